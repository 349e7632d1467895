//! The timed runs of `stormo bench`: the node and model they time ([`Rig`]), warming them,
//! the prefills, the greedy decode (the probes sampled between its tokens, the `--pair-*`
//! settings alternated) and the sampled decode after it.
//!
//! Owns the order of the measurements and the engine's process-wide settings a paired run
//! changes (each is put back when its run ends). Not the bounds they are judged against
//! (`ceilings`), nor the report (`report`).

use std::sync::Arc;
use std::time::Instant;

use stormo_engine::generate::{argmax, DecodePair};
use stormo_engine::profile;
use stormo_engine::tiers::ExpertStats;
use stormo_engine::{Logits, Model, ModelFiles, ScreenStats, Session};
use stormo_node::config::{LocalExperts, NodeConfig, PeersConfig};
use stormo_node::experts::Experts;
use stormo_node::node::{Host, Node};

use super::ceilings::Ceilings;
use super::{Args, Plan, Progress};

/// Tokens of the untimed forward pass `--warm` runs when every expert is resident.
const WARM_TOKENS: usize = 8;

/// Random prompt tokens below the vocabulary's size: the same seed gives the same prompts,
/// so the run from the local disk beside peers sees the same ones.
#[derive(Debug)]
struct Prompts {
    /// The splitmix64 state.
    state: u64,
    vocab: u64,
}

impl Prompts {
    fn new(seed: u64, vocab: u64) -> Self {
        Self { state: seed, vocab }
    }

    fn next(&mut self) -> u64 {
        // splitmix64
        self.state = self.state.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// A prompt of `n` tokens.
    fn prompt(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % self.vocab) as u32).collect()
    }
}

/// A node started for the run and the model loaded on it. The fields drop in order: the
/// model, then the experts, then the node.
#[derive(Debug)]
pub(super) struct Rig {
    pub(super) model: Model,
    pub(super) experts: Arc<Experts>,
    pub(super) node: Node,
    prompts: Prompts,
}

/// One timed prefill.
#[derive(Clone, Copy, Debug)]
pub(super) struct Prefill {
    /// Prompt tokens.
    pub(super) tokens: usize,
    /// Seconds it took.
    pub(super) secs: f64,
    /// Its rate in GFLOP/s (what a prompt token and the head cost, over the seconds).
    pub(super) gflop_s: f64,
    /// Nanoseconds in each phase ([`profile::Phase::ALL`]'s order).
    pub(super) phase_nanos: [u64; profile::N],
}

/// What the timed greedy decode measured.
#[derive(Debug)]
pub(super) struct Decoded {
    /// Seconds it took (the spot-checks still running at the end included; the probes'
    /// samples between tokens not).
    pub(super) secs: f64,
    /// The last token decoded: the next to run.
    pub(super) last: u32,
    /// Tokens per second through the screened head and the whole exact head
    /// (`--pair-full-head`).
    pub(super) full_head_pair: Option<[f64; 2]>,
    /// Seconds of the even and of the odd decoded tokens (the two settings when paired).
    pub(super) by_parity: [Vec<f64>; 2],
    /// Nanoseconds in each phase ([`profile::Phase::ALL`]'s order), the probes' samples outside.
    pub(super) phase_nanos: [u64; profile::N],
    /// Spot-checks of peers' answers that disagreed.
    pub(super) late_disagreements: u64,
    /// The AVX-512 kernels' default prefetch distance, bytes.
    pub(super) default_ahead: usize,
    /// The experts' statistics when the decode started.
    pub(super) experts_before: Option<ExpertStats>,
    /// How the head chose the decoded tokens.
    pub(super) screen: ScreenStats,
}

impl Rig {
    /// Starts a node on `a`'s model (`files`, opened from `a.model`) with its experts from
    /// `local` and `peers`, sessions of `plan.context` positions, and loads the model.
    pub(super) fn start(
        a: &Args,
        plan: &Plan,
        local: LocalExperts,
        peers: PeersConfig,
        files: ModelFiles,
    ) -> anyhow::Result<Self> {
        let cfg = NodeConfig {
            model: a.model.clone(),
            state_dir: a.experts.state_dir(),
            experts: a.experts.resolve()?,
            local,
            context: plan.context,
            peers,
            listen: None,
            swarm: None,
        };
        let node = Node::start_on(cfg, Host::new()?, files)?;
        let experts = node.experts().clone();
        let model = node.load_model(&plan.load)?;
        Ok(Self {
            model,
            experts,
            node,
            prompts: Prompts::new(a.seed, plan.vocab),
        })
    }

