//! Serving experts and the manifest to peers over QUIC.
//!
//! One task per connection and one per stream. The connecting side's first stream is its
//! control stream (its first frame is a `Hello`); every other stream carries one request (its
//! first frame is a `Get`, `GetManifest`, `GetFile` or `Exec`; an `Exec` is answered by
//! [`super::exec`] with its own limits). Requests are admitted by a per-peer
//! [`stormo_wire::Server`] (beyond its limit: `busy`) and a node-wide limit (also `busy`);
//! expert records come from the node's expert provider (its RAM cache when hot, else its
//! disk), fetched on tokio's blocking threads so the async threads never stall. A frame that
//! does not decode, or a message that has no place where it arrived, closes that connection
//! with `PROTOCOL_VIOLATION`; other connections and the node carry on. A connection whose
//! peer is revoked, or whose membership certificate expires, while it is open is closed with
//! `FORBIDDEN` within about a second (`tls::LiveMembers`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use bytes::Bytes;
use stormo_engine::moe::{ExpertProvider, ExpertSchema};
use stormo_manifests::{ExpertId, Hash, Manifest, PublicKey, SecretKey};
use stormo_wire::{
    data_frame_prefix, expect_hello, ErrorCode, ExpertSet, Hello, Inventory, InventoryUpdate,
    Message, NodeId, Offer, Resource, ServeRequest, Server, ServerConfig, ServerEvent,
    PROTOCOL_VERSION,
};
use tokio::sync::Semaphore;

use super::tls::{self, Admission};
use super::{FramedRecv, ReadError};

/// The send priority of the stream of an `Exec` answer (and of its request, at the caller):
/// above the experts' bytes (0) and prefetches (-1), so rows a layer waits on do not queue
/// behind a fetch's megabytes on a slow link.
pub const EXEC_PRIORITY: i32 = 1;

/// Bytes per `Data` frame sent.
const DATA_CHUNK: usize = 256 << 10;
/// The largest frame accepted from a peer (requests and control messages are small; an
/// inventory bitmap of the largest model fits; an `Exec`'s rows are at most 256 KiB).
const MAX_INBOUND_FRAME: usize = if stormo_wire::MAX_EXEC_FRAME_LEN > 256 << 10 {
    stormo_wire::MAX_EXEC_FRAME_LEN
} else {
    256 << 10
};

/// What a node serves: one model's manifest and the experts it holds or can fetch.
pub struct Holdings {
    /// The manifest's canonical bytes.
    pub manifest_bytes: Bytes,
    /// The manifest, decoded.
    pub manifest: Arc<Manifest>,
    /// Where expert records come from (the node's tiers).
    pub experts: Arc<dyn ExpertProvider>,
    /// What the node announces to its peers: the experts it holds verified and those it can
    /// fetch from its own peers. It changes while the node runs (a node re-serves what it
    /// fetched); every connected peer is told of each change.
    pub announce: tokio::sync::watch::Sender<Arc<Announce>>,
    /// The model folder's files served to `stormo pull` (`None`: none).
    pub files: Option<Arc<FileShare>>,
    /// How each layer's experts are laid out (`files.layout.schemas`), to run them for peers
    /// (`Exec`). Empty: the node runs no experts for peers (answered `not found`).
    pub schemas: Vec<Option<ExpertSchema>>,
    /// Requests for each expert since placement last took them (its demand).
    pub demand: Arc<Demand>,
    /// Experts checked against the manifest before this node ran them for a peer: `true`
    /// matched, `false` did not (never run nor served again).
    pub verified: Arc<Mutex<std::collections::HashMap<ExpertId, bool>>>,
}

/// Requests for experts a node answered (whole records and executions), counted for
/// placement's demand and taken by it.
#[derive(Debug, Default)]
pub struct Demand(Mutex<std::collections::HashMap<ExpertId, u32>>);

impl Demand {
    /// Counts one request for `id`.
    pub fn record(&self, id: ExpertId) {
        let mut m = self.0.lock().expect("demand lock");
        let c = m.entry(id).or_insert(0);
        *c = c.saturating_add(1);
    }

    /// The counts since the last take, emptied.
    pub fn take(&self) -> Vec<(ExpertId, u32)> {
        std::mem::take(&mut *self.0.lock().expect("demand lock"))
            .into_iter()
            .collect()
    }
}

/// What a node announces: the experts it holds verified (its inventory) and those it does not
/// hold but can fetch for a peer from a direct peer that holds them (its offer, one hop).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announce {
    /// Held: on its disk, in its kept experts, or verified in its RAM cache.
    pub held: ExpertSet,
    /// Offered: held by one of its direct peers, not by itself.
    pub offered: ExpertSet,
    /// Its room and claims for placing replicas (`None`: it places none).
    pub placement: Option<Arc<stormo_wire::Placement>>,
    /// The serving nodes in its peer set that serve now (peer exchange: [`stormo_wire::Peers`]),
    /// at most [`stormo_wire::MAX_PEERS`], in a fixed order so that an unchanged set is not
    /// sent again.
    pub peers: Vec<stormo_wire::PeerEntry>,
}

impl Announce {
    /// Holding `held` and offering nothing.
    pub fn holding(held: ExpertSet) -> Self {
        let offered = ExpertSet::new(held.layers(), held.experts_per_layer())
            .expect("the same shape as a valid set");
        Self {
            held,
            offered,
            placement: None,
            peers: Vec::new(),
        }
    }

    /// Whether a request for `id` is served (held or offered).
    pub fn serves(&self, id: ExpertId) -> bool {
        self.held.contains(id) || self.offered.contains(id)
    }
}

/// The files of a model folder a node serves by name (`GetFile`): only the manifest's
/// metadata and safetensors files and the manifest's signature, each only within its length,
/// read from `dir` and never from a path built out of a peer's bytes.
#[derive(Debug)]
pub struct FileShare {
    /// The model folder.
    pub dir: std::path::PathBuf,
    /// The manifest's signature file, served as `stormo-manifest.sig`, when there is one.
    pub sig: Option<Bytes>,
    /// The folder was pulled without experts (its expert bytes are holes, or not there at
    /// all): serve only ranges that lie outside every expert tensor.
    pub dense_only: bool,
    /// Where a dense-only folder that holds its dense tensors in files of their own
    /// (`stormo_engine::safetensors::dense`) keeps the bytes of each published weight file:
    /// the ranges served are put together from there.
    pub dense: Option<Vec<DenseFile>>,
    /// The byte ranges (manifest file index, start, end) of the experts this node does not
    /// serve (`--only-experts`), which no file range it serves may overlap: a node told to
    /// serve some experts hands out no other expert's bytes, through `stormo pull` either.
    pub withheld: Vec<(u32, u64, u64, ExpertId)>,
}

