//! A congestion controller of stormo's own for what a node sends: CUBIC that does not back
//! off for a loss while the path's queue is empty ([`Tolerant`], `--congestion tolerant`).
//!
//! # Why
//! CUBIC cuts its window to 0.7 of itself on every loss, whatever caused it. On a long path with
//! random loss (20 ms one way, 0.5% of datagrams: `stormo sim --scenario wan`) that holds it
//! near 5% of the link. quinn's BBR ignores such loss, but its bandwidth estimate overshoots
//! (it sent about 1.7 times what the link carried and lost the excess at the bottleneck) and it
//! takes nearly the whole link from a CUBIC flow beside it (`stormo sim --scenario fair-wan`,
//! figures in docs/network.md).
//!
//! # What it does
//! It is quinn's CUBIC with one filter in front of its loss signal. A loss is taken for
//! random, and not passed on, when both hold:
//! - the path's queue is empty: the smoothed round trip is within
//!   max([`QUEUE_DELAY_FRACTION`] of the base round trip, [`QUEUE_DELAY_FLOOR`]) of the
//!   base, the least the round trip has been when smoothed once more ([`BASE_GAIN`]). A
//!   loss at a full drop-tail queue comes with a grown round trip, so congestion (a competing flow,
//!   our own overshoot) is answered as CUBIC answers it;
//! - recent loss is rare: at most [`TOLERATED_LOSS`] of the last [`LOSS_WINDOW`] bytes. A
//!   path that drops much more without queueing (a policer) is answered as CUBIC answers it.
//!
//! The base is not quinn's minimum sample: a sample is timed from a clock read before the
//! datagrams it covers were received, so on a busy host (a process descheduled between the
//! two) one can come out shorter than the path allows. In `stormo sim --scenario wan` (40 ms
//! round trip, seven processes on two cores) one connection's minimum fell to 30.9 ms; from
//! then on every random loss looked like a queue of 11 ms, was passed on, and CUBIC held that
//! link at a few percent of its rate for the rest of the run (324 s instead of about 50). The
//! least *smoothed* round trip was not enough either: a burst of short samples (a batch of
//! acknowledgements read late) drags it down for a moment (a later run: a minimum sample of
//! 16.1 ms, the same collapse). So the base is the least of the smoothed round trip smoothed
//! again, by [`BASE_GAIN`] per acknowledgement: a dip of a few acknowledgements moves it by a
//! small share of the dip, a path that got faster is followed within a hundred or so. The
//! base never rises, so a queue a competing flow keeps standing is never taken for the
//! path's own round trip, as an expiring minimum (BBR's) would take it. Nor is the base
//! taken before [`WARMUP_ACKS`] acknowledgements (until then the smoothed round trip is its
//! own base): quinn's smoothed round trip starts at the first sample, and a first sample of
//! 8.3 ms on a 40 ms path became a base that never rose (one `wan` run of two stalled so, at
//! 147 s). The variants tried and their `wan` runs are
//! in docs/network.md and docs/performance.md.
//!
//! Persistent congestion always passes. Everything else (slow start, the cubic growth,
//! recovery, pacing) is quinn's CUBIC unchanged. The rule is the one TCP Veno and Westwood
//! rest on: a loss without a queue says little about congestion. The decision is a sans-IO
//! state ([`LossFilter`]) with time and round trips passed in, tested without sockets.
//!
//! # The window never falls below the pipe
//! A random loss met while a queue stands (the flow's own, several streams filling it) is
//! passed on, and each such loss cuts CUBIC's window to 0.7 of itself; CUBIC then takes
//! seconds to grow back (its `K`: 9 s for a 1.5 MB window). In `stormo sim --scenario wan`
//! the serving nodes' connections ended with windows of 272-402 KB, below the path's 500 KB
//! of bandwidth times round trip, and a holder's 106 MB of spot-check fetches took 20-25 s
//! instead of 8.5. So the window never goes below the pipe: the delivery rate measured
//! over the last round trips ([`DeliveryRate`], sans-IO) times the base round trip. A window
//! of that size keeps the link full without a queue, where random loss is ignored; a
//! competing flow's standing queue lowers the measured rate, and the floor with it, so the
//! floor yields to it as the rate falls (BBR keeps its window at twice that; this floor is
//! only a floor, CUBIC still decides above it). Persistent congestion (every datagram of
//! several round trips lost) forgets the rate: the path may have changed.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics, CubicConfig};

