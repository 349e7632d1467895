//! Remote expert execution's choice, sans-IO: for each expert of a block, fetch it (and
//! compute it here) or have a peer holding it compute it; which peer; which answers to
//! spot-check; which peers to stop asking.
//!
//! The choice weighs what each way moves over the link. Fetching moves the expert's bytes
//! (13.2 MB at gpt-oss-20b geometry) once, after which every use of it while it stays in the
//! RAM cache is free; executing moves the block's rows routed to it both ways
//! (`positions x hidden x 4` bytes each way: 11.5 KB per position at that geometry) on every
//! use, plus a round trip and the peer's queue. So in `auto`:
//! - an expert already in the RAM cache is computed here;
//! - otherwise the fetch's time (round trip + bytes / throughput) is shared among the uses
//!   expected while it would stay cached: `1 + heat x horizon`, where `heat` is how often the
//!   expert was routed in recent blocks of its layer (an exponentially weighted share) and
//!   `horizon` the blocks a fetched expert stays in the RAM cache: [`HORIZON`], or fewer when
//!   the budget holds less than that many blocks' experts ([`RemotePolicy::set_cache`]: at the
//!   smallest budget an expert is evicted before the next block, so its fetch serves one use);
//!   a hot expert, or a fast link, is fetched;
//! - the call's time is the round trip, the rows both ways over the throughput, and the
//!   service time of the calls already in flight at the peer (its measured call time less the
//!   round trip, each call measured as if it had been sent alone: [`alone`]); a prefill block
//!   with many positions moves many rows, so it tends to fetch.
//!   A measured call time fades with the time since the peer's last answer (half-life
//!   [`CALL_HALF_LIFE`]): calls measured slow while the link was full of fetches (a prefill)
//!   would otherwise keep every later call from being chosen, and so from being measured
//!   again, for the whole session;
//! - the cheaper way wins; among holders, the one with the cheapest call.
//!
//! `always` delegates whenever some holder can take the call; `never` never does. In every
//! mode a peer that answered `busy` is not asked for a back-off (doubling from
//! [`BUSY_PAUSE`]), one that failed for another (doubling from [`FAILURE_PAUSE`]), one whose
//! answer disagreed with a spot-check is not asked again this session, and no expert is
//! delegated when no holder is usable (the engine then fetches it as without remote
//! execution).
//!
//! Spot-checks: every call to a peer until its first answer, and a share `spot_check` of the
//! later ones (drawn from a seeded generator, so a test can replay it), is computed here as
//! well and compared bit for bit by the engine ([`stormo_engine::moe::remote`]).
//!
//! A peer is given at most [`MAX_IN_FLIGHT`] calls at once (a block's choices count the
//! calls chosen before them); beyond that the expert goes to another holder or is fetched.
//!
//! Nothing here reads a clock or touches a socket: the time is an argument (as in
//! [`super::policy`]), and the link's round trip and throughput are the network tier's
//! measurements, passed in. Non-goals: predicting future layers' routing (the heat is the
//! layer's own recent history), and sharing the link with concurrent fetches (each call is
//! judged alone).

use std::time::{Duration, Instant};

use super::policy;
use stormo_engine::moe::Verdict;

/// Throughput assumed for a link not yet measured (bytes per second): 100 Mbit/s.
pub const UNMEASURED_RATE: f64 = 12.5e6;
/// Round trip assumed for a link not yet measured.
pub const UNMEASURED_RTT: Duration = Duration::from_millis(5);
/// Blocks over which a fetched expert is expected to stay cached and be reused, at most (a
/// budget that holds fewer blocks' experts shortens it: [`RemotePolicy::set_cache`]).
pub const HORIZON: f64 = 16.0;
/// Weight of the newest block in an expert's heat.
const HEAT_ALPHA: f32 = 0.1;
/// Weight of the newest call in a peer's measured call time.
const CALL_ALPHA: f64 = 0.25;
/// How long after a peer's last answer its measured call time counts half: a slow answer
/// (a queue at the peer, rows behind a link full of fetches) says less of the peer the longer
/// ago it came, and a peer written off by it is asked again once it has faded.
pub const CALL_HALF_LIFE: Duration = Duration::from_secs(2);
/// The first pause after a `busy` answer, doubled after each further one.
pub const BUSY_PAUSE: Duration = Duration::from_millis(50);
/// The first pause after a failed call, doubled after each further one.
pub const FAILURE_PAUSE: Duration = Duration::from_millis(500);
/// The longest pause.
pub const MAX_PAUSE: Duration = Duration::from_secs(30);
/// Most calls in flight at one peer; a peer with this many is not chosen. A serving node
/// admits 8 calls of one peer at once by default (`--exec-per-peer`) and answers `busy`
/// beyond. A 24-token prefill block routes to 30-odd experts of a layer; with 4, a quarter
/// holder's experts beyond its 4th were fetched (13.2 MB each) and the `wan` swarm's prefill
/// ran about 1 tok/s, with 8 it runs 7-9. (8 was slower while spot-checks held the decoded
/// token back: more calls meant more checks in its way; docs/performance.md.)
pub const MAX_IN_FLIGHT: u32 = 8;

