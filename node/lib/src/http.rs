//! An OpenAI-compatible HTTP API for people and their tools: `POST /v1/chat/completions`,
//! `POST /v1/completions` (both with server-sent-event streaming), `GET /v1/models`, and for
//! operators `GET /health` and `GET /metrics` (Prometheus text format, see `http/metrics.rs`).
//!
//! Owns: parsing requests (bounded body, every malformed input a 400 in OpenAI's error shape,
//! never a panic; only a request hyper cannot parse at all, such as a garbage request line or
//! oversized headers, gets hyper's own bodiless 400, 414 or 431: hyper 1.x writes that
//! response itself and has no hook to give it a body), who may call (`http/guard.rs`: the
//! `Host` check against DNS rebinding, CORS origins, the API key), rendering chat requests
//! through the model's chat format, queueing, streaming replies, and shutting down
//! gracefully. Connections are capped, in all
//! and per client address, and timed (see `http/conn.rs`): a client that stalls sending a
//! request or taking a reply, or keeps an idle connection open, loses it after
//! `--http-timeout`. One engine thread runs up to `parallel` requests together, one forward
//! per step over all of them (continuous batching, see `http/batch.rs`), each token the one
//! the request would get alone; requests beyond `queue` waiting ones get 429 with
//! `Retry-After`. Because clients send the whole conversation every time, a request takes the
//! slot whose KV cache holds the longest common prefix and computes only the rest (as
//! [`stormo_text::session`] does). With `--prompt-cache SIZE` the prompts' KV caches are also
//! kept on disk, in the state directory, across restarts (`http/prompt_cache.rs`); a reply
//! says how many prompt tokens came from a cache in `usage.prompt_tokens_details.cached_tokens`.
//!
//! An honest API: a malformed field is refused with a 400 whose `param` names it and whose
//! message says what it must be (`http/request.rs` checks each field the server reads before
//! serde sees the body); what is not implemented is refused with a 400 naming the field (`tools`,
//! `functions`, `tool_choice` other than `none`/`auto`, `response_format` other than text,
//! `echo`, `suffix`, `n` > 1), never silently ignored; fields this server does not know are
//! named in a warning log line. `logprobs`/`top_logprobs` are the model's own distribution:
//! `log_softmax` of the whole output head's logits before penalty, temperature, top-k and
//! top-p, so when they are asked the screened head (an 8-bit copy of the head that finds the
//! greedy token, or the sampled one, computing only the rows that can matter) is not used for
//! that request. The sampling a request leaves out comes from the model folder's
//! `generation_config.json` (see [`stormo_text::defaults`]), else OpenAI's defaults.
//!
//! SIGTERM or Ctrl-C (see [`shutdown_signal`] and [`HttpServer::shutdown`]): the listener
//! closes, `/health` answers 503, idle keep-alive connections close, requests still waiting
//! for a slot are refused with 503 at once (a stream sends its head only once its request
//! runs, so a waiting one can still be refused so), running replies may finish within the
//! grace period; past it they are cut cleanly (a stream gets an error event and
//! `data: [DONE]`, a whole reply a 503), then the server returns.
//!
//! Why hyper and not axum/tower: the server has five routes, and what it needs beyond
//! routing does not exist as tower layers in the shape needed: the connection caps act
//! before a request exists (on accepted sockets), the write-stall timeout wraps the socket,
//! graceful shutdown is hyper's own `graceful_shutdown` on each connection, and the guard
//! answers in OpenAI's JSON error shape (tower-http's CORS and auth layers answer in theirs
//! and would not refuse a foreign `Origin`, which is what stops a web page from driving the
//! server). axum would add a router, extractors and a layer stack to reach the same hyper
//! calls; the hand-written dispatch (`route`) is one `match`.
//!
//! Non-goals: `n > 1`, tools/function calling, structured output, TLS.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use anyhow::Context;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use serde_json::{json, Value};
use stormo_engine::sampling::SamplingParams;
use tokio::sync::mpsc;

use crate::experts::Experts;
use crate::text_model::TextModel;
use stormo_text::defaults::SamplingDefaults;
use stormo_text::reply::ReplyStream;
use stormo_text::session::{GenerateOptions, Generation, TokenLogprobs, MAX_TOP_LOGPROBS};
use stormo_text::{
    harmony::ReasoningEffort, ChatFormat, OutputDelta, PromptOptions, TokenId, Tokenizer, Turn,
    TurnRole,
};

mod answer;
mod batch;
mod conn;
mod guard;
mod metrics;
mod prompt_cache;
mod request;
mod stop;

use answer::{now_s, Kind, Reply};
pub use batch::{default_parallel, MAX_PARALLEL};
pub use conn::{DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_CLIENT, DEFAULT_TIMEOUT};
use metrics::Metrics;
pub use prompt_cache::PromptCacheConfig;
use request::{prompt_ids, read_json, settings, turns_of};
use stop::StopMatcher;

/// How long running replies may take to finish after SIGTERM, by default.
pub const DEFAULT_SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// An extra check of `/health`: `Err` with the reason when the server cannot serve (e.g. a
/// peer it needs is unreachable). Called on every `/health` request, so it must be quick.
#[derive(Clone)]
pub struct HealthCheck(pub Arc<dyn Fn() -> Result<(), String> + Send + Sync>);

