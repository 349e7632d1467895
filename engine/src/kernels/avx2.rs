//! The AVX2 + FMA + F16C tier (x86-64 since Haswell / Zen).
//!
//! Row-major kernels keep one 8-lane accumulator per (row, position): lane `l` sums the
//! products of elements `i ≡ l (mod 8)` in increasing `i`, then [`hsum`] reduces the lanes in a
//! fixed order and a scalar tail adds the leftover elements with fused multiply-adds. How many
//! rows (`R`) and positions (`P`) one call interleaves changes only which loads are shared, never
//! a position's arithmetic, so a block of positions gets exactly what each position gets alone.
//!
//! MXFP4 nibbles are decoded in registers: a byte shuffle maps each nibble to twice its FP4
//! value as an int8 (exact integers), which widens to f32; the block's sum is multiplied by half
//! its E8M0 scale, so the doubled integers cost no precision.

use std::arch::x86_64::*;

use super::{Float, Mat, Outs, BF16, F16, F32, I8, SCALE};

/// True if this CPU runs the tier.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Output rows `r0 .. r0 + n` of a row-major matrix (`Dense` or `Mxfp4`) for `p` positions
/// `xs` (`[p, cols]`, `p <= 4`, or [`MXFP4_POSITIONS`] for MXFP4) into `out` (`[p, n]`).
pub(super) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    if !supported() {
        return super::scalar::rows(w, r0, n, xs, p, out);
    }
    super::check_rows(w, r0, n, xs, p, out);
    assert!(
        p <= 4 || matches!(w, Mat::Mxfp4 { .. }) && p <= MXFP4_POSITIONS,
        "kernel takes at most 4 positions ({MXFP4_POSITIONS} for MXFP4)"
    );
    // SAFETY: the CPU supports avx2, fma and f16c (checked above) and `check_rows` verified
    // that rows `r0 .. r0 + n`, `p` positions of `xs` and `p * n` outputs are in bounds.
    unsafe { rows_impl(w, r0, n, xs, p, out) }
}

/// Output columns `o0 .. o0 + n` of an input-major matrix (`DenseT`) for `outs.len()`
/// positions.
pub(super) fn cols_t(w: &Mat<'_>, o0: usize, n: usize, xs: &[f32], outs: &mut Outs<'_>) {
    if !supported() {
        return super::scalar::cols_t(w, o0, n, xs, outs);
    }
    super::check_cols_t(w, o0, n, xs, outs);
    let Mat::DenseT {
        fmt,
        bytes,
        rows,
        cols,
    } = *w
    else {
        unreachable!("check_cols_t accepts only DenseT")
    };
    let mut i = 0;
    while i < outs.len() {
        let p = (outs.len() - i).min(2);
        let x = &xs[i * cols..];
        // SAFETY: the CPU supports the tier (checked above); `check_cols_t` verified that the
        // matrix holds `rows * cols` elements, `o0 + n <= rows`, each output has `n` elements
        // and `xs` holds `outs.len()` positions of `cols`.
        unsafe {
            let y = &mut outs[i..i + p];
            match (fmt, p) {
                (Float::F32, 1) => dense_t::<F32, 1>(bytes, rows, cols, o0, n, x, y),
                (Float::F32, _) => dense_t::<F32, 2>(bytes, rows, cols, o0, n, x, y),
                (Float::BF16, 1) => dense_t::<BF16, 1>(bytes, rows, cols, o0, n, x, y),
                (Float::BF16, _) => dense_t::<BF16, 2>(bytes, rows, cols, o0, n, x, y),
                (Float::F16, 1) => dense_t::<F16, 1>(bytes, rows, cols, o0, n, x, y),
                (Float::F16, _) => dense_t::<F16, 2>(bytes, rows, cols, o0, n, x, y),
            }
        }
        i += p;
    }
}

