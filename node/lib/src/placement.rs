//! The placement driver: runs a serving node's [`stormo_net::placement::Placement`] policy
//! against the real swarm, so serving nodes replicate experts by themselves (`--replicas N`)
//! and the swarm keeps the whole model once its seeders leave.
//!
//! Owns: one task on the node's runtime that, every [`TICK`], feeds the policy what changed
//! (the peers' placement announcements and their departures, as the peer tier follows them;
//! the node's kept experts; the requests its server answered) and carries out its actions:
//! a fetch goes through the peer tier, which verifies every chunk against the manifest and
//! keeps the record in the expert directory; an eviction deletes the record; an announcement
//! is published on the node's control streams ([`stormo_wire::Placement`]). On a clean stop
//! the node says it is leaving, so the others re-replicate what fell below N at once.
//!
//! A peer that sends no placement (a node that serves its model folder and places nothing,
//! such as a seeder started without peers) is a source: its inventory counts as pinned
//! copies, which the policy uses to fetch from but does not count towards N
//! ([`stormo_net::placement::Config::count_pinned`]).
//!
//! Non-goals: choosing among holders (the peer tier's choice and hedging do it; the policy's
//! source order is not used), and peers this node does not dial (a serving node sees the
//! placement of the peers it dials: its `--peer`s and those discovery finds).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stormo_engine::tiers::{ExpertId, Priority, Tier};
use stormo_manifests::{Hash, Manifest};
use stormo_net::expert_dir::ExpertDir;
use stormo_net::placement::{
    Action, Announcement, Config, Departure, Event, ExpertInfo, Placement,
};
use stormo_net::serve::Holdings;
use stormo_net::tier::PeerTier;
use stormo_wire::ExpertSet;

/// How often the driver looks at the swarm and the policy.
pub const TICK: Duration = Duration::from_millis(250);

/// How long a peer that is not connected keeps its place in the view before it counts as
/// gone (a connection being redialled after a short loss is not a departure).
const GONE_AFTER: Duration = Duration::from_secs(3);

/// How long a starting node may wait for its view of the swarm before it places anything:
/// until every peer it dials has answered with what it holds, or this long.
const SETTLE_MAX: Duration = Duration::from_secs(10);

/// How long the budgets in view must stay too small for `--replicas` copies before a node
/// says so (a swarm still joining is short for its first moments).
const ROOM_GRACE: Duration = Duration::from_secs(10);

/// The least a starting node waits before it places anything: long enough for its peers'
/// first lists of their own peers (peer exchange, sent with their inventories and then every
/// half second) to arrive, so that a node given only the seeder sees the other nodes before
/// it fills its budget.
const SETTLE_MIN: Duration = Duration::from_millis(1500);

/// How long a fetched expert may take to be written to the expert directory before the fetch
/// counts as failed (the peer tier stores a verified record after handing it on, off the async
/// threads; a record the directory refuses never appears).
const STORE_WAIT: Duration = Duration::from_secs(5);

/// A fetch of placement's own still under way this long is said (info), once: it holds one of
/// the node's few fetch slots and, in a swap, the room of the copy it evicted. The peer tier
/// bounds it (its tries, deadlines and rounds); this only makes a long one visible.
const FETCH_SLOW: Duration = Duration::from_secs(30);

/// What the driver remembers of one peer.
#[derive(Debug)]
struct Seen {
    /// The announcement last fed to the policy.
    last: Option<Announcement>,
    /// Since when it has not been connected.
    down_since: Option<Instant>,
    /// It left (goodbye or gone) and the policy was told.
    left: bool,
}