impl std::fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HealthCheck(..)")
    }
}

/// The server's settings.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Where to listen.
    pub addr: SocketAddr,
    /// The names the model is served under (`--alias`; empty: the model's own name). Replies
    /// carry the first.
    pub aliases: Vec<String>,
    /// Requests that may wait while `parallel` run.
    pub queue: usize,
    /// Requests generated together (continuous batching), each with its own KV cache of
    /// `context` positions.
    pub parallel: usize,
    /// Largest request body.
    pub max_body: usize,
    /// Positions of the session.
    pub context: usize,
    /// How long a client may take to send a request's headers (or keep a connection idle),
    /// then its body, or to take the next part of a reply.
    pub timeout: std::time::Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections one client address may have open at once (at least 1; at or above
    /// `max_connections`, only that cap applies).
    pub max_per_client: usize,
    /// The key every request but `/health` must give as a Bearer token.
    pub api_key: Option<String>,
    /// `/metrics` is served without the key (`--metrics-public`), for a scraper that holds
    /// none.
    pub metrics_public: bool,
    /// Host names served besides the listen address (`*`: any).
    pub allowed_hosts: Vec<String>,
    /// Origins allowed to call from a browser (`*`: any).
    pub cors: Vec<String>,
    /// How long running replies may take to finish on shutdown.
    pub shutdown_grace: std::time::Duration,
    /// Sampling for what a request leaves out (the model's generation_config.json).
    pub sampling: SamplingDefaults,
    /// Extra checks of `/health`, beyond "the model is loaded and the engine runs".
    pub health: Vec<HealthCheck>,
    /// The prompt cache on disk (`--prompt-cache`; `None`: off).
    pub prompt_cache: Option<PromptCacheConfig>,
}

impl HttpConfig {
    /// Settings with defaults for everything but the address (for tests and embedding).
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            aliases: Vec::new(),
            queue: 8,
            parallel: 1,
            max_body: 1 << 20,
            context: 4096,
            timeout: DEFAULT_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_client: DEFAULT_MAX_PER_CLIENT,
            api_key: None,
            metrics_public: false,
            allowed_hosts: Vec::new(),
            cors: Vec::new(),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            sampling: SamplingDefaults::default(),
            health: Vec::new(),
            prompt_cache: None,
        }
    }

    /// These settings with the sampling defaults of the model in `dir` (its
    /// generation_config.json).
    pub fn with_model_defaults(mut self, dir: &std::path::Path) -> Self {
        self.sampling = SamplingDefaults::from_dir(dir);
        self
    }
}

/// The most `--http-max-connections` takes (each connection is a file descriptor).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// Waits for SIGTERM or SIGINT (Ctrl-C); returns the signal's name.
pub async fn shutdown_signal() -> anyhow::Result<&'static str> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("listening for SIGTERM")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.map(|()| "SIGINT").context("waiting for Ctrl-C"),
            _ = term.recv() => Ok("SIGTERM"),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c()
            .await
            .context("waiting for Ctrl-C")?;
        Ok("Ctrl-C")
    }
}

/// Where the server is in its life: serving, draining (no new connections; running replies
/// may finish), or cutting (running replies end now).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Serving,
    Draining,
    Cutting,
}

/// Waits until the server is at `phase` or past it; `false` if the server is gone without
/// getting there.
async fn phase_reached(rx: &mut tokio::sync::watch::Receiver<Phase>, phase: Phase) -> bool {
    rx.wait_for(|p| *p >= phase).await.is_ok()
}

/// A running HTTP server.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
    phase: tokio::sync::watch::Sender<Phase>,
    /// The connection slots (all free: no connection open), and how many there are.
    open: (Arc<tokio::sync::Semaphore>, usize),
    grace: std::time::Duration,
    state: Arc<State>,
}

impl HttpServer {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the server can serve now: `Err` with the reason otherwise (what `/health`
    /// answers).
    pub fn health(&self) -> Result<(), String> {
        self.state.health()
    }

    /// Stops at once: no new connections, open ones dropped; waits for the engine's expert
    /// I/O to finish.
    pub fn close(self) {
        let _ = self.phase.send(Phase::Cutting);
        self.accept.abort();
        self.state.experts.finish();
    }

    /// Stops gracefully (see the module docs): stops accepting, lets running replies finish
    /// within the grace period, cuts the rest cleanly, and returns once every connection is
    /// closed (or a few seconds after the cut, whichever is first).
    pub async fn shutdown(self) {
        let _ = self.phase.send(Phase::Draining);
        let (open, max) = &self.open;
        let all = u32::try_from(*max).unwrap_or(u32::MAX);
        let idle = || open.acquire_many(all);
        if tokio::time::timeout(self.grace, idle()).await.is_err() {
            let running = self.state.metrics.admitted.get();
            tracing::warn!(
                "shutdown: {running} replies still running after {:.1} s: cutting them",
                self.grace.as_secs_f64()
            );
            let _ = self.phase.send(Phase::Cutting);
            let _ = tokio::time::timeout(CUT_LINGER, idle()).await;
        }
        self.accept.abort();
        self.state.experts.finish();
    }
}

/// How long cut replies are given to reach their clients before the server returns anyway.
const CUT_LINGER: std::time::Duration = std::time::Duration::from_secs(3);

/// What the engine thread sends back about one request.
#[derive(Debug)]
enum Event {
    /// Sent first: how many prompt positions came from a cache (a slot's, or the disk's).
    Cached(usize),
    Token(TokenId, Option<TokenLogprobs>),
    Done(Generation),
    Failed(String),
    /// Failed because an expert could not be had (no reachable holder): 503, worth a retry.
    Unavailable(String),
}

struct Job {
    prompt: Vec<TokenId>,
    opts: GenerateOptions,
    /// Log-probabilities with this many alternatives, if asked.
    logprobs: Option<usize>,
    events: mpsc::UnboundedSender<Event>,
    _permit: Permit,
}

/// A place in the queue; given back when dropped.
struct Permit(Arc<AtomicUsize>, Arc<Metrics>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.admitted.dec();
    }
}