    /// Loads every expert when the RAM budget holds them all (so decode and prefill run
    /// resident), else runs one prompt of the longest prompt's length; then the dense weights
    /// are in memory.
    pub(super) fn warm(&mut self, plan: &Plan) -> anyhow::Result<()> {
        let (model, experts) = (&self.model, &self.experts);
        let sizes = &plan.sizes;
        let max_p = plan.max_p;
        let all: u64 = sizes.iter().flatten().sum();
        match &experts.tiered {
            Some(t) if t.budget() >= all => {
                let mut out = Vec::new();
                for (layer, l) in sizes.iter().enumerate() {
                    let ids: Vec<usize> = (0..l.len()).collect();
                    let batch = experts.provider.max_batch(layer).max(1);
                    for chunk in ids.chunks(batch) {
                        experts.provider.fetch(layer, chunk, &mut out)?;
                        out.clear();
                    }
                }
                // And a short forward pass, so the dense weights (mapped from the checkpoint)
                // are in memory too: otherwise the first prefill pays for reading them from
                // disk whenever the page cache has dropped them (after another program read a
                // large file, say), and measures the disk rather than the kernels.
                let n = WARM_TOKENS.min(max_p);
                let mut s = model.session(n)?;
                model.forward_greedy(&mut s, &self.prompts.prompt(n), None)?;
            }
            _ => {
                let mut s = model.session(max_p)?;
                model.forward_greedy(&mut s, &self.prompts.prompt(max_p), None)?;
            }
        }
        Ok(())
    }

    /// A prefill of a new prompt of `tokens` in a new session of `context` positions: the
    /// session, the next token and the seconds it took.
    pub(super) fn prefill_once(
        &mut self,
        context: usize,
        tokens: usize,
    ) -> anyhow::Result<(Session, u32, f64)> {
        let prompt = self.prompts.prompt(tokens);
        prefill_once(&self.model, context, &prompt)
    }

    /// The timed prefills, one per prompt length in a new session each, with where their time
    /// went phase by phase; the last one's session and next token, which the decode goes on
    /// from.
    pub(super) fn prefill(
        &mut self,
        a: &Args,
        plan: &Plan,
        say: Progress,
    ) -> anyhow::Result<(Vec<Prefill>, Session, u32)> {
        let mut prefills = Vec::new();
        let mut last = None;
        for &p in &a.prompt_tokens {
            say.say(format!("prefill of {p} tokens..."));
            profile::take();
            profile::enable(true);
            let r = prefill_once(&self.model, plan.context, &self.prompts.prompt(p));
            profile::enable(false);
            let (s, next, secs) = r?;
            prefills.push(Prefill {
                tokens: p,
                secs,
                gflop_s: (plan.costs.flops_tok * p as f64 + plan.costs.flops_head) / secs / 1e9,
                phase_nanos: profile::take(),
            });
            last = Some((s, next));
        }
        let (sess, next) = last.expect("at least one prompt");
        Ok((prefills, sess, next))
    }

    /// `--pair-completion`'s prefills: each prompt length prefilled four more times on a new
    /// prompt (fetch-then-compute, completion-driven, completion-driven, fetch-then-compute);
    /// per length its tokens, the mean seconds of each mode and whether all four chose the
    /// same next token.
    pub(super) fn paired_prefill(
        &mut self,
        a: &Args,
        plan: &Plan,
        say: Progress,
    ) -> anyhow::Result<Vec<(usize, [f64; 2], bool)>> {
        let completion_default = stormo_engine::moe::completion_driven();
        let mut runs = Vec::new();
        for &p in &a.prompt_tokens {
            say.say(format!(
                "prefill of {p} tokens, fetch-then-compute and completion-driven alternated..."
            ));
            let tokens = self.prompts.prompt(p);
            // seconds per mode (off, on) and the next tokens
            let mut secs = [0.0; 2];
            let mut next = Vec::new();
            for on in [false, true, true, false] {
                stormo_engine::moe::set_completion_driven(on);
                let (_, n, s) = prefill_once(&self.model, plan.context, &tokens)?;
                secs[on as usize] += s / 2.0;
                next.push(n);
            }
            let same = next.iter().all(|&n| n == next[0]);
            runs.push((p, secs, same));
        }
        stormo_engine::moe::set_completion_driven(completion_default);
        Ok(runs)
    }

