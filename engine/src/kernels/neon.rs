//! The NEON ISA (AArch64: every 64-bit Arm CPU, Cortex-A53 and Apple M1 to Graviton).
//!
//! The kernels compute the scalar reference's arithmetic (`scalar`: sixteen lanes of fused
//! multiply-adds and a fixed reduction), so they give its bits. Row-major kernels keep one
//! 16-lane accumulator per (row, position) in four 4-lane vectors: for dense rows, lane `l` of
//! the four sums the products of elements `i ≡ l (mod 16)` in increasing `i`; [`hsum16`]
//! reduces the lanes in the reference's order, then a scalar tail adds the leftover elements
//! with fused multiply-adds. How many rows (`R`) and positions (`P`) one call interleaves
//! changes only which loads are shared, never a position's arithmetic, so a block of positions
//! gets exactly what each position gets alone.
//!
//! Widening: bf16 by a long shift (`USHLL #16`), int8 by sign extension and conversion, f16 by
//! integer arithmetic on the bits ([`f16_to_f32`], exact for every value including subnormals;
//! the `FCVTL` intrinsics need a newer Rust than the workspace's minimum).
//!
//! MXFP4 is decoded in element order, so inputs are never permuted: the low nibbles of a
//! block's 16 bytes are its even elements and the high nibbles its odd ones; two byte zips put
//! the 32 nibbles in element order, and per 16 nibbles two table lookups (`TBL`) in the block's
//! scale's tables give the high and low bytes of each dequantized value (FP4 value times E8M0
//! scale) as bf16 (exact: at most two significant bits), which a zip and a long shift turn into
//! f32. Each (row, position) then takes a fused multiply-add per 4 weights, no per-block scale
//! multiply: vector `j` of the accumulator takes elements `4j .. 4j + 4` of each block's first
//! half, then the same of its second half, and [`hsum_mxfp4`] reduces the lanes in the
//! reference's order. Decode reads four rows at a time in registers; prefill decodes a slab of rows
//! once per call of up to 32 positions into an L1 buffer and multiplies it in register tiles,
//! as the AVX2 ISA does. Tested under QEMU (`.ci/neon-emulated.sh`); speed not measured.
//! With four vectors per accumulator, tiles take at most 24 of the 32 registers.

use std::arch::aarch64::*;

use super::{Float, Mat, Outs, BF16, F16, F32, I8, SCALE};

/// True if this CPU runs the ISA.
pub(super) fn supported() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// Most positions one dense (or Q8) row-kernel call takes; MXFP4 takes [`MXFP4_POSITIONS`].
const POSITIONS: usize = 4;

/// Output rows `r0 .. r0 + n` of a row-major matrix (`Dense`, `Q8` or `Mxfp4`) for `p <= 4`
/// positions (`p <= MXFP4_POSITIONS` for MXFP4) `xs` (`[p, cols]`) into `out` (`[p, n]`).
pub(super) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    if !supported() {
        return super::scalar::rows(w, r0, n, xs, p, out);
    }
    super::check_rows(w, r0, n, xs, p, out);
    assert!(
        p <= POSITIONS || matches!(w, Mat::Mxfp4 { .. }) && p <= MXFP4_POSITIONS,
        "neon kernels take at most {POSITIONS} positions ({MXFP4_POSITIONS} for MXFP4)"
    );
    // SAFETY: the CPU supports neon (checked above) and `check_rows` verified that rows
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
        let p = (outs.len() - i).min(2);
        let x = &xs[i * cols..];
        let y = &mut outs[i..i + p];
        // SAFETY: the CPU supports the ISA (checked above); `check_cols_t` verified that the
        // matrix holds `rows * cols` elements, `o0 + n <= rows`, each output has `n` elements
        // and `xs` holds `outs.len()` positions of `cols`.
        unsafe {
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
/// The CPU must support neon, and the bounds `check_rows` verifies must hold, with `p <= 4`
/// (`MXFP4_POSITIONS` for MXFP4).
#[target_feature(enable = "neon")]
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
#[target_feature(enable = "neon")]
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
    // At most 24 accumulator vectors (four per row and position) of the 32 registers.
    match p {
        1 => sweep!(4, 1),
        2 => sweep!(2, 2),
        3 => sweep!(2, 3),
        _ => sweep!(1, 4),
    }
}

