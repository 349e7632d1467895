//! Sessions saved to a file and loaded back by another process: the KV cache of every layer
//! and the position reached, so that the next forward gives the same bits as in a session
//! that never stopped.
//!
//! The file (all numbers little-endian):
//!
//! ```text
//! "STORMOKV"            magic, 8 bytes
//! version               u32 (SESSION_FILE_VERSION)
//! header length         u32 (at most 1 MiB)
//! header                JSON: the model's identity, the settings the cache depends on
//!                       (8-bit copies, context, prefill block, each layer's slots), the
//!                       position and the length of the caller's bytes
//! header checksum       BLAKE3 of everything before it, 32 bytes
//! body                  the caller's bytes (a transcript, its ids), then per layer the keys
//!                       then the values of each position the layer holds, oldest first,
//!                       as f32
//! body checksum         BLAKE3 of the body, 32 bytes
//! ```
//!
//! Nothing else follows. Loading checks each part before it trusts it, and every failure is
//! an [`Error::SessionFile`] that says what is wrong (never a panic): not a session file,
//! another version, truncated, corrupt, another model, other settings. The model's identity
//! is [`Model::identity`]: its config.json and a sample of every dense tensor, so a file is
//! refused by a model of the same shape with other weights. Scratch buffers, the last
//! logits and statistics are not saved: nothing the next forward computes depends on them.
//!
//! # Spans
//!
//! A span file holds the keys and values of a run of positions `start..end` only
//! ([`Session::save_span`]), to be appended to a session that holds the positions before it
//! ([`Session::load_span`]): a prompt cache keeps a prompt's prefix as a chain of spans, so
//! prompts that share a prefix share its files. Its layout is the session file's with the
//! magic `STORMOKS`, a header naming the model, its cache settings, the span and the caller's
//! bytes, and a body of the caller's bytes then per layer the keys then the values of the
//! span's positions. A span is loaded into the session only once all of it has been read and
//! its checksum matched, so a bad file leaves the session as it was.
//!
//! A span's numbers do not depend on how its positions were computed: every kernel computes
//! each position on its own whatever block or batch it shares (model.rs, `model/batch.rs`,
//! [`crate::kernels`]), so a position's keys and values are the same bits whether its prompt
//! ran in one block, in chunks or batched with other sessions, and whatever the session's
//! context. What does change them is [`Model::kv_identity`]: the model, its 8-bit copies and,
//! for the approximate int8-input experts, the instruction set.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use super::{LayerKv, Model, Session};
use crate::error::{Error, Result};

/// The version of the session file [`Session::save_to`] writes and [`Session::load_from`]
/// reads.
pub const SESSION_FILE_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"STORMOKV";
/// The largest header read.
const MAX_HEADER: usize = 1 << 20;
/// The most caller's bytes read.
const MAX_APP: u64 = 256 << 20;
/// Bytes of each dense tensor hashed into the model's identity, at its start, middle and end.
const SAMPLE: u64 = 4096;

/// What the header says.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct Header {
    /// [`Model::identity`], in hex.
    model: String,
    /// Attention projections and head from 8-bit copies.
    int8_attn_head: bool,
    /// Experts on int8-rounded inputs.
    int8_experts: bool,
    /// Positions the session holds.
    context: usize,
    /// Positions per prefill block.
    block: usize,
    /// Elements of a key (and of a value) per position.
    kv_dim: usize,
    /// Each layer's slots.
    slots: Vec<usize>,
    /// Positions in the cache.
    position: usize,
    /// Length of the caller's bytes.
    app_bytes: u64,
}

