//! Swarms of real nodes on one machine: `stormo serve` processes on 127.0.0.1 speaking real
//! QUIC through relays that impose latency, bandwidth and loss, a `stormo run` client, nodes
//! killed and restarted during a run, and the verdict that matters: did the output stay
//! token-exact against a local run of the same prompt.
//!
//! - [`relay`]: the link shaper (a UDP relay per client-server link).
//! - [`cluster`]: the processes (keys, manifest, serve nodes, client runs, cleanup).
//! - [`run_scenario`]: the named scenarios and their [`SwarmReport`].
//! - [`faults`]: the fault matrix against real processes and its [`faults::FaultReport`].
//! - [`bigger`]: a model no serving node has room for: nodes place the experts among
//!   themselves from a seeder that then leaves ([`bigger::BiggerReport`]).
//! - [`fairness`]: two bulk transfers sharing one bottleneck, paced by different congestion
//!   controls, and each one's share ([`fairness::FairnessReport`]).
//!
//! This crate cannot depend on the node (the node depends on it), so it drives the `stormo`
//! binary whose path the caller gives, exactly as a user would. Non-goals: more than one
//! machine, network namespaces, simulated time.

pub mod bigger;
pub mod cluster;
pub mod fairness;
pub mod faults;
pub mod relay;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use cluster::{Cluster, NodeSpec, Reaper};
pub use relay::{LinkCounts, LinkSpec, Relay, SharedLink, ETHERNET_MTU};

/// Why a swarm could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SwarmError {
    /// A process could not be started.
    #[error("{what}: cannot start {}: {source}", exe.display())]
    Spawn {
        /// What was being done.
        what: String,
        /// The binary.
        exe: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A step failed.
    #[error("{what}: {detail}")]
    Failed {
        /// What was being done.
        what: String,
        /// What went wrong (a process's last log lines).
        detail: String,
    },
    /// A file could not be used.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The model does not suit the scenario.
    #[error("{0}")]
    Model(String),
}

impl SwarmError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A named scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// Four nodes on a LAN, each holding a quarter of the experts; the generation runs on
    /// node 0 with its quarter from its own disk and the rest from the other three.
    Lan4,
    /// A fresh node with no experts and no manifest (fetched from a peer, pinned by model
    /// id) joins four nodes that each hold a quarter, and generates with every expert from
    /// them.
    JoinEmpty,
    /// Four nodes each holding half the experts (every expert on two nodes); a client with
    /// no experts generates while one holder is killed mid-run and restarted.
    Churn,
    /// `join-empty` over internet-like links (20 ms one way, 100 Mbit/s, 0.5% loss).
    Wan,
    /// `wan` run twice by the joining node: fetching every expert (`--remote-exec never`),
    /// then choosing per expert between fetching and having a holder run it
    /// (`--remote-exec auto`).
    WanExec,
    /// Two nodes each hold every expert, each behind its own 200 Mbit/s link; a node with no
    /// experts generates from one of them, then from both (each expert of at least 2 MiB
    /// striped across the two). Not in [`Scenario::ALL`]: it needs experts that large.
    Stripe,
}

impl Scenario {
    /// Every scenario `all` runs, in report order (the small model `stormo sim` makes
    /// suits each).
    pub const ALL: [Self; 5] = [
        Self::Lan4,
        Self::JoinEmpty,
        Self::Churn,
        Self::Wan,
        Self::WanExec,
    ];

    /// Every scenario by name: [`Self::ALL`], and those that need a model of their own.
    pub const NAMED: [Self; 6] = [
        Self::Lan4,
        Self::JoinEmpty,
        Self::Churn,
        Self::Wan,
        Self::WanExec,
        Self::Stripe,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lan4 => "lan4",
            Self::JoinEmpty => "join-empty",
            Self::Churn => "churn",
            Self::Wan => "wan",
            Self::WanExec => "wan-exec",
            Self::Stripe => "stripe",
        }
    }

    /// The links it uses unless told otherwise.
    pub fn default_link(self) -> LinkSpec {
        match self {
            Self::Wan | Self::WanExec => LinkSpec::wan(),
            Self::Stripe => LinkSpec {
                bandwidth: Some(25_000_000),
                ..LinkSpec::lan()
            },
            _ => LinkSpec::lan(),
        }
    }

    /// One line on what it does.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Lan4 => {
                "4 nodes each hold a quarter; node 0 generates, 3/4 of experts from the others"
            }
            Self::JoinEmpty => {
                "a node with no experts and no manifest joins 4 quarter-holders and generates"
            }
            Self::Churn => {
                "4 nodes hold every expert twice; a holder is killed mid-run and restarted"
            }
            Self::Wan => "join-empty over 20 ms / 100 Mbit/s / 0.5% loss links",
            Self::WanExec => {
                "wan fetching every expert, then with remote execution chosen per expert (auto)"
            }
            Self::Stripe => {
                "2 nodes hold every expert behind 200 Mbit/s links; an empty node generates \
                 from one, then from both (striped)"
            }
        }
    }
}

