//! A node's configuration, typed: what the command line (the binary's `args`), a config file
//! and `STORMO_*` variables resolve into once, before any work starts (the way ripgrep turns
//! its low-level arguments into high-level ones). Library code and tests take these, never
//! clap's structs; every value here is already parsed and checked.
//!
//! Also the last step of that resolution, which needs the model folder opened: a
//! [`NodeConfig`] settles into a [`NodePlan`] ([`NodeConfig::plan`]): what the folder and the
//! state directory say without being asked (a pulled folder's pinned model id, experts kept
//! earlier), which local experts the node uses, whether it dials, listens and needs a
//! manifest, and the refusal, naming the flags, of every combination that cannot work. The
//! Node starts from a plan and checks no flag itself.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use stormo_manifests::{Hash, ManifestPaths, PublicKey};

use stormo_net::tier::PeerConfig;
use stormo_net::{self as net, serve, PeerAddr};

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
    /// Which peers may compute experts for this node.
    pub exec_trust: stormo_net::remote::ExecTrust,
}

/// Serving experts to peers over QUIC.
#[derive(Clone, Debug)]
pub struct ListenConfig {
    /// Where to listen (UDP); the node dials its peers from the same port.
    pub addr: SocketAddr,
    /// Limits and admission. The certificate the node presents is that of
    /// [`NodeConfig::swarm`], the one place it is given.
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

/// Where a node keeps its own files for one model, under the state directory.
#[derive(Clone, Debug)]
pub struct StatePaths {
    /// `STATE/models/KEY`: this model's folder (KEY: the model id, or for a checkpoint with no
    /// manifest, a hash of its folder's path).
    pub model: PathBuf,
    /// Where kept experts go by default (`STATE/experts`; the expert directory adds the model
    /// id).
    pub experts: PathBuf,
}

impl StatePaths {
    /// The paths under `state` for the model keyed `key`.
    pub fn new(state: &Path, key: &str) -> Self {
        Self {
            model: state.join("models").join(key),
            experts: state.join("experts"),
        }
    }

    /// The expert usage counts (the hot store).
    pub fn usage(&self) -> PathBuf {
        self.model.join("usage.json")
    }
}

/// The most kept experts a node holds per model when it was not told (`--expert-dir-limit`'s
/// default): half the free space of their filesystem, at most the model's experts, read
/// again before each write (`stormo_net::expert_dir::budget`).
pub const DEFAULT_KEEP_LIMIT: stormo_net::expert_dir::budget::KeepLimit =
    stormo_net::expert_dir::budget::KeepLimit::Auto;

/// What a [`NodeConfig`] asks of the node, settled against its model folder and state
/// directory ([`NodeConfig::plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    /// The folder was pulled without its experts (their bytes are holes).
    pub dense_only: bool,
    /// The local experts the node may use (`None`: all).
    pub allowed: Option<Vec<Vec<bool>>>,
    /// It uses some of its local experts.
    pub uses_local: bool,
    /// It finds peers by discovery.
    pub discovering: bool,
    /// It dials out (peers given or to be found).
    pub dials: bool,
    /// It needs a manifest (to check experts from peers or kept ones, or to serve).
    pub needs_manifest: bool,
}

