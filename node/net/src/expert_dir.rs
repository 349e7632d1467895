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
//! reads refresh, so the order survives restarts). The limit is `--expert-dir-limit`, or by
//! default follows the free disk, read again before each write; a full disk stops the storing
//! with one warning ([`budget`]).
//!
//! One process owns a model's folder: it holds an exclusive lock on `DIR/.<model id>.lock`
//! (an OS advisory lock, `std::fs::File::try_lock`, released when the process ends, even by
//! a crash). Another process that opens the folder meanwhile (a `run` beside the `serve` of
//! the same `--state-dir`, or a second node started on it by mistake) uses it shared: it
//! reads the records there, verified as always, but writes, evicts and deletes nothing, so it
//! never takes away the copies the owner keeps and announces ([`ExpertDir::is_shared`]; a
//! serving node that places replicas refuses to start on a shared folder). Where the file
//! system has no locks, every process owns the folder, as before.
//!
//! Non-goals: durability against power loss (a torn record fails verification and is
//! fetched again).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context;
use stormo_engine::huge::HugeBuf;
use stormo_engine::moe::{ExpertData, ExpertSchema};
use stormo_engine::tiers::{Completion, ExpertId, Priority, Tier};
use stormo_manifests::{Hash, Manifest};

pub mod budget;

use budget::{FreeSpace, KeepLimit, Reason};

struct Entry {
    len: u64,
    stamp: u64,
    /// The record's file is in place under its final name. A store reserves its entry (and
    /// its room in the limit) before writing; until the rename the expert is not held: a
    /// reader would find no file, and a process that exits then leaves only the temporary one.
    written: bool,
}

struct State {
    entries: HashMap<ExpertId, Entry>,
    used: u64,
    clock: u64,
    /// The limit in force, computed again before each write.
    limit: u64,
    /// Why it is what it is.
    reason: Reason,
    /// The disk was found full at the last write: nothing is stored until it has room again.
    full: bool,
    /// The one warning about a full disk was given.
    warned_full: bool,
}

/// A bounded directory of verified experts of one model. See the module docs.
pub struct ExpertDir {
    root: PathBuf,
    /// The limit asked for.
    asked: KeepLimit,
    /// All of the model's experts, in bytes (the most an automatic limit gives).
    experts: u64,
    free: FreeSpace,
    manifest: Arc<Manifest>,
    schemas: Vec<Option<ExpertSchema>>,
    state: Mutex<State>,
    /// Placement decides what is kept ([`ExpertDir::set_placed`]): a record that does not fit
    /// is not stored, instead of evicting the least recently used.
    placed: std::sync::atomic::AtomicBool,
    /// With placement: the experts it asked to keep and that are not stored yet. Nothing else
    /// is kept (a record fetched to answer a peer would take a placed copy's room).
    wanted: Mutex<std::collections::HashSet<ExpertId>>,
    /// The folder's lock, held while this value lives; `None`: another process owns the
    /// folder, and this one only reads it.
    owner: Option<std::fs::File>,
}