impl std::str::FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMED
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::NAMED.iter().map(|x| x.name()).collect();
                format!("unknown scenario {s:?}: one of {}", names.join(", "))
            })
    }
}

/// What a swarm run is given.
#[derive(Debug, Clone)]
pub struct SwarmOptions {
    /// The `stormo` binary.
    pub exe: PathBuf,
    /// The checkpoint (read only; every node serves from it).
    pub model: PathBuf,
    /// A scratch folder for keys, the manifest and logs.
    pub work: PathBuf,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// The links (`None`: the scenario's).
    pub link: Option<LinkSpec>,
    /// The client's `--expert-cache` (`None`: half of all experts, so that experts keep
    /// moving during the run).
    pub client_cache: Option<String>,
    /// The longest any one generation may take.
    pub timeout: Duration,
    /// Extra arguments of every serving node (e.g. `--congestion bbr`).
    pub serve_args: Vec<String>,
}

/// What one `stormo run --json` reported.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunOutcome {
    /// The generated ids.
    pub ids: Vec<u32>,
    /// Prefill tokens per second.
    pub prefill_tok_s: f64,
    /// Decode tokens per second.
    pub decode_tok_s: f64,
    /// Of the decode's time, seconds the end waited for spot-checks still running.
    pub check_wait_s: f64,
    /// Seconds from process start to exit (loading included).
    pub wall_s: f64,
    /// Experts loaded from peers (each verified against the manifest).
    pub peer_loads: u64,
    /// Expert bytes from peers.
    pub peer_bytes: u64,
    /// Expert requests to peers that failed (and went to another peer).
    pub peer_failures: u64,
    /// Experts loaded from the local disk.
    pub disk_loads: u64,
    /// Loads that fell to a lower tier after a failure.
    pub fallbacks: u64,
    /// Experts computed by peers (calls answered).
    pub remote_calls: u64,
    /// Bytes of rows sent to and received from them.
    pub remote_bytes: u64,
    /// Calls that gave no rows (the expert was fetched instead).
    pub remote_failures: u64,
    /// Loads striped across several holders.
    pub peer_striped_loads: u64,
}

impl RunOutcome {
    /// Reads `stormo run --json` output.
    pub fn from_json(v: &serde_json::Value, wall_s: f64) -> Result<Self, SwarmError> {
        let bad = |what: &str| SwarmError::Failed {
            what: "reading `stormo run --json`".into(),
            detail: format!("no {what} in {v}"),
        };
        let ids = v["generated_ids"]
            .as_array()
            .ok_or_else(|| bad("generated_ids"))?
            .iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad("integer generated_ids"))?;
        let f = |p: &str| {
            v.pointer(p)
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0)
        };
        let u = |p: &str| {
            v.pointer(p)
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0)
        };
        Ok(Self {
            ids,
            prefill_tok_s: f("/timings/prefill_tok_s"),
            decode_tok_s: f("/timings/decode_tok_s"),
            check_wait_s: f("/timings/check_wait_s"),
            wall_s,
            peer_loads: u("/experts/peer_loads"),
            peer_bytes: u("/experts/peer_bytes"),
            peer_failures: u("/experts/peer_failures"),
            disk_loads: u("/experts/disk_loads"),
            fallbacks: u("/experts/fallbacks"),
            remote_calls: u("/experts/remote_calls"),
            remote_bytes: u("/experts/remote_bytes"),
            remote_failures: u("/experts/remote_failures"),
            peer_striped_loads: u("/experts/peer_striped_loads"),
        })
    }
}

/// One node in a report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeReport {
    /// `n0`, `n1`, ...
    pub name: String,
    /// Its `--only-experts` spec.
    pub holds: String,
    /// What its link carried (down: to the client).
    pub link: LinkCounts,
    /// Requests it reported serving (lives that ended gracefully only).
    pub served: Option<u64>,
    /// Times killed.
    pub kills: u32,
    /// Times started.
    pub starts: u32,
}

