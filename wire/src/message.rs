//! The messages nodes exchange, their tags and their limits.
//!
//! This module owns the *body* encoding of every message (a one-byte tag followed by the
//! postcard encoding of the message's struct) and the semantic limits checked on both encode and
//! decode. Framing (the length prefix) lives in [`crate::frame`].
//!
//! Tags are explicit constants in [`tag`], never derived from the order of a Rust enum, so
//! adding a message can never renumber an existing one. Tags not listed there are reserved:
//! decoding one yields [`DecodeError::UnknownTag`].

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use stormo_ids::{ExpertId, Hash};

use crate::frame::DecodeError;
use crate::inventory::ExpertSet;

/// The one-byte tag that starts every frame body, one constant per message.
///
/// A tag below 128 is also the postcard varint of the same number, so a body reads as the
/// postcard encoding of an enum whose variant indices are these tags. Tags 11 to 127 are reserved
/// for later messages of this protocol version line; 128 to 255 are never used (they would not
/// be a one-byte varint).
pub mod tag {
    /// [`super::Hello`].
    pub const HELLO: u8 = 0;
    /// [`super::Inventory`].
    pub const INVENTORY: u8 = 1;
    /// [`super::InventoryUpdate`].
    pub const INVENTORY_UPDATE: u8 = 2;
    /// [`super::Get`].
    pub const GET: u8 = 3;
    /// [`super::Data`].
    pub const DATA: u8 = 4;
    /// [`super::End`].
    pub const END: u8 = 5;
    /// [`super::GetManifest`].
    pub const GET_MANIFEST: u8 = 6;
    /// [`super::Cancel`].
    pub const CANCEL: u8 = 7;
    /// [`super::Ping`].
    pub const PING: u8 = 8;
    /// [`super::Pong`].
    pub const PONG: u8 = 9;
    /// [`super::ErrorMessage`].
    pub const ERROR: u8 = 10;
    /// [`super::GetFile`].
    pub const GET_FILE: u8 = 11;
    /// [`super::Offer`].
    pub const OFFER: u8 = 12;
    /// [`super::Exec`].
    pub const EXEC: u8 = 13;
    /// [`super::ExecResult`].
    pub const EXEC_RESULT: u8 = 14;
    /// [`super::Placement`].
    pub const PLACEMENT: u8 = 15;
    /// [`super::Peers`].
    pub const PEERS: u8 = 16;
    /// The first reserved tag: 17 up to and including 127 are free for new messages.
    pub const FIRST_RESERVED: u8 = 17;
}

/// The largest payload of one [`Data`] message: 1 MiB.
pub const MAX_DATA_LEN: usize = 1 << 20;
/// The most model ids one [`Hello`] may list.
pub const MAX_MODELS: usize = 256;
/// The longest [`ErrorMessage::message`], in bytes of UTF-8.
pub const MAX_ERROR_MESSAGE_LEN: usize = 1024;
/// The most experts one [`InventoryUpdate`] may name (added and removed together).
pub const MAX_UPDATE_EXPERTS: usize = 16 * 1024;
/// The largest manifest a client accepts by default, in bytes (it arrives as [`Data`] frames).
pub const MAX_MANIFEST_LEN: u64 = 64 << 20;
/// The longest [`GetFile::name`], in bytes of UTF-8.
pub const MAX_FILE_NAME_LEN: usize = 255;
/// The most bytes one [`GetFile`] may ask for: a responder holds at most this much per
/// request, so larger files are fetched as several ranges.
pub const MAX_FILE_RANGE_LEN: u64 = 16 << 20;
/// The most positions one [`Exec`] may carry.
pub const MAX_EXEC_POSITIONS: u32 = 64;
/// The largest `rows` of one [`Exec`] or [`ExecResult`]: 256 KiB (65,536 f32). At
/// gpt-oss-20b's hidden width of 2,880 a position is 11,520 bytes, so one call carries at most
/// 22 positions there; a requester splits more into several calls.
pub const MAX_EXEC_ROWS_LEN: usize = 256 << 10;
/// The largest frame body of an [`Exec`]: its rows and room for its header (at most 59
/// bytes). A responder reading requests accepts frames this large.
pub const MAX_EXEC_FRAME_LEN: usize = MAX_EXEC_ROWS_LEN + 64;

/// Identifies one request within a connection. Chosen by the requester; the responder echoes
/// it in every answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A node's identity: its 32-byte Ed25519 public key, the same key its TLS handshake proved.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub [u8; 32]);

impl NodeId {
    /// The first 5 bytes in hex, for logs.
    pub fn short(&self) -> String {
        hex(&self.0[..5])
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({})", self.short())
    }
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        write!(s, "{b:02x}").expect("writing to a String cannot fail");
    }
    s
}

/// An error code carried by [`ErrorMessage`], also suitable as a QUIC application close code.
///
/// Unknown codes decode fine (a newer peer may send one) and print as `unknown(N)`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ErrorCode(pub u16);

impl ErrorCode {
    /// No error: a graceful close.
    pub const NO_ERROR: Self = Self(0);
    /// The responder does not hold what was asked for (model, expert or manifest).
    pub const NOT_FOUND: Self = Self(1);
    /// The responder is at its concurrency limit; ask again later or ask another peer.
    pub const BUSY: Self = Self(2);
    /// The request was malformed (empty range, duplicate request id, ...).
    pub const BAD_REQUEST: Self = Self(3);
    /// The peer speaks a protocol version this node does not.
    pub const UNSUPPORTED_VERSION: Self = Self(4);
    /// The responder failed for its own reasons (e.g. a disk read error).
    pub const INTERNAL: Self = Self(5);
    /// The requested byte range lies outside the resource.
    pub const OUT_OF_RANGE: Self = Self(6);
    /// The peer broke the protocol (undecodable frame, unexpected message); the connection
    /// closes with this code.
    pub const PROTOCOL_VIOLATION: Self = Self(7);
    /// The node is not admitted (private swarm) or its identity does not match its Hello.
    pub const FORBIDDEN: Self = Self(8);

    /// The constant's name, or `None` for a code this version does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::NO_ERROR => "no error",
            Self::NOT_FOUND => "not found",
            Self::BUSY => "busy",
            Self::BAD_REQUEST => "bad request",
            Self::UNSUPPORTED_VERSION => "unsupported version",
            Self::INTERNAL => "internal",
            Self::OUT_OF_RANGE => "out of range",
            Self::PROTOCOL_VIOLATION => "protocol violation",
            Self::FORBIDDEN => "forbidden",
            _ => return None,
        })
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "unknown({})", self.0),
        }
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ErrorCode({}: {self})", self.0)
    }
}

/// Limits a node announces in its [`Hello`] and enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Requests from this peer the node serves at once; more are answered [`ErrorCode::BUSY`].
    pub max_concurrent_requests: u32,
}

/// The first message each side sends on a connection's control stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`crate::PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// The sender's Ed25519 public key; must equal the key its TLS handshake proved.
    pub node: NodeId,
    /// The ids of the models whose manifest (and possibly experts) the sender serves.
    /// At most [`MAX_MODELS`]. A dialling node names the model when it serves it too (the
    /// node it dials may dial it back at the connection's address); one that only fetches
    /// names none.
    pub models: Vec<Hash>,
    /// What the sender will serve to this peer at once.
    pub limits: Limits,
}

/// The full set of experts of one model that the sender holds and serves. Replaces any earlier
/// inventory of the same model from that sender.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// The model id.
    pub model: Hash,
    /// Which experts, as a bitmap.
    pub experts: ExpertSet,
}

/// A change to the sender's last [`Inventory`] of `model`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InventoryUpdate {
    /// The model id.
    pub model: Hash,
    /// Experts the sender now holds.
    pub added: Vec<ExpertId>,
    /// Experts the sender no longer holds.
    pub removed: Vec<ExpertId>,
}

/// The experts of `model` the sender does not hold but can fetch for the receiver from its own
/// peers, which hold them (one hop: a node offers only what its direct peers hold, never what
/// they offer, so offers cannot outlive the holders they come from). Each `Offer` replaces the
/// sender's last one of the same model. Requests for offered experts are `Get`s like any other;
/// the bytes are verified against the manifest by every node they pass through.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// The model id.
    pub model: Hash,
    /// Which experts, as a bitmap.
    pub experts: ExpertSet,
}

/// The most demand counts one [`Placement`] may carry.
pub const MAX_PLACEMENT_DEMAND: usize = 256;

