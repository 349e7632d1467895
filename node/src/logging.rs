//! Logging to stderr with `tracing`: `warn` by default, `-v` for info, `-vv` for debug,
//! `RUST_LOG` overrides both.

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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
