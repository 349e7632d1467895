//! Links to peers: connecting (QUIC handshake, hello both ways, the peer's inventory), one
//! dial at a time per peer as [`policy`] allows ([`link`]), the control stream that keeps a
//! peer's inventory current ([`Control`]), and liveness: when a connection last heard
//! anything ([`Liveness`]), which tells a silent peer (killed, stopped) from a slow one.
//!
//! A link found closed is a lost connection, redialled with back-off ([`policy::PeerView::lose`]);
//! whether to dial is the policy's decision ([`policy::PeerView::dial`]), not this module's.
//! A link that owes a datagram beyond what the peer's latency explains is probed: one dial at
//! a time in parallel ([`probe_due`]). A peer that answers it was restarted (its old
//! connection will never be heard again): the new connection replaces the silent one at once
//! ([`Link::replaced`]), instead of after [`policy::SILENT_CONNECTION`] and a redial. A hung
//! peer answers no probe either, which costs nothing: the link was being waited on anyway.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use stormo_manifests::Hash;
use stormo_wire::{
    expect_hello, Event, ExpertSet, Hello, Message, NodeId, Requests, RequestsConfig,
    MAX_FRAME_LEN, PROTOCOL_VERSION,
};
use tokio::sync::Semaphore;

use super::exec_client::EXEC_IN_FLIGHT;
use super::{Inner, Peer, PeerConfig};
use crate::load::LinkError;
use crate::policy;
use crate::{FramedRecv, PeerAddr};

/// A live connection to a peer, with what its fetches and calls share.
pub(crate) struct Link {
    pub(crate) conn: quinn::Connection,
    /// When `conn` last received a datagram.
    pub(crate) live: Liveness,
    /// The peer's request slots for this node (its hello's limit).
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) reqs: Mutex<LinkRequests>,
    /// The next request id of an `Exec` on this connection: from 2^63 up, apart from the ids
    /// `reqs` gives its fetches (from 0 up), so the two never meet.
    pub(crate) exec_ids: AtomicU64,
    /// The `Exec` calls in flight on this connection ([`EXEC_IN_FLIGHT`]).
    pub(crate) exec_slots: Semaphore,
    /// Set (before `conn` is closed) when a probe found the peer answering a new connection
    /// while this one stayed silent: the peer restarted, and the new link took this one's
    /// place. A try that fails on a replaced link is not the peer's failure: it is made again
    /// on the new link.
    pub(crate) replaced: Arc<AtomicBool>,
    /// On the watch that closes it once its server is no longer admitted (a swarm's
    /// revocation list, a certificate's expiry); off it when the link is dropped.
    _watched: Option<crate::tls::Watched>,
}

impl Link {
    /// Whether a probe's new connection replaced this one ([`Self::replaced`]).
    pub(crate) fn was_replaced(&self) -> bool {
        self.replaced.load(Ordering::SeqCst)
    }
}

/// What dialling a peer takes, from the tier: for [`link`] and the probes of [`Liveness::watch`].
#[derive(Clone)]
pub(crate) struct Dialer {
    endpoint: quinn::Endpoint,
    me: NodeId,
    model: Hash,
    cfg: PeerConfig,
    /// The swarm this node is a member of, if any.
    swarm: Option<stormo_manifests::PublicKey>,
    /// The watch over dialled connections ([`Inner::dialled`]).
    watch: Option<Arc<crate::tls::LiveMembers>>,
    /// This node serves the model ([`Inner::serving`]).
    serving: bool,
}

impl Dialer {
    fn of(inner: &Inner) -> Self {
        Self {
            endpoint: inner.endpoint.clone(),
            me: inner.me,
            model: inner.model,
            cfg: inner.cfg,
            swarm: inner.membership.as_ref().map(|m| m.swarm),
            watch: inner.dialled.clone(),
            serving: inner.serving.load(Ordering::SeqCst),
        }
    }

