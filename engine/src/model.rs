//! The shared decoder: loading the dense weights of either family, sessions with a KV cache,
//! and the block forward used by both prefill and decode.
//!
//! Both families are pre-norm decoders with GQA attention and an MoE (or dense) MLP; they
//! differ in options the [`ModelConfig`] carries (biases, sinks, QK-norm, sliding layers,
//! routing rule, activation), so one forward serves both, and the family files only say
//! where their experts lie. Everything is computed in f32; weights stay in their stored format
//! and are widened inside the kernels.
//!
//! A forward processes a block of positions per layer: projections for all positions, RoPE,
//! the KV write, attention in position order, the routing of all positions, then each expert
//! of the block's union once for all positions that chose it. Decode is the same with a block
//! of one, and gives bit-identical results per position. A block may also hold the positions
//! of several sessions ([`Model::forward_batch`], `model/batch.rs`): continuous batching, with
//! the same bits per position again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::config::{Family, ModelConfig};
use crate::error::{Error, Result};
use crate::huge::HugeBuf;
use crate::kernels::{matmul, matmul_batch, Float, Mat, Product, Vector};
use crate::layout::{ExpertLayout, Loader, Loc};
use crate::moe::{
    self, ExpertData, ExpertExecutor, ExpertProvider, MappedExperts, MoeScratch, PartBytes,
};
use crate::ops;
use crate::profile::{self, Phase};
use crate::rope::Rope;
use crate::safetensors::{Checkpoint, MappedFile};
use crate::sampling::Sampler;
use crate::tiers::{self, disk::DiskFile, DiskTier};

mod batch;
mod head;
mod persist;
pub use batch::{Batch, Seq, Want};
pub use head::{Choice, ScreenStats};
use head::{HeadScreen, ScreenScratch};
pub use persist::{SESSION_FILE_VERSION, SPAN_FILE_VERSION};

#[derive(Clone, Copy, Debug)]
struct MatSpec {
    fmt: Float,
    loc: Loc,
    rows: usize,
    cols: usize,
    /// Index into [`Model::q8`] when the matrix runs from an 8-bit copy.
    q8: Option<usize>,
    /// Index into [`Model::copies`] when the matrix runs from a copy on huge pages.
    copy: Option<usize>,
}

/// An owned row-scaled 8-bit copy of a dense matrix ([`Mat::Q8`]).
#[derive(Debug)]
struct Q8Mat {
    q: HugeBuf,
    scales: Vec<f32>,
}

impl Q8Mat {
    /// Quantizes `w` row by row: scale = max |w| / 127, q = round(w / scale). Also gives,
    /// per row, `[max |w|, max |w - scale·q|]` (in f64, where both are exact).
    fn quantize(w: &Mat<'_>) -> Result<(Self, Vec<[f64; 2]>)> {
        use rayon::prelude::*;
        let (rows, cols) = (w.rows(), w.cols());
        let mut q = huge_buf(rows * cols, "an 8-bit copy of a matrix")?;
        let mut scales = vec![0f32; rows];
        let mut err = vec![[0f64; 2]; rows];
        q.par_chunks_mut(cols.max(1))
            .zip(scales.par_iter_mut())
            .zip(err.par_iter_mut())
            .enumerate()
            .for_each_init(
                || vec![0f32; cols],
                |row, (r, ((qr, s), e))| {
                    w.row_into(r, row);
                    let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    *s = max / 127.0;
                    let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
                    let mut worst = 0f64;
                    for (b, v) in qr.iter_mut().zip(row.iter()) {
                        let k = (v * inv).round().clamp(-127.0, 127.0) as i8;
                        *b = k as u8;
                        let d = (*v as f64 - *s as f64 * k as f64).abs();
                        // A NaN (from a NaN or infinite weight) sticks: that row's bound is
                        // then unusable (`f64::max` would drop it).
                        worst = if d.is_nan() || worst.is_nan() {
                            f64::NAN
                        } else {
                            worst.max(d)
                        };
                    }
                    *e = [max as f64, worst];
                },
            );
        Ok((Self { q, scales }, err))
    }
}

/// [`HugeBuf::zeroed`], its failure named as for `what`.
fn huge_buf(bytes: usize, what: &str) -> Result<HugeBuf> {
    HugeBuf::zeroed(bytes).map_err(|source| Error::Memory {
        what: what.into(),
        source,
    })
}

#[derive(Clone, Copy, Debug)]
struct VecSpec {
    fmt: Float,
    loc: Loc,
}

#[derive(Debug)]
struct Attn {
    q: MatSpec,
    k: MatSpec,
    v: MatSpec,
    o: MatSpec,
    biases: Option<[VecSpec; 4]>,
    sinks: Option<VecSpec>,
    qk_norm: Option<[VecSpec; 2]>,
}

#[derive(Debug)]
enum Mlp {
    Moe {
        router: MatSpec,
        router_bias: Option<VecSpec>,
    },
    Dense {
        gate: MatSpec,
        up: MatSpec,
        down: MatSpec,
    },
}

#[derive(Debug)]
struct Layer {
    input_norm: VecSpec,
    post_norm: VecSpec,
    attn: Attn,
    mlp: Mlp,
    /// Window length if this layer slides.
    window: Option<usize>,
}

/// Options for [`Model::load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Positions per prefill block (bounds activation memory; larger blocks reuse each
    /// expert across more positions).
    pub prefill_block: usize,
    /// Run the attention projections and the output head from row-scaled 8-bit copies made
    /// at load (half the bytes of bf16 per token). Approximate: an opt-in whose agreement with
    /// the exact path is measured, never the default.
    pub int8_attn_head: bool,
    /// Multiply MXFP4 experts by inputs rounded to int8 in blocks of 32 (products summed in
    /// integers; fewer instructions per weight than the exact f32 path). Approximate: an
    /// opt-in whose agreement with the exact path is measured, never the default. Experts
    /// stored as floats are unaffected.
    pub int8_experts: bool,
    /// Keep an 8-bit copy of the output head to find greedy tokens ([`Model::forward_greedy`])
    /// and to draw sampled ones ([`Model::forward_sample`]) reading about half the head's
    /// bytes: the same tokens as the whole exact head, always (see the `head` module and
    /// [`Sampler::sample_screened`]). Costs the copy's memory (half the bytes of a bf16 head) and a
    /// pass over the head at load; the exact head's mapped pages are then released and read
    /// back only for the rows needed. Ignored with `int8_attn_head` (the head is then 8-bit
    /// anyway).
    pub screened_head: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            prefill_block: 128,
            int8_attn_head: false,
            int8_experts: false,
            screened_head: false,
        }
    }
}

