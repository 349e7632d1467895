//! `stormo convert`: write a checkpoint's experts as a flat, 4 KiB-aligned store.

use std::path::PathBuf;

use anyhow::Context;
use stormo_engine::tiers::store;

use stormo_net::progress::Progress;

/// Arguments of `stormo convert`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model directory as published (config.json and safetensors).
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    /// Where to write the store (must not exist, or be empty). It holds experts.bin (one
    /// 4 KiB-aligned record per expert, read with one O_DIRECT read), dense.safetensors (every
    /// other tensor, unchanged), stormo-store.json (the index) and the model's small files.
    /// `stormo run --model DIR` on it then gives bit-identical logits to the original.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// No progress on stderr.
    #[arg(long, short)]
    pub quiet: bool,
}

/// Runs `stormo convert`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let mut p = Progress::new("converting").quiet(a.quiet);
    store::convert(&a.model, &a.out, |d, t| p.update(d, t))
        .with_context(|| format!("converting {} into {}", a.model.display(), a.out.display()))?;
    p.finish();
    if !a.quiet {
        eprintln!("wrote {}", a.out.display());
    }
    Ok(())
}