    /// Connects to `peer` within `timeout` ([`connect`]).
    async fn connect(
        &self,
        peer: &Peer,
        timeout: Duration,
    ) -> anyhow::Result<(quinn::Connection, Hello, Option<ExpertSet>, Control)> {
        connect(
            &self.endpoint,
            peer.client.clone(),
            &peer.addr,
            self.me,
            Some(self.model),
            self.serving,
            timeout,
        )
        .await
    }
}

/// The least time between the starts of two probe dials of one peer.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// The least time a probe dial is given: a restarted peer answers a handshake within a round
/// trip or two, and a probe that waits longer only delays the next one, whose first packet
/// may find the peer back (QUIC resends a handshake's first packet after a second, then two).
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Whether a link to a peer whose view is `view`, silent for `link_silent`, is due a probe
/// dial at `now`, the last probe having started at `last` (none is in flight): the peer is
/// usable and its link owes a datagram beyond [`policy::silence_limit`] (a request was sent
/// and nothing heard since: [`policy::PeerView::unanswered`]; a peer only slow to answer, or
/// an idle link, acknowledged what it was sent and is not probed), the link itself has heard
/// nothing for that limit, and the last probe started [`PROBE_INTERVAL`] ago or more.
pub(crate) fn probe_due(
    view: &policy::PeerView,
    link_silent: Duration,
    last: Option<Instant>,
    now: Instant,
) -> bool {
    let limit = policy::silence_limit(view.rtt);
    view.usable()
        && view.unanswered(now).is_some_and(|q| q >= limit)
        && link_silent >= limit
        && last.is_none_or(|t| now.saturating_duration_since(t) >= PROBE_INTERVAL)
}

/// How long a probe dial of a peer with round trip `rtt` is given: [`PROBE_TIMEOUT`] and four
/// round trips (a handshake, the hellos and the inventory), never more than a dial's
/// `connect_timeout`.
pub(crate) fn probe_timeout(rtt: Option<Duration>, connect_timeout: Duration) -> Duration {
    rtt.unwrap_or(policy::DEFAULT_RTT)
        .saturating_mul(4)
        .saturating_add(PROBE_TIMEOUT)
        .min(connect_timeout)
}

/// How often a connection's datagram count is sampled for [`Liveness`].
pub(crate) const LIVENESS_SAMPLE: Duration = Duration::from_millis(100);

/// When a connection last received a datagram (an answer's bytes, an acknowledgement of a
/// request or keep-alive), to within [`LIVENESS_SAMPLE`]: quinn counts datagrams but keeps no
/// time, so a task samples the count ([`Liveness::watch`]).
///
/// A try at a peer that heard from it only before it died must not read as "still sending":
/// a peer killed 0.1 s into a 5 s try sent bytes in that try, and its connection would be
/// kept for QUIC's idle timeout (10 s) and the load tried again on it.
pub(crate) struct Liveness {
    start: Instant,
    /// The datagram count the sampler saw last.
    seen: AtomicU64,
    /// Milliseconds from `start` to when the count last changed.
    last_ms: AtomicU64,
}

impl Liveness {
    pub(crate) fn new() -> Self {
        Self {
            start: Instant::now(),
            seen: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        }
    }

    /// How long the connection has received nothing, at `now`.
    pub(crate) fn silent_for(&self, now: Instant) -> Duration {
        let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        now.saturating_duration_since(last)
    }

    /// Whether `conn` (the connection watched) has been silent for
    /// [`policy::SILENT_CONNECTION`] at `now`.
    pub(crate) fn silent(&self, conn: &quinn::Connection, now: Instant) -> bool {
        self.silent_beyond(conn, now, policy::SILENT_CONNECTION)
    }

    /// Whether `conn` (the connection watched) has been silent for `limit` at `now`. A
    /// datagram the sampler has not seen yet (this node's runtime busy for a while) counts as
    /// heard: a busy node must not drop live peers.
    pub(crate) fn silent_beyond(
        &self,
        conn: &quinn::Connection,
        now: Instant,
        limit: Duration,
    ) -> bool {
        conn.stats().udp_rx.datagrams == self.seen.load(Ordering::Relaxed)
            && self.silent_for(now) >= limit
    }