/// A model folder, opened and checked: its config, the mapped checkpoint (or the dense part of
/// a converted store), and where every expert lies. The first stage of loading; the caller then
/// chooses where experts come from and builds the [`Model`].
#[derive(Debug)]
pub struct ModelFiles {
    /// The folder.
    pub dir: PathBuf,
    /// Its configuration.
    pub cfg: ModelConfig,
    /// The mapped safetensors files (dense tensors, and experts unless a store).
    pub ckpt: Arc<Checkpoint>,
    /// Where every expert lies.
    pub layout: Arc<ExpertLayout>,
}

impl ModelFiles {
    /// Opens `dir`: a checkpoint as published, or a store written by `stormo convert`.
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ckpt = Arc::new(Checkpoint::open(dir)?);
        let layout = if tiers::store::is_store(dir) {
            tiers::store::open(dir, &cfg)?
        } else {
            ExpertLayout::from_checkpoint(&ckpt, &cfg)?
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            cfg,
            ckpt,
            layout: Arc::new(layout),
        })
    }

    /// Whether the experts live in a converted flat store.
    pub fn is_store(&self) -> bool {
        tiers::store::is_store(&self.dir)
    }

    /// An error when the folder holds the dense tensors only (its expert tensors are
    /// [`absent`](Checkpoint::absent)): no expert can be read from it.
    pub fn check_holds_experts(&self) -> Result<()> {
        match self.ckpt.absent.keys().next() {
            None => Ok(()),
            Some(t) => Err(Error::config(
                self.dir.join(crate::safetensors::dense::INDEX),
                format!(
                    "this folder holds the dense tensors only (pulled without its experts; \
                     {t} and {} other expert tensors are not here): take experts from peers \
                     (--peer or --discover) or pull them (`stormo pull --with-experts`)",
                    self.ckpt.absent.len() - 1
                ),
            )),
        }
    }

    /// A provider that serves every expert from memory-mapped files.
    pub fn mapped_experts(&self) -> Result<MappedExperts> {
        self.check_holds_experts()?;
        let maps: Vec<Arc<MappedFile>> = if self.is_store() {
            self.layout
                .files
                .iter()
                .map(|(p, len)| map_file(p, *len))
                .collect::<Result<_>>()?
        } else {
            self.ckpt.files.clone()
        };
        let experts = self
            .layout
            .parts
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .map(|parts| {
                        Arc::new(ExpertData::new(
                            parts
                                .iter()
                                .map(|p| {
                                    let s = p.loc.offset as usize;
                                    PartBytes::Mapped(
                                        maps[p.loc.file].clone(),
                                        s..s + p.loc.len as usize,
                                    )
                                })
                                .collect(),
                        ))
                    })
                    .collect()
            })
            .collect();
        Ok(MappedExperts::new(experts))
    }

    /// A disk tier reading experts with positioned reads on `threads` I/O threads (O_DIRECT for
    /// a store where the filesystem allows it); `allowed[layer][expert]` limits what it holds.
    pub fn disk_tier(&self, threads: usize, allowed: Option<Vec<Vec<bool>>>) -> Result<DiskTier> {
        self.check_holds_experts()?;
        let direct = self.is_store();
        let files = self
            .layout
            .files
            .iter()
            .map(|(p, len)| DiskFile::open(p.clone(), *len, direct))
            .collect::<Result<_>>()?;
        DiskTier::new(files, self.layout.clone(), threads, allowed)
            .map_err(|e| Error::Input(e.to_string()))
    }
}

fn map_file(path: &Path, len: u64) -> Result<Arc<MappedFile>> {
    let file = crate::safetensors::open_regular(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only mapping; see `safetensors::open_file`.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    if map.len() as u64 != len {
        return Err(Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "file is {} bytes, expected {len}: truncated or replaced",
                    map.len()
                ),
            ),
        ));
    }
    Ok(Arc::new(MappedFile::new(
        path.to_path_buf(),
        len,
        map,
        file,
    )))
}

/// A loaded model: configuration, mapped checkpoint, dense weights, and an expert provider.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    ckpt: Arc<Checkpoint>,
    layout: Arc<ExpertLayout>,
    embed: MatSpec,
    lm_head: MatSpec,
    final_norm: VecSpec,
    layers: Vec<Layer>,
    rope: Rope,
    experts: Arc<dyn ExpertProvider>,
    /// Runs chosen experts elsewhere ([`Model::with_executor`]); `None`: all computed here.
    executor: Option<Arc<dyn ExpertExecutor>>,
    prefill_block: usize,
    /// [`LoadOptions::int8_experts`].
    int8_experts: bool,
    /// 8-bit copies of matrices ([`LoadOptions::int8_attn_head`]).
    q8: Vec<Q8Mat>,
    /// [`LoadOptions::screened_head`].
    screen: Option<HeadScreen>,
    /// Copies of the dense matrices every token reads, on huge pages (see `copy_dense`).
    copies: Vec<HugeBuf>,
    /// Per checkpoint file, the end of its last tensor that is not an expert's: the bytes a
    /// step may read through the mapping besides experts (norms, biases, the head).
    dense_ends: Vec<usize>,
    /// [`Model::identity`], computed once when first asked for.
    identity: OnceLock<[u8; 32]>,
}

/// Receives intermediate values of a forward (for tests and diagnostics).
pub trait Observer {
    /// Hidden state `index` for the block (`[t, H]`): 0 is the embedding output, `i` the
    /// residual after layer `i-1`, and `num_layers` the final-normed output of the last layer.
    fn hidden(&mut self, _index: usize, _xs: &[f32]) {}
    /// Router logits `[t, E]` of `layer`.
    fn router(&mut self, _layer: usize, _logits: &[f32]) {}
}

/// What a block computes after its last layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Head {
    /// Logits for the block's last `n` positions.
    Rows(usize),
    /// The greedy choice for the last position ([`Model::forward_greedy`]).
    Greedy,
    /// Only the final norm of the last position, into `s.h` ([`Model::forward_sample`]).
    Normed,
}

/// Which logits a forward computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only for the block's last position (generation).
    Last,
    /// For every position of the block.
    All,
}

