//! The AVX-512 ISA (F and BW, with AVX2 + FMA + F16C), for Xeons since Skylake-SP and Zen 4.
//!
//! The same structure as the AVX2 ISA with 16 lanes: one accumulator per (row, position),
//! lane `l` summing elements `i ≡ l (mod 16)` in increasing `i` (for MXFP4, the elements
//! [`MXFP4_ORDER`] puts in lane `l` of each block's two vectors, block after block), a fixed
//! lane reduction and a fused scalar tail; so a position's result never depends on how many
//! rows or positions a call interleaves. With 32 vector registers, dense prefill kernels
//! interleave 4 rows × 4 positions. MXFP4 nibbles index the block's scale's row of a table of
//! exactly dequantized values (FP4 value times E8M0 scale) with one permute (`vpermps`) per 16
//! weights, so a block costs two multiply-adds per position; each half of the block is
//! broadcast from memory to the eight 64-bit lanes and one variable shift per 16 weights
//! brings each lane's nibble to the bits `vpermps` reads, so its weights come out of element
//! order and the inputs are permuted to match ([`MXFP4_ORDER`]). Decode reads a matrix as four
//! sequential streams (rows from the four quarters of a task's range, interleaved) with a
//! software prefetch ahead in each (a distance chosen per CPU family). Prefill (up to 32
//! positions a call) decodes each block of a tile of rows in registers and multiplies it by a
//! tile of up to 8 positions in the same loop, so the decoding's shifts and lookups overlap
//! the multiply-adds ([`mxfp4_fused`]; on Zen 4 1.1-1.5x the kernel that decoded into an L1
//! buffer first, docs/performance.md). Measured on Zen 4 (docs/performance.md); on CPUs without
//! AVX-512 the tests run the ISA in software emulation (`avx512_emulated`), and where it runs
//! natively the runtime self-check guards it.
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Float, Mat, Outs, BF16, F16, F32, FP4_LUT, I8, SCALE};

/// True if this CPU runs the ISA.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && super::avx2::supported()
}

/// Output rows `r0 .. r0 + n` of a row-major matrix (`Dense` or `Mxfp4`) for `p` positions
/// `xs` (`[p, cols]`, `p <= 4`, or [`POSITIONS`] for MXFP4) into `out` (`[p, n]`).
pub(super) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    // Only an ISA the CPU runs is ever chosen, and MXFP4 inputs come permuted for this ISA's
    // decode: a scalar fallback here would give wrong results, not slow ones.
    assert!(supported(), "these kernels need AVX-512 F and BW");
    super::check_rows(w, r0, n, xs, p, out);
    assert!(
        p <= 4 || matches!(w, Mat::Mxfp4 { .. }) && p <= POSITIONS,
        "kernel takes at most 4 positions ({POSITIONS} for MXFP4)"
    );
    // SAFETY: the CPU supports the ISA (checked above) and `check_rows` verified that rows
    // `r0 .. r0 + n`, `p` positions of `xs` and `p * n` outputs are in bounds.
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
        let p = (outs.len() - i).min(4);
        let x = &xs[i * cols..];
        let y = &mut outs[i..i + p];
        macro_rules! go {
            ($f:ident) => {
                // SAFETY: the CPU supports the ISA (checked above); `check_cols_t` verified
                // that the matrix holds `rows * cols` elements, `o0 + n <= rows`, each output
                // has `n` elements and `xs` holds the positions.
                unsafe {
                    match p {
                        1 => dense_t::<$f, 1>(bytes, rows, cols, o0, n, x, y),
                        2 => dense_t::<$f, 2>(bytes, rows, cols, o0, n, x, y),
                        3 => dense_t::<$f, 3>(bytes, rows, cols, o0, n, x, y),
                        _ => dense_t::<$f, 4>(bytes, rows, cols, o0, n, x, y),
                    }
                }
            };
        }
        match fmt {
            Float::F32 => go!(F32),
            Float::BF16 => go!(BF16),
            Float::F16 => go!(F16),
        }
        i += p;
    }
}

