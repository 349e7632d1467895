//! The AVX2 + FMA + F16C ISA (x86-64 since Haswell / Zen).
//!
//! The kernels compute the scalar reference's arithmetic (`scalar`: sixteen lanes of fused
//! multiply-adds and a fixed reduction), so they give its bits. Row-major kernels keep one
//! 16-lane accumulator per (row, position) in two 8-lane registers: for dense rows, lane `l`
//! of the pair sums the products of elements `i ≡ l (mod 16)` in increasing `i`, then
//! [`hsum16`] reduces the lanes in the reference's order and a scalar tail adds the leftover
//! elements with fused multiply-adds. How many rows (`R`) and positions (`P`) one call
//! interleaves changes only which loads are shared, never a position's arithmetic, so a block
//! of positions gets exactly what each position gets alone.
//!
//! MXFP4 weights are dequantized exactly on the fly, never copied out of the checkpoint's
//! format: two byte shuffles of per-scale tables give each nibble's value times its block's
//! scale as bf16 bytes, which widen to f32 (see [`decode_scaled`]). The decode yields a
//! block's weights in its own order ([`MXFP4_ORDER`]): four vectors, the first two of the
//! block's first half, the last two of the same lanes' elements of its second half. An
//! accumulator's first register takes the first and third, its second register the second
//! and fourth, and [`hsum_mxfp4`] reduces them in the reference's order.

use std::arch::x86_64::*;
use std::cell::Cell;

use super::{Float, Mat, Outs, BF16, F16, F32, I8, SCALE};

/// True if this CPU runs the ISA.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Output rows `r0 .. r0 + n` of a row-major matrix (`Dense` or `Mxfp4`) for `p` positions
/// `xs` (`[p, cols]`, `p <= 4`, or [`MXFP4_POSITIONS`] for MXFP4) into `out` (`[p, n]`).
pub(super) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    // Only an ISA the CPU runs is ever chosen, and MXFP4 inputs come permuted for this ISA's
    // decode: a scalar fallback here would give wrong results, not slow ones.
    assert!(supported(), "these kernels need AVX2, FMA and F16C");
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
        // SAFETY: the CPU supports the ISA (checked above); `check_cols_t` verified that the
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
    // At most twelve accumulator registers (two per row and position) of the sixteen.
    match p {
        1 => sweep!(4, 1),
        2 => sweep!(3, 2),
        3 => sweep!(2, 3),
        _ => sweep!(1, 4),
    }
}

/// Loads 8 elements of format `FMT` starting at element `i` of `w`, widened to f32.
///
/// # Safety
/// The CPU supports the ISA and elements `i .. i + 8` are readable.
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

/// Sums the 8 lanes in a fixed order: `l + 4`, then `l + 2`, then `l + 1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Sums a dense accumulator's 16 lanes (lanes 0 to 7 in `a[0]`, 8 to 15 in `a[1]`) in the
/// reference's order (`scalar::reduce`): `l + 8`, then [`hsum`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum16(a: [__m256; 2]) -> f32 {
    hsum(_mm256_add_ps(a[0], a[1]))
}