/// What a serving node tells its peers so the swarm places copies of `model`'s experts by
/// itself (replicas by rarity and demand): its room for kept experts, which experts it holds
/// for good (its model folder's own, pinned: never evicted; and those it keeps on disk, not
/// those merely in its RAM cache, which its [`Inventory`] lists too), which it is fetching
/// (claims, so others hold back), and how often it was asked for experts. Sent on the control stream after
/// [`Inventory`] and when it changes; each one replaces the sender's last of the same model.
/// `leaving` says the sender is stopping cleanly: its copies are about to go.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The model id.
    pub model: Hash,
    /// Bytes the sender may keep for this model (its budget for kept experts).
    pub budget: u64,
    /// Bytes of kept experts it holds now.
    pub used: u64,
    /// Held experts that are its model folder's own.
    pub pinned: ExpertSet,
    /// Experts it keeps on disk (within `budget`).
    pub kept: ExpertSet,
    /// Experts it is fetching to keep.
    pub fetching: ExpertSet,
    /// Requests for experts it saw recently: (expert, count), at most
    /// [`MAX_PLACEMENT_DEMAND`].
    pub demand: Vec<(ExpertId, u32)>,
    /// The sender is stopping.
    pub leaving: bool,
}

/// The most peers one [`Peers`] may name.
pub const MAX_PEERS: usize = 64;

/// Peer exchange: serving nodes of `model` the sender has in its peer set and that serve
/// now, each with the address the sender reaches it at, so that nodes which were each given
/// only one node (a star around a seeder) find each other and place copies by the whole
/// swarm's holdings. Sent on the control stream after [`Inventory`] and when the list
/// changes; each one replaces the sender's last of the same model. An entry is an address
/// to try, not a fact: the receiver dials it and the connection's TLS and [`Hello`] check the
/// key, as for a peer given on its command line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peers {
    /// The model id.
    pub model: Hash,
    /// At most [`MAX_PEERS`] entries.
    pub peers: Vec<PeerEntry>,
}

/// One node of a [`Peers`] list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerEntry {
    /// Its Ed25519 public key.
    pub node: NodeId,
    /// Where the sender reaches it (IPv4 or IPv6 address and UDP port; an IPv6 address's
    /// flow label and scope are not carried).
    pub addr: std::net::SocketAddr,
}

/// A byte range `[offset, offset + len)` within a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ByteRange {
    /// The first byte.
    pub offset: u64,
    /// How many bytes; never zero in a valid request.
    pub len: u64,
}

impl ByteRange {
    /// One past the last byte, or `None` if that overflows `u64`.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }
}

/// How urgently a requester needs an answer. Responders serve [`Priority::Now`] first (a QUIC
/// node maps it to stream priority).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Priority {
    /// The requester's inference is waiting for this.
    Now,
    /// A prefetch hint: useful soon, not yet needed.
    Prefetch,
}

/// Asks for the bytes of one expert, whole or a range of them. Answered by [`Data`] frames in
/// increasing offset order then [`End`], or by an [`ErrorMessage`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Get {
    /// Chosen by the requester, unique among its outstanding requests on this connection.
    pub request_id: RequestId,
    /// The model id.
    pub model: Hash,
    /// Which expert.
    pub expert: ExpertId,
    /// `None` for the whole expert; otherwise a non-empty range of its bytes.
    pub range: Option<ByteRange>,
    /// Needed now or prefetch.
    pub priority: Priority,
}

/// Asks for a model's manifest as opaque bytes (its format belongs to `stormo-manifests`).
/// Answered like [`Get`]: [`Data`] frames from offset 0, then [`End`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetManifest {
    /// Chosen by the requester.
    pub request_id: RequestId,
    /// The model id, as listed in the responder's [`Hello`].
    pub model: Hash,
}

/// Asks for a byte range of one file of the model folder, named as the model's manifest
/// names it (`config.json`, a tokenizer file, a safetensors file or its index). Answered like
/// [`Get`]: [`Data`] frames from `offset` in increasing order, then [`End`]; or an
/// [`ErrorMessage`] (`not found` for a file the manifest does not list, `out of range` past
/// its end, `bad request` for a name that is not a plain file name).
///
/// A name is a manifest name, never a path: it is refused if it is empty, `.` or `..`, or
/// holds `/`, `\` or NUL ([`check_file_name`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetFile {
    /// Chosen by the requester.
    pub request_id: RequestId,
    /// The model id.
    pub model: Hash,
    /// The file's name in the model folder; at most [`MAX_FILE_NAME_LEN`] bytes.
    pub name: String,
    /// The first byte asked for.
    pub offset: u64,
    /// How many bytes: 1 to [`MAX_FILE_RANGE_LEN`].
    pub len: u64,
}

impl GetFile {
    /// The range asked for.
    pub fn range(&self) -> ByteRange {
        ByteRange {
            offset: self.offset,
            len: self.len,
        }
    }
}

/// Checks that `name` is a plain file name of a model folder, not a path: not empty, not `.`
/// or `..`, no `/`, `\` or NUL, at most [`MAX_FILE_NAME_LEN`] bytes. `Err` says why.
pub fn check_file_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty file name".into());
    }
    if name.len() > MAX_FILE_NAME_LEN {
        return Err(format!(
            "file name of {} bytes, over the limit of {MAX_FILE_NAME_LEN}",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} is not a file name"));
    }
    if let Some(c) = name.chars().find(|c| matches!(c, '/' | '\\' | '\0')) {
        return Err(format!(
            "file name {:?} holds {c:?}: names are manifest names, not paths",
            name.escape_debug().to_string()
        ));
    }
    Ok(())
}

/// A piece of a resource being streamed for a request.
///
/// `offset` is the position of `bytes` within the whole resource (not within the requested
/// range). `bytes` is 1 to [`MAX_DATA_LEN`] bytes long. Encoded as the varints `request_id`,
/// `offset`, `bytes.len()` and then the raw bytes, exactly as postcard encodes
/// `(u64, u64, &[u8])`.
#[derive(Clone, PartialEq, Eq)]
pub struct Data {
    /// The request being answered.
    pub request_id: RequestId,
    /// Offset of `bytes[0]` within the resource.
    pub offset: u64,
    /// The bytes.
    pub bytes: Bytes,
}

impl fmt::Debug for Data {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Data")
            .field("request_id", &self.request_id)
            .field("offset", &self.offset)
            .field("len", &self.bytes.len())
            .finish()
    }
}

/// The responder sent every byte of the request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct End {
    /// The request that is complete.
    pub request_id: RequestId,
}

/// The requester no longer wants the answer to a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancel {
    /// The request to drop.
    pub request_id: RequestId,
}

/// Asks the peer to echo `nonce` in a [`Pong`], to measure round-trip time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    /// Any value; echoed.
    pub nonce: u64,
}

impl Ping {
    /// The answer to this ping.
    pub fn pong(&self) -> Pong {
        Pong { nonce: self.nonce }
    }
}

/// The answer to a [`Ping`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// The ping's nonce.
    pub nonce: u64,
}

/// A request failed, or (with no request id) the connection is about to close.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMessage {
    /// The failed request, or `None` for an error about the whole connection.
    pub request_id: Option<RequestId>,
    /// What kind of failure.
    pub code: ErrorCode,
    /// Human-readable detail, at most [`MAX_ERROR_MESSAGE_LEN`] bytes.
    pub message: String,
}

