//! `AppState`, what every handler shares: the engine handle, the cache registry, the metrics
//! handle, the server's request limits and who may call it.

use kvq_cache::CacheRegistry;
use kvq_engine::Engine;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;

/// Default request body limit: 4 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Limits the server enforces on requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest request body accepted (413 past it).
    pub max_body_bytes: usize,
    /// Largest `n` (choices per request) accepted.
    pub max_n: usize,
    /// How long one request may run (a stream then ends with an error event); None: no limit.
    pub request_timeout: Option<std::time::Duration>,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_n: 1,
            request_timeout: None,
        }
    }
}

/// Who may call the server: with keys, every `/v1` route needs one (`auth.rs`); `/health`
/// never does, `/metrics` when `metrics_need_key`.
#[derive(Debug, Clone, Default)]
pub struct Access {
    pub keys: Option<Arc<crate::auth::ApiKeys>>,
    pub metrics_need_key: bool,
}

/// Shared by every handler; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub registry: Arc<CacheRegistry>,
    pub metrics: PrometheusHandle,
    pub limits: ServerLimits,
    pub access: Access,
    /// Draining and cutting streams at shutdown (`lifecycle.rs`).
    pub lifecycle: Arc<crate::lifecycle::Lifecycle>,
}