/// Sums an MXFP4 accumulator's 16 lanes in the reference's order. Its registers hold, by lane,
/// the block elements (of the first half; the second half's are the same plus 16)
/// `[0, 4, 8, 12, 1, 5, 9, 13]` and `[2, 6, 10, 14, 3, 7, 11, 15]` ([`MXFP4_ORDER`]); the
/// reference's lanes hold elements `0, 8, 1, 9, …` (`scalar::MXFP4_LANE`), so its tree sums,
/// by element, `e + (e + 4)` for `e` in 0..4 and 8..12, then those `+ 2`, then `+ 1`, then the
/// halves 0..8 and 8..16. Here: one horizontal add gives the first level (`0+4, 8+12, 2+6,
/// 10+14 | 1+5, 9+13, 3+7, 11+15`), a shuffle the second (lanes `l` and `l + 2` of each
/// 128-bit half), the 128-bit halves' sum the third, and the last two lanes the fourth.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_mxfp4(a: [__m256; 2]) -> f32 {
    let h = _mm256_hadd_ps(a[0], a[1]);
    let u = _mm256_add_ps(h, _mm256_permute_ps::<0b11_10_11_10>(h));
    let s = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps::<1>(u));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Dot products of `R` consecutive rows with `P` positions, `n` elements each (`2 R P`
/// accumulator registers: at most 12 of the 16 leave room for the loads). With one
/// position (decode) it also prefetches, a cache line at a time, the next `R` rows: each row
/// is a stream too short for the hardware prefetcher to ramp up before it ends
/// (docs/performance.md, Zen 4).
///
/// # Safety
/// The CPU supports the ISA; each `w[k]` points to `n` readable elements of format `FMT` and
/// each `x[q]` to `n` readable f32. (The prefetches may point past the matrix: a hint.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_dot<const FMT: u8, const R: usize, const P: usize>(
    w: [*const u8; R],
    x: [*const f32; P],
    n: usize,
) -> [[f32; P]; R] {
    let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
    let main = n / 16 * 16;
    let size = super::code_size(FMT);
    let (per_line, ahead) = (64 / size, R * n * size);
    let mut i = 0;
    while i < main {
        if P == 1 && i % per_line < 16 {
            for p in w {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + i * size) as *const i8);
            }
        }
        for (wk, ak) in w.iter().zip(&mut acc) {
            for h in 0..2 {
                // SAFETY: `i + 16 <= n` (caller's bounds).
                let wv = unsafe { load8::<FMT>(*wk, i + 8 * h) };
                for (xq, aq) in x.iter().zip(ak.iter_mut()) {
                    // SAFETY: as above, for `x[q]`.
                    let xv = unsafe { _mm256_loadu_ps(xq.add(i + 8 * h)) };
                    aq[h] = _mm256_fmadd_ps(wv, xv, aq[h]);
                }
            }
        }
        i += 16;
    }
    let mut out = [[0f32; P]; R];
    for k in 0..R {
        for q in 0..P {
            let mut s = hsum16(acc[k][q]);
            for j in main..n {
                // SAFETY: `j < n` (caller's bounds).
                s = unsafe { load1::<FMT>(w[k], j).mul_add(*x[q].add(j), s) };
            }
            out[k][q] = s;
        }
    }
    out
}

/// Rows of an MXFP4 matrix for `p <= MXFP4_POSITIONS` positions.
///
/// Every (row, position) is the same computation whatever `p` and `n`: its weights dequantized
/// exactly ([`decode_scaled`]: each FP4 value times its block's E8M0 scale, as
/// [`mxfp4_value`](super::mxfp4_value) gives it), then one accumulator of two 8-lane
/// registers takes a fused multiply-add per vector of 8 weights (the block's first and third
/// vectors into the first register, its second and fourth into the second, block after block),
/// and [`hsum_mxfp4`] reduces the lanes: the reference's arithmetic. One position
/// ([`mxfp4_dot`]) streams four rows at a time, decoding in registers; up to
/// [`FUSED_POSITIONS`] ([`mxfp4_fused`]) decode each row's blocks in registers and multiply
/// them by tiles of up to 4 positions; more ([`mxfp4_block`]) decode a slab of rows into an
/// L1 buffer once and multiply it by every position in register tiles. So a block of
/// positions gets exactly what each position gets alone.
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
    let nb = cols / 32;
    let (bb, sb) = (blocks.as_ptr(), scales.as_ptr());
    if p > 1 {
        // SAFETY: bounds forwarded from the caller.
        return unsafe {
            if p <= FUSED_POSITIONS {
                mxfp4_fused(bb, sb, nb, r0, n, xs, p, out)
            } else {
                mxfp4_block(bb, sb, nb, r0, n, xs, p, out)
            }
        };
    }
    let x = xs.as_ptr();
    let c = Fp4Consts::new();
    // SAFETY: rows `r0 + i` for `i < n` are in bounds (caller).
    let row = |i: usize| unsafe { (bb.add((r0 + i) * nb * 16), sb.add((r0 + i) * nb)) };
    macro_rules! run {
        ($r:literal, $i:expr) => {{
            let i = $i;
            let b: [*const u8; $r] = std::array::from_fn(|k| row(i + k).0);
            let s: [*const u8; $r] = std::array::from_fn(|k| row(i + k).1);
            // SAFETY: whole rows of `nb` blocks and a position of `cols` f32 (caller).
            let v = unsafe { mxfp4_dot::<$r>(b, s, x, nb, c) };
            out[i..i + $r].copy_from_slice(&v);
        }};
    }
    let mut i = 0;
    while n - i >= 4 {
        run!(4, i);
        i += 4;
    }
    match n - i {
        3 => run!(3, i),
        2 => run!(2, i),
        1 => run!(1, i),
        _ => {}
    }
}

