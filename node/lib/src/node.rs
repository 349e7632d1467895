//! The Node: the one composition root of a stormo process.
//!
//! Every command that runs or serves a model builds one [`Node`] from a [`NodeConfig`] and
//! calls it. The Node owns:
//! - its [`Host`]: the tokio runtime (the only one in the process), its key, and one QUIC
//!   endpoint that both accepts and dials, so peers reach this node on the port it dials from
//!   (iroh's model: one endpoint, every protocol on it); the manifest is fetched through it
//!   too. A command may build the host first and hand it over ([`Node::start_on`]);
//! - the peer set, which can change while the node runs ([`Node::add_peers`],
//!   [`Node::remove_peer`]; discovery feeds it);
//! - the expert tiers, built once: the RAM cache over the local disk, the kept experts and
//!   the peers, in that order (peers before the disk with `peers_first`);
//! - remote expert execution over the peers (`--remote-exec`, see [`stormo_net::remote`]):
//!   the engine's executor, given to every model the node loads;
//! - its services, stopped by [`Node::close`]: the serving side, when it listens (it serves
//!   every expert it holds verified: its disk, its kept experts, its RAM cache; offers what
//!   its direct peers hold, fetching it for the asker, verified on the way through; and tells
//!   connected peers whenever either set changes, so a swarm grows copies the way BitTorrent
//!   swarms do), discovery, and the HTTP API ([`Node::start_http`]).
//!
//! It starts in phases ([`Node::start_on`]): the model opened (once per command,
//! [`open_model`]) and the configuration settled against it ([`NodeConfig::plan`]: the
//! checks of the settings are there, none here) → identity → endpoint → manifest → tiers →
//! services.
//!
//! The model folder is never written: usage counts and kept experts go to the state directory,
//! under the model id (see [`StatePaths`]). The engine knows none of this: peers and kept
//! experts reach it through the `Tier` trait, and remote execution through the engine's
//! `ExpertExecutor` trait.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use stormo_engine::moe::ExpertProvider;
use stormo_engine::tiers::{ExpertId, Tier};
use stormo_engine::{LoadOptions, Model, ModelFiles};
use stormo_manifests::{Hash, Manifest, ManifestPaths, PublicKey, SecretKey};
use stormo_wire::ExpertSet;

pub use crate::config::StatePaths;
use crate::config::{NodeConfig, NodePlan};
use crate::experts::Experts;
use crate::memory::MemoryPlan;
use stormo_net::expert_dir::{DirTier, ExpertDir};
use stormo_net::remote::{PeerExec, RemoteExperts};
use stormo_net::remote_policy::RemoteExec;
use stormo_net::serve::{Announce, FileShare, Holdings, ServerHandle};
use stormo_net::tier::PeerTier;
use stormo_net::{self as net, PeerAddr};

mod host;
pub use host::Host;
use host::NodeRuntime;

/// How often a serving node recomputes what it holds and offers (and tells its peers).
const ANNOUNCE_EVERY: Duration = Duration::from_millis(500);

/// The manifest a node checks peers' bytes against.
#[derive(Debug)]
struct NodeManifest {
    manifest: Arc<Manifest>,
    id: Hash,
    bytes: Bytes,
}

/// A running node. See the module docs.
pub struct Node {
    cfg: NodeConfig,
    rt: NodeRuntime,
    files: ModelFiles,
    secret: Option<SecretKey>,
    manifest: Option<NodeManifest>,
    experts: Arc<Experts>,
    peers: Option<Arc<PeerTier>>,
    /// Remote expert execution over the peers (`--remote-exec` auto or always).
    remote: Option<Arc<RemoteExperts>>,
    dir: Option<Arc<ExpertDir>>,
    endpoint: Option<quinn::Endpoint>,
    server: Mutex<Option<ServerHandle>>,
    holdings: Option<Arc<Holdings>>,
    state: StatePaths,
    /// Running discovery (dropping it stops announcing), when asked for.
    discovery: Mutex<Option<stormo_net::discover::Discovery>>,
    /// Replica placement, when the node serves, keeps experts and has peers.
    replicator: Mutex<Option<Arc<crate::placement::Replicator>>>,
    /// The experts of the model folder this node uses (with a manifest).
    local: Option<ExpertSet>,
    /// Peers whose connection is down are dialled again ([`Node::keep_peers_dialled`]).
    redialling: std::sync::atomic::AtomicBool,
    /// The HTTP API, when started ([`Node::start_http`]).
    http: Mutex<Option<crate::http::HttpServer>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("model", &self.cfg.model)
            .field("id", &self.manifest.as_ref().map(|m| m.id))
            .field("listen", &self.local_addr())
            .finish_non_exhaustive()
    }
}

/// A copy of `f` (its tensors and layout are shared, not copied).
fn share(f: &ModelFiles) -> ModelFiles {
    ModelFiles {
        dir: f.dir.clone(),
        cfg: f.cfg.clone(),
        ckpt: f.ckpt.clone(),
        layout: f.layout.clone(),
    }
}

/// The experts of `manifest` flagged in `allowed` (all when `None`), as an inventory.
fn local_held(manifest: &Manifest, allowed: Option<&[Vec<bool>]>) -> anyhow::Result<ExpertSet> {
    Holdings::inventory_of(manifest, allowed)
}

/// Opens the model folder `dir` (config.json parsed, the checkpoint mapped, where every expert
/// lies): what a command reads once and passes along, to the text checks and to
/// [`Node::start_on`].
pub fn open_model(dir: &Path) -> anyhow::Result<ModelFiles> {
    ModelFiles::open(dir).map_err(|e| in_model(e, dir))
}

/// An engine error on the model folder `dir`, with the folder named once: an error that is
/// about the folder itself ([`stormo_engine::Error::NoModel`]) names it already.
pub fn in_model(e: stormo_engine::Error, dir: &Path) -> anyhow::Error {
    match e {
        e @ stormo_engine::Error::NoModel { .. } => e.into(),
        e => anyhow::Error::new(e).context(format!("loading the model in {}", dir.display())),
    }
}

impl Node {
    /// Builds the node `cfg` describes and starts it on a [`Host`] of its own, opening
    /// `cfg.model` itself: see [`Node::start_on`].
    pub fn start(cfg: NodeConfig) -> anyhow::Result<Self> {
        let files = open_model(&cfg.model)?;
        Self::start_on(cfg, Host::new()?, files)
    }

