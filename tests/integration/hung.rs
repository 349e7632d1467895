//! Issue 58 item 4, from outside: a holder hung (SIGSTOP) or killed (SIGKILL) for good in the
//! middle of a run, while a second holder has every expert, costs a hedge, not time-outs. Two
//! `stormo serve` processes hold a synthesized model; `stormo run --no-local-experts` with both
//! as `--peer` generates 24 tokens, executing remotely (`--remote-exec always`) or fetching
//! (`never`, at the smallest RAM cache so that every token fetches), and one holder is sent the
//! signal once the sixth id is printed. The ids must be the run's without a fault, and the time
//! from the sixth id to the last may exceed the same run's without a fault (measured in the
//! same test, on the same holders) by less than the 2 s.
//!
//! A sole holder killed after the sixth id and restarted on the same port with the same key
//! [`RESTART_AFTER`] later costs under 2 s beyond its restart: the run's tail exceeds the
//! no-fault run's by less than 2 s plus the time the holder was away (from the kill to the
//! restarted process printing its address, i.e. listening again).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::demo::stormo_exe;
use crate::node::{s, stormo};

/// Tokens generated per run, and the id after which the fault comes.
const TOKENS: usize = 24;
const FAULT_AFTER: usize = 6;

/// What the issue allows a fault to cost.
const MAX_LOST: Duration = Duration::from_secs(2);

/// A synthesized GPT-OSS model (4 layers of 32 experts, 512 wide: about 100 MB, experts of
/// about 0.8 MB) with its manifest built there, and its model id.
fn model() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = s(dir.path()).to_string();
    crate::demo::synth(&[
        "--layers",
        "4",
        "--hidden",
        "512",
        "--intermediate",
        "512",
        "--vocab",
        "4096",
        "--seed",
        "58",
        "--out",
        &out,
    ])
    .expect("stormo synth writes the model");
    let built = stormo(&["manifest", "build", "--model", &out, "--io", "buffered"]);
    let id = built
        .split_whitespace()
        .find(|w| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("manifest build printed no model id: {built}"))
        .to_string();
    (dir, id)
}

/// How long a restarted holder stays away before it is started again.
const RESTART_AFTER: Duration = Duration::from_secs(2);

/// A `stormo serve` process holding the model, and its `KEY@ADDR`; killed (after a SIGCONT,
/// should it be stopped) when dropped.
struct Holder {
    child: Child,
    line: String,
    _state: Option<tempfile::TempDir>,
}

impl Holder {
    fn start(model: &Path) -> Self {
        let state = tempfile::tempdir().expect("state dir");
        let mut h = Self::start_in(model, state.path(), None, "127.0.0.1:0");
        h._state = Some(state);
        h
    }

