//! `stormo tokenize`: text to token ids and back. (Not implemented yet.)

/// Arguments of `stormo tokenize`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model directory (its tokenizer.json is used).
    #[arg(long, value_name = "DIR")]
    pub model: std::path::PathBuf,
}

/// Runs `stormo tokenize`.
pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("stormo tokenize is not implemented yet")
}
