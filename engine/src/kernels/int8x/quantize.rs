//! The inputs of the `--int8-experts` kernels: each block of 32 rounded to int8 with one f32
//! scale and laid out as [`super`]'s "Layout of the quantized inputs" says ([`quantize`]), one
//! arithmetic in scalar code and in AVX2 and AVX-512 vectors; and the rounded inputs as f64
//! for tests ([`rounded`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{byte_at, position};

/// Quantizes positions of `cols` inputs (`cols` a multiple of 32) into the layout the
/// kernels read; `out` has the length of `xs`. A block holding a NaN or an infinity gets a
/// NaN scale, so the outputs it feeds are NaN, as on the exact path. Where the CPU has
/// AVX-512 BW and VL ([`quantize_x86`]) or AVX2 ([`quantize_avx2`]), vector arithmetic writes
/// the same bytes (the same f32 operations on each element, so the same integers; a test
/// compares each with [`quantize_scalar`]).
pub(in crate::kernels) fn quantize(xs: &[f32], cols: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if quantize_x86_supported() {
            // SAFETY: the CPU has the features (just checked).
            return unsafe { quantize_x86(xs, cols, out) };
        }
        if crate::kernels::avx2::supported() {
            // SAFETY: the CPU has AVX2 (just checked).
            return unsafe { quantize_avx2(xs, cols, out) };
        }
    }
    quantize_scalar(xs, cols, out);
}

/// Whether this CPU runs [`quantize_x86`] (checked once).
#[cfg(target_arch = "x86_64")]
pub(super) fn quantize_x86_supported() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    })
}

/// One quantized block: its scale `d`, the sum of its 32 integers, and its bytes as eight
/// 4-byte words, word `2 j + odd` holding elements `2 (4 j + m) + odd`, m = 0..4 (four such
/// elements lie side by side in every layout, at [`byte_at`] of element `8 j + odd`).
struct Block {
    d: f32,
    sum: i32,
    words: [u32; 8],
}

/// A block's scale `d` (NaN for a block with a NaN or an infinity) and the factor its inputs
/// are multiplied by before rounding (0 where the scale is 0 or NaN).
fn block_scale(amax: f32, finite: bool) -> (f32, f32) {
    let scale = amax / 127.0;
    let inv = if scale > 0.0 && finite {
        1.0 / scale
    } else {
        0.0
    };
    (if finite { scale } else { f32::NAN }, inv)
}

/// [`quantize`] with `block` quantizing each block of 32 inputs: the slots of each position
/// (values, scales, offsets) written where the kernels read them.
#[inline(always)]
fn quantize_with(xs: &[f32], cols: usize, out: &mut [f32], block: impl Fn(&[f32]) -> Block) {
    let nb = cols / 32;
    for (x, o) in xs.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let (q, rest) = o.split_at_mut(cols / 4);
        let (d, rest) = rest.split_at_mut(nb);
        let offsets = &mut rest[..nb];
        // SAFETY: the slots' memory as bytes: in bounds (`4 * q.len()` bytes), `u8` has no
        // alignment or validity requirements, and `q` is not used while this view lives.
        let bytes = unsafe { std::slice::from_raw_parts_mut(q.as_mut_ptr() as *mut u8, cols) };
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let k = block(xb);
            d[b] = k.d;
            offsets[b] = f32::from_bits((-12 * k.sum) as u32);
            for (i, w) in k.words.iter().enumerate() {
                let at = byte_at(nb, b, 8 * (i / 2) + i % 2);
                bytes[at..at + 4].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
}

/// [`quantize`] in vectors, block by block: the largest magnitude and the finiteness test on
/// sixteen lanes at a time, then each element's product, rounding and clamping as
/// [`round_i8`] does them (a NaN lane gives 0, as `as i8` does), narrowed to bytes, summed,
/// and put in word order by one byte shuffle ([`block_words`]).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(super) unsafe fn quantize_x86(xs: &[f32], cols: usize, out: &mut [f32]) {
    let magic = _mm512_set1_ps(12_582_912.0);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let abs_bits = _mm512_set1_epi32(0x7fff_ffff);
    let inf = _mm512_set1_ps(f32::INFINITY);
    quantize_with(xs, cols, out, |xb| {
        // SAFETY: `xb` holds 32 elements, read as two vectors of sixteen.
        let (v0, v1) = unsafe {
            (
                _mm512_loadu_ps(xb.as_ptr()),
                _mm512_loadu_ps(xb.as_ptr().add(16)),
            )
        };
        let a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), abs_bits));
        let a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs_bits));
        let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a0, inf)
            & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a1, inf)
            == 0xffff;
        // Exact, as the scalar fold is, when every element is finite (the only case in which
        // it is used).
        let (d, inv) = block_scale(_mm512_reduce_max_ps(_mm512_max_ps(a0, a1)), finite);
        let s = _mm512_set1_ps(inv);
        let round = |v: __m512| {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, s), magic), magic);
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(r, r);
            _mm512_maskz_cvtps_epi32(!nan, _mm512_min_ps(_mm512_max_ps(r, lo), hi))
        };
        let (i0, i1) = (round(v0), round(v1));
        let q = _mm256_set_m128i(_mm512_cvtepi32_epi8(i1), _mm512_cvtepi32_epi8(i0));
        Block {
            words: block_words(q),
            d,
            sum: _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)),
        }
    });
}

