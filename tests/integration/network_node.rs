//! A [`Node`](stormo_node::node::Node) built as `stormo run` builds one, its experts from
//! peers over real QUIC on 127.0.0.1: peers first with the local disk behind lying or dead
//! peers, the expert directory kept between runs, and a server under many fetchers. Moved out
//! of `network.rs` (the helpers and the peer tier's own tests), which was over 1,500 lines.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use stormo_engine::moe::ExpertData;
use stormo_engine::tiers::Tier;
use stormo_engine::ModelFiles;
use stormo_manifests::SecretKey;
use stormo_net::serve::{Holdings, ServeConfig};
use stormo_net::tier::{PeerConfig, PeerTier};
use stormo_net::tls::Admission;
use stormo_net::{self as net};

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

    // A smaller limit evicts down to it, files included.
    let m = stormo_manifests::read_manifest(&f.dir.path().join("stormo-manifest.bin"))
        .expect("manifest")
        .0;
    let rec = m.experts[0].len;
    let small = net::expert_dir::ExpertDir::open(
        store.path(),
        f.id,
        2 * rec,
        Arc::new(m),
        ModelFiles::open(f.dir.path())
            .expect("files")
            .layout
            .schemas
            .clone(),
    )
    .expect("reopen");
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
