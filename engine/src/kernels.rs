//! Matrix kernels over weights as they lie in the checkpoint: f32, bf16, f16 and MXFP4.
//!
//! The seam: [`Mat`] describes a weight matrix by reference (no copy, no dequantisation);
//! [`matvec`] and [`matmul`] compute `y = W·x` for one or many positions. Both call the same
//! per-row dot product, so a position's output is bit-identical whether it was computed alone
//! (decode) or in a block (prefill). The row kernels live in `scalar` (the reference); SIMD
//! tiers slot in beside it and are selected once at run time.

mod scalar;

use rayon::prelude::*;

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
}

/// Work (multiply-adds) below which a kernel runs on the calling thread.
const PAR_THRESHOLD: usize = 1 << 16;

impl Mat<'_> {
    /// Output width.
    pub fn rows(&self) -> usize {
        match *self {
            Self::Dense { rows, .. } | Self::DenseT { rows, .. } | Self::Mxfp4 { rows, .. } => rows,
        }
    }
    /// Input width.
    pub fn cols(&self) -> usize {
        match *self {
            Self::Dense { cols, .. } | Self::DenseT { cols, .. } | Self::Mxfp4 { cols, .. } => cols,
        }
    }
    /// Bytes of weights the matrix occupies.
    pub fn byte_len(&self) -> usize {
        match *self {
            Self::Dense { bytes, .. } | Self::DenseT { bytes, .. } => bytes.len(),
            Self::Mxfp4 { blocks, scales, .. } => blocks.len() + scales.len(),
        }
    }

    /// Dot product of output row `r` with `x` (not for `DenseT`).
    #[inline]
    fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        match *self {
            Self::Dense {
                fmt, bytes, cols, ..
            } => {
                let w = &bytes[r * cols * fmt.size()..(r + 1) * cols * fmt.size()];
                match fmt {
                    Float::F32 => scalar::dot_f32(w, x),
                    Float::BF16 => scalar::dot_bf16(w, x),
                    Float::F16 => scalar::dot_f16(w, x),
                }
            }
            Self::Mxfp4 {
                blocks,
                scales,
                cols,
                ..
            } => {
                let nb = cols / 32;
                scalar::dot_mxfp4(
                    &blocks[r * nb * 16..(r + 1) * nb * 16],
                    &scales[r * nb..(r + 1) * nb],
                    x,
                )
            }
            Self::DenseT { .. } => unreachable!("dot_row is not defined for input-major weights"),
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
            Self::Mxfp4 {
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

/// `y = W·x` for one position.
pub fn matvec(w: &Mat<'_>, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols(), "matvec input width");
    assert_eq!(y.len(), w.rows(), "matvec output width");
    let work = w.rows() * w.cols();
    match *w {
        Mat::DenseT {
            fmt, bytes, rows, ..
        } => {
            let chunk = 256;
            let f = fmt.widen_fn();
            if work < PAR_THRESHOLD {
                for (c, yc) in y.chunks_mut(chunk).enumerate() {
                    scalar::gemv_t(fmt.size(), f, bytes, rows, c * chunk, x, yc);
                }
            } else {
                y.par_chunks_mut(chunk).enumerate().for_each(|(c, yc)| {
                    scalar::gemv_t(fmt.size(), f, bytes, rows, c * chunk, x, yc)
                });
            }
        }
        _ => {
            if work < PAR_THRESHOLD {
                for (r, yr) in y.iter_mut().enumerate() {
                    *yr = w.dot_row(r, x);
                }
            } else {
                let chunk = (w.rows() / (rayon::current_num_threads() * 8)).clamp(16, 1024);
                y.par_chunks_mut(chunk).enumerate().for_each(|(c, yc)| {
                    for (i, yr) in yc.iter_mut().enumerate() {
                        *yr = w.dot_row(c * chunk + i, x);
                    }
                });
            }
        }
    }
}

/// `ys[t] = W·xs[t]` for `t` positions; `xs` is `[t, cols]`, `ys` is `[t, rows]`, row-major.
/// Each output equals what [`matvec`] gives for that position alone, bit for bit.
pub fn matmul(w: &Mat<'_>, xs: &[f32], ys: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(xs.len() % cols, 0, "matmul input width");
    let t = xs.len() / cols;
    assert_eq!(ys.len(), t * rows, "matmul output size");
    if t == 1 {
        return matvec(w, xs, ys);
    }
    if let Mat::DenseT { .. } = w {
        // Input-major weights: one gemv per position (the kernel streams the matrix by rows).
        return ys
            .chunks_mut(rows)
            .zip(xs.chunks(cols))
            .for_each(|(y, x)| matvec(w, x, y));
    }
    // Tiles of output rows: each weight row is read once for all positions of the block.
    let ptr = SendPtr(ys.as_mut_ptr());
    let tile = 16;
    let run = |tile_idx: usize| {
        let r0 = tile_idx * tile;
        let r1 = (r0 + tile).min(rows);
        for r in r0..r1 {
            for (p, x) in xs.chunks_exact(cols).enumerate() {
                let v = w.dot_row(r, x);
                // SAFETY: each (p, r) is written by exactly one tile (tiles partition the
                // rows) and `p * rows + r < t * rows == ys.len()`; `ys` outlives the loop.
                unsafe { *ptr.get().add(p * rows + r) = v };
            }
        }
    };
    let n_tiles = rows.div_ceil(tile);
    if rows * cols * t < PAR_THRESHOLD {
        (0..n_tiles).for_each(run);
    } else {
        (0..n_tiles).into_par_iter().for_each(run);
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to write disjoint elements from different threads (see `matmul`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn reference(w: &Mat<'_>, x: &[f32]) -> Vec<f64> {
        let mut row = vec![0f32; w.cols()];
        (0..w.rows())
            .map(|r| {
                w.row_into(r, &mut row);
                row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum()
            })
            .collect()
    }

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

    fn check(w: &Mat<'_>, rng: &mut rand::rngs::StdRng) {
        let x: Vec<f32> = (0..w.cols()).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut y = vec![0f32; w.rows()];
        matvec(w, &x, &mut y);
        let r = reference(w, &x);
        for (a, b) in y.iter().zip(&r) {
            assert!((*a as f64 - b).abs() < 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
        // matmul gives each position exactly what matvec gives it alone
        let t = 3;
        let xs: Vec<f32> = (0..t * w.cols())
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let mut ys = vec![0f32; t * w.rows()];
        matmul(w, &xs, &mut ys);
        for p in 0..t {
            let mut y1 = vec![0f32; w.rows()];
            matvec(w, &xs[p * w.cols()..(p + 1) * w.cols()], &mut y1);
            assert_eq!(&ys[p * w.rows()..(p + 1) * w.rows()], &y1[..]);
        }
    }

    #[test]
    fn kernels_match_reference_on_odd_shapes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(rows, cols) in &[(1, 1), (3, 7), (17, 33), (64, 96), (300, 257), (1030, 130)] {
            for fmt in [Float::F32, Float::BF16, Float::F16] {
                let bytes: Vec<u8> = (0..rows * cols)
                    .flat_map(|_| {
                        let v: f32 = rng.gen_range(-1.0..1.0);
                        match fmt {
                            Float::F32 => v.to_le_bytes().to_vec(),
                            Float::BF16 => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                            Float::F16 => half::f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
                        }
                    })
                    .collect();
                check(
                    &Mat::Dense {
                        fmt,
                        bytes: &bytes,
                        rows,
                        cols,
                    },
                    &mut rng,
                );
                check(
                    &Mat::DenseT {
                        fmt,
                        bytes: &bytes,
                        rows,
                        cols,
                    },
                    &mut rng,
                );
            }
        }
        for &(rows, cols) in &[(1, 32), (5, 64), (33, 96), (700, 320)] {
            let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..rows * cols / 32)
                .map(|_| rng.gen_range(120..134))
                .collect();
            check(
                &Mat::Mxfp4 {
                    blocks: &blocks,
                    scales: &scales,
                    rows,
                    cols,
                },
                &mut rng,
            );
        }
    }
}
