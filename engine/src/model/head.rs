//! The screened greedy head: the exact argmax of the output head without reading every exact
//! row.
//!
//! Greedy decoding needs only the index of the largest logit. An 8-bit row-scaled copy of the
//! head (half the bytes of bf16) gives every logit approximately, and for each row a bound on
//! how far the exact logit can lie from the approximate one: the quantization error of the
//! row (`max |w - scale·q|`, recorded at load) times `‖x‖₁`, plus the rounding of both f32
//! dot products in any summation order. Every row whose upper bound reaches the best lower
//! bound is a candidate; the rows that hold the exact maximum are always among them. The
//! candidates' exact logits are then computed by the same row kernel as the whole head
//! ([`matvec_rows`], bit for bit; the model reads those rows from the file rather than
//! touching the mapping, which would map whole page-cache folios), and the first largest
//! wins, as in [`argmax`](crate::generate::argmax). So the token is the exact path's token,
//! always; the screen only decides how many exact rows are read (about a hundred of 201,088
//! on random weights at gpt-oss-20b geometry; fewer where one logit stands out).
//! Where the bound cannot be trusted (a non-finite input or approximation, exact sums that
//! could overflow, a winner below the bound) or would leave too many candidates, the whole
//! exact head is computed instead; rows with non-finite weights are always candidates.
//!
//! Sampling uses the same bounds ([`HeadScreen::sample`]): the sampler
//! ([`Sampler::sample_screened`](crate::sampling::Sampler::sample_screened)) decides from them
//! which rows it needs exactly (about a hundred at gpt-oss-20b geometry on random weights at
//! temperature 0.7), gets them through the same row kernel, and returns the token it draws
//! from the whole exact head, or gives up and the whole head is computed.

use crate::error::Result;
use crate::kernels::{matmul, matvec, matvec_rows, Mat};
use crate::sampling::Sampler;

use super::Q8Mat;

/// The unit roundoff of f32.
const U: f64 = f32::EPSILON as f64 / 2.0;

/// Added to every bound: underflow adds at most a few multiples of the smallest subnormal per
/// operation.
const TINY: f64 = 1e-30;

/// Above this share of the rows as candidates, the whole exact head is cheaper to read.
const MAX_CANDIDATE_SHARE: usize = 8;

/// Candidates' exact rows read ([`ReadRows`]) and computed at a time: a buffer of 1.5 MB at
/// gpt-oss-20b geometry, one read for most tokens (about a hundred candidates on random
/// weights, fewer where one logit stands out).
const GATHER_ROWS: usize = 256;

/// Reads rows (given in increasing order) of the exact head as stored into the buffer, one
/// after another: how the candidates' rows are fetched without touching the mapping.
pub(super) type ReadRows<'a> = &'a dyn Fn(&[usize], &mut [u8]) -> Result<()>;

/// An 8-bit copy of the output head and, per row, its error bound per unit of `‖x‖₁`.
#[derive(Debug)]
pub(super) struct HeadScreen {
    q8: Q8Mat,
    slack: Vec<f64>,
    /// The largest `|w|` of the rows with a finite slack: with `‖x‖₁` it bounds every partial
    /// sum of their exact dot products, which the error bound needs to stay finite.
    max_w: f64,
}

/// The greedy choice: the token and its exact logit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// Index of the largest logit, the first one on ties; NaN never wins (0 if none is a
    /// number or larger than `-inf`).
    pub token: u32,
    /// Its logit as the exact head computes it (`-inf` if no logit is larger).
    pub logit: f32,
}

impl Choice {
    /// The first largest of `logits` (what [`argmax`](crate::generate::argmax) picks).
    pub fn of(logits: &[f32]) -> Self {
        Self::of_rows(logits.iter().copied().enumerate())
    }

    /// The first largest of `(row, logit)` pairs given in increasing row order.
    fn of_rows(it: impl Iterator<Item = (usize, f32)>) -> Self {
        let mut best = Self {
            token: 0,
            logit: f32::NEG_INFINITY,
        };
        for (r, v) in it {
            if v > best.logit {
                best = Self {
                    token: r as u32,
                    logit: v,
                };
            }
        }
        best
    }
}