/// # Safety
/// The CPU must support the ISA, and the bounds `check_rows` verifies must hold.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
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
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
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
    // Rows `rows[k]`, all positions: one call of the `R x P` kernel.
    macro_rules! run {
        ($r:literal, $p:literal, $rows:expr) => {{
            let rows: [usize; $r] = $rows;
            // SAFETY: every row `r0 + rows[k] < r0 + n` is in bounds (caller), as are the
            // positions.
            let ws: [*const u8; $r] =
                std::array::from_fn(|k| unsafe { base.add((r0 + rows[k]) * row_bytes) });
            let xp: [*const f32; $p] = std::array::from_fn(x);
            // SAFETY: pointers to whole rows of `cols` elements (caller's contract).
            let v = unsafe { dense_dot::<FMT, $r, $p>(ws, xp, cols) };
            for k in 0..$r {
                for q in 0..$p {
                    out[q * n + rows[k]] = v[k][q];
                }
            }
        }};
    }
    macro_rules! sweep {
        ($r:literal, $p:literal) => {{
            let mut i = 0;
            while n - i >= $r {
                run!($r, $p, std::array::from_fn(|k| i + k));
                i += $r;
            }
            while i < n {
                run!(1, $p, [i]);
                i += 1;
            }
        }};
    }
    match p {
        1 => {
            // Decode reads each row once: four rows at a time, one from each quarter of the
            // range, so the matrix is read as four long sequential streams, which the hardware
            // prefetchers follow (four neighbouring rows with a software prefetch of the next
            // four, as the AVX2 ISA does, read the output head at 78% of the speed on Zen 4).
            let q = n / 4;
            for i in 0..q {
                run!(4, 1, [i, q + i, 2 * q + i, 3 * q + i]);
            }
            for i in 4 * q..n {
                run!(1, 1, [i]);
            }
        }
        2 => sweep!(4, 2),
        3 => sweep!(4, 3),
        _ => sweep!(4, 4),
    }
}

