//! stormo's network tier: serving and fetching verified experts over QUIC.
//!
//! - [`congestion`]: stormo's own congestion controller (CUBIC that lets random loss pass
//!   while the path's queue is empty).
//! - [`tls`]: TLS 1.3 with both sides authenticated by their Ed25519 node keys (raw public
//!   keys), and the admission policy of a private swarm.
//! - [`serve`]: the serving side (`stormo serve`): hello and inventory on a control stream,
//!   one stream per request answered from the node's expert tiers, per-peer and node-wide
//!   limits answered `busy`.
//! - [`tier`]: the fetching side, a [`stormo_engine::tiers::Tier`] named "peer" that streams
//!   each expert from a peer holding it, verifies every chunk against the manifest, and moves
//!   on to another peer on any failure.
//! - [`remote`]: remote expert execution, the engine's executor over the node's peers.
//! - [`remote_policy`]: remote expert execution's choice (fetch an expert or have a peer
//!   holding it compute it), sans-IO.
//!
//! Helpers here: node identity ([`node_key`]), peer names ([`PeerAddr`]), expert subsets
//! ([`parse_only_experts`]), a tuned UDP endpoint ([`bind`]) and framed reads ([`FramedRecv`]).
//! - [`placement`]: which experts a serving node fetches and evicts so the swarm keeps
//!   `--replicas` copies of each (sans-IO).
//! - [`discover`]: finding peers by mDNS and the mainline DHT.
//! - [`identity`]: the node key and swarm certificate files; [`swarm`]: membership resolved.
//! - [`progress`]: progress lines and human units.
//!
//! No CLI and no HTTP here (the `stormo` binary and `stormo_node` sit above); the
//! `stormo_node::node::Node` composes these with the engine's tiers.

pub mod congestion;
pub mod discover;
pub mod exec;
pub mod expert_dir;
pub mod identity;
pub mod load;
pub mod placement;
pub mod policy;
pub mod progress;
pub mod pull;
pub mod remote;
pub mod remote_policy;
pub mod serve;
pub mod swarm;
pub mod tier;
pub mod tls;

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use stormo_manifests::{Hash, Manifest, ManifestSignature, PublicKey, SecretKey};
use stormo_wire::{DecodeError, FrameDecoder, Message, Piece};

/// UDP socket buffer size: the default ~200 KiB drops packets of a 13 MB expert on loopback.
pub const SOCKET_BUFFER: usize = 4 << 20;
/// The largest UDP payload a node sends or accepts, and the upper bound of QUIC's path MTU
/// discovery. Each path starts at QUIC's 1,200 bytes and discovery probes upward: an Ethernet
/// path settles near 1,452, loopback and jumbo-frame LANs climb to this, and a path that
/// stops carrying large datagrams is caught by quinn's black-hole detection, which falls back
/// to 1,200. QUIC on loopback is bound by CPU per packet, so larger datagrams carry more bytes
/// per second (see docs/network.md). Not higher: quinn sends up to 10 datagrams in one batched
/// (GSO) send, which must stay under 64 KiB, and above about 6,550 the batch fails silently.
pub const MAX_UDP_PAYLOAD: u16 = 6500;
/// The longest a connection attempt (QUIC handshake plus Hello) may take (for a node that
/// fetches, `--peer-timeout` when that is shorter).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// An error and its causes on one line, each cause once (a cause whose text the message
/// already ends with is not repeated): how every error reaches the user.
pub fn error_message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.ends_with(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}

/// The node's identity: the key in `path`, or a new ephemeral key (with a warning: peers
/// cannot allow-list a key that changes every start).
pub fn node_key(path: Option<&Path>) -> anyhow::Result<SecretKey> {
    match path {
        Some(p) => identity::load_secret_key(p).context("cannot use the node key (--key)"),
        None => {
            let k = SecretKey::generate();
            tracing::warn!(
                "no --key given: using an ephemeral node key {} (create one with `stormo key generate --key FILE`)",
                k.public()
            );
            Ok(k)
        }
    }
}