/// The queueing delay, as a share of the base round trip, under which a path counts as not
/// queueing.
pub const QUEUE_DELAY_FRACTION: f64 = 0.25;
/// The queueing delay under which a path always counts as not queueing (timer, acknowledgement
/// and scheduling noise on short paths).
pub const QUEUE_DELAY_FLOOR: Duration = Duration::from_millis(4);
/// The share of recent bytes that may be lost for losses to still count as random.
pub const TOLERATED_LOSS: f64 = 0.02;
/// How many bytes "recent" spans: the counts of acknowledged and lost bytes are scaled down
/// together to stay within it (about 3,000 full datagrams).
pub const LOSS_WINDOW: f64 = (4 << 20) as f64;
/// The weight of each acknowledgement's smoothed round trip in the base's own smoothing.
pub const BASE_GAIN: f64 = 1.0 / 32.0;
/// Acknowledged datagrams before the base is taken: until then the smoothed round trip is
/// its own base (no queue is seen, and rare loss is tolerated as on an empty path). quinn's
/// smoothed round trip starts at the first sample, and a first sample timed short (8.3 ms on
/// a 40 ms path, seen in a `wan` run) would otherwise become a base that never rises: every
/// later random loss looks like a queue. (Passing every loss of the warm-up instead cut the
/// window of a young connection at its first random loss, and the `wan` swarm's prefill,
/// whose calls carry 276 KB of rows each, ran 1-2 tok/s instead of 8-11.)
pub const WARMUP_ACKS: u32 = 256;

/// The loss filter's state: acknowledged and lost bytes of about the last [`LOSS_WINDOW`],
/// the smoothed round trip last seen, that smoothed again, and the least of the latter (the
/// base).
#[derive(Debug, Clone)]
pub struct LossFilter {
    acked: f64,
    lost: f64,
    srtt: Duration,
    /// The smoothed round trip smoothed again ([`BASE_GAIN`]), seconds.
    slow: Option<f64>,
    /// The least `slow` has been: the base round trip (zero: none yet).
    base: Duration,
    /// Acknowledgements seen, up to [`WARMUP_ACKS`].
    acks: u32,
    /// Losses not passed on to CUBIC.
    pub ignored: u64,
    /// Losses passed on.
    pub passed: u64,
}

impl Default for LossFilter {
    fn default() -> Self {
        Self::new()
    }
}

impl LossFilter {
    /// A filter that has seen nothing (its first loss passes: no round trip is known).
    pub fn new() -> Self {
        Self {
            acked: 0.0,
            lost: 0.0,
            srtt: Duration::ZERO,
            slow: None,
            base: Duration::ZERO,
            acks: 0,
            ignored: 0,
            passed: 0,
        }
    }

    /// `bytes` were acknowledged; the path's smoothed round trip is `srtt`.
    pub fn on_ack(&mut self, bytes: u64, srtt: Duration) {
        self.srtt = srtt;
        let s = srtt.as_secs_f64();
        self.acked += bytes as f64;
        if self.acks < WARMUP_ACKS {
            // Until the smoothed round trip has left its first sample behind.
            self.acks += 1;
            self.slow = Some(s);
            self.rescale();
            return;
        }
        let slow = self.slow.map_or(s, |x| x + BASE_GAIN * (s - x));
        self.slow = Some(slow);
        let slow = Duration::from_secs_f64(slow);
        if self.base.is_zero() || slow < self.base {
            self.base = slow;
        }
        self.rescale();
    }

