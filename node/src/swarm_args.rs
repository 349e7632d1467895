//! The swarm options every networked command shares (`--swarm`, `--cert`, `--revoked`,
//! `--discover`, `--lan-interface`, `--dht-bootstrap`, `--dht-listen`), and their resolution
//! into a typed [`SwarmConfig`] before any work starts.
//!
//! A command flattens [`SwarmArgs`] and calls [`SwarmArgs::resolve`] once with its node key;
//! the library takes the result ([`SwarmConfig::identity`], [`SwarmConfig::admission`],
//! [`SwarmConfig::discover`]), never the clap struct.

use std::collections::HashSet;
use std::net::{SocketAddr, SocketAddrV4, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use stormo_manifests::{PublicKey, SecretKey};

use stormo_net::discover::{dht::DhtConfig, lan::LanConfig, DiscoverConfig, Source};
pub use stormo_net::swarm::{MembershipConfig, SwarmConfig};
use stormo_net::tls::RevokedList;

/// Swarm membership and discovery options.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SwarmArgs {
    /// Join the swarm with this key (64 hex, printed by `stormo swarm create`): present
    /// --cert to peers and admit any peer with a valid certificate of this swarm, checked in
    /// the handshake both ways. Keys of --allow/--allow-file (or all, --allow-any) are still
    /// admitted without one.
    #[arg(long, value_name = "SWARMKEY", requires = "cert")]
    pub swarm: Option<String>,
    /// This node's membership certificate, from the swarm owner's `stormo swarm admit`.
    #[arg(long, value_name = "CERT", requires = "swarm")]
    pub cert: Option<PathBuf>,
    /// A file of revoked node keys (one 64-hex key per line, `#` comments), refused even with
    /// a valid certificate; re-read whenever it changes.
    #[arg(long, value_name = "FILE", requires = "swarm")]
    pub revoked: Option<PathBuf>,
    /// Find peers by themselves: `lan` (mDNS on the local network), `dht` (the BitTorrent
    /// mainline DHT), or both (`lan,dht`). Off unless given: without it a node never
    /// announces itself or asks a DHT.
    #[arg(long, value_delimiter = ',', value_name = "lan,dht")]
    pub discover: Vec<Source>,
    /// With --discover lan: announce and listen only on this interface (repeatable; default
    /// every IPv4 interface but loopback).
    #[arg(long, value_name = "NAME")]
    pub lan_interface: Vec<String>,
    /// With --discover dht: a DHT node to bootstrap from (repeatable; default the public
    /// mainline bootstrap nodes, never used when this is given). Give another stormo node's
    /// --dht-listen for a private DHT; a node given its own --dht-listen address here is the
    /// first node of one and bootstraps from nobody.
    #[arg(long, value_name = "HOST:PORT")]
    pub dht_bootstrap: Vec<String>,
    /// With --discover dht: the UDP address of this node's own DHT node (IPv4), which makes
    /// it a full DHT node others can bootstrap from (default: a random port, client mode).
    #[arg(long, value_name = "ADDR")]
    pub dht_listen: Option<SocketAddr>,
}

impl SwarmArgs {
    /// Whether any swarm option was given.
    fn given(&self) -> bool {
        // Every option counts, so that one that needs another is refused, not ignored
        // (`--dht-bootstrap` without `--discover dht`).
        self.swarm.is_some()
            || self.cert.is_some()
            || !self.discover.is_empty()
            || !self.lan_interface.is_empty()
            || !self.dht_bootstrap.is_empty()
            || self.dht_listen.is_some()
    }