/// Most positions one MXFP4 kernel call takes: the weights are decoded once per call, so all
/// of an expert's positions in a prefill block of 128 tokens (about 16 on GPT-OSS) share one.
pub(super) const MXFP4_POSITIONS: usize = 32;
/// Rows [`mxfp4_block`] decodes at once.
const CHUNK_ROWS: usize = 16;
/// Rows whose accumulators [`mxfp4_block`] keeps at once (the largest prefill tile).
const MAX_ROWS: usize = 64;
/// Accumulator registers [`mxfp4_block`] keeps per group of rows (16 KiB): fewer rows per
/// group as positions grow, so the accumulators a slab walks stay in L1 beside the slab and
/// the inputs (as the AVX-512 ISA's `ACC_VECTORS`).
const ACC_VECTORS: usize = 512;
/// Blocks per slab in [`mxfp4_block`]: one cache line of each row's weights, 512 bytes of
/// inputs per position, so the decoded slab (8 KiB) and the inputs it meets stay in L1.
const SLAB: usize = 4;

/// The dot products of `R` consecutive rows (`b`, `s`: each row's blocks and scales) with one
/// position `x` in [`MXFP4_ORDER`]: per row one accumulator (two registers), four fused
/// multiply-adds per block. Four rows give the core eight independent chains (one alone waits
/// on each multiply-add's latency); while they compute, the next `R` rows are prefetched, a
/// line at a time (each row is a stream too short for the hardware prefetcher to ramp up on).
///
/// # Safety
/// The CPU supports the ISA; each `b[k]` points to `16 * nb` readable bytes, `s[k]` to `nb`,
/// `x` to `32 * nb` f32. (The prefetches may point past the matrix: a hint.)
#[inline(always)]
unsafe fn mxfp4_dot<const R: usize>(
    b: [*const u8; R],
    s: [*const u8; R],
    x: *const f32,
    nb: usize,
    c: Fp4Consts,
) -> [f32; R] {
    let mut a = [[_mm256_setzero_ps(); 2]; R];
    let ahead = R * nb * 16;
    for blk in 0..nb {
        if blk % 4 == 0 {
            for bk in b {
                _mm_prefetch::<_MM_HINT_T0>(bk.wrapping_add(ahead + 16 * blk) as *const i8);
            }
            if blk % 64 == 0 {
                for sk in s {
                    _mm_prefetch::<_MM_HINT_T0>(sk.wrapping_add(R * nb + blk) as *const i8);
                }
            }
        }
        // SAFETY: block `blk < nb` of every row and of the position (caller).
        unsafe {
            let xp = x.add(32 * blk);
            for k in 0..R {
                let w = decode_scaled(b[k].add(16 * blk), *s[k].add(blk), c);
                let mut acc = a[k];
                for (j, wv) in w.iter().enumerate() {
                    acc[j % 2] = _mm256_fmadd_ps(*wv, _mm256_loadu_ps(xp.add(8 * j)), acc[j % 2]);
                }
                a[k] = acc;
            }
        }
    }
    a.map(|v| hsum_mxfp4(v))
}

/// Vectors of [`mxfp4_block`]'s scratch: a group's accumulators ([`ACC_VECTORS`]: at most
/// that many whatever the positions, as [`group_rows`] chooses), then the slab of dequantized
/// weights (`CHUNK_ROWS` rows of `SLAB` blocks of four vectors in [`MXFP4_ORDER`]).
const SCRATCH: usize = ACC_VECTORS + CHUNK_ROWS * SLAB * 4;

/// Rows of a group at `p` positions (a pair of registers each): as many as keep their
/// accumulators within [`ACC_VECTORS`], at most [`MAX_ROWS`].
fn group_rows(p: usize) -> usize {
    (ACC_VECTORS / (2 * p)).clamp(4, MAX_ROWS)
}

thread_local! {
    /// [`mxfp4_block`]'s scratch (24 KiB), kept by each thread between calls instead of being
    /// set up on the stack by every call (taken while in use).
    static BLOCK_SCRATCH: Cell<Vec<__m256>> = const { Cell::new(Vec::new()) };
}

