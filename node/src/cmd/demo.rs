//! `stormo demo`: the whole idea on one machine in about a minute.
//!
//! A small GPT-OSS-shaped model with the real 201,088-token vocabulary is synthesized, a few
//! nodes on 127.0.0.1 each serve part of its experts, and one more node with no experts (the
//! dense weights pulled from a holder) fetches from them and re-serves what it verified. A
//! node holding none that knows only that relay (the holders admit the relay alone)
//! generates from a Harmony prompt, every
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

use std::ops::Range;
use std::path::{Path, PathBuf};
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
    #[arg(short = 'n', long, default_value_t = 24, value_name = "N",
          allow_negative_numbers = true, value_parser = crate::args::count_arg)]
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
fn wait_until_kept(dir: &Path) -> usize {
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
    let model = DemoModel::synthesize(scratch.path.join("model"), &a.prompt, &say)?;
    let (mut c, relay_key) = start_holders(&exe, &model, &scratch.path, &reapers, a.nodes, &say)?;
    let relay = start_relay(&exe, &mut c, &scratch.path, 0..a.nodes, relay_key, &say)?;
    let runs = generate(&mut c, &model, 0..a.nodes, relay, a.max_new_tokens, &say)?;
    let report = Report {
        c: &c,
        model: &model,
        relay,
        holders: a.nodes,
        runs,
    };
    report.print(a.json, start);
    anyhow::ensure!(
        report.exact(),
        "the swarm's output differs from the local run's"
    );
    anyhow::ensure!(
        report.exact_after(),
        "the output after the holders left differs from the local run's"
    );
    Ok(())
}

/// Prints a progress line on stderr (nothing with `--json`).
type Say<'a> = &'a dyn Fn(&str);

/// The demo's model: a small GPT-OSS-shaped checkpoint with random weights and the real
/// vocabulary, and the prompt every run generates from.
#[derive(Debug)]
struct DemoModel {
    /// Its folder.
    dir: PathBuf,
    /// The embedded tokenizer (also written into the folder), when this build has one.
    tokenizer: Option<Arc<Tokenizer>>,
    /// The user's message rendered as a Harmony prompt (a fixed list of ids without a
    /// tokenizer).
    prompt: Vec<u32>,
    /// Experts per layer.
    experts: usize,
}

impl DemoModel {
    /// Synthesizes it in `dir`, with (when embedded) its tokenizer, and renders `message`.
    fn synthesize(dir: PathBuf, message: &str, say: Say<'_>) -> anyhow::Result<Self> {
        say(&format!(
            "synthesizing a 4-layer GPT-OSS-shaped model with the {GPT_OSS_VOCAB}-token vocabulary"
        ));
        crate::cmd::sim::small_model(&dir, GPT_OSS_VOCAB)?;
        let tokenizer = match embedded_tokenizer()? {
            Some(json) => {
                std::fs::write(dir.join("tokenizer.json"), &json)
                    .with_context(|| format!("writing {}", dir.join("tokenizer.json").display()))?;
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
                    &[Turn::new(TurnRole::User, message.to_owned())],
                    &PromptOptions::default(),
                )?
            }
            None => vec![200_006, 17_360, 200_008, 3, 1_000, 50_000, 200_007],
        };
        let experts = {
            let files = stormo_engine::ModelFiles::open(&dir)?;
            files.layout.parts.iter().map(Vec::len).max().unwrap_or(0)
        };
        Ok(Self {
            dir,
            tokenizer,
            prompt,
            experts,
        })
    }
}

