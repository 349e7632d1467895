//! Conversations that keep their KV cache between turns.
//!
//! A [`ChatSession`] owns an engine [`Session`] and the ids whose keys and values it holds.
//! Each turn hands it the whole conversation rendered again (chat formats are not
//! prefix-preserving between turns: Harmony drops earlier reasoning and turns `<|return|>`
//! into `<|end|>`), and it reuses the longest common prefix of the new ids and the cached ids,
//! truncates the cache to it and computes only the rest. The tokens are the same as a full
//! recompute's, because a block forward is bit-identical per position to decoding one by one.
//!
//! Every emitted token except the last is run through the model to produce the next one, and
//! enters the cached ids at that moment, so the cache's positions always match its ids. The
//! last emitted token (usually a stop token) is not run: nothing needs its logits, and the
//! next turn's render decides whether it belongs in the cache (a `<|return|>` does not); if
//! it does, the longest common prefix leaves it to be computed with the rest of the new turn.
//!
//! A prompt that does not fit the context is refused before the cache is touched. A prompt
//! stopped by the session's interrupt flag ([`ChatSession::set_interrupt`], Ctrl-C in `stormo
//! chat`) ends the turn with no reply and the cache as it was before the turn. A session
//! can be saved to a file and resumed by another process ([`ChatSession::save`],
//! [`ChatSession::restore`]: the `persist` module).

mod persist;
pub use persist::SessionFileError;

use std::ops::ControlFlow;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use stormo_engine::generate::Checked;
use stormo_engine::sampling::{Sampler, SamplingError, SamplingParams};
use stormo_engine::{Logits, Model, Session};

use super::TokenId;

/// Why a turn could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// Nothing to run.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the session's context.
    #[error("the prompt has {prompt} tokens, more than the context of {context} positions holds")]
    PromptTooLong {
        /// Tokens in the prompt.
        prompt: usize,
        /// Positions in the session.
        context: usize,
    },
    /// An id outside the model's vocabulary.
    #[error("token id {id} is out of range: the model's vocabulary has {vocab} ids")]
    TokenOutOfRange {
        /// The id.
        id: TokenId,
        /// The vocabulary size.
        vocab: usize,
    },
    /// Sampling settings or logits were unusable.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] stormo_engine::Error),
}

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model emitted one of the stop ids (the last generated id).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The context is full.
    ContextFull,
    /// The caller's callback asked to stop.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's name for it (`stop` or `length`).
    pub fn openai(self) -> &'static str {
        match self {
            Self::Stop | Self::Cancelled => "stop",
            Self::Length | Self::ContextFull => "length",
        }
    }
}

/// Settings of one generation.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// At most this many new tokens (at least 1).
    pub max_new_tokens: usize,
    /// Ids that end the turn; the stop id is returned as the last generated id.
    pub stop: Vec<TokenId>,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
}

/// What a generation did.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The generated ids, including a final stop id.
    pub ids: Vec<TokenId>,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt positions taken from the cache instead of computed.
    pub reused: usize,
    /// How it ended.
    pub finish: FinishReason,
    /// Seconds spent on the prompt (the part not reused).
    pub prefill_s: f64,
    /// Seconds spent producing tokens after the first.
    pub decode_s: f64,
    /// Of `decode_s`, the seconds spent waiting for spot-checks still running after the last
    /// token was made (or the turn was cancelled): the checks that ran in the background did
    /// not end with the tokens.
    pub check_wait_s: f64,
}

/// The log-probability of a chosen token and of the most likely tokens at its position,
/// from the model's logits as they come out of the head: before the repetition penalty,
/// temperature, top-k and top-p (so they describe the model, not the sampler's settings).
/// `log_softmax(logits)[id]`, computed in f64 with the maximum subtracted first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first (lower id first on ties).
    pub top: Vec<(TokenId, f32)>,
}

