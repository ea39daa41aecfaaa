//! Getting one file of a repository at a commit into the hub cache: already there (its size
//! checked), its blob already there under another commit (linked), or downloaded through
//! hf-hub, which writes `blobs/<etag>` and the snapshot's link and resumes a partial download
//! from its last finished chunk. Around hf-hub: retries that resume, a fresh runtime per try
//! (hf-hub's chunk tasks outlive a failed try and would download on), and the size and sha256
//! check of what arrived.

use crate::listing::{Sibling, api, error_chain, status_error};
use crate::{HubConfig, HubError, HubId};
use hf_hub::api::tokio::ApiError;
use hf_hub::{Cache, CacheRepo, Repo, RepoType};
use indicatif::ProgressBar;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Fetches files of one repository at one commit.
pub(crate) struct Fetcher<'a> {
    cfg: &'a HubConfig,
    id: &'a HubId,
    commit: String,
    cache: CacheRepo,
    /// Bytes that came over the network (resumed tries count what they added).
    pub downloaded: u64,
}

/// How one try ended when it did not succeed.
enum Failure {
    /// Worth another try, which resumes: no answer, a cut connection, a 5xx.
    Transient(String),
    Fatal(Box<HubError>),
}

impl<'a> Fetcher<'a> {
    pub fn new(cfg: &'a HubConfig, id: &'a HubId, commit: &str) -> Self {
        let repo = Repo::with_revision(id.repo.clone(), RepoType::Model, commit.into());
        Self {
            cfg,
            id,
            commit: commit.into(),
            cache: Cache::new(cfg.cache_dir.clone()).repo(repo),
            downloaded: 0,
        }
    }

    /// Where `file` lives in this commit's snapshot.
    pub fn pointer(&self, file: &str) -> PathBuf {
        self.cache.pointer_path(&self.commit).join(file)
    }

    /// This commit's snapshot directory.
    pub fn snapshot(&self) -> PathBuf {
        self.cache.pointer_path(&self.commit)
    }

    /// Makes `file` present in the snapshot and returns its path.
    pub async fn fetch(&mut self, file: &Sibling) -> Result<PathBuf, HubError> {
        let pointer = self.pointer(&file.rfilename);
        if self.present(&pointer, file)? || self.link_blob(&pointer, file)? {
            return Ok(pointer);
        }
        let size = file
            .size()
            .map_or_else(String::new, |s| format!(" ({})", mib(s)));
        tracing::info!(repo = %self.id.repo, "downloading {}{size} from {}", file.rfilename, self.cfg.endpoint);
        let started = std::time::Instant::now();
        let mut attempt = 1;
        loop {
            let before = partial_len(&self.cache, file);
            let result = self.try_once(&file.rfilename).await;
            self.downloaded += fs_len(&pointer)
                .or_else(|| partial_len(&self.cache, file))
                .unwrap_or(0)
                .saturating_sub(before.unwrap_or(0));
            match result {
                Ok(()) => break,
                Err(Failure::Fatal(e)) => return Err(*e),
                Err(Failure::Transient(reason)) if attempt < self.cfg.attempts => {
                    tracing::warn!(
                        repo = %self.id.repo,
                        "download of {} interrupted ({reason}); resuming (try {} of {})",
                        file.rfilename, attempt + 1, self.cfg.attempts
                    );
                    tokio::time::sleep(Duration::from_millis(250 << attempt.min(5))).await;
                    attempt += 1;
                    // Another process may have finished it meanwhile.
                    if self.link_blob(&pointer, file)? {
                        return Ok(pointer);
                    }
                }
                Err(Failure::Transient(reason)) => {
                    return Err(HubError::Download {
                        repo: self.id.repo.clone(),
                        file: file.rfilename.clone(),
                        attempts: attempt,
                        reason: format!("{reason}; run again to resume it"),
                    });
                }
            }
        }
        if !pointer.is_file() {
            return Err(HubError::Http {
                repo: self.id.repo.clone(),
                status: 200,
                what: file.rfilename.clone(),
                detail: format!(
                    ", but not as commit {} (x-repo-commit differs)",
                    self.commit
                ),
            });
        }
        self.verify(&pointer, file).await?;
        // hf-hub leaves `blobs/<etag>.lock` behind; the blob is complete, so nobody waits on it.
        if let Ok(mut lock) = std::fs::canonicalize(&pointer) {
            lock.set_extension("lock");
            let _ = std::fs::remove_file(lock);
        }
        tracing::info!(repo = %self.id.repo, secs = format_args!("{:.1}", started.elapsed().as_secs_f64()), "downloaded {}", file.rfilename);
        Ok(pointer)
    }

