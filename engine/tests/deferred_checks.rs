//! Deferred spot-checks end to end ([`ExpertExecutor::defer_checks`]): an executor that
//! computes every expert of each oracle fixture, but wrong for one expert from some call on,
//! and whose checks end a few steps after the answers they check. The generation uses the
//! wrong answers at once, finds out later, rolls back and makes the tokens again: the ids
//! handed on (and returned) are the reference ids, each handed on once, greedy and sampled,
//! whether the lie starts in the prefill or in a decoded token. Without the rollback the same
//! lie changes the ids, so the test can fail.
//!
//! This file holds this one test: it reads the process-wide rollback counter.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use stormo_engine::generate::{greedy, rollbacks, sampled, Timings};
use stormo_engine::moe::{
    expert_forward, Demand, ExecFailed, Executed, ExpertExecutor, ExpertProvider, ExpertSchema,
    ExpertScratch, MappedExperts, Settled, Ticket, Verdict,
};
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{LoadOptions, Model, ModelFiles};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

/// What the executor has done and knows.
#[derive(Debug, Default)]
struct State {
    /// Calls so far.
    calls: usize,
    /// The expert it lies about, once chosen (the expert of call `from`).
    target: Option<(usize, usize)>,
    /// Caught: it answers right from then on (as a banned peer's experts are computed here).
    caught: bool,
    /// The current step, and the steps with checks: (step, lied).
    step: u64,
    checks: Vec<(u64, bool)>,
    /// Answers waiting to be collected.
    answers: Vec<Vec<f32>>,
    deferring: bool,
    /// The calls made before each step.
    calls_before: Vec<usize>,
}

/// Computes every expert with the engine's kernels; from call `from` on, the first expert it
/// is asked then is answered wrong in every value (3 - 4x) until a check catches it. Every step's
/// answers are checked, each check ending `lag` steps after its step began.
#[derive(Debug)]
struct Liar {
    experts: MappedExperts,
    schemas: Vec<Option<ExpertSchema>>,
    from: usize,
    lag: u64,
    /// Report failures (false: the control run, where the lie is never found).
    report: bool,
    s: Mutex<State>,
}

impl Liar {
    fn new(name: &str, from: usize, lag: u64, report: bool) -> Self {
        let files = ModelFiles::open(&fixture(name)).unwrap();
        Self {
            experts: files.mapped_experts().unwrap(),
            schemas: files.layout.schemas.clone(),
            from,
            lag,
            report,
            s: Mutex::default(),
        }
    }
}

impl ExpertExecutor for Liar {
    fn choose(&self, _layer: usize, _demand: &[Demand], delegate: &mut [bool]) {
        delegate.fill(true);
    }

    fn submit(&self, layer: usize, expert: usize, inputs: &[f32]) -> Ticket {
        let schema = self.schemas[layer].as_ref().unwrap();
        let mut data = Vec::new();
        self.experts.fetch(layer, &[expert], &mut data).unwrap();
        let mut scratch = ExpertScratch::default();
        expert_forward(
            &schema.view(&data[0]),
            inputs,
            schema.hidden,
            schema.intermediate,
            &mut scratch,
        );
        let mut rows = scratch.output().to_vec();
        let mut s = self.s.lock().unwrap();
        if s.calls == self.from && s.target.is_none() {
            s.target = Some((layer, expert));
        }
        s.calls += 1;
        let lie = !s.caught && s.target == Some((layer, expert));
        if lie {
            rows.iter_mut().for_each(|x| *x = 3.0 - 4.0 * *x);
        }
        if s.deferring {
            let step = s.step;
            match s.checks.iter_mut().find(|c| c.0 == step) {
                Some(c) => c.1 |= lie,
                None => s.checks.push((step, lie)),
            }
        }
        s.answers.push(rows);
        Ticket(s.answers.len() as u64 - 1)
    }

    fn collect(&self, ticket: Ticket) -> Result<Executed, ExecFailed> {
        let s = self.s.lock().unwrap();
        Ok(Executed {
            rows: s.answers[ticket.0 as usize].clone(),
            check: false,
        })
    }

