//! The network tier's peer policy, sans-IO: which peer to ask for an expert, how long to wait
//! before racing a second one, how long a failing peer is avoided, when a peer that sent bad
//! bytes is dropped, when a peer may be dialled (and redialled after its connection was lost),
//! how the rounds over an expert's holders go on or end, how a record is striped over several
//! holders ([`stripes`]), and when a stripe has fallen far enough behind to move its rest to
//! another holder ([`far_behind`]).
//!
//! A peer's connection is in one of four states here: never tried or up (dial when needed),
//! unreachable (the last attempt failed: no attempt until its back-off ends), or lost (it was
//! up and went away: the peer may be restarting). A lost peer is redialled with back-off, at
//! most [`MAX_RECONNECTS`] failed attempts, and while it may still come back the loads that
//! have no other holder wait for it in rounds ([`coming_back`]) instead of failing at once;
//! after the last failed attempt it is unreachable. A peer whose very first attempt failed
//! (starting, or slow to answer on a busy machine) gets one more attempt that loads wait for,
//! and then no more rounds: a dead address costs one attempt per back-off, not one per load or
//! round.
//!
//! Nothing here touches a socket or reads a clock: every decision takes the time as an
//! argument (as quinn-proto and this crate's wire client do), so the whole policy is tested
//! by stepping a fake clock. The driver in [`super::tier`] owns the connections, keeps one
//! [`PeerView`] per peer under a lock, and asks these functions what to do.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use stormo_manifests::ExpertId;
use stormo_wire::ExpertSet;

/// Throughput assumed for a peer not yet measured (bytes per second).
pub const DEFAULT_RATE: f64 = 100e6;
/// The longest a failing peer is avoided.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Fetch durations remembered per peer (for its latency quantiles).
const LATENCY_SAMPLES: usize = 32;
/// Samples needed before quantiles replace the estimate from round trip and throughput.
const MIN_SAMPLES: usize = 4;

/// Most rounds over an expert's holders that verify nothing more of it and get no `busy`
/// answer, with no round that verifies more in between (see [`Rounds`]).
pub const MAX_ROUNDS: u32 = 4;

/// The per-try deadline stops doubling at this multiple of the first round's.
pub const MAX_TIMEOUT_FACTOR: u32 = 8;

/// One load's budget, in per-try deadlines of the first round: no later round or try starts,
/// and no try's deadline moves, past it.
pub const LOAD_BUDGET_FACTOR: u32 = MAX_ROUNDS * MAX_TIMEOUT_FACTOR;

/// Most failed attempts to reconnect to a peer whose connection was lost; after them it is
/// unreachable like a peer never reached.
pub const MAX_RECONNECTS: u32 = 3;
/// The pause after the first failed reconnection attempt, doubled after each later one.
pub const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// How long a connection may hear nothing at all, with a request of this node waiting on it,
/// before its peer is presumed gone (killed, stopped, its host down): longer than the
/// keep-alive interval, since a live peer acknowledges a keep-alive within a round trip. The
/// driver closes such a connection and redials it.
pub const SILENT_CONNECTION: Duration = Duration::from_secs(4);

/// Round trips a request may go unanswered by any datagram on its connection before the peer
/// is suspect (see [`silence_limit`]).
pub const SILENCE_RTTS: u32 = 4;

/// What [`silence_limit`] allows beyond the round trips: a peer reading a cold expert from its
/// disk sends nothing else meanwhile.
pub const SILENCE_GRACE: Duration = Duration::from_millis(750);

/// The round trip assumed for a peer not yet measured.
pub const DEFAULT_RTT: Duration = Duration::from_millis(100);

/// How long a connection with a request waiting on it may hear nothing at all (no answer, no
/// acknowledgement) before its peer is suspect: more than its measured latency explains,
/// [`SILENCE_RTTS`] round trips and [`SILENCE_GRACE`], never more than [`SILENT_CONNECTION`].
/// A load whose try waits on a suspect peer races another holder at once, and later tries
/// go to a suspect peer only when no other holder is left.
pub fn silence_limit(rtt: Option<Duration>) -> Duration {
    (rtt.unwrap_or(DEFAULT_RTT).saturating_mul(SILENCE_RTTS) + SILENCE_GRACE).min(SILENT_CONNECTION)
}

/// A connection that was up and was lost: redialled with back-off, a bounded number of times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lost {
    /// Failed reconnection attempts since it was lost.
    pub failed: u32,
    /// No attempt before this.
    pub next: Instant,
}

/// Whether the driver may dial a peer now ([`PeerView::dial`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dial {
    /// Connect now.
    Now,
    /// Not now: the last attempt failed `why`, and the next may start after `left`.
    Wait {
        /// Why the last attempt failed.
        why: String,
        /// Until an attempt may start again.
        left: Duration,
        /// The connection was lost and the peer may come back (a load without another holder
        /// waits for it in rounds); false: unreachable for its back-off.
        coming_back: bool,
    },
}

/// What the policy knows of one peer.
#[derive(Debug, Default)]
pub struct PeerView {
    /// The experts it holds, once connected (`None`: not known yet).
    pub inventory: Option<ExpertSet>,
    /// Its last placement announcement (room, pinned and claimed experts, demand), if any.
    pub placement: Option<stormo_wire::Placement>,
    /// The serving nodes it last said it has in its peer set (peer exchange: addresses to
    /// try, not facts).
    pub told: Vec<stormo_wire::PeerEntry>,
    /// Its control stream is open (a connection is up and following its inventory).
    pub control_open: bool,
    /// The experts it can fetch for this node from its own peers (one hop).
    pub offer: Option<ExpertSet>,
    /// Left the peer set: never chosen again.
    pub removed: bool,
    /// Sent bytes that failed verification: dropped for the rest of the session.
    pub banned: Option<String>,
    /// Requests in flight at it.
    pub in_flight: u32,
    /// Failures since its last success (sets the back-off).
    pub failures: u32,
    /// Failures in all.
    pub failures_total: u32,
    /// Not chosen before this, unless nothing else is left.
    pub avoid_until: Option<Instant>,
    /// Why the last connection attempt failed, until a connection succeeds: while the peer is
    /// avoided for it, tries fail at once instead of connecting again.
    pub unreachable: Option<String>,
    /// Its connection was up and was lost, and it is being redialled (see [`Lost`]).
    pub lost: Option<Lost>,
    /// Connection attempts made.
    pub connects: u32,
    /// A connection was made at some point.
    pub ever_connected: bool,
    /// Measured throughput, bytes per second.
    pub rate: Option<f64>,
    /// Round trip of its connection.
    pub rtt: Option<Duration>,
    /// Its connection's certificate carries a membership of this node's swarm (checked in the
    /// handshake): it may compute experts for this node by default ([`crate::remote::ExecTrust`]).
    pub member: bool,
    /// Seconds of its recent whole-expert fetches, newest last (a race it lost counts with
    /// the time it had taken so far: a lower bound).
    recent: VecDeque<f64>,
    /// Races it lost (it was slow; not a failure).
    pub races_lost: u32,
    /// Verified expert bytes received from it.
    pub bytes: u64,
    /// Its connection is up, as far as the driver knows (set on connecting, cleared when the
    /// connection is lost or found closed, or an attempt fails): a try at a peer that is not
    /// up waits for a dial.
    pub up: bool,
    /// When its connection last received a datagram (sampled by the driver).
    pub heard: Option<Instant>,
    /// When a request of this node was found waiting on its connection beyond
    /// [`silence_limit`]: suspect until the connection hears anything again
    /// ([`PeerView::suspect`]).
    pub silent_since: Option<Instant>,
    /// When the oldest request this node sent on its connection since it last heard anything
    /// was sent ([`PeerView::request_sent`]). A live peer acknowledges every request within a
    /// round trip, one cancelled since included, so the connection owes a datagram from then
    /// on, whatever became of the request: a stopped peer whose every try is raced and
    /// cancelled before its own silence limit is still found silent.
    pub owed_since: Option<Instant>,
}

