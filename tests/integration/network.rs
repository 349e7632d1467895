//! The network tier with real QUIC on 127.0.0.1: servers in-process (each on its own tokio
//! runtime, so that one can be killed), a client whose experts all come from peers. The
//! helpers here serve `network_node.rs` (a Node built as `stormo run` builds one) and
//! `network_pull.rs` (`stormo pull`) too.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use stormo_engine::generate::{greedy, Timings};
use stormo_engine::moe::{ExpertData, ExpertProvider};
use stormo_engine::tiers::{ExpertStats, Tier, TierConfig, TieredExperts};
use stormo_engine::{LoadOptions, Model, ModelFiles};
use stormo_manifests::{build, BuildOptions, Hash, ManifestSignature, SecretKey};
use stormo_net::serve::{self, Holdings, ServeConfig, ServerHandle};
use stormo_net::tier::{PeerConfig, PeerTier};
use stormo_net::tls::{Admission, Congestion};
use stormo_net::{self as net, PeerAddr};
use stormo_node::config::{ExpertsConfig, KeepConfig, LocalExperts, NodeConfig, PeersConfig};
use stormo_simulations::swarm::{LinkSpec, Relay, ETHERNET_MTU};
pub(crate) use stormo_testing::runtime;
use stormo_tests::{fixture, Reference, MODEL_FIXTURES};

/// `n` greedy ids after `prompt`, and the session that made them.
pub(crate) fn greedy_ids(
    model: &Model,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, stormo_engine::Session) {
    let mut sess = model.session(prompt.len() + n).expect("session");
    let got = greedy(
        model,
        &mut sess,
        prompt,
        n,
        &[],
        |_, _| {},
        &mut Timings::default(),
    )
    .expect("generation");
    (got, sess)
}

/// Short timeouts so that failure cases finish quickly.
pub(crate) fn quick() -> PeerConfig {
    PeerConfig {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(3),
        idle_timeout: Duration::from_millis(700),
        ..PeerConfig::default()
    }
}

pub(crate) struct Fixture {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) publisher: SecretKey,
    pub(crate) id: Hash,
}

/// A copy of fixture `name` with a manifest built and signed there.
pub(crate) fn setup(name: &str) -> Fixture {
    let dir = crate::manifests::copy_fixture(name);
    sign_dir(dir)
}

/// The model in `dir` with a manifest built and signed there.
pub(crate) fn sign_dir(dir: tempfile::TempDir) -> Fixture {
    let m = build(dir.path(), &BuildOptions::default()).expect("manifest builds");
    let publisher = SecretKey::from_seed(&[42; 32]);
    std::fs::write(dir.path().join("stormo-manifest.bin"), m.encode()).expect("write manifest");
    std::fs::write(
        dir.path().join("stormo-manifest.sig"),
        ManifestSignature::sign(&publisher, &m).to_bytes(),
    )
    .expect("write signature");
    Fixture {
        id: m.model_id(),
        dir,
        publisher,
    }
}

pub(crate) fn expert_args() -> ExpertsConfig {
    ExpertsConfig {
        prefetch: true,
        io_threads: 2,
        hot_store: false,
        ..ExpertsConfig::default()
    }
}

/// A peer server on its own runtime (the shared harness), closed when dropped.
pub(crate) type Node = stormo_testing::Server;

/// Serves `holdings` as node key `seed` to `admission`.
pub(crate) fn start_node(seed: u8, holdings: Holdings, admission: Admission) -> Node {
    start_node_with(
        seed,
        holdings,
        ServeConfig {
            admission,
            ..ServeConfig::default()
        },
    )
}

/// Serves `holdings` as node key `seed` with `cfg`.
pub(crate) fn start_node_with(seed: u8, holdings: Holdings, cfg: ServeConfig) -> Node {
    Node::start(seed, holdings, cfg)
}

/// A node serving the experts of `dir` named by `only` (an --only-experts spec).
pub(crate) fn serve_dir(seed: u8, dir: &Path, only: Option<&str>, admission: Admission) -> Node {
    let (h, _experts) =
        stormo_node::experts::open_holdings(dir, None, &expert_args(), only).expect("holdings");
    start_node(seed, h, admission)
}

pub(crate) const CLIENT_SEED: u8 = 1;

pub(crate) fn client_key() -> SecretKey {
    SecretKey::from_seed(&[CLIENT_SEED; 32])
}

pub(crate) fn allow_client() -> Admission {
    Admission::Keys([*client_key().public().as_bytes()].into())
}

/// Every expert `e` of `n` with `e % 3 != i`: three such nodes hold each expert twice and no
/// node holds all.
pub(crate) fn two_of_three(i: usize, n: usize) -> String {
    let v: Vec<String> = (0..n)
        .filter(|e| e % 3 != i)
        .map(|e| e.to_string())
        .collect();
    v.join(",")
}

pub(crate) fn peer_args(f: &Fixture, peers: Vec<PeerAddr>) -> PeersConfig {
    PeersConfig {
        peers,
        trust: vec![f.publisher.public()],
        timeouts: PeerConfig::with_timeout(Duration::from_secs(3)),
        ..PeersConfig::default()
    }
}

/// Keeps verified experts in `dir` (`--expert-dir DIR`, the default limit).
pub(crate) fn keep_in(dir: &Path) -> Option<KeepConfig> {
    Some(KeepConfig {
        dir: Some(dir.to_path_buf()),
        limit: (16u64 << 30).into(),
    })
}