/// f16 bit patterns (one per 32-bit lane, upper halves zero) as f32: the exponent rebiased,
/// infinities and NaNs kept at the top, zeros and subnormals computed as `1.m · 2^-14 - 2^-14`
/// (exact).
#[inline]
#[target_feature(enable = "neon")]
fn f16_to_f32(h: uint32x4_t) -> float32x4_t {
    const REBIAS: u32 = (127 - 15) << 23;
    const EXP: u32 = 0x1f << 23;
    let em = vshlq_n_u32::<13>(vandq_u32(h, vdupq_n_u32(0x7fff)));
    let exp = vandq_u32(em, vdupq_n_u32(EXP));
    let mut o = vaddq_u32(em, vdupq_n_u32(REBIAS));
    // Infinity and NaN: every exponent bit set in f32 as in f16.
    let top = vceqq_u32(exp, vdupq_n_u32(EXP));
    o = vaddq_u32(o, vandq_u32(top, vdupq_n_u32(REBIAS)));
    // Zero and subnormals.
    let low = vceqq_u32(exp, vdupq_n_u32(0));
    let one_m = vreinterpretq_f32_u32(vaddq_u32(o, vdupq_n_u32(1 << 23)));
    let sub = vsubq_f32(one_m, vdupq_n_f32(f32::from_bits(113 << 23)));
    o = vbslq_u32(low, vreinterpretq_u32_f32(sub), o);
    let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
    vreinterpretq_f32_u32(vorrq_u32(o, sign))
}

