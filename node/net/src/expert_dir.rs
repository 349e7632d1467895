//! `--expert-dir`: a local directory of verified experts fetched from peers, so that the next
//! run finds them on its own disk.
//!
//! Layout: `DIR/<model id, 64 hex>/<layer>-<expert>.bin`, each file one expert record exactly
//! as the manifest hashes it. A record is written to a temporary file in the same folder and
//! renamed into place, so a reader never sees a half-written record under its final name
//! (temporary files left by a crash are removed at the next open). Every record is verified
//! against the manifest again when it is read back; a record that fails is deleted and the
//! load fails, so the tiers below supply it. The folder is bounded by a byte limit: storing
//! evicts the least recently used records first (use is the file's modification time, which
//! reads refresh, so the order survives restarts).
//!
//! Non-goals: sharing one folder between processes that write it at the same time (each keeps
//! its own index; they do not corrupt each other, but the limit is per process), and
//! durability against power loss (a torn record fails verification and is fetched again).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context;
use stormo_engine::huge::HugeBuf;
use stormo_engine::moe::{ExpertData, ExpertSchema};
use stormo_engine::tiers::{Completion, ExpertId, Priority, Tier};
use stormo_manifests::{Hash, Manifest};

struct Entry {
    len: u64,
    stamp: u64,
    /// The record's file is in place under its final name. A store reserves its entry (and
    /// its room in the limit) before writing; until the rename the expert is not held: a
    /// reader would find no file, and a process that exits then leaves only the temporary one.
    written: bool,
}

#[derive(Default)]
struct State {
    entries: HashMap<ExpertId, Entry>,
    used: u64,
    clock: u64,
}

/// A bounded directory of verified experts of one model. See the module docs.
pub struct ExpertDir {
    root: PathBuf,
    limit: u64,
    manifest: Arc<Manifest>,
    schemas: Vec<Option<ExpertSchema>>,
    state: Mutex<State>,
}

impl std::fmt::Debug for ExpertDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertDir")
            .field("root", &self.root)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

fn file_name(id: ExpertId) -> String {
    format!("{}-{}.bin", id.layer, id.expert)
}

fn parse_name(name: &str) -> Option<ExpertId> {
    let (l, e) = name.strip_suffix(".bin")?.split_once('-')?;
    Some(ExpertId {
        layer: l.parse().ok()?,
        expert: e.parse().ok()?,
    })
}

