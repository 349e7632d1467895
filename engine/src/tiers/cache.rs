//! The RAM tier: a byte-budgeted cache of expert records over the lower tiers.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::{Completion, ExpertId, Priority, Tier};
use crate::error::{Error, Result};
use crate::moe::{with_landing, ExpertData, ExpertProvider, Landed};

/// Settings of the RAM tier.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// Byte budget for cached experts (raised, with a warning, to at least one layer's top-k).
    pub budget: u64,
    /// Load predicted experts of the next layer while the current one computes. Off by
    /// default: at gpt-oss-20b geometry with budgets below the experts it read more from disk
    /// and ran slower (docs/performance.md).
    pub prefetch: bool,
    /// Share of the budget that hot experts (by usage counts) may hold and keep.
    pub hot_fraction: f64,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            budget: u64::MAX,
            prefetch: false,
            hot_fraction: 0.5,
        }
    }
}

/// Counters of one lower tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// The tier's name.
    pub name: String,
    /// Experts it delivered.
    pub loads: u64,
    /// Bytes it delivered.
    pub bytes: u64,
    /// Failed tries there: loads that failed there, and failures the tier itself followed with
    /// another of its sources ([`Tier::retried_failures`]: another peer).
    pub failures: u64,
}

/// What the tiers did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Experts asked for by the model (one per expert per block per layer).
    pub requests: u64,
    /// Of those, found ready in RAM.
    pub ram_hits: u64,
    /// Prefetched experts that were then used.
    pub prefetch_used: u64,
    /// Prefetched experts evicted (or left) unused.
    pub prefetch_wasted: u64,
    /// Experts loaded ahead of the request that then asked for them (the next group of a
    /// layer, loaded while the current one computes: [`ExpertProvider::fetch_each`]).
    pub ahead_used: u64,
    /// Experts loaded ahead and evicted (or left) unused (another request needed the room).
    pub ahead_wasted: u64,
    /// Failures followed by a try elsewhere: a load that failed in one tier and was retried in
    /// the next, or a failure a tier followed with another of its sources
    /// ([`Tier::retried_failures`]).
    pub fallbacks: u64,
    /// Seconds the model waited for experts.
    pub wait_s: f64,
    /// Per lower tier, in order.
    pub tiers: Vec<TierStats>,
}

enum State {
    Loading,
    Ready(Arc<ExpertData>),
    Failed(String),
}

struct Entry {
    state: State,
    /// Bytes reserved in the budget.
    len: u64,
    /// LRU clock of the last use.
    stamp: u64,
    /// Loaded by a prefetch and not used yet.
    unused_prefetch: bool,
    /// Loaded ahead of a request that named it as next ([`ExpertProvider::fetch_each`]'s
    /// `ahead`) and not used yet.
    unused_ahead: bool,
    /// A hot expert (evicted last).
    hot: bool,
    /// Index of the tier currently loading it.
    tier: usize,
    /// Demand requests waiting for it that have not taken their handle yet: an entry someone
    /// waits for is never evicted (an eviction between the load's completion and the waiter
    /// waking up would make the waiter lose its expert).
    waiters: u32,
}

impl Entry {
    /// A load of `len` bytes from `tier`, last used at `stamp`: no flag set, nobody waiting.
    fn loading(len: u64, stamp: u64, tier: usize) -> Self {
        Self {
            state: State::Loading,
            len,
            stamp,
            unused_prefetch: false,
            unused_ahead: false,
            hot: false,
            tier,
            waiters: 0,
        }
    }
}

/// Adds `k` to the loads of its tier in `batch` (by tier, sized on the first load, so that a
/// request with no miss allocates nothing).
fn add_load(batch: &mut Vec<Vec<ExpertId>>, tiers: usize, tier: usize, k: ExpertId) {
    if batch.is_empty() {
        batch.resize(tiers, Vec::new());
    }
    batch[tier].push(k);
}

struct Inner {
    map: HashMap<ExpertId, Entry>,
    /// Requests per expert since start, `[layer][expert]` (the hot-store's counts).
    usage: Vec<Vec<u64>>,
    used: u64,
    clock: u64,
    stats: ExpertStats,
    /// The tier and message of the last failure logged as a warning, and when: the same
    /// failure of the next experts (a dead peer fails every expert of a layer at once) is
    /// logged at debug level instead, for [`REPEAT_QUIET`].
    last_failure: Option<(usize, String, Instant)>,
}

impl Inner {
    /// Puts `e` in the map under `k` and its bytes in the budget (room already made).
    fn reserve(&mut self, k: ExpertId, e: Entry) {
        self.used += e.len;
        self.map.insert(k, e);
    }
}

/// How long the same failure of one tier is not warned about again.
const REPEAT_QUIET: std::time::Duration = std::time::Duration::from_secs(10);

/// The RAM cache over lower tiers; an [`ExpertProvider`] for the model.
pub struct TieredExperts {
    shared: Arc<Shared>,
}

struct Shared {
    inner: Mutex<Inner>,
    ready: Condvar,
    tiers: Vec<Arc<dyn Tier>>,
    /// Size of every expert record, `[layer][expert]`.
    sizes: Vec<Vec<u64>>,
    budget: u64,
    hot_budget: u64,
    prefetch: bool,
}

impl std::fmt::Debug for TieredExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredExperts")
            .field("budget", &self.shared.budget)
            .field("tiers", &self.shared.tiers)
            .finish_non_exhaustive()
    }
}

