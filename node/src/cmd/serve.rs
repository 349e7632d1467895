//! `stormo serve`: serve this node's manifest and experts to peers over QUIC (`--listen`),
//! and/or an OpenAI-compatible HTTP API (`--http`, see [`stormo_node::http`]), in one process:
//! both are services of one [`Node`], which stops them on SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

use stormo_engine::LoadOptions;

use crate::args::{ExpertArgs, PeerArgs};
use crate::cmd::chat::{check_text_model, text_model_on};
use crate::swarm_args::SwarmConfig;
use stormo_net::tls::{Admission, Congestion};
use stormo_net::{self as net, serve};
use stormo_node::config::{ListenConfig, LocalExperts, NodeConfig};
use stormo_node::memory::MemoryPlan;
use stormo_node::node::Node;

/// How to run one node for a LAN, shown after `stormo serve --help`.
pub const LAN_HELP: &str = "\
One node for a LAN (every machine runs one node; a node serves what it holds, fetches what it
lacks, keeps it and serves it on):
  # the machine with the checkpoint (build its manifest once; the folder is never written again)
  stormo key generate --key node.key
  stormo manifest build --model /models/gpt-oss-20b           # prints the model id
  stormo serve --model /models/gpt-oss-20b --key node.key --listen 0.0.0.0:4433 --allow-any
  # a machine without room for the experts: the dense weights, then a node that fetches
  stormo pull --peer KEY@HOST:4433 --model-id ID --out ~/gpt-oss-20b
  stormo serve --model ~/gpt-oss-20b --peer KEY@HOST:4433 --listen 0.0.0.0:4433 --allow-any \\
      --http 127.0.0.1:8080
Every option can also come from a --config FILE (TOML) or a STORMO_<OPTION> variable.";

/// Arguments of `stormo serve`.
#[derive(Debug, clap::Args)]
#[command(after_help = LAN_HELP)]
#[command(group(
    clap::ArgGroup::new("endpoint")
        .args(["listen", "http"])
        .required(true)
        .multiple(true)
))]
pub struct Args {
    /// The model directory: a full or partial checkpoint, or a folder from `stormo pull`
    /// (dense weights only; its experts then come from --peer). Serving peers with --listen
    /// needs its manifest (DIR/stormo-manifest.bin, or --manifest, or fetched from a peer).
    #[arg(short, long, value_name = "DIR")]
    pub model: PathBuf,
    /// Where to listen for peers (UDP), e.g. 0.0.0.0:4433 or 127.0.0.1:0. The node also
    /// dials its peers from this port.
    #[arg(long, value_name = "ADDR", value_parser = listen_addr)]
    pub listen: Option<SocketAddr>,
    /// Admit the peer with this node key (64 hex); repeatable. Without --allow, --allow-file
    /// or --allow-any nobody can connect.
    #[arg(long, value_name = "PUBKEY")]
    pub allow: Vec<String>,
    /// Admit the node keys listed in this file (one per line, `#` comments).
    #[arg(long, value_name = "FILE")]
    pub allow_file: Option<PathBuf>,
    /// Admit any node key (a public node). Must be asked for explicitly.
    #[arg(long, conflicts_with_all = ["allow", "allow_file"])]
    pub allow_any: bool,
    /// Serve only these experts: `0-15` (the same experts in every layer), per layer
    /// `0:0-7,1:8-15` (layers not named: none), or `all`.
    #[arg(long, value_name = "SPEC")]
    pub only_experts: Option<String>,
    /// Copies of every expert the serving nodes keep across the swarm. A node with peers
    /// (--peer or --discover) and room for kept experts (--expert-dir-limit) fetches, verified,
    /// the experts with the fewest copies first until each has N, then copies of the most
    /// asked for; it evicts what has most copies elsewhere. A model folder's own experts (a
    /// seeder's) do not count towards N, so the swarm keeps the model when seeders leave.
    /// A node counts the copies of the peers it is connected to: its --peer list, those found
    /// by --discover, serving nodes that dialled it, and the serving nodes its peers name (peer
    /// exchange), so nodes given only the seeder find each other. Check `swarm status` (its
    /// kept copies) before a seeder goes.
    /// 0: place nothing (keep only what this node happens to fetch).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub replicas: u32,
    /// Requests of one peer served at once; more are answered busy.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub per_peer: u32,
    /// Requests of all peers served at once; more are answered busy.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub max_requests: usize,
    /// Threads that run held experts for peers (remote execution: a peer sends an expert's
    /// input rows, 11.5 KB a position, instead of fetching its weights), a pool apart from the
    /// engine's: with C engine threads, generation keeps at least C/(C+N) of the CPU while
    /// peers keep them busy. 0: run nothing for peers.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub exec_threads: usize,
    /// Expert calls of one peer run (or waiting for an exec thread) at once; more are
    /// answered busy.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub exec_per_peer: u32,
    /// Expert calls of all peers run (or waiting for an exec thread) at once; more are
    /// answered busy.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub exec_max: usize,
    /// How answers to peers are paced (QUIC congestion control). `tolerant` (the default) is
    /// CUBIC that does not back off for a loss while the path's queue is empty: it keeps
    /// experts flowing over long lossy paths and is CUBIC wherever a queue builds, so it
    /// shares a link fairly; `cubic` is the plain opt-out; `bbr` is quinn's experimental BBR,
    /// which took most of a link it shared with a CUBIC flow (`stormo sim --scenario
    /// fair-wan`, docs/network.md).
    #[arg(long, default_value_t = Congestion::default(), value_name = "ALGORITHM", value_parser = crate::args::congestion_arg())]
    pub congestion: Congestion,
    /// Do not read the experts this node holds into its RAM cache at start. By default a node
    /// that listens does, in the background and at the lowest priority, into the cache's free
    /// room (as many as --expert-cache holds, evicting nothing), so that peers' first calls
    /// and fetches are answered from RAM rather than the disk; it prints a line when done.
    /// With this the cache fills as peers ask.
    #[arg(long)]
    pub no_warm: bool,
    /// The HTTP API computes the whole exact output head for every token instead of
    /// screening it with an 8-bit copy made at load, greedy or sampled (the same tokens;
    /// docs/design.md). Lab switch (hidden).
    #[arg(long, hide = true)]
    pub full_head: bool,
    /// Where experts come from (one RAM cache over the local disk, kept experts and peers,
    /// shared by the peers served and the HTTP API).
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// Peers this node fetches from (what it fetches it keeps and serves on, unless
    /// --no-keep), and the manifest checks.
    #[command(flatten)]
    pub net: PeerArgs,
    /// The HTTP API for people and their tools.
    #[command(flatten)]
    pub http: crate::args::HttpArgs,
    /// Swarm membership and discovery.
    #[command(flatten)]
    pub swarm: crate::swarm_args::SwarmArgs,
}

