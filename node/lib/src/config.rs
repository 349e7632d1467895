//! A node's configuration, typed: what the command line ([`crate::args`]), a config file and
//! `STORMO_*` variables resolve into once, before any work starts (the way ripgrep turns its
//! low-level arguments into high-level ones). Library code and tests take these, never clap's
//! structs; every value here is already parsed and checked.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use stormo_manifests::{Hash, PublicKey};

use stormo_net::tier::PeerConfig;
use stormo_net::{serve, PeerAddr};

/// How much RAM the expert cache may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheBudget {
    /// The RAM available, less the dense weights, the KV cache and a reserve for the system.
    Auto,
    /// This many bytes (never less than one layer's top-k experts, never more than all).
    Bytes(u64),
}

/// The RAM cache and the local disk tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertsConfig {
    /// The cache's budget.
    pub cache: CacheBudget,
    /// Prefetch the next layer's predicted experts.
    pub prefetch: bool,
    /// Serve local experts from memory-mapped files instead of the cache (no budget).
    pub mmap: bool,
    /// Threads reading experts from disk.
    pub io_threads: usize,
    /// Preload the most used experts at start and record usage counts (in the state
    /// directory).
    pub hot_store: bool,
    /// Threads the engine computes on (`None`: rayon's default, one per core or
    /// `RAYON_NUM_THREADS`); see [`start_engine_threads`].
    pub threads: Option<usize>,
}

impl Default for ExpertsConfig {
    fn default() -> Self {
        Self {
            cache: CacheBudget::Auto,
            prefetch: false,
            mmap: false,
            io_threads: 4,
            hot_store: true,
            threads: None,
        }
    }
}

/// Sets the number of threads the engine computes on: the size of rayon's global pool, which
/// the kernels' parallel loops and the tokenizer's loading share. It must run before anything
/// uses that pool, so commands call it first thing (with [`ExpertsConfig::threads`]) and
/// [`crate::node::Node::start`] calls it again (a library caller that skipped it). `None`
/// leaves rayon's default. Asking again for the count the pool already has is fine; asking
/// for another once the pool has started is an error naming both.
pub fn start_engine_threads(threads: Option<usize>) -> anyhow::Result<()> {
    let Some(n) = threads else {
        return Ok(());
    };
    anyhow::ensure!(n >= 1, "--threads must be at least 1");
    match rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("stormo-engine-{i}"))
        .build_global()
    {
        Ok(()) => Ok(()),
        // Already started (by an earlier call or an earlier use): fine if it is the same size.
        Err(_) if rayon::current_num_threads() == n => Ok(()),
        Err(_) => anyhow::bail!(
            "--threads {n}: the engine's threads had already started ({} of them)",
            rayon::current_num_threads()
        ),
    }
}

/// Which of the checkpoint's experts the node uses from its own disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LocalExperts {
    /// All of them (a folder pulled without experts has none, whatever this says).
    #[default]
    All,
    /// None: every expert comes from peers or kept experts.
    None,
    /// These (an `--only-experts` spec such as `0-15` or `0:0-7,1:8-15`, checked against the
    /// model's shape when the node starts).
    Only(String),
}

/// Where verified experts fetched from peers are kept, so the node uses them again and serves
/// them to others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeepConfig {
    /// The folder (`None`: `experts/` in the state directory).
    pub dir: Option<PathBuf>,
    /// The most it may hold for one model (least recently used experts go first): bytes, or
    /// by default half the free disk, at most the model's experts (`--expert-dir-limit`).
    pub limit: stormo_net::expert_dir::budget::KeepLimit,
}

/// The peers below the disk, and how experts from them are checked.
#[derive(Clone, Debug, Default)]
pub struct PeersConfig {
    /// Peers to connect to at start (more may join while the node runs).
    pub peers: Vec<PeerAddr>,
    /// This node's secret key file (`None`: an ephemeral key).
    pub key: Option<PathBuf>,
    /// Publisher keys whose signature on the manifest is accepted.
    pub trust: Vec<PublicKey>,
    /// The one manifest accepted, by id.
    pub model_id: Option<Hash>,
    /// The manifest file, if not `DIR/stormo-manifest.bin`.
    pub manifest: Option<PathBuf>,
    /// Timeouts of the network tier.
    pub timeouts: PeerConfig,
    /// Keep verified experts from peers (`None`: do not keep them).
    pub keep: Option<KeepConfig>,
    /// Ask peers before the local disk.
    pub peers_first: bool,
    /// Whether experts may be computed by the peers holding them, and spot-checks.
    pub remote: stormo_net::remote_policy::RemoteConfig,
}

/// Serving experts to peers over QUIC.
#[derive(Clone, Debug)]
pub struct ListenConfig {
    /// Where to listen (UDP); the node dials its peers from the same port.
    pub addr: SocketAddr,
    /// Limits and admission.
    pub serve: serve::ServeConfig,
    /// Copies of every expert the serving nodes aim to keep across the swarm
    /// (`--replicas`; 0: this node places none). Needs kept experts and peers.
    pub replicas: u32,
}

/// Everything a [`crate::node::Node`] is built from.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The model folder (never written to).
    pub model: PathBuf,
    /// Where the node keeps its own files: usage counts, kept experts, a manifest it built.
    pub state_dir: PathBuf,
    /// The RAM cache and the local disk.
    pub experts: ExpertsConfig,
    /// Which local experts are used.
    pub local: LocalExperts,
    /// Positions of KV cache the model will need (for the cache's automatic budget).
    pub context: usize,
    /// Peers and the manifest.
    pub peers: PeersConfig,
    /// Serving to peers, if the node listens.
    pub listen: Option<ListenConfig>,
    /// Swarm membership (the certificate presented, the members admitted) and discovery.
    pub swarm: Option<stormo_net::swarm::SwarmConfig>,
}

impl NodeConfig {
    /// A node that runs the model in `model` from its own disk alone, with default settings.
    pub fn local(model: impl Into<PathBuf>, context: usize) -> Self {
        Self {
            model: model.into(),
            state_dir: default_state_dir(),
            experts: ExpertsConfig::default(),
            local: LocalExperts::All,
            context,
            peers: PeersConfig::default(),
            listen: None,
            swarm: None,
        }
    }
}

/// The state directory when none is given: `$XDG_STATE_HOME/stormo`, else
/// `~/.local/state/stormo`, else `.stormo-state` in the working folder.
pub fn default_state_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("stormo");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return Path::new(&h).join(".local/state/stormo");
    }
    PathBuf::from(".stormo-state")
}

#[cfg(test)]
mod tests {
    /// The pool's size is set once: the same count again is accepted, another is refused
    /// naming both (the test asks for the size the pool already has, so it changes nothing
    /// for the other tests in this process).
    #[test]
    fn engine_threads_are_set_once() {
        super::start_engine_threads(None).unwrap();
        let n = rayon::current_num_threads();
        super::start_engine_threads(Some(n)).unwrap();
        let e = super::start_engine_threads(Some(n + 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("--threads {}", n + 1)), "{e}");
        assert!(e.contains(&format!("({n} of them)")), "{e}");
        assert!(super::start_engine_threads(Some(0)).is_err());
    }
}