impl ErrorMessage {
    /// An error for `request_id`, with `message` cut to [`MAX_ERROR_MESSAGE_LEN`] bytes at a
    /// character boundary so it always encodes.
    pub fn new(request_id: Option<RequestId>, code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE_LEN {
            let mut cut = MAX_ERROR_MESSAGE_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self {
            request_id,
            code,
            message,
        }
    }
}

/// Asks the responder to run one expert it holds over `positions` input rows and answer its
/// output rows ([`ExecResult`]), or an [`ErrorMessage`]: `busy` beyond the responder's compute
/// limits, `not found` for an expert it does not hold verified, `bad request` when the rows are
/// not `positions` rows of the model's hidden width, `forbidden` when this node may not use
/// its compute.
///
/// `rows` are `positions * hidden` f32, little-endian, row after row (`[positions, hidden]`),
/// sent exactly (NaN and infinities are data, not errors): `4 * hidden` bytes per position,
/// 11,520 at gpt-oss-20b's hidden width of 2,880. Encoded as the varints `request_id`, the
/// 32 bytes of `model`, the varints `expert.layer`, `expert.expert`, `positions` and
/// `rows.len()`, then the raw rows, exactly as postcard encodes
/// `(u64, Hash, ExpertId, u32, &[u8])`.
#[derive(Clone, PartialEq, Eq)]
pub struct Exec {
    /// Chosen by the requester; echoed in the answer.
    pub request_id: RequestId,
    /// The model id.
    pub model: Hash,
    /// Which expert to run.
    pub expert: ExpertId,
    /// How many input rows: 1 to [`MAX_EXEC_POSITIONS`].
    pub positions: u32,
    /// The input rows, f32 LE `[positions, hidden]`: a non-zero multiple of `4 * positions`
    /// bytes, at most [`MAX_EXEC_ROWS_LEN`].
    pub rows: Bytes,
}

impl Exec {
    /// A request to run `expert` of `model` over `rows` (`[positions, hidden]` floats).
    pub fn new(
        request_id: RequestId,
        model: Hash,
        expert: ExpertId,
        positions: u32,
        rows: &[f32],
    ) -> Self {
        Self {
            request_id,
            model,
            expert,
            positions,
            rows: f32_bytes(rows),
        }
    }

    /// The row width the request implies: `rows.len() / (4 * positions)` (0 for an invalid
    /// request with no positions).
    pub fn hidden(&self) -> usize {
        self.rows
            .len()
            .checked_div(4 * self.positions as usize)
            .unwrap_or(0)
    }

    /// The input rows as floats.
    pub fn rows_f32(&self) -> Vec<f32> {
        f32s(&self.rows)
    }
}

impl fmt::Debug for Exec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exec")
            .field("request_id", &self.request_id)
            .field("model", &self.model)
            .field("expert", &self.expert)
            .field("positions", &self.positions)
            .field("rows_len", &self.rows.len())
            .finish()
    }
}

/// The answer to an [`Exec`]: the expert's output rows, f32 LE, the same shape as the input
/// (`[positions, hidden]`). Encoded as the varints `request_id` and `rows.len()`, then the raw
/// rows.
#[derive(Clone, PartialEq, Eq)]
pub struct ExecResult {
    /// The request answered.
    pub request_id: RequestId,
    /// The output rows: a non-zero multiple of 4 bytes, at most [`MAX_EXEC_ROWS_LEN`]. The
    /// requester checks that they are as many as it sent.
    pub rows: Bytes,
}

impl ExecResult {
    /// The answer to `request_id` with output `rows`.
    pub fn new(request_id: RequestId, rows: &[f32]) -> Self {
        Self {
            request_id,
            rows: f32_bytes(rows),
        }
    }

    /// The output rows as floats.
    pub fn rows_f32(&self) -> Vec<f32> {
        f32s(&self.rows)
    }
}

impl fmt::Debug for ExecResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecResult")
            .field("request_id", &self.request_id)
            .field("rows_len", &self.rows.len())
            .finish()
    }
}

/// `xs` as little-endian bytes.
pub fn f32_bytes(xs: &[f32]) -> Bytes {
    let mut out = Vec::with_capacity(xs.len() * 4);
    for x in xs {
        out.extend_from_slice(&x.to_le_bytes());
    }
    Bytes::from(out)
}

/// Little-endian `bytes` as floats (a trailing partial float is dropped; decoded messages
/// have none).
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum Message {
    /// Tag 0.
    Hello(Hello),
    /// Tag 1.
    Inventory(Inventory),
    /// Tag 2.
    InventoryUpdate(InventoryUpdate),
    /// Tag 3.
    Get(Get),
    /// Tag 4.
    Data(Data),
    /// Tag 5.
    End(End),
    /// Tag 6.
    GetManifest(GetManifest),
    /// Tag 7.
    Cancel(Cancel),
    /// Tag 8.
    Ping(Ping),
    /// Tag 9.
    Pong(Pong),
    /// Tag 10.
    Error(ErrorMessage),
    /// Tag 11.
    GetFile(GetFile),
    /// Tag 12.
    Offer(Offer),
    /// Tag 13.
    Exec(Exec),
    /// Tag 14.
    ExecResult(ExecResult),
    /// Tag 15.
    Placement(Placement),
    /// Tag 16.
    Peers(Peers),
}