    /// A holder with its state in `state`, with the secret key in `key` if given, listening
    /// on `listen`.
    fn start_in(model: &Path, state: &Path, key: Option<&Path>, listen: &str) -> Self {
        let mut cmd = Command::new(stormo_exe());
        cmd.args(["serve", "--model", s(model), "--listen", listen])
            .args(["--allow-any", "--no-hot-store", "--state-dir", s(state)]);
        if let Some(k) = key {
            cmd.args(["--key", s(k)]);
        }
        let mut child = cmd
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("stormo serve starts");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let _ = out.read_line(&mut line);
        // Keep draining stdout so that it never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut rest = Vec::new();
            let _ = out.read_to_end(&mut rest);
        });
        let line = line.trim().to_string();
        assert!(line.contains('@'), "stormo serve printed {line:?}");
        Self {
            child,
            line,
            _state: None,
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill {sig} failed");
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One run's ids, the time from the [`FAULT_AFTER`]th id to the last, and the longest wait
/// between two ids after the [`FAULT_AFTER`]th.
struct Run {
    ids: Vec<u64>,
    tail: Duration,
    gap: Duration,
    stderr: String,
}

/// `stormo run --no-local-experts` of [`TOKENS`] ids from `holders` with `--remote-exec
/// mode`; `fault` is called once the [`FAULT_AFTER`]th id is printed.
fn run(model: &Path, id: &str, holders: &[&Holder], mode: &str, fault: impl FnOnce()) -> Run {
    let state = tempfile::tempdir().expect("state dir");
    let n = TOKENS.to_string();
    let mut cmd = Command::new(stormo_exe());
    cmd.args(["run", "--model", s(model), "--no-local-experts"])
        .args(["--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", &n])
        .args([
            "--state-dir",
            s(state.path()),
            "--expert-cache",
            "0",
            "--no-keep",
        ])
        .args([
            "--model-id",
            id,
            "--remote-exec",
            mode,
            "--exec-trust",
            "any",
        ]);
    for h in holders {
        cmd.args(["--peer", &h.line]);
    }
    let mut child = cmd
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("stormo run starts");
    let mut err = child.stderr.take().expect("stderr");
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    // Ids come as they are made, separated by spaces, flushed after each.
    let mut out = child.stdout.take().expect("stdout");
    let (mut ids, mut stamps, mut word) = (Vec::new(), Vec::new(), String::new());
    let mut fault = Some(fault);
    let mut byte = [0u8; 1];
    while out.read(&mut byte).is_ok_and(|n| n == 1) {
        let c = char::from(byte[0]);
        if c.is_ascii_digit() {
            word.push(c);
            continue;
        }
        if word.is_empty() {
            continue;
        }
        stamps.push(Instant::now());
        ids.push(word.parse::<u64>().expect("an id"));
        word.clear();
        if ids.len() == FAULT_AFTER {
            if let Some(f) = fault.take() {
                f();
            }
        }
    }
    let status = child.wait().expect("stormo run ends");
    let stderr = stderr.join().expect("stderr thread");
    assert!(status.success(), "stormo run failed ({status}): {stderr}");
    assert_eq!(ids.len(), TOKENS, "{ids:?}: {stderr}");
    let gap = stamps[FAULT_AFTER - 1..]
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    Run {
        tail: stamps[TOKENS - 1] - stamps[FAULT_AFTER - 1],
        gap,
        ids,
        stderr,
    }
}

/// Each mode, with a fresh pair of holders: the run without a fault, then the same run with
/// one holder sent `sig` after the [`FAULT_AFTER`]th id.
fn one_holder_lost(sig: &str) {
    let (dir, id) = model();
    for mode in ["always", "never"] {
        let (a, b) = (Holder::start(dir.path()), Holder::start(dir.path()));
        let base = run(dir.path(), &id, &[&a, &b], mode, || {});
        let hit = run(dir.path(), &id, &[&a, &b], mode, || a.signal(sig));
        let lost = hit.tail.saturating_sub(base.tail);
        eprintln!(
            "{mode} {sig}: ids {FAULT_AFTER}..{TOKENS} took {:.2}s, {:.2}s without the fault \
             ({:.2}s lost)",
            hit.tail.as_secs_f64(),
            base.tail.as_secs_f64(),
            lost.as_secs_f64()
        );
        assert_eq!(hit.ids, base.ids, "{mode} {sig}: {}", hit.stderr);
        assert!(
            lost < MAX_LOST,
            "{mode} {sig}: the fault cost {lost:?} ({:?} against {:?}): {}",
            hit.tail,
            base.tail,
            hit.stderr
        );
    }
}

/// A holder stopped for good (SIGSTOP) mid-run, the other holding every expert: exact, under
/// 2 s lost, executing and fetching.
#[test]
fn fault_a_holder_hung_mid_run_costs_under_two_seconds() {
    one_holder_lost("-STOP");
}

/// A holder killed (SIGKILL) mid-run, the other holding every expert: exact, under 2 s lost,
/// executing and fetching.
#[test]
fn fault_a_holder_killed_mid_run_costs_under_two_seconds() {
    one_holder_lost("-KILL");
}

/// A sole holder killed (SIGKILL) after the [`FAULT_AFTER`]th id and started again on the same
/// port with the same key [`RESTART_AFTER`] later, executing and fetching: exact, and under
/// 2 s lost beyond the time it was away (from the kill to the restarted holder listening). A
/// fetch whose answer stalls mid-stream owes data from the last datagram heard, so its silent
/// link is probed and replaced by the restarted holder's (before, it waited out
/// `SILENT_CONNECTION`: about 3.6 s beyond the restart).
#[test]
fn fault_a_sole_holder_restarted_mid_run_costs_under_two_seconds_beyond_its_restart() {
    let (dir, id) = model();
    for mode in ["always", "never"] {
        let state = tempfile::tempdir().expect("state dir");
        let key = state.path().join("node.key");
        stormo(&["key", "generate", "--out", s(&key)]);
        let a = Holder::start_in(dir.path(), state.path(), Some(&key), "127.0.0.1:0");
        let addr = a
            .line
            .rsplit_once('@')
            .map(|(_, addr)| addr.to_string())
            .unwrap_or_else(|| panic!("no address in {:?}", a.line));
        let base = run(dir.path(), &id, &[&a], mode, || {});
        let restarted = std::sync::Mutex::new(None);
        let hit = run(dir.path(), &id, &[&a], mode, || {
            let killed = Instant::now();
            a.signal("-KILL");
            let (model, state, key, addr) = (
                dir.path().to_path_buf(),
                state.path().to_path_buf(),
                key.clone(),
                addr.clone(),
            );
            *restarted.lock().expect("lock") = Some(std::thread::spawn(move || {
                std::thread::sleep(RESTART_AFTER);
                let b = Holder::start_in(&model, &state, Some(&key), &addr);
                (b, killed.elapsed())
            }));
        });
        let (b, away) = restarted
            .into_inner()
            .expect("lock")
            .expect("the fault came")
            .join()
            .expect("the holder restarted");
        assert_eq!(b.line, a.line, "restarted on another port or key");
        let lost = hit.tail.saturating_sub(base.tail);
        let beyond = lost.saturating_sub(away);
        eprintln!(
            "{mode} sole holder restarted (away {:.2}s): ids {FAULT_AFTER}..{TOKENS} took \
             {:.2}s, {:.2}s without the fault ({:.2}s lost, {:.2}s beyond the restart); the \
             longest wait for an id {:.2}s, {:.2}s without the fault",
            away.as_secs_f64(),
            hit.tail.as_secs_f64(),
            base.tail.as_secs_f64(),
            lost.as_secs_f64(),
            beyond.as_secs_f64(),
            hit.gap.as_secs_f64(),
            base.gap.as_secs_f64()
        );
        assert_eq!(hit.ids, base.ids, "{mode} restart: {}", hit.stderr);
        assert!(
            beyond < MAX_LOST,
            "{mode} restart: the fault cost {lost:?} with the holder away {away:?} ({:?} \
             against {:?}): {}",
            hit.tail,
            base.tail,
            hit.stderr
        );
        drop(b);
    }
}
