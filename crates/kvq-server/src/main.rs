//! The `kvq` binary: parses the command line (`cli/`), sets up logging and runs `serve` or
//! `generate`. Errors are printed as `error: ...` with their causes, exit code 1.

mod cli;

use clap::Parser;

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