/// The peer tier of a client of `f` (key [`CLIENT_SEED`]).
pub(crate) fn peer_tier(f: &Fixture, peers: Vec<PeerAddr>) -> Arc<PeerTier> {
    peer_tier_with(f, peers, quick())
}

/// Timeouts for a peer behind a slow relay: tries of `request_timeout`, a generous connect.
pub(crate) fn slow_link_config(request_timeout: Duration) -> PeerConfig {
    PeerConfig {
        connect_timeout: Duration::from_secs(10),
        request_timeout,
        idle_timeout: Duration::from_secs(5),
        ..PeerConfig::default()
    }
}

/// [`peer_tier`] with the timeouts of `cfg`.
pub(crate) fn peer_tier_with(f: &Fixture, peers: Vec<PeerAddr>, cfg: PeerConfig) -> Arc<PeerTier> {
    client_tier(f.dir.path(), &peer_args(f, peers), &client_key(), cfg)
}

/// The network tier of a client with key `key` of the model in `dir`, over the peers of
/// `args` (whose manifest checks accept it), with the timeouts of `cfg`, on a runtime of its
/// own.
pub(crate) fn client_tier(
    dir: &Path,
    args: &PeersConfig,
    key: &SecretKey,
    cfg: PeerConfig,
) -> Arc<PeerTier> {
    let files = ModelFiles::open(dir).expect("model files");
    let rt = runtime();
    let (m, id, _) =
        stormo_node::manifest::resolve_manifest(dir, args, key, &rt).expect("manifest accepted");
    serve::check_layout(&m, &files.layout.sizes()).expect("layout");
    let rt = Arc::new(rt);
    let t = PeerTier::connect(
        key,
        &args.peers,
        Arc::new(m),
        id,
        files.layout.schemas.clone(),
        cfg,
        Some(rt.handle().clone()),
    )
    .expect("tier");
    Arc::new(t.keep_runtime(rt))
}

/// Greedy ids of fixture `name` with every expert from `tier` (no local experts), at the
/// smallest RAM budget (one layer's top-k) with prefetch, so that experts are fetched again
/// and again.
pub(crate) fn generate_from(
    f: &Fixture,
    name: &str,
    tier: Arc<PeerTier>,
) -> (Vec<u32>, Vec<u32>, u64) {
    let (got, want, stats) = generate_with(f, name, tier, true);
    (got, want, stats.tiers[0].loads)
}

/// [`generate_from`] with or without prefetch (without, no load is left running when it
/// returns), and the cache's statistics.
pub(crate) fn generate_with(
    f: &Fixture,
    name: &str,
    tier: Arc<PeerTier>,
    prefetch: bool,
) -> (Vec<u32>, Vec<u32>, ExpertStats) {
    let files = ModelFiles::open(f.dir.path()).expect("model files");
    let r = Reference::open(&fixture(name));
    let prompt = r.ids("input_ids");
    let want = r.ids("generated_ids");
    let sizes = files.layout.sizes();
    let cfg = TierConfig {
        budget: 0,
        prefetch,
        ..TierConfig::default()
    };
    let t = Arc::new(TieredExperts::new(
        vec![tier as Arc<dyn Tier>],
        sizes,
        files.cfg.top_k,
        &cfg,
    ));
    let model = Model::new(files, t.clone(), &LoadOptions::default()).expect("model");
    let (got, _) = greedy_ids(&model, &prompt, want.len());
    (got, want, t.stats())
}

pub(crate) fn experts_per_layer(f: &Fixture) -> usize {
    let files = ModelFiles::open(f.dir.path()).expect("model files");
    files.layout.parts.iter().map(Vec::len).max().unwrap_or(0)
}

/// Three nodes, each holding two thirds of the experts; a client with no local experts
/// generates exactly the reference ids on every fixture.
#[test]
fn peers_holding_parts_supply_exact_generation_on_every_fixture() {
    for name in MODEL_FIXTURES {
        let f = setup(name);
        let n = experts_per_layer(&f);
        let nodes: Vec<Node> = (0..3)
            .map(|i| {
                serve_dir(
                    10 + i as u8,
                    f.dir.path(),
                    Some(&two_of_three(i, n)),
                    allow_client(),
                )
            })
            .collect();
        let tier = peer_tier(&f, nodes.iter().map(Node::addr).collect());
        assert!(
            tier.inventories().iter().all(|i| i.is_some_and(|n| n > 0)),
            "{name}: every peer reached"
        );
        let (got, want, loads) = generate_from(&f, name, tier.clone());
        assert_eq!(got, want, "{name}: ids with every expert from peers");
        assert!(loads > 0, "{name}: no expert came from peers");
        let served: u64 = nodes.iter().map(Node::served).sum();
        assert!(served >= loads, "{name}: {served} served for {loads} loads");
        assert!(
            tier.failures().iter().all(|(_, n)| *n == 0),
            "{name}: {:?}",
            tier.failures()
        );
        tier.close();
    }
}

