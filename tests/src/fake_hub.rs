//! A Hugging Face Hub on loopback, for testing `--model org/repo` without the internet. It
//! serves what hf-hub and huggingface_hub read: the listing `GET
//! /api/models/{repo}/revision/{rev}` (commit, files with size, blob id, LFS sha256), and
//! `GET /{repo}/resolve/{rev}/{file}` with `x-repo-commit` and `ETag`; large (LFS) files
//! answer with a 302 to a second host (the "CDN", `localhost` where the Hub is `127.0.0.1`) carrying
//! `x-linked-etag` and `x-linked-size`, and both honor `Range` with `206` and `Content-Range`.
//! Errors carry the Hub's `x-error-code`: a missing repo is `401 RepoNotFound` (what the Hub
//! answers a client without a token), a gated repo without its token `401 GatedRepo`. Faults
//! can cut or stall a file's transfer at a byte, or corrupt one byte of it.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::get;
use futures::StreamExt;
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One file of a fixture repository.
pub struct HubFile {
    pub path: String,
    pub data: Bytes,
    /// Stored in LFS: listed with its sha256 and served through the CDN redirect.
    pub lfs: bool,
}

/// A fixture repository at one commit (`main` points to it).
pub struct HubRepo {
    pub id: String,
    pub commit: String,
    pub files: Vec<HubFile>,
    /// Gated: file downloads need `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

/// Something to go wrong with one file's bytes on the CDN.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Drop the connection once the transfer reaches byte `at`, the next `times` times.
    Cut { file: String, at: u64, times: usize },
    /// Send up to byte `at`, then nothing more, ever.
    Stall { file: String, at: u64 },
    /// Flip the bits of byte `at` in every transfer that covers it.
    Corrupt { file: String, at: u64 },
}

/// A body request the CDN served (probes of one byte are left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub file: String,
    pub start: u64,
    pub end: u64,
}

struct Blob {
    repo: usize,
    file: usize,
}

struct Inner {
    repos: Vec<HubRepo>,
    /// LFS sha256 -> the file.
    blobs: HashMap<String, Blob>,
    cdn: String,
    faults: Mutex<Vec<Fault>>,
    served: Mutex<Vec<Served>>,
    sent: Mutex<HashMap<String, u64>>,
    requests: Mutex<usize>,
}

/// The running fake Hub; stopped (every connection dropped) when dropped.
pub struct FakeHub {
    /// For `HF_ENDPOINT`.
    pub endpoint: String,
    inner: Arc<Inner>,
    rt: Option<tokio::runtime::Runtime>,
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A blob id for a file outside LFS: the Hub's is git's sha1; a stand-in of the same form
/// serves (clients only name the cached blob by it).
fn blob_id(data: &[u8]) -> String {
    sha256_hex(data)[..40].to_string()
}

impl FakeHub {
    /// Serves `repos` on two loopback ports (Hub and CDN).
    pub fn start(repos: Vec<HubRepo>) -> FakeHub {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let bind = || {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.set_nonblocking(true).expect("nonblocking");
            l
        };
        let (hub, cdn) = (bind(), bind());
        let url = |l: &std::net::TcpListener| format!("http://{}", l.local_addr().expect("addr"));
        let mut blobs = HashMap::new();
        for (r, repo) in repos.iter().enumerate() {
            for (f, file) in repo.files.iter().enumerate() {
                if file.lfs {
                    blobs.insert(sha256_hex(&file.data), Blob { repo: r, file: f });
                }
            }
        }
        // The CDN under another host name, as the Hub's are: clients follow only redirects that
        // stay on the Hub's host, and read the file's metadata from the redirect itself.
        let cdn_port = cdn.local_addr().expect("addr").port();
        let inner = Arc::new(Inner {
            repos,
            blobs,
            cdn: format!("http://localhost:{cdn_port}"),
            faults: Mutex::new(Vec::new()),
            served: Mutex::new(Vec::new()),
            sent: Mutex::new(HashMap::new()),
            requests: Mutex::new(0),
        });
        let endpoint = url(&hub);
        let hub_app = Router::new()
            .route("/api/models/{org}/{name}/revision/{*rev}", get(listing))
            .route("/{org}/{name}/resolve/{rev}/{*path}", get(resolve))
            .with_state(inner.clone());
        let cdn_app = Router::new()
            .route("/cdn/{sha}", get(cdn_blob))
            .with_state(inner.clone());
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(hub).expect("listener");
            axum::serve(l, hub_app).await.expect("hub serves");
        });
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(cdn).expect("listener");
            axum::serve(l, cdn_app).await.expect("cdn serves");
        });
        FakeHub {
            endpoint,
            inner,
            rt: Some(rt),
        }
    }

    /// Adds a fault.
    pub fn fault(&self, fault: Fault) {
        self.inner.faults.lock().expect("lock").push(fault);
    }

    /// Removes every fault.
    pub fn clear_faults(&self) {
        self.inner.faults.lock().expect("lock").clear();
    }

    /// Body bytes of `file` that left the CDN so far.
    pub fn bytes_sent(&self, file: &str) -> u64 {
        let sent = self.inner.sent.lock().expect("lock");
        sent.get(file).copied().unwrap_or(0)
    }

    /// The body requests for `file`, in order.
    pub fn served(&self, file: &str) -> Vec<Served> {
        let served = self.inner.served.lock().expect("lock");
        served.iter().filter(|s| s.file == file).cloned().collect()
    }

    /// Requests to the Hub and the CDN together.
    pub fn requests(&self) -> usize {
        *self.inner.requests.lock().expect("lock")
    }

    /// The sha256 of a fixture file, as the listing gives it.
    pub fn sha256(&self, repo: &str, file: &str) -> Option<String> {
        let r = self.inner.repos.iter().find(|r| r.id == repo)?;
        let f = r.files.iter().find(|f| f.path == file)?;
        Some(sha256_hex(&f.data))
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn count(state: &Inner) {
    *state.requests.lock().expect("lock") += 1;
}

/// A Hub error answer: status, `x-error-code` and message.
fn hub_error(status: StatusCode, code: &str, message: &str) -> Response {
    Response::builder()
        .status(status)
        .header("x-error-code", code)
        .header("x-error-message", message)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "error": message }).to_string()))
        .expect("response")
}

