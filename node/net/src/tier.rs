//! The network tier: a [`Tier`] named "peer" that fetches experts from a set of peers.
//!
//! For each requested expert it picks a peer whose inventory holds it (fewest requests in
//! flight, then the shortest expected time from measured round trip and throughput), streams
//! the record on its own QUIC stream through a [`Requests`] straight into the buffer the kernels
//! will read (huge pages, allocated once per load: the payload bytes are copied once, from
//! the chunks quinn received), and checks every chunk against the manifest as it arrives, in
//! that buffer. On any failure (a bad chunk,
//! a timeout or silence, a lost connection, a peer that does not hold what it advertised, another
//! protocol version) it logs a warning naming the peer, puts the peer on a growing back-off,
//! and goes on with another peer, resuming after the verified prefix; only when no peer can
//! supply the expert does it complete with an error, so the tiers above fall back. A try that
//! runs out of time (or hears nothing of its own answer) while the peer is still sending on
//! the connection, or a `busy` answer, is load rather than a fault: the peer is not put on a
//! back-off. A try is cut off at its deadline only while another holder is left to try;
//! otherwise it runs on while its chunks keep verifying. When every holder has been tried
//! another round starts with a longer deadline (big experts over a link that many loads
//! share); the rounds end after a few that verify nothing more and meet no `busy` answer.
//!
//! An expert that several peers hold, long enough to be worth it ([`policy::stripes`]), is
//! striped: its buffer is split into chunk-aligned parts, one per holder, each fetched at once
//! by its own task with the same tries and rounds as a whole record (starting at its holder,
//! going on to the others after a failure, resuming after its verified chunks), into its part
//! of the buffer; the parts join back into the record without a copy once each verified. A
//! stripe whose try falls far behind a finished one ([`policy::far_behind`]) is made to give
//! up, and its rest goes to an idle holder ([`policy::idle_holder_left`]). Striped loads are
//! not hedged.
//! Keys are fetched in parallel, each on its own task. Prefetch loads are sent with the
//! `Prefetch` priority. Every wait is bounded: the connect (handshake plus hello), each try's
//! deadline (from when its request is sent; moved on only by verified chunks, never past the
//! load's budget of 32 first deadlines), the silence between two pieces of an answer, and the
//! rounds (no later try starts past that budget).
//!
//! A peer that cannot be connected to is unreachable for its back-off: one connection attempt
//! at a time (concurrent loads wait for it rather than each connecting), and until the
//! back-off ends every try at it fails at once, naming the peer and why, without connecting
//! again (after its very first failed attempt, one more is made that loads with no other
//! source wait for: a peer starting, or slow on a busy machine). A peer whose connection was up
//! and was lost (closed, reset, or silent for the
//! silence deadline: killed, stopped or restarting) is redialled with back-off a bounded
//! number of times, and loads that have no other source wait for it in rounds like slow
//! peers, so a holder that comes back is used again; one that does not ends them with an
//! error naming it. Whether to dial, and whether another round is worth it, are
//! [`policy`]'s decisions ([`PeerView::dial`], [`Rounds::after`]); this module only dials and
//! reports what happened. Failed tries that another peer made up for are counted through
//! [`Tier::retried_failures`], so the statistics show them as failures and fallbacks.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use stormo_engine::huge::{HugeBuf, HugePart};
use stormo_engine::moe::{ExpertData, ExpertSchema};
use stormo_engine::tiers::{Completion, ExpertId, Priority, Tier};
use stormo_manifests::{Hash, Manifest, PublicKey, SecretKey};
use stormo_wire::{
    expect_hello, ByteRange, ChunkVerifier, Completed, Event, ExpertSet, Fetch, FetchError, Hello,
    Message, NodeId, RecordBuffer, Requests, RequestsConfig, MAX_FRAME_LEN, MAX_MANIFEST_LEN,
    PROTOCOL_VERSION,
};
use tokio::sync::Semaphore;

use super::exec::ExecError;
use super::policy::{self, LoadClock, PeerView, Rounds, StripeState};
use super::{tls, FramedRecv, PeerAddr, ReadError};

/// One peer as [`PeerTier::swarm_view`] sees it.
#[derive(Clone, Debug)]
pub struct PeerSnapshot {
    /// Its key and address.
    pub addr: PeerAddr,
    /// The experts it holds (`None`: not heard yet).
    pub inventory: Option<ExpertSet>,
    /// Its last placement announcement.
    pub placement: Option<stormo_wire::Placement>,
    /// Its connection is up and its control stream open.
    pub connected: bool,
}

/// Timeouts of the network tier.
#[derive(Clone, Copy, Debug)]
pub struct PeerConfig {
    /// The longest a connection (QUIC handshake, hello and inventory) may take.
    pub connect_timeout: Duration,
    /// The deadline of one try at one peer for one expert, from when the request is sent
    /// (waiting for a connection or a request slot is not counted). Doubled for each later
    /// round over the holders (up to 8 times), and moved on while chunks verify when no other
    /// holder is left to try (see `fetch_from_peers`).
    pub request_timeout: Duration,
    /// The longest wait for the first frame of an answer or between two frames.
    pub idle_timeout: Duration,
    /// The shortest delay before a demand request is hedged (raced by a second request).
    pub hedge_min: Duration,
    /// The longest delay before a demand request is hedged.
    pub hedge_max: Duration,
    /// The smallest stripe of a record fetched from several holders at once: a record shorter
    /// than two of them comes whole from one peer ([`policy::MIN_STRIPE`] by default;
    /// `u64::MAX` never stripes).
    pub stripe_min: u64,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            connect_timeout: super::CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(5),
            hedge_min: Duration::from_millis(20),
            hedge_max: Duration::from_secs(2),
            stripe_min: policy::MIN_STRIPE,
        }
    }
}

impl PeerConfig {
    /// The timeouts of `--peer-timeout SECS`: every request to a peer answered within
    /// `timeout` of being sent (longer in later rounds while peers are still sending), a
    /// connection attempt within [`super::CONNECT_TIMEOUT`] or `timeout`, the shorter, and the
    /// gap between frames within 5 s or `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            connect_timeout: super::CONNECT_TIMEOUT.min(timeout),
            request_timeout: timeout,
            idle_timeout: timeout.min(Duration::from_secs(5)),
            ..Self::default()
        }
    }
}

/// Counters of the network tier's races.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HedgeStats {
    /// Demand requests raced by a second request (to another peer or the local disk).
    pub hedges: u64,
    /// Races won by the second request.
    pub hedge_wins: u64,
    /// Races won by the local disk.
    pub local_wins: u64,
}

struct Link {
    conn: quinn::Connection,
    /// When `conn` last received a datagram.
    live: Liveness,
    slots: Arc<Semaphore>,
    reqs: Mutex<LinkRequests>,
    /// The next request id of an `Exec` on this connection: from 2^63 up, apart from the ids
    /// `reqs` gives its fetches (from 0 up), so the two never meet.
    exec_ids: AtomicU64,
    /// The `Exec` calls in flight on this connection ([`EXEC_IN_FLIGHT`]).
    exec_slots: Semaphore,
}

/// How long a connection may receive nothing at all, with requests waiting on it, before its
/// peer is presumed gone (killed, stopped, its host down): longer than the keep-alive
/// interval, since a live peer acknowledges a keep-alive within a round trip.
const SILENT_CONNECTION: Duration = Duration::from_secs(4);
/// How often a connection's datagram count is sampled for [`Liveness`].
const LIVENESS_SAMPLE: Duration = Duration::from_millis(100);

/// When a connection last received a datagram (an answer's bytes, an acknowledgement of a
/// request or keep-alive), to within [`LIVENESS_SAMPLE`]: quinn counts datagrams but keeps no
/// time, so a task samples the count ([`Liveness::watch`]).
///
/// A try at a peer that heard from it only before it died must not read as "still sending":
/// a peer killed 0.1 s into a 5 s try sent bytes in that try, and its connection would be
/// kept for QUIC's idle timeout (10 s) and the load tried again on it.
struct Liveness {
    start: Instant,
    /// The datagram count the sampler saw last.
    seen: AtomicU64,
    /// Milliseconds from `start` to when the count last changed.
    last_ms: AtomicU64,
}

impl Liveness {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            seen: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        }
    }

    /// How long the connection has received nothing, at `now`.
    fn silent_for(&self, now: Instant) -> Duration {
        let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        now.saturating_duration_since(last)
    }

    /// Whether `conn` (the connection watched) has been silent for [`SILENT_CONNECTION`] at
    /// `now`. A datagram the sampler has not seen yet (this node's runtime busy for a while)
    /// counts as heard: a busy node must not drop live peers.
    fn silent(&self, conn: &quinn::Connection, now: Instant) -> bool {
        conn.stats().udp_rx.datagrams == self.seen.load(Ordering::Relaxed)
            && self.silent_for(now) >= SILENT_CONNECTION
    }

    /// Samples `link`'s datagram count until the link is dropped or its connection closes.
    /// Must be called inside a tokio runtime.
    fn watch(link: &Arc<Link>) {
        let weak = Arc::downgrade(link);
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
                    let ms = l.live.start.elapsed().as_millis() as u64;
                    l.live.last_ms.store(ms, Ordering::Relaxed);
                    l.live.seen.store(n, Ordering::Relaxed);
                }
            }
        });
    }
}

/// The outstanding requests of one connection (request ids are per connection), with the
/// events that arrived for each, picked up by the task that owns the request.
struct LinkRequests {
    req: Requests,
    events: std::collections::HashMap<stormo_wire::RequestId, Event>,
}

impl LinkRequests {
    fn new(cfg: RequestsConfig) -> Mutex<Self> {
        Mutex::new(Self {
            req: Requests::new(cfg),
            events: Default::default(),
        })
    }

    fn pump(&mut self) {
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

fn lock(m: &Mutex<LinkRequests>) -> std::sync::MutexGuard<'_, LinkRequests> {
    m.lock().expect("link requests lock")
}

/// One request counted in flight at a peer, uncounted when dropped (also when a race is lost
/// and its future dropped).
struct InFlight(Arc<Peer>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.0.state();
        s.in_flight = s.in_flight.saturating_sub(1);
    }
}

/// How long one try may take: `timeout` from when its request is sent, moved on while its
/// chunks keep verifying up to `extend_until` when that is set (see
/// [`Fetch::extend_on_progress`]).
#[derive(Clone, Copy, Debug)]
struct TryLimit {
    timeout: Duration,
    extend_until: Option<Instant>,
}

/// What the tries of one expert load share.
#[derive(Default)]
struct Tries {
    /// Failed tries.
    failed: AtomicU64,
    /// Set when a try ran out of time while its peer was still sending, or the peer answered
    /// busy: worth another round.
    retry: std::sync::atomic::AtomicBool,
    /// Set when a peer answered busy.
    busy: std::sync::atomic::AtomicBool,
}

/// How one try at one peer ended: its span verified whole, or why not (naming the peer) and
/// the verified prefix it left.
type TryResult = Result<Prefix, (String, Prefix)>;

/// A record's buffer (huge pages, the record's length) as the wire writes into it.
#[derive(Debug)]
struct RecordBuf(HugeBuf);

impl RecordBuffer for RecordBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// One stripe's part of a record's buffer (see [`HugeBuf::split`]), as the wire writes into
/// it: byte `i` is byte `offset + i` of the record.
#[derive(Debug)]
struct StripeBuf {
    part: HugePart,
    offset: u64,
}

impl RecordBuffer for StripeBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.part
    }
    fn offset(&self) -> u64 {
        self.offset
    }
}

/// What the tries of one load have verified of a span of a record (the whole record, or one
/// stripe): bytes `start..verified`, in `buffer` (none before the first try at a whole record
/// allocates it, or after a try lost it).
#[derive(Debug, Default)]
struct Prefix {
    buffer: Option<Box<dyn RecordBuffer>>,
    /// The span: bytes `start..end` of the record.
    start: u64,
    end: u64,
    /// The end of the verified bytes, from `start`.
    verified: u64,
}

impl Prefix {
    /// The whole record of `len` bytes, nothing verified or allocated yet.
    fn whole(len: u64) -> Self {
        Self {
            end: len,
            ..Self::default()
        }
    }

    /// Takes the verified prefix and its buffer, leaving the same span with neither.
    fn take(&mut self) -> Self {
        let (start, end) = (self.start, self.end);
        std::mem::replace(
            self,
            Self {
                start,
                end,
                verified: start,
                buffer: None,
            },
        )
    }

    /// Bytes of the span verified.
    fn len(&self) -> usize {
        self.verified.saturating_sub(self.start) as usize
    }

    /// What a request hands back: `buffer` with its bytes up to `verified_end` verified
    /// (without a buffer, nothing is).
    fn keep(&mut self, buffer: Option<Box<dyn RecordBuffer>>, verified_end: u64) {
        self.verified = if buffer.is_some() {
            verified_end
        } else {
            self.start
        };
        self.buffer = buffer;
    }

    /// A copy in a buffer of its own (for a second try racing the one that holds this; a
    /// whole record's only).
    fn copy(&mut self, len: u64) -> Result<Self, String> {
        let mut buf = HugeBuf::recycled(len as usize).map_err(|e| e.to_string())?;
        let n = self.len();
        if let Some(b) = self.buffer.as_mut() {
            buf[..n].copy_from_slice(&b.bytes_mut()[..n]);
        }
        Ok(Self {
            verified: if self.buffer.is_some() {
                self.verified
            } else {
                0
            },
            buffer: Some(Box::new(RecordBuf(buf))),
            start: 0,
            end: len,
        })
    }

    /// The whole record's buffer, once verified.
    fn into_record(self) -> HugeBuf {
        let b: Box<dyn std::any::Any> = self.buffer.expect("a verified span has its buffer");
        b.downcast::<RecordBuf>()
            .expect("a whole record's buffer is a RecordBuf")
            .0
    }