/// The result of one scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SwarmReport {
    /// The scenario's name.
    pub scenario: String,
    /// The links.
    pub link: LinkJson,
    /// The serving nodes.
    pub nodes: Vec<NodeReport>,
    /// The run with every expert local.
    pub local: RunOutcome,
    /// The run in the swarm.
    pub swarm: RunOutcome,
    /// `wan-exec`: the same run with `--remote-exec auto` (the swarm run fetched).
    pub remote: Option<RunOutcome>,
    /// `stripe`: the same run with one holder as its only peer (the swarm run had both).
    pub one_holder: Option<RunOutcome>,
    /// Whether the swarm's ids equal the local run's.
    pub token_exact: bool,
    /// The least time the links' rate allows for what they carried: the busiest link's bytes
    /// (every run of the scenario, both ways) at its bandwidth, each node's link running in
    /// parallel with the others (`None`: unlimited links).
    pub link_bound_s: Option<f64>,
    /// What happened, in order, with seconds since the swarm run started.
    pub events: Vec<String>,
}

/// A [`LinkSpec`] for JSON.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct LinkJson {
    /// One-way delay, milliseconds.
    pub delay_ms: f64,
    /// Bytes per second (`None`: unlimited).
    pub bandwidth_bytes_s: Option<u64>,
    /// Loss probability.
    pub loss: f64,
}

impl From<LinkSpec> for LinkJson {
    fn from(l: LinkSpec) -> Self {
        Self {
            delay_ms: l.delay.as_secs_f64() * 1e3,
            bandwidth_bytes_s: l.bandwidth,
            loss: l.loss,
        }
    }
}

/// Experts per layer, MoE layers and total expert bytes of `model`.
fn expert_shape(model: &Path) -> Result<(usize, usize, u64), SwarmError> {
    let files = stormo_engine::ModelFiles::open(model).map_err(|e| {
        SwarmError::Model(format!("cannot open the model in {}: {e}", model.display()))
    })?;
    let n = files.layout.parts.iter().map(Vec::len).max().unwrap_or(0);
    let layers = files.layout.parts.iter().filter(|l| !l.is_empty()).count();
    let bytes = files.layout.sizes().iter().flatten().sum();
    Ok((n, layers, bytes))
}

/// The experts `e` of `n` with `e % 4` in `residues`, as an `--only-experts` list.
pub fn experts_with_residues(n: usize, residues: &[usize]) -> String {
    let v: Vec<String> = (0..n)
        .filter(|e| residues.contains(&(e % 4)))
        .map(|e| e.to_string())
        .collect();
    v.join(",")
}

fn ids_arg(ids: &[u32]) -> String {
    let v: Vec<String> = ids.iter().map(u32::to_string).collect();
    v.join(",")
}

/// The arguments of a `stormo run` of `opts`'s prompt.
pub fn run_args(model: &Path, prompt: &[u32], max_new_tokens: usize) -> Vec<String> {
    vec![
        "--model".into(),
        model.to_string_lossy().into_owned(),
        "--prompt-ids".into(),
        ids_arg(prompt),
        "--max-new-tokens".into(),
        max_new_tokens.to_string(),
        "--json".into(),
        "--no-hot-store".into(),
    ]
}

