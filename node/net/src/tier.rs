//! The network tier: a [`Tier`] named "peer" that fetches experts from a set of peers.
//!
//! For each requested expert it picks a peer whose inventory holds it (fewest requests in
//! flight, then the shortest expected time from measured round trip and throughput), streams
//! the record on its own QUIC stream through a [`stormo_wire::Requests`] straight into the
//! buffer the kernels will read (huge pages, allocated once per load: the payload bytes are
//! copied once, from the chunks quinn received), and checks every chunk against the manifest
//! as it arrives, in that buffer. On any failure (a bad chunk, a timeout or silence, a lost
//! connection, a peer that does not hold what it advertised, another protocol version) it
//! logs a warning naming the peer, puts the peer on a growing back-off, and goes on with
//! another peer, resuming after the verified prefix; only when no peer can supply the expert
//! does it complete with an error, so the tiers above fall back. A try that runs out of time
//! (or hears nothing of its own answer) while the peer is still sending on the connection, or
//! a `busy` answer, is load rather than a fault: the peer is not put on a back-off. A try is
//! cut off at its deadline only while another holder is left to try; otherwise it runs on
//! while its chunks keep verifying. When every holder has been tried another round starts
//! with a longer deadline (big experts over a link that many loads share); the rounds end
//! after a few that verify nothing more and meet no `busy` answer.
//!
//! An expert that several peers hold, long enough to be worth it ([`policy::stripes`]), is
//! striped: its buffer is split into chunk-aligned parts, one per holder, each fetched at once
//! with the same tries and rounds as a whole record (starting at its holder, going on to the
//! others after a failure, resuming after its verified chunks), into its part of the buffer;
//! the parts join back into the record without a copy once each verified. A stripe whose try
//! falls far behind a finished one ([`policy::far_behind`]) is made to give up, and its rest
//! goes to an idle holder ([`policy::idle_holder_left`]). Striped loads are not hedged on
//! time.
//!
//! A try whose connection hears nothing for longer than the peer's latency explains
//! ([`policy::silence_limit`]) is raced by another holder at once (a stripe's rest moves to a
//! connected holder), and the peer is suspect, asked last, until its connection is heard
//! again; a holder whose connection is up is asked before one that needs a dial, and a try
//! waiting on a dial is raced by a connected holder at once.
//!
//! Keys are fetched in parallel, each on its own task. Prefetch loads are sent with the
//! `Prefetch` priority. Every wait is bounded: the connect (handshake plus hello), each try's
//! deadline (from when its request is sent; moved on only by verified chunks, never past the
//! load's budget of 32 first deadlines), the silence between two pieces of an answer, and the
//! rounds (no later try starts past that budget).
//!
//! A peer that cannot be connected to is unreachable for its back-off: one connection attempt
//! at a time (concurrent loads wait for it rather than each connecting), and until the
//! back-off ends every try at it fails at once, naming the peer and why, without connecting
//! again (after its very first failed attempt, one more is made that loads with no other
//! source wait for: a peer starting, or slow on a busy machine). A peer whose connection was up
//! and was lost (closed, reset, or silent for the silence deadline: killed, stopped or
//! restarting) is redialled with back-off a bounded number of times, and loads that have no
//! other source wait for it in rounds like slow peers, so a holder that comes back is used
//! again; one that does not ends them with an error naming it.
//!
//! Every decision of a load (which holder, when to hedge, the rounds, the stripes, a
//! straggler moved, a silent connection) is made by the sans-IO state machine
//! [`crate::load::Load`] with [`policy`]'s rules; this module and its parts only move bytes:
//! - `driver`: runs a load's machine and turns its actions into dials, tries and cancels;
//! - `link`: connecting, the control stream, liveness;
//! - `request`: one request on a stream of its own into a record's buffer, verified chunk by
//!   chunk; the whole requests of a pull ([`fetch_manifest`], [`PeerLink`]);
//! - `exec_client`: remote execution's calls ([`PeerTier::exec`]).
//!
//! Failed tries that another peer made up for are counted through
//! [`Tier::retried_failures`], so the statistics show them as failures and fallbacks.

mod driver;
mod exec_client;
mod link;
mod request;

pub use exec_client::{ExecLink, ExecRequest, EXEC_IN_FLIGHT};
pub use request::{fetch_manifest, fetch_manifest_on, PeerLink};

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use stormo_engine::moe::ExpertSchema;
use stormo_engine::tiers::{Completion, ExpertId, Priority, Tier};
use stormo_manifests::{Hash, Manifest, PublicKey, SecretKey};
use stormo_wire::{ExpertSet, NodeId};

use crate::policy::{self, PeerView};
use crate::{tls, PeerAddr};
use link::{client_endpoint, link, Link};

/// One peer as [`PeerTier::swarm_view`] sees it.
#[derive(Clone, Debug)]
pub struct PeerSnapshot {
    /// Its key and address.
    pub addr: PeerAddr,
    /// The experts it holds (`None`: not heard yet).
    pub inventory: Option<ExpertSet>,
    /// Its last placement announcement.
    pub placement: Option<stormo_wire::Placement>,
    /// Its connection is up and its control stream open.
    pub connected: bool,
}

/// Timeouts of the network tier.
#[derive(Clone, Copy, Debug)]
pub struct PeerConfig {
    /// The longest a connection (QUIC handshake, hello and inventory) may take.
    pub connect_timeout: Duration,
    /// The deadline of one try at one peer for one expert, from when the request is sent
    /// (waiting for a connection or a request slot is not counted). Doubled for each later
    /// round over the holders (up to 8 times), and moved on while chunks verify when no other
    /// holder is left to try (see [`crate::load`]).
    pub request_timeout: Duration,
    /// The longest wait for the first frame of an answer or between two frames.
    pub idle_timeout: Duration,
    /// The shortest delay before a demand request is hedged (raced by a second request).
    pub hedge_min: Duration,
    /// The longest delay before a demand request is hedged.
    pub hedge_max: Duration,
    /// The smallest stripe of a record fetched from several holders at once: a record shorter
    /// than two of them comes whole from one peer ([`policy::MIN_STRIPE`] by default;
    /// `u64::MAX` never stripes).
    pub stripe_min: u64,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            connect_timeout: crate::CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(5),
            hedge_min: Duration::from_millis(20),
            hedge_max: Duration::from_secs(2),
            stripe_min: policy::MIN_STRIPE,
        }
    }
}

impl PeerConfig {
    /// The timeouts of `--peer-timeout SECS`: every request to a peer answered within
    /// `timeout` of being sent (longer in later rounds while peers are still sending), a
    /// connection attempt within [`crate::CONNECT_TIMEOUT`] or `timeout`, the shorter, and the
    /// gap between frames within 5 s or `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            connect_timeout: crate::CONNECT_TIMEOUT.min(timeout),
            request_timeout: timeout,
            idle_timeout: timeout.min(Duration::from_secs(5)),
            ..Self::default()
        }
    }
}

/// Counters of the network tier's races.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HedgeStats {
    /// Demand requests raced by a second request (to another peer or the local disk).
    pub hedges: u64,
    /// Races won by the second request.
    pub hedge_wins: u64,
    /// Races won by the local disk.
    pub local_wins: u64,
}

/// One peer of the set: its address, the TLS client configuration that pins its key, its
/// link (dialled one attempt at a time), and what the policy knows of it.
pub(crate) struct Peer {
    pub(crate) addr: PeerAddr,
    pub(crate) client: quinn::ClientConfig,
    pub(crate) link: Arc<tokio::sync::Mutex<Option<Arc<Link>>>>,
    pub(crate) state: Mutex<PeerView>,
}

impl Peer {
    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, PeerView> {
        self.state.lock().expect("peer state lock")
    }
}