/// Why a message cannot be encoded (it breaks a limit of the protocol).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The message breaks a limit; `reason` says which.
    #[error("cannot encode {message}: {reason}")]
    Invalid {
        /// The message's name.
        message: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The encoded frame would exceed the frame limit.
    #[error("{message} encodes to {len} bytes, over the frame limit of {max}")]
    TooLarge {
        /// The message's name.
        message: &'static str,
        /// Its encoded body length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl Message {
    /// The message's tag (see [`tag`]).
    pub fn tag(&self) -> u8 {
        match self {
            Self::Hello(_) => tag::HELLO,
            Self::Inventory(_) => tag::INVENTORY,
            Self::InventoryUpdate(_) => tag::INVENTORY_UPDATE,
            Self::Get(_) => tag::GET,
            Self::Data(_) => tag::DATA,
            Self::End(_) => tag::END,
            Self::GetManifest(_) => tag::GET_MANIFEST,
            Self::Cancel(_) => tag::CANCEL,
            Self::Ping(_) => tag::PING,
            Self::Pong(_) => tag::PONG,
            Self::Error(_) => tag::ERROR,
            Self::GetFile(_) => tag::GET_FILE,
            Self::Offer(_) => tag::OFFER,
            Self::Exec(_) => tag::EXEC,
            Self::ExecResult(_) => tag::EXEC_RESULT,
            Self::Placement(_) => tag::PLACEMENT,
            Self::Peers(_) => tag::PEERS,
        }
    }

    /// The message's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        tag_name(self.tag()).expect("every message has a named tag")
    }

    /// The request this message belongs to, if it belongs to one. A QUIC node uses this to
    /// route a message to the stream of its request; messages without one go on the control
    /// stream.
    pub fn request_id(&self) -> Option<RequestId> {
        match self {
            Self::Get(m) => Some(m.request_id),
            Self::Data(m) => Some(m.request_id),
            Self::End(m) => Some(m.request_id),
            Self::GetManifest(m) => Some(m.request_id),
            Self::Cancel(m) => Some(m.request_id),
            Self::GetFile(m) => Some(m.request_id),
            Self::Exec(m) => Some(m.request_id),
            Self::ExecResult(m) => Some(m.request_id),
            Self::Error(m) => m.request_id,
            Self::Hello(_)
            | Self::Inventory(_)
            | Self::InventoryUpdate(_)
            | Self::Offer(_)
            | Self::Placement(_)
            | Self::Peers(_)
            | Self::Ping(_)
            | Self::Pong(_) => None,
        }
    }

    /// Checks the protocol's limits on this message's contents (the same checks decoding
    /// applies). `Err` names the limit broken.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Self::Hello(h) => {
                if h.models.len() > MAX_MODELS {
                    return Err(format!(
                        "{} model ids, over the limit of {MAX_MODELS}",
                        h.models.len()
                    ));
                }
                if h.limits.max_concurrent_requests == 0 {
                    return Err("max_concurrent_requests is 0".into());
                }
            }
            Self::Inventory(i) => i.experts.validate().map_err(|e| e.to_string())?,
            Self::Offer(o) => o.experts.validate().map_err(|e| e.to_string())?,
            Self::Placement(p) => {
                p.pinned.validate().map_err(|e| e.to_string())?;
                p.kept.validate().map_err(|e| e.to_string())?;
                p.fetching.validate().map_err(|e| e.to_string())?;
                if p.demand.len() > MAX_PLACEMENT_DEMAND {
                    return Err(format!(
                        "{} demand counts, over the limit of {MAX_PLACEMENT_DEMAND}",
                        p.demand.len()
                    ));
                }
            }
            Self::Peers(p) => {
                if p.peers.len() > MAX_PEERS {
                    return Err(format!(
                        "{} peers, over the limit of {MAX_PEERS}",
                        p.peers.len()
                    ));
                }
            }
            Self::InventoryUpdate(u) => {
                let n = u.added.len() + u.removed.len();
                if n > MAX_UPDATE_EXPERTS {
                    return Err(format!(
                        "{n} experts in one update, over the limit of {MAX_UPDATE_EXPERTS}"
                    ));
                }
            }
            Self::Get(g) => {
                if let Some(r) = g.range {
                    if r.len == 0 {
                        return Err("empty byte range".into());
                    }
                    if r.end().is_none() {
                        return Err(format!("byte range {}+{} overflows u64", r.offset, r.len));
                    }
                }
            }
            Self::Data(d) => {
                if d.bytes.is_empty() {
                    return Err("empty data".into());
                }
                if d.bytes.len() > MAX_DATA_LEN {
                    return Err(format!(
                        "{} bytes of data, over the limit of {MAX_DATA_LEN}",
                        d.bytes.len()
                    ));
                }
                if d.offset.checked_add(d.bytes.len() as u64).is_none() {
                    return Err(format!("data at offset {} overflows u64", d.offset));
                }
            }
            Self::Error(e) => {
                if e.message.len() > MAX_ERROR_MESSAGE_LEN {
                    return Err(format!(
                        "error message of {} bytes, over the limit of {MAX_ERROR_MESSAGE_LEN}",
                        e.message.len()
                    ));
                }
            }
            Self::GetFile(g) => {
                // Only the length limits here: a bad name is the responder's to refuse with
                // `bad request` (the peer's error, not a broken connection).
                if g.name.len() > MAX_FILE_NAME_LEN {
                    return Err(format!(
                        "file name of {} bytes, over the limit of {MAX_FILE_NAME_LEN}",
                        g.name.len()
                    ));
                }
                if g.len == 0 {
                    return Err("empty byte range".into());
                }
                if g.len > MAX_FILE_RANGE_LEN {
                    return Err(format!(
                        "{} bytes asked for, over the limit of {MAX_FILE_RANGE_LEN}",
                        g.len
                    ));
                }
                if g.range().end().is_none() {
                    return Err(format!("byte range {}+{} overflows u64", g.offset, g.len));
                }
            }
            Self::Exec(e) => {
                if e.positions == 0 || e.positions > MAX_EXEC_POSITIONS {
                    return Err(format!(
                        "{} positions, outside 1..={MAX_EXEC_POSITIONS}",
                        e.positions
                    ));
                }
                check_rows(e.rows.len())?;
                if e.rows.len() % (4 * e.positions as usize) != 0 {
                    return Err(format!(
                        "{} bytes of rows are not {} rows of f32",
                        e.rows.len(),
                        e.positions
                    ));
                }
            }
            Self::ExecResult(r) => check_rows(r.rows.len())?,
            Self::End(_)
            | Self::GetManifest(_)
            | Self::Cancel(_)
            | Self::Ping(_)
            | Self::Pong(_) => {}
        }
        Ok(())
    }

    /// Appends the frame body (tag + postcard payload) to `out`, after checking the limits.
    /// On error nothing is appended.
    pub fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.validate().map_err(|reason| EncodeError::Invalid {
            message: self.name(),
            reason,
        })?;
        let start = out.len();
        out.push(self.tag());
        let res = match self {
            Self::Hello(m) => put(m, out),
            Self::Inventory(m) => put(m, out),
            Self::InventoryUpdate(m) => put(m, out),
            Self::Get(m) => put(m, out),
            Self::Data(m) => {
                out.extend_from_slice(&data_header_fields(m.request_id, m.offset, m.bytes.len()));
                out.extend_from_slice(&m.bytes);
                Ok(())
            }
            Self::End(m) => put(m, out),
            Self::GetManifest(m) => put(m, out),
            Self::Cancel(m) => put(m, out),
            Self::Ping(m) => put(m, out),
            Self::Pong(m) => put(m, out),
            Self::Error(m) => put(m, out),
            Self::GetFile(m) => put(m, out),
            Self::Offer(m) => put(m, out),
            Self::Placement(m) => put(m, out),
            Self::Peers(m) => put(m, out),
            Self::Exec(m) => {
                let header = (
                    m.request_id.0,
                    m.model,
                    m.expert,
                    m.positions,
                    m.rows.len() as u64,
                );
                put(&header, out).map(|()| out.extend_from_slice(&m.rows))
            }
            Self::ExecResult(m) => put(&(m.request_id.0, m.rows.len() as u64), out)
                .map(|()| out.extend_from_slice(&m.rows)),
        };
        // Serializing into a Vec has no failure mode for these types (no maps of unknown
        // length, no custom errors); surface it as Invalid rather than panic all the same.
        if let Err(e) = res {
            out.truncate(start);
            return Err(EncodeError::Invalid {
                message: self.name(),
                reason: e.to_string(),
            });
        }
        let len = out.len() - start;
        if len > crate::frame::MAX_FRAME_LEN {
            out.truncate(start);
            return Err(EncodeError::TooLarge {
                message: self.name(),
                len,
                max: crate::frame::MAX_FRAME_LEN,
            });
        }
        Ok(())
    }

    /// Decodes one frame body (tag + payload, without the length prefix). `Data` payloads are
    /// slices of `body`, not copies.
    pub fn decode_body(body: Bytes) -> Result<Self, DecodeError> {
        let Some((&t, payload)) = body.split_first() else {
            return Err(DecodeError::EmptyFrame);
        };
        let msg = match t {
            tag::HELLO => Self::Hello(take_all(t, payload)?),
            tag::INVENTORY => Self::Inventory(take_all(t, payload)?),
            tag::INVENTORY_UPDATE => Self::InventoryUpdate(take_all(t, payload)?),
            tag::GET => Self::Get(take_all(t, payload)?),
            tag::DATA => Self::Data(decode_data(&body)?),
            tag::END => Self::End(take_all(t, payload)?),
            tag::GET_MANIFEST => Self::GetManifest(take_all(t, payload)?),
            tag::CANCEL => Self::Cancel(take_all(t, payload)?),
            tag::PING => Self::Ping(take_all(t, payload)?),
            tag::PONG => Self::Pong(take_all(t, payload)?),
            tag::ERROR => Self::Error(take_all(t, payload)?),
            tag::GET_FILE => Self::GetFile(take_all(t, payload)?),
            tag::OFFER => Self::Offer(take_all(t, payload)?),
            tag::PLACEMENT => Self::Placement(take_all(t, payload)?),
            tag::PEERS => Self::Peers(take_all(t, payload)?),
            tag::EXEC => Self::Exec(decode_exec(&body)?),
            tag::EXEC_RESULT => Self::ExecResult(decode_exec_result(&body)?),
            other => return Err(DecodeError::UnknownTag(other)),
        };
        msg.validate().map_err(|reason| DecodeError::Invalid {
            message: msg.name(),
            reason,
        })?;
        Ok(msg)
    }
}

/// The name of the message with tag `t`, or `None` for a reserved tag.
pub fn tag_name(t: u8) -> Option<&'static str> {
    Some(match t {
        tag::HELLO => "Hello",
        tag::INVENTORY => "Inventory",
        tag::INVENTORY_UPDATE => "InventoryUpdate",
        tag::GET => "Get",
        tag::DATA => "Data",
        tag::END => "End",
        tag::GET_MANIFEST => "GetManifest",
        tag::CANCEL => "Cancel",
        tag::PING => "Ping",
        tag::PONG => "Pong",
        tag::ERROR => "Error",
        tag::GET_FILE => "GetFile",
        tag::OFFER => "Offer",
        tag::EXEC => "Exec",
        tag::EXEC_RESULT => "ExecResult",
        tag::PLACEMENT => "Placement",
        tag::PEERS => "Peers",
        _ => return None,
    })
}

fn put<T: Serialize>(m: &T, out: &mut Vec<u8>) -> postcard::Result<()> {
    out.extend_from_slice(&postcard::to_allocvec(m)?);
    Ok(())
}

fn take_all<'de, T: Deserialize<'de>>(t: u8, payload: &'de [u8]) -> Result<T, DecodeError> {
    let message = tag_name(t).expect("take_all is only called for known tags");
    let (value, rest) = postcard::take_from_bytes(payload)
        .map_err(|source| DecodeError::Malformed { message, source })?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            message,
            extra: rest.len(),
        });
    }
    Ok(value)
}

/// The varints that follow the Data tag: request id, offset, payload length (at most 30 bytes).
fn data_header_fields(request_id: RequestId, offset: u64, len: usize) -> Vec<u8> {
    postcard::to_allocvec(&(request_id.0, offset, len as u64))
        .expect("three u64 varints always serialize")
}

