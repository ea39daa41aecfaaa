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
    /// `http://127.0.0.1:PORT` (empty until it listens).
    pub base: String,
    /// Everything the server wrote to stderr so far.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    listening: mpsc::Receiver<String>,
}

impl Server {
    /// Starts `kvq serve --port 0` with extra `args`, waiting until it listens.
    pub fn start(args: &[&str]) -> Server {
        Self::start_on("127.0.0.1", args, &[])
    }

    /// Starts `kvq serve --host HOST --port 0` with extra `args` and environment `env`.
    pub fn start_on(host: &str, args: &[&str], env: &[(&str, &str)]) -> Server {
        let env: Vec<(&str, Option<&str>)> = env.iter().map(|(k, v)| (*k, Some(*v))).collect();
        Self::start_at(host, args, &env)
    }

    /// [`Server::start`] with environment changes: `(name, Some(value))` sets, `None` removes.
    pub fn start_with(args: &[&str], env: &[(&str, Option<&str>)]) -> Server {
        Self::start_at("127.0.0.1", args, env)
    }

    fn start_at(host: &str, args: &[&str], env: &[(&str, Option<&str>)]) -> Server {
        let mut server = Self::spawn_at(host, args, env);
        if !server.wait_listening(Duration::from_secs(120)) {
            let _ = server.child.kill();
            panic!("kvq serve did not start: {}", server.log_text());
        }
        server
    }

    /// Starts `kvq serve --port 0` with `args` and `env` without waiting for it.
    pub fn spawn_with(args: &[&str], env: &[(&str, Option<&str>)]) -> Server {
        Self::spawn_at("127.0.0.1", args, env)
    }

    fn spawn_at(host: &str, args: &[&str], env: &[(&str, Option<&str>)]) -> Server {
        let mut cmd = Command::new(kvq_bin());
        cmd.arg("serve")
            .args(["--host", host, "--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            // A key in the developer's environment would lock every other test out.
            .env_remove("KVQ_API_KEY");
        apply_env(&mut cmd, env);
        let mut child = cmd
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
        Server {
            child,
            base: String::new(),
            log,
            listening: rx,
        }
    }

    /// Waits up to `timeout` for the server to listen; false if it did not (or exited).
    pub fn wait_listening(&mut self, timeout: Duration) -> bool {
        match self.listening.recv_timeout(timeout) {
            Ok(url) => {
                self.base = url;
                true
            }
            Err(_) => false,
        }
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

    /// Everything the server logged so far, one string.
    pub fn log_text(&self) -> String {
        self.log.lock().map(|l| l.join("\n")).unwrap_or_default()
    }
}

fn apply_env(cmd: &mut Command, env: &[(&str, Option<&str>)]) {
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
}

/// How a `kvq` run ended.
pub struct Run {
    /// The exit code; None when it was killed at the timeout.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `kvq ARGS` to its end (killed after `timeout`).
pub fn run_kvq(args: &[&str], env: &[(&str, Option<&str>)], timeout: Duration) -> Run {
    let mut cmd = Command::new(kvq_bin());
    cmd.args(args).env("RUST_LOG", "info");
    apply_env(&mut cmd, env);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("could not start kvq: {e}"));
    // Read as it comes, so a chatty child never blocks on a full pipe.
    fn reader(
        pipe: Option<impl std::io::Read + Send + 'static>,
    ) -> Option<std::thread::JoinHandle<String>> {
        pipe.map(|mut p| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = p.read_to_string(&mut text);
                text
            })
        })
    }
    let (out, err) = (reader(child.stdout.take()), reader(child.stderr.take()));
    let started = std::time::Instant::now();
    let code = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.code(),
            Ok(None) if started.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(50))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let text = |r: Option<std::thread::JoinHandle<String>>| {
        r.and_then(|r| r.join().ok()).unwrap_or_default()
    };
    Run {
        code,
        stdout: text(out),
        stderr: text(err),
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
