//! `stormo pull`: a model folder fetched from peers and verified against the L0 manifest.
//!
//! # Layout of a pulled folder
//! - `stormo-manifest.bin` (and `stormo-manifest.sig` when the peer has one), accepted by
//!   `--model-id` or `--trust` before anything else is fetched;
//! - the metadata files the manifest lists (`config.json`, tokenizer files, the index), each
//!   checked against its BLAKE3;
//! - without the experts, honest files ([`stormo_engine::safetensors::dense`]): per published
//!   safetensors file, its header fetched and checked tensor by tensor against the manifest
//!   (names, dtypes, shapes, offsets) and kept in the index `stormo-dense.json`, and its dense
//!   tensors (each checked against its BLAKE3) packed into `NAME.dense.safetensors`; no file
//!   is longer than what it holds, so `ls`, `du` and a copy agree;
//! - with `--with-experts`, every published safetensors file whole, every tensor checked: a
//!   full copy (the dense files and their index, if any, removed once it is complete);
//! - `stormo-pulled.json` ([`MARKER_FILE`]), written *before* any weight file appears:
//!   `{"model_id": .., "experts": false}` until a full copy is complete. `run` takes a folder
//!   whose marker says `"experts": false` as `--no-local-experts`, and `serve` serves no
//!   experts and no expert bytes from it.
//!
//! A folder pulled without experts by an older stormo holds the published files at their full
//! length, *sparse* (the expert tensors holes that read as zeros). It still opens and runs;
//! a pull into it (without experts) copies its dense tensors into dense files and removes the
//! sparse ones.
//!
//! Every peer is dialled from one endpoint: a node's own ([`pull_on`], what `stormo pull` does,
//! sharing it with the node that fetches experts next), or one of the pull's ([`pull`]). A peer
//! that does not answer (starting, or too busy to finish a handshake within the connect
//! timeout) is dialled up to three times, 0.5 s and 2 s apart; a peer that refuses a key once.
//!
//! Every file is written to a temporary name in the folder and renamed only once all of its
//! contents verified: a failed pull leaves no half-written file under a final name.
//! A file already present at its final name that verifies is kept (a pull resumes), and the
//! verified tensors of one that does not are copied from it rather than fetched again.
//!
//! # What a pull does to a folder that is not empty
//! Before anything is written, the folder is surveyed. A pull never loses what is stored
//! there without being asked:
//! - a folder that holds *another model* (a marker or manifest of another model id, weight or
//!   metadata files the manifest does not list, or, in a folder this model was not pulled
//!   into, a file of the manifest's whose bytes differ) is refused, naming the folder and
//!   why, unless `force` is set; then the other model's files are removed first, so none is
//!   left beside the new ones;
//! - a pull never downgrades a folder: one that already holds this model's expert tensors
//!   (its marker says so, or it was not pulled and its weight files verify in full) stays a
//!   full copy even without `with_experts`;
//! - a folder the pull created is removed again when the pull fails before storing anything.
//!
//! # What it says
//! On stderr, what it fetches as it goes: the manifest accepted, each metadata file, each
//! weight file's progress (redrawn on a terminal, a line every 5 s otherwise). `quiet`
//! silences all of that; errors, warnings (logged) and the files `force` removes are still
//! told. The [`PullReport`] counts tensors and the metadata files apart, so the caller's
//! summary can say which bytes were which.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use stormo_engine::safetensors::dense::{self, DenseIndex, PublishedFile};
use stormo_manifests::{
    Hash, Manifest, ManifestPaths, ManifestSignature, Membership, PublicKey, SecretKey,
    MANIFEST_FILE,
};
use stormo_wire::MAX_FILE_RANGE_LEN;

use super::tier::{PeerConfig, PeerLink};
use super::tls::{self, Admission, Identity};
use super::PeerAddr;

/// The marker file of a pulled folder.
pub const MARKER_FILE: &str = "stormo-pulled.json";
/// Bytes per file request.
const RANGE: u64 = 4 << 20;
/// File requests in flight per file.
const WINDOW: usize = 4;
/// The pauses between a pull's attempts to dial a peer that did not answer (one that is
/// starting, or too busy to finish a handshake in time): three attempts in all, then the next
/// peer. A peer that refuses this node's key, or whose key is not the one given, is not
/// dialled again.
const DIAL_PAUSES: [std::time::Duration; 2] = [
    std::time::Duration::from_millis(500),
    std::time::Duration::from_secs(2),
];

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
    /// Fetch the expert tensors too. Without it a folder that already holds them keeps them.
    pub with_experts: bool,
    /// Replace another model the folder holds (its files are removed first) instead of
    /// refusing.
    pub force: bool,
    /// Timeouts.
    pub cfg: PeerConfig,
    /// The swarm membership to present to the peers (`--swarm`, `--cert`), if any.
    pub membership: Option<PullMembership>,
    /// The expert records to fetch after the folder (`--experts SPEC`, fetched by the caller):
    /// checked against the accepted manifest's experts before anything else is fetched, so a
    /// spec naming an expert the model does not have fails at once.
    pub experts: Option<String>,
    /// No progress on stderr (`--quiet`): see the module docs for what is still told.
    pub quiet: bool,
}

