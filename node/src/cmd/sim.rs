//! `stormo sim`: run a swarm scenario of real nodes on this machine and report it (the old
//! spelling `stormo swarm --scenario NAME` still works: [`crate::cli::Cli::try_parse_args`]
//! rewrites it).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use stormo_simulations::swarm::{self, LinkSpec, Scenario, SwarmOptions};
use stormo_simulations::synth::{self, Overrides, Preset, SynthOptions};

/// Run a swarm scenario of real nodes on this machine (latency, loss, churn) and report it
///
/// Starts real `stormo serve` processes on 127.0.0.1 (real QUIC, each behind a relay that
/// imposes the links' delay, bandwidth and loss), lays the experts out among them, runs a
/// generation with `stormo run` on a node that lacks experts, and reports tokens/s, the bytes
/// each node sent, peer failures and fallbacks, and whether the ids equal those of a local
/// run of the same prompt (progress on stderr: each step, and a line every 30 s of a long
/// generation). Scenarios:
///
///   lan4        4 nodes each hold a quarter; node 0 generates, 3/4 of experts from the others
///   join-empty  a node with no experts and no manifest joins 4 quarter-holders and generates
///   churn       4 nodes hold every expert twice; a holder is killed mid-run and restarted
///   wan         join-empty over 20 ms / 100 Mbit/s / 0.5% loss links
///   wan-exec    wan fetching every expert, then with remote execution chosen per expert
///               (--remote-exec auto): decode speed side by side
///   all         each of them in turn
///   stripe      2 nodes hold every expert, each behind its own 200 Mbit/s link; a node with
///               no experts generates from one of them, then from both (experts of 2 MiB or
///               more striped across the two): speed side by side. Needs such experts (give
///               --model, e.g. from `stormo synth --preset gpt-oss-20b --layers 2`)
///   faults      the fault matrix: a holder killed or stopped while it sends, the sole holder
///               restarted on its port, corrupt bytes, an unknown key, a server at
///               --expert-cache 0 under concurrent clients; prints a table of case, outcome
///               (exact or clear error) and time, and fails unless every case is as expected
///   fair-lan    fairness: two nodes each pace a bulk pull through one shared bottleneck
///   fair-wan    (the lan or wan link's rate and drop-tail queue; each flow its own delay
///               and loss), as cubic+cubic, bbr+cubic, bbr+bbr, tolerant+cubic and
///               tolerant+tolerant; prints each flow's throughput and share over --fair-secs
///               after a 3 s warm-up
///   bigger-than-disk
///               N dense-only nodes, each with room for part of the experts, place 2 copies
///               of each (--replicas); the seeder leaves; a node with no experts generates
///               over lan and wan links, and again after one more node is killed
///
/// Without --model a small GPT-OSS-shaped model is synthesized in the scratch folder.
/// Example: `stormo sim --scenario churn --json`.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The scenario: lan4, join-empty, churn, wan, wan-exec, all, stripe, faults, fair-lan,
    /// fair-wan or bigger-than-disk.
    #[arg(long, value_name = "NAME")]
    pub scenario: String,
    /// The checkpoint every node serves from (at least 4 experts per layer).
    #[arg(short, long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Prompt token ids (default: 24 fixed ids below the vocabulary size).
    #[arg(long, value_name = "IDS")]
    pub prompt_ids: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 48, value_name = "N",
          allow_negative_numbers = true, value_parser = crate::args::count_arg)]
    pub max_new_tokens: usize,
    /// One-way delay of every link, in milliseconds (default: the scenario's).
    #[arg(long, value_name = "MS")]
    pub delay_ms: Option<f64>,
    /// Bandwidth of every link in Mbit/s, 0 for unlimited (default: the scenario's).
    #[arg(long, value_name = "MBIT")]
    pub bandwidth_mbit: Option<f64>,
    /// Share of datagrams lost on every link, e.g. 0.01 (default: the scenario's).
    #[arg(long, value_name = "P")]
    pub loss: Option<f64>,
    /// The generating node's --expert-cache (default: half of all experts, so experts keep
    /// moving through the run).
    #[arg(long, value_name = "SIZE", value_parser = stormo_net::progress::size_arg)]
    pub client_cache: Option<String>,
    /// Seconds any one generation may take (at most 1e6).
    #[arg(
        long,
        default_value_t = 600.0,
        value_name = "SECS",
        value_parser = stormo_net::progress::secs_arg
    )]
    pub timeout: f64,
    /// How the serving nodes pace their answers (`stormo serve --congestion`, whose default
    /// this follows; the fairness scenarios set each flow's own).
    #[arg(long, default_value_t = stormo_net::tls::Congestion::default(), value_name = "ALGORITHM", value_parser = crate::args::congestion_arg())]
    pub congestion: stormo_net::tls::Congestion,
    /// Scratch folder (keys, manifest, logs; the synthesized model): new or empty, kept at the
    /// end. Default: a new folder in the system's temp dir, removed at the end unless --keep.
    #[arg(long, value_name = "DIR")]
    pub work: Option<PathBuf>,
    /// Keep the scratch folder (its logs name what each process did).
    #[arg(long)]
    pub keep: bool,
    /// Print the reports as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// The faults scenario's concurrent clients of a server at --expert-cache 0 (1 to 64).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub fault_clients: usize,
    /// Seconds each pair of the fairness scenarios is measured, after the warm-up (1 to 3600).
    #[arg(long, default_value_t = 20.0, value_name = "SECS")]
    pub fair_secs: f64,
    /// bigger-than-disk: serving nodes (2 to 32).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub nodes: usize,
    /// bigger-than-disk: the serving nodes' --replicas (1 to --nodes - 1).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub replicas: u32,
    /// bigger-than-disk: each serving node's --expert-dir-limit, below the model's experts
    /// (default: replicas x the model's experts / nodes x 1.5).
    #[arg(long, value_name = "SIZE", value_parser = stormo_net::progress::size_arg)]
    pub expert_dir_limit: Option<String>,
}

