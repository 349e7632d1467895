//! The executor seam: an expert computed somewhere else (a peer holding its weights) on the
//! rows routed to it, with the engine's output unchanged bit for bit.
//!
//! [`moe_block`](super::moe_block) routes a block, then for the union of the layer's experts
//! asks an [`ExpertExecutor`] which of them to delegate ([`ExpertExecutor::choose`]). Each
//! delegated expert's input rows (`[n, H]`, the normalised hidden states of the positions
//! routed to it) are handed over with [`ExpertExecutor::submit`] before the local experts are
//! fetched and computed, so remote calls run while the engine works; the engine then blocks in
//! [`ExpertExecutor::collect`] for each answer: the expert's output rows `expert(xs)`, before
//! the routing weight (exactly what [`ExpertScratch::output`](super::ExpertScratch::output)
//! holds for those rows).
//!
//! Exactness does not depend on the executor:
//! - a failed call (an error, a time-out, an answer of the wrong length) is made up for by
//!   fetching and computing that expert locally through the provider;
//! - an answer marked [`Executed::check`] (the executor's spot-check choice) is compared bit
//!   for bit with the expert computed locally; the verdict goes back through
//!   [`ExpertExecutor::report`] and the local rows are used whatever it is;
//! - every position still sums its k slot outputs in slot order, so the output bits are those
//!   of a block computed wholly locally as long as the executor computes each row as the
//!   engine does (the kernels give the same bits for a row whatever rows share its call).
//!
//! Deferred checks: an executor may also check answers without holding the engine back
//! ([`ExpertExecutor::defer_checks`]). A generation loop that can roll back
//! ([`crate::generate`]) turns this on: the answers drawn for a spot-check are then used at
//! once like the others and checked in the background, each step of the loop is named with
//! [`ExpertExecutor::begin_step`], and [`ExpertExecutor::settle`] tells the loop which steps
//! are checked. A step whose check disagreed is rolled back (the session truncated to its
//! start, its token and every later one made again) and the loop forgets it
//! ([`ExpertExecutor::forget`]); a token leaves the loop only once its step and every step
//! before it are checked. The tokens are those of checks made inline.
//!
//! Non-goals: the engine knows no network, no peers and no policy: which experts to delegate,
//! to whom, and which answers to check are the executor's business (the node implements it).
//! A model run with int8-quantized expert inputs (`--int8-experts`) never delegates: a peer
//! computes the exact f32 path.

use std::fmt;

/// One expert of a block's union and how many of the block's positions were routed to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// The expert's index in its layer.
    pub expert: usize,
    /// Positions routed to it in this block (rows its call would carry).
    pub positions: usize,
}

/// A submitted call, named by the executor that took it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// A delegated expert's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Executed {
    /// `[n, H]` output rows, in the order of the submitted input rows.
    pub rows: Vec<f32>,
    /// Whether the engine should compute the expert locally too and compare (a spot-check);
    /// the verdict comes back through [`ExpertExecutor::report`].
    pub check: bool,
}

/// Why a delegated call gave no answer. The engine computes the expert locally instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecFailed {
    /// No executor could be reached or none holds the expert now.
    #[error("no executor available: {0}")]
    Unavailable(String),
    /// Every executor asked was busy.
    #[error("executors busy")]
    Busy,
    /// The answer did not come in time.
    #[error("timed out")]
    TimedOut,
    /// The executor answered with an error or broke the protocol.
    #[error("executor failed: {0}")]
    Failed(String),
}

/// What the engine found about a collected answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A spot-check: the answer equals the local computation bit for bit.
    Agreed,
    /// A spot-check: the answer differs from the local computation (the executor computes
    /// wrong, or with other kernels); the local rows were used.
    Disagreed,
    /// The answer had the wrong number of values for the rows sent; the expert was computed
    /// locally.
    Malformed,
}

/// Runs experts somewhere else. Implemented by the node over its peers; the engine calls it
/// from its own threads (`submit` must not block on the call; `collect` may).
pub trait ExpertExecutor: Send + Sync + fmt::Debug {
    /// For each of `demand` (the block's union of `layer`'s experts), whether to delegate it:
    /// `delegate[i]` is false on entry and is set true for each expert to delegate.
    fn choose(&self, layer: usize, demand: &[Demand], delegate: &mut [bool]);

    /// Starts computing `expert` of `layer` on `inputs` (`[n, H]` rows, row-major); the
    /// answer is collected with the ticket returned. A call that cannot start is reported by
    /// `collect`.
    fn submit(&self, layer: usize, expert: usize, inputs: &[f32]) -> Ticket;

    /// Waits for the answer to `ticket` (each ticket is collected once).
    fn collect(&self, ticket: Ticket) -> Result<Executed, ExecFailed>;

    /// What the engine found about the answer to `ticket`: a spot-check's verdict, or a
    /// malformed answer. Answers used without a check are not reported.
    fn report(&self, ticket: Ticket, verdict: Verdict);

    /// Asks for spot-checks that do not hold the engine back (see the module docs): with
    /// `on`, an answer drawn for a check is collected with [`Executed::check`] false and
    /// checked in the background, its verdict read through [`settle`](Self::settle). Only a
    /// caller that rolls back what a disagreeing step made may ask; `false` turns it off.
    /// Returns whether checks are deferred from now on. Default: never.
    fn defer_checks(&self, on: bool) -> bool {
        let _ = on;
        false
    }

    /// A step of a generation begins: answers collected from now until the next call belong
    /// to it. Returns the step's id; ids grow.
    fn begin_step(&self) -> u64 {
        0
    }

    /// The deferred checks of the steps not forgotten: with `wait` (the generation's end),
    /// blocks until every step is settled (an executor that holds steps back for another
    /// reason, such as answers not yet confirmed by a later check of their peer, settles them
    /// now) or one has failed. Default: [`Settled::Clear`].
    fn settle(&self, wait: bool) -> Settled {
        let _ = wait;
        Settled::Clear
    }

    /// The steps from `step` on were rolled back: their checks no longer count (they still
    /// end, and a disagreeing one still costs its peer the executor's trust).
    fn forget(&self, step: u64) {
        let _ = step;
    }
}

/// The deferred checks' state ([`ExpertExecutor::settle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Every step not forgotten is settled: its deferred checks agreed, or none was drawn.
    Clear,
    /// This step (the earliest not settled) waits on a check, or on a later check of a peer
    /// whose answer it used unchecked; every step before it is settled.
    Pending(u64),
    /// This step (the earliest such) used a wrong answer, or an unchecked answer of a peer
    /// since caught computing wrong: it, and every later one, must be made again. Checks of
    /// earlier steps may still be running.
    Failed(u64),
}