impl TieredExperts {
    /// A cache over `tiers` (tried in order). `sizes[layer][expert]` is each record's length;
    /// `top_k` sets the smallest budget (one layer's top-k of the largest experts).
    pub fn new(
        tiers: Vec<Arc<dyn Tier>>,
        sizes: Vec<Vec<u64>>,
        top_k: usize,
        cfg: &TierConfig,
    ) -> Self {
        let largest = sizes.iter().flatten().copied().max().unwrap_or(0);
        let everything: u64 = sizes.iter().flatten().sum();
        // One request (a layer's top-k experts) must fit, or it could never be served whole:
        // a smaller budget is raised up front, with a warning, instead of failing loads later.
        // A budget of 0 asks for exactly that smallest cache (as `--expert-cache` documents):
        // no warning then.
        let least = (largest * top_k as u64).min(everything.max(largest));
        if cfg.budget == 0 {
            tracing::debug!("expert cache budget 0: the smallest, {least} bytes");
        } else if cfg.budget < least {
            tracing::warn!(
                "expert cache budget of {} bytes is below one layer's top-{top_k} experts: \
                 raised to {least} bytes",
                cfg.budget
            );
        }
        let budget = cfg
            .budget
            .max(largest * top_k as u64)
            .min(everything.max(largest));
        let stats = ExpertStats {
            tiers: tiers
                .iter()
                .map(|t| TierStats {
                    name: t.name().to_string(),
                    ..TierStats::default()
                })
                .collect(),
            ..ExpertStats::default()
        };
        Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    map: HashMap::new(),
                    usage: sizes.iter().map(|l| vec![0; l.len()]).collect(),
                    used: 0,
                    clock: 0,
                    stats,
                    last_failure: None,
                }),
                ready: Condvar::new(),
                tiers,
                sizes,
                budget,
                hot_budget: (budget as f64 * cfg.hot_fraction.clamp(0.0, 1.0)) as u64,
                prefetch: cfg.prefetch,
            }),
        }
    }

    /// The effective budget in bytes.
    pub fn budget(&self) -> u64 {
        self.shared.budget
    }

    /// Bytes held (ready or loading).
    pub fn used(&self) -> u64 {
        self.shared.lock().used
    }

    /// A snapshot of the counters. Prefetched experts still unused count as wasted; failures
    /// a tier retried itself count as its failures and as fallbacks.
    pub fn stats(&self) -> ExpertStats {
        let g = self.shared.lock();
        let mut s = g.stats.clone();
        s.prefetch_wasted += g.map.values().filter(|e| e.unused_prefetch).count() as u64;
        s.ahead_wasted += g.map.values().filter(|e| e.unused_ahead).count() as u64;
        drop(g);
        for (t, tier) in s.tiers.iter_mut().zip(&self.shared.tiers) {
            let n = tier.retried_failures();
            t.failures += n;
            s.fallbacks += n;
        }
        s
    }

    /// The experts in RAM now, ready to use (loads still under way are left out).
    pub fn resident(&self) -> Vec<ExpertId> {
        let g = self.shared.lock();
        g.map
            .iter()
            .filter(|(_, e)| matches!(e.state, State::Ready(_)))
            .map(|(k, _)| *k)
            .collect()
    }

    /// Whether `key` is in RAM now, ready to use (what remote execution's choice asks: a
    /// cached expert costs nothing to compute here).
    pub fn is_resident(&self, key: ExpertId) -> bool {
        let g = self.shared.lock();
        g.map
            .get(&key)
            .is_some_and(|e| matches!(e.state, State::Ready(_)))
    }

    /// Requests per expert since start, `[layer][expert]`.
    pub fn usage(&self) -> Vec<Vec<u64>> {
        self.shared.lock().usage.clone()
    }

    /// Starts loading those of `keys` not in RAM, in order, in the background at prefetch
    /// priority, into the budget's free room only: nothing is evicted for them, they are not
    /// hot (the least recently used of all), and no request or usage count is added for them
    /// (warming a serving node's cache at start). Returns the keys queued.
    pub fn warm(&self, keys: &[ExpertId]) -> Vec<ExpertId> {
        let mut g = self.shared.lock();
        let mut batch: Vec<Vec<ExpertId>> = Vec::new();
        let mut queued = Vec::new();
        for &k in keys {
            if g.map.contains_key(&k) {
                continue;
            }
            let (Some(len), Some(tier)) = (self.shared.size(k), self.shared.first_tier(k, 0))
            else {
                continue;
            };
            if g.used + len > self.shared.budget {
                break;
            }
            g.reserve(k, Entry::loading(len, 0, tier));
            add_load(&mut batch, self.shared.tiers.len(), tier, k);
            queued.push(k);
        }
        drop(g);
        self.shared.start(batch, Priority::Prefetch);
        queued
    }

    /// How many of `keys` are still loading.
    pub fn loading(&self, keys: &[ExpertId]) -> usize {
        let g = self.shared.lock();
        keys.iter()
            .filter(|k| {
                g.map
                    .get(k)
                    .is_some_and(|e| matches!(e.state, State::Loading))
            })
            .count()
    }

    /// Starts loading `keys` as hot experts (kept in preference to others), in the background,
    /// up to the hot share of the budget. Returns how many were queued.
    pub fn preload_hot(&self, keys: &[ExpertId]) -> usize {
        let mut g = self.shared.lock();
        let mut hot_bytes: u64 = g.map.values().filter(|e| e.hot).map(|e| e.len).sum();
        let mut batch: Vec<Vec<ExpertId>> = vec![Vec::new(); self.shared.tiers.len()];
        let mut n = 0;
        for &k in keys {
            let Some(len) = self.shared.size(k) else {
                continue;
            };
            if hot_bytes + len > self.shared.hot_budget {
                break;
            }
            if let Some(e) = g.map.get_mut(&k) {
                e.hot = true;
                hot_bytes += e.len;
                continue;
            }
            let Some(tier) = self.shared.first_tier(k, 0) else {
                continue;
            };
            if !self.shared.make_room(&mut g, len, false, &|_| false) {
                break;
            }
            g.reserve(
                k,
                Entry {
                    hot: true,
                    ..Entry::loading(len, 0, tier)
                },
            );
            hot_bytes += len;
            batch[tier].push(k);
            n += 1;
        }
        drop(g);
        self.shared.start(batch, Priority::Prefetch);
        n
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("expert cache lock")
    }

    fn size(&self, k: ExpertId) -> Option<u64> {
        self.sizes
            .get(k.layer as usize)?
            .get(k.expert as usize)
            .copied()
    }

    fn first_tier(&self, k: ExpertId, from: usize) -> Option<usize> {
        (from..self.tiers.len()).find(|&i| self.tiers[i].holds(k))
    }

    /// Evicts until `len` more bytes fit. Demand loads may overshoot when everything held is in
    /// use; prefetches may not.
    fn make_room(
        &self,
        g: &mut Inner,
        len: u64,
        demand: bool,
        kept: &dyn Fn(&ExpertId) -> bool,
    ) -> bool {
        while g.used + len > self.budget {
            // least recently used ready entry that nobody holds and the current request does not
            // need; hot ones only as a last resort
            let victim = g
                .map
                .iter()
                .filter(|(k, e)| {
                    !kept(k)
                        && e.waiters == 0
                        && matches!(&e.state, State::Ready(d) if Arc::strong_count(d) == 1)
                })
                .min_by_key(|(_, e)| (e.hot, e.stamp))
                .map(|(k, _)| *k);
            let failed = g
                .map
                .iter()
                .find(|(_, e)| e.waiters == 0 && matches!(e.state, State::Failed(_)))
                .map(|(k, _)| *k);
            match victim.or(failed) {
                Some(k) => {
                    let e = g.map.remove(&k).expect("victim present");
                    g.used -= e.len;
                    if e.unused_prefetch {
                        g.stats.prefetch_wasted += 1;
                    }
                    if e.unused_ahead {
                        g.stats.ahead_wasted += 1;
                    }
                }
                None => return demand,
            }
        }
        true
    }

    /// Makes room for and marks loading those of `ahead` (experts of `layer` that a request
    /// for `experts` names as asked for next) that are not in RAM, in order, as far as the
    /// budget allows without evicting one of `ahead` or of `experts` not yet handed over
    /// (`taken[i]` false) or overshooting; returns
    /// them by tier, for [`start`](Self::start) at prefetch priority once the lock is
    /// released. They count as loaded ahead. Allocates nothing when none is missing.
    fn load_ahead(
        &self,
        g: &mut Inner,
        layer: usize,
        experts: &[usize],
        taken: &[bool],
        ahead: &[usize],
    ) -> Vec<Vec<ExpertId>> {
        let mut batch: Vec<Vec<ExpertId>> = Vec::new();
        for &e in ahead {
            let k = ExpertId::from_indices(layer, e);
            if g.map.contains_key(&k) {
                continue;
            }
            let (Some(len), Some(tier)) = (self.size(k), self.first_tier(k, 0)) else {
                continue;
            };
            let kept = |k: &ExpertId| {
                in_request(k, layer, ahead)
                    || k.layer as usize == layer
                        && experts
                            .iter()
                            .zip(taken)
                            .any(|(&e, &t)| !t && e == k.expert as usize)
            };
            if !self.make_room(g, len, false, &kept) {
                break;
            }
            let stamp = g.clock;
            g.reserve(
                k,
                Entry {
                    unused_ahead: true,
                    ..Entry::loading(len, stamp, tier)
                },
            );
            add_load(&mut batch, self.tiers.len(), tier, k);
        }
        batch
    }

    fn start(self: &Arc<Self>, batches: Vec<Vec<ExpertId>>, priority: Priority) {
        for (tier, keys) in batches.into_iter().enumerate() {
            if keys.is_empty() {
                continue;
            }
            let me = self.clone();
            let done: Completion = Arc::new(move |k, r| me.complete(k, r, priority));
            self.tiers[tier].load(&keys, priority, done);
        }
    }

    fn complete(self: &Arc<Self>, k: ExpertId, r: Result<Arc<ExpertData>>, priority: Priority) {
        let mut g = self.lock();
        let Some(tier) = g.map.get(&k).map(|e| e.tier) else {
            return;
        };
        match r {
            Ok(data) => {
                let bytes: u64 = data.parts().map(|p| p.len() as u64).sum();
                let t = &mut g.stats.tiers[tier];
                t.loads += 1;
                t.bytes += bytes;
                if let Some(e) = g.map.get_mut(&k) {
                    e.state = State::Ready(data);
                }
            }
            Err(err) => {
                g.stats.tiers[tier].failures += 1;
                let (name, why) = (self.tiers[tier].name(), err.chain());
                // The same failure whatever the expert: the message with this expert's names
                // taken out.
                let same = why
                    .replace(&format!("expert {} of layer {}", k.expert, k.layer), "")
                    .replace(&format!("expert {k}"), "");
                let repeat = g.last_failure.as_ref().is_some_and(|(t, m, at)| {
                    *t == tier && *m == same && at.elapsed() < REPEAT_QUIET
                });
                if repeat {
                    tracing::debug!("expert {k} from {name}: {why} (as the last one)");
                } else if priority == Priority::Prefetch {
                    // Nothing asked for it yet (the hot store, a predicted expert): a load
                    // that needs it warns if it fails too.
                    tracing::debug!("expert {k} from {name}, prefetched: {why}");
                } else {
                    tracing::warn!(
                        "expert {k} from {name}: {why} (the same failure of other experts in \
                         the next {}s: at debug level, -vv)",
                        REPEAT_QUIET.as_secs()
                    );
                    g.last_failure = Some((tier, same, Instant::now()));
                }
                if let Some(next) = self.first_tier(k, tier + 1) {
                    g.stats.fallbacks += 1;
                    if let Some(e) = g.map.get_mut(&k) {
                        e.tier = next;
                    }
                    drop(g);
                    let me = self.clone();
                    let done: Completion = Arc::new(move |k, r| me.complete(k, r, priority));
                    self.tiers[next].load(&[k], priority, done);
                    return;
                }
                if let Some(e) = g.map.get_mut(&k) {
                    // The reason alone where the error already names this expert: `get`
                    // wraps the stored message in `Error::Expert` again.
                    e.state = State::Failed(match err {
                        Error::Expert { reason, .. } => reason,
                        err => err.chain(),
                    });
                }
            }
        }
        drop(g);
        self.ready.notify_all();
    }
}