    /// Samples `link`'s datagram count until the link is dropped or its connection closes,
    /// noting in `peer`'s view when it last heard ([`policy::PeerView::heard`], what a load's
    /// silence rule reads), and probing the peer with `dialer` while the link is silent
    /// ([`probe_due`], one probe at a time: [`probe`]). Must be called inside a tokio runtime.
    pub(crate) fn watch(link: &Arc<Link>, peer: &Arc<Peer>, dialer: Dialer) {
        let weak = Arc::downgrade(link);
        let peer = Arc::downgrade(peer);
        let mut seen = link.conn.stats().udp_rx.datagrams;
        link.live.seen.store(seen, Ordering::Relaxed);
        tokio::spawn(async move {
            let mut probing: Option<tokio::task::JoinHandle<()>> = None;
            let mut last_probe = None;
            loop {
                tokio::time::sleep(LIVENESS_SAMPLE).await;
                let Some(l) = weak.upgrade() else { return };
                if l.conn.close_reason().is_some() {
                    return;
                }
                let n = l.conn.stats().udp_rx.datagrams;
                let now = Instant::now();
                if n != seen {
                    seen = n;
                    let ms = now.saturating_duration_since(l.live.start).as_millis() as u64;
                    l.live.last_ms.store(ms, Ordering::Relaxed);
                    l.live.seen.store(n, Ordering::Relaxed);
                    if let Some(p) = peer.upgrade() {
                        p.state().heard = Some(now);
                    }
                }
                if probing.as_ref().is_some_and(|t| !t.is_finished()) {
                    continue;
                }
                probing = None;
                let Some(p) = peer.upgrade() else { return };
                let (due, rtt) = {
                    let s = p.state();
                    let due = probe_due(&s, l.live.silent_for(now), last_probe, now);
                    (due, s.rtt)
                };
                if due {
                    last_probe = Some(now);
                    let timeout = probe_timeout(rtt, dialer.cfg.connect_timeout);
                    probing = Some(tokio::spawn(probe(dialer.clone(), p, l, timeout)));
                }
            }
        });
    }
}

/// One probe dial of `peer`, whose link `old` is silent, within `timeout`. If the peer
/// answers, it was restarted (a live peer would have acknowledged on `old`): under the lock
/// on the peer's link, the new connection replaces `old` when that is still the peer's link
/// and still silent (or closed meanwhile), and `old` is marked replaced and closed. Otherwise
/// the new connection is closed. A probe that gets no answer changes nothing: no back-off.
async fn probe(dialer: Dialer, peer: Arc<Peer>, old: Arc<Link>, timeout: Duration) {
    let Ok((conn, hello, inv, control)) = dialer.connect(&peer, timeout).await else {
        return;
    };
    let mut g = peer.link.lock().await;
    let now = Instant::now();
    let (limit, owed) = {
        let s = peer.state();
        let limit = policy::silence_limit(s.rtt);
        (limit, s.unanswered(now).is_some_and(|q| q >= limit))
    };
    let current = g.as_ref().is_some_and(|c| Arc::ptr_eq(c, &old));
    // The peer answered a new connection, so it processes packets: had it been the same
    // process, it would have acknowledged what the old one owes by now.
    let silent = old.conn.close_reason().is_some()
        || (owed && old.live.silent_beyond(&old.conn, now, limit));
    if !(current && silent) {
        conn.close(0u32.into(), b"not needed");
        return;
    }
    tracing::info!(
        "peer {}: its connection heard nothing for {:.1}s and a new one was answered (it \
         restarted?); using the new one",
        peer.addr,
        old.live.silent_for(now).as_secs_f64()
    );
    old.replaced.store(true, Ordering::SeqCst);
    let new = install(&dialer, &peer, conn, &hello, inv, control);
    *g = Some(new);
    drop(g);
    old.conn.close(0u32.into(), b"replaced");
}