    /// Checks and loads the options for the node whose key is `node` at `now` (Unix seconds):
    /// the swarm key parses, the certificate file is one, is for that swarm and this node's
    /// key, and is valid now (so a node never starts with a certificate every peer would
    /// refuse), and the revocation file reads.
    pub fn resolve(&self, node: &SecretKey, now: u64) -> anyhow::Result<SwarmConfig> {
        let membership = match (&self.swarm, &self.cert) {
            (Some(swarm), Some(cert_path)) => {
                let swarm: PublicKey = swarm
                    .parse()
                    .map_err(|e| anyhow::anyhow!("--swarm {swarm:?}: not a swarm key ({e})"))?;
                let cert = stormo_net::identity::read_cert(cert_path).context("--cert")?;
                let revoked = match &self.revoked {
                    Some(p) => Some(Arc::new(RevokedList::load(p)?)),
                    None => None,
                };
                let revoked_now: HashSet<PublicKey> = revoked
                    .as_ref()
                    .map(|r| r.with(Clone::clone))
                    .unwrap_or_default();
                let checked = cert.verify(&swarm, &node.public(), now, &revoked_now);
                if let Err(stormo_manifests::membership::MembershipError::OtherKey {
                    certified,
                    ..
                }) = checked
                {
                    anyhow::bail!(
                        "--cert {}: it was issued to node {certified}, not to this node's key \
                         {} (--key); give the certificate issued for --key, or the key it was \
                         issued to",
                        cert_path.display(),
                        node.public()
                    );
                }
                checked.with_context(|| {
                    format!(
                        "--cert {}: this node ({}) cannot use it in swarm {swarm}",
                        cert_path.display(),
                        node.public()
                    )
                })?;
                Some(MembershipConfig {
                    swarm,
                    cert,
                    revoked,
                })
            }
            (None, None) => None,
            // clap's `requires` rules this out; a caller building SwarmArgs by hand may not.
            _ => anyhow::bail!("--swarm and --cert go together"),
        };
        let sources: HashSet<Source> = self.discover.iter().copied().collect();
        let lan = sources.contains(&Source::Lan).then(|| LanConfig {
            interfaces: self.lan_interface.clone(),
        });
        anyhow::ensure!(
            lan.is_some() || self.lan_interface.is_empty(),
            "--lan-interface needs --discover lan"
        );
        let dht = if sources.contains(&Source::Dht) {
            let listen = match self.dht_listen {
                None => None,
                Some(SocketAddr::V4(a)) => Some(a),
                Some(SocketAddr::V6(a)) => {
                    anyhow::bail!("--dht-listen {a}: the mainline DHT runs on IPv4 only")
                }
            };
            let mut bootstrap = Vec::new();
            for b in &self.dht_bootstrap {
                bootstrap.extend(bootstrap_addrs(b)?);
            }
            Some(DhtConfig {
                bootstrap,
                listen,
                ..DhtConfig::default()
            })
        } else {
            anyhow::ensure!(
                self.dht_bootstrap.is_empty() && self.dht_listen.is_none(),
                "--dht-bootstrap and --dht-listen need --discover dht"
            );
            None
        };
        Ok(SwarmConfig {
            membership,
            discover: DiscoverConfig {
                lan,
                dht,
                wait: None,
            },
        })
    }
}

/// The IPv4 addresses of one `--dht-bootstrap HOST:PORT` (a name is resolved now). One that
/// gives none is an error: a node given bootstrap nodes never falls back to the public ones
/// in their place.
fn bootstrap_addrs(b: &str) -> anyhow::Result<Vec<SocketAddrV4>> {
    let v: Vec<SocketAddrV4> = b
        .to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("--dht-bootstrap {b:?}: not a reachable HOST:PORT ({e})"))?
        .filter_map(|a| match a {
            SocketAddr::V4(a) => Some(a),
            SocketAddr::V6(_) => None,
        })
        .collect();
    anyhow::ensure!(
        !v.is_empty(),
        "--dht-bootstrap {b:?}: no IPv4 address (the mainline DHT runs on IPv4 only)"
    );
    Ok(v)
}

/// A node's swarm options and, when they needed it, its key, resolved once before the node
/// starts: the key file is loaded here only to check the certificate against it, and then
/// goes to the node ([`NodeIdentity::into_host`]) rather than being loaded again.
#[derive(Debug)]
pub struct NodeIdentity {
    /// The swarm options (`None`: none given).
    swarm: Option<SwarmConfig>,
    /// The key of `--key`, when the swarm options loaded it.
    key: Option<SecretKey>,
}

impl NodeIdentity {
    /// The swarm options, and the host a node with this identity starts on: a new runtime,
    /// with the key when it was loaded (else the node loads `--key` itself when it needs a
    /// key).
    pub fn into_host(self) -> anyhow::Result<(Option<SwarmConfig>, stormo_node::node::Host)> {
        let host = stormo_node::node::Host::new()?;
        let host = match self.key {
            Some(k) => host.with_key(k),
            None => host,
        };
        Ok((self.swarm, host))
    }
}

/// The swarm options of a node whose key file is `key` (loaded only when a swarm option is
/// given), resolved now, with the key it loaded.
pub fn resolve_identity(
    args: &SwarmArgs,
    key: Option<&std::path::Path>,
) -> anyhow::Result<NodeIdentity> {
    if !args.given() {
        return Ok(NodeIdentity {
            swarm: None,
            key: None,
        });
    }
    let secret = match key {
        Some(k) => Some(stormo_net::identity::load_secret_key(k).context("--key")?),
        None => None,
    };
    let swarm = resolve_with_key(args, secret.as_ref())?;
    Ok(NodeIdentity { swarm, key: secret })
}