/// [`mxfp4_rows`] for `2 <= p <= MXFP4_POSITIONS` positions: groups of up to [`MAX_ROWS`]
/// rows (fewer as positions grow: [`group_rows`]), walked in slabs of [`SLAB`] blocks. For
/// each slab, chunk after chunk of [`CHUNK_ROWS`] rows is decoded once into an L1 buffer,
/// then tiles of 3 (or 2) rows x 2 positions multiply it ([`mxfp4_tile`]: twelve accumulator
/// registers, each input vector loaded once for the tile's rows, each weight vector once for
/// two positions). The accumulators of the group's (row,
/// position)s live in the thread's scratch between slabs, so each slab of inputs meets all the
/// group's rows while it is in L1.
///
/// # Safety
/// As [`mxfp4_rows`], with `bb`/`sb` the matrix's blocks and scales and `nb` its blocks per
/// row.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mxfp4_block(
    bb: *const u8,
    sb: *const u8,
    nb: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    debug_assert!((2..=MXFP4_POSITIONS).contains(&p));
    let cols = nb * 32;
    let c = Fp4Consts::new();
    let mut scratch = BLOCK_SCRATCH.take();
    scratch.resize(SCRATCH, _mm256_setzero_ps());
    // The accumulators of every row of a group, packed `p` positions apart, so each slab of
    // inputs, once in L1, meets all the group's rows before the next slab.
    let stride = 2 * p;
    let rows = group_rows(p);
    let (acc, slab) = scratch.split_at_mut(ACC_VECTORS);
    for g0 in (0..n).step_by(rows) {
        let g = rows.min(n - g0);
        acc[..g * stride].fill(_mm256_setzero_ps());
        for b0 in (0..nb).step_by(SLAB) {
            let k = SLAB.min(nb - b0);
            super::prefetch_slab_ahead(bb, nb, r0, n, g0, rows, b0, SLAB);
            for c0 in (0..g).step_by(CHUNK_ROWS) {
                let m = CHUNK_ROWS.min(g - c0);
                for (i, dst) in slab.chunks_exact_mut(SLAB * 4).take(m).enumerate() {
                    let row = r0 + g0 + c0 + i;
                    // SAFETY: row `row < r0 + n` and blocks `b0 .. b0 + k <= nb` (caller).
                    let (b, s) =
                        unsafe { (bb.add(row * nb * 16 + 16 * b0), sb.add(row * nb + b0)) };
                    for (j, d) in dst.chunks_exact_mut(4).take(k).enumerate() {
                        // SAFETY: block `b0 + j` of the row (above).
                        let w = unsafe { decode_scaled(b.add(16 * j), *s.add(j), c) };
                        d.copy_from_slice(&w);
                    }
                }
                let mut i = 0;
                while i < m {
                    // Three rows per tile where they divide evenly enough (16 rows: 3, 3, 3,
                    // 3, 2, 2): with two positions, twelve accumulator registers, independent
                    // chains of multiply-adds that keep both FMA pipes busy through their
                    // latency, where eight just match it.
                    let r = match m - i {
                        1 => 1,
                        2 | 4 => 2,
                        _ => 3,
                    };
                    let mut q = 0;
                    while q < p {
                        // SAFETY: positions `q .. q + 2.min(p - q) <= p` hold `cols` f32 each
                        // and the slab's blocks lie within them (caller); slab rows
                        // `i .. i + r <= m` and accumulator rows `c0 + i + r <= g <= MAX_ROWS`.
                        unsafe {
                            let x = xs.as_ptr().add(q * cols + 32 * b0);
                            let a = acc.as_mut_ptr().add((c0 + i) * stride + 2 * q);
                            let slab = slab.as_ptr();
                            match (r, (p - q).min(2)) {
                                (3, 2) => mxfp4_tile::<3, 2>(slab, i, x, cols, k, a, p),
                                (3, _) => mxfp4_tile::<3, 1>(slab, i, x, cols, k, a, p),
                                (2, 2) => mxfp4_tile::<2, 2>(slab, i, x, cols, k, a, p),
                                (2, _) => mxfp4_tile::<2, 1>(slab, i, x, cols, k, a, p),
                                (_, 2) => mxfp4_tile::<1, 2>(slab, i, x, cols, k, a, p),
                                (_, _) => mxfp4_tile::<1, 1>(slab, i, x, cols, k, a, p),
                            }
                        }
                        q += 2;
                    }
                    i += r;
                }
            }
        }
        for (i, a) in acc[..g * stride].chunks_exact(stride).enumerate() {
            for q in 0..p {
                out[q * n + g0 + i] = hsum_mxfp4([a[2 * q], a[2 * q + 1]]);
            }
        }
    }
    BLOCK_SCRATCH.set(scratch);
}