    /// A stripe's part of the record's buffer, once verified.
    fn into_part(self) -> HugePart {
        let b: Box<dyn std::any::Any> = self.buffer.expect("a verified span has its buffer");
        b.downcast::<StripeBuf>()
            .expect("a stripe's buffer is a StripeBuf")
            .part
    }
}

/// How the driver of a striped load follows one stripe, and moves it: the stripe's tries
/// report their progress here, and give up when told to (their verified prefix stays, and
/// the stripe's next try, at another holder, resumes after it).
#[derive(Debug)]
struct StripeCtl {
    /// Bumped to make the running try give up (its remainder moves to another holder).
    moves: tokio::sync::watch::Sender<u64>,
    /// The running try: when it began, the end of the stripe's verified bytes then, and its
    /// peer.
    run: Mutex<Option<(Instant, u64, usize)>>,
    /// The end of the stripe's verified bytes now (in the record).
    verified: AtomicU64,
    /// The count of `moves` when the running try began: a try that finds it changed when it
    /// starts its request was moved before it could hear of it.
    moves_at_begin: AtomicU64,
    start: u64,
    end: u64,
}

impl StripeCtl {
    fn new(start: u64, end: u64) -> Self {
        Self {
            moves: tokio::sync::watch::Sender::new(0),
            run: Mutex::new(None),
            verified: AtomicU64::new(start),
            moves_at_begin: AtomicU64::new(0),
            start,
            end,
        }
    }

    fn run(&self) -> std::sync::MutexGuard<'_, Option<(Instant, u64, usize)>> {
        self.run.lock().expect("stripe lock")
    }

    /// A try at peer `peer` begins, with the stripe verified up to `verified`.
    fn begin(&self, verified: u64, peer: usize) {
        self.moves_at_begin
            .store(*self.moves.borrow(), Ordering::SeqCst);
        self.verified.store(verified, Ordering::Relaxed);
        *self.run() = Some((Instant::now(), verified, peer));
    }

    /// The try ended.
    fn end_try(&self) {
        *self.run() = None;
    }

    /// What [`policy::far_behind`] needs to know of it, while it is not done; `elsewhere`
    /// says whether a holder other than peer `i` could take it over.
    fn state(&self, elsewhere: impl Fn(usize) -> bool) -> StripeState {
        match *self.run() {
            Some((since, at_start, peer)) => StripeState::Running {
                since,
                verified_at_start: at_start - self.start,
                verified: self.verified.load(Ordering::Relaxed) - self.start,
                len: self.end - self.start,
                elsewhere: elsewhere(peer),
            },
            None => StripeState::Waiting,
        }
    }

    /// The rate of the try that finished it (bytes per second), at `now`.
    fn final_rate(&self, now: Instant) -> f64 {
        match *self.run() {
            Some((since, at_start, _)) => {
                (self.end - at_start) as f64 / now.duration_since(since).as_secs_f64().max(1e-6)
            }
            None => 0.0,
        }
    }

    /// Makes the running try give up, so that its remainder moves.
    fn move_on(&self) {
        self.moves.send_modify(|n| *n += 1);
    }
}

/// What loading a span ended with: the span verified, or (a whole record raced against the
/// local disk) the disk's expert.
enum Got {
    Span(Prefix),
    Local(Arc<ExpertData>),
}

struct Peer {
    addr: PeerAddr,
    client: quinn::ClientConfig,
    link: Arc<tokio::sync::Mutex<Option<Arc<Link>>>>,
    state: Mutex<PeerView>,
}

impl Peer {
    fn state(&self) -> std::sync::MutexGuard<'_, PeerView> {
        self.state.lock().expect("peer state lock")
    }

    /// Notes a failure: warns naming the peer, and avoids it for a while.
    fn mark(&self, what: &str, err: &dyn fmt::Display) {
        let backoff = self.state().fail(Instant::now());
        tracing::warn!(
            "peer {} failed {what}: {err}; avoiding it for {:.1}s",
            self.addr,
            backoff.as_secs_f64()
        );
    }

    /// Drops the peer for the session: it sent bytes that failed verification. Named once.
    fn ban(&self, what: &str, err: &dyn fmt::Display) {
        let why = format!("{what}: {err}");
        if self.state().ban(&why) {
            tracing::warn!(
                "peer {} sent bytes that failed verification ({why}); not asking it again \
                 this session",
                self.addr
            );
        }
    }
}

struct Inner {
    cfg: PeerConfig,
    me: NodeId,
    endpoint: quinn::Endpoint,
    model: Hash,
    manifest: Arc<Manifest>,
    schemas: Vec<Option<ExpertSchema>>,
    /// Every peer ever added, in the order added (indices stay valid: a removed peer is only
    /// marked), replaced whole when one is added.
    peers: Mutex<Arc<Vec<Arc<Peer>>>>,
    /// This node's key, for the TLS client configuration of peers added later.
    secret: SecretKey,
    /// This node's swarm membership certificate, presented to every peer it dials.
    membership: Option<stormo_manifests::Membership>,
    /// Which servers it accepts besides the key pinned per peer (a swarm's members).
    servers: tls::Admission,
    /// Held while choosing a peer and counting the request in flight, so that concurrent
    /// loads spread over the peers.
    choosing: Mutex<()>,
    /// Set by [`PeerTier::close`]: failures after it are the shutdown, not the peers'.
    closing: std::sync::atomic::AtomicBool,
    /// A local tier (the disk) that a slow demand request is raced against when no other
    /// peer holds the expert.
    local: std::sync::OnceLock<Arc<dyn Tier>>,
    /// Where verified experts are also written (`--expert-dir`).
    store: std::sync::OnceLock<Arc<super::expert_dir::ExpertDir>>,
    hedges: Mutex<HedgeStats>,
    /// Failed tries at peers that were followed by a try elsewhere ([`Tier::retried_failures`]).
    retried: AtomicU64,
    /// Loads striped across several holders that ended with the record.
    striped: AtomicU64,
}

/// The network tier. See the module docs.
pub struct PeerTier {
    inner: Arc<Inner>,
    rt: tokio::runtime::Handle,
    _own: Option<OwnedRuntime>,
}

/// A runtime shut down without waiting when the tier goes (possibly on one of its own threads,
/// where a blocking drop would panic).
struct OwnedRuntime(Option<Arc<tokio::runtime::Runtime>>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take().and_then(|a| Arc::try_unwrap(a).ok()) {
            rt.shutdown_background();
        }
    }
}

impl fmt::Debug for PeerTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peers: Vec<String> = self
            .inner
            .peers()
            .iter()
            .map(|p| p.addr.to_string())
            .collect();
        f.debug_struct("PeerTier")
            .field("model", &self.inner.model.short())
            .field("peers", &peers)
            .finish()
    }
}

/// A verifier of one expert's chunks against the manifest.
struct ChunkCheck {
    manifest: Arc<Manifest>,
    id: ExpertId,
    len: u64,
}

impl ChunkVerifier for ChunkCheck {
    fn chunk_len(&self) -> u64 {
        u64::from(self.manifest.chunk_size)
    }
    fn resource_len(&self) -> u64 {
        self.len
    }
    fn verify_chunk(
        &mut self,
        index: u64,
        bytes: &[u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let index = u32::try_from(index).map_err(|_| "chunk index out of range")?;
        self.manifest
            .verify_chunk(self.id, index, bytes)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    }
}

/// A QUIC client endpoint on an ephemeral port of the right address family.
fn client_endpoint(peers: &[PeerAddr]) -> anyhow::Result<quinn::Endpoint> {
    let v6 = peers.iter().any(|p| p.addr.is_ipv6());
    super::bind(super::unspecified(v6), None)
}

/// The control stream of a connection to a peer: kept open (the peer treats its end as a
/// goodbye) and read for the peer's later inventory updates and offers.
struct Control {
    send: quinn::SendStream,
    frames: FramedRecv,
}

impl Control {
    /// Keeps the stream open and reads it to its end, ignoring what comes.
    fn drain(mut self) {
        tokio::spawn(async move {
            let _send = self.send;
            while let Ok(Some(_)) = self.frames.next().await {}
        });
    }