#[derive(Debug)]
struct State {
    /// The name replies carry (the first of `names`).
    name: String,
    /// Every name the model is served under.
    names: Vec<String>,
    tokenizer: Arc<Tokenizer>,
    format: ChatFormat,
    eos: Vec<TokenId>,
    vocab: usize,
    jobs: std::sync::mpsc::SyncSender<JobBox>,
    pending: Arc<AtomicUsize>,
    limit: usize,
    max_body: usize,
    context: usize,
    /// How long a request's body may take to arrive.
    timeout: std::time::Duration,
    created: u64,
    next_id: AtomicU64,
    guard: guard::Guard,
    /// `/metrics` needs no key ([`HttpConfig::metrics_public`]).
    metrics_public: bool,
    metrics: Arc<Metrics>,
    phase: tokio::sync::watch::Receiver<Phase>,
    /// Whether the engine thread still takes jobs.
    engine_alive: Arc<std::sync::atomic::AtomicBool>,
    health: Vec<HealthCheck>,
    sampling: SamplingDefaults,
    experts: Arc<Experts>,
    /// The node the model runs on (for `/v1/swarm` and coverage in `/health`).
    node: Arc<crate::node::Node>,
}

impl State {
    /// `/health`: the model is loaded (it is, once the server runs), the engine takes jobs,
    /// the server is not shutting down, and every extra check passes.
    fn health(&self) -> Result<(), String> {
        if *self.phase.borrow() != Phase::Serving {
            return Err("the server is shutting down".into());
        }
        if !self.engine_alive.load(Ordering::Acquire) {
            return Err("the engine thread has stopped".into());
        }
        for h in &self.health {
            (h.0)()?;
        }
        Ok(())
    }
}

/// A job, boxed so the channel needs no Debug of its contents.
struct JobBox(Job);

impl std::fmt::Debug for JobBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Job({} prompt ids)", self.0.prompt.len())
    }
}

