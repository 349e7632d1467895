//! `stormo demo`: the whole idea on one machine in about a minute.
//!
//! A small GPT-OSS-shaped model with the real 201,088-token vocabulary is synthesized, a few
//! nodes on 127.0.0.1 each serve part of its experts, and one more node with no experts (the
//! dense weights pulled from a holder) fetches from them and re-serves what it verified. A
//! node holding none that knows only that relay generates from a Harmony prompt, every
//! expert fetched over QUIC and checked against the signed manifest; then the holders stop
//! and it generates again, served by the relay from what it kept. Both outputs are compared
//! with a local run of the same prompt.
//!
//! The o200k_harmony tokenizer ships inside the binary: `build.rs` compresses the repository's
//! `fixtures/o200k-harmony/tokenizer.json` (28 MB) with zlib to about 4.5 MB and this module
//! includes it. Deriving the vocabulary at build time instead would have meant a second
//! tokenizer format to maintain; 4.5 MB in a binary that already carries the engine and QUIC
//! is the simpler price. A build without the fixture embeds nothing and the demo then uses a
//! fixed list of prompt ids.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use stormo_simulations::swarm::{self, Cluster, LinkSpec, NodeSpec, Reaper, RunOutcome};

use crate::cmd::sim::Scratch;
use stormo_text::{ChatFormat, PromptOptions, Tokenizer, Turn, TurnRole};

/// The o200k_harmony tokenizer.json, zlib-compressed by build.rs (empty when the build had
/// no fixture).
static TOKENIZER_ZLIB: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/o200k-harmony.json.zlib"));

/// GPT-OSS's vocabulary size.
const GPT_OSS_VOCAB: usize = 201_088;

/// Arguments of `stormo demo`.
///
/// Makes a small GPT-OSS-shaped model (random weights, the real 201,088-token o200k_harmony
/// vocabulary), starts --nodes serving nodes on 127.0.0.1 that each hold part of its experts
/// and one relay node that holds none (it fetches from them, keeps what it verified and
/// serves it on), and generates on a node that holds none and knows only the relay: every
/// expert comes over QUIC and is checked against the publisher-signed manifest before use.
/// Then the holders stop and it generates again, served by the relay alone. Shows where each
/// expert came from, the verification, the speed, and whether the ids equal a local run's.
/// Removes everything it made, also on Ctrl-C.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Serving nodes (each holds every n-th expert).
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub nodes: usize,
    /// The user's message, rendered as a Harmony prompt.
    #[arg(
        short,
        long,
        default_value = "What is a mixture of experts?",
        value_name = "TEXT"
    )]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 24, value_name = "N")]
    pub max_new_tokens: usize,
    /// Scratch folder: new or empty, kept at the end (default: a new temp folder, removed at
    /// the end).
    #[arg(long, value_name = "DIR")]
    pub work: Option<PathBuf>,
    /// Print one JSON object on stdout instead of the report.
    #[arg(long)]
    pub json: bool,
}

/// On SIGINT: kill every process of `reapers`, remove `dir`, exit 130. Runs on a thread of
/// its own.
pub fn on_interrupt(dir: Option<PathBuf>, reapers: Arc<Mutex<Vec<Reaper>>>) {
    let spawned = std::thread::Builder::new()
        .name("stormo-ctrl-c".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            if rt.block_on(tokio::signal::ctrl_c()).is_err() {
                return;
            }
            eprintln!("interrupted: stopping the nodes and cleaning up");
            for r in reapers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                r.kill_all();
            }
            if let Some(d) = dir {
                let _ = std::fs::remove_dir_all(d);
            }
            std::process::exit(130);
        });
    if let Err(e) = spawned {
        tracing::warn!("no Ctrl-C handler ({e}): an interrupt may leave files behind");
    }
}

/// The embedded tokenizer, if this build has one.
fn embedded_tokenizer() -> anyhow::Result<Option<Vec<u8>>> {
    if TOKENIZER_ZLIB.is_empty() {
        return Ok(None);
    }
    let json = miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(TOKENIZER_ZLIB, 64 << 20)
        .map_err(|e| anyhow::anyhow!("the embedded tokenizer does not decompress: {e:?}"))?;
    Ok(Some(json))
}