/// A node pacing its answers with BBR (`stormo serve --congestion bbr`) or with the default
/// `tolerant` controller (which ignores losses on an empty queue), behind a relay that delays
/// and drops datagrams, supplies exactly the reference generation.
#[test]
fn a_bbr_or_tolerant_paced_peer_over_a_lossy_link_gives_the_reference_ids() {
    let name = "gptoss-tiny-mxfp4";
    let f = setup(name);
    for (seed, congestion) in [(90, Congestion::Bbr), (91, Congestion::Tolerant)] {
        let (h, _experts) =
            stormo_node::experts::open_holdings(f.dir.path(), None, &expert_args(), None)
                .expect("holdings");
        let node = start_node_with(
            seed,
            h,
            ServeConfig {
                admission: allow_client(),
                congestion,
                ..ServeConfig::default()
            },
        );
        let relay = Relay::start(
            node.addr().addr,
            LinkSpec {
                delay: Duration::from_millis(5),
                loss: 0.02,
                ..LinkSpec::ideal()
            },
            11,
        )
        .expect("relay");
        let tier = peer_tier(
            &f,
            vec![PeerAddr {
                key: node.addr().key,
                addr: relay.addr(),
            }],
        );
        let (got, want, loads) = generate_from(&f, name, tier.clone());
        assert_eq!(got, want, "ids through a {congestion:?}-paced peer");
        assert!(loads > 0 && node.served() >= loads);
        assert!(
            relay.counts().lost > 0,
            "the link lost nothing: no loss was tested"
        );
        tier.close();
    }
}

/// A copy of the model folder `src` whose experts are then corrupted (its manifest still
/// describes the original bytes).
pub(crate) fn corrupted_copy(src: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for e in std::fs::read_dir(src).expect("dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copy");
    }
    corrupt_experts(dir.path());
    dir
}

/// Flips one byte of every expert tensor's data in `dir` (after the manifest was built).
pub(crate) fn corrupt_experts(dir: &Path) {
    let files = ModelFiles::open(dir).expect("model files");
    let mut edits: Vec<(std::path::PathBuf, u64)> = Vec::new();
    for layer in &files.layout.parts {
        for parts in layer {
            let p = &parts[0];
            edits.push((
                files.layout.files[p.loc.file].0.clone(),
                p.loc.offset + p.loc.len / 2,
            ));
        }
    }
    drop(files);
    for (path, off) in edits {
        let mut b = std::fs::read(&path).expect("read");
        b[off as usize] ^= 0x5a;
        std::fs::write(&path, b).expect("write");
    }
}

/// A node whose files were corrupted after its manifest was made serves wrong bytes: the
/// client detects it, names it (its failure count), and still generates the exact ids. The
/// statistics count every bad answer as a peer failure and a fallback, though the good peer
/// made up for each inside the network tier (they once said 0 failures, 0 fallbacks).
#[test]
fn corrupt_peer_is_detected_and_named_and_output_is_identical() {
    let name = "qwen3moe-tiny";
    let f = setup(name);
    let bad_dir = corrupted_copy(f.dir.path());
    let bad = serve_dir(20, bad_dir.path(), None, allow_client());
    let good = serve_dir(21, f.dir.path(), None, allow_client());
    let tier = peer_tier(&f, vec![bad.addr(), good.addr()]);
    // No prefetch: no load is still running when the counts are compared.
    let (got, want, stats) = generate_with(&f, name, tier.clone(), false);
    assert_eq!(got, want, "ids with a lying peer");
    let fails = tier.failures();
    assert!(
        fails[0].1 > 0,
        "the corrupt peer was never caught: {fails:?}"
    );
    assert_eq!(fails[1].1, 0, "the good peer was blamed: {fails:?}");
    assert_eq!(fails[0].0, bad.addr());
    let peer = &stats.tiers[0];
    assert_eq!(
        peer.failures,
        u64::from(fails[0].1),
        "one peer failure per bad answer: {stats:?}"
    );
    assert_eq!(
        stats.fallbacks, peer.failures,
        "each made up for by the good peer: {stats:?}"
    );
    tier.close();

    // The same through the tiers `stormo run` composes, as `--json` reports them.
    let args = peer_args(&f, vec![bad.addr(), good.addr()]);
    let (got, _, j, tiers) = run_node(&f, name, &args, true);
    assert_eq!(got, want, "ids with a lying peer, composed as run does");
    let fails = tiers.peer_tier().expect("peer tier").failures();
    assert!(
        fails[0].1 > 0,
        "the corrupt peer was never caught: {fails:?}"
    );
    assert!(
        num(&j, "peer_failures") >= u64::from(fails[0].1),
        "{fails:?}: {j}"
    );
    assert!(num(&j, "fallbacks") > 0, "{j}");
}

/// An expert provider that stalls far past the client's timeouts (a peer that accepts and
/// never answers its requests).
#[derive(Debug)]
pub(crate) struct Stall;

impl ExpertProvider for Stall {
    fn fetch(
        &self,
        _layer: usize,
        _experts: &[usize],
        _out: &mut Vec<Arc<ExpertData>>,
    ) -> stormo_engine::Result<()> {
        std::thread::sleep(Duration::from_secs(4));
        Err(stormo_engine::Error::Expert {
            layer: 0,
            expert: 0,
            reason: "stalled".into(),
        })
    }
}

/// An expert provider that kills its node after a few fetches (a peer dying mid-run).
pub(crate) struct KillAfter {
    pub(crate) inner: Arc<dyn ExpertProvider>,
    pub(crate) left: AtomicUsize,
    pub(crate) handle: Arc<OnceLock<Arc<ServerHandle>>>,
}

impl std::fmt::Debug for KillAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KillAfter")
    }
}

impl ExpertProvider for KillAfter {
    fn fetch(
        &self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<Arc<ExpertData>>,
    ) -> stormo_engine::Result<()> {
        if self.left.fetch_sub(1, Ordering::SeqCst) <= 1 {
            if let Some(h) = self.handle.get() {
                h.close();
            }
        }
        self.inner.fetch(layer, experts, out)
    }
}

