//! An OpenAI-compatible HTTP API for people and their tools: `POST /v1/chat/completions`,
//! `POST /v1/completions` (both with server-sent-event streaming) and `GET /v1/models`.
//!
//! Owns: parsing requests (bounded body, every malformed input a 400 in OpenAI's error shape,
//! never a panic), rendering chat requests through the model's chat format, queueing, and
//! streaming replies. Connections are capped, in all and per client address, and timed (see
//! `http/conn.rs`): a client that stalls sending a request or taking a reply, or keeps an
//! idle connection open, loses it after `--http-timeout`. One engine thread owns one
//! [`ChatSession`] and runs one request at a time in arrival order; requests beyond `queue`
//! waiting ones get 429. Because clients send the whole conversation every time, consecutive
//! turns of one conversation reuse the cached common prefix (see [`crate::chat::session`]).
//!
//! Non-goals: authentication (bind to loopback or put a proxy in front), batching several
//! requests into one forward, `n > 1`, logprobs, tools/function calling.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::ops::ControlFlow;
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

use crate::chat::reply::ReplyStream;
use crate::chat::session::{ChatSession, GenerateOptions, Generation};
use crate::chat::{
    harmony::ReasoningEffort, ChatFormat, OutputDelta, PromptOptions, TokenId, Tokenizer, Turn,
    TurnRole,
};
use crate::cmd::chat::TextModel;
use crate::experts::ExpertArgs;

mod conn;
mod stop;
pub use conn::{DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_CLIENT, DEFAULT_TIMEOUT};
use stop::StopMatcher;

/// Options of the HTTP API (`stormo serve --http`).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Serve an OpenAI-compatible HTTP API here, e.g. 127.0.0.1:8080 or localhost:8080 (no
    /// authentication: bind to loopback or put a proxy in front).
    #[arg(long, value_name = "ADDR", value_parser = crate::cmd::serve::listen_addr)]
    pub http: Option<SocketAddr>,
    /// Requests that may wait while one runs; more get HTTP 429.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub http_queue: usize,
    /// Largest request body accepted, in bytes (larger: HTTP 413).
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES")]
    pub http_max_body: usize,
    /// Positions of the HTTP engine's session (prompt and reply); longer prompts get 400.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub http_context: usize,
    /// How long a client may take to send a request's headers (also how long an idle
    /// keep-alive connection is kept), then its body, or to take the next part of a reply;
    /// past it the connection is closed (a body too slow: HTTP 408). At most 1e6.
    #[arg(
        long,
        default_value_t = DEFAULT_TIMEOUT.as_secs_f64(),
        value_name = "SECS",
        value_parser = crate::progress::secs_arg
    )]
    pub http_timeout: f64,
    /// Connections open at once; more are answered HTTP 503 and closed.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    pub http_max_connections: usize,
    /// Connections one client IP address may have open at once; more from it are answered
    /// HTTP 503 and closed. At least 1; at or above --http-max-connections, only that cap
    /// applies. Behind a proxy every client has the proxy's address: raise it to
    /// --http-max-connections there.
    #[arg(long, default_value_t = DEFAULT_MAX_PER_CLIENT, value_name = "N")]
    pub http_max_per_client: usize,
}

/// The server's settings.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Where to listen.
    pub addr: SocketAddr,
    /// Requests that may wait while one runs.
    pub queue: usize,
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
}

impl HttpArgs {
    /// The settings, if `--http` was given.
    pub fn config(&self) -> anyhow::Result<Option<HttpConfig>> {
        let Some(addr) = self.http else {
            return Ok(None);
        };
        anyhow::ensure!(self.http_context >= 2, "--http-context must be at least 2");
        anyhow::ensure!(
            self.http_max_body >= 64,
            "--http-max-body must be at least 64"
        );
        let timeout = crate::progress::check_secs(self.http_timeout)
            .map_err(|e| anyhow::anyhow!("--http-timeout: {e}"))?;
        anyhow::ensure!(
            (1..=MAX_CONNECTIONS).contains(&self.http_max_connections),
            "--http-max-connections must be between 1 and {MAX_CONNECTIONS}"
        );
        anyhow::ensure!(
            self.http_max_per_client >= 1,
            "--http-max-per-client must be at least 1 (to leave only --http-max-connections, \
             give it that value)"
        );
        Ok(Some(HttpConfig {
            addr,
            queue: self.http_queue,
            max_body: self.http_max_body,
            context: self.http_context,
            timeout: std::time::Duration::from_secs_f64(timeout),
            max_connections: self.http_max_connections,
            max_per_client: self.http_max_per_client,
        }))
    }
}