/// The name the manifest's signature is served under.
pub const SIG_FILE: &str = "stormo-manifest.sig";

impl std::fmt::Debug for Holdings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holdings")
            .field("model", &self.model_id())
            .field("held", &self.announce.borrow().held.len())
            .finish_non_exhaustive()
    }
}

impl Holdings {
    /// The experts held now.
    pub fn held(&self) -> ExpertSet {
        self.announce.borrow().held.clone()
    }

    /// Replaces what the node holds, offers and names as peers, keeping its placement
    /// announcement; connected peers are told what changed.
    ///
    /// Each writer changes only its own fields, inside the channel's lock: the inventory
    /// refresh and the placement driver run on their own schedules, and a refresh that
    /// carried a placement read before its (slow) work would put back an older one, which
    /// nobody sends again (a node's peers saw two of its kept copies as still fetching).
    pub fn set_inventory(
        &self,
        held: ExpertSet,
        offered: ExpertSet,
        peers: Vec<stormo_wire::PeerEntry>,
    ) {
        self.announce.send_if_modified(|cur| {
            if cur.held == held && cur.offered == offered && cur.peers == peers {
                return false;
            }
            *cur = Arc::new(Announce {
                held,
                offered,
                placement: cur.placement.clone(),
                peers,
            });
            true
        });
    }

    /// Replaces the node's placement announcement, keeping the rest (see
    /// [`Holdings::set_inventory`]); connected peers are told when it changed.
    pub fn set_placement(&self, placement: stormo_wire::Placement) {
        self.announce.send_if_modified(|cur| {
            if cur.placement.as_deref() == Some(&placement) {
                return false;
            }
            let mut next = (**cur).clone();
            next.placement = Some(Arc::new(placement));
            *cur = Arc::new(next);
            true
        });
    }

    /// The model id.
    pub fn model_id(&self) -> Hash {
        Hash::of(&self.manifest_bytes)
    }

    /// The inventory of every expert of `manifest` whose `allowed[layer][expert]` flag is set
    /// (all of them when `allowed` is `None`).
    pub fn inventory_of(
        manifest: &Manifest,
        allowed: Option<&[Vec<bool>]>,
    ) -> anyhow::Result<ExpertSet> {
        let layers = manifest
            .experts
            .iter()
            .map(|e| e.id.layer + 1)
            .max()
            .unwrap_or(0);
        let per = manifest
            .experts
            .iter()
            .map(|e| e.id.expert + 1)
            .max()
            .unwrap_or(0);
        let mut set = ExpertSet::new(layers.max(1), per.max(1)).context("inventory size")?;
        for e in &manifest.experts {
            let ok = allowed.is_none_or(|a| {
                a.get(e.id.layer as usize)
                    .and_then(|l| l.get(e.id.expert as usize))
                    .copied()
                    .unwrap_or(false)
            });
            if ok {
                set.insert(e.id).context("inventory")?;
            }
        }
        Ok(set)
    }
}

/// Limits of a serving node.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Requests of one peer served at once (more: `busy`).
    pub per_peer: u32,
    /// Requests of all peers served at once (more: `busy`).
    pub node_limit: usize,
    /// Who may connect.
    pub admission: Admission,
    /// How answers are paced.
    pub congestion: tls::Congestion,
    /// Running experts for peers: threads and limits.
    pub exec: super::exec::ExecConfig,
    /// Told of each admitted peer whose hello names this node's model: a node serving it
    /// that dialled this one, with the address its connection came from (where it listens:
    /// a serving node dials from its listening endpoint). `None`: nobody is told.
    pub serving_peers: Option<ServingPeers>,
}

/// Where [`ServeConfig::serving_peers`] reports a serving peer that dialled in.
#[derive(Clone)]
pub struct ServingPeers(pub Arc<dyn Fn(super::PeerAddr) + Send + Sync>);

impl std::fmt::Debug for ServingPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServingPeers(..)")
    }
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            per_peer: 8,
            node_limit: 32,
            admission: Admission::Keys(Default::default()),
            congestion: tls::Congestion::default(),
            exec: super::exec::ExecConfig::default(),
            serving_peers: None,
        }
    }
}

/// Counters of a serving node.
#[derive(Debug, Default)]
pub struct ServeStats {
    /// Connections accepted (past TLS).
    pub connections: AtomicU64,
    /// Requests answered in full.
    pub served: AtomicU64,
    /// Bytes of expert and manifest data sent.
    pub bytes: AtomicU64,
    /// Requests answered `busy`.
    pub busy: AtomicU64,
    /// Connections closed for a protocol violation.
    pub violations: AtomicU64,
    /// Bytes of answers held in memory now: the bytes of each request being answered, from
    /// when they are read until the peer has acknowledged them (QUIC's send buffers hold
    /// slices of the same bytes, not a copy; an expert's answer is the provider's record
    /// itself). Bounded by the node-wide request limit (`--max-requests`) times the largest
    /// answer (an expert record, or a `GetFile` range).
    pub buffered: AtomicU64,
    /// The most `buffered` has been.
    pub buffered_peak: AtomicU64,
}

/// Counts `n` bytes in [`ServeStats::buffered`] while alive.
struct Buffered<'a>(&'a ServeStats, u64);

impl<'a> Buffered<'a> {
    fn new(stats: &'a ServeStats, n: u64) -> Self {
        let now = stats.buffered.fetch_add(n, Ordering::Relaxed) + n;
        stats.buffered_peak.fetch_max(now, Ordering::Relaxed);
        Self(stats, n)
    }
}

impl Drop for Buffered<'_> {
    fn drop(&mut self) {
        self.0.buffered.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// A running server. Dropping it does not stop it; call [`ServerHandle::close`].
#[derive(Debug)]
pub struct ServerHandle {
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    /// Its counters.
    pub stats: Arc<ServeStats>,
    /// The counters of experts run for peers.
    pub exec_stats: Arc<super::exec::ExecStats>,
}

impl ServerHandle {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutting down");
    }

    /// Waits until every connection is closed.
    pub async fn wait_idle(&self) {
        self.endpoint.wait_idle().await;
    }
}

