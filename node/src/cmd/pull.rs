//! `stormo pull`: fetch a model folder from peers, verified against the L0 manifest (the
//! layout is described in [`stormo_net::pull`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use stormo_manifests::{Hash, PublicKey};

use stormo_net::{self as net, pull, tier::PeerConfig, PeerAddr};
use stormo_node::node::Host;

/// Arguments of `stormo pull`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("accept").required(true).multiple(true).args(["model_id", "trust"])))]
pub struct Args {
    /// A peer serving the model, as KEY@HOST:PORT (its 64-hex node key and address).
    /// Repeatable: a peer that fails or sends wrong bytes is replaced by the next. Not needed
    /// with --discover, which finds the swarm's peers serving --model-id.
    #[arg(long = "peer", value_name = "KEY@HOST:PORT")]
    pub peers: Vec<PeerAddr>,
    /// Accept only the manifest with this model id (64 hex).
    #[arg(long, value_name = "ID")]
    pub model_id: Option<Hash>,
    /// Accept a manifest signed by this publisher key (64 hex; the signature is fetched from
    /// the peer and saved beside the manifest). Repeatable.
    #[arg(long, value_name = "PUBKEY")]
    pub trust: Vec<PublicKey>,
    /// The folder to write (created if missing, and removed again if the pull fails before
    /// storing anything). A folder pulled before is resumed: files already complete and
    /// verified are kept. A folder holding another model is refused (see --force).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Replace another model that --out holds: its weight, metadata and manifest files are
    /// removed first (instead of refusing the pull).
    #[arg(long)]
    pub force: bool,
    /// This node's secret key (which the peers allow-list); without it an ephemeral key.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Fetch the expert tensors too (a full local copy). Without it the folder holds the
    /// dense weights only and `run` fetches experts from peers (--no-local-experts implied),
    /// unless it already held the experts: a pull never drops them.
    #[arg(long)]
    pub with_experts: bool,
    /// Also fetch these experts' records (the --only-experts syntax: `0-15`, or per layer
    /// `0:0-7,1:8-15`, or `all`), each from any peer that holds it (partial holders too), verified
    /// against the manifest and kept in the expert directory (--expert-dir, default the state
    /// directory), where `run`, `chat` and `serve` on this folder find and use them.
    #[arg(long, value_name = "SPEC", conflicts_with = "with_experts")]
    pub experts: Option<String>,
    /// Where --experts keeps the records (default: `experts/` in the state directory).
    #[arg(long, value_name = "DIR", requires = "experts")]
    pub expert_dir: Option<PathBuf>,
    /// The state directory (default: $XDG_STATE_HOME/stormo or ~/.local/state/stormo).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Seconds a peer may take to answer one request, from when it is sent, before the next
    /// peer is tried (a connection attempt gets at most 3 s, or this if shorter). At most 1e6.
    #[arg(
        long,
        default_value_t = 30.0,
        value_name = "SECS",
        value_parser = stormo_net::progress::secs_arg
    )]
    pub peer_timeout: f64,
    /// No progress on stderr: no line per file, no progress lines, no summary. Errors and
    /// warnings are still printed, and so are the files --force removes.
    #[arg(long, short)]
    pub quiet: bool,
    /// Swarm membership and discovery (peers found by themselves instead of --peer).
    #[command(flatten)]
    pub swarm: crate::swarm_args::SwarmArgs,
}

