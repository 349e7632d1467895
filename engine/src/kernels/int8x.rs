//! MXFP4 weights times int8-quantized inputs ([`Mat::Mxfp4Int8`], the opt-in
//! `--int8-experts` path): each block of 32 inputs is rounded to int8 with one f32 scale
//! (max |x| / 127), the 4-bit weights times two are small integers (0, ±1, ±2, ±3, ±4, ±6,
//! ±8, ±12), and a block's 32 products are summed exactly in integers before one
//! multiply by the two scales. Approximate (the rounding of the inputs); never the default.
//!
//! Inputs reach the kernels in the layout [`quantize`] writes, in place of the f32 inputs
//! (the same length): per position of `cols`, first the `cols / 32` block scales, then the
//! int8 values, four to an f32 slot, each block's even elements then its odd ones (the order
//! in which the AVX2 kernel's nibble split yields the weights). Every ISA quantizes with the
//! same scalar code, so the integers are the same on every CPU.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Mat, SCALE};

/// Twice each FP4 value, by nibble.
const W2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Quantizes positions of `cols` inputs (`cols` a multiple of 32) into the layout the
/// kernels read; `out` has the length of `xs`. A block holding a NaN or an infinity gets a
/// NaN scale, so the outputs it feeds are NaN, as on the exact path.
pub(super) fn quantize(xs: &[f32], cols: usize, out: &mut [f32]) {
    let nb = cols / 32;
    for (x, o) in xs.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let (d, q) = o.split_at_mut(nb);
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let finite = xb.iter().all(|v| v.is_finite());
            let scale = amax / 127.0;
            let inv = if scale > 0.0 && finite {
                1.0 / scale
            } else {
                0.0
            };
            d[b] = if finite { scale } else { f32::NAN };
            let mut bytes = [0u8; 32];
            for k in 0..16 {
                bytes[k] = round_i8(xb[2 * k] * inv);
                bytes[16 + k] = round_i8(xb[2 * k + 1] * inv);
            }
            for (slot, c) in q[b * 8..b * 8 + 8].iter_mut().zip(bytes.chunks_exact(4)) {
                // Native order: the slot's bytes in memory are the values, as kernels read them.
                *slot = f32::from_bits(u32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
    }
}

fn round_i8(v: f32) -> u8 {
    v.round().clamp(-127.0, 127.0) as i8 as u8
}

/// The quantized block scales and int8 values of one position.
fn position(xs: &[f32], cols: usize, q: usize) -> (&[f32], &[i8]) {
    let x = &xs[q * cols..(q + 1) * cols];
    let (d, rest) = x.split_at(cols / 32);
    // SAFETY: the slots' memory read as bytes: in bounds (`4 * rest.len()` bytes), `i8` has
    // no alignment or validity requirements, and nothing writes `xs` while it is borrowed.
    let bytes = unsafe { std::slice::from_raw_parts(rest.as_ptr() as *const i8, 4 * rest.len()) };
    (d, bytes)
}

/// How far ahead (bytes of blocks) the one-position AVX2 kernel prefetches.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// Most positions one SIMD call takes (one row's decode shared by all of them).
pub(super) const POSITIONS: usize = 8;

/// Rows `r0 .. r0 + n` for `p` quantized positions on `ISA`: the AVX2 kernel for the AVX2
/// and AVX-512 ISAs, the NEON kernel for NEON, else the scalar reference.
pub(super) fn rows(
    isa: super::Isa,
    w: &Mat<'_>,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    super::check_rows(w, r0, n, xs, p, out);
    let Mat::Mxfp4Int8 {
        blocks,
        scales,
        cols,
        ..
    } = *w
    else {
        unreachable!("int8x takes only Mxfp4Int8 weights")
    };
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, super::Isa::Avx2 | super::Isa::Avx512)
        && p <= POSITIONS
        && super::avx2::supported()
    {
        // SAFETY: the ISA was detected on this CPU (both imply AVX2 and FMA); bounds
        // checked above.
        unsafe { with_positions!(p, avx2_tile(blocks, scales, cols, r0, n, xs, out)) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa == super::Isa::Neon && p <= POSITIONS && super::neon::supported() {
        // SAFETY: NEON detected on this CPU; bounds checked above.
        unsafe { neon_rows(blocks, scales, cols, r0, n, xs, p, out) };
        return;
    }
    let _ = isa;
    reference_rows(blocks, scales, cols, r0, n, xs, p, out)
}

/// NEON kernel for up to [`POSITIONS`] positions: per block the nibbles index a table of
/// twice the FP4 values (`TBL`), widening multiply-adds (`SMULL`/`SMLAL`) sum four products
/// per 16-bit lane, a pairwise widening add gives four 32-bit sums, which are converted and
/// scaled into f32 accumulators.
///
/// # Safety
/// The CPU has NEON; rows `r0 .. r0 + n` and `p <= POSITIONS` positions are in bounds.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn neon_rows(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    use std::arch::aarch64::*;
    let nb = cols / 32;
    // SAFETY (whole body): rows `r0 .. r0 + n` of `blocks`/`scales` and `p` positions of
    // `cols` slots of `xs` are in bounds (caller).
    unsafe {
        let table = vld1q_s8(W2.as_ptr());
        let nibble = vdupq_n_u8(0x0f);
        let d: [*const f32; POSITIONS] =
            std::array::from_fn(|q| xs.as_ptr().add(q.min(p - 1) * cols));
        let qx: [*const i8; POSITIONS] = std::array::from_fn(|q| d[q].add(nb) as *const i8);
        for i in 0..n {
            let b = blocks.as_ptr().add((r0 + i) * nb * 16);
            let s = scales.as_ptr().add((r0 + i) * nb);
            let mut acc = [vdupq_n_f32(0.0); POSITIONS];
            for blk in 0..nb {
                let v = vld1q_u8(b.add(16 * blk));
                let even = vqtbl1q_s8(table, vandq_u8(v, nibble));
                let odd = vqtbl1q_s8(table, vshrq_n_u8::<4>(v));
                let half = SCALE[*s.add(blk) as usize] * 0.5;
                for q in 0..p {
                    let xe = vld1q_s8(qx[q].add(32 * blk));
                    let xo = vld1q_s8(qx[q].add(32 * blk + 16));
                    let mut s16 = vmull_s8(vget_low_s8(even), vget_low_s8(xe));
                    s16 = vmlal_high_s8(s16, even, xe);
                    s16 = vmlal_s8(s16, vget_low_s8(odd), vget_low_s8(xo));
                    s16 = vmlal_high_s8(s16, odd, xo);
                    let sum = vcvtq_f32_s32(vpaddlq_s16(s16));
                    acc[q] = vfmaq_n_f32(acc[q], sum, *d[q].add(blk) * half);
                }
            }
            for q in 0..p {
                out[q * n + i] = vaddvq_f32(acc[q]);
            }
        }
    }
}

/// Scalar reference: per block, the exact integer sum of weights (times two) by quantized
/// inputs, times the input scale and half the block's E8M0 scale, added in block order.
#[allow(clippy::too_many_arguments)]
pub(super) fn reference_rows(
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
    for q in 0..p {
        let (d, byte) = position(xs, cols, q);
        for i in 0..n {
            let r = r0 + i;
            let mut acc = 0f32;
            for b in 0..nb {
                let wb = &blocks[(r * nb + b) * 16..(r * nb + b + 1) * 16];
                let mut isum = 0i32;
                for (k, &wbyte) in wb.iter().enumerate() {
                    let even = W2[(wbyte & 15) as usize] as i32;
                    let odd = W2[(wbyte >> 4) as usize] as i32;
                    isum += even * byte[b * 32 + k] as i32 + odd * byte[b * 32 + 16 + k] as i32;
                }
                acc += isum as f32 * (d[b] * (SCALE[scales[r * nb + b] as usize] * 0.5));
            }
            out[q * n + i] = acc;
        }
    }
}

/// AVX2 kernel for `P` (1-8) positions: per block the nibbles index two byte tables (|2w| and
/// 2w), `sign` moves each weight's sign onto its input, `maddubs`/`madd` sum the 32 products
/// into eight 32-bit lanes, which are converted and scaled into f32 accumulators.
///
/// # Safety
/// The CPU has AVX2 and FMA; rows `r0 .. r0 + n` and `P` positions are in bounds.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_tile<const P: usize>(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    out: &mut [f32],
) {
    const fn table(signed: bool) -> [i8; 32] {
        let mut t = [0i8; 32];
        let mut i = 0;
        while i < 32 {
            let v = W2[i % 16];
            t[i] = if signed || v >= 0 { v } else { -v };
            i += 1;
        }
        t
    }
    const ABS: [i8; 32] = table(false);
    const SIGNED: [i8; 32] = table(true);
    let nb = cols / 32;
    // SAFETY (whole body): rows `r0 .. r0 + n` of `blocks`/`scales` and `P` positions of
    // `cols` slots of `xs` are in bounds (caller); loads are unaligned.
    unsafe {
        let abs = _mm256_loadu_si256(ABS.as_ptr() as *const __m256i);
        let signed = _mm256_loadu_si256(SIGNED.as_ptr() as *const __m256i);
        let split = super::avx2::NibbleSplit::new();
        let ones = _mm256_set1_epi16(1);
        let d: [*const f32; P] = std::array::from_fn(|q| xs.as_ptr().add(q * cols));
        let qx: [*const u8; P] = std::array::from_fn(|q| d[q].add(nb) as *const u8);
        for i in 0..n {
            let b = blocks.as_ptr().add((r0 + i) * nb * 16);
            let s = scales.as_ptr().add((r0 + i) * nb);
            let mut acc = [_mm256_setzero_ps(); P];
            for blk in 0..nb {
                if P == 1 && blk % 4 == 0 {
                    // One position decodes slower than memory streams and the hardware
                    // prefetcher alone keeps too few lines in flight: the weights (and scales)
                    // PREFETCH bytes ahead, a line at a time (a hint, harmless past the end;
                    // measured paired per decoded token: +7-8% decode with `--int8-experts`).
                    _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(16 * blk + PREFETCH) as *const i8);
                    if blk % 64 == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(
                            s.wrapping_add(blk + PREFETCH / 16) as *const i8
                        );
                    }
                }
                let idx = split.split(b.add(16 * blk));
                let wa = _mm256_shuffle_epi8(abs, idx);
                let ws = _mm256_shuffle_epi8(signed, idx);
                let half = _mm256_set1_ps(SCALE[*s.add(blk) as usize] * 0.5);
                for q in 0..P {
                    let x = _mm256_loadu_si256(qx[q].add(32 * blk) as *const __m256i);
                    let prod = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, ws));
                    let sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                    let f = _mm256_mul_ps(_mm256_set1_ps(*d[q].add(blk)), half);
                    acc[q] = _mm256_fmadd_ps(sum, f, acc[q]);
                }
            }
            for q in 0..P {
                out[q * n + i] = super::avx2::hsum(acc[q]);
            }
        }
    }
}
