//! The requester's side: [`Requests`] tracks the outstanding requests to one peer.
//!
//! It owns request ids, deadlines, reassembly of streamed [`crate::Data`] into one contiguous record,
//! the in-order and bounds rules, and chunk verification through a caller's [`ChunkVerifier`].
//! Data arrives whole ([`Requests::handle_message`]) or in the pieces of
//! [`crate::FrameDecoder::decode_streaming`] ([`Requests::handle_piece`]), and lands in a
//! buffer `Requests` grows, or straight at its offset in a buffer the caller allocated for the
//! whole record ([`Fetch::into_buffer`]): the bytes are then copied once after the transport,
//! and a retry can resume writing after the verified prefix in the same buffer.
//! It does not own sockets, streams or clocks: the caller passes messages in
//! ([`Requests::handle_message`]) with the current time, drains messages to send
//! ([`Requests::poll_transmit`]) and events ([`Requests::poll_event`]), and wakes it at
//! [`Requests::poll_timeout`] to call [`Requests::handle_timeout`].
//!
//! The rules a response must follow (any breach fails that request at once, names the breach,
//! and sends the peer a [`Cancel`]):
//! - `Data` arrives in order: each frame starts exactly where the previous one ended, the first
//!   at the start of the requested range;
//! - no byte lies past the end of the requested range (or past the caller's limit for a
//!   manifest);
//! - with a verifier, every verification chunk is checked as soon as its last byte arrives;
//! - an exact-length request completes as soon as its last byte arrives and verifies (a later
//!   `End` is ignored); `End` before that is a truncation;
//! - the request completes or fails before its overall deadline (which progress moves on for
//!   a request started with [`Fetch::extend_on_progress`]), and no more than the idle timeout
//!   passes between frames.

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};
use std::error::Error as StdError;
use std::fmt;
use std::time::{Duration, Instant};

use stormo_ids::{ExpertId, Hash};

use crate::frame::Piece;
use crate::message::{
    check_file_name, ByteRange, Cancel, End, ErrorCode, ErrorMessage, Get, GetFile, GetManifest,
    Limits, Message, Priority, RequestId, MAX_FILE_RANGE_LEN,
};

/// Verifies a resource chunk by chunk as it streams in. The manifests crate implements this
/// ("is this chunk exactly the manifest's?").
///
/// Chunks tile the whole resource from offset 0: chunk `k` covers bytes
/// `[k * chunk_len, min((k + 1) * chunk_len, resource_len))`. A fetch with a verifier must ask
/// for a range that starts on a chunk boundary and ends on one (or at the resource's end).
pub trait ChunkVerifier: Send {
    /// Length of a verification chunk in bytes (not zero).
    fn chunk_len(&self) -> u64;
    /// Length of the whole resource in bytes.
    fn resource_len(&self) -> u64;
    /// Checks chunk `index`, whose bytes are `bytes`. An `Err` fails the request at once with
    /// [`FetchError::BadChunk`] carrying it as the reason.
    fn verify_chunk(
        &mut self,
        index: u64,
        bytes: &[u8],
    ) -> Result<(), Box<dyn StdError + Send + Sync>>;
}

/// A buffer the caller allocated for a whole resource (e.g. on huge pages, where the record
/// is used from): [`crate::Data`] bytes are written at their offset in the resource, chunks are
/// verified in place, and the buffer comes back in [`Completed::buffer`] or
/// [`Failed::buffer`] (downcast it to the caller's type through [`Any`]).
///
/// A buffer may hold only a window of the resource (one stripe of a record fetched from
/// several peers at once, each window written by its own request): byte `i` of
/// [`RecordBuffer::bytes_mut`] is then byte `offset() + i` of the resource, and a request into
/// it must lie within the window.
pub trait RecordBuffer: Any + Send + fmt::Debug {
    /// The buffer's bytes; byte `i` is byte `offset() + i` of the resource.
    fn bytes_mut(&mut self) -> &mut [u8];

    /// Where the buffer's first byte lies in the resource (0: the buffer starts with it).
    fn offset(&self) -> u64 {
        0
    }
}