/// A peer killed mid-run, a peer that never answers requests, and a peer that never even
/// says hello: the run finishes with the same ids, in bounded time, from the good peer.
#[test]
fn killed_stalled_and_silent_peers_fall_back_to_another() {
    let name = "gptoss-tiny-mxfp4";
    let f = setup(name);
    let start = Instant::now();
    // Killed after 3 records.
    let (h, _e) = stormo_node::experts::open_holdings(f.dir.path(), None, &expert_args(), None)
        .expect("holdings");
    let cell = Arc::new(OnceLock::new());
    let h = Holdings {
        experts: Arc::new(KillAfter {
            inner: h.experts.clone(),
            left: AtomicUsize::new(3),
            handle: cell.clone(),
        }),
        ..h
    };
    let dying = start_node(30, h, allow_client());
    cell.set(dying.handle.clone()).expect("set once");
    // Hello and inventory, then silence on every request.
    let (h, _e) = stormo_node::experts::open_holdings(f.dir.path(), None, &expert_args(), None)
        .expect("holdings");
    let stalled = start_node(
        31,
        Holdings {
            experts: Arc::new(Stall),
            ..h
        },
        allow_client(),
    );
    // Accepts QUIC connections and never says anything.
    let silent_key = SecretKey::from_seed(&[32; 32]);
    let silent_rt = runtime();
    let silent_ep = silent_rt.block_on(async {
        let sc = net::tls::server_config(&silent_key, Admission::Any, 8, Congestion::Cubic)
            .expect("config");
        let ep = net::bind("127.0.0.1:0".parse().expect("address"), Some(sc)).expect("bind");
        let e2 = ep.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(inc) = e2.accept().await {
                if let Ok(c) = inc.await {
                    held.push(c);
                }
            }
        });
        ep
    });
    let silent = PeerAddr {
        key: silent_key.public(),
        addr: silent_ep.local_addr().expect("address"),
    };
    let good = serve_dir(33, f.dir.path(), None, allow_client());
    let tier = peer_tier(&f, vec![dying.addr(), stalled.addr(), silent, good.addr()]);
    let (got, want, _) = generate_from(&f, name, tier.clone());
    assert_eq!(got, want, "ids with failing peers");
    let fails = tier.failures();
    assert!(fails[0].1 > 0, "the killed peer was not noticed: {fails:?}");
    // A stalled demand request is raced by a hedge (and loses); a stalled prefetch times out.
    let lost = tier.races_lost();
    assert!(
        fails[1].1 > 0 || lost[1] > 0,
        "the stalled peer was not noticed: {fails:?}, races lost {lost:?}"
    );
    assert!(fails[2].1 > 0, "the silent peer was not noticed: {fails:?}");
    assert_eq!(fails[3].1, 0, "the good peer was blamed: {fails:?}");
    assert!(good.served() > 0);
    assert!(
        start.elapsed() < Duration::from_secs(40),
        "took {:?}",
        start.elapsed()
    );
    silent_ep.close(0u32.into(), b"");
    silent_rt.shutdown_background();
}

/// Demand loads of `keys` from `tier`, each load's outcome as it completes (each within 60 s).
pub(crate) fn load_all(
    tier: &PeerTier,
    keys: &[stormo_engine::tiers::ExpertId],
) -> Vec<(stormo_engine::tiers::ExpertId, Result<(), String>)> {
    load_all_as(tier, keys, stormo_engine::tiers::Priority::Demand)
}

/// [`load_all`] with `priority` (prefetch loads are not hedged).
pub(crate) fn load_all_as(
    tier: &PeerTier,
    keys: &[stormo_engine::tiers::ExpertId],
    priority: stormo_engine::tiers::Priority,
) -> Vec<(stormo_engine::tiers::ExpertId, Result<(), String>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    tier.load(
        keys,
        priority,
        Arc::new(
            move |k: stormo_engine::tiers::ExpertId, r: stormo_engine::Result<Arc<ExpertData>>| {
                let _ = tx.send((k, r.map(|_| ()).map_err(|e| e.to_string())));
            },
        ),
    );
    keys.iter()
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(60))
                .expect("a load hung")
        })
        .collect()
}

/// A peer address where nothing answers: a UDP socket that swallows every packet, so QUIC
/// handshakes to it run into the connect timeout (as with nothing listening at all, where
/// the port could also be taken by something else meanwhile). Keep the socket alive.
pub(crate) fn dead_peer() -> (PeerAddr, std::net::UdpSocket) {
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let addr = PeerAddr {
        key: SecretKey::from_seed(&[77; 32]).public(),
        addr: sink.local_addr().expect("address"),
    };
    (addr, sink)
}

