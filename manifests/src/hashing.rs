//! The hashing engine shared by build and verify: every file's SHA-256, every tensor's
//! BLAKE3 and every expert record's hashes, reading each file once, sequentially.
//!
//! Per file, a reader thread reads large blocks and hands each one to two hasher threads at
//! once: one computes the file's SHA-256, the other feeds the BLAKE3 of every tensor the block
//! overlaps. Expert records are hashed by a pool of threads that each wait until the readers
//! have passed all of a record's bytes, then read them back with positioned reads (from the
//! page cache, as they were just read), so the disk is read once in order while both cores
//! hash. Nothing here panics on a short, missing or unreadable file: what could not be hashed
//! comes back as `None` with the reason.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};

use sha2::Digest;

use crate::hash::Hash;
use crate::manifest::Sha256;
use crate::record::RecordHasher;

/// Bytes per read of the sequential readers.
const BLOCK: usize = 8 << 20;
/// Buffers in flight per file.
const BUFFERS: usize = 4;
/// Bytes per positioned read of expert parts.
const PIECE: usize = 1 << 20;

/// Progress of a long build or verify, in bytes; read it from another thread.
#[derive(Debug, Default)]
pub struct Progress {
    total: AtomicU64,
    done: AtomicU64,
}

impl Progress {
    /// A new counter at zero.
    pub fn new() -> Self {
        Self::default()
    }
    /// (bytes done, bytes total). The total is known once hashing starts (0 before).
    pub fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
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
    /// File names in `dir`, with the length each is expected to have (for progress).
    pub(crate) files: Vec<(String, u64)>,
    pub(crate) tensors: Vec<Span>,
    pub(crate) experts: Vec<Vec<Span>>,
    pub(crate) chunk_size: u32,
}

/// What one file gave.
#[derive(Debug, Default)]
pub(crate) struct FileOutcome {
    /// Its length on disk (None if it could not be opened).
    pub(crate) len: Option<u64>,
    /// SHA-256 of all its bytes (None on a read error).
    pub(crate) sha256: Option<Sha256>,
    /// Why it could not be opened or read.
    pub(crate) error: Option<String>,
}

/// The hashes: `None` where the bytes could not be read in full.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) files: Vec<FileOutcome>,
    pub(crate) tensors: Vec<Option<Hash>>,
    pub(crate) experts: Vec<Option<RecordHashes>>,
}

/// How far each file's reader has got (u64::MAX once it has stopped).
#[derive(Debug)]
struct Watermarks {
    pos: Mutex<Vec<u64>>,
    moved: Condvar,
}

impl Watermarks {
    fn set(&self, file: usize, pos: u64) {
        let mut g = self.pos.lock().unwrap_or_else(|e| e.into_inner());
        g[file] = pos;
        drop(g);
        self.moved.notify_all();
    }