/// A serving node's replica placement. See the module docs.
pub struct Replicator {
    policy: Mutex<Placement<[u8; 32]>>,
    dir: Arc<ExpertDir>,
    peers: Arc<PeerTier>,
    holdings: Arc<Holdings>,
    model: Hash,
    shape: (u16, u16),
    /// The model folder's own experts on this node.
    pinned: ExpertSet,
    seen: Mutex<HashMap<[u8; 32], Seen>>,
    /// Kept experts the policy knows of.
    kept: Mutex<HashSet<ExpertId>>,
    /// Fetches under way, with their start and whether their slowness was said
    /// ([`FETCH_SLOW`]).
    fetching: Mutex<HashMap<ExpertId, (Instant, bool)>>,
    leaving: AtomicBool,
    /// Results of finished fetches, fed to the policy at the next tick.
    done: Mutex<Vec<(ExpertId, bool)>>,
    /// Fetched experts not yet written to the directory, with when they were fetched.
    storing: Mutex<HashMap<ExpertId, Instant>>,
    /// When the driver started, and whether its view of the swarm has settled (see
    /// [`SETTLE_MAX`]).
    started: Instant,
    settled: AtomicBool,
    /// `--replicas`, and the bytes of one copy of every expert.
    replicas: u32,
    model_bytes: u64,
    /// Each expert's record size, smallest first.
    sizes: Vec<(ExpertId, u64)>,
    /// Since when the swarm's budgets in view have been too small for `replicas` copies,
    /// and whether that was said (once, until they are big enough again).
    short: Mutex<(Option<Instant>, bool)>,
}

impl std::fmt::Debug for Replicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicator")
            .field("model", &self.model)
            .field("kept", &self.kept.lock().expect("kept lock").len())
            .finish_non_exhaustive()
    }
}

impl Replicator {
    /// A driver for the node serving `holdings`, keeping copies in `dir` within its limit,
    /// fetching through `peers`, aiming at `replicas` copies of every expert; `pinned` are the
    /// model folder's own experts on this node.
    pub fn new(
        manifest: &Manifest,
        holdings: Arc<Holdings>,
        dir: Arc<ExpertDir>,
        peers: Arc<PeerTier>,
        pinned: ExpertSet,
        replicas: u32,
        me: [u8; 32],
    ) -> Self {
        let now = Instant::now();
        let catalog: Vec<ExpertInfo> = manifest
            .experts
            .iter()
            .map(|e| ExpertInfo {
                id: e.id,
                bytes: e.len,
            })
            .collect();
        // A real swarm is small and its fetches are quick: a failed fetch is tried again
        // after 5 s (not the simulated swarm's 30 s) and a full node may swap every 15 s, so
        // coverage does not wait half a minute on one unlucky fetch.
        let config = Config {
            replicas,
            retry_after: Duration::from_secs(5),
            swap_interval: Duration::from_secs(15),
            ..Config::default()
        };
        dir.set_placed();
        let mut policy = Placement::new(me, dir.limit(), &catalog, config, now);
        for id in pinned.iter() {
            policy.handle(
                Event::Holding {
                    expert: id,
                    pinned: true,
                },
                now,
            );
        }
        let shape = (pinned.layers(), pinned.experts_per_layer());
        let model_bytes = catalog.iter().map(|e| e.bytes).sum();
        let mut sizes: Vec<_> = catalog.iter().map(|e| (e.id, e.bytes)).collect();
        sizes.sort_by_key(|&(id, b)| (b, id));
        Self {
            policy: Mutex::new(policy),
            dir,
            peers,
            model: holdings.model_id(),
            holdings,
            shape,
            pinned,
            seen: Mutex::default(),
            kept: Mutex::default(),
            fetching: Mutex::default(),
            leaving: AtomicBool::new(false),
            done: Mutex::default(),
            storing: Mutex::default(),
            started: now,
            settled: AtomicBool::new(false),
            replicas,
            model_bytes,
            sizes,
            short: Mutex::new((None, false)),
        }
    }

