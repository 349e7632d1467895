//! The command line: one subcommand per file in `cmd/`.

use clap::{Parser, Subcommand};

use crate::cmd;

/// stormo: run Mixture-of-Experts models (GPT-OSS, Qwen3-MoE) on CPUs, with experts streamed
/// from RAM, the local disk, or verified peers over QUIC.
#[derive(Debug, Parser)]
#[command(name = "stormo", version, propagate_version = true)]
pub struct Cli {
    /// More logging on stderr (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate from a text prompt (through the model's chat format) or from token ids.
    Run(cmd::run::Args),
    /// Build, sign and verify a checkpoint's manifest (tensor and per-expert hashes).
    #[command(subcommand)]
    Manifest(cmd::manifest::Command),
    /// Serve experts to peers over QUIC (--listen) and/or an OpenAI-compatible HTTP API (--http).
    Serve(cmd::serve::Args),
    /// Fetch a model folder (manifest, config, tokenizer, dense weights; --with-experts: all)
    /// from peers, every byte verified against the manifest.
    Pull(cmd::pull::Args),
    /// Create and show Ed25519 node and publisher keys.
    #[command(subcommand)]
    Key(cmd::key::Command),
    /// Measure prefill and decode speed beside the machine's memory and disk bandwidth.
    Bench(cmd::bench::Args),
    /// Write a checkpoint's experts as a flat store of 4 KiB-aligned records (one read each).
    Convert(cmd::convert::Args),
    /// Turn text into token ids with the model's tokenizer, or ids back into text.
    Tokenize(cmd::tokenize::Args),
    /// Write a random-weight checkpoint with a real model's geometry and layout.
    Synth(cmd::synth::Args),
    /// Talk with a model in the terminal (streams tokens, keeps the session between turns).
    Chat(cmd::chat::Args),
    /// Run a swarm scenario of real nodes on this machine (latency, loss, churn) and report it.
    Swarm(cmd::swarm::Args),
    /// Show the whole idea in about a minute: a small model, nodes on 127.0.0.1, a
    /// generation on a node with no experts, every expert verified.
    Demo(cmd::demo::Args),
}

/// `e` as one line for the user: each cause after its context, except a cause the text
/// already ends with (an error whose message includes its source, as many I/O errors with a
/// path do, would otherwise repeat it).
pub fn error_message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.ends_with(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}

/// Runs the chosen subcommand.
pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Manifest(c) => cmd::manifest::run(c),
        Command::Key(c) => cmd::key::run(c),
        Command::Pull(a) => cmd::pull::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Swarm(a) => cmd::swarm::run(a),
        Command::Demo(a) => cmd::demo::run(a),
    }
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks over every subcommand (conflicting names, groups that
    /// name missing arguments, ...), which otherwise fire only when that command runs.
    #[test]
    fn command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    /// A cause already at the end of the message is not repeated; others follow their context.
    #[test]
    fn error_message_names_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("/k: {source}")]
        struct WithPath {
            source: std::io::Error,
        }
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "not found");
        let e = anyhow::Error::new(WithPath { source: io }).context("reading the key");
        assert_eq!(super::error_message(&e), "reading the key: /k: not found");
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(super::error_message(&e), "outer: middle: inner");
    }
}