/// Marks the engine stopped when its thread ends, however it ends.
struct Alive(Arc<std::sync::atomic::AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Starts the server on the current tokio runtime: binds `cfg.addr`, starts the engine
/// thread, and accepts connections until closed. A node runs it as one of its services, on
/// its runtime and stopped with it ([`crate::node::Node::start_http`]); benches and tests may
/// run it alone.
pub async fn start(tm: TextModel, cfg: HttpConfig) -> anyhow::Result<HttpServer> {
    anyhow::ensure!(
        (1..=MAX_CONNECTIONS).contains(&cfg.max_connections),
        "the HTTP server's connection cap must be between 1 and {MAX_CONNECTIONS}"
    );
    anyhow::ensure!(
        cfg.max_per_client >= 1,
        "the HTTP server's per-client connection cap must be at least 1"
    );
    anyhow::ensure!(
        !cfg.timeout.is_zero() && cfg.timeout.as_secs_f64() <= stormo_net::progress::MAX_SECS,
        "the HTTP server's timeout must be positive and at most {} s",
        stormo_net::progress::MAX_SECS
    );
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .with_context(|| format!("binding the HTTP address {}", cfg.addr))?;
    let addr = listener.local_addr().context("the HTTP socket's address")?;
    let limit = cfg.queue + cfg.parallel;
    let (tx, rx) = std::sync::mpsc::sync_channel::<JobBox>(limit);
    let experts = tm.experts.clone();
    let stats_of = experts.clone();
    let metrics = Arc::new(Metrics::new(
        Arc::new(move || stats_of.stats()),
        cfg.prompt_cache.is_some(),
    ));
    let engine = batch::Engine::new(
        tm.model.clone(),
        cfg.context,
        cfg.parallel,
        metrics.clone(),
        cfg.prompt_cache.as_ref(),
    )?;
    let engine_alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let alive = Alive(engine_alive.clone());
    std::thread::Builder::new()
        .name("stormo-http-engine".into())
        .spawn(move || {
            let _alive = alive;
            engine.run(rx);
        })
        .context("starting the engine thread")?;
    let (phase_tx, phase) = tokio::sync::watch::channel(Phase::Serving);
    let cfgm = tm.model.config();
    let state = Arc::new(State {
        name: cfg
            .aliases
            .first()
            .cloned()
            .unwrap_or_else(|| tm.name.clone()),
        names: if cfg.aliases.is_empty() {
            vec![tm.name.clone()]
        } else {
            cfg.aliases.clone()
        },
        tokenizer: tm.tokenizer.clone(),
        format: tm.format.clone(),
        eos: cfgm.eos_token_ids.clone(),
        vocab: cfgm.vocab_size,
        jobs: tx,
        pending: Arc::new(AtomicUsize::new(0)),
        limit,
        max_body: cfg.max_body,
        context: cfg.context,
        timeout: cfg.timeout,
        created: now_s(),
        next_id: AtomicU64::new(1),
        guard: guard::Guard::new(addr, &cfg.allowed_hosts, &cfg.cors, cfg.api_key.as_deref()),
        metrics_public: cfg.metrics_public,
        metrics,
        phase: phase.clone(),
        engine_alive,
        health: cfg.health.clone(),
        sampling: cfg.sampling,
        experts,
        node: tm.node.clone(),
    });
    if !state.guard.needs_key() && !addr.ip().is_loopback() {
        tracing::warn!(
            "the HTTP API at {addr} is reachable from other machines and needs no API key: give \
             --api-key (or STORMO_API_KEY) or listen on 127.0.0.1"
        );
    }
    let timeout = cfg.timeout;
    let refusal = ApiError::server(format!(
        "the server has {} connections open, the most it allows; try again later",
        cfg.max_connections
    ))
    .code("too_many_connections");
    let client_refusal = ApiError::server(format!(
        "your address has {} connections open to the server, the most one address may have; \
         close one or try again later",
        cfg.max_per_client
    ))
    .code("too_many_connections_from_client");
    let mut gate = conn::Gate::new(
        cfg.max_connections,
        cfg.max_per_client,
        &refusal.body().to_string(),
        &client_refusal.body().to_string(),
    );
    let open = gate.slots();
    let task_state = state.clone();
    let mut stop = phase.clone();
    let accept = tokio::spawn(async move {
        let state = task_state;
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                true = phase_reached(&mut stop, Phase::Draining) => {
                    tracing::info!("HTTP: no longer accepting connections");
                    return;
                }
            };
            let (stream, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to close.
                    tracing::warn!("HTTP accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some((stream, slot)) = gate.admit(stream, peer) else {
                continue;
            };
            let state = state.clone();
            let mut phase = phase.clone();
            tokio::spawn(async move {
                // Given back when the task ends, after the connection (owned by the future
                // below) is closed, whether it ended well, by an error or by a timeout.
                let _slot = slot;
                let svc = service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(state, req).await) }
                });
                // hyper's header read timeout runs from the connection's start and from the
                // end of each response, so it also ends idle keep-alive connections.
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(timeout)
                    .serve_connection(TokioIo::new(conn::Stall::new(stream, timeout)), svc);
                tokio::pin!(conn);
                let res = tokio::select! {
                    r = conn.as_mut() => r,
                    true = phase_reached(&mut phase, Phase::Draining) => {
                        // Finishes the response being written, then closes (at once if idle).
                        conn.as_mut().graceful_shutdown();
                        conn.await
                    }
                };
                if let Err(e) = res {
                    tracing::debug!("HTTP connection from {peer}: {e}");
                }
            });
        }
    });
    Ok(HttpServer {
        addr,
        accept,
        phase: phase_tx,
        open,
        grace: cfg.shutdown_grace,
        state,
    })
}

// ---- Bodies and errors ----

/// A response body: all at once, or server-sent events as they are made.
#[derive(Debug)]
pub enum Body {
    /// The whole body (taken when sent).
    Full(Option<Bytes>),
    /// Chunks from a channel, until it closes.
    Stream(mpsc::Receiver<Bytes>),
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Self::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Self::Full(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            Self::Stream(_) => http_body::SizeHint::default(),
        }
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Body::Full(Some(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error for the client, in OpenAI's shape.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    /// The request field at fault (`messages[0].content`), when there is one.
    param: Option<std::borrow::Cow<'static, str>>,
    message: String,
    /// Headers to send with it (`Retry-After`, `WWW-Authenticate`).
    headers: Vec<(hyper::header::HeaderName, HeaderValue)>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: None,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    fn param(mut self, p: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        self.param = Some(p.into());
        self
    }

    fn code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }

    fn status(mut self, s: StatusCode) -> Self {
        self.status = s;
        self
    }

    fn header(mut self, name: hyper::header::HeaderName, value: &'static str) -> Self {
        self.headers.push((name, HeaderValue::from_static(value)));
        self
    }

    /// A 429 with `Retry-After` (one request takes seconds; a second is a fair first wait).
    fn busy(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            code: Some("rate_limit_exceeded"),
            ..Self::bad(message)
        }
        .header(hyper::header::RETRY_AFTER, "1")
    }

    /// A refusal that names a field the server does not implement.
    fn unsupported(field: &'static str, what: &str) -> Self {
        Self::bad(format!(
            "{field} is not supported by this server ({what}); leave it out"
        ))
        .param(field)
        .code("unsupported_parameter")
    }

    /// 503: an expert the reply needed has no reachable holder now (a peer down); the
    /// request may succeed once it is back.
    fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: Some("experts_unavailable"),
            ..Self::server(message)
        }
        .header(hyper::header::RETRY_AFTER, "5")
    }

    fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    fn body(&self) -> Value {
        json!({ "error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    fn response(&self) -> Response<Body> {
        let mut r = json_response(self.status, &self.body());
        for (k, v) in &self.headers {
            r.headers_mut().insert(k.clone(), v.clone());
        }
        r
    }
}

// ---- Requests ----

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<MessageContent>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    name: Option<String>,
    /// Fields this server does not read (named in a warning).
    #[serde(flatten)]
    extra: Extra,
}

