//! Length-prefixed frames on a byte stream, and the streaming decoder.
//!
//! A frame is a 4-byte little-endian body length `n` (1 ≤ `n` ≤ the decoder's maximum, at
//! most [`MAX_FRAME_LEN`]) followed by `n` bytes of body: a message tag and its payload (see
//! [`crate::message`]). The decoder checks `n` as soon as the 4 length bytes are in, before it
//! allocates anything, and then allocates exactly `n` bytes: a peer cannot make it hold more
//! than one maximum-size frame per stream.

use bytes::Bytes;

use crate::message::{EncodeError, Message, MAX_DATA_LEN};

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
    /// The body being filled; its capacity is exactly the announced length.
    body: Option<Vec<u8>>,
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
            body: None,
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
            self.poisoned = true;
            self.body = None;
        }
        res
    }

    fn decode_inner(&mut self, input: &mut &[u8]) -> Result<Option<Message>, DecodeError> {
        if self.body.is_none() {
            let take = (LEN_PREFIX - self.prefix_have).min(input.len());
            self.prefix[self.prefix_have..self.prefix_have + take].copy_from_slice(&input[..take]);
            self.prefix_have += take;
            *input = &input[take..];
            if self.prefix_have < LEN_PREFIX {
                return Ok(None);
            }
            let len = u32::from_le_bytes(self.prefix) as u64;
            if len == 0 {
                return Err(DecodeError::EmptyFrame);
            }
            if len > self.max as u64 {
                return Err(DecodeError::Oversized { len, max: self.max });
            }
            self.need = len as usize;
            self.body = Some(Vec::with_capacity(self.need));
        }
        let body = self.body.as_mut().expect("set just above");
        let take = (self.need - body.len()).min(input.len());
        body.extend_from_slice(&input[..take]);
        *input = &input[take..];
        if body.len() < self.need {
            return Ok(None);
        }
        let body = self.body.take().expect("checked above");
        self.prefix_have = 0;
        Message::decode_body(Bytes::from(body)).map(Some)
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
        self.prefix_have > 0 || self.body.is_some()
    }

    /// Call at the end of the stream: an error if it ended inside a frame.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.poisoned {
            return Err(DecodeError::Poisoned);
        }
        match &self.body {
            Some(b) => Err(DecodeError::Truncated {
                have: LEN_PREFIX + b.len(),
                need: LEN_PREFIX + self.need,
            }),
            None if self.prefix_have > 0 => Err(DecodeError::Truncated {
                have: self.prefix_have,
                need: LEN_PREFIX,
            }),
            None => Ok(()),
        }
    }
}