/// Whether `k` is one of `experts` of `layer`.
fn in_request(k: &ExpertId, layer: usize, experts: &[usize]) -> bool {
    k.layer as usize == layer && experts.contains(&(k.expert as usize))
}

/// Releases the pins of `experts` of `layer` (one per occurrence) that a request took.
fn unpin(g: &mut Inner, layer: usize, experts: &[usize]) {
    for &e in experts {
        if let Some(en) = g.map.get_mut(&ExpertId::from_indices(layer, e)) {
            en.waiters = en.waiters.saturating_sub(1);
        }
    }
}

impl TieredExperts {
    /// [`fetch_each`](ExpertProvider::fetch_each), and with `whole` [`fetch`](ExpertProvider::fetch)
    /// (ExpertProvider::fetch): nothing handed over until every expert of the request is ready,
    /// then all of them at once, in request order.
    fn serve(
        &self,
        layer: usize,
        experts: &[usize],
        ahead: &[usize],
        whole: bool,
        miss: Priority,
        landed: &mut Landed<'_>,
    ) -> Result<()> {
        let sh = &self.shared;
        let mut g = sh.lock();
        g.clock += 1;
        let clock = g.clock;
        // allocated on the first miss only: an all-hit fetch allocates nothing
        let mut batch: Vec<Vec<ExpertId>> = Vec::new();
        // Every expert of this request is pinned (its `waiters` counted) from here until its
        // handle is handed over or the request fails, so no concurrent request evicts it
        // meanwhile; a handed-over expert is kept by its handle until the caller drops it.
        for (i, &e) in experts.iter().enumerate() {
            let k = ExpertId::from_indices(layer, e);
            g.stats.requests += 1;
            if let Some(u) = g.usage.get_mut(layer).and_then(|l| l.get_mut(e)) {
                *u += 1;
            }
            let mut waiters = 1;
            let retry = matches!(g.map.get(&k).map(|e| &e.state), Some(State::Failed(_)));
            if retry {
                // the requests still waiting on the failed load wait on this one instead
                let old = g.map.remove(&k).expect("present");
                g.used -= old.len;
                waiters += old.waiters;
            }
            let Inner { map, stats, .. } = &mut *g;
            if let Some(entry) = map.get_mut(&k) {
                entry.stamp = clock;
                entry.waiters += 1;
                if entry.unused_prefetch {
                    entry.unused_prefetch = false;
                    stats.prefetch_used += 1;
                }
                if entry.unused_ahead {
                    entry.unused_ahead = false;
                    stats.ahead_used += 1;
                }
                if matches!(entry.state, State::Ready(_)) {
                    stats.ram_hits += 1;
                }
                continue;
            }
            let found = sh
                .size(k)
                .ok_or_else(|| "no such expert".to_string())
                .and_then(|len| {
                    let tier = sh.first_tier(k, 0).ok_or_else(|| {
                        let why: Vec<String> =
                            sh.tiers.iter().filter_map(|t| t.why_not(k)).collect();
                        if why.is_empty() {
                            "no tier holds it (not on local disk, and no peer serves it)".into()
                        } else {
                            format!("no tier holds it: {}", why.join("; "))
                        }
                    })?;
                    Ok((len, tier))
                });
            let (len, tier) = match found {
                Ok(found) => found,
                Err(reason) => {
                    unpin(&mut g, layer, &experts[..i]);
                    drop(g);
                    // The misses before it are marked loading: they load (for the next request)
                    // rather than stay marked forever.
                    sh.start(batch, miss);
                    return Err(Error::Expert {
                        layer,
                        expert: e,
                        reason,
                    });
                }
            };
            sh.make_room(&mut g, len, true, &|k| in_request(k, layer, experts));
            g.reserve(
                k,
                Entry {
                    waiters,
                    ..Entry::loading(len, clock, tier)
                },
            );
            add_load(&mut batch, sh.tiers.len(), tier, k);
        }
        drop(g);
        sh.start(batch, miss);
        with_landing(|l| {
            l.taken.resize(experts.len(), false);
            let mut left = experts.len();
            let mut waited = std::time::Duration::ZERO;
            let mut g = sh.lock();
            let early = sh.load_ahead(&mut g, layer, experts, &l.taken, ahead);
            if !early.is_empty() {
                drop(g);
                sh.start(early, Priority::Prefetch);
                g = sh.lock();
            }
            let failed = 'wait: loop {
                l.places.clear();
                l.handles.clear();
                let mut pending = false;
                let mut lost = None;
                for (i, &e) in experts.iter().enumerate() {
                    if l.taken[i] {
                        continue;
                    }
                    let k = ExpertId::from_indices(layer, e);
                    match g.map.get(&k).map(|en| &en.state) {
                        Some(State::Ready(d)) => {
                            l.places.push(i);
                            l.handles.push(d.clone());
                        }
                        Some(State::Loading) => pending = true,
                        Some(State::Failed(msg)) => {
                            break 'wait Some(Error::Expert {
                                layer,
                                expert: e,
                                reason: msg.clone(),
                            });
                        }
                        None => {
                            lost = Some(k);
                            break;
                        }
                    }
                }
                if let Some(k) = lost {
                    // Pinned entries are never evicted, so this is not expected; should it
                    // happen, the expert is loaded again rather than the request failed.
                    let (len, tier) = (sh.size(k), sh.first_tier(k, 0));
                    let (Some(len), Some(tier)) = (len, tier) else {
                        break Some(Error::Expert {
                            layer,
                            expert: k.expert as usize,
                            reason: "evicted while loading, and no tier holds it now".into(),
                        });
                    };
                    tracing::debug!(
                        "expert {k} was evicted while a request waited: loading it again"
                    );
                    let waiters = experts
                        .iter()
                        .zip(&l.taken)
                        .filter(|&(&e, &taken)| !taken && e == k.expert as usize)
                        .count();
                    sh.make_room(&mut g, len, true, &|k| in_request(k, layer, experts));
                    g.reserve(
                        k,
                        Entry {
                            waiters: u32::try_from(waiters).unwrap_or(u32::MAX),
                            ..Entry::loading(len, clock, tier)
                        },
                    );
                    drop(g);
                    let mut batch = vec![Vec::new(); sh.tiers.len()];
                    batch[tier].push(k);
                    sh.start(batch, miss);
                    g = sh.lock();
                    continue;
                }
                if whole && pending {
                    l.places.clear();
                    l.handles.clear();
                }
                if !l.places.is_empty() {
                    for &i in &l.places {
                        l.taken[i] = true;
                        unpin(&mut g, layer, &experts[i..=i]);
                    }
                    left -= l.places.len();
                    g.stats.wait_s += waited.as_secs_f64();
                    waited = std::time::Duration::ZERO;
                    drop(g);
                    let r = landed(&l.places, &l.handles);
                    // The caller is done with them: computed experts may be evicted now.
                    l.handles.clear();
                    g = sh.lock();
                    if let Err(e) = r {
                        break Some(e);
                    }
                    // The room the computed experts freed goes to the next experts.
                    let more = sh.load_ahead(&mut g, layer, experts, &l.taken, ahead);
                    if !more.is_empty() {
                        drop(g);
                        sh.start(more, Priority::Prefetch);
                        g = sh.lock();
                    }
                    if left == 0 {
                        break None;
                    }
                    continue;
                }
                if left == 0 {
                    break None;
                }
                let t = Instant::now();
                g = sh.ready.wait(g).expect("expert cache lock");
                waited += t.elapsed();
            };
            g.stats.wait_s += waited.as_secs_f64();
            match failed {
                None => Ok(()),
                Some(e) => {
                    for (i, &taken) in l.taken.iter().enumerate() {
                        if !taken {
                            unpin(&mut g, layer, &experts[i..=i]);
                        }
                    }
                    Err(e)
                }
            }
        })
    }

    /// [`fetch`](ExpertProvider::fetch) for work nobody is waiting on (a spot-check made in the
    /// background): its misses load at prefetch priority, behind every demand load, in the
    /// tiers and at the peers that serve them.
    pub fn fetch_behind(
        &self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<Arc<ExpertData>>,
    ) -> Result<()> {
        self.fetch_whole(layer, experts, Priority::Prefetch, out)
    }

    /// The whole request into `out`, in request order, its misses loaded at `miss` priority.
    fn fetch_whole(
        &self,
        layer: usize,
        experts: &[usize],
        miss: Priority,
        out: &mut Vec<Arc<ExpertData>>,
    ) -> Result<()> {
        self.serve(layer, experts, &[], true, miss, &mut |_, handles| {
            out.extend_from_slice(handles);
            Ok(())
        })
    }
}

