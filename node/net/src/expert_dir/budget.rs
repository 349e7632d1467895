//! How many bytes of kept experts a node may hold: `--expert-dir-limit SIZE`, or by default a
//! budget that follows the disk.
//!
//! The default ([`KeepLimit::Auto`]) is half the space that is free or already held by the
//! store on the store's filesystem, never more than all of the model's experts:
//! `min(experts, (free + held) / 2)`. Counting what the store holds keeps the budget still
//! while the store itself grows or shrinks (each byte it writes is one byte less free), so it
//! moves only when something else fills or frees the disk. It is computed again before every
//! write, so a disk that others fill makes the store give room back (least recently used
//! records first). Whatever the limit, a write that would leave the filesystem with less than
//! [`RESERVE`] free is not made: the disk is full, the store says so once and stops growing,
//! and serving goes on from what it holds.
//!
//! Free space is read with `statvfs` (`f_bavail * f_frsize`: the blocks an unprivileged writer
//! may use) through `rustix`, a safe wrapper over the system calls kept by the Bytecode
//! Alliance and already in the build through `tempfile`: the node crates forbid `unsafe`, so
//! `libc` directly is out, and `fs2`/`fs4` would add a crate that does the same through the
//! same calls (`fs2` is no longer maintained). Only on Unix; elsewhere the free space is
//! unknown and the budget is [`UNKNOWN_FREE_LIMIT`] (at most the model's experts).
//!
//! Non-goals: quotas, and space shared with other processes writing the same disk at the same
//! moment (the budget is re-read before each write, not reserved).

use std::path::Path;
use std::sync::Arc;

use crate::progress::human_bytes;

/// The most the store may hold for one model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeepLimit {
    /// Half the free disk (counting what the store holds), at most the model's experts.
    #[default]
    Auto,
    /// This many bytes (`--expert-dir-limit SIZE`).
    Bytes(u64),
}

impl From<u64> for KeepLimit {
    fn from(b: u64) -> Self {
        Self::Bytes(b)
    }
}

/// The budget when the free space cannot be read.
pub const UNKNOWN_FREE_LIMIT: u64 = 16 << 30;

/// What is left free on the disk: a write that would leave less is not made.
pub const RESERVE: u64 = 64 << 20;

/// Reads the space free at a path (`None`: unknown). Injected in tests.
pub type FreeSpace = Arc<dyn Fn(&Path) -> Option<u64> + Send + Sync>;

/// The free space of the filesystem holding `path`, as an unprivileged writer may use it
/// (the nearest existing ancestor's, for a folder not yet created).
pub fn free_space(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    free_space_of(existing)
}

#[cfg(unix)]
fn free_space_of(path: &Path) -> Option<u64> {
    let s = rustix::fs::statvfs(path).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}

#[cfg(not(unix))]
fn free_space_of(_path: &Path) -> Option<u64> {
    None
}

/// The system's free space reader.
pub fn system_free_space() -> FreeSpace {
    Arc::new(free_space)
}

/// Why the limit is what it is, for the line a node prints at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// `--expert-dir-limit` gave it.
    Given,
    /// Half the free disk.
    HalfFree,
    /// The model's experts all fit in half the free disk.
    AllExperts,
    /// The free space is unknown: [`UNKNOWN_FREE_LIMIT`].
    Unknown,
}

/// The limit `limit` gives when `free` bytes are free (`None`: unknown), the store holds
/// `held`, and the model's experts are `experts` bytes, with why.
pub fn effective(limit: KeepLimit, free: Option<u64>, held: u64, experts: u64) -> (u64, Reason) {
    match (limit, free) {
        (KeepLimit::Bytes(b), _) => (b, Reason::Given),
        (KeepLimit::Auto, None) => (UNKNOWN_FREE_LIMIT.min(experts), Reason::Unknown),
        (KeepLimit::Auto, Some(f)) => {
            let half = f.saturating_add(held) / 2;
            if half >= experts {
                (experts, Reason::AllExperts)
            } else {
                (half, Reason::HalfFree)
            }
        }
    }
}

/// Whether a record of `len` bytes may be written with `free` bytes free: it must leave
/// [`RESERVE`]. An unknown free space never stops a write (the write itself may still fail).
pub fn room_for(len: u64, free: Option<u64>) -> bool {
    free.is_none_or(|f| len.checked_add(RESERVE).is_some_and(|need| f >= need))
}

