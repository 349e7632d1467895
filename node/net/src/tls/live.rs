//! Membership on live connections: a connection this node admitted is closed as soon as its
//! admission policy ([`Admission`]) would refuse its peer now, not only at the handshake.
//!
//! The peer server puts every connection it accepts on a watch ([`LiveMembers::admit`]), with
//! what its peer proved in the handshake: its node key and its membership certificate. A
//! watcher (one task per server, started with it) judges them again, with the very check of
//! the handshake ([`Admission::check`]):
//!
//! - every connection, when a list file of the policy changed (a key added to `--revoked`,
//!   or removed from `--allow-file`);
//! - one connection, when its membership certificate reaches its expiry (a key on `--allow`,
//!   or `--allow-any`, stays admitted without a valid certificate, as in the handshake).
//!
//! A connection refused now is closed with the application code [`ErrorCode::FORBIDDEN`] and
//! the refusal as its reason (`no longer admitted: node ... is revoked`, `...: the certificate
//! expired at ...`), and the same words are logged (WARN) with the peer's key and address.
//!
//! # Polling, once a second
//! The watcher asks each list file for its modification time and length once a second (and
//! re-reads it only when one changed) instead of asking the OS for change events (inotify,
//! kqueue): that takes no new dependency and no code per platform, it keeps following a file
//! that an editor or `mv` replaces by a new one (a watch on the old inode goes quiet), and it
//! works on network file systems that send no events. One `stat` a second is nothing beside a
//! QUIC server's work, and a second is well inside the 5 s in which a revocation must take
//! effect. The same tick finds the certificates that expired: their validity is counted in
//! whole seconds, so a timer per expiry would close a connection less than a second sooner.
//!
//! # Sans-IO core
//! [`Admitted`] holds the connections and is given the time; it returns those to close. It is
//! tested without sockets; [`LiveMembers`] drives it with quinn connections and a clock.
//!
//! The connections this node dials are watched the same way: the peer tier puts each link's
//! connection on a watch under the policy it admits servers by (`tier::Inner::dialled`), so a
//! server revoked, or whose certificate expires, while this node uses it is closed too (and
//! its redial refused in the handshake).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use stormo_manifests::{Membership, PublicKey};
use stormo_wire::ErrorCode;

use super::{Admission, Refusal};

/// How often the watcher looks at the list files and the expiries.
const POLL: Duration = Duration::from_secs(1);

/// The code a connection is closed with when its peer is no longer admitted.
pub(crate) const NO_LONGER_ADMITTED: ErrorCode = ErrorCode::FORBIDDEN;

/// One admitted connection: what its peer proved, and when it was last judged.
#[derive(Debug)]
struct Entry<C> {
    key: PublicKey,
    /// The membership extension's bytes, as the handshake saw them.
    membership: Option<Vec<u8>>,
    /// The certificate's expiry (Unix seconds), when it decodes.
    expires: Option<u64>,
    /// The lists' generation it was last judged under (`None`: not yet judged here).
    judged: Option<u64>,
    /// When its verdict changes by itself: the expiry of a certificate that admits it.
    due: Option<u64>,
    handle: C,
}

/// The connections admitted under one policy, judged again when its lists change or a
/// certificate expires. Sans-IO: the time is passed in, the connections to close come out.
#[derive(Debug)]
pub(crate) struct Admitted<C> {
    admission: Admission,
    next_id: u64,
    entries: HashMap<u64, Entry<C>>,
}

/// A connection whose peer its policy refuses now: the caller closes it.
#[derive(Debug)]
pub(crate) struct Ended<C> {
    /// The connection.
    pub(crate) handle: C,
    /// Its peer's node key.
    pub(crate) key: PublicKey,
    /// Why it is refused now.
    pub(crate) reason: Refusal,
}

impl<C> Admitted<C> {
    /// No connections yet, under `admission`.
    pub(crate) fn new(admission: Admission) -> Self {
        Self {
            admission,
            next_id: 0,
            entries: HashMap::new(),
        }
    }

