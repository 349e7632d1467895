//! Continuous batching on the HTTP engine thread: up to `parallel` requests generate
//! together, one [`Model::forward_batch`] per step over every running request's next tokens
//! (a decoded token, or a chunk of a prompt).
//!
//! Each request runs in a slot: an engine [`Session`] (its own KV cache and position) and the
//! ids its cache holds. A new request takes the free slot whose cached ids share the longest
//! prefix with its prompt (a conversation's next turn usually finds its previous turn there)
//! and computes only the rest, as [`stormo_text::session::ChatSession`] does; with a prompt
//! cache on disk ([`super::prompt_cache`]), the chunks of the prompt it holds beyond what the
//! slot shares are loaded from there, and a request that ends leaves its slot's chunks there
//! (before its client hears that it is done). The client is told how many prompt positions
//! came from a cache before its first token ([`Event::Cached`]). Requests join
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
//!
//! Spot-checks of peers' answers (when the model's experts run on peers) do not hold a step
//! back unless `--spot-check-inline` is given: each step's outputs (tokens, ends, errors) are
//! held until the checks of that step and of every earlier one have ended, and only then
//! sent, as `run` and the chat do ([`stormo_engine::generate::Checked`]). A check that
//! disagrees rolls back every request that took part in its step or a later one: each slot
//! goes back to its position before that step, each request to its sampler, history and ids
//! then, and those steps are made again. A client only ever sees checked tokens; a request
//! ends (and its slot is free again) once its last step is checked, and when nothing is left
//! to compute the engine waits for the checks still running.
//!
//! Requests wait for a slot in a [`Queue`], oldest first. A thread takes each one from the
//! handlers' channel as it comes (the engine may be in the middle of a step) and starts a
//! watcher on the engine's small runtime: when the request's client hangs up (its reply, and
//! so the receiving end of its events, is dropped), the watcher takes it out of the queue at
//! once, and its place counts against the queue limit no more. A request that hung up is
//! never started either. A running request whose client hangs up ends at the next step, as
//! before.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

use stormo_engine::model::{Seq, Want};
use stormo_engine::moe::{ExpertExecutor, Settled};
use stormo_engine::sampling::{Sampler, SamplingError};
use stormo_engine::{Batch, Model, Session};

use anyhow::Context as _;

use super::metrics::Metrics;
use super::prompt_cache::{PromptCache, PromptCacheConfig};
use super::{Event, Job, JobBox};
use stormo_text::session::{common_prefix, FinishReason, Generation, TokenLogprobs};
use stormo_text::TokenId;

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
    /// The engine's id of the request (steps name their requests by it).
    id: u64,
    slot: usize,
    job: Job,
    /// How it ends, once a step decided so (the slot stays busy until that step is checked
    /// and handed on: it can still be rolled back).
    ending: Option<Result<FinishReason, String>>,
    /// Its client left: it ends as cancelled whatever a rollback makes again.
    gone: bool,
    /// Seconds the engine waited for spot-checks while this request was running.
    check_wait_s: f64,
    sampler: Sampler,
    /// Prompt and generated ids (the repetition penalty's history).
    history: Vec<TokenId>,
    /// Prompt positions in the slot's cache.
    done: usize,
    /// The last generated token, to run next (none while the prompt runs).
    next: Option<TokenId>,
    ids: Vec<TokenId>,
    /// What it wants from the head after its last token: with the model's screened head and
    /// no log-probabilities asked, a greedy choice or a draw through the screen (the whole
    /// head's token either way); else the logits.
    want: Want,
    reused: usize,
    started: Instant,
    prefill_s: f64,
    first_token: Option<Instant>,
}

/// A request's state before a step, to go back to if that step is rolled back (it had not
/// ended then: an ended request takes no part in steps).
struct Snapshot {
    /// Its slot's position (and cached ids).
    position: usize,
    done: usize,
    next: Option<TokenId>,
    history: usize,
    ids: usize,
    sampler: Sampler,
}