impl Model {
    /// Loads the model in `dir` with every expert served from memory-mapped files.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let files = ModelFiles::open(dir)?;
        let experts = Arc::new(files.mapped_experts()?);
        Self::new(files, experts, opts)
    }

    /// The executor of [`with_executor`](Self::with_executor), if any.
    pub fn executor(&self) -> Option<&Arc<dyn ExpertExecutor>> {
        self.executor.as_ref()
    }

    /// The same model with experts that `executor` chooses computed by it (a peer holding
    /// them); the others, failed calls and spot-checks are fetched from the provider and
    /// computed here (see [`moe::remote`]). The output is the same bits.
    pub fn with_executor(mut self, executor: Arc<dyn ExpertExecutor>) -> Self {
        self.executor = Some(executor);
        self
    }

    /// Loads the dense weights of `files` and takes experts from `experts`.
    pub fn new(
        files: ModelFiles,
        experts: Arc<dyn ExpertProvider>,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let ModelFiles {
            cfg, ckpt, layout, ..
        } = files;
        let ld = Loader::new(&ckpt, cfg.family);
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let mat = |name: &str, rows: usize, cols: usize| -> Result<MatSpec> {
            let (fmt, loc) = ld.float(name, &[rows, cols])?;
            Ok(MatSpec {
                fmt,
                loc,
                rows,
                cols,
                q8: None,
                copy: None,
            })
        };
        let vec = |name: &str, len: usize| -> Result<VecSpec> {
            let (fmt, loc) = ld.float(name, &[len])?;
            Ok(VecSpec { fmt, loc })
        };
        let embed = mat("model.embed_tokens.weight", v, h)?;
        let lm_head = if cfg.tie_word_embeddings && !ld.has("lm_head.weight") {
            embed
        } else {
            mat("lm_head.weight", v, h)?
        };
        let final_norm = vec("model.norm.weight", h)?;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}.");
            let a = format!("{p}self_attn.");
            let biases = if cfg.attention_bias {
                Some([
                    vec(&format!("{a}q_proj.bias"), qd)?,
                    vec(&format!("{a}k_proj.bias"), kvd)?,
                    vec(&format!("{a}v_proj.bias"), kvd)?,
                    vec(&format!("{a}o_proj.bias"), h)?,
                ])
            } else {
                None
            };
            let attn = Attn {
                q: mat(&format!("{a}q_proj.weight"), qd, h)?,
                k: mat(&format!("{a}k_proj.weight"), kvd, h)?,
                v: mat(&format!("{a}v_proj.weight"), kvd, h)?,
                o: mat(&format!("{a}o_proj.weight"), h, qd)?,
                biases,
                sinks: if cfg.attention_sinks {
                    Some(vec(&format!("{a}sinks"), cfg.num_heads)?)
                } else {
                    None
                },
                qk_norm: if cfg.qk_norm {
                    Some([
                        vec(&format!("{a}q_norm.weight"), cfg.head_dim)?,
                        vec(&format!("{a}k_norm.weight"), cfg.head_dim)?,
                    ])
                } else {
                    None
                },
            };
            let mlp = if cfg.layer_moe[l] {
                let router_name = match cfg.family {
                    Family::GptOss => "router",
                    Family::Qwen3Moe => "gate",
                };
                Mlp::Moe {
                    router: mat(&format!("{p}mlp.{router_name}.weight"), cfg.num_experts, h)?,
                    router_bias: if cfg.router_bias {
                        Some(vec(&format!("{p}mlp.{router_name}.bias"), cfg.num_experts)?)
                    } else {
                        None
                    },
                }
            } else {
                let i = cfg.dense_intermediate;
                Mlp::Dense {
                    gate: mat(&format!("{p}mlp.gate_proj.weight"), i, h)?,
                    up: mat(&format!("{p}mlp.up_proj.weight"), i, h)?,
                    down: mat(&format!("{p}mlp.down_proj.weight"), h, i)?,
                }
            };
            layers.push(Layer {
                input_norm: vec(&format!("{p}input_layernorm.weight"), h)?,
                post_norm: vec(&format!("{p}post_attention_layernorm.weight"), h)?,
                attn,
                mlp,
                window: if cfg.layer_sliding[l] {
                    cfg.sliding_window
                } else {
                    None
                },
            });
        }
        let unused = ld.unused(&layout.expert_tensor_names());
        if let Some(first) = unused.first() {
            tracing::warn!(
                "{} tensor(s) of the checkpoint are not used by its config.json (first: {first:?}); \
                 check num_hidden_layers, the expert counts and the model type",
                unused.len()
            );
        }
        let rope = Rope::new(&cfg.rope, cfg.head_dim);
        let expert_tensors = layout.expert_tensor_names();
        let mut dense_ends = vec![0; ckpt.files.len()];
        for (name, t) in &ckpt.tensors {
            if !expert_tensors.contains(name.as_str()) {
                let end = &mut dense_ends[t.file];
                *end = (*end).max((t.offset + t.len) as usize);
            }
        }
        let mut model = Self {
            cfg,
            ckpt,
            layout,
            embed,
            lm_head,
            final_norm,
            layers,
            rope,
            experts,
            executor: None,
            prefill_block: opts.prefill_block.max(1),
            int8_experts: opts.int8_experts,
            q8: Vec::new(),
            screen: None,
            copies: Vec::new(),
            dense_ends,
            identity: OnceLock::new(),
        };
        if opts.int8_attn_head {
            model.quantize_attn_head()?;
        } else if opts.screened_head {
            model.screen = Some(HeadScreen::build(&model.dense(&model.lm_head))?);
            model.release(model.lm_head.loc);
        }
        model.copy_dense()?;
        model.check_mapped()?;
        Ok(model)
    }

    /// Whether the dense bytes a step may read through the checkpoint's mapping still are
    /// the files' ([`MappedFile::check`]): a file truncated under the model, which gave a
    /// step zeros in place of a fault, fails that step with the file's name. One `fstat` per
    /// file. (Experts are checked by the MoE, before and after they are computed.)
    fn check_mapped(&self) -> Result<()> {
        for (f, &end) in self.ckpt.files.iter().zip(&self.dense_ends) {
            if end > 0 {
                f.check(end)?;
            }
        }
        Ok(())
    }

    /// Reads every dense matrix a token multiplies in full (the attention projections that
    /// have no 8-bit copy, the routers, dense MLPs) into memory on huge pages, with
    /// positioned reads, and runs them from there: every token streams these bytes, and a
    /// stream through the checkpoint's mapping crosses a 4 KiB page (a TLB miss and a
    /// restarted hardware prefetcher) every 4 KiB (see [`crate::huge`]). The resident set is
    /// the same as running from the mapping once every page has been touched, since the
    /// mapping is then never touched. The embedding and the output head are not copied: a
    /// token reads a few of their rows.
    fn copy_dense(&mut self) -> Result<()> {
        let mut specs: Vec<&mut MatSpec> = Vec::new();
        for l in &mut self.layers {
            let a = &mut l.attn;
            specs.extend([&mut a.q, &mut a.k, &mut a.v, &mut a.o]);
            match &mut l.mlp {
                Mlp::Moe { router, .. } => specs.push(router),
                Mlp::Dense { gate, up, down } => specs.extend([gate, up, down]),
            }
        }
        for m in specs.into_iter().filter(|m| m.q8.is_none()) {
            let file = &self.ckpt.files[m.loc.file];
            let mut buf = huge_buf(m.loc.len as usize, "a copy of a dense matrix")?;
            file.read_exact_at(&mut buf, m.loc.offset)?;
            m.copy = Some(self.copies.len());
            self.copies.push(buf);
        }
        Ok(())
    }

    /// Makes the 8-bit copies of every attention projection and of the output head (the
    /// embedding lookup keeps the exact rows, even when the head is tied to it).
    fn quantize_attn_head(&mut self) -> Result<()> {
        fn push(m: &mut MatSpec, specs: &mut Vec<MatSpec>) {
            m.q8 = Some(specs.len());
            specs.push(*m);
        }
        let mut specs: Vec<MatSpec> = Vec::new();
        push(&mut self.lm_head, &mut specs);
        for l in &mut self.layers {
            let a = &mut l.attn;
            for m in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                push(m, &mut specs);
            }
        }
        let q8: Vec<Q8Mat> = specs
            .iter()
            .map(|m| {
                let (q, _) = Q8Mat::quantize(&self.dense(m))?;
                self.release(m.loc);
                Ok(q)
            })
            .collect::<Result<_>>()?;
        self.q8 = q8;
        Ok(())
    }

    /// Tells the OS that the mapped pages wholly inside `loc` are not needed now (they are
    /// read back from the file if ever touched again), so tensors that run from 8-bit copies
    /// stop counting in the resident set.
    fn release(&self, loc: Loc) {
        const PAGE: u64 = 4096;
        let map = &self.ckpt.files[loc.file].map;
        let start = loc.offset.next_multiple_of(PAGE);
        let end = (loc.offset + loc.len) / PAGE * PAGE;
        if end > start {
            // Advice only: a failure leaves the pages resident, which costs memory, not
            // correctness.
            // SAFETY: the map is a read-only file mapping, so dropping its pages loses nothing:
            // a later access reads the same bytes from the file again.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start as usize,
                    (end - start) as usize,
                )
            };
        }
    }

    /// Bytes of the 8-bit copies held in RAM ([`LoadOptions::int8_attn_head`],
    /// [`LoadOptions::screened_head`]).
    pub fn int8_bytes(&self) -> u64 {
        let q8: u64 = self
            .q8
            .iter()
            .map(|m| (m.q.len() + 4 * m.scales.len()) as u64)
            .sum();
        q8 + self.screen.as_ref().map_or(0, HeadScreen::bytes)
    }

    /// Whether greedy tokens are found through an 8-bit screen of the head
    /// ([`LoadOptions::screened_head`]).
    pub fn has_screened_head(&self) -> bool {
        self.screen.is_some()
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The mapped checkpoint.
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.ckpt
    }

    /// Where every expert lies.
    pub fn expert_layout(&self) -> &Arc<ExpertLayout> {
        &self.layout
    }

    fn bytes(&self, loc: Loc) -> &[u8] {
        let f = &self.ckpt.files[loc.file];
        &f.map[loc.offset as usize..(loc.offset + loc.len) as usize]
    }

    fn mat(&self, m: &MatSpec) -> Mat<'_> {
        match m.q8 {
            Some(i) => Mat::Q8 {
                q: &self.q8[i].q,
                scales: &self.q8[i].scales,
                rows: m.rows,
                cols: m.cols,
            },
            None => self.dense(m),
        }
    }

    /// Rows `rows` (in any order) of the stored row-major matrix `m`, one after another into
    /// `bytes`, read from the file with positioned reads (runs of consecutive rows in one).
    ///
    /// For a few rows of a large matrix (an embedding lookup, the screened head's candidates)
    /// this keeps the resident set small where touching the mapping would not: a fault on
    /// one mapped byte maps the whole page-cache folio around it (up to 2 MiB on Linux 6.18,
    /// about 680 KiB per touch on average measured on a freshly written checkpoint), so a
    /// hundred head rows a token soon map in the whole 1.16 GB head at gpt-oss-20b geometry.
    fn read_rows(&self, m: &MatSpec, rows: &[usize], bytes: &mut [u8]) -> Result<()> {
        let row = m.cols * m.fmt.size();
        let file = &self.ckpt.files[m.loc.file];
        assert_eq!(bytes.len(), rows.len() * row, "read_rows output length");
        let mut i = 0;
        while i < rows.len() {
            let first = rows[i];
            let mut n = 1;
            while i + n < rows.len() && rows[i + n] == first + n {
                n += 1;
            }
            if first + n > m.rows {
                return Err(Error::Input(format!(
                    "row {} of a {}-row matrix",
                    first + n - 1,
                    m.rows
                )));
            }
            let at = m.loc.offset + (first * row) as u64;
            file.read_exact_at(&mut bytes[i * row..(i + n) * row], at)?;
            i += n;
        }
        Ok(())
    }

    /// The matrix as stored in the checkpoint (from its copy if it has one).
    fn dense(&self, m: &MatSpec) -> Mat<'_> {
        Mat::Dense {
            fmt: m.fmt,
            bytes: match m.copy {
                Some(i) => &self.copies[i],
                None => self.bytes(m.loc),
            },
            rows: m.rows,
            cols: m.cols,
        }
    }

    fn vector(&self, v: &VecSpec) -> Vector<'_> {
        Vector {
            fmt: v.fmt,
            bytes: self.bytes(v.loc),
        }
    }

    /// A new session able to hold `max_context` positions.
    pub fn session(&self, max_context: usize) -> Result<Session> {
        self.session_with_rewind(max_context, 0)
    }

    /// A new session whose sliding layers keep `rewind` positions more than their window
    /// needs, so that [`Session::truncate`] can go back that far without a recompute (a chat
    /// that re-renders its last reply). `rewind >= max_context` keeps everything.
    pub fn session_with_rewind(&self, max_context: usize, rewind: usize) -> Result<Session> {
        if max_context == 0 || max_context > self.cfg.max_position_embeddings {
            return Err(Error::Input(format!(
                "context of {max_context} positions is outside 1..={} (max_position_embeddings)",
                self.cfg.max_position_embeddings
            )));
        }
        let block = self.prefill_block.min(max_context);
        let kvd = self.cfg.kv_dim();
        let kv = self
            .layers
            .iter()
            .map(|l| {
                let cap = match l.window {
                    Some(w) => (w + block).saturating_add(rewind).min(max_context),
                    None => max_context,
                };
                LayerKv {
                    cap,
                    k: vec![0.0; cap * kvd],
                    v: vec![0.0; cap * kvd],
                }
            })
            .collect();
        let s = Scratch {
            scores: vec![0.0; self.cfg.num_heads * max_context],
            ..Scratch::default()
        };
        Ok(Session {
            pos: 0,
            max_context,
            block,
            kv,
            s,
            logits: Vec::new(),
            stop: None,
        })
    }

    /// Checks that `tokens` can be appended to `sess`.
    pub fn check_input(&self, sess: &Session, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is out of range: the vocabulary has {} ids (0..={})",
                self.cfg.vocab_size,
                self.cfg.vocab_size - 1
            )));
        }
        if sess.pos.saturating_add(tokens.len()) > sess.max_context {
            return Err(Error::Input(format!(
                "{} positions already used + {} new tokens exceed the context of {}",
                sess.pos,
                tokens.len(),
                sess.max_context
            )));
        }
        Ok(())
    }

    /// Runs `tokens` through the model at the session's next positions, in blocks. Returns
    /// the logits: `[vocab]` for the last token, or `[tokens, vocab]` with [`Logits::All`].
    pub fn forward<'s>(
        &self,
        sess: &'s mut Session,
        tokens: &[u32],
        which: Logits,
        obs: Option<&mut dyn Observer>,
    ) -> Result<&'s [f32]> {
        self.check_input(sess, tokens)?;
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        let v = self.cfg.vocab_size;
        sess.logits.clear();
        let block = sess.block;
        let run = |sess: &mut Session, mut obs: Option<&mut dyn Observer>| {
            let mut last = Vec::new();
            for chunk in tokens.chunks(block) {
                let is_last = chunk.as_ptr_range().end == tokens.as_ptr_range().end;
                let rows = match which {
                    Logits::All => chunk.len(),
                    Logits::Last if is_last => 1,
                    Logits::Last => 0,
                };
                self.forward_block(sess, chunk, Head::Rows(rows), obs.as_deref_mut())?;
                if which == Logits::All {
                    last.extend_from_slice(&sess.s.logits[..rows * v]);
                }
            }
            Ok::<_, Error>(last)
        };
        let last = run(sess, obs)?;
        if which == Logits::All {
            sess.logits = last;
        } else {
            std::mem::swap(&mut sess.logits, &mut sess.s.logits);
            sess.logits.truncate(v);
            // keep the scratch buffer's capacity for the next call
            sess.s.logits.clear();
        }
        Ok(&sess.logits)
    }

    /// Runs `tokens` as [`forward`](Self::forward) does and returns the greedy choice for
    /// the last one: always the token (and logit) the exact head's
    /// [`argmax`](crate::generate::argmax) gives, found through the 8-bit screen when the
    /// model has one ([`LoadOptions::screened_head`]; [`Session::screen_stats`] counts how).
    pub fn forward_greedy(
        &self,
        sess: &mut Session,
        tokens: &[u32],
        obs: Option<&mut dyn Observer>,
    ) -> Result<Choice> {
        self.check_input(sess, tokens)?;
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        let run = |sess: &mut Session, mut obs: Option<&mut dyn Observer>| {
            let mut choice = None;
            for chunk in tokens.chunks(sess.block) {
                let is_last = chunk.as_ptr_range().end == tokens.as_ptr_range().end;
                let head = if is_last { Head::Greedy } else { Head::Rows(0) };
                choice = self.forward_block(sess, chunk, head, obs.as_deref_mut())?;
            }
            Ok(choice.expect("the last block chooses"))
        };
        run(sess, obs)
    }

    /// Runs `tokens` as [`forward`](Self::forward) does and returns the token `sampler` draws
    /// for the last one (`history`: the tokens its repetition penalty applies to): always the
    /// token [`Sampler::sample`] draws from the exact head's logits, drawn through the 8-bit
    /// screen when the model has one ([`LoadOptions::screened_head`]) and it can prove the
    /// draw ([`Sampler::sample_screened`]), else from the whole head
    /// ([`Session::screen_stats`] counts how). Leaves [`Session::logits`] as they were.
    pub fn forward_sample(
        &self,
        sess: &mut Session,
        tokens: &[u32],
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        self.check_input(sess, tokens)?;
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        for chunk in tokens.chunks(sess.block) {
            let is_last = chunk.as_ptr_range().end == tokens.as_ptr_range().end;
            let head = if is_last { Head::Normed } else { Head::Rows(0) };
            self.forward_block(sess, chunk, head, None)?;
        }
        let _span = profile::span(Phase::Head);
        let s = &mut sess.s;
        let (h, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        // The last block's length: its last position's normed state is in `s.h`.
        let t = (tokens.len() - 1) % sess.block + 1;
        let x = &s.h[(t - 1) * h..t * h];
        let head_mat = self.mat(&self.lm_head);
        if let Some(screen) = &self.screen {
            let read =
                |rows: &[usize], bytes: &mut [u8]| self.read_rows(&self.lm_head, rows, bytes);
            let got = screen.sample(
                &head_mat,
                x,
                sampler,
                history,
                &mut s.screen,
                &mut s.screen_stats,
                Some(&read),
            )?;
            if let Some(tok) = got {
                self.check_mapped()?;
                return Ok(tok);
            }
        }
        s.screen_stats.full += 1;
        s.logits.resize(v, 0.0);
        matmul(&head_mat, x, &mut s.logits[..v]);
        self.check_mapped()?;
        sampler
            .sample(&s.logits[..v], history)
            .map_err(|e| Error::Input(e.to_string()))
    }

    /// One block of `t` positions: the embedding, each layer's [attention](Self::attention)
    /// and [MLP](Self::mlp) steps, then the [head](Self::head). Computes the `head` work for
    /// its last positions: logits into `sess.s.logits`, or the greedy choice (returned).
    fn forward_block<'o>(
        &self,
        sess: &mut Session,
        tokens: &[u32],
        head: Head,
        mut obs: Option<&mut (dyn Observer + 'o)>,
    ) -> Result<Option<Choice>> {
        let cfg = &self.cfg;
        let (t, h) = (tokens.len(), cfg.hidden_size);
        let p0 = sess.pos;
        let s = &mut sess.s;
        s.ensure(t, cfg);
        // The exact rows as stored (the embedding never runs from an 8-bit copy), read rather
        // than touched through the mapping: see `read_rows`.
        let embed_span = profile::span(Phase::Head);
        s.embed_row.resize(h * self.embed.fmt.size(), 0);
        for (i, &tok) in tokens.iter().enumerate() {
            self.read_rows(&self.embed, &[tok as usize], &mut s.embed_row)?;
            (self.embed.fmt).widen_into(&s.embed_row, &mut s.x[i * h..(i + 1) * h]);
        }
        drop(embed_span);
        if let Some(o) = obs.as_deref_mut() {
            o.hidden(0, &s.x[..t * h]);
        }
        // The attention's scores buffer is the session's own; taken out of its scratch for
        // the block (a move, no allocation) and put back whatever happens.
        let mut scores = std::mem::take(&mut s.scores);
        let stop = sess.stop.clone();
        let layers = (|| {
            for (l, layer) in self.layers.iter().enumerate() {
                // Between layers: nothing of the block is committed yet (the position moves
                // only after the last layer), so a stop leaves the session where the block began.
                if stop.as_ref().is_some_and(|f| f.load(Ordering::Relaxed)) {
                    return Err(Error::Stopped);
                }
                let mut seq = [SeqRows {
                    kv: &mut sess.kv[l],
                    scores: &mut scores,
                    p0,
                    row: 0,
                    t,
                }];
                self.attention(layer, s, t, &mut seq);
                self.mlp(l, layer, s, t, obs.as_deref_mut())?;
                if self.experts.wants_hints() {
                    self.predict_next(l, t, s);
                }
                if l + 1 < cfg.num_layers {
                    if let Some(o) = obs.as_deref_mut() {
                        o.hidden(l + 1, &s.x[..t * h]);
                    }
                }
            }
            Ok::<_, Error>(())
        })();
        s.scores = scores;
        layers?;
        self.check_mapped()?;
        sess.pos += t;
        let choice = self.head(s, t, head, obs)?;
        self.check_mapped()?;
        Ok(choice)
    }

    /// One layer's attention step on the block's `t` rows, which are the positions of one or
    /// more sequences (`seqs`, each with its rows, first position and cache): norm, q/k/v
    /// projections over all rows (biases, QK-norm), RoPE at each row's position, the keys and
    /// values into each sequence's cache, attention of each sequence over its own cache, the
    /// output projection over all rows, added to the residual `s.x`. Every step is computed
    /// per row (or per sequence), so a row's result does not depend on the other rows.
    fn attention(&self, layer: &Layer, s: &mut Scratch, t: usize, seqs: &mut [SeqRows<'_>]) {
        let mut span = profile::span(Phase::Qkv);
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let eps = cfg.rms_norm_eps;
        let w = self.vector(&layer.input_norm);
        for i in 0..t {
            ops::rms_norm(
                &s.x[i * h..(i + 1) * h],
                &w,
                eps,
                &mut s.h[i * h..(i + 1) * h],
            );
        }
        let a = &layer.attn;
        let hs = &s.h[..t * h];
        // One parallel region for the three projections: a decoded token's k and v are
        // small, and alone each would pay the pool's hand-off (about 2% faster decode at
        // gpt-oss-20b geometry, paired per token on Zen 4).
        matmul_batch([
            Product {
                w: self.mat(&a.q),
                xs: hs,
                ys: &mut s.q[..t * qd],
            },
            Product {
                w: self.mat(&a.k),
                xs: hs,
                ys: &mut s.k[..t * kvd],
            },
            Product {
                w: self.mat(&a.v),
                xs: hs,
                ys: &mut s.v[..t * kvd],
            },
        ]);
        if let Some([bq, bk, bv, _]) = &a.biases {
            add_bias_rows(&self.vector(bq), &mut s.q[..t * qd]);
            add_bias_rows(&self.vector(bk), &mut s.k[..t * kvd]);
            add_bias_rows(&self.vector(bv), &mut s.v[..t * kvd]);
        }
        if let Some([qn, kn]) = &a.qk_norm {
            ops::rms_norm_heads(&mut s.q[..t * qd], hd, &self.vector(qn), eps);
            ops::rms_norm_heads(&mut s.k[..t * kvd], hd, &self.vector(kn), eps);
        }
        span.next(Phase::Attend);
        let sinks = a.sinks.as_ref().map(|v| self.vector(v));
        for seq in seqs.iter_mut() {
            let SeqRows {
                ref mut kv,
                p0,
                row,
                t,
                ..
            } = *seq;
            for i in row..row + t {
                self.rope.cos_sin(p0 + i - row, &mut s.cos, &mut s.sin);
                Rope::apply(&mut s.q[i * qd..(i + 1) * qd], hd, &s.cos, &s.sin);
                Rope::apply(&mut s.k[i * kvd..(i + 1) * kvd], hd, &s.cos, &s.sin);
            }
            for i in row..row + t {
                let slot = (p0 + i - row) % kv.cap;
                kv.k[slot * kvd..(slot + 1) * kvd].copy_from_slice(&s.k[i * kvd..(i + 1) * kvd]);
                kv.v[slot * kvd..(slot + 1) * kvd].copy_from_slice(&s.v[i * kvd..(i + 1) * kvd]);
            }
        }
        // Every sequence's heads in one parallel region (a decoded token's heads alone are
        // too few to split); each sequence's heads `[heads, t, head_dim]` land in its rows'
        // share of `s.heads` (the sequences' rows are consecutive, in order).
        let q = &s.q;
        let (window, heads, kv_heads) = (layer.window, cfg.num_heads, cfg.num_kv_heads);
        fn attend<'a>(
            kv: &'a LayerKv,
            q: &'a [f32],
            sinks: Option<Vector<'a>>,
            (window, p0, t): (Option<usize>, usize, usize),
            (heads, kv_heads, head_dim): (usize, usize, usize),
        ) -> crate::attention::Attend<'a> {
            crate::attention::Attend {
                k: &kv.k,
                v: &kv.v,
                cap: kv.cap,
                q,
                sinks,
                window,
                p0,
                t,
                heads,
                kv_heads,
                head_dim,
            }
        }
        let shape = (heads, kv_heads, hd);
        if let [one] = seqs {
            // One sequence (`forward`'s decode and prefill): no lists, so a decoded token
            // allocates nothing.
            let (row, t) = (one.row, one.t);
            let qs = &q[row * qd..(row + t) * qd];
            attend(one.kv, qs, sinks, (window, one.p0, t), shape)
                .run(&mut s.heads[row * qd..(row + t) * qd], one.scores);
        } else {
            let (mut outs, mut scores) = (Vec::with_capacity(seqs.len()), Vec::new());
            let mut rest = &mut s.heads[..t * qd];
            let mut blocks = Vec::with_capacity(seqs.len());
            for seq in seqs.iter_mut() {
                let (mine, after) = std::mem::take(&mut rest).split_at_mut(seq.t * qd);
                rest = after;
                outs.push(mine);
                let qs = &q[seq.row * qd..(seq.row + seq.t) * qd];
                blocks.push(attend(seq.kv, qs, sinks, (window, seq.p0, seq.t), shape));
                scores.push(&mut *seq.scores);
            }
            crate::attention::Attend::run_all(&blocks, &mut outs, &mut scores);
        }
        for seq in seqs.iter() {
            let (row, t) = (seq.row, seq.t);
            let heads = &s.heads[row * qd..(row + t) * qd];
            for i in 0..t {
                for head in 0..cfg.num_heads {
                    let src = &heads[(head * t + i) * hd..(head * t + i + 1) * hd];
                    s.att[(row + i) * qd + head * hd..(row + i) * qd + (head + 1) * hd]
                        .copy_from_slice(src);
                }
            }
        }
        span.next(Phase::OProj);
        matmul(&self.mat(&a.o), &s.att[..t * qd], &mut s.o[..t * h]);
        if let Some([_, _, _, bo]) = &a.biases {
            add_bias_rows(&self.vector(bo), &mut s.o[..t * h]);
        }
        for (x, o) in s.x[..t * h].iter_mut().zip(&s.o[..t * h]) {
            *x += o;
        }
    }

    /// Layer `l`'s MLP step on the block's `t` positions: norm, then the routed experts (MoE
    /// layers: router, plan, `moe_block`; the router logits go to `obs`) or the dense MLP,
    /// added to the residual `s.x`.
    fn mlp<'o>(
        &self,
        l: usize,
        layer: &Layer,
        s: &mut Scratch,
        t: usize,
        obs: Option<&mut (dyn Observer + 'o)>,
    ) -> Result<()> {
        let mut span = profile::span(Phase::Router);
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let w = self.vector(&layer.post_norm);
        for i in 0..t {
            ops::rms_norm(
                &s.x[i * h..(i + 1) * h],
                &w,
                cfg.rms_norm_eps,
                &mut s.h[i * h..(i + 1) * h],
            );
        }
        s.o[..t * h].fill(0.0);
        match &layer.mlp {
            Mlp::Moe {
                router,
                router_bias,
            } => {
                let e = cfg.num_experts;
                let m = &mut s.moe;
                m.logits.resize(t * e, 0.0);
                matmul(&self.mat(router), &s.h[..t * h], &mut m.logits);
                if let Some(b) = router_bias {
                    add_bias_rows(&self.vector(b), &mut m.logits);
                }
                if let Some(o) = obs {
                    o.router(l, &m.logits);
                }
                let logits = std::mem::take(&mut m.logits);
                m.plan
                    .route(&logits, e, cfg.top_k, cfg.routing, &mut s.probs);
                m.logits = logits;
                if s.predicted_for == Some(l) {
                    // share of this block's (position, expert) choices that were predicted
                    for &x in &m.plan.experts {
                        s.pred_total += 1;
                        s.pred_hits += s.pred_set.get(x).copied().unwrap_or(false) as u64;
                    }
                    s.predicted_for = None;
                }
                let schema = self.layout.schemas[l]
                    .as_ref()
                    .expect("MoE layer has an expert schema");
                span.next(Phase::Experts);
                moe::moe_block(
                    l,
                    schema,
                    &*self.experts,
                    self.executor.as_deref(),
                    e,
                    &s.h[..t * h],
                    &mut s.o[..t * h],
                    self.int8_experts,
                    m,
                )?;
            }
            Mlp::Dense { gate, up, down } => {
                span.next(Phase::Experts);
                let view = moe::ExpertView {
                    gate_up: None,
                    gate: Some(self.mat(gate)),
                    up: Some(self.mat(up)),
                    down: Some(self.mat(down)),
                    gate_up_bias: None,
                    down_bias: None,
                    activation: cfg.activation,
                };
                moe::expert_forward(
                    &view,
                    &s.h[..t * h],
                    h,
                    cfg.dense_intermediate,
                    &mut s.dense,
                );
                s.o[..t * h].copy_from_slice(s.dense.output());
            }
        }
        for (x, o) in s.x[..t * h].iter_mut().zip(&s.o[..t * h]) {
            *x += o;
        }
        Ok(())
    }

    /// The head on the block's last positions: final norm (of every position when `obs`
    /// wants the hidden states), then logits into `s.logits` or the greedy choice.
    fn head<'o>(
        &self,
        s: &mut Scratch,
        t: usize,
        head: Head,
        obs: Option<&mut (dyn Observer + 'o)>,
    ) -> Result<Option<Choice>> {
        let _span = profile::span(Phase::Head);
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let w = self.vector(&self.final_norm);
        let need_all_norm = obs.is_some();
        let normed = match head {
            Head::Rows(n) => n,
            Head::Greedy | Head::Normed => 1,
        };
        let first = if need_all_norm { 0 } else { t - normed };
        for i in first..t {
            ops::rms_norm(
                &s.x[i * h..(i + 1) * h],
                &w,
                cfg.rms_norm_eps,
                &mut s.h[i * h..(i + 1) * h],
            );
        }
        if let Some(o) = obs {
            o.hidden(cfg.num_layers, &s.h[..t * h]);
        }
        let v = cfg.vocab_size;
        let head_mat = self.mat(&self.lm_head);
        let logit_rows = match head {
            Head::Rows(n) => n,
            Head::Normed => 0,
            Head::Greedy => {
                let x = &s.h[(t - 1) * h..t * h];
                let read =
                    |rows: &[usize], bytes: &mut [u8]| self.read_rows(&self.lm_head, rows, bytes);
                let screened = match &self.screen {
                    Some(sc) => sc.choose(
                        &head_mat,
                        x,
                        &mut s.screen,
                        &mut s.screen_stats,
                        Some(&read),
                    )?,
                    None => None,
                };
                if let Some(c) = screened {
                    return Ok(Some(c));
                }
                s.screen_stats.full += 1;
                1
            }
        };
        s.logits.resize(logit_rows * v, 0.0);
        if logit_rows > 0 {
            matmul(
                &head_mat,
                &s.h[(t - logit_rows) * h..t * h],
                &mut s.logits[..logit_rows * v],
            );
        }
        Ok(match head {
            Head::Greedy => Some(Choice::of(&s.logits[..v])),
            Head::Rows(_) | Head::Normed => None,
        })
    }
}

