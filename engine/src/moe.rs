//! Mixture-of-experts: routing into a plan, the seam where expert tiers plug in, and the
//! computation of one expert over the positions that chose it.
//!
//! The router never knows where an expert lives. A layer's routing yields a [`RoutePlan`]
//! (for each position, its k experts and weights); the union of the plan's experts is asked
//! of an [`ExpertProvider`] in one call, which may serve them from the mapped checkpoint, a RAM
//! cache, the disk or a peer; each expert of the union is then computed once for all the
//! positions that chose it (batch-union), and each position sums its k outputs in slot order.
//! An [`ExpertExecutor`] may take some of the union instead (a peer computing an expert it
//! holds on the rows routed to it; see [`remote`]): the output bits are the same.
//!
//! **Completion-driven.** The union is asked of the provider a group at a time (as many as its
//! RAM budget holds, [`ExpertProvider::max_batch`]), and each group's experts are computed as
//! they land, in whatever order ([`ExpertProvider::fetch_each`]): all the experts ready and
//! not yet computed go through one `experts_forward` call (so the thread pool stays busy)
//! while the rest still load from the disk or the network, and the next group of the same
//! layer (known: the route is) starts loading as the computed experts free room. Each expert's
//! rows go to its own slot rows and each position sums its slots in slot order at the end, so
//! the output is the same bits in any landing order. [`set_completion_driven`] (or
//! `STORMO_COMPLETION_DRIVEN=0`) turns it off for measurement: then each group is fetched
//! whole, then computed, as before.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::config::{Activation, Routing};
use crate::error::{Error, Result};
use crate::huge::HugeBuf;
use crate::kernels::{each_mut, each_row_mut, matmul_batch, Float, Mat, Product, Vector};
use crate::ops;
use crate::safetensors::MappedFile;

pub mod remote;

pub use remote::{Demand, ExecFailed, Executed, ExpertExecutor, Settled, Ticket, Verdict};

/// Which piece of an expert a stored part is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Fused, interleaved gate/up weights (GPT-OSS): dense, or MXFP4 blocks.
    GateUp,
    /// MXFP4 scales of [`Role::GateUp`].
    GateUpScales,
    /// Bias of the fused gate/up projection.
    GateUpBias,
    /// Gate projection (Qwen3).
    Gate,
    /// Up projection (Qwen3).
    Up,
    /// Down projection: dense, or MXFP4 blocks.
    Down,
    /// MXFP4 scales of [`Role::Down`].
    DownScales,
    /// Bias of the down projection.
    DownBias,
}

/// How one part of an expert is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartFormat {
    /// Row-major `[out, in]` floats (or a vector for biases).
    Dense(Float),
    /// Row-major `[in, out]` floats (Transformers' saved GPT-OSS experts).
    DenseT(Float),
    /// MXFP4 nibbles `[out, in/32, 16]`.
    Mxfp4Blocks,
    /// E8M0 scales `[out, in/32]`.
    Mxfp4Scales,
}

/// One stored part of every expert of a layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartSchema {
    /// Which piece.
    pub role: Role,
    /// Storage format.
    pub format: PartFormat,
    /// Byte length of this part for one expert.
    pub len: usize,
}

/// How a layer's experts are laid out: the parts each has, in a fixed order, and the
/// logical shapes. The same for every expert of the layer.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSchema {
    /// Parts, in the order [`ExpertData`] holds them.
    pub parts: Vec<PartSchema>,
    /// Residual width H.
    pub hidden: usize,
    /// Intermediate width I.
    pub intermediate: usize,
    /// Activation.
    pub activation: Activation,
}

impl ExpertSchema {
    /// Bytes of one expert (all parts).
    pub fn expert_len(&self) -> usize {
        self.parts.iter().map(|p| p.len).sum()
    }

    /// `expert(xs)` for `n` rows of `xs` (`[n, H]`), the expert's parts in `data`: `[n, H]`
    /// output rows ([`expert_forward`] over [`view`](Self::view)), as a serving peer computes
    /// an `Exec` and as a spot-check computes it again.
    pub fn compute(&self, data: &ExpertData, xs: &[f32]) -> Vec<f32> {
        let mut scratch = ExpertScratch::default();
        expert_forward(
            &self.view(data),
            xs,
            self.hidden,
            self.intermediate,
            &mut scratch,
        );
        scratch.ys
    }

    /// Interprets an expert's parts as matrices.
    pub fn view<'a>(&self, data: &'a ExpertData) -> ExpertView<'a> {
        let (h, i) = (self.hidden, self.intermediate);
        let mut v = ExpertView {
            gate_up: None,
            gate: None,
            up: None,
            down: None,
            gate_up_bias: None,
            down_bias: None,
            activation: self.activation,
        };
        let mut gu_blocks = None;
        let mut gu_scales = None;
        let mut d_blocks = None;
        let mut d_scales = None;
        for (p, bytes) in self.parts.iter().zip(data.parts()) {
            let dense = |rows, cols| match p.format {
                PartFormat::Dense(fmt) => Mat::Dense {
                    fmt,
                    bytes,
                    rows,
                    cols,
                },
                PartFormat::DenseT(fmt) => Mat::DenseT {
                    fmt,
                    bytes,
                    rows,
                    cols,
                },
                _ => unreachable!("schema built with a float format for {:?}", p.role),
            };
            let vector = || match p.format {
                PartFormat::Dense(fmt) | PartFormat::DenseT(fmt) => Vector { fmt, bytes },
                _ => unreachable!("bias stored as floats"),
            };
            match (p.role, p.format) {
                (Role::GateUp, PartFormat::Mxfp4Blocks) => gu_blocks = Some(bytes),
                (Role::GateUpScales, _) => gu_scales = Some(bytes),
                (Role::Down, PartFormat::Mxfp4Blocks) => d_blocks = Some(bytes),
                (Role::DownScales, _) => d_scales = Some(bytes),
                (Role::GateUp, _) => v.gate_up = Some(dense(2 * i, h)),
                (Role::Gate, _) => v.gate = Some(dense(i, h)),
                (Role::Up, _) => v.up = Some(dense(i, h)),
                (Role::Down, _) => v.down = Some(dense(h, i)),
                (Role::GateUpBias, _) => v.gate_up_bias = Some(vector()),
                (Role::DownBias, _) => v.down_bias = Some(vector()),
            }
        }
        if let (Some(blocks), Some(scales)) = (gu_blocks, gu_scales) {
            v.gate_up = Some(Mat::Mxfp4 {
                blocks,
                scales,
                rows: 2 * i,
                cols: h,
            });
        }
        if let (Some(blocks), Some(scales)) = (d_blocks, d_scales) {
            v.down = Some(Mat::Mxfp4 {
                blocks,
                scales,
                rows: h,
                cols: i,
            });
        }
        v
    }
}

/// An expert's matrices, borrowed from wherever its bytes are.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// Fused interleaved gate/up `[2I, H]` (GPT-OSS).
    pub gate_up: Option<Mat<'a>>,
    /// Gate `[I, H]` (Qwen3).
    pub gate: Option<Mat<'a>>,
    /// Up `[I, H]` (Qwen3).
    pub up: Option<Mat<'a>>,
    /// Down `[H, I]`.
    pub down: Option<Mat<'a>>,
    /// Bias of gate/up `[2I]`.
    pub gate_up_bias: Option<Vector<'a>>,
    /// Bias of down `[H]`.
    pub down_bias: Option<Vector<'a>>,
    /// Activation.
    pub activation: Activation,
}