/// # Safety
/// The CPU must support avx2, fma and f16c, and the bounds `check_rows` verifies must hold.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_impl(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    // SAFETY (whole body): forwarded from the caller's contract.
    unsafe {
        match *w {
            Mat::Dense {
                fmt, bytes, cols, ..
            } => match fmt {
                Float::F32 => dense_rows::<F32>(bytes, cols, r0, n, xs, p, out),
                Float::BF16 => dense_rows::<BF16>(bytes, cols, r0, n, xs, p, out),
                Float::F16 => dense_rows::<F16>(bytes, cols, r0, n, xs, p, out),
            },
            Mat::Mxfp4 {
                blocks,
                scales,
                cols,
                ..
            } => mxfp4_rows(blocks, scales, cols, r0, n, xs, p, out),
            Mat::Q8 {
                q, scales, cols, ..
            } => {
                dense_rows::<I8>(q, cols, r0, n, xs, p, out);
                for (i, v) in out[..p * n].iter_mut().enumerate() {
                    *v *= scales[r0 + i % n];
                }
            }
            Mat::DenseT { .. } => unreachable!("check_rows rejects DenseT"),
            Mat::Mxfp4Int8 { .. } => unreachable!("kernels::rows_in routes Mxfp4Int8 to int8x"),
        }
    }
}

/// Dispatches rows and positions to the `R x P` kernels.
///
/// # Safety
/// As [`rows_impl`]; `bytes` holds at least `(r0 + n) * cols` elements of format `FMT`.
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_rows<const FMT: u8>(
    bytes: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    let row_bytes = cols * super::code_size(FMT);
    let base = bytes.as_ptr();
    let x = |q: usize| xs[q * cols..].as_ptr();
    macro_rules! run {
        ($r:literal, $p:literal, $i:expr) => {{
            let i = $i;
            // SAFETY: rows `r0 + i .. r0 + i + $r` are in bounds (caller), as are the positions.
            let ws: [*const u8; $r] =
                std::array::from_fn(|k| unsafe { base.add((r0 + i + k) * row_bytes) });
            let xp: [*const f32; $p] = std::array::from_fn(x);
            // SAFETY: pointers to whole rows of `cols` elements (caller's contract).
            let v = unsafe { dense_dot::<FMT, $r, $p>(ws, xp, cols) };
            for k in 0..$r {
                for q in 0..$p {
                    out[q * n + i + k] = v[k][q];
                }
            }
        }};
    }
    macro_rules! sweep {
        ($r:literal, $p:literal) => {{
            let mut i = 0;
            while n - i >= $r {
                run!($r, $p, i);
                i += $r;
            }
            while i < n {
                run!(1, $p, i);
                i += 1;
            }
        }};
    }
    match p {
        1 => sweep!(4, 1),
        2 => sweep!(2, 2),
        3 => sweep!(2, 3),
        _ => sweep!(2, 4),
    }
}

/// Loads 8 elements of format `FMT` starting at element `i` of `w`, widened to f32.
///
/// # Safety
/// The CPU supports the tier and elements `i .. i + 8` are readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const FMT: u8>(w: *const u8, i: usize) -> __m256 {
    // SAFETY: forwarded from the caller; all loads are unaligned.
    unsafe {
        match FMT {
            F32 => _mm256_loadu_ps(w.add(4 * i) as *const f32),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i) as *const __m128i)),
            I8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                w.add(i) as *const __m128i
            ))),
            _ => {
                let h = _mm_loadu_si128(w.add(2 * i) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }
}

/// Widens element `i` of `w` (the scalar tail).
///
/// # Safety
/// Element `i` is readable.
#[inline(always)]
unsafe fn load1<const FMT: u8>(w: *const u8, i: usize) -> f32 {
    // SAFETY: forwarded from the caller.
    let b = unsafe {
        std::slice::from_raw_parts(w.add(i * super::code_size(FMT)), super::code_size(FMT))
    };
    match FMT {
        F32 => super::f32_at(b, 0),
        F16 => super::f16_at(b, 0),
        I8 => b[0] as i8 as f32,
        _ => super::bf16_at(b, 0),
    }
}

