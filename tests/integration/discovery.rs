//! Swarms that form themselves (issue 41 (a)): `stormo serve` processes on a private mainline
//! DHT on loopback find each other from the model id and the swarm key alone, and `stormo
//! pull` and `stormo run`, given no `--peer`, get a model folder and token-exact output from
//! them. Every node is given a loopback `--dht-bootstrap` and a loopback `--dht-listen`, so no
//! DHT packet leaves 127.0.0.1 and no node ever reaches for the public bootstrap nodes (a
//! node given bootstrap nodes never falls back to them: `discover::dht` unit tests). Every
//! process is killed when its guard drops.

use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::node::{model_with_manifest, run_ids, s, state, stormo, Proc};
use crate::swarm::{admit_for, create_swarm};

/// A free UDP port on 127.0.0.1 (released again: the first DHT node binds it next).
pub(crate) fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|u| u.local_addr())
        .expect("a free UDP port on loopback")
        .port()
}

/// A new node key `dir/NAME.key` and its membership certificate `dir/NAME.cert`, signed by
/// the owner in `dir` for `swarm admit`'s default period.
fn admit(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{name}.key"));
    stormo(&["key", "generate", "--out", s(&key)]);
    let cert = admit_for(dir, s(&key), None, name);
    (key, cert)
}

/// The log line a node writes when it adds the peer that printed `line` (`KEY@ADDR`).
fn discovered(line: &str) -> String {
    let (key, addr) = line.split_once('@').expect("KEY@ADDR");
    format!("discovered peer {}@{addr}", &key[..8])
}

/// A swarm on a private DHT: its key, its owner's folder, the model every node serves, and
/// the DHT's bootstrap node (`127.0.0.1:PORT`, the first node's `--dht-listen`).
struct DhtSwarm<'a> {
    swarm: String,
    keys: &'a Path,
    model: &'a Path,
    bootstrap: String,
}

impl<'m> DhtSwarm<'m> {
    /// A new swarm (its owner in `keys`) serving `model`, on a DHT bootstrapped from a free
    /// loopback port.
    fn new(keys: &'m Path, model: &'m Path) -> Self {
        Self {
            swarm: create_swarm(keys),
            keys,
            model,
            bootstrap: format!("127.0.0.1:{}", free_udp_port()),
        }
    }

    /// The options of the member with `key` and `cert` that discovers through the DHT.
    fn member<'a>(&'a self, key: &'a Path, cert: &'a Path) -> Vec<&'a str> {
        vec![
            "--key",
            s(key),
            "--swarm",
            &self.swarm,
            "--cert",
            s(cert),
            "--discover",
            "dht",
            "--dht-bootstrap",
            &self.bootstrap,
        ]
    }

    /// `stormo serve` as the new member `name`, discovering through the DHT, holding the
    /// experts `only` with no cache, its state in `state`; `dht_listen` where its DHT node
    /// listens (`None`: a random port), and `extra` options.
    fn serve(
        &self,
        name: &str,
        only: &str,
        state: &Path,
        dht_listen: Option<&str>,
        extra: &[&str],
    ) -> Proc {
        let (key, cert) = admit(self.keys, name);
        let mut args = vec!["serve", "--model", s(self.model), "--listen", "127.0.0.1:0"];
        args.extend(self.member(&key, &cert));
        args.extend([
            "--only-experts",
            only,
            "--state-dir",
            s(state),
            "--expert-cache",
            "0",
        ]);
        if let Some(at) = dht_listen {
            args.extend(["--dht-listen", at]);
        }
        args.extend_from_slice(extra);
        Proc::start_logging(&args, Some("warn,stormo_node=info,stormo_net=info"))
    }

    /// `stormo pull` and then `stormo run` on the pulled folder, given no `--peer`: as the new
    /// member `name`, finding the nodes through the DHT (and `extra` options). The folder is
    /// model `id`'s, and the run generates the ids of a local run (state in `states[0]`), with
    /// experts from the peers (state in `states[1]`).
    fn pull_and_run_exactly(&self, name: &str, id: &str, extra: &[&str], states: [&Path; 2]) {
        let (key, cert) = admit(self.keys, name);
        let mut client = self.member(&key, &cert);
        client.extend(["--model-id", id]);
        client.extend_from_slice(extra);
        // `pull` with no address: the dense folder, from whichever nodes discovery found.
        let out = tempfile::tempdir().expect("pull dir");
        let mut pull = vec!["pull", "--out", s(out.path())];
        pull.extend_from_slice(&client);
        stormo(&pull);
        let marker =
            std::fs::read_to_string(out.path().join("stormo-pulled.json")).expect("marker");
        assert!(marker.contains(id), "{marker}");
        // `run` on it with no address: every expert from the peers, the ids of a local run.
        let (want, _) = run_ids(self.model, states[0], &[]);
        let (got, j) = run_ids(out.path(), states[1], &client);
        assert_eq!(
            got, want,
            "ids from discovered peers differ from a local run: {j}"
        );
        assert!(
            j["experts"]["peer_loads"].as_u64().unwrap_or(0) > 0,
            "nothing came from peers: {j}"
        );
    }
}

