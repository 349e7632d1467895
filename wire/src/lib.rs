//! stormo's protocol between nodes, sans-IO: messages, framing, and the state machines of a
//! request's two ends.
//!
//! # What this crate owns
//! - The versioned ALPN ([`ALPN`]) and [`PROTOCOL_VERSION`], the error codes ([`ErrorCode`]),
//!   and every message with its exact bytes ([`message`]).
//! - Framing on a byte stream and a streaming decoder that survives any input ([`frame`]).
//! - The requester's state ([`Requests`]): ids, deadlines, reassembly, in-order and bounds
//!   rules, chunk verification through a [`ChunkVerifier`].
//! - The responder's state ([`Server`]): parsing, per-peer concurrency with `busy` answers,
//!   cancellation.
//! - Helpers: inventories as bitmaps ([`ExpertSet`]), round-trip estimation ([`Pinger`]), the
//!   Hello check ([`expect_hello`]).
//!
//! # Goals
//! - Safe to expose to strangers: every limit is checked before allocating; no input panics;
//!   every refusal names what is wrong.
//! - Stable bytes: explicit tags, golden tests of every message, reserved tags for later.
//! - Deterministic: time is an argument (`std::time::Instant`), so two instances can be stepped
//!   in a test without a clock or a network.
//!
//! # Non-goals
//! - No I/O, no async runtime, no sockets, no TLS (the `node` crate builds the QUIC endpoint
//!   with quinn on top of this). An import of tokio does not compile here:
//!   ```compile_fail
//!   use tokio as _;
//!   ```
//! - No manifest format and no hashing policy: manifests are opaque bytes, and chunk checks are
//!   the caller's [`ChunkVerifier`] (implemented by `stormo-manifests`). Ids and hashes come
//!   from the leaf crate `stormo-ids` (the types `stormo-manifests` re-exports), so this crate
//!   does not compile the engine that manifests are built with.
//! - No peer selection, hedging or fallback policy: that is the node's, fed by the events and
//!   [`RttEstimator`] here.
//!
//! # Mapping onto QUIC
//! One QUIC connection per pair of nodes, TLS 1.3 with both sides authenticated by their
//! Ed25519 node keys, ALPN [`ALPN`].
//! - **Control stream**: the connecting side opens the first bidirectional stream. Each side
//!   sends [`Hello`] first (check the peer's with [`expect_hello`], against the key TLS proved),
//!   then [`Inventory`] for each model it serves, later [`InventoryUpdate`]s, [`Ping`]/[`Pong`],
//!   and a connection-level [`ErrorMessage`] (no request id) before closing.
//! - **One bidirectional stream per request**, opened by the requester: it writes [`Get`],
//!   [`GetManifest`] or [`GetFile`] (and possibly [`Cancel`] later, or resets the stream); the responder writes
//!   [`Data`]\* then [`End`], or an [`ErrorMessage`], then finishes the stream. An [`Exec`]
//!   is answered by one [`ExecResult`] or an [`ErrorMessage`].
//!   [`Message::request_id`] routes each message from `poll_transmit` to its stream.
//!   Request ids are per direction: answers on streams this node opened go to its
//!   [`Requests`], requests on streams the peer opened go to its [`Server`], and the two id
//!   spaces never mix. Closing a request's stream early (reset / stop) means the same as
//!   [`Cancel`]: feed the [`Server`] a `Cancel` for it.
//! - A frame that does not decode closes the connection with
//!   [`ErrorCode::PROTOCOL_VIOLATION`]; it never takes down the node.
//!
//! # Frame format
//! ```text
//! +----------------+-----+---------------------------+
//! | len: u32 LE    | tag | payload (postcard)        |
//! +----------------+-----+---------------------------+
//!   4 bytes          1     len - 1 bytes
//! ```
//! `1 ≤ len ≤` [`MAX_FRAME_LEN`] (1 MiB + 64), checked before anything is allocated. postcard
//! writes integers (`u16`, `u32`, `u64`) as LEB128 varints, `u8` and fixed arrays (`[u8; 32]`,
//! `Hash`, `NodeId`) as raw bytes, `Vec`/`String` as a varint length then the elements,
//! `Option` as `00` or `01` + value, and an enum as its varint variant index + fields.
//!
//! # Messages
//! | tag | message | fields (in order) | sent on |
//! |---|---|---|---|
//! | 0 | [`Hello`] | version u32, node `[u8; 32]`, models Vec\<Hash\> (≤ [`MAX_MODELS`]), limits {max_concurrent_requests u32} | control |
//! | 1 | [`Inventory`] | model Hash, experts {layers u16, experts_per_layer u16, bitmap Vec\<u8\>} | control |
//! | 2 | [`InventoryUpdate`] | model Hash, added Vec\<ExpertId\>, removed Vec\<ExpertId\> (≤ [`MAX_UPDATE_EXPERTS`] together) | control |
//! | 3 | [`Get`] | request_id u64, model Hash, expert {layer u16, expert u16}, range Option\<{offset u64, len u64}\>, priority {0 Now, 1 Prefetch} | request |
//! | 4 | [`Data`] | request_id u64, offset u64, bytes (varint length 1..=[`MAX_DATA_LEN`] + raw) | request |
//! | 5 | [`End`] | request_id u64 | request |
//! | 6 | [`GetManifest`] | request_id u64, model Hash | request |
//! | 7 | [`Cancel`] | request_id u64 | request |
//! | 8 | [`Ping`] | nonce u64 | control |
//! | 9 | [`Pong`] | nonce u64 | control |
//! | 10 | [`ErrorMessage`] | request_id Option\<u64\>, code u16, message String (≤ [`MAX_ERROR_MESSAGE_LEN`]) | either |
//! | 11 | [`GetFile`] | request_id u64, model Hash, name String (≤ [`MAX_FILE_NAME_LEN`]), offset u64, len u64 (1..=[`MAX_FILE_RANGE_LEN`]) | request |
//! | 12 | [`Offer`] | model Hash, experts {layers u16, experts_per_layer u16, bitmap Vec\<u8\>} | control |
//! | 13 | [`Exec`] | request_id u64, model Hash, expert {layer u16, expert u16}, positions u32 (1..=[`MAX_EXEC_POSITIONS`]), rows (varint length + raw f32 LE `[positions, hidden]`, ≤ [`MAX_EXEC_ROWS_LEN`]) | request |
//! | 14 | [`ExecResult`] | request_id u64, rows (varint length + raw f32 LE, ≤ [`MAX_EXEC_ROWS_LEN`]) | request |
//! | 15 | [`Placement`] | model Hash, budget u64, used u64, pinned ExpertSet, kept ExpertSet, fetching ExpertSet, demand Vec\<(ExpertId, u32)\> (at most 256), leaving bool | control |
//! | 16 | [`Peers`] | model Hash, peers Vec\<{node `[u8; 32]`, addr SocketAddr: 0 + 4 bytes or 1 + 16 bytes, then port u16}\> (at most 64) | control |
//! | 17–127 | reserved | decoding yields [`DecodeError::UnknownTag`] | |
//!
//! A manifest is answered like an expert, as `Data` frames from offset 0 and `End`, so it
//! is bounded by the requester's limit ([`MAX_MANIFEST_LEN`] by default), not by the frame size.
//! A file range ([`GetFile`], for `stormo pull`) is answered the same way, from its offset.
//!
//! # Remote execution
//! An [`Exec`] asks the responder to run one expert it holds over some positions' input rows;
//! it answers one [`ExecResult`] with the output rows (the same shape), or an
//! [`ErrorMessage`] (`busy` beyond its compute limits), on the request's own stream. Rows
//! travel as exact f32, little-endian: `4 × hidden` bytes a position each way, 11,520 bytes at
//! gpt-oss-20b's hidden width of 2,880 (against 13.2 MB for fetching that expert's weights).
//! One call carries at most [`max_positions`] positions (22 at that width); more are split
//! into several calls. [`ExecCall`] checks an answer before its rows are used.
//!
//! # Stepping it
//! ```
//! use std::time::Instant;
//! use stormo_ids::{ExpertId, Hash};
//! use stormo_wire::*;
//!
//! let now = Instant::now();
//! let (model, expert) = (Hash::of(b"model"), ExpertId { layer: 0, expert: 3 });
//! let mut client = Requests::new(RequestsConfig::default());
//! let mut server = Server::new(ServerConfig::default());
//! let id = client.start(now, Fetch::expert(model, expert, 5)).unwrap();
//! while let Some(m) = client.poll_transmit() {
//!     server.handle_message(m).unwrap();
//! }
//! let Some(ServerEvent::Serve(req)) = server.poll_event() else { unreachable!() };
//! let range = req.resolve(5).unwrap();
//! for m in DataChunks::new(req.id, range.offset, bytes::Bytes::from_static(b"hello"), 2) {
//!     client.handle_message(now, m).unwrap();
//! }
//! assert!(server.complete(req.id));
//! let Some(Event::Completed(done)) = client.poll_event() else { unreachable!() };
//! assert_eq!((done.id, &done.bytes[..]), (id, &b"hello"[..]));
//! ```

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use bytes;

