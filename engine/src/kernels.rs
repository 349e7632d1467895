//! Matrix kernels over weights as they lie in the checkpoint: f32, bf16, f16 and MXFP4.
//!
//! The seam: [`Mat`] describes a weight matrix by reference (no copy, no dequantisation);
//! [`matvec`] and [`matmul`] compute `y = W·x` for one or many positions, [`matmul_batch`]
//! several independent products in one parallel region.
//!
//! Kernels come per instruction set ([`Isa`]): `scalar` (the reference, everywhere), `avx2` (AVX2, FMA
//! and F16C) and `avx512` (AVX-512 F/BW) on x86-64, `neon` on AArch64. The best ISA this CPU
//! runs is detected once; `STORMO_SIMD=scalar|neon|avx2|avx512` forces a lower one for the whole
//! process and [`with_isa`] for one thread's calls (tests run one body against every ISA in
//! [`Isa::available`], which in tests includes the AVX-512 ISA run in software on CPUs
//! without it: `avx512_emulated`). The process-wide ISA must first pass a self-check against
//! an f64 reference and, bit for bit, against the scalar kernels (`verify`), else the next
//! lower ISA is used, with a warning.
//!
//! # Same bits on every ISA
//!
//! Placement decides speed, never the output: an expert run on another peer's CPU, with another
//! ISA, gives the bits it gives here. The arithmetic is defined once, by the scalar reference
//! (`scalar`), and every ISA computes exactly it, only wider: a row's dot product is sixteen
//! lanes of fused multiply-adds (one rounding each), lane `l` taking the dense elements
//! `i ≡ l (mod 16)` in increasing `i` (MXFP4: each weight dequantized exactly, FP4 value times
//! its block's scale, and lane `l` taking a fixed element of each half of each block, in the
//! order the AVX-512 decode yields them), then a fixed halving tree over the lanes (`l + 8`,
//! `l + 4`, `l + 2`, `l + 1`), then the dense elements past the last multiple of 16 added one
//! by one, fused. Input-major matrices ([`Mat::DenseT`]) add one fused product per input, in
//! increasing input, to each output. This is what the AVX-512 ISA computed already (its speed is
//! unchanged); AVX2 holds the sixteen lanes in two registers, NEON in four, and the scalar
//! kernels use `f32::mul_add` (correctly rounded on every target, in hardware or in libm).
//! The row-scaled int8 weights of `--int8-attn-head` ([`Mat::Q8`]) follow the dense order, then
//! take the row's scale, so they agree too. Every ISA is tested against the scalar kernels bit
//! for bit on random shapes, special values included (every NaN counts as the same NaN: which
//! one an operation returns is the CPU's choice); what it cost is in `docs/performance.md`.
//! The opt-in int8-input MXFP4 path ([`Mat::Mxfp4Int8`], `--int8-experts`) rounds its inputs
//! (approximate against the exact product, by design), but it too has one arithmetic for every
//! ISA (`int8x`): each block's 32 products summed exactly in integers (in any order), times one
//! f32 factor per block, fused into eight lanes (block `b` into lane `b mod 8`, in increasing
//! `b`), then the lanes' halving tree (`l + 4`, `l + 2`, `l + 1`); so it gives the same bits
//! on every ISA too, and is tested as the exact formats are.
//!
//! Within an ISA, a position's output is bit-identical whether it was computed alone
//! ([`matvec`], decode) or in a block ([`matmul`], prefill): every kernel keeps one accumulator
//! per (row, position) whose summation order does not depend on how many rows or positions a
//! call interleaves. Prefill blocks read each weight row once per group of up to four
//! positions (32 for MXFP4 on the SIMD ISAs, 8 for its int8-input form; weights from cache
//! for the rest), decode streams the matrix once split across the kernels' threads (`pool`). MXFP4 is decoded
//! on the fly, in registers (the SIMD prefill kernels stage a few rows' slab of 4 blocks,
//! 8 KiB, in an L1 buffer they reuse, as a GEMM packs its panels); no dequantised copy of a
//! matrix is ever made.
//! An ISA may want MXFP4 inputs permuted within each block of 32 (AVX2 does, so its shuffles
//! need no interleaving): [`matvec`] and [`matmul`] permute them once per call into a reused
//! thread-local buffer.

/// `$f::<P>(args)` with `P` the const for `$p` positions, 1 to 8 (8 for anything larger):
/// position counts as const generics, so each kernel's per-position loops unroll.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))] // the x86 kernels use it
macro_rules! with_positions {
    ($p:expr, $f:ident($($a:expr),* $(,)?)) => {
        match $p {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            6 => $f::<6>($($a),*),
            7 => $f::<7>($($a),*),
            _ => $f::<8>($($a),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(all(target_arch = "x86_64", any(test, feature = "emulated-avx512")))]
mod avx512_emulated;
mod int8x;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pool;
mod scalar;
mod verify;

use std::cell::Cell;
use std::sync::OnceLock;

pub(crate) use pool::for_each_index;
pub use pool::park_helpers;
#[cfg(test)]
pub(crate) use verify::Gen;

use crate::safetensors::Dtype;

/// FP4 E2M1 values by nibble; bit 3 is the sign.
pub const FP4_LUT: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The value of an E8M0 scale byte, `2^(s - 127)`, as Transformers' `ldexp` computes it:
/// 0 gives 2^-127 (a subnormal), 255 gives +inf (the OCP spec calls it NaN).
#[inline]
pub fn e8m0_to_f32(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::INFINITY,
        s => f32::from_bits((s as u32) << 23),
    }
}

/// One MXFP4 element, dequantised (the reference the kernels are tested against).
pub fn mxfp4_value(nibble: u8, scale: u8) -> f32 {
    let v = FP4_LUT[(nibble & 15) as usize];
    if v == 0.0 {
        v
    } else {
        v * e8m0_to_f32(scale)
    }
}

/// Widens element `i` of a bf16 slice.
#[inline]
pub fn bf16_at(b: &[u8], i: usize) -> f32 {
    scalar::bf16_to_f32(b[2 * i], b[2 * i + 1])
}

/// Widens element `i` of an f16 slice.
#[inline]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    scalar::f16_to_f32(b[2 * i], b[2 * i + 1])
}

/// Widens element `i` of an f32 slice.
#[inline]
pub fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Element formats of dense weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Float {
    /// f32.
    F32,
    /// bf16.
    BF16,
    /// f16.
    F16,
}

impl Float {
    /// From a safetensors dtype, if it is a float format the kernels take.
    pub fn from_dtype(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F32 => Some(Self::F32),
            Dtype::BF16 => Some(Self::BF16),
            Dtype::F16 => Some(Self::F16),
            _ => None,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 | Self::F16 => 2,
        }
    }
    fn widen_fn(self) -> fn(&[u8], usize) -> f32 {
        match self {
            Self::F32 => f32_at,
            Self::BF16 => bf16_at,
            Self::F16 => f16_at,
        }
    }
    /// Widens element `i` of `b`.
    #[inline]
    pub fn at(self, b: &[u8], i: usize) -> f32 {
        (self.widen_fn())(b, i)
    }
    /// Widens all of `b` into `out`.
    pub fn widen_into(self, b: &[u8], out: &mut [f32]) {
        debug_assert_eq!(b.len(), out.len() * self.size());
        let f = self.widen_fn();
        for (i, o) in out.iter_mut().enumerate() {
            *o = f(b, i);
        }
    }
}

/// A vector of weights (bias, norm, sinks) in its stored format.
#[derive(Clone, Copy, Debug)]
pub struct Vector<'a> {
    /// Element format.
    pub fmt: Float,
    /// Little-endian bytes.
    pub bytes: &'a [u8],
}

impl Vector<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.fmt.size()
    }
    /// True if empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// Element `i`, widened.
    #[inline]
    pub fn at(&self, i: usize) -> f32 {
        self.fmt.at(self.bytes, i)
    }
    /// `y[i] += self[i]`.
    pub fn add_to(&self, y: &mut [f32]) {
        for (i, v) in y.iter_mut().enumerate() {
            *v += self.at(i);
        }
    }
}

/// A weight matrix by reference, in its stored format. `rows` is the output width and `cols`
/// the input width whatever the storage orientation.
#[derive(Clone, Copy, Debug)]
pub enum Mat<'a> {
    /// Row-major `[rows, cols]` (nn.Linear orientation).
    Dense {
        /// Element format.
        fmt: Float,
        /// Bytes.
        bytes: &'a [u8],
        /// Output width.
        rows: usize,
        /// Input width.
        cols: usize,
    },
    /// Row-major `[cols, rows]`: stored input-major, as Transformers saves GPT-OSS experts.
    DenseT {
        /// Element format.
        fmt: Float,
        /// Bytes.
        bytes: &'a [u8],
        /// Output width.
        rows: usize,
        /// Input width.
        cols: usize,
    },
    /// Row-scaled 8-bit integers (the opt-in approximate format for attention and head
    /// weights): element `(r, c)` is `q[r * cols + c] as i8 * scales[r]`.
    Q8 {
        /// Row-major `[rows, cols]` two's-complement bytes.
        q: &'a [u8],
        /// One scale per row.
        scales: &'a [f32],
        /// Output width.
        rows: usize,
        /// Input width.
        cols: usize,
    },
    /// MXFP4: `blocks` `[rows, cols/32, 16]`, `scales` `[rows, cols/32]`.
    Mxfp4 {
        /// Packed nibbles.
        blocks: &'a [u8],
        /// E8M0 scales.
        scales: &'a [u8],
        /// Output width.
        rows: usize,
        /// Input width.
        cols: usize,
    },
    /// The same MXFP4 weights multiplied by int8-quantized inputs (blocks of 32 inputs rounded
    /// to int8 with one scale each; products summed in integers). The opt-in approximate
    /// `--int8-experts` path; see `int8x`.
    Mxfp4Int8 {
        /// Packed nibbles.
        blocks: &'a [u8],
        /// E8M0 scales.
        scales: &'a [u8],
        /// Output width.
        rows: usize,
        /// Input width.
        cols: usize,
    },
}

// ---- element codes and scale tables shared by the SIMD ISAs ----

/// Element-format codes for const-generic kernels.
pub(crate) const F32: u8 = 0;
/// bf16.
pub(crate) const BF16: u8 = 1;
/// f16.
pub(crate) const F16: u8 = 2;
/// int8 (the row-scaled [`Mat::Q8`] format; kernels sum raw integers times inputs and apply
/// the row's scale to the sum).
pub(crate) const I8: u8 = 3;

/// Bytes per element of a format code.
#[inline(always)]
pub(crate) const fn code_size(code: u8) -> usize {
    match code {
        F32 => 4,
        I8 => 1,
        _ => 2,
    }
}

const fn e8m0_const(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::INFINITY,
        s => f32::from_bits((s as u32) << 23),
    }
}

const fn scale_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut s = 0;
    while s < 256 {
        t[s] = e8m0_const(s as u8);
        s += 1;
    }
    t
}

/// [`e8m0_to_f32`] by byte.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(crate) static SCALE: [f32; 256] = scale_table();

// ---- ISAs and dispatch ----

/// An instruction set the kernels are written for (`STORMO_SIMD` names one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Portable reference kernels.
    Scalar,
    /// AArch64 NEON (Advanced SIMD).
    Neon,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F and BW (plus AVX2 + FMA + F16C).
    Avx512,
}

impl Isa {
    /// Every ISA, lowest first (a CPU runs scalar and the ISAs of its own architecture).
    pub const ALL: [Self; 4] = [Self::Scalar, Self::Neon, Self::Avx2, Self::Avx512];

    /// The name `STORMO_SIMD` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Neon => "neon",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }

