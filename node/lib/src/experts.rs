//! Where a node's experts come from: the provider built from an [`ExpertsConfig`] (mapped
//! files, or the RAM cache over disk, kept experts and peers), and its statistics. The
//! cache's budget comes from the command's [`MemoryPlan`] (one reading of the machine's
//! memory, shared with the HTTP API's `--parallel` default).

use std::path::PathBuf;
use std::sync::Arc;

use stormo_engine::moe::ExpertProvider;
use stormo_engine::tiers::{usage, ExpertStats, Tier, TierConfig, TieredExperts};
use stormo_engine::ModelFiles;

use crate::config::ExpertsConfig;
use crate::memory::MemoryPlan;
use stormo_net::progress::human_bytes;

/// The provider built from an [`ExpertsConfig`], with what is needed to report on it.
#[derive(Debug)]
pub struct Experts {
    /// For the model.
    pub provider: Arc<dyn ExpertProvider>,
    /// The cache, when tiered.
    pub tiered: Option<Arc<TieredExperts>>,
    usage_path: Option<PathBuf>,
}

/// Bytes of the non-expert tensors.
pub fn dense_bytes(files: &ModelFiles) -> u64 {
    let experts = files.layout.expert_tensor_names();
    files
        .ckpt
        .tensors
        .iter()
        .filter(|(n, _)| !experts.contains(n.as_str()))
        .map(|(_, t)| t.len)
        .sum()
}

/// Bytes of an f32 KV cache for `context` positions (upper bound: no sliding-window savings;
/// [`crate::memory::kv_cache_bytes`]).
pub fn kv_bytes(files: &ModelFiles, context: usize) -> u64 {
    crate::memory::kv_cache_bytes(&files.cfg, context)
}

impl Experts {
    /// [`Experts::build_within`] a plan of the machine's memory read here, for a caller that
    /// has none of its own (a command that also sizes the HTTP API's `--parallel` reads one
    /// plan for both and calls [`Experts::build_within`]).
    pub fn build(
        files: &ModelFiles,
        cfg: &ExpertsConfig,
        context: usize,
        tiers: Vec<Arc<dyn Tier>>,
        usage: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        Self::build_within(files, cfg, &MemoryPlan::read(), context, tiers, usage)
    }

    /// The provider for `files` with room for a `context`-position KV cache: the local
    /// experts memory-mapped (`cfg.mmap`), or the RAM cache over `tiers` (tried in order),
    /// its budget from `memory` under `--expert-cache auto`, preloading the hottest experts
    /// recorded at `usage` (when given) and recording usage there at [`Experts::finish`].
    pub fn build_within(
        files: &ModelFiles,
        cfg: &ExpertsConfig,
        memory: &MemoryPlan,
        context: usize,
        tiers: Vec<Arc<dyn Tier>>,
        usage: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        if cfg.mmap {
            return Ok(Self {
                provider: Arc::new(files.mapped_experts()?),
                tiered: None,
                usage_path: None,
            });
        }
        let sizes = files.layout.sizes();
        let all: u64 = sizes.iter().flatten().sum();
        let budget = memory.expert_cache(cfg.cache, dense_bytes(files), kv_bytes(files, context));
        let tc = TierConfig {
            budget: budget.min(all),
            prefetch: cfg.prefetch,
            ..TierConfig::default()
        };
        let t = Arc::new(TieredExperts::new(
            tiers,
            sizes,
            files.cfg.top_k.max(1),
            &tc,
        ));
        tracing::info!(
            "expert cache budget {} of {} in all",
            human_bytes(t.budget()),
            human_bytes(all)
        );
        let usage_path = usage.filter(|_| cfg.hot_store);
        if let Some(p) = &usage_path {
            let shape: Vec<usize> = files.layout.parts.iter().map(Vec::len).collect();
            let counts = usage::load(p, &shape);
            let hot = usage::hottest(&counts);
            if !hot.is_empty() {
                let n = t.preload_hot(&hot);
                tracing::info!("preloading {n} hot experts from {}", p.display());
            }
        }
        Ok(Self {
            provider: t.clone(),
            tiered: Some(t),
            usage_path,
        })
    }

    /// The RAM cache over the local disk alone (a model run from its own checkpoint, as the
    /// benchmarks and tests do), recording no usage.
    pub fn local(files: &ModelFiles, cfg: &ExpertsConfig, context: usize) -> anyhow::Result<Self> {
        let tiers: Vec<Arc<dyn Tier>> = if cfg.mmap {
            Vec::new()
        } else {
            vec![Arc::new(files.disk_tier(cfg.io_threads, None)?)]
        };
        Self::build(files, cfg, context, tiers, None)
    }

    /// Statistics so far, when tiered.
    pub fn stats(&self) -> Option<ExpertStats> {
        self.tiered.as_ref().map(|t| t.stats())
    }

    /// Saves the usage counts for the next start (hot-store). They are only a hint for the
    /// next start's preloading, so a failure to save them is a warning, not a failed run.
    pub fn finish(&self) {
        if let (Some(t), Some(p)) = (&self.tiered, &self.usage_path) {
            if let Err(e) = usage::save(p, &t.usage()) {
                tracing::warn!(
                    "could not save expert usage counts to {} ({e}); the next start preloads \
                     from the history it finds",
                    p.display()
                );
            }
        }
    }