/// Loads 8 elements of format `FMT` starting at element `i` of `w`, widened to f32 (elements
/// `i .. i + 4` in the first vector).
///
/// # Safety
/// The CPU supports the ISA and elements `i .. i + 8` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load8<const FMT: u8>(w: *const u8, i: usize) -> [float32x4_t; 2] {
    // SAFETY: forwarded from the caller; byte loads need no alignment.
    unsafe {
        match FMT {
            F32 => {
                let p = w.add(4 * i);
                [
                    vreinterpretq_f32_u8(vld1q_u8(p)),
                    vreinterpretq_f32_u8(vld1q_u8(p.add(16))),
                ]
            }
            I8 => {
                let v = vmovl_s8(vld1_s8(w.add(i) as *const i8));
                [
                    vcvtq_f32_s32(vmovl_s16(vget_low_s16(v))),
                    vcvtq_f32_s32(vmovl_high_s16(v)),
                ]
            }
            F16 => {
                let h = vreinterpretq_u16_u8(vld1q_u8(w.add(2 * i)));
                [
                    f16_to_f32(vmovl_u16(vget_low_u16(h))),
                    f16_to_f32(vmovl_high_u16(h)),
                ]
            }
            _ => {
                let h = vreinterpretq_u16_u8(vld1q_u8(w.add(2 * i)));
                [
                    vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
                    vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
                ]
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
    let size = super::code_size(FMT);
    // SAFETY: forwarded from the caller.
    let b = unsafe { std::slice::from_raw_parts(w.add(i * size), size) };
    match FMT {
        F32 => super::f32_at(b, 0),
        F16 => super::f16_at(b, 0),
        I8 => b[0] as i8 as f32,
        _ => super::bf16_at(b, 0),
    }
}

/// `(c0 + c2) + (c1 + c3)`: the last two levels of the reference's reduction.
#[inline]
#[target_feature(enable = "neon")]
fn fold4(c: float32x4_t) -> f32 {
    let d = vadd_f32(vget_low_f32(c), vget_high_f32(c));
    vget_lane_f32::<0>(d) + vget_lane_f32::<1>(d)
}

/// Sums a dense accumulator's 16 lanes (lanes `4j .. 4j + 4` in `a[j]`) in the reference's
/// order (`scalar::reduce`): lane `l` plus `l + 8`, then `l + 4`, then [`fold4`].
#[inline]
#[target_feature(enable = "neon")]
fn hsum16(a: [float32x4_t; 4]) -> f32 {
    fold4(vaddq_f32(vaddq_f32(a[0], a[2]), vaddq_f32(a[1], a[3])))
}

/// Sums an MXFP4 accumulator's 16 lanes (`a[j]` holds block elements `4j .. 4j + 4` of the
/// first half, and the same plus 16) in the reference's order: its lanes hold elements
/// `0, 8, 1, 9, …` (`scalar::MXFP4_LANE`), so its tree sums, by element, `e + (e + 4)`, then
/// `+ 2`, then `+ 1` within 0..8 and within 8..16, then the two.
#[inline]
#[target_feature(enable = "neon")]
fn hsum_mxfp4(a: [float32x4_t; 4]) -> f32 {
    fold4(vaddq_f32(a[0], a[1])) + fold4(vaddq_f32(a[2], a[3]))
}

/// Dot products of `R` rows with `P` positions, `n` elements each.
///
/// # Safety
/// The CPU supports the ISA; each `w[k]` points to `n` readable elements of format `FMT` and
/// each `x[q]` to `n` readable f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dense_dot<const FMT: u8, const R: usize, const P: usize>(
    w: [*const u8; R],
    x: [*const f32; P],
    n: usize,
) -> [[f32; P]; R] {
    let z = vdupq_n_f32(0.0);
    let mut acc = [[[z; 4]; P]; R];
    let main = n / 16 * 16;
    let mut i = 0;
    while i < main {
        for k in 0..R {
            // SAFETY: `i + 16 <= n` (caller's bounds).
            let [w0, w1] = unsafe { load8::<FMT>(w[k], i) };
            // SAFETY: as above.
            let [w2, w3] = unsafe { load8::<FMT>(w[k], i + 8) };
            let wv = [w0, w1, w2, w3];
            for q in 0..P {
                let a = &mut acc[k][q];
                for (h, (ah, wh)) in a.iter_mut().zip(&wv).enumerate() {
                    // SAFETY: as above, for `x[q]`.
                    let xv = unsafe { vld1q_f32(x[q].add(i + 4 * h)) };
                    *ah = vfmaq_f32(*ah, *wh, xv);
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
/// [`mxfp4_value`](super::mxfp4_value) gives it), then the accumulator's four 4-lane vectors
/// take a fused multiply-add per 4 weights (vector `j` the block's elements `4j .. 4j + 4`,
/// then `16 + 4j .. 16 + 4j + 4`), block after block, and [`hsum_mxfp4`] reduces them. One
/// position ([`mxfp4_dot`]) streams four rows at a time,
/// decoding in registers; several ([`mxfp4_block`]) decode a slab of rows into an L1 buffer
/// once and multiply it by every position in register tiles. So a block of positions gets
/// exactly what each position gets alone.
///
/// # Safety
/// As [`rows_impl`]: rows `r0 .. r0 + n` of `blocks`/`scales` and `p` positions in bounds.
#[allow(clippy::too_many_arguments)]
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "neon")]
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
        return unsafe { mxfp4_block(bb, sb, nb, r0, n, xs, p, out) };
    }
    let x = xs.as_ptr();
    // SAFETY: rows `r0 + i` for `i < n` are in bounds (caller).
    let row = |i: usize| unsafe { (bb.add((r0 + i) * nb * 16), sb.add((r0 + i) * nb)) };
    macro_rules! run {
        ($r:literal, $i:expr) => {{
            let i = $i;
            let b: [*const u8; $r] = std::array::from_fn(|k| row(i + k).0);
            let s: [*const u8; $r] = std::array::from_fn(|k| row(i + k).1);
            // SAFETY: whole rows of `nb` blocks and a position of `cols` f32 (caller).
            let v = unsafe { mxfp4_dot::<$r>(b, s, x, nb) };
            out[i..i + $r].copy_from_slice(&v);
        }};
    }
    let mut i = 0;
    while n - i >= 4 {
        run!(4, i);
        i += 4;
    }
    while i < n {
        run!(1, i);
        i += 1;
    }
}

/// Most positions one MXFP4 call takes: the weights are decoded once per call, so all of an
/// expert's positions in a prefill block of 128 tokens (about 16 on GPT-OSS) share one decode.
pub(super) const MXFP4_POSITIONS: usize = 32;
/// Rows [`mxfp4_block`] decodes at once.
const CHUNK_ROWS: usize = 16;
/// Rows whose accumulators [`mxfp4_block`] keeps at once.
const MAX_ROWS: usize = 64;
/// Blocks per slab in [`mxfp4_block`]: one cache line of each row's weights, 512 bytes of
/// inputs per position; the decoded slab is 8 KiB.
const SLAB: usize = 4;

/// High and low bytes of every dequantized MXFP4 value as bf16, by E8M0 scale byte: entry `s`
/// holds `mxfp4_value(nibble, s)` for the 16 nibbles, high bytes then low bytes (exact: an FP4
/// value times a power of two has at most two significant bits, which bf16 holds, subnormals
/// included; at scales 253 and 254 the larger values overflow to ±inf, as dequantizing does).
#[repr(C, align(32))]
struct Scaled([[[u8; 16]; 2]; 256]);

static SCALED: Scaled = {
    let mut t = [[[0u8; 16]; 2]; 256];
    let mut s = 0;
    while s < 256 {
        let mut i = 0;
        while i < 16 {
            let v = super::FP4_LUT[i];
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

/// The 32 weights of one MXFP4 block (16 bytes at `b`, E8M0 scale byte `s`) dequantized, as
/// eight vectors of 4 f32 in element order: two byte zips put the nibbles in element order,
/// per 16 nibbles two table lookups (`TBL`) in the scale's [`SCALED`] tables give each value's
/// bf16 bytes, and a zip and a long shift turn those into f32.
///
/// # Safety
/// The CPU supports the ISA and 16 bytes at `b` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode_scaled(b: *const u8, s: u8) -> [float32x4_t; 8] {
    let t = &SCALED.0[s as usize];
    // SAFETY: 16 readable bytes (caller) and two 16-byte tables; byte loads need no alignment.
    let (v, hi, lo) = unsafe {
        (
            vld1q_u8(b),
            vld1q_u8(t[0].as_ptr()),
            vld1q_u8(t[1].as_ptr()),
        )
    };
    let even = vandq_u8(v, vdupq_n_u8(0x0f));
    let odd = vshrq_n_u8::<4>(v);
    let widen = |idx: uint8x16_t| {
        let hb = vqtbl1q_u8(hi, idx);
        let lb = vqtbl1q_u8(lo, idx);
        let h0 = vreinterpretq_u16_u8(vzip1q_u8(lb, hb));
        let h1 = vreinterpretq_u16_u8(vzip2q_u8(lb, hb));
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h0))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h0)),
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h1))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h1)),
        ]
    };
    let [a0, a1, a2, a3] = widen(vzip1q_u8(even, odd));
    let [b0, b1, b2, b3] = widen(vzip2q_u8(even, odd));
    [a0, a1, a2, a3, b0, b1, b2, b3]
}

