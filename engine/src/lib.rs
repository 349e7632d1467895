//! stormo's engine: the numbers.
//!
//! Loads GPT-OSS and Qwen3-MoE checkpoints as published (safetensors, MXFP4 experts),
//! computes their forward pass in f32 exactly as Transformers does, and takes experts from a
//! provider (the [`moe::ExpertProvider`] seam) so that RAM, disk and network tiers can serve
//! them without the model knowing which. It knows nothing of networks or async runtimes.

mod attention;
pub mod config;
pub mod error;
pub mod generate;
pub mod gpt_oss;
pub mod huge;
pub mod kernels;
#[doc(hidden)]
pub mod late_liar;
pub mod layout;
pub mod model;
pub mod moe;
pub mod ops;
pub mod profile;
pub mod qwen3_moe;
pub mod rope;
pub mod safetensors;
pub mod sampling;
pub mod tiers;

pub use config::{Family, ModelConfig};
pub use error::{Error, Result};
pub use model::{
    Batch, Choice, LoadOptions, Logits, Model, ModelFiles, Observer, ScreenStats, Session,
};