impl Model {
    /// Predicts the experts of layer `l + 1` from the residual after layer `l`, through layer
    /// `l + 1`'s norm and router, and hints them to the provider so they load while layer
    /// `l + 1`'s attention runs. Never changes the output: the real routing happens as usual.
    fn predict_next(&self, l: usize, t: usize, s: &mut Scratch) {
        let Some(next) = self.layers.get(l + 1) else {
            return;
        };
        let Mlp::Moe {
            router,
            router_bias,
        } = &next.mlp
        else {
            return;
        };
        let (h, e, k) = (self.cfg.hidden_size, self.cfg.num_experts, self.cfg.top_k);
        let w = self.vector(&next.post_norm);
        for i in 0..t {
            ops::rms_norm(
                &s.x[i * h..(i + 1) * h],
                &w,
                self.cfg.rms_norm_eps,
                &mut s.h[i * h..(i + 1) * h],
            );
        }
        s.pred_logits.resize(t * e, 0.0);
        matmul(&self.mat(router), &s.h[..t * h], &mut s.pred_logits);
        if let Some(b) = router_bias {
            add_bias_rows(&self.vector(b), &mut s.pred_logits);
        }
        s.pred
            .route(&s.pred_logits, e, k, self.cfg.routing, &mut s.probs);
        s.pred_set.clear();
        s.pred_set.resize(e, false);
        for &x in &s.pred.experts {
            s.pred_set[x] = true;
        }
        s.pred_union.clear();
        s.pred_union.extend((0..e).filter(|&x| s.pred_set[x]));
        self.experts.hint(l + 1, &s.pred_union);
        s.predicted_for = Some(l + 1);
    }
}

