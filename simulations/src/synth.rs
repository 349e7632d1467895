//! Random-weight checkpoints with a real model's geometry and published layout.
//!
//! [`plan`] turns a [`Geometry`] (a [`Preset`] with optional [`Overrides`]) and a seed into a
//! [`Plan`]: every tensor's name, dtype, shape, shard and byte offset, and the JSON files the hub
//! ships beside the weights. [`write()`] then streams the shards to disk: each shard's header is
//! written from the computed offsets, and every tensor is generated in chunks, in parallel, by
//! a counter-based generator, so nothing larger than a few chunks is ever held in memory.
//!
//! # Layout (what "as published" means here)
//! - **GPT-OSS** (SPEC §1, §4.1): experts as MXFP4 `*_blocks` U8 `[E, 2I, H/32, 16]` /
//!   `[E, H, I/32, 16]` with E8M0 `*_scales` U8; everything else BF16 (sinks, norms, router and
//!   expert biases included). Shards are named like the convert script names them
//!   (`model-00000-of-00002.safetensors`: numbered from 0, "of" the last number), filled
//!   greedily in the hub index's order up to 4.8 GB, which reproduces the published
//!   gpt-oss-20b split tensor for tensor (and its `total_size` of 13,761,264,768 bytes).
//!   `config.json`, `generation_config.json` and `model.safetensors.index.json` are formatted
//!   as the hub's files are.
//! - **Qwen3-30B-A3B** (SPEC §5): all BF16, one tensor per expert
//!   (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), no biases, QK-norm weights,
//!   shards named `model-00001-of-00016.safetensors` of at most 4 GB, hub-style config.
//! - Inside a shard, tensors lie as the `safetensors` Python library lays them: wider dtypes
//!   first, then by name; the header carries `{"format": "pt"}` metadata and is padded with
//!   spaces to a multiple of 8 bytes.
//!
//! # Values
//! Chosen so that a forward pass stays finite and its logits are not degenerate over many
//! tokens, at any width: linear weights ~ N(0, 1/fan_in) (≈ N(0, 0.02) at 2880 wide), the
//! embedding ~ N(0, 0.02), norms ~ N(1, 0.05), biases ~ N(0, 0.02), sinks ~ N(0, 0.5). MXFP4
//! experts draw each 4-bit code from a rounded Gaussian and each block's E8M0 scale from two
//! neighbouring exponents, mixed so the dequantised weights have the same N(0, 1/fan_in)
//! variance. With [`HotExperts`] (GPT-OSS), a seeded subset of each layer's experts gets a
//! larger router bias, so routing is skewed as in real models.
//!
//! # Determinism
//! Element `i` of tensor `t` is a pure function of (seed, name of `t`, `i`), so the bytes do
//! not depend on chunking, thread count or write order: the same seed gives byte-identical
//! files, another seed different ones.

mod layout;
mod pyjson;
mod rng;
mod writer;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub use layout::{Plan, ShardPlan, TensorPlan};
pub use stormo_engine::Family;
pub use writer::{checkpoint_files, write, Progress, Report};

/// The published models whose geometry and layout can be synthesised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// openai/gpt-oss-20b: 24 layers, 32 experts of 2880, MXFP4.
    GptOss20b,
    /// openai/gpt-oss-120b: 36 layers, 128 experts of 2880, MXFP4.
    GptOss120b,
    /// Qwen/Qwen3-30B-A3B: 48 layers, 128 experts of 768, BF16.
    Qwen3_30bA3b,
}

impl Preset {
    /// Every preset.
    pub const ALL: [Self; 3] = [Self::GptOss20b, Self::GptOss120b, Self::Qwen3_30bA3b];

    /// The name used on the command line (`gpt-oss-20b`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::GptOss20b => "gpt-oss-20b",
            Self::GptOss120b => "gpt-oss-120b",
            Self::Qwen3_30bA3b => "qwen3-30b-a3b",
        }
    }

    /// The published geometry.
    pub fn geometry(self) -> Geometry {
        match self {
            Self::GptOss20b | Self::GptOss120b => Geometry {
                family: Family::GptOss,
                layers: if self == Self::GptOss20b { 24 } else { 36 },
                hidden: 2880,
                heads: 64,
                kv_heads: 8,
                head_dim: 64,
                vocab: 201_088,
                experts: if self == Self::GptOss20b { 32 } else { 128 },
                top_k: 4,
                intermediate: 2880,
                dense_intermediate: 0,
            },
            Self::Qwen3_30bA3b => Geometry {
                family: Family::Qwen3Moe,
                layers: 48,
                hidden: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                vocab: 151_936,
                experts: 128,
                top_k: 8,
                intermediate: 768,
                dense_intermediate: 6144,
            },
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<Self, SynthError> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| SynthError::UnknownPreset(s.to_string()))
    }
}

/// The shape of a model: everything that sets tensor shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Model family (sets names, dtypes and the config format).
    pub family: Family,
    /// Decoder layers.
    pub layers: usize,
    /// Residual width H.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Per-expert intermediate width I (`intermediate_size` for GPT-OSS,
    /// `moe_intermediate_size` for Qwen3).
    pub intermediate: usize,
    /// Qwen3's `intermediate_size` for dense layers (written to the config; every synthesised
    /// Qwen3 layer is MoE, as in Qwen3-30B-A3B). Unused for GPT-OSS.
    pub dense_intermediate: usize,
}