/// The most `--http-max-connections` takes (each connection is a file descriptor).
const MAX_CONNECTIONS: usize = 1 << 20;

/// Loads the model in `dir` for the HTTP API.
pub fn load(
    dir: &std::path::Path,
    experts: &ExpertArgs,
    cfg: &HttpConfig,
) -> anyhow::Result<TextModel> {
    crate::cmd::chat::load_text_model(dir, experts, cfg.context, &Default::default())
}

/// A running HTTP server.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
    model: Arc<TextModelParts>,
}

impl HttpServer {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections and waits for the engine's expert I/O to finish.
    pub fn close(self) {
        self.accept.abort();
        self.model.experts.finish();
    }
}

#[derive(Debug)]
struct TextModelParts {
    experts: crate::experts::Experts,
}

/// What the engine thread sends back about one request.
#[derive(Debug)]
enum Event {
    Token(TokenId),
    Done(Generation),
    Failed(String),
}

struct Job {
    prompt: Vec<TokenId>,
    opts: GenerateOptions,
    events: mpsc::UnboundedSender<Event>,
    _permit: Permit,
}

/// A place in the queue; given back when dropped.
struct Permit(Arc<AtomicUsize>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
struct State {
    name: String,
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
}

/// A job, boxed so the channel needs no Debug of its contents.
struct JobBox(Job);

impl std::fmt::Debug for JobBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Job({} prompt ids)", self.0.prompt.len())
    }
}

/// Starts the server on the current tokio runtime: binds `cfg.addr`, starts the engine
/// thread, and accepts connections until closed.
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
        !cfg.timeout.is_zero() && cfg.timeout.as_secs_f64() <= crate::progress::MAX_SECS,
        "the HTTP server's timeout must be positive and at most {} s",
        crate::progress::MAX_SECS
    );
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .with_context(|| format!("binding the HTTP address {}", cfg.addr))?;
    let addr = listener.local_addr().context("the HTTP socket's address")?;
    let limit = cfg.queue + 1;
    let (tx, rx) = std::sync::mpsc::sync_channel::<JobBox>(limit);
    let mut sess = ChatSession::new(tm.model.clone(), cfg.context)?;
    std::thread::Builder::new()
        .name("stormo-http-engine".into())
        .spawn(move || {
            while let Ok(JobBox(job)) = rx.recv() {
                run_job(&mut sess, job);
            }
        })
        .context("starting the engine thread")?;
    let cfgm = tm.model.config();
    let state = Arc::new(State {
        name: tm.name.clone(),
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
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        next_id: AtomicU64::new(1),
    });
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
    let accept = tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
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
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(timeout)
                    .serve_connection(TokioIo::new(conn::Stall::new(stream, timeout)), svc)
                    .await
                {
                    tracing::debug!("HTTP connection from {peer}: {e}");
                }
            });
        }
    });
    Ok(HttpServer {
        addr,
        accept,
        model: Arc::new(TextModelParts {
            experts: tm.experts,
        }),
    })
}

fn run_job(sess: &mut ChatSession, job: Job) {
    if job.events.is_closed() {
        return;
    }
    let events = &job.events;
    let res = sess.generate(&job.prompt, &job.opts, |id| {
        if events.send(Event::Token(id)).is_err() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    let _ = events.send(match res {
        Ok(g) => {
            tracing::info!(
                "HTTP request: prompt {} tokens ({} reused), {} generated",
                g.prompt_tokens,
                g.reused,
                g.ids.len()
            );
            Event::Done(g)
        }
        Err(e) => Event::Failed(e.to_string()),
    });
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
    param: Option<&'static str>,
    message: String,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: None,
            message: message.into(),
        }
    }

    fn param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
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

    fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
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
        json_response(self.status, &self.body())
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
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
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
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    /// A string, an array of one string, an array of token ids or an array of one such
    /// array (read by [`prompt_ids`], whose messages say which of these was wrong).
    prompt: Value,
    #[serde(flatten)]
    common: Common,
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let method = req.method().clone();
    let res = match (method.clone(), path.as_str()) {
        (Method::GET, "/v1/models") => Ok(models(&state)),
        (Method::GET, p) if p.starts_with("/v1/models/") => {
            let id = &p["/v1/models/".len()..];
            if id == state.name {
                Ok(json_response(StatusCode::OK, &model_object(&state)))
            } else {
                Err(ApiError::bad(format!(
                    "the model {id:?} does not exist; this server has {:?}",
                    state.name
                ))
                .status(StatusCode::NOT_FOUND)
                .code("model_not_found"))
            }
        }
        (Method::POST, "/v1/chat/completions") => match read_json(&state, req).await {
            Ok(body) => chat_completions(&state, body).await,
            Err(e) => Err(e),
        },
        (Method::POST, "/v1/completions") => match read_json(&state, req).await {
            Ok(body) => completions(&state, body).await,
            Err(e) => Err(e),
        },
        (_, "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            Err(ApiError::bad(format!("{method} is not allowed on {path}"))
                .status(StatusCode::METHOD_NOT_ALLOWED))
        }
        _ => Err(ApiError::bad(format!("no such endpoint: {method} {path}"))
            .status(StatusCode::NOT_FOUND)
            .code("not_found")),
    };
    match res {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!("HTTP {method} {path}: {} {}", e.status, e.message);
            e.response()
        }
    }
}