/// The most alternatives [`TokenLogprobs`] lists.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl TokenLogprobs {
    /// The log-probability of `chosen` and the `top` most likely tokens (at most
    /// [`MAX_TOP_LOGPROBS`]) under `logits`. NaN logits count as negative infinity.
    pub fn of(logits: &[f32], chosen: TokenId, top: usize) -> Self {
        let top = top.min(MAX_TOP_LOGPROBS).min(logits.len());
        let clean = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        let max = logits
            .iter()
            .map(|&v| clean(v))
            .fold(f32::NEG_INFINITY, f32::max);
        // With no finite logit there is no distribution: every log-probability is -inf.
        let log_z = if max.is_finite() {
            let sum: f64 = logits
                .iter()
                .map(|&v| (f64::from(clean(v)) - f64::from(max)).exp())
                .sum();
            f64::from(max) + sum.ln()
        } else {
            f64::INFINITY
        };
        let lp = |v: f32| (f64::from(clean(v)) - log_z) as f32;
        let mut best: Vec<(TokenId, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &v) in logits.iter().enumerate() {
                let v = clean(v);
                if best.len() == top && best.last().is_some_and(|&(_, w)| v <= w) {
                    continue;
                }
                let at = best.partition_point(|&(_, w)| w >= v);
                best.insert(at, (i as TokenId, v));
                best.truncate(top);
            }
        }
        Self {
            logprob: logits
                .get(chosen as usize)
                .map_or(f32::NEG_INFINITY, |&v| lp(v)),
            top: best.into_iter().map(|(id, v)| (id, lp(v))).collect(),
        }
    }
}

/// A conversation's engine state: the KV cache and the ids it holds.
#[derive(Debug)]
pub struct ChatSession {
    model: Arc<Model>,
    sess: Session,
    /// The ids whose keys and values are in the cache; `len() == sess.position()`.
    cached: Vec<TokenId>,
    /// [`ChatSession::set_interrupt`].
    interrupt: Option<Arc<AtomicBool>>,
}