/// Regression (dead peer paid per expert): every load to a peer that does not answer waited
/// for its own connection attempt, one after another behind the peer's lock, so a run waited
/// 3 s per expert of a layer (6 to 24 s at 8 experts) although the peer was "avoided", and
/// `--peer-timeout` did not shorten the attempts. Now one attempt is made for all the loads
/// waiting, the peer is unreachable for its back-off (loads fail at once, naming it), and the
/// attempt is bounded by `--peer-timeout` when that is shorter than 3 s.
#[test]
fn dead_peer_costs_one_connect_attempt_not_one_per_expert() {
    let name = "gptoss-tiny-mxfp4";
    let f = setup(name);
    let (dead, _sink) = dead_peer();
    let tier = peer_tier(&f, vec![dead.clone()]);
    assert_eq!(tier.connects(), [1], "the attempt at start");
    // Past the first back-off (1 s): the next load connects again, and every other load of
    // the model, all started at once, waits for that one attempt.
    std::thread::sleep(Duration::from_millis(1200));
    let keys: Vec<_> = ModelFiles::open(f.dir.path())
        .expect("model files")
        .layout
        .parts
        .iter()
        .enumerate()
        .flat_map(|(l, experts)| {
            (0..experts.len()).map(move |e| stormo_engine::tiers::ExpertId::from_indices(l, e))
        })
        .collect();
    assert!(keys.len() >= 16, "{} experts", keys.len());
    let started = Instant::now();
    for (k, r) in load_all(&tier, &keys) {
        let e = r.expect_err("a dead peer supplied an expert");
        assert!(e.contains(&dead.to_string()), "expert {k}: {e}");
    }
    let took = started.elapsed();
    // Before: one attempt (1 s with these timeouts) per load, 1 + keys.len() in all. One
    // more is allowed in case the loads are slow to see the second back-off (2 s) begin.
    let connects = tier.connects()[0];
    assert!(
        connects <= 3,
        "{connects} connection attempts for {} loads",
        keys.len()
    );
    assert!(tier.failures()[0].1 <= 3, "{:?}", tier.failures());
    assert!(
        took < Duration::from_secs(10),
        "{} loads took {took:?}",
        keys.len()
    );
    tier.close();

    // As `stormo run` composes it, with no local experts (a pulled folder) and
    // `--peer-timeout 1`: the run fails naming the peer and the 1 s bound (not 3 s).
    let mut args = peer_args(&f, vec![dead.clone()]);
    args.timeouts = PeerConfig::with_timeout(Duration::from_secs(1));
    let (got, _, _, tiers) = try_run_node(&f, name, &args, true);
    let e = got.expect_err("a run against only a dead peer cannot succeed");
    assert!(
        e.contains(&dead.to_string()) && e.contains("no answer within 1.0s"),
        "{e}"
    );
    let connects = tiers.peer_tier().expect("peer tier").connects()[0];
    assert!(connects <= 3, "{connects} connection attempts");

    // With its own experts asked after the peers (`--peers-first`), the run falls back to
    // the disk at once for every expert, and gives the reference ids.
    args.peers_first = true;
    let (got, want, j, tiers) = run_node(&f, name, &args, false);
    assert_eq!(got, want, "ids with a dead peer first");
    assert!(num(&j, "disk_loads") > 0, "{j}");
    let failed = num(&j, "peer_failures");
    assert_eq!(num(&j, "fallbacks"), failed, "{j}");
    // Attempts follow the back-off (1, 2, 4, ... s), not the loads: 8 would take minutes.
    let connects = tiers.peer_tier().expect("peer tier").connects()[0];
    assert!(
        connects < 8 && u64::from(connects) < failed,
        "{connects} connection attempts, {failed} loads failed at the peer: {j}"
    );
}

/// In private mode a node key not on the allow-list cannot connect; a listed one can.
#[test]
fn unknown_node_key_is_refused_in_private_mode() {
    let f = setup("qwen3moe-tiny");
    let node = serve_dir(40, f.dir.path(), None, allow_client());
    let rt = runtime();
    let stranger = SecretKey::from_seed(&[99; 32]);
    let e = rt
        .block_on(net::tier::fetch_manifest(
            &stranger,
            &node.addr(),
            None,
            quick(),
        ))
        .expect_err("a stranger was admitted");
    assert!(format!("{e:#}").contains(&node.addr().to_string()), "{e:#}");
    assert!(format!("{e:#}").contains("a key was refused"), "{e:#}");
    assert_eq!(node.handle.stats.connections.load(Ordering::Relaxed), 0);
    let (id, bytes) = rt
        .block_on(net::tier::fetch_manifest(
            &client_key(),
            &node.addr(),
            None,
            quick(),
        ))
        .expect("the allowed key is admitted");
    assert_eq!(id, f.id);
    assert_eq!(Hash::of(&bytes), f.id);
}

/// A manifest not signed by the trusted key, or whose id is not the pinned one, is refused,
/// whether local or fetched from a peer.
#[test]
fn untrusted_or_unpinned_manifest_is_refused() {
    let f = setup("qwen3moe-tiny");
    let bytes = std::fs::read(f.dir.path().join("stormo-manifest.bin")).expect("manifest");
    let sig = std::fs::read(f.dir.path().join("stormo-manifest.sig")).expect("sig");
    let other = SecretKey::from_seed(&[7; 32]).public();
    net::accept_manifest(&bytes, Some(&sig), &[f.publisher.public()], None).expect("trusted");
    net::accept_manifest(&bytes, None, &[], Some(f.id)).expect("pinned");
    let e = net::accept_manifest(&bytes, Some(&sig), &[other], None).expect_err("untrusted");
    assert!(format!("{e:#}").contains("signature"), "{e:#}");
    let e = net::accept_manifest(&bytes, Some(&sig), &[], Some(Hash::of(b"x"))).expect_err("pin");
    assert!(format!("{e:#}").contains("--model-id"), "{e:#}");
    let e = net::accept_manifest(&bytes, Some(&sig), &[], None).expect_err("no policy");
    assert!(format!("{e:#}").contains("--trust"), "{e:#}");
    // Fetched from a peer (no local manifest): the pinned id must match.
    let node = serve_dir(50, f.dir.path(), None, allow_client());
    let client_dir = tempfile::tempdir().expect("tempdir");
    let rt = runtime();
    let mut args = peer_args(&f, vec![node.addr()]);
    args.trust.clear();
    args.model_id = Some(Hash::of(b"another model"));
    let e = stormo_node::manifest::resolve_manifest(client_dir.path(), &args, &client_key(), &rt)
        .expect_err("another id accepted");
    assert!(format!("{e:#}").contains("does not serve model"), "{e:#}");
    args.model_id = Some(f.id);
    let (_, id, _) =
        stormo_node::manifest::resolve_manifest(client_dir.path(), &args, &client_key(), &rt)
            .expect("pinned id");
    assert_eq!(id, f.id);
}

