//! A scriptable hostile peer: a QUIC server on 127.0.0.1 that speaks stormo's wire protocol by
//! hand (Hello, Inventory, Data, End) instead of through `stormo_net::serve`, answers
//! each expert request as a test's [`Script`] says (honestly, with a corrupt chunk, silently,
//! or with raw bytes), and records what it observed: the ranges requested and whether the
//! requester cut an answer short. Shared by the fault tests (`faults.rs`).
//!
//! It holds every expert of the model folder it is started on and answers `GetManifest`
//! honestly, so a client can be pointed at it alone. It runs experts for `Exec` calls too, as
//! its [`ExecScript`] says (honestly with the engine's kernels, with one output perturbed,
//! with rows of the wrong length, silently, or by dropping the connection mid-call).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stormo_manifests::{ExpertId, SecretKey};
use stormo_net::serve::{self, Holdings};
use stormo_net::tls::{self, Admission, Congestion};
use stormo_net::{self as net, FramedRecv, PeerAddr};
use stormo_node::config::ExpertsConfig;
use stormo_wire::{
    data_frame_prefix, End, Hello, Inventory, Limits, Message, NodeId, RequestId, PROTOCOL_VERSION,
};

/// How the peer answers one expert request.
#[derive(Clone, Debug)]
pub(crate) enum Answer {
    /// The bytes asked for, as they are.
    Honest,
    /// The same, after a pause (a slower holder).
    HonestAfter(Duration),
    /// The bytes asked for in frames of one manifest chunk each, with one byte of the record's
    /// chunk `index` flipped. After that chunk the peer sends nothing more and waits up to
    /// `hold` for the requester to stop the stream (observed as [`Observed::CutShort`]); if
    /// it does not, the rest follows as it is and [`Observed::Completed`] is recorded.
    CorruptChunk { index: u64, hold: Duration },
    /// The first `bytes` of the range, then nothing more (a peer that dies mid-answer).
    PartThenSilence { bytes: u64 },
    /// A `not_found` error (a peer whose inventory lies).
    NotFound,
}

/// What the peer saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Observed {
    /// A request for `expert`, bytes `offset..offset + len` of its record.
    Request {
        expert: ExpertId,
        offset: u64,
        len: u64,
    },
    /// The requester stopped (or dropped) the answer's stream after `sent` bytes of the
    /// answer were written.
    CutShort { expert: ExpertId, sent: u64 },
    /// An answer with a corrupt chunk was sent to its end: the requester did not stop it.
    Completed { expert: ExpertId },
    /// An `Exec` of `expert` over `positions` rows.
    Exec { expert: ExpertId, positions: u32 },
}

/// Decides the answer to the `n`th request (from 0) for `expert` at this peer.
pub(crate) type Script = Arc<dyn Fn(ExpertId, usize) -> Answer + Send + Sync>;

/// How the peer answers one `Exec` call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum ExecAnswer {
    /// The expert's output rows, computed with the engine's kernels.
    Honest,
    /// The honest rows with `delta` added to the first float (a lying executor).
    Perturb(f32),
    /// The honest rows less their last float (a malformed answer).
    WrongLength,
    /// Nothing, until the requester gives up (a stalled executor).
    Stall,
    /// The connection closed mid-call, with no answer (a dying executor).
    Die,
}

/// Decides the answer to the `n`th `Exec` (from 0) for `expert` at this peer.
pub(crate) type ExecScript = Arc<dyn Fn(ExpertId, usize) -> ExecAnswer + Send + Sync>;

/// A running hostile peer; stopped when dropped.
pub(crate) struct HostilePeer {
    pub(crate) key: SecretKey,
    pub(crate) addr: SocketAddr,
    observed: Arc<Mutex<Vec<Observed>>>,
    endpoint: quinn::Endpoint,
    rt: Option<tokio::runtime::Runtime>,
}