struct Shared {
    key: NodeId,
    holdings: Arc<Holdings>,
    cfg: ServeConfig,
    node_slots: Arc<Semaphore>,
    stats: Arc<ServeStats>,
    exec: super::exec::Executor,
    /// The admitted connections, closed when their peer is revoked or its certificate expires
    /// (`None`: the policy admits anyone, or a fixed list).
    live: Option<Arc<tls::LiveMembers>>,
}

/// Starts serving `holdings` on `listen` as `secret` (a node key with no swarm certificate),
/// on an endpoint of its own. Must be called inside a tokio runtime; the server runs on it
/// until closed. A node that also fetches, or presents a membership certificate, uses
/// [`start_on`].
pub fn start(
    secret: &SecretKey,
    listen: SocketAddr,
    holdings: Arc<Holdings>,
    cfg: ServeConfig,
) -> anyhow::Result<ServerHandle> {
    let endpoint = super::bind(listen, None)?;
    start_on(endpoint, tls::Identity::key(secret), holdings, cfg)
}

/// The TLS and transport settings of a server that is `id` (its key, and in a swarm its
/// certificate) with `cfg`'s limits.
fn server_config(id: tls::Identity<'_>, cfg: &ServeConfig) -> anyhow::Result<quinn::ServerConfig> {
    // Requests (and the streams a requester gave up on that the server has not yet dropped),
    // the exec calls, and the control stream.
    let streams = cfg.per_peer.saturating_mul(2).max(4) + cfg.exec.per_peer.max(1) + 1;
    tls::server_config_for(id, cfg.admission.clone(), streams, cfg.congestion)
}

/// Starts serving `holdings` as `id` (the node key, and the swarm certificate it presents in
/// the handshake) on `endpoint` (which may also dial: peers reach this node on the port it
/// dials from). Must be called inside a tokio runtime.
pub fn start_on(
    endpoint: quinn::Endpoint,
    id: tls::Identity<'_>,
    holdings: Arc<Holdings>,
    cfg: ServeConfig,
) -> anyhow::Result<ServerHandle> {
    endpoint.set_server_config(Some(server_config(id, &cfg)?));
    let addr = endpoint.local_addr().context("the bound address")?;
    let stats = Arc::new(ServeStats::default());
    let exec = super::exec::Executor::new(cfg.exec)?;
    let exec_stats = exec.stats.clone();
    let live = tls::LiveMembers::start(cfg.admission.clone());
    let shared = Arc::new(Shared {
        key: NodeId(*id.secret.public().as_bytes()),
        holdings,
        node_slots: Arc::new(Semaphore::new(cfg.node_limit.max(1))),
        cfg,
        stats: stats.clone(),
        exec,
        live,
    });
    let ep = endpoint.clone();
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            let shared = shared.clone();
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                match tokio::time::timeout(super::CONNECT_TIMEOUT, incoming).await {
                    Ok(Ok(conn)) => connection(shared, conn).await,
                    Ok(Err(e)) => tracing::info!("connection from {remote} failed: {e}"),
                    Err(_) => tracing::info!("connection from {remote} timed out in the handshake"),
                }
            });
        }
    });
    Ok(ServerHandle {
        endpoint,
        addr,
        stats,
        exec_stats,
    })
}

fn violation(shared: &Shared, conn: &quinn::Connection, peer: &str, why: &str) {
    tracing::warn!("peer {peer}: {why}; closing its connection");
    shared.stats.violations.fetch_add(1, Ordering::Relaxed);
    conn.close(
        u32::from(ErrorCode::PROTOCOL_VIOLATION.0).into(),
        why.as_bytes(),
    );
}

/// What a connection's path did, for the log when it ends: how much was sent and lost, the
/// congestion window and round trip at the end, the datagram size, and what went wrong with
/// it (congestion events, black holes found by MTU discovery). A slow transfer is read from
/// these without a packet capture.
fn path_summary(s: &quinn::ConnectionStats) -> String {
    let p = &s.path;
    format!(
        "sent {:.1} MB in {} datagrams, {} lost ({:.1} MB), {} congestion events, window {} KB \
         at the end, round trip {:.1} ms (least {:.1} ms), MTU {} ({} black holes)",
        s.udp_tx.bytes as f64 / 1e6,
        s.udp_tx.datagrams,
        p.lost_packets,
        p.lost_bytes as f64 / 1e6,
        p.congestion_events,
        p.cwnd / 1000,
        p.rtt.as_secs_f64() * 1e3,
        p.min_rtt.as_secs_f64() * 1e3,
        p.current_mtu,
        p.black_holes_detected,
    )
}

async fn connection(shared: Arc<Shared>, conn: quinn::Connection) {
    let Some(key) = tls::peer_key(&conn) else {
        conn.close(u32::from(ErrorCode::FORBIDDEN.0).into(), b"no node key");
        return;
    };
    // Watched until this function returns (the connection closed): a revocation or an expiry
    // closes it meanwhile.
    let _watched = shared.live.as_ref().and_then(|l| l.admit(&conn));
    let peer = format!("{}@{}", hex8(&key), conn.remote_address());
    shared.stats.connections.fetch_add(1, Ordering::Relaxed);
    tracing::info!("peer {peer} connected");
    let server = Arc::new(Mutex::new(Server::new(ServerConfig {
        max_concurrent: shared.cfg.per_peer,
    })));
    let exec_slots = shared.exec.peer_slots();
    loop {
        let (send, recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(e) => {
                let filter = super::congestion::filter_summary(&conn)
                    .map_or_else(String::new, |f| format!("; {f}"));
                tracing::info!(
                    "peer {peer} gone: {e}; {}{filter}",
                    path_summary(&conn.stats())
                );
                return;
            }
        };
        let (shared, conn, server, peer, exec_slots) = (
            shared.clone(),
            conn.clone(),
            server.clone(),
            peer.clone(),
            exec_slots.clone(),
        );
        tokio::spawn(async move {
            let streams = Streams {
                server: &server,
                exec_slots: &exec_slots,
            };
            stream(&shared, &conn, streams, &peer, NodeId(key), send, recv).await;
        });
    }
}