fn model_object(state: &State) -> Value {
    json!({ "id": state.name, "object": "model", "created": state.created, "owned_by": "stormo" })
}

fn models(state: &State) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({ "object": "list", "data": [model_object(state)] }),
    )
}

/// Reads the body (at most `max_body` bytes) as JSON.
async fn read_json<T: serde::de::DeserializeOwned>(
    state: &State,
    req: Request<Incoming>,
) -> Result<T, ApiError> {
    let too_large = || {
        ApiError::bad(format!(
            "the request body is larger than {} bytes",
            state.max_body
        ))
        .status(StatusCode::PAYLOAD_TOO_LARGE)
    };
    if let Some(len) = req.headers().get(CONTENT_LENGTH) {
        let len: u64 = len
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| ApiError::bad("the Content-Length header is not a number"))?;
        if len > state.max_body as u64 {
            return Err(too_large());
        }
    }
    let collect = Limited::new(req.into_body(), state.max_body).collect();
    let Ok(body) = tokio::time::timeout(state.timeout, collect).await else {
        return Err(ApiError::bad(format!(
            "the request body did not arrive within {} s",
            state.timeout.as_secs_f64()
        ))
        .status(StatusCode::REQUEST_TIMEOUT));
    };
    let body = match body {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large()),
        Err(e) => return Err(ApiError::bad(format!("reading the request body: {e}"))),
    };
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad(format!(
            "the request body is not valid JSON for this endpoint: {e}"
        ))
    })
}

/// Generation settings from the request, checked.
fn settings(
    state: &State,
    c: &Common,
    max_tokens: Option<u64>,
    default_max: usize,
) -> Result<(SamplingParams, usize, Vec<String>), ApiError> {
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad("only n = 1 is supported").param("n"));
        }
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(
            ApiError::bad(format!("temperature {temperature} is outside [0, 2]"))
                .param("temperature"),
        );
    }
    // Read as f64 so a value beyond f32's range is reported as sent, not as inf; values
    // that pass the checks below are in f32's range.
    let params = SamplingParams {
        temperature: temperature as f32,
        top_p: c.top_p.unwrap_or(1.0) as f32,
        top_k: c.top_k.unwrap_or(0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0) as f32,
        seed: c.seed.map(|s| s as u64).unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        }),
    };
    params
        .validate()
        .map_err(|e| ApiError::bad(format!("sampling settings: {e}")))?;
    let max = match max_tokens {
        Some(0) => return Err(ApiError::bad("max_tokens must be at least 1").param("max_tokens")),
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX).min(state.context),
        None => default_max,
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(
            ApiError::bad("stop takes up to 4 non-empty strings of at most 256 bytes")
                .param("stop"),
        );
    }
    Ok((params, max, stop))
}