/// Runs `stormo pull`: finds the peers (with `--discover`), fetches the folder, then (with
/// `--experts`) the expert records, all on one [`Host`]: one runtime, one key, one endpoint,
/// which the node fetching the experts starts on.
pub fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.peers.is_empty() || !a.swarm.discover.is_empty(),
        "pull needs peers to fetch from: --peer KEY@HOST:PORT, or --discover lan (with \
         --swarm and --cert) to find the swarm's nodes serving --model-id"
    );
    let t = stormo_net::progress::check_secs(a.peer_timeout)
        .map_err(|e| anyhow::anyhow!("--peer-timeout: {e}"))?;
    let t = Duration::from_secs_f64(t);
    let mut host = Host::new()?;
    host.key_or_load(a.key.as_deref())?;
    let given_key = a.key.as_ref().and(host.key());
    let swarm = crate::swarm_args::resolve_with_key(&a.swarm, given_key)?;
    let endpoint = host.endpoint_or_bind(None, &a.peers)?.clone();
    let (rt, secret) = (
        host.runtime(),
        host.key().expect("loaded above: the pull's key"),
    );
    let mut peers = a.peers.clone();
    if let Some(sw) = swarm.as_ref().filter(|s| s.discover.is_on()) {
        let id = a.model_id.context(
            "--discover needs --model-id: peers are found under a key derived from the model id",
        )?;
        for p in stormo_net::discover::find_peers_on(
            rt,
            &endpoint,
            secret,
            sw,
            id,
            stormo_net::discover::FIND_WITHIN,
        )? {
            if !peers.iter().any(|q| q.key == p.key) {
                peers.push(p);
            }
        }
        if !a.quiet {
            eprintln!(
                "pull: discovery found {} peers",
                peers.len() - a.peers.len()
            );
        }
    }
    // In a swarm, the peers found or given are dialled as a member: certificate presented,
    // members admitted (and the keys given with --peer).
    let given: Vec<PublicKey> = a.peers.iter().map(|p| p.key).collect();
    let membership = swarm.as_ref().and_then(|sw| {
        sw.membership.as_ref().map(|m| pull::PullMembership {
            cert: m.cert.clone(),
            servers: sw.admission(&given, false),
        })
    });
    let opts = pull::PullOptions {
        peers: peers.clone(),
        model_id: a.model_id,
        trust: a.trust.clone(),
        out: a.out.clone(),
        with_experts: a.with_experts,
        force: a.force,
        cfg: PeerConfig::with_timeout(t),
        membership,
        experts: a.experts.clone(),
        quiet: a.quiet,
    };
    let started = std::time::Instant::now();
    let r = pull::pull_on(secret, &opts, rt, &endpoint)
        .with_context(|| format!("pulling into {}", a.out.display()))?;
    let secs = started.elapsed().as_secs_f64();
    let model = r.model_id.map(|h| h.to_hex()).unwrap_or_default();
    let mut kept = None;
    if let Some(spec) = &a.experts {
        // The peers are found: the node that fetches the experts looks no further.
        let swarm = swarm.map(|sw| crate::swarm_args::SwarmConfig {
            discover: Default::default(),
            ..sw
        });
        kept = Some(pull_experts(
            &a,
            spec,
            r.model_id,
            PeerConfig::with_timeout(t),
            peers,
            swarm,
            host,
        )?);
    }
    let total = started.elapsed().as_secs_f64();
    if !a.quiet {
        eprintln!(
            "{}",
            last_line(&model, &a.out, &r, kept.as_ref(), [secs, total])
        );
    }
    Ok(())
}

/// What `stormo pull --experts` kept.
#[derive(Debug)]
struct KeptExperts {
    /// Experts asked for.
    asked: usize,
    /// Of them, fetched now (the rest were kept already).
    fetched: usize,
    /// Their records' bytes fetched now.
    bytes: u64,
    /// Where they are kept.
    dir: PathBuf,
}

