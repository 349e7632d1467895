//! Generation on top of [`Model::forward`]: greedy, or through a [`Sampler`].

use crate::error::Result;
use crate::model::{Logits, Model, Session};
use crate::moe::{ExpertExecutor, Settled};
use crate::sampling::{Sampler, SamplingParams};

/// Index of the largest logit; the first one on ties (as `torch.argmax`). NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// Timings of a generation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// Seconds spent on the prompt.
    pub prefill_s: f64,
    /// Seconds spent producing tokens after the first.
    pub decode_s: f64,
    /// Of `decode_s`, seconds spent waiting for deferred spot-checks still running after the
    /// last token was made (zero when checks are inline or none were deferred).
    pub check_wait_s: f64,
}

/// Runs `prompt` then generates up to `max_new` tokens greedily, calling `on_token` with each
/// token and the logits that chose it. Stops early if `stop` holds the token (the token is still
/// reported). Returns the generated ids.
pub fn greedy(
    model: &Model,
    sess: &mut Session,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    on_token: impl FnMut(u32, &[f32]),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    let mut warned = false;
    let choose = |_: &mut (), logits: &[f32]| {
        let tok = argmax(logits);
        let best = logits.get(tok as usize).copied().unwrap_or(f32::NAN);
        warn_once_without_a_logit(best, &mut warned);
        Ok(tok)
    };
    from_logits(
        model,
        sess,
        (prompt, max_new, stop),
        &mut (),
        choose,
        on_token,
        timings,
    )
}

/// [`greedy`] without the logits: each token through [`Model::forward_greedy`], so a model
/// with a screened head ([`LoadOptions::screened_head`](crate::LoadOptions::screened_head))
/// reads only the head rows it needs. The same ids as [`greedy`].
pub fn greedy_ids(
    model: &Model,
    sess: &mut Session,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    mut on_token: impl FnMut(u32),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    let mut warned = false;
    generate(
        model,
        sess,
        (prompt, max_new, stop),
        &mut (),
        |sess, tokens, _| {
            let c = model.forward_greedy(sess, tokens, None)?;
            warn_once_without_a_logit(c.logit, &mut warned);
            Ok(c.token)
        },
        (false, |tok, _: &[f32]| on_token(tok)),
        timings,
    )
}

/// [`greedy`] with each token chosen by `sampler` from the logits instead of their argmax; the
/// repetition penalty applies to the prompt and the tokens generated so far (as in
/// Transformers). The same seed gives the same tokens.
#[allow(clippy::too_many_arguments)]
pub fn sampled(
    model: &Model,
    sess: &mut Session,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    on_token: impl FnMut(u32, &[f32]),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    // The sampler and the history are the state a rolled-back step restores.
    let mut state = (sampler.clone(), prompt.to_vec());
    let out = from_logits(
        model,
        sess,
        (prompt, max_new, stop),
        &mut state,
        |(sampler, history): &mut (Sampler, Vec<u32>), logits: &[f32]| {
            let tok = sampler
                .sample(logits, history)
                .map_err(|e| crate::Error::Input(e.to_string()))?;
            history.push(tok);
            Ok(tok)
        },
        on_token,
        timings,
    );
    *sampler = state.0;
    out
}

/// [`sampled`] without the logits: each token through [`Model::forward_sample`], so a model
/// with a screened head ([`LoadOptions::screened_head`](crate::LoadOptions::screened_head))
/// reads only the head rows the draw needs. The same ids as [`sampled`].
#[allow(clippy::too_many_arguments)]
pub fn sampled_ids(
    model: &Model,
    sess: &mut Session,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    let mut state = (sampler.clone(), prompt.to_vec());
    let out = generate(
        model,
        sess,
        (prompt, max_new, stop),
        &mut state,
        |sess, tokens, (sampler, history): &mut (Sampler, Vec<u32>)| {
            let tok = model.forward_sample(sess, tokens, sampler, history)?;
            history.push(tok);
            Ok(tok)
        },
        (false, |tok, _: &[f32]| on_token(tok)),
        timings,
    );
    *sampler = state.0;
    out
}

