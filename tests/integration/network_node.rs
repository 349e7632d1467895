//! A [`Node`](stormo_node::node::Node) built as `stormo run` builds one, its experts from
//! peers over real QUIC on 127.0.0.1: peers first with the local disk behind lying or dead
//! peers, the expert directory kept between runs, and a server under many fetchers. Moved out
//! of `network.rs` (the helpers and the peer tier's own tests), which was over 1,500 lines.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use stormo_engine::generate::{greedy, Timings};
use stormo_engine::moe::ExpertData;
use stormo_engine::tiers::Tier;
use stormo_engine::{LoadOptions, ModelFiles};
use stormo_manifests::SecretKey;
use stormo_net::serve::{Holdings, ServeConfig};
use stormo_net::tier::{PeerConfig, PeerTier};
use stormo_net::tls::Admission;
use stormo_net::{self as net};
use stormo_node::config::{LocalExperts, NodeConfig, PeersConfig};
use stormo_tests::{fixture, Reference};

use crate::network::*;

/// A node with its own experts that asks peers first (`--peers-first`): one peer lies
/// (corrupt files) and one dies after a few records; the run finishes with the reference ids
/// from the local disk, and `--json` counts the peer loads, failures and fallbacks.
#[test]
fn peers_first_falls_back_to_the_local_disk_when_peers_lie_or_die() {
    let name = "gptoss-tiny-mxfp4";
    let f = setup(name);
    let bad_dir = corrupted_copy(f.dir.path());
    let liar = serve_dir(90, bad_dir.path(), None, allow_client());
    let (h, _e) = stormo_node::experts::open_holdings(f.dir.path(), None, &expert_args(), None)
        .expect("holdings");
    let cell = Arc::new(OnceLock::new());
    let dying = start_node(
        91,
        Holdings {
            experts: Arc::new(KillAfter {
                inner: h.experts.clone(),
                left: AtomicUsize::new(6),
                handle: cell.clone(),
            }),
            ..h
        },
        allow_client(),
    );
    cell.set(dying.handle.clone()).expect("set once");
    let mut args = peer_args(&f, vec![dying.addr(), liar.addr()]);
    args.peers_first = true;
    args.timeouts = PeerConfig::with_timeout(Duration::from_secs(2));
    let (got, want, j, tiers) = run_node(&f, name, &args, false);
    assert_eq!(got, want, "ids when peers lie or die");
    assert!(
        num(&j, "peer_loads") > 0,
        "the dying peer served nothing first: {j}"
    );
    assert!(num(&j, "peer_bytes") > 0, "{j}");
    // Each peer's verified bytes, by name: at least the records they completed (the verified
    // part of failed tries counts too). A race the local disk won (`peer_local_wins`) hands
    // its record over through the network tier, so it counts in `peer_bytes` but is no
    // peer's.
    let by_peer = j["peer_bytes_by_peer"]
        .as_object()
        .expect("peer_bytes_by_peer");
    assert_eq!(by_peer.len(), 2, "{j}");
    let sum: u64 = by_peer.values().map(|v| v.as_u64().expect("bytes")).sum();
    let largest = stormo_manifests::read_manifest(&f.dir.path().join("stormo-manifest.bin"))
        .expect("manifest")
        .0
        .experts
        .iter()
        .map(|e| e.len)
        .max()
        .expect("experts");
    let local = num(&j, "peer_local_wins") * largest;
    assert!(sum + local >= num(&j, "peer_bytes"), "{j}");
    assert!(
        by_peer.contains_key(&dying.addr().to_string()),
        "named as KEY@ADDR: {j}"
    );
    assert_eq!(
        num(&j, "peer_striped_loads"),
        0,
        "tiny experts are never striped: {j}"
    );
    assert!(num(&j, "peer_failures") > 0, "{j}");
    assert!(num(&j, "fallbacks") > 0, "{j}");
    assert_eq!(
        num(&j, "fallbacks"),
        num(&j, "peer_failures"),
        "each failure fell back: {j}"
    );
    assert!(num(&j, "disk_loads") > 0, "{j}");
    let fails = tiers.peer_tier().expect("peer tier").failures();
    assert!(fails[1].1 > 0, "the liar was not named: {fails:?}");
}