    /// Puts a connection on the watch: its peer proved `key` and presented `membership` (the
    /// extension's bytes, if any). It is judged at the next [`Self::sweep`], since a list may
    /// have changed between its handshake and now. Returns its id for [`Self::remove`].
    pub(crate) fn insert(&mut self, key: PublicKey, membership: Option<Vec<u8>>, handle: C) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let expires = membership
            .as_deref()
            .and_then(|b| Membership::from_bytes(b).ok())
            .map(|m| m.expires);
        self.entries.insert(
            id,
            Entry {
                key,
                membership,
                expires,
                judged: None,
                due: None,
                handle,
            },
        );
        id
    }

    /// Takes a connection off the watch (it closed).
    pub(crate) fn remove(&mut self, id: u64) -> Option<C> {
        self.entries.remove(&id).map(|e| e.handle)
    }

    /// How many connections are watched.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Judges again at `now` (Unix seconds) every connection whose verdict may have changed
    /// (a list changed since it was judged, or its certificate's expiry came), and takes those
    /// refused now off the watch, returned with the reason.
    pub(crate) fn sweep(&mut self, now: u64) -> Vec<Ended<C>> {
        let Self {
            admission, entries, ..
        } = self;
        // Re-reads a list file whose stamp changed.
        let generation = admission.lists_generation();
        let mut refused = Vec::new();
        for (&id, e) in entries.iter_mut() {
            let stale = e.judged != Some(generation) || e.due.is_some_and(|d| d <= now);
            if !stale {
                continue;
            }
            match admission.check(&e.key, e.membership.as_deref(), now) {
                Ok(()) => {
                    e.judged = Some(generation);
                    e.due = e.expires.filter(|&x| x > now);
                }
                Err(reason) => refused.push((id, reason)),
            }
        }
        refused
            .into_iter()
            .filter_map(|(id, reason)| {
                let e = entries.remove(&id)?;
                Some(Ended {
                    handle: e.handle,
                    key: e.key,
                    reason,
                })
            })
            .collect()
    }
}

/// The live connections of one server under its admission policy, and the watcher that
/// closes those it no longer admits (see the module docs).
#[derive(Debug)]
pub(crate) struct LiveMembers {
    admitted: Mutex<Admitted<quinn::Connection>>,
}

/// A connection on the watch; dropping it takes the connection off.
#[derive(Debug)]
pub(crate) struct Watched {
    members: Weak<LiveMembers>,
    id: u64,
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(m) = self.members.upgrade() {
            m.lock().remove(self.id);
        }
    }
}

impl LiveMembers {
    /// A watch over the connections `admission` admits, its watcher spawned on the current
    /// tokio runtime (it ends once the watch is dropped). `None` when no verdict of the policy
    /// can change while a connection lives (anyone, or a fixed list of keys). Must be called
    /// inside a tokio runtime.
    pub(crate) fn start(admission: Admission) -> Option<Arc<Self>> {
        if !admission.can_change() {
            return None;
        }
        let me = Arc::new(Self {
            admitted: Mutex::new(Admitted::new(admission)),
        });
        tokio::spawn(watch(Arc::downgrade(&me)));
        Some(me)
    }

