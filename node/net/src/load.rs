//! One expert load from peers as a sans-IO state machine: which holder to ask, when to race a
//! second one (a hedge), when to start another round over the holders and when to give up,
//! how a record is striped over several holders, when a stripe has fallen far behind and its
//! rest moves to another holder, and what a silent connection or a redial costs.
//!
//! A [`Load`] is driven as quinn-proto's `Connection` is: the driver feeds it what happened
//! ([`Load::handle`]: a dial ended, a try verified more bytes or ended, the local disk
//! answered), then asks what to do ([`Load::poll_action`]: [`Action::Dial`] a peer,
//! [`Action::Send`] a byte range to a peer, [`Action::Cancel`] a try, race the local disk,
//! warn about a peer, and at last [`Action::Done`]), and wakes it at [`Load::poll_timeout`].
//! It reads no clock and touches no socket: the time is an argument, and the peers' state is
//! the [`PeerView`]s the driver lends to [`Load::poll_action`] (the same views every load of
//! the tier shares, so that loads spread over the peers and a peer's failure is seen by all).
//! So every decision of a load is tested here by stepping a fake clock, without a socket.
//!
//! Non-goals: moving bytes, verifying chunks, keeping connections (the driver's); the
//! decisions about one peer across loads (back-off, redials, bans, the choice, the stripe plan,
//! the far-behind rule) are [`crate::policy`]'s, which this machine calls.
//!
//! Buffers stay with the driver. Each span of the record (the whole record, or one stripe)
//! has one kept buffer holding its longest verified prefix: a try takes it
//! ([`BufferFrom::Kept`]) and hands it back when it ends, and the driver keeps the longer of
//! what two racing tries hand back (this machine follows the same rule to know what is kept).
//! A second try racing the first starts from a spare copy of the prefix made before the first
//! was sent ([`Request::keep_spare`], [`BufferFrom::Spare`]), or from nothing ([`BufferFrom::Fresh`]).

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::time::{Duration, Instant};

use stormo_manifests::ExpertId;
use stormo_wire::{ErrorCode, FetchError};

use crate::policy::{self, LoadClock, PeerView, RoundEnd, Rounds, StripeState};

/// A view of one peer the driver lends to [`Load::poll_action`]: the peer's [`PeerView`]
/// itself, a mutable reference to it, or the guard of the lock it lives under.
pub trait ViewMut {
    /// The view.
    fn view(&self) -> &PeerView;
    /// The view, to change.
    fn view_mut(&mut self) -> &mut PeerView;
}

impl ViewMut for PeerView {
    fn view(&self) -> &PeerView {
        self
    }
    fn view_mut(&mut self) -> &mut PeerView {
        self
    }
}

impl ViewMut for &mut PeerView {
    fn view(&self) -> &PeerView {
        self
    }
    fn view_mut(&mut self) -> &mut PeerView {
        self
    }
}

impl ViewMut for std::sync::MutexGuard<'_, PeerView> {
    fn view(&self) -> &PeerView {
        self
    }
    fn view_mut(&mut self) -> &mut PeerView {
        self
    }
}

fn views<V: ViewMut>(peers: &[V]) -> impl Iterator<Item = (usize, &PeerView)> {
    peers.iter().enumerate().map(|(i, v)| (i, v.view()))
}

/// The time limits and sizes every load of a tier shares.
#[derive(Clone, Copy, Debug)]
pub struct LoadConfig {
    /// The first round's deadline of one try, from when its request is sent.
    pub request_timeout: Duration,
    /// The shortest delay before a demand load is hedged.
    pub hedge_min: Duration,
    /// The longest delay before a demand load is hedged.
    pub hedge_max: Duration,
    /// The smallest stripe ([`policy::stripes`]; `u64::MAX` never stripes).
    pub stripe_min: u64,
}

/// What one load is for.
#[derive(Clone, Copy, Debug)]
pub struct LoadSpec {
    /// The expert.
    pub id: ExpertId,
    /// Its record's length.
    pub len: u64,
    /// The manifest's chunk size (stripes are cut on chunks).
    pub chunk: u64,
    /// The engine waits on it (not a prefetch): a try slower than its peer's usual is hedged.
    pub demand: bool,
    /// A local tier (the disk) holds the expert: a slow whole-record load races it when no
    /// other peer is left, and a lost holder is not waited for.
    pub local: bool,
}

/// A try at one peer, numbered per load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TryId(pub u64);

impl fmt::Display for TryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "try {}", self.0)
    }
}

/// Where the buffer of a try comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferFrom {
    /// The span's kept buffer (a whole record's is allocated by the first try that finds
    /// none; a stripe's part is made by [`Action::Stripe`]).
    Kept,
    /// The spare copy of the whole record's prefix made for a racer ([`Request::keep_spare`]).
    Spare,
    /// A new buffer for the whole record, nothing verified.
    Fresh,
}

/// A request to send ([`Action::Send`]): bytes `range` of the record to `peer`, into a buffer of span `span`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The try.
    pub try_id: TryId,
    /// The peer (an index into the views).
    pub peer: usize,
    /// The span it fetches (0 for a whole record; the stripe's index).
    pub span: usize,
    /// The bytes of the record asked for: from the end of the buffer's verified prefix to the
    /// span's end.
    pub range: Range<u64>,
    /// The buffer the try writes into.
    pub buffer: BufferFrom,
    /// Copy the kept prefix into the spare buffer before lending it (dropping any spare there
    /// was); false drops the spare.
    pub keep_spare: bool,
    /// The try's deadline from when its request is sent.
    pub timeout: Duration,
    /// Moved on while chunks verify, up to this time ([`stormo_wire::Fetch::extend_on_progress`]).
    pub extend_until: Option<Instant>,
    /// Report [`Event::Progress`] as chunks verify (a stripe's try: the far-behind rule needs it).
    pub progress: bool,
}

/// What the driver is asked to do.
#[derive(Debug)]
pub enum Action {
    /// The record is striped: split its buffer into these spans (chunk-aligned, in order,
    /// covering it), span `k` the `k`-th, before the first [`Action::Send`].
    Stripe(Vec<Range<u64>>),
    /// Connect to the peer (one attempt at a time per peer; the policy may refuse,
    /// [`PeerView::dial`]), then report [`Event::Dialed`].
    Dial {
        /// The peer.
        peer: usize,
    },
    /// Send a request, and report [`Event::Ended`] when it ends.
    Send(Request),
    /// Make a try give up. With `keep`, it hands back its buffer with what verified (report
    /// [`Event::Ended`] with [`TryError::Moved`]); without, nothing more is wanted of it (its
    /// buffer and any later event are dropped).
    Cancel {
        /// The try.
        try_id: TryId,
        /// Hand back what verified.
        keep: bool,
    },
    /// Load the expert from the local tier, and report [`Event::LocalEnded`].
    LoadLocal,
    /// Log a warning about a peer (`peer {its address} {message}`).
    Warn {
        /// The peer.
        peer: usize,
        /// What happened and what follows for it.
        message: String,
    },
    /// The load ended; nothing more comes from it.
    Done(Result<Loaded, LoadError>),
}

/// Where a finished load's record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loaded {
    /// In the kept buffers of the spans (one, or the stripes in order), verified whole.
    Peers,
    /// The local tier's answer.
    Local,
}

/// What happened, for [`Load::handle`].
#[derive(Debug)]
pub enum Event {
    /// A dial asked for by [`Action::Dial`] ended (or the link was up already).
    Dialed {
        /// The peer.
        peer: usize,
        /// The link is up, or why not (the peer is marked for it already).
        result: Result<(), LinkError>,
    },
    /// The try has verified its span up to `verified_end` (in the record).
    Progress {
        /// The try.
        try_id: TryId,
        /// The end of the verified bytes.
        verified_end: u64,
    },
    /// The try ended: verified its span whole, or failed. It handed back its buffer (`kept`)
    /// with its bytes up to `verified_end` verified, or none.
    Ended {
        /// The try.
        try_id: TryId,
        /// Verified whole, or why not.
        result: Result<(), TryError>,
        /// The end of the verified bytes of the buffer handed back.
        verified_end: u64,
        /// A buffer was handed back.
        kept: bool,
    },
    /// The local tier's load ended (its data stays with the driver).
    LocalEnded(Result<(), String>),
}

/// Why there is no link to a peer. Either way the peer is already marked for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// This attempt to connect failed.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// A recent attempt failed (or the connection was lost) and the policy says not to dial
    /// yet ([`policy::Dial::Wait`]).
    #[error("{}", wait_message(.why, *.left, *.coming_back))]
    Wait {
        /// Why the last attempt failed.
        why: String,
        /// Until an attempt may start.
        left: Duration,
        /// Lost and being redialled, rather than unreachable.
        coming_back: bool,
    },
}

fn wait_message(why: &str, left: Duration, coming_back: bool) -> String {
    if coming_back {
        format!("{why}; trying again in {:.1}s", left.as_secs_f64())
    } else {
        format!(
            "unreachable ({why}); not trying to connect again for {:.1}s",
            left.as_secs_f64()
        )
    }
}

