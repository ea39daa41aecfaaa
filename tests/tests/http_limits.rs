//! Connection limits of the real `kvq serve` binary, over raw TCP: a client that does not
//! finish its headers within `--header-timeout` is disconnected, a head larger than
//! `--max-header-bytes` gets 431, and past `--max-connections` a new connection waits until
//! one closes; the server answers normally throughout.

use kvq_tests::default_gguf;
use kvq_tests::server::Server;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn addr(server: &Server) -> String {
    server.base.trim_start_matches("http://").to_string()
}

/// Sends `request` on a new connection and reads until the server closes it or `wait` passes:
/// what came back.
fn exchange(addr: &str, request: &[u8], wait: Duration) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(wait)).expect("timeout");
    s.write_all(request).expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: kvq\r\nConnection: close\r\n\r\n";

#[test]
fn slow_heads_and_huge_heads_are_refused() {
    let model = default_gguf();
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--header-timeout",
        "1",
        "--max-header-bytes",
        "16384",
    ]);
    let a = addr(&server);
    // Half a request head, then silence: closed after about a second.
    let start = Instant::now();
    let got = exchange(
        &a,
        b"GET /health HTTP/1.1\r\nHost: kvq\r\n",
        Duration::from_secs(10),
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(8),
        "closed after {took:?}: {got:?}"
    );
    assert!(!got.contains("200 OK"), "{got}");
    // A 40 KB header: 431.
    let big = format!(
        "GET /health HTTP/1.1\r\nHost: kvq\r\nX-Big: {}\r\n\r\n",
        "y".repeat(40_000)
    );
    let got = exchange(&a, big.as_bytes(), Duration::from_secs(10));
    assert!(got.starts_with("HTTP/1.1 431"), "{got:?}");
    // And a normal request is answered.
    let got = exchange(&a, HEALTH, Duration::from_secs(10));
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
}

#[test]
fn connections_past_the_cap_wait_for_a_free_one() {
    let model = default_gguf();
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--max-connections",
        "2",
    ]);
    let a = addr(&server);
    let first = TcpStream::connect(&a).expect("first");
    let second = TcpStream::connect(&a).expect("second");
    // Let the server take both before the third arrives.
    std::thread::sleep(Duration::from_millis(300));
    let a3 = a.clone();
    let third = std::thread::spawn(move || {
        let start = Instant::now();
        let got = exchange(&a3, HEALTH, Duration::from_secs(20));
        (got, start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(1500));
    drop(first);
    let (got, took) = third.join().expect("third");
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    assert!(
        took >= Duration::from_millis(1300),
        "the third connection was served after {took:?}, while two were open"
    );
    drop(second);
}