struct State {
    key: NodeId,
    holdings: Holdings,
    chunk: u64,
    script: Script,
    exec: ExecScript,
    counts: Mutex<std::collections::HashMap<ExpertId, usize>>,
    exec_counts: Mutex<std::collections::HashMap<ExpertId, usize>>,
    observed: Arc<Mutex<Vec<Observed>>>,
}

fn expert_args() -> ExpertsConfig {
    ExpertsConfig {
        io_threads: 1,
        hot_store: false,
        ..ExpertsConfig::default()
    }
}

impl HostilePeer {
    /// Starts a peer with node key `seed` serving the model in `dir` (with its manifest) as
    /// `script` says, admitting any key.
    pub(crate) fn start(seed: u8, dir: &Path, script: Script) -> Self {
        Self::start_sharing(seed, dir, script, Arc::default())
    }

    /// As [`Self::start`], answering expert requests honestly and `Exec` calls as `exec`
    /// says.
    pub(crate) fn start_exec(seed: u8, dir: &Path, exec: ExecScript) -> Self {
        Self::start_with(
            seed,
            dir,
            Arc::new(|_, _| Answer::Honest),
            exec,
            Arc::default(),
        )
    }

    /// Answers fetches by `script` and `Exec` calls by `exec`.
    pub(crate) fn start_scripted(seed: u8, dir: &Path, script: Script, exec: ExecScript) -> Self {
        Self::start_with(seed, dir, script, exec, Arc::default())
    }

    /// As [`Self::start`], recording into `observed` (a log shared by several peers, in the
    /// order of what they saw).
    pub(crate) fn start_sharing(
        seed: u8,
        dir: &Path,
        script: Script,
        observed: Arc<Mutex<Vec<Observed>>>,
    ) -> Self {
        let honest: ExecScript = Arc::new(|_, _| ExecAnswer::Honest);
        Self::start_with(seed, dir, script, honest, observed)
    }