/// Sums the 8 lanes in a fixed order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Dot products of `R` consecutive rows with `P` positions, `n` elements each. With one
/// position (decode) it also prefetches, a cache line at a time, the next `R` rows: each row
/// is a stream too short for the hardware prefetcher to ramp up before it ends (README,
/// Kernels).
///
/// # Safety
/// The CPU supports the tier; each `w[k]` points to `n` readable elements of format `FMT` and
/// each `x[q]` to `n` readable f32. (The prefetches may point past the matrix: a hint.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_dot<const FMT: u8, const R: usize, const P: usize>(
    w: [*const u8; R],
    x: [*const f32; P],
    n: usize,
) -> [[f32; P]; R] {
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    let main = n / 8 * 8;
    let size = super::code_size(FMT);
    let (per_line, ahead) = (64 / size, R * n * size);
    let mut i = 0;
    while i < main {
        if P == 1 && i % per_line == 0 {
            for p in w {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + i * size) as *const i8);
            }
        }
        for k in 0..R {
            // SAFETY: `i + 8 <= n` (caller's bounds).
            let wv = unsafe { load8::<FMT>(w[k], i) };
            for q in 0..P {
                // SAFETY: as above, for `x[q]`.
                let xv = unsafe { _mm256_loadu_ps(x[q].add(i)) };
                acc[k][q] = _mm256_fmadd_ps(wv, xv, acc[k][q]);
            }
        }
        i += 8;
    }
    let mut out = [[0f32; P]; R];
    for k in 0..R {
        for q in 0..P {
            let mut s = hsum(acc[k][q]);
            for j in main..n {
                // SAFETY: `j < n` (caller's bounds).
                s = unsafe { load1::<FMT>(w[k], j).mul_add(*x[q].add(j), s) };
            }
            out[k][q] = s;
        }
    }
    out
}

/// Rows of an MXFP4 matrix for `p <= MXFP4_POSITIONS` positions: one row at a time (a
/// single sequential stream of weights) for one position; for several, slabs of
/// [`SLAB`] blocks so the slab's inputs of every position stay in L1 while each row of the
/// tile passes over them, with the accumulators kept between slabs. Either way a (row,
/// position)'s blocks are accumulated in increasing order by the same arithmetic
/// ([`mxfp4_acc`]), so the result does not depend on `p`.
///
/// # Safety
/// As [`rows_impl`]: rows `r0 .. r0 + n` of `blocks`/`scales` and `p` positions in bounds.
#[allow(clippy::too_many_arguments)]
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mxfp4_rows(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    // SAFETY (whole body): bounds forwarded from the caller.
    unsafe { with_positions!(p, mxfp4_tile(blocks, scales, cols, r0, n, xs, out)) }
}

/// How far ahead (bytes of blocks) the one-position MXFP4 kernel prefetches: measured on a
/// Zen 3 core streaming from DRAM, 2-4 KiB ahead read about 20% faster than none, 512 bytes
/// hardly changed anything.
const PREFETCH: usize = 4096;

/// Most positions one MXFP4 kernel call takes.
pub(super) const MXFP4_POSITIONS: usize = 8;
/// Blocks per column slab when several positions share a call (8 positions x 16 blocks of
/// inputs = 16 KiB).
const SLAB: usize = 16;
/// Rows whose accumulators a multi-position call keeps at once.
const SLAB_ROWS: usize = 32;

