//! Swarms that form themselves (issue 41 (a)): `stormo serve` processes on a private mainline
//! DHT on loopback find each other from the model id and the swarm key alone, and `stormo
//! pull` and `stormo run`, given no `--peer`, get a model folder and token-exact output from
//! them. Every node is given a loopback `--dht-bootstrap` and a loopback `--dht-listen`, so no
//! DHT packet leaves 127.0.0.1 and no node ever reaches for the public bootstrap nodes (a
//! node given bootstrap nodes never falls back to them: `discover::dht` unit tests). Every
//! process is killed when its guard drops.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::node::{model_with_manifest, run_ids, s, state, stormo, Proc};

/// A free UDP port on 127.0.0.1 (released again: the first DHT node binds it next).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|u| u.local_addr())
        .expect("a free UDP port on loopback")
        .port()
}

/// A swarm: the owner's key in `dir`, and its swarm key.
fn create_swarm(dir: &Path) -> String {
    let owner = dir.join("owner.key");
    stormo(&["swarm", "create", "--out", s(&owner)])
        .trim()
        .to_string()
}

/// A node key and its membership certificate, signed by the owner in `dir`.
fn admit(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{name}.key"));
    let cert = dir.join(format!("{name}.cert"));
    stormo(&["key", "generate", "--out", s(&key)]);
    stormo(&[
        "swarm",
        "admit",
        "--swarm",
        s(&dir.join("owner.key")),
        "--node",
        s(&key),
        "--out",
        s(&cert),
    ]);
    (key, cert)
}

/// The log line a node writes when it adds the peer that printed `line` (`KEY@ADDR`).
fn discovered(line: &str) -> String {
    let (key, addr) = line.split_once('@').expect("KEY@ADDR");
    format!("discovered peer {}@{addr}", &key[..8])
}

/// Five serving nodes, each holding part of the experts, find each other on a loopback DHT;
/// a pull with no `--peer` gets the dense folder from them, and a run on it with no `--peer`
/// generates the same ids as a local run, every expert fetched from them.
#[test]
fn five_nodes_on_a_loopback_dht_find_each_other_and_a_sixth_generates_exactly() {
    let (m, id) = model_with_manifest();
    let keys = tempfile::tempdir().expect("key dir");
    let swarm = create_swarm(keys.path());
    assert_eq!(swarm.len(), 64, "swarm create printed {swarm:?}");
    let bootstrap = format!("127.0.0.1:{}", free_udp_port());
    let states: Vec<_> = (0..7).map(|_| state()).collect();
    // Every expert of the 4 is held by some node, none by all: the sixth needs several.
    let parts = ["0", "1", "2", "3", "0,1"];
    let mut nodes: Vec<Proc> = Vec::new();
    for (i, only) in parts.iter().enumerate() {
        let (key, cert) = admit(keys.path(), &format!("node{i}"));
        // The first node is the private DHT's bootstrap node: its --dht-listen is everyone's
        // --dht-bootstrap (its own too, which leaves it with none).
        let dht_listen = if i == 0 {
            bootstrap.as_str()
        } else {
            "127.0.0.1:0"
        };
        let args = [
            "serve",
            "--model",
            s(m.path()),
            "--listen",
            "127.0.0.1:0",
            "--key",
            s(&key),
            "--swarm",
            &swarm,
            "--cert",
            s(&cert),
            "--discover",
            "dht",
            "--dht-listen",
            dht_listen,
            "--dht-bootstrap",
            &bootstrap,
            "--only-experts",
            only,
            "--state-dir",
            s(states[i].path()),
            "--expert-cache",
            "0",
        ];
        nodes.push(Proc::start_logging(&args, Some("warn,stormo_node=info")));
    }
    // Each finds the other four (lookups every 2, 4, 8... s at first).
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let missing: Vec<(usize, usize)> = (0..nodes.len())
            .flat_map(|i| (0..nodes.len()).map(move |j| (i, j)))
            .filter(|&(i, j)| {
                i != j
                    && !nodes[i]
                        .stderr
                        .lock()
                        .expect("stderr lock")
                        .contains(&discovered(&nodes[j].line))
            })
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "within 120 s, these nodes had not found these others (i, j): {missing:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    for n in &nodes {
        let log = n.stderr.lock().expect("stderr lock");
        assert!(
            !log.contains(&discovered(&n.line)),
            "a node added itself: {log}"
        );
        // Its DHT node is on loopback (where --dht-listen put it), none on 0.0.0.0.
        let dht = log
            .lines()
            .find_map(|l| {
                l.split_once("DHT node on ")
                    .map(|(_, a)| a.trim().to_string())
            })
            .unwrap_or_else(|| panic!("no DHT node logged: {log}"));
        assert!(dht.starts_with("127.0.0.1:"), "a DHT node on {dht}");
    }

    let (key, cert) = admit(keys.path(), "client");
    let client = |cmd: &'static str| -> Vec<&str> {
        vec![
            cmd,
            "--key",
            s(&key),
            "--swarm",
            &swarm,
            "--cert",
            s(&cert),
            "--discover",
            "dht",
            "--dht-listen",
            "127.0.0.1:0",
            "--dht-bootstrap",
            &bootstrap,
            "--model-id",
            &id,
        ]
    };
    // `pull` with no address: the dense folder, from whichever nodes discovery found.
    let out = tempfile::tempdir().expect("pull dir");
    let mut pull = client("pull");
    pull.extend_from_slice(&["--out", s(out.path())]);
    stormo(&pull);
    let marker = std::fs::read_to_string(out.path().join("stormo-pulled.json")).expect("marker");
    assert!(marker.contains(&id), "{marker}");

    // `run` on it with no address: every expert from the five, the ids of a local run.
    let (want, _) = run_ids(m.path(), states[5].path(), &[]);
    let mut run = client("run");
    run.remove(0);
    let (got, j) = run_ids(out.path(), states[6].path(), &run);
    assert_eq!(
        got, want,
        "ids from discovered peers differ from a local run: {j}"
    );
    assert!(
        j["experts"]["peer_loads"].as_u64().unwrap_or(0) > 0,
        "nothing came from peers: {j}"
    );
    drop(nodes);
}
