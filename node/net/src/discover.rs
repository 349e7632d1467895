//! Discovery: finding the peers of a swarm without typing their addresses.
//!
//! Two sources, each off unless asked for (`--discover lan,dht`): a node never announces
//! itself or queries a DHT on its own.
//!
//! - [`lan`]: mDNS/DNS-SD on the local network (the `mdns-sd` crate). A node announces its
//!   node key, its QUIC port, and a tag per model it serves, at the real addresses of the
//!   interfaces it announces on (never 0.0.0.0), and reports every node of the same swarm and
//!   model it hears.
//! - [`dht`]: the BitTorrent mainline DHT (the `mainline` crate). A node announces its QUIC
//!   port under a 20-byte key derived from the model id and the swarm key ([`dht_key`]),
//!   looks that key up now and then, and reports the addresses it finds.
//!
//! Only a node that serves (`--listen`) announces itself; one that only fetches (`run`
//! without `--listen`, `pull`) looks without announcing ([`Announce::port`] `None`): nobody
//! could dial it.
//!
//! # The seam
//! [`start`] takes what to announce ([`Announce`]), the resolved [`DiscoverConfig`], and a
//! tokio `mpsc::Sender<Event>`; it returns a [`Discovery`] handle whose drop (or
//! [`Discovery::stop`]) stops announcing and looking. Each [`Event::Found`] names the peer's
//! addresses and, from the LAN, the node key it announced; [`Event::Lost`] says a LAN record
//! went away; [`Event::Looked`] ends a DHT lookup round. Nothing here is trusted: the key in an
//! mDNS record is a claim, and a DHT address is only an address. [`drive`] turns the events
//! into changes of a peer set through a [`book::PeerBook`]: it dials each DHT address
//! ([`probe`]) with [`crate::tls::client_config_for`] under the swarm's
//! [`crate::tls::Admission::Swarm`], so only a peer that proves a key with a valid
//! membership certificate counts, and removes peers that go away (see [`book`]).
//!
//! # Privacy of the model
//! In a swarm (`--swarm`), the model tags announced on the LAN are keyed hashes of the model
//! id ([`lan_model_tag`]), and the DHT key is derived from the swarm key too: who does not
//! know the swarm key cannot tell which model the swarm runs. Without a swarm the LAN tag is
//! the model id itself (an open swarm wants to be found).
//!
//! Non-goals: NAT traversal (a node behind NAT dials out, and serves only through a forwarded
//! port), and peer exchange.

pub mod book;
pub mod dht;
pub mod lan;

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stormo_manifests::{Hash, PublicKey};
use tokio::sync::mpsc;

use book::{Change, PeerBook};

/// What a discovery source reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A peer announced itself (again).
    Found(Discovered),
    /// The LAN record of the node with this key was withdrawn (the node stopped) or expired.
    Lost {
        /// The key its record named.
        key: PublicKey,
        /// Which source lost it.
        via: Source,
    },
    /// A lookup round of this source ended: every address it found was reported before.
    Looked(Source),
}

/// A peer some discovery source reported.
#[derive(Clone, PartialEq, Eq)]
pub struct Discovered {
    /// The node key it announced (LAN); `None` from the DHT, which carries addresses only.
    /// A claim until the handshake proves it.
    pub key: Option<PublicKey>,
    /// Where it says it listens (QUIC), at least one.
    pub addrs: Vec<SocketAddr>,
    /// The model (one of those announced) it serves.
    pub model: Hash,
    /// Which source reported it.
    pub via: Source,
}

impl fmt::Debug for Discovered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self
            .key
            .map_or_else(|| "?".to_string(), |k| crate::short_key(&k));
        write!(f, "{key}@{:?} via {}", self.addrs, self.via)
    }
}

/// A discovery source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// mDNS on the local network.
    Lan,
    /// The mainline DHT.
    Dht,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Lan => "lan",
            Self::Dht => "dht",
        })
    }
}

impl FromStr for Source {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.trim() {
            "lan" => Ok(Self::Lan),
            "dht" => Ok(Self::Dht),
            other => anyhow::bail!("{other:?} is not a discovery source (lan or dht)"),
        }
    }
}

/// What this node announces.
#[derive(Clone, Debug)]
pub struct Announce {
    /// Its node key.
    pub node: PublicKey,
    /// The UDP port its QUIC endpoint serves on (the same on every address); `None` for a node
    /// that only fetches: it looks for peers without announcing itself.
    pub port: Option<u16>,
    /// The models it serves, or wants: it looks for peers of these.
    pub models: Vec<Hash>,
    /// Its swarm (the owner's key), if any.
    pub swarm: Option<PublicKey>,
}