/// How the tokens of a session's [`Model::forward_greedy`](crate::Model::forward_greedy) and
/// [`Model::forward_sample`](crate::Model::forward_sample) were chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScreenStats {
    /// Tokens chosen (greedy or drawn) through the screen.
    pub screened: u64,
    /// Exact head rows computed for them, in all.
    pub exact_rows: u64,
    /// Tokens for which the whole exact head was computed (no screen, or one that could not
    /// decide).
    pub full: u64,
}

impl ScreenStats {
    /// What was counted since `before` (an earlier reading of the same session).
    pub fn since(self, before: Self) -> Self {
        Self {
            screened: self.screened - before.screened,
            exact_rows: self.exact_rows - before.exact_rows,
            full: self.full - before.full,
        }
    }

    /// Exact rows per screened token on average (0 if none was screened).
    pub fn rows_per_token(&self) -> f64 {
        self.exact_rows as f64 / self.screened.max(1) as f64
    }
}

/// Buffers of [`HeadScreen::choose`], kept by the session.
#[derive(Debug, Default)]
pub(super) struct ScreenScratch {
    approx: Vec<f32>,
    rows: Vec<usize>,
    exact: Vec<f32>,
    /// Candidates' exact rows as read ([`GATHER_ROWS`] at most).
    gathered: Vec<u8>,
}

impl HeadScreen {
    /// The screen of `head` (row-major): its 8-bit copy and each row's slack.
    pub(super) fn build(head: &Mat<'_>) -> Result<Self> {
        let (q8, err) = Q8Mat::quantize(head)?;
        let n = head.cols() as f64 + 2.0;
        // Either dot product, in any order, fused or not, is off its real value by at most
        // gamma times the sum of its terms' magnitudes, as long as nothing overflows (Higham,
        // Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1; `choose`
        // checks the overflow). The exact terms are at most max|w|·|x_i|, the 8-bit ones
        // scale·127·|x_i| (in f64, exact: not always within max|w|·(1 + u) when the scale is
        // subnormal), and the 8-bit logit's final product by the scale adds one rounding. The
        // margin covers the products of these small factors while gamma <= 1/128 (up to about
        // 130,000 columns); wider rows get no screen.
        let gamma = n * U / (1.0 - n * U);
        let usable = n * U < 1.0 / 128.0;
        let slack: Vec<f64> = err
            .iter()
            .zip(&q8.scales)
            .map(|(&[max, quant], &scale)| {
                let big = max.max(scale as f64 * 127.0);
                let s = (quant + big * (2.0 * gamma + 3.0 * U)) * (1.0 + 1.0 / 64.0);
                if s.is_finite() && usable {
                    s
                } else {
                    f64::INFINITY
                }
            })
            .collect();
        let max_w = err
            .iter()
            .zip(&slack)
            .filter(|&(_, s)| s.is_finite())
            .map(|(&[max, _], _)| max)
            .fold(0.0, f64::max);
        Ok(Self { q8, slack, max_w })
    }

    /// Bytes held in RAM.
    pub(super) fn bytes(&self) -> u64 {
        (self.q8.q.len() + 4 * self.q8.scales.len() + 8 * self.slack.len()) as u64
    }

    /// The greedy choice for the normed hidden state `x` of `head` (the exact matrix this
    /// screen was built from), or `None` when the screen cannot decide (the caller computes
    /// the whole head). With `read`, the candidates' exact rows are read through it rather
    /// than from `head`'s bytes (the same bytes; only a failed read is an error).
    pub(super) fn choose(
        &self,
        head: &Mat<'_>,
        x: &[f32],
        sc: &mut ScreenScratch,
        stats: &mut ScreenStats,
        read: Option<ReadRows<'_>>,
    ) -> Result<Option<Choice>> {
        Ok(self.choose_inner(head, x, sc, read)?.inspect(|_| {
            stats.screened += 1;
            stats.exact_rows += sc.rows.len() as u64;
        }))
    }

