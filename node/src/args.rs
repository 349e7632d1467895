//! The command line's shared option groups (clap types live here and in each command's own
//! file, never in library code): each resolves once into the typed configuration of
//! [`stormo_node::config`], which is all the library takes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use stormo_engine::ModelConfig;
use stormo_manifests::{Hash, PublicKey};

use stormo_net::expert_dir::budget::KeepLimit;
use stormo_net::progress::{check_secs, parse_size, secs_arg, size_arg};
use stormo_net::remote::ExecTrust;
use stormo_net::remote_policy::{RemoteConfig, RemoteExec, VerifyExec};
use stormo_net::tier::PeerConfig;
use stormo_net::PeerAddr;
use stormo_node::config::{CacheBudget, ExpertsConfig, KeepConfig, PeersConfig};
use stormo_node::http::HttpConfig;
use stormo_node::memory::MemoryPlan;
use stormo_text::defaults::SamplingDefaults;

/// Options for experts and their tiers.
#[derive(Debug, Clone, clap::Args)]
pub struct ExpertArgs {
    /// RAM budget for cached experts: a size such as 0, 512MiB, 6GiB, or "auto" (the RAM
    /// available, less the dense weights, the KV cache and a reserve for the system). Never less
    /// than one layer's top-k experts, never more than all of them.
    #[arg(long, default_value = "auto", value_name = "SIZE", value_parser = cache_size)]
    pub expert_cache: String,
    /// Threads the engine computes on, 1 to 1024 (default: one per CPU core, or
    /// RAYON_NUM_THREADS).
    #[arg(short = 't', long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub threads: Option<usize>,
    /// Lab switch (hidden; docs/performance.md): prefetch the next layer's predicted experts
    /// into the cache while the current layer computes. Off by default: measured at
    /// gpt-oss-20b geometry with budgets below the experts, it read 38-58% more from disk per
    /// decoded token and decoded 7-17% slower.
    #[arg(long, hide = true, conflicts_with = "no_prefetch")]
    pub prefetch: bool,
    /// Do not prefetch (the default; kept so scripts that say so keep working).
    #[arg(long, hide = true)]
    pub no_prefetch: bool,
    /// Serve experts from memory-mapped checkpoint files instead of the budgeted cache (the OS
    /// pages them in and out; no budget, no statistics).
    #[arg(long, conflicts_with_all = ["expert_cache", "prefetch"])]
    pub mmap_experts: bool,
    /// Threads reading experts from disk (queue depth), 1 to 256.
    #[arg(long, default_value_t = 4, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub io_threads: usize,
    /// Neither preload the most used experts at start nor record usage counts.
    #[arg(long)]
    pub no_hot_store: bool,
    /// Where the node keeps its own files: expert usage counts, kept experts, a manifest it
    /// built for itself (model folders are never written). Default: $XDG_STATE_HOME/stormo or
    /// ~/.local/state/stormo.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

impl ExpertArgs {
    /// The typed settings (sizes parsed once, here).
    pub fn resolve(&self) -> anyhow::Result<ExpertsConfig> {
        let cache = if self.expert_cache.trim().eq_ignore_ascii_case("auto") {
            CacheBudget::Auto
        } else {
            CacheBudget::Bytes(
                parse_size(&self.expert_cache)
                    .map_err(|e| anyhow::anyhow!("--expert-cache: {e}"))?,
            )
        };
        Ok(ExpertsConfig {
            cache,
            prefetch: self.prefetch && !self.no_prefetch,
            mmap: self.mmap_experts,
            io_threads: self.io_threads.max(1),
            hot_store: !self.no_hot_store,
            threads: self.threads,
        })
    }

    /// The state directory: `--state-dir`, or the default.
    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(stormo_node::config::default_state_dir)
    }
}

/// `--expert-cache` as given, if it is "auto" or a size [`parse_size`] reads: checked when the
/// arguments are parsed, so a bad value is reported before any work starts.
fn cache_size(s: &str) -> Result<String, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(s.to_owned());
    }
    size_arg(s).map_err(|e| format!("{e}, or auto"))
}

/// A count (a whole number, 0 or more), with an error that says what is wrong with it.
pub fn count_arg(s: &str) -> Result<usize, String> {
    whole(s)
}

/// A 64-bit whole number, 0 or more (a seed), with an error that says what is wrong with it.
pub fn u64_arg(s: &str) -> Result<u64, String> {
    whole(s)
}