/// A node with no manifest of its own asks every peer at once: peers that never answer
/// (loopback sockets that read nothing) and one serving another model cost nothing once a good
/// peer has answered. Asked one by one, as before, each silent peer listed first held the
/// fetch until its handshake gave up (the QUIC idle timeout, `tls::IDLE_TIMEOUT`, 10 s), so
/// three of them 30 s, before the good one was tried.
#[test]
fn a_manifest_fetch_does_not_wait_for_a_silent_or_wrong_peer() {
    let f = setup("qwen3moe-tiny");
    let other = setup("gptoss-tiny-mxfp4");
    let good = serve_dir(52, f.dir.path(), None, allow_client());
    let wrong = serve_dir(53, other.dir.path(), None, allow_client());
    // Bound and kept open, never read: QUIC's handshake gets no answer and no refusal.
    let sockets: Vec<_> = (0..3)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("udp socket"))
        .collect();
    let mut peers: Vec<PeerAddr> = sockets
        .iter()
        .zip(54u8..)
        .map(|(s, seed)| PeerAddr {
            key: SecretKey::from_seed(&[seed; 32]).public(),
            addr: s.local_addr().expect("address"),
        })
        .collect();
    peers.extend([wrong.addr(), good.addr()]);
    let client_dir = tempfile::tempdir().expect("tempdir");
    let rt = runtime();
    let mut args = peer_args(&f, peers);
    args.trust.clear();
    args.model_id = Some(f.id);
    args.timeouts.connect_timeout = Duration::from_secs(60);
    let start = Instant::now();
    let (_, id, bytes) =
        stormo_node::manifest::resolve_manifest(client_dir.path(), &args, &client_key(), &rt)
            .expect("the good peer's manifest");
    assert_eq!(id, f.id);
    assert_eq!(Hash::of(&bytes), f.id);
    // Less than one silent peer's handshake wait, let alone three.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "the fetch waited {:?} for the silent peers",
        start.elapsed()
    );
    // With only the wrong peer, the error says why.
    args.peers = vec![wrong.addr()];
    let e = stormo_node::manifest::resolve_manifest(client_dir.path(), &args, &client_key(), &rt)
        .expect_err("another model's peer supplied the manifest");
    let e = format!("{e:#}");
    assert!(e.contains("no peer supplied the manifest"), "{e}");
    assert!(e.contains("does not serve model"), "{e}");
}

/// Malformed and oversized frames close only the offending connection; the node keeps
/// serving others.
#[test]
fn malformed_or_oversized_message_closes_only_that_connection() {
    let f = setup("qwen3moe-tiny");
    let node = serve_dir(60, f.dir.path(), None, allow_client());
    let rt = runtime();
    let key = client_key();
    for garbage in [
        vec![0xff, 0xff, 0xff, 0x7f, 3], // oversized length
        vec![2, 0, 0, 0, 0x7f, 0],       // reserved tag
        vec![3, 0, 0, 0, 3, 0xff, 0xff], // Get with a truncated body
    ] {
        let reason = rt.block_on(async {
            let (ep, conn) = node.dial(&key).await;
            let (mut send, _recv) = conn.open_bi().await.expect("stream");
            send.write_all(&garbage).await.expect("write");
            let r = tokio::time::timeout(Duration::from_secs(5), conn.closed())
                .await
                .expect("the server closed the connection");
            ep.close(0u32.into(), b"");
            r
        });
        match reason {
            quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(
                c.error_code,
                quinn::VarInt::from_u32(u32::from(stormo_wire::ErrorCode::PROTOCOL_VIOLATION.0))
            ),
            other => panic!("closed for another reason: {other}"),
        }
    }
    assert_eq!(node.handle.stats.violations.load(Ordering::Relaxed), 3);
    let (id, _) = rt
        .block_on(net::tier::fetch_manifest(&key, &node.addr(), None, quick()))
        .expect("the node still serves");
    assert_eq!(id, f.id);
}

/// An expert provider that answers, but only after `delay` (a slow peer).
pub(crate) struct Slow {
    pub(crate) inner: Arc<dyn ExpertProvider>,
    pub(crate) delay: Duration,
}

impl std::fmt::Debug for Slow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Slow")
    }
}

impl ExpertProvider for Slow {
    fn fetch(
        &self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<Arc<ExpertData>>,
    ) -> stormo_engine::Result<()> {
        std::thread::sleep(self.delay);
        self.inner.fetch(layer, experts, out)
    }
}

/// A node serving every expert of `dir`, each answer delayed by `delay`.
pub(crate) fn serve_slow(seed: u8, dir: &Path, delay: Duration, admission: Admission) -> Node {
    let (h, _e) =
        stormo_node::experts::open_holdings(dir, None, &expert_args(), None).expect("holdings");
    let h = Holdings {
        experts: Arc::new(Slow {
            inner: h.experts.clone(),
            delay,
        }),
        ..h
    };
    start_node(seed, h, admission)
}