/// Adds `k` decoded blocks of slab rows `i .. i + R` (`slab`: block `blk` of row `i` is the four
/// vectors at `slab + (i * SLAB + blk) * 4`) times `Q` positions (`x`: the slab's first input of
/// the first position, positions `cols` apart) to the accumulators at `acc` (row `r`, position
/// `q`: the pair of registers at `acc + 2 * (r * p + q)`), by [`mxfp4_dot`]'s arithmetic.
///
/// # Safety
/// The CPU supports the ISA; `x` points to `Q` positions of `32 * k` readable f32, `cols`
/// apart; `slab` to a whole slab, `i + R <= CHUNK_ROWS`, `k <= SLAB`; the `R x Q` accumulators
/// are in bounds.
#[inline(always)]
unsafe fn mxfp4_tile<const R: usize, const Q: usize>(
    slab: *const __m256,
    i: usize,
    x: *const f32,
    cols: usize,
    k: usize,
    acc: *mut __m256,
    p: usize,
) {
    // SAFETY (whole body): the bounds above (caller).
    unsafe {
        let at = |r: usize, q: usize, h: usize| acc.add(2 * (r * p + q) + h);
        let mut a: [[[__m256; 2]; Q]; R] =
            std::array::from_fn(|r| std::array::from_fn(|q| [*at(r, q, 0), *at(r, q, 1)]));
        for blk in 0..k {
            for j in 0..4 {
                let w: [__m256; R] =
                    std::array::from_fn(|r| *slab.add(((i + r) * SLAB + blk) * 4 + j));
                for q in 0..Q {
                    let xv = _mm256_loadu_ps(x.add(q * cols + 32 * blk + 8 * j));
                    for (ar, wr) in a.iter_mut().zip(&w) {
                        ar[q][j % 2] = _mm256_fmadd_ps(*wr, xv, ar[q][j % 2]);
                    }
                }
            }
        }
        for (r, ar) in a.iter().enumerate() {
            for (q, v) in ar.iter().enumerate() {
                *at(r, q, 0) = v[0];
                *at(r, q, 1) = v[1];
            }
        }
    }
}

/// Blocks per column slab of [`mxfp4_fused`].
const FUSED_SLAB: usize = 16;
/// Most positions [`mxfp4_rows`] gives [`mxfp4_fused`] rather than [`mxfp4_block`]: with 16
/// registers a tile takes 4 positions, so beyond 8 the block is decoded three times or more
/// and decoding once into L1 wins. On Zen 4 with this ISA forced (one thread, 2880 x 2880,
/// `cargo bench -p stormo-engine --bench kernel_min -- mxfp4 P 40 avx2`): fused 1.1-1.4x at
/// 2 to 8 positions, 0.95x at 16 and 0.87x at 32.
const FUSED_POSITIONS: usize = 8;

