//! Replicas behind a load balancer: two `kvq serve` processes and Debian's `haproxy` with
//! docker/haproxy.cfg on loopback (what docker/compose.yaml runs). A conversation's turns land on
//! one replica (their `cached_tokens` show its prefix cache held the earlier turns), whether it
//! is keyed by an `x-session-id` header, the body's `user` or its first message; the
//! conversations spread over both replicas; stopping one replica while requests are in flight
//! loses none of them (those it was streaming finish in its drain, the rest are retried on the
//! other), and the survivor serves what follows.

use kvq_tests::server::Server;
use kvq_tests::{default_gguf, workspace_root};
use serde_json::{Value, json};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running haproxy, killed on drop.
struct Balancer(Child);

impl Drop for Balancer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn port(base: &str) -> &str {
    base.rsplit(':').next().expect("port")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

fn start_balancer(replicas: [&str; 2]) -> (Balancer, String) {
    let lb = free_port();
    let cfg = workspace_root().join("docker/haproxy.cfg");
    let child = Command::new("haproxy")
        .args(["-db", "-f"])
        .arg(&cfg)
        .env("KVQ_LB_BIND", format!("127.0.0.1:{lb}"))
        .env("KVQ_REPLICA_1", format!("127.0.0.1:{}", port(replicas[0])))
        .env("KVQ_REPLICA_2", format!("127.0.0.1:{}", port(replicas[1])))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("could not run haproxy ({e}): install it (apt-get install haproxy; scripts/test does)")
        });
    (Balancer(child), format!("http://127.0.0.1:{lb}"))
}

/// `kvq_requests_total` of one replica's chat route, all statuses.
async fn chat_requests(client: &reqwest::Client, base: &str) -> u64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with("kvq_requests_total") && l.contains("/v1/chat/completions"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// One conversation's request: keyed by a header, the `user` field, or nothing.
fn chat(
    client: &reqwest::Client,
    lb: &str,
    key: &Key,
    messages: &[Value],
    stream: bool,
) -> reqwest::RequestBuilder {
    let mut body =
        json!({"messages": messages, "max_tokens": 8, "temperature": 0, "stream": stream});
    let mut req = client.post(format!("{lb}/v1/chat/completions"));
    match key {
        Key::Header(id) => req = req.header("x-session-id", id),
        Key::User(u) => body["user"] = json!(u),
        Key::FirstMessage => {}
    }
    req.json(&body)
}

enum Key {
    Header(String),
    User(String),
    FirstMessage,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conversations_stay_on_one_replica_and_survive_one_going_away() {
    let model = default_gguf();
    let args = [
        "--model",
        model.to_str().expect("path"),
        "--shutdown-grace",
        "60",
    ];
    let a = Server::start(&args);
    let b = Server::start(&args);
    let (_lb, lb) = start_balancer([&a.base, &b.base]);
    let client = reqwest::Client::new();
    // Until the balancer listens and its health checks passed twice (rise 2, every 1 s).
    let t0 = Instant::now();
    loop {
        let ok = client.get(format!("{lb}/health")).send().await;
        if ok.is_ok_and(|r| r.status() == 200) && t0.elapsed() > Duration::from_secs(3) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the balancer never answered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Twelve conversations of three turns, keyed each of the three ways.
    let topics = [
        "rivers",
        "comets",
        "violins",
        "deserts",
        "glaciers",
        "owls",
        "bridges",
        "tea",
        "volcanoes",
        "chess",
        "coral",
        "lanterns",
    ];
    for (i, topic) in topics.iter().enumerate() {
        let key = match i % 3 {
            0 => Key::Header(format!("conv-{i}")),
            1 => Key::User(format!("user-{i}")),
            _ => Key::FirstMessage,
        };
        let mut messages = vec![
            json!({"role": "system", "content": "You answer in one short sentence."}),
            json!({"role": "user", "content": format!("Tell me one fact about {topic}.")}),
        ];
        for turn in 0..3 {
            let v: Value = chat(&client, &lb, &key, &messages, false)
                .send()
                .await
                .expect("post")
                .json()
                .await
                .expect("json");
            let reply = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("{topic} turn {turn}: {v}"))
                .to_string();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
            if turn > 0 {
                assert!(
                    cached.is_some_and(|c| c > 0),
                    "{topic} turn {turn} found no held prefix: another replica? {v}"
                );
            }
            messages.push(json!({"role": "assistant", "content": reply}));
            messages.push(json!({"role": "user", "content": "Another one, please."}));
        }
    }
    let (na, nb) = (
        chat_requests(&client, &a.base).await,
        chat_requests(&client, &b.base).await,
    );
    assert_eq!(na + nb, 36, "every turn reached a replica once");
    assert!(
        na > 0 && nb > 0,
        "conversations did not spread: {na} and {nb}"
    );

    // Sixteen streams at once, then replica `a` is told to stop while they run.
    let streams: Vec<_> = (0..16)
        .map(|i| {
            let key = Key::Header(format!("burst-{i}"));
            let messages =
                [json!({"role": "user", "content": format!("Count from {i} to {}.", i + 20)})];
            let req = chat(&client, &lb, &key, &messages, true);
            tokio::spawn(async move {
                let r = req.send().await.map_err(|e| e.to_string())?;
                let status = r.status();
                let text = r.text().await.map_err(|e| e.to_string())?;
                Ok::<_, String>((status, text))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = Command::new("kill")
        .args(["-TERM", &a.pid().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    for (i, s) in streams.into_iter().enumerate() {
        let (status, text) = s
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("stream {i}: {e}"));
        assert_eq!(status, 200, "stream {i}: {text}");
        assert!(
            text.contains("\"finish_reason\":\"") && text.trim_end().ends_with("data: [DONE]"),
            "stream {i} did not finish: {text}"
        );
        assert!(!text.contains("event: error"), "stream {i}: {text}");
    }
    // After it: every conversation is served by the survivor, `a`'s ones included.
    for i in 0..6 {
        let key = Key::Header(format!("after-{i}"));
        let messages = [json!({"role": "user", "content": "Name a color."})];
        let r = chat(&client, &lb, &key, &messages, false)
            .send()
            .await
            .expect("post");
        assert_eq!(r.status(), 200, "after the stop, request {i}");
    }
    let mut a = a;
    let status = a.wait_exit(Duration::from_secs(90));
    assert!(
        status.is_some_and(|s| s.success()),
        "the stopped replica did not drain and exit: {status:?}"
    );
    drop(b);
}
