//! Signatures: a publisher's Ed25519 key binding a model id.
//!
//! # Signature file (version 1, 170 bytes)
//!
//! ```text
//! bytes   0..8    magic b"STORMOSG"
//! bytes   8..10   version, u16 little-endian (1)
//! bytes  10..42   publisher public key
//! bytes  42..74   model id (BLAKE3 of the canonical manifest bytes)
//! bytes  74..106  identity digest (BLAKE3 of the postcard of the manifest's identity section)
//! bytes 106..170  Ed25519 signature over SIGNING_CONTEXT || model id || identity digest
//! ```
//!
//! The identity digest is what tells a manifest altered after signing (same model, other
//! bytes: [`SignatureError::ManifestAltered`]) from a signature made over another model's
//! manifest ([`SignatureError::OtherManifest`]).

use crate::hash::Hash;
use crate::keys::{KeyError, PublicKey, SecretKey};
use crate::manifest::Manifest;

/// The first 8 bytes of a signature file.
pub const SIG_MAGIC: [u8; 8] = *b"STORMOSG";
/// The signature file version.
pub const SIG_VERSION: u16 = 1;
/// The length of a version-1 signature file.
pub const SIG_LEN: usize = 8 + 2 + 32 + 32 + 32 + 64;
/// Domain separation: what a stormo manifest signature signs, before the ids.
pub const SIGNING_CONTEXT: &[u8] = b"stormo manifest signature v1\0";

/// A publisher's signature over a manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestSignature {
    /// Who signed.
    pub publisher: PublicKey,
    /// The model id signed.
    pub model_id: Hash,
    /// The identity digest signed.
    pub identity: Hash,
    signature: [u8; 64],
}

/// Why a signature file could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureDecodeError {
    /// Not [`SIG_LEN`] bytes.
    #[error("signature file is {0} bytes, expected {SIG_LEN}")]
    Length(usize),
    /// Bad magic.
    #[error("not a stormo signature file (bad magic)")]
    BadMagic,
    /// Unknown version.
    #[error("signature format version {0} is not supported (this build reads {SIG_VERSION})")]
    Version(u16),
    /// The publisher key is not a valid key.
    #[error("signature file holds an invalid publisher key: {0}")]
    Key(#[source] KeyError),
}

/// Why a signature does not vouch for a manifest. Each case has its own message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureError {
    /// The signature bytes are not a valid signature by the key they name (forged or damaged).
    #[error("the signature is invalid: it was not made by the key it names ({publisher})")]
    BadSignature {
        /// The key the file names.
        publisher: PublicKey,
    },
    /// Signed by a key that is not trusted. The message does not suggest trusting it: only a
    /// key the user names (as its publisher gave it) is trusted.
    #[error(
        "signed by {publisher}, which is not a trusted key (--trust names the publisher keys accepted)"
    )]
    UntrustedKey {
        /// The signer.
        publisher: PublicKey,
    },
    /// The manifest changed after it was signed (same model identity, other bytes).
    #[error(
        "the manifest was altered after signing: the signature is for model id {signed}, the manifest now hashes to {found}"
    )]
    ManifestAltered {
        /// The model id signed.
        signed: Hash,
        /// The model id of the manifest given.
        found: Hash,
    },
    /// The signature is over a different model's manifest.
    #[error(
        "the signature is over a different manifest (another model: its config/tokenizer differ); signed model id {signed}, this manifest {found}"
    )]
    OtherManifest {
        /// The model id signed.
        signed: Hash,
        /// The model id of the manifest given.
        found: Hash,
    },
}

fn message(model_id: &Hash, identity: &Hash) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGNING_CONTEXT.len() + 64);
    m.extend_from_slice(SIGNING_CONTEXT);
    m.extend_from_slice(model_id.as_bytes());
    m.extend_from_slice(identity.as_bytes());
    m
}

impl ManifestSignature {
    /// Signs a manifest.
    pub fn sign(key: &SecretKey, manifest: &Manifest) -> Self {
        let model_id = manifest.model_id();
        let identity = manifest.identity_digest();
        let signature = key.sign(&message(&model_id, &identity));
        Self {
            publisher: key.public(),
            model_id,
            identity,
            signature,
        }
    }

    /// The file bytes.
    pub fn to_bytes(&self) -> [u8; SIG_LEN] {
        let mut b = [0u8; SIG_LEN];
        b[..8].copy_from_slice(&SIG_MAGIC);
        b[8..10].copy_from_slice(&SIG_VERSION.to_le_bytes());
        b[10..42].copy_from_slice(self.publisher.as_bytes());
        b[42..74].copy_from_slice(self.model_id.as_bytes());
        b[74..106].copy_from_slice(self.identity.as_bytes());
        b[106..].copy_from_slice(&self.signature);
        b
    }

