//! A node's identity on disk: its Ed25519 secret key file, its swarm membership certificate,
//! and the clock both are checked against. Loading names what is wrong with a file in the
//! user's terms (a file that is not a key at all is not told to fix its permissions).

use std::io::Read;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use stormo_manifests::keys::{KeyError, SECRET_KEY_HEADER};
use stormo_manifests::{Membership, SecretKey, MEMBERSHIP_LEN};

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
pub fn load_secret_key(path: &Path) -> anyhow::Result<SecretKey> {
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

/// Seconds since the Unix epoch.
pub fn unix_now() -> anyhow::Result<u64> {
    Ok(SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the system clock is before 1970")?
        .as_secs())
}

/// `YYYY-MM-DD HH:MM` (UTC) of Unix seconds (the seconds and the zone left off:
/// [`stormo_manifests::membership::utc_date_time`] without its last `:SS UTC`).
pub fn utc_date_time(secs: u64) -> String {
    let mut s = stormo_manifests::membership::utc_date_time(secs);
    s.truncate(s.len() - ":SS UTC".len());
    s
}

/// Reads a membership certificate file (bounded; a file that is not one is named).
pub fn read_cert(path: &Path) -> anyhow::Result<Membership> {
    let bytes = stormo_manifests::read_small_file(path, 4096)
        .with_context(|| format!("{}: cannot read the membership certificate", path.display()))?;
    // `read_small_file` caps the size; anything but the exact length fails to decode below.
    debug_assert!(bytes.len() <= 4096);
    Membership::from_bytes(&bytes).with_context(|| {
        format!(
            "{}: not a membership certificate (`stormo swarm admit` writes {MEMBERSHIP_LEN} bytes)",
            path.display()
        )
    })
}
