//! One module per subcommand (`synth`, `sim` and `demo`, the lab, with the `lab` feature).

pub mod bench;
pub mod chat;
pub mod completions;
pub mod convert;
#[cfg(feature = "lab")]
pub mod demo;
pub mod key;
pub mod man;
pub mod manifest;
pub mod pull;
pub mod run;
pub mod serve;
#[cfg(feature = "lab")]
pub mod sim;
pub mod swarm;
#[cfg(feature = "lab")]
pub mod synth;
pub mod tokenize;