/// Runs `scenario`, reporting progress through `log`. Every process it starts is gone when
/// it returns (or when the returned error is dropped); the scratch folder is left to the
/// caller.
pub fn run_scenario(
    scenario: Scenario,
    opts: &SwarmOptions,
    log: &mut dyn FnMut(&str),
    reaper_out: Option<&dyn Fn(Reaper)>,
) -> Result<SwarmReport, SwarmError> {
    let link = opts.link.unwrap_or_else(|| scenario.default_link());
    link.validate().map_err(SwarmError::Model)?;
    let (n_experts, n_layers, expert_bytes) = expert_shape(&opts.model)?;
    // Bytes of one expert (on average).
    let one_expert = expert_bytes / (n_layers * n_experts).max(1) as u64;
    if n_experts < 4 {
        return Err(SwarmError::Model(format!(
            "the model has {n_experts} experts per layer; the scenarios need at least 4"
        )));
    }
    if scenario == Scenario::Stripe {
        let largest = largest_expert(&opts.model)?;
        if largest < STRIPE_MIN {
            return Err(SwarmError::Model(format!(
                "the stripe scenario needs experts of at least {} MiB (a node stripes only those); \
                 this model's largest is {largest} bytes: give --model a larger one, e.g. from \
                 `stormo synth --preset gpt-oss-20b --layers 2 --vocab 4096 --out DIR`",
                STRIPE_MIN >> 20
            )));
        }
    }
    let work = opts.work.join(scenario.name());
    log(&format!("{}: {}", scenario.name(), scenario.describe()));
    let mut c = Cluster::prepare(&opts.exe, &opts.model, &work)?;
    c.serve_args = opts.serve_args.clone();
    if let Some(f) = reaper_out {
        f(c.reaper());
    }
    log(&format!(
        "manifest {} signed by {}",
        &c.model_id[..16],
        &c.publisher[..16]
    ));

    // The reference: every expert local.
    let base = run_args(&opts.model, &opts.prompt, opts.max_new_tokens);
    log("local run (every expert from this disk)");
    let (v, wall) = c.spawn_run("local", &base)?.wait(opts.timeout)?;
    let local = RunOutcome::from_json(&v, wall)?;

    let layouts: Vec<Vec<usize>> = match scenario {
        Scenario::Lan4 => vec![vec![1], vec![2], vec![3]],
        Scenario::JoinEmpty | Scenario::Wan | Scenario::WanExec => {
            vec![vec![0], vec![1], vec![2], vec![3]]
        }
        Scenario::Churn => vec![vec![0, 1], vec![1, 2], vec![2, 3], vec![3, 0]],
        Scenario::Stripe => vec![vec![0, 1, 2, 3], vec![0, 1, 2, 3]],
    };
    for r in &layouts {
        // Every residue: the whole model (`all` in the report).
        let only = (r.len() < 4).then(|| experts_with_residues(n_experts, r));
        let i = c.add_node(only, link)?;
        log(&format!(
            "started {} holding experts {}",
            c.nodes[i].name,
            c.nodes[i].only.as_deref().unwrap_or("all")
        ));
    }
    let cache = opts
        .client_cache
        .clone()
        .unwrap_or_else(|| (expert_bytes / 2).to_string());
    let mut args = base.clone();
    args.extend([
        "--key".into(),
        c.client_key.to_string_lossy().into_owned(),
        "--expert-cache".into(),
        cache,
        // The simulated holders are this machine's own processes, named by key, not members
        // of a swarm: the client lets them compute (remote execution goes only to swarm
        // members by default).
        "--exec-trust".into(),
        "any".into(),
    ]);
    let empty_manifest = work.join("joining-node").join("stormo-manifest.bin");
    match scenario {
        Scenario::Lan4 => {
            args.extend([
                "--manifest".into(),
                c.manifest.to_string_lossy().into_owned(),
                "--trust".into(),
                c.publisher.clone(),
                "--only-experts".into(),
                experts_with_residues(n_experts, &[0]),
            ]);
        }
        Scenario::JoinEmpty | Scenario::Wan | Scenario::WanExec | Scenario::Stripe => {
            args.extend([
                "--manifest".into(),
                empty_manifest.to_string_lossy().into_owned(),
                "--model-id".into(),
                c.model_id.clone(),
                "--no-local-experts".into(),
            ]);
        }
        Scenario::Churn => {
            args.extend([
                "--manifest".into(),
                c.manifest.to_string_lossy().into_owned(),
                "--trust".into(),
                c.publisher.clone(),
                "--no-local-experts".into(),
                // Fail over quickly from the killed node (its silence shows within this), yet
                // give a whole expert time to arrive over a link shared by a prefill's loads:
                // 2 s, or a second per 2 MB of one expert when that is longer (6.6 s at
                // gpt-oss-20b's 13.2 MB).
                "--peer-timeout".into(),
                format!("{:.1}", (one_expert as f64 / 2e6).max(2.0)),
            ]);
        }
    }
    // `stripe`'s first run has one holder as its only peer, each run its own state folder.
    let one_holder_args = (scenario == Scenario::Stripe).then(|| {
        let mut a = args.clone();
        a.extend(c.peer_args(0..1));
        a.extend(["--state-dir".into(), state_arg(&work, "one-holder")]);
        a
    });
    if scenario == Scenario::Stripe {
        args.extend(["--state-dir".into(), state_arg(&work, "two-holders")]);
    }
    args.extend(c.peer_args(0..c.nodes.len()));
    // `wan-exec`'s first run fetches every expert; its second (below) chooses.
    let auto_args = (scenario == Scenario::WanExec).then(|| {
        let mut a = args.clone();
        a.extend(["--remote-exec".into(), "auto".into()]);
        a
    });
    if scenario == Scenario::WanExec {
        args.extend(["--remote-exec".into(), "never".into()]);
    }
    let one_holder = match one_holder_args {
        Some(a) => {
            log("run with one holder as the only peer");
            let client = c.spawn_run("one-holder", &a)?;
            let mut next_report = REPORT_EVERY;
            Some(finish(&c, client, opts.timeout, &mut next_report, log)?)
        }
        None => None,
    };
    log(if scenario == Scenario::Stripe {
        "run with both holders"
    } else {
        "swarm run"
    });
    let mut events = Vec::new();
    let mut client = c.spawn_run("swarm", &args)?;
    let mut next_report = REPORT_EVERY;
    if scenario == Scenario::Churn {
        let victim = 1;
        let mut killed_at: Option<Instant> = None;
        let mut restarted = false;
        while !client.finished() {
            let t = client.started.elapsed().as_secs_f64();
            // Mid-run: once the victim has sent about three experts' worth.
            if killed_at.is_none() && c.nodes[victim].link().down_bytes > 3 * one_expert {
                c.kill(victim);
                killed_at = Some(Instant::now());
                let e = format!(
                    "{t:.2}s: killed {} (SIGKILL) after it had sent {} bytes",
                    c.nodes[victim].name,
                    c.nodes[victim].link().down_bytes
                );
                log(&e);
                events.push(e);
            }
            if let Some(k) = killed_at {
                if !restarted && k.elapsed() >= Duration::from_millis(1500) {
                    c.start(victim)?;
                    restarted = true;
                    let e = format!("{t:.2}s: restarted {}", c.nodes[victim].name);
                    log(&e);
                    events.push(e);
                }
            }
            if client.started.elapsed() > opts.timeout {
                break;
            }
            report(&c, &client, &mut next_report, log);
            std::thread::sleep(Duration::from_millis(5));
        }
        if killed_at.is_some() && !restarted {
            // The run outlived neither the kill nor the restart delay (a fast machine): bring
            // the node back all the same, so every scenario ends with the victim restarted,
            // and say when.
            c.start(victim)?;
            let t = client.started.elapsed().as_secs_f64();
            let e = format!(
                "{t:.2}s: restarted {} (after the run had ended)",
                c.nodes[victim].name
            );
            log(&e);
            events.push(e);
        }
        if killed_at.is_none() {
            return Err(SwarmError::Failed {
                what: "churn".into(),
                detail: "the run ended before the victim served anything, so nothing was killed mid-run; give a longer run (--max-new-tokens) or a smaller --client-cache".into(),
            });
        }
    }
    let swarm = finish(&c, client, opts.timeout, &mut next_report, log)?;
    let remote = match auto_args {
        Some(a) => {
            log("swarm run with remote execution (auto)");
            let client = c.spawn_run("swarm-auto", &a)?;
            let mut next_report = REPORT_EVERY;
            Some(finish(&c, client, opts.timeout, &mut next_report, log)?)
        }
        None => None,
    };
    c.stop_all();
    let token_exact = swarm.ids == local.ids
        && remote.as_ref().is_none_or(|r| r.ids == local.ids)
        && one_holder.as_ref().is_none_or(|r| r.ids == local.ids);
    log(&format!(
        "{}: {}",
        scenario.name(),
        if token_exact {
            "token-exact"
        } else {
            "OUTPUT DIFFERS"
        }
    ));
    let nodes: Vec<NodeReport> = c
        .nodes
        .iter()
        .map(|n| NodeReport {
            name: n.name.clone(),
            holds: n.only.clone().unwrap_or_else(|| "all".into()),
            link: n.link(),
            served: n.served,
            kills: n.kills,
            starts: n.starts,
        })
        .collect();
    let link_bound_s = link_bound(&nodes, &link);
    Ok(SwarmReport {
        scenario: scenario.name().into(),
        link: link.into(),
        link_bound_s,
        nodes,
        local,
        swarm,
        remote,
        one_holder,
        token_exact,
        events,
    })
}

