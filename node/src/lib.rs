//! The `stormo` binary's library: arguments ([`args`], [`swarm_args`], [`config_file`]),
//! their resolution into the node library's typed configuration, one module per subcommand
//! ([`cmd`]), printing and logging. The lab (`synth`, `sim`, `demo`, charts) comes with the
//! `lab` feature.
//!
//! Everything that runs a node lives below this crate: `stormo_node` (the Node and its
//! services), `stormo_net` (peers) and `stormo_text` (tokenizers, chat formats).

#![forbid(unsafe_code)]

pub mod args;
pub mod cli;
pub mod cmd;
pub mod config_file;
pub mod logging;
pub mod plot;
pub mod swarm_args;