/// The outstanding requests of one connection (request ids are per connection), with the
/// events that arrived for each, picked up by the task that owns the request.
pub(crate) struct LinkRequests {
    pub(crate) req: Requests,
    pub(crate) events: std::collections::HashMap<stormo_wire::RequestId, Event>,
}

impl LinkRequests {
    pub(crate) fn new(cfg: RequestsConfig) -> Mutex<Self> {
        Mutex::new(Self {
            req: Requests::new(cfg),
            events: Default::default(),
        })
    }

    pub(crate) fn pump(&mut self) {
        while let Some(e) = self.req.poll_event() {
            let id = match &e {
                Event::Completed(c) => c.id,
                Event::Failed(f) => f.id,
            };
            self.events.insert(id, e);
        }
        // Cancels are carried by stream resets instead.
        while self.req.poll_transmit().is_some() {}
    }
}

pub(crate) fn lock(m: &Mutex<LinkRequests>) -> std::sync::MutexGuard<'_, LinkRequests> {
    m.lock().expect("link requests lock")
}

/// A QUIC client endpoint on an ephemeral port of the right address family.
pub(crate) fn client_endpoint(peers: &[PeerAddr]) -> anyhow::Result<quinn::Endpoint> {
    let v6 = peers.iter().any(|p| p.addr.is_ipv6());
    crate::bind(crate::unspecified(v6), None)
}

/// The control stream of a connection to a peer: kept open (the peer treats its end as a
/// goodbye) and read for the peer's later inventory updates and offers.
pub(crate) struct Control {
    send: quinn::SendStream,
    frames: FramedRecv,
}

impl Control {
    /// Keeps the stream open and reads it to its end, ignoring what comes.
    pub(crate) fn drain(mut self) {
        tokio::spawn(async move {
            let _send = self.send;
            while let Ok(Some(_)) = self.frames.next().await {}
        });
    }

    /// Reads the peer's control messages until the stream ends, applying its inventory
    /// updates and offers of `model` to `peer`'s state. The stream of a link that was
    /// `replaced` leaves the new link's control stream counted open.
    pub(crate) async fn follow(self, peer: Arc<Peer>, model: Hash, replaced: Arc<AtomicBool>) {
        let Self { send, mut frames } = self;
        let _send = send;
        peer.state().control_open = true;
        Self::follow_frames(&mut frames, &peer, model).await;
        if !replaced.load(Ordering::SeqCst) {
            peer.state().control_open = false;
        }
    }