/// Waits until each of `nodes` has logged that it discovered every other, at most `within`
/// from `since`.
fn until_each_found_the_others(nodes: &[Proc], since: Instant, within: Duration) {
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
            return;
        }
        assert!(
            since.elapsed() < within,
            "within {within:?}, these nodes had not found these others (i, j): {missing:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Where a node's log says its DHT node is.
fn dht_addr(log: &str) -> SocketAddr {
    let at = log
        .lines()
        .find_map(|l| l.split_once("DHT node on ").map(|(_, a)| a.to_string()))
        .unwrap_or_else(|| panic!("no DHT node logged: {log}"));
    at.split_whitespace()
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("not an address: {at}"))
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
    let dht = DhtSwarm {
        swarm,
        keys: keys.path(),
        model: m.path(),
        bootstrap: format!("127.0.0.1:{}", free_udp_port()),
    };
    let states: Vec<_> = (0..7).map(|_| state()).collect();
    // Every expert of the 4 is held by some node, none by all: the sixth needs several.
    let parts = ["0", "1", "2", "3", "0,1"];
    let nodes: Vec<Proc> = parts
        .iter()
        .enumerate()
        .map(|(i, only)| {
            // The first node is the private DHT's bootstrap node: its --dht-listen is
            // everyone's --dht-bootstrap (its own too, which leaves it with none).
            let listen = if i == 0 {
                dht.bootstrap.as_str()
            } else {
                "127.0.0.1:0"
            };
            dht.serve(
                &format!("node{i}"),
                only,
                states[i].path(),
                Some(listen),
                &[],
            )
        })
        .collect();
    // Each finds the other four (lookups every 2, 4, 8... s at first).
    until_each_found_the_others(&nodes, Instant::now(), Duration::from_secs(120));
    for n in &nodes {
        let log = n.stderr.lock().expect("stderr lock");
        assert!(
            !log.contains(&discovered(&n.line)),
            "a node added itself: {log}"
        );
        // Its DHT node is on loopback (where --dht-listen put it), none on 0.0.0.0.
        let at = dht_addr(&log);
        assert_eq!(at.ip().to_string(), "127.0.0.1", "a DHT node on {at}");
    }
    dht.pull_and_run_exactly(
        "client",
        &id,
        &["--dht-listen", "127.0.0.1:0"],
        [states[5].path(), states[6].path()],
    );
    drop(nodes);
}

