//! Internet discovery on the BitTorrent mainline DHT (BEP 5) with the `mainline` crate.
//!
//! A node runs its own DHT node (UDP; `--dht-listen` fixes its address, which also makes it
//! a full "server" DHT node that others can bootstrap from, as on a private network), and for
//! each model it serves:
//!
//! - announces its QUIC port under [`super::dht_key`] (`announce_peer`; the DHT records the
//!   address the announcement came from), again every [`REANNOUNCE`]: BEP 5 nodes forget
//!   announcements after about 30 minutes, and mainline's storage is an LRU, so a node
//!   re-announces well within that. An announcement that fails (no DHT node took it) is tried
//!   again after 1, 2, 4... seconds, at most [`ANNOUNCE_RETRY_MAX`] apart, until one succeeds
//!   ([`AnnounceSchedule`]). A node that only fetches announces nothing;
//! - looks the key up (`get_peers`) at once, then after 2, 4, 8... seconds up to
//!   `lookup_every` ([`lookup_delay`]: a node that starts before its peers finds them soon,
//!   and then asks the DHT once a minute), reports every address found except its own, and
//!   ends each round with [`Event::Looked`].
//!
//! A DHT record is an address and nothing else: the caller learns the node key in the QUIC
//! handshake, where the swarm's admission checks the peer's membership certificate.
//!
//! Bootstrap: `--dht-bootstrap HOST:PORT` (repeatable) replaces mainline's default public
//! bootstrap nodes entirely ([`mainline_config`]); only without it does a node bootstrap
//! from those public nodes. A node whose own `--dht-listen` address is among its bootstrap
//! nodes is the first node of a private DHT: it bootstraps from nobody (never from the public
//! nodes), and the others bootstrap from it; so every node of a private DHT can be given the
//! same `--dht-bootstrap`. Tests always pass a loopback bootstrap.
//!
//! Without `--dht-listen` the DHT node binds a random UDP port (mainline's own default is
//! 6881, taken if free: two nodes on one machine, or a BitTorrent client, would fight over
//! it). It is a client-mode node on the public DHT (mainline's adaptive mode may promote it
//! after 15 minutes), and a full (server-mode) node on a private DHT (bootstrap nodes given),
//! whether it serves or only fetches: on a private network the nodes reach each other, a
//! client-mode node stores nobody's records, and a full node takes none into its routing
//! table.
//!
//! # How nodes of a private DHT find each other in seconds
//! A serving node stores its record at the DHT nodes closest to the key that answer, itself
//! included: mainline queries the address the others know it by, which on a LAN or loopback
//! reaches itself. A lookup then reads every serving node's storage. The first node, alone,
//! stores its record nowhere (no DHT node answers, not even itself: it has not learned its own
//! address yet), so its announcement fails and is tried again with back-off. On a private DHT
//! a node also looks every [`TABLE_POLL`] whether its routing table gained a node; when it
//! did, a failing announcement is tried at once and lookups start again at
//! [`FIRST_LOOKUP_DELAY`]: a node that bootstraps from one that was alone for an hour finds
//! it, and is found, within seconds. That holds for a node that only fetches too (`pull`,
//! `run`, `swarm status` with `--discover dht`): it is a full node there, so the lone seeder
//! takes it into its table, announces, and the fetching node's lookups find it (a client-mode
//! node would never be taken in, and the seeder's record stay nowhere).

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_lite::StreamExt;
use mainline::{async_dht::AsyncDht, Dht, Id};
use stormo_manifests::Hash;
use tokio::sync::mpsc;

use super::{dht_key, Announce, Discovered, Event, Source};

/// How often a node re-announces itself (BEP 5 peers expire after about 30 minutes).
pub const REANNOUNCE: Duration = Duration::from_secs(15 * 60);
/// How often a node looks for peers by default, once it has been running a while.
pub const LOOKUP_EVERY: Duration = Duration::from_secs(60);
/// The wait before a node's second lookup; each later wait doubles, up to `lookup_every`.
pub const FIRST_LOOKUP_DELAY: Duration = Duration::from_secs(2);
/// The wait before a failed announcement is tried again; each later wait doubles.
pub const ANNOUNCE_RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between tries of a failing announcement.
pub const ANNOUNCE_RETRY_MAX: Duration = Duration::from_secs(30);
/// How often a node on a private DHT looks whether its routing table gained a node.
pub const TABLE_POLL: Duration = Duration::from_secs(1);
/// How often a node of a private DHT (not the first) pings its bootstrap nodes to notice one
/// that restarted (`BootstrapWatch`).
pub const BOOTSTRAP_CHECK: Duration = Duration::from_secs(15);