fn bad(reason: impl Into<String>) -> Error {
    Error::SessionFile {
        reason: reason.into(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The positions a layer of `slots` slots holds when `position` positions were run.
fn held(position: usize, slots: usize) -> std::ops::Range<usize> {
    position.saturating_sub(slots)..position
}

impl Model {
    /// The model's identity, for files that must be read with the same model: a BLAKE3 hash of
    /// its config.json (its parsed config when that file cannot be read) and of every dense
    /// tensor's name, type, shape and three samples of its bytes (4 KiB at its start, middle
    /// and end; about a thousand small reads, done once and kept). Expert tensors are left
    /// out, so a folder of dense weights whose experts come from peers has the identity of
    /// the whole model.
    pub fn identity(&self) -> Result<[u8; 32]> {
        if let Some(id) = self.identity.get() {
            return Ok(*id);
        }
        let mut h = blake3::Hasher::new();
        h.update(b"stormo model identity 1\0");
        match std::fs::read(self.ckpt.dir.join("config.json")) {
            Ok(c) => h.update(&c),
            Err(_) => h.update(format!("{:?}", self.cfg).as_bytes()),
        };
        let experts = self.layout.expert_tensor_names();
        let mut buf = vec![0u8; SAMPLE as usize];
        for (name, t) in &self.ckpt.tensors {
            if experts.contains(name.as_str()) {
                continue;
            }
            h.update(format!("\0{name}\0{:?}\0{:?}\0{}\0", t.dtype, t.shape, t.len).as_bytes());
            let file = &self.ckpt.files[t.file];
            let n = SAMPLE.min(t.len);
            let mut starts = vec![0, (t.len - n) / 2, t.len - n];
            starts.dedup();
            for at in starts {
                let b = &mut buf[..n as usize];
                file.read_exact_at(b, t.offset + at)?;
                h.update(b);
            }
        }
        let id = *h.finalize().as_bytes();
        Ok(*self.identity.get_or_init(|| id))
    }

    /// (int8_attn_head, int8_experts): the load options that change the numbers in a cache.
    fn cache_settings(&self) -> (bool, bool) {
        (!self.q8.is_empty(), self.int8_experts)
    }
}

/// A writer that hashes what goes through it.
struct Hashing<'a> {
    inner: &'a mut dyn Write,
    hash: blake3::Hasher,
}

impl Hashing<'_> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.hash.update(b);
        self.inner.write_all(b)
    }

    /// Writes the hash of what went through since the last call, unhashed, and starts again.
    fn seal(&mut self) -> std::io::Result<()> {
        let sum = std::mem::take(&mut self.hash).finalize();
        self.inner.write_all(sum.as_bytes())
    }
}

/// A reader that hashes what comes through it and names what a short read cut.
struct Checking<'a> {
    inner: &'a mut dyn Read,
    hash: blake3::Hasher,
}

impl Checking<'_> {
    /// Reads a file's preamble: its `magic` (a stormo `kind` file), its `version` (the one
    /// this stormo reads), and its JSON header's bytes, checked against the hash so far.
    fn preamble(&mut self, magic: &[u8; 8], kind: &str, version: u32) -> Result<Vec<u8>> {
        let mut got = [0u8; 8];
        self.get(&mut got, "the magic number")?;
        if &got != magic {
            return Err(bad(format!(
                "it is not a stormo {kind} file (it does not start with {})",
                String::from_utf8_lossy(magic)
            )));
        }
        let mut word = [0u8; 4];
        self.get(&mut word, "the version")?;
        let found = u32::from_le_bytes(word);
        if found != version {
            return Err(bad(format!(
                "it is a version {found} {kind} file; this stormo reads version {version}"
            )));
        }
        self.get(&mut word, "the header's length")?;
        let len = u32::from_le_bytes(word) as usize;
        if len > MAX_HEADER {
            return Err(bad(format!(
                "the header is corrupt: it claims {len} bytes (at most {MAX_HEADER})"
            )));
        }
        let mut json = vec![0u8; len];
        self.get(&mut json, "the header")?;
        self.check("the header", "the header is corrupt")?;
        Ok(json)
    }

    fn get(&mut self, b: &mut [u8], what: &str) -> Result<()> {
        read_all(self.inner, b, what)?;
        self.hash.update(b);
        Ok(())
    }

    /// Reads a checksum of what came through since the last call (`what`) and compares;
    /// `corrupt` says what a mismatch means.
    fn check(&mut self, what: &str, corrupt: &str) -> Result<()> {
        let mut sum = [0u8; 32];
        read_all(self.inner, &mut sum, &format!("{what}'s checksum"))?;
        let want = std::mem::take(&mut self.hash).finalize();
        if want.as_bytes() != &sum {
            return Err(bad(format!("{corrupt} (its checksum does not match)")));
        }
        Ok(())
    }
}

fn read_all(r: &mut dyn Read, b: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(b).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            bad(format!("the file is truncated: it ends in {what}"))
        } else {
            bad(format!("reading {what}: {e}"))
        }
    })
}

