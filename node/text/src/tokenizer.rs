//! Byte-level BPE tokenizers read from a model folder's Hugging Face `tokenizer.json`.
//!
//! Owns: loading `tokenizer.json` (vocab, merges, added tokens, normalizer, pre-tokenizer),
//! encoding text to ids exactly as the `tokenizers` library does for byte-level BPE models
//! (GPT-OSS's o200k_harmony, Qwen2/Qwen3), decoding ids back to bytes, and an incremental
//! decoder for streaming that only emits whole characters.
//!
//! The pipeline for [`Tokenizer::encode`]:
//! 1. Added tokens are cut out of the raw text first (leftmost, then longest match). Added
//!    tokens marked `special` are only recognized when the caller allows it; the others are
//!    always recognized, as the `tokenizers` library does (Qwen's `<think>` is one).
//! 2. Each remaining segment is normalized (NFC/NFD/NFKC/NFKD or a sequence of them).
//! 3. The pre-tokenizer splits it into pieces: `Split` with a regex (lookaheads included, via
//!    `fancy-regex`, the engine tiktoken uses) and/or `ByteLevel` with its GPT-2 regex.
//! 4. Each piece, as UTF-8 bytes, goes through BPE: with `ignore_merges` a piece that is
//!    itself in the vocab is one token; otherwise the lowest-ranked merge applies first,
//!    leftmost on ties, using a heap over a linked list of symbols (O(n log n) per piece, so a
//!    long run of one letter is not quadratic).
//!
//! Non-goals: WordPiece/Unigram models, `add_prefix_space`, BPE dropout, `byte_fallback`,
//! added tokens with `lstrip`/`rstrip`/`single_word`. These are refused at load with a clear
//! error rather than tokenized slightly wrong. Post-processors (BOS/EOS templates) are not
//! applied: chat templates in this crate write every special token themselves.
//!
//! Decoding: each id maps to its bytes (added tokens to their content). Joining the bytes of
//! a whole sequence is exact; a single id may end inside a UTF-8 character, so streaming
//! output goes through [`StreamDecoder`], which holds back an incomplete trailing character
//! until the bytes that complete it arrive and turns bytes that can never form a character
//! into U+FFFD.

use std::borrow::Cow;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use unicode_normalization::UnicodeNormalization;

/// A token id.
pub type TokenId = u32;

/// Why a `tokenizer.json` could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read tokenizer file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not JSON of the expected shape.
    #[error("tokenizer.json is not valid")]
    Json(#[source] serde_json::Error),
    /// A feature this implementation does not support (refused rather than approximated).
    #[error("tokenizer.json uses something not supported: {0}")]
    Unsupported(String),
    /// The file is inconsistent (a merge producing an unknown token, an id used twice, ...).
    #[error("tokenizer.json is inconsistent: {0}")]
    Invalid(String),
}

/// Why text could not be encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The pre-tokenizer regex gave up (fancy-regex's backtracking limit).
    #[error("pre-tokenizer regex failed on the input")]
    Regex(#[source] Box<fancy_regex::Error>),
}

/// Why ids could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// An id past the largest the vocabulary has.
    #[error("token id {id} is not in the vocabulary (ids go up to {max})")]
    UnknownId {
        /// The offending id.
        id: TokenId,
        /// The largest id the vocabulary has.
        max: TokenId,
    },
    /// An id below the largest that no token of `tokenizer.json` has (a gap in its ids).
    #[error(
        "token id {id} is missing from the tokenizer's vocabulary: no token has it, though ids \
         go up to {max} (a gap in tokenizer.json's ids)"
    )]
    MissingId {
        /// The offending id.
        id: TokenId,
        /// The largest id the vocabulary has.
        max: TokenId,
    },
}

/// A minimal FxHash-style hasher with a final mix: fast for short keys; keys come from the
/// tokenizer file and lookups never insert, so untrusted text cannot grow a table.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("chunk of 8")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut buf = [0u8; 8];
            buf[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(buf) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        // Multiplication only carries bits upward, and hashbrown picks buckets by the low
        // bits: without this final mix, keys differing only in high bits (the left id of a
        // merge pair) would all share a bucket. murmur3's fmix64.
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    h.write(bytes);
    h.finish()
}

/// One slot of [`VocabTable`]: the key is `arena[start..start + len]`.
#[derive(Clone, Copy)]
struct Slot {
    /// The high half of the key's hash; `u32::MAX` in `id` marks an empty slot.
    tag: u32,
    id: TokenId,
    start: u32,
    len: u32,
}

const EMPTY_SLOT: Slot = Slot {
    tag: 0,
    id: u32::MAX,
    start: 0,
    len: 0,
};

/// Token bytes to id for the ordinary vocabulary: an open-addressing table (linear probing,
/// at most half full) whose keys are spans of the tokenizer's byte arena, so loading makes no
/// allocation per token and a lookup touches one slot and the key's bytes. Ids are below
/// [`MAX_TOKEN_ID`] (checked at load), so `u32::MAX` can mark empty slots.
struct VocabTable {
    slots: Vec<Slot>,
    mask: usize,
    len: usize,
}