impl PeerView {
    /// Remembers one fetch time.
    pub fn sample(&mut self, secs: f64) {
        if self.recent.len() == LATENCY_SAMPLES {
            self.recent.pop_front();
        }
        self.recent.push_back(secs);
    }

    /// The `q` quantile of the recent fetch times, once there are enough of them.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.recent.len() < MIN_SAMPLES {
            return None;
        }
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let at = ((v.len() - 1) as f64 * q).round() as usize;
        v.get(at).copied()
    }

    /// Seconds a fetch of `len` bytes is expected to take: the median of recent fetches, or
    /// before there are enough, round trip plus `len` over the measured (or assumed) rate.
    pub fn expected(&self, len: u64) -> f64 {
        self.quantile(0.5).unwrap_or_else(|| {
            self.rtt.map_or(0.001, |r| r.as_secs_f64())
                + len as f64 / self.rate.unwrap_or(DEFAULT_RATE)
        })
    }

    /// Whether it holds `id` (by its inventory).
    pub fn holds(&self, id: ExpertId) -> bool {
        self.inventory.as_ref().is_some_and(|inv| inv.contains(id))
    }

    /// Whether it offers `id` (fetching it from a peer of its own).
    pub fn offers(&self, id: ExpertId) -> bool {
        self.offer.as_ref().is_some_and(|o| o.contains(id))
    }

    /// Whether it may be asked at all: in the set and not dropped.
    pub fn usable(&self) -> bool {
        !self.removed && self.banned.is_none()
    }

    /// Whether it serves now as far as this node knows: usable, its control stream open, its
    /// connection neither lost nor failing, and not leaving. What a node offers to fetch for
    /// its own peers, and what coverage counts, come only from peers serving now.
    pub fn serving_now(&self) -> bool {
        self.usable()
            && self.control_open
            && self.lost.is_none()
            && self.unreachable.is_none()
            && !self.placement.as_ref().is_some_and(|w| w.leaving)
    }

    /// Whether it may supply `id`: it is usable and [`announces`](Self::announces) it.
    pub fn may_supply(&self, id: ExpertId) -> bool {
        self.usable() && self.announces(id)
    }

    /// Whether it holds or offers `id`, or has not said what it holds (usable or not).
    pub fn announces(&self, id: ExpertId) -> bool {
        self.inventory.is_none() || self.holds(id) || self.offers(id)
    }

    /// Whether, at `now`, its connection was found silent with a request waiting on it and
    /// has heard nothing since, or has heard nothing for [`silence_limit`] since a request was
    /// sent on it ([`PeerView::unanswered`]).
    pub fn suspect(&self, now: Instant) -> bool {
        self.flagged()
            || self
                .unanswered(now)
                .is_some_and(|q| q >= silence_limit(self.rtt))
    }

    /// Whether it was found silent ([`PeerView::suspect_silent`]) and has heard nothing since.
    fn flagged(&self) -> bool {
        self.silent_since
            .is_some_and(|t| self.heard.is_none_or(|h| h <= t))
    }

    /// Notes at `now` that a request (a fetch's, an exec call's) was sent on its connection.
    pub fn request_sent(&mut self, now: Instant) {
        if self.sent_unheard().is_none() {
            self.owed_since = Some(now);
        }
    }

    /// The oldest request sent since the connection last heard anything.
    fn sent_unheard(&self) -> Option<Instant> {
        self.owed_since
            .filter(|&o| self.heard.is_none_or(|h| h < o))
    }

    /// Since when the connection owes a datagram: from the oldest request sent since it last
    /// heard anything, or, while a fetch is in flight at the peer (its answer streaming or
    /// about to), from the last datagram heard: a live peer sending an answer keeps sending,
    /// so a fetch whose answer stalls mid-stream owes too (else a peer that died mid-answer
    /// went unnoticed until [`SILENT_CONNECTION`]).
    fn owed(&self) -> Option<Instant> {
        let streaming = self.heard.filter(|_| self.in_flight > 0);
        self.sent_unheard().or(streaming)
    }

    /// How long, at `now`, its connection has heard nothing since a request was sent on it
    /// (`None`: it heard something after every request sent).
    pub fn unanswered(&self, now: Instant) -> Option<Duration> {
        self.owed().map(|o| now.saturating_duration_since(o))
    }

    /// Notes at `now` that a request waited on its connection beyond [`silence_limit`].
    /// Returns true when it was not suspect already.
    pub fn suspect_silent(&mut self, now: Instant) -> bool {
        let new = !self.flagged();
        if new {
            self.silent_since = Some(now);
        }
        new
    }

    /// Whether it is waiting out a back-off at `now`.
    pub fn avoided(&self, now: Instant) -> bool {
        self.avoid_until.is_some_and(|t| t > now)
    }

    /// Notes a failure at `now`: avoided for a back-off that doubles with each failure in a
    /// row (1 s, 2 s, ... up to [`MAX_BACKOFF`]). Returns the back-off.
    pub fn fail(&mut self, now: Instant) -> Duration {
        self.failures += 1;
        self.failures_total += 1;
        let backoff = Duration::from_millis(500)
            .saturating_mul(1 << self.failures.min(8))
            .min(MAX_BACKOFF);
        self.avoid_until = Some(now + backoff);
        backoff
    }

    /// Notes a verified fetch of `len` bytes that took `secs`: the back-off ends and the
    /// throughput and latency estimates take it in.
    pub fn succeed(&mut self, len: u64, secs: f64) {
        let secs = secs.max(1e-6);
        let r = len as f64 / secs;
        self.rate = Some(self.rate.map_or(r, |old| 0.8 * old + 0.2 * r));
        self.sample(secs);
        self.failures = 0;
        self.avoid_until = None;
    }

    /// Whether the driver may dial it at `now` (when it has no live connection); counts the
    /// attempt when it may. A lost peer may be dialled once its reconnection pause is over; an
    /// unreachable one once its back-off is.
    pub fn dial(&mut self, now: Instant) -> Dial {
        let why = || {
            self.unreachable
                .clone()
                .unwrap_or_else(|| "connection lost".into())
        };
        if let Some(l) = self.lost {
            if l.next > now {
                return Dial::Wait {
                    why: why(),
                    left: l.next - now,
                    coming_back: true,
                };
            }
        } else if let (Some(_), Some(until)) = (&self.unreachable, self.avoid_until) {
            if until > now {
                return Dial::Wait {
                    why: why(),
                    left: until - now,
                    coming_back: false,
                };
            }
        }
        self.connects += 1;
        Dial::Now
    }

    /// Notes a connection made: it is neither unreachable nor lost any more.
    pub fn connected(&mut self, now: Instant) {
        self.unreachable = None;
        self.lost = None;
        self.ever_connected = true;
        self.up = true;
        self.heard = Some(now);
        self.silent_since = None;
        self.owed_since = None;
    }

    /// Notes a failed connection attempt at `now`: the peer is unreachable for a back-off (see
    /// [`PeerView::fail`]); a lost one is redialled after [`RECONNECT_PAUSE`] doubled per
    /// failed attempt, until [`MAX_RECONNECTS`] have failed, when it is no longer coming back.
    /// Returns the back-off.
    pub fn dial_failed(&mut self, why: &str, now: Instant) -> Duration {
        self.unreachable = Some(why.to_string());
        self.up = false;
        let backoff = self.fail(now);
        if !self.ever_connected && self.connects == 1 {
            // The very first attempt: the peer may be starting, or slow to answer on a busy
            // machine. One more attempt, which loads without another source wait for; then
            // it is unreachable like any.
            self.lost = Some(Lost {
                failed: MAX_RECONNECTS - 1,
                next: now + RECONNECT_PAUSE,
            });
            return backoff;
        }
        if let Some(l) = self.lost.as_mut() {
            l.failed += 1;
            if l.failed >= MAX_RECONNECTS {
                self.lost = None;
            } else {
                l.next = now + RECONNECT_PAUSE.saturating_mul(1 << (l.failed - 1));
            }
        }
        backoff
    }

    /// Notes at `now` that its live connection was lost (closed by the peer or the network,
    /// or silent for the silence deadline): it may be restarting, so it is redialled (at once
    /// the first time) and loads without another holder wait for it. Counts as one failure
    /// however many loads saw the loss. Returns true when the loss is new.
    pub fn lose(&mut self, now: Instant) -> bool {
        self.up = false;
        if self.lost.is_some() || !self.usable() {
            return false;
        }
        self.fail(now);
        self.lost = Some(Lost {
            failed: 0,
            next: now,
        });
        true
    }

    /// When it may be dialled again if it is coming back (lost, with attempts left, usable).
    pub fn coming_back(&self, now: Instant) -> Option<Instant> {
        self.lost.filter(|_| self.usable()).map(|l| l.next.max(now))
    }

    /// Drops the peer for the session: it sent bytes that failed verification. Returns true
    /// the first time (so the caller names it once).
    pub fn ban(&mut self, why: &str) -> bool {
        self.failures_total += 1;
        if self.banned.is_some() {
            return false;
        }
        self.banned = Some(why.to_string());
        true
    }
}

