//! `stormo key`: Ed25519 node and publisher keys.

use std::path::PathBuf;

use anyhow::Context;
use stormo_manifests::SecretKey;

/// Key subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create a new secret key file (mode 0600, never overwritten) and print its public key.
    ///
    /// The public key is printed as 64 lowercase hex characters: the form that `--trust`,
    /// `--allow` and `KEY@HOST:PORT` take. The secret is never printed.
    Generate {
        /// Where to write the secret key (must not exist).
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the public key of a secret key file (64 hex characters).
    ///
    /// The file is refused if anyone but its owner may read or write it (mode 0600 or 0400).
    Show {
        /// The secret key file.
        #[arg(long)]
        key: PathBuf,
    },
}

/// Runs a key subcommand.
pub fn run(c: Command) -> anyhow::Result<()> {
    match c {
        Command::Generate { out } => {
            let key = SecretKey::generate();
            key.write_new(&out)?;
            eprintln!("wrote secret key {} (mode 0600)", out.display());
            println!("{}", key.public());
        }
        Command::Show { key } => {
            let key = SecretKey::load(&key).context("cannot use the secret key")?;
            println!("{}", key.public());
        }
    }
    Ok(())
}
