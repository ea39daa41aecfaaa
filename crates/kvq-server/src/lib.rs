//! kvq-server: the OpenAI-compatible HTTP API over a `kvq_engine::Engine` — routes, wire types,
//! request validation, errors (mapped to HTTP in one place, `error.rs`), SSE streaming and
//! Prometheus metrics. The `kvq` binary (`main.rs`, `cli/`) is built on this library.

pub mod auth;
pub mod cache_select;
pub mod calibration;
pub mod error;
pub mod extract;
pub mod generation;
pub mod lifecycle;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod server;
pub mod sse;
pub mod state;
pub mod tool_calls;
pub mod validate;

pub use error::ApiError;
pub use metrics::install_metrics;
pub use routes::router;
pub use server::{ServeOptions, serve};
pub use state::{Access, AppState, DEFAULT_MAX_BODY_BYTES, ServerLimits};
