//! Building the L0 manifest of a checkpoint folder.
//!
//! The engine says what the checkpoint holds (it validates every safetensors header) and how
//! each expert is laid out; this module hashes it all in one sequential pass per file (see
//! the hashing notes in the crate docs) and assembles the canonical [`Manifest`]. Non-goal:
//! it does not write files (the CLI does, see [`crate::ManifestPaths`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use stormo_engine::layout::ExpertLayout;
use stormo_engine::moe::PartFormat;
use stormo_engine::safetensors::Checkpoint;
use stormo_engine::ModelConfig;

use crate::hash::{ExpertId, Hash};
use crate::hashing::{self, IoMode, Plan, Progress, Span, PENDING_BUDGET};
use crate::manifest::{
    is_plain_file_name, ExpertEntry, ExpertPart, Manifest, MetaFile, ModelIdentity, Quant,
    TensorEntry, WeightFile, DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, MXFP4_BLOCK,
};

/// The non-weight files whose hashes make up the model's identity, when present
/// (`config.json` is required).
pub const META_FILES: &[&str] = &[
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
];

/// The largest metadata file read (tokenizers are tens of MB).
pub const MAX_META_LEN: u64 = 1 << 30;

/// How to build.
#[derive(Clone, Copy, Debug)]
pub struct BuildOptions<'a> {
    /// Chunk size of the per-expert chunk hashes (a power of two within the format's bounds).
    pub chunk_size: u32,
    /// Where to report progress, if anywhere.
    pub progress: Option<&'a Progress>,
    /// How the weight files are read.
    pub io: IoMode,
}

impl Default for BuildOptions<'_> {
    fn default() -> Self {
        Self {
            chunk_size: DEFAULT_CHUNK_SIZE,
            progress: None,
            io: IoMode::Buffered,
        }
    }
}

