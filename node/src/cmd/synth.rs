//! `stormo synth`: random-weight checkpoints at real geometry, in the published layout.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use stormo_net::progress::human_bytes;
use stormo_simulations::synth::{self, HotExperts, Overrides, Preset, Progress, SynthOptions};

/// A published model to imitate.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum PresetArg {
    /// openai/gpt-oss-20b: 24 layers, 32 MXFP4 experts per layer (about 13.8 GB).
    #[value(name = "gpt-oss-20b")]
    GptOss20b,
    /// openai/gpt-oss-120b: 36 layers, 128 MXFP4 experts per layer (about 65 GB).
    #[value(name = "gpt-oss-120b")]
    GptOss120b,
    /// Qwen/Qwen3-30B-A3B: 48 layers, 128 BF16 experts per layer (about 61 GB).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
}

impl From<PresetArg> for Preset {
    fn from(p: PresetArg) -> Self {
        match p {
            PresetArg::GptOss20b => Self::GptOss20b,
            PresetArg::GptOss120b => Self::GptOss120b,
            PresetArg::Qwen3_30bA3b => Self::Qwen3_30bA3b,
        }
    }
}

/// Geometry overrides, for small test and demo models.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Geometry overrides (default: the preset's)")]
pub struct GeometryArgs {
    /// Decoder layers.
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Residual width (a multiple of 32 for GPT-OSS).
    #[arg(long, value_name = "N")]
    pub hidden: Option<usize>,
    /// Per-expert intermediate width (a multiple of 32 for GPT-OSS).
    #[arg(long, value_name = "N")]
    pub intermediate: Option<usize>,
    /// Experts per layer.
    #[arg(long, value_name = "N")]
    pub experts: Option<usize>,
    /// Experts chosen per token.
    #[arg(long, value_name = "N")]
    pub top_k: Option<usize>,
    /// Vocabulary size (eos/pad/bos ids beyond it are moved to its last ids).
    #[arg(long, value_name = "N")]
    pub vocab: Option<usize>,
    /// Query heads.
    #[arg(long, value_name = "N")]
    pub heads: Option<usize>,
    /// Key/value heads (must divide --heads).
    #[arg(long, value_name = "N")]
    pub kv_heads: Option<usize>,
    /// Width of each head (even).
    #[arg(long, value_name = "N")]
    pub head_dim: Option<usize>,
}

/// Arguments of `stormo synth`.
///
/// Writes a checkpoint with random weights but the exact geometry and on-disk layout of a
/// published model: sharded safetensors with `model.safetensors.index.json`, `config.json` and
/// `generation_config.json` as the Hugging Face hub ships them (GPT-OSS experts in MXFP4,
/// everything else BF16). The same seed always gives byte-identical files. Weights are drawn
/// so a forward pass stays finite with varied logits; they carry no knowledge.
///
/// Example: `stormo synth --preset gpt-oss-20b --out /data/gpt-oss-20b` (13.8 GB), or a small
/// model with the real vocabulary: `stormo synth --preset gpt-oss-20b --layers 2 --hidden 256
/// --intermediate 256 --experts 8 --heads 4 --kv-heads 2 --out /tmp/small`.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The published model whose geometry and layout to reproduce.
    #[arg(long, value_enum)]
    pub preset: PresetArg,
    /// Where to write the checkpoint (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Seed of every weight: the same seed gives byte-identical files.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub seed: u64,
    #[command(flatten)]
    pub geometry: GeometryArgs,
    /// Skew routing: this share of each layer's experts (chosen from the seed) is hot.
    #[arg(long, value_name = "FRACTION")]
    pub hot_experts: Option<f64>,
    /// How strongly hot experts are preferred: added to their router bias (GPT-OSS, router
    /// logits are about N(0,1)); their router rows are scaled by 1 + B (Qwen3, no router bias).
    #[arg(
        long,
        value_name = "B",
        default_value_t = 2.0,
        requires = "hot_experts"
    )]
    pub hot_bias: f32,
    /// Largest shard (tensor bytes), e.g. 4.8GB, 512MiB or 1000000 (default: as the hub's,
    /// 4.8 GB for GPT-OSS and 4 GB for Qwen3).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub shard_size: Option<u64>,
    /// Copy this tokenizer.json into the checkpoint (its ids must fit the model's vocabulary,
    /// e.g. the o200k_harmony tokenizer with GPT-OSS's 201088 ids).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Replace the checkpoint files already in --out, and remove the files that described
    /// the old checkpoint (its manifest and signature beside it, a pull's marker) and its
    /// tokenizer.json unless --tokenizer gives one. Other files in --out are kept.
    #[arg(long)]
    pub force: bool,
    /// Print the files that would be written, and their sizes, without writing anything.
    #[arg(long)]
    pub dry_run: bool,
    /// No progress on stderr. The result still goes to stdout (one line saying what was
    /// written, and the hot experts), and files --force removes are still named on stderr.
    #[arg(long, short)]
    pub quiet: bool,
}