/// [`mxfp4_rows`] for `2 <= p <= MXFP4_POSITIONS` positions, decoding in registers: the
/// positions split into tiles of at most 4, and for each column slab of [`FUSED_SLAB`] blocks
/// and each tile, row after row decodes its blocks and multiplies them by the tile's
/// positions at once ([`fused`]), so the decoding's shuffles run beside the multiply-adds.
/// The group's accumulators live in the thread's scratch between slabs.
///
/// # Safety
/// As [`mxfp4_block`].
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
    debug_assert!((2..=MXFP4_POSITIONS).contains(&p));
    let cols = nb * 32;
    let c = Fp4Consts::new();
    let mut scratch = BLOCK_SCRATCH.take();
    scratch.resize(ACC_VECTORS, _mm256_setzero_ps());
    let acc = &mut scratch[..];
    let stride = 2 * p;
    let rows = group_rows(p);
    let tiles = p.div_ceil(4);
    for g0 in (0..n).step_by(rows) {
        let g = rows.min(n - g0);
        acc[..g * stride].fill(_mm256_setzero_ps());
        for b0 in (0..nb).step_by(FUSED_SLAB) {
            let k = FUSED_SLAB.min(nb - b0);
            super::prefetch_slab_ahead(bb, nb, r0, n, g0, rows, b0, FUSED_SLAB);
            let mut q = 0;
            for t in 0..tiles {
                let qn = (p - q) / (tiles - t);
                for i in 0..g {
                    // SAFETY: row `g0 + i` of the group and positions `q .. q + qn <= p`
                    // (caller); its accumulators lie within `g * stride`.
                    unsafe {
                        let row = r0 + g0 + i;
                        let b = bb.add(row * nb * 16 + 16 * b0);
                        let s = sb.add(row * nb + b0);
                        let x = xs.as_ptr().add(q * cols + 32 * b0);
                        let a = acc.as_mut_ptr().add(i * stride + 2 * q);
                        match qn {
                            4 => fused::<4>(b, s, x, cols, k, a, c),
                            3 => fused::<3>(b, s, x, cols, k, a, c),
                            2 => fused::<2>(b, s, x, cols, k, a, c),
                            _ => fused::<1>(b, s, x, cols, k, a, c),
                        }
                    }
                }
                q += qn;
            }
        }
        for (i, a) in acc[..g * stride].chunks_exact(stride).enumerate() {
            for q in 0..p {
                out[q * n + g0 + i] = hsum_mxfp4([a[2 * q], a[2 * q + 1]]);
            }
        }
    }
    BLOCK_SCRATCH.set(scratch);
}

/// Adds blocks `0 .. k` of one row (`b`, `s`: its weights and scales at the slab's first
/// block) times `Q` positions (`x`: the slab's first input of the first position, positions
/// `cols` apart) to the accumulators at `acc` (position `q`: the pair of registers at
/// `acc + 2 * q`), decoding each block once in registers, by [`mxfp4_dot`]'s arithmetic.
///
/// # Safety
/// The CPU supports the ISA; `k` blocks at `b`/`s`, `Q` positions of `32 * k` readable f32 at
/// `x`, and the `Q` accumulators are in bounds.
#[inline(always)]
unsafe fn fused<const Q: usize>(
    b: *const u8,
    s: *const u8,
    x: *const f32,
    cols: usize,
    k: usize,
    acc: *mut __m256,
    c: Fp4Consts,
) {
    // SAFETY (whole body): the bounds above (caller).
    unsafe {
        let mut a: [[__m256; 2]; Q] =
            std::array::from_fn(|q| [*acc.add(2 * q), *acc.add(2 * q + 1)]);
        for blk in 0..k {
            let w = decode_scaled(b.add(16 * blk), *s.add(blk), c);
            for (j, wv) in w.iter().enumerate() {
                for (q, aq) in a.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(q * cols + 32 * blk + 8 * j));
                    aq[j % 2] = _mm256_fmadd_ps(*wv, xv, aq[j % 2]);
                }
            }
        }
        for (q, v) in a.iter().enumerate() {
            *acc.add(2 * q) = v[0];
            *acc.add(2 * q + 1) = v[1];
        }
    }
}

/// The order in which [`decode_scaled`] yields a block's 32 weights: lane `k` of the four
/// vectors holds element `MXFP4_ORDER[k]` of the block. Kernel inputs are permuted to match once
/// per call ([`mxfp4_permute`]), so the decode needs no interleaving shuffles.
pub(super) const MXFP4_ORDER: [usize; 32] = [
    0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, //
    16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31,
];

/// Rearranges positions of `cols` inputs (a multiple of 32) into [`MXFP4_ORDER`] within each
/// block of 32.
pub(super) fn mxfp4_permute(xs: &[f32], out: &mut [f32]) {
    super::permute_blocks(&MXFP4_ORDER, xs, out);
}