/// How often a long client run says how far it got.
const REPORT_EVERY: Duration = Duration::from_secs(30);

/// Says how long `client` has run and what the nodes have sent, once `next` is reached (then
/// `next` moves on by [`REPORT_EVERY`]).
fn report(
    c: &Cluster,
    client: &cluster::RunningClient,
    next: &mut Duration,
    log: &mut dyn FnMut(&str),
) {
    let t = client.started.elapsed();
    if t >= *next {
        *next += REPORT_EVERY;
        let sent: u64 = c.nodes.iter().map(|n| n.link().down_bytes).sum();
        log(&format!(
            "{} run: {}s, the nodes have sent {}",
            client.name(),
            t.as_secs(),
            mb(sent)
        ));
    }
}

/// Waits for `client` to end (reporting as it runs), then reads its `--json`.
fn finish(
    c: &Cluster,
    mut client: cluster::RunningClient,
    timeout: Duration,
    next_report: &mut Duration,
    log: &mut dyn FnMut(&str),
) -> Result<RunOutcome, SwarmError> {
    while !client.finished() && client.started.elapsed() <= timeout {
        report(c, &client, next_report, log);
        std::thread::sleep(Duration::from_millis(10));
    }
    let (v, wall) = client.wait(timeout)?;
    RunOutcome::from_json(&v, wall)
}