    fn start_with(
        seed: u8,
        dir: &Path,
        script: Script,
        exec: ExecScript,
        observed: Arc<Mutex<Vec<Observed>>>,
    ) -> Self {
        let key = SecretKey::from_seed(&[seed; 32]);
        let (holdings, _experts) =
            stormo_node::experts::open_holdings(dir, None, &expert_args(), None).expect("holdings");
        let chunk = u64::from(holdings.manifest.chunk_size);
        let state = Arc::new(State {
            key: NodeId(*key.public().as_bytes()),
            holdings,
            chunk,
            script,
            exec,
            counts: Mutex::new(Default::default()),
            exec_counts: Mutex::new(Default::default()),
            observed: observed.clone(),
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let endpoint = rt.block_on(async {
            let sc = tls::server_config(&key, Admission::Any, 32, Congestion::Cubic)
                .expect("server config");
            let ep = net::bind("127.0.0.1:0".parse().expect("address"), Some(sc)).expect("bind");
            let accepting = ep.clone();
            tokio::spawn(async move {
                while let Some(incoming) = accepting.accept().await {
                    let state = state.clone();
                    tokio::spawn(async move {
                        let Ok(conn) = incoming.await else { return };
                        while let Ok((send, recv)) = conn.accept_bi().await {
                            tokio::spawn(stream(state.clone(), conn.clone(), send, recv));
                        }
                    });
                }
            });
            ep
        });
        Self {
            key,
            addr: endpoint.local_addr().expect("address"),
            observed,
            endpoint,
            rt: Some(rt),
        }
    }

    /// Its address as a client names it.
    pub(crate) fn peer_addr(&self) -> PeerAddr {
        PeerAddr {
            key: self.key.public(),
            addr: self.addr,
        }
    }

    /// Stops it as a killed process stops: no packet more, not even a close (its runtime,
    /// which drives the endpoint, is shut down).
    pub(crate) fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }

    /// What it observed so far, in order.
    pub(crate) fn observed(&self) -> Vec<Observed> {
        self.observed.lock().expect("log lock").clone()
    }
}

impl Drop for HostilePeer {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"done");
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A script that answers the first request for each of `corrupt` (expert, chunk index) with
/// that chunk corrupt, counted over every peer sharing the script, and later ones honestly.
pub(crate) fn corrupt_first(corrupt: Vec<(ExpertId, u64)>, hold: Duration) -> Script {
    let seen: Arc<Mutex<std::collections::HashSet<ExpertId>>> = Arc::default();
    Arc::new(move |expert, _| {
        let Some(&(_, index)) = corrupt.iter().find(|(e, _)| *e == expert) else {
            return Answer::Honest;
        };
        if seen.lock().expect("lock").insert(expert) {
            Answer::CorruptChunk { index, hold }
        } else {
            Answer::Honest
        }
    })
}

async fn write(send: &mut quinn::SendStream, m: &Message) -> bool {
    net::write_message(send, m).await.is_ok()
}

async fn stream(
    state: Arc<State>,
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
) {
    let mut recv = FramedRecv::new(recv, 1 << 20);
    let Ok(Some(first)) = recv.next().await else {
        return;
    };
    let h = &state.holdings;
    match first {
        Message::Exec(e) => {
            state.log(Observed::Exec {
                expert: e.expert,
                positions: e.positions,
            });
            let n = {
                let mut c = state.exec_counts.lock().expect("counts lock");
                let n = c.entry(e.expert).or_insert(0);
                *n += 1;
                *n - 1
            };
            let answer = (state.exec)(e.expert, n);
            match answer {
                ExecAnswer::Stall => {
                    let _ = tokio::time::timeout(Duration::from_secs(60), send.stopped()).await;
                    return;
                }
                ExecAnswer::Die => {
                    conn.close(0u32.into(), b"dying");
                    return;
                }
                _ => {}
            }
            let mut rows = run_expert(h, &e).await;
            match answer {
                ExecAnswer::Perturb(d) => rows[0] += d,
                ExecAnswer::WrongLength => {
                    rows.pop();
                }
                _ => {}
            }
            let r = stormo_wire::ExecResult::new(e.request_id, &rows);
            let _ = write(&mut send, &Message::ExecResult(r)).await;
            let _ = send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
        }
        Message::Hello(_) => {
            let hello = Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                node: state.key,
                models: vec![h.model_id()],
                limits: Limits {
                    max_concurrent_requests: 16,
                },
            });
            let inv = Message::Inventory(Inventory {
                model: h.model_id(),
                experts: h.held(),
            });
            if !write(&mut send, &hello).await || !write(&mut send, &inv).await {
                return;
            }
            while let Ok(Some(m)) = recv.next().await {
                if let Message::Ping(p) = m {
                    if !write(&mut send, &Message::Pong(p.pong())).await {
                        return;
                    }
                }
            }
        }
        Message::GetManifest(g) => {
            let bytes = h.manifest_bytes.clone();
            send_range(&mut send, g.request_id, &bytes, 0).await;
            let _ = write(
                &mut send,
                &Message::End(End {
                    request_id: g.request_id,
                }),
            )
            .await;
            let _ = send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
        }
        Message::Get(g) => {
            let Some(entry) = h.manifest.expert(g.expert) else {
                return;
            };
            let (offset, len) = g.range.map_or((0, entry.len), |r| (r.offset, r.len));
            state.log(Observed::Request {
                expert: g.expert,
                offset,
                len,
            });
            let n = {
                let mut c = state.counts.lock().expect("counts lock");
                let n = c.entry(g.expert).or_insert(0);
                *n += 1;
                *n - 1
            };
            let answer = (state.script)(g.expert, n);
            let record = serve::record(h.experts.clone(), g.expert)
                .await
                .expect("the hostile peer's own record");
            let end = offset.saturating_add(len).min(record.len() as u64);
            let bytes = record.slice(offset.min(end) as usize..end as usize);
            match answer {
                Answer::Honest => {
                    send_range(&mut send, g.request_id, &bytes, offset).await;
                }
                Answer::HonestAfter(pause) => {
                    tokio::time::sleep(pause).await;
                    send_range(&mut send, g.request_id, &bytes, offset).await;
                }
                Answer::PartThenSilence { bytes: n } => {
                    let n = (n as usize).min(bytes.len());
                    send_range(&mut send, g.request_id, &bytes[..n], offset).await;
                    let _ = tokio::time::timeout(Duration::from_secs(60), send.stopped()).await;
                    return;
                }
                Answer::NotFound => {
                    let e = stormo_wire::ErrorMessage::new(
                        Some(g.request_id),
                        stormo_wire::ErrorCode::NOT_FOUND,
                        "not held here after all",
                    );
                    let _ = write(&mut send, &Message::Error(e)).await;
                    let _ = send.finish();
                    let _ = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
                    return;
                }
                Answer::CorruptChunk { index, hold } => {
                    let c = state.chunk;
                    let mut bad = bytes.to_vec();
                    // the middle of the chunk (which may be shorter than the chunk size)
                    let start = index * c;
                    let chunk_len = c.min((offset + bad.len() as u64).saturating_sub(start));
                    let at = (start + chunk_len / 2).checked_sub(offset);
                    if let Some(b) = at.and_then(|at| bad.get_mut(at as usize)) {
                        *b ^= 0x5a;
                    }
                    // through the end of the corrupt chunk, in chunk-sized frames
                    let cut = ((index + 1) * c)
                        .saturating_sub(offset)
                        .min(bad.len() as u64);
                    let mut sent = 0u64;
                    while sent < cut {
                        let n = c.min(cut - sent);
                        let piece = &bad[sent as usize..(sent + n) as usize];
                        if send_range(&mut send, g.request_id, piece, offset + sent).await {
                            sent += n;
                        } else {
                            break;
                        }
                    }
                    tokio::select! {
                        _ = send.stopped() => {
                            state.log(Observed::CutShort { expert: g.expert, sent });
                            return;
                        }
                        _ = tokio::time::sleep(hold) => {}
                    }
                    let rest = &bad[sent as usize..];
                    if !send_range(&mut send, g.request_id, rest, offset + sent).await {
                        state.log(Observed::CutShort {
                            expert: g.expert,
                            sent,
                        });
                        return;
                    }
                    state.log(Observed::Completed { expert: g.expert });
                }
            }
            let _ = write(
                &mut send,
                &Message::End(End {
                    request_id: g.request_id,
                }),
            )
            .await;
            let _ = send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
        }
        _ => {}
    }
}