/// The best peer for `id` among `peers` (index, view) not in `tried`: holders not avoided and
/// not suspect first, then peers that offer it, then those whose connection is up (a try
/// never waits on a redial while another holder is connected), then fewest in flight, then the
/// shortest expected time. A peer that has not said what it holds may hold it: it is tried,
/// but after the others.
pub fn choose<'a>(
    peers: impl IntoIterator<Item = (usize, &'a PeerView)>,
    id: ExpertId,
    len: u64,
    tried: &HashSet<usize>,
    now: Instant,
) -> Option<usize> {
    // Avoided or suspect, offers rather than holds, needs a dial, requests in flight.
    type Rank = (bool, bool, bool, u32);
    let mut best: Option<(Rank, f64, usize)> = None;
    for (i, p) in peers {
        if tried.contains(&i) || !p.may_supply(id) {
            continue;
        }
        let unknown = p.inventory.is_none();
        let avoided = unknown || p.avoided(now) || p.suspect(now);
        let cand = (
            (avoided, !p.holds(id), !p.up, p.in_flight),
            p.expected(len),
            i,
        );
        // Expected times within a tenth or 5 ms of each other are a tie (an unmeasured peer's
        // estimate differs from another's by round-trip noise): the earlier peer in the set
        // keeps it, so peers given in an order are asked in that order.
        if best.as_ref().is_none_or(|b| {
            cand.0 < b.0 || (cand.0 == b.0 && cand.1 < b.1 - (0.1 * b.1).max(0.005))
        }) {
            best = Some(cand);
        }
    }
    best.map(|b| b.2)
}

/// Whether a peer not in `tried` may still supply `id` in this round: one that may supply it
/// and is not waiting out a back-off for being unreachable (a try at that fails at once).
pub fn other_holder_left<'a>(
    peers: impl IntoIterator<Item = (usize, &'a PeerView)>,
    id: ExpertId,
    tried: &HashSet<usize>,
    now: Instant,
) -> bool {
    peers.into_iter().any(|(i, p)| {
        !tried.contains(&i) && p.may_supply(id) && !(p.unreachable.is_some() && p.avoided(now))
    })
}

/// Whether a holder other than peer `running` could take over the rest of a stripe of `id`
/// that fell behind: one that holds it by its inventory, is not avoided or unreachable, and
/// has no fetch of this node's in flight. A busy holder is left alone: with several loads
/// sharing the links (a prefill's), a finished stripe's rate says what its holder did before
/// the next loads reached it, not what it would do for this one; moving then only throws away
/// what the slow holder had on the wire and adds a request to a full one (measured: in
/// `stormo sim --scenario stripe` the moves went back and forth and the holders answered
/// busy). An idle holder is what a laggard's share moves to, as in BitTorrent's end game.
pub fn idle_holder_left<'a>(
    peers: impl IntoIterator<Item = (usize, &'a PeerView)>,
    id: ExpertId,
    running: usize,
    now: Instant,
) -> bool {
    peers.into_iter().any(|(i, p)| {
        i != running
            && p.usable()
            && p.holds(id)
            && p.in_flight == 0
            && !p.avoided(now)
            && !p.suspect(now)
            && p.unreachable.is_none()
    })
}

/// The earliest time a peer that may supply `id` and whose connection was lost may be dialled
/// again (see [`PeerView::coming_back`]): a load with no other source waits until then for
/// another round instead of failing. `None`: no such peer.
pub fn coming_back<'a>(
    peers: impl IntoIterator<Item = (usize, &'a PeerView)>,
    id: ExpertId,
    now: Instant,
) -> Option<Instant> {
    peers
        .into_iter()
        .filter(|(_, p)| p.may_supply(id))
        .filter_map(|(_, p)| p.coming_back(now))
        .min()
}

/// How long a demand request to `p` runs before it is raced by a second one: the p95 of its
/// recent fetch times (before there are enough, three times the expected time), within
/// `[min, max]` and never past `request_timeout`.
pub fn hedge_delay(
    p: &PeerView,
    len: u64,
    min: Duration,
    max: Duration,
    request_timeout: Duration,
) -> Duration {
    let secs = p.quantile(0.95).unwrap_or_else(|| 3.0 * p.expected(len));
    let max = max.min(request_timeout);
    Duration::from_secs_f64(secs.clamp(0.0, 1e6)).clamp(min.min(max), max)
}