/// Which sources to run, and how.
#[derive(Clone, Debug, Default)]
pub struct DiscoverConfig {
    /// mDNS on the local network, if asked.
    pub lan: Option<lan::LanConfig>,
    /// The mainline DHT, if asked.
    pub dht: Option<dht::DhtConfig>,
    /// How long a node that only fetches waits at start for what discovery finds (`None`:
    /// the node's default, 15 s; `swarm status` gives its `--wait`).
    pub wait: Option<Duration>,
}

impl DiscoverConfig {
    /// Whether any source is on.
    pub fn is_on(&self) -> bool {
        self.lan.is_some() || self.dht.is_some()
    }
}

/// Running discovery: dropping it stops announcing (the LAN record is withdrawn) and looking.
#[derive(Debug, Default)]
pub struct Discovery {
    /// Held for its drop, which withdraws the record.
    _lan: Option<lan::Lan>,
    dht: Option<dht::DhtDiscovery>,
}

impl Discovery {
    /// Stops every source (as dropping does).
    pub fn stop(self) {}

    /// The UDP address of this node's own DHT node, if it runs one (what other nodes can
    /// give as `--dht-bootstrap`).
    pub fn dht_local_addr(&self) -> Option<SocketAddr> {
        self.dht.as_ref().map(dht::DhtDiscovery::local_addr)
    }
}

/// Starts the sources `cfg` asks for, announcing `me`; every peer found goes to `out`. Must
/// be called inside a tokio runtime (the DHT runs as a task on it). Returns an empty handle
/// when no source is on.
pub fn start(
    cfg: &DiscoverConfig,
    me: &Announce,
    out: mpsc::Sender<Event>,
) -> anyhow::Result<Discovery> {
    anyhow::ensure!(
        !me.models.is_empty() || !cfg.is_on(),
        "discovery needs the id of a model to announce and look for"
    );
    anyhow::ensure!(
        me.port != Some(0),
        "discovery needs the port this node listens on"
    );
    let lan = match &cfg.lan {
        Some(c) => Some(lan::Lan::start(c, me, out.clone())?),
        None => None,
    };
    let dht = match &cfg.dht {
        Some(c) => Some(dht::DhtDiscovery::start(c, me, out)?),
        None => None,
    };
    Ok(Discovery { _lan: lan, dht })
}

/// How far a node's discovery got: the peers its last DHT lookup round found that answered,
/// once the round and its handshakes ended (what a node that starts without peers waits for).
#[derive(Debug, Default)]
pub struct Progress(AtomicU64);

impl Progress {
    const SETTLED: u64 = 1 << 63;

    /// The number of peers in the set after the last settled DHT round, `None` before the
    /// first round settled.
    pub fn settled(&self) -> Option<usize> {
        let v = self.0.load(Ordering::Acquire);
        (v & Self::SETTLED != 0).then_some((v & !Self::SETTLED) as usize)
    }

    fn settle(&self, peers: usize) {
        self.0
            .store(Self::SETTLED | peers as u64, Ordering::Release);
    }
}

/// How a node dials an address a DHT reported: its endpoint, and a client configuration
/// that presents its membership and admits only members (the swarm's admission).
#[derive(Clone, Debug)]
pub struct Dialer {
    /// The endpoint to dial from.
    pub endpoint: quinn::Endpoint,
    /// The client configuration (no key pinned: a DHT record names none).
    pub client: quinn::ClientConfig,
}

/// The key a peer at `addr` proves in a handshake that `d` accepts, within `within` (the
/// connection is closed again at once); `None` when it does not answer or is refused.
pub async fn probe(d: &Dialer, addr: SocketAddr, within: Duration) -> Option<PublicKey> {
    let connecting = d
        .endpoint
        .connect_with(d.client.clone(), addr, "stormo")
        .ok()?;
    let conn = tokio::time::timeout(within, connecting)
        .await
        .ok()?
        .map_err(|e| tracing::debug!("discovered address {addr}: {e}"))
        .ok()?;
    let key = crate::tls::peer_key(&conn).map(|k| PublicKey::from_bytes(&k));
    conn.close(0u32.into(), b"key learned");
    key.and_then(Result::ok)
}

/// How often [`drive`] expires peers that went away.
const EXPIRE_EVERY: Duration = Duration::from_secs(5);

