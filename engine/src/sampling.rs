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
//! - **Temperature** `t`: logits divided by `t`; each token's weight is
//!   `w = exp(x / t - max / t)` (in f32, as written in [`Sampler::sample`]).
//! - **Top-k** (0 = off): only the `k` largest logits stay (ties broken by lower id).
//! - **Top-p** (1 = off): over the remaining tokens, sorted by probability (lower id first
//!   on ties), the shortest prefix whose probability reaches `p` stays, at least one token.
//! - **Draw, with top-k or top-p**: one uniform `u` in [0, 1) from the generator; the token is
//!   the first, in the order above, whose cumulative weight exceeds `u` times the kept
//!   tokens' total weight.
//! - **Draw, with temperature alone** (an exponential race, the Gumbel-max trick): one 64-bit
//!   key `K` from the generator; each token `i` gets `E_i = -ln(v_i)`, `v_i` uniform in
//!   (0, 1) from wyrand's output for the state `K + (i + 1)·0xa0761d6478bd642f` (its top 52
//!   bits, `v = (bits + 1/2)·2^-52`), and the token is the one with the largest
//!   `s_i - ln(E_i)` (lowest id on ties), where `s_i = x_i / t - max / t` is the f32 exponent
//!   of its weight. This picks token `i` with probability `w_i / Σ w` exactly as the
//!   cumulative draw does (`E_i / w_i` are independent exponentials of rates `w_i`, and the
//!   smallest is `i`'s with that probability).
//!
//! **Why the race.** The cumulative draw over the whole vocabulary compares `u·Σ w` with
//! running sums, so its token depends on every token's weight to about `1/V` of the total:
//! where the distribution is flat (every random-weight checkpoint at temperature 0.7, whose
//! top token holds 0.1% of the mass) no bound short of every exact logit decides it. The race
//! draws from the same distribution, and its token depends only on the tokens whose key can
//! reach the winner's: a few dozen rows whatever the distribution. It replaced the
//! cumulative draw for temperature alone (so a seed gives other tokens than before that
//! change, from the same distribution); with top-k or top-p the cumulative draw stays, since
//! it is decided by the kept tokens, which a screen finds exactly where the distribution is
//! peaked enough for top-p to keep few tokens.
//!
//! **Screened sampling** ([`Sampler::sample_screened`]): given for every token a bound on its
//! logit (an 8-bit screen of the output head) and the exact logits of chosen tokens (the whole
//! head's, bit for bit), the sampler returns the token [`sample`](Sampler::sample) returns on
//! the whole head's logits, or says it cannot prove it (the caller then computes the whole
//! head; the generator is left as it was, so the same draw is made). It reads exactly: the
//! rows that can hold the largest logit; for the race, the rows whose key's upper bound
//! reaches the best proven key; for top-k, the rows whose bound reaches the k-th largest lower
//! bound; for top-p alone, the rows within `t·ln(V·2^20)` of the largest logit, the rest of
//! the vocabulary's weight bounded (at most 2^-20 of the total) and every comparison of the
//! draw made on intervals that hold every rounding of the whole head's sums (in any order);
//! an interval that straddles a decision gives up.
//!
//! The generator is xoshiro256** (Blackman and Vigna), its 256-bit state filled from the
//! 64-bit seed by SplitMix64, and `u = (next_u64 >> 11) * 2^-53`. This is fixed: the same
//! seed yields the same stream on every machine and in every version (a test pins the first
//! outputs). The tokens drawn are therefore the same given bit-identical logits; the
//! probabilities use `f32::exp` and the race `f64::ln`, which could in principle differ in the
//! last bit between math libraries.
//!
//! No allocation per token once the scratch buffers have grown: the sampler keeps them.
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

/// Computes the exact logits of some rows (in increasing order) into an output of their
/// length, bit for bit the whole head's ([`Sampler::sample_screened`]).
pub type ExactRows<'a, E> = &'a mut dyn FnMut(&[usize], &mut [f32]) -> Result<(), E>;

/// Picks tokens; keeps its generator and scratch between calls.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Logits after penalty and temperature.
    work: Vec<f32>,
    /// (logit, id) candidates for top-k / top-p.
    cand: Vec<(f32, u32)>,
    /// Scratch of [`sample_screened`](Self::sample_screened).
    screen: ScreenScratch,
}