/// A step whose outputs wait for its spot-checks (and those of every earlier step).
struct Held {
    /// The executor's id of the step (0 when checks are not deferred).
    step: u64,
    /// The requests that took part (by id), each as it was before the step (none when
    /// checks are not deferred: such a step is handed on at once and never rolled back).
    before: Vec<(u64, Snapshot)>,
    /// The tokens the step chose (with their log-probabilities, if asked), in order, by
    /// request id. A request whose choice failed ended with the error.
    chose: Vec<(u64, TokenId, Option<TokenLogprobs>)>,
}

/// The requests waiting for a slot, oldest first; shared by the engine, the thread that
/// fills it from the handlers' channel, and the watchers of the waiting requests' clients.
#[derive(Default)]
struct Queue {
    state: Mutex<Waiting>,
    /// Signalled when a request arrives or the queue closes.
    ready: Condvar,
}

#[derive(Default)]
struct Waiting {
    jobs: VecDeque<Entry>,
    /// The handlers' channel has closed: no more requests come.
    closed: bool,
    /// The engine has stopped (it panicked): requests are failed, not queued.
    stopped: bool,
    next_id: u64,
}

/// A waiting request. Dropping it (admitted, or gone) ends its watcher.
struct Entry {
    id: u64,
    job: Job,
    _watch: tokio::sync::oneshot::Sender<()>,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes every request from `rx` into the queue, each watched on `rt`, until the channel
    /// closes or the engine stops.
    fn fill(self: &Arc<Self>, rx: std::sync::mpsc::Receiver<JobBox>, rt: &tokio::runtime::Handle) {
        while let Ok(JobBox(job)) = rx.recv() {
            if !self.push(job, rt) {
                // Dropping `rx` makes the handlers' next send fail: "the engine has stopped".
                return;
            }
        }
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Queues `job` and watches its client; false (and `job` failed) when the engine stopped.
    fn push(self: &Arc<Self>, job: Job, rt: &tokio::runtime::Handle) -> bool {
        let events = job.events.clone();
        let (watch, admitted) = tokio::sync::oneshot::channel();
        let id = {
            let mut w = self.lock();
            if w.stopped {
                drop(w);
                fail(job, "the engine has stopped");
                return false;
            }
            w.next_id += 1;
            let id = w.next_id;
            w.jobs.push_back(Entry {
                id,
                job,
                _watch: watch,
            });
            id
        };
        self.ready.notify_one();
        let queue = self.clone();
        rt.spawn(async move {
            tokio::select! {
                () = events.closed() => queue.leave(id),
                // The request left the queue (admitted, or the engine stopped).
                _ = admitted => {}
            }
        });
        true
    }

    /// Request `id`'s client hung up: it leaves the queue, and its place is free (its
    /// `Permit` drops with it).
    fn leave(&self, id: u64) {
        let gone = {
            let mut w = self.lock();
            let i = w.jobs.iter().position(|e| e.id == id);
            i.and_then(|i| w.jobs.remove(i))
        };
        if gone.is_some() {
            tracing::debug!("HTTP: a queued request left the queue: its client hung up");
        }
    }

    /// Moves up to `free` waiting requests into `into`, oldest first; with `wait`, first
    /// waits until one is there. False once the queue is closed and empty (no request can
    /// come any more).
    fn take(&self, free: usize, wait: bool, into: &mut Vec<Job>) -> bool {
        let mut w = self.lock();
        while wait && w.jobs.is_empty() && !w.closed {
            w = self.ready.wait(w).unwrap_or_else(PoisonError::into_inner);
        }
        if w.jobs.is_empty() && w.closed {
            return false;
        }
        let n = free.min(w.jobs.len());
        into.extend(w.jobs.drain(..n).map(|e| e.job));
        true
    }

    /// The engine stopped: waiting requests fail, and so do any that come.
    fn stop(&self) {
        let jobs = {
            let mut w = self.lock();
            w.stopped = true;
            std::mem::take(&mut w.jobs)
        };
        for e in jobs {
            fail(e.job, "the engine has stopped");
        }
    }
}

/// The engine thread's state.
pub(super) struct Engine {
    model: Arc<Model>,
    slots: Vec<Slot>,
    running: Vec<Running>,
    batch: Batch,
    metrics: Arc<Metrics>,
    /// Whether spot-checks are deferred (the model's executor agreed to).
    deferring: bool,
    /// Steps not yet handed on, oldest first.
    held: VecDeque<Held>,
    next_id: u64,
    queue: Arc<Queue>,
    /// Runs the queue's filler and watchers (one worker thread); `None` once shut down.
    rt: Option<tokio::runtime::Runtime>,
    /// The prompt cache on disk, if asked for.
    cache: Option<PromptCache>,
}

impl Engine {
    /// `parallel` slots of `context` positions each, and the prompt cache in `cache`.
    pub(super) fn new(
        model: Arc<Model>,
        context: usize,
        parallel: usize,
        metrics: Arc<Metrics>,
        cache: Option<&PromptCacheConfig>,
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
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("stormo-http-queue")
            .build()
            .context("starting the HTTP queue's runtime")?;
        let cache = cache
            .map(|c| PromptCache::open(c, &model, metrics.clone()))
            .transpose()
            .context("opening the prompt cache (--prompt-cache)")?;
        let deferring = model.executor().is_some_and(|x| x.defer_checks(true));
        Ok(Self {
            model,
            slots,
            running: Vec::new(),
            batch: Batch::new(),
            metrics,
            deferring,
            held: VecDeque::new(),
            next_id: 0,
            queue: Arc::new(Queue::default()),
            rt: Some(rt),
            cache,
        })
    }