/// How a pull dials as a swarm member.
#[derive(Debug, Clone)]
pub struct PullMembership {
    /// This node's certificate, presented in every handshake.
    pub cert: Membership,
    /// Which servers it accepts (besides proving the pinned key): the swarm's admission.
    pub servers: Admission,
}

/// What a pull did.
#[derive(Debug, Clone, Default)]
pub struct PullReport {
    /// The model id.
    pub model_id: Option<Hash>,
    /// Bytes fetched from peers, in all (the metadata files' among them).
    pub fetched: u64,
    /// Tensors fetched and verified.
    pub tensors: usize,
    /// Metadata files (`config.json`, tokenizer files, ...) fetched and verified.
    pub meta: usize,
    /// Of [`PullReport::fetched`], the metadata files' bytes.
    pub meta_bytes: u64,
    /// Tensors copied, verified, from a file the folder already held instead of fetched.
    pub reused: usize,
    /// Files (weight and metadata files alike) kept because they were already complete and
    /// verified.
    pub kept: usize,
    /// The weight files the folder holds after the pull, with their lengths: the published
    /// files (a full copy), or the dense files (without the experts).
    pub files: Vec<(String, u64)>,
    /// Whether the folder now holds the expert tensors (a full copy).
    pub experts: bool,
    /// Files of another model removed (with `force`).
    pub removed: Vec<PathBuf>,
}

/// Pulls per `opts` as `secret`, on `rt`, dialling from an endpoint of its own (closed when
/// done). A folder the pull creates is removed again if it fails before storing anything in
/// it.
pub fn pull(
    secret: &SecretKey,
    opts: &PullOptions,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<PullReport> {
    let endpoint = {
        let _g = rt.enter();
        crate::bind(
            crate::unspecified(opts.peers.iter().any(|p| p.addr.is_ipv6())),
            None,
        )?
    };
    let out = pull_on(secret, opts, rt, &endpoint);
    endpoint.close(0u32.into(), b"done");
    out
}

/// [`pull`] dialling every peer from `endpoint` (a node's own, which stays open; the
/// connections are closed when the pull ends).
pub fn pull_on(
    secret: &SecretKey,
    opts: &PullOptions,
    rt: &tokio::runtime::Runtime,
    endpoint: &quinn::Endpoint,
) -> anyhow::Result<PullReport> {
    anyhow::ensure!(!opts.peers.is_empty(), "give at least one --peer");
    anyhow::ensure!(
        opts.model_id.is_some() || !opts.trust.is_empty(),
        "say which manifest to accept: --model-id ID or --trust PUBKEY"
    );
    let created = first_missing(&opts.out);
    let res = std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))
        .and_then(|()| rt.block_on(pull_async(endpoint, secret, opts)));
    if res.is_err() {
        if let Some(top) = created {
            remove_if_unused(&opts.out, &top);
        }
    }
    res
}

/// The outermost folder of `out` (itself or an ancestor) that does not exist yet: the one
/// `create_dir_all` creates first. `None` when `out` exists.
fn first_missing(out: &Path) -> Option<PathBuf> {
    let mut top = None;
    for a in out.ancestors() {
        if a.as_os_str().is_empty() || a.symlink_metadata().is_ok() {
            break;
        }
        top = Some(a.to_path_buf());
    }
    top
}

/// Whether `name` is a file a pull writes before it stores any of the model: the marker, the
/// manifest and its signature, and temporary files.
fn is_bookkeeping(name: &str) -> bool {
    name == MARKER_FILE
        || name == MANIFEST_FILE
        || Path::new(name) == Path::new(MANIFEST_FILE).with_extension("sig")
        || (name.starts_with('.') && name.ends_with(".pull-tmp"))
}

/// Removes `out`, and the folders up to `top` created with it, if `out` holds nothing but a
/// pull's bookkeeping (nothing of the model was stored). Anything else in it keeps it all.
fn remove_if_unused(out: &Path, top: &Path) {
    let Ok(rd) = std::fs::read_dir(out) else {
        return;
    };
    let mut ours = Vec::new();
    for e in rd {
        let Ok(e) = e else { return };
        let ok = e.file_type().is_ok_and(|t| t.is_file())
            && e.file_name().to_str().is_some_and(is_bookkeeping);
        if !ok {
            return;
        }
        ours.push(e.path());
    }
    for p in ours {
        if std::fs::remove_file(&p).is_err() {
            return;
        }
    }
    for d in out.ancestors() {
        // `remove_dir` removes only an empty folder: nothing another process put there.
        if std::fs::remove_dir(d).is_err() || d == top {
            break;
        }
    }
}

