//! `stormo sim --scenario bigger-than-disk`: a model no serving node has room for (issue 57).
//!
//! A seeder serves the whole checkpoint; every serving node pulls the dense weights only
//! (`stormo pull`) and serves them with an expert budget below the model's experts
//! (`--expert-dir-limit`), together enough for `--replicas` copies, so the nodes place the
//! experts among themselves. Once `stormo swarm status` shows every expert with its copies the
//! seeder is killed; then a node with no experts (another pulled dense folder) generates over
//! `lan` links and over `wan` links, and again after one more serving node is killed. The
//! report: time to coverage, what each node kept, the copies, each run's speed beside the same
//! model run locally, and whether each run's ids equal the local run's.
//!
//! The links: the generating client reaches each serving node through a relay of the
//! [`LinkSpec`] under test (one relay per node and link). Placement traffic (node to node and
//! from the seeder) goes over loopback unshaped: the nodes dial each other at addresses fixed
//! before they start, and a relay's shape is fixed when it starts, while one placement serves
//! both links' runs. Bytes moved per node are read from the nodes themselves (`swarm status`:
//! the bytes each keeps) and from their state folders on disk.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::cluster::{run_capture, tail, Cluster, RunningClient};
use super::relay::{LinkSpec, Relay};
use super::{expert_shape, run_args, LinkJson, Reaper, RunOutcome, SwarmError, SwarmOptions};

/// What the scenario is given beyond [`SwarmOptions`].
#[derive(Debug, Clone)]
pub struct BiggerOptions {
    /// Serving nodes (at least 2).
    pub nodes: usize,
    /// `--replicas` of every serving node (at least 1, fewer than `nodes`).
    pub replicas: u32,
    /// Each node's `--expert-dir-limit` in bytes (`None`: replicas x experts / nodes x 1.5).
    pub budget: Option<u64>,
    /// The `lan` links.
    pub lan: LinkSpec,
    /// The `wan` links.
    pub wan: LinkSpec,
    /// The longest placement may take to reach `replicas` copies of every expert.
    pub coverage_timeout: Duration,
}

/// One serving node in the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlacedNode {
    /// `n0`, `n1`, ...
    pub name: String,
    /// Its `--expert-dir-limit`, bytes.
    pub budget: u64,
    /// Experts it kept when coverage was reached (its own report).
    pub kept_experts: Option<u64>,
    /// Bytes it kept then (its own report).
    pub kept_bytes: Option<u64>,
    /// Bytes in its state folder on disk then (the kept experts and its small files).
    pub state_dir_bytes: u64,
    /// Whether it was killed before the last runs.
    pub killed: bool,
}

/// One generation by the node with no experts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlacedRun {
    /// `lan`, `wan`, `lan, n0 killed`, ...
    pub label: String,
    /// The links between the client and each serving node.
    pub link: LinkJson,
    /// Serving nodes it had as peers.
    pub peers: usize,
    /// What `stormo run --json` reported (empty when it failed).
    pub run: RunOutcome,
    /// Why the run failed (its log's last lines), if it did: the scenario goes on with the
    /// next run, so one failure leaves the rest of the report.
    pub error: Option<String>,
    /// Whether its ids equal the local run's.
    pub token_exact: bool,
}

/// The result of `bigger-than-disk`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BiggerReport {
    /// `bigger-than-disk`.
    pub scenario: String,
    /// Experts of the model (every layer).
    pub experts: u64,
    /// Their bytes.
    pub expert_bytes: u64,
    /// Serving nodes.
    pub nodes_n: usize,
    /// `--replicas`.
    pub replicas: u32,
    /// Each node's expert budget, bytes.
    pub budget: u64,
    /// Seconds from starting the serving nodes until `swarm status` showed every expert with
    /// `replicas` copies (the pulls of the dense folders before are not counted).
    pub coverage_s: f64,
    /// The least copies of any expert then.
    pub min_copies: u64,
    /// The least copies just before one more node was killed (placement goes on after
    /// coverage: copies of the most asked-for experts, evictions).
    pub min_copies_before_kill: Option<u64>,
    /// The least copies after one more node was killed (over the nodes left).
    pub min_copies_after_kill: Option<u64>,
    /// Experts with no reachable holder then.
    pub uncovered_after_kill: Option<u64>,
    /// Seconds the dense folders' pulls took (all of them, one after another).
    pub pull_s: f64,
    /// Bytes one pulled dense folder takes on disk.
    pub dense_bytes: u64,
    /// The serving nodes.
    pub nodes: Vec<PlacedNode>,
    /// The run with every expert local (the whole checkpoint on this disk).
    pub local: RunOutcome,
    /// The runs of the node with no experts.
    pub runs: Vec<PlacedRun>,
    /// Whether every run's ids equal the local run's.
    pub token_exact: bool,
    /// What the links shape.
    pub links_note: String,
}

