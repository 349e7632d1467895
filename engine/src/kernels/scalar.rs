//! Scalar reference kernels. Every SIMD path is tested against these; they also serve as the
//! fallback on CPUs without a faster tier. Eight independent accumulators keep the summation
//! order fixed (and let the compiler vectorise) without any target-specific code.

use super::FP4_LUT;

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

/// `y[o] += Σ_i x[i] · W[i, o]` for a row-major `[in, out]` matrix, over the output columns
/// `o0 .. o0 + y.len()`. `w` is the whole matrix; `out` its row length.
pub(crate) fn gemv_t(
    dtype_size: usize,
    widen: fn(&[u8], usize) -> f32,
    w: &[u8],
    out: usize,
    o0: usize,
    x: &[f32],
    y: &mut [f32],
) {
    y.fill(0.0);
    for (i, &xi) in x.iter().enumerate() {
        let row = &w[(i * out + o0) * dtype_size..(i * out + o0 + y.len()) * dtype_size];
        for (o, yo) in y.iter_mut().enumerate() {
            *yo += xi * widen(row, o);
        }
    }
}