    /// Runs jobs from `rx` until it closes and every running request has finished.
    pub(super) fn run(mut self, rx: std::sync::mpsc::Receiver<JobBox>) {
        let rt = self
            .rt
            .as_ref()
            .expect("the runtime lives until the engine drops");
        let (queue, handle) = (self.queue.clone(), rt.handle().clone());
        rt.spawn_blocking(move || queue.fill(rx, &handle));
        let mut jobs = Vec::with_capacity(self.slots.len());
        loop {
            let free = self.slots.len() - self.running.len();
            let idle = self.running.is_empty();
            if !self.queue.take(free, idle, &mut jobs) && idle {
                return;
            }
            for job in jobs.drain(..) {
                self.admit(job);
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
        let mut kept = s.sess.truncate(want);
        s.cached.truncate(kept);
        if let Some(cache) = &mut self.cache {
            let (held, from_disk) =
                cache.load(&self.model, &mut s.sess, &prompt[..prompt.len() - 1]);
            if held != kept {
                s.cached.clear();
                s.cached.extend_from_slice(&prompt[..held]);
                kept = held;
            }
            self.metrics.prompt_cache_tokens.inc_by(from_disk as u64);
        }
        s.busy = true;
        if job.events.send(Event::Cached(kept)).is_err() {
            s.busy = false;
            return;
        }
        // Log-probabilities need the whole head's logits.
        let want = if job.logprobs.is_some() || !self.model.has_screened_head() {
            Want::Logits
        } else if job.opts.sampling.is_plain_argmax() {
            Want::Greedy
        } else {
            Want::Sample
        };
        self.metrics.active.inc();
        self.next_id += 1;
        self.running.push(Running {
            id: self.next_id,
            slot,
            ending: None,
            gone: false,
            check_wait_s: 0.0,
            history: job.prompt.clone(),
            job,
            sampler,
            done: kept,
            next: None,
            ids: Vec::new(),
            want,
            reused: kept,
            started: Instant::now(),
            prefill_s: 0.0,
            first_token: None,
        });
    }

    /// The model's executor, when its spot-checks are deferred.
    fn deferred(&self) -> Option<Arc<dyn ExpertExecutor>> {
        self.model.executor().filter(|_| self.deferring).cloned()
    }

    /// Whether request `id` took part in a step not yet handed on.
    fn in_held(&self, id: u64) -> bool {
        self.held.iter().any(|h| h.before.iter().any(|b| b.0 == id))
    }

    /// One forward over every running request's next tokens, then each request's choice,
    /// held until its checks end ([`Self::settle`]). With nothing left to compute, waits for
    /// the checks still running instead.
    fn step(&mut self) {
        // Requests whose clients left stop here (their caches stay valid for reuse); one with
        // steps still held ends once they are handed on.
        for r in &mut self.running {
            if !r.gone && r.job.events.is_closed() {
                r.gone = true;
                r.ending = Some(Ok(FinishReason::Cancelled));
            }
        }
        self.release_ended();
        if self.running.is_empty() {
            return;
        }
        if self.running.iter().all(|r| r.ending.is_some()) {
            // Every request has made its last step: wait for those steps' checks.
            let t = Instant::now();
            self.settle(true);
            let waited = t.elapsed().as_secs_f64();
            for r in &mut self.running {
                r.check_wait_s += waited;
            }
            self.release_ended();
            return;
        }
        // Slot order: the batch's sequences are the slots, taken in order.
        self.running.sort_by_key(|r| r.slot);
        let decoding = self
            .running
            .iter()
            .any(|r| r.ending.is_none() && r.next.is_some());
        let block = self.slots[0].sess.max_step();
        let mut budget = if decoding {
            PREFILL_WHILE_DECODING.min(block)
        } else {
            block
        };
        // Per running request: its tokens this step (empty: it waits for prompt budget, or
        // has ended).
        let mut inputs: Vec<(Vec<TokenId>, Want)> = Vec::with_capacity(self.running.len());
        for r in &self.running {
            let want = r.want;
            if r.ending.is_some() {
                inputs.push((Vec::new(), Want::Nothing));
                continue;
            }
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
        // Only a step that may be rolled back needs what its requests were before it.
        let before: Vec<(u64, Snapshot)> = if self.deferring {
            self.running
                .iter()
                .zip(&inputs)
                .filter(|(_, (tokens, _))| !tokens.is_empty())
                .map(|(r, _)| (r.id, self.snapshot(r)))
                .collect()
        } else {
            Vec::new()
        };
        let executor = self.deferred();
        let step = executor.as_ref().map_or(0, |x| x.begin_step());
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
            let msg = e.chain();
            // No reachable holder of an expert (the peers' tier or none at all): 503, worth a
            // retry once a holder is back. A local file's fault (a checkpoint changed under
            // the node) stays a 500.
            let unavailable = matches!(
                &e,
                stormo_engine::Error::Expert { reason, .. }
                    if reason.starts_with("no tier holds it") || reason.starts_with("from peers:")
            );
            tracing::warn!("HTTP engine step failed: {msg}");
            // The held steps' requests fail with it, and so does this step: their checks no
            // longer count.
            if let Some(x) = &executor {
                x.forget(self.held.front().map_or(step, |h| h.step));
            }
            self.held.clear();
            for r in std::mem::take(&mut self.running) {
                self.slots[r.slot].reset();
                self.slots[r.slot].busy = false;
                self.metrics.active.dec();
                if unavailable {
                    end(r.job, Event::Unavailable(msg.clone()));
                } else {
                    fail(r.job, &msg);
                }
            }
            return;
        }
        let vocab = self.model.config().vocab_size;
        let mut chose = Vec::new();
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
                Want::Nothing => None,
                Want::Greedy => {
                    let c = self
                        .batch
                        .choice(j, vocab)
                        .expect("a greedy choice was asked");
                    Some(if c.logit == f32::NEG_INFINITY {
                        Err(SamplingError::NoFiniteLogit.to_string())
                    } else {
                        Ok((c.token, None))
                    })
                }
                Want::Sample => Some(
                    self.model
                        .batch_sample(
                            &mut self.batch,
                            j,
                            &mut slot.sess,
                            &mut r.sampler,
                            &r.history,
                        )
                        .map(|tok| (tok, None))
                        .map_err(|e| e.chain()),
                ),
                Want::Logits => {
                    let logits = self.batch.logits(j, vocab).expect("logits were asked");
                    Some(match r.sampler.sample(logits, &r.history) {
                        Ok(tok) => Ok((
                            tok,
                            r.job.logprobs.map(|n| TokenLogprobs::of(logits, tok, n)),
                        )),
                        Err(e) => Err(e.to_string()),
                    })
                }
            };
            j += 1;
            match out {
                None => {}
                Some(Ok((tok, lp))) => {
                    let ending = self.advance(i, tok).map(Ok);
                    let r = &mut self.running[i];
                    r.ending = ending;
                    chose.push((r.id, tok, lp));
                }
                Some(Err(msg)) => r.ending = Some(Err(msg)),
            }
        }
        self.held.push_back(Held {
            step,
            before,
            chose,
        });
        self.settle(false);
        self.release_ended();
    }

