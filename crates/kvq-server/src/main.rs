//! The `kvq` binary: parses the command line (`cli/`), sets up logging and runs `serve` or
//! `generate`. Errors are printed as `error: ...` with their causes, exit code 1.

mod cli;

use clap::Parser;

/// jemalloc keeps a long prompt's KV cache blocks apart from the per-layer buffers freed between
/// them (size classes), where glibc's arenas left ~45 MiB of holes at 8000 tokens; it also gives
/// freed pages back to the OS on its own (decay), so an idle server shrinks.
#[cfg(not(any(target_env = "msvc", target_os = "macos")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    cli::init_tracing(args.command.default_log_level());
    match cli::run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
