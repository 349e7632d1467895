//! Rotary position embedding, rotate-half ("NeoX") layout, with optional YaRN scaling.
//!
//! Follows Transformers' `_compute_default_rope_parameters` and `_compute_yarn_parameters`:
//! `inv_freq` in f32, angle `p · inv_freq_i` in f32, cos and sin multiplied by the attention
//! scaling factor (so q·k is scaled by its square).

use crate::config::{RopeConfig, YarnConfig};

/// Precomputed frequencies for one head width.
#[derive(Clone, Debug)]
pub struct Rope {
    /// `inv_freq[i]` for `i < head_dim/2`.
    pub inv_freq: Vec<f32>,
    /// Multiplier on cos and sin (YaRN "mscale"; 1 without scaling).
    pub attention_scaling: f32,
}

/// YaRN's `get_mscale`.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl Rope {
    /// Frequencies for `head_dim` under `cfg`.
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Self {
        let half = head_dim / 2;
        let base = cfg.theta;
        // pos_freq_i = base^(2i/dim), computed in f64 and rounded once.
        let pos_freq: Vec<f64> = (0..half)
            .map(|i| base.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        match &cfg.yarn {
            None => Self {
                inv_freq: pos_freq.iter().map(|p| (1.0 / p) as f32).collect(),
                attention_scaling: 1.0,
            },
            Some(y) => Self::yarn(y, base, head_dim, &pos_freq),
        }
    }

    fn yarn(y: &YarnConfig, base: f64, dim: usize, pos_freq: &[f64]) -> Self {
        let factor = y.factor;
        let (low, high) = correction_range(y, base, dim);
        let (low, high) = if low == high {
            (low, high + 0.001)
        } else {
            (low, high)
        };
        let inv_freq = pos_freq
            .iter()
            .enumerate()
            .map(|(i, &pf)| {
                let extrap = (1.0 / pf) as f32;
                let interp = (1.0 / (factor * pf)) as f32;
                let ramp = (((i as f64 - low) / (high - low)).clamp(0.0, 1.0)) as f32;
                let extrap_factor = 1.0 - ramp;
                interp * (1.0 - extrap_factor) + extrap * extrap_factor
            })
            .collect();
        Self {
            inv_freq,
            attention_scaling: attention_factor(y) as f32,
        }
    }

    /// Writes `cos` and `sin` (each `head_dim/2` long) for `pos`, already scaled.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = p * f;
            *c = a.cos() * self.attention_scaling;
            *s = a.sin() * self.attention_scaling;
        }
    }

    /// Rotates each `head_dim`-wide head of `x` in place: `[a·cos − b·sin, b·cos + a·sin]`.
    pub fn apply(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (ai, bi) = (a[i], b[i]);
                a[i] = ai * cos[i] - bi * sin[i];
                b[i] = bi * cos[i] + ai * sin[i];
            }
        }
    }
}

/// YaRN's attention scaling: `attention_factor` if given, else the mscale ratio, else
/// `get_mscale(factor, 1)`.
pub(crate) fn attention_factor(y: &YarnConfig) -> f64 {
    match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(ma)) => get_mscale(y.factor, m) / get_mscale(y.factor, ma),
        _ => get_mscale(y.factor, 1.0),
    }
}

/// YaRN's correction range `(low, high)`, clamped to `[0, dim-1]`.
pub(crate) fn correction_range(y: &YarnConfig, base: f64, dim: usize) -> (f64, f64) {
    let corr = |rot: f64| {
        dim as f64 * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt_oss_rope() -> RopeConfig {
        RopeConfig {
            theta: 150000.0,
            yarn: Some(YarnConfig {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096.0,
                truncate: false,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
            }),
        }
    }

    #[test]
    fn yarn_matches_spec_values() {
        let cfg = gpt_oss_rope();
        let (low, high) = correction_range(cfg.yarn.as_ref().unwrap(), 150000.0, 64);
        assert!((low - 8.0928).abs() < 1e-4, "low {low}");
        assert!((high - 17.3980).abs() < 1e-4, "high {high}");
        let r = Rope::new(&cfg, 64);
        for (i, want) in [1.0f32, 0.68904, 0.47478, 0.32715].iter().enumerate() {
            assert!(
                (r.inv_freq[i] - want).abs() < 1e-5,
                "inv_freq[{i}] = {}",
                r.inv_freq[i]
            );
        }
        assert!(
            (r.inv_freq[31] / 3.0235e-7 - 1.0).abs() < 1e-4,
            "{}",
            r.inv_freq[31]
        );
        assert!((r.attention_scaling as f64 - 1.3465735902799727).abs() < 1e-7);
    }

    #[test]
    fn default_rope_is_plain_powers() {
        let r = Rope::new(
            &RopeConfig {
                theta: 10000.0,
                yarn: None,
            },
            8,
        );
        assert_eq!(r.attention_scaling, 1.0);
        assert_eq!(r.inv_freq[0], 1.0);
        assert!((r.inv_freq[2] - 0.01).abs() < 1e-9);
    }

    #[test]
    fn rotate_half_pairs_i_with_i_plus_half() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        let cos = [0.0, 1.0];
        let sin = [1.0, 0.0];
        Rope::apply(&mut x, 4, &cos, &sin);
        // pair (0,2): a=1,b=3 rotated by 90° -> (-3, 1); pair (1,3) unrotated
        assert_eq!(x, vec![-3.0, 2.0, 1.0, 4.0]);
    }
}