/// The line a node prints at start: "keeping up to 12.3 GiB of experts in DIR (half the
/// free disk)".
pub fn describe(limit: u64, reason: Reason, dir: &Path) -> String {
    let why = match reason {
        Reason::Given => "--expert-dir-limit".to_string(),
        Reason::HalfFree => "half the free disk".to_string(),
        Reason::AllExperts => "all of the model's experts, within half the free disk".to_string(),
        Reason::Unknown => "the free disk could not be read".to_string(),
    };
    format!(
        "keeping up to {} of experts in {} ({why})",
        human_bytes(limit),
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// The default is half of what is free or already held, never more than the model's
    /// experts; a given limit is taken as it is; an unknown free space gives the fallback.
    #[test]
    fn the_default_budget_follows_the_free_disk() {
        let auto = KeepLimit::Auto;
        // 100 GiB free, nothing held, a 60 GiB model: 50 GiB.
        assert_eq!(
            effective(auto, Some(100 * GIB), 0, 60 * GIB),
            (50 * GIB, Reason::HalfFree)
        );
        // A small model fits whole.
        assert_eq!(
            effective(auto, Some(100 * GIB), 0, 10 * GIB),
            (10 * GIB, Reason::AllExperts)
        );
        // What the store holds counts as room: writing 20 GiB (20 less free) keeps it still.
        assert_eq!(
            effective(auto, Some(80 * GIB), 20 * GIB, 60 * GIB),
            (50 * GIB, Reason::HalfFree)
        );
        // Another process filling the disk shrinks it.
        assert_eq!(
            effective(auto, Some(10 * GIB), 20 * GIB, 60 * GIB),
            (15 * GIB, Reason::HalfFree)
        );
        // A full disk with nothing held: nothing.
        assert_eq!(effective(auto, Some(0), 0, 60 * GIB), (0, Reason::HalfFree));
        // Unknown free space: the fallback, at most the model.
        assert_eq!(
            effective(auto, None, 0, 60 * GIB),
            (UNKNOWN_FREE_LIMIT, Reason::Unknown)
        );
        assert_eq!(effective(auto, None, 0, GIB), (GIB, Reason::Unknown));
        // Given: as it is, whatever the disk (the full-disk check still applies).
        assert_eq!(
            effective(KeepLimit::Bytes(100 << 20), Some(GIB), 0, 60 * GIB),
            (100 << 20, Reason::Given)
        );
        assert_eq!(
            effective(KeepLimit::Bytes(u64::MAX), Some(u64::MAX), u64::MAX, 1),
            (u64::MAX, Reason::Given)
        );
        // No overflow at the extremes.
        assert_eq!(
            effective(auto, Some(u64::MAX), u64::MAX, u64::MAX).0,
            u64::MAX / 2
        );
    }

    #[test]
    fn a_write_leaves_the_reserve_free() {
        assert!(room_for(GIB, Some(GIB + RESERVE)));
        assert!(!room_for(GIB, Some(GIB + RESERVE - 1)));
        assert!(!room_for(1, Some(0)));
        assert!(room_for(u64::MAX, None));
        assert!(!room_for(u64::MAX, Some(u64::MAX)));
    }

    #[test]
    fn the_start_line_is_in_human_units() {
        let dir = Path::new("/state/experts");
        assert_eq!(
            describe(12 * GIB + 3 * GIB / 10, Reason::HalfFree, dir),
            "keeping up to 12.3 GiB of experts in /state/experts (half the free disk)"
        );
        assert_eq!(
            describe(100 << 20, Reason::Given, dir),
            "keeping up to 100.0 MiB of experts in /state/experts (--expert-dir-limit)"
        );
    }

    /// The real reader answers for a temporary folder, and for one not yet created (its
    /// nearest existing ancestor's filesystem).
    #[cfg(unix)]
    #[test]
    fn free_space_is_read_from_the_nearest_existing_folder() {
        let t = tempfile::tempdir().expect("tempdir");
        let here = free_space(t.path()).expect("free space of a temporary folder");
        assert!(here > 0);
        assert!(free_space(&t.path().join("not/yet/made")).is_some());
    }
}