fn add_bias_rows(b: &Vector<'_>, xs: &mut [f32]) {
    for row in xs.chunks_exact_mut(b.len()) {
        b.add_to(row);
    }
}

/// One sequence's share of a block in [`Model::attention`]: rows `row .. row + t` of the
/// block are its positions `p0 .. p0 + t`, attending over its layer cache `kv` with `scores`
/// as scratch.
struct SeqRows<'a> {
    kv: &'a mut LayerKv,
    scores: &'a mut [f32],
    p0: usize,
    row: usize,
    t: usize,
}

#[derive(Debug)]
struct LayerKv {
    cap: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Buffers reused across blocks so decoding allocates nothing per token.
#[derive(Debug, Default)]
struct Scratch {
    t: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    heads: Vec<f32>,
    o: Vec<f32>,
    scores: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    probs: Vec<f32>,
    moe: MoeScratch,
    dense: moe::ExpertScratch,
    logits: Vec<f32>,
    pred: moe::RoutePlan,
    pred_logits: Vec<f32>,
    pred_set: Vec<bool>,
    pred_union: Vec<usize>,
    predicted_for: Option<usize>,
    pred_hits: u64,
    pred_total: u64,
    screen: ScreenScratch,
    screen_stats: ScreenStats,
    /// One embedding row as stored, read from the file ([`Model::read_rows`]).
    embed_row: Vec<u8>,
}

impl Scratch {
    fn ensure(&mut self, t: usize, cfg: &ModelConfig) {
        if self.t >= t && !self.x.is_empty() {
            return;
        }
        let (h, qd, kvd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        self.t = t;
        self.x.resize(t * h, 0.0);
        self.h.resize(t * h, 0.0);
        self.q.resize(t * qd, 0.0);
        self.k.resize(t * kvd, 0.0);
        self.v.resize(t * kvd, 0.0);
        self.att.resize(t * qd, 0.0);
        self.heads.resize(t * qd, 0.0);
        self.o.resize(t * h, 0.0);
        self.cos.resize(cfg.head_dim / 2, 0.0);
        self.sin.resize(cfg.head_dim / 2, 0.0);
    }
}

/// A conversation's state: the KV cache and the position reached. It can be saved to a file
/// and loaded back by another process ([`Session::save_to`], [`Session::load_from`]).
#[derive(Debug)]
pub struct Session {
    pos: usize,
    max_context: usize,
    block: usize,
    kv: Vec<LayerKv>,
    s: Scratch,
    logits: Vec<f32>,
    /// [`Session::set_stop`].
    stop: Option<Arc<AtomicBool>>,
}

impl Session {
    /// Positions already in the cache.
    pub fn position(&self) -> usize {
        self.pos
    }
    /// Of the (position, expert) choices made in layers whose experts were predicted (for
    /// prefetch), the number predicted correctly and the total.
    pub fn prediction(&self) -> (u64, u64) {
        (self.s.pred_hits, self.s.pred_total)
    }

