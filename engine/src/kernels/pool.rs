//! The kernels' parallel loop: `f(0) .. f(n - 1)` split among the calling thread and helper
//! threads that spin between loops.
//!
//! A decoded token of GPT-OSS opens about 120 parallel regions, each a millisecond or less,
//! with a few microseconds of serial work between them. The rayon pool puts an idle worker to
//! sleep within microseconds, so nearly every region waited for a futex wake-up: measured on
//! a 2-core Xeon VM at gpt-oss-20b geometry, the second thread started a matrix product's
//! region 36 µs after it opened and an attention region 66 µs after (of 150). Here the
//! helpers spin for [`SPIN`] (or `STORMO_SPIN_MS`) after each loop before they park, so the
//! next region starts on every core at once.
//!
//! Results never depend on which thread runs an index (every caller's indices are
//! independent), so a loop runs on the calling thread alone when the pool is busy with another
//! caller's loop, when it is called from inside a loop, or when the rayon pool it stands
//! beside has one thread.
//!
//! The protocol: one atomic word holds the loop's epoch, its index count and the next index;
//! a thread claims an index with a compare-and-swap that also checks the epoch, so a claim is
//! only ever of the current loop. The caller writes the loop's closure before it publishes the
//! epoch and rewrites it only after every claimed index of the previous loop has finished, so
//! whoever holds a claim reads a closure that is whole and alive.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use super::{Isa, FORCED};

/// How long a helper spins after a loop before it parks, unless `STORMO_SPIN_MS` says
/// otherwise (0: park at once, for a machine whose other work needs the cores more than
/// decode needs the microseconds).
const SPIN: Duration = Duration::from_millis(5);

/// [`SPIN`], or `STORMO_SPIN_MS` milliseconds (a whole number; anything else is ignored with a
/// warning).
fn spin_from_env() -> Duration {
    match std::env::var("STORMO_SPIN_MS") {
        Err(_) => SPIN,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) => Duration::from_millis(ms),
            Err(_) => {
                tracing::warn!(
                    "STORMO_SPIN_MS={v:?} is not a whole number of milliseconds; spinning {} ms",
                    SPIN.as_millis()
                );
                SPIN
            }
        },
    }
}

/// Bits of the state word for the index count and for the next index.
const TASK_BITS: u32 = 20;
/// Largest index count one loop on the pool takes (larger ones run as several loops).
const MAX_TASKS: usize = (1 << TASK_BITS) - 1;
const TASK_MASK: u64 = (1 << TASK_BITS) - 1;
/// The epoch: the bits above the count and the index.
const EPOCH_SHIFT: u32 = 2 * TASK_BITS;
const EPOCH_MASK: u64 = (1 << (64 - EPOCH_SHIFT)) - 1;

fn epoch_of(s: u64) -> u64 {
    s >> EPOCH_SHIFT
}

/// The current loop: its closure (lifetime erased: see the module's protocol) and the
/// caller's forced kernel ISA, which the helpers take on while they run it.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    isa: Option<Isa>,
}

struct Shared {
    /// Epoch, index count, next index.
    state: AtomicU64,
    /// Written only by the caller holding `caller`, while no index is claimed.
    job: UnsafeCell<Job>,
    /// Indices of the current loop finished.
    done: AtomicUsize,
    /// The first panic of the current loop's indices, re-raised in the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    /// Set by [`park_helpers`]: spinning helpers park at once; cleared by the next loop.
    park_now: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
    /// How long helpers spin after a loop.
    spin: Duration,
}

// SAFETY: `job` is written and read only as the protocol allows (module docs); its closure is
// `Sync`, so calling it from several threads is sound.
unsafe impl Sync for Shared {}
// SAFETY: as above.
unsafe impl Send for Shared {}

struct Pool {
    shared: &'static Shared,
    helpers: usize,
    /// Held by the caller whose loop the pool runs.
    caller: Mutex<()>,
}

thread_local! {
    /// True while this thread runs an index of a loop (a loop inside runs here alone).
    static IN_LOOP: Cell<bool> = const { Cell::new(false) };
}

/// The pool, started on first use with one helper fewer than the rayon pool's threads (the
/// caller is the last).
static POOL: OnceLock<Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: &(|_| {}) as &(dyn Fn(usize) + Sync),
                isa: None,
            }),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            park_now: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
            spin: spin_from_env(),
        }));
        let mut helpers = 0;
        for i in 1..rayon::current_num_threads() {
            let spawned = std::thread::Builder::new()
                .name(format!("stormo-kernels-{i}"))
                .spawn(move || helper(shared));
            match spawned {
                Ok(_) => helpers += 1,
                Err(e) => {
                    tracing::warn!("kernel helper thread {i} not started ({e}); fewer threads");
                    break;
                }
            }
        }
        Pool {
            shared,
            helpers,
            caller: Mutex::new(()),
        }
    })
}