impl ExpertView<'_> {
    /// The same expert with its MXFP4 matrices taking int8-quantized inputs
    /// ([`Mat::Mxfp4Int8`], the opt-in `--int8-experts` path); float matrices unchanged.
    pub fn with_int8_inputs(mut self) -> Self {
        for m in [
            &mut self.gate_up,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ]
        .into_iter()
        .flatten()
        {
            if let Mat::Mxfp4 {
                blocks,
                scales,
                rows,
                cols,
            } = *m
            {
                *m = Mat::Mxfp4Int8 {
                    blocks,
                    scales,
                    rows,
                    cols,
                };
            }
        }
        self
    }
}

/// Where an expert part's bytes are held.
#[derive(Clone)]
pub enum PartBytes {
    /// A range of a mapped checkpoint file.
    Mapped(Arc<MappedFile>, Range<usize>),
    /// A range of an owned buffer, on huge pages where the kernel allows (an expert the disk
    /// tier read, bytes from a peer or an expert directory): see [`crate::huge`].
    Owned(Arc<HugeBuf>, Range<usize>),
}

impl fmt::Debug for PartBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mapped(m, r) => write!(f, "Mapped({}, {r:?})", m.path.display()),
            Self::Owned(_, r) => write!(f, "Owned({r:?})"),
        }
    }
}

impl PartBytes {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped(m, r) => &m.map[r.clone()],
            Self::Owned(b, r) => &b[r.clone()],
        }
    }
}

/// One expert's bytes, part by part in [`ExpertSchema`] order.
#[derive(Clone, Debug)]
pub struct ExpertData {
    parts: Vec<PartBytes>,
}

impl ExpertData {
    /// From parts in schema order.
    pub fn new(parts: Vec<PartBytes>) -> Self {
        Self { parts }
    }

    /// From one contiguous buffer holding the parts back to back in schema order.
    pub fn from_buffer(buf: Arc<HugeBuf>, schema: &ExpertSchema) -> Self {
        Self::from_lengths(buf, 0, schema.parts.iter().map(|p| p.len))
    }

    /// From one buffer holding parts of lengths `lens` back to back from byte `base`.
    pub fn from_lengths(
        buf: Arc<HugeBuf>,
        base: usize,
        lens: impl IntoIterator<Item = usize>,
    ) -> Self {
        let mut off = base;
        let parts = lens
            .into_iter()
            .map(|len| {
                let r = off..off + len;
                off += len;
                PartBytes::Owned(buf.clone(), r)
            })
            .collect();
        Self { parts }
    }

    /// The parts' bytes.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        self.parts.iter().map(PartBytes::bytes)
    }

    /// Whether the parts held in a file mapping still are the file's
    /// ([`MappedFile::check`]: one `fstat` per file). Called before the bytes are used and
    /// again after whatever was computed from them, and before it is handed on: a file
    /// truncated in between reads as zeros, not as a fault (see `safetensors/sigbus.rs`).
    pub fn check_mapped(&self) -> Result<()> {
        let mut run: Option<(&Arc<MappedFile>, usize)> = None;
        for p in &self.parts {
            let PartBytes::Mapped(file, r) = p else {
                continue;
            };
            match &mut run {
                Some((f, end)) if Arc::ptr_eq(f, file) => *end = (*end).max(r.end),
                _ => {
                    if let Some((f, end)) = run {
                        f.check(end)?;
                    }
                    run = Some((file, r.end));
                }
            }
        }
        match run {
            Some((f, end)) => f.check(end),
            None => Ok(()),
        }
    }
}

/// [`ExpertData::check_mapped`] as an error naming the expert (and the file).
fn check_mapped(layer: usize, expert: usize, data: &ExpertData) -> Result<()> {
    data.check_mapped().map_err(|e| Error::Expert {
        layer,
        expert,
        reason: e.chain(),
    })
}

/// Where experts come from: the seam between the MoE computation and the tiers.
///
/// `fetch` is given a whole layer's union of experts at once, so a slow tier can work on all
/// of them in parallel; it appends one handle per requested expert, in request order.
pub trait ExpertProvider: Send + Sync + fmt::Debug {
    /// Makes `experts` of `layer` available.
    fn fetch(&self, layer: usize, experts: &[usize], out: &mut Vec<Arc<ExpertData>>) -> Result<()>;

    /// A hint that `experts` of `layer` will probably be needed soon (prefetch). Default: none.
    fn hint(&self, _layer: usize, _experts: &[usize]) {}

    /// Whether [`hint`](Self::hint) does anything (so the model can skip predicting).
    fn wants_hints(&self) -> bool {
        false
    }

    /// The most experts of `layer` that one `fetch` should ask for (a RAM budget may hold only
    /// so many at once). Default: no limit.
    fn max_batch(&self, _layer: usize) -> usize {
        usize::MAX
    }

    /// Makes `experts` of `layer` available as [`fetch`](Self::fetch) does, but hands them to
    /// `landed` as they arrive, in any order: each call gives the places in `experts` of the
    /// experts that became ready since the last call, and their handles (`landed(places,
    /// handles)`, one handle per place). When it returns `Ok`, every place was handed over
    /// exactly once. An error of a load, or of `landed`, ends the call with that error (places
    /// not handed over by then never are).
    ///
    /// `ahead` are experts of the same layer that the caller will ask for next (the route is
    /// known): a provider may start loading them as room frees up, never evicting one of
    /// `experts` or `ahead` for them. The default fetches the whole request, then hands it
    /// over in one call, and ignores `ahead`.
    fn fetch_each(
        &self,
        layer: usize,
        experts: &[usize],
        ahead: &[usize],
        landed: &mut Landed<'_>,
    ) -> Result<()> {
        let _ = ahead;
        with_landing(|l| {
            self.fetch(layer, experts, &mut l.handles)?;
            if l.handles.len() != experts.len() {
                return Err(wrong_count(layer, experts, l.handles.len()));
            }
            l.places.extend(0..experts.len());
            landed(&l.places, &l.handles)
        })
    }
}

/// Buffers for handing experts over as they land ([`ExpertProvider::fetch_each`]), kept by
/// each thread so that a decoded token allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct Landing {
    /// Places in the request of the experts of one landing.
    pub(crate) places: Vec<usize>,
    /// Their handles.
    pub(crate) handles: Vec<Arc<ExpertData>>,
    /// Per place of the request, whether it was handed over.
    pub(crate) taken: Vec<bool>,
}

thread_local! {
    static LANDING: std::cell::Cell<Landing> = std::cell::Cell::new(Landing::default());
}

/// Runs `f` with this thread's [`Landing`] buffers, empty (a nested call gets new ones). The
/// handles are dropped before the buffers are kept: a kept handle would keep its expert from
/// being evicted.
pub(crate) fn with_landing<R>(f: impl FnOnce(&mut Landing) -> R) -> R {
    let mut l = LANDING.with(std::cell::Cell::take);
    l.places.clear();
    l.handles.clear();
    l.taken.clear();
    let r = f(&mut l);
    l.handles.clear();
    LANDING.with(|c| c.set(l));
    r
}