/// How DHT discovery runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DhtConfig {
    /// Bootstrap nodes, resolved; empty: mainline's public bootstrap nodes.
    pub bootstrap: Vec<SocketAddrV4>,
    /// The UDP address of this node's DHT node (IPv4), which makes it a server-mode DHT node;
    /// `None`: any port on every interface, as a client-mode DHT node.
    pub listen: Option<SocketAddrV4>,
    /// How often to look for peers, at most.
    pub lookup_every: Duration,
    /// How often to re-announce.
    pub announce_every: Duration,
}

impl Default for DhtConfig {
    fn default() -> Self {
        Self {
            bootstrap: Vec::new(),
            listen: None,
            lookup_every: LOOKUP_EVERY,
            announce_every: REANNOUNCE,
        }
    }
}

impl DhtConfig {
    /// Whether this is a private DHT: bootstrap nodes were given.
    pub fn is_private(&self) -> bool {
        !self.bootstrap.is_empty()
    }
}

/// The `mainline` configuration for `cfg` on a machine whose addresses are `own_ips`.
/// Bootstrap nodes given replace the public ones (mainline falls back to its defaults only
/// when its list is `None`); the node's own `listen` address is left out of them (with an
/// unspecified listen address, its port at any of `own_ips` or any loopback address: a
/// machine's own name often resolves to 127.0.1.1, which no interface lists), and a node left
/// with none bootstraps from nobody. Without `listen` the node binds a random port; it runs in
/// server mode with `listen`, and on a private DHT whether it serves or only fetches (see the
/// module docs).
pub fn mainline_config(cfg: &DhtConfig, own_ips: &[Ipv4Addr]) -> mainline::Config {
    let is_own = |b: &SocketAddrV4| {
        cfg.listen.is_some_and(|l| {
            l.port() == b.port()
                && (l.ip() == b.ip()
                    || (l.ip().is_unspecified()
                        && (b.ip().is_loopback() || own_ips.contains(b.ip()))))
        })
    };
    let bootstrap = (!cfg.bootstrap.is_empty()).then(|| {
        cfg.bootstrap
            .iter()
            .copied()
            .filter(|b| !is_own(b))
            .collect()
    });
    mainline::Config {
        bootstrap,
        // Never mainline's default (6881 if free): a random port unless one was given.
        port: Some(cfg.listen.map_or(0, |l| l.port())),
        bind_address: cfg.listen.map(|l| *l.ip()),
        server_mode: cfg.listen.is_some() || cfg.is_private(),
        ..mainline::Config::default()
    }
}

/// When a serving node announces: at once, then every `every` after a success, and after a
/// failure again in 1, 2, 4... seconds, at most [`ANNOUNCE_RETRY_MAX`] apart (time passed in).
#[derive(Clone, Debug)]
pub struct AnnounceSchedule {
    due: Instant,
    failures: u32,
    every: Duration,
}

impl AnnounceSchedule {
    /// Due at `now`, then every `every`.
    pub fn new(now: Instant, every: Duration) -> Self {
        Self {
            due: now,
            failures: 0,
            every,
        }
    }

    /// When the next announcement is due.
    pub fn due(&self) -> Instant {
        self.due
    }

    /// Failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// An announcement made at `now` succeeded (`ok`) or failed.
    pub fn record(&mut self, ok: bool, now: Instant) {
        if ok {
            self.failures = 0;
            self.due = now + self.every;
        } else {
            self.due = now + announce_retry_delay(self.failures);
            self.failures = self.failures.saturating_add(1);
        }
    }

    /// The DHT gained a node at `now`: a failing announcement is tried again at once.
    pub fn nudge(&mut self, now: Instant) {
        if self.failures > 0 {
            self.due = self.due.min(now);
        }
    }
}

/// The wait after the `failures`-th failure in a row (0: the first): [`ANNOUNCE_RETRY_FIRST`]
/// doubled per failure, at most [`ANNOUNCE_RETRY_MAX`].
pub fn announce_retry_delay(failures: u32) -> Duration {
    ANNOUNCE_RETRY_FIRST
        .checked_mul(1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX))
        .map_or(ANNOUNCE_RETRY_MAX, |d| d.min(ANNOUNCE_RETRY_MAX))
}

