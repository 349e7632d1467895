//! Which experts the swarm covers, as this node sees it: per expert, the copies held for good
//! (a model folder's own experts and kept ones, as serving nodes announce them in their
//! placement; a node that places nothing counts with its inventory) and whether any holder is
//! reachable now; per node, what it holds. What `stormo swarm status` prints, `GET /v1/swarm`
//! answers, and `/health` and `--wait-coverage` judge by.
//!
//! "Reachable" is wider than "a copy": a peer serves what its RAM cache holds too (its
//! inventory), and this node's own RAM cache, disk and kept experts count; an expert with no
//! reachable holder is *uncovered*: generation would fail on it.
//!
//! *Kept* copies are the copies in nodes' expert directories (what placement keeps), the
//! model folders' own experts left out: a seeder serving a whole folder holds a copy of every
//! expert, and the swarm keeps the model once it leaves only if every expert has a kept copy.
//!
//! The nodes are those of this node's peer set: a peer whose connection is down is listed
//! too, marked `connected: false`, serving nothing (`held` 0) and counted in no copy; what it
//! last announced of its placement (`pinned`, `kept`, its budget) is shown as announced. So a
//! long-running node's `/v1/swarm` shows which nodes went down, where `stormo swarm status`,
//! a process that starts afresh, knows only the nodes it is given and those the peers name,
//! which are serving: a node that is down shows there only when given with `--peer`.

use serde_json::{json, Value};
use stormo_engine::tiers::ExpertId;
use stormo_wire::ExpertSet;

/// One node's holdings in a [`Coverage`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCoverage {
    /// Its node key (64 hex).
    pub key: String,
    /// Where it listens (`None`: this node, when it does not listen).
    pub addr: Option<String>,
    /// This node (the one asking).
    pub this_node: bool,
    /// Its connection is up (always true for this node). A node that is down is listed
    /// still, counted in no copy.
    pub connected: bool,
    /// Experts it serves now (its inventory: disk, kept and RAM cache); 0 for a node that is
    /// down.
    pub held: usize,
    /// Its model folder's own experts, when it announces placement.
    pub pinned: Option<usize>,
    /// Experts it keeps on disk, when it announces placement.
    pub kept: Option<usize>,
    /// Its budget for kept experts, in bytes, when it announces placement.
    pub budget: Option<u64>,
    /// Bytes of that budget in use.
    pub used: Option<u64>,
}

impl NodeCoverage {
    /// Peer `p` as this node sees it: what it serves now (nothing while it is down), and its
    /// last placement announcement.
    pub fn peer(p: &stormo_net::tier::PeerSnapshot) -> Self {
        Self {
            key: p.addr.key.to_string(),
            addr: Some(p.addr.addr.to_string()),
            this_node: false,
            connected: p.connected,
            held: p
                .inventory
                .as_ref()
                .filter(|_| p.connected)
                .map_or(0, ExpertSet::len),
            pinned: p.placement.as_ref().map(|w| w.pinned.len()),
            kept: p.placement.as_ref().map(|w| w.kept.len()),
            budget: p.placement.as_ref().map(|w| w.budget),
            used: p.placement.as_ref().map(|w| w.used),
        }
    }
}

/// The swarm's coverage of one model. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coverage {
    /// Copies held for good, per layer and expert (`[layer][expert]`).
    pub copies: Vec<Vec<u32>>,
    /// Of them, kept copies (in expert directories; not a model folder's own).
    pub kept: Vec<Vec<u32>>,
    /// Whether some holder is reachable now, per layer and expert.
    pub reachable: Vec<Vec<bool>>,
    /// The nodes in view, this one first.
    pub nodes: Vec<NodeCoverage>,
}

/// What one holder contributes: its durable copies and what it serves now.
#[derive(Debug)]
pub struct Holder<'a> {
    /// Copies held for good (pinned and kept).
    pub durable: &'a ExpertSet,
    /// What it serves now (a superset of `durable` for a serving node).
    pub serves: &'a ExpertSet,
    /// Of `durable`, its kept copies (in its expert directory), as far as it says.
    pub kept: Option<&'a ExpertSet>,
}