/// `--remote-exec`: whether experts may be computed by the peers holding them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RemoteExec {
    /// Per expert and block, the cheaper of fetching and executing remotely.
    #[default]
    Auto,
    /// Every expert a usable peer holds is executed remotely.
    Always,
    /// Experts are always fetched and computed here.
    Never,
}

impl std::str::FromStr for RemoteExec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "always" => Ok(Self::Always),
            "never" => Ok(Self::Never),
            _ => Err(format!("{s:?} is not one of auto, always, never")),
        }
    }
}

impl std::fmt::Display for RemoteExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Always => "always",
            Self::Never => "never",
        })
    }
}

/// `--verify-exec`: how a remote result is trusted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerifyExec {
    /// One holder computes; its results are spot-checked.
    #[default]
    Single,
    /// Two holders compute each call and their rows are compared bit for bit; a disagreement
    /// is settled here (the expert computed locally, the wrong holder dropped). Spot-checks
    /// apply on top. With one holder left, a call goes to it alone.
    Dual,
}

impl std::str::FromStr for VerifyExec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "single" => Ok(Self::Single),
            "dual" => Ok(Self::Dual),
            _ => Err(format!("{s:?} is not one of single, dual")),
        }
    }
}

impl std::fmt::Display for VerifyExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single => "single",
            Self::Dual => "dual",
        })
    }
}

/// The resolved remote-execution options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RemoteConfig {
    /// `--remote-exec`.
    pub mode: RemoteExec,
    /// `--spot-check`: the share of answers (beyond each peer's first) checked, in [0, 1].
    pub spot_check: f64,
    /// `--spot-check-inline`: a checked answer holds its step back until the check ends,
    /// also where the generation could roll back instead.
    pub inline: bool,
    /// `--verify-exec`.
    pub verify: VerifyExec,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            mode: RemoteExec::Auto,
            spot_check: 0.05,
            inline: false,
            verify: VerifyExec::Single,
        }
    }
}

/// A peer's link as the network tier measured it (`None`: not measured yet).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Link {
    /// Round trip.
    pub rtt: Option<Duration>,
    /// Throughput, bytes per second.
    pub rate: Option<f64>,
}

impl Link {
    /// The round trip, or [`UNMEASURED_RTT`] before one is measured.
    pub fn rtt(&self) -> Duration {
        self.rtt.unwrap_or(UNMEASURED_RTT)
    }

    fn rtt_s(&self) -> f64 {
        self.rtt().as_secs_f64()
    }

    fn rate(&self) -> f64 {
        self.rate.filter(|r| *r > 0.0).unwrap_or(UNMEASURED_RATE)
    }
}

/// A peer holding the expert, as a candidate executor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Holder {
    /// The peer (the network tier's index).
    pub peer: usize,
    /// Its link.
    pub link: Link,
}

/// One expert of a block, as the choice sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Want {
    /// Layer.
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// Positions routed to it in this block.
    pub positions: usize,
    /// Bytes of the expert (what a fetch moves).
    pub expert_bytes: u64,
    /// Already in the RAM cache.
    pub cached: bool,
}

/// The choice for one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Fetch it (from wherever the tiers find it) and compute it here.
    Fetch,
    /// Ask this peer to compute it.
    Execute {
        /// The peer.
        peer: usize,
    },
}

/// What the policy knows of one peer as an executor.
#[derive(Clone, Debug, Default)]
struct Executor {
    /// Answers received (every call before the first answer is checked).
    answers: u64,
    /// Why it is not asked again this session.
    banned: Option<String>,
    /// Not asked before this.
    paused_until: Option<Instant>,
    /// `busy` answers since its last answer.
    busy_streak: u32,
    /// Failures since its last answer.
    failure_streak: u32,
    /// Calls in flight.
    in_flight: u32,
    /// Measured seconds per call (EWMA), as of `call_at`.
    call_s: Option<f64>,
    /// When `call_s` was last updated.
    call_at: Option<Instant>,
}

impl Executor {
    /// The measured seconds per call at `now`: faded by half every [`CALL_HALF_LIFE`] since
    /// the last answer.
    fn call_s(&self, now: Instant) -> Option<f64> {
        let c = self.call_s?;
        let age = self
            .call_at
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        Some(c * 0.5f64.powf(age.as_secs_f64() / CALL_HALF_LIFE.as_secs_f64()))
    }
}

/// Counters of remote execution, as `run --json` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// Calls answered with rows.
    pub calls: u64,
    /// Bytes of rows sent and received.
    pub bytes: u64,
    /// Calls that gave no usable rows (busy, failed, timed out, malformed).
    pub failures: u64,
    /// Answers spot-checked.
    pub spot_checks: u64,
    /// Spot-checks that disagreed.
    pub spot_check_failures: u64,
    /// Spot-checks made in the background (of `spot_checks`, once they end).
    pub deferred_checks: u64,
    /// Calls answered by two holders whose rows were compared (`--verify-exec dual`).
    pub dual_calls: u64,
    /// Of those, the ones whose two answers differed (settled here).
    pub dual_disagreements: u64,
}