    /// The 8-bit head as a matrix.
    fn q8_mat(&self) -> Mat<'_> {
        Mat::Q8 {
            q: &self.q8.q,
            scales: &self.q8.scales,
            rows: self.slack.len(),
            cols: self.q8.q.len() / self.slack.len().max(1),
        }
    }

    /// The 8-bit logits of several normed states at once (`xs` `[n, H]`, `out` `[n, V]`):
    /// the 8-bit head read once for all of them, each state's row bit for bit what it gets
    /// alone (the kernels compute each position on its own, whatever positions share a call).
    /// A batched decode step screens its sequences with this and
    /// [`choose_from`](Self::choose_from), rather than reading the whole 8-bit head once per
    /// sequence.
    pub(super) fn approx_many(&self, xs: &[f32], out: &mut Vec<f32>) {
        let q = self.q8_mat();
        let n = xs.len() / q.cols().max(1);
        out.resize(n * q.rows(), 0.0);
        matmul(&q, xs, out);
    }

    /// [`choose`](Self::choose) for a state whose 8-bit logits `approx` were computed already
    /// ([`approx_many`](Self::approx_many)): the same choice, bit for bit.
    pub(super) fn choose_from(
        &self,
        head: &Mat<'_>,
        x: &[f32],
        approx: &[f32],
        sc: &mut ScreenScratch,
        stats: &mut ScreenStats,
        read: Option<ReadRows<'_>>,
    ) -> Result<Option<Choice>> {
        Ok(self.decide(head, x, approx, sc, read)?.inspect(|_| {
            stats.screened += 1;
            stats.exact_rows += sc.rows.len() as u64;
        }))
    }

    /// A token for the normed hidden state `x` drawn by `sampler` through the screen, the one
    /// it draws from the whole exact head's logits
    /// ([`Sampler::sample_screened`](crate::sampling::Sampler::sample_screened)), or `None`
    /// when the screen cannot prove it (the sampler is then as it was: the caller computes
    /// the whole head and samples from it). The exact rows the sampler asks for are read as
    /// in [`choose`](Self::choose).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sample(
        &self,
        head: &Mat<'_>,
        x: &[f32],
        sampler: &mut Sampler,
        history: &[u32],
        sc: &mut ScreenScratch,
        stats: &mut ScreenStats,
        read: Option<ReadRows<'_>>,
    ) -> Result<Option<u32>> {
        // Not worth the 8-bit pass when the bound cannot hold (`sample_from` would give up).
        if self.l1_within_bound(x).is_none() {
            return Ok(None);
        }
        let mut approx = std::mem::take(&mut sc.approx);
        approx.resize(head.rows(), 0.0);
        matvec(&self.q8_mat(), x, &mut approx);
        let got = self.sample_from(head, x, &approx, sampler, history, sc, stats, read);
        sc.approx = approx;
        got
    }

    /// [`sample`](Self::sample) for a state whose 8-bit logits `approx` were computed already
    /// ([`approx_many`](Self::approx_many)): the same token, bit for bit (any rounding of the
    /// 8-bit sums is within the bounds).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sample_from(
        &self,
        head: &Mat<'_>,
        x: &[f32],
        approx: &[f32],
        sampler: &mut Sampler,
        history: &[u32],
        sc: &mut ScreenScratch,
        stats: &mut ScreenStats,
        read: Option<ReadRows<'_>>,
    ) -> Result<Option<u32>> {
        debug_assert_eq!(approx.len(), head.rows());
        let Some(l1) = self.l1_within_bound(x) else {
            return Ok(None);
        };
        let mut rows_read = 0u64;
        let gathered = &mut sc.gathered;
        let mut exact = |rows: &[usize], out: &mut [f32]| {
            rows_read += rows.len() as u64;
            exact_rows(head, x, rows, out, gathered, read)
        };
        let slack = &self.slack;
        let got = sampler.sample_screened(approx, |i| slack[i] * l1 + TINY, &mut exact, history);
        if let Ok(Some(_)) = got {
            stats.screened += 1;
            stats.exact_rows += rows_read;
        }
        got
    }

    fn choose_inner(
        &self,
        head: &Mat<'_>,
        x: &[f32],
        sc: &mut ScreenScratch,
        read: Option<ReadRows<'_>>,
    ) -> Result<Option<Choice>> {
        // Not worth the 8-bit pass when the bound cannot hold (`decide` would give up).
        if self.l1_within_bound(x).is_none() {
            return Ok(None);
        }
        let mut approx = std::mem::take(&mut sc.approx);
        approx.resize(head.rows(), 0.0);
        matvec(&self.q8_mat(), x, &mut approx);
        let r = self.decide(head, x, &approx, sc, read);
        sc.approx = approx;
        r
    }

    /// `x`'s L1 norm when no partial sum of a screened row's exact logit can overflow for it
    /// (the bound assumes it; rows with an infinite slack are always computed exactly, as the
    /// whole head would); `None` otherwise.
    fn l1_within_bound(&self, x: &[f32]) -> Option<f64> {
        let l1: f64 = x.iter().map(|&v| (v as f64).abs()).sum();
        (l1.is_finite() && self.max_w * l1 * 2.0 < f32::MAX as f64).then_some(l1)
    }

    /// The choice from the 8-bit logits `approx` of `x`: the candidate rows computed exactly.
    fn decide(
        &self,
        head: &Mat<'_>,
        x: &[f32],
        approx: &[f32],
        sc: &mut ScreenScratch,
        read: Option<ReadRows<'_>>,
    ) -> Result<Option<Choice>> {
        let rows = head.rows();
        debug_assert_eq!(self.slack.len(), rows);
        debug_assert_eq!(approx.len(), rows);
        let Some(l1) = self.l1_within_bound(x) else {
            return Ok(None);
        };
        let mut floor = f64::NEG_INFINITY;
        for (&a, &s) in approx.iter().zip(&self.slack) {
            let a = a as f64;
            if !a.is_finite() {
                return Ok(None);
            }
            floor = floor.max(a - (s * l1 + TINY));
        }
        if !floor.is_finite() {
            return Ok(None);
        }
        // At most `cap` candidates, in a buffer of that capacity kept between tokens (so a
        // decoded token allocates nothing here).
        let cap = rows / MAX_CANDIDATE_SHARE;
        sc.rows.clear();
        sc.rows.reserve(cap);
        for (r, (&a, &s)) in approx.iter().zip(&self.slack).enumerate() {
            if a as f64 + (s * l1 + TINY) >= floor {
                if sc.rows.len() == cap {
                    return Ok(None);
                }
                sc.rows.push(r);
            }
        }
        sc.exact.clear();
        sc.exact.reserve(cap);
        sc.exact.resize(sc.rows.len(), 0.0);
        exact_rows(head, x, &sc.rows, &mut sc.exact, &mut sc.gathered, read)?;
        let choice = Choice::of_rows(sc.rows.iter().copied().zip(sc.exact.iter().copied()));
        // The row that set the floor is a candidate with a finite exact logit at or above it,
        // so the winner is a number; anything else means the bound did not hold: say so by
        // computing the whole head rather than guess.
        let above = (choice.logit as f64)
            .partial_cmp(&floor)
            .is_some_and(|o| o.is_ge());
        if !above && choice.logit != f32::INFINITY {
            return Ok(None);
        }
        Ok(Some(choice))
    }
}