/// A slow peer (it answers every request, late, well within the timeouts) is raced by a
/// hedge to a fast one: the run gives the same ids, hedges win, and the slow peer is not
/// blamed for failures.
#[test]
fn slow_peer_is_hedged_and_not_blamed() {
    let name = "qwen3moe-tiny";
    let f = setup(name);
    let slow = serve_slow(80, f.dir.path(), Duration::from_millis(400), allow_client());
    let fast = serve_dir(81, f.dir.path(), None, allow_client());
    let files = ModelFiles::open(f.dir.path()).expect("model files");
    let args = peer_args(&f, vec![slow.addr(), fast.addr()]);
    let rt = runtime();
    let (m, id, _) =
        stormo_node::manifest::resolve_manifest(f.dir.path(), &args, &client_key(), &rt)
            .expect("manifest");
    let rt = Arc::new(rt);
    let tier = Arc::new(
        PeerTier::connect(
            &client_key(),
            &args.peers,
            Arc::new(m),
            id,
            files.layout.schemas.clone(),
            PeerConfig {
                request_timeout: Duration::from_secs(20),
                idle_timeout: Duration::from_secs(10),
                hedge_min: Duration::from_millis(20),
                hedge_max: Duration::from_millis(100),
                ..PeerConfig::default()
            },
            Some(rt.handle().clone()),
        )
        .expect("tier")
        .keep_runtime(rt),
    );
    let (got, want, _) = generate_from(&f, name, tier.clone());
    assert_eq!(got, want, "ids with a slow peer");
    let h = tier.hedge_stats();
    assert!(h.hedges > 0 && h.hedge_wins > 0, "no race won: {h:?}");
    assert!(tier.races_lost()[0] > 0, "{:?}", tier.races_lost());
    let fails = tier.failures();
    assert!(
        fails.iter().all(|(_, n)| *n == 0),
        "a slow peer is not a failing one: {fails:?}"
    );
    assert!(fast.served() > 0);
    tier.close();
}

/// A peer whose link is slower than the per-try deadline (a bandwidth-limited relay in front of
/// it) still supplies every expert it is asked for at once: tries run out of time while the
/// peer is still sending, the peer is not blamed for it, and later rounds resume after the
/// verified prefix with longer deadlines.
#[test]
fn a_peer_slower_than_the_deadline_still_delivers_in_later_rounds() {
    let name = "gptoss-tiny-mxfp4";
    let f = setup(name);
    let node = serve_dir(85, f.dir.path(), None, allow_client());
    let manifest = Arc::new(
        stormo_manifests::read_manifest(&f.dir.path().join("stormo-manifest.bin"))
            .expect("manifest")
            .0,
    );
    let layer: Vec<_> = manifest
        .experts
        .iter()
        .filter(|e| e.id.layer == 0)
        .collect();
    let len: u64 = layer.iter().map(|e| e.len).max().expect("experts");
    let keys: Vec<_> = layer
        .iter()
        .take(3)
        .map(|e| stormo_engine::tiers::ExpertId::from_indices(0, e.id.expert.into()))
        .collect();
    // Through the relay one expert alone takes about 125 ms, the three together about 375:
    // the first round's 100 ms deadline passes mid-answer, the third's 400 ms does not.
    let relay = Relay::start(
        node.addr().addr,
        // Ethernet's MTU, as a real slow link has: QUIC's MTU probes (up to 6.5 kB each)
        // would otherwise take seconds of a link this slow.
        LinkSpec {
            bandwidth: Some(len * 8),
            mtu: Some(ETHERNET_MTU),
            ..LinkSpec::ideal()
        },
        7,
    )
    .expect("relay");
    let through = PeerAddr {
        key: node.addr().key,
        addr: relay.addr(),
    };
    let tier = peer_tier_with(
        &f,
        vec![through],
        slow_link_config(Duration::from_millis(100)),
    );
    for (k, r) in load_all(&tier, &keys) {
        if let Err(e) = r {
            panic!("expert {k} from a slow but working peer: {e}");
        }
    }
    assert!(
        tier.retried_failures() > 0,
        "no try ran out of time, so this test did not test anything"
    );
    let fails = tier.failures();
    assert!(
        fails.iter().all(|(_, n)| *n == 0),
        "a slow peer is not a failing one: {fails:?}"
    );
    assert!(relay.counts().down_bytes >= 3 * len);
    tier.close();
}