/// A clone makes the same choices from then on, without the scratch (refilled by every
/// call): generations that can roll back clone their sampler at every step, and the scratch
/// is vocabulary-sized.
impl Clone for Sampler {
    fn clone(&self) -> Self {
        Self {
            params: self.params,
            rng: self.rng.clone(),
            work: Vec::new(),
            cand: Vec::new(),
            screen: ScreenScratch::default(),
        }
    }
}

/// Buffers of [`Sampler::sample_screened`].
#[derive(Debug, Default)]
struct ScreenScratch {
    /// Whether each id is in the history (the repetition penalty applies to it).
    penalized: Vec<bool>,
    /// Rows whose exact logits are asked for, in increasing order.
    rows: Vec<usize>,
    /// Their exact logits.
    exact: Vec<f32>,
    /// Rows (and their race noise) that pass a cheap test.
    more: Vec<(usize, f64)>,
    /// Lower bounds (top-k's threshold).
    lows: Vec<f64>,
    /// (work value, id) of the rows computed exactly.
    known: Vec<(f32, u32)>,
}

/// Largest first, lower id first on ties; NaN was mapped to -inf before.
fn by_logit_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// The race's random bits for token `i` under key `key` (see the module docs): wyrand
/// (Wang Yi's generator, one 64×64→128-bit product per output) at the state it reaches after
/// `i + 1` steps from `key`, so each token's bits cost one product, in any order.
fn race_bits(key: u64, i: usize) -> u64 {
    let s = key.wrapping_add(
        (i as u64)
            .wrapping_add(1)
            .wrapping_mul(0xa076_1d64_78bd_642f),
    );
    let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
    (t >> 64) as u64 ^ t as u64
}

