//! Mapped checkpoint files that shrink under the process: an error for the step that read
//! them, never a SIGBUS that kills the node.
//!
//! Reading a page of a shared file mapping that lies past the file's end (another program
//! truncated the file) raises SIGBUS, whose default action ends the process; so does a page
//! the disk cannot read. The engine reads experts through the mapping with
//! `--mmap-experts`, and the output head and the norm vectors through it in every mode.
//!
//! Owns: a process-wide table of the checkpoint's mappings, and a SIGBUS handler that turns a
//! fault inside one of them into zeros and a mark. For a fault at an address in a registered
//! mapping, the handler maps anonymous zero pages (read-only, `MAP_FIXED`) over the mapping
//! from the faulting page to its end, records that offset as the mapping's `cut`, and returns:
//! the access runs again and reads zeros, on whichever thread of the kernel pool it was. Any
//! other SIGBUS goes to the handler that was there before (Rust's own, which tells a stack
//! overflow from other faults), or, if none, gets the default action back, so the process
//! dies of it as it would have without this module.
//!
//! The zeros never reach a client: whoever reads mapped bytes checks the range afterwards
//! ([`MappedFile::check`](super::MappedFile::check): the cut, and the file's length, since
//! bytes past the end of the file's last page read as zeros without any signal), and turns a
//! range that was cut into an error naming the file. The MoE checks each expert before it
//! hands its bytes to the kernels (the common case, a file truncated between steps, fails
//! there with the file's old and new lengths and no signal at all) and again after computing
//! it; the model checks its dense bytes after every step.
//!
//! Why this and not the alternatives:
//! - A `stat` before each access alone is racy: the file can shrink between the check and
//!   the kernels' reads (milliseconds for an expert), and then the process dies.
//! - `sigsetjmp`/`siglongjmp` around the reads cannot work here: the fault happens on a
//!   worker of the kernels' thread pool, not on the thread that would have set the jump
//!   point, and jumping over Rust frames skips their destructors (undefined behaviour in
//!   general).
//! - Copying every expert out with `pread` before use is safe but is what the disk tier
//!   already does; `--mmap-experts` exists to run from the page cache without that copy.
//!
//! The handler is async-signal-safe: it reads atomics, calls `mmap` and `sigaction` (system
//! calls), and keeps `errno`. A mapping whose bytes were zeroed stays so: every later range
//! in it fails its check until the process restarts (the file may be back, but the mapping
//! no longer shows it). Linux only; elsewhere nothing is registered and a fault stays fatal.
//!
//! Non-goals: recovering the bytes (a truncated file no longer has them); mappings other
//! than checkpoint files; more than [`MAX_MAPS`] mappings at once (the rest are unguarded,
//! as before, and say so at debug level).

use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};

/// The most mappings guarded at once (a model has one per checkpoint file; tests hold many
/// models in one process).
pub(crate) const MAX_MAPS: usize = 512;

/// A mapping's `cut` when none of it was replaced.
const INTACT: usize = usize::MAX;

/// One registered mapping. `seq` is odd while the slot describes a live mapping and changes
/// on every registration and release, so the handler can tell a consistent read of `start`
/// and `len` (a sequence lock; the handler never waits).
struct Slot {
    taken: AtomicBool,
    seq: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    /// Offset in the mapping from which its pages read zeros ([`INTACT`]: none).
    cut: AtomicUsize,
}

impl Slot {
    const fn new() -> Self {
        Self {
            taken: AtomicBool::new(false),
            seq: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            cut: AtomicUsize::new(INTACT),
        }
    }
}

static SLOTS: [Slot; MAX_MAPS] = [const { Slot::new() }; MAX_MAPS];

/// A mapping's place in the table, given back when dropped: it must drop before the mapping
/// is unmapped (it is declared before the map in [`MappedFile`](super::MappedFile)).
#[derive(Debug)]
pub(crate) struct Guard {
    slot: Option<usize>,
}

