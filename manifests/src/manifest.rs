//! The L0 manifest: what a checkpoint is, to the byte, and its canonical encoding.
//!
//! This module owns the manifest's data model, its canonical binary encoding (postcard behind
//! a magic and a version), its readable JSON view, the model id, and the decoder's checks.
//! It does not read checkpoints (see [`crate::build()`] and [`crate::verify()`]) nor sign
//! (see [`crate::signature`]).
//!
//! # Encoding (format version 1)
//!
//! ```text
//! bytes 0..8   magic  b"STORMOMF"
//! bytes 8..10  format version, u16 little-endian (1)
//! bytes 10..   postcard of `Manifest` (fields in declaration order, integers as varints,
//!              strings and sequences length-prefixed, enums as a varint variant index,
//!              hashes as 32 raw bytes)
//! ```
//!
//! The encoding is canonical: tensors are sorted by name, files and metadata files by name,
//! experts by (layer, expert), and nothing depends on paths, times or hash-map order. The
//! decoder re-encodes what it decoded and rejects any input that is not byte-identical, so
//! one manifest has exactly one encoding and the **model id** (the BLAKE3 of the canonical
//! bytes, [`Manifest::model_id`]) names it.
//!
//! # Expert records and chunks
//!
//! An expert's *record* is the concatenation of its parts in the layer schema's order (the
//! buffer the engine's `ExpertData::from_buffer` takes and peers send). The manifest holds the
//! BLAKE3 of the whole record and the BLAKE3 of each *chunk*: chunk `i` is the plain BLAKE3 of
//! record bytes `[i * chunk_size, min((i + 1) * chunk_size, len))`. The chunk size is a field
//! of the manifest ([`DEFAULT_CHUNK_SIZE`] = 256 KiB unless chosen otherwise at build time), a
//! power of two between [`MIN_CHUNK_SIZE`] and [`MAX_CHUNK_SIZE`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hash::{ExpertId, Hash};

/// The first 8 bytes of an encoded manifest.
pub const MAGIC: [u8; 8] = *b"STORMOMF";
/// The format version this crate writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Bytes before the postcard body: magic and version.
pub const PREFIX_LEN: usize = MAGIC.len() + 2;
/// The chunk size used unless another is chosen: 256 KiB (a 13.2 MB GPT-OSS-20B expert is 51
/// chunks; a lying peer is caught after at most 256 KiB).
pub const DEFAULT_CHUNK_SIZE: u32 = 256 * 1024;
/// The smallest chunk size a manifest may declare.
pub const MIN_CHUNK_SIZE: u32 = 16 * 1024;
/// The largest chunk size a manifest may declare.
pub const MAX_CHUNK_SIZE: u32 = 64 * 1024 * 1024;
/// The largest encoded manifest accepted, checked before anything is read or allocated.
pub const MAX_MANIFEST_LEN: u64 = 256 * 1024 * 1024;
/// The longest tensor or file name accepted.
pub const MAX_NAME_LEN: usize = 1024;
/// The most dimensions a tensor may have.
pub const MAX_DIMS: usize = 8;
/// The most parts an expert record may have.
pub const MAX_EXPERT_PARTS: usize = 64;
/// The MXFP4 block size: elements sharing one E8M0 scale.
pub const MXFP4_BLOCK: u32 = 32;

/// The L0 manifest of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// What model this is: its family and the hashes of its config and tokenizer files.
    pub identity: ModelIdentity,
    /// The chunk size of the per-expert chunk hashes, in bytes.
    pub chunk_size: u32,
    /// The safetensors files, sorted by name.
    pub files: Vec<WeightFile>,
    /// Every tensor, sorted by name.
    pub tensors: Vec<TensorEntry>,
    /// Every expert of every MoE layer, sorted by (layer, expert).
    pub experts: Vec<ExpertEntry>,
}

/// The model's identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// The `model_type` (`gpt_oss`, `qwen3_moe`).
    pub family: String,
    /// `config.json` and, when present, the tokenizer, generation and index files; sorted by
    /// name.
    pub meta: Vec<MetaFile>,
}