    fn report(&self, _ticket: Ticket, _verdict: Verdict) {}

    fn defer_checks(&self, on: bool) -> bool {
        let mut s = self.s.lock().unwrap();
        s.deferring = on;
        s.checks.clear();
        on
    }

    fn begin_step(&self) -> u64 {
        let mut s = self.s.lock().unwrap();
        s.step += 1;
        s.answers.clear();
        let calls = s.calls;
        s.calls_before.push(calls);
        s.step
    }

    fn settle(&self, wait: bool) -> Settled {
        let mut s = self.s.lock().unwrap();
        let now = s.step;
        // A check has ended `lag` steps after its step, or at once when waited for.
        let ended = |step: u64| wait || step + self.lag <= now;
        if let Some(&(step, _)) = s
            .checks
            .iter()
            .find(|&&(step, lied)| lied && ended(step) && self.report)
        {
            s.caught = true;
            return Settled::Failed(step);
        }
        s.checks.retain(|&(step, _)| !ended(step));
        match s.checks.first() {
            None => Settled::Clear,
            Some(&(step, _)) => Settled::Pending(step),
        }
    }

    fn forget(&self, step: u64) {
        self.s.lock().unwrap().checks.retain(|c| c.0 < step);
    }
}

/// Greedy and sampled ids of `model` after `prompt`, and the ids handed to `on_token`.
fn generate(model: &Model, prompt: &[u32], sampling: bool) -> (Vec<u32>, Vec<u32>) {
    let mut sess = model.session(64).unwrap();
    let mut handed = Vec::new();
    let mut t = Timings::default();
    let ids = if sampling {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: 7,
        })
        .unwrap();
        sampled(
            model,
            &mut sess,
            prompt,
            12,
            &[],
            &mut sampler,
            |id, l| {
                assert!(!l.is_empty(), "the logits that chose {id}");
                handed.push(id)
            },
            &mut t,
        )
    } else {
        greedy(
            model,
            &mut sess,
            prompt,
            12,
            &[],
            |id, _| handed.push(id),
            &mut t,
        )
    };
    (ids.unwrap(), handed)
}

#[test]
fn a_deferred_check_that_disagrees_rolls_back_to_the_reference_ids() {
    for name in ["gptoss-tiny-mxfp4", "qwen3moe-tiny"] {
        let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 1000).collect();
        let local = Model::load(&fixture(name), &LoadOptions::default()).unwrap();
        for sampling in [false, true] {
            let (want, handed) = generate(&local, &prompt, sampling);
            assert_eq!(want, handed);
            // An honest run: the calls before the third step (the second decoded token).
            let honest = Arc::new(Liar::new(name, usize::MAX, 1, true));
            let model = Model::load(&fixture(name), &LoadOptions::default())
                .unwrap()
                .with_executor(honest.clone());
            assert_eq!(
                generate(&model, &prompt, sampling).0,
                want,
                "{name}: honest"
            );
            let third = honest.s.lock().unwrap().calls_before[2];
            // The lie from the prefill's first call, and from a decoded token's.
            for (from, lag) in [(0, 2), (0, 1), (third + 1, 3)] {
                let liar = Arc::new(Liar::new(name, from, lag, true));
                let model = Model::load(&fixture(name), &LoadOptions::default())
                    .unwrap()
                    .with_executor(liar.clone());
                let before = rollbacks();
                let (ids, handed) = generate(&model, &prompt, sampling);
                let what = format!("{name}, sampling {sampling}, lying from call {from}");
                assert_eq!(ids, want, "{what}");
                assert_eq!(handed, want, "{what}: each token handed on once, checked");
                assert!(liar.s.lock().unwrap().caught, "{what}: the lie was found");
                assert!(rollbacks() > before, "{what}: a step was made again");

                // The control: the same lie, never found, changes the ids.
                let blind = Arc::new(Liar::new(name, from, lag, false));
                let model = Model::load(&fixture(name), &LoadOptions::default())
                    .unwrap()
                    .with_executor(blind);
                let (ids, _) = generate(&model, &prompt, sampling);
                assert_ne!(ids, want, "{what}: the lie matters");
            }
        }
    }
}
