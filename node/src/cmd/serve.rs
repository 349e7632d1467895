//! `stormo serve`: serve this node's manifest and experts to peers over QUIC (`--listen`),
//! and/or an OpenAI-compatible HTTP API (`--http`, see [`crate::http`]), in one process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

use crate::experts::ExpertArgs;
use crate::net::tls::{Admission, Congestion};
use crate::net::{self, serve};

/// Arguments of `stormo serve`.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("endpoint")
        .args(["listen", "http"])
        .required(true)
        .multiple(true)
))]
pub struct Args {
    /// The model directory (a full or partial checkpoint; serving peers with --listen also
    /// needs its stormo-manifest.bin).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// The manifest, if not DIR/stormo-manifest.bin.
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Where to listen for peers (UDP), e.g. 0.0.0.0:4433 or 127.0.0.1:0.
    #[arg(long, value_name = "ADDR", value_parser = listen_addr)]
    pub listen: Option<SocketAddr>,
    /// This node's secret key (from `stormo key generate`); without it an ephemeral key is
    /// made and printed, which peers cannot allow-list across restarts.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Admit the peer with this node key (64 hex); repeatable. Without --allow, --allow-file
    /// or --allow-any nobody can connect.
    #[arg(long, value_name = "KEY")]
    pub allow: Vec<String>,
    /// Admit the node keys listed in this file (one per line, `#` comments).
    #[arg(long, value_name = "FILE")]
    pub allow_file: Option<PathBuf>,
    /// Admit any node key (a public node). Must be asked for explicitly.
    #[arg(long, conflicts_with_all = ["allow", "allow_file"])]
    pub allow_any: bool,
    /// Serve only these experts: `0-15` (the same experts in every layer) or per layer
    /// `0:0-7,1:8-15` (layers not named: none).
    #[arg(long, value_name = "SPEC")]
    pub only_experts: Option<String>,
    /// Requests of one peer served at once; more are answered busy.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub per_peer: u32,
    /// Requests of all peers served at once; more are answered busy.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub max_requests: usize,
    /// How answers to peers are paced. `bbr` keeps experts flowing over long lossy paths
    /// (20 ms one way, 0.5% loss: about 12 times faster than `cubic` in `stormo swarm
    /// --scenario wan`, see the README), but quinn calls its BBR experimental, and it can take
    /// more than its share of a link shared with other traffic.
    #[arg(long, value_enum, default_value_t = Congestion::Cubic, value_name = "ALGORITHM")]
    pub congestion: Congestion,
    /// Where served experts come from (RAM cache over the local disk).
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// The HTTP API for people and their tools.
    #[command(flatten)]
    pub http: crate::http::HttpArgs,
    /// Swarm membership and discovery.
    #[command(flatten)]
    pub swarm: crate::swarm_args::SwarmArgs,
}

