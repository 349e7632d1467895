//! The prompt cache on disk (`serve --http --prompt-cache SIZE`): the KV cache of the
//! prompts the server has run, kept in the state directory across restarts, so that a
//! request whose prompt starts with one already seen (a conversation's next turn, a long
//! system prompt many clients share) loads that prefix instead of computing it.
//!
//! Owns: the files under `STATE/prompt-cache/`, their names, the bound on their size and
//! which of them go first. The engine thread ([`super::batch`]) asks it for a prompt's prefix
//! when it admits a request (after taking what a slot's cache in RAM shares with the prompt)
//! and hands it a slot's positions when a request ends.
//!
//! A prompt is cut into chunks of [`CHUNK`] positions; chunk `i` is one span file
//! ([`Session::save_span`]) of positions `i·CHUNK .. (i+1)·CHUNK`, named by a chained key:
//! `key(-1)` is the model's [`Model::kv_identity`] (its weights, its 8-bit copies, and with
//! int8-input experts the instruction set), and `key(i) = BLAKE3(key(i-1), ids of chunk i)`,
//! so a key names the whole prefix up to its chunk's end. Prompts that share a prefix share
//! its files; a conversation's turns store each chunk once. Only whole chunks are kept: the
//! last `< CHUNK` positions of a prompt are computed again. The file is
//! `STATE/prompt-cache/IDENTITY/KEY.kv` (IDENTITY: [`Model::identity`]), and holds its key
//! among its bytes, which loading compares: a file under another name is not trusted.
//!
//! Exactness: a loaded chunk holds the bits a prefill of its ids would compute, because a
//! position's keys and values do not depend on how the positions were split into blocks or
//! batched with other requests (the engine computes each position on its own; see the
//! engine's `model/persist.rs` and its test `loaded_spans_continue_bit_for_bit_whatever_
//! computed_them`), and every setting that does change them is in the key. So a reply with a
//! cache hit is the reply without it, greedy or sampled with a seed.
//!
//! Bounded on disk: the `.kv` files under `STATE/prompt-cache/` (every model's) total at most
//! SIZE, least recently used first out. A chunk is "used" when it is written or loaded, and
//! a prompt's chunks are marked used last one first, so chunk 0 is the most recent and a
//! prefix outlives its tail (a tail without its prefix is never reachable). A request's save
//! never evicts the chunks it saved itself: when SIZE holds less than its prompt, its first
//! chunks are kept. The order lives in memory and in the files' modification times (read
//! back at start). Files are written to a temporary name and renamed, without fsync: a file
//! cut by a crash fails its checksum. A file that fails to load (cut, corrupt, written by
//! another model or under another name, gone) is removed and counted in /metrics, and the
//! request computes the rest; it never fails a request and never panics. A save that fails
//! (disk full) is logged and the request is answered as usual.
//!
//! The files are read and written on the engine thread: a chunk's load or save is a memory
//! copy and a file read or write (for gpt-oss-20b, 96 KiB a position, 6 MiB a chunk), far less
//! than computing its 64 positions.
//!
//! Non-goals: two servers sharing a state directory at once (each keeps its own count, so
//! the bound may be passed; the files stay whole), prefixes shorter than a chunk.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use anyhow::Context as _;
use stormo_engine::{Model, Session};
use stormo_text::TokenId;

use super::metrics::Metrics;

/// Positions per file: the granularity of reuse.
pub(super) const CHUNK: usize = 64;

/// The files' extension, and the temporary files'.
const EXT: &str = "kv";
const TMP: &str = "tmp";

/// Where the prompt cache lives and how large it may grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptCacheConfig {
    /// `STATE/prompt-cache`: each model's files go in a folder under it.
    pub dir: PathBuf,
    /// The most bytes its files take, all models together.
    pub limit: u64,
}

/// A file's size and when it was last used.
#[derive(Debug, Clone, Copy)]
struct Entry {
    size: u64,
    used: u64,
}

