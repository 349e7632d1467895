//! Internet discovery on the BitTorrent mainline DHT (BEP 5) with the `mainline` crate.
//!
//! A node runs its own DHT node (UDP; `--dht-listen` fixes its address, which also makes it
//! a full "server" DHT node that others can bootstrap from, as on a private network), and for
//! each model it serves:
//!
//! - announces its QUIC port under [`super::dht_key`] (`announce_peer`; the DHT records the
//!   address the announcement came from), again every [`REANNOUNCE`]: BEP 5 nodes forget
//!   announcements after about 30 minutes, and mainline's storage is an LRU, so a node
//!   re-announces well within that. A node that only fetches announces nothing;
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

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

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

/// The `mainline` configuration for `cfg` on a machine whose addresses are `own_ips`.
/// Bootstrap nodes given replace the public ones (mainline falls back to its defaults only
/// when its list is `None`); the node's own `listen` address is left out of them (with an
/// unspecified listen address, its port at any of `own_ips`), and a node left with none
/// bootstraps from nobody.
pub fn mainline_config(cfg: &DhtConfig, own_ips: &[Ipv4Addr]) -> mainline::Config {
    let is_own = |b: &SocketAddrV4| {
        cfg.listen.is_some_and(|l| {
            l.port() == b.port()
                && (l.ip() == b.ip() || (l.ip().is_unspecified() && own_ips.contains(b.ip())))
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
        port: cfg.listen.map(|l| l.port()),
        bind_address: cfg.listen.map(|l| *l.ip()),
        server_mode: cfg.listen.is_some(),
        ..mainline::Config::default()
    }
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
        let dht = Dht::new(mainline_config(cfg, &local_ipv4s()))
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
        let task = tokio::spawn(run(
            dht,
            topics,
            me.port,
            cfg.lookup_every,
            cfg.announce_every,
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

async fn run(
    dht: AsyncDht,
    topics: Vec<(Hash, Id)>,
    port: Option<u16>,
    lookup_every: Duration,
    announce_every: Duration,
    out: mpsc::Sender<Event>,
) {
    if !dht.bootstrapped().await {
        tracing::warn!(
            "DHT: not bootstrapped (are the --dht-bootstrap nodes reachable?); retrying"
        );
    }
    let own_ips = local_ipv4s();
    let mut announced: Option<tokio::time::Instant> = None;
    for round in 0u32.. {
        let now = tokio::time::Instant::now();
        if let Some(port) = port {
            if announced.is_none_or(|t| now.duration_since(t) >= announce_every) {
                for (model, id) in &topics {
                    match dht.announce_peer(*id, Some(port)).await {
                        Ok(_) => {
                            tracing::debug!("DHT: announced model {} on port {port}", model.short())
                        }
                        Err(e) => tracing::warn!("DHT: announcing model {}: {e}", model.short()),
                    }
                }
                announced = Some(now);
            }
        }
        for (model, id) in &topics {
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
                        return;
                    }
                }
            }
        }
        if out.send(Event::Looked(Source::Dht)).await.is_err() {
            return;
        }
        tokio::time::sleep(lookup_delay(round, lookup_every)).await;
    }
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
        assert!(!c.server_mode && c.port.is_none() && c.bind_address.is_none());
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
        // Only a node given none uses the public nodes.
        assert_eq!(mainline_config(&DhtConfig::default(), &own).bootstrap, None);
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
