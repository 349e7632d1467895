//! Known-answer checks of an ISA's kernels against an f64 reference and, bit for bit, against
//! the scalar reference kernels (every ISA computes their arithmetic, see [`super`]).
//!
//! The unit tests run every ISA this CPU has on many shapes (the AVX-512 ISA in software
//! where the CPU lacks it: `avx512_emulated`). A machine elsewhere may run an ISA natively that
//! this project's test machines only emulate (the compiler's AVX-512 code and an AVX-512 CPU
//! are not tested by the emulation), so [`Isa::process`](super::Isa::process) also runs
//! [`self_check`] once, on a few small matrices of every format, before the process uses a
//! ISA: an ISA that fails it is not used, the next lower one is, with a warning. A kernel that
//! goes wrong only on shapes the check does not cover would still get through; the check is a
//! guard against an ISA that is wrong everywhere (an instruction misread, a CPU or OS quirk),
//! not a proof.

use super::{matmul_in, Float, Isa, Mat};

/// A small deterministic generator (xorshift64*), so the check needs no random-number crate
/// outside tests and gives the same matrices on every run.
pub(crate) struct Gen(u64);

impl Gen {
    /// A generator from `seed` (any value).
    pub(crate) fn new(seed: u64) -> Self {
        Self((seed ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `[-1, 1)`.
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u32 << 23) as f32 - 1.0
    }

    /// A byte.
    pub(crate) fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }

    /// `n` values in `[-1, 1)`.
    pub(crate) fn units(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }

    /// The blocks and scales of a random MXFP4 matrix (`cols` a multiple of 32), its scales
    /// near 1 (2^-7 to 2^6), so products stay far from overflow.
    pub(crate) fn mxfp4(&mut self, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let blocks = (0..rows * cols / 2).map(|_| self.byte()).collect();
        let scales = (0..rows * cols / 32)
            .map(|_| 120 + self.byte() % 14)
            .collect();
        (blocks, scales)
    }

    /// `n` elements in `[-1, 1)` stored as `fmt`, little-endian.
    pub(crate) fn dense(&mut self, fmt: Float, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * fmt.size());
        for _ in 0..n {
            let v = self.unit();
            match fmt {
                Float::F32 => out.extend(v.to_le_bytes()),
                Float::BF16 => out.extend(((v.to_bits() >> 16) as u16).to_le_bytes()),
                Float::F16 => out.extend(half::f16::from_f32(v).to_bits().to_le_bytes()),
            }
        }
        out
    }
}

/// `W·x` in f64 from the dequantized rows (for [`Mat::Mxfp4Int8`], of the inputs as the int8
/// path rounds them: the product that path approximates only by its f32 steps).
pub(crate) fn reference(w: &Mat<'_>, x: &[f32]) -> Vec<f64> {
    let x: Vec<f64> = match *w {
        Mat::Mxfp4Int8 { cols, .. } => super::int8x::rounded(x, cols),
        _ => x.iter().map(|&v| v as f64).collect(),
    };
    let mut row = vec![0f32; w.cols()];
    (0..w.rows())
        .map(|r| {
            w.row_into(r, &mut row);
            row.iter().zip(&x).map(|(&a, &b)| a as f64 * b).sum()
        })
        .collect()
}

/// Checks `ISA`'s kernels on `w` (see [`check_with`]); and, on an ISA other than the scalar
/// one, that they give the scalar kernels' bits (see [`check_same_bits`]).
pub(crate) fn check_mat(
    isa: Isa,
    w: &Mat<'_>,
    block_sizes: &[usize],
    g: &mut Gen,
) -> Result<(), String> {
    let kernel = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| matmul_in(isa, w, xs, ys);
    let scalar = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| matmul_in(Isa::Scalar, w, xs, ys);
    check_with(w, block_sizes, g, kernel)
        .and_then(|()| check_rows_alone(isa, w, g))
        .and_then(|()| {
            if isa == Isa::Scalar {
                Ok(())
            } else {
                check_same_bits(w, block_sizes, g, kernel, scalar)
            }
        })
        .map_err(|e| format!("{isa} kernels on {}: {e}", describe(w)))
}

