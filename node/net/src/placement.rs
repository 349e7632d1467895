//! Replica placement: which experts a serving node fetches and evicts so that the swarm holds
//! every expert at least `--replicas N` times, and its spare room goes to the experts asked for
//! most (issue 57, item 2).
//!
//! # What this module owns
//! One [`Placement`] per serving node: a sans-IO policy in the manner of quinn-proto's
//! `Connection`. The node feeds it what it learns through [`Placement::handle`] (peers'
//! [`Announcement`]s, peers leaving, the demand it sees, the outcome of its fetches, what its
//! store holds) with the time passed in, and drains decisions from [`Placement::poll_action`]:
//! [`Action::Fetch`] (fetch this expert, verified, from one of these holders and keep it),
//! [`Action::Evict`] (delete this kept expert) and [`Action::Announce`] (send peers
//! [`Placement::announcement`]). No sockets, no clock, no randomness: the same inputs give the
//! same actions, so a thousand instances can be stepped in a unit test.
//!
//! # The policy
//! - **Copies.** Each node counts, per expert, the peers holding it (their inventories) and the
//!   peers fetching it (their announced claims), plus itself. An expert with fewer than N copies
//!   (holders + claims) is *missing copies*.
//! - **Rarest first** (BitTorrent). A node with spare budget fetches the experts missing the
//!   most copies first; when none is missing it adds copies where demand per copy is highest
//!   (Petals' rebalancing: the experts asked for most get more copies). Demand is the node's
//!   own count of requests, halved every `demand_half_life`, plus the counts peers announce.
//! - **No herding.** A thousand nodes that see the same view must not all fetch the same rare
//!   expert. Decisions are taken once per `round` (time passed in), and in each round a node
//!   takes part for an expert missing `d` copies only if its lottery ticket — a hash of
//!   (node, expert, round), different on every node and every round, like CRUSH's or
//!   rendezvous hashing's per-node draws — falls under `claimants_per_copy · d / F`, `F` being
//!   the nodes with room. So about `claimants_per_copy · d` nodes act per round for an expert,
//!   whatever the swarm's size; their claims reach the others within a round (announce delay
//!   below `round`), which then see the copies as coming and hold back. Re-replication after a
//!   departure goes through the same lottery, so it neither stampedes nor overshoots much.
//! - **Eviction.** A node evicts only to make room for something worth more, or when its
//!   budget shrank. It evicts first what has most copies elsewhere and is least used (lowest
//!   demand per copy); never an expert it fetched less than `min_hold` ago, never one that
//!   would fall below N copies, and of the holders of an over-replicated expert only the
//!   `copies − N` with the highest rendezvous score of (holder, expert) may evict it, so two
//!   holders never drop the last spare copy at once.
//! - **Hysteresis.** A full node swaps (evict, then fetch) at most once per `swap_interval`;
//!   for a missing copy only after the copy stayed missing `swap_after` with no node with room
//!   in view, and for demand only when the new copy is worth `swap_gain` times the evicted one
//!   (demand per copy), so a swap cannot be undone by the reverse swap. In a stable swarm the
//!   policy goes quiet: no actions once every node is full and the copies are level.
//! - **Bounded bytes.** A node fetches at most `max_in_flight` experts at once and never past
//!   its budget (claims are reserved); its bytes moved are its budget plus one expert per
//!   `swap_interval` at most.
//!
//! # How a node drives it
//! - At start: [`Placement::new`] with the manifest's experts and sizes, then
//!   [`Event::Holding`] for every expert on disk (`pinned` for the model folder's own experts,
//!   which are never evicted and do not count against the budget; not pinned for kept ones).
//! - On every peer inventory or announcement: [`Event::Announced`]; when a peer says goodbye
//!   or stops answering: [`Event::PeerLeft`]. Each request for an expert served or computed
//!   here: [`Event::Demand`]. Each fetch the policy asked for ends in [`Event::FetchDone`]
//!   (verified and stored) or [`Event::FetchFailed`].
//! - After each event, and at [`Placement::poll_timeout`], call [`Placement::poll_action`]
//!   until it returns `None`, and carry the actions out. On [`Action::Announce`] send every
//!   peer [`Placement::announcement`] (held, pinned, fetching, budget, used, demand counts).
//! - On a clean stop, say goodbye to peers: they re-replicate what fell below N.
//!
//! # Non-goals
//! Moving bytes, verifying them (the caller fetches through the verified path), choosing among
//! the sources (the caller's peer choice and hedging do that), the wire encoding of
//! announcements, and partial views: every node is assumed to see every serving peer's
//! announcement (a swarm of thousands needs the counts gossiped or a DHT to find the holders
//! of an expert; not done here).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::Hash;
use std::time::{Duration, Instant};

use draw::{hash3, mix, node_key, unit, SALT_COVER, SALT_DEMAND, SALT_SOURCE};
use evict::Safety;

pub use stormo_engine::tiers::ExpertId;

/// The 32 bits of an expert id, for the per-node draws.
fn bits(id: ExpertId) -> u64 {
    (u64::from(id.layer) << 16) | u64::from(id.expert)
}

/// An expert of the manifest and the bytes its record takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertInfo {
    /// The expert.
    pub id: ExpertId,
    /// Its record's size in bytes.
    pub bytes: u64,
}

/// The policy's knobs. [`Config::default`] is what a node uses; every value is clamped to a
/// usable range by [`Placement::new`].
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Copies of every expert the swarm aims at (`--replicas`, at least 1).
    pub replicas: u32,
    /// Whether a model folder's own copy (a pinned one: a seeder's) counts towards
    /// `replicas`. Off by default: the N copies are kept copies, so the swarm keeps the whole
    /// model once its seeders leave.
    pub count_pinned: bool,
    /// Fetches of this policy running at once (at least 1).
    pub max_in_flight: usize,
    /// How often decisions are taken, and how long a lottery ticket lasts. Must exceed the time
    /// an announcement takes to reach the peers, or claims arrive too late to stop others.
    pub round: Duration,
    /// Width of the first lottery: a node ranks itself among the nodes with room for an
    /// expert missing `d` copies only when its draw falls under `lottery_width · d / F`
    /// (`F`: nodes with room); the `d` best draws act. 3 finds the `d` best in 95% of rounds
    /// at `d` = 1 while ranking itself for few experts.
    pub lottery_width: f64,
    /// Full nodes expected to swap per missing copy per round (above 0).
    pub swap_claimants_per_copy: f64,
    /// A fetched expert is not evicted (except to meet a shrunk budget) before this.
    pub min_hold: Duration,
    /// A demand swap needs the new copy to be worth this many times the evicted one (above 1).
    pub swap_gain: f64,
    /// At most one swap (evict to fetch) per this long.
    pub swap_interval: Duration,
    /// A full node swaps for a missing copy only once it stayed missing this long with no node
    /// with room in view.
    pub swap_after: Duration,
    /// After a failed fetch, the expert is not tried again before this.
    pub retry_after: Duration,
    /// Demand copies go to experts whose demand per copy is within this factor of the best
    /// (at least 1): fill level by level rather than all on one expert.
    pub level_tolerance: f64,
    /// Local demand counts halve over this.
    pub demand_half_life: Duration,
    /// Demand alone is re-announced at most this often.
    pub demand_announce_interval: Duration,
    /// Sources named in a [`Action::Fetch`] at most.
    pub max_sources: usize,
    /// Demand counts in an [`Announcement`] at most (the highest).
    pub max_demand_entries: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            replicas: 2,
            count_pinned: false,
            max_in_flight: 2,
            round: Duration::from_secs(2),
            lottery_width: 3.0,
            swap_claimants_per_copy: 0.5,
            min_hold: Duration::from_secs(600),
            swap_gain: 2.0,
            swap_interval: Duration::from_secs(60),
            swap_after: Duration::from_secs(6),
            retry_after: Duration::from_secs(30),
            level_tolerance: 1.25,
            demand_half_life: Duration::from_secs(600),
            demand_announce_interval: Duration::from_secs(30),
            max_sources: 8,
            max_demand_entries: 64,
        }
    }
}

