//! The hashing engine shared by build and verify: every file's SHA-256, every tensor's
//! BLAKE3 and every expert record's hashes, from one sequential read of each file.
//!
//! Per file, a reader reads large blocks (8 MiB; with [`IoMode::Direct`], `O_DIRECT` into
//! page-aligned buffers, so the page cache is neither used nor polluted) and hands each block
//! to up to three consumers at once, each on its own thread:
//!
//! - the file's SHA-256 (sequential by nature: one hasher per file, so different files'
//!   SHA-256 run in parallel when several files are read at once);
//! - the BLAKE3 of every tensor the block overlaps;
//! - the expert records: each expert's parts are fed to its [`RecordHasher`] in record order
//!   straight from the block when the part is next in line, and otherwise copied aside until
//!   the parts before it have been fed (in a GPT-OSS checkpoint the `down_proj` tensors come
//!   before `gate_up_proj` in the file but after it in the record). The copies are bounded by
//!   [`Plan::pending_budget`]; an expert that would exceed it is *deferred* and hashed after
//!   the readers are done with positioned reads (the only bytes ever read twice; none for the
//!   checkpoints stormo knows).
//!
//! Up to one file per core (at most eight) is read at a time. A block's buffer returns to its reader's pool
//! when the last consumer drops it. Nothing here panics on a short, missing or unreadable
//! file: what could not be hashed comes back as `None` with the reason.
//!
//! [`reference`] computes the same [`Outcome`] the plain way (whole spans read with positioned
//! reads, hashed one after another); tests hold the pipeline to it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use sha2::Digest;

use crate::hash::Hash;
use crate::manifest::Sha256;
use crate::record::RecordHasher;

/// Bytes per read of the sequential readers.
const BLOCK: usize = 8 << 20;
/// Buffers in flight per file.
const BUFFERS: usize = 6;
/// Alignment of `O_DIRECT` buffers, offsets and lengths (the largest logical block size in
/// common use).
const ALIGN: usize = 4096;
/// Most files read at once (each has its own SHA-256 thread; eight of them outrun any disk).
const MAX_FILES_AT_ONCE: usize = 8;
/// Bytes per positioned read of deferred expert parts.
const PIECE: usize = 1 << 20;
/// Default bound on the expert bytes held aside while waiting for earlier parts.
pub(crate) const PENDING_BUDGET: u64 = 1 << 30;

/// How checkpoint files are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum IoMode {
    /// Through the page cache (fast when the files are cached; fills the cache otherwise).
    #[default]
    Buffered,
    /// `O_DIRECT` on Linux: straight from the disk, leaving the page cache alone. Where the
    /// file system refuses it (tmpfs, other systems), the file is read buffered instead and
    /// [`Progress::direct_fallbacks`] counts it.
    Direct,
}

impl std::str::FromStr for IoMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "buffered" => Ok(Self::Buffered),
            "direct" => Ok(Self::Direct),
            _ => Err(format!("{s:?} is not an I/O mode (direct or buffered)")),
        }
    }
}

/// Progress of a long build or verify, in bytes; read it from another thread.
#[derive(Debug, Default)]
pub struct Progress {
    total: AtomicU64,
    done: AtomicU64,
    fallbacks: AtomicU64,
}

impl Progress {
    /// A new counter at zero.
    pub fn new() -> Self {
        Self::default()
    }
    /// (bytes done, bytes total). The total is known once hashing starts (0 before); it
    /// grows if an expert has to be read a second time.
    pub fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }
    /// Files that were read buffered although [`IoMode::Direct`] was asked for.
    pub fn direct_fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }
    fn add(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
}

/// A byte range in file `file` of a plan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl Span {
    fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// What to hash.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) dir: PathBuf,
    /// File names in `dir`, with the length each is expected to have.
    pub(crate) files: Vec<(String, u64)>,
    pub(crate) tensors: Vec<Span>,
    /// Each expert's parts, in record order.
    pub(crate) experts: Vec<Vec<Span>>,
    pub(crate) chunk_size: u32,
    pub(crate) io: IoMode,
    /// Most bytes of expert parts held aside at once (see the module docs).
    pub(crate) pending_budget: u64,
}

