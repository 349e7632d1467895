//! TLS 1.3 for QUIC with both sides authenticated by their Ed25519 node keys, and the
//! admission policy that decides which proven keys may talk to this node.
//!
//! # Identity
//! Each side presents a self-signed X.509 certificate (made with `rcgen`) whose subject
//! public key is its Ed25519 node key, and proves that key with the TLS 1.3 handshake
//! signature. The verifiers below read exactly two things from the peer's certificate: the
//! subject public key info, which must be an Ed25519 key in the one DER form [`spki`] writes,
//! and, if present, the membership extension ([`MEMBERSHIP_OID`]). Nothing else in it (names,
//! dates, its self-signature) is trusted or needed: the handshake signature is verified
//! against that SPKI exactly as it was when nodes sent raw public keys (RFC 7250), so a peer's
//! identity is the key it proved, as before, and a client still pins the key it dialled.
//!
//! # Swarm membership
//! A node of a swarm ([`Identity::membership`]) carries its [`Membership`] certificate (154
//! bytes, signed by the swarm owner) in a non-critical X.509 extension of its TLS
//! certificate, so membership is checked *inside the handshake* by the same verifiers, on
//! both sides: a server admits a client, and a client dialling a discovered peer admits that
//! server, only if [`Admission::Swarm`] accepts the membership for the key proven. A refusal
//! fails the handshake before any stream opens, and is logged (WARN) with its reason: no
//! certificate, a certificate that does not decode, another swarm, a bad signature (forged
//! or edited), another node's certificate, revoked, not yet valid or expired.
//!
//! Carrying it in the handshake (rather than as the first control-stream message) keeps the
//! check in this module: nothing is served before it, and no caller can forget it.
//!
//! The handshake is not the only check: a server watches the connections it admitted
//! (`LiveMembers`, in `tls/live.rs`) and closes those of a key revoked later, or whose
//! certificate expired, within about a second.
//! Raw public keys were given up because they have no room for an extension.
//!
//! The extension's OID is [`MEMBERSHIP_OID`], an arc under the private-enterprise branch
//! picked for stormo and not registered: only stormo reads it, and it is marked non-critical.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{
    CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, SubjectPublicKeyInfoDer,
    UnixTime,
};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use stormo_manifests::{Membership, MembershipDecodeError, MembershipError, PublicKey, SecretKey};

mod list;
mod live;

pub use list::RevokedList;
pub(crate) use live::{LiveMembers, Watched};

/// DER prefix of an Ed25519 SubjectPublicKeyInfo; the 32 key bytes follow.
const SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];
/// DER prefix of an Ed25519 PKCS#8 v1 private key; the 32 seed bytes follow.
const PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
/// The X.509 extension that carries a node's [`Membership`] certificate (its 154 bytes as
/// the extension's value).
pub const MEMBERSHIP_OID: &[u64] = &[1, 3, 6, 1, 4, 1, 61_541, 41, 1];
/// The largest certificate a peer may present (ours are a few hundred bytes).
const MAX_PEER_CERT: usize = 4096;

/// The longest a connection may stay silent before it is dropped (keep-alives are sent well
/// before that).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of one stream a server's QUIC buffers before its reader takes them (see
/// [`server_config`]).
pub const SERVER_STREAM_WINDOW: u32 = 512 << 10;
/// Bytes of all streams of one connection a server's QUIC buffers before they are read.
pub const SERVER_CONNECTION_WINDOW: u32 = 2 << 20;
/// How often an idle connection is kept alive.
pub const KEEP_ALIVE: Duration = Duration::from_secs(3);

/// Who this node is in a handshake: its node key and, in a swarm, the owner's certificate
/// for that key.
#[derive(Clone, Copy, Debug)]
pub struct Identity<'a> {
    /// The node key.
    pub secret: &'a SecretKey,
    /// Its membership certificate, presented to every peer.
    pub membership: Option<&'a Membership>,
}

impl<'a> Identity<'a> {
    /// A node key with no membership (`--allow` lists and pinned peers only).
    pub fn key(secret: &'a SecretKey) -> Self {
        Self {
            secret,
            membership: None,
        }
    }
}

/// Which node keys this node admits.
#[derive(Clone, Debug)]
pub enum Admission {
    /// Anyone with a valid key (asked for explicitly with `--allow-any`).
    Any,
    /// Only these keys (a private swarm).
    Keys(HashSet<[u8; 32]>),
    /// Members of a swarm (`--swarm`), and the keys of `allow` besides.
    Swarm(Arc<SwarmAdmission>),
    /// These keys (`--allow`) and those of a file (`--allow-file`), re-read when the file
    /// changes: a key added to the file is admitted without a restart, one removed is refused
    /// from the next handshake on.
    Listed {
        /// Keys given on the command line.
        keys: HashSet<[u8; 32]>,
        /// The allow-list file (the same one-key-a-line format as a revocation list).
        file: Arc<RevokedList>,
    },
}

/// The members of one swarm: any key with a valid, unexpired membership certificate signed
/// by `swarm` and not revoked; and the keys of `allow` (from `--allow`, `--allow-file`), or
/// anyone if `allow_any`.
#[derive(Debug)]
pub struct SwarmAdmission {
    /// The swarm key (its owner's public key).
    pub swarm: PublicKey,
    /// Keys admitted without a certificate.
    pub allow: HashSet<[u8; 32]>,
    /// Admit keys without a certificate too (`--allow-any`).
    pub allow_any: bool,
    /// Revoked node keys, re-read when their file changes.
    pub revoked: Option<Arc<RevokedList>>,
}

