//! One module per subcommand.

pub mod bench;
pub mod chat;
pub mod completions;
pub mod convert;
pub mod demo;
pub mod key;
pub mod man;
pub mod manifest;
pub mod pull;
pub mod run;
pub mod serve;
pub mod sim;
pub mod swarm;
pub mod synth;
pub mod tokenize;