fn whole<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    let t = s.trim();
    t.parse().map_err(|_| {
        if t.starts_with('-') {
            format!("{s:?} is negative: give a whole number, 0 or more")
        } else if t.parse::<f64>().is_ok() {
            format!("{s:?} is too large or not a whole number")
        } else {
            format!("{s:?} is not a whole number (0 or more)")
        }
    })
}

/// `--expert-dir-limit` as given, if it is "auto" or a size [`parse_size`] reads.
fn limit_arg(s: &str) -> Result<String, String> {
    cache_size(s)
}

/// Options of a node that fetches from peers (shared by `run` and `pull`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PeerArgs {
    /// A peer to fetch experts (or the manifest) from, as KEY@HOST:PORT: its 64-hex node key
    /// and address. Repeatable.
    #[arg(long = "peer", value_name = "KEY@HOST:PORT")]
    pub peers: Vec<PeerAddr>,
    /// This node's secret key (from `stormo key generate`), which peers allow-list. Without
    /// it an ephemeral key is used.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Accept a manifest signed by this publisher key (64 hex; the signature is read from
    /// beside the manifest, stormo-manifest.sig). Repeatable.
    #[arg(long, value_name = "PUBKEY")]
    pub trust: Vec<PublicKey>,
    /// Accept only the manifest with this model id (64 hex, as `stormo manifest build`
    /// prints).
    #[arg(long, value_name = "ID")]
    pub model_id: Option<Hash>,
    /// The manifest file, if not DIR/stormo-manifest.bin. When it does not exist and peers
    /// are given, the manifest is fetched from a peer (and checked the same way).
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Seconds a peer may take to answer one expert request, from when it is sent, before
    /// another peer is tried (a connection attempt gets at most 3 s, or this if shorter). A
    /// peer that cannot be connected to is then not tried again for a back-off (1 s, doubling
    /// up to 60 s). A peer still sending when its time is up is slow, not failing: the try at
    /// the last holder left is let run while each such period verifies more of the expert,
    /// and once every holder has been tried another round follows, resuming after the
    /// verified bytes with twice the time (up to 8 times this). A load ends after four rounds
    /// that verify nothing (busy answers aside), or once it has run 32 times this (no later
    /// try starts or runs on past that); the tiers below then take over. At most 1e6.
    #[arg(
        long,
        default_value_t = 30.0,
        value_name = "SECS",
        value_parser = secs_arg
    )]
    pub peer_timeout: f64,
    /// Also keep the verified experts fetched from peers in this directory (one file per
    /// expert under a folder named by the model id, written atomically, verified again when
    /// read), so later runs find them there: a tier between the local disk and the peers.
    #[arg(long, value_name = "DIR")]
    pub expert_dir: Option<PathBuf>,
    /// The most the kept experts may hold for this model (beyond it, least recently used
    /// experts are evicted; on a serving node that places copies, --replicas chooses what to
    /// keep and evict instead), e.g. 20GiB, or `auto`: half the free space of their filesystem, at most the
    /// model's experts. Read again before each write; a full disk stops the keeping (one
    /// warning) and serving goes on. Given without --expert-dir, experts are kept in the
    /// state directory. Default: auto.
    #[arg(long, value_name = "SIZE", value_parser = limit_arg)]
    pub expert_dir_limit: Option<String>,
    /// Do not keep verified experts fetched from peers (a serving node keeps them by default,
    /// in the state directory, and serves them to others; see --expert-dir). Wins over an
    /// --expert-dir-limit from a config file or variable; with --expert-dir-limit on the
    /// command line too, it is refused as a contradiction.
    #[arg(long, conflicts_with = "expert_dir")]
    pub no_keep: bool,
    /// Ask peers before the local disk (for a slow local disk or when peers hold the experts
    /// in RAM): the local disk becomes the fallback, and races slow peer answers.
    #[arg(long, requires = "peers")]
    pub peers_first: bool,
    /// Whether an expert a peer holds may be computed by that peer on the rows routed to it
    /// (a few KB each way) instead of fetched (MBs): `auto` chooses per expert and block from
    /// the link's measured round trip and throughput, how often the expert is used and
    /// whether it is cached; `always` asks a holder whenever one can take the call; `never`
    /// always fetches. The output is the same bits either way.
    #[arg(long, default_value_t = RemoteExec::Auto, value_name = "auto|always|never")]
    pub remote_exec: RemoteExec,
    /// Which peers may compute experts for this node: by default only members of this
    /// node's swarm (`--swarm`); `any` lets every peer compute (each one's results
    /// spot-checked: a peer lying now and then gets each lie past the checks with probability
    /// 1 - the --spot-check share); a 64-hex node key lets that peer. Repeatable, or
    /// comma-separated. Fetched experts are verified whoever sends them.
    #[arg(long, value_name = "any|KEY", value_delimiter = ',')]
    pub exec_trust: Vec<String>,
    /// The share of remote results also computed here and compared bit for bit (every call
    /// sent to a peer before its first answer always is); a peer whose result differs is not
    /// asked again this session, and the tokens made with its unchecked results are made
    /// again. 0 checks only each peer's first answer: a warning says so.
    #[arg(long, default_value_t = 0.05, value_name = "FRACTION", value_parser = fraction_arg)]
    pub spot_check: f64,
    /// Hold each step back until its spot-checks end. By default `run` and `chat` use a
    /// checked result at once and check it in the background (the expert fetched meanwhile),
    /// showing a token only once its checks agree, and on a disagreement generate again from
    /// the step that used the wrong result: the same tokens, without a slow link's fetch in
    /// every checked token. `serve --http` does the same for its batched requests (a client
    /// is sent only checked tokens), and `bench` defers its decoded tokens' checks.
    #[arg(long)]
    pub spot_check_inline: bool,
    /// `dual`: two holders compute each remote call and their rows are compared bit for bit;
    /// a disagreement is settled here (the expert computed locally) and the holder that was
    /// wrong is not asked again. Twice the peers' work and rows for every call; spot-checks
    /// apply on top. With one holder left, a call goes to it alone. Default: single.
    #[arg(long, default_value_t = VerifyExec::Single, value_name = "single|dual")]
    pub verify_exec: VerifyExec,
    /// Seconds `run`, `chat` and `serve --http` wait at start, with --discover, until every
    /// expert has a reachable holder (peers found by discovery answer a moment after they
    /// are found); then they start anyway, saying how many experts are uncovered. 0: do not
    /// wait.
    #[arg(long, default_value_t = 5.0, value_name = "SECS", value_parser = secs_arg)]
    pub wait_coverage: f64,
}