fn hex8(key: &[u8; 32]) -> String {
    key[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// What the streams of one connection share: its request state and its exec slots.
#[derive(Clone, Copy)]
struct Streams<'a> {
    server: &'a Mutex<Server>,
    exec_slots: &'a Arc<Semaphore>,
}

async fn stream(
    shared: &Shared,
    conn: &quinn::Connection,
    streams: Streams<'_>,
    peer: &str,
    key: NodeId,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
) {
    let mut recv = FramedRecv::new(recv, MAX_INBOUND_FRAME);
    let first = match recv.next().await {
        Ok(Some(m)) => m,
        Ok(None) => return,
        Err(ReadError::Decode(e)) => return violation(shared, conn, peer, &e.to_string()),
        Err(ReadError::Stream(_)) => return,
    };
    let server = streams.server;
    match first {
        Message::Hello(_) => control(shared, conn, peer, key, first, send, recv).await,
        Message::Exec(exec) => {
            let expert = exec.expert;
            let answer = shared
                .exec
                .answer(&shared.holdings, streams.exec_slots, exec)
                .await;
            if let Message::Error(e) = &answer {
                tracing::debug!("exec of {expert} for {peer}: {} {}", e.code, e.message);
            }
            // A few KiB that a whole layer of the caller waits on: sent ahead of the experts'
            // bytes on the same connection (those at 0, prefetches at -1), not behind them.
            let _ = send.set_priority(EXEC_PRIORITY);
            if super::write_message(&mut send, &answer).await.is_err() {
                return;
            }
            let _ = send.finish();
            let _ = tokio::time::timeout(tls::IDLE_TIMEOUT, send.stopped()).await;
        }
        Message::Get(_) | Message::GetManifest(_) | Message::GetFile(_) => {
            let (out, events) = {
                let mut s = server.lock().expect("server state lock");
                if let Err(e) = s.handle_message(first) {
                    drop(s);
                    return violation(shared, conn, peer, &e.to_string());
                }
                drain(&mut s)
            };
            for m in &out {
                if super::write_message(&mut send, m).await.is_err() {
                    return;
                }
            }
            for ev in events {
                if let ServerEvent::Serve(req) = ev {
                    serve_one(shared, server, peer, req, &mut send).await;
                }
            }
            let _ = send.finish();
            // Wait for the peer to read everything (or give up on it) before dropping.
            let _ = tokio::time::timeout(tls::IDLE_TIMEOUT, send.stopped()).await;
        }
        other => violation(
            shared,
            conn,
            peer,
            &format!("a stream opened with a {} message", other.name()),
        ),
    }
}

fn drain(s: &mut Server) -> (Vec<Message>, Vec<ServerEvent>) {
    let mut out = Vec::new();
    while let Some(m) = s.poll_transmit() {
        out.push(m);
    }
    let mut ev = Vec::new();
    while let Some(e) = s.poll_event() {
        ev.push(e);
    }
    (out, ev)
}

async fn control(
    shared: &Shared,
    conn: &quinn::Connection,
    peer: &str,
    key: NodeId,
    first: Message,
    mut send: quinn::SendStream,
    mut recv: FramedRecv,
) {
    let theirs = match expect_hello(first, &key) {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("peer {peer}: {e}");
            let _ = super::write_message(&mut send, &Message::Error(e.to_message())).await;
            let _ = send.finish();
            let _ =
                tokio::time::timeout(std::time::Duration::from_millis(200), send.stopped()).await;
            conn.close(u32::from(e.code().0).into(), e.to_string().as_bytes());
            return;
        }
    };
    let h = &shared.holdings;
    let model = h.model_id();
    if let (true, Some(tell), Ok(k)) = (
        theirs.models.contains(&model),
        &shared.cfg.serving_peers,
        PublicKey::from_bytes(&key.0),
    ) {
        // An IPv4 peer reaching a dual-stack endpoint shows as ::ffff:a.b.c.d: named as IPv4,
        // which an IPv4-only endpoint can dial back.
        let addr = match conn.remote_address() {
            SocketAddr::V6(a) => a
                .ip()
                .to_ipv4_mapped()
                .map_or(SocketAddr::V6(a), |ip| SocketAddr::new(ip.into(), a.port())),
            a => a,
        };
        (tell.0)(super::PeerAddr { key: k, addr });
    }
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        node: shared.key,
        models: vec![model],
        limits: stormo_wire::Limits {
            max_concurrent_requests: shared.cfg.per_peer,
        },
    });
    let mut changes = h.announce.subscribe();
    let mut last = changes.borrow_and_update().clone();
    let mut first = vec![
        hello,
        Message::Inventory(Inventory {
            model,
            experts: last.held.clone(),
        }),
    ];
    if !last.offered.is_empty() {
        first.push(Message::Offer(Offer {
            model,
            experts: last.offered.clone(),
        }));
    }
    if let Some(p) = &last.placement {
        first.push(Message::Placement((**p).clone()));
    }
    if !last.peers.is_empty() {
        first.push(Message::Peers(stormo_wire::Peers {
            model,
            peers: last.peers.clone(),
        }));
    }
    for m in &first {
        if super::write_message(&mut send, m).await.is_err() {
            return;
        }
    }
    loop {
        let got = tokio::select! {
            m = recv.next() => m,
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
                let now = changes.borrow_and_update().clone();
                for m in announce_changes(model, &last, &now) {
                    if super::write_message(&mut send, &m).await.is_err() {
                        return;
                    }
                }
                last = now;
                continue;
            }
        };
        match got {
            Ok(Some(Message::Ping(p))) => {
                if super::write_message(&mut send, &Message::Pong(p.pong()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Ok(Some(
                Message::Inventory(_)
                | Message::InventoryUpdate(_)
                | Message::Offer(_)
                | Message::Placement(_)
                | Message::Peers(_)
                | Message::Pong(_),
            )) => {}
            Ok(Some(Message::Error(e))) => {
                tracing::info!("peer {peer} closes: {} {}", e.code, e.message);
                return;
            }
            Ok(Some(other)) => {
                return violation(
                    shared,
                    conn,
                    peer,
                    &format!("unexpected {} on the control stream", other.name()),
                )
            }
            Ok(None) | Err(ReadError::Stream(_)) => return,
            Err(ReadError::Decode(e)) => return violation(shared, conn, peer, &e.to_string()),
        }
    }
}

/// The messages that tell a peer how `now` differs from `last`: inventory updates (within the
/// protocol's limit of experts per update) for the held experts, a whole offer when it changed.
pub fn announce_changes(model: Hash, last: &Announce, now: &Announce) -> Vec<Message> {
    let mut out = Vec::new();
    let added: Vec<ExpertId> = now
        .held
        .iter()
        .filter(|e| !last.held.contains(*e))
        .collect();
    let removed: Vec<ExpertId> = last
        .held
        .iter()
        .filter(|e| !now.held.contains(*e))
        .collect();
    let per = stormo_wire::MAX_UPDATE_EXPERTS;
    let (mut a, mut r) = (&added[..], &removed[..]);
    while !a.is_empty() || !r.is_empty() {
        let na = a.len().min(per);
        let nr = r.len().min(per - na);
        out.push(Message::InventoryUpdate(InventoryUpdate {
            model,
            added: a[..na].to_vec(),
            removed: r[..nr].to_vec(),
        }));
        a = &a[na..];
        r = &r[nr..];
    }
    if now.offered != last.offered {
        out.push(Message::Offer(Offer {
            model,
            experts: now.offered.clone(),
        }));
    }
    if now.placement != last.placement {
        if let Some(p) = &now.placement {
            out.push(Message::Placement((**p).clone()));
        }
    }
    if now.peers != last.peers {
        out.push(Message::Peers(stormo_wire::Peers {
            model,
            peers: now.peers.clone(),
        }));
    }
    out
}

fn fail(
    server: &Mutex<Server>,
    id: stormo_wire::RequestId,
    code: ErrorCode,
    msg: String,
) -> Vec<Message> {
    let mut s = server.lock().expect("server state lock");
    s.fail(id, code, msg);
    drain(&mut s).0
}

async fn serve_one(
    shared: &Shared,
    server: &Mutex<Server>,
    peer: &str,
    req: ServeRequest,
    send: &mut quinn::SendStream,
) {
    let id = req.id;
    let answer = match shared.node_slots.clone().try_acquire_owned() {
        Err(_) => {
            shared.stats.busy.fetch_add(1, Ordering::Relaxed);
            Err((
                ErrorCode::BUSY,
                "the node is serving its limit of requests".to_string(),
            ))
        }
        Ok(permit) => {
            // A requester that gives up (a hedge won elsewhere) stops the stream: free its
            // slot now rather than after the read.
            tokio::select! {
                r = resolve(shared, &req) => r.map(|b| (b, permit)),
                _ = send.stopped() => {
                    let mut s = server.lock().expect("server state lock");
                    let _ = s.handle_message(Message::Cancel(stormo_wire::Cancel { request_id: id }));
                    let _ = drain(&mut s);
                    return;
                }
            }
        }
    };
    let (parts, offset, _permit) = match answer {
        Ok(((parts, offset), permit)) => (parts, offset, permit),
        Err((code, msg)) => {
            for m in fail(server, id, code, msg) {
                let _ = super::write_message(send, &m).await;
            }
            return;
        }
    };
    let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let _held = Buffered::new(&shared.stats, total);
    if req.priority == stormo_wire::Priority::Prefetch {
        let _ = send.set_priority(-1);
    }
    let mut off = offset;
    let chunks = parts.iter().flat_map(|p| {
        (0..p.len())
            .step_by(DATA_CHUNK)
            .map(move |at| p.slice(at..(at + DATA_CHUNK).min(p.len())))
    });
    for chunk in chunks {
        if !server.lock().expect("server state lock").is_active(id) {
            return;
        }
        let n = chunk.len() as u64;
        // Handed to QUIC as slices of the answer (`write_all_chunks` keeps the `Bytes`, where
        // `write_all` would copy them into its send buffer): the bytes of an answer are held
        // once, whether still here or queued in QUIC until acknowledged.
        let mut frame = [Bytes::from(data_frame_prefix(id, off, chunk.len())), chunk];
        let sent = send.write_all_chunks(&mut frame).await;
        if sent.is_err() {
            // The peer reset or stopped the stream: the same as a Cancel.
            let mut s = server.lock().expect("server state lock");
            let _ = s.handle_message(Message::Cancel(stormo_wire::Cancel { request_id: id }));
            let _ = drain(&mut s);
            return;
        }
        off += n;
    }
    let out = {
        let mut s = server.lock().expect("server state lock");
        s.complete(id);
        drain(&mut s).0
    };
    for m in &out {
        if super::write_message(send, m).await.is_err() {
            return;
        }
    }
    shared.stats.served.fetch_add(1, Ordering::Relaxed);
    shared.stats.bytes.fetch_add(total, Ordering::Relaxed);
    tracing::debug!("served {} ({total} bytes) to {peer}", req.resource);
    // The node's slot and the gauge are held until the peer has acknowledged the whole answer
    // (or stopped the stream, or the wait timed out): until then QUIC's send buffer still
    // holds its bytes, and a new request admitted meanwhile would hold more than the bound.
    let _ = send.finish();
    let _ = tokio::time::timeout(tls::IDLE_TIMEOUT, send.stopped()).await;
}

/// The bytes to send for `req` (in pieces, back to back) and their offset in the resource, or
/// the error to answer.
async fn resolve(
    shared: &Shared,
    req: &ServeRequest,
) -> Result<(Vec<Bytes>, u64), (ErrorCode, String)> {
    let h = &shared.holdings;
    match req.resource {
        Resource::File {
            model, ref name, ..
        } => {
            if model != h.model_id() {
                return Err((
                    ErrorCode::NOT_FOUND,
                    format!("model {} is not served here", model.short()),
                ));
            }
            let Some(share) = h.files.clone() else {
                return Err((ErrorCode::NOT_FOUND, "this node serves no files".into()));
            };
            match file_source(&h.manifest, &share, name, req)? {
                FileSource::Bytes(b, range) => {
                    let (s, e) = (range.offset as usize, (range.offset + range.len) as usize);
                    Ok((vec![b.slice(s..e)], range.offset))
                }
                FileSource::Disk(range) => {
                    let path = share.dir.join(name);
                    let bytes = read_range(path, range).await.map_err(|e| {
                        tracing::warn!("reading {name} to serve it: {e:#}");
                        (ErrorCode::INTERNAL, format!("reading {name} failed"))
                    })?;
                    Ok((vec![bytes], range.offset))
                }
                FileSource::Pieces(path, pieces, offset) => {
                    let mut out = Vec::with_capacity(pieces.len());
                    for p in pieces {
                        out.push(match p {
                            Piece::Mem(b) => b,
                            Piece::Disk(at, len) => {
                                let range = stormo_wire::ByteRange { offset: at, len };
                                read_range(path.clone(), range).await.map_err(|e| {
                                    tracing::warn!("reading {name} to serve it: {e:#}");
                                    (ErrorCode::INTERNAL, format!("reading {name} failed"))
                                })?
                            }
                        });
                    }
                    Ok((out, offset))
                }
            }
        }
        Resource::Manifest { model } => {
            if model != h.model_id() {
                return Err((
                    ErrorCode::NOT_FOUND,
                    format!("no manifest of {}", model.short()),
                ));
            }
            Ok((vec![h.manifest_bytes.clone()], 0))
        }
        Resource::Expert { model, expert } => {
            if model != h.model_id() {
                return Err((
                    ErrorCode::NOT_FOUND,
                    format!("model {} is not served here", model.short()),
                ));
            }
            let entry = h.manifest.expert(expert);
            let (Some(entry), true) = (entry, h.announce.borrow().serves(expert)) else {
                return Err((
                    ErrorCode::NOT_FOUND,
                    format!("expert {expert} is not held here"),
                ));
            };
            if h.verified.lock().expect("verified lock").get(&expert) == Some(&false) {
                return Err((
                    ErrorCode::NOT_FOUND,
                    format!("expert {expert}: this node's copy does not match the manifest"),
                ));
            }
            let range = req.resolve(entry.len)?;
            if range.offset == 0 {
                h.demand.record(expert);
            }
            // The answer is the provider's own record (no copy): while it is sent, it is the
            // record the expert cache holds (pinned there, counted in its bytes).
            let (len, parts) = record_parts(h.experts.clone(), expert, range.offset, range.len)
                .await
                .map_err(|e| {
                    tracing::warn!("reading expert {expert} to serve it: {e:#}");
                    (
                        ErrorCode::INTERNAL,
                        format!("reading expert {expert} failed"),
                    )
                })?;
            if len != entry.len {
                return Err((
                    ErrorCode::INTERNAL,
                    format!("expert {expert} has an unexpected length"),
                ));
            }
            Ok((parts, range.offset))
        }
    }
}

/// Where a dense-only folder keeps the bytes of one published weight file.
#[derive(Debug, Clone)]
pub struct DenseFile {
    /// The published header, length prefix included: the file's first bytes.
    pub header: Bytes,
    /// The file holding its dense tensors.
    pub path: std::path::PathBuf,
    /// Per dense tensor (manifest index): its offset in the published file, its length, and
    /// its offset in `path`.
    pub tensors: Vec<(usize, u64, u64, u64)>,
}

impl DenseFile {
    /// Where the bytes `offset..offset + len` of the published file lie: pieces back to back,
    /// or the first byte that lies in no piece (one of a tensor not held here, or a gap).
    fn pieces(&self, offset: u64, len: u64) -> Result<Vec<Piece>, u64> {
        let (end, mut at) = (offset + len, offset);
        let mut out = Vec::new();
        let h = self.header.len() as u64;
        if at < h {
            let to = end.min(h);
            out.push(Piece::Mem(self.header.slice(at as usize..to as usize)));
            at = to;
        }
        while at < end {
            let Some(&(_, start, n, dense_at)) = self
                .tensors
                .iter()
                .find(|&&(_, start, n, _)| start <= at && at < start + n)
            else {
                return Err(at);
            };
            let to = end.min(start + n);
            out.push(Piece::Disk(dense_at + (at - start), to - at));
            at = to;
        }
        Ok(out)
    }
}

/// A piece of a range served from a dense-only folder.
#[derive(Debug)]
enum Piece {
    /// Bytes in memory (of the published header).
    Mem(Bytes),
    /// This many bytes at this offset of the dense file.
    Disk(u64, u64),
}

/// Where the bytes of a `GetFile` come from.
#[derive(Debug)]
enum FileSource {
    /// Held in memory (the signature).
    Bytes(Bytes, stormo_wire::ByteRange),
    /// This range of the file of that name in the folder.
    Disk(stormo_wire::ByteRange),
    /// Put together from a dense-only folder's header and dense file (at the range's offset).
    Pieces(std::path::PathBuf, Vec<Piece>, u64),
}

/// Decides whether `name` may be served for `req` and from where: only a file the manifest
/// lists (or the signature), only within its length, and from a dense-only folder only
/// outside the expert tensors. Names are compared with the manifest's names, never joined
/// into a path before they matched one.
fn file_source(
    m: &Manifest,
    share: &FileShare,
    name: &str,
    req: &ServeRequest,
) -> Result<FileSource, (ErrorCode, String)> {
    stormo_wire::check_file_name(name).map_err(|why| (ErrorCode::BAD_REQUEST, why))?;
    let not_found = || {
        (
            ErrorCode::NOT_FOUND,
            format!("{name:?} is not a file of this model's manifest"),
        )
    };
    if name == SIG_FILE {
        let sig = share.sig.clone().ok_or_else(not_found)?;
        let range = req.resolve(sig.len() as u64)?;
        return Ok(FileSource::Bytes(sig, range));
    }
    if let Some(meta) = m.identity.meta.iter().find(|f| f.name == name) {
        return Ok(FileSource::Disk(req.resolve(meta.len)?));
    }
    let (index, file) = m
        .files
        .iter()
        .enumerate()
        .find(|(_, f)| f.name == name)
        .ok_or_else(not_found)?;
    let range = req.resolve(file.len)?;
    let end = range.offset + range.len;
    let withheld = share
        .withheld
        .iter()
        .find(|&&(f, a, b, _)| f as usize == index && a < end && range.offset < b);
    if let Some((_, _, _, id)) = withheld {
        return Err((
            ErrorCode::NOT_FOUND,
            format!(
                "{name} bytes {}+{} include expert {id}, which this node does not serve",
                range.offset, range.len
            ),
        ));
    }
    if share.dense_only {
        let experts = expert_tensors(m);
        let hit = m.tensors.iter().enumerate().find(|(i, t)| {
            t.file as usize == index
                && experts.contains(i)
                && t.offset < end
                && range.offset < t.offset + t.len
        });
        if let Some((_, t)) = hit {
            return Err((
                ErrorCode::NOT_FOUND,
                format!(
                    "{name} bytes {}+{} include expert tensor {}, which this node does not hold",
                    range.offset, range.len, t.name
                ),
            ));
        }
    }
    if let Some(dense) = share.dense.as_ref().and_then(|d| d.get(index)) {
        let pieces = dense.pieces(range.offset, range.len).map_err(|at| {
            (
                ErrorCode::NOT_FOUND,
                format!("{name} byte {at} is in no tensor this node holds"),
            )
        })?;
        return Ok(FileSource::Pieces(dense.path.clone(), pieces, range.offset));
    }
    Ok(FileSource::Disk(range))
}

/// Where a folder holding the dense tensors only in files of their own keeps each of `m`'s
/// published weight files (`None` for any other folder): its index's headers, each checked
/// against the manifest, and the places of its dense tensors in the opened checkpoint.
pub fn dense_files(
    dir: &std::path::Path,
    m: &Manifest,
    files: &stormo_engine::ModelFiles,
) -> anyhow::Result<Option<Vec<DenseFile>>> {
    let Some(idx) = stormo_engine::safetensors::dense::DenseIndex::read(dir)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(m.files.len());
    for (i, file) in m.files.iter().enumerate() {
        let pf = idx
            .files
            .iter()
            .find(|f| f.name == file.name)
            .with_context(|| format!("{} does not list {}", dir.display(), file.name))?;
        let header = pf.header_bytes();
        super::pull::check_header(m, i, &header)
            .with_context(|| format!("{}: the header kept for {}", dir.display(), file.name))?;
        let mut tensors = Vec::new();
        let mut path = None;
        for (t, te) in m.tensors.iter().enumerate() {
            if te.file as usize != i {
                continue;
            }
            if let Some(info) = files.ckpt.tensors.get(&te.name) {
                anyhow::ensure!(
                    info.len == te.len,
                    "{}: tensor {} has another length than the manifest's",
                    dir.display(),
                    te.name
                );
                path = Some(files.ckpt.files[info.file].path.clone());
                tensors.push((t, te.offset, te.len, info.offset));
            }
        }
        out.push(DenseFile {
            header: Bytes::from(header),
            path: path.unwrap_or_else(|| dir.join(&pf.dense)),
            tensors,
        });
    }
    Ok(Some(out))
}

/// The indices (into `m.tensors`) of the tensors that hold expert bytes.
pub fn expert_tensors(m: &Manifest) -> std::collections::BTreeSet<usize> {
    m.experts
        .iter()
        .flat_map(|e| e.parts.iter().map(|p| p.tensor as usize))
        .collect()
}

/// Reads `range` of the file at `path` on a blocking thread.
async fn read_range(
    path: std::path::PathBuf,
    range: stormo_wire::ByteRange,
) -> anyhow::Result<Bytes> {
    tokio::task::spawn_blocking(move || -> anyhow::Result<Bytes> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f =
            std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        f.seek(SeekFrom::Start(range.offset))?;
        let len = usize::try_from(range.len).context("range too large")?;
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(Bytes::from(buf))
    })
    .await
    .context("the file reader panicked")?
}

