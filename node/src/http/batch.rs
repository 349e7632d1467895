//! Continuous batching on the HTTP engine thread: up to `parallel` requests generate
//! together, one [`Model::forward_batch`] per step over every running request's next tokens
//! (a decoded token, or a chunk of a prompt).
//!
//! Each request runs in a slot: an engine [`Session`] (its own KV cache and position) and the
//! ids its cache holds. A new request takes the free slot whose cached ids share the longest
//! prefix with its prompt (a conversation's next turn usually finds its previous turn there)
//! and computes only the rest, as [`crate::chat::session::ChatSession`] does. Requests join
//! and leave between steps. A prompt goes in chunks: at most one prefill block per step when
//! nothing decodes, at most [`PREFILL_WHILE_DECODING`] positions per step while others decode,
//! so a long prompt delays their next tokens by a few small steps instead of one long one.
//!
//! The tokens are those of the request running alone: a batched step gives each sequence the
//! same logits, bit for bit, as its own forward (see the engine's `model/batch.rs`), chunked
//! or not, and each request chooses from them with its own sampler and history exactly as
//! `ChatSession::generate_with_logprobs` does (the same order of checks: stop id, cancelled,
//! length, context full).
//!
//! A step that fails (an expert no tier could give) fails every request in it: their slots
//! are reset (as `ChatSession` drops its cache on an error) and each client gets the error.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use stormo_engine::model::{Seq, Want};
use stormo_engine::sampling::{Sampler, SamplingError};
use stormo_engine::{Batch, Model, Session};

use super::metrics::Metrics;
use super::{Event, Job, JobBox};
use crate::chat::session::{common_prefix, FinishReason, Generation, TokenLogprobs};
use crate::chat::TokenId;

/// The most prompt positions run in one step while other requests decode: each step then
/// costs about what decoding this many more tokens costs, so the decoding requests slow down
/// for the new prompt's prefill but are never stalled by a whole block.
pub(super) const PREFILL_WHILE_DECODING: usize = 32;

/// The most requests a server may run at once (`--parallel`).
pub const MAX_PARALLEL: usize = 64;

/// How many requests run together when `--parallel` is not given: as many KV caches of
/// `slot_bytes` as a quarter of `available` RAM holds (unknown: 8 GiB assumed), at least 1
/// and at most 4 (llama-server's default too). The caches are allocated zeroed, so the OS
/// commits their pages as positions are used.
pub fn default_parallel(slot_bytes: u64, available: Option<u64>) -> usize {
    let quarter = available.unwrap_or(8 << 30) / 4;
    (quarter / slot_bytes.max(1)).clamp(1, 4) as usize
}

/// A KV cache and the ids it holds (`cached.len() == sess.position()`).
#[derive(Debug)]
struct Slot {
    sess: Session,
    cached: Vec<TokenId>,
    busy: bool,
}

impl Slot {
    fn reset(&mut self) {
        self.sess.truncate(0);
        self.cached.clear();
    }
}

/// A request generating in a slot.
struct Running {
    slot: usize,
    job: Job,
    sampler: Sampler,
    /// Prompt and generated ids (the repetition penalty's history).
    history: Vec<TokenId>,
    /// Prompt positions in the slot's cache.
    done: usize,
    /// The last generated token, to run next (none while the prompt runs).
    next: Option<TokenId>,
    ids: Vec<TokenId>,
    /// Greedy through the screened head (no logits needed).
    screened: bool,
    reused: usize,
    started: Instant,
    prefill_s: f64,
    first_token: Option<Instant>,
}

/// The engine thread's state.
pub(super) struct Engine {
    model: Arc<Model>,
    slots: Vec<Slot>,
    running: Vec<Running>,
    batch: Batch,
    metrics: Arc<Metrics>,
}