impl ExpertProvider for TieredExperts {
    fn fetch(&self, layer: usize, experts: &[usize], out: &mut Vec<Arc<ExpertData>>) -> Result<()> {
        self.fetch_whole(layer, experts, Priority::Demand, out)
    }

    /// Hits are handed over at once, each miss as its load completes (from whichever tier).
    /// The experts of `ahead` not in RAM start loading (at prefetch priority, behind every
    /// demand load) as far as the budget allows without evicting one of `experts` or
    /// `ahead`: at once, and again after each landing, whose experts the caller is done with.
    fn fetch_each(
        &self,
        layer: usize,
        experts: &[usize],
        ahead: &[usize],
        landed: &mut Landed<'_>,
    ) -> Result<()> {
        self.serve(layer, experts, ahead, false, Priority::Demand, landed)
    }

    fn hint(&self, layer: usize, experts: &[usize]) {
        let sh = &self.shared;
        if !sh.prefetch {
            return;
        }
        let mut g = sh.lock();
        // allocated on the first miss only: an all-hit fetch allocates nothing
        let mut batch: Vec<Vec<ExpertId>> = Vec::new();
        for &e in experts {
            let k = ExpertId::from_indices(layer, e);
            if g.map.contains_key(&k) {
                continue;
            }
            let (Some(len), Some(tier)) = (sh.size(k), sh.first_tier(k, 0)) else {
                continue;
            };
            if !sh.make_room(&mut g, len, false, &|_| false) {
                break;
            }
            let stamp = g.clock;
            g.reserve(
                k,
                Entry {
                    unused_prefetch: true,
                    ..Entry::loading(len, stamp, tier)
                },
            );
            add_load(&mut batch, sh.tiers.len(), tier, k);
        }
        drop(g);
        sh.start(batch, Priority::Prefetch);
    }

