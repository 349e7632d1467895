//! Logging to stderr with `tracing`: `warn` by default, `-v` for info, `-vv` for debug,
//! `RUST_LOG` overrides both. Colours only when stderr is a terminal and `NO_COLOR` is unset,
//! so logs captured to a file hold plain text.
//!
//! The DHT crate's one ERROR ("Could not bootstrap the routing table") is dropped: it fires
//! whenever its routing table is empty after bootstrapping, which is the expected state of the
//! first node of a private DHT (documented setup, reported at info level), and a node that
//! could not reach its bootstrap nodes is reported by our own discovery code, at error level,
//! with a sentence that names the flag (`stormo_net::discover::dht`).

use tracing_subscriber::prelude::*;
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
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = tracing_subscriber::registry()
        .with(
            fmt.with_filter(filter)
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    !is_dht_bootstrap_error(m.target(), *m.level())
                })),
        )
        .try_init();
}

/// Whether an event is the DHT crate's ERROR about an empty routing table (see the module
/// docs): the only event at that level the crate logs.
fn is_dht_bootstrap_error(target: &str, level: tracing::Level) -> bool {
    level == tracing::Level::ERROR && (target == "mainline" || target.starts_with("mainline::"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_dht_crates_errors_are_dropped() {
        use tracing::Level;
        assert!(is_dht_bootstrap_error("mainline::rpc", Level::ERROR));
        assert!(!is_dht_bootstrap_error("mainline::rpc", Level::WARN));
        assert!(!is_dht_bootstrap_error("mainline_other", Level::ERROR));
        assert!(!is_dht_bootstrap_error(
            "stormo_net::discover::dht",
            Level::ERROR
        ));
    }
}
