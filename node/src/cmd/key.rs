//! `stormo key`: Ed25519 keys. (Not implemented yet.)

/// Key subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create a new secret key file (mode 0600).
    Generate {
        /// Where to write the secret key.
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

/// Runs a key subcommand.
pub fn run(_c: Command) -> anyhow::Result<()> {
    anyhow::bail!("stormo key is not implemented yet")
}
