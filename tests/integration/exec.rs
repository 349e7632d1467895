//! Remote expert execution over real QUIC on 127.0.0.1: a node runs the experts it holds for
//! its peers (`Exec` → `ExecResult`), bit for bit what the requester would compute itself,
//! within its limits (`busy` beyond them), refusing what it cannot or may not run, and
//! unharmed by hostile requests.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use stormo_engine::moe::{expert_forward, ExpertData, ExpertProvider, ExpertScratch};
use stormo_engine::ModelFiles;
use stormo_manifests::{build, BuildOptions, ExpertId, Hash, SecretKey};
use stormo_net::exec::{ExecConfig, ExecError};
use stormo_net::serve::{Holdings, ServeConfig};
use stormo_net::tier::{ExecRequest, PeerConfig, PeerTier, EXEC_IN_FLIGHT};
use stormo_net::tls::Admission;
use stormo_net::{self as net, PeerAddr};
use stormo_node::config::ExpertsConfig;
use stormo_testing::runtime;
use stormo_tests::MODEL_FIXTURES;

use crate::hostile::{ExecAnswer, ExecScript, HostilePeer, Observed};
use stormo_wire::{encode_frame, ErrorCode, Exec, Message, RequestId};

/// A copy of fixture `name` with its manifest built there; and the model id.
fn setup(name: &str) -> (tempfile::TempDir, Hash) {
    let dir = crate::manifests::copy_fixture(name);
    let m = build(dir.path(), &BuildOptions::default()).expect("manifest builds");
    std::fs::write(dir.path().join("stormo-manifest.bin"), m.encode()).expect("write manifest");
    (dir, m.model_id())
}

fn expert_args() -> ExpertsConfig {
    ExpertsConfig {
        io_threads: 1,
        hot_store: false,
        ..ExpertsConfig::default()
    }
}

const SERVER_SEED: u8 = 90;

fn client(seed: u8) -> SecretKey {
    SecretKey::from_seed(&[seed; 32])
}

/// A serving node on its own runtime (the shared harness); closed when dropped.
type Server = stormo_testing::Server;

/// Serves `holdings` as node key [`SERVER_SEED`] with `exec`'s limits, to the clients of key
/// seeds `admit`.
fn start_server(holdings: Holdings, admit: &[u8], exec: ExecConfig) -> Server {
    let admission = Admission::Keys(
        admit
            .iter()
            .map(|&s| *client(s).public().as_bytes())
            .collect(),
    );
    let cfg = ServeConfig {
        admission,
        exec,
        ..ServeConfig::default()
    };
    Server::start(SERVER_SEED, holdings, cfg)
}

/// The network tier of a client with key `seed`, connected to `server`.
fn tier(dir: &Path, id: Hash, seed: u8, server: &Server) -> PeerTier {
    tier_at(dir, id, seed, server.addr())
}

/// The network tier of a client with key `seed`, connected to the peer at `addr`.
fn tier_at(dir: &Path, id: Hash, seed: u8, addr: PeerAddr) -> PeerTier {
    let files = ModelFiles::open(dir).expect("model");
    let (m, _) =
        stormo_manifests::read_manifest(&dir.join("stormo-manifest.bin")).expect("manifest");
    PeerTier::connect(
        &client(seed),
        &[addr],
        Arc::new(m),
        id,
        files.layout.schemas.clone(),
        PeerConfig {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(2),
            ..PeerConfig::default()
        },
        None,
    )
    .expect("tier")
}

/// What expert `id` of the model in `dir` gives for `xs`, computed here (the reference).
fn local(dir: &Path, id: ExpertId, xs: &[f32]) -> Vec<f32> {
    let files = ModelFiles::open(dir).expect("model");
    let schema = files.layout.schemas[id.layer as usize]
        .clone()
        .expect("an expert layer");
    let (h, _e) =
        stormo_node::experts::open_holdings(dir, None, &expert_args(), None).expect("holdings");
    let mut out = Vec::new();
    h.experts
        .fetch(id.layer as usize, &[id.expert as usize], &mut out)
        .expect("the expert");
    let mut s = ExpertScratch::default();
    expert_forward(
        &schema.view(&out[0]),
        xs,
        schema.hidden,
        schema.intermediate,
        &mut s,
    );
    s.output().to_vec()
}

/// `n` pseudo-random rows of `hidden` floats.
fn rows(n: usize, hidden: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n * hidden)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect()
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