/// A small non-weight file of the model folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaFile {
    /// File name in the model folder.
    pub name: String,
    /// Length in bytes.
    pub len: u64,
    /// BLAKE3 of its bytes.
    pub hash: Hash,
}

/// A SHA-256 digest (the hash the Hugging Face Hub lists for LFS files). Hex in JSON, raw
/// bytes in postcard.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Sha256(pub [u8; 32]);

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256({})", hex::encode(&self.0[..5]))
    }
}

impl Serialize for Sha256 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&hex::encode(self.0))
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Sha256 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            let mut out = [0u8; 32];
            hex::decode_to_slice(&s, &mut out).map_err(serde::de::Error::custom)?;
            Ok(Self(out))
        } else {
            <[u8; 32]>::deserialize(d).map(Self)
        }
    }
}

/// One safetensors file of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFile {
    /// File name in the model folder (no directories).
    pub name: String,
    /// Length in bytes.
    pub len: u64,
    /// SHA-256 of the whole file.
    pub sha256: Sha256,
}

/// Element types, as safetensors spells them. The variant order is the encoding: never
/// reorder; append new types at the end.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TensorDtype {
    F32,
    F16,
    BF16,
    F64,
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
    U32,
    U64,
    #[serde(rename = "BOOL")]
    Bool,
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
}

impl TensorDtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool | Self::F8E4M3 | Self::F8E5M2 => 1,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F64 | Self::I64 | Self::U64 => 8,
        }
    }
}

impl From<stormo_engine::safetensors::Dtype> for TensorDtype {
    fn from(d: stormo_engine::safetensors::Dtype) -> Self {
        use stormo_engine::safetensors::Dtype as D;
        match d {
            D::F32 => Self::F32,
            D::F16 => Self::F16,
            D::BF16 => Self::BF16,
            D::F64 => Self::F64,
            D::U8 => Self::U8,
            D::I8 => Self::I8,
            D::I16 => Self::I16,
            D::I32 => Self::I32,
            D::I64 => Self::I64,
            D::U16 => Self::U16,
            D::U32 => Self::U32,
            D::U64 => Self::U64,
            D::Bool => Self::Bool,
            D::F8E4M3 => Self::F8E4M3,
            D::F8E5M2 => Self::F8E5M2,
        }
    }
}

impl fmt::Display for TensorDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::Bool => "BOOL",
            Self::F8E4M3 => "F8_E4M3",
            Self::F8E5M2 => "F8_E5M2",
            other => return write!(f, "{other:?}"),
        };
        f.write_str(s)
    }
}

/// How a tensor's bytes encode numbers beyond its dtype. The variant order is the encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quant {
    /// Plain elements of the dtype.
    None,
    /// MXFP4 (OCP microscaling FP4 E2M1) nibbles, two per byte, `block` elements per scale.
    Mxfp4Blocks {
        /// Elements per block (32).
        block: u32,
    },
    /// MXFP4 E8M0 scales, one per `block` elements.
    Mxfp4Scales {
        /// Elements per block (32).
        block: u32,
    },
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: TensorDtype,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Quantization scheme.
    pub quant: Quant,
    /// Index into [`Manifest::files`].
    pub file: u32,
    /// Absolute byte offset in that file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// BLAKE3 of its bytes.
    pub hash: Hash,
}

/// One part of an expert record: a byte range inside a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPart {
    /// Index into [`Manifest::tensors`].
    pub tensor: u32,
    /// Absolute byte offset in the tensor's file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// One expert: where its record comes from and its hashes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertEntry {
    /// Which expert.
    pub id: ExpertId,
    /// The parts, in record order.
    pub parts: Vec<ExpertPart>,
    /// Record length (the sum of the parts).
    pub len: u64,
    /// BLAKE3 of the whole record.
    pub hash: Hash,
    /// BLAKE3 of each chunk of the record.
    pub chunks: Vec<Hash>,
}