/// The choice's state: each expert's heat, each peer's standing, the spot-check draw.
#[derive(Debug)]
pub struct RemotePolicy {
    cfg: RemoteConfig,
    /// `[layer][expert]` heat: the weighted share of recent blocks that routed to it.
    heat: Vec<Vec<f32>>,
    executors: Vec<Executor>,
    /// xorshift state of the spot-check draw.
    draw: u64,
    stats: RemoteStats,
    /// Blocks a fetched expert is expected to stay cached: [`HORIZON`] at most.
    horizon: f64,
}

impl RemotePolicy {
    /// A policy for a model of `experts[layer]` experts per layer, drawing spot-checks from
    /// `seed`.
    pub fn new(cfg: RemoteConfig, experts: &[usize], seed: u64) -> Self {
        Self {
            cfg,
            heat: experts.iter().map(|&n| vec![0.0; n]).collect(),
            executors: Vec::new(),
            draw: seed | 1,
            stats: RemoteStats::default(),
            horizon: HORIZON,
        }
    }

    /// The RAM cache holds `budget` bytes of experts and one block (a decoded token) routes
    /// `per_block` bytes of experts over all layers: a fetched expert is then expected to stay
    /// cached for about `budget / per_block` blocks (fewer misses than routed experts make it
    /// stay longer, so this errs short), at most [`HORIZON`].
    pub fn set_cache(&mut self, budget: u64, per_block: u64) {
        self.horizon = if per_block == 0 {
            HORIZON
        } else {
            (budget as f64 / per_block as f64).min(HORIZON)
        };
    }

    /// Blocks a fetched expert is expected to stay cached (see [`set_cache`](Self::set_cache)).
    pub fn horizon(&self) -> f64 {
        self.horizon
    }

    /// The configuration.
    pub fn config(&self) -> RemoteConfig {
        self.cfg
    }

    /// The counters so far.
    pub fn stats(&self) -> RemoteStats {
        self.stats
    }

    fn executor(&mut self, peer: usize) -> &mut Executor {
        if self.executors.len() <= peer {
            self.executors.resize_with(peer + 1, Executor::default);
        }
        &mut self.executors[peer]
    }

    /// Records which experts of `layer` a block routed to (call once per block and layer,
    /// before [`choose`](Self::choose)).
    pub fn observe(&mut self, layer: usize, routed: impl IntoIterator<Item = usize>) {
        let Some(h) = self.heat.get_mut(layer) else {
            return;
        };
        for x in h.iter_mut() {
            *x *= 1.0 - HEAT_ALPHA;
        }
        for e in routed {
            if let Some(x) = h.get_mut(e) {
                *x += HEAT_ALPHA;
            }
        }
    }

    /// How often `expert` of `layer` was routed in recent blocks, in [0, 1].
    pub fn heat(&self, layer: usize, expert: usize) -> f32 {
        self.heat
            .get(layer)
            .and_then(|h| h.get(expert))
            .copied()
            .unwrap_or(0.0)
    }

    /// Whether `peer` may be asked at `now`.
    pub fn usable(&self, peer: usize, now: Instant) -> bool {
        self.executors.get(peer).is_none_or(|x| {
            x.banned.is_none()
                && x.paused_until.is_none_or(|t| now >= t)
                && x.in_flight < MAX_IN_FLIGHT
        })
    }

    /// Why `peer` is not asked again this session, if it is not.
    pub fn banned(&self, peer: usize) -> Option<&str> {
        self.executors.get(peer)?.banned.as_deref()
    }

    /// Seconds a call of `rows` rows of width `hidden` to `h` is expected to take at `now`.
    fn call_cost(&self, now: Instant, h: &Holder, rows: usize, hidden: usize) -> f64 {
        let rtt = h.link.rtt_s();
        let wire = rtt + 2.0 * (rows * hidden * 4) as f64 / h.link.rate();
        let x = self.executors.get(h.peer);
        // The peer's service time per call (compute and its queue), from its measured calls.
        let service = x
            .and_then(|x| x.call_s(now))
            .map_or(0.0, |c| (c - rtt).max(0.0));
        let queued = x.map_or(0, |x| x.in_flight) as f64;
        wire + service * (1.0 + queued)
    }