    async fn follow_frames(frames: &mut FramedRecv, peer: &Arc<Peer>, model: Hash) {
        loop {
            match frames.next().await {
                Ok(Some(Message::Inventory(i))) if i.model == model => {
                    if i.experts.validate().is_ok() {
                        peer.state().inventory = Some(i.experts);
                    }
                }
                Ok(Some(Message::InventoryUpdate(u))) if u.model == model => {
                    let mut s = peer.state();
                    if let Some(inv) = s.inventory.as_mut() {
                        if let Err(e) = inv.apply(&u) {
                            tracing::warn!(
                                "peer {}: a bad inventory update ({e}); ignoring it",
                                peer.addr
                            );
                        } else {
                            tracing::debug!(
                                "peer {}: holds {} more, {} fewer experts",
                                peer.addr,
                                u.added.len(),
                                u.removed.len()
                            );
                        }
                    }
                }
                Ok(Some(Message::Offer(o))) if o.model == model => {
                    if o.experts.validate().is_ok() {
                        peer.state().offer = Some(o.experts);
                    }
                }
                Ok(Some(Message::Placement(p))) if p.model == model => {
                    peer.state().placement = Some(p);
                }
                Ok(Some(Message::Peers(p))) if p.model == model => {
                    peer.state().told = p.peers;
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return,
            }
        }
    }
}

/// Connects to `peer`: QUIC handshake, hello both ways (version and key checked) and the
/// peer's inventory of `model`, all within `timeout`.
pub(crate) async fn connect(
    endpoint: &quinn::Endpoint,
    client: quinn::ClientConfig,
    peer: &PeerAddr,
    me: NodeId,
    model: Option<Hash>,
    serving: bool,
    timeout: Duration,
) -> anyhow::Result<(quinn::Connection, Hello, Option<ExpertSet>, Control)> {
    let fut = async {
        let conn = endpoint
            .connect_with(client, peer.addr, "stormo")
            .context("starting the connection")?
            .await
            .context("QUIC handshake")?;
        let (mut send, recv) = conn.open_bi().await.context("opening the control stream")?;
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            node: me,
            // A node serving the model names it: the peer may dial it back at the address
            // this connection comes from. A fetching node serves nothing on this connection.
            models: model.filter(|_| serving).into_iter().collect(),
            // The protocol wants at least 1.
            limits: stormo_wire::Limits {
                max_concurrent_requests: 1,
            },
        });
        crate::write_message(&mut send, &hello).await?;
        let mut frames = FramedRecv::new(recv, MAX_FRAME_LEN);
        let first = frames
            .next()
            .await
            .context("reading the peer's hello")?
            .context("the peer closed the control stream before its hello")?;
        if let Message::Error(e) = &first {
            anyhow::bail!("the peer refused us: {} {}", e.code, e.message);
        }
        let theirs = expect_hello(first, &NodeId(*peer.key.as_bytes()))?;
        let mut inv = None;
        if let Some(model) = model {
            anyhow::ensure!(
                theirs.models.contains(&model),
                "the peer does not serve model {}",
                model.short()
            );
            loop {
                match frames.next().await.context("reading the inventory")? {
                    Some(Message::Inventory(i)) if i.model == model => {
                        i.experts.validate().context("the peer's inventory")?;
                        inv = Some(i.experts);
                        break;
                    }
                    Some(Message::Inventory(_) | Message::Pong(_)) => {}
                    Some(other) => {
                        anyhow::bail!("unexpected {} before the inventory", other.name())
                    }
                    None => anyhow::bail!("the control stream ended before the inventory"),
                }
            }
        }
        Ok((conn, theirs, inv, Control { send, frames }))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {:.1}s", timeout.as_secs_f64()))?
        .map_err(|e| {
            // Either side refusing the other's key ends the connection with this reason, in
            // the handshake or (TLS 1.3: the server checks the client last) at the first read.
            // A refusal is said in the user's terms alone; TLS's words for it ("error 49:
            // invalid peer certificate: ApplicationVerificationFailure") go to the debug log.
            let text = format!("{e:#}");
            // This side refused the peer: it proved another key than the one dialled.
            let presented =
                crate::tls::presented_key(&text).filter(|_| !text.contains("aborted by peer"));
            if let Some(presented) = presented {
                tracing::debug!("{text}");
                return anyhow::anyhow!(
                    "a key was refused: the peer at {} presented node key {presented}, not {} \
                     (the NODE given in NODE@ADDR)",
                    peer.addr,
                    peer.key
                );
            }
            let refused = text.contains("ApplicationVerificationFailure");
            let why = if !refused {
                return e;
            } else if text.contains("aborted by peer") {
                // The peer closed the connection over this node's certificate.
                "a key was refused: the peer does not admit this node's key (the peer admits \
                 keys on its --allow list, nodes with a certificate of a swarm it is in (--swarm \
                 and --cert here), or any key when it serves with --allow-any)"
            } else if text.contains("invalid peer certificate") {
                // This side refused the peer's certificate (the warning logged says why).
                "a key was refused: this node does not admit the peer (not a member of its \
                 swarm, or a certificate no longer valid: see the warning above)"
            } else {
                "a key was refused (the peer's must be the NODE given in NODE@ADDR, and this \
                 node's must be on the peer's --allow list, or carry a certificate of a swarm \
                 the peer is in (--swarm and --cert), unless the peer serves with --allow-any)"
            };
            tracing::debug!("{why}: {text}");
            anyhow::anyhow!(why)
        })
}