/// Why a manifest could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// `config.json` is missing or not a supported model.
    #[error("cannot read the model config: {0}")]
    Config(#[source] stormo_engine::Error),
    /// The safetensors files are missing or malformed.
    #[error("cannot open the checkpoint: {0}")]
    Checkpoint(#[source] stormo_engine::Error),
    /// The folder holds the dense tensors only (pulled without its experts): a manifest is
    /// built from a whole checkpoint.
    #[error(
        "the folder holds the dense tensors only ({absent} expert tensors are not there: it \
         was pulled without its experts); a manifest is built from a whole checkpoint (the \
         publisher's, or one pulled with `stormo pull --with-experts`)"
    )]
    DenseOnly {
        /// How many tensors are absent.
        absent: usize,
    },
    /// The expert tensors are not what the config implies.
    #[error("the checkpoint's expert tensors do not match its config: {0}")]
    Layout(#[source] stormo_engine::Error),
    /// The requested chunk size is not allowed.
    #[error("chunk size {0} is not a power of two in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")]
    ChunkSize(u32),
    /// A metadata file could not be read.
    #[error("{}: {source}", path.display())]
    Meta {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A metadata file is larger than [`MAX_META_LEN`].
    #[error("{}: {len} bytes is too large for a metadata file", path.display())]
    MetaTooLarge {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// A checkpoint file has a name the manifest cannot hold.
    #[error("{}: not a plain UTF-8 file name", path.display())]
    FileName {
        /// The file.
        path: PathBuf,
    },
    /// A file could not be read in full while hashing.
    #[error("{file}: could not read while hashing: {reason}")]
    Read {
        /// The file.
        file: String,
        /// What happened.
        reason: String,
    },
    /// A file changed length between opening and hashing.
    #[error("{file}: changed while hashing ({expected} bytes when opened, {found} now)")]
    Changed {
        /// The file.
        file: String,
        /// Length when opened.
        expected: u64,
        /// Length when hashed.
        found: u64,
    },
    /// The checkpoint is valid for the engine but not representable in the manifest format.
    #[error("checkpoint not representable in a manifest: {0}")]
    Unsupported(String),
}

/// Builds the manifest of the checkpoint in `dir`: one read of every byte, hashed in a
/// pipeline on all cores (see the crate's hashing notes).
pub fn build(dir: &Path, opts: &BuildOptions<'_>) -> Result<Manifest, BuildError> {
    build_with(dir, opts, false)
}

/// Builds the same manifest as [`build`] the plain way: each tensor and expert record read
/// whole and hashed one after another, on one thread. Slow; for tests that hold the pipeline
/// to it.
#[doc(hidden)]
pub fn build_reference(dir: &Path, chunk_size: u32) -> Result<Manifest, BuildError> {
    let opts = BuildOptions {
        chunk_size,
        ..BuildOptions::default()
    };
    build_with(dir, &opts, true)
}

fn build_with(
    dir: &Path,
    opts: &BuildOptions<'_>,
    reference: bool,
) -> Result<Manifest, BuildError> {
    let cs = opts.chunk_size;
    if !cs.is_power_of_two() || !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&cs) {
        return Err(BuildError::ChunkSize(cs));
    }
    let cfg = ModelConfig::from_dir(dir).map_err(BuildError::Config)?;
    let ckpt = Checkpoint::open(dir).map_err(BuildError::Checkpoint)?;
    if !ckpt.absent.is_empty() {
        return Err(BuildError::DenseOnly {
            absent: ckpt.absent.len(),
        });
    }
    let layout = ExpertLayout::from_checkpoint(&ckpt, &cfg).map_err(BuildError::Layout)?;

    let mut meta = Vec::new();
    for name in META_FILES {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        let len = std::fs::metadata(&path)
            .map_err(|source| BuildError::Meta {
                path: path.clone(),
                source,
            })?
            .len();
        if len > MAX_META_LEN {
            return Err(BuildError::MetaTooLarge { path, len });
        }
        let bytes =
            crate::read_small_file(&path, MAX_META_LEN).map_err(|source| BuildError::Meta {
                path: path.clone(),
                source,
            })?;
        meta.push(MetaFile {
            name: (*name).to_string(),
            len: bytes.len() as u64,
            hash: Hash::of(&bytes),
        });
    }

    // Files sorted by name; `remap[engine index] = manifest index`.
    let mut names = Vec::with_capacity(ckpt.files.len());
    for (i, f) in ckpt.files.iter().enumerate() {
        let name = f
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| is_plain_file_name(n))
            .ok_or_else(|| BuildError::FileName {
                path: f.path.clone(),
            })?;
        names.push((name.to_string(), f.len, i));
    }
    names.sort();
    let mut remap = vec![0u32; names.len()];
    for (k, (_, _, i)) in names.iter().enumerate() {
        remap[*i] = k as u32;
    }

    let mut formats: HashMap<&str, PartFormat> = HashMap::new();
    for (l, schema) in layout.schemas.iter().enumerate() {
        let Some(schema) = schema else { continue };
        for parts in &layout.parts[l] {
            for (p, ps) in parts.iter().zip(&schema.parts) {
                formats.insert(p.tensor.as_str(), ps.format);
            }
        }
    }

    let mut tensors = Vec::with_capacity(ckpt.tensors.len());
    let mut index: HashMap<&str, u32> = HashMap::new();
    for (name, t) in &ckpt.tensors {
        let quant = match formats.get(name.as_str()) {
            Some(PartFormat::Mxfp4Blocks) => Quant::Mxfp4Blocks { block: MXFP4_BLOCK },
            Some(PartFormat::Mxfp4Scales) => Quant::Mxfp4Scales { block: MXFP4_BLOCK },
            _ => Quant::None,
        };
        index.insert(name, tensors.len() as u32);
        tensors.push(TensorEntry {
            name: name.clone(),
            dtype: t.dtype.into(),
            shape: t.shape.iter().map(|&d| d as u64).collect(),
            quant,
            file: remap[t.file],
            offset: t.offset,
            len: t.len,
            hash: Hash::default(),
        });
    }

    let mut experts = Vec::new();
    for (l, per_layer) in layout.parts.iter().enumerate() {
        for (e, parts) in per_layer.iter().enumerate() {
            let id = ExpertId {
                layer: u16::try_from(l)
                    .map_err(|_| BuildError::Unsupported(format!("layer index {l}")))?,
                expert: u16::try_from(e)
                    .map_err(|_| BuildError::Unsupported(format!("expert index {e}")))?,
            };
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                let tensor = *index.get(p.tensor.as_str()).ok_or_else(|| {
                    BuildError::Unsupported(format!("expert {id} names unknown tensor"))
                })?;
                out.push(ExpertPart {
                    tensor,
                    offset: p.loc.offset,
                    len: p.loc.len,
                });
            }
            experts.push(ExpertEntry {
                id,
                len: out.iter().map(|p| p.len).sum(),
                parts: out,
                hash: Hash::default(),
                chunks: Vec::new(),
            });
        }
    }
    experts.sort_by_key(|e| e.id);

    let plan = Plan {
        dir: dir.to_path_buf(),
        files: names.iter().map(|(n, l, _)| (n.clone(), *l)).collect(),
        tensors: tensors
            .iter()
            .map(|t| Span {
                file: t.file as usize,
                offset: t.offset,
                len: t.len,
            })
            .collect(),
        experts: experts
            .iter()
            .map(|e| {
                e.parts
                    .iter()
                    .map(|p| Span {
                        file: tensors[p.tensor as usize].file as usize,
                        offset: p.offset,
                        len: p.len,
                    })
                    .collect()
            })
            .collect(),
        chunk_size: cs,
        io: opts.io,
        pending_budget: PENDING_BUDGET,
    };
    let hashed = if reference {
        hashing::reference(&plan)
    } else {
        hashing::run(&plan, opts.progress)
    };

    let mut files = Vec::with_capacity(names.len());
    for ((name, len, _), out) in names.iter().zip(hashed.files) {
        let found = out.len.unwrap_or(0);
        if found != *len {
            return Err(BuildError::Changed {
                file: name.clone(),
                expected: *len,
                found,
            });
        }
        let sha256 = out.sha256.ok_or_else(|| BuildError::Read {
            file: name.clone(),
            reason: out.error.unwrap_or_else(|| "unknown error".into()),
        })?;
        files.push(WeightFile {
            name: name.clone(),
            len: *len,
            sha256,
        });
    }
    for (t, h) in tensors.iter_mut().zip(hashed.tensors) {
        t.hash = h.ok_or_else(|| BuildError::Read {
            file: files[t.file as usize].name.clone(),
            reason: format!("tensor {:?} could not be read in full", t.name),
        })?;
    }
    for (e, h) in experts.iter_mut().zip(hashed.experts) {
        let (hash, chunks) = h.ok_or_else(|| BuildError::Read {
            file: files[tensors[e.parts[0].tensor as usize].file as usize]
                .name
                .clone(),
            reason: format!("expert {} could not be read in full", e.id),
        })?;
        e.hash = hash;
        e.chunks = chunks;
    }

    let m = Manifest {
        identity: ModelIdentity {
            family: cfg.family.model_type().to_string(),
            meta,
        },
        chunk_size: cs,
        files,
        tensors,
        experts,
    };
    m.validate()
        .map_err(|e| BuildError::Unsupported(e.to_string()))?;
    Ok(m)
}
