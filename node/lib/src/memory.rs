//! The machine's memory plan: the RAM available, read once per command, and how it is
//! divided between the HTTP API's KV caches and the expert cache.
//!
//! Owns the one reading of `MemAvailable` (/proc/meminfo) and the arithmetic of both shares:
//! how many requests run together when `--parallel` is not given ([`MemoryPlan::parallel`])
//! and the expert cache's budget under `--expert-cache auto` ([`MemoryPlan::cache_budget`]).
//! A command reads one plan ([`MemoryPlan::read`]) as it resolves its arguments and hands the
//! same plan to both, so they divide one reading rather than each reading the machine again
//! a moment later. Both shares are pure functions of the reading and their inputs
//! ([`MemoryPlan::new`] makes a plan from any reading, for tests).
//!
//! Non-goals: following memory while the node runs (the plan is fixed at start), and cgroup
//! limits (`MemAvailable` is the host's or the container's view, whichever /proc shows).

use stormo_engine::ModelConfig;

use crate::config::CacheBudget;

/// The RAM assumed when `MemAvailable` cannot be read (no /proc/meminfo: not Linux).
pub const ASSUMED_AVAILABLE: u64 = 8 << 30;

/// The smallest reserve left to the system by an automatic expert cache budget.
pub const MIN_RESERVE: u64 = 1 << 30;

/// One reading of the machine's available RAM, and the shares derived from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// `MemAvailable` in bytes at the reading; `None` when it could not be read.
    available: Option<u64>,
}

impl MemoryPlan {
    /// Reads `MemAvailable` of /proc/meminfo, once.
    pub fn read() -> Self {
        Self::new(mem_available())
    }

    /// The plan for a reading of `available` bytes (`None`: unknown, [`ASSUMED_AVAILABLE`]
    /// assumed).
    pub fn new(available: Option<u64>) -> Self {
        Self { available }
    }

    /// The reading: bytes available, if known.
    pub fn available(&self) -> Option<u64> {
        self.available
    }

    /// How many requests run together when `--parallel` is not given, each with a KV cache
    /// of `slot_bytes` ([`kv_cache_bytes`]): as many as a quarter of the available RAM holds,
    /// 1 to 4 ([`crate::http::default_parallel`]).
    pub fn parallel(&self, slot_bytes: u64) -> usize {
        crate::http::default_parallel(slot_bytes, self.available)
    }

    /// What the system keeps beside a node under an automatic budget: a tenth of the
    /// available RAM, at least [`MIN_RESERVE`].
    pub fn reserve(&self) -> u64 {
        (self.available_or_assumed() / 10).max(MIN_RESERVE)
    }

    /// The expert cache's budget under `--expert-cache auto`: the available RAM less the
    /// dense weights (`dense` bytes), the KV caches (`kv` bytes, every request's together)
    /// and [`Self::reserve`]; 0 when they take it all.
    pub fn cache_budget(&self, dense: u64, kv: u64) -> u64 {
        self.available_or_assumed()
            .saturating_sub(dense + kv + self.reserve())
    }

    /// The expert cache's budget under `cache`: [`Self::cache_budget`] for
    /// [`CacheBudget::Auto`], the bytes given otherwise.
    pub fn expert_cache(&self, cache: CacheBudget, dense: u64, kv: u64) -> u64 {
        match cache {
            CacheBudget::Auto => self.cache_budget(dense, kv),
            CacheBudget::Bytes(b) => b,
        }
    }

    fn available_or_assumed(&self) -> u64 {
        self.available.unwrap_or(ASSUMED_AVAILABLE)
    }
}

/// Bytes of an f32 KV cache of `context` positions for a model of `cfg` (an upper bound: no
/// sliding-window savings).
pub fn kv_cache_bytes(cfg: &ModelConfig, context: usize) -> u64 {
    (cfg.num_layers * 2 * cfg.kv_dim() * 4) as u64 * context as u64
}

/// The RAM available (`MemAvailable` of /proc/meminfo), if known. Read only by
/// [`MemoryPlan::read`].
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

