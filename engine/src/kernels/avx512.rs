//! The AVX-512 tier (F and BW, with AVX2 + FMA + F16C), for Xeons since Skylake-SP and Zen 4.
//!
//! The same structure as the AVX2 tier with 16 lanes: one accumulator per (row, position),
//! lane `l` summing elements `i ≡ l (mod 16)` in increasing `i`, a fixed lane reduction and a
//! fused scalar tail; so a position's result never depends on how many rows or positions a
//! call interleaves. With 32 vector registers, prefill kernels interleave 4 rows × 4 positions.
//! MXFP4 nibbles index a 16-entry f32 table with one permute (`vpermps`), giving exact FP4
//! values; each block's sum is multiplied by its E8M0 scale.

use std::arch::x86_64::*;

use super::{Float, Mat, Outs, BF16, F16, F32, FP4_LUT, I8, SCALE};

/// True if this CPU runs the tier.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && super::avx2::supported()
}

/// Output rows `r0 .. r0 + n` of a row-major matrix (`Dense` or `Mxfp4`) for `p` positions
/// `xs` (`[p, cols]`, `p <= 4`) into `out` (`[p, n]`).
pub(super) fn rows(w: &Mat<'_>, r0: usize, n: usize, xs: &[f32], p: usize, out: &mut [f32]) {
    if !supported() {
        return super::scalar::rows(w, r0, n, xs, p, out);
    }
    super::check_rows(w, r0, n, xs, p, out);
    assert!(p <= 4, "kernel takes at most 4 positions");
    // SAFETY: the CPU supports the tier (checked above) and `check_rows` verified that rows
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
                // SAFETY: the CPU supports the tier (checked above); `check_cols_t` verified
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
/// The CPU must support the tier, and the bounds `check_rows` verifies must hold.
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
        2 => sweep!(4, 2),
        3 => sweep!(4, 3),
        _ => sweep!(4, 4),
    }
}

/// Loads 16 elements of format `FMT` starting at element `i` of `w`, widened to f32.
///
/// # Safety
/// The CPU supports the tier and elements `i .. i + 16` are readable.
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

/// Dot products of `R` rows with `P` positions, `n` elements each.
///
/// The rows are consecutive. With one position (decode) it also prefetches the next `R` rows,
/// a cache line at a time, as the AVX2 tier does (measured there; not measured on AVX-512
/// hardware).
///
/// # Safety
/// The CPU supports the tier; each `w[k]` points to `n` readable elements of format `FMT` and
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
    let (per_line, ahead) = (64 / size, R * n * size);
    let mut i = 0;
    while i < main {
        if P == 1 && i % per_line == 0 {
            for p in w {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + i * size) as *const i8);
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

/// Dispatches MXFP4 rows and positions to the `R x P` kernels.
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
    let x = |q: usize| xs[q * cols..].as_ptr();
    macro_rules! run {
        ($r:literal, $p:literal, $i:expr) => {{
            let i = $i;
            // SAFETY: rows `r0 + i .. r0 + i + $r` are in bounds (caller).
            let b: [*const u8; $r] =
                std::array::from_fn(|k| unsafe { bb.add((r0 + i + k) * nb * 16) });
            // SAFETY: as above.
            let s: [*const u8; $r] = std::array::from_fn(|k| unsafe { sb.add((r0 + i + k) * nb) });
            let xp: [*const f32; $p] = std::array::from_fn(x);
            // SAFETY: whole rows of `nb` blocks and positions of `cols` f32 (caller).
            let v = unsafe { mxfp4_dot::<$r, $p>(b, s, xp, nb) };
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

/// Dot products of `R` consecutive MXFP4 rows (`nb` blocks each) with `P` positions. With one
/// position it also prefetches the next `R` rows' blocks and scales (short row streams; see
/// [`dense_dot`]).
///
/// # Safety
/// The CPU supports the tier; each `b[k]` points to `16 * nb` readable bytes, each `s[k]` to
/// `nb`, each `x[q]` to `32 * nb` f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn mxfp4_dot<const R: usize, const P: usize>(
    b: [*const u8; R],
    s: [*const u8; R],
    x: [*const f32; P],
    nb: usize,
) -> [[f32; P]; R] {
    // SAFETY: the 16-entry table read unaligned.
    let lut = unsafe { _mm512_loadu_ps(FP4_LUT.as_ptr()) };
    let low = _mm_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    for blk in 0..nb {
        if P == 1 && blk % 4 == 0 {
            for k in 0..R {
                // A hint: harmless past the end.
                _mm_prefetch::<_MM_HINT_T0>(b[k].wrapping_add((R * nb + blk) * 16) as *const i8);
                if blk % 64 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(s[k].wrapping_add(R * nb + blk) as *const i8);
                }
            }
        }
        for k in 0..R {
            // SAFETY: `blk < nb` (caller's bounds); unaligned load of 16 bytes.
            let v = unsafe { _mm_loadu_si128(b[k].add(16 * blk) as *const __m128i) };
            let lo = _mm_and_si128(v, low);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), low);
            // Byte j holds elements 2j (low nibble) and 2j+1 (high): interleave.
            let w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut);
            let w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), lut);
            // SAFETY: as above.
            let sc = _mm512_set1_ps(SCALE[unsafe { *s[k].add(blk) } as usize]);
            for q in 0..P {
                // SAFETY: elements `32 * blk .. 32 * blk + 32` of a position (caller).
                unsafe {
                    let xp = x[q].add(32 * blk);
                    let t = _mm512_mul_ps(w0, _mm512_loadu_ps(xp));
                    let t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp.add(16)), t);
                    acc[k][q] = _mm512_fmadd_ps(t, sc, acc[k][q]);
                }
            }
        }
    }
    let mut out = [[0f32; P]; R];
    for k in 0..R {
        for q in 0..P {
            out[k][q] = hsum(acc[k][q]);
        }
    }
    out
}

/// `y[q][o] = Σ_i x[q][i] · W[i, o0 + o]` for `P` positions, one fused multiply-add per input
/// in increasing `i` for every output; four input rows per pass over `y`.
///
/// # Safety
/// The CPU supports the tier; `w` holds `cols` rows of `ld` elements of format `FMT`,
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
    // SAFETY: the CPU supports the tier (asserted above).
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