/// How many expert records a node has kept in `dir`, once the count has stopped growing
/// (a serving node keeps what it fetched in the background; at most 30 s).
fn wait_until_kept(dir: &std::path::Path) -> usize {
    let count = || std::fs::read_dir(dir).map_or(0, |d| d.count());
    let until = Instant::now() + Duration::from_secs(30);
    let (mut last, mut since) = (count(), Instant::now());
    while Instant::now() < until && (last == 0 || since.elapsed() < Duration::from_millis(1500)) {
        std::thread::sleep(Duration::from_millis(100));
        let now = count();
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    last
}

/// The experts of node `i` of `n` among `experts`: every n-th, from `i`.
fn share(i: usize, n: usize, experts: usize) -> String {
    let v: Vec<String> = (i..experts).step_by(n).map(|e| e.to_string()).collect();
    v.join(",")
}

/// Runs `stormo demo`.
pub fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=16).contains(&a.nodes),
        "--nodes must be between 1 and 16"
    );
    anyhow::ensure!(
        (1..=4096).contains(&a.max_new_tokens),
        "--max-new-tokens must be between 1 and 4096"
    );
    let start = Instant::now();
    let exe = std::env::current_exe().context("finding the stormo binary")?;
    let scratch = Scratch::new(a.work.clone(), "demo", false)?;
    let reapers = Arc::new(Mutex::new(Vec::new()));
    on_interrupt(
        a.work.is_none().then(|| scratch.path.clone()),
        reapers.clone(),
    );
    let say = |m: &str| {
        if !a.json {
            eprintln!("demo: {m}");
        }
    };

    // The model, with the real vocabulary and (when embedded) its tokenizer.
    let model = scratch.path.join("model");
    say(&format!(
        "synthesizing a 4-layer GPT-OSS-shaped model with the {GPT_OSS_VOCAB}-token vocabulary"
    ));
    crate::cmd::sim::small_model(&model, GPT_OSS_VOCAB)?;
    let tokenizer = match embedded_tokenizer()? {
        Some(json) => {
            std::fs::write(model.join("tokenizer.json"), &json)
                .with_context(|| format!("writing {}", model.join("tokenizer.json").display()))?;
            Some(Arc::new(
                Tokenizer::from_json(&json).context("the embedded tokenizer")?,
            ))
        }
        None => None,
    };
    let prompt: Vec<u32> = match &tokenizer {
        Some(t) => {
            let fmt = ChatFormat::for_family(stormo_engine::Family::GptOss, t.clone())?;
            fmt.render_prompt(
                &[Turn::new(TurnRole::User, a.prompt.clone())],
                &PromptOptions::default(),
            )?
        }
        None => vec![200_006, 17_360, 200_008, 3, 1_000, 50_000, 200_007],
    };
    let experts = {
        let files = stormo_engine::ModelFiles::open(&model)?;
        files.layout.parts.iter().map(Vec::len).max().unwrap_or(0)
    };

    // The swarm: keys, a signed manifest, nodes each holding part of the experts.
    say("making keys and a signed manifest");
    let mut c = Cluster::prepare(&exe, &model, &scratch.path.join("swarm"))?;
    reapers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(c.reaper());
    // The relay node's key is made first: the holders admit it beside the client.
    let relay_key = c.make_key("relay")?;
    c.serve_args = vec!["--allow".into(), relay_key.1.clone()];
    for i in 0..a.nodes {
        c.add_node(Some(share(i, a.nodes, experts)), LinkSpec::ideal())?;
    }
    say(&format!("{} nodes serving on 127.0.0.1", a.nodes));
    let holders = 0..a.nodes;

    // A node with no experts of its own: the dense weights pulled from a holder, then a
    // `serve` that fetches from the holders, keeps what it verified and serves it on.
    let dense = scratch.path.join("relay-model");
    say("pulling the dense weights for a node with no experts");
    swarm::cluster::run_capture(
        &exe,
        &[
            "pull".into(),
            "--peer".into(),
            c.nodes[0].peer(),
            "--trust".into(),
            c.publisher.clone(),
            "--key".into(),
            c.client_key.to_string_lossy().into_owned(),
            "--state-dir".into(),
            scratch
                .path
                .join("pull.state")
                .to_string_lossy()
                .into_owned(),
            "--out".into(),
            dense.to_string_lossy().into_owned(),
        ],
        "pulling the dense weights",
    )?;
    let mut relay_args = vec!["--trust".to_string(), c.publisher.clone()];
    relay_args.extend(c.peer_args(holders.clone()));
    let relay = c.add_node_with(
        NodeSpec {
            model: Some(dense),
            args: relay_args,
            key: Some(relay_key),
            ..NodeSpec::default()
        },
        LinkSpec::ideal(),
    )?;
    say(&format!(
        "{} serving on 127.0.0.1 with no experts, fetching from the others",
        c.nodes[relay].name
    ));

    let base = swarm::run_args(&model, &prompt, a.max_new_tokens);
    let mut args = base.clone();
    args.extend([
        "--no-local-experts".into(),
        "--manifest".into(),
        c.manifest.to_string_lossy().into_owned(),
        "--trust".into(),
        c.publisher.clone(),
        "--key".into(),
        c.client_key.to_string_lossy().into_owned(),
    ]);
    args.extend(c.peer_args([relay]));
    let timeout = Duration::from_secs(300);
    say(&format!(
        "generating on a node with no experts that knows only {}",
        c.nodes[relay].name
    ));
    let (v, wall) = c.spawn_run("swarm", &args)?.wait(timeout)?;
    let remote = RunOutcome::from_json(&v, wall)?;
    let kept = wait_until_kept(&c.nodes[relay].state_dir.join("experts").join(&c.model_id));
    say(&format!(
        "{} kept {kept} verified expert records; stopping every holder",
        c.nodes[relay].name
    ));
    for i in holders.clone() {
        c.stop(i);
    }
    say("generating again, with the holders gone");
    let (v, wall) = c.spawn_run("reserved", &args)?.wait(timeout)?;
    let reserved = RunOutcome::from_json(&v, wall)?;
    say("the same prompt with every expert local");
    let (v, wall) = c.spawn_run("local", &base)?.wait(timeout)?;
    let local = RunOutcome::from_json(&v, wall)?;
    c.stop_all();
    let exact = remote.ids == local.ids;
    let exact_after = reserved.ids == local.ids;
    let text = tokenizer
        .as_ref()
        .and_then(|t| t.decode(&remote.ids, false).ok());
    let held = |n: &swarm::cluster::Node| -> usize {
        if n.name == c.nodes[relay].name {
            0
        } else {
            n.only.as_deref().map_or(experts, |s| s.split(',').count())
        }
    };
    let nodes: Vec<serde_json::Value> = c
        .nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "name": n.name,
                "holds": n.only,
                "experts_held": held(n),
                "relay": n.name == c.nodes[relay].name,
                "served": n.served,
                "bytes_sent": n.link().down_bytes,
            })
        })
        .collect();
    let elapsed = start.elapsed().as_secs_f64();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model_id": c.model_id,
                "publisher": c.publisher,
                "prompt_ids": prompt,
                "swarm": remote,
                "after_holders_left": reserved,
                "relay_kept": kept,
                "local": local,
                "token_exact": exact && exact_after,
                "nodes": nodes,
                "text": text,
                "elapsed_s": elapsed,
            })
        );
    } else {
        let r = &c.nodes[relay].name;
        println!("stormo demo: a 4-layer GPT-OSS-shaped model with random weights and the real");
        println!(
            "{GPT_OSS_VOCAB}-token vocabulary; {experts} experts per layer spread over {} nodes;",
            a.nodes
        );
        println!("{r} holds no experts and fetches from them; the generating node knows only {r}.");
        println!();
        println!("verification");
        println!("  model id   {}", c.model_id);
        println!(
            "  publisher  {} (the manifest is accepted only because this key signed it)",
            c.publisher
        );
        println!(
            "  experts    {} loaded from {r}, each checked chunk by chunk against the manifest; {} failures",
            remote.peer_loads, remote.peer_failures
        );
        println!();
        println!("where the experts came from");
        for n in &c.nodes {
            let role = if n.name == *r {
                format!("holds none, kept the {kept} it fetched")
            } else {
                format!("holds {} experts per layer", held(n))
            };
            println!(
                "  {}  {role:<36} served {:>4} requests, sent {:>10}",
                n.name,
                n.served.map_or_else(|| "?".into(), |v| v.to_string()),
                stormo_net::progress::human_bytes(n.link().down_bytes)
            );
        }
        println!(
            "  ({}'s bytes include the dense weights it sent for {r}'s folder)",
            c.nodes[0].name
        );
        println!();
        println!("speed");
        println!(
            "  through {r}                 prefill {:>7.1} tok/s ({} prompt tokens), decode {:>7.1} tok/s",
            remote.prefill_tok_s,
            prompt.len(),
            remote.decode_tok_s
        );
        println!(
            "  holders gone, {r} re-serves prefill {:>7.1} tok/s, decode {:>7.1} tok/s",
            reserved.prefill_tok_s, reserved.decode_tok_s
        );
        println!(
            "  all local                  prefill {:>7.1} tok/s, decode {:>7.1} tok/s",
            local.prefill_tok_s, local.decode_tok_s
        );
        println!();
        let yes = |b: bool| if b { "yes" } else { "NO" };
        println!(
            "token-exact against the local run: {} ({} tokens); after the holders left: {}",
            yes(exact),
            remote.ids.len(),
            yes(exact_after)
        );
        let ids: Vec<String> = remote.ids.iter().map(u32::to_string).collect();
        println!("generated ids: {}", ids.join(" "));
        if let Some(t) = &text {
            println!("as text (random weights, so it means nothing): {t:?}");
        }
        println!("done in {elapsed:.1}s");
    }
    anyhow::ensure!(exact, "the swarm's output differs from the local run's");
    anyhow::ensure!(
        exact_after,
        "the output after the holders left differs from the local run's"
    );
    anyhow::ensure!(exact, "the swarm's output differs from the local run's");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_partition_the_experts() {
        assert_eq!(share(0, 3, 7), "0,3,6");
        assert_eq!(share(2, 3, 7), "2,5");
        let n: usize = (0..3).map(|i| share(i, 3, 16).split(',').count()).sum();
        assert_eq!(n, 16);
    }

    #[test]
    fn the_embedded_tokenizer_is_o200k_harmony_when_present() {
        if let Some(json) = embedded_tokenizer().unwrap() {
            let t = Tokenizer::from_json(&json).unwrap();
            assert!(t.vocab_size() <= GPT_OSS_VOCAB);
            assert_eq!(t.token_to_id("<|start|>"), Some(200_006));
        }
    }
}
