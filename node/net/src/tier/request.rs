//! The request client: one request to a peer on a stream of its own, driven to its end
//! through the wire's sans-IO [`Requests`] ([`run_request`]), straight into the buffer the
//! kernels will read ([`Prefix`]: the verified prefix of a record or of one stripe, in its
//! buffer), with every chunk checked against the manifest as it arrives ([`ChunkCheck`]).
//! Also the whole requests of a pull: a manifest ([`fetch_manifest`], [`fetch_manifest_on`] from
//! a node's endpoint) and file ranges over one connection ([`PeerLink`]).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use stormo_engine::huge::{HugeBuf, HugePart};
use stormo_engine::tiers::ExpertId;
use stormo_manifests::{Hash, Manifest, SecretKey};
use stormo_wire::{
    ByteRange, ChunkVerifier, Completed, Event, Fetch, FetchError, Hello, NodeId, RecordBuffer,
    RequestsConfig, MAX_FRAME_LEN, MAX_MANIFEST_LEN,
};
use tokio::sync::{watch, Semaphore};

use super::link::{client_endpoint, connect, lock, LinkRequests, Liveness};
use super::PeerConfig;
use crate::load::TryError;
use crate::{tls, FramedRecv, PeerAddr, ReadError};

/// How long one try may take: `timeout` from when its request is sent, moved on while its
/// chunks keep verifying up to `extend_until` when that is set (see
/// [`Fetch::extend_on_progress`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TryLimit {
    pub(crate) timeout: Duration,
    pub(crate) extend_until: Option<Instant>,
}

/// How a load's driver steers one running try: `cancel` set makes it give up, keeping what
/// verified ([`TryError::Moved`]); `progress` hears the end of its verified bytes as chunks
/// verify.
pub(crate) struct TryCtl<'a> {
    pub(crate) cancel: watch::Receiver<bool>,
    pub(crate) progress: Option<&'a (dyn Fn(u64) + Send + Sync)>,
}

/// A record's buffer (huge pages, the record's length) as the wire writes into it.
#[derive(Debug)]
pub(crate) struct RecordBuf(pub(crate) HugeBuf);

impl RecordBuffer for RecordBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// One stripe's part of a record's buffer (see [`HugeBuf::split`]), as the wire writes into
/// it: byte `i` is byte `offset + i` of the record.
#[derive(Debug)]
pub(crate) struct StripeBuf {
    pub(crate) part: HugePart,
    pub(crate) offset: u64,
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
pub(crate) struct Prefix {
    pub(crate) buffer: Option<Box<dyn RecordBuffer>>,
    /// The span: bytes `start..end` of the record.
    pub(crate) start: u64,
    pub(crate) end: u64,
    /// The end of the verified bytes, from `start`.
    pub(crate) verified: u64,
}

impl Prefix {
    /// The whole record of `len` bytes, nothing verified or allocated yet.
    pub(crate) fn whole(len: u64) -> Self {
        Self {
            end: len,
            ..Self::default()
        }
    }