/// A block's 32 integers, as bytes in element order, in [`Block`]'s word order: per 128-bit
/// lane the even bytes of each 8-byte half, then its odd ones.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn block_words(q: __m256i) -> [u32; 8] {
    let order = _mm256_setr_epi8(
        0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12,
        14, 9, 11, 13, 15,
    );
    let mut words = [0u32; 8];
    // SAFETY: `words` holds 32 bytes.
    unsafe {
        _mm256_storeu_si256(
            words.as_mut_ptr() as *mut __m256i,
            _mm256_shuffle_epi8(q, order),
        )
    };
    words
}

/// [`quantize_x86`] on eight lanes (AVX2): the four vectors' integers packed to bytes (which
/// leaves them in 4-byte runs out of order), put back in element order by one dword permute,
/// then in word order by [`block_words`] as the AVX-512 one does.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_avx2(xs: &[f32], cols: usize, out: &mut [f32]) {
    let magic = _mm256_set1_ps(12_582_912.0);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let abs_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let inf = _mm256_set1_ps(f32::INFINITY);
    // After the two packs, dword `k` holds elements `4 p[k] .. 4 p[k] + 4` with p = 0, 2, 4,
    // 6, 1, 3, 5, 7.
    let runs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    quantize_with(xs, cols, out, |xb| {
        // SAFETY: `xb` holds 32 elements, read as four vectors of eight.
        let v: [__m256; 4] =
            std::array::from_fn(|k| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * k)) });
        let a = v.map(|v| _mm256_and_ps(v, abs_bits));
        let finite = a
            .iter()
            .all(|&a| _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, inf)) == 0xff);
        // Exact (a maximum) when every element is finite, the only case in which it is used.
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        let (d, inv) = block_scale(_mm_cvtss_f32(m), finite);
        let s = _mm256_set1_ps(inv);
        let i = v.map(|v| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, s), magic), magic);
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(r, r));
            let c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            _mm256_andnot_si256(nan, c)
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let sum = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32::<1>(sum));
        let q = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let q = _mm256_permutevar8x32_epi32(q, runs);
        Block {
            words: block_words(q),
            d,
            sum: _mm_cvtsi128_si32(sum),
        }
    });
}

/// [`quantize`] one element at a time: the definition.
pub(super) fn quantize_scalar(xs: &[f32], cols: usize, out: &mut [f32]) {
    quantize_with(xs, cols, out, |xb| {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (d, inv) = block_scale(amax, xb.iter().all(|v| v.is_finite()));
        let qb: [i8; 32] = std::array::from_fn(|e| round_i8(xb[e] * inv));
        Block {
            d,
            sum: qb.iter().map(|&v| v as i32).sum(),
            words: std::array::from_fn(|i| {
                let (j, odd) = (i / 2, i % 2);
                u32::from_le_bytes(std::array::from_fn(|m| qb[8 * j + 2 * m + odd] as u8))
            }),
        }
    });
}

/// The inputs as the int8 path rounds them (`q · d`, exact in f64), in element order: what
/// the path multiplies the weights by (a test reference).
pub(in crate::kernels) fn rounded(xs: &[f32], cols: usize) -> Vec<f64> {
    let nb = cols / 32;
    let mut q = vec![0f32; xs.len()];
    quantize(xs, cols, &mut q);
    let mut out = Vec::with_capacity(xs.len());
    for p in 0..xs.len() / cols.max(1) {
        let (v, d, _) = position(&q, cols, p);
        for b in 0..nb {
            out.extend((0..32).map(|e| v[byte_at(nb, b, e)] as f64 * d[b] as f64));
        }
    }
    out
}