impl Config {
    fn sanitized(mut self) -> Self {
        let d = Self::default();
        self.replicas = self.replicas.max(1);
        self.max_in_flight = self.max_in_flight.max(1);
        self.round = self.round.max(Duration::from_millis(1));
        if !(self.lottery_width.is_finite() && self.lottery_width > 0.0) {
            self.lottery_width = d.lottery_width;
        }
        if !(self.swap_claimants_per_copy.is_finite() && self.swap_claimants_per_copy > 0.0) {
            self.swap_claimants_per_copy = d.swap_claimants_per_copy;
        }
        if !(self.swap_gain.is_finite() && self.swap_gain > 1.0) {
            self.swap_gain = d.swap_gain;
        }
        if !(self.level_tolerance.is_finite() && self.level_tolerance >= 1.0) {
            self.level_tolerance = d.level_tolerance;
        }
        self.max_sources = self.max_sources.max(1);
        self
    }
}

/// What a node tells its peers about itself: its inventory, its claims, its room and the demand
/// it sees. Lists are sets (order and duplicates do not matter); unknown experts are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Announcement {
    /// Budget for kept experts, in bytes.
    pub budget: u64,
    /// Bytes of that budget in use: kept experts and fetches under way.
    pub used: u64,
    /// Kept experts (evictable).
    pub held: Vec<ExpertId>,
    /// Experts held for good (the model folder's): never evicted, outside the budget.
    pub pinned: Vec<ExpertId>,
    /// Experts being fetched: claims, which peers count as copies coming.
    pub fetching: Vec<ExpertId>,
    /// Requests seen for experts (decayed counts, the highest first).
    pub demand: Vec<(ExpertId, u32)>,
}

/// How a peer left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Departure {
    /// It said goodbye (a clean stop).
    Goodbye,
    /// It stopped answering (the driver's timeout).
    TimedOut,
}

/// An input to [`Placement::handle`]. `N` is the node id type.
#[derive(Debug)]
pub enum Event<'a, N> {
    /// A peer's announcement, which replaces whatever it announced before.
    Announced {
        /// The peer.
        peer: N,
        /// What it announced.
        announcement: &'a Announcement,
    },
    /// A peer left: its copies and claims no longer count.
    PeerLeft {
        /// The peer.
        peer: N,
        /// How.
        how: Departure,
    },
    /// Requests for an expert seen here (served to peers or computed locally).
    Demand {
        /// The expert.
        expert: ExpertId,
        /// How many.
        count: u32,
    },
    /// This node's store holds an expert (found at start, or kept by another path).
    Holding {
        /// The expert.
        expert: ExpertId,
        /// Held for good: never evicted, outside the budget.
        pinned: bool,
    },
    /// This node's store lost an expert (deleted by another path).
    Dropped {
        /// The expert.
        expert: ExpertId,
    },
    /// A fetch asked for by [`Action::Fetch`] finished: verified and stored.
    FetchDone {
        /// The expert.
        expert: ExpertId,
    },
    /// A fetch asked for by [`Action::Fetch`] failed (no source answered, bad bytes).
    FetchFailed {
        /// The expert.
        expert: ExpertId,
    },
    /// The budget for kept experts changed.
    Budget {
        /// The new budget in bytes.
        bytes: u64,
    },
}

/// Why a fetch was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The expert has fewer than N copies.
    Coverage,
    /// The expert is asked for more per copy than others.
    Demand,
}

/// An output of [`Placement::poll_action`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action<N> {
    /// Fetch this expert, verified, from one of these holders (best first), and keep it; then
    /// report [`Event::FetchDone`] or [`Event::FetchFailed`].
    Fetch {
        /// The expert.
        expert: ExpertId,
        /// Peers holding it by their announcements, in this node's order of preference.
        sources: Vec<N>,
        /// Why.
        reason: Reason,
    },
    /// Delete this kept expert (the policy already counts it gone).
    Evict {
        /// The expert.
        expert: ExpertId,
    },
    /// This node's announcement changed: send [`Placement::announcement`] to the peers.
    Announce,
}

/// Counters of what the policy decided, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Fetches started.
    pub fetches: u64,
    /// Of which for coverage.
    pub coverage_fetches: u64,
    /// Fetches done.
    pub fetched: u64,
    /// Bytes of fetches done.
    pub fetched_bytes: u64,
    /// Fetches failed.
    pub failed: u64,
    /// Evictions.
    pub evictions: u64,
    /// Of which swaps (evicted to make room for a fetch).
    pub swaps: u64,
    /// Peers that said goodbye.
    pub goodbyes: u64,
    /// Peers that timed out.
    pub timeouts: u64,
}

// ---------------------------------------------------------------------------------------------
// State.

/// What this node knows of one expert across its peers.
#[derive(Clone, Debug, Default)]
struct ExpertView {
    /// Peers holding it (kept or pinned).
    held: u32,
    /// Of those, peers holding it pinned (their model folder's own copy).
    pinned: u32,
    /// Peers fetching it.
    claims: u32,
    /// Those peers (indices into `peers`).
    holders: Vec<u32>,
    /// Sum of the peers' announced demand.
    peer_demand: u64,
    /// Round (plus one) since which it misses copies, 0 if it does not.
    missing_since: u64,
}

#[derive(Debug)]
struct Peer<N> {
    id: N,
    key: u64,
    /// Held experts (kept and pinned), then pinned (a subset), then claims (disjoint from
    /// held), each sorted: one allocation, as a node keeps one of these per peer.
    sets: Box<[u32]>,
    n_holds: u32,
    n_pinned: u32,
    /// Demand counts by index, sorted.
    demand: Box<[(u32, u32)]>,
    /// Its room fits the largest expert.
    free: bool,
}

impl<N> Peer<N> {
    /// Whether it could swap: full, with kept (evictable) copies.
    fn can_swap(&self) -> bool {
        !self.free && self.n_holds > self.n_pinned
    }
}

impl ExpertView {
    /// Holders of it, pinned or not.
    fn counted(&self) -> u32 {
        self.held
    }
}