    /// Builds the node `cfg` describes for the model `files` (opened from `cfg.model`,
    /// [`open_model`]) and starts it on `host` (its runtime, and its key and endpoint when it
    /// has them), in phases: settles the plan of `cfg` for the model ([`NodeConfig::plan`]:
    /// every check of the settings is there), takes its identity (the host's key, else
    /// `--key`'s), binds its one endpoint (when it dials or listens), resolves the manifest
    /// (from the folder, or fetched from a peer through that endpoint), connects to the peers
    /// and builds the tiers, then starts its services (serving peers, discovery; the HTTP API
    /// once a model is loaded on it, [`Node::start_http`]).
    pub fn start_on(
        mut cfg: NodeConfig,
        mut host: Host,
        files: ModelFiles,
    ) -> anyhow::Result<Self> {
        crate::config::start_engine_threads(cfg.experts.threads)?;
        anyhow::ensure!(
            files.dir == cfg.model,
            "the model opened ({}) is not the node's ({})",
            files.dir.display(),
            cfg.model.display()
        );
        let shape: Vec<usize> = files.layout.parts.iter().map(Vec::len).collect();
        let plan = cfg.plan(&shape)?;
        let p = &cfg.peers;
        let reaches = plan.dials || cfg.listen.is_some();
        // A key is needed to reach peers or be reached; kept experts alone need none, and a
        // key no peer sees is not worth a warning.
        let secret = if reaches {
            host.key_or_load(p.key.as_deref())?;
            host.secret.take()
        } else if plan.needs_manifest {
            Some(host.secret.take().unwrap_or_else(SecretKey::generate))
        } else {
            None
        };
        if reaches {
            host.endpoint_or_bind(cfg.listen.as_ref().map(|l| l.addr), &p.peers)?;
        }
        let Host {
            rt,
            endpoint,
            memory,
            ..
        } = host;
        // A node that neither dials nor listens has no endpoint (nor a peer tier).
        let endpoint = endpoint.filter(|_| reaches);
        let manifest = match (&secret, plan.needs_manifest) {
            (Some(secret), true) => {
                Some(node_manifest(&cfg, &files, secret, &rt, endpoint.as_ref())?)
            }
            _ => None,
        };
        let key = match &manifest {
            Some(m) => m.id.to_hex(),
            None => {
                let dir = &cfg.model;
                let canon = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
                let h = Hash::of(canon.to_string_lossy().as_bytes()).to_hex();
                format!("path-{}", &h[..16])
            }
        };
        let state = StatePaths::new(&cfg.state_dir, &key);
        let memory = memory.unwrap_or_else(MemoryPlan::read);
        let tiers = build_tiers(
            &cfg,
            &files,
            (&plan, &memory),
            &state,
            &rt,
            secret.as_ref().zip(endpoint.as_ref()),
            manifest.as_ref(),
        )?;
        let local = match &manifest {
            Some(m) => Some(local_held(&m.manifest, plan.allowed.as_deref())?),
            None => None,
        };
        let mut node = Self {
            rt,
            files,
            secret,
            manifest,
            experts: tiers.experts,
            peers: tiers.peers,
            remote: tiers.remote,
            dir: tiers.kept,
            endpoint,
            server: Mutex::new(None),
            holdings: None,
            state,
            discovery: Mutex::new(None),
            replicator: Mutex::new(None),
            redialling: std::sync::atomic::AtomicBool::new(false),
            http: Mutex::new(None),
            local,
            cfg,
        };
        if node.cfg.listen.is_some() {
            node.keep_peers_dialled();
            node.start_serving(plan.allowed.as_deref(), plan.dense_only)?;
        } else {
            node.exchange_peers();
        }
        if plan.discovering {
            node.start_discovery()?;
        }
        Ok(node)
    }