/// `v` rounded to the nearest integer (ties to even: adding and taking away 1.5 · 2^23 is
/// exact arithmetic below 2^22, and not a library call as `f32::round` is on baseline x86-64),
/// clamped to ±127; NaN gives 0.
pub(super) fn round_i8(v: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    ((v + MAGIC) - MAGIC).clamp(-127.0, 127.0) as i8
}

#[cfg(test)]
mod tests {
    use super::super::{byte_at, position};
    use super::*;

    /// The offsets are `-12 Σ q` of each block, the scales `max |x| / 127`.
    #[test]
    fn quantize_writes_values_scales_and_offsets() {
        let cols = 9 * 32;
        let x: Vec<f32> = (0..cols).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let mut q = vec![0f32; cols];
        quantize(&x, cols, &mut q);
        let (v, d, offsets) = position(&q, cols, 0);
        for b in 0..cols / 32 {
            let xb = &x[32 * b..32 * (b + 1)];
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(d[b], amax / 127.0);
            let mut sum = 0;
            for (e, &xe) in xb.iter().enumerate() {
                let got = v[byte_at(cols / 32, b, e)];
                assert_eq!(got, round_i8(xe * (1.0 / d[b])), "block {b} element {e}");
                sum += got as i32;
            }
            assert_eq!(offsets[b].to_bits() as i32, -12 * sum);
        }
    }

    /// Each vector quantization this CPU runs writes the scalar one's bytes: every rounding
    /// tie, blocks of tiny, huge, subnormal, zero, NaN and infinite inputs, whole groups and
    /// the blocks past them, over every slot the kernels read.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_quantizations_write_the_scalar_bytes() {
        type Quantize = unsafe fn(&[f32], usize, &mut [f32]);
        let mut runs: Vec<(&str, Quantize)> = Vec::new();
        if crate::kernels::avx2::supported() {
            runs.push(("avx2", quantize_avx2));
        } else {
            eprintln!("NOT RUN: this CPU has no AVX2 for its vector quantization");
        }
        if quantize_x86_supported() {
            runs.push(("avx512", quantize_x86));
        } else {
            eprintln!("NOT RUN: this CPU has no AVX-512 BW and VL for its vector quantization");
        }
        let cols = 11 * 32 + 64;
        let nb = cols / 32;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for round in 0..300 {
            let mut x = vec![0f32; 3 * cols];
            for (i, v) in x.iter_mut().enumerate() {
                let r = next();
                let b = (i / 32) % 12;
                *v = match (round + b) % 12 {
                    // Halves: rounding ties once scaled (max 127 exactly).
                    0 => ((r % 255) as f32 - 127.0) * 0.5,
                    1 => f32::from_bits(r as u32 & 0x807f_ffff), // subnormal or zero
                    2 => ((r % 2001) as f32 - 1000.0) * 1e30,
                    3 if r % 7 == 0 => f32::NAN,
                    4 if r % 9 == 0 => f32::INFINITY,
                    5 if r % 9 == 0 => f32::NEG_INFINITY,
                    6 => 0.0,
                    7 => -0.0,
                    8 => ((r % 255) as f32 - 127.0) * 1e-38,
                    _ => {
                        f32::from_bits((r as u32 & 0x807f_ffff) | 0x3f00_0000)
                            * ((r >> 40) % 9) as f32
                    }
                };
            }
            let mut want = vec![f32::from_bits(0x5a5a_5a5a); x.len()];
            quantize_scalar(&x, cols, &mut want);
            for &(name, quantize) in &runs {
                let mut got = vec![f32::from_bits(0x5a5a_5a5a); x.len()];
                // SAFETY: the CPU has the features (checked above).
                unsafe { quantize(&x, cols, &mut got) };
                for p in 0..3 {
                    let (wv, wd, wo) = position(&want, cols, p);
                    let (gv, gd, go) = position(&got, cols, p);
                    assert_eq!(wv, gv, "{name} round {round} position {p}: int8 values");
                    for b in 0..nb {
                        let (w, g) = ((wd[b], wo[b]), (gd[b], go[b]));
                        assert_eq!(w.0.to_bits(), g.0.to_bits(), "{name} {round} {b}: scale");
                        assert_eq!(w.1.to_bits(), g.1.to_bits(), "{name} {round} {b}: offset");
                    }
                }
            }
        }
    }
}