impl VocabTable {
    fn with_capacity(n: usize) -> Self {
        let size = (n.max(4) * 2).next_power_of_two();
        Self {
            slots: vec![EMPTY_SLOT; size],
            mask: size - 1,
            len: 0,
        }
    }

    /// The id of `key`, whose bytes the arena holds at the slot's span.
    #[inline]
    fn get(&self, key: &[u8], arena: &[u8]) -> Option<TokenId> {
        self.probe(key, arena).ok()
    }

    /// Linear probing for `key`: its id, or the empty slot where it would go (with its hash
    /// tag).
    #[inline]
    fn probe(&self, key: &[u8], arena: &[u8]) -> Result<TokenId, (usize, u32)> {
        let h = hash_bytes(key);
        let tag = (h >> 32) as u32;
        let mut i = h as usize & self.mask;
        loop {
            let s = self.slots[i];
            if s.id == u32::MAX {
                return Err((i, tag));
            }
            if s.tag == tag
                && s.len as usize == key.len()
                && &arena[s.start as usize..(s.start + s.len) as usize] == key
            {
                return Ok(s.id);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Adds `arena[start..start + len]` as `id`; returns the id already there for the same
    /// bytes instead, if any. The table never gets more than half full: its capacity was
    /// sized for every key.
    fn insert(&mut self, arena: &[u8], start: u32, len: u32, id: TokenId) -> Option<TokenId> {
        let key = &arena[start as usize..(start + len) as usize];
        let (i, tag) = match self.probe(key, arena) {
            Ok(found) => return Some(found),
            Err(empty) => empty,
        };
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow(arena);
            return self.insert(arena, start, len, id);
        }
        self.slots[i] = Slot {
            tag,
            id,
            start,
            len,
        };
        self.len += 1;
        None
    }

    fn grow(&mut self, arena: &[u8]) {
        let old = std::mem::replace(self, Self::with_capacity(self.slots.len()));
        for s in old.slots.into_iter().filter(|s| s.id != u32::MAX) {
            self.insert(arena, s.start, s.len, s.id);
        }
    }
}

/// GPT-2's byte-to-character table: byte-level tokens spell byte `b` as `BYTE_CHARS[b]`.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        out[b as usize] = char::from_u32(c).expect("code points below 0x200 are chars");
    }
    out
}

/// The inverse of [`byte_chars`], indexed by code point (all below 0x144).
fn char_bytes() -> Vec<Option<u8>> {
    let mut table = vec![None; 0x200];
    for (b, c) in byte_chars().iter().enumerate() {
        table[*c as usize] = Some(b as u8);
    }
    table
}

/// Appends the bytes a byte-level token spells to `out`; `false` (with `out` partly
/// written) if a character is not in the GPT-2 table.
fn byte_level_decode_into(token: &str, table: &[Option<u8>], out: &mut Vec<u8>) -> bool {
    // Printable ASCII spells itself: copy runs of it at once.
    let b = token.as_bytes();
    if b.iter().all(|&c| (0x21..=0x7e).contains(&c)) {
        out.extend_from_slice(b);
        return true;
    }
    for c in token.chars() {
        match table.get(c as usize).copied().flatten() {
            Some(x) => out.push(x),
            None => return false,
        }
    }
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormForm {
    Nfc,
    Nfd,
    Nfkc,
    Nfkd,
}

/// The GPT-2 pattern a `ByteLevel` pre-tokenizer with `use_regex: true` applies.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SplitBehavior {
    /// Matches and the gaps between them are separate pieces.
    Isolated,
    /// Matches are dropped, the gaps kept.
    Removed,
}

#[derive(Debug)]
struct SplitStep {
    regex: fancy_regex::Regex,
    behavior: SplitBehavior,
}

/// Where an added token sits.
#[derive(Debug, Clone, Copy)]
struct Added {
    id: TokenId,
    special: bool,
}

/// A byte-level BPE tokenizer loaded from `tokenizer.json`. Cheap to share (`Sync`): encode
/// and decode take `&self`.
pub struct Tokenizer {
    /// Token bytes to id, for the ordinary (non-added) vocabulary; keys live in `bytes`.
    encoder: VocabTable,
    /// The id of each single byte.
    byte_ids: [TokenId; 256],
    /// `(left << 32) | right` to `(rank, merged id)`.
    merges: FxMap<u64, (u32, TokenId)>,
    ignore_merges: bool,
    /// Added tokens by content.
    added: FxMap<Box<[u8]>, Added>,
    /// Distinct added-token lengths, longest first.
    added_lens: Vec<usize>,
    /// Which bytes start an added token.
    added_first: [bool; 256],
    /// Bytes of every id: `spans[id] = (start, len)` into `bytes`, `len == u32::MAX` if unused.
    spans: Vec<(u32, u32)>,
    bytes: Vec<u8>,
    /// Whether each id is a special added token.
    special: Vec<bool>,
    normalizers: Vec<NormForm>,
    splits: Vec<SplitStep>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.encoder.len)
            .field("merges", &self.merges.len())
            .field("added", &self.added.len())
            .field("normalizers", &self.normalizers)
            .field("splits", &self.splits.len())
            .finish()
    }
}

