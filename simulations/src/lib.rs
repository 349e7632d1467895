#![forbid(unsafe_code)]
//! stormo's proving ground.
//!
//! No real GPT-OSS or Qwen3 weights can be downloaded where stormo is developed, yet speed and
//! memory only mean something at the real geometry. This crate makes stand-ins:
//!
//! - [`synth`]: random-weight checkpoints in the exact published layout of GPT-OSS 20B/120B
//!   (MXFP4 experts, BF16 elsewhere, sharded safetensors with the hub's index and config) and
//!   Qwen3-30B-A3B (BF16, one tensor per expert), deterministic from a seed and written at disk
//!   speed without holding the model in memory.
//! - [`swarm`]: swarms of real `stormo` processes on 127.0.0.1 over real QUIC, with links
//!   shaped by relays (latency, bandwidth, loss), nodes killed and restarted mid-run, and a
//!   token-exactness verdict against a local run.
//!
//! Non-goals: realistic *outputs*. The weights are random; what is real is the geometry, the
//! byte layout and the numeric ranges, so that loading, streaming, hashing and the forward pass
//! cost what they would cost on the published models.

pub mod swarm;
pub mod synth;