/// What the tier's loads, calls and links share.
pub(crate) struct Inner {
    pub(crate) cfg: PeerConfig,
    pub(crate) me: NodeId,
    pub(crate) endpoint: quinn::Endpoint,
    pub(crate) model: Hash,
    pub(crate) manifest: Arc<Manifest>,
    pub(crate) schemas: Vec<Option<ExpertSchema>>,
    /// Every peer ever added, in the order added (indices stay valid: a removed peer is only
    /// marked), replaced whole when one is added.
    pub(crate) peers: Mutex<Arc<Vec<Arc<Peer>>>>,
    /// This node's key, for the TLS client configuration of peers added later.
    pub(crate) secret: SecretKey,
    /// This node's swarm membership certificate, presented to every peer it dials.
    pub(crate) membership: Option<stormo_manifests::Membership>,
    /// Which servers it accepts besides the key pinned per peer (a swarm's members).
    pub(crate) servers: tls::Admission,
    /// The watch over the connections this node dials, under `servers`: one whose server the
    /// policy refuses later (its key revoked, its certificate expired) is closed within about a
    /// second, as the peer server closes those it accepted ([`tls::LiveMembers`]). `None` when
    /// no verdict of the policy can change.
    pub(crate) dialled: Option<Arc<tls::LiveMembers>>,
    /// Set by [`PeerTier::close`]: failures after it are the shutdown, not the peers'.
    pub(crate) closing: std::sync::atomic::AtomicBool,
    /// This node serves the model on the endpoint it dials from: its hello says so, and the
    /// peers it dials may add it to their peer sets ([`PeerTier::set_serving`]).
    pub(crate) serving: std::sync::atomic::AtomicBool,
    /// A local tier (the disk) that a slow demand request is raced against when no other
    /// peer holds the expert.
    pub(crate) local: std::sync::OnceLock<Arc<dyn Tier>>,
    /// Where verified experts are also written (`--expert-dir`).
    pub(crate) store: std::sync::OnceLock<Arc<crate::expert_dir::ExpertDir>>,
    pub(crate) hedges: Mutex<HedgeStats>,
    /// Failed tries at peers that were followed by a try elsewhere ([`Tier::retried_failures`]).
    pub(crate) retried: AtomicU64,
    /// Loads striped across several holders that ended with the record.
    pub(crate) striped: AtomicU64,
}

/// The network tier. See the module docs.
pub struct PeerTier {
    inner: Arc<Inner>,
    rt: tokio::runtime::Handle,
    _own: Option<OwnedRuntime>,
}

/// A runtime shut down without waiting when the tier goes (possibly on one of its own threads,
/// where a blocking drop would panic).
struct OwnedRuntime(Option<Arc<tokio::runtime::Runtime>>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take().and_then(|a| Arc::try_unwrap(a).ok()) {
            rt.shutdown_background();
        }
    }
}

impl fmt::Debug for PeerTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<String> = self
            .inner
            .peers()
            .iter()
            .map(|p| p.addr.to_string())
            .collect();
        f.debug_struct("PeerTier")
            .field("model", &self.inner.model.short())
            .field("peers", &peers)
            .finish()
    }
}

impl PeerTier {
    /// Connects to `peers` (in parallel, each bounded by the connect timeout) as `secret`, for
    /// the model of `manifest` whose experts have `schemas` (`files.layout.schemas`). Peers
    /// that cannot be reached are warned about and retried later. Runs on `rt` if given, else
    /// on a runtime of its own, and dials from an endpoint of its own (a node that also serves
    /// uses [`PeerTier::new`] with its one endpoint).
    pub fn connect(
        secret: &SecretKey,
        peers: &[PeerAddr],
        manifest: Arc<Manifest>,
        model: Hash,
        schemas: Vec<Option<ExpertSchema>>,
        cfg: PeerConfig,
        rt: Option<tokio::runtime::Handle>,
    ) -> anyhow::Result<Self> {
        let (rt, own) = match rt {
            Some(h) => (h, None),
            None => {
                let r = Arc::new(
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .thread_name("stormo-net")
                        .enable_all()
                        .build()
                        .context("starting the network runtime")?,
                );
                (r.handle().clone(), Some(r))
            }
        };
        let endpoint = {
            let _g = rt.enter();
            client_endpoint(peers)?
        };
        let mut t = Self::new(endpoint, rt, secret, manifest, model, schemas, cfg);
        t._own = own.map(|r| OwnedRuntime(Some(r)));
        t.add_peers(peers)?;
        Ok(t)
    }

    /// A network tier with no peers yet, dialing from `endpoint` (which may also serve) on
    /// `rt`. Peers join with [`PeerTier::add_peers`] and leave with [`PeerTier::remove_peer`].
    pub fn new(
        endpoint: quinn::Endpoint,
        rt: tokio::runtime::Handle,
        secret: &SecretKey,
        manifest: Arc<Manifest>,
        model: Hash,
        schemas: Vec<Option<ExpertSchema>>,
        cfg: PeerConfig,
    ) -> Self {
        let inner = Arc::new(Inner {
            cfg,
            me: NodeId(*secret.public().as_bytes()),
            endpoint,
            model,
            manifest,
            schemas,
            peers: Mutex::new(Arc::new(Vec::new())),
            secret: SecretKey::from_seed(&secret.seed()),
            membership: None,
            servers: tls::Admission::Any,
            dialled: None,
            closing: Default::default(),
            serving: Default::default(),
            local: Default::default(),
            store: Default::default(),
            hedges: Default::default(),
            retried: Default::default(),
            striped: Default::default(),
        });
        Self {
            inner,
            rt,
            _own: None,
        }
    }

    /// Dials as a member of a swarm: presents `membership` in every handshake and accepts a
    /// server only if `servers` admits it (besides proving the pinned key). Call before any
    /// peer is added.
    pub fn with_membership(
        mut self,
        membership: Option<stormo_manifests::Membership>,
        servers: tls::Admission,
    ) -> Self {
        let dialled = {
            let _in = self.rt.enter();
            tls::LiveMembers::start(servers.clone())
        };
        let inner = Arc::get_mut(&mut self.inner).expect("no peer added yet");
        inner.membership = membership;
        inner.servers = servers;
        inner.dialled = dialled;
        self
    }

    /// Adds `peers` to the peer set and connects to the new ones (in parallel, each bounded by
    /// the connect timeout), returning when every attempt has ended. A peer already in the set
    /// under the same key and address is left as it is; one under the same key at another
    /// address replaces it; one removed before comes back with its view as it was (see
    /// `Inner::add_peers`). Unreachable peers are warned about and retried later.
    pub fn add_peers(&self, peers: &[PeerAddr]) -> anyhow::Result<()> {
        self.add_and_connect(peers, true)
    }

    /// [`PeerTier::add_peers`] without waiting for the connections: they are made on the
    /// tier's runtime while the caller goes on. For a node that serves, whose listener need not
    /// wait for a peer that does not answer (its handshake's whole timeout).
    pub fn add_peers_in_background(&self, peers: &[PeerAddr]) -> anyhow::Result<()> {
        self.add_and_connect(peers, false)
    }