// ---- tokenizer.json, as read ----

/// A string borrowed from the file when it has no escapes.
#[derive(Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

struct VocabJson<'a>(Vec<(Cow<'a, str>, TokenId)>);

impl<'de: 'a, 'a> Deserialize<'de> for VocabJson<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = VocabJson<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from token to id")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Self::Value, M::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(0));
                while let Some((k, v)) = m.next_entry::<Str<'de>, TokenId>()? {
                    out.push((k.0, v));
                }
                Ok(VocabJson(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A merge, written either `"a b"` (older files) or `["a", "b"]`.
struct MergeJson<'a>(Cow<'a, str>, Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for MergeJson<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = MergeJson<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a merge: \"a b\" or [\"a\", \"b\"]")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                let (a, b) = s
                    .split_once(' ')
                    .ok_or_else(|| E::custom(format!("merge {s:?} has no space")))?;
                Ok(MergeJson(Cow::Borrowed(a), Cow::Borrowed(b)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                let (a, b) = s
                    .split_once(' ')
                    .ok_or_else(|| E::custom(format!("merge {s:?} has no space")))?;
                Ok(MergeJson(Cow::Owned(a.into()), Cow::Owned(b.into())))
            }
            fn visit_seq<S: SeqAccess<'de>>(self, mut s: S) -> Result<Self::Value, S::Error> {
                let a: Str<'de> = s
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let b: Str<'de> = s
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                if s.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(3, &self));
                }
                Ok(MergeJson(a.0, b.0))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct AddedTokenJson<'a> {
    id: TokenId,
    #[serde(borrow)]
    content: Cow<'a, str>,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    special: bool,
}

#[derive(Deserialize)]
struct ModelJson<'a> {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(borrow)]
    vocab: VocabJson<'a>,
    #[serde(borrow)]
    merges: Vec<MergeJson<'a>>,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
}

#[derive(Deserialize)]
struct TokenizerJson<'a> {
    #[serde(default, borrow)]
    added_tokens: Vec<AddedTokenJson<'a>>,
    #[serde(default)]
    normalizer: Option<serde_json::Value>,
    #[serde(default)]
    pre_tokenizer: Option<serde_json::Value>,
    #[serde(default)]
    decoder: Option<serde_json::Value>,
    #[serde(borrow)]
    model: ModelJson<'a>,
}

fn type_of(v: &serde_json::Value) -> &str {
    v.get("type").and_then(|t| t.as_str()).unwrap_or("")
}

fn parse_normalizer(v: &serde_json::Value, out: &mut Vec<NormForm>) -> Result<(), LoadError> {
    match type_of(v) {
        "NFC" => out.push(NormForm::Nfc),
        "NFD" => out.push(NormForm::Nfd),
        "NFKC" => out.push(NormForm::Nfkc),
        "NFKD" => out.push(NormForm::Nfkd),
        "Sequence" => {
            let list = v
                .get("normalizers")
                .and_then(|n| n.as_array())
                .ok_or_else(|| {
                    LoadError::Invalid("normalizer Sequence without \"normalizers\"".into())
                })?;
            for n in list {
                parse_normalizer(n, out)?;
            }
        }
        other => {
            return Err(LoadError::Unsupported(format!(
                "normalizer type {other:?} (supported: NFC, NFD, NFKC, NFKD, Sequence)"
            )))
        }
    }
    Ok(())
}

fn compile(pattern: &str) -> Result<fancy_regex::Regex, LoadError> {
    fancy_regex::Regex::new(pattern).map_err(|e| {
        LoadError::Unsupported(format!(
            "pre-tokenizer regex {pattern:?} does not compile: {e}"
        ))
    })
}

fn parse_pre_tokenizer(v: &serde_json::Value, out: &mut Vec<SplitStep>) -> Result<(), LoadError> {
    match type_of(v) {
        "Sequence" => {
            let list = v
                .get("pretokenizers")
                .and_then(|n| n.as_array())
                .ok_or_else(|| {
                    LoadError::Invalid("pre_tokenizer Sequence without \"pretokenizers\"".into())
                })?;
            for p in list {
                parse_pre_tokenizer(p, out)?;
            }
        }
        "Split" => {
            let pattern = v.get("pattern").ok_or_else(|| {
                LoadError::Invalid("Split pre-tokenizer without \"pattern\"".into())
            })?;
            let regex = if let Some(r) = pattern.get("Regex").and_then(|r| r.as_str()) {
                compile(r)?
            } else if let Some(s) = pattern.get("String").and_then(|r| r.as_str()) {
                compile(&fancy_regex::escape(s))?
            } else {
                return Err(LoadError::Invalid(format!(
                    "Split pattern {pattern} is neither {{\"Regex\": ..}} nor {{\"String\": ..}}"
                )));
            };
            if v.get("invert").and_then(|i| i.as_bool()).unwrap_or(false) {
                return Err(LoadError::Unsupported("Split with invert: true".into()));
            }
            let behavior = match v.get("behavior").and_then(|b| b.as_str()) {
                Some("Isolated") => SplitBehavior::Isolated,
                Some("Removed") => SplitBehavior::Removed,
                other => {
                    return Err(LoadError::Unsupported(format!(
                        "Split behavior {other:?} (supported: Isolated, Removed)"
                    )))
                }
            };
            out.push(SplitStep { regex, behavior });
        }
        "ByteLevel" => {
            if v.get("add_prefix_space")
                .and_then(|b| b.as_bool())
                .unwrap_or(false)
            {
                return Err(LoadError::Unsupported(
                    "ByteLevel pre-tokenizer with add_prefix_space: true".into(),
                ));
            }
            // The tokenizers library defaults use_regex to true.
            if v.get("use_regex").and_then(|b| b.as_bool()).unwrap_or(true) {
                out.push(SplitStep {
                    regex: compile(GPT2_PATTERN)?,
                    behavior: SplitBehavior::Isolated,
                });
            }
        }
        other => {
            return Err(LoadError::Unsupported(format!(
                "pre-tokenizer type {other:?} (supported: Sequence, Split, ByteLevel)"
            )))
        }
    }
    Ok(())
}