/// Why one try at one peer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TryError {
    /// The request failed: why, and whether the peer sent stream data on the connection
    /// meanwhile (for this request or another; acknowledgements and pings do not count).
    #[error("{error}")]
    Fetch {
        /// Why.
        error: FetchError,
        /// The peer was sending all along.
        heard: bool,
    },
    /// No link (the peer is already marked for it).
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The connection was lost during the request (the peer is already marked for it, once
    /// however many requests saw it: [`PeerView::lose`]).
    #[error("connection lost: {0}")]
    Lost(Box<Self>),
    /// The try gave up when asked ([`Action::Cancel`] with `keep`); not the peer's fault.
    #[error("fell far behind the other stripes; its remainder moved to another holder")]
    Moved,
    /// The try gave up when its connection had heard nothing for this long; the rest of its
    /// span went to another holder.
    #[error(
        "its connection heard nothing for {:.1}s; its remainder moved to another holder",
        .0.as_secs_f64()
    )]
    Silent(Duration),
    /// The try completed with a buffer of the wrong length.
    #[error("{have} bytes of a {span}-byte span of a {len}-byte record")]
    Short {
        /// Bytes in the buffer.
        have: u64,
        /// Bytes of the span.
        span: u64,
        /// Bytes of the record.
        len: u64,
    },
    /// Anything else (refused, a protocol violation, a local failure).
    #[error("{0}")]
    Other(String),
}

/// One failure of a load, in the order they happened.
#[derive(Debug)]
pub enum Failure {
    /// A try at a peer.
    Peer {
        /// The peer.
        peer: usize,
        /// Why.
        error: TryError,
    },
    /// The local tier's race.
    Local(String),
    /// The load's budget ran out before another round.
    Budget(Duration),
}

/// Why a load ended without the record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No peer may supply the expert.
    #[error("no peer holds expert {id}")]
    NoHolder {
        /// The expert.
        id: ExpertId,
    },
    /// Every try failed (the tries' failures, in order).
    #[error("no peer could supply expert {id} ({})", Summary { failures, names: None })]
    Exhausted {
        /// The expert.
        id: ExpertId,
        /// Why each try failed.
        failures: Vec<Failure>,
    },
    /// A stripe failed every holder.
    #[error("bytes {start}..{end} of {len}: {source}")]
    Stripe {
        /// The stripe's first byte.
        start: u64,
        /// Its end.
        end: u64,
        /// The record's length.
        len: u64,
        /// Why the stripe failed.
        source: Box<Self>,
    },
}

impl LoadError {
    /// The error in words, naming each peer with `name` (its address): what the user sees.
    pub fn named<'a>(&'a self, name: &'a dyn Fn(usize) -> String) -> impl fmt::Display + 'a {
        Named { e: self, name }
    }

    /// The failures it lists.
    pub fn failures(&self) -> &[Failure] {
        match self {
            Self::NoHolder { .. } => &[],
            Self::Exhausted { failures, .. } => failures,
            Self::Stripe { source, .. } => source.failures(),
        }
    }
}

struct Named<'a> {
    e: &'a LoadError,
    name: &'a dyn Fn(usize) -> String,
}

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.e {
            LoadError::Exhausted { id, failures } => write!(
                f,
                "no peer could supply expert {id} ({})",
                Summary {
                    failures,
                    names: Some(self.name)
                }
            ),
            LoadError::Stripe {
                start,
                end,
                len,
                source,
            } => write!(
                f,
                "bytes {start}..{end} of {len}: {}",
                Named {
                    e: source,
                    name: self.name
                }
            ),
            e => write!(f, "{e}"),
        }
    }
}

/// The failures of a load, in order; of a long list (many rounds), the first and last three
/// with a count of those between.
struct Summary<'a> {
    failures: &'a [Failure],
    names: Option<&'a dyn Fn(usize) -> String>,
}

impl Summary<'_> {
    fn one(&self, f: &mut fmt::Formatter<'_>, x: &Failure) -> fmt::Result {
        match x {
            Failure::Peer { peer, error } => match self.names {
                Some(n) => write!(f, "{}: {error}", n(*peer)),
                None => write!(f, "peer {peer}: {error}"),
            },
            Failure::Local(e) => write!(f, "local disk: {e}"),
            Failure::Budget(b) => write!(
                f,
                "gave up after {:.1}s, the load's budget",
                b.as_secs_f64()
            ),
        }
    }
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const ENDS: usize = 3;
        let v = self.failures;
        let list = |f: &mut fmt::Formatter<'_>, xs: &[Failure]| -> fmt::Result {
            for (k, x) in xs.iter().enumerate() {
                if k > 0 {
                    f.write_str("; ")?;
                }
                self.one(f, x)?;
            }
            Ok(())
        };
        if v.len() <= 2 * ENDS + 1 {
            return list(f, v);
        }
        list(f, &v[..ENDS])?;
        write!(f, "; ... {} more ...; ", v.len() - 2 * ENDS)?;
        list(f, &v[v.len() - ENDS..])
    }
}

/// Counts of one load, for the tier's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Tries raced by a second request (another peer or the local disk).
    pub hedges: u64,
    /// Races won by the second request to a peer.
    pub hedge_wins: u64,
    /// Races won by the local disk.
    pub local_wins: u64,
    /// Failed tries (a try asked to give up is not one).
    pub failed: u64,
    /// The load was striped.
    pub striped: bool,
}

impl LoadStats {
    /// Failed tries that another try followed (all of them when the load succeeded; all but
    /// the last, the load's own error, when it failed).
    pub fn retried(&self, ok: bool) -> u64 {
        if ok {
            self.failed
        } else {
            self.failed.saturating_sub(1)
        }
    }
}

/// What one try's end means for its load and its peer ([`judge`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// A failed try (a try asked to give up, or a success, is not one).
    pub failed: bool,
    /// Worth another round: the peer was slow, busy, or the try was moved.
    pub retry: bool,
    /// The peer answered `busy`.
    pub busy: bool,
    /// A warning to log about the peer (`peer {address} {warning}`).
    pub warn: Option<String>,
}

/// Judges the end of one try of expert `id` at the peer of `view`, which ran `elapsed` and
/// verified `added` bytes more, at `now`, and notes it in the view. A success feeds the
/// peer's throughput and latency; bytes that fail verification drop the peer for the session
/// (named once); a try that ran out of time while its peer was still sending is slow, not
/// faulty, and a `busy` answer is load: neither marks the peer, and both are worth another
/// round, as is a try that was moved. A lost connection or a failed dial was marked where it
/// happened. Any other failure backs the peer off.
pub fn judge(
    view: &mut PeerView,
    id: ExpertId,
    result: &Result<(), TryError>,
    added: u64,
    elapsed: Duration,
    now: Instant,
) -> Verdict {
    view.bytes += added;
    let e = match result {
        Ok(()) => {
            view.succeed(added, elapsed.as_secs_f64());
            return Verdict::default();
        }
        Err(e) => e,
    };
    let mut v = Verdict {
        failed: true,
        ..Verdict::default()
    };
    match e {
        TryError::Moved | TryError::Silent(_) => {
            v.failed = false;
            v.retry = true;
        }
        TryError::Link(_) | TryError::Lost(_) => {}
        TryError::Fetch {
            error: FetchError::Remote { code, .. },
            ..
        } if *code == ErrorCode::BUSY => {
            // Alive but serving as many of this node's requests as it takes (some may be
            // tries this node gave up on that the peer has not yet dropped): a later round
            // may find it free.
            v.retry = true;
            v.busy = true;
        }
        TryError::Fetch {
            error: FetchError::TimedOut { .. } | FetchError::Stalled { .. },
            heard: true,
        } => {
            // The peer was sending to this node all along (this answer, or others ahead of
            // it on the same connection): slow or loaded, not failing.
            view.sample(elapsed.as_secs_f64());
            v.retry = true;
        }
        TryError::Fetch {
            error: FetchError::BadChunk { .. },
            ..
        }
        | TryError::Short { .. } => {
            let why = format!("expert {id}: {e}");
            if view.ban(&why) {
                v.warn = Some(format!(
                    "sent bytes that failed verification ({why}); not asking it again this \
                     session"
                ));
            }
        }
        _ => {
            let backoff = view.fail(now);
            v.warn = Some(format!(
                "failed on expert {id}: {e}; avoiding it for {:.1}s",
                backoff.as_secs_f64()
            ));
        }
    }
    v
}

/// Why a try is made to give up and hand back its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Move {
    /// [`policy::far_behind`].
    FarBehind,
    /// Its connection heard nothing for this long.
    Silent(Duration),
}