/// Decode speed of greedy and of sampled tokens measured together: `steps` tokens decoded one
/// at a time after `first` (the next token to run) in `sess`, alternating a greedy token
/// ([`Model::forward_greedy`], even steps) and one drawn by a sampler with `params`
/// ([`Model::forward_sample`], odd steps), each fed the token before it; both through the
/// model's screened head when it has one. Alternated token by token, so both see the same
/// machine (other tenants, memory bandwidth) and the same context lengths. Needs `steps`
/// free positions in `sess`. What `stormo bench` reports as `decode_sampled_tok_s`.
pub fn decode_greedy_and_sampled(
    model: &Model,
    sess: &mut Session,
    first: u32,
    steps: usize,
    params: SamplingParams,
) -> Result<DecodePair> {
    let mut sampler = Sampler::new(params).map_err(|e| crate::Error::Input(e.to_string()))?;
    let mut secs = [0.0f64; 2];
    let mut count = [0usize; 2];
    let mut tok = first;
    for i in 0..steps {
        let t = std::time::Instant::now();
        tok = if i % 2 == 0 {
            model.forward_greedy(sess, &[tok], None)?.token
        } else {
            model.forward_sample(sess, &[tok], &mut sampler, &[])?
        };
        secs[i % 2] += t.elapsed().as_secs_f64();
        count[i % 2] += 1;
    }
    let rate = |k: usize| count[k] as f64 / secs[k].max(f64::MIN_POSITIVE);
    Ok(DecodePair {
        greedy_tok_s: rate(0),
        sampled_tok_s: rate(1),
        last: tok,
    })
}

/// What [`decode_greedy_and_sampled`] measured.
#[derive(Clone, Copy, Debug)]
pub struct DecodePair {
    /// Greedy tokens per second.
    pub greedy_tok_s: f64,
    /// Sampled tokens per second.
    pub sampled_tok_s: f64,
    /// The last token decoded.
    pub last: u32,
}

/// [`greedy`] and [`sampled`]: each step's last-position logits, and the token `choose` picks
/// from them (with `state`, which a rolled-back step restores); the prompt, the most tokens to
/// make and the stop tokens come as one tuple.
fn from_logits<S: Clone>(
    model: &Model,
    sess: &mut Session,
    run: (&[u32], usize, &[u32]),
    state: &mut S,
    mut choose: impl FnMut(&mut S, &[f32]) -> Result<u32>,
    on_token: impl FnMut(u32, &[f32]),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    generate(
        model,
        sess,
        run,
        state,
        |sess, tokens, state| {
            let logits = model.forward(sess, tokens, Logits::Last, None)?;
            choose(state, logits)
        },
        (true, on_token),
        timings,
    )
}

/// Warns, once per generation, when the greedy choice `best` (the largest logit) is NaN or
/// `-inf`: no logit is a number, so the token (0) means nothing; the weights or the config
/// do not give a usable model. (Sampling refuses such logits with an error instead.)
fn warn_once_without_a_logit(best: f32, warned: &mut bool) {
    if (best.is_nan() || best == f32::NEG_INFINITY) && !*warned {
        *warned = true;
        tracing::warn!(
            "the model gave no logit that is a number (all NaN or -inf): the tokens it picks \
             mean nothing; check the checkpoint's weights and config.json"
        );
    }
}

/// What [`generate`] keeps of a step until its checks end: the token, the logits that chose
/// it (when handed on), and the caller's state before the step.
struct Made<S> {
    token: u32,
    logits: Vec<f32>,
    state: S,
}