/// Calls `f(i)` for every `i < n`, each exactly once, on this thread and the pool's helpers;
/// returns when all have returned. A panic in any call is re-raised here (after every call
/// has finished).
pub(crate) fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    run_loop(n, &f);
}

/// [`for_each_index`] on this thread alone, with the same promise: every call is made, and
/// the first panic is re-raised after the last (a loop that stopped at the panic broke it
/// whenever another caller held the pool, which a test running beside others saw under QEMU).
fn run_inline(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let mut first = None;
    for i in 0..n {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
            match first {
                None => first = Some(p),
                // As in `run_claimed`: a later payload's `Drop` may not unwind from here.
                Some(_) => drop(catch_unwind(AssertUnwindSafe(move || drop(p)))),
            }
        }
    }
    if let Some(p) = first {
        resume_unwind(p);
    }
}

/// [`for_each_index`], not generic.
fn run_loop(n: usize, f: &(dyn Fn(usize) + Sync)) {
    if n <= 1 || IN_LOOP.with(Cell::get) || rayon::current_num_threads() <= 1 {
        return run_inline(n, f);
    }
    if n > MAX_TASKS {
        // In loops of at most MAX_TASKS indices (none so large runs on the decode path).
        for base in (0..n).step_by(MAX_TASKS) {
            run_loop(MAX_TASKS.min(n - base), &|i| f(base + i));
        }
        return;
    }
    let pool = pool();
    if pool.helpers == 0 {
        return run_inline(n, f);
    }
    let _caller = match pool.caller.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return run_inline(n, f),
    };
    let sh = pool.shared;
    // SAFETY: erases the closure's lifetime; it is called only for claimed indices of this
    // loop, and this function returns only once every one has finished.
    let f: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
    // SAFETY: no index is claimed: the previous loop's all finished before its caller (which
    // held `caller`, as this one does now) returned, and this loop's epoch is not out yet.
    unsafe {
        *sh.job.get() = Job {
            f,
            isa: FORCED.with(Cell::get),
        };
    }
    sh.done.store(0, Ordering::Relaxed);
    sh.park_now.store(false, Ordering::Relaxed);
    let epoch = (epoch_of(sh.state.load(Ordering::Relaxed)) + 1) & EPOCH_MASK;
    sh.state.store(
        (epoch << EPOCH_SHIFT) | ((n as u64) << TASK_BITS),
        Ordering::SeqCst,
    );
    if sh.sleepers.load(Ordering::SeqCst) > 0 {
        let _g = lock(&sh.park);
        sh.wake.notify_all();
    }
    run_claimed(sh, epoch);
    let mut spins = 0u32;
    while sh.done.load(Ordering::Acquire) < n {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            // a helper holding an index may have lost its core: let it have this one
            std::thread::yield_now();
        }
        std::hint::spin_loop();
    }
    if let Some(p) = lock(&sh.panic).take() {
        resume_unwind(p);
    }
}

/// Makes the helpers park now rather than spin on after the last loop, and waits (up to a
/// second) until they have: for measuring something else on every core (a memory probe)
/// right after kernels ran, which spinning helpers would otherwise share the cores with.
pub fn park_helpers() {
    let Some(pool) = POOL.get() else {
        return;
    };
    let sh = pool.shared;
    sh.park_now.store(true, Ordering::Relaxed);
    let start = Instant::now();
    while sh.sleepers.load(Ordering::SeqCst) < pool.helpers
        && start.elapsed() < Duration::from_secs(1)
    {
        std::thread::yield_now();
    }
}

/// Locks `m`, taking over a poisoned lock (what it guards stays valid: a panic is caught
/// before it could leave anything half done).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Claims the next index of loop `epoch`, if it has one left.
fn claim(state: &AtomicU64, epoch: u64) -> Option<usize> {
    let mut s = state.load(Ordering::Acquire);
    loop {
        let (n, next) = ((s >> TASK_BITS) & TASK_MASK, s & TASK_MASK);
        if epoch_of(s) != epoch || next >= n {
            return None;
        }
        match state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(next as usize),
            Err(now) => s = now,
        }
    }
}