impl RecordBuffer for Vec<u8> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// What a request is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Resource {
    /// Bytes of one expert.
    Expert {
        /// The model id.
        model: Hash,
        /// The expert.
        expert: ExpertId,
    },
    /// A model's manifest.
    Manifest {
        /// The model id.
        model: Hash,
    },
    /// A file of the model folder, by its manifest name.
    File {
        /// The model id.
        model: Hash,
        /// The file's name.
        name: String,
    },
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Expert { model, expert } => write!(f, "expert {expert} of {}", model.short()),
            Self::Manifest { model } => write!(f, "manifest of {}", model.short()),
            Self::File { model, name } => write!(f, "file {name:?} of {}", model.short()),
        }
    }
}

/// A request to start, built with [`Fetch::expert`] or [`Fetch::manifest`].
pub struct Fetch {
    resource: Resource,
    /// Expert: the expert's length. Manifest: the most bytes accepted.
    len: u64,
    range: Option<ByteRange>,
    priority: Priority,
    timeout: Option<Duration>,
    extend_on_progress: Option<Duration>,
    verifier: Option<Box<dyn ChunkVerifier>>,
    into: Option<Box<dyn RecordBuffer>>,
}

impl fmt::Debug for Fetch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fetch")
            .field("resource", &self.resource)
            .field("len", &self.len)
            .field("range", &self.range)
            .field("priority", &self.priority)
            .field("timeout", &self.timeout)
            .field("extend_on_progress", &self.extend_on_progress)
            .field("verified", &self.verifier.is_some())
            .field("into_buffer", &self.into.is_some())
            .finish()
    }
}

impl Fetch {
    /// The whole of `expert`, which is `expert_len` bytes long (from the manifest).
    pub fn expert(model: Hash, expert: ExpertId, expert_len: u64) -> Self {
        Self {
            resource: Resource::Expert { model, expert },
            len: expert_len,
            range: None,
            priority: Priority::Now,
            timeout: None,
            extend_on_progress: None,
            verifier: None,
            into: None,
        }
    }

    /// The manifest of `model`, accepting at most `max_len` bytes (e.g.
    /// [`crate::MAX_MANIFEST_LEN`]). Verify it as a whole on completion (model id or
    /// signature): it has no chunk hashes to check against while it streams.
    pub fn manifest(model: Hash, max_len: u64) -> Self {
        Self {
            resource: Resource::Manifest { model },
            len: max_len,
            range: None,
            priority: Priority::Now,
            timeout: None,
            extend_on_progress: None,
            verifier: None,
            into: None,
        }
    }

    /// Bytes `range` of the file `name` of the model folder (at most
    /// [`crate::MAX_FILE_RANGE_LEN`] of them). No chunk verifier applies: check what arrives
    /// against the manifest's hashes of the tensors or files it holds.
    pub fn file(model: Hash, name: impl Into<String>, range: ByteRange) -> Self {
        Self {
            resource: Resource::File {
                model,
                name: name.into(),
            },
            len: range.end().unwrap_or(u64::MAX),
            range: Some(range),
            priority: Priority::Now,
            timeout: None,
            extend_on_progress: None,
            verifier: None,
            into: None,
        }
    }

    /// Only this byte range of the expert (to resume from another peer, or to split a fetch).
    pub fn range(mut self, range: ByteRange) -> Self {
        self.range = Some(range);
        self
    }

    /// The priority sent to the peer (default [`Priority::Now`]).
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// The overall deadline of this request, instead of [`RequestsConfig::timeout`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// At its deadline, a request that made progress since it started or since its deadline
    /// was last moved (more chunks verified; more bytes received when there is no verifier)
    /// gets another timeout instead of failing, so only one that stops advancing for a whole
    /// timeout times out; never later than `max_total` after its start, though, or its first
    /// deadline if that is later. (The idle timeout between frames applies as always.)
    pub fn extend_on_progress(mut self, max_total: Duration) -> Self {
        self.extend_on_progress = Some(max_total);
        self
    }

    /// Checks every chunk with `verifier` as it arrives (experts only).
    pub fn verifier(mut self, verifier: Box<dyn ChunkVerifier>) -> Self {
        self.verifier = Some(verifier);
        self
    }

    /// Writes the answer into `buffer` at its offsets in the resource instead of a buffer of
    /// its own (experts and file ranges: requests of a known length). `buffer` must cover the
    /// requested range (from [`RecordBuffer::offset`] at or before its start to at least its
    /// end); bytes outside the range (a verified prefix from an earlier try) are left as they
    /// are.
    pub fn into_buffer(mut self, buffer: Box<dyn RecordBuffer>) -> Self {
        self.into = Some(buffer);
        self
    }