/// `-ln(E)`, the race's noise for `bits` ([`race_bits`]): `E = -ln(v)`, `v` in (0, 1).
fn race_noise(bits: u64) -> f64 {
    let v = ((bits >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64);
    -(-v.ln()).ln()
}

/// An upper bound of [`race_noise`] from the bits alone, with no logarithm: with
/// `m = 2^53 - 2·(bits >> 12) - 1` (odd, at least 1), `E = -ln(v) >= 1 - v = m·2^-53 >=
/// 2^(63 - lz(m) - 53)`, so `-ln(E) <= (lz(m) - 10)·ln 2`; the margin covers the roundings
/// of the two logarithms (a few units in the last place of numbers below 40).
fn race_noise_bound(bits: u64) -> f64 {
    race_noise_bound_of(race_lz(bits))
}

/// The leading zeros [`race_noise_bound`] takes (11 to 63).
fn race_lz(bits: u64) -> u32 {
    ((1u64 << 53) - 2 * (bits >> 12) - 1).leading_zeros()
}

/// [`race_noise_bound`] for `lz` leading zeros.
fn race_noise_bound_of(lz: u32) -> f64 {
    (lz as f64 - 10.0) * std::f64::consts::LN_2 + 1e-9
}

/// A work value `h` with `s_hi(h) < target`, as large as found quickly (`s_hi`, the upper
/// bound of a row's exponent from its work value's, is nondecreasing, so every value at or
/// below `h` is below `target` too): from the inverse of `h·it - ms`, moved down until it
/// holds. `+inf` when nothing reaches `target` (`s_hi` never exceeds 0), `-inf` if no value
/// was found.
fn below(s_hi: &dyn Fn(f64) -> f64, target: f64, ms: f64, it: f64) -> f64 {
    if target > 0.0 {
        return f64::INFINITY;
    }
    let h0 = (target + ms) / it;
    let mut d = (h0.abs() + 1.0) * 1e-6;
    while d.is_finite() {
        let h = h0 - d;
        if s_hi(h) < target {
            return h;
        }
        d *= 2.0;
    }
    f64::NEG_INFINITY
}

/// Outward margins for quantities computed in f32 (one rounding of `2^-24` relative, or a
/// subnormal step) and bounded in f64: generous, so that they hold for any order of the two
/// roundings of `x / t - max / t`.
fn up32(x: f64) -> f64 {
    x + x.abs() * (1.0 / (1u64 << 22) as f64) + 1e-40
}
fn down32(x: f64) -> f64 {
    x - x.abs() * (1.0 / (1u64 << 22) as f64) - 1e-40
}

/// The repetition penalty as [`Sampler::sample`] applies it, on an f64 bound (monotone, so
/// bounds map to bounds; the f32 rounding is covered by the caller's margins).
fn penalize(x: f64, p: f32) -> f64 {
    if x < 0.0 {
        x * p as f64
    } else {
        x / p as f64
    }
}

/// Share of the vocabulary above which screened sampling gives up (the whole head is cheaper).
const MAX_SCREENED_SHARE: usize = 8;

/// With top-p alone, the screen computes the rows whose logit can be within `t·ln(V / TAIL)`
/// of the largest, so that the other rows weigh at most `TAIL` (the largest weighs 1): a draw
/// lands within that uncertainty, and gives up, about once in 2^20 tokens.
const TAIL: f64 = 1.0 / (1u64 << 20) as f64;

impl Sampler {
    /// A sampler; checks the settings.
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        Ok(Self {
            params,
            rng: Rng::new(params.seed),
            work: Vec::new(),
            cand: Vec::new(),
            screen: ScreenScratch::default(),
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
                self.work[i] = penalized_logit(orig, p.repetition_penalty);
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

        if top_k == n && p.top_p >= 1.0 {
            // The whole distribution: the race (see the module docs).
            let key = self.rng.next_u64();
            return Ok(race(&self.work, best, inv_t, max_scaled, key));
        }
        let u = self.rng.next_f64();

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
        Ok(draw(&self.cand[..keep], inv_t, max_scaled, u))
    }

    /// [`sample`](Self::sample) from bounds instead of logits: the same token, or `None` when
    /// the bounds cannot prove it (then nothing has changed: the caller computes the whole
    /// logits and calls [`sample`](Self::sample), which makes the same draw).
    ///
    /// Token `i`'s exact logit must lie within `approx[i] ± radius(i)` (an infinite radius
    /// is allowed; a NaN logit needs one); `exact(rows, out)` gives the exact logits of
    /// `rows` (increasing), bit for bit those `sample` would get. A logit found outside its
    /// bounds, a non-finite `approx`, a history id out of range, a vocabulary with no finite
    /// logit, or more candidates than an eighth of the vocabulary give `None`.
    pub fn sample_screened<E>(
        &mut self,
        approx: &[f32],
        radius: impl Fn(usize) -> f64,
        exact: ExactRows<'_, E>,
        history: &[u32],
    ) -> Result<Option<u32>, E> {
        let n = approx.len();
        let pen = self.params.repetition_penalty;
        if n == 0 || (pen != 1.0 && history.iter().any(|&id| id as usize >= n)) {
            return Ok(None);
        }
        let mut sc = std::mem::take(&mut self.screen);
        let mut penalized = std::mem::take(&mut sc.penalized);
        penalized.clear();
        if pen != 1.0 {
            penalized.resize(n, false);
            for &id in history {
                penalized[id as usize] = true;
            }
        }
        let rng = self.rng.clone();
        let got = self.screened(approx, radius, exact, &penalized, &mut sc);
        sc.penalized = penalized;
        self.screen = sc;
        if !matches!(got, Ok(Some(_))) {
            self.rng = rng;
        }
        got
    }

    fn screened<E>(
        &mut self,
        approx: &[f32],
        radius: impl Fn(usize) -> f64,
        exact: ExactRows<'_, E>,
        penalized: &[bool],
        sc: &mut ScreenScratch,
    ) -> Result<Option<u32>, E> {
        let p = self.params;
        let n = approx.len();
        let pen = p.repetition_penalty;
        let cap = n / MAX_SCREENED_SHARE;
        // Room for the most rows any call takes, so that no later token allocates.
        sc.rows.reserve(cap.saturating_sub(sc.rows.len()));
        sc.exact.reserve(cap.saturating_sub(sc.exact.len()));
        sc.more.reserve(cap.saturating_sub(sc.more.len()));
        sc.known.reserve((2 * cap).saturating_sub(sc.known.len()));
        // The exact logit's bounds, and the work value's (after the penalty).
        let raw = |i: usize| {
            let (a, r) = (approx[i] as f64, radius(i));
            let r = if r.is_nan() { f64::INFINITY } else { r };
            (a - r, a + r)
        };
        let bounds = |i: usize| {
            let (lo, hi) = raw(i);
            if pen != 1.0 && penalized[i] {
                (down32(penalize(lo, pen)), up32(penalize(hi, pen)))
            } else {
                (lo, hi)
            }
        };
        // Round 1: the rows that can hold the largest work value: every row holding it has
        // a bound at or above the largest lower bound, `floor`. One pass: the rows at or above
        // the floor so far (started from every 64th row's, so that few pass early), kept to
        // those at or above the final floor.
        let mut floor = (0..n)
            .step_by(64)
            .map(|i| bounds(i).0)
            .fold(f64::NEG_INFINITY, f64::max);
        sc.rows.clear();
        for (i, a) in approx.iter().enumerate() {
            if !a.is_finite() {
                return Ok(None);
            }
            let (lo, hi) = bounds(i);
            floor = floor.max(lo);
            if hi >= floor {
                if sc.rows.len() == cap {
                    // Too many early: filter what was kept before going on.
                    sc.rows.retain(|&r| bounds(r).1 >= floor);
                    if sc.rows.len() == cap {
                        return Ok(None);
                    }
                }
                sc.rows.push(i);
            }
        }
        if floor == f64::NEG_INFINITY {
            return Ok(None);
        }
        sc.rows.retain(|&r| bounds(r).1 >= floor);
        sc.known.clear();
        if !sc.fetch(&raw, exact, penalized, pen)? {
            return Ok(None);
        }
        let Some(&(max, best)) = sc.known.iter().min_by(|a, b| by_logit_desc(a, b)) else {
            return Ok(None);
        };
        if max == f32::NEG_INFINITY {
            return Ok(None);
        }
        if p.is_greedy() {
            return Ok(Some(best));
        }
        let inv_t = 1.0 / p.temperature;
        let max_scaled = max * inv_t;
        if !max_scaled.is_finite() {
            return Ok(None);
        }
        let (it, ms) = (inv_t as f64, max_scaled as f64);
        // Bounds of a row's f32 exponent `s = x·(1/t) - max/t` from its work value's bounds
        // (never above 0: no work value exceeds the largest).
        let s_hi = |hi: f64| up32(up32(hi * it) - ms).min(0.0);
        let s_lo = |lo: f64| down32(down32(lo * it) - ms);
        let top_k = if p.top_k == 0 || p.top_k >= n {
            n
        } else {
            p.top_k
        };
        if top_k == n && p.top_p >= 1.0 {
            let key = self.rng.next_u64();
            let exp_of = |x: f32| f64::from(x * inv_t - max_scaled);
            // The best key among the rows known: a lower bound of the winner's.
            let mut win = (f64::NEG_INFINITY, u32::MAX);
            for &(x, id) in &sc.known {
                let k = exp_of(x) + race_noise(race_bits(key, id as usize));
                if x != f32::NEG_INFINITY && (k > win.0 || (k == win.0 && id < win.1)) {
                    win = (k, id);
                }
            }
            // Rows whose key can reach it, by the cheap bound, then by the exact noise; the
            // best lower bound of a key rises as they come.
            let mut floor_key = win.0;
            // Per count of leading zeros (the cheap bound's input), a work value at or below
            // which no row's key reaches `floor_key`: one comparison for most rows. Refilled
            // when the floor rises (a lower floor's table still holds, only looser).
            let mut table = [f64::INFINITY; 64];
            let fill = |table: &mut [f64; 64], floor_key: f64| {
                for (lz, t) in table.iter_mut().enumerate().skip(11) {
                    let target = floor_key - race_noise_bound_of(lz as u32);
                    *t = below(&s_hi, target, ms, it);
                }
            };
            fill(&mut table, floor_key);
            let mut filled = floor_key;
            sc.more.clear();
            for i in 0..n {
                let bits = race_bits(key, i);
                let hi = bounds(i).1;
                if hi <= table[race_lz(bits) as usize] {
                    continue;
                }
                if s_hi(hi) + race_noise_bound(bits) >= floor_key {
                    if sc.more.len() == cap {
                        return Ok(None);
                    }
                    let g = race_noise(bits);
                    let (lo, hi) = bounds(i);
                    let k_hi = s_hi(hi) + g;
                    let k_lo = s_lo(lo) + g;
                    floor_key = floor_key.max(k_lo - k_lo.abs() * 1e-15 - 1e-12);
                    if k_hi + k_hi.abs() * 1e-15 + 1e-12 >= floor_key {
                        sc.more.push((i, g));
                    }
                    if floor_key > filled + 0.25 {
                        fill(&mut table, floor_key);
                        filled = floor_key;
                    }
                }
            }
            // Round 1's rows are known already.
            let mut r1 = sc.rows.iter().copied().peekable();
            sc.more.retain(|&(i, _)| {
                while r1.next_if(|&r| r < i).is_some() {}
                r1.peek() != Some(&i)
            });
            sc.rows.clear();
            for &(i, g) in &sc.more {
                let (_, hi) = bounds(i);
                if s_hi(hi) + g + (s_hi(hi) + g).abs() * 1e-15 + 1e-12 >= floor_key {
                    sc.rows.push(i);
                }
            }
            let before = sc.known.len();
            if !sc.fetch(&raw, exact, penalized, pen)? {
                return Ok(None);
            }
            for &(x, id) in &sc.known[before..] {
                let k = exp_of(x) + race_noise(race_bits(key, id as usize));
                if x != f32::NEG_INFINITY && (k > win.0 || (k == win.0 && id < win.1)) {
                    win = (k, id);
                }
            }
            return Ok((win.1 != u32::MAX).then_some(win.1));
        }

        // The cumulative draw over the kept tokens: the rows at or above a threshold `theta`
        // (of the work value) computed exactly, the others bounded.
        let u = self.rng.next_f64();
        let theta = if top_k < n {
            // The k-th largest lower bound: the k-th largest exact value is at or above it,
            // so every row below it is outside the top k.
            sc.lows.clear();
            sc.lows.extend((0..n).map(|i| bounds(i).0));
            let (_, kth, _) = sc
                .lows
                .select_nth_unstable_by(top_k - 1, |a, b| b.total_cmp(a));
            *kth
        } else {
            floor + p.temperature as f64 * (TAIL / n as f64).ln()
        };
        if !theta.is_finite() {
            return Ok(None);
        }
        sc.rows.clear();
        let mut r1 = 0;
        let mut outside = 0usize;
        for i in 0..n {
            let known = sc.known.get(r1).is_some_and(|k| k.1 as usize == i);
            if known {
                r1 += 1;
            } else if bounds(i).1 >= theta {
                if sc.rows.len() == cap {
                    return Ok(None);
                }
                sc.rows.push(i);
            } else {
                outside += 1;
            }
        }
        // `fetch` appends; round 1's rows stay in front, each part in id order.
        if !sc.fetch(&raw, exact, penalized, pen)? {
            return Ok(None);
        }
        sc.known.sort_unstable_by(by_logit_desc);
        // Rows at or above theta precede, in this order, every row left out (all below it).
        let valid = sc.known.partition_point(|&(x, _)| x as f64 >= theta);
        let weight = |x: f32| f64::from((x * inv_t - max_scaled).exp());
        // Each of the whole head's f64 sums of `m` weights, in any order, is within
        // `(m - 1)·2^-53` of its real value relatively; ours too: `g` covers both.
        let g = |m: usize| (2 * m + 4) as f64 * f64::EPSILON;
        let (total_lo, total_hi) = if top_k < n {
            if valid < top_k {
                return Ok(None);
            }
            let t: f64 = sc.known[..top_k].iter().map(|&(x, _)| weight(x)).sum();
            (t * (1.0 - g(top_k)), t * (1.0 + g(top_k)))
        } else {
            let t: f64 = sc.known.iter().map(|&(x, _)| weight(x)).sum();
            // Every row left out weighs at most exp(s) at theta, with f32 exp's rounding.
            let w_out = (s_hi(theta).exp() * (1.0 + 1e-6) + 1e-44) * outside as f64;
            (t * (1.0 - g(n)), (t + w_out) * (1.0 + g(n)))
        };
        let keep = if p.top_p >= 1.0 {
            top_k
        } else {
            let top_p = f64::from(p.top_p);
            let need_lo = top_p * total_lo * (1.0 - f64::EPSILON);
            let need_hi = top_p * total_hi * (1.0 + f64::EPSILON);
            let mut acc = 0.0f64;
            let mut keep = None;
            for j in 0..top_k {
                if j > 0 && acc >= need_lo {
                    if acc < need_hi {
                        return Ok(None);
                    }
                    keep = Some(j);
                    break;
                }
                if j >= valid {
                    return Ok(None);
                }
                acc += weight(sc.known[j].0);
            }
            match keep {
                Some(k) => k,
                None if top_k < n => top_k,
                None => return Ok(None),
            }
        };
        if keep > valid {
            return Ok(None);
        }
        Ok(Some(draw(&sc.known[..keep], inv_t, max_scaled, u)))
    }
}

impl ScreenScratch {
    /// Exact logits of `self.rows` through `exact`, appended to `self.known` as (work value,
    /// id); `false` if one lies outside its bounds.
    fn fetch<E>(
        &mut self,
        raw: &dyn Fn(usize) -> (f64, f64),
        exact: ExactRows<'_, E>,
        penalized: &[bool],
        pen: f32,
    ) -> Result<bool, E> {
        self.exact.clear();
        self.exact.resize(self.rows.len(), 0.0);
        exact(&self.rows, &mut self.exact)?;
        for (&i, &x) in self.rows.iter().zip(&self.exact) {
            let (lo, hi) = raw(i);
            let inside = if x.is_nan() {
                lo == f64::NEG_INFINITY && hi == f64::INFINITY
            } else {
                lo <= x as f64 && x as f64 <= hi
            };
            if !inside {
                return Ok(false);
            }
            let w = if x.is_nan() {
                f32::NEG_INFINITY
            } else if pen != 1.0 && penalized[i] {
                penalized_logit(x, pen)
            } else {
                x
            };
            self.known.push((w, i as u32));
        }
        Ok(true)
    }
}

/// A logit under the repetition penalty `p`.
fn penalized_logit(x: f32, p: f32) -> f32 {
    if x < 0.0 {
        x * p
    } else {
        x / p
    }
}

/// The cumulative draw over `kept` (sorted, largest first) with the uniform `u`.
fn draw(kept: &[(f32, u32)], inv_t: f32, max_scaled: f32, u: f64) -> u32 {
    let mass: f64 = kept
        .iter()
        .map(|&(x, _)| f64::from((x * inv_t - max_scaled).exp()))
        .sum();
    let target = u * mass;
    let mut acc = 0.0f64;
    for &(x, id) in kept {
        acc += f64::from((x * inv_t - max_scaled).exp());
        if acc > target {
            return id;
        }
    }
    kept[kept.len() - 1].1
}

/// The race over `work` (see the module docs) under `key`; `best` is the largest work value's
/// row. Keys are computed only where the cheap bound of the noise ([`race_noise_bound`])
/// lets a row reach the best so far: the same winner as computing every key.
fn race(work: &[f32], best: u32, inv_t: f32, max_scaled: f32, key: u64) -> u32 {
    if !max_scaled.is_finite() {
        return best;
    }
    let key_of = |i: usize, bits: u64| f64::from(work[i] * inv_t - max_scaled) + race_noise(bits);
    let mut win = (key_of(best as usize, race_bits(key, best as usize)), best);
    for (i, &x) in work.iter().enumerate() {
        if x == f32::NEG_INFINITY {
            continue;
        }
        let bits = race_bits(key, i);
        let s = f64::from(x * inv_t - max_scaled);
        let reach = s + race_noise_bound(bits);
        if reach + reach.abs() * 1e-15 < win.0 {
            continue;
        }
        let k = key_of(i, bits);
        if k > win.0 || (k == win.0 && (i as u32) < win.1) {
            win = (k, i as u32);
        }
    }
    win.1
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

    /// Every key computed (no cheap bound): the race as the module docs define it.
    fn race_reference(work: &[f32], inv_t: f32, max_scaled: f32, key: u64) -> u32 {
        let mut win = (f64::NEG_INFINITY, 0u32);
        for (i, &x) in work.iter().enumerate() {
            let k = f64::from(x * inv_t - max_scaled) + race_noise(race_bits(key, i));
            if k > win.0 {
                win = (k, i as u32);
            }
        }
        win.1
    }

    /// The race that skips keys by their cheap bound picks what computing every key picks.
    #[test]
    fn pruned_race_equals_every_key_computed() {
        use rand::{Rng as _, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for case in 0..300 {
            let n = [1, 2, 7, 100, 3000][case % 5];
            let spread = [0.1f32, 1.0, 5.0, 30.0][case % 4];
            let mut work: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0) * spread).collect();
            if case % 7 == 0 {
                work[rng.gen_range(0..n)] = f32::NEG_INFINITY;
                work[0] = work[n - 1]; // a tie
            }
            let (best, max) = argmax(&work);
            if max == f32::NEG_INFINITY {
                continue;
            }
            for t in [0.05f32, 0.7, 2.0] {
                let inv_t = 1.0 / t;
                let key = rng.gen::<u64>();
                assert_eq!(
                    race(&work, best, inv_t, max * inv_t, key),
                    race_reference(&work, inv_t, max * inv_t, key),
                    "case {case}, t {t}"
                );
            }
        }
    }

    /// The cheap bound of the noise holds for every kind of bits, including the extremes.
    #[test]
    fn race_noise_bound_holds() {
        use rand::{Rng as _, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut all: Vec<u64> = (0..200_000).map(|_| rng.gen()).collect();
        for shift in 0..64 {
            all.push(u64::MAX >> shift);
            all.push(!(u64::MAX >> shift));
        }
        all.extend([0, 1, (1 << 12) - 1, 1 << 12, u64::MAX - (1 << 12)]);
        for bits in all {
            let (g, b) = (race_noise(bits), race_noise_bound(bits));
            assert!(g.is_finite() && g <= b, "{bits:#x}: {g} > {b}");
            // Tight where it matters: large noise (a key far above its exponent).
            assert!(
                g < 0.0 || b - g < 1.2,
                "{bits:#x}: the bound is loose: {g} against {b}"
            );
        }
    }

    /// Random logits of `n` tokens: flat (like a random-weight model's), peaked (like a
    /// trained model's: a few tokens far above a wide bulk), or with ties and -inf.
    fn random_logits(rng: &mut rand::rngs::StdRng, n: usize, kind: usize) -> Vec<f32> {
        use rand::Rng as _;
        let normal = |rng: &mut rand::rngs::StdRng| -> f32 {
            (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum::<f32>() * 0.87
        };
        let mut x: Vec<f32> = (0..n).map(|_| normal(rng)).collect();
        match kind % 3 {
            0 => {}
            1 => {
                for v in x.iter_mut() {
                    *v *= 3.0;
                }
                for _ in 0..rng.gen_range(1..6) {
                    let i = rng.gen_range(0..n);
                    x[i] = rng.gen_range(10.0..22.0);
                }
            }
            _ => {
                for v in x.iter_mut() {
                    *v = (*v * 2.0).round();
                }
                x[rng.gen_range(0..n)] = f32::NEG_INFINITY;
                x[rng.gen_range(0..n)] = 9.0;
                x[rng.gen_range(0..n)] = 9.0;
            }
        }
        x
    }

    /// One token through the screen (falling back to the whole logits as a model does),
    /// with the rows it asked for checked; `Some` only when the screen decided.
    fn screened_or_full(
        s: &mut Sampler,
        logits: &[f32],
        approx: &[f32],
        radius: &[f64],
        history: &[u32],
        rows_read: &mut usize,
    ) -> (u32, bool) {
        let mut exact = |rows: &[usize], out: &mut [f32]| -> Result<(), ()> {
            assert!(rows.windows(2).all(|w| w[0] < w[1]), "rows in order");
            assert_eq!(rows.len(), out.len());
            for (&r, o) in rows.iter().zip(out.iter_mut()) {
                *o = logits[r];
            }
            *rows_read += rows.len();
            Ok(())
        };
        let got = s
            .sample_screened(approx, |i| radius[i], &mut exact, history)
            .expect("no read fails");
        match got {
            Some(t) => (t, true),
            None => (s.sample(logits, history).expect("valid logits"), false),
        }
    }

    /// The screened sampler draws, seed for seed and token after token, what the sampler
    /// draws from the exact logits: over flat, peaked and tied logits, bounds of every
    /// width (exact logits anywhere within them), temperatures, top-k, top-p, the
    /// repetition penalty and greedy; and it decides most peaked draws itself.
    #[test]
    fn screened_draws_equal_the_full_draws() {
        use rand::{Rng as _, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let n = 4000;
        let mut decided = [[0usize; 2]; 3];
        let mut rows_read = 0;
        for case in 0..240 {
            let kind = case % 3;
            let logits = random_logits(&mut rng, n, kind);
            let width = [0.001f64, 0.05, 0.5, 2.0][case % 4];
            let radius: Vec<f64> = (0..n)
                .map(|i| {
                    if i == 17 && case % 5 == 0 {
                        f64::INFINITY
                    } else {
                        width * rng.gen_range(0.1..1.0)
                    }
                })
                .collect();
            // The approximation anywhere within its bound of the exact logit, -inf's finite.
            let approx: Vec<f32> = logits
                .iter()
                .zip(&radius)
                .map(|(&x, &r)| {
                    let x = if x.is_finite() { x } else { -40.0 };
                    let r = r.min(10.0) as f32 * 0.999;
                    x + rng.gen_range(-r..=r)
                })
                .collect();
            let radius: Vec<f64> = radius
                .iter()
                .zip(&logits)
                .map(|(&r, &x)| if x.is_finite() { r } else { f64::INFINITY })
                .collect();
            let params = SamplingParams {
                temperature: [0.0f32, 0.3, 0.7, 0.7, 1.0, 1.6][case % 6],
                top_k: [0, 0, 0, 1, 5, 40, 3000][case % 7],
                top_p: [1.0f32, 1.0, 0.5, 0.9, 0.99][case % 5],
                repetition_penalty: [1.0f32, 1.0, 1.3, 0.8][case % 4],
                seed: case as u64,
            };
            let history: Vec<u32> = (0..rng.gen_range(0..20))
                .map(|_| rng.gen_range(0..n as u32))
                .collect();
            let mut full = sampler(params);
            let mut screened = sampler(params);
            for step in 0..12 {
                let want = full.sample(&logits, &history).expect("valid logits");
                let (got, by_screen) = screened_or_full(
                    &mut screened,
                    &logits,
                    &approx,
                    &radius,
                    &history,
                    &mut rows_read,
                );
                assert_eq!(got, want, "case {case} step {step}: {params:?}");
                let race = params.top_k == 0 && params.top_p >= 1.0;
                decided[kind][race as usize] += by_screen as usize;
            }
        }
        // Peaked logits with narrow bounds are the common case: most are decided.
        assert!(decided[1][1] > 40 * 12 / 3, "{decided:?}");
        assert!(decided[1][0] > 40 * 12 / 3, "{decided:?}");
        // The race decides flat draws too.
        assert!(decided[0][1] > 20 * 12 / 3, "{decided:?}");
        assert!(rows_read > 0);
    }

    /// Top-p set to the mass of a prefix of the sorted tokens (as f32: right at a cut, where
    /// the unknown tail and the sums' roundings decide it): the screened sampler draws what
    /// the whole logits draw, or gives up, never another token.
    #[test]
    fn top_p_at_a_cut_is_decided_exactly_or_given_up() {
        use rand::{Rng as _, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let n = 3000;
        let mut outcomes = [0usize; 2];
        for case in 0..200 {
            let logits = random_logits(&mut rng, n, 1);
            let t = [0.5f32, 0.7, 1.0][case % 3];
            let mut sorted = logits.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let max = sorted[0];
            let w: Vec<f64> = sorted
                .iter()
                .map(|&x| f64::from((x * (1.0 / t) - max * (1.0 / t)).exp()))
                .collect();
            let total: f64 = w.iter().sum();
            let j = rng.gen_range(1..6);
            let cut = (w[..j].iter().sum::<f64>() / total) as f32;
            if !(cut > 0.0 && cut < 1.0) {
                continue;
            }
            let top_p = [
                cut,
                f32::from_bits(cut.to_bits() + 1),
                f32::from_bits(cut.to_bits() - 1),
            ][case % 3];
            let params = SamplingParams {
                temperature: t,
                top_p,
                top_k: [0, 0, 50][case % 3],
                seed: case as u64,
                ..Default::default()
            };
            let radius = vec![0.01; n];
            let approx: Vec<f32> = logits
                .iter()
                .map(|&x| x + rng.gen_range(-0.009f32..0.009))
                .collect();
            let mut full = sampler(params);
            let mut screened = sampler(params);
            for _ in 0..4 {
                let want = full.sample(&logits, &[]).unwrap();
                let mut read = 0;
                let (got, by_screen) =
                    screened_or_full(&mut screened, &logits, &approx, &radius, &[], &mut read);
                assert_eq!(got, want, "case {case}: {params:?}");
                outcomes[by_screen as usize] += 1;
            }
        }
        eprintln!("top-p at a cut: {outcomes:?} (whole logits, screened)");
        assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
    }

    /// An exact logit found outside its bounds (a broken screen) gives no token, and leaves
    /// the generator as it was.
    #[test]
    fn a_logit_outside_its_bounds_gives_up() {
        let n = 1000;
        let logits: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.5).collect();
        let mut approx = logits.clone();
        approx[16] = 8.5; // 8.0 exact, bound 0.1: a candidate for the largest
        for params in [
            SamplingParams {
                temperature: 0.7,
                seed: 3,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.7,
                top_k: 20,
                seed: 3,
                ..Default::default()
            },
        ] {
            let mut s = sampler(params);
            let mut exact = |rows: &[usize], out: &mut [f32]| -> Result<(), ()> {
                for (&r, o) in rows.iter().zip(out.iter_mut()) {
                    *o = logits[r];
                }
                Ok(())
            };
            let got = s.sample_screened(&approx, |_| 0.1, &mut exact, &[]);
            assert_eq!(got, Ok(None), "{params:?}");
            let mut fresh = sampler(params);
            assert_eq!(s.sample(&logits, &[]), fresh.sample(&logits, &[]));
        }
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