/// The token ids of a completion's prompt: a string, an array of one string, an array of
/// token ids, or an array of one array of token ids (OpenAI's batches of one).
fn prompt_ids(tokenizer: &Tokenizer, prompt: &Value) -> Result<Vec<TokenId>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param("prompt");
    let empty = || {
        bad("the prompt is empty; give a non-empty string or a non-empty array of token ids".into())
    };
    let text = |t: &str| {
        if t.is_empty() {
            return Err(empty());
        }
        tokenizer
            .encode(t, false)
            .map_err(|e| bad(format!("tokenizing the prompt: {e}")))
    };
    let ids = |v: &[Value]| {
        v.iter()
            .map(|x| match x {
                Value::Number(n) => n
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| bad(format!("token id {n} is out of range"))),
                x => Err(bad(format!(
                    "the prompt's token ids include {}; an array prompt is strings or token ids",
                    json_kind(x)
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let wrong = |what: &str| {
        bad(format!(
            "the prompt {what}; give a string, an array of one string, or an array of token ids"
        ))
    };
    let ids = match prompt {
        Value::String(t) => text(t)?,
        Value::Array(v) => match v.first() {
            None => return Err(empty()),
            Some(_) if v.len() > 1 && !v[0].is_number() => {
                return Err(bad("only one prompt per request is supported".into()))
            }
            Some(Value::String(t)) => text(t)?,
            Some(Value::Number(_)) => ids(v)?,
            Some(Value::Array(inner)) => ids(inner)?,
            Some(x) => return Err(wrong(&format!("holds {}", json_kind(x)))),
        },
        x => return Err(wrong(&format!("is {}", json_kind(x)))),
    };
    if ids.is_empty() {
        return Err(empty());
    }
    Ok(ids)
}

/// What a JSON value is, for messages (never the value itself, which may be large).
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn turns_of(messages: &[ChatMessage]) -> Result<Vec<Turn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages is empty").param("messages"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = TurnRole::parse(&m.role).ok_or_else(|| {
                ApiError::bad(format!(
                    "messages[{i}].role {:?} is not system, developer, user, assistant or tool",
                    m.role
                ))
                .param("messages")
            })?;
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (k, _) => {
                                return Err(ApiError::bad(format!(
                                    "messages[{i}]: content parts of type {k:?} are not supported (text only)"
                                ))
                                .param("messages"))
                            }
                        }
                    }
                    s
                }
            };
            Ok(Turn {
                reasoning: m.reasoning_content.clone(),
                name: m.name.clone(),
                ..Turn::new(role, content)
            })
        })
        .collect()
}

fn queue(
    state: &State,
    prompt: Vec<TokenId>,
    opts: GenerateOptions,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty").param("prompt"));
    }
    if prompt.len() >= state.context {
        return Err(ApiError::bad(format!(
            "the prompt has {} tokens; this server's context holds {} positions (prompt and reply)",
            prompt.len(),
            state.context
        ))
        .code("context_length_exceeded"));
    }
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= state.vocab) {
        return Err(ApiError::bad(format!(
            "token id {id} is outside the vocabulary of {}",
            state.vocab
        ))
        .param("prompt"));
    }
    let prev = state.pending.fetch_add(1, Ordering::AcqRel);
    let permit = Permit(state.pending.clone());
    if prev >= state.limit {
        return Err(ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            code: Some("rate_limit_exceeded"),
            param: None,
            message: format!(
                "the server is busy: {} requests are running or waiting; try again later",
                state.limit
            ),
        });
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let job = JobBox(Job {
        prompt,
        opts,
        events: tx,
        _permit: permit,
    });
    match state.jobs.try_send(job) {
        Ok(()) => Ok(rx),
        Err(std::sync::mpsc::TrySendError::Full(_)) => {
            Err(ApiError::server("the queue is full").status(StatusCode::TOO_MANY_REQUESTS))
        }
        Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
            Err(ApiError::server("the engine has stopped"))
        }
    }
}

/// Text pieces of one reply as they are made, with stop strings applied to the answer.
struct Reply {
    events: mpsc::UnboundedReceiver<Event>,
    stream: ReplyStream,
    stop: StopMatcher,
    tokens: usize,
    ready: std::collections::VecDeque<Step>,
    finished: bool,
}

/// One step of a [`Reply`].
#[derive(Debug)]
enum Step {
    Delta(OutputDelta),
    /// Finished: OpenAI's finish reason and the completion's token count.
    End(&'static str, usize),
}

impl Reply {
    fn new(events: mpsc::UnboundedReceiver<Event>, stream: ReplyStream, stop: Vec<String>) -> Self {
        Self {
            events,
            stream,
            stop: StopMatcher::new(stop),
            tokens: 0,
            ready: Default::default(),
            finished: false,
        }
    }