impl NodeConfig {
    /// Settles this configuration for its model, whose MoE layers hold `shape[l]` experts
    /// each: takes what the folder and the state directory say (a pulled folder's pinned
    /// model id, experts kept earlier), then refuses the combinations of settings that cannot
    /// work, naming the flags, before anything is started.
    pub fn plan(&mut self, shape: &[usize]) -> anyhow::Result<NodePlan> {
        self.adopt()?;
        let dir = &self.model;
        let dense_only = net::pull::Pulled::dense_only(dir)?;
        let allowed: Option<Vec<Vec<bool>>> = match (&self.local, dense_only) {
            (LocalExperts::All, false) => None,
            (LocalExperts::Only(spec), false) => Some(net::parse_only_experts(spec, shape)?),
            (LocalExperts::Only(_), true) => anyhow::bail!(
                "{} was pulled without experts ({}): it has no local experts to restrict with \
                 --only-experts",
                dir.display(),
                net::pull::MARKER_FILE
            ),
            (LocalExperts::None, _) | (LocalExperts::All, true) => {
                Some(shape.iter().map(|&n| vec![false; n]).collect())
            }
        };
        let uses_local = allowed
            .as_ref()
            .is_none_or(|a| a.iter().flatten().any(|&on| on));
        let p = &self.peers;
        let discovering = self.swarm.as_ref().is_some_and(|s| s.discover.is_on());
        // Peers given, or to be found: either way the node dials out.
        let dials = !p.peers.is_empty() || discovering;
        let needs_manifest = dials || p.keep.is_some() || self.listen.is_some();
        if !needs_manifest {
            // These check the manifest that verifies experts from peers or kept experts; with
            // neither, nothing would check them, and a user who set them expects a check.
            let given: Vec<&str> = [
                ("--trust", !p.trust.is_empty()),
                ("--model-id", p.model_id.is_some()),
                ("--manifest", p.manifest.is_some()),
                ("--key", p.key.is_some()),
            ]
            .into_iter()
            .filter_map(|(flag, set)| set.then_some(flag))
            .collect();
            anyhow::ensure!(
                given.is_empty(),
                "{} {} only with --peer, --expert-dir or --listen: the manifest checks verify \
                 experts from peers or kept experts, and --key names this node to peers. The \
                 local checkpoint is used as it is; `stormo manifest verify` checks it against \
                 a manifest",
                given.join(", "),
                if given.len() == 1 { "applies" } else { "apply" }
            );
        }
        if !uses_local && !dials && p.keep.is_none() && self.listen.is_none() {
            anyhow::bail!(
                "{} holds no experts this node may use{}: give --peer KEY@HOST:PORT (or \
                 --discover with --swarm) so experts come from peers, or --expert-dir with \
                 experts kept earlier",
                dir.display(),
                if dense_only {
                    format!(
                        " (it was pulled without them, see {})",
                        net::pull::MARKER_FILE
                    )
                } else {
                    String::new()
                }
            );
        }
        if self.experts.mmap {
            anyhow::ensure!(
                !dials && p.keep.is_none() && allowed.is_none(),
                "--mmap-experts serves every local expert; it cannot be combined with peers, an \
                 expert directory or expert subsets"
            );
        }
        Ok(NodePlan {
            dense_only,
            allowed,
            uses_local,
            discovering,
            dials,
            needs_manifest,
        })
    }

