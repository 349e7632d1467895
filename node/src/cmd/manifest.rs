//! `stormo manifest`: build, sign, verify and show a checkpoint's L0 manifest.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use stormo_manifests::manifest::{DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use stormo_manifests::{
    read_manifest, BuildOptions, IoMode, ManifestPaths, ManifestSignature, Progress, PublicKey,
    SignatureError, VerifyOptions,
};
use stormo_net::progress::human_bytes;

const PATHS_HELP: &str = "Files: by default the manifest is written beside the model as \
DIR/stormo-manifest.bin (canonical bytes; the model id is their BLAKE3), \
DIR/stormo-manifest.json (a readable view) and DIR/stormo-manifest.sig (the signature). \
For a read-only model folder pass --out FILE.bin to build, then --manifest FILE.bin to sign \
and verify; the .json and .sig go beside it.";

/// How the weight files are read (shared by build, verify and bench).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct IoArgs {
    /// How to read the weight files: `direct` (O_DIRECT: straight from the disk, the page
    /// cache left alone; falls back to buffered where the file system refuses it, with a
    /// warning) or `buffered` (through the page cache: faster for files already cached).
    #[arg(long, value_name = "MODE", default_value = "direct")]
    io: IoMode,
}

/// Manifest subcommands.
#[derive(Debug, clap::Subcommand)]
#[command(after_help = PATHS_HELP)]
pub enum Command {
    /// Hash a checkpoint and write its L0 manifest (.bin and .json) and print its model id.
    ///
    /// Records every tensor (name, dtype, shape, bytes, quantization, file, offset, BLAKE3),
    /// every safetensors file's SHA-256 (as the Hugging Face Hub lists it), the config and
    /// tokenizer hashes, and per expert its record's BLAKE3 and chunk hashes.
    #[command(after_help = PATHS_HELP)]
    Build {
        /// The model folder (config.json and safetensors).
        #[arg(short, long, value_name = "DIR")]
        model: PathBuf,
        /// Where to write the manifest (default DIR/stormo-manifest.bin); the JSON view is
        /// written beside it with a .json extension.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Chunk size of the per-expert chunk hashes, in KiB (a power of two, 16 to 65536).
        #[arg(long, default_value_t = DEFAULT_CHUNK_SIZE / 1024, value_name = "KIB")]
        chunk_kib: u32,
        #[command(flatten)]
        io: IoArgs,
    },
    /// Sign a manifest with a publisher's secret key (writes the .sig beside the manifest).
    ///
    /// Refuses to replace a signature that is already there (naming its signer) unless
    /// --force is given.
    #[command(after_help = PATHS_HELP)]
    Sign {
        /// The model folder.
        #[arg(short, long, value_name = "DIR")]
        model: PathBuf,
        /// The secret key file (`stormo key generate`).
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        /// The manifest (default DIR/stormo-manifest.bin).
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
        /// Replace an existing signature (stderr names the key that had signed it).
        #[arg(long)]
        force: bool,
    },
    /// Check the signature and every local byte against the manifest.
    ///
    /// Reports exactly which tensor or expert differs, which file is truncated and what is
    /// missing, and exits non-zero on any mismatch. With --trust, the manifest must carry a
    /// valid signature by one of those keys; without it, a signature present is checked and
    /// its key shown but not trusted.
    #[command(after_help = PATHS_HELP)]
    Verify {
        /// The model folder.
        #[arg(short, long, value_name = "DIR")]
        model: PathBuf,
        /// The manifest (default DIR/stormo-manifest.bin).
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
        /// A trusted publisher key (64 hex characters); repeat for several.
        #[arg(long = "trust", value_name = "PUBKEY")]
        trust: Vec<PublicKey>,
        /// Check only the signature, not the local bytes.
        #[arg(long)]
        signature_only: bool,
        #[command(flatten)]
        io: IoArgs,
    },
    /// Measure build throughput against a raw read of the same files, in the same run.
    ///
    /// Each round reads every safetensors file of the model the way a build does (same block
    /// size, I/O mode and files at once) without hashing, then builds the manifest (written
    /// nowhere), and prints both rates in MB/s and their ratio. Compare like with like: with
    /// `--io direct` (the default) both passes read from the disk; with `--io buffered` both
    /// read whatever the page cache holds.
    Bench {
        /// The model folder.
        #[arg(short, long, value_name = "DIR")]
        model: PathBuf,
        /// Rounds of (read, build).
        #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100))]
        rounds: u32,
        #[command(flatten)]
        io: IoArgs,
    },
    /// Print a manifest's model id and summary (or its JSON view with --json).
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true)
        .args(["model", "manifest"])))]
    Show {
        /// The model folder (its manifest is DIR/stormo-manifest.bin).
        #[arg(short, long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// The manifest file (instead of the model folder's).
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
        /// Print the JSON view.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a manifest subcommand.
pub fn run(c: Command) -> anyhow::Result<()> {
    match c {
        Command::Build {
            model,
            out,
            chunk_kib,
            io,
        } => build(&model, out.as_deref(), chunk_kib, io.io),
        Command::Sign {
            model,
            key,
            manifest,
            force,
        } => sign(&model, &key, manifest.as_deref(), force),
        Command::Verify {
            model,
            manifest,
            trust,
            signature_only,
            io,
        } => verify(&model, manifest.as_deref(), &trust, signature_only, io.io),
        Command::Bench { model, rounds, io } => bench(&model, rounds, io.io),
        Command::Show {
            model,
            manifest,
            json,
        } => {
            let manifest = match (manifest, model) {
                (Some(f), _) => f,
                (None, Some(dir)) => dir.join(stormo_manifests::MANIFEST_FILE),
                (None, None) => anyhow::bail!("give --model or --manifest"),
            };
            let (m, bytes) = read_manifest(&manifest)?;
            if json {
                println!("{}", m.to_json());
            } else {
                println!("model id   {}", stormo_manifests::Hash::of(&bytes));
                println!("family     {}", m.identity.family);
                println!(
                    "files      {} ({})",
                    m.files.len(),
                    human_bytes(m.total_file_bytes())
                );
                println!("tensors    {}", m.tensors.len());
                println!("experts    {}", m.experts.len());
                println!("chunk size {}", human_bytes(m.chunk_size.into()));
            }
            Ok(())
        }
    }
}

/// Prints progress on stderr every half second while `work` runs, if stderr is a terminal or
/// the job is large.
fn with_progress<T>(what: &str, work: impl FnOnce(&Progress) -> T) -> T {
    let progress = Progress::new();
    let done = AtomicBool::new(false);
    let tty = std::io::stderr().is_terminal();
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut shown = false;
            let mut last = 0.0f64;
            // Only jobs longer than a second; every half second on a terminal, 5 s otherwise.
            let every = if tty { 0.5 } else { 5.0 };
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
                let secs = start.elapsed().as_secs_f64();
                let (d, t) = progress.get();
                if secs < 1.0 || t == 0 || secs - last < every {
                    continue;
                }
                last = secs;
                let pct = 100.0 * d as f64 / t as f64;
                let rate = human_bytes((d as f64 / secs) as u64);
                let eta = if d > 0 {
                    format!("{:.0} s", t.saturating_sub(d) as f64 / (d as f64 / secs))
                } else {
                    "?".to_string()
                };
                let line = format!(
                    "{what}: {pct:5.1}% of {}, {rate}/s, ETA {eta}",
                    human_bytes(t)
                );
                if tty {
                    eprint!("\r{line}   ");
                } else {
                    eprintln!("{line}");
                }
                shown = true;
            }
            if shown && tty {
                eprintln!();
            }
        });
        let out = work(&progress);
        done.store(true, Ordering::Relaxed);
        out
    })
}

