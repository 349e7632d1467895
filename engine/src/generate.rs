//! Generation on top of [`Model::forward`]: greedy, or through a [`Sampler`].

use crate::error::Result;
use crate::model::{Logits, Model, Session};
use crate::sampling::Sampler;

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
    let choose = |logits: &[f32]| {
        let tok = argmax(logits);
        let best = logits.get(tok as usize).copied().unwrap_or(f32::NAN);
        warn_once_without_a_logit(best, &mut warned);
        Ok(tok)
    };
    from_logits(
        model,
        sess,
        (prompt, max_new, stop),
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
        prompt,
        max_new,
        stop,
        timings,
        |sess, tokens| {
            let c = model.forward_greedy(sess, tokens, None)?;
            warn_once_without_a_logit(c.logit, &mut warned);
            on_token(c.token);
            Ok(c.token)
        },
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
    let mut history = prompt.to_vec();
    let choose = |logits: &[f32]| {
        let tok = sampler
            .sample(logits, &history)
            .map_err(|e| crate::Error::Input(e.to_string()))?;
        history.push(tok);
        Ok(tok)
    };
    from_logits(
        model,
        sess,
        (prompt, max_new, stop),
        choose,
        on_token,
        timings,
    )
}

/// [`greedy`] and [`sampled`]: each step's last-position logits, and the token `choose` picks
/// from them; the prompt, the most tokens to make and the stop tokens come as one tuple.
fn from_logits(
    model: &Model,
    sess: &mut Session,
    (prompt, max_new, stop): (&[u32], usize, &[u32]),
    mut choose: impl FnMut(&[f32]) -> Result<u32>,
    mut on_token: impl FnMut(u32, &[f32]),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    generate(
        model,
        sess,
        prompt,
        max_new,
        stop,
        timings,
        |sess, tokens| {
            let logits = model.forward(sess, tokens, Logits::Last, None)?;
            let tok = choose(logits)?;
            on_token(tok, logits);
            Ok(tok)
        },
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

/// The loop of [`greedy`], [`greedy_ids`] and [`sampled`]: `step` runs tokens and returns the
/// next one.
fn generate(
    model: &Model,
    sess: &mut Session,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    timings: &mut Timings,
    mut step: impl FnMut(&mut Session, &[u32]) -> Result<u32>,
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
    let t0 = std::time::Instant::now();
    let mut tok = step(sess, prompt)?;
    timings.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    loop {
        out.push(tok);
        if out.len() == max_new || stop.contains(&tok) {
            break;
        }
        tok = step(sess, &[tok])?;
    }
    timings.decode_s = t1.elapsed().as_secs_f64();
    Ok(out)
}