    /// How this session's greedy tokens were chosen ([`Model::forward_greedy`]).
    pub fn screen_stats(&self) -> ScreenStats {
        self.s.screen_stats
    }

    /// The logits the last [`Model::forward`] returned ([`Model::forward_greedy`] leaves them
    /// as they were).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// The most positions this session can hold.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// A flag that stops this session's forwards ([`Model::forward`],
    /// [`Model::forward_greedy`], [`Model::forward_sample`]) while it is raised: checked
    /// before each layer of each block, so a long prefill stops within one layer's time with
    /// [`Error::Stopped`]. The blocks finished before stay in the cache (the position says how
    /// far it got; [`Session::truncate`] goes back); the block it stopped in is not committed.
    /// `None` (the default) never stops.
    pub fn set_stop(&mut self, flag: Option<Arc<AtomicBool>>) {
        self.stop = flag;
    }
    /// Forgets everything from position `pos` on, keeping the cache before it, and returns
    /// the number of positions actually kept. That is `pos` unless a sliding layer's ring has
    /// already overwritten keys the window at `pos` needs; then it is 0 (recompute from the
    /// start), never a position whose attention would be wrong.
    pub fn truncate(&mut self, pos: usize) -> usize {
        let old = self.pos;
        let pos = pos.min(old);
        let intact = self.kv.iter().all(|kv| {
            // positions old-cap .. old are still held; the window at `pos` needs pos-cap+block..pos
            kv.cap >= self.max_context || pos + kv.cap >= old + self.block.min(kv.cap)
        });
        self.pos = if intact { pos } else { 0 };
        self.pos
    }
}