/// The loop of [`greedy`], [`greedy_ids`] and [`sampled`]: `step` runs tokens (with the
/// caller's `state`) and returns the next one; each token goes to `hand_on`, with the logits
/// [`Model::forward`] left in the session when `with_logits` (else none).
///
/// When the model's executor defers its spot-checks ([`Checked`]), a token is handed on only
/// once its step and every step before it are checked; a step whose check disagreed is rolled
/// back: the session is truncated to the step's start, the state restored, and the step and
/// every later one made again (their tokens were never handed on). The tokens are those of
/// inline checks.
#[allow(clippy::too_many_arguments)]
fn generate<S: Clone>(
    model: &Model,
    sess: &mut Session,
    (prompt, max_new, stop): (&[u32], usize, &[u32]),
    state: &mut S,
    mut step: impl FnMut(&mut Session, &[u32], &mut S) -> Result<u32>,
    (with_logits, mut hand_on): (bool, impl FnMut(u32, &[f32])),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    // Saturating: a `max_new` near `usize::MAX` must fail this check, not wrap past it.
    let total = prompt.len().saturating_add(max_new.saturating_sub(1));
    if sess.position().saturating_add(total) > sess.max_context() {
        return Err(crate::Error::Input(format!(
            "prompt of {} tokens + {} new tokens does not fit the context of {} positions",
            prompt.len(),
            max_new,
            sess.max_context()
        )));
    }
    model.check_input(sess, prompt)?;
    let mut out = Vec::with_capacity(max_new.min(sess.max_context()));
    if max_new == 0 {
        return Ok(out);
    }
    let mut checked = Checked::new(model, sess.position());
    let base = sess.position();
    // The tokens of this generation fed or to feed: the prompt, then each one made.
    let mut fed = prompt.to_vec();
    let t0 = std::time::Instant::now();
    let mut t1 = None;
    loop {
        let start = sess.position();
        let id = checked.begin();
        let before = checked.deferring().then(|| state.clone());
        let tok = step(sess, &fed[start - base..], state)?;
        if t1.is_none() {
            timings.prefill_s = t0.elapsed().as_secs_f64();
            t1 = Some(std::time::Instant::now());
        }
        out.push(tok);
        fed.push(tok);
        let logits = if with_logits { sess.logits() } else { &[] };
        let done = out.len() == max_new || stop.contains(&tok);
        let Some(state_before) = before else {
            hand_on(tok, logits);
            if done {
                break;
            }
            continue;
        };
        let made = Made {
            token: tok,
            logits: logits.to_vec(),
            state: state_before,
        };
        checked.push(id, start, made);
        // At the end, wait for every check: the last tokens are handed on checked too.
        let emit = |m: Made<S>| hand_on(m.token, &m.logits);
        let waited = done.then(std::time::Instant::now);
        let settled = checked.settle(done, emit)?;
        timings.check_wait_s += waited.map_or(0.0, |t| t.elapsed().as_secs_f64());
        match settled {
            None if done => break,
            None => {}
            Some(back) => {
                out.truncate(out.len() - back.dropped);
                fed.truncate(prompt.len() + out.len());
                back.truncate(sess)?;
                *state = back.item.state;
            }
        }
    }
    timings.decode_s = t1.map_or(0.0, |t| t.elapsed().as_secs_f64());
    Ok(out)
}

/// A generation's steps under deferred spot-checks ([`ExpertExecutor::defer_checks`]): on
/// from [`new`](Self::new) (when the model's executor can defer them) until dropped, however
/// the generation ends. Each step's output (`T`) is held until the checks of its step and of
/// every step before it have ended, then handed on in order; a step whose check disagreed is
/// given back as a [`Rollback`]. The loop of [`greedy`] and [`sampled`] uses it, and so does
/// any other loop that can go back (the node's chat).
#[derive(Debug)]
pub struct Checked<'a, T> {
    executor: Option<&'a dyn ExpertExecutor>,
    /// The session position where the generation began: it cannot go back before it.
    base: usize,
    held: std::collections::VecDeque<(u64, usize, T)>,
}

/// A step whose deferred check disagreed, and what to undo ([`Checked::settle`]).
#[derive(Debug)]
pub struct Rollback<T> {
    /// The session's position when the step began: truncate it there.
    pub start: usize,
    /// The step's output (with whatever state from before the step the caller kept in it).
    pub item: T,
    /// Steps dropped: this one and every later one (none of them handed on).
    pub dropped: usize,
    base: usize,
}

impl<T> Rollback<T> {
    /// Truncates `sess` to the failed step's start (see [`Session::truncate`]); fails when the
    /// session cannot go back to where the generation began.
    pub fn truncate(&self, sess: &mut Session) -> Result<usize> {
        let kept = sess.truncate(self.start);
        if kept < self.base {
            return Err(crate::Error::Input(format!(
                "a peer's wrong answer was found at position {}, and the session cannot go \
                 back before position {} where this generation began",
                self.start, self.base
            )));
        }
        tracing::warn!(
            position = self.start,
            "a deferred spot-check disagreed: generating again from position {kept}"
        );
        Ok(kept)
    }
}

impl<'a, T> Checked<'a, T> {
    /// Deferred checks for a generation of `model` beginning at session position `base`, if
    /// its executor can defer them.
    pub fn new(model: &'a Model, base: usize) -> Self {
        Self {
            executor: model
                .executor()
                .map(|x| &**x)
                .filter(|x| x.defer_checks(true)),
            base,
            held: Default::default(),
        }
    }

    /// Whether checks are deferred: else every output is the caller's to hand on at once.
    pub fn deferring(&self) -> bool {
        self.executor.is_some()
    }

    /// A step begins; its id (0 when not deferring).
    pub fn begin(&self) -> u64 {
        self.executor.map_or(0, |x| x.begin_step())
    }

    /// Holds the output of step `step`, which began at session position `start`.
    pub fn push(&mut self, step: u64, start: usize, item: T) {
        self.held.push_back((step, start, item));
    }