    /// Parses an ISA name (`scalar`, `neon`, `avx2`, `avx512`).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
    }

    /// True if this CPU runs the ISA's instructions.
    pub fn is_native(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => avx2::supported(),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => avx512::supported(),
            #[cfg(target_arch = "aarch64")]
            Self::Neon => neon::supported(),
            _ => false,
        }
    }

    /// True if the ISA can run here: natively, or (in tests and with the `emulated-avx512`
    /// feature) the AVX-512 ISA in software on an AVX2 CPU, much slower, never chosen by
    /// [`Isa::detected`].
    pub fn is_supported(self) -> bool {
        self.is_native() || self.is_emulated()
    }

    /// True if the ISA runs here only in software emulation (see [`Isa::is_supported`]).
    pub fn is_emulated(self) -> bool {
        #[cfg(all(target_arch = "x86_64", any(test, feature = "emulated-avx512")))]
        if self == Self::Avx512 && !self.is_native() {
            return avx512_emulated::supported();
        }
        false
    }

    /// The best ISA this CPU runs natively.
    pub fn detected() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|t| t.is_native())
            .unwrap_or(Self::Scalar)
    }

    /// Every ISA this CPU runs natively, lowest first.
    pub fn native() -> Vec<Self> {
        Self::ALL.into_iter().filter(|t| t.is_native()).collect()
    }

    /// Every ISA this CPU runs (emulated ones included), lowest first.
    pub fn available() -> Vec<Self> {
        Self::ALL.into_iter().filter(|t| t.is_supported()).collect()
    }

    /// The process-wide ISA: [`Isa::detected`], lowered by `STORMO_SIMD` if set, then by
    /// one ISA at a time while it fails its self-check (a few small products of every exact
    /// weight format against an f64 reference, a few milliseconds; a failure is logged as a
    /// warning). Decided once, on first use.
    pub fn process() -> Self {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let simd = std::env::var("STORMO_SIMD").ok();
            let (isa, warnings) = decide(simd.as_deref(), Self::detected(), self_check);
            for w in warnings {
                tracing::warn!("{w}");
            }
            tracing::debug!(isa = isa.name(), "kernel instruction set");
            isa
        })
    }

    /// The ISA kernels called from this thread use: the innermost [`with_isa`], else
    /// [`Isa::process`].
    pub fn active() -> Self {
        FORCED.with(Cell::get).unwrap_or_else(Self::process)
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The ISA a `STORMO_SIMD` value selects on a CPU whose best ISA is `best`, and a warning if
/// the value could not be honoured as given.
fn resolve(value: &str, best: Isa) -> (Isa, Option<String>) {
    if value.trim().is_empty() || value.trim().eq_ignore_ascii_case("auto") {
        return (best, None);
    }
    match Isa::parse(value) {
        Some(t) if t <= best && t.is_native() => (t, None),
        Some(t) => (
            best,
            Some(format!(
                "STORMO_SIMD={value}: this CPU does not support {t}; using {best}"
            )),
        ),
        None => (
            best,
            Some(format!(
                "STORMO_SIMD={value}: unknown instruction set (expected scalar, neon, avx2, avx512 or auto); \
                 using {best}"
            )),
        ),
    }
}

/// The process-wide ISA on a CPU whose best is `best`, given `STORMO_SIMD`'s value (if set)
/// and a self-check (`check`): the requested ISA, lowered while it fails the check; with the
/// warnings to log.
fn decide(
    simd: Option<&str>,
    best: Isa,
    check: impl Fn(Isa) -> Result<(), String>,
) -> (Isa, Vec<String>) {
    let (want, note) = simd.map_or((best, None), |v| resolve(v, best));
    let (isa, mut warnings) = verify::first_passing(want, check);
    warnings.splice(0..0, note);
    (isa, warnings)
}

/// [`verify::self_check`] of `ISA`, on a one-thread pool of its own: it runs while
/// [`Isa::process`] is being decided, when threads of the global pool may be waiting for that
/// decision.
fn self_check(isa: Isa) -> Result<(), String> {
    match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
        Ok(pool) => pool.install(|| verify::self_check(isa)),
        Err(e) => {
            tracing::debug!("no thread for the kernel self-check ({e}); running it here");
            verify::self_check(isa)
        }
    }
}

thread_local! {
    static FORCED: Cell<Option<Isa>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's kernel calls forced to `ISA` (work they hand to the kernels' helpers
/// uses the same ISA). Nests; restores the previous ISA afterwards, even on panic.
///
/// # Panics
/// If this CPU does not support `ISA` (see [`Isa::available`]).
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(
        isa.is_supported(),
        "this CPU does not support the {isa} instruction set"
    );
    struct Restore(Option<Isa>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(isa))));
    f()
}

/// The CPU as CPUID names it: vendor, family and model (family and model with their extended
/// fields added in, as the vendors' manuals define them). `None` off x86-64.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuId {
    /// The vendor string, e.g. `GenuineIntel` or `AuthenticAMD`.
    pub vendor: String,
    /// The family, e.g. 25 for AMD's Zen 3 and Zen 4, 26 for Zen 5, 6 for Intel's cores.
    pub family: u32,
    /// The model within the family.
    pub model: u32,
}

impl CpuId {
    /// This CPU.
    pub fn get() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid;
            let (l0, l1) = (__cpuid(0), __cpuid(1));
            let vendor: Vec<u8> = [l0.ebx, l0.edx, l0.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            Some(Self::from_signature(
                String::from_utf8_lossy(&vendor).into_owned(),
                l1.eax,
            ))
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    }

    /// The family and model encoded in CPUID leaf 1's EAX.
    fn from_signature(vendor: String, eax: u32) -> Self {
        let base = (eax >> 8) & 0xf;
        let family = if base == 0xf {
            base + ((eax >> 20) & 0xff)
        } else {
            base
        };
        let mut model = (eax >> 4) & 0xf;
        if base == 0x6 || base == 0xf {
            model |= ((eax >> 16) & 0xf) << 4;
        }
        Self {
            vendor,
            family,
            model,
        }
    }

    /// True for AMD's family 25 (Zen 3 and Zen 4; of those only Zen 4 runs the AVX-512 ISA).
    pub fn is_zen4_family(&self) -> bool {
        self.vendor == "AuthenticAMD" && self.family == 25
    }
}

/// Column slabs ahead that the prefill kernels' slab walks ([`prefetch_slab_ahead`]) prefetch.
#[cfg(target_arch = "x86_64")]
const SLABS_AHEAD: usize = 2;

/// For the multi-position MXFP4 kernels that walk a matrix in groups of `rows` rows and, within
/// a group, in column slabs of `slab` blocks (`avx512::mxfp4_fused`, and the AVX2 kernels):
/// at slab `b0` (its first block) of the group starting at row `g0` (of `r0 .. r0 + n`), asks
/// for every line of the slab [`SLABS_AHEAD`] ahead in that walk (the next group's first slabs
/// near a group's end) of every row, into L2. The walk jumps between rows, so the hardware
/// prefetchers do not follow it, and L1 is full of the inputs and accumulators. On Zen 4 (one
/// thread, weights streamed from memory as a prefill's experts are) this made the AVX-512 kernel
/// 1.05-1.19x as fast at 2 to 32 positions (the AVX2 kernels level, or up to 1.07x at 8), and a
/// 24-layer prefill's experts 1.05-1.06x, where one line of each row's slab after next into L1
/// was what the kernels had (docs/performance.md, "The weights' arrival").
///
/// A safe function: a prefetch is a hint that never faults, so addresses past the matrix
/// (`wrapping_add`) are harmless.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn prefetch_slab_ahead(
    bb: *const u8,
    nb: usize,
    r0: usize,
    n: usize,
    g0: usize,
    rows: usize,
    b0: usize,
    slab: usize,
) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let slabs = nb.div_ceil(slab);
    let (mut tg, mut ts) = (g0, b0 / slab + SLABS_AHEAD);
    if ts >= slabs {
        (tg, ts) = (g0 + rows, ts - slabs);
    }
    let tb = ts * slab;
    let bytes = 16 * slab.min(nb.saturating_sub(tb));
    if bytes == 0 {
        return;
    }
    for i in 0..rows.min(n.saturating_sub(tg)) {
        let at = bb.wrapping_add((r0 + tg + i) * nb * 16 + 16 * tb);
        // Every line the slab's bytes touch: from its first byte, 64 apart, and its last.
        let mut o = 0;
        while o < bytes + 63 {
            // SAFETY: a prefetch is a hint: it never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(o.min(bytes - 1)) as *const i8) };
            o += 64;
        }
    }
}

/// The AVX-512 decode kernels' default prefetch distance on `cpu`, chosen by paired
/// measurement (`stormo bench --pair-prefetch A,B`: decoded tokens alternate between two
/// distances in one process, so the host's drifting memory speed hits both alike): 512 bytes
/// on Zen 4 (6-8% faster than 1 or 2 KiB, 6% faster than none, 2% faster than 256 bytes at
/// gpt-oss-20b geometry), 2 KiB elsewhere (5-7% faster than 512 bytes on Zen 5 and on the
/// Xeon). docs/performance.md has the runs.
pub fn default_prefetch_ahead(cpu: Option<&CpuId>) -> usize {
    match cpu {
        Some(c) if c.is_zen4_family() => 512,
        _ => 2048,
    }
}

