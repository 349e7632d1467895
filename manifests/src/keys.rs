//! Ed25519 keys: a publisher's or node's secret key on disk, and public keys in text.
//!
//! # Public key text form
//! A public key is written as its 32 bytes in **lowercase hex** (64 characters), e.g.
//! `d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a`. That is what
//! `stormo key show` prints and what `--trust`, `--allow` and `KEY@HOST:PORT` take (upper
//! case is accepted on input). The form is pinned by a test against RFC 8032's first vector.
//!
//! # Secret key file
//! Two lines of text: the header `stormo-ed25519-secret-key-v1` and the 32-byte seed in
//! hex. It is created with mode 0600 (never overwriting a file) and refused when its mode
//! lets anyone but the owner read or write it. The seed is never printed: [`SecretKey`]'s
//! `Debug` is `SecretKey(..)` and the key is zeroized on drop.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use zeroize::Zeroizing;

/// The first line of a secret key file.
pub const SECRET_KEY_HEADER: &str = "stormo-ed25519-secret-key-v1";
/// The largest secret key file read.
const MAX_SECRET_FILE: u64 = 4096;

/// An Ed25519 secret key. Prints as `SecretKey(..)`; zeroized on drop.
pub struct SecretKey(SigningKey);

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

/// An Ed25519 public key (a node id or a publisher id).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey([u8; 32]);

/// Why a key could not be read, parsed or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Reading or writing the file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `generate` will not overwrite a file.
    #[error("{}: already exists; refusing to overwrite a key", path.display())]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// The secret key file is readable or writable by others.
    #[error(
        "{}: permissions {mode:04o} are too open for a secret key; run `chmod 600 {}`",
        path.display(),
        path.display()
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file is not a stormo secret key.
    #[error("{}: not a stormo secret key file ({reason})", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: &'static str,
    },
    /// Text that is not a public key.
    #[error("{input:?} is not a public key: {reason} (a public key is 64 hex characters, as `stormo key generate` prints a node's and `stormo swarm create` a swarm's)")]
    Public {
        /// The text given (truncated).
        input: String,
        /// What is wrong.
        reason: &'static str,
    },
}

impl SecretKey {
    /// A new random key from the operating system's RNG.
    pub fn generate() -> Self {
        let mut seed = Zeroizing::new([0u8; 32]);
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, seed.as_mut());
        Self::from_seed(&seed)
    }

    /// The key with this 32-byte seed (RFC 8032 "secret key").
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        Self(SigningKey::from_bytes(seed))
    }

    /// The 32-byte seed (for building the node's TLS key); zeroized when dropped.
    pub fn seed(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(self.0.to_bytes())
    }

    /// Its public key.
    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key().to_bytes())
    }

    /// Signs `msg` (crate-internal: every signature stormo makes is domain-separated).
    pub(crate) fn sign(&self, msg: &[u8]) -> [u8; 64] {
        self.0.sign(msg).to_bytes()
    }

    /// Writes the key to a new file with mode 0600. Fails if the file exists.
    pub fn write_new(&self, path: &Path) -> Result<(), KeyError> {
        let io = |source| KeyError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = opts.open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                KeyError::Exists {
                    path: path.to_path_buf(),
                }
            } else {
                io(e)
            }
        })?;
        let raw = Zeroizing::new(self.0.to_bytes());
        let seed = Zeroizing::new(hex::encode(raw.as_ref()));
        let text = Zeroizing::new(format!("{SECRET_KEY_HEADER}\n{}\n", seed.as_str()));
        f.write_all(text.as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)
    }

    /// Reads a key file, refusing it if its permissions let others read or write it.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let io = |source| KeyError::Io {
            path: path.to_path_buf(),
            source,
        };
        let fmt = |reason| KeyError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        // Before the permissions: a directory's mode would otherwise draw a `chmod` advice.
        if !meta.is_file() {
            return Err(fmt("not a regular file"));
        }
        #[cfg(unix)]
        {
            let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777;
            if mode & 0o077 != 0 {
                return Err(KeyError::Permissions {
                    path: path.to_path_buf(),
                    mode,
                });
            }
        }
        if meta.len() > MAX_SECRET_FILE {
            return Err(fmt("too large to be a key file"));
        }
        let bytes = Zeroizing::new(std::fs::read(path).map_err(io)?);
        let text = std::str::from_utf8(&bytes).map_err(|_| fmt("not UTF-8"))?;
        let mut lines = text.lines();
        if lines.next().map(str::trim) != Some(SECRET_KEY_HEADER) {
            return Err(fmt("missing the header line"));
        }
        let hex_seed = lines.next().map(str::trim).ok_or(fmt("missing the key"))?;
        if lines.any(|l| !l.trim().is_empty()) {
            return Err(fmt("unexpected lines after the key"));
        }
        let mut seed = Zeroizing::new([0u8; 32]);
        hex::decode_to_slice(hex_seed, seed.as_mut())
            .map_err(|_| fmt("the key is not 64 hex characters"))?;
        Ok(Self::from_seed(&seed))
    }
}