/// A peer named `KEY@HOST:PORT`: its Ed25519 node key (64 hex) and where it listens.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerAddr {
    /// The key it must prove.
    pub key: PublicKey,
    /// Its address.
    pub addr: SocketAddr,
}

impl fmt::Debug for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", short_key(&self.key), self.addr)
    }
}

/// The first 8 hex characters of a key, for logs.
pub fn short_key(k: &PublicKey) -> String {
    k.to_hex()[..8].to_string()
}

impl FromStr for PeerAddr {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        let s = s.trim();
        let Some((key, addr)) = s.split_once('@') else {
            anyhow::bail!(
                "peer {s:?}: expected KEY@HOST:PORT (the peer's 64-hex node key, then its address)"
            );
        };
        // Each message carries its cause inline: clap shows a value parser's error without
        // its chain.
        let key: PublicKey = key.parse().map_err(|e| {
            anyhow::anyhow!("peer {s:?}: the part before '@' is not a node key ({e})")
        })?;
        let Some((host, port)) = addr.rsplit_once(':') else {
            anyhow::bail!("peer {s:?}: {addr:?} is not HOST:PORT");
        };
        if port.parse::<u16>().is_err() {
            anyhow::bail!("peer {s:?}: the port {port:?} is not a number from 0 to 65535");
        }
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| anyhow::anyhow!("peer {s:?}: cannot resolve the host {host:?} ({e})"))?
            .next()
            .with_context(|| format!("peer {s:?}: the host {host:?} has no address"))?;
        Ok(Self { key, addr })
    }
}

/// Reads the allow-list: keys from `--allow` and from `--allow-file` (one 64-hex key per line;
/// blank lines and `#` comments skipped).
pub fn allow_list(keys: &[String], file: Option<&Path>) -> anyhow::Result<Vec<PublicKey>> {
    let mut out = Vec::new();
    for k in keys {
        out.push(k.parse().context("--allow")?);
    }
    if let Some(p) = file {
        let text =
            // One key a line: 1 MiB holds about 16,000 keys; the cap keeps a device or a
            // runaway file from filling memory.
            stormo_engine::safetensors::read_small_text(p, 1 << 20)
                .with_context(|| format!("--allow-file {}", p.display()))?;
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            out.push(
                line.parse()
                    .with_context(|| format!("{} line {}", p.display(), i + 1))?,
            );
        }
    }
    Ok(out)
}

/// Parses `--only-experts`: `A-B,C` (these experts in every layer) or `L:A-B,L:C,M:D-E` (per
/// layer; layers not named get none). Returns `[layer][expert]` flags for `shape` (experts per
/// layer, 0 for dense layers).
pub fn parse_only_experts(spec: &str, shape: &[usize]) -> anyhow::Result<Vec<Vec<bool>>> {
    parse_expert_spec("--only-experts", spec, shape)
}