async fn pull_async(
    endpoint: &quinn::Endpoint,
    secret: &SecretKey,
    opts: &PullOptions,
) -> anyhow::Result<PullReport> {
    let mut links = Vec::new();
    let mut why = Vec::new();
    for p in &opts.peers {
        let client = match &opts.membership {
            None => match tls::client_config(secret, &p.key) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("{e:#}");
                    continue;
                }
            },
            Some(m) => {
                let id = Identity {
                    secret,
                    membership: Some(&m.cert),
                };
                tls::client_config_for(id, Some(&p.key), m.servers.clone())?
            }
        };
        match connect_retrying(endpoint, secret, client, p, opts.cfg).await {
            Ok(l) => links.push(Arc::new(l)),
            Err(e) => {
                tracing::warn!("{e:#}");
                why.push(format!("{e:#}"));
            }
        }
    }
    // Each peer's own reason (unreachable, or reached and refusing this node's key).
    anyhow::ensure!(
        !links.is_empty(),
        "no peer could be used: {}",
        if why.is_empty() {
            "none given".to_string()
        } else {
            why.join("; ")
        }
    );
    let out = pull_with(&links, opts).await;
    for l in &links {
        l.close();
    }
    out
}

/// A link to `p`, dialled again after each of [`DIAL_PAUSES`] while the attempt fails for any
/// reason but a refusal of either side's key.
async fn connect_retrying(
    endpoint: &quinn::Endpoint,
    secret: &SecretKey,
    client: quinn::ClientConfig,
    p: &PeerAddr,
    cfg: PeerConfig,
) -> anyhow::Result<PeerLink> {
    let mut pauses = DIAL_PAUSES.iter();
    loop {
        let e = match PeerLink::connect_on(endpoint, secret, client.clone(), p, cfg).await {
            Ok(l) => return Ok(l),
            Err(e) => e,
        };
        let refused = format!("{e:#}").contains("refused");
        match pauses.next() {
            Some(pause) if !refused => {
                tracing::warn!("{e:#}; dialling it again in {:.1}s", pause.as_secs_f64());
                tokio::time::sleep(*pause).await;
            }
            _ => return Err(e),
        }
    }
}