/// Runs the bookkeeping of discovered peers until `events` closes: peers found for `model`
/// go into `book` (a DHT address once it answered a [`probe`] through `dial`), and every
/// change of the book goes to `apply` (add to, or remove from, the peer set). `progress`
/// tells how far the DHT's lookups got.
pub async fn drive(
    mut events: mpsc::Receiver<Event>,
    mut book: PeerBook,
    model: Hash,
    dial: Dialer,
    apply: impl Fn(Change) + Send + 'static,
    progress: Arc<Progress>,
) {
    let (ptx, mut prx) = mpsc::channel::<(SocketAddr, Option<PublicKey>)>(64);
    let mut probing: HashSet<SocketAddr> = HashSet::new();
    let mut round_over = false;
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                None => return,
                Some(Event::Found(d)) if d.model == model => match d.key {
                    Some(key) => {
                        if let Some(c) = d.addrs.first().and_then(|a| book.lan_found(key, *a)) {
                            apply(c);
                        }
                    }
                    None => {
                        for &addr in &d.addrs {
                            // A peer that answered lately is not dialled on every lookup.
                            if !book.answered_recently(addr, Instant::now()) && probing.insert(addr) {
                                let (dial, ptx) = (dial.clone(), ptx.clone());
                                tokio::spawn(async move {
                                    let key = probe(&dial, addr, crate::CONNECT_TIMEOUT).await;
                                    let _ = ptx.send((addr, key)).await;
                                });
                            }
                        }
                    }
                },
                Some(Event::Found(_)) => {}
                Some(Event::Lost { key, .. }) => {
                    if let Some(c) = book.lan_gone(&key, Instant::now()) {
                        apply(c);
                    }
                }
                Some(Event::Looked(_)) => round_over = true,
            },
            Some((addr, key)) = prx.recv() => {
                probing.remove(&addr);
                match key {
                    Some(key) => {
                        if let Some(c) = book.dht_alive(key, addr, Instant::now()) {
                            apply(c);
                        }
                    }
                    None => tracing::debug!("discovered address {addr} did not answer"),
                }
            },
            _ = tick.tick() => {
                for c in book.expire(Instant::now()) {
                    apply(c);
                }
            },
        }
        if round_over && probing.is_empty() {
            round_over = false;
            progress.settle(book.len());
        }
    }
}

/// How long [`find_peers`] looks at most.
pub const FIND_WITHIN: Duration = Duration::from_secs(30);

/// The peers of `sw`'s swarm serving `model` that discovery finds, for a command that fetches
/// once (`stormo pull`) and announces nothing: it looks (as `secret`) until a DHT lookup round
/// found at least one peer that answered (LAN only: until one peer is found, and a second
/// more), or `within` passed. Errors when it found none. Dials from an endpoint of its own,
/// closed when done ([`find_peers_on`] dials from a node's).
pub fn find_peers(
    rt: &tokio::runtime::Runtime,
    secret: &stormo_manifests::SecretKey,
    sw: &crate::swarm::SwarmConfig,
    model: Hash,
    within: Duration,
) -> anyhow::Result<Vec<crate::PeerAddr>> {
    let endpoint = {
        let _g = rt.enter();
        crate::bind(crate::unspecified(false), None)?
    };
    let found = find_peers_on(rt, &endpoint, secret, sw, model, within);
    endpoint.close(0u32.into(), b"done");
    found
}