    /// Says (once, until it changes) when the budgets of the placing nodes in view, this
    /// one's included, cannot hold `--replicas` copies of every expert: placement then stops
    /// short of N whatever it does, and the seeder must not go.
    fn check_room(&self, view: &[stormo_net::tier::PeerSnapshot]) {
        if self.replicas == 0 || self.model_bytes == 0 {
            return;
        }
        // What a node can keep: whole experts within its budget, of those it does not hold
        // pinned (a node holds one copy of an expert at most, and pinned copies do not count),
        // the smallest first.
        let experts = self.sizes.len() as u64;
        let can_keep = |budget: u64, pinned: &ExpertSet| -> u64 {
            let mut left = budget;
            self.sizes
                .iter()
                .filter(|(e, _)| !pinned.contains(*e))
                .take_while(|&&(_, b)| {
                    let fits = b <= left;
                    left = left.saturating_sub(b);
                    fits
                })
                .count() as u64
        };
        // A seeder (every expert pinned) keeps nothing: the warning is for the placing nodes.
        let own = can_keep(self.dir.limit(), &self.pinned);
        if own == 0 && self.pinned.len() as u64 >= experts {
            return;
        }
        let budgets: Vec<u64> = view
            .iter()
            .filter_map(|p| p.placement.as_ref().filter(|w| p.connected && !w.leaving))
            .map(|w| can_keep(w.budget, &w.pinned))
            .collect();
        let room = budgets.iter().fold(own, |a, b| a.saturating_add(*b));
        let need = experts.saturating_mul(u64::from(self.replicas));
        let copies = room as f64 / experts.max(1) as f64;
        let mut g = self.short.lock().expect("short lock");
        let (since, said) = &mut *g;
        if room >= need {
            *since = None;
            if std::mem::take(said) {
                tracing::info!(
                    "placement: the budgets in view now hold {copies:.2} copies of the model's \
                     experts (--replicas {})",
                    self.replicas
                );
            }
            return;
        }
        // Short for a while, not merely while the swarm is still joining.
        let now = Instant::now();
        let since = *since.get_or_insert(now);
        if !*said && now.saturating_duration_since(since) >= ROOM_GRACE {
            *said = true;
            tracing::warn!(
                "placement: the budgets of the {} placing nodes in view hold {copies:.2} copies \
                 of the model's experts, fewer than --replicas {}: add room \
                 (--expert-dir-limit) or nodes, and keep the seeder until `swarm status` shows \
                 {} kept copies",
                1 + budgets.len(),
                self.replicas,
                self.replicas
            );
        }
    }

    /// Runs the driver on `rt` until the node stops (the task ends with the runtime).
    pub fn spawn(self: &Arc<Self>, rt: &tokio::runtime::Handle) {
        let me = self.clone();
        let handle = rt.clone();
        rt.spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if me.leaving.load(Ordering::SeqCst) {
                    return;
                }
                let m = me.clone();
                let h = handle.clone();
                // The expert directory and the peer tier take locks: off the async threads.
                if tokio::task::spawn_blocking(move || m.step(&h))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }

    /// Says goodbye: the next announcement says this node is leaving, and placement stops.
    pub fn leave(&self) {
        // Under the policy's lock, as a step publishes: a step's announcement never lands
        // after the goodbye.
        let policy = self.policy.lock().expect("policy lock");
        self.leaving.store(true, Ordering::SeqCst);
        self.publish(&policy.announcement(Instant::now()), true);
    }