impl PeerArgs {
    /// `--wait-coverage` as a duration.
    pub fn wait_coverage(&self) -> Duration {
        Duration::from_secs_f64(self.wait_coverage)
    }

    /// `--exec-trust` resolved: `any` (alone), or node keys.
    pub fn exec_trust(&self) -> anyhow::Result<ExecTrust> {
        let mut keys = Vec::new();
        let mut any = false;
        for w in self
            .exec_trust
            .iter()
            .map(|w| w.trim())
            .filter(|w| !w.is_empty())
        {
            if w.eq_ignore_ascii_case("any") {
                any = true;
            } else {
                keys.push(w.parse::<PublicKey>().map_err(|e| {
                    anyhow::anyhow!("--exec-trust {w:?}: not `any` nor a node key (64 hex): {e}")
                })?);
            }
        }
        match (any, keys.is_empty()) {
            (true, false) => anyhow::bail!(
                "--exec-trust: `any` already lets every peer compute; drop the keys or `any`"
            ),
            (true, true) => Ok(ExecTrust::Any),
            (false, _) => Ok(ExecTrust::Members(keys)),
        }
    }

    /// The timeouts these options give.
    pub fn timeouts(&self) -> anyhow::Result<PeerConfig> {
        let t =
            check_secs(self.peer_timeout).map_err(|e| anyhow::anyhow!("--peer-timeout: {e}"))?;
        Ok(PeerConfig::with_timeout(Duration::from_secs_f64(t)))
    }