/// [`find_peers`] dialling the addresses it finds from `endpoint` (a node's own, which stays
/// open; the connections made to learn keys are closed).
pub fn find_peers_on(
    rt: &tokio::runtime::Runtime,
    endpoint: &quinn::Endpoint,
    secret: &stormo_manifests::SecretKey,
    sw: &crate::swarm::SwarmConfig,
    model: Hash,
    within: Duration,
) -> anyhow::Result<Vec<crate::PeerAddr>> {
    use std::sync::Mutex;
    let me = secret.public();
    let dial = Dialer {
        endpoint: endpoint.clone(),
        client: crate::tls::client_config_for(
            sw.identity(secret),
            None,
            sw.admission(&[], sw.membership.is_none()),
        )?,
    };
    let (tx, rx) = mpsc::channel(64);
    let announce = Announce {
        node: me,
        port: None,
        models: vec![model],
        swarm: sw.swarm(),
    };
    let discovery = {
        let _g = rt.enter();
        start(&sw.discover, &announce, tx)?
    };
    let found: Arc<Mutex<Vec<crate::PeerAddr>>> = Arc::default();
    let f = found.clone();
    let apply = move |c: Change| {
        let mut f = f.lock().expect("found peers lock");
        match c {
            Change::Add(p) => {
                tracing::info!("discovered peer {p}");
                f.retain(|q| q.key != p.key);
                f.push(p);
            }
            Change::Remove(k) => f.retain(|q| q.key != k),
        }
    };
    let progress = Arc::new(Progress::default());
    let book = PeerBook::new(me, within, &[]);
    rt.spawn(drive(rx, book, model, dial, apply, progress.clone()));
    let dht = sw.discover.dht.is_some();
    let started = Instant::now();
    let mut first_seen: Option<Instant> = None;
    while started.elapsed() < within {
        let n = found.lock().expect("found peers lock").len();
        if n > 0 && first_seen.is_none() {
            first_seen = Some(Instant::now());
        }
        let done = if dht {
            progress.settled().is_some_and(|n| n > 0)
        } else {
            first_seen.is_some_and(|t| t.elapsed() >= Duration::from_secs(1))
        };
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(discovery);
    let peers = found.lock().expect("found peers lock").clone();
    anyhow::ensure!(
        !peers.is_empty(),
        "discovery found no peer serving model {} within {} s (is a node of this swarm \
         serving it with --discover, and are the --dht-bootstrap nodes reachable?)",
        model.to_hex(),
        within.as_secs()
    );
    Ok(peers)
}

/// The tag a model is announced under on the LAN: the model id in hex without a swarm; with
/// one, the first 16 bytes of BLAKE3 keyed by a key derived from the swarm key, in hex.
pub fn lan_model_tag(model: &Hash, swarm: Option<&PublicKey>) -> String {
    match swarm {
        None => model.to_string(),
        Some(s) => {
            let key = blake3::derive_key("stormo 2026 lan model tag v1", s.as_bytes());
            let h = blake3::keyed_hash(&key, model.as_bytes());
            hex_of(&h.as_bytes()[..16])
        }
    }
}

/// The 20-byte DHT key a model's nodes announce under: the first 20 bytes of BLAKE3 in
/// derive-key mode (context `stormo 2026 dht topic v1`) over the swarm key (32 zero bytes
/// for no swarm) and the model id.
pub fn dht_key(model: &Hash, swarm: Option<&PublicKey>) -> [u8; 20] {
    let mut h = blake3::Hasher::new_derive_key("stormo 2026 dht topic v1");
    h.update(swarm.map_or(&[0u8; 32], PublicKey::as_bytes).as_slice());
    h.update(model.as_bytes());
    let mut out = [0u8; 20];
    out.copy_from_slice(&h.finalize().as_bytes()[..20]);
    out
}

/// The addresses peers can dial for an endpoint bound to `bound`: `bound` itself for a
/// specific address; for 0.0.0.0 (or ::), the port at each address of this machine's
/// interfaces of that family, loopback last (alone only when there is nothing else).
pub fn reachable_addrs(bound: SocketAddr) -> Vec<SocketAddr> {
    if !bound.ip().is_unspecified() {
        return vec![bound];
    }
    let mut v: Vec<SocketAddr> = if_addrs::get_if_addrs()
        .unwrap_or_default()
        .into_iter()
        .map(|i| i.ip())
        .filter(|ip| ip.is_ipv4() == bound.is_ipv4() && !ip.is_loopback())
        // IPv6 link-local addresses need a scope to be dialled: leave them out.
        .filter(|ip| match ip {
            std::net::IpAddr::V6(a) => (a.segments()[0] & 0xffc0) != 0xfe80,
            std::net::IpAddr::V4(_) => true,
        })
        .map(|ip| SocketAddr::new(ip, bound.port()))
        .collect();
    v.sort();
    v.dedup();
    if v.is_empty() {
        let lo: std::net::IpAddr = if bound.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        };
        v.push(SocketAddr::new(lo, bound.port()));
    }
    v
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Hash {
        Hash([7; 32])
    }

    /// The derivations are pinned: nodes of different builds must meet under the same keys.
    #[test]
    fn topic_derivations_are_pinned_and_depend_on_the_swarm() {
        let swarm = stormo_manifests::SecretKey::from_seed(&[1; 32]).public();
        let other = stormo_manifests::SecretKey::from_seed(&[2; 32]).public();
        let k = dht_key(&model(), Some(&swarm));
        let mut h = blake3::Hasher::new_derive_key("stormo 2026 dht topic v1");
        h.update(swarm.as_bytes());
        h.update(&[7; 32]);
        assert_eq!(k[..], h.finalize().as_bytes()[..20]);
        assert_ne!(k, dht_key(&model(), Some(&other)));
        assert_ne!(k, dht_key(&model(), None));
        assert_ne!(k, dht_key(&Hash([8; 32]), Some(&swarm)));

        assert_eq!(lan_model_tag(&model(), None), "07".repeat(32));
        let tag = lan_model_tag(&model(), Some(&swarm));
        assert_eq!(tag.len(), 32);
        assert!(!("07".repeat(32)).contains(&tag));
        assert_ne!(tag, lan_model_tag(&model(), Some(&other)));
    }

    #[test]
    fn reachable_addresses_are_never_unspecified() {
        let specific: SocketAddr = "127.0.0.1:4433".parse().unwrap();
        assert_eq!(reachable_addrs(specific), vec![specific]);
        let any: SocketAddr = "0.0.0.0:4433".parse().unwrap();
        let v = reachable_addrs(any);
        assert!(!v.is_empty());
        for a in v {
            assert!(
                !a.ip().is_unspecified() && a.is_ipv4() && a.port() == 4433,
                "{a}"
            );
        }
    }

    /// The driver without a source: a LAN record adds its peer and its goodbye removes it; a
    /// DHT address that does not answer is never added, and the lookup round settles once its
    /// dial has ended; events for another model are ignored.
    #[test]
    fn the_driver_adds_and_removes_lan_peers_and_skips_silent_dht_addresses() {
        use stormo_manifests::SecretKey;
        async fn next(c: &mut mpsc::UnboundedReceiver<Change>) -> Option<Change> {
            tokio::time::timeout(Duration::from_secs(10), c.recv())
                .await
                .expect("a change within 10 s")
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let me = SecretKey::from_seed(&[1; 32]);
        let peer = SecretKey::from_seed(&[2; 32]).public();
        // A UDP port on loopback where nothing answers QUIC.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
        let silent_addr = silent.local_addr().expect("addr");
        rt.block_on(async {
            let dial = Dialer {
                endpoint: crate::bind("127.0.0.1:0".parse().unwrap(), None).expect("ep"),
                client: crate::tls::client_config_for(
                    crate::tls::Identity::key(&me),
                    None,
                    crate::tls::Admission::Any,
                )
                .expect("client"),
            };
            let (tx, rx) = mpsc::channel(8);
            let (ctx, mut changes) = mpsc::unbounded_channel();
            let progress = Arc::new(Progress::default());
            let book = PeerBook::new(me.public(), Duration::from_secs(60), &[]);
            let task = tokio::spawn(drive(
                rx,
                book,
                model(),
                dial,
                move |c| {
                    let _ = ctx.send(c);
                },
                progress.clone(),
            ));
            let at: SocketAddr = "10.1.2.3:4433".parse().unwrap();
            let found = |model: Hash, key: Option<PublicKey>, addr: SocketAddr| {
                Event::Found(Discovered {
                    key,
                    addrs: vec![addr],
                    model,
                    via: if key.is_some() {
                        Source::Lan
                    } else {
                        Source::Dht
                    },
                })
            };
            let within = Duration::from_secs(10);
            tx.send(found(Hash([8; 32]), Some(peer), at)).await.unwrap();
            tx.send(found(model(), Some(peer), at)).await.unwrap();
            assert_eq!(
                next(&mut changes).await,
                Some(Change::Add(crate::PeerAddr {
                    key: peer,
                    addr: at
                }))
            );
            tx.send(found(model(), None, silent_addr)).await.unwrap();
            tx.send(Event::Looked(Source::Dht)).await.unwrap();
            tx.send(Event::Lost {
                key: peer,
                via: Source::Lan,
            })
            .await
            .unwrap();
            assert_eq!(next(&mut changes).await, Some(Change::Remove(peer)));
            // The silent address's dial ends (the connect timeout), then the round settles,
            // with no peer left.
            let until = tokio::time::Instant::now() + within;
            while progress.settled().is_none() {
                assert!(
                    tokio::time::Instant::now() < until,
                    "the round never settled"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(progress.settled(), Some(0));
            assert!(changes.try_recv().is_err(), "the silent address was added");
            drop(tx);
            tokio::time::timeout(within, task)
                .await
                .expect("the driver ends when its events end")
                .expect("the driver");
        });
        drop(silent);
    }

    #[test]
    fn sources_parse_and_name_a_bad_one() {
        assert_eq!("lan".parse::<Source>().unwrap(), Source::Lan);
        assert_eq!(" dht".parse::<Source>().unwrap(), Source::Dht);
        let e = "wifi".parse::<Source>().unwrap_err().to_string();
        assert!(e.contains("\"wifi\""), "{e}");
    }
}