    /// One hf-hub download on a runtime of its own, dropped afterwards with whatever chunk
    /// tasks a failure left running.
    async fn try_once(&self, file: &str) -> Result<(), Failure> {
        let (cfg, id) = (self.cfg.clone(), self.id.clone());
        let (commit, name) = (self.commit.clone(), file.to_string());
        tokio::task::spawn_blocking(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Failure::Transient(format!("no runtime: {e}")))?;
            let got = rt.block_on(async {
                let api = api(&cfg).map_err(|e| Failure::Fatal(Box::new(e)))?;
                let repo = api.repo(Repo::with_revision(
                    id.repo.clone(),
                    RepoType::Model,
                    commit,
                ));
                let got = match cfg.progress {
                    true => {
                        repo.download_with_progress(&name, ProgressBar::new(0))
                            .await
                    }
                    false => repo.download_with_progress(&name, ()).await,
                };
                got.map(drop)
                    .map_err(|e| Failure::from_api(e, &cfg, &id, &name))
            });
            drop(rt);
            got
        })
        .await
        .unwrap_or_else(|e| Err(Failure::Transient(format!("the download task failed: {e}"))))
    }

    /// Whether `pointer` is there with the size the Hub gives; a wrong size removes it (and its
    /// blob) so it is fetched again.
    fn present(&self, pointer: &Path, file: &Sibling) -> Result<bool, HubError> {
        let Some(len) = fs_len(pointer) else {
            return Ok(false);
        };
        match file.size() {
            Some(want) if want != len => {
                tracing::warn!(repo = %self.id.repo, "{} in the cache has {len} bytes, the Hub says {want}; fetching it again", file.rfilename);
                remove_with_blob(pointer);
                Ok(false)
            }
            _ => Ok(true),
        }
    }

    /// Links `pointer` to the blob the Hub names for `file` when the cache has it complete
    /// (downloaded for another commit or by another tool).
    fn link_blob(&self, pointer: &Path, file: &Sibling) -> Result<bool, HubError> {
        let Some(name) = file.blob_name() else {
            return Ok(false);
        };
        let blob = self.cache.blob_path(name);
        match (fs_len(&blob), file.size()) {
            (Some(len), Some(want)) if len == want => {}
            _ => return Ok(false),
        }
        if let Some(dir) = pointer.parent() {
            std::fs::create_dir_all(dir).map_err(HubError::io(dir))?;
        }
        let _ = std::fs::remove_file(pointer);
        link(&blob, pointer, &file.rfilename).map_err(HubError::io(pointer))?;
        tracing::info!(repo = %self.id.repo, "{} is already in the cache", file.rfilename);
        Ok(true)
    }

    /// The size and, for LFS files, the sha256 the Hub gives; a mismatch deletes the file.
    async fn verify(&self, pointer: &Path, file: &Sibling) -> Result<(), HubError> {
        let corrupt = |what, expected: String, got: String| {
            remove_with_blob(pointer);
            HubError::Corrupt {
                repo: self.id.repo.clone(),
                file: file.rfilename.clone(),
                what,
                expected,
                got,
            }
        };
        let len = fs_len(pointer).unwrap_or(0);
        if let Some(want) = file.size()
            && want != len
        {
            return Err(corrupt("size", want.to_string(), len.to_string()));
        }
        let Some(want) = file.lfs.as_ref().map(|l| l.sha256.to_ascii_lowercase()) else {
            return Ok(());
        };
        let path = pointer.to_path_buf();
        let got = tokio::task::spawn_blocking(move || sha256_file(&path))
            .await
            .map_err(|e| HubError::BadSpec(format!("the hashing task failed: {e}")))?
            .map_err(HubError::io(pointer))?;
        if got != want {
            return Err(corrupt("sha256", want, got));
        }
        Ok(())
    }
}