/// Each node's expert budget: `replicas` copies of `expert_bytes` spread over `nodes`, with
/// half again to spare, rounded up (with a fifth to spare placement stalled at one copy of a
/// few experts while others had three or four); an error when that is not below the model's experts (the nodes
/// could each hold the model) or is below the largest expert.
pub fn budget_for(
    expert_bytes: u64,
    largest: u64,
    nodes: usize,
    replicas: u32,
) -> Result<u64, SwarmError> {
    let b = (u128::from(expert_bytes) * u128::from(replicas) * 3).div_ceil(nodes as u128 * 2);
    let b = u64::try_from(b).unwrap_or(u64::MAX);
    if b >= expert_bytes {
        return Err(SwarmError::Model(format!(
            "{replicas} copies over {nodes} nodes need {b} bytes of experts on each, not below \
             the model's {expert_bytes}: give more --nodes or fewer --replicas"
        )));
    }
    if b < largest {
        return Err(SwarmError::Model(format!(
            "a budget of {b} bytes per node cannot hold the largest expert ({largest} bytes)"
        )));
    }
    Ok(b)
}

/// A UDP port on 127.0.0.1 that was free a moment ago (nodes must know each other's
/// addresses before they start).
fn free_port() -> Result<u16, SwarmError> {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .map_err(|e| SwarmError::Failed {
            what: "choosing a port".into(),
            detail: e.to_string(),
        })
}

/// Bytes the files under `dir` take on disk (allocated blocks: a folder pulled by an older
/// stormo had sparse shards, whose holes where the experts would be take nothing).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| on_disk(&m)),
            Err(_) => 0,
        })
        .sum()
}

#[cfg(unix)]
fn on_disk(m: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    m.blocks() * 512
}

