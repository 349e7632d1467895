//! Choosing the next token from logits: greedy by default; temperature, top-k, top-p and a
//! repetition penalty, with a seeded generator so that a seed always gives the same tokens.
//!
//! The order of operations is Transformers' (`generate` with `do_sample=True`): repetition
//! penalty, temperature, top-k, top-p, then one draw. In detail:
//! - **Repetition penalty** `p` (1 = off), for every distinct id in the history: a positive
//!   logit is divided by `p`, a negative one multiplied by it (applied once per id, however
//!   often it occurs). It applies to greedy decoding too.
//! - **Greedy** when `temperature == 0` or `top_k == 1`: the largest logit, the lowest id on
//!   ties. No random number is drawn.
//! - **Temperature** `t`: logits divided by `t`.
//! - **Top-k** (0 = off): only the `k` largest logits stay (ties broken by lower id).
//! - **Top-p** (1 = off): over the remaining tokens, sorted by probability (lower id first
//!   on ties), the shortest prefix whose probability reaches `p` stays, at least one token.
//! - **Draw**: one uniform `u` in [0, 1) from the generator; the token is the first, in the
//!   order above (id order when neither top-k nor top-p is on), whose cumulative probability
//!   exceeds `u` times the total.
//!
//! The generator is xoshiro256** (Blackman and Vigna), its 256-bit state filled from the
//! 64-bit seed by SplitMix64, and `u = (next_u64 >> 11) * 2^-53`. This is fixed: the same
//! seed yields the same stream on every machine and in every version (a test pins the first
//! outputs). The tokens drawn are therefore the same given bit-identical logits; the
//! probabilities use `f32::exp`, which could in principle differ in the last bit between
//! math libraries.
//!
//! No allocation per token: the sampler keeps its scratch buffers and reuses them.
//! NaN logits count as negative infinity.

use std::cmp::Ordering;

/// Sampling settings. The default is greedy with no penalty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy. Otherwise must be positive and finite.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the most likely tokens up to this probability mass, in (0, 1]; 1 turns it off.
    pub top_p: f32,
    /// Penalty for tokens already in the history, positive; 1 turns it off.
    pub repetition_penalty: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether no random choice is made.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether the choice is the argmax of the logits as the model gives them (greedy with no
    /// penalty), so a model's screened head can make it
    /// ([`Model::forward_greedy`](crate::Model::forward_greedy)).
    pub fn is_plain_argmax(&self) -> bool {
        self.is_greedy() && self.repetition_penalty == 1.0
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |what: &str| Err(SamplingError::InvalidParams(what.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be 0 (greedy) or a positive finite number");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p must be in (0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty must be a positive finite number");
        }
        Ok(())
    }
}

/// Why no token could be chosen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// Settings out of range.
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(String),
    /// No logits were given.
    #[error("no logits to sample from")]
    EmptyLogits,
    /// Every logit is NaN or negative infinity.
    #[error("no finite logit to sample from")]
    NoFiniteLogit,
    /// A history token is outside the logits.
    #[error("history token {id} is outside the vocabulary of {vocab} logits")]
    TokenOutOfRange {
        /// The token.
        id: u32,
        /// The number of logits.
        vocab: usize,
    },
}

/// xoshiro256** seeded by SplitMix64 (see the module docs).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The generator for a seed.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform number in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks tokens; keeps its generator and scratch between calls.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Logits after penalty and temperature.
    work: Vec<f32>,
    /// (logit, id) candidates for top-k / top-p.
    cand: Vec<(f32, u32)>,
}

/// A clone makes the same choices from then on, without the scratch (refilled by every
/// call): generations that can roll back clone their sampler at every step, and the scratch
/// is two vocabulary-sized buffers.
impl Clone for Sampler {
    fn clone(&self) -> Self {
        Self {
            params: self.params,
            rng: self.rng.clone(),
            work: Vec::new(),
            cand: Vec::new(),
        }
    }
}

/// Largest first, lower id first on ties; NaN was mapped to -inf before.
fn by_logit_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