    /// `bytes` were lost: whether CUBIC should hear of it. Loss is rare while the bytes lost
    /// lately are at most [`TOLERATED_LOSS`] of a whole [`LOSS_WINDOW`] (so a young or slow
    /// connection is not judged on its first few datagrams).
    pub fn on_loss(&mut self, bytes: u64, persistent: bool) -> bool {
        self.lost += bytes as f64;
        self.rescale();
        // In the warm-up the path counts as having no queue: its smoothed round trip is its own
        // base until it has left its first sample behind.
        let base = if self.acks < WARMUP_ACKS {
            self.srtt
        } else {
            self.base()
        };
        let queue = self.srtt.saturating_sub(base);
        let empty = base > Duration::ZERO
            && queue <= base.mul_f64(QUEUE_DELAY_FRACTION).max(QUEUE_DELAY_FLOOR);
        let rare = self.lost <= TOLERATED_LOSS * LOSS_WINDOW;
        let pass = persistent || !empty || !rare;
        if pass {
            self.passed += 1;
        } else {
            self.ignored += 1;
        }
        pass
    }

    /// The base round trip (zero: none yet).
    pub fn base(&self) -> Duration {
        self.base
    }

    /// Scales both counts down to keep them within the window.
    fn rescale(&mut self) {
        let total = self.acked + self.lost;
        if total > LOSS_WINDOW {
            let k = LOSS_WINDOW / total;
            self.acked *= k;
            self.lost *= k;
        }
    }
}

/// Delivery-rate samples the estimate is the largest of (BBR's bottleneck-bandwidth filter
/// spans ten round trips too): answers come in bursts with gaps between them, and a sample
/// that spans a gap reads low.
const RATE_SAMPLES: usize = 10;

/// The rate at which the path delivers a connection's bytes: bytes acknowledged over each
/// round trip, the largest of the last `RATE_SAMPLES` samples (a sample taken while the
/// sender had less to send than its window allowed counts only when it raises the estimate).
/// Sans-IO: time and round trips are passed in.
#[derive(Debug, Clone, Default)]
pub struct DeliveryRate {
    /// When the current sample began, and the bytes acknowledged since.
    start: Option<Instant>,
    bytes: u64,
    /// The last samples, bytes per second, oldest first.
    last: [f64; RATE_SAMPLES],
}

impl DeliveryRate {
    /// `bytes` were acknowledged at `now`; the smoothed round trip is `srtt`; `app_limited`:
    /// the sender had less to send than its window allowed.
    pub fn on_ack(&mut self, now: Instant, bytes: u64, app_limited: bool, srtt: Duration) {
        let Some(start) = self.start else {
            // The bytes of the first acknowledgement were delivered before it: not timed.
            self.start = Some(now);
            return;
        };
        self.bytes += bytes;
        let elapsed = now.saturating_duration_since(start);
        // A sample spans at least a smoothed round trip.
        if srtt.is_zero() || elapsed < srtt {
            return;
        }
        let sample = self.bytes as f64 / elapsed.as_secs_f64();
        if !app_limited || sample > self.rate() {
            self.last.rotate_left(1);
            self.last[RATE_SAMPLES - 1] = sample;
        }
        self.start = Some(now);
        self.bytes = 0;
    }

    /// The delivery rate, bytes per second (zero: not measured yet).
    pub fn rate(&self) -> f64 {
        self.last.iter().copied().fold(0.0, f64::max)
    }

    /// The pipe of a path whose round trip without a queue is `base`: the bytes in flight
    /// that keep it delivering at [`Self::rate`] (zero while either is unknown).
    pub fn pipe(&self, base: Duration) -> u64 {
        (self.rate() * base.as_secs_f64()) as u64
    }

    /// Forgets the rate measured (persistent congestion: the path may have changed).
    pub fn forget(&mut self) {
        *self = Self::default();
    }

    /// `window` (the controller's own), raised to the pipe of a path of round trip `base`.
    pub fn floor(&self, window: u64, base: Duration) -> u64 {
        window.max(self.pipe(base))
    }
}

/// quinn's CUBIC behind a [`LossFilter`], its window never below the pipe
/// ([`DeliveryRate::pipe`] of the filter's base).
pub struct Tolerant {
    cubic: Box<dyn Controller>,
    filter: LossFilter,
    delivery: DeliveryRate,
}