    /// The typed settings. `keep_by_default`: a node that serves keeps what it fetches (in
    /// the state directory) unless `--no-keep`; any node keeps when given `--expert-dir` or
    /// `--expert-dir-limit`.
    pub fn resolve(&self, keep_by_default: bool) -> anyhow::Result<PeersConfig> {
        let limit = match self.expert_dir_limit.as_deref() {
            None => KeepLimit::Auto,
            Some(s) if s.trim().eq_ignore_ascii_case("auto") => KeepLimit::Auto,
            Some(s) => KeepLimit::Bytes(
                parse_size(s).map_err(|e| anyhow::anyhow!("--expert-dir-limit: {e}"))?,
            ),
        };
        let asked = keep_by_default || self.expert_dir_limit.is_some();
        let keep = match (&self.expert_dir, asked && !self.no_keep) {
            (Some(d), _) => Some(KeepConfig {
                dir: Some(d.clone()),
                limit,
            }),
            (None, true) => Some(KeepConfig { dir: None, limit }),
            (None, false) => None,
        };
        Ok(PeersConfig {
            peers: self.peers.clone(),
            key: self.key.clone(),
            trust: self.trust.clone(),
            model_id: self.model_id,
            manifest: self.manifest.clone(),
            timeouts: self.timeouts()?,
            keep,
            peers_first: self.peers_first,
            exec_trust: self.exec_trust()?,
            remote: RemoteConfig {
                mode: self.remote_exec,
                spot_check: self.spot_check,
                inline: self.spot_check_inline,
                verify: self.verify_exec,
            },
        })
    }
}

/// A share in [0, 1] (`--spot-check`).
fn fraction_arg(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number (a share such as 0.05)"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{s} is not a share between 0 and 1"))
    }
}

/// Options of the HTTP API (`stormo serve --http`).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Serve an OpenAI-compatible HTTP API here, e.g. 127.0.0.1:8080 or localhost:8080. Only
    /// requests whose Host header names this address (or an --allowed-host) are served.
    #[arg(long, value_name = "ADDR", value_parser = crate::cmd::serve::listen_addr)]
    pub http: Option<SocketAddr>,
    /// The name the API serves the model under (repeatable: every name works in requests,
    /// GET /v1/models lists them all, replies carry the first). Default: the model folder's
    /// name.
    #[arg(long, visible_alias = "served-model-name", value_name = "NAME")]
    pub alias: Vec<String>,
    /// Requests that may wait while --parallel run; more get HTTP 429.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub http_queue: usize,
    /// Requests generated together (continuous batching: one forward per step over all of
    /// them, each expert read once for every request routed to it), each with its own KV
    /// cache of --context positions. Default: as many as a quarter of the available RAM
    /// holds caches for, 1 to 4.
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=stormo_node::http::MAX_PARALLEL as u64))]
    pub parallel: Option<usize>,
    /// Largest request body accepted, in bytes (larger: HTTP 413).
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES")]
    pub http_max_body: usize,
    /// Positions of each request's KV cache (prompt and reply); longer prompts get 400.
    #[arg(
        short = 'c',
        long = "context",
        alias = "http-context",
        default_value_t = 4096,
        value_name = "N"
    )]
    pub http_context: usize,
    /// How long a client may take to send a request's headers (also how long an idle
    /// keep-alive connection is kept), then its body, or to take the next part of a reply;
    /// past it the connection is closed (a body too slow: HTTP 408). At most 1e6.
    #[arg(
        long,
        default_value_t = stormo_node::http::DEFAULT_TIMEOUT.as_secs_f64(),
        value_name = "SECS",
        value_parser = stormo_net::progress::secs_arg
    )]
    pub http_timeout: f64,
    /// Connections open at once; more are answered HTTP 503 and closed.
    #[arg(long, default_value_t = stormo_node::http::DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    pub http_max_connections: usize,
    /// Connections one client IP address may have open at once; more from it are answered
    /// HTTP 503 and closed. At least 1; at or above --http-max-connections, only that cap
    /// applies. Behind a proxy every client has the proxy's address: raise it to
    /// --http-max-connections there.
    #[arg(long, default_value_t = stormo_node::http::DEFAULT_MAX_PER_CLIENT, value_name = "N")]
    pub http_max_per_client: usize,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (wrong or missing:
    /// HTTP 401). Also read from the STORMO_API_KEY environment variable, which, unlike a
    /// command-line argument, other users of the machine cannot see.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Serve /metrics without --api-key's key (for a Prometheus scraper that holds none;
    /// the counters show request rates and queue lengths, never prompts or keys).
    #[arg(long)]
    pub metrics_public: bool,
    /// Also serve requests whose Host header is this name (repeatable; `*`: any). Without it
    /// only the listen address is accepted (for a loopback address also `localhost`; for
    /// 0.0.0.0 or :: any IP address), so that a web page cannot reach the server through a
    /// name it controls (DNS rebinding). Give the names clients use, e.g. the machine's.
    #[arg(long, value_name = "NAME")]
    pub allowed_host: Vec<String>,
    /// Let web pages from this origin (e.g. http://localhost:3000; repeatable; `*`: any) call
    /// the API (CORS). Without it a request from a browser page (one with an Origin header)
    /// is refused with HTTP 403.
    #[arg(long, value_name = "ORIGIN")]
    pub cors: Vec<String>,
    /// On SIGTERM or Ctrl-C: stop accepting connections, let running replies finish for up
    /// to this long, then cut the rest cleanly (a stream ends with an error event and
    /// `[DONE]`) and exit. At most 1e6.
    #[arg(
        long,
        default_value_t = stormo_node::http::DEFAULT_SHUTDOWN_GRACE.as_secs_f64(),
        value_name = "SECS",
        value_parser = stormo_net::progress::secs_arg
    )]
    pub shutdown_grace: f64,
    /// Keep the KV cache of the prompts served on disk, in --state-dir's prompt-cache folder,
    /// at most SIZE in all (e.g. 2GiB; least recently used out first): a request whose prompt
    /// starts as an earlier one did (a conversation's next turn, a shared system prompt), also
    /// after a restart, loads that prefix in chunks of 64 tokens instead of computing it, and
    /// gets the same reply. For gpt-oss-20b a token takes 96 KiB. Default: off (0).
    #[arg(long, value_name = "SIZE", value_parser = size_arg)]
    pub prompt_cache: Option<String>,
}