    fn wait_past(&self, spans: &[Span]) {
        let mut g = self.pos.lock().unwrap_or_else(|e| e.into_inner());
        while !spans.iter().all(|s| g[s.file] >= s.end()) {
            g = self.moved.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Marks a file's reader finished however it leaves (also on a panic), so that expert
/// threads waiting on it never hang.
struct Finished<'a>(&'a Watermarks, usize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.set(self.1, u64::MAX);
    }
}

pub(crate) fn run(plan: &Plan, progress: Option<&Progress>) -> Outcome {
    let nfiles = plan.files.len();
    let opened: Vec<Result<(File, u64), String>> = plan
        .files
        .iter()
        .map(|(name, _)| {
            let path = plan.dir.join(name);
            let f = File::open(&path).map_err(|e| e.to_string())?;
            let len = f.metadata().map_err(|e| e.to_string())?.len();
            Ok((f, len))
        })
        .collect();
    if let Some(p) = progress {
        let files: u64 = opened
            .iter()
            .map(|o| o.as_ref().map_or(0, |(_, l)| *l))
            .sum();
        let experts: u64 = plan.experts.iter().flatten().map(|s| s.len).sum();
        p.total.store(files + experts, Ordering::Relaxed);
    }

    // Tensor spans of each file, by offset.
    let mut per_file: Vec<Vec<usize>> = vec![Vec::new(); nfiles];
    for (i, s) in plan.tensors.iter().enumerate() {
        if s.file < nfiles {
            per_file[s.file].push(i);
        }
    }
    for v in &mut per_file {
        v.sort_by_key(|&i| plan.tensors[i].offset);
    }

    // Experts in the order the readers make them available.
    let mut order: Vec<usize> = (0..plan.experts.len()).collect();
    order.sort_by_key(|&i| {
        plan.experts[i]
            .iter()
            .map(|s| (s.file, s.end()))
            .max()
            .unwrap_or((0, 0))
    });

    let marks = Watermarks {
        pos: Mutex::new(vec![0; nfiles]),
        moved: Condvar::new(),
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next_file = AtomicUsize::new(0);
    let next_expert = AtomicUsize::new(0);
    let file_out: Vec<Mutex<FileResult>> = (0..nfiles)
        .map(|_| Mutex::new((FileOutcome::default(), Vec::new())))
        .collect();
    let expert_out: Vec<Mutex<Option<RecordHashes>>> =
        (0..plan.experts.len()).map(|_| Mutex::new(None)).collect();

    std::thread::scope(|s| {
        for _ in 0..cores.min(nfiles) {
            s.spawn(|| loop {
                let f = next_file.fetch_add(1, Ordering::Relaxed);
                if f >= nfiles {
                    break;
                }
                let _finished = Finished(&marks, f);
                let spans: Vec<(usize, Span)> =
                    per_file[f].iter().map(|&i| (i, plan.tensors[i])).collect();
                let result = match &opened[f] {
                    Err(e) => (
                        FileOutcome {
                            len: None,
                            sha256: None,
                            error: Some(e.clone()),
                        },
                        spans.iter().map(|(i, _)| (*i, None)).collect(),
                    ),
                    Ok((file, len)) => hash_file(file, *len, &spans, f, &marks, progress),
                };
                *file_out[f].lock().unwrap_or_else(|e| e.into_inner()) = result;
            });
        }
        if !plan.experts.is_empty() {
            for _ in 0..cores {
                s.spawn(|| {
                    let mut buf = vec![0u8; PIECE];
                    loop {
                        let k = next_expert.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = order.get(k) else { break };
                        let spans = &plan.experts[i];
                        marks.wait_past(spans);
                        let r = hash_expert(&opened, spans, plan.chunk_size, &mut buf, progress);
                        *expert_out[i].lock().unwrap_or_else(|e| e.into_inner()) = r;
                    }
                });
            }
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
    let experts = expert_out
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect();
    Outcome {
        files,
        tensors,
        experts,
    }
}

type Block = Arc<(Vec<u8>, u64, usize)>;
/// A record's hash and its chunk hashes.
type RecordHashes = (Hash, Vec<Hash>);
/// One file's outcome and its tensors' hashes.
type FileResult = (FileOutcome, Vec<(usize, Option<Hash>)>);

/// Reads one file sequentially; SHA-256 and the tensors' BLAKE3 on two threads.
fn hash_file(
    file: &File,
    len: u64,
    spans: &[(usize, Span)],
    index: usize,
    marks: &Watermarks,
    progress: Option<&Progress>,
) -> FileResult {
    let (sha_tx, sha_rx) = sync_channel::<Block>(BUFFERS);
    let (t_tx, t_rx) = sync_channel::<Block>(BUFFERS);
    let (back_tx, back_rx) = sync_channel::<Block>(2 * BUFFERS + 2);
    std::thread::scope(|s| {
        let back2 = back_tx.clone();
        let sha = s.spawn(move || {
            let mut h = sha2::Sha256::new();
            for b in sha_rx {
                h.update(&b.0[..b.2]);
                let _ = back2.try_send(b);
            }
            Sha256(h.finalize().into())
        });
        let back3 = back_tx.clone();
        let tensors = s.spawn(move || tensor_hashes(spans, t_rx, back3));
        drop(back_tx);
        let read = read_blocks(file, len, index, marks, progress, &sha_tx, &t_tx, &back_rx);
        drop(sha_tx);
        drop(t_tx);
        let sha = sha.join().expect("the SHA-256 thread does not panic");
        let tensors = tensors
            .join()
            .expect("the tensor hash thread does not panic");
        let outcome = match read {
            Ok(()) => FileOutcome {
                len: Some(len),
                sha256: Some(sha),
                error: None,
            },
            Err(e) => FileOutcome {
                len: Some(len),
                sha256: None,
                error: Some(e.to_string()),
            },
        };
        (outcome, tensors)
    })
}

#[allow(clippy::too_many_arguments)]
fn read_blocks(
    mut file: &File,
    len: u64,
    index: usize,
    marks: &Watermarks,
    progress: Option<&Progress>,
    sha_tx: &SyncSender<Block>,
    t_tx: &SyncSender<Block>,
    back_rx: &Receiver<Block>,
) -> std::io::Result<()> {
    use std::io::Read;
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut made = 0;
    let mut pos = 0u64;
    loop {
        // A buffer: a returned one both hashers are done with, else a new one.
        let mut buf = loop {
            if let Some(b) = spare.pop() {
                break b;
            }
            if made < BUFFERS {
                made += 1;
                break vec![0u8; BLOCK];
            }
            match back_rx.recv() {
                Ok(b) => {
                    if let Ok((v, _, _)) = Arc::try_unwrap(b) {
                        spare.push(v);
                    }
                }
                Err(_) => break vec![0u8; BLOCK],
            }
        };
        let mut n = 0;
        while n < buf.len() {
            match file.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if n == 0 {
            return Ok(());
        }
        let block: Block = Arc::new((buf, pos, n));
        pos += n as u64;
        if let Some(p) = progress {
            p.add(n as u64);
        }
        marks.set(index, pos.min(len));
        if sha_tx.send(block.clone()).is_err() || t_tx.send(block).is_err() {
            return Err(std::io::Error::other("a hasher thread stopped"));
        }
    }
}

/// Feeds each tensor's BLAKE3 with the parts of the blocks it overlaps.
fn tensor_hashes(
    spans: &[(usize, Span)],
    rx: Receiver<Block>,
    back: SyncSender<Block>,
) -> Vec<(usize, Option<Hash>)> {
    let mut hashers: Vec<Option<blake3::Hasher>> = vec![None; spans.len()];
    let mut out: Vec<(usize, Option<Hash>)> = spans.iter().map(|(i, _)| (*i, None)).collect();
    let mut first = 0; // spans before this one are finished
    let mut seen = 0u64;
    for b in rx {
        let (buf, start, n) = (&b.0, b.1, b.2);
        let end = start + n as u64;
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
        let _ = back.try_send(b);
    }
    // Empty tensors at the very end of the file.
    for (k, (_, s)) in spans.iter().enumerate() {
        if s.len == 0 && s.offset <= seen && out[k].1.is_none() {
            out[k].1 = Some(Hash::of(&[]));
        }
    }
    out
}

/// Reads and hashes one expert record (parts in order) with positioned reads.
fn hash_expert(
    files: &[Result<(File, u64), String>],
    spans: &[Span],
    chunk_size: u32,
    buf: &mut [u8],
    progress: Option<&Progress>,
) -> Option<RecordHashes> {
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let mut h = RecordHasher::new(chunk_size, total);
    for s in spans {
        let (file, len) = files.get(s.file)?.as_ref().ok()?;
        if s.end() > *len {
            return None;
        }
        let mut off = s.offset;
        while off < s.end() {
            let n = ((s.end() - off) as usize).min(buf.len());
            read_exact_at(file, &mut buf[..n], off).ok()?;
            h.update(&buf[..n]);
            off += n as u64;
            if let Some(p) = progress {
                p.add(n as u64);
            }
        }
    }
    Some(h.finish())
}

#[cfg(unix)]
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset) {
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
