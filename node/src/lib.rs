//! stormo's node: composes the engine, manifests and wire protocol into the `stormo` binary.

#![forbid(unsafe_code)]

pub mod args;
pub mod chat;
pub mod cli;
pub mod cmd;
pub mod config;
pub mod config_file;
pub mod discover;
pub mod experts;
pub mod http;
pub mod logging;
pub mod net;
pub mod node;
pub mod plot;
pub mod progress;
pub mod swarm_args;