/// Why a peer was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The key is not on the allow-list (and there is no swarm).
    #[error("its key is not allowed")]
    NotAllowed,
    /// A client dialled one key and the server proved another.
    #[error("it is node {presented}, not the node dialled, {expected}")]
    NotDialled {
        /// The key dialled.
        expected: PublicKey,
        /// The key the server proved.
        presented: PublicKey,
    },
    /// In a swarm, the peer presented no membership certificate (and is not on `--allow`).
    #[error("it presented no membership certificate for swarm {swarm}")]
    NoMembership {
        /// This node's swarm.
        swarm: PublicKey,
    },
    /// The membership extension does not hold a certificate.
    #[error("its membership certificate does not decode: {0}")]
    BadMembership(#[source] MembershipDecodeError),
    /// The certificate does not admit it.
    #[error("{0}")]
    Membership(#[source] MembershipError),
}

impl Admission {
    /// Whether `key` may connect without a membership certificate.
    pub fn admits(&self, key: &[u8; 32]) -> bool {
        match self {
            Self::Any => true,
            Self::Keys(k) => k.contains(key),
            Self::Listed { keys, file } => {
                keys.contains(key)
                    || PublicKey::from_bytes(key).is_ok_and(|k| file.with(|set| set.contains(&k)))
            }
            Self::Swarm(s) => s.allow_any || s.allow.contains(key),
        }
    }

    /// Whether the peer that proved `key` and presented `membership` (the extension's bytes,
    /// if any) may connect at `now` (Unix seconds).
    pub fn check(
        &self,
        key: &PublicKey,
        membership: Option<&[u8]>,
        now: u64,
    ) -> Result<(), Refusal> {
        let Self::Swarm(s) = self else {
            return if self.admits(key.as_bytes()) {
                Ok(())
            } else {
                Err(Refusal::NotAllowed)
            };
        };
        let checked = match membership {
            None => Err(Refusal::NoMembership { swarm: s.swarm }),
            Some(bytes) => {
                let cert = Membership::from_bytes(bytes).map_err(Refusal::BadMembership)?;
                let empty = HashSet::new();
                let verdict = match &s.revoked {
                    Some(r) => r.with(|revoked| cert.verify(&s.swarm, key, now, revoked)),
                    None => cert.verify(&s.swarm, key, now, &empty),
                };
                verdict.map_err(Refusal::Membership)
            }
        };
        // A key on `--allow` (or `--allow-any`) is admitted even without a valid certificate,
        // unless it is revoked (a certificate that does not decode was refused above).
        match checked {
            Ok(()) => Ok(()),
            Err(Refusal::Membership(MembershipError::Revoked { node })) => {
                Err(Refusal::Membership(MembershipError::Revoked { node }))
            }
            Err(_) if self.admits(key.as_bytes()) && !s.is_revoked(key) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Admission {
    /// How many times the files this policy reads (`--revoked`, `--allow-file`) changed their
    /// lists, each re-read first if it changed: a connection admitted under one generation is
    /// judged again under the next.
    pub fn lists_generation(&self) -> u64 {
        match self {
            Self::Any | Self::Keys(_) => 0,
            Self::Listed { file, .. } => file.generation(),
            Self::Swarm(s) => s.revoked.as_ref().map_or(0, |r| r.generation()),
        }
    }

    /// Whether a verdict of this policy can change while a connection lives: a list file can
    /// change, a membership certificate can expire.
    pub fn can_change(&self) -> bool {
        matches!(self, Self::Listed { .. } | Self::Swarm(_))
    }
}

impl SwarmAdmission {
    fn is_revoked(&self, key: &PublicKey) -> bool {
        self.revoked
            .as_ref()
            .is_some_and(|r| r.with(|set| set.contains(key)))
    }
}

/// The key a dialled server presented instead of the one pinned, read from the text of the
/// failed dial's error ([`Refusal::NotDialled`] as the verifier wrote it): quinn turns a
/// handshake's error into its text alone, so the typed refusal cannot be had back. `None`
/// when the text says no such thing.
pub fn presented_key(text: &str) -> Option<PublicKey> {
    const MARK: &str = "it is node ";
    let at = text.find(MARK)? + MARK.len();
    let (hex, rest) = text[at..].split_at_checked(64)?;
    rest.starts_with(", not the node dialled")
        .then(|| hex.parse().ok())
        .flatten()
}

/// The SubjectPublicKeyInfo DER of an Ed25519 public key.
pub fn spki(key: &[u8; 32]) -> Vec<u8> {
    let mut v = SPKI_PREFIX.to_vec();
    v.extend_from_slice(key);
    v
}

/// The Ed25519 key inside a SubjectPublicKeyInfo DER, if it is one.
pub fn key_of_spki(der: &[u8]) -> Option<[u8; 32]> {
    let rest = der.strip_prefix(&SPKI_PREFIX[..])?;
    rest.try_into().ok()
}

/// What a peer's certificate says: its SPKI's Ed25519 key and its membership extension.
#[derive(Debug)]
struct PeerCert {
    key: [u8; 32],
    membership: Option<Vec<u8>>,
}

/// Reads a peer's certificate (never panics on hostile bytes): an X.509 certificate with
/// nothing after it, an Ed25519 SPKI, at most one membership extension.
fn read_peer_cert(der: &[u8]) -> Option<PeerCert> {
    if der.len() > MAX_PEER_CERT {
        return None;
    }
    let (rest, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    if !rest.is_empty() {
        return None;
    }
    let key = key_of_spki(cert.public_key().raw)?;
    let oid = x509_parser::oid_registry::Oid::from(MEMBERSHIP_OID).ok()?;
    let mut found = cert.extensions().iter().filter(|e| e.oid == oid);
    let membership = found.next().map(|e| e.value.to_vec());
    if found.next().is_some() {
        return None;
    }
    Some(PeerCert { key, membership })
}

/// What a QUIC connection's peer presented in its handshake.
fn peer_cert(conn: &quinn::Connection) -> Option<PeerCert> {
    let id = conn.peer_identity()?;
    let certs = id.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    read_peer_cert(certs.first()?.as_ref())
}

/// The key a QUIC connection's peer proved in its handshake.
pub fn peer_key(conn: &quinn::Connection) -> Option<[u8; 32]> {
    Some(peer_cert(conn)?.key)
}

/// The membership certificate a QUIC connection's peer presented (already checked in the
/// handshake when this node runs in a swarm).
pub fn peer_membership(conn: &quinn::Connection) -> Option<Membership> {
    Membership::from_bytes(&peer_cert(conn)?.membership?).ok()
}

/// This node's certificate (self-signed X.509 for its node key, with its membership in an
/// extension) and its private key.
fn certificate(
    id: Identity<'_>,
) -> anyhow::Result<(CertificateDer<'static>, PrivateKeyDer<'static>)> {
    let seed = id.secret.seed();
    let mut pkcs8 = zeroize::Zeroizing::new(PKCS8_PREFIX.to_vec());
    pkcs8.extend_from_slice(&seed[..]);
    let der = PrivatePkcs8KeyDer::from(pkcs8.to_vec());
    let pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519)
        .map_err(|e| anyhow::anyhow!("the node key is not a usable Ed25519 key: {e}"))?;
    let mut params = rcgen::CertificateParams::new(vec!["stormo".to_string()])
        .context("TLS certificate parameters")?;
    if let Some(m) = id.membership {
        anyhow::ensure!(
            m.node == id.secret.public(),
            "the membership certificate is for node {}, not this node's key {}",
            m.node,
            id.secret.public()
        );
        params
            .custom_extensions
            .push(rcgen::CustomExtension::from_oid_content(
                MEMBERSHIP_OID,
                m.to_bytes().to_vec(),
            ));
    }
    let cert = params
        .self_signed(&pair)
        .context("signing the node's TLS certificate")?;
    Ok((cert.der().clone(), PrivateKeyDer::Pkcs8(der)))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn unix_seconds(now: UnixTime) -> u64 {
    now.as_secs()
}

/// Checks the peer's key (and membership) against a policy, and its handshake signatures.
#[derive(Debug)]
struct KeyVerifier {
    admission: Admission,
    /// A client's dialled key: the server must prove exactly this one.
    pin: Option<PublicKey>,
    /// "client" or "server": which side the refused peer was, for the log.
    peer_role: &'static str,
    algs: WebPkiSupportedAlgorithms,
}

impl KeyVerifier {
    fn new(admission: Admission, pin: Option<PublicKey>, peer_role: &'static str) -> Self {
        Self {
            admission,
            pin,
            peer_role,
            algs: provider().signature_verification_algorithms,
        }
    }

    fn check(&self, end_entity: &CertificateDer<'_>, now: UnixTime) -> Result<(), rustls::Error> {
        let Some(cert) = read_peer_cert(end_entity.as_ref()) else {
            tracing::warn!(
                "refused a {}: its certificate is not an Ed25519 node certificate",
                self.peer_role
            );
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::BadEncoding,
            ));
        };
        let Ok(key) = PublicKey::from_bytes(&cert.key) else {
            tracing::warn!(
                "refused a {}: its node key is not a valid Ed25519 key",
                self.peer_role
            );
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::BadEncoding,
            ));
        };
        let verdict = match self.pin {
            Some(expected) if expected != key => Err(Refusal::NotDialled {
                expected,
                presented: key,
            }),
            _ => self
                .admission
                .check(&key, cert.membership.as_deref(), unix_seconds(now)),
        };
        verdict.map_err(|reason| {
            tracing::warn!(
                peer = %super::short_key(&key),
                "refused {} {key}: {reason}",
                self.peer_role
            );
            match reason {
                // The dialling side's own check: its reason, with both keys, is the error
                // the dial fails with (quinn keeps only its text: see [`presented_key`]).
                // The server is sent a handshake-failure alert, and no more.
                Refusal::NotDialled { .. } => {
                    rustls::Error::Other(rustls::OtherError(Arc::new(reason)))
                }
                _ => rustls::Error::InvalidCertificate(
                    CertificateError::ApplicationVerificationFailure,
                ),
            }
        })
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let Some(peer) = read_peer_cert(cert.as_ref()) else {
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::BadEncoding,
            ));
        };
        rustls::crypto::verify_tls13_signature_with_raw_key(
            message,
            &SubjectPublicKeyInfoDer::from(spki(&peer.key)),
            dss,
            &self.algs,
        )
    }
}