/// The repository `org/name` at `rev`, or the Hub's error for it.
fn find<'a>(
    state: &'a Inner,
    org: &str,
    name: &str,
    rev: &str,
) -> Result<&'a HubRepo, Box<Response>> {
    let id = format!("{org}/{name}");
    let repo = state.repos.iter().find(|r| r.id == id).ok_or_else(|| {
        Box::new(hub_error(
            StatusCode::UNAUTHORIZED,
            "RepoNotFound",
            "Repository Not Found for url: the repository does not exist or is private",
        ))
    })?;
    if rev != "main" && rev != repo.commit {
        return Err(Box::new(hub_error(
            StatusCode::NOT_FOUND,
            "RevisionNotFound",
            &format!("Invalid rev id: {rev}"),
        )));
    }
    Ok(repo)
}

async fn listing(
    State(state): State<Arc<Inner>>,
    Path((org, name, rev)): Path<(String, String, String)>,
) -> Response {
    count(&state);
    let repo = match find(&state, &org, &name, &rev) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    let siblings: Vec<serde_json::Value> = repo
        .files
        .iter()
        .map(|f| {
            let size = f.data.len();
            let mut s = json!({"rfilename": f.path, "blobId": blob_id(&f.data), "size": size});
            if f.lfs {
                s["lfs"] = json!({"sha256": sha256_hex(&f.data), "size": size, "pointerSize": 134});
            }
            s
        })
        .collect();
    let body = json!({
        "id": repo.id, "sha": repo.commit, "private": false,
        "gated": if repo.token.is_some() { json!("manual") } else { json!(false) },
        "siblings": siblings,
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("response")
}

async fn resolve(
    State(state): State<Arc<Inner>>,
    Path((org, name, rev, path)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    count(&state);
    let repo = match find(&state, &org, &name, &rev) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    if let Some(token) = &repo.token {
        let sent = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if sent != Some(format!("Bearer {token}").as_str()) {
            return hub_error(
                StatusCode::UNAUTHORIZED,
                "GatedRepo",
                &format!(
                    "Access to model {} is restricted. You must have access to it and be \
                     authenticated to access it. Please log in.",
                    repo.id
                ),
            );
        }
    }
    let Some(file) = repo.files.iter().find(|f| f.path == path) else {
        return hub_error(
            StatusCode::NOT_FOUND,
            "EntryNotFound",
            &format!("{path} does not exist on \"{rev}\""),
        );
    };
    if file.lfs {
        let sha = sha256_hex(&file.data);
        return Response::builder()
            .status(StatusCode::FOUND)
            .header(header::LOCATION, format!("{}/cdn/{sha}", state.cdn))
            .header("x-repo-commit", &repo.commit)
            .header("x-linked-etag", format!("\"{sha}\""))
            .header("x-linked-size", file.data.len())
            .header(header::ETAG, format!("\"{}\"", blob_id(sha.as_bytes())))
            .body(Body::empty())
            .expect("response");
    }
    let mut r = ranged(&state, &file.path, &file.data, &headers);
    r.headers_mut()
        .insert("x-repo-commit", repo.commit.parse().expect("header value"));
    r.headers_mut().insert(
        header::ETAG,
        format!("\"{}\"", blob_id(&file.data))
            .parse()
            .expect("header value"),
    );
    r
}

async fn cdn_blob(
    State(state): State<Arc<Inner>>,
    Path(sha): Path<String>,
    headers: HeaderMap,
) -> Response {
    count(&state);
    let Some(blob) = state.blobs.get(&sha) else {
        return hub_error(StatusCode::NOT_FOUND, "NotFound", "no such blob");
    };
    let file = &state.repos[blob.repo].files[blob.file];
    ranged(&state, &file.path, &file.data, &headers)
}

/// `bytes=a-b` or `bytes=a-` against `len`, clamped as RFC 9110 says; `Err` if unsatisfiable.
fn parse_range(headers: &HeaderMap, len: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = headers
        .get(header::RANGE)?
        .to_str()
        .ok()?
        .strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let start: u64 = a.trim().parse().ok()?;
    let end = match b.trim() {
        "" => len.saturating_sub(1),
        b => b.parse::<u64>().ok()?.min(len.saturating_sub(1)),
    };
    Some(if start >= len || end < start {
        Err(())
    } else {
        Ok((start, end))
    })
}

/// `data` in full (200) or the requested range (206), streamed in pieces through the faults.
fn ranged(state: &Arc<Inner>, file: &str, data: &Bytes, headers: &HeaderMap) -> Response {
    let len = data.len() as u64;
    let (status, start, end) = match parse_range(headers, len) {
        None => (StatusCode::OK, 0, len.saturating_sub(1)),
        Some(Ok((a, b))) => (StatusCode::PARTIAL_CONTENT, a, b),
        Some(Err(())) => {
            return Response::builder()
                .status(StatusCode::RANGE_NOT_SATISFIABLE)
                .header(header::CONTENT_RANGE, format!("bytes */{len}"))
                .body(Body::empty())
                .expect("response");
        }
    };
    if end > start {
        state.served.lock().expect("lock").push(Served {
            file: file.to_string(),
            start,
            end,
        });
    }
    let body = stream_body(
        state.clone(),
        file.to_string(),
        data.slice(start as usize..=end as usize),
        start,
    );
    let mut b = Response::builder()
        .status(status)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CONTENT_LENGTH, end - start + 1);
    if status == StatusCode::PARTIAL_CONTENT {
        b = b.header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{len}"));
    }
    b.body(body).expect("response")
}

/// The bytes `part` (starting at `offset` of `file`) in 256 KiB pieces, with the faults on
/// `file` applied and every byte sent counted.
fn stream_body(state: Arc<Inner>, file: String, part: Bytes, offset: u64) -> Body {
    const PIECE: usize = 256 * 1024;
    let end = offset + part.len() as u64;
    // What to do at which byte, decided once per transfer.
    let mut stop: Option<(u64, bool)> = None; // (at, cut: else stall)
    let mut flip: Option<u64> = None;
    {
        let mut faults = state.faults.lock().expect("lock");
        for f in faults.iter_mut() {
            match f {
                Fault::Cut { file: n, at, times }
                    if *n == file && *times > 0 && (offset..end).contains(at) =>
                {
                    *times -= 1;
                    stop = Some((*at, true));
                }
                Fault::Stall { file: n, at } if *n == file && (offset..end).contains(at) => {
                    stop = Some((*at, false));
                }
                Fault::Corrupt { file: n, at } if *n == file && (offset..end).contains(at) => {
                    flip = Some(*at);
                }
                _ => {}
            }
        }
    }
    let mut data = part.to_vec();
    if let Some(at) = flip {
        data[(at - offset) as usize] ^= 0xff;
    }
    let limit = stop.map_or(data.len(), |(at, _)| (at - offset) as usize);
    let pieces: Vec<Bytes> = Bytes::from(data)
        .slice(..limit)
        .chunks(PIECE)
        .map(Bytes::copy_from_slice)
        .collect();
    let sent_state = state.clone();
    let name = file.clone();
    let head = futures::stream::iter(pieces).then(move |p| {
        let state = sent_state.clone();
        let name = name.clone();
        async move {
            *state.sent.lock().expect("lock").entry(name).or_insert(0) += p.len() as u64;
            // Slow enough that a test can act in the middle of a transfer.
            tokio::time::sleep(std::time::Duration::from_micros(200)).await;
            Ok::<Bytes, std::io::Error>(p)
        }
    });
    let tail: futures::stream::BoxStream<'static, Result<Bytes, std::io::Error>> = match stop {
        None => futures::stream::empty().boxed(),
        Some((_, true)) => futures::stream::once(async {
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "cut by the test",
            ))
        })
        .boxed(),
        Some((_, false)) => futures::stream::pending().boxed(),
    };
    Body::from_stream(head.chain(tail))
}

/// A loopback port that counts the connections made to it and answers none: what
/// `HF_ENDPOINT` points at when a test must show that nothing was requested.
pub struct Tripwire {
    pub endpoint: String,
    count: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Tripwire {
    pub fn start() -> Tripwire {
        use std::sync::atomic::Ordering;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.set_nonblocking(true).expect("nonblocking");
        let endpoint = format!("http://{}", l.local_addr().expect("addr"));
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, s) = (count.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok(_) => {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        });
        Tripwire {
            endpoint,
            count,
            stop,
        }
    }

    /// Connections so far.
    pub fn connections(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