/// Fields a request has that this server does not know, by name.
type Extra = std::collections::BTreeMap<String, Value>;

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    /// Fields this server does not read (named in a warning).
    #[serde(flatten)]
    extra: Extra,
}

/// Settings both endpoints share.
#[derive(Debug, Default, Deserialize)]
struct Common {
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    repetition_penalty: Option<f64>,
    #[serde(default)]
    max_tokens: Option<u64>,
    /// OpenAI's newer name for `max_tokens`; wins when both are given.
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<StopField>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u64>,
    /// The model asked for: the served model's name (see [`check_model`]).
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    logit_bias: Option<Value>,
    /// An end-user id for abuse tracking: accepted, not used.
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

impl Common {
    /// The completion's length the request asks, and the field that asked it.
    fn max_tokens(&self) -> request::MaxTokens {
        match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some((m, "max_completion_tokens")),
            (None, Some(m)) => Some((m, "max_tokens")),
            (None, None) => None,
        }
    }
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<ChatMessage>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u64>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    functions: Option<Value>,
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(flatten)]
    common: Common,
    /// Last: it takes the fields no other field took.
    #[serde(flatten)]
    extra: Extra,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    /// A string, an array of one string, an array of token ids or an array of one such
    /// array (read by [`prompt_ids`], whose messages say which of these was wrong).
    prompt: Value,
    /// Log-probabilities with this many alternatives (0 to 5, as OpenAI's).
    #[serde(default)]
    logprobs: Option<u64>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    best_of: Option<u64>,
    #[serde(flatten)]
    common: Common,
    /// Last: it takes the fields no other field took.
    #[serde(flatten)]
    extra: Extra,
}

/// The endpoint a path is, for metrics (a bounded set of label values).
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/v1/swarm" => "/v1/swarm",
        _ => "other",
    }
}

fn header_str(req: &Request<Incoming>, name: hyper::header::HeaderName) -> Option<&str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// The guard's checks: `Ok(allow_origin)` to go on (with the value of
/// `Access-Control-Allow-Origin` to send, if any), or the refusal to answer.
fn admit(state: &State, req: &Request<Incoming>, path: &str) -> Result<Option<String>, ApiError> {
    use guard::Refusal;
    // HTTP/1.1 requires Host; hyper puts an absolute-form target's authority in the URI.
    let host =
        header_str(req, hyper::header::HOST).or_else(|| req.uri().authority().map(|a| a.as_str()));
    let refuse = |e: Refusal| match e {
        Refusal::Host(h) => ApiError::bad(match h {
            Some(h) => format!(
                "this server does not answer to the host {h:?} (to serve it, start the server \
                 with --allowed-host NAME)"
            ),
            None => "the request has no Host header".into(),
        })
        .status(StatusCode::FORBIDDEN)
        .code("host_not_allowed"),
        Refusal::Origin(o) => ApiError::bad(format!(
            "requests from the web origin {o:?} are not allowed (to allow it, start the server \
             with --cors {o})"
        ))
        .status(StatusCode::FORBIDDEN)
        .code("origin_not_allowed"),
        Refusal::NoKey => ApiError::bad(
            "this server needs an API key: send it as the header `Authorization: Bearer KEY`",
        )
        .status(StatusCode::UNAUTHORIZED)
        .code("invalid_api_key")
        .header(hyper::header::WWW_AUTHENTICATE, "Bearer"),
        Refusal::WrongKey => ApiError::bad("incorrect API key provided")
            .status(StatusCode::UNAUTHORIZED)
            .code("invalid_api_key")
            .header(hyper::header::WWW_AUTHENTICATE, "Bearer"),
    };
    state.guard.host(host).map_err(refuse)?;
    let allow = state
        .guard
        .origin(header_str(req, hyper::header::ORIGIN))
        .map_err(refuse)?;
    // A preflight carries no credentials; /health is for load balancers, and /metrics for a
    // scraper when --metrics-public says so.
    let open = path == "/health" || (path == "/metrics" && state.metrics_public);
    if req.method() != Method::OPTIONS && !open {
        state
            .guard
            .key(header_str(req, hyper::header::AUTHORIZATION))
            .map_err(refuse)?;
    }
    Ok(allow)
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    // A trailing slash is ignored, but the root stays `/` (so messages name it).
    let path = match req.uri().path().trim_end_matches('/') {
        "" => "/".to_string(),
        p => p.to_string(),
    };
    let method = req.method().clone();
    let label = endpoint_label(&path);
    let (res, allow_origin) = match admit(&state, &req, &path) {
        Err(e) => (Err(e), None),
        Ok(allow) => (route(&state, req, &method, &path).await, allow),
    };
    let mut r = match res {
        Ok(r) => r,
        Err(e) => {
            if e.status.is_server_error() || e.status == StatusCode::TOO_MANY_REQUESTS {
                tracing::info!("HTTP {method} {path}: {} {}", e.status, e.message);
            } else {
                tracing::debug!("HTTP {method} {path}: {} {}", e.status, e.message);
            }
            e.response()
        }
    };
    if let Some(o) = allow_origin {
        let h = r.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&o) {
            h.insert(hyper::header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        }
        h.insert(hyper::header::VARY, HeaderValue::from_static("Origin"));
    }
    state.metrics.request(label, r.status().as_u16());
    r
}