fn check_decoder(v: &serde_json::Value) -> Result<(), LoadError> {
    match type_of(v) {
        "ByteLevel" => Ok(()),
        "Sequence" => {
            let list = v
                .get("decoders")
                .and_then(|n| n.as_array())
                .ok_or_else(|| {
                    LoadError::Invalid("decoder Sequence without \"decoders\"".into())
                })?;
            list.iter().try_for_each(check_decoder)
        }
        other => Err(LoadError::Unsupported(format!(
            "decoder type {other:?} (only byte-level tokenizers are supported)"
        ))),
    }
}

/// Reused buffers for one encode call.
#[derive(Default)]
struct Scratch {
    syms: Vec<Sym>,
    heap: BinaryHeap<std::cmp::Reverse<(u32, u32)>>,
}

#[derive(Clone, Copy)]
struct Sym {
    id: TokenId,
    next: u32,
    prev: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

/// Every token id must be below this (2^24). The largest id sizes the per-id tables (9 bytes an
/// id) whatever the number of entries, so one token with id 4000000000 asked for 32 GiB and
/// aborted the process. Published vocabularies stay below 2^18 (o200k_harmony has 201088 ids,
/// the largest common ones about 262000); 2^24 leaves 64 times that while capping the tables at
/// about 150 MB.
const MAX_TOKEN_ID: TokenId = 1 << 24;

/// Merges per parallel task when resolving them to ids.
const MERGE_CHUNK: usize = 1 << 14;

/// Resolves merges, written as byte-level spellings, to `(left << 32) | right` keys with
/// their rank and merged id. Each part is decoded to bytes in a reused buffer and looked up in
/// the vocabulary table; the merged token is the two parts' bytes together (decoding is per
/// character, so that equals the lookup of the joined spelling). Chunks run in parallel; the
/// first inconsistent merge (lowest rank) is the error reported, and the first occurrence of a
/// pair wins, as in the tokenizers library.
fn resolve_merges(
    merges: &[MergeJson<'_>],
    vocab: &VocabTable,
    arena: &[u8],
    table: &[Option<u8>],
) -> Result<FxMap<u64, (u32, TokenId)>, LoadError> {
    use rayon::prelude::*;
    if merges.len() > u32::MAX as usize {
        return Err(LoadError::Invalid(format!(
            "{} merges is more than ranks can number",
            merges.len()
        )));
    }
    let resolve_chunk = |chunk: &[MergeJson<'_>]| -> Result<Vec<(u64, TokenId)>, LoadError> {
        let mut out = Vec::with_capacity(chunk.len());
        let mut buf = Vec::with_capacity(64);
        let missing = |s: &str| LoadError::Invalid(format!("merge part {s:?} is not in the vocab"));
        for MergeJson(a, b) in chunk {
            buf.clear();
            if !byte_level_decode_into(a, table, &mut buf) {
                return Err(missing(a));
            }
            let la = buf.len();
            if !byte_level_decode_into(b, table, &mut buf) {
                return Err(missing(b));
            }
            let ia = vocab.get(&buf[..la], arena).ok_or_else(|| missing(a))?;
            let ib = vocab.get(&buf[la..], arena).ok_or_else(|| missing(b))?;
            let new = vocab.get(&buf, arena).ok_or_else(|| {
                LoadError::Invalid(format!(
                    "merge {a:?} {b:?} makes {:?}, not in the vocab",
                    format!("{a}{b}")
                ))
            })?;
            out.push(((u64::from(ia) << 32) | u64::from(ib), new));
        }
        Ok(out)
    };
    let resolved: Vec<Result<Vec<(u64, TokenId)>, LoadError>> =
        merges.par_chunks(MERGE_CHUNK).map(resolve_chunk).collect();
    let mut map: FxMap<u64, (u32, TokenId)> = FxMap::default();
    map.reserve(merges.len());
    let mut rank = 0u32;
    for chunk in resolved {
        for (key, new) in chunk? {
            map.entry(key).or_insert((rank, new));
            rank += 1;
        }
    }
    Ok(map)
}

impl Tokenizer {
    /// Loads `DIR/tokenizer.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, LoadError> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&bytes)
    }

    /// Builds a tokenizer from the bytes of a `tokenizer.json`.
    pub fn from_json(json: &[u8]) -> Result<Self, LoadError> {
        let file: TokenizerJson<'_> = serde_json::from_slice(json).map_err(LoadError::Json)?;
        let model = file.model;
        if let Some(kind) = model.kind.as_deref() {
            if kind != "BPE" {
                return Err(LoadError::Unsupported(format!(
                    "model type {kind:?} (only BPE)"
                )));
            }
        }
        if model.dropout.is_some_and(|d| d > 0.0) {
            return Err(LoadError::Unsupported("BPE dropout".into()));
        }
        if model
            .continuing_subword_prefix
            .as_deref()
            .is_some_and(|s| !s.is_empty())
            || model
                .end_of_word_suffix
                .as_deref()
                .is_some_and(|s| !s.is_empty())
        {
            return Err(LoadError::Unsupported(
                "continuing_subword_prefix / end_of_word_suffix".into(),
            ));
        }
        if model.byte_fallback {
            return Err(LoadError::Unsupported("byte_fallback".into()));
        }
        if let Some(d) = &file.decoder {
            check_decoder(d)?;
        }
        let mut normalizers = Vec::new();
        if let Some(n) = file.normalizer.as_ref().filter(|n| !n.is_null()) {
            parse_normalizer(n, &mut normalizers)?;
        }
        let mut splits = Vec::new();
        if let Some(p) = file.pre_tokenizer.as_ref().filter(|p| !p.is_null()) {
            parse_pre_tokenizer(p, &mut splits)?;
        }

        let table = char_bytes();
        let too_large = |what: &str, tok: &str, id: TokenId| {
            LoadError::Invalid(format!(
                "{what} {tok:?} has id {id}, implausibly large (ids must be below {MAX_TOKEN_ID})"
            ))
        };
        if let Some((tok, id)) = model.vocab.0.iter().find(|(_, id)| *id >= MAX_TOKEN_ID) {
            return Err(too_large("vocab token", tok, *id));
        }
        if let Some(t) = file.added_tokens.iter().find(|t| t.id >= MAX_TOKEN_ID) {
            return Err(too_large("added token", &t.content, t.id));
        }
        let max_vocab = model.vocab.0.iter().map(|(_, id)| *id).max();
        let max_added = file.added_tokens.iter().map(|t| t.id).max();
        let max_id = max_vocab.max(max_added).ok_or_else(|| {
            LoadError::Invalid("the vocabulary and the added tokens are empty".into())
        })?;
        let n_ids = max_id as usize + 1;
        // Vocabulary: each token's bytes (decoded from its byte-level spelling) go once into
        // the arena; the table indexes them there.
        let mut spans = vec![(0u32, u32::MAX); n_ids];
        let mut bytes = Vec::with_capacity(model.vocab.0.iter().map(|(t, _)| t.len()).sum());
        let mut encoder = VocabTable::with_capacity(model.vocab.0.len());
        for (tok, id) in &model.vocab.0 {
            let start = bytes.len();
            if !byte_level_decode_into(tok, &table, &mut bytes) {
                return Err(LoadError::Unsupported(format!(
                    "vocab token {tok:?} is not in byte-level (GPT-2) spelling"
                )));
            }
            if bytes.len() > u32::MAX as usize {
                return Err(LoadError::Invalid("vocabulary bytes exceed 4 GiB".into()));
            }
            let (start, len) = (start as u32, (bytes.len() - start) as u32);
            let slot = &mut spans[*id as usize];
            if slot.1 != u32::MAX {
                return Err(LoadError::Invalid(format!(
                    "id {id} appears twice in the vocab"
                )));
            }
            *slot = (start, len);
            if encoder.insert(&bytes, start, len, *id).is_some() {
                return Err(LoadError::Invalid(format!("token {tok:?} appears twice")));
            }
        }
        let mut byte_ids = [0; 256];
        let bc = byte_chars();
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = encoder.get(&[b as u8], &bytes).ok_or_else(|| {
                LoadError::Invalid(format!(
                    "byte-level vocab has no token for byte 0x{b:02x} ({:?})",
                    bc[b]
                ))
            })?;
        }
        let merges = resolve_merges(&model.merges, &encoder, &bytes, &table)?;
        let mut special = vec![false; n_ids];
        let mut added: FxMap<Box<[u8]>, Added> = FxMap::default();
        let mut added_first = [false; 256];
        let mut added_lens = Vec::new();
        for t in &file.added_tokens {
            if t.single_word || t.lstrip || t.rstrip {
                return Err(LoadError::Unsupported(format!(
                    "added token {:?} uses single_word/lstrip/rstrip",
                    t.content
                )));
            }
            if t.content.is_empty() {
                return Err(LoadError::Invalid(format!("added token {} is empty", t.id)));
            }
            let b = t.content.as_bytes();
            let slot = &mut spans[t.id as usize];
            // An added token may repeat a vocab entry (same id); its content is its text.
            *slot = (bytes.len() as u32, b.len() as u32);
            bytes.extend_from_slice(b);
            special[t.id as usize] = t.special;
            added_first[b[0] as usize] = true;
            if !added_lens.contains(&b.len()) {
                added_lens.push(b.len());
            }
            added.insert(
                b.into(),
                Added {
                    id: t.id,
                    special: t.special,
                },
            );
        }
        added_lens.sort_unstable_by(|a, b| b.cmp(a));
        if bytes.len() > u32::MAX as usize {
            return Err(LoadError::Invalid("vocabulary bytes exceed 4 GiB".into()));
        }
        Ok(Self {
            encoder,
            byte_ids,
            merges,
            ignore_merges: model.ignore_merges,
            added,
            added_lens,
            added_first,
            spans,
            bytes,
            special,
            normalizers,
            splits,
        })
    }