impl HttpArgs {
    /// The prompt cache (`--prompt-cache`) in the state directory `state_dir`, if asked for.
    pub fn prompt_cache(
        &self,
        state_dir: &Path,
    ) -> anyhow::Result<Option<stormo_node::http::PromptCacheConfig>> {
        let Some(size) = &self.prompt_cache else {
            return Ok(None);
        };
        let limit = parse_size(size).map_err(|e| anyhow::anyhow!("--prompt-cache: {e}"))?;
        Ok((limit > 0).then(|| stormo_node::http::PromptCacheConfig {
            dir: state_dir.join("prompt-cache"),
            limit,
        }))
    }

    /// [`Self::resolve_within`] a plan of the machine's memory read here. A command that also
    /// starts a node reads one [`MemoryPlan`] for both (the expert cache's budget: the node's
    /// host carries it, [`stormo_node::node::Host::with_memory`]) and calls
    /// [`Self::resolve_within`].
    pub fn resolve(&self, model: &Path, cfg: &ModelConfig) -> anyhow::Result<Option<HttpConfig>> {
        self.resolve_within(model, cfg, &MemoryPlan::read())
    }

    /// The settings, if `--http` was given, for the model in `model` whose config.json the
    /// command read into `cfg` (its generation_config.json gives the default sampling; without
    /// --parallel, its KV cache's size and `memory` set how many requests run together:
    /// [`MemoryPlan::parallel`]).
    pub fn resolve_within(
        &self,
        model: &Path,
        cfg: &ModelConfig,
        memory: &MemoryPlan,
    ) -> anyhow::Result<Option<HttpConfig>> {
        let Some(addr) = self.http else {
            return Ok(None);
        };
        anyhow::ensure!(self.http_context >= 2, "--context must be at least 2");
        anyhow::ensure!(
            self.http_max_body >= 64,
            "--http-max-body must be at least 64"
        );
        let timeout =
            check_secs(self.http_timeout).map_err(|e| anyhow::anyhow!("--http-timeout: {e}"))?;
        anyhow::ensure!(
            (1..=stormo_node::http::MAX_CONNECTIONS).contains(&self.http_max_connections),
            "--http-max-connections must be between 1 and {}",
            stormo_node::http::MAX_CONNECTIONS
        );
        anyhow::ensure!(
            self.http_max_per_client >= 1,
            "--http-max-per-client must be at least 1 (to leave only --http-max-connections, \
             give it that value)"
        );
        let grace = check_secs(self.shutdown_grace)
            .map_err(|e| anyhow::anyhow!("--shutdown-grace: {e}"))?;
        let api_key = match &self.api_key {
            Some(k) => Some(k.clone()),
            None => std::env::var("STORMO_API_KEY").ok(),
        };
        if let Some(k) = &api_key {
            anyhow::ensure!(
                !k.trim().is_empty() && !k.chars().any(|c| c.is_whitespace() || c.is_control()),
                "the API key (--api-key or STORMO_API_KEY) must be non-empty, without spaces or \
                 control characters"
            );
        }
        for n in &self.alias {
            anyhow::ensure!(
                !n.trim().is_empty() && n.len() <= 256 && !n.chars().any(char::is_control),
                "--alias {n:?}: give a non-empty name of at most 256 bytes"
            );
        }
        for h in &self.allowed_host {
            anyhow::ensure!(
                !h.is_empty() && !h.contains(['/', ' ']),
                "--allowed-host {h:?}: give a host name or address, without a scheme or path"
            );
        }
        let parallel = match self.parallel {
            Some(n) => n,
            None => memory.parallel(stormo_node::memory::kv_cache_bytes(cfg, self.http_context)),
        };
        Ok(Some(
            HttpConfig {
                addr,
                aliases: self.alias.clone(),
                queue: self.http_queue,
                parallel,
                max_body: self.http_max_body,
                context: self.http_context,
                timeout: Duration::from_secs_f64(timeout),
                max_connections: self.http_max_connections,
                max_per_client: self.http_max_per_client,
                api_key,
                metrics_public: self.metrics_public,
                allowed_hosts: self.allowed_host.clone(),
                cors: self.cors.clone(),
                shutdown_grace: Duration::from_secs_f64(grace),
                sampling: SamplingDefaults::default(),
                health: Vec::new(),
                prompt_cache: None,
            }
            .with_model_defaults(model),
        ))
    }
}