    /// Seconds fetching `w` from `holders` is expected to take, shared among the uses
    /// expected while it stays cached: from the one with the cheapest fetch, or, for an
    /// expert the network tier stripes (at least two stripes of [`policy::MIN_STRIPE`] and
    /// two holders), from the fastest [`policy::MAX_STRIPES`] at once, at the sum of their
    /// rates after the longest of their round trips.
    fn fetch_cost(&self, w: &Want, holders: &[Holder]) -> f64 {
        let bytes = w.expert_bytes as f64;
        let whole = holders
            .iter()
            .map(|h| h.link.rtt_s() + bytes / h.link.rate())
            .fold(f64::INFINITY, f64::min);
        let once = if holders.len() >= 2 && w.expert_bytes >= 2 * policy::MIN_STRIPE {
            let striped = |set: &mut dyn Iterator<Item = &Holder>| {
                let (rate, rtt) = set.fold((0.0, 0.0f64), |(r, t), h| {
                    (r + h.link.rate(), t.max(h.link.rtt_s()))
                });
                rtt + bytes / rate
            };
            // Usually every holder takes part; more than the most stripes (rare) are sorted.
            let t = if holders.len() <= policy::MAX_STRIPES {
                striped(&mut holders.iter())
            } else {
                let mut by_rate: Vec<&Holder> = holders.iter().collect();
                by_rate.sort_by(|a, b| b.link.rate().total_cmp(&a.link.rate()));
                striped(&mut by_rate.into_iter().take(policy::MAX_STRIPES))
            };
            whole.min(t)
        } else {
            whole
        };
        once / (1.0 + self.heat(w.layer, w.expert) as f64 * self.horizon)
    }

