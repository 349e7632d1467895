//! Length-prefixed frames on a byte stream, and the streaming decoder.
//!
//! A frame is a 4-byte little-endian body length `n` (1 ≤ `n` ≤ the decoder's maximum, at
//! most [`MAX_FRAME_LEN`]) followed by `n` bytes of body: a message tag and its payload (see
//! [`crate::message`]). The decoder checks `n` as soon as the 4 length bytes are in, before it
//! allocates anything, and then allocates exactly `n` bytes: a peer cannot make it hold more
//! than one maximum-size frame per stream.
//!
//! [`FrameDecoder::decode`] hands out whole messages. [`FrameDecoder::decode_streaming`] does
//! the same for every message but [`Data`](crate::Data): once a Data frame's header (request
//! id, offset, payload length) is in and checked, it hands out the header and then the payload
//! in pieces as they arrive, borrowed from the caller's input, so a requester can write them
//! straight into the buffer the record ends up in (no reassembly copy). The same bytes are
//! refused with the same errors either way, only sooner in the streaming mode (at the header
//! rather than at the frame's last byte).

use bytes::Bytes;

use crate::message::{tag, EncodeError, Message, RequestId, MAX_DATA_LEN};

/// The largest frame body: one maximum [`crate::Data`] payload plus room for its header.
/// Every valid message of every other kind fits well within it (tested).
pub const MAX_FRAME_LEN: usize = MAX_DATA_LEN + 64;

/// Bytes of the length prefix.
pub const LEN_PREFIX: usize = 4;

/// Why bytes from a peer are not a valid frame. After any of these the stream's framing is lost:
/// close the stream (or the connection, with [`crate::ErrorCode::PROTOCOL_VIOLATION`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The length prefix announces more than the limit (checked before allocating).
    #[error("frame of {len} bytes announced, over the limit of {max}")]
    Oversized {
        /// The announced body length.
        len: u64,
        /// The limit in force.
        max: usize,
    },
    /// The length prefix is zero: a frame has at least its tag.
    #[error("empty frame (length 0)")]
    EmptyFrame,
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame: {have} of {need} bytes")]
    Truncated {
        /// Bytes of the frame (prefix included) that arrived.
        have: usize,
        /// Bytes the frame needed (prefix included; 4 while the prefix is incomplete).
        need: usize,
    },
    /// The tag is not a message of this protocol version.
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    /// The payload is not valid postcard for the message.
    #[error("malformed {message}: {source}")]
    Malformed {
        /// The message's name.
        message: &'static str,
        /// What postcard found.
        source: postcard::Error,
    },
    /// Bytes left in the frame after the message.
    #[error("{extra} trailing bytes after {message}")]
    TrailingBytes {
        /// The message's name.
        message: &'static str,
        /// How many.
        extra: usize,
    },
    /// The message decodes but breaks a limit of the protocol.
    #[error("invalid {message}: {reason}")]
    Invalid {
        /// The message's name.
        message: &'static str,
        /// The limit broken.
        reason: String,
    },
    /// An earlier error already broke this stream's framing.
    #[error("decoder used after an error")]
    Poisoned,
    /// [`FrameDecoder::decode`] was called in the middle of a Data frame that
    /// [`FrameDecoder::decode_streaming`] is handing out in pieces (a caller's mistake: use
    /// one mode per stream).
    #[error("whole-frame decoding asked for in the middle of a streamed Data frame")]
    MixedModes,
}

/// The most bytes of a Data frame's body before its payload: the tag and three varints.
const DATA_HEAD_MAX: usize = 1 + 3 * 10;

/// What [`FrameDecoder::decode_streaming`] hands out.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// A whole message that is not [`crate::Data`].
    Message(Message),
    /// The header of a Data frame, checked (payload 1 to [`MAX_DATA_LEN`] bytes, its end
    /// within `u64`): `len` payload bytes at `offset` of request `request_id` follow as
    /// [`Piece::DataBytes`].
    DataHeader {
        /// The request being answered.
        request_id: RequestId,
        /// Offset of the payload's first byte within the resource.
        offset: u64,
        /// Payload bytes in the frame.
        len: u64,
    },
    /// Payload bytes of the current Data frame, borrowed from the input.
    DataBytes {
        /// The request being answered (from the header).
        request_id: RequestId,
        /// Offset of `bytes[0]` within the resource.
        offset: u64,
        /// The bytes (at least one).
        bytes: &'a [u8],
        /// Whether these are the frame's last payload bytes.
        last: bool,
    },
}

