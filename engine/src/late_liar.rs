//! Test support, not part of the API: an executor that lies and whose spot-checks end late,
//! for the tests of deferred checks (`engine/tests/deferred_checks.rs` and the node's chat).

use std::path::Path;
use std::sync::Mutex;

use crate::moe::{
    Demand, ExecFailed, Executed, ExpertExecutor, ExpertProvider, ExpertSchema, MappedExperts,
    Settled, Ticket, Verdict,
};
use crate::ModelFiles;

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
pub struct LateLiar {
    experts: MappedExperts,
    schemas: Vec<Option<ExpertSchema>>,
    from: usize,
    lag: u64,
    /// Report failures (false: the control run, where the lie is never found).
    report: bool,
    s: Mutex<State>,
}

impl LateLiar {
    /// The liar over the checkpoint in `dir`.
    pub fn new(dir: &Path, from: usize, lag: u64, report: bool) -> crate::Result<Self> {
        let files = ModelFiles::open(dir)?;
        Ok(Self {
            experts: files.mapped_experts()?,
            schemas: files.layout.schemas.clone(),
            from,
            lag,
            report,
            s: Mutex::default(),
        })
    }

    /// Whether a check found the lie.
    pub fn caught(&self) -> bool {
        self.s.lock().expect("liar lock").caught
    }

    /// The calls made before each step began.
    pub fn calls_before(&self) -> Vec<usize> {
        self.s.lock().expect("liar lock").calls_before.clone()
    }
}

impl ExpertExecutor for LateLiar {
    fn choose(&self, _layer: usize, _demand: &[Demand], delegate: &mut [bool]) {
        delegate.fill(true);
    }

    fn submit(&self, layer: usize, expert: usize, inputs: &[f32]) -> Ticket {
        let schema = self.schemas[layer].as_ref().expect("the layer has experts");
        let mut data = Vec::new();
        self.experts
            .fetch(layer, &[expert], &mut data)
            .expect("the checkpoint holds the expert");
        let mut rows = schema.compute(&data[0], inputs);
        let mut s = self.s.lock().expect("liar lock");
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
        let s = self.s.lock().expect("liar lock");
        Ok(Executed {
            rows: s.answers[ticket.0 as usize].clone(),
            check: false,
        })
    }

    fn report(&self, _ticket: Ticket, _verdict: Verdict) {}

    fn defer_checks(&self, on: bool) -> bool {
        let mut s = self.s.lock().expect("liar lock");
        s.deferring = on;
        s.checks.clear();
        on
    }

    fn begin_step(&self) -> u64 {
        let mut s = self.s.lock().expect("liar lock");
        s.step += 1;
        s.answers.clear();
        let calls = s.calls;
        s.calls_before.push(calls);
        s.step
    }

    fn settle(&self, wait: bool) -> Settled {
        let mut s = self.s.lock().expect("liar lock");
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
        self.s
            .lock()
            .expect("liar lock")
            .checks
            .retain(|c| c.0 < step);
    }
}