    fn add_and_connect(&self, peers: &[PeerAddr], wait: bool) -> anyhow::Result<()> {
        let added = self.inner.add_peers(peers)?;
        if added.is_empty() {
            return Ok(());
        }
        let i2 = self.inner.clone();
        let connect_all = async move {
            let tasks: Vec<_> = added
                .into_iter()
                .map(|p| {
                    let i = i2.clone();
                    // A failure is marked (and warned about) by `link`.
                    tokio::spawn(async move { link(&i, &p).await })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        };
        if !wait {
            self.rt.spawn(connect_all);
            return Ok(());
        }
        match tokio::runtime::Handle::try_current() {
            // Inside a runtime (a discovery task): connect in the background.
            Ok(_) => {
                self.rt.spawn(connect_all);
            }
            Err(_) => self.rt.block_on(connect_all),
        }
        let peers = self.inner.peers();
        let live: Vec<_> = peers.iter().filter(|p| !p.state().removed).collect();
        let reachable = live
            .iter()
            .filter(|p| p.state().inventory.is_some())
            .count();
        tracing::info!("{reachable} of {} peers reachable", live.len());
        Ok(())
    }

    /// Dials again each peer of the set whose connection is down, as a load would (`link`):
    /// through the policy, so that a peer that cannot be connected to is dialled again only
    /// once its back-off is over (1 s, doubling with each failed attempt in a row up to 60 s:
    /// [`policy::PeerView::fail`]) and a lost one as its reconnection pauses allow, and each
    /// failed attempt is one failure of the peer's one view. A peer whose connection is up,
    /// or that an attempt (or a load) holds, is left alone. Returns when the attempts it
    /// started have ended. For a node that must see a peer come back without fetching from
    /// it (coverage, `/health`, placement).
    pub async fn redial_down(&self) {
        if self.inner.closing.load(Ordering::SeqCst) {
            return;
        }
        let tasks: Vec<_> = self
            .inner
            .peers()
            .iter()
            .filter(|p| p.state().usable())
            .filter(|p| {
                p.link
                    .try_lock()
                    .is_ok_and(|g| g.as_ref().is_none_or(|l| l.conn.close_reason().is_some()))
            })
            .map(|p| {
                let (inner, p) = (self.inner.clone(), p.clone());
                // A failure is marked (and warned about) by `link`; a refusal to dial during
                // the back-off changes nothing.
                self.rt
                    .spawn(async move { link(&inner, &p).await.map(|_| ()) })
            })
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    }

    /// Marks this node as serving the model on the endpoint it dials from: the hellos of its
    /// later dials name the model, so a peer it dials learns that it can dial it back at the
    /// connection's address ([`crate::serve::ServeConfig::serving_peers`]).
    pub fn set_serving(&self) {
        self.inner.serving.store(true, Ordering::SeqCst);
    }

    /// Removes the peer with node key `key` from the peer set (closing its connection).
    /// Returns whether it was there.
    pub fn remove_peer(&self, key: &PublicKey) -> bool {
        self.inner.remove_peer(key)
    }

    /// The peers in the set now.
    pub fn peer_addrs(&self) -> Vec<PeerAddr> {
        self.inner
            .peers()
            .iter()
            .filter(|p| !p.state().removed)
            .map(|p| p.addr.clone())
            .collect()
    }

    /// The experts that peers serving now hold (their inventories), in `shape`: a peer whose
    /// connection is down, that is leaving or was dropped counts with nothing, so a node's
    /// offer never outlives the holder it came from ([`policy::PeerView::serving_now`]).
    pub fn held_by_peers(&self, shape: (u16, u16)) -> Option<ExpertSet> {
        let mut out = ExpertSet::new(shape.0, shape.1).ok()?;
        for p in self.inner.peers().iter() {
            let s = p.state();
            if !s.serving_now() {
                continue;
            }
            if let Some(inv) = s.inventory.as_ref() {
                for e in inv.iter() {
                    let _ = out.insert(e);
                }
            }
        }
        Some(out)
    }

    /// What this node knows of each peer in the set: its key, its inventory, its last
    /// placement announcement, and whether its connection is up now.
    pub fn swarm_view(&self) -> Vec<PeerSnapshot> {
        self.inner
            .peers()
            .iter()
            .filter_map(|p| {
                let s = p.state();
                (!s.removed).then(|| PeerSnapshot {
                    addr: p.addr.clone(),
                    inventory: s.inventory.clone(),
                    placement: s.placement.clone(),
                    connected: s.control_open
                        && s.banned.is_none()
                        && s.lost.is_none()
                        && s.unreachable.is_none(),
                })
            })
            .collect()
    }

    /// The address the peer set has for `key`, and whether that peer serves now (`None`: no
    /// such peer in the set).
    pub fn peer_serving(&self, key: &PublicKey) -> Option<(std::net::SocketAddr, bool)> {
        self.inner
            .peers()
            .iter()
            .filter(|p| !p.state().removed && p.addr.key == *key)
            .map(|p| (p.addr.addr, p.state().serving_now()))
            .next()
    }

    /// Peer exchange, what this node tells: the peers of its set that serve now, as
    /// [`stormo_wire::PeerEntry`]s, ordered by key, at most [`stormo_wire::MAX_PEERS`].
    pub fn serving_entries(&self) -> Vec<stormo_wire::PeerEntry> {
        let mut out: Vec<_> = self
            .inner
            .peers()
            .iter()
            .filter(|p| p.state().serving_now())
            .map(|p| stormo_wire::PeerEntry {
                node: NodeId(*p.addr.key.as_bytes()),
                addr: p.addr.addr,
            })
            .collect();
        out.sort_by(|a, b| a.node.0.cmp(&b.node.0).then(a.addr.cmp(&b.addr)));
        out.dedup_by(|a, b| a.node == b.node);
        out.truncate(stormo_wire::MAX_PEERS);
        out
    }

    /// Peer exchange, what this node heard: the nodes that peers serving now said they have
    /// in their sets ([`stormo_wire::Peers`]) and that are not in this node's set (or are, at
    /// another address, and do not serve there now: restarted elsewhere), nor this node
    /// itself; one address per key. An entry that cannot be dialled (a key that is no
    /// Ed25519 point, port 0, an unspecified, multicast or broadcast address, or another
    /// address family than this node's endpoint) is left out, and so is a loopback address
    /// named by a peer that is not itself on loopback.
    pub fn told_peers(&self) -> Vec<PeerAddr> {
        let peers = self.inner.peers();
        // The keys the set has, with their address and whether they serve there: a known key
        // named at another address while its entry does not serve (a node restarted on a new
        // port) is taken, and replaces the entry's address.
        let known: std::collections::HashMap<[u8; 32], (std::net::SocketAddr, bool)> = peers
            .iter()
            .filter(|p| !p.state().removed)
            .map(|p| {
                (
                    *p.addr.key.as_bytes(),
                    (p.addr.addr, p.state().serving_now()),
                )
            })
            .collect();
        let v6 = self.inner.endpoint.local_addr().is_ok_and(|a| a.is_ipv6());
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for p in peers.iter() {
            let s = p.state();
            if !s.serving_now() {
                continue;
            }
            // A peer reached over the network that names a loopback address names this
            // machine's own services, not its peers: only a peer on loopback may.
            let local = p.addr.addr.ip().is_loopback();
            for e in &s.told {
                let ip = e.addr.ip();
                let dialable = e.addr.port() != 0
                    && !ip.is_unspecified()
                    && !ip.is_multicast()
                    && ip != std::net::Ipv4Addr::BROADCAST
                    && (local || !ip.is_loopback())
                    && (v6 || e.addr.is_ipv4());
                if !dialable
                    || e.node == self.inner.me
                    || known
                        .get(&e.node.0)
                        .is_some_and(|&(addr, serving)| serving || addr == e.addr)
                    || !seen.insert(e.node.0)
                {
                    continue;
                }
                if let Ok(key) = PublicKey::from_bytes(&e.node.0) {
                    out.push(PeerAddr { key, addr: e.addr });
                }
            }
        }
        out
    }

    /// How many experts each peer advertised (in `peers` order; `None`: not reached).
    pub fn inventories(&self) -> Vec<Option<usize>> {
        self.inner
            .peers()
            .iter()
            .map(|p| p.state().inventory.as_ref().map(ExpertSet::len))
            .collect()
    }

    /// Keeps `rt` alive as long as the tier (when the tier runs on it).
    pub fn keep_runtime(mut self, rt: Arc<tokio::runtime::Runtime>) -> Self {
        self._own = Some(OwnedRuntime(Some(rt)));
        self
    }

    /// Races `local` (the node's disk tier) against demand requests that are slow to come
    /// from a peer when no other peer holds the expert. Set once; later calls are ignored.
    pub fn set_local(&self, local: Arc<dyn Tier>) {
        let _ = self.inner.local.set(local);
    }

    /// Also writes every verified expert to `dir` (in the background, after the load
    /// completes). Set once; later calls are ignored.
    pub fn set_expert_dir(&self, dir: Arc<crate::expert_dir::ExpertDir>) {
        let _ = self.inner.store.set(dir);
    }

    /// The races so far.
    pub fn hedge_stats(&self) -> HedgeStats {
        *self.inner.hedges.lock().expect("hedge stats lock")
    }

    /// Races lost so far per peer (slower than a hedge), in `peers` order.
    pub fn races_lost(&self) -> Vec<u32> {
        self.inner
            .peers()
            .iter()
            .map(|p| p.state().races_lost)
            .collect()
    }

    /// Verified expert bytes received so far per peer (whole records, stripes, and the
    /// verified part of failed tries), in `peers` order.
    pub fn peer_bytes(&self) -> Vec<(PeerAddr, u64)> {
        self.inner
            .peers()
            .iter()
            .map(|p| (p.addr.clone(), p.state().bytes))
            .collect()
    }

    /// Loads striped across several holders that ended with the record, so far.
    pub fn striped_loads(&self) -> u64 {
        self.inner.striped.load(Ordering::Relaxed)
    }

    /// Connection attempts so far per peer (the first at start included), in `peers` order.
    pub fn connects(&self) -> Vec<u32> {
        self.inner
            .peers()
            .iter()
            .map(|p| p.state().connects)
            .collect()
    }

    /// Failures so far per peer, in `peers` order: tries that reached the peer (or tried to
    /// connect to it) and failed. Tries refused at once because the peer is unreachable for
    /// its back-off are not its failures again.
    pub fn failures(&self) -> Vec<(PeerAddr, u32)> {
        self.inner
            .peers()
            .iter()
            .map(|p| (p.addr.clone(), p.state().failures_total))
            .collect()
    }

    /// Closes every connection.
    pub fn close(&self) {
        self.inner.closing.store(true, Ordering::SeqCst);
        self.inner.endpoint.close(0u32.into(), b"done");
    }
}

impl Inner {
    /// The peer set now.
    pub(crate) fn peers(&self) -> Arc<Vec<Arc<Peer>>> {
        self.peers.lock().expect("peer set lock").clone()
    }

    /// Adds `peers` not already in the set (see [`PeerTier::add_peers`]); returns the new ones
    /// and the ones back in the set.
    ///
    /// A peer removed before and added again at the same address gets its entry back, with
    /// its view as it was (back-off, history, a drop for bad bytes): discovery removes a peer
    /// it has not heard of for a while and adds it when it is heard again, and neither a new
    /// entry each time (the set would grow by one a cycle) nor a clean slate (a peer dropped
    /// for sending bad bytes would be trusted again) is wanted. A peer at a new address gets
    /// a new entry, which keeps the drop of the key's earlier entries.
    pub(crate) fn add_peers(&self, peers: &[PeerAddr]) -> anyhow::Result<Vec<Arc<Peer>>> {
        let mut set = self.peers.lock().expect("peer set lock");
        let mut next: Vec<Arc<Peer>> = set.as_ref().clone();
        let mut added = Vec::new();
        for p in peers {
            if p.key == self.secret.public() {
                continue;
            }
            let same = next
                .iter()
                .find(|q| q.addr.key == p.key && !q.state().removed);
            match same {
                Some(q) if q.addr.addr == p.addr => continue,
                Some(q) => {
                    tracing::info!("peer {} moved to {}", q.addr, p.addr);
                    q.state().removed = true;
                }
                None => {}
            }
            if let Some(q) = next.iter().rev().find(|q| q.addr == *p) {
                q.state().removed = false;
                added.push(q.clone());
                continue;
            }
            let banned = next
                .iter()
                .filter(|q| q.addr.key == p.key)
                .find_map(|q| q.state().banned.clone());
            let peer = Arc::new(Peer {
                addr: p.clone(),
                client: tls::client_config_for(
                    tls::Identity {
                        secret: &self.secret,
                        membership: self.membership.as_ref(),
                    },
                    Some(&p.key),
                    self.servers.clone(),
                )?,
                link: Default::default(),
                state: Mutex::new(PeerView::default()),
            });
            peer.state().banned = banned;
            next.push(peer.clone());
            added.push(peer);
        }
        *set = Arc::new(next);
        Ok(added)
    }

    /// Marks the peer with `key` removed and closes its connection.
    pub(crate) fn remove_peer(&self, key: &PublicKey) -> bool {
        let peers = self.peers();
        let mut found = false;
        for p in peers.iter().filter(|p| p.addr.key == *key) {
            if !std::mem::replace(&mut p.state().removed, true) {
                found = true;
                if let Ok(g) = p.link.try_lock() {
                    if let Some(l) = g.as_ref() {
                        l.conn.close(0u32.into(), b"removed");
                    }
                }
            }
        }
        found
    }

    pub(crate) fn count(&self, f: impl FnOnce(&mut HedgeStats)) {
        f(&mut self.hedges.lock().expect("hedge stats lock"));
    }
}

impl Tier for PeerTier {
    fn name(&self) -> &str {
        "peer"
    }

    fn holds(&self, id: ExpertId) -> bool {
        self.inner.manifest.expert(id).is_some()
            && self.inner.peers().iter().any(|p| p.state().may_supply(id))
    }

    fn retried_failures(&self) -> u64 {
        self.inner.retried.load(Ordering::Relaxed)
    }

    fn why_not(&self, id: ExpertId) -> Option<String> {
        let dropped: Vec<String> = self
            .inner
            .peers()
            .iter()
            .filter_map(|p| {
                let s = p.state();
                let why = s
                    .banned
                    .as_ref()
                    .filter(|_| s.announces(id) && !s.removed)?;
                Some(format!(
                    "peer {} held it but was dropped this session: {why}",
                    p.addr
                ))
            })
            .collect();
        (!dropped.is_empty()).then(|| dropped.join("; "))
    }

    fn load(&self, keys: &[ExpertId], priority: Priority, done: Completion) {
        for &key in keys {
            let inner = self.inner.clone();
            let done = done.clone();
            self.rt.spawn(async move {
                // The one place a load's typed failure becomes words.
                let r =
                    inner
                        .fetch(key, priority)
                        .await
                        .map_err(|e| stormo_engine::Error::Expert {
                            layer: key.layer as usize,
                            expert: key.expert as usize,
                            reason: format!("from peers: {}", e.describe(&inner)),
                        });
                done(key, r);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::path::Path;
    use std::time::Instant;

    use stormo_engine::huge::HugeBuf;
    use stormo_engine::moe::ExpertData;
    use stormo_wire::FetchError;

    use super::driver::FetchFailure;
    use super::request::{Prefix, RecordBuf, StripeBuf, TryLimit};
    use crate::load::{self, TryError};

    use stormo_engine::moe::ExpertProvider;
    use stormo_manifests::{manifest::MIN_CHUNK_SIZE, BuildOptions};

    use crate::serve::{self, ServeConfig, ServerHandle};

    /// Passes on its provider's records with byte `at` of each flipped: a peer whose files went
    /// bad after its manifest was made.
    #[derive(Debug)]
    struct FlipByte {
        inner: Arc<dyn ExpertProvider>,
        at: usize,
    }

    impl ExpertProvider for FlipByte {
        fn fetch(
            &self,
            layer: usize,
            experts: &[usize],
            out: &mut Vec<Arc<ExpertData>>,
        ) -> stormo_engine::Result<()> {
            let mut honest = Vec::new();
            self.inner.fetch(layer, experts, &mut honest)?;
            for d in honest {
                let lens: Vec<usize> = d.parts().map(<[u8]>::len).collect();
                let mut buf = HugeBuf::zeroed(lens.iter().sum()).expect("a record buffer");
                let mut at = 0;
                for p in d.parts() {
                    buf[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
                buf[self.at] ^= 1;
                out.push(Arc::new(ExpertData::from_lengths(Arc::new(buf), 0, lens)));
            }
            Ok(())
        }
    }

    /// Fails every read: a peer whose disk went away (it answers `internal`).
    #[derive(Debug)]
    struct Failing;

    impl ExpertProvider for Failing {
        fn fetch(
            &self,
            _layer: usize,
            _experts: &[usize],
            _out: &mut Vec<Arc<ExpertData>>,
        ) -> stormo_engine::Result<()> {
            Err(stormo_engine::Error::Input("the disk went away".into()))
        }
    }

    /// Reads honestly after `delay`, sending nothing meanwhile (a stopped or overloaded peer),
    /// and counts the reads begun.
    #[derive(Debug)]
    struct Late {
        inner: Arc<dyn ExpertProvider>,
        delay: Duration,
        begun: Arc<AtomicU64>,
    }

    impl ExpertProvider for Late {
        fn fetch(
            &self,
            layer: usize,
            experts: &[usize],
            out: &mut Vec<Arc<ExpertData>>,
        ) -> stormo_engine::Result<()> {
            self.begun.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
            self.inner.fetch(layer, experts, out)
        }
    }

    /// How one of a bench's servers answers.
    #[derive(Clone, Copy, Debug)]
    enum Serving {
        Honest,
        /// With byte `at` of every record flipped.
        Flip(usize),
        /// `internal`: every read fails.
        Failing,
        /// Honestly, after a read of this long.
        Late(Duration),
        /// Honestly, one request at a time, after a read of this long: `busy` to any other
        /// request meanwhile.
        Busy(Duration),
    }

    /// Servers of the tiny bf16 GPT-OSS fixture under a manifest of the smallest chunk size
    /// (each expert record is two chunks, the second one short), and a client tier over them.
    struct Bench {
        _dir: tempfile::TempDir,
        chunk: u64,
        id: ExpertId,
        /// Expert `id`'s record, as the manifest hashes it.
        record: Vec<u8>,
        tier: PeerTier,
        servers: Vec<ServerHandle>,
        /// Reads begun by its `Late` servers.
        begun: Arc<AtomicU64>,
        _server_rt: tokio::runtime::Runtime,
    }

    impl Drop for Bench {
        fn drop(&mut self) {
            self.tier.close();
            for s in &self.servers {
                s.close();
            }
        }
    }

    /// The client's timeouts of a bench: far longer than any of its tries takes.
    fn bench_config() -> PeerConfig {
        PeerConfig {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            hedge_min: Duration::from_secs(60),
            hedge_max: Duration::from_secs(60),
            // One record, one request: these tests are of single tries.
            stripe_min: u64::MAX,
        }
    }

    /// One server per entry of `serving`, answering as it says.
    fn bench(serving: &[Serving]) -> Bench {
        bench_with(serving, bench_config())
    }

    fn bench_with(serving: &[Serving], peer_cfg: PeerConfig) -> Bench {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gptoss-tiny-bf16");
        let dir = tempfile::tempdir().expect("tempdir");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.path().join(f)).expect("copying the fixture");
        }
        let opts = BuildOptions {
            chunk_size: MIN_CHUNK_SIZE,
            ..BuildOptions::default()
        };
        let m = stormo_manifests::build(dir.path(), &opts).expect("manifest");
        std::fs::write(dir.path().join("stormo-manifest.bin"), m.encode()).expect("manifest");
        let chunk = u64::from(MIN_CHUNK_SIZE);
        let entry = m.experts[0].clone();
        assert!(
            entry.len > chunk && entry.len < 2 * chunk,
            "a record of {} bytes is not two chunks with a short last one",
            entry.len
        );
        let files = stormo_engine::ModelFiles::open(dir.path()).expect("model files");
        let client = SecretKey::from_seed(&[70; 32]);
        let serve_cfg = |busy: bool| ServeConfig {
            admission: tls::Admission::Keys([*client.public().as_bytes()].into()),
            node_limit: if busy {
                1
            } else {
                ServeConfig::default().node_limit
            },
            ..ServeConfig::default()
        };
        let begun = Arc::new(AtomicU64::new(0));
        let server_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let mut record = Vec::new();
        let mut servers = Vec::new();
        let mut addrs = Vec::new();
        for (i, serving) in serving.iter().enumerate() {
            let h = serve::holdings(dir.path(), None, None, |files, _| {
                Ok(Arc::new(files.mapped_experts()?) as Arc<dyn ExpertProvider>)
            })
            .expect("holdings");
            if record.is_empty() {
                let mut out = Vec::new();
                h.experts
                    .fetch(
                        entry.id.layer as usize,
                        &[entry.id.expert as usize],
                        &mut out,
                    )
                    .expect("the record");
                record = out[0].parts().flatten().copied().collect();
                assert_eq!(Hash::of(&record), entry.hash);
            }
            let experts: Arc<dyn ExpertProvider> = match *serving {
                Serving::Honest => h.experts.clone(),
                Serving::Flip(at) => Arc::new(FlipByte {
                    inner: h.experts.clone(),
                    at,
                }),
                Serving::Failing => Arc::new(Failing),
                Serving::Late(delay) | Serving::Busy(delay) => Arc::new(Late {
                    inner: h.experts.clone(),
                    delay,
                    begun: begun.clone(),
                }),
            };
            let h = serve::Holdings { experts, ..h };
            let key = SecretKey::from_seed(&[71 + i as u8; 32]);
            let handle = server_rt
                .block_on(async {
                    serve::start(
                        &key,
                        "127.0.0.1:0".parse().expect("address"),
                        Arc::new(h),
                        serve_cfg(matches!(serving, Serving::Busy(_))),
                    )
                })
                .expect("server starts");
            addrs.push(PeerAddr {
                key: key.public(),
                addr: handle.local_addr(),
            });
            servers.push(handle);
        }
        let model = m.model_id();
        let tier = PeerTier::connect(
            &client,
            &addrs,
            Arc::new(m),
            model,
            files.layout.schemas.clone(),
            peer_cfg,
            None,
        )
        .expect("client tier");
        assert_eq!(
            tier.peer_addrs().iter().map(|p| p.key).collect::<Vec<_>>(),
            addrs.iter().map(|p| p.key).collect::<Vec<_>>(),
            "peers in the order given"
        );
        Bench {
            _dir: dir,
            chunk,
            id: entry.id,
            record,
            tier,
            servers,
            begun,
            _server_rt: server_rt,
        }
    }

    impl Bench {
        fn len(&self) -> u64 {
            self.record.len() as u64
        }

        /// One [`Inner::attempt`] at peer `i` from `prefix` (of the whole record), and the
        /// record it completed.
        fn attempt(&self, i: usize, prefix: &mut Prefix) -> Result<HugeBuf, TryError> {
            self.attempt_span(i, prefix, Duration::from_secs(10))?;
            Ok(prefix.take().into_record())
        }

        /// One [`Inner::attempt`] at peer `i` from `prefix` (of any span) within `timeout`.
        fn attempt_span(
            &self,
            i: usize,
            prefix: &mut Prefix,
            timeout: Duration,
        ) -> Result<(), TryError> {
            let inner = &self.tier.inner;
            let peer = inner.peers()[i].clone();
            let limit = TryLimit {
                timeout,
                extend_until: None,
            };
            self.tier.rt.block_on(inner.attempt(
                &peer,
                self.id,
                self.len(),
                prefix,
                Priority::Demand,
                limit,
                None,
            ))
        }

        /// One try at peer `i` from `prefix` (of the whole record), judged as a load judges
        /// it ([`load::judge`]) into `tally`, and the record it completed.
        fn try_peer(
            &self,
            i: usize,
            prefix: Prefix,
            tally: &mut Tally,
        ) -> Result<HugeBuf, (String, Prefix)> {
            self.try_span(i, prefix, tally).map(Prefix::into_record)
        }

        /// One try at peer `i` from `prefix` (of any span), judged into `tally`: the span, or
        /// the error naming the peer with the prefix left.
        fn try_span(
            &self,
            i: usize,
            prefix: Prefix,
            tally: &mut Tally,
        ) -> Result<Prefix, (String, Prefix)> {
            let inner = &self.tier.inner;
            let peer = inner.peers()[i].clone();
            let limit = TryLimit {
                timeout: Duration::from_secs(10),
                extend_until: None,
            };
            let from = prefix.verified.max(prefix.start);
            let started = Instant::now();
            let (r, prefix) = self.tier.rt.block_on(inner.run_try(
                &peer,
                self.id,
                self.len(),
                prefix,
                Priority::Demand,
                limit,
                None,
            ));
            let added = match prefix.buffer {
                Some(_) => prefix.verified.saturating_sub(from),
                None => 0,
            };
            let now = Instant::now();
            let v = load::judge(&mut peer.state(), self.id, &r, added, now - started, now);
            tally.failed += u64::from(v.failed);
            tally.retry |= v.retry;
            tally.busy |= v.busy;
            match r {
                Ok(()) => Ok(prefix),
                Err(e) => Err((format!("{}: {e}", peer.addr), prefix)),
            }
        }

        /// Why peer `i`'s connection was closed (`None`: it is open, or there is none).
        fn closed_why(&self, i: usize) -> Option<quinn::ConnectionError> {
            let peer = self.tier.inner.peers()[i].clone();
            let link = self.tier.rt.block_on(peer.link.lock()).clone();
            link.and_then(|l| l.conn.close_reason())
        }

        /// A whole-record prefix with nothing verified.
        fn fresh(&self) -> Prefix {
            Prefix::whole(self.len())
        }
    }

    /// What a load keeps of the tries it judged.
    #[derive(Debug, Default)]
    struct Tally {
        failed: u64,
        retry: bool,
        busy: bool,
    }

    /// A prefix buffer of `len` bytes holding `bytes` at its start, all of them verified.
    fn prefix_of(bytes: &[u8], len: u64) -> Prefix {
        let mut b = HugeBuf::zeroed(len as usize).expect("buffer");
        b[..bytes.len()].copy_from_slice(bytes);
        Prefix {
            buffer: Some(Box::new(RecordBuf(b))),
            start: 0,
            end: len,
            verified: bytes.len() as u64,
        }
    }

    fn prefix_bytes(p: &mut Prefix) -> Vec<u8> {
        let n = p.len();
        p.buffer.as_mut().expect("a buffer").bytes_mut()[..n].to_vec()
    }

    /// The chunk check in a real fetch: an honest peer's record arrives whole; a corrupt chunk
    /// (the first, or the short last one) fails the try at that chunk, naming it, and what
    /// verified before it is kept; a try from a verified prefix asks only for the bytes
    /// after it and completes the record.
    #[test]
    fn a_corrupt_chunk_ends_the_try_at_the_verified_prefix_and_a_try_resumes_after_it() {
        let b = bench(&[
            Serving::Honest,
            Serving::Flip(5),
            Serving::Flip(MIN_CHUNK_SIZE as usize + 5),
        ]);
        let (chunk, len) = (b.chunk, b.len());
        let got = b.attempt(0, &mut b.fresh()).expect("the honest peer");
        assert!(got[..] == b.record[..], "the honest peer's record differs");

        for (peer, bad) in [(1, 0u64), (2, 1)] {
            let mut prefix = b.fresh();
            match b.attempt(peer, &mut prefix) {
                Err(TryError::Fetch {
                    error: FetchError::BadChunk { index, offset, .. },
                    ..
                }) => {
                    assert_eq!((index, offset), (bad, bad * chunk));
                }
                other => panic!("chunk {bad} corrupt: {other:?}"),
            }
            assert_eq!(prefix.verified, bad * chunk, "chunk {bad} corrupt");
            assert!(prefix.buffer.is_some(), "the buffer is kept");
            assert!(prefix_bytes(&mut prefix) == b.record[..(bad * chunk) as usize]);
        }

        // A try from a prefix: the bytes after it complete the record.
        let mut prefix = b.fresh();
        assert!(b.attempt(2, &mut prefix).is_err());
        assert_eq!(prefix.verified, chunk);
        let got = b
            .attempt(0, &mut prefix)
            .expect("resumed at the honest peer");
        assert!(got[..] == b.record[..], "the resumed record differs");
        // Only those bytes are asked for: a prefix marked verified is not fetched again.
        let marker = vec![0xa5; chunk as usize];
        let mut prefix = prefix_of(&marker, len);
        let got = b.attempt(0, &mut prefix).expect("resumed");
        assert!(
            got[..chunk as usize] == marker[..],
            "the prefix was fetched again"
        );
        assert!(got[chunk as usize..] == b.record[chunk as usize..]);
        // A prefix without a buffer starts over, whatever it says.
        let mut prefix = Prefix {
            buffer: None,
            start: 0,
            end: len,
            verified: chunk,
        };
        let got = b.attempt(0, &mut prefix).expect("from scratch");
        assert!(got[..] == b.record[..]);
    }

    /// What a try does with bytes that fail: the peer is dropped for the session (not merely
    /// backed off), the failure is counted once, and the verified prefix is handed back. A good
    /// try counts no failure and feeds the peer's throughput; a try ending because the tier
    /// closes is not the peer's failure.
    #[test]
    fn a_peer_that_sends_a_bad_chunk_is_dropped_and_its_verified_prefix_kept() {
        let b = bench(&[Serving::Honest, Serving::Flip(MIN_CHUNK_SIZE as usize + 5)]);
        let peers = b.tier.inner.peers();
        let mut tries = Tally::default();
        let got = b
            .try_peer(0, b.fresh(), &mut tries)
            .expect("the honest peer");
        assert!(got[..] == b.record[..]);
        assert_eq!(tries.failed, 0);
        assert!(
            peers[0].state().rate.is_some(),
            "a success feeds the throughput"
        );
        let len = b.len();
        assert_eq!(peers[0].state().bytes, len, "verified bytes credited");
        assert!(peers[0].state().usable());

        let (why, mut prefix) = b
            .try_peer(1, b.fresh(), &mut tries)
            .expect_err("a corrupt chunk");
        assert!(
            why.contains(&peers[1].addr.to_string()) && why.contains("chunk 1"),
            "{why}"
        );
        assert_eq!(prefix.len() as u64, b.chunk);
        assert!(prefix_bytes(&mut prefix) == b.record[..b.chunk as usize]);
        assert_eq!(tries.failed, 1);
        assert_eq!(
            peers[1].state().bytes,
            b.chunk,
            "its verified chunk credited"
        );
        assert!(
            peers[1].state().banned.is_some(),
            "a peer that sent bad bytes is not dropped"
        );
        assert!(!peers[1].state().usable());
        assert!(peers[0].state().banned.is_none());

        // The verified prefix completes at the honest peer.
        let got = b.try_peer(0, prefix, &mut tries).expect("resumed");
        assert!(got[..] == b.record[..]);
        assert_eq!(tries.failed, 1);
        assert_eq!(
            peers[0].state().bytes,
            2 * len - b.chunk,
            "only the bytes after the prefix credited"
        );

        b.tier.close();
        let failures = peers[0].state().failures_total;
        let r = b
            .tier
            .rt
            .block_on(b.tier.inner.fetch(b.id, Priority::Demand));
        assert!(matches!(r, Err(FetchFailure::Closed)), "{r:?}");
        assert_eq!(
            peers[0].state().failures_total,
            failures,
            "a load ended by closing counted as the peer's failure"
        );
    }

    /// A stripe (a span of the record, in its part of a split buffer) is asked for exactly:
    /// the first, from 0 to before the record's end, and the last, from a chunk boundary to the
    /// end, each verified and credited to its peer at its own length. A stripe whose buffer
    /// was lost fails its try: it is not fetched into a buffer of the whole record.
    #[test]
    fn a_stripe_is_fetched_into_its_part_of_the_record() {
        let b = bench(&[Serving::Honest]);
        let (chunk, len) = (b.chunk, b.len());
        let peers = b.tier.inner.peers();
        let mut tries = Tally::default();
        let parts = HugeBuf::zeroed(len as usize)
            .expect("a record buffer")
            .split(&[chunk as usize])
            .expect("two stripes");
        for (part, (start, end)) in parts.into_iter().zip([(0, chunk), (chunk, len)]) {
            let prefix = Prefix {
                buffer: Some(Box::new(StripeBuf {
                    part,
                    offset: start,
                })),
                start,
                end,
                verified: start,
            };
            let before = peers[0].state().bytes;
            let got = b
                .try_span(0, prefix, &mut tries)
                .unwrap_or_else(|(e, _)| panic!("stripe {start}..{end}: {e}"))
                .into_part();
            assert!(
                got[..] == b.record[start as usize..end as usize],
                "stripe {start}..{end} differs"
            );
            assert_eq!(peers[0].state().bytes - before, end - start);
        }
        assert_eq!(tries.failed, 0);

        for (start, end) in [(0, chunk), (chunk, len)] {
            let mut prefix = Prefix {
                buffer: None,
                start,
                end,
                verified: start,
            };
            match b.attempt_span(0, &mut prefix, Duration::from_secs(10)) {
                Err(TryError::Other(e)) => {
                    assert!(e.contains("was lost"), "{e}");
                }
                other => panic!("stripe {start}..{end} without its buffer: {other:?}"),
            }
            assert!(prefix.buffer.is_none());
        }
    }

    /// A peer that answers `busy` is loaded, not failing: its try is worth another round and
    /// the peer is not marked. Any other error it answers is its failure: marked (backed off),
    /// with no other round for it.
    #[test]
    fn a_busy_answer_is_load_and_another_error_a_failure() {
        let b = bench(&[Serving::Busy(Duration::from_secs(3)), Serving::Failing]);
        let peers = b.tier.inner.peers();
        for (i, busy) in [(0, true), (1, false)] {
            let mut tries = Tally::default();
            let (why, prefix) = std::thread::scope(|s| {
                if busy {
                    // Another request holds the server's one slot.
                    s.spawn(|| b.attempt_span(0, &mut b.fresh(), Duration::from_secs(10)));
                    let until = Instant::now() + Duration::from_secs(30);
                    while b.begun.load(Ordering::SeqCst) == 0 {
                        assert!(Instant::now() < until, "the first request never began");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                b.try_span(i, b.fresh(), &mut tries).expect_err("no record")
            });
            let code = if busy { "busy" } else { "internal" };
            assert!(why.contains(&format!("peer answered {code}")), "{why}");
            assert_eq!(prefix.len(), 0);
            assert_eq!(tries.failed, 1);
            assert_eq!(tries.retry, busy, "{why}");
            assert_eq!(tries.busy, busy, "{why}");
            let s = peers[i].state();
            assert_eq!(s.failures, u32::from(!busy), "{why}");
            assert_eq!(s.avoid_until.is_some(), !busy, "{why}");
            assert!(s.usable() && s.lost.is_none(), "{why}");
        }
    }

    /// A peer whose stream is silent for the silence deadline (stopped, killed) is presumed
    /// gone: its connection is closed, so that the next try dials again, and it is noted as
    /// lost. One that sent nothing before the request's own deadline, when that is the
    /// shorter, timed out: its connection stays, and it is not lost.
    #[test]
    fn silence_closes_the_connection_and_a_timeout_does_not() {
        let cfg = PeerConfig {
            idle_timeout: Duration::from_secs(1),
            ..bench_config()
        };
        let b = bench_with(&[Serving::Late(Duration::from_secs(4))], cfg);
        let peer = b.tier.inner.peers()[0].clone();
        let mut prefix = b.fresh();
        match b.attempt_span(0, &mut prefix, Duration::from_millis(100)) {
            Err(TryError::Fetch {
                error: FetchError::TimedOut { .. },
                heard: false,
            }) => {}
            other => panic!("a silent peer past a 100 ms deadline: {other:?}"),
        }
        assert!(b.closed_why(0).is_none(), "a timeout closed the connection");
        assert!(peer.state().lost.is_none());

        let mut prefix = b.fresh();
        match b.attempt_span(0, &mut prefix, Duration::from_secs(10)) {
            Err(TryError::Lost(e))
                if matches!(
                    *e,
                    TryError::Fetch {
                        error: FetchError::Stalled { .. },
                        heard: false
                    }
                ) => {}
            other => panic!("a peer silent for 1 s: {other:?}"),
        }
        assert!(
            matches!(b.closed_why(0), Some(quinn::ConnectionError::LocallyClosed)),
            "the silent peer's connection is still open"
        );
        assert!(peer.state().lost.is_some());
    }

    /// A connection the peer closes while a request waits on it is lost: the try says so, and
    /// the peer is noted as lost (to be dialled again), whatever error the request saw.
    #[test]
    fn a_connection_closed_by_the_peer_mid_request_is_lost() {
        let b = bench(&[Serving::Late(Duration::from_secs(2))]);
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                let until = Instant::now() + Duration::from_secs(30);
                while b.begun.load(Ordering::SeqCst) == 0 {
                    assert!(
                        Instant::now() < until,
                        "the request never reached the server"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                b.servers[0].close();
            });
            b.attempt_span(0, &mut b.fresh(), Duration::from_secs(10))
        });
        match got {
            Err(TryError::Lost(_)) => {}
            other => panic!("the server closed mid-request: {other:?}"),
        }
        assert!(matches!(
            b.closed_why(0),
            Some(quinn::ConnectionError::ApplicationClosed(_))
        ));
        assert!(b.tier.inner.peers()[0].state().lost.is_some());
    }

    /// A try whose connection hears nothing for longer than its peer's latency explains is
    /// raced at once by another holder, a prefetch too (no timer hedges it): the load takes
    /// about the silence limit (under a second here), not the 4 s its peer is silent, and the
    /// silent peer loses a race rather than being blamed.
    #[test]
    fn a_silent_holder_is_raced_at_once_by_another() {
        let b = bench(&[Serving::Late(Duration::from_secs(4)), Serving::Honest]);
        let started = Instant::now();
        let d = b
            .tier
            .rt
            .block_on(b.tier.inner.fetch(b.id, Priority::Prefetch))
            .expect("the record");
        let took = started.elapsed();
        let got: Vec<u8> = d.parts().flatten().copied().collect();
        assert!(got == b.record, "the record differs");
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert_eq!(
            b.begun.load(Ordering::SeqCst),
            1,
            "the silent peer asked first"
        );
        let h = b.tier.hedge_stats();
        assert_eq!((h.hedges, h.hedge_wins), (1, 1), "{h:?}");
        let peers = b.tier.inner.peers();
        assert_eq!(peers[0].state().races_lost, 1);
        assert_eq!(
            peers[0].state().failures_total,
            0,
            "silence raced, not blamed"
        );
        assert_eq!(peers[1].state().bytes, b.len());
    }

    /// What one load keeps between tries: a request hands back its buffer with the verified
    /// end, or nothing without a buffer; a copy for a racing try holds the same verified bytes.
    #[test]
    fn prefixes_keep_exactly_their_verified_bytes() {
        let mut kept = Prefix::whole(16);
        kept.keep(None, 7);
        assert_eq!((kept.len(), kept.buffer.is_none()), (0, true));
        let mut from = prefix_of(&[1, 2, 3, 4, 5], 16);
        let buffer = from.buffer.take();
        let mut kept = Prefix::whole(16);
        kept.keep(buffer, 3);
        assert_eq!(kept.len(), 3);
        assert_eq!(prefix_bytes(&mut kept), [1, 2, 3]);

        let mut copy = kept.copy(16).expect("copy");
        assert_eq!(copy.len(), 3);
        assert_eq!(prefix_bytes(&mut copy), [1, 2, 3]);
        let whole = copy.buffer.as_mut().expect("a buffer").bytes_mut().to_vec();
        assert_eq!(whole.len(), 16);
        assert_eq!(&whole[3..], &[0; 13], "bytes past the prefix copied");
        assert_eq!(prefix_bytes(&mut kept), [1, 2, 3], "the original changed");

        let mut none = Prefix {
            buffer: None,
            start: 0,
            end: 16,
            verified: 9,
        };
        let copy = none.copy(16).expect("copy");
        assert_eq!(copy.len(), 0, "a prefix without bytes copied as verified");
        assert!(copy.buffer.is_some());
    }

    #[test]
    fn peer_timeout_sets_each_deadline_it_documents() {
        // Shorter than every default: each deadline is the given one.
        let t = Duration::from_secs(2);
        assert!(t < crate::CONNECT_TIMEOUT && t < PeerConfig::default().idle_timeout);
        let short = PeerConfig::with_timeout(t);
        assert_eq!(short.connect_timeout, t);
        assert_eq!(short.request_timeout, t);
        assert_eq!(short.idle_timeout, t);
        // Longer than every default: connection and silence keep their bounds.
        let t = Duration::from_secs(60);
        let long = PeerConfig::with_timeout(t);
        assert_eq!(long.connect_timeout, crate::CONNECT_TIMEOUT);
        assert_eq!(long.request_timeout, t);
        assert_eq!(long.idle_timeout, Duration::from_secs(5));
        // The rest are the defaults.
        let d = PeerConfig::default();
        assert_eq!(
            (long.hedge_min, long.hedge_max, long.stripe_min),
            (d.hedge_min, d.hedge_max, d.stripe_min)
        );
    }

    /// Waits (at most 10 s) until `peer` serves now: its control stream is followed by a task
    /// of its own, so right after the bench connects it may not be open yet.
    fn serving_soon(peer: &Peer) {
        let until = Instant::now() + Duration::from_secs(10);
        while !peer.state().serving_now() {
            assert!(Instant::now() < until, "the peer never served");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What a node offers to fetch for its peers comes only from peers serving now: one whose
    /// control stream ended (it left, or its connection was lost), or that announced it is
    /// leaving, or was dropped, counts with nothing, so an offer never outlives its holder.
    #[test]
    fn an_offer_comes_only_from_peers_serving_now() {
        let b = bench(&[Serving::Honest]);
        let peer = b.tier.inner.peers()[0].clone();
        let shape = {
            let s = peer.state();
            let inv = s.inventory.as_ref().expect("the peer's inventory");
            (inv.layers(), inv.experts_per_layer())
        };
        let held = |b: &Bench| b.tier.held_by_peers(shape).expect("a set").len();
        serving_soon(&peer);
        let all = held(&b);
        assert!(all > 0);
        peer.state().control_open = false;
        assert_eq!(held(&b), 0, "a peer whose control stream ended");
        peer.state().control_open = true;
        assert_eq!(held(&b), all);
        let mut leaving = stormo_wire::Placement {
            model: b.tier.inner.model,
            budget: 0,
            used: 0,
            pinned: ExpertSet::new(shape.0, shape.1).expect("set"),
            kept: ExpertSet::new(shape.0, shape.1).expect("set"),
            fetching: ExpertSet::new(shape.0, shape.1).expect("set"),
            demand: Vec::new(),
            leaving: true,
        };
        peer.state().placement = Some(leaving.clone());
        assert_eq!(held(&b), 0, "a peer that is leaving");
        leaving.leaving = false;
        peer.state().placement = Some(leaving);
        assert_eq!(held(&b), all);
        assert!(peer.state().ban("bad bytes (test)"));
        assert_eq!(held(&b), 0, "a dropped peer");
        b.tier.close();
    }

    /// Peer exchange: a node tells the peers that serve now, and of what a peer tells it
    /// takes only what it can dial and does not know: not itself, not a peer it has, not a
    /// key twice, no port 0, unspecified, multicast or broadcast address; nothing from a peer
    /// that does not serve now. (The bench's peer is on loopback, so it may name loopback
    /// addresses.)
    #[test]
    fn told_peers_keep_only_new_dialable_nodes() {
        let b = bench(&[Serving::Honest]);
        let peer = b.tier.inner.peers()[0].clone();
        let known = b.tier.peer_addrs()[0].clone();
        serving_soon(&peer);
        let told = b.tier.serving_entries();
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].node.0, *known.key.as_bytes());
        let key = |seed: u8| SecretKey::from_seed(&[seed; 32]).public();
        let entry = |seed: u8, addr: &str| stormo_wire::PeerEntry {
            node: NodeId(*key(seed).as_bytes()),
            addr: addr.parse().expect("address"),
        };
        let me = stormo_wire::PeerEntry {
            node: b.tier.inner.me,
            addr: "127.0.0.9:9".parse().expect("address"),
        };
        peer.state().told = vec![
            entry(2, "127.0.0.2:4433"),
            entry(2, "127.0.0.3:4433"), // the same key again
            entry(3, "127.0.0.4:0"),
            entry(4, "0.0.0.0:4433"),
            entry(5, "224.0.0.251:5353"),
            entry(6, "255.255.255.255:4433"),
            stormo_wire::PeerEntry {
                node: NodeId(*known.key.as_bytes()),
                addr: "127.0.0.5:1".parse().expect("address"),
            },
            me,
            entry(7, "10.1.2.3:4433"),
        ];
        let got: Vec<String> = b
            .tier
            .told_peers()
            .iter()
            .map(|p| p.addr.to_string())
            .collect();
        assert_eq!(got, ["127.0.0.2:4433", "10.1.2.3:4433"]);
        // A peer that does not serve now is not listened to, nor told of.
        peer.state().control_open = false;
        assert!(b.tier.told_peers().is_empty());
        assert!(b.tier.serving_entries().is_empty());
        b.tier.close();
    }

    /// A peer removed and added again at its address (discovery losing it and hearing it
    /// again) gets its entry back: the set does not grow, the peer serves again, and a drop
    /// for bad bytes stays. One at a new address gets a new entry that keeps the drop.
    #[test]
    fn a_peer_removed_and_added_again_gets_its_entry_back_and_keeps_a_drop() {
        let b = bench(&[Serving::Honest]);
        let addr = b.tier.peer_addrs()[0].clone();
        let entries = |b: &Bench| b.tier.inner.peers().len();
        for round in 0..3 {
            assert!(b.tier.remove_peer(&addr.key), "round {round}");
            assert!(b.tier.peer_addrs().is_empty());
            b.tier
                .add_peers(std::slice::from_ref(&addr))
                .expect("added");
            assert_eq!(
                b.tier.peer_addrs(),
                std::slice::from_ref(&addr),
                "round {round}"
            );
            assert_eq!(entries(&b), 1, "a new entry in round {round}");
        }
        let record = b.attempt(0, &mut b.fresh()).expect("served again");
        assert_eq!(&record[..], &b.record[..]);
        assert!(b.tier.inner.peers()[0].state().ban("sent bad bytes (test)"));
        b.tier.remove_peer(&addr.key);
        b.tier
            .add_peers(std::slice::from_ref(&addr))
            .expect("added");
        assert!(
            b.tier.inner.peers()[0].state().banned.is_some(),
            "a dropped peer is trusted again after it was removed"
        );
        let moved = PeerAddr {
            key: addr.key,
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 9)),
        };
        b.tier
            .add_peers(std::slice::from_ref(&moved))
            .expect("added");
        assert_eq!(b.tier.peer_addrs(), [moved]);
        assert_eq!(entries(&b), 2);
        assert!(
            b.tier.inner.peers()[1].state().banned.is_some(),
            "a dropped peer is trusted again at a new address"
        );
        b.tier.close();
    }

    /// The background redial ([`PeerTier::redial_down`]) goes through the peer's one view: a
    /// peer that does not answer is dialled only when its back-off allows, each attempt is one
    /// more failure of it, and the back-off doubles with them; a connected peer is left alone.
    #[test]
    fn redialling_a_dead_peer_follows_its_doubling_back_off() {
        let b = bench(&[Serving::Honest]);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        // Swallows every packet: each attempt runs into the connect timeout.
        let sink = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let dead = PeerAddr {
            key: SecretKey::from_seed(&[71; 32]).public(),
            addr: sink.local_addr().expect("address"),
        };
        let endpoint = {
            let _in = rt.enter();
            client_endpoint(std::slice::from_ref(&dead)).expect("endpoint")
        };
        let schemas = stormo_engine::ModelFiles::open(b._dir.path())
            .expect("model files")
            .layout
            .schemas
            .clone();
        let t = PeerTier::new(
            endpoint,
            rt.handle().clone(),
            &SecretKey::from_seed(&[70; 32]),
            b.tier.inner.manifest.clone(),
            b.tier.inner.model,
            schemas,
            PeerConfig {
                connect_timeout: Duration::from_millis(300),
                ..bench_config()
            },
        );
        t.add_peers(std::slice::from_ref(&dead))
            .expect("peer added");
        let view = |t: &PeerTier| {
            let p = t.inner.peers()[0].clone();
            let s = p.state();
            (s.connects, s.failures, s.avoid_until)
        };
        // The first attempt failed at start: one quick retry after its pause.
        assert_eq!(view(&t).0, 1);
        rt.block_on(t.redial_down());
        assert_eq!(view(&t).0, 1, "redialled during the retry's pause");
        std::thread::sleep(policy::RECONNECT_PAUSE + Duration::from_millis(50));
        let mut backoffs = Vec::new();
        for n in 2..=3u32 {
            rt.block_on(t.redial_down());
            let (connects, failures, until) = view(&t);
            assert_eq!((connects, failures), (n, n), "attempt {n}");
            let left = until
                .expect("avoided")
                .saturating_duration_since(Instant::now());
            backoffs.push(left);
            // Refused during the back-off: no attempt, no failure.
            rt.block_on(t.redial_down());
            let (connects, failures, _) = view(&t);
            assert_eq!(
                (connects, failures),
                (n, n),
                "redialled during its back-off"
            );
            if n < 3 {
                std::thread::sleep(left + Duration::from_millis(20));
            }
        }
        assert!(
            backoffs
                .windows(2)
                .all(|w| w[1] > w[0] + Duration::from_millis(500)),
            "back-offs {backoffs:?}"
        );
        assert_eq!(t.peer_addrs(), [dead], "one entry for the peer");
        // A connected peer is left alone.
        let before = b.tier.connects();
        rt.block_on(b.tier.redial_down());
        assert_eq!(b.tier.connects(), before);
        t.close();
    }

    /// A server this node dialled is closed within seconds once the policy it admits servers
    /// by refuses it (here its key taken off the allow-list file; a swarm's revocation list
    /// and a certificate's expiry take the same path), and its redial is refused in the
    /// handshake.
    #[test]
    fn a_dialled_server_no_longer_admitted_is_closed_and_not_redialled() {
        let b = bench(&[Serving::Honest]);
        let server = b.tier.peer_addrs()[0].clone();
        let dir = tempfile::tempdir().expect("tempdir");
        let allow = dir.path().join("allow.txt");
        std::fs::write(&allow, format!("{}\n", server.key)).expect("allow file");
        let file = Arc::new(tls::RevokedList::load(&allow).expect("allow list"));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let endpoint = {
            let _in = rt.enter();
            client_endpoint(std::slice::from_ref(&server)).expect("endpoint")
        };
        let schemas = stormo_engine::ModelFiles::open(b._dir.path())
            .expect("model files")
            .layout
            .schemas
            .clone();
        // The key the bench's servers admit.
        let client = SecretKey::from_seed(&[70; 32]);
        let t = PeerTier::new(
            endpoint,
            rt.handle().clone(),
            &client,
            b.tier.inner.manifest.clone(),
            b.tier.inner.model,
            schemas,
            bench_config(),
        )
        .with_membership(
            None,
            tls::Admission::Listed {
                keys: Default::default(),
                file,
            },
        );
        t.add_peers(std::slice::from_ref(&server))
            .expect("peer added");
        let peer = t.inner.peers()[0].clone();
        let l = rt
            .block_on(link(&t.inner, &peer))
            .expect("admitted while on the list");
        std::fs::write(&allow, "# nobody now\n").expect("allow file");
        let until = Instant::now() + Duration::from_secs(5);
        while l.conn.close_reason().is_none() {
            assert!(
                Instant::now() < until,
                "the connection to a server no longer admitted stayed open 5 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            matches!(
                l.conn.close_reason(),
                Some(quinn::ConnectionError::LocallyClosed)
            ),
            "closed by this node: {:?}",
            l.conn.close_reason()
        );
        let again = rt.block_on(link(&t.inner, &peer));
        assert!(again.is_err(), "a server no longer admitted was redialled");
        t.close();
    }
}