/// The rounds of one load over an expert's holders: after each round that some try made
/// worth repeating (a peer still sending at its deadline, a `busy` answer, or a lost
/// connection that may come back), the pause before the next, or the end of the load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rounds {
    /// Rounds in a row that verified nothing more.
    quiet: u32,
    /// Of those, the rounds in which no peer answered `busy` either (busy rounds neither count
    /// nor start the count again).
    stalls: u32,
}

impl Rounds {
    /// After a round that `progressed` (verified more of the expert) or not, in which some
    /// peer answered `busy` or not: the pause before the next round, or `None` after
    /// [`MAX_ROUNDS`] stalled rounds with no progress between them. A peer that is busy with
    /// this node's other loads or sends slowly but surely costs time, not the load; one that
    /// sends nothing more (without being busy) ends it. The pause is short after progress and
    /// grows (to 2 s) with the quiet rounds, so that a busy peer has time to finish what it is
    /// sending, and a restarted one to come back.
    pub fn next(&mut self, progressed: bool, busy: bool) -> Option<Duration> {
        if progressed {
            *self = Self::default();
            return Some(Duration::from_millis(250));
        }
        self.quiet += 1;
        if !busy {
            self.stalls += 1;
        }
        (self.stalls < MAX_ROUNDS).then(|| Duration::from_millis(250 << self.quiet.min(3)))
    }
}

/// How a round over an expert's holders ended (every holder tried), for [`Rounds::after`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundEnd {
    /// It verified more of the expert.
    pub progressed: bool,
    /// Some peer answered `busy`.
    pub busy: bool,
    /// Some try ran out of time while its peer was still sending.
    pub slow: bool,
    /// A holder whose connection was lost may be dialled again at this time (see
    /// [`coming_back`]; the driver leaves it out when another source, the local disk, holds
    /// the expert).
    pub coming_back: Option<Instant>,
}

impl Rounds {
    /// After a round at `now` that ended as `end`: the pause before the next round, or `None`
    /// to end the load. Another round is worth it only when a peer was slow or busy, or a lost
    /// holder may come back; the pause is the rounds' (see [`Rounds::next`]) or, when longer,
    /// the wait until that holder may be dialled; and no pause runs past `clock`'s budget.
    /// Rounds spent waiting for a lost holder count as stalled rounds, and its reconnection
    /// attempts are bounded too ([`MAX_RECONNECTS`]), so a holder that does not come back ends
    /// the load within both bounds.
    pub fn after(&mut self, end: RoundEnd, clock: &LoadClock, now: Instant) -> Option<Duration> {
        if !(end.slow || end.busy || end.coming_back.is_some()) {
            return None;
        }
        let pause = self.next(end.progressed, end.busy)?;
        let pause = end
            .coming_back
            .map_or(pause, |t| pause.max(t.saturating_duration_since(now)));
        clock.fits(now, pause).then_some(pause)
    }
}

/// The smallest stripe of a record fetched from several holders at once. A record shorter
/// than two of them is fetched whole from one peer, as is any record with one holder: each
/// stripe costs a request of its own (a stream, a `Get`, a round trip before its first byte)
/// and a chunk verified apart, which at 1 MiB is about a millisecond of a 1 GB/s link or a
/// tenth of a 100 Mbit/s one, against a round trip of a fraction of a millisecond on a LAN:
/// a few percent at most, while every byte past it comes from a second link.
pub const MIN_STRIPE: u64 = 1 << 20;

/// The most holders one record is striped across.
pub const MAX_STRIPES: usize = 8;

/// A stripe's try is moved to another holder when its rate is below the fastest finished
/// stripe's divided by this (see [`far_behind`]).
pub const FAR_BEHIND: f64 = 2.0;

/// A stripe's try is judged on its rate only after it ran this long.
pub const MIN_OBSERVE: Duration = Duration::from_millis(50);

/// One stripe of a record: bytes `start..end`, asked first of peer `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stripe {
    /// The stripe's first byte in the record (on a chunk boundary).
    pub start: u64,
    /// The end of the stripe (on a chunk boundary, or the record's end).
    pub end: u64,
    /// The holder asked first (an index into the peers given to [`stripes`]).
    pub peer: usize,
}

/// How to stripe a record of `len` bytes in chunks of `chunk` over the peers `peers` (index,
/// view) that may serve `id`, at `now`: `None` to fetch it whole from one peer (fewer than two
/// holders ready, or a record shorter than two stripes of `min_stripe`). Only holders by their
/// inventory take part, not avoided, not unreachable, and not offerers (which fetch it
/// themselves first); at most [`MAX_STRIPES`] of them, in [`choose`]'s order. Each one's
/// share is proportional to its measured (or assumed) rate, cut on chunk boundaries, at least
/// `min_stripe` (the slowest holders are left out until every share is).
pub fn stripes<'a>(
    peers: impl IntoIterator<Item = (usize, &'a PeerView)>,
    id: ExpertId,
    len: u64,
    chunk: u64,
    min_stripe: u64,
    now: Instant,
) -> Option<Vec<Stripe>> {
    let chunk = chunk.max(1);
    let min_stripe = min_stripe.max(chunk);
    let ready: Vec<(usize, &PeerView)> = peers
        .into_iter()
        .filter(|(_, p)| {
            p.usable()
                && p.holds(id)
                && !p.avoided(now)
                && !p.suspect(now)
                && p.unreachable.is_none()
        })
        .collect();
    if ready.len() < 2 || len < min_stripe.saturating_mul(2) {
        return None;
    }
    // In the order `choose` would ask them.
    let mut order = Vec::with_capacity(ready.len());
    let mut tried = HashSet::new();
    while let Some(i) = choose(ready.iter().copied(), id, len, &tried, now) {
        tried.insert(i);
        order.push(i);
    }
    let rate = |i: usize| {
        let p = ready.iter().find(|(j, _)| *j == i).map(|(_, p)| *p);
        p.and_then(|p| p.rate).unwrap_or(DEFAULT_RATE).max(1.0)
    };
    let most = usize::try_from(len / min_stripe).unwrap_or(usize::MAX);
    order.truncate(MAX_STRIPES.min(most));
    let chunks = len.div_ceil(chunk);
    loop {
        if order.len() < 2 {
            return None;
        }
        let total: f64 = order.iter().map(|&i| rate(i)).sum();
        // Chunk counts proportional to the rates: each stripe ends at the rounded share of
        // the rates so far (so rounding never piles up on the last), the last at the end.
        let mut out = Vec::with_capacity(order.len());
        let (mut at, mut sum) = (0u64, 0.0);
        for (k, &i) in order.iter().enumerate() {
            sum += rate(i);
            let start = (at * chunk).min(len);
            at = if k + 1 == order.len() {
                chunks
            } else {
                ((chunks as f64 * sum / total).round() as u64).clamp(at, chunks)
            };
            out.push(Stripe {
                start,
                end: (at * chunk).min(len),
                peer: i,
            });
        }
        if out.iter().all(|s| s.end - s.start >= min_stripe) {
            return Some(out);
        }
        // The slowest holder goes (the last of the fastest-first order on ties).
        let slowest = (0..order.len())
            .rev()
            .min_by(|&a, &b| rate(order[a]).total_cmp(&rate(order[b])))
            .expect("at least two holders");
        order.remove(slowest);
    }
}