/// A node stripes an expert across its holders from this size on (the network tier's
/// minimum stripe is 1 MiB, and a record is striped when each of two holders gets one).
const STRIPE_MIN: u64 = 2 << 20;

/// The largest expert record of `model`, in bytes.
fn largest_expert(model: &Path) -> Result<u64, SwarmError> {
    let files = stormo_engine::ModelFiles::open(model).map_err(|e| {
        SwarmError::Model(format!("cannot open the model in {}: {e}", model.display()))
    })?;
    Ok(files
        .layout
        .sizes()
        .iter()
        .flatten()
        .copied()
        .max()
        .unwrap_or(0))
}

/// `--state-dir` of a client run named `name`, in the scenario's folder.
fn state_arg(work: &Path, name: &str) -> String {
    work.join(format!("{name}.state"))
        .to_string_lossy()
        .into_owned()
}

/// The busiest node link's bytes (both ways) at the link's bandwidth, in seconds.
fn link_bound(nodes: &[NodeReport], link: &LinkSpec) -> Option<f64> {
    let bw = link.bandwidth? as f64;
    let busiest = nodes
        .iter()
        .map(|n| n.link.down_bytes.max(n.link.up_bytes))
        .max()
        .unwrap_or(0);
    Some(busiest as f64 / bw)
}

fn mb(b: u64) -> String {
    format!("{:.1} MB", b as f64 / 1e6)
}