/// `--expert-dir`: experts fetched from peers are kept there; with the peers gone, the next
/// run gets the same ids from the directory; a record damaged on disk is caught when read
/// back and fetched again; a lower limit evicts down to it.
#[test]
fn expert_dir_keeps_fetched_experts_for_the_next_run() {
    let name = "qwen3moe-tiny";
    let f = setup(name);
    let store = tempfile::tempdir().expect("tempdir");
    let mut peer = serve_dir(100, f.dir.path(), None, allow_client());
    let mut args = peer_args(&f, vec![peer.addr()]);
    args.keep = keep_in(store.path());
    let (got, want, j, tiers) = run_node(&f, name, &args, true);
    assert_eq!(got, want, "first run, from the peer");
    assert!(num(&j, "peer_loads") > 0, "{j}");
    // Experts evicted from RAM come back from the directory, not the peer, already in run 1.
    assert!(num(&j, "dir_loads") > 0, "{j}");
    // Stores run in the background after each load: wait for them.
    let dir = tiers.expert_dir().cloned().expect("expert dir");
    settle(&dir);
    let held = dir.len();
    assert!(held > 0, "nothing was stored");
    let root = dir.root().to_path_buf();
    assert!(root.ends_with(f.id.to_hex()));
    let files: Vec<_> = std::fs::read_dir(&root).expect("dir").flatten().collect();
    assert_eq!(
        files.len(),
        held,
        "one file per record, no temporary files left"
    );
    // This process owns the folder while a handle lives: let go of it for the runs below.
    drop(dir);
    drop(tiers);
    peer.kill();

    // Second run: no peers at all, the experts come from the directory.
    let mut again = peer_args(&f, Vec::new());
    again.keep = keep_in(store.path());
    let (got, _, j, _) = run_node(&f, name, &again, true);
    assert_eq!(got, want, "second run, from the expert directory");
    assert!(num(&j, "dir_loads") > 0, "{j}");
    assert_eq!(num(&j, "peer_loads"), 0, "{j}");

    // A damaged record is refused when read back, deleted, and fetched from a peer again.
    let victim = files[0].path();
    let mut b = std::fs::read(&victim).expect("record");
    b[0] ^= 1;
    std::fs::write(&victim, b).expect("damage");
    let peer2 = serve_dir(101, f.dir.path(), None, allow_client());
    let mut third = peer_args(&f, vec![peer2.addr()]);
    third.keep = keep_in(store.path());
    let (got, _, j, t3) = run_node(&f, name, &third, true);
    assert_eq!(got, want, "third run, one record damaged");
    settle(t3.expert_dir().expect("expert dir"));
    assert!(
        num(&j, "dir_failures") > 0,
        "the damage was not caught: {j}"
    );
    assert!(num(&j, "fallbacks") > 0, "{j}");
    drop(t3);

    // A smaller limit evicts down to it, files included.
    let m = stormo_manifests::read_manifest(&f.dir.path().join("stormo-manifest.bin"))
        .expect("manifest")
        .0;
    let rec = m.experts[0].len;
    let (m, schemas) = (
        Arc::new(m),
        ModelFiles::open(f.dir.path())
            .expect("files")
            .layout
            .schemas
            .clone(),
    );
    // The third run's node lets go of the folder (and its lock) as its runtime's last tasks
    // end, a moment after it is dropped.
    let until = Instant::now() + Duration::from_secs(10);
    let small = loop {
        let d = net::expert_dir::ExpertDir::open(
            store.path(),
            f.id,
            2 * rec,
            m.clone(),
            schemas.clone(),
        )
        .expect("reopen");
        if !d.is_shared() {
            break d;
        }
        assert!(
            Instant::now() < until,
            "the folder is still owned after 10 s"
        );
        drop(d);
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(small.len(), 2);
    assert_eq!(std::fs::read_dir(&root).expect("dir").count(), 2);
}

/// Many concurrent fetchers (4 connections, 32 requests) against one slow server with
/// per-peer and node-wide limits: the server answers some `busy`, every request ends with
/// data (a busy answer is retried in a later round) or `busy` in bounded time, the server's
/// buffered bytes stay within its limit, and it keeps serving afterwards.
#[test]
fn many_fetchers_get_data_or_busy_and_server_memory_stays_bounded() {
    let name = "qwen3moe-tiny";
    let f = setup(name);
    let (h, _e) = stormo_node::experts::open_holdings(f.dir.path(), None, &expert_args(), None)
        .expect("holdings");
    let max_record = h
        .manifest
        .experts
        .iter()
        .map(|e| e.len)
        .max()
        .expect("experts");
    let keys: Vec<_> = h
        .manifest
        .experts
        .iter()
        .map(|e| {
            stormo_engine::tiers::ExpertId::from_indices(e.id.layer.into(), e.id.expert.into())
        })
        .collect();
    let node_limit = 6;
    let node = start_node_with(
        110,
        Holdings {
            experts: Arc::new(Slow {
                inner: h.experts.clone(),
                delay: Duration::from_millis(150),
            }),
            ..h
        },
        ServeConfig {
            per_peer: 4,
            node_limit,
            admission: Admission::Any,
            ..ServeConfig::default()
        },
    );
    let files = ModelFiles::open(f.dir.path()).expect("model files");
    let manifest = Arc::new(
        stormo_manifests::read_manifest(&f.dir.path().join("stormo-manifest.bin"))
            .expect("manifest")
            .0,
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let mut tiers = Vec::new();
    let mut sent = 0;
    for c in 0..4u8 {
        let t = PeerTier::connect(
            &SecretKey::from_seed(&[120 + c; 32]),
            &[node.addr()],
            manifest.clone(),
            f.id,
            files.layout.schemas.clone(),
            PeerConfig {
                hedge_max: Duration::from_secs(60),
                hedge_min: Duration::from_secs(60),
                ..quick()
            },
            None,
        )
        .expect("client");
        let batch: Vec<_> = keys
            .iter()
            .cycle()
            .skip(c as usize * 8)
            .take(8)
            .copied()
            .collect();
        sent += batch.len();
        let tx = tx.clone();
        t.load(
            &batch,
            stormo_engine::tiers::Priority::Demand,
            Arc::new(
                move |k: stormo_engine::tiers::ExpertId,
                      r: stormo_engine::Result<Arc<ExpertData>>| {
                    let _ = tx.send((k, r.map(|_| ()).map_err(|e| e.to_string())));
                },
            ),
        );
        tiers.push(t);
    }
    let (mut ok, mut busy) = (0, 0);
    for _ in 0..sent {
        let (k, r) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a request hung");
        match r {
            Ok(()) => ok += 1,
            Err(e) if e.contains("busy") => busy += 1,
            Err(e) => panic!("expert {k}: neither data nor busy: {e}"),
        }
    }
    assert_eq!(sent, 32);
    assert!(ok > 0, "{ok} answered, {busy} busy");
    let stats = &node.handle.stats;
    assert!(stats.busy.load(Ordering::Relaxed) > 0);
    let peak = stats.buffered_peak.load(Ordering::Relaxed);
    assert!(peak > 0, "the gauge never moved");
    assert!(
        peak <= node_limit as u64 * max_record,
        "{peak} bytes buffered, more than {node_limit} records"
    );
    for t in &tiers {
        t.close();
    }
    let until = Instant::now() + Duration::from_secs(5);
    while stats.buffered.load(Ordering::Relaxed) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        stats.buffered.load(Ordering::Relaxed),
        0,
        "answers left in memory"
    );
    // Still serving.
    let rt = runtime();
    let (id, _) = rt
        .block_on(net::tier::fetch_manifest(
            &client_key(),
            &node.addr(),
            None,
            quick(),
        ))
        .expect("the node still serves");
    assert_eq!(id, f.id);
}

/// A node as `stormo serve` builds one from a dense-only folder (no local experts, `args`'s
/// peers), keeping its peers dialled as a server does (`run` does not), with its key and
/// state in the returned folder.
fn node_keeping_peers_dialled(
    f: &Fixture,
    args: &PeersConfig,
) -> (stormo_node::node::Node, tempfile::TempDir) {
    let state = tempfile::tempdir().expect("tempdir");
    let mut args = args.clone();
    let key = state.path().join("client.key");
    client_key().write_new(&key).expect("key file");
    args.key = Some(key);
    let mut experts = expert_args();
    experts.cache = stormo_node::config::CacheBudget::Bytes(0);
    let node = stormo_node::node::Node::start(NodeConfig {
        model: f.dir.path().to_path_buf(),
        state_dir: state.path().join("state"),
        experts,
        local: LocalExperts::None,
        context: 512,
        peers: args,
        listen: None,
        swarm: None,
    })
    .expect("the node starts");
    node.keep_peers_dialled();
    (node, state)
}

/// A serving node does not hold its listener back for a peer that does not answer: before,
/// building it waited for every `--peer`'s handshake, so a silent peer (a loopback socket that
/// reads nothing) held `stormo serve` until the handshake gave up (the QUIC idle timeout,
/// 10 s, with a longer connect timeout; 3 s with the default one). A node that only fetches
/// (`run`) still waits, so that its first load knows what its peers hold.
#[test]
fn a_serving_node_does_not_wait_for_a_silent_peer_to_start() {
    let f = setup("qwen3moe-tiny");
    let (dead, _sink) = dead_peer();
    let mut args = peer_args(&f, vec![dead]);
    args.timeouts.connect_timeout = Duration::from_secs(60);
    let state = tempfile::tempdir().expect("tempdir");
    let key = state.path().join("server.key");
    SecretKey::from_seed(&[91; 32])
        .write_new(&key)
        .expect("key file");
    args.key = Some(key);
    let started = Instant::now();
    let node = stormo_node::node::Node::start(NodeConfig {
        model: f.dir.path().to_path_buf(),
        state_dir: state.path().join("state"),
        experts: expert_args(),
        local: LocalExperts::All,
        context: 512,
        peers: args,
        listen: Some(stormo_node::config::ListenConfig {
            addr: "127.0.0.1:0".parse().expect("address"),
            serve: ServeConfig::default(),
            replicas: 0,
        }),
        swarm: None,
    })
    .expect("the node starts");
    let took = started.elapsed();
    // Well below the silent peer's handshake (10 s), whatever the machine's load.
    assert!(
        took < Duration::from_secs(7),
        "the serving node took {took:?} to start beside a silent peer"
    );
    drop(node);
}

/// Regression (`serve --http` hung on a dead sole holder): a node that keeps its peers dialled
/// redialled a peer whose connection was down by taking it out of the peer set and adding it
/// again, every second. Each new entry started the peer's policy over, as a peer never tried:
/// "coming back" after its first failed attempt, so a load with no other holder waited a round
/// for it, found the next new entry untried, and went on until its budget (32 times the peer
/// timeout: 16 minutes at the default 30 s), while `stormo run`, which does not redial, failed
/// in 7 s. Now a generation from a dead sole holder fails as `run`'s does, naming the peer,
/// within a few connection attempts (3 s each).
#[test]
fn a_node_keeping_peers_dialled_fails_fast_when_its_only_holder_is_dead() {
    let name = "gptoss-tiny-mxfp4";
    let f = setup(name);
    let (dead, _sink) = dead_peer();
    let mut args = peer_args(&f, vec![dead.clone()]);
    // The default: the load's budget is 960 s.
    args.timeouts = PeerConfig::with_timeout(Duration::from_secs(30));
    let (node, _state) = node_keeping_peers_dialled(&f, &args);
    // A server's first request comes after some redials.
    std::thread::sleep(Duration::from_millis(2500));
    let prompt = Reference::open(&fixture(name)).ids("input_ids");
    let model = node.load_model(&LoadOptions::default()).expect("model");
    let (tx, rx) = std::sync::mpsc::channel();
    let started = Instant::now();
    let generation = std::thread::spawn(move || {
        let mut sess = model.session(prompt.len() + 4).expect("session");
        let r = greedy(
            &model,
            &mut sess,
            &prompt,
            4,
            &[],
            |_, _| {},
            &mut Timings::default(),
        );
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    // Two or three connection attempts of 3 s and the pauses between them; `run` takes 7 s.
    let bound = Duration::from_secs(20);
    let got = rx.recv_timeout(bound);
    let tier = node.peer_tier().expect("peer tier");
    if got.is_err() {
        // Ends the loads still waiting, so that the test ends.
        tier.close();
    }
    let _ = generation.join();
    let got = got.unwrap_or_else(|_| {
        panic!(
            "the generation was still loading experts from a dead peer after {:?}",
            started.elapsed()
        )
    });
    let e = got.expect_err("a dead peer supplied experts");
    assert!(
        e.contains("no peer could supply expert") && e.contains(&dead.to_string()),
        "{e}"
    );
    assert_eq!(
        tier.connects().len(),
        1,
        "the peer set grew: {:?}",
        tier.connects()
    );
}

/// Regression (the back-off never doubled): the redials above gave each new entry of the dead
/// peer a back-off of 1 s, the first of a peer never tried, so it was dialled (and warned
/// about) every second or two for as long as it stayed down. Now the peer keeps its one
/// entry, each attempt is one more failure of it, and the attempts come further and further
/// apart as its back-off doubles (with 1 s attempts: the second about 1 s after the first
/// failed, then back-offs of 2, 4 and 8 s), not at a steady pace.
#[test]
fn a_dead_peer_kept_dialled_is_dialled_with_a_doubling_back_off() {
    let f = setup("gptoss-tiny-mxfp4");
    let (dead, _sink) = dead_peer();
    let mut args = peer_args(&f, vec![dead.clone()]);
    // Connection attempts of 1 s.
    args.timeouts = PeerConfig::with_timeout(Duration::from_secs(1));
    let (node, _state) = node_keeping_peers_dialled(&f, &args);
    let tier = node.peer_tier().expect("peer tier");
    let until = Instant::now() + Duration::from_secs(16);
    let mut last = tier.connects();
    let mut starts = Vec::new();
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
        let now = tier.connects();
        assert_eq!(
            now.len(),
            1,
            "the dead peer was added to the set again: {now:?}"
        );
        if now[0] > last[0] {
            starts.push(Instant::now());
        }
        last = now;
    }
    let gaps: Vec<f64> = starts
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    // At a steady 1 s back-off the attempts start every 2-3 s (an attempt, the back-off, the
    // next redial tick): 6 or more in the window.
    assert!(
        (2..=4).contains(&starts.len()),
        "{} attempts in 16 s, {gaps:?} s apart",
        starts.len()
    );
    // The gap after a 4 s back-off is the back-off, the attempt (up to 1 s) and the wait for
    // the next redial tick (up to 1 s): 4-6 s. (It asked for 5 s, at that range's edge; this
    // assertion failed once in a full run of the suite on a loaded machine, its gaps not
    // recorded.)
    assert!(
        gaps.windows(2).all(|w| w[1] > w[0]) && gaps.last().is_some_and(|&g| g >= 4.0),
        "attempts {gaps:?} s apart"
    );
    let (_, failures) = tier.failures()[0].clone();
    assert_eq!(failures, tier.connects()[0], "each attempt one failure");
    tier.close();
}