impl Guard {
    /// Guards the mapping `bytes` (the whole of a file mapping, as mapped).
    pub(crate) fn new(bytes: &[u8]) -> Self {
        if bytes.is_empty() || !handler::install() {
            return Self { slot: None };
        }
        let Some(i) = SLOTS.iter().position(|s| {
            s.taken
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        }) else {
            tracing::debug!(
                "{MAX_MAPS} mappings are guarded already: a file truncated under this one \
                 ends the process with SIGBUS"
            );
            return Self { slot: None };
        };
        let s = &SLOTS[i];
        // `seq` is even: the handler ignores the slot while it is written.
        s.start.store(bytes.as_ptr() as usize, Ordering::Relaxed);
        s.len.store(bytes.len(), Ordering::Relaxed);
        s.cut.store(INTACT, Ordering::Relaxed);
        s.seq.fetch_add(1, Ordering::Release);
        Self { slot: Some(i) }
    }

    /// The offset from which the mapping reads zeros because a fault was caught there, if
    /// one was.
    pub(crate) fn cut(&self) -> Option<usize> {
        let cut = SLOTS[self.slot?].cut.load(Ordering::Acquire);
        (cut != INTACT).then_some(cut)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let s = &SLOTS[i];
            s.seq.fetch_add(1, Ordering::Release);
            s.taken.store(false, Ordering::Release);
        }
    }
}

/// The registered mapping holding `addr`: its slot. Async-signal-safe.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn find(addr: usize) -> Option<&'static Slot> {
    SLOTS.iter().find(|s| {
        let seq = s.seq.load(Ordering::Acquire);
        if seq % 2 == 0 {
            return false;
        }
        let (start, len) = (
            s.start.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
        );
        fence(Ordering::Acquire);
        s.seq.load(Ordering::Relaxed) == seq && addr >= start && addr - start < len
    })
}

#[cfg(target_os = "linux")]
mod handler {
    use std::ffi::{c_int, c_void};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;

    use libc::{siginfo_t, SA_ONSTACK, SA_SIGINFO, SIGBUS, SIG_DFL, SIG_IGN};

    /// The action installed before ours (the one a fault outside the table goes to).
    static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
    static PAGE: AtomicUsize = AtomicUsize::new(4096);

