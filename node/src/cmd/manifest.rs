//! `stormo manifest`: build, sign and verify manifests. (Not implemented yet.)

/// Manifest subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Write the L0 manifest of a checkpoint.
    Build {
        /// The model directory.
        #[arg(long)]
        model: std::path::PathBuf,
    },
}

/// Runs a manifest subcommand.
pub fn run(_c: Command) -> anyhow::Result<()> {
    anyhow::bail!("stormo manifest is not implemented yet")
}