impl ServerCertVerifier for KeyVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity, now)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

impl ClientCertVerifier for KeyVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity, now)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// How a sender paces its data (QUIC congestion control).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// CUBIC (RFC 9438), as TCP uses: backs off on every loss, so random loss on a long path
    /// holds it far below the link's rate.
    Cubic,
    /// quinn's BBR: paces to its estimate of the bottleneck's rate, so random loss costs it
    /// little; but quinn calls it experimental, its estimate overshoots (it loses much of
    /// what it sends at a full queue), and it takes most of a link it shares with CUBIC.
    Bbr,
    /// CUBIC that lets a loss pass while the path's queue is empty and loss is rare, its
    /// window never below the path's measured rate times its round trip
    /// (docs/network.md, Congestion control): keeps experts flowing on long lossy paths, and is
    /// CUBIC wherever a queue builds.
    #[default]
    Tolerant,
}

impl Congestion {
    /// Every choice, in the order `--help` lists them.
    pub const ALL: [Self; 3] = [Self::Cubic, Self::Bbr, Self::Tolerant];

    /// The name the command line takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cubic => "cubic",
            Self::Bbr => "bbr",
            Self::Tolerant => "tolerant",
        }
    }
}

impl fmt::Display for Congestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Congestion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| format!("{s:?} is not one of cubic, bbr, tolerant"))
    }
}

/// Transport settings shared by both ends: bounded idle time, keep-alives, at most `streams`
/// concurrent requests from the peer, path MTU discovery up to [`super::MAX_UDP_PAYLOAD`],
/// and `congestion` for what this end sends.
pub fn transport(
    streams: u32,
    congestion: Congestion,
) -> anyhow::Result<Arc<quinn::TransportConfig>> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(IDLE_TIMEOUT).context("idle timeout")?,
    ))
    .keep_alive_interval(Some(KEEP_ALIVE))
    .max_concurrent_bidi_streams(streams.into())
    .max_concurrent_uni_streams(0u32.into());
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(super::MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(Some(mtu));
    match congestion {
        Congestion::Cubic => {
            t.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()))
        }
        Congestion::Bbr => {
            t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()))
        }
        Congestion::Tolerant => {
            t.congestion_controller_factory(Arc::new(super::congestion::TolerantConfig::default()))
        }
    };
    Ok(Arc::new(t))
}

/// A server configuration: this node's key, TLS 1.3 only, the stormo ALPN, peers admitted by
/// `admission`, answers paced by `congestion`.
pub fn server_config(
    secret: &SecretKey,
    admission: Admission,
    streams: u32,
    congestion: Congestion,
) -> anyhow::Result<quinn::ServerConfig> {
    server_config_for(Identity::key(secret), admission, streams, congestion)
}

/// [`server_config`] for an [`Identity`] that may carry a membership certificate.
pub fn server_config_for(
    id: Identity<'_>,
    admission: Admission,
    streams: u32,
    congestion: Congestion,
) -> anyhow::Result<quinn::ServerConfig> {
    let (cert, key) = certificate(id)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .with_client_cert_verifier(Arc::new(KeyVerifier::new(admission, None, "client")))
        .with_single_cert(vec![cert], key)
        .context("the node's TLS certificate")?;
    // No session resumption: a resumed handshake shows no certificate, so a client revoked
    // (or whose certificate expired) since its first connection would be let in on its
    // ticket without the admission check. Every handshake is a full one (one Ed25519
    // signature each way).
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.send_tls13_tickets = 0;
    cfg.alpn_protocols = vec![stormo_wire::ALPN.to_vec()];
    let quic = quinn::crypto::rustls::QuicServerConfig::try_from(cfg)
        .context("a QUIC server configuration from TLS 1.3")?;
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(quic));
    let mut t = Arc::into_inner(transport(streams, congestion)?)
        .expect("a transport config just made has one owner");
    // What a peer sends a server is small (requests, control messages, an inventory frame of
    // at most 256 KiB): QUIC may buffer at most this much of it per stream and per connection,
    // where quinn's defaults (1.25 MB per stream, no connection limit) would let one peer make
    // the server hold megabytes it never reads.
    t.stream_receive_window(SERVER_STREAM_WINDOW.into())
        .receive_window(SERVER_CONNECTION_WINDOW.into());
    sc.transport_config(Arc::new(t));
    Ok(sc)
}

/// A client configuration that accepts only the server whose key is `peer`.
pub fn client_config(secret: &SecretKey, peer: &PublicKey) -> anyhow::Result<quinn::ClientConfig> {
    client_config_for(Identity::key(secret), Some(peer), Admission::Any)
}