impl PublicKey {
    /// From raw bytes; fails on bytes that are not a usable Ed25519 point.
    pub fn from_bytes(bytes: &[u8; 32]) -> Result<Self, KeyError> {
        let vk = VerifyingKey::from_bytes(bytes).map_err(|_| KeyError::Public {
            input: hex::encode(bytes),
            reason: "not a valid Ed25519 point",
        })?;
        if vk.is_weak() {
            return Err(KeyError::Public {
                input: hex::encode(bytes),
                reason: "a weak (small-order) key",
            });
        }
        Ok(Self(*bytes))
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex (the text form).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Checks an Ed25519 signature (strict: no malleable signatures, no small-order keys).
    pub(crate) fn verify(&self, msg: &[u8], sig: &[u8; 64]) -> bool {
        let Ok(vk) = VerifyingKey::from_bytes(&self.0) else {
            return false;
        };
        vk.verify_strict(msg, &Signature::from_bytes(sig)).is_ok()
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", &self.to_hex()[..10])
    }
}

impl FromStr for PublicKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let input: String = s.chars().take(80).collect();
        let s = s.trim();
        if s.len() != 64 {
            return Err(KeyError::Public {
                input,
                reason: "wrong length",
            });
        }
        let mut b = [0u8; 32];
        hex::decode_to_slice(s, &mut b).map_err(|_| KeyError::Public {
            input,
            reason: "not hex",
        })?;
        Self::from_bytes(&b)
    }
}

impl serde::Serialize for PublicKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.to_hex())
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> serde::Deserialize<'de> for PublicKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(serde::de::Error::custom)
        } else {
            let b = <[u8; 32]>::deserialize(d)?;
            Self::from_bytes(&b).map_err(serde::de::Error::custom)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 8032 section 7.1, TEST 1: the text form of a public key is its lowercase hex.
    #[test]
    fn public_key_text_form_is_pinned_by_rfc8032() {
        let seed: [u8; 32] =
            hex::decode("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
                .unwrap()
                .try_into()
                .unwrap();
        let pk = SecretKey::from_seed(&seed).public();
        let text = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";
        assert_eq!(pk.to_string(), text);
        assert_eq!(text.parse::<PublicKey>().unwrap(), pk);
        assert_eq!(text.to_uppercase().parse::<PublicKey>().unwrap(), pk);
        assert!(text[..63].parse::<PublicKey>().is_err());
        assert!(format!("{}g", &text[..63]).parse::<PublicKey>().is_err());
        // The identity point is a weak key.
        let weak = format!("01{}", "00".repeat(31));
        assert!(weak.parse::<PublicKey>().is_err());
    }

    #[test]
    fn secret_key_never_prints() {
        let k = SecretKey::from_seed(&[7; 32]);
        assert_eq!(format!("{k:?}"), "SecretKey(..)");
        assert_eq!(format!("{:?}", Some(&k)), "Some(SecretKey(..))");
    }

    #[cfg(unix)]
    #[test]
    fn secret_key_file_is_0600_round_trips_and_is_refused_when_loose() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        let k = SecretKey::generate();
        k.write_new(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with(SECRET_KEY_HEADER));
        assert_eq!(SecretKey::load(&path).unwrap().public(), k.public());
        assert!(matches!(
            SecretKey::generate().write_new(&path),
            Err(KeyError::Exists { .. })
        ));
        for loose in [0o644, 0o640, 0o602, 0o660] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(loose)).unwrap();
            assert!(matches!(
                SecretKey::load(&path),
                Err(KeyError::Permissions { mode, .. }) if mode == loose
            ));
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert!(SecretKey::load(&path).is_ok());
    }

    #[cfg(unix)]
    #[test]
    fn malformed_secret_files_are_rejected() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for (i, body) in [
            "nope\n00\n".to_string(),
            format!("{SECRET_KEY_HEADER}\nzz\n"),
            format!("{SECRET_KEY_HEADER}\n"),
            format!("{SECRET_KEY_HEADER}\n{}\nextra\n", "00".repeat(32)),
        ]
        .into_iter()
        .enumerate()
        {
            let p = dir.path().join(format!("k{i}"));
            std::fs::write(&p, body).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
            assert!(matches!(SecretKey::load(&p), Err(KeyError::Format { .. })));
        }
    }

    #[test]
    fn signatures_verify_only_for_the_signed_message_and_key() {
        let k = SecretKey::from_seed(&[3; 32]);
        let sig = k.sign(b"abc");
        assert!(k.public().verify(b"abc", &sig));
        assert!(!k.public().verify(b"abd", &sig));
        assert!(!SecretKey::from_seed(&[4; 32]).public().verify(b"abc", &sig));
    }
}
