//! The manifest a node runs under: the local file, or one fetched from a peer, accepted only
//! when its id is pinned or its signature verifies against a trusted publisher.

use std::path::Path;

use anyhow::Context;
use stormo_manifests::{
    read_manifest, Hash, Manifest, ManifestPaths, ManifestSignature, SecretKey,
};
use stormo_net::{accept_manifest, tier};

/// The manifest for a node of `dir`: the local file (`args.manifest` or
/// `DIR/stormo-manifest.bin`) when it exists, else fetched from the peers, all asked at once,
/// the first answer that [`accept_manifest`] takes winning; accepted only as it says. A fetch dials from an endpoint of its own: for
/// a caller with none (a node fetches from its own, [`resolve_manifest_on`]).
pub fn resolve_manifest(
    dir: &Path,
    args: &crate::config::PeersConfig,
    secret: &SecretKey,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<(Manifest, Hash, Vec<u8>)> {
    resolve_manifest_on(dir, args, secret, rt, None)
}

/// [`resolve_manifest`] fetching, when it must, from `endpoint` (the node's own, which stays
/// open); with `None` from an endpoint of its own, closed when done.
pub fn resolve_manifest_on(
    dir: &Path,
    args: &crate::config::PeersConfig,
    secret: &SecretKey,
    rt: &tokio::runtime::Runtime,
    endpoint: Option<&quinn::Endpoint>,
) -> anyhow::Result<(Manifest, Hash, Vec<u8>)> {
    let paths = ManifestPaths::resolve(dir, args.manifest.as_deref());
    let sig = std::fs::read(&paths.sig).ok();
    let accept = |bytes: &[u8]| accept_manifest(bytes, sig.as_deref(), &args.trust, args.model_id);
    if paths.bin.exists() {
        let (_, bytes) = read_manifest(&paths.bin)?;
        let (m, id) = accept(&bytes)?;
        return Ok((m, id, bytes));
    }
    anyhow::ensure!(
        !args.peers.is_empty(),
        "no manifest at {} and no --peer to fetch it from",
        paths.bin.display()
    );
    anyhow::ensure!(
        args.model_id.is_some() || sig.is_some(),
        "no manifest at {}: fetching it from a peer needs --model-id ID (or its signature file there with --trust)",
        paths.bin.display()
    );
    let want = match (args.model_id, &sig) {
        (Some(id), _) => Some(id),
        (None, Some(s)) => Some(
            ManifestSignature::from_bytes(s)
                .context("the signature file")?
                .model_id,
        ),
        (None, None) => None,
    };
    let got = match endpoint {
        Some(ep) => fetch_from_peers(args, secret, rt, ep, want, accept),
        None => {
            let own = {
                let _g = rt.enter();
                let v6 = args.peers.iter().any(|p| p.addr.is_ipv6());
                stormo_net::bind(stormo_net::unspecified(v6), None)?
            };
            let got = fetch_from_peers(args, secret, rt, &own, want, accept);
            own.close(0u32.into(), b"done");
            got
        }
    };
    got.map(|((m, id), bytes)| (m, id, bytes))
}

/// The manifest (of `want`, or the peer's only model) from the first of `args.peers` whose
/// bytes `accept` takes, dialled from `endpoint`. Every peer is asked at once and the answers
/// are taken as they come: a peer that does not answer costs no more than the fastest good
/// one takes, and one that sends bytes `accept` refuses (a manifest that is not the pinned or
/// signed one) is warned about and passed over for the next answer, where asking the peers one
/// by one had waited out each dead peer's connect timeout and given up at the first bad
/// manifest.
fn fetch_from_peers<T>(
    args: &crate::config::PeersConfig,
    secret: &SecretKey,
    rt: &tokio::runtime::Runtime,
    endpoint: &quinn::Endpoint,
    want: Option<Hash>,
    accept: impl Fn(&[u8]) -> anyhow::Result<T>,
) -> anyhow::Result<(T, Vec<u8>)> {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    rt.block_on(async {
        let mut asks: FuturesUnordered<_> = args
            .peers
            .iter()
            .map(|p| async move {
                let got = tier::fetch_manifest_on(endpoint, secret, p, want, args.timeouts).await;
                (p, got)
            })
            .collect();
        let mut last = None;
        while let Some((p, got)) = asks.next().await {
            let taken = got.and_then(|(_, bytes)| {
                let t = accept(&bytes).with_context(|| format!("the manifest from peer {p}"))?;
                Ok((t, bytes))
            });
            match taken {
                Ok(t) => return Ok(t),
                Err(e) => {
                    tracing::warn!("{e:#}");
                    last = Some(e);
                }
            }
        }
        Err(last
            .unwrap_or_else(|| anyhow::anyhow!("no peer"))
            .context("no peer supplied the manifest"))
    })
}
