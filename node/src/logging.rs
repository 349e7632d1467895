//! Logging to stderr with `tracing`: `warn` by default, `-v` for info, `-vv` for debug,
//! `RUST_LOG` overrides both. Colours only when stderr is a terminal and `NO_COLOR` is unset,
//! so logs captured to a file hold plain text.

use tracing_subscriber::EnvFilter;

/// Installs the stderr subscriber.
pub fn init(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