impl<N> Peer<N> {
    fn holds(&self) -> &[u32] {
        self.sets.get(..self.n_holds as usize).unwrap_or(&[])
    }
    fn pinned(&self) -> &[u32] {
        let a = self.n_holds as usize;
        self.sets
            .get(a..a.saturating_add(self.n_pinned as usize))
            .unwrap_or(&[])
    }
    fn fetching(&self) -> &[u32] {
        let a = (self.n_holds as usize).saturating_add(self.n_pinned as usize);
        self.sets.get(a..).unwrap_or(&[])
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Own {
    None,
    Fetching,
    Held,
    Pinned,
}

/// The placement policy of one node. `N` is the node id type (the repo's `NodeId`); it only
/// needs `Hash` to be the same function of the id on every node (derived `Hash` on bytes or
/// integers is).
#[derive(Debug)]
pub struct Placement<N> {
    me: N,
    me_key: u64,
    config: Config,
    start: Instant,
    catalog: Vec<ExpertInfo>,
    /// Index by `layer * grid_stride + expert` when the ids form a dense enough grid (else
    /// `grid_stride` is 0 and lookups binary-search the catalog).
    grid: Vec<u32>,
    grid_stride: usize,
    max_bytes: u64,
    experts: Vec<ExpertView>,
    /// Experts whose copies (all holders and claims, this node included) are below N.
    missing: usize,
    peers: Vec<Option<Peer<N>>>,
    peer_index: HashMap<N, u32>,
    vacant: Vec<u32>,
    free_peers: usize,
    /// Peers that could swap ([`Peer::can_swap`]): the nodes a missing copy's swap lottery
    /// is shared among.
    swap_peers: usize,
    own: Vec<Own>,
    /// When each kept expert was fetched or found.
    held_since: HashMap<u32, Instant>,
    retry_at: HashMap<u32, Instant>,
    /// Local demand, scaled by 2^(t / half-life) since `demand_t0`.
    local_demand: HashMap<u32, f64>,
    demand_t0: Instant,
    budget: u64,
    used: u64,
    reserved: u64,
    in_flight: usize,
    kept: usize,
    last_swap: Option<Instant>,
    last_full_scan: Option<Instant>,
    next_decide: Instant,
    kick: bool,
    announce_dirty: bool,
    demand_dirty: bool,
    last_demand_announce: Option<Instant>,
    actions: VecDeque<Action<N>>,
    stats: Stats,
    weights: Vec<f64>,
}

impl<N: Copy + Eq + Hash + fmt::Debug> Placement<N> {
    /// A policy for node `me` with `budget` bytes for kept experts, over the manifest's
    /// `experts` (duplicates are merged; zero-sized ones count as one byte), starting at
    /// `now`. `config.replicas` is `--replicas`.
    pub fn new(me: N, budget: u64, experts: &[ExpertInfo], config: Config, now: Instant) -> Self {
        let mut catalog: Vec<ExpertInfo> = experts
            .iter()
            .map(|e| ExpertInfo {
                id: e.id,
                bytes: e.bytes.max(1),
            })
            .collect();
        catalog.sort_by_key(|e| e.id);
        catalog.dedup_by_key(|e| e.id);
        let n = catalog.len();
        let config = config.sanitized();
        let layers = catalog
            .iter()
            .map(|e| usize::from(e.id.layer) + 1)
            .max()
            .unwrap_or(0);
        let stride = catalog
            .iter()
            .map(|e| usize::from(e.id.expert) + 1)
            .max()
            .unwrap_or(0);
        let (grid, grid_stride) = if layers.saturating_mul(stride) <= n.saturating_mul(4) {
            let mut g = vec![u32::MAX; layers * stride];
            for (i, e) in catalog.iter().enumerate() {
                let slot = usize::from(e.id.layer) * stride + usize::from(e.id.expert);
                if let (Some(s), Ok(i)) = (g.get_mut(slot), u32::try_from(i)) {
                    *s = i;
                }
            }
            (g, stride)
        } else {
            (Vec::new(), 0)
        };
        Self {
            me,
            me_key: node_key(&me),
            start: now,
            grid,
            grid_stride,
            max_bytes: catalog.iter().map(|e| e.bytes).max().unwrap_or(1),
            experts: vec![ExpertView::default(); n],
            missing: 0,
            catalog,
            peers: Vec::new(),
            peer_index: HashMap::new(),
            vacant: Vec::new(),
            free_peers: 0,
            swap_peers: 0,
            own: vec![Own::None; n],
            held_since: HashMap::new(),
            retry_at: HashMap::new(),
            local_demand: HashMap::new(),
            demand_t0: now,
            budget,
            used: 0,
            reserved: 0,
            in_flight: 0,
            kept: 0,
            last_swap: None,
            last_full_scan: None,
            next_decide: now,
            kick: true,
            announce_dirty: true,
            demand_dirty: false,
            last_demand_announce: None,
            actions: VecDeque::new(),
            stats: Stats::default(),
            weights: Vec::new(),
            config,
        }
    }

    /// This node's id.
    pub fn id(&self) -> N {
        self.me
    }

    /// The configuration in use (after clamping).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What the policy decided so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Peers in view.
    pub fn peer_count(&self) -> usize {
        self.peer_index.len()
    }

    /// Copies of `expert` in view (holders, this node included), or `None` if it is not in the
    /// manifest.
    pub fn copies(&self, expert: ExpertId) -> Option<u32> {
        let i = self.index(expert)?;
        let v = self.experts.get(i as usize)?;
        Some(
            v.held
                .saturating_sub(self.uncounted_pinned(v))
                .saturating_add(u32::from(self.holds(i) && self.own_copy(i) == 1)),
        )
    }

    /// The pinned copies of `v` that do not count towards N (all of them unless
    /// [`Config::count_pinned`]).
    fn uncounted_pinned(&self, v: &ExpertView) -> u32 {
        if self.config.count_pinned {
            0
        } else {
            v.pinned
        }
    }

    /// Whether this node's own copy (held or being fetched) of expert `i` counts towards N.
    fn own_copy(&self, i: u32) -> u32 {
        match self.own_of(i) {
            Own::None => 0,
            Own::Pinned if !self.config.count_pinned => 0,
            _ => 1,
        }
    }

    /// Experts of the manifest with fewer than N copies in view, counting claims, that some
    /// node holds (an expert nobody holds cannot be replicated).
    pub fn missing(&self) -> usize {
        self.missing
    }

    /// Whether this node holds `expert` (kept or pinned).
    pub fn holds_expert(&self, expert: ExpertId) -> bool {
        self.index(expert).is_some_and(|i| self.holds(i))
    }

    /// Bytes of the budget in use: kept experts and fetches under way.
    pub fn used(&self) -> u64 {
        self.used.saturating_add(self.reserved)
    }

    /// Feed one input. Inputs about unknown experts, unknown peers or this node itself as a
    /// peer are ignored.
    pub fn handle(&mut self, event: Event<'_, N>, now: Instant) {
        match event {
            Event::Announced { peer, announcement } => self.on_announced(peer, announcement),
            Event::PeerLeft { peer, how } => {
                if self.remove_peer(peer) {
                    match how {
                        Departure::Goodbye => self.stats.goodbyes += 1,
                        Departure::TimedOut => self.stats.timeouts += 1,
                    }
                }
            }
            Event::Demand { expert, count } => self.on_demand(expert, count, now),
            Event::Holding { expert, pinned } => {
                if let Some(i) = self.index(expert) {
                    self.set_own(i, if pinned { Own::Pinned } else { Own::Held }, now);
                }
            }
            Event::Dropped { expert } => {
                if let Some(i) = self.index(expert) {
                    if matches!(self.own_of(i), Own::Held | Own::Pinned) {
                        self.set_own(i, Own::None, now);
                    }
                }
            }
            Event::FetchDone { expert } => {
                if let Some(i) = self.index(expert) {
                    match self.own_of(i) {
                        Own::Fetching => {
                            self.stats.fetched += 1;
                            self.stats.fetched_bytes =
                                self.stats.fetched_bytes.saturating_add(self.bytes(i));
                            self.set_own(i, Own::Held, now);
                        }
                        Own::None => self.set_own(i, Own::Held, now),
                        Own::Held | Own::Pinned => {}
                    }
                }
            }
            Event::FetchFailed { expert } => {
                if let Some(i) = self.index(expert) {
                    if self.own_of(i) == Own::Fetching {
                        self.stats.failed += 1;
                        self.set_own(i, Own::None, now);
                        if let Some(t) = now.checked_add(self.config.retry_after) {
                            self.retry_at.insert(i, t);
                        }
                    }
                }
            }
            Event::Budget { bytes } => {
                if bytes != self.budget {
                    self.budget = bytes;
                    self.kick = true;
                    self.announce_dirty = true;
                }
            }
        }
    }

    /// The next decision, if any. Call after every [`Placement::handle`] and at
    /// [`Placement::poll_timeout`], until it returns `None`.
    pub fn poll_action(&mut self, now: Instant) -> Option<Action<N>> {
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        if self.kick || now >= self.next_decide {
            self.decide(now);
            if let Some(a) = self.actions.pop_front() {
                return Some(a);
            }
        }
        let demand_due = self.demand_dirty
            && self.last_demand_announce.is_none_or(|t| {
                now.saturating_duration_since(t) >= self.config.demand_announce_interval
            });
        if self.announce_dirty || demand_due {
            self.announce_dirty = false;
            self.demand_dirty = false;
            self.last_demand_announce = Some(now);
            return Some(Action::Announce);
        }
        None
    }

    /// When [`Placement::poll_action`] may have something new without any input.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t = self.next_decide;
        if self.demand_dirty {
            if let Some(d) = self
                .last_demand_announce
                .and_then(|l| l.checked_add(self.config.demand_announce_interval))
            {
                t = t.min(d);
            }
        }
        Some(t)
    }

    /// What to tell peers now (see [`Action::Announce`]).
    pub fn announcement(&self, now: Instant) -> Announcement {
        let mut a = Announcement {
            budget: self.budget,
            used: self.used(),
            ..Announcement::default()
        };
        for (i, own) in self.own.iter().enumerate() {
            let Some(info) = self.catalog.get(i) else {
                continue;
            };
            match own {
                Own::None => {}
                Own::Fetching => a.fetching.push(info.id),
                Own::Held => a.held.push(info.id),
                Own::Pinned => a.pinned.push(info.id),
            }
        }
        let scale = self.demand_read_scale(now);
        let mut demand: Vec<(ExpertId, u32)> = self
            .local_demand
            .iter()
            .filter_map(|(&i, &v)| {
                let c = (v * scale).round();
                let id = self.catalog.get(i as usize)?.id;
                (c >= 1.0).then_some((id, c.min(f64::from(u32::MAX)) as u32))
            })
            .collect();
        demand.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        demand.truncate(self.config.max_demand_entries);
        a.demand = demand;
        a
    }

    // -----------------------------------------------------------------------------------------
    // Inputs.

    fn index(&self, expert: ExpertId) -> Option<u32> {
        if self.grid_stride > 0 {
            let slot = usize::from(expert.layer) * self.grid_stride + usize::from(expert.expert);
            if usize::from(expert.expert) >= self.grid_stride {
                return None;
            }
            return self.grid.get(slot).copied().filter(|&i| i != u32::MAX);
        }
        self.catalog
            .binary_search_by_key(&expert, |e| e.id)
            .ok()
            .and_then(|i| u32::try_from(i).ok())
    }

    fn bytes(&self, i: u32) -> u64 {
        self.catalog.get(i as usize).map_or(0, |e| e.bytes)
    }

    fn own_of(&self, i: u32) -> Own {
        self.own.get(i as usize).copied().unwrap_or(Own::None)
    }

    fn holds(&self, i: u32) -> bool {
        matches!(self.own_of(i), Own::Held | Own::Pinned)
    }

    fn copies_with_claims(&self, i: u32) -> u32 {
        let Some(v) = self.experts.get(i as usize) else {
            return u32::MAX;
        };
        v.counted()
            .saturating_sub(self.uncounted_pinned(v))
            .saturating_add(v.claims)
            .saturating_add(self.own_copy(i))
    }

    /// Whether expert `i` misses copies (claims counted) and can get them: some node holds it.
    fn is_missing(&self, i: u32) -> bool {
        let sourced = self.holds(i) || self.experts.get(i as usize).is_some_and(|v| v.held > 0);
        sourced && self.copies_with_claims(i) < self.config.replicas
    }

    /// Apply `f` to expert `i`'s view, keeping the count of experts missing copies right.
    fn adjust(&mut self, i: u32, f: impl FnOnce(&mut ExpertView)) {
        let before = self.is_missing(i);
        if let Some(v) = self.experts.get_mut(i as usize) {
            f(v);
        }
        let after = self.is_missing(i);
        match (before, after) {
            (true, false) => self.missing = self.missing.saturating_sub(1),
            (false, true) => self.missing += 1,
            _ => {}
        }
    }

    fn set_own(&mut self, i: u32, to: Own, now: Instant) {
        let from = self.own_of(i);
        if from == to {
            return;
        }
        let bytes = self.bytes(i);
        let before = self.is_missing(i);
        match from {
            Own::None | Own::Pinned => {}
            Own::Fetching => {
                self.reserved = self.reserved.saturating_sub(bytes);
                self.in_flight = self.in_flight.saturating_sub(1);
            }
            Own::Held => {
                self.used = self.used.saturating_sub(bytes);
                self.kept = self.kept.saturating_sub(1);
                self.held_since.remove(&i);
            }
        }
        match to {
            Own::None | Own::Pinned => {}
            Own::Fetching => {
                self.reserved = self.reserved.saturating_add(bytes);
                self.in_flight += 1;
            }
            Own::Held => {
                self.used = self.used.saturating_add(bytes);
                self.kept += 1;
                self.held_since.insert(i, now);
            }
        }
        if let Some(o) = self.own.get_mut(i as usize) {
            *o = to;
        }
        let after = self.is_missing(i);
        match (before, after) {
            (true, false) => self.missing = self.missing.saturating_sub(1),
            (false, true) => self.missing += 1,
            _ => {}
        }
        self.kick = true;
        self.announce_dirty = true;
    }

    /// Sorted, deduplicated indices of the known experts in `ids`.
    fn indices(&self, ids: &[ExpertId]) -> Vec<u32> {
        let mut v: Vec<u32> = ids.iter().filter_map(|&e| self.index(e)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn on_announced(&mut self, peer: N, a: &Announcement) {
        if peer == self.me {
            return;
        }
        let mut pinned = self.indices(&a.pinned);
        pinned.sort_unstable();
        pinned.dedup();
        let mut holds = self.indices(&a.held);
        holds.extend_from_slice(&pinned);
        holds.sort_unstable();
        holds.dedup();
        let mut fetching = self.indices(&a.fetching);
        fetching.retain(|i| holds.binary_search(i).is_err());
        let mut demand: Vec<(u32, u32)> = a
            .demand
            .iter()
            .filter_map(|&(e, c)| Some((self.index(e)?, c)))
            .collect();
        demand.sort_unstable();
        demand.dedup_by_key(|d| d.0);
        let free = a.budget.saturating_sub(a.used) >= self.max_bytes;

        let idx = match self.peer_index.get(&peer) {
            Some(&i) => i,
            None => {
                let Ok(next) = u32::try_from(self.peers.len()) else {
                    return;
                };
                let slot = self.vacant.pop().unwrap_or(next);
                let p = Peer {
                    id: peer,
                    key: node_key(&peer),
                    sets: Box::new([]),
                    n_holds: 0,
                    n_pinned: 0,
                    demand: Box::new([]),
                    free: false,
                };
                if slot == next {
                    self.peers.push(Some(p));
                } else if let Some(s) = self.peers.get_mut(slot as usize) {
                    *s = Some(p);
                }
                self.peer_index.insert(peer, slot);
                slot
            }
        };
        let Some(mut p) = self.peers.get_mut(idx as usize).and_then(Option::take) else {
            return;
        };
        // Claims first (a claim that became a holding must not count twice on the way).
        diff(p.fetching(), &fetching, |i, added| {
            self.adjust(i, |v| {
                if added {
                    v.claims = v.claims.saturating_add(1);
                } else {
                    v.claims = v.claims.saturating_sub(1);
                }
            });
        });
        diff(p.pinned(), &pinned, |i, added| {
            self.adjust(i, |v| {
                if added {
                    v.pinned = v.pinned.saturating_add(1);
                } else {
                    v.pinned = v.pinned.saturating_sub(1);
                }
            });
        });
        diff(p.holds(), &holds, |i, added| {
            self.adjust(i, |v| {
                if added {
                    v.held = v.held.saturating_add(1);
                    v.holders.push(idx);
                } else {
                    v.held = v.held.saturating_sub(1);
                    if let Some(pos) = v.holders.iter().position(|&h| h == idx) {
                        v.holders.swap_remove(pos);
                    }
                }
            });
        });
        for &(i, c) in &p.demand {
            if let Some(v) = self.experts.get_mut(i as usize) {
                v.peer_demand = v.peer_demand.saturating_sub(u64::from(c));
            }
        }
        for &(i, c) in &demand {
            if let Some(v) = self.experts.get_mut(i as usize) {
                v.peer_demand = v.peer_demand.saturating_add(u64::from(c));
            }
        }
        if p.free != free {
            if free {
                self.free_peers += 1;
            } else {
                self.free_peers = self.free_peers.saturating_sub(1);
            }
        }
        let could_swap = p.can_swap();
        p.n_holds = u32::try_from(holds.len()).unwrap_or(u32::MAX);
        p.n_pinned = u32::try_from(pinned.len()).unwrap_or(u32::MAX);
        let mut sets = holds;
        sets.extend_from_slice(&pinned);
        sets.extend_from_slice(&fetching);
        p.sets = sets.into_boxed_slice();
        p.demand = demand.into_boxed_slice();
        p.free = free;
        match (could_swap, p.can_swap()) {
            (false, true) => self.swap_peers += 1,
            (true, false) => self.swap_peers = self.swap_peers.saturating_sub(1),
            _ => {}
        }
        if let Some(s) = self.peers.get_mut(idx as usize) {
            *s = Some(p);
        }
    }

    fn remove_peer(&mut self, peer: N) -> bool {
        let Some(idx) = self.peer_index.remove(&peer) else {
            return false;
        };
        let Some(p) = self.peers.get_mut(idx as usize).and_then(Option::take) else {
            return false;
        };
        for &i in p.fetching() {
            self.adjust(i, |v| v.claims = v.claims.saturating_sub(1));
        }
        for &i in p.pinned() {
            self.adjust(i, |v| v.pinned = v.pinned.saturating_sub(1));
        }
        for &i in p.holds() {
            self.adjust(i, |v| {
                v.held = v.held.saturating_sub(1);
                if let Some(pos) = v.holders.iter().position(|&h| h == idx) {
                    v.holders.swap_remove(pos);
                }
            });
        }
        for &(i, c) in &p.demand {
            if let Some(v) = self.experts.get_mut(i as usize) {
                v.peer_demand = v.peer_demand.saturating_sub(u64::from(c));
            }
        }
        if p.free {
            self.free_peers = self.free_peers.saturating_sub(1);
        }
        if p.can_swap() {
            self.swap_peers = self.swap_peers.saturating_sub(1);
        }
        self.vacant.push(idx);
        true
    }

    fn demand_exponent(&self, now: Instant) -> f64 {
        let hl = self.config.demand_half_life.as_secs_f64();
        if hl <= 0.0 {
            return 0.0;
        }
        now.saturating_duration_since(self.demand_t0).as_secs_f64() / hl
    }

    /// Multiply stored local demand by this to read it at `now`.
    fn demand_read_scale(&self, now: Instant) -> f64 {
        (-self.demand_exponent(now)).exp2()
    }

    fn on_demand(&mut self, expert: ExpertId, count: u32, now: Instant) {
        let Some(i) = self.index(expert) else {
            return;
        };
        let mut exp = self.demand_exponent(now);
        if exp > 256.0 {
            // Renormalise before the scale overflows: read everything at `now`.
            let s = (-exp).exp2();
            for v in self.local_demand.values_mut() {
                *v *= s;
            }
            self.local_demand.retain(|_, v| *v >= 1e-3);
            self.demand_t0 = now;
            exp = 0.0;
        }
        *self.local_demand.entry(i).or_insert(0.0) += f64::from(count) * exp.exp2();
        self.demand_dirty = true;
    }

    // -----------------------------------------------------------------------------------------
    // Decisions.

    fn round_of(&self, now: Instant) -> u64 {
        let r = self.config.round.as_nanos().max(1);
        let e = now.saturating_duration_since(self.start).as_nanos() / r;
        u64::try_from(e).unwrap_or(u64::MAX)
    }

    fn round_start(&self, round: u64, now: Instant) -> Instant {
        let r = self.config.round.as_nanos().max(1);
        let nanos = u64::try_from(r.saturating_mul(u128::from(round))).unwrap_or(u64::MAX);
        self.start
            .checked_add(Duration::from_nanos(nanos))
            .unwrap_or_else(|| now.checked_add(self.config.round).unwrap_or(now))
    }

    fn draw(&self, i: u32, round: u64, salt: u64) -> f64 {
        let e = self.catalog.get(i as usize).map_or(0, |e| bits(e.id));
        unit(hash3(self.me_key ^ salt, e, round))
    }

    fn decide(&mut self, now: Instant) {
        let round = self.round_of(now);
        self.next_decide = self.round_start(round.saturating_add(1), now);
        self.kick = false;
        let over_budget = self.used.saturating_add(self.reserved) > self.budget;
        let slots = self.in_flight < self.config.max_in_flight;
        if !over_budget && !slots {
            return;
        }
        let free_bytes = self
            .budget
            .saturating_sub(self.used.saturating_add(self.reserved));
        let self_free = free_bytes >= self.max_bytes;
        if !over_budget && !self_free {
            // Full: only swaps are possible. Look for them each round while copies are
            // missing, else once per swap interval (demand swaps).
            if self.kept == 0 {
                return;
            }
            if self.missing == 0 {
                let due = self
                    .last_full_scan
                    .is_none_or(|t| now.saturating_duration_since(t) >= self.config.swap_interval);
                if !due || self.free_peers > 0 {
                    return;
                }
                self.last_full_scan = Some(now);
            }
        }
        self.retry_at.retain(|_, t| *t > now);
        self.compute_weights(now);

        // Budget first: a shrunk budget is a hard limit.
        while self.used.saturating_add(self.reserved) > self.budget {
            let v = self
                .victim(now, Safety::Demand)
                .or_else(|| self.victim(now, Safety::Budget));
            let Some(v) = v else { break };
            self.evict(v.idx, now);
        }
        if self.in_flight >= self.config.max_in_flight {
            return;
        }

        let n = self.config.replicas;
        let alpha = self.config.lottery_width;
        let beta = self.config.swap_claimants_per_copy;
        let mut free_bytes = self
            .budget
            .saturating_sub(self.used.saturating_add(self.reserved));
        let self_free = free_bytes >= self.max_bytes;
        let nodes_with_room = (self.free_peers + usize::from(self_free)).max(1) as f64;
        let swap_ok = self
            .last_swap
            .is_none_or(|t| now.saturating_duration_since(t) >= self.config.swap_interval);
        // A copy beyond N may go for a missing copy whatever its age (the swarm loses
        // nothing); for more demand only once held `min_hold` (no thrashing).
        let mut victim = if swap_ok {
            self.victim(now, Safety::Coverage)
        } else {
            None
        };
        let mut demand_victim = if swap_ok {
            self.victim(now, Safety::Demand)
        } else {
            None
        };
        // The full nodes that could act on a missing copy: at most one per copy beyond N
        // (each such copy has one designated evictor) and at most the nodes with kept copies.
        // Dividing by the copies alone made a small swarm of big nodes (4 nodes with 16 spare
        // copies each) draw one swap per minute.
        let surplus: u64 = self
            .experts
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let own = u32::from(self.own_of(i as u32) == Own::Held);
                u64::from(
                    v.held
                        .saturating_sub(self.uncounted_pinned(v))
                        .saturating_add(own)
                        .saturating_sub(n),
                )
            })
            .sum();
        let swappers = self.swap_peers as u64 + u64::from(victim.is_some());
        let surplus = surplus.min(swappers).max(1) as f64;

        // (copies with claims, weight, draw, index, direct)
        let mut cover: Vec<(u32, f64, f64, u32, bool)> = Vec::new();
        let mut extra: Vec<(f64, f64, u32)> = Vec::new();
        let mut best_value = 0.0f64;
        // Experts below N held copies (claims not counted): while there are any, spare room
        // waits for them rather than adding demand copies, which would compete with the
        // first copies for the few holders' upload.
        let mut below_n_held = 0usize;
        for i in 0..self.experts.len() {
            let Ok(iu) = u32::try_from(i) else { break };
            let c = self.copies_with_claims(iu);
            let own = self.own_of(iu);
            // Held copies that count towards N (a seeder's pinned copy does not, by default).
            let counted_held = self.experts.get(i).map_or(0, |v| {
                v.held
                    .saturating_sub(self.uncounted_pinned(v))
                    .saturating_add(self.own_copy(iu) * u32::from(own != Own::Fetching))
            });
            let Some(v) = self.experts.get_mut(i) else {
                break;
            };
            if c < n {
                if v.missing_since == 0 {
                    v.missing_since = round.saturating_add(1);
                }
            } else {
                v.missing_since = 0;
            }
            let (missing_since, held) = (v.missing_since, v.held);
            // Only the experts this node could add a copy of hold its spare room back: one it
            // holds already (a node with room left holding the rarest expert) must not keep
            // it from taking a third copy of another, which lets a full node swap.
            if counted_held < n && own == Own::None {
                below_n_held += 1;
            }
            if own != Own::None || held == 0 || self.retry_at.contains_key(&iu) {
                continue;
            }
            let bytes = self.catalog.get(i).map_or(u64::MAX, |e| e.bytes);
            let w = self.weights.get(i).copied().unwrap_or(1.0);
            let direct = free_bytes >= bytes;
            if c < n {
                let d = f64::from(n - c);
                let p = if direct {
                    alpha * d / nodes_with_room
                } else {
                    let since = self.round_start(missing_since.saturating_sub(1), now);
                    let waited = now.saturating_duration_since(since) >= self.config.swap_after;
                    let fits =
                        victim.is_some_and(|vi| free_bytes.saturating_add(vi.bytes) >= bytes);
                    if fits && (self.free_peers == 0 || waited) {
                        beta * d / surplus
                    } else {
                        0.0
                    }
                };
                let h = self.draw(iu, round, SALT_COVER);
                if h < p {
                    cover.push((c, w, h, iu, direct));
                }
            } else if direct || demand_victim.is_some() {
                let value = w / f64::from(c.saturating_add(1));
                best_value = best_value.max(value);
                extra.push((value, self.draw(iu, round, SALT_DEMAND), iu));
            }
        }

        cover.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(b.1.total_cmp(&a.1))
                .then(a.2.total_cmp(&b.2))
        });
        for &(c, _, _, i, _) in &cover {
            if self.in_flight >= self.config.max_in_flight {
                return;
            }
            let bytes = self.bytes(i);
            if free_bytes >= bytes {
                if !self.among_best(i, round, SALT_COVER, n.saturating_sub(c)) {
                    continue;
                }
                free_bytes -= bytes;
                self.start_fetch(i, Reason::Coverage, now);
            } else if let Some(vi) = victim {
                if free_bytes.saturating_add(vi.bytes) >= bytes {
                    self.evict(vi.idx, now);
                    self.stats.swaps += 1;
                    self.last_swap = Some(now);
                    victim = None;
                    demand_victim = None;
                    free_bytes = free_bytes.saturating_add(vi.bytes) - bytes;
                    self.start_fetch(i, Reason::Coverage, now);
                }
            }
        }

