//! A node's swarm, resolved: its membership (the swarm key, its certificate, the revocation
//! list) and which discovery sources run. The CLI resolves its options into a
//! [`SwarmConfig`] once; the node takes this, never the CLI's structs.

use std::collections::HashSet;
use std::sync::Arc;

use stormo_manifests::{Membership, PublicKey, SecretKey};

use crate::discover::DiscoverConfig;
use crate::tls::{Admission, Identity, RevokedList, SwarmAdmission};

/// The resolved swarm options.
#[derive(Clone, Debug, Default)]
pub struct SwarmConfig {
    /// The swarm and this node's place in it, if `--swarm`.
    pub membership: Option<MembershipConfig>,
    /// Which discovery sources to run.
    pub discover: DiscoverConfig,
}

/// A node's swarm: the swarm key, its certificate, the revocation list.
#[derive(Clone, Debug)]
pub struct MembershipConfig {
    /// The swarm key.
    pub swarm: PublicKey,
    /// This node's certificate (checked at start: this swarm, this node's key, valid now).
    pub cert: Membership,
    /// The revoked keys, re-read when the file changes.
    pub revoked: Option<Arc<RevokedList>>,
}

impl SwarmConfig {
    /// This node's handshake identity: its key, and its certificate in a swarm.
    pub fn identity<'a>(&'a self, secret: &'a SecretKey) -> Identity<'a> {
        Identity {
            secret,
            membership: self.membership.as_ref().map(|m| &m.cert),
        }
    }

    /// Whom this node admits: the swarm's members (if `--swarm`) and the keys of `allow`
    /// (`--allow`, `--allow-file`), or anyone (`--allow-any`).
    pub fn admission(&self, allow: &[PublicKey], allow_any: bool) -> Admission {
        let keys: HashSet<[u8; 32]> = allow.iter().map(|k| *k.as_bytes()).collect();
        match &self.membership {
            None if allow_any => Admission::Any,
            None => Admission::Keys(keys),
            Some(m) => Admission::Swarm(Arc::new(SwarmAdmission {
                swarm: m.swarm,
                allow: keys,
                allow_any,
                revoked: m.revoked.clone(),
            })),
        }
    }

    /// The swarm key, if any (what discovery derives its topics from).
    pub fn swarm(&self) -> Option<PublicKey> {
        self.membership.as_ref().map(|m| m.swarm)
    }
}