/// The prompt cache of one model.
#[derive(Debug)]
pub(super) struct PromptCache {
    /// This model's folder.
    dir: PathBuf,
    limit: u64,
    /// The key chain's start.
    root: [u8; 32],
    /// Every cache file (all models'), and the same by last use, oldest first.
    files: HashMap<PathBuf, Entry>,
    by_use: BTreeMap<u64, PathBuf>,
    clock: u64,
    total: u64,
    metrics: Arc<Metrics>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl PromptCache {
    /// Opens (or makes) the cache in `cfg.dir` for `model`: takes stock of the files there
    /// (removing temporary ones a crash left), and evicts down to the limit if it shrank.
    pub(super) fn open(
        cfg: &PromptCacheConfig,
        model: &Model,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let identity = model.identity().context("the model's identity")?;
        let root = model.kv_identity().context("the model's identity")?;
        let dir = cfg.dir.join(hex(&identity));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("making the prompt cache's folder {}", dir.display()))?;
        let mut found = Vec::new();
        let models = std::fs::read_dir(&cfg.dir)
            .with_context(|| format!("reading the prompt cache's folder {}", cfg.dir.display()))?;
        for m in models.flatten() {
            let Ok(files) = std::fs::read_dir(m.path()) else {
                continue;
            };
            for f in files.flatten() {
                let path = f.path();
                let Ok(meta) = f.metadata() else { continue };
                if !meta.is_file() {
                    continue;
                }
                match path.extension().and_then(|e| e.to_str()) {
                    Some(EXT) => {
                        let t = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                        found.push((t, path, meta.len()));
                    }
                    Some(TMP) => {
                        let _ = std::fs::remove_file(&path);
                    }
                    _ => {}
                }
            }
        }
        found.sort();
        let mut pc = Self {
            dir,
            limit: cfg.limit,
            root,
            files: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
            total: 0,
            metrics,
        };
        for (_, path, size) in found {
            pc.total += size;
            pc.clock += 1;
            pc.by_use.insert(pc.clock, path.clone());
            pc.files.insert(
                path,
                Entry {
                    size,
                    used: pc.clock,
                },
            );
        }
        pc.make_room(0, u64::MAX);
        pc.gauges();
        tracing::info!(
            "prompt cache: {} files, {} of {} in {}",
            pc.files.len(),
            stormo_net::progress::human_bytes(pc.total),
            stormo_net::progress::human_bytes(pc.limit),
            cfg.dir.display()
        );
        Ok(pc)
    }

    /// The keys of the first `n` chunks of `ids`.
    fn keys(&self, ids: &[TokenId], n: usize) -> Vec<[u8; 32]> {
        let mut key = self.root;
        ids.chunks_exact(CHUNK)
            .take(n)
            .map(|chunk| {
                let mut h = blake3::Hasher::new();
                h.update(&key);
                for id in chunk {
                    h.update(&id.to_le_bytes());
                }
                key = *h.finalize().as_bytes();
                key
            })
            .collect()
    }

    fn path(&self, key: &[u8; 32]) -> PathBuf {
        self.dir.join(format!("{}.{EXT}", hex(key)))
    }