/// Expert `id`'s record (its parts back to back, copied into one buffer), from the provider
/// on a blocking thread.
pub async fn record(experts: Arc<dyn ExpertProvider>, id: ExpertId) -> anyhow::Result<Bytes> {
    let (_, parts) = record_parts(experts, id, 0, u64::MAX).await?;
    Ok(Bytes::from(parts.concat()))
}

/// One part of a provider's expert record as `Bytes`, without a copy: it keeps the record
/// (and so its place in the provider's cache) alive while any slice of it is.
struct RecordPart(Arc<stormo_engine::moe::ExpertData>, usize);

impl AsRef<[u8]> for RecordPart {
    fn as_ref(&self) -> &[u8] {
        self.0
            .parts()
            .nth(self.1)
            .expect("a part index taken from the same record")
    }
}

/// The record's length and its bytes `offset..offset + len` (clamped to the record) as
/// slices of the provider's record parts, fetched on a blocking thread: nothing is copied.
pub async fn record_parts(
    experts: Arc<dyn ExpertProvider>,
    id: ExpertId,
    offset: u64,
    len: u64,
) -> anyhow::Result<(u64, Vec<Bytes>)> {
    tokio::task::spawn_blocking(move || -> anyhow::Result<(u64, Vec<Bytes>)> {
        let mut out = Vec::with_capacity(1);
        experts.fetch(id.layer as usize, &[id.expert as usize], &mut out)?;
        let data = out.pop().context("the provider returned no expert")?;
        let total: u64 = data.parts().map(|p| p.len() as u64).sum();
        let start = offset.min(total);
        let end = offset.saturating_add(len).min(total);
        let mut pieces = Vec::new();
        let mut at = 0u64;
        for (i, p) in data.parts().enumerate() {
            let (a, b) = (at, at + p.len() as u64);
            at = b;
            if b <= start || a >= end {
                continue;
            }
            let (from, to) = ((start.max(a) - a) as usize, (end.min(b) - a) as usize);
            pieces.push(Bytes::from_owner(RecordPart(data.clone(), i)).slice(from..to));
        }
        Ok((total, pieces))
    })
    .await
    .context("the expert reader panicked")?
}