/// Warns when O_DIRECT was asked for but some files were read through the page cache.
fn warn_fallbacks(io: IoMode, p: &Progress) {
    if io == IoMode::Direct && p.direct_fallbacks() > 0 {
        eprintln!(
            "warning: {} file(s) read through the page cache: the file system refused O_DIRECT",
            p.direct_fallbacks()
        );
    }
}

/// Refuses paths where a manifest's files would land on each other or on a file that is not
/// an earlier manifest (a checkpoint, a config, a key): `--out` names the .bin, and the .json
/// view and the .sig go beside it.
fn check_targets(paths: &ManifestPaths) -> anyhow::Result<()> {
    let (bin, json, sig) = (&paths.bin, &paths.json, &paths.sig);
    for p in [bin, json] {
        if p.is_dir() {
            bail!("{} is a folder; give a file path", p.display());
        }
    }
    if bin == json || bin == sig {
        bail!(
            "{}: the manifest, its JSON view and its signature would share one file; give a \
             path ending in .bin",
            bin.display()
        );
    }
    let bin_is_manifest = read_manifest(bin).is_ok();
    if bin.exists() && !bin_is_manifest {
        bail!(
            "{} exists and is not a manifest: refusing to overwrite it",
            bin.display()
        );
    }
    if json.exists() && !bin_is_manifest {
        bail!(
            "{} exists and is not the JSON view of a manifest at {}: refusing to overwrite it",
            json.display(),
            bin.display()
        );
    }
    Ok(())
}