/// The README's private-DHT recipe (issue 57, item 4), on loopback: the first node gets
/// `--dht-listen 127.0.0.1:P --dht-bootstrap 127.0.0.1:P` (the README's `0.0.0.0:6881` and
/// `first-host:6881`, kept on loopback), the others only `--dht-bootstrap 127.0.0.1:P`, so
/// their DHT nodes bind a random port (every interface, as documented, but they only ever send
/// to the loopback addresses they learn). The first one is alone for a while first; then the
/// serving nodes find each other in under 10 s, the first logs no ERROR, nobody binds 6881,
/// and `run --discover dht` started right after them generates a local run's ids, with
/// experts that no single node holds all of.
#[test]
fn the_readme_private_dht_recipe_converges_in_seconds_and_run_generates_exactly() {
    let (m, id) = model_with_manifest();
    let keys = tempfile::tempdir().expect("key dir");
    let dht = DhtSwarm::new(keys.path(), m.path());
    let states: Vec<_> = (0..5).map(|_| state()).collect();
    // Each node holds half the experts, none all of them.
    let parts = ["0,1", "2,3", "1,2"];
    let start = |i: usize| -> Proc {
        let listen = (i == 0).then_some(dht.bootstrap.as_str());
        let name = format!("recipe{i}");
        dht.serve(&name, parts[i], states[i].path(), listen, &["--no-warm"])
    };
    let mut nodes = vec![start(0)];
    // Alone long enough to have failed (or made) its first announcements and lookups.
    std::thread::sleep(Duration::from_secs(4));
    nodes.push(start(1));
    nodes.push(start(2));
    let joined = Instant::now();
    until_each_found_the_others(&nodes, joined, Duration::from_secs(10));
    eprintln!(
        "the recipe's nodes found each other in {:?}",
        joined.elapsed()
    );
    for (i, n) in nodes.iter().enumerate() {
        let log = n.stderr.lock().expect("stderr lock");
        assert!(!log.contains("ERROR"), "node {i} logged an error: {log}");
        let addr = dht_addr(&log);
        if i == 0 {
            assert_eq!(
                addr.to_string(),
                dht.bootstrap,
                "the first node's --dht-listen"
            );
        } else {
            assert_ne!(
                addr.port(),
                6881,
                "mainline's default port, not a random one"
            );
        }
    }

    // Right after them: a pull and a run that know only the bootstrap address.
    dht.pull_and_run_exactly(
        "recipe-client",
        &id,
        &[],
        [states[3].path(), states[4].path()],
    );
    drop(nodes);
}

/// A seeder alone on its private DHT (the README's order: the seeder first, then `pull`) is
/// found by a `pull` and a `run` that know only its DHT address. Before, a fetching node was a
/// client-mode DHT node, which the lone seeder never took into its routing table: its
/// announcement kept failing with "no other DHT node yet" and the pull found nobody in 30 s.
#[test]
fn a_lone_seeder_on_a_private_dht_is_found_by_pull_and_run() {
    let (m, id) = model_with_manifest();
    let keys = tempfile::tempdir().expect("key dir");
    let dht = DhtSwarm::new(keys.path(), m.path());
    let states: Vec<_> = (0..3).map(|_| state()).collect();
    let seeder = dht.serve(
        "lone-seeder",
        "0-3",
        states[0].path(),
        Some(dht.bootstrap.as_str()),
        &["--no-warm"],
    );
    // Alone long enough to have failed its first announcements.
    std::thread::sleep(Duration::from_secs(3));
    dht.pull_and_run_exactly(
        "lone-client",
        &id,
        &[],
        [states[1].path(), states[2].path()],
    );
    drop(seeder);
}