    fn wants_hints(&self) -> bool {
        self.shared.prefetch
    }

    fn max_batch(&self, layer: usize) -> usize {
        let largest = self
            .shared
            .sizes
            .get(layer)
            .and_then(|s| s.iter().max())
            .copied()
            .unwrap_or(1)
            .max(1);
        (self.shared.budget / largest).max(1) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tier whose every load fails the way the network tier's do: with an error that
    /// already names the expert.
    #[derive(Debug)]
    struct Refusing;

    impl Tier for Refusing {
        fn name(&self) -> &str {
            "refusing"
        }
        fn holds(&self, _: ExpertId) -> bool {
            true
        }
        fn load(&self, keys: &[ExpertId], _: Priority, done: Completion) {
            for &k in keys {
                let e = Error::Expert {
                    layer: k.layer as usize,
                    expert: k.expert as usize,
                    reason: "no peer could supply it".into(),
                };
                done(k, Err(e));
            }
        }
    }

    /// A tier with several sources that made up for `retried` failures itself, and then
    /// refused every load.
    #[derive(Debug)]
    struct Retrying {
        retried: u64,
    }

    impl Tier for Retrying {
        fn name(&self) -> &str {
            "retrying"
        }
        fn holds(&self, k: ExpertId) -> bool {
            Refusing.holds(k)
        }
        fn load(&self, keys: &[ExpertId], p: Priority, done: Completion) {
            Refusing.load(keys, p, done)
        }
        fn retried_failures(&self) -> u64 {
            self.retried
        }
    }

    /// Failures a tier followed with another of its sources count as its failures and as
    /// fallbacks, besides the loads that failed there.
    #[test]
    fn failures_a_tier_retried_itself_count_as_failures_and_fallbacks() {
        let cache = TieredExperts::new(
            vec![Arc::new(Retrying { retried: 3 })],
            vec![vec![64; 4]],
            1,
            &TierConfig::default(),
        );
        let s = cache.stats();
        assert_eq!((s.tiers[0].failures, s.fallbacks), (3, 3));
        cache.fetch(0, &[1], &mut Vec::new()).unwrap_err();
        let s = cache.stats();
        assert_eq!(s.tiers[0].failures, 4, "the load that failed there, too");
        assert_eq!(s.fallbacks, 3, "no tier below to retry it in");
    }

    /// A failure is reported once, naming the expert once, and not cached as data.
    #[test]
    fn a_failed_load_names_the_expert_once() {
        let cache = TieredExperts::new(
            vec![Arc::new(Refusing)],
            vec![vec![64; 4]],
            1,
            &TierConfig::default(),
        );
        let mut out = Vec::new();
        let e = cache.fetch(0, &[2], &mut out).unwrap_err().to_string();
        assert_eq!(e, "expert 2 of layer 0: no peer could supply it");
        assert!(out.is_empty());
    }

    /// An expert no tier holds is named with what the tiers say of it (a source dropped);
    /// with nothing said, the plain reason.
    #[test]
    fn an_unheld_expert_names_why_the_tiers_do_not_hold_it() {
        #[derive(Debug)]
        struct Dropped(Option<&'static str>);
        impl Tier for Dropped {
            fn name(&self) -> &str {
                "peer"
            }
            fn holds(&self, _: ExpertId) -> bool {
                false
            }
            fn load(&self, keys: &[ExpertId], p: Priority, done: Completion) {
                Refusing.load(keys, p, done)
            }
            fn why_not(&self, _: ExpertId) -> Option<String> {
                self.0.map(str::to_string)
            }
        }
        for (why, want) in [
            (
                Some("peer x was dropped"),
                "expert 1 of layer 0: no tier holds it: peer x was dropped",
            ),
            (
                None,
                "expert 1 of layer 0: no tier holds it (not on local disk, and no peer serves it)",
            ),
        ] {
            let cache = TieredExperts::new(
                vec![Arc::new(Dropped(why))],
                vec![vec![64; 4]],
                1,
                &TierConfig::default(),
            );
            let e = cache
                .fetch(0, &[1], &mut Vec::new())
                .unwrap_err()
                .to_string();
            assert_eq!(e, want);
        }
    }

    /// Regression: a request whose second expert no tier holds failed before it started the
    /// load of its first, a miss already marked loading, so the next request for that one
    /// waited forever.
    #[test]
    fn a_request_failing_on_an_unheld_expert_still_loads_the_misses_before_it() {
        /// Holds expert 0 only; its loads complete on their own threads.
        #[derive(Debug)]
        struct OnlyZero;
        impl Tier for OnlyZero {
            fn name(&self) -> &str {
                "only-zero"
            }
            fn holds(&self, k: ExpertId) -> bool {
                k.expert == 0
            }
            fn load(&self, keys: &[ExpertId], p: Priority, done: Completion) {
                Threaded.load(keys, p, done)
            }
        }
        let cache = cache_over(Arc::new(OnlyZero), 16 * 64);
        let e = cache.fetch(0, &[0, 1], &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("no tier holds it"), "{e}");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let _ = tx.send(cache.fetch(0, &[0], &mut out).map(|()| out.len()));
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the fetch of expert 0 returned");
        assert_eq!(got.unwrap(), 1);
    }

    /// A tier whose loads complete on their own threads after a short pause, as the disk
    /// and network tiers' do.
    #[derive(Debug)]
    struct Threaded;

    impl Tier for Threaded {
        fn name(&self) -> &str {
            "threaded"
        }
        fn holds(&self, _: ExpertId) -> bool {
            true
        }
        fn load(&self, keys: &[ExpertId], _: Priority, done: Completion) {
            for &k in keys {
                let done = done.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                    done(k, Ok(Arc::new(ExpertData::new(Vec::new()))));
                });
            }
        }
    }

