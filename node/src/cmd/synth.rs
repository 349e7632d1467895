//! `stormo synth`: random-weight checkpoints at real geometry. (Not implemented yet.)

/// Arguments of `stormo synth`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where to write the checkpoint.
    #[arg(long, value_name = "DIR")]
    pub out: std::path::PathBuf,
}

/// Runs `stormo synth`.
pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("stormo synth is not implemented yet")
}