pub mod client;
pub mod exec;
pub mod frame;
pub mod handshake;
pub mod inventory;
pub mod latency;
pub mod message;
pub mod server;

pub use client::{
    Abandoned, ChunkVerifier, Completed, Event, Failed, Fetch, FetchError, RecordBuffer, Requests,
    RequestsConfig, Resource, StartError, UnexpectedMessage,
};
pub use exec::{check_shape, max_positions, ExecAnswerError, ExecCall, ExecRequestError};
pub use frame::{append_frame, encode_frame, DecodeError, FrameDecoder, Piece, MAX_FRAME_LEN};
pub use handshake::{expect_hello, HelloError};
pub use inventory::{ExpertSet, InventoryError};
pub use latency::{Pinger, RttEstimator};
pub use message::{
    check_file_name, data_frame_prefix, f32_bytes, f32s, tag, ByteRange, Cancel, Data, EncodeError,
    End, ErrorCode, ErrorMessage, Exec, ExecResult, Get, GetFile, GetManifest, Hello, Inventory,
    InventoryUpdate, Limits, Message, NodeId, Offer, PeerEntry, Peers, Ping, Placement, Pong,
    Priority, RequestId, MAX_DATA_LEN, MAX_ERROR_MESSAGE_LEN, MAX_EXEC_FRAME_LEN,
    MAX_EXEC_POSITIONS, MAX_EXEC_ROWS_LEN, MAX_FILE_NAME_LEN, MAX_FILE_RANGE_LEN, MAX_MANIFEST_LEN,
    MAX_MODELS, MAX_PEERS, MAX_PLACEMENT_DEMAND, MAX_UPDATE_EXPERTS,
};
pub use server::{DataChunks, ServeRequest, Server, ServerConfig, ServerEvent, ServerStats};

/// The ALPN protocol id of stormo's wire protocol, version line 2 (2 added [`Peers`]). Both
/// QUIC sides must offer exactly this; a peer of another line fails the TLS handshake.
pub const ALPN: &[u8] = b"stormo/2";

/// The protocol version sent in [`Hello`]. A peer whose version differs is refused with
/// [`ErrorCode::UNSUPPORTED_VERSION`].
pub const PROTOCOL_VERSION: u32 = 2;
