//! Streaming a [`Plan`] to disk at disk speed.
//!
//! The calling thread generates batches of chunks in parallel (rayon) while a writer thread
//! writes the previous batch, so generation and I/O overlap and at most a few batches are in
//! memory. Each shard is written to `NAME.partial`, synced and renamed when complete; the JSON
//! files come last, the index last of all, so an interrupted run never leaves a folder that
//! looks like a complete checkpoint.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::{Plan, SynthError};

/// Bytes generated per job (the unit of parallel work).
const CHUNK: u64 = 4 << 20;
/// Jobs per batch handed to the writer.
const BATCH: usize = 8;

/// Where a write stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// Bytes written so far (headers and JSON included).
    pub written: u64,
    /// Bytes to write in all.
    pub total: u64,
    /// Time since the write began.
    pub elapsed: Duration,
}

impl Progress {
    /// Bytes per second so far.
    pub fn rate(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.written as f64 / s
        } else {
            0.0
        }
    }

    /// Time left at the rate so far (None before anything is written).
    pub fn eta(&self) -> Option<Duration> {
        let r = self.rate();
        (r > 0.0)
            .then(|| Duration::from_secs_f64(self.total.saturating_sub(self.written) as f64 / r))
    }
}

/// What a write produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Every file written, with its size in bytes, shards first.
    pub files: Vec<(String, u64)>,
    /// Sum of the file sizes.
    pub bytes: u64,
    /// Wall time of the whole write (shards synced to disk).
    pub elapsed: Duration,
}

/// One unit of parallel work: a byte range of one tensor.
#[derive(Clone, Copy, Debug)]
struct Job {
    shard: usize,
    tensor: usize,
    start: u64,
    len: usize,
}

const JSON_FILES: [&str; 3] = [
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
];

/// Writes `plan` into `dir` (created if missing), calling `on_progress` now and then.
///
/// Refuses a folder that already holds a checkpoint file (`*.safetensors`, its index or
/// `config.json`) unless `force`, in which case those files are replaced and stale shards of
/// an earlier checkpoint removed.
pub fn write(
    plan: &Plan,
    dir: &Path,
    force: bool,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<Report, SynthError> {
    let t0 = Instant::now();
    prepare_dir(dir, force)?;
    let json: Vec<(&str, String)> = vec![
        (JSON_FILES[0], plan.config_json()),
        (JSON_FILES[1], plan.generation_config_json()),
        (JSON_FILES[2], plan.index_json()),
    ];
    let total = plan.files_size() + json.iter().map(|(_, s)| s.len() as u64).sum::<u64>();
    let written = AtomicU64::new(0);

    let mut jobs = Vec::new();
    for (s, shard) in plan.shards.iter().enumerate() {
        for &t in &shard.tensors {
            let len = plan.tensors[t].len;
            let mut start = 0;
            while start < len {
                let n = CHUNK.min(len - start);
                jobs.push(Job {
                    shard: s,
                    tensor: t,
                    start,
                    len: n as usize,
                });
                start += n;
            }
        }
    }

    let mut last_report = Instant::now();
    let mut report = |force_now: bool, on_progress: &mut dyn FnMut(&Progress)| {
        if force_now || last_report.elapsed() >= Duration::from_millis(250) {
            last_report = Instant::now();
            on_progress(&Progress {
                written: written.load(Ordering::Relaxed),
                total,
                elapsed: t0.elapsed(),
            });
        }
    };

    let result = std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<Vec<(usize, Vec<u8>)>>(1);
        let (back_tx, back_rx) = mpsc::channel::<Vec<u8>>();
        let writer = scope.spawn(|| write_shards(plan, dir, rx, back_tx, &written));
        for batch in jobs.chunks(BATCH) {
            let mut bufs: Vec<(usize, Vec<u8>)> = batch
                .iter()
                .map(|j| (j.shard, back_rx.try_recv().unwrap_or_default()))
                .collect();
            bufs.par_iter_mut()
                .zip(batch.par_iter())
                .for_each(|((_, buf), job)| {
                    buf.clear();
                    buf.resize(job.len, 0);
                    plan.fill(job.tensor, job.start, buf);
                });
            if tx.send(bufs).is_err() {
                break; // the writer failed; its error is returned by join
            }
            report(false, on_progress);
        }
        drop(tx);
        writer.join().expect("the shard writer does not panic")
    });
    result?;

    let mut files: Vec<(String, u64)> = plan
        .shards
        .iter()
        .map(|s| (s.file_name.clone(), s.file_len()))
        .collect();
    for (name, text) in &json {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| SynthError::io(&path, e))?;
        written.fetch_add(text.len() as u64, Ordering::Relaxed);
        files.push((name.to_string(), text.len() as u64));
    }
    report(true, on_progress);
    Ok(Report {
        bytes: files.iter().map(|(_, n)| n).sum(),
        files,
        elapsed: t0.elapsed(),
    })
}