    /// Warming loads into the free room only, in order: it evicts nothing (not even an expert
    /// a request used), stops at the budget, skips what is in RAM, and counts no request or
    /// usage.
    #[test]
    fn warming_fills_only_the_free_room_and_counts_no_use() {
        let cache = TieredExperts::new(
            vec![Arc::new(Threaded)],
            vec![vec![64; 8]; 2],
            1,
            &TierConfig {
                budget: 5 * 64,
                hot_fraction: 0.0,
                ..TierConfig::default()
            },
        );
        cache.fetch(1, &[7], &mut Vec::new()).unwrap();
        let used = cache.stats().requests;
        let keys: Vec<ExpertId> = (0..8)
            .map(|e| ExpertId::from_indices(0, e))
            .chain([ExpertId::from_indices(1, 7)])
            .collect();
        let queued = cache.warm(&keys);
        assert_eq!(queued, keys[..4], "four more fit beside the one in RAM");
        let until = Instant::now() + std::time::Duration::from_secs(10);
        while cache.loading(&queued) > 0 {
            assert!(Instant::now() < until, "warming never ended");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut resident = cache.resident();
        resident.sort_by_key(|k| (k.layer, k.expert));
        let mut want = keys[..4].to_vec();
        want.push(ExpertId::from_indices(1, 7));
        assert_eq!(resident, want, "the used one is still there");
        assert_eq!(cache.stats().requests, used);
        assert_eq!(cache.usage()[0], vec![0; 8]);
        assert!(
            cache.warm(&keys).is_empty(),
            "full: nothing more, nothing evicted"
        );
        assert_eq!(cache.resident().len(), 5);
    }

    /// Regression (issue 40, item 1): at a budget of one record, concurrent demand loads
    /// evicted experts that other requests were still waiting on, and those waits ended in
    /// "evicted while loading" instead of getting their expert. Every fetch must succeed.
    #[test]
    fn concurrent_loads_at_a_tiny_budget_all_get_their_experts() {
        for budget in [0, 64, 3 * 64] {
            let cache = Arc::new(TieredExperts::new(
                vec![Arc::new(Threaded)],
                vec![vec![64; 16]; 2],
                1,
                &TierConfig {
                    budget,
                    hot_fraction: 0.0,
                    ..TierConfig::default()
                },
            ));
            let threads: Vec<_> = (0..16)
                .map(|t| {
                    let cache = cache.clone();
                    std::thread::spawn(move || {
                        for i in 0..40usize {
                            let layer = (t + i) % 2;
                            let experts = [(t * 7 + i * 3) % 16];
                            let mut out = Vec::new();
                            cache
                                .fetch(layer, &experts, &mut out)
                                .unwrap_or_else(|e| panic!("budget {budget}, thread {t}: {e}"));
                            assert_eq!(out.len(), 1);
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().expect("a fetching thread failed");
            }
            let mut out = Vec::new();
            cache
                .fetch(0, &[1, 2], &mut out)
                .expect("a two-expert fetch");
            assert_eq!(out.len(), 2, "two records even where the budget holds one");
        }
    }

    /// A tier that holds every load until the test completes it, so the test chooses the
    /// order loads land in (and which fail). Records each load asked of it.
    #[derive(Default)]
    struct Gated {
        calls: Mutex<Vec<(ExpertId, Priority, Option<Completion>)>>,
        cv: Condvar,
    }

    impl std::fmt::Debug for Gated {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Gated")
        }
    }

    impl Tier for Gated {
        fn name(&self) -> &str {
            "gated"
        }
        fn holds(&self, _: ExpertId) -> bool {
            true
        }
        fn load(&self, keys: &[ExpertId], p: Priority, done: Completion) {
            let mut c = self.calls.lock().unwrap();
            for &k in keys {
                c.push((k, p, Some(done.clone())));
            }
            self.cv.notify_all();
        }
    }

    /// An expert whose one part is `[layer, expert]`: the test knows a handle by its bytes.
    fn labelled(k: ExpertId) -> Arc<ExpertData> {
        let bytes = [k.layer as u8, k.expert as u8];
        Arc::new(ExpertData::from_lengths(
            Arc::new(crate::huge::HugeBuf::copy_of(&bytes).unwrap()),
            0,
            [2],
        ))
    }

    fn label(d: &ExpertData) -> (usize, usize) {
        let b = d.parts().next().unwrap();
        (b[0] as usize, b[1] as usize)
    }

    impl Gated {
        /// Waits (at most 10 s) until `n` loads were asked, and returns them.
        fn asked(&self, n: usize) -> Vec<(ExpertId, Priority)> {
            let c = self.calls.lock().unwrap();
            let (c, _) = self
                .cv
                .wait_timeout_while(c, std::time::Duration::from_secs(10), |c| c.len() < n)
                .unwrap();
            assert!(c.len() >= n, "{} loads asked, waited for {n}", c.len());
            c.iter().map(|(k, p, _)| (*k, *p)).collect()
        }

        /// Completes the pending load of `k`: its labelled data, or an error.
        fn finish(&self, k: ExpertId, ok: bool) {
            let done = {
                let mut c = self.calls.lock().unwrap();
                let call = c
                    .iter_mut()
                    .find(|(key, _, d)| *key == k && d.is_some())
                    .unwrap_or_else(|| panic!("no pending load of {k}"));
                call.2.take().unwrap()
            };
            let r = if ok {
                Ok(labelled(k))
            } else {
                Err(Error::Expert {
                    layer: k.layer as usize,
                    expert: k.expert as usize,
                    reason: "the disk said no".into(),
                })
            };
            done(k, r);
        }
    }

    /// No request's pin is left on any entry.
    fn assert_no_pin(cache: &TieredExperts) {
        let g = cache.shared.lock();
        assert!(g.map.values().all(|e| e.waiters == 0), "a pin was left");
    }

    fn cache_over(tier: Arc<dyn Tier>, budget: u64) -> Arc<TieredExperts> {
        Arc::new(TieredExperts::new(
            vec![tier],
            vec![vec![64; 16]; 2],
            1,
            &TierConfig {
                budget,
                hot_fraction: 0.0,
                ..TierConfig::default()
            },
        ))
    }

    /// One landing of a `fetch_each`: (place, label of its handle).
    type Landing = Vec<(usize, (usize, usize))>;

    /// Runs `fetch_each` on its own thread; its landings arrive on the channel as they come.
    fn fetch_each_on_thread(
        cache: &Arc<TieredExperts>,
        layer: usize,
        experts: Vec<usize>,
        ahead: Vec<usize>,
    ) -> (
        std::sync::mpsc::Receiver<Landing>,
        std::thread::JoinHandle<Result<Vec<Landing>>>,
    ) {
        let (tx, rx) = std::sync::mpsc::channel();
        let cache = cache.clone();
        let t = std::thread::spawn(move || {
            let mut all = Vec::new();
            cache
                .fetch_each(layer, &experts, &ahead, &mut |places, handles| {
                    let l: Vec<_> = places
                        .iter()
                        .zip(handles)
                        .map(|(&p, d)| (p, label(d)))
                        .collect();
                    all.push(l.clone());
                    let _ = tx.send(l);
                    Ok(())
                })
                .map(|()| all)
        });
        (rx, t)
    }

    fn next_landing(rx: &std::sync::mpsc::Receiver<Landing>) -> Landing {
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("a landing within 10 s")
    }

    /// Whatever order the loads complete in, each expert is handed over once, as its load
    /// completes (hits at once, before any miss), with its own bytes; nothing stays pinned.
    #[test]
    fn fetch_each_hands_each_expert_over_as_it_lands_in_any_order() {
        for order in [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]] {
            let gated = Arc::new(Gated::default());
            let cache = cache_over(gated.clone(), 16 * 64);
            // Experts 5 and 9 of layer 1 in RAM first.
            let hits = std::thread::spawn({
                let cache = cache.clone();
                move || cache.fetch(1, &[5, 9], &mut Vec::new())
            });
            gated.asked(2);
            gated.finish(ExpertId::from_indices(1, 5), true);
            gated.finish(ExpertId::from_indices(1, 9), true);
            hits.join().unwrap().unwrap();
            let request = vec![7, 9, 2, 5, 11, 3];
            let (rx, t) = fetch_each_on_thread(&cache, 1, request.clone(), Vec::new());
            let first = next_landing(&rx);
            assert_eq!(first, vec![(1, (1, 9)), (3, (1, 5))], "the hits, at once");
            let misses = [7, 2, 11, 3];
            let asked = gated.asked(6);
            assert_eq!(
                asked[2..]
                    .iter()
                    .map(|(k, _)| k.expert as usize)
                    .collect::<Vec<_>>(),
                misses,
                "the misses, in one batch"
            );
            assert!(asked.iter().all(|&(_, p)| p == Priority::Demand));
            for i in order {
                let e = misses[i];
                gated.finish(ExpertId::from_indices(1, e), true);
                let place = request.iter().position(|&x| x == e).unwrap();
                assert_eq!(next_landing(&rx), vec![(place, (1, e))], "order {order:?}");
            }
            let all = t.join().unwrap().unwrap();
            let mut places: Vec<usize> = all.iter().flatten().map(|&(p, _)| p).collect();
            places.sort_unstable();
            assert_eq!(places, (0..request.len()).collect::<Vec<_>>());
            let s = cache.stats();
            assert_eq!((s.requests, s.ram_hits, s.tiers[0].loads), (8, 2, 6));
            assert_no_pin(&cache);
        }
    }

    /// A load failing mid-group ends the request with its error after the experts that
    /// landed before it were handed over; the pins of the rest are released (the experts
    /// still loading are evictable once they land), and the next request loads the failed
    /// expert again. An error of the caller's own ends the request the same way.
    #[test]
    fn a_failure_mid_group_ends_the_request_and_leaves_no_pin() {
        let gated = Arc::new(Gated::default());
        let cache = cache_over(gated.clone(), 16 * 64);
        let (rx, t) = fetch_each_on_thread(&cache, 0, vec![4, 6, 8], Vec::new());
        gated.asked(3);
        gated.finish(ExpertId::from_indices(0, 8), true);
        assert_eq!(next_landing(&rx), vec![(2, (0, 8))]);
        gated.finish(ExpertId::from_indices(0, 4), false);
        let e = t.join().unwrap().unwrap_err().to_string();
        assert_eq!(e, "expert 4 of layer 0: the disk said no");
        assert_no_pin(&cache);
        // Expert 6 lands after the request ended: nobody holds it.
        gated.finish(ExpertId::from_indices(0, 6), true);
        assert!(cache.is_resident(ExpertId::from_indices(0, 6)));
        // Expert 4 is loaded again by the next request.
        let (rx, t) = fetch_each_on_thread(&cache, 0, vec![4, 6], Vec::new());
        assert_eq!(next_landing(&rx), vec![(1, (0, 6))]);
        gated.asked(4);
        gated.finish(ExpertId::from_indices(0, 4), true);
        assert_eq!(next_landing(&rx), vec![(0, (0, 4))]);
        t.join().unwrap().unwrap();
        // The caller's error.
        let r = cache.fetch_each(0, &[4, 6, 8], &[], &mut |_, _| {
            Err(Error::Expert {
                layer: 0,
                expert: 4,
                reason: "the caller gave up".into(),
            })
        });
        assert!(r.unwrap_err().to_string().contains("the caller gave up"));
        assert_no_pin(&cache);
    }

    /// The next group (`ahead`) starts loading, at prefetch priority, as soon as room allows
    /// without evicting the current group or itself: at a budget of three records and a group
    /// of three, one at a time as the current group's experts are handed over.
    #[test]
    fn ahead_loads_fill_the_room_the_current_group_frees() {
        let gated = Arc::new(Gated::default());
        let cache = cache_over(gated.clone(), 3 * 64);
        let (rx, t) = fetch_each_on_thread(&cache, 0, vec![0, 1, 2], vec![3, 4, 5]);
        let asked = gated.asked(3);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(gated.asked(3).len(), 3, "no room for the next group yet");
        assert!(asked.iter().all(|&(_, p)| p == Priority::Demand));
        gated.finish(ExpertId::from_indices(0, 1), true);
        next_landing(&rx);
        // Expert 1 handed over and dropped: its room goes to expert 3.
        let asked = gated.asked(4);
        assert_eq!(asked[3], (ExpertId::from_indices(0, 3), Priority::Prefetch));
        gated.finish(ExpertId::from_indices(0, 0), true);
        gated.finish(ExpertId::from_indices(0, 2), true);
        let all = t.join().unwrap().unwrap();
        assert_eq!(all.iter().flatten().count(), 3);
        // The whole next group is loading ahead once the current one is done.
        let asked = gated.asked(6);
        assert_eq!(asked.len(), 6);
        for (i, &(k, p)) in asked[3..].iter().enumerate() {
            assert_eq!(
                (k, p),
                (ExpertId::from_indices(0, 3 + i), Priority::Prefetch)
            );
            gated.finish(k, true);
        }
        let mut out = Vec::new();
        cache.fetch(0, &[3, 4, 5], &mut out).unwrap();
        assert_eq!(
            out.iter().map(|d| label(d)).collect::<Vec<_>>(),
            [(0, 3), (0, 4), (0, 5)]
        );
        let s = cache.stats();
        assert_eq!(
            (s.ram_hits, s.ahead_used, s.ahead_wasted),
            (3, 3, 0),
            "{s:?}"
        );
        assert_eq!(
            s.prefetch_used + s.prefetch_wasted,
            0,
            "not predictions: {s:?}"
        );
        assert_eq!(s.tiers[0].loads, 6, "no expert loaded twice: {s:?}");
    }

    /// Regression guard for the landing path at a tiny budget: many threads asking
    /// overlapping groups with overlapping `ahead` lists all get every expert they asked for,
    /// once each, with its own bytes, and leave no pin.
    #[test]
    fn concurrent_fetch_each_at_a_tiny_budget_gets_every_expert_once() {
        /// Completes each load on its own thread after a short pause, with labelled data.
        #[derive(Debug)]
        struct Labelled;
        impl Tier for Labelled {
            fn name(&self) -> &str {
                "labelled"
            }
            fn holds(&self, _: ExpertId) -> bool {
                true
            }
            fn load(&self, keys: &[ExpertId], _: Priority, done: Completion) {
                for &k in keys {
                    let done = done.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(std::time::Duration::from_micros(
                            100 + 50 * k.expert as u64,
                        ));
                        done(k, Ok(labelled(k)));
                    });
                }
            }
        }
        for budget in [0, 64, 3 * 64] {
            let cache = cache_over(Arc::new(Labelled), budget);
            let threads: Vec<_> = (0..12)
                .map(|t| {
                    let cache = cache.clone();
                    std::thread::spawn(move || {
                        for i in 0..30usize {
                            let layer = (t + i) % 2;
                            let a = (t * 5 + i * 3) % 16;
                            let group = [a, (a + 1) % 16];
                            let ahead = [(a + 2) % 16, (a + 7) % 16];
                            let mut seen = [0u8; 2];
                            cache
                                .fetch_each(layer, &group, &ahead, &mut |places, handles| {
                                    for (&p, d) in places.iter().zip(handles) {
                                        assert_eq!(label(d), (layer, group[p]));
                                        seen[p] += 1;
                                    }
                                    Ok(())
                                })
                                .unwrap_or_else(|e| panic!("budget {budget}, thread {t}: {e}"));
                            assert_eq!(seen, [1, 1], "budget {budget}, thread {t}");
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().expect("a fetching thread failed");
            }
            // Ahead loads may still be landing: wait for them, then nothing is pinned.
            let start = Instant::now();
            loop {
                let g = cache.shared.lock();
                let loading = g.map.values().any(|e| matches!(e.state, State::Loading));
                if !loading {
                    assert!(g.map.values().all(|e| e.waiters == 0), "a pin was left");
                    break;
                }
                drop(g);
                assert!(start.elapsed().as_secs() < 10, "loads never landed");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}