    fn content(&mut self, t: &str) -> bool {
        let (emit, hit) = self.stop.push(t);
        if !emit.is_empty() {
            self.ready
                .push_back(Step::Delta(OutputDelta::Content(emit)));
        }
        hit
    }

    async fn next(&mut self) -> Result<Option<Step>, ApiError> {
        loop {
            if let Some(s) = self.ready.pop_front() {
                return Ok(Some(s));
            }
            if self.finished {
                return Ok(None);
            }
            let Some(ev) = self.events.recv().await else {
                return Err(ApiError::server("the engine dropped the request"));
            };
            match ev {
                Event::Token(id) => {
                    self.tokens += 1;
                    match self.stream.push(id) {
                        Some(OutputDelta::Content(t)) => {
                            let hit = self.content(&t);
                            if hit {
                                // Closing the channel cancels the generation.
                                self.events.close();
                                self.finished = true;
                                self.ready.push_back(Step::End("stop", self.tokens));
                            }
                        }
                        Some(d) => self.ready.push_back(Step::Delta(d)),
                        None => {}
                    }
                }
                Event::Done(g) => {
                    self.finished = true;
                    let mut hit = false;
                    if let Some(OutputDelta::Content(t)) = self.stream.finish() {
                        hit = self.content(&t);
                    }
                    if !hit {
                        let tail = self.stop.finish();
                        if !tail.is_empty() {
                            self.ready
                                .push_back(Step::Delta(OutputDelta::Content(tail)));
                        }
                    }
                    let reason = if hit { "stop" } else { g.finish.openai() };
                    self.ready.push_back(Step::End(reason, self.tokens));
                }
                Event::Failed(msg) => return Err(ApiError::server(msg)),
            }
        }
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Which endpoint a reply is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// Everything needed to answer once the request is queued.
struct Answer {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    prompt_tokens: usize,
    include_usage: bool,
    reply: Reply,
}

impl Answer {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
            }),
            Kind::Text => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{ "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                              "logprobs": null, "finish_reason": finish }],
            }),
        }
    }

    async fn whole(mut self) -> Result<Response<Body>, ApiError> {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let (mut reason, mut tokens) = ("stop", 0);
        while let Some(step) = self.reply.next().await? {
            match step {
                Step::Delta(OutputDelta::Content(t)) => content.push_str(&t),
                Step::Delta(OutputDelta::Reasoning(t)) => reasoning.push_str(&t),
                Step::End(r, n) => (reason, tokens) = (r, n),
            }
        }
        let usage = usage(self.prompt_tokens, tokens);
        let v = match self.kind {
            Kind::Chat => {
                let mut message = json!({ "role": "assistant", "content": content });
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                json!({
                    "id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.model,
                    "choices": [{ "index": 0, "message": message, "finish_reason": reason }],
                    "usage": usage,
                })
            }
            Kind::Text => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{ "index": 0, "text": content, "logprobs": null, "finish_reason": reason }],
                "usage": usage,
            }),
        };
        Ok(json_response(StatusCode::OK, &v))
    }

    fn streamed(mut self) -> Response<Body> {
        let (tx, rx) = mpsc::channel::<Bytes>(32);
        tokio::spawn(async move {
            let event = |v: &Value| Bytes::from(format!("data: {v}\n\n"));
            if self.kind == Kind::Chat {
                let first = self.chunk(json!({ "role": "assistant", "content": "" }), None);
                if tx.send(event(&first)).await.is_err() {
                    return;
                }
            }
            loop {
                let v = match self.reply.next().await {
                    Ok(Some(Step::Delta(OutputDelta::Content(t)))) => {
                        self.chunk(json!({ "content": t }), None)
                    }
                    Ok(Some(Step::Delta(OutputDelta::Reasoning(t)))) => {
                        if self.kind == Kind::Text {
                            continue;
                        }
                        self.chunk(json!({ "reasoning_content": t }), None)
                    }
                    Ok(Some(Step::End(reason, tokens))) => {
                        let mut last = self.chunk(json!({}), Some(reason));
                        if self.include_usage {
                            if tx.send(event(&last)).await.is_err() {
                                return;
                            }
                            last = self.chunk(json!({}), None);
                            last["choices"] = json!([]);
                            last["usage"] = usage(self.prompt_tokens, tokens);
                        }
                        last
                    }
                    Ok(None) => break,
                    Err(e) => e.body(),
                };
                let is_err = v.get("error").is_some();
                if tx.send(event(&v)).await.is_err() || is_err {
                    return;
                }
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut r = Response::new(Body::Stream(rx));
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(
            hyper::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
        r
    }
}

impl State {
    fn answer(&self, kind: Kind, common: &Common, prompt_tokens: usize, reply: Reply) -> Answer {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        };
        Answer {
            kind,
            id: format!("{prefix}-{:x}{n:06x}", self.created),
            model: self.name.clone(),
            created: now_s(),
            prompt_tokens,
            include_usage: common
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            reply,
        }
    }
}

async fn chat_completions(state: &State, req: ChatRequest) -> Result<Response<Body>, ApiError> {
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
    let prompt = state
        .format
        .render_prompt(&turns, &popts)
        .map_err(|e| ApiError::bad(format!("rendering the messages: {e}")).param("messages"))?;
    let c = &req.common;
    let room = state.context.saturating_sub(prompt.len()).max(1);
    let (sampling, max, stop) =
        settings(state, c, req.max_completion_tokens.or(c.max_tokens), room)?;
    let opts = GenerateOptions {
        max_new_tokens: max,
        stop: state.format.stop_tokens(),
        sampling,
    };
    let n = prompt.len();
    let events = queue(state, prompt, opts)?;
    let reply = Reply::new(events, ReplyStream::chat(&state.format), stop);
    let a = state.answer(Kind::Chat, c, n, reply);
    if c.stream.unwrap_or(false) {
        Ok(a.streamed())
    } else {
        a.whole().await
    }
}

async fn completions(state: &State, req: CompletionRequest) -> Result<Response<Body>, ApiError> {
    let prompt = prompt_ids(&state.tokenizer, &req.prompt)?;
    let c = &req.common;
    let (sampling, max, stop) = settings(state, c, c.max_tokens, 16)?;
    let opts = GenerateOptions {
        max_new_tokens: max,
        stop: state.eos.clone(),
        sampling,
    };
    let n = prompt.len();
    let events = queue(state, prompt, opts)?;
    let reply = Reply::new(events, ReplyStream::plain(state.tokenizer.clone()), stop);
    let a = state.answer(Kind::Text, c, n, reply);
    if c.stream.unwrap_or(false) {
        Ok(a.streamed())
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
            let req: ChatRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
            turns_of(&req.messages).map_err(bad)?;
        }
        "/v1/completions" => {
            let _: CompletionRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        }
        other => return Err(format!("no endpoint {other}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> HttpArgs {
        HttpArgs {
            http: Some("127.0.0.1:0".parse().expect("addr")),
            http_queue: 8,
            http_max_body: 1 << 20,
            http_context: 4096,
            http_timeout: DEFAULT_TIMEOUT.as_secs_f64(),
            http_max_connections: DEFAULT_MAX_CONNECTIONS,
            http_max_per_client: DEFAULT_MAX_PER_CLIENT,
        }
    }

    #[test]
    fn config_checks_the_timeout_and_connection_caps() {
        let cfg = args().config().expect("defaults").expect("--http given");
        assert_eq!(cfg.timeout, DEFAULT_TIMEOUT);
        assert_eq!(cfg.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(cfg.max_per_client, DEFAULT_MAX_PER_CLIENT);
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e18] {
            let a = HttpArgs {
                http_timeout: t,
                ..args()
            };
            let e = a.config().expect_err("a bad timeout is refused");
            assert!(e.to_string().contains("--http-timeout"), "{t}: {e}");
        }
        for n in [0, MAX_CONNECTIONS + 1, usize::MAX] {
            let a = HttpArgs {
                http_max_connections: n,
                ..args()
            };
            let e = a.config().expect_err("a bad cap is refused");
            assert!(e.to_string().contains("--http-max-connections"), "{n}: {e}");
        }
        let a = HttpArgs {
            http_max_per_client: 0,
            ..args()
        };
        let e = a.config().expect_err("a per-client cap of 0 is refused");
        assert!(e.to_string().contains("--http-max-per-client"), "{e}");
        // Above the cap in all: accepted, and only that cap applies (see conn.rs).
        for n in [
            1,
            DEFAULT_MAX_CONNECTIONS,
            DEFAULT_MAX_CONNECTIONS + 1,
            usize::MAX,
        ] {
            let a = HttpArgs {
                http_max_per_client: n,
                ..args()
            };
            let cfg = a.config().expect("accepted").expect("--http given");
            assert_eq!(cfg.max_per_client, n);
        }
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