impl ExpertDir {
    /// Opens (creating it if needed) the folder of model `model` under `dir`, holding at most
    /// `limit` bytes of records of `manifest`'s experts (`schemas`: `files.layout.schemas`).
    /// Files that are not records of this manifest with the right length are ignored;
    /// leftover temporary files are removed; if more than `limit` is held, the least recently
    /// used records are evicted.
    pub fn open(
        dir: &Path,
        model: Hash,
        limit: u64,
        manifest: Arc<Manifest>,
        schemas: Vec<Option<ExpertSchema>>,
    ) -> anyhow::Result<Self> {
        let root = dir.join(model.to_hex());
        std::fs::create_dir_all(&root)
            .with_context(|| format!("creating the expert directory {}", root.display()))?;
        let mut found: Vec<(SystemTime, ExpertId, u64)> = Vec::new();
        for e in std::fs::read_dir(&root).with_context(|| format!("reading {}", root.display()))? {
            let e = e.with_context(|| format!("reading {}", root.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(meta) = e.metadata() else { continue };
            if name.ends_with(".tmp") && meta.is_file() {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            let Some(id) = parse_name(&name) else {
                continue;
            };
            let ok = meta.is_file() && manifest.expert(id).is_some_and(|x| x.len == meta.len());
            if !ok {
                tracing::warn!(
                    "{}: not a record of this model; ignored",
                    e.path().display()
                );
                continue;
            }
            let t = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            found.push((t, id, meta.len()));
        }
        found.sort();
        let mut st = State::default();
        for (_, id, len) in found {
            st.clock += 1;
            st.used += len;
            st.entries.insert(
                id,
                Entry {
                    len,
                    stamp: st.clock,
                    written: true,
                },
            );
        }
        let me = Self {
            root,
            limit,
            manifest,
            schemas,
            state: Mutex::new(st),
        };
        {
            let mut g = me.lock();
            me.evict(&mut g, 0);
        }
        tracing::info!(
            "expert directory {}: {} experts, {} bytes of at most {limit}",
            me.root.display(),
            me.len(),
            me.used()
        );
        Ok(me)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("expert dir lock")
    }

    /// The folder of this model's records.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Records held (written in place).
    pub fn len(&self) -> usize {
        self.lock().entries.values().filter(|e| e.written).count()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// Whether expert `id` is held: its record's file is in place (a store still writing it
    /// does not count).
    pub fn contains(&self, id: ExpertId) -> bool {
        self.lock().entries.get(&id).is_some_and(|e| e.written)
    }

    fn path(&self, id: ExpertId) -> PathBuf {
        self.root.join(file_name(id))
    }

    /// Evicts least recently used records until `extra` more bytes fit in the limit (never
    /// one still being written: its store owns it until then).
    fn evict(&self, g: &mut State, extra: u64) {
        while g.used + extra > self.limit {
            let Some(id) = g
                .entries
                .iter()
                .filter(|(_, e)| e.written)
                .min_by_key(|(_, e)| e.stamp)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.forget(g, id);
        }
    }

    fn forget(&self, g: &mut State, id: ExpertId) {
        if let Some(e) = g.entries.remove(&id) {
            g.used -= e.len;
            if let Err(e) = std::fs::remove_file(self.path(id)) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("removing {}: {e}", self.path(id).display());
                }
            }
        }
    }

    /// Stores the verified `record` of expert `id` (checked again here: only records that
    /// match the manifest are written). Failures are logged, never fatal: the directory is a
    /// cache.
    pub fn store(&self, id: ExpertId, record: &[u8]) {
        if let Err(e) = self.try_store(id, record) {
            tracing::warn!("expert directory: not storing expert {id}: {e:#}");
        }
    }

    fn try_store(&self, id: ExpertId, record: &[u8]) -> anyhow::Result<()> {
        self.manifest
            .verify_record(id, record)
            .context("the record does not match the manifest")?;
        let len = record.len() as u64;
        anyhow::ensure!(len <= self.limit, "larger than --expert-dir-limit");
        {
            let mut g = self.lock();
            if g.entries.contains_key(&id) {
                return Ok(());
            }
            self.evict(&mut g, len);
            // Reserve the room now so concurrent stores respect the limit.
            g.clock += 1;
            let stamp = g.clock;
            g.used += len;
            g.entries.insert(
                id,
                Entry {
                    len,
                    stamp,
                    written: false,
                },
            );
        }
        let tmp = self.root.join(format!(
            ".{}.{}.{:x}.tmp",
            file_name(id),
            std::process::id(),
            rand_suffix()
        ));
        let written = std::fs::write(&tmp, record)
            .with_context(|| format!("writing {}", tmp.display()))
            .and_then(|()| {
                std::fs::rename(&tmp, self.path(id))
                    .with_context(|| format!("renaming {} into place", tmp.display()))
            });
        let mut g = self.lock();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
            if let Some(e) = g.entries.remove(&id) {
                g.used -= e.len;
            }
        } else if let Some(e) = g.entries.get_mut(&id) {
            e.written = true;
        }
        written
    }

    /// Reads expert `id` back, verified against the manifest. A record that fails is deleted.
    pub fn read(&self, id: ExpertId) -> anyhow::Result<Vec<u8>> {
        let path = self.path(id);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()));
        let checked = bytes.and_then(|b| {
            self.manifest
                .verify_record(id, &b)
                .with_context(|| format!("{} does not match the manifest", path.display()))?;
            Ok(b)
        });
        let mut g = self.lock();
        match checked {
            Ok(b) => {
                g.clock += 1;
                let stamp = g.clock;
                if let Some(e) = g.entries.get_mut(&id) {
                    e.stamp = stamp;
                }
                drop(g);
                // Keep the use order across restarts.
                if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                Ok(b)
            }
            Err(e) => {
                self.forget(&mut g, id);
                Err(e)
            }
        }
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// The expert directory as a tier (named "dir"), between the local disk and the peers.
#[derive(Debug)]
pub struct DirTier(pub Arc<ExpertDir>);

impl Tier for DirTier {
    fn name(&self) -> &str {
        "dir"
    }

    fn holds(&self, key: ExpertId) -> bool {
        self.0.contains(key)
    }

    fn load(&self, keys: &[ExpertId], _priority: Priority, done: Completion) {
        let dir = self.0.clone();
        let keys = keys.to_vec();
        let spawned = std::thread::Builder::new()
            .name("stormo-expert-dir".into())
            .spawn({
                let done = done.clone();
                let keys = keys.clone();
                move || {
                    for key in keys {
                        done(key, load_one(&dir, key));
                    }
                }
            });
        if let Err(e) = spawned {
            for key in keys {
                done(
                    key,
                    Err(expert_error(key, format!("no thread to read it: {e}"))),
                );
            }
        }
    }
}

fn expert_error(key: ExpertId, reason: String) -> stormo_engine::Error {
    stormo_engine::Error::Expert {
        layer: key.layer as usize,
        expert: key.expert as usize,
        reason,
    }
}

fn load_one(dir: &ExpertDir, key: ExpertId) -> stormo_engine::Result<Arc<ExpertData>> {
    let id = key;
    let schema = dir
        .schemas
        .get(key.layer as usize)
        .and_then(Option::as_ref)
        .ok_or_else(|| expert_error(key, "its layer has no experts".into()))?;
    let bytes = dir
        .read(id)
        .map_err(|e| expert_error(key, format!("from the expert directory: {e:#}")))?;
    let buf = HugeBuf::copy_of(&bytes).map_err(|e| expert_error(key, e.to_string()))?;
    Ok(Arc::new(ExpertData::from_buffer(Arc::new(buf), schema)))
}
