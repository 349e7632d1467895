//! Scalar reference kernels: they define the arithmetic every ISA reproduces bit for bit (see
//! [`super`]'s "Same bits on every ISA"), and serve as the fallback on CPUs without a faster
//! ISA.
//!
//! A row's dot product is sixteen lanes of fused multiply-adds (`f32::mul_add`, which the SIMD
//! ISAs' FMA instructions compute alike: one rounding per step), reduced by [`reduce`]. Dense
//! rows: lane `l` takes the elements `i ≡ l (mod 16)` below the last multiple of 16, in
//! increasing `i`; the leftover elements are then added one by one, fused, in order. MXFP4
//! rows: each weight is dequantized first (FP4 value times the block's E8M0 scale, in f32,
//! exact but for overflow to ±inf at the two largest finite scales), and in each block lane `l`
//! takes element [`MXFP4_LANE`]`[l]` and then element `16 + MXFP4_LANE[l]` (the order of the
//! AVX-512 ISA's decode), block after block. Input-major matrices add one fused product per
//! input, in increasing input, to each output.

use super::{Float, Mat, Outs, FP4_LUT};

/// Lanes of the canonical dot product.
pub(crate) const LANES: usize = 16;

/// The element of each half of an MXFP4 block (its first 16 elements, then its last 16) that
/// lane `l` takes: `8 * (l % 2) + l / 2` (lanes 0, 1, 2, 3, … take elements 0, 8, 1, 9, …).
pub(crate) const MXFP4_LANE: [usize; LANES] = {
    let mut o = [0; LANES];
    let mut l = 0;
    while l < LANES {
        o[l] = 8 * (l % 2) + l / 2;
        l += 1;
    }
    o
};

#[inline]
pub(crate) fn bf16_to_f32(lo: u8, hi: u8) -> f32 {
    f32::from_bits((u16::from_le_bytes([lo, hi]) as u32) << 16)
}

#[inline]
pub(crate) fn f16_to_f32(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// Sums the 16 lanes in the canonical order: lane `l` plus lane `l + 8` (`l < 8`), then
/// `l + 4`, `l + 2`, `l + 1` (the halving tree a 512-bit register reduces in).
#[inline]
pub(crate) fn reduce(a: [f32; LANES]) -> f32 {
    let b: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let c: [f32; 4] = std::array::from_fn(|l| b[l] + b[l + 4]);
    (c[0] + c[2]) + (c[1] + c[3])
}

/// The canonical dot product of `n = x.len()` weights (`w(i)`, widened) with `x`.
#[inline(always)]
fn dot_with(w: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
    let n = x.len();
    let main = n / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (c, xc) in x[..main].chunks_exact(LANES).enumerate() {
        for (l, (a, &xv)) in acc.iter_mut().zip(xc).enumerate() {
            *a = w(c * LANES + l).mul_add(xv, *a);
        }
    }
    let mut s = reduce(acc);
    for (j, &xv) in x.iter().enumerate().skip(main) {
        s = w(j).mul_add(xv, s);
    }
    s
}

/// Dot product of an f32 row (little-endian bytes) with `x`.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 4);
    dot_with(|i| super::f32_at(w, i), x)
}

/// Dot product of a bf16 row with `x`.
pub(crate) fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 2);
    dot_with(|i| bf16_to_f32(w[2 * i], w[2 * i + 1]), x)
}

/// Dot product of an f16 row with `x`.
pub(crate) fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 2);
    dot_with(|i| f16_to_f32(w[2 * i], w[2 * i + 1]), x)
}

/// Dot product of an int8 row (raw integers, unscaled) with `x`.
pub(crate) fn dot_i8(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    dot_with(|i| w[i] as i8 as f32, x)
}

