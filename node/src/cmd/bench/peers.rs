//! `stormo bench --peer`: where the experts come from, and the same run again from the local
//! disk beside the peers' run.
//!
//! With `--peer` every expert comes from peers (none from the local disk); when the folder
//! holds the experts, the same prompts and decode then run from the local disk at the same
//! RAM budget ([`disk_run`]), so the report can set the two side by side. A folder from
//! `stormo pull` holds only the dense weights: then only the peers' run.

use std::time::Instant;

use stormo_node::config::{LocalExperts, PeersConfig};

use super::timed::Rig;
use super::{Args, Plan, Progress};

/// Where a run's experts come from.
#[derive(Debug)]
pub(super) struct Source {
    /// The peers (none without `--peer`).
    pub(super) peers: PeersConfig,
    /// Whether every expert comes from peers.
    pub(super) from_peers: bool,
    /// Whether the same run follows from the local disk.
    pub(super) beside_disk: bool,
}

impl Source {
    /// From `a`'s peer options and what its model folder holds (saying when it holds no
    /// experts to run from beside the peers).
    pub(super) fn resolve(a: &Args, say: Progress) -> anyhow::Result<Self> {
        let peers = a.net.resolve(false)?;
        let from_peers = !peers.peers.is_empty();
        let beside_disk = from_peers && !stormo_net::pull::Pulled::dense_only(&a.model)?;
        if from_peers && !beside_disk {
            say.say(format!(
                "{} holds no experts (pulled without them): measuring from peers only, with no \
                 local-disk run beside it",
                a.model.display()
            ));
        }
        Ok(Self {
            peers,
            from_peers,
            beside_disk,
        })
    }

    /// The local experts the run uses: none when they come from peers.
    pub(super) fn local(&self) -> LocalExperts {
        if self.from_peers {
            LocalExperts::None
        } else {
            LocalExperts::All
        }
    }
}

/// What `bench --peer` measures from the local disk beside the run from peers.
#[derive(Debug)]
pub(super) struct DiskRun {
    /// (prompt tokens, seconds) per prompt.
    pub(super) prefill: Vec<(usize, f64)>,
    /// Decode tokens per second.
    pub(super) decode_tok_s: f64,
}

/// The run of `a` again with every expert from the local disk and no peers: the same prompts
/// (the same seed), the same warming and the same number of decoded tokens, at the same RAM
/// budget.
pub(super) fn disk_run(a: &Args, plan: &Plan) -> anyhow::Result<DiskRun> {
    let files = stormo_node::node::open_model(&a.model)?;
    let mut rig = Rig::start(a, plan, LocalExperts::All, PeersConfig::default(), files)?;
    if a.warm {
        rig.warm(plan)?;
    }
    let mut prefill = Vec::new();
    let mut last = None;
    for &p in &a.prompt_tokens {
        let (s, next, secs) = rig.prefill_once(plan.context, p)?;
        prefill.push((p, secs));
        last = Some((s, next));
    }
    let (mut sess, mut tok) = last.expect("at least one prompt");
    let t = Instant::now();
    for _ in 0..a.decode_tokens {
        tok = rig.model.forward_greedy(&mut sess, &[tok], None)?.token;
    }
    let decode_tok_s = a.decode_tokens as f64 / t.elapsed().as_secs_f64();
    rig.node.finish_run();
    Ok(DiskRun {
        prefill,
        decode_tok_s,
    })
}
