//! Links to peers: connecting (QUIC handshake, hello both ways, the peer's inventory), one
//! dial at a time per peer as [`policy`] allows ([`link`]), the control stream that keeps a
//! peer's inventory current ([`Control`]), and liveness: when a connection last heard
//! anything ([`Liveness`]), which tells a silent peer (killed, stopped) from a slow one.
//!
//! A link found closed is a lost connection, redialled with back-off ([`policy::PeerView::lose`]);
//! whether to dial is the policy's decision ([`policy::PeerView::dial`]), not this module's.

use std::sync::atomic::{AtomicU64, Ordering};
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
    /// silence rule reads). Must be called inside a tokio runtime.
    pub(crate) fn watch(link: &Arc<Link>, peer: &Arc<Peer>) {
        let weak = Arc::downgrade(link);
        let peer = Arc::downgrade(peer);
        let mut seen = link.conn.stats().udp_rx.datagrams;
        link.live.seen.store(seen, Ordering::Relaxed);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(LIVENESS_SAMPLE).await;
                let Some(l) = weak.upgrade() else { return };
                if l.conn.close_reason().is_some() {
                    return;
                }
                let n = l.conn.stats().udp_rx.datagrams;
                if n != seen {
                    seen = n;
                    let now = Instant::now();
                    let ms = now.saturating_duration_since(l.live.start).as_millis() as u64;
                    l.live.last_ms.store(ms, Ordering::Relaxed);
                    l.live.seen.store(n, Ordering::Relaxed);
                    if let Some(p) = peer.upgrade() {
                        p.state().heard = Some(now);
                    }
                }
            }
        });
    }
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
    /// updates and offers of `model` to `peer`'s state.
    pub(crate) async fn follow(self, peer: Arc<Peer>, model: Hash) {
        let Self { send, mut frames } = self;
        let _send = send;
        peer.state().control_open = true;
        Self::follow_frames(&mut frames, &peer, model).await;
        peer.state().control_open = false;
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
            models: Vec::new(),
            // A fetching node serves nothing on this connection; the protocol wants at least 1.
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
            let refused = text.contains("ApplicationVerificationFailure");
            let why = if !refused {
                return e;
            } else if text.contains("aborted by peer") {
                // The peer closed the connection over this node's certificate.
                "a key was refused: the peer does not admit this node's key (the peer admits \
                 keys on its --allow list, nodes with a certificate of a swarm it is in (--swarm \
                 and --cert here), or any key when it serves with --allow-any)"
            } else if text.contains("invalid peer certificate") {
                // This side refused the peer's certificate: its key is another node's.
                "a key was refused: the peer's key is not the NODE given in NODE@ADDR"
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
    let task = tokio::spawn(connect_link(
        inner.endpoint.clone(),
        inner.me,
        inner.model,
        inner.cfg,
        peer.clone(),
        g,
    ));
    task.await.unwrap_or_else(|e| {
        Err(LinkError::Connect(format!(
            "the connecting task ended: {e}"
        )))
    })
}

/// Connects to `peer` for [`link`], which holds `g`, and stores the link there.
async fn connect_link(
    endpoint: quinn::Endpoint,
    me: NodeId,
    model: Hash,
    cfg: PeerConfig,
    peer: Arc<Peer>,
    mut g: tokio::sync::OwnedMutexGuard<Option<Arc<Link>>>,
) -> Result<Arc<Link>, LinkError> {
    let (conn, hello, inv, control) = match connect(
        &endpoint,
        peer.client.clone(),
        &peer.addr,
        me,
        Some(model),
        cfg.connect_timeout,
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            let why = format!("{e:#}");
            // Marked before the lock on the link is released, so that the calls waiting for
            // it see the policy's answer to this failure.
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
    let slots = hello.limits.max_concurrent_requests.clamp(1, 64) as usize;
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
    });
    {
        let mut s = peer.state();
        s.inventory = inv;
        s.offer = None;
        s.rtt = Some(l.conn.rtt());
        s.connected(Instant::now());
    }
    tokio::spawn(control.follow(peer.clone(), model));
    Liveness::watch(&l, &peer);
    *g = Some(l.clone());
    Ok(l)
}

/// Whether `conn` was lost: closed by the peer or the network (a reset, an idle timeout),
/// not by this node (for a protocol violation, a removal or shutdown).
pub(crate) fn connection_lost(conn: &quinn::Connection) -> bool {
    conn.close_reason()
        .is_some_and(|e| !matches!(e, quinn::ConnectionError::LocallyClosed))
}