    /// Fetch `w` or ask one of its `holders` (rows of width `hidden`) at `now`.
    pub fn choose(&self, now: Instant, w: &Want, hidden: usize, holders: &[Holder]) -> Choice {
        if self.cfg.mode == RemoteExec::Never || w.positions == 0 {
            return Choice::Fetch;
        }
        let best = holders
            .iter()
            .filter(|h| self.usable(h.peer, now))
            .map(|h| (h, self.call_cost(now, h, w.positions, hidden)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((h, call)) = best else {
            return Choice::Fetch;
        };
        let execute = match self.cfg.mode {
            RemoteExec::Always => true,
            RemoteExec::Never => false,
            RemoteExec::Auto => {
                let fetch = self.fetch_cost(w, holders);
                !w.cached && call < fetch
            }
        };
        if execute {
            Choice::Execute { peer: h.peer }
        } else {
            Choice::Fetch
        }
    }

    /// With `--verify-exec dual`, the holder to ask beside `first` (which [`choose`](Self::choose)
    /// gave): the cheapest other usable one, if any.
    pub fn second(
        &self,
        now: Instant,
        first: usize,
        w: &Want,
        hidden: usize,
        holders: &[Holder],
    ) -> Option<usize> {
        if self.cfg.verify != VerifyExec::Dual {
            return None;
        }
        holders
            .iter()
            .filter(|h| h.peer != first && self.usable(h.peer, now))
            .map(|h| (h.peer, self.call_cost(now, h, w.positions, hidden)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(peer, _)| peer)
    }

    /// Two holders answered one call (`--verify-exec dual`); `agreed`: bit for bit.
    pub fn compared(&mut self, agreed: bool) {
        self.stats.dual_calls += 1;
        if !agreed {
            self.stats.dual_disagreements += 1;
        }
    }

    /// A call to `peer` was chosen: it counts as in flight from now on, so the rest of the
    /// block's choices see it (call right after [`choose`](Self::choose) answered it).
    pub fn begin(&mut self, peer: usize) {
        self.executor(peer).in_flight += 1;
    }

    /// A call begun for `peer` is not sent after all.
    pub fn cancel(&mut self, peer: usize) {
        let x = self.executor(peer);
        x.in_flight = x.in_flight.saturating_sub(1);
    }

    /// Whether the answer of a call to `peer` about to be sent is to be spot-checked: every
    /// call until the peer's first answer (a call that failed checked nothing), then a
    /// `spot_check` share.
    pub fn check(&mut self, peer: usize) -> bool {
        let f = self.cfg.spot_check;
        self.executor(peer).answers == 0 || self.next_draw() < f
    }

    /// A uniform draw in [0, 1).
    fn next_draw(&mut self) -> f64 {
        let mut x = self.draw;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.draw = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `peer` answered with rows at `now`, `elapsed` after the call, having moved `bytes`
    /// both ways.
    pub fn answered(&mut self, peer: usize, now: Instant, elapsed: Duration, bytes: u64) {
        let x = self.executor(peer);
        let before = x.call_s(now);
        x.in_flight = x.in_flight.saturating_sub(1);
        x.answers += 1;
        x.busy_streak = 0;
        x.failure_streak = 0;
        x.paused_until = None;
        let s = elapsed.as_secs_f64();
        x.call_s = Some(before.map_or(s, |c| c + CALL_ALPHA * (s - c)));
        x.call_at = Some(now);
        self.stats.calls += 1;
        self.stats.bytes += bytes;
    }

    /// `peer` answered `busy` at `now`: not asked for a pause that doubles while it stays busy.
    pub fn busy(&mut self, peer: usize, now: Instant) {
        let x = self.executor(peer);
        x.in_flight = x.in_flight.saturating_sub(1);
        x.busy_streak += 1;
        x.paused_until = Some(now + pause(BUSY_PAUSE, x.busy_streak));
        self.stats.failures += 1;
    }

    /// A call to `peer` failed at `now` (error, time-out, lost connection).
    pub fn failed(&mut self, peer: usize, now: Instant) {
        let x = self.executor(peer);
        x.in_flight = x.in_flight.saturating_sub(1);
        x.failure_streak += 1;
        x.paused_until = Some(now + pause(FAILURE_PAUSE, x.failure_streak));
        self.stats.failures += 1;
    }

    /// A spot-check is made in the background; its verdict comes later.
    pub fn deferred(&mut self) {
        self.stats.deferred_checks += 1;
    }

    /// An answer of `peer` drawn for a spot-check could not be checked (its expert could not
    /// be had here): it is not used, and the peer is asked nothing more this session, since
    /// an answer that cannot be checked is worth no more than a wrong one.
    pub fn unverifiable(&mut self, peer: usize) {
        self.stats.failures += 1;
        self.executor(peer).banned = Some("an answer of its could not be spot-checked".into());
    }

    /// What the engine found about an answer of `peer`: a disagreeing spot-check or a
    /// malformed answer bans it for the session.
    pub fn verdict(&mut self, peer: usize, v: Verdict) {
        match v {
            Verdict::Agreed => self.stats.spot_checks += 1,
            Verdict::Disagreed => {
                self.stats.spot_checks += 1;
                self.stats.spot_check_failures += 1;
                self.executor(peer).banned =
                    Some("its result differed from the local computation".into());
            }
            Verdict::Malformed => {
                self.stats.failures += 1;
                self.executor(peer).banned = Some("it answered rows of the wrong length".into());
            }
        }
    }
}

/// What one of `together` calls sent to a peer at once would have taken alone, from the
/// `elapsed` it took on a link of round trip `rtt`: the peer runs them one after another, so
/// on average a call also waited for half of the others, and what the call took beyond the
/// round trip is divided by `(together + 1) / 2`. The choice multiplies a peer's service time
/// by the calls queued ahead of a new one ([`RemotePolicy::choose`]); a measured time that
/// holds that queue already would count it twice (four calls of a decode step to one peer
/// measured 2.5 times the service, and the 4th call was judged at 10 times it, so a loopback
/// peer's experts were fetched instead).
pub fn alone(elapsed: Duration, rtt: Duration, together: u32) -> Duration {
    let share = (f64::from(together.max(1)) + 1.0) / 2.0;
    let beyond = elapsed.saturating_sub(rtt).as_secs_f64() / share;
    elapsed.min(rtt) + Duration::from_secs_f64(beyond)
}

/// `first` doubled for each of `streak - 1` repeats, at most [`MAX_PAUSE`].
fn pause(first: Duration, streak: u32) -> Duration {
    first
        .saturating_mul(1u32 << streak.saturating_sub(1).min(16))
        .min(MAX_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss-20b geometry: 2,880 wide, 13.2 MB experts, 24 layers of 32.
    const HIDDEN: usize = 2880;
    const EXPERT: u64 = 13_240_000;

    fn policy(mode: RemoteExec, spot_check: f64) -> RemotePolicy {
        RemotePolicy::new(
            RemoteConfig {
                mode,
                spot_check,
                inline: false,
                verify: VerifyExec::Single,
            },
            &[32; 24],
            7,
        )
    }

    fn want(expert: usize, positions: usize, cached: bool) -> Want {
        Want {
            layer: 3,
            expert,
            positions,
            expert_bytes: EXPERT,
            cached,
        }
    }

    fn link(rtt_ms: u64, mbit: f64) -> Link {
        Link {
            rtt: Some(Duration::from_millis(rtt_ms)),
            rate: Some(mbit * 1e6 / 8.0),
        }
    }

    fn holder(peer: usize, l: Link) -> Holder {
        Holder { peer, link: l }
    }

    /// A cold expert over a home link (40 ms, 100 Mbit/s) is executed remotely when decoding
    /// (one position: 23 KB both ways against 13.2 MB), and fetched when already cached or
    /// when a prefill block routes 1,024 positions to it (23.6 MB of rows both ways); on a
    /// LAN a hot expert is fetched and a cold one executed.
    #[test]
    fn auto_executes_cold_experts_and_fetches_hot_ones_and_prefills() {
        let mut p = policy(RemoteExec::Auto, 0.05);
        let now = Instant::now();
        let home = [holder(0, link(40, 100.0))];
        assert_eq!(
            p.choose(now, &want(5, 1, false), HIDDEN, &home),
            Choice::Execute { peer: 0 }
        );
        assert_eq!(
            p.choose(now, &want(5, 1, true), HIDDEN, &home),
            Choice::Fetch
        );
        assert_eq!(
            p.choose(now, &want(5, 1024, false), HIDDEN, &home),
            Choice::Fetch
        );
        // Expert 5 routed in every block for a while: hot.
        for _ in 0..60 {
            p.observe(3, [5]);
        }
        assert!(p.heat(3, 5) > 0.99);
        let lan = [holder(0, link(1, 10_000.0))];
        // On a LAN a hot expert's fetch (1 ms + 10.6 ms shared by 17 uses) beats a call.
        assert_eq!(
            p.choose(now, &want(5, 1, false), HIDDEN, &lan),
            Choice::Fetch
        );
        // A cold one on the same LAN is still executed (1 ms + 18 us against 11.6 ms).
        assert_eq!(
            p.choose(now, &want(6, 1, false), HIDDEN, &lan),
            Choice::Execute { peer: 0 }
        );
        // Heat decays once the expert stops being routed.
        for _ in 0..60 {
            p.observe(3, [6]);
        }
        assert!(p.heat(3, 5) < 0.01);
    }

    /// A fast link fetches even a cold expert: 13.2 MB at 100 Gbit/s with a 1 ms round trip
    /// (2.06 ms) against a call measured at 5 ms.
    /// Two holders of an expert stripe its fetch (at the sum of their rates), so a prefill
    /// block's 400 positions that one holder runs for the node (0.78 s of rows on a 40 ms,
    /// 100 Mbit/s link, against 1.10 s to fetch the expert) are fetched from two (0.57 s).
    #[test]
    fn two_holders_stripe_the_fetch_the_choice_weighs() {
        let p = policy(RemoteExec::Auto, 0.05);
        let now = Instant::now();
        let one = [holder(0, link(40, 100.0))];
        let two = [holder(0, link(40, 100.0)), holder(1, link(40, 100.0))];
        let w = want(5, 400, false);
        assert_eq!(p.choose(now, &w, HIDDEN, &one), Choice::Execute { peer: 0 });
        assert_eq!(p.choose(now, &w, HIDDEN, &two), Choice::Fetch);
        // An expert too small to be striped comes whole from one of them: 30 positions' call
        // (5.6 s at 1 Mbit/s) beats its whole fetch (8.4 s), not the 4.2 s it would take
        // striped.
        let small = Want {
            expert_bytes: policy::MIN_STRIPE,
            ..want(5, 30, false)
        };
        let slow = [holder(0, link(40, 1.0)), holder(1, link(40, 1.0))];
        assert_eq!(
            p.choose(now, &small, HIDDEN, &slow),
            Choice::Execute { peer: 0 }
        );
        // Nine holders: the tier stripes over the fastest eight, so a slow ninth's 1 s round
        // trip does not count (striped: 0.17 s; a call of 100 positions: 0.22 s).
        let mut nine: Vec<Holder> = (0..8).map(|i| holder(i, link(40, 100.0))).collect();
        nine.push(holder(
            8,
            Link {
                rtt: Some(Duration::from_secs(1)),
                rate: Some(1e6 / 8.0),
            },
        ));
        assert_eq!(
            p.choose(now, &want(5, 100, false), HIDDEN, &nine),
            Choice::Fetch
        );
    }

    #[test]
    fn a_fast_link_or_a_slow_peer_fetches() {
        let mut p = policy(RemoteExec::Auto, 0.0);
        let now = Instant::now();
        let fast = [holder(0, link(1, 100_000.0))];
        p.begin(0);
        p.answered(0, now, Duration::from_millis(5), 0);
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &fast),
            Choice::Fetch
        );
        // Unmeasured, the same link is judged by its round trip alone: executed.
        let fresh = [holder(1, link(1, 100_000.0))];
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &fresh),
            Choice::Execute { peer: 1 }
        );
    }

    /// A peer whose call was measured slow (rows behind a link full of fetches, as in a
    /// prefill) is not asked while that is recent, and is asked again once it has faded; a
    /// fast answer then keeps it asked.
    #[test]
    fn a_slow_answer_fades_and_the_peer_is_asked_again() {
        let mut p = policy(RemoteExec::Auto, 0.0);
        let t0 = Instant::now();
        let home = [holder(0, link(40, 100.0))];
        p.begin(0);
        p.answered(0, t0, Duration::from_secs(5), 0);
        // 5 s a call against 1.1 s to fetch the cold expert: fetched, and still at 2.5 s.
        let cold = want(1, 1, false);
        assert_eq!(p.choose(t0, &cold, HIDDEN, &home), Choice::Fetch);
        assert_eq!(
            p.choose(t0 + CALL_HALF_LIFE, &cold, HIDDEN, &home),
            Choice::Fetch
        );
        // Eight half-lives on, 20 ms: below the round trip, so the call is the wire's 42 ms.
        let later = t0 + CALL_HALF_LIFE * 8;
        assert_eq!(
            p.choose(later, &cold, HIDDEN, &home),
            Choice::Execute { peer: 0 }
        );
        p.begin(0);
        p.answered(0, later, Duration::from_millis(45), 0);
        assert_eq!(
            p.choose(later, &cold, HIDDEN, &home),
            Choice::Execute { peer: 0 }
        );
        // A second slow answer writes it off again.
        p.begin(0);
        p.answered(0, later, Duration::from_secs(20), 0);
        assert_eq!(p.choose(later, &cold, HIDDEN, &home), Choice::Fetch);
    }

    /// An expert routed in every block is fetched when the cache keeps it for the next ones,
    /// and executed when the budget holds less than one block's experts (at the smallest
    /// budget the fetch would serve one use): on loopback (0.1 ms, 8 Gbit/s), a call measured
    /// at 3 ms against the fetch's 13.3 ms.
    #[test]
    fn a_cache_too_small_to_keep_an_expert_makes_its_fetch_serve_one_use() {
        let mut p = policy(RemoteExec::Auto, 0.0);
        let now = Instant::now();
        let lo = [holder(
            0,
            Link {
                rtt: Some(Duration::from_micros(100)),
                rate: Some(1e9),
            },
        )];
        p.begin(0);
        p.answered(0, now, Duration::from_millis(3), 0);
        for _ in 0..60 {
            p.observe(3, [5]);
        }
        let hot = want(5, 1, false);
        assert_eq!(p.horizon(), HORIZON);
        assert_eq!(p.choose(now, &hot, HIDDEN, &lo), Choice::Fetch);
        // Room for 4 experts; a token routes 4 in each of 24 layers.
        p.set_cache(4 * EXPERT, 96 * EXPERT);
        assert!((p.horizon() - 4.0 / 96.0).abs() < 1e-12);
        assert_eq!(
            p.choose(now, &hot, HIDDEN, &lo),
            Choice::Execute { peer: 0 }
        );
        // A budget of many tokens' experts is capped at the horizon.
        p.set_cache(1000 * 96 * EXPERT, 96 * EXPERT);
        assert_eq!(p.horizon(), HORIZON);
        p.set_cache(1, 0);
        assert_eq!(p.horizon(), HORIZON, "no experts routed: the cap");
    }

    /// Among holders the cheapest call wins: a shorter round trip, and a peer with fewer calls
    /// queued when their service times are equal.
    #[test]
    fn the_cheapest_holder_is_chosen() {
        let mut p = policy(RemoteExec::Always, 0.0);
        let now = Instant::now();
        let hs = [holder(0, link(30, 100.0)), holder(1, link(10, 100.0))];
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &hs),
            Choice::Execute { peer: 1 }
        );
        // Both measured at 20 ms per call over equal links; peer 1 has three calls queued.
        let same = [holder(0, link(10, 100.0)), holder(1, link(10, 100.0))];
        for peer in [0, 1] {
            p.begin(peer);
            p.answered(peer, now, Duration::from_millis(20), 0);
        }
        for _ in 0..3 {
            p.begin(1);
        }
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &same),
            Choice::Execute { peer: 0 }
        );
    }

    /// `always` executes even cached or prefill experts while a holder is usable; `never`
    /// never executes; no holder, or none usable, fetches.
    #[test]
    fn modes_and_no_usable_holder() {
        let now = Instant::now();
        let hs = [holder(2, link(40, 100.0))];
        let always = policy(RemoteExec::Always, 0.05);
        assert_eq!(
            always.choose(now, &want(1, 512, true), HIDDEN, &hs),
            Choice::Execute { peer: 2 }
        );
        assert_eq!(
            always.choose(now, &want(1, 1, false), HIDDEN, &[]),
            Choice::Fetch
        );
        let never = policy(RemoteExec::Never, 0.05);
        assert_eq!(
            never.choose(now, &want(1, 1, false), HIDDEN, &hs),
            Choice::Fetch
        );
    }

    /// A busy peer is not asked for 50 ms, then 100 ms after a second busy answer; an answer
    /// ends the pause. A failed one waits 500 ms. A disagreeing spot-check or a malformed
    /// answer bans it for good.
    #[test]
    fn busy_failing_and_lying_peers_are_avoided() {
        let mut p = policy(RemoteExec::Always, 0.0);
        let t0 = Instant::now();
        let hs = [holder(0, link(10, 100.0))];
        let w = want(1, 1, false);
        p.begin(0);
        p.busy(0, t0);
        assert_eq!(p.choose(t0, &w, HIDDEN, &hs), Choice::Fetch);
        let t1 = t0 + Duration::from_millis(50);
        assert_eq!(p.choose(t1, &w, HIDDEN, &hs), Choice::Execute { peer: 0 });
        p.begin(0);
        p.busy(0, t1);
        assert!(!p.usable(0, t1 + Duration::from_millis(99)));
        assert!(p.usable(0, t1 + Duration::from_millis(100)));
        p.begin(0);
        p.answered(0, t1, Duration::from_millis(12), 100);
        assert!(p.usable(0, t1));
        p.begin(0);
        p.failed(0, t1);
        assert!(!p.usable(0, t1 + Duration::from_millis(499)));
        assert!(p.usable(0, t1 + Duration::from_millis(500)));
        let s = p.stats();
        assert_eq!((s.calls, s.bytes, s.failures), (1, 100, 3));

        p.verdict(0, Verdict::Agreed);
        assert!(p.usable(0, t1 + Duration::from_secs(1)));
        p.verdict(0, Verdict::Disagreed);
        let later = t1 + Duration::from_secs(3600);
        assert!(!p.usable(0, later));
        assert!(p.banned(0).is_some());
        assert_eq!(p.choose(later, &w, HIDDEN, &hs), Choice::Fetch);
        p.verdict(1, Verdict::Malformed);
        assert!(!p.usable(1, later));
        let s = p.stats();
        assert_eq!(
            (s.spot_checks, s.spot_check_failures, s.failures),
            (2, 1, 4)
        );
        // An answer that could not be checked bans its peer too.
        p.unverifiable(2);
        assert!(!p.usable(2, later));
        assert!(p.banned(2).is_some_and(|why| why.contains("could not")));
        assert_eq!(p.stats().failures, 5);
    }

    /// The pause doubles and stops at the maximum.
    #[test]
    fn pauses_double_up_to_the_maximum() {
        assert_eq!(pause(BUSY_PAUSE, 1), BUSY_PAUSE);
        assert_eq!(pause(BUSY_PAUSE, 3), BUSY_PAUSE * 4);
        assert_eq!(pause(FAILURE_PAUSE, 40), MAX_PAUSE);
    }

    /// Every call until a peer's first answer is checked (a failed call does not count), then
    /// about the configured share (replayable from the seed); 0 checks only those, 1 all.
    #[test]
    fn spot_checks_take_calls_until_the_first_answer_and_a_share() {
        let now = Instant::now();
        let answered = |p: &mut RemotePolicy, peer| {
            p.begin(peer);
            p.answered(peer, now, Duration::from_millis(1), 0);
        };
        let mut p = policy(RemoteExec::Always, 0.05);
        assert!(p.check(0) && p.check(0) && p.check(1));
        p.begin(0);
        p.busy(0, now);
        assert!(p.check(0), "a busy answer is no answer");
        answered(&mut p, 0);
        let n = 20_000;
        let checked = (0..n).filter(|_| p.check(0)).count();
        let share = checked as f64 / n as f64;
        assert!((0.04..0.06).contains(&share), "{share}");
        assert!(p.check(1), "peer 1 has not answered yet");
        let mut q = policy(RemoteExec::Always, 0.05);
        answered(&mut q, 0);
        assert_eq!((0..n).filter(|_| q.check(0)).count(), checked, "replayable");
        let mut none = policy(RemoteExec::Always, 0.0);
        assert!(none.check(4));
        answered(&mut none, 4);
        assert!((0..1000).all(|_| !none.check(4)));
        let mut all = policy(RemoteExec::Always, 1.0);
        answered(&mut all, 4);
        assert!((0..1000).all(|_| all.check(4)));
    }

    /// A peer is given at most [`MAX_IN_FLIGHT`] calls at once: the next choice goes to another
    /// holder, or fetches when there is none; an answer frees a place.
    #[test]
    fn calls_in_flight_are_bounded_per_peer() {
        let mut p = policy(RemoteExec::Always, 0.0);
        let now = Instant::now();
        let one = [holder(0, link(1, 1000.0))];
        let two = [holder(0, link(1, 1000.0)), holder(1, link(2, 1000.0))];
        for _ in 0..MAX_IN_FLIGHT {
            assert_eq!(
                p.choose(now, &want(1, 1, false), HIDDEN, &one),
                Choice::Execute { peer: 0 }
            );
            p.begin(0);
        }
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &one),
            Choice::Fetch
        );
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &two),
            Choice::Execute { peer: 1 }
        );
        p.answered(0, now, Duration::from_millis(1), 0);
        assert_eq!(
            p.choose(now, &want(1, 1, false), HIDDEN, &one),
            Choice::Execute { peer: 0 }
        );
    }

    /// Calls sent together are measured as if alone: four calls of 1 ms each, run one after
    /// another behind a 0.1 ms round trip, took 1.1, 2.1, 3.1 and 4.1 ms; their mean, alone,
    /// is the 1.1 ms a single call takes. One call, or a call no slower than the round trip,
    /// is unchanged.
    #[test]
    fn calls_sent_together_are_measured_as_if_alone() {
        let us = Duration::from_micros;
        let rtt = us(100);
        let mean: f64 = [1100, 2100, 3100, 4100]
            .iter()
            .map(|&e| alone(us(e), rtt, 4).as_secs_f64())
            .sum::<f64>()
            / 4.0;
        assert!((mean - 1.1e-3).abs() < 1e-9, "{mean}");
        assert_eq!(alone(us(1100), rtt, 1), us(1100));
        assert_eq!(alone(us(1100), rtt, 0), us(1100));
        assert_eq!(alone(us(50), rtt, 4), us(50));
    }
}
