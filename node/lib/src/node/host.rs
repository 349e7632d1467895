//! Where a node runs: the tokio runtime (the only one in the process), the node's key, its
//! one QUIC endpoint that both dials and, once the node serves, accepts, and the machine's
//! memory plan its expert cache is sized from.
//!
//! A [`Host`] is built before the model is opened, so a command can use it before it has a
//! [`Node`](super::Node) and then hand it to the Node it starts
//! ([`Node::start_on`](super::Node::start_on)): `stormo pull` finds its peers and fetches the
//! model folder through it, and the Node that fetches the experts next runs on the same
//! runtime, key and endpoint. The Node's start fills in what the host lacks (the key of
//! `--key`, an endpoint). Owns nothing of a model: no manifest, no tiers, no services.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;
use stormo_manifests::SecretKey;
use stormo_net::{self as net, PeerAddr};

use crate::memory::MemoryPlan;

/// A node's runtime, key and endpoint. See the module docs.
#[derive(Debug)]
pub struct Host {
    pub(super) rt: NodeRuntime,
    pub(super) secret: Option<SecretKey>,
    pub(super) endpoint: Option<quinn::Endpoint>,
    /// The command's reading of the machine's memory (`None`: read when the node starts).
    pub(super) memory: Option<MemoryPlan>,
}

impl Host {
    /// A runtime (two worker threads), no key, no endpoint yet.
    pub fn new() -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stormo-node")
            .enable_all()
            .build()
            .context("starting the node's runtime")?;
        Ok(Self {
            rt: NodeRuntime(Some(rt)),
            secret: None,
            endpoint: None,
            memory: None,
        })
    }

    /// This host with the key `secret` (loaded once by the caller, e.g. with the swarm
    /// options it was checked against), which a Node started on it uses.
    pub fn with_key(mut self, secret: SecretKey) -> Self {
        self.secret = Some(secret);
        self
    }

    /// This host with the memory plan `memory` (the command's one reading of the machine's
    /// memory, which also gave the HTTP API's `--parallel` default), from which a Node started
    /// on it sizes its expert cache.
    pub fn with_memory(mut self, memory: MemoryPlan) -> Self {
        self.memory = Some(memory);
        self
    }

    /// The node's key: the one the host has, else the key in `path`, else a new ephemeral key
    /// (with a warning, see [`net::node_key`]); kept for whatever runs on the host next.
    pub fn key_or_load(&mut self, path: Option<&Path>) -> anyhow::Result<&SecretKey> {
        if self.secret.is_none() {
            self.secret = Some(net::node_key(path)?);
        }
        Ok(self.secret.as_ref().expect("set above"))
    }

    /// The endpoint, bound now if the host has none: on `listen` when given (a node that
    /// serves is dialled there, and dials from there), else on an ephemeral port of every
    /// interface, IPv6 when one of `peers` is. A host already bound elsewhere than `listen`
    /// is an error naming both.
    pub fn endpoint_or_bind(
        &mut self,
        listen: Option<SocketAddr>,
        peers: &[PeerAddr],
    ) -> anyhow::Result<&quinn::Endpoint> {
        if let (Some(ep), Some(want)) = (&self.endpoint, listen) {
            let bound = ep.local_addr().context("the node's bound address")?;
            anyhow::ensure!(
                bound == want || (want.port() == 0 && bound.ip() == want.ip()),
                "the node's endpoint is bound on {bound}, not on {want} where it should listen"
            );
        }
        if self.endpoint.is_none() {
            let addr =
                listen.unwrap_or_else(|| net::unspecified(peers.iter().any(|q| q.addr.is_ipv6())));
            let _g = self.rt.enter();
            self.endpoint = Some(net::bind(addr, None)?);
        }
        Ok(self.endpoint.as_ref().expect("bound above"))
    }

    /// The runtime.
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    /// The key, once there is one.
    pub fn key(&self) -> Option<&SecretKey> {
        self.secret.as_ref()
    }

    /// The endpoint, once bound.
    pub fn endpoint(&self) -> Option<&quinn::Endpoint> {
        self.endpoint.as_ref()
    }
}

/// The node's runtime, shut down without waiting when the node goes: the last holder of a
/// node may be one of its own tasks (an HTTP connection's), where a blocking drop panics.
#[derive(Debug)]
pub(super) struct NodeRuntime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for NodeRuntime {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0
            .as_ref()
            .expect("the runtime lives as long as the node")
    }
}

impl Drop for NodeRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}