impl SwarmReport {
    /// A table for people.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let l = &self.link;
        let _ = writeln!(
            o,
            "scenario {}: links {:.2} ms one way, {}, loss {:.2}%",
            self.scenario,
            l.delay_ms,
            l.bandwidth_bytes_s.map_or_else(
                || "unlimited".into(),
                |b| format!("{:.0} Mbit/s", b as f64 * 8.0 / 1e6)
            ),
            l.loss * 100.0
        );
        // `lost`: datagrams the relay dropped by the link's loss probability.
        let _ = writeln!(
            o,
            "  {:<4} {:>10} {:>10} {:>8} {:>6} {:>14}  holds",
            "node", "sent", "received", "served", "kills", "datagrams lost"
        );
        for n in &self.nodes {
            let holds = if n.holds.len() > 40 {
                format!("{}...", &n.holds[..37])
            } else {
                n.holds.clone()
            };
            let _ = writeln!(
                o,
                "  {:<4} {:>10} {:>10} {:>8} {:>6} {:>14}  {}",
                n.name,
                mb(n.link.down_bytes),
                mb(n.link.up_bytes),
                n.served.map_or_else(|| "?".into(), |v| v.to_string()),
                n.kills,
                n.link.lost,
                holds
            );
        }
        for e in &self.events {
            let _ = writeln!(o, "  event: {e}");
        }
        let s = &self.swarm;
        let _ = writeln!(
            o,
            "  {:<6} {:>9} {:>9} {:>7} {:>11} {:>10} {:>9} {:>9}",
            "run", "prefill", "decode", "wall", "peer loads", "peer data", "failures", "fallbacks"
        );
        let rows = [("local", &self.local)]
            .into_iter()
            .chain(self.one_holder.as_ref().map(|r| ("one", r)))
            .chain([(
                if self.one_holder.is_some() {
                    "both"
                } else {
                    "swarm"
                },
                s,
            )])
            .chain(self.remote.as_ref().map(|r| ("auto", r)));
        for (name, r) in rows {
            let _ = writeln!(
                o,
                "  {:<6} {:>7.1}/s {:>7.1}/s {:>6.2}s {:>11} {:>10} {:>9} {:>9}",
                name,
                r.prefill_tok_s,
                r.decode_tok_s,
                r.wall_s,
                r.peer_loads,
                mb(r.peer_bytes),
                r.peer_failures,
                r.fallbacks
            );
        }
        let runs = [("swarm", Some(s)), ("auto", self.remote.as_ref())];
        for (name, r) in runs.into_iter().filter_map(|(n, r)| Some((n, r?))) {
            if r.check_wait_s >= 0.05 {
                let _ = writeln!(
                    o,
                    "  {name}: the decode's end waited {:.1} s for spot-checks still running",
                    r.check_wait_s
                );
            }
        }
        if let Some(r) = &self.remote {
            let _ = writeln!(
                o,
                "  auto: {} experts run by peers ({} of rows), {} failed calls; decode {:.2}x the \
                 fetching run's",
                r.remote_calls,
                mb(r.remote_bytes),
                r.remote_failures,
                r.decode_tok_s / s.decode_tok_s.max(f64::MIN_POSITIVE)
            );
        }
        if let Some(r) = &self.one_holder {
            let _ = writeln!(
                o,
                "  both holders: {} of {} peer loads striped; decode {:.2}x, prefill {:.2}x, \
                 wall {:.2}x the one holder's",
                s.peer_striped_loads,
                s.peer_loads,
                s.decode_tok_s / r.decode_tok_s.max(f64::MIN_POSITIVE),
                s.prefill_tok_s / r.prefill_tok_s.max(f64::MIN_POSITIVE),
                s.wall_s / r.wall_s.max(f64::MIN_POSITIVE)
            );
        }
        if let (Some(bound), None) = (self.link_bound_s, &self.one_holder) {
            let runs = s.wall_s + self.remote.as_ref().map_or(0.0, |r| r.wall_s);
            let _ = writeln!(
                o,
                "  the links' rate allows {bound:.1} s for what the busiest one carried; the \
                 swarm run{} took {runs:.1} s ({:.2}x)",
                if self.remote.is_some() { "s" } else { "" },
                runs / bound.max(f64::MIN_POSITIVE)
            );
        }
        let _ = write!(
            o,
            "  token-exact: {} ({} ids)",
            if self.token_exact { "yes" } else { "NO" },
            s.ids.len()
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residue_layouts_cover_every_expert() {
        assert_eq!(experts_with_residues(8, &[1]), "1,5");
        assert_eq!(experts_with_residues(8, &[3, 0]), "0,3,4,7");
        for n in [4, 7, 32] {
            let mut all: Vec<usize> = (0..4)
                .flat_map(|r| {
                    experts_with_residues(n, &[r])
                        .split(',')
                        .filter(|s| !s.is_empty())
                        .map(|s| s.parse::<usize>().unwrap())
                        .collect::<Vec<_>>()
                })
                .collect();
            all.sort_unstable();
            assert_eq!(all, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn scenario_names_round_trip() {
        for s in Scenario::ALL {
            assert_eq!(s.name().parse::<Scenario>(), Ok(s));
        }
        assert!("lan5".parse::<Scenario>().unwrap_err().contains("lan4"));
    }

    #[test]
    fn run_json_is_read_and_bad_json_named() {
        let v = serde_json::json!({
            "generated_ids": [5, 6],
            "timings": {"prefill_tok_s": 10.0, "decode_tok_s": 20.0, "check_wait_s": 1.5},
            "experts": {"peer_loads": 7, "peer_failures": 1}
        });
        let r = RunOutcome::from_json(&v, 1.5).unwrap();
        assert_eq!(r.ids, [5, 6]);
        assert_eq!((r.peer_loads, r.peer_failures), (7, 1));
        assert_eq!(r.decode_tok_s, 20.0);
        assert_eq!(r.check_wait_s, 1.5);
        let e = RunOutcome::from_json(&serde_json::json!({"generated_ids": [-1]}), 0.0);
        assert!(e.unwrap_err().to_string().contains("generated_ids"));
    }
}