/// What the driver of a striped load knows of one stripe, for [`far_behind`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StripeState {
    /// Verified whole, at `rate` bytes per second (its last try's).
    Done {
        /// Bytes per second of the try that finished it.
        rate: f64,
    },
    /// A try is running since `since`, when `verified_at_start` bytes of the stripe were
    /// verified; `verified` are now, of `len`.
    Running {
        /// When the try began.
        since: Instant,
        /// Bytes of the stripe verified then.
        verified_at_start: u64,
        /// Bytes of the stripe verified now.
        verified: u64,
        /// The stripe's length.
        len: u64,
        /// Another holder than this try's peer may take the rest (moving it back to the same
        /// peer would only throw away what it has sent).
        elsewhere: bool,
    },
    /// Between tries (waiting for a round, a connection, or a request slot).
    Waiting,
}

/// The stripe whose try has fallen far behind at `now`, to move its unverified remainder to
/// another holder: of the running tries that another holder could take over, that ran at
/// least [`MIN_OBSERVE`] and have at least one `chunk` left, one whose rate is below the fastest finished stripe's divided by
/// [`FAR_BEHIND`] (a stalled try's rate is 0), the one that would take longest to finish at
/// its rate. `None` before some stripe has finished (no holder is free to take it on, and
/// nothing to compare with).
pub fn far_behind(stripes: &[StripeState], chunk: u64, now: Instant) -> Option<usize> {
    let fastest = stripes
        .iter()
        .filter_map(|s| match s {
            StripeState::Done { rate } => Some(*rate),
            _ => None,
        })
        .max_by(f64::total_cmp)?;
    let mut worst: Option<(f64, usize)> = None;
    for (k, s) in stripes.iter().enumerate() {
        let &StripeState::Running {
            since,
            verified_at_start,
            verified,
            len,
            elsewhere: true,
        } = s
        else {
            continue;
        };
        let ran = now.saturating_duration_since(since);
        let left = len.saturating_sub(verified);
        if ran < MIN_OBSERVE || left < chunk.max(1) {
            continue;
        }
        let rate = verified.saturating_sub(verified_at_start) as f64 / ran.as_secs_f64();
        if rate * FAR_BEHIND >= fastest {
            continue;
        }
        let eta = if rate > 0.0 {
            left as f64 / rate
        } else {
            f64::INFINITY
        };
        if worst.is_none_or(|(w, _)| eta > w) {
            worst = Some((eta, k));
        }
    }
    worst.map(|w| w.1)
}

/// The time limits of one load: the first round's per-try deadline, doubled each round up to
/// [`MAX_TIMEOUT_FACTOR`] times, and the load's budget of [`LOAD_BUDGET_FACTOR`] first
/// deadlines from its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadClock {
    /// The per-try deadline of the current round.
    pub timeout: Duration,
    first: Duration,
    /// When the load must end.
    pub end: Instant,
}

impl LoadClock {
    /// A load starting at `now` with per-try deadline `timeout`.
    pub fn new(timeout: Duration, now: Instant) -> Self {
        Self {
            timeout,
            first: timeout,
            end: now + timeout.saturating_mul(LOAD_BUDGET_FACTOR),
        }
    }

    /// The load's whole budget.
    pub fn budget(&self) -> Duration {
        self.first.saturating_mul(LOAD_BUDGET_FACTOR)
    }

    /// Whether the budget is spent at `now`.
    pub fn spent(&self, now: Instant) -> bool {
        now >= self.end
    }

    /// Whether a pause of `pause` from `now` still ends within the budget.
    pub fn fits(&self, now: Instant, pause: Duration) -> bool {
        now + pause < self.end
    }

    /// Moves to the next round: the per-try deadline doubles (within its cap).
    pub fn next_round(&mut self) {
        self.timeout = self
            .timeout
            .saturating_mul(2)
            .min(self.first.saturating_mul(MAX_TIMEOUT_FACTOR));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fetch whose answer stalls mid-stream owes data from the last datagram heard (the
    /// peer was sending), so it turns suspect once that is longer than its latency explains;
    /// with nothing in flight, a connection heard from after its last request owes nothing.
    #[test]
    fn a_fetch_stalled_mid_stream_owes_from_the_last_datagram() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut v = PeerView {
            rtt: Some(Duration::from_millis(1)),
            ..PeerView::default()
        };
        v.connected(t0);
        v.request_sent(ms(10));
        v.in_flight = 1;
        // Answer bytes arrive until 100 ms, then nothing.
        v.heard = Some(ms(100));
        assert_eq!(v.unanswered(ms(500)), Some(Duration::from_millis(400)));
        assert!(!v.suspect(ms(800)));
        assert!(v.suspect(ms(860)), "754 ms after the last datagram");
        // The fetch ended (or was cancelled): nothing is owed.
        v.in_flight = 0;
        assert_eq!(v.unanswered(ms(900)), None);
        // A new request owes from its own send, not from the last datagram.
        v.request_sent(ms(1000));
        v.in_flight = 1;
        assert_eq!(v.unanswered(ms(1100)), Some(Duration::from_millis(100)));
    }

    fn id(layer: u16, expert: u16) -> ExpertId {
        ExpertId { layer, expert }
    }

    fn inv(ids: &[ExpertId]) -> ExpertSet {
        let mut s = ExpertSet::new(2, 4).expect("shape");
        for &e in ids {
            s.insert(e).expect("in shape");
        }
        s
    }

    fn holding(ids: &[ExpertId]) -> PeerView {
        PeerView {
            inventory: Some(inv(ids)),
            ..PeerView::default()
        }
    }

    fn views(v: &[PeerView]) -> impl Iterator<Item = (usize, &PeerView)> {
        v.iter().enumerate()
    }

    /// A connection owes a datagram from the oldest request sent since it last heard: later
    /// requests do not move that on, anything heard clears it, and once it is owed for the
    /// silence limit the peer is suspect until heard (or connected) again.
    #[test]
    fn a_connection_owes_from_its_oldest_unanswered_request() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut p = PeerView {
            rtt: Some(Duration::from_millis(1)),
            heard: Some(t0),
            ..PeerView::default()
        };
        let limit = silence_limit(p.rtt);
        assert_eq!(limit, Duration::from_millis(754));
        assert_eq!(p.unanswered(ms(5)), None, "nothing sent");
        p.request_sent(ms(10));
        p.request_sent(ms(500));
        assert_eq!(p.unanswered(ms(600)), Some(Duration::from_millis(590)));
        assert!(!p.suspect(ms(763)));
        assert!(p.suspect(ms(764)), "owed since the first request");
        // Heard: owed no more; the next request starts the clock again.
        p.heard = Some(ms(800));
        assert!(!p.suspect(ms(900)));
        p.request_sent(ms(900));
        assert!(!p.suspect(ms(1653)));
        assert!(p.suspect(ms(1654)));
        p.connected(ms(1700));
        assert_eq!(p.unanswered(ms(3000)), None);
        assert!(!p.suspect(ms(3000)));
    }