/// Runs indices of loop `epoch` on this thread while any are left to claim.
fn run_claimed(sh: &Shared, epoch: u64) {
    while let Some(i) = claim(&sh.state, epoch) {
        // SAFETY: index `i` of this loop is claimed, so the job is this loop's, whole, and
        // its closure alive until the caller has seen it finish (`done`).
        let job = unsafe { *sh.job.get() };
        let outer = (
            IN_LOOP.with(|c| c.replace(true)),
            FORCED.with(|c| c.replace(job.isa)),
        );
        // SAFETY: as above.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.f)(i) }));
        IN_LOOP.with(|c| c.set(outer.0));
        FORCED.with(|c| c.set(outer.1));
        if let Err(p) = r {
            let mut first = lock(&sh.panic);
            if first.is_none() {
                *first = Some(p);
            } else {
                drop(first);
                // A later payload is dropped here, where a panic in its `Drop` cannot skip
                // the count below (the caller would wait forever, or return early).
                let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
            }
        }
        sh.done.fetch_add(1, Ordering::Release);
    }
}

/// A helper thread: waits for each new loop (spinning, then parked), helps run it.
fn helper(sh: &'static Shared) {
    let mut seen = epoch_of(sh.state.load(Ordering::Acquire));
    loop {
        let s = wait_for_new(sh, seen);
        seen = epoch_of(s);
        run_claimed(sh, seen);
    }
}

/// The state once its epoch differs from `seen`: spins for `sh.spin` (yielding the core now
/// and then, should another thread want it), then parks until a caller wakes it.
fn wait_for_new(sh: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let s = sh.state.load(Ordering::Acquire);
        if epoch_of(s) != seen {
            return s;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            if start.elapsed() > sh.spin || sh.park_now.load(Ordering::Relaxed) {
                break;
            }
            std::thread::yield_now();
        }
        std::hint::spin_loop();
    }
    let mut g = lock(&sh.park);
    sh.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        let s = sh.state.load(Ordering::SeqCst);
        if epoch_of(s) != seen {
            sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            return s;
        }
        g = sh.wake.wait(g).unwrap_or_else(|p| p.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every index runs exactly once, for loops of every size, many times over (epochs that
    /// follow each other closely, helpers spinning and parked) and from several callers at
    /// once (one gets the pool, the others run alone).
    #[test]
    fn every_index_runs_exactly_once() {
        std::thread::scope(|s| {
            for caller in 0..3 {
                s.spawn(move || {
                    for round in 0..300 {
                        let n = match (round + caller) % 8 {
                            7 if round < 8 => MAX_TASKS + 5,
                            k => [0, 1, 2, 3, 17, 64, 1000, 99][k],
                        };
                        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                        for_each_index(n, |i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                        if round % 100 == 99 {
                            // let the helpers park
                            std::thread::sleep(SPIN * 2);
                        }
                    }
                });
            }
        });
    }

    /// The same on a caller left to run its loop alone, the pool being busy with another:
    /// every index still runs before the panic reaches the caller.
    #[test]
    fn a_panic_on_a_caller_running_alone_comes_after_every_index() {
        let _busy = pool()
            .caller
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let ran = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each_index(64, |i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 40 && i != 50, "index {i} fails");
            })
        }));
        let msg = r.expect_err("the panic reaches the caller");
        assert_eq!(
            msg.downcast_ref::<String>().map(String::as_str),
            Some("index 40 fails")
        );
        assert_eq!(ran.load(Ordering::Relaxed), 64);
    }

    /// A panic in one index reaches the caller after the others have run, and the pool
    /// still works afterwards.
    #[test]
    fn a_panic_reaches_the_caller_and_the_pool_survives() {
        let ran = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each_index(64, |i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 40, "index 40 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Ordering::Relaxed), 64);
        let sum = AtomicUsize::new(0);
        for_each_index(100, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    /// `park_helpers` returns with every helper parked (a caller still holding the pool
    /// would keep them busy, so the test holds it), and the next loop wakes them.
    #[test]
    fn helpers_park_on_request_and_wake_for_the_next_loop() {
        for_each_index(4, |_| {});
        let pool = pool();
        {
            let _only_caller = lock(&pool.caller);
            park_helpers();
            assert_eq!(pool.shared.sleepers.load(Ordering::SeqCst), pool.helpers);
        }
        let sum = AtomicUsize::new(0);
        for_each_index(10, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    /// A loop inside a loop runs, on the thread that opened it; every index sees the caller's
    /// forced ISA.
    #[test]
    fn nested_loops_and_the_forced_isa() {
        let count = AtomicUsize::new(0);
        let isas = Mutex::new(Vec::new());
        super::super::with_isa(Isa::Scalar, || {
            for_each_index(8, |_| {
                lock(&isas).push(Isa::active());
                for_each_index(8, |_| {
                    count.fetch_add(1, Ordering::Relaxed);
                });
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
        let isas = isas.into_inner().unwrap();
        assert_eq!(isas.len(), 8);
        assert!(isas.iter().all(|&t| t == Isa::Scalar));
    }
}