    /// Installs the handler once; whether it is installed.
    pub(super) fn install() -> bool {
        static INSTALLED: OnceLock<bool> = OnceLock::new();
        *INSTALLED.get_or_init(|| {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if page > 0 {
                PAGE.store(page as usize, Ordering::Relaxed);
            }
            // SAFETY: `sigaction` with a null new action only reads the current one into
            // `old`, a plain C struct for which zeroes are valid.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            if unsafe { libc::sigaction(SIGBUS, std::ptr::null(), &mut old) } != 0 {
                return false;
            }
            // Set before ours is installed, so the handler always finds it.
            let _ = PREVIOUS.set(old);
            // SAFETY: as above; `on_sigbus` has the three-argument signature SA_SIGINFO asks
            // for and is async-signal-safe (see the module docs).
            unsafe {
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_sigbus as *const () as usize;
                new.sa_flags = SA_SIGINFO | SA_ONSTACK;
                libc::sigemptyset(&mut new.sa_mask);
                libc::sigaction(SIGBUS, &new, std::ptr::null_mut()) == 0
            }
        })
    }

    extern "C" fn on_sigbus(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
        // SAFETY: errno is this thread's; read and written back so the interrupted code sees
        // its own value.
        let errno = unsafe { *libc::__errno_location() };
        // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
        let addr = unsafe { (*info).si_addr() } as usize;
        // SAFETY: see `zero_from`.
        if !unsafe { zero_from(addr) } {
            // SAFETY: the same arguments the kernel gave us.
            unsafe { chain(sig, info, ctx) };
        }
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
    }

    /// If `addr` lies in a registered mapping, replaces its pages from `addr`'s to the end
    /// with zero pages and records the cut; whether it did.
    ///
    /// # Safety
    ///
    /// Only from the SIGBUS handler, for a fault at `addr`: the pages replaced are past the
    /// file's end (or unreadable), so no reader can get other bytes from them than a fault.
    unsafe fn zero_from(addr: usize) -> bool {
        let Some(s) = super::find(addr) else {
            return false;
        };
        let (start, len) = (
            s.start.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
        );
        let from = addr & !(PAGE.load(Ordering::Relaxed) - 1);
        let from = from.max(start);
        // SAFETY: [from, start + len) lies inside a live mapping the engine owns (the slot is
        // released before it is unmapped); MAP_FIXED replaces those pages in place with
        // anonymous read-only zero pages, which the mapping's eventual munmap removes too.
        let p = unsafe {
            libc::mmap(
                from as *mut c_void,
                start + len - from,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return false;
        }
        s.cut.fetch_min(from - start, Ordering::AcqRel);
        true
    }

    /// Hands a fault that is not ours to the action installed before, or restores the
    /// default action so that the access, run again on return, ends the process as it would
    /// have without this module.
    ///
    /// # Safety
    ///
    /// Only from the SIGBUS handler, with the arguments it got.
    unsafe fn chain(sig: c_int, info: *mut siginfo_t, ctx: *mut c_void) {
        let prev = PREVIOUS.get();
        match prev {
            Some(p) if p.sa_sigaction != SIG_DFL && p.sa_sigaction != SIG_IGN => {
                if p.sa_flags & SA_SIGINFO != 0 {
                    // SAFETY: an SA_SIGINFO action's handler has this signature.
                    let f: extern "C" fn(c_int, *mut siginfo_t, *mut c_void) =
                        unsafe { std::mem::transmute(p.sa_sigaction) };
                    f(sig, info, ctx);
                } else {
                    // SAFETY: a plain action's handler has this signature.
                    let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                    f(sig);
                }
            }
            _ => {
                // SAFETY: a zeroed sigaction with SIG_DFL is the default action.
                unsafe {
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = SIG_DFL;
                    libc::sigaction(SIGBUS, &dfl, std::ptr::null_mut());
                }
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod handler {
    /// Not implemented here: a fault stays fatal.
    pub(super) fn install() -> bool {
        false
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use crate::huge::HugeBuf;
    use crate::moe::{ExpertData, ExpertProvider, MappedExperts, PartBytes};
    use crate::safetensors::{open_file, write, Dtype};
    use crate::{Error, LoadOptions, Logits, Model, ModelFiles};

    const PAGE: usize = 4096;

    /// A file of one tensor, 3 pages of 0xab; the offset of its data.
    fn three_pages(dir: &Path) -> (PathBuf, usize) {
        let p = dir.join("t.safetensors");
        let data = vec![0xabu8; 3 * PAGE];
        write(&p, &[("t", Dtype::U8, &[3 * PAGE], &data)], None).unwrap();
        let len = std::fs::metadata(&p).unwrap().len() as usize;
        (p, len - 3 * PAGE)
    }

    fn truncate(p: &Path, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    /// A byte of the mapping, read as the kernels do (not optimised away).
    fn read(map: &[u8], at: usize) -> u8 {
        // SAFETY: `at` is inside `map`.
        unsafe { std::ptr::read_volatile(map.as_ptr().add(at)) }
    }

    /// Reads of a guarded mapping past the end of a file truncated under it give zeros, not
    /// SIGBUS; the bytes before the end are still read; and `check` tells which ranges are
    /// no longer the file's, naming it: past the cut (a fault was caught there), or past the
    /// file's new end (the rest of its last page reads as zeros without a fault).
    #[test]
    fn a_read_past_the_end_of_a_truncated_file_gives_zeros_and_an_error_not_sigbus() {
        let d = tempfile::tempdir().unwrap();
        let (p, base) = three_pages(d.path());
        let (f, _) = open_file(&p, 0).unwrap();
        let map = &f.map[..];
        let end = map.len();
        assert_eq!(read(map, base + 2 * PAGE + 5), 0xab);
        f.check(end).unwrap();
        // The file now ends one page into its mapping, and some bytes past that.
        let keep = PAGE + 100;
        truncate(&p, keep as u64);
        let msg = f.check(end).unwrap_err().chain();
        assert!(
            msg.contains("t.safetensors") && msg.contains("changed size"),
            "{msg}"
        );
        // The last page's tail past the end: zeros, no fault, nothing marked; `check` knows
        // from the file's length.
        assert_eq!(read(map, keep + 10), 0);
        f.check(keep).unwrap();
        assert!(f.check(keep + 1).is_err());
        // A page past the end: zeros instead of SIGBUS, and the mapping is marked from there.
        let at = 2 * PAGE + 7;
        assert_eq!(read(map, at), 0);
        assert_eq!(f.guard.cut(), Some(2 * PAGE));
        let msg = f.check(2 * PAGE + 1).unwrap_err().chain();
        assert!(
            msg.contains("t.safetensors") && msg.contains("could not be read through the mapping"),
            "{msg}"
        );
        // The bytes before the end are still there; a fault on an earlier page moves the mark.
        assert_eq!(read(map, base), 0xab);
        assert_eq!(read(map, keep - 1), 0xab);
        f.check(keep).unwrap();
        // Even with the file grown back, the marked pages stay zeros, and say so.
        truncate(&p, end as u64);
        assert_eq!(read(map, at), 0);
        assert!(f.check(2 * PAGE + 1).is_err());
        f.check(PAGE).unwrap();
    }

    /// The handler takes only faults in mappings it guards: any other SIGBUS still ends the
    /// process (in a child: this test runs itself with `STORMO_SIGBUS_CHILD` set).
    #[test]
    fn a_fault_outside_the_guarded_mappings_still_ends_the_process() {
        if std::env::var_os("STORMO_SIGBUS_CHILD").is_some() {
            let d = tempfile::tempdir().unwrap();
            let (p, _) = three_pages(d.path());
            // The handler is installed by a guarded mapping.
            let (_guarded, _) = open_file(&p, 0).unwrap();
            let file = std::fs::File::open(&p).unwrap();
            // SAFETY: a read-only mapping this test faults on purpose.
            let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
            truncate(&p, PAGE as u64);
            let b = read(&map, 2 * PAGE);
            panic!("read {b} past the end of an unguarded mapping without a fault");
        }
        let name = "safetensors::sigbus::tests::a_fault_outside_the_guarded_mappings_still_ends_the_process";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env("STORMO_SIGBUS_CHILD", "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGBUS),
            "{:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A copy of the tiny GPT-OSS fixture; its weights file.
    fn tiny_copy(dir: &Path) -> PathBuf {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/gptoss-tiny-mxfp4");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        dir.join("model.safetensors")
    }

    /// The end of the last tensor that is not an expert's (the experts' MXFP4 blocks and
    /// scales lie after it in the fixture).
    fn dense_end(files: &ModelFiles) -> u64 {
        let experts = files.layout.expert_tensor_names();
        files
            .ckpt
            .tensors
            .iter()
            .filter(|(n, _)| !experts.contains(n.as_str()))
            .map(|(_, t)| t.offset + t.len)
            .max()
            .unwrap()
    }

    /// Mapped experts whose file is cut to `cut` bytes right after the first fetch, before
    /// the experts are computed: the race a check before the read alone would lose.
    #[derive(Debug)]
    struct CutAfterFetch {
        inner: MappedExperts,
        path: PathBuf,
        cut: u64,
        done: AtomicBool,
    }

    impl ExpertProvider for CutAfterFetch {
        fn fetch(
            &self,
            layer: usize,
            experts: &[usize],
            out: &mut Vec<Arc<ExpertData>>,
        ) -> crate::Result<()> {
            self.inner.fetch(layer, experts, out)?;
            if !self.done.swap(true, Ordering::SeqCst) {
                truncate(&self.path, self.cut);
            }
            Ok(())
        }
    }

    /// `--mmap-experts` with the checkpoint truncated while a step computes its experts: the
    /// kernels read zeros instead of dying of SIGBUS, and the step fails with an error naming
    /// the expert and the file; so does every later step touching those pages, even once the
    /// file is back (the mapping no longer shows it). With the check after the compute
    /// removed, the step would succeed on zeros (the test can fail).
    #[test]
    fn mapped_experts_cut_while_computed_fail_the_step_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = tiny_copy(d.path());
        let whole = std::fs::read(&p).unwrap();
        let files = ModelFiles::open(d.path()).unwrap();
        let cut = dense_end(&files);
        assert!(
            cut + PAGE as u64 * 2 < whole.len() as u64,
            "experts after the dense part"
        );
        let experts = Arc::new(CutAfterFetch {
            inner: files.mapped_experts().unwrap(),
            path: p.clone(),
            cut,
            done: AtomicBool::new(false),
        });
        let model = Model::new(files, experts, &LoadOptions::default()).unwrap();
        let mut sess = model.session(64).unwrap();
        let Err(e) = model.forward(&mut sess, &[1, 2, 3], Logits::Last, None) else {
            panic!("the step succeeded on a cut file");
        };
        let msg = e.chain();
        assert!(
            matches!(e, Error::Expert { layer: 0, .. })
                && msg.contains("model.safetensors")
                && msg.contains("could not be read through the mapping"),
            "{msg}"
        );
        // Put back in place (the same file): the mapped pages stay zeros, and say so.
        std::fs::write(&p, &whole).unwrap();
        let mut sess = model.session(64).unwrap();
        let Err(e) = model.forward(&mut sess, &[1, 2, 3], Logits::Last, None) else {
            panic!("the step succeeded on a mapping that was cut");
        };
        let msg = e.chain();
        assert!(
            msg.contains("could not be read through the mapping"),
            "{msg}"
        );
    }

    /// Experts held in RAM (copies), so only the dense bytes read through the mapping (norms,
    /// the head) meet a truncation: within the last page (zeros without a fault) and pages
    /// past it (a fault caught), the step fails naming the file.
    #[test]
    fn a_dense_tensor_cut_under_the_model_fails_the_step_naming_the_file() {
        #[derive(Debug)]
        struct Copied(Vec<Vec<Arc<ExpertData>>>);
        impl ExpertProvider for Copied {
            fn fetch(
                &self,
                layer: usize,
                experts: &[usize],
                out: &mut Vec<Arc<ExpertData>>,
            ) -> crate::Result<()> {
                out.extend(experts.iter().map(|&e| self.0[layer][e].clone()));
                Ok(())
            }
        }
        for (why, back) in [
            ("within the last page", 100),
            ("pages past it", 3 * PAGE as u64),
        ] {
            let d = tempfile::tempdir().unwrap();
            let p = tiny_copy(d.path());
            let files = ModelFiles::open(d.path()).unwrap();
            let end = dense_end(&files);
            let mapped = files.mapped_experts().unwrap();
            let copied = (0..files.cfg.num_layers)
                .map(|l| {
                    let mut out = Vec::new();
                    let all: Vec<usize> = (0..files.cfg.num_experts).collect();
                    mapped.fetch(l, &all, &mut out).unwrap();
                    out.iter()
                        .map(|d| {
                            let parts = d
                                .parts()
                                .map(|b| {
                                    let buf = Arc::new(HugeBuf::copy_of(b).unwrap());
                                    PartBytes::Owned(buf, 0..b.len())
                                })
                                .collect();
                            Arc::new(ExpertData::new(parts))
                        })
                        .collect()
                })
                .collect();
            let model =
                Model::new(files, Arc::new(Copied(copied)), &LoadOptions::default()).unwrap();
            let mut sess = model.session(64).unwrap();
            model
                .forward(&mut sess, &[1, 2, 3], Logits::Last, None)
                .unwrap();
            truncate(&p, end - back);
            let Err(e) = model.forward(&mut sess, &[4], Logits::Last, None) else {
                panic!("{why}: the step succeeded on a cut file");
            };
            let msg = e.chain();
            assert!(msg.contains("model.safetensors"), "{why}: {msg}");
        }
    }
}