fn build(model: &Path, out: Option<&Path>, chunk_kib: u32, io: IoMode) -> anyhow::Result<()> {
    let paths = ManifestPaths::resolve(model, out);
    check_targets(&paths)?;
    let (min, max) = (MIN_CHUNK_SIZE / 1024, MAX_CHUNK_SIZE / 1024);
    anyhow::ensure!(
        chunk_kib.is_power_of_two() && (min..=max).contains(&chunk_kib),
        "--chunk-kib {chunk_kib}: must be a power of two from {min} to {max} (KiB)"
    );
    let chunk_size = chunk_kib * 1024;
    let start = Instant::now();
    let m = with_progress("hashing", |p| {
        let m = stormo_manifests::build(
            model,
            &BuildOptions {
                chunk_size,
                progress: Some(p),
                io,
            },
        );
        warn_fallbacks(io, p);
        m
    })
    .with_context(|| format!("building the manifest of {}", model.display()))?;
    let secs = start.elapsed().as_secs_f64();
    let bytes = m.encode();
    write_atomic(&paths.bin, &bytes)?;
    write_atomic(&paths.json, m.to_json().as_bytes())?;
    let total = m.total_file_bytes();
    eprintln!(
        "hashed {} tensors, {} experts, {} in {secs:.1} s ({}/s)",
        m.tensors.len(),
        m.experts.len(),
        human_bytes(total),
        human_bytes((total as f64 / secs.max(1e-9)) as u64)
    );
    eprintln!("wrote {} and {}", paths.bin.display(), paths.json.display());
    if paths.sig.exists() {
        eprintln!(
            "note: {} is from an earlier manifest; sign again (with --force) if the model \
             changed",
            paths.sig.display()
        );
    }
    println!("{}", stormo_manifests::Hash::of(&bytes));
    Ok(())
}

fn sign(model: &Path, key: &Path, manifest: Option<&Path>, force: bool) -> anyhow::Result<()> {
    let paths = ManifestPaths::resolve(model, manifest);
    if paths.sig == paths.bin {
        bail!(
            "{}: the signature would overwrite the manifest; name the manifest with a .bin \
             extension",
            paths.bin.display()
        );
    }
    let key = stormo_net::identity::load_secret_key(key)?;
    let (m, bytes) = read_manifest(&paths.bin).context("run `stormo manifest build` first?")?;
    // A link counts as there, even a dangling one: writing would replace it.
    let old = std::fs::symlink_metadata(&paths.sig)
        .is_ok()
        .then(|| earlier_signature(&paths.sig, &bytes));
    if let (Some(old), false) = (&old, force) {
        bail!(
            "{} already exists ({old}): refusing to replace a signature; pass --force to \
             replace it",
            paths.sig.display()
        );
    }
    let sig = ManifestSignature::sign(&key, &m);
    write_atomic(&paths.sig, &sig.to_bytes())?;
    if let Some(old) = old {
        eprintln!("replaced {} ({old})", paths.sig.display());
    }
    eprintln!(
        "signed model id {} as {}; wrote {}",
        sig.model_id,
        sig.publisher,
        paths.sig.display()
    );
    Ok(())
}

/// A few words on the signature file at `path`, beside the manifest `manifest_bytes`: who
/// signed it, and whether for this manifest.
fn earlier_signature(path: &Path, manifest_bytes: &[u8]) -> String {
    let raw = match stormo_manifests::read_small_file(path, 4096) {
        Ok(raw) => raw,
        Err(e) => return format!("unreadable: {e}"),
    };
    let sig = match ManifestSignature::from_bytes(&raw) {
        Ok(sig) => sig,
        Err(e) => return format!("not a signature: {e}"),
    };
    match sig.check(manifest_bytes) {
        Ok(()) => format!("signed by {}, for this manifest", sig.publisher),
        Err(SignatureError::BadSignature { publisher }) => {
            format!("naming {publisher}, but not a valid signature by it")
        }
        Err(_) => format!(
            "signed by {}, for another manifest (model id {})",
            sig.publisher, sig.model_id
        ),
    }
}