/// As [`holdings`], serving experts through `provider`, the expert cache of a model
/// this process also runs (`stormo serve --http` with `--listen`), so the node keeps one cache
/// within one budget instead of two. Requests outside the inventory (`only`) are refused by
/// the server before they reach the provider.
pub fn open_holdings_sharing(
    dir: &std::path::Path,
    manifest: Option<&std::path::Path>,
    only: Option<&str>,
    provider: Arc<dyn ExpertProvider>,
) -> anyhow::Result<Holdings> {
    holdings(dir, manifest, only, |_, _| Ok(provider))
}

/// Opens the manifest and inventory of `dir`; `experts` makes the provider from the files
/// and the experts allowed.
pub fn holdings(
    dir: &std::path::Path,
    manifest: Option<&std::path::Path>,
    only: Option<&str>,
    experts: impl FnOnce(
        &stormo_engine::ModelFiles,
        Option<Vec<Vec<bool>>>,
    ) -> anyhow::Result<Arc<dyn ExpertProvider>>,
) -> anyhow::Result<Holdings> {
    let files = stormo_engine::ModelFiles::open(dir)
        .with_context(|| format!("loading the model in {}", dir.display()))?;
    let path = stormo_manifests::ManifestPaths::resolve(dir, manifest).bin;
    let (m, bytes) = stormo_manifests::read_manifest(&path).with_context(|| {
        format!(
            "reading the manifest (create it with `stormo manifest build --model {}`)",
            dir.display()
        )
    })?;
    check_layout(&m, &files.layout.sizes())?;
    let pulled = super::pull::Pulled::read(dir)?;
    let dense_only = pulled.as_ref().is_some_and(|p| !p.experts);
    if dense_only {
        tracing::warn!(
            "{} was pulled without experts: serving its manifest and dense files only, no experts",
            dir.display()
        );
    }
    let allowed = if dense_only {
        let shape: Vec<usize> = files.layout.parts.iter().map(Vec::len).collect();
        Some(shape.iter().map(|&n| vec![false; n]).collect())
    } else {
        only.map(|s| {
            let shape: Vec<usize> = files.layout.parts.iter().map(Vec::len).collect();
            super::parse_only_experts(s, &shape)
        })
        .transpose()?
    };
    let sig = own_signature(
        &stormo_manifests::ManifestPaths::resolve(dir, manifest).sig,
        &bytes,
    )?;
    let inventory = Holdings::inventory_of(&m, allowed.as_deref())?;
    let withheld = m
        .experts
        .iter()
        .filter(|e| !inventory.contains(e.id))
        .flat_map(|e| {
            let tensors = &m.tensors;
            e.parts.iter().filter_map(move |p| {
                let t = tensors.get(p.tensor as usize)?;
                Some((t.file, p.offset, p.offset + p.len, e.id))
            })
        })
        .collect();
    let dense = dense_files(dir, &m, &files)?;
    let experts = experts(&files, allowed)?;
    let schemas = files.layout.schemas.clone();
    Ok(Holdings {
        manifest_bytes: Bytes::from(bytes),
        manifest: Arc::new(m),
        experts,
        announce: tokio::sync::watch::Sender::new(Arc::new(Announce::holding(inventory))),
        files: Some(Arc::new(FileShare {
            dir: dir.to_path_buf(),
            sig,
            dense_only,
            dense,
            withheld,
        })),
        schemas,
        demand: Arc::default(),
        verified: Arc::default(),
    })
}