/// Experts per layer as far as `m` tells: its experts' layers, and its tensors named
/// `model.layers.N.` for layers with none (a dense layer counts 0 experts).
fn expert_shape(m: &Manifest) -> Vec<usize> {
    let layer_of = |name: &str| -> Option<usize> {
        name.strip_prefix("model.layers.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    };
    let layers = m
        .tensors
        .iter()
        .filter_map(|t| layer_of(&t.name))
        .chain(m.experts.iter().map(|e| usize::from(e.id.layer)))
        .max()
        .map_or(0, |l| l + 1);
    let mut shape = vec![0; layers];
    for e in &m.experts {
        shape[usize::from(e.id.layer)] += 1;
    }
    shape
}

async fn pull_with(links: &[Arc<PeerLink>], opts: &PullOptions) -> anyhow::Result<PullReport> {
    let dir = &opts.out;
    let mut report = PullReport::default();
    // The manifest, accepted before anything else is fetched.
    let (manifest, id, bytes, sig) = fetch_manifest(links, opts).await?;
    report.model_id = Some(id);
    if let Some(spec) = &opts.experts {
        super::parse_expert_spec("--experts", spec, &expert_shape(&manifest))?;
    }
    let say = |line: std::fmt::Arguments<'_>| {
        if !opts.quiet {
            eprintln!("pull: {line}");
        }
    };
    say(format_args!(
        "manifest {} accepted ({} weight file{}, {} tensors, {} experts)",
        id.to_hex(),
        manifest.files.len(),
        if manifest.files.len() == 1 { "" } else { "s" },
        manifest.tensors.len(),
        manifest.experts.len()
    ));
    for f in listed_files(&manifest) {
        stormo_wire::check_file_name(f)
            .map_err(|why| anyhow::anyhow!("the manifest names a file {f:?}: {why}"))?;
    }
    // What the folder holds, before anything is written to it.
    let s = survey(dir, &manifest, id, opts.with_experts)?;
    if !s.foreign.is_empty() {
        anyhow::ensure!(
            opts.force,
            "{} holds files of another model than {}: {}. Nothing was changed: pull into \
             another folder, or pass --force to remove that model's files and replace them",
            dir.display(),
            id.to_hex(),
            s.foreign.join("; ")
        );
        for p in &s.stale {
            eprintln!("pull: --force: removing {}", p.display());
            std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
        }
        report.removed = s.stale.clone();
    }
    // A folder that holds the experts keeps them: they are fetched too where missing.
    let with_experts = opts.with_experts || s.full;
    if with_experts && !opts.with_experts {
        say(format_args!(
            "the folder holds the expert tensors too; they are kept (a full copy)"
        ));
    }
    // The marker first: no sparse file is ever there without it saying so, and it says
    // "experts" before the end only where the folder already held them all.
    write_marker(dir, id, s.full)?;
    let paths = ManifestPaths::beside_model(dir);
    write_atomic(&paths.bin, &bytes)?;
    if let Some(sig) = &sig {
        write_atomic(&paths.sig, sig)?;
    }
    for meta in &manifest.identity.meta {
        let path = dir.join(&meta.name);
        if std::fs::read(&path).is_ok_and(|b| Hash::of(&b) == meta.hash) {
            report.kept += 1;
            continue;
        }
        say(format_args!("{} ({} bytes)", meta.name, meta.len));
        let b = fetch_whole(links, id, &meta.name, meta.len, &mut report).await?;
        anyhow::ensure!(
            Hash::of(&b) == meta.hash,
            "{}: the bytes from the peers do not match the manifest's hash",
            meta.name
        );
        write_atomic(&path, &b)?;
        report.meta += 1;
        report.meta_bytes += meta.len;
    }
    let experts = super::serve::expert_tensors(&manifest);
    let old_index = DenseIndex::read(dir).ok().flatten();
    let mut published = Vec::new();
    for (index, file) in manifest.files.iter().enumerate() {
        let dense_name = dense::dense_name(&file.name);
        let listed = old_index
            .as_ref()
            .and_then(|i| i.files.iter().find(|f| f.name == file.name));
        let done = if with_experts {
            s.complete[index]
        } else {
            s.dense_complete[index] && listed.is_some()
        };
        if done {
            let shown = if with_experts {
                &file.name
            } else {
                &dense_name
            };
            say(format_args!("{shown} already complete and verified"));
            report.kept += 1;
            published.extend(listed.cloned());
            continue;
        }
        let header = fetch_header(links, id, &manifest, index, &mut report).await?;
        let path = dir.join(&file.name);
        // Files already there whose tensors that verify are copied instead of fetched: the
        // published file if it has this layout (the dense part when the experts are added, the
        // intact part of a damaged file, an older pull's sparse file), and the dense file.
        let mut sources = Vec::new();
        if let Some(f) = std::fs::File::open(&path).ok().filter(|f| {
            f.metadata().is_ok_and(|md| md.len() == file.len)
                && read_header(f).is_ok_and(|h| h == header)
        }) {
            // A sparse file's expert tensors are holes: not worth reading.
            let at = tensors_of(&manifest, index)
                .filter(|t| !(s.sparse && experts.contains(t)))
                .map(|t| (t, manifest.tensors[t].offset))
                .collect();
            sources.push(Source { file: f, at });
        }
        if let Some(src) = open_dense(dir, &manifest, index) {
            sources.push(src);
        }
        let fetch_context = |t: usize, e: anyhow::Error| {
            if with_experts && !opts.with_experts && experts.contains(&t) {
                e.context(format!(
                    "{} holds the expert tensors, and a pull keeps them: the missing ones \
                     are fetched too",
                    dir.display()
                ))
            } else {
                e
            }
        };
        if with_experts {
            let place: Vec<(usize, u64)> = tensors_of(&manifest, index)
                .map(|t| (t, manifest.tensors[t].offset))
                .collect();
            let target = Target {
                path: &path,
                len: file.len,
                header: &header,
                place: &place,
                quiet: opts.quiet,
            };
            write_weights(
                links,
                id,
                &manifest,
                index,
                target,
                &mut sources,
                &mut report,
            )
            .await
            .map_err(|(t, e)| match t {
                Some(t) => fetch_context(t, e),
                None => e,
            })?;
        } else {
            // The dense tensors packed into a file of their own, in the published order.
            let parsed = stormo_engine::safetensors::parse_header(
                Path::new(&file.name),
                &header,
                file.len,
                index,
            )?;
            let mut dense_tensors: Vec<(usize, &stormo_engine::safetensors::TensorInfo)> = parsed
                .iter()
                .filter_map(|(name, info)| {
                    let t = tensors_of(&manifest, index)
                        .find(|&t| manifest.tensors[t].name == *name)?;
                    (!experts.contains(&t)).then_some((t, info))
                })
                .collect();
            dense_tensors.sort_by_key(|(_, info)| info.offset);
            let described: Vec<_> = dense_tensors
                .iter()
                .map(|(t, info)| {
                    (
                        manifest.tensors[*t].name.as_str(),
                        info.dtype,
                        info.shape.as_slice(),
                        info.len,
                    )
                })
                .collect();
            let dense_header = stormo_engine::safetensors::header(&described, None);
            let mut at = dense_header.len() as u64;
            let place: Vec<(usize, u64)> = dense_tensors
                .iter()
                .map(|(t, info)| {
                    let p = (*t, at);
                    at += info.len;
                    p
                })
                .collect();
            let target = Target {
                path: &dir.join(&dense_name),
                len: at,
                header: &dense_header,
                place: &place,
                quiet: opts.quiet,
            };
            write_weights(
                links,
                id,
                &manifest,
                index,
                target,
                &mut sources,
                &mut report,
            )
            .await
            .map_err(|(_, e)| e)?;
            let text = std::str::from_utf8(&header[8..])
                .context("the published header is not UTF-8")?
                .to_owned();
            published.push(PublishedFile {
                name: file.name.clone(),
                len: file.len,
                header: text,
                dense: dense_name,
            });
        }
    }
    if with_experts {
        // Whole files now: the dense-only layout goes (its index first, so the folder never
        // opens as dense-only with its dense files gone).
        remove_if_there(&dir.join(dense::INDEX))?;
        for file in &manifest.files {
            remove_if_there(&dir.join(dense::dense_name(&file.name)))?;
        }
    } else {
        write_atomic(
            &dir.join(dense::INDEX),
            &DenseIndex::new(published).to_json(),
        )?;
        // An older pull's sparse files, whose dense tensors the dense files now hold.
        for file in &manifest.files {
            let p = dir.join(&file.name);
            if is_file(&p) {
                say(format_args!(
                    "removing {} (a sparse file of an older pull; its dense tensors are in {})",
                    file.name,
                    dense::dense_name(&file.name)
                ));
                remove_if_there(&p)?;
            }
        }
    }
    write_marker(dir, id, with_experts)?;
    report.experts = with_experts;
    report.files = manifest
        .files
        .iter()
        .map(|f| {
            let name = if with_experts {
                f.name.clone()
            } else {
                dense::dense_name(&f.name)
            };
            let len = std::fs::metadata(dir.join(&name)).map_or(0, |m| m.len());
            (name, len)
        })
        .collect();
    Ok(report)
}

/// A weight file to write: `header` then each tensor of `place` (a manifest tensor index and
/// its offset in the file), `len` bytes in all; `quiet`: without a progress line.
struct Target<'a> {
    path: &'a Path,
    len: u64,
    header: &'a [u8],
    place: &'a [(usize, u64)],
    quiet: bool,
}

