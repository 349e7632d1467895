//! `stormo pull`: fetch a model folder from peers, verified against the L0 manifest (the
//! layout is described in [`crate::net::pull`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use stormo_manifests::{Hash, PublicKey};

use crate::net::{self, pull, tier::PeerConfig, PeerAddr};

/// Arguments of `stormo pull`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("accept").required(true).multiple(true).args(["model_id", "trust"])))]
pub struct Args {
    /// A peer serving the model, as KEY@HOST:PORT (its 64-hex node key and address).
    /// Repeatable: a peer that fails or sends wrong bytes is replaced by the next.
    #[arg(long = "peer", value_name = "KEY@HOST:PORT", required = true)]
    pub peers: Vec<PeerAddr>,
    /// Accept only the manifest with this model id (64 hex).
    #[arg(long, value_name = "ID")]
    pub model_id: Option<Hash>,
    /// Accept a manifest signed by this publisher key (64 hex; the signature is fetched from
    /// the peer and saved beside the manifest). Repeatable.
    #[arg(long, value_name = "PUBKEY")]
    pub trust: Vec<PublicKey>,
    /// The folder to write (created if missing, and removed again if the pull fails before
    /// storing anything). A folder pulled before is resumed: files already complete and
    /// verified are kept. A folder holding another model is refused (see --force).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Replace another model that --out holds: its weight, metadata and manifest files are
    /// removed first (instead of refusing the pull).
    #[arg(long)]
    pub force: bool,
    /// This node's secret key (which the peers allow-list); without it an ephemeral key.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Fetch the expert tensors too (a full local copy). Without it the folder holds the
    /// dense weights only and `run` fetches experts from peers (--no-local-experts implied),
    /// unless it already held the experts: a pull never drops them.
    #[arg(long)]
    pub with_experts: bool,
    /// Seconds a peer may take to answer one request, from when it is sent, before the next
    /// peer is tried (a connection attempt gets at most 3 s, or this if shorter). At most 1e6.
    #[arg(
        long,
        default_value_t = 30.0,
        value_name = "SECS",
        value_parser = crate::progress::secs_arg
    )]
    pub peer_timeout: f64,
}

/// Runs `stormo pull`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let t = crate::progress::check_secs(a.peer_timeout)
        .map_err(|e| anyhow::anyhow!("--peer-timeout: {e}"))?;
    let t = Duration::from_secs_f64(t);
    let secret = net::node_key(a.key.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("stormo-pull")
        .enable_all()
        .build()
        .context("starting the network runtime")?;
    let opts = pull::PullOptions {
        peers: a.peers,
        model_id: a.model_id,
        trust: a.trust,
        out: a.out.clone(),
        with_experts: a.with_experts,
        force: a.force,
        cfg: PeerConfig::with_timeout(t),
    };
    let started = std::time::Instant::now();
    let r = pull::pull(&secret, &opts, &rt)
        .with_context(|| format!("pulling into {}", a.out.display()))?;
    let secs = started.elapsed().as_secs_f64();
    let model = r.model_id.map(|h| h.to_hex()).unwrap_or_default();
    let what = if r.experts {
        "experts included"
    } else {
        "dense only: run it with --peer to fetch experts"
    };
    if r.tensors == 0 && r.fetched == 0 && r.reused == 0 {
        eprintln!(
            "model {model} in {} is already up to date: {} files kept ({what})",
            a.out.display(),
            r.kept,
        );
    } else {
        eprintln!(
            "pulled model {model} into {}: {} tensors, {:.1} MB fetched in {secs:.1}s ({:.1} MB/s), \
             {} tensors copied from files already there, {} files kept ({what})",
            a.out.display(),
            r.tensors,
            r.fetched as f64 / 1e6,
            r.fetched as f64 / 1e6 / secs.max(1e-9),
            r.reused,
            r.kept,
        );
    }
    Ok(())
}
