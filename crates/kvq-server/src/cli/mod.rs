//! The command line: `kvq serve`, `kvq generate`, `kvq bench` and `kvq eval` (clap derive),
//! logging setup, and model loading with a progress bar shared by all.

mod bench;
mod budget;
mod calibrate;
mod device;
mod eval;
mod generate;
mod model;
mod presets;
mod serve;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// kvq: a local LLM inference server with a per-request compressed KV cache.
#[derive(Debug, Parser)]
#[command(name = "kvq", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Generate a completion for one prompt and stream it to stdout.
    Generate(generate::GenerateArgs),
    /// Measure prompt and decode tokens/s (optionally against llama-bench results).
    Bench(bench::BenchArgs),
    /// Train VecInfer's codebooks and smoothing factors for a model on a text.
    Calibrate(calibrate::CalibrateArgs),
    /// Measure perplexity per KV cache method (llama-perplexity's protocol) against fp16.
    Eval(eval::EvalArgs),
}

impl Command {
    /// The log level when RUST_LOG is unset: `info` for the server, `warn` for one-shot commands.
    pub fn default_log_level(&self) -> &'static str {
        match self {
            Command::Serve(_) => "info",
            Command::Calibrate(_) => "warn",
            Command::Generate(_) | Command::Bench(_) | Command::Eval(_) => "warn",
        }
    }
}

/// Logs to stderr, filtered by RUST_LOG (default `default_level`).
pub fn init_tracing(default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs the chosen subcommand.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve::run(args).await,
        Command::Generate(args) => generate::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Calibrate(args) => calibrate::run(args).await,
        Command::Eval(args) => eval::run(args).await,
    }
}