/// True if `a` and `b` are the same f32, bit for bit, counting every NaN as the same (which NaN
/// an operation on NaNs returns is the CPU's choice, not the summation order's).
pub(crate) fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Checks that `kernel` gives `reference`'s bits ([`same_bits`]) on `w`, for one position and
/// for blocks of each of `block_sizes` positions, inputs from `g`. The error names the first
/// output that differs.
pub(crate) fn check_same_bits(
    w: &Mat<'_>,
    block_sizes: &[usize],
    g: &mut Gen,
    kernel: impl Fn(&Mat<'_>, &[f32], &mut [f32]),
    reference: impl Fn(&Mat<'_>, &[f32], &mut [f32]),
) -> Result<(), String> {
    let (rows, cols) = (w.rows(), w.cols());
    for t in std::iter::once(1).chain(block_sizes.iter().copied()) {
        let xs = g.units(t * cols);
        let (mut got, mut want) = (vec![f32::NAN; t * rows], vec![f32::NAN; t * rows]);
        kernel(w, &xs, &mut got);
        reference(w, &xs, &mut want);
        if let Some(i) = (0..t * rows).find(|&i| !same_bits(got[i], want[i])) {
            return Err(format!(
                "position {} of {t}, row {}: {:e} against the scalar reference's {:e}",
                i / rows.max(1),
                i % rows.max(1),
                got[i],
                want[i]
            ));
        }
    }
    Ok(())
}

/// [`matvec_rows_in`](super::matvec_rows_in) on `ISA`: rows asked for alone, backwards and
/// repeated, bit-identical to the same rows of the whole product (row-major matrices).
fn check_rows_alone(isa: Isa, w: &Mat<'_>, g: &mut Gen) -> Result<(), String> {
    if matches!(w, Mat::DenseT { .. }) {
        return Ok(());
    }
    let (rows, cols) = (w.rows(), w.cols());
    let x = g.units(cols);
    let mut all = vec![f32::NAN; rows];
    matmul_in(isa, w, &x, &mut all);
    let pick: Vec<usize> = (0..rows).rev().chain((0..rows).step_by(3)).collect();
    let mut got = vec![f32::NAN; pick.len()];
    super::matvec_rows_in(isa, w, &pick, &x, &mut got);
    match pick
        .iter()
        .zip(&got)
        .find(|&(&r, v)| v.to_bits() != all[r].to_bits())
    {
        Some((&r, v)) => Err(format!(
            "row {r} computed alone: {v} against {} in the whole product",
            all[r]
        )),
        None => Ok(()),
    }
}

/// `w`'s format and shape, in a few words (its `Debug` form lists every byte).
pub(crate) fn describe(w: &Mat<'_>) -> String {
    let kind = match *w {
        Mat::Dense { fmt, .. } => format!("{fmt:?}"),
        Mat::DenseT { fmt, .. } => format!("input-major {fmt:?}"),
        Mat::Q8 { .. } => "Q8".into(),
        Mat::Mxfp4 { .. } => "MXFP4".into(),
        Mat::Mxfp4Int8 { .. } => "MXFP4 (int8 inputs)".into(),
    };
    format!("{kind} {}x{}", w.rows(), w.cols())
}

/// Checks `kernel` (`ys = W·xs` for any number of positions) on `w`: one position against
/// [`reference`] (to the rounding error of an f32 sum in any order, bounded by the sum of the
/// terms' magnitudes), then blocks of each of `block_sizes` positions bit-identical, position by
/// position, to one position alone. Inputs come from `g`. The error names the first output
/// that is wrong.
pub(crate) fn check_with(
    w: &Mat<'_>,
    block_sizes: &[usize],
    g: &mut Gen,
    kernel: impl Fn(&Mat<'_>, &[f32], &mut [f32]),
) -> Result<(), String> {
    let (rows, cols) = (w.rows(), w.cols());
    let x = g.units(cols);
    let mut y = vec![f32::NAN; rows];
    kernel(w, &x, &mut y);
    let want = reference(w, &x);
    let mut row = vec![0f32; cols];
    for (i, (&a, &b)) in y.iter().zip(&want).enumerate() {
        w.row_into(i, &mut row);
        let mag: f64 = row
            .iter()
            .zip(&x)
            .map(|(&a, &b)| (a as f64 * b as f64).abs())
            .sum();
        let tol = 1e-6 * (mag + 1.0) * (cols as f64).sqrt().max(1.0);
        let err = (a as f64 - b).abs();
        if err.is_nan() || err > tol {
            return Err(format!("row {i}: {a} against {b} (tolerance {tol:.3e})"));
        }
    }
    for &t in block_sizes {
        let xs = g.units(t * cols);
        let mut ys = vec![f32::NAN; t * rows];
        kernel(w, &xs, &mut ys);
        let mut y1 = vec![f32::NAN; rows];
        for p in 0..t {
            kernel(w, &xs[p * cols..(p + 1) * cols], &mut y1);
            let got = &ys[p * rows..(p + 1) * rows];
            if let Some(r) = (0..rows).find(|&r| got[r].to_bits() != y1[r].to_bits()) {
                return Err(format!(
                    "position {p} of a block of {t}, row {r}: {} against {} alone",
                    got[r], y1[r]
                ));
            }
        }
    }
    Ok(())
}

/// Matrices of every format the kernels take, small but of odd sizes (row and column tails,
/// several position groups, a full-width MXFP4 row; MXFP4 on int8 inputs with and without
/// blocks past its groups of eight), checked on `ISA` with [`check_mat`]. A few milliseconds
/// on a SIMD ISA.
pub(crate) fn self_check(isa: Isa) -> Result<(), String> {
    let mut g = Gen::new(0x5eed);
    let block_sizes = [2, 5, 33];
    for (rows, cols) in [(37, 101), (6, 8)] {
        for fmt in [Float::F32, Float::BF16, Float::F16] {
            // One spare byte up front: weights need not be aligned.
            let mut bytes = vec![0u8];
            bytes.extend(g.dense(fmt, rows * cols));
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
                check_mat(isa, &w, &block_sizes, &mut g)?;
            }
        }
        let q: Vec<u8> = (0..rows * cols).map(|_| g.byte()).collect();
        let scales: Vec<f32> = (0..rows).map(|_| (g.unit() + 1.0) * 0.01).collect();
        check_mat(
            isa,
            &Mat::Q8 {
                q: &q,
                scales: &scales,
                rows,
                cols,
            },
            &block_sizes,
            &mut g,
        )?;
    }
    for (rows, cols) in [(37, 96), (6, 256), (5, 2880)] {
        let (blocks, scales) = g.mxfp4(rows, cols);
        let w = Mat::Mxfp4 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        check_mat(isa, &w, &block_sizes, &mut g)?;
        let w = Mat::Mxfp4Int8 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        check_mat(isa, &w, &block_sizes, &mut g)?;
    }
    Ok(())
}

/// The first ISA from `start` down that passes `check` (scalar, the reference, is not
/// checked), with a warning for each one that failed.
pub(crate) fn first_passing(
    start: Isa,
    check: impl Fn(Isa) -> Result<(), String>,
) -> (Isa, Vec<String>) {
    let mut warnings = Vec::new();
    let mut isa = start;
    while isa != Isa::Scalar {
        let Err(e) = check(isa) else { break };
        let lower = Isa::ALL
            .into_iter()
            .rev()
            .find(|t| *t < isa && t.is_native())
            .unwrap_or(Isa::Scalar);
        warnings.push(format!(
            "the {isa} kernels failed their self-check on this CPU, so the slower {lower} \
             kernels are used instead (please report this with the CPU model): {e}"
        ));
        isa = lower;
    }
    (isa, warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_available_isa_passes_the_self_check() {
        for isa in Isa::available() {
            assert_eq!(self_check(isa), Ok(()), "{isa}");
        }
    }

    /// The check can fail: a wrong output for one position, a NaN, and a block whose positions
    /// differ in the last bit from one position alone are each caught and named; so is a last
    /// bit that differs from the scalar reference's.
    #[test]
    fn check_catches_wrong_results() {
        let (rows, cols) = (9, 64);
        let mut g = Gen::new(3);
        let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| g.byte()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|_| 127).collect();
        let w = Mat::Mxfp4 {
            blocks: &blocks,
            scales: &scales,
            rows,
            cols,
        };
        let right = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| matmul_in(Isa::Scalar, w, xs, ys);
        assert_eq!(check_with(&w, &[2, 5], &mut Gen::new(4), right), Ok(()));
        let off = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| {
            right(w, xs, ys);
            ys[3] += 0.25;
        };
        let e = check_with(&w, &[2, 5], &mut Gen::new(4), off).unwrap_err();
        assert!(e.starts_with("row 3:"), "{e}");
        let nan = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| {
            right(w, xs, ys);
            ys[8] = f32::NAN;
        };
        let e = check_with(&w, &[2, 5], &mut Gen::new(4), nan).unwrap_err();
        assert!(e.starts_with("row 8:"), "{e}");
        let block = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| {
            right(w, xs, ys);
            if xs.len() == 5 * cols {
                ys[2 * rows + 6] = f32::from_bits(ys[2 * rows + 6].to_bits() ^ 1);
            }
        };
        let e = check_with(&w, &[2, 5], &mut Gen::new(4), block).unwrap_err();
        assert!(e.starts_with("position 2 of a block of 5, row 6:"), "{e}");
        assert_eq!(
            check_same_bits(&w, &[2, 5], &mut Gen::new(4), right, right),
            Ok(())
        );
        let e = check_same_bits(&w, &[2, 5], &mut Gen::new(4), block, right).unwrap_err();
        assert!(e.starts_with("position 2 of 5, row 6:"), "{e}");
        let last_bit = |w: &Mat<'_>, xs: &[f32], ys: &mut [f32]| {
            right(w, xs, ys);
            ys[4] = f32::from_bits(ys[4].to_bits() ^ 1);
        };
        let e = check_same_bits(&w, &[2, 5], &mut Gen::new(4), last_bit, right).unwrap_err();
        assert!(e.starts_with("position 0 of 1, row 4:"), "{e}");
        assert!(same_bits(f32::NAN, -f32::NAN) && !same_bits(0.0, -0.0));
    }

    #[test]
    fn a_failing_isa_falls_to_the_next_lower_one() {
        let best = Isa::detected();
        let (isa, warnings) = first_passing(best, |t| {
            if t == best {
                Err("broken".into())
            } else {
                Ok(())
            }
        });
        if best == Isa::Scalar {
            assert_eq!((isa, warnings.len()), (Isa::Scalar, 0));
        } else {
            assert!(isa < best && isa.is_native(), "{isa} below {best}");
            assert_eq!(warnings.len(), 1);
            assert!(warnings[0].contains("broken") && warnings[0].contains(best.name()));
        }
        let (isa, warnings) = first_passing(best, |_| Err("all broken".into()));
        assert_eq!(isa, Isa::Scalar);
        assert_eq!(warnings.len(), Isa::native().len() - 1);
        assert_eq!(first_passing(best, |_| Ok(())), (best, vec![]));
    }
}
