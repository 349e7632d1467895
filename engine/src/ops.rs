//! Small elementwise and reduction operations on f32 rows.

/// RMSNorm: `y = w ⊙ (x · 1/sqrt(mean(x²) + eps))`, all in f32. In f32 the GPT-OSS and Qwen3
/// variants (which differ only in where a lower-precision model rounds) coincide.
pub fn rms_norm(x: &[f32], w: &crate::kernels::Vector<'_>, eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for (i, (o, &v)) in out.iter_mut().zip(x).enumerate() {
        *o = w.at(i) * (v * inv);
    }
}

/// In-place RMSNorm of each `width`-wide chunk of `x` (QK-norm over heads).
pub fn rms_norm_heads(x: &mut [f32], width: usize, w: &crate::kernels::Vector<'_>, eps: f32) {
    for head in x.chunks_exact_mut(width) {
        let ss: f32 = head.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / width as f32 + eps).sqrt();
        for (i, v) in head.iter_mut().enumerate() {
            *v = w.at(i) * (*v * inv);
        }
    }
}

/// Dot product of two f32 slices of equal length in a fixed order: eight interleaved partial
/// sums (lane `l` takes elements `i ≡ l mod 8`), reduced pairwise, then the tail. The same
/// order on every CPU, and written so the compiler keeps the lanes in vector registers.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len()) / 8 * 8;
    let mut acc = [0f32; 8];
    for (ac, bc) in a[..n].chunks_exact(8).zip(b[..n].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ac[l] * bc[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in a[n..].iter().zip(&b[n..]) {
        s += x * y;
    }
    s
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// In-place softmax of `x`.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Softmax of `scores` with an extra "sink" logit that takes probability mass but has no
/// value: `p_j = exp(s_j) / (Σ_i exp(s_i) + exp(sink))`. Writes the probabilities in place.
pub fn softmax_with_sink(scores: &mut [f32], sink: f32) {
    let m = scores.iter().copied().fold(sink, f32::max);
    let mut s = (sink - m).exp();
    for v in scores.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in scores.iter_mut() {
        *v /= s;
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
/// Writes into `idx` (len k). NaN ranks below every number.
pub fn top_k(x: &[f32], idx: &mut [usize]) {
    let k = idx.len();
    let mut n = 0;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() && n == k {
            continue;
        }
        // insertion position among the current n (stable: equal values keep earlier first)
        let mut p = n;
        while p > 0 && greater(v, x[idx[p - 1]]) {
            p -= 1;
        }
        if p < k {
            let end = n.min(k - 1);
            for j in (p..end).rev() {
                idx[j + 1] = idx[j];
            }
            idx[p] = i;
            n = (n + 1).min(k);
        }
    }
}

#[inline]
fn greater(a: f32, b: f32) -> bool {
    match (a.is_nan(), b.is_nan()) {
        (true, _) => false,
        (false, true) => true,
        _ => a > b,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_sums_in_its_fixed_order() {
        let a: Vec<f32> = (0..19).map(|i| 1.0 + i as f32 * 0.37).collect();
        let b: Vec<f32> = (0..19).map(|i| 0.5 - i as f32 * 0.11).collect();
        let mut acc = [0f32; 8];
        for i in 0..16 {
            acc[i % 8] += a[i] * b[i];
        }
        let mut want =
            ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for i in 16..19 {
            want += a[i] * b[i];
        }
        assert_eq!(dot(&a, &b).to_bits(), want.to_bits());
        let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        assert!((dot(&a, &b) as f64 - exact).abs() < 1e-4);
        assert_eq!(dot(&[], &[]), 0.0);
    }

    use super::*;
    use crate::kernels::{Float, Vector};

    #[test]
    fn rms_norm_reference() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let wb: Vec<u8> = [1.0f32, 2.0, 0.5, -1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let w = Vector {
            fmt: Float::F32,
            bytes: &wb,
        };
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0;
        let inv = 1.0 / (ms + 1e-5f64).sqrt();
        for (i, o) in out.iter().enumerate() {
            let want = [1.0, 2.0, 0.5, -1.0][i] * x[i] as f64 * inv;
            assert!((*o as f64 - want).abs() < 1e-6);
        }
        // eps matters for tiny inputs
        let z = [0.0f32; 4];
        rms_norm(&z, &w, 1e-5, &mut out);
        assert_eq!(out, [0.0, 0.0, 0.0, -0.0]);
    }

    #[test]
    fn sink_takes_mass() {
        let mut s = [0.0f32, 0.0];
        softmax_with_sink(&mut s, 0.0);
        assert!((s[0] - 1.0 / 3.0).abs() < 1e-7 && (s[1] - 1.0 / 3.0).abs() < 1e-7);
        let mut s = [1.0f32, 2.0, 3.0];
        softmax_with_sink(&mut s, f32::NEG_INFINITY);
        let mut p = [1.0f32, 2.0, 3.0];
        softmax(&mut p);
        assert_eq!(s, p, "a -inf sink is plain softmax");
        let mut s = [0.0f32];
        softmax_with_sink(&mut s, 100.0);
        assert!(s[0] < 1e-40, "a huge sink swallows the mass");
    }

    #[test]
    fn top_k_order_and_ties() {
        let mut idx = [0usize; 3];
        top_k(&[0.1, 0.9, 0.5, 0.9, -1.0], &mut idx);
        assert_eq!(idx, [1, 3, 2]);
        let mut idx = [0usize; 2];
        top_k(&[3.0, 3.0, 3.0, 3.0], &mut idx);
        assert_eq!(idx, [0, 1]);
        top_k(&[f32::NAN, 1.0, 2.0], &mut idx);
        assert_eq!(idx, [2, 1]);
        let mut idx = [0usize; 4];
        top_k(&[5.0, 4.0, 3.0, 2.0, 1.0, 6.0], &mut idx);
        assert_eq!(idx, [5, 0, 1, 2]);
    }
}