/// Runs `stormo serve` until interrupted (SIGINT or SIGTERM: a clean stop).
pub fn run(a: Args) -> anyhow::Result<()> {
    // First: the tokenizer and the probes use the pool whose size this sets.
    stormo_node::config::start_engine_threads(a.experts.threads)?;
    anyhow::ensure!(
        a.listen.is_some() || a.http.http.is_some(),
        "give --listen, --http, or both (on the command line or in the --config file)"
    );
    // The model's description, read once: the HTTP API's settings, the text checks and the
    // node take it; and one reading of the machine's memory gives both the --parallel default
    // and the expert cache's budget.
    let files = stormo_node::node::open_model(&a.model)?;
    let memory = MemoryPlan::read();
    let mut http = a.http.resolve_within(&a.model, &files.cfg, &memory)?;
    if let Some(cfg) = &mut http {
        cfg.prompt_cache = a.http.prompt_cache(&a.experts.state_dir())?;
    }
    anyhow::ensure!(a.per_peer >= 1, "--per-peer must be at least 1");
    anyhow::ensure!(a.max_requests >= 1, "--max-requests must be at least 1");
    anyhow::ensure!(a.exec_per_peer >= 1, "--exec-per-peer must be at least 1");
    anyhow::ensure!(a.exec_max >= 1, "--exec-max must be at least 1");
    anyhow::ensure!(
        a.exec_threads <= 1024,
        "--exec-threads {}: at most 1024",
        a.exec_threads
    );
    // The checks that cost no loading (the tokenizer's) before the node starts.
    let text = match &http {
        Some(cfg) => Some(check_text_model(
            &files,
            cfg.context,
            &LoadOptions::default(),
        )?),
        None => None,
    };
    // The key file is loaded once: for the certificate's check and for the node.
    let (swarm, host) =
        crate::swarm_args::resolve_identity(&a.swarm, a.net.key.as_deref())?.into_host()?;
    let listen = match a.listen {
        Some(addr) => Some(ListenConfig {
            addr,
            serve: serve::ServeConfig {
                per_peer: a.per_peer,
                node_limit: a.max_requests,
                admission: admission(&a, swarm.as_ref())?,
                congestion: a.congestion,
                exec: net::exec::ExecConfig {
                    threads: a.exec_threads,
                    per_peer: a.exec_per_peer,
                    total: a.exec_max,
                },
                // Set by the node, which knows its peer set.
                serving_peers: None,
            },
            replicas: a.replicas,
        }),
        None => None,
    };
    let node = Arc::new(Node::start_on(
        NodeConfig {
            model: a.model.clone(),
            state_dir: a.experts.state_dir(),
            experts: a.experts.resolve()?,
            local: match &a.only_experts {
                Some(spec) => LocalExperts::Only(spec.clone()),
                None => LocalExperts::All,
            },
            // Every request running at once has its own KV cache.
            context: http.as_ref().map_or(1, |c| c.context * c.parallel),
            peers: a.net.resolve(listen.is_some())?,
            listen,
            swarm,
        },
        host.with_memory(memory),
        files,
    )?);
    if let (Some(addr), Some(key), Some(id)) = (node.local_addr(), node.node_key(), node.model_id())
    {
        let held = node.announce().map_or(0, |a| a.held.len());
        eprintln!(
            "serving model {} ({held} experts held) on {addr} as node {key}",
            id.to_hex()
        );
        if let Some(kept) = node.expert_dir() {
            eprintln!("{}", kept.describe());
            if let Some(small) = kept.smallest_record().filter(|&s| kept.limit() < s) {
                tracing::warn!(
                    "--expert-dir-limit {} holds no expert (the smallest is {}): this node \
                     keeps nothing{}",
                    stormo_net::progress::human_bytes(kept.limit()),
                    stormo_net::progress::human_bytes(small),
                    if a.replicas > 0 {
                        " and places no copies (--replicas)"
                    } else {
                        ""
                    }
                );
            }
        } else if a.net.no_keep && a.replicas > 0 && a.listen.is_some() {
            tracing::warn!(
                "--no-keep: this node keeps no experts, so it places no copies of them \
                 (--replicas {} needs kept experts)",
                a.replicas
            );
        }
        // One `KEY@ADDR` line per address a peer can dial (never 0.0.0.0).
        for reachable in stormo_net::discover::reachable_addrs(addr) {
            println!("{key}@{reachable}");
        }
    }
    if a.listen.is_some() && !a.no_warm {
        let n = node.clone();
        std::thread::Builder::new()
            .name("stormo-warm".into())
            .spawn(move || {
                let t = std::time::Instant::now();
                let (count, bytes) = n.warm_cache();
                eprintln!(
                    "warmed the RAM cache: {count} experts ({}) in {:.1} s",
                    stormo_net::progress::human_bytes(bytes),
                    t.elapsed().as_secs_f64()
                );
            })
            .context("starting the warm-up thread")?;
    }
    if let (Some(cfg), Some((tokenizer, format))) = (http, text) {
        // Requests routed to an expert nobody reachable holds would fail: wait (bounded)
        // for the peers to answer first.
        node.keep_peers_dialled();
        node.wait_for_coverage(a.net.wait_coverage());
        // Greedy and sampled requests go through the head's screen (the whole head's tokens);
        // a request that asks for log-probabilities uses the whole head.
        let load = LoadOptions {
            screened_head: !a.full_head,
            ..LoadOptions::default()
        };
        let tm = text_model_on(node.clone(), tokenizer, format, &load)?;
        let name = tm.name.clone();
        let addr = node.start_http(tm, cfg)?;
        eprintln!("serving {name} over HTTP (OpenAI API) at http://{addr}/v1");
        if node.local_addr().is_none() {
            println!("http://{addr}/v1");
        }
    }
    let signal = node.wait_for_shutdown()?;
    eprintln!("{signal}: shutting down (running replies have --shutdown-grace to finish)");
    if let Some(st) = node.serve_stats() {
        eprintln!(
            "served {} requests ({}) over {} connections",
            st.served.load(std::sync::atomic::Ordering::Relaxed),
            stormo_net::progress::human_bytes(st.bytes.load(std::sync::atomic::Ordering::Relaxed)),
            st.connections.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
    if let Some(st) = node.exec_stats() {
        let answered = st.answered.load(std::sync::atomic::Ordering::Relaxed);
        let busy = st.busy.load(std::sync::atomic::Ordering::Relaxed);
        if answered + busy > 0 {
            eprintln!(
                "ran experts for peers: {answered} calls ({} positions), {busy} answered busy",
                st.positions.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
    }
    // The HTTP API first (running replies get --shutdown-grace), then the peers and the server.
    node.close(std::time::Duration::from_secs(2));
    Ok(())
}

/// Who may connect, from `--allow`, `--allow-file`, `--allow-any` and the swarm (`--swarm`).
fn admission(a: &Args, swarm: Option<&SwarmConfig>) -> anyhow::Result<Admission> {
    if let Some(sw) = swarm.filter(|s| s.membership.is_some()) {
        let keys = net::allow_list(&a.allow, a.allow_file.as_deref())?;
        return Ok(sw.admission(&keys, a.allow_any));
    }
    if a.allow_any {
        tracing::warn!("--allow-any: any node may fetch from this one");
        return Ok(Admission::Any);
    }
    let keys = net::allow_list(&a.allow, a.allow_file.as_deref())?;
    if keys.is_empty() {
        match &a.allow_file {
            Some(f) if a.allow.is_empty() => tracing::warn!(
                "--allow-file {} lists no keys and no --allow or --allow-any is given: no \
                 peer can connect",
                f.display()
            ),
            _ => tracing::warn!("no --allow, --allow-file or --allow-any: no peer can connect"),
        }
    }
    // With --allow-file, the file is re-read when it changes (no restart to admit a node).
    if let Some(f) = &a.allow_file {
        let given = net::allow_list(&a.allow, None)?;
        let file = net::tls::RevokedList::load(f)
            .map_err(|e| anyhow::anyhow!("--allow-file {}: {e:#}", f.display()))?;
        return Ok(Admission::Listed {
            keys: given.iter().map(|k| *k.as_bytes()).collect(),
            file: Arc::new(file),
        });
    }
    Ok(Admission::Keys(
        keys.iter().map(|k| *k.as_bytes()).collect(),
    ))
}

/// `--listen` and `--http`: an IP address and port, or a host name that resolves to one
/// (`localhost:4433`: the first address it resolves to).
pub(crate) fn listen_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not HOST:PORT (e.g. 0.0.0.0:4433 or 127.0.0.1:0)"))?;
    port.parse::<u16>()
        .map_err(|_| format!("{s:?}: the port {port:?} is not a number from 0 to 65535"))?;
    std::net::ToSocketAddrs::to_socket_addrs(s)
        .map_err(|e| format!("{s:?}: cannot resolve the host {host:?} ({e})"))?
        .next()
        .ok_or_else(|| format!("{s:?}: the host {host:?} has no address"))
}

#[cfg(test)]
mod tests {
    /// The exec budget's options parse into `Args` with their defaults (1 thread, 8 calls a
    /// peer, 16 in all) and take other values.
    #[test]
    fn exec_options_parse_with_small_defaults() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["stormo", "serve", "--model", "m", "--listen", "127.0.0.1:0"];
            argv.extend_from_slice(extra);
            match crate::cli::Cli::try_parse_args(argv)
                .expect("parses")
                .command
            {
                crate::cli::Command::Serve(a) => (a.exec_threads, a.exec_per_peer, a.exec_max),
                _ => unreachable!("serve parses as serve"),
            }
        };
        assert_eq!(parse(&[]), (1, 8, 16));
        assert_eq!(
            parse(&[
                "--exec-threads",
                "0",
                "--exec-per-peer",
                "2",
                "--exec-max",
                "3"
            ]),
            (0, 2, 3)
        );
    }

    /// `--prompt-cache SIZE` parses like the other sizes and puts the cache in the state
    /// directory's `prompt-cache` folder; 0 or no flag is off; a bad size is refused by name.
    #[test]
    fn prompt_cache_takes_a_size_and_lives_in_the_state_dir() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["stormo", "serve", "--model", "m", "--http", "127.0.0.1:0"];
            argv.extend_from_slice(extra);
            match crate::cli::Cli::try_parse_args(argv)
                .map_err(|e| e.to_string())?
                .command
            {
                crate::cli::Command::Serve(a) => a
                    .http
                    .prompt_cache(std::path::Path::new("/state"))
                    .map_err(|e| format!("{e:#}")),
                _ => unreachable!("serve parses as serve"),
            }
        };
        let on = parse(&["--prompt-cache", "512MiB"]).unwrap().expect("on");
        assert_eq!(on.dir, std::path::Path::new("/state/prompt-cache"));
        assert_eq!(on.limit, 512 << 20);
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(parse(&["--prompt-cache", "0"]).unwrap(), None);
        let e = parse(&["--prompt-cache", "lots"]).unwrap_err();
        assert!(
            e.contains("--prompt-cache") && e.contains("not a size"),
            "{e}"
        );
    }

    /// `--http` takes what `--listen` takes: an address, or a host name that resolves.
    #[test]
    fn http_and_listen_take_host_names() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["stormo", "serve", "--model", "m"];
            argv.extend_from_slice(extra);
            crate::cli::Cli::try_parse_args(argv).map_err(|e| e.to_string())
        };
        for flag in ["--http", "--listen"] {
            for ok in ["127.0.0.1:8080", "localhost:8080", "[::1]:0"] {
                parse(&[flag, ok]).unwrap_or_else(|e| panic!("{flag} {ok}: {e}"));
            }
            for (bad, needle) in [
                ("8080", "is not HOST:PORT"),
                ("localhost:http", "is not a number"),
                ("localhost:70000", "is not a number"),
            ] {
                let err = parse(&[flag, bad]).expect_err(bad);
                assert!(err.contains(needle), "{flag} {bad}: {err}");
            }
        }
    }
}