/// [`parse_only_experts`] for the option `flag` (its errors name it): `pull --experts` takes
/// the same syntax.
pub fn parse_expert_spec(
    flag: &str,
    spec: &str,
    shape: &[usize],
) -> anyhow::Result<Vec<Vec<bool>>> {
    let spec = spec.trim();
    anyhow::ensure!(
        !spec.is_empty(),
        "{flag}: empty (e.g. 0-15 or 0:0-7,1:8-15)"
    );
    if spec == "all" {
        return Ok(shape.iter().map(|&n| vec![true; n]).collect());
    }
    let per_layer = spec.contains(':');
    let mut out: Vec<Vec<bool>> = shape.iter().map(|&n| vec![false; n]).collect();
    let experts_max = shape.iter().copied().max().unwrap_or(0);
    let mut mark = |layer: Option<usize>, lo: usize, hi: usize| -> anyhow::Result<()> {
        let layers: Vec<usize> = match layer {
            Some(l) => {
                anyhow::ensure!(
                    l < shape.len(),
                    "{flag}: layer {l} does not exist (the model has {} layers)",
                    shape.len()
                );
                vec![l]
            }
            None => (0..shape.len()).collect(),
        };
        anyhow::ensure!(
            hi < experts_max,
            "{flag}: expert {hi} does not exist (layers have {experts_max} experts)"
        );
        for l in layers {
            let row = &mut out[l];
            let end = (hi + 1).min(row.len());
            if lo < end {
                row[lo..end].iter_mut().for_each(|f| *f = true);
            }
        }
        Ok(())
    };
    for item in spec.split(',').map(str::trim) {
        let (layer, range) = if per_layer {
            let Some((l, r)) = item.split_once(':') else {
                anyhow::bail!("{flag}: {item:?} has no layer (per-layer form is LAYER:A-B; do not mix with plain ranges)");
            };
            let l: usize = l
                .trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("{flag}: {l:?} is not a layer number"))?;
            (Some(l), r.trim())
        } else {
            (None, item)
        };
        let num = |t: &str| -> anyhow::Result<usize> {
            t.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("{flag}: {t:?} is not an expert number"))
        };
        let (lo, hi) = match range.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(range)?;
                (n, n)
            }
        };
        anyhow::ensure!(lo <= hi, "{flag}: range {range:?} is backwards");
        mark(layer, lo, hi)?;
    }
    Ok(out)
}

/// The unspecified address (all interfaces), port 0: where a node that only dials binds.
pub fn unspecified(v6: bool) -> SocketAddr {
    if v6 {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    } else {
        SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0))
    }
}

/// A UDP endpoint on `addr` with [`SOCKET_BUFFER`] socket buffers, serving with `server` if
/// given. Must be called inside a tokio runtime.
pub fn bind(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> anyhow::Result<quinn::Endpoint> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .context("creating a UDP socket")?;
    for (what, r) in [
        ("receive", sock.set_recv_buffer_size(SOCKET_BUFFER)),
        ("send", sock.set_send_buffer_size(SOCKET_BUFFER)),
    ] {
        if let Err(e) = r {
            tracing::warn!("could not set the UDP {what} buffer to {SOCKET_BUFFER} bytes: {e}");
        }
    }
    sock.bind(&addr.into())
        .with_context(|| format!("binding UDP {addr}"))?;
    let udp: std::net::UdpSocket = sock.into();
    let mut config = quinn::EndpointConfig::default();
    config
        .max_udp_payload_size(MAX_UDP_PAYLOAD)
        .context("the largest UDP payload")?;
    quinn::Endpoint::new(config, server, udp, Arc::new(quinn::TokioRuntime))
        .with_context(|| format!("starting QUIC on {addr}"))
}