/// Loads 16 elements of format `FMT` starting at element `i` of `w`, widened to f32.
///
/// # Safety
/// The CPU supports the ISA and elements `i .. i + 16` are readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn load16<const FMT: u8>(w: *const u8, i: usize) -> __m512 {
    // SAFETY: forwarded from the caller; all loads are unaligned.
    unsafe {
        match FMT {
            F32 => _mm512_loadu_ps(w.add(4 * i) as *const f32),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * i) as *const __m256i)),
            I8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                w.add(i) as *const __m128i
            ))),
            _ => {
                let h = _mm256_loadu_si256(w.add(2 * i) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
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

/// Sums the 16 lanes in a fixed order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let v = _mm256_add_ps(lo, hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// How far ahead in its own stream a one-position kernel prefetches each row's weights (one
/// cache line per line it reads; rows of a stream are contiguous, so near a row's end this is
/// the next row of the stream), unless set: [`super::default_prefetch_ahead`] for this CPU.
/// With the rows read as four sequential streams the hardware prefetchers do most of it; the
/// distance was chosen per CPU family by decoded tokens alternated between two distances in
/// one process (a paired comparison, immune to the host's drifting memory speed): 2 KiB on
/// Zen 5 and the Xeon, 512 bytes on Zen 4 (docs/performance.md).
static AHEAD_NOW: AtomicUsize = AtomicUsize::new(UNSET);

/// [`AHEAD_NOW`] before the first use picks the CPU's default.
const UNSET: usize = usize::MAX;

/// Sets [`AHEAD_NOW`].
pub(super) fn set_ahead(bytes: usize) {
    AHEAD_NOW.store(bytes.min(UNSET - 1), Ordering::Relaxed);
}

/// [`AHEAD_NOW`], the CPU's default until set.
pub(super) fn ahead() -> usize {
    match AHEAD_NOW.load(Ordering::Relaxed) {
        UNSET => {
            let d = super::default_prefetch_ahead(super::CpuId::get().as_ref());
            // A race with `set_ahead` keeps whichever value was set.
            let _ = AHEAD_NOW.compare_exchange(UNSET, d, Ordering::Relaxed, Ordering::Relaxed);
            AHEAD_NOW.load(Ordering::Relaxed)
        }
        v => v,
    }
}

/// Dot products of `R` rows with `P` positions, `n` elements each; with one position (decode)
/// each row is prefetched [`ahead`] bytes ahead.
///
/// # Safety
/// The CPU supports the ISA; each `w[k]` points to `n` readable elements of format `FMT` and
/// each `x[q]` to `n` readable f32. (The prefetches may point past the matrix: a hint.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dense_dot<const FMT: u8, const R: usize, const P: usize>(
    w: [*const u8; R],
    x: [*const f32; P],
    n: usize,
) -> [[f32; P]; R] {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let main = n / 16 * 16;
    let size = super::code_size(FMT);
    let ahead = if P == 1 { ahead() } else { 0 };
    let mut i = 0;
    while i < main {
        if P == 1 && (i * size).is_multiple_of(64) {
            for p in w {
                // A hint: harmless past the end.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i * size + ahead) as *const i8);
            }
        }
        for k in 0..R {
            // SAFETY: `i + 16 <= n` (caller's bounds).
            let wv = unsafe { load16::<FMT>(w[k], i) };
            for q in 0..P {
                // SAFETY: as above, for `x[q]`.
                let xv = unsafe { _mm512_loadu_ps(x[q].add(i)) };
                acc[k][q] = _mm512_fmadd_ps(wv, xv, acc[k][q]);
            }
        }
        i += 16;
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

/// Rows of an MXFP4 matrix for `p <= POSITIONS` positions.
///
/// Every (row, position) is the same computation whatever `p` and `n`: its weights dequantized
/// exactly ([`decode`]: each FP4 value times its block's E8M0 scale, as
/// [`mxfp4_value`](super::mxfp4_value) gives it), then one 16-lane accumulator takes two fused
/// multiply-adds per block (its two vectors in [`MXFP4_ORDER`], against inputs permuted to
/// match), block after block, and [`hsum`] reduces
/// the lanes. One position ([`mxfp4_dot`]) streams four rows at a time (one from each quarter
/// of the range), decoding in registers;
/// several ([`mxfp4_fused`]) decode each block of a tile of rows in registers and multiply it
/// by a tile of positions at once. So a block of positions gets exactly what each position
/// gets alone.
///
/// # Safety
/// As [`rows_impl`]: rows `r0 .. r0 + n` of `blocks`/`scales` and `p` positions in bounds.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
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
    let nb = cols / 32;
    let (bb, sb) = (blocks.as_ptr(), scales.as_ptr());
    if p > 1 {
        // SAFETY: bounds forwarded from the caller.
        return unsafe { mxfp4_fused(bb, sb, nb, r0, n, xs, p, out) };
    }
    let x = xs.as_ptr();
    let c = Shifts::new();
    // SAFETY: rows `r0 + i` for `i < n` are in bounds (caller).
    let row = |i: usize| unsafe { (bb.add((r0 + i) * nb * 16), sb.add((r0 + i) * nb)) };
    macro_rules! run {
        ($r:literal, $rows:expr) => {{
            let rows: [usize; $r] = $rows;
            let b: [*const u8; $r] = std::array::from_fn(|k| row(rows[k]).0);
            let s: [*const u8; $r] = std::array::from_fn(|k| row(rows[k]).1);
            // SAFETY: whole rows of `nb` blocks and a position of `cols` f32 (caller).
            let v = unsafe { mxfp4_dot::<$r>(b, s, x, nb, c) };
            for k in 0..$r {
                out[rows[k]] = v[k];
            }
        }};
    }
    // Four rows at a time, one from each quarter of the range: four long sequential streams of
    // blocks and of scales, as `dense_rows` reads its rows.
    let q = n / 4;
    for i in 0..q {
        run!(4, [i, q + i, 2 * q + i, 3 * q + i]);
    }
    for i in 4 * q..n {
        run!(1, [i]);
    }
}

/// Most positions one MXFP4 call takes: the weights are decoded once per call, so all of an
/// expert's positions in a prefill block of 128 tokens (about 16 on GPT-OSS) share one decode.
pub(super) const POSITIONS: usize = 32;
/// Most rows whose accumulators [`mxfp4_fused`] keeps at once (at up to 8 positions; fewer
/// beyond, [`ACC_VECTORS`]): half the AVX2 ISA's 64, since each accumulator is twice the size.
const MAX_ROWS: usize = 32;
/// Accumulator vectors [`mxfp4_fused`] keeps per group of rows (16 KiB, half of Zen 4's L1
/// data cache): fewer rows per group as positions grow (32 rows at 8 positions, 8 at 32), so
/// that the accumulators a slab walks stay in L1 beside the inputs; rows are packed `p`
/// positions apart. On the Xeon (family 6, model 207), against 32 rows at every count with
/// rows `POSITIONS` apart, eight alternations of `cargo bench -p stormo-engine --bench
/// kernel_min -- mxfp4 P 40 avx512`: 2-14% faster at 32 positions, from 2% slower to 8%
/// faster at 8 and 16 (one run 13%); the prefill's experts phase 3-6% faster (measured with
/// the kernel before [`mxfp4_fused`], which decoded into an L1 buffer first).
const ACC_VECTORS: usize = 256;

/// Every dequantized MXFP4 value by E8M0 scale byte: entry `s` holds
/// [`mxfp4_value`](super::mxfp4_value)`(nibble, s)` for the 16 nibbles (one 64-byte line per
/// scale; at scales 253 and 254 the larger values overflow to ±inf, as dequantizing does).
#[repr(C, align(64))]
struct Scaled([[f32; 16]; 256]);

static SCALED: Scaled = {
    let mut t = [[0f32; 16]; 256];
    let mut s = 0;
    while s < 256 {
        let mut i = 0;
        while i < 16 {
            let v = FP4_LUT[i];
            t[s][i] = if v == 0.0 { v } else { v * SCALE[s] };
            i += 1;
        }
        s += 1;
    }
    Scaled(t)
};

/// The order in which [`decode`] yields a block's 32 weights: lane `l` of its two vectors holds
/// element `MXFP4_ORDER[l]` (the first vector) or `MXFP4_ORDER[16 + l]` of the block. The first
/// vector sees the block's first 8 bytes (elements 0 to 15, two per byte, low nibble first),
/// the second its last 8; lane `l` takes nibble `l / 2` of the low (even `l`) or high (odd `l`)
/// 32-bit half of those bytes.
pub(super) const MXFP4_ORDER: [usize; 32] = {
    let mut o = [0; 32];
    let mut l = 0;
    while l < 16 {
        o[l] = 8 * (l % 2) + l / 2;
        o[16 + l] = 16 + o[l];
        l += 1;
    }
    o
};

/// Rearranges positions of `cols` inputs (a multiple of 32) into [`MXFP4_ORDER`] within each
/// block of 32.
pub(super) fn mxfp4_permute(xs: &[f32], out: &mut [f32]) {
    super::permute_blocks(&MXFP4_ORDER, xs, out);
}

/// Bit offsets of [`decode`]'s nibbles: lanes `2i` and `2i + 1` shift their 32 bits right by
/// `4i`.
#[derive(Clone, Copy)]
struct Shifts(__m512i);

impl Shifts {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    fn new() -> Self {
        Self(_mm512_setr_epi32(
            0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28,
        ))
    }
}

/// The 32 weights of one MXFP4 block (16 bytes at `b`, E8M0 scale byte `s`) dequantized, in
/// [`MXFP4_ORDER`]: each half of the block (8 bytes) is broadcast to the eight 64-bit lanes
/// (a load, no shuffle), one variable shift brings each 32-bit lane's nibble to its low four
/// bits, and `vpermps`, which reads only those, looks it up in the scale's [`SCALED`] row. Per
/// block: two shifts, two permutes, and the two multiply-adds of the caller. Zen 4 issues two
/// 512-bit operations a cycle, so that is about three cycles per block at best; broadcasting
/// the whole block to the four 128-bit lanes, as this ISA did first, is a shuffle, and
/// measured 11-17% slower there (docs/performance.md, Zen 4).
///
/// # Safety
/// The CPU supports the ISA and 16 bytes at `b` are readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn decode(b: *const u8, s: u8, c: Shifts) -> [__m512; 2] {
    // SAFETY: 16 readable bytes (caller); the table row is 64 bytes.
    let (lo, hi, t) = unsafe {
        (
            _mm512_set1_epi64((b as *const i64).read_unaligned()),
            _mm512_set1_epi64((b.add(8) as *const i64).read_unaligned()),
            _mm512_loadu_ps(SCALED.0[s as usize].as_ptr()),
        )
    };
    [
        _mm512_permutexvar_ps(_mm512_srlv_epi32(lo, c.0), t),
        _mm512_permutexvar_ps(_mm512_srlv_epi32(hi, c.0), t),
    ]
}

/// The dot products of `R` MXFP4 rows (`nb` blocks each) with one position `x`, by
/// [`mxfp4_rows`]' arithmetic; each row's blocks are prefetched [`ahead`] bytes ahead.
///
/// # Safety
/// The CPU supports the ISA; each `b[k]` points to `16 * nb` readable bytes, each `s[k]` to
/// `nb`, `x` to `32 * nb` f32. (The prefetches may point past the matrix: a hint.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn mxfp4_dot<const R: usize>(
    b: [*const u8; R],
    s: [*const u8; R],
    x: *const f32,
    nb: usize,
    c: Shifts,
) -> [f32; R] {
    let mut acc = [_mm512_setzero_ps(); R];
    let ahead = ahead();
    for blk in 0..nb {
        if blk.is_multiple_of(4) {
            for p in b {
                // A hint: harmless past the end.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(blk * 16 + ahead) as *const i8);
            }
        }
        // SAFETY: block `blk < nb` of every row and of the position (caller).
        unsafe {
            let (x0, x1) = (
                _mm512_loadu_ps(x.add(32 * blk)),
                _mm512_loadu_ps(x.add(32 * blk + 16)),
            );
            for k in 0..R {
                let [w0, w1] = decode(b[k].add(16 * blk), *s[k].add(blk), c);
                acc[k] = _mm512_fmadd_ps(w1, x1, _mm512_fmadd_ps(w0, x0, acc[k]));
            }
        }
    }
    acc.map(|v| hsum(v))
}