/// High and low bytes of every dequantized MXFP4 value as bf16, by E8M0 scale byte: entry
/// `s` holds `mxfp4_value(nibble, s)` for the 16 nibbles, repeated in both 128-bit lanes, high
/// bytes then low bytes (one cache line per scale). Exact: an FP4 value times a power of two has
/// at most two significant bits, which bf16 holds, subnormals included; at scales 253 and 254
/// the larger values overflow to ±inf, as dequantizing to f32 or bf16 does (a test checks
/// every entry against [`mxfp4_value`](super::mxfp4_value)).
#[repr(C, align(64))]
struct Scaled([[[u8; 32]; 2]; 256]);

static SCALED: Scaled = {
    let mut t = [[[0u8; 32]; 2]; 256];
    let mut s = 0;
    while s < 256 {
        let mut i = 0;
        while i < 32 {
            let v = super::FP4_LUT[i % 16];
            let w = if v == 0.0 { v } else { v * SCALE[s] };
            let bits = w.to_bits();
            t[s][0][i] = (bits >> 24) as u8;
            t[s][1][i] = (bits >> 16) as u8;
            i += 1;
        }
        s += 1;
    }
    Scaled(t)
};

/// Splits MXFP4 blocks into their nibbles (constants loaded once per call); shared by
/// [`decode_scaled`] and the int8-input kernel.
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
    /// The CPU supports the ISA and 16 bytes at `b` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn split(self, b: *const u8) -> __m256i {
        // SAFETY: 16 readable bytes (caller); unaligned load.
        let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(b as *const __m128i) });
        _mm256_and_si256(_mm256_srlv_epi32(v, self.shifts), self.nibble)
    }
}

/// Constants of [`decode_scaled`], loaded once per call.
#[derive(Clone, Copy)]
struct Fp4Consts {
    split: NibbleSplit,
    upper: __m256i,
}

impl Fp4Consts {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn new() -> Self {
        Self {
            split: NibbleSplit::new(),
            upper: _mm256_set1_epi32(-65536),
        }
    }
}

/// The 32 weights of one MXFP4 block (16 bytes at `b`, E8M0 scale byte `s`) dequantized, as
/// four vectors of 8 f32 in [`MXFP4_ORDER`]: the low lane takes the low nibbles (even
/// elements), the high lane the high nibbles, two byte shuffles of the scale's [`SCALED`]
/// tables give each value's bf16 bytes, interleaving those gives bf16 pairs, and a shift or a
/// mask of each pair gives the f32 (7 shuffle-port operations per block; the scale costs two
/// table loads, no arithmetic).
///
/// # Safety
/// The CPU supports the ISA and 16 bytes at `b` are readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_scaled(b: *const u8, s: u8, c: Fp4Consts) -> [__m256; 4] {
    let t = &SCALED.0[s as usize];
    // SAFETY: 16 readable bytes (caller); the tables are 32 bytes each, read unaligned.
    let (idx, hi, lo) = unsafe {
        (
            c.split.split(b),
            _mm256_loadu_si256(t[0].as_ptr() as *const __m256i),
            _mm256_loadu_si256(t[1].as_ptr() as *const __m256i),
        )
    };
    let hb = _mm256_shuffle_epi8(hi, idx);
    let lb = _mm256_shuffle_epi8(lo, idx);
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

/// [`SCALED`] entry `s`, nibble `n`, as the f32 the kernels decode (for tests).
#[cfg(test)]
pub(super) fn scaled_value(s: u8, n: u8) -> f32 {
    let t = &SCALED.0[s as usize];
    let bits = ((t[0][n as usize] as u32) << 24) | ((t[1][n as usize] as u32) << 16);
    f32::from_bits(bits)
}

/// `y[q][o] = Σ_i x[q][i] · W[i, o0 + o]` for `P` positions, with one fused multiply-add per
/// input in increasing `i` for every output (so chunking and grouping never change a value).
/// Four input rows are applied per pass over `y`, which stays in L1.
///
/// # Safety
/// The CPU supports the ISA; `w` holds `cols` rows of `ld` elements of format `FMT`,
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
    // SAFETY: the CPU supports the ISA (asserted above).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every position count's group of rows fits the scratch's accumulators.
    #[test]
    fn groups_fit_the_accumulator_scratch() {
        for p in 2..=MXFP4_POSITIONS {
            let rows = group_rows(p);
            assert!((4..=MAX_ROWS).contains(&rows), "{p} positions: {rows} rows");
            assert!(rows * 2 * p <= ACC_VECTORS, "{p} positions: {rows} rows");
        }
    }
}
