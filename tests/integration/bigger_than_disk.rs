//! `stormo sim --scenario bigger-than-disk` at a tiny size (the small synthesized model): four
//! serving nodes from dense-only folders, none with room for the model, place two copies of
//! every expert from a seeder that then leaves; a node with no experts generates over lan and
//! wan links, and again after one more node is killed, each run with the local run's ids.

use std::process::Command;

use serde_json::Value;

use crate::demo::stormo_exe;

#[test]
fn the_swarm_holds_a_model_no_node_has_room_for_and_generates_exactly() {
    let started = std::time::Instant::now();
    let out = Command::new(stormo_exe())
        .args([
            "sim",
            "--scenario",
            "bigger-than-disk",
            "--json",
            "--max-new-tokens",
            "8",
            // Also the bound on placement: 9-12 s on this model (docs/network.md).
            "--timeout",
            "180",
        ])
        .output()
        .expect("run stormo sim");
    let err = String::from_utf8_lossy(&out.stderr);
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("sim --json is not JSON ({e}); stderr: {err}"));
    assert!(out.status.success(), "{err}");
    assert_eq!(r["scenario"], "bigger-than-disk");
    let total = r["expert_bytes"].as_u64().expect("expert_bytes");
    let budget = r["budget"].as_u64().expect("budget");
    assert!(budget < total, "{r}");
    assert!(r["min_copies"].as_u64().unwrap_or(0) >= 2, "{r}");
    assert!(r["coverage_s"].as_f64().is_some_and(|s| s > 0.0), "{r}");
    assert_eq!(r["uncovered_after_kill"], 0, "{r}");
    let nodes = r["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 4, "{r}");
    for n in nodes {
        let kept = n["kept_bytes"].as_u64().expect("kept_bytes");
        assert!(kept > 0 && kept <= budget, "{n}");
    }
    let runs = r["runs"].as_array().expect("runs");
    let labels: Vec<&str> = runs.iter().filter_map(|x| x["label"].as_str()).collect();
    assert_eq!(labels, ["lan", "wan", "lan, n0 killed", "wan, n0 killed"]);
    for x in runs {
        assert_eq!(x["run"]["ids"], r["local"]["ids"], "{x}");
        assert_eq!(x["token_exact"], true, "{x}");
        assert!(x["run"]["peer_loads"].as_u64().unwrap_or(0) > 0, "{x}");
    }
    assert_eq!(r["token_exact"], true);
    eprintln!("bigger-than-disk took {:?}", started.elapsed());
}