fn verify(
    model: &Path,
    manifest: Option<&Path>,
    trust: &[PublicKey],
    signature_only: bool,
    io: IoMode,
) -> anyhow::Result<()> {
    let paths = ManifestPaths::resolve(model, manifest);
    let (m, bytes) = read_manifest(&paths.bin)?;
    let id = stormo_manifests::Hash::of(&bytes);
    println!("manifest {} (model id {id})", paths.bin.display());

    match std::fs::metadata(&paths.sig) {
        Ok(md) if md.len() <= 4096 => {
            let raw = stormo_manifests::read_small_file(&paths.sig, 4096)
                .with_context(|| format!("reading {}", paths.sig.display()))?;
            let sig = ManifestSignature::from_bytes(&raw)
                .with_context(|| paths.sig.display().to_string())?;
            if trust.is_empty() {
                sig.check(&bytes)
                    .with_context(|| format!("signature {}", paths.sig.display()))?;
                // The signer's key is not suggested for --trust: anyone can sign, and only a
                // key the user got from its publisher out of band should be trusted.
                println!(
                    "signature: valid, by {} (NOT pinned: anyone can sign; --trust PUBKEY \
                     requires the publisher's key, as its publisher gave it to you)",
                    sig.publisher
                );
            } else {
                sig.verify(&bytes, trust)
                    .with_context(|| format!("signature {}", paths.sig.display()))?;
                println!("signature: valid, by trusted key {}", sig.publisher);
            }
        }
        Ok(md) => bail!(
            "{}: {} bytes is not a signature file",
            paths.sig.display(),
            md.len()
        ),
        Err(_) if trust.is_empty() => println!("signature: none ({})", paths.sig.display()),
        Err(e) => bail!(
            "--trust was given but the manifest is not signed ({}: {e})",
            paths.sig.display()
        ),
    }
    if signature_only {
        return Ok(());
    }

    let start = Instant::now();
    let report = with_progress("verifying", |p| {
        let r = stormo_manifests::verify(
            model,
            &m,
            &VerifyOptions {
                progress: Some(p),
                io,
            },
        );
        warn_fallbacks(io, p);
        r
    })?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "checked {} in {secs:.1} s ({}/s)",
        human_bytes(report.bytes),
        human_bytes((report.bytes as f64 / secs.max(1e-9)) as u64)
    );
    if report.is_ok() {
        println!(
            "OK: {} tensors, {} experts, {} files ({}) match the manifest",
            report.tensors,
            report.experts,
            m.files.len(),
            human_bytes(report.bytes)
        );
        return Ok(());
    }
    if stormo_net::pull::Pulled::dense_only(model).unwrap_or(false) {
        println!(
            "note: {} was pulled without experts ({}): it holds the dense tensors only (in \
             *.dense.safetensors files, or, pulled by an older stormo, in files whose expert \
             bytes are holes), so the expert tensors, the experts and the published files \
             differ from the manifest by design (`stormo pull` into it checks the dense \
             tensors; `stormo pull --with-experts` fetches the rest)",
            model.display(),
            stormo_net::pull::MARKER_FILE
        );
    }
    const SHOWN: usize = 200;
    for p in report.problems.iter().take(SHOWN) {
        println!("MISMATCH {p}");
    }
    if report.problems.len() > SHOWN {
        println!("... and {} more", report.problems.len() - SHOWN);
    }
    bail!(
        "{} does not match its manifest: {} problem(s)",
        model.display(),
        report.problems.len()
    )
}

fn bench(model: &Path, rounds: u32, io: IoMode) -> anyhow::Result<()> {
    let ckpt = stormo_engine::safetensors::Checkpoint::open(model)
        .with_context(|| format!("opening the checkpoint in {}", model.display()))?;
    let names: Vec<String> = ckpt
        .files
        .iter()
        .map(|f| {
            f.path
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)
                .with_context(|| format!("{}: not a UTF-8 file name", f.path.display()))
        })
        .collect::<anyhow::Result<_>>()?;
    let bytes: u64 = ckpt.files.iter().map(|f| f.len).sum();
    drop(ckpt);
    println!(
        "{}: {} files, {}, --io {}",
        model.display(),
        names.len(),
        human_bytes(bytes),
        match io {
            IoMode::Direct => "direct",
            _ => "buffered",
        }
    );
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        let t = Instant::now();
        let read = with_progress("reading", |p| {
            let r = stormo_manifests::read_files(model, &names, io, Some(p));
            warn_fallbacks(io, p);
            r
        })?;
        let read_mbs = read as f64 / 1e6 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        let m = with_progress("building", |p| {
            let m = stormo_manifests::build(
                model,
                &BuildOptions {
                    progress: Some(p),
                    io,
                    ..BuildOptions::default()
                },
            );
            warn_fallbacks(io, p);
            m
        })?;
        let build_mbs = m.total_file_bytes() as f64 / 1e6 / t.elapsed().as_secs_f64();
        let ratio = build_mbs / read_mbs;
        ratios.push(ratio);
        println!(
            "round {round}: raw read {read_mbs:.0} MB/s, manifest build {build_mbs:.0} MB/s, \
             build/read {ratio:.2}"
        );
    }
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    // The middle value; with an even count, the mean of the two middle ones.
    let median = (ratios[(n - 1) / 2] + ratios[n / 2]) / 2.0;
    println!("median build/read ratio over {rounds} round(s): {median:.2}");
    Ok(())
}

/// Writes a file through a temporary name and a rename, so a reader never sees half of it.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{} is not a file path", path.display()))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    // Checked first, so no temporary file is left beside a folder the rename cannot replace.
    if path.is_dir() {
        anyhow::bail!("{} is a folder; give a file path", path.display());
    }
    let written = std::fs::write(&tmp, bytes)
        .with_context(|| format!("writing {}", tmp.display()))
        .and_then(|()| {
            std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
        });
    if written.is_err() {
        // Best effort: the error above is the one to report.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
