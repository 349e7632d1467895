//! The manifest a node runs under: the local file, or one fetched from a peer, accepted only
//! when its id is pinned or its signature verifies against a trusted publisher.

use std::path::Path;

use anyhow::Context;
use stormo_manifests::{
    read_manifest, Hash, Manifest, ManifestPaths, ManifestSignature, SecretKey,
};
use stormo_net::{accept_manifest, tier};

/// The manifest for a node of `dir`: the local file (`args.manifest` or
/// `DIR/stormo-manifest.bin`) when it exists, else fetched from the first peer that answers;
/// accepted only as [`accept_manifest`] says.
pub fn resolve_manifest(
    dir: &Path,
    args: &crate::config::PeersConfig,
    secret: &SecretKey,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<(Manifest, Hash, Vec<u8>)> {
    let paths = ManifestPaths::resolve(dir, args.manifest.as_deref());
    let sig = std::fs::read(&paths.sig).ok();
    let bytes = if paths.bin.exists() {
        let (_, bytes) = read_manifest(&paths.bin)?;
        bytes
    } else {
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
        let cfg = args.timeouts;
        let mut last = None;
        let mut got = None;
        for p in &args.peers {
            match rt.block_on(tier::fetch_manifest(secret, p, want, cfg)) {
                Ok((_, b)) => {
                    got = Some(b);
                    break;
                }
                Err(e) => {
                    tracing::warn!("{e:#}");
                    last = Some(e);
                }
            }
        }
        match got {
            Some(b) => b,
            None => {
                return Err(last
                    .unwrap_or_else(|| anyhow::anyhow!("no peer"))
                    .context("no peer supplied the manifest"))
            }
        }
    };
    let (m, id) = accept_manifest(&bytes, sig.as_deref(), &args.trust, args.model_id)?;
    Ok((m, id, bytes))
}