/// Rows of a group at `p` positions: as many as keep their accumulators within
/// [`ACC_VECTORS`], a multiple of 4 (the tiles' row counts are 1, 2, 4 and 8), at most
/// [`MAX_ROWS`].
fn group_rows(p: usize) -> usize {
    (ACC_VECTORS / p / 4 * 4).clamp(4, MAX_ROWS)
}

thread_local! {
    /// [`mxfp4_fused`]'s accumulators (16 KiB), kept by each thread between calls (taken
    /// while in use).
    static BLOCK_SCRATCH: std::cell::Cell<Vec<__m512>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Blocks per column slab of [`mxfp4_fused`]: a tile of 8 positions' inputs over a slab is
/// 16 KiB. On Zen 4 (one thread, 8 to 32 positions) slabs of 8 blocks were 2-6% slower, of 4
/// blocks 5-12%; 4 blocks with 8 KiB of accumulators were no faster in a 24-layer prefill.
const FUSED_SLAB: usize = 16;

/// [`mxfp4_rows`] for `2 <= p <= POSITIONS` positions, decoding in registers: the positions
/// are split into tiles of at most 8, and for each column slab of [`FUSED_SLAB`] blocks and
/// each tile of positions, tiles of rows (2 rows at 5-8 positions, 4 at 3-4, 8 at 2) decode
/// their blocks and multiply them at once ([`fused`]), so the decoding's shifts and lookups
/// run beside the multiply-adds rather than in a loop of their own. The group's
/// accumulators live in the thread's scratch between slabs.
///
/// # Safety
/// As [`mxfp4_rows`], with `bb`/`sb` the matrix's blocks and scales and `nb` its blocks per
/// row.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn mxfp4_fused(
    bb: *const u8,
    sb: *const u8,
    nb: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    debug_assert!((2..=POSITIONS).contains(&p));
    let cols = nb * 32;
    let c = Shifts::new();
    let mut scratch = BLOCK_SCRATCH.take();
    scratch.resize(ACC_VECTORS, _mm512_setzero_ps());
    let acc = &mut scratch[..];
    let rows = group_rows(p);
    // Tiles of positions as equal as possible, at most 8 each.
    let tiles = p.div_ceil(8);
    for g0 in (0..n).step_by(rows) {
        let g = rows.min(n - g0);
        acc[..g * p].fill(_mm512_setzero_ps());
        for b0 in (0..nb).step_by(FUSED_SLAB) {
            let k = FUSED_SLAB.min(nb - b0);
            super::prefetch_slab_ahead(bb, nb, r0, n, g0, rows, b0, FUSED_SLAB);
            let mut q = 0;
            for t in 0..tiles {
                let qn = (p - q) / (tiles - t);
                let mut i = 0;
                while i < g {
                    // SAFETY: rows `g0 + i ..` of the group and positions `q .. q + qn <= p`
                    // (caller); accumulator `(i, q)` and beyond lie within `g * p`.
                    unsafe {
                        let row = r0 + g0 + i;
                        let b = bb.add(row * nb * 16 + 16 * b0);
                        let s = sb.add(row * nb + b0);
                        let x = xs.as_ptr().add(q * cols + 32 * b0);
                        let a = acc.as_mut_ptr().add(i * p + q);
                        macro_rules! go {
                            ($r:literal, $q:literal) => {{
                                if g - i >= $r {
                                    fused::<$r, $q>(b, s, nb, x, cols, k, a, p, c);
                                    $r
                                } else {
                                    fused::<1, $q>(b, s, nb, x, cols, k, a, p, c);
                                    1
                                }
                            }};
                        }
                        i += match qn {
                            8 => go!(2, 8),
                            7 => go!(2, 7),
                            6 => go!(2, 6),
                            5 => go!(2, 5),
                            4 => go!(4, 4),
                            3 => go!(4, 3),
                            _ => go!(8, 2),
                        };
                    }
                }
                q += qn;
            }
        }
        for (i, a) in acc[..g * p].chunks_exact(p).enumerate() {
            for (q, v) in a.iter().enumerate() {
                out[q * n + g0 + i] = hsum(*v);
            }
        }
    }
    BLOCK_SCRATCH.set(scratch);
}

