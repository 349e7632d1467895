//! The local-disk tier: positioned reads of each expert's byte ranges into an owned buffer, on
//! a small pool of I/O threads (queue depth > 1), demand reads ahead of prefetch reads.

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};

use super::{Completion, ExpertId, Priority, Tier};
use crate::error::{Error, Result};
use crate::huge::HugeBuf;
use crate::layout::ExpertLayout;
use crate::moe::ExpertData;

/// Alignment of O_DIRECT reads and of flat-store records.
pub const ALIGN: usize = 4096;

/// A file the disk tier reads from.
#[derive(Debug)]
pub struct DiskFile {
    /// Its path (for messages).
    pub path: PathBuf,
    file: File,
    /// The length it had when validated; any other length later is an error.
    expected_len: u64,
    /// Opened with O_DIRECT (aligned reads only).
    direct: bool,
}

impl DiskFile {
    /// Opens `path` for positioned reads, expecting it to be `expected_len` bytes. With `direct`
    /// it tries O_DIRECT and falls back to buffered reads where the filesystem refuses it.
    pub fn open(path: PathBuf, expected_len: u64, direct: bool) -> Result<Self> {
        let open_plain = || File::open(&path).map_err(|e| Error::io(&path, e));
        let (file, direct) = if direct {
            use std::os::unix::fs::OpenOptionsExt;
            match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
            {
                Ok(f) => (f, true),
                Err(_) => (open_plain()?, false),
            }
        } else {
            (open_plain()?, false)
        };
        let me = Self {
            path,
            file,
            expected_len,
            direct,
        };
        me.check_len()?;
        Ok(me)
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    fn check_len(&self) -> Result<()> {
        let len = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len();
        if len != self.expected_len {
            return Err(Error::Io {
                path: self.path.clone(),
                source: std::io::Error::other(format!(
                    "file changed size: {} bytes when opened, {len} now (truncated or replaced while running)",
                    self.expected_len
                )),
            });
        }
        Ok(())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_len()?;
        crate::safetensors::read_exact_at(&self.file, &self.path, buf, offset)?;
        // a file truncated during the read gives zeros on some filesystems: check again
        self.check_len()
    }
}

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queues {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    shutdown: bool,
}

/// A fixed pool of I/O threads with two queues; demand jobs always go first.
pub struct IoPool {
    shared: Arc<(Mutex<Queues>, Condvar)>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for IoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoPool({} threads)", self.threads.len())
    }
}

