//! Spawns the real `kvq serve` binary on an ephemeral port for tests that talk to it over TCP
//! (curl, the openai Python client), and kills it when dropped.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The `kvq` binary next to the test executable (`cargo build --release` builds it), or `$KVQ_BIN`.
pub fn kvq_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVQ_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    // target/<profile>/deps/<test> -> target/<profile>/kvq
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("kvq"))
        .unwrap_or_default();
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build --release --bin kvq)",
        p.display()
    );
    p
}

/// A running `kvq serve`.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Everything the server wrote to stderr so far.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `kvq serve --port 0` with extra `args`, waiting until it listens.
    pub fn start(args: &[&str]) -> Server {
        Self::start_on("127.0.0.1", args, &[])
    }

    /// Starts `kvq serve --host HOST --port 0` with extra `args` and environment `env`.
    pub fn start_on(host: &str, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(kvq_bin())
            .arg("serve")
            .args(["--host", host, "--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            // A key in the developer's environment would lock every other test out.
            .env_remove("KVQ_API_KEY")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start kvq: {e}"));
        let stderr = child.stderr.take().expect("piped stderr");
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("kvq listening on ") {
                    let url = line[i + "kvq listening on ".len()..].trim().to_string();
                    let _ = tx.send(url);
                }
                log2.lock().map(|mut l| l.push(line)).ok();
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(url) => url,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "kvq serve did not start: {:?}",
                    log.lock().map(|l| l.clone())
                );
            }
        };
        Server { child, base, log }
    }

    /// Waits up to `timeout` for the process to exit on its own; its status, or None.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < end {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