/// Why a framed read stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The peer's bytes are not a valid frame (close the connection).
    #[error("malformed frame: {0}")]
    Decode(#[from] DecodeError),
    /// The stream or connection failed.
    #[error(transparent)]
    Stream(#[from] quinn::ReadError),
}

/// Messages from a QUIC receive stream, one frame at a time.
#[derive(Debug)]
pub struct FramedRecv {
    recv: quinn::RecvStream,
    dec: FrameDecoder,
    buf: bytes::Bytes,
    received: u64,
}

impl FramedRecv {
    /// Frames up to `max` bytes from `recv`.
    pub fn new(recv: quinn::RecvStream, max: usize) -> Self {
        Self {
            recv,
            dec: FrameDecoder::with_max(max),
            buf: bytes::Bytes::new(),
            received: 0,
        }
    }

    /// Bytes read from the stream so far, whole frames or not.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The next message, or `None` at a clean end of the stream.
    pub async fn next(&mut self) -> Result<Option<Message>, ReadError> {
        loop {
            if !self.buf.is_empty() {
                let mut input: &[u8] = &self.buf;
                let before = input.len();
                let m = self.dec.decode(&mut input)?;
                let used = before - input.len();
                let _ = self.buf.split_to(used);
                if let Some(m) = m {
                    return Ok(Some(m));
                }
                continue;
            }
            match self.recv.read_chunk(1 << 20, true).await? {
                Some(c) => {
                    self.received += c.bytes.len() as u64;
                    self.buf = c.bytes;
                }
                None => {
                    self.dec.finish()?;
                    return Ok(None);
                }
            }
        }
    }

    /// The next pieces, as [`stormo_wire::FrameDecoder::decode_streaming`] cuts the stream,
    /// appended to `out`: those of every chunk quinn has received (up to 32 at once), so that
    /// the caller handles a batch at a time rather than a datagram's worth. A Data frame's
    /// payload comes out as slices of those chunks (no copy), for the caller to write where
    /// it belongs. Returns `false` at a clean end of the stream (nothing appended). Use this
    /// or [`FramedRecv::next`] on a stream, not both.
    pub async fn next_pieces(&mut self, out: &mut Vec<StreamPiece>) -> Result<bool, ReadError> {
        const BATCH: usize = 32;
        let mut chunks: [bytes::Bytes; BATCH] = Default::default();
        loop {
            self.decode_pieces(out)?;
            if !out.is_empty() {
                return Ok(true);
            }
            match self.recv.read_chunks(&mut chunks).await? {
                Some(n) => {
                    for c in &mut chunks[..n] {
                        self.received += c.len() as u64;
                        self.buf = std::mem::take(c);
                        self.decode_pieces(out)?;
                    }
                }
                None => {
                    self.dec.finish()?;
                    return Ok(false);
                }
            }
        }
    }

    /// Decodes the whole of `self.buf` into `out`.
    fn decode_pieces(&mut self, out: &mut Vec<StreamPiece>) -> Result<(), ReadError> {
        let mut input: &[u8] = &self.buf;
        while !input.is_empty() {
            let Some(p) = self.dec.decode_streaming(&mut input)? else {
                continue;
            };
            out.push(match p {
                Piece::Message(m) => StreamPiece::Message(m),
                Piece::DataHeader {
                    request_id,
                    offset,
                    len,
                } => StreamPiece::DataHeader {
                    request_id,
                    offset,
                    len,
                },
                Piece::DataBytes {
                    request_id,
                    offset,
                    bytes,
                    last,
                } => StreamPiece::DataBytes {
                    request_id,
                    offset,
                    bytes: self.buf.slice_ref(bytes),
                    last,
                },
            });
        }
        self.buf = bytes::Bytes::new();
        Ok(())
    }

    /// The underlying stream (to stop it).
    pub fn stream(&mut self) -> &mut quinn::RecvStream {
        &mut self.recv
    }
}

/// A piece of [`FramedRecv::next_pieces`]: [`Piece`] with the payload bytes held as a slice of
/// the received chunk.
#[derive(Debug)]
pub enum StreamPiece {
    /// A whole message other than Data.
    Message(Message),
    /// A Data frame's header.
    DataHeader {
        /// The request answered.
        request_id: stormo_wire::RequestId,
        /// The payload's offset in the resource.
        offset: u64,
        /// The payload's length.
        len: u64,
    },
    /// Payload bytes of the current Data frame.
    DataBytes {
        /// The request answered.
        request_id: stormo_wire::RequestId,
        /// Offset of `bytes[0]` in the resource.
        offset: u64,
        /// The bytes.
        bytes: bytes::Bytes,
        /// Whether they end the frame.
        last: bool,
    },
}

impl StreamPiece {
    /// Hands the piece to `req` ([`stormo_wire::Requests::handle_piece`]).
    pub fn feed(
        self,
        req: &mut stormo_wire::Requests,
        now: std::time::Instant,
    ) -> Result<(), stormo_wire::UnexpectedMessage> {
        match self {
            Self::Message(m) => req.handle_message(now, m),
            Self::DataHeader {
                request_id,
                offset,
                len,
            } => req.handle_piece(
                now,
                Piece::DataHeader {
                    request_id,
                    offset,
                    len,
                },
            ),
            Self::DataBytes {
                request_id,
                offset,
                bytes,
                last,
            } => req.handle_piece(
                now,
                Piece::DataBytes {
                    request_id,
                    offset,
                    bytes: &bytes,
                    last,
                },
            ),
        }
    }
}

/// Writes one message as a frame.
pub async fn write_message(send: &mut quinn::SendStream, m: &Message) -> anyhow::Result<()> {
    let f = stormo_wire::encode_frame(m).context("encoding a message")?;
    send.write_all(&f).await.context("writing to the stream")?;
    Ok(())
}

/// Accepts manifest `bytes` only if its id equals `model_id` (when given) and its signature
/// `sig` (the .sig file's bytes) verifies against one of `trust` (when given); at least one of
/// the two must be given. Returns the manifest and its id.
pub fn accept_manifest(
    bytes: &[u8],
    sig: Option<&[u8]>,
    trust: &[PublicKey],
    model_id: Option<Hash>,
) -> anyhow::Result<(Manifest, Hash)> {
    anyhow::ensure!(
        model_id.is_some() || !trust.is_empty(),
        "say which manifest to accept: --trust PUBKEY (the publisher's key) or --model-id ID"
    );
    let id = Hash::of(bytes);
    if let Some(want) = model_id {
        anyhow::ensure!(
            id == want,
            "manifest refused: its model id is {id}, not the pinned --model-id {want}"
        );
    }
    if !trust.is_empty() {
        let sig = sig.context(
            "manifest refused: --trust needs its signature (stormo-manifest.sig beside it), and there is none",
        )?;
        let sig =
            ManifestSignature::from_bytes(sig).context("manifest refused: the signature file")?;
        sig.verify(bytes, trust)
            .context("manifest refused: its signature does not verify against --trust")?;
    }
    let m = Manifest::decode(bytes).context("manifest refused: not a valid manifest")?;
    Ok((m, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_addr_parses_and_names_what_is_wrong() {
        let key = SecretKey::from_seed(&[1; 32]).public();
        let p: PeerAddr = format!("{key}@127.0.0.1:4433").parse().unwrap();
        assert_eq!(p.key, key);
        assert_eq!(p.addr, "127.0.0.1:4433".parse().unwrap());
        let e = format!("{:#}", "127.0.0.1:4433".parse::<PeerAddr>().unwrap_err());
        assert!(e.contains("KEY@HOST:PORT"), "{e}");
        let e = format!("{:#}", "abc@127.0.0.1:1".parse::<PeerAddr>().unwrap_err());
        assert!(e.contains("before '@'"), "{e}");
        let e = format!(
            "{:#}",
            format!("{key}@127.0.0.1").parse::<PeerAddr>().unwrap_err()
        );
        assert!(e.contains("HOST:PORT"), "{e}");
    }

    #[test]
    fn only_experts_both_forms() {
        let shape = [8, 8, 0];
        let all = parse_only_experts("0-2,5", &shape).unwrap();
        assert_eq!(all[0], [true, true, true, false, false, true, false, false]);
        assert_eq!(all[1], all[0]);
        assert!(all[2].is_empty());
        let per = parse_only_experts("0:0-1,1:7", &shape).unwrap();
        assert_eq!(
            per[0],
            [true, true, false, false, false, false, false, false]
        );
        assert_eq!(
            per[1],
            [false, false, false, false, false, false, false, true]
        );
        let every = parse_only_experts(" all ", &shape).unwrap();
        assert_eq!(every, [vec![true; 8], vec![true; 8], vec![]]);
        for bad in [
            "", "3-1", "0-8", "x", "5:0", "0:1,2", "0:a-b", "al", "all,0",
        ] {
            assert!(parse_only_experts(bad, &shape).is_err(), "{bad:?} accepted");
        }
    }
}