    /// A holder is chosen over a peer that only offers, which is chosen over one that has not
    /// said; a peer that holds nothing of it never is.
    #[test]
    fn holders_before_offers_before_the_unknown() {
        let t0 = Instant::now();
        let x = id(0, 1);
        let offering = PeerView {
            inventory: Some(inv(&[])),
            offer: Some(inv(&[x])),
            ..PeerView::default()
        };
        let peers = vec![
            PeerView::default(),
            offering,
            holding(&[x]),
            holding(&[id(1, 1)]),
        ];
        let mut tried = HashSet::new();
        let order: Vec<usize> = std::iter::from_fn(|| {
            let i = choose(views(&peers), x, 100, &tried, t0)?;
            tried.insert(i);
            Some(i)
        })
        .collect();
        assert_eq!(
            order,
            [2, 1, 0],
            "holder, offerer, unknown; never the non-holder"
        );
    }

    /// A failing peer is avoided for a back-off that doubles and is capped; others go first
    /// meanwhile; once the back-off is over (time passed in) it is a candidate like any.
    #[test]
    fn back_off_doubles_is_capped_and_ends_on_the_clock() {
        let t0 = Instant::now();
        let x = id(0, 0);
        let mut peers = vec![holding(&[x]), holding(&[x])];
        let mut last = Duration::ZERO;
        for n in 1..=10 {
            let b = peers[0].fail(t0);
            assert!(b >= last, "back-off shrank at failure {n}");
            assert!(b <= MAX_BACKOFF);
            last = b;
        }
        assert_eq!(last, MAX_BACKOFF);
        peers[0].failures = 0;
        let b = peers[0].fail(t0);
        assert_eq!(b, Duration::from_secs(1));
        // The other, equal in all else, is chosen while the first is avoided ...
        assert_eq!(choose(views(&peers), x, 100, &HashSet::new(), t0), Some(1));
        // ... but the first is still chosen when it is the only one left.
        let tried: HashSet<usize> = [1].into();
        assert_eq!(choose(views(&peers), x, 100, &tried, t0), Some(0));
        // After the back-off it competes again: make it the faster.
        peers[0].succeed(1000, 0.001);
        peers[1].rate = Some(1.0);
        let later = t0 + Duration::from_millis(1001);
        assert_eq!(
            choose(views(&peers), x, 1000, &HashSet::new(), later),
            Some(0)
        );
    }

    /// A peer that sent bad bytes is dropped for the session: never chosen again, whatever
    /// the clock says, and named once.
    #[test]
    fn a_peer_that_sent_bad_bytes_is_never_asked_again() {
        let t0 = Instant::now();
        let x = id(1, 3);
        let mut peers = vec![holding(&[x]), holding(&[x])];
        assert!(peers[0].ban("chunk 0 failed verification"));
        assert!(!peers[0].ban("again"), "named once");
        for later in [t0, t0 + Duration::from_secs(3600)] {
            assert_eq!(choose(views(&peers), x, 1, &HashSet::new(), later), Some(1));
        }
        let tried: HashSet<usize> = [1].into();
        assert_eq!(choose(views(&peers), x, 1, &tried, t0), None);
        assert!(!other_holder_left(views(&peers), x, &tried, t0));
    }

    /// An unreachable peer in its back-off does not count as a holder left in the round; once
    /// the back-off has passed it does again (a restarted holder is tried again).
    #[test]
    fn an_unreachable_holder_counts_again_after_its_back_off() {
        let t0 = Instant::now();
        let x = id(0, 2);
        let mut p = holding(&[x]);
        p.unreachable = Some("connection refused".into());
        let b = p.fail(t0);
        let peers = vec![p];
        assert!(!other_holder_left(views(&peers), x, &HashSet::new(), t0));
        assert!(other_holder_left(views(&peers), x, &HashSet::new(), t0 + b));
    }

    /// A stripe that fell behind moves only to another holder that is idle: one with a
    /// fetch of this node in flight, an offerer, a banned or an unreachable peer does not
    /// count, nor does the stripe's own holder.
    #[test]
    fn a_laggard_moves_only_to_an_idle_holder() {
        let t0 = Instant::now();
        let x = id(1, 2);
        let mut peers = vec![holding(&[x]), holding(&[x])];
        assert!(idle_holder_left(views(&peers), x, 0, t0));
        assert!(idle_holder_left(views(&peers), x, 1, t0));
        peers[1].in_flight = 1;
        assert!(!idle_holder_left(views(&peers), x, 0, t0), "busy");
        assert!(idle_holder_left(views(&peers), x, 1, t0), "0 is idle");
        peers[1].in_flight = 0;
        assert!(
            !idle_holder_left(views(&peers), id(1, 3), 0, t0),
            "holds other"
        );
        let offering = PeerView {
            inventory: Some(inv(&[])),
            offer: Some(inv(&[x])),
            ..PeerView::default()
        };
        let lone = vec![holding(&[x]), offering];
        assert!(!idle_holder_left(views(&lone), x, 0, t0), "an offerer");
        assert!(peers[1].ban("chunk 3 failed verification"));
        assert!(!idle_holder_left(views(&peers), x, 0, t0), "banned");
        let mut gone = holding(&[x]);
        gone.unreachable = Some("connection refused".into());
        let peers = vec![holding(&[x]), gone];
        assert!(!idle_holder_left(views(&peers), x, 0, t0), "unreachable");
    }

    /// Near-equal expected times keep the set's order (round-trip noise decides nothing).
    #[test]
    fn near_ties_keep_the_order_of_the_set() {
        let t0 = Instant::now();
        let x = id(0, 0);
        let mut peers = vec![holding(&[x]), holding(&[x])];
        peers[0].rtt = Some(Duration::from_micros(2500));
        peers[1].rtt = Some(Duration::from_micros(80));
        assert_eq!(
            choose(views(&peers), x, 1 << 20, &HashSet::new(), t0),
            Some(0)
        );
        peers[0].rate = Some(1e6);
        assert_eq!(
            choose(views(&peers), x, 1 << 20, &HashSet::new(), t0),
            Some(1)
        );
    }

    /// Fewer requests in flight wins among holders; then the shorter expected time.
    #[test]
    fn load_spreads_by_in_flight_then_speed() {
        let t0 = Instant::now();
        let x = id(0, 0);
        let mut peers = vec![holding(&[x]), holding(&[x])];
        peers[0].rate = Some(1e9);
        peers[1].rate = Some(1e6);
        assert_eq!(
            choose(views(&peers), x, 1 << 20, &HashSet::new(), t0),
            Some(0)
        );
        peers[0].in_flight = 2;
        assert_eq!(
            choose(views(&peers), x, 1 << 20, &HashSet::new(), t0),
            Some(1)
        );
    }

