//! The bookkeeping of discovered peers: which to add to a node's peer set, and which to take
//! out again when they go away. Sans-IO: events and the time come in as arguments, changes
//! to the peer set come out; the node's discovery task applies them ([`super`] describes the
//! sources).
//!
//! A peer is *alive* while some source vouches for it:
//! - the LAN, from the moment its mDNS record resolves until the record is withdrawn (a
//!   goodbye when the node stops) or expires (mDNS records live 75 minutes without a refresh,
//!   the node's responder refreshes them while it runs): [`PeerBook::lan_found`],
//!   [`PeerBook::lan_gone`];
//! - the DHT, for [`PeerBook::lost_after`] after the last time one of its DHT addresses
//!   answered a handshake proving its key ([`PeerBook::dht_alive`]). A DHT record alone proves
//!   nothing: the DHT keeps a stopped node's announcement for up to 30 minutes, so the node's
//!   discovery task dials each address a lookup reports, and only an answer counts.
//!
//! A peer no source vouches for any more is removed ([`Change::Remove`]) and forgotten: if it
//! comes back (its record resolves again, its address answers again) it is added again. Peers
//! given on the command line (`--peer`) are pinned: discovery never removes them.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use stormo_manifests::PublicKey;

use crate::PeerAddr;

/// A change to make to the node's peer set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add this peer (new, back after it went away, or moved to another address).
    Add(PeerAddr),
    /// Remove the peer with this key: no source vouches for it any more.
    Remove(PublicKey),
}

/// What vouches for one peer.
#[derive(Clone, Debug)]
struct Entry {
    addr: SocketAddr,
    /// Its mDNS record is announced (resolved and neither withdrawn nor expired).
    lan: bool,
    /// When one of its DHT addresses last answered a handshake.
    dht: Option<Instant>,
}

/// The discovered peers of one node. See the module docs.
#[derive(Debug)]
pub struct PeerBook {
    me: PublicKey,
    lost_after: Duration,
    pinned: HashSet<PublicKey>,
    entries: HashMap<PublicKey, Entry>,
}

impl PeerBook {
    /// The book of node `me`, whose DHT peers count as gone `lost_after` after their last
    /// answer, and which never removes the `pinned` peers (those of `--peer`).
    pub fn new(me: PublicKey, lost_after: Duration, pinned: &[PeerAddr]) -> Self {
        Self {
            me,
            lost_after,
            pinned: pinned.iter().map(|p| p.key).collect(),
            entries: HashMap::new(),
        }
    }

    /// How long a DHT peer stays in the set after its last answer.
    pub fn lost_after(&self) -> Duration {
        self.lost_after
    }

    /// The peer `key` announces itself on the LAN at `addr`.
    pub fn lan_found(&mut self, key: PublicKey, addr: SocketAddr) -> Option<Change> {
        self.vouch(key, addr, |e| e.lan = true)
    }

    /// The LAN record of `key` was withdrawn or expired.
    pub fn lan_gone(&mut self, key: &PublicKey, now: Instant) -> Option<Change> {
        let e = self.entries.get_mut(key)?;
        e.lan = false;
        self.drop_if_unvouched(key, now)
    }

    /// The peer `key` answered a handshake at `addr`, a DHT address, at `now`.
    pub fn dht_alive(&mut self, key: PublicKey, addr: SocketAddr, now: Instant) -> Option<Change> {
        self.vouch(key, addr, |e| e.dht = Some(now))
    }

    /// The DHT peers whose last answer is older than [`Self::lost_after`] and that the LAN
    /// does not vouch for: removed.
    pub fn expire(&mut self, now: Instant) -> Vec<Change> {
        let keys: Vec<PublicKey> = self.entries.keys().copied().collect();
        keys.iter()
            .filter_map(|k| self.drop_if_unvouched(k, now))
            .collect()
    }

    /// Whether the peer at DHT address `addr` answered recently (within a third of
    /// [`Self::lost_after`]): no need to dial it again yet.
    pub fn answered_recently(&self, addr: SocketAddr, now: Instant) -> bool {
        self.entries.values().any(|e| {
            e.addr == addr
                && e.dht
                    .is_some_and(|t| now.saturating_duration_since(t) < self.lost_after / 3)
        })
    }

    /// The key of the peer known at `addr`, if any.
    pub fn key_at(&self, addr: SocketAddr) -> Option<PublicKey> {
        self.entries
            .iter()
            .find(|(_, e)| e.addr == addr)
            .map(|(k, _)| *k)
    }