    /// The `"experts"` object of `--json`.
    pub fn json(&self, prediction: (u64, u64)) -> serde_json::Value {
        let Some(s) = self.stats() else {
            return serde_json::json!({"mode": "mmap"});
        };
        let mut o = serde_json::json!({
            "requests": s.requests,
            "ram_hits": s.ram_hits,
            "prefetch_used": s.prefetch_used,
            "prefetch_wasted": s.prefetch_wasted,
            "ahead_used": s.ahead_used,
            "ahead_wasted": s.ahead_wasted,
            "fallbacks": s.fallbacks,
            "wait_s": s.wait_s,
            "budget_bytes": self.tiered.as_ref().map(|t| t.budget()),
            "prediction_accuracy": if prediction.1 > 0 { Some(prediction.0 as f64 / prediction.1 as f64) } else { None },
        });
        for name in ["disk", "dir", "peer"] {
            let t = s.tiers.iter().find(|t| t.name == name);
            o[format!("{name}_loads")] = t.map_or(0, |t| t.loads).into();
            o[format!("{name}_bytes")] = t.map_or(0, |t| t.bytes).into();
            o[format!("{name}_failures")] = t.map_or(0, |t| t.failures).into();
        }
        o
    }

    /// A short table for `--stats` on stderr.
    pub fn table(&self, prediction: (u64, u64)) -> String {
        let Some(s) = self.stats() else {
            return "experts: memory-mapped (no statistics)".into();
        };
        let mut out = format!(
            "experts: {} requests, {} RAM hits ({:.1}%), waited {:.3}s, budget {}\n",
            s.requests,
            s.ram_hits,
            100.0 * s.ram_hits as f64 / s.requests.max(1) as f64,
            s.wait_s,
            human_bytes(self.tiered.as_ref().map_or(0, |t| t.budget()))
        );
        for t in &s.tiers {
            out += &format!(
                "  {:<5} {:>6} loads {:>10} {:>4} failures\n",
                t.name,
                t.loads,
                human_bytes(t.bytes),
                t.failures
            );
        }
        out += &format!(
            "  prefetch: {} used, {} wasted; loaded ahead: {} used, {} wasted",
            s.prefetch_used, s.prefetch_wasted, s.ahead_used, s.ahead_wasted
        );
        if prediction.1 > 0 {
            out += &format!(
                "; next-layer prediction {:.1}% right",
                100.0 * prediction.0 as f64 / prediction.1 as f64
            );
        }
        if s.fallbacks > 0 {
            out += &format!("; {} fallbacks", s.fallbacks);
        }
        out
    }
}

/// Opens what a node in `dir` serves: the manifest (`manifest`, or `DIR/stormo-manifest.bin`),
/// checked against the checkpoint's layout, and its experts through the tiers of `args`,
/// restricted to `only` (an `--only-experts` spec) when given.
pub fn open_holdings(
    dir: &std::path::Path,
    manifest: Option<&std::path::Path>,
    args: &ExpertsConfig,
    only: Option<&str>,
) -> anyhow::Result<(stormo_net::serve::Holdings, Experts)> {
    let mut built = None;
    let h = stormo_net::serve::holdings(dir, manifest, only, |files, allowed| {
        let tiers: Vec<Arc<dyn Tier>> = if allowed
            .as_ref()
            .is_some_and(|a| !a.iter().flatten().any(|&on| on))
        {
            Vec::new()
        } else {
            vec![Arc::new(files.disk_tier(args.io_threads.max(1), allowed)?)]
        };
        let e = Experts::build(files, args, 1, tiers, None)?;
        let provider = e.provider.clone();
        built = Some(e);
        Ok(provider)
    })?;
    Ok((h, built.expect("holdings() builds the experts it returns")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormo_engine::tiers::{Completion, ExpertId, Priority};

    /// A network tier that made up for `retried` failed tries with other peers.
    #[derive(Debug)]
    struct Peers {
        retried: u64,
    }

    impl Tier for Peers {
        fn name(&self) -> &str {
            "peer"
        }
        fn holds(&self, _: ExpertId) -> bool {
            false
        }
        fn load(&self, _: &[ExpertId], _: Priority, _: Completion) {
            unreachable!("holds nothing")
        }
        fn retried_failures(&self) -> u64 {
            self.retried
        }
    }

    /// `--json` and `--stats` report the same peer failures and fallbacks, failures that
    /// another peer made up for included (both once said 0).
    #[test]
    fn json_and_stats_count_peer_failures_another_peer_made_up_for() {
        let t = Arc::new(TieredExperts::new(
            vec![Arc::new(Peers { retried: 2 })],
            vec![vec![64; 4]],
            1,
            &TierConfig::default(),
        ));
        let e = Experts {
            provider: t.clone(),
            tiered: Some(t),
            usage_path: None,
        };
        let j = e.json((0, 0));
        assert_eq!(j["peer_failures"], 2, "{j}");
        assert_eq!(j["fallbacks"], 2, "{j}");
        let table = e.table((0, 0));
        let peer = table
            .lines()
            .find(|l| l.trim_start().starts_with("peer"))
            .unwrap_or_else(|| panic!("no peer row: {table}"));
        assert!(peer.trim_end().ends_with("2 failures"), "{table}");
        assert!(table.contains("; 2 fallbacks"), "{table}");
    }
}