/// A shard size: [`stormo_net::progress::parse_size`] (one size syntax across the CLI), at least one
/// byte.
pub fn parse_size(s: &str) -> Result<u64, String> {
    match stormo_net::progress::parse_size(s)? {
        0 => Err(format!("size {s:?} must be at least one byte")),
        v => Ok(v),
    }
}

fn secs(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

fn progress_line(p: &Progress) -> String {
    let pct = if p.total > 0 {
        100.0 * p.written as f64 / p.total as f64
    } else {
        100.0
    };
    let eta = p.eta().map_or_else(|| "?".to_string(), secs);
    format!(
        "synth: {} / {} ({pct:.0}%), {}/s, ETA {eta}",
        human_bytes(p.written),
        human_bytes(p.total),
        human_bytes(p.rate() as u64)
    )
}

/// Runs `stormo synth`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let g = &a.geometry;
    let preset: Preset = a.preset.into();
    let geometry = preset.geometry().with(&Overrides {
        layers: g.layers,
        hidden: g.hidden,
        intermediate: g.intermediate,
        experts: g.experts,
        top_k: g.top_k,
        vocab: g.vocab,
        heads: g.heads,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
    });
    let opts = SynthOptions {
        geometry,
        seed: a.seed,
        hot: a.hot_experts.map(|fraction| HotExperts {
            fraction,
            bias: a.hot_bias,
        }),
        shard_bytes: a.shard_size,
    };
    let plan = synth::plan(&opts)?;
    if let Some(t) = &a.tokenizer {
        check_tokenizer(t, geometry.vocab)?;
        let dest = a.out.join("tokenizer.json");
        if dest.exists() && !a.force && !a.dry_run {
            bail!(
                "{} already exists; choose an empty folder or pass --force to replace it",
                dest.display()
            );
        }
    }
    // Files beside an earlier checkpoint that describe it: kept, they would contradict the
    // weights written now (a later `manifest verify` fails on every tensor).
    let stale = stale_companions(&a.out);
    if let (Some(first), false, false) = (stale.first(), a.force, a.dry_run) {
        bail!(
            "{} is from an earlier checkpoint; choose an empty folder, or pass --force to \
             replace that checkpoint and remove it",
            first.display()
        );
    }
    // With --force and no --tokenizer, the tokenizer of the checkpoint replaced goes too: the
    // folder then holds what this synthesis wrote, not a tokenizer of another vocabulary.
    let old_tokenizer = if a.force && a.tokenizer.is_none() {
        old_tokenizer(&a.out, !stale.is_empty())?
    } else {
        None
    };
    if a.dry_run {
        println!(
            "{} ({} layers, {} experts of {}, hidden {}, vocab {}), seed {}: {} in {} shards",
            preset,
            geometry.layers,
            geometry.experts,
            geometry.intermediate,
            geometry.hidden,
            geometry.vocab,
            a.seed,
            human_bytes(plan.files_size()),
            plan.shards.len()
        );
        for s in &plan.shards {
            println!("  {}  {} bytes", s.file_name, s.file_len());
        }
        println!(
            "  model.safetensors.index.json  total_size {}",
            plan.total_size()
        );
        if let Some(t) = &a.tokenizer {
            println!("  tokenizer.json  copied from {}", t.display());
        }
        if a.force {
            for p in &stale {
                println!(
                    "  {}  removed (it describes the checkpoint replaced)",
                    p.display()
                );
            }
            if let Some(p) = &old_tokenizer {
                println!(
                    "  {}  removed (it belongs to the checkpoint replaced)",
                    p.display()
                );
            }
        }
        return Ok(());
    }
    // Removed before the new weights are written: a write that fails partway leaves no
    // manifest claiming the folder.
    for p in &stale {
        std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
    }
    if !stale.is_empty() {
        let names: Vec<String> = stale.iter().map(|p| p.display().to_string()).collect();
        eprintln!(
            "removed {}: they described the checkpoint replaced (`stormo manifest build` and \
             `sign` describe the new one)",
            names.join(", ")
        );
    }
    if let Some(p) = &old_tokenizer {
        std::fs::remove_file(p).with_context(|| format!("removing {}", p.display()))?;
        eprintln!(
            "removed {}: it belonged to the checkpoint replaced (--tokenizer FILE gives the new \
             one a tokenizer; without one, only `stormo run --prompt-ids` works)",
            p.display()
        );
    }

    let tty = std::io::stderr().is_terminal();
    let mut last_line = std::time::Instant::now();
    let mut on_progress = |p: &Progress| {
        if a.quiet {
            return;
        }
        let mut err = std::io::stderr().lock();
        if tty {
            let _ = write!(err, "\r{:<70}", progress_line(p));
            let _ = err.flush();
        } else if last_line.elapsed() >= Duration::from_secs(5) || p.written == p.total {
            last_line = std::time::Instant::now();
            let _ = writeln!(err, "{}", progress_line(p));
        }
    };
    let report = synth::write(&plan, &a.out, a.force, &mut on_progress)
        .with_context(|| format!("writing the checkpoint to {}", a.out.display()))?;
    if tty && !a.quiet {
        eprintln!();
    }
    if report.bytes == 0 {
        bail!("nothing was written");
    }
    if let Some(t) = &a.tokenizer {
        let dest = a.out.join("tokenizer.json");
        // Copying a file onto itself truncates it first: a tokenizer already in place stays.
        let same = matches!(
            (t.canonicalize(), dest.canonicalize()),
            (Ok(a), Ok(b)) if a == b
        );
        if !same {
            std::fs::copy(t, &dest)
                .with_context(|| format!("copying {} to {}", t.display(), dest.display()))?;
        }
    }
    let rate = report.bytes as f64 / report.elapsed.as_secs_f64().max(1e-9);
    println!(
        "wrote {} ({}, seed {}) to {}: {} in {} files, {} ({}/s)",
        preset,
        if plan.shards.len() == 1 {
            "1 shard".to_string()
        } else {
            format!("{} shards", plan.shards.len())
        },
        a.seed,
        a.out.display(),
        human_bytes(report.bytes),
        report.files.len() + usize::from(a.tokenizer.is_some()),
        secs(report.elapsed),
        human_bytes(rate as u64)
    );
    if opts.hot.is_some() {
        for (l, hot) in plan.hot_experts.iter().enumerate() {
            let list: Vec<String> = hot.iter().map(usize::to_string).collect();
            println!("  layer {l}: hot experts {}", list.join(","));
        }
    }
    Ok(())
}