/// The shape of the model in `dir`: (layers with experts, experts per layer, hidden width).
fn shape(dir: &Path) -> (Vec<u16>, u16, usize) {
    let files = ModelFiles::open(dir).expect("model");
    let layers: Vec<u16> = files
        .layout
        .schemas
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_some())
        .map(|(l, _)| l as u16)
        .collect();
    let per = files.layout.parts[layers[0] as usize].len() as u16;
    let hidden = files.layout.schemas[layers[0] as usize]
        .as_ref()
        .expect("schema")
        .hidden;
    (layers, per, hidden)
}

/// Every model fixture: a node answers exec calls with the rows the requester computes itself,
/// bit for bit, for one position, a few, and more than one call carries (split into calls);
/// and many calls at once (`exec_all`), none of them `busy`.
#[test]
fn exec_answers_bit_identical_rows() {
    for name in MODEL_FIXTURES {
        let (dir, id) = setup(name);
        let (h, _e) =
            stormo_node::experts::open_holdings(dir.path(), None, &expert_args(), None).expect("h");
        let server = start_server(h, &[1], ExecConfig::default());
        let t = tier(dir.path(), id, 1, &server);
        let (layers, per, hidden) = shape(dir.path());
        let over = stormo_wire::max_positions(hidden) + 3;
        let cases = [
            (ExpertId::new(layers[0], 0), 1),
            (ExpertId::new(*layers.last().expect("a layer"), per - 1), 3),
            (ExpertId::new(layers[0], per / 2), over),
        ];
        for (i, (e, n)) in cases.into_iter().enumerate() {
            let xs = rows(n, hidden, 7 + i as u64);
            let got = t
                .exec_blocking(&server.key.public(), e, &xs, Duration::from_secs(10))
                .unwrap_or_else(|err| panic!("{name} {e} x{n}: {err}"));
            let want = local(dir.path(), e, &xs);
            assert_eq!(got.len(), n * hidden, "{name} {e}");
            assert_eq!(bits(&got), bits(&want), "{name} {e} x{n}: other bits");
        }
        // Many calls at once, more than one connection carries at a time: all answered.
        let many: Vec<ExecRequest> = (0..2 * EXEC_IN_FLIGHT)
            .map(|i| ExecRequest {
                peer: server.key.public(),
                expert: ExpertId::new(layers[i % layers.len()], (i % per as usize) as u16),
                rows: rows(1 + i % 3, hidden, 100 + i as u64),
            })
            .collect();
        let got = t.exec_all_blocking(many.clone(), Duration::from_secs(20));
        for (c, r) in many.iter().zip(got) {
            let r = r.unwrap_or_else(|err| panic!("{name} {}: {err}", c.expert));
            assert_eq!(
                bits(&r),
                bits(&local(dir.path(), c.expert, &c.rows)),
                "{name}"
            );
        }
        let st = &server.handle.exec_stats;
        let calls = 2 + over.div_ceil(stormo_wire::max_positions(hidden)) + many.len();
        assert_eq!(st.answered.load(Ordering::Relaxed), calls as u64, "{name}");
        assert_eq!(st.busy.load(Ordering::Relaxed), 0, "{name}");
        assert_eq!(t.exec_holders(ExpertId::new(layers[0], 0)).len(), 1);
        t.close();
    }
}

/// A provider that holds every fetch until opened, counting the fetches waiting: the calls
/// that reached it hold their exec slots meanwhile.
#[derive(Debug)]
struct Gate {
    inner: Arc<dyn ExpertProvider>,
    open: Mutex<bool>,
    cv: Condvar,
    waiting: AtomicUsize,
}

impl Gate {
    fn release(&self) {
        *self.open.lock().expect("gate") = true;
        self.cv.notify_all();
    }
}