impl Engine {
    /// `parallel` slots of `context` positions each.
    pub(super) fn new(
        model: Arc<Model>,
        context: usize,
        parallel: usize,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            (1..=MAX_PARALLEL).contains(&parallel),
            "the HTTP server's parallel requests must be between 1 and {MAX_PARALLEL}"
        );
        // Sliding layers keep the whole context, so a slot can always go back to a common
        // prefix without recomputing from the start (as `ChatSession`).
        let slots = (0..parallel)
            .map(|_| {
                Ok(Slot {
                    sess: model.session_with_rewind(context, context)?,
                    cached: Vec::new(),
                    busy: false,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            model,
            slots,
            running: Vec::new(),
            batch: Batch::new(),
            metrics,
        })
    }

    /// Runs jobs from `rx` until it closes and every running request has finished.
    pub(super) fn run(mut self, rx: std::sync::mpsc::Receiver<JobBox>) {
        let mut open = true;
        loop {
            if self.running.is_empty() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(JobBox(job)) => self.admit(job),
                    Err(_) => return,
                }
            }
            while open && self.running.len() < self.slots.len() {
                match rx.try_recv() {
                    Ok(JobBox(job)) => self.admit(job),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if !self.running.is_empty() {
                self.step();
            }
        }
    }

    /// Starts `job` in the free slot whose cache shares the longest prefix with its prompt.
    fn admit(&mut self, job: Job) {
        if job.events.is_closed() {
            return;
        }
        let sampler = match Sampler::new(job.opts.sampling) {
            Ok(s) => s,
            Err(e) => return fail(job, &e.to_string()),
        };
        let prompt = &job.prompt;
        let context = self.slots[0].sess.max_context();
        if prompt.is_empty() || prompt.len() > context {
            let msg = format!(
                "the prompt has {} tokens; a request holds 1 to {context}",
                prompt.len()
            );
            return fail(job, &msg);
        }
        let Some(slot) = (0..self.slots.len())
            .filter(|&i| !self.slots[i].busy)
            .max_by_key(|&i| (common_prefix(&self.slots[i].cached, prompt), usize::MAX - i))
        else {
            // The loop admits only while a slot is free.
            return fail(job, "no free slot");
        };
        let s = &mut self.slots[slot];
        // The last prompt token is always run: its logits choose the first new token.
        let want = common_prefix(&s.cached, prompt).min(prompt.len() - 1);
        let kept = s.sess.truncate(want);
        s.cached.truncate(kept);
        s.busy = true;
        let screened = job.logprobs.is_none()
            && self.model.has_screened_head()
            && job.opts.sampling.is_plain_argmax();
        self.metrics.active.inc();
        self.running.push(Running {
            slot,
            history: job.prompt.clone(),
            job,
            sampler,
            done: kept,
            next: None,
            ids: Vec::new(),
            screened,
            reused: kept,
            started: Instant::now(),
            prefill_s: 0.0,
            first_token: None,
        });
    }

    /// One forward over every running request's next tokens, then each request's choice.
    fn step(&mut self) {
        // Requests whose clients left stop here (their caches stay valid for reuse).
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].job.events.is_closed() {
                let r = self.running.swap_remove(i);
                self.release(r, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
        if self.running.is_empty() {
            return;
        }
        // Slot order: the batch's sequences are the slots, taken in order.
        self.running.sort_by_key(|r| r.slot);
        let decoding = self.running.iter().any(|r| r.next.is_some());
        let block = self.slots[0].sess.max_step();
        let mut budget = if decoding {
            PREFILL_WHILE_DECODING.min(block)
        } else {
            block
        };
        // Per running request: its tokens this step (empty: it waits for prompt budget).
        let mut inputs: Vec<(Vec<TokenId>, Want)> = Vec::with_capacity(self.running.len());
        for r in &self.running {
            let want = if r.screened {
                Want::Greedy
            } else {
                Want::Logits
            };
            if let Some(tok) = r.next {
                inputs.push((vec![tok], want));
                continue;
            }
            let n = (r.job.prompt.len() - r.done).min(budget);
            budget -= n;
            let end = r.done + n;
            let want = if end == r.job.prompt.len() {
                want
            } else {
                Want::Nothing
            };
            inputs.push((r.job.prompt[r.done..end].to_vec(), want));
        }
        let mut seqs: Vec<Seq<'_>> = Vec::with_capacity(inputs.len());
        let mut at = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(j) = self.running[at..].iter().position(|r| r.slot == i) else {
                continue;
            };
            at += j;
            let (tokens, want) = &inputs[at];
            at += 1;
            if !tokens.is_empty() {
                seqs.push(Seq {
                    session: &mut slot.sess,
                    tokens,
                    want: *want,
                });
            }
        }
        self.metrics.steps.inc();
        self.metrics.step_sequences.inc_by(seqs.len() as u64);
        let res = self.model.forward_batch(&mut self.batch, &mut seqs);
        drop(seqs);
        if let Err(e) = res {
            let msg = e.to_string();
            tracing::warn!("HTTP engine step failed: {msg}");
            for r in std::mem::take(&mut self.running) {
                self.slots[r.slot].reset();
                self.slots[r.slot].busy = false;
                self.metrics.active.dec();
                fail(r.job, &msg);
            }
            return;
        }
        let vocab = self.model.config().vocab_size;
        let mut finished = Vec::new();
        let mut j = 0;
        for (i, (tokens, want)) in inputs.iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let r = &mut self.running[i];
            let slot = &mut self.slots[r.slot];
            slot.cached.extend_from_slice(tokens);
            if r.next.is_none() {
                r.done += tokens.len();
            }
            let out = match want {
                Want::Nothing => Ok(None),
                Want::Greedy => {
                    let c = self
                        .batch
                        .choice(j, vocab)
                        .expect("a greedy choice was asked");
                    if c.logit == f32::NEG_INFINITY {
                        Err(SamplingError::NoFiniteLogit.to_string())
                    } else {
                        Ok(Some((c.token, None)))
                    }
                }
                Want::Logits => {
                    let logits = self.batch.logits(j, vocab).expect("logits were asked");
                    match r.sampler.sample(logits, &r.history) {
                        Ok(tok) => Ok(Some((
                            tok,
                            r.job.logprobs.map(|n| TokenLogprobs::of(logits, tok, n)),
                        ))),
                        Err(e) => Err(e.to_string()),
                    }
                }
            };
            j += 1;
            match out {
                Ok(None) => {}
                Ok(Some((tok, lp))) => {
                    if let Some(reason) = self.took(i, tok, lp) {
                        finished.push((i, Ok(reason)));
                    }
                }
                Err(msg) => finished.push((i, Err(msg))),
            }
        }
        // Highest index first, so the indices of the others stay valid.
        for (i, end) in finished.into_iter().rev() {
            let r = self.running.swap_remove(i);
            match end {
                Ok(reason) => self.release(r, reason),
                Err(msg) => {
                    // As `ChatSession` on an error: the cache is dropped, never left inconsistent.
                    self.slots[r.slot].reset();
                    self.slots[r.slot].busy = false;
                    self.metrics.active.dec();
                    fail(r.job, &msg);
                }
            }
        }
    }