/// The dot products of `R` consecutive MXFP4 rows (`nb` blocks each) with one position `x`, by
/// [`mxfp4_rows`]' arithmetic (the rows give the core independent chains of multiply-adds).
///
/// # Safety
/// The CPU supports the ISA; each `b[k]` points to `16 * nb` readable bytes, each `s[k]` to
/// `nb`, `x` to `32 * nb` f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn mxfp4_dot<const R: usize>(
    b: [*const u8; R],
    s: [*const u8; R],
    x: *const f32,
    nb: usize,
) -> [f32; R] {
    let mut acc = [[vdupq_n_f32(0.0); 4]; R];
    for blk in 0..nb {
        // SAFETY: block `blk < nb` of every row and of the position (caller).
        unsafe {
            let xp = x.add(32 * blk);
            for k in 0..R {
                let w = decode_scaled(b[k].add(16 * blk), *s[k].add(blk));
                let a = &mut acc[k];
                for (j, wj) in w.iter().enumerate() {
                    a[j % 4] = vfmaq_f32(a[j % 4], *wj, vld1q_f32(xp.add(4 * j)));
                }
            }
        }
    }
    acc.map(|a| hsum_mxfp4(a))
}

/// Vectors of [`mxfp4_block`]'s scratch: the accumulators (`MAX_ROWS` rows of
/// `MXFP4_POSITIONS` fours), then the slab (`CHUNK_ROWS` rows of `SLAB` blocks of 8 vectors).
const SCRATCH: usize = MAX_ROWS * MXFP4_POSITIONS * 4 + CHUNK_ROWS * SLAB * 8;