    /// One past the largest id (the size of an embedding table that covers every token).
    pub fn vocab_size(&self) -> usize {
        self.spans.len()
    }

    /// The id of a token given by its text: an added token by its content (`<|start|>`,
    /// `<|im_end|>`), otherwise the vocab token whose bytes are the text's UTF-8.
    pub fn token_to_id(&self, token: &str) -> Option<TokenId> {
        match self.added.get(token.as_bytes()) {
            Some(a) => Some(a.id),
            None => self.encoder.get(token.as_bytes(), &self.bytes),
        }
    }

    /// The bytes of a token (an added token's content), or `None` for an unknown id.
    pub fn token_bytes(&self, id: TokenId) -> Option<&[u8]> {
        let &(start, len) = self.spans.get(id as usize)?;
        if len == u32::MAX {
            return None;
        }
        Some(&self.bytes[start as usize..(start + len) as usize])
    }

    /// Whether `id` is an added token marked special.
    pub fn is_special(&self, id: TokenId) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Encodes text. With `allow_special`, special added tokens written in the text
    /// (`<|start|>`) become their ids; without it they are ordinary text. Added tokens that
    /// are not special are always recognized (as the `tokenizers` library does).
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<TokenId>, EncodeError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_into(text, allow_special, &mut out)?;
        Ok(out)
    }

    /// Encodes text with every added token treated as ordinary text, not even the non-special
    /// ones: what chat templates use for message content so that a user cannot forge
    /// structure. (Equal to tiktoken's `encode_ordinary` for o200k_harmony.)
    pub fn encode_ordinary(&self, text: &str) -> Result<Vec<TokenId>, EncodeError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Scratch::default();
        self.encode_segment(text, &mut out, &mut scratch)?;
        Ok(out)
    }

    /// [`Tokenizer::encode`], appending to `out`.
    pub fn encode_into(
        &self,
        text: &str,
        allow_special: bool,
        out: &mut Vec<TokenId>,
    ) -> Result<(), EncodeError> {
        let mut scratch = Scratch::default();
        let b = text.as_bytes();
        let mut seg_start = 0;
        let mut i = 0;
        while i < b.len() {
            if self.added_first[b[i] as usize] {
                if let Some((len, id)) = self.added_at(&b[i..], allow_special) {
                    // Both ends are char boundaries: the match is whole UTF-8 text.
                    self.encode_segment(&text[seg_start..i], out, &mut scratch)?;
                    out.push(id);
                    i += len;
                    seg_start = i;
                    continue;
                }
            }
            i += 1;
        }
        self.encode_segment(&text[seg_start..], out, &mut scratch)
    }

    fn added_at(&self, rest: &[u8], allow_special: bool) -> Option<(usize, TokenId)> {
        for &len in &self.added_lens {
            if len > rest.len() {
                continue;
            }
            if let Some(a) = self.added.get(&rest[..len]) {
                if allow_special || !a.special {
                    return Some((len, a.id));
                }
            }
        }
        None
    }

    fn normalize<'t>(&self, text: &'t str) -> Cow<'t, str> {
        let mut s = Cow::Borrowed(text);
        for form in &self.normalizers {
            let quick = match form {
                NormForm::Nfc => unicode_normalization::is_nfc_quick(s.chars()),
                NormForm::Nfd => unicode_normalization::is_nfd_quick(s.chars()),
                NormForm::Nfkc => unicode_normalization::is_nfkc_quick(s.chars()),
                NormForm::Nfkd => unicode_normalization::is_nfkd_quick(s.chars()),
            };
            if quick == unicode_normalization::IsNormalized::Yes {
                continue;
            }
            s = Cow::Owned(match form {
                NormForm::Nfc => s.nfc().collect(),
                NormForm::Nfd => s.nfd().collect(),
                NormForm::Nfkc => s.nfkc().collect(),
                NormForm::Nfkd => s.nfkd().collect(),
            });
        }
        s
    }

    /// Normalizes, pre-tokenizes and BPE-encodes text that holds no added token.
    fn encode_segment(
        &self,
        text: &str,
        out: &mut Vec<TokenId>,
        scratch: &mut Scratch,
    ) -> Result<(), EncodeError> {
        if text.is_empty() {
            return Ok(());
        }
        let text = self.normalize(text);
        let text = text.as_ref();
        match self.splits.as_slice() {
            [] => self.bpe(text.as_bytes(), out, scratch),
            [only] => {
                // The common case (one Split): no intermediate list of pieces.
                for_each_piece(only, text, |p| self.bpe(p.as_bytes(), out, scratch))?;
            }
            [first, rest @ ..] => {
                let mut pieces = Vec::new();
                for_each_piece(first, text, |p| pieces.push(p))?;
                for step in rest {
                    let mut next = Vec::with_capacity(pieces.len());
                    for p in &pieces {
                        for_each_piece(step, p, |q| next.push(q))?;
                    }
                    pieces = next;
                }
                for p in pieces {
                    self.bpe(p.as_bytes(), out, scratch);
                }
            }
        }
        Ok(())
    }

    #[inline]
    fn merge_of(&self, a: TokenId, b: TokenId) -> Option<(u32, TokenId)> {
        self.merges
            .get(&((u64::from(a) << 32) | u64::from(b)))
            .copied()
    }

    /// Byte-pair encodes one piece.
    fn bpe(&self, piece: &[u8], out: &mut Vec<TokenId>, s: &mut Scratch) {
        use std::cmp::Reverse;
        match piece.len() {
            0 => return,
            1 => {
                out.push(self.byte_ids[piece[0] as usize]);
                return;
            }
            _ => {}
        }
        if self.ignore_merges {
            if let Some(id) = self.encoder.get(piece, &self.bytes) {
                out.push(id);
                return;
            }
        }
        let n = piece.len();
        s.syms.clear();
        s.syms.extend(piece.iter().enumerate().map(|(i, &b)| Sym {
            id: self.byte_ids[b as usize],
            prev: if i == 0 { NONE } else { i as u32 - 1 },
            next: if i + 1 == n { NONE } else { i as u32 + 1 },
            alive: true,
        }));
        s.heap.clear();
        for i in 0..n - 1 {
            if let Some((rank, _)) = self.merge_of(s.syms[i].id, s.syms[i + 1].id) {
                s.heap.push(Reverse((rank, i as u32)));
            }
        }
        // Lowest rank first, leftmost on ties; stale entries are skipped: an entry is current
        // exactly when the pair now at its position still has its rank (ranks are unique).
        while let Some(Reverse((rank, pos))) = s.heap.pop() {
            let left = s.syms[pos as usize];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = s.syms[left.next as usize];
            let Some((r, new)) = self.merge_of(left.id, right.id) else {
                continue;
            };
            if r != rank {
                continue;
            }
            s.syms[left.next as usize].alive = false;
            let after = right.next;
            {
                let l = &mut s.syms[pos as usize];
                l.id = new;
                l.next = after;
            }
            if after != NONE {
                s.syms[after as usize].prev = pos;
                if let Some((r, _)) = self.merge_of(new, s.syms[after as usize].id) {
                    s.heap.push(Reverse((r, pos)));
                }
            }
            if left.prev != NONE {
                if let Some((r, _)) = self.merge_of(s.syms[left.prev as usize].id, new) {
                    s.heap.push(Reverse((r, left.prev)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(s.syms[i as usize].id);
            i = s.syms[i as usize].next;
        }
    }

    /// The bytes of `ids` joined. Special tokens are left out with `skip_special`.
    pub fn decode_bytes(
        &self,
        ids: &[TokenId],
        skip_special: bool,
    ) -> Result<Vec<u8>, DecodeError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            out.extend_from_slice(self.bytes_of(id)?);
        }
        Ok(out)
    }

    /// `ids` as text. Exact whenever the ids hold whole UTF-8 characters (any output of
    /// [`Tokenizer::encode`] does); bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[TokenId], skip_special: bool) -> Result<String, DecodeError> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    fn bytes_of(&self, id: TokenId) -> Result<&[u8], DecodeError> {
        let max = self.spans.len().saturating_sub(1) as TokenId;
        self.token_bytes(id).ok_or(if id <= max {
            DecodeError::MissingId { id, max }
        } else {
            DecodeError::UnknownId { id, max }
        })
    }
}

