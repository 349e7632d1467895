//! LAN discovery over mDNS/DNS-SD (RFC 6762/6763) with the `mdns-sd` crate.
//!
//! A node registers one service instance of type [`SERVICE_TYPE`], named by the first 16 hex
//! characters of its node key, at its QUIC port, on the addresses of the interfaces it
//! announces on (the crate fills them in from the interfaces, so never 0.0.0.0). Its TXT
//! record holds:
//!
//! ```text
//! v=1            the record's version
//! k=<64 hex>     the node key (a claim: the handshake proves it)
//! m=<tag>,<tag>  the models it serves, each as discover::lan_model_tag (a keyed hash in a
//!                swarm, the model id otherwise), as many as fit in 255 bytes
//! ```
//!
//! It browses the same type and reports every other instance whose `m` holds one of its own
//! tags. Records from the network are untrusted text: any that do not parse are skipped.
//!
//! Interfaces: every IPv4 interface but loopback by default, or those named by
//! `--lan-interface` (loopback only if named).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use mdns_sd::{IfKind, ServiceDaemon, ServiceEvent, ServiceInfo};
use stormo_manifests::{Hash, PublicKey};
use tokio::sync::mpsc;

use super::{lan_model_tag, Announce, Discovered, Source};

/// The DNS-SD service type stormo nodes announce.
pub const SERVICE_TYPE: &str = "_stormo._udp.local.";
/// The TXT record's version.
const TXT_VERSION: &str = "1";
/// The most bytes of one TXT string (RFC 6763 section 6.1).
const TXT_MAX: usize = 255;

/// How LAN discovery runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LanConfig {
    /// Interfaces to announce and listen on, by name; empty: every IPv4 interface but
    /// loopback.
    pub interfaces: Vec<String>,
}

/// A running mDNS responder and browser; dropping it withdraws the record and stops.
pub struct Lan {
    daemon: ServiceDaemon,
    fullname: String,
}

impl std::fmt::Debug for Lan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lan")
            .field("fullname", &self.fullname)
            .finish_non_exhaustive()
    }
}

impl Lan {
    /// Registers `me` and starts reporting peers to `out` (from a thread of the mDNS crate's
    /// own; no runtime needed).
    pub fn start(cfg: &LanConfig, me: &Announce, out: mpsc::Sender<Discovered>) -> anyhow::Result<Self> {
        let daemon = ServiceDaemon::new().context("starting mDNS (--discover lan)")?;
        let setup = || -> anyhow::Result<String> {
            // IPv4 only: the node's QUIC endpoint is IPv4.
            daemon.disable_interface(IfKind::IPv6)?;
            if cfg.interfaces.is_empty() {
                daemon.disable_interface(IfKind::LoopbackV4)?;
            } else {
                daemon.disable_interface(IfKind::All)?;
                for name in &cfg.interfaces {
                    daemon.enable_interface(IfKind::Name(name.clone()))?;
                }
            }
            let tags: HashMap<String, Hash> = me
                .models
                .iter()
                .map(|m| (lan_model_tag(m, me.swarm.as_ref()), *m))
                .collect();
            let mut m = String::new();
            for tag in tags.keys() {
                if m.len() + 2 + tag.len() + 1 > TXT_MAX {
                    tracing::warn!("mDNS: too many models to announce; announcing the first ones");
                    break;
                }
                if !m.is_empty() {
                    m.push(',');
                }
                m.push_str(tag);
            }
            let key = me.node.to_hex();
            let instance = &key[..16];
            let host = format!("stormo-{instance}.local.");
            let props = [("v", TXT_VERSION), ("k", key.as_str()), ("m", m.as_str())];
            let info = ServiceInfo::new(SERVICE_TYPE, instance, &host, "", me.port, &props[..])?
                .enable_addr_auto();
            let fullname = info.get_fullname().to_string();
            daemon.register(info)?;
            let events = daemon.browse(SERVICE_TYPE)?;
            let me_key = me.node;
            std::thread::Builder::new()
                .name("stormo-mdns".into())
                .spawn(move || {
                    while let Ok(ev) = events.recv() {
                        let ServiceEvent::ServiceResolved(s) = ev else {
                            continue;
                        };
                        let Some(d) = peer_of(&s, &me_key, &tags) else {
                            continue;
                        };
                        tracing::debug!("mDNS: found {d:?}");
                        if out.blocking_send(d).is_err() {
                            break;
                        }
                    }
                })
                .context("starting the mDNS browser thread")?;
            Ok(fullname)
        };
        match setup() {
            Ok(fullname) => Ok(Self { daemon, fullname }),
            Err(e) => {
                let _ = daemon.shutdown();
                Err(e.context("mDNS (--discover lan)"))
            }
        }
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // Withdraw the record (a goodbye packet), then stop the daemon; its browser channel
        // then closes and the browser thread ends.
        if let Ok(done) = self.daemon.unregister(&self.fullname) {
            let _ = done.recv_timeout(std::time::Duration::from_secs(1));
        }
        let _ = self.daemon.shutdown();
    }
}

/// The peer a resolved record names, if it is another stormo node serving one of `tags`.
fn peer_of(
    s: &mdns_sd::ResolvedService,
    me: &PublicKey,
    tags: &HashMap<String, Hash>,
) -> Option<Discovered> {
    if s.txt_properties.get_property_val_str("v") != Some(TXT_VERSION) {
        return None;
    }
    let key: PublicKey = s.txt_properties.get_property_val_str("k")?.parse().ok()?;
    if key == *me {
        return None;
    }
    let models = s.txt_properties.get_property_val_str("m")?;
    let model = models.split(',').find_map(|t| tags.get(t.trim()))?;
    let mut addrs: Vec<SocketAddr> = s
        .get_addresses()
        .iter()
        .map(|ip| ip.to_ip_addr())
        .filter(|ip: &IpAddr| ip.is_ipv4() && !ip.is_unspecified() && !ip.is_multicast())
        .map(|ip| SocketAddr::new(ip, s.port))
        .collect();
    addrs.sort();
    addrs.dedup();
    if addrs.is_empty() || s.port == 0 {
        return None;
    }
    Some(Discovered {
        key: Some(key),
        addrs,
        model: *model,
        via: Source::Lan,
    })
}