/// [`mxfp4_rows`] for `P` positions.
///
/// # Safety
/// As [`mxfp4_rows`].
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mxfp4_tile<const P: usize>(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    out: &mut [f32],
) {
    let nb = cols / 32;
    let (bb, sb) = (blocks.as_ptr(), scales.as_ptr());
    let x: [*const f32; P] = std::array::from_fn(|q| xs[q * cols..].as_ptr());
    let c = Fp4Consts::new();
    // SAFETY: rows `r0 + i` for `i < n` are in bounds (caller).
    let row = |i: usize| unsafe { (bb.add((r0 + i) * nb * 16), sb.add((r0 + i) * nb)) };
    if P == 1 {
        for (i, o) in out[..n].iter_mut().enumerate() {
            let (b, s) = row(i);
            let mut acc = [_mm256_setzero_ps(); P];
            // SAFETY: a whole row of `nb` blocks and a position of `cols` f32 (caller).
            unsafe { mxfp4_acc::<P>(b, s, x, 0, nb, c, &mut acc) };
            *o = hsum(acc[0]);
        }
        return;
    }
    let mut acc = [[_mm256_setzero_ps(); P]; SLAB_ROWS];
    for i0 in (0..n).step_by(SLAB_ROWS) {
        let m = SLAB_ROWS.min(n - i0);
        acc[..m].fill([_mm256_setzero_ps(); P]);
        for b0 in (0..nb).step_by(SLAB) {
            let b1 = nb.min(b0 + SLAB);
            for (k, a) in acc[..m].iter_mut().enumerate() {
                let (b, s) = row(i0 + k);
                // Rows lie apart, so the hardware does not see this walk as a stream: fetch
                // the slab of the row after next while this one computes (a hint, harmless
                // past the end).
                let ahead = 2 * nb * 16;
                for off in (16 * b0..16 * b1).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(ahead + off) as *const i8);
                }
                _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(2 * nb + b0) as *const i8);
                // SAFETY: blocks `b0 .. b1 <= nb` of a row and of each position (caller).
                unsafe { mxfp4_acc::<P>(b, s, x, b0, b1, c, a) };
            }
        }
        for (k, a) in acc[..m].iter().enumerate() {
            for q in 0..P {
                out[q * n + i0 + k] = hsum(a[q]);
            }
        }
    }
}

/// The order in which [`decode_block`] yields a block's 32 weights: lane `k` of the four
/// vectors holds element `MXFP4_ORDER[k]` of the block. Kernel inputs are permuted to match once
/// per call ([`mxfp4_permute`]), so the decode needs no interleaving shuffles.
pub(super) const MXFP4_ORDER: [usize; 32] = [
    0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, //
    16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31,
];

/// Rearranges positions of `cols` inputs (a multiple of 32) into [`MXFP4_ORDER`] within each
/// block of 32.
pub(super) fn mxfp4_permute(xs: &[f32], out: &mut [f32]) {
    for (o, x) in out.chunks_exact_mut(32).zip(xs.chunks_exact(32)) {
        for (d, &k) in o.iter_mut().zip(&MXFP4_ORDER) {
            *d = x[k];
        }
    }
}

/// High and low bytes of each FP4 value as bf16 (exact: FP4 values have two mantissa bits),
/// by nibble, in both 128-bit lanes.
const FP4_BF16: ([u8; 32], [u8; 32]) = {
    let mut hi = [0u8; 32];
    let mut lo = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        let bits = super::FP4_LUT[i % 16].to_bits();
        hi[i] = (bits >> 24) as u8;
        lo[i] = (bits >> 16) as u8;
        i += 1;
    }
    (hi, lo)
};

/// Splits MXFP4 blocks into their nibbles (constants loaded once per call); shared by
/// [`decode_block`] and the int8-input kernel.
#[derive(Clone, Copy)]
pub(super) struct NibbleSplit {
    nibble: __m256i,
    shifts: __m256i,
}

impl NibbleSplit {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn new() -> Self {
        Self {
            nibble: _mm256_set1_epi8(0x0f),
            shifts: _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
        }
    }

