//! Greedy generation on top of [`Model::forward`].

use crate::error::Result;
use crate::model::{Logits, Model, Session};

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
    mut on_token: impl FnMut(u32, &[f32]),
    timings: &mut Timings,
) -> Result<Vec<u32>> {
    let total = prompt.len() + max_new.saturating_sub(1);
    if sess.position() + total > sess.max_context() {
        return Err(crate::Error::Input(format!(
            "prompt of {} tokens + {} new tokens does not fit the context of {} positions",
            prompt.len(),
            max_new,
            sess.max_context()
        )));
    }
    model.check_input(sess, prompt)?;
    let mut out = Vec::with_capacity(max_new);
    if max_new == 0 {
        return Ok(out);
    }
    let t0 = std::time::Instant::now();
    let mut logits = model.forward(sess, prompt, Logits::Last, None)?;
    timings.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    loop {
        let tok = argmax(logits);
        on_token(tok, logits);
        out.push(tok);
        if out.len() == max_new || stop.contains(&tok) {
            break;
        }
        logits = model.forward(sess, &[tok], Logits::Last, None)?;
    }
    timings.decode_s = t1.elapsed().as_secs_f64();
    Ok(out)
}