#[derive(Debug)]
struct Try {
    id: TryId,
    span: usize,
    peer: usize,
    /// When it was picked (the hedge delay and the far-behind rule count from here).
    started: Instant,
    /// When its request was sent (`None`: waiting for a dial).
    sent: Option<Instant>,
    /// The end of the span's verified bytes when it began, and now.
    from: u64,
    verified: u64,
    timeout: Duration,
    extend_until: Option<Instant>,
    buffer: BufferFrom,
    /// The second of two racers.
    hedge: bool,
    /// Asked to give up, keeping what verified.
    moving: Option<Move>,
    /// Its silence, or its wait for a dial, was acted on already.
    watched: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LocalRace {
    NotTried,
    Running,
    Tried,
}

#[derive(Debug)]
struct Span {
    start: u64,
    end: u64,
    /// The holder asked first (a stripe's).
    first: Option<usize>,
    tried: HashSet<usize>,
    failures: Vec<Failure>,
    clock: LoadClock,
    rounds: Rounds,
    round: u32,
    /// The verified length kept when this round started.
    round_start: u64,
    /// Some try ran out of time while its peer was still sending, or a peer answered busy, or
    /// a try was moved: worth another round.
    retry: bool,
    /// A peer answered busy.
    busy: bool,
    /// The end of the verified prefix of the buffer the driver keeps for the span (`None`: it
    /// keeps none, as before a whole record's first try or while a try holds it).
    kept: Option<u64>,
    /// The same of the spare copy.
    spare: Option<u64>,
    pause_until: Option<Instant>,
    /// When a running try without a racer is to be hedged (a demand load's whole record).
    hedge_at: Option<Instant>,
    local: LocalRace,
    /// Verified whole, at this rate (bytes per second of the try that finished it).
    done: Option<f64>,
}

impl Span {
    fn kept_len(&self) -> u64 {
        self.kept.map_or(0, |v| v.saturating_sub(self.start))
    }
}

/// One expert load. See the module docs.
#[derive(Debug)]
pub struct Load {
    spec: LoadSpec,
    cfg: LoadConfig,
    spans: Vec<Span>,
    striped: bool,
    tries: Vec<Try>,
    next_try: u64,
    events: Vec<(Event, Instant)>,
    actions: std::collections::VecDeque<Action>,
    /// Peers this load asked to dial and has not heard back of.
    dialing: HashSet<usize>,
    stats: LoadStats,
    wake: Option<Instant>,
    finished: bool,
}

/// How often the stripes are judged once one has finished (as the driver of striped loads
/// looked at them before).
const STRIPE_TICK: Duration = Duration::from_millis(10);

impl Load {
    /// A load of `spec`; it starts at the first [`Self::poll_action`] (its clock too).
    pub fn new(spec: LoadSpec, cfg: LoadConfig) -> Self {
        Self {
            spec,
            cfg,
            spans: Vec::new(),
            striped: false,
            tries: Vec::new(),
            next_try: 0,
            events: Vec::new(),
            actions: Default::default(),
            dialing: HashSet::new(),
            stats: LoadStats::default(),
            wake: None,
            finished: false,
        }
    }

    /// Takes in what happened at `now`; acted on by the next [`Self::poll_action`].
    pub fn handle(&mut self, event: Event, now: Instant) {
        if !self.finished {
            self.events.push((event, now));
        }
    }

    /// The next thing to do at `now`, with the peers' views `peers` (the tier's peer set, in
    /// its order; they are read and changed: requests in flight, failures, measurements).
    /// `None`: nothing until another event or [`Self::poll_timeout`].
    pub fn poll_action<V: ViewMut>(&mut self, peers: &mut [V], now: Instant) -> Option<Action> {
        if self.actions.is_empty() && !self.finished {
            self.step(peers, now);
        }
        self.actions.pop_front()
    }

