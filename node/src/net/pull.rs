//! `stormo pull`: a model folder fetched from peers and verified against the L0 manifest.
//!
//! # Layout of a pulled folder
//! - `stormo-manifest.bin` (and `stormo-manifest.sig` when the peer has one), accepted by
//!   `--model-id` or `--trust` before anything else is fetched;
//! - the metadata files the manifest lists (`config.json`, tokenizer files, the index), each
//!   checked against its BLAKE3;
//! - every safetensors file at its full length, *sparse*: its header (checked tensor by tensor
//!   against the manifest: names, dtypes, shapes, offsets) and every dense tensor (checked
//!   against its BLAKE3) at their offsets; the expert tensors are holes that read as zeros.
//!   With `--with-experts` the expert tensors are fetched and checked too: a full copy;
//! - `stormo-pulled.json` ([`MARKER_FILE`]), written *before* any safetensors file appears:
//!   `{"model_id": .., "experts": false}` until a full copy is complete. `run` takes a folder
//!   whose marker says `"experts": false` as `--no-local-experts`, and `serve` serves no
//!   experts and no expert bytes from it, so the holes are never used as weights.
//!
//! Every file is written to a temporary name in the folder and renamed only once all of its
//! contents verified: a failed pull leaves no half-written file under a final name.
//! A file already present at its final name that verifies is kept (a pull resumes).

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use stormo_manifests::{Hash, Manifest, ManifestPaths, ManifestSignature, PublicKey, SecretKey};
use stormo_wire::MAX_FILE_RANGE_LEN;

use super::tier::{PeerConfig, PeerLink};
use super::PeerAddr;

/// The marker file of a pulled folder.
pub const MARKER_FILE: &str = "stormo-pulled.json";
/// Bytes per file request.
const RANGE: u64 = 4 << 20;
/// File requests in flight per file.
const WINDOW: usize = 4;

/// What a folder's [`MARKER_FILE`] says.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Pulled {
    /// The model id pulled.
    pub model_id: String,
    /// Whether the expert tensors were fetched (a full copy) or are holes.
    pub experts: bool,
}

impl Pulled {
    /// The marker of `dir`, `None` when it was not pulled.
    pub fn read(dir: &Path) -> anyhow::Result<Option<Self>> {
        let p = dir.join(MARKER_FILE);
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .with_context(|| format!("{} is not a valid pull marker", p.display())),
            // Not pulled; a file given as the folder is reported by whatever reads the model.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// Whether `dir` was pulled without its experts (its expert bytes are holes).
    pub fn dense_only(dir: &Path) -> anyhow::Result<bool> {
        Ok(Self::read(dir)?.is_some_and(|p| !p.experts))
    }
}

/// What to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Peers, tried in order.
    pub peers: Vec<PeerAddr>,
    /// Accept the manifest with this id.
    pub model_id: Option<Hash>,
    /// Accept a manifest signed by one of these keys.
    pub trust: Vec<PublicKey>,
    /// The folder to write.
    pub out: PathBuf,
    /// Fetch the expert tensors too.
    pub with_experts: bool,
    /// Timeouts.
    pub cfg: PeerConfig,
}

/// What a pull did.
#[derive(Debug, Clone, Default)]
pub struct PullReport {
    /// The model id.
    pub model_id: Option<Hash>,
    /// Bytes fetched from peers.
    pub fetched: u64,
    /// Tensors fetched and verified.
    pub tensors: usize,
    /// Files kept because they were already complete and verified.
    pub kept: usize,
}