    /// The 32 nibbles of the block of 16 bytes at `b`, one per byte: the low lane holds the
    /// low nibbles (the block's even elements), the high lane the high ones (odd elements).
    ///
    /// # Safety
    /// The CPU supports the tier and 16 bytes at `b` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn split(self, b: *const u8) -> __m256i {
        // SAFETY: 16 readable bytes (caller); unaligned load.
        let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(b as *const __m128i) });
        _mm256_and_si256(_mm256_srlv_epi32(v, self.shifts), self.nibble)
    }
}

/// Constants of [`decode_block`], loaded once per call.
#[derive(Clone, Copy)]
struct Fp4Consts {
    hi: __m256i,
    lo: __m256i,
    split: NibbleSplit,
    upper: __m256i,
}

impl Fp4Consts {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn new() -> Self {
        // SAFETY: 32-byte tables read unaligned.
        unsafe {
            Self {
                hi: _mm256_loadu_si256(FP4_BF16.0.as_ptr() as *const __m256i),
                lo: _mm256_loadu_si256(FP4_BF16.1.as_ptr() as *const __m256i),
                split: NibbleSplit::new(),
                upper: _mm256_set1_epi32(-65536),
            }
        }
    }
}

/// 32 weights of one MXFP4 block (16 bytes at `b`) as four vectors of 8 f32, unscaled, in
/// [`MXFP4_ORDER`]: the low lane takes the low nibbles (even elements), the high lane the high
/// nibbles, two byte shuffles give each value's bf16 bytes, interleaving those gives bf16 pairs,
/// and a shift or a mask of each pair gives the f32 (7 shuffle-port operations per block).
///
/// # Safety
/// The CPU supports the tier and 16 bytes at `b` are readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_block(b: *const u8, c: Fp4Consts) -> [__m256; 4] {
    // SAFETY: 16 readable bytes (caller).
    let idx = unsafe { c.split.split(b) };
    let hb = _mm256_shuffle_epi8(c.hi, idx);
    let lb = _mm256_shuffle_epi8(c.lo, idx);
    let w0 = _mm256_unpacklo_epi8(lb, hb);
    let w1 = _mm256_unpackhi_epi8(lb, hb);
    // Each 32-bit lane holds two bf16 values: shifting up gives the lower as f32, masking
    // gives the upper (integer operations rather than two more shuffles per vector).
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w0)),
        _mm256_castsi256_ps(_mm256_and_si256(w0, c.upper)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w1)),
        _mm256_castsi256_ps(_mm256_and_si256(w1, c.upper)),
    ]
}

/// Adds blocks `b0 .. b1` of one MXFP4 row (`b`, scales `s`) times `P` positions in
/// [`MXFP4_ORDER`] to `acc`: per position, each block's 32 products are summed in lanes, the
/// sum scaled by the block's E8M0 scale and added to the position's accumulator.
///
/// # Safety
/// The CPU supports the tier; `b` points to `16 * b1` readable bytes, `s` to `b1`, each `x[q]`
/// to `32 * b1` f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn mxfp4_acc<const P: usize>(
    b: *const u8,
    s: *const u8,
    x: [*const f32; P],
    b0: usize,
    b1: usize,
    c: Fp4Consts,
    acc: &mut [__m256; P],
) {
    let mut a = *acc;
    for blk in b0..b1 {
        if P == 1 && blk % 4 == 0 {
            // One position decodes slower than memory streams, and the hardware prefetcher
            // alone then keeps too few lines in flight: ask for the weights (and scales)
            // PREFETCH bytes ahead, once per cache line (a hint, harmless past the end).
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(16 * blk + PREFETCH) as *const i8);
            if blk % 64 == 0 {
                _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(blk + PREFETCH / 16) as *const i8);
            }
        }
        // SAFETY: `blk < b1` (caller's bounds); the CPU supports the tier (caller).
        unsafe {
            let w = decode_block(b.add(16 * blk), c);
            let sc = _mm256_set1_ps(SCALE[*s.add(blk) as usize]);
            for q in 0..P {
                let xp = x[q].add(32 * blk);
                let mut t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
                t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), t);
                t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), t);
                t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), t);
                a[q] = _mm256_fmadd_ps(t, sc, a[q]);
            }
        }
    }
    *acc = a;
}