        if self.in_flight >= self.config.max_in_flight || extra.is_empty() || below_n_held > 0 {
            return;
        }
        let floor = best_value / self.config.level_tolerance;
        let p_direct = alpha / nodes_with_room;
        let p_swap = beta / surplus;
        let mut picks: Vec<(f64, f64, u32)> = extra
            .into_iter()
            .filter(|&(value, h, i)| {
                if value < floor {
                    return false;
                }
                if free_bytes >= self.bytes(i) {
                    h < p_direct
                } else {
                    self.free_peers == 0 && h < p_swap
                }
            })
            .collect();
        picks.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1)));
        for (value, _, i) in picks {
            if self.in_flight >= self.config.max_in_flight {
                break;
            }
            let bytes = self.bytes(i);
            if free_bytes >= bytes {
                if !self.among_best(i, round, SALT_DEMAND, 1) {
                    continue;
                }
                free_bytes -= bytes;
                self.start_fetch(i, Reason::Demand, now);
            } else if let Some(vi) = demand_victim {
                if value > self.config.swap_gain * vi.keep
                    && free_bytes.saturating_add(vi.bytes) >= bytes
                {
                    self.evict(vi.idx, now);
                    self.stats.swaps += 1;
                    self.last_swap = Some(now);
                    demand_victim = None;
                    free_bytes = free_bytes.saturating_add(vi.bytes) - bytes;
                    self.start_fetch(i, Reason::Demand, now);
                }
            }
        }
    }

    /// Demand weight per expert: 1 + its demand over the mean, so that with no demand all
    /// experts weigh the same and copies level out.
    fn compute_weights(&mut self, now: Instant) {
        let scale = self.demand_read_scale(now);
        let n = self.experts.len();
        self.weights.clear();
        self.weights.resize(n, 0.0);
        let mut total = 0.0;
        for (i, v) in self.experts.iter().enumerate() {
            let local = u32::try_from(i)
                .ok()
                .and_then(|iu| self.local_demand.get(&iu))
                .map_or(0.0, |&d| d * scale);
            let d = v.peer_demand as f64 + local;
            total += d;
            if let Some(w) = self.weights.get_mut(i) {
                *w = d;
            }
        }
        let mean = if n == 0 { 0.0 } else { total / n as f64 };
        for w in &mut self.weights {
            *w = if mean > 0.0 { 1.0 + *w / mean } else { 1.0 };
        }
    }

    /// Whether this node's draw for expert `i` is among the `d` lowest of the nodes with room
    /// that neither hold nor fetch it, as far as this node sees. Every node with the same view
    /// reaches the same verdict, so exactly `d` act (rendezvous hashing over the nodes with
    /// room, computed only for the experts the first lottery let through).
    fn among_best(&self, i: u32, round: u64, salt: u64, d: u32) -> bool {
        let e = self.catalog.get(i as usize).map_or(0, |e| bits(e.id));
        let mine = (hash3(self.me_key ^ salt, e, round), self.me_key);
        let mut below = 0u32;
        for p in self.peers.iter().flatten() {
            if !p.free
                || p.holds().binary_search(&i).is_ok()
                || p.fetching().binary_search(&i).is_ok()
            {
                continue;
            }
            if (hash3(p.key ^ salt, e, round), p.key) < mine {
                below += 1;
                if below >= d {
                    return false;
                }
            }
        }
        below < d
    }

    fn start_fetch(&mut self, i: u32, reason: Reason, now: Instant) {
        let Some(id) = self.catalog.get(i as usize).map(|e| e.id) else {
            return;
        };
        let Some(v) = self.experts.get(i as usize) else {
            return;
        };
        // Every requester orders the holders differently (rendezvous on requester, holder and
        // expert), so a thousand fetches of one expert spread over its holders.
        let salt = hash3(self.me_key, bits(id), SALT_SOURCE);
        let mut ranked: Vec<(u64, N)> = v
            .holders
            .iter()
            .filter_map(|&h| match self.peers.get(h as usize) {
                Some(Some(p)) => Some((mix(p.key ^ salt), p.id)),
                _ => None,
            })
            .collect();
        ranked.sort_unstable_by_key(|r| r.0);
        ranked.truncate(self.config.max_sources);
        let sources = ranked.into_iter().map(|r| r.1).collect();
        self.set_own(i, Own::Fetching, now);
        self.stats.fetches += 1;
        if reason == Reason::Coverage {
            self.stats.coverage_fetches += 1;
        }
        self.actions.push_back(Action::Fetch {
            expert: id,
            sources,
            reason,
        });
    }
}

