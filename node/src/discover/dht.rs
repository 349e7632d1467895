//! Internet discovery on the BitTorrent mainline DHT (BEP 5) with the `mainline` crate.
//!
//! A node runs its own DHT node (UDP; `--dht-listen` fixes its address, which also makes it
//! a full "server" DHT node that others can bootstrap from, as on a private network), and for
//! each model it serves:
//!
//! - announces its QUIC port under [`super::dht_key`] (`announce_peer`; the DHT records the
//!   address the announcement came from), again every [`REANNOUNCE`]: BEP 5 nodes forget
//!   announcements after about 30 minutes, and mainline's storage is an LRU, so a node
//!   re-announces well within that;
//! - looks the key up (`get_peers`) at once and then every `lookup_every`, and reports every
//!   address found except its own.
//!
//! A DHT record is an address and nothing else: the caller learns the node key in the QUIC
//! handshake, where the swarm's admission checks the peer's membership certificate.
//!
//! Bootstrap: `--dht-bootstrap HOST:PORT` (repeatable) replaces mainline's default public
//! bootstrap nodes; without it a node bootstraps from those public nodes (which a test must
//! never do: tests always pass a loopback bootstrap).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use anyhow::Context;
use futures_lite::StreamExt;
use mainline::{async_dht::AsyncDht, Dht, Id};
use stormo_manifests::Hash;
use tokio::sync::mpsc;

use super::{dht_key, Announce, Discovered, Source};

/// How often a node re-announces itself (BEP 5 peers expire after about 30 minutes).
pub const REANNOUNCE: Duration = Duration::from_secs(15 * 60);
/// How often a node looks for peers by default.
pub const LOOKUP_EVERY: Duration = Duration::from_secs(60);

/// How DHT discovery runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DhtConfig {
    /// Bootstrap nodes (`HOST:PORT`); empty: mainline's public bootstrap nodes.
    pub bootstrap: Vec<String>,
    /// The UDP address of this node's DHT node (IPv4); `None`: any port on every interface,
    /// as a client-mode DHT node.
    pub listen: Option<SocketAddrV4>,
    /// How often to look for peers.
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

/// A running DHT node announcing and looking up; dropping it stops both and the node.
#[derive(Debug)]
pub struct DhtDiscovery {
    task: tokio::task::JoinHandle<()>,
    local: SocketAddr,
}

impl DhtDiscovery {
    /// Starts a DHT node, announcing `me` and reporting peers to `out` from a task on the
    /// current tokio runtime.
    pub fn start(
        cfg: &DhtConfig,
        me: &Announce,
        out: mpsc::Sender<Discovered>,
    ) -> anyhow::Result<Self> {
        let mut b = Dht::builder();
        if !cfg.bootstrap.is_empty() {
            b.bootstrap(&cfg.bootstrap);
        }
        if let Some(listen) = cfg.listen {
            b.bind_address(*listen.ip())
                .port(listen.port())
                .server_mode();
        }
        let dht = b
            .build()
            .context("starting the DHT node (--discover dht)")?
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
    port: u16,
    lookup_every: Duration,
    announce_every: Duration,
    out: mpsc::Sender<Discovered>,
) {
    if !dht.bootstrapped().await {
        tracing::warn!(
            "DHT: not bootstrapped (are the --dht-bootstrap nodes reachable?); retrying"
        );
    }
    let own_ips = local_ipv4s();
    let mut announced: Option<tokio::time::Instant> = None;
    loop {
        let now = tokio::time::Instant::now();
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
        for (model, id) in &topics {
            let mut found = dht.get_peers(*id);
            while let Some(batch) = found.next().await {
                let addrs: Vec<SocketAddr> = batch
                    .into_iter()
                    .filter(|a| !(a.port() == port && own_ips.contains(a.ip())))
                    .map(SocketAddr::V4)
                    .collect();
                for a in addrs {
                    let d = Discovered {
                        key: None,
                        addrs: vec![a],
                        model: *model,
                        via: Source::Dht,
                    };
                    if out.send(d).await.is_err() {
                        return;
                    }
                }
            }
        }
        tokio::time::sleep(lookup_every).await;
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
            bootstrap: testnet.bootstrap.clone(),
            listen: Some(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)),
            lookup_every: Duration::from_millis(500),
            announce_every: REANNOUNCE,
        };
        // QUIC ports the nodes claim (nothing listens: discovery only reports addresses).
        let ports: Vec<u16> = (0..5).map(|i| 41_000 + i).collect();
        rt.block_on(async {
            let (tx, mut rx) = mpsc::channel::<(u16, Discovered)>(1024);
            let mut nodes = Vec::new();
            for (i, &port) in ports.iter().chain([&41_999]).enumerate() {
                let me = Announce {
                    node: SecretKey::from_seed(&[10 + i as u8; 32]).public(),
                    port,
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
                let Ok(Some((me, d))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
                    panic!("not every node found the other four within 60 s: {seen:?}");
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
}