    /// One round: what changed in, the policy's actions out.
    fn step(self: &Arc<Self>, rt: &tokio::runtime::Handle) {
        let now = Instant::now();
        let mut events: Vec<(EventOwned, Option<Announcement>)> = Vec::new();
        // This node's kept experts: the directory is the truth (the engine's own fetches
        // and its least-recently-used evictions change it too).
        let kept_now: HashSet<ExpertId> = self.dir.kept().into_iter().collect();
        {
            let mut kept = self.kept.lock().expect("kept lock");
            let fetching = self.fetching.lock().expect("fetching lock");
            for &id in kept_now.difference(&kept) {
                // A fetch of placement's own ends below, as done.
                if !fetching.contains_key(&id) {
                    events.push((EventOwned::Holding(id), None));
                }
            }
            drop(fetching);
            for &id in kept.difference(&kept_now) {
                events.push((EventOwned::Dropped(id), None));
            }
            *kept = kept_now;
        }
        for (id, (since, said)) in self.fetching.lock().expect("fetching lock").iter_mut() {
            let took = now.saturating_duration_since(*since);
            if !*said && took >= FETCH_SLOW {
                *said = true;
                tracing::info!(
                    "placement: fetching expert {id} is still under way after {:.0}s",
                    took.as_secs_f64()
                );
            }
        }
        // A fetch is done once its record is written: the tier stores it just after handing
        // it on, so a fetch that loaded waits for its record (up to STORE_WAIT). Counting it
        // failed at once freed its room for another fetch, and the record landing a moment
        // later put the node over its budget, which evicted a copy the swarm needed.
        {
            let mut storing = self.storing.lock().expect("storing lock");
            for (id, ok) in std::mem::take(&mut *self.done.lock().expect("done lock")) {
                if ok {
                    storing.entry(id).or_insert(now);
                } else {
                    self.fetching.lock().expect("fetching lock").remove(&id);
                    events.push((EventOwned::FetchFailed(id), None));
                }
            }
            storing.retain(|&id, since| {
                let stored = self.dir.contains(id);
                if !stored && now.saturating_duration_since(*since) < STORE_WAIT {
                    return true;
                }
                self.fetching.lock().expect("fetching lock").remove(&id);
                events.push((
                    if stored {
                        EventOwned::FetchDone(id)
                    } else {
                        EventOwned::FetchFailed(id)
                    },
                    None,
                ));
                false
            });
        }
        // The peers, as the peer tier follows them.
        let view = self.peers.swarm_view();
        {
            let mut seen = self.seen.lock().expect("seen lock");
            let mut present = HashSet::new();
            for p in &view {
                let key = *p.addr.key.as_bytes();
                present.insert(key);
                let s = seen.entry(key).or_insert(Seen {
                    last: None,
                    down_since: None,
                    left: false,
                });
                if !p.connected {
                    let since = *s.down_since.get_or_insert(now);
                    if !s.left && s.last.is_some() && now.duration_since(since) >= GONE_AFTER {
                        s.left = true;
                        s.last = None;
                        events.push((EventOwned::Left(key, Departure::TimedOut), None));
                    }
                    continue;
                }
                s.down_since = None;
                let announced = match &p.placement {
                    Some(w) if w.leaving => {
                        if !s.left && s.last.is_some() {
                            events.push((EventOwned::Left(key, Departure::Goodbye), None));
                        }
                        s.left = true;
                        s.last = None;
                        continue;
                    }
                    Some(w) => from_wire(w),
                    // Places nothing: its inventory is a source, pinned (not counted).
                    None => match &p.inventory {
                        Some(inv) => Announcement {
                            held: inv.iter().collect(),
                            pinned: inv.iter().collect(),
                            ..Announcement::default()
                        },
                        None => continue,
                    },
                };
                s.left = false;
                if s.last.as_ref() != Some(&announced) {
                    s.last = Some(announced.clone());
                    events.push((EventOwned::Announced(key), Some(announced)));
                }
            }
            for (key, s) in seen.iter_mut() {
                if !present.contains(key) && !s.left && s.last.is_some() {
                    s.left = true;
                    s.last = None;
                    events.push((EventOwned::Left(*key, Departure::TimedOut), None));
                }
            }
        }
        let demand = self.holdings.demand.take();
        // A node that places before it has heard from its peers fills its budget blind (the
        // peers it dials at the same moment are still starting): wait until each peer in view
        // is connected and has said what it holds, and none has named a node not in view yet
        // (peer exchange), at least SETTLE_MIN and at most SETTLE_MAX.
        let waited = now.saturating_duration_since(self.started);
        let settled = self.settled.load(Ordering::Relaxed)
            || waited >= SETTLE_MAX
            || (waited >= SETTLE_MIN
                && self.peers.told_peers().is_empty()
                && view
                    .iter()
                    .all(|p| p.connected && (p.placement.is_some() || p.inventory.is_some())));
        if settled {
            self.check_room(&view);
        }
        if settled && !self.settled.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "placement: the swarm's view settled after {:.1}s ({} peers)",
                now.saturating_duration_since(self.started).as_secs_f64(),
                view.len()
            );
        }
        let mut actions = Vec::new();
        {
            let mut policy = self.policy.lock().expect("policy lock");
            for (e, a) in &events {
                let event = match *e {
                    EventOwned::Holding(id) => Event::Holding {
                        expert: id,
                        pinned: false,
                    },
                    EventOwned::Dropped(id) => Event::Dropped { expert: id },
                    EventOwned::FetchDone(id) => Event::FetchDone { expert: id },
                    EventOwned::FetchFailed(id) => Event::FetchFailed { expert: id },
                    EventOwned::Left(peer, how) => Event::PeerLeft { peer, how },
                    EventOwned::Announced(peer) => Event::Announced {
                        peer,
                        announcement: a.as_ref().expect("announced with its announcement"),
                    },
                };
                policy.handle(event, now);
            }
            for (id, count) in demand {
                policy.handle(Event::Demand { expert: id, count }, now);
            }
            while let Some(a) = settled.then(|| policy.poll_action(now)).flatten() {
                actions.push(a);
            }
        }
        let mut announce = false;
        for a in actions {
            match a {
                Action::Fetch { expert, .. } => self.fetch(expert, rt),
                Action::Evict { expert } => {
                    if self.dir.remove(expert) {
                        tracing::info!(
                            "placement: evicted expert {expert} (enough copies elsewhere)"
                        );
                    }
                    self.kept.lock().expect("kept lock").remove(&expert);
                }
                Action::Announce => announce = true,
            }
        }
        if announce {
            let policy = self.policy.lock().expect("policy lock");
            if !self.leaving.load(Ordering::SeqCst) {
                self.publish(&policy.announcement(now), false);
            }
        }
    }

    /// Fetches `id` through the peer tier (verified; the tier keeps it in the directory).
    fn fetch(self: &Arc<Self>, id: ExpertId, _rt: &tokio::runtime::Handle) {
        {
            let mut f = self.fetching.lock().expect("fetching lock");
            if f.contains_key(&id) {
                return;
            }
            f.insert(id, (Instant::now(), false));
        }
        tracing::info!("placement: fetching expert {id} to keep a copy");
        self.dir.want(id);
        let me = self.clone();
        self.peers.load(
            &[id],
            Priority::Prefetch,
            Arc::new(move |id, r| {
                if let Err(e) = &r {
                    tracing::info!("placement: fetching expert {id} failed: {e}");
                }
                me.done.lock().expect("done lock").push((id, r.is_ok()));
            }),
        );
    }

    /// Publishes `a` on the node's control streams.
    fn publish(&self, a: &Announcement, leaving: bool) {
        let set = |ids: &mut dyn Iterator<Item = ExpertId>| {
            let mut s = ExpertSet::new(self.shape.0, self.shape.1)
                .expect("the shape of the node's own inventory");
            for id in ids {
                let _ = s.insert(id);
            }
            s
        };
        let pinned = self.pinned.clone();
        let kept = set(&mut a.held.iter().copied().filter(|id| !pinned.contains(*id)));
        let fetching = set(&mut a.fetching.iter().copied());
        let mut demand = a.demand.clone();
        demand.truncate(stormo_wire::MAX_PLACEMENT_DEMAND);
        let w = stormo_wire::Placement {
            model: self.model,
            budget: a.budget,
            used: a.used,
            pinned,
            kept,
            fetching,
            demand,
            leaving,
        };
        self.holdings.set_placement(w);
    }
}

/// An event whose borrowed parts live beside it.
#[derive(Clone, Copy, Debug)]
enum EventOwned {
    Holding(ExpertId),
    Dropped(ExpertId),
    FetchDone(ExpertId),
    FetchFailed(ExpertId),
    Left([u8; 32], Departure),
    Announced([u8; 32]),
}

/// A peer's wire announcement as the policy takes it.
fn from_wire(w: &stormo_wire::Placement) -> Announcement {
    let mut held: Vec<ExpertId> = w.kept.iter().collect();
    held.extend(w.pinned.iter());
    held.sort_unstable();
    held.dedup();
    Announcement {
        budget: w.budget,
        used: w.used,
        held,
        pinned: w.pinned.iter().collect(),
        fetching: w.fetching.iter().collect(),
        demand: w.demand.clone(),
    }
}