/// What one file gave.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct FileOutcome {
    /// Its length on disk (None if it could not be opened).
    pub(crate) len: Option<u64>,
    /// SHA-256 of all its bytes (None on a read error).
    pub(crate) sha256: Option<Sha256>,
    /// Why it could not be opened or read.
    pub(crate) error: Option<String>,
}

/// The hashes: `None` where the bytes could not be read in full.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub(crate) files: Vec<FileOutcome>,
    pub(crate) tensors: Vec<Option<Hash>>,
    pub(crate) experts: Vec<Option<RecordHashes>>,
}

/// A record's hash and its chunk hashes.
pub(crate) type RecordHashes = (Hash, Vec<Hash>);

/// A file opened for hashing: a buffered handle (always) and a direct one (if asked for and
/// allowed).
#[derive(Debug)]
struct Opened {
    file: File,
    direct: Option<File>,
    len: u64,
}

fn open(path: &Path, io: IoMode, progress: Option<&Progress>) -> Result<Opened, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let direct = match io {
        IoMode::Buffered => None,
        IoMode::Direct => {
            let d = open_direct(path);
            if d.is_none() {
                tracing::warn!("{}: O_DIRECT refused, reading buffered", path.display());
                if let Some(p) = progress {
                    p.fallbacks.fetch_add(1, Ordering::Relaxed);
                }
            }
            d
        }
    };
    Ok(Opened { file, direct, len })
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path) -> Option<File> {
    None
}

/// A block of a file, shared by its consumers; the buffer goes back to the reader's pool
/// when the last one drops it.
struct Block {
    buf: Vec<u8>,
    /// Where the aligned data starts in `buf`.
    start: usize,
    /// Bytes of data.
    n: usize,
    /// File offset of the first byte.
    pos: u64,
    home: SyncSender<Vec<u8>>,
}

impl Block {
    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.n]
    }
    fn end(&self) -> u64 {
        self.pos + self.n as u64
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let _ = self.home.try_send(std::mem::take(&mut self.buf));
    }
}

/// A buffer with room for an aligned block.
fn new_buffer() -> Vec<u8> {
    vec![0u8; BLOCK + ALIGN]
}

/// Reads `len` bytes of a file in blocks and sends each block to every consumer.
fn read_blocks(
    f: &Opened,
    progress: Option<&Progress>,
    consumers: &[SyncSender<Arc<Block>>],
) -> std::io::Result<()> {
    let (home, pool) = sync_channel::<Vec<u8>>(BUFFERS);
    let mut made = 0;
    let mut direct = f.direct.as_ref();
    let mut pos = 0u64;
    while pos < f.len {
        let mut buf = match pool.try_recv() {
            Ok(b) => b,
            Err(_) if made < BUFFERS => {
                made += 1;
                new_buffer()
            }
            Err(_) => pool
                .recv()
                .expect("the reader holds a sender of its own pool"),
        };
        let start = buf.as_ptr().align_offset(ALIGN);
        let want = (f.len - pos).min(BLOCK as u64) as usize;
        let mut n = 0;
        while n < want {
            let at = pos + n as u64;
            let r = match direct {
                Some(d) if n.is_multiple_of(ALIGN) && at.is_multiple_of(ALIGN as u64) => {
                    let to = want.next_multiple_of(ALIGN);
                    read_at(d, &mut buf[start + n..start + to], at)
                }
                _ => read_at(&f.file, &mut buf[start + n..start + want], at),
            };
            match r {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "the file shrank while being read (ended at {at} of {})",
                            f.len
                        ),
                    ))
                }
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if direct.is_some() && e.raw_os_error() == Some(libc::EINVAL) => {
                    direct = None; // this file system refuses O_DIRECT reads after all
                    if let Some(p) = progress {
                        p.fallbacks.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let n = n.min(want); // a direct read may pass `len` if the file grew
        let block = Arc::new(Block {
            buf,
            start,
            n,
            pos,
            home: home.clone(),
        });
        pos += n as u64;
        if let Some(p) = progress {
            p.add(n as u64);
        }
        for c in consumers {
            if c.send(block.clone()).is_err() {
                return Err(std::io::Error::other("a hasher thread stopped"));
            }
        }
    }
    Ok(())
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(file, buf, offset)
}