    /// Request `r` as it is now, to go back to.
    fn snapshot(&self, r: &Running) -> Snapshot {
        Snapshot {
            position: self.slots[r.slot].sess.position(),
            done: r.done,
            next: r.next,
            history: r.history.len(),
            ids: r.ids.len(),
            sampler: r.sampler.clone(),
        }
    }

    /// Request `i` chose `tok` in a step: records it; returns how it ends, if it does (the
    /// order of `ChatSession`'s checks: stop id, length, context full; a client that left is
    /// found when the token is handed on).
    fn advance(&mut self, i: usize, tok: TokenId) -> Option<FinishReason> {
        let r = &mut self.running[i];
        r.ids.push(tok);
        r.history.push(tok);
        let sess = &self.slots[r.slot].sess;
        if r.job.opts.stop.contains(&tok) {
            return Some(FinishReason::Stop);
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

    /// Hands on the held steps whose checks have ended (all of them when checks are not
    /// deferred; with `wait`, after waiting for the running ones), or rolls back from a step
    /// whose check disagreed.
    fn settle(&mut self, wait: bool) {
        let x = self.deferred();
        match x.as_ref().map_or(Settled::Clear, |x| x.settle(wait)) {
            Settled::Clear => {
                while let Some(h) = self.held.pop_front() {
                    self.hand_on(h);
                }
            }
            Settled::Pending(p) => {
                while self.held.front().is_some_and(|h| h.step < p) {
                    let h = self.held.pop_front().expect("a held step");
                    self.hand_on(h);
                }
            }
            Settled::Failed(f) => {
                let x = x.expect("only an executor's checks fail");
                let Some(k) = self.held.iter().position(|h| h.step >= f) else {
                    // Only steps whose checks all ended were handed on: cannot happen, and
                    // nothing held is wrong if it does.
                    tracing::warn!("a deferred check failed for step {f}, already handed on");
                    x.forget(f);
                    return;
                };
                let dropped: Vec<Held> = self.held.drain(k..).collect();
                // From `f` on (the first dropped step is `f` itself unless a bug handed `f` on):
                // a failure left standing would roll back again and again.
                x.forget(f);
                self.roll_back(dropped);
            }
        }
    }

    /// Steps `dropped` (oldest first) are undone: every request in them goes back to its state
    /// before the first of them it took part in, its slot to that position.
    fn roll_back(&mut self, dropped: Vec<Held>) {
        tracing::warn!(
            "a deferred spot-check disagreed: {} step(s) of the HTTP engine made again",
            dropped.len()
        );
        let mut restored = std::collections::HashSet::new();
        for h in dropped {
            for (id, snap) in h.before {
                if !restored.insert(id) {
                    continue;
                }
                let Some(i) = self.running.iter().position(|r| r.id == id) else {
                    continue;
                };
                let r = &mut self.running[i];
                let slot = &mut self.slots[r.slot];
                let kept = slot.sess.truncate(snap.position);
                slot.cached.truncate(kept);
                if kept != snap.position {
                    // A slot keeps its whole context, so this does not happen; if it did, the
                    // request could not be made again exactly.
                    r.ending = Some(Err(format!(
                        "a peer's wrong answer was found at position {}, and the request's \
                         cache cannot go back there",
                        snap.position
                    )));
                    slot.reset();
                    continue;
                }
                r.done = snap.done;
                r.next = snap.next;
                r.history.truncate(snap.history);
                r.ids.truncate(snap.ids);
                r.sampler = snap.sampler;
                r.ending = r.gone.then_some(Ok(FinishReason::Cancelled));
            }
        }
    }

    /// Sends a checked step's tokens to their clients (its errors and ends go with the
    /// requests' release, [`Self::release_ended`]).
    fn hand_on(&mut self, h: Held) {
        for (id, tok, lp) in h.chose {
            let Some(r) = self.running.iter_mut().find(|r| r.id == id && !r.gone) else {
                continue;
            };
            if r.first_token.is_none() {
                r.prefill_s = r.started.elapsed().as_secs_f64();
                r.first_token = Some(Instant::now());
            }
            self.metrics.tokens.inc();
            if r.job.events.send(Event::Token(tok, lp)).is_err() {
                r.gone = true;
                // `ChatSession`'s order: a stop id ends the request before a client that left.
                if !matches!(r.ending, Some(Ok(FinishReason::Stop))) {
                    r.ending = Some(Ok(FinishReason::Cancelled));
                }
            }
        }
    }

    /// Ends the requests whose last step has been handed on.
    fn release_ended(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.ending.is_none() || self.in_held(r.id) {
                i += 1;
                continue;
            }
            let mut r = self.running.swap_remove(i);
            match r.ending.take().expect("an ending") {
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

    /// Ends request `r` (its slot keeps its cache for the next request that shares it, and
    /// the prompt cache on disk its whole chunks).
    fn release(&mut self, r: Running, finish: FinishReason) {
        if let Some(cache) = &mut self.cache {
            let slot = &self.slots[r.slot];
            cache.save(&self.model, &slot.sess, &slot.cached);
        }
        self.slots[r.slot].busy = false;
        self.metrics.active.dec();
        let g = Generation {
            prompt_tokens: r.job.prompt.len(),
            reused: r.reused,
            finish,
            prefill_s: r.prefill_s,
            decode_s: r.first_token.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            check_wait_s: r.check_wait_s,
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

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(x) = self.deferred() {
            x.defer_checks(false);
        }
        // After `run` the queue is closed and empty; if the engine panicked, its waiting
        // requests fail instead of waiting for ever.
        self.queue.stop();
        // Without waiting: the filler may still block on the channel (it returns at the next
        // request), and the engine may be dropped on an async thread where waiting panics.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Tells `job`'s client that it failed.
fn fail(job: Job, msg: &str) {
    end(job, Event::Failed(msg.to_string()));
}

/// Releases `job`'s place in the queue and tells its client `last`.
fn end(job: Job, last: Event) {
    let Job {
        events, _permit, ..
    } = job;
    drop(_permit);
    let _ = events.send(last);
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormo_engine::late_liar::LateLiar;
    use stormo_engine::sampling::SamplingParams;
    use stormo_text::session::GenerateOptions;

    fn tiny() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/gptoss-tiny-mxfp4")
    }

    /// What a client of a request saw: its tokens, and how it ended.
    type Seen = (Vec<TokenId>, Result<Generation, String>);

    /// Runs `jobs` (prompt, sampling, max new tokens) through an engine over `model` with
    /// `parallel` slots, all submitted at once; what each client saw.
    fn serve(
        model: Model,
        parallel: usize,
        jobs: &[(Vec<TokenId>, SamplingParams, usize)],
    ) -> Vec<Seen> {
        let metrics = Arc::new(Metrics::new(Arc::new(|| None), false));
        let engine = Engine::new(Arc::new(model), 64, parallel, metrics.clone(), None).unwrap();
        let pending = Arc::new(std::sync::atomic::AtomicUsize::new(jobs.len()));
        let (tx, rx) = std::sync::mpsc::channel();
        let mut clients = Vec::new();
        for (prompt, sampling, n) in jobs {
            let (events, seen) = tokio::sync::mpsc::unbounded_channel();
            let job = Job {
                prompt: prompt.clone(),
                opts: GenerateOptions {
                    max_new_tokens: *n,
                    stop: Vec::new(),
                    sampling: *sampling,
                },
                logprobs: None,
                events,
                _permit: super::super::Permit(pending.clone(), metrics.clone()),
            };
            tx.send(JobBox(job)).unwrap();
            clients.push(seen);
        }
        drop(tx);
        engine.run(rx);
        clients
            .into_iter()
            .map(|mut seen| {
                let mut ids = Vec::new();
                loop {
                    match seen.try_recv().expect("the request ended") {
                        Event::Token(t, _) => ids.push(t),
                        Event::Cached(_) => {}
                        Event::Done(g) => return (ids, Ok(g)),
                        Event::Failed(e) | Event::Unavailable(e) => return (ids, Err(e)),
                    }
                }
            })
            .collect()
    }

    /// With the experts run by a peer that lies about one expert and whose spot-checks end
    /// two steps late, batched requests (greedy and sampled, two and three at once, the lie
    /// starting in a prompt or in a decoded token) are made again from the lying step: every
    /// client sees exactly the tokens of a server without the liar, never a wrong one, and the
    /// ids it was told at the end. With the check never reported, the tokens differ (the test
    /// can fail).
    #[test]
    fn a_lie_found_late_is_made_again_and_clients_see_only_checked_tokens() {
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: 3,
        };
        let prompt = |k: u32, n: u32| (0..n).map(|i| (i * 37 + 5 * k) % 1000).collect::<Vec<_>>();
        let jobs = vec![
            (prompt(1, 9), SamplingParams::default(), 8),
            (prompt(2, 5), sampled, 10),
            (prompt(3, 12), SamplingParams::default(), 6),
        ];
        let load = || Model::load(&tiny(), &stormo_engine::LoadOptions::default()).unwrap();
        for parallel in [2, 3] {
            let want = serve(load(), parallel, &jobs);
            for (ids, end) in &want {
                assert_eq!(&end.as_ref().unwrap().ids, ids);
            }
            // A call in the first step (a prompt), and one well into the decoding.
            for from in [0, 40] {
                let liar = Arc::new(LateLiar::new(&tiny(), from, 2, true).unwrap());
                let got = serve(load().with_executor(liar.clone()), parallel, &jobs);
                assert!(liar.caught(), "parallel {parallel}, lie from call {from}");
                for (k, ((ids, end), (want_ids, _))) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        ids, want_ids,
                        "request {k}, parallel {parallel}, from {from}"
                    );
                    assert_eq!(&end.as_ref().unwrap().ids, want_ids);
                }
            }
            // The control: the same lie never reported changes what the clients see.
            let silent = Arc::new(LateLiar::new(&tiny(), 0, 2, false).unwrap());
            let got = serve(load().with_executor(silent), parallel, &jobs);
            assert_ne!(
                got.iter().map(|g| &g.0).collect::<Vec<_>>(),
                want.iter().map(|g| &g.0).collect::<Vec<_>>()
            );
        }
    }

    /// Sampled requests (temperature, top-k, top-p, penalties, several seeds; greedy ones
    /// beside them) get through a model's screened head, one at a time and batched, the tokens
    /// they get from the whole head.
    #[test]
    fn sampled_requests_through_the_screened_head_get_the_whole_heads_tokens() {
        let case = |temperature, top_k, top_p, repetition_penalty, seed| SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            seed,
        };
        let cases = [
            case(0.7, 0, 1.0, 1.0, 1),
            case(0.7, 0, 1.0, 1.0, 2),
            case(1.0, 40, 1.0, 1.0, 3),
            case(0.8, 0, 0.9, 1.0, 4),
            case(0.6, 20, 0.95, 1.1, 5),
            case(0.0, 0, 1.0, 1.2, 6),
            SamplingParams::default(),
        ];
        let jobs: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(k, &s)| {
                let k = k as u32;
                let prompt = (0..3 + 4 * k).map(|i| (i * 37 + 11 * k) % 1000).collect();
                (prompt, s, 8)
            })
            .collect();
        let load = |screened_head| {
            let opts = stormo_engine::LoadOptions {
                screened_head,
                ..stormo_engine::LoadOptions::default()
            };
            Model::load(&tiny(), &opts).unwrap()
        };
        let want = serve(load(false), 1, &jobs);
        for parallel in [1, 3] {
            let got = serve(load(true), parallel, &jobs);
            for (k, ((ids, end), (want_ids, _))) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    ids, want_ids,
                    "request {k} ({:?}), parallel {parallel}",
                    cases[k]
                );
                assert_eq!(&end.as_ref().unwrap().ids, want_ids);
            }
        }
    }