/// Geometry changes on top of a preset, for small test and demo models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Decoder layers.
    pub layers: Option<usize>,
    /// Residual width H.
    pub hidden: Option<usize>,
    /// Per-expert intermediate width.
    pub intermediate: Option<usize>,
    /// Experts per layer.
    pub experts: Option<usize>,
    /// Experts per token.
    pub top_k: Option<usize>,
    /// Vocabulary size.
    pub vocab: Option<usize>,
    /// Query heads.
    pub heads: Option<usize>,
    /// Key/value heads.
    pub kv_heads: Option<usize>,
    /// Per-head width.
    pub head_dim: Option<usize>,
}

/// Upper bound on any one dimension (keeps every size computation far from overflow).
const MAX_DIM: usize = 1 << 24;

impl Geometry {
    /// This geometry with `o` applied.
    pub fn with(mut self, o: &Overrides) -> Self {
        let set = |v: &mut usize, o: Option<usize>| {
            if let Some(x) = o {
                *v = x;
            }
        };
        set(&mut self.layers, o.layers);
        set(&mut self.hidden, o.hidden);
        set(&mut self.intermediate, o.intermediate);
        set(&mut self.experts, o.experts);
        set(&mut self.top_k, o.top_k);
        set(&mut self.vocab, o.vocab);
        set(&mut self.heads, o.heads);
        set(&mut self.kv_heads, o.kv_heads);
        set(&mut self.head_dim, o.head_dim);
        self
    }

    /// Checks that the engine (and Transformers) could run this geometry.
    pub fn validate(&self) -> Result<(), SynthError> {
        let bad = |m: String| Err(SynthError::Geometry(m));
        for (name, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv-heads", self.kv_heads),
            ("head-dim", self.head_dim),
            ("vocab", self.vocab),
            ("experts", self.experts),
            ("top-k", self.top_k),
            ("intermediate", self.intermediate),
        ] {
            if v == 0 || v > MAX_DIM {
                return bad(format!("{name} must be between 1 and {MAX_DIM}, got {v}"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads ({}) must be a multiple of kv-heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head-dim must be even for RoPE, got {}",
                self.head_dim
            ));
        }
        if self.top_k > self.experts {
            return bad(format!(
                "top-k ({}) cannot exceed experts ({})",
                self.top_k, self.experts
            ));
        }
        if self.family == Family::GptOss {
            for (name, v) in [("hidden", self.hidden), ("intermediate", self.intermediate)] {
                if v % 32 != 0 {
                    return bad(format!(
                        "{name} must be a multiple of 32 for MXFP4 experts (blocks of 32), got {v}"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Skewed routing: a seeded subset of each layer's experts is preferred by the router, through
/// its bias. GPT-OSS only: Qwen3-MoE's router has no bias, and scaling its rows instead does not
/// make experts reliably hot with random weights (the hidden states share a component across
/// positions, so a larger row pushes its expert's logit down as often as up).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HotExperts {
    /// Share of each layer's experts that are hot, in (0, 1]; at least one expert is hot.
    pub fraction: f64,
    /// Added to the hot experts' router bias (router logits are about N(0, 1)).
    pub bias: f32,
}

/// Everything that decides a synthesised checkpoint's bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthOptions {
    /// Shapes.
    pub geometry: Geometry,
    /// Seed of every value.
    pub seed: u64,
    /// Skewed routing, if any.
    pub hot: Option<HotExperts>,
    /// Largest shard in bytes of tensor data (None: 4.8 GB for GPT-OSS, 4 GB for Qwen3, as the
    /// hub's shards). A tensor larger than this gets a shard of its own.
    pub shard_bytes: Option<u64>,
}

impl SynthOptions {
    /// Options for `geometry` with `seed`, no skew and hub-sized shards.
    pub fn new(geometry: Geometry, seed: u64) -> Self {
        Self {
            geometry,
            seed,
            hot: None,
            shard_bytes: None,
        }
    }
}

/// Why a checkpoint could not be planned or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    /// The preset name is not known.
    #[error("unknown preset {0:?} (known: gpt-oss-20b, gpt-oss-120b, qwen3-30b-a3b)")]
    UnknownPreset(String),
    /// The geometry cannot be run.
    #[error("invalid geometry: {0}")]
    Geometry(String),
    /// An option is out of range.
    #[error("invalid option: {0}")]
    Option(String),
    /// The output folder already holds a checkpoint.
    #[error("{} already holds {file}; choose an empty folder or pass --force to replace the checkpoint files", dir.display())]
    OutputExists {
        /// The output folder.
        dir: PathBuf,
        /// The file found there.
        file: String,
    },
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl SynthError {
    fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// Plans a checkpoint: validates the options and lays every tensor out. Cheap (no tensor data).
pub fn plan(opts: &SynthOptions) -> Result<Plan, SynthError> {
    opts.geometry.validate()?;
    if let Some(h) = opts.hot {
        if opts.geometry.family != Family::GptOss {
            return Err(SynthError::Option(
                "--hot-experts needs a router bias; Qwen3-MoE's router has no bias, so skewed \
                 routing is only available for the GPT-OSS presets"
                    .into(),
            ));
        }
        if !(h.fraction > 0.0 && h.fraction <= 1.0) {
            return Err(SynthError::Option(format!(
                "hot-experts fraction must be in (0, 1], got {}",
                h.fraction
            )));
        }
        if !h.bias.is_finite() || h.bias < 0.0 || h.bias > 100.0 {
            return Err(SynthError::Option(format!(
                "hot-bias must be between 0 and 100, got {}",
                h.bias
            )));
        }
    }
    if opts.shard_bytes == Some(0) {
        return Err(SynthError::Option("shard size must be positive".into()));
    }
    Ok(layout::build(opts))
}