/// A clap value parser for `--congestion` that lists the choices in `--help`
/// ([`stormo_net::tls::Congestion`] knows nothing of clap).
pub fn congestion_arg() -> impl clap::builder::TypedValueParser<Value = stormo_net::tls::Congestion>
{
    use clap::builder::TypedValueParser as _;
    use stormo_net::tls::Congestion;
    clap::builder::PossibleValuesParser::new(
        Congestion::ALL.map(|c| clap::builder::PossibleValue::new(c.name())),
    )
    .map(|s| {
        Congestion::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .expect("the parser admits only these names")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormo_net::CONNECT_TIMEOUT;

    /// `--remote-exec` and `--spot-check` resolve into the peers' configuration (default
    /// auto and 0.05); a mode or share out of range is refused naming it.
    #[test]
    fn remote_exec_options_resolve_and_refuse_what_is_wrong() {
        #[derive(Debug, clap::Parser)]
        struct T {
            #[command(flatten)]
            p: PeerArgs,
        }
        use clap::Parser;
        let parse = |args: &[&str]| {
            let mut v = vec!["t"];
            v.extend_from_slice(args);
            T::try_parse_from(v).map(|t| t.p)
        };
        let c = parse(&[]).unwrap().resolve(false).unwrap();
        assert_eq!(c.remote, RemoteConfig::default());
        assert_eq!(c.remote.mode, RemoteExec::Auto);
        assert_eq!(c.remote.spot_check, 0.05);
        let c = parse(&["--remote-exec", "always", "--spot-check", "1"])
            .unwrap()
            .resolve(false)
            .unwrap();
        assert_eq!(
            c.remote,
            RemoteConfig {
                mode: RemoteExec::Always,
                spot_check: 1.0,
                inline: false,
                verify: Default::default(),
            }
        );
        for (args, named) in [
            (&["--remote-exec", "sometimes"][..], "sometimes"),
            (&["--spot-check", "1.5"][..], "1.5"),
            (&["--spot-check=-0.1"][..], "-0.1"),
            (&["--spot-check", "NaN"][..], "NaN"),
            (&["--spot-check", "many"][..], "many"),
            (&["--verify-exec", "triple"][..], "triple"),
        ] {
            let e = parse(args).unwrap_err().to_string();
            assert!(e.contains(named), "{args:?}: {e}");
        }
        let c = parse(&["--verify-exec", "dual"]).unwrap().resolve(false);
        assert_eq!(c.unwrap().remote.verify, VerifyExec::Dual);
        // Who may compute: swarm members by default, `any`, or keys (repeated or listed).
        assert_eq!(c_trust(&parse(&[]).unwrap()), Ok(ExecTrust::default()));
        assert_eq!(
            c_trust(&parse(&["--exec-trust", "any"]).unwrap()),
            Ok(ExecTrust::Any)
        );
        let (a, b) = (
            stormo_manifests::SecretKey::from_seed(&[1; 32]).public(),
            stormo_manifests::SecretKey::from_seed(&[2; 32]).public(),
        );
        let (a_hex, b_hex) = (a.to_string(), b.to_string());
        let both = format!("{a_hex},{b_hex}");
        assert_eq!(
            c_trust(&parse(&["--exec-trust", &both]).unwrap()),
            Ok(ExecTrust::Members(vec![a, b]))
        );
        assert_eq!(
            c_trust(&parse(&["--exec-trust", &a_hex, "--exec-trust", &b_hex]).unwrap()),
            Ok(ExecTrust::Members(vec![a, b]))
        );
        for (bad, named) in [
            (format!("any,{a_hex}"), "drop the keys or `any`"),
            ("everyone".to_string(), "\"everyone\""),
        ] {
            let e = c_trust(&parse(&["--exec-trust", &bad]).unwrap()).unwrap_err();
            assert!(e.contains(named), "{bad}: {e}");
        }
    }

    fn c_trust(p: &PeerArgs) -> Result<ExecTrust, String> {
        p.exec_trust().map_err(|e| e.to_string())
    }

    /// `--peer-timeout` bounds a whole try, so a connection attempt never gets more than it
    /// (it once always got 3 s).
    #[test]
    fn peer_timeout_bounds_the_connect_timeout() {
        let args = |t: f64| PeerArgs {
            peer_timeout: t,
            ..PeerArgs::default()
        };
        let c = args(1.0).timeouts().unwrap();
        assert_eq!(c.connect_timeout, Duration::from_secs(1));
        assert_eq!(c.request_timeout, Duration::from_secs(1));
        let c = args(30.0).timeouts().unwrap();
        assert_eq!(c.connect_timeout, CONNECT_TIMEOUT);
        assert_eq!(c.request_timeout, Duration::from_secs(30));
        assert_eq!(c.idle_timeout, Duration::from_secs(5));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e18] {
            assert!(args(bad).timeouts().is_err(), "{bad} accepted");
        }
    }

    /// A serving node keeps what it fetches in the state directory unless told not to; an
    /// `--expert-dir` is kept wherever it is.
    #[test]
    fn keeping_follows_the_role_and_the_flags() {
        let base = PeerArgs {
            peer_timeout: 30.0,
            ..PeerArgs::default()
        };
        assert_eq!(base.resolve(false).unwrap().keep, None);
        let k = base.resolve(true).unwrap().keep.unwrap();
        assert_eq!((k.dir, k.limit), (None, KeepLimit::Auto));
        // A limit alone asks for keeping, in the state directory, bounded by it.
        let limited = PeerArgs {
            expert_dir_limit: Some("1GiB".into()),
            ..base.clone()
        };
        let k = limited.resolve(false).unwrap().keep.unwrap();
        assert_eq!((k.dir, k.limit), (None, KeepLimit::Bytes(1 << 30)));
        let auto = PeerArgs {
            expert_dir_limit: Some("auto".into()),
            ..base.clone()
        };
        assert_eq!(
            auto.resolve(false).unwrap().keep.unwrap().limit,
            KeepLimit::Auto
        );
        let limited_no = PeerArgs {
            no_keep: true,
            ..limited
        };
        assert_eq!(limited_no.resolve(true).unwrap().keep, None);
        let no = PeerArgs {
            no_keep: true,
            ..base.clone()
        };
        assert_eq!(no.resolve(true).unwrap().keep, None);
        let d = PeerArgs {
            expert_dir: Some("/x".into()),
            ..base
        };
        assert_eq!(
            d.resolve(false).unwrap().keep.unwrap().dir,
            Some("/x".into())
        );
    }

    /// A gpt-oss-20b: 96 KiB of KV cache a position.
    fn gpt_oss() -> ModelConfig {
        ModelConfig::from_json_str(
            stormo_engine::config::GPT_OSS_20B_CONFIG,
            Path::new("config.json"),
        )
        .expect("config.json")
    }

    fn args() -> HttpArgs {
        HttpArgs {
            http: Some("127.0.0.1:0".parse().expect("addr")),
            alias: Vec::new(),
            http_queue: 8,
            parallel: Some(1),
            http_max_body: 1 << 20,
            http_context: 4096,
            http_timeout: stormo_node::http::DEFAULT_TIMEOUT.as_secs_f64(),
            http_max_connections: stormo_node::http::DEFAULT_MAX_CONNECTIONS,
            http_max_per_client: stormo_node::http::DEFAULT_MAX_PER_CLIENT,
            api_key: None,
            metrics_public: false,
            allowed_host: Vec::new(),
            cors: Vec::new(),
            shutdown_grace: stormo_node::http::DEFAULT_SHUTDOWN_GRACE.as_secs_f64(),
            prompt_cache: None,
        }
    }

    #[test]
    fn config_checks_the_timeout_and_connection_caps() {
        let cfg = args()
            .resolve(Path::new("m"), &gpt_oss())
            .expect("defaults")
            .expect("--http given");
        assert_eq!(cfg.timeout, stormo_node::http::DEFAULT_TIMEOUT);
        assert_eq!(
            cfg.max_connections,
            stormo_node::http::DEFAULT_MAX_CONNECTIONS
        );
        assert_eq!(
            cfg.max_per_client,
            stormo_node::http::DEFAULT_MAX_PER_CLIENT
        );
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e18] {
            let a = HttpArgs {
                http_timeout: t,
                ..args()
            };
            let e = a
                .resolve(Path::new("m"), &gpt_oss())
                .expect_err("a bad timeout is refused");
            assert!(e.to_string().contains("--http-timeout"), "{t}: {e}");
        }
        for n in [0, stormo_node::http::MAX_CONNECTIONS + 1, usize::MAX] {
            let a = HttpArgs {
                http_max_connections: n,
                ..args()
            };
            let e = a
                .resolve(Path::new("m"), &gpt_oss())
                .expect_err("a bad cap is refused");
            assert!(e.to_string().contains("--http-max-connections"), "{n}: {e}");
        }
        let a = HttpArgs {
            http_max_per_client: 0,
            ..args()
        };
        let e = a
            .resolve(Path::new("m"), &gpt_oss())
            .expect_err("a per-client cap of 0 is refused");
        assert!(e.to_string().contains("--http-max-per-client"), "{e}");
        // Above the cap in all: accepted, and only that cap applies (see conn.rs).
        for n in [
            1,
            stormo_node::http::DEFAULT_MAX_CONNECTIONS,
            stormo_node::http::DEFAULT_MAX_CONNECTIONS + 1,
            usize::MAX,
        ] {
            let a = HttpArgs {
                http_max_per_client: n,
                ..args()
            };
            let cfg = a
                .resolve(Path::new("m"), &gpt_oss())
                .expect("accepted")
                .expect("--http given");
            assert_eq!(cfg.max_per_client, n);
        }
    }

    /// Without --parallel, the number of requests run together divides the memory plan the
    /// command read (a quarter of it in KV caches of --context positions, 1 to 4); given, it
    /// is taken as is.
    #[test]
    fn the_parallel_default_comes_from_the_memory_plan() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = gpt_oss();
        // 96 KiB a position: 384 MiB a cache of 4096 positions.
        let gib = 1u64 << 30;
        let a = HttpArgs {
            parallel: None,
            ..args()
        };
        for (avail, parallel) in [(Some(16 * gib), 4), (Some(4 * gib), 2), (Some(gib), 1)] {
            let cfg = a
                .resolve_within(dir.path(), &model, &MemoryPlan::new(avail))
                .expect("resolves")
                .expect("--http given");
            assert_eq!(cfg.parallel, parallel, "{avail:?}");
        }
        let given = args()
            .resolve_within(dir.path(), &model, &MemoryPlan::new(Some(64 * gib)))
            .expect("resolves")
            .expect("--http given");
        assert_eq!(given.parallel, 1);
    }

    /// A negative or non-numeric per-client cap is refused by the command line, naming the
    /// option.
    #[test]
    fn the_per_client_cap_is_a_number() {
        for v in ["-1", "x", "1.5"] {
            let e = crate::cli::Cli::try_parse_args([
                "stormo",
                "serve",
                "--model",
                "m",
                "--http",
                "127.0.0.1:0",
                "--http-max-per-client",
                v,
            ])
            .expect_err("refused")
            .to_string();
            assert!(
                e.contains(&format!("invalid value '{v}' for '--http-max-per-client")),
                "{v}: {e}"
            );
        }
    }
}
