//! The Node as users run it: `stormo serve` processes that serve and fetch, re-serve what they
//! fetched, put a model whose experts are elsewhere behind the OpenAI API and `chat`, and never
//! write to the model folder. Loopback only; every process is killed when its guard drops.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use crate::demo::stormo_exe;

/// A `stormo` process, killed (and waited for) when dropped.
pub(crate) struct Proc {
    child: Child,
    /// The first line it printed on stdout (`KEY@ADDR` or `http://ADDR/v1`).
    pub(crate) line: String,
    /// What it wrote to stderr so far, when started with [`Proc::start_logging`].
    pub(crate) stderr: Arc<Mutex<String>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Starts `stormo ARGS` and waits (bounded) for its first line on stdout.
    pub(crate) fn start(args: &[&str]) -> Self {
        Self::start_logging(args, None)
    }

    /// [`Proc::start`] with `RUST_LOG=log`, its stderr kept in [`Proc::stderr`] (and echoed),
    /// when `log` is given.
    pub(crate) fn start_logging(args: &[&str], log: Option<&str>) -> Self {
        let mut child = Command::new(stormo_exe())
            .args(args)
            .env("RUST_LOG", log.unwrap_or("warn"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if log.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("start stormo");
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(err) = child.stderr.take() {
            let keep = stderr.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(err);
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    eprint!("{line}");
                    keep.lock().expect("stderr lock").push_str(&line);
                    line.clear();
                }
            });
        }
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
            // Keep reading so the process never blocks on a full pipe.
            let mut rest = String::new();
            while r.read_line(&mut rest).is_ok_and(|n| n > 0) {
                rest.clear();
            }
        });
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if !l.trim().is_empty() => l.trim().to_string(),
            other => {
                let _ = child.kill();
                panic!("stormo {args:?} printed no address within 60 s ({other:?})");
            }
        };
        Self {
            child,
            line,
            stderr,
        }
    }

    /// Stops it with SIGTERM and returns its exit status (bounded: killed after 20 s).
    pub(crate) fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                return s;
            }
            assert!(
                Instant::now() < until,
                "stormo did not stop within 20 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Runs `stormo ARGS` to its end (bounded) and returns its stdout; panics with its stderr on
/// failure.
pub(crate) fn stormo(args: &[&str]) -> String {
    stormo_with_input(args, None)
}

fn stormo_with_input(args: &[&str], input: Option<&str>) -> String {
    let out = stormo_output(args, input);
    assert!(
        out.status.success(),
        "stormo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Runs `stormo ARGS` (with `input` on its stdin) to its end, bounded, however it ends.
pub(crate) fn stormo_output(args: &[&str], input: Option<&str>) -> std::process::Output {
    let mut child = Command::new(stormo_exe())
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run stormo");
    if let Some(text) = input {
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(text.as_bytes()).expect("write stdin");
    }
    wait_bounded(child, Duration::from_secs(180))
}

/// Waits for `child` to end, at most `within` (then kills it and panics with its stderr).
/// Its output is read while it runs, so a child that writes more than a pipe holds is not
/// stopped by a full pipe.
fn wait_bounded(mut child: Child, within: Duration) -> std::process::Output {
    fn drain(r: Option<impl std::io::Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    }
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let until = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            let err = err.join().unwrap_or_default();
            panic!(
                "stormo ran over {within:?}: {}",
                String::from_utf8_lossy(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}

/// A chattable synthetic model (2 layers, 4 experts) with its manifest; returns the folder and
/// the model id.
pub(crate) fn model_with_manifest() -> (tempfile::TempDir, String) {
    let dir = crate::http::synth_model();
    let m = dir.path().to_str().expect("utf-8");
    let out = stormo(&["manifest", "build", "--model", m, "--io", "buffered"]);
    let id = out
        .split_whitespace()
        .find(|w| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("manifest build printed no model id: {out}"))
        .to_string();
    (dir, id)
}

/// A state directory for one node.
pub(crate) fn state() -> tempfile::TempDir {
    tempfile::tempdir().expect("state dir")
}

pub(crate) fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The arguments of `stormo serve --listen` on loopback admitting anyone, at an expert cache
/// of `budget`.
pub(crate) fn serve_args<'a>(model: &'a Path, st: &'a Path, budget: &'a str) -> Vec<&'a str> {
    vec![
        "serve",
        "--model",
        s(model),
        "--listen",
        "127.0.0.1:0",
        "--allow-any",
        "--state-dir",
        s(st),
        "--expert-cache",
        budget,
    ]
}

/// [`serve_args`] at the smallest budget, with `extra` options.
pub(crate) fn serve(model: &Path, st: &Path, extra: &[&str]) -> Proc {
    let mut args = serve_args(model, st, "0");
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// `stormo pull` of the dense weights only, from `peer`.
fn pull_dense(peer: &str, id: &str) -> tempfile::TempDir {
    let out = tempfile::tempdir().expect("pull dir");
    stormo(&[
        "pull",
        "--peer",
        peer,
        "--model-id",
        id,
        "--out",
        s(out.path()),
    ]);
    out
}

/// The arguments of a greedy `stormo run --json` of 12 ids after the prompt 1..=8, with
/// `extra` options.
pub(crate) fn run_args<'a>(model: &'a Path, st: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--model",
        s(model),
        "--prompt-ids",
        "1,2,3,4,5,6,7,8",
        "--max-new-tokens",
        "12",
        "--json",
        "--state-dir",
        s(st),
        "--expert-cache",
        "0",
    ];
    args.extend_from_slice(extra);
    args
}

/// The `generated_ids` of `run --json`'s answer.
pub(crate) fn generated_ids(v: &Value) -> Vec<u64> {
    v["generated_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

/// Greedy ids from `stormo run --json` with `extra` options.
pub(crate) fn run_ids(model: &Path, st: &Path, extra: &[&str]) -> (Vec<u64>, Value) {
    let v: Value = serde_json::from_str(&stormo(&run_args(model, st, extra))).expect("run --json");
    (generated_ids(&v), v)
}

/// A greedy chat completion through the Python `openai` client.
fn openai_greedy(base: &str) -> String {
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
m = c.models.list().data[0].id
r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, temperature=0)
print(repr(r.choices[0].message.content))
print(r.usage.completion_tokens)
# A random-weight model's chat reply rarely parses as a message: the raw completion's text is
# the generated tokens decoded, so it shows every token.
t = c.completions.create(model=m, prompt="Name three colours.", max_tokens=24, temperature=0)
assert t.choices[0].text, t
print(repr(t.choices[0].text))
"#;
    stormo_tests::require_python("openai");
    let out = Command::new("python3")
        .args(["-c", script, base])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "openai client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Issue 34 (a): three nodes each holding a third of the experts and a fourth on a folder
/// pulled without experts, serving the OpenAI API with `--peer`: the greedy completion equals
/// a node holding everything; `chat --peer` piped gives the same reply as a local chat.
#[test]
fn a_node_with_experts_on_three_peers_answers_like_a_local_one() {
    let (m, id) = model_with_manifest();
    let states: Vec<_> = (0..5).map(|_| state()).collect();
    let thirds = ["0,3", "1", "2"];
    let holders: Vec<Proc> = thirds
        .iter()
        .zip(&states)
        .map(|(only, st)| serve(m.path(), st.path(), &["--only-experts", only]))
        .collect();
    let dense = pull_dense(&holders[0].line, &id);
    let mut peer_args = Vec::new();
    for h in &holders {
        peer_args.push("--peer");
        peer_args.push(h.line.as_str());
    }
    let mut api = vec![
        "serve",
        "--model",
        s(dense.path()),
        "--http",
        "127.0.0.1:0",
        "--model-id",
        &id,
        "--state-dir",
        s(states[3].path()),
    ];
    api.extend_from_slice(&peer_args);
    let remote = Proc::start(&api);
    let local = Proc::start(&[
        "serve",
        "--model",
        s(m.path()),
        "--http",
        "127.0.0.1:0",
        "--state-dir",
        s(states[4].path()),
    ]);
    let want = openai_greedy(&local.line);
    let got = openai_greedy(&remote.line);
    assert_eq!(
        got, want,
        "the completion from peers differs from the local one"
    );
    // `chat --peer` on the dense-only folder, piped.
    let mut chat = vec![
        "chat",
        "--model",
        s(dense.path()),
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--model-id",
        &id,
        "--state-dir",
        s(states[3].path()),
    ];
    chat.extend_from_slice(&peer_args);
    let got = chat_reply(&chat);
    let want = chat_reply(&[
        "chat",
        "--model",
        s(m.path()),
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--state-dir",
        s(states[4].path()),
    ]);
    assert_eq!(got, want, "chat --peer replied otherwise than a local chat");
}

/// What `stormo chat ARGS` prints for one piped message: the reply on stdout and the turn's
/// statistics line on stderr (prompt and reply token counts, how the reply ended), its speed
/// left out. A random-weight model's reply rarely holds a chat message, so the counts and the
/// end carry the comparison when the text is empty.
fn chat_reply(args: &[&str]) -> (String, String) {
    let mut child = Command::new(stormo_exe())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run stormo chat");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"Name three colours.\n")
        .expect("write stdin");
    let out = wait_bounded(child, Duration::from_secs(180));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stormo {args:?} failed: {err}");
    let stats = err
        .lines()
        .find(|l| l.starts_with("[prompt "))
        .unwrap_or_else(|| panic!("no statistics line: {err}"));
    let stats: Vec<&str> = stats
        .split("; ")
        // The speed differs run to run (the last part: "… tok/s]").
        .filter(|p| !p.contains(" tok/s"))
        .collect();
    assert!(
        stats.iter().any(|p| p.starts_with("reply 16 tokens")),
        "{stats:?}"
    );
    (
        String::from_utf8(out.stdout).expect("utf-8"),
        stats.join("; "),
    )
}

/// Issue 34 (b): C knows only B, B knows only A. C's run is exact (B fetches from A for it);
/// then A stops, and C's next run is still exact, served by B from what it kept.
#[test]
fn a_node_re_serves_what_it_fetched_after_the_source_is_gone() {
    let (m, id) = model_with_manifest();
    let (sa, sb, sc, sl) = (state(), state(), state(), state());
    let a = serve(m.path(), sa.path(), &[]);
    let dense_b = pull_dense(&a.line, &id);
    let dense_c = pull_dense(&a.line, &id);
    let b = serve(
        dense_b.path(),
        sb.path(),
        &["--peer", &a.line, "--model-id", &id],
    );
    let (want, _) = run_ids(m.path(), sl.path(), &[]);
    let client = ["--peer", b.line.as_str(), "--model-id", id.as_str()];
    let (first, j) = run_ids(dense_c.path(), sc.path(), &client);
    assert_eq!(first, want, "C's ids through B differ from the local run's");
    assert!(
        j["experts"]["peer_loads"].as_u64().unwrap_or(0) > 0,
        "C fetched nothing from peers: {j}"
    );
    // B keeps what it fetched in its state directory (in the background): wait for it.
    let kept = sb.path().join("experts").join(&id);
    let until = Instant::now() + Duration::from_secs(20);
    while std::fs::read_dir(&kept).map_or(0, |d| d.count()) == 0 {
        assert!(
            Instant::now() < until,
            "B kept no experts in {}",
            kept.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
    drop(a);
    let (second, j2) = run_ids(dense_c.path(), sc.path(), &client);
    assert_eq!(second, want, "C's ids after A left differ: {j2}");
}

/// Every file under `dir` with its length and modification time.
fn snapshot(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("list").flatten() {
            let meta = e.metadata().expect("metadata");
            if meta.is_dir() {
                stack.push(e.path());
            } else {
                out.push((e.path(), meta.len(), meta.modified().expect("mtime")));
            }
        }
    }
    out.sort();
    out
}

/// Issue 34 (c): a read-only copy of a checkpoint runs and serves, and no file in the model
/// folder changes: usage counts and kept experts go to the state directory.
#[test]
fn a_read_only_checkpoint_runs_and_serves_and_is_never_written() {
    let (m, id) = model_with_manifest();
    let before = snapshot(m.path());
    let chmod = |mode: &str| {
        let ok = Command::new("chmod")
            .args(["-R", mode, s(m.path())])
            .status()
            .is_ok_and(|st| st.success());
        assert!(ok, "chmod -R {mode}");
    };
    chmod("a-w");
    let (sa, sb) = (state(), state());
    // The hot store is on (the default): its counts must land in the state directory.
    let mut run = vec![
        "run",
        "--model",
        s(m.path()),
        "--prompt-ids",
        "1,2,3",
        "--json",
    ];
    run.extend_from_slice(&["--max-new-tokens", "4", "--state-dir", s(sa.path())]);
    let v: Value = serde_json::from_str(&stormo(&run)).expect("run --json");
    assert_eq!(v["generated_ids"].as_array().map(Vec::len), Some(4), "{v}");
    let server = serve(m.path(), sb.path(), &[]);
    let dense = pull_dense(&server.line, &id);
    let (ids, _) = run_ids(
        dense.path(),
        sa.path(),
        &["--peer", &server.line, "--model-id", &id],
    );
    assert_eq!(ids.len(), 12);
    assert_eq!(
        server.terminate().code(),
        Some(0),
        "serve exits 0 on SIGTERM"
    );
    chmod("u+w");
    assert_eq!(snapshot(m.path()), before, "the model folder changed");
    let usage: Vec<_> = snapshot(sa.path())
        .into_iter()
        .filter(|(p, _, _)| p.ends_with("usage.json"))
        .collect();
    assert!(!usage.is_empty(), "no usage counts in the state directory");
}

/// Issue 34: `stormo pull --experts SPEC` fetches a subset of expert records, each from any
/// holder (two partial holders here), keeps them in the state directory, and a later `run` on
/// the folder uses them with no peer at all: exact. Issue 60: its progress counts experts (not
/// bytes named after them) and its last line says what it wrote: the dense file and its size,
/// and the experts kept and where (it said "0 files kept").
#[test]
fn pull_experts_fetches_records_from_partial_holders_and_runs_without_peers() {
    let (m, id) = model_with_manifest();
    let (s1, s2, sp, sl) = (state(), state(), state(), state());
    let h1 = serve(m.path(), s1.path(), &["--only-experts", "0,1"]);
    let h2 = serve(m.path(), s2.path(), &["--only-experts", "2,3"]);
    let out = tempfile::tempdir().expect("pull dir");
    let pulled = stormo_output(
        &[
            "pull",
            "--peer",
            &h1.line,
            "--peer",
            &h2.line,
            "--model-id",
            &id,
            "--out",
            s(out.path()),
            "--experts",
            "0-3",
            "--state-dir",
            s(sp.path()),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&pulled.stderr).into_owned();
    assert!(pulled.status.success(), "{err}");
    let kept = sp.path().join("experts").join(&id);
    let n = std::fs::read_dir(&kept).map_or(0, |d| d.count());
    assert_eq!(n, 8, "2 layers x 4 experts kept in {}", kept.display());
    assert!(
        err.contains(&format!("pull: experts: {n} of {n} experts, ")),
        "{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    let files: Vec<(String, u64)> = std::fs::read_dir(out.path())
        .expect("pulled folder")
        .map(|e| e.expect("entry"))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e))
        .filter(|(n, _)| n.ends_with(".dense.safetensors"))
        .map(|(n, e)| (n, e.metadata().expect("metadata").len()))
        .collect();
    let [(name, dense)] = files.as_slice() else {
        panic!("not one dense file in {}: {files:?}", out.path().display());
    };
    for want in [
        format!("{name} ("),
        stormo_net::progress::human_bytes(*dense),
        "dense tensors only".to_string(),
        format!("{n} experts kept in {}", kept.display()),
    ] {
        assert!(
            last.contains(&want),
            "{want:?} not in the last line: {last}"
        );
    }
    assert!(!err.contains("files kept"), "{err}");
    drop((h1, h2));
    let (want, _) = run_ids(m.path(), sl.path(), &[]);
    let (got, j) = run_ids(out.path(), sp.path(), &[]);
    assert_eq!(got, want, "the kept experts gave other ids: {j}");
    assert!(
        j["experts"]["dir_loads"].as_u64().unwrap_or(0) > 0,
        "no expert came from the kept ones: {j}"
    );
}

/// Regression: the expert directory reserved a record's entry before writing its file, so it
/// said it held the expert while the file was still a temporary one; `pull --experts` waits
/// until every expert is held and then exits, and under load the last record was left as its
/// temporary file, which the next run removes ("no tier holds it"). Now an expert is held
/// only once its file is in place, full length, whenever a reader asks.
#[test]
fn the_expert_directory_holds_an_expert_only_once_its_file_is_in_place() {
    use stormo_engine::tiers::ExpertId;
    let (m, _) = model_with_manifest();
    let manifest = stormo_manifests::read_manifest(&m.path().join("stormo-manifest.bin"))
        .expect("manifest")
        .0;
    let ckpt = stormo_engine::safetensors::Checkpoint::open(m.path()).expect("checkpoint");
    let cfg = stormo_engine::ModelConfig::from_dir(m.path()).expect("config");
    let layout = stormo_engine::layout::ExpertLayout::from_checkpoint(&ckpt, &cfg).expect("layout");
    let st = state();
    let dir = Arc::new(
        stormo_net::expert_dir::ExpertDir::open(
            st.path(),
            manifest.model_id(),
            u64::MAX,
            Arc::new(manifest),
            layout.schemas.clone(),
        )
        .expect("expert dir"),
    );
    for (l, per_layer) in layout.parts.iter().enumerate() {
        for (e, parts) in per_layer.iter().enumerate() {
            let id = ExpertId::from_indices(l, e);
            let mut record = Vec::new();
            for p in parts {
                let f = &ckpt.files[p.loc.file].map;
                record.extend_from_slice(
                    &f[p.loc.offset as usize..(p.loc.offset + p.loc.len) as usize],
                );
            }
            let len = record.len() as u64;
            let path = dir.root().join(format!("{}-{}.bin", id.layer, id.expert));
            let storing = {
                let dir = dir.clone();
                std::thread::spawn(move || dir.store(id, &record))
            };
            // Every time the directory says it holds the expert, the file is there, whole.
            let until = Instant::now() + Duration::from_secs(30);
            while !dir.contains(id) {
                assert!(Instant::now() < until, "expert {id} never stored");
                std::hint::spin_loop();
            }
            let on_disk = std::fs::metadata(&path).map(|m| m.len());
            assert_eq!(
                on_disk.ok(),
                Some(len),
                "expert {id} held before {} was in place",
                path.display()
            );
            storing.join().expect("store");
        }
    }
    let tmp = std::fs::read_dir(dir.root())
        .expect("dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .count();
    assert_eq!(tmp, 0, "temporary files left");
}

/// Issue 35: `bench --peer` measures decode and prefill with every expert from a peer, then
/// the same prompts from the local disk, and reports both and their ratio; on a folder pulled
/// without experts it measures the peers' run alone.
#[test]
fn bench_with_peers_reports_the_run_from_peers_beside_the_local_disk() {
    let (m, id) = model_with_manifest();
    let (sa, sb) = (state(), state());
    let a = serve(m.path(), sa.path(), &[]);
    let bench = |model: &Path| -> Value {
        let out = stormo(&[
            "bench",
            "--model",
            s(model),
            "--peer",
            &a.line,
            "--model-id",
            &id,
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "4",
            "--mem-test",
            "1MiB",
            "--disk-test",
            "0",
            "--expert-cache",
            "0",
            "--state-dir",
            s(sb.path()),
            "--json",
        ]);
        serde_json::from_str(&out).expect("bench --json")
    };
    let v = bench(m.path());
    assert_eq!(v["from_peers"], true, "{v}");
    assert!(v["experts"]["peer_loads"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(v["experts"]["disk_loads"], 0, "{v}");
    let disk = v["disk"]["decode_tok_s"]
        .as_f64()
        .expect("the disk's decode");
    let peers = v["decode"]["tok_s"].as_f64().expect("the peers' decode");
    let ratio = v["peer_vs_disk"].as_f64().expect("peer_vs_disk");
    assert!((ratio - peers / disk).abs() <= 1e-9 * ratio.abs(), "{v}");
    assert!(v["fetch_mb_s"].as_f64().is_some_and(|f| f > 0.0), "{v}");
    assert_eq!(v["disk"]["prefill"][0]["tokens"], 8, "{v}");
    let dense = pull_dense(&a.line, &id);
    let v = bench(dense.path());
    assert!(v["experts"]["peer_loads"].as_u64().unwrap_or(0) > 0, "{v}");
    assert!(v["disk"].is_null() && v["peer_vs_disk"].is_null(), "{v}");
}

/// The line `serve --warm` prints once the warm-up ended, waited for (bounded).
fn warmed_line(p: &Proc) -> String {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let err = p.stderr.lock().expect("stderr lock").clone();
        if let Some(l) = err
            .lines()
            .find(|l| l.starts_with("warmed the RAM cache: "))
        {
            return l.to_string();
        }
        assert!(Instant::now() < until, "no warm-up line within 60 s: {err}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A serving node reads every held expert into its RAM cache at start when the budget holds
/// them all, and only as many as the budget holds when it does not (`--expert-cache 0`: one
/// layer's top-k, 2 here); `--no-warm` turns it off.
#[test]
fn serve_warms_the_ram_cache_up_to_its_budget() {
    let (m, _id) = model_with_manifest();
    let cases = [("auto", "8 experts"), ("0", "2 experts")];
    for (budget, want) in cases {
        let st = state();
        let p = Proc::start_logging(&serve_args(m.path(), st.path(), budget), Some("warn"));
        let line = warmed_line(&p);
        assert!(
            line.starts_with(&format!("warmed the RAM cache: {want} (")),
            "--expert-cache {budget}: {line}"
        );
        assert!(p.terminate().success());
    }
    let st = state();
    let mut a = serve_args(m.path(), st.path(), "auto");
    a.push("--no-warm");
    let p = Proc::start_logging(&a, Some("warn"));
    std::thread::sleep(Duration::from_millis(500));
    let err = p.stderr.lock().expect("stderr lock").clone();
    assert!(!err.contains("warmed the RAM cache"), "{err}");
    assert!(p.terminate().success());
}

/// Issue 60: `run --stats` prints the prompt's and the generation's tokens per second and the
/// wall time, as llama-cli does.
#[test]
fn run_stats_prints_tokens_per_second() {
    let out = Command::new(stormo_exe())
        .args([
            "run",
            "--model",
            s(&stormo_tests::fixture("gptoss-tiny-mxfp4")),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "6",
            "--stats",
            "--state-dir",
            s(state().path()),
        ])
        .output()
        .expect("run stormo");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("prompt: 3 tokens"))
        .unwrap_or_else(|| panic!("no speed line: {err}"));
    assert!(
        line.matches("tok/s").count() == 2 && line.contains("wall time"),
        "{line}"
    );
}