/// A client configuration as `id` that accepts a server if it proves `pin` (when given) and
/// `admission` admits it: pass the swarm's [`Admission::Swarm`] to dial a discovered peer,
/// whose key a discovery announcement named (`pin`) or did not (a DHT gives addresses only).
pub fn client_config_for(
    id: Identity<'_>,
    pin: Option<&PublicKey>,
    admission: Admission,
) -> anyhow::Result<quinn::ClientConfig> {
    let (cert, key) = certificate(id)?;
    let verifier = KeyVerifier::new(admission, pin.copied(), "server");
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(vec![cert], key)
        .context("the node's TLS certificate")?;
    // No session resumption, as on the server side: a resumed handshake skips the server's
    // certificate, and with it the admission check of a server revoked since the last one.
    cfg.resumption = rustls::client::Resumption::disabled();
    cfg.alpn_protocols = vec![stormo_wire::ALPN.to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(cfg)
        .context("a QUIC client configuration from TLS 1.3")?;
    let mut cc = quinn::ClientConfig::new(Arc::new(quic));
    // A client sends requests, a few bytes each: its congestion control hardly matters.
    cc.transport_config(transport(64, Congestion::Cubic)?);
    Ok(cc)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Mutex;
    use std::time::SystemTime;

    #[test]
    fn spki_round_trips_and_rejects_other_keys() {
        let k = [7u8; 32];
        let der = spki(&k);
        assert_eq!(der.len(), 44);
        assert_eq!(key_of_spki(&der), Some(k));
        let mut bad = der.clone();
        bad[5] ^= 1;
        assert_eq!(key_of_spki(&bad), None);
        assert_eq!(key_of_spki(&der[..43]), None);
    }

    /// Log lines written while a closure runs on this thread.
    #[derive(Clone, Default)]
    pub(super) struct Logs(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Logs {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log buffer").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Logs {
        /// The lines logged since the last call.
        pub(super) fn take(&self) -> String {
            String::from_utf8_lossy(&std::mem::take(&mut *self.0.lock().expect("log buffer")))
                .into_owned()
        }

        /// Captures this thread's warnings until the guard drops.
        pub(super) fn warnings() -> (Self, tracing::subscriber::DefaultGuard) {
            let logs = Self::default();
            let writer = logs.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::WARN)
                .finish();
            (logs, tracing::subscriber::set_default(subscriber))
        }
    }

    fn now() -> u64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs()
    }

    /// One handshake of `client` with `server` on loopback: whether the server accepted the
    /// connection and whether the client got through.
    async fn handshake(
        server: (Identity<'_>, Admission),
        client: (Identity<'_>, Option<&PublicKey>, Admission),
    ) -> (bool, bool) {
        let sc = server_config_for(server.0, server.1, 4, Congestion::Cubic).expect("server");
        let cc = client_config_for(client.0, client.1, client.2).expect("client");
        handshake_with(sc, cc).await
    }

    /// Whether the server and the client (in that order) accept each other in a loopback
    /// handshake of these configurations.
    async fn handshake_with(sc: quinn::ServerConfig, cc: quinn::ClientConfig) -> (bool, bool) {
        let ep = crate::bind("127.0.0.1:0".parse().expect("addr"), Some(sc)).expect("bind");
        let addr = ep.local_addr().expect("address");
        let cep = crate::bind("127.0.0.1:0".parse().expect("addr"), None).expect("bind");
        let connecting = cep.connect_with(cc, addr, "stormo").expect("connect");
        let accepting = async {
            let incoming = ep.accept().await.expect("incoming");
            match incoming.await {
                // TLS 1.3: the server checks the client's certificate last; a refused client
                // may see its handshake complete, and the connection closed at once.
                Ok(c) => {
                    let r = c.accept_uni().await;
                    !matches!(r, Err(quinn::ConnectionError::TransportError(_)))
                }
                Err(_) => false,
            }
        };
        let client_side = async {
            match connecting.await {
                Ok(c) => {
                    // Wait for the server's verdict on our certificate.
                    let r = tokio::time::timeout(Duration::from_millis(500), c.closed()).await;
                    r.is_err()
                }
                Err(_) => false,
            }
        };
        let (s, c) = tokio::time::timeout(Duration::from_secs(5), async {
            // The server side ends when the client closes; close the client once it knows.
            let client_then_close = async {
                let c = client_side.await;
                cep.close(0u32.into(), b"done");
                c
            };
            tokio::join!(accepting, client_then_close)
        })
        .await
        .expect("a handshake within 5 s");
        ep.close(0u32.into(), b"done");
        (s, c)
    }

    /// Issue 41 (c) and (d): a node without a certificate, with an expired one, with one for
    /// another swarm, a revoked one, and one whose file was edited are each refused in the
    /// handshake, with the reason logged; a member is admitted, both ways.
    #[test]
    fn swarm_admission_refuses_each_bad_certificate_with_its_reason() {
        let (logs, _guard) = Logs::warnings();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let t = now();
        let owner = SecretKey::from_seed(&[10; 32]);
        let other_owner = SecretKey::from_seed(&[11; 32]);
        let server = SecretKey::from_seed(&[12; 32]);
        let member = |seed: u8| SecretKey::from_seed(&[seed; 32]);
        let cert = |owner: &SecretKey, node: &SecretKey, from: u64, to: u64| {
            Membership::issue(owner, node.public(), from, to).expect("a valid period")
        };
        let server_cert = cert(&owner, &server, t - 60, t + 3600);
        let dir = tempfile::tempdir().expect("tempdir");
        let revoked_path = dir.path().join("revoked");
        std::fs::write(&revoked_path, "# none yet\n").expect("write");
        let revoked = Arc::new(RevokedList::load(&revoked_path).expect("revoked list"));
        let admission = Admission::Swarm(Arc::new(SwarmAdmission {
            swarm: owner.public(),
            allow: HashSet::new(),
            allow_any: false,
            revoked: Some(revoked),
        }));
        let server_id = Identity {
            secret: &server,
            membership: Some(&server_cert),
        };

        let good_key = member(20);
        let good = cert(&owner, &good_key, t - 60, t + 3600);
        let expired_key = member(21);
        let expired = cert(&owner, &expired_key, t - 7200, t - 3600);
        let foreign_key = member(22);
        let foreign = cert(&other_owner, &foreign_key, t - 60, t + 3600);
        let revoked_key = member(23);
        let revoked_cert = cert(&owner, &revoked_key, t - 60, t + 3600);
        let edited_key = member(24);
        let mut edited = cert(&owner, &edited_key, t - 7200, t - 3600).to_bytes();
        edited[82..90].copy_from_slice(&(t + 365 * 86_400).to_le_bytes()); // a later expiry
        let edited = Membership::from_bytes(&edited).expect("an edited file still decodes");
        let bare_key = member(25);

        rt.block_on(async {
            let id = |secret, membership| Identity { secret, membership };
            let cases: [(&str, Identity<'_>, &str); 5] = [
                (
                    "no certificate",
                    id(&bare_key, None),
                    "presented no membership certificate",
                ),
                ("expired", id(&expired_key, Some(&expired)), "expired at"),
                (
                    "other swarm",
                    id(&foreign_key, Some(&foreign)),
                    "not this swarm",
                ),
                (
                    "revoked",
                    id(&revoked_key, Some(&revoked_cert)),
                    "is revoked",
                ),
                (
                    "edited",
                    id(&edited_key, Some(&edited)),
                    "signature is invalid",
                ),
            ];
            // Revoke one key now: the file is re-read at the next handshake.
            std::fs::write(&revoked_path, format!("{}\n", revoked_key.public())).expect("write");
            for (what, client, reason) in cases {
                let (s, c) = handshake(
                    (server_id, admission.clone()),
                    (client, Some(&server.public()), admission.clone()),
                )
                .await;
                assert!(!s && !c, "{what}: admitted (server {s}, client {c})");
                let log = logs.take();
                assert!(
                    log.contains("refused client") && log.contains(reason),
                    "{what}: the log does not give the reason {reason:?}:\n{log}"
                );
            }
            // A member is admitted both ways.
            let (s, c) = handshake(
                (server_id, admission.clone()),
                (
                    id(&good_key, Some(&good)),
                    Some(&server.public()),
                    admission.clone(),
                ),
            )
            .await;
            assert!(
                s && c,
                "a member was refused (server {s}, client {c}): {}",
                logs.take()
            );
            // Both directions: a member dialling a discovered server without a certificate
            // refuses it itself.
            let (s, c) = handshake(
                (Identity::key(&bare_key), Admission::Any),
                (id(&good_key, Some(&good)), None, admission.clone()),
            )
            .await;
            assert!(!c && !s, "a server without a certificate was admitted");
            let log = logs.take();
            assert!(
                log.contains("refused server") && log.contains("presented no membership"),
                "{log}"
            );
            // A pinned key is still enforced beside the swarm check.
            let (_, c) = handshake(
                (server_id, admission.clone()),
                (
                    id(&good_key, Some(&good)),
                    Some(&bare_key.public()),
                    admission.clone(),
                ),
            )
            .await;
            assert!(!c, "a server that is not the key dialled was admitted");
            assert!(logs.take().contains("not the node dialled"));
        });
    }

    /// A pin refused: the dial's error text (all quinn keeps of the verifier's error) names
    /// the key the server presented, which [`presented_key`] reads back; no other text reads
    /// as one.
    #[test]
    fn a_refused_pin_names_the_key_presented() {
        let expected = SecretKey::from_seed(&[5; 32]).public();
        let presented = SecretKey::from_seed(&[6; 32]).public();
        let err = rustls::Error::Other(rustls::OtherError(Arc::new(Refusal::NotDialled {
            expected,
            presented,
        })));
        let text = format!("QUIC handshake: the cryptographic handshake failed: error 40: {err}");
        assert!(text.contains(&expected.to_string()), "{text}");
        assert_eq!(presented_key(&text), Some(presented), "{text}");
        for other in [
            "invalid peer certificate: ApplicationVerificationFailure",
            "it is node 12, not the node dialled",
            "it is node ",
        ] {
            assert_eq!(presented_key(other), None, "{other}");
        }
    }

    /// The peer's key is read from its certificate as before; a certificate with trailing
    /// bytes, or that is not one, is not read at all.
    #[test]
    fn peer_certificates_carry_the_node_key_and_membership() {
        let owner = SecretKey::from_seed(&[1; 32]);
        let node = SecretKey::from_seed(&[2; 32]);
        let m = Membership::issue(&owner, node.public(), 1, 2).expect("period");
        let (der, _) = certificate(Identity {
            secret: &node,
            membership: Some(&m),
        })
        .expect("certificate");
        let read = read_peer_cert(der.as_ref()).expect("reads");
        assert_eq!(read.key, *node.public().as_bytes());
        assert_eq!(read.membership.as_deref(), Some(&m.to_bytes()[..]));
        let (plain, _) = certificate(Identity::key(&node)).expect("certificate");
        assert!(read_peer_cert(plain.as_ref())
            .expect("reads")
            .membership
            .is_none());
        let mut trailing = der.as_ref().to_vec();
        trailing.push(0);
        assert!(read_peer_cert(&trailing).is_none());
        assert!(read_peer_cert(&der.as_ref()[..der.as_ref().len() - 1]).is_none());
        assert!(read_peer_cert(b"not a certificate").is_none());
        // Another node's certificate cannot be presented as this node's.
        let stranger = SecretKey::from_seed(&[3; 32]);
        assert!(certificate(Identity {
            secret: &stranger,
            membership: Some(&m)
        })
        .is_err());
    }

    /// The congestion control a server is configured with is the one its connections run.
    #[test]
    fn server_connections_run_the_configured_congestion_control() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            for cc in [Congestion::Bbr, Congestion::Cubic, Congestion::Tolerant] {
                let server_key = SecretKey::from_seed(&[3; 32]);
                let sc = server_config(&server_key, Admission::Any, 4, cc).expect("server");
                let server = crate::bind("127.0.0.1:0".parse().expect("addr"), Some(sc))
                    .expect("server endpoint");
                let addr = server.local_addr().expect("address");
                let client = crate::bind("127.0.0.1:0".parse().expect("addr"), None)
                    .expect("client endpoint");
                let cfg = client_config(&SecretKey::from_seed(&[4; 32]), &server_key.public())
                    .expect("client");
                let connecting = client.connect_with(cfg, addr, "stormo").expect("connect");
                let accepting = async { server.accept().await.expect("incoming").await };
                let (inbound, out) = tokio::join!(accepting, connecting);
                let inbound = inbound.expect("accepted");
                out.expect("connected");
                let state = inbound.congestion_state().into_any();
                let ran = if state.is::<quinn::congestion::Bbr>() {
                    Congestion::Bbr
                } else if state.is::<quinn::congestion::Cubic>() {
                    Congestion::Cubic
                } else if state.is::<crate::congestion::Tolerant>() {
                    Congestion::Tolerant
                } else {
                    panic!("{cc:?}: an unknown controller")
                };
                assert_eq!(ran, cc);
            }
        });
    }

    fn at(secs: u64) -> UnixTime {
        UnixTime::since_unix_epoch(Duration::from_secs(secs))
    }

    fn refused() -> Result<(), rustls::Error> {
        Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ))
    }

    fn bad_encoding() -> Result<(), rustls::Error> {
        Err(rustls::Error::InvalidCertificate(
            CertificateError::BadEncoding,
        ))
    }

    /// Where the Ed25519 SPKI (prefix and key) starts in a certificate's DER.
    fn spki_at(der: &[u8]) -> usize {
        der.windows(SPKI_PREFIX.len())
            .position(|w| w == SPKI_PREFIX)
            .expect("an Ed25519 SPKI in the certificate")
    }

    /// The verifier's own verdicts, without a handshake: a pinned key is the only one a client
    /// accepts; no allow-list admits nobody; certificates that are not Ed25519 node
    /// certificates, or whose key is no usable Ed25519 point, are refused as bad encodings
    /// (the other refusals are policy refusals).
    #[test]
    fn the_verifier_refuses_another_key_than_the_pinned_one_and_what_is_not_a_node_certificate() {
        let node = SecretKey::from_seed(&[50; 32]);
        let other = SecretKey::from_seed(&[51; 32]);
        let (der, _) = certificate(Identity::key(&node)).expect("certificate");
        let t = at(now());
        let check = |admission: Admission, pin: Option<PublicKey>, der: &[u8]| {
            KeyVerifier::new(admission, pin, "server").check(&CertificateDer::from(der), t)
        };
        assert_eq!(check(Admission::Any, Some(node.public()), &der), Ok(()));
        assert_eq!(check(Admission::Any, None, &der), Ok(()));
        // Refused with both keys said (an `OtherError` never compares equal).
        match check(Admission::Any, Some(other.public()), &der) {
            Err(rustls::Error::Other(e)) => assert_eq!(
                e.to_string(),
                format!(
                    "it is node {}, not the node dialled, {}",
                    node.public(),
                    other.public()
                )
            ),
            r => panic!("a server proving another key than the one dialled: {r:?}"),
        }
        // The pin does not replace the policy: a pinned key must be admitted too.
        let only_other = Admission::Keys([*other.public().as_bytes()].into());
        assert_eq!(
            check(only_other.clone(), Some(node.public()), &der),
            refused()
        );
        assert_eq!(check(only_other, None, &der), refused());
        assert_eq!(
            check(Admission::Keys(HashSet::new()), None, &der),
            refused(),
            "no allow-list admitted a peer"
        );
        assert_eq!(
            check(
                Admission::Keys([*node.public().as_bytes()].into()),
                None,
                &der
            ),
            Ok(())
        );

        assert_eq!(
            check(Admission::Any, None, b"not a certificate"),
            bad_encoding()
        );
        assert_eq!(check(Admission::Any, None, &[]), bad_encoding());
        let at_spki = spki_at(&der);
        // Another algorithm's SPKI (the OID's last byte: Ed448 is 1.3.101.113).
        let mut ed448 = der.to_vec();
        ed448[at_spki + 8] = 0x71;
        assert!(x509_parser::parse_x509_certificate(&ed448).is_ok());
        assert!(read_peer_cert(&ed448).is_none());
        assert_eq!(check(Admission::Any, None, &ed448), bad_encoding());
        // An Ed25519 SPKI whose 32 bytes are no usable point.
        let invalid = (0u8..=255)
            .map(|b| [b; 32])
            .find(|k| PublicKey::from_bytes(k).is_err())
            .expect("some 32 equal bytes are not an Ed25519 point");
        let mut no_point = der.to_vec();
        no_point[at_spki + 12..at_spki + 44].copy_from_slice(&invalid);
        assert_eq!(
            read_peer_cert(&no_point).map(|c| c.key),
            Some(invalid),
            "the certificate still reads"
        );
        assert_eq!(check(Admission::Any, None, &no_point), bad_encoding());
    }

    /// A membership is judged at the handshake's time, as rustls gives it: valid within its
    /// period, not before it nor after it.
    #[test]
    fn the_verifier_judges_a_membership_at_the_handshake_time() {
        let owner = SecretKey::from_seed(&[52; 32]);
        let node = SecretKey::from_seed(&[53; 32]);
        let t = now();
        let m = Membership::issue(&owner, node.public(), t - 60, t + 3600).expect("period");
        let (der, _) = certificate(Identity {
            secret: &node,
            membership: Some(&m),
        })
        .expect("certificate");
        let v = KeyVerifier::new(
            Admission::Swarm(Arc::new(SwarmAdmission {
                swarm: owner.public(),
                allow: HashSet::new(),
                allow_any: false,
                revoked: None,
            })),
            None,
            "client",
        );
        let der = CertificateDer::from(der.as_ref());
        assert_eq!(v.check(&der, at(t)), Ok(()));
        assert_eq!(v.check(&der, at(t + 7200)), refused(), "expired");
        assert_eq!(v.check(&der, at(t - 3600)), refused(), "not yet valid");
    }

    /// Each admission policy on its own: who is admitted with and without a membership
    /// certificate, and that revocation beats `--allow` and `--allow-any`.
    #[test]
    fn admission_policies_admit_exactly_their_keys() {
        let t = now();
        let owner = SecretKey::from_seed(&[54; 32]);
        let member = SecretKey::from_seed(&[55; 32]);
        let listed = SecretKey::from_seed(&[56; 32]);
        let stranger = SecretKey::from_seed(&[57; 32]);
        let cert = |node: &SecretKey| {
            Membership::issue(&owner, node.public(), t - 60, t + 3600)
                .expect("period")
                .to_bytes()
        };
        let (member_cert, listed_cert) = (cert(&member), cert(&listed));
        let expired = Membership::issue(&owner, listed.public(), t - 7200, t - 3600)
            .expect("period")
            .to_bytes();
        let dir = tempfile::tempdir().expect("tempdir");
        let revoked_path = dir.path().join("revoked");
        std::fs::write(&revoked_path, format!("{}\n", listed.public())).expect("write");
        let revoked = Arc::new(RevokedList::load(&revoked_path).expect("revoked list"));
        let swarm = |allow: &[&SecretKey], allow_any: bool, revoked: Option<Arc<RevokedList>>| {
            Admission::Swarm(Arc::new(SwarmAdmission {
                swarm: owner.public(),
                allow: allow.iter().map(|k| *k.public().as_bytes()).collect(),
                allow_any,
                revoked,
            }))
        };

        // Swarm members, with no --allow.
        let plain = swarm(&[], false, None);
        assert!(plain.check(&member.public(), Some(&member_cert), t).is_ok());
        assert!(matches!(
            plain.check(&member.public(), None, t),
            Err(Refusal::NoMembership { .. })
        ));
        assert!(matches!(
            plain.check(&member.public(), Some(b"junk"), t),
            Err(Refusal::BadMembership(_))
        ));
        assert!(matches!(
            plain.check(&stranger.public(), Some(&member_cert), t),
            Err(Refusal::Membership(MembershipError::OtherKey { .. }))
        ));
        assert!(!plain.admits(member.public().as_bytes()));

        // --allow: a listed key is admitted without a certificate, or with an expired one;
        // nobody else is.
        let allow = swarm(&[&listed], false, None);
        assert!(allow.admits(listed.public().as_bytes()));
        assert!(!allow.admits(stranger.public().as_bytes()));
        assert!(allow.check(&listed.public(), None, t).is_ok());
        // (A membership extension that does not decode is refused all the same.)
        assert!(matches!(
            allow.check(&listed.public(), Some(b"junk"), t),
            Err(Refusal::BadMembership(_))
        ));
        assert!(allow.check(&listed.public(), Some(&expired), t).is_ok());
        assert!(allow.check(&listed.public(), Some(&listed_cert), t).is_ok());
        assert!(allow.check(&stranger.public(), None, t).is_err());
        assert!(allow.check(&member.public(), Some(&member_cert), t).is_ok());

        // --allow-any: anyone, certificate or not.
        let any = swarm(&[], true, None);
        assert!(any.admits(stranger.public().as_bytes()));
        assert!(any.check(&stranger.public(), None, t).is_ok());

        // Revoked: refused whether listed, allowed by --allow-any, or certified.
        for adm in [
            swarm(&[&listed], false, Some(revoked.clone())),
            swarm(&[], true, Some(revoked.clone())),
        ] {
            assert!(matches!(
                adm.check(&listed.public(), None, t),
                Err(Refusal::NoMembership { .. })
            ));
            assert!(matches!(
                adm.check(&listed.public(), Some(&listed_cert), t),
                Err(Refusal::Membership(MembershipError::Revoked { .. }))
            ));
            assert!(adm.check(&member.public(), Some(&member_cert), t).is_ok());
        }
        let revoking = swarm(&[], false, Some(revoked.clone()));
        assert!(matches!(
            revoking.check(&listed.public(), Some(&listed_cert), t),
            Err(Refusal::Membership(MembershipError::Revoked { .. }))
        ));

        // Without a swarm: exactly the keys listed, or anyone with --allow-any; a membership
        // certificate changes nothing.
        assert!(Admission::Any.check(&stranger.public(), None, t).is_ok());
        let keys = Admission::Keys([*listed.public().as_bytes()].into());
        assert!(keys.check(&listed.public(), None, t).is_ok());
        assert!(matches!(
            keys.check(&member.public(), Some(&member_cert), t),
            Err(Refusal::NotAllowed)
        ));
        assert!(matches!(
            Admission::Keys(HashSet::new()).check(&listed.public(), None, t),
            Err(Refusal::NotAllowed)
        ));
        let listed_file = Admission::Listed {
            keys: [*member.public().as_bytes()].into(),
            file: revoked,
        };
        assert!(listed_file.check(&member.public(), None, t).is_ok());
        assert!(listed_file.check(&listed.public(), None, t).is_ok());
        assert!(listed_file.check(&stranger.public(), None, t).is_err());
    }

    /// The certificate size bound: a certificate of exactly [`MAX_PEER_CERT`] bytes is read, one
    /// byte more is not; two membership extensions are refused rather than one picked.
    #[test]
    fn peer_certificates_are_bounded_and_carry_one_membership_at_most() {
        let node = SecretKey::from_seed(&[58; 32]);
        let pair = |filler: usize, extensions: &[(&[u64], usize)]| {
            let seed = node.seed();
            let mut pkcs8 = PKCS8_PREFIX.to_vec();
            pkcs8.extend_from_slice(&seed[..]);
            let der = PrivatePkcs8KeyDer::from(pkcs8);
            let kp = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519)
                .expect("key pair");
            let mut params =
                rcgen::CertificateParams::new(vec!["stormo".to_string()]).expect("params");
            params
                .custom_extensions
                .push(rcgen::CustomExtension::from_oid_content(
                    &[1, 3, 6, 1, 4, 1, 61_541, 41, 99],
                    vec![7; filler],
                ));
            for (oid, len) in extensions {
                params
                    .custom_extensions
                    .push(rcgen::CustomExtension::from_oid_content(oid, vec![1; *len]));
            }
            params.self_signed(&kp).expect("certificate").der().to_vec()
        };
        // A filler that makes the certificate `len` bytes long: about the bound less the
        // certificate without it (DER length fields grow by steps, so search around that).
        let estimate = MAX_PEER_CERT - pair(0, &[]).len();
        let of_len = |len: usize| {
            (estimate - 16..estimate + 16)
                .map(|n| pair(n, &[]))
                .find(|d| d.len() == len)
                .unwrap_or_else(|| panic!("no filler gives a certificate of {len} bytes"))
        };
        let exact = of_len(MAX_PEER_CERT);
        assert_eq!(
            read_peer_cert(&exact).map(|c| c.key),
            Some(*node.public().as_bytes())
        );
        let over = of_len(MAX_PEER_CERT + 1);
        assert!(x509_parser::parse_x509_certificate(&over).is_ok());
        assert!(
            read_peer_cert(&over).is_none(),
            "an oversized certificate was read"
        );

        let one = pair(10, &[(MEMBERSHIP_OID, 154)]);
        assert_eq!(
            read_peer_cert(&one).and_then(|c| c.membership),
            Some(vec![1; 154])
        );
        let two = pair(10, &[(MEMBERSHIP_OID, 154), (MEMBERSHIP_OID, 154)]);
        if x509_parser::parse_x509_certificate(&two).is_ok() {
            assert!(read_peer_cert(&two).is_none(), "two memberships were read");
        }
    }

    /// One connection of `client` to `server` on loopback (both must admit each other): the
    /// key and membership each side reads from the other's certificate.
    async fn peers_seen(
        server: Identity<'_>,
        client: Identity<'_>,
    ) -> (
        (Option<[u8; 32]>, Option<Membership>),
        (Option<[u8; 32]>, Option<Membership>),
    ) {
        let sc = server_config_for(server, Admission::Any, 4, Congestion::Cubic).expect("server");
        let ep = crate::bind("127.0.0.1:0".parse().expect("addr"), Some(sc)).expect("bind");
        let addr = ep.local_addr().expect("address");
        let cep = crate::bind("127.0.0.1:0".parse().expect("addr"), None).expect("bind");
        let cc = client_config_for(client, Some(&server.secret.public()), Admission::Any)
            .expect("client");
        let connecting = cep.connect_with(cc, addr, "stormo").expect("connect");
        let accepting = async { ep.accept().await.expect("incoming").await };
        let (inbound, outbound) = tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(accepting, connecting)
        })
        .await
        .expect("a handshake within 5 s");
        let (inbound, outbound) = (inbound.expect("accepted"), outbound.expect("connected"));
        let seen = (
            (peer_key(&inbound), peer_membership(&inbound)),
            (peer_key(&outbound), peer_membership(&outbound)),
        );
        cep.close(0u32.into(), b"done");
        ep.close(0u32.into(), b"done");
        seen
    }

    /// Issue 40 (b) and (c) in a live handshake: a client refuses a server that proves another
    /// key than the one it dialled, and a server with no allow-list refuses every client; the
    /// keys a connection reports are the ones proven, with the membership presented.
    #[test]
    fn live_handshakes_refuse_the_wrong_server_key_and_clients_without_an_allow_list() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let server = SecretKey::from_seed(&[59; 32]);
        let client = SecretKey::from_seed(&[60; 32]);
        let impostor = SecretKey::from_seed(&[61; 32]);
        let owner = SecretKey::from_seed(&[62; 32]);
        let t = now();
        let m = Membership::issue(&owner, client.public(), t - 60, t + 3600).expect("period");
        let client_allowed = || Admission::Keys([*client.public().as_bytes()].into());
        rt.block_on(async {
            let (s, c) = handshake(
                (Identity::key(&server), client_allowed()),
                (
                    Identity::key(&client),
                    Some(&server.public()),
                    Admission::Any,
                ),
            )
            .await;
            assert!(
                s && c,
                "the right server and client (server {s}, client {c})"
            );
            let (_, c) = handshake(
                (Identity::key(&impostor), client_allowed()),
                (
                    Identity::key(&client),
                    Some(&server.public()),
                    Admission::Any,
                ),
            )
            .await;
            assert!(
                !c,
                "a server under another key than the one dialled was accepted"
            );
            let (s, c) = handshake(
                (Identity::key(&server), Admission::Keys(HashSet::new())),
                (
                    Identity::key(&client),
                    Some(&server.public()),
                    Admission::Any,
                ),
            )
            .await;
            assert!(
                !s && !c,
                "no allow-list admitted a client (server {s}, client {c})"
            );

            let ((key_in, m_in), (key_out, m_out)) = peers_seen(
                Identity::key(&server),
                Identity {
                    secret: &client,
                    membership: Some(&m),
                },
            )
            .await;
            assert_eq!(key_in, Some(*client.public().as_bytes()));
            assert_eq!(m_in.map(|m| m.to_bytes()), Some(m.to_bytes()));
            assert_eq!(key_out, Some(*server.public().as_bytes()));
            assert!(m_out.is_none());
        });
    }

    /// Presents node `shown`'s certificate and signs the handshake with `signer`'s key: a peer
    /// replaying another node's certificate without that node's secret key (or, with
    /// `shown == signer`, an honest one).
    #[derive(Debug)]
    struct Presents(Arc<rustls::sign::CertifiedKey>);

    impl Presents {
        fn new(shown: &SecretKey, signer: &SecretKey) -> Arc<Self> {
            let (cert, _) = certificate(Identity::key(shown)).expect("a certificate");
            let (_, key) = certificate(Identity::key(signer)).expect("a key");
            let key = provider()
                .key_provider
                .load_private_key(key)
                .expect("a signing key");
            Arc::new(Self(Arc::new(rustls::sign::CertifiedKey::new(
                vec![cert],
                key,
            ))))
        }
    }

    impl rustls::server::ResolvesServerCert for Presents {
        fn resolve(
            &self,
            _hello: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
    }

    impl rustls::client::ResolvesClientCert for Presents {
        fn resolve(
            &self,
            _hints: &[&[u8]],
            _schemes: &[SignatureScheme],
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }

        fn has_certs(&self) -> bool {
            true
        }
    }

    /// A server presenting what `presents` resolves to, admitting `admission`.
    fn presenting_server(presents: Arc<Presents>, admission: Admission) -> quinn::ServerConfig {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_client_cert_verifier(Arc::new(KeyVerifier::new(admission, None, "client")))
            .with_cert_resolver(presents);
        cfg.alpn_protocols = vec![stormo_wire::ALPN.to_vec()];
        let quic = quinn::crypto::rustls::QuicServerConfig::try_from(cfg).expect("QUIC");
        quinn::ServerConfig::with_crypto(Arc::new(quic))
    }

    /// A client presenting what `presents` resolves to, pinning `pin`.
    fn presenting_client(presents: Arc<Presents>, pin: &PublicKey) -> quinn::ClientConfig {
        let verifier = KeyVerifier::new(Admission::Any, Some(*pin), "server");
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_cert_resolver(presents);
        cfg.alpn_protocols = vec![stormo_wire::ALPN.to_vec()];
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(cfg).expect("QUIC");
        quinn::ClientConfig::new(Arc::new(quic))
    }

    /// A key is proven by the handshake signature, not by the certificate that names it: a
    /// server or a client presenting the certificate of an admitted node (public, sent in
    /// every handshake) without that node's secret key is refused.
    #[test]
    fn a_certificate_replayed_without_its_key_is_refused_both_ways() {
        let subscriber = tracing_subscriber::fmt()
            .with_test_writer()
            .with_max_level(tracing::Level::WARN)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let server = SecretKey::from_seed(&[63; 32]);
        let client = SecretKey::from_seed(&[64; 32]);
        let impostor = SecretKey::from_seed(&[65; 32]);
        let client_allowed = || Admission::Keys([*client.public().as_bytes()].into());
        rt.block_on(async {
            let (s, c) = handshake_with(
                presenting_server(Presents::new(&server, &server), client_allowed()),
                presenting_client(Presents::new(&client, &client), &server.public()),
            )
            .await;
            assert!(s && c, "honest peers (server {s}, client {c})");
            let (_, c) = handshake_with(
                presenting_server(Presents::new(&server, &impostor), client_allowed()),
                presenting_client(Presents::new(&client, &client), &server.public()),
            )
            .await;
            assert!(
                !c,
                "a server replaying the pinned key's certificate was accepted"
            );
            let (s, _) = handshake_with(
                presenting_server(Presents::new(&server, &server), client_allowed()),
                presenting_client(Presents::new(&client, &impostor), &server.public()),
            )
            .await;
            assert!(
                !s,
                "a client replaying an allowed key's certificate was admitted"
            );
        });
    }

    /// A changed `--allow-file` is picked up without a restart: a key added is admitted, a key
    /// removed is refused, from the next check on.
    #[test]
    fn an_allow_file_is_re_read_when_it_changes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("allowed");
        let a = SecretKey::from_seed(&[41; 32]).public();
        let b = SecretKey::from_seed(&[42; 32]).public();
        std::fs::write(&path, format!("{a}\n")).expect("write");
        let adm = Admission::Listed {
            keys: HashSet::new(),
            file: Arc::new(RevokedList::load(&path).expect("loads")),
        };
        assert!(adm.admits(a.as_bytes()));
        assert!(!adm.admits(b.as_bytes()));
        // Another length too, so the change shows even within the file system's time grain.
        std::fs::write(&path, format!("# b only\n{b}\n")).expect("rewrite");
        assert!(!adm.admits(a.as_bytes()), "a removed key is still admitted");
        assert!(adm.admits(b.as_bytes()), "an added key is not admitted");
    }

    /// A peer admitted once and taken off the allow-list since is refused at its next
    /// handshake, both ways, though it connected before with the same configurations: no
    /// session is resumed (a resumed handshake shows no certificate, so it would skip the
    /// admission check; both sides once let a revoked peer back in that way).
    #[test]
    fn a_peer_refused_since_its_last_connection_is_not_resumed_back_in() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let server = SecretKey::from_seed(&[63; 32]);
        let client = SecretKey::from_seed(&[64; 32]);
        let listed = |name: &str, key: PublicKey| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("{key}\n")).expect("write");
            let adm = Admission::Listed {
                keys: HashSet::new(),
                file: Arc::new(RevokedList::load(&path).expect("loads")),
            };
            (path, adm)
        };
        let (clients, server_adm) = listed("clients", client.public());
        let (servers, client_adm) = listed("servers", server.public());
        let sc = server_config_for(Identity::key(&server), server_adm, 4, Congestion::Cubic)
            .expect("server");
        let cc = client_config_for(Identity::key(&client), Some(&server.public()), client_adm)
            .expect("client");
        rt.block_on(async {
            for _ in 0..2 {
                let (s, c) = handshake_with(sc.clone(), cc.clone()).await;
                assert!(s && c, "admitted both ways (server {s}, client {c})");
            }
            // The client taken off the server's list: the server refuses it.
            std::fs::write(&clients, "# nobody now\n").expect("rewrite");
            let (s, _) = handshake_with(sc.clone(), cc.clone()).await;
            assert!(!s, "the server let a client it no longer admits back in");
            // The server taken off the client's list: the client refuses it.
            std::fs::write(&clients, format!("# back\n{}\n", client.public())).expect("rewrite");
            std::fs::write(&servers, "# nobody now\n").expect("rewrite");
            let (_, c) = handshake_with(sc.clone(), cc.clone()).await;
            assert!(!c, "the client accepted a server it no longer admits");
        });
    }
}