/// Pulls per `opts` as `secret`, on `rt`.
pub fn pull(
    secret: &SecretKey,
    opts: &PullOptions,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<PullReport> {
    anyhow::ensure!(!opts.peers.is_empty(), "give at least one --peer");
    anyhow::ensure!(
        opts.model_id.is_some() || !opts.trust.is_empty(),
        "say which manifest to accept: --model-id ID or --trust PUBKEY"
    );
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    rt.block_on(pull_async(secret, opts))
}

async fn pull_async(secret: &SecretKey, opts: &PullOptions) -> anyhow::Result<PullReport> {
    let mut links = Vec::new();
    for p in &opts.peers {
        match PeerLink::connect(secret, p, opts.cfg).await {
            Ok(l) => links.push(Arc::new(l)),
            Err(e) => tracing::warn!("{e:#}"),
        }
    }
    anyhow::ensure!(!links.is_empty(), "no peer could be reached");
    let out = pull_with(&links, opts).await;
    for l in &links {
        l.close();
    }
    out
}

async fn pull_with(links: &[Arc<PeerLink>], opts: &PullOptions) -> anyhow::Result<PullReport> {
    let dir = &opts.out;
    let mut report = PullReport::default();
    // The manifest, accepted before anything else is fetched.
    let (manifest, id, bytes, sig) = fetch_manifest(links, opts).await?;
    report.model_id = Some(id);
    eprintln!(
        "pull: manifest {} accepted ({} files, {} tensors, {} experts)",
        id.to_hex(),
        manifest.files.len(),
        manifest.tensors.len(),
        manifest.experts.len()
    );
    // A folder holding another model is not overwritten piecemeal.
    if let Some(p) = Pulled::read(dir)? {
        anyhow::ensure!(
            p.model_id == id.to_hex(),
            "{} holds a pull of model {}, not {}: pull into another folder",
            dir.display(),
            p.model_id,
            id.to_hex()
        );
    }
    for f in manifest
        .identity
        .meta
        .iter()
        .map(|f| &f.name)
        .chain(manifest.files.iter().map(|f| &f.name))
    {
        stormo_wire::check_file_name(f)
            .map_err(|why| anyhow::anyhow!("the manifest names a file {f:?}: {why}"))?;
    }
    // The marker first: no sparse file is ever there without it.
    let previous_full = Pulled::read(dir)?.is_some_and(|p| p.experts);
    write_marker(dir, id, previous_full && opts.with_experts)?;
    let paths = ManifestPaths::beside_model(dir);
    write_atomic(&paths.bin, &bytes)?;
    if let Some(s) = &sig {
        write_atomic(&paths.sig, s)?;
    }
    for meta in &manifest.identity.meta {
        let path = dir.join(&meta.name);
        if std::fs::read(&path).is_ok_and(|b| Hash::of(&b) == meta.hash) {
            report.kept += 1;
            continue;
        }
        eprintln!("pull: {} ({} bytes)", meta.name, meta.len);
        let b = fetch_whole(links, id, &meta.name, meta.len, &mut report).await?;
        anyhow::ensure!(
            Hash::of(&b) == meta.hash,
            "{}: the bytes from the peers do not match the manifest's hash",
            meta.name
        );
        write_atomic(&path, &b)?;
    }
    let experts = super::serve::expert_tensors(&manifest);
    for (index, file) in manifest.files.iter().enumerate() {
        let tensors: Vec<usize> = (0..manifest.tensors.len())
            .filter(|&t| manifest.tensors[t].file as usize == index)
            .collect();
        let wanted: Vec<usize> = tensors
            .iter()
            .copied()
            .filter(|t| opts.with_experts || !experts.contains(t))
            .collect();
        let path = dir.join(&file.name);
        if already_complete(&path, file.len, &manifest, &wanted) {
            eprintln!("pull: {} already complete and verified", file.name);
            report.kept += 1;
            continue;
        }
        let header = fetch_header(links, id, &manifest, index, &mut report).await?;
        let tmp = dir.join(format!(".{}.pull-tmp", file.name));
        let res = async {
            let mut f = std::fs::File::create(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            f.set_len(file.len)
                .with_context(|| format!("sizing {}", tmp.display()))?;
            f.write_all(&header)?;
            let total: u64 = wanted.iter().map(|&t| manifest.tensors[t].len).sum();
            let mut done = 0u64;
            for &t in &wanted {
                let te = &manifest.tensors[t];
                fetch_tensor(links, id, &file.name, te, &mut f, &mut report).await?;
                done += te.len;
                report.tensors += 1;
                eprint!(
                    "\rpull: {} {:.1}/{:.1} MB",
                    file.name,
                    done as f64 / 1e6,
                    total as f64 / 1e6
                );
            }
            eprintln!();
            f.sync_all()?;
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    }
    write_marker(dir, id, opts.with_experts)?;
    Ok(report)
}

/// Fetches and accepts the manifest (and its signature for `--trust`) from the first peer
/// that supplies an acceptable one.
async fn fetch_manifest(
    links: &[Arc<PeerLink>],
    opts: &PullOptions,
) -> anyhow::Result<(Manifest, Hash, Vec<u8>, Option<Vec<u8>>)> {
    let mut last = None;
    for l in links {
        let attempt = async {
            let sig = if opts.trust.is_empty() {
                None
            } else {
                // The signature names the model id; ask for it under every model served.
                let mut found = None;
                for &m in l.models() {
                    let len = stormo_manifests::signature::SIG_LEN as u64;
                    if let Ok(b) = l.file(m, super::serve::SIG_FILE, 0, len).await {
                        found = Some(b);
                        break;
                    }
                }
                Some(
                    found
                        .context("the peer has no signature of its manifest (needed by --trust)")?,
                )
            };
            let want = match (opts.model_id, &sig) {
                (Some(id), _) => id,
                (None, Some(s)) => {
                    ManifestSignature::from_bytes(s)
                        .context("the peer's signature file")?
                        .model_id
                }
                (None, None) => anyhow::bail!("--model-id or --trust is needed"),
            };
            anyhow::ensure!(
                l.models().contains(&want),
                "the peer does not serve model {}",
                want.short()
            );
            let bytes = l.manifest(want).await?;
            let (m, id) =
                super::accept_manifest(&bytes, sig.as_deref(), &opts.trust, opts.model_id)?;
            anyhow::Ok((m, id, bytes, sig))
        };
        match attempt.await {
            Ok(v) => return Ok(v),
            Err(e) => {
                let e = e.context(format!("peer {}", l.peer));
                tracing::warn!("{e:#}");
                last = Some(e);
            }
        }
    }
    Err(last
        .unwrap_or_else(|| anyhow::anyhow!("no peer"))
        .context("no peer supplied an acceptable manifest"))
}

/// All `len` bytes of the file `name` (a small metadata file), from the first peer that has
/// them.
async fn fetch_whole(
    links: &[Arc<PeerLink>],
    model: Hash,
    name: &str,
    len: u64,
    report: &mut PullReport,
) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let n = (len - off).min(MAX_FILE_RANGE_LEN);
        out.extend(fetch_range(links, model, name, off, n).await?);
        off += n;
    }
    report.fetched += len;
    Ok(out)
}

/// One range, from the first peer that answers it.
async fn fetch_range(
    links: &[Arc<PeerLink>],
    model: Hash,
    name: &str,
    offset: u64,
    len: u64,
) -> anyhow::Result<Vec<u8>> {
    let mut last = None;
    for l in links {
        match l.file(model, name, offset, len).await {
            Ok(b) => return Ok(b),
            Err(e) => {
                tracing::warn!("{e:#}");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no peer")))
}

/// The header of safetensors file `index`, checked against the manifest: every tensor the
/// header lists is the manifest's (name, dtype, shape, offset, length) and it lists them all.
async fn fetch_header(
    links: &[Arc<PeerLink>],
    model: Hash,
    m: &Manifest,
    index: usize,
    report: &mut PullReport,
) -> anyhow::Result<Vec<u8>> {
    let file = &m.files[index];
    anyhow::ensure!(
        file.len >= 8,
        "{}: {} bytes, too short",
        file.name,
        file.len
    );
    let head = fetch_whole(links, model, &file.name, 8, report).await?;
    let n = u64::from_le_bytes(head[..8].try_into().expect("8 bytes fetched"));
    anyhow::ensure!(
        n <= 100 << 20 && 8 + n <= file.len,
        "{}: the peer's header length {n} is impossible for a file of {} bytes",
        file.name,
        file.len
    );
    let mut header = head;
    let mut rest = vec![0u8; 0];
    if n > 0 {
        rest = fetch_whole_range(links, model, &file.name, 8, n, report).await?;
    }
    header.extend_from_slice(&rest);
    let parsed =
        stormo_engine::safetensors::parse_header(Path::new(&file.name), &header, file.len, index)
            .with_context(|| format!("{}: the peer's header", file.name))?;
    let listed = m
        .tensors
        .iter()
        .filter(|t| t.file as usize == index)
        .count();
    anyhow::ensure!(
        parsed.len() == listed,
        "{}: the peer's header lists {} tensors, the manifest {listed}",
        file.name,
        parsed.len()
    );
    for (name, info) in &parsed {
        let t = m.tensor(name).with_context(|| {
            format!(
                "{}: the peer's header lists {name:?}, which the manifest does not",
                file.name
            )
        })?;
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        anyhow::ensure!(
            t.file as usize == index
                && stormo_manifests::manifest::TensorDtype::from(info.dtype) == t.dtype
                && shape == t.shape
                && info.offset == t.offset
                && info.len == t.len,
            "{}: the peer's header describes tensor {name} differently from the manifest",
            file.name
        );
    }
    Ok(header)
}

async fn fetch_whole_range(
    links: &[Arc<PeerLink>],
    model: Hash,
    name: &str,
    offset: u64,
    len: u64,
    report: &mut PullReport,
) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut off = offset;
    while off < offset + len {
        let n = (offset + len - off).min(MAX_FILE_RANGE_LEN);
        out.extend(fetch_range(links, model, name, off, n).await?);
        off += n;
    }
    report.fetched += len;
    Ok(out)
}

/// Fetches tensor `t` of file `name` into `f` at its offset, hashing as it arrives, from one
/// peer after another until one supplies bytes that match the manifest's BLAKE3.
async fn fetch_tensor(
    links: &[Arc<PeerLink>],
    model: Hash,
    name: &str,
    t: &stormo_manifests::manifest::TensorEntry,
    f: &mut std::fs::File,
    report: &mut PullReport,
) -> anyhow::Result<()> {
    let mut errors = Vec::new();
    for l in links {
        match fetch_tensor_from(l, model, name, t, f).await {
            Ok(()) => {
                report.fetched += t.len;
                return Ok(());
            }
            Err(e) => {
                tracing::warn!("tensor {}: {e:#}", t.name);
                errors.push(format!("{e:#}"));
            }
        }
    }
    anyhow::bail!(
        "tensor {} of {name}: no peer supplied it intact ({})",
        t.name,
        errors.join("; ")
    )
}

async fn fetch_tensor_from(
    l: &Arc<PeerLink>,
    model: Hash,
    name: &str,
    t: &stormo_manifests::manifest::TensorEntry,
    f: &mut std::fs::File,
) -> anyhow::Result<()> {
    let mut hasher = blake3::Hasher::new();
    let end = t.offset + t.len;
    let mut next = t.offset;
    let mut inflight = VecDeque::new();
    let window = WINDOW.min(l.max_concurrent());
    f.seek(SeekFrom::Start(t.offset))?;
    while next < end || !inflight.is_empty() {
        while next < end && inflight.len() < window {
            let n = (end - next).min(RANGE);
            let (l, name, off) = (l.clone(), name.to_string(), next);
            inflight.push_back(tokio::spawn(
                async move { l.file(model, &name, off, n).await },
            ));
            next += n;
        }
        let Some(h) = inflight.pop_front() else { break };
        let bytes = h.await.context("a fetch task panicked")??;
        hasher.update(&bytes);
        f.write_all(&bytes)?;
    }
    let got = Hash(*hasher.finalize().as_bytes());
    anyhow::ensure!(
        got == t.hash,
        "peer {} sent bytes whose BLAKE3 is not the manifest's",
        l.peer
    );
    Ok(())
}

/// Whether `path` is already `len` bytes long and every tensor of `wanted` in it verifies.
fn already_complete(path: &Path, len: u64, m: &Manifest, wanted: &[usize]) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    if f.metadata().map(|md| md.len()).ok() != Some(len) {
        return false;
    }
    wanted.iter().all(|&t| {
        let te = &m.tensors[t];
        let mut h = blake3::Hasher::new();
        if f.seek(SeekFrom::Start(te.offset)).is_err() {
            return false;
        }
        let mut r = (&mut f).take(te.len);
        if std::io::copy(&mut r, &mut h).ok() != Some(te.len) {
            return false;
        }
        Hash(*h.finalize().as_bytes()) == te.hash
    })
}

fn write_marker(dir: &Path, id: Hash, experts: bool) -> anyhow::Result<()> {
    let m = Pulled {
        model_id: id.to_hex(),
        experts,
    };
    let json = serde_json::to_vec_pretty(&m).expect("a marker serializes");
    write_atomic(&dir.join(MARKER_FILE), &json)
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .context("a file path has a name")?
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.pull-tmp"));
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}