/// The swarm options of a node whose key (from `--key`; `None`: none given) is loaded
/// already, resolved now; `None` when no swarm option was given.
pub fn resolve_with_key(
    args: &SwarmArgs,
    key: Option<&SecretKey>,
) -> anyhow::Result<Option<SwarmConfig>> {
    if !args.given() {
        return Ok(None);
    }
    let generated;
    let secret = match key {
        Some(k) => k,
        None if args.cert.is_some() => {
            anyhow::bail!("--cert needs --key: the certificate names this node's key")
        }
        // No certificate to check against a key: any key resolves the rest.
        None => {
            generated = SecretKey::generate();
            &generated
        }
    };
    args.resolve(secret, stormo_net::identity::unix_now()?)
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use stormo_manifests::Membership;
    use stormo_net::tls::Admission;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        s: SwarmArgs,
    }

    const NOW: u64 = 1_800_000_000;

    #[test]
    fn options_resolve_and_name_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let owner = SecretKey::from_seed(&[1; 32]);
        let node = SecretKey::from_seed(&[2; 32]);
        let cert = Membership::issue(&owner, node.public(), NOW - 10, NOW + 100).unwrap();
        let cert_path = dir.path().join("node.cert");
        std::fs::write(&cert_path, cert.to_bytes()).unwrap();
        let swarm = owner.public().to_string();
        let cp = cert_path.to_str().unwrap();

        let parse = |args: &[&str]| {
            let mut v = vec!["t"];
            v.extend_from_slice(args);
            T::try_parse_from(v).map(|t| t.s)
        };
        let a = parse(&["--swarm", &swarm, "--cert", cp, "--discover", "lan,dht"]).unwrap();
        let c = a.resolve(&node, NOW).unwrap();
        assert_eq!(c.swarm(), Some(owner.public()));
        assert!(c.discover.lan.is_some() && c.discover.dht.is_some());
        assert!(matches!(c.admission(&[], false), Admission::Swarm(_)));
        assert!(c.identity(&node).membership.is_some());

        // --swarm without --cert, and the other way, are clap errors.
        assert!(parse(&["--swarm", &swarm]).is_err());
        assert!(parse(&["--cert", cp]).is_err());
        assert!(parse(&["--discover", "wifi"]).is_err());
        // Another node's certificate, an expired one, another swarm: named at start.
        let other = SecretKey::from_seed(&[3; 32]);
        let e = format!("{:#}", a.resolve(&other, NOW).unwrap_err());
        assert!(
            e.contains(&format!("issued to node {}", node.public()))
                && e.contains(&format!("not to this node's key {}", other.public())),
            "{e}"
        );
        let e = format!("{:#}", a.resolve(&node, NOW + 100).unwrap_err());
        assert!(e.contains("expired"), "{e}");
        let b = parse(&["--swarm", &other.public().to_string(), "--cert", cp]).unwrap();
        let e = format!("{:#}", b.resolve(&node, NOW).unwrap_err());
        assert!(e.contains("not this swarm"), "{e}");
        // Discovery options without their source.
        let e = parse(&["--lan-interface", "eth0"])
            .unwrap()
            .resolve(&node, NOW);
        assert!(e.unwrap_err().to_string().contains("--discover lan"));
        let e = parse(&["--dht-bootstrap", "127.0.0.1:1"])
            .unwrap()
            .resolve(&node, NOW);
        assert!(e.unwrap_err().to_string().contains("--discover dht"));
        // ... also as a command resolves them (it skipped a discovery option given alone).
        for alone in [
            &["--dht-bootstrap", "127.0.0.1:1"][..],
            &["--dht-listen", "127.0.0.1:1"],
            &["--lan-interface", "eth0"],
        ] {
            let e = resolve_with_key(&parse(alone).unwrap(), None).expect_err(alone[0]);
            assert!(e.to_string().contains("need"), "{alone:?}: {e}");
        }
        // Bootstrap nodes are resolved once; one that gives no IPv4 address is named.
        let c = parse(&[
            "--discover",
            "dht",
            "--dht-bootstrap",
            "127.0.0.1:7001",
            "--dht-bootstrap",
            "127.0.0.2:7002",
        ])
        .unwrap()
        .resolve(&node, NOW)
        .unwrap();
        let d = c.discover.dht.unwrap();
        let want: Vec<SocketAddrV4> = vec![
            "127.0.0.1:7001".parse().unwrap(),
            "127.0.0.2:7002".parse().unwrap(),
        ];
        assert_eq!(d.bootstrap, want);
        for bad in ["[::1]:7001", "127.0.0.1", "127.0.0.1:x"] {
            let e = parse(&["--discover", "dht", "--dht-bootstrap", bad])
                .unwrap()
                .resolve(&node, NOW)
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad), "{e}");
        }
        // Off unless asked.
        let none = parse(&[]).unwrap().resolve(&node, NOW).unwrap();
        assert!(!none.discover.is_on() && none.membership.is_none());
        assert!(matches!(none.admission(&[], false), Admission::Keys(_)));
        assert!(matches!(none.admission(&[], true), Admission::Any));
    }
}
