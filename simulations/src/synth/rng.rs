//! The counter-based generator and the value distributions of each kind of tensor.
//!
//! `draw(key, i)` is SplitMix64's output function applied to `key + (i+1)·φ`: a pure function
//! of the tensor's key and the counter, so any range of any tensor can be generated on any
//! thread in any order and still give the same bytes.

/// SplitMix64's increment (2^64 / φ).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijective 64-bit mix.
#[inline]
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th 64 random bits of stream `key`.
#[inline]
pub(crate) fn draw(key: u64, i: u64) -> u64 {
    mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// The stream key of a named tensor under `seed`.
pub(crate) fn key(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, then mixed with the seed.
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix(mix(seed ^ 0x5EED_5EED_5EED_5EED).wrapping_add(h))
}

/// 1/σ of the sum of four uniform 16-bit integers: σ² = 4·(65536² − 1)/12.
const INV_SUM4_STD: f32 = 1.0 / 37_837.227;
const SUM4_MEAN: f32 = 131_070.0; // 4 · 65535 / 2

/// An approximately standard normal value (Irwin–Hall of four 16-bit uniforms, |z| < 3.5).
#[inline]
pub(crate) fn gauss(r: u64) -> f32 {
    let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
    (s as f32 - SUM4_MEAN) * INV_SUM4_STD
}

/// How many of 128 draws land on each FP4 magnitude code 0..8 (0, 0.5, 1, 1.5, 2, 3, 4, 6):
/// a N(0, 2) value rounded to the nearest code, the spread a 32-element block takes after
/// MXFP4 quantisation with `e = ceil(log2(amax/6))`.
const FP4_MAGNITUDE_COUNTS: [u8; 8] = [13, 25, 22, 19, 22, 17, 8, 2];

/// FP4 E2M1 magnitudes by code (SPEC §4.3).
const FP4_MAGNITUDES: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Random byte → FP4 nibble: the top bit is the sign (bit 3 of the nibble), the low seven
/// bits pick a magnitude code with the frequencies of [`FP4_MAGNITUDE_COUNTS`].
pub(crate) const NIBBLE_OF_BYTE: [u8; 256] = nibble_table();

const fn nibble_table() -> [u8; 256] {
    let mut t = [0u8; 256];
    let mut code = 0;
    let mut at = 0;
    while code < 8 {
        let mut n = 0;
        while n < FP4_MAGNITUDE_COUNTS[code] {
            t[at] = code as u8;
            t[at + 128] = code as u8 | 8;
            at += 1;
            n += 1;
        }
        code += 1;
    }
    assert!(at == 128, "the magnitude counts sum to 128");
    t
}

/// Mean square of a code drawn through [`NIBBLE_OF_BYTE`] (4.0 with the counts above).
pub(crate) fn fp4_code_mean_square() -> f64 {
    let mut s = 0.0;
    for (c, v) in FP4_MAGNITUDE_COUNTS.iter().zip(FP4_MAGNITUDES) {
        s += f64::from(*c) * v * v;
    }
    s / 128.0
}

/// E8M0 scales that give dequantised weights of standard deviation `std`: each block takes
/// exponent `lo` or `lo + 1`, the latter with the probability that makes the mean variance
/// exact. Returns (`127 + lo`, threshold on a u32 draw below which the block takes `lo + 1`).
pub(crate) fn e8m0_for_std(std: f64) -> (u8, u32) {
    let ratio = std * std / fp4_code_mean_square();
    // 4^lo <= ratio < 4^(lo+1)
    let lo = (ratio.log2() / 2.0).floor();
    let p = (ratio / 4f64.powf(lo) - 1.0) / 3.0;
    let lo = (lo as i64).clamp(-127, 126);
    let threshold = (p.clamp(0.0, 1.0) * f64::from(u32::MAX)) as u32;
    ((127 + lo) as u8, threshold)
}

/// The bf16 bits of `x`, rounded to nearest even.
#[inline]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauss_is_standardised() {
        let n = 200_000u64;
        let (mut s, mut s2) = (0f64, 0f64);
        for i in 0..n {
            let z = f64::from(gauss(draw(7, i)));
            s += z;
            s2 += z * z;
        }
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }

    #[test]
    fn nibble_table_has_both_signs_and_all_codes() {
        let mut seen = [0u32; 16];
        for b in NIBBLE_OF_BYTE {
            seen[b as usize] += 1;
        }
        for (code, count) in FP4_MAGNITUDE_COUNTS.iter().enumerate() {
            assert_eq!(seen[code], u32::from(*count));
            assert_eq!(seen[code | 8], u32::from(*count));
        }
        assert!((fp4_code_mean_square() - 4.0).abs() < 1e-12);
    }

    #[test]
    fn e8m0_mix_hits_the_target_variance() {
        for std in [1.0 / 2880f64.sqrt(), 1.0 / 64f64.sqrt(), 0.3, 2.0] {
            let (lo, thr) = e8m0_for_std(std);
            let p = f64::from(thr) / f64::from(u32::MAX);
            let e = f64::from(lo) - 127.0;
            let var = fp4_code_mean_square() * ((1.0 - p) * 4f64.powf(e) + p * 4f64.powf(e + 1.0));
            assert!(
                (var.sqrt() / std - 1.0).abs() < 1e-6,
                "{std}: {}",
                var.sqrt()
            );
        }
    }

    #[test]
    fn keys_differ_by_seed_and_name() {
        assert_ne!(key(0, "a"), key(1, "a"));
        assert_ne!(key(0, "a"), key(0, "b"));
        assert_eq!(key(3, "lm_head.weight"), key(3, "lm_head.weight"));
    }
}