/// How many bytes ahead in each of its weight streams the AVX-512 ISA's one-position (decode)
/// kernels prefetch: [`default_prefetch_ahead`] for this CPU unless [`set_prefetch_ahead`]
/// changed it (0 off x86-64, where there is no such ISA). The other ISAs prefetch the next rows
/// instead and ignore this.
pub fn prefetch_ahead() -> usize {
    #[cfg(target_arch = "x86_64")]
    return avx512::ahead();
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Sets [`prefetch_ahead`] for the whole process (a hint: any value is safe, and results do not
/// depend on it). For measuring, as `stormo bench --pair-prefetch` does.
pub fn set_prefetch_ahead(bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    avx512::set_ahead(bytes);
    #[cfg(all(target_arch = "x86_64", any(test, feature = "emulated-avx512")))]
    avx512_emulated::set_ahead(bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Output slices, one per position, for input-major kernels.
pub(crate) type Outs<'a> = [&'a mut [f32]];

/// Panics unless a row kernel's arguments are in bounds (the SIMD ISAs read through raw
/// pointers after this check).
pub(crate) fn check_rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &[f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert!(r0 + n <= rows, "kernel rows {r0}+{n} beyond {rows}");
    assert!(
        xs.len() >= p * cols,
        "kernel input holds fewer than {p} positions"
    );
    assert!(
        out.len() >= p * n,
        "kernel output holds fewer than {p} x {n}"
    );
    assert!(
        p <= MAX_POSITIONS,
        "kernel takes at most {MAX_POSITIONS} positions"
    );
    match *w {
        Mat::Dense { fmt, bytes, .. } => {
            assert!(
                bytes.len() >= rows * cols * fmt.size(),
                "dense weights too short"
            )
        }
        Mat::Q8 { q, scales, .. } => {
            assert!(q.len() >= rows * cols, "int8 weights too short");
            assert!(scales.len() >= rows, "int8 row scales too short");
        }
        Mat::Mxfp4 { blocks, scales, .. } | Mat::Mxfp4Int8 { blocks, scales, .. } => {
            assert_eq!(cols % 32, 0, "MXFP4 width {cols} is not a multiple of 32");
            assert!(blocks.len() >= rows * cols / 2, "MXFP4 blocks too short");
            assert!(scales.len() >= rows * cols / 32, "MXFP4 scales too short");
        }
        Mat::DenseT { .. } => panic!("row kernels do not take input-major weights"),
    }
}

/// Panics unless an input-major kernel's arguments are in bounds.
pub(crate) fn check_cols_t(w: &Mat<'_>, o0: usize, n: usize, xs: &[f32], outs: &Outs<'_>) {
    let Mat::DenseT {
        fmt,
        bytes,
        rows,
        cols,
    } = *w
    else {
        panic!("input-major kernels take only DenseT weights")
    };
    assert!(o0 + n <= rows, "kernel columns {o0}+{n} beyond {rows}");
    assert!(
        bytes.len() >= rows * cols * fmt.size(),
        "input-major weights too short"
    );
    assert!(
        xs.len() >= outs.len() * cols,
        "kernel input holds too few positions"
    );
    assert!(outs.iter().all(|o| o.len() >= n), "kernel output too short");
}

/// Row kernel of `ISA`: rows `r0 .. r0 + n`, `p <= 4` positions, `out` `[p, n]`.
fn rows_in(isa: Isa, w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    if let Mat::Mxfp4Int8 { .. } = w {
        return int8x::rows(isa, w, r0, n, xs, p, out);
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::rows(w, r0, n, xs, p, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            #[cfg(any(test, feature = "emulated-avx512"))]
            if Isa::Avx512.is_emulated() {
                return avx512_emulated::rows(w, r0, n, xs, p, out);
            }
            avx512::rows(w, r0, n, xs, p, out)
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::rows(w, r0, n, xs, p, out),
        _ => scalar::rows(w, r0, n, xs, p, out),
    }
}

/// Input-major kernel of `ISA`: output columns `o0 .. o0 + n` for `outs.len()` positions.
fn cols_t_in(isa: Isa, w: &Mat<'_>, o0: usize, n: usize, xs: &[f32], outs: &mut Outs<'_>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::cols_t(w, o0, n, xs, outs),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            #[cfg(any(test, feature = "emulated-avx512"))]
            if Isa::Avx512.is_emulated() {
                return avx512_emulated::cols_t(w, o0, n, xs, outs);
            }
            avx512::cols_t(w, o0, n, xs, outs)
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::cols_t(w, o0, n, xs, outs),
        _ => scalar::cols_t(w, o0, n, xs, outs),
    }
}

/// Bytes of weights below which a call stays on the calling thread (waking the pool costs
/// more than reading this much).
const SERIAL_BYTES: usize = 96 << 10;
/// Smallest share of weights worth handing to another thread.
const MIN_TASK_BYTES: usize = 24 << 10;

/// Tasks per thread a parallel product is split into unless [`set_tasks_per_thread`] changed
/// it.
pub const DEFAULT_TASKS_PER_THREAD: usize = 6;

static TASKS_PER_THREAD: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(DEFAULT_TASKS_PER_THREAD);

/// How many tasks per thread a parallel call's weights are split into
/// ([`DEFAULT_TASKS_PER_THREAD`] unless [`set_tasks_per_thread`] changed it).
pub fn tasks_per_thread() -> usize {
    TASKS_PER_THREAD.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets [`tasks_per_thread`] for the whole process (at least 1; results do not depend on it,
/// only the balance between threads does). For measuring, as `stormo bench --pair-tasks`
/// does.
pub fn set_tasks_per_thread(n: usize) {
    TASKS_PER_THREAD.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
}

/// How many tasks to split `bytes` of weights into: one if small, else enough for every
/// thread to take several (so a slow or busy core does not hold the others up).
fn tasks_for(bytes: usize) -> usize {
    let threads = rayon::current_num_threads();
    if threads <= 1 || bytes < SERIAL_BYTES {
        1
    } else {
        (threads * tasks_per_thread())
            .min(bytes / MIN_TASK_BYTES)
            .max(threads)
    }
}

impl Mat<'_> {
    /// Output width.
    pub fn rows(&self) -> usize {
        match *self {
            Self::Dense { rows, .. }
            | Self::DenseT { rows, .. }
            | Self::Q8 { rows, .. }
            | Self::Mxfp4 { rows, .. }
            | Self::Mxfp4Int8 { rows, .. } => rows,
        }
    }
    /// Input width.
    pub fn cols(&self) -> usize {
        match *self {
            Self::Dense { cols, .. }
            | Self::DenseT { cols, .. }
            | Self::Q8 { cols, .. }
            | Self::Mxfp4 { cols, .. }
            | Self::Mxfp4Int8 { cols, .. } => cols,
        }
    }
    /// Bytes of weights the matrix occupies.
    pub fn byte_len(&self) -> usize {
        match *self {
            Self::Dense { bytes, .. } | Self::DenseT { bytes, .. } => bytes.len(),
            Self::Q8 { q, scales, .. } => q.len() + 4 * scales.len(),
            Self::Mxfp4 { blocks, scales, .. } | Self::Mxfp4Int8 { blocks, scales, .. } => {
                blocks.len() + scales.len()
            }
        }
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match *self {
            Self::Dense {
                fmt, bytes, cols, ..
            } => {
                let s = fmt.size();
                fmt.widen_into(&bytes[r * cols * s..(r + 1) * cols * s], out)
            }
            Self::DenseT {
                fmt, bytes, rows, ..
            } => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = fmt.at(bytes, i * rows + r);
                }
            }
            Self::Q8 {
                q, scales, cols, ..
            } => {
                for (o, &b) in out.iter_mut().zip(&q[r * cols..(r + 1) * cols]) {
                    *o = b as i8 as f32 * scales[r];
                }
            }
            Self::Mxfp4 {
                blocks,
                scales,
                cols,
                ..
            }
            | Self::Mxfp4Int8 {
                blocks,
                scales,
                cols,
                ..
            } => {
                let nb = cols / 32;
                for (k, o) in out.iter_mut().enumerate() {
                    let b = blocks[r * nb * 16 + k / 2];
                    let nib = if k % 2 == 0 { b & 15 } else { b >> 4 };
                    *o = mxfp4_value(nib, scales[r * nb + k / 32]);
                }
            }
        }
    }
}

/// The machine's floating-point peak for `ISA`'s kernels, in FLOP/s: every thread of the
/// rayon pool at once runs independent fused multiply-adds on registers (f32 lanes of the
/// ISA's vector width; the scalar ISA's `mul_add`) for about `seconds`; the best of three
/// such rounds (a ceiling: a busy host only lowers it). Kernel rates in `stormo bench` are
/// reported against it (the higher of a measurement before and one after the timed work).
///
/// # Panics
/// If this CPU does not run `ISA` natively (an emulated ISA has no meaningful peak).
pub fn peak_flops(isa: Isa, seconds: f64) -> f64 {
    park_helpers();
    assert!(isa.is_native(), "this CPU does not run {isa} natively");
    (0..3)
        .map(|_| peak_round(isa, seconds / 3.0))
        .fold(0.0, f64::max)
}

/// One round of [`peak_flops`].
fn peak_round(isa: Isa, seconds: f64) -> f64 {
    burst_rate(seconds, || match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::fma_burst(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::fma_burst(),
        _ => scalar::fma_burst(),
    })
}

/// Operations a second of `burst` (which returns the operations it did) on every thread of
/// the rayon pool at once, for about `seconds`.
fn burst_rate(seconds: f64, burst: impl Fn() -> f64 + Sync) -> f64 {
    let per_thread: Vec<f64> = rayon::broadcast(|_| {
        let mut ops = 0f64;
        let start = std::time::Instant::now();
        while start.elapsed().as_secs_f64() < seconds {
            ops += burst();
        }
        ops / start.elapsed().as_secs_f64()
    });
    per_thread.iter().sum()
}

/// The machine's peak for the `--int8-experts` path's dot-product step on `ISA`, in integer
/// operations a second (two per 8-bit product, so comparable with [`peak_flops`]): every
/// thread of the rayon pool runs the step the int8 kernel uses (`vpdpbusd` with AVX-512 VNNI,
/// `vpmaddubsw` and `vpmaddwd` without) on registers, the best of three rounds of about
/// `seconds / 3`. `None` where that path has no x86 SIMD kernel (NEON, scalar).
///
/// # Panics
/// If this CPU does not run `ISA` natively.
pub fn peak_int8_ops(isa: Isa, seconds: f64) -> Option<f64> {
    park_helpers();
    assert!(isa.is_native(), "this CPU does not run {isa} natively");
    int8x::dot_burst(isa)?;
    Some(
        (0..3)
            .map(|_| burst_rate(seconds / 3.0, || int8x::dot_burst(isa).unwrap_or(0.0)))
            .fold(0.0, f64::max),
    )
}

/// `y = W·x` for one position, with the thread's [`Isa::active`] kernels.
pub fn matvec(w: &Mat<'_>, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols(), "matvec input width");
    assert_eq!(y.len(), w.rows(), "matvec output width");
    matmul_in(Isa::active(), w, x, y)
}

/// Some rows of `W·x` for one position: `y[i]` is row `rows[i]` of what [`matvec`] gives,
/// bit for bit (every row kernel computes each row on its own, whatever rows share its call;
/// `verify::check_mat` checks it for every ISA). For a few rows of a large matrix (the
/// screened output head), on the calling thread.
///
/// # Panics
/// If `w` is input-major ([`Mat::DenseT`]), a row is out of range, or the lengths disagree.
pub fn matvec_rows(w: &Mat<'_>, rows: &[usize], x: &[f32], y: &mut [f32]) {
    matvec_rows_in(Isa::active(), w, rows, x, y)
}

fn matvec_rows_in(isa: Isa, w: &Mat<'_>, rows: &[usize], x: &[f32], y: &mut [f32]) {
    assert!(
        !matches!(w, Mat::DenseT { .. }),
        "matvec_rows takes row-major matrices"
    );
    assert_eq!(x.len(), w.cols(), "matvec_rows input width");
    assert_eq!(y.len(), rows.len(), "matvec_rows output length");
    if rows.is_empty() {
        return;
    }
    if w.cols() == 0 {
        return y.fill(0.0);
    }
    // The thread's reused input buffer (a decoded token allocates nothing here).
    let mut buf = ROW_INPUTS.take();
    let x = match Arrange::of(isa, w, x) {
        Some(a) => {
            let at = a.apply(x, &mut buf);
            &buf[at]
        }
        None => x,
    };
    for (&r, out) in rows.iter().zip(y) {
        assert!(r < w.rows(), "row {r} of a matrix of {} rows", w.rows());
        rows_in(isa, w, r, 1, x, 1, std::slice::from_mut(out));
    }
    ROW_INPUTS.set(buf);
}

/// Rearranges kernel inputs (`xs` into `out`, same length).
type Permute = fn(&[f32], &mut [f32]);

/// `xs` (blocks of 32) into `out` with element `order[k]` of each block at its place `k`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the x86 ISAs permute
fn permute_blocks(order: &[usize; 32], xs: &[f32], out: &mut [f32]) {
    for (o, x) in out.chunks_exact_mut(32).zip(xs.chunks_exact(32)) {
        for (d, &k) in o.iter_mut().zip(order) {
            *d = x[k];
        }
    }
}

/// How `ISA`'s MXFP4 kernels want their inputs arranged within each block of 32, if not in
/// element order.
fn mxfp4_input_order(isa: Isa) -> Option<Permute> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(avx2::mxfp4_permute),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(avx512::mxfp4_permute),
        _ => None,
    }
}

/// Bytes of a cache line: the x86 kernels' inputs start on one, so that no vector load of them
/// straddles two lines. A straddling 64-byte load costs two loads' time on Zen 5, and the
/// MXFP4 decode kernel loads two vectors of inputs per block for every four rows: with its
/// inputs 16 bytes off a line it read 10-14% slower on one thread (README, Zen 5).
const LINE: usize = 64;