fn decode_data(body: &Bytes) -> Result<Data, DecodeError> {
    let payload = &body[1..];
    let ((request_id, offset, len), rest) = postcard::take_from_bytes::<(u64, u64, u64)>(payload)
        .map_err(|source| DecodeError::Malformed {
        message: "Data",
        source,
    })?;
    if len > MAX_DATA_LEN as u64 {
        return Err(DecodeError::Invalid {
            message: "Data",
            reason: format!("{len} bytes of data, over the limit of {MAX_DATA_LEN}"),
        });
    }
    let len = len as usize;
    if rest.len() < len {
        return Err(DecodeError::Malformed {
            message: "Data",
            source: postcard::Error::DeserializeUnexpectedEnd,
        });
    }
    if rest.len() > len {
        return Err(DecodeError::TrailingBytes {
            message: "Data",
            extra: rest.len() - len,
        });
    }
    let start = body.len() - len;
    Ok(Data {
        request_id: RequestId(request_id),
        offset,
        bytes: body.slice(start..),
    })
}

/// Checks the length of an [`Exec`]'s or [`ExecResult`]'s rows: not empty, whole floats,
/// within [`MAX_EXEC_ROWS_LEN`].
fn check_rows(len: usize) -> Result<(), String> {
    if len == 0 {
        return Err("no rows".into());
    }
    if len > MAX_EXEC_ROWS_LEN {
        return Err(format!(
            "{len} bytes of rows, over the limit of {MAX_EXEC_ROWS_LEN}"
        ));
    }
    if !len.is_multiple_of(4) {
        return Err(format!("{len} bytes of rows are not whole f32"));
    }
    Ok(())
}

/// The raw rows that end a frame body, after a header that announced `len` of them: a slice
/// of `body`, checked against the limit before anything else.
fn take_rows(
    message: &'static str,
    body: &Bytes,
    len: u64,
    rest: &[u8],
) -> Result<Bytes, DecodeError> {
    if len > MAX_EXEC_ROWS_LEN as u64 {
        return Err(DecodeError::Invalid {
            message,
            reason: format!("{len} bytes of rows, over the limit of {MAX_EXEC_ROWS_LEN}"),
        });
    }
    let len = len as usize;
    if rest.len() < len {
        return Err(DecodeError::Malformed {
            message,
            source: postcard::Error::DeserializeUnexpectedEnd,
        });
    }
    if rest.len() > len {
        return Err(DecodeError::TrailingBytes {
            message,
            extra: rest.len() - len,
        });
    }
    Ok(body.slice(body.len() - len..))
}

fn decode_exec(body: &Bytes) -> Result<Exec, DecodeError> {
    let ((request_id, model, expert, positions, len), rest) =
        postcard::take_from_bytes::<(u64, Hash, ExpertId, u32, u64)>(&body[1..]).map_err(
            |source| DecodeError::Malformed {
                message: "Exec",
                source,
            },
        )?;
    Ok(Exec {
        request_id: RequestId(request_id),
        model,
        expert,
        positions,
        rows: take_rows("Exec", body, len, rest)?,
    })
}

fn decode_exec_result(body: &Bytes) -> Result<ExecResult, DecodeError> {
    let ((request_id, len), rest) =
        postcard::take_from_bytes::<(u64, u64)>(&body[1..]).map_err(|source| {
            DecodeError::Malformed {
                message: "ExecResult",
                source,
            }
        })?;
    Ok(ExecResult {
        request_id: RequestId(request_id),
        rows: take_rows("ExecResult", body, len, rest)?,
    })
}

/// The frame header and Data header for a Data message whose payload the caller writes itself
/// (zero-copy sending from a RAM cache or a mapped file): write the returned bytes, then the
/// `len` payload bytes. `len` must be 1 to [`MAX_DATA_LEN`].
pub fn data_frame_prefix(request_id: RequestId, offset: u64, len: usize) -> Vec<u8> {
    assert!(
        (1..=MAX_DATA_LEN).contains(&len),
        "data payload length {len} outside 1..={MAX_DATA_LEN}"
    );
    let fields = data_header_fields(request_id, offset, len);
    let body_len = 1 + fields.len() + len;
    let mut out = Vec::with_capacity(4 + 1 + fields.len());
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.push(tag::DATA);
    out.extend_from_slice(&fields);
    out
}

macro_rules! impl_from {
    ($($t:ident),*) => {$(
        impl From<$t> for Message {
            fn from(m: $t) -> Self {
                Self::$t(m)
            }
        }
    )*};
}
impl_from!(
    Hello,
    Inventory,
    InventoryUpdate,
    Get,
    Data,
    End,
    GetManifest,
    Cancel,
    Ping,
    Pong,
    GetFile,
    Offer,
    Exec,
    ExecResult,
    Placement,
    Peers
);

impl From<ErrorMessage> for Message {
    fn from(m: ErrorMessage) -> Self {
        Self::Error(m)
    }
}

#[cfg(test)]
mod tests {
    //! Golden bytes: every message encoded by hand, field by field. If one of these changes, the
    //! protocol changed: bump [`crate::PROTOCOL_VERSION`] and the ALPN.
    use super::*;
    use crate::frame::{encode_frame, FrameDecoder, MAX_FRAME_LEN};
    use crate::inventory::ExpertSet;

    /// Checks `msg` encodes to exactly the concatenation of `parts`, and decodes back.
    fn golden(msg: Message, parts: &[&[u8]]) {
        let expected: Vec<u8> = parts.concat();
        let got = encode_frame(&msg).unwrap();
        assert_eq!(got, expected, "encoding of {msg:?}");
        let mut dec = FrameDecoder::new();
        let mut input = &expected[..];
        assert_eq!(dec.decode(&mut input).unwrap(), Some(msg));
        assert!(input.is_empty());
        dec.finish().unwrap();
    }

    fn h(b: u8) -> Hash {
        Hash([b; 32])
    }

    #[test]
    fn golden_hello() {
        golden(
            Message::Hello(Hello {
                version: 1,
                node: NodeId([0xab; 32]),
                models: vec![h(0x11)],
                limits: Limits {
                    max_concurrent_requests: 300,
                },
            }),
            &[
                &[69, 0, 0, 0], // frame length 69, u32 LE
                &[0],           // tag: Hello
                &[1],           // version 1 (varint)
                &[0xab; 32],    // node id: 32 raw bytes
                &[1],           // models: 1 entry
                &[0x11; 32],    //   model id: 32 raw bytes
                &[0xac, 0x02],  // max_concurrent_requests 300 = 0x2c|0x80, 300>>7
            ],
        );
    }

    #[test]
    fn golden_inventory() {
        let mut experts = ExpertSet::new(2, 3).unwrap();
        experts
            .insert(ExpertId {
                layer: 0,
                expert: 1,
            })
            .unwrap(); // bit 1
        experts
            .insert(ExpertId {
                layer: 1,
                expert: 2,
            })
            .unwrap(); // bit 1*3+2 = 5
        golden(
            Message::Inventory(Inventory {
                model: h(0x22),
                experts,
            }),
            &[
                &[37, 0, 0, 0], // frame length 37
                &[1],           // tag: Inventory
                &[0x22; 32],    // model id
                &[2],           // layers 2
                &[3],           // experts per layer 3
                &[1],           // bitmap: 1 byte (6 bits)
                &[0b0010_0010], //   bits 1 and 5, LSB first
            ],
        );
    }

    #[test]
    fn golden_offer() {
        let mut experts = ExpertSet::new(2, 3).unwrap();
        for (layer, expert) in [(0, 0), (1, 1)] {
            experts.insert(ExpertId { layer, expert }).unwrap(); // bits 0 and 1*3+1 = 4
        }
        golden(
            Message::Offer(Offer {
                model: h(0x44),
                experts,
            }),
            &[
                &[37, 0, 0, 0], // frame length 37
                &[12],          // tag: Offer
                &[0x44; 32],    // model id
                &[2],           // layers 2
                &[3],           // experts per layer 3
                &[1],           // bitmap: 1 byte (6 bits)
                &[0b0001_0001], //   bits 0 and 4, LSB first
            ],
        );
    }