/// The fairness scenarios: their name and the link whose rate and queue the flows share.
fn fairness_link(name: &str) -> Option<Scenario> {
    match name {
        "fair-lan" => Some(Scenario::Lan4),
        "fair-wan" => Some(Scenario::Wan),
        _ => None,
    }
}

/// The link every scenario uses unless overridden.
fn link_for(a: &Args, s: Scenario) -> anyhow::Result<LinkSpec> {
    let mut l = s.default_link();
    if let Some(d) = a.delay_ms {
        anyhow::ensure!(
            d.is_finite() && (0.0..=10_000.0).contains(&d),
            "--delay-ms must be between 0 and 10000"
        );
        l.delay = Duration::from_secs_f64(d / 1e3);
    }
    if let Some(b) = a.bandwidth_mbit {
        anyhow::ensure!(
            b.is_finite() && b >= 0.0,
            "--bandwidth-mbit must be 0 (unlimited) or more"
        );
        l.bandwidth = (b > 0.0).then(|| ((b * 1e6 / 8.0) as u64).max(1));
    }
    if let Some(p) = a.loss {
        l.loss = p;
    }
    l.validate()
        .map_err(|e| anyhow::anyhow!("the links: {e}"))?;
    Ok(l)
}

/// A small GPT-OSS-shaped model for swarms: 4 layers of 16 experts, top-4.
pub fn small_model(dir: &Path, vocab: usize) -> anyhow::Result<()> {
    let geometry = Preset::GptOss20b.geometry().with(&Overrides {
        layers: Some(4),
        hidden: Some(256),
        intermediate: Some(256),
        experts: Some(16),
        top_k: Some(4),
        vocab: Some(vocab),
        heads: Some(4),
        kv_heads: Some(2),
        head_dim: Some(64),
    });
    let plan = synth::plan(&SynthOptions::new(geometry, 7))?;
    synth::write(&plan, dir, true, &mut |_| {})
        .with_context(|| format!("writing a small model to {}", dir.display()))?;
    Ok(())
}

/// A scratch folder removed on drop unless kept.
#[derive(Debug)]
pub struct Scratch {
    /// Its path.
    pub path: PathBuf,
    keep: bool,
}