/// The last line of a pull: what the folder holds now (its weight files and their size, dense
/// only or with the experts), what it took (tensors and metadata files fetched, each with
/// their bytes; tensors copied; files kept), and the experts kept where (`--experts`).
/// `secs`: the folder's pull, and the whole command.
fn last_line(
    model: &str,
    out: &std::path::Path,
    r: &pull::PullReport,
    kept: Option<&KeptExperts>,
    [secs, total]: [f64; 2],
) -> String {
    use stormo_net::progress::human_bytes;
    let size: u64 = r.files.iter().map(|(_, n)| n).sum();
    let names: Vec<&str> = r.files.iter().map(|(n, _)| n.as_str()).collect();
    let files = match names.as_slice() {
        [one] => (*one).to_string(),
        [first, .., last] if names.len() > 3 => format!("{} files, {first} to {last}", names.len()),
        many => many.join(", "),
    };
    let holds = if r.experts {
        format!("{files} ({}, experts included)", human_bytes(size))
    } else {
        format!("{files} ({}, dense tensors only)", human_bytes(size))
    };
    let folder_new = r.tensors > 0 || r.meta > 0 || r.fetched > 0 || r.reused > 0;
    let experts_new = kept.is_some_and(|k| k.fetched > 0);
    let mut line = if folder_new || experts_new {
        format!(
            "pulled model {model} into {} in {total:.1}s: {holds}",
            out.display()
        )
    } else {
        format!(
            "model {model} in {} is already up to date: {holds}",
            out.display()
        )
    };
    if folder_new {
        let rate = human_bytes((r.fetched as f64 / secs.max(1e-9)) as u64);
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        // The weight files' headers come with their tensors' bytes.
        let tensors = format!(
            "{} ({})",
            plural(r.tensors, "tensor", "tensors"),
            human_bytes(r.fetched.saturating_sub(r.meta_bytes))
        );
        let meta = format!(
            "{} ({})",
            plural(r.meta, "metadata file", "metadata files"),
            human_bytes(r.meta_bytes)
        );
        let fetched = match (r.tensors > 0, r.meta > 0) {
            (true, true) => format!("{tensors} and {meta}"),
            (false, true) => meta,
            _ => tensors,
        };
        line += &format!("; fetched {fetched} at {rate}/s");
        if r.reused > 0 {
            line += &format!(
                ", {} copied from files already there",
                plural(r.reused, "tensor", "tensors")
            );
        }
        if r.kept > 0 {
            line += &format!(", {} already complete", plural(r.kept, "file", "files"));
        }
    } else if experts_new {
        line += ", already up to date";
    }
    if let Some(k) = kept {
        line += &format!(
            "; {} experts kept in {} ({} fetched now, {})",
            k.asked,
            k.dir.display(),
            k.fetched,
            human_bytes(k.bytes)
        );
    }
    if !r.experts {
        line += if kept.is_some() {
            "; run it with --peer or --discover for the other experts"
        } else {
            "; run it with --peer or --discover to fetch experts"
        };
    }
    line
}