/// Dot product of one MXFP4 row (`cols/2` packed bytes, `cols/32` E8M0 scales) with `x`: each
/// weight dequantized ([`mxfp4_value`](super::mxfp4_value)), lane `l` taking elements
/// [`MXFP4_LANE`]`[l]` and `16 + MXFP4_LANE[l]` of each block in turn.
pub(crate) fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(blocks.len() * 2, x.len());
    debug_assert_eq!(scales.len() * 32, x.len());
    let mut acc = [0f32; LANES];
    for ((bc, &s), xc) in blocks.chunks_exact(16).zip(scales).zip(x.chunks_exact(32)) {
        let scale = super::e8m0_to_f32(s);
        let w = |e: usize| {
            let b = bc[e / 2];
            let v = FP4_LUT[if e.is_multiple_of(2) { b & 15 } else { b >> 4 } as usize];
            if v == 0.0 {
                v
            } else {
                v * scale
            }
        };
        for half in [0, 16] {
            for (a, &e) in acc.iter_mut().zip(&MXFP4_LANE) {
                *a = w(half + e).mul_add(xc[half + e], *a);
            }
        }
    }
    reduce(acc)
}

/// Dot product of output row `r` of a row-major matrix with `x`.
fn dot_row(w: &Mat<'_>, r: usize, x: &[f32]) -> f32 {
    match *w {
        Mat::Dense {
            fmt, bytes, cols, ..
        } => {
            let row = &bytes[r * cols * fmt.size()..(r + 1) * cols * fmt.size()];
            match fmt {
                Float::F32 => dot_f32(row, x),
                Float::BF16 => dot_bf16(row, x),
                Float::F16 => dot_f16(row, x),
            }
        }
        Mat::Q8 {
            q, scales, cols, ..
        } => dot_i8(&q[r * cols..(r + 1) * cols], x) * scales[r],
        Mat::Mxfp4 {
            blocks,
            scales,
            cols,
            ..
        } => {
            let nb = cols / 32;
            dot_mxfp4(
                &blocks[r * nb * 16..(r + 1) * nb * 16],
                &scales[r * nb..(r + 1) * nb],
                x,
            )
        }
        Mat::DenseT { .. } => unreachable!("row kernels do not take input-major weights"),
        Mat::Mxfp4Int8 { .. } => unreachable!("kernels::rows_in routes Mxfp4Int8 to int8x"),
    }
}

/// Output rows `r0 .. r0 + n` of a row-major matrix for `p` positions `xs` (`[p, cols]`)
/// into `out` (`[p, n]`).
pub(crate) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    super::check_rows(w, r0, n, xs, p, out);
    let cols = w.cols();
    for i in 0..n {
        for q in 0..p {
            out[q * n + i] = dot_row(w, r0 + i, &xs[q * cols..(q + 1) * cols]);
        }
    }
}

/// Output columns `o0 .. o0 + n` of an input-major matrix for `outs.len()` positions.
pub(crate) fn cols_t(w: &Mat<'_>, o0: usize, n: usize, xs: &[f32], outs: &mut Outs<'_>) {
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
    for (q, y) in outs.iter_mut().enumerate() {
        gemv_t(
            fmt,
            bytes,
            rows,
            o0,
            &xs[q * cols..(q + 1) * cols],
            &mut y[..n],
        );
    }
}

/// `y[o] = Σ_i x[i] · W[i, o0 + o]` for a row-major `[in, out]` matrix `w` with rows of `out`
/// elements: one fused multiply-add per input, in increasing `i`, for every output.
fn gemv_t(fmt: Float, w: &[u8], out: usize, o0: usize, x: &[f32], y: &mut [f32]) {
    let size = fmt.size();
    y.fill(0.0);
    for (i, &xi) in x.iter().enumerate() {
        let row = &w[(i * out + o0) * size..(i * out + o0 + y.len()) * size];
        for (o, yo) in y.iter_mut().enumerate() {
            *yo = xi.mul_add(fmt.at(row, o), *yo);
        }
    }
}

/// Floating-point operations done by a burst of independent `mul_add` chains (for
/// [`super::peak_flops`]).
pub(crate) fn fma_burst() -> f64 {
    const CHAINS: usize = 8;
    const STEPS: usize = 1 << 16;
    let mut acc = std::hint::black_box([1.0f32; CHAINS]);
    let (a, b) = std::hint::black_box((0.999_999f32, 1e-7f32));
    for _ in 0..STEPS {
        for v in acc.iter_mut() {
            *v = v.mul_add(a, b);
        }
    }
    std::hint::black_box(acc);
    (2 * CHAINS * STEPS) as f64
}