impl Session {
    /// Writes the session (its position and the KV cache of the positions it holds) to `w`,
    /// with `app`, the caller's bytes (a transcript, the ids of the cached positions), in the
    /// format the module describes. `model` is the model that ran it.
    pub fn save_to(&self, model: &Model, app: &[u8], w: &mut dyn Write) -> Result<()> {
        let (int8_attn_head, int8_experts) = model.cache_settings();
        let header = Header {
            model: hex(&model.identity()?),
            int8_attn_head,
            int8_experts,
            context: self.max_context,
            block: self.block,
            kv_dim: model.cfg.kv_dim(),
            slots: self.kv.iter().map(|kv| kv.cap).collect(),
            position: self.pos,
            app_bytes: app.len() as u64,
        };
        let json = serde_json::to_vec(&header).map_err(|e| bad(e.to_string()))?;
        let io = |e: std::io::Error| bad(format!("writing it: {e}"));
        let mut out = Hashing {
            inner: w,
            hash: blake3::Hasher::new(),
        };
        out.put(MAGIC).map_err(io)?;
        out.put(&SESSION_FILE_VERSION.to_le_bytes()).map_err(io)?;
        out.put(&(json.len() as u32).to_le_bytes()).map_err(io)?;
        out.put(&json).map_err(io)?;
        out.seal().map_err(io)?;
        out.put(app).map_err(io)?;
        let kvd = header.kv_dim;
        let mut bytes = Vec::with_capacity(kvd * 4 * 64);
        for kv in &self.kv {
            for data in [&kv.k, &kv.v] {
                for p in held(self.pos, kv.cap) {
                    let slot = p % kv.cap;
                    for x in &data[slot * kvd..(slot + 1) * kvd] {
                        bytes.extend_from_slice(&x.to_le_bytes());
                    }
                    if bytes.len() >= kvd * 4 * 64 {
                        out.put(&bytes).map_err(io)?;
                        bytes.clear();
                    }
                }
            }
        }
        out.put(&bytes).map_err(io)?;
        out.seal().map_err(io)?;
        out.inner.flush().map_err(io)
    }