async fn route(
    state: &State,
    req: Request<Incoming>,
    method: &Method,
    path: &str,
) -> Result<Response<Body>, ApiError> {
    // HEAD is answered as GET is; hyper sends the head without the body.
    let routed = if method == Method::HEAD {
        Method::GET
    } else {
        method.clone()
    };
    match (routed, path) {
        (Method::OPTIONS, _) => Ok(preflight()),
        (Method::GET, "/health") => Ok(health(state)),
        (Method::GET, "/metrics") => {
            let mut r = Response::new(Body::Full(Some(Bytes::from(state.metrics.render()))));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(metrics::CONTENT_TYPE),
            );
            Ok(r)
        }
        (Method::GET, "/v1/models") => Ok(models(state)),
        (Method::GET, "/v1/swarm") => match state.node.coverage() {
            Some(c) => Ok(json_response(StatusCode::OK, &c.json())),
            None => Err(ApiError::bad(
                "this node runs alone from its model folder (no manifest, no peers): there is no \
                 swarm to report",
            )
            .status(StatusCode::NOT_FOUND)
            .code("not_found")),
        },
        (Method::GET, p) if p.starts_with("/v1/models/") => {
            // Clients percent-encode an id with a space or a slash (`openai%2Fgpt-oss-20b`).
            let id = percent_decode(&p["/v1/models/".len()..]);
            check_model(state, Some(&id))?;
            Ok(json_response(StatusCode::OK, &model_object(state, &id)))
        }
        (Method::POST, "/v1/chat/completions") => {
            chat_completions(state, read_json(state, req, &request::CHAT).await?).await
        }
        (Method::POST, "/v1/completions") => {
            completions(state, read_json(state, req, &request::COMPLETION).await?).await
        }
        (
            _,
            "/v1/models"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/health"
            | "/metrics"
            | "/v1/swarm",
        ) => Err(ApiError::bad(format!("{method} is not allowed on {path}"))
            .status(StatusCode::METHOD_NOT_ALLOWED)),
        _ => Err(ApiError::bad(format!("no such endpoint: {method} {path}"))
            .status(StatusCode::NOT_FOUND)
            .code("not_found")),
    }
}

/// The answer to a CORS preflight from an allowed origin (the origin was checked already).
fn preflight() -> Response<Body> {
    let mut r = Response::new(Body::Full(None));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let h = r.headers_mut();
    h.insert(
        hyper::header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    h.insert(
        hyper::header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("authorization, content-type"),
    );
    h.insert(
        hyper::header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    r
}

/// `GET /health`: 200 `{"status":"ok"}`, or 503 `{"status":"unavailable","reason":...}`.
fn health(state: &State) -> Response<Body> {
    match state.health() {
        Ok(()) => {
            // Every expert generation may need must have a reachable holder.
            let uncovered = state.node.coverage().map_or(0, |c| c.uncovered().len());
            if uncovered > 0 {
                let mut r = json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &json!({
                        "status": "degraded",
                        "model": state.name,
                        "uncovered": uncovered,
                        "reason": format!(
                            "{uncovered} experts have no reachable holder: requests that \
                             route to them fail until a peer holding them is back"
                        ),
                    }),
                );
                r.headers_mut()
                    .insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("5"));
                return r;
            }
            json_response(
                StatusCode::OK,
                &json!({ "status": "ok", "model": state.name }),
            )
        }
        Err(reason) => {
            let mut r = json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({ "status": "unavailable", "reason": reason }),
            );
            r.headers_mut()
                .insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("5"));
            r
        }
    }
}

/// Refuses a model name other than the served model's (as `/v1/models` lists it) with a 404
/// like OpenAI's. A request without `model` is served by the one model.
fn check_model(state: &State, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if state.names.iter().any(|n| n == m) => Ok(()),
        Some(m) => Err(ApiError::bad(format!(
            "the model `{m}` does not exist; this server serves {} (as GET /v1/models lists {})",
            served_names(&state.names),
            if state.names.len() == 1 { "it" } else { "them" },
        ))
        .param("model")
        .status(StatusCode::NOT_FOUND)
        .code("model_not_found")),
    }
}