impl std::fmt::Debug for ExpertDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertDir")
            .field("root", &self.root)
            .field("limit", &self.asked)
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
    /// `limit` (bytes, or [`KeepLimit::Auto`]: following the free disk) of records of
    /// `manifest`'s experts (`schemas`: `files.layout.schemas`). Files that are not records
    /// of this manifest with the right length are ignored; leftover temporary files are
    /// removed; if more than the limit is held, the least recently used records are evicted.
    pub fn open(
        dir: &Path,
        model: Hash,
        limit: impl Into<KeepLimit>,
        manifest: Arc<Manifest>,
        schemas: Vec<Option<ExpertSchema>>,
    ) -> anyhow::Result<Self> {
        Self::open_with(
            dir,
            model,
            limit.into(),
            manifest,
            schemas,
            budget::system_free_space(),
        )
    }

    /// [`Self::open`] for a node whose replica placement decides what is kept
    /// ([`ExpertDir::set_placed`] from the start): records found beyond the limit (a restart
    /// with a smaller `--expert-dir-limit`, or a fuller disk) are not deleted here, least
    /// recently used first, but left to placement, which evicts, once it has seen the swarm,
    /// the copies the swarm has most of. Deleting by age alone could take an expert's last copy.
    pub fn open_placed(
        dir: &Path,
        model: Hash,
        limit: impl Into<KeepLimit>,
        manifest: Arc<Manifest>,
        schemas: Vec<Option<ExpertSchema>>,
    ) -> anyhow::Result<Self> {
        Self::open_impl(
            dir,
            model,
            limit.into(),
            manifest,
            schemas,
            budget::system_free_space(),
            true,
        )
    }

    /// [`Self::open`], the free space read by `free` (tests give a fake disk).
    pub fn open_with(
        dir: &Path,
        model: Hash,
        limit: KeepLimit,
        manifest: Arc<Manifest>,
        schemas: Vec<Option<ExpertSchema>>,
        free: FreeSpace,
    ) -> anyhow::Result<Self> {
        Self::open_impl(dir, model, limit, manifest, schemas, free, false)
    }

    fn open_impl(
        dir: &Path,
        model: Hash,
        limit: KeepLimit,
        manifest: Arc<Manifest>,
        schemas: Vec<Option<ExpertSchema>>,
        free: FreeSpace,
        placed: bool,
    ) -> anyhow::Result<Self> {
        let root = dir.join(model.to_hex());
        std::fs::create_dir_all(&root)
            .with_context(|| format!("creating the expert directory {}", root.display()))?;
        let owner = own(&root)?;
        let mut found: Vec<(SystemTime, ExpertId, u64)> = Vec::new();
        for e in std::fs::read_dir(&root).with_context(|| format!("reading {}", root.display()))? {
            let e = e.with_context(|| format!("reading {}", root.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(meta) = e.metadata() else { continue };
            if name.ends_with(".tmp") && meta.is_file() {
                // A crash's leftover, unless the owner is writing it now.
                if owner.is_some() {
                    let _ = std::fs::remove_file(e.path());
                }
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
        let mut st = State {
            entries: HashMap::new(),
            used: 0,
            clock: 0,
            limit: 0,
            reason: Reason::Given,
            full: false,
            warned_full: false,
        };
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
        let experts = manifest.experts.iter().map(|x| x.len).sum();
        let me = Self {
            root,
            asked: limit,
            experts,
            free,
            manifest,
            schemas,
            state: Mutex::new(st),
            placed: std::sync::atomic::AtomicBool::new(placed),
            wanted: Mutex::default(),
            owner,
        };
        me.refresh_limit(&mut me.lock());
        if me.is_shared() {
            tracing::info!(
                "expert directory {}: in use by another stormo process; reading the experts it \
                 keeps, keeping and deleting none",
                me.root.display()
            );
        } else if placed {
            let g = me.lock();
            if g.used > g.limit {
                tracing::info!(
                    "expert directory {}: {} bytes kept, over the limit of {} bytes; placement \
                     evicts the copies the swarm has most of once it has seen the swarm",
                    me.root.display(),
                    g.used,
                    g.limit
                );
            }
        } else {
            let mut g = me.lock();
            let (before, bytes) = (g.entries.len(), g.used);
            me.evict(&mut g, 0);
            if g.entries.len() < before {
                // A smaller limit than the records found (a restart with a lower
                // --expert-dir-limit, or a fuller disk): say what went, not silently.
                tracing::warn!(
                    "expert directory {}: {} kept experts ({} bytes) over the limit of {} bytes; \
                     deleted {} of them, least recently used first",
                    me.root.display(),
                    before,
                    bytes,
                    g.limit,
                    before - g.entries.len()
                );
            }
        }
        tracing::info!(
            "expert directory {}: {} experts, {} bytes of at most {}",
            me.root.display(),
            me.len(),
            me.used(),
            me.limit()
        );
        Ok(me)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("expert dir lock")
    }

    /// Whether another process owns the folder (see the module docs): this one reads the
    /// records there and writes, evicts and deletes none.
    pub fn is_shared(&self) -> bool {
        self.owner.is_none()
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

    /// The experts held (written in place), in no particular order.
    pub fn kept(&self) -> Vec<ExpertId> {
        let g = self.lock();
        g.entries
            .iter()
            .filter(|(_, e)| e.written)
            .map(|(id, _)| *id)
            .collect()
    }

    /// The most bytes it holds (`--expert-dir-limit`, or what the free disk gave at the last
    /// write: see [`budget`]).
    pub fn limit(&self) -> u64 {
        self.lock().limit
    }

    /// The bytes of the model's smallest expert record (`None`: a model without experts).
    pub fn smallest_record(&self) -> Option<u64> {
        self.manifest.experts.iter().map(|e| e.len).min()
    }

    /// The line a node prints at start: how much it keeps, where, and why (in human units).
    pub fn describe(&self) -> String {
        let g = self.lock();
        budget::describe(g.limit, g.reason, &self.root)
    }

    /// Whether the disk was found full at the last write (nothing is stored until it has
    /// room again).
    pub fn disk_full(&self) -> bool {
        self.lock().full
    }

    /// Reads the free space and sets the limit in force from it; returns the free space.
    fn refresh_limit(&self, g: &mut State) -> Option<u64> {
        let free = (self.free)(&self.root);
        (g.limit, g.reason) = budget::effective(self.asked, free, g.used, self.experts);
        free
    }

    /// With placement: keep expert `id` when it is next stored (placement is fetching it).
    pub fn want(&self, id: ExpertId) {
        self.wanted.lock().expect("wanted lock").insert(id);
    }

    /// Hands what is kept to replica placement: from now on only the records it asked for
    /// ([`ExpertDir::want`]) are stored, and only when they fit (a record fetched for another
    /// reason, or least-recently-used eviction, would take a placed copy's room and the swarm's
    /// copies would fall below the replica count); placement evicts by its own rules
    /// ([`ExpertDir::remove`]).
    pub fn set_placed(&self) {
        self.placed
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Deletes expert `id`'s record (placement evicting a copy the swarm has enough of).
    /// Returns whether it was held; one still being written is left to its store.
    pub fn remove(&self, id: ExpertId) -> bool {
        if self.is_shared() {
            return false;
        }
        let mut g = self.lock();
        if !g.entries.get(&id).is_some_and(|e| e.written) {
            return false;
        }
        self.forget(&mut g, id);
        true
    }

    fn path(&self, id: ExpertId) -> PathBuf {
        self.root.join(file_name(id))
    }

    /// Evicts least recently used records until `extra` more bytes fit in the limit (never
    /// one still being written: its store owns it until then).
    fn evict(&self, g: &mut State, extra: u64) {
        while g.used + extra > g.limit {
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
            if self.is_shared() {
                return;
            }
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
        if self.is_shared() {
            return Ok(());
        }
        self.manifest
            .verify_record(id, record)
            .context("the record does not match the manifest")?;
        let len = record.len() as u64;
        {
            let mut g = self.lock();
            if g.entries.contains_key(&id) {
                return Ok(());
            }
            // The budget and the disk, read again before every write.
            let free = self.refresh_limit(&mut g);
            if len > g.limit && g.reason == Reason::Given {
                anyhow::bail!("larger than --expert-dir-limit");
            }
            // What evicting down to the limit would give back to the disk.
            let freed = (g.used + len).saturating_sub(g.limit).min(g.used);
            if len > g.limit || !budget::room_for(len, free.map(|f| f.saturating_add(freed))) {
                self.no_room(&mut g, free);
                return Ok(());
            }
            if g.full {
                g.full = false;
                tracing::info!(
                    "expert directory {}: the disk has room again; keeping experts again",
                    self.root.display()
                );
            }
            let placed = self.placed.load(std::sync::atomic::Ordering::Relaxed);
            if placed && !self.wanted.lock().expect("wanted lock").remove(&id) {
                // Placement keeps what it asked for, nothing else.
                return Ok(());
            }
            if placed && g.used + len > g.limit {
                // The copies held are placement's to evict, not least-recently-used order's:
                // a record fetched for another reason waits for room.
                tracing::debug!("expert directory: full; not keeping expert {id}");
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
        if let Err(e) = &written {
            let _ = std::fs::remove_file(&tmp);
            if let Some(e) = g.entries.remove(&id) {
                g.used -= e.len;
            }
            let disk_full = e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::StorageFull)
            });
            if disk_full {
                let free = (self.free)(&self.root);
                self.no_room(&mut g, free);
                return Ok(());
            }
        } else if let Some(e) = g.entries.get_mut(&id) {
            e.written = true;
        }
        written
    }

    /// The disk has no room for another record: stop storing, saying so once (a warning the
    /// first time in this process, quieter after), and serve on from what is held.
    fn no_room(&self, g: &mut State, free: Option<u64>) {
        if g.full {
            return;
        }
        g.full = true;
        let free = free.map_or_else(|| "unknown".into(), crate::progress::human_bytes);
        if g.warned_full {
            tracing::info!(
                "expert directory {}: the disk is full again ({free} free); not keeping more \
                 experts",
                self.root.display()
            );
        } else {
            g.warned_full = true;
            tracing::warn!(
                "expert directory {}: the disk is full ({free} free, {} kept): not keeping more \
                 experts until it has room; serving goes on",
                self.root.display(),
                crate::progress::human_bytes(g.used)
            );
        }
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

/// Takes `root`'s lock (`.<model id>.lock` beside the folder, so the folder holds records
/// only): the file, locked, when this process now owns the folder; `None` when another
/// process holds it. A file system without locks gives every process the folder.
fn own(root: &Path) -> anyhow::Result<Option<std::fs::File>> {
    let name = root
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let path = root.with_file_name(format!(".{name}.lock"));
    let f = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(Some(f)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => {
            tracing::debug!("{}: no lock ({e}); owning the folder", path.display());
            Ok(Some(f))
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