/// A file already in the folder whose tensors that verify a pull copies instead of fetching:
/// where each tensor it may hold lies in it.
struct Source {
    file: std::fs::File,
    at: std::collections::HashMap<usize, u64>,
}

/// Writes `target` for weight file `index` of `m` through a temporary name and a rename: each
/// tensor copied from the first of `sources` where its bytes verify, else fetched from the
/// peers (at the published file's offsets) and verified. On failure, the tensor that could
/// not be had (if it was one) and why; no file is left under either name.
async fn write_weights(
    links: &[Arc<PeerLink>],
    id: Hash,
    m: &Manifest,
    index: usize,
    target: Target<'_>,
    sources: &mut [Source],
    report: &mut PullReport,
) -> Result<(), (Option<usize>, anyhow::Error)> {
    let file = &m.files[index];
    let shown = target
        .path
        .file_name()
        .map_or_else(|| file.name.clone(), |n| n.to_string_lossy().into_owned());
    let tmp = target.path.with_file_name(format!(".{shown}.pull-tmp"));
    let res = async {
        let mut f = std::fs::File::create(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))
            .map_err(|e| (None, e))?;
        f.set_len(target.len)
            .and_then(|()| f.write_all(target.header))
            .with_context(|| format!("writing {}", tmp.display()))
            .map_err(|e| (None, e))?;
        let total: u64 = target.place.iter().map(|&(t, _)| m.tensors[t].len).sum();
        let mut progress =
            crate::progress::Progress::new(&format!("pull: {shown}")).quiet(target.quiet);
        let mut done = 0u64;
        for &(t, at) in target.place {
            let te = &m.tensors[t];
            let mut copied = false;
            for src in sources.iter_mut() {
                let Some(&from) = src.at.get(&t) else {
                    continue;
                };
                copied = copy_verified(&mut src.file, from, &mut f, at, te)
                    .with_context(|| format!("copying {} into {}", te.name, tmp.display()))
                    .map_err(|e| (None, e))?;
                if copied {
                    break;
                }
            }
            if copied {
                report.reused += 1;
            } else {
                fetch_tensor(links, id, &file.name, te, &mut f, at, report)
                    .await
                    .map_err(|e| (Some(t), e))?;
                report.tensors += 1;
            }
            done += te.len;
            progress.update(done, total);
        }
        progress.finish();
        f.sync_all()
            .with_context(|| format!("writing {}", tmp.display()))
            .map_err(|e| (None, e))
    }
    .await;
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, target.path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), target.path.display()))
        .map_err(|e| (None, e))
}

/// Removes the file at `p` if there is one.
fn remove_if_there(p: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", p.display()))
        }
        _ => Ok(()),
    }
}

/// The dense file of weight file `index` of `m` in `dir`, as a source of tensors: where it
/// says each of that file's tensors lies (those whose dtype, shape and length are the
/// manifest's). `None` when there is none or its header does not parse.
fn open_dense(dir: &Path, m: &Manifest, index: usize) -> Option<Source> {
    let path = dir.join(dense::dense_name(&m.files[index].name));
    let file = std::fs::File::open(&path).ok()?;
    let len = file.metadata().ok()?.len();
    let header = read_header(&file).ok()?;
    let parsed = stormo_engine::safetensors::parse_header(&path, &header, len, 0).ok()?;
    let mut at = std::collections::HashMap::new();
    for (name, info) in parsed {
        let Some(t) = tensors_of(m, index).find(|&t| m.tensors[t].name == name) else {
            continue;
        };
        let te = &m.tensors[t];
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        if stormo_manifests::manifest::TensorDtype::from(info.dtype) == te.dtype
            && shape == te.shape
            && info.len == te.len
        {
            at.insert(t, info.offset);
        }
    }
    Some(Source { file, at })
}