/// The wait after lookup round `round` (0: the first): [`FIRST_LOOKUP_DELAY`] doubled per
/// round, at most `every`.
pub fn lookup_delay(round: u32, every: Duration) -> Duration {
    FIRST_LOOKUP_DELAY
        .checked_mul(1u32.checked_shl(round.min(31)).unwrap_or(u32::MAX))
        .map_or(every, |d| d.min(every))
}

/// A running DHT node announcing and looking up; dropping it stops both and the node.
#[derive(Debug)]
pub struct DhtDiscovery {
    task: tokio::task::JoinHandle<()>,
    local: SocketAddr,
}

impl DhtDiscovery {
    /// Starts a DHT node, announcing `me` (when it serves) and reporting peers to `out` from
    /// a task on the current tokio runtime.
    pub fn start(cfg: &DhtConfig, me: &Announce, out: mpsc::Sender<Event>) -> anyhow::Result<Self> {
        let main = mainline_config(cfg, &local_ipv4s());
        // The first node of a private DHT: others bootstrap from it, it from nobody.
        let first = main.bootstrap.as_ref().is_some_and(Vec::is_empty);
        let dht = Dht::new(main.clone())
            .with_context(|| match cfg.listen {
                Some(l) => format!("starting the DHT node on {l} (--dht-listen)"),
                None => "starting the DHT node (--discover dht)".to_string(),
            })?
            .as_async();
        let local = SocketAddr::V4(futures_lite::future::block_on(dht.info()).local_addr());
        tracing::info!("DHT node on {local}");
        let topics: Vec<(Hash, Id)> = me
            .models
            .iter()
            .map(|m| {
                let k = dht_key(m, me.swarm.as_ref());
                (*m, Id::from_bytes(k).expect("a 20-byte key is a DHT id"))
            })
            .collect();
        let watch = (!first && cfg.is_private())
            .then(|| BootstrapWatch::new(main.bootstrap.clone().unwrap_or_default(), main.clone()));
        let task = tokio::spawn(run(
            dht,
            watch,
            topics,
            me.port,
            Timing {
                lookup_every: cfg.lookup_every,
                announce_every: cfg.announce_every,
                first,
                private: cfg.is_private(),
            },
            out,
        ));
        Ok(Self { task, local })
    }

    /// The UDP address of this node's DHT node.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for DhtDiscovery {
    fn drop(&mut self) {
        // The task owns the DHT handle; aborting it drops the handle, which stops the node.
        self.task.abort();
    }
}

/// How [`run`] paces itself.
#[derive(Clone, Copy, Debug)]
struct Timing {
    lookup_every: Duration,
    announce_every: Duration,
    /// The first node of a private DHT (it bootstraps from nobody).
    first: bool,
    /// A private DHT: a node joining is worth an early lookup.
    private: bool,
}

