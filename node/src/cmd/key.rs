//! `stormo key`: Ed25519 node and publisher keys.

use std::io::Read;
use std::path::{Path, PathBuf};

use stormo_manifests::keys::{KeyError, SECRET_KEY_HEADER};
use stormo_manifests::SecretKey;

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

/// What a secret key file holds, for errors about a file that is not one.
fn expected() -> String {
    format!(
        "a secret key file is what `stormo key generate` writes: the line \
         `{SECRET_KEY_HEADER}`, then the key as 64 hex characters"
    )
}

/// Reads a secret key file (as [`SecretKey::load`]), saying plainly when the file is not a
/// stormo key at all: `load` checks the mode first, and its `chmod` advice would mislead
/// about, say, a config.json that anyone may read. Permissions are named only for a file
/// that starts like a key.
pub(crate) fn load_secret_key(path: &Path) -> anyhow::Result<SecretKey> {
    let e = match SecretKey::load(path) {
        Ok(key) => return Ok(key),
        Err(e) => e,
    };
    let e = match e {
        KeyError::Permissions { .. } if !starts_like_a_key(path) => anyhow::anyhow!(
            "{}: not a stormo secret key (its first line is not `{SECRET_KEY_HEADER}`); {}",
            path.display(),
            expected()
        ),
        e @ KeyError::Format { .. } => anyhow::anyhow!("{e}; {}", expected()),
        e => e.into(),
    };
    Err(e.context("cannot use the secret key"))
}

/// Whether the first line of `path` is a secret key file's header. Reads that line only
/// (byte by byte, at most a few dozen bytes), never the key after it.
fn starts_like_a_key(path: &Path) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() <= SECRET_KEY_HEADER.len() + 64 {
        match f.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(_) => return false,
        }
    }
    line.trim_ascii() == SECRET_KEY_HEADER.as_bytes()
}