/// Writes `bytes` (at `offset` of the resource) as `Data` frames of up to 256 KiB; false when
/// the stream was stopped.
async fn send_range(
    send: &mut quinn::SendStream,
    id: RequestId,
    bytes: &[u8],
    offset: u64,
) -> bool {
    let mut off = offset;
    for piece in bytes.chunks(256 << 10) {
        let prefix = data_frame_prefix(id, off, piece.len());
        if send.write_all(&prefix).await.is_err() || send.write_all(piece).await.is_err() {
            return false;
        }
        off += piece.len() as u64;
    }
    true
}

/// The honest output rows of `e`, computed with the engine's kernels.
async fn run_expert(h: &Holdings, e: &stormo_wire::Exec) -> Vec<f32> {
    let schema = h.schemas[e.expert.layer as usize]
        .clone()
        .expect("an expert layer");
    let mut out = Vec::new();
    let (experts, id) = (h.experts.clone(), e.expert);
    let data = tokio::task::spawn_blocking(move || {
        experts
            .fetch(id.layer as usize, &[id.expert as usize], &mut out)
            .expect("the hostile peer's own expert");
        out.pop().expect("one expert")
    })
    .await
    .expect("reader");
    let mut s = stormo_engine::moe::ExpertScratch::default();
    stormo_engine::moe::expert_forward(
        &schema.view(&data),
        &e.rows_f32(),
        schema.hidden,
        schema.intermediate,
        &mut s,
    );
    s.output().to_vec()
}

impl State {
    fn log(&self, o: Observed) {
        self.observed.lock().expect("log lock").push(o);
    }
}
