//! `kvq serve`: load the model, start the engine, bind, print `kvq listening on http://ADDR`
//! and serve until ctrl-c.

use super::model::{load_with_progress, resolve_model_path};
use anyhow::Context;
use clap::Args;
use kvq_cache::CacheRegistry;
use kvq_engine::{Engine, EngineConfig};
use kvq_server::{AppState, DEFAULT_MAX_BODY_BYTES, ServerLimits, install_metrics, serve};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the bound address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// A GGUF file, a Hugging Face model directory or id (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Sequences generating at once.
    #[arg(long, default_value_t = EngineConfig::default().max_running)]
    pub max_running: usize,
    /// Requests allowed to wait; past that requests get 503 with Retry-After.
    #[arg(long, default_value_t = EngineConfig::default().max_waiting)]
    pub max_waiting: usize,
    /// Largest request body accepted, in bytes (413 past it).
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Largest `n` (choices per request) accepted.
    #[arg(long, default_value_t = 1)]
    pub max_n: usize,
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.max_running >= 1, "--max-running must be at least 1");
    anyhow::ensure!(args.max_n >= 1, "--max-n must be at least 1");
    let path = resolve_model_path(args.model)?;
    let model = load_with_progress(path).await?;
    let config = EngineConfig {
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        ..EngineConfig::default()
    };
    let engine = Engine::start(model, config);
    let registry = Arc::new(CacheRegistry::builtin());
    tracing::info!(methods = %registry.names().join(", "), default = registry.default_method(), "kv cache methods");
    let state = AppState {
        engine,
        registry,
        metrics: install_metrics(),
        limits: ServerLimits {
            max_body_bytes: args.max_body_bytes,
            max_n: args.max_n,
        },
    };
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("could not listen on {}:{}", args.host, args.port))?;
    let addr = listener
        .local_addr()
        .context("could not read the bound address")?;
    eprintln!("kvq listening on http://{addr}");
    serve(listener, state).await.context("the server failed")?;
    tracing::info!("stopped");
    Ok(())
}