/// `y[q][o] = Σ_i x[q][i] · W[i, o0 + o]` for `P` positions, with one fused multiply-add per
/// input in increasing `i` for every output (so chunking and grouping never change a value).
/// Four input rows are applied per pass over `y`, which stays in L1.
///
/// # Safety
/// The CPU supports the tier; `w` holds `cols` rows of `ld` elements of format `FMT`,
/// `o0 + n <= ld`, `x` holds `P` positions of `cols` f32 and each `y[q]` has `n` elements.
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_t<const FMT: u8, const P: usize>(
    w: &[u8],
    ld: usize,
    cols: usize,
    o0: usize,
    n: usize,
    x: &[f32],
    y: &mut [&mut [f32]],
) {
    let size = super::code_size(FMT);
    let base = w.as_ptr();
    let n8 = n / 8 * 8;
    for yq in y.iter_mut() {
        yq[..n].fill(0.0);
    }
    let mut i = 0;
    while i < cols {
        let kk = (cols - i).min(4);
        // Input rows i .. i + kk, starting at output o0.
        // SAFETY: `i + k < cols` rows of `ld` elements, `o0 < ld` (caller).
        let rows: [*const u8; 4] =
            std::array::from_fn(|k| unsafe { base.add(((i + k.min(kk - 1)) * ld + o0) * size) });
        let bx: [[__m256; 4]; P] = std::array::from_fn(|q| {
            std::array::from_fn(|k| _mm256_set1_ps(x[q * cols + i + k.min(kk - 1)]))
        });
        let mut j = 0;
        while j < n8 {
            // SAFETY: `j + 8 <= n` and `o0 + n <= ld`.
            let wv: [__m256; 4] = std::array::from_fn(|k| unsafe { load8::<FMT>(rows[k], j) });
            for q in 0..P {
                let yp = y[q][j..j + 8].as_mut_ptr();
                // SAFETY: 8 elements of `y[q]` at `j` (bounds by the slice above).
                unsafe {
                    let mut v = _mm256_loadu_ps(yp);
                    for k in 0..kk {
                        v = _mm256_fmadd_ps(bx[q][k], wv[k], v);
                    }
                    _mm256_storeu_ps(yp, v);
                }
            }
            j += 8;
        }
        // Indexes several outputs at once; an iterator would hide the shared `j`.
        #[allow(clippy::needless_range_loop)]
        for j in n8..n {
            for q in 0..P {
                let mut v = y[q][j];
                for k in 0..kk {
                    // SAFETY: `j < n`, rows as above.
                    v = x[q * cols + i + k].mul_add(unsafe { load1::<FMT>(rows[k], j) }, v);
                }
                y[q][j] = v;
            }
        }
        i += kk;
    }
}

/// Floating-point operations done by a burst of 8-lane fused multiply-adds on 12 independent
/// register accumulators (for [`super::peak_flops`]).
pub(super) fn fma_burst() -> f64 {
    assert!(supported(), "the CPU runs AVX2 and FMA");
    // SAFETY: the CPU supports the tier (asserted above).
    unsafe { fma_burst_impl() }
}

/// # Safety
/// The CPU supports avx2 and fma.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_burst_impl() -> f64 {
    const CHAINS: usize = 12;
    const STEPS: usize = 1 << 14;
    let a = _mm256_set1_ps(std::hint::black_box(0.999_999));
    let b = _mm256_set1_ps(std::hint::black_box(1e-7));
    let mut acc = [_mm256_set1_ps(std::hint::black_box(1.0)); CHAINS];
    for _ in 0..STEPS {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    std::hint::black_box(acc);
    (2 * 8 * CHAINS * STEPS) as f64
}