/// What [`ExpertProvider::fetch_each`] hands each landing to: the places in the request of
/// the experts that landed, and their handles.
pub type Landed<'a> = dyn FnMut(&[usize], &[Arc<ExpertData>]) -> Result<()> + 'a;

/// The error of a provider that returned `got` experts for the request `experts`.
fn wrong_count(layer: usize, experts: &[usize], got: usize) -> Error {
    Error::Expert {
        layer,
        expert: experts.first().copied().unwrap_or(0),
        reason: format!(
            "provider returned {got} experts for {} requested",
            experts.len()
        ),
    }
}

/// Whether [`moe_block`] computes experts as they land (0: not read yet, 1: off, 2: on).
static COMPLETION_DRIVEN: AtomicU8 = AtomicU8::new(0);

/// Whether [`moe_block`] computes each group's experts as they land
/// ([`ExpertProvider::fetch_each`]), loading the next group meanwhile: on unless
/// [`set_completion_driven`] or `STORMO_COMPLETION_DRIVEN=0` turned it off. Never changes a
/// result.
pub fn completion_driven() -> bool {
    match COMPLETION_DRIVEN.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var("STORMO_COMPLETION_DRIVEN").map_or(true, |v| v.trim() != "0");
            // A concurrent `set_completion_driven` wins over the environment.
            let _ = COMPLETION_DRIVEN.compare_exchange(
                0,
                if on { 2 } else { 1 },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            COMPLETION_DRIVEN.load(Ordering::Relaxed) == 2
        }
    }
}

