//! stormo's root of trust: hashes, the L0 manifest of a checkpoint, per-expert hashes, keys
//! and signatures.
//!
//! A node runs code on bytes that strangers sent it, so before it uses a byte it must know
//! that it is exactly the byte the model's publisher released. This crate owns that chain:
//!
//! - [`manifest`]: the L0 manifest ([`Manifest`]): the model's identity (BLAKE3 of
//!   `config.json` and, when present, the tokenizer, generation and index files), every
//!   tensor (name, dtype, shape, byte length, quantization scheme and block size, file,
//!   offset, BLAKE3), every weight file's SHA-256 (as the Hugging Face Hub lists for LFS
//!   files), and per expert the byte ranges of its record, its length, its BLAKE3 and its
//!   chunk hashes (256 KiB chunks by default). Canonical postcard encoding behind a magic
//!   and a version; the **model id** is the BLAKE3 of those bytes.
//! - [`build()`]: builds a manifest from a checkpoint folder, reading every byte once
//!   (optionally `O_DIRECT`, [`IoMode`]) and computing every hash from the same buffers in a
//!   pipeline on all cores, with [`Progress`]; [`read_files`] reads the same files the same
//!   way without hashing, the bound a build is measured against.
//! - [`verify()`]: checks a local checkpoint against a manifest and names every difference.
//! - [`record`]: [`Manifest::verify_record`] and [`Manifest::verify_chunk`], what the node
//!   runs on every expert (or chunk) from a peer or disk before using it.
//! - [`keys`]: Ed25519 [`SecretKey`] files (mode 0600) and [`PublicKey`] text (64 hex).
//! - [`signature`]: a publisher's [`ManifestSignature`] binding a model id to a key.
//! - [`membership`]: a swarm owner's [`Membership`] certificate admitting one node key into
//!   the swarm until an expiry.
//!
//! # Where the files live
//! By default beside the model: `DIR/stormo-manifest.bin` (canonical bytes),
//! `DIR/stormo-manifest.json` (readable view, not used for checks) and
//! `DIR/stormo-manifest.sig` (signature). For a read-only model folder, put the `.bin`
//! anywhere; the `.json` and `.sig` go beside it with those extensions ([`ManifestPaths`]).
//!
//! Non-goals: fetching experts or talking to peers (the node and `wire` do that), and
//! deciding whom to trust (the user passes keys).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod build;
pub mod hash;
mod hashing;
pub mod keys;
pub mod manifest;
pub mod membership;
pub mod record;
pub mod signature;
pub mod verify;

use std::path::{Path, PathBuf};

pub use build::{build, build_reference, BuildError, BuildOptions};
pub use hash::{ExpertId, Hash};
pub use hashing::{read_files, IoMode, Progress};
pub use keys::{KeyError, PublicKey, SecretKey};
pub use manifest::{DecodeError, Manifest};
pub use membership::{
    IssueError, Membership, MembershipDecodeError, MembershipError, MEMBERSHIP_LEN,
};
pub use record::RecordError;
pub use signature::{ManifestSignature, SignatureDecodeError, SignatureError};
pub use verify::{verify, Problem, VerifyError, VerifyOptions, VerifyReport};

/// The default manifest file name in a model folder.
pub const MANIFEST_FILE: &str = "stormo-manifest.bin";

/// Where a manifest and its companions are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestPaths {
    /// The canonical manifest.
    pub bin: PathBuf,
    /// Its JSON view.
    pub json: PathBuf,
    /// Its signature.
    pub sig: PathBuf,
}

impl ManifestPaths {
    /// The defaults beside a model: `DIR/stormo-manifest.{bin,json,sig}`.
    pub fn beside_model(dir: &Path) -> Self {
        Self::at(&dir.join(MANIFEST_FILE))
    }

    /// A manifest at `bin`, with `.json` and `.sig` beside it.
    pub fn at(bin: &Path) -> Self {
        Self {
            bin: bin.to_path_buf(),
            json: bin.with_extension("json"),
            sig: bin.with_extension("sig"),
        }
    }

    /// `manifest` if given, else the defaults beside the model.
    pub fn resolve(model: &Path, manifest: Option<&Path>) -> Self {
        manifest.map_or_else(|| Self::beside_model(model), Self::at)
    }
}

/// Why a manifest file could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a valid manifest.
    #[error("{}: {source}", path.display())]
    Decode {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: DecodeError,
    },
}

/// Bounded reads of small files (refusing devices, pipes and directories), shared with the
/// engine's loading of configurations.
pub use stormo_engine::safetensors::read_small_file;

/// Reads a manifest file: its length is checked before it is read, then it is decoded and
/// validated. Returns the manifest and its canonical bytes.
pub fn read_manifest(path: &Path) -> Result<(Manifest, Vec<u8>), ReadError> {
    let io = |source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > manifest::MAX_MANIFEST_LEN {
        return Err(ReadError::Decode {
            path: path.to_path_buf(),
            source: DecodeError::TooLarge { len },
        });
    }
    let bytes = read_small_file(path, manifest::MAX_MANIFEST_LEN).map_err(io)?;
    let m = Manifest::decode(&bytes).map_err(|source| ReadError::Decode {
        path: path.to_path_buf(),
        source,
    })?;
    Ok((m, bytes))
}