/// The swarm's keys and signed manifest (in `work`/swarm), and `nodes` holders on 127.0.0.1,
/// each serving every n-th expert, their processes registered in `reapers` for Ctrl-C; with
/// the relay's key (made first: the holders admit it alone).
fn start_holders(
    exe: &Path,
    model: &DemoModel,
    work: &Path,
    reapers: &Mutex<Vec<Reaper>>,
    nodes: usize,
    say: Say<'_>,
) -> anyhow::Result<(Cluster, (PathBuf, String))> {
    say("making keys and a signed manifest");
    let mut c = Cluster::prepare(exe, &model.dir, &work.join("swarm"))?;
    reapers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(c.reaper());
    let relay_key = c.make_key("relay")?;
    // The holders admit the relay alone: the client hears of them from the relay (peer
    // exchange) but is refused, so what it gets comes through the relay, as to a node that
    // cannot reach the holders.
    for i in 0..nodes {
        c.add_node_with(
            NodeSpec {
                only: Some(share(i, nodes, model.experts)),
                allow: Some(relay_key.1.clone()),
                ..NodeSpec::default()
            },
            LinkSpec::ideal(),
        )?;
    }
    say(&format!("{nodes} nodes serving on 127.0.0.1"));
    Ok((c, relay_key))
}

/// The relay: a node with no experts of its own (the dense weights pulled from a holder into
/// `work`), serving with `key` and fetching from the `holders`, keeping what it verified and
/// serving it on. Its index in the cluster.
fn start_relay(
    exe: &Path,
    c: &mut Cluster,
    work: &Path,
    holders: Range<usize>,
    key: (PathBuf, String),
    say: Say<'_>,
) -> anyhow::Result<usize> {
    let dense = work.join("relay-model");
    say("pulling the dense weights for a node with no experts");
    swarm::cluster::run_capture(
        exe,
        &[
            "pull".into(),
            "--peer".into(),
            c.nodes[0].peer(),
            "--trust".into(),
            c.publisher.clone(),
            "--key".into(),
            key.0.to_string_lossy().into_owned(),
            "--state-dir".into(),
            work.join("pull.state").to_string_lossy().into_owned(),
            "--out".into(),
            dense.to_string_lossy().into_owned(),
        ],
        "pulling the dense weights",
    )?;
    let mut relay_args = vec!["--trust".to_string(), c.publisher.clone()];
    relay_args.extend(c.peer_args(holders));
    let relay = c.add_node_with(
        NodeSpec {
            model: Some(dense),
            args: relay_args,
            key: Some(key),
            ..NodeSpec::default()
        },
        LinkSpec::ideal(),
    )?;
    say(&format!(
        "{} serving on 127.0.0.1 with no experts, fetching from the others",
        c.nodes[relay].name
    ));
    Ok(relay)
}

/// The three runs the demo compares, and what the relay kept between them.
#[derive(Debug)]
struct Runs {
    /// On a node with no experts that knows only the relay, the holders up.
    remote: RunOutcome,
    /// The same, the holders stopped: served by the relay from what it kept.
    reserved: RunOutcome,
    /// Every expert local.
    local: RunOutcome,
    /// Verified expert records the relay kept after the first run.
    kept: usize,
}

/// Generates `max_new_tokens` from the prompt on a node with no experts that knows only the
/// `relay`, then again once the `holders` have stopped, then with every expert local; stops
/// every node.
fn generate(
    c: &mut Cluster,
    model: &DemoModel,
    holders: Range<usize>,
    relay: usize,
    max_new_tokens: usize,
    say: Say<'_>,
) -> anyhow::Result<Runs> {
    let base = swarm::run_args(&model.dir, &model.prompt, max_new_tokens);
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
    for i in holders {
        c.stop(i);
    }
    say("generating again, with the holders gone");
    let (v, wall) = c.spawn_run("reserved", &args)?.wait(timeout)?;
    let reserved = RunOutcome::from_json(&v, wall)?;
    say("the same prompt with every expert local");
    let (v, wall) = c.spawn_run("local", &base)?.wait(timeout)?;
    let local = RunOutcome::from_json(&v, wall)?;
    c.stop_all();
    Ok(Runs {
        remote,
        reserved,
        local,
        kept,
    })
}