    /// Extends `sess`, which holds a prefix of `ids`, with the chunks of `ids` the cache has
    /// beyond it (it may first go back to the start of the chunk its position is in).
    /// Returns the session's position (a prefix of `ids`), and how many positions more than
    /// it held the files gave.
    pub(super) fn load(
        &mut self,
        model: &Model,
        sess: &mut Session,
        ids: &[TokenId],
    ) -> (usize, usize) {
        let held = sess.position();
        let n = ids.len() / CHUNK;
        if n * CHUNK <= held {
            return (held, 0);
        }
        let keys = self.keys(ids, n);
        let mut first = held / CHUNK;
        let present = |first: usize| {
            keys[first..]
                .iter()
                .take_while(|k| self.files.contains_key(&self.path(k)))
                .count()
        };
        let mut count = present(first);
        if (first + count) * CHUNK <= held {
            return (held, 0);
        }
        if sess.truncate(first * CHUNK) != first * CHUNK {
            // The session could not go back there (cannot happen with the server's slots,
            // which keep their whole context): from the start.
            sess.truncate(0);
            first = 0;
            count = present(0);
        }
        let t = Instant::now();
        let mut loaded = 0;
        for key in &keys[first..first + count] {
            if let Err(why) = self.load_one(model, sess, key) {
                tracing::warn!("prompt cache: ignoring a file that {why}");
                self.remove(&self.path(key));
                self.metrics.prompt_cache_rejected.inc();
                break;
            }
            loaded += 1;
        }
        // Marked used last chunk first, so the prefix is the most recent.
        for key in keys[first..first + loaded].iter().rev() {
            self.touch(&self.path(key));
        }
        let pos = sess.position();
        let gained = pos.saturating_sub(held);
        if gained > 0 {
            tracing::info!(
                "prompt cache: {gained} more prompt positions from {loaded} files in {:.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        (pos, gained)
    }

    /// Loads the chunk named `key` at the session's position; on an error, the session is
    /// where it was (or, if it could not go back, at 0) and the error says why.
    fn load_one(&self, model: &Model, sess: &mut Session, key: &[u8; 32]) -> Result<(), String> {
        let path = self.path(key);
        let file = std::fs::File::open(&path)
            .map_err(|e| format!("cannot be opened ({}: {e})", path.display()))?;
        let start = sess.position();
        let (span, app) = sess
            .load_span(model, &mut std::io::BufReader::new(file))
            .map_err(|e| {
                format!(
                    "is not a whole chunk of this model ({}: {e})",
                    path.display()
                )
            })?;
        if app != key || span.start != start || span.len() != CHUNK {
            sess.truncate(start);
            return Err(format!(
                "holds another prefix than its name says ({})",
                path.display()
            ));
        }
        Ok(())
    }

    /// Saves the whole chunks of `ids`, the ids whose positions `sess` holds, that are not
    /// saved yet, and marks those that are as used.
    pub(super) fn save(&mut self, model: &Model, sess: &Session, ids: &[TokenId]) {
        let n = ids.len().min(sess.position()) / CHUNK;
        if n == 0 {
            return;
        }
        let keys = self.keys(ids, n);
        // Files marked used from here on are this save's: it never evicts them.
        let mine = self.clock + 1;
        let mut kept = 0;
        for (i, key) in keys.iter().enumerate() {
            let path = self.path(key);
            if self.files.contains_key(&path) {
                self.touch(&path);
                kept += 1;
                continue;
            }
            match self.write(model, sess, i, key, &path, mine) {
                Ok(true) => kept += 1,
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!("prompt cache: not saved: {e:#}");
                    break;
                }
            }
        }
        for key in keys[..kept].iter().rev() {
            self.touch(&self.path(key));
        }
        self.gauges();
    }

    /// Writes chunk `i` of `sess` to `path`; false when the limit leaves no room for it
    /// without evicting what was used since `mine`.
    fn write(
        &mut self,
        model: &Model,
        sess: &Session,
        i: usize,
        key: &[u8; 32],
        path: &Path,
        mine: u64,
    ) -> anyhow::Result<bool> {
        let mut bytes = Vec::new();
        sess.save_span(model, i * CHUNK..(i + 1) * CHUNK, key, &mut bytes)
            .context("the chunk")?;
        let size = bytes.len() as u64;
        if !self.make_room(size, mine) {
            return Ok(false);
        }
        let tmp = path.with_extension(TMP);
        let written = std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&bytes))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("writing {}", path.display()));
        }
        self.total += size;
        self.clock += 1;
        self.by_use.insert(self.clock, path.to_path_buf());
        self.files.insert(
            path.to_path_buf(),
            Entry {
                size,
                used: self.clock,
            },
        );
        Ok(true)
    }

    /// Evicts the least recently used files until `size` more bytes fit, never one used
    /// since `mine`; false if they cannot fit.
    fn make_room(&mut self, size: u64, mine: u64) -> bool {
        if size > self.limit {
            return false;
        }
        while self.total + size > self.limit {
            let Some((&used, path)) = self.by_use.iter().next() else {
                return false;
            };
            if used >= mine {
                return false;
            }
            let path = path.clone();
            self.remove(&path);
            self.metrics.prompt_cache_evictions.inc();
        }
        true
    }

    /// Forgets the file at `path` and removes it.
    fn remove(&mut self, path: &Path) {
        if let Some(e) = self.files.remove(path) {
            self.by_use.remove(&e.used);
            self.total -= e.size;
        }
        if let Err(e) = std::fs::remove_file(path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("prompt cache: removing {}: {e}", path.display());
            }
        }
        self.gauges();
    }

    /// Marks the file at `path` used now (in memory and in its modification time).
    fn touch(&mut self, path: &Path) {
        let Some(e) = self.files.get_mut(path) else {
            return;
        };
        self.by_use.remove(&e.used);
        self.clock += 1;
        e.used = self.clock;
        self.by_use.insert(self.clock, path.to_path_buf());
        let stamped = std::fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_modified(SystemTime::now()));
        if let Err(e) = stamped {
            tracing::debug!("prompt cache: marking {} used: {e}", path.display());
        }
    }

    fn gauges(&self) {
        self.metrics
            .prompt_cache_bytes
            .set(i64::try_from(self.total).unwrap_or(i64::MAX));
        self.metrics
            .prompt_cache_files
            .set(i64::try_from(self.files.len()).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormo_engine::{LoadOptions, Logits};

    fn tiny() -> Model {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gptoss-tiny-mxfp4");
        Model::load(&dir, &LoadOptions::default()).expect("the fixture loads")
    }

    fn ids(n: usize, salt: u32) -> Vec<TokenId> {
        (0..n as u32).map(|i| (i * 37 + salt) % 2000).collect()
    }

    fn open(dir: &Path, limit: u64, model: &Model) -> PromptCache {
        let metrics = Arc::new(Metrics::new(Arc::new(|| None), true));
        let cfg = PromptCacheConfig {
            dir: dir.to_path_buf(),
            limit,
        };
        PromptCache::open(&cfg, model, metrics).expect("opens")
    }

    /// A session that ran `prompt`.
    fn ran(model: &Model, prompt: &[TokenId]) -> Session {
        let mut s = model.session_with_rewind(256, 256).unwrap();
        model.forward(&mut s, prompt, Logits::Last, None).unwrap();
        s
    }

    /// The whole chunks of a prompt saved by one cache are found by a cache opened again on
    /// the folder (a restart), loaded beyond what a session holds, and continue as the
    /// session that computed them, bit for bit; a prompt that diverges inside a chunk gets
    /// the chunks before it.
    #[test]
    fn saved_chunks_load_after_a_restart_and_continue_bit_for_bit() {
        let model = tiny();
        let dir = tempfile::tempdir().unwrap();
        let prompt = ids(200, 3);
        let a = ran(&model, &prompt);
        open(dir.path(), 1 << 30, &model).save(&model, &a, &prompt);
        let mut pc = open(dir.path(), 1 << 30, &model);
        assert_eq!(pc.files.len(), 3, "200 positions: 3 whole chunks");
        let mut b = model.session_with_rewind(256, 256).unwrap();
        // It holds 10 positions already (from RAM): the files give the rest of 192.
        model
            .forward(&mut b, &prompt[..10], Logits::Last, None)
            .unwrap();
        assert_eq!(pc.load(&model, &mut b, &prompt), (192, 182));
        let mut c = ran(&model, &prompt[..192]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let lb = bits(
            model
                .forward(&mut b, &prompt[192..], Logits::All, None)
                .unwrap(),
        );
        let lc = bits(
            model
                .forward(&mut c, &prompt[192..], Logits::All, None)
                .unwrap(),
        );
        assert_eq!(lb, lc);
        // Diverging at 100: the first chunk only.
        let mut other = prompt.clone();
        other[100] += 1;
        let mut d = model.session_with_rewind(256, 256).unwrap();
        assert_eq!(pc.load(&model, &mut d, &other), (64, 64));
        // Another model's cache (other settings: 8-bit attention) finds nothing.
        let int8 = Model::load(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gptoss-tiny-mxfp4"),
            &LoadOptions {
                int8_attn_head: true,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let mut e = int8.session_with_rewind(256, 256).unwrap();
        assert_eq!(
            open(dir.path(), 1 << 30, &int8).load(&int8, &mut e, &prompt),
            (0, 0)
        );
    }

    /// Within the limit, the least recently used chunks go first, a prompt's tail before its
    /// prefix, and a save never evicts its own chunks: the first that fit are kept. A smaller
    /// limit at start evicts down to it.
    #[test]
    fn eviction_keeps_the_bound_and_prefixes() {
        let model = tiny();
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (ids(200, 3), ids(140, 5));
        let (sa, sb) = (ran(&model, &a), ran(&model, &b));
        let size = {
            let mut pc = open(dir.path(), 1 << 30, &model);
            pc.save(&model, &sa, &a);
            pc.total / 3
        };
        std::fs::remove_dir_all(dir.path()).unwrap();
        // Room for three chunks and a half.
        let limit = size * 7 / 2;
        let mut pc = open(dir.path(), limit, &model);
        pc.save(&model, &sa, &a);
        pc.save(&model, &sb, &b);
        assert!(pc.total <= limit);
        let evicted = pc.metrics.prompt_cache_evictions.get();
        assert_eq!(evicted, 2, "a's last two chunks made room for b's two");
        let mut s = model.session_with_rewind(256, 256).unwrap();
        assert_eq!(pc.load(&model, &mut s, &a).0, 64, "a's first chunk stayed");
        let mut s = model.session_with_rewind(256, 256).unwrap();
        assert_eq!(pc.load(&model, &mut s, &b).0, 128);
        // A prompt larger than the limit keeps its first chunks.
        let other = tempfile::tempdir().unwrap();
        let mut small = open(other.path(), size * 2, &model);
        small.save(&model, &sa, &a);
        assert_eq!(small.files.len(), 2);
        // Opened again with room for one chunk: one stays, the most recently used.
        drop(pc);
        let mut pc = open(dir.path(), size + size / 2, &model);
        assert!(pc.total <= size + size / 2);
        assert_eq!(pc.files.len(), 1);
        let mut s = model.session_with_rewind(256, 256).unwrap();
        assert_eq!(pc.load(&model, &mut s, &b).0, 64);
    }
}