/// An expert of many chunks from two holders behind links so slow that no try delivers it
/// within its deadline: the try at the first holder is cut off at its deadline (another
/// holder is left), the one at the second, the last, runs on while its chunks keep verifying,
/// resuming after what the first verified, and the load completes. (A prefetch load, so that
/// no hedge races the two holders.)
#[test]
fn the_last_holder_is_not_cut_off_while_its_chunks_keep_verifying() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().to_str().expect("utf-8 temp path");
    // Experts of about 1.7 MB (gate/up 2048 x 1024 and down 1024 x 1024 in MXFP4), sent and
    // verified in pieces of 256 KiB.
    crate::demo::synth(&[
        "--layers",
        "1",
        "--hidden",
        "1024",
        "--intermediate",
        "1024",
        "--experts",
        "2",
        "--top-k",
        "2",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "64",
        "--vocab",
        "64",
        "--out",
        out,
    ])
    .expect("stormo synth writes the model");
    let f = sign_dir(dir);
    let nodes = [86, 87].map(|seed| serve_dir(seed, f.dir.path(), None, allow_client()));
    let manifest = Arc::new(
        stormo_manifests::read_manifest(&f.dir.path().join("stormo-manifest.bin"))
            .expect("manifest")
            .0,
    );
    let e = &manifest.experts[0];
    let chunks = e.len.div_ceil(u64::from(manifest.chunk_size));
    assert!(chunks >= 6, "expert of {} bytes, {chunks} chunks", e.len);
    // The expert takes about 4 s through either relay, a chunk about 0.6 s; a try gets 1 s,
    // and each second of the second try verifies a chunk or more.
    let relays = nodes.each_ref().map(|node| {
        Relay::start(
            node.addr().addr,
            LinkSpec {
                bandwidth: Some(e.len / 4),
                mtu: Some(ETHERNET_MTU),
                ..LinkSpec::ideal()
            },
            8,
        )
        .expect("relay")
    });
    let through: Vec<_> = nodes
        .iter()
        .zip(&relays)
        .map(|(node, relay)| PeerAddr {
            key: node.addr().key,
            addr: relay.addr(),
        })
        .collect();
    let tier = peer_tier_with(&f, through, slow_link_config(Duration::from_secs(1)));
    let key = stormo_engine::tiers::ExpertId::from_indices(0, e.id.expert.into());
    let t0 = Instant::now();
    for (k, r) in load_all_as(&tier, &[key], stormo_engine::tiers::Priority::Prefetch) {
        if let Err(e) = r {
            panic!("expert {k} from a slow peer that keeps sending: {e}");
        }
    }
    // The relays cannot deliver faster than their bandwidth, so this holds by construction:
    // the load outlasted its tries' deadline.
    assert!(
        t0.elapsed() > Duration::from_secs(2),
        "loaded in {:?}: the relay was not the bottleneck, so this test did not test anything",
        t0.elapsed()
    );
    assert_eq!(
        tier.retried_failures(),
        1,
        "the first try, cut off at its deadline, and no other"
    );
    // Neither relay carried the whole expert: the second try resumed after the first one's
    // verified chunks rather than starting over.
    let down: Vec<u64> = relays.iter().map(|r| r.counts().down_bytes).collect();
    assert!(
        down.iter().all(|&d| d < e.len),
        "expert of {} bytes; the relays carried {down:?}",
        e.len
    );
    let fails = tier.failures();
    assert!(
        fails.iter().all(|(_, n)| *n == 0),
        "a slow peer is not a failing one: {fails:?}"
    );
    tier.close();
}

/// Runs fixture `name` on a [`Node`](stormo_node::node::Node) built as `stormo run` builds
/// one: the tiers from `args` (local disk unless `no_local`), the smallest RAM budget; returns
/// the ids, the reference ids, the `--json` experts object and the node.
pub(crate) fn run_node(
    f: &Fixture,
    name: &str,
    args: &PeersConfig,
    no_local: bool,
) -> (
    Vec<u32>,
    Vec<u32>,
    serde_json::Value,
    stormo_node::node::Node,
) {
    let (got, want, json, node) = try_run_node(f, name, args, no_local);
    (got.expect("generation"), want, json, node)
}

/// [`run_node`], with the generation's error (as `stormo run` would report it) rather than a
/// panic.
pub(crate) fn try_run_node(
    f: &Fixture,
    name: &str,
    args: &PeersConfig,
    no_local: bool,
) -> (
    Result<Vec<u32>, String>,
    Vec<u32>,
    serde_json::Value,
    stormo_node::node::Node,
) {
    let mut ea = expert_args();
    ea.cache = stormo_node::config::CacheBudget::Bytes(0);
    let key_dir = tempfile::tempdir().expect("tempdir");
    let mut args = args.clone();
    if args.key.is_none() {
        let p = key_dir.path().join("client.key");
        client_key().write_new(&p).expect("key file");
        args.key = Some(p);
    }
    let node = stormo_node::node::Node::start(NodeConfig {
        model: f.dir.path().to_path_buf(),
        state_dir: key_dir.path().join("state"),
        experts: ea,
        local: if no_local {
            LocalExperts::None
        } else {
            LocalExperts::All
        },
        context: 512,
        peers: args,
        listen: None,
        swarm: None,
    })
    .expect("the node starts");
    let r = Reference::open(&fixture(name));
    let prompt = r.ids("input_ids");
    let want = r.ids("generated_ids");
    let model = node.load_model(&LoadOptions::default()).expect("model");
    let mut sess = model.session(prompt.len() + want.len()).expect("session");
    let got = greedy(
        &model,
        &mut sess,
        &prompt,
        want.len(),
        &[],
        |_, _| {},
        &mut Timings::default(),
    )
    .map_err(|e| e.to_string());
    node.finish_run();
    let json = node.json(sess.prediction());
    (got, want, json, node)
}

/// Waits (bounded) until the background stores into `dir` have ended.
pub(crate) fn settle(dir: &net::expert_dir::ExpertDir) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let n = dir.len();
        std::thread::sleep(Duration::from_millis(200));
        let tmp = std::fs::read_dir(dir.root())
            .expect("expert dir")
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
        if (dir.len() == n && !tmp) || Instant::now() > until {
            return;
        }
    }
}

pub(crate) fn num(j: &serde_json::Value, k: &str) -> u64 {
    j[k].as_u64()
        .unwrap_or_else(|| panic!("--json has no number {k:?}: {j}"))
}