    /// Parses file bytes (the signature itself is checked by [`Self::check`]).
    pub fn from_bytes(b: &[u8]) -> Result<Self, SignatureDecodeError> {
        if b.len() != SIG_LEN {
            return Err(SignatureDecodeError::Length(b.len()));
        }
        if b[..8] != SIG_MAGIC {
            return Err(SignatureDecodeError::BadMagic);
        }
        let v = u16::from_le_bytes([b[8], b[9]]);
        if v != SIG_VERSION {
            return Err(SignatureDecodeError::Version(v));
        }
        let arr = |r: std::ops::Range<usize>| -> [u8; 32] {
            b[r].try_into()
                .expect("a 32-byte range of a checked-length buffer")
        };
        let publisher = PublicKey::from_bytes(&arr(10..42)).map_err(SignatureDecodeError::Key)?;
        Ok(Self {
            publisher,
            model_id: Hash(arr(42..74)),
            identity: Hash(arr(74..106)),
            signature: b[106..].try_into().expect("64 bytes"),
        })
    }

    /// Checks that the signature is valid and is over exactly `manifest_bytes`, without
    /// asking who signed it (see [`Self::verify`]).
    pub fn check(&self, manifest_bytes: &[u8]) -> Result<(), SignatureError> {
        if !self
            .publisher
            .verify(&message(&self.model_id, &self.identity), &self.signature)
        {
            return Err(SignatureError::BadSignature {
                publisher: self.publisher,
            });
        }
        let found = Hash::of(manifest_bytes);
        if found == self.model_id {
            return Ok(());
        }
        // Same model (identity) but other bytes: altered. Another identity: other manifest.
        // Bytes that do not decode at all were altered too.
        match Manifest::decode(manifest_bytes) {
            Ok(m) if m.identity_digest() != self.identity => Err(SignatureError::OtherManifest {
                signed: self.model_id,
                found,
            }),
            _ => Err(SignatureError::ManifestAltered {
                signed: self.model_id,
                found,
            }),
        }
    }

    /// Checks the signature (as [`Self::check`]) and that its publisher is among `trusted`.
    pub fn verify(
        &self,
        manifest_bytes: &[u8],
        trusted: &[PublicKey],
    ) -> Result<(), SignatureError> {
        if !self
            .publisher
            .verify(&message(&self.model_id, &self.identity), &self.signature)
        {
            return Err(SignatureError::BadSignature {
                publisher: self.publisher,
            });
        }
        if !trusted.contains(&self.publisher) {
            return Err(SignatureError::UntrustedKey {
                publisher: self.publisher,
            });
        }
        self.check(manifest_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::tests::small;

    #[test]
    fn the_three_failures_are_distinct_and_the_truth_passes() {
        let k = SecretKey::from_seed(&[9; 32]);
        let m = small();
        let bytes = m.encode();
        let sig = ManifestSignature::sign(&k, &m);
        let sig = ManifestSignature::from_bytes(&sig.to_bytes()).unwrap();
        sig.verify(&bytes, &[k.public()]).unwrap();

        let stranger = SecretKey::from_seed(&[8; 32]).public();
        let untrusted = sig.verify(&bytes, &[stranger]).unwrap_err();
        assert!(matches!(untrusted, SignatureError::UntrustedKey { .. }));
        // Regression (issue 40, item 5): the refusal suggested trusting the refused key.
        let text = untrusted.to_string();
        assert!(
            !text.contains(&format!("--trust {}", k.public())) && !text.contains("trust it"),
            "{text}"
        );

        let mut altered = m.clone();
        altered.tensors[0].hash = Hash([0xaa; 32]);
        let e_alt = sig.verify(&altered.encode(), &[k.public()]).unwrap_err();
        assert!(matches!(e_alt, SignatureError::ManifestAltered { .. }));
        // Raw bytes flipped so the manifest no longer decodes: altered too.
        let mut raw = bytes.clone();
        raw[20] ^= 0xff;
        assert!(matches!(
            sig.verify(&raw, &[k.public()]),
            Err(SignatureError::ManifestAltered { .. })
        ));

        let mut other = m.clone();
        other.identity.family = "qwen3_moe".into();
        let e_other = sig.verify(&other.encode(), &[k.public()]).unwrap_err();
        assert!(matches!(e_other, SignatureError::OtherManifest { .. }));

        let msgs = [
            untrusted.to_string(),
            e_alt.to_string(),
            e_other.to_string(),
        ];
        assert_ne!(msgs[0], msgs[1]);
        assert_ne!(msgs[1], msgs[2]);
        assert_ne!(msgs[0], msgs[2]);

        // A tampered signature file (model id swapped for the altered one) is forged.
        let mut b = sig.to_bytes();
        b[42..74].copy_from_slice(altered.model_id().as_bytes());
        let forged = ManifestSignature::from_bytes(&b).unwrap();
        assert!(matches!(
            forged.verify(&altered.encode(), &[k.public()]),
            Err(SignatureError::BadSignature { .. })
        ));
    }

    #[test]
    fn signature_file_layout_is_pinned() {
        let k = SecretKey::from_seed(&[9; 32]);
        let m = small();
        let b = ManifestSignature::sign(&k, &m).to_bytes();
        assert_eq!(&b[..10], b"STORMOSG\x01\x00");
        assert_eq!(&b[10..42], k.public().as_bytes());
        assert_eq!(&b[42..74], m.model_id().as_bytes());
        assert_eq!(&b[74..106], m.identity_digest().as_bytes());
        assert!(ManifestSignature::from_bytes(&b[..169]).is_err());
        let mut bad = b;
        bad[8] = 2;
        assert!(matches!(
            ManifestSignature::from_bytes(&bad),
            Err(SignatureDecodeError::Version(2))
        ));
    }
}
