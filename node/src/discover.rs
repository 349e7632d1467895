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
//! # The seam
//! [`start`] takes what to announce ([`Announce`]), the resolved [`DiscoverConfig`], and a
//! tokio `mpsc::Sender<Discovered>`; it returns a [`Discovery`] handle whose drop (or
//! [`Discovery::stop`]) stops announcing and looking. Each [`Discovered`] names the peer's
//! addresses and, from the LAN, the node key it announced. Nothing here is trusted: the key
//! in an mDNS record is a claim, and a DHT address is only an address. The caller dials with
//! [`crate::net::tls::client_config_for`] under the swarm's
//! [`crate::net::tls::Admission::Swarm`], so the handshake admits a discovered peer only if it
//! proves a key with a valid membership certificate (and the announced key, when pinned).
//! The same peer is reported again on every lookup; the caller keeps the set.
//!
//! # Privacy of the model
//! In a swarm (`--swarm`), the model tags announced on the LAN are keyed hashes of the model
//! id ([`lan_model_tag`]), and the DHT key is derived from the swarm key too: who does not
//! know the swarm key cannot tell which model the swarm runs. Without a swarm the LAN tag is
//! the model id itself (an open swarm wants to be found).
//!
//! Non-goals: NAT traversal (a node behind NAT dials out, and serves only through a forwarded
//! port), and peer exchange.

pub mod dht;
pub mod lan;

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use stormo_manifests::{Hash, PublicKey};
use tokio::sync::mpsc;

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
            .map_or_else(|| "?".to_string(), |k| crate::net::short_key(&k));
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
    /// The UDP port its QUIC endpoint listens on (the same on every address).
    pub port: u16,
    /// The models it serves (and looks for peers of). A node that only fetches still names
    /// the model it wants: it is found too, and other nodes then know it.
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
    out: mpsc::Sender<Discovered>,
) -> anyhow::Result<Discovery> {
    anyhow::ensure!(
        !me.models.is_empty() || !cfg.is_on(),
        "discovery needs the id of a model to announce and look for"
    );
    anyhow::ensure!(
        me.port != 0,
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

    #[test]
    fn sources_parse_and_name_a_bad_one() {
        assert_eq!("lan".parse::<Source>().unwrap(), Source::Lan);
        assert_eq!(" dht".parse::<Source>().unwrap(), Source::Dht);
        let e = "wifi".parse::<Source>().unwrap_err().to_string();
        assert!(e.contains("\"wifi\""), "{e}");
    }
}
