//! The `stormo` binary.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = stormo_node::cli::Cli::parse();
    stormo_node::logging::init(cli.verbose);
    match stormo_node::cli::dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", stormo_node::cli::error_message(&e));
            ExitCode::FAILURE
        }
    }
}
