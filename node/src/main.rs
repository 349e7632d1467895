//! The `stormo` binary.

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    stormo_cli::cli::main()
}
