//! Eviction: which kept expert a node gives up ([`Placement::victim`]) and, of the holders
//! of an expert beyond N copies, which may give theirs up ([`Placement::designated_evictor`]).

use std::fmt;
use std::hash::Hash;
use std::time::Instant;

use super::draw::{hash3, SALT_EVICT};
use super::{bits, Action, Own, Placement};

/// What an eviction must respect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Safety {
    /// A shrunk budget: anything not pinned, safest first.
    Budget,
    /// For a missing copy: only copies beyond N of which this node is a designated evictor.
    Coverage,
    /// For demand: the same, and held at least `min_hold`.
    Demand,
}

/// A victim for a swap: index, its keep value (demand per copy) and size.
#[derive(Clone, Copy, Debug)]
pub(super) struct Victim {
    pub(super) idx: u32,
    pub(super) keep: f64,
    pub(super) bytes: u64,
}

impl<N: Copy + Eq + Hash + fmt::Debug> Placement<N> {
    /// The kept expert to evict first: lowest demand per copy (most copies, least used), then
    /// least used here. `safe`: only what stays at N copies or more without this node, was
    /// held `min_hold`, and for which this node is among the designated evictors.
    pub(super) fn victim(&self, now: Instant, safety: Safety) -> Option<Victim> {
        let safe = safety != Safety::Budget;
        let n = self.config.replicas;
        let scale = self.demand_read_scale(now);
        // The experts missing copies, for a swap that covers one ([`Self::designated_evictor`]).
        let missing: Vec<u32> = if safety == Safety::Coverage {
            (0..self.experts.len() as u32)
                .filter(|&x| self.is_missing(x))
                .collect()
        } else {
            Vec::new()
        };
        let mut best: Option<(Victim, u32, f64)> = None;
        for (&i, &since) in &self.held_since {
            if self.own_of(i) != Own::Held {
                continue;
            }
            let Some(v) = self.experts.get(i as usize) else {
                continue;
            };
            // Copies that count towards N, this one included: evicting must not leave an
            // expert whose other copy is only a seeder's (pinned, not counted) below N.
            let copies = v
                .held
                .saturating_sub(self.uncounted_pinned(v))
                .saturating_add(1);
            if safe {
                let young = now.saturating_duration_since(since) < self.config.min_hold;
                if copies <= n || (young && safety == Safety::Demand) {
                    continue;
                }
                let gap = (safety == Safety::Coverage).then_some(&missing[..]);
                if !self.designated_evictor(i, copies - n, gap) {
                    continue;
                }
            }
            let w = self.weights.get(i as usize).copied().unwrap_or(1.0);
            let keep = w / f64::from(copies);
            let local = self.local_demand.get(&i).map_or(0.0, |&d| d * scale);
            let cand = Victim {
                idx: i,
                keep,
                bytes: self.bytes(i),
            };
            let better = match &best {
                None => true,
                Some((b, bc, bl)) => keep
                    .total_cmp(&b.keep)
                    .then(bc.cmp(&copies))
                    .then(local.total_cmp(bl))
                    .then(i.cmp(&b.idx))
                    .is_lt(),
            };
            if better {
                best = Some((cand, copies, local));
            }
        }
        best.map(|b| b.0)
    }

    /// Whether this node is among the `spare` evictable holders of expert `i` with the highest
    /// rendezvous score (pinned holders never evict, so they are not ranked). With `missing`
    /// (the experts missing copies, for a swap that covers one) only the holders that lack
    /// one of them are ranked: a holder that holds every missing expert could not use the
    /// room, and designating it left a full swarm stuck with one expert at three copies and
    /// another at one (every holder of the spare copy but the designated one holding back).
    fn designated_evictor(&self, i: u32, spare: u32, missing: Option<&[u32]>) -> bool {
        let e = self.catalog.get(i as usize).map_or(0, |e| bits(e.id));
        let mine = hash3(self.me_key, e, SALT_EVICT);
        let Some(v) = self.experts.get(i as usize) else {
            return false;
        };
        // Whether holder `h` (a peer index) lacks an expert of `missing`.
        let could_use = |h: u32| {
            missing.is_none_or(|m| {
                m.iter().any(|&x| {
                    self.experts
                        .get(x as usize)
                        .is_some_and(|xv| !xv.holders.contains(&h))
                })
            })
        };
        if missing.is_some_and(|m| m.iter().all(|&x| self.own_of(x) != Own::None)) {
            return false;
        }
        let mut above = 0u32;
        for &h in &v.holders {
            let Some(Some(p)) = self.peers.get(h as usize) else {
                continue;
            };
            if p.pinned().binary_search(&i).is_ok() || !could_use(h) {
                continue;
            }
            let s = hash3(p.key, e, SALT_EVICT);
            if (s, p.key) > (mine, self.me_key) {
                above += 1;
                if above >= spare {
                    return false;
                }
            }
        }
        above < spare
    }

    pub(super) fn evict(&mut self, i: u32, now: Instant) {
        let Some(id) = self.catalog.get(i as usize).map(|e| e.id) else {
            return;
        };
        self.set_own(i, Own::None, now);
        self.stats.evictions += 1;
        self.actions.push_back(Action::Evict { expert: id });
    }
}