/// Walk two sorted sets, calling `f(i, false)` for what left and `f(i, true)` for what came.
fn diff(old: &[u32], new: &[u32], mut f: impl FnMut(u32, bool)) {
    let (mut a, mut b) = (0, 0);
    loop {
        match (old.get(a), new.get(b)) {
            (Some(&x), Some(&y)) if x == y => {
                a += 1;
                b += 1;
            }
            (Some(&x), Some(&y)) if x < y => {
                f(x, false);
                a += 1;
            }
            (Some(_), Some(&y)) => {
                f(y, true);
                b += 1;
            }
            (Some(&x), None) => {
                f(x, false);
                a += 1;
            }
            (None, Some(&y)) => {
                f(y, true);
                b += 1;
            }
            (None, None) => break,
        }
    }
}

mod draw;
mod evict;

#[cfg(test)]
mod sim;

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(n: u16) -> Vec<ExpertInfo> {
        (0..n)
            .map(|e| ExpertInfo {
                id: ExpertId::new(0, e),
                bytes: 100,
            })
            .collect()
    }

    fn drain<N: Copy + Eq + Hash + fmt::Debug>(
        p: &mut Placement<N>,
        now: Instant,
    ) -> Vec<Action<N>> {
        std::iter::from_fn(|| p.poll_action(now)).collect()
    }

    fn seeder(experts: &[ExpertInfo]) -> Announcement {
        Announcement {
            pinned: experts.iter().map(|e| e.id).collect(),
            ..Announcement::default()
        }
    }

    #[test]
    fn a_lone_node_fetches_rarest_first_within_its_budget() {
        let t0 = Instant::now();
        let cat = catalog(4);
        let mut p = Placement::new(1u64, 200, &cat, Config::default(), t0);
        p.handle(
            Event::Announced {
                peer: 0,
                announcement: &seeder(&cat),
            },
            t0,
        );
        // Expert 0:3 already has a second copy: the node takes two of the others.
        let other = Announcement {
            held: vec![ExpertId::new(0, 3)],
            ..Announcement::default()
        };
        p.handle(
            Event::Announced {
                peer: 2,
                announcement: &other,
            },
            t0,
        );
        let acts = drain(&mut p, t0);
        let fetched: Vec<ExpertId> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Fetch {
                    expert,
                    reason: Reason::Coverage,
                    sources,
                } => {
                    assert_eq!(sources, &vec![0]);
                    Some(*expert)
                }
                _ => None,
            })
            .collect();
        assert_eq!(fetched.len(), 2, "{acts:?}");
        assert!(!fetched.contains(&ExpertId::new(0, 3)));
        assert!(acts.contains(&Action::Announce));
        assert_eq!(p.used(), 200);
        // Full: nothing more, even in later rounds.
        assert!(drain(&mut p, t0 + Duration::from_secs(5)).is_empty());
        let a = p.announcement(t0);
        assert_eq!(a.fetching.len(), 2);
        assert_eq!(a.used, 200);
    }

    #[test]
    fn never_evicts_below_n_nor_what_it_just_fetched() {
        let t0 = Instant::now();
        let cat = catalog(2);
        let mut p = Placement::new(1u64, 100, &cat, Config::default(), t0);
        p.handle(
            Event::Announced {
                peer: 0,
                announcement: &seeder(&cat),
            },
            t0,
        );
        drain(&mut p, t0);
        let got: Vec<ExpertId> = cat
            .iter()
            .map(|e| e.id)
            .filter(|&e| p.announcement(t0).fetching.contains(&e))
            .collect();
        assert_eq!(got.len(), 1);
        p.handle(Event::FetchDone { expert: got[0] }, t0);
        assert!(p.holds_expert(got[0]));
        // The other expert misses a copy; the node is full and its only expert is at N: no
        // swap, ever.
        for s in 1..100 {
            let acts = drain(&mut p, t0 + Duration::from_secs(s * 10));
            assert!(
                acts.iter().all(|a| matches!(a, Action::Announce)),
                "{acts:?}"
            );
        }
    }

    #[test]
    fn a_departure_is_re_replicated_and_a_shrunk_budget_is_met() {
        let t0 = Instant::now();
        let cat = catalog(1);
        let id = cat[0].id;
        let mut p = Placement::new(1u64, 0, &cat, Config::default(), t0);
        let held = Announcement {
            held: vec![id],
            budget: 100,
            used: 100,
            ..Announcement::default()
        };
        p.handle(
            Event::Announced {
                peer: 2,
                announcement: &held,
            },
            t0,
        );
        p.handle(
            Event::Announced {
                peer: 3,
                announcement: &held,
            },
            t0,
        );
        assert!(drain(&mut p, t0)
            .iter()
            .all(|a| matches!(a, Action::Announce)));
        assert_eq!(p.copies(id), Some(2));
        p.handle(
            Event::PeerLeft {
                peer: 2,
                how: Departure::Goodbye,
            },
            t0,
        );
        assert_eq!(p.missing(), 1);
        p.handle(Event::Budget { bytes: 100 }, t0);
        let t1 = t0 + Duration::from_secs(2);
        let acts = drain(&mut p, t1);
        assert!(
            acts.contains(&Action::Fetch {
                expert: id,
                sources: vec![3],
                reason: Reason::Coverage
            }),
            "{acts:?}"
        );
        p.handle(Event::FetchDone { expert: id }, t1);
        assert_eq!(p.stats().fetched_bytes, 100);
        p.handle(Event::Budget { bytes: 0 }, t1);
        assert!(drain(&mut p, t1).contains(&Action::Evict { expert: id }));
        assert_eq!(p.used(), 0);
    }

    /// A node restarted with a smaller budget than it holds (its expert directory leaves the
    /// excess to placement, `ExpertDir::open_placed`) gives up, once it sees the swarm, the
    /// copies the swarm has most of, whatever their age: of an expert three other nodes hold
    /// and one it alone holds, the first goes; the only copy stays.
    #[test]
    fn over_its_budget_at_start_a_node_evicts_the_most_copied_never_its_only_copy() {
        let t0 = Instant::now();
        let cat = catalog(4);
        let (common, only) = (cat[0].id, cat[1].id);
        for order in [[common, only], [only, common]] {
            // Room for one of its two.
            let mut p = Placement::new(1u64, 100, &cat, Config::default(), t0);
            for id in order {
                p.handle(
                    Event::Holding {
                        expert: id,
                        pinned: false,
                    },
                    t0,
                );
            }
            let holder = Announcement {
                held: vec![common, cat[2].id, cat[3].id],
                budget: 300,
                used: 300,
                ..Announcement::default()
            };
            for peer in 2..5 {
                p.handle(
                    Event::Announced {
                        peer,
                        announcement: &holder,
                    },
                    t0,
                );
            }
            let acts = drain(&mut p, t0);
            assert!(acts.contains(&Action::Evict { expert: common }), "{acts:?}");
            assert!(!acts.contains(&Action::Evict { expert: only }), "{acts:?}");
            assert!(p.holds_expert(only));
            assert_eq!(p.used(), 100);
        }
    }

    #[test]
    fn of_a_thousand_nodes_with_one_view_only_the_missing_copies_act() {
        // Herding: 1,000 empty nodes see the same swarm (a seeder holding the one expert);
        // per round only as many of them fetch it as copies are missing: two when the
        // seeder's pinned copy does not count (the default), one when it does.
        let t0 = Instant::now();
        let cat = catalog(1);
        let free = Announcement {
            budget: 100,
            ..Announcement::default()
        };
        for (count_pinned, missing) in [(false, 2), (true, 1)] {
            let config = Config {
                count_pinned,
                ..Config::default()
            };
            let mut fetchers = 0;
            for me in 0..1000u64 {
                let mut p = Placement::new(me, 100, &cat, config.clone(), t0);
                p.handle(
                    Event::Announced {
                        peer: 5000,
                        announcement: &seeder(&cat),
                    },
                    t0,
                );
                for peer in 0..1000u64 {
                    p.handle(
                        Event::Announced {
                            peer,
                            announcement: &free,
                        },
                        t0,
                    );
                }
                let t = t0 + Duration::from_secs(2);
                if drain(&mut p, t)
                    .iter()
                    .any(|a| matches!(a, Action::Fetch { .. }))
                {
                    fetchers += 1;
                }
            }
            assert!(
                fetchers <= missing,
                "{fetchers} nodes fetched {missing} missing copies (count_pinned {count_pinned})"
            );
        }
    }

    /// Regression (the recipe, budgets 1.2x): four nodes with room for 4.8 experts of
    /// 8 each; three are full with 4, the fourth holds 3 and among them the one expert with a
    /// single copy; every other expert has exactly 2. Nobody can fetch that expert's second
    /// copy directly and no full node has a spare copy to swap out, so the node with room
    /// takes a third copy of another expert: a full holder of that one can then swap it for
    /// the rare expert.
    #[test]
    fn a_node_with_room_holding_the_rare_expert_makes_a_spare_for_a_swap() {
        let t0 = Instant::now();
        let cat = catalog(8);
        let id = |e: u16| ExpertId::new(0, e);
        let budget = 480;
        let mut p = Placement::new(1u64, budget, &cat, Config::default(), t0);
        for e in [0, 1, 2] {
            p.handle(
                Event::Holding {
                    expert: id(e),
                    pinned: false,
                },
                t0,
            );
        }
        let full = |held: &[u16]| Announcement {
            held: held.iter().map(|&e| id(e)).collect(),
            budget,
            used: 400,
            ..Announcement::default()
        };
        for (peer, held) in [(2u64, [1, 3, 4, 5]), (3, [2, 3, 6, 7]), (4, [4, 5, 6, 7])] {
            p.handle(
                Event::Announced {
                    peer,
                    announcement: &full(&held),
                },
                t0,
            );
        }
        assert_eq!(p.copies(id(0)), Some(1));
        let fetched: Vec<ExpertId> = (0..10)
            .flat_map(|r| drain(&mut p, t0 + Duration::from_secs(2 * r)))
            .filter_map(|a| match a {
                Action::Fetch { expert, .. } => Some(expert),
                _ => None,
            })
            .collect();
        assert_eq!(fetched.len(), 1, "one spare copy: {fetched:?}");
        assert!(
            (3..8).contains(&fetched[0].expert),
            "a copy of one it does not hold: {fetched:?}"
        );
    }

    #[test]
    fn hostile_inputs_do_not_panic() {
        let t0 = Instant::now();
        let cat = catalog(3);
        let mut p = Placement::new(
            [7u8; 32],
            u64::MAX,
            &cat,
            Config {
                replicas: 0,
                round: Duration::ZERO,
                lottery_width: f64::NAN,
                ..Config::default()
            },
            t0,
        );
        let junk = Announcement {
            budget: u64::MAX,
            used: u64::MAX,
            held: vec![
                ExpertId::new(9, 9),
                ExpertId::new(0, 1),
                ExpertId::new(0, 1),
            ],
            pinned: vec![ExpertId::new(0, 1)],
            fetching: vec![
                ExpertId::new(0, 1),
                ExpertId::new(0, 2),
                ExpertId::new(u16::MAX, u16::MAX),
            ],
            demand: vec![
                (ExpertId::new(0, 2), u32::MAX),
                (ExpertId::new(0, 2), u32::MAX),
            ],
        };
        for _ in 0..3 {
            p.handle(
                Event::Announced {
                    peer: [1u8; 32],
                    announcement: &junk,
                },
                t0,
            );
        }
        p.handle(
            Event::Announced {
                peer: [7u8; 32],
                announcement: &junk,
            },
            t0,
        );
        p.handle(
            Event::PeerLeft {
                peer: [9u8; 32],
                how: Departure::TimedOut,
            },
            t0,
        );
        p.handle(
            Event::FetchDone {
                expert: ExpertId::new(5, 5),
            },
            t0,
        );
        p.handle(
            Event::FetchFailed {
                expert: ExpertId::new(0, 0),
            },
            t0,
        );
        p.handle(
            Event::Dropped {
                expert: ExpertId::new(0, 0),
            },
            t0,
        );
        p.handle(
            Event::Demand {
                expert: ExpertId::new(0, 0),
                count: u32::MAX,
            },
            t0 + Duration::from_secs(1 << 40),
        );
        let _ = drain(&mut p, t0 - Duration::from_secs(1).min(t0.elapsed()));
        let _ = drain(&mut p, t0 + Duration::from_secs(1 << 40));
        p.handle(
            Event::PeerLeft {
                peer: [1u8; 32],
                how: Departure::Goodbye,
            },
            t0,
        );
        assert_eq!(p.peer_count(), 0);
        let _ = p.announcement(t0 + Duration::from_secs(1 << 41));
        let empty: Placement<u8> = Placement::new(0, 0, &[], Config::default(), t0);
        assert_eq!(empty.missing(), 0);
    }
}