/// `MemAvailable` in bytes from the text of /proc/meminfo.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// The automatic budget is what is left after the dense weights, the KV caches and a
    /// reserve of a tenth (at least 1 GiB); never below 0; 8 GiB assumed when unknown.
    #[test]
    fn the_cache_budget_is_the_rest_after_dense_kv_and_the_reserve() {
        let plan = MemoryPlan::new(Some(20 * GIB));
        assert_eq!(plan.reserve(), 2 * GIB);
        assert_eq!(plan.cache_budget(3 * GIB, GIB), 14 * GIB);
        assert_eq!(plan.cache_budget(0, 0), 18 * GIB);
        // A small machine keeps the 1 GiB floor.
        let small = MemoryPlan::new(Some(4 * GIB));
        assert_eq!(small.reserve(), GIB);
        assert_eq!(small.cache_budget(GIB, GIB / 2), GIB + GIB / 2);
        // More than there is: nothing for the cache, no underflow.
        assert_eq!(small.cache_budget(4 * GIB, GIB), 0);
        assert_eq!(MemoryPlan::new(Some(0)).cache_budget(0, 0), 0);
        // Unknown: 8 GiB assumed, whose tenth is below the 1 GiB floor.
        let unknown = MemoryPlan::new(None);
        assert_eq!(unknown.reserve(), MIN_RESERVE);
        assert_eq!(unknown.cache_budget(GIB, GIB), 5 * GIB);
        assert_eq!(unknown.cache_budget(0, 0), ASSUMED_AVAILABLE - MIN_RESERVE);
    }

    /// `--expert-cache SIZE` is taken as given, whatever the reading; `auto` is the plan's.
    #[test]
    fn a_given_cache_size_ignores_the_reading() {
        let plan = MemoryPlan::new(Some(20 * GIB));
        assert_eq!(
            plan.expert_cache(CacheBudget::Bytes(123), 3 * GIB, GIB),
            123
        );
        assert_eq!(
            MemoryPlan::new(Some(0)).expert_cache(CacheBudget::Bytes(64 * GIB), 0, 0),
            64 * GIB
        );
        assert_eq!(
            plan.expert_cache(CacheBudget::Auto, 3 * GIB, GIB),
            plan.cache_budget(3 * GIB, GIB)
        );
    }

    /// The `--parallel` default comes from the same reading: as many KV caches as a quarter of
    /// it holds, 1 to 4.
    #[test]
    fn the_parallel_default_divides_the_same_reading() {
        assert_eq!(MemoryPlan::new(Some(16 * GIB)).parallel(GIB), 4);
        assert_eq!(MemoryPlan::new(Some(8 * GIB)).parallel(GIB), 2);
        assert_eq!(MemoryPlan::new(Some(2 * GIB)).parallel(GIB), 1);
        assert_eq!(MemoryPlan::new(Some(64 * GIB)).parallel(GIB), 4);
        assert_eq!(MemoryPlan::new(Some(0)).parallel(GIB), 1);
        assert_eq!(MemoryPlan::new(None).parallel(0), 4);
        assert_eq!(MemoryPlan::new(None).parallel(GIB), 2);
        assert_eq!(MemoryPlan::new(None).parallel(3 * GIB), 1);
    }

    /// One plan gives both shares: the KV caches of the default `--parallel` (at most a
    /// quarter of the reading, or one cache) and, beside them, the dense weights and the
    /// reserve, the expert cache takes the rest of the same reading.
    #[test]
    fn both_shares_divide_one_reading() {
        let (dense, slot) = (GIB / 2, GIB / 4);
        for (avail, parallel) in [(2 * GIB, 2), (6 * GIB, 4), (100 * GIB, 4)] {
            let plan = MemoryPlan::new(Some(avail));
            assert_eq!(plan.parallel(slot), parallel, "{avail}");
            let kv = slot * parallel as u64;
            assert!(kv <= avail / 4, "{avail}");
            let cache = plan.cache_budget(dense, kv);
            assert_eq!(dense + kv + plan.reserve() + cache, avail, "{avail}");
        }
    }

    /// A KV cache holds a key and a value of `kv_dim` f32s per layer and position.
    #[test]
    fn kv_cache_bytes_count_keys_and_values_in_f32() {
        let text = stormo_engine::config::GPT_OSS_20B_CONFIG;
        let cfg = ModelConfig::from_json_str(text, std::path::Path::new("config.json"))
            .expect("a gpt-oss config");
        // 24 layers x (key + value) x 8 heads x 64 x 4 bytes = 96 KiB a position.
        assert_eq!(kv_cache_bytes(&cfg, 1), 96 << 10);
        assert_eq!(kv_cache_bytes(&cfg, 4096), 384 << 20);
        assert_eq!(kv_cache_bytes(&cfg, 0), 0);
    }

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let text = "MemTotal:       32653604 kB\nMemFree:         1015428 kB\n\
                    MemAvailable:   20971520 kB\nBuffers:          123456 kB\n";
        assert_eq!(parse_mem_available(text), Some(20 * GIB));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
    }
}