    /// A request waiting in the queue whose client hangs up leaves it at once, with no engine
    /// step to notice it: its place is given back (the count the HTTP side admits against
    /// drops) and the live requests keep theirs, in order. A request taken from the queue
    /// is watched no more (its watcher's copy of the client's sender is dropped).
    #[test]
    fn a_waiting_request_whose_client_hung_up_leaves_the_queue_at_once() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let metrics = Arc::new(Metrics::new(Arc::new(|| None), false));
        let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let queue = Arc::new(Queue::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let filler = {
            let (queue, handle) = (queue.clone(), rt.handle().clone());
            std::thread::spawn(move || queue.fill(rx, &handle))
        };
        let mut clients = Vec::new();
        for n in 1..=3u32 {
            pending.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let (events, seen) = tokio::sync::mpsc::unbounded_channel();
            let job = Job {
                prompt: vec![n],
                opts: GenerateOptions {
                    max_new_tokens: 1,
                    stop: Vec::new(),
                    sampling: SamplingParams::default(),
                },
                logprobs: None,
                events,
                _permit: super::super::Permit(pending.clone(), metrics.clone()),
            };
            tx.send(JobBox(job)).unwrap();
            clients.push(Some(seen));
        }
        let waited = |what: &str, done: &dyn Fn() -> bool| {
            let t0 = Instant::now();
            while !done() {
                assert!(t0.elapsed().as_secs() < 5, "{what}");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            t0.elapsed()
        };
        waited("three requests queue", &|| queue.lock().jobs.len() == 3);
        // The second client hangs up.
        clients[1] = None;
        let took = waited("the request leaves the queue", &|| {
            pending.load(std::sync::atomic::Ordering::Acquire) == 2
        });
        assert!(took.as_millis() < 1000, "{took:?}");
        let ids: Vec<u32> = queue.lock().jobs.iter().map(|e| e.job.prompt[0]).collect();
        assert_eq!(ids, [1, 3]);
        // The engine takes one: it is watched no more; the other still is.
        let mut taken = Vec::new();
        assert!(queue.take(1, false, &mut taken));
        assert_eq!(taken[0].prompt, [1]);
        let sender = taken[0].events.clone();
        waited("the taken request's watcher ends", &|| {
            sender.strong_count() == 2
        });
        drop((taken, sender));
        // Closing the channel ends the filler; the queue closes once the last request left.
        drop(tx);
        filler.join().unwrap();
        clients[2] = None;
        waited("the last request leaves", &|| {
            pending.load(std::sync::atomic::Ordering::Acquire) == 0
        });
        assert!(!queue.take(1, true, &mut Vec::new()), "closed and empty");
    }

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