    /// Takes back the buffer given to [`Fetch::into_buffer`] (a request that is not sent after
    /// all).
    pub fn take_buffer(&mut self) -> Option<Box<dyn RecordBuffer>> {
        self.into.take()
    }
}

/// Settings of a [`Requests`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestsConfig {
    /// The default overall deadline of a request, from [`Requests::start`].
    pub timeout: Duration,
    /// The longest wait for the first frame of an answer or between two frames.
    pub idle_timeout: Duration,
    /// The most requests outstanding at once, whatever the peer allows.
    pub max_outstanding: u32,
}

impl Default for RequestsConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(5),
            max_outstanding: 64,
        }
    }
}

/// Why a request could not be started. Nothing was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// As many requests are outstanding as this side or the peer allows.
    #[error("{outstanding} requests outstanding, at the limit of {limit}")]
    AtCapacity {
        /// Requests outstanding.
        outstanding: usize,
        /// The limit in force.
        limit: u32,
    },
    /// The range is empty or lies outside the expert.
    #[error("range {offset}+{len} is empty or outside the expert's {expert_len} bytes")]
    BadRange {
        /// Range start.
        offset: u64,
        /// Range length.
        len: u64,
        /// The expert's length.
        expert_len: u64,
    },
    /// The expert's length is zero.
    #[error("an expert of length 0 cannot be fetched")]
    EmptyExpert,
    /// The range is too large to hold in memory here.
    #[error("cannot reserve {len} bytes for the answer")]
    TooLarge {
        /// Bytes asked for.
        len: u64,
    },
    /// The verifier does not fit the request.
    #[error("verifier does not fit the request: {0}")]
    Verifier(String),
    /// The caller's buffer ([`Fetch::into_buffer`]) does not fit the request.
    #[error("buffer does not fit the request: {0}")]
    Buffer(String),
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The peer answered with an error.
    #[error("peer answered {code}: {message}")]
    Remote {
        /// The peer's code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// The overall deadline passed.
    #[error("no complete answer within {after:?} ({received} bytes received)")]
    TimedOut {
        /// How long after its start the request timed out (its timeout, or more when
        /// [`Fetch::extend_on_progress`] moved the deadline).
        after: Duration,
        /// Bytes received so far.
        received: u64,
    },
    /// No frame arrived for the idle timeout.
    #[error("peer silent for {idle:?} ({received} bytes received)")]
    Stalled {
        /// The idle timeout.
        idle: Duration,
        /// Bytes received so far.
        received: u64,
    },
    /// Data did not start where the previous data ended.
    #[error("data out of order: expected offset {expected}, got {got}")]
    OutOfOrder {
        /// The next offset expected.
        expected: u64,
        /// The offset received.
        got: u64,
    },
    /// Data reached past the end of the requested range (or the manifest limit).
    #[error("data {offset}+{len} reaches past the end of the request at {end}")]
    OutOfBounds {
        /// The frame's offset.
        offset: u64,
        /// The frame's length.
        len: u64,
        /// The end of the requested range.
        end: u64,
    },
    /// The peer said `End` before sending every byte.
    #[error("peer ended after {received} of {expected} bytes")]
    Truncated {
        /// Bytes received.
        received: u64,
        /// Bytes requested.
        expected: u64,
    },
    /// A chunk failed verification.
    #[error("chunk {index} (offset {offset}) failed verification: {source}")]
    BadChunk {
        /// The chunk index.
        index: u64,
        /// The chunk's offset in the resource.
        offset: u64,
        /// The verifier's reason.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The connection went away.
    #[error("connection lost: {reason}")]
    ConnectionLost {
        /// Why, as the transport says.
        reason: String,
    },
}

impl FetchError {
    /// Whether the peer broke the protocol or sent wrong bytes (mark it; prefer other peers).
    /// Timeouts, errors the peer reported and lost connections are not counted as faults.
    pub fn is_peer_fault(&self) -> bool {
        matches!(
            self,
            Self::OutOfOrder { .. }
                | Self::OutOfBounds { .. }
                | Self::Truncated { .. }
                | Self::BadChunk { .. }
        )
    }
}

/// A request that completed: every byte of the range, verified when a verifier was given.
#[derive(Debug)]
pub struct Completed {
    /// The request.
    pub id: RequestId,
    /// What it was for.
    pub resource: Resource,
    /// Offset of `bytes[0]` within the resource.
    pub offset: u64,
    /// The bytes (empty when they went into the caller's buffer).
    pub bytes: Vec<u8>,
    /// The caller's buffer ([`Fetch::into_buffer`]), holding the range at its offsets.
    pub buffer: Option<Box<dyn RecordBuffer>>,
    /// Time from [`Requests::start`] to completion.
    pub elapsed: Duration,
}

/// A request that failed.
#[derive(Debug)]
pub struct Failed {
    /// The request.
    pub id: RequestId,
    /// What it was for.
    pub resource: Resource,
    /// Why.
    pub error: FetchError,
    /// Offset of `verified[0]` within the resource (the start of the requested range).
    pub offset: u64,
    /// The prefix of the range that arrived and passed verification (empty without a verifier,
    /// or when it is in the caller's buffer): resume from `verified_end` on another peer.
    pub verified: Vec<u8>,
    /// The caller's buffer ([`Fetch::into_buffer`]): bytes `offset..verified_end` of it are
    /// verified; what lies after them is not to be trusted.
    pub buffer: Option<Box<dyn RecordBuffer>>,
    /// The end of the verified prefix in the resource (`offset` without a verifier).
    pub verified_end: u64,
}

/// What [`Requests::cancel_keeping`] hands back.
#[derive(Debug)]
pub struct Abandoned {
    /// The caller's buffer ([`Fetch::into_buffer`]): bytes up to `verified_end` of the range
    /// in it are verified.
    pub buffer: Option<Box<dyn RecordBuffer>>,
    /// The end of the verified prefix in the resource (the range's start without a verifier).
    pub verified_end: u64,
}

/// What happened to a request.
#[derive(Debug)]
pub enum Event {
    /// It completed.
    Completed(Completed),
    /// It failed.
    Failed(Failed),
}

/// A message that a requester never receives arrived on a response path (the caller should
/// close the connection with [`ErrorCode::PROTOCOL_VIOLATION`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected {0} message")]
pub struct UnexpectedMessage(pub &'static str);

struct Pending {
    resource: Resource,
    start: u64,
    end: u64,
    exact: bool,
    /// The bytes received, when they go into a buffer of the request's own.
    buf: Vec<u8>,
    /// The caller's buffer, when they go there.
    into: Option<Box<dyn RecordBuffer>>,
    /// Bytes of the range received.
    received: u64,
    verifier: Option<Box<dyn ChunkVerifier>>,
    /// Resource offset up to which chunks were verified.
    verified_to: u64,
    started: Instant,
    timeout: Duration,
    deadline: Instant,
    idle_deadline: Instant,
    /// [`Fetch::extend_on_progress`]: the progress when the deadline was last set, and the
    /// latest deadline allowed.
    extend: Option<(u64, Instant)>,
}

impl Pending {
    fn received(&self) -> u64 {
        self.received
    }

    /// What [`Fetch::extend_on_progress`] counts: the verified end, or the bytes received
    /// when nothing is verified.
    fn progress(&self) -> u64 {
        if self.verifier.is_some() {
            self.verified_to
        } else {
            self.start + self.received()
        }
    }
}

/// The outstanding requests to one peer. See the module docs.
pub struct Requests {
    config: RequestsConfig,
    peer_limit: Option<u32>,
    next_id: u64,
    pending: BTreeMap<RequestId, Pending>,
    transmits: VecDeque<Message>,
    events: VecDeque<Event>,
    stray: u64,
}

impl fmt::Debug for Requests {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Requests")
            .field("outstanding", &self.pending.keys().collect::<Vec<_>>())
            .field("peer_limit", &self.peer_limit)
            .field("stray", &self.stray)
            .finish()
    }
}

impl Requests {
    /// No requests yet.
    pub fn new(config: RequestsConfig) -> Self {
        Self {
            config,
            peer_limit: None,
            next_id: 0,
            pending: BTreeMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stray: 0,
        }
    }

    /// Applies the limits of the peer's [`crate::Hello`]: [`Requests::start`] then refuses to
    /// go over them instead of collecting `busy` answers.
    pub fn set_peer_limits(&mut self, limits: Limits) {
        self.peer_limit = Some(limits.max_concurrent_requests);
    }

    /// Requests outstanding.
    pub fn outstanding(&self) -> usize {
        self.pending.len()
    }

    /// Whether `id` is outstanding.
    pub fn is_outstanding(&self, id: RequestId) -> bool {
        self.pending.contains_key(&id)
    }

    /// The end of the verified part of `id`'s range in the resource (its start before a chunk
    /// verified; without a verifier, its start), if `id` is outstanding.
    pub fn verified_end(&self, id: RequestId) -> Option<u64> {
        self.pending.get(&id).map(|p| p.verified_to)
    }

    /// Part of a frame of `id`'s answer arrived (the caller reads its stream) that was not
    /// handed in: the peer is not silent, so `id`'s idle deadline starts again from `now`.
    /// Nothing else changes (what counts as progress is the bytes handed in, as messages or
    /// pieces). Returns whether `id` was outstanding.
    pub fn handle_partial(&mut self, now: Instant, id: RequestId) -> bool {
        match self.pending.get_mut(&id) {
            Some(p) => {
                p.idle_deadline = now + self.config.idle_timeout;
                true
            }
            None => false,
        }
    }

    /// How many more requests [`Requests::start`] accepts now.
    pub fn capacity(&self) -> usize {
        (self.limit() as usize).saturating_sub(self.pending.len())
    }

    /// Answers that arrived for requests no longer outstanding (cancelled, timed out or never
    /// sent); they are dropped.
    pub fn stray_messages(&self) -> u64 {
        self.stray
    }

    fn limit(&self) -> u32 {
        match self.peer_limit {
            Some(p) => p.min(self.config.max_outstanding),
            None => self.config.max_outstanding,
        }
    }

    /// Starts a request: queues its `Get` or `GetManifest` for [`Requests::poll_transmit`] and
    /// returns its id.
    pub fn start(&mut self, now: Instant, fetch: Fetch) -> Result<RequestId, StartError> {
        let limit = self.limit();
        if self.pending.len() >= limit as usize {
            return Err(StartError::AtCapacity {
                outstanding: self.pending.len(),
                limit,
            });
        }
        let (start, end, exact) = match fetch.resource {
            Resource::Expert { .. } => {
                if fetch.len == 0 {
                    return Err(StartError::EmptyExpert);
                }
                match fetch.range {
                    None => (0, fetch.len, true),
                    Some(r) => match r.end() {
                        Some(end) if r.len > 0 && end <= fetch.len => (r.offset, end, true),
                        _ => {
                            return Err(StartError::BadRange {
                                offset: r.offset,
                                len: r.len,
                                expert_len: fetch.len,
                            })
                        }
                    },
                }
            }
            Resource::Manifest { .. } => (0, fetch.len, false),
            Resource::File { ref name, .. } => {
                let bad = |r: ByteRange| StartError::BadRange {
                    offset: r.offset,
                    len: r.len,
                    expert_len: fetch.len,
                };
                let r = fetch.range.expect("Fetch::file always sets a range");
                match r.end() {
                    Some(end) if r.len > 0 && r.len <= MAX_FILE_RANGE_LEN => {
                        if check_file_name(name).is_err() {
                            return Err(bad(r));
                        }
                        if fetch.verifier.is_some() {
                            return Err(StartError::Verifier(
                                "a file range is checked by the caller, not by chunks".into(),
                            ));
                        }
                        (r.offset, end, true)
                    }
                    _ => return Err(bad(r)),
                }
            }
        };
        if let Some(v) = &fetch.verifier {
            if !exact {
                return Err(StartError::Verifier(
                    "a manifest is verified whole, not by chunks".into(),
                ));
            }
            let c = v.chunk_len();
            if c == 0 {
                return Err(StartError::Verifier("chunk length 0".into()));
            }
            if v.resource_len() != fetch.len {
                return Err(StartError::Verifier(format!(
                    "verifier is for {} bytes, the expert has {}",
                    v.resource_len(),
                    fetch.len
                )));
            }
            if start % c != 0 || (end % c != 0 && end != fetch.len) {
                return Err(StartError::Verifier(format!(
                    "range {start}..{end} is not aligned to {c}-byte chunks"
                )));
            }
        }
        if fetch.into.is_some() && !exact {
            return Err(StartError::Buffer(
                "a manifest's length is not known before it arrives".into(),
            ));
        }
        let mut into = fetch.into;
        if let Some(b) = into.as_mut() {
            let from = b.offset();
            let to = from.saturating_add(b.bytes_mut().len() as u64);
            if from > start || to < end {
                return Err(StartError::Buffer(format!(
                    "it holds bytes {from}..{to}, the range is {start}..{end}"
                )));
            }
        }
        // An exact range was sized by the caller (from the manifest); reserve it now, and refuse
        // a size this process cannot hold rather than abort. A manifest grows as its bytes
        // arrive, bounded by the caller's limit.
        let mut buf = Vec::new();
        if exact && into.is_none() {
            buf.try_reserve_exact((end - start) as usize)
                .map_err(|_| StartError::TooLarge { len: end - start })?;
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let msg = match &fetch.resource {
            &Resource::Expert { model, expert } => Message::Get(Get {
                request_id: id,
                model,
                expert,
                range: fetch.range,
                priority: fetch.priority,
            }),
            &Resource::Manifest { model } => Message::GetManifest(GetManifest {
                request_id: id,
                model,
            }),
            Resource::File { model, name } => {
                let r = fetch.range.expect("Fetch::file always sets a range");
                Message::GetFile(GetFile {
                    request_id: id,
                    model: *model,
                    name: name.clone(),
                    offset: r.offset,
                    len: r.len,
                })
            }
        };
        self.transmits.push_back(msg);
        let timeout = fetch.timeout.unwrap_or(self.config.timeout);
        let extend = fetch
            .extend_on_progress
            .map(|max_total| (start, now + max_total.max(timeout)));
        self.pending.insert(
            id,
            Pending {
                extend,
                resource: fetch.resource,
                start,
                end,
                exact,
                buf,
                into,
                received: 0,
                verifier: fetch.verifier,
                verified_to: start,
                started: now,
                timeout,
                deadline: now + timeout,
                idle_deadline: now + self.config.idle_timeout,
            },
        );
        Ok(id)
    }

    /// Gives up on `id`: queues a [`Cancel`] for the peer. No event is emitted for it. Returns
    /// whether it was outstanding.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if self.pending.remove(&id).is_some() {
            self.transmits
                .push_back(Message::Cancel(Cancel { request_id: id }));
            true
        } else {
            false
        }
    }

    /// [`Requests::cancel`], handing back the caller's buffer ([`Fetch::into_buffer`]) and the
    /// end of its verified prefix, as a [`Failed`] event would have. `None` when `id` is not
    /// outstanding.
    pub fn cancel_keeping(&mut self, id: RequestId) -> Option<Abandoned> {
        let p = self.pending.remove(&id)?;
        self.transmits
            .push_back(Message::Cancel(Cancel { request_id: id }));
        Some(Abandoned {
            buffer: p.into,
            verified_end: p.verified_to,
        })
    }

    /// Feeds a message that arrived from the peer on a response path: `Data`, `End` or `Error`.
    /// Breaches of the response rules fail the request (an [`Event`]); only a message a
    /// requester never receives is an `Err`.
    pub fn handle_message(&mut self, now: Instant, msg: Message) -> Result<(), UnexpectedMessage> {
        match msg {
            Message::Data(d) => {
                let len = d.bytes.len() as u64;
                if self.handle_data_header(now, d.request_id, d.offset, len) {
                    self.handle_data_bytes(now, d.request_id, d.offset, &d.bytes);
                }
            }
            Message::End(e) => self.handle_end(now, e),
            Message::Error(e) => self.handle_error(e),
            other => return Err(UnexpectedMessage(other.name())),
        }
        Ok(())
    }

    /// Feeds a piece from [`crate::FrameDecoder::decode_streaming`] of a response path, as
    /// [`Requests::handle_message`] does whole messages.
    pub fn handle_piece(
        &mut self,
        now: Instant,
        piece: Piece<'_>,
    ) -> Result<(), UnexpectedMessage> {
        match piece {
            Piece::Message(m) => return self.handle_message(now, m),
            Piece::DataHeader {
                request_id,
                offset,
                len,
            } => {
                self.handle_data_header(now, request_id, offset, len);
            }
            Piece::DataBytes {
                request_id,
                offset,
                bytes,
                ..
            } => self.handle_data_bytes(now, request_id, offset, bytes),
        }
        Ok(())
    }

    /// A Data frame of `len` bytes at `offset` begins: checks it against the order and bounds
    /// rules as a whole. Returns whether its request is still outstanding.
    fn handle_data_header(&mut self, now: Instant, id: RequestId, offset: u64, len: u64) -> bool {
        let Some(p) = self.pending.get_mut(&id) else {
            self.stray += 1;
            return false;
        };
        let expected = p.start + p.received();
        if offset != expected {
            let error = FetchError::OutOfOrder {
                expected,
                got: offset,
            };
            self.fail(id, error, true);
            return false;
        }
        // Data headers are validated on decode, but a caller may build one by hand.
        match offset.checked_add(len) {
            Some(e) if e <= p.end && len > 0 => {}
            _ => {
                let error = FetchError::OutOfBounds {
                    offset,
                    len,
                    end: p.end,
                };
                self.fail(id, error, true);
                return false;
            }
        }
        p.idle_deadline = now + self.config.idle_timeout;
        true
    }

    /// Payload bytes of the current Data frame of `id` (after its header; dropped when the
    /// request is no longer outstanding). Checked again for order and bounds, since a caller
    /// may pass pieces by hand.
    fn handle_data_bytes(&mut self, now: Instant, id: RequestId, offset: u64, bytes: &[u8]) {
        let Some(p) = self.pending.get_mut(&id) else {
            return;
        };
        let len = bytes.len() as u64;
        let expected = p.start + p.received();
        if offset != expected {
            let error = FetchError::OutOfOrder {
                expected,
                got: offset,
            };
            return self.fail(id, error, true);
        }
        match offset.checked_add(len) {
            Some(e) if e <= p.end => {}
            _ => {
                let error = FetchError::OutOfBounds {
                    offset,
                    len,
                    end: p.end,
                };
                return self.fail(id, error, true);
            }
        }
        match p.into.as_mut() {
            // In bounds: `start` checked that the buffer reaches the range's end.
            Some(b) => {
                let at = (offset - b.offset()) as usize;
                b.bytes_mut()[at..at + len as usize].copy_from_slice(bytes)
            }
            None => p.buf.extend_from_slice(bytes),
        }
        p.received += len;
        p.idle_deadline = now + self.config.idle_timeout;
        if let Err(error) = verify_ready(p) {
            return self.fail(id, error, true);
        }
        if p.exact && p.start + p.received() == p.end {
            self.complete(now, id);
        }
    }

    fn handle_end(&mut self, now: Instant, e: End) {
        let Some(p) = self.pending.get(&e.request_id) else {
            self.stray += 1;
            return;
        };
        if p.exact {
            // Exact requests complete on their last byte, so this End is early.
            let error = FetchError::Truncated {
                received: p.received(),
                expected: p.end - p.start,
            };
            // The peer claims to be done; there is nothing to cancel.
            self.fail(e.request_id, error, false);
        } else {
            self.complete(now, e.request_id);
        }
    }

    fn handle_error(&mut self, e: ErrorMessage) {
        match e.request_id {
            Some(id) => {
                if self.pending.contains_key(&id) {
                    let error = FetchError::Remote {
                        code: e.code,
                        message: e.message,
                    };
                    self.fail(id, error, false);
                } else {
                    self.stray += 1;
                }
            }
            None => {
                let ids: Vec<_> = self.pending.keys().copied().collect();
                for id in ids {
                    let error = FetchError::Remote {
                        code: e.code,
                        message: e.message.clone(),
                    };
                    self.fail(id, error, false);
                }
            }
        }
    }

    /// Fails every outstanding request with [`FetchError::ConnectionLost`] and drops queued
    /// messages.
    pub fn connection_lost(&mut self, reason: &str) {
        self.transmits.clear();
        let ids: Vec<_> = self.pending.keys().copied().collect();
        for id in ids {
            let error = FetchError::ConnectionLost {
                reason: reason.to_string(),
            };
            self.fail(id, error, false);
        }
    }

    /// The earliest deadline of any outstanding request: call [`Requests::handle_timeout`]
    /// then.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pending
            .values()
            .map(|p| p.deadline.min(p.idle_deadline))
            .min()
    }

    /// The earliest deadline of request `id`, if outstanding: call
    /// [`Requests::handle_timeout_of`] then. (For a caller that drives each request from its
    /// own task, which alone knows what its stream has delivered: see
    /// [`Requests::handle_partial`].)
    pub fn poll_timeout_of(&self, id: RequestId) -> Option<Instant> {
        self.pending
            .get(&id)
            .map(|p| p.deadline.min(p.idle_deadline))
    }

    /// Fails (and cancels at the peer) every request whose deadline is at or before `now`,
    /// except that one started with [`Fetch::extend_on_progress`] that advanced since its
    /// deadline was set gets another timeout from `now` (up to its latest). A request past its
    /// idle deadline is reported [`FetchError::Stalled`], whatever else has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let ids: Vec<_> = self.pending.keys().copied().collect();
        for id in ids {
            self.handle_timeout_of(now, id);
        }
    }

    /// [`Requests::handle_timeout`] for request `id` alone.
    pub fn handle_timeout_of(&mut self, now: Instant, id: RequestId) {
        let Some(p) = self.pending.get_mut(&id) else {
            return;
        };
        if now >= p.deadline && now < p.idle_deadline {
            if let Some((from, latest)) = p.extend {
                let at = p.progress();
                if at > from && now < latest {
                    p.extend = Some((at, latest));
                    p.deadline = (now + p.timeout).min(latest);
                }
            }
        }
        let error = if now >= p.idle_deadline {
            FetchError::Stalled {
                idle: self.config.idle_timeout,
                received: p.received(),
            }
        } else if now >= p.deadline {
            FetchError::TimedOut {
                after: now.saturating_duration_since(p.started),
                received: p.received(),
            }
        } else {
            return;
        };
        self.fail(id, error, true);
    }

    /// The next message to send to the peer (`Get`, `GetManifest` or `Cancel`; route it by
    /// [`Message::request_id`]).
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmits.pop_front()
    }

    /// The next completion or failure.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    fn complete(&mut self, now: Instant, id: RequestId) {
        let p = self
            .pending
            .remove(&id)
            .expect("complete is called on a pending id");
        self.events.push_back(Event::Completed(Completed {
            id,
            resource: p.resource,
            offset: p.start,
            bytes: p.buf,
            buffer: p.into,
            elapsed: now.saturating_duration_since(p.started),
        }));
    }

    fn fail(&mut self, id: RequestId, error: FetchError, cancel: bool) {
        let mut p = self
            .pending
            .remove(&id)
            .expect("fail is called on a pending id");
        if cancel {
            self.transmits
                .push_back(Message::Cancel(Cancel { request_id: id }));
        }
        let verified = if p.verifier.is_some() {
            p.buf.truncate((p.verified_to - p.start) as usize);
            p.buf
        } else {
            Vec::new()
        };
        self.events.push_back(Event::Failed(Failed {
            id,
            resource: p.resource,
            error,
            offset: p.start,
            verified,
            buffer: p.into,
            verified_end: p.verified_to,
        }));
    }
}

/// Verifies every chunk whose last byte has arrived.
fn verify_ready(p: &mut Pending) -> Result<(), FetchError> {
    let Some(v) = p.verifier.as_mut() else {
        return Ok(());
    };
    let c = v.chunk_len();
    let total = v.resource_len();
    let received_to = p.start + p.received;
    while p.verified_to < p.end {
        let index = p.verified_to / c;
        let chunk_end = (index + 1).saturating_mul(c).min(total);
        if chunk_end > received_to {
            break;
        }
        let bytes = match p.into.as_mut() {
            Some(b) => {
                let from = b.offset();
                &b.bytes_mut()[(p.verified_to - from) as usize..(chunk_end - from) as usize]
            }
            None => &p.buf[(p.verified_to - p.start) as usize..(chunk_end - p.start) as usize],
        };
        v.verify_chunk(index, bytes)
            .map_err(|source| FetchError::BadChunk {
                index,
                offset: p.verified_to,
                source,
            })?;
        p.verified_to = chunk_end;
    }
    Ok(())
}