/// Fetches the expert records `spec` names for the model pulled into `a.out` (id `model`),
/// each from any peer holding it, and keeps them (verified) in the expert directory, on a node
/// started on the pull's `host`. Progress counts experts and their bytes.
fn pull_experts(
    a: &Args,
    spec: &str,
    model: Option<Hash>,
    timeouts: PeerConfig,
    peers: Vec<PeerAddr>,
    swarm: Option<crate::swarm_args::SwarmConfig>,
    host: Host,
) -> anyhow::Result<KeptExperts> {
    use stormo_engine::tiers::{ExpertId, Priority, Tier};
    let state_dir = a
        .state_dir
        .clone()
        .unwrap_or_else(stormo_node::config::default_state_dir);
    let files = stormo_node::node::open_model(&a.out)?;
    let node = stormo_node::node::Node::start_on(
        stormo_node::config::NodeConfig {
            model: a.out.clone(),
            state_dir,
            experts: stormo_node::config::ExpertsConfig {
                cache: stormo_node::config::CacheBudget::Bytes(0),
                hot_store: false,
                ..Default::default()
            },
            local: stormo_node::config::LocalExperts::None,
            context: 1,
            peers: stormo_node::config::PeersConfig {
                peers,
                key: a.key.clone(),
                trust: a.trust.clone(),
                model_id: model.or(a.model_id),
                manifest: None,
                timeouts,
                keep: Some(stormo_node::config::KeepConfig {
                    dir: a.expert_dir.clone(),
                    limit: u64::MAX.into(),
                }),
                peers_first: false,
                exec_trust: Default::default(),
                // A pull computes nothing.
                remote: net::remote_policy::RemoteConfig {
                    mode: net::remote_policy::RemoteExec::Never,
                    spot_check: 0.0,
                    inline: false,
                    verify: Default::default(),
                },
            },
            listen: None,
            swarm,
        },
        host,
        files,
    )?;
    let shape: Vec<usize> = node.files().layout.parts.iter().map(Vec::len).collect();
    let flags = net::parse_expert_spec("--experts", spec, &shape)?;
    let keys: Vec<ExpertId> = flags
        .iter()
        .enumerate()
        .flat_map(|(l, row)| {
            row.iter()
                .enumerate()
                .filter(|(_, &on)| on)
                .map(move |(e, _)| ExpertId::from_indices(l, e))
        })
        .collect();
    let tier = node.peer_tier().context("no network tier")?.clone();
    let dir = node.expert_dir().context("no expert directory")?.clone();
    anyhow::ensure!(
        !dir.is_shared(),
        "the expert directory {} is in use by another stormo process (a node or run on the \
         same --state-dir): stop it, or give `pull` another --state-dir or --expert-dir",
        dir.root().display()
    );
    let todo: Vec<ExpertId> = keys.iter().copied().filter(|&k| !dir.contains(k)).collect();
    if !a.quiet {
        eprintln!(
            "pull: {} experts asked for, {} already kept in {}",
            keys.len(),
            keys.len() - todo.len(),
            dir.root().display()
        );
    }
    let mut progress =
        stormo_net::progress::Progress::counting("pull: experts", "experts").quiet(a.quiet);
    let total = todo.len() as u64;
    let sizes = node.files().layout.sizes();
    let size = |k: ExpertId| {
        sizes
            .get(usize::from(k.layer))
            .and_then(|s| s.get(usize::from(k.expert)))
            .copied()
            .unwrap_or(0)
    };
    let (mut done, mut bytes) = (0u64, 0u64);
    // A few at a time: each load holds its whole record in memory until it is kept.
    for batch in todo.chunks(4) {
        let (tx, rx) = std::sync::mpsc::channel();
        tier.load(
            batch,
            Priority::Demand,
            std::sync::Arc::new(move |k: ExpertId, r: stormo_engine::Result<_>| {
                let _ = tx.send((k, r.map(|_: std::sync::Arc<_>| ())));
            }),
        );
        for _ in batch {
            let (k, r) = rx.recv().context("the network tier dropped a load")?;
            r.with_context(|| format!("expert {k}"))?;
            done += 1;
            bytes += size(k);
            progress.update_items(done, total, bytes);
        }
    }
    progress.finish();
    // The tier keeps each verified record in the background: wait for the last ones.
    let until = std::time::Instant::now() + Duration::from_secs(120);
    while todo.iter().any(|&k| !dir.contains(k)) {
        anyhow::ensure!(
            std::time::Instant::now() < until,
            "the fetched experts were not all written to {} within 120 s",
            dir.root().display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    node.finish_run();
    Ok(KeptExperts {
        asked: keys.len(),
        fetched: todo.len(),
        bytes,
        dir: dir.root().to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: the summary counted the metadata files' bytes (a tokenizer.json of 27 MiB)
    /// as the tensors', "30 tensors fetched (27.9 MiB, ...)" for 0.9 MiB of tensors. Tensors
    /// and metadata files are counted and sized apart; files and tensors are labelled as
    /// such, one or many.
    #[test]
    fn the_summary_counts_tensors_and_metadata_files_apart() {
        let r = pull::PullReport {
            fetched: (27 << 20) + (900 << 10),
            tensors: 30,
            meta: 2,
            meta_bytes: 27 << 20,
            kept: 1,
            files: vec![("model.dense.safetensors".into(), 900 << 10)],
            ..Default::default()
        };
        let line = last_line("ID", std::path::Path::new("/m"), &r, None, [1.0, 1.0]);
        assert!(
            line.contains(
                "; fetched 30 tensors (900.0 KiB) and 2 metadata files (27.0 MiB) at 27.9 MiB/s, \
                 1 file already complete"
            ),
            "{line}"
        );
        // Only the tokenizer again: no tensors to speak of.
        let r = pull::PullReport {
            fetched: 27 << 20,
            meta: 1,
            meta_bytes: 27 << 20,
            kept: 2,
            files: vec![("model.dense.safetensors".into(), 900 << 10)],
            ..Default::default()
        };
        let line = last_line("ID", std::path::Path::new("/m"), &r, None, [1.0, 1.0]);
        assert!(
            line.contains("; fetched 1 metadata file (27.0 MiB) at 27.0 MiB/s, 2 files already"),
            "{line}"
        );
    }
}