/// Runs `stormo serve` until interrupted.
pub fn run(a: Args) -> anyhow::Result<()> {
    let http = match a.http.config()? {
        Some(cfg) => Some((crate::http::load(&a.model, &a.experts, &cfg)?, cfg)),
        None => None,
    };
    let Some(listen) = a.listen else {
        let (tm, cfg) = http.context("give --listen, --http, or both")?;
        return serve_http_only(tm, cfg);
    };
    let secret = net::node_key(a.key.as_deref())?;
    let swarm = a.swarm.resolve(&secret, crate::cmd::swarm::unix_now()?)?;
    let admission = if swarm.membership.is_some() {
        let keys = net::allow_list(&a.allow, a.allow_file.as_deref())?;
        swarm.admission(&keys, a.allow_any)
    } else if a.allow_any {
        tracing::warn!("--allow-any: any node may fetch from this one");
        Admission::Any
    } else {
        let keys = net::allow_list(&a.allow, a.allow_file.as_deref())?;
        if keys.is_empty() {
            match &a.allow_file {
                Some(f) if a.allow.is_empty() => tracing::warn!(
                    "--allow-file {} lists no keys and no --allow or --allow-any is given: no \
                     peer can connect",
                    f.display()
                ),
                _ => tracing::warn!("no --allow, --allow-file or --allow-any: no peer can connect"),
            }
        }
        Admission::Keys(keys.iter().map(|k| *k.as_bytes()).collect())
    };
    anyhow::ensure!(a.per_peer >= 1, "--per-peer must be at least 1");
    anyhow::ensure!(a.max_requests >= 1, "--max-requests must be at least 1");
    // With the HTTP API too, the server shares the model's expert cache (one budget).
    let (holdings, experts) = match &http {
        Some((tm, _)) => (
            serve::open_holdings_sharing(
                &a.model,
                a.manifest.as_deref(),
                a.only_experts.as_deref(),
                tm.experts.provider.clone(),
            )?,
            None,
        ),
        None => {
            let (h, e) = serve::open_holdings(
                &a.model,
                a.manifest.as_deref(),
                &a.experts,
                a.only_experts.as_deref(),
            )?;
            (h, Some(e))
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("stormo-serve")
        .enable_all()
        .build()
        .context("starting the network runtime")?;
    let model = holdings.model_id();
    let n = holdings.inventory.len();
    let holdings = Arc::new(holdings);
    rt.block_on(async move {
        let web = match http {
            Some((tm, cfg)) => Some(start_http(tm, cfg).await?),
            None => None,
        };
        let h = serve::start(
            &secret,
            listen,
            holdings,
            serve::ServeConfig {
                per_peer: a.per_peer,
                node_limit: a.max_requests,
                admission,
                congestion: a.congestion,
                membership: swarm.membership.as_ref().map(|m| m.cert.clone()),
            },
        )?;
        // Announce this node; `serve` dials nobody, so what it finds is only logged (the
        // Node of issue 34 feeds it to its peer set).
        let (found, mut peers) = tokio::sync::mpsc::channel(64);
        let announce = crate::discover::Announce {
            node: secret.public(),
            port: h.local_addr().port(),
            models: vec![model],
            swarm: swarm.swarm(),
        };
        let _discovery = crate::discover::start(&swarm.discover, &announce, found)?;
        tokio::spawn(async move {
            while let Some(d) = peers.recv().await {
                tracing::info!("discovered peer {d:?}");
            }
        });
        eprintln!(
            "serving model {} ({n} experts) on {} as node {}",
            model.to_hex(),
            h.local_addr(),
            secret.public()
        );
        // One `KEY@ADDR` line per address a peer can dial (never 0.0.0.0).
        for addr in crate::discover::reachable_addrs(h.local_addr()) {
            println!("{}@{addr}", secret.public());
        }
        tokio::signal::ctrl_c()
            .await
            .context("waiting for Ctrl-C")?;
        eprintln!("shutting down");
        let st = &h.stats;
        eprintln!(
            "served {} requests ({} bytes) over {} connections",
            st.served.load(std::sync::atomic::Ordering::Relaxed),
            st.bytes.load(std::sync::atomic::Ordering::Relaxed),
            st.connections.load(std::sync::atomic::Ordering::Relaxed)
        );
        h.close();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), h.wait_idle()).await;
        if let Some(w) = web {
            w.close();
        }
        anyhow::Ok(())
    })?;
    if let Some(e) = experts {
        e.finish();
    }
    Ok(())
}

async fn start_http(
    tm: crate::cmd::chat::TextModel,
    cfg: crate::http::HttpConfig,
) -> anyhow::Result<crate::http::HttpServer> {
    let name = tm.name.clone();
    let w = crate::http::start(tm, cfg).await?;
    eprintln!(
        "serving {name} over HTTP (OpenAI API) at http://{}/v1",
        w.local_addr()
    );
    Ok(w)
}

/// `stormo serve --http` without `--listen`: the HTTP API alone.
fn serve_http_only(
    tm: crate::cmd::chat::TextModel,
    cfg: crate::http::HttpConfig,
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("stormo-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    rt.block_on(async move {
        let w = start_http(tm, cfg).await?;
        println!("http://{}/v1", w.local_addr());
        tokio::signal::ctrl_c()
            .await
            .context("waiting for Ctrl-C")?;
        eprintln!("shutting down");
        w.close();
        anyhow::Ok(())
    })
}

/// `--listen` and `--http`: an IP address and port, or a host name that resolves to one
/// (`localhost:4433`: the first address it resolves to).
pub(crate) fn listen_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not HOST:PORT (e.g. 0.0.0.0:4433 or 127.0.0.1:0)"))?;
    port.parse::<u16>()
        .map_err(|_| format!("{s:?}: the port {port:?} is not a number from 0 to 65535"))?;
    std::net::ToSocketAddrs::to_socket_addrs(s)
        .map_err(|e| format!("{s:?}: cannot resolve the host {host:?} ({e})"))?
        .next()
        .ok_or_else(|| format!("{s:?}: the host {host:?} has no address"))
}

#[cfg(test)]
mod tests {
    /// `--http` takes what `--listen` takes: an address, or a host name that resolves.
    #[test]
    fn http_and_listen_take_host_names() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["stormo", "serve", "--model", "m"];
            argv.extend_from_slice(extra);
            crate::cli::Cli::try_parse_args(argv).map_err(|e| e.to_string())
        };
        for flag in ["--http", "--listen"] {
            for ok in ["127.0.0.1:8080", "localhost:8080", "[::1]:0"] {
                parse(&[flag, ok]).unwrap_or_else(|e| panic!("{flag} {ok}: {e}"));
            }
            for (bad, needle) in [
                ("8080", "is not HOST:PORT"),
                ("localhost:http", "is not a number"),
                ("localhost:70000", "is not a number"),
            ] {
                let err = parse(&[flag, bad]).expect_err(bad);
                assert!(err.contains(needle), "{flag} {bad}: {err}");
            }
        }
    }
}