    /// Puts `conn` on the watch, with the key and membership its peer proved in the
    /// handshake; `None` for a connection whose peer proved no node key (never admitted).
    pub(crate) fn admit(self: &Arc<Self>, conn: &quinn::Connection) -> Option<Watched> {
        let cert = super::peer_cert(conn)?;
        let key = PublicKey::from_bytes(&cert.key).ok()?;
        let id = self.lock().insert(key, cert.membership, conn.clone());
        Some(Watched {
            members: Arc::downgrade(self),
            id,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Admitted<quinn::Connection>> {
        self.admitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Judges the connections at `now` and closes those refused (see [`end`]).
    fn sweep(&self, now: u64) {
        let ended = self.lock().sweep(now);
        for e in ended {
            end(e);
        }
    }
}

/// The reason a connection is closed with, and logged.
fn why(reason: &Refusal) -> String {
    format!("no longer admitted: {reason}")
}

/// Closes a connection whose peer is no longer admitted, saying why (to the peer in the close
/// reason, and in the log with the peer's key and address).
fn end(e: Ended<quinn::Connection>) {
    let why = why(&e.reason);
    tracing::warn!(
        peer = %crate::short_key(&e.key),
        "closing the connection of {}@{}: {why}",
        e.key,
        e.handle.remote_address()
    );
    e.handle
        .close(u32::from(NO_LONGER_ADMITTED.0).into(), why.as_bytes());
}

/// The watcher: every [`POLL`], the sweep of the connections (on a blocking thread: it may
/// read a file and check a signature per connection), until the watch is dropped.
async fn watch(members: Weak<LiveMembers>) {
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(m) = members.upgrade() else {
            return;
        };
        let now = match crate::identity::unix_now() {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!("membership watch: {}", crate::error_message(&e));
                continue;
            }
        };
        if tokio::task::spawn_blocking(move || m.sweep(now))
            .await
            .is_err()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::HashSet;

    use stormo_manifests::{MembershipError, SecretKey};
    use stormo_testing::Member;

    use crate::tls::{RevokedList, SwarmAdmission};

    const T: u64 = 1_800_000_000;

    fn key(seed: u8) -> SecretKey {
        SecretKey::from_seed(&[seed; 32])
    }

    fn cert(owner: &SecretKey, node: &SecretKey, expires: u64) -> Option<Vec<u8>> {
        Some(
            Membership::issue(owner, node.public(), T - 60, expires)
                .expect("a valid period")
                .to_bytes()
                .to_vec(),
        )
    }

    fn names<C: Copy>(ended: &[Ended<C>]) -> Vec<C> {
        ended.iter().map(|e| e.handle).collect()
    }

    /// The sweep without sockets: a key written into the revocation file (beside a malformed
    /// line) ends its connection at the next sweep, a certificate ends its connection at its
    /// expiry, and the others stay: a member with a later expiry, and a key on `--allow` whose
    /// certificate expired (admitted without one, as in the handshake).
    #[test]
    fn a_sweep_ends_revoked_and_expired_members_and_keeps_the_others() {
        let owner = key(80);
        let (revoked, expiring, allowed, staying) = (key(81), key(82), key(83), key(84));
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("revoked");
        std::fs::write(&path, "# nobody yet\n").expect("write");
        let admission = Admission::Swarm(Arc::new(SwarmAdmission {
            swarm: owner.public(),
            allow: [*allowed.public().as_bytes()].into(),
            allow_any: false,
            revoked: Some(Arc::new(RevokedList::load(&path).expect("loads"))),
        }));
        let mut live = Admitted::new(admission);
        live.insert(
            revoked.public(),
            cert(&owner, &revoked, T + 3600),
            "revoked",
        );
        live.insert(
            expiring.public(),
            cert(&owner, &expiring, T + 10),
            "expiring",
        );
        live.insert(allowed.public(), cert(&owner, &allowed, T + 10), "allowed");
        live.insert(
            staying.public(),
            cert(&owner, &staying, T + 3600),
            "staying",
        );
        let gone = live.insert(staying.public(), None, "gone");
        assert_eq!(live.remove(gone), Some("gone"));
        assert!(
            live.sweep(T).is_empty(),
            "members were ended before anything changed"
        );
        assert_eq!(live.len(), 4);

        std::fs::write(&path, format!("not a key\n{}\n", revoked.public())).expect("revoke");
        let ended = live.sweep(T + 1);
        assert_eq!(names(&ended), ["revoked"]);
        assert!(matches!(
            ended[0].reason,
            Refusal::Membership(MembershipError::Revoked { node }) if node == revoked.public()
        ));
        assert_eq!(ended[0].key, revoked.public());
        assert!(
            why(&ended[0].reason).contains("is revoked"),
            "{}",
            why(&ended[0].reason)
        );

        assert!(live.sweep(T + 9).is_empty(), "ended before the expiry");
        let ended = live.sweep(T + 10);
        assert_eq!(names(&ended), ["expiring"]);
        assert!(matches!(
            ended[0].reason,
            Refusal::Membership(MembershipError::Expired { .. })
        ));
        assert!(why(&ended[0].reason).contains("expired at"));
        assert!(live.sweep(T + 3599).is_empty());
        let left: HashSet<_> = live.entries.values().map(|e| e.handle).collect();
        assert_eq!(left, ["allowed", "staying"].into());
    }

    /// A connection admitted before its key was revoked, but put on the watch after the file
    /// changed, is judged at the next sweep all the same (the list moved since its handshake).
    #[test]
    fn a_connection_registered_after_a_change_is_judged_at_the_next_sweep() {
        let owner = key(85);
        let member = key(86);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("revoked");
        std::fs::write(&path, format!("{}\n", member.public())).expect("write");
        let admission = Admission::Swarm(Arc::new(SwarmAdmission {
            swarm: owner.public(),
            allow: HashSet::new(),
            allow_any: false,
            revoked: Some(Arc::new(RevokedList::load(&path).expect("loads"))),
        }));
        let mut live = Admitted::new(admission);
        assert!(live.sweep(T).is_empty());
        live.insert(member.public(), cert(&owner, &member, T + 3600), 1);
        assert_eq!(names(&live.sweep(T)), [1]);
        assert!(live.is_empty());
    }

    /// Without a swarm, a key taken out of `--allow-file` loses its connections at the next
    /// sweep, as it would be refused at its next handshake; the keys of `--allow` stay.
    #[test]
    fn a_key_removed_from_the_allow_file_loses_its_connections() {
        let (listed, given, other) = (key(87), key(88), key(89));
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("allowed");
        std::fs::write(&path, format!("{}\n{}\n", listed.public(), other.public())).expect("write");
        let admission = Admission::Listed {
            keys: [*given.public().as_bytes()].into(),
            file: Arc::new(RevokedList::load(&path).expect("loads")),
        };
        assert!(admission.can_change());
        let mut live = Admitted::new(admission);
        live.insert(listed.public(), None, "listed");
        live.insert(given.public(), None, "given");
        live.insert(other.public(), None, "other");
        assert!(live.sweep(T).is_empty());
        std::fs::write(&path, format!("# listed is out\n{}\n", other.public())).expect("write");
        let ended = live.sweep(T + 1);
        assert_eq!(names(&ended), ["listed"]);
        assert!(matches!(ended[0].reason, Refusal::NotAllowed));
        assert_eq!(live.len(), 2);
        // Policies whose verdicts cannot change are not watched at all.
        assert!(!Admission::Any.can_change());
        assert!(!Admission::Keys(HashSet::new()).can_change());
    }

    /// Issue 58 (5), in a real peer server on loopback: a member whose key is written into the
    /// server's `--revoked` file (beside a malformed line) while its connection is open loses
    /// that connection within 5 s, closed `FORBIDDEN` with the reason; a member whose
    /// certificate expires while connected loses it within 5 s of the expiry; a third member
    /// keeps its connection through both.
    #[test]
    fn live_connections_of_a_revoked_and_an_expired_member_close_within_5_s() {
        let rt = stormo_testing::runtime();
        let model = tempfile::tempdir().expect("tempdir");
        let holdings = Arc::new(crate::serve::tests::fixture_holdings(model.path()));
        let now = crate::identity::unix_now().expect("clock");
        let owner = key(90);
        let (server, revoked, expiring, staying) = (key(91), key(92), key(93), key(94));
        let issue = |node: &SecretKey, expires: u64| {
            Membership::issue(&owner, node.public(), now - 60, expires).expect("a valid period")
        };
        let path = model.path().join("revoked");
        std::fs::write(&path, "# nobody yet\n").expect("write");
        let admission = Admission::Swarm(Arc::new(SwarmAdmission {
            swarm: owner.public(),
            allow: HashSet::new(),
            allow_any: false,
            revoked: Some(Arc::new(RevokedList::load(&path).expect("loads"))),
        }));
        // Whole seconds: this certificate expires 3-4 s from now.
        let expiry = now + 4;
        let server_cert = issue(&server, now + 3600);
        rt.block_on(async {
            let cfg = crate::serve::ServeConfig {
                admission,
                ..crate::serve::ServeConfig::default()
            };
            let id = crate::tls::Identity {
                secret: &server,
                membership: Some(&server_cert),
            };
            let endpoint = crate::bind("127.0.0.1:0".parse().expect("addr"), None).expect("bind");
            let handle =
                crate::serve::start_on(endpoint, id, holdings, cfg).expect("the server starts");
            let at = handle.local_addr();
            let sk = server.public();
            let exp = Member::connect(at, &sk, &expiring, &issue(&expiring, expiry)).await;
            let rev = Member::connect(at, &sk, &revoked, &issue(&revoked, now + 3600)).await;
            let stay = Member::connect(at, &sk, &staying, &issue(&staying, now + 3600)).await;

            std::fs::write(
                &path,
                format!("{}0\n{}\n", staying.public(), revoked.public()),
            )
            .expect("revoke");
            let within = tokio::time::Instant::now() + Duration::from_secs(5);
            let (code, reason) = rev.closed_by(within).await.unwrap_or_else(|e| {
                panic!("the revoked member's connection, 5 s after the revocation: {e}")
            });
            assert_eq!(code, u64::from(NO_LONGER_ADMITTED.0));
            assert!(reason.contains("is revoked"), "{reason}");

            let secs_left = Duration::from_secs(expiry)
                .saturating_sub(std::time::UNIX_EPOCH.elapsed().expect("clock"));
            let within = tokio::time::Instant::now() + secs_left + Duration::from_secs(5);
            let (code, reason) = exp.closed_by(within).await.unwrap_or_else(|e| {
                panic!("the expired member's connection, 5 s after the expiry: {e}")
            });
            assert_eq!(code, u64::from(NO_LONGER_ADMITTED.0));
            assert!(reason.contains("expired at"), "{reason}");

            assert!(
                stay.close_reason().is_none(),
                "a member still admitted lost its connection: {:?}",
                stay.close_reason()
            );
            for m in [rev, exp, stay] {
                m.close();
            }
            handle.close();
        });
    }
}