/// Why the dense file of weight file `index` of `m` in `dir` is not complete: the index does
/// not list it with a header that is the manifest's, or the file does not hold exactly that
/// file's dense tensors (those not in `experts`), each verified.
fn verify_dense(
    dir: &Path,
    m: &Manifest,
    index: usize,
    idx: Option<&DenseIndex>,
    experts: &BTreeSet<usize>,
) -> Result<(), String> {
    let file = &m.files[index];
    let entry = idx
        .and_then(|i| i.files.iter().find(|f| f.name == file.name))
        .ok_or_else(|| format!("{} does not list {}", dense::INDEX, file.name))?;
    if entry.len != file.len || entry.dense != dense::dense_name(&file.name) {
        return Err(format!("{} lists {} differently", dense::INDEX, file.name));
    }
    check_header(m, index, &entry.header_bytes()).map_err(|e| format!("{e:#}"))?;
    let mut src = open_dense(dir, m, index).ok_or("no readable dense file")?;
    let wanted: Vec<usize> = tensors_of(m, index)
        .filter(|t| !experts.contains(t))
        .collect();
    let held = std::fs::File::open(dir.join(&entry.dense))
        .ok()
        .and_then(|f| read_header(&f).ok())
        .and_then(|h| {
            stormo_engine::safetensors::parse_header(Path::new(&entry.dense), &h, u64::MAX, 0).ok()
        })
        .map_or(0, |p| p.len());
    if held != wanted.len() {
        return Err(format!(
            "it holds {held} tensors, not the {} dense ones",
            wanted.len()
        ));
    }
    for t in wanted {
        let te = &m.tensors[t];
        let ok = src
            .at
            .get(&t)
            .is_some_and(|&at| tensor_verifies(&mut src.file, at, te));
        if !ok {
            return Err(format!("tensor {} does not match the manifest", te.name));
        }
    }
    Ok(())
}

/// The names of the files manifest `m` lists: metadata (config, tokenizer), then weights.
fn listed_files(m: &Manifest) -> impl Iterator<Item = &str> {
    m.identity
        .meta
        .iter()
        .map(|f| f.name.as_str())
        .chain(m.files.iter().map(|f| f.name.as_str()))
}

/// The indices of the tensors of weight file `index`.
fn tensors_of(m: &Manifest, index: usize) -> impl Iterator<Item = usize> + '_ {
    (0..m.tensors.len()).filter(move |&t| m.tensors[t].file as usize == index)
}

/// What an output folder holds, surveyed before a pull writes anything (see the module docs).
#[derive(Debug, Default)]
struct Survey {
    /// Why the folder holds files of another model (empty: it holds none).
    foreign: Vec<String>,
    /// The other model's files, removed first when the pull is forced.
    stale: Vec<PathBuf>,
    /// Per weight file of the manifest: already there, complete and verified.
    complete: Vec<bool>,
    /// Whether the folder holds this model's expert tensors, which the pull then keeps.
    full: bool,
    /// Whether the folder was pulled without the experts: its weight files may be sparse.
    sparse: bool,
    /// Per weight file of the manifest: its dense file is there, listed in the dense index,
    /// complete and verified (a folder of this model pulled without experts).
    dense_complete: Vec<bool>,
}

