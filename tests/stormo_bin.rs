//! The `stormo` command line, built inside this package so that the integration tests can run
//! it as a process (`CARGO_BIN_EXE_stormo-under-test`): `stormo demo` and `stormo swarm`
//! start nodes as processes of the binary they run in.

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