/// Whether `ISA` loads its inputs in vectors of 32 or 64 bytes, which straddle cache lines
/// unless the inputs start on one (the allocator aligns to 16 bytes).
fn wide_loads(isa: Isa) -> bool {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => true,
        _ => false,
    }
}

/// Where [`Arrange::apply`] put the inputs in `buf`: its first element on a cache line.
fn line_start(buf: &[f32]) -> usize {
    buf.as_ptr().align_offset(LINE).min(LINE / 4)
}

/// How `ISA`'s kernels for a matrix want their inputs, when not as given.
#[derive(Clone, Copy)]
enum Arrange {
    /// Permuted within each block of 32 (MXFP4 on ISAs that decode out of element order).
    Permute(Permute),
    /// Quantized as [`int8x::quantize`] lays them out, rows of `cols` inputs.
    Quantize(usize),
    /// Copied as they are, to start on a cache line (inputs that do not).
    Align,
}

impl Arrange {
    /// The arrangement `ISA`'s kernels want for `w`'s inputs (`None`: as given).
    fn of(isa: Isa, w: &Mat<'_>, xs: &[f32]) -> Option<Self> {
        match *w {
            Mat::Mxfp4 { .. } => mxfp4_input_order(isa).map(Arrange::Permute),
            Mat::Mxfp4Int8 { cols, .. } => Some(Self::Quantize(cols)),
            _ => (wide_loads(isa) && !xs.as_ptr().cast::<u8>().addr().is_multiple_of(LINE))
                .then_some(Self::Align),
        }
    }

    /// `xs` arranged into `buf` (grown to fit), starting on a cache line: the slice returned.
    /// What `buf` held before is not cleared (zeroing it cost more than quantizing into it):
    /// a permutation or a copy writes every slot, and [`int8x::quantize`] every slot the
    /// kernels read.
    fn apply(self, xs: &[f32], buf: &mut Vec<f32>) -> std::ops::Range<usize> {
        if buf.len() < xs.len() + LINE / 4 {
            buf.resize(xs.len() + LINE / 4, 0.0);
        }
        let at = line_start(buf);
        let out = &mut buf[at..at + xs.len()];
        match self {
            Self::Permute(permute) => permute(xs, out),
            Self::Quantize(cols) => int8x::quantize(xs, cols, out),
            Self::Align => out.copy_from_slice(xs),
        }
        at..at + xs.len()
    }
}

thread_local! {
    /// Reused buffers for arranged kernel inputs, one per product of a batch (taken while in
    /// use, so a nested call on the same thread gets fresh ones instead of a conflict).
    static INPUTS: Cell<Vec<Vec<f32>>> = const { Cell::new(Vec::new()) };
    /// [`matvec_rows`]' arranged input (taken while in use).
    static ROW_INPUTS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// A prefill tile's outputs before they are scattered to their positions (8 KiB, kept by
    /// each thread instead of set up on the stack for every tile; taken while in use).
    static TILE_OUT: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Positions a prefill kernel call takes at once (each weight row is read once per group).
const GROUP: usize = 4;
/// Most positions any row kernel takes (see [`group_for`]; the row-lane VNNI kernel takes
/// this many).
const MAX_POSITIONS: usize = 64;
/// Positions past which a product's work, for splitting it among tasks, counts no more (the
/// weights are read about once per this many).
const WORK_POSITIONS: usize = 32;

/// Positions per row-kernel call for `w` on `ISA`: more where decoding the weights costs
/// more than the multiply-adds (MXFP4 on AVX2, AVX-512 and NEON).
fn group_for(isa: Isa, w: &Mat<'_>) -> usize {
    match (isa, w) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Mat::Mxfp4 { .. }) => avx2::MXFP4_POSITIONS,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Mat::Mxfp4 { .. }) => avx512::POSITIONS,
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Mat::Mxfp4 { .. }) => neon::MXFP4_POSITIONS,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512, Mat::Mxfp4Int8 { .. }) => int8x::positions(isa),
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Mat::Mxfp4Int8 { .. }) => int8x::positions(isa),
        _ => GROUP,
    }
}
/// Most rows in one prefill tile.
const MAX_TILE: usize = 64;

/// Bytes of weights a prefill tile aims for (re-read from L1/L2 for every position group).
const TILE_BYTES: usize = 24 << 10;

/// Rows of a prefill tile of `w` (rows of `row_bytes`) on `ISA`, before the split among
/// threads: a multiple of 4 in `4 ..= MAX_TILE`.
fn tile_rows(isa: Isa, w: &Mat<'_>, row_bytes: usize) -> usize {
    match (isa, w) {
        // The AVX2 MXFP4 kernel takes all of a tile's positions (up to 32) in one call and reads
        // each weight once, so its tile need not stay in cache between groups; the largest lets
        // each slab of inputs, once in L1, meet the most rows (measured paired in one `stormo
        // bench` run: 64-row tiles against 16-row ones, 128-token prefill 7-17% faster). The
        // AVX-512 and NEON kernels have the same structure (AVX-512 with 32-row accumulator
        // groups; not measured: neither runs here). The int8-input kernels for 1-8 positions
        // copy each position's last partial group of blocks once per call, which a larger tile
        // shares among more rows (Zen 4, one thread, 2880 x 2880: 64-row tiles 7-10% faster
        // than 16-row ones at 8 and 64 positions; `kernel_min mxfp4-int8`, measured before
        // the row-lane VNNI kernel, which decodes 16 rows at a time and so runs four such
        // tiles per task, the next one's rows prefetched while one runs).
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512, Mat::Mxfp4 { .. } | Mat::Mxfp4Int8 { .. }) => MAX_TILE,
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Mat::Mxfp4 { .. } | Mat::Mxfp4Int8 { .. }) => MAX_TILE,
        _ => (TILE_BYTES / row_bytes).clamp(4, MAX_TILE) / 4 * 4,
    }
}

/// `ys[t] = W·xs[t]` for `t` positions; `xs` is `[t, cols]`, `ys` is `[t, rows]`, row-major.
/// Each output equals what [`matvec`] gives for that position alone, bit for bit, and what any
/// other ISA gives.
pub fn matmul(w: &Mat<'_>, xs: &[f32], ys: &mut [f32]) {
    matmul_in(Isa::active(), w, xs, ys)
}

fn matmul_in(isa: Isa, w: &Mat<'_>, xs: &[f32], ys: &mut [f32]) {
    batch_in(isa, &mut [Product { w: *w, xs, ys }])
}

/// One product of a [`matmul_batch`]: `ys = W·xs` over `t` positions, shaped as for
/// [`matmul`].
#[derive(Debug)]
pub struct Product<'a> {
    /// The weights.
    pub w: Mat<'a>,
    /// Inputs `[t, cols]`.
    pub xs: &'a [f32],
    /// Outputs `[t, rows]`.
    pub ys: &'a mut [f32],
}

impl Product<'_> {
    /// A product of nothing (fills unused slots of a batch).
    fn empty() -> Self {
        Product {
            w: Mat::Dense {
                fmt: Float::F32,
                bytes: &[],
                rows: 0,
                cols: 0,
            },
            xs: &[],
            ys: &mut [],
        }
    }
}

/// Most products one parallel region of [`matmul_batch`] takes (more run in several).
const MAX_BATCH: usize = 16;

/// Elements of element-wise work below which it stays on the calling thread (a decoded
/// token's: handing it to the pool would cost more than it saves); a prefill block's goes to
/// the pool, so one core does not idle between parallel regions.
pub(crate) const PARALLEL_ELEMENTS: usize = 1 << 16;

/// `f(i, &mut items[i])` for every item: on the pool's threads when `work` (elements) reaches
/// [`PARALLEL_ELEMENTS`], else on this one. The calls are independent, so every value is the
/// same either way.
pub(crate) fn each_mut<T: Send>(items: &mut [T], work: usize, f: impl Fn(usize, &mut T) + Sync) {
    if work >= PARALLEL_ELEMENTS {
        let base = SendPtr(items.as_mut_ptr());
        // SAFETY: each index is run once, so each item is borrowed by one call only; `items`
        // outlives the loop.
        for_each_index(items.len(), |i| f(i, unsafe { &mut *base.at(i) }));
    } else {
        items.iter_mut().enumerate().for_each(|(i, x)| f(i, x));
    }
}

/// [`each_mut`] over the rows of `len` elements of `buf`.
pub(crate) fn each_row_mut(
    buf: &mut [f32],
    len: usize,
    work: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    if work >= PARALLEL_ELEMENTS {
        let (base, total) = (SendPtr(buf.as_mut_ptr()), buf.len());
        for_each_index(total.div_ceil(len), |i| {
            let n = len.min(total - i * len);
            // SAFETY: row `i` (the last may be short) is in bounds and run by one call only;
            // `buf` outlives the loop.
            f(i, unsafe {
                std::slice::from_raw_parts_mut(base.at(i * len), n)
            })
        });
    } else {
        buf.chunks_mut(len).enumerate().for_each(|(i, r)| f(i, r));
    }
}

/// Computes independent products in one parallel region: every output is what [`matmul`]
/// gives for its product alone, bit for bit, but the pool's threads are handed
/// work once for all of them, not once per matrix. Decode spends most of its time in a few
/// such groups (a layer's selected experts' projections): one region each saves the hand-offs,
/// and a thread done with one matrix moves on to the next instead of waiting at a barrier.
///
/// # Panics
/// If a product's input or output length does not fit its matrix (as [`matmul`]).
pub fn matmul_batch<'a>(products: impl IntoIterator<Item = Product<'a>>) {
    let isa = Isa::active();
    let mut products = products.into_iter().peekable();
    while products.peek().is_some() {
        let mut batch: [Product<'a>; MAX_BATCH] = std::array::from_fn(|_| Product::empty());
        let mut n = 0;
        for (slot, p) in batch.iter_mut().zip(products.by_ref()) {
            *slot = p;
            n += 1;
        }
        batch_in(isa, &mut batch[..n]);
    }
}

/// A product ready for the row kernels: inputs arranged, output rows split into tiles.
#[derive(Clone, Copy)]
struct Planned<'a> {
    w: Mat<'a>,
    xs: &'a [f32],
    ys: SendPtr<f32>,
    t: usize,
    /// Rows per task.
    tile: usize,
}