    /// When the load wants [`Self::poll_action`] called again without an event.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.finished {
            None
        } else {
            self.wake
        }
    }

    /// Its counts so far.
    pub fn stats(&self) -> LoadStats {
        self.stats
    }

    /// Whether [`Action::Done`] was given.
    pub fn is_done(&self) -> bool {
        self.finished
    }

    /// Gives the load up without an end (the driver stops: the tier closes, or its task is
    /// dropped): its tries are no longer in flight. Nothing more comes from it.
    pub fn abandon<V: ViewMut>(&mut self, peers: &mut [V]) {
        for t in std::mem::take(&mut self.tries) {
            if let Some(p) = peers.get_mut(t.peer) {
                let v = p.view_mut();
                v.in_flight = v.in_flight.saturating_sub(1);
            }
        }
        self.actions.clear();
        self.events.clear();
        self.finished = true;
        self.wake = None;
    }

    fn step<V: ViewMut>(&mut self, peers: &mut [V], now: Instant) {
        if self.spans.is_empty() {
            self.plan(peers, now);
        }
        for (e, at) in std::mem::take(&mut self.events) {
            self.apply(e, peers, at);
            if self.finished {
                return;
            }
        }
        self.watch(peers, now);
        if self.finished {
            return;
        }
        for k in 0..self.spans.len() {
            self.advance(k, peers, now);
            if self.finished {
                return;
            }
        }
        if self.spans.iter().all(|s| s.done.is_some()) {
            if self.striped {
                self.stats.striped = true;
            }
            self.finish(peers, Ok(Loaded::Peers));
            return;
        }
        self.wake = self.next_wake(peers, now);
    }

    /// Stripes the record over its holders when [`policy::stripes`] says so, else one span.
    fn plan<V: ViewMut>(&mut self, peers: &mut [V], now: Instant) {
        let LoadSpec { id, len, chunk, .. } = self.spec;
        let clock = LoadClock::new(self.cfg.request_timeout, now);
        let span = |start: u64, end: u64, first: Option<usize>, kept: Option<u64>| Span {
            start,
            end,
            first,
            tried: HashSet::new(),
            failures: Vec::new(),
            clock,
            rounds: Rounds::default(),
            round: 1,
            round_start: 0,
            retry: false,
            busy: false,
            kept,
            spare: None,
            pause_until: None,
            hedge_at: None,
            local: LocalRace::NotTried,
            done: None,
        };
        match policy::stripes(views(peers), id, len, chunk, self.cfg.stripe_min, now) {
            Some(plan) => {
                self.striped = true;
                self.spans = plan
                    .iter()
                    .map(|s| span(s.start, s.end, Some(s.peer), Some(s.start)))
                    .collect();
                self.actions.push_back(Action::Stripe(
                    plan.iter().map(|s| s.start..s.end).collect(),
                ));
            }
            None => self.spans = vec![span(0, len, None, None)],
        }
    }

    fn apply<V: ViewMut>(&mut self, e: Event, peers: &mut [V], now: Instant) {
        match e {
            Event::Dialed { peer, result } => {
                self.dialing.remove(&peer);
                let waiting: Vec<TryId> = self
                    .tries
                    .iter()
                    .filter(|t| t.peer == peer && t.sent.is_none())
                    .map(|t| t.id)
                    .collect();
                for id in waiting {
                    match &result {
                        Ok(()) => self.send(id, peers, now),
                        Err(e) => {
                            self.ended(id, Err(TryError::Link(e.clone())), 0, false, peers, now)
                        }
                    }
                }
            }
            Event::Progress {
                try_id,
                verified_end,
            } => {
                if let Some(t) = self.tries.iter_mut().find(|t| t.id == try_id) {
                    t.verified = t.verified.max(verified_end);
                }
            }
            Event::Ended {
                try_id,
                result,
                verified_end,
                kept,
            } => self.ended(try_id, result, verified_end, kept, peers, now),
            Event::LocalEnded(r) => self.local_ended(r, peers, now),
        }
    }

    /// Picks the best holder for span `k` not tried in this round ([`policy::choose`]),
    /// counting a request in flight at it.
    fn pick<V: ViewMut>(&mut self, k: usize, peers: &mut [V], now: Instant) -> Option<usize> {
        let s = &mut self.spans[k];
        let i = policy::choose(views(peers), self.spec.id, self.spec.len, &s.tried, now)?;
        s.tried.insert(i);
        peers[i].view_mut().in_flight += 1;
        Some(i)
    }

    /// Picks holder `i` for span `k`, if it was not tried in this round and may supply it.
    fn pick_this<V: ViewMut>(&mut self, k: usize, i: usize, peers: &mut [V]) -> Option<usize> {
        let s = &mut self.spans[k];
        let v = peers.get_mut(i)?.view_mut();
        if s.tried.contains(&i) || !v.may_supply(self.spec.id) {
            return None;
        }
        v.in_flight += 1;
        s.tried.insert(i);
        Some(i)
    }

    /// Starts a try at peer `i` (picked, counted in flight) for span `k`: sent at once when
    /// its connection is up, else after a dial.
    fn start<V: ViewMut>(
        &mut self,
        k: usize,
        i: usize,
        hedge: bool,
        peers: &mut [V],
        now: Instant,
    ) {
        let id = TryId(self.next_try);
        self.next_try += 1;
        let s = &self.spans[k];
        let whole = !self.striped;
        // A try is cut off at its deadline while another holder is left to try in this
        // round. Once every holder has been tried (or there is no other), all are slow: one
        // that keeps verifying chunks is let run, within the load's budget (cutting it off
        // would throw away what its peer has queued).
        let extend_until = (s.round > 1
            || !policy::other_holder_left(views(peers), self.spec.id, &s.tried, now))
        .then_some(s.clock.end);
        // A racer starts from the spare copy of the prefix, or from the kept prefix itself if
        // the first try has not taken it yet (it waits for a dial), or from nothing.
        let (buffer, from) = if !hedge {
            (BufferFrom::Kept, s.kept.unwrap_or(s.start))
        } else if let Some(v) = s.spare {
            (BufferFrom::Spare, v)
        } else if let Some(v) = s.kept {
            (BufferFrom::Kept, v)
        } else {
            (BufferFrom::Fresh, 0)
        };
        // A racer's limit is the first try's: a hedge taking the last holder must not let the
        // slower of the two run on while the other is cut off.
        let (timeout, extend_until) = match self.tries.iter().find(|t| t.span == k) {
            Some(t) if hedge => (t.timeout, t.extend_until),
            _ => (s.clock.timeout, extend_until),
        };
        if !hedge && whole && self.spec.demand {
            let v = peers[i].view();
            let c = &self.cfg;
            let delay = policy::hedge_delay(
                v,
                self.spec.len,
                c.hedge_min,
                c.hedge_max,
                c.request_timeout,
            );
            self.spans[k].hedge_at = Some(now + delay);
        }
        self.tries.push(Try {
            id,
            span: k,
            peer: i,
            started: now,
            sent: None,
            from,
            verified: from,
            timeout,
            extend_until,
            buffer,
            hedge,
            moving: None,
            watched: false,
        });
        if peers[i].view().up {
            self.send(id, peers, now);
        } else if self.dialing.insert(i) {
            self.actions.push_back(Action::Dial { peer: i });
        }
    }

    /// Sends try `id`, its peer's link being up: from now on its connection owes a datagram
    /// ([`PeerView::request_sent`]).
    fn send<V: ViewMut>(&mut self, id: TryId, peers: &mut [V], now: Instant) {
        let Some(t) = self.tries.iter_mut().find(|t| t.id == id) else {
            return;
        };
        if let Some(p) = peers.get_mut(t.peer) {
            p.view_mut().request_sent(now);
        }
        let s = &mut self.spans[t.span];
        t.sent = Some(now);
        let keep_spare = !t.hedge && t.buffer == BufferFrom::Kept && !self.striped;
        match t.buffer {
            BufferFrom::Kept => {
                // The prefix: where it is now, if a racer took it since the try was picked.
                t.from = s.kept.unwrap_or(s.start);
                t.verified = t.from;
                s.spare = (keep_spare && s.kept_len() > 0).then_some(t.from);
                s.kept = None;
            }
            BufferFrom::Spare => match s.spare.take() {
                Some(v) => (t.from, t.verified) = (v, v),
                None => {
                    t.buffer = BufferFrom::Fresh;
                    (t.from, t.verified) = (0, 0);
                }
            },
            BufferFrom::Fresh => {}
        }
        let send = Request {
            try_id: t.id,
            peer: t.peer,
            span: t.span,
            range: t.from..s.end,
            buffer: t.buffer,
            keep_spare: keep_spare && s.spare.is_some(),
            timeout: t.timeout,
            extend_until: t.extend_until,
            progress: self.striped,
        };
        self.actions.push_back(Action::Send(send));
    }

    /// Stops waiting on try `id` (a lost race, or the load ended): it is no longer in flight.
    fn drop_try<V: ViewMut>(&mut self, id: TryId, peers: &mut [V]) {
        if let Some(at) = self.tries.iter().position(|t| t.id == id) {
            let t = self.tries.remove(at);
            let v = peers[t.peer].view_mut();
            v.in_flight = v.in_flight.saturating_sub(1);
            if t.sent.is_some() {
                self.actions.push_back(Action::Cancel {
                    try_id: id,
                    keep: false,
                });
            }
        }
    }

    /// Notes that peer `i` lost a race after `elapsed` (a lower bound of its fetch time).
    fn lost<V: ViewMut>(peers: &mut [V], i: usize, elapsed: Duration) {
        let v = peers[i].view_mut();
        v.sample(elapsed.as_secs_f64());
        v.races_lost += 1;
    }

    fn warn(&mut self, peer: usize, message: String) {
        self.actions.push_back(Action::Warn { peer, message });
    }

    fn ended<V: ViewMut>(
        &mut self,
        id: TryId,
        result: Result<(), TryError>,
        verified_end: u64,
        kept: bool,
        peers: &mut [V],
        now: Instant,
    ) {
        let Some(at) = self.tries.iter().position(|t| t.id == id) else {
            return;
        };
        let t = self.tries.remove(at);
        let expert = self.spec.id;
        let i = t.peer;
        let elapsed = now.saturating_duration_since(t.started);
        {
            let v = peers[i].view_mut();
            v.in_flight = v.in_flight.saturating_sub(1);
        }
        let s = &mut self.spans[t.span];
        // The verified bytes this try added (a try that lost its buffer kept none).
        let added = if kept {
            verified_end.saturating_sub(t.from)
        } else {
            0
        };
        if kept && s.kept.is_none_or(|k| verified_end > k) {
            s.kept = Some(verified_end);
        }
        let result = match (result, t.moving) {
            (Err(TryError::Moved), Some(Move::Silent(d))) => Err(TryError::Silent(d)),
            (r, _) => r,
        };
        let verdict = judge(peers[i].view_mut(), expert, &result, added, elapsed, now);
        if let Some(w) = verdict.warn {
            self.warn(i, w);
        }
        let s = &mut self.spans[t.span];
        s.retry |= verdict.retry;
        s.busy |= verdict.busy;
        if verdict.failed {
            self.stats.failed += 1;
        }
        let e = match result {
            Ok(()) => {
                s.kept = Some(s.end);
                let ran = elapsed.as_secs_f64().max(1e-6);
                s.done = Some((s.end - t.from) as f64 / ran);
                s.hedge_at = None;
                // A racer still running lost: to a hedge, or the hedge lost to it.
                let losers: Vec<(TryId, usize, Instant)> = self
                    .tries
                    .iter()
                    .filter(|r| r.span == t.span)
                    .map(|r| (r.id, r.peer, r.started.min(t.started)))
                    .collect();
                for (l, p, since) in losers {
                    Self::lost(peers, p, now.saturating_duration_since(since));
                    self.drop_try(l, peers);
                }
                if t.hedge {
                    self.stats.hedge_wins += 1;
                }
                return;
            }
            Err(e) => e,
        };
        if matches!(e, TryError::Moved | TryError::Silent(_)) {
            Self::lost(peers, i, elapsed);
        }
        tracing::debug!("peer {i} on expert {expert}: {e}");
        let s = &mut self.spans[t.span];
        s.failures.push(Failure::Peer { peer: i, error: e });
        if !self.tries.iter().any(|r| r.span == t.span) {
            s.hedge_at = None;
        }
    }

    fn local_ended<V: ViewMut>(&mut self, r: Result<(), String>, peers: &mut [V], now: Instant) {
        let Some(k) = self
            .spans
            .iter()
            .position(|s| s.local == LocalRace::Running)
        else {
            return;
        };
        self.spans[k].local = LocalRace::Tried;
        match r {
            Ok(()) => {
                let running: Vec<(TryId, usize, Instant)> = self
                    .tries
                    .iter()
                    .filter(|t| t.span == k)
                    .map(|t| (t.id, t.peer, t.started))
                    .collect();
                for (id, p, started) in running {
                    Self::lost(peers, p, now.saturating_duration_since(started));
                    self.drop_try(id, peers);
                }
                self.stats.local_wins += 1;
                self.finish(peers, Ok(Loaded::Local));
            }
            Err(e) => self.spans[k].failures.push(Failure::Local(e)),
        }
    }

    /// Races a second request against span `k`'s only try: another holder not tried in this
    /// round, else the local disk once. Returns whether it started one.
    fn hedge<V: ViewMut>(&mut self, k: usize, peers: &mut [V], now: Instant) -> bool {
        if let Some(j) = self.pick(k, peers, now) {
            self.stats.hedges += 1;
            tracing::debug!("expert {}: hedging span {k} with peer {j}", self.spec.id);
            self.start(k, j, true, peers, now);
            return true;
        }
        let s = &mut self.spans[k];
        if self.spec.local && s.local == LocalRace::NotTried {
            s.local = LocalRace::Running;
            self.stats.hedges += 1;
            self.actions.push_back(Action::LoadLocal);
            return true;
        }
        false
    }

    /// The timers of running tries: a demand load's hedge, a connection silent beyond what
    /// its latency explains, a try waiting on a dial while another holder is connected, and a
    /// stripe fallen far behind.
    fn watch<V: ViewMut>(&mut self, peers: &mut [V], now: Instant) {
        let id = self.spec.id;
        for k in 0..self.spans.len() {
            if self.spans[k].done.is_some() {
                continue;
            }
            let racers = self.tries.iter().filter(|t| t.span == k).count();
            let alone = racers == 1 && self.spans[k].local != LocalRace::Running;
            if alone && self.spans[k].hedge_at.is_some_and(|t| now >= t) {
                self.spans[k].hedge_at = None;
                self.hedge(k, peers, now);
            }
        }
        // Silence, and waits on a dial.
        let watch: Vec<TryId> = self
            .tries
            .iter()
            .filter(|t| !t.watched && t.moving.is_none())
            .map(|t| t.id)
            .collect();
        for tid in watch {
            let Some((k, i, sent)) = self
                .tries
                .iter()
                .find(|t| t.id == tid)
                .map(|t| (t.span, t.peer, t.sent))
            else {
                continue;
            };
            let v = peers[i].view();
            // Silent since this try was sent, or since an earlier request on the connection
            // (one raced and cancelled since counts: the peer never acknowledged it).
            let silent = match sent {
                Some(sent) => {
                    let quiet = now
                        .saturating_duration_since(v.heard.map_or(sent, |h| h.max(sent)))
                        .max(v.unanswered(now).unwrap_or_default());
                    (quiet >= policy::silence_limit(v.rtt)).then_some(quiet)
                }
                None => None,
            };
            // Waiting on a dial while another holder not tried in this round is connected:
            // that one is asked at once.
            let dial_wait = sent.is_none()
                && views(peers).any(|(j, p)| {
                    j != i
                        && !self.spans[k].tried.contains(&j)
                        && p.up
                        && p.holds(id)
                        && p.usable()
                        && !p.suspect(now)
                });
            if silent.is_none() && !dial_wait {
                continue;
            }
            if let Some(q) = silent {
                if peers[i].view_mut().suspect_silent(now) {
                    tracing::debug!(
                        "peer {i}: its connection heard nothing for {:.1}s with a request of \
                         expert {id} waiting",
                        q.as_secs_f64()
                    );
                }
            }
            if let Some(t) = self.tries.iter_mut().find(|t| t.id == tid) {
                t.watched = true;
            }
            let racers = self.tries.iter().filter(|t| t.span == k).count();
            if !self.striped {
                if racers == 1 && self.spans[k].local != LocalRace::Running {
                    self.spans[k].hedge_at = None;
                    self.hedge(k, peers, now);
                }
                continue;
            }
            // A stripe: its rest moves to another holder, one that is connected and not
            // suspect (the silent one has nothing on the wire to lose).
            let elsewhere = views(peers).any(|(j, p)| {
                j != i
                    && p.usable()
                    && p.holds(id)
                    && p.up
                    && !p.suspect(now)
                    && !p.avoided(now)
                    && p.unreachable.is_none()
            });
            if !elsewhere {
                continue;
            }
            match silent {
                Some(q) => self.move_try(tid, Move::Silent(q), peers, now),
                None => {
                    // Never sent: nothing to hand back; it is no failure of its peer.
                    if let Some(at) = self.tries.iter().position(|t| t.id == tid) {
                        let t = self.tries.remove(at);
                        let v = peers[t.peer].view_mut();
                        v.in_flight = v.in_flight.saturating_sub(1);
                    }
                }
            }
        }
        // The far-behind rule, once a stripe has finished.
        if self.striped && self.spans.iter().any(|s| s.done.is_some()) {
            let states: Vec<StripeState> = self
                .spans
                .iter()
                .enumerate()
                .map(|(k, s)| {
                    if let Some(rate) = s.done {
                        return StripeState::Done { rate };
                    }
                    match self
                        .tries
                        .iter()
                        .find(|t| t.span == k && t.moving.is_none())
                    {
                        Some(t) => StripeState::Running {
                            since: t.started,
                            verified_at_start: t.from - s.start,
                            verified: t.verified - s.start,
                            len: s.end - s.start,
                            elsewhere: policy::idle_holder_left(views(peers), id, t.peer, now),
                        },
                        None => StripeState::Waiting,
                    }
                })
                .collect();
            if let Some(k) = policy::far_behind(&states, self.spec.chunk, now) {
                tracing::debug!(
                    "expert {id}: bytes {}..{} fell far behind the other stripes; moving the \
                     rest to another holder",
                    self.spans[k].start,
                    self.spans[k].end
                );
                let running = self
                    .tries
                    .iter()
                    .find(|t| t.span == k && t.moving.is_none());
                if let Some(tid) = running.map(|t| t.id) {
                    self.move_try(tid, Move::FarBehind, peers, now);
                }
            }
        }
    }

    /// Asks try `id` to give up, handing back what verified.
    fn move_try<V: ViewMut>(&mut self, id: TryId, why: Move, peers: &mut [V], now: Instant) {
        let Some(t) = self.tries.iter_mut().find(|t| t.id == id) else {
            return;
        };
        t.moving = Some(why);
        if t.sent.is_some() {
            self.actions.push_back(Action::Cancel {
                try_id: id,
                keep: true,
            });
        } else {
            // Not sent yet (waiting for a dial): it ends here, the kept buffer untouched.
            self.ended(id, Err(TryError::Moved), 0, false, peers, now);
        }
    }

    /// Goes on with span `k` when no try of it runs: the next holder in this round, another
    /// round after its pause, or the end of the span.
    fn advance<V: ViewMut>(&mut self, k: usize, peers: &mut [V], now: Instant) {
        let s = &self.spans[k];
        if s.done.is_some()
            || self.tries.iter().any(|t| t.span == k)
            || s.local == LocalRace::Running
        {
            return;
        }
        let picked = if let Some(until) = s.pause_until {
            if now < until {
                return;
            }
            let s = &mut self.spans[k];
            s.pause_until = None;
            s.round += 1;
            s.clock.next_round();
            s.round_start = s.kept_len();
            s.tried.clear();
            tracing::debug!(
                "expert {}: every holder tried and some still sending, busy or coming back; \
                 round {} with {:.1}s per try (more while chunks verify), after {} verified \
                 bytes",
                self.spec.id,
                s.round,
                s.clock.timeout.as_secs_f64(),
                s.kept_len()
            );
            self.pick(k, peers, now)
        } else {
            if s.round > 1 && s.clock.spent(now) {
                let budget = s.clock.budget();
                self.spans[k].failures.push(Failure::Budget(budget));
                return self.fail_span(k, peers);
            }
            let first = self.spans[k].first.take();
            let picked = first
                .and_then(|i| self.pick_this(k, i, peers))
                .or_else(|| self.pick(k, peers, now));
            if picked.is_none() {
                // Every holder tried: another round, or the end (the policy's call).
                let s = &mut self.spans[k];
                let end = RoundEnd {
                    progressed: s.kept_len() > s.round_start,
                    busy: std::mem::take(&mut s.busy),
                    slow: std::mem::take(&mut s.retry),
                    // With the expert on the local disk, a lost holder is not waited for.
                    coming_back: if self.spec.local {
                        None
                    } else {
                        policy::coming_back(views(peers), self.spec.id, now)
                    },
                };
                if let Some(pause) = s.rounds.after(end, &s.clock, now) {
                    s.pause_until = Some(now + pause);
                    return;
                }
            }
            picked
        };
        match picked {
            Some(i) => self.start(k, i, false, peers, now),
            None => self.fail_span(k, peers),
        }
    }

    fn fail_span<V: ViewMut>(&mut self, k: usize, peers: &mut [V]) {
        let id = self.spec.id;
        let s = &mut self.spans[k];
        let failures = std::mem::take(&mut s.failures);
        let e = if failures.is_empty() {
            LoadError::NoHolder { id }
        } else {
            LoadError::Exhausted { id, failures }
        };
        let e = if self.striped {
            LoadError::Stripe {
                start: s.start,
                end: s.end,
                len: self.spec.len,
                source: Box::new(e),
            }
        } else {
            e
        };
        self.finish(peers, Err(e));
    }

    /// Ends the load: every try still running is cancelled, then [`Action::Done`].
    fn finish<V: ViewMut>(&mut self, peers: &mut [V], r: Result<Loaded, LoadError>) {
        let running: Vec<TryId> = self.tries.iter().map(|t| t.id).collect();
        for id in running {
            self.drop_try(id, peers);
        }
        self.events.clear();
        self.finished = true;
        self.wake = None;
        self.actions.push_back(Action::Done(r));
    }

    /// The earliest time a timer of the load runs out.
    fn next_wake<V: ViewMut>(&self, peers: &[V], now: Instant) -> Option<Instant> {
        let mut wake: Option<Instant> = None;
        let mut at = |t: Instant| wake = Some(wake.map_or(t, |w| w.min(t)));
        for s in &self.spans {
            if let Some(t) = s.pause_until {
                at(t);
            }
            if let Some(t) = s.hedge_at {
                at(t);
            }
        }
        for t in &self.tries {
            if let (Some(sent), false, None) = (t.sent, t.watched, t.moving) {
                let v = peers[t.peer].view();
                let quiet = v.heard.map_or(sent, |h| h.max(sent));
                let quiet = v
                    .unanswered(now)
                    .and_then(|q| now.checked_sub(q))
                    .map_or(quiet, |owed| quiet.min(owed));
                at(quiet + policy::silence_limit(v.rtt));
            }
        }
        if self.striped && self.spans.iter().any(|s| s.done.is_some()) && !self.tries.is_empty() {
            at(now + STRIPE_TICK);
        }
        wake
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use stormo_wire::ExpertSet;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    fn x() -> ExpertId {
        ExpertId {
            layer: 0,
            expert: 1,
        }
    }

    /// A peer holding `x()` by its inventory, its connection up and heard at `t`.
    fn holder(t: Instant) -> PeerView {
        let mut inv = ExpertSet::new(2, 4).expect("shape");
        inv.insert(x()).expect("in shape");
        let mut p = PeerView::default();
        p.inventory = Some(inv);
        p.up = true;
        p.ever_connected = true;
        p.heard = Some(t);
        p.rtt = Some(Duration::from_millis(1));
        p
    }

    fn cfg() -> LoadConfig {
        LoadConfig {
            request_timeout: Duration::from_secs(30),
            hedge_min: Duration::from_millis(20),
            hedge_max: Duration::from_secs(2),
            stripe_min: MIB,
        }
    }

    fn spec(len: u64, demand: bool) -> LoadSpec {
        LoadSpec {
            id: x(),
            len,
            chunk: 256 * KIB,
            demand,
            local: false,
        }
    }

    /// A load and the peer set it runs over, on a fake clock.
    struct Sim {
        load: Load,
        peers: Vec<PeerView>,
        t0: Instant,
        now: Instant,
        /// Peers whose connections keep hearing (their `heard` follows the clock).
        alive: Vec<usize>,
    }

    impl Sim {
        fn new(n: usize, spec: LoadSpec) -> Self {
            let t0 = Instant::now();
            Self {
                load: Load::new(spec, cfg()),
                peers: (0..n).map(|_| holder(t0)).collect(),
                t0,
                now: t0,
                alive: (0..n).collect(),
            }
        }

        /// Every action at `ms` milliseconds from the start.
        fn at(&mut self, ms: u64) -> Vec<Action> {
            self.now = self.t0 + Duration::from_millis(ms);
            for &i in &self.alive {
                self.peers[i].heard = Some(self.now);
            }
            let mut out = Vec::new();
            while let Some(a) = self.load.poll_action(&mut self.peers, self.now) {
                out.push(a);
            }
            out
        }

        fn event(&mut self, ms: u64, e: Event) {
            self.now = self.t0 + Duration::from_millis(ms);
            self.load.handle(e, self.now);
        }

        /// The try of `send` verified its span whole at `ms`.
        fn verified(&mut self, ms: u64, send: &Request) -> Vec<Action> {
            self.event(
                ms,
                Event::Ended {
                    try_id: send.try_id,
                    result: Ok(()),
                    verified_end: send.range.end,
                    kept: true,
                },
            );
            self.at(ms)
        }

        /// The try of `send` failed at `ms` with `error`, with its bytes up to `verified_end`
        /// verified.
        fn failed(
            &mut self,
            ms: u64,
            send: &Request,
            error: TryError,
            verified_end: u64,
        ) -> Vec<Action> {
            self.event(
                ms,
                Event::Ended {
                    try_id: send.try_id,
                    result: Err(error),
                    verified_end,
                    kept: true,
                },
            );
            self.at(ms)
        }

        fn in_flight(&self) -> Vec<u32> {
            self.peers.iter().map(|p| p.in_flight).collect()
        }
    }

    fn dbg(x: &impl fmt::Debug) -> String {
        format!("{x:?}")
    }

    fn sends(actions: &[Action]) -> Vec<Request> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send(s) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }

    fn only_send(actions: &[Action]) -> Request {
        let s = sends(actions);
        assert_eq!(s.len(), 1, "one request in {actions:?}");
        s[0].clone()
    }

    fn done(actions: &[Action]) -> Option<&Result<Loaded, LoadError>> {
        actions.iter().find_map(|a| match a {
            Action::Done(r) => Some(r),
            _ => None,
        })
    }

    fn cancels(actions: &[Action]) -> Vec<(TryId, bool)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Cancel { try_id, keep } => Some((*try_id, *keep)),
                _ => None,
            })
            .collect()
    }

    fn slow() -> TryError {
        TryError::Fetch {
            error: FetchError::TimedOut {
                after: Duration::from_secs(30),
                received: 0,
            },
            heard: true,
        }
    }

    fn busy() -> TryError {
        TryError::Fetch {
            error: FetchError::Remote {
                code: ErrorCode::BUSY,
                message: "busy".into(),
            },
            heard: true,
        }
    }

    /// A demand request slower than its peer's usual (three times its expected time before
    /// there are samples: 35 ms for 1 MiB at the assumed rate) is raced by a second holder;
    /// the first verified answer wins, the other is cancelled and counted as a lost race.
    #[test]
    fn a_slow_demand_try_is_hedged_and_the_faster_wins() {
        let mut sim = Sim::new(2, spec(MIB, true));
        let a = only_send(&sim.at(0));
        assert_eq!(
            (a.peer, a.range.clone(), a.buffer),
            (0, 0..MIB, BufferFrom::Kept)
        );
        assert!(
            a.extend_until.is_none(),
            "another holder is left: cut off at the deadline"
        );
        assert!(sim.at(34).is_empty(), "not before the hedge delay");
        let b = only_send(&sim.at(36));
        assert_eq!(
            (b.peer, b.range.clone(), b.buffer),
            (1, 0..MIB, BufferFrom::Fresh)
        );
        assert_eq!(b.timeout, a.timeout, "a racer has the first try's limit");
        assert_eq!(sim.in_flight(), [1, 1]);
        assert_eq!(sim.load.stats().hedges, 1);

        let out = sim.verified(50, &b);
        assert_eq!(cancels(&out), [(a.try_id, false)], "the loser is cancelled");
        assert!(matches!(done(&out), Some(Ok(Loaded::Peers))));
        assert_eq!(sim.load.stats().hedge_wins, 1);
        assert_eq!(sim.peers[0].races_lost, 1);
        assert_eq!(sim.peers[1].bytes, MIB);
        assert_eq!(sim.in_flight(), [0, 0]);
        assert!(sim.at(5000).is_empty(), "nothing after the end");
    }

    /// A prefetch is not hedged on time, and a striped load is not hedged at all.
    #[test]
    fn a_prefetch_is_not_hedged_on_time() {
        let mut sim = Sim::new(2, spec(MIB, false));
        let a = only_send(&sim.at(0));
        assert!(sim.at(500).is_empty());
        assert!(matches!(
            done(&sim.verified(900, &a)),
            Some(Ok(Loaded::Peers))
        ));
        assert_eq!(sim.load.stats().hedges, 0);
    }

    /// A try that fails keeps its verified prefix: the next holder is asked only for the rest,
    /// the failing peer is warned about and backed off, and the failure is counted as one
    /// another try made up for.
    #[test]
    fn a_failed_try_resumes_after_the_verified_prefix_at_another_holder() {
        let mut sim = Sim::new(2, spec(MIB, false));
        let a = only_send(&sim.at(0));
        let out = sim.failed(10, &a, TryError::Other("refused".into()), 512 * KIB);
        assert!(
            matches!(&out[0], Action::Warn { peer: 0, message } if message.contains("refused")),
            "{out:?}"
        );
        assert!(sim.peers[0].avoided(sim.now));
        let b = only_send(&out);
        assert_eq!((b.peer, b.range.clone()), (1, 512 * KIB..MIB));
        assert_eq!(b.buffer, BufferFrom::Kept);
        assert!(b.keep_spare, "a racer may need a copy of the prefix");
        assert!(
            b.extend_until.is_some(),
            "the last holder runs on while chunks verify"
        );
        assert!(matches!(done(&sim.verified(20, &b)), Some(Ok(_))));
        assert_eq!(sim.peers[0].bytes, 512 * KIB);
        assert_eq!(sim.peers[1].bytes, 512 * KIB);
        assert_eq!(sim.load.stats().retried(true), 1);
    }

    /// Tries that run out of time while their peer is still sending are worth more rounds:
    /// each after a pause, with twice the deadline, until four rounds verified nothing more.
    /// Busy rounds do not count.
    #[test]
    fn rounds_double_the_deadline_and_end_after_four_stalled_rounds() {
        let mut sim = Sim::new(1, spec(MIB, false));
        let mut s = only_send(&sim.at(0));
        assert_eq!(s.timeout, Duration::from_secs(30));
        assert!(
            s.extend_until.is_some(),
            "no other holder: runs on while chunks verify"
        );
        let mut t = 30_000;
        // A busy answer: another round, not counted as stalled.
        let out = sim.failed(t, &s, busy(), 0);
        assert!(sends(&out).is_empty(), "a pause first");
        t += 500;
        s = only_send(&sim.at(t));
        assert_eq!(s.timeout, Duration::from_secs(60));
        let mut pauses = Vec::new();
        for _ in 0..3 {
            t += s.timeout.as_millis() as u64;
            assert!(sends(&sim.failed(t, &s, slow(), 0)).is_empty());
            let start = t;
            loop {
                t += 50;
                let out = sim.at(t);
                if let Some(n) = sends(&out).pop() {
                    s = n;
                    break;
                }
            }
            pauses.push(t - start);
        }
        assert_eq!(
            pauses,
            [1000, 2000, 2000],
            "the pause grows with the quiet rounds"
        );
        assert_eq!(
            s.timeout,
            Duration::from_secs(240),
            "capped at 8 times the first"
        );
        t += 240_000;
        let out = sim.failed(t, &s, slow(), 0);
        let Some(Err(e)) = done(&out) else {
            panic!("the load ends after the fourth stalled round: {out:?}");
        };
        assert_eq!(e.failures().len(), 5);
        assert_eq!(sim.load.stats().failed, 5);
        assert_eq!(sim.load.stats().retried(false), 4);
        assert!(
            !sim.peers[0].avoided(sim.now),
            "slow and busy are load, not faults"
        );
    }

    /// A peer that keeps verifying more is never cut off by the rounds, only by the load's
    /// budget (32 first deadlines).
    #[test]
    fn the_budget_ends_a_load_that_keeps_progressing() {
        let mut sim = Sim::new(1, spec(64 * MIB, false));
        let mut s = only_send(&sim.at(0));
        let (mut t, mut v) = (0, 0);
        let e = loop {
            t += s.timeout.as_millis() as u64;
            v += 256 * KIB;
            let mut out = sim.failed(t, &s, slow(), v);
            while sends(&out).is_empty() && done(&out).is_none() {
                t += 50;
                out = sim.at(t);
            }
            if let Some(r) = done(&out) {
                break r.as_ref().err().map(ToString::to_string).expect("fails");
            }
            s = only_send(&out);
            assert_eq!(
                s.range.start, v,
                "each round resumes after the verified prefix"
            );
        };
        assert!(e.contains("the load's budget"), "{e}");
        assert!(t >= 32 * 30_000, "not before the budget: {t}");
    }

    /// A record two holders hold, at least two stripes long, is cut on chunks in proportion
    /// to their rates and fetched from both at once, each into its part of the buffer.
    #[test]
    fn a_record_held_twice_is_striped_by_rate() {
        let mut sim = Sim::new(2, spec(6 * MIB, true));
        sim.peers[0].rate = Some(200e6);
        sim.peers[1].rate = Some(100e6);
        let out = sim.at(0);
        assert_eq!(
            dbg(&out[0]),
            dbg(&Action::Stripe(vec![0..4 * MIB, 4 * MIB..6 * MIB]))
        );
        let s = sends(&out);
        assert_eq!(
            s.iter()
                .map(|s| (s.span, s.peer, s.range.clone()))
                .collect::<Vec<_>>(),
            [(0, 0, 0..4 * MIB), (1, 1, 4 * MIB..6 * MIB)]
        );
        assert!(s.iter().all(|s| s.progress && !s.keep_spare));
        assert!(sim.at(3000).is_empty(), "a stripe is not hedged");
        assert!(done(&sim.verified(3100, &s[1])).is_none());
        let out = sim.verified(3200, &s[0]);
        assert!(matches!(done(&out), Some(Ok(Loaded::Peers))));
        assert!(sim.load.stats().striped);
        assert_eq!(sim.peers[0].bytes, 4 * MIB);
        assert_eq!(sim.peers[1].bytes, 2 * MIB);
    }

    /// Once a stripe has finished, a stripe whose try runs at less than half its rate is made
    /// to give up, keeping what verified, and its rest goes to an idle holder: a lost race,
    /// not a failure.
    #[test]
    fn a_straggler_moves_to_an_idle_holder() {
        let mut sim = Sim::new(3, spec(6 * MIB, true));
        // The third holder is backed off while the stripes are planned, idle afterwards.
        sim.peers[2].avoid_until = Some(sim.t0 + Duration::from_millis(50));
        let out = sim.at(0);
        assert_eq!(
            dbg(&out[0]),
            dbg(&Action::Stripe(vec![0..3 * MIB, 3 * MIB..6 * MIB]))
        );
        let s = sends(&out);
        sim.event(
            90,
            Event::Progress {
                try_id: s[1].try_id,
                verified_end: 5 * MIB,
            },
        );
        // The finished stripe ran at 3 MiB in 100 ms; the other, at 2 MiB in 100 ms, is not
        // below half of that.
        let out = sim.verified(100, &s[0]);
        assert!(out.is_empty(), "{out:?}");
        assert!(sim.at(130).is_empty());
        // Nothing more by 150 ms: 2 MiB in 150 ms is.
        let out = sim.at(150);
        assert_eq!(cancels(&out), [(s[1].try_id, true)], "{out:?}");
        let out = sim.failed(160, &s[1], TryError::Moved, 5 * MIB);
        let c = only_send(&out);
        assert_eq!((c.peer, c.span), (2, 1), "to the idle holder");
        assert_eq!(c.range, 5 * MIB..6 * MIB, "after what verified");
        assert_eq!(sim.peers[1].races_lost, 1);
        assert!(!sim.peers[1].avoided(sim.now), "moving is no failure");
        assert!(matches!(done(&sim.verified(200, &c)), Some(Ok(_))));
        assert_eq!(sim.load.stats().failed, 0);
    }

    /// A laggard stays where it is when the only other holders are busy with this node's
    /// fetches.
    #[test]
    fn a_straggler_stays_when_no_holder_is_idle() {
        let mut sim = Sim::new(2, spec(6 * MIB, true));
        let s = sends(&sim.at(0));
        sim.peers[0].in_flight += 1; // another load's fetch
        let out = sim.verified(100, &s[0]);
        assert!(out.is_empty(), "{out:?}");
        assert!(cancels(&sim.at(400)).is_empty());
        // Once that fetch ends, the laggard moves.
        sim.peers[0].in_flight -= 1;
        assert_eq!(cancels(&sim.at(410)), [(s[1].try_id, true)]);
    }

    /// A try whose connection hears nothing beyond what its round trip explains is raced at
    /// once by another holder (a prefetch too, which no timer hedges), its peer is suspect,
    /// and a later load asks the other holder first.
    #[test]
    fn a_silent_peer_is_hedged_at_once_and_later_loads_avoid_it() {
        let mut sim = Sim::new(2, spec(MIB, false));
        sim.alive = vec![1];
        let a = only_send(&sim.at(0));
        assert_eq!(a.peer, 0);
        // 4 round trips of 1 ms and the grace of 750 ms.
        assert!(sim.at(750).is_empty());
        let b = only_send(&sim.at(760));
        assert_eq!(b.peer, 1);
        assert!(sim.peers[0].suspect(sim.now));
        assert_eq!(sim.load.stats().hedges, 1);
        let out = sim.verified(800, &b);
        assert_eq!(cancels(&out), [(a.try_id, false)]);
        assert!(matches!(done(&out), Some(Ok(_))));

        // The next load of the same peers: the silent connection is asked last.
        let mut next = Load::new(spec(MIB, false), cfg());
        let s = match next.poll_action(&mut sim.peers, sim.now) {
            Some(Action::Send(s)) => s,
            a => panic!("{a:?}"),
        };
        assert_eq!(s.peer, 1, "not the silent connection");
        // Once it hears again it is not suspect.
        sim.peers[0].heard = Some(sim.now + Duration::from_millis(1));
        assert!(!sim.peers[0].suspect(sim.now));
    }

    /// A stopped peer whose every try is raced and won by another holder before its own
    /// silence limit (a decode's small demand loads, hedged after tens of milliseconds) is
    /// still found silent: its connection has owed a datagram since the first request sent on
    /// it, so once that is longer than its latency explains, it is suspect and later loads ask
    /// the other holder first. (Measured before the rule: a peer stopped mid-run was asked
    /// first by every load of the rest of a 24-token run, each raced after a hedge delay that
    /// grew with every race it lost: +5.3 s.)
    #[test]
    fn a_silent_peer_whose_tries_are_all_raced_is_still_found_silent() {
        let mut sim = Sim::new(2, spec(MIB, true));
        sim.alive = vec![1];
        let mut first_at_0 = 0;
        // Both were heard at 0.
        let mut ms = 10;
        // Loads one after another, each ended by peer 1 within 100 ms.
        while ms < 710 {
            let a = only_send(&sim.at(ms));
            if a.peer == 0 {
                first_at_0 += 1;
                let mut t = ms;
                let b = loop {
                    t += 5;
                    let out = sim.at(t);
                    if let Some(b) = sends(&out).pop() {
                        break b;
                    }
                    assert!(t < ms + 100, "peer 0's try was not raced");
                };
                assert_eq!(b.peer, 1);
                let out = sim.verified(t + 1, &b);
                assert_eq!(cancels(&out), [(a.try_id, false)]);
                assert!(matches!(done(&out), Some(Ok(_))));
            } else {
                assert!(matches!(done(&sim.verified(ms + 1, &a)), Some(Ok(_))));
            }
            assert!(!sim.peers[0].suspect(sim.now), "at {ms} ms");
            ms += 100;
            sim.load = Load::new(spec(MIB, true), cfg());
        }
        assert!(first_at_0 >= 1, "peer 0 was asked first at least once");
        assert_eq!(sim.in_flight(), [0, 0], "every raced try was cancelled");
        // 4 round trips of 1 ms and the grace of 750 ms after the first request to peer 0.
        let s = only_send(&sim.at(770));
        assert!(sim.peers[0].suspect(sim.now));
        assert_eq!(s.peer, 1, "not the silent connection");
        // Heard again, it is asked as before.
        sim.alive = vec![0, 1];
        sim.at(800);
        assert!(!sim.peers[0].suspect(sim.now));
    }

    /// A try sent to a connection that has owed a datagram since an earlier request is raced
    /// when that earlier request's silence limit ends, not a whole limit after its own send.
    #[test]
    fn a_try_at_a_connection_already_silent_is_raced_on_the_connections_clock() {
        let mut sim = Sim::new(2, spec(MIB, false));
        sim.alive = vec![1];
        // An earlier request (another load's, cancelled since), after it was last heard.
        sim.peers[0].request_sent(sim.t0 + Duration::from_millis(10));
        let a = only_send(&sim.at(500));
        assert_eq!(a.peer, 0);
        assert_eq!(
            sim.load.poll_timeout(),
            Some(sim.t0 + Duration::from_millis(764)),
            "woken on the connection's clock"
        );
        assert!(sim.at(760).is_empty());
        let b = only_send(&sim.at(764));
        assert_eq!(b.peer, 1, "raced 264 ms after its own send");
    }

    /// A silent stripe moves at once to a connected holder, whatever its fetches in flight.
    #[test]
    fn a_silent_stripe_moves_to_a_connected_holder() {
        let mut sim = Sim::new(2, spec(6 * MIB, false));
        sim.alive = vec![0];
        let s = sends(&sim.at(0));
        assert_eq!(s.len(), 2);
        let out = sim.at(760);
        assert_eq!(cancels(&out), [(s[1].try_id, true)]);
        let out = sim.failed(770, &s[1], TryError::Moved, 3 * MIB);
        let c = only_send(&out);
        assert_eq!((c.peer, c.range.clone()), (0, 3 * MIB..6 * MIB));
        let Some(Failure::Peer { error, .. }) = sim.load.spans[1].failures.last() else {
            panic!("the move is noted");
        };
        assert!(
            error.to_string().contains("heard nothing for 0.8s"),
            "{error}"
        );
    }

    /// A peer whose connection is lost mid-answer costs one try: the load goes on at another
    /// holder (the driver marked the loss).
    #[test]
    fn a_dead_peer_costs_one_try() {
        let mut sim = Sim::new(2, spec(MIB, true));
        let a = only_send(&sim.at(0));
        sim.peers[0].lose(sim.now);
        let lost = TryError::Lost(Box::new(TryError::Fetch {
            error: FetchError::ConnectionLost {
                reason: "reset".into(),
            },
            heard: false,
        }));
        let out = sim.failed(10, &a, lost, 0);
        assert!(
            !out.iter().any(|a| matches!(a, Action::Warn { .. })),
            "marked once, by the driver"
        );
        let b = only_send(&out);
        assert_eq!(b.peer, 1);
        assert!(matches!(done(&sim.verified(20, &b)), Some(Ok(_))));
        assert_eq!(sim.load.stats().retried(true), 1);
    }

    /// A sole holder whose connection was lost is waited for in rounds and redialled with
    /// back-off; when it is back, the load finishes from it.
    #[test]
    fn a_sole_holder_coming_back_is_redialled_and_finishes_the_load() {
        let mut sim = Sim::new(1, spec(MIB, false));
        let a = only_send(&sim.at(0));
        sim.peers[0].lose(sim.t0 + Duration::from_millis(1000));
        let lost = TryError::Lost(Box::new(TryError::Other("reset".into())));
        assert!(sim.failed(1000, &a, lost, 256 * KIB).is_empty(), "a pause");
        // The first redial is allowed at once; the pause after a round that verified more is
        // 0.25 s.
        let out = sim.at(1240);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(dbg(&sim.at(1250)), dbg(&[Action::Dial { peer: 0 }]));
        // It fails (the driver asked the policy, dialled and noted the failure): the next
        // attempt is allowed 0.5 s later, and the quiet round's pause is as long.
        let now = sim.now;
        assert_eq!(sim.peers[0].dial(now), policy::Dial::Now);
        sim.peers[0].dial_failed("refused", now);
        sim.event(
            1300,
            Event::Dialed {
                peer: 0,
                result: Err(LinkError::Connect("refused".into())),
            },
        );
        assert!(sim.at(1300).is_empty());
        assert!(sim.at(1790).is_empty());
        assert_eq!(dbg(&sim.at(1800)), dbg(&[Action::Dial { peer: 0 }]));
        sim.peers[0].connected(sim.now);
        sim.event(
            1900,
            Event::Dialed {
                peer: 0,
                result: Ok(()),
            },
        );
        let b = only_send(&sim.at(1900));
        assert_eq!(
            b.range,
            256 * KIB..MIB,
            "resumes after what verified before the loss"
        );
        assert!(matches!(done(&sim.verified(2000, &b)), Some(Ok(_))));
    }

    /// A holder that does not come back ends the load naming it.
    #[test]
    fn a_sole_holder_that_stays_away_ends_the_load() {
        let mut sim = Sim::new(1, spec(MIB, false));
        let a = only_send(&sim.at(0));
        sim.peers[0].lose(sim.now);
        sim.failed(
            10,
            &a,
            TryError::Lost(Box::new(TryError::Other("reset".into()))),
            0,
        );
        let mut t = 10;
        let e = loop {
            t += 50;
            let out = sim.at(t);
            if out.iter().any(|a| matches!(a, Action::Dial { peer: 0 })) {
                let now = sim.now;
                if let policy::Dial::Wait {
                    why,
                    left,
                    coming_back,
                } = sim.peers[0].dial(now)
                {
                    let r = Err(LinkError::Wait {
                        why,
                        left,
                        coming_back,
                    });
                    sim.event(t, Event::Dialed { peer: 0, result: r });
                } else {
                    sim.peers[0].dial_failed("refused", now);
                    let r = Err(LinkError::Connect("refused".into()));
                    sim.event(t, Event::Dialed { peer: 0, result: r });
                }
            }
            if let Some(r) = done(&out) {
                break r
                    .as_ref()
                    .err()
                    .map(|e| e.named(&|i| format!("P{i}")).to_string());
            }
            assert!(t < 30_000, "ends within the bounds");
        };
        let e = e.expect("fails");
        assert!(
            e.starts_with("no peer could supply expert 0:1 (P0: connection lost"),
            "{e}"
        );
        assert!(e.contains("P0: cannot connect: refused"), "{e}");
    }

    /// No try waits on a redial while another holder is connected: a connected holder is
    /// asked before one that needs a dial, and a try waiting on a dial is raced at once by a
    /// holder that is connected.
    #[test]
    fn no_try_waits_on_a_redial_while_another_holder_is_connected() {
        let mut sim = Sim::new(2, spec(MIB, false));
        sim.peers[0].up = false;
        sim.peers[1].in_flight = 3;
        let s = sim.at(0);
        assert_eq!(only_send(&s).peer, 1, "{s:?}");

        let mut sim = Sim::new(2, spec(MIB, false));
        sim.peers[0].up = false;
        sim.peers[1].avoid_until = Some(sim.t0 + Duration::from_secs(10));
        let out = sim.at(0);
        assert_eq!(dbg(&out[0]), dbg(&Action::Dial { peer: 0 }));
        let b = only_send(&out);
        assert_eq!(b.peer, 1, "the connected holder is asked at once");
        assert!(matches!(done(&sim.verified(10, &b)), Some(Ok(_))));
    }

    /// A slow whole record with no other holder races the local disk once; the disk winning
    /// ends the load and cancels the peer's try.
    #[test]
    fn a_slow_demand_try_races_the_local_disk() {
        let mut sim = Sim::new(
            1,
            LoadSpec {
                local: true,
                ..spec(MIB, true)
            },
        );
        let a = only_send(&sim.at(0));
        assert_eq!(dbg(&sim.at(40)), dbg(&[Action::LoadLocal]));
        sim.event(45, Event::LocalEnded(Ok(())));
        let out = sim.at(45);
        assert_eq!(cancels(&out), [(a.try_id, false)]);
        assert!(matches!(done(&out), Some(Ok(Loaded::Local))));
        assert_eq!(sim.load.stats().local_wins, 1);
        assert_eq!(sim.peers[0].races_lost, 1);
        assert_eq!(sim.in_flight(), [0]);
    }

    /// Bad bytes drop the peer for the session, named once; the error at the tier's edge
    /// names each peer by its address.
    #[test]
    fn bad_bytes_drop_the_peer_and_errors_name_peers_at_the_edge() {
        let mut sim = Sim::new(2, spec(MIB, false));
        let a = only_send(&sim.at(0));
        let bad = TryError::Fetch {
            error: FetchError::BadChunk {
                index: 1,
                offset: 256 * KIB,
                source: "hash mismatch".into(),
            },
            heard: true,
        };
        let out = sim.failed(5, &a, bad, 256 * KIB);
        assert!(
            matches!(&out[0], Action::Warn { peer: 0, message } if message.contains("failed verification"))
        );
        assert!(sim.peers[0].banned.is_some());
        let b = only_send(&out);
        let out = sim.failed(9, &b, TryError::Other("refused".into()), 256 * KIB);
        let Some(Err(e)) = done(&out) else {
            panic!("{out:?}")
        };
        let names = |i: usize| format!("KEY{i}@10.0.0.{i}:4433");
        let text = e.named(&names).to_string();
        assert!(
            text.starts_with("no peer could supply expert 0:1 (KEY0@10.0.0.0:4433: chunk 1"),
            "{text}"
        );
        assert!(text.contains("; KEY1@10.0.0.1:4433: refused)"), "{text}");
    }

    #[test]
    fn long_error_lists_keep_their_ends() {
        let list = |n: usize| -> String {
            let failures: Vec<Failure> = (0..n)
                .map(|i| Failure::Peer {
                    peer: i,
                    error: TryError::Other(format!("e{i}")),
                })
                .collect();
            let e = LoadError::Exhausted { id: x(), failures };
            let name = |i: usize| format!("p{i}");
            let text = e.named(&name).to_string();
            text
        };
        assert_eq!(
            list(7),
            "no peer could supply expert 0:1 (p0: e0; p1: e1; p2: e2; p3: e3; p4: e4; p5: e5; \
             p6: e6)"
        );
        assert_eq!(
            list(40),
            "no peer could supply expert 0:1 (p0: e0; p1: e1; p2: e2; ... 34 more ...; \
             p37: e37; p38: e38; p39: e39)"
        );
    }

    /// A load the driver gives up (the tier closing) leaves nothing in flight.
    #[test]
    fn an_abandoned_load_leaves_nothing_in_flight() {
        let mut sim = Sim::new(2, spec(MIB, true));
        only_send(&sim.at(0));
        sim.at(40);
        assert_eq!(sim.in_flight(), [1, 1]);
        sim.load.abandon(&mut sim.peers);
        assert_eq!(sim.in_flight(), [0, 0]);
        assert!(sim.at(100).is_empty());
    }

    /// A racer resumes after the verified prefix too, from a copy made before the first try
    /// took it; of two racers that fail, the longer prefix is kept.
    #[test]
    fn racers_resume_after_the_prefix_and_the_longer_prefix_is_kept() {
        let mut sim = Sim::new(4, spec(MIB, true));
        let a = only_send(&sim.at(0));
        let out = sim.failed(10, &a, TryError::Other("refused".into()), 256 * KIB);
        let b = only_send(&out);
        assert_eq!(
            (b.range.start, b.buffer, b.keep_spare),
            (256 * KIB, BufferFrom::Kept, true)
        );
        let t = sim.t0 + Duration::from_millis(10);
        let delay = policy::hedge_delay(
            &sim.peers[b.peer],
            MIB,
            cfg().hedge_min,
            cfg().hedge_max,
            cfg().request_timeout,
        );
        let at = (t + delay - sim.t0).as_millis() as u64 + 1;
        let c = only_send(&sim.at(at));
        assert_eq!((c.range.start, c.buffer), (256 * KIB, BufferFrom::Spare));
        // Both fail: the second at a longer prefix, which the next try resumes after.
        let out = sim.failed(at + 5, &b, TryError::Other("reset".into()), 512 * KIB);
        assert!(sends(&out).is_empty(), "the racer still runs");
        let out = sim.failed(at + 6, &c, TryError::Other("reset".into()), 768 * KIB);
        let d = only_send(&out);
        assert_eq!(
            (d.peer, d.range.start, d.buffer),
            (3, 768 * KIB, BufferFrom::Kept)
        );
        assert!(matches!(done(&sim.verified(at + 20, &d)), Some(Ok(_))));
        assert_eq!(sim.load.stats().hedges, 1);
        assert_eq!(sim.load.stats().hedge_wins, 0);
        assert_eq!(sim.load.stats().retried(true), 3);
    }
}
