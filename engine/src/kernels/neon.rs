//! The NEON tier (AArch64: every 64-bit Arm CPU, Cortex-A53 and Apple M1 to Graviton).
//!
//! Row-major kernels keep one accumulator of two 4-lane vectors per (row, position): lane `l`
//! of the pair sums the products of elements `i ≡ l (mod 8)` in increasing `i`; the two vectors
//! are added and their lanes reduced pairwise ([`hsum`], a fixed order), then a scalar tail adds
//! the leftover elements with fused multiply-adds. How many rows (`R`) and positions (`P`) one
//! call interleaves changes only which loads are shared, never a position's arithmetic, so a
//! block of positions gets exactly what each position gets alone.
//!
//! Widening: bf16 by a long shift (`USHLL #16`), int8 by sign extension and conversion, f16 by
//! integer arithmetic on the bits ([`f16_to_f32`], exact for every value including subnormals;
//! the `FCVTL` intrinsics need a newer Rust than the workspace's minimum).
//!
//! MXFP4 is decoded in registers and in element order, so inputs are never permuted: the low
//! nibbles of a block's 16 bytes are its even elements and the high nibbles its odd ones; two
//! byte zips put the 32 nibbles in element order, and per 16 nibbles two table lookups (`TBL`)
//! give the high and low bytes of each FP4 value as bf16 (exact: FP4 values have a two-bit
//! mantissa), which a zip and a long shift turn into f32. Each block's 32 products are summed
//! in two 4-lane vectors, which are multiplied by the block's E8M0 scale (a power of two) and
//! added to the accumulator.

use std::arch::aarch64::*;

use super::{Float, Mat, Outs, BF16, F16, F32, I8, SCALE};

/// True if this CPU runs the tier.
pub(super) fn supported() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// Most positions one row-kernel call takes.
const POSITIONS: usize = 4;