impl Sampler {
    /// A sampler; checks the settings.
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        Ok(Self {
            params,
            rng: Rng::new(params.seed),
            work: Vec::new(),
            cand: Vec::new(),
        })
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (one per vocabulary entry); `history` holds the
    /// tokens the repetition penalty applies to (Transformers uses prompt and output).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        let p = self.params;
        let n = logits.len();
        self.work.clear();
        self.work.extend(
            logits
                .iter()
                .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x }),
        );
        if p.repetition_penalty != 1.0 {
            for &id in history {
                let i = id as usize;
                let Some(&orig) = logits.get(i) else {
                    return Err(SamplingError::TokenOutOfRange { id, vocab: n });
                };
                if orig.is_nan() {
                    continue;
                }
                // From the original value, so a repeated id is penalized once.
                self.work[i] = if orig < 0.0 {
                    orig * p.repetition_penalty
                } else {
                    orig / p.repetition_penalty
                };
            }
        }
        let (best, max) = argmax(&self.work);
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogit);
        }
        if p.is_greedy() {
            return Ok(best);
        }
        let inv_t = 1.0 / p.temperature;
        let max_scaled = max * inv_t;
        let top_k = if p.top_k == 0 || p.top_k >= n {
            n
        } else {
            p.top_k
        };
        let u = self.rng.next_f64();

        if top_k == n && p.top_p >= 1.0 {
            // The whole distribution, in id order: no sort needed.
            let total: f64 = self
                .work
                .iter()
                .map(|&x| f64::from((x * inv_t - max_scaled).exp()))
                .sum();
            let target = u * total;
            let mut acc = 0.0f64;
            let mut last_positive = best;
            for (i, &x) in self.work.iter().enumerate() {
                let w = f64::from((x * inv_t - max_scaled).exp());
                if w > 0.0 {
                    last_positive = i as u32;
                }
                acc += w;
                if acc > target {
                    return Ok(i as u32);
                }
            }
            return Ok(last_positive);
        }

        // Candidates, largest first. With top-k, exactly the k best; with only top-p, grow a
        // sorted prefix until it holds the mass top-p needs (no full sort of the vocab).
        self.cand.clear();
        self.cand
            .extend(self.work.iter().enumerate().map(|(i, &x)| (x, i as u32)));
        if top_k < n {
            self.cand.select_nth_unstable_by(top_k - 1, by_logit_desc);
            self.cand.truncate(top_k);
        }
        let total: f64 = self
            .cand
            .iter()
            .map(|&(x, _)| f64::from((x * inv_t - max_scaled).exp()))
            .sum();
        let mut sorted = if p.top_p < 1.0 {
            64.min(self.cand.len())
        } else {
            self.cand.len()
        };
        let keep = loop {
            if sorted < self.cand.len() {
                self.cand.select_nth_unstable_by(sorted - 1, by_logit_desc);
            }
            self.cand[..sorted].sort_unstable_by(by_logit_desc);
            if p.top_p >= 1.0 {
                break sorted;
            }
            // Keep while the mass before a token is below top_p.
            let need = f64::from(p.top_p) * total;
            let mut acc = 0.0f64;
            let mut keep = None;
            for (j, &(x, _)) in self.cand[..sorted].iter().enumerate() {
                if j > 0 && acc >= need {
                    keep = Some(j);
                    break;
                }
                acc += f64::from((x * inv_t - max_scaled).exp());
            }
            match keep {
                Some(k) => break k,
                None if sorted == self.cand.len() => break sorted,
                None => sorted = (sorted * 4).min(self.cand.len()),
            }
        };
        let kept = &self.cand[..keep];
        let mass: f64 = kept
            .iter()
            .map(|&(x, _)| f64::from((x * inv_t - max_scaled).exp()))
            .sum();
        let target = u * mass;
        let mut acc = 0.0f64;
        for &(x, id) in kept {
            acc += f64::from((x * inv_t - max_scaled).exp());
            if acc > target {
                return Ok(id);
            }
        }
        Ok(kept[keep - 1].1)
    }
}