async fn run(
    mut dht: AsyncDht,
    mut watch: Option<BootstrapWatch>,
    topics: Vec<(Hash, Id)>,
    port: Option<u16>,
    t: Timing,
    out: mpsc::Sender<Event>,
) {
    if t.first {
        tracing::info!(
            "DHT: the first node of a private DHT (its --dht-listen is its --dht-bootstrap): \
             the others bootstrap from it"
        );
    } else if !dht.bootstrapped().await {
        // A real failure (the DHT crate's own error about it is not shown, see `logging.rs`
        // in the CLI): this node found no other.
        if t.private {
            tracing::error!(
                "DHT: could not bootstrap: no --dht-bootstrap node answered (are they running \
                 and reachable?); retrying"
            );
        } else {
            tracing::error!(
                "DHT: could not bootstrap: the public bootstrap nodes did not answer (no \
                 internet access? a private DHT takes --dht-bootstrap); retrying"
            );
        }
    }
    let own_ips = local_ipv4s();
    let mut announce = AnnounceSchedule::new(Instant::now(), t.announce_every);
    let mut next_lookup = Instant::now();
    let mut round = 0u32;
    let mut known: HashSet<String> = HashSet::new();
    loop {
        if let Some(port) = port {
            if Instant::now() >= announce.due() {
                let ok = announce_all(&dht, &topics, port, &announce, t.first).await;
                announce.record(ok, Instant::now());
            }
        }
        if Instant::now() >= next_lookup {
            if !look_up(&dht, &topics, port, &own_ips, &out).await {
                return;
            }
            next_lookup = Instant::now() + lookup_delay(round, t.lookup_every);
            round = round.saturating_add(1);
        }
        let mut wake = next_lookup;
        if port.is_some() {
            wake = wake.min(announce.due());
        }
        if t.private {
            wake = wake.min(Instant::now() + TABLE_POLL);
        }
        if let Some(w) = &watch {
            wake = wake.min(w.due);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
            _ = out.closed() => return,
        }
        if let Some(w) = watch.as_mut().filter(|w| Instant::now() >= w.due) {
            let Some((d, again)) = w.check(dht).await else {
                return;
            };
            dht = d;
            if again {
                // Rejoined through a bootstrap node that restarted: announce and look now.
                known.clear();
                let now = Instant::now();
                next_lookup = now;
                round = 0;
                announce = AnnounceSchedule::new(now, t.announce_every);
            }
        }
        if t.private {
            // A node joined the DHT: look (and announce, if that failed) now, not on the
            // slow schedule a node alone has reached.
            let table = dht.to_bootstrap().await;
            let before = known.len();
            known.extend(table);
            if known.len() > before {
                tracing::debug!(
                    "DHT: the routing table gained {} nodes",
                    known.len() - before
                );
                let now = Instant::now();
                next_lookup = now;
                round = 0;
                announce.nudge(now);
            }
        }
    }
}

/// Notices a bootstrap node of a private DHT that restarted, and rejoins through it.
///
/// The first node of a private DHT has no bootstrap list, and takes into its routing table
/// only the nodes that ask it `find_node`, which a node does when it bootstraps. Nodes already
/// running never ask again (their tables hold each other), so a bootstrap node that restarts
/// knows none of them, and nodes started later find only it. Every [`BOOTSTRAP_CHECK`] this
/// node pings each bootstrap node from a socket of its own (a KRPC `ping`: the answer names
/// the answering node's id, and a ping adds nobody to a routing table); when one answers with
/// another id than before, it restarted, and this node's DHT node is made again (same
/// configuration), which bootstraps through it. Bootstrap nodes that do not answer change
/// nothing.
struct BootstrapWatch {
    bootstrap: Vec<SocketAddrV4>,
    config: mainline::Config,
    /// The id each bootstrap node last answered with.
    seen: std::collections::HashMap<SocketAddrV4, [u8; 20]>,
    due: Instant,
}

impl BootstrapWatch {
    fn new(bootstrap: Vec<SocketAddrV4>, config: mainline::Config) -> Self {
        Self {
            bootstrap,
            config,
            seen: Default::default(),
            due: Instant::now(),
        }
    }