/// What the demo found, printed as a report or one JSON object.
#[derive(Debug)]
struct Report<'a> {
    c: &'a Cluster,
    model: &'a DemoModel,
    /// The relay's index in the cluster.
    relay: usize,
    /// How many holders served (the first nodes of the cluster).
    holders: usize,
    runs: Runs,
}

impl Report<'_> {
    /// Whether the swarm's ids equal the local run's.
    fn exact(&self) -> bool {
        self.runs.remote.ids == self.runs.local.ids
    }

    /// Whether the ids after the holders left equal the local run's.
    fn exact_after(&self) -> bool {
        self.runs.reserved.ids == self.runs.local.ids
    }

    /// The swarm's ids as text (random weights, so it means nothing), with a tokenizer.
    fn text(&self) -> Option<String> {
        self.model
            .tokenizer
            .as_ref()
            .and_then(|t| t.decode(&self.runs.remote.ids, false).ok())
    }

    /// Whether `n` is the relay.
    fn is_relay(&self, n: &swarm::cluster::Node) -> bool {
        n.name == self.c.nodes[self.relay].name
    }

    /// Experts per layer `n` holds.
    fn held(&self, n: &swarm::cluster::Node) -> usize {
        if self.is_relay(n) {
            0
        } else {
            n.only
                .as_deref()
                .map_or(self.model.experts, |s| s.split(',').count())
        }
    }

    /// Prints it (`json`: one JSON object on stdout), `start` being when the demo started.
    fn print(&self, json: bool, start: Instant) {
        let nodes: Vec<serde_json::Value> = self
            .c
            .nodes
            .iter()
            .map(|n| {
                serde_json::json!({
                    "name": n.name,
                    "holds": n.only,
                    "experts_held": self.held(n),
                    "relay": self.is_relay(n),
                    "served": n.served,
                    "bytes_sent": n.link().down_bytes,
                })
            })
            .collect();
        let elapsed = start.elapsed().as_secs_f64();
        if json {
            let (c, r) = (self.c, &self.runs);
            println!(
                "{}",
                serde_json::json!({
                    "model_id": c.model_id,
                    "publisher": c.publisher,
                    "prompt_ids": self.model.prompt,
                    "swarm": r.remote,
                    "after_holders_left": r.reserved,
                    "relay_kept": r.kept,
                    "local": r.local,
                    "token_exact": self.exact() && self.exact_after(),
                    "nodes": nodes,
                    "text": self.text(),
                    "elapsed_s": elapsed,
                })
            );
        } else {
            self.print_text(elapsed);
        }
    }

    /// The report for people: what ran, the verification, where the experts came from, the
    /// speeds and whether the ids were exact.
    fn print_text(&self, elapsed: f64) {
        let (c, runs) = (self.c, &self.runs);
        let (remote, reserved, local) = (&runs.remote, &runs.reserved, &runs.local);
        let r = &c.nodes[self.relay].name;
        println!("stormo demo: a 4-layer GPT-OSS-shaped model with random weights and the real");
        println!(
            "{GPT_OSS_VOCAB}-token vocabulary; {} experts per layer spread over {} nodes;",
            self.model.experts, self.holders
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
            "  experts    {} loads from {r} by the generating node, each checked chunk by chunk against the manifest; {} failures",
            remote.peer_loads, remote.peer_failures
        );
        println!();
        println!("where the experts came from");
        for n in &c.nodes {
            let role = if n.name == *r {
                format!("held none; kept the {} it fetched", runs.kept)
            } else {
                format!("holds {} experts per layer", self.held(n))
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
            self.model.prompt.len(),
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
            yes(self.exact()),
            remote.ids.len(),
            yes(self.exact_after())
        );
        let ids: Vec<String> = remote.ids.iter().map(u32::to_string).collect();
        println!("generated ids: {}", ids.join(" "));
        if let Some(t) = &self.text() {
            println!("as text (random weights, so it means nothing): {t:?}");
        }
        println!("done in {elapsed:.1}s");
    }
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