    /// Starts the serving side on the node's endpoint.
    fn start_serving(
        &mut self,
        allowed: Option<&[Vec<bool>]>,
        dense_only: bool,
    ) -> anyhow::Result<()> {
        let listen = self
            .cfg
            .listen
            .clone()
            .expect("serving needs a listen config");
        let (Some(m), Some(secret), Some(ep)) = (&self.manifest, &self.secret, &self.endpoint)
        else {
            anyhow::bail!("serving needs the manifest, a key and an endpoint");
        };
        let local = local_held(&m.manifest, allowed)?;
        let withheld = m
            .manifest
            .experts
            .iter()
            .filter(|e| !local.contains(e.id))
            .flat_map(|e| {
                let tensors = &m.manifest.tensors;
                e.parts.iter().filter_map(move |p| {
                    let t = tensors.get(p.tensor as usize)?;
                    Some((t.file, p.offset, p.offset + p.len, e.id))
                })
            })
            .collect();
        let paths = ManifestPaths::resolve(&self.cfg.model, self.cfg.peers.manifest.as_deref());
        // A signature beside the manifest that does not verify is refused, not served.
        let sig = net::serve::own_signature(&paths.sig, &m.bytes)?;
        let holdings = Arc::new(Holdings {
            manifest_bytes: m.bytes.clone(),
            manifest: m.manifest.clone(),
            experts: self.experts.provider.clone(),
            announce: tokio::sync::watch::Sender::new(Arc::new(Announce::holding(local.clone()))),
            files: Some(Arc::new(FileShare {
                dir: self.cfg.model.clone(),
                sig,
                dense_only,
                dense: net::serve::dense_files(&self.cfg.model, &m.manifest, &self.files)?,
                withheld,
            })),
            schemas: self.files.layout.schemas.clone(),
            demand: Arc::default(),
            verified: Arc::default(),
        });
        let mut serve_cfg = listen.serve.clone();
        if let Some(tier) = &self.peers {
            // Peers that serve the model and dial this node join its peer set; its own dials
            // say it serves (set when the tier was made), so the peers it dials add it too.
            let tier = tier.clone();
            serve_cfg.serving_peers = Some(net::serve::ServingPeers(Arc::new(move |p| {
                add_serving_peer(&tier, p);
            })));
        }
        let h = {
            let _g = self.rt.enter();
            // The certificate presented is the swarm's, given once (`NodeConfig::swarm`).
            let id = match &self.cfg.swarm {
                Some(s) => s.identity(secret),
                None => net::tls::Identity::key(secret),
            };
            net::serve::start_on(ep.clone(), id, holdings.clone(), serve_cfg)?
        };
        let announcer = Announcer {
            holdings: holdings.clone(),
            local,
            cache: self.experts.tiered.clone(),
            dir: self.dir.clone(),
            peers: self.peers.clone(),
        };
        announcer.refresh();
        let pinned = announcer.local.clone();
        self.rt.spawn(async move {
            let mut tick = tokio::time::interval(ANNOUNCE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let a = announcer.clone();
                // The cache and the expert directory take locks: off the async threads.
                if tokio::task::spawn_blocking(move || a.refresh())
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        if let (true, Some(dir), Some(peers)) = (listen.replicas > 0, &self.dir, &self.peers) {
            let r = Arc::new(crate::placement::Replicator::new(
                &m.manifest,
                holdings.clone(),
                dir.clone(),
                peers.clone(),
                pinned,
                listen.replicas,
                *secret.public().as_bytes(),
            ));
            r.spawn(self.rt.handle());
            tracing::info!(
                "placing replicas: aiming at {} copies of every expert across the swarm",
                listen.replicas
            );
            *self.replicator.lock().expect("replicator lock") = Some(r);
        }
        self.holdings = Some(holdings);
        *self.server.lock().expect("server lock") = Some(h);
        Ok(())
    }

    /// Announces this node (when it serves) and feeds the peers that discovery finds into the
    /// peer set, taking out those that go away ([`stormo_net::discover::drive`]): a LAN record
    /// names its key (proven in the handshake when dialled), a DHT record only an address,
    /// which is dialled to learn the key it proves. A node that does not serve and was given
    /// no peer on the command line waits (bounded) until the first DHT lookup's peers are
    /// connected (LAN only: the first peer), so a run that starts at once has them to ask; a
    /// serving node starts serving at once.
    fn start_discovery(&self) -> anyhow::Result<()> {
        use stormo_net::discover::{self, book::Change};
        let (Some(sw), Some(secret), Some(ep), Some(m), Some(tier)) = (
            self.cfg.swarm.as_ref(),
            self.secret.as_ref(),
            self.endpoint.as_ref(),
            self.manifest.as_ref(),
            self.peers.clone(),
        ) else {
            anyhow::bail!("discovery needs the node's key, endpoint, manifest and network tier");
        };
        let port = ep.local_addr().context("the bound address")?.port();
        let me = secret.public();
        let announce = discover::Announce {
            node: me,
            // A node that does not serve is not announced: nobody could dial it.
            port: self.cfg.listen.is_some().then_some(port),
            models: vec![m.id],
            swarm: sw.swarm(),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let discovery = {
            let _g = self.rt.enter();
            discover::start(&sw.discover, &announce, tx)?
        };
        *self.discovery.lock().expect("discovery lock") = Some(discovery);
        // In a swarm only members count; an open swarm (no --swarm) admits any key.
        let dial = discover::Dialer {
            endpoint: ep.clone(),
            client: net::tls::client_config_for(
                sw.identity(secret),
                None,
                sw.admission(&[], sw.membership.is_none()),
            )?,
        };
        let book = discover::book::PeerBook::new(me, DISCOVERED_LOST_AFTER, &self.cfg.peers.peers);
        let progress = Arc::new(discover::Progress::default());
        let apply = move |c: Change| match c {
            Change::Add(peer) => {
                tracing::info!("discovered peer {peer}");
                if let Err(e) = tier.add_peers(std::slice::from_ref(&peer)) {
                    tracing::warn!("discovered peer {peer}: {e:#}");
                }
            }
            Change::Remove(key) => {
                if tier.remove_peer(&key) {
                    tracing::info!(
                        "discovered peer {} went away: removed",
                        net::short_key(&key)
                    );
                }
            }
        };
        self.rt.spawn(discover::drive(
            rx,
            book,
            m.id,
            dial,
            apply,
            progress.clone(),
        ));
        if self.cfg.peers.peers.is_empty() && self.cfg.listen.is_none() {
            let dht = sw.discover.dht.is_some();
            let t = self.peers.clone().expect("checked above");
            let ready = || {
                let have = t.inventories().iter().filter(|i| i.is_some()).count();
                match progress.settled() {
                    Some(found) => have >= found.max(1),
                    None => !dht && have > 0,
                }
            };
            let wait = sw.discover.wait.unwrap_or(DISCOVERY_WAIT);
            let until = std::time::Instant::now() + wait;
            while std::time::Instant::now() < until && !ready() {
                std::thread::sleep(Duration::from_millis(100));
            }
            if !t.inventories().iter().any(Option::is_some) {
                // Discovery's topics derive from the swarm key: without it, only open swarms.
                let open = if sw.membership.is_none() {
                    " (no --swarm given: only nodes of an open swarm are found; a private \
                     swarm's nodes are found with its --swarm key and --cert)"
                } else {
                    ""
                };
                tracing::warn!(
                    "discovery found no peer within {:.1} s{open}; peers found later are used \
                     as they come",
                    wait.as_secs_f64()
                );
            }
        }
        Ok(())
    }

    /// The swarm's coverage of the model as this node sees it (see [`crate::coverage`]):
    /// this node's experts (model folder, kept, RAM cache) and each connected peer's.
    /// `None` without a manifest (a node alone with its model folder holds every expert).
    pub fn coverage(&self) -> Option<crate::coverage::Coverage> {
        use crate::coverage::{Coverage, Holder, NodeCoverage};
        let m = self.manifest.as_ref()?;
        let local = self.local.clone()?;
        let mut experts: Vec<usize> = Vec::new();
        for e in &m.manifest.experts {
            let l = e.id.layer as usize;
            if experts.len() <= l {
                experts.resize(l + 1, 0);
            }
            experts[l] = experts[l].max(e.id.expert as usize + 1);
        }
        // This node: its folder's experts and kept ones for good, its RAM cache besides.
        let mut own_durable = local.clone();
        if let Some(d) = &self.dir {
            for id in d.kept() {
                let _ = own_durable.insert(id);
            }
        }
        let mut own_serves = own_durable.clone();
        if let Some(c) = &self.experts.tiered {
            for id in c.resident() {
                let _ = own_serves.insert(id);
            }
        }
        let placement = self
            .holdings
            .as_ref()
            .and_then(|h| h.announce.borrow().placement.clone());
        let mut nodes = vec![NodeCoverage {
            key: self
                .secret
                .as_ref()
                .map_or_else(String::new, |s| s.public().to_string()),
            addr: self.local_addr().map(|a| a.to_string()),
            this_node: true,
            connected: true,
            held: own_serves.len(),
            pinned: Some(local.len()),
            kept: self.dir.as_ref().map(|d| d.len()),
            budget: placement.as_ref().map(|p| p.budget),
            used: placement.as_ref().map(|p| p.used),
        }];
        // Each connected peer: durable copies from its placement (pinned and kept), else its
        // inventory; it serves its inventory and what it offers.
        let view = self
            .peers
            .as_ref()
            .map(|p| p.swarm_view())
            .unwrap_or_default();
        let mut sets: Vec<(ExpertSet, ExpertSet, Option<ExpertSet>)> = Vec::new();
        for p in &view {
            nodes.push(NodeCoverage::peer(p));
            let inv = p.inventory.clone();
            let durable = match (&p.placement, &inv) {
                (Some(w), _) => {
                    let mut d = w.pinned.clone();
                    for id in w.kept.iter() {
                        let _ = d.insert(id);
                    }
                    Some(d)
                }
                (None, Some(i)) => Some(i.clone()),
                (None, None) => None,
            };
            if !p.connected || p.placement.as_ref().is_some_and(|w| w.leaving) {
                continue;
            }
            if let (Some(d), Some(i)) = (durable, inv) {
                let kept = p.placement.as_ref().map(|w| w.kept.clone());
                sets.push((d, i, kept));
            }
        }
        // Same dimensions as `local`, so the set is always made.
        let own_kept = self.dir.as_ref().and_then(|d| {
            let mut k = ExpertSet::new(local.layers(), local.experts_per_layer()).ok()?;
            for id in d.kept() {
                let _ = k.insert(id);
            }
            Some(k)
        });
        let mut holders = vec![Holder {
            durable: &own_durable,
            serves: &own_serves,
            kept: own_kept.as_ref(),
        }];
        holders.extend(sets.iter().map(|(d, i, k)| Holder {
            durable: d,
            serves: i,
            kept: k.as_ref(),
        }));
        Some(Coverage::from_holders(&experts, &holders, nodes))
    }

    /// Keeps the peers dialled: one whose connection is down is dialled again as its back-off
    /// allows (looked at every second), so coverage, `/health` and placement see a peer that
    /// came back (a node that only generates dials when it fetches). A serving node does this
    /// from its start; `serve --http` asks for it. Once per node.
    pub fn keep_peers_dialled(&self) {
        if let Some(t) = &self.peers {
            if !self
                .redialling
                .swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                spawn_redial(self.rt.handle(), t.clone());
            }
        }
    }

    /// Peer exchange for a node that only fetches (`run`, `chat` and `bench` with peers; a
    /// serving node does it in its announcer): the serving nodes its peers name join its
    /// set, so it fetches from each holder directly instead of through the one it was given
    /// (whose offer goes one hop), and goes on when that one stops. Once now, then every
    /// [`ANNOUNCE_EVERY`] while the node runs.
    fn exchange_peers(&self) {
        let Some(t) = self.peers.clone() else {
            return;
        };
        add_told_peers(&t);
        self.rt.spawn(async move {
            let mut tick = tokio::time::interval(ANNOUNCE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let t = t.clone();
                // It may dial: off the async threads.
                if tokio::task::spawn_blocking(move || add_told_peers(&t))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }

    /// Waits (at most `within`) until every expert has a reachable holder, for a node that
    /// finds its peers by discovery: they answer a moment after they are found (peers named
    /// with `--peer` were dialled at start). Returns how many experts are still uncovered (0 at once for a node with no
    /// peers, or holding every expert), and warns when some are.
    pub fn wait_for_coverage(&self, within: Duration) -> usize {
        // Peers named on the command line were dialled at start (their inventories are in);
        // only discovery finds holders later.
        let discovering = self.cfg.swarm.as_ref().is_some_and(|s| s.discover.is_on());
        if self.peers.is_none() || !discovering {
            return 0;
        }
        let until = std::time::Instant::now() + within;
        loop {
            let uncovered = self.coverage().map_or(0, |c| c.uncovered().len());
            if uncovered == 0 {
                return 0;
            }
            if std::time::Instant::now() >= until {
                tracing::warn!(
                    "{uncovered} experts have no reachable holder after {:.1} s \
                     (--wait-coverage): generation fails if it routes to one of them; \
                     `stormo swarm status` shows which",
                    within.as_secs_f64()
                );
                return uncovered;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The model, loaded with `opts` over this node's experts. Call once per model instance;
    /// the node stays needed while the model runs (its tiers and runtime serve the experts).
    pub fn load_model(&self, opts: &LoadOptions) -> anyhow::Result<Model> {
        let model = Model::new(share(&self.files), self.experts.provider.clone(), opts)
            .with_context(|| format!("loading the model in {}", self.cfg.model.display()))?;
        Ok(match &self.remote {
            Some(r) => model.with_executor(r.clone()),
            None => model,
        })
    }

    /// Remote expert execution, when on (`--remote-exec` auto or always, with peers).
    pub fn remote(&self) -> Option<&Arc<RemoteExperts>> {
        self.remote.as_ref()
    }

    /// The model's files.
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    /// What the node was built from.
    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    /// The expert provider (the RAM cache over the tiers).
    pub fn provider(&self) -> Arc<dyn ExpertProvider> {
        self.experts.provider.clone()
    }

    /// The experts and their statistics.
    pub fn experts(&self) -> &Arc<Experts> {
        &self.experts
    }

    /// Reads the experts this node holds (its disk and its kept experts; see
    /// [`Announce::held`]) into the free room of its RAM cache, layer by layer, in the
    /// background at prefetch priority, evicting nothing and counting no use
    /// ([`stormo_engine::tiers::TieredExperts::warm`]), so that peers' first calls and
    /// fetches are answered from RAM, not from the disk (`stormo serve` does unless
    /// `--no-warm`). Blocks until those loads end: run it on a
    /// thread of its own. Returns how many of the held experts are in RAM then, and their
    /// bytes; a node that serves nothing warms nothing.
    pub fn warm_cache(&self) -> (usize, u64) {
        let (Some(t), Some(a)) = (self.experts.tiered.as_ref(), self.announce()) else {
            return (0, 0);
        };
        let held: Vec<ExpertId> = a.held.iter().collect();
        let queued = t.warm(&held);
        while t.loading(&queued) > 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
        let schemas = &self.files.layout.schemas;
        held.iter()
            .filter(|&&k| t.is_resident(k))
            .map(|k| {
                schemas
                    .get(k.layer as usize)
                    .and_then(Option::as_ref)
                    .map_or(0, |s| s.expert_len() as u64)
            })
            .fold((0, 0), |(n, b), len| (n + 1, b + len))
    }

    /// The node's runtime.
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    /// The node's key, when it has one (it talks to peers).
    pub fn node_key(&self) -> Option<PublicKey> {
        self.secret.as_ref().map(SecretKey::public)
    }

    /// The model id, when the node has a manifest.
    pub fn model_id(&self) -> Option<Hash> {
        self.manifest.as_ref().map(|m| m.id)
    }

    /// Where the node serves peers (the UDP address it listens and dials on).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server
            .lock()
            .expect("server lock")
            .as_ref()
            .map(ServerHandle::local_addr)
    }

    /// The serving side's counters, when it listens.
    pub fn serve_stats(&self) -> Option<Arc<net::serve::ServeStats>> {
        self.server
            .lock()
            .expect("server lock")
            .as_ref()
            .map(|s| s.stats.clone())
    }

    /// The counters of experts run for peers (remote execution), when it listens.
    pub fn exec_stats(&self) -> Option<Arc<net::exec::ExecStats>> {
        self.server
            .lock()
            .expect("server lock")
            .as_ref()
            .map(|s| s.exec_stats.clone())
    }

    /// What the node holds and offers now, when it serves.
    pub fn announce(&self) -> Option<Arc<Announce>> {
        self.holdings.as_ref().map(|h| h.announce.borrow().clone())
    }

    /// The network tier, when the node has peers (or listens and may get them).
    pub fn peer_tier(&self) -> Option<&Arc<PeerTier>> {
        self.peers.as_ref()
    }

    /// The kept experts, when the node keeps them.
    pub fn expert_dir(&self) -> Option<&Arc<ExpertDir>> {
        self.dir.as_ref()
    }

    /// The state paths of this model.
    pub fn state(&self) -> &StatePaths {
        &self.state
    }

    /// Adds peers to the peer set and connects to the new ones (see
    /// [`PeerTier::add_peers`]). A node built without peers and without listening has no
    /// network tier: that is an error.
    pub fn add_peers(&self, peers: &[PeerAddr]) -> anyhow::Result<()> {
        let t = self
            .peers
            .as_ref()
            .context("this node has no network tier (start it with --peer or --listen)")?;
        t.add_peers(peers)
    }

    /// Removes a peer from the peer set. Returns whether it was there.
    pub fn remove_peer(&self, key: &PublicKey) -> bool {
        self.peers.as_ref().is_some_and(|t| t.remove_peer(key))
    }

    /// Starts the HTTP API ([`crate::http`]) as one of the node's services, on its runtime:
    /// it serves `tm`, a model loaded on this node ([`crate::text_model::text_model_on`]),
    /// with `cfg`, and keeps the peers dialled ([`Node::keep_peers_dialled`]: `/health` and
    /// the requests routed to a peer need to see one that came back). Returns where it
    /// listens. [`Node::close`] stops it first, gracefully (running replies get
    /// `cfg.shutdown_grace`); until then the service holds the node (through `tm`). Once per
    /// node.
    pub fn start_http(
        &self,
        tm: crate::text_model::TextModel,
        cfg: crate::http::HttpConfig,
    ) -> anyhow::Result<SocketAddr> {
        anyhow::ensure!(
            std::ptr::eq(Arc::as_ptr(&tm.node), self),
            "the HTTP API serves a model loaded on another node"
        );
        let mut slot = self.http.lock().expect("http lock");
        anyhow::ensure!(slot.is_none(), "this node serves HTTP already");
        self.keep_peers_dialled();
        let server = self.rt.block_on(crate::http::start(tm, cfg))?;
        let addr = server.local_addr();
        *slot = Some(server);
        Ok(addr)
    }

    /// Where the HTTP API listens, when the node serves it.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http
            .lock()
            .expect("http lock")
            .as_ref()
            .map(crate::http::HttpServer::local_addr)
    }

    /// Blocks until SIGINT (Ctrl-C) or SIGTERM.
    pub fn wait_for_shutdown(&self) -> anyhow::Result<&'static str> {
        self.rt.block_on(crate::http::shutdown_signal())
    }

    /// Stops the node cleanly: the HTTP API first (running replies get its shutdown grace),
    /// then the peers' connections and the server (waiting up to `grace` for connections to
    /// close), and saves the expert usage counts.
    pub fn close(&self, grace: Duration) {
        let http = self.http.lock().expect("http lock").take();
        if let Some(w) = http {
            self.rt.block_on(w.shutdown());
        }
        if let Some(r) = self.replicator.lock().expect("replicator lock").take() {
            // Say goodbye before the connections close, so peers re-replicate at once.
            r.leave();
            std::thread::sleep(Duration::from_millis(300));
        }
        if let Some(p) = &self.peers {
            p.close();
        }
        if let Some(h) = self.server.lock().expect("server lock").take() {
            h.close();
            let _ = self
                .rt
                .block_on(async { tokio::time::timeout(grace, h.wait_idle()).await });
        }
        self.experts.finish();
    }

    /// Closes the network tier (at the end of a run, so that its failures are not blamed on
    /// peers) and saves the usage counts.
    pub fn finish_run(&self) {
        if let Some(p) = &self.peers {
            p.close();
        }
        self.experts.finish();
    }

    /// Lines for `--stats`: the cache's table and the network's figures.
    pub fn table(&self, prediction: (u64, u64)) -> String {
        let mut out = self.experts.table(prediction);
        out.push('\n');
        if let Some(p) = &self.peers {
            let h = p.hedge_stats();
            out += &format!(
                "  races: {} requests raced by a second one, {} won by the second, {} won by the local disk\n",
                h.hedges, h.hedge_wins, h.local_wins
            );
        }
        if let Some(r) = &self.remote {
            let s = r.stats();
            out += &format!(
                "  remote execution: {} experts run by peers ({} of rows), {} failed calls, {} spot-checks ({} disagreed, {} in the background), {} steps generated again\n",
                s.calls,
                stormo_net::progress::human_bytes(s.bytes),
                s.failures,
                s.spot_checks,
                s.spot_check_failures,
                s.deferred_checks,
                stormo_engine::generate::rollbacks()
            );
            if s.dual_calls > 0 {
                out += &format!(
                    "  --verify-exec dual: {} calls answered by two holders, {} of them differently\n",
                    s.dual_calls, s.dual_disagreements
                );
            }
        }
        if let Some(d) = &self.dir {
            out += &format!(
                "  expert dir: {} experts held, {}\n",
                d.len(),
                stormo_net::progress::human_bytes(d.used())
            );
        }
        out
    }

    /// The `"experts"` object of `--json`, with the network's figures.
    pub fn json(&self, prediction: (u64, u64)) -> serde_json::Value {
        let mut o = self.experts.json(prediction);
        if let Some(p) = &self.peers {
            let h = p.hedge_stats();
            o["peer_hedges"] = h.hedges.into();
            o["peer_hedge_wins"] = h.hedge_wins.into();
            o["peer_local_wins"] = h.local_wins.into();
            o["peer_striped_loads"] = p.striped_loads().into();
            o["peer_bytes_by_peer"] = p
                .peer_bytes()
                .into_iter()
                .map(|(addr, bytes)| (addr.to_string(), serde_json::Value::from(bytes)))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        let r = self.remote.as_ref().map(|r| r.stats()).unwrap_or_default();
        o["remote_calls"] = r.calls.into();
        o["remote_bytes"] = r.bytes.into();
        o["remote_failures"] = r.failures.into();
        o["spot_checks"] = r.spot_checks.into();
        o["spot_check_failures"] = r.spot_check_failures.into();
        o["deferred_checks"] = r.deferred_checks.into();
        o["dual_calls"] = r.dual_calls.into();
        o["dual_disagreements"] = r.dual_disagreements.into();
        o["rollbacks"] = stormo_engine::generate::rollbacks().into();
        if let Some(d) = &self.dir {
            o["dir_held"] = (d.len() as u64).into();
            o["dir_held_bytes"] = d.used().into();
        }
        o
    }
}

/// The manifest in the model folder (or at `manifest`), taken as it is, with its id and bytes.
fn own_manifest(dir: &Path, manifest: Option<&Path>) -> anyhow::Result<(Manifest, Hash, Vec<u8>)> {
    let path = ManifestPaths::resolve(dir, manifest).bin;
    let (m, bytes) = stormo_manifests::read_manifest(&path).with_context(|| {
        format!(
            "reading the manifest (create it with `stormo manifest build --model {}`)",
            dir.display()
        )
    })?;
    let id = Hash::of(&bytes);
    Ok((m, id, bytes))
}

pub use crate::config::DEFAULT_KEEP_LIMIT;

/// How long a node given no peer waits for discovery to find the first ones.
const DISCOVERY_WAIT: Duration = Duration::from_secs(15);

/// How long a peer found on the DHT stays in the peer set after it last answered: three
/// lookups' time (a lookup dials every address it finds).
const DISCOVERED_LOST_AFTER: Duration =
    Duration::from_secs(3 * stormo_net::discover::dht::LOOKUP_EVERY.as_secs());

/// Says what remote execution under `cfg` will not do that its options suggest: unchecked
/// results (`--spot-check 0`), or `--remote-exec always` with no peer allowed to compute.
fn warn_remote(cfg: &NodeConfig) {
    let p = &cfg.peers;
    if p.remote.spot_check == 0.0 {
        tracing::warn!(
            "--spot-check 0: a peer's results are used unchecked after its first answer, so a \
             peer that computes wrong changes the output. Give a share above 0 (default 0.05) \
             or --remote-exec never (fetched experts are always verified)"
        );
    }
    let member = cfg.swarm.as_ref().is_some_and(|s| s.membership.is_some());
    if p.remote.mode == RemoteExec::Always && !member && !p.exec_trust.names_peers() {
        tracing::warn!(
            "--remote-exec always: no peer may compute for this node (remote execution goes to \
             members of this node's swarm and to keys given with --exec-trust; --exec-trust any \
             lets every peer compute, its results spot-checked): experts are fetched instead"
        );
    }
}

/// Remote execution over `tier` (`--remote-exec auto|always`): the engine's executor that has
/// peers holding an expert compute it. `on_machine`: the tiers on this machine, whose experts
/// are never computed by a peer.
fn remote_experts(
    tier: &Arc<PeerTier>,
    rt: &tokio::runtime::Handle,
    files: &ModelFiles,
    p: &crate::config::PeersConfig,
    experts: &Experts,
    on_machine: Vec<Arc<dyn Tier>>,
) -> Arc<RemoteExperts> {
    let hidden = files.cfg.hidden_size;
    let client = PeerExec::new(
        tier.clone(),
        hidden,
        p.timeouts.request_timeout,
        p.exec_trust.clone(),
    );
    let sizes = files.layout.sizes();
    // A decoded token's experts: top-k of each MoE layer, at the layer's mean size.
    let per_token: u64 = sizes
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| l.iter().sum::<u64>() / l.len() as u64 * files.cfg.top_k as u64)
        .sum();
    let x = RemoteExperts::new(
        Arc::new(client),
        rt.clone(),
        p.remote,
        experts.tiered.clone(),
        on_machine,
        sizes,
        hidden,
        p.timeouts.request_timeout,
    );
    if let Some(t) = &experts.tiered {
        x.set_cache(t.budget(), per_token);
    }
    let x = if p.remote.inline {
        x
    } else {
        x.with_deferred_checks(files.layout.schemas.clone())
    };
    Arc::new(x)
}

/// The most peers a node's set takes in from the serving peers that dialled it
/// ([`add_serving_peer`]) and those its peers named (peer exchange); beyond it they are left
/// out (a bound on what strangers can add where any node may connect, `--allow-any`).
const MAX_DIALLED_IN_PEERS: usize = 256;

/// Adds `p`, a peer serving the model that dialled this node, to `tier`'s peer set unless a
/// peer of its key is there already and serves at its address (one given with `--peer` or
/// found by discovery that works stays as it is; one that does not, such as a node restarted
/// on another port, moves to the address the connection proved), or the set is full
/// ([`MAX_DIALLED_IN_PEERS`]).
fn add_serving_peer(tier: &Arc<PeerTier>, p: PeerAddr) {
    match tier.peer_serving(&p.key) {
        Some((addr, _)) if addr == p.addr => return,
        Some((addr, true)) => {
            // The entry still looks up: a node restarted elsewhere is found lost only when its
            // old connection times out. Look again until then, and move it if it is gone
            // (a second node with the same key, still up, keeps the entry where it is).
            let (tier, p) = (tier.clone(), p.clone());
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let until = tokio::time::Instant::now() + MOVE_WAIT;
                    while tokio::time::Instant::now() < until {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        match tier.peer_serving(&p.key) {
                            Some((a, false)) if a == addr => {
                                move_peer(&tier, &p, addr);
                                return;
                            }
                            Some((a, true)) if a == addr => {}
                            _ => return,
                        }
                    }
                });
            }
            return;
        }
        Some((addr, false)) => {
            move_peer(tier, &p, addr);
            return;
        }
        None => {}
    }
    let known = tier.peer_addrs();
    if known.len() >= MAX_DIALLED_IN_PEERS {
        tracing::debug!("peer {p} dialled in serving the model: the peer set is full");
        return;
    }
    tracing::info!("peer {p} dialled in serving the model: added to the peer set");
    if let Err(e) = tier.add_peers(std::slice::from_ref(&p)) {
        tracing::warn!("peer {p}: {e:#}");
    }
}

/// How long a node that dialled in from a new address waits for its old entry to be found
/// lost before the entry moves ([`add_serving_peer`]): the QUIC idle timeout and a margin.
const MOVE_WAIT: Duration = Duration::from_secs(20);

/// Moves `p`'s entry in `tier` from `from` to its address (the peer dialled in from there).
fn move_peer(tier: &PeerTier, p: &PeerAddr, from: SocketAddr) {
    tracing::info!("peer {p} dialled in serving the model: moved from {from}");
    if let Err(e) = tier.add_peers(std::slice::from_ref(p)) {
        tracing::warn!("peer {p}: {e:#}");
    }
}

/// Peer exchange: adds to `tier`'s set the serving nodes that its peers serving now named
/// ([`PeerTier::told_peers`]) and that it does not have, while the set holds fewer than
/// `MAX_DIALLED_IN_PEERS` (256), and dials them (in the background inside a runtime, else
/// before returning, each bounded by the connect timeout).
pub fn add_told_peers(tier: &PeerTier) {
    let told = tier.told_peers();
    if told.is_empty() {
        return;
    }
    // A named node the set has at another address replaces that entry (no new room).
    let room = MAX_DIALLED_IN_PEERS.saturating_sub(tier.peer_addrs().len());
    let (moved, told): (Vec<_>, Vec<_>) = told
        .into_iter()
        .partition(|p| tier.peer_serving(&p.key).is_some());
    for p in &moved {
        tracing::info!("peer {p} named by a peer: moved to this address");
    }
    if !moved.is_empty() {
        if let Err(e) = tier.add_peers(&moved) {
            tracing::warn!("peers named by a peer: {e:#}");
        }
    }
    if told.is_empty() {
        return;
    }
    if room < told.len() {
        tracing::debug!(
            "{} peers named by peers left out: the peer set is full",
            told.len() - room
        );
    }
    let take: Vec<_> = told.into_iter().take(room).collect();
    for p in &take {
        tracing::info!("peer {p} named by a peer: added to the peer set");
    }
    if let Err(e) = tier.add_peers(&take) {
        tracing::warn!("peers named by a peer: {e:#}");
    }
}

/// The manifest phase of [`Node::start_on`]: the folder's own manifest when there are no
/// peers' bytes to check, else the one [`crate::manifest::resolve_manifest_on`] accepts
/// (fetched, when the folder has none, through the node's `endpoint`); it must describe the
/// checkpoint opened.
fn node_manifest(
    cfg: &NodeConfig,
    files: &ModelFiles,
    secret: &SecretKey,
    rt: &tokio::runtime::Runtime,
    endpoint: Option<&quinn::Endpoint>,
) -> anyhow::Result<NodeManifest> {
    let p = &cfg.peers;
    let (m, id, bytes) = if p.peers.is_empty() && p.model_id.is_none() && p.trust.is_empty() {
        // No peer's bytes to check: the folder's own manifest describes what this node
        // serves and keeps (its peers check it against their own pin).
        own_manifest(&cfg.model, p.manifest.as_deref())?
    } else {
        crate::manifest::resolve_manifest_on(&cfg.model, p, secret, rt, endpoint)?
    };
    net::serve::check_layout(&m, &files.layout.sizes())
        .context("the manifest does not describe this checkpoint")?;
    Ok(NodeManifest {
        manifest: Arc::new(m),
        id,
        bytes: Bytes::from(bytes),
    })
}

/// What the tiers phase of [`Node::start_on`] builds.
struct Tiers {
    kept: Option<Arc<ExpertDir>>,
    peers: Option<Arc<PeerTier>>,
    experts: Arc<Experts>,
    remote: Option<Arc<RemoteExperts>>,
}

/// The tiers phase of [`Node::start_on`]: the kept experts, the local disk, the peers (over
/// the node's key and endpoint, `net`, with a manifest), the RAM cache over them all (its
/// budget from `memory` under `--expert-cache auto`), and remote execution over the peers.
fn build_tiers(
    cfg: &NodeConfig,
    files: &ModelFiles,
    (plan, memory): (&NodePlan, &MemoryPlan),
    state: &StatePaths,
    rt: &tokio::runtime::Runtime,
    net: Option<(&SecretKey, &quinn::Endpoint)>,
    manifest: Option<&NodeManifest>,
) -> anyhow::Result<Tiers> {
    let p = &cfg.peers;
    let kept = match (&p.keep, manifest) {
        (Some(k), Some(m)) => {
            let root = k.dir.clone().unwrap_or_else(|| state.experts.clone());
            // With replica placement, what goes beyond the limit is placement's to choose.
            let placing = cfg.listen.as_ref().is_some_and(|l| l.replicas > 0);
            let (manifest, schemas) = (m.manifest.clone(), files.layout.schemas.clone());
            let dir = if placing {
                ExpertDir::open_placed(&root, m.id, k.limit, manifest, schemas)?
            } else {
                ExpertDir::open(&root, m.id, k.limit, manifest, schemas)?
            };
            // Two nodes placing copies in one folder would each announce the other's, and
            // delete them by their own budgets. A node that holds every expert in its folder
            // (a seeder, or two nodes of one folder on a machine) places nothing and only
            // reads the kept ones.
            let holds_all = plan.uses_local && !plan.dense_only && plan.allowed.is_none();
            anyhow::ensure!(
                !placing || holds_all || !dir.is_shared(),
                "the expert directory {} is in use by another stormo process (a node or run \
                 on the same --state-dir): give this node its own --state-dir (or \
                 --expert-dir), or stop the other",
                dir.root().display()
            );
            Some(Arc::new(dir))
        }
        _ => None,
    };
    let disk: Option<Arc<dyn Tier>> = if plan.uses_local && !cfg.experts.mmap {
        Some(Arc::new(files.disk_tier(
            cfg.experts.io_threads.max(1),
            plan.allowed.clone(),
        )?))
    } else {
        None
    };
    let peers = match (net, manifest) {
        (Some(net), Some(m)) => Some(Arc::new(peer_tier(
            cfg,
            rt,
            net,
            m,
            files,
            kept.as_ref(),
            disk.as_ref(),
        )?)),
        _ => None,
    };
    // The tiers on this machine: an expert they hold is never computed by a peer.
    let mut on_machine: Vec<Arc<dyn Tier>> = disk.iter().cloned().collect();
    if let Some(d) = &kept {
        on_machine.push(Arc::new(DirTier(d.clone())));
    }
    let mut tiers: Vec<Arc<dyn Tier>> = Vec::new();
    if !p.peers_first {
        tiers.extend(disk.clone());
    }
    if let Some(d) = &kept {
        tiers.push(Arc::new(DirTier(d.clone())));
    }
    if let Some(t) = &peers {
        tiers.push(t.clone());
    }
    if p.peers_first {
        tiers.extend(disk);
    }
    let usage = cfg.experts.hot_store.then(|| state.usage());
    if let Some(parent) = usage.as_ref().and_then(|u| u.parent()) {
        if let Err(e) = std::fs::create_dir_all(parent) {
            tracing::warn!(
                "cannot create the state directory {} ({e}); expert usage is not recorded",
                parent.display()
            );
        }
    }
    let experts = Arc::new(Experts::build_within(
        files,
        &cfg.experts,
        memory,
        cfg.context.max(1),
        tiers,
        usage,
    )?);
    let remote = match &peers {
        Some(t) if p.remote.mode != RemoteExec::Never && !cfg.experts.mmap => {
            warn_remote(cfg);
            Some(remote_experts(
                t,
                rt.handle(),
                files,
                p,
                &experts,
                on_machine,
            ))
        }
        _ => None,
    };
    Ok(Tiers {
        kept,
        peers,
        experts,
        remote,
    })
}

/// The peer tier of a node with a manifest `m`, dialling from `endpoint` as `secret`: the
/// swarm's membership, the kept experts it keeps into, the local disk it races (with
/// `peers_first`), and the peers given.
fn peer_tier(
    cfg: &NodeConfig,
    rt: &tokio::runtime::Runtime,
    (secret, endpoint): (&SecretKey, &quinn::Endpoint),
    m: &NodeManifest,
    files: &ModelFiles,
    kept: Option<&Arc<ExpertDir>>,
    disk: Option<&Arc<dyn Tier>>,
) -> anyhow::Result<PeerTier> {
    let p = &cfg.peers;
    let mut t = PeerTier::new(
        endpoint.clone(),
        rt.handle().clone(),
        secret,
        m.manifest.clone(),
        m.id,
        files.layout.schemas.clone(),
        p.timeouts,
    );
    if let Some(sw) = cfg.swarm.as_ref().filter(|s| s.membership.is_some()) {
        t = t.with_membership(
            sw.membership.as_ref().map(|m| m.cert.clone()),
            sw.admission(&[], false),
        );
    }
    if let Some(d) = kept {
        t.set_expert_dir(d.clone());
    }
    if let (true, Some(d)) = (p.peers_first, disk) {
        t.set_local(d.clone());
    }
    // One peer list for a whole swarm (a shared config file) names each node too.
    for own in p.peers.iter().filter(|q| q.key == secret.public()) {
        tracing::warn!(
            "--peer {own} has this node's own key (--key): left out, a node does not dial \
             itself"
        );
    }
    if cfg.listen.is_some() {
        // Its hellos say it serves from its first dials on (made before serving starts).
        t.set_serving();
        // A serving node does not hold its listener back for its peers' handshakes (a peer
        // that does not answer takes the whole connect timeout): placement waits for them
        // on its own (its settle time), and a load dials a peer not yet reached.
        t.add_peers_in_background(&p.peers)?;
    } else {
        t.add_peers(&p.peers)?;
    }
    Ok(t)
}

/// How often the peers whose connection is down are looked at. A peer is dialled when its
/// back-off allows ([`PeerTier::redial_down`]), and the loop waits for the attempts: one that
/// was still starting when first dialled (nodes started together) is reached about 1 s after
/// that first dial failed (its one quick retry), not 3-6 s; one that stays down is dialled
/// after 1, 2, 4 ... 60 s, each attempt one failure of it.
const REDIAL_EVERY: Duration = Duration::from_secs(1);

/// Dials again, every [`REDIAL_EVERY`], the peers whose connection is down and whose back-off
/// is over (one that was not up yet when this node started, or one restarted): the peer tier
/// dials on its own only when it fetches, and coverage, `/health` and placement need to see a
/// peer that came back. The peer stays in the set meanwhile, with its policy state: taking it
/// out and adding it again started its back-off over (1 s, never doubling) and made loads
/// wait for it as for a peer never tried, again and again.
fn spawn_redial(rt: &tokio::runtime::Handle, tier: Arc<PeerTier>) {
    rt.spawn(async move {
        let mut tick = tokio::time::interval(REDIAL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            tier.redial_down().await;
        }
    });
}

/// Recomputes what a serving node holds and offers.
#[derive(Clone)]
struct Announcer {
    holdings: Arc<Holdings>,
    /// The experts on the local disk that the node serves.
    local: ExpertSet,
    cache: Option<Arc<stormo_engine::tiers::TieredExperts>>,
    dir: Option<Arc<ExpertDir>>,
    peers: Option<Arc<PeerTier>>,
}

impl Announcer {
    /// Held: the local experts, the kept ones, and those verified in the RAM cache. Offered:
    /// those the direct peers hold and this node does not.
    fn refresh(&self) {
        let mut held = self.local.clone();
        if let Some(c) = &self.cache {
            for k in c.resident() {
                let _ = held.insert(k);
            }
        }
        if let Some(d) = &self.dir {
            for e in &self.holdings.manifest.experts {
                if d.contains(e.id) {
                    let _ = held.insert(e.id);
                }
            }
        }
        let shape = (held.layers(), held.experts_per_layer());
        let mut offered = self
            .peers
            .as_ref()
            .and_then(|p| p.held_by_peers(shape))
            .unwrap_or_else(|| Announce::holding(held.clone()).offered);
        for e in held.iter() {
            let _ = offered.remove(e);
        }
        let peers = match &self.peers {
            Some(tier) => {
                // Peer exchange: the serving nodes this node's peers told it of join its set
                // (a star of nodes that were each given only the seeder becomes a mesh).
                add_told_peers(tier);
                tier.serving_entries()
            }
            None => Vec::new(),
        };
        // The placement announcement is the driver's: left as it is now, not as it was when
        // this refresh began.
        self.holdings.set_inventory(held, offered, peers);
    }
}
