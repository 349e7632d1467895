//! stormo's node library: one [`node::Node`] that owns a running node (its runtime, QUIC
//! endpoint, tier stack, peers and services), its typed configuration ([`config`]), the
//! local expert tiers ([`experts`]), the machine's memory plan ([`memory`]), the manifest it
//! runs under ([`manifest`]), a model loaded for text ([`text_model`]) and the
//! OpenAI-compatible HTTP service ([`http`]).
//!
//! Crate map (arrows point to what a crate may import; nothing points back up):
//! `stormo` (the binary: clap, commands, printing) → `stormo-node` (this) → `stormo-net`
//! (QUIC, peers, discovery, identity; no CLI, no HTTP) and `stormo-text` (tokenizers, chat
//! formats; no async runtime) → `stormo-engine`, `stormo-wire`, `stormo-manifests`.
//! Library callers and tests build a [`config::NodeConfig`], never the CLI's structs.

#![forbid(unsafe_code)]

pub mod config;
pub mod coverage;
pub mod experts;
pub mod http;
pub mod manifest;
pub mod memory;
pub mod node;
pub mod placement;
pub mod text_model;
