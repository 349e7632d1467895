//! `stormo sim`: real serve processes behind shaping relays, a node killed mid-run, and the
//! token-exactness verdict.

use std::process::Command;

use serde_json::Value;

use crate::demo::stormo_exe;

/// Churn: a holder is killed (SIGKILL) mid-run and restarted; with every expert held twice
/// the run finishes with the local run's ids, and the failures are counted.
#[test]
fn churn_kills_a_holder_mid_run_and_the_output_stays_exact() {
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "churn",
            "--json",
            "--max-new-tokens",
            "32",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo sim failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("swarm --json is JSON");
    let r = &v[0];
    assert_eq!(r["scenario"], "churn");
    assert_eq!(r["swarm"]["ids"], r["local"]["ids"], "{r}");
    assert_eq!(r["token_exact"], true);
    assert!(r["swarm"]["peer_loads"].as_u64().unwrap_or(0) > 0, "{r}");
    let victim = &r["nodes"][1];
    assert_eq!(victim["kills"], 1, "{victim}");
    assert_eq!(victim["starts"], 2, "{victim}");
    assert!(r["events"].as_array().is_some_and(|e| e.len() == 2), "{r}");
    // Killed mid-run: after it had sent expert data, before the run ended.
    assert!(
        victim["link"]["down_bytes"].as_u64().unwrap_or(0) > 0,
        "{victim}"
    );
}

/// Through the simulator's old spelling `stormo swarm --scenario`, kept as an alias of
/// `stormo sim`.
#[test]
fn unknown_scenario_is_a_clear_error() {
    let out = Command::new(stormo_exe())
        .args(["swarm", "--scenario", "lan5"])
        .output()
        .expect("run stormo swarm");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("lan4") && !err.contains("panicked"), "{err}");
}

/// `stormo sim --scenario faults` at a tiny size: every case of the fault matrix against real
/// processes ends as it should (the ids of the local run, or for the refused key an error
/// naming the peer), and the table lists each with its time.
#[test]
fn the_fault_matrix_against_real_processes_ends_as_expected() {
    let started = std::time::Instant::now();
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "faults",
            "--json",
            "--max-new-tokens",
            "24",
            "--fault-clients",
            "3",
            "--timeout",
            "120",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    let rows = v["rows"].as_array().expect("rows");
    let cases: Vec<&str> = rows.iter().filter_map(|r| r["case"].as_str()).collect();
    assert_eq!(rows.len(), 6, "{cases:?}");
    for r in rows {
        assert_eq!(r["ok"], true, "{r}\nstderr: {err}");
        let want = if r["expect"] == "exact" {
            "exact"
        } else {
            "clear error"
        };
        assert_eq!(r["outcome"], want, "{r}");
        assert!(r["secs"].as_f64().is_some_and(|s| s > 0.0), "{r}");
    }
    assert!(
        rows.iter().any(|r| r["expect"] == "clear-error"),
        "no case expects an error: {cases:?}"
    );
    assert!(out.status.success(), "{err}");
    eprintln!("the fault matrix took {:?}", started.elapsed());
}

/// `stormo sim --scenario fair-wan` at a tiny size (the small model, a slow shared link, a
/// 2 s window): every pair of congestion controls runs to the end through one shared
/// bottleneck and both flows of each are reported with their bytes and shares. What the shares
/// are is measured, never asserted.
#[test]
fn the_fairness_scenario_reports_both_flows_of_each_pair() {
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "fair-wan",
            "--json",
            "--bandwidth-mbit",
            "20",
            "--fair-secs",
            "2",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo sim failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    assert_eq!(v["scenario"], "fair-wan");
    let pairs = v["pairs"].as_array().expect("pairs");
    let names: Vec<String> = pairs
        .iter()
        .map(|p| {
            format!(
                "{}+{}",
                p["flows"][0]["congestion"], p["flows"][1]["congestion"]
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            "\"cubic\"+\"cubic\"",
            "\"bbr\"+\"cubic\"",
            "\"bbr\"+\"bbr\"",
            "\"tolerant\"+\"cubic\"",
            "\"tolerant\"+\"tolerant\""
        ],
        "{v}"
    );
    for p in pairs {
        let flows = p["flows"].as_array().expect("two flows");
        assert_eq!(flows.len(), 2, "{p}");
        let shares: f64 = flows.iter().filter_map(|f| f["share"].as_f64()).sum();
        assert!((shares - 1.0).abs() < 1e-9, "shares do not add up: {p}");
        let bytes: Vec<u64> = flows.iter().filter_map(|f| f["bytes"].as_u64()).collect();
        assert_eq!(bytes.len(), 2, "{p}");
        assert!(
            bytes.iter().sum::<u64>() > 0,
            "the link carried nothing: {p}"
        );
        for f in flows {
            assert!(f["pulls"].as_u64().is_some_and(|n| n >= 1), "{p}");
        }
    }
}

/// `stormo sim --scenario stripe` on a one-layer model whose experts (3.2 MiB) are large
/// enough to stripe: an empty node generates from one holder, then from two, both times with
/// the local run's ids, and with two holders every expert it fetched came striped, with
/// bytes from both holders. Which run is faster is measured (docs), never asserted. A model
/// whose experts are too small to stripe is refused by name before anything starts.
#[test]
fn the_stripe_scenario_fetches_from_both_holders_and_stays_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    let synth = Command::new(stormo_exe())
        .args([
            "synth",
            "--preset",
            "gpt-oss-20b",
            "--layers",
            "1",
            "--hidden",
            "1024",
        ])
        .args([
            "--intermediate",
            "2048",
            "--experts",
            "8",
            "--top-k",
            "4",
            "--vocab",
            "4096",
        ])
        .args([
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--out",
        ])
        .arg(&model)
        .output()
        .expect("run stormo synth");
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "stripe",
            "--json",
            "-n",
            "4",
            "--model",
        ])
        .arg(&model)
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stormo sim failed: {err}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    let r = &v[0];
    assert_eq!(r["scenario"], "stripe");
    assert_eq!(r["token_exact"], true, "{r}");
    assert_eq!(r["one_holder"]["ids"], r["local"]["ids"], "{r}");
    assert_eq!(r["swarm"]["ids"], r["local"]["ids"], "{r}");
    let (one, both) = (&r["one_holder"], &r["swarm"]);
    let loads = |x: &Value, k: &str| x[k].as_u64().unwrap_or(0);
    assert!(loads(one, "peer_loads") > 0, "{r}");
    assert_eq!(loads(one, "peer_striped_loads"), 0, "one holder: {r}");
    assert!(loads(both, "peer_loads") > 0, "{r}");
    // Most loads are striped, not necessarily all: the stripe plan takes only holders ready
    // at that moment (connected, not backed off after a slow try), and a load with one ready
    // holder comes whole from it. Seen once in the full suite on the loaded 2-core machine:
    // 6 of 9 striped (which holder was not ready, and why, was not looked into). Without
    // striping none would be.
    let striped = loads(both, "peer_striped_loads");
    assert!(
        striped > 0 && 2 * striped >= loads(both, "peer_loads"),
        "most experts striped: {r}"
    );
    // n1 is a peer of the second run only, so everything it sent went to that run.
    let sent = |i: usize| r["nodes"][i]["link"]["down_bytes"].as_u64().unwrap_or(0);
    assert!(sent(0) > 0 && sent(1) > 0, "{r}");

    // The small model's experts are far below 2 MiB.
    let out = Command::new(stormo_exe())
        .args(["sim", "--scenario", "stripe", "-n", "1"])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("needs experts of at least 2 MiB") && !err.contains("panicked"),
        "{err}"
    );
}
