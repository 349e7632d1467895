//! `stormo sim --scenario faults`: the fault matrix of issue 40 against real processes.
//!
//! Each case starts `stormo serve` processes on 127.0.0.1 (behind the cluster's relays),
//! injects one fault while a `stormo run` with no local experts generates from them, and
//! judges the run: either its ids equal a local run's ("exact"), or it ends with an error that
//! names the peer to blame ("clear error"), each within the run's timeout. The cases:
//!
//! - a holder killed (SIGKILL) while it sends, another holder left;
//! - a holder stopped (SIGSTOP) while it sends and resumed 3 s later, another holder left;
//! - the only holder killed while it sends and restarted on the same port a second later;
//! - a holder stopped for good (SIGSTOP, never resumed during the run) while it sends,
//!   another holder left: fetching, and executing remotely (`--remote-exec always`);
//! - a holder that serves corrupt bytes (a copy of the model with a byte of every expert
//!   flipped) ahead of an honest one;
//! - the same corrupt holder asked to *execute* experts (`--remote-exec always --spot-check
//!   0`, the liar of issue 58): beside an honest holder (exact), and alone (it runs none of
//!   its corrupt experts and serves none of their bytes: a clear error);
//! - the only holder does not admit the client's key;
//! - a holder at `--expert-cache 0` under several concurrent clients.
//!
//! Not here: a peer that announces experts it then does not serve (wrong inventory) or sends
//! hostile frames. `stormo serve` cannot be made to lie, so those need the scripted peer of
//! the integration tests (`tests/integration/faults.rs`, `hostile.rs`), which run them
//! in-process.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use super::cluster::{Cluster, NodeSpec, RunningClient};
use super::{expert_shape, run_args, Reaper, RunOutcome, SwarmError, SwarmOptions};

/// What a case should end in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Expect {
    /// The local run's ids.
    Exact,
    /// A failed run whose error names the peer.
    ClearError,
}

/// One row of the fault matrix.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultRow {
    /// The case.
    pub case: String,
    /// What it should end in.
    pub expect: Expect,
    /// What it ended in: `exact`, `clear error`, or what went wrong instead.
    pub outcome: String,
    /// Whether the outcome is the expected one.
    pub ok: bool,
    /// Seconds from the (first) client's start to the end of the last.
    pub secs: f64,
    /// What happened: the fault's timing, peer failures, the error.
    pub detail: String,
}

/// The fault matrix's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultReport {
    /// The reference run, every expert local.
    pub local: RunOutcome,
    /// One row per case.
    pub rows: Vec<FaultRow>,
}

impl FaultReport {
    /// Whether every case ended as it should.
    pub fn all_ok(&self) -> bool {
        self.rows.iter().all(|r| r.ok)
    }

    /// A table for people.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let w = self.rows.iter().map(|r| r.case.len()).max().unwrap_or(4);
        let _ = writeln!(
            o,
            "fault matrix: real `stormo serve` processes on 127.0.0.1, {} ids per run",
            self.local.ids.len()
        );
        let _ = writeln!(
            o,
            "  {:<w$}  {:<11}  {:<11}  {:>7}  detail",
            "case", "expected", "outcome", "time"
        );
        for r in &self.rows {
            let expect = match r.expect {
                Expect::Exact => "exact",
                Expect::ClearError => "clear error",
            };
            let _ = writeln!(
                o,
                "  {:<w$}  {:<11}  {:<11}  {:>6.1}s  {}",
                r.case,
                expect,
                if r.ok { &r.outcome } else { "FAILED" },
                r.secs,
                if r.ok {
                    r.detail.clone()
                } else {
                    format!("{}: {}", r.outcome, r.detail)
                }
            );
        }
        let bad = self.rows.iter().filter(|r| !r.ok).count();
        let _ = write!(
            o,
            "  {} of {} cases as expected",
            self.rows.len() - bad,
            self.rows.len()
        );
        o
    }
}