/// Output rows `r0 .. r0 + n` of a row-major matrix (`Dense`, `Q8` or `Mxfp4`) for `p <= 4`
/// positions `xs` (`[p, cols]`) into `out` (`[p, n]`).
pub(super) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    if !supported() {
        return super::scalar::rows(w, r0, n, xs, p, out);
    }
    super::check_rows(w, r0, n, xs, p, out);
    assert!(
        p <= POSITIONS,
        "neon kernels take at most {POSITIONS} positions"
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
        // SAFETY: the CPU supports the tier (checked above); `check_cols_t` verified that the
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
/// The CPU must support neon, and the bounds `check_rows` verifies must hold, with `p <= 4`.
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
            } => match p {
                1 => mxfp4_tile::<1>(blocks, scales, cols, r0, n, xs, out),
                2 => mxfp4_tile::<2>(blocks, scales, cols, r0, n, xs, out),
                3 => mxfp4_tile::<3>(blocks, scales, cols, r0, n, xs, out),
                _ => mxfp4_tile::<4>(blocks, scales, cols, r0, n, xs, out),
            },
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
    match p {
        1 => sweep!(4, 1),
        2 => sweep!(2, 2),
        3 => sweep!(2, 3),
        _ => sweep!(2, 4),
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
/// The CPU supports the tier and elements `i .. i + 8` are readable.
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

/// Sums an accumulator's 8 lanes in a fixed order.
#[inline]
#[target_feature(enable = "neon")]
fn hsum(a: [float32x4_t; 2]) -> f32 {
    vaddvq_f32(vaddq_f32(a[0], a[1]))
}

/// Dot products of `R` rows with `P` positions, `n` elements each.
///
/// # Safety
/// The CPU supports the tier; each `w[k]` points to `n` readable elements of format `FMT` and
/// each `x[q]` to `n` readable f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dense_dot<const FMT: u8, const R: usize, const P: usize>(
    w: [*const u8; R],
    x: [*const f32; P],
    n: usize,
) -> [[f32; P]; R] {
    let z = vdupq_n_f32(0.0);
    let mut acc = [[[z; 2]; P]; R];
    let main = n / 8 * 8;
    let mut i = 0;
    while i < main {
        for k in 0..R {
            // SAFETY: `i + 8 <= n` (caller's bounds).
            let wv = unsafe { load8::<FMT>(w[k], i) };
            for q in 0..P {
                // SAFETY: as above, for `x[q]`.
                let (x0, x1) = unsafe { (vld1q_f32(x[q].add(i)), vld1q_f32(x[q].add(i + 4))) };
                let a = &mut acc[k][q];
                a[0] = vfmaq_f32(a[0], wv[0], x0);
                a[1] = vfmaq_f32(a[1], wv[1], x1);
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

/// Blocks per column slab when several positions share a call (4 positions x 32 blocks of
/// inputs = 16 KiB, which stays in L1 while the slab's rows pass over it).
const SLAB: usize = 32;
/// Rows whose accumulators a multi-position call keeps at once.
const SLAB_ROWS: usize = 32;

/// Rows of an MXFP4 matrix for `P <= 4` positions: one row at a time (a single sequential
/// stream of weights) for one position; for several, slabs of [`SLAB`] blocks so the slab's
/// inputs of every position stay in L1 while each row of the tile passes over them, with the
/// accumulators kept between slabs. Either way a (row, position)'s blocks are accumulated in
/// increasing order by the same arithmetic ([`mxfp4_acc`]), so the result does not depend on
/// `P`.
///
/// # Safety
/// As [`rows_impl`]: rows `r0 .. r0 + n` of `blocks`/`scales` and `P` positions in bounds.
#[allow(clippy::too_many_arguments)]
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "neon")]
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
    let z = [vdupq_n_f32(0.0); 2];
    if P == 1 {
        for (i, o) in out[..n].iter_mut().enumerate() {
            let (b, s) = row(i);
            let mut acc = [z; P];
            // SAFETY: a whole row of `nb` blocks and a position of `cols` f32 (caller).
            unsafe { mxfp4_acc::<P>(b, s, x, 0, nb, c, &mut acc) };
            *o = hsum(acc[0]);
        }
        return;
    }
    let mut acc = [[z; P]; SLAB_ROWS];
    for i0 in (0..n).step_by(SLAB_ROWS) {
        let m = SLAB_ROWS.min(n - i0);
        acc[..m].fill([z; P]);
        for b0 in (0..nb).step_by(SLAB) {
            let b1 = nb.min(b0 + SLAB);
            for (k, a) in acc[..m].iter_mut().enumerate() {
                let (b, s) = row(i0 + k);
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

/// High and low bytes of each FP4 value as bf16 (exact: FP4 values have two mantissa bits),
/// by nibble.
const FP4_BF16: ([u8; 16], [u8; 16]) = {
    let mut hi = [0u8; 16];
    let mut lo = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        let bits = super::FP4_LUT[i].to_bits();
        hi[i] = (bits >> 24) as u8;
        lo[i] = (bits >> 16) as u8;
        i += 1;
    }
    (hi, lo)
};

/// Constants of [`decode_block`], loaded once per call.
#[derive(Clone, Copy)]
struct Fp4Consts {
    hi: uint8x16_t,
    lo: uint8x16_t,
    nibble: uint8x16_t,
}

impl Fp4Consts {
    #[inline]
    #[target_feature(enable = "neon")]
    fn new() -> Self {
        // SAFETY: 16-byte tables.
        unsafe {
            Self {
                hi: vld1q_u8(FP4_BF16.0.as_ptr()),
                lo: vld1q_u8(FP4_BF16.1.as_ptr()),
                nibble: vdupq_n_u8(0x0f),
            }
        }
    }
}

/// The 32 weights of one MXFP4 block (16 bytes at `b`) as eight vectors of 4 f32, unscaled,
/// in element order.
///
/// # Safety
/// The CPU supports the tier and 16 bytes at `b` are readable.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode_block(b: *const u8, c: Fp4Consts) -> [float32x4_t; 8] {
    // SAFETY: 16 readable bytes (caller); byte loads need no alignment.
    let v = unsafe { vld1q_u8(b) };
    let even = vandq_u8(v, c.nibble);
    let odd = vshrq_n_u8::<4>(v);
    let widen = |idx: uint8x16_t| {
        let hb = vqtbl1q_u8(c.hi, idx);
        let lb = vqtbl1q_u8(c.lo, idx);
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

/// Adds blocks `b0 .. b1` of one MXFP4 row (`b`, scales `s`) times `P` positions to `acc`:
/// per position, each block's 32 products are summed in two 4-lane vectors (elements
/// `i mod 8 < 4` in the first), each scaled by the block's E8M0 scale and added to the
/// position's accumulator.
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
    acc: &mut [[float32x4_t; 2]; P],
) {
    let mut a = *acc;
    for blk in b0..b1 {
        // SAFETY: `blk < b1` (caller's bounds); the CPU supports the tier (caller).
        unsafe {
            let w = decode_block(b.add(16 * blk), c);
            let sc = vdupq_n_f32(SCALE[*s.add(blk) as usize]);
            for (q, a) in a.iter_mut().enumerate() {
                let xp = x[q].add(32 * blk);
                let mut t0 = vmulq_f32(w[0], vld1q_f32(xp));
                let mut t1 = vmulq_f32(w[1], vld1q_f32(xp.add(4)));
                for k in 1..4 {
                    t0 = vfmaq_f32(t0, w[2 * k], vld1q_f32(xp.add(8 * k)));
                    t1 = vfmaq_f32(t1, w[2 * k + 1], vld1q_f32(xp.add(8 * k + 4)));
                }
                a[0] = vfmaq_f32(a[0], t0, sc);
                a[1] = vfmaq_f32(a[1], t1, sc);
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

    /// Every byte decodes to the FP4 values of its two nibbles, low nibble first, in element
    /// order across the block.
    #[test]
    fn mxfp4_block_decodes_in_element_order() {
        // SAFETY: AArch64 always has neon.
        let c = unsafe { Fp4Consts::new() };
        for start in (0..256usize).step_by(16) {
            let block: [u8; 16] = std::array::from_fn(|j| (start + j * 7 % 16) as u8);
            // SAFETY: 16 readable bytes.
            let w = unsafe { decode_block(block.as_ptr(), c) };
            let mut got = [0f32; 32];
            for (k, v) in w.iter().enumerate() {
                // SAFETY: four f32 written inside `got`.
                unsafe { vst1q_f32(got[4 * k..].as_mut_ptr(), *v) };
            }
            for (e, g) in got.iter().enumerate() {
                let b = block[e / 2];
                let nib = if e % 2 == 0 { b & 15 } else { b >> 4 };
                let want = super::super::FP4_LUT[nib as usize];
                assert_eq!(g.to_bits(), want.to_bits(), "byte {b:#04x} element {e}");
            }
        }
    }
}
