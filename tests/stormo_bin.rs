//! The `stormo` command line, built inside this package so that the integration tests can run
//! it as a process (`CARGO_BIN_EXE_stormo-under-test`): `stormo demo` and `stormo swarm`
//! start nodes as processes of the binary they run in.

fn main() -> std::process::ExitCode {
    stormo_cli::cli::main()
}
