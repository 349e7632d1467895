//! The names every stormo crate shares: [`Hash`](struct@Hash) (a BLAKE3 digest, also the model id) and
//! [`ExpertId`] (a layer and an expert index).
//!
//! # Why a crate of its own
//! The protocol (`stormo-wire`) needs these two types and nothing else of the manifests: its
//! messages carry model ids, expert ids and chunk hashes. `stormo-manifests` builds and
//! verifies manifests of checkpoints, for which it asks `stormo-engine` how a checkpoint is
//! laid out; had wire taken the types from there, it would compile the whole engine. So they
//! live here, in a leaf with no stormo dependency, and `stormo-manifests` re-exports them (as
//! `stormo_manifests::{Hash, ExpertId}` and `stormo_manifests::hash`), so its users see one
//! type either way.
//!
//! A [`Hash`](struct@Hash) prints as lowercase hex (also in JSON) and is encoded as raw bytes in postcard.
//!
//! Non-goals: hashing files or building manifests (`stormo-manifests`), any I/O.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::fmt;
use std::str::FromStr;

/// A 32-byte BLAKE3 digest. Model ids are hashes too (of the canonical manifest bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// BLAKE3 of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 5 bytes in hex, for logs.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..5])
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({})", self.short())
    }
}

/// Why a string is not a hash.
#[derive(Debug, thiserror::Error)]
#[error("not a 64-character hex hash: {0:?}")]
pub struct ParseHashError(String);

impl FromStr for Hash {
    type Err = ParseHashError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s.trim(), &mut out).map_err(|_| ParseHashError(s.to_string()))?;
        Ok(Self(out))
    }
}

impl serde::Serialize for Hash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.to_hex())
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> serde::Deserialize<'de> for Hash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(serde::de::Error::custom)
        } else {
            <[u8; 32]>::deserialize(d).map(Self)
        }
    }
}

/// One expert of a model: its layer and its index in that layer.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ExpertId {
    /// Decoder layer.
    pub layer: u16,
    /// Expert index within the layer.
    pub expert: u16,
}

impl ExpertId {
    /// The id of `expert` in `layer`.
    pub const fn new(layer: u16, expert: u16) -> Self {
        Self { layer, expert }
    }

    /// The id of the expert at these indices, if both fit in 16 bits.
    pub fn try_from_indices(layer: usize, expert: usize) -> Option<Self> {
        Some(Self {
            layer: u16::try_from(layer).ok()?,
            expert: u16::try_from(expert).ok()?,
        })
    }

    /// The id of the expert at these indices of a loaded model.
    ///
    /// # Panics
    ///
    /// If either index exceeds `u16::MAX`. The engine refuses a configuration with more than
    /// 65,536 layers or experts per layer, so every index of a loaded model fits; indices
    /// from outside (a peer, a file) go through [`ExpertId::try_from_indices`].
    pub fn from_indices(layer: usize, expert: usize) -> Self {
        Self::try_from_indices(layer, expert)
            .unwrap_or_else(|| panic!("expert {layer}:{expert} is beyond 16-bit indices"))
    }
}

impl fmt::Display for ExpertId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.layer, self.expert)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_json_form() {
        let h = Hash::of(b"stormo");
        assert_eq!(h.to_hex().parse::<Hash>().unwrap(), h);
        let j = serde_json::to_string(&h).unwrap();
        assert_eq!(j, format!("\"{}\"", h.to_hex()));
        assert!("zz".parse::<Hash>().is_err());
    }
}
