//! `stormo key`: Ed25519 node and publisher keys.

use std::path::PathBuf;

use stormo_manifests::SecretKey;
use stormo_net::identity::load_secret_key;

/// Key subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Create a new secret key file (mode 0600, never overwritten) and print its public key.
    ///
    /// The public key is printed as 64 lowercase hex characters: the form that `--trust`,
    /// `--allow` and `KEY@HOST:PORT` take. The secret is never printed.
    Generate {
        /// Where to write the secret key (must not exist): the file `--key` then names to
        /// `key show`, `run`, `serve` and `manifest sign`.
        #[arg(long, alias = "out", value_name = "FILE")]
        key: PathBuf,
    },
    /// Print the public key of a secret key file (64 hex characters).
    ///
    /// The file must be one that `stormo key generate` wrote, and is refused if anyone but
    /// its owner may read or write it (mode 0600 or 0400).
    Show {
        /// The secret key file.
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
    },
}

/// Runs a key subcommand.
pub fn run(c: Command) -> anyhow::Result<()> {
    match c {
        Command::Generate { key: out } => {
            let key = SecretKey::generate();
            key.write_new(&out)?;
            eprintln!("wrote secret key {} (mode 0600)", out.display());
            println!("{}", key.public());
        }
        Command::Show { key } => {
            let key = load_secret_key(&key)?;
            println!("{}", key.public());
        }
    }
    Ok(())
}