/// Adds blocks `0 .. k` of `R` rows (`b`, `s`: the first row's weights and scales at the
/// slab's first block, rows `nb` blocks apart) times `Q` positions (`x`: the slab's first
/// input of the first position, positions `cols` apart) to the accumulators at `acc` (row
/// `r`, position `q` at `acc + r * p + q`), decoding each block once in registers, by
/// [`mxfp4_rows`]' arithmetic.
///
/// # Safety
/// The CPU supports the ISA; `R` rows of `k` blocks at `b`/`s`, `Q` positions of `32 * k`
/// readable f32 at `x`, and the `R x Q` accumulators are in bounds.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn fused<const R: usize, const Q: usize>(
    b: *const u8,
    s: *const u8,
    nb: usize,
    x: *const f32,
    cols: usize,
    k: usize,
    acc: *mut __m512,
    p: usize,
    c: Shifts,
) {
    // SAFETY (whole body): the bounds above (caller).
    unsafe {
        let at = |r: usize, q: usize| acc.add(r * p + q);
        let mut a: [[__m512; Q]; R] = std::array::from_fn(|r| std::array::from_fn(|q| *at(r, q)));
        for blk in 0..k {
            let w: [[__m512; 2]; R] = std::array::from_fn(|r| {
                decode(b.add(r * nb * 16 + 16 * blk), *s.add(r * nb + blk), c)
            });
            for q in 0..Q {
                let x0 = _mm512_loadu_ps(x.add(q * cols + 32 * blk));
                let x1 = _mm512_loadu_ps(x.add(q * cols + 32 * blk + 16));
                for (ar, wr) in a.iter_mut().zip(&w) {
                    ar[q] = _mm512_fmadd_ps(wr[1], x1, _mm512_fmadd_ps(wr[0], x0, ar[q]));
                }
            }
        }
        for (r, ar) in a.iter().enumerate() {
            for (q, v) in ar.iter().enumerate() {
                *at(r, q) = *v;
            }
        }
    }
}

