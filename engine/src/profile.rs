//! Where a forward pass's time goes: wall-clock time per phase, summed over every layer of
//! every forward pass while profiling is on (it is off unless a caller turns it on, as
//! `stormo bench` does around its decode).
//!
//! Process-wide counters rather than a value threaded through the forward pass: the phases
//! sit deep in the model's steps, and a benchmark runs one forward at a time. Off, a span
//! costs one relaxed atomic load; on, two clock reads and one atomic add (about 200 spans a
//! decoded token at gpt-oss-20b geometry: microseconds against a token's tens of
//! milliseconds). Never changes a result.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A phase of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The attention's input norm and its q, k and v projections (biases, QK-norm included).
    Qkv,
    /// RoPE, the key/value cache, and attention over the cache.
    Attend,
    /// The attention's output projection and the residual add.
    OProj,
    /// The MLP's input norm and the router (logits and routing).
    Router,
    /// Taking the routed experts from their tier (RAM hits, or the wait for the disk or the
    /// network).
    ExpertFetch,
    /// Computing the routed experts (or the dense MLP; waiting for experts delegated to a
    /// remote executor), and the residual add.
    Experts,
    /// The final norm and the output head (screened or whole), the embedding lookup.
    Head,
}

impl Phase {
    /// Every phase, in the order of the forward pass.
    pub const ALL: [Self; N] = [
        Self::Qkv,
        Self::Attend,
        Self::OProj,
        Self::Router,
        Self::ExpertFetch,
        Self::Experts,
        Self::Head,
    ];

    /// A short lower-case name (as `stormo bench --json` keys them).
    pub fn name(self) -> &'static str {
        match self {
            Self::Qkv => "qkv",
            Self::Attend => "attention",
            Self::OProj => "o_proj",
            Self::Router => "router",
            Self::ExpertFetch => "expert_fetch",
            Self::Experts => "experts",
            Self::Head => "head",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
/// How many phases there are.
pub const N: usize = 7;

static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Turns profiling on or off (off by default).
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Nanoseconds spent in each phase (in [`Phase::ALL`]'s order) since the last call, which
/// resets them. The experts' fetch is timed inside the experts' span; it is taken out of
/// [`Phase::Experts`] here, so the phases add up to the time spent in them.
pub fn take() -> [u64; N] {
    let mut t: [u64; N] = std::array::from_fn(|i| NANOS[i].swap(0, Ordering::Relaxed));
    let (fetch, experts) = (index(Phase::ExpertFetch), index(Phase::Experts));
    t[experts] = t[experts].saturating_sub(t[fetch]);
    t
}

/// `p`'s place in [`Phase::ALL`].
pub fn index(p: Phase) -> usize {
    Phase::ALL.iter().position(|&q| q == p).unwrap_or(0)
}

/// Times the rest of its scope as `phase` (when profiling is on).
#[must_use = "a span measures until it is dropped"]
pub(crate) struct Span(Option<(Phase, Instant)>);

/// Starts a [`Span`].
pub(crate) fn span(phase: Phase) -> Span {
    Span(ON.load(Ordering::Relaxed).then(|| (phase, Instant::now())))
}

impl Span {
    /// Ends this span and starts one of `phase` at the same instant.
    pub(crate) fn next(&mut self, phase: Phase) {
        if let Some((p, t0)) = self.0 {
            let now = Instant::now();
            add(p, now - t0);
            self.0 = Some((phase, now));
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((p, t0)) = self.0 {
            add(p, t0.elapsed());
        }
    }
}

fn add(p: Phase, d: std::time::Duration) {
    NANOS[index(p)].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_only_while_on_and_take_resets() {
        // One test owns the process-wide counters (no other test in this crate turns them on).
        let ms = std::time::Duration::from_millis;
        enable(false);
        let _ = take();
        drop(span(Phase::Experts));
        assert_eq!(take(), [0; N]);
        enable(true);
        {
            let mut s = span(Phase::Qkv);
            std::thread::sleep(ms(2));
            s.next(Phase::Experts);
            {
                let _fetch = span(Phase::ExpertFetch);
                std::thread::sleep(ms(20));
            }
            std::thread::sleep(ms(1));
        }
        enable(false);
        let t = take();
        assert!(t[index(Phase::Qkv)] >= 2_000_000, "{t:?}");
        assert!(t[index(Phase::ExpertFetch)] >= 20_000_000, "{t:?}");
        // The fetch nested in the experts' span is not counted twice.
        let experts = t[index(Phase::Experts)];
        assert!((1_000_000..20_000_000).contains(&experts), "{t:?}");
        for p in [Phase::Attend, Phase::OProj, Phase::Router, Phase::Head] {
            assert_eq!(t[index(p)], 0, "{p:?}: {t:?}");
        }
        assert_eq!(take(), [0; N]);
    }
}
