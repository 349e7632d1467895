//! Scalar reference kernels. Every SIMD path is tested against these; they also serve as the
//! fallback on CPUs without a faster ISA. Eight independent accumulators keep the summation
//! order fixed (and let the compiler vectorise) without any target-specific code.

use super::{Float, Mat, Outs, FP4_LUT};

const LANES: usize = 8;

#[inline]
pub(crate) fn bf16_to_f32(lo: u8, hi: u8) -> f32 {
    f32::from_bits((u16::from_le_bytes([lo, hi]) as u32) << 16)
}

#[inline]
pub(crate) fn f16_to_f32(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

#[inline]
fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Dot product of an f32 row (little-endian bytes) with `x`.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 4);
    let mut acc = [0f32; LANES];
    let n = x.len() / LANES * LANES;
    for (wc, xc) in w[..n * 4]
        .chunks_exact(LANES * 4)
        .zip(x[..n].chunks_exact(LANES))
    {
        for l in 0..LANES {
            let b = &wc[l * 4..l * 4 + 4];
            acc[l] += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * xc[l];
        }
    }
    let mut s = reduce(acc);
    for i in n..x.len() {
        let b = &w[i * 4..i * 4 + 4];
        s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x[i];
    }
    s
}

/// Dot product of a bf16 row with `x`.
pub(crate) fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 2);
    let mut acc = [0f32; LANES];
    let n = x.len() / LANES * LANES;
    for (wc, xc) in w[..n * 2]
        .chunks_exact(LANES * 2)
        .zip(x[..n].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += bf16_to_f32(wc[2 * l], wc[2 * l + 1]) * xc[l];
        }
    }
    let mut s = reduce(acc);
    for i in n..x.len() {
        s += bf16_to_f32(w[2 * i], w[2 * i + 1]) * x[i];
    }
    s
}

/// Dot product of an f16 row with `x`.
pub(crate) fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 2);
    let mut acc = [0f32; LANES];
    let n = x.len() / LANES * LANES;
    for (wc, xc) in w[..n * 2]
        .chunks_exact(LANES * 2)
        .zip(x[..n].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += f16_to_f32(wc[2 * l], wc[2 * l + 1]) * xc[l];
        }
    }
    let mut s = reduce(acc);
    for i in n..x.len() {
        s += f16_to_f32(w[2 * i], w[2 * i + 1]) * x[i];
    }
    s
}

/// Dot product of an int8 row (raw integers, unscaled) with `x`.
pub(crate) fn dot_i8(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; LANES];
    let n = x.len() / LANES * LANES;
    for (wc, xc) in w[..n].chunks_exact(LANES).zip(x[..n].chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += wc[l] as i8 as f32 * xc[l];
        }
    }
    let mut s = reduce(acc);
    for i in n..x.len() {
        s += w[i] as i8 as f32 * x[i];
    }
    s
}

/// Dot product of one MXFP4 row (`cols/2` packed bytes, `cols/32` E8M0 scales) with `x`.
/// Each 32-element block is summed, then multiplied by its power-of-two scale (exact).
pub(crate) fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(blocks.len() * 2, x.len());
    debug_assert_eq!(scales.len() * 32, x.len());
    let mut total = 0f32;
    for ((bc, &s), xc) in blocks.chunks_exact(16).zip(scales).zip(x.chunks_exact(32)) {
        let mut acc = [0f32; LANES];
        for (j, &b) in bc.iter().enumerate() {
            let l = (2 * j) % LANES;
            acc[l] += FP4_LUT[(b & 0x0f) as usize] * xc[2 * j];
            acc[l + 1] += FP4_LUT[(b >> 4) as usize] * xc[2 * j + 1];
        }
        total += reduce(acc) * super::e8m0_to_f32(s);
    }
    total
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
/// elements.
fn gemv_t(fmt: Float, w: &[u8], out: usize, o0: usize, x: &[f32], y: &mut [f32]) {
    let size = fmt.size();
    y.fill(0.0);
    for (i, &xi) in x.iter().enumerate() {
        let row = &w[(i * out + o0) * size..(i * out + o0 + y.len()) * size];
        for (o, yo) in y.iter_mut().enumerate() {
            *yo += xi * fmt.at(row, o);
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