/// The one bootstrap node of a private DHT restarts at once: a node started after the restart
/// finds the nodes already running (`swarm status` shows every expert covered) and generates
/// exactly from them. Here the running nodes still have the old bootstrap node's address in
/// their routing tables and their lookups reach the new one, so this passes without
/// `BootstrapWatch` too; a bootstrap node down long enough for the others to drop it from
/// their tables (minutes) is the case the watch is for, tested only in its parts (the ping,
/// the answer's id) in `discover::dht`.
#[test]
fn running_nodes_rejoin_a_restarted_bootstrap_node() {
    let (m, id) = model_with_manifest();
    let keys = tempfile::tempdir().expect("key dir");
    let dht = DhtSwarm::new(keys.path(), m.path());
    let states: Vec<_> = (0..6).map(|_| state()).collect();
    let boot = |name: &str, st: &Path| {
        dht.serve(name, "0", st, Some(dht.bootstrap.as_str()), &["--no-warm"])
    };
    let first = boot("boot-before", states[0].path());
    let a = dht.serve("rejoin-a", "1,2", states[1].path(), None, &["--no-warm"]);
    let b = dht.serve("rejoin-b", "2,3", states[2].path(), None, &["--no-warm"]);
    let nodes = vec![first, a, b];
    until_each_found_the_others(&nodes, Instant::now(), Duration::from_secs(20));
    let mut nodes = nodes.into_iter();
    drop(nodes.next());
    std::thread::sleep(Duration::from_millis(500));
    let _again = boot("boot-after", states[3].path());
    let (key, cert) = admit(dht.keys, "rejoin-status");
    let mut args = vec!["swarm", "status", "--model", s(m.path()), "--json"];
    args.extend(dht.member(&key, &cert));
    args.extend(["--model-id", &id]);
    let restarted = Instant::now();
    loop {
        let out = crate::node::stormo_output(&args, None);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if v["uncovered"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(90),
            "a node started after the bootstrap node restarted still finds only it: {v}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    eprintln!(
        "found the running nodes {:?} after the bootstrap node restarted",
        restarted.elapsed()
    );
    dht.pull_and_run_exactly(
        "rejoin-client",
        &id,
        &[],
        [states[4].path(), states[5].path()],
    );
}

/// The fault matrix's membership case (issue 40), through the CLI: a swarm node admits a
/// client whose certificate is valid; a client whose certificate has expired does not start
/// (naming it); a member whose key the server's `--revoked` file names (re-read while the
/// server runs) is refused in the handshake, and with no other source its run ends with an
/// error naming the server, within a bounded time.
#[test]
fn fault_expired_or_revoked_membership_is_refused_in_the_handshake() {
    use std::process::{Command, Stdio};

    let (m, id) = model_with_manifest();
    let keys = tempfile::tempdir().expect("key dir");
    let swarm = create_swarm(keys.path());
    let (skey, scert) = admit(keys.path(), "server");
    let revoked = keys.path().join("revoked.txt");
    std::fs::write(&revoked, "# no one yet\n").expect("revoked file");
    let st = state();
    let server = Proc::start(&[
        "serve",
        "--model",
        s(m.path()),
        "--listen",
        "127.0.0.1:0",
        "--key",
        s(&skey),
        "--swarm",
        &swarm,
        "--cert",
        s(&scert),
        "--revoked",
        s(&revoked),
        "--state-dir",
        s(st.path()),
        "--expert-cache",
        "0",
    ]);
    let addr = server.line.split_once('@').expect("KEY@ADDR").1;
    // `stormo run` with every expert from the server alone; its exit status, JSON and stderr.
    let run = |key: &Path, cert: &Path| {
        let cst = state();
        let t0 = Instant::now();
        let out = Command::new(crate::demo::stormo_exe())
            .args([
                "run",
                "--model",
                s(m.path()),
                "--prompt-ids",
                "1,2,3,4,5,6,7,8",
                "--max-new-tokens",
                "12",
                "--json",
                "--no-local-experts",
                "--state-dir",
                s(cst.path()),
                "--key",
                s(key),
                "--swarm",
                &swarm,
                "--cert",
                s(cert),
                "--peer",
                &server.line,
                "--model-id",
                &id,
            ])
            .stdin(Stdio::null())
            .output()
            .expect("run stormo");
        (out, t0.elapsed())
    };

    // A valid certificate: admitted, the ids of a local run.
    let (want, _) = run_ids(m.path(), state().path(), &[]);
    let (good_key, good_cert) = admit(keys.path(), "member");
    let (out, _) = run(&good_key, &good_cert);
    assert!(
        out.status.success(),
        "a member was refused: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: Value = serde_json::from_slice(&out.stdout).expect("run --json");
    let got: Vec<u64> = j["generated_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(|x| x.as_u64())
        .collect();
    assert_eq!(got, want, "a member's ids differ from a local run");

    // An expired certificate (valid for 1 s, then waited out): refused.
    let old_key = keys.path().join("old.key");
    stormo(&["key", "generate", "--out", s(&old_key)]);
    let old_cert = admit_for(keys.path(), s(&old_key), Some("1s"), "old");
    std::thread::sleep(Duration::from_millis(2100));
    // The client itself refuses to start on it, naming the certificate and its expiry (the
    // server's refusal of an expired certificate presented anyway is
    // `faults::fault_an_expired_membership_is_refused_by_the_server_in_the_handshake`).
    let (out, _) = run(&old_key, &old_cert);
    assert!(
        !out.status.success(),
        "a client with an expired certificate generated: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("old.cert") && err.contains("expired"),
        "the error does not name the expired certificate: {err}"
    );

    // The member's key revoked while the server runs: refused from then on.
    let member_pub = stormo(&["key", "show", "--key", s(&good_key)]);
    let member_pub = member_pub
        .split_whitespace()
        .find(|w| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("key show printed no key: {member_pub}"))
        .to_string();
    std::fs::write(&revoked, format!("# revoked\n{member_pub}\n")).expect("revoke");
    let (out, took) = run(&good_key, &good_cert);
    assert!(
        !out.status.success(),
        "a revoked member generated: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(addr),
        "the error does not name the peer {addr}: {err}"
    );
    assert!(took < Duration::from_secs(60), "the refusal took {took:?}");
    drop(server);
}