    /// Pings the bootstrap nodes. When one of them restarted, `dht` is dropped (freeing a
    /// fixed `--dht-listen` port: the old node's socket goes when its thread sees the handle
    /// gone) and a new node made with the same configuration (or, if that port stays taken
    /// for 5 s, on a random one); `true` then. Otherwise `dht` as it was. `None`: no DHT node
    /// could be made again (no socket at all): discovery by DHT ends, logged.
    async fn check(&mut self, dht: AsyncDht) -> Option<(AsyncDht, bool)> {
        self.due = Instant::now() + BOOTSTRAP_CHECK;
        let mut restarted = None;
        for &b in &self.bootstrap {
            let Some(id) = ping_id(b, Duration::from_secs(2)).await else {
                continue;
            };
            if self.seen.insert(b, id).is_some_and(|old| old != id) {
                restarted = Some(b);
            }
        }
        let Some(b) = restarted else {
            return Some((dht, false));
        };
        tracing::info!(
            "DHT: bootstrap node {b} restarted (another node id): joining through it again"
        );
        drop(dht);
        let mut config = self.config.clone();
        for attempt in 0..51 {
            if attempt == 50 {
                tracing::warn!("DHT: port {:?} still taken: a random port", config.port);
                config.port = Some(0);
            }
            if let Ok(d) = Dht::new(config.clone()) {
                let d = d.as_async();
                if d.bootstrapped().await {
                    tracing::info!("DHT: joined again through {b}");
                }
                return Some((d, true));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tracing::error!("DHT: could not start the DHT node again: discovery by DHT stops");
        None
    }
}

/// The node id the DHT node at `addr` answers a KRPC `ping` with, within `within`; `None`
/// when it does not answer.
async fn ping_id(addr: SocketAddrV4, within: Duration) -> Option<[u8; 20]> {
    let sock = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .await
        .ok()?;
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(b"d1:ad2:id20:");
    // Any id: the answer is all that is read, and a ping adds nobody to a routing table.
    let nonce = format!("{:?}{addr}", Instant::now());
    q.extend_from_slice(&Hash::of(nonce.as_bytes()).0[..20]);
    // mainline reads a 4-byte transaction id.
    q.extend_from_slice(b"e1:q4:ping1:t4:swch1:y1:qe");
    sock.send_to(&q, addr).await.ok()?;
    let mut buf = [0u8; 1500];
    let until = tokio::time::Instant::now() + within;
    loop {
        let (n, from) = tokio::time::timeout_at(until, sock.recv_from(&mut buf))
            .await
            .ok()?
            .ok()?;
        if from == SocketAddr::V4(addr) {
            return krpc_id(&buf[..n]);
        }
    }
}

/// The `id` of a KRPC answer (`d1:rd2:id20:<20 bytes>...`).
fn krpc_id(msg: &[u8]) -> Option<[u8; 20]> {
    const KEY: &[u8] = b"2:id20:";
    let at = msg.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    msg.get(at..at + 20)?.try_into().ok()
}

/// Announces every topic on `port`; whether each succeeded. The first failure in a row is a
/// warning (on the first node of a private DHT, alone until another joins, an info line),
/// later ones are debug lines.
async fn announce_all(
    dht: &AsyncDht,
    topics: &[(Hash, Id)],
    port: u16,
    schedule: &AnnounceSchedule,
    first: bool,
) -> bool {
    let mut all = true;
    for (model, id) in topics {
        match dht.announce_peer(*id, Some(port)).await {
            Ok(_) if schedule.failures() > 0 => tracing::info!(
                "DHT: announced model {} on port {port} (after {} failed tries)",
                model.short(),
                schedule.failures()
            ),
            Ok(_) => tracing::debug!("DHT: announced model {} on port {port}", model.short()),
            Err(e) => {
                all = false;
                let again = announce_retry_delay(schedule.failures()).as_secs();
                if schedule.failures() > 0 {
                    tracing::debug!(
                        "DHT: announcing model {}: {e}; again in {again} s",
                        model.short()
                    );
                } else if first {
                    tracing::info!(
                        "DHT: announcing model {}: {e} (no other DHT node yet); trying again \
                         in {again} s, then less often",
                        model.short()
                    );
                } else {
                    tracing::warn!(
                        "DHT: announcing model {}: {e}; trying again in {again} s, then less \
                         often",
                        model.short()
                    );
                }
            }
        }
    }
    all
}

/// One lookup round: every address found for every topic (but this node's own) goes to
/// `out`, then [`Event::Looked`]. `false` when `out` closed.
async fn look_up(
    dht: &AsyncDht,
    topics: &[(Hash, Id)],
    port: Option<u16>,
    own_ips: &[Ipv4Addr],
    out: &mpsc::Sender<Event>,
) -> bool {
    for (model, id) in topics {
        let mut found = dht.get_peers(*id);
        while let Some(batch) = found.next().await {
            let addrs: Vec<SocketAddr> = batch
                .into_iter()
                .filter(|a| !(Some(a.port()) == port && own_ips.contains(a.ip())))
                .map(SocketAddr::V4)
                .collect();
            for a in addrs {
                let d = Discovered {
                    key: None,
                    addrs: vec![a],
                    model: *model,
                    via: Source::Dht,
                };
                if out.send(Event::Found(d)).await.is_err() {
                    return false;
                }
            }
        }
    }
    out.send(Event::Looked(Source::Dht)).await.is_ok()
}

/// This machine's IPv4 addresses (loopback included), to leave its own announcement out.
fn local_ipv4s() -> Vec<Ipv4Addr> {
    let mut v = vec![Ipv4Addr::LOCALHOST];
    if let Ok(ifs) = if_addrs::get_if_addrs() {
        v.extend(ifs.iter().filter_map(|i| match i.ip() {
            std::net::IpAddr::V4(ip) => Some(ip),
            std::net::IpAddr::V6(_) => None,
        }));
    }
    v
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use stormo_manifests::{PublicKey, SecretKey};

    use super::*;

    /// Issue 41 (a), discovery part: five nodes on a private DHT on 127.0.0.1 (bootstrapped
    /// from a small loopback testnet, never the public nodes) find each other from the model
    /// id and the swarm key alone; a node of another swarm, same model, finds none of them.
    #[test]
    fn nodes_on_a_loopback_dht_find_each_other_from_model_and_swarm_alone() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let testnet = mainline::Testnet::builder(3)
            .bind_address(Ipv4Addr::LOCALHOST)
            .build()
            .expect("a loopback testnet");
        assert!(testnet
            .bootstrap
            .iter()
            .all(|b| b.starts_with("127.0.0.1:")));
        let swarm: PublicKey = SecretKey::from_seed(&[1; 32]).public();
        let stranger_swarm: PublicKey = SecretKey::from_seed(&[2; 32]).public();
        let model = Hash([9; 32]);
        let cfg = DhtConfig {
            bootstrap: testnet
                .bootstrap
                .iter()
                .map(|b| b.parse().expect("a testnet address"))
                .collect(),
            listen: Some(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)),
            lookup_every: Duration::from_millis(500),
            announce_every: REANNOUNCE,
        };
        // QUIC ports the nodes claim (nothing listens: discovery only reports addresses).
        let ports: Vec<u16> = (0..5).map(|i| 41_000 + i).collect();
        rt.block_on(async {
            let (tx, mut rx) = mpsc::channel::<(u16, Event)>(1024);
            let mut nodes = Vec::new();
            for (i, &port) in ports.iter().chain([&41_999]).enumerate() {
                let me = Announce {
                    node: SecretKey::from_seed(&[10 + i as u8; 32]).public(),
                    port: Some(port),
                    models: vec![model],
                    swarm: Some(if port == 41_999 {
                        stranger_swarm
                    } else {
                        swarm
                    }),
                };
                let (out, mut found) = mpsc::channel(256);
                let node = DhtDiscovery::start(&cfg, &me, out).expect("a DHT node");
                assert!(node.local_addr().ip().is_loopback());
                let tx = tx.clone();
                tokio::spawn(async move {
                    while let Some(d) = found.recv().await {
                        if tx.send((port, d)).await.is_err() {
                            break;
                        }
                    }
                });
                nodes.push(node);
            }
            drop(tx);
            let mut seen: HashMap<u16, HashSet<u16>> = HashMap::new();
            let all_found = |seen: &HashMap<u16, HashSet<u16>>| {
                ports
                    .iter()
                    .all(|p| seen.get(p).is_some_and(|s| s.len() == ports.len() - 1))
            };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while !all_found(&seen) {
                let Ok(Some((me, ev))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
                    panic!("not every node found the other four within 60 s: {seen:?}");
                };
                let Event::Found(d) = ev else {
                    continue;
                };
                assert_eq!(d.via, Source::Dht);
                assert_eq!(d.model, model);
                assert!(d.key.is_none(), "a DHT record carries no key");
                for a in &d.addrs {
                    assert!(a.ip().is_loopback(), "{a}");
                    assert_ne!(a.port(), me, "a node reported itself");
                    seen.entry(me).or_default().insert(a.port());
                }
            }
            // No member announced under the stranger swarm's key, and the stranger is not
            // under the members' key.
            for p in &ports {
                assert!(!seen[p].contains(&41_999), "{seen:?}");
            }
            assert!(seen.get(&41_999).is_none_or(HashSet::is_empty), "{seen:?}");
            drop(nodes);
        });
    }