/// The manifest's signature file at `path`, if there is one, checked against the manifest it
/// sits beside (`manifest_bytes`): a signature that is not valid, or is over another manifest,
/// is refused rather than served to peers (who would refuse the manifest with it). Whose key
/// signed it is the peers' business (`--trust`), not checked here.
pub fn own_signature(
    path: &std::path::Path,
    manifest_bytes: &[u8],
) -> anyhow::Result<Option<Bytes>> {
    const MAX_SIG_FILE: u64 = 4096;
    let raw = match stormo_manifests::read_small_file(path, MAX_SIG_FILE) {
        Ok(raw) => raw,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let sig = stormo_manifests::ManifestSignature::from_bytes(&raw)
        .with_context(|| format!("{} is not a manifest signature", path.display()))?;
    sig.check(manifest_bytes).with_context(|| {
        format!(
            "refusing to serve: {} does not verify against the manifest beside it \
             (sign the manifest again, or remove the signature file)",
            path.display()
        )
    })?;
    Ok(Some(Bytes::from(raw)))
}

/// Checks that `m` lists exactly the experts of a checkpoint with record sizes `sizes`.
pub fn check_layout(m: &Manifest, sizes: &[Vec<u64>]) -> anyhow::Result<()> {
    let n: usize = sizes.iter().map(Vec::len).sum();
    anyhow::ensure!(
        m.experts.len() == n,
        "the manifest lists {} experts, the checkpoint has {n}",
        m.experts.len()
    );
    for e in &m.experts {
        let want = sizes
            .get(e.id.layer as usize)
            .and_then(|l| l.get(e.id.expert as usize));
        anyhow::ensure!(
            want == Some(&e.len),
            "expert {} is {} bytes in the manifest but {:?} in the checkpoint",
            e.id,
            e.len,
            want
        );
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The tiny GPT-OSS fixture with a manifest, in `dir`, as a server's holdings.
    pub(crate) fn fixture_holdings(dir: &std::path::Path) -> Holdings {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/gptoss-tiny-bf16");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.join(f)).expect("copying the fixture");
        }
        let m = stormo_manifests::build(dir, &stormo_manifests::BuildOptions::default())
            .expect("manifest");
        std::fs::write(dir.join("stormo-manifest.bin"), m.encode()).expect("manifest");
        holdings(dir, None, None, |files, _| {
            Ok(Arc::new(files.mapped_experts()?) as Arc<dyn ExpertProvider>)
        })
        .expect("holdings")
    }

    /// The inventory refresh and the placement driver write the one announcement on their own
    /// schedules: each changes only its own fields, so neither puts back what the other
    /// replaced (a refresh that carried the placement it read before its work undid the
    /// driver's newer one, and the node's peers saw two of its kept copies as fetching for
    /// good), and a write that changes nothing tells no peer.
    #[test]
    fn the_inventory_and_the_placement_never_undo_each_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = fixture_holdings(dir.path());
        let held = h.held();
        let empty = ExpertSet::new(held.layers(), held.experts_per_layer()).expect("a set");
        let placement = |kept: &ExpertSet, used: u64| stormo_wire::Placement {
            model: h.model_id(),
            budget: 1 << 20,
            used,
            pinned: empty.clone(),
            kept: kept.clone(),
            fetching: empty.clone(),
            demand: Vec::new(),
            leaving: false,
        };
        let mut changes = h.announce.subscribe();
        changes.borrow_and_update();

        let first = placement(&empty, 0);
        h.set_placement(first.clone());
        assert!(changes.has_changed().expect("open"));
        changes.borrow_and_update();
        h.set_inventory(empty.clone(), held.clone(), Vec::new());
        let now = changes.borrow_and_update().clone();
        assert_eq!(now.placement.as_deref(), Some(&first));
        assert_eq!((&now.held, &now.offered), (&empty, &held));

        let second = placement(&held, 7);
        h.set_placement(second.clone());
        let now = changes.borrow_and_update().clone();
        assert_eq!(now.placement.as_deref(), Some(&second));
        assert_eq!((&now.held, &now.offered), (&empty, &held));

        // Nothing new: no peer is told.
        h.set_inventory(empty.clone(), held.clone(), Vec::new());
        h.set_placement(second);
        assert!(!changes.has_changed().expect("open"));
    }
}