    /// The hedge delay follows the measured p95, within its bounds and the request timeout.
    #[test]
    fn hedge_delay_follows_measurements_within_bounds() {
        let (min, max, rt) = (
            Duration::from_millis(20),
            Duration::from_secs(2),
            Duration::from_secs(30),
        );
        let mut p = PeerView::default();
        // Unmeasured: three times the expected time at the assumed rate (100 MB/s: 30 ms).
        let d = hedge_delay(&p, 1_000_000, min, max, rt);
        assert!((d.as_secs_f64() - 0.033).abs() < 0.002, "{d:?}");
        for _ in 0..10 {
            p.sample(0.5);
        }
        assert_eq!(hedge_delay(&p, 1, min, max, rt), Duration::from_millis(500));
        for _ in 0..32 {
            p.sample(100.0);
        }
        assert_eq!(hedge_delay(&p, 1, min, max, rt), max);
        assert_eq!(
            hedge_delay(&p, 1, min, max, Duration::from_secs(1)),
            Duration::from_secs(1)
        );
    }

    /// The load's clock: deadlines double per round up to the cap; the budget bounds pauses.
    #[test]
    fn the_load_clock_doubles_deadlines_and_bounds_the_budget() {
        let t0 = Instant::now();
        let mut c = LoadClock::new(Duration::from_secs(1), t0);
        assert_eq!(
            c.budget(),
            Duration::from_secs(u64::from(LOAD_BUDGET_FACTOR))
        );
        let mut seen = vec![c.timeout];
        for _ in 0..6 {
            c.next_round();
            seen.push(c.timeout);
        }
        let secs: Vec<u64> = seen.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [1, 2, 4, 8, 8, 8, 8]);
        assert!(c.fits(t0, Duration::from_secs(1)));
        let near_end = t0 + c.budget() - Duration::from_millis(100);
        assert!(!c.fits(near_end, Duration::from_millis(250)));
        assert!(c.spent(t0 + c.budget()));
    }

    /// A peer whose connection was lost is redialled at once, then after a pause that
    /// doubles per failed attempt; after [`MAX_RECONNECTS`] failures it is unreachable like a
    /// peer never reached (its back-off refuses dials, and it is no longer coming back). A
    /// success ends all of it.
    #[test]
    fn a_lost_peer_is_redialled_with_back_off_a_bounded_number_of_times() {
        let t0 = Instant::now();
        let x = id(0, 1);
        let mut p = holding(&[x]);
        assert_eq!(p.dial(t0), Dial::Now, "a peer never tried is dialled");
        p.connected(t0);
        assert!(p.lose(t0), "a new loss");
        assert!(!p.lose(t0), "the same loss seen by another load");
        assert_eq!(
            p.failures, 1,
            "one loss is one failure, however many loads saw it"
        );
        assert_eq!(p.coming_back(t0), Some(t0));
        assert_eq!(p.dial(t0), Dial::Now, "the first redial is at once");
        let mut now = t0;
        let mut pauses = Vec::new();
        for n in 1..MAX_RECONNECTS {
            now += Duration::from_secs(3);
            p.dial_failed("no answer within 3.0s", now);
            let next = p.coming_back(now).expect("still coming back");
            pauses.push(next - now);
            match p.dial(now) {
                Dial::Wait {
                    coming_back: true,
                    left,
                    why,
                } => {
                    assert_eq!(left, next - now);
                    assert!(why.contains("no answer"), "{why}");
                }
                d => panic!("dialled during the pause after failure {n}: {d:?}"),
            }
            assert_eq!(p.dial(next), Dial::Now, "after the pause");
        }
        assert_eq!(
            pauses,
            [RECONNECT_PAUSE, RECONNECT_PAUSE * 2][..(MAX_RECONNECTS - 1) as usize]
        );
        now += Duration::from_secs(3);
        let backoff = p.dial_failed("no answer within 3.0s", now);
        assert_eq!(p.coming_back(now), None, "given up after {MAX_RECONNECTS}");
        assert!(matches!(
            p.dial(now),
            Dial::Wait {
                coming_back: false,
                ..
            }
        ));
        assert_eq!(
            p.dial(now + backoff),
            Dial::Now,
            "tried again after the back-off"
        );
        p.connected(now + backoff);
        assert_eq!(p.unreachable, None);
        assert!(p.lose(now), "a loss after a reconnection is a new one");
    }

    /// A peer whose first attempt failed gets one more attempt, after a pause, and is then
    /// not coming back (a dead address costs no more rounds); nor is a lost peer that was
    /// removed or dropped, or one that does not hold the expert.
    #[test]
    fn only_a_lost_usable_holder_is_coming_back() {
        let t0 = Instant::now();
        let (x, y) = (id(0, 1), id(1, 2));
        let mut never = holding(&[x]);
        assert_eq!(never.dial(t0), Dial::Now);
        never.dial_failed("no answer within 3.0s", t0);
        assert_eq!(
            never.coming_back(t0),
            Some(t0 + RECONNECT_PAUSE),
            "one more try"
        );
        assert_eq!(never.dial(t0 + RECONNECT_PAUSE), Dial::Now);
        never.dial_failed("no answer within 3.0s", t0 + RECONNECT_PAUSE);
        assert_eq!(never.coming_back(t0 + RECONNECT_PAUSE), None, "and no more");
        let mut banned = holding(&[x]);
        banned.lose(t0);
        banned.ban("bad chunk");
        let mut other = holding(&[y]);
        other.lose(t0);
        let peers = vec![never, banned, other];
        assert_eq!(coming_back(views(&peers), x, t0), None);
        assert_eq!(coming_back(views(&peers), y, t0), Some(t0));
        let mut removed = holding(&[x]);
        removed.removed = true;
        assert!(!removed.lose(t0));
    }

    /// A round after which a lost holder is coming back is followed by another, paused until
    /// it may be dialled; without one (and nothing slow or busy) the load ends; rounds spent
    /// waiting are stalls, so they end after [`MAX_ROUNDS`]; no pause passes the budget.
    #[test]
    fn rounds_wait_for_a_holder_coming_back_within_their_bounds() {
        let t0 = Instant::now();
        let clock = LoadClock::new(Duration::from_secs(1), t0);
        let mut r = Rounds::default();
        assert_eq!(r.after(RoundEnd::default(), &clock, t0), None);
        let back = |at: Instant| RoundEnd {
            coming_back: Some(at),
            ..RoundEnd::default()
        };
        assert_eq!(r.after(back(t0), &clock, t0), ms(500));
        assert_eq!(
            r.after(back(t0 + Duration::from_secs(3)), &clock, t0),
            ms(3000),
            "paused until the holder may be dialled"
        );
        assert_eq!(r.after(back(t0), &clock, t0), ms(2000));
        assert_eq!(r.after(back(t0), &clock, t0), None, "four stalled rounds");
        let mut r = Rounds::default();
        let late = t0 + clock.budget() - Duration::from_millis(100);
        assert_eq!(r.after(back(late), &clock, late), None, "past the budget");
    }

    /// Two holders of equal (assumed) rate split a record in halves on a chunk boundary, the
    /// first peer in the set first; a measured faster holder gets the larger share; a record
    /// under two stripes, a lone holder, an offerer, an avoided or a dropped holder: no
    /// stripes.
    #[test]
    fn a_record_is_striped_over_ready_holders_by_their_rates() {
        let t0 = Instant::now();
        let x = id(0, 1);
        let mib = 1u64 << 20;
        let chunk = 256 << 10;
        let len = 13 * mib + 5;
        let mut peers = vec![holding(&[x]), holding(&[x])];
        let s = stripes(views(&peers), x, len, chunk, MIN_STRIPE, t0).expect("striped");
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].start, s[0].peer, s[1].peer), (0, 0, 1));
        assert_eq!(s[0].end, s[1].start);
        assert_eq!(s[1].end, len);
        assert_eq!(s[0].end % chunk, 0, "on a chunk boundary");
        assert!((s[0].end as f64 / len as f64 - 0.5).abs() < 0.02, "{s:?}");
        // Three times as fast: three quarters.
        peers[1].rate = Some(3.0 * DEFAULT_RATE);
        let s = stripes(views(&peers), x, len, chunk, MIN_STRIPE, t0).expect("striped");
        assert_eq!(s[0].peer, 1, "the faster first");
        assert!((s[0].end as f64 / len as f64 - 0.75).abs() < 0.02, "{s:?}");
        // So much faster that the other's share would be under a stripe: not striped.
        peers[1].rate = Some(100.0 * DEFAULT_RATE);
        assert_eq!(stripes(views(&peers), x, len, chunk, MIN_STRIPE, t0), None);
        peers[1].rate = None;
        assert_eq!(
            stripes(views(&peers), x, 2 * MIN_STRIPE - 1, chunk, MIN_STRIPE, t0),
            None,
            "under two stripes"
        );
        assert!(stripes(views(&peers), x, 2 * MIN_STRIPE, chunk, MIN_STRIPE, t0).is_some());
        let offering = PeerView {
            inventory: Some(inv(&[])),
            offer: Some(inv(&[x])),
            ..PeerView::default()
        };
        let mut avoided = holding(&[x]);
        avoided.fail(t0);
        let mut banned = holding(&[x]);
        banned.ban("bad chunk");
        for other in [offering, avoided, banned, holding(&[id(1, 1)])] {
            let v = vec![holding(&[x]), other];
            assert_eq!(stripes(views(&v), x, len, chunk, MIN_STRIPE, t0), None);
        }
        // Many holders: at most MAX_STRIPES, each at least a stripe.
        let many: Vec<PeerView> = (0..12).map(|_| holding(&[x])).collect();
        let s = stripes(views(&many), x, len, chunk, MIN_STRIPE, t0).expect("striped");
        assert_eq!(s.len(), MAX_STRIPES);
        assert!(s.iter().all(|s| s.end - s.start >= MIN_STRIPE), "{s:?}");
        let s = stripes(views(&many), x, 3 * MIN_STRIPE, chunk, MIN_STRIPE, t0).expect("striped");
        assert_eq!(s.len(), 3, "{s:?}");
        // Small chunks and a small minimum (as the tests' small models use).
        let s = stripes(views(&peers), x, 96 << 10, 16 << 10, 16 << 10, t0).expect("striped");
        assert_eq!(
            s.iter().map(|s| (s.start, s.end)).collect::<Vec<_>>(),
            [(0, 48 << 10), (48 << 10, 96 << 10)]
        );
    }

    /// A try slower than half the fastest finished stripe is moved, once it ran long enough to
    /// tell, while a chunk is left and another holder could take it; a stalled one first;
    /// nothing moves before a stripe finished.
    #[test]
    fn a_stripe_far_behind_the_fastest_is_moved() {
        let t0 = Instant::now();
        let chunk = 1 << 10;
        let running = |since: Instant, done: u64, len: u64| StripeState::Running {
            since,
            verified_at_start: 0,
            verified: done,
            len,
            elsewhere: true,
        };
        let later = t0 + Duration::from_secs(1);
        // Nothing finished yet: nothing to compare with, no holder free.
        let s = [running(t0, 0, 1 << 20), StripeState::Waiting];
        assert_eq!(far_behind(&s, chunk, later), None);
        // 100 KB/s against 1 MB/s: moved; 600 KB/s: not.
        let s = [
            StripeState::Done { rate: 1e6 },
            running(t0, 100_000, 1 << 20),
        ];
        assert_eq!(far_behind(&s, chunk, later), Some(1));
        let s = [
            StripeState::Done { rate: 1e6 },
            running(t0, 600_000, 1 << 20),
        ];
        assert_eq!(far_behind(&s, chunk, later), None);
        // Too early to tell, or less than a chunk left.
        let s = [StripeState::Done { rate: 1e6 }, running(t0, 0, 1 << 20)];
        assert_eq!(far_behind(&s, chunk, t0 + MIN_OBSERVE / 2), None);
        assert_eq!(far_behind(&s, chunk, t0 + MIN_OBSERVE), Some(1));
        let s = [
            StripeState::Done { rate: 1e6 },
            running(t0, (1 << 20) - chunk + 1, 1 << 20),
        ];
        assert_eq!(far_behind(&s, chunk, later), None);
        // A stalled try goes before a slow one; the rate counts this try's bytes only.
        let s = [
            StripeState::Done { rate: 1e6 },
            running(t0, 10_000, 1 << 20),
            StripeState::Running {
                since: t0,
                verified_at_start: 500_000,
                verified: 500_000,
                len: 1 << 20,
                elsewhere: true,
            },
        ];
        assert_eq!(far_behind(&s, chunk, later), Some(2));
        // Unless no other holder could take it: then the slow one.
        let mut s = s;
        if let StripeState::Running { elsewhere, .. } = &mut s[2] {
            *elsewhere = false;
        }
        assert_eq!(far_behind(&s, chunk, later), Some(1));
        if let StripeState::Running { elsewhere, .. } = &mut s[1] {
            *elsewhere = false;
        }
        assert_eq!(far_behind(&s, chunk, later), None, "nowhere to move either");
    }

    fn ms(n: u64) -> Option<Duration> {
        Some(Duration::from_millis(n))
    }

    #[test]
    fn rounds_without_progress_or_busy_end_after_four() {
        let mut r = Rounds::default();
        assert_eq!(r.next(false, false), ms(500));
        assert_eq!(r.next(false, false), ms(1000));
        assert_eq!(r.next(false, false), ms(2000));
        assert_eq!(r.next(false, false), None);
    }

    #[test]
    fn progress_starts_the_count_again() {
        let mut r = Rounds::default();
        for _ in 0..3 {
            assert!(r.next(false, false).is_some());
        }
        assert_eq!(r.next(true, false), ms(250));
        for _ in 0..3 {
            assert!(r.next(false, false).is_some());
        }
        assert_eq!(r.next(false, false), None);
    }

    #[test]
    fn busy_rounds_pause_longer_but_do_not_end_the_load() {
        let mut r = Rounds::default();
        for _ in 0..20 {
            assert!(r.next(false, true).is_some(), "a busy round ended the load");
        }
        assert_eq!(r.next(false, true), ms(2000));
        for _ in 0..3 {
            assert!(r.next(false, false).is_some());
        }
        assert_eq!(r.next(false, false), None);
    }
}
