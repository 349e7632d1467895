//! TLS 1.3 for QUIC with both sides authenticated by their Ed25519 node keys, as raw public
//! keys (RFC 7250): no certificates, no names, no authorities. A client pins the one key it
//! dialled; a server admits the keys of its [`Admission`] policy.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{
    CertificateDer, PrivatePkcs8KeyDer, ServerName, SubjectPublicKeyInfoDer, UnixTime,
};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use stormo_manifests::{PublicKey, SecretKey};

/// DER prefix of an Ed25519 SubjectPublicKeyInfo; the 32 key bytes follow.
const SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];
/// DER prefix of an Ed25519 PKCS#8 v1 private key; the 32 seed bytes follow.
const PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

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

/// Which node keys a server admits.
#[derive(Clone, Debug)]
pub enum Admission {
    /// Anyone with a valid key (asked for explicitly with `--allow-any`).
    Any,
    /// Only these keys (a private swarm).
    Keys(HashSet<[u8; 32]>),
}

impl Admission {
    /// Whether `key` may connect.
    pub fn admits(&self, key: &[u8; 32]) -> bool {
        match self {
            Self::Any => true,
            Self::Keys(k) => k.contains(key),
        }
    }
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

/// The key a QUIC connection's peer proved in its handshake.
pub fn peer_key(conn: &quinn::Connection) -> Option<[u8; 32]> {
    let id = conn.peer_identity()?;
    let certs = id.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    key_of_spki(certs.first()?.as_ref())
}

fn certified_key(secret: &SecretKey) -> anyhow::Result<Arc<CertifiedKey>> {
    let seed = secret.seed();
    let mut pkcs8 = PKCS8_PREFIX.to_vec();
    pkcs8.extend_from_slice(&seed[..]);
    let der = PrivatePkcs8KeyDer::from(pkcs8);
    let signer = rustls::crypto::ring::sign::any_eddsa_type(&der)
        .map_err(|e| anyhow::anyhow!("the node key is not a usable Ed25519 key: {e}"))?;
    let public = spki(secret.public().as_bytes());
    Ok(Arc::new(CertifiedKey::new(
        vec![CertificateDer::from(public)],
        signer,
    )))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Checks the peer's raw public key against a policy, and its handshake signatures.
#[derive(Debug)]
struct KeyVerifier {
    admission: Admission,
    algs: WebPkiSupportedAlgorithms,
}

impl KeyVerifier {
    fn new(admission: Admission) -> Self {
        Self {
            admission,
            algs: provider().signature_verification_algorithms,
        }
    }

    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        let Some(key) = key_of_spki(end_entity.as_ref()) else {
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::BadEncoding,
            ));
        };
        if self.admission.admits(&key) {
            Ok(())
        } else {
            tracing::warn!(
                "refused node {}: its key is not allowed",
                PublicKey::from_bytes(&key).map_or_else(|_| "(invalid key)".into(), |k| k.to_hex())
            );
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature_with_raw_key(
            message,
            &SubjectPublicKeyInfoDer::from(cert.as_ref()),
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
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)?;
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

    fn requires_raw_public_keys(&self) -> bool {
        true
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
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity)?;
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

    fn requires_raw_public_keys(&self) -> bool {
        true
    }
}

/// How a sender paces its data (QUIC congestion control).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Congestion {
    /// CUBIC (RFC 9438), as TCP uses: backs off on every loss, so random loss on a long path
    /// holds it far below the link's rate.
    #[default]
    Cubic,
    /// BBR: paces to the measured bottleneck rate and round trip, so random loss costs it
    /// little. quinn calls its implementation experimental, and BBR can take more than its
    /// share of a link it shares with CUBIC flows.
    Bbr,
}

/// Transport settings shared by both ends: bounded idle time, keep-alives, at most `streams`
/// concurrent requests from the peer, and `congestion` for what this end sends.
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
    if congestion == Congestion::Bbr {
        t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
    }
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
    let ck = certified_key(secret)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .with_client_cert_verifier(Arc::new(KeyVerifier::new(admission)))
        .with_cert_resolver(Arc::new(
            rustls::server::AlwaysResolvesServerRawPublicKeys::new(ck),
        ));
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
    let ck = certified_key(secret)?;
    let only = Admission::Keys(HashSet::from([*peer.as_bytes()]));
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with the ring provider")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(KeyVerifier::new(only)))
        .with_client_cert_resolver(Arc::new(
            rustls::client::AlwaysResolvesClientRawPublicKeys::new(ck),
        ));
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

    /// The congestion control a server is configured with is the one its connections run.
    #[test]
    fn server_connections_run_the_configured_congestion_control() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            for (cc, bbr) in [(Congestion::Bbr, true), (Congestion::Cubic, false)] {
                let server_key = SecretKey::from_seed(&[3; 32]);
                let sc = server_config(&server_key, Admission::Any, 4, cc).expect("server");
                let server = crate::net::bind("127.0.0.1:0".parse().expect("addr"), Some(sc))
                    .expect("server endpoint");
                let addr = server.local_addr().expect("address");
                let client = crate::net::bind("127.0.0.1:0".parse().expect("addr"), None)
                    .expect("client endpoint");
                let cfg = client_config(&SecretKey::from_seed(&[4; 32]), &server_key.public())
                    .expect("client");
                let connecting = client.connect_with(cfg, addr, "stormo").expect("connect");
                let accepting = async { server.accept().await.expect("incoming").await };
                let (inbound, out) = tokio::join!(accepting, connecting);
                let inbound = inbound.expect("accepted");
                out.expect("connected");
                let state = inbound.congestion_state().into_any();
                assert_eq!(
                    state.downcast::<quinn::congestion::Bbr>().is_ok(),
                    bbr,
                    "{cc:?}"
                );
            }
        });
    }
}