/// The live link to `peer`, connecting if there is none (or the last one closed) and the
/// policy allows a dial ([`policy::PeerView::dial`]). Attempts are one at a time (the lock on the
/// link is held while connecting): the calls that waited for a failed one find the policy
/// refusing to dial again until its back-off ends, and fail at once without connecting. A
/// link found closed is a lost connection ([`policy::PeerView::lose`]): the peer is redialled.
pub(crate) async fn link(inner: &Inner, peer: &Arc<Peer>) -> Result<Arc<Link>, LinkError> {
    let mut g = peer.link.clone().lock_owned().await;
    if let Some(l) = g.as_ref() {
        if l.conn.close_reason().is_none() {
            return Ok(l.clone());
        }
        // Closed by this node only for silence (the loss is noted then) or a protocol
        // violation (not a loss: no reconnection rounds for it).
        let lost = {
            let mut s = peer.state();
            s.up = false;
            connection_lost(&l.conn) && s.lose(Instant::now())
        };
        if lost {
            tracing::info!("peer {}: connection lost, reconnecting", peer.addr);
        }
        *g = None;
    }
    let dial = peer.state().dial(Instant::now());
    if let policy::Dial::Wait {
        why,
        left,
        coming_back,
    } = dial
    {
        return Err(LinkError::Wait {
            why,
            left,
            coming_back,
        });
    }
    // On a task of its own, holding the lock: the attempt runs to its end (and a failure is
    // marked) even when the try that started it is dropped, such as a race lost to the disk.
    let task = tokio::spawn(connect_link(Dialer::of(inner), peer.clone(), g));
    task.await.unwrap_or_else(|e| {
        Err(LinkError::Connect(format!(
            "the connecting task ended: {e}"
        )))
    })
}

/// Connects to `peer` for [`link`], which holds `g`, and stores the link there.
async fn connect_link(
    dialer: Dialer,
    peer: Arc<Peer>,
    mut g: tokio::sync::OwnedMutexGuard<Option<Arc<Link>>>,
) -> Result<Arc<Link>, LinkError> {
    let (conn, hello, inv, control) = match dialer.connect(&peer, dialer.cfg.connect_timeout).await
    {
        Ok(c) => c,
        Err(e) => {
            let why = format!("{e:#}");
            // Marked before the lock on the link is released, so that the calls waiting
            // for it see the policy's answer to this failure.
            let mut s = peer.state();
            let backoff = s.dial_failed(&why, Instant::now());
            let again = match s.coming_back(Instant::now()) {
                Some(t) => format!(
                    "reconnecting in {:.1}s",
                    t.saturating_duration_since(Instant::now()).as_secs_f64()
                ),
                None => format!("avoiding it for {:.1}s", backoff.as_secs_f64()),
            };
            tracing::warn!("peer {} failed to connect: {why}; {again}", peer.addr);
            return Err(LinkError::Connect(why));
        }
    };
    let l = install(&dialer, &peer, conn, &hello, inv, control);
    *g = Some(l.clone());
    Ok(l)
}

/// Sets up a link on a new connection to `peer` (a dial's or a probe's), for the caller to
/// store under the lock it holds on the peer's link: the link's request slots as the peer's
/// hello allows, the peer's view connected with its inventory and round trip, its control
/// stream followed and its liveness watched.
fn install(
    dialer: &Dialer,
    peer: &Arc<Peer>,
    conn: quinn::Connection,
    hello: &Hello,
    inv: Option<ExpertSet>,
    control: Control,
) -> Arc<Link> {
    let cfg = dialer.cfg;
    let slots = hello.limits.max_concurrent_requests.clamp(1, 64) as usize;
    let watched = dialer.watch.as_ref().and_then(|w| w.admit(&conn));
    let l = Arc::new(Link {
        conn,
        live: Liveness::new(),
        slots: Arc::new(Semaphore::new(slots)),
        reqs: LinkRequests::new(RequestsConfig {
            timeout: cfg.request_timeout,
            idle_timeout: cfg.idle_timeout,
            max_outstanding: 64,
        }),
        exec_ids: AtomicU64::new(1 << 63),
        exec_slots: Semaphore::new(EXEC_IN_FLIGHT),
        replaced: Arc::new(AtomicBool::new(false)),
        _watched: watched,
    });
    {
        let mut s = peer.state();
        s.inventory = inv;
        s.offer = None;
        s.rtt = Some(l.conn.rtt());
        s.member = member_of(dialer.swarm.as_ref(), &peer.addr.key, &l.conn);
        s.connected(Instant::now());
    }
    tokio::spawn(control.follow(peer.clone(), dialer.model, l.replaced.clone()));
    Liveness::watch(&l, peer, dialer.clone());
    l
}