    #[test]
    fn golden_placement() {
        let mut pinned = ExpertSet::new(2, 3).unwrap();
        pinned.insert(ExpertId::new(0, 1)).unwrap(); // bit 1
        let mut kept = ExpertSet::new(2, 3).unwrap();
        kept.insert(ExpertId::new(1, 0)).unwrap(); // bit 3
        let mut fetching = ExpertSet::new(2, 3).unwrap();
        fetching.insert(ExpertId::new(1, 2)).unwrap(); // bit 1*3+2 = 5
        golden(
            Message::Placement(Placement {
                model: h(0x55),
                budget: 300,
                used: 5,
                pinned,
                kept,
                fetching,
                demand: vec![(ExpertId::new(1, 0), 7)],
                leaving: true,
            }),
            &[
                &[53, 0, 0, 0],     // frame length 53
                &[15],              // tag: Placement
                &[0x55; 32],        // model id
                &[0xac, 0x02],      // budget 300 (varint)
                &[5],               // used 5
                &[2, 3, 1, 0b10],   // pinned: 2 layers x 3, 1 byte, bit 1
                &[2, 3, 1, 1 << 3], // kept: bit 3
                &[2, 3, 1, 1 << 5], // fetching: bit 5
                &[1],               // demand: 1 entry
                &[1, 0, 7],         //   layer 1, expert 0, count 7
                &[1],               // leaving: true
            ],
        );
        let too_many = Placement {
            model: h(0),
            budget: 0,
            used: 0,
            pinned: ExpertSet::new(1, 1).unwrap(),
            kept: ExpertSet::new(1, 1).unwrap(),
            fetching: ExpertSet::new(1, 1).unwrap(),
            demand: vec![(ExpertId::new(0, 0), 1); MAX_PLACEMENT_DEMAND + 1],
            leaving: false,
        };
        assert!(Message::Placement(too_many).validate().is_err());
    }

    #[test]
    fn golden_peers() {
        golden(
            Message::Peers(Peers {
                model: h(0x66),
                peers: vec![
                    PeerEntry {
                        node: NodeId([7; 32]),
                        addr: "127.0.0.2:4433".parse().unwrap(),
                    },
                    PeerEntry {
                        node: NodeId([8; 32]),
                        addr: "[::1]:300".parse().unwrap(),
                    },
                ],
            }),
            &[
                &[124, 0, 0, 0],    // frame length 124
                &[16],              // tag: Peers
                &[0x66; 32],        // model id
                &[2],               // 2 peers
                &[7; 32],           //   node key
                &[0, 127, 0, 0, 2], //   IPv4 (variant 0), 127.0.0.2
                &[0xd1, 0x22],      //   port 4433 (varint)
                &[8; 32],           //   node key
                &[1],               //   IPv6 (variant 1)
                &[0; 15],           //   ::1
                &[1],
                &[0xac, 0x02], //   port 300 (varint)
            ],
        );
        let too_many = Peers {
            model: h(0),
            peers: vec![
                PeerEntry {
                    node: NodeId([0; 32]),
                    addr: "127.0.0.1:1".parse().unwrap()
                };
                MAX_PEERS + 1
            ],
        };
        assert!(Message::Peers(too_many).validate().is_err());
    }

    #[test]
    fn golden_inventory_update() {
        golden(
            Message::InventoryUpdate(InventoryUpdate {
                model: h(0x33),
                added: vec![ExpertId {
                    layer: 1,
                    expert: 200,
                }],
                removed: vec![],
            }),
            &[
                &[38, 0, 0, 0], // frame length 38
                &[2],           // tag: InventoryUpdate
                &[0x33; 32],    // model id
                &[1],           // added: 1 entry
                &[1],           //   layer 1
                &[0xc8, 0x01],  //   expert 200 (varint)
                &[0],           // removed: empty
            ],
        );
    }

    #[test]
    fn golden_get() {
        golden(
            Message::Get(Get {
                request_id: RequestId(5),
                model: h(0x44),
                expert: ExpertId {
                    layer: 2,
                    expert: 7,
                },
                range: Some(ByteRange {
                    offset: 1 << 20,
                    len: 1 << 16,
                }),
                priority: Priority::Prefetch,
            }),
            &[
                &[44, 0, 0, 0],      // frame length 44
                &[3],                // tag: Get
                &[5],                // request id 5
                &[0x44; 32],         // model id
                &[2, 7],             // expert: layer 2, expert 7
                &[1],                // range: Some
                &[0x80, 0x80, 0x40], //   offset 2^20 (varint)
                &[0x80, 0x80, 0x04], //   len 2^16 (varint)
                &[1],                // priority: Prefetch
            ],
        );
        golden(
            Message::Get(Get {
                request_id: RequestId(0),
                model: h(0x44),
                expert: ExpertId {
                    layer: 0,
                    expert: 0,
                },
                range: None,
                priority: Priority::Now,
            }),
            &[
                &[38, 0, 0, 0], // frame length 38
                &[3],           // tag: Get
                &[0],           // request id 0
                &[0x44; 32],    // model id
                &[0, 0],        // expert 0:0
                &[0],           // range: None (whole expert)
                &[0],           // priority: Now
            ],
        );
    }

