//! Expert tiers: a RAM cache with a byte budget over the local disk, and below the disk any
//! other [`Tier`] (the network, in the node crate) that the engine knows only through the trait.
//!
//! - [`TieredExperts`] is an [`ExpertProvider`](crate::moe::ExpertProvider): it serves hits from RAM and sends misses to the
//!   first lower tier that holds the expert, falling back to the next on failure. `fetch`
//!   blocks until a whole request is in RAM; `fetch_each` hands each expert over as it lands
//!   (hits at once) and loads the experts the caller names as next while it computes; prefetch
//!   hints start loads that land in the cache while the model computes. The cache keeps within its budget by evicting the least recently used expert that
//!   no computation is holding; hot experts (by persisted usage counts) are preloaded and evicted
//!   last.
//! - [`DiskTier`] reads an expert by its byte ranges with positioned reads into an owned buffer
//!   (not demand-paged mmap, so the budget is real), from the original checkpoint or from a flat
//!   store written by [`store::convert`] (one 4 KiB-aligned record per expert, O_DIRECT).
//!
//! Placement decides only speed: every tier hands the engine the same bytes, and the kernels do
//! not care where the bytes live.

pub mod cache;
pub mod disk;
pub mod store;
pub mod usage;

use std::fmt;
use std::sync::Arc;

use crate::error::Result;
use crate::moe::ExpertData;

pub use cache::{ExpertStats, TierConfig, TierStats, TieredExperts};
pub use disk::DiskTier;

/// One expert of a model: the id every crate uses (the manifests and the wire too).
pub use stormo_ids::ExpertId;

/// How urgently a load is wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// The model is waiting for it.
    Demand,
    /// A prediction; may be dropped or served late.
    Prefetch,
}

/// Called once per requested key, from any thread, when its load ends.
pub type Completion = Arc<dyn Fn(ExpertId, Result<Arc<ExpertData>>) + Send + Sync>;

/// A source of experts below the RAM cache: the local disk, or peers.
///
/// `load` must return quickly: it starts the loads (on its own threads or runtime) and reports
/// each through `done`, exactly once per key, in any order. It receives a whole layer's misses
/// at once so that it can work on them in parallel. A tier that verifies (the network) must
/// only ever complete with bytes it has checked.
pub trait Tier: Send + Sync + fmt::Debug {
    /// A short name for statistics and logs ("disk", "peer").
    fn name(&self) -> &str;
    /// Whether this tier can supply `key` at all (it may still fail).
    fn holds(&self, key: ExpertId) -> bool;
    /// Starts loading `keys`.
    fn load(&self, keys: &[ExpertId], priority: Priority, done: Completion);
    /// Why this tier does not hold `key` although it might have (a source it held it at was
    /// dropped, say), for the error of a load that no tier can supply; `None` when there is
    /// nothing worth telling.
    fn why_not(&self, _key: ExpertId) -> Option<String> {
        None
    }
    /// Failures so far that this tier followed with another try of its own (a tier with
    /// several sources, such as the network tier trying peer after peer): its completions do
    /// not show them, since a load that one source failed and another supplied completes with
    /// the data, and a load that failed everywhere completes with one error (its last
    /// failure, which is not counted here). [`TieredExperts`] counts each as a failure of this
    /// tier and a fallback. A tier with one source per load has none.
    fn retried_failures(&self) -> u64 {
        0
    }
}
