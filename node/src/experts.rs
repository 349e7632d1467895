//! Where a node's experts come from: the options shared by every command that runs a model,
//! and the provider built from them (mapped files, or the RAM cache over disk and peers).

use std::path::PathBuf;
use std::sync::Arc;

use stormo_engine::moe::ExpertProvider;
use stormo_engine::tiers::{usage, ExpertStats, Tier, TierConfig, TieredExperts};
use stormo_engine::ModelFiles;

use crate::progress::{human_bytes, parse_size};

/// Options for experts and their tiers.
#[derive(Debug, Clone, clap::Args)]
pub struct ExpertArgs {
    /// RAM budget for cached experts: a size such as 0, 512MiB, 6GiB, or "auto" (the RAM
    /// available, less the dense weights, the KV cache and a reserve for the system). Never less
    /// than one layer's top-k experts, never more than all of them.
    #[arg(long, default_value = "auto", value_name = "SIZE", value_parser = cache_size)]
    pub expert_cache: String,
    /// Prefetch the next layer's predicted experts into the cache while the current layer
    /// computes. Off by default: measured at gpt-oss-20b geometry with budgets below the
    /// experts, it read 38-58% more from disk per decoded token and decoded 7-17% slower
    /// (README, Performance).
    #[arg(long, conflicts_with = "no_prefetch")]
    pub prefetch: bool,
    /// Do not prefetch (the default; kept so scripts that say so keep working).
    #[arg(long, hide = true)]
    pub no_prefetch: bool,
    /// Serve experts from memory-mapped checkpoint files instead of the budgeted cache (the OS
    /// pages them in and out; no budget, no statistics).
    #[arg(long, conflicts_with_all = ["expert_cache", "prefetch"])]
    pub mmap_experts: bool,
    /// Threads reading experts from disk (queue depth), 1 to 256.
    #[arg(long, default_value_t = 4, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub io_threads: usize,
    /// Neither preload the most used experts at start nor record usage counts.
    #[arg(long)]
    pub no_hot_store: bool,
}

/// `--expert-cache` as given, if it is "auto" or a size [`parse_size`] reads: checked when the
/// arguments are parsed, so a bad value is reported before any work starts.
fn cache_size(s: &str) -> Result<String, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(s.to_owned());
    }
    crate::progress::size_arg(s)
}

/// The provider built from [`ExpertArgs`], with what is needed to report on it.
#[derive(Debug)]
pub struct Experts {
    /// For the model.
    pub provider: Arc<dyn ExpertProvider>,
    /// The cache, when tiered.
    pub tiered: Option<Arc<TieredExperts>>,
    usage_path: Option<PathBuf>,
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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

/// Bytes of an f32 KV cache for `context` positions (upper bound: no sliding-window savings).
pub fn kv_bytes(files: &ModelFiles, context: usize) -> u64 {
    let c = &files.cfg;
    (c.num_layers * 2 * c.kv_dim() * 4 * context) as u64
}

impl Experts {
    /// Builds the provider for `files` with room for a `context`-position KV cache. `lower`
    /// are tiers below the disk (peers); `local_disk` false leaves the disk out (a node with no
    /// local experts); `allowed` restricts which local experts are used.
    pub fn build(
        files: &ModelFiles,
        args: &ExpertArgs,
        context: usize,
        lower: Vec<Arc<dyn Tier>>,
        local_disk: bool,
        allowed: Option<Vec<Vec<bool>>>,
    ) -> anyhow::Result<Self> {
        let uses_local = local_disk
            && allowed
                .as_ref()
                .is_none_or(|a| a.iter().flatten().any(|&on| on));
        if uses_local && crate::net::pull::Pulled::dense_only(&files.dir)? {
            anyhow::bail!(
                "{} was pulled without its experts (see {}): its expert bytes are holes; run it with `stormo run --peer ...` so experts come from peers",
                files.dir.display(),
                crate::net::pull::MARKER_FILE
            );
        }
        if args.mmap_experts {
            anyhow::ensure!(lower.is_empty() && local_disk && allowed.is_none(), "--mmap-experts serves every local expert; it cannot be combined with peers or expert subsets");
            return Ok(Self {
                provider: Arc::new(files.mapped_experts()?),
                tiered: None,
                usage_path: None,
            });
        }
        let mut tiers: Vec<Arc<dyn Tier>> = Vec::new();
        if local_disk {
            tiers.push(Self::disk_tier(files, args, allowed)?);
        }
        tiers.extend(lower);
        Self::build_tiers(files, args, context, tiers)
    }

    /// The local disk tier of `files` with the options' I/O threads, restricted to `allowed`.
    pub fn disk_tier(
        files: &ModelFiles,
        args: &ExpertArgs,
        allowed: Option<Vec<Vec<bool>>>,
    ) -> anyhow::Result<Arc<dyn Tier>> {
        Ok(Arc::new(files.disk_tier(args.io_threads.max(1), allowed)?))
    }

    /// The RAM cache over `tiers`, tried in order.
    pub fn build_tiers(
        files: &ModelFiles,
        args: &ExpertArgs,
        context: usize,
        tiers: Vec<Arc<dyn Tier>>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !args.mmap_experts,
            "--mmap-experts serves every local expert; it cannot be combined with peers, an expert directory or expert subsets"
        );
        let sizes = files.layout.sizes();
        let all: u64 = sizes.iter().flatten().sum();
        let budget = if args.expert_cache.trim().eq_ignore_ascii_case("auto") {
            let avail = mem_available().unwrap_or(8 << 30);
            let reserve = (avail / 10).max(1 << 30);
            avail.saturating_sub(dense_bytes(files) + kv_bytes(files, context) + reserve)
        } else {
            parse_size(&args.expert_cache).map_err(|e| anyhow::anyhow!("--expert-cache: {e}"))?
        };
        let cfg = TierConfig {
            budget: budget.min(all),
            prefetch: args.prefetch && !args.no_prefetch,
            ..TierConfig::default()
        };
        let t = Arc::new(TieredExperts::new(
            tiers,
            sizes,
            files.cfg.top_k.max(1),
            &cfg,
        ));
        tracing::info!(
            "expert cache budget {} of {} in all",
            human_bytes(t.budget()),
            human_bytes(all)
        );
        let usage_path = (!args.no_hot_store).then(|| usage::usage_path(&files.dir));
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
            "  prefetch: {} used, {} wasted",
            s.prefetch_used, s.prefetch_wasted
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

#[cfg(test)]
mod tests {
    use super::*;
    use stormo_engine::tiers::{Completion, ExpertKey, Priority};

    /// A network tier that made up for `retried` failed tries with other peers.
    #[derive(Debug)]
    struct Peers {
        retried: u64,
    }

    impl Tier for Peers {
        fn name(&self) -> &str {
            "peer"
        }
        fn holds(&self, _: ExpertKey) -> bool {
            false
        }
        fn load(&self, _: &[ExpertKey], _: Priority, _: Completion) {
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