/// Where the decoder is within the current frame's body.
#[derive(Debug)]
enum Body {
    /// Between frames (or inside the length prefix).
    None,
    /// Streaming mode, the first bytes of a body (the tag and, for Data, the header).
    Head {
        bytes: [u8; DATA_HEAD_MAX],
        have: usize,
    },
    /// A whole body being filled; its capacity is exactly the announced length.
    Whole(Vec<u8>),
    /// Streaming a Data payload: the header's fields, and the payload bytes handed out.
    Payload {
        request_id: RequestId,
        offset: u64,
        len: u64,
        done: u64,
    },
}

/// Encodes `msg` as one complete frame (length prefix + body).
pub fn encode_frame(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    append_frame(msg, &mut out)?;
    Ok(out)
}

/// Appends `msg` as one complete frame to `out`. On error nothing is appended.
pub fn append_frame(msg: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0; LEN_PREFIX]);
    if let Err(e) = msg.encode_body(out) {
        out.truncate(start);
        return Err(e);
    }
    let len = (out.len() - start - LEN_PREFIX) as u32;
    out[start..start + LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// A streaming frame decoder for one byte stream.
///
/// Feed it whatever the transport delivers, split anywhere; it yields each message as soon as
/// its last byte arrives. It never panics, holds at most one frame, and after an error returns
/// [`DecodeError::Poisoned`].
///
/// ```
/// use stormo_wire::{encode_frame, FrameDecoder, Message, Ping};
/// let bytes = encode_frame(&Message::Ping(Ping { nonce: 7 })).unwrap();
/// let mut dec = FrameDecoder::new();
/// let (a, b) = bytes.split_at(3);
/// let mut input = a;
/// assert_eq!(dec.decode(&mut input).unwrap(), None);
/// let mut input = b;
/// assert_eq!(dec.decode(&mut input).unwrap(), Some(Message::Ping(Ping { nonce: 7 })));
/// dec.finish().unwrap();
/// ```
#[derive(Debug)]
pub struct FrameDecoder {
    max: usize,
    prefix: [u8; LEN_PREFIX],
    prefix_have: usize,
    body: Body,
    need: usize,
    poisoned: bool,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder accepting frames up to [`MAX_FRAME_LEN`].
    pub fn new() -> Self {
        Self::with_max(MAX_FRAME_LEN)
    }

    /// A decoder accepting frames up to `max` bytes (clamped to [`MAX_FRAME_LEN`]), e.g. a
    /// smaller limit for a control stream.
    pub fn with_max(max: usize) -> Self {
        Self {
            max: max.min(MAX_FRAME_LEN),
            prefix: [0; LEN_PREFIX],
            prefix_have: 0,
            body: Body::None,
            need: 0,
            poisoned: false,
        }
    }

    /// The largest frame body this decoder accepts.
    pub fn max_frame_len(&self) -> usize {
        self.max
    }

    /// Consumes bytes from the front of `input` up to the end of the next frame. Returns
    /// `Ok(Some(message))` when a frame completed (`input` then holds the bytes after it), or
    /// `Ok(None)` when `input` was used up without completing one. Call it in a loop until
    /// `input` is empty.
    pub fn decode(&mut self, input: &mut &[u8]) -> Result<Option<Message>, DecodeError> {
        if self.poisoned {
            return Err(DecodeError::Poisoned);
        }
        let res = self.decode_inner(input);
        if res.is_err() {
            self.poison();
        }
        res
    }

    fn poison(&mut self) {
        self.poisoned = true;
        self.body = Body::None;
    }

    /// Reads the length prefix; once it is complete, checks it and returns `true`.
    fn read_prefix(&mut self, input: &mut &[u8]) -> Result<bool, DecodeError> {
        let take = (LEN_PREFIX - self.prefix_have).min(input.len());
        self.prefix[self.prefix_have..self.prefix_have + take].copy_from_slice(&input[..take]);
        self.prefix_have += take;
        *input = &input[take..];
        if self.prefix_have < LEN_PREFIX {
            return Ok(false);
        }
        let len = u32::from_le_bytes(self.prefix) as u64;
        if len == 0 {
            return Err(DecodeError::EmptyFrame);
        }
        if len > self.max as u64 {
            return Err(DecodeError::Oversized { len, max: self.max });
        }
        self.need = len as usize;
        Ok(true)
    }

    fn decode_inner(&mut self, input: &mut &[u8]) -> Result<Option<Message>, DecodeError> {
        match &mut self.body {
            Body::None => {
                if !self.read_prefix(input)? {
                    return Ok(None);
                }
                self.body = Body::Whole(Vec::with_capacity(self.need));
            }
            Body::Head { bytes, have } => {
                let mut v = Vec::with_capacity(self.need);
                v.extend_from_slice(&bytes[..*have]);
                self.body = Body::Whole(v);
            }
            Body::Whole(_) => {}
            Body::Payload { .. } => return Err(DecodeError::MixedModes),
        }
        self.fill_whole(input)
    }

    /// Fills the whole body from `input`; decodes it once complete.
    fn fill_whole(&mut self, input: &mut &[u8]) -> Result<Option<Message>, DecodeError> {
        let Body::Whole(body) = &mut self.body else {
            unreachable!("fill_whole is called with a whole body")
        };
        let take = (self.need - body.len()).min(input.len());
        body.extend_from_slice(&input[..take]);
        *input = &input[take..];
        if body.len() < self.need {
            return Ok(None);
        }
        let Body::Whole(body) = std::mem::replace(&mut self.body, Body::None) else {
            unreachable!("checked above")
        };
        self.prefix_have = 0;
        Message::decode_body(Bytes::from(body)).map(Some)
    }

    /// Like [`FrameDecoder::decode`], but a Data frame comes out as a [`Piece::DataHeader`]
    /// and then [`Piece::DataBytes`] as its payload arrives (borrowed from `input`), not as one
    /// message. Consumes bytes from the front of `input` up to the end of the piece returned;
    /// `Ok(None)` when `input` was used up without completing one. Call it in a loop until
    /// `input` is empty. Every other message comes out whole, as from `decode`.
    pub fn decode_streaming<'a>(
        &mut self,
        input: &mut &'a [u8],
    ) -> Result<Option<Piece<'a>>, DecodeError> {
        if self.poisoned {
            return Err(DecodeError::Poisoned);
        }
        let res = self.streaming_inner(input);
        if res.is_err() {
            self.poison();
        }
        res
    }

    fn streaming_inner<'a>(
        &mut self,
        input: &mut &'a [u8],
    ) -> Result<Option<Piece<'a>>, DecodeError> {
        loop {
            match &mut self.body {
                Body::None => {
                    if !self.read_prefix(input)? {
                        return Ok(None);
                    }
                    self.body = Body::Head {
                        bytes: [0; DATA_HEAD_MAX],
                        have: 0,
                    };
                }
                Body::Head { bytes, have } => {
                    let room = DATA_HEAD_MAX.min(self.need);
                    if *have == 0 {
                        // The tag alone decides the mode.
                        let Some(&t) = input.first() else {
                            return Ok(None);
                        };
                        if t != tag::DATA {
                            self.body = Body::Whole(Vec::with_capacity(self.need));
                            continue;
                        }
                    }
                    let have_before = *have;
                    let take = (room - have_before).min(input.len());
                    bytes[have_before..have_before + take].copy_from_slice(&input[..take]);
                    *have += take;
                    let (bytes, have) = (*bytes, *have);
                    match postcard::take_from_bytes::<(u64, u64, u64)>(&bytes[1..have]) {
                        Ok(((request_id, offset, len), rest)) => {
                            // The header ends within what this call copied (it was incomplete
                            // before): leave the payload bytes copied with it in `input`.
                            let head = have - rest.len();
                            *input = &input[head - have_before..];
                            return self.start_payload(RequestId(request_id), offset, len, head);
                        }
                        Err(postcard::Error::DeserializeUnexpectedEnd) if have < room => {
                            *input = &input[take..];
                            return Ok(None);
                        }
                        Err(source) => {
                            return Err(DecodeError::Malformed {
                                message: "Data",
                                source,
                            })
                        }
                    }
                }
                Body::Whole(_) => {
                    return Ok(self.fill_whole(input)?.map(Piece::Message));
                }
                Body::Payload {
                    request_id,
                    offset,
                    len,
                    done,
                } => {
                    if input.is_empty() {
                        return Ok(None);
                    }
                    let take = ((*len - *done) as usize).min(input.len());
                    let (bytes, rest) = input.split_at(take);
                    *input = rest;
                    let piece = Piece::DataBytes {
                        request_id: *request_id,
                        offset: *offset + *done,
                        bytes,
                        last: *done + take as u64 == *len,
                    };
                    *done += take as u64;
                    if *done == *len {
                        self.body = Body::None;
                        self.prefix_have = 0;
                    }
                    return Ok(Some(piece));
                }
            }
        }
    }

    /// Checks a Data header as [`Message::decode_body`] checks a whole Data frame, and starts
    /// streaming its payload. `head` bytes of the body are the tag and header.
    fn start_payload<'a>(
        &mut self,
        request_id: RequestId,
        offset: u64,
        len: u64,
        head: usize,
    ) -> Result<Option<Piece<'a>>, DecodeError> {
        if len > MAX_DATA_LEN as u64 {
            return Err(DecodeError::Invalid {
                message: "Data",
                reason: format!("{len} bytes of data, over the limit of {MAX_DATA_LEN}"),
            });
        }
        let room = (self.need - head) as u64;
        if len > room {
            return Err(DecodeError::Malformed {
                message: "Data",
                source: postcard::Error::DeserializeUnexpectedEnd,
            });
        }
        if len < room {
            return Err(DecodeError::TrailingBytes {
                message: "Data",
                extra: (room - len) as usize,
            });
        }
        if len == 0 {
            return Err(DecodeError::Invalid {
                message: "Data",
                reason: "empty data".into(),
            });
        }
        if offset.checked_add(len).is_none() {
            return Err(DecodeError::Invalid {
                message: "Data",
                reason: format!("data at offset {offset} overflows u64"),
            });
        }
        self.body = Body::Payload {
            request_id,
            offset,
            len,
            done: 0,
        };
        Ok(Some(Piece::DataHeader {
            request_id,
            offset,
            len,
        }))
    }

    /// Decodes every complete frame in `input`, appending the messages to `out`. Stops at the
    /// first error (the messages before it are kept in `out`).
    pub fn decode_all(
        &mut self,
        mut input: &[u8],
        out: &mut Vec<Message>,
    ) -> Result<(), DecodeError> {
        while !input.is_empty() {
            if let Some(m) = self.decode(&mut input)? {
                out.push(m);
            }
        }
        Ok(())
    }

    /// Whether the decoder holds part of a frame.
    pub fn is_mid_frame(&self) -> bool {
        self.prefix_have > 0 || !matches!(self.body, Body::None)
    }

    /// Call at the end of the stream: an error if it ended inside a frame.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.poisoned {
            return Err(DecodeError::Poisoned);
        }
        let body_have = match &self.body {
            Body::None if self.prefix_have > 0 => {
                return Err(DecodeError::Truncated {
                    have: self.prefix_have,
                    need: LEN_PREFIX,
                })
            }
            Body::None => return Ok(()),
            Body::Head { have, .. } => *have,
            Body::Whole(b) => b.len(),
            Body::Payload { len, done, .. } => self.need - (len - done) as usize,
        };
        Err(DecodeError::Truncated {
            have: LEN_PREFIX + body_have,
            need: LEN_PREFIX + self.need,
        })
    }
}