impl ExpertEntry {
    /// The byte range of chunk `index` within the record, if the record has that chunk.
    pub fn chunk_range(&self, chunk_size: u32, index: u32) -> Option<std::ops::Range<u64>> {
        let start = u64::from(index).checked_mul(u64::from(chunk_size))?;
        if start >= self.len {
            return None;
        }
        Some(start..(start + u64::from(chunk_size)).min(self.len))
    }
}

/// The number of chunks of a record of `len` bytes.
pub fn chunk_count(len: u64, chunk_size: u32) -> u64 {
    len.div_ceil(u64::from(chunk_size))
}

/// Why bytes are not a manifest.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Longer than [`MAX_MANIFEST_LEN`].
    #[error("manifest is {len} bytes, more than the {MAX_MANIFEST_LEN}-byte limit")]
    TooLarge {
        /// Its length.
        len: u64,
    },
    /// Does not start with [`MAGIC`].
    #[error("not a stormo manifest (bad magic)")]
    BadMagic,
    /// A format version this build does not read.
    #[error(
        "manifest format version {found} is not supported (this build reads {FORMAT_VERSION})"
    )]
    UnsupportedVersion {
        /// The version found.
        found: u16,
    },
    /// The body is not valid postcard for the manifest.
    #[error("manifest body does not decode: {0}")]
    Postcard(#[source] postcard::Error),
    /// Bytes after the body.
    #[error("{count} unexpected bytes after the manifest body")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// The body decodes but breaks a rule of the format.
    #[error("invalid manifest: {0}")]
    Invalid(String),
    /// Valid but not in canonical form (so its model id would be ambiguous).
    #[error("manifest is not canonically encoded")]
    NotCanonical,
}