/// [`matmul_batch`] on one ISA, at most [`MAX_BATCH`] products.
fn batch_in(isa: Isa, ps: &mut [Product<'_>]) {
    debug_assert!(ps.len() <= MAX_BATCH);
    let mut t_of = [0usize; MAX_BATCH];
    // Where each product's task writes (taken while the outputs are borrowed mutably).
    let mut outs = [SendPtr(std::ptr::null_mut()); MAX_BATCH];
    for ((p, t), out) in ps.iter_mut().zip(&mut t_of).zip(&mut outs) {
        *out = SendPtr(p.ys.as_mut_ptr());
        let (rows, cols) = (p.w.rows(), p.w.cols());
        if cols == 0 {
            assert!(p.xs.is_empty(), "matmul input width");
            p.ys.fill(0.0);
            continue;
        }
        assert_eq!(p.xs.len() % cols, 0, "matmul input width");
        *t = p.xs.len() / cols;
        assert_eq!(p.ys.len(), *t * rows, "matmul output size");
        if let Mat::DenseT { .. } = p.w {
            // Input-major weights have their own column-band split.
            if rows > 0 && *t > 0 {
                dense_t_in(isa, &p.w, p.xs, p.ys, *t);
            }
            *t = 0;
        }
        if rows == 0 {
            *t = 0;
        }
    }
    // From here a product with `t == 0` has nothing left to compute.
    // Weights are read once per group of positions.
    let work = |p: &Product<'_>, t: usize| p.w.byte_len().saturating_mul(t.min(WORK_POSITIONS));
    let total: usize = ps.iter().zip(&t_of).map(|(p, &t)| work(p, t)).sum();
    if total == 0 {
        return;
    }
    let tasks = tasks_for(total);

    let mut bufs = INPUTS.take();
    if bufs.len() < ps.len() {
        bufs.resize_with(ps.len(), Vec::new);
    }
    let arrange = |i: usize| Arrange::of(isa, &ps[i].w, ps[i].xs).filter(|_| t_of[i] > 0);
    // A prefill block's inputs (a layer's experts' positions) are arranged on the pool's
    // threads, a decoded token's on this one.
    let arranged: usize = (0..ps.len())
        .filter(|&i| arrange(i).is_some())
        .map(|i| ps[i].xs.len())
        .sum();
    each_mut(&mut bufs[..ps.len()], arranged, |i, buf| {
        if let Some(a) = arrange(i) {
            a.apply(ps[i].xs, buf);
        }
    });
    let mut plans: [Option<Planned<'_>>; MAX_BATCH] = [None; MAX_BATCH];
    // `starts[i]`: the first task of product `i`; tasks are numbered across all products.
    let mut starts = [0usize; MAX_BATCH + 1];
    for i in 0..ps.len() {
        let p = &ps[i];
        let (t, rows) = (t_of[i], p.w.rows());
        let n_tiles = if t == 0 {
            0
        } else {
            // This product's share of the tasks, at least one.
            let share = (tasks * work(p, t)).div_ceil(total).max(1);
            let tile = if t == 1 {
                rows.div_ceil(share).next_multiple_of(4)
            } else {
                // Tiles small enough to stay in cache while every group of positions passes
                // over them, and enough of them for the product's share of the threads.
                let tile = tile_rows(isa, &p.w, (p.w.byte_len() / rows).max(1));
                if share > 1 {
                    tile.min(rows.div_ceil(share).next_multiple_of(4)).max(4)
                } else {
                    tile
                }
            }
            .min(rows);
            plans[i] = Some(Planned {
                w: p.w,
                xs: if arrange(i).is_some() {
                    let at = line_start(&bufs[i]);
                    &bufs[i][at..at + p.xs.len()]
                } else {
                    p.xs
                },
                ys: outs[i],
                t,
                tile,
            });
            rows.div_ceil(tile)
        };
        starts[i + 1] = starts[i] + n_tiles;
    }
    let n = ps.len();
    let run = |k: usize| {
        // The product task `k` belongs to: the one whose tasks end after `k` first.
        let i = starts[1..=n].partition_point(|&end| end <= k);
        let p = plans[i].expect("a product with tasks has a plan");
        run_tile(isa, &p, (k - starts[i]) * p.tile);
    };
    let all = starts[n];
    if tasks == 1 || all == 1 {
        (0..all).for_each(run);
    } else {
        for_each_index(all, run);
    }
    INPUTS.set(bufs);
}

/// Rows `r0 .. r0 + tile` (clipped to the matrix) of every position of a planned product.
fn run_tile(isa: Isa, p: &Planned<'_>, r0: usize) {
    let (rows, cols, t) = (p.w.rows(), p.w.cols(), p.t);
    let n = p.tile.min(rows - r0);
    if t == 1 {
        // SAFETY: tiles partition the rows of the product's output (`[rows]` for one
        // position), so `r0 .. r0 + n` is written by this task alone and lies within it; the
        // output outlives the batch's region.
        let out = unsafe { std::slice::from_raw_parts_mut(p.ys.get().add(r0), n) };
        rows_in(isa, &p.w, r0, n, p.xs, 1, out);
        return;
    }
    let group = group_for(isa, &p.w);
    let mut buf = TILE_OUT.take();
    buf.resize(MAX_POSITIONS * MAX_TILE, 0.0);
    for g in (0..t).step_by(group) {
        let q_n = group.min(t - g);
        rows_in(
            isa,
            &p.w,
            r0,
            n,
            &p.xs[g * cols..(g + q_n) * cols],
            q_n,
            &mut buf[..q_n * n],
        );
        for q in 0..q_n {
            // SAFETY: tiles partition the rows, so element `(g + q, r0 .. r0 + n)` is
            // written by this task alone, and `(g + q) * rows + r0 + n <= t * rows`, the
            // output's length; the output outlives the batch's region.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(p.ys.get().add((g + q) * rows + r0), n) };
            dst.copy_from_slice(&buf[q * n..(q + 1) * n]);
        }
    }
    TILE_OUT.set(buf);
}

/// `ys = W·xs` for input-major weights ([`Mat::DenseT`]), `t >= 1` positions: bands of
/// output columns, one per thread, each reading its part of every input row once per group
/// of positions (narrower bands would turn the stream into short strided reads).
fn dense_t_in(isa: Isa, w: &Mat<'_>, xs: &[f32], ys: &mut [f32], t: usize) {
    let (rows, cols) = (w.rows(), w.cols());
    let ptr = SendPtr(ys.as_mut_ptr());
    let work = w.byte_len().saturating_mul(t.min(WORK_POSITIONS));
    let tasks = tasks_for(work).min(rayon::current_num_threads());
    let chunk = rows.div_ceil(tasks).next_multiple_of(16).min(rows);
    let run = |c: usize| {
        let o0 = c * chunk;
        let n = chunk.min(rows - o0);
        for g in (0..t).step_by(GROUP) {
            let p = GROUP.min(t - g);
            // SAFETY: band `o0 .. o0 + n` of positions `g .. g + p`: bands partition the
            // columns, so no two tasks write the same element, and
            // `(g + q) * rows + o0 + n <= t * rows == ys.len()`; `ys` outlives the loop.
            let mut outs: [&mut [f32]; GROUP] = std::array::from_fn(|q| unsafe {
                if q < p {
                    std::slice::from_raw_parts_mut(ptr.get().add((g + q) * rows + o0), n)
                } else {
                    &mut []
                }
            });
            cols_t_in(isa, w, o0, n, &xs[g * cols..(g + p) * cols], &mut outs[..p]);
        }
    };
    let bands = rows.div_ceil(chunk);
    if tasks == 1 {
        (0..bands).for_each(run);
    } else {
        for_each_index(bands, run);
    }
}

/// A pointer to items (elements, rows, whole slices) that parallel calls write one each:
/// each call takes items no other call takes (see `matmul`, [`each_mut`], attention).
pub(crate) struct SendPtr<T>(pub(crate) *mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: used only to hand disjoint items of a `Send` type to other threads.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }

    /// The pointer to item `i`.
    pub(crate) fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    use verify::reference;

    #[test]
    fn fp4_codes_and_scales() {
        let expect = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for n in 0..16u8 {
            let v = mxfp4_value(n, 127);
            let mag = expect[(n & 7) as usize];
            assert_eq!(v.abs(), mag, "nibble {n}");
            assert_eq!(v.is_sign_negative(), n >= 8, "sign of nibble {n}");
        }
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(255), f32::INFINITY);
        assert_eq!(mxfp4_value(7, 254), 6.0 * 2f32.powi(127));
        assert_eq!(mxfp4_value(1, 0), 2f32.powi(-128));
        assert_eq!(mxfp4_value(0, 255), 0.0, "ldexp(0, 128) is 0");
    }

    #[test]
    fn bf16_and_f16_widening() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 3.140625, 1e-30, f32::INFINITY] {
            let b = (v.to_bits() >> 16) as u16;
            assert_eq!(
                bf16_at(&b.to_le_bytes(), 0).to_bits(),
                v.to_bits() & 0xffff_0000
            );
        }
        let h = half::f16::from_f32(0.333);
        assert_eq!(f16_at(&h.to_bits().to_le_bytes(), 0), h.to_f32());
    }

    /// Every ISA this CPU runs; a test body loops over these.
    fn isas() -> Vec<Isa> {
        let t = Isa::available();
        assert_eq!(t[0], Isa::Scalar);
        t
    }

    fn rand_x(n: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    /// `matvec` against the f64 reference, and `matmul` bit-identical to `matvec` per position
    /// for block sizes covering every position-group remainder and several whole groups.
    fn check(w: &Mat<'_>, rng: &mut rand::rngs::StdRng) {
        let block_sizes = [2, 3, 4, 5, 6, 7, 9, 17, 37];
        let mut g = Gen::new(rng.gen());
        let r = verify::check_mat(Isa::active(), w, &block_sizes, &mut g);
        if let Err(e) = r {
            panic!("{e}");
        }
    }

    #[test]
    fn every_isa_matches_reference_on_odd_shapes() {
        for isa in isas() {
            with_isa(isa, || {
                assert_eq!(Isa::active(), isa);
                let mut rng = rand::rngs::StdRng::seed_from_u64(7);
                let shapes = [
                    (1, 1),
                    (3, 7),
                    (5, 8),
                    (17, 33),
                    (9, 47),
                    (64, 96),
                    (300, 257),
                    (1030, 130),
                    (77, 1000),
                ];
                for &(rows, cols) in &shapes {
                    for fmt in [Float::F32, Float::BF16, Float::F16] {
                        // One spare byte up front: weights need not be aligned.
                        let mut bytes = vec![0u8];
                        bytes.extend(Gen::new(rng.gen()).dense(fmt, rows * cols));
                        let bytes = &bytes[1..];
                        check(
                            &Mat::Dense {
                                fmt,
                                bytes,
                                rows,
                                cols,
                            },
                            &mut rng,
                        );
                        check(
                            &Mat::DenseT {
                                fmt,
                                bytes,
                                rows,
                                cols,
                            },
                            &mut rng,
                        );
                    }
                    let mut q = vec![0u8];
                    q.extend((0..rows * cols).map(|_| rng.gen::<u8>()));
                    let scales: Vec<f32> = (0..rows).map(|_| rng.gen_range(0.0..0.02)).collect();
                    check(
                        &Mat::Q8 {
                            q: &q[1..],
                            scales: &scales,
                            rows,
                            cols,
                        },
                        &mut rng,
                    );
                }
                for &(rows, cols) in &[(1, 32), (5, 64), (33, 96), (7, 2880), (700, 320)] {
                    let mut blocks: Vec<u8> = vec![0];
                    blocks.extend((0..rows * cols / 2).map(|_| rng.gen::<u8>()));
                    let scales: Vec<u8> = (0..rows * cols / 32)
                        .map(|_| rng.gen_range(120..134))
                        .collect();
                    check(
                        &Mat::Mxfp4 {
                            blocks: &blocks[1..],
                            scales: &scales,
                            rows,
                            cols,
                        },
                        &mut rng,
                    );
                    check(
                        &Mat::Mxfp4Int8 {
                            blocks: &blocks[1..],
                            scales: &scales,
                            rows,
                            cols,
                        },
                        &mut rng,
                    );
                }
            })
        }
    }

    /// Where the inputs sit in memory changes nothing: every ISA gives the same bits for inputs
    /// at each of the sixteen f32 offsets from a cache line (kernels copy inputs that do not
    /// start on one, [`Arrange::Align`]), for one position and for a block.
    #[test]
    fn results_do_not_depend_on_input_alignment() {
        let mut g = Gen::new(11);
        let (rows, cols, t) = (37, 2880, 5);
        let (blocks, scales) = g.mxfp4(rows, cols);
        let dense = g.dense(Float::BF16, rows * cols);
        let q: Vec<u8> = (0..rows * cols).map(|_| g.byte()).collect();
        let q_scales = g.units(rows);
        let mats = [
            Mat::Mxfp4 {
                blocks: &blocks,
                scales: &scales,
                rows,
                cols,
            },
            Mat::Dense {
                fmt: Float::BF16,
                bytes: &dense,
                rows,
                cols,
            },
            Mat::Q8 {
                q: &q,
                scales: &q_scales,
                rows,
                cols,
            },
        ];
        let xs = g.units(t * cols);
        for isa in isas() {
            with_isa(isa, || {
                for w in &mats {
                    let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
                    let mut room = vec![0f32; t * cols + 2 * LINE];
                    let base = line_start(&room);
                    for at in base..base + LINE / 4 {
                        let x = &mut room[at..at + t * cols];
                        x.copy_from_slice(&xs);
                        let (mut one, mut block) = (vec![0f32; rows], vec![0f32; t * rows]);
                        matvec(w, &x[..cols], &mut one);
                        matmul(w, x, &mut block);
                        match &first {
                            None => first = Some((one, block)),
                            Some((o, b)) => {
                                let same = |a: &[f32], b: &[f32]| {
                                    a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits())
                                };
                                assert!(same(o, &one), "{isa}: matvec at offset {at}");
                                assert!(same(b, &block), "{isa}: matmul at offset {at}");
                            }
                        }
                    }
                }
            })
        }
    }

    /// The prefetch distance is a hint: every ISA's one-position kernels give the same bits at
    /// any distance (none, one line, the default, far past the matrix's end).
    #[test]
    fn results_do_not_depend_on_the_prefetch_distance() {
        let mut g = Gen::new(12);
        let (rows, cols) = (29, 2880);
        let (blocks, scales) = g.mxfp4(rows, cols);
        let dense = g.dense(Float::BF16, rows * cols);
        let mats = [
            Mat::Mxfp4 {
                blocks: &blocks,
                scales: &scales,
                rows,
                cols,
            },
            Mat::Dense {
                fmt: Float::BF16,
                bytes: &dense,
                rows,
                cols,
            },
        ];
        let x = g.units(cols);
        let default = prefetch_ahead();
        for isa in isas() {
            with_isa(isa, || {
                for w in &mats {
                    let mut first: Option<Vec<u32>> = None;
                    for ahead in [0, 64, default, 1 << 20] {
                        set_prefetch_ahead(ahead);
                        let mut y = vec![0f32; rows];
                        matvec(w, &x, &mut y);
                        let bits: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                        match &first {
                            None => first = Some(bits),
                            Some(f) => assert_eq!(f, &bits, "{isa}: {ahead} bytes ahead"),
                        }
                    }
                }
            })
        }
        set_prefetch_ahead(default);
    }

    #[test]
    fn cpu_signatures_decode_and_choose_the_prefetch_distance() {
        let amd = |eax| CpuId::from_signature("AuthenticAMD".into(), eax);
        // Zen 4 (EPYC 9004/Genoa-class VM): family 0xf + 0xa = 25, model 0x11 = 17.
        let zen4 = amd(0x00a1_0f11);
        assert_eq!((zen4.family, zen4.model), (25, 17));
        assert_eq!(default_prefetch_ahead(Some(&zen4)), 512);
        // Zen 5: family 0xf + 0xb = 26, model 2.
        let zen5 = amd(0x00b0_0f20);
        assert_eq!((zen5.family, zen5.model), (26, 2));
        assert_eq!(default_prefetch_ahead(Some(&zen5)), 2048);
        // An Intel core: family 6, model 0xa7 (extended model 0xa, model 7).
        let xeon = CpuId::from_signature("GenuineIntel".into(), 0x000a_0671);
        assert_eq!((xeon.family, xeon.model), (6, 167));
        assert_eq!(default_prefetch_ahead(Some(&xeon)), 2048);
        // Family 25 from another vendor is not Zen 4.
        let other = CpuId::from_signature("HygonGenuine".into(), 0x00a1_0f11);
        assert_eq!(default_prefetch_ahead(Some(&other)), 2048);
        assert_eq!(default_prefetch_ahead(None), 2048);
    }

    /// The int8-input MXFP4 path in every ISA: `matvec` gives the scalar reference's bits on
    /// the same quantized inputs; the result lies within the input rounding (half a step of
    /// each block's scale, times the weights) of the exact product; `matmul` is bit-identical
    /// to `matvec` per position; threaded shapes included.
    #[test]
    fn int8_input_mxfp4_matches_reference_and_exact_product_in_every_isa() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        for &(rows, cols) in &[
            (1, 32),
            (5, 64),
            (33, 96),
            (7, 2880),
            (700, 320),
            (1157, 288),
        ] {
            let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..rows * cols / 32)
                .map(|_| rng.gen_range(118..136))
                .collect();
            let w = Mat::Mxfp4Int8 {
                blocks: &blocks,
                scales: &scales,
                rows,
                cols,
            };
            let exact_w = Mat::Mxfp4 {
                blocks: &blocks,
                scales: &scales,
                rows,
                cols,
            };
            // Inputs of mixed magnitudes across blocks, one block all zero.
            let mut x = rand_x(cols, &mut rng);
            for (b, xb) in x.chunks_mut(32).enumerate() {
                let m = [1.0, 0.01, 30.0, 0.0][b % 4];
                xb.iter_mut().for_each(|v| *v *= m);
            }
            let mut q = vec![0f32; cols];
            int8x::quantize(&x, cols, &mut q);
            let mut want = vec![0f32; rows];
            int8x::reference_rows(&blocks, &scales, cols, 0, rows, &q, 1, &mut want);
            let exact = reference(&exact_w, &x);
            let mut row = vec![0f32; cols];
            for isa in isas() {
                with_isa(isa, || {
                    let mut y = vec![f32::NAN; rows];
                    matvec(&w, &x, &mut y);
                    for r in 0..rows {
                        exact_w.row_into(r, &mut row);
                        let (mut mag, mut step) = (0f64, 0f64);
                        for (b, (wb, xb)) in row.chunks(32).zip(x.chunks(32)).enumerate() {
                            let d = q[cols / 4 + b] as f64;
                            for (&a, &v) in wb.iter().zip(xb) {
                                mag += (a as f64 * v as f64).abs();
                                step += (a as f64).abs() * d / 2.0;
                            }
                        }
                        let tol = 1e-6 * (mag + 1.0) * (cols as f64).sqrt();
                        assert!(
                            verify::same_bits(y[r], want[r]),
                            "{isa} {rows}x{cols} row {r}: {} vs reference {}",
                            y[r],
                            want[r]
                        );
                        assert!(
                            (y[r] as f64 - exact[r]).abs() <= step * 1.001 + tol,
                            "{isa} {rows}x{cols} row {r}: {} vs exact {} (rounding bound {step})",
                            y[r],
                            exact[r]
                        );
                    }
                    for t in [2, 3, 4, 5, 9] {
                        let xs = rand_x(t * cols, &mut rng);
                        let mut ys = vec![f32::NAN; t * rows];
                        matmul(&w, &xs, &mut ys);
                        for p in 0..t {
                            let mut y1 = vec![0f32; rows];
                            matvec(&w, &xs[p * cols..(p + 1) * cols], &mut y1);
                            let got = &ys[p * rows..(p + 1) * rows];
                            assert!(
                                got.iter().zip(&y1).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{isa}: int8 matmul position {p} of {t} differs from matvec"
                            );
                        }
                    }
                })
            }
        }
    }

    /// Non-finite inputs give NaN outputs on the int8 path, as products with them do on the
    /// exact path, rather than being rounded away.
    #[test]
    fn int8_input_mxfp4_propagates_non_finite_inputs() {
        let blocks = vec![0x21u8; 4 * 64 / 2];
        let scales = vec![127u8; 4 * 2];
        let w = Mat::Mxfp4Int8 {
            blocks: &blocks,
            scales: &scales,
            rows: 4,
            cols: 64,
        };
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![0.5f32; 64];
            x[40] = bad;
            for isa in isas() {
                with_isa(isa, || {
                    let mut y = vec![0f32; 4];
                    matvec(&w, &x, &mut y);
                    assert!(y.iter().all(|v| v.is_nan()), "{isa} {bad}: {y:?}");
                })
            }
        }
    }

    /// Large matrices take the threaded paths (several tasks), which small ones do not.
    #[test]
    fn every_isa_matches_reference_when_threaded() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (rows, cols) = (1157, 288);
        assert!(tasks_for(rows * cols / 2) > 1 || rayon::current_num_threads() == 1);
        let bf = Gen::new(rng.gen()).dense(Float::BF16, rows * cols);
        let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| rng.gen_range(118..136))
            .collect();
        for isa in isas() {
            with_isa(isa, || {
                let fmt = Float::BF16;
                check(
                    &Mat::Dense {
                        fmt,
                        bytes: &bf,
                        rows,
                        cols,
                    },
                    &mut rng,
                );
                check(
                    &Mat::DenseT {
                        fmt,
                        bytes: &bf,
                        rows,
                        cols,
                    },
                    &mut rng,
                );
                let q8_scales: Vec<f32> = (0..rows).map(|r| 1e-3 * (r % 7) as f32).collect();
                check(
                    &Mat::Q8 {
                        q: &blocks[..rows * cols / 2],
                        scales: &q8_scales,
                        rows,
                        cols: cols / 2,
                    },
                    &mut rng,
                );
                let (blocks, scales) = (&blocks[..], &scales[..]);
                check(
                    &Mat::Mxfp4 {
                        blocks,
                        scales,
                        rows,
                        cols,
                    },
                    &mut rng,
                );
            })
        }
    }

    /// A batch gives each product exactly what `matmul` gives it alone, in every ISA: mixed
    /// formats, large (threaded) and tiny products, one and many positions, empty and
    /// zero-width products, input-major weights, and more products than one region takes.
    #[test]
    fn batch_equals_each_product_alone_in_every_isa() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (rows, cols) = (1157, 288);
        let bf = Gen::new(rng.gen()).dense(Float::BF16, rows * cols);
        let f32s = Gen::new(rng.gen()).dense(Float::F32, 37 * 19);
        let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| rng.gen_range(118..136))
            .collect();
        let q8_scales: Vec<f32> = (0..rows).map(|r| 1e-3 * (r % 7 + 1) as f32).collect();
        let (b, s) = (&blocks[..], &scales[..]);
        let mut mats = vec![
            Mat::Mxfp4 {
                blocks: b,
                scales: s,
                rows,
                cols,
            },
            Mat::Mxfp4Int8 {
                blocks: b,
                scales: s,
                rows: 301,
                cols,
            },
            Mat::Dense {
                fmt: Float::BF16,
                bytes: &bf,
                rows,
                cols,
            },
            Mat::DenseT {
                fmt: Float::BF16,
                bytes: &bf,
                rows: 96,
                cols: 288,
            },
            Mat::Dense {
                fmt: Float::F32,
                bytes: &f32s,
                rows: 37,
                cols: 19,
            },
            Mat::Q8 {
                q: &blocks[..rows * 96],
                scales: &q8_scales,
                rows,
                cols: 96,
            },
            Mat::Mxfp4 {
                blocks: b,
                scales: s,
                rows: 0,
                cols,
            },
            Mat::Dense {
                fmt: Float::F32,
                bytes: &[],
                rows: 5,
                cols: 0,
            },
        ];
        // More products than one region takes.
        for r in 1..=MAX_BATCH {
            mats.push(Mat::Mxfp4 {
                blocks: b,
                scales: s,
                rows: 4 * r + 1,
                cols,
            });
        }
        for isa in isas() {
            with_isa(isa, || {
                for t in [1, 3, 9] {
                    let xs: Vec<Vec<f32>> = mats
                        .iter()
                        .map(|w| rand_x(t * w.cols(), &mut rng))
                        .collect();
                    let alone: Vec<Vec<f32>> = mats
                        .iter()
                        .zip(&xs)
                        .map(|(w, x)| {
                            let mut y = vec![f32::NAN; t * w.rows()];
                            matmul(w, x, &mut y);
                            y
                        })
                        .collect();
                    let mut ys: Vec<Vec<f32>> =
                        mats.iter().map(|w| vec![f32::NAN; t * w.rows()]).collect();
                    matmul_batch(
                        mats.iter()
                            .zip(&xs)
                            .zip(&mut ys)
                            .map(|((w, x), y)| Product {
                                w: *w,
                                xs: x,
                                ys: y,
                            }),
                    );
                    for (i, (got, want)) in ys.iter().zip(&alone).enumerate() {
                        let same = got
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{isa}: product {i} ({:?}), {t} positions", mats[i]);
                    }
                }
            })
        }
    }

    /// Random MXFP4 blocks for `rows` (at most 256) rows of `cols`, every block of row `r`
    /// with scale byte `r`.
    fn scale_byte_per_row(
        rows: usize,
        cols: usize,
        rng: &mut rand::rngs::StdRng,
    ) -> (Vec<u8>, Vec<u8>) {
        let blocks = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales = (0..rows * cols / 32)
            .map(|i| (i / (cols / 32)) as u8)
            .collect();
        (blocks, scales)
    }

    /// Every E8M0 scale byte, including the subnormal (0) and infinite (255) ends, gives the
    /// scalar reference's bits in every ISA (at scales 253 and 254 the larger dequantized
    /// weights overflow to ±inf in every ISA alike); and the reference is within rounding of
    /// the f64 product wherever that is finite and its terms' magnitudes stay within f32.
    #[test]
    fn every_isa_handles_extreme_mxfp4_scales() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (256, 64);
        let (blocks, scales) = scale_byte_per_row(rows, cols, &mut rng);
        let w = Mat::Mxfp4 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        let x = rand_x(cols, &mut rng);
        let mut want = vec![0f32; rows];
        with_isa(Isa::Scalar, || matvec(&w, &x, &mut want));
        let exact = reference(&w, &x);
        let mut row = vec![0f32; cols];
        for (r, (&a, &b)) in want.iter().zip(&exact).enumerate() {
            if !b.is_finite() {
                continue;
            }
            w.row_into(r, &mut row);
            let mag: f64 = row
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let tol = 1e-5 * mag + 1e-44;
            // Where the products' magnitudes add up past f32's range, a partial sum may
            // overflow in any order.
            let overflows = !a.is_finite() && mag > f32::MAX as f64;
            assert!(
                (a as f64 - b).abs() <= tol || overflows,
                "scalar row {r} (scale byte {r}): {a} vs {b}"
            );
        }
        for isa in isas() {
            let mut y = vec![0f32; rows];
            with_isa(isa, || matvec(&w, &x, &mut y));
            for (r, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!(
                    verify::same_bits(*a, *b),
                    "{isa} row {r} (scale byte {r}): {a:e} vs the scalar {b:e}"
                );
            }
        }
    }

    /// Values that stress an order's arithmetic: zeros of both signs, subnormals, values whose
    /// products or sums overflow, infinities and NaNs, among ordinary ones.
    fn special(rng: &mut rand::rngs::StdRng) -> f32 {
        match rng.gen_range(0..10) {
            0 => [0.0, -0.0][rng.gen_range(0..2)],
            1 => f32::from_bits(rng.gen_range(1..0x0080_0000)) * [1.0, -1.0][rng.gen_range(0..2)],
            2 => rng.gen_range(-1.0..1.0) * 3e38,
            3 => rng.gen_range(-1.0..1.0) * 1e-30,
            4 => [f32::INFINITY, f32::NEG_INFINITY][rng.gen_range(0..2)],
            5 => f32::NAN,
            _ => rng.gen_range(-1e4..1e4),
        }
    }

    /// `n` inputs: ordinary values, with a special one ([`special`]) at about one place in
    /// `every` (none if `every` is 0).
    fn inputs(n: usize, every: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        (0..n)
            .map(|_| {
                if every > 0 && rng.gen_range(0..every) == 0 {
                    special(rng)
                } else {
                    rng.gen_range(-1.0..1.0)
                }
            })
            .collect()
    }

    /// Dense weights in `fmt`: ordinary values, with a special one ([`special`], rounded to
    /// the format) at about one place in `every` (none if 0).
    fn dense_weights(fmt: Float, n: usize, every: usize, rng: &mut rand::rngs::StdRng) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * fmt.size());
        for v in inputs(n, every, rng) {
            match fmt {
                Float::F32 => out.extend(v.to_le_bytes()),
                Float::BF16 => out.extend(half::bf16::from_f32(v).to_bits().to_le_bytes()),
                Float::F16 => out.extend(half::f16::from_f32(v).to_bits().to_le_bytes()),
            }
        }
        out
    }

    /// `matmul` of `w` on every ISA against the scalar kernels, bit for bit (every NaN the
    /// same), for each number of positions in `ts`; inputs from `rng` with a special value at
    /// about one place in `every`.
    fn same_bits_as_scalar(w: &Mat<'_>, ts: &[usize], every: usize, rng: &mut rand::rngs::StdRng) {
        let (rows, cols) = (w.rows(), w.cols());
        for &t in ts {
            let xs = inputs(t * cols, every, rng);
            let mut want = vec![f32::NAN; t * rows];
            matmul_in(Isa::Scalar, w, &xs, &mut want);
            for isa in isas().into_iter().skip(1) {
                let mut got = vec![f32::NAN; t * rows];
                with_isa(isa, || matmul(w, &xs, &mut got));
                if let Some(i) = (0..t * rows).find(|&i| !verify::same_bits(got[i], want[i])) {
                    panic!(
                        "{isa} on {}: position {} of {t}, row {}: {:e} against the scalar {:e}",
                        verify::describe(w),
                        i / rows,
                        i % rows,
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }

    /// Positions per block tried on a matrix: all of 1 to 40 on small ones, a spread on larger
    /// ones (every group remainder of the SIMD ISAs, several groups).
    fn block_sizes(rows: usize, cols: usize) -> Vec<usize> {
        if rows * cols <= 3000 {
            (1..=40).collect()
        } else {
            vec![1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 40]
        }
    }

    /// The issue-39 promise: every ISA gives the scalar reference's bits, for one position and
    /// for blocks of 1 to 40, on random shapes (odd row counts, widths that are and are not
    /// multiples of the vector widths), for every weight format (dense f32, bf16 and f16 in
    /// both orientations, int8 rows, MXFP4 at every scale byte, on f32 and on int8 inputs:
    /// widths of 1 to 90 blocks, whole groups of eight and not), with and without special
    /// values (NaN, ±inf, subnormals, overflowing products) in weights and inputs.
    #[test]
    fn every_isa_gives_the_scalar_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(39);
        for case in 0..24 {
            let rows = [1, 3, 5, 7, 17, 31, 33, 67][case % 8] + 2 * rng.gen_range(0..4);
            let cols = match case % 4 {
                0 => rng.gen_range(1..16),
                1 => 16 * rng.gen_range(1..8),
                2 => rng.gen_range(17..200),
                _ => rng.gen_range(200..700),
            };
            // Special values in the second half of the cases (in the weights, the inputs, or
            // both), at about one place in 60.
            let (w_every, x_every) = match case / 12 {
                0 => (0, 0),
                _ => [(60, 0), (0, 60), (60, 60)][case % 3],
            };
            let ts = block_sizes(rows, cols);
            for fmt in [Float::F32, Float::BF16, Float::F16] {
                let mut bytes = vec![0u8];
                bytes.extend(dense_weights(fmt, rows * cols, w_every, &mut rng));
                let bytes = &bytes[1..];
                for w in [
                    Mat::Dense {
                        fmt,
                        bytes,
                        rows,
                        cols,
                    },
                    Mat::DenseT {
                        fmt,
                        bytes,
                        rows,
                        cols,
                    },
                ] {
                    same_bits_as_scalar(&w, &ts, x_every, &mut rng);
                }
            }
            let q: Vec<u8> = (0..rows * cols).map(|_| rng.gen()).collect();
            let q_scales = inputs(rows, w_every / 10, &mut rng);
            let w = Mat::Q8 {
                q: &q,
                scales: &q_scales,
                rows,
                cols,
            };
            same_bits_as_scalar(&w, &ts, x_every, &mut rng);
            // MXFP4: widths in blocks of 32; scales near 1, or any byte (0, 1, 253, 254 and
            // 255 often).
            let cols = 32 * [1, 2, 3, 5, 9, 90][case % 6];
            let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..rows * cols / 32)
                .map(|_| match (case % 2, rng.gen_range(0..8)) {
                    (0, _) => rng.gen_range(118..136),
                    (_, 0) => [0, 1, 253, 254, 255][rng.gen_range(0..5)],
                    _ => rng.gen(),
                })
                .collect();
            for w in [
                Mat::Mxfp4 {
                    blocks: &blocks,
                    scales: &scales,
                    rows,
                    cols,
                },
                Mat::Mxfp4Int8 {
                    blocks: &blocks,
                    scales: &scales,
                    rows,
                    cols,
                },
            ] {
                same_bits_as_scalar(&w, &block_sizes(rows, cols), x_every, &mut rng);
            }
        }
    }

    /// Large matrices take the threaded paths and the AVX2/AVX-512 MXFP4 prefill kernels'
    /// several row groups and slabs (up to 32 positions a call), and the int8-input kernels'
    /// several position groups: still the scalar bits.
    #[test]
    fn every_isa_gives_the_scalar_bits_when_threaded() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(40);
        let (rows, cols) = (389, 2880);
        let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| rng.gen_range(118..136))
            .collect();
        let w = Mat::Mxfp4 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        same_bits_as_scalar(&w, &[1, 33, 40], 0, &mut rng);
        let w = Mat::Mxfp4Int8 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        same_bits_as_scalar(&w, &[1, 9, 40], 0, &mut rng);
        let (rows, cols) = (301, 1000);
        let bf = dense_weights(Float::BF16, rows * cols, 0, &mut rng);
        let fmt = Float::BF16;
        for w in [
            Mat::Dense {
                fmt,
                bytes: &bf,
                rows,
                cols,
            },
            Mat::DenseT {
                fmt,
                bytes: &bf,
                rows,
                cols,
            },
        ] {
            same_bits_as_scalar(&w, &[1, 6], 0, &mut rng);
        }
    }

    /// The int8-input path at every E8M0 scale byte: each ISA gives the reference's bits on
    /// the same quantized inputs; the reference finite up to scale byte 245 and within
    /// rounding of the f64 product of the rounded inputs.
    #[test]
    fn int8_input_mxfp4_handles_extreme_scales() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (rows, cols) = (256, 96);
        let (blocks, scales) = scale_byte_per_row(rows, cols, &mut rng);
        let w = Mat::Mxfp4Int8 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        let x = rand_x(cols, &mut rng);
        let mut q = vec![0f32; cols];
        int8x::quantize(&x, cols, &mut q);
        let mut want = vec![0f32; rows];
        int8x::reference_rows(&blocks, &scales, cols, 0, rows, &q, 1, &mut want);
        let exact = reference(&w, &x);
        let d = &q[cols / 4..cols / 4 + cols / 32];
        for (r, (&a, &b)) in want.iter().zip(&exact).enumerate() {
            // A block's product is below 2^15.6 (its integer sum) times 2^-7 (the input
            // scale of inputs below 1) times 2^(r - 128) (half the weights' scale), so three
            // blocks' sum stays below 2^(r - 117.8): finite up to scale byte 245.
            assert!(a.is_finite() || r > 245, "reference row {r}: {a}");
            // (At scale bytes 253 and 254 the f64 reference's f32 weights overflow.)
            if a.is_finite() && b.is_finite() {
                // Each product is at most 12 x 127 steps of the block's scales.
                let step = (0..cols / 32)
                    .map(|k| d[k] as f64 * SCALE[scales[r * cols / 32 + k] as usize] as f64)
                    .sum::<f64>();
                let tol = 1e-6 * 12.0 * 127.0 * 32.0 * step + 1e-44;
                assert!(
                    (a as f64 - b).abs() <= tol,
                    "reference row {r} (scale byte {r}): {a} vs {b}"
                );
            }
        }
        for isa in isas() {
            let mut y = vec![0f32; rows];
            with_isa(isa, || matvec(&w, &x, &mut y));
            for (r, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!(
                    verify::same_bits(*a, *b),
                    "{isa} row {r} (scale byte {r}): {a:e} vs the scalar {b:e}"
                );
            }
        }
        // Many positions at once (every prefill kernel).
        for t in [3, 8, 17, 32, 40] {
            let xs = rand_x(t * cols, &mut rng);
            let mut q = vec![0f32; xs.len()];
            int8x::quantize(&xs, cols, &mut q);
            let mut want = vec![0f32; t * rows];
            int8x::reference_rows(&blocks, &scales, cols, 0, rows, &q, t, &mut want);
            // `reference_rows` writes `[t, rows]` position by position, as `matmul` does.
            for isa in isas() {
                let mut ys = vec![f32::NAN; t * rows];
                with_isa(isa, || matmul(&w, &xs, &mut ys));
                for (j, (a, b)) in ys.iter().zip(&want).enumerate() {
                    assert!(
                        verify::same_bits(*a, *b),
                        "{isa}, {t} positions, output {j} (scale byte {}): {a:e} vs {b:e}",
                        j % rows
                    );
                }
            }
        }
    }

    /// The AVX2 ISA's per-scale tables hold every dequantized MXFP4 value exactly (bf16 has
    /// the bits: an FP4 value times a power of two has at most two significant bits).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_scaled_tables_are_exact_dequantized_values() {
        for s in 0..=255u8 {
            for n in 0..16u8 {
                let want = mxfp4_value(n, s);
                let got = avx2::scaled_value(s, n);
                assert!(
                    got.to_bits() == want.to_bits(),
                    "scale {s} nibble {n}: table {got:e} vs value {want:e}"
                );
            }
        }
    }

    #[test]
    fn simd_switch_values() {
        let best = Isa::detected();
        assert_eq!(resolve("scalar", best), (Isa::Scalar, None));
        assert_eq!(resolve(" SCALAR ", best), (Isa::Scalar, None));
        assert_eq!(resolve("auto", best), (best, None));
        assert_eq!(resolve("", best), (best, None));
        let (t, note) = resolve("sse9", best);
        assert_eq!(t, best);
        assert!(note
            .expect("unknown instruction set warns")
            .contains("unknown instruction set"));
        // Asking for more than the CPU has falls back to what it has, with a warning.
        let (t, note) = resolve("avx512", Isa::Scalar);
        assert_eq!(t, Isa::Scalar);
        assert!(note
            .expect("unsupported instruction set warns")
            .contains("does not support"));
        for t in Isa::ALL {
            assert_eq!(Isa::parse(t.name()), Some(t));
        }
    }

    /// The process-wide decision: `STORMO_SIMD` picks the starting ISA, the self-check lowers
    /// it, and both warnings are kept, the switch's first.
    #[test]
    fn process_isa_is_switched_then_checked() {
        let best = Isa::detected();
        let broken = |t: Isa| {
            if t == best {
                Err("broken".to_string())
            } else {
                Ok(())
            }
        };
        assert_eq!(decide(None, best, |_| Ok(())), (best, vec![]));
        assert_eq!(decide(Some("scalar"), best, broken), (Isa::Scalar, vec![]));
        let (isa, warnings) = decide(Some("sse9"), best, broken);
        if best == Isa::Scalar {
            assert_eq!((isa, warnings.len()), (Isa::Scalar, 1));
        } else {
            assert!(isa < best, "{isa} below {best}");
            assert_eq!(warnings.len(), 2, "{warnings:?}");
            assert!(
                warnings[0].contains("unknown instruction set") && warnings[1].contains("broken")
            );
        }
    }

    #[test]
    fn with_isa_nests_and_restores() {
        let outer = Isa::active();
        with_isa(Isa::Scalar, || {
            assert_eq!(Isa::active(), Isa::Scalar);
            let best = Isa::detected();
            with_isa(best, || assert_eq!(Isa::active(), best));
            assert_eq!(Isa::active(), Isa::Scalar);
        });
        assert_eq!(Isa::active(), outer);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn detection_finds_avx2_when_the_cpu_has_it() {
        let has = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        assert_eq!(Isa::available().contains(&Isa::Avx2), has);
        assert_eq!(Isa::detected() >= Isa::Avx2, has);
    }

    /// Where the CPU has AVX2 but not AVX-512 (as the machines this project is tested on),
    /// the AVX-512 ISA still runs in the tests, in software, and is never chosen for real
    /// work; and it is its own kernels that run, not a fallback: given MXFP4 inputs in element
    /// order rather than in the order its decode wants them, its row kernel gives other
    /// results than the scalar one (with them arranged, the same bits: other tests).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_isa_runs_in_tests_natively_or_emulated() {
        let (native, emulated) = (Isa::Avx512.is_native(), Isa::Avx512.is_emulated());
        assert!(!(native && emulated));
        assert_eq!(emulated, Isa::Avx2.is_native() && !native);
        assert_eq!(Isa::available().contains(&Isa::Avx512), native || emulated);
        if !Isa::Avx512.is_supported() {
            return;
        }
        if emulated {
            assert!(Isa::detected() < Isa::Avx512);
            assert_eq!(resolve("avx512", Isa::detected()).0, Isa::detected());
        }
        let (rows, cols) = (64, 2880);
        let mut g = Gen::new(11);
        let (blocks, scales) = g.mxfp4(rows, cols);
        let w = Mat::Mxfp4 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        let x = g.units(cols);
        let (mut wide, mut scalar) = (vec![0f32; rows], vec![0f32; rows]);
        rows_in(Isa::Avx512, &w, 0, rows, &x, 1, &mut wide);
        rows_in(Isa::Scalar, &w, 0, rows, &x, 1, &mut scalar);
        verify::check_mat(Isa::Avx512, &w, &[3, 17], &mut g).unwrap();
        assert!(
            wide.iter()
                .zip(&scalar)
                .any(|(a, b)| a.to_bits() != b.to_bits()),
            "the avx512 row kernel ignores the order of its inputs: is the ISA falling back?"
        );
    }

    /// The AVX-512 ISA's software copy (`avx512_emulated`), which the tests use in its place on
    /// AVX2-only CPUs, gives the scalar bits too, whether or not this CPU has AVX-512 (called
    /// directly: [`Isa::available`] offers it only where the CPU lacks the real one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn emulated_avx512_gives_the_scalar_bits() {
        if !avx512_emulated::supported() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        let same = |got: &[f32], want: &[f32], what: &str| {
            if let Some(i) = (0..want.len()).find(|&i| !verify::same_bits(got[i], want[i])) {
                panic!(
                    "emulated avx512, {what}: output {i}: {:e} vs {:e}",
                    got[i], want[i]
                );
            }
        };
        for &(rows, cols) in &[(7, 37), (9, 16), (5, 5), (33, 2880)] {
            for fmt in [Float::F32, Float::BF16, Float::F16] {
                let bytes = dense_weights(fmt, rows * cols, 50, &mut rng);
                let (w, wt) = (
                    Mat::Dense {
                        fmt,
                        bytes: &bytes,
                        rows,
                        cols,
                    },
                    Mat::DenseT {
                        fmt,
                        bytes: &bytes,
                        rows,
                        cols,
                    },
                );
                for p in 1..=4 {
                    let xs = inputs(p * cols, 50, &mut rng);
                    let (mut got, mut want) = (vec![0f32; p * rows], vec![0f32; p * rows]);
                    avx512_emulated::rows(&w, 0, rows, &xs, p, &mut got);
                    scalar::rows(&w, 0, rows, &xs, p, &mut want);
                    same(
                        &got,
                        &want,
                        &format!("{fmt:?} {rows}x{cols}, {p} positions"),
                    );
                    let mut outs: Vec<Vec<f32>> = vec![vec![0f32; rows]; p];
                    let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                    avx512_emulated::cols_t(&wt, 0, rows, &xs, &mut refs);
                    let got: Vec<f32> = outs.concat();
                    let mut outs: Vec<Vec<f32>> = vec![vec![0f32; rows]; p];
                    let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                    scalar::cols_t(&wt, 0, rows, &xs, &mut refs);
                    same(
                        &got,
                        &outs.concat(),
                        &format!("input-major {fmt:?} {rows}x{cols}"),
                    );
                }
            }
        }
        for &(rows, cols) in &[(5, 64), (17, 2880)] {
            let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..rows * cols / 32).map(|_| rng.gen()).collect();
            let w = Mat::Mxfp4 {
                blocks: &blocks,
                scales: &scales,
                rows,
                cols,
            };
            for p in [1, 2, 5, 32] {
                let xs = inputs(p * cols, 50, &mut rng);
                let mut arranged = vec![0f32; xs.len()];
                avx512_emulated::mxfp4_permute(&xs, &mut arranged);
                let (mut got, mut want) = (vec![0f32; p * rows], vec![0f32; p * rows]);
                avx512_emulated::rows(&w, 0, rows, &arranged, p, &mut got);
                scalar::rows(&w, 0, rows, &xs, p, &mut want);
                same(&got, &want, &format!("MXFP4 {rows}x{cols}, {p} positions"));
            }
        }
    }

    /// Every AArch64 CPU a Linux distribution runs on has NEON (Advanced SIMD is part of
    /// ARMv8-A's base), so on AArch64 the NEON tier must be found: otherwise the kernel tests
    /// (`.ci/neon-emulated.sh`) would pass on the scalar tier alone without testing NEON.
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn detection_finds_neon_when_the_cpu_has_it() {
        let has = std::arch::is_aarch64_feature_detected!("neon");
        assert!(
            has,
            "an AArch64 CPU without NEON: the NEON kernels are not tested here"
        );
        assert_eq!(Isa::available().contains(&Isa::Neon), has);
        assert_eq!(Isa::detected() == Isa::Neon, has);
    }

    #[test]
    fn peak_flops_is_positive_for_every_native_isa() {
        for isa in Isa::native() {
            let f = peak_flops(isa, 0.01);
            assert!(f.is_finite() && f > 1e6, "{isa}: {f} FLOP/s");
        }
    }

    /// The int8 path's peak is measured wherever it has an x86 kernel, and only there.
    #[test]
    fn int8_peak_is_positive_where_the_int8_path_has_simd() {
        for isa in Isa::native() {
            let simd = cfg!(target_arch = "x86_64") && matches!(isa, Isa::Avx2 | Isa::Avx512);
            match peak_int8_ops(isa, 0.01) {
                Some(ops) => assert!(simd && ops.is_finite() && ops > 1e6, "{isa}: {ops}"),
                None => assert!(!simd, "{isa}: no int8 peak"),
            }
        }
    }

    #[test]
    fn scale_table_matches_e8m0() {
        for s in 0..=255u8 {
            assert_eq!(SCALE[s as usize], e8m0_to_f32(s), "scale {s}");
        }
    }
}