impl std::fmt::Debug for Tolerant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tolerant")
            .field("window", &self.cubic.window())
            .field("filter", &self.filter)
            .finish()
    }
}

impl Tolerant {
    /// Its loss filter (how many losses it ignored and passed on).
    pub fn filter(&self) -> &LossFilter {
        &self.filter
    }
}

impl Controller for Tolerant {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.cubic.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.filter.on_ack(bytes, rtt.get());
        self.delivery.on_ack(now, bytes, app_limited, rtt.get());
        self.cubic.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.cubic
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        if is_persistent_congestion {
            // The path may not be the one measured (every datagram of several round trips
            // lost): no floor until its rate is measured again.
            self.delivery.forget();
        }
        if self.filter.on_loss(lost_bytes, is_persistent_congestion) {
            self.cubic
                .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
        }
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.cubic.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        self.delivery.floor(self.cubic.window(), self.filter.base())
    }

    fn metrics(&self) -> ControllerMetrics {
        self.cubic.metrics()
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Self {
            cubic: self.cubic.clone_box(),
            filter: self.filter.clone(),
            delivery: self.delivery.clone(),
        })
    }

    fn initial_window(&self) -> u64 {
        self.cubic.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// What the loss filter of `conn`'s controller did, when it is [`Tolerant`]: its base round
/// trip, and the losses it passed on to CUBIC and those it took for random (for the line a
/// serving node logs when a peer goes).
pub fn filter_summary(conn: &quinn::Connection) -> Option<String> {
    let t = conn
        .congestion_state()
        .into_any()
        .downcast::<Tolerant>()
        .ok()?;
    let f = t.filter();
    Some(format!(
        "loss filter: base {:.1} ms, {} losses passed on, {} taken for random",
        f.base().as_secs_f64() * 1e3,
        f.passed,
        f.ignored
    ))
}

/// Makes [`Tolerant`] controllers (CUBIC with quinn's default settings inside).
#[derive(Debug, Default)]
pub struct TolerantConfig {
    cubic: CubicConfig,
}

impl ControllerFactory for TolerantConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        let cubic = Arc::new(self.cubic.clone()).build(now, current_mtu);
        Box::new(Tolerant {
            cubic,
            filter: LossFilter::new(),
            delivery: DeliveryRate::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A filter that has seen `acked` bytes on a path whose smoothed round trip was `min` and
    /// is `srtt` now.
    fn warmed(srtt: Duration, min: Duration, acked: u64) -> LossFilter {
        let mut f = LossFilter::new();
        // The warm-up, then the base.
        for _ in 0..=WARMUP_ACKS {
            f.on_ack(0, min);
        }
        // The base's own smoothing follows a jump up without moving the base.
        for _ in 0..1000 {
            f.on_ack(0, srtt);
        }
        f.on_ack(acked, srtt);
        f
    }

    #[test]
    fn a_rare_loss_on_an_empty_queue_is_ignored() {
        let mut f = warmed(41 * MS, 40 * MS, 1_000_000);
        assert!(!f.on_loss(1200, false));
        assert_eq!((f.ignored, f.passed), (1, 0));
        // A young connection's first losses too, once a round trip is known.
        let mut f = warmed(40 * MS, 40 * MS, 3000);
        assert!(!f.on_loss(1200, false));
    }

    #[test]
    fn a_loss_with_a_queue_is_passed() {
        // 40 ms of minimum round trip: the queue may add 10 ms before it counts.
        let mut f = warmed(51 * MS, 40 * MS, 1_000_000);
        assert!(f.on_loss(1200, false));
        let mut f = warmed(50 * MS, 40 * MS, 1_000_000);
        assert!(!f.on_loss(1200, false));
        // A short path: the floor of 4 ms, not a quarter of 0.5 ms.
        let mut f = warmed(4 * MS, MS / 2, 1_000_000);
        assert!(!f.on_loss(1200, false));
        let mut f = warmed(5 * MS, MS / 2, 1_000_000);
        assert!(f.on_loss(1200, false));
    }

    #[test]
    fn persistent_congestion_and_a_loss_before_any_round_trip_are_passed() {
        let mut f = warmed(40 * MS, 40 * MS, 1_000_000);
        assert!(f.on_loss(1200, true));
        let mut f = LossFilter::new();
        assert!(f.on_loss(1200, false));
    }

    #[test]
    fn frequent_loss_is_passed_even_without_a_queue() {
        let mut f = warmed(40 * MS, 40 * MS, 1_000_000);
        // 2% of the 4 MiB window, about 84 kB: 69 losses of 1,200 bytes are tolerated, the
        // 70th is not.
        for _ in 0..69 {
            assert!(!f.on_loss(1200, false));
        }
        assert!(f.on_loss(1200, false));
        assert_eq!((f.ignored, f.passed), (69, 1));
    }

    #[test]
    fn old_losses_weigh_less_as_bytes_arrive() {
        let mut f = warmed(40 * MS, 40 * MS, 1_000_000);
        while !f.on_loss(1200, false) {}
        // Two windows of clean delivery later, old losses weigh a quarter: ignored again.
        for _ in 0..8 {
            f.on_ack(1 << 20, 40 * MS);
        }
        assert!(!f.on_loss(1200, false));
    }

    /// Random loss of 0.5% on an empty queue is never passed on, whatever the flow's rate.
    #[test]
    fn half_a_percent_of_random_loss_is_always_tolerated() {
        let mut f = warmed(40 * MS, 40 * MS, 10_000);
        for _ in 0..100_000 {
            for _ in 0..199 {
                f.on_ack(1200, 40 * MS);
            }
            assert!(!f.on_loss(1200, false));
        }
    }

    /// One short sample on a 40 ms path (quinn's minimum then says 31 ms for the rest of the
    /// connection) dips the smoothed round trip for a few acknowledgements: the base hardly
    /// moves, and a random loss at 42 ms is still taken for random. Measured against the 31 ms
    /// sample it would look like a queue of 11 ms and be passed on, every time.
    #[test]
    fn one_short_round_trip_sample_does_not_make_every_loss_congestion() {
        let mut f = LossFilter::new();
        let mut srtt = 41.0f64;
        for i in 0..3000 {
            // RFC 6298's smoothing, as quinn does it, of samples of 41-42 ms and one of 31.
            let sample = if i == 2000 {
                31.0
            } else {
                41.0 + (i % 2) as f64
            };
            srtt = (7.0 * srtt + sample) / 8.0;
            f.on_ack(1200, Duration::from_secs_f64(srtt / 1e3));
        }
        assert!(f.base() > 40 * MS + 9 * MS / 10, "base {:?}", f.base());
        f.on_ack(1200, 42 * MS);
        assert!(!f.on_loss(1200, false), "a random loss was passed on");
    }

    /// A first round-trip sample timed short (8.3 ms on a 40 ms path) starts quinn's smoothed
    /// round trip there; the base is taken only after the warm-up, when the smoothed round
    /// trip has reached the path's, so random loss is still taken for random, during the
    /// warm-up too.
    #[test]
    fn a_short_first_sample_does_not_become_the_base() {
        let mut f = LossFilter::new();
        let mut srtt = 8.3f64;
        f.on_ack(1200, Duration::from_secs_f64(srtt / 1e3));
        assert!(
            !f.on_loss(1200, false),
            "a rare loss in the warm-up is tolerated"
        );
        for _ in 1..3000 {
            srtt = (7.0 * srtt + 40.5) / 8.0;
            f.on_ack(1200, Duration::from_secs_f64(srtt / 1e3));
        }
        assert!(f.base() > 40 * MS, "base {:?}", f.base());
        assert!(!f.on_loss(1200, false), "a random loss was passed on");
    }

    /// A burst of short samples drags even the smoothed round trip far down (28 ms here) for
    /// a few acknowledgements; the base moves by a small share of it, and random loss is
    /// still taken for random. (The least smoothed round trip would be 28 ms: a queue of 13.)
    #[test]
    fn a_burst_of_short_samples_hardly_moves_the_base() {
        let mut f = LossFilter::new();
        for _ in 0..2000 {
            f.on_ack(1200, 41 * MS);
        }
        assert_eq!(f.base(), 41 * MS);
        for rtt in [35, 30, 28, 30, 33, 36, 38, 40] {
            f.on_ack(1200, rtt * MS);
        }
        f.on_ack(1200, 41 * MS);
        assert!(f.base() > 39 * MS, "base {:?}", f.base());
        assert!(!f.on_loss(1200, false), "a random loss was passed on");
    }

    /// A path that got faster is followed; a round trip that grows (a queue a competing flow
    /// keeps standing) never raises the base, so that flow's losses keep being passed on, as
    /// CUBIC would answer them.
    #[test]
    fn the_base_follows_a_faster_path_and_never_rises() {
        let mut f = LossFilter::new();
        for _ in 0..1000 {
            f.on_ack(1200, 60 * MS);
        }
        assert_eq!(f.base(), 60 * MS);
        for _ in 0..1000 {
            f.on_ack(1200, 40 * MS);
        }
        assert!(f.base() < 40 * MS + MS / 10, "base {:?}", f.base());
        let base = f.base();
        for _ in 0..100_000 {
            f.on_ack(1200, 84 * MS);
        }
        assert_eq!(f.base(), base);
        assert!(
            f.on_loss(1200, false),
            "a loss at a standing queue is passed on"
        );
    }

    #[test]
    fn samples_of_a_sender_with_nothing_to_send_only_raise_the_rate() {
        let mut s = DeliveryRate::default();
        let mut now = Instant::now();
        s.on_ack(now, 500_000, false, 40 * MS);
        for _ in 0..3 {
            now += 40 * MS;
            s.on_ack(now, 500_000, false, 40 * MS);
        }
        let rate = s.rate();
        assert!((rate - 12.5e6).abs() < 1e3, "{rate}");
        for _ in 0..3 {
            now += 40 * MS;
            s.on_ack(now, 1_000, true, 40 * MS);
        }
        assert_eq!(s.rate(), rate);
        // Not limited by the application: a slower path is followed within ten samples.
        for _ in 0..RATE_SAMPLES {
            now += 40 * MS;
            s.on_ack(now, 100_000, false, 40 * MS);
        }
        assert!((s.rate() - 2.5e6).abs() < 1e3, "{}", s.rate());
        // The pipe of a 40 ms path at 2.5 MB/s: 100 KB.
        assert_eq!(s.pipe(40 * MS), 100_000);
        assert_eq!(DeliveryRate::default().pipe(40 * MS), 0, "no rate yet");
        assert_eq!(s.pipe(Duration::ZERO), 0, "no base yet");
    }

    /// A window CUBIC cut below the pipe (random losses met at a standing queue) is raised to
    /// it; one above it is CUBIC's; before a base or a rate is known, CUBIC's.
    #[test]
    fn the_window_is_never_below_the_pipe() {
        let mut s = DeliveryRate::default();
        let mut now = Instant::now();
        assert_eq!(s.floor(14_720, 40 * MS), 14_720, "no rate yet");
        s.on_ack(now, 0, false, 40 * MS);
        for _ in 0..3 {
            now += 40 * MS;
            s.on_ack(now, 500_000, false, 40 * MS);
        }
        // 12.5 MB/s over a 40 ms path: a pipe of 500 KB.
        assert_eq!(s.floor(272_000, 40 * MS), 500_000);
        assert_eq!(s.floor(1_500_000, 40 * MS), 1_500_000);
        assert_eq!(s.floor(272_000, Duration::ZERO), 272_000, "no base yet");
        // A competing flow's queue: the same window now delivers 40% of it over the round
        // trip it grew to, and the floor comes down with the rate within ten samples.
        for _ in 0..RATE_SAMPLES {
            now += 100 * MS;
            s.on_ack(now, 500_000, false, 100 * MS);
        }
        assert_eq!(s.floor(150_000, 40 * MS), 200_000);
        // Persistent congestion: no floor until the rate is measured again.
        s.forget();
        assert_eq!(s.floor(14_720, 40 * MS), 14_720);
    }
}
