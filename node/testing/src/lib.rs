//! Test support for stormo's crates: the harnesses their tests would otherwise each write
//! again. A dev-dependency only (of `stormo-net`'s unit tests and the workspace integration
//! tests), so nothing here reaches a build of stormo, and the crates' internals stay
//! `pub(crate)` rather than opened up for tests.
//!
//! `stormo-net`'s own unit tests link a second copy of `stormo-net` through this crate, whose
//! types are not theirs: what they use here ([`runtime`], [`Member`]) takes and returns only
//! other crates' types (std, tokio, quinn, `stormo-manifests`).
//!
//! - [`runtime`]: a small tokio runtime for a test's servers and clients.
//! - [`Server`]: a peer server (`stormo serve`'s serving code) on a runtime of its own. It
//!   gives `stormo-net`'s own types, so only tests outside `stormo-net` use it.
//! - [`Member`]: a swarm member's connection to a peer server, its control stream open.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use stormo_manifests::{Membership, PublicKey, SecretKey};
use stormo_net::serve::{Holdings, ServeConfig, ServerHandle};
use stormo_net::{FramedRecv, PeerAddr};
use stormo_wire::{Hello, Limits, Message, NodeId, PROTOCOL_VERSION};

/// How long a test waits for a handshake or the server's `Hello` (a busy machine included).
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// A tokio runtime with one worker thread and every driver, for a test's servers and clients.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A peer server (`stormo serve`'s serving code) as node key `[seed; 32]`, on a runtime of its
/// own (one worker thread); closed, and its runtime shut down, when killed or dropped.
#[derive(Debug)]
pub struct Server {
    /// Its node key.
    pub key: SecretKey,
    /// The running server: its address and counters.
    pub handle: Arc<ServerHandle>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Server {
    /// Serves `holdings` with `cfg` as node key `[seed; 32]` on an ephemeral port of 127.0.0.1.
    pub fn start(seed: u8, holdings: Holdings, cfg: ServeConfig) -> Self {
        Self::start_at(seed, holdings, cfg, "127.0.0.1:0".parse().expect("address"))
    }

    /// Serves `holdings` with `cfg` as node key `[seed; 32]` on `at`.
    pub fn start_at(seed: u8, holdings: Holdings, cfg: ServeConfig, at: SocketAddr) -> Self {
        let key = SecretKey::from_seed(&[seed; 32]);
        let rt = runtime();
        let handle = rt
            .block_on(async { stormo_net::serve::start(&key, at, Arc::new(holdings), cfg) })
            .expect("server starts");
        Self {
            key,
            handle: Arc::new(handle),
            rt: Some(rt),
        }
    }

    /// Its key and address, as a peer dials it.
    pub fn addr(&self) -> PeerAddr {
        PeerAddr {
            key: self.key.public(),
            addr: self.handle.local_addr(),
        }
    }

    /// A connection to it as client `key` (admitted or not by its policy), on an endpoint of
    /// its own on 127.0.0.1 (close the endpoint when done). Panics (the test fails) when the
    /// handshake fails. Must be called inside a tokio runtime (the test's, not the server's).
    pub async fn dial(&self, key: &SecretKey) -> (quinn::Endpoint, quinn::Connection) {
        let cc = stormo_net::tls::client_config(key, &self.key.public()).expect("client config");
        let ep = stormo_net::bind("127.0.0.1:0".parse().expect("address"), None).expect("bind");
        let conn = ep
            .connect_with(cc, self.handle.local_addr(), "stormo")
            .expect("connect")
            .await
            .expect("handshake");
        (ep, conn)
    }

    /// Requests it answered in full.
    pub fn served(&self) -> u64 {
        self.handle.stats.served.load(Ordering::Relaxed)
    }

    /// Closes it and shuts its runtime down (without waiting): a peer that went away.
    pub fn kill(&mut self) {
        self.handle.close();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A swarm member's connection to a peer server (a `stormo serve` process, or a server a test
/// started), its control stream open: a `Hello` each way, so the server's connection task
/// runs and watches it. Used to see when, and why, the server closes it.
#[derive(Debug)]
pub struct Member {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    _control: (quinn::SendStream, FramedRecv),
}

impl Member {
    /// Connects to the server at `server` whose node key is `server_key`, as node `me` with the
    /// certificate `cert`, and exchanges the `Hello`s. Panics (the test fails) when the server
    /// does not admit it or does not answer within 10 s. Must be called inside a tokio runtime.
    pub async fn connect(
        server: SocketAddr,
        server_key: &PublicKey,
        me: &SecretKey,
        cert: &Membership,
    ) -> Self {
        let endpoint = stormo_net::bind("127.0.0.1:0".parse().expect("addr"), None).expect("bind");
        let id = stormo_net::tls::Identity {
            secret: me,
            membership: Some(cert),
        };
        let cc = stormo_net::tls::client_config_for(
            id,
            Some(server_key),
            stormo_net::tls::Admission::Any,
        )
        .expect("client config");
        let connecting = endpoint
            .connect_with(cc, server, "stormo")
            .expect("connect");
        let conn = tokio::time::timeout(ANSWER_WITHIN, connecting)
            .await
            .expect("a handshake within 10 s")
            .expect("a member is admitted");
        let (mut send, recv) = conn.open_bi().await.expect("a control stream");
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            node: NodeId(*me.public().as_bytes()),
            models: Vec::new(),
            limits: Limits {
                max_concurrent_requests: 1,
            },
        });
        stormo_net::write_message(&mut send, &hello)
            .await
            .expect("send the hello");
        let mut recv = FramedRecv::new(recv, 1 << 20);
        let answer = tokio::time::timeout(ANSWER_WITHIN, recv.next())
            .await
            .expect("the server's hello within 10 s");
        assert!(
            matches!(answer, Ok(Some(Message::Hello(_)))),
            "the server did not say hello: {answer:?}"
        );
        Self {
            endpoint,
            conn,
            _control: (send, recv),
        }
    }

    /// Connects to the server a peer line `KEY@ADDR` names (what `stormo serve` prints): see
    /// [`Member::connect`].
    pub async fn connect_to(line: &str, me: &SecretKey, cert: &Membership) -> Self {
        let (key, addr) = line.split_once('@').expect("KEY@ADDR");
        let server_key: PublicKey = key.parse().expect("the server's key");
        let addr = addr.trim().parse().expect("the server's address");
        Self::connect(addr, &server_key, me, cert).await
    }

    /// Waits at most until `until` for the server to close the connection: its application
    /// code and reason (`Err`: still open, or closed otherwise, saying how).
    pub async fn closed_by(&self, until: tokio::time::Instant) -> Result<(u64, String), String> {
        match tokio::time::timeout_at(until, self.conn.closed()).await {
            Err(_) => Err("still open".into()),
            Ok(quinn::ConnectionError::ApplicationClosed(c)) => Ok((
                c.error_code.into_inner(),
                String::from_utf8_lossy(&c.reason).into_owned(),
            )),
            Ok(other) => Err(format!("closed otherwise: {other}")),
        }
    }

    /// Why the connection closed, if it has.
    pub fn close_reason(&self) -> Option<quinn::ConnectionError> {
        self.conn.close_reason()
    }

    /// Closes this member's endpoint (and so its connection).
    pub fn close(self) {
        self.endpoint.close(0u32.into(), b"done");
    }
}