/// The served names for a message: `a`, `a` and `b`, `a`, `b` and `c`.
fn served_names(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

/// A path segment with its `%XX` escapes decoded; an escape that is not one is kept as it
/// is, and bytes that are not UTF-8 are replaced (such a name is served by no model anyway).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| char::from(c).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                // Two hex digits: at most 255.
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Logs the fields of a request this server does not know (they are not used).
fn warn_unknown(endpoint: &str, extra: &Extra, common: &Common, messages: &[ChatMessage]) {
    let names = unknown_fields(extra, common, messages);
    if !names.is_empty() {
        tracing::warn!(
            "{endpoint}: ignoring request fields this server does not know: {}",
            names.join(", ")
        );
    }
}

/// The fields of a request this server does not know, by their paths.
fn unknown_fields(extra: &Extra, common: &Common, messages: &[ChatMessage]) -> Vec<String> {
    let mut names: Vec<String> = extra.keys().cloned().collect();
    if let Some(o) = &common.stream_options {
        names.extend(o.extra.keys().map(|k| format!("stream_options.{k}")));
    }
    for (i, m) in messages.iter().enumerate() {
        names.extend(m.extra.keys().map(|k| format!("messages[{i}].{k}")));
    }
    names
}

fn model_object(state: &State, name: &str) -> Value {
    json!({ "id": name, "object": "model", "created": state.created, "owned_by": "stormo" })
}

fn models(state: &State) -> Response<Body> {
    let data: Vec<Value> = state.names.iter().map(|n| model_object(state, n)).collect();
    json_response(StatusCode::OK, &json!({ "object": "list", "data": data }))
}

fn queue(
    state: &State,
    prompt: Vec<TokenId>,
    opts: GenerateOptions,
    logprobs: Option<usize>,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    if *state.phase.borrow() != Phase::Serving {
        return Err(ApiError::server("the server is shutting down")
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .code("server_shutting_down"));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty").param("prompt"));
    }
    // `settings` refused a prompt that leaves no room for a reply, naming its field.
    debug_assert!(prompt.len() < state.context);
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= state.vocab) {
        return Err(ApiError::bad(format!(
            "token id {id} is outside the vocabulary of {}",
            state.vocab
        ))
        .param("prompt"));
    }
    let prev = state.pending.fetch_add(1, Ordering::AcqRel);
    state.metrics.admitted.inc();
    let permit = Permit(state.pending.clone(), state.metrics.clone());
    if prev >= state.limit {
        return Err(ApiError::busy(format!(
            "the server is busy: {} requests are running or waiting; try again later",
            state.limit
        )));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let job = JobBox(Job {
        prompt,
        opts,
        logprobs,
        events: tx,
        _permit: permit,
    });
    match state.jobs.try_send(job) {
        Ok(()) => Ok(rx),
        Err(std::sync::mpsc::TrySendError::Full(_)) => {
            Err(ApiError::busy("the queue is full; try again later"))
        }
        Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
            Err(ApiError::server("the engine has stopped"))
        }
    }
}

/// Whether a JSON field asks for something (not absent, null, false, empty).
fn given(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// Refuses what the chat endpoint does not implement, naming the field.
fn refuse_unsupported_chat(req: &ChatRequest) -> Result<(), ApiError> {
    if given(&req.tools) {
        return Err(ApiError::unsupported(
            "tools",
            "tool calling is not implemented",
        ));
    }
    if given(&req.functions) {
        return Err(ApiError::unsupported(
            "functions",
            "function calling is not implemented",
        ));
    }
    for (field, v) in [
        ("tool_choice", &req.tool_choice),
        ("function_call", &req.function_call),
    ] {
        match v {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    field,
                    "tool calling is not implemented; only \"none\" or \"auto\" without tools",
                ))
            }
        }
    }
    match &req.response_format {
        None | Some(Value::Null) => {}
        Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "response_format",
                "structured output (JSON mode, JSON schema) is not implemented; only \
                 {\"type\": \"text\"}",
            ))
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        if given(&m.extra.get("tool_calls").cloned()) {
            return Err(ApiError::bad(format!(
                "messages[{i}].tool_calls: tool calling is not implemented by this server"
            ))
            .param(format!("messages[{i}].tool_calls"))
            .code("unsupported_parameter"));
        }
    }
    Ok(())
}

/// The number of alternatives asked for, checked (`None`: no log-probabilities).
fn top_logprobs(
    asked: bool,
    top: Option<u64>,
    field: &'static str,
) -> Result<Option<usize>, ApiError> {
    let top = top.unwrap_or(0);
    if top > MAX_TOP_LOGPROBS as u64 {
        return Err(
            ApiError::bad(format!("{field} is {top}; at most {MAX_TOP_LOGPROBS}")).param(field),
        );
    }
    Ok(asked.then_some(top as usize))
}

async fn chat_completions(state: &State, req: ChatRequest) -> Result<Response<Body>, ApiError> {
    // A wrong model name is the first error, as OpenAI's API reports it.
    check_model(state, req.common.model.as_deref())?;
    refuse_unsupported_chat(&req)?;
    warn_unknown(
        "/v1/chat/completions",
        &req.extra,
        &req.common,
        &req.messages,
    );
    if req.top_logprobs.is_some() && req.logprobs != Some(true) {
        return Err(ApiError::bad("top_logprobs needs logprobs set to true").param("top_logprobs"));
    }
    let logprobs = top_logprobs(req.logprobs == Some(true), req.top_logprobs, "top_logprobs")?;
    let turns = turns_of(&req.messages)?;
    let effort = match req.reasoning_effort.as_deref() {
        None => ReasoningEffort::Medium,
        Some(e) => ReasoningEffort::parse(e).ok_or_else(|| {
            ApiError::bad(format!("reasoning_effort {e:?} is not low, medium or high"))
                .param("reasoning_effort")
        })?,
    };
    let popts = PromptOptions {
        reasoning_effort: effort,
        ..PromptOptions::default()
    };
    let c = &req.common;
    let prompt = state
        .format
        .render_prompt(&turns, &popts)
        .map_err(|e| ApiError::bad(format!("rendering the messages: {e}")).param("messages"))?;
    let room = state.context.saturating_sub(prompt.len());
    let (sampling, max, stop) = settings(state, c, c.max_tokens(), room, prompt.len(), "messages")?;
    let opts = GenerateOptions {
        max_new_tokens: max,
        stop: state.format.stop_tokens(),
        sampling,
    };
    let n = prompt.len();
    let events = queue(state, prompt, opts, logprobs)?;
    let reply = Reply::new(events, ReplyStream::chat(&state.format), stop);
    let a = state.answer(Kind::Chat, c, n, reply, logprobs.is_some());
    if c.stream.unwrap_or(false) {
        a.streamed().await
    } else {
        a.whole().await
    }
}