    /// The timed greedy decode of `--decode-tokens` tokens after `tok` in `sess`: the memory
    /// and kernel probes of `ceilings` sampled between tokens (the host's memory bandwidth
    /// drifts with other tenants, so the bound is measured over the same minutes as the
    /// decode it judges), what a `--pair-*` switch names alternated token by token (and put
    /// back after), spot-checks of peers' answers settled within its time.
    pub(super) fn decode(
        &self,
        a: &Args,
        sess: &mut Session,
        mut tok: u32,
        ceilings: &mut Ceilings,
        say: Progress,
    ) -> anyhow::Result<Decoded> {
        let model = &self.model;
        let (probe, isa) = (&mut ceilings.probe, ceilings.isa);
        say.say(format!("decoding {} tokens...", a.decode_tokens));
        let experts_before = self.experts.stats();
        let screen_before = sess.screen_stats();
        let mut dsecs = 0.0;
        // Seconds and tokens decoded through the screen and through the whole head when paired.
        let mut paired = [(0.0, 0u32); 2];
        // Seconds of the even and of the odd decoded tokens (the two settings when paired).
        let mut by_parity: [Vec<f64>; 2] = Default::default();
        let default_ahead = stormo_engine::kernels::prefetch_ahead();
        let default_tasks = stormo_engine::kernels::tasks_per_thread();
        let completion_default = stormo_engine::moe::completion_driven();
        if a.pair_prefetch.is_some() && isa != stormo_engine::kernels::Isa::Avx512 {
            eprintln!(
                "warning: the {isa} kernels do not use the prefetch distance; both sides of --pair-prefetch run the same kernels"
            );
        }
        // Where the decoded tokens' time goes, phase by phase (the probe's samples between
        // tokens are outside the spans).
        profile::take();
        profile::enable(true);
        // Spot-checks of peers' answers in the background, as `run` makes them (unless
        // --spot-check-inline): each token is a step, and the checks still running at the end
        // are waited for within the decode's time. A check that disagrees is counted, not
        // rolled back: the bench's tokens are never shown.
        let deferred = model
            .executor()
            .filter(|x| x.defer_checks(true))
            .map(|x| &**x);
        let mut late_disagreements = 0u64;
        // Whether a check was found to disagree.
        let mut settle = |wait: bool| match deferred.map(|x| (x, x.settle(wait))) {
            Some((x, stormo_engine::moe::Settled::Failed(step))) => {
                late_disagreements += 1;
                x.forget(step);
                true
            }
            _ => false,
        };
        for i in 0..a.decode_tokens {
            if let Some(x) = deferred {
                x.begin_step();
            }
            if let Some(d) = a.pair_prefetch {
                stormo_engine::kernels::set_prefetch_ahead(d[i % 2]);
            }
            if let Some(n) = a.pair_tasks {
                stormo_engine::kernels::set_tasks_per_thread(n[i % 2]);
            }
            if a.pair_completion {
                stormo_engine::moe::set_completion_driven(i % 2 == 1);
            }
            let t = Instant::now();
            let whole = a.pair_full_head && i % 2 == 1;
            tok = if whole {
                argmax(model.forward(sess, &[tok], Logits::Last, None)?)
            } else {
                model.forward_greedy(sess, &[tok], None)?.token
            };
            settle(false);
            let secs = t.elapsed().as_secs_f64();
            dsecs += secs;
            paired[whole as usize].0 += secs;
            paired[whole as usize].1 += 1;
            by_parity[i % 2].push(secs);
            probe.sample();
            probe.sample_kernels();
        }
        let t = Instant::now();
        // A disagreement ends a wait (and forgets its step): wait again for the rest.
        while settle(true) {}
        dsecs += t.elapsed().as_secs_f64();
        if let Some(x) = deferred {
            x.defer_checks(false);
        }
        profile::enable(false);
        let phase_nanos = profile::take();
        stormo_engine::kernels::set_prefetch_ahead(default_ahead);
        stormo_engine::kernels::set_tasks_per_thread(default_tasks);
        stormo_engine::moe::set_completion_driven(completion_default);
        Ok(Decoded {
            secs: dsecs,
            last: tok,
            full_head_pair: a.pair_full_head.then(|| paired.map(|(s, n)| n as f64 / s)),
            by_parity,
            phase_nanos,
            late_disagreements,
            default_ahead,
            experts_before,
            screen: sess.screen_stats().since(screen_before),
        })
    }

    /// What users see: chat and the API sample (temperature 0.7 here), measured alternated
    /// with greedy tokens so both see the same machine: `tokens` more after `tok` in `sess`.
    pub(super) fn decode_sampled(
        &self,
        sess: &mut Session,
        tok: u32,
        tokens: usize,
        say: Progress,
    ) -> anyhow::Result<DecodePair> {
        say.say("decoding sampled (temperature 0.7) and greedy tokens alternated...");
        Ok(stormo_engine::generate::decode_greedy_and_sampled(
            &self.model,
            sess,
            tok,
            tokens,
            stormo_engine::sampling::SamplingParams {
                temperature: 0.7,
                ..Default::default()
            },
        )?)
    }

    /// Ends the run: the experts' `--json` object and table with `sess`'s predictions, the
    /// usage counts saved (hot-store), then the session, model and node dropped, so their
    /// memory is free before anything else runs.
    pub(super) fn finish(self, sess: Session) -> (serde_json::Value, String) {
        let json = self.node.json(sess.prediction());
        let table = self.node.table(sess.prediction());
        self.node.finish_run();
        drop(sess);
        (json, table)
    }
}

/// A prefill of `tokens` in a new session of `context` positions: the session, the next
/// token and the seconds it took.
fn prefill_once(
    model: &Model,
    context: usize,
    tokens: &[u32],
) -> anyhow::Result<(Session, u32, f64)> {
    let mut s = model.session(context)?;
    let t = Instant::now();
    let next = model.forward_greedy(&mut s, tokens, None)?.token;
    Ok((s, next, t.elapsed().as_secs_f64()))
}