#[cfg(not(unix))]
fn on_disk(m: &std::fs::Metadata) -> u64 {
    m.len()
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A `stormo serve` process started by the scenario.
struct Server {
    name: String,
    key: String,
    addr: SocketAddr,
    proc: Option<RunningClient>,
    out: PathBuf,
    log: PathBuf,
}

impl Server {
    /// `KEY@ADDR`, direct (no relay).
    fn peer(&self) -> String {
        format!("{}@{}", self.key, self.addr)
    }

    /// Starts `stormo serve args` as `name`, listening on `addr`.
    fn start(
        c: &Cluster,
        name: &str,
        key: String,
        addr: SocketAddr,
        args: &[String],
    ) -> Result<Self, SwarmError> {
        let proc = c.spawn_command(name, "serve", args)?;
        Ok(Self {
            name: name.into(),
            key,
            addr,
            proc: Some(proc),
            out: c.work.join(format!("{name}.json")),
            log: c.work.join(format!("{name}.log")),
        })
    }

    /// Waits until it prints its `KEY@ADDR` line, or fails with its log.
    fn ready(&mut self, timeout: Duration) -> Result<(), SwarmError> {
        let until = Instant::now() + timeout;
        loop {
            let out = std::fs::read_to_string(&self.out).unwrap_or_default();
            if out.lines().any(|l| l.contains('@')) {
                return Ok(());
            }
            self.alive()?;
            if Instant::now() > until {
                return Err(self.failed(&format!(
                    "printed no KEY@ADDR line within {}s",
                    timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// An error unless it is still running.
    fn alive(&mut self) -> Result<(), SwarmError> {
        match self.proc.as_mut().and_then(RunningClient::outcome) {
            None => Ok(()),
            Some(_) => Err(self.failed("exited")),
        }
    }

    fn failed(&self, what: &str) -> SwarmError {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        SwarmError::Failed {
            what: format!("{} {what}", self.name),
            detail: format!("its log ({}):\n{}", self.log.display(), tail(&log, 20)),
        }
    }

    /// Kills it (SIGKILL).
    fn kill(&mut self) {
        self.proc = None;
    }
}

/// `stormo swarm status --json` over `peers`.
fn status(c: &Cluster, dense: &Path, peers: &[String]) -> Result<serde_json::Value, SwarmError> {
    let mut args: Vec<String> = [
        "swarm",
        "status",
        "--model",
        &s(dense),
        "--model-id",
        &c.model_id,
        "--json",
    ]
    .map(String::from)
    .to_vec();
    for p in peers {
        args.extend(["--peer".into(), p.clone()]);
    }
    let out = run_capture(c.exe(), &args, "stormo swarm status")?;
    serde_json::from_str(out.trim()).map_err(|e| SwarmError::Failed {
        what: "stormo swarm status".into(),
        detail: format!("its --json output is not JSON ({e}): {out}"),
    })
}

/// Runs `bigger-than-disk`, reporting progress through `log`. Every process it starts is gone
/// when it returns; the scratch folder is left to the caller.
pub fn run_bigger(
    opts: &SwarmOptions,
    b: &BiggerOptions,
    log: &mut dyn FnMut(&str),
    reaper_out: Option<&dyn Fn(Reaper)>,
) -> Result<BiggerReport, SwarmError> {
    if b.nodes < 2 || b.replicas < 1 || b.replicas as usize >= b.nodes {
        return Err(SwarmError::Model(format!(
            "{} nodes with {} replicas: need at least 2 nodes and 1 to nodes - 1 replicas (a \
             node is killed and every expert must keep a copy)",
            b.nodes, b.replicas
        )));
    }
    let (_, _, expert_bytes) = expert_shape(&opts.model)?;
    let files = stormo_engine::ModelFiles::open(&opts.model).map_err(|e| {
        SwarmError::Model(format!(
            "cannot open the model in {}: {e}",
            opts.model.display()
        ))
    })?;
    let sizes = files.layout.sizes();
    let experts = sizes.iter().map(Vec::len).sum::<usize>() as u64;
    let largest = sizes.iter().flatten().copied().max().unwrap_or(0);
    drop(files);
    let budget = match b.budget {
        Some(v) if v >= expert_bytes => {
            return Err(SwarmError::Model(format!(
                "--expert-dir-limit {v} is not below the model's experts ({expert_bytes} bytes)"
            )))
        }
        Some(v) if v * (b.nodes as u64) < expert_bytes * u64::from(b.replicas) => {
            return Err(SwarmError::Model(format!(
                "--expert-dir-limit {v} on {} nodes cannot hold {} copies of {expert_bytes} bytes",
                b.nodes, b.replicas
            )))
        }
        Some(v) => v,
        None => budget_for(expert_bytes, largest, b.nodes, b.replicas)?,
    };
    let work = opts.work.join("bigger-than-disk");
    log(&format!(
        "bigger-than-disk: {} nodes with {} of expert budget each (the model's experts: {}), \
         {} copies",
        b.nodes,
        gb(budget),
        gb(expert_bytes),
        b.replicas
    ));
    let c = Cluster::prepare(&opts.exe, &opts.model, &work)?;
    if let Some(f) = reaper_out {
        f(c.reaper());
    }
    let base = run_args(&opts.model, &opts.prompt, opts.max_new_tokens);
    log("local run (every expert from this disk)");
    let (v, wall) = c.spawn_run("local", &base)?.wait(opts.timeout)?;
    let local = RunOutcome::from_json(&v, wall)?;

    // The seeder: the whole checkpoint.
    let (seed_key, seed_public) = c.make_key("seeder")?;
    let seed_addr: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
    let mut seed_args = vec![
        "--model".into(),
        s(&opts.model),
        "--manifest".into(),
        s(&c.manifest),
        "--listen".into(),
        seed_addr.to_string(),
        "--key".into(),
        s(&seed_key),
        "--allow-any".into(),
        "--no-hot-store".into(),
        "--expert-cache".into(),
        "0".into(),
        "--state-dir".into(),
        s(&work.join("seeder.state")),
    ];
    seed_args.extend(opts.serve_args.iter().cloned());
    let mut seeder = Server::start(&c, "seeder", seed_public, seed_addr, &seed_args)?;
    seeder.ready(Duration::from_secs(120))?;
    log(&format!("seeder up at {}", seeder.addr));

    // Dense-only folders, as `stormo pull` makes them: one per serving node and the client.
    let pulled = Instant::now();
    let mut dense = Vec::new();
    for i in 0..=b.nodes {
        let name = if i == b.nodes {
            "client".to_string()
        } else {
            format!("n{i}")
        };
        let dir = work.join(format!("{name}.dense"));
        run_capture(
            c.exe(),
            &[
                "pull".into(),
                "--peer".into(),
                seeder.peer(),
                "--model-id".into(),
                c.model_id.clone(),
                "--out".into(),
                s(&dir),
            ],
            &format!("pulling the dense weights for {name}"),
        )?;
        dense.push(dir);
    }
    let pull_s = pulled.elapsed().as_secs_f64();
    let dense_bytes = dir_bytes(&dense[0]);
    log(&format!(
        "pulled {} dense folders of {} each in {pull_s:.1}s",
        dense.len(),
        gb(dense_bytes)
    ));
    let client_dense = dense.pop().expect("the client's folder was pulled");

    // The serving nodes, each knowing the others and the seeder by address.
    let mut keys = Vec::new();
    for i in 0..b.nodes {
        let (k, public) = c.make_key(&format!("n{i}"))?;
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
        keys.push((k, public, addr));
    }
    let direct: Vec<String> = keys.iter().map(|(_, p, a)| format!("{p}@{a}")).collect();
    let started = Instant::now();
    let mut nodes = Vec::new();
    for (i, (k, public, addr)) in keys.iter().enumerate() {
        let mut args = vec![
            "--model".into(),
            s(&dense[i]),
            "--listen".into(),
            addr.to_string(),
            "--key".into(),
            s(k),
            "--allow-any".into(),
            "--no-hot-store".into(),
            "--expert-cache".into(),
            "0".into(),
            "--state-dir".into(),
            s(&work.join(format!("n{i}.state"))),
            "--expert-dir-limit".into(),
            budget.to_string(),
            "--replicas".into(),
            b.replicas.to_string(),
            "--peer".into(),
            seeder.peer(),
        ];
        for (j, p) in direct.iter().enumerate() {
            if j != i {
                args.extend(["--peer".into(), p.clone()]);
            }
        }
        args.extend(opts.serve_args.iter().cloned());
        nodes.push(Server::start(
            &c,
            &format!("n{i}"),
            public.clone(),
            *addr,
            &args,
        )?);
    }
    for n in &mut nodes {
        n.ready(Duration::from_secs(120))?;
    }
    log(&format!(
        "{} serving nodes up; waiting for {} copies of every expert",
        nodes.len(),
        b.replicas
    ));
    let until = started + b.coverage_timeout;
    let mut next_log = Instant::now() + Duration::from_secs(10);
    let covered = loop {
        for n in &mut nodes {
            n.alive()?;
        }
        let st = status(&c, &client_dense, &direct)?;
        let min = st["min_copies"].as_u64().unwrap_or(0);
        if min >= u64::from(b.replicas) {
            break st;
        }
        if Instant::now() > until {
            return Err(SwarmError::Failed {
                what: "placement".into(),
                detail: format!(
                    "no {} copies of every expert within {}s; the last status: {st}",
                    b.replicas,
                    b.coverage_timeout.as_secs()
                ),
            });
        }
        if Instant::now() >= next_log {
            next_log += Duration::from_secs(10);
            let kept: u64 = st["nodes"]
                .as_array()
                .map(|v| v.iter().filter_map(|n| n["used"].as_u64()).sum())
                .unwrap_or(0);
            log(&format!(
                "{}s: min copies {min}, {} uncovered by the {}, {} kept in all",
                started.elapsed().as_secs(),
                st["uncovered"].as_array().map_or(0, Vec::len),
                nodes.len(),
                gb(kept)
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let coverage_s = started.elapsed().as_secs_f64();
    let min_copies = covered["min_copies"].as_u64().unwrap_or(0);
    log(&format!(
        "every expert has {min_copies} copies after {coverage_s:.1}s; killing the seeder"
    ));
    seeder.kill();
    let mut placed: Vec<PlacedNode> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let me = covered["nodes"]
                .as_array()
                .and_then(|v| v.iter().find(|x| x["key"].as_str() == Some(n.key.as_str())));
            PlacedNode {
                name: n.name.clone(),
                budget,
                kept_experts: me.and_then(|m| m["kept"].as_u64()),
                kept_bytes: me.and_then(|m| m["used"].as_u64()),
                state_dir_bytes: dir_bytes(&work.join(format!("n{i}.state"))),
                killed: false,
            }
        })
        .collect();

    // The client's links: a relay per node and link shape.
    let relays = |spec: LinkSpec, seed: u64| -> Result<Vec<Relay>, SwarmError> {
        nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                Relay::start(n.addr, spec, seed + i as u64).map_err(|e| SwarmError::Failed {
                    what: format!("starting a relay to {}", n.name),
                    detail: e.to_string(),
                })
            })
            .collect()
    };
    let lan = relays(b.lan, 100)?;
    let wan = relays(b.wan, 200)?;
    let mut runs = Vec::new();
    let peers_via = |relays: &[Relay], live: &[usize]| -> Vec<String> {
        live.iter()
            .map(|&i| format!("{}@{}", nodes[i].key, relays[i].addr()))
            .collect()
    };
    let mut run = |label: String,
                   spec: LinkSpec,
                   peers: Vec<String>,
                   log: &mut dyn FnMut(&str)|
     -> Result<(), SwarmError> {
        let mut args = run_args(&client_dense, &opts.prompt, opts.max_new_tokens);
        let state = work.join(format!("run-{}.state", runs.len()));
        args.extend([
            "--model-id".into(),
            c.model_id.clone(),
            "--key".into(),
            s(&c.client_key),
            "--state-dir".into(),
            s(&state),
        ]);
        if let Some(cache) = &opts.client_cache {
            args.extend(["--expert-cache".into(), cache.clone()]);
        }
        let n_peers = peers.len();
        for p in peers {
            args.extend(["--peer".into(), p]);
        }
        log(&format!("run over {label} links"));
        let name = format!("run-{}", label.replace([',', ' '], "-"));
        let outcome = c
            .spawn_run(&name, &args)?
            .wait(opts.timeout)
            .and_then(|(v, wall)| RunOutcome::from_json(&v, wall));
        let (r, error) = match outcome {
            Ok(r) => (r, None),
            Err(e) => (RunOutcome::default(), Some(e.to_string())),
        };
        let exact = error.is_none() && r.ids == local.ids;
        log(&match &error {
            Some(e) => format!("{label}: FAILED: {e}"),
            None => format!(
                "{label}: prefill {:.1} tok/s, decode {:.1} tok/s, {}",
                r.prefill_tok_s,
                r.decode_tok_s,
                if exact {
                    "token-exact"
                } else {
                    "OUTPUT DIFFERS"
                }
            ),
        });
        runs.push(PlacedRun {
            label,
            link: spec.into(),
            peers: n_peers,
            run: r,
            error,
            token_exact: exact,
        });
        Ok(())
    };
    let all: Vec<usize> = (0..nodes.len()).collect();
    run("lan".into(), b.lan, peers_via(&lan, &all), log)?;
    run("wan".into(), b.wan, peers_via(&wan, &all), log)?;
    let (lan_left, wan_left) = {
        let live: Vec<usize> = (1..nodes.len()).collect();
        (peers_via(&lan, &live), peers_via(&wan, &live))
    };
    // One more node goes.
    let before = status(&c, &client_dense, &direct)?;
    let victim = 0;
    log(&format!("killing {}", nodes[victim].name));
    nodes[victim].kill();
    placed[victim].killed = true;
    let live: Vec<usize> = (0..nodes.len()).filter(|&i| i != victim).collect();
    let killed = format!("{} killed", nodes[victim].name);
    run(format!("lan, {killed}"), b.lan, lan_left, log)?;
    run(format!("wan, {killed}"), b.wan, wan_left, log)?;
    let left: Vec<String> = live.iter().map(|&i| direct[i].clone()).collect();
    let after = status(&c, &client_dense, &left)?;
    for n in &mut nodes {
        n.kill();
    }
    let token_exact = runs.iter().all(|r| r.token_exact);
    Ok(BiggerReport {
        scenario: "bigger-than-disk".into(),
        experts,
        expert_bytes,
        nodes_n: b.nodes,
        replicas: b.replicas,
        budget,
        coverage_s,
        min_copies,
        min_copies_before_kill: before["min_copies"].as_u64(),
        min_copies_after_kill: after["min_copies"].as_u64(),
        uncovered_after_kill: after["uncovered"].as_array().map(|v| v.len() as u64),
        pull_s,
        dense_bytes,
        nodes: placed,
        local,
        runs,
        token_exact,
        links_note: "the client's link to each serving node is shaped (a relay per node); \
                     placement traffic between the nodes and from the seeder is loopback, \
                     unshaped"
            .into(),
    })
}

fn gb(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

impl BiggerReport {
    /// A table for people.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "scenario bigger-than-disk: {} serving nodes, none holding the model; {} experts of \
             {} in all, {} of budget each ({:.0}% of the model), --replicas {}; dense folders \
             of {} pulled in {:.1} s",
            self.nodes_n,
            self.experts,
            gb(self.expert_bytes),
            gb(self.budget),
            self.budget as f64 * 100.0 / self.expert_bytes.max(1) as f64,
            self.replicas,
            gb(self.dense_bytes),
            self.pull_s
        );
        let _ = writeln!(
            o,
            "  coverage: min copies {} after {:.1} s (the seeder then killed); {} before one more \
             node was killed; after: min copies {}, {} uncovered",
            self.min_copies,
            self.coverage_s,
            self.min_copies_before_kill
                .map_or_else(|| "?".into(), |v| v.to_string()),
            self.min_copies_after_kill
                .map_or_else(|| "?".into(), |v| v.to_string()),
            self.uncovered_after_kill
                .map_or_else(|| "?".into(), |v| v.to_string()),
        );
        let _ = writeln!(
            o,
            "  {:<4} {:>8} {:>12} {:>12} {:>12}  ",
            "node", "experts", "kept", "state dir", "budget"
        );
        for n in &self.nodes {
            let _ = writeln!(
                o,
                "  {:<4} {:>8} {:>12} {:>12} {:>12}  {}",
                n.name,
                n.kept_experts.map_or_else(|| "?".into(), |v| v.to_string()),
                n.kept_bytes.map_or_else(|| "?".into(), gb),
                gb(n.state_dir_bytes),
                gb(n.budget),
                if n.killed { "killed" } else { "" }
            );
        }
        let _ = writeln!(
            o,
            "  {:<16} {:>10} {:>10} {:>8} {:>11} {:>10} {:>9}  exact",
            "run", "prefill", "decode", "wall", "peer loads", "peer data", "failures"
        );
        let rows = std::iter::once(("local".to_string(), &self.local, true, None)).chain(
            self.runs
                .iter()
                .map(|r| (r.label.clone(), &r.run, r.token_exact, r.error.as_deref())),
        );
        for (label, r, exact, error) in rows {
            if let Some(e) = error {
                let first = e.lines().next().unwrap_or_default();
                let _ = writeln!(o, "  {label:<16} FAILED: {first}");
                continue;
            }
            let _ = writeln!(
                o,
                "  {:<16} {:>6.1} t/s {:>6.1} t/s {:>7.1}s {:>11} {:>10} {:>9}  {}",
                label,
                r.prefill_tok_s,
                r.decode_tok_s,
                r.wall_s,
                r.peer_loads,
                gb(r.peer_bytes),
                r.peer_failures,
                if exact { "yes" } else { "NO" }
            );
        }
        if let (Some(l), Some(w)) = (self.runs.first(), self.runs.get(1)) {
            let link = |j: &LinkJson| {
                format!(
                    "{:.2} ms, {}, loss {:.2}%",
                    j.delay_ms,
                    j.bandwidth_bytes_s.map_or_else(
                        || "unlimited".into(),
                        |b| format!("{:.0} Mbit/s", b as f64 * 8.0 / 1e6)
                    ),
                    j.loss * 100.0
                )
            };
            let _ = writeln!(o, "  links: lan {}; wan {}", link(&l.link), link(&w.link));
        }
        let _ = writeln!(o, "  ({})", self.links_note);
        let _ = write!(
            o,
            "  token-exact: {} ({} ids)",
            if self.token_exact { "yes" } else { "NO" },
            self.local.ids.len()
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_below_the_model_and_enough_for_the_copies() {
        let b = budget_for(1000, 10, 4, 2).unwrap();
        assert_eq!(b, 750);
        assert!(b * 4 >= 2 * 1000);
        // 2 copies over 2 nodes would need the whole model on each.
        assert!(budget_for(1000, 10, 2, 2)
            .unwrap_err()
            .to_string()
            .contains("--nodes"));
        // A budget that cannot hold the largest expert.
        assert!(budget_for(1000, 800, 4, 2).is_err());
        assert_eq!(budget_for(1000, 10, 10, 3).unwrap(), 450);
    }
}