impl IoPool {
    /// Starts `n` threads (at least one). If the system refuses some of them (a thread limit),
    /// the pool runs with those it got; it fails only if it got none.
    pub fn new(n: usize) -> std::io::Result<Self> {
        let shared = Arc::new((Mutex::new(Queues::default()), Condvar::new()));
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let spawned = {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("stormo-io-{i}"))
                    .spawn(move || loop {
                        let job = {
                            let (m, cv) = &*shared;
                            let mut q = m.lock().expect("io queue lock");
                            loop {
                                if let Some(j) =
                                    q.demand.pop_front().or_else(|| q.prefetch.pop_front())
                                {
                                    break j;
                                }
                                if q.shutdown {
                                    return;
                                }
                                q = cv.wait(q).expect("io queue lock");
                            }
                        };
                        job();
                    })
            };
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) if threads.is_empty() => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("starting a thread to read experts from disk: {e}"),
                    ))
                }
                Err(e) => {
                    tracing::warn!(
                        "started {} of {n} threads to read experts from disk ({e}); going on with those",
                        threads.len()
                    );
                    break;
                }
            }
        }
        Ok(Self { shared, threads })
    }

    /// Queues a job.
    pub fn submit(&self, priority: Priority, job: Job) {
        let (m, cv) = &*self.shared;
        let mut q = m.lock().expect("io queue lock");
        match priority {
            Priority::Demand => q.demand.push_back(job),
            Priority::Prefetch => q.prefetch.push_back(job),
        }
        cv.notify_one();
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        {
            let (m, cv) = &*self.shared;
            let mut q = m.lock().expect("io queue lock");
            q.shutdown = true;
            q.prefetch.clear();
            cv.notify_all();
        }
        // The pool may be dropped by one of its own threads (a job held the last reference to
        // the tier): never join that one.
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

/// Reads experts from local files by the ranges of an [`ExpertLayout`].
#[derive(Debug)]
pub struct DiskTier {
    inner: Arc<DiskInner>,
    pool: IoPool,
}

#[derive(Debug)]
struct DiskInner {
    files: Vec<DiskFile>,
    layout: Arc<ExpertLayout>,
    /// Which experts this node may serve from disk (`--only-experts`); None = all.
    allowed: Option<Vec<Vec<bool>>>,
}

impl DiskTier {
    /// A disk tier over `files` (indexed by the layout's `Loc::file`), with `threads` readers.
    /// `allowed[layer][expert]` restricts which experts it holds.
    pub fn new(
        files: Vec<DiskFile>,
        layout: Arc<ExpertLayout>,
        threads: usize,
        allowed: Option<Vec<Vec<bool>>>,
    ) -> std::io::Result<Self> {
        Ok(Self {
            inner: Arc::new(DiskInner {
                files,
                layout,
                allowed,
            }),
            pool: IoPool::new(threads)?,
        })
    }

    /// Reads one expert now, on the calling thread.
    pub fn read(&self, key: ExpertId) -> Result<Arc<ExpertData>> {
        self.inner.read(key)
    }
}

impl DiskInner {
    fn holds(&self, key: ExpertId) -> bool {
        let (l, e) = (key.layer as usize, key.expert as usize);
        let exists = self.layout.parts.get(l).is_some_and(|p| e < p.len());
        exists
            && self
                .allowed
                .as_ref()
                .is_none_or(|a| a.get(l).and_then(|r| r.get(e)).copied().unwrap_or(false))
    }

    fn read(&self, key: ExpertId) -> Result<Arc<ExpertData>> {
        let (l, e) = (key.layer as usize, key.expert as usize);
        let parts = self
            .layout
            .parts
            .get(l)
            .and_then(|p| p.get(e))
            .ok_or_else(|| Error::Expert {
                layer: l,
                expert: e,
                reason: "not in the layout".into(),
            })?;
        let total: usize = parts.iter().map(|p| p.loc.len as usize).sum();
        // One contiguous record when the parts are back to back in one file (the flat store);
        // then a single (possibly O_DIRECT) read loads the whole expert.
        let contiguous = parts.windows(2).all(|w| {
            w[0].loc.file == w[1].loc.file && w[0].loc.offset + w[0].loc.len == w[1].loc.offset
        });
        let first = &parts[0].loc;
        let file = &self.files[first.file];
        let (b, base) =
            if contiguous && file.direct && (first.offset as usize).is_multiple_of(ALIGN) {
                let padded = total.div_ceil(ALIGN) * ALIGN;
                let mut b = buffer(padded + ALIGN, l, e)?;
                let skew = b.as_ptr() as usize % ALIGN;
                let base = if skew == 0 { 0 } else { ALIGN - skew };
                file.read_exact_at(&mut b[base..base + padded], first.offset)?;
                (b, base)
            } else {
                let mut b = buffer(total, l, e)?;
                let mut off = 0;
                for p in parts {
                    let len = p.loc.len as usize;
                    self.files[p.loc.file].read_exact_at(&mut b[off..off + len], p.loc.offset)?;
                    off += len;
                }
                (b, 0)
            };
        let lens = parts.iter().map(|p| p.loc.len as usize);
        Ok(Arc::new(ExpertData::from_lengths(Arc::new(b), base, lens)))
    }
}

/// A buffer for an expert's bytes, which the read overwrites ([`HugeBuf::recycled`]), on huge
/// pages where the kernel allows: decode streams every cached expert's bytes through the
/// kernels (see [`crate::huge`]).
fn buffer(n: usize, layer: usize, expert: usize) -> Result<HugeBuf> {
    HugeBuf::recycled(n).map_err(|e| Error::Expert {
        layer,
        expert,
        reason: e.to_string(),
    })
}

impl Tier for DiskTier {
    fn name(&self) -> &str {
        "disk"
    }

    fn holds(&self, key: ExpertId) -> bool {
        self.inner.holds(key)
    }

    fn load(&self, keys: &[ExpertId], priority: Priority, done: Completion) {
        for &key in keys {
            let inner = self.inner.clone();
            let done = done.clone();
            self.pool.submit(
                priority,
                Box::new(move || {
                    let r = inner.read(key);
                    done(key, r);
                }),
            );
        }
    }
}