    /// What a folder and the state directory say without being asked: a folder from `stormo
    /// pull` pins the model id it was pulled for (its manifest was accepted then), and experts
    /// kept earlier for this model in the state directory (by a serving node, or `stormo pull
    /// --experts`) are used, read-only unless keeping was asked for.
    ///
    /// The pin is taken only by a node that checks experts against the manifest (one that
    /// dials, keeps or listens): a folder pulled with its experts runs alone as any checkpoint
    /// does.
    fn adopt(&mut self) -> anyhow::Result<()> {
        let discovering = self.swarm.as_ref().is_some_and(|s| s.discover.is_on());
        let listens = self.listen.is_some();
        let p = &mut self.peers;
        let pinned: Option<Hash> = match net::pull::Pulled::read(&self.model)? {
            Some(pulled) if p.model_id.is_none() && p.trust.is_empty() => {
                pulled.model_id.parse().ok()
            }
            _ => None,
        };
        if p.keep.is_none() {
            let bin = ManifestPaths::resolve(&self.model, p.manifest.as_deref()).bin;
            if let Ok(bytes) = std::fs::read(&bin) {
                let id = Hash::of(&bytes);
                let kept = StatePaths::new(&self.state_dir, "")
                    .experts
                    .join(id.to_hex());
                let any = std::fs::read_dir(&kept).is_ok_and(|mut d| d.next().is_some());
                let trusted = p.model_id.or(pinned) == Some(id) || !p.trust.is_empty();
                if any && trusted {
                    tracing::info!("using the experts kept in {}", kept.display());
                    p.keep = Some(KeepConfig {
                        dir: None,
                        limit: DEFAULT_KEEP_LIMIT,
                    });
                }
            }
        }
        let checks = !p.peers.is_empty() || discovering || p.keep.is_some() || listens;
        if checks && pinned.is_some() {
            p.model_id = pinned;
        }
        Ok(())
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
    use super::*;

    /// The plan of a node alone with its folder uses every local expert and needs no network;
    /// each combination that cannot work is refused naming the flags, before anything starts
    /// (a folder with no model in it: the plan reads only the pull marker and the state).
    #[test]
    fn the_plan_refuses_settings_that_cannot_work_naming_the_flags() {
        let dir = tempfile::tempdir().unwrap();
        let mut base = NodeConfig::local(dir.path(), 16);
        base.state_dir = dir.path().join("state");
        let shape = [4, 4];
        let plan = base.clone().plan(&shape).unwrap();
        assert_eq!(
            plan,
            NodePlan {
                dense_only: false,
                allowed: None,
                uses_local: true,
                discovering: false,
                dials: false,
                needs_manifest: false,
            }
        );
        let refused = |edit: &dyn Fn(&mut NodeConfig)| {
            let mut c = base.clone();
            edit(&mut c);
            format!("{:#}", c.plan(&shape).unwrap_err())
        };
        let key = stormo_manifests::SecretKey::from_seed(&[7; 32]).public();
        let e = refused(&|c| c.peers.trust = vec![key]);
        assert!(e.contains("--trust applies only with --peer"), "{e}");
        let e = refused(&|c| {
            c.peers.model_id = Some(Hash::of(b"m"));
            c.peers.key = Some("k".into());
        });
        assert!(
            e.contains("--model-id, --key apply only with --peer"),
            "{e}"
        );
        let e = refused(&|c| c.local = LocalExperts::None);
        assert!(e.contains("holds no experts this node may use"), "{e}");
        let e = refused(&|c| c.local = LocalExperts::Only("9".into()));
        assert!(e.contains("--only-experts"), "{e}");
        let e = refused(&|c| {
            c.experts.mmap = true;
            c.local = LocalExperts::Only("0-1".into());
        });
        assert!(e.contains("--mmap-experts"), "{e}");
        // A subset is parsed against the model's shape.
        let mut c = base.clone();
        c.local = LocalExperts::Only("0-1".into());
        let half = vec![true, true, false, false];
        assert_eq!(
            c.plan(&shape).unwrap().allowed,
            Some(vec![half.clone(), half])
        );
        // A folder pulled without its experts has none to restrict, and none to use alone.
        std::fs::write(
            dir.path().join(net::pull::MARKER_FILE),
            br#"{"model_id": "00", "experts": false}"#,
        )
        .unwrap();
        let e = refused(&|c| c.local = LocalExperts::Only("0-1".into()));
        assert!(e.contains("pulled without experts"), "{e}");
        let e = refused(&|_| {});
        assert!(e.contains("it was pulled without them"), "{e}");
    }

    /// The pool's size is set once: the same count again is accepted, another is refused
    /// naming both (the test asks for the size the pool already has, so it changes nothing
    /// for the other tests in this process).
    #[test]
    fn engine_threads_are_set_once() {
        start_engine_threads(None).unwrap();
        let n = rayon::current_num_threads();
        start_engine_threads(Some(n)).unwrap();
        let e = start_engine_threads(Some(n + 1)).unwrap_err().to_string();
        assert!(e.contains(&format!("--threads {}", n + 1)), "{e}");
        assert!(e.contains(&format!("({n} of them)")), "{e}");
        assert!(start_engine_threads(Some(0)).is_err());
    }
}