/// Surveys `dir` for a pull of `m` (model `id`). Reads every weight file of the manifest
/// already there and hashes its tensors: all of them, or only the dense ones in a folder
/// pulled without experts when none are asked for.
fn survey(dir: &Path, m: &Manifest, id: Hash, with_experts: bool) -> anyhow::Result<Survey> {
    let mut s = Survey {
        complete: vec![false; m.files.len()],
        dense_complete: vec![false; m.files.len()],
        ..Survey::default()
    };
    let short = id.short();
    let mut stale = BTreeSet::new();
    // Only a folder this model was pulled into is the pull's to repair; in any other folder
    // a file that differs from the manifest's is someone else's.
    let marker = match Pulled::read(dir) {
        Ok(p) => p,
        Err(e) => {
            s.foreign.push(format!("{e:#}"));
            None
        }
    };
    let owned = match &marker {
        Some(p) if p.model_id == id.to_hex() => true,
        Some(p) => {
            s.foreign
                .push(format!("it holds a pull of model {}", p.model_id));
            false
        }
        None => false,
    };
    let listed: HashSet<&str> = listed_files(m).collect();
    let paths = ManifestPaths::beside_model(dir);
    let mut other_manifest = marker.is_some() && !owned;
    match std::fs::read(&paths.bin) {
        Ok(b) => match Manifest::decode(&b) {
            Ok(old) if old.model_id() == id => {}
            Ok(old) => {
                s.foreign.push(format!(
                    "its {MANIFEST_FILE} is model {}'s",
                    old.model_id().to_hex()
                ));
                other_manifest = true;
                // The other model's own files that this one does not have go with it.
                for name in listed_files(&old) {
                    let p = dir.join(name);
                    if stormo_wire::check_file_name(name).is_ok()
                        && !listed.contains(name)
                        && is_file(&p)
                    {
                        stale.insert(p);
                    }
                }
            }
            Err(e) => {
                s.foreign.push(format!(
                    "its {MANIFEST_FILE} is not a manifest this build reads ({e})"
                ));
                other_manifest = true;
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", paths.bin.display())),
    }
    if other_manifest {
        // The other manifest's JSON view and signature would describe the wrong model.
        for p in [&paths.json, &paths.sig] {
            if is_file(p) {
                stale.insert(p.clone());
            }
        }
    }
    // Weight and metadata files the manifest does not list: a checkpoint loader may pick
    // them up beside this model's (every `*.safetensors` without an index, an index
    // without its shards).
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let model_file = name.ends_with(".safetensors")
            || stormo_manifests::build::META_FILES.contains(&name.as_str())
            || name == dense::INDEX;
        // A pull of this model without experts keeps its dense files and their index.
        let ours = owned
            && (name == dense::INDEX || m.files.iter().any(|f| dense::dense_name(&f.name) == name));
        if model_file && !ours && !listed.contains(name.as_str()) && is_file(&e.path()) {
            s.foreign.push(format!(
                "it holds {name}, which model {short} does not have"
            ));
            stale.insert(e.path());
        }
    }
    for meta in &m.identity.meta {
        let p = dir.join(&meta.name);
        match std::fs::read(&p) {
            Ok(b) if Hash::of(&b) == meta.hash => {}
            Ok(_) if !owned => {
                s.foreign
                    .push(format!("its {} differs from model {short}'s", meta.name));
                stale.insert(p);
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }
    // Which tensors must verify for a file there to count as complete: all of them, unless
    // this is a folder pulled without experts and none are asked for now.
    let pulled_sparse = owned && marker.as_ref().is_some_and(|p| !p.experts);
    let experts = super::serve::expert_tensors(m);
    let (mut present, mut all_complete) = (false, true);
    for (index, file) in m.files.iter().enumerate() {
        let p = dir.join(&file.name);
        if p.symlink_metadata().is_err() {
            continue;
        }
        present = true;
        let wanted: Vec<usize> = tensors_of(m, index)
            .filter(|t| with_experts || !pulled_sparse || !experts.contains(t))
            .collect();
        match verify_local(&p, m, index, &wanted) {
            Ok(()) => s.complete[index] = true,
            Err(why) => {
                all_complete = false;
                if !owned {
                    s.foreign
                        .push(format!("its {} is not model {short}'s ({why})", file.name));
                    stale.insert(p);
                }
            }
        }
    }
    s.sparse = pulled_sparse;
    if pulled_sparse {
        let idx = DenseIndex::read(dir).ok().flatten();
        for index in 0..m.files.len() {
            s.dense_complete[index] = verify_dense(dir, m, index, idx.as_ref(), &experts).is_ok();
        }
    }
    s.full = if owned {
        !pulled_sparse
    } else {
        // Not pulled: weight files there are whole files, and they are this model's.
        present && all_complete
    };
    s.stale = stale.into_iter().collect();
    Ok(s)
}

/// Whether `p` is a file (or a symbolic link, not followed), which a forced pull may remove.
fn is_file(p: &Path) -> bool {
    p.symlink_metadata().is_ok_and(|md| !md.is_dir())
}

/// Why the weight file `index` of `m` at `path` is not complete: its length, its header or
/// the first of `tensors` whose bytes do not match.
fn verify_local(path: &Path, m: &Manifest, index: usize, tensors: &[usize]) -> Result<(), String> {
    let file = &m.files[index];
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    if len != file.len {
        return Err(format!("{len} bytes, not {}", file.len));
    }
    let header = read_header(&f).map_err(|e| format!("{e:#}"))?;
    check_header(m, index, &header).map_err(|e| format!("{e:#}"))?;
    for &t in tensors {
        let te = &m.tensors[t];
        if !tensor_verifies(&mut f, te.offset, te) {
            return Err(format!("tensor {} does not match the manifest", te.name));
        }
    }
    Ok(())
}

/// The header (length prefix included) of the safetensors file `f`.
fn read_header(mut f: &std::fs::File) -> anyhow::Result<Vec<u8>> {
    let len = f.metadata()?.len();
    let mut head = [0u8; 8];
    f.seek(SeekFrom::Start(0))?;
    f.read_exact(&mut head)?;
    let n = u64::from_le_bytes(head);
    anyhow::ensure!(
        n <= 100 << 20 && 8 + n <= len,
        "a header length of {n} in a file of {len} bytes"
    );
    let mut header = head.to_vec();
    f.take(n).read_to_end(&mut header)?;
    anyhow::ensure!(header.len() as u64 == 8 + n, "a short header");
    Ok(header)
}

/// Whether the bytes of tensor `te` at offset `at` of `f` match its hash.
fn tensor_verifies(
    f: &mut std::fs::File,
    at: u64,
    te: &stormo_manifests::manifest::TensorEntry,
) -> bool {
    read_verified(f, at, te, &mut std::io::sink()).unwrap_or(false)
}

/// Copies tensor `te` from offset `from` of `src` to offset `to` of `dst`; whether the bytes
/// matched its hash (if not, whatever was copied is overwritten when it is fetched).
fn copy_verified(
    src: &mut std::fs::File,
    from: u64,
    dst: &mut std::fs::File,
    to: u64,
    te: &stormo_manifests::manifest::TensorEntry,
) -> std::io::Result<bool> {
    dst.seek(SeekFrom::Start(to))?;
    read_verified(src, from, te, dst)
}

/// Reads tensor `te` from offset `at` of `src` into `out`, hashing as it goes; whether `src`
/// held all of it and its bytes matched the hash.
fn read_verified(
    src: &mut std::fs::File,
    at: u64,
    te: &stormo_manifests::manifest::TensorEntry,
    out: &mut impl Write,
) -> std::io::Result<bool> {
    struct Hashing<'a, W> {
        h: blake3::Hasher,
        out: &'a mut W,
    }
    impl<W: Write> Write for Hashing<'_, W> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let n = self.out.write(b)?;
            self.h.update(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.out.flush()
        }
    }
    src.seek(SeekFrom::Start(at))?;
    let mut w = Hashing {
        h: blake3::Hasher::new(),
        out,
    };
    let n = std::io::copy(&mut src.take(te.len), &mut w)?;
    Ok(n == te.len && Hash(*w.h.finalize().as_bytes()) == te.hash)
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
        let got = l.file(model, name, offset, len).await.and_then(|b| {
            // Every caller counts on the whole range: a peer's short answer is its failure.
            anyhow::ensure!(
                b.len() as u64 == len,
                "{name} bytes {offset}+{len}: the peer sent {} bytes",
                b.len()
            );
            Ok(b)
        });
        match got {
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
    check_header(m, index, &header).with_context(|| format!("{}: the peer's header", file.name))?;
    Ok(header)
}

/// Checks a safetensors header (length prefix included) of weight file `index` against the
/// manifest: every tensor it lists is the manifest's (name, dtype, shape, offset, length) and
/// it lists them all.
pub(crate) fn check_header(m: &Manifest, index: usize, header: &[u8]) -> anyhow::Result<()> {
    let file = &m.files[index];
    let parsed =
        stormo_engine::safetensors::parse_header(Path::new(&file.name), header, file.len, index)?;
    let listed = tensors_of(m, index).count();
    anyhow::ensure!(
        parsed.len() == listed,
        "it lists {} tensors, the manifest {listed}",
        parsed.len()
    );
    for (name, info) in &parsed {
        let t = m
            .tensor(name)
            .with_context(|| format!("it lists {name:?}, which the manifest does not"))?;
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        anyhow::ensure!(
            t.file as usize == index
                && stormo_manifests::manifest::TensorDtype::from(info.dtype) == t.dtype
                && shape == t.shape
                && info.offset == t.offset
                && info.len == t.len,
            "it describes tensor {name} differently from the manifest"
        );
    }
    Ok(())
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

/// Fetches tensor `t` of file `name` (at its offset there) into `f` at offset `at`, hashing as
/// it arrives, from one peer after another until one supplies bytes that match the
/// manifest's BLAKE3.
async fn fetch_tensor(
    links: &[Arc<PeerLink>],
    model: Hash,
    name: &str,
    t: &stormo_manifests::manifest::TensorEntry,
    f: &mut std::fs::File,
    at: u64,
    report: &mut PullReport,
) -> anyhow::Result<()> {
    let mut errors = Vec::new();
    for l in links {
        match fetch_tensor_from(l, model, name, t, f, at).await {
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
    // Expert tensors come whole only from a node with the whole folder (a seeder); the
    // nodes that keep copies hand out records, which `--experts` fetches from any holder.
    let hint = if errors
        .iter()
        .any(|e| e.contains("which this node does not serve"))
    {
        ": no peer holds this tensor's whole folder (a node that keeps some experts serves \
         them as records, not as file bytes); pull the dense weights and fetch every expert \
         from its holders with `--experts all` instead of --with-experts"
    } else {
        ""
    };
    anyhow::bail!(
        "tensor {} of {name}: no peer supplied it intact ({}){hint}",
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
    at: u64,
) -> anyhow::Result<()> {
    let mut hasher = blake3::Hasher::new();
    let end = t.offset + t.len;
    let mut next = t.offset;
    let mut inflight = VecDeque::new();
    let window = WINDOW.min(l.max_concurrent());
    f.seek(SeekFrom::Start(at))?;
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