    #[test]
    fn golden_data_and_its_zero_copy_prefix() {
        let msg = Message::Data(Data {
            request_id: RequestId(300),
            offset: 128,
            bytes: Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef]),
        });
        let parts: &[&[u8]] = &[
            &[10, 0, 0, 0],            // frame length 10
            &[4],                      // tag: Data
            &[0xac, 0x02],             // request id 300
            &[0x80, 0x01],             // offset 128
            &[4],                      // 4 bytes follow
            &[0xde, 0xad, 0xbe, 0xef], // the bytes
        ];
        golden(msg, parts);
        let prefix = data_frame_prefix(RequestId(300), 128, 4);
        assert_eq!(prefix, parts[..5].concat());
    }

    #[test]
    fn golden_end_manifest_cancel_ping_pong() {
        golden(
            Message::End(End {
                request_id: RequestId(300),
            }),
            &[
                &[3, 0, 0, 0], // frame length 3
                &[5],          // tag: End
                &[0xac, 0x02], // request id 300
            ],
        );
        golden(
            Message::GetManifest(GetManifest {
                request_id: RequestId(0),
                model: h(0x55),
            }),
            &[
                &[34, 0, 0, 0], // frame length 34
                &[6],           // tag: GetManifest
                &[0],           // request id 0
                &[0x55; 32],    // model id
            ],
        );
        golden(
            Message::Cancel(Cancel {
                request_id: RequestId(7),
            }),
            &[
                &[2, 0, 0, 0], // frame length 2
                &[7],          // tag: Cancel
                &[7],          // request id 7
            ],
        );
        golden(
            Message::Ping(Ping { nonce: u64::MAX }),
            &[
                &[11, 0, 0, 0], // frame length 11
                &[8],           // tag: Ping
                &[0xff; 9],     // nonce u64::MAX: nine 7-bit groups with continuation...
                &[0x01],        // ...and the last bit
            ],
        );
        golden(
            Message::Pong(Pong { nonce: 1 }),
            &[
                &[2, 0, 0, 0], // frame length 2
                &[9],          // tag: Pong
                &[1],          // nonce 1
            ],
        );
    }

    #[test]
    fn golden_error() {
        golden(
            Message::Error(ErrorMessage::new(
                Some(RequestId(9)),
                ErrorCode::BUSY,
                "busy",
            )),
            &[
                &[9, 0, 0, 0], // frame length 9
                &[10],         // tag: Error
                &[1, 9],       // request id: Some(9)
                &[2],          // code 2: busy
                &[4],          // message: 4 bytes of UTF-8
                b"busy",
            ],
        );
        golden(
            Message::Error(ErrorMessage::new(None, ErrorCode::UNSUPPORTED_VERSION, "")),
            &[
                &[4, 0, 0, 0], // frame length 4
                &[10],         // tag: Error
                &[0],          // request id: None (connection-level)
                &[4],          // code 4: unsupported version
                &[0],          // message: empty
            ],
        );
    }

    #[test]
    fn golden_get_file() {
        golden(
            Message::GetFile(GetFile {
                request_id: RequestId(3),
                model: h(0x66),
                name: "config.json".into(),
                offset: 300,
                len: 1 << 20,
            }),
            &[
                &[51, 0, 0, 0],      // frame length 51
                &[11],               // tag: GetFile
                &[3],                // request id 3
                &[0x66; 32],         // model id
                &[11],               // name: 11 bytes of UTF-8
                b"config.json",      //
                &[0xac, 0x02],       // offset 300 (varint)
                &[0x80, 0x80, 0x40], // len 2^20 (varint)
            ],
        );
    }

    #[test]
    fn golden_exec_and_result() {
        golden(
            Message::Exec(Exec::new(
                RequestId(300),
                h(0x77),
                ExpertId {
                    layer: 23,
                    expert: 200,
                },
                2,
                &[1.0, -2.0],
            )),
            &[
                &[48, 0, 0, 0],            // frame length 48
                &[13],                     // tag: Exec
                &[0xac, 0x02],             // request id 300
                &[0x77; 32],               // model id
                &[23, 0xc8, 0x01],         // expert: layer 23, expert 200 (varint)
                &[2],                      // positions 2
                &[8],                      // 8 bytes of rows follow
                &[0x00, 0x00, 0x80, 0x3f], //   1.0 (f32 LE)
                &[0x00, 0x00, 0x00, 0xc0], //   -2.0
            ],
        );
        golden(
            Message::ExecResult(ExecResult::new(RequestId(300), &[f32::NAN])),
            &[
                &[8, 0, 0, 0],             // frame length 8
                &[14],                     // tag: ExecResult
                &[0xac, 0x02],             // request id 300
                &[4],                      // 4 bytes of rows follow
                &[0x00, 0x00, 0xc0, 0x7f], //   NaN (f32 LE): data, not an error
            ],
        );
    }

    #[test]
    fn exec_limits_are_checked_both_ways() {
        let exec = |positions: u32, len: usize| {
            Message::Exec(Exec {
                request_id: RequestId(1),
                model: h(0),
                expert: ExpertId {
                    layer: 0,
                    expert: 0,
                },
                positions,
                rows: Bytes::from(vec![0; len]),
            })
        };
        let result = |len: usize| {
            Message::ExecResult(ExecResult {
                request_id: RequestId(1),
                rows: Bytes::from(vec![0; len]),
            })
        };
        // The largest of each kind encodes, fits the frame limits and decodes.
        let largest = [
            exec(MAX_EXEC_POSITIONS, MAX_EXEC_ROWS_LEN),
            exec(1, MAX_EXEC_ROWS_LEN),
            result(MAX_EXEC_ROWS_LEN),
        ];
        for m in largest {
            let f = encode_frame(&m).unwrap();
            assert!(f.len() - 4 <= MAX_EXEC_FRAME_LEN, "{m:?}: {}", f.len());
            assert_eq!(decode_one(&f).unwrap(), Some(m));
        }
        for (bad, name) in [
            (exec(0, 4), "Exec"),
            (exec(MAX_EXEC_POSITIONS + 1, 4 * 65), "Exec"),
            (exec(1, 0), "Exec"),
            (exec(1, 6), "Exec"),
            (exec(3, 16), "Exec"), // 4 floats are not 3 rows
            (exec(1, MAX_EXEC_ROWS_LEN + 4), "Exec"),
            (result(0), "ExecResult"),
            (result(7), "ExecResult"),
            (result(MAX_EXEC_ROWS_LEN + 4), "ExecResult"),
        ] {
            assert!(
                matches!(encode_frame(&bad), Err(EncodeError::Invalid { .. })),
                "{bad:?}"
            );
            // Hand-encoded, the decoder refuses it too, naming the message.
            let mut body = vec![bad.tag()];
            match &bad {
                Message::Exec(e) => {
                    body.extend_from_slice(
                        &postcard::to_allocvec(&(
                            e.request_id.0,
                            e.model,
                            e.expert,
                            e.positions,
                            e.rows.len() as u64,
                        ))
                        .unwrap(),
                    );
                    body.extend_from_slice(&e.rows);
                }
                Message::ExecResult(r) => {
                    body.extend_from_slice(
                        &postcard::to_allocvec(&(r.request_id.0, r.rows.len() as u64)).unwrap(),
                    );
                    body.extend_from_slice(&r.rows);
                }
                _ => unreachable!(),
            }
            let got = FrameDecoder::with_max(1 << 21).decode(&mut &framed(&body)[..]);
            assert!(
                matches!(got, Err(DecodeError::Invalid { message, .. }) if message == name),
                "{bad:?}: {got:?}"
            );
        }
        // A length announced past the limit is refused before the rows are looked at, and
        // rows shorter or longer than announced are malformed.
        let mut body = vec![tag::EXEC_RESULT, 1];
        body.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(matches!(
            decode_one(&framed(&body)),
            Err(DecodeError::Invalid {
                message: "ExecResult",
                ..
            })
        ));
        assert!(matches!(
            decode_one(&framed(&[tag::EXEC_RESULT, 1, 8, 0, 0, 0, 0])),
            Err(DecodeError::Malformed {
                message: "ExecResult",
                ..
            })
        ));
        assert_eq!(
            decode_one(&framed(&[tag::EXEC_RESULT, 1, 4, 0, 0, 0, 0, 9])),
            Err(DecodeError::TrailingBytes {
                message: "ExecResult",
                extra: 1
            })
        );
        let mut short = vec![tag::EXEC, 1];
        short.extend_from_slice(&[0; 32]);
        short.extend_from_slice(&[0, 0, 1]); // expert 0:0, 1 position, then nothing
        assert!(matches!(
            decode_one(&framed(&short)),
            Err(DecodeError::Malformed {
                message: "Exec",
                ..
            })
        ));
    }

    #[test]
    fn exec_rows_are_slices_of_the_frame() {
        let f = encode_frame(&Message::Exec(Exec::new(
            RequestId(1),
            h(1),
            ExpertId {
                layer: 0,
                expert: 1,
            },
            1,
            &[3.0; 100],
        )))
        .unwrap();
        let body = Bytes::copy_from_slice(&f[4..]);
        let Message::Exec(e) = Message::decode_body(body.clone()).unwrap() else {
            panic!("not exec")
        };
        assert!(body.as_ptr_range().contains(&e.rows.as_ptr()));
        assert_eq!(e.rows_f32(), vec![3.0; 100]);
    }

    #[test]
    fn get_file_limits_are_checked_both_ways() {
        let get = |name: String, offset: u64, len: u64| {
            Message::GetFile(GetFile {
                request_id: RequestId(0),
                model: h(0),
                name,
                offset,
                len,
            })
        };
        let longest = get(
            "n".repeat(MAX_FILE_NAME_LEN),
            u64::MAX - MAX_FILE_RANGE_LEN,
            MAX_FILE_RANGE_LEN,
        );
        let f = encode_frame(&longest).unwrap();
        assert_eq!(decode_one(&f).unwrap(), Some(longest));
        for bad in [
            get("n".repeat(MAX_FILE_NAME_LEN + 1), 0, 1),
            get("a".into(), 0, 0),
            get("a".into(), 0, MAX_FILE_RANGE_LEN + 1),
            get("a".into(), u64::MAX, 1),
        ] {
            assert!(
                matches!(encode_frame(&bad), Err(EncodeError::Invalid { .. })),
                "{bad:?}"
            );
            // Hand-encoded, the decoder refuses it too.
            let Message::GetFile(g) = &bad else {
                unreachable!()
            };
            let mut body = vec![tag::GET_FILE];
            body.extend_from_slice(&postcard::to_allocvec(g).unwrap());
            assert!(
                matches!(
                    decode_one(&framed(&body)),
                    Err(DecodeError::Invalid {
                        message: "GetFile",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn file_names_are_names_not_paths() {
        for ok in [
            "config.json",
            "model-00001-of-00002.safetensors",
            "tokenizer.json",
            "..x",
            "a..b",
        ] {
            check_file_name(ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "../config.json",
            "a/b",
            "/etc/passwd",
            "a\\b",
            "C:\\x",
            "a\0b",
        ] {
            assert!(check_file_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_file_name(&"x".repeat(MAX_FILE_NAME_LEN + 1)).is_err());
    }

    #[test]
    fn error_codes_are_pinned() {
        let codes = [
            (ErrorCode::NO_ERROR, 0),
            (ErrorCode::NOT_FOUND, 1),
            (ErrorCode::BUSY, 2),
            (ErrorCode::BAD_REQUEST, 3),
            (ErrorCode::UNSUPPORTED_VERSION, 4),
            (ErrorCode::INTERNAL, 5),
            (ErrorCode::OUT_OF_RANGE, 6),
            (ErrorCode::PROTOCOL_VIOLATION, 7),
            (ErrorCode::FORBIDDEN, 8),
        ];
        for (c, n) in codes {
            assert_eq!(c.0, n);
            assert!(c.name().is_some());
        }
        assert_eq!(ErrorCode(999).to_string(), "unknown(999)");
        assert_eq!(crate::ALPN, b"stormo/2");
    }

    #[test]
    fn long_error_messages_are_cut_at_a_char_boundary() {
        let e = ErrorMessage::new(None, ErrorCode::INTERNAL, "é".repeat(MAX_ERROR_MESSAGE_LEN));
        assert!(e.message.len() <= MAX_ERROR_MESSAGE_LEN);
        assert_eq!(e.message.len(), MAX_ERROR_MESSAGE_LEN); // 512 two-byte chars
        encode_frame(&Message::Error(e)).unwrap();
    }

    /// The largest valid message of every kind fits a frame: the frame limit never refuses a
    /// valid message.
    #[test]
    fn largest_valid_messages_fit_the_frame_limit() {
        let max_expert = ExpertId {
            layer: u16::MAX,
            expert: u16::MAX,
        };
        let mut full = ExpertSet::new(256, 4096).unwrap();
        for l in [0, 255] {
            full.insert(ExpertId {
                layer: l,
                expert: 4095,
            })
            .unwrap();
        }
        let big: Vec<Message> = vec![
            Message::Hello(Hello {
                version: u32::MAX,
                node: NodeId([0xff; 32]),
                models: vec![h(1); MAX_MODELS],
                limits: Limits {
                    max_concurrent_requests: u32::MAX,
                },
            }),
            Message::Inventory(Inventory {
                model: h(2),
                experts: full,
            }),
            Message::InventoryUpdate(InventoryUpdate {
                model: h(3),
                added: vec![max_expert; MAX_UPDATE_EXPERTS / 2],
                removed: vec![max_expert; MAX_UPDATE_EXPERTS / 2],
            }),
            Message::Get(Get {
                request_id: RequestId(u64::MAX),
                model: h(4),
                expert: max_expert,
                range: Some(ByteRange {
                    offset: u64::MAX - 1,
                    len: 1,
                }),
                priority: Priority::Prefetch,
            }),
            Message::Data(Data {
                request_id: RequestId(u64::MAX),
                offset: u64::MAX - MAX_DATA_LEN as u64,
                bytes: Bytes::from(vec![7; MAX_DATA_LEN]),
            }),
            Message::Error(ErrorMessage::new(
                Some(RequestId(u64::MAX)),
                ErrorCode(u16::MAX),
                "x".repeat(MAX_ERROR_MESSAGE_LEN),
            )),
        ];
        for m in big {
            let f = encode_frame(&m).unwrap_or_else(|e| panic!("{}: {e}", m.name()));
            assert!(f.len() - 4 <= MAX_FRAME_LEN);
            let mut dec = FrameDecoder::new();
            assert_eq!(dec.decode(&mut &f[..]).unwrap(), Some(m));
        }
    }

    #[test]
    fn over_limit_messages_are_refused_on_encode() {
        let bad: Vec<Message> = vec![
            Message::Hello(Hello {
                version: 1,
                node: NodeId([0; 32]),
                models: vec![h(1); MAX_MODELS + 1],
                limits: Limits {
                    max_concurrent_requests: 1,
                },
            }),
            Message::Hello(Hello {
                version: 1,
                node: NodeId([0; 32]),
                models: vec![],
                limits: Limits {
                    max_concurrent_requests: 0,
                },
            }),
            Message::Data(Data {
                request_id: RequestId(0),
                offset: 0,
                bytes: Bytes::from(vec![0; MAX_DATA_LEN + 1]),
            }),
            Message::Data(Data {
                request_id: RequestId(0),
                offset: 0,
                bytes: Bytes::new(),
            }),
            Message::Data(Data {
                request_id: RequestId(0),
                offset: u64::MAX,
                bytes: Bytes::from_static(b"x"),
            }),
            Message::Get(Get {
                request_id: RequestId(0),
                model: h(0),
                expert: ExpertId {
                    layer: 0,
                    expert: 0,
                },
                range: Some(ByteRange { offset: 3, len: 0 }),
                priority: Priority::Now,
            }),
            Message::InventoryUpdate(InventoryUpdate {
                model: h(0),
                added: vec![
                    ExpertId {
                        layer: 0,
                        expert: 0
                    };
                    MAX_UPDATE_EXPERTS + 1
                ],
                removed: vec![],
            }),
            Message::Error(ErrorMessage {
                request_id: None,
                code: ErrorCode::INTERNAL,
                message: "x".repeat(MAX_ERROR_MESSAGE_LEN + 1),
            }),
        ];
        for m in bad {
            let mut out = vec![1, 2, 3];
            let err = crate::frame::append_frame(&m, &mut out).unwrap_err();
            assert!(matches!(err, EncodeError::Invalid { .. }), "{err}");
            assert_eq!(out, [1, 2, 3], "nothing appended on error");
        }
    }

    fn decode_one(frame: &[u8]) -> Result<Option<Message>, DecodeError> {
        FrameDecoder::new().decode(&mut &frame[..])
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn reserved_tags_are_unknown() {
        for t in tag::FIRST_RESERVED..=255 {
            assert_eq!(
                decode_one(&framed(&[t, 0, 0])),
                Err(DecodeError::UnknownTag(t))
            );
            assert_eq!(tag_name(t), None);
        }
    }

    #[test]
    fn malformed_bodies_name_the_message_and_the_fault() {
        // A varint cut short.
        assert!(matches!(
            decode_one(&framed(&[tag::END, 0x80])),
            Err(DecodeError::Malformed { message: "End", .. })
        ));
        // A byte after a complete Cancel.
        assert_eq!(
            decode_one(&framed(&[tag::CANCEL, 7, 0])),
            Err(DecodeError::TrailingBytes {
                message: "Cancel",
                extra: 1
            })
        );
        // Option tag 2.
        let mut get = vec![tag::GET, 0];
        get.extend_from_slice(&[0; 32]);
        get.extend_from_slice(&[0, 0, 2]);
        assert!(matches!(
            decode_one(&framed(&get)),
            Err(DecodeError::Malformed { message: "Get", .. })
        ));
        // Priority 2 does not exist.
        get.truncate(get.len() - 1);
        get.extend_from_slice(&[0, 2]);
        assert!(matches!(
            decode_one(&framed(&get)),
            Err(DecodeError::Malformed { message: "Get", .. })
        ));
        // Invalid UTF-8 in an error message.
        assert!(matches!(
            decode_one(&framed(&[tag::ERROR, 0, 1, 2, 0xff, 0xfe])),
            Err(DecodeError::Malformed {
                message: "Error",
                ..
            })
        ));
        // Data announcing more bytes than the frame holds, fewer, and over the limit.
        assert!(matches!(
            decode_one(&framed(&[tag::DATA, 0, 0, 3, 1, 2])),
            Err(DecodeError::Malformed {
                message: "Data",
                ..
            })
        ));
        assert_eq!(
            decode_one(&framed(&[tag::DATA, 0, 0, 1, 1, 2])),
            Err(DecodeError::TrailingBytes {
                message: "Data",
                extra: 1
            })
        );
        assert!(matches!(
            decode_one(&framed(&[tag::DATA, 0, 0, 0x81, 0x80, 0x40])),
            Err(DecodeError::Invalid {
                message: "Data",
                ..
            })
        ));
        // Empty data.
        assert!(matches!(
            decode_one(&framed(&[tag::DATA, 0, 0, 0])),
            Err(DecodeError::Invalid {
                message: "Data",
                ..
            })
        ));
        // An inventory whose padding bits are set.
        let mut inv = vec![tag::INVENTORY];
        inv.extend_from_slice(&[0; 32]);
        inv.extend_from_slice(&[1, 3, 1, 0b1000]);
        assert!(matches!(
            decode_one(&framed(&inv)),
            Err(DecodeError::Invalid {
                message: "Inventory",
                ..
            })
        ));
    }

    #[test]
    fn data_payload_is_a_slice_of_the_frame() {
        let f = encode_frame(&Message::Data(Data {
            request_id: RequestId(1),
            offset: 0,
            bytes: Bytes::from(vec![9; 1000]),
        }))
        .unwrap();
        let body = Bytes::copy_from_slice(&f[4..]);
        let Message::Data(d) = Message::decode_body(body.clone()).unwrap() else {
            panic!("not data")
        };
        let inside = body.as_ptr_range();
        assert!(inside.contains(&d.bytes.as_ptr()), "payload was copied");
    }
}