/// Length of the longest common prefix.
pub fn common_prefix(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl ChatSession {
    /// A session of `context` positions. Sliding-window layers keep the whole context, so a
    /// turn can always go back to the common prefix without recomputing from the start.
    pub fn new(model: Arc<Model>, context: usize) -> Result<Self, SessionError> {
        let sess = model.session_with_rewind(context, context)?;
        Ok(Self {
            model,
            sess,
            cached: Vec::new(),
            interrupt: None,
        })
    }

    /// How this session's tokens were chosen (see [`Model::forward_greedy`] and
    /// [`Model::forward_sample`]).
    pub fn screen_stats(&self) -> stormo_engine::ScreenStats {
        self.sess.screen_stats()
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Positions the session holds.
    pub fn context(&self) -> usize {
        self.sess.max_context()
    }

    /// The ids whose keys and values are in the cache.
    pub fn cached(&self) -> &[TokenId] {
        &self.cached
    }

    /// The engine session (expert prediction statistics).
    pub fn engine_session(&self) -> &Session {
        &self.sess
    }

    /// A flag that stops a turn's prompt while it is computed (checked between layers): the
    /// turn then ends at once, with no ids, finish reason [`FinishReason::Cancelled`] and the
    /// cache as it was before the turn. Generated tokens are not stopped by it: `on_token`
    /// decides that.
    pub fn set_interrupt(&mut self, flag: Option<Arc<AtomicBool>>) {
        self.interrupt = flag;
    }

    /// Forgets the conversation.
    pub fn reset(&mut self) {
        self.sess.truncate(0);
        self.cached.clear();
    }

    /// Runs `prompt` (a whole rendered conversation), reusing the cached common prefix, then
    /// generates. `on_token` sees each generated id as it is chosen and may stop the
    /// generation with `ControlFlow::Break`. On an engine error the cache is dropped (the
    /// next turn recomputes), never left inconsistent.
    pub fn generate(
        &mut self,
        prompt: &[TokenId],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(TokenId) -> ControlFlow<()>,
    ) -> Result<Generation, SessionError> {
        self.generate_with_logprobs(prompt, opts, None, |id, _| on_token(id))
    }

    /// [`Self::generate`], and when `top` is given, each token's log-probability and the
    /// `top` most likely alternatives (see [`TokenLogprobs`]) passed to `on_token` with it.
    /// Log-probabilities need the whole output head: with `top` given, the screened head is
    /// never used, for greedy or sampled tokens (the tokens are the same).
    pub fn generate_with_logprobs(
        &mut self,
        prompt: &[TokenId],
        opts: &GenerateOptions,
        top: Option<usize>,
        mut on_token: impl FnMut(TokenId, Option<TokenLogprobs>) -> ControlFlow<()>,
    ) -> Result<Generation, SessionError> {
        if prompt.is_empty() {
            return Err(SessionError::EmptyPrompt);
        }
        let context = self.context();
        if prompt.len() > context {
            return Err(SessionError::PromptTooLong {
                prompt: prompt.len(),
                context,
            });
        }
        let vocab = self.model.config().vocab_size;
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(SessionError::TokenOutOfRange { id, vocab });
        }
        let mut sampler = Sampler::new(opts.sampling)?;
        let res = self.generate_inner(prompt, opts, top, &mut sampler, &mut on_token);
        if res.is_err() {
            self.reset();
        }
        res
    }

    fn generate_inner(
        &mut self,
        prompt: &[TokenId],
        opts: &GenerateOptions,
        top: Option<usize>,
        sampler: &mut Sampler,
        on_token: &mut impl FnMut(TokenId, Option<TokenLogprobs>) -> ControlFlow<()>,
    ) -> Result<Generation, SessionError> {
        // The last prompt token is always run: its logits choose the first new token.
        let want = common_prefix(&self.cached, prompt).min(prompt.len() - 1);
        let kept = self.sess.truncate(want);
        self.cached.truncate(kept);
        debug_assert_eq!(self.cached.len(), self.sess.position());
        let t0 = Instant::now();
        let model = Arc::clone(&self.model);
        // Through the model's screened head when it has one: the argmax for greedy without a
        // penalty, else the sampler's draw (the same token as from the whole logits).
        // Log-probabilities need the whole head.
        let screened = top.is_none() && model.has_screened_head();
        let argmax = opts.sampling.is_plain_argmax();
        let step = |sess: &mut Session,
                    tokens: &[TokenId],
                    history: &[TokenId],
                    sampler: &mut Sampler|
         -> Result<(TokenId, Option<TokenLogprobs>), SessionError> {
            if screened && argmax {
                let c = model.forward_greedy(sess, tokens, None)?;
                if c.logit == f32::NEG_INFINITY {
                    return Err(SamplingError::NoFiniteLogit.into());
                }
                Ok((c.token, None))
            } else if screened {
                Ok((model.forward_sample(sess, tokens, sampler, history)?, None))
            } else {
                let logits = model.forward(sess, tokens, Logits::Last, None)?;
                let tok = sampler.sample(logits, history)?;
                Ok((tok, top.map(|n| TokenLogprobs::of(logits, tok, n))))
            }
        };
        let rest = &prompt[kept..];
        let mut history = prompt.to_vec();
        // Spot-checks of peers' answers in the background when the executor defers them: a
        // token goes to `on_token` only once its step is checked, and a step whose check
        // disagreed is made again (its token never shown).
        let mut checked = Checked::new(&model, kept);
        let deferring = checked.deferring();
        let before = deferring.then(|| sampler.clone());
        let id = checked.begin();
        // Only the prompt stops on the interrupt flag; `on_token` stops the reply.
        self.sess.set_stop(self.interrupt.clone());
        let first = step(&mut self.sess, rest, &history, sampler);
        self.sess.set_stop(None);
        let (mut tok, mut lp) = match first {
            Err(SessionError::Engine(stormo_engine::Error::Stopped)) => {
                // Back to the cache before the turn (the blocks computed are dropped).
                let kept = self.sess.truncate(kept);
                self.cached.truncate(kept);
                return Ok(Generation {
                    ids: Vec::new(),
                    prompt_tokens: prompt.len(),
                    reused: kept,
                    finish: FinishReason::Cancelled,
                    prefill_s: t0.elapsed().as_secs_f64(),
                    decode_s: 0.0,
                    check_wait_s: 0.0,
                });
            }
            first => first?,
        };
        self.cached.extend_from_slice(rest);
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        // The tokens made (`ids`), of which the first `shown` went to `on_token`.
        let mut ids = Vec::new();
        let mut shown = 0;
        let mut cancelled = false;
        let mut made = before.map(|b| (id, kept, b));
        let mut check_wait_s = 0.0;
        let finish = loop {
            ids.push(tok);
            history.push(tok);
            let mut finish = if opts.stop.contains(&tok) {
                Some(FinishReason::Stop)
            } else if ids.len() >= opts.max_new_tokens.max(1) {
                Some(FinishReason::Length)
            } else if self.sess.position() >= self.sess.max_context() {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            match made.take() {
                None => {
                    shown += 1;
                    if on_token(tok, lp.take()).is_break() && finish != Some(FinishReason::Stop) {
                        finish = Some(FinishReason::Cancelled);
                    }
                }
                Some((step_id, start, sampler_before)) => {
                    checked.push(step_id, start, (tok, lp.take(), sampler_before));
                    // At the end, and once cancelled, wait for every check.
                    let mut wait = finish.is_some() || cancelled;
                    let back = loop {
                        let waited = wait.then(Instant::now);
                        let back = checked.settle(wait, |(t, l, _)| {
                            if !cancelled {
                                shown += 1;
                                cancelled = on_token(t, l).is_break();
                            }
                        })?;
                        check_wait_s += waited.map_or(0.0, |t| t.elapsed().as_secs_f64());
                        if back.is_some() || wait || !cancelled {
                            break back;
                        }
                        wait = true;
                    };
                    if let Some(back) = back {
                        // Go back to the failed step: the session, its ids, the sampler.
                        let kept = back.truncate(&mut self.sess)?;
                        let keep = ids.len() - back.dropped;
                        ids.truncate(keep);
                        history.truncate(prompt.len() + keep);
                        self.cached.truncate(kept);
                        *sampler = back.item.2;
                        if cancelled {
                            // Nothing after what was shown is made again.
                            break FinishReason::Cancelled;
                        }
                        let input = history[kept..].to_vec();
                        let before = sampler.clone();
                        let step_id = checked.begin();
                        (tok, lp) = step(&mut self.sess, &input, &history, sampler)?;
                        self.cached.extend_from_slice(&input);
                        made = Some((step_id, kept, before));
                        continue;
                    }
                    if cancelled && finish != Some(FinishReason::Stop) {
                        finish = Some(FinishReason::Cancelled);
                    }
                    debug_assert!(finish.is_none() || checked.is_empty());
                }
            }
            if let Some(f) = finish {
                break f;
            }
            let start = self.sess.position();
            let before = deferring.then(|| sampler.clone());
            let step_id = checked.begin();
            let (next, next_lp) = step(&mut self.sess, &[tok], &history, sampler)?;
            self.cached.push(tok);
            made = before.map(|b| (step_id, start, b));
            (tok, lp) = (next, next_lp);
        };
        if ids.len() > shown {
            // Cancelled with tokens made but not shown: keep only what was shown (the session
            // holds every shown token but the last, as when not deferring).
            let keep = prompt.len() + shown.saturating_sub(1);
            let kept = self.sess.truncate(keep);
            self.cached.truncate(kept);
            ids.truncate(shown);
        }
        Ok(Generation {
            ids,
            prompt_tokens: prompt.len(),
            reused: kept,
            finish,
            prefill_s,
            decode_s: t1.elapsed().as_secs_f64(),
            check_wait_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/gptoss-tiny-mxfp4")
    }

    /// A session over the tiny fixture whose experts a [`LateLiar`] runs: wrong for one expert
    /// from call `from` on, each check found two steps late.
    fn lied_to(from: usize) -> (ChatSession, Arc<stormo_engine::late_liar::LateLiar>) {
        let liar =
            Arc::new(stormo_engine::late_liar::LateLiar::new(&tiny(), from, 2, true).unwrap());
        let model = Model::load(&tiny(), &stormo_engine::LoadOptions::default())
            .unwrap()
            .with_executor(liar.clone());
        (ChatSession::new(Arc::new(model), 64).unwrap(), liar)
    }

    /// With checks in the background, a chat turn shows only checked tokens: a lie found late
    /// (in the prefill or in a decoded token) is made again, greedy and sampled, and the turn
    /// shows and returns the ids of a session without the liar; the next turn reuses the cache
    /// as usual. A turn cancelled after three tokens keeps those three and the cache before
    /// the last.
    #[test]
    fn a_lie_found_late_is_made_again_and_never_shown() {
        let prompt: Vec<TokenId> = (0..9).map(|i| (i * 37 + 5) % 1000).collect();
        let opts = |sampling| GenerateOptions {
            max_new_tokens: 10,
            stop: Vec::new(),
            sampling,
        };
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: 3,
        };
        let local = || {
            let m = Model::load(&tiny(), &stormo_engine::LoadOptions::default()).unwrap();
            ChatSession::new(Arc::new(m), 64).unwrap()
        };
        for sampling in [SamplingParams::default(), sampled] {
            let mut reference = local();
            let want = reference
                .generate(&prompt, &opts(sampling), |_| ControlFlow::Continue(()))
                .unwrap()
                .ids;
            let second: Vec<TokenId> = [&prompt[..], &want, &[7, 8]].concat();
            let want2 = reference
                .generate(&second, &opts(sampling), |_| ControlFlow::Continue(()))
                .unwrap()
                .ids;
            let decode_call = {
                let (mut s, liar) = lied_to(usize::MAX);
                s.generate(&prompt, &opts(sampling), |_| ControlFlow::Continue(()))
                    .unwrap();
                liar.calls_before()[2] + 1
            };
            for from in [0, decode_call] {
                let (mut s, liar) = lied_to(from);
                let before = stormo_engine::generate::rollbacks();
                let mut shown = Vec::new();
                let g = s
                    .generate(&prompt, &opts(sampling), |id| {
                        shown.push(id);
                        ControlFlow::Continue(())
                    })
                    .unwrap();
                let what = format!("{sampling:?}, lying from call {from}");
                assert_eq!(g.ids, want, "{what}");
                assert_eq!(shown, want, "{what}");
                assert!(liar.caught(), "{what}");
                assert!(stormo_engine::generate::rollbacks() > before, "{what}");
                assert_eq!(s.cached(), &second[..prompt.len() + want.len() - 1]);
                let g2 = s
                    .generate(&second, &opts(sampling), |_| ControlFlow::Continue(()))
                    .unwrap();
                assert_eq!(g2.ids, want2, "{what}: the next turn");
                assert_eq!(g2.reused, prompt.len() + want.len() - 1, "{what}");
            }
            // Cancelled after three tokens shown, with the lie in the prefill.
            let (mut s, _) = lied_to(0);
            let mut n = 0;
            let g = s
                .generate(&prompt, &opts(sampling), |_| {
                    n += 1;
                    if n == 3 {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                })
                .unwrap();
            assert_eq!(g.finish, FinishReason::Cancelled);
            assert_eq!(g.ids, want[..3]);
            assert_eq!(s.cached(), &second[..prompt.len() + 2]);
        }
    }

    #[test]
    fn common_prefix_counts_equal_leading_ids() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[7], &[8]), 0);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_tokens_in_order() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let lp = TokenLogprobs::of(&logits, 1, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|v| v.exp()).sum();
        let want = |v: f64| (v - z.ln()) as f32;
        assert!((lp.logprob - want(3.0)).abs() < 1e-6, "{lp:?}");
        // Ties: the lower id first; the NaN counts as -inf and is never among the top.
        let ids: Vec<TokenId> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0]);
        assert!((lp.top[2].1 - want(1.0)).abs() < 1e-6);
        let probs: f64 = (0..5)
            .map(|i| f64::from(TokenLogprobs::of(&logits, i, 0).logprob).exp())
            .sum();
        assert!((probs - 1.0).abs() < 1e-6, "{probs}");
        assert!(TokenLogprobs::of(&logits, 9, 0).logprob == f32::NEG_INFINITY);
        assert_eq!(TokenLogprobs::of(&logits, 0, 100).top.len(), 5);
        let none = TokenLogprobs::of(&[f32::NEG_INFINITY; 3], 0, 1);
        assert_eq!(none.logprob, f32::NEG_INFINITY);
    }

    #[test]
    fn finish_reasons_use_openai_names() {
        assert_eq!(FinishReason::Stop.openai(), "stop");
        assert_eq!(FinishReason::ContextFull.openai(), "length");
    }
}