/// Turns completion-driven MoE on or off for the whole process (a lab switch: `stormo bench
/// --pair-completion` alternates the two). Off, each group of experts is fetched whole, then
/// computed. The same bits either way.
pub fn set_completion_driven(on: bool) {
    COMPLETION_DRIVEN.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Experts served straight from the mapped checkpoint: every expert resident (or paged in by
/// the OS). The simplest provider, and the reference the tiers are tested against.
#[derive(Debug)]
pub struct MappedExperts {
    /// `[layer][expert]`; empty for dense layers.
    experts: Vec<Vec<Arc<ExpertData>>>,
}

impl MappedExperts {
    /// From per-layer, per-expert data.
    pub fn new(experts: Vec<Vec<Arc<ExpertData>>>) -> Self {
        Self { experts }
    }
}

impl ExpertProvider for MappedExperts {
    fn fetch(&self, layer: usize, experts: &[usize], out: &mut Vec<Arc<ExpertData>>) -> Result<()> {
        for &e in experts {
            let d = self
                .experts
                .get(layer)
                .and_then(|l| l.get(e))
                .ok_or_else(|| Error::Expert {
                    layer,
                    expert: e,
                    reason: "no such expert in the checkpoint".into(),
                })?;
            check_mapped(layer, e, d)?;
            out.push(d.clone());
        }
        Ok(())
    }
}

/// The routing of a block of positions through one layer.
#[derive(Clone, Debug, Default)]
pub struct RoutePlan {
    /// Experts per position.
    pub k: usize,
    /// `[t, k]` expert ids, slot order (descending router score).
    pub experts: Vec<usize>,
    /// `[t, k]` weights.
    pub weights: Vec<f32>,
}

impl RoutePlan {
    /// Routes `t` positions given router logits `[t, e]`.
    pub fn route(
        &mut self,
        logits: &[f32],
        num_experts: usize,
        k: usize,
        rule: Routing,
        probs_scratch: &mut Vec<f32>,
    ) {
        let t = logits.len() / num_experts;
        self.k = k;
        self.experts.resize(t * k, 0);
        self.weights.resize(t * k, 0.0);
        for p in 0..t {
            let row = &logits[p * num_experts..(p + 1) * num_experts];
            let idx = &mut self.experts[p * k..(p + 1) * k];
            let w = &mut self.weights[p * k..(p + 1) * k];
            match rule {
                Routing::TopKThenSoftmax => {
                    ops::top_k(row, idx);
                    for (wi, &e) in w.iter_mut().zip(idx.iter()) {
                        *wi = row[e];
                    }
                    ops::softmax(w);
                }
                Routing::SoftmaxThenTopK { renormalize } => {
                    probs_scratch.clear();
                    probs_scratch.extend_from_slice(row);
                    ops::softmax(probs_scratch);
                    ops::top_k(probs_scratch, idx);
                    for (wi, &e) in w.iter_mut().zip(idx.iter()) {
                        *wi = probs_scratch[e];
                    }
                    if renormalize {
                        let s: f32 = w.iter().sum();
                        for wi in w.iter_mut() {
                            *wi /= s;
                        }
                    }
                }
            }
        }
    }

    /// Number of positions.
    pub fn positions(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
    }
}

/// Scratch for one expert over `n` positions.
#[derive(Debug, Default)]
pub struct ExpertScratch {
    h: Vec<f32>,
    h2: Vec<f32>,
    act: Vec<f32>,
    ys: Vec<f32>,
}

impl ExpertScratch {
    /// The output of the last [`expert_forward`], `[n, H]`.
    pub fn output(&self) -> &[f32] {
        &self.ys
    }
}

/// Computes `ys = expert(xs)` for `n` rows of `xs` (`[n, H]`); `ys` is `[n, H]`
/// ([`ExpertScratch::output`]).
pub fn expert_forward(
    v: &ExpertView<'_>,
    xs: &[f32],
    hidden: usize,
    inter: usize,
    s: &mut ExpertScratch,
) {
    experts_forward(|_| *v, |_| xs, std::slice::from_mut(s), hidden, inter);
}

/// Computes `ys = expert(xs)` for several experts, each over its own positions: expert `i`
/// is `view(i)`, its inputs `[n_i, H]` are `input(i)` and its output lands in `scratch[i]`
/// ([`ExpertScratch::output`]). Each
/// output is what the expert alone would give, bit for bit; the experts' gate/up projections
/// share one parallel region and their down projections another
/// ([`matmul_batch`](crate::kernels::matmul_batch)).
pub(crate) fn experts_forward<'v, 'x>(
    view: impl Fn(usize) -> ExpertView<'v> + Sync,
    input: impl Fn(usize) -> &'x [f32],
    scratch: &mut [ExpertScratch],
    hidden: usize,
    inter: usize,
) {
    for (i, s) in scratch.iter_mut().enumerate() {
        let n = input(i).len() / hidden;
        match view(i).activation {
            Activation::ClippedSwiglu { .. } => s.h.resize(n * 2 * inter, 0.0),
            Activation::Silu => {
                s.h.resize(n * inter, 0.0);
                s.h2.resize(n * inter, 0.0);
            }
        }
        s.act.resize(n * inter, 0.0);
        s.ys.resize(n * hidden, 0.0);
    }
    matmul_batch(scratch.iter_mut().enumerate().flat_map(|(i, s)| {
        let v = view(i);
        let ExpertScratch { h, h2, .. } = s;
        let (first, second) = match v.activation {
            Activation::ClippedSwiglu { .. } => {
                (v.gate_up.expect("GPT-OSS expert has gate_up"), None)
            }
            Activation::Silu => (
                v.gate.expect("Qwen3 expert has gate"),
                Some(v.up.expect("Qwen3 expert has up")),
            ),
        };
        let xs = input(i);
        std::iter::once(Product {
            w: first,
            xs,
            ys: h,
        })
        .chain(second.map(|w| Product { w, xs, ys: h2 }))
    }));
    // A prefill block's activations (hundreds of thousands of exponentials) on the pool.
    let work = scratch.iter().map(|s| s.act.len()).sum();
    each_mut(scratch, work, |i, s| activate(&view(i), s, inter));
    matmul_batch(scratch.iter_mut().enumerate().map(|(i, s)| Product {
        w: view(i).down.expect("expert has down"),
        xs: &s.act,
        ys: &mut s.ys,
    }));
    let work = scratch.iter().map(|s| s.ys.len()).sum();
    each_mut(scratch, work, |i, s| {
        if let Some(b) = &view(i).down_bias {
            for row in s.ys.chunks_exact_mut(hidden) {
                b.add_to(row);
            }
        }
    });
}

/// An expert's activation: its gate/up bias, then `act` from `h` (and `h2`).
fn activate(v: &ExpertView<'_>, s: &mut ExpertScratch, inter: usize) {
    match v.activation {
        Activation::ClippedSwiglu { limit, alpha } => {
            if let Some(b) = &v.gate_up_bias {
                for row in s.h.chunks_exact_mut(2 * inter) {
                    b.add_to(row);
                }
            }
            for (a, g) in s.act.iter_mut().zip(s.h.chunks_exact(2)) {
                let gate = g[0].min(limit);
                let up = g[1].clamp(-limit, limit);
                let glu = gate * ops::sigmoid(gate * alpha);
                *a = (up + 1.0) * glu;
            }
        }
        Activation::Silu => {
            for ((a, &g), &u) in s.act.iter_mut().zip(&s.h).zip(&s.h2) {
                *a = g * ops::sigmoid(g) * u;
            }
        }
    }
}

/// Scratch for a whole MoE layer over a block.
#[derive(Debug, Default)]
pub struct MoeScratch {
    /// Router logits `[t, E]`.
    pub logits: Vec<f32>,
    /// The plan.
    pub plan: RoutePlan,
    union: Vec<usize>,
    /// For each union member, the (position, slot) pairs that chose it (flattened).
    members: Vec<(usize, usize)>,
    member_start: Vec<usize>,
    fill: Vec<usize>,
    handles: Vec<Arc<ExpertData>>,
    /// Places `0..g` of a group fetched whole.
    places: Vec<usize>,
    /// The experts of one landing, in its order.
    landed: Vec<usize>,
    /// Per (position, slot) expert output `[t, k, H]`.
    slot_out: Vec<f32>,
    /// One per expert of a landing.
    experts: Vec<ExpertScratch>,
    /// Each landed expert's inputs `[n_e, H]`, gathered from its positions.
    inputs: Vec<Vec<f32>>,
    /// Per (position, slot), the landing's expert and row holding its output, if the expert
    /// is in the landing.
    source: Vec<Option<(usize, usize)>>,
    /// The union's experts with their position counts, for [`ExpertExecutor::choose`].
    demand: Vec<Demand>,
    /// Which of the union the executor takes.
    delegate: Vec<bool>,
    /// The experts computed here (fetched through the provider).
    local: Vec<usize>,
    /// A delegated expert's inputs, gathered for [`ExpertExecutor::submit`].
    remote_in: Vec<f32>,
    /// The delegated experts and their tickets.
    remote: Vec<(usize, Ticket)>,
    /// Answers to compare with the local computation (spot-checks).
    checks: Vec<(usize, Ticket, Vec<f32>)>,
    /// Delegated experts computed here after all (failed calls, spot-checks).
    recompute: Vec<usize>,
}

impl MoeScratch {
    /// The experts used by the last block (the union), in first-use order.
    pub fn union(&self) -> &[usize] {
        &self.union
    }

    /// Builds the union of the plan's experts and each one's (position, slot) members.
    fn gather(&mut self, num_experts: usize) {
        let (t, k) = (self.plan.positions(), self.plan.k);
        self.union.clear();
        self.member_start.clear();
        self.member_start.resize(num_experts + 1, 0);
        for &e in &self.plan.experts {
            self.member_start[e + 1] += 1;
        }
        for e in 0..num_experts {
            if self.member_start[e + 1] > 0 {
                self.union.push(e);
            }
            self.member_start[e + 1] += self.member_start[e];
        }
        self.members.resize(t * k, (0, 0));
        self.fill.clear();
        self.fill.extend_from_slice(&self.member_start);
        for p in 0..t {
            for s in 0..k {
                let e = self.plan.experts[p * k + s];
                self.members[self.fill[e]] = (p, s);
                self.fill[e] += 1;
            }
        }
    }

    /// The (position, slot) pairs routed to `e`, in row order of its inputs and outputs.
    fn members_of(&self, e: usize) -> &[(usize, usize)] {
        &self.members[self.member_start[e]..self.member_start[e + 1]]
    }
}

/// Runs the MoE for a block: `xs` `[t, H]` normalised inputs, adds the result into `out`
/// `[t, H]`. The plan must already be in `s.plan`. With `int8_inputs`, MXFP4 experts take
/// int8-quantized inputs ([`ExpertView::with_int8_inputs`]).
///
/// With an `executor`, the experts it chooses are computed by it while the others are fetched
/// and computed here; a failed call or a spot-checked answer is computed here as well (see
/// [`remote`]). The output is the same bits either way.
#[allow(clippy::too_many_arguments)]
pub fn moe_block(
    layer: usize,
    schema: &ExpertSchema,
    provider: &dyn ExpertProvider,
    executor: Option<&dyn ExpertExecutor>,
    num_experts: usize,
    xs: &[f32],
    out: &mut [f32],
    int8_inputs: bool,
    s: &mut MoeScratch,
) -> Result<()> {
    let h = schema.hidden;
    let (t, k) = (s.plan.positions(), s.plan.k);
    s.gather(num_experts);
    s.slot_out.resize(t * k * h, 0.0);
    s.local.clear();
    s.remote.clear();
    let executor = executor.filter(|_| !int8_inputs);
    match executor {
        Some(x) => {
            s.demand.clear();
            for &e in &s.union {
                s.demand.push(Demand {
                    expert: e,
                    positions: s.member_start[e + 1] - s.member_start[e],
                });
            }
            s.delegate.clear();
            s.delegate.resize(s.union.len(), false);
            x.choose(layer, &s.demand, &mut s.delegate);
            for i in 0..s.union.len() {
                let e = s.union[i];
                if !s.delegate[i] {
                    s.local.push(e);
                    continue;
                }
                let mut rows = std::mem::take(&mut s.remote_in);
                rows.clear();
                for &(p, _) in s.members_of(e) {
                    rows.extend_from_slice(&xs[p * h..(p + 1) * h]);
                }
                let ticket = x.submit(layer, e, &rows);
                s.remote_in = rows;
                s.remote.push((e, ticket));
            }
        }
        None => s.local.extend_from_slice(&s.union),
    }
    // The local experts while the delegated ones run elsewhere; every ticket is collected
    // even when this fails, so the executor is left with no call nobody waits for.
    let local = std::mem::take(&mut s.local);
    let computed = compute_local(layer, schema, provider, &local, xs, int8_inputs, s);
    s.local = local;
    if let Some(x) = executor {
        s.recompute.clear();
        s.checks.clear();
        for ri in 0..s.remote.len() {
            let (e, ticket) = s.remote[ri];
            let n = s.member_start[e + 1] - s.member_start[e];
            match x.collect(ticket) {
                Ok(a) if a.rows.len() == n * h => {
                    if a.check {
                        s.recompute.push(e);
                        s.checks.push((e, ticket, a.rows));
                    } else {
                        let (members, slot_out) = (
                            &s.members[s.member_start[e]..s.member_start[e + 1]],
                            &mut s.slot_out,
                        );
                        for (j, &(p, slot)) in members.iter().enumerate() {
                            slot_out[(p * k + slot) * h..(p * k + slot + 1) * h]
                                .copy_from_slice(&a.rows[j * h..(j + 1) * h]);
                        }
                    }
                }
                Ok(a) => {
                    tracing::debug!(
                        layer,
                        expert = e,
                        "executor answered {} values for {} rows of {h}; computing it here",
                        a.rows.len(),
                        n
                    );
                    x.report(ticket, Verdict::Malformed);
                    s.recompute.push(e);
                }
                Err(err) => {
                    tracing::debug!(
                        layer,
                        expert = e,
                        "delegated call failed ({err}); computing it here"
                    );
                    s.recompute.push(e);
                }
            }
        }
        computed?;
        let recompute = std::mem::take(&mut s.recompute);
        let done = compute_local(layer, schema, provider, &recompute, xs, int8_inputs, s);
        s.recompute = recompute;
        done?;
        for (e, ticket, rows) in &s.checks {
            let agree = s.members_of(*e).iter().enumerate().all(|(j, &(p, slot))| {
                let here = &s.slot_out[(p * k + slot) * h..(p * k + slot + 1) * h];
                let there = &rows[j * h..(j + 1) * h];
                here.iter()
                    .zip(there)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            });
            if !agree {
                tracing::warn!(
                    layer,
                    expert = e,
                    "a spot-checked remote result differs from the local computation; the local one is used"
                );
            }
            x.report(
                *ticket,
                if agree {
                    Verdict::Agreed
                } else {
                    Verdict::Disagreed
                },
            );
        }
        s.checks.clear();
    } else {
        computed?;
    }
    // Each position adds its slots' outputs in slot order, whichever thread runs it.
    each_row_mut(&mut out[..t * h], h, t * k * h, |p, o| {
        for slot in 0..k {
            let w = s.plan.weights[p * k + slot];
            let y = &s.slot_out[(p * k + slot) * h..(p * k + slot + 1) * h];
            for (oi, &yi) in o.iter_mut().zip(y) {
                *oi += w * yi;
            }
        }
    });
    Ok(())
}

/// Fetches `experts` of `layer` through the provider (in groups of at most its
/// [`max_batch`](ExpertProvider::max_batch)), computes each over the positions routed to it,
/// and writes the outputs into the scratch's slot rows. Completion-driven
/// ([`completion_driven`]): each group's experts are computed as they land, the next group
/// named to the provider as `ahead`; else each group is fetched whole, then computed.
#[allow(clippy::too_many_arguments)]
fn compute_local(
    layer: usize,
    schema: &ExpertSchema,
    provider: &dyn ExpertProvider,
    experts: &[usize],
    xs: &[f32],
    int8_inputs: bool,
    s: &mut MoeScratch,
) -> Result<()> {
    let group = provider.max_batch(layer).max(1);
    let streamed = completion_driven();
    let mut rest = experts;
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(group.min(rest.len()));
        rest = after;
        if streamed {
            let ahead = &rest[..group.min(rest.len())];
            // The fetch span covers the waits only: each landing is computed in the experts'.
            let mut fetch_span = Some(crate::profile::span(crate::profile::Phase::ExpertFetch));
            provider.fetch_each(layer, chunk, ahead, &mut |places, handles| {
                fetch_span = None;
                compute_landed(layer, schema, chunk, places, handles, xs, int8_inputs, s)?;
                fetch_span = Some(crate::profile::span(crate::profile::Phase::ExpertFetch));
                Ok(())
            })?;
        } else {
            let mut handles = std::mem::take(&mut s.handles);
            handles.clear();
            let fetch_span = crate::profile::span(crate::profile::Phase::ExpertFetch);
            let fetched = provider.fetch(layer, chunk, &mut handles);
            drop(fetch_span);
            let done = fetched.and_then(|()| {
                if handles.len() != chunk.len() {
                    return Err(wrong_count(layer, chunk, handles.len()));
                }
                s.places.clear();
                s.places.extend(0..chunk.len());
                let places = std::mem::take(&mut s.places);
                let done =
                    compute_landed(layer, schema, chunk, &places, &handles, xs, int8_inputs, s);
                s.places = places;
                done
            });
            handles.clear();
            s.handles = handles;
            done?;
        }
    }
    Ok(())
}

/// Computes the experts `chunk[places[i]]` of `layer`, whose bytes are `handles[i]`, over
/// the positions routed to each (in one [`experts_forward`] call), and writes their outputs
/// into the scratch's slot rows. What an expert gives does not depend on which others share
/// the call, so any split of a group into landings gives the same bits.
#[allow(clippy::too_many_arguments)]
fn compute_landed(
    layer: usize,
    schema: &ExpertSchema,
    chunk: &[usize],
    places: &[usize],
    handles: &[Arc<ExpertData>],
    xs: &[f32],
    int8_inputs: bool,
    s: &mut MoeScratch,
) -> Result<()> {
    let h = schema.hidden;
    let (t, k) = (s.plan.positions(), s.plan.k);
    let g = places.len();
    if handles.len() != g {
        return Err(wrong_count(layer, chunk, handles.len()));
    }
    let expert = |i: usize| -> Result<usize> {
        chunk.get(places[i]).copied().ok_or_else(|| Error::Expert {
            layer,
            expert: chunk.first().copied().unwrap_or(0),
            reason: format!(
                "provider handed over place {} of a request for {}",
                places[i],
                chunk.len()
            ),
        })
    };
    s.landed.clear();
    for (i, d) in handles.iter().enumerate() {
        let e = expert(i)?;
        check_lengths(layer, e, schema, d)?;
        s.landed.push(e);
    }
    if s.experts.len() < g {
        s.experts.resize_with(g, ExpertScratch::default);
        s.inputs.resize_with(g, Vec::new);
    }
    // Each expert's inputs gathered from its positions.
    let (members, member_start, landed) = (&s.members, &s.member_start, &s.landed);
    each_mut(&mut s.inputs[..g], t * k * h, |i, x| {
        let e = landed[i];
        x.clear();
        for &(p, _) in &members[member_start[e]..member_start[e + 1]] {
            x.extend_from_slice(&xs[p * h..(p + 1) * h]);
        }
    });
    let view = |i: usize| {
        let v = schema.view(&handles[i]);
        if int8_inputs {
            v.with_int8_inputs()
        } else {
            v
        }
    };
    let inputs = &s.inputs;
    experts_forward(
        view,
        |i| &inputs[i],
        &mut s.experts[..g],
        h,
        schema.intermediate,
    );
    // A mapped file cut short while the kernels read it gave them zeros: found here.
    for (d, &e) in handles.iter().zip(&s.landed) {
        check_mapped(layer, e, d)?;
    }
    // Where each (position, slot) of these experts finds its output row.
    s.source.clear();
    s.source.resize(t * k, None);
    for (i, &e) in s.landed.iter().enumerate() {
        for (j, &(p, slot)) in s.members[s.member_start[e]..s.member_start[e + 1]]
            .iter()
            .enumerate()
        {
            s.source[p * k + slot] = Some((i, j));
        }
    }
    let (experts, source) = (&s.experts, &s.source);
    each_row_mut(&mut s.slot_out[..t * k * h], h, t * k * h, |d, dst| {
        if let Some((i, j)) = source[d] {
            dst.copy_from_slice(&experts[i].ys[j * h..(j + 1) * h]);
        }
    });
    Ok(())
}

fn check_lengths(
    layer: usize,
    expert: usize,
    schema: &ExpertSchema,
    data: &ExpertData,
) -> Result<()> {
    let n = data.parts.len();
    if n != schema.parts.len() {
        return Err(Error::Expert {
            layer,
            expert,
            reason: format!("has {n} parts, expected {}", schema.parts.len()),
        });
    }
    for (p, b) in schema.parts.iter().zip(data.parts()) {
        if b.len() != p.len {
            return Err(Error::Expert {
                layer,
                expert,
                reason: format!("part {:?} is {} bytes, expected {}", p.role, b.len(), p.len),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::PARALLEL_ELEMENTS;

    /// Bytes from a fixed xorshift sequence.
    fn noise(n: usize, seed: u64) -> impl Iterator<Item = u64> {
        let mut x = seed.max(1);
        (0..n).map(move |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
    }

    /// Random MXFP4 experts of one layer, a block's inputs, router logits and residual.
    struct Block {
        schema: ExpertSchema,
        provider: MappedExperts,
        xs: Vec<f32>,
        logits: Vec<f32>,
        residual: Vec<f32>,
        n_exp: usize,
        k: usize,
        t: usize,
    }

    impl Block {
        fn new(h: usize, inter: usize, n_exp: usize, k: usize, t: usize) -> Self {
            let part = |role, format, len| PartSchema { role, format, len };
            let f32s = PartFormat::Dense(Float::F32);
            let schema = ExpertSchema {
                parts: vec![
                    part(Role::GateUp, PartFormat::Mxfp4Blocks, 2 * inter * h / 2),
                    part(
                        Role::GateUpScales,
                        PartFormat::Mxfp4Scales,
                        2 * inter * h / 32,
                    ),
                    part(Role::GateUpBias, f32s, 2 * inter * 4),
                    part(Role::Down, PartFormat::Mxfp4Blocks, h * inter / 2),
                    part(Role::DownScales, PartFormat::Mxfp4Scales, h * inter / 32),
                    part(Role::DownBias, f32s, h * 4),
                ],
                hidden: h,
                intermediate: inter,
                activation: Activation::ClippedSwiglu {
                    limit: 7.0,
                    alpha: 1.702,
                },
            };
            let experts = (0..n_exp as u64)
                .map(|e| {
                    let mut buf = Vec::new();
                    for (i, p) in schema.parts.iter().enumerate() {
                        let seed = 1 + e * 16 + i as u64;
                        match p.format {
                            PartFormat::Mxfp4Blocks => {
                                buf.extend(noise(p.len, seed).map(|v| v as u8));
                            }
                            // Scales 2^-6 .. 2^-3 and biases in [-0.5, 0.5).
                            PartFormat::Mxfp4Scales => {
                                buf.extend(noise(p.len, seed).map(|v| 121 + (v % 4) as u8));
                            }
                            _ => buf
                                .extend(noise(p.len / 4, seed).flat_map(|v| {
                                    ((v % 1000) as f32 / 1000.0 - 0.5).to_le_bytes()
                                })),
                        }
                    }
                    Arc::new(ExpertData::from_buffer(
                        Arc::new(HugeBuf::copy_of(&buf).unwrap()),
                        &schema,
                    ))
                })
                .collect();
            Self {
                schema,
                provider: MappedExperts::new(vec![experts]),
                xs: noise(t * h, 99)
                    .map(|v| (v % 2000) as f32 / 1000.0 - 1.0)
                    .collect(),
                logits: noise(t * n_exp, 7)
                    .map(|v| (v % 1000) as f32 / 100.0)
                    .collect(),
                residual: noise(t * h, 5).map(|v| (v % 7) as f32 - 3.0).collect(),
                n_exp,
                k,
                t,
            }
        }

        /// The MoE over positions `ps` added to their residual.
        fn run(
            &self,
            ps: Range<usize>,
            provider: &dyn ExpertProvider,
            executor: Option<&dyn ExpertExecutor>,
        ) -> Result<Vec<f32>> {
            let (h, n_exp) = (self.schema.hidden, self.n_exp);
            let mut s = MoeScratch::default();
            let logits = &self.logits[ps.start * n_exp..ps.end * n_exp];
            s.plan.route(
                logits,
                n_exp,
                self.k,
                Routing::TopKThenSoftmax,
                &mut Vec::new(),
            );
            let mut out = self.residual[ps.start * h..ps.end * h].to_vec();
            let xs = &self.xs[ps.start * h..ps.end * h];
            moe_block(
                0,
                &self.schema,
                provider,
                executor,
                n_exp,
                xs,
                &mut out,
                false,
                &mut s,
            )?;
            Ok(out)
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// A block large enough that the MoE gathers, activates, scatters and combines on the
    /// pool's threads (t * k * H and t * k * I at the threshold) gives, bit for bit, what each
    /// of its positions gives alone (on the calling thread), and the same when its experts come
    /// three at a time.
    #[test]
    fn a_threaded_block_equals_its_positions_alone() {
        let (h, inter, k, t) = (256, 256, 4, 64);
        assert!(t * k * h >= PARALLEL_ELEMENTS && t * k * inter >= PARALLEL_ELEMENTS);
        assert!(k * h < PARALLEL_ELEMENTS && k * inter < PARALLEL_ELEMENTS);
        let b = Block::new(h, inter, 8, k, t);
        // The same experts handed out three at a time (as a small RAM budget does).
        #[derive(Debug)]
        struct ThreeAtATime<'a>(&'a MappedExperts);
        impl ExpertProvider for ThreeAtATime<'_> {
            fn fetch(&self, l: usize, e: &[usize], out: &mut Vec<Arc<ExpertData>>) -> Result<()> {
                assert!(e.len() <= 3);
                self.0.fetch(l, e, out)
            }
            fn max_batch(&self, _layer: usize) -> usize {
                3
            }
        }
        let block = b.run(0..t, &b.provider, None).unwrap();
        let in_threes = b.run(0..t, &ThreeAtATime(&b.provider), None).unwrap();
        assert!(same_bits(&block, &in_threes));
        for p in 0..t {
            let alone = b.run(p..p + 1, &b.provider, None).unwrap();
            for (i, (a, b)) in block[p * h..(p + 1) * h].iter().zip(&alone).enumerate() {
                assert!(a.is_finite(), "position {p}, element {i}: {a}");
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "position {p}, element {i}: {a} vs {b}"
                );
            }
        }
    }

    /// A provider that hands each request's experts over in a scrambled order, one or two at
    /// a time (from `seed`), in groups of three, recording each request and its `ahead`.
    #[derive(Debug)]
    struct Scrambled<'a> {
        inner: &'a MappedExperts,
        seed: u64,
        requests: std::sync::Mutex<Vec<(Vec<usize>, Vec<usize>)>>,
    }

    impl ExpertProvider for Scrambled<'_> {
        fn fetch(&self, l: usize, e: &[usize], out: &mut Vec<Arc<ExpertData>>) -> Result<()> {
            self.inner.fetch(l, e, out)
        }
        fn max_batch(&self, _layer: usize) -> usize {
            3
        }
        fn fetch_each(
            &self,
            layer: usize,
            experts: &[usize],
            ahead: &[usize],
            landed: &mut Landed<'_>,
        ) -> Result<()> {
            self.requests
                .lock()
                .unwrap()
                .push((experts.to_vec(), ahead.to_vec()));
            let n = experts.len();
            let mut order: Vec<usize> = (0..n).collect();
            let mut r = noise(2 * n, self.seed + n as u64);
            for i in (1..n).rev() {
                order.swap(i, r.next().unwrap() as usize % (i + 1));
            }
            let mut at = 0;
            while at < n {
                let take = (1 + r.next().unwrap() as usize % 2).min(n - at);
                let places = &order[at..at + take];
                let mut handles = Vec::new();
                for &p in places {
                    self.inner.fetch(layer, &experts[p..=p], &mut handles)?;
                }
                landed(places, &handles)?;
                at += take;
            }
            Ok(())
        }
    }

    /// Experts handed over in scrambled orders and pieces give the bits of the whole group at
    /// once, and each group names the next one as `ahead` (the last none).
    #[test]
    fn scrambled_landings_give_the_bits_of_the_in_order_run() {
        let (h, inter, k, t) = (256, 256, 4, 64);
        let b = Block::new(h, inter, 8, k, t);
        let in_order = b.run(0..t, &b.provider, None).unwrap();
        for seed in 1..6 {
            let p = Scrambled {
                inner: &b.provider,
                seed,
                requests: Default::default(),
            };
            let scrambled = b.run(0..t, &p, None).unwrap();
            assert!(same_bits(&in_order, &scrambled), "seed {seed}");
            let requests = std::mem::take(&mut *p.requests.lock().unwrap());
            let union: Vec<usize> = requests.iter().flat_map(|(g, _)| g.clone()).collect();
            assert_eq!(union, (0..8).collect::<Vec<_>>(), "every expert, in groups");
            for (i, (group, ahead)) in requests.iter().enumerate() {
                assert!(group.len() <= 3);
                let next = requests.get(i + 1).map(|r| r.0.clone()).unwrap_or_default();
                assert_eq!(ahead, &next, "group {i}'s ahead is the next group");
            }
            // A decode position too (a few experts, one group).
            for ps in [0..1, 7..8] {
                let alone = b.run(ps.clone(), &b.provider, None).unwrap();
                assert!(same_bits(&alone, &b.run(ps, &p, None).unwrap()));
            }
        }
    }

    /// How an in-process executor answers.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Behaviour {
        /// Computes the expert with [`expert_forward`].
        Honest,
        /// Computes, then adds this to every output of expert 3.
        Lies(f32),
        /// Answers every call with an error.
        Fails,
        /// Answers with one value missing.
        Truncates,
    }

    /// An executor in the same process: delegates the experts `take` accepts, computes them
    /// from `experts` at submit, marks answers for a spot-check when `check`, and records the
    /// verdicts it is given.
    #[derive(Debug)]
    struct InProcess<'a> {
        experts: &'a MappedExperts,
        schema: &'a ExpertSchema,
        take: fn(usize) -> bool,
        behaviour: Behaviour,
        check: bool,
        answers: std::sync::Mutex<Vec<(usize, std::result::Result<Executed, ExecFailed>)>>,
        collected: std::sync::Mutex<Vec<usize>>,
        verdicts: std::sync::Mutex<Vec<(usize, Verdict)>>,
    }

    impl<'a> InProcess<'a> {
        fn new(b: &'a Block, take: fn(usize) -> bool, behaviour: Behaviour, check: bool) -> Self {
            Self {
                experts: &b.provider,
                schema: &b.schema,
                take,
                behaviour,
                check,
                answers: Default::default(),
                collected: Default::default(),
                verdicts: Default::default(),
            }
        }

        /// (expert, verdict) pairs reported, by expert.
        fn verdicts(&self) -> Vec<(usize, Verdict)> {
            let mut v = self.verdicts.lock().unwrap().clone();
            v.sort_by_key(|&(e, _)| e);
            v
        }
    }

    impl ExpertExecutor for InProcess<'_> {
        fn choose(&self, _layer: usize, demand: &[Demand], delegate: &mut [bool]) {
            assert!(delegate.iter().all(|d| !d), "delegate starts all false");
            for (d, x) in demand.iter().zip(delegate) {
                assert!(d.positions > 0);
                *x = (self.take)(d.expert);
            }
        }

        fn submit(&self, layer: usize, expert: usize, inputs: &[f32]) -> Ticket {
            let answer = match self.behaviour {
                Behaviour::Fails => Err(ExecFailed::Unavailable("test".into())),
                _ => {
                    let mut handles = Vec::new();
                    self.experts.fetch(layer, &[expert], &mut handles).unwrap();
                    let v = self.schema.view(&handles[0]);
                    let mut s = ExpertScratch::default();
                    let (h, i) = (self.schema.hidden, self.schema.intermediate);
                    expert_forward(&v, inputs, h, i, &mut s);
                    let mut rows = s.output().to_vec();
                    match self.behaviour {
                        Behaviour::Lies(by) if expert == 3 => {
                            rows.iter_mut().for_each(|y| *y += by)
                        }
                        Behaviour::Truncates => {
                            rows.pop();
                        }
                        _ => {}
                    }
                    Ok(Executed {
                        rows,
                        check: self.check,
                    })
                }
            };
            let mut a = self.answers.lock().unwrap();
            a.push((expert, answer));
            Ticket(a.len() as u64 - 1)
        }

        fn collect(&self, ticket: Ticket) -> std::result::Result<Executed, ExecFailed> {
            let mut a = self.answers.lock().unwrap();
            let (e, answer) = &mut a[ticket.0 as usize];
            self.collected.lock().unwrap().push(*e);
            std::mem::replace(answer, Err(ExecFailed::Failed("collected twice".into())))
        }

        fn report(&self, ticket: Ticket, verdict: Verdict) {
            let e = self.answers.lock().unwrap()[ticket.0 as usize].0;
            self.verdicts.lock().unwrap().push((e, verdict));
        }
    }

    /// One test body over a decode position and a prefill block: the output with `executor`
    /// is the bits of the output without one.
    fn exact_with(b: &Block, x: &InProcess<'_>) {
        for ps in [0..1, 5..6, 0..b.t] {
            let here = b.run(ps.clone(), &b.provider, None).unwrap();
            let there = b.run(ps.clone(), &b.provider, Some(x)).unwrap();
            assert!(
                same_bits(&here, &there),
                "positions {ps:?}, {:?}",
                x.behaviour
            );
        }
        let mut submitted: Vec<usize> = x.answers.lock().unwrap().iter().map(|a| a.0).collect();
        let mut collected = x.collected.lock().unwrap().clone();
        submitted.sort_unstable();
        collected.sort_unstable();
        assert!(!submitted.is_empty());
        assert_eq!(submitted, collected, "every call collected once");
    }

    /// An honest executor taking some or all experts gives the bits of no executor, checked
    /// or not; a spot-check of an honest answer agrees.
    #[test]
    fn an_honest_executor_changes_no_bit() {
        let b = Block::new(64, 64, 8, 4, 16);
        for take in [(|e| e % 2 == 1) as fn(usize) -> bool, |_| true] {
            exact_with(&b, &InProcess::new(&b, take, Behaviour::Honest, false));
            let checked = InProcess::new(&b, take, Behaviour::Honest, true);
            exact_with(&b, &checked);
            let v = checked.verdicts();
            assert!(!v.is_empty());
            assert!(v.iter().all(|&(_, v)| v == Verdict::Agreed), "{v:?}");
        }
    }

    /// An executor that perturbs expert 3's outputs by 1e-2 is caught by every spot-check of
    /// expert 3 (and only of it), and the output stays exact; unchecked, the lie would change
    /// the output (so the check is what keeps it exact).
    #[test]
    fn a_lying_executor_is_caught_and_the_output_stays_exact() {
        let b = Block::new(64, 64, 8, 4, 16);
        let x = InProcess::new(&b, |_| true, Behaviour::Lies(1e-2), true);
        exact_with(&b, &x);
        let v = x.verdicts();
        assert!(v.iter().any(|&(e, _)| e == 3), "expert 3 was routed: {v:?}");
        for (e, verdict) in v {
            let want = if e == 3 {
                Verdict::Disagreed
            } else {
                Verdict::Agreed
            };
            assert_eq!(verdict, want, "expert {e}");
        }
        let unchecked = InProcess::new(&b, |_| true, Behaviour::Lies(1e-2), false);
        let here = b.run(0..b.t, &b.provider, None).unwrap();
        let there = b.run(0..b.t, &b.provider, Some(&unchecked)).unwrap();
        assert!(!same_bits(&here, &there));
    }

    /// Failed calls and answers of the wrong length are computed here: exact output, and a
    /// short answer is reported malformed.
    #[test]
    fn failed_and_malformed_calls_fall_back_exactly() {
        let b = Block::new(64, 64, 8, 4, 16);
        let failing = InProcess::new(&b, |e| e != 0, Behaviour::Fails, true);
        exact_with(&b, &failing);
        assert!(
            failing.verdicts().is_empty(),
            "a failed call has no verdict"
        );
        let short = InProcess::new(&b, |_| true, Behaviour::Truncates, false);
        exact_with(&b, &short);
        let v = short.verdicts();
        assert!(!v.is_empty());
        assert!(v.iter().all(|&(_, v)| v == Verdict::Malformed), "{v:?}");
    }

    /// A provider that fails while calls are out still sees every ticket collected, and the
    /// block returns the provider's error.
    #[test]
    fn every_ticket_is_collected_when_the_provider_fails() {
        #[derive(Debug)]
        struct Broken;
        impl ExpertProvider for Broken {
            fn fetch(&self, l: usize, e: &[usize], _: &mut Vec<Arc<ExpertData>>) -> Result<()> {
                Err(Error::Expert {
                    layer: l,
                    expert: e[0],
                    reason: "broken".into(),
                })
            }
        }
        let b = Block::new(64, 64, 8, 4, 16);
        let x = InProcess::new(&b, |e| e % 2 == 0, Behaviour::Honest, false);
        let e = b.run(0..b.t, &Broken, Some(&x)).unwrap_err();
        assert!(e.to_string().contains("broken"), "{e}");
        let submitted = x.answers.lock().unwrap().len();
        assert!(submitted > 0);
        assert_eq!(x.collected.lock().unwrap().len(), submitted);
    }

    #[test]
    fn gpt_oss_routing_is_softmax_over_selected() {
        let mut plan = RoutePlan::default();
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        plan.route(&logits, 4, 2, Routing::TopKThenSoftmax, &mut Vec::new());
        assert_eq!(plan.experts, vec![1, 2]);
        let e = (1.0f32).exp();
        assert!((plan.weights[0] - e / (e + 1.0)).abs() < 1e-6);
        assert!((plan.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn qwen_routing_renormalises_only_when_asked() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let mut a = RoutePlan::default();
        a.route(
            &logits,
            4,
            2,
            Routing::SoftmaxThenTopK { renormalize: false },
            &mut Vec::new(),
        );
        let mut b = RoutePlan::default();
        b.route(
            &logits,
            4,
            2,
            Routing::SoftmaxThenTopK { renormalize: true },
            &mut Vec::new(),
        );
        assert_eq!(a.experts, vec![3, 2]);
        assert!(a.weights.iter().sum::<f32>() < 0.95);
        assert!((b.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn clipped_swiglu_edges() {
        // One expert with H = 1, I = 1: gate_up is the identity into (gate, up) = (x·a, x·b).
        let gu: Vec<u8> = [1.0f32, 1.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let down: Vec<u8> = 1.0f32.to_le_bytes().to_vec();
        let v = ExpertView {
            gate_up: Some(Mat::Dense {
                fmt: Float::F32,
                bytes: &gu,
                rows: 2,
                cols: 1,
            }),
            gate: None,
            up: None,
            down: Some(Mat::Dense {
                fmt: Float::F32,
                bytes: &down,
                rows: 1,
                cols: 1,
            }),
            gate_up_bias: None,
            down_bias: None,
            activation: Activation::ClippedSwiglu {
                limit: 7.0,
                alpha: 1.702,
            },
        };
        let f = |x: f32| {
            let mut s = ExpertScratch::default();
            expert_forward(&v, &[x], 1, 1, &mut s);
            s.ys[0]
        };
        let reference = |g: f32, u: f32| {
            let g = g.min(7.0);
            let u = u.clamp(-7.0, 7.0);
            (u + 1.0) * (g * (1.0 / (1.0 + (-(g * 1.702)).exp())))
        };
        for x in [-20.0f32, -7.0, -6.99, 0.0, 0.5, 6.99, 7.0, 7.01, 50.0] {
            assert_eq!(f(x), reference(x, x), "x = {x}");
        }
        // above the limit the output is constant: both gate and up saturate
        assert_eq!(f(8.0), f(100.0));
        // below -limit, up clamps to -7 but gate keeps falling (no lower clamp on gate)
        assert_ne!(f(-8.0), f(-9.0));
    }
}