/// The exact logits of `rows` (increasing) of `head` for `x`, into `out`: read through
/// `read` in chunks of at most [`GATHER_ROWS`] (into `gathered`) when given, else from
/// `head`'s bytes; bit for bit the whole head's either way (the same bytes through the same
/// row kernel give the same bits, whichever rows share the matrix: `matvec_rows`).
fn exact_rows(
    head: &Mat<'_>,
    x: &[f32],
    rows: &[usize],
    out: &mut [f32],
    gathered: &mut Vec<u8>,
    read: Option<ReadRows<'_>>,
) -> Result<()> {
    match (read, *head) {
        (Some(read), Mat::Dense { fmt, cols, .. }) => {
            let cap = head.rows() / MAX_CANDIDATE_SHARE;
            let (chunk, row) = (GATHER_ROWS.min(cap).max(1), cols * fmt.size());
            gathered.resize(chunk * row, 0);
            for (rows, out) in rows.chunks(chunk).zip(out.chunks_mut(chunk)) {
                let bytes = &mut gathered[..rows.len() * row];
                read(rows, bytes)?;
                let m = Mat::Dense {
                    fmt,
                    bytes,
                    rows: rows.len(),
                    cols,
                };
                matvec(&m, x, out);
            }
        }
        _ => matvec_rows(head, rows, x, out),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{with_isa, Float, Isa};
    use rand::{Rng, SeedableRng};

    fn encode(fmt: Float, v: &[f32]) -> Vec<u8> {
        match fmt {
            Float::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Float::BF16 => v
                .iter()
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            Float::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }

    /// The screen's choice (with its statistics) and the whole exact head's.
    fn both(
        fmt: Float,
        w: &[f32],
        rows: usize,
        x: &[f32],
    ) -> (Option<Choice>, Choice, ScreenStats) {
        let bytes = encode(fmt, w);
        let head = Mat::Dense {
            fmt,
            bytes: &bytes,
            rows,
            cols: x.len(),
        };
        let screen = HeadScreen::build(&head).unwrap();
        let mut all = vec![0.0; rows];
        matvec(&head, x, &mut all);
        let mut stats = ScreenStats::default();
        let got = screen
            .choose(&head, x, &mut ScreenScratch::default(), &mut stats, None)
            .unwrap();
        // The candidates' rows read from elsewhere (a copy starting at an odd address, read
        // through the `ReadRows` hook in chunks, as the model reads them from the file) give
        // the same choice, bit for bit, and the same statistics.
        let row = x.len() * fmt.size();
        let copy = [vec![0u8; 3], bytes.clone()].concat();
        let reads = std::cell::Cell::new(0);
        let read = |rs: &[usize], out: &mut [u8]| {
            assert!(rs.len() <= GATHER_ROWS && rs.windows(2).all(|w| w[0] < w[1]));
            for (&r, o) in rs.iter().zip(out.chunks_exact_mut(row)) {
                o.copy_from_slice(&copy[3 + r * row..3 + (r + 1) * row]);
            }
            reads.set(reads.get() + rs.len() as u64);
            Ok(())
        };
        let mut stats_read = ScreenStats::default();
        let got_read = screen
            .choose(
                &head,
                x,
                &mut ScreenScratch::default(),
                &mut stats_read,
                Some(&read),
            )
            .unwrap();
        assert_eq!(got_read, got, "rows read against rows mapped");
        assert_eq!(stats_read, stats, "rows read against rows mapped");
        if got.is_some() {
            assert_eq!(reads.get(), stats.exact_rows, "rows read");
        }
        (got, Choice::of(&all), stats)
    }

    fn normal(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        // The sum of a few uniforms: roughly normal, with a long enough tail for a max.
        (0..n)
            .map(|_| (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum::<f32>())
            .collect()
    }

    /// On random heads and inputs, in every ISA and float format, the screen decides (no
    /// fallback), reads a small share of the rows, and picks the exact head's token and logit.
    #[test]
    fn screen_picks_the_exact_argmax_reading_few_rows() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (4001, 136);
        let w = normal(&mut rng, rows * cols);
        for isa in Isa::available() {
            with_isa(isa, || {
                for fmt in [Float::BF16, Float::F16, Float::F32] {
                    let mut exact_rows = 0;
                    for _ in 0..8 {
                        let x = normal(&mut rng, cols);
                        let (got, want, stats) = both(fmt, &w, rows, &x);
                        assert_eq!(got, Some(want), "{isa} {fmt:?}");
                        exact_rows += stats.exact_rows;
                    }
                    assert!(
                        exact_rows < 8 * 40,
                        "{isa} {fmt:?}: {exact_rows} exact rows"
                    );
                }
            });
        }
    }

    /// Draws through the screen equal the draws from the whole exact head, seed for seed and
    /// token after token, in every ISA and float format, over temperatures, top-k, top-p, the
    /// repetition penalty and greedy; the screen decides most of them (flat random logits, so
    /// top-p alone mostly falls back), and its exact rows are read through the hook as the
    /// model reads them.
    #[test]
    fn screened_draws_equal_the_whole_heads() {
        use crate::sampling::{Sampler, SamplingParams};
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let (rows, cols) = (4001, 136);
        let w = normal(&mut rng, rows * cols);
        let mut decided = [0u64; 2];
        for isa in Isa::available() {
            with_isa(isa, || {
                for fmt in [Float::BF16, Float::F16, Float::F32] {
                    let bytes = encode(fmt, &w);
                    let head = Mat::Dense {
                        fmt,
                        bytes: &bytes,
                        rows,
                        cols,
                    };
                    let screen = HeadScreen::build(&head).unwrap();
                    let row = cols * fmt.size();
                    let read = |rs: &[usize], out: &mut [u8]| {
                        for (&r, o) in rs.iter().zip(out.chunks_exact_mut(row)) {
                            o.copy_from_slice(&bytes[r * row..(r + 1) * row]);
                        }
                        Ok(())
                    };
                    for case in 0..24 {
                        let params = SamplingParams {
                            temperature: [0.0f32, 0.7, 0.7, 1.0, 0.3, 1.3][case % 6],
                            top_k: [0, 0, 40, 0, 7][case % 5],
                            top_p: [1.0f32, 1.0, 0.9, 1.0][case % 4],
                            repetition_penalty: [1.0f32, 1.2, 1.0][case % 3],
                            seed: case as u64,
                        };
                        let history = [5u32, 77, 3000];
                        let mut full = Sampler::new(params).unwrap();
                        let mut screened = Sampler::new(params).unwrap();
                        let mut sc = ScreenScratch::default();
                        let mut stats = ScreenStats::default();
                        for step in 0..6 {
                            // A larger input now and then: a more peaked distribution.
                            let scale = [1.0f32, 3.0][step % 2];
                            let x: Vec<f32> =
                                normal(&mut rng, cols).iter().map(|v| v * scale).collect();
                            let mut all = vec![0.0; rows];
                            matvec(&head, &x, &mut all);
                            let want = full.sample(&all, &history).unwrap();
                            let before = stats.screened;
                            let got = screen
                                .sample(
                                    &head,
                                    &x,
                                    &mut screened,
                                    &history,
                                    &mut sc,
                                    &mut stats,
                                    Some(&read),
                                )
                                .unwrap();
                            let got = match got {
                                Some(t) => t,
                                None => screened.sample(&all, &history).unwrap(),
                            };
                            assert_eq!(got, want, "{isa} {fmt:?} {params:?} step {step}");
                            decided[(stats.screened > before) as usize] += 1;
                        }
                    }
                }
            });
        }
        assert!(decided[1] > 2 * decided[0], "decided / not: {decided:?}");
    }

    /// Several states screened together (the 8-bit head read once, `approx_many`) get each
    /// the 8-bit logits and the choice it gets alone, bit for bit, in every ISA.
    #[test]
    fn states_screened_together_choose_as_alone() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (rows, cols) = (3001, 96);
        let w = normal(&mut rng, rows * cols);
        let bytes = encode(Float::BF16, &w);
        let head = Mat::Dense {
            fmt: Float::BF16,
            bytes: &bytes,
            rows,
            cols,
        };
        let screen = HeadScreen::build(&head).unwrap();
        for isa in Isa::available() {
            with_isa(isa, || {
                for n in [1, 2, 5] {
                    let xs = normal(&mut rng, n * cols);
                    let mut approx = Vec::new();
                    screen.approx_many(&xs, &mut approx);
                    for (x, a) in xs.chunks(cols).zip(approx.chunks(rows)) {
                        let mut alone = vec![0.0; rows];
                        matvec(&screen.q8_mat(), x, &mut alone);
                        assert!(
                            alone.iter().zip(a).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{isa} n={n}: 8-bit logits differ from a state alone"
                        );
                        let mut s1 = ScreenStats::default();
                        let mut s2 = ScreenStats::default();
                        let one = screen
                            .choose(&head, x, &mut ScreenScratch::default(), &mut s1, None)
                            .unwrap();
                        let many = screen
                            .choose_from(&head, x, a, &mut ScreenScratch::default(), &mut s2, None)
                            .unwrap();
                        assert_eq!(one, many, "{isa} n={n}");
                        assert_eq!((s1.screened, s1.exact_rows), (s2.screened, s2.exact_rows));
                    }
                }
            });
        }
    }

    /// Exact ties go to the first row, as the whole head's argmax does; a row one bf16 step
    /// away from the best is told apart by its exact logit, whichever way the step goes.
    #[test]
    fn ties_and_near_ties_are_decided_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (rows, cols) = (3000, 64);
        let mut w = normal(&mut rng, rows * cols);
        let x = normal(&mut rng, cols);
        let (_, best, _) = both(Float::BF16, &w, rows, &x);
        let b = best.token as usize;
        let row: Vec<f32> = w[b * cols..(b + 1) * cols].to_vec();
        // Two copies of the best row, one before it and one after: the first copy wins.
        let (early, late) = ((b + 7) % rows, (b + 1500) % rows);
        for r in [early, late] {
            w[r * cols..(r + 1) * cols].copy_from_slice(&row);
        }
        let (got, want, _) = both(Float::BF16, &w, rows, &x);
        assert_eq!(want.token as usize, b.min(early).min(late));
        assert_eq!(got, Some(want));
        // The copy after the best nudged by one bf16 step in its largest term, up or down.
        let k = (0..cols)
            .max_by(|&i, &j| (row[i] * x[i]).abs().total_cmp(&(row[j] * x[j]).abs()))
            .unwrap();
        for up in [true, false] {
            let mut w = w.clone();
            w[early * cols..(early + 1) * cols].copy_from_slice(&normal(&mut rng, cols));
            let v = &mut w[late * cols + k];
            let bits = v.to_bits() >> 16;
            let grow = (up == (x[k] > 0.0)) == (*v > 0.0);
            *v = f32::from_bits((if grow { bits + 1 } else { bits - 1 }) << 16);
            let (got, want, _) = both(Float::BF16, &w, rows, &x);
            assert_eq!(got, Some(want), "nudged {}", if up { "up" } else { "down" });
        }
    }

    /// Two rows whose 8-bit logits are in the wrong order by nearly their whole bounds: row A's
    /// weights sit 0.49 of a step below the 8-bit grid (its 8-bit logit too high), row B's 0.49
    /// above it with a tenth of its terms one step lower (too low), on positive inputs. B's
    /// exact logit is the larger, by about 8% of the inputs' sum, while its 8-bit logit is 90%
    /// below A's: only bounds of at least 90% of the real quantization error find it.
    #[test]
    fn a_row_misordered_by_quantization_is_still_found() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let (rows, cols) = (300, 64);
        // Other rows: small weights, far below A and B (which carry 127 · x[0]).
        let mut w: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let x: Vec<f32> = (0..cols)
            .map(|i| {
                if i == 0 {
                    40.0
                } else {
                    rng.gen_range(0.5..1.5)
                }
            })
            .collect();
        let rest: f32 = x[1..].iter().sum();
        let (a, b) = (7, 3);
        let mut lowered = 0.0;
        for i in 0..cols {
            let k = rng.gen_range(-100..=100) as f32;
            // Both rows' largest weight is 127, so both scales are exactly 1.
            let (wa, mut wb) = if i == 0 {
                (127.0, 127.0)
            } else {
                (k - 0.49, k + 0.49)
            };
            if i > 0 && lowered < 0.9 * rest {
                wb -= 1.0;
                lowered += x[i];
            }
            w[a * cols + i] = wa;
            w[b * cols + i] = wb;
        }
        for isa in Isa::available() {
            with_isa(isa, || {
                let (got, want, stats) = both(Float::F32, &w, rows, &x);
                assert_eq!(want.token as usize, b, "{isa}: the construction");
                assert_eq!(got, Some(want), "{isa}");
                assert!(stats.exact_rows >= 2, "{isa}");
            });
        }
    }

    /// A head whose exact arithmetic overflows on one row (its lanes reach ±inf and sum to
    /// NaN, where its 8-bit logit is a large finite number) leaves the choice to the whole
    /// head: the bound would not hold.
    #[test]
    fn overflowing_exact_rows_fall_back_to_the_whole_head() {
        let (rows, cols) = (64, 32);
        let mut w: Vec<f32> = (0..rows * cols).map(|i| (i % 7) as f32 * 0.01).collect();
        let x = vec![1.0f32; cols];
        let r = 10 * cols;
        w[r] = 2e38;
        w[r + 8] = 2e38;
        w[r + 1] = -2e38;
        w[r + 9] = -2e38;
        w[r + 2] = 3e38;
        for isa in Isa::available() {
            with_isa(isa, || {
                let (got, want, _) = both(Float::F32, &w, rows, &x);
                assert!(
                    got.is_none() || got == Some(want),
                    "{isa}: {got:?} against {want:?}"
                );
            });
        }
    }

    /// Non-finite weights make their rows candidates (NaN never wins, +inf does); non-finite
    /// or all-zero inputs leave the choice to the whole head.
    #[test]
    fn non_finite_values_never_mislead_the_screen() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (rows, cols) = (2000, 48);
        let w = normal(&mut rng, rows * cols);
        let x = normal(&mut rng, cols);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut w = w.clone();
            w[17 * cols + 5] = bad;
            let (got, want, _) = both(Float::BF16, &w, rows, &x);
            if let Some(got) = got {
                assert_eq!(got, want, "weight {bad}");
            }
            if bad.is_nan() {
                assert!(got.is_some(), "one NaN row need not stop the screen");
            }
        }
        let mut nan_x = x.clone();
        nan_x[3] = f32::NAN;
        assert_eq!(both(Float::BF16, &w, rows, &nan_x).0, None);
        assert_eq!(both(Float::BF16, &w, rows, &vec![0.0; cols]).0, None);
    }

    /// More candidates than one read's worth ([`GATHER_ROWS`]): 300 copies of the best row
    /// (ties, all candidates) are read and computed in chunks, and the first copy wins, as in
    /// the whole head; a read that fails is an error, not a guess.
    #[test]
    fn many_candidates_are_read_in_chunks_and_failed_reads_are_errors() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (rows, cols) = (4000, 40);
        let mut w = normal(&mut rng, rows * cols);
        let x = normal(&mut rng, cols);
        let best: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
        for r in 0..300 {
            let at = (100 + 3 * r) * cols;
            w[at..at + cols].copy_from_slice(&best);
        }
        for isa in Isa::available() {
            with_isa(isa, || {
                let (got, want, stats) = both(Float::BF16, &w, rows, &x);
                assert_eq!(want.token, 100, "{isa}: the construction");
                assert_eq!(got, Some(want), "{isa}");
                assert!(stats.exact_rows > GATHER_ROWS as u64, "{isa}: {stats:?}");
            });
        }
        let bytes = encode(Float::BF16, &w);
        let head = Mat::Dense {
            fmt: Float::BF16,
            bytes: &bytes,
            rows,
            cols,
        };
        let screen = HeadScreen::build(&head).unwrap();
        let fail = |_: &[usize], _: &mut [u8]| Err(crate::Error::Input("disk on fire".into()));
        let mut stats = ScreenStats::default();
        let got = screen.choose(
            &head,
            &x,
            &mut ScreenScratch::default(),
            &mut stats,
            Some(&fail),
        );
        assert!(
            got.as_ref()
                .is_err_and(|e| e.to_string().contains("disk on fire")),
            "{got:?}"
        );
        assert_eq!(stats, ScreenStats::default());
    }
}