    /// Reads a session [`Session::save_to`] wrote, for `model`, into a new session of
    /// `max_context` positions whose sliding layers keep `rewind` more (as
    /// [`Model::session_with_rewind`] makes): the file must have been written for a session
    /// made so, by the same model with the same settings, and be whole. Returns the session,
    /// at the saved position with the saved cache, and the caller's bytes.
    pub fn load_from(
        model: &Model,
        r: &mut dyn Read,
        max_context: usize,
        rewind: usize,
    ) -> Result<(Self, Vec<u8>)> {
        let mut input = Checking {
            inner: r,
            hash: blake3::Hasher::new(),
        };
        let json = input.preamble(MAGIC, "session", SESSION_FILE_VERSION)?;
        let h: Header = serde_json::from_slice(&json)
            .map_err(|e| bad(format!("the header is not what this stormo wrote: {e}")))?;
        let this = hex(&model.identity()?);
        if h.model != this {
            return Err(bad(format!(
                "it was saved with another model (identity {}…; this model's is {}…)",
                h.model.get(..16).unwrap_or(&h.model),
                &this[..16]
            )));
        }
        let (int8_attn_head, int8_experts) = model.cache_settings();
        let on = |b: bool| if b { "on" } else { "off" };
        if h.int8_attn_head != int8_attn_head {
            return Err(bad(format!(
                "it was saved with int8_attn_head {} and this model runs with it {}",
                on(h.int8_attn_head),
                on(int8_attn_head)
            )));
        }
        if h.int8_experts != int8_experts {
            return Err(bad(format!(
                "it was saved with int8_experts {} and this model runs with it {}",
                on(h.int8_experts),
                on(int8_experts)
            )));
        }
        if h.context != max_context {
            return Err(bad(format!(
                "it was saved with a context of {} positions; this session has {max_context}",
                h.context
            )));
        }
        let mut sess = model.session_with_rewind(max_context, rewind)?;
        let slots: Vec<usize> = sess.kv.iter().map(|kv| kv.cap).collect();
        if h.block != sess.block || h.slots != slots || h.kv_dim != model.cfg.kv_dim() {
            return Err(bad(format!(
                "its cache's shape (prefill block {}, {} layers) is not this session's \
                 (prefill block {}, {} layers): saved with other settings",
                h.block,
                h.slots.len(),
                sess.block,
                slots.len()
            )));
        }
        if h.position > max_context {
            return Err(bad(format!(
                "the header is corrupt: position {} in a context of {max_context}",
                h.position
            )));
        }
        if h.app_bytes > MAX_APP {
            return Err(bad(format!(
                "the header is corrupt: it claims {} bytes of conversation",
                h.app_bytes
            )));
        }
        // In pieces: a length claimed is not allocated before its bytes are there.
        let mut app = Vec::new();
        while app.len() < h.app_bytes as usize {
            let n = (h.app_bytes as usize - app.len()).min(1 << 20);
            let at = app.len();
            app.resize(at + n, 0);
            input.get(&mut app[at..], "the conversation")?;
        }
        let kvd = h.kv_dim;
        let mut row = vec![0u8; kvd * 4];
        for (l, kv) in sess.kv.iter_mut().enumerate() {
            let LayerKv { cap, k, v } = kv;
            for data in [k, v] {
                for p in held(h.position, *cap) {
                    input.get(&mut row, &format!("layer {l}'s cache"))?;
                    let slot = p % *cap;
                    for (x, b) in data[slot * kvd..(slot + 1) * kvd]
                        .iter_mut()
                        .zip(row.chunks_exact(4))
                    {
                        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
        }
        input.check("the cache", "the saved conversation or cache is corrupt")?;
        let mut extra = [0u8; 1];
        match input.inner.read(&mut extra) {
            Ok(0) => {}
            Ok(_) => return Err(bad("it goes on after its end: corrupt or not one file")),
            Err(e) => return Err(bad(format!("reading its end: {e}"))),
        }
        sess.pos = h.position;
        Ok((sess, app))
    }
}

/// The version of the span file [`Session::save_span`] writes and [`Session::load_span`] reads.
pub const SPAN_FILE_VERSION: u32 = 1;

const SPAN_MAGIC: &[u8; 8] = b"STORMOKS";

/// What a span file's header says.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct SpanHeader {
    /// [`Model::identity`], in hex.
    model: String,
    int8_attn_head: bool,
    int8_experts: bool,
    /// The instruction set, when the cache depends on it (int8-input experts).
    isa: Option<String>,
    kv_dim: usize,
    layers: usize,
    /// The positions held: `start..end`.
    start: usize,
    end: usize,
    /// Length of the caller's bytes.
    app_bytes: u64,
}

/// The most caller's bytes a span file carries.
const MAX_SPAN_APP: u64 = 1 << 20;

impl Model {
    /// What the numbers in a KV cache depend on besides the tokens: the model
    /// ([`Model::identity`]), its 8-bit copies of attention and head, and with the int8-input
    /// experts (whose instruction sets agree only to rounding) the instruction set. Two
    /// models with the same value compute the same bits for the same tokens at the same
    /// positions, so their caches are interchangeable.
    pub fn kv_identity(&self) -> Result<[u8; 32]> {
        let mut h = blake3::Hasher::new();
        h.update(b"stormo kv identity 1\0");
        h.update(&self.identity()?);
        let (int8_attn_head, int8_experts) = self.cache_settings();
        h.update(&[u8::from(int8_attn_head), u8::from(int8_experts)]);
        if let Some(isa) = self.cache_isa() {
            h.update(isa.as_bytes());
        }
        Ok(*h.finalize().as_bytes())
    }

    /// The instruction set's name when the cache's numbers depend on it.
    fn cache_isa(&self) -> Option<String> {
        self.int8_experts
            .then(|| crate::kernels::Isa::process().name().to_string())
    }

    fn span_header(&self, start: usize, end: usize, app: usize) -> Result<SpanHeader> {
        let (int8_attn_head, int8_experts) = self.cache_settings();
        Ok(SpanHeader {
            model: hex(&self.identity()?),
            int8_attn_head,
            int8_experts,
            isa: self.cache_isa(),
            kv_dim: self.cfg.kv_dim(),
            layers: self.layers.len(),
            start,
            end,
            app_bytes: app as u64,
        })
    }
}

impl Session {
    /// Writes the keys and values of positions `span` (a span file, see the module docs)
    /// with `app`, the caller's bytes (at most 1 MiB), to `w`. Every layer must still hold
    /// those positions (`span.end` at most the position; a sliding layer's ring not past
    /// `span.start`).
    pub fn save_span(
        &self,
        model: &Model,
        span: std::ops::Range<usize>,
        app: &[u8],
        w: &mut dyn Write,
    ) -> Result<()> {
        if span.start >= span.end || span.end > self.pos {
            return Err(Error::Input(format!(
                "positions {span:?} are not a span of the {} positions in the session",
                self.pos
            )));
        }
        if let Some((l, kv)) = self
            .kv
            .iter()
            .enumerate()
            .find(|(_, kv)| held(self.pos, kv.cap).start > span.start)
        {
            return Err(Error::Input(format!(
                "layer {l} no longer holds position {} (it keeps the last {} of {})",
                span.start, kv.cap, self.pos
            )));
        }
        if app.len() as u64 > MAX_SPAN_APP {
            return Err(Error::Input(format!(
                "{} bytes of the caller's in a span file: at most {MAX_SPAN_APP}",
                app.len()
            )));
        }
        let header = model.span_header(span.start, span.end, app.len())?;
        let json = serde_json::to_vec(&header).map_err(|e| bad(e.to_string()))?;
        let io = |e: std::io::Error| bad(format!("writing it: {e}"));
        let mut out = Hashing {
            inner: w,
            hash: blake3::Hasher::new(),
        };
        out.put(SPAN_MAGIC).map_err(io)?;
        out.put(&SPAN_FILE_VERSION.to_le_bytes()).map_err(io)?;
        out.put(&(json.len() as u32).to_le_bytes()).map_err(io)?;
        out.put(&json).map_err(io)?;
        out.seal().map_err(io)?;
        out.put(app).map_err(io)?;
        let kvd = header.kv_dim;
        let mut bytes = Vec::with_capacity(kvd * 4 * span.len());
        for kv in &self.kv {
            for data in [&kv.k, &kv.v] {
                for p in span.clone() {
                    let slot = p % kv.cap;
                    for x in &data[slot * kvd..(slot + 1) * kvd] {
                        bytes.extend_from_slice(&x.to_le_bytes());
                    }
                }
                out.put(&bytes).map_err(io)?;
                bytes.clear();
            }
        }
        out.seal().map_err(io)?;
        out.inner.flush().map_err(io)
    }

    /// Reads a span file [`Session::save_span`] wrote, for `model`, and appends its positions
    /// to this session: the span must start at the session's position and fit in its
    /// context, and the file be whole and written by a model of the same
    /// [`Model::kv_identity`]. Nothing is changed unless all of it is right. Returns the
    /// span and the caller's bytes.
    pub fn load_span(
        &mut self,
        model: &Model,
        r: &mut dyn Read,
    ) -> Result<(std::ops::Range<usize>, Vec<u8>)> {
        let mut input = Checking {
            inner: r,
            hash: blake3::Hasher::new(),
        };
        let json = input.preamble(SPAN_MAGIC, "span", SPAN_FILE_VERSION)?;
        let h: SpanHeader = serde_json::from_slice(&json)
            .map_err(|e| bad(format!("the header is not what this stormo wrote: {e}")))?;
        let want = model.span_header(h.start, h.end, h.app_bytes as usize)?;
        if h.model != want.model {
            return Err(bad(format!(
                "it was saved with another model (identity {}…; this model's is {}…)",
                h.model.get(..16).unwrap_or(&h.model),
                &want.model[..16]
            )));
        }
        if (h.int8_attn_head, h.int8_experts, &h.isa)
            != (want.int8_attn_head, want.int8_experts, &want.isa)
        {
            return Err(bad(format!(
                "it was saved with other cache settings (int8_attn_head {}, int8_experts {}, \
                 instruction set {:?}; this model: {}, {}, {:?})",
                h.int8_attn_head,
                h.int8_experts,
                h.isa,
                want.int8_attn_head,
                want.int8_experts,
                want.isa
            )));
        }
        if h.kv_dim != want.kv_dim || h.layers != want.layers {
            return Err(bad(format!(
                "the header is corrupt: {} layers of {} per position (this model: {} of {})",
                h.layers, h.kv_dim, want.layers, want.kv_dim
            )));
        }
        if h.start != self.pos || h.end <= h.start || h.end > self.max_context {
            return Err(bad(format!(
                "it holds positions {}..{}; this session is at position {} of {}",
                h.start, h.end, self.pos, self.max_context
            )));
        }
        if h.app_bytes > MAX_SPAN_APP {
            return Err(bad(format!(
                "the header is corrupt: it claims {} bytes of the caller's",
                h.app_bytes
            )));
        }
        let mut app = vec![0u8; h.app_bytes as usize];
        input.get(&mut app, "the caller's bytes")?;
        // Read and checked whole before the cache is touched. The length is bounded by the
        // context, which the session holds already.
        let n = h.end - h.start;
        let mut body = vec![0u8; h.layers * 2 * n * h.kv_dim * 4];
        input.get(&mut body, "the cache")?;
        input.check("the cache", "the span is corrupt")?;
        let mut extra = [0u8; 1];
        match input.inner.read(&mut extra) {
            Ok(0) => {}
            Ok(_) => return Err(bad("it goes on after its end: corrupt or not one file")),
            Err(e) => return Err(bad(format!("reading its end: {e}"))),
        }
        let kvd = h.kv_dim;
        let mut rows = body.chunks_exact(kvd * 4);
        for kv in &mut self.kv {
            let LayerKv { cap, k, v } = kv;
            for data in [k, v] {
                for p in h.start..h.end {
                    let row = rows.next().expect("the body holds every row");
                    let slot = p % *cap;
                    for (x, b) in data[slot * kvd..(slot + 1) * kvd]
                        .iter_mut()
                        .zip(row.chunks_exact(4))
                    {
                        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
        }
        self.pos = h.end;
        Ok((h.start..h.end, app))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LoadOptions, Logits};

    fn tiny(name: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures")
            .join(name)
    }

    fn load(name: &str, opts: &LoadOptions) -> Model {
        Model::load(&tiny(name), opts).expect("the fixture loads")
    }

    fn ids(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| (i * 37 + salt) % 500).collect()
    }

    fn saved(model: &Model, sess: &Session, app: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        sess.save_to(model, app, &mut out).expect("saved");
        out
    }

    fn reason(e: Error) -> String {
        match e {
            Error::SessionFile { reason } => reason,
            e => panic!("not a session-file error: {e}"),
        }
    }

    /// A session saved after a prompt and loaded into a new one continues with the same
    /// logits, bit for bit, as the session that never stopped; the caller's bytes come back.
    /// Both families (GPT-OSS slides; a ring smaller than the context wraps).
    #[test]
    fn a_saved_session_continues_bit_for_bit() {
        // (The second: 150 positions in sliding rings of 128 + 8 slots.)
        for (name, context, rewind, prompt) in [
            ("gptoss-tiny-mxfp4", 64, 64, 29),
            ("gptoss-tiny-mxfp4", 200, 0, 150),
            ("qwen3moe-tiny", 48, 48, 29),
        ] {
            let opts = LoadOptions {
                prefill_block: 8,
                ..LoadOptions::default()
            };
            let model = load(name, &opts);
            let mut a = model.session_with_rewind(context, rewind).expect("session");
            model
                .forward(&mut a, &ids(prompt, 3), Logits::Last, None)
                .expect("prompt");
            let file = saved(&model, &a, b"the conversation");
            let (mut b, app) =
                Session::load_from(&model, &mut &file[..], context, rewind).expect("loaded");
            assert_eq!(app, b"the conversation");
            assert_eq!(b.position(), prompt);
            for step in [ids(11, 5), vec![7], vec![9]] {
                let la = model
                    .forward(&mut a, &step, Logits::All, None)
                    .unwrap()
                    .to_vec();
                let lb = model
                    .forward(&mut b, &step, Logits::All, None)
                    .unwrap()
                    .to_vec();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&la), bits(&lb), "{name}, rewind {rewind}");
            }
            // An empty session round-trips too.
            let empty = model.session_with_rewind(context, rewind).unwrap();
            let (e, app) = Session::load_from(
                &model,
                &mut &saved(&model, &empty, b"")[..],
                context,
                rewind,
            )
            .expect("an empty session loads");
            assert_eq!((e.position(), app.len()), (0, 0));
        }
    }

    /// Every cut of a file is a named error, and so is a file that goes on after its end.
    #[test]
    fn a_truncated_file_is_a_named_error() {
        let model = load("gptoss-tiny-mxfp4", &LoadOptions::default());
        let mut s = model.session(32).unwrap();
        model
            .forward(&mut s, &ids(5, 1), Logits::Last, None)
            .unwrap();
        let file = saved(&model, &s, b"app");
        for cut in [0, 3, 8, 11, 14, 40, file.len() - 40, file.len() - 1] {
            let e = Session::load_from(&model, &mut &file[..cut], 32, 0).expect_err("cut");
            let r = reason(e);
            assert!(r.contains("truncated"), "cut at {cut}: {r}");
        }
        let mut longer = file.clone();
        longer.push(0);
        let r = reason(Session::load_from(&model, &mut &longer[..], 32, 0).unwrap_err());
        assert!(r.contains("goes on after its end"), "{r}");
    }

    /// A file saved with another model (another family; the same config with other weights)
    /// or with other settings names what differs.
    #[test]
    fn another_model_or_other_settings_are_named() {
        let gpt = load("gptoss-tiny-mxfp4", &LoadOptions::default());
        let mut s = gpt.session(32).unwrap();
        gpt.forward(&mut s, &ids(5, 1), Logits::Last, None).unwrap();
        let file = saved(&gpt, &s, b"");
        let qwen = load("qwen3moe-tiny", &LoadOptions::default());
        let r = reason(Session::load_from(&qwen, &mut &file[..], 32, 0).unwrap_err());
        assert!(r.contains("another model"), "{r}");
        // The same config, one weight changed.
        let dir = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(tiny("gptoss-tiny-mxfp4")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
        }
        let t = &gpt.ckpt.tensors["model.norm.weight"];
        let path = dir.path().join(
            gpt.ckpt.files[t.file]
                .path
                .file_name()
                .expect("a file name"),
        );
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[t.offset as usize] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let other = Model::load(dir.path(), &LoadOptions::default()).unwrap();
        let r = reason(Session::load_from(&other, &mut &file[..], 32, 0).unwrap_err());
        assert!(r.contains("another model"), "{r}");
        // Settings.
        let int8 = load(
            "gptoss-tiny-mxfp4",
            &LoadOptions {
                int8_attn_head: true,
                ..LoadOptions::default()
            },
        );
        let r = reason(Session::load_from(&int8, &mut &file[..], 32, 0).unwrap_err());
        assert!(r.contains("saved with int8_attn_head off"), "{r}");
        let r = reason(Session::load_from(&gpt, &mut &file[..], 48, 0).unwrap_err());
        assert!(
            r.contains("context of 32 positions; this session has 48"),
            "{r}"
        );
        let block8 = load(
            "gptoss-tiny-mxfp4",
            &LoadOptions {
                prefill_block: 8,
                ..LoadOptions::default()
            },
        );
        let r = reason(Session::load_from(&block8, &mut &file[..], 32, 0).unwrap_err());
        assert!(r.contains("saved with other settings"), "{r}");
    }

    /// A file that is not a session, of another version, or whose header or cache was
    /// changed is a named error.
    #[test]
    fn a_corrupt_file_is_a_named_error() {
        let model = load("gptoss-tiny-mxfp4", &LoadOptions::default());
        let mut s = model.session(32).unwrap();
        model
            .forward(&mut s, &ids(5, 1), Logits::Last, None)
            .unwrap();
        let file = saved(&model, &s, b"app");
        let with = |at: usize, f: &dyn Fn(&mut u8)| {
            let mut b = file.clone();
            f(&mut b[at]);
            reason(Session::load_from(&model, &mut &b[..], 32, 0).unwrap_err())
        };
        assert!(with(0, &|b| *b = b'X').contains("not a stormo session file"));
        assert!(with(8, &|b| *b = 9).contains("version 9 session file"));
        assert!(with(12, &|b| *b = 0x7f).contains("the header is corrupt"));
        // A byte of the header's JSON, then one of the header's checksum.
        assert!(with(20, &|b| *b ^= 4).contains("header is corrupt (its checksum"));
        let json_end = 16 + u32::from_le_bytes(file[12..16].try_into().unwrap()) as usize;
        assert!(with(json_end + 3, &|b| *b ^= 1).contains("header is corrupt"));
        // A byte of the cache, then one of the conversation.
        assert!(with(file.len() - 40, &|b| *b ^= 1).contains("or cache is corrupt"));
        assert!(with(json_end + 33, &|b| *b ^= 1).contains("or cache is corrupt"));
        // Random bytes never panic.
        for seed in 0..64u32 {
            let mut b = file.clone();
            let at = (seed as usize * 7919) % b.len();
            b[at] = b[at].wrapping_add(seed as u8 + 1);
            assert!(Session::load_from(&model, &mut &b[..], 32, 0).is_err());
        }
        let junk: Vec<u8> = (0..300u32).map(|i| (i * 31) as u8).collect();
        assert!(Session::load_from(&model, &mut &junk[..], 32, 0).is_err());
    }

    /// A prompt's prefix saved as two spans by a model that ran the prompt in one block, and
    /// loaded by the same model with another prefill block into a new session, continues with
    /// the logits of a session that computed the prefix itself in chunks, bit for bit (both
    /// families): a span's bits do not depend on how its positions were computed.
    #[test]
    fn loaded_spans_continue_bit_for_bit_whatever_computed_them() {
        for name in ["gptoss-tiny-mxfp4", "qwen3moe-tiny"] {
            let whole = load(name, &LoadOptions::default());
            let chunked = load(
                name,
                &LoadOptions {
                    prefill_block: 5,
                    ..LoadOptions::default()
                },
            );
            assert_eq!(whole.kv_identity().unwrap(), chunked.kv_identity().unwrap());
            let prompt = ids(40, 11);
            let mut a = whole.session_with_rewind(48, 48).unwrap();
            whole
                .forward(&mut a, &prompt[..32], Logits::Last, None)
                .unwrap();
            let span = |range: std::ops::Range<usize>, app: &[u8]| {
                let mut out = Vec::new();
                a.save_span(&whole, range, app, &mut out).expect("saved");
                out
            };
            let (first, second) = (span(0..16, b"one"), span(16..32, b"two"));
            let mut b = chunked.session_with_rewind(48, 48).unwrap();
            assert_eq!(
                b.load_span(&chunked, &mut &first[..]).unwrap(),
                (0..16, b"one".to_vec())
            );
            assert_eq!(
                b.load_span(&chunked, &mut &second[..]).unwrap(),
                (16..32, b"two".to_vec())
            );
            assert_eq!(b.position(), 32);
            let mut c = chunked.session_with_rewind(48, 48).unwrap();
            chunked
                .forward(&mut c, &prompt[..32], Logits::Last, None)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for step in [prompt[32..].to_vec(), vec![7]] {
                let lb = bits(chunked.forward(&mut b, &step, Logits::All, None).unwrap());
                let lc = bits(chunked.forward(&mut c, &step, Logits::All, None).unwrap());
                assert_eq!(lb, lc, "{name}");
            }
        }
    }

    /// A span that does not start at the session's position, is cut, corrupt, of another
    /// model or of another kind of file is a named error, and leaves the session as it was.
    #[test]
    fn a_bad_span_is_a_named_error_and_changes_nothing() {
        let model = load("gptoss-tiny-mxfp4", &LoadOptions::default());
        let mut s = model.session(32).unwrap();
        model
            .forward(&mut s, &ids(12, 1), Logits::Last, None)
            .unwrap();
        let mut file = Vec::new();
        s.save_span(&model, 4..8, b"key", &mut file).unwrap();
        let e = s
            .save_span(&model, 8..13, b"", &mut Vec::new())
            .unwrap_err();
        assert!(e.to_string().contains("not a span"), "{e}");
        let mut t = model.session(32).unwrap();
        model
            .forward(&mut t, &ids(4, 1), Logits::Last, None)
            .unwrap();
        let try_load = |bytes: &[u8], t: &mut Session| {
            let r = reason(t.load_span(&model, &mut &bytes[..]).unwrap_err());
            assert_eq!(t.position(), 4, "{r}");
            r
        };
        let mut at_zero = model.session(32).unwrap();
        let r = reason(at_zero.load_span(&model, &mut &file[..]).unwrap_err());
        assert!(
            r.contains("positions 4..8; this session is at position 0"),
            "{r}"
        );
        for cut in [0, 5, 12, 30, file.len() - 33, file.len() - 1] {
            let r = try_load(&file[..cut], &mut t);
            assert!(r.contains("truncated"), "cut at {cut}: {r}");
        }
        let mut flipped = file.clone();
        let n = flipped.len();
        flipped[n - 40] ^= 1;
        assert!(try_load(&flipped, &mut t).contains("span is corrupt"));
        let session_file = saved(&model, &s, b"");
        assert!(try_load(&session_file, &mut t).contains("not a stormo span file"));
        let qwen = load("qwen3moe-tiny", &LoadOptions::default());
        let mut q = qwen.session(32).unwrap();
        qwen.forward(&mut q, &ids(4, 1), Logits::Last, None)
            .unwrap();
        let r = reason(q.load_span(&qwen, &mut &file[..]).unwrap_err());
        assert!(r.contains("another model"), "{r}");
        for seed in 0..64u32 {
            let mut b = file.clone();
            let at = (seed as usize * 7919) % b.len();
            b[at] = b[at].wrapping_add(seed as u8 + 1);
            assert!(t.load_span(&model, &mut &b[..]).is_err());
            assert_eq!(t.position(), 4);
        }
        // The good file loads.
        assert_eq!(t.load_span(&model, &mut &file[..]).unwrap().0, 4..8);
        assert_eq!(t.position(), 8);
    }
}