async fn completions(state: &State, req: CompletionRequest) -> Result<Response<Body>, ApiError> {
    check_model(state, req.common.model.as_deref())?;
    warn_unknown("/v1/completions", &req.extra, &req.common, &[]);
    if req.echo == Some(true) {
        return Err(ApiError::unsupported(
            "echo",
            "the prompt is not returned with the completion",
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "fill-in-the-middle is not implemented",
        ));
    }
    if req.best_of.is_some_and(|b| b > 1) {
        return Err(ApiError::unsupported("best_of", "only best_of = 1"));
    }
    let logprobs = top_logprobs(req.logprobs.is_some(), req.logprobs, "logprobs")?;
    let c = &req.common;
    let prompt = prompt_ids(&state.tokenizer, &req.prompt)?;
    let (sampling, max, stop) = settings(state, c, c.max_tokens(), 16, prompt.len(), "prompt")?;
    let opts = GenerateOptions {
        max_new_tokens: max,
        stop: state.eos.clone(),
        sampling,
    };
    let n = prompt.len();
    let events = queue(state, prompt, opts, logprobs)?;
    let reply = Reply::new(events, ReplyStream::plain(state.tokenizer.clone()), stop);
    let a = state.answer(Kind::Text, c, n, reply, logprobs.is_some());
    if c.stream.unwrap_or(false) {
        a.streamed().await
    } else {
        a.whole().await
    }
}

/// Parses a request body the way the endpoint at `path` does before it needs a model (the
/// JSON into its request type, then a chat's messages into turns), for the fuzz tests
/// (tests/fuzz): untrusted bytes in, an error naming what is wrong out, never a panic.
#[doc(hidden)]
pub fn parse_request_body(path: &str, body: &[u8]) -> Result<(), String> {
    let bad = |e: ApiError| format!("{e:?}");
    match path {
        "/v1/chat/completions" => {
            let req: ChatRequest = request::parse_body(body, &request::CHAT).map_err(bad)?;
            turns_of(&req.messages).map_err(bad)?;
        }
        "/v1/completions" => {
            let _: CompletionRequest =
                request::parse_body(body, &request::COMPLETION).map_err(bad)?;
        }
        other => return Err(format!("no endpoint {other}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_in_paths_are_percent_decoded() {
        assert_eq!(percent_decode("my%20model"), "my model");
        assert_eq!(percent_decode("openai%2Fgpt-oss-20b"), "openai/gpt-oss-20b");
        assert_eq!(percent_decode("openai%2fgpt"), "openai/gpt");
        assert_eq!(percent_decode("plain"), "plain");
        // Not escapes: kept as they are.
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("a%zz"), "a%zz");
        assert_eq!(percent_decode("caf%C3%A9"), "café");
        assert_eq!(percent_decode("%FF"), "\u{fffd}");
    }

    #[test]
    fn a_404_for_a_model_lists_every_served_name() {
        let names = |v: &[&str]| served_names(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(names(&["a"]), "`a`");
        assert_eq!(names(&["a", "b"]), "`a` and `b`");
        assert_eq!(names(&["a", "b", "c"]), "`a`, `b` and `c`");
    }

    /// Unknown fields are warned about wherever they are: the body, `stream_options`, a
    /// message.
    #[test]
    fn unknown_fields_are_named_with_their_paths() {
        let body = br#"{"messages": [{"role": "user", "content": "hi", "mood": 1}],
                        "stream_options": {"include_usage": true, "chunk_size": 3},
                        "frobnicate": true}"#;
        let req: ChatRequest = request::parse_body(body, &request::CHAT).expect("parses");
        assert_eq!(
            unknown_fields(&req.extra, &req.common, &req.messages),
            [
                "frobnicate",
                "stream_options.chunk_size",
                "messages[0].mood"
            ]
        );
        assert_eq!(
            req.common.stream_options.and_then(|o| o.include_usage),
            Some(true)
        );
    }

    #[test]
    fn completions_take_max_completion_tokens() {
        let req: CompletionRequest = request::parse_body(
            br#"{"prompt": "hi", "max_completion_tokens": 3}"#,
            &request::COMPLETION,
        )
        .expect("parses");
        assert!(req.extra.is_empty(), "{:?}", req.extra);
        assert_eq!(req.common.max_tokens(), Some((3, "max_completion_tokens")));
        let req: CompletionRequest = request::parse_body(
            br#"{"prompt": "hi", "max_tokens": 5, "max_completion_tokens": 3}"#,
            &request::COMPLETION,
        )
        .expect("parses");
        assert_eq!(req.common.max_tokens(), Some((3, "max_completion_tokens")));
    }
}