/// Whether the peer that proved `key` on `conn` is a member of `swarm` (this node's, if any):
/// its certificate carries a membership of that swarm, signed, for its key, valid now.
fn member_of(
    swarm: Option<&stormo_manifests::PublicKey>,
    key: &stormo_manifests::PublicKey,
    conn: &quinn::Connection,
) -> bool {
    let (Some(swarm), Some(m)) = (swarm, crate::tls::peer_membership(conn)) else {
        return false;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    m.verify(swarm, key, now, &Default::default()).is_ok()
}

/// Whether `conn` was lost: closed by the peer or the network (a reset, an idle timeout),
/// not by this node (for a protocol violation, a removal or shutdown).
pub(crate) fn connection_lost(conn: &quinn::Connection) -> bool {
    conn.close_reason()
        .is_some_and(|e| !matches!(e, quinn::ConnectionError::LocallyClosed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer measured at 1 ms whose connection was sent a request at `t0` and heard nothing
    /// since: its silence limit is 0.754 s.
    fn owing(t0: Instant) -> policy::PeerView {
        let mut v = policy::PeerView::default();
        v.rtt = Some(Duration::from_millis(1));
        v.connected(t0 - Duration::from_secs(1));
        v.request_sent(t0);
        v
    }

    #[test]
    fn a_link_owing_a_datagram_beyond_its_silence_limit_is_probed() {
        let t0 = Instant::now();
        let v = owing(t0);
        let limit = policy::silence_limit(v.rtt);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(!probe_due(&v, limit, None, at(700)), "not suspect yet");
        assert!(probe_due(&v, limit, None, at(760)));
        assert!(
            !probe_due(&v, limit - Duration::from_millis(1), None, at(760)),
            "the link itself heard something lately"
        );
    }

    #[test]
    fn probes_of_a_silent_link_are_paced() {
        let t0 = Instant::now();
        let v = owing(t0);
        let limit = policy::silence_limit(v.rtt);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(!probe_due(&v, limit, Some(at(800)), at(1000)));
        assert!(probe_due(&v, limit, Some(at(800)), at(1050)));
    }

    #[test]
    fn a_link_that_heard_an_answer_or_a_dropped_peer_is_not_probed() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut v = owing(t0);
        let limit = policy::silence_limit(v.rtt);
        v.heard = Some(at(10));
        assert!(!probe_due(&v, limit, None, at(2000)), "nothing owed");
        let mut v = owing(t0);
        v.ban("bad bytes");
        assert!(!probe_due(&v, limit, None, at(2000)), "not usable");
        let v = policy::PeerView::default();
        assert!(
            !probe_due(&v, limit, None, at(2000)),
            "never asked anything"
        );
        // A request found waiting (a slow read at the peer) that was acknowledged: the peer is
        // suspect to the loads, but alive; no probe.
        let mut v = owing(t0);
        v.heard = Some(at(1));
        v.suspect_silent(at(800));
        assert!(v.suspect(at(2000)));
        assert!(!probe_due(&v, limit, None, at(2000)), "only slow");
    }

    #[test]
    fn a_probe_waits_a_few_round_trips_and_never_past_a_dial() {
        let connect = Duration::from_secs(3);
        let ms = Duration::from_millis;
        assert_eq!(probe_timeout(Some(ms(1)), connect), ms(504));
        assert_eq!(probe_timeout(None, connect), ms(900));
        assert_eq!(probe_timeout(Some(ms(2000)), connect), connect);
        assert_eq!(probe_timeout(Some(Duration::MAX), connect), connect);
    }
}