/// The files in `dir` that describe the checkpoint there rather than hold it: the manifest,
/// its JSON view and signature where `stormo manifest build` and `sign` put them by default,
/// and the marker of `stormo pull`. Those that exist (a dangling link counts).
fn stale_companions(dir: &Path) -> Vec<PathBuf> {
    let m = stormo_manifests::ManifestPaths::beside_model(dir);
    [
        m.bin,
        m.json,
        m.sig,
        dir.join(stormo_net::pull::MARKER_FILE),
    ]
    .into_iter()
    .filter(|p| std::fs::symlink_metadata(p).is_ok())
    .collect()
}

/// `dir/tokenizer.json` when it belongs to an earlier checkpoint: one whose files are in `dir`
/// or, `described`, whose manifest, signature or pull marker is. A tokenizer.json in a folder
/// holding neither was put there for the checkpoint about to be written, and is kept; so is a
/// folder of that name (synth never writes one). A dangling link counts.
fn old_tokenizer(dir: &Path, described: bool) -> anyhow::Result<Option<PathBuf>> {
    let p = dir.join("tokenizer.json");
    if !std::fs::symlink_metadata(&p).is_ok_and(|m| !m.is_dir()) {
        return Ok(None);
    }
    let earlier = described || !synth::checkpoint_files(dir)?.is_empty();
    Ok(earlier.then_some(p))
}

/// Checks that the tokenizer in `path` loads and that every id it can produce is below
/// `vocab` (the model's embedding rows).
pub fn check_tokenizer(path: &Path, vocab: usize) -> anyhow::Result<()> {
    let tok = stormo_text::Tokenizer::from_file(path)
        .with_context(|| format!("--tokenizer {}", path.display()))?;
    let n = tok.vocab_size();
    if n > vocab {
        bail!(
            "--tokenizer {}: its ids go up to {}, but the model's vocabulary has only {vocab} ids (give --vocab {n} or more)",
            path.display(),
            n - 1
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4.8GB"), Ok(4_800_000_000));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GB").is_err());
    }
}