/// How one `stormo run` ended: its `--json` output and wall seconds, or why it failed.
type RunResult = Result<(serde_json::Value, f64), SwarmError>;

/// What the fault cases share.
struct Bench<'a> {
    c: Cluster,
    opts: &'a SwarmOptions,
    local: RunOutcome,
    /// Bytes of one expert (on average).
    one_expert: u64,
    /// The client's `stormo run` arguments without its peers.
    client: Vec<String>,
    /// More arguments for the current case.
    extra: Vec<String>,
}

/// A fault injected while a run goes on, once the victim has sent `after` bytes.
enum Fault {
    /// SIGKILL.
    Kill,
    /// SIGSTOP, then SIGCONT after the pause.
    Stop(Duration),
    /// SIGKILL, then a start on the same port after the pause.
    Restart(Duration),
}

impl Bench<'_> {
    fn node(&mut self, spec: NodeSpec) -> Result<usize, SwarmError> {
        let link = self.opts.link.unwrap_or_else(super::LinkSpec::lan);
        self.c.add_node_with(spec, link)
    }

    fn all() -> NodeSpec {
        NodeSpec::default()
    }

    fn args(&self, peers: &[usize]) -> Vec<String> {
        let mut a = self.client.clone();
        a.extend(self.c.peer_args(peers.iter().copied()));
        a.extend(self.extra.iter().cloned());
        a
    }

    /// Judges a finished run against `expect`, naming `blame` (a node) in a clear error.
    fn judge(
        &self,
        case: &str,
        expect: Expect,
        runs: Vec<RunResult>,
        started: Instant,
        blame: Option<usize>,
        mut detail: Vec<String>,
    ) -> FaultRow {
        let secs = started.elapsed().as_secs_f64();
        let mut outcomes: Vec<String> = Vec::new();
        for r in runs {
            let this = match r {
                Ok((v, wall)) => match RunOutcome::from_json(&v, wall) {
                    Ok(o) if o.ids == self.local.ids => {
                        detail.push(format!(
                            "{} peer loads, {} failures",
                            o.peer_loads, o.peer_failures
                        ));
                        "exact".to_string()
                    }
                    Ok(o) => format!("ids differ: {:?}", o.ids),
                    Err(e) => format!("unreadable output: {e}"),
                },
                Err(e) => {
                    let text = e.to_string();
                    // The run's own error (`stormo` ends on an `error: ` line), not the warnings
                    // logged before it.
                    let error = text
                        .lines()
                        .rev()
                        .find(|l| l.starts_with("error: "))
                        .unwrap_or("");
                    // The node to blame, or for a case that expects no error, any node.
                    let named = match blame {
                        Some(i) => error.contains(&self.c.nodes[i].public[..8]),
                        None => self.c.nodes.iter().any(|n| error.contains(&n.public[..8])),
                    };
                    detail.push(error.chars().take(300).collect());
                    if named {
                        "clear error".to_string()
                    } else {
                        "an error that names no peer".to_string()
                    }
                }
            };
            if !outcomes.contains(&this) {
                outcomes.push(this);
            }
        }
        // One outcome when every run ended alike, else each kind seen.
        let outcome = outcomes.join(", then ");
        let ok = match expect {
            Expect::Exact => outcome == "exact",
            Expect::ClearError => outcome == "clear error",
        } && !outcomes.is_empty();
        FaultRow {
            case: case.into(),
            expect,
            outcome,
            ok,
            secs,
            detail: detail.join("; "),
        }
    }

    /// Runs the client against `peers`, injecting `fault` into node `victim` once it has
    /// sent half an expert. Returns the run's result and what happened.
    fn run_with_fault(
        &mut self,
        name: &str,
        peers: &[usize],
        victim: usize,
        fault: Fault,
    ) -> Result<(RunResult, Vec<String>), SwarmError> {
        let args = self.args(peers);
        let mut client = self.c.spawn_run(name, &args)?;
        let before = self.c.nodes[victim].link().down_bytes;
        let mut events = Vec::new();
        let mut hit: Option<Instant> = None;
        let mut undone = false;
        let timeout = self.opts.timeout;
        while !client.finished() && client.started.elapsed() <= timeout {
            let t = client.started.elapsed().as_secs_f64();
            let sent = self.c.nodes[victim].link().down_bytes - before;
            if hit.is_none() && sent > self.one_expert / 2 {
                hit = Some(Instant::now());
                let what = match fault {
                    Fault::Kill | Fault::Restart(_) => {
                        self.c.kill(victim);
                        "killed (SIGKILL)"
                    }
                    Fault::Stop(_) => {
                        self.c.pause(victim);
                        "stopped (SIGSTOP)"
                    }
                };
                events.push(format!("{what} at {t:.1}s after {sent} bytes"));
            }
            if let (Some(h), false) = (hit, undone) {
                match fault {
                    Fault::Stop(d) if h.elapsed() >= d => {
                        self.c.resume(victim);
                        undone = true;
                        events.push(format!("resumed at {t:.1}s"));
                    }
                    Fault::Restart(d) if h.elapsed() >= d => {
                        self.c.start(victim)?;
                        undone = true;
                        events.push(format!("restarted on the same port at {t:.1}s"));
                    }
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if hit.is_none() {
            events.push("the run ended before the victim had sent half an expert".into());
        }
        if let (Some(_), false, Fault::Stop(_)) = (hit, undone, &fault) {
            self.c.resume(victim);
        }
        let r = client.wait(timeout);
        if hit.is_none() {
            return Ok((
                Err(SwarmError::Failed {
                    what: "the fault".into(),
                    detail: "not injected: the run was too short (give more --max-new-tokens)"
                        .into(),
                }),
                events,
            ));
        }
        Ok((r, events))
    }

    /// Kills every node (the next case starts its own).
    fn clear(&mut self) {
        for i in 0..self.c.nodes.len() {
            self.c.kill(i);
        }
    }
}

/// A copy of `model` in `dir` with one byte of every expert's first tensor flipped: it still
/// has the sizes of the manifest's records, but no record's hash.
fn corrupt_copy(model: &Path, dir: &Path) -> Result<(), SwarmError> {
    std::fs::create_dir_all(dir).map_err(|e| SwarmError::io(dir, e))?;
    for e in std::fs::read_dir(model).map_err(|e| SwarmError::io(model, e))? {
        let e = e.map_err(|e| SwarmError::io(model, e))?;
        if e.path().is_file() {
            let to = dir.join(e.file_name());
            std::fs::copy(e.path(), &to).map_err(|err| SwarmError::io(&to, err))?;
        }
    }
    let files = stormo_engine::ModelFiles::open(dir)
        .map_err(|e| SwarmError::Model(format!("the corrupt copy: {e}")))?;
    let mut edits = Vec::new();
    for layer in &files.layout.parts {
        for parts in layer {
            if let Some(p) = parts.first() {
                edits.push((
                    files.layout.files[p.loc.file].0.clone(),
                    p.loc.offset + p.loc.len / 2,
                ));
            }
        }
    }
    drop(files);
    for (path, off) in edits {
        let mut b = std::fs::read(&path).map_err(|e| SwarmError::io(&path, e))?;
        if let Some(x) = usize::try_from(off).ok().and_then(|o| b.get_mut(o)) {
            *x ^= 0x5a;
        }
        std::fs::write(&path, b).map_err(|e| SwarmError::io(&path, e))?;
    }
    Ok(())
}

/// Runs the fault matrix with `clients` concurrent clients in the tiny-cache case, reporting
/// progress through `log`. Every process it starts is gone when it returns.
pub fn run_faults(
    opts: &SwarmOptions,
    clients: usize,
    log: &mut dyn FnMut(&str),
    reaper_out: Option<&dyn Fn(Reaper)>,
) -> Result<FaultReport, SwarmError> {
    let (n_experts, n_layers, expert_bytes) = expert_shape(&opts.model)?;
    let one_expert = expert_bytes / (n_layers * n_experts).max(1) as u64;
    let work = opts.work.join("faults");
    log("faults: the fault matrix against real processes");
    let mut c = Cluster::prepare(&opts.exe, &opts.model, &work)?;
    c.serve_args = opts.serve_args.clone();
    if let Some(f) = reaper_out {
        f(c.reaper());
    }
    let base = run_args(&opts.model, &opts.prompt, opts.max_new_tokens);
    log("local run (every expert from this disk)");
    let (v, wall) = c.spawn_run("local", &base)?.wait(opts.timeout)?;
    let local = RunOutcome::from_json(&v, wall)?;
    let mut client = base;
    client.extend([
        "--key".into(),
        c.client_key.to_string_lossy().into_owned(),
        "--manifest".into(),
        c.manifest.to_string_lossy().into_owned(),
        "--trust".into(),
        c.publisher.clone(),
        "--no-local-experts".into(),
        // Experts keep moving through the run.
        "--expert-cache".into(),
        opts.client_cache
            .clone()
            .unwrap_or_else(|| (expert_bytes / 4).max(1).to_string()),
        // The default silence deadline (5 s), and a connect timeout (3 s) that a busy machine
        // running many processes at once still meets; longer for big experts.
        "--peer-timeout".into(),
        format!("{:.1}", (one_expert as f64 / 2e6).max(5.0)),
    ]);
    let mut b = Bench {
        c,
        opts,
        local,
        one_expert,
        client,
        extra: Vec::new(),
    };
    let mut rows = Vec::new();
    let mut done = |row: FaultRow, log: &mut dyn FnMut(&str)| {
        log(&format!(
            "{}: {} in {:.1}s ({})",
            row.case, row.outcome, row.secs, row.detail
        ));
        rows.push(row);
    };

    for (name, case, fault) in [
        (
            "killed",
            "holder killed while sending, another left",
            Fault::Kill,
        ),
        (
            "stopped",
            "holder stopped while sending, resumed after 3 s",
            Fault::Stop(Duration::from_secs(3)),
        ),
    ] {
        log(case);
        let victim = b.node(Bench::all())?;
        let other = b.node(Bench::all())?;
        let t = Instant::now();
        let (r, ev) = b.run_with_fault(name, &[victim, other], victim, fault)?;
        done(b.judge(case, Expect::Exact, vec![r], t, None, ev), log);
        b.clear();
    }

    // Hung for good: stopped and never resumed while the run lasts (resumed after it).
    let exec = ["--remote-exec", "always", "--exec-trust", "any"].map(String::from);
    for (name, case, extra) in [
        (
            "hung",
            "holder stopped for good while sending, another left",
            &[][..],
        ),
        (
            "hung-exec",
            "holder stopped for good while executing (--remote-exec always), another left",
            &exec[..],
        ),
    ] {
        log(case);
        b.extra = extra.to_vec();
        let victim = b.node(Bench::all())?;
        let other = b.node(Bench::all())?;
        let t = Instant::now();
        let forever = Fault::Stop(Duration::from_secs(24 * 3600));
        let (r, ev) = b.run_with_fault(name, &[victim, other], victim, forever)?;
        done(b.judge(case, Expect::Exact, vec![r], t, None, ev), log);
        b.extra.clear();
        b.clear();
    }

    let case = "sole holder killed while sending, restarted on the same port 1 s later";
    log(case);
    let sole = b.node(Bench::all())?;
    let t = Instant::now();
    let (r, ev) = b.run_with_fault(
        "restarted",
        &[sole],
        sole,
        Fault::Restart(Duration::from_secs(1)),
    )?;
    done(b.judge(case, Expect::Exact, vec![r], t, None, ev), log);
    b.clear();

    let case = "corrupt bytes from the first of two holders";
    log(case);
    let bad_model = work.join("corrupt-model");
    corrupt_copy(&opts.model, &bad_model)?;
    let liar = b.node(NodeSpec {
        model: Some(bad_model.clone()),
        ..NodeSpec::default()
    })?;
    let honest = b.node(Bench::all())?;
    let t = Instant::now();
    let r =
        b.c.spawn_run("corrupt", &b.args(&[liar, honest]))?
            .wait(opts.timeout);
    done(
        b.judge(case, Expect::Exact, vec![r], t, None, Vec::new()),
        log,
    );
    b.clear();

    // The liar of issue 58: the corrupt holder asked to compute, with no spot-check after
    // its first answer. It checks each expert against the manifest before it runs it.
    b.extra = exec.to_vec();
    b.extra.extend(["--spot-check".into(), "0".into()]);
    for (name, alone) in [("corrupt-exec", false), ("corrupt-exec-alone", true)] {
        let case = if alone {
            "a corrupt holder asked to execute (--spot-check 0), alone"
        } else {
            "a corrupt holder asked to execute (--spot-check 0), beside an honest one"
        };
        log(case);
        let liar = b.node(NodeSpec {
            model: Some(bad_model.clone()),
            ..NodeSpec::default()
        })?;
        let peers = if alone {
            vec![liar]
        } else {
            vec![liar, b.node(Bench::all())?]
        };
        let t = Instant::now();
        let r = b.c.spawn_run(name, &b.args(&peers))?.wait(opts.timeout);
        let (expect, blame) = if alone {
            (Expect::ClearError, Some(liar))
        } else {
            (Expect::Exact, None)
        };
        done(b.judge(case, expect, vec![r], t, blame, Vec::new()), log);
        b.clear();
    }
    b.extra.clear();

    let case = "the only holder does not admit the client's key";
    log(case);
    let refusing = b.node(NodeSpec {
        allow: Some(b.c.publisher.clone()),
        ..NodeSpec::default()
    })?;
    let t = Instant::now();
    let r =
        b.c.spawn_run("unknown-key", &b.args(&[refusing]))?
            .wait(opts.timeout);
    done(
        b.judge(
            case,
            Expect::ClearError,
            vec![r],
            t,
            Some(refusing),
            Vec::new(),
        ),
        log,
    );
    b.clear();

    let case = format!("holder at --expert-cache 0, {clients} concurrent clients");
    log(&case);
    let tiny = b.node(NodeSpec {
        args: vec!["--expert-cache".into(), "0".into()],
        ..NodeSpec::default()
    })?;
    let t = Instant::now();
    let running: Vec<RunningClient> = (0..clients.max(1))
        .map(|k| b.c.spawn_run(&format!("tiny-cache-{k}"), &b.args(&[tiny])))
        .collect::<Result<_, _>>()?;
    let runs = running.into_iter().map(|r| r.wait(opts.timeout)).collect();
    done(
        b.judge(&case, Expect::Exact, runs, t, None, Vec::new()),
        log,
    );
    b.clear();

    Ok(FaultReport {
        local: b.local,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ok: bool) -> FaultRow {
        FaultRow {
            case: "a case".into(),
            expect: Expect::Exact,
            outcome: if ok {
                "exact".into()
            } else {
                "ids differ: [1]".into()
            },
            ok,
            secs: 1.5,
            detail: "d".into(),
        }
    }

    #[test]
    fn the_table_names_failed_cases_and_counts_them() {
        let r = FaultReport {
            local: RunOutcome::default(),
            rows: vec![row(true), row(false)],
        };
        assert!(!r.all_ok());
        let t = r.table();
        assert!(t.contains("FAILED") && t.contains("ids differ: [1]"), "{t}");
        assert!(t.contains("1 of 2 cases as expected"), "{t}");
    }
}