#[cfg(windows)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    std::os::windows::fs::FileExt::seek_read(file, buf, offset)
}

fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        match read_at(file, buf, offset) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads the files of `dir` named in `files` exactly as `run` does (same block size, I/O
/// mode and number of files at once) and only counts the bytes: the bound a build or verify
/// is measured against. Returns the bytes read.
pub fn read_files(
    dir: &Path,
    files: &[String],
    io: IoMode,
    progress: Option<&Progress>,
) -> std::io::Result<u64> {
    let mut opened = Vec::with_capacity(files.len());
    for name in files {
        let path = dir.join(name);
        let f = open(&path, io, progress)
            .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?;
        opened.push(f);
    }
    if let Some(p) = progress {
        p.total
            .store(opened.iter().map(|o| o.len).sum(), Ordering::Relaxed);
    }
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<std::io::Error>> = Mutex::new(None);
    let total = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..cores().min(MAX_FILES_AT_ONCE).min(opened.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(f) = opened.get(i) else { break };
                let (tx, rx) = sync_channel::<Arc<Block>>(BUFFERS);
                let r = std::thread::scope(|s| {
                    s.spawn(move || rx.into_iter().count());
                    read_blocks(f, progress, &[tx])
                });
                match r {
                    Ok(()) => {
                        total.fetch_add(f.len, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let e = std::io::Error::new(e.kind(), format!("{}: {e}", files[i]));
                        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(total.into_inner()),
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// A piece of an expert part inside one file.
#[derive(Clone, Copy, Debug)]
struct Piece {
    offset: u64,
    len: u64,
    expert: usize,
    part: usize,
}

/// One expert record being hashed from the blocks as they pass.
#[derive(Debug)]
struct ExpertState {
    lens: Vec<u64>,
    hasher: Option<RecordHasher>,
    /// The next part to feed the hasher, and how many of its bytes have been fed.
    next: usize,
    fed: u64,
    /// Bytes of parts after `next` that arrived early.
    pending: Vec<Option<Vec<u8>>>,
    /// Too much held aside, or the bytes came in an order this cannot follow: hash it later
    /// with positioned reads.
    deferred: bool,
    result: Option<RecordHashes>,
}

impl ExpertState {
    fn new(spans: &[Span], chunk_size: u32) -> Self {
        let lens: Vec<u64> = spans.iter().map(|s| s.len).collect();
        let total = lens.iter().sum();
        let mut s = Self {
            pending: vec![None; lens.len()],
            lens,
            hasher: Some(RecordHasher::new(chunk_size, total)),
            next: 0,
            fed: 0,
            deferred: false,
            result: None,
        };
        s.advance(&AtomicU64::new(0));
        s
    }

    fn feed(&mut self, part: usize, at: u64, bytes: &[u8], held: &AtomicU64, budget: u64) {
        if self.deferred || self.result.is_some() {
            return;
        }
        if part == self.next && at == self.fed {
            if let Some(h) = &mut self.hasher {
                h.update(bytes);
            }
            self.fed += bytes.len() as u64;
            if self.fed == self.lens[part] {
                self.next += 1;
                self.fed = 0;
                self.advance(held);
            }
            return;
        }
        let in_order = part > self.next
            && self.pending[part]
                .as_ref()
                .map_or(at == 0, |p| p.len() as u64 == at);
        if !in_order {
            self.defer(held);
            return;
        }
        if self.pending[part].is_none() {
            let want = self.lens[part];
            if held.fetch_add(want, Ordering::Relaxed) + want > budget {
                held.fetch_sub(want, Ordering::Relaxed);
                self.defer(held);
                return;
            }
            self.pending[part] = Some(Vec::with_capacity(want as usize));
        }
        if let Some(p) = &mut self.pending[part] {
            p.extend_from_slice(bytes);
        }
    }

    /// Feeds the parts that are complete in order.
    fn advance(&mut self, held: &AtomicU64) {
        while self.next < self.lens.len() {
            if let Some(p) = self.pending[self.next].take() {
                if let Some(h) = &mut self.hasher {
                    h.update(&p);
                }
                self.fed = p.len() as u64;
                held.fetch_sub(self.lens[self.next], Ordering::Relaxed);
            }
            if self.fed < self.lens[self.next] {
                return;
            }
            self.next += 1;
            self.fed = 0;
        }
        if let Some(h) = self.hasher.take() {
            self.result = Some(h.finish());
        }
    }

    fn defer(&mut self, held: &AtomicU64) {
        for (p, len) in self.pending.iter_mut().zip(&self.lens) {
            if p.take().is_some() {
                held.fetch_sub(*len, Ordering::Relaxed);
            }
        }
        self.hasher = None;
        self.deferred = true;
    }
}

/// Hashes everything `plan` names.
pub(crate) fn run(plan: &Plan, progress: Option<&Progress>) -> Outcome {
    let nfiles = plan.files.len();
    let opened: Vec<Result<Opened, String>> = plan
        .files
        .iter()
        .map(|(name, _)| open(&plan.dir.join(name), plan.io, progress))
        .collect();
    if let Some(p) = progress {
        let files: u64 = opened.iter().map(|o| o.as_ref().map_or(0, |f| f.len)).sum();
        p.total.store(files, Ordering::Relaxed);
    }

    // Tensor spans and expert pieces of each file, by offset.
    let mut tensors_in: Vec<Vec<(usize, Span)>> = vec![Vec::new(); nfiles];
    for (i, s) in plan.tensors.iter().enumerate() {
        if let Some(v) = tensors_in.get_mut(s.file) {
            v.push((i, *s));
        }
    }
    let mut pieces_in: Vec<Vec<Piece>> = vec![Vec::new(); nfiles];
    for (e, spans) in plan.experts.iter().enumerate() {
        for (part, s) in spans.iter().enumerate() {
            if let Some(v) = pieces_in.get_mut(s.file) {
                if s.len > 0 {
                    v.push(Piece {
                        offset: s.offset,
                        len: s.len,
                        expert: e,
                        part,
                    });
                }
            }
        }
    }
    for v in &mut tensors_in {
        v.sort_by_key(|(_, s)| s.offset);
    }
    for v in &mut pieces_in {
        v.sort_by_key(|p| p.offset);
    }

    let states: Vec<Mutex<ExpertState>> = plan
        .experts
        .iter()
        .map(|spans| Mutex::new(ExpertState::new(spans, plan.chunk_size)))
        .collect();
    let held = AtomicU64::new(0);
    let next_file = AtomicUsize::new(0);
    let file_out: Vec<Mutex<FileResult>> = (0..nfiles)
        .map(|_| Mutex::new((FileOutcome::default(), Vec::new())))
        .collect();

    std::thread::scope(|s| {
        for _ in 0..cores().min(MAX_FILES_AT_ONCE).min(nfiles) {
            s.spawn(|| loop {
                let f = next_file.fetch_add(1, Ordering::Relaxed);
                if f >= nfiles {
                    break;
                }
                let spans = &tensors_in[f];
                let result = match &opened[f] {
                    Err(e) => (
                        FileOutcome {
                            len: None,
                            sha256: None,
                            error: Some(e.clone()),
                        },
                        spans.iter().map(|(i, _)| (*i, None)).collect(),
                    ),
                    Ok(file) => hash_file(
                        file,
                        spans,
                        &pieces_in[f],
                        &states,
                        &held,
                        plan.pending_budget,
                        progress,
                    ),
                };
                *file_out[f].lock().unwrap_or_else(|e| e.into_inner()) = result;
            });
        }
    });

    let mut tensors = vec![None; plan.tensors.len()];
    let mut files = Vec::with_capacity(nfiles);
    for m in file_out {
        let (fo, ts) = m.into_inner().unwrap_or_else(|e| e.into_inner());
        for (i, h) in ts {
            tensors[i] = h;
        }
        files.push(fo);
    }

    // Deferred experts: positioned reads, on all cores.
    let mut experts: Vec<Option<RecordHashes>> = Vec::with_capacity(states.len());
    let mut deferred = Vec::new();
    for (i, m) in states.into_iter().enumerate() {
        let st = m.into_inner().unwrap_or_else(|e| e.into_inner());
        if st.deferred {
            deferred.push(i);
        }
        experts.push(st.result);
    }
    if !deferred.is_empty() {
        tracing::info!(
            "{} expert record(s) hashed with a second read",
            deferred.len()
        );
        if let Some(p) = progress {
            let bytes: u64 = deferred
                .iter()
                .flat_map(|&i| &plan.experts[i])
                .map(|s| s.len)
                .sum();
            p.total.fetch_add(bytes, Ordering::Relaxed);
        }
        let next = AtomicUsize::new(0);
        let out: Vec<Mutex<Option<RecordHashes>>> =
            deferred.iter().map(|_| Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for _ in 0..cores().min(deferred.len()) {
                s.spawn(|| {
                    let mut buf = vec![0u8; PIECE];
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = deferred.get(k) else { break };
                        let r = hash_expert(
                            &opened,
                            &plan.experts[i],
                            plan.chunk_size,
                            &mut buf,
                            progress,
                        );
                        *out[k].lock().unwrap_or_else(|e| e.into_inner()) = r;
                    }
                });
            }
        });
        for (k, m) in out.into_iter().enumerate() {
            experts[deferred[k]] = m.into_inner().unwrap_or_else(|e| e.into_inner());
        }
    }
    Outcome {
        files,
        tensors,
        experts,
    }
}

/// One file's outcome and its tensors' hashes.
type FileResult = (FileOutcome, Vec<(usize, Option<Hash>)>);

/// Reads one file once; SHA-256, tensor BLAKE3 and expert records on three threads.
fn hash_file(
    file: &Opened,
    spans: &[(usize, Span)],
    pieces: &[Piece],
    states: &[Mutex<ExpertState>],
    held: &AtomicU64,
    budget: u64,
    progress: Option<&Progress>,
) -> FileResult {
    let (sha_tx, sha_rx) = sync_channel::<Arc<Block>>(BUFFERS);
    let (t_tx, t_rx) = sync_channel::<Arc<Block>>(BUFFERS);
    let (e_tx, e_rx) = sync_channel::<Arc<Block>>(BUFFERS);
    std::thread::scope(|s| {
        let sha = s.spawn(move || {
            let mut h = sha2::Sha256::new();
            for b in sha_rx {
                h.update(b.bytes());
            }
            Sha256(h.finalize().into())
        });
        let tensors = s.spawn(move || tensor_hashes(spans, t_rx));
        let mut consumers = vec![sha_tx, t_tx];
        if pieces.is_empty() {
            drop(e_rx);
        } else {
            s.spawn(move || expert_pieces(pieces, e_rx, states, held, budget));
            consumers.push(e_tx);
        }
        let read = read_blocks(file, progress, &consumers);
        drop(consumers);
        let sha = sha.join().expect("the SHA-256 thread does not panic");
        let tensors = tensors
            .join()
            .expect("the tensor hash thread does not panic");
        let outcome = match read {
            Ok(()) => FileOutcome {
                len: Some(file.len),
                sha256: Some(sha),
                error: None,
            },
            Err(e) => FileOutcome {
                len: Some(file.len),
                sha256: None,
                error: Some(e.to_string()),
            },
        };
        (outcome, tensors)
    })
}

/// Feeds each tensor's BLAKE3 with the parts of the blocks it overlaps.
fn tensor_hashes(spans: &[(usize, Span)], rx: Receiver<Arc<Block>>) -> Vec<(usize, Option<Hash>)> {
    let mut hashers: Vec<Option<blake3::Hasher>> = vec![None; spans.len()];
    let mut out: Vec<(usize, Option<Hash>)> = spans.iter().map(|(i, _)| (*i, None)).collect();
    let mut first = 0; // spans before this one are finished
    let mut seen = 0u64;
    for b in rx {
        let (buf, start, end) = (b.bytes(), b.pos, b.end());
        seen = end;
        let mut k = first;
        while k < spans.len() && spans[k].1.offset < end {
            let s = spans[k].1;
            if s.end() > start && out[k].1.is_none() {
                let lo = s.offset.max(start);
                let hi = s.end().min(end);
                let h = hashers[k].get_or_insert_with(blake3::Hasher::new);
                if hi > lo {
                    h.update(&buf[(lo - start) as usize..(hi - start) as usize]);
                }
                if s.end() <= end {
                    let h = hashers[k].take().unwrap_or_default();
                    out[k].1 = Some(Hash(*h.finalize().as_bytes()));
                }
            } else if s.len == 0 && out[k].1.is_none() {
                out[k].1 = Some(Hash::of(&[]));
            }
            k += 1;
        }
        while first < spans.len() && out[first].1.is_some() {
            first += 1;
        }
    }
    // Empty tensors at the very end of the file.
    for (k, (_, s)) in spans.iter().enumerate() {
        if s.len == 0 && s.offset <= seen && out[k].1.is_none() {
            out[k].1 = Some(Hash::of(&[]));
        }
    }
    out
}

/// Feeds the expert records with the parts of the blocks they overlap.
fn expert_pieces(
    pieces: &[Piece],
    rx: Receiver<Arc<Block>>,
    states: &[Mutex<ExpertState>],
    held: &AtomicU64,
    budget: u64,
) {
    let mut first = 0; // pieces before this one end before the current block
    for b in rx {
        let (buf, start, end) = (b.bytes(), b.pos, b.end());
        while first < pieces.len() && pieces[first].offset + pieces[first].len <= start {
            first += 1;
        }
        let mut k = first;
        while k < pieces.len() && pieces[k].offset < end {
            let p = pieces[k];
            let lo = p.offset.max(start);
            let hi = (p.offset + p.len).min(end);
            if hi > lo {
                let mut st = states[p.expert].lock().unwrap_or_else(|e| e.into_inner());
                st.feed(
                    p.part,
                    lo - p.offset,
                    &buf[(lo - start) as usize..(hi - start) as usize],
                    held,
                    budget,
                );
            }
            k += 1;
        }
    }
}

/// Reads and hashes one expert record (parts in order) with positioned reads.
fn hash_expert(
    files: &[Result<Opened, String>],
    spans: &[Span],
    chunk_size: u32,
    buf: &mut [u8],
    progress: Option<&Progress>,
) -> Option<RecordHashes> {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let mut h = RecordHasher::new(chunk_size, total);
    for s in spans {
        let f = files.get(s.file)?.as_ref().ok()?;
        if s.end() > f.len {
            return None;
        }
        let mut off = s.offset;
        while off < s.end() {
            let n = ((s.end() - off) as usize).min(buf.len());
            read_exact_at(&f.file, &mut buf[..n], off).ok()?;
            h.update(&buf[..n]);
            off += n as u64;
            if let Some(p) = progress {
                p.add(n as u64);
            }
        }
    }
    Some(h.finish())
}

/// The plain computation of what [`run`] computes: each file's SHA-256 from a simple read
/// loop, then each tensor and each expert record read whole and hashed with one call.
pub(crate) fn reference(plan: &Plan) -> Outcome {
    use std::io::Read;
    let mut files = Vec::new();
    let mut handles = Vec::new();
    for (name, _) in &plan.files {
        let opened = File::open(plan.dir.join(name)).and_then(|f| {
            let len = f.metadata()?.len();
            Ok((f, len))
        });
        match opened {
            Err(e) => {
                files.push(FileOutcome {
                    len: None,
                    sha256: None,
                    error: Some(e.to_string()),
                });
                handles.push(None);
            }
            Ok((f, len)) => {
                let mut h = sha2::Sha256::new();
                let mut buf = vec![0u8; 1 << 20];
                let mut rd = &f;
                let mut left = len;
                let mut error = None;
                while left > 0 {
                    match rd.read(&mut buf[..(left.min(1 << 20)) as usize]) {
                        Ok(0) => {
                            error = Some("short read".to_string());
                            break;
                        }
                        Ok(n) => {
                            h.update(&buf[..n]);
                            left -= n as u64;
                        }
                        Err(e) => {
                            error = Some(e.to_string());
                            break;
                        }
                    }
                }
                files.push(FileOutcome {
                    len: Some(len),
                    sha256: error.is_none().then(|| Sha256(h.finalize().into())),
                    error,
                });
                handles.push(Some((f, len)));
            }
        }
    }
    let bytes_of = |s: &Span| -> Option<Vec<u8>> {
        let (f, len) = handles.get(s.file)?.as_ref()?;
        if s.end() > *len {
            return None;
        }
        let mut v = vec![0u8; s.len as usize];
        read_exact_at(f, &mut v, s.offset).ok()?;
        Some(v)
    };
    let tensors = plan
        .tensors
        .iter()
        .map(|s| bytes_of(s).map(|b| Hash::of(&b)))
        .collect();
    let experts = plan
        .experts
        .iter()
        .map(|spans| {
            let mut record = Vec::new();
            for s in spans {
                record.extend_from_slice(&bytes_of(s)?);
            }
            let chunks = record
                .chunks(plan.chunk_size as usize)
                .map(Hash::of)
                .collect();
            Some((Hash::of(&record), chunks))
        })
        .collect();
    Outcome {
        files,
        tensors,
        experts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    /// Files of random bytes, tensors tiling each file with random sizes (some empty, some
    /// crossing block boundaries), experts made of random tensor slices from any file in
    /// random record order.
    fn random_plan(dir: &Path, seed: u64, io: IoMode, budget: u64) -> Plan {
        let mut rng = Rng(seed | 1);
        let nfiles = 1 + rng.below(3) as usize;
        let mut files = Vec::new();
        let mut tensors = Vec::new();
        for f in 0..nfiles {
            // Up to ~2.5 blocks, so pieces straddle block boundaries.
            let len = if rng.below(4) == 0 {
                rng.below(5000)
            } else {
                rng.below(BLOCK as u64 * 5 / 2)
            };
            let mut bytes = vec![0u8; len as usize];
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = (i as u64 ^ seed ^ (i as u64 >> 9)).wrapping_mul(0x9E37) as u8;
            }
            let name = format!("f{f}.bin");
            std::fs::write(dir.join(&name), &bytes).unwrap();
            files.push((name, len));
            let mut at = 0;
            while at < len {
                let n = match rng.below(5) {
                    0 => 0,
                    1 => rng.below(300),
                    _ => rng.below(BLOCK as u64),
                }
                .min(len - at);
                tensors.push(Span {
                    file: f,
                    offset: at,
                    len: n,
                });
                at += n;
            }
        }
        let mut experts = Vec::new();
        for _ in 0..rng.below(40) {
            let mut parts = Vec::new();
            for _ in 0..rng.below(6) {
                let t = tensors[rng.below(tensors.len() as u64) as usize];
                let lo = rng.below(t.len + 1);
                let hi = lo + rng.below(t.len - lo + 1);
                parts.push(Span {
                    file: t.file,
                    offset: t.offset + lo,
                    len: hi - lo,
                });
            }
            experts.push(parts);
        }
        Plan {
            dir: dir.to_path_buf(),
            files,
            tensors,
            experts,
            chunk_size: 16 << 10,
            io,
            pending_budget: budget,
        }
    }

    #[test]
    fn pipeline_matches_reference_on_random_layouts_modes_and_budgets() {
        let dir = tempfile::tempdir().unwrap();
        for seed in 1..=6u64 {
            for (io, budget) in [
                (IoMode::Buffered, PENDING_BUDGET),
                (IoMode::Direct, PENDING_BUDGET),
                (IoMode::Buffered, 100 << 10), // most experts deferred
                (IoMode::Direct, 0),           // every out-of-order expert deferred
            ] {
                let plan = random_plan(dir.path(), seed * 7919, io, budget);
                let progress = Progress::new();
                let got = run(&plan, Some(&progress));
                let want = reference(&plan);
                assert_eq!(got, want, "seed {seed}, {io:?}, budget {budget}");
                assert!(got.experts.iter().all(Option::is_some));
                let (done, total) = progress.get();
                assert_eq!(done, total, "progress ends at its total");
            }
        }
    }

    #[test]
    fn truncated_and_missing_files_give_none_like_the_reference() {
        let dir = tempfile::tempdir().unwrap();
        let mut plan = random_plan(dir.path(), 99, IoMode::Direct, PENDING_BUDGET);
        // Cut the first file in half and remove the last (if there are two).
        let (name, len) = plan.files[0].clone();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(&name))
            .unwrap();
        f.set_len(len / 2).unwrap();
        plan.files.push(("absent.bin".into(), 10));
        plan.tensors.push(Span {
            file: plan.files.len() - 1,
            offset: 0,
            len: 10,
        });
        let got = run(&plan, None);
        assert_eq!(got, reference(&plan));
        assert!(got.files.last().unwrap().len.is_none());
        assert!(got.tensors.last().unwrap().is_none());
        if len > 2 {
            assert!(got.tensors.iter().any(Option::is_none));
        }
    }

    #[test]
    fn expert_parts_out_of_file_order_are_held_then_fed_in_record_order() {
        // Part 1 comes first in the file, part 0 last: with a budget the record is hashed
        // from the blocks (nothing deferred); with none it is deferred and re-read. Both
        // must give the record's true hash.
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..3 * BLOCK as u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.path().join("m.bin"), &bytes).unwrap();
        let spans = vec![
            Span {
                file: 0,
                offset: 2 * BLOCK as u64 + 5,
                len: BLOCK as u64 / 2,
            },
            Span {
                file: 0,
                offset: 7,
                len: BLOCK as u64 + 3,
            },
        ];
        let mut record = bytes[2 * BLOCK + 5..2 * BLOCK + 5 + BLOCK / 2].to_vec();
        record.extend_from_slice(&bytes[7..7 + BLOCK + 3]);
        for budget in [PENDING_BUDGET, 0] {
            let plan = Plan {
                dir: dir.path().to_path_buf(),
                files: vec![("m.bin".into(), bytes.len() as u64)],
                tensors: vec![],
                experts: vec![spans.clone()],
                chunk_size: 1 << 20,
                io: IoMode::Buffered,
                pending_budget: budget,
            };
            let progress = Progress::new();
            let out = run(&plan, Some(&progress));
            let (hash, chunks) = out.experts[0].clone().unwrap();
            assert_eq!(hash, Hash::of(&record));
            assert_eq!(chunks[0], Hash::of(&record[..1 << 20]));
            // Deferred: the record's bytes are read a second time, and progress says so.
            let extra = if budget == 0 { record.len() as u64 } else { 0 };
            assert_eq!(progress.get().1, bytes.len() as u64 + extra);
        }
    }

    #[test]
    fn read_files_reads_every_byte() {
        let dir = tempfile::tempdir().unwrap();
        let names: Vec<String> = (0..3).map(|i| format!("r{i}")).collect();
        let mut total = 0;
        for (i, n) in names.iter().enumerate() {
            let len = i * BLOCK + 12345;
            std::fs::write(dir.path().join(n), vec![7u8; len]).unwrap();
            total += len as u64;
        }
        for io in [IoMode::Buffered, IoMode::Direct] {
            let p = Progress::new();
            assert_eq!(read_files(dir.path(), &names, io, Some(&p)).unwrap(), total);
            assert_eq!(p.get(), (total, total));
        }
        let missing = read_files(dir.path(), &["nope".to_string()], IoMode::Buffered, None);
        assert!(missing.unwrap_err().to_string().contains("nope"));
    }
}