    /// How many discovered peers are in the set.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no discovered peer is in the set.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn vouch(
        &mut self,
        key: PublicKey,
        addr: SocketAddr,
        mark: impl FnOnce(&mut Entry),
    ) -> Option<Change> {
        if key == self.me {
            return None;
        }
        let (e, changed) = match self.entries.get_mut(&key) {
            Some(e) => {
                let moved = e.addr != addr;
                e.addr = addr;
                (e, moved)
            }
            None => (
                self.entries.entry(key).or_insert(Entry {
                    addr,
                    lan: false,
                    dht: None,
                }),
                true,
            ),
        };
        mark(e);
        changed.then_some(Change::Add(PeerAddr { key, addr }))
    }

    fn drop_if_unvouched(&mut self, key: &PublicKey, now: Instant) -> Option<Change> {
        let e = self.entries.get(key)?;
        let dht_fresh = e
            .dht
            .is_some_and(|t| now.saturating_duration_since(t) < self.lost_after);
        if e.lan || dht_fresh {
            return None;
        }
        self.entries.remove(key);
        (!self.pinned.contains(key)).then_some(Change::Remove(*key))
    }
}

#[cfg(test)]
mod tests {
    use stormo_manifests::SecretKey;

    use super::*;

    fn key(seed: u8) -> PublicKey {
        SecretKey::from_seed(&[seed; 32]).public()
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    const LOST: Duration = Duration::from_secs(180);

    #[test]
    fn a_dht_peer_that_stops_answering_is_removed_and_added_again_when_it_answers() {
        let t0 = Instant::now();
        let mut b = PeerBook::new(key(0), LOST, &[]);
        let add = Change::Add(PeerAddr {
            key: key(1),
            addr: addr(1),
        });
        assert_eq!(b.dht_alive(key(1), addr(1), t0), Some(add.clone()));
        assert!(b.answered_recently(addr(1), t0 + LOST / 3 - Duration::from_secs(1)));
        assert!(!b.answered_recently(addr(1), t0 + LOST / 3));
        assert!(!b.answered_recently(addr(2), t0));
        // Answering again changes nothing, and keeps it fresh.
        assert_eq!(b.dht_alive(key(1), addr(1), t0 + LOST / 2), None);
        assert!(b.expire(t0 + LOST).is_empty(), "answered LOST/2 ago");
        assert_eq!(b.key_at(addr(1)), Some(key(1)));
        // No answer for LOST: removed, and forgotten.
        let gone = t0 + LOST / 2 + LOST;
        assert_eq!(b.expire(gone), vec![Change::Remove(key(1))]);
        assert!(b.is_empty() && b.key_at(addr(1)).is_none());
        assert!(b.expire(gone + LOST).is_empty(), "removed once only");
        // Back: added again.
        assert_eq!(b.dht_alive(key(1), addr(1), gone + LOST), Some(add));
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn a_lan_peer_stays_until_its_record_goes_and_comes_back_with_it() {
        let t0 = Instant::now();
        let mut b = PeerBook::new(key(0), LOST, &[]);
        assert!(matches!(b.lan_found(key(2), addr(2)), Some(Change::Add(_))));
        assert_eq!(b.lan_found(key(2), addr(2)), None);
        // The LAN vouches for it however long it is silent on the DHT.
        assert!(b.expire(t0 + 100 * LOST).is_empty());
        assert_eq!(b.lan_gone(&key(2), t0), Some(Change::Remove(key(2))));
        assert_eq!(b.lan_gone(&key(2), t0), None, "removed once only");
        assert!(matches!(b.lan_found(key(2), addr(2)), Some(Change::Add(_))));
    }

    #[test]
    fn a_peer_both_sources_know_goes_when_neither_vouches() {
        let t0 = Instant::now();
        let mut b = PeerBook::new(key(0), LOST, &[]);
        assert!(b.lan_found(key(3), addr(3)).is_some());
        assert_eq!(b.dht_alive(key(3), addr(3), t0), None);
        // The record goes, but the DHT answer is fresh: it stays, then expires.
        assert_eq!(b.lan_gone(&key(3), t0 + LOST / 2), None);
        assert!(b.expire(t0 + LOST / 2).is_empty());
        assert_eq!(b.expire(t0 + LOST), vec![Change::Remove(key(3))]);
    }

    #[test]
    fn a_peer_at_a_new_address_is_added_there() {
        let t0 = Instant::now();
        let mut b = PeerBook::new(key(0), LOST, &[]);
        b.dht_alive(key(4), addr(4), t0);
        assert_eq!(
            b.dht_alive(key(4), addr(40), t0),
            Some(Change::Add(PeerAddr {
                key: key(4),
                addr: addr(40)
            }))
        );
        assert_eq!(b.key_at(addr(40)), Some(key(4)));
        assert_eq!(b.key_at(addr(4)), None);
    }

    #[test]
    fn itself_is_never_added_and_pinned_peers_never_removed() {
        let t0 = Instant::now();
        let pinned = PeerAddr {
            key: key(5),
            addr: addr(5),
        };
        let mut b = PeerBook::new(key(0), LOST, std::slice::from_ref(&pinned));
        assert_eq!(b.dht_alive(key(0), addr(9), t0), None);
        assert_eq!(b.lan_found(key(0), addr(9)), None);
        assert!(b.is_empty());
        // A pinned peer found by discovery too: added (the peer set keeps one copy), never
        // removed by discovery.
        assert!(b.dht_alive(key(5), addr(5), t0).is_some());
        assert!(b.expire(t0 + 2 * LOST).is_empty());
        assert!(b.is_empty());
    }
}