/// The writer thread: opens each shard in turn, writes its header and the data it receives.
fn write_shards(
    plan: &Plan,
    dir: &Path,
    rx: mpsc::Receiver<Vec<(usize, Vec<u8>)>>,
    back: mpsc::Sender<Vec<u8>>,
    written: &AtomicU64,
) -> Result<(), SynthError> {
    let mut open: Option<OpenShard> = None;
    let result = (|| {
        for batch in rx {
            for (s, buf) in batch {
                if open.as_ref().map(|o| o.index) != Some(s) {
                    if let Some(o) = open.take() {
                        o.finish(plan)?;
                    }
                    let o = OpenShard::create(plan, dir, s)?;
                    written.fetch_add(plan.shards[s].header.len() as u64, Ordering::Relaxed);
                    open = Some(o);
                }
                let o = open.as_mut().expect("a shard is open");
                o.file
                    .write_all(&buf)
                    .map_err(|e| SynthError::io(&o.partial, e))?;
                o.remaining -= buf.len() as u64;
                written.fetch_add(buf.len() as u64, Ordering::Relaxed);
                let _ = back.send(buf);
            }
        }
        if let Some(o) = open.take() {
            o.finish(plan)?;
        }
        Ok(())
    })();
    if result.is_err() {
        if let Some(o) = open {
            let _ = std::fs::remove_file(&o.partial);
        }
    }
    result
}

struct OpenShard {
    index: usize,
    file: File,
    partial: PathBuf,
    done: PathBuf,
    remaining: u64,
}

impl OpenShard {
    fn create(plan: &Plan, dir: &Path, index: usize) -> Result<Self, SynthError> {
        let shard = &plan.shards[index];
        let done = dir.join(&shard.file_name);
        let partial = dir.join(format!("{}.partial", shard.file_name));
        let mut file = File::create(&partial).map_err(|e| SynthError::io(&partial, e))?;
        file.write_all(&shard.header)
            .map_err(|e| SynthError::io(&partial, e))?;
        Ok(Self {
            index,
            file,
            partial,
            done,
            remaining: shard.data_len,
        })
    }

    fn finish(self, plan: &Plan) -> Result<(), SynthError> {
        if self.remaining != 0 {
            let _ = std::fs::remove_file(&self.partial);
            return Err(SynthError::io(
                &self.partial,
                std::io::Error::other(format!(
                    "{} bytes of {} were never generated",
                    self.remaining, plan.shards[self.index].file_name
                )),
            ));
        }
        self.file
            .sync_all()
            .map_err(|e| SynthError::io(&self.partial, e))?;
        std::fs::rename(&self.partial, &self.done).map_err(|e| SynthError::io(&self.done, e))
    }
}

/// Is this one of the files a checkpoint written here would consist of?
fn is_checkpoint_file(name: &str) -> bool {
    name.ends_with(".safetensors")
        || name.ends_with(".safetensors.partial")
        || JSON_FILES.contains(&name)
}

/// The names of the files in `dir` that [`write()`] with `force` replaces (`*.safetensors`, a
/// shard left `.partial`, `config.json`, `generation_config.json`, the index), sorted; none
/// when `dir` does not exist.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<String>, SynthError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(SynthError::io(dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| SynthError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_checkpoint_file(&name) {
            found.push(name);
        }
    }
    found.sort();
    Ok(found)
}

fn prepare_dir(dir: &Path, force: bool) -> Result<(), SynthError> {
    std::fs::create_dir_all(dir).map_err(|e| SynthError::io(dir, e))?;
    let found = checkpoint_files(dir)?;
    if let Some(first) = found.first() {
        if !force {
            return Err(SynthError::OutputExists {
                dir: dir.to_path_buf(),
                file: first.clone(),
            });
        }
        for name in &found {
            let path = dir.join(name);
            std::fs::remove_file(&path).map_err(|e| SynthError::io(&path, e))?;
        }
    }
    Ok(())
}