    /// Request `i` chose `tok`: tells its client; returns how it ends, if it does.
    fn took(&mut self, i: usize, tok: TokenId, lp: Option<TokenLogprobs>) -> Option<FinishReason> {
        let r = &mut self.running[i];
        if r.first_token.is_none() {
            r.prefill_s = r.started.elapsed().as_secs_f64();
            r.first_token = Some(Instant::now());
        }
        r.ids.push(tok);
        r.history.push(tok);
        self.metrics.tokens.inc();
        let flow = if r.job.events.send(Event::Token(tok, lp)).is_err() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        };
        let sess = &self.slots[r.slot].sess;
        if r.job.opts.stop.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        if flow.is_break() {
            return Some(FinishReason::Cancelled);
        }
        if r.ids.len() >= r.job.opts.max_new_tokens.max(1) {
            return Some(FinishReason::Length);
        }
        if sess.position() >= sess.max_context() {
            return Some(FinishReason::ContextFull);
        }
        r.next = Some(tok);
        None
    }

    /// Ends request `r` (its slot keeps its cache for the next request that shares it).
    fn release(&mut self, r: Running, finish: FinishReason) {
        self.slots[r.slot].busy = false;
        self.metrics.active.dec();
        let g = Generation {
            prompt_tokens: r.job.prompt.len(),
            reused: r.reused,
            finish,
            prefill_s: r.prefill_s,
            decode_s: r.first_token.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            // Batched serving checks inline.
            check_wait_s: 0.0,
            ids: r.ids,
        };
        // The place in the queue is given back before the client hears that the request is
        // done, so whatever it asks next (another request, /metrics) sees the engine free.
        let Job {
            events, _permit, ..
        } = r.job;
        drop(_permit);
        tracing::info!(
            "HTTP request: prompt {} tokens ({} reused), {} generated",
            g.prompt_tokens,
            g.reused,
            g.ids.len()
        );
        self.metrics.prompt_tokens.inc_by(g.prompt_tokens as u64);
        self.metrics.prompt_reused.inc_by(g.reused as u64);
        let decode = g.ids.len().saturating_sub(1);
        if decode > 0 && g.decode_s > 0.0 {
            self.metrics.set_decode_rate(decode as f64 / g.decode_s);
        }
        let _ = events.send(Event::Done(g));
    }
}

/// Tells `job`'s client that it failed.
fn fail(job: Job, msg: &str) {
    let Job {
        events, _permit, ..
    } = job;
    drop(_permit);
    let _ = events.send(Event::Failed(msg.to_string()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_parallel_fits_a_quarter_of_the_ram_between_1_and_4() {
        let gib = 1u64 << 30;
        assert_eq!(default_parallel(gib, Some(16 * gib)), 4);
        assert_eq!(default_parallel(gib, Some(8 * gib)), 2);
        assert_eq!(default_parallel(gib, Some(2 * gib)), 1);
        assert_eq!(default_parallel(gib, Some(0)), 1);
        assert_eq!(default_parallel(0, None), 4);
        assert_eq!(default_parallel(3 * gib, None), 1);
    }
}