/// Calls `f` with each piece `step` cuts `text` into.
fn for_each_piece<'t>(
    step: &SplitStep,
    text: &'t str,
    mut f: impl FnMut(&'t str),
) -> Result<(), EncodeError> {
    let mut last = 0;
    for m in step.regex.find_iter(text) {
        let m = m.map_err(|e| EncodeError::Regex(Box::new(e)))?;
        if m.start() == m.end() {
            continue;
        }
        if m.start() > last {
            f(&text[last..m.start()]);
        }
        if step.behavior == SplitBehavior::Isolated {
            f(m.as_str());
        }
        last = m.end();
    }
    if last < text.len() {
        f(&text[last..]);
    }
    Ok(())
}

/// Turns a stream of bytes into text that only ever holds whole characters.
///
/// Bytes that end inside a character are held until the rest arrives; a sequence that can
/// never become valid UTF-8 is replaced by one U+FFFD per maximal invalid run (as
/// `String::from_utf8_lossy` does), so the concatenation of everything emitted plus
/// [`Utf8Stream::finish`] equals the lossy decoding of all the bytes at once.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
    out: String,
}

impl Utf8Stream {
    /// A stream with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes; returns the text they complete (maybe empty). Reuses an internal buffer.
    pub fn push(&mut self, bytes: &[u8]) -> &str {
        self.out.clear();
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    self.out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    let s = std::str::from_utf8(&self.pending[start..start + valid])
                        .expect("valid_up_to marks valid UTF-8");
                    self.out.push_str(s);
                    start += valid;
                    match e.error_len() {
                        Some(bad) => {
                            self.out.push('\u{FFFD}');
                            start += bad;
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        &self.out
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: what is held back, as U+FFFD (empty if nothing is pending).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Decodes ids one at a time for streaming, emitting only whole characters (see
/// [`Utf8Stream`]). Holds no reference to the tokenizer, so it can live in a session.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    utf8: Utf8Stream,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder; with `skip_special`, special tokens produce no text.
    pub fn new(skip_special: bool) -> Self {
        Self {
            utf8: Utf8Stream::new(),
            skip_special,
        }
    }

    /// Adds one id; returns the text it completes (maybe empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: TokenId) -> Result<&str, DecodeError> {
        if self.skip_special && tokenizer.is_special(id) {
            return Ok(self.utf8.push(&[]));
        }
        let bytes = tokenizer.bytes_of(id)?;
        Ok(self.utf8.push(bytes))
    }

    /// Ends the stream (see [`Utf8Stream::finish`]).
    pub fn finish(&mut self) -> String {
        self.utf8.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        let inv = char_bytes();
        for b in 0..=255u8 {
            assert_eq!(inv[t[b as usize] as usize], Some(b));
        }
    }

    /// A byte-level tokenizer.json: the 256 bytes as ids 0..=255, then `vocab` and `added`
    /// (content, id) entries.
    fn json(vocab: &[(&str, u64)], added: &[(&str, u64)]) -> Vec<u8> {
        let mut v: serde_json::Map<String, serde_json::Value> = byte_chars()
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i.into()))
            .collect();
        for &(tok, id) in vocab {
            v.insert(tok.into(), id.into());
        }
        let added: Vec<_> = added
            .iter()
            .map(|&(content, id)| serde_json::json!({"id": id, "content": content}))
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "added_tokens": added,
            "model": {"type": "BPE", "vocab": v, "merges": []},
        }))
        .expect("json")
    }

    #[test]
    fn implausibly_large_ids_are_refused_naming_the_token() {
        // 4000000000 asked for a 32 GiB table (abort); 400000000 took 3.2 GB.
        for id in [
            4_294_967_290,
            4_000_000_000,
            400_000_000,
            u64::from(MAX_TOKEN_ID),
        ] {
            for (vocab, added) in [
                (&[("hello", id)][..], &[][..]),
                (&[][..], &[("<|big|>", id)][..]),
            ] {
                let e = Tokenizer::from_json(&json(vocab, added))
                    .expect_err("refused")
                    .to_string();
                let tok = if vocab.is_empty() { "<|big|>" } else { "hello" };
                assert!(
                    e.contains(&format!("{tok:?} has id {id}")),
                    "{id} {tok}: {e}"
                );
            }
        }
        let t = Tokenizer::from_json(&json(&[("hello", 300)], &[("<|end|>", 301)])).unwrap();
        assert_eq!(t.vocab_size(), 302);
    }

    #[test]
    fn a_gap_in_the_ids_is_reported_as_missing_not_out_of_range() {
        let t = Tokenizer::from_json(&json(&[("hello", 1000)], &[])).unwrap();
        assert_eq!(t.decode(&[1000], false).unwrap(), "hello");
        let e = t.decode(&[500], false).unwrap_err();
        assert_eq!(e, DecodeError::MissingId { id: 500, max: 1000 });
        let e = e.to_string();
        assert!(
            e.contains("500") && e.contains("missing") && e.contains("gap"),
            "{e}"
        );
        let e = t.decode(&[1001], false).unwrap_err();
        assert_eq!(
            e,
            DecodeError::UnknownId {
                id: 1001,
                max: 1000
            }
        );
    }

    #[test]
    fn utf8_stream_holds_split_characters() {
        let text = "a€b😀";
        let bytes = text.as_bytes();
        let mut s = Utf8Stream::new();
        let mut got = String::new();
        for b in bytes {
            got.push_str(s.push(std::slice::from_ref(b)));
        }
        assert!(!s.has_pending());
        assert_eq!(got, text);
        // "€" split after its first byte: nothing until complete.
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&bytes[..2]), "a");
        assert!(s.has_pending());
        assert_eq!(s.push(&bytes[2..4]), "€");
    }

    #[test]
    fn utf8_stream_replaces_like_lossy() {
        let cases: [&[u8]; 4] = [
            b"ok\xffok",
            b"\xe2\x82",
            b"\xe2\x82x\xf0\x9f\x98\x80\x80",
            b"\xc3\xa9\xed\xa0\x80z",
        ];
        for bytes in cases {
            for cut in 0..=bytes.len() {
                let mut s = Utf8Stream::new();
                let mut got = s.push(&bytes[..cut]).to_string();
                got.push_str(s.push(&bytes[cut..]));
                got.push_str(&s.finish());
                assert_eq!(
                    got,
                    String::from_utf8_lossy(bytes),
                    "{bytes:?} cut at {cut}"
                );
            }
        }
    }
}