impl Scratch {
    /// `given`, or a new folder named after `what` in the temp dir.
    pub fn new(given: Option<PathBuf>, what: &str, keep: bool) -> anyhow::Result<Self> {
        let (path, keep) = match given {
            Some(p) => {
                // A run writes keys there, and keys are never overwritten: an earlier run's
                // folder would stop this one halfway, so it is refused before anything starts.
                if std::fs::read_dir(&p).is_ok_and(|mut d| d.next().is_some()) {
                    anyhow::bail!(
                        "--work {}: the folder is not empty (an earlier run's?); give a new or \
                         empty folder, or delete this one",
                        p.display()
                    );
                }
                (p, true)
            }
            None => (
                std::env::temp_dir().join(format!("stormo-{what}-{}", std::process::id())),
                keep,
            ),
        };
        std::fs::create_dir_all(&path)
            .with_context(|| format!("creating the scratch folder {}", path.display()))?;
        Ok(Self { path, keep })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Runs `stormo sim`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let faults = a.scenario == "faults";
    let fairness = fairness_link(&a.scenario);
    anyhow::ensure!(
        (1..=64).contains(&a.fault_clients),
        "--fault-clients must be between 1 and 64"
    );
    anyhow::ensure!(
        a.fair_secs.is_finite() && (1.0..=3600.0).contains(&a.fair_secs),
        "--fair-secs must be between 1 and 3600"
    );
    let bigger = a.scenario == "bigger-than-disk";
    let scenarios: Vec<Scenario> = if faults || fairness.is_some() || bigger {
        Vec::new()
    } else if a.scenario == "all" {
        Scenario::ALL.to_vec()
    } else {
        vec![a.scenario.parse().map_err(|e: String| {
            anyhow::anyhow!(
                "--scenario: {e}, all (each of them but stripe), faults, fair-lan, fair-wan or \
                 bigger-than-disk"
            )
        })?]
    };
    let links = scenarios
        .iter()
        .map(|&s| link_for(&a, s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let timeout = stormo_net::progress::check_secs(a.timeout)
        .map_err(|e| anyhow::anyhow!("--timeout: {e}"))?;
    anyhow::ensure!(a.max_new_tokens >= 1, "--max-new-tokens must be at least 1");
    let exe = std::env::current_exe().context("finding the stormo binary")?;
    let scratch = Scratch::new(a.work.clone(), "swarm", a.keep)?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let dir = scratch.path.join("model");
            eprintln!("synthesizing a small model in {}", dir.display());
            small_model(&dir, 32_000)?;
            dir
        }
    };
    let files = stormo_engine::ModelFiles::open(&model)
        .with_context(|| format!("loading the model in {}", model.display()))?;
    let vocab = files.cfg.vocab_size;
    drop(files);
    let prompt = match &a.prompt_ids {
        Some(s) => crate::cmd::run::parse_ids(s, "--prompt-ids")?,
        None => (0..24u64)
            .map(|i| ((i * 7919 + 13) % vocab.min(200_000) as u64) as u32)
            .collect(),
    };
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= vocab) {
        anyhow::bail!("--prompt-ids: id {bad} is not below the vocabulary size {vocab}");
    }
    let reaper_slot = std::sync::Arc::new(std::sync::Mutex::new(Vec::<swarm::Reaper>::new()));
    crate::cmd::demo::on_interrupt(scratch_guard(&scratch), reaper_slot.clone());
    // Every node the scenarios start, for the interrupt handler to stop.
    let keep_reaper = |r: swarm::Reaper| {
        reaper_slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
    };
    // A single-report scenario's output: its JSON or its table, and where its logs stayed.
    let print_report = |json: anyhow::Result<String>, table: String| -> anyhow::Result<()> {
        if a.json {
            println!("{}", json?);
        } else {
            println!("{table}");
        }
        if a.keep || a.work.is_some() {
            eprintln!("logs kept in {}", scratch.path.display());
        }
        Ok(())
    };
    let opts_for = |link: Option<LinkSpec>| SwarmOptions {
        exe: exe.clone(),
        model: model.clone(),
        work: scratch.path.clone(),
        prompt: prompt.clone(),
        max_new_tokens: a.max_new_tokens,
        link,
        client_cache: a.client_cache.clone(),
        timeout: Duration::from_secs_f64(timeout),
        serve_args: vec!["--congestion".into(), congestion_arg(a.congestion)],
    };
    if let Some(path) = fairness {
        let link = link_for(&a, path)?;
        let r = swarm::fairness::run_fairness(
            &a.scenario,
            &opts_for(Some(link)),
            link,
            &swarm::fairness::PAIRS,
            Duration::from_secs_f64(a.fair_secs),
            &mut |m| eprintln!("sim: {m}"),
            Some(&keep_reaper),
        )
        .with_context(|| format!("scenario {}", a.scenario))?;
        print_report(
            serde_json::to_string_pretty(&r).map_err(Into::into),
            r.table(),
        )?;
        return Ok(());
    }
    if a.scenario == "bigger-than-disk" {
        anyhow::ensure!(
            (2..=32).contains(&a.nodes),
            "--nodes must be between 2 and 32"
        );
        let budget = a
            .expert_dir_limit
            .as_deref()
            .map(stormo_net::progress::parse_size)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--expert-dir-limit: {e}"))?;
        let b = swarm::bigger::BiggerOptions {
            nodes: a.nodes,
            replicas: a.replicas,
            budget,
            lan: link_for(&a, Scenario::Lan4)?,
            wan: link_for(&a, Scenario::Wan)?,
            coverage_timeout: Duration::from_secs_f64(timeout),
        };
        let r = swarm::bigger::run_bigger(
            &opts_for(None),
            &b,
            &mut |m| eprintln!("sim: {m}"),
            Some(&keep_reaper),
        )
        .context("scenario bigger-than-disk")?;
        print_report(
            serde_json::to_string_pretty(&r).map_err(Into::into),
            r.table(),
        )?;
        anyhow::ensure!(
            r.token_exact,
            "bigger-than-disk: not token-exact (or failed) in: {}",
            r.runs
                .iter()
                .filter(|r| !r.token_exact)
                .map(|r| r.label.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(());
    }
    if faults {
        let link = link_for(&a, Scenario::Lan4)?;
        let r = swarm::faults::run_faults(
            &opts_for(Some(link)),
            a.fault_clients,
            &mut |m| eprintln!("sim: {m}"),
            Some(&keep_reaper),
        )
        .context("scenario faults")?;
        print_report(
            serde_json::to_string_pretty(&r).map_err(Into::into),
            r.table(),
        )?;
        let bad: Vec<&str> = r
            .rows
            .iter()
            .filter(|r| !r.ok)
            .map(|r| r.case.as_str())
            .collect();
        anyhow::ensure!(
            bad.is_empty(),
            "the fault matrix: not as expected in: {}",
            bad.join("; ")
        );
        return Ok(());
    }
    let mut reports = Vec::new();
    for (s, link) in scenarios.iter().zip(links) {
        let opts = opts_for(Some(link));
        let r = swarm::run_scenario(
            *s,
            &opts,
            &mut |m| eprintln!("swarm: {m}"),
            Some(&keep_reaper),
        )
        .with_context(|| format!("scenario {}", s.name()))?;
        if !a.json {
            println!("{}\n", r.table());
        }
        reports.push(r);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    if a.keep || a.work.is_some() {
        eprintln!("logs kept in {}", scratch.path.display());
    }
    let inexact: Vec<&str> = reports
        .iter()
        .filter(|r| !r.token_exact)
        .map(|r| r.scenario.as_str())
        .collect();
    anyhow::ensure!(
        inexact.is_empty(),
        "the output was not token-exact in: {}",
        inexact.join(", ")
    );
    Ok(())
}

/// `--congestion`'s value for `c`, as `stormo serve` parses it.
fn congestion_arg(c: stormo_net::tls::Congestion) -> String {
    c.name().to_string()
}

/// The folder a Ctrl-C handler should remove (none when kept).
fn scratch_guard(s: &Scratch) -> Option<PathBuf> {
    (!s.keep).then(|| s.path.clone())
}