impl ExpertProvider for Gate {
    fn fetch(
        &self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<Arc<ExpertData>>,
    ) -> stormo_engine::Result<()> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let g = self.open.lock().expect("gate");
        let _g = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(20), |open| !*open)
            .expect("gate");
        self.inner.fetch(layer, experts, out)
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "waited for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// More calls than the limits at once: those beyond the per-peer limit and beyond the node's
/// are answered `busy` at once (not queued), the rest correctly; a node with no exec threads
/// refuses, and a key not admitted never gets a connection.
#[test]
fn exec_beyond_the_limits_is_busy_and_the_rest_is_answered() {
    let (dir, id) = setup("gptoss-tiny-mxfp4");
    let (mut h, _e) =
        stormo_node::experts::open_holdings(dir.path(), None, &expert_args(), None).expect("h");
    let gate = Arc::new(Gate {
        inner: h.experts.clone(),
        open: Mutex::new(false),
        cv: Condvar::new(),
        waiting: AtomicUsize::new(0),
    });
    h.experts = gate.clone();
    let limits = ExecConfig {
        threads: 1,
        per_peer: 2,
        total: 3,
    };
    let server = start_server(h, &[1, 2], limits);
    let (a, b) = (
        Arc::new(tier(dir.path(), id, 1, &server)),
        Arc::new(tier(dir.path(), id, 2, &server)),
    );
    let (layers, _, hidden) = shape(dir.path());
    let e = ExpertId::new(layers[0], 1);
    let xs = Arc::new(rows(2, hidden, 11));
    let call = |t: &Arc<PeerTier>| {
        let (t, xs, key) = (t.clone(), xs.clone(), server.key.public());
        std::thread::spawn(move || t.exec_blocking(&key, e, &xs, Duration::from_secs(20)))
    };
    let stats = server.handle.exec_stats.clone();
    // Peer A: three calls, two slots.
    let mut calls: Vec<_> = (0..3).map(|_| call(&a)).collect();
    wait_until("two of A's calls in and one busy", || {
        gate.waiting.load(Ordering::SeqCst) == 2 && stats.busy.load(Ordering::SeqCst) == 1
    });
    // Peer B: two calls, one node slot left.
    calls.extend((0..2).map(|_| call(&b)));
    wait_until("one of B's calls in and one busy", || {
        gate.waiting.load(Ordering::SeqCst) == 3 && stats.busy.load(Ordering::SeqCst) == 2
    });
    gate.release();
    let want = local(dir.path(), e, &xs);
    let (mut ok, mut busy) = (0, 0);
    for c in calls {
        match c.join().expect("call thread") {
            Ok(rows) => {
                assert_eq!(bits(&rows), bits(&want));
                ok += 1;
            }
            Err(ExecError::Busy(why)) => {
                assert!(why.contains("limit"), "{why}");
                busy += 1;
            }
            Err(other) => panic!("neither rows nor busy: {other}"),
        }
    }
    assert_eq!((ok, busy), (3, 2));
    assert_eq!(stats.answered.load(Ordering::SeqCst), 3);
    // Slots come back: another call is answered.
    let again = a
        .exec_blocking(&server.key.public(), e, &xs, Duration::from_secs(10))
        .expect("a call after the others");
    assert_eq!(bits(&again), bits(&want));

    // A key that is not admitted gets no connection, so no call.
    let c = tier(dir.path(), id, 3, &server);
    let err = c
        .exec_blocking(&server.key.public(), e, &xs, Duration::from_secs(5))
        .expect_err("not admitted");
    assert!(matches!(err, ExecError::Lost(_)), "{err}");
    assert_eq!(stats.answered.load(Ordering::SeqCst), 4);

    // A node with no exec threads refuses.
    let (h, _e2) =
        stormo_node::experts::open_holdings(dir.path(), None, &expert_args(), None).expect("h");
    let off = start_server(
        h,
        &[1],
        ExecConfig {
            threads: 0,
            ..ExecConfig::default()
        },
    );
    let t = tier(dir.path(), id, 1, &off);
    match t.exec_blocking(&off.key.public(), e, &xs, Duration::from_secs(5)) {
        Err(ExecError::Refused { code, message }) => {
            assert_eq!(code, ErrorCode::FORBIDDEN);
            assert!(message.contains("--exec-threads 0"), "{message}");
        }
        other => panic!("not refused: {other:?}"),
    }
}

/// Sends `bytes` on a new stream of a fresh connection as client `seed` and returns the one
/// message answered (or `None` if the connection was closed instead).
fn raw(server: &Server, seed: u8, bytes: Vec<u8>) -> Option<Message> {
    let rt = runtime();
    rt.block_on(async {
        let (ep, conn) = server.dial(&client(seed)).await;
        let (mut send, recv) = conn.open_bi().await.expect("stream");
        send.write_all(&bytes).await.expect("write");
        let _ = send.finish();
        let mut recv = net::FramedRecv::new(recv, 1 << 20);
        let answer = tokio::time::timeout(Duration::from_secs(5), recv.next())
            .await
            .expect("an answer or a close in time");
        ep.close(0u32.into(), b"");
        answer.ok().flatten()
    })
}