    /// Takes the verified prefix and its buffer, leaving the same span with neither.
    #[cfg(test)]
    pub(crate) fn take(&mut self) -> Self {
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
    pub(crate) fn len(&self) -> usize {
        self.verified.saturating_sub(self.start) as usize
    }

    /// What a request hands back: `buffer` with its bytes up to `verified_end` verified
    /// (without a buffer, nothing is).
    pub(crate) fn keep(&mut self, buffer: Option<Box<dyn RecordBuffer>>, verified_end: u64) {
        self.verified = if buffer.is_some() {
            verified_end
        } else {
            self.start
        };
        self.buffer = buffer;
    }

    /// A copy in a buffer of its own (for a second try racing the one that holds this; a
    /// whole record's only).
    pub(crate) fn copy(&mut self, len: u64) -> Result<Self, String> {
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
    pub(crate) fn into_record(self) -> HugeBuf {
        let b: Box<dyn std::any::Any> = self.buffer.expect("a verified span has its buffer");
        b.downcast::<RecordBuf>()
            .expect("a whole record's buffer is a RecordBuf")
            .0
    }

    /// A stripe's part of the record's buffer, once verified.
    pub(crate) fn into_part(self) -> HugePart {
        let b: Box<dyn std::any::Any> = self.buffer.expect("a verified span has its buffer");
        b.downcast::<StripeBuf>()
            .expect("a stripe's buffer is a StripeBuf")
            .part
    }
}

/// A verifier of one expert's chunks against the manifest.
pub(crate) struct ChunkCheck {
    pub(crate) manifest: Arc<Manifest>,
    pub(crate) id: ExpertId,
    pub(crate) len: u64,
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

/// Starts `fetch` among the requests of `conn`, sends it on a new stream and drives it to
/// its end. Data payloads go from the chunks quinn received to where the request keeps them
/// (the caller's buffer with [`Fetch::into_buffer`]) without another copy. On failure, `kept`
/// gets back the caller's buffer and the end of its verified prefix. With `ctl`, the request
/// gives up ([`TryError::Moved`]) when told to, and reports its verified end as chunks verify
/// if asked to. With `live`, a try that fails while
/// the whole connection has been silent for [`SILENT_CONNECTION`] did not hear the peer,
/// whatever arrived before that.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_request(
    conn: &quinn::Connection,
    reqs: &Mutex<LinkRequests>,
    fetch: Fetch,
    priority: Option<i32>,
    idle: Duration,
    live: Option<&Liveness>,
    kept: &mut Prefix,
    ctl: Option<&mut TryCtl<'_>>,
) -> Result<Completed, TryError> {
    let (mut cancel, progress) = match ctl {
        Some(c) => (Some(&mut c.cancel), c.progress),
        None => (None, None),
    };
    let mut fetch = fetch;
    let rx_before = conn.stats().frame_rx.stream;
    // A peer that died or stopped grants no new stream: that wait is silence too, bounded
    // by the same deadline as silence within an answer.
    let (mut send, recv) = match tokio::time::timeout(idle, conn.open_bi()).await {
        // Closed by the peer, the network, or this node (a silent link is closed so that the
        // next try reconnects): lost either way, and worth another round.
        Ok(r) => r.map_err(|e| {
            kept.buffer = fetch.take_buffer();
            TryError::Fetch {
                error: FetchError::ConnectionLost {
                    reason: format!("opening a stream: {e}"),
                },
                heard: false,
            }
        })?,
        Err(_) => {
            kept.buffer = fetch.take_buffer();
            return Err(TryError::Fetch {
                error: FetchError::Stalled { idle, received: 0 },
                heard: false,
            });
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
            .map_err(|e| TryError::Other(e.to_string()))?;
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
        TryError::Other(why)
    };
    // Told to give up before the request went out (waiting for the link or a slot).
    if cancel.as_ref().is_some_and(|c| *c.borrow()) {
        give_up(String::new(), kept);
        return Err(TryError::Moved);
    }
    for m in &out {
        if let Err(e) = crate::write_message(&mut send, m).await {
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
                        Err(TryError::Fetch { error, heard })
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
                    let (r, verified) = {
                        let mut g = lock(reqs);
                        let now = Instant::now();
                        let r = pieces.drain(..).try_for_each(|p| p.feed(&mut g.req, now));
                        (r, g.req.verified_end(id))
                    };
                    if let (Some(p), Some(v)) = (progress, verified) {
                        p(v);
                    }
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
            _ = cancelled(&mut cancel) => {
                give_up(String::new(), kept);
                return Err(TryError::Moved);
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

/// Resolves when `cancel` says to give up (never without one).
async fn cancelled(cancel: &mut Option<&mut watch::Receiver<bool>>) {
    match cancel {
        Some(rx) => {
            if rx.wait_for(|c| *c).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
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

/// Fetches a manifest from `peer` and returns its bytes, unchecked (check them against the
/// trusted key or the pinned id before use). `model` is the id to ask for; `None` asks for
/// the peer's only model. Dials from an endpoint of its own, closed when done: for a caller
/// with no endpoint (a node dials from its own, [`fetch_manifest_on`]).
pub async fn fetch_manifest(
    secret: &SecretKey,
    peer: &PeerAddr,
    model: Option<Hash>,
    cfg: PeerConfig,
) -> anyhow::Result<(Hash, Vec<u8>)> {
    let endpoint = client_endpoint(std::slice::from_ref(peer))?;
    let out = fetch_manifest_on(&endpoint, secret, peer, model, cfg).await;
    endpoint.close(0u32.into(), b"done");
    out
}

/// [`fetch_manifest`] dialled from `endpoint` (a node's own, which stays open).
pub async fn fetch_manifest_on(
    endpoint: &quinn::Endpoint,
    secret: &SecretKey,
    peer: &PeerAddr,
    model: Option<Hash>,
    cfg: PeerConfig,
) -> anyhow::Result<(Hash, Vec<u8>)> {
    let client = tls::client_config(secret, &peer.key)?;
    let me = NodeId(*secret.public().as_bytes());
    let (conn, hello, _, control) =
        connect(endpoint, client, peer, me, None, false, cfg.connect_timeout)
            .await
            .with_context(|| format!("peer {peer}"))?;
    control.drain();
    let model = match (model, hello.models.as_slice()) {
        (Some(m), models) if models.contains(&m) => Ok(m),
        (Some(m), _) => Err(anyhow::anyhow!(
            "peer {peer} does not serve model {}",
            m.short()
        )),
        (None, [m]) => Ok(*m),
        (None, []) => Err(anyhow::anyhow!("peer {peer} serves no model")),
        (None, _) => Err(anyhow::anyhow!(
            "peer {peer} serves several models; name one with --model-id"
        )),
    };
    let model = match model {
        Ok(m) => m,
        Err(e) => {
            conn.close(0u32.into(), b"done");
            return Err(e);
        }
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
    conn.close(0u32.into(), b"done");
    match out {
        Ok(bytes) => Ok((model, bytes)),
        Err(e) => Err(anyhow::anyhow!("peer {peer}: fetching the manifest: {e}")),
    }
}

/// One connection to one peer for whole requests (a manifest, file ranges), several at once:
/// what `stormo pull` fetches through. Every request is bounded by the timeouts of the
/// [`PeerConfig`] it was opened with.
pub struct PeerLink {
    /// The endpoint the link dialled from, when it is its own (closed with the link).
    own_endpoint: Option<quinn::Endpoint>,
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
    /// `peer`'s key): a swarm member's, which presents its membership certificate. Dials from
    /// an endpoint of its own, closed with the link ([`Self::connect_on`] dials from a node's).
    pub async fn connect_with(
        secret: &SecretKey,
        client: quinn::ClientConfig,
        peer: &PeerAddr,
        cfg: PeerConfig,
    ) -> anyhow::Result<Self> {
        let endpoint = client_endpoint(std::slice::from_ref(peer))?;
        match Self::connect_on(&endpoint, secret, client, peer, cfg).await {
            Ok(mut link) => {
                link.own_endpoint = Some(endpoint);
                Ok(link)
            }
            Err(e) => {
                endpoint.close(0u32.into(), b"done");
                Err(e)
            }
        }
    }

    /// [`Self::connect_with`] dialled from `endpoint` (a node's own: closing the link leaves
    /// it open).
    pub async fn connect_on(
        endpoint: &quinn::Endpoint,
        secret: &SecretKey,
        client: quinn::ClientConfig,
        peer: &PeerAddr,
        cfg: PeerConfig,
    ) -> anyhow::Result<Self> {
        let me = NodeId(*secret.public().as_bytes());
        let (conn, hello, _, control) =
            connect(endpoint, client, peer, me, None, false, cfg.connect_timeout)
                .await
                .with_context(|| format!("peer {peer}"))?;
        control.drain();
        let limit = hello.limits.max_concurrent_requests.clamp(1, 64);
        Ok(Self {
            own_endpoint: None,
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

    /// Closes the connection (and the link's own endpoint, when it has one).
    pub fn close(&self) {
        self.conn.close(0u32.into(), b"done");
        if let Some(e) = &self.own_endpoint {
            e.close(0u32.into(), b"done");
        }
    }
}
