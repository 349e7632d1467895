//! stormo's root of trust: hashes, the L0 manifest of a checkpoint, per-expert hashes, keys
//! and signatures.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod hash;

pub use hash::{ExpertId, Hash};