/// Hostile exec requests (too many positions, rows of the wrong length, an expert out of
/// range, an expert not held, another model, a length past every limit) get a clear error or
/// close only their connection; the node goes on answering good calls.
#[test]
fn hostile_exec_requests_are_refused_and_the_node_is_unharmed() {
    let (dir, id) = setup("qwen3moe-tiny");
    let (layers, per, hidden) = shape(dir.path());
    // Serves only expert 0 of each layer.
    let (h, _e) = stormo_node::experts::open_holdings(dir.path(), None, &expert_args(), Some("0"))
        .expect("h");
    let server = start_server(h, &[1], ExecConfig::default());
    let exec = |expert: ExpertId, positions: u32, len: usize, model: Hash| {
        // Hand-encoded, past the encoder's checks.
        let mut body = vec![stormo_wire::tag::EXEC];
        body.extend_from_slice(&postcard_header(
            RequestId(5),
            model,
            expert,
            positions,
            len as u64,
        ));
        body.extend(std::iter::repeat_n(0u8, len));
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(&body);
        f
    };
    let e0 = ExpertId::new(layers[0], 0);
    let row = 4 * hidden;
    let cases: Vec<(&str, Vec<u8>, Option<ErrorCode>)> = vec![
        (
            "too many positions",
            exec(e0, stormo_wire::MAX_EXEC_POSITIONS + 1, 4 * 65, id),
            None,
        ),
        ("rows not whole f32", exec(e0, 1, row + 2, id), None),
        (
            "rows not whole positions",
            exec(e0, 3, 4 * (3 * hidden + 1), id),
            None,
        ),
        (
            "rows of another width",
            exec(e0, 1, row + 4, id),
            Some(ErrorCode::BAD_REQUEST),
        ),
        (
            "an expert out of range",
            exec(ExpertId::new(layers[0], per), 1, row, id),
            Some(ErrorCode::NOT_FOUND),
        ),
        (
            "a layer out of range",
            exec(ExpertId::new(999, 0), 1, row, id),
            Some(ErrorCode::NOT_FOUND),
        ),
        (
            "an expert not held",
            exec(ExpertId::new(layers[0], 1), 1, row, id),
            Some(ErrorCode::NOT_FOUND),
        ),
        (
            "another model",
            exec(e0, 1, row, Hash([3; 32])),
            Some(ErrorCode::NOT_FOUND),
        ),
        (
            "rows past the limit",
            exec(e0, 1, stormo_wire::MAX_EXEC_ROWS_LEN + 4, id),
            None,
        ),
        (
            "an answer sent to a server",
            encode_frame(&Message::ExecResult(stormo_wire::ExecResult::new(
                RequestId(1),
                &[1.0],
            )))
            .expect("encodes"),
            None,
        ),
    ];
    for (what, bytes, code) in cases {
        let got = raw(&server, 1, bytes);
        match (code, got) {
            (Some(want), Some(Message::Error(e))) => {
                assert_eq!(e.code, want, "{what}: {}", e.message);
                assert_eq!(e.request_id, Some(RequestId(5)), "{what}");
                assert!(!e.message.is_empty(), "{what}");
            }
            // A frame that breaks the protocol's limits closes the connection.
            (None, None) => {}
            (want, got) => panic!("{what}: wanted {want:?}, got {got:?}"),
        }
    }
    assert!(server.handle.stats.violations.load(Ordering::Relaxed) >= 4);
    // Still serving: a good call, by hand and through the tier.
    let xs = rows(1, hidden, 3);
    let good =
        encode_frame(&Message::Exec(Exec::new(RequestId(9), id, e0, 1, &xs))).expect("encodes");
    match raw(&server, 1, good) {
        Some(Message::ExecResult(r)) => {
            assert_eq!(r.request_id, RequestId(9));
            assert_eq!(bits(&r.rows_f32()), bits(&local(dir.path(), e0, &xs)));
        }
        other => panic!("no rows: {other:?}"),
    }
    let t = tier(dir.path(), id, 1, &server);
    let got = t
        .exec_blocking(&server.key.public(), e0, &xs, Duration::from_secs(5))
        .expect("a good call");
    assert_eq!(bits(&got), bits(&local(dir.path(), e0, &xs)));
    // Through the tier, a wrong width is refused before anything is sent.
    assert!(matches!(
        t.exec_blocking(&server.key.public(), e0, &xs[1..], Duration::from_secs(5)),
        Err(ExecError::Invalid(_))
    ));
}

/// The postcard header of an `Exec` (what precedes its raw rows).
fn postcard_header(id: RequestId, model: Hash, e: ExpertId, positions: u32, len: u64) -> Vec<u8> {
    fn varint(mut n: u64, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }
    let mut out = Vec::new();
    varint(id.0, &mut out);
    out.extend_from_slice(&model.0);
    varint(u64::from(e.layer), &mut out);
    varint(u64::from(e.expert), &mut out);
    varint(u64::from(positions), &mut out);
    varint(len, &mut out);
    out
}