impl Failure {
    fn from_api(e: ApiError, cfg: &HubConfig, id: &HubId, file: &str) -> Failure {
        match e {
            ApiError::RequestError(e) => match e.status().map(|s| s.as_u16()) {
                None => Failure::Transient(error_chain(&e)),
                Some(s) if s >= 500 || s == 408 || s == 429 => {
                    Failure::Transient(format!("HTTP {s}"))
                }
                Some(status) => Failure::Fatal(Box::new(status_error(
                    cfg,
                    id,
                    Some(file),
                    status,
                    None,
                    None,
                ))),
            },
            ApiError::TooManyRetries(inner) => Failure::from_api(*inner, cfg, id, file),
            ApiError::LockAcquisition(p) => Failure::Transient(format!(
                "{} is locked: another process is downloading it",
                p.display()
            )),
            ApiError::IoError(e) => Failure::Fatal(Box::new(HubError::Io {
                path: cfg.cache_dir.clone(),
                source: e,
            })),
            other => Failure::Fatal(Box::new(HubError::BadSpec(format!(
                "{}: the Hub's answer for {file} was not usable ({other}); is HF_ENDPOINT a \
                 Hugging Face Hub?",
                id.repo
            )))),
        }
    }
}

/// The length of the file at `path` (following links), if it is one.
fn fs_len(path: &Path) -> Option<u64> {
    std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len())
}

/// What a partial hf-hub download of `file` holds so far (its `.sync.part` file, whose last 8
/// bytes count what is committed), for the byte count only.
fn partial_len(cache: &CacheRepo, file: &Sibling) -> Option<u64> {
    let mut part = cache.blob_path(file.blob_name()?);
    part.set_extension("sync.part");
    let mut f = std::fs::File::open(part).ok()?;
    let len = f.metadata().ok()?.len();
    let mut tail = [0u8; 8];
    use std::io::Seek;
    f.seek(std::io::SeekFrom::Start(len.checked_sub(8)?)).ok()?;
    f.read_exact(&mut tail).ok()?;
    Some(u64::from_le_bytes(tail).min(len))
}

/// Removes a snapshot link and the blob it points to.
fn remove_with_blob(pointer: &Path) {
    if let Ok(blob) = std::fs::canonicalize(pointer) {
        let _ = std::fs::remove_file(blob);
    }
    let _ = std::fs::remove_file(pointer);
}

/// Points `pointer` (`snapshots/<commit>/<file>`) at `blob` (`blobs/<etag>`) by a relative
/// link, as huggingface_hub does; a copy where links are not available.
fn link(blob: &Path, pointer: &Path, file: &str) -> std::io::Result<()> {
    let ups = 1 + file.split('/').count();
    let name = blob.file_name().unwrap_or_default();
    let target: PathBuf = std::iter::repeat_n(Path::new(".."), ups)
        .collect::<PathBuf>()
        .join("blobs")
        .join(name);
    #[cfg(unix)]
    {
        let _ = blob;
        std::os::unix::fs::symlink(target, pointer)
    }
    #[cfg(not(unix))]
    {
        let _ = target;
        std::fs::copy(blob, pointer).map(drop)
    }
}

/// The lowercase hex sha256 of the file at `path`.
pub(crate) fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `n` bytes as MiB for logs.
fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1024.0 * 1024.0))
}
