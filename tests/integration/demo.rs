//! `stormo demo` as a user runs it, and `stormo synth --tokenizer`.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use stormo_cli::cli::{dispatch, Cli};
use stormo_tests::fixture;

/// The stormo binary built in this package.
pub(crate) fn stormo_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stormo-under-test"))
}

/// The demo's claims, checked against its own JSON: the ids from a node with no experts
/// equal a local run's, every expert came from peers (none from a disk), every node served,
/// the relay (a node with no experts) kept what it fetched and alone served the second run
/// exactly after the holders stopped, the prompt is Harmony-rendered with the embedded
/// tokenizer, and nothing is left behind.
#[test]
fn demo_generates_exactly_from_peers_and_cleans_up() {
    let out = Command::new(stormo_exe())
        .args(["demo", "--json", "--max-new-tokens", "12"])
        .output()
        .expect("run stormo demo");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo demo failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("demo --json is JSON");
    let swarm = &v["swarm"]["ids"];
    let local = &v["local"]["ids"];
    assert_eq!(swarm.as_array().map(Vec::len), Some(12), "{v}");
    assert_eq!(swarm, local, "ids from peers differ from the local run");
    assert_eq!(v["token_exact"], true);
    let loads = v["swarm"]["peer_loads"].as_u64().expect("peer_loads");
    assert!(loads > 0, "no expert came from peers: {v}");
    assert_eq!(
        v["swarm"]["disk_loads"], 0,
        "the generating node read experts from disk"
    );
    assert_eq!(v["local"]["peer_loads"], 0);
    let after = &v["after_holders_left"];
    assert_eq!(
        &after["ids"], local,
        "ids re-served by the relay differ: {v}"
    );
    assert!(after["peer_loads"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(after["peer_failures"], 0, "{v}");
    assert!(
        v["relay_kept"].as_u64().unwrap_or(0) > 0,
        "the relay kept nothing: {v}"
    );
    let nodes = v["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 4, "three holders and a relay: {v}");
    let relays: Vec<&Value> = nodes.iter().filter(|n| n["relay"] == true).collect();
    assert_eq!(relays.len(), 1, "{v}");
    assert_eq!(relays[0]["experts_held"], 0, "{v}");
    let mut served = 0;
    for n in nodes {
        let s = n["served"]
            .as_u64()
            .expect("every node reported what it served");
        assert!(s > 0, "a node served nothing: {n}");
        assert!(n["bytes_sent"].as_u64().unwrap_or(0) > 0, "{n}");
        served += s;
    }
    assert!(
        served >= loads,
        "{served} requests served for {loads} loads"
    );
    let prompt = v["prompt_ids"].as_array().expect("prompt_ids");
    assert_eq!(prompt[0], 200_006, "not a Harmony prompt (<|start|> first)");
    assert!(
        v["text"].is_string(),
        "no text: the tokenizer is not embedded"
    );
    let scratch = std::env::temp_dir().join(format!("stormo-demo-{}", out_pid(&err)));
    assert!(!scratch.exists(), "{} left behind", scratch.display());
}

/// The demo's process id is not printed; its scratch folder is named after it, so look for
/// any `stormo-demo-*` folder whose process is gone instead.
fn out_pid(_stderr: &str) -> String {
    for e in std::fs::read_dir(std::env::temp_dir())
        .expect("temp dir")
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = name.strip_prefix("stormo-demo-") {
            if !PathBuf::from(format!("/proc/{pid}")).exists() {
                return pid.to_string();
            }
        }
    }
    "none".into()
}

/// `stormo synth --preset gpt-oss-20b --quiet ARGS`, in process.
pub(crate) fn synth(args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["stormo", "synth", "--preset", "gpt-oss-20b", "--quiet"];
    all.extend_from_slice(args);
    dispatch(Cli::try_parse_args(all)?)
}

/// A tiny GPT-OSS shape for `stormo synth` (all but the layer count), shared by the tests that
/// write one.
pub(crate) const SMALL_SHAPE: &[&str] = &[
    "--hidden",
    "64",
    "--intermediate",
    "64",
    "--experts",
    "4",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--head-dim",
    "32",
];

#[test]
fn synth_copies_a_tokenizer_that_fits_and_refuses_one_that_does_not() {
    let tok = fixture("o200k-harmony").join("tokenizer.json");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("m");
    let mut args = [&["--layers", "1"], SMALL_SHAPE].concat();
    let tok_s = tok.to_string_lossy().into_owned();
    let out_s = out.to_string_lossy().into_owned();
    args.extend(["--vocab", "1000", "--tokenizer", &tok_s, "--out", &out_s]);
    let e = synth(&args).expect_err("a 201088-id tokenizer accepted for vocab 1000");
    let msg = format!("{e:#}");
    assert!(msg.contains("201087") && msg.contains("--vocab"), "{msg}");
    assert!(
        !out.join("config.json").exists(),
        "wrote files before refusing"
    );
    let mut args = [&["--layers", "1"], SMALL_SHAPE].concat();
    args.extend(["--vocab", "201088", "--tokenizer", &tok_s, "--out", &out_s]);
    synth(&args).expect("synth with the tokenizer");
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).expect("copied"),
        std::fs::read(&tok).expect("fixture")
    );
    let mut args = [&["--layers", "1"], SMALL_SHAPE].concat();
    let missing = dir.path().join("nope.json").to_string_lossy().into_owned();
    args.extend(["--tokenizer", &missing, "--out", &out_s, "--force"]);
    let e = synth(&args).expect_err("a missing tokenizer accepted");
    assert!(format!("{e:#}").contains("nope.json"), "{e:#}");
}