/// The requesting side against a hostile executor: a perturbed answer comes back as rows (one
/// call cannot tell a wrong float from a right one: spot-checks can), rows of the wrong length
/// are `Malformed`, silence is a `Timeout` at the call's deadline, a connection dropped
/// mid-call is `Lost`; none of them harms the next call.
#[test]
fn exec_errors_name_how_an_executor_failed() {
    let (dir, id) = setup("gptoss-tiny-mxfp4");
    let (layers, _, hidden) = shape(dir.path());
    let script: ExecScript = Arc::new(|e, _| match e.expert {
        0 => ExecAnswer::Honest,
        1 => ExecAnswer::Perturb(1e-2),
        2 => ExecAnswer::WrongLength,
        3 => ExecAnswer::Stall,
        _ => ExecAnswer::Die,
    });
    let peer = HostilePeer::start_exec(95, dir.path(), script);
    let t = tier_at(dir.path(), id, 1, peer.peer_addr());
    let key = peer.key.public();
    let xs = rows(2, hidden, 5);
    let e = |i| ExpertId::new(layers[0], i);
    let call = |i, secs| t.exec_blocking(&key, e(i), &xs, Duration::from_secs_f64(secs));

    let honest = call(0, 5.0).expect("an honest answer");
    assert_eq!(bits(&honest), bits(&local(dir.path(), e(0), &xs)));
    let lie = call(1, 5.0).expect("a lie still has the right shape");
    let truth = local(dir.path(), e(1), &xs);
    assert_eq!(lie[0], truth[0] + 1e-2);
    assert_eq!(bits(&lie[1..]), bits(&truth[1..]));
    match call(2, 5.0) {
        Err(ExecError::Malformed(why)) => assert!(why.contains("expected"), "{why}"),
        other => panic!("not malformed: {other:?}"),
    }
    let t0 = Instant::now();
    assert_eq!(
        call(3, 0.3),
        Err(ExecError::Timeout(Duration::from_secs_f64(0.3)))
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(matches!(call(4, 5.0), Err(ExecError::Lost(_))));
    // The tier dials again for the next call.
    let again = call(0, 5.0).expect("after a dropped connection");
    assert_eq!(bits(&again), bits(&honest));
    let seen: Vec<_> = peer
        .observed()
        .into_iter()
        .filter_map(|o| match o {
            Observed::Exec { expert, positions } => Some((expert.expert, positions)),
            _ => None,
        })
        .collect();
    assert_eq!(seen, [(0, 2), (1, 2), (2, 2), (3, 2), (4, 2), (0, 2)]);
}

/// `stormo serve --listen --exec-threads 2` runs experts for a peer (the options reach the
/// node's serving side, the node's own holdings carry the layout), bit for bit, and says how
/// many it ran when it stops.
#[test]
fn a_stormo_serve_process_runs_experts_for_peers() {
    use crate::node::{model_with_manifest, s, state, Proc};
    let (dir, id) = model_with_manifest();
    let st = state();
    let node = Proc::start_logging(
        &[
            "serve",
            "--model",
            s(dir.path()),
            "--listen",
            "127.0.0.1:0",
            "--allow-any",
            "--state-dir",
            s(st.path()),
            "--exec-threads",
            "2",
            "--exec-per-peer",
            "2",
        ],
        Some("warn"),
    );
    let addr: PeerAddr = node.line.parse().expect("KEY@ADDR");
    let id: Hash = id.parse().expect("model id");
    let t = tier_at(dir.path(), id, 7, addr.clone());
    let (layers, per, hidden) = shape(dir.path());
    for (i, e) in [
        ExpertId::new(layers[0], 0),
        ExpertId::new(*layers.last().expect("a layer"), per - 1),
    ]
    .into_iter()
    .enumerate()
    {
        let xs = rows(3, hidden, 40 + i as u64);
        let got = t
            .exec_blocking(&addr.key, e, &xs, Duration::from_secs(10))
            .unwrap_or_else(|err| panic!("{e}: {err}"));
        assert_eq!(bits(&got), bits(&local(dir.path(), e, &xs)), "{e}");
    }
    t.close();
    let stderr = node.stderr.clone();
    let status = node.terminate();
    let said = "ran experts for peers: 2 calls (6 positions), 0 answered busy";
    let t0 = Instant::now();
    while !stderr.lock().expect("stderr").contains(said) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = stderr.lock().expect("stderr").clone();
    assert!(status.success(), "{err}");
    assert!(err.contains(said), "{err}");
}