/// The index and value of the largest element (lowest index on ties).
fn argmax(xs: &[f32]) -> (u32, f32) {
    let mut best = 0;
    let mut max = f32::NEG_INFINITY;
    for (i, &x) in xs.iter().enumerate() {
        if x > max {
            max = x;
            best = i;
        }
    }
    (best as u32, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p).expect("valid params")
    }

    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// A clone samples what the sampler would have from that point, however much scratch
    /// the sampler had filled.
    #[test]
    fn a_clone_continues_the_same_choices() {
        let p = SamplingParams {
            temperature: 0.9,
            top_k: 5,
            top_p: 0.9,
            repetition_penalty: 1.2,
            seed: 11,
        };
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7) % 13) as f32 * 0.3).collect();
        let mut s = Sampler::new(p).unwrap();
        s.sample(&logits, &[1, 2]).unwrap();
        let mut c = s.clone();
        let a: Vec<u32> = (0..20).map(|_| s.sample(&logits, &[3]).unwrap()).collect();
        let b: Vec<u32> = (0..20).map(|_| c.sample(&logits, &[3]).unwrap()).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "the draws vary: {a:?}");
    }

    /// Pins the generator: these values must never change (same seed, same tokens).
    #[test]
    fn rng_stream_is_pinned() {
        let mut r = Rng::new(0);
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(
            got,
            [0x99ec5f36cb75f2b4, 0xbf6e1f784956452a, 0x1a5f849d4933e6e0]
        );
        let mut r = Rng::new(42);
        assert_eq!(r.next_u64(), 0x15780b2e0c2ec716);
    }

    #[test]
    fn default_is_greedy_and_breaks_ties_low() {
        let mut s = sampler(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0], &[]), Ok(1));
        assert_eq!(s.sample(&[f32::NAN, 0.5, 0.2], &[]), Ok(1));
    }

    #[test]
    fn temperature_zero_and_top_k_one_are_greedy() {
        let logits = logits_of(&[0.2, 0.5, 0.3]);
        for p in [
            SamplingParams {
                temperature: 0.0,
                seed: 9,
                ..Default::default()
            },
            SamplingParams {
                temperature: 5.0,
                top_k: 1,
                seed: 9,
                ..Default::default()
            },
            SamplingParams {
                temperature: 5.0,
                top_p: 1e-6,
                seed: 9,
                ..Default::default()
            },
        ] {
            let mut s = sampler(p);
            for _ in 0..200 {
                assert_eq!(s.sample(&logits, &[]), Ok(1), "{p:?}");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) * 0.05).collect();
        let run = |seed| {
            let mut s = sampler(SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                top_k: 200,
                seed,
                ..Default::default()
            });
            (0..100)
                .map(|_| s.sample(&logits, &[]).expect("sample"))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    fn frequencies(p: SamplingParams, logits: &[f32], draws: usize) -> Vec<f64> {
        let mut s = sampler(p);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..draws {
            counts[s.sample(logits, &[]).expect("sample") as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn draws_follow_the_distribution() {
        let probs = [0.5, 0.3, 0.15, 0.05];
        let f = frequencies(
            SamplingParams {
                temperature: 1.0,
                seed: 1,
                ..Default::default()
            },
            &logits_of(&probs),
            40_000,
        );
        for (got, want) in f.iter().zip(probs) {
            assert!((got - want).abs() < 0.01, "{f:?}");
        }
        // Temperature 2 flattens: p^(1/2), renormalized.
        let flat: Vec<f64> = probs.iter().map(|p: &f64| p.sqrt()).collect();
        let z: f64 = flat.iter().sum();
        let f = frequencies(
            SamplingParams {
                temperature: 2.0,
                seed: 2,
                ..Default::default()
            },
            &logits_of(&probs),
            40_000,
        );
        for (got, want) in f.iter().zip(&flat) {
            assert!((got - want / z).abs() < 0.01, "{f:?}");
        }
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let probs = [0.05, 0.5, 0.3, 0.15];
        let logits = logits_of(&probs);
        // top-k 2: only ids 1 and 2, renormalized to 0.625 / 0.375.
        let f = frequencies(
            SamplingParams {
                temperature: 1.0,
                top_k: 2,
                seed: 3,
                ..Default::default()
            },
            &logits,
            40_000,
        );
        assert_eq!((f[0], f[3]), (0.0, 0.0));
        assert!((f[1] - 0.625).abs() < 0.01, "{f:?}");
        // top-p 0.7: 0.5 < 0.7, so 0.3 joins; then 0.8 >= 0.7 stops.
        let f = frequencies(
            SamplingParams {
                temperature: 1.0,
                top_p: 0.7,
                seed: 4,
                ..Default::default()
            },
            &logits,
            40_000,
        );
        assert_eq!((f[0], f[3]), (0.0, 0.0));
        assert!((f[2] - 0.375).abs() < 0.01, "{f:?}");
    }

    #[test]
    fn top_p_grows_past_its_first_window() {
        // 1000 equally likely tokens: top-p 0.5 needs 500 of them, more than the first 64.
        let logits = vec![0.0f32; 1000];
        let f = frequencies(
            SamplingParams {
                temperature: 1.0,
                top_p: 0.5,
                seed: 5,
                ..Default::default()
            },
            &logits,
            20_000,
        );
        let kept = f.iter().filter(|&&x| x > 0.0).count();
        assert!(kept > 450 && kept <= 500, "{kept}");
        assert!(f[500..].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn repetition_penalty_divides_positive_multiplies_negative() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        // 3.0 / 2 = 1.5 < 2.0: the unseen id 1 wins.
        assert_eq!(s.sample(&[3.0, 2.0], &[0]), Ok(1));
        // Penalized once however often it repeats.
        assert_eq!(s.sample(&[3.0, 1.4], &[0, 0, 0]), Ok(0));
        // -1 * 2 = -2 < -1.5.
        assert_eq!(s.sample(&[-1.0, -1.5], &[0]), Ok(1));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 1.3,
            ..Default::default()
        });
        assert_eq!(s.sample(&[], &[]), Err(SamplingError::EmptyLogits));
        assert_eq!(
            s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]),
            Err(SamplingError::NoFiniteLogit)
        );
        assert!(matches!(
            s.sample(&[1.0], &[5]),
            Err(SamplingError::TokenOutOfRange { id: 5, vocab: 1 })
        ));
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(p).is_err(), "{p:?}");
        }
    }
}