    /// Reads the peer's control messages until the stream ends, applying its inventory
    /// updates and offers of `model` to `peer`'s state.
    async fn follow(self, peer: Arc<Peer>, model: Hash) {
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
async fn connect(
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
        super::write_message(&mut send, &hello).await?;
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

impl PeerTier {
    /// Connects to `peers` (in parallel, each bounded by the connect timeout) as `secret`, for
    /// the model of `manifest` whose experts have `schemas` (`files.layout.schemas`). Peers
    /// that cannot be reached are warned about and retried later. Runs on `rt` if given, else
    /// on a runtime of its own, and dials from an endpoint of its own (a node that also serves
    /// uses [`PeerTier::new`] with its one endpoint).
    pub fn connect(
        secret: &SecretKey,
        peers: &[PeerAddr],
        manifest: Arc<Manifest>,
        model: Hash,
        schemas: Vec<Option<ExpertSchema>>,
        cfg: PeerConfig,
        rt: Option<tokio::runtime::Handle>,
    ) -> anyhow::Result<Self> {
        let (rt, own) = match rt {
            Some(h) => (h, None),
            None => {
                let r = Arc::new(
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .thread_name("stormo-net")
                        .enable_all()
                        .build()
                        .context("starting the network runtime")?,
                );
                (r.handle().clone(), Some(r))
            }
        };
        let endpoint = {
            let _g = rt.enter();
            client_endpoint(peers)?
        };
        let mut t = Self::new(endpoint, rt, secret, manifest, model, schemas, cfg);
        t._own = own.map(|r| OwnedRuntime(Some(r)));
        t.add_peers(peers)?;
        Ok(t)
    }

    /// A network tier with no peers yet, dialing from `endpoint` (which may also serve) on
    /// `rt`. Peers join with [`PeerTier::add_peers`] and leave with [`PeerTier::remove_peer`].
    pub fn new(
        endpoint: quinn::Endpoint,
        rt: tokio::runtime::Handle,
        secret: &SecretKey,
        manifest: Arc<Manifest>,
        model: Hash,
        schemas: Vec<Option<ExpertSchema>>,
        cfg: PeerConfig,
    ) -> Self {
        let inner = Arc::new(Inner {
            cfg,
            me: NodeId(*secret.public().as_bytes()),
            endpoint,
            model,
            manifest,
            schemas,
            peers: Mutex::new(Arc::new(Vec::new())),
            secret: SecretKey::from_seed(&secret.seed()),
            membership: None,
            servers: tls::Admission::Any,
            choosing: Mutex::new(()),
            closing: Default::default(),
            local: Default::default(),
            store: Default::default(),
            hedges: Default::default(),
            retried: Default::default(),
            striped: Default::default(),
        });
        Self {
            inner,
            rt,
            _own: None,
        }
    }

    /// Dials as a member of a swarm: presents `membership` in every handshake and accepts a
    /// server only if `servers` admits it (besides proving the pinned key). Call before any
    /// peer is added.
    pub fn with_membership(
        mut self,
        membership: Option<stormo_manifests::Membership>,
        servers: tls::Admission,
    ) -> Self {
        let inner = Arc::get_mut(&mut self.inner).expect("no peer added yet");
        inner.membership = membership;
        inner.servers = servers;
        self
    }

    /// Adds `peers` to the peer set and connects to the new ones (in parallel, each bounded by
    /// the connect timeout), returning when every attempt has ended. A peer already in the set
    /// under the same key and address is left as it is; one under the same key at another
    /// address replaces it. Unreachable peers are warned about and retried later.
    pub fn add_peers(&self, peers: &[PeerAddr]) -> anyhow::Result<()> {
        let added = self.inner.add_peers(peers)?;
        if added.is_empty() {
            return Ok(());
        }
        let i2 = self.inner.clone();
        let connect_all = async move {
            let tasks: Vec<_> = added
                .into_iter()
                .map(|p| {
                    let i = i2.clone();
                    // A failure is marked (and warned about) by `link`.
                    tokio::spawn(async move { link(&i, &p).await })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            // Inside a runtime (a discovery task): connect in the background.
            Ok(_) => {
                self.rt.spawn(connect_all);
            }
            Err(_) => self.rt.block_on(connect_all),
        }
        let peers = self.inner.peers();
        let live: Vec<_> = peers.iter().filter(|p| !p.state().removed).collect();
        let reachable = live
            .iter()
            .filter(|p| p.state().inventory.is_some())
            .count();
        tracing::info!("{reachable} of {} peers reachable", live.len());
        Ok(())
    }

    /// Removes the peer with node key `key` from the peer set (closing its connection).
    /// Returns whether it was there.
    pub fn remove_peer(&self, key: &PublicKey) -> bool {
        self.inner.remove_peer(key)
    }

    /// The peers in the set now.
    pub fn peer_addrs(&self) -> Vec<PeerAddr> {
        self.inner
            .peers()
            .iter()
            .filter(|p| !p.state().removed)
            .map(|p| p.addr.clone())
            .collect()
    }

    /// The experts that peers in the set hold now (their inventories), in `shape`.
    pub fn held_by_peers(&self, shape: (u16, u16)) -> Option<ExpertSet> {
        let mut out = ExpertSet::new(shape.0, shape.1).ok()?;
        for p in self.inner.peers().iter() {
            if p.state().removed {
                continue;
            }
            if let Some(inv) = p.state().inventory.as_ref() {
                for e in inv.iter() {
                    let _ = out.insert(e);
                }
            }
        }
        Some(out)
    }

    /// What this node knows of each peer in the set: its key, its inventory, its last
    /// placement announcement, and whether its connection is up now.
    pub fn swarm_view(&self) -> Vec<PeerSnapshot> {
        self.inner
            .peers()
            .iter()
            .filter_map(|p| {
                let s = p.state();
                (!s.removed).then(|| PeerSnapshot {
                    addr: p.addr.clone(),
                    inventory: s.inventory.clone(),
                    placement: s.placement.clone(),
                    connected: s.control_open
                        && s.banned.is_none()
                        && s.lost.is_none()
                        && s.unreachable.is_none(),
                })
            })
            .collect()
    }

    /// How many experts each peer advertised (in `peers` order; `None`: not reached).
    pub fn inventories(&self) -> Vec<Option<usize>> {
        self.inner
            .peers()
            .iter()
            .map(|p| p.state().inventory.as_ref().map(ExpertSet::len))
            .collect()
    }

    /// Keeps `rt` alive as long as the tier (when the tier runs on it).
    pub fn keep_runtime(mut self, rt: Arc<tokio::runtime::Runtime>) -> Self {
        self._own = Some(OwnedRuntime(Some(rt)));
        self
    }

    /// Races `local` (the node's disk tier) against demand requests that are slow to come
    /// from a peer when no other peer holds the expert. Set once; later calls are ignored.
    pub fn set_local(&self, local: Arc<dyn Tier>) {
        let _ = self.inner.local.set(local);
    }

    /// Also writes every verified expert to `dir` (in the background, after the load
    /// completes). Set once; later calls are ignored.
    pub fn set_expert_dir(&self, dir: Arc<super::expert_dir::ExpertDir>) {
        let _ = self.inner.store.set(dir);
    }

    /// The races so far.
    pub fn hedge_stats(&self) -> HedgeStats {
        *self.inner.hedges.lock().expect("hedge stats lock")
    }

    /// Races lost so far per peer (slower than a hedge), in `peers` order.
    pub fn races_lost(&self) -> Vec<u32> {
        self.inner
            .peers()
            .iter()
            .map(|p| p.state().races_lost)
            .collect()
    }

    /// Verified expert bytes received so far per peer (whole records, stripes, and the
    /// verified part of failed tries), in `peers` order.
    pub fn peer_bytes(&self) -> Vec<(PeerAddr, u64)> {
        self.inner
            .peers()
            .iter()
            .map(|p| (p.addr.clone(), p.state().bytes))
            .collect()
    }

    /// Loads striped across several holders that ended with the record, so far.
    pub fn striped_loads(&self) -> u64 {
        self.inner.striped.load(Ordering::Relaxed)
    }

    /// Connection attempts so far per peer (the first at start included), in `peers` order.
    pub fn connects(&self) -> Vec<u32> {
        self.inner
            .peers()
            .iter()
            .map(|p| p.state().connects)
            .collect()
    }

    /// Failures so far per peer, in `peers` order: tries that reached the peer (or tried to
    /// connect to it) and failed. Tries refused at once because the peer is unreachable for
    /// its back-off are not its failures again.
    pub fn failures(&self) -> Vec<(PeerAddr, u32)> {
        self.inner
            .peers()
            .iter()
            .map(|p| (p.addr.clone(), p.state().failures_total))
            .collect()
    }

    /// The peers in the set that hold expert `id` verified by their inventory (not those that
    /// only offer to fetch it), and may be asked: where [`Self::exec`] can run it.
    pub fn exec_holders(&self, id: ExpertId) -> Vec<PublicKey> {
        self.inner
            .peers()
            .iter()
            .filter(|p| {
                let s = p.state();
                s.usable() && s.holds(id)
            })
            .map(|p| p.addr.key)
            .collect()
    }

    /// [`Self::exec_holders`] with each one's measured link: round trip and throughput
    /// (`None`: not measured yet), for remote execution's choice.
    pub fn exec_links(&self, id: ExpertId) -> Vec<(PublicKey, Option<Duration>, Option<f64>)> {
        self.inner
            .peers()
            .iter()
            .filter_map(|p| {
                let s = p.state();
                (s.usable() && s.holds(id)).then(|| (p.addr.key, s.rtt, s.rate))
            })
            .collect()
    }

    /// Runs expert `expert` at the peer with key `peer` over `rows` (`[n, hidden]` f32, the
    /// layer's hidden width) and returns its output rows (`[n, hidden]`), within `deadline`
    /// (connecting included). More positions than one call carries
    /// ([`stormo_wire::max_positions`]) go as several calls, one after another. The answer's
    /// length is checked before its rows are returned; whether they are right is the
    /// caller's to check (spot-checks). Uses the tier's connection to the peer (dialling it if
    /// there is none, as a fetch would); a failure changes nothing in the peer's standing
    /// here, except that a lost connection is redialled later as for fetches.
    pub async fn exec(
        &self,
        peer: &PublicKey,
        expert: ExpertId,
        rows: &[f32],
        deadline: Duration,
    ) -> Result<Vec<f32>, ExecError> {
        exec_at(&self.inner, peer, expert, rows, deadline).await
    }

    /// Runs every call of `calls` at its peer, all at once (each on a task of its own; at most
    /// [`EXEC_IN_FLIGHT`] at a time on one peer's connection, the others wait their turn
    /// within the deadline), and returns their outputs in the same order. Each call is as
    /// [`Self::exec`], with the same `deadline` from now.
    pub async fn exec_all(
        &self,
        calls: Vec<ExecRequest>,
        deadline: Duration,
    ) -> Vec<Result<Vec<f32>, ExecError>> {
        let tasks: Vec<_> = calls
            .into_iter()
            .map(|c| {
                let inner = self.inner.clone();
                tokio::spawn(
                    async move { exec_at(&inner, &c.peer, c.expert, &c.rows, deadline).await },
                )
            })
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(
                t.await.unwrap_or_else(|e| {
                    Err(ExecError::Lost(format!("the call's task ended: {e}")))
                }),
            );
        }
        out
    }

    /// [`Self::exec_all`] from a thread outside the tier's runtime, blocking it until every
    /// call ended. Must not be called from within an async task.
    pub fn exec_all_blocking(
        &self,
        calls: Vec<ExecRequest>,
        deadline: Duration,
    ) -> Vec<Result<Vec<f32>, ExecError>> {
        self.rt.block_on(self.exec_all(calls, deadline))
    }

    /// [`Self::exec`] from a thread outside the tier's runtime (an engine thread), blocking
    /// it until the call ends. Must not be called from within an async task.
    pub fn exec_blocking(
        &self,
        peer: &PublicKey,
        expert: ExpertId,
        rows: &[f32],
        deadline: Duration,
    ) -> Result<Vec<f32>, ExecError> {
        self.rt.block_on(self.exec(peer, expert, rows, deadline))
    }

    /// Closes every connection.
    pub fn close(&self) {
        self.inner.closing.store(true, Ordering::SeqCst);
        self.inner.endpoint.close(0u32.into(), b"done");
    }
}

/// Why there is no link to a peer. Either way the peer is already marked: callers must not
/// mark it again.
#[derive(Debug, thiserror::Error)]
enum LinkError {
    /// This call tried to connect and failed.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// A recent attempt failed (or the connection was lost) and the policy says not to dial
    /// yet ([`policy::Dial::Wait`]).
    #[error("{}", wait_message(.why, *.left, *.coming_back))]
    Wait {
        /// Why the last attempt failed.
        why: String,
        /// Until an attempt may start.
        left: Duration,
        /// Lost and being redialled, rather than unreachable.
        coming_back: bool,
    },
}

fn wait_message(why: &str, left: Duration, coming_back: bool) -> String {
    if coming_back {
        format!("{why}; trying again in {:.1}s", left.as_secs_f64())
    } else {
        format!(
            "unreachable ({why}); not trying to connect again for {:.1}s",
            left.as_secs_f64()
        )
    }
}

/// The live link to `peer`, connecting if there is none (or the last one closed) and the
/// policy allows a dial ([`PeerView::dial`]). Attempts are one at a time (the lock on the
/// link is held while connecting): the calls that waited for a failed one find the policy
/// refusing to dial again until its back-off ends, and fail at once without connecting. A
/// link found closed is a lost connection ([`PeerView::lose`]): the peer is redialled.
async fn link(inner: &Inner, peer: &Arc<Peer>) -> Result<Arc<Link>, LinkError> {
    let mut g = peer.link.clone().lock_owned().await;
    if let Some(l) = g.as_ref() {
        if l.conn.close_reason().is_none() {
            return Ok(l.clone());
        }
        // Closed by this node only for silence (the loss is noted then) or a protocol
        // violation (not a loss: no reconnection rounds for it).
        if connection_lost(&l.conn) && peer.state().lose(Instant::now()) {
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
        s.connected();
    }
    tokio::spawn(control.follow(peer.clone(), model));
    Liveness::watch(&l);
    *g = Some(l.clone());
    Ok(l)
}

/// Whether `conn` was lost: closed by the peer or the network (a reset, an idle timeout),
/// not by this node (for a protocol violation, a removal or shutdown).
fn connection_lost(conn: &quinn::Connection) -> bool {
    conn.close_reason()
        .is_some_and(|e| !matches!(e, quinn::ConnectionError::LocallyClosed))
}

/// Fetches a manifest from `peer` and returns its bytes, unchecked (check them against the
/// trusted key or the pinned id before use). `model` is the id to ask for; `None` asks for
/// the peer's only model.
pub async fn fetch_manifest(
    secret: &SecretKey,
    peer: &PeerAddr,
    model: Option<Hash>,
    cfg: PeerConfig,
) -> anyhow::Result<(Hash, Vec<u8>)> {
    let endpoint = client_endpoint(std::slice::from_ref(peer))?;
    let client = tls::client_config(secret, &peer.key)?;
    let me = NodeId(*secret.public().as_bytes());
    let (conn, hello, _, control) = connect(&endpoint, client, peer, me, None, cfg.connect_timeout)
        .await
        .with_context(|| format!("peer {peer}"))?;
    control.drain();
    let model = match model {
        Some(m) => {
            anyhow::ensure!(
                hello.models.contains(&m),
                "peer {peer} does not serve model {}",
                m.short()
            );
            m
        }
        None => match hello.models.as_slice() {
            [m] => *m,
            [] => anyhow::bail!("peer {peer} serves no model"),
            _ => anyhow::bail!("peer {peer} serves several models; name one with --model-id"),
        },
    };
    let reqs = LinkRequests::new(RequestsConfig {
        timeout: cfg.request_timeout,
        idle_timeout: cfg.idle_timeout,
        max_outstanding: 1,
    });
    let out = run_request(
        &conn,
        &reqs,
        Fetch::manifest(model, MAX_MANIFEST_LEN),
        None,
        cfg.idle_timeout,
        None,
        &mut Prefix::default(),
        None,
    )
    .await
    .map(|c| c.bytes);
    endpoint.close(0u32.into(), b"done");
    match out {
        Ok(bytes) => Ok((model, bytes)),
        Err(e) => Err(anyhow::anyhow!("peer {peer}: fetching the manifest: {e}")),
    }
}

/// One connection to one peer for whole requests (a manifest, file ranges), several at once:
/// what `stormo pull` fetches through. Every request is bounded by the timeouts of the
/// [`PeerConfig`] it was opened with.
pub struct PeerLink {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    hello: Hello,
    reqs: Mutex<LinkRequests>,
    slots: Arc<Semaphore>,
    /// The silence deadline.
    idle: Duration,
    /// The peer.
    pub peer: PeerAddr,
}

impl fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerLink")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl PeerLink {
    /// Connects to `peer` as `secret` (handshake and hello within the connect timeout).
    pub async fn connect(
        secret: &SecretKey,
        peer: &PeerAddr,
        cfg: PeerConfig,
    ) -> anyhow::Result<Self> {
        let client = tls::client_config(secret, &peer.key)?;
        Self::connect_with(secret, client, peer, cfg).await
    }

    /// [`Self::connect`] with the client configuration `client` (made for `secret`, pinning
    /// `peer`'s key): a swarm member's, which presents its membership certificate.
    pub async fn connect_with(
        secret: &SecretKey,
        client: quinn::ClientConfig,
        peer: &PeerAddr,
        cfg: PeerConfig,
    ) -> anyhow::Result<Self> {
        let endpoint = client_endpoint(std::slice::from_ref(peer))?;
        let me = NodeId(*secret.public().as_bytes());
        let (conn, hello, _, control) =
            connect(&endpoint, client, peer, me, None, cfg.connect_timeout)
                .await
                .with_context(|| format!("peer {peer}"))?;
        control.drain();
        let limit = hello.limits.max_concurrent_requests.clamp(1, 64);
        Ok(Self {
            endpoint,
            conn,
            reqs: LinkRequests::new(RequestsConfig {
                timeout: cfg.request_timeout,
                idle_timeout: cfg.idle_timeout,
                max_outstanding: limit,
            }),
            slots: Arc::new(Semaphore::new(limit as usize)),
            hello,
            idle: cfg.idle_timeout,
            peer: peer.clone(),
        })
    }

    /// The model ids the peer serves (from its hello).
    pub fn models(&self) -> &[Hash] {
        &self.hello.models
    }

    /// How many requests the peer serves at once for this node.
    pub fn max_concurrent(&self) -> usize {
        self.hello.limits.max_concurrent_requests.clamp(1, 64) as usize
    }

    async fn request(&self, fetch: Fetch) -> anyhow::Result<Vec<u8>> {
        let _slot = self.slots.acquire().await.context("the link is closed")?;
        run_request(
            &self.conn,
            &self.reqs,
            fetch,
            None,
            self.idle,
            None,
            &mut Prefix::default(),
            None,
        )
        .await
        .map(|c| c.bytes)
        .map_err(|e| anyhow::anyhow!("peer {}: {e}", self.peer))
    }

    /// The manifest of `model`, unchecked (check it against the pinned id or trusted key).
    pub async fn manifest(&self, model: Hash) -> anyhow::Result<Vec<u8>> {
        self.request(Fetch::manifest(model, MAX_MANIFEST_LEN))
            .await
            .context("fetching the manifest")
    }

    /// Bytes `offset..offset + len` of the file `name` of `model` (at most
    /// [`stormo_wire::MAX_FILE_RANGE_LEN`]), unchecked.
    pub async fn file(
        &self,
        model: Hash,
        name: &str,
        offset: u64,
        len: u64,
    ) -> anyhow::Result<Vec<u8>> {
        self.request(Fetch::file(model, name, ByteRange { offset, len }))
            .await
            .with_context(|| format!("fetching {name} bytes {offset}+{len}"))
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.conn.close(0u32.into(), b"done");
        self.endpoint.close(0u32.into(), b"done");
    }
}

/// The most `Exec` calls this node has in flight on one peer's connection at once (a serving
/// node admits `--exec-per-peer` of them, 8 by default; more would only be answered `busy`).
pub const EXEC_IN_FLIGHT: usize = 8;

/// One call of [`PeerTier::exec_all`]: run `expert` at `peer` over `rows`.
#[derive(Clone, Debug)]
pub struct ExecRequest {
    /// The peer's key.
    pub peer: PublicKey,
    /// The expert.
    pub expert: ExpertId,
    /// The input rows, `[n, hidden]`.
    pub rows: Vec<f32>,
}

/// [`PeerTier::exec`] on `inner`.
async fn exec_at(
    inner: &Inner,
    peer: &PublicKey,
    expert: ExpertId,
    rows: &[f32],
    deadline: Duration,
) -> Result<Vec<f32>, ExecError> {
    let hidden = inner
        .schemas
        .get(expert.layer as usize)
        .and_then(Option::as_ref)
        .map(|s| s.hidden)
        .ok_or_else(|| ExecError::Invalid(format!("layer {} has no experts", expert.layer)))?;
    if rows.is_empty() || !rows.len().is_multiple_of(hidden) {
        return Err(ExecError::Invalid(format!(
            "{} floats are not whole rows of {hidden}",
            rows.len()
        )));
    }
    let p = inner
        .peers()
        .iter()
        .find(|p| p.addr.key == *peer && p.state().usable())
        .cloned()
        .ok_or_else(|| {
            ExecError::Invalid(format!("peer {} is not in the set", super::short_key(peer)))
        })?;
    let per_call = stormo_wire::max_positions(hidden).max(1) * hidden;
    let work = async {
        let l = link(inner, &p)
            .await
            .map_err(|e| ExecError::Lost(format!("{}: {e}", p.addr)))?;
        let mut out = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(per_call) {
            out.extend(exec_call(&l, inner.model, expert, chunk, hidden).await?);
        }
        Ok(out)
    };
    tokio::time::timeout(deadline, work)
        .await
        .unwrap_or(Err(ExecError::Timeout(deadline)))
}

/// One `Exec` call on `l`'s connection: sends the rows on a stream of its own and reads the
/// one answer.
async fn exec_call(
    l: &Link,
    model: Hash,
    expert: ExpertId,
    rows: &[f32],
    hidden: usize,
) -> Result<Vec<f32>, ExecError> {
    let _slot = l
        .exec_slots
        .acquire()
        .await
        .map_err(|_| ExecError::Lost("the link is closed".into()))?;
    let id = stormo_wire::RequestId(l.exec_ids.fetch_add(1, Ordering::Relaxed));
    let (call, msg) = stormo_wire::ExecCall::start(id, model, expert, rows, hidden)
        .map_err(|e| ExecError::Invalid(e.to_string()))?;
    let (mut send, recv) = l
        .conn
        .open_bi()
        .await
        .map_err(|e| ExecError::Lost(format!("opening a stream: {e}")))?;
    let _ = send.set_priority(super::serve::EXEC_PRIORITY);
    super::write_message(&mut send, &Message::Exec(msg))
        .await
        .map_err(|e| ExecError::Lost(format!("{e:#}")))?;
    let _ = send.finish();
    let mut frames = FramedRecv::new(recv, stormo_wire::MAX_EXEC_FRAME_LEN);
    match frames.next().await {
        Ok(Some(m)) => call.answer(m).map_err(ExecError::from),
        Ok(None) => Err(ExecError::Malformed(
            "the stream ended without an answer".into(),
        )),
        Err(ReadError::Decode(e)) => {
            l.conn.close(
                u32::from(stormo_wire::ErrorCode::PROTOCOL_VIOLATION.0).into(),
                e.to_string().as_bytes(),
            );
            Err(ExecError::Malformed(e.to_string()))
        }
        Err(ReadError::Stream(e)) => Err(ExecError::Lost(e.to_string())),
    }
}

/// Why one attempt at one peer failed.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    /// The request failed: why, and whether the peer sent stream data on the connection
    /// meanwhile (for this request or another; acknowledgements and pings do not count).
    #[error("{0}")]
    Fetch(FetchError, bool),
    /// No link (the peer is already marked for it).
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The connection was lost during the request (the peer is already marked for it, once
    /// however many requests saw it: [`PeerView::lose`]).
    #[error("connection lost: {0}")]
    Lost(Box<Self>),
    /// The driver of a striped load moved the rest of this stripe to another holder (this
    /// try fell far behind); not the peer's fault.
    #[error("fell far behind the other stripes; its remainder moved to another holder")]
    Moved,
    #[error("{0:#}")]
    Other(anyhow::Error),
}

/// Starts `fetch` among the requests of `conn`, sends it on a new stream and drives it to
/// its end. Data payloads go from the chunks quinn received to where the request keeps them
/// (the caller's buffer with [`Fetch::into_buffer`]) without another copy. On failure, `kept`
/// gets back the caller's buffer and the end of its verified prefix. With `stripe`, the
/// verified end is reported there as chunks verify, and the request gives up
/// ([`AttemptError::Moved`]) when the stripe is moved. With `live`, a try that fails while
/// the whole connection has been silent for [`SILENT_CONNECTION`] did not hear the peer,
/// whatever arrived before that.
#[allow(clippy::too_many_arguments)]
async fn run_request(
    conn: &quinn::Connection,
    reqs: &Mutex<LinkRequests>,
    fetch: Fetch,
    priority: Option<i32>,
    idle: Duration,
    live: Option<&Liveness>,
    kept: &mut Prefix,
    stripe: Option<&StripeCtl>,
) -> Result<Completed, AttemptError> {
    let mut moves = stripe.map(|c| c.moves.subscribe());
    let mut fetch = fetch;
    let rx_before = conn.stats().frame_rx.stream;
    // A peer that died or stopped grants no new stream: that wait is silence too, bounded
    // by the same deadline as silence within an answer.
    let (mut send, recv) = match tokio::time::timeout(idle, conn.open_bi()).await {
        // Closed by the peer, the network, or this node (a silent link is closed so that the
        // next try reconnects): lost either way, and worth another round.
        Ok(r) => r.map_err(|e| {
            kept.buffer = fetch.take_buffer();
            AttemptError::Fetch(
                FetchError::ConnectionLost {
                    reason: format!("opening a stream: {e}"),
                },
                false,
            )
        })?,
        Err(_) => {
            kept.buffer = fetch.take_buffer();
            return Err(AttemptError::Fetch(
                FetchError::Stalled { idle, received: 0 },
                false,
            ));
        }
    };
    if let Some(p) = priority {
        let _ = send.set_priority(p);
    }
    let (id, out) = {
        let mut g = lock(reqs);
        let id = g
            .req
            .start(Instant::now(), fetch)
            .map_err(|e| AttemptError::Other(anyhow::anyhow!("{e}")))?;
        let mut out = Vec::new();
        while let Some(m) = g.req.poll_transmit() {
            if m.request_id() == Some(id) {
                out.push(m);
            }
        }
        (id, out)
    };
    // Whatever ends this request (also the future being dropped when a race is lost), it
    // leaves nothing behind in the link's requests.
    let _outstanding = Outstanding { reqs, id };
    let give_up = |why: String, kept: &mut Prefix| {
        if let Some(a) = lock(reqs).req.cancel_keeping(id) {
            kept.keep(a.buffer, a.verified_end);
        }
        AttemptError::Other(anyhow::anyhow!(why))
    };
    if let (Some(c), Some(rx)) = (stripe, moves.as_ref()) {
        if *rx.borrow() != c.moves_at_begin.load(Ordering::SeqCst) {
            give_up(String::new(), kept);
            return Err(AttemptError::Moved);
        }
    }
    for m in &out {
        if let Err(e) = super::write_message(&mut send, m).await {
            return Err(give_up(format!("{e:#}"), kept));
        }
    }
    let _ = send.finish();
    let mut frames = FramedRecv::new(recv, MAX_FRAME_LEN);
    // Stream bytes read when the request's idle deadline was last renewed, and the
    // connection's stream frames received by then.
    let mut heard_to = 0;
    let mut rx_mark = rx_before;
    let mut pieces = Vec::new();
    loop {
        let deadline = {
            let mut g = lock(reqs);
            g.pump();
            if let Some(ev) = g.events.remove(&id) {
                drop(g);
                return match ev {
                    Event::Completed(c) => Ok(c),
                    Event::Failed(f) => {
                        kept.keep(f.buffer, f.verified_end);
                        let _ = frames.stream().stop(0u32.into());
                        let _ = send.reset(0u32.into());
                        // Report what arrived of a frame still coming in too, not only whole
                        // frames (the message's byte count; `heard` below decides).
                        let error = match f.error {
                            FetchError::TimedOut { after, received } => FetchError::TimedOut {
                                after,
                                received: received.max(frames.received()),
                            },
                            e => e,
                        };
                        // Whether the peer was sending on this connection all along: since the
                        // request was sent, or for a stall since this stream last heard
                        // anything (a peer killed mid-answer is silent since).
                        let rx = conn.stats().frame_rx.stream;
                        let heard = match error {
                            FetchError::Stalled { .. } => rx > rx_mark,
                            _ => rx > rx_before,
                        } && !live.is_some_and(|l| l.silent(conn, Instant::now()));
                        Err(AttemptError::Fetch(error, heard))
                    }
                };
            }
            // This task alone knows what its stream has delivered (`handle_partial` below), so
            // it alone expires its request.
            g.req.poll_timeout_of(id)
        }
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
        tokio::select! {
            m = frames.next_pieces(&mut pieces) => match m {
                Ok(true) => {
                    heard_to = frames.received();
                    rx_mark = conn.stats().frame_rx.stream;
                    let r = {
                        let mut g = lock(reqs);
                        let now = Instant::now();
                        let r = pieces.drain(..).try_for_each(|p| p.feed(&mut g.req, now));
                        if let (Some(c), Some(v)) = (stripe, g.req.verified_end(id)) {
                            c.verified.store(v, Ordering::Relaxed);
                        }
                        r
                    };
                    if let Err(e) = r {
                        conn.close(u32::from(stormo_wire::ErrorCode::PROTOCOL_VIOLATION.0).into(), e.to_string().as_bytes());
                        return Err(give_up(e.to_string(), kept));
                    }
                }
                Ok(false) => {
                    // The answer may have completed with the last frame.
                    let mut g = lock(reqs);
                    g.pump();
                    if g.events.contains_key(&id) {
                        continue;
                    }
                    drop(g);
                    return Err(give_up("the stream ended before the answer".into(), kept));
                }
                Err(ReadError::Decode(e)) => {
                    conn.close(u32::from(stormo_wire::ErrorCode::PROTOCOL_VIOLATION.0).into(), e.to_string().as_bytes());
                    return Err(give_up(format!("malformed frame: {e}"), kept));
                }
                Err(e) => return Err(give_up(e.to_string(), kept)),
            },
            _ = moved(&mut moves) => {
                give_up(String::new(), kept);
                return Err(AttemptError::Moved);
            }
            _ = tokio::time::sleep_until(deadline.into()) => {
                // Part of a frame arrived since: a slow stream (a frame is 256 KiB), not a
                // silent peer.
                let mut g = lock(reqs);
                let now = Instant::now();
                if frames.received() > heard_to {
                    heard_to = frames.received();
                    rx_mark = conn.stats().frame_rx.stream;
                    g.req.handle_partial(now, id);
                }
                g.req.handle_timeout_of(now, id);
            }
        }
    }
}

/// Resolves when the stripe `moves` follows is moved (never without one).
async fn moved(moves: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    match moves {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// The tries' errors of a failed load, in order; of a long list (many rounds), the first and
/// last three with a count of those between.
fn summarize(errors: &[String]) -> String {
    const ENDS: usize = 3;
    if errors.len() <= 2 * ENDS + 1 {
        return errors.join("; ");
    }
    format!(
        "{}; ... {} more ...; {}",
        errors[..ENDS].join("; "),
        errors.len() - 2 * ENDS,
        errors[errors.len() - ENDS..].join("; ")
    )
}

/// Cancels a request and drops its event when dropped.
struct Outstanding<'a> {
    reqs: &'a Mutex<LinkRequests>,
    id: stormo_wire::RequestId,
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        let mut g = lock(self.reqs);
        g.req.cancel(self.id);
        g.events.remove(&self.id);
        // Cancels are carried by the streams' resets.
        while g.req.poll_transmit().is_some() {}
    }
}

impl Inner {
    /// The peer set now.
    fn peers(&self) -> Arc<Vec<Arc<Peer>>> {
        self.peers.lock().expect("peer set lock").clone()
    }

    /// Adds `peers` not already in the set (see [`PeerTier::add_peers`]); returns the new ones.
    fn add_peers(&self, peers: &[PeerAddr]) -> anyhow::Result<Vec<Arc<Peer>>> {
        let mut set = self.peers.lock().expect("peer set lock");
        let mut next: Vec<Arc<Peer>> = set.as_ref().clone();
        let mut added = Vec::new();
        for p in peers {
            if p.key == self.secret.public() {
                continue;
            }
            let same = next
                .iter()
                .find(|q| q.addr.key == p.key && !q.state().removed);
            match same {
                Some(q) if q.addr.addr == p.addr => continue,
                Some(q) => {
                    tracing::info!("peer {} moved to {}", q.addr, p.addr);
                    q.state().removed = true;
                }
                None => {}
            }
            let peer = Arc::new(Peer {
                addr: p.clone(),
                client: tls::client_config_for(
                    tls::Identity {
                        secret: &self.secret,
                        membership: self.membership.as_ref(),
                    },
                    Some(&p.key),
                    self.servers.clone(),
                )?,
                link: Default::default(),
                state: Mutex::new(PeerView::default()),
            });
            next.push(peer.clone());
            added.push(peer);
        }
        *set = Arc::new(next);
        Ok(added)
    }

    /// Marks the peer with `key` removed and closes its connection.
    fn remove_peer(&self, key: &PublicKey) -> bool {
        let peers = self.peers();
        let mut found = false;
        for p in peers.iter().filter(|p| p.addr.key == *key) {
            if !std::mem::replace(&mut p.state().removed, true) {
                found = true;
                if let Ok(g) = p.link.try_lock() {
                    if let Some(l) = g.as_ref() {
                        l.conn.close(0u32.into(), b"removed");
                    }
                }
            }
        }
        found
    }

    /// The best peer for `id` among those not in `tried` (see [`policy::choose`]).
    fn choose(&self, id: ExpertId, len: u64, tried: &HashSet<usize>) -> Option<usize> {
        let peers = self.peers();
        let views: Vec<_> = peers.iter().map(|p| p.state()).collect();
        policy::choose(
            views.iter().enumerate().map(|(i, v)| (i, &**v)),
            id,
            len,
            tried,
            Instant::now(),
        )
    }

    /// Whether a peer not in `tried` may still supply `id` in this round (see
    /// [`policy::other_holder_left`]).
    fn other_holder_left(&self, id: ExpertId, tried: &HashSet<usize>) -> bool {
        let peers = self.peers();
        let views: Vec<_> = peers.iter().map(|p| p.state()).collect();
        policy::other_holder_left(
            views.iter().enumerate().map(|(i, v)| (i, &**v)),
            id,
            tried,
            Instant::now(),
        )
    }

    /// When a holder of `id` whose connection was lost may be dialled again (see
    /// [`policy::coming_back`]).
    fn coming_back(&self, id: ExpertId, now: Instant) -> Option<Instant> {
        let peers = self.peers();
        let views: Vec<_> = peers.iter().map(|p| p.state()).collect();
        policy::coming_back(views.iter().enumerate().map(|(i, v)| (i, &**v)), id, now)
    }

    /// Chooses a peer for `id` not in `tried` (adding it there) and counts a request in
    /// flight at it.
    fn pick(
        &self,
        id: ExpertId,
        len: u64,
        tried: &mut HashSet<usize>,
    ) -> Option<(usize, InFlight)> {
        let _g = self.choosing.lock().expect("choosing lock");
        let i = self.choose(id, len, tried)?;
        tried.insert(i);
        let p = self.peers()[i].clone();
        p.state().in_flight += 1;
        Some((i, InFlight(p)))
    }

    /// Counts a request in flight at peer `i` for `id` and adds it to `tried`, if it may still
    /// supply `id` (a stripe's first holder, chosen by [`policy::stripes`]).
    fn pick_this(
        &self,
        i: usize,
        id: ExpertId,
        tried: &mut HashSet<usize>,
    ) -> Option<(usize, InFlight)> {
        let _g = self.choosing.lock().expect("choosing lock");
        let p = self.peers().get(i)?.clone();
        {
            let mut s = p.state();
            if tried.contains(&i) || !s.may_supply(id) {
                return None;
            }
            s.in_flight += 1;
        }
        tried.insert(i);
        Some((i, InFlight(p)))
    }

    /// The stripes of `id` (`len` bytes) over its holders now, if it is worth striping (see
    /// [`policy::stripes`]).
    fn stripe_plan(&self, id: ExpertId, len: u64) -> Option<Vec<policy::Stripe>> {
        let peers = self.peers();
        let views: Vec<_> = peers.iter().map(|p| p.state()).collect();
        policy::stripes(
            views.iter().enumerate().map(|(i, v)| (i, &**v)),
            id,
            len,
            u64::from(self.manifest.chunk_size),
            self.cfg.stripe_min,
            Instant::now(),
        )
    }

    /// How long a demand request to peer `i` runs before it is hedged: the p95 of its recent
    /// fetch times (before there are enough, three times the expected time), within the
    /// configured bounds and never past the request timeout.
    fn hedge_delay(&self, i: usize, len: u64) -> Duration {
        let peers = self.peers();
        let s = peers[i].state();
        let c = &self.cfg;
        policy::hedge_delay(&s, len, c.hedge_min, c.hedge_max, c.request_timeout)
    }

    fn count(&self, f: impl FnOnce(&mut HedgeStats)) {
        f(&mut self.hedges.lock().expect("hedge stats lock"));
    }

    /// Starts loading `key` from the local tier, if there is one and it holds the key.
    fn local_load(
        &self,
        key: ExpertId,
    ) -> Option<tokio::sync::oneshot::Receiver<stormo_engine::Result<Arc<ExpertData>>>> {
        let local = self.local.get()?;
        if !local.holds(key) {
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tx = Mutex::new(Some(tx));
        local.load(
            &[key],
            Priority::Demand,
            Arc::new(
                move |_: ExpertId, r: stormo_engine::Result<Arc<ExpertData>>| {
                    if let Some(tx) = tx.lock().expect("oneshot lock").take() {
                        let _ = tx.send(r);
                    }
                },
            ),
        );
        Some(rx)
    }

    /// One try at peer `i` (counted in flight by `f`) within `limit`, resuming after
    /// `prefix`; the whole span is verified before it is returned. Failures mark the peer and
    /// are counted in `tries.failed` (unless the tier is closing); successes feed its latency
    /// and throughput. A try whose deadline passed while the peer was still sending is slow,
    /// not faulty, and a busy answer is load, not a fault: neither marks the peer, and both set
    /// `tries.retry`. A stripe's try (with `stripe`) reports its progress there and gives up
    /// when the stripe is moved, which is not a failure either.
    #[allow(clippy::too_many_arguments)]
    async fn try_peer(
        &self,
        i: usize,
        f: InFlight,
        id: ExpertId,
        len: u64,
        mut prefix: Prefix,
        priority: Priority,
        limit: TryLimit,
        tries: &Tries,
        stripe: Option<&StripeCtl>,
    ) -> TryResult {
        let failed = &tries.failed;
        let peers = self.peers();
        let peer = &peers[i];
        let started = Instant::now();
        let from = prefix.verified.max(prefix.start);
        if let Some(c) = stripe {
            c.begin(from, i);
        }
        let got = self
            .attempt(peer, id, len, &mut prefix, priority, limit, stripe)
            .await;
        drop(f);
        if let Some(c) = stripe {
            if got.is_err() {
                c.end_try();
            }
        }
        let closing = self.closing.load(Ordering::SeqCst);
        if !closing && got.is_err() && !matches!(got, Err(AttemptError::Moved)) {
            failed.fetch_add(1, Ordering::Relaxed);
        }
        let span = prefix.end - prefix.start;
        // The verified bytes this try added (a try that lost its buffer kept none).
        let added = prefix.verified.saturating_sub(from);
        peer.state().bytes += added;
        match got {
            Ok(()) => {
                // Every chunk of the span passed `ChunkCheck` as it arrived (this attempt's
                // and the verified prefix of earlier ones), and the chunk hashes are part of
                // the same manifest as the record's hash (one canonical encoding, named by the
                // model id or signed): the span is verified without hashing it again. Its
                // length is the one thing left to check.
                let have = prefix.buffer.as_mut().map_or(0, |b| b.bytes_mut().len()) as u64;
                if have != span {
                    failed.fetch_add(1, Ordering::Relaxed);
                    let e = format!("{have} bytes of a {span}-byte span of a {len}-byte record");
                    peer.ban(&format!("expert {id}"), &e);
                    prefix.keep(None, 0);
                    return Err((format!("{}: {e}", peer.addr), prefix));
                }
                peer.state().succeed(added, started.elapsed().as_secs_f64());
                Ok(prefix)
            }
            Err(_) if closing => Err(("the network tier is closed".into(), prefix)),
            Err(e @ AttemptError::Moved) => {
                tracing::debug!("peer {} on expert {id}: {e}", peer.addr);
                self.lost(i, started.elapsed());
                tries.retry.store(true, Ordering::Relaxed);
                Err((format!("{}: {e}", peer.addr), prefix))
            }
            Err(e @ (AttemptError::Link(_) | AttemptError::Lost(_))) => {
                tracing::debug!("peer {} on expert {id}: {e}", peer.addr);
                Err((format!("{}: {e}", peer.addr), prefix))
            }
            Err(e @ AttemptError::Fetch(FetchError::Remote { code, .. }, _))
                if code == stormo_wire::ErrorCode::BUSY =>
            {
                // Alive but serving as many of this node's requests as it takes (some may be
                // tries this node gave up on that the peer has not yet dropped): a later round
                // may find it free.
                tracing::debug!("peer {} on expert {id}: {e}", peer.addr);
                tries.retry.store(true, Ordering::Relaxed);
                tries.busy.store(true, Ordering::Relaxed);
                Err((format!("{}: {e}", peer.addr), prefix))
            }
            Err(
                e @ AttemptError::Fetch(
                    FetchError::TimedOut { .. } | FetchError::Stalled { .. },
                    true,
                ),
            ) => {
                // The peer was sending to this node all along (this answer, or others ahead of
                // it on the same connection): slow or loaded, not failing.
                tracing::debug!(
                    "peer {} on expert {id}: {e}; still sending, so slow rather than failing \
                     (the next try resumes after {} verified bytes)",
                    peer.addr,
                    prefix.len()
                );
                peer.state().sample(started.elapsed().as_secs_f64());
                tries.retry.store(true, Ordering::Relaxed);
                Err((format!("{}: {e}", peer.addr), prefix))
            }
            Err(e @ AttemptError::Fetch(FetchError::BadChunk { .. }, _)) => {
                peer.ban(&format!("expert {id}"), &e);
                Err((format!("{}: {e}", peer.addr), prefix))
            }
            Err(e) => {
                peer.mark(&format!("on expert {id}"), &e);
                Err((format!("{}: {e}", peer.addr), prefix))
            }
        }
    }

    /// Notes that peer `i` lost a race after `elapsed` (a lower bound of its fetch time).
    fn lost(&self, i: usize, elapsed: Duration) {
        let peers = self.peers();
        let mut s = peers[i].state();
        s.sample(elapsed.as_secs_f64());
        s.races_lost += 1;
    }

    /// Loads `key` from the peers, and counts the failed tries that were followed by another
    /// (all of them when the load succeeds; all but the last, which is the load's own error,
    /// when it fails).
    async fn fetch(
        self: &Arc<Self>,
        key: ExpertId,
        priority: Priority,
    ) -> Result<Arc<ExpertData>, String> {
        let tries = Arc::new(Tries::default());
        let r = self.fetch_from_peers(key, priority, &tries).await;
        let failed = tries.failed.load(Ordering::Relaxed);
        let retried = if r.is_ok() {
            failed
        } else {
            failed.saturating_sub(1)
        };
        self.retried.fetch_add(retried, Ordering::Relaxed);
        r
    }

    /// Loads `key` from the peers, counting failed tries in `tries`: striped across its
    /// holders when [`policy::stripes`] says so ([`Self::fetch_striped`]), else whole
    /// ([`Self::fetch_span`]).
    async fn fetch_from_peers(
        self: &Arc<Self>,
        key: ExpertId,
        priority: Priority,
        tries: &Arc<Tries>,
    ) -> Result<Arc<ExpertData>, String> {
        let id = key;
        let entry = self
            .manifest
            .expert(id)
            .ok_or_else(|| format!("expert {id} is not in the manifest"))?;
        let len = entry.len;
        let schema = self
            .schemas
            .get(key.layer as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("layer {} has no experts", key.layer))?;
        // On huge pages, as the disk tier reads experts: where an expert came from decides
        // nothing, not even how fast the kernels stream it.
        let done = |record: HugeBuf| -> Result<Arc<ExpertData>, String> {
            let buf = Arc::new(record);
            if let Some(dir) = self.store.get() {
                let (dir, buf) = (dir.clone(), buf.clone());
                tokio::task::spawn_blocking(move || dir.store(id, &buf));
            }
            Ok(Arc::new(ExpertData::from_buffer(buf, schema)))
        };
        if let Some(plan) = self.stripe_plan(id, len) {
            let record = self.fetch_striped(id, len, plan, priority, tries).await?;
            // Counted once loaded, as the loads it is a share of are.
            self.striped.fetch_add(1, Ordering::Relaxed);
            return done(record);
        }
        match self
            .fetch_span(id, len, Prefix::whole(len), None, None, priority, tries)
            .await?
        {
            Got::Span(p) => done(p.into_record()),
            Got::Local(d) => Ok(d),
        }
    }

    /// Loads `id` (`len` bytes) striped as `plan` says: each stripe into its part of one
    /// buffer, all at once, each by [`Self::fetch_span`] (which starts at the stripe's holder
    /// and goes on to the others as for a whole record). When a stripe has finished, a try
    /// that fell far behind it ([`policy::far_behind`]) is made to give up, and its stripe
    /// goes on from its verified prefix at another holder. The record is whole once every
    /// stripe verified; a stripe that fails fails the load.
    async fn fetch_striped(
        self: &Arc<Self>,
        id: ExpertId,
        len: u64,
        plan: Vec<policy::Stripe>,
        priority: Priority,
        tries: &Arc<Tries>,
    ) -> Result<HugeBuf, String> {
        let buf = HugeBuf::recycled(len as usize).map_err(|e| e.to_string())?;
        let cuts: Vec<usize> = plan.iter().skip(1).map(|s| s.start as usize).collect();
        let parts = buf.split(&cuts).map_err(|(_, e)| e)?;
        tracing::debug!(
            "expert {id}: striped over {} holders ({})",
            plan.len(),
            plan.iter()
                .map(|s| format!("{}..{} at {}", s.start, s.end, self.peers()[s.peer].addr))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let ctls: Vec<Arc<StripeCtl>> = plan
            .iter()
            .map(|s| Arc::new(StripeCtl::new(s.start, s.end)))
            .collect();
        let mut set = tokio::task::JoinSet::new();
        for (k, (s, part)) in plan.iter().zip(parts).enumerate() {
            let prefix = Prefix {
                buffer: Some(Box::new(StripeBuf {
                    part,
                    offset: s.start,
                })),
                start: s.start,
                end: s.end,
                verified: s.start,
            };
            let (inner, tries, ctl, first) = (self.clone(), tries.clone(), ctls[k].clone(), s.peer);
            set.spawn(async move {
                let r = inner
                    .fetch_span(id, len, prefix, Some(first), Some(&ctl), priority, &tries)
                    .await;
                let rate = ctl.final_rate(Instant::now());
                (k, r, rate)
            });
        }
        let mut done: Vec<Option<HugePart>> = plan.iter().map(|_| None).collect();
        let mut states = vec![StripeState::Waiting; plan.len()];
        let chunk = u64::from(self.manifest.chunk_size);
        // Once a stripe has finished, the others are looked at this often.
        let tick = policy::MIN_OBSERVE / 5;
        while !set.is_empty() {
            let any_done = states.iter().any(|s| matches!(s, StripeState::Done { .. }));
            let next = tokio::select! {
                r = set.join_next() => r,
                _ = tokio::time::sleep(tick), if any_done => None,
            };
            match next {
                Some(Ok((k, Ok(Got::Span(p)), rate))) => {
                    states[k] = StripeState::Done { rate };
                    done[k] = Some(p.into_part());
                }
                Some(Ok((k, Ok(Got::Local(_)), _))) => {
                    return Err(format!(
                        "stripe {k}: a stripe is never raced against the disk"
                    ));
                }
                Some(Ok((k, Err(e), _))) => {
                    let s = &plan[k];
                    return Err(format!("bytes {}..{} of {len}: {e}", s.start, s.end));
                }
                Some(Err(e)) => return Err(format!("a stripe's task ended: {e}")),
                None => {}
            }
            let now = Instant::now();
            let elsewhere = |i: usize| {
                let peers = self.peers();
                let views: Vec<_> = peers.iter().map(|p| p.state()).collect();
                policy::idle_holder_left(
                    views.iter().enumerate().map(|(j, v)| (j, &**v)),
                    id,
                    i,
                    now,
                )
            };
            for (st, c) in states.iter_mut().zip(&ctls) {
                if !matches!(st, StripeState::Done { .. }) {
                    *st = c.state(elsewhere);
                }
            }
            if let Some(k) = policy::far_behind(&states, chunk, now) {
                tracing::debug!(
                    "expert {id}: bytes {}..{} fell far behind the other stripes; moving the \
                     rest to another holder",
                    plan[k].start,
                    plan[k].end
                );
                ctls[k].move_on();
                // Not judged again until its next try has run long enough.
                ctls[k].end_try();
                states[k] = StripeState::Waiting;
            }
        }
        let parts: Vec<HugePart> = done
            .into_iter()
            .map(|p| p.expect("every stripe finished"))
            .collect();
        HugePart::join(parts).map_err(|(_, e)| e)
    }

    /// Loads the span `prefix` of `id` (`len` bytes: the whole record, or a stripe) from the
    /// peers, starting at peer `first` if given, counting failed tries in `tries`.
    ///
    /// Each holder is tried once per round, each try resuming after the longest verified
    /// prefix so far. When every holder has been tried and some try ran out of time while its
    /// peer was still sending, or a peer answered busy (slow or loaded peers, or a link shared
    /// by many loads, not failing ones), or a holder whose connection was lost may come back
    /// (restarted; not waited for when the local disk holds the expert), another round starts
    /// after a short pause (for a lost holder, until the policy lets it be redialled), with twice
    /// the per-try deadline (up to [`policy::MAX_TIMEOUT_FACTOR`] times the first); see [`Rounds`]
    /// for when the rounds end. A try is cut off at its deadline while another holder is
    /// left in the round; the last holder's, and every try after the first round, runs on
    /// while its chunks keep verifying. Neither a round nor such a run goes past the load's
    /// budget, [`policy::LOAD_BUDGET_FACTOR`] times the first per-try deadline. A whole
    /// record's demand load is hedged; a stripe (with `stripe`) is not: the other stripes'
    /// holders already race it, and [`Self::fetch_striped`] moves it when it falls behind.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_span(
        &self,
        id: ExpertId,
        len: u64,
        mut prefix: Prefix,
        mut first: Option<usize>,
        stripe: Option<&StripeCtl>,
        priority: Priority,
        tries: &Tries,
    ) -> Result<Got, String> {
        let key = id;
        let done = |p: Prefix| Ok(Got::Span(p));
        let hedged = priority == Priority::Demand && stripe.is_none();
        let mut tried = HashSet::new();
        let mut errors = Vec::new();
        let mut local_tried = false;
        let mut clock = LoadClock::new(self.cfg.request_timeout, Instant::now());
        let mut rounds = Rounds::default();
        let mut round = 1;
        // The verified length when this round started.
        let mut round_start = 0;
        loop {
            if self.closing.load(Ordering::SeqCst) {
                return Err("the network tier is closed".into());
            }
            if round > 1 && clock.spent(Instant::now()) {
                errors.push(format!(
                    "gave up after {:.1}s, the load's budget",
                    clock.budget().as_secs_f64()
                ));
                break;
            }
            let mut picked = match first.take() {
                Some(i) => self
                    .pick_this(i, id, &mut tried)
                    .or_else(|| self.pick(id, len, &mut tried)),
                None => self.pick(id, len, &mut tried),
            };
            if picked.is_none() {
                // Every holder tried: another round, or the end (the policy's call).
                let now = Instant::now();
                let end = policy::RoundEnd {
                    progressed: prefix.len() > round_start,
                    busy: tries.busy.swap(false, Ordering::Relaxed),
                    slow: tries.retry.swap(false, Ordering::Relaxed),
                    // With the expert on the local disk, a lost holder is not waited for.
                    coming_back: if self.local.get().is_some_and(|l| l.holds(key)) {
                        None
                    } else {
                        self.coming_back(id, now)
                    },
                };
                if let Some(pause) = rounds.after(end, &clock, now) {
                    tokio::time::sleep(pause).await;
                    round += 1;
                    clock.next_round();
                    round_start = prefix.len();
                    tracing::debug!(
                        "expert {id}: every holder tried and some still sending, busy or \
                         coming back; round {round} with {:.1}s per try (more while chunks \
                         verify), after {} verified bytes",
                        clock.timeout.as_secs_f64(),
                        prefix.len()
                    );
                    tried.clear();
                    picked = self.pick(id, len, &mut tried);
                }
            }
            let Some((i, f)) = picked else {
                break;
            };
            // A try is cut off at its deadline while another holder is left to try in this
            // round. Once every holder has been tried (or there is no other), all are slow:
            // one that keeps verifying chunks is let run, within the load's budget (cutting
            // it off would throw away what its peer has queued).
            let limit = TryLimit {
                timeout: clock.timeout,
                extend_until: (round > 1 || !self.other_holder_left(id, &tried))
                    .then_some(clock.end),
            };
            let started = Instant::now();
            let delay = self.hedge_delay(i, len);
            // The try takes the verified prefix (and its buffer) and hands it back; a hedge
            // racing it starts from a copy (made only when there is a prefix to copy).
            let mut hedge_prefix = match hedged {
                true if prefix.len() > 0 => Some(prefix.copy(len)?),
                _ => None,
            };
            let prefix_in = prefix.take();
            let mut a = std::pin::pin!(
                self.try_peer(i, f, id, len, prefix_in, priority, limit, tries, stripe)
            );
            let first_try = if hedged {
                tokio::select! {
                    r = &mut a => Some(r),
                    _ = tokio::time::sleep(delay) => None,
                }
            } else {
                Some(a.as_mut().await)
            };
            let r = match first_try {
                Some(r) => r,
                None => {
                    // Slow: race a second request.
                    if let Some((j, g)) = self.pick(id, len, &mut tried) {
                        self.count(|h| h.hedges += 1);
                        tracing::debug!(
                            "expert {id}: {} slower than {:.1} ms, hedging with {}",
                            self.peers()[i].addr,
                            delay.as_secs_f64() * 1e3,
                            self.peers()[j].addr
                        );
                        let mut b = std::pin::pin!(self.try_peer(
                            j,
                            g,
                            id,
                            len,
                            hedge_prefix.take().unwrap_or_else(|| Prefix::whole(len)),
                            priority,
                            // The racer's limit: a hedge taking the last holder must not let
                            // the slower of the two run on while the other is cut off.
                            limit,
                            tries,
                            None
                        ));
                        let (r, b_first) = tokio::select! {
                            r = &mut a => (r, false),
                            r = &mut b => (r, true),
                        };
                        let (loser, winner_hedge) = if b_first { (i, true) } else { (j, false) };
                        match r {
                            Ok(record) => {
                                self.lost(loser, started.elapsed());
                                if winner_hedge {
                                    self.count(|h| h.hedge_wins += 1);
                                }
                                return done(record);
                            }
                            Err((e, p1)) => {
                                errors.push(e);
                                let r2 = if b_first {
                                    a.as_mut().await
                                } else {
                                    b.as_mut().await
                                };
                                match r2 {
                                    Ok(record) => {
                                        if !b_first {
                                            self.count(|h| h.hedge_wins += 1);
                                        }
                                        return done(record);
                                    }
                                    Err((e, p2)) => {
                                        Err((e, if p1.len() >= p2.len() { p1 } else { p2 }))
                                    }
                                }
                            }
                        }
                    } else if let Some(rx) = (!local_tried).then(|| self.local_load(key)).flatten()
                    {
                        local_tried = true;
                        self.count(|h| h.hedges += 1);
                        tracing::debug!(
                            "expert {id}: {} slower than {:.1} ms, hedging with the local disk",
                            self.peers()[i].addr,
                            delay.as_secs_f64() * 1e3
                        );
                        let mut rx = rx;
                        tokio::select! {
                            r = &mut a => match r {
                                Ok(record) => return done(record),
                                Err((e, p)) => {
                                    errors.push(e);
                                    prefix = p;
                                    match rx.await {
                                        Ok(Ok(d)) => {
                                            self.count(|h| h.local_wins += 1);
                                            return Ok(Got::Local(d));
                                        }
                                        Ok(Err(e)) => Err((format!("local disk: {e}"), prefix.take())),
                                        Err(_) => Err(("local disk: dropped the load".into(), prefix.take())),
                                    }
                                }
                            },
                            l = &mut rx => match l {
                                Ok(Ok(d)) => {
                                    self.lost(i, started.elapsed());
                                    self.count(|h| h.local_wins += 1);
                                    return Ok(Got::Local(d));
                                }
                                Ok(Err(e)) => {
                                    errors.push(format!("local disk: {e}"));
                                    a.as_mut().await
                                }
                                Err(_) => a.as_mut().await,
                            },
                        }
                    } else {
                        a.as_mut().await
                    }
                }
            };
            match r {
                Ok(record) => return done(record),
                Err((e, p)) => {
                    errors.push(e);
                    // The try began from `prefix` and returns it extended, or empty when the
                    // whole record failed to verify (then nothing of it is kept).
                    prefix = p;
                }
            }
        }
        if errors.is_empty() {
            Err(format!("no peer holds expert {id}"))
        } else {
            Err(format!(
                "no peer could supply expert {id} ({})",
                summarize(&errors)
            ))
        }
    }

    /// One attempt at `peer`: fetches the bytes of `prefix`'s span after its verified prefix
    /// (from an earlier attempt) into its buffer (a whole record's is allocated here on the
    /// first try) and leaves the span verified in `prefix`, or extends `prefix` with what
    /// verified.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        peer: &Arc<Peer>,
        id: ExpertId,
        len: u64,
        prefix: &mut Prefix,
        priority: Priority,
        limit: TryLimit,
        stripe: Option<&StripeCtl>,
    ) -> Result<(), AttemptError> {
        // `limit` bounds the request from when it is sent. Connecting has its own bound (the
        // connect timeout), and waiting for one of the link's request slots is not counted:
        // that queue is this node's own loads, not the peer's doing, and every request holding
        // a slot is bounded.
        let l = link(self, peer).await?;
        let _permit = l
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| AttemptError::Other(anyhow::anyhow!("link closed")))?;
        let wire_priority = match priority {
            Priority::Demand => stormo_wire::Priority::Now,
            Priority::Prefetch => stormo_wire::Priority::Prefetch,
        };
        let mut fetch = Fetch::expert(self.model, id, len)
            .priority(wire_priority)
            .timeout(limit.timeout)
            .verifier(Box::new(ChunkCheck {
                manifest: self.manifest.clone(),
                id,
                len,
            }));
        if let Some(until) = limit.extend_until {
            fetch = fetch.extend_on_progress(until.saturating_duration_since(Instant::now()));
        }
        // On huge pages, as the disk tier reads experts: where an expert came from decides
        // nothing, not even how fast the kernels stream it.
        let whole = prefix.start == 0 && prefix.end == len;
        let buffer = match prefix.buffer.take() {
            Some(b) => b,
            None if whole => {
                prefix.verified = 0;
                let b = HugeBuf::recycled(len as usize)
                    .map_err(|e| AttemptError::Other(anyhow::anyhow!("{e}")))?;
                Box::new(RecordBuf(b))
            }
            None => {
                return Err(AttemptError::Other(anyhow::anyhow!(
                    "the buffer of bytes {}..{} was lost",
                    prefix.start,
                    prefix.end
                )))
            }
        };
        fetch = fetch.into_buffer(buffer);
        let have = prefix.verified.max(prefix.start);
        if have > 0 || prefix.end != len {
            fetch = fetch.range(ByteRange {
                offset: have,
                len: prefix.end - have,
            });
        }
        let stream_priority = match priority {
            Priority::Demand => 1,
            Priority::Prefetch => 0,
        };
        let idle = self.cfg.idle_timeout;
        let mut lost = false;
        let r = run_request(
            &l.conn,
            &l.reqs,
            fetch,
            Some(stream_priority),
            idle,
            Some(&l.live),
            prefix,
            stripe,
        )
        .await;
        if r.is_err() && prefix.buffer.is_none() {
            // The buffer went with a request that never started: begin again from scratch.
            prefix.verified = prefix.start;
        }
        let r = match r {
            Ok(c) => {
                prefix.buffer = Some(
                    c.buffer
                        .expect("a request into a buffer completes with the buffer"),
                );
                prefix.verified = prefix.end;
                return Ok(());
            }
            Err(AttemptError::Fetch(e, heard)) => {
                let stalled = matches!(e, FetchError::Stalled { .. });
                if !heard && (stalled || l.live.silent(&l.conn, Instant::now())) {
                    // Silent on the whole connection for the silence deadline, or nothing at
                    // all received for `SILENT_CONNECTION`: presumed gone (killed, stopped,
                    // restarted). Closing the link now makes the next try reconnect instead
                    // of waiting out QUIC's own idle timeout on it.
                    l.conn.close(0u32.into(), b"silent");
                    lost = true;
                }
                AttemptError::Fetch(e, heard)
            }
            Err(e) => e,
        };
        if !(lost || connection_lost(&l.conn)) {
            return Err(r);
        }
        if peer.state().lose(Instant::now()) {
            tracing::info!(
                "peer {}: connection lost on expert {id} ({r}); it will be redialled",
                peer.addr
            );
        }
        Err(AttemptError::Lost(Box::new(r)))
    }
}

impl Tier for PeerTier {
    fn name(&self) -> &str {
        "peer"
    }

    fn holds(&self, id: ExpertId) -> bool {
        self.inner.manifest.expert(id).is_some()
            && self.inner.peers().iter().any(|p| p.state().may_supply(id))
    }

    fn retried_failures(&self) -> u64 {
        self.inner.retried.load(Ordering::Relaxed)
    }

    fn why_not(&self, id: ExpertId) -> Option<String> {
        let dropped: Vec<String> = self
            .inner
            .peers()
            .iter()
            .filter_map(|p| {
                let s = p.state();
                let why = s
                    .banned
                    .as_ref()
                    .filter(|_| s.announces(id) && !s.removed)?;
                Some(format!(
                    "peer {} held it but was dropped this session: {why}",
                    p.addr
                ))
            })
            .collect();
        (!dropped.is_empty()).then(|| dropped.join("; "))
    }

    fn load(&self, keys: &[ExpertId], priority: Priority, done: Completion) {
        for &key in keys {
            let inner = self.inner.clone();
            let done = done.clone();
            self.rt.spawn(async move {
                let r = inner.fetch(key, priority).await.map_err(|reason| {
                    stormo_engine::Error::Expert {
                        layer: key.layer as usize,
                        expert: key.expert as usize,
                        reason: format!("from peers: {reason}"),
                    }
                });
                done(key, r);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::path::Path;

    use stormo_engine::moe::ExpertProvider;
    use stormo_manifests::{manifest::MIN_CHUNK_SIZE, BuildOptions};

    use crate::serve::{self, ServeConfig, ServerHandle};

    /// Passes on its provider's records with byte `at` of each flipped: a peer whose files went
    /// bad after its manifest was made.
    #[derive(Debug)]
    struct FlipByte {
        inner: Arc<dyn ExpertProvider>,
        at: usize,
    }

    impl ExpertProvider for FlipByte {
        fn fetch(
            &self,
            layer: usize,
            experts: &[usize],
            out: &mut Vec<Arc<ExpertData>>,
        ) -> stormo_engine::Result<()> {
            let mut honest = Vec::new();
            self.inner.fetch(layer, experts, &mut honest)?;
            for d in honest {
                let lens: Vec<usize> = d.parts().map(<[u8]>::len).collect();
                let mut buf = HugeBuf::zeroed(lens.iter().sum()).expect("a record buffer");
                let mut at = 0;
                for p in d.parts() {
                    buf[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
                buf[self.at] ^= 1;
                out.push(Arc::new(ExpertData::from_lengths(Arc::new(buf), 0, lens)));
            }
            Ok(())
        }
    }

    /// Fails every read: a peer whose disk went away (it answers `internal`).
    #[derive(Debug)]
    struct Failing;

    impl ExpertProvider for Failing {
        fn fetch(
            &self,
            _layer: usize,
            _experts: &[usize],
            _out: &mut Vec<Arc<ExpertData>>,
        ) -> stormo_engine::Result<()> {
            Err(stormo_engine::Error::Input("the disk went away".into()))
        }
    }

    /// Reads honestly after `delay`, sending nothing meanwhile (a stopped or overloaded peer),
    /// and counts the reads begun.
    #[derive(Debug)]
    struct Late {
        inner: Arc<dyn ExpertProvider>,
        delay: Duration,
        begun: Arc<AtomicU64>,
    }

    impl ExpertProvider for Late {
        fn fetch(
            &self,
            layer: usize,
            experts: &[usize],
            out: &mut Vec<Arc<ExpertData>>,
        ) -> stormo_engine::Result<()> {
            self.begun.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
            self.inner.fetch(layer, experts, out)
        }
    }

    /// How one of a bench's servers answers.
    #[derive(Clone, Copy, Debug)]
    enum Serving {
        Honest,
        /// With byte `at` of every record flipped.
        Flip(usize),
        /// `internal`: every read fails.
        Failing,
        /// Honestly, after a read of this long.
        Late(Duration),
        /// Honestly, one request at a time, after a read of this long: `busy` to any other
        /// request meanwhile.
        Busy(Duration),
    }

    /// Servers of the tiny bf16 GPT-OSS fixture under a manifest of the smallest chunk size
    /// (each expert record is two chunks, the second one short), and a client tier over them.
    struct Bench {
        _dir: tempfile::TempDir,
        chunk: u64,
        id: ExpertId,
        /// Expert `id`'s record, as the manifest hashes it.
        record: Vec<u8>,
        tier: PeerTier,
        servers: Vec<ServerHandle>,
        /// Reads begun by its `Late` servers.
        begun: Arc<AtomicU64>,
        _server_rt: tokio::runtime::Runtime,
    }

    impl Drop for Bench {
        fn drop(&mut self) {
            self.tier.close();
            for s in &self.servers {
                s.close();
            }
        }
    }

    /// The client's timeouts of a bench: far longer than any of its tries takes.
    fn bench_config() -> PeerConfig {
        PeerConfig {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            hedge_min: Duration::from_secs(60),
            hedge_max: Duration::from_secs(60),
            // One record, one request: these tests are of single tries.
            stripe_min: u64::MAX,
        }
    }

    /// One server per entry of `serving`, answering as it says.
    fn bench(serving: &[Serving]) -> Bench {
        bench_with(serving, bench_config())
    }

    fn bench_with(serving: &[Serving], peer_cfg: PeerConfig) -> Bench {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gptoss-tiny-bf16");
        let dir = tempfile::tempdir().expect("tempdir");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.path().join(f)).expect("copying the fixture");
        }
        let opts = BuildOptions {
            chunk_size: MIN_CHUNK_SIZE,
            ..BuildOptions::default()
        };
        let m = stormo_manifests::build(dir.path(), &opts).expect("manifest");
        std::fs::write(dir.path().join("stormo-manifest.bin"), m.encode()).expect("manifest");
        let chunk = u64::from(MIN_CHUNK_SIZE);
        let entry = m.experts[0].clone();
        assert!(
            entry.len > chunk && entry.len < 2 * chunk,
            "a record of {} bytes is not two chunks with a short last one",
            entry.len
        );
        let files = stormo_engine::ModelFiles::open(dir.path()).expect("model files");
        let client = SecretKey::from_seed(&[70; 32]);
        let serve_cfg = |busy: bool| ServeConfig {
            admission: tls::Admission::Keys([*client.public().as_bytes()].into()),
            node_limit: if busy {
                1
            } else {
                ServeConfig::default().node_limit
            },
            ..ServeConfig::default()
        };
        let begun = Arc::new(AtomicU64::new(0));
        let server_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let mut record = Vec::new();
        let mut servers = Vec::new();
        let mut addrs = Vec::new();
        for (i, serving) in serving.iter().enumerate() {
            let h = serve::holdings(dir.path(), None, None, |files, _| {
                Ok(Arc::new(files.mapped_experts()?) as Arc<dyn ExpertProvider>)
            })
            .expect("holdings");
            if record.is_empty() {
                let mut out = Vec::new();
                h.experts
                    .fetch(
                        entry.id.layer as usize,
                        &[entry.id.expert as usize],
                        &mut out,
                    )
                    .expect("the record");
                record = out[0].parts().flatten().copied().collect();
                assert_eq!(Hash::of(&record), entry.hash);
            }
            let experts: Arc<dyn ExpertProvider> = match *serving {
                Serving::Honest => h.experts.clone(),
                Serving::Flip(at) => Arc::new(FlipByte {
                    inner: h.experts.clone(),
                    at,
                }),
                Serving::Failing => Arc::new(Failing),
                Serving::Late(delay) | Serving::Busy(delay) => Arc::new(Late {
                    inner: h.experts.clone(),
                    delay,
                    begun: begun.clone(),
                }),
            };
            let h = serve::Holdings { experts, ..h };
            let key = SecretKey::from_seed(&[71 + i as u8; 32]);
            let handle = server_rt
                .block_on(async {
                    serve::start(
                        &key,
                        "127.0.0.1:0".parse().expect("address"),
                        Arc::new(h),
                        serve_cfg(matches!(serving, Serving::Busy(_))),
                    )
                })
                .expect("server starts");
            addrs.push(PeerAddr {
                key: key.public(),
                addr: handle.local_addr(),
            });
            servers.push(handle);
        }
        let model = m.model_id();
        let tier = PeerTier::connect(
            &client,
            &addrs,
            Arc::new(m),
            model,
            files.layout.schemas.clone(),
            peer_cfg,
            None,
        )
        .expect("client tier");
        assert_eq!(
            tier.peer_addrs().iter().map(|p| p.key).collect::<Vec<_>>(),
            addrs.iter().map(|p| p.key).collect::<Vec<_>>(),
            "peers in the order given"
        );
        Bench {
            _dir: dir,
            chunk,
            id: entry.id,
            record,
            tier,
            servers,
            begun,
            _server_rt: server_rt,
        }
    }

    impl Bench {
        fn len(&self) -> u64 {
            self.record.len() as u64
        }

        /// One [`Inner::attempt`] at peer `i` from `prefix` (of the whole record), and the
        /// record it completed.
        fn attempt(&self, i: usize, prefix: &mut Prefix) -> Result<HugeBuf, AttemptError> {
            self.attempt_span(i, prefix, Duration::from_secs(10))?;
            Ok(prefix.take().into_record())
        }

        /// One [`Inner::attempt`] at peer `i` from `prefix` (of any span) within `timeout`.
        fn attempt_span(
            &self,
            i: usize,
            prefix: &mut Prefix,
            timeout: Duration,
        ) -> Result<(), AttemptError> {
            let inner = &self.tier.inner;
            let peer = inner.peers()[i].clone();
            let limit = TryLimit {
                timeout,
                extend_until: None,
            };
            self.tier.rt.block_on(inner.attempt(
                &peer,
                self.id,
                self.len(),
                prefix,
                Priority::Demand,
                limit,
                None,
            ))
        }

        /// One [`Inner::try_peer`] at peer `i` from `prefix` (of the whole record), counting
        /// into `tries`, and the record it completed.
        fn try_peer(
            &self,
            i: usize,
            prefix: Prefix,
            tries: &Tries,
        ) -> Result<HugeBuf, (String, Prefix)> {
            self.try_span(i, prefix, tries).map(Prefix::into_record)
        }

        /// One [`Inner::try_peer`] at peer `i` from `prefix` (of any span), counting into
        /// `tries`.
        fn try_span(&self, i: usize, prefix: Prefix, tries: &Tries) -> TryResult {
            let inner = &self.tier.inner;
            let peer = inner.peers()[i].clone();
            let limit = TryLimit {
                timeout: Duration::from_secs(10),
                extend_until: None,
            };
            self.tier.rt.block_on(inner.try_peer(
                i,
                InFlight(peer),
                self.id,
                self.len(),
                prefix,
                Priority::Demand,
                limit,
                tries,
                None,
            ))
        }

        /// Why peer `i`'s connection was closed (`None`: it is open, or there is none).
        fn closed_why(&self, i: usize) -> Option<quinn::ConnectionError> {
            let peer = self.tier.inner.peers()[i].clone();
            let link = self.tier.rt.block_on(peer.link.lock()).clone();
            link.and_then(|l| l.conn.close_reason())
        }

        /// A whole-record prefix with nothing verified.
        fn fresh(&self) -> Prefix {
            Prefix::whole(self.len())
        }
    }

    /// A prefix buffer of `len` bytes holding `bytes` at its start, all of them verified.
    fn prefix_of(bytes: &[u8], len: u64) -> Prefix {
        let mut b = HugeBuf::zeroed(len as usize).expect("buffer");
        b[..bytes.len()].copy_from_slice(bytes);
        Prefix {
            buffer: Some(Box::new(RecordBuf(b))),
            start: 0,
            end: len,
            verified: bytes.len() as u64,
        }
    }

    fn prefix_bytes(p: &mut Prefix) -> Vec<u8> {
        let n = p.len();
        p.buffer.as_mut().expect("a buffer").bytes_mut()[..n].to_vec()
    }

    /// The chunk check in a real fetch: an honest peer's record arrives whole; a corrupt chunk
    /// (the first, or the short last one) fails the try at that chunk, naming it, and what
    /// verified before it is kept; a try from a verified prefix asks only for the bytes
    /// after it and completes the record.
    #[test]
    fn a_corrupt_chunk_ends_the_try_at_the_verified_prefix_and_a_try_resumes_after_it() {
        let b = bench(&[
            Serving::Honest,
            Serving::Flip(5),
            Serving::Flip(MIN_CHUNK_SIZE as usize + 5),
        ]);
        let (chunk, len) = (b.chunk, b.len());
        let got = b.attempt(0, &mut b.fresh()).expect("the honest peer");
        assert!(got[..] == b.record[..], "the honest peer's record differs");

        for (peer, bad) in [(1, 0u64), (2, 1)] {
            let mut prefix = b.fresh();
            match b.attempt(peer, &mut prefix) {
                Err(AttemptError::Fetch(FetchError::BadChunk { index, offset, .. }, _)) => {
                    assert_eq!((index, offset), (bad, bad * chunk));
                }
                other => panic!("chunk {bad} corrupt: {other:?}"),
            }
            assert_eq!(prefix.verified, bad * chunk, "chunk {bad} corrupt");
            assert!(prefix.buffer.is_some(), "the buffer is kept");
            assert!(prefix_bytes(&mut prefix) == b.record[..(bad * chunk) as usize]);
        }

        // A try from a prefix: the bytes after it complete the record.
        let mut prefix = b.fresh();
        assert!(b.attempt(2, &mut prefix).is_err());
        assert_eq!(prefix.verified, chunk);
        let got = b
            .attempt(0, &mut prefix)
            .expect("resumed at the honest peer");
        assert!(got[..] == b.record[..], "the resumed record differs");
        // Only those bytes are asked for: a prefix marked verified is not fetched again.
        let marker = vec![0xa5; chunk as usize];
        let mut prefix = prefix_of(&marker, len);
        let got = b.attempt(0, &mut prefix).expect("resumed");
        assert!(
            got[..chunk as usize] == marker[..],
            "the prefix was fetched again"
        );
        assert!(got[chunk as usize..] == b.record[chunk as usize..]);
        // A prefix without a buffer starts over, whatever it says.
        let mut prefix = Prefix {
            buffer: None,
            start: 0,
            end: len,
            verified: chunk,
        };
        let got = b.attempt(0, &mut prefix).expect("from scratch");
        assert!(got[..] == b.record[..]);
    }

    /// What a try does with bytes that fail: the peer is dropped for the session (not merely
    /// backed off), the failure is counted once, and the verified prefix is handed back. A good
    /// try counts no failure and feeds the peer's throughput; a try ending because the tier
    /// closes is not the peer's failure.
    #[test]
    fn a_peer_that_sends_a_bad_chunk_is_dropped_and_its_verified_prefix_kept() {
        let b = bench(&[Serving::Honest, Serving::Flip(MIN_CHUNK_SIZE as usize + 5)]);
        let peers = b.tier.inner.peers();
        let tries = Tries::default();
        let got = b.try_peer(0, b.fresh(), &tries).expect("the honest peer");
        assert!(got[..] == b.record[..]);
        assert_eq!(tries.failed.load(Ordering::Relaxed), 0);
        assert!(
            peers[0].state().rate.is_some(),
            "a success feeds the throughput"
        );
        let len = b.len();
        assert_eq!(peers[0].state().bytes, len, "verified bytes credited");
        assert!(peers[0].state().usable());

        let (why, mut prefix) = b
            .try_peer(1, b.fresh(), &tries)
            .expect_err("a corrupt chunk");
        assert!(
            why.contains(&peers[1].addr.to_string()) && why.contains("chunk 1"),
            "{why}"
        );
        assert_eq!(prefix.len() as u64, b.chunk);
        assert!(prefix_bytes(&mut prefix) == b.record[..b.chunk as usize]);
        assert_eq!(tries.failed.load(Ordering::Relaxed), 1);
        assert_eq!(
            peers[1].state().bytes,
            b.chunk,
            "its verified chunk credited"
        );
        assert!(
            peers[1].state().banned.is_some(),
            "a peer that sent bad bytes is not dropped"
        );
        assert!(!peers[1].state().usable());
        assert!(peers[0].state().banned.is_none());

        // The verified prefix completes at the honest peer.
        let got = b.try_peer(0, prefix, &tries).expect("resumed");
        assert!(got[..] == b.record[..]);
        assert_eq!(tries.failed.load(Ordering::Relaxed), 1);
        assert_eq!(
            peers[0].state().bytes,
            2 * len - b.chunk,
            "only the bytes after the prefix credited"
        );

        b.tier.close();
        let (why, _) = b
            .try_peer(0, b.fresh(), &tries)
            .expect_err("the tier is closed");
        assert_eq!(why, "the network tier is closed");
        assert_eq!(
            tries.failed.load(Ordering::Relaxed),
            1,
            "a try ended by closing counted as a failure"
        );
    }

    /// A stripe (a span of the record, in its part of a split buffer) is asked for exactly:
    /// the first, from 0 to before the record's end, and the last, from a chunk boundary to the
    /// end, each verified and credited to its peer at its own length. A stripe whose buffer
    /// was lost fails its try: it is not fetched into a buffer of the whole record.
    #[test]
    fn a_stripe_is_fetched_into_its_part_of_the_record() {
        let b = bench(&[Serving::Honest]);
        let (chunk, len) = (b.chunk, b.len());
        let peers = b.tier.inner.peers();
        let tries = Tries::default();
        let parts = HugeBuf::zeroed(len as usize)
            .expect("a record buffer")
            .split(&[chunk as usize])
            .expect("two stripes");
        for (part, (start, end)) in parts.into_iter().zip([(0, chunk), (chunk, len)]) {
            let prefix = Prefix {
                buffer: Some(Box::new(StripeBuf {
                    part,
                    offset: start,
                })),
                start,
                end,
                verified: start,
            };
            let before = peers[0].state().bytes;
            let got = b
                .try_span(0, prefix, &tries)
                .unwrap_or_else(|(e, _)| panic!("stripe {start}..{end}: {e}"))
                .into_part();
            assert!(
                got[..] == b.record[start as usize..end as usize],
                "stripe {start}..{end} differs"
            );
            assert_eq!(peers[0].state().bytes - before, end - start);
        }
        assert_eq!(tries.failed.load(Ordering::Relaxed), 0);

        for (start, end) in [(0, chunk), (chunk, len)] {
            let mut prefix = Prefix {
                buffer: None,
                start,
                end,
                verified: start,
            };
            match b.attempt_span(0, &mut prefix, Duration::from_secs(10)) {
                Err(AttemptError::Other(e)) => {
                    assert!(e.to_string().contains("was lost"), "{e:#}");
                }
                other => panic!("stripe {start}..{end} without its buffer: {other:?}"),
            }
            assert!(prefix.buffer.is_none());
        }
    }

    /// A peer that answers `busy` is loaded, not failing: its try is worth another round and
    /// the peer is not marked. Any other error it answers is its failure: marked (backed off),
    /// with no other round for it.
    #[test]
    fn a_busy_answer_is_load_and_another_error_a_failure() {
        let b = bench(&[Serving::Busy(Duration::from_secs(3)), Serving::Failing]);
        let peers = b.tier.inner.peers();
        for (i, busy) in [(0, true), (1, false)] {
            let tries = Tries::default();
            let (why, prefix) = std::thread::scope(|s| {
                if busy {
                    // Another request holds the server's one slot.
                    s.spawn(|| b.attempt_span(0, &mut b.fresh(), Duration::from_secs(10)));
                    let until = Instant::now() + Duration::from_secs(30);
                    while b.begun.load(Ordering::SeqCst) == 0 {
                        assert!(Instant::now() < until, "the first request never began");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                b.try_span(i, b.fresh(), &tries).expect_err("no record")
            });
            let code = if busy { "busy" } else { "internal" };
            assert!(why.contains(&format!("peer answered {code}")), "{why}");
            assert_eq!(prefix.len(), 0);
            assert_eq!(tries.failed.load(Ordering::Relaxed), 1);
            assert_eq!(tries.retry.load(Ordering::Relaxed), busy, "{why}");
            assert_eq!(tries.busy.load(Ordering::Relaxed), busy, "{why}");
            let s = peers[i].state();
            assert_eq!(s.failures, u32::from(!busy), "{why}");
            assert_eq!(s.avoid_until.is_some(), !busy, "{why}");
            assert!(s.usable() && s.lost.is_none(), "{why}");
        }
    }

    /// A peer whose stream is silent for the silence deadline (stopped, killed) is presumed
    /// gone: its connection is closed, so that the next try dials again, and it is noted as
    /// lost. One that sent nothing before the request's own deadline, when that is the
    /// shorter, timed out: its connection stays, and it is not lost.
    #[test]
    fn silence_closes_the_connection_and_a_timeout_does_not() {
        let cfg = PeerConfig {
            idle_timeout: Duration::from_secs(1),
            ..bench_config()
        };
        let b = bench_with(&[Serving::Late(Duration::from_secs(4))], cfg);
        let peer = b.tier.inner.peers()[0].clone();
        let mut prefix = b.fresh();
        match b.attempt_span(0, &mut prefix, Duration::from_millis(100)) {
            Err(AttemptError::Fetch(FetchError::TimedOut { .. }, false)) => {}
            other => panic!("a silent peer past a 100 ms deadline: {other:?}"),
        }
        assert!(b.closed_why(0).is_none(), "a timeout closed the connection");
        assert!(peer.state().lost.is_none());

        let mut prefix = b.fresh();
        match b.attempt_span(0, &mut prefix, Duration::from_secs(10)) {
            Err(AttemptError::Lost(e))
                if matches!(*e, AttemptError::Fetch(FetchError::Stalled { .. }, false)) => {}
            other => panic!("a peer silent for 1 s: {other:?}"),
        }
        assert!(
            matches!(b.closed_why(0), Some(quinn::ConnectionError::LocallyClosed)),
            "the silent peer's connection is still open"
        );
        assert!(peer.state().lost.is_some());
    }

    /// A connection the peer closes while a request waits on it is lost: the try says so, and
    /// the peer is noted as lost (to be dialled again), whatever error the request saw.
    #[test]
    fn a_connection_closed_by_the_peer_mid_request_is_lost() {
        let b = bench(&[Serving::Late(Duration::from_secs(2))]);
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                let until = Instant::now() + Duration::from_secs(30);
                while b.begun.load(Ordering::SeqCst) == 0 {
                    assert!(
                        Instant::now() < until,
                        "the request never reached the server"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                b.servers[0].close();
            });
            b.attempt_span(0, &mut b.fresh(), Duration::from_secs(10))
        });
        match got {
            Err(AttemptError::Lost(_)) => {}
            other => panic!("the server closed mid-request: {other:?}"),
        }
        assert!(matches!(
            b.closed_why(0),
            Some(quinn::ConnectionError::ApplicationClosed(_))
        ));
        assert!(b.tier.inner.peers()[0].state().lost.is_some());
    }

    /// What one load keeps between tries: a request hands back its buffer with the verified
    /// end, or nothing without a buffer; a copy for a racing try holds the same verified bytes.
    #[test]
    fn prefixes_keep_exactly_their_verified_bytes() {
        let mut kept = Prefix::whole(16);
        kept.keep(None, 7);
        assert_eq!((kept.len(), kept.buffer.is_none()), (0, true));
        let mut from = prefix_of(&[1, 2, 3, 4, 5], 16);
        let buffer = from.buffer.take();
        let mut kept = Prefix::whole(16);
        kept.keep(buffer, 3);
        assert_eq!(kept.len(), 3);
        assert_eq!(prefix_bytes(&mut kept), [1, 2, 3]);

        let mut copy = kept.copy(16).expect("copy");
        assert_eq!(copy.len(), 3);
        assert_eq!(prefix_bytes(&mut copy), [1, 2, 3]);
        let whole = copy.buffer.as_mut().expect("a buffer").bytes_mut().to_vec();
        assert_eq!(whole.len(), 16);
        assert_eq!(&whole[3..], &[0; 13], "bytes past the prefix copied");
        assert_eq!(prefix_bytes(&mut kept), [1, 2, 3], "the original changed");

        let mut none = Prefix {
            buffer: None,
            start: 0,
            end: 16,
            verified: 9,
        };
        let copy = none.copy(16).expect("copy");
        assert_eq!(copy.len(), 0, "a prefix without bytes copied as verified");
        assert!(copy.buffer.is_some());
    }

    #[test]
    fn peer_timeout_sets_each_deadline_it_documents() {
        // Shorter than every default: each deadline is the given one.
        let t = Duration::from_secs(2);
        assert!(t < crate::CONNECT_TIMEOUT && t < PeerConfig::default().idle_timeout);
        let short = PeerConfig::with_timeout(t);
        assert_eq!(short.connect_timeout, t);
        assert_eq!(short.request_timeout, t);
        assert_eq!(short.idle_timeout, t);
        // Longer than every default: connection and silence keep their bounds.
        let t = Duration::from_secs(60);
        let long = PeerConfig::with_timeout(t);
        assert_eq!(long.connect_timeout, crate::CONNECT_TIMEOUT);
        assert_eq!(long.request_timeout, t);
        assert_eq!(long.idle_timeout, Duration::from_secs(5));
        // The rest are the defaults.
        let d = PeerConfig::default();
        assert_eq!(
            (long.hedge_min, long.hedge_max, long.stripe_min),
            (d.hedge_min, d.hedge_max, d.stripe_min)
        );
    }

    #[test]
    fn long_error_lists_keep_their_ends() {
        let few: Vec<String> = (0..7).map(|i| format!("e{i}")).collect();
        assert_eq!(summarize(&few), "e0; e1; e2; e3; e4; e5; e6");
        let many: Vec<String> = (0..40).map(|i| format!("e{i}")).collect();
        assert_eq!(
            summarize(&many),
            "e0; e1; e2; ... 34 more ...; e37; e38; e39"
        );
    }
}