    /// Issue 57: the first node of a private DHT, alone for a while (its announcements
    /// failing, its lookups already on their slower schedule), and a second serving node that
    /// bootstraps from it (no --dht-listen: a random port) find each other within seconds:
    /// the first announces and looks again as soon as its routing table gains the newcomer.
    /// Alone for 7 s, its next scheduled lookup is at 14 s and its next announcement at 15 s:
    /// finding each other within 5 s of the join takes the nudge, not the schedule.
    #[test]
    fn two_serving_nodes_find_each_other_in_seconds_after_the_first_was_alone() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .and_then(|u| u.local_addr())
            .expect("a free UDP port")
            .port();
        let first_addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
        let first = DhtConfig {
            bootstrap: vec![first_addr],
            listen: Some(first_addr),
            ..DhtConfig::default()
        };
        let second = DhtConfig {
            bootstrap: vec![first_addr],
            listen: None,
            ..DhtConfig::default()
        };
        let model = Hash([7; 32]);
        let swarm: PublicKey = SecretKey::from_seed(&[3; 32]).public();
        let me = |port: u16, seed: u8| Announce {
            node: SecretKey::from_seed(&[seed; 32]).public(),
            port: Some(port),
            models: vec![model],
            swarm: Some(swarm),
        };
        rt.block_on(async {
            let (tx1, mut rx1) = mpsc::channel(256);
            let a = DhtDiscovery::start(&first, &me(42_001, 21), tx1).expect("first node");
            assert_eq!(a.local_addr(), SocketAddr::V4(first_addr));
            tokio::time::sleep(Duration::from_secs(7)).await;
            let (tx2, mut rx2) = mpsc::channel(256);
            let b = DhtDiscovery::start(&second, &me(42_002, 22), tx2).expect("second node");
            assert_ne!(b.local_addr().port(), 6881, "a random port, not mainline's default");
            let joined = tokio::time::Instant::now();
            let deadline = joined + Duration::from_secs(5);
            let (mut a_found, mut b_found) = (false, false);
            while !(a_found && b_found) {
                let ev = tokio::select! {
                    e = rx1.recv() => e.map(|e| (1, e)),
                    e = rx2.recv() => e.map(|e| (2, e)),
                    _ = tokio::time::sleep_until(deadline) => {
                        panic!("within 5 s: first found second {a_found}, second found first {b_found}")
                    }
                };
                if let Some((who, Event::Found(d))) = ev {
                    for addr in &d.addrs {
                        assert_ne!(addr.port(), if who == 1 { 42_001 } else { 42_002 });
                        a_found |= who == 1 && addr.port() == 42_002;
                        b_found |= who == 2 && addr.port() == 42_001;
                    }
                }
            }
            eprintln!("found each other in {:?}", joined.elapsed());
            drop((a, b));
        });
    }

    fn v4(s: &str) -> SocketAddrV4 {
        s.parse().expect("an IPv4 address and port")
    }

    /// Bootstrap nodes given replace the public ones: mainline falls back to its defaults only
    /// for a `None` list, which a node gets only when it was given none.
    #[test]
    fn given_bootstrap_nodes_replace_the_public_ones_and_the_first_node_has_none() {
        let given = DhtConfig {
            bootstrap: vec![v4("127.0.0.1:7001"), v4("127.0.0.1:7002")],
            ..DhtConfig::default()
        };
        let c = mainline_config(&given, &[Ipv4Addr::LOCALHOST]);
        assert_eq!(c.bootstrap, Some(given.bootstrap.clone()));
        // No --dht-listen: a random port (never mainline's 6881), every interface; a full
        // node on this private DHT, whether it serves or only fetches (a lone seeder takes
        // only full nodes into its routing table, and needs one to store its record).
        assert!(c.server_mode && c.port == Some(0) && c.bind_address.is_none());
        // The first node of a private DHT: its own address is its only bootstrap node.
        let first = DhtConfig {
            bootstrap: vec![v4("127.0.0.1:7001")],
            listen: Some(v4("127.0.0.1:7001")),
            ..DhtConfig::default()
        };
        let c = mainline_config(&first, &[Ipv4Addr::LOCALHOST]);
        assert_eq!(
            c.bootstrap,
            Some(Vec::new()),
            "nobody, never the public nodes"
        );
        assert!(c.server_mode);
        assert_eq!(c.port, Some(7001));
        assert_eq!(c.bind_address, Some(Ipv4Addr::LOCALHOST));
        // The same on every interface, named by one of this machine's addresses; another
        // machine's at that port, or this one's at another port, stays.
        let lan = DhtConfig {
            bootstrap: vec![
                v4("10.0.0.2:6881"),
                v4("10.0.0.3:6881"),
                v4("10.0.0.2:6882"),
            ],
            listen: Some(v4("0.0.0.0:6881")),
            ..DhtConfig::default()
        };
        let own = [Ipv4Addr::LOCALHOST, Ipv4Addr::new(10, 0, 0, 2)];
        assert_eq!(
            mainline_config(&lan, &own).bootstrap,
            Some(vec![v4("10.0.0.3:6881"), v4("10.0.0.2:6882")])
        );
        // Issue 60: the README's recipe on the first host, whose name resolves to 127.0.1.1
        // (Debian's /etc/hosts), which no interface lists: still its own address, so it
        // bootstraps from nobody (it bootstrapped from itself and logged an ERROR).
        let named = DhtConfig {
            bootstrap: vec![v4("127.0.1.1:6881")],
            ..lan.clone()
        };
        assert_eq!(mainline_config(&named, &own).bootstrap, Some(Vec::new()));
        // Only a node given none uses the public nodes; there, without --dht-listen, a
        // client-mode node on a random port.
        let public = mainline_config(&DhtConfig::default(), &own);
        assert_eq!(public.bootstrap, None);
        assert!(!public.server_mode && public.port == Some(0));
    }

    /// A KRPC answer's id is read wherever the key stands; a message without one, or cut
    /// short, has none.
    #[test]
    fn a_krpc_answer_names_its_id() {
        let id = [7u8; 20];
        let mut msg = b"d2:ip6:\x7f\0\0\x01\x1a\xe11:rd2:id20:".to_vec();
        msg.extend_from_slice(&id);
        msg.extend_from_slice(b"e1:t2:sw1:y1:re");
        assert_eq!(krpc_id(&msg), Some(id));
        assert_eq!(krpc_id(b"d1:y1:ee"), None);
        assert_eq!(krpc_id(b"d1:rd2:id20:short"), None);
    }

    /// A live DHT node answers the watch's ping with its id, the same each time; a port where
    /// nothing answers gives none within the wait.
    #[test]
    fn a_ping_reads_a_dht_nodes_id() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let node = Dht::new(mainline::Config {
            bootstrap: Some(Vec::new()),
            port: Some(0),
            bind_address: Some(Ipv4Addr::LOCALHOST),
            server_mode: true,
            ..mainline::Config::default()
        })
        .expect("a DHT node")
        .as_async();
        let info = rt.block_on(node.info());
        let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, info.local_addr().port());
        let once = rt.block_on(ping_id(addr, Duration::from_secs(2)));
        let twice = rt.block_on(ping_id(addr, Duration::from_secs(2)));
        assert!(once.is_some(), "no answer from {addr}");
        assert_eq!(once, twice);
        assert_eq!(once.as_ref(), Some(info.id().as_bytes()));
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("socket");
        let SocketAddr::V4(quiet) = silent.local_addr().expect("address") else {
            unreachable!("bound on IPv4")
        };
        assert_eq!(
            rt.block_on(ping_id(quiet, Duration::from_millis(300))),
            None
        );
    }

    /// A failed announcement is tried again after 1, 2, 4... s, at most 30 s apart, until one
    /// succeeds; then on the long period. A node joining nudges a failing one to now.
    #[test]
    fn a_failed_announce_is_retried_with_back_off_then_on_the_long_period() {
        let d: Vec<u64> = (0..8).map(|f| announce_retry_delay(f).as_secs()).collect();
        assert_eq!(d, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(announce_retry_delay(u32::MAX), ANNOUNCE_RETRY_MAX);
        let t0 = Instant::now();
        let mut s = AnnounceSchedule::new(t0, REANNOUNCE);
        assert_eq!(s.due(), t0, "due at once");
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..7 {
            s.record(false, now);
            waits.push((s.due() - now).as_secs());
            now = s.due();
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        // Someone joined: the failing announcement goes at once.
        let joined = now - Duration::from_secs(10);
        s.nudge(joined);
        assert_eq!(s.due(), joined);
        s.record(true, joined);
        assert_eq!(s.failures(), 0);
        assert_eq!(s.due(), joined + REANNOUNCE, "then on the long period");
        // A nudge does not hurry an announcement that succeeded.
        s.nudge(joined + Duration::from_secs(1));
        assert_eq!(s.due(), joined + REANNOUNCE);
        // And a failure after a success starts the back-off over.
        s.record(false, joined);
        assert_eq!(s.due(), joined + ANNOUNCE_RETRY_FIRST);
    }

    #[test]
    fn lookups_start_often_and_slow_down_to_the_interval() {
        let every = Duration::from_secs(60);
        let d: Vec<u64> = (0..8).map(|r| lookup_delay(r, every).as_secs()).collect();
        assert_eq!(d, [2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(lookup_delay(u32::MAX, every), every);
        assert_eq!(
            lookup_delay(0, Duration::from_secs(1)),
            Duration::from_secs(1)
        );
    }
}