impl Manifest {
    /// The canonical bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(PREFIX_LEN + 64 * (self.tensors.len() + 1));
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        postcard::to_io(self, &mut out).expect("writing postcard into a Vec cannot fail");
        out
    }

    /// The model id: BLAKE3 of the canonical bytes.
    pub fn model_id(&self) -> Hash {
        Hash::of(&self.encode())
    }

    /// Decodes and validates canonical manifest bytes. Never panics; checks the length before
    /// decoding anything.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() as u64 > MAX_MANIFEST_LEN {
            return Err(DecodeError::TooLarge {
                len: bytes.len() as u64,
            });
        }
        if bytes.len() < PREFIX_LEN || bytes[..MAGIC.len()] != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != FORMAT_VERSION {
            return Err(DecodeError::UnsupportedVersion { found: version });
        }
        let (m, rest): (Self, _) =
            postcard::take_from_bytes(&bytes[PREFIX_LEN..]).map_err(DecodeError::Postcard)?;
        if !rest.is_empty() {
            return Err(DecodeError::TrailingBytes { count: rest.len() });
        }
        m.validate()?;
        if m.encode() != bytes {
            return Err(DecodeError::NotCanonical);
        }
        Ok(m)
    }

    /// Checks every rule of the format: sorted and unique names, safe file names, indices and
    /// ranges in bounds, lengths consistent with shapes, chunk counts.
    pub fn validate(&self) -> Result<(), DecodeError> {
        let bad = |s: String| Err(DecodeError::Invalid(s));
        let id = &self.identity;
        if id.family.is_empty() || id.family.len() > 64 {
            return bad(format!("family {:?} is empty or too long", id.family));
        }
        check_sorted_names(id.meta.iter().map(|m| m.name.as_str()), "metadata file")?;
        if !id.meta.iter().any(|m| m.name == "config.json") {
            return bad("no config.json among the metadata files".into());
        }
        if !self.chunk_size.is_power_of_two()
            || !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&self.chunk_size)
        {
            return bad(format!(
                "chunk size {} is not a power of two in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]",
                self.chunk_size
            ));
        }
        if self.files.is_empty() {
            return bad("no weight files".into());
        }
        check_sorted_names(self.files.iter().map(|f| f.name.as_str()), "weight file")?;
        if self.tensors.is_empty() {
            return bad("no tensors".into());
        }
        let mut prev: Option<&str> = None;
        for t in &self.tensors {
            if t.name.is_empty() || t.name.len() > MAX_NAME_LEN {
                return bad(format!("tensor name of {} bytes", t.name.len()));
            }
            if prev.is_some_and(|p| p >= t.name.as_str()) {
                return bad(format!("tensor {:?} is out of order or repeated", t.name));
            }
            prev = Some(&t.name);
            if t.shape.len() > MAX_DIMS {
                return bad(format!(
                    "tensor {:?} has {} dimensions",
                    t.name,
                    t.shape.len()
                ));
            }
            let want = t
                .shape
                .iter()
                .try_fold(t.dtype.size(), |a, &d| a.checked_mul(d));
            if want != Some(t.len) {
                return bad(format!(
                    "tensor {:?}: {} {:?} does not take {} bytes",
                    t.name, t.dtype, t.shape, t.len
                ));
            }
            let Some(file) = self.files.get(t.file as usize) else {
                return bad(format!("tensor {:?} names file #{}", t.name, t.file));
            };
            if t.offset.checked_add(t.len).is_none_or(|end| end > file.len) {
                return bad(format!(
                    "tensor {:?} runs past the end of {}",
                    t.name, file.name
                ));
            }
            match t.quant {
                Quant::None => {}
                Quant::Mxfp4Blocks { block } | Quant::Mxfp4Scales { block } => {
                    if t.dtype != TensorDtype::U8 || block == 0 {
                        return bad(format!("tensor {:?}: MXFP4 on {}", t.name, t.dtype));
                    }
                }
            }
        }
        let mut spans: Vec<(u32, u64, u64, &str)> = self
            .tensors
            .iter()
            .map(|t| (t.file, t.offset, t.offset + t.len, t.name.as_str()))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
                return bad(format!("tensors {:?} and {:?} overlap", w[0].3, w[1].3));
            }
        }
        let mut prev: Option<ExpertId> = None;
        for e in &self.experts {
            if prev.is_some_and(|p| p >= e.id) {
                return bad(format!("expert {} is out of order or repeated", e.id));
            }
            prev = Some(e.id);
            if e.parts.is_empty() || e.parts.len() > MAX_EXPERT_PARTS {
                return bad(format!("expert {} has {} parts", e.id, e.parts.len()));
            }
            let mut total = 0u64;
            for p in &e.parts {
                let Some(t) = self.tensors.get(p.tensor as usize) else {
                    return bad(format!("expert {} names tensor #{}", e.id, p.tensor));
                };
                let inside = p.offset >= t.offset
                    && p.offset
                        .checked_add(p.len)
                        .is_some_and(|end| end <= t.offset + t.len);
                if !inside || p.len == 0 {
                    return bad(format!(
                        "expert {}: part [{}, +{}) is not inside tensor {:?}",
                        e.id, p.offset, p.len, t.name
                    ));
                }
                total = total
                    .checked_add(p.len)
                    .ok_or_else(|| DecodeError::Invalid("expert length overflows".into()))?;
            }
            if total != e.len {
                return bad(format!(
                    "expert {}: parts sum to {total} bytes, not {}",
                    e.id, e.len
                ));
            }
            if e.chunks.len() as u64 != chunk_count(e.len, self.chunk_size) {
                return bad(format!(
                    "expert {}: {} chunk hashes for {} bytes",
                    e.id,
                    e.chunks.len(),
                    e.len
                ));
            }
        }
        Ok(())
    }

    /// The readable JSON view: format, version, model id, then the manifest (hashes in hex).
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct View<'a> {
            format: &'static str,
            version: u16,
            model_id: Hash,
            #[serde(flatten)]
            manifest: &'a Manifest,
        }
        let v = View {
            format: "stormo-manifest",
            version: FORMAT_VERSION,
            model_id: self.model_id(),
            manifest: self,
        };
        serde_json::to_string_pretty(&v).expect("a manifest always serializes to JSON")
    }

    /// Looks an expert up (binary search).
    pub fn expert(&self, id: ExpertId) -> Option<&ExpertEntry> {
        self.experts
            .binary_search_by(|e| e.id.cmp(&id))
            .ok()
            .map(|i| &self.experts[i])
    }

    /// Looks a tensor up by name (binary search).
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// The digest of the identity section alone (family and metadata files), which a
    /// signature also binds so that a signature over another model can be told apart from a
    /// manifest altered after signing.
    pub fn identity_digest(&self) -> Hash {
        let bytes = postcard::to_stdvec(&self.identity).expect("postcard into a Vec");
        Hash::of(&bytes)
    }

    /// Total bytes of all weight files.
    pub fn total_file_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }
}