impl Coverage {
    /// Coverage of a model whose layer `l` has `experts[l]` experts (0 for a dense layer),
    /// from `holders` (this node's and each connected peer's) and `nodes`.
    pub fn from_holders(
        experts: &[usize],
        holders: &[Holder<'_>],
        nodes: Vec<NodeCoverage>,
    ) -> Self {
        let mut copies: Vec<Vec<u32>> = experts.iter().map(|&n| vec![0; n]).collect();
        let mut kept = copies.clone();
        let mut reachable: Vec<Vec<bool>> = experts.iter().map(|&n| vec![false; n]).collect();
        for h in holders {
            for id in h.durable.iter() {
                if let Some(c) = copies
                    .get_mut(id.layer as usize)
                    .and_then(|l| l.get_mut(id.expert as usize))
                {
                    *c += 1;
                }
            }
            for id in h.kept.iter().flat_map(|k| k.iter()) {
                if let Some(c) = kept
                    .get_mut(id.layer as usize)
                    .and_then(|l| l.get_mut(id.expert as usize))
                {
                    *c += 1;
                }
            }
            for id in h.serves.iter().chain(h.durable.iter()) {
                if let Some(r) = reachable
                    .get_mut(id.layer as usize)
                    .and_then(|l| l.get_mut(id.expert as usize))
                {
                    *r = true;
                }
            }
        }
        Self {
            copies,
            kept,
            reachable,
            nodes,
        }
    }

    /// The number of experts (of every MoE layer).
    pub fn experts(&self) -> usize {
        self.copies.iter().map(Vec::len).sum()
    }

    /// The experts no reachable node holds.
    pub fn uncovered(&self) -> Vec<ExpertId> {
        let mut out = Vec::new();
        for (l, layer) in self.reachable.iter().enumerate() {
            for (e, &r) in layer.iter().enumerate() {
                if !r {
                    out.push(ExpertId::new(l as u16, e as u16));
                }
            }
        }
        out
    }

    /// The fewest copies any expert has (0 for a model without experts).
    pub fn min_copies(&self) -> u32 {
        self.copies.iter().flatten().copied().min().unwrap_or(0)
    }

    /// The fewest kept copies any expert has: what the swarm holds without the model folders
    /// (0 for a model without experts).
    pub fn min_kept_copies(&self) -> u32 {
        self.kept.iter().flatten().copied().min().unwrap_or(0)
    }

    /// (min, median, max) copies of `layer`'s experts, `None` for a dense layer.
    pub fn layer_copies(&self, layer: usize) -> Option<(u32, u32, u32)> {
        let mut c = self.copies.get(layer)?.clone();
        if c.is_empty() {
            return None;
        }
        c.sort_unstable();
        Some((c[0], c[c.len() / 2], c[c.len() - 1]))
    }

    /// The JSON of `stormo swarm status --json` and `GET /v1/swarm`: `experts`, `min_copies`,
    /// `min_kept_copies`, `uncovered` ("layer:expert"), per-layer copies and the `nodes`
    /// (each `key`, `addr`, `this_node`, `connected`, `held`, `pinned`, `kept`, `budget`,
    /// `used`; see [`NodeCoverage`]).
    pub fn json(&self) -> Value {
        let uncovered: Vec<String> = self.uncovered().iter().map(ToString::to_string).collect();
        let layers: Vec<Value> = (0..self.copies.len())
            .filter_map(|l| {
                let (min, median, max) = self.layer_copies(l)?;
                let uncovered = self.reachable[l].iter().filter(|r| !**r).count();
                Some(json!({
                    "layer": l,
                    "experts": self.copies[l].len(),
                    "min_copies": min,
                    "median_copies": median,
                    "max_copies": max,
                    "uncovered": uncovered,
                }))
            })
            .collect();
        let nodes: Vec<Value> = self
            .nodes
            .iter()
            .map(|n| {
                json!({
                    "key": n.key,
                    "addr": n.addr,
                    "this_node": n.this_node,
                    "connected": n.connected,
                    "held": n.held,
                    "pinned": n.pinned,
                    "kept": n.kept,
                    "budget": n.budget,
                    "used": n.used,
                })
            })
            .collect();
        json!({
            "experts": self.experts(),
            "min_copies": self.min_copies(),
            "min_kept_copies": self.min_kept_copies(),
            "uncovered": uncovered,
            "layers": layers,
            "nodes": nodes,
        })
    }

    /// A table for people: per layer the copies (min/median/max) and what is uncovered, then
    /// per node what it holds.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let uncovered = self.uncovered();
        let copies = |n: u32| if n == 1 { "copy" } else { "copies" };
        let _ = writeln!(
            s,
            "{} experts, at least {} {} each ({} kept, model folders left out), {} uncovered",
            self.experts(),
            self.min_copies(),
            copies(self.min_copies()),
            self.min_kept_copies(),
            uncovered.len()
        );
        let _ = writeln!(s, "layer  experts  copies min/median/max  uncovered");
        for l in 0..self.copies.len() {
            if let Some((min, med, max)) = self.layer_copies(l) {
                let u = self.reachable[l].iter().filter(|r| !**r).count();
                let _ = writeln!(
                    s,
                    "{l:>5}  {:>7}  {:>21}  {u:>9}",
                    self.copies[l].len(),
                    format!("{min}/{med}/{max}")
                );
            }
        }
        if !uncovered.is_empty() {
            let list: Vec<String> = uncovered.iter().take(20).map(ToString::to_string).collect();
            let more = uncovered.len().saturating_sub(20);
            let _ = writeln!(
                s,
                "uncovered: {}{}",
                list.join(" "),
                if more > 0 {
                    format!(" (and {more} more)")
                } else {
                    String::new()
                }
            );
        }
        let _ = writeln!(
            s,
            "node      address                 up  serves  pinned    kept  budget used"
        );
        for n in &self.nodes {
            let opt = |v: Option<usize>| v.map_or("-".to_string(), |v| v.to_string());
            let bytes = match (n.used, n.budget) {
                (Some(u), Some(b)) => format!(
                    "{} of {}",
                    stormo_net::progress::human_bytes(u),
                    stormo_net::progress::human_bytes(b)
                ),
                _ => "-".into(),
            };
            let _ = writeln!(
                s,
                "{:<8}  {:<22}  {:>2}  {:>6}  {:>6}  {:>6}  {bytes}",
                &n.key[..n.key.len().min(8)],
                n.addr
                    .as_deref()
                    .unwrap_or(if n.this_node { "(this node)" } else { "?" }),
                if n.connected { "up" } else { "no" },
                n.held,
                opt(n.pinned),
                opt(n.kept),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[(u16, u16)]) -> ExpertSet {
        let mut s = ExpertSet::new(2, 3).unwrap();
        for &(l, e) in ids {
            s.insert(ExpertId::new(l, e)).unwrap();
        }
        s
    }

    #[test]
    fn copies_count_durable_holders_and_reachability_counts_any() {
        // Layer 0 has 3 experts, layer 1 is dense.
        let experts = [3, 0];
        let a = set(&[(0, 0), (0, 1)]);
        let a_serves = set(&[(0, 0), (0, 1), (0, 2)]);
        let b = set(&[(0, 0)]);
        let c = Coverage::from_holders(
            &experts,
            &[
                Holder {
                    durable: &a,
                    serves: &a_serves,
                    kept: None,
                },
                Holder {
                    durable: &b,
                    serves: &b,
                    kept: Some(&b),
                },
            ],
            Vec::new(),
        );
        assert_eq!(c.copies, vec![vec![2, 1, 0], vec![]]);
        // a's copies are its folder's own (no kept set); b keeps 0:0.
        assert_eq!(c.kept, vec![vec![1, 0, 0], vec![]]);
        assert_eq!(c.min_kept_copies(), 0);
        assert!(
            c.table()
                .contains("at least 0 copies each (0 kept, model folders left out)"),
            "{}",
            c.table()
        );
        assert_eq!(c.experts(), 3);
        assert_eq!(c.min_copies(), 0);
        assert!(c.uncovered().is_empty(), "0:2 is in a's RAM cache");
        assert_eq!(c.layer_copies(0), Some((0, 1, 2)));
        assert_eq!(c.layer_copies(1), None);
        let j = c.json();
        assert_eq!(j["experts"], 3);
        assert_eq!(j["min_copies"], 0);
        assert_eq!(j["min_kept_copies"], 0);
        assert_eq!(j["uncovered"].as_array().unwrap().len(), 0);
        let alone = Coverage::from_holders(
            &experts,
            &[Holder {
                durable: &b,
                serves: &b,
                kept: Some(&b),
            }],
            Vec::new(),
        );
        assert_eq!(
            alone.uncovered(),
            vec![ExpertId::new(0, 1), ExpertId::new(0, 2)]
        );
        assert_eq!(alone.json()["uncovered"], json!(["0:1", "0:2"]));
        assert!(alone.table().contains("2 uncovered"), "{}", alone.table());
    }

    /// A peer that is down is listed, marked `connected: false` and serving nothing, its
    /// last placement shown as announced; before, it was listed serving its last inventory,
    /// as if up but for one flag.
    #[test]
    fn a_peer_that_is_down_is_listed_serving_nothing() {
        let key = stormo_manifests::SecretKey::from_seed(&[7; 32]).public();
        let mut p = stormo_net::tier::PeerSnapshot {
            addr: stormo_net::PeerAddr {
                key,
                addr: "127.0.0.1:4433".parse().unwrap(),
            },
            inventory: Some(set(&[(0, 0), (0, 1)])),
            placement: Some(stormo_wire::Placement {
                model: stormo_manifests::Hash::of(b"m"),
                budget: 100,
                used: 10,
                pinned: set(&[(0, 0)]),
                kept: set(&[(0, 1)]),
                fetching: set(&[]),
                demand: Vec::new(),
                leaving: false,
            }),
            connected: true,
        };
        let up = NodeCoverage::peer(&p);
        assert_eq!((up.connected, up.held, up.kept), (true, 2, Some(1)));
        p.connected = false;
        let down = NodeCoverage::peer(&p);
        assert_eq!(
            (down.connected, down.held, down.pinned, down.kept),
            (false, 0, Some(1), Some(1))
        );
        let c = Coverage::from_holders(&[3, 0], &[], vec![down]);
        let j = &c.json()["nodes"][0];
        assert_eq!(
            (&j["connected"], &j["held"]),
            (&json!(false), &json!(0)),
            "{j}"
        );
        let table = c.table();
        let row: Vec<&str> = table
            .lines()
            .last()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(row[1..4], ["127.0.0.1:4433", "no", "0"], "{table}");
    }
}