/// `y[q][o] = Σ_i x[q][i] · W[i, o0 + o]` for `P` positions, one fused multiply-add per input
/// in increasing `i` for every output; four input rows per pass over `y`.
///
/// # Safety
/// The CPU supports the ISA; `w` holds `cols` rows of `ld` elements of format `FMT`,
/// `o0 + n <= ld`, `x` holds `P` positions of `cols` f32 and each `y[q]` has `n` elements.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
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
    let n16 = n / 16 * 16;
    for yq in y.iter_mut() {
        yq[..n].fill(0.0);
    }
    let mut i = 0;
    while i < cols {
        let kk = (cols - i).min(4);
        // SAFETY: `i + k < cols` rows of `ld` elements, `o0 < ld` (caller).
        let rows: [*const u8; 4] =
            std::array::from_fn(|k| unsafe { base.add(((i + k.min(kk - 1)) * ld + o0) * size) });
        let bx: [[__m512; 4]; P] = std::array::from_fn(|q| {
            std::array::from_fn(|k| _mm512_set1_ps(x[q * cols + i + k.min(kk - 1)]))
        });
        let mut j = 0;
        while j < n16 {
            // SAFETY: `j + 16 <= n` and `o0 + n <= ld`.
            let wv: [__m512; 4] = std::array::from_fn(|k| unsafe { load16::<FMT>(rows[k], j) });
            for q in 0..P {
                let yp = y[q][j..j + 16].as_mut_ptr();
                // SAFETY: 16 elements of `y[q]` at `j` (bounds by the slice above).
                unsafe {
                    let mut v = _mm512_loadu_ps(yp);
                    for k in 0..kk {
                        v = _mm512_fmadd_ps(bx[q][k], wv[k], v);
                    }
                    _mm512_storeu_ps(yp, v);
                }
            }
            j += 16;
        }
        // Indexes several outputs at once; an iterator would hide the shared `j`.
        #[allow(clippy::needless_range_loop)]
        for j in n16..n {
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

/// Floating-point operations done by a burst of 16-lane fused multiply-adds on 12 independent
/// register accumulators (for [`super::peak_flops`]).
pub(super) fn fma_burst() -> f64 {
    assert!(supported(), "the CPU runs AVX-512");
    // SAFETY: the CPU supports the ISA (asserted above).
    unsafe { fma_burst_impl() }
}

/// # Safety
/// The CPU supports avx512f.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn fma_burst_impl() -> f64 {
    const CHAINS: usize = 12;
    const STEPS: usize = 1 << 14;
    let a = _mm512_set1_ps(std::hint::black_box(0.999_999));
    let b = _mm512_set1_ps(std::hint::black_box(1e-7));
    let mut acc = [_mm512_set1_ps(std::hint::black_box(1.0)); CHAINS];
    for _ in 0..STEPS {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    std::hint::black_box(acc);
    (2 * 16 * CHAINS * STEPS) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every position count's group of rows fits the scratch's accumulators.
    #[test]
    fn groups_fit_the_accumulator_scratch() {
        for p in 2..=POSITIONS {
            let rows = group_rows(p);
            assert!((4..=MAX_ROWS).contains(&rows), "{p} positions: {rows} rows");
            assert!(rows * p <= ACC_VECTORS, "{p} positions: {rows} rows");
        }
    }
}