/// Checks that names are valid plain file names, sorted and unique.
fn check_sorted_names<'a>(
    names: impl Iterator<Item = &'a str>,
    what: &str,
) -> Result<(), DecodeError> {
    let mut prev: Option<&str> = None;
    for n in names {
        if !is_plain_file_name(n) {
            return Err(DecodeError::Invalid(format!(
                "{what} name {n:?} is not a plain file name"
            )));
        }
        if prev.is_some_and(|p| p >= n) {
            return Err(DecodeError::Invalid(format!(
                "{what} {n:?} is out of order or repeated"
            )));
        }
        prev = Some(n);
    }
    Ok(())
}

/// A name that can be joined to the model folder without leaving it.
pub(crate) fn is_plain_file_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 255
        && n != "."
        && n != ".."
        && !n.contains(['/', '\\', '\0'])
        && !n.starts_with('~')
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small hand-built manifest: one file, two tensors (one MXFP4), one expert of 2 parts.
    pub(crate) fn small() -> Manifest {
        Manifest {
            identity: ModelIdentity {
                family: "gpt_oss".into(),
                meta: vec![MetaFile {
                    name: "config.json".into(),
                    len: 2,
                    hash: Hash([0x11; 32]),
                }],
            },
            chunk_size: MIN_CHUNK_SIZE,
            files: vec![WeightFile {
                name: "m.st".into(),
                len: 200,
                sha256: Sha256([0x22; 32]),
            }],
            tensors: vec![
                TensorEntry {
                    name: "a".into(),
                    dtype: TensorDtype::BF16,
                    shape: vec![2, 3],
                    quant: Quant::None,
                    file: 0,
                    offset: 100,
                    len: 12,
                    hash: Hash([0x33; 32]),
                },
                TensorEntry {
                    name: "b".into(),
                    dtype: TensorDtype::U8,
                    shape: vec![4],
                    quant: Quant::Mxfp4Scales { block: 32 },
                    file: 0,
                    offset: 112,
                    len: 4,
                    hash: Hash([0x44; 32]),
                },
            ],
            experts: vec![ExpertEntry {
                id: ExpertId {
                    layer: 1,
                    expert: 300,
                },
                parts: vec![
                    ExpertPart {
                        tensor: 0,
                        offset: 106,
                        len: 6,
                    },
                    ExpertPart {
                        tensor: 1,
                        offset: 114,
                        len: 2,
                    },
                ],
                len: 8,
                hash: Hash([0x55; 32]),
                chunks: vec![Hash([0x66; 32])],
            }],
        }
    }

    fn hex_of(parts: &[&str]) -> Vec<u8> {
        let s: String = parts.concat().split_whitespace().collect();
        hex::decode(s).unwrap()
    }

    /// The exact bytes of the small manifest, field by field. Changing the format must break
    /// this test (and bump [`FORMAT_VERSION`]).
    #[test]
    fn golden_encoding_of_a_small_manifest() {
        let h = |b: &str| b.repeat(32);
        let want = hex_of(&[
            "53544f524d4f4d46", // magic "STORMOMF"
            "0100",             // version 1, u16 LE
            // identity
            "07 6770745f6f7373",         // family: len 7, "gpt_oss"
            "01",                        // meta: 1 entry
            "0b 636f6e6669672e6a736f6e", // name "config.json"
            "02",                        // len 2
            &h("11"),                    // BLAKE3
            "808001",                    // chunk_size 16384 (varint)
            "01",                        // files: 1
            "04 6d2e7374",               // name "m.st"
            "c801",                      // len 200
            &h("22"),                    // SHA-256
            "02",                        // tensors: 2
            "01 61",                     // name "a"
            "02",                        // dtype BF16 (variant 2)
            "02 02 03",                  // shape [2, 3]
            "00",                        // quant None
            "00",                        // file 0
            "64",                        // offset 100
            "0c",                        // len 12
            &h("33"),                    // BLAKE3
            "01 62",                     // name "b"
            "04",                        // dtype U8 (variant 4)
            "01 04",                     // shape [4]
            "02 20",                     // quant Mxfp4Scales { block: 32 }
            "00",                        // file 0
            "70",                        // offset 112
            "04",                        // len 4
            &h("44"),                    // BLAKE3
            "01",                        // experts: 1
            "01 ac02",                   // id: layer 1, expert 300
            "02",                        // parts: 2
            "00 6a 06",                  // tensor 0, offset 106, len 6
            "01 72 02",                  // tensor 1, offset 114, len 2
            "08",                        // record len 8
            &h("55"),                    // record BLAKE3
            "01",                        // chunks: 1
            &h("66"),                    // chunk 0 BLAKE3
        ]);
        let m = small();
        assert_eq!(hex::encode(m.encode()), hex::encode(&want));
        assert_eq!(Manifest::decode(&want).unwrap(), m);
    }

    #[test]
    fn decoder_rejects_bad_prefix_trailing_and_non_canonical_bytes() {
        let good = small().encode();
        let mut b = good.clone();
        b[0] ^= 1;
        assert!(matches!(Manifest::decode(&b), Err(DecodeError::BadMagic)));
        let mut b = good.clone();
        b[8] = 2;
        assert!(matches!(
            Manifest::decode(&b),
            Err(DecodeError::UnsupportedVersion { found: 2 })
        ));
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(
            Manifest::decode(&b),
            Err(DecodeError::TrailingBytes { count: 1 })
        ));
        // An overlong varint for the meta file length (2 as 0x82 0x00) decodes to the same
        // value but is not canonical.
        let pos = PREFIX_LEN + 8 + 1 + 12;
        assert_eq!(good[pos], 0x02);
        let mut b = good[..pos].to_vec();
        b.extend_from_slice(&[0x82, 0x00]);
        b.extend_from_slice(&good[pos + 1..]);
        assert!(matches!(
            Manifest::decode(&b),
            Err(DecodeError::NotCanonical | DecodeError::Postcard(_))
        ));
    }

    #[test]
    fn validation_rejects_path_traversal_and_bad_ranges() {
        let mut m = small();
        m.files[0].name = "../etc/passwd".into();
        assert!(matches!(
            Manifest::decode(&m.encode()),
            Err(DecodeError::Invalid(_))
        ));
        let mut m = small();
        m.tensors[1].offset = 198;
        assert!(Manifest::decode(&m.encode()).is_err());
        let mut m = small();
        m.experts[0].parts[1].offset = 117;
        assert!(Manifest::decode(&m.encode()).is_err());
        let mut m = small();
        m.experts[0].chunks.push(Hash::default());
        assert!(Manifest::decode(&m.encode()).is_err());
        let mut m = small();
        m.tensors.swap(0, 1);
        assert!(Manifest::decode(&m.encode()).is_err());
        let mut m = small();
        m.chunk_size = 3000;
        assert!(Manifest::decode(&m.encode()).is_err());
    }

    #[test]
    fn json_view_has_hex_hashes_and_the_model_id() {
        let m = small();
        let j: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
        assert_eq!(j["model_id"], m.model_id().to_hex());
        assert_eq!(j["files"][0]["sha256"], "22".repeat(32));
        assert_eq!(j["tensors"][1]["quant"]["mxfp4_scales"]["block"], 32);
        assert_eq!(j["tensors"][0]["dtype"], "BF16");
    }

    fn arb_hash() -> impl Strategy<Value = Hash> {
        any::<[u8; 32]>().prop_map(Hash)
    }

    /// Random valid manifests: a file, tensors laid end to end, experts cut from them.
    fn arb_manifest() -> impl Strategy<Value = Manifest> {
        (
            prop::collection::vec((1u64..5, 1u64..40, arb_hash(), 0u8..3), 1..6),
            prop::collection::vec(
                (
                    0u16..4,
                    prop::collection::vec((any::<u32>(), any::<u32>()), 1..4),
                ),
                0..5,
            ),
            arb_hash(),
            0u32..3,
            "[a-z_]{1,12}",
        )
            .prop_map(|(ts, es, h, cs, family)| {
                let chunk_size = MIN_CHUNK_SIZE << cs;
                let mut tensors = Vec::new();
                let mut off = 8u64;
                for (i, (a, b, hash, q)) in ts.into_iter().enumerate() {
                    let (dtype, quant) = match q {
                        0 => (TensorDtype::F32, Quant::None),
                        1 => (TensorDtype::U8, Quant::Mxfp4Blocks { block: 32 }),
                        _ => (TensorDtype::BF16, Quant::None),
                    };
                    let len = a * b * 1000 * dtype.size();
                    tensors.push(TensorEntry {
                        name: format!("t{i:03}"),
                        dtype,
                        shape: vec![a, b, 1000],
                        quant,
                        file: 0,
                        offset: off,
                        len,
                        hash,
                    });
                    off += len;
                }
                let mut experts = Vec::new();
                for (n, (layer, parts)) in es.into_iter().enumerate() {
                    let parts: Vec<ExpertPart> = parts
                        .into_iter()
                        .map(|(t, o)| {
                            let t = &tensors[t as usize % tensors.len()];
                            let start = u64::from(o) % t.len;
                            let len = 1 + (u64::from(o) >> 7) % (t.len - start);
                            ExpertPart {
                                tensor: tensors.iter().position(|x| x.name == t.name).unwrap()
                                    as u32,
                                offset: t.offset + start,
                                len,
                            }
                        })
                        .collect();
                    let len: u64 = parts.iter().map(|p| p.len).sum();
                    experts.push(ExpertEntry {
                        id: ExpertId {
                            layer,
                            expert: n as u16,
                        },
                        parts,
                        len,
                        hash: h,
                        chunks: vec![h; chunk_count(len, chunk_size) as usize],
                    });
                }
                experts.sort_by_key(|e| e.id);
                experts.dedup_by_key(|e| e.id);
                Manifest {
                    identity: ModelIdentity {
                        family,
                        meta: vec![MetaFile {
                            name: "config.json".into(),
                            len: 10,
                            hash: h,
                        }],
                    },
                    chunk_size,
                    files: vec![WeightFile {
                        name: "model.safetensors".into(),
                        len: off + 3,
                        sha256: Sha256(h.0),
                    }],
                    tensors,
                    experts,
                }
            })
    }

    proptest! {
        #[test]
        fn round_trip(m in arb_manifest()) {
            m.validate().unwrap();
            let bytes = m.encode();
            let back = Manifest::decode(&bytes).unwrap();
            prop_assert_eq!(&back, &m);
            prop_assert_eq!(back.model_id(), Hash::of(&bytes));
        }

        #[test]
        fn decoder_survives_random_bytes(body in prop::collection::vec(any::<u8>(), 0..2048)) {
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
            bytes.extend_from_slice(&body);
            let _ = Manifest::decode(&bytes);
            let _ = Manifest::decode(&body);
        }

        #[test]
        fn decoder_survives_mutated_manifests(
            m in arb_manifest(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut bytes = m.encode();
            for (i, v) in flips {
                let i = i.index(bytes.len());
                bytes[i] = v;
            }
            if let Ok(d) = Manifest::decode(&bytes) {
                // Whatever decodes is canonical and valid.
                prop_assert_eq!(d.encode(), bytes.clone());
            }
            let n = cut.index(bytes.len());
            let _ = Manifest::decode(&bytes[..n]);
        }
    }
}
