//! The engine's one error type, grouped by where an error comes from.

use std::path::PathBuf;

/// Everything that can go wrong while loading a checkpoint or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- files ----
    /// An I/O error on a named file.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file is malformed: bad header, offsets out of range, truncated.
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// `config.json` (or the shard index) is not usable.
    #[error("{}: {reason}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The folder given as a model is not one: missing, or without `config.json`.
    #[error("no model at {}: {reason}", dir.display())]
    NoModel {
        /// The folder.
        dir: PathBuf,
        /// What is missing, and what to do.
        reason: String,
    },
    /// The config names a model family the engine does not implement.
    #[error("unsupported model_type {found:?}; supported: {}", SUPPORTED_MODEL_TYPES.join(", "))]
    UnsupportedModel {
        /// The `model_type` found.
        found: String,
    },

    // ---- tensors ----
    /// A tensor the model needs is absent from the checkpoint.
    #[error("missing tensor {name:?} (required by {family})")]
    MissingTensor {
        /// The tensor's name.
        name: String,
        /// The model family that needs it.
        family: &'static str,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor's name.
        name: String,
        /// What the config implies.
        expected: Vec<usize>,
        /// What the file holds.
        found: Vec<usize>,
    },
    /// A tensor has a dtype the engine cannot use there.
    #[error("tensor {name:?} has dtype {found}, expected {expected}")]
    Dtype {
        /// The tensor's name.
        name: String,
        /// The dtypes accepted.
        expected: String,
        /// The dtype found.
        found: String,
    },

    // ---- running ----
    /// An input the caller gave is out of range (token id, prompt length, ...).
    #[error("{0}")]
    Input(String),
    /// Memory for a copy the engine keeps (of weights it streams every token) could not be
    /// had.
    #[error("memory for {what}")]
    Memory {
        /// What the memory was for.
        what: String,
        /// The cause (how much was asked for, and why it was refused).
        #[source]
        source: std::io::Error,
    },
    /// A forward stopped because the session's stop flag was raised
    /// ([`crate::Session::set_stop`]).
    #[error("stopped (the session's stop flag was raised)")]
    Stopped,
    /// A saved session ([`crate::Session::load_from`]) cannot be used: not a session file,
    /// another version, truncated, corrupt, or made with another model or other settings.
    #[error("{reason}")]
    SessionFile {
        /// What is wrong, in words.
        reason: String,
    },
    /// An expert could not be obtained from any tier.
    #[error("expert {expert} of layer {layer}: {reason}")]
    Expert {
        /// The layer.
        layer: usize,
        /// The expert.
        expert: usize,
        /// What went wrong.
        reason: String,
    },
}

/// The `model_type` values the engine implements.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["gpt_oss", "qwen3_moe"];

/// Result with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The message with every cause appended (`a: b: c`), for places that keep only a string.
    pub fn chain(&self) -> String {
        let mut s = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(e) = src {
            s.push_str(": ");
            s.push_str(&e.to_string());
            src = e.source();
        }
        s
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn config(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Config {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