thread_local! {
    /// [`mxfp4_block`]'s scratch (136 KiB), kept by each thread between calls (taken while in
    /// use).
    static BLOCK_SCRATCH: std::cell::Cell<Vec<float32x4_t>> =
        const { std::cell::Cell::new(Vec::new()) };
}

/// [`mxfp4_rows`] for `2 <= p <= MXFP4_POSITIONS` positions, as the AVX2 ISA's prefill
/// kernel: groups of up to [`MAX_ROWS`] rows walked in slabs of [`SLAB`] blocks; for each slab,
/// chunk after chunk of [`CHUNK_ROWS`] rows is decoded once into an L1 buffer, then tiles of 2
/// rows x 2 positions multiply it ([`tile`]: sixteen accumulator vectors in registers, each
/// input vector loaded once for both rows, each weight vector once for two positions). The
/// group's accumulators live in the thread's scratch between slabs.
///
/// # Safety
/// As [`mxfp4_rows`], with `bb`/`sb` the matrix's blocks and scales and `nb` its blocks per
/// row.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "neon")]
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
    let mut scratch = BLOCK_SCRATCH.take();
    scratch.resize(SCRATCH, vdupq_n_f32(0.0));
    let (acc, slab) = scratch.split_at_mut(MAX_ROWS * MXFP4_POSITIONS * 4);
    let stride = MXFP4_POSITIONS * 4;
    for g0 in (0..n).step_by(MAX_ROWS) {
        let g = MAX_ROWS.min(n - g0);
        for a in acc[..g * stride].chunks_exact_mut(stride) {
            a[..4 * p].fill(vdupq_n_f32(0.0));
        }
        for b0 in (0..nb).step_by(SLAB) {
            let k = SLAB.min(nb - b0);
            for c0 in (0..g).step_by(CHUNK_ROWS) {
                let m = CHUNK_ROWS.min(g - c0);
                for (i, dst) in slab.chunks_exact_mut(SLAB * 8).take(m).enumerate() {
                    let row = r0 + g0 + c0 + i;
                    // SAFETY: row `row < r0 + n` and blocks `b0 .. b0 + k <= nb` (caller).
                    let (b, s) =
                        unsafe { (bb.add(row * nb * 16 + 16 * b0), sb.add(row * nb + b0)) };
                    for (j, d) in dst.chunks_exact_mut(8).take(k).enumerate() {
                        // SAFETY: block `b0 + j` of the row (above).
                        let w = unsafe { decode_scaled(b.add(16 * j), *s.add(j)) };
                        d.copy_from_slice(&w);
                    }
                }
                let mut i = 0;
                while i < m {
                    let r = (m - i).min(2);
                    let mut q = 0;
                    while q < p {
                        // SAFETY: positions `q .. q + 2.min(p - q) <= p` hold `cols` f32 each
                        // and the slab's blocks lie within them (caller); slab rows
                        // `i .. i + r <= m` and accumulator rows `c0 + i + r <= g <= MAX_ROWS`.
                        unsafe {
                            let x = xs.as_ptr().add(q * cols + 32 * b0);
                            let a = acc.as_mut_ptr().add((c0 + i) * stride + 4 * q);
                            let slab = slab.as_ptr();
                            match (r, (p - q).min(2)) {
                                (2, 2) => tile::<2, 2>(slab, i, x, cols, k, a),
                                (2, _) => tile::<2, 1>(slab, i, x, cols, k, a),
                                (_, 2) => tile::<1, 2>(slab, i, x, cols, k, a),
                                (_, _) => tile::<1, 1>(slab, i, x, cols, k, a),
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
                out[q * n + g0 + i] =
                    hsum_mxfp4([a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]]);
            }
        }
    }
    BLOCK_SCRATCH.set(scratch);
}

/// Adds `k` decoded blocks of slab rows `i .. i + R` (block `blk` of row `i` is the eight
/// vectors at `slab + (i * SLAB + blk) * 8`) times `Q` positions (`x`: the slab's first input
/// of the first position, positions `cols` apart) to the accumulators at `acc` (row `r`,
/// position `q`: the four vectors at `acc + 4 * (r * MXFP4_POSITIONS + q)`), by
/// [`mxfp4_rows`]' arithmetic.
///
/// # Safety
/// The CPU supports the ISA; `x` points to `Q` positions of `32 * k` readable f32, `cols`
/// apart; `slab` to a whole slab, `i + R <= CHUNK_ROWS`, `k <= SLAB`; the `R x Q` accumulators
/// are in bounds.
#[inline(always)]
unsafe fn tile<const R: usize, const Q: usize>(
    slab: *const float32x4_t,
    i: usize,
    x: *const f32,
    cols: usize,
    k: usize,
    acc: *mut float32x4_t,
) {
    // SAFETY (whole body): the bounds above (caller).
    unsafe {
        let at = |r: usize, q: usize, h: usize| acc.add(4 * (r * MXFP4_POSITIONS + q) + h);
        let mut a: [[[float32x4_t; 4]; Q]; R] =
            std::array::from_fn(|r| std::array::from_fn(|q| std::array::from_fn(|h| *at(r, q, h))));
        for blk in 0..k {
            for j in 0..8 {
                let w: [float32x4_t; R] =
                    std::array::from_fn(|r| *slab.add(((i + r) * SLAB + blk) * 8 + j));
                for q in 0..Q {
                    let xv = vld1q_f32(x.add(q * cols + 32 * blk + 4 * j));
                    for (ar, wr) in a.iter_mut().zip(&w) {
                        ar[q][j % 4] = vfmaq_f32(ar[q][j % 4], *wr, xv);
                    }
                }
            }
        }
        for (r, ar) in a.iter().enumerate() {
            for (q, v) in ar.iter().enumerate() {
                for (h, vh) in v.iter().enumerate() {
                    *at(r, q, h) = *vh;
                }
            }
        }
    }
}

/// `y[q][o] = Σ_i x[q][i] · W[i, o0 + o]` for `P` positions, with one fused multiply-add per
/// input in increasing `i` for every output (so chunking and grouping never change a value).
/// Four input rows are applied per pass over `y`, which stays in L1.
///
/// # Safety
/// The CPU supports the ISA; `w` holds `cols` rows of `ld` elements of format `FMT`,
/// `o0 + n <= ld`, `x` holds `P` positions of `cols` f32 and each `y[q]` has `n` elements.
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "neon")]
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
        // Input rows i .. i + kk (the last repeated to fill four), starting at output o0.
        // SAFETY: `i + k < cols` rows of `ld` elements, `o0 < ld` (caller).
        let rows: [*const u8; 4] =
            std::array::from_fn(|k| unsafe { base.add(((i + k.min(kk - 1)) * ld + o0) * size) });
        let bx: [[float32x4_t; 4]; P] = std::array::from_fn(|q| {
            std::array::from_fn(|k| vdupq_n_f32(x[q * cols + i + k.min(kk - 1)]))
        });
        let mut j = 0;
        while j < n8 {
            // SAFETY: `j + 8 <= n` and `o0 + n <= ld`.
            let wv: [[float32x4_t; 2]; 4] =
                std::array::from_fn(|k| unsafe { load8::<FMT>(rows[k], j) });
            for q in 0..P {
                let yp = y[q][j..j + 8].as_mut_ptr();
                // SAFETY: 8 elements of `y[q]` at `j` (bounds by the slice above).
                unsafe {
                    let mut v0 = vld1q_f32(yp);
                    let mut v1 = vld1q_f32(yp.add(4));
                    for k in 0..kk {
                        v0 = vfmaq_f32(v0, bx[q][k], wv[k][0]);
                        v1 = vfmaq_f32(v1, bx[q][k], wv[k][1]);
                    }
                    vst1q_f32(yp, v0);
                    vst1q_f32(yp.add(4), v1);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 bit pattern widens as the `half` crate widens it (NaNs stay NaN).
    #[test]
    fn f16_widening_matches_half_for_every_bit_pattern() {
        for hi in 0..(1u32 << 14) {
            let bits: [u32; 4] = std::array::from_fn(|k| hi * 4 + k as u32);
            // SAFETY: four u32 read from a local array; AArch64 always has neon.
            let v = unsafe { f16_to_f32(vld1q_u32(bits.as_ptr())) };
            let mut got = [0f32; 4];
            // SAFETY: four f32 written to a local array.
            unsafe { vst1q_f32(got.as_mut_ptr(), v) };
            for (b, g) in bits.iter().zip(got) {
                let want = half::f16::from_bits(*b as u16).to_f32();
                if want.is_nan() {
                    assert!(g.is_nan(), "f16 {b:#06x}: {g} is not NaN");
                } else {
                    assert_eq!(g.to_bits(), want.to_bits(), "f16 {b:#06x}: {g} vs {want}");
                }
            }
        }
    }

    /// Every byte decodes, at every scale, to the dequantized values of its two nibbles, low
    /// nibble first, in element order across the block.
    #[test]
    fn mxfp4_block_decodes_in_element_order() {
        for scale in 0..=255u8 {
            for start in (0..256usize).step_by(16) {
                let block: [u8; 16] = std::array::from_fn(|j| (start + j * 7 % 16) as u8);
                // SAFETY: 16 readable bytes; AArch64 always has neon.
                let w = unsafe { decode_scaled(block.as_ptr(), scale) };
                let mut got = [0f32; 32];
                for (k, v) in w.iter().enumerate() {
                    // SAFETY: four f32 written inside `got`.
                    unsafe { vst1q_f32(got[4 * k..].as_mut_ptr(), *v) };
                }
                for (e, g) in got.iter().enumerate() {
                    let b = block[e / 2];
                    let nib = if e % 2 == 0 { b & 15 } else { b >> 4 };
                    let want = super::super::mxfp4_value(nib, scale);
                    let same = g.to_bits() == want.to_bits()
                        || (scale >= 253 && g.is_infinite() && want.is_finite());
                    assert!(
                        same,
                        "byte {b:#04x} element {e} scale {scale}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
