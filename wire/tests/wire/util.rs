//! Two in-memory ends of one connection, and a BLAKE3 chunk verifier.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use stormo_ids::{ExpertId, Hash};
use stormo_wire::*;

/// A verifier that checks each chunk's BLAKE3 against a list (what the manifests crate will do).
pub(crate) struct Blake3Chunks {
    pub(crate) chunk_len: u64,
    pub(crate) total: u64,
    pub(crate) hashes: Vec<Hash>,
    pub(crate) checked: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Blake3Chunks {
    pub(crate) fn of(bytes: &[u8], chunk_len: usize) -> Self {
        Self {
            chunk_len: chunk_len as u64,
            total: bytes.len() as u64,
            hashes: bytes.chunks(chunk_len).map(Hash::of).collect(),
            checked: Default::default(),
        }
    }
}

impl ChunkVerifier for Blake3Chunks {
    fn chunk_len(&self) -> u64 {
        self.chunk_len
    }
    fn resource_len(&self) -> u64 {
        self.total
    }
    fn verify_chunk(
        &mut self,
        index: u64,
        bytes: &[u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.checked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let want = self
            .hashes
            .get(index as usize)
            .ok_or_else(|| format!("no hash for chunk {index}"))?;
        let got = Hash::of(bytes);
        if &got != want {
            return Err(format!("BLAKE3 {} instead of {}", got.short(), want.short()).into());
        }
        Ok(())
    }
}

pub(crate) fn model() -> Hash {
    Hash::of(b"test model")
}

pub(crate) fn expert(layer: u16, expert: u16) -> ExpertId {
    ExpertId { layer, expert }
}

/// Deterministic pseudo-random bytes.
pub(crate) fn bytes_of(len: usize, seed: u64) -> Bytes {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// How the serving side misbehaves (all default: honest).
#[derive(Default, Clone)]
pub(crate) struct Faults {
    /// Flip one byte of the served resource at this offset.
    pub(crate) corrupt_at: Option<u64>,
    /// Drop the data frame with this index.
    pub(crate) skip_frame: Option<usize>,
    /// Serve the whole resource whatever range was asked for.
    pub(crate) ignore_range: bool,
    /// Send `End` after this many data frames.
    pub(crate) end_after: Option<usize>,
    /// Never answer at all.
    pub(crate) silent: bool,
    /// Admit requests but do not serve them (to hold slots).
    pub(crate) hold: bool,
}

/// A requester and a responder joined by two in-memory byte pipes that go through the real
/// frame encoder and decoder.
pub(crate) struct Pair {
    pub(crate) now: Instant,
    pub(crate) client: Requests,
    pub(crate) server: Server,
    pub(crate) experts: HashMap<ExpertId, Bytes>,
    pub(crate) manifest: Bytes,
    pub(crate) chunk: usize,
    pub(crate) faults: Faults,
    /// Every message the server received, in order.
    pub(crate) server_saw: Vec<Message>,
    /// Serve requests held by `Faults::hold`.
    pub(crate) held: Vec<ServeRequest>,
    /// When set, the client reads its stream with `decode_streaming` in pieces of these sizes
    /// (in turn), and Data payloads go to it piece by piece; otherwise whole messages in 7-byte
    /// pieces.
    pub(crate) stream_pieces: Option<Vec<usize>>,
    to_server: FrameDecoder,
    to_client: FrameDecoder,
}

impl Pair {
    pub(crate) fn new(client: RequestsConfig, server: ServerConfig) -> Self {
        Self {
            now: Instant::now(),
            client: Requests::new(client),
            server: Server::new(server),
            experts: HashMap::new(),
            manifest: Bytes::new(),
            chunk: 1000,
            faults: Faults::default(),
            server_saw: Vec::new(),
            held: Vec::new(),
            stream_pieces: None,
            to_server: FrameDecoder::new(),
            to_client: FrameDecoder::new(),
        }
    }

    pub(crate) fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// Sends `msgs` through a pipe: encode, split into 7-byte pieces, decode.
    fn pipe(dec: &mut FrameDecoder, msgs: Vec<Message>) -> Vec<Message> {
        let mut wire = Vec::new();
        for m in &msgs {
            append_frame(m, &mut wire).expect("test messages encode");
        }
        let mut out = Vec::new();
        for piece in wire.chunks(7) {
            dec.decode_all(piece, &mut out).expect("test frames decode");
        }
        dec.finish().expect("whole frames");
        out
    }

    /// Runs until neither side has anything to send. Returns the client's events.
    pub(crate) fn run(&mut self) -> Vec<Event> {
        loop {
            let mut up = Vec::new();
            while let Some(m) = self.client.poll_transmit() {
                up.push(m);
            }
            let up = Self::pipe(&mut self.to_server, up);
            let progressed_up = !up.is_empty();
            for m in up {
                self.server_saw.push(m.clone());
                self.server
                    .handle_message(m)
                    .expect("client sends requests only");
            }
            let mut down = Vec::new();
            while let Some(ev) = self.server.poll_event() {
                if let ServerEvent::Serve(req) = ev {
                    self.serve(req, &mut down);
                }
            }
            while let Some(m) = self.server.poll_transmit() {
                down.push(m);
            }
            let progressed_down = !down.is_empty();
            if let Some(sizes) = &self.stream_pieces {
                let mut wire = Vec::new();
                for m in &down {
                    append_frame(m, &mut wire).expect("test messages encode");
                }
                let mut at = 0;
                for &n in sizes.iter().cycle() {
                    if at == wire.len() {
                        break;
                    }
                    let end = (at + n.max(1)).min(wire.len());
                    let mut input = &wire[at..end];
                    while let Some(piece) = self
                        .to_client
                        .decode_streaming(&mut input)
                        .expect("test frames decode")
                    {
                        self.client
                            .handle_piece(self.now, piece)
                            .expect("server sends responses only");
                    }
                    assert!(input.is_empty());
                    at = end;
                }
                self.to_client.finish().expect("whole frames");
            } else {
                let down = Self::pipe(&mut self.to_client, down);
                for m in down {
                    self.client
                        .handle_message(self.now, m)
                        .expect("server sends responses only");
                }
            }
            if !progressed_up && !progressed_down {
                break;
            }
        }
        let mut events = Vec::new();
        while let Some(e) = self.client.poll_event() {
            events.push(e);
        }
        events
    }

    /// What a node does with an admitted request.
    fn serve(&mut self, req: ServeRequest, out: &mut Vec<Message>) {
        if self.faults.silent {
            return;
        }
        if self.faults.hold {
            self.held.push(req);
            return;
        }
        let bytes = match req.resource {
            Resource::Expert { model: m, expert } if m == model() => {
                self.experts.get(&expert).cloned()
            }
            Resource::Manifest { model: m } if m == model() => Some(self.manifest.clone()),
            _ => None,
        };
        let Some(mut bytes) = bytes else {
            self.server.fail(
                req.id,
                ErrorCode::NOT_FOUND,
                format!("{} not held", req.resource),
            );
            return;
        };
        if let Some(at) = self.faults.corrupt_at {
            let mut v = bytes.to_vec();
            v[at as usize] ^= 0x40;
            bytes = v.into();
        }
        let range = if self.faults.ignore_range {
            ByteRange {
                offset: 0,
                len: bytes.len() as u64,
            }
        } else {
            match req.resolve(bytes.len() as u64) {
                Ok(r) => r,
                Err((code, msg)) => {
                    self.server.fail(req.id, code, msg);
                    return;
                }
            }
        };
        let slice = bytes.slice(range.offset as usize..(range.offset + range.len) as usize);
        for (i, m) in DataChunks::new(req.id, range.offset, slice, self.chunk).enumerate() {
            if self.faults.end_after == Some(i) {
                break;
            }
            if self.faults.skip_frame != Some(i) {
                out.push(m);
            }
        }
        self.server.complete(req.id);
    }
}