    /// Whether outputs are held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Hands on, in order, the outputs whose checks have ended, to `hand_on`; with `wait`,
    /// first waits for every running check (or a disagreement). A disagreement drops the
    /// outputs from the failed step on and returns that step's [`Rollback`]; the outputs
    /// before it stay held (their checks may still be running) until a later call.
    pub fn settle(
        &mut self,
        wait: bool,
        mut hand_on: impl FnMut(T),
    ) -> Result<Option<Rollback<T>>> {
        let Some(x) = self.executor else {
            self.held.drain(..).for_each(|h| hand_on(h.2));
            return Ok(None);
        };
        match x.settle(wait) {
            Settled::Clear => self.held.drain(..).for_each(|h| hand_on(h.2)),
            Settled::Pending(p) => {
                while self.held.front().is_some_and(|h| h.0 < p) {
                    hand_on(self.held.pop_front().expect("a held step").2);
                }
            }
            Settled::Failed(f) => {
                let Some(r) = self.held.iter().position(|h| h.0 >= f) else {
                    return Err(crate::Error::Input(format!(
                        "a deferred check failed for step {f}, which was already handed on"
                    )));
                };
                let mut dropped = self.held.drain(r..);
                let (step, start, item) = dropped.next().expect("the failed step");
                let dropped = 1 + dropped.count();
                x.forget(step);
                ROLLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Ok(Some(Rollback {
                    start,
                    item,
                    dropped,
                    base: self.base,
                }));
            }
        }
        Ok(None)
    }
}

impl<T> Drop for Checked<'_, T> {
    fn drop(&mut self) {
        if let Some(x) = self.executor {
            x.defer_checks(false);
        }
    }
}

/// Steps rolled back after a deferred check disagreed, in this process.
static ROLLBACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many steps generations of this process rolled back because a deferred spot-check
/// disagreed ([`ExpertExecutor::defer_checks`]).
pub fn rollbacks() -> u64 {
    ROLLBACKS.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::{Demand, ExecFailed, Executed, Ticket, Verdict};
    use std::sync::Mutex;

    /// An executor whose `settle` answers from a script, recording what was forgotten.
    #[derive(Debug, Default)]
    struct Scripted {
        answers: Mutex<Vec<Settled>>,
        forgotten: Mutex<Vec<u64>>,
    }

    impl ExpertExecutor for Scripted {
        fn choose(&self, _: usize, _: &[Demand], _: &mut [bool]) {}
        fn submit(&self, _: usize, _: usize, _: &[f32]) -> Ticket {
            Ticket(0)
        }
        fn collect(&self, _: Ticket) -> std::result::Result<Executed, ExecFailed> {
            Err(ExecFailed::Unavailable("none".into()))
        }
        fn report(&self, _: Ticket, _: Verdict) {}
        fn settle(&self, _: bool) -> Settled {
            self.answers.lock().unwrap().remove(0)
        }
        fn forget(&self, step: u64) {
            self.forgotten.lock().unwrap().push(step);
        }
    }

    /// A later step's disagreement while an earlier step's check still runs: only the failed
    /// step and those after it are dropped; the earlier ones stay held until their own checks
    /// end, then are handed on in order.
    #[test]
    fn a_failed_step_leaves_earlier_unchecked_steps_held() {
        let x = Scripted::default();
        *x.answers.lock().unwrap() = vec![Settled::Failed(3), Settled::Pending(2), Settled::Clear];
        let mut c: Checked<'_, u32> = Checked {
            executor: Some(&x),
            base: 0,
            held: Default::default(),
        };
        for step in 1..=4 {
            c.push(step, 10 + step as usize, step as u32 * 100);
        }
        let mut handed = Vec::new();
        let back = c
            .settle(false, |t| handed.push(t))
            .unwrap()
            .expect("a rollback");
        assert_eq!((back.start, back.item, back.dropped), (13, 300, 2));
        assert!(
            handed.is_empty(),
            "step 1's check may still be running: {handed:?}"
        );
        assert_eq!(*x.forgotten.lock().unwrap(), [3]);
        assert!(c.settle(false, |t| handed.push(t)).unwrap().is_none());
        assert_eq!(handed, [100], "step 1 checked, step 2 still running");
        assert!(c.settle(true, |t| handed.push(t)).unwrap().is_none());
        assert_eq!(handed, [100, 200]);
        assert!(c.is_empty());
        // `Checked` turns deferral off when dropped; the default `defer_checks` ignores it.
    }
}
