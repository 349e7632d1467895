//! The OpenAI-compatible HTTP API (`stormo serve --http`) on a small synthetic GPT-OSS with the
//! real o200k_harmony vocabulary: errors in OpenAI's shape, the queue bound, streaming, stop
//! strings, health and metrics, shutdown, and the Python `openai` client against it (the
//! connections' caps and timeouts: `http_connections`).
//!
//! The model is written by the `stormo synth` CLI (run in-process) into a temporary folder,
//! with the fixture's tokenizer.json copied beside it. Servers listen on 127.0.0.1 only.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use stormo_cli::cmd::chat::{load_text_model, TextModel};
use stormo_node::config::{ExpertsConfig, NodeConfig};
use stormo_node::http::{self, HttpConfig, HttpServer};
use stormo_tests::fixture;
use stormo_text::{PromptOptions, Turn, TurnRole};

/// A synthetic model folder (the same model on every call: the seed is fixed), removed when
/// the returned handle drops. Each test writes its own (a fraction of a second) rather than
/// sharing one held in a static, which is never dropped and so would leave the folder behind
/// after every run.
pub(crate) fn synth_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().to_str().expect("utf-8 temp path");
    let mut args = vec!["--layers", "2", "--top-k", "2", "--seed", "5", "--out", out];
    args.extend_from_slice(crate::demo::SMALL_SHAPE);
    crate::demo::synth(&args).expect("stormo synth writes the model");
    std::fs::copy(
        fixture("o200k-harmony").join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    dir
}

pub(crate) fn expert_args() -> ExpertsConfig {
    ExpertsConfig {
        mmap: true,
        io_threads: 1,
        hot_store: false,
        ..ExpertsConfig::default()
    }
}

pub(crate) fn text_model(dir: &Path, context: usize) -> TextModel {
    let cfg = NodeConfig {
        experts: expert_args(),
        ..NodeConfig::local(dir, context)
    };
    load_text_model(cfg, &Default::default()).expect("model loads")
}

/// A server on its own runtime, stopped when dropped (then its model folder is removed).
pub(crate) struct Server {
    rt: Option<tokio::runtime::Runtime>,
    srv: Option<HttpServer>,
    pub(crate) addr: SocketAddr,
    model: tempfile::TempDir,
}

impl Server {
    fn start(queue: usize, context: usize) -> Self {
        Self::start_with(queue, context, |_| {})
    }

    /// A server whose settings `tweak` changes first.
    pub(crate) fn start_with(
        queue: usize,
        context: usize,
        tweak: impl FnOnce(&mut HttpConfig),
    ) -> Self {
        Self::start_experts(queue, context, &expert_args(), tweak)
    }

    /// A server whose experts come as `experts` says.
    fn start_experts(
        queue: usize,
        context: usize,
        experts: &ExpertsConfig,
        tweak: impl FnOnce(&mut HttpConfig),
    ) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let mut cfg = HttpConfig {
            queue,
            max_body: 64 << 10,
            context,
            ..HttpConfig::new("127.0.0.1:0".parse().expect("addr"))
        };
        tweak(&mut cfg);
        let model = synth_model();
        let srv = rt
            .block_on(http::start(
                load_text_model(
                    NodeConfig {
                        experts: experts.clone(),
                        ..NodeConfig::local(model.path(), context)
                    },
                    &Default::default(),
                )
                .expect("model loads"),
                cfg,
            ))
            .expect("server starts");
        let addr = srv.local_addr();
        Self {
            rt: Some(rt),
            srv: Some(srv),
            addr,
            model,
        }
    }
}

impl Server {
    /// Begins a graceful shutdown, as SIGTERM does (it runs on the server's runtime).
    fn begin_shutdown(&mut self) {
        let srv = self.srv.take().expect("the server runs");
        let rt = self.rt.as_ref().expect("the runtime runs");
        rt.spawn(srv.shutdown());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.srv.take() {
            s.close();
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

pub(crate) fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    s
}

pub(crate) fn send(s: &mut TcpStream, method: &str, path: &str, body: &[u8]) {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).expect("write body");
}

/// One request; the status and the body (chunked bodies joined).
pub(crate) fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = connect(addr);
    send(&mut s, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&String::from_utf8(raw).expect("utf-8 response"))
}

/// The status and body of a whole response (chunked bodies joined).
pub(crate) fn parse_response(text: &str) -> (u16, String) {
    let (head, body) = text.split_once("\r\n\r\n").expect("a header block");
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

/// Reads one response with a Content-Length from a connection that stays open.
pub(crate) fn read_response(s: &mut TcpStream) -> (u16, String) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("a response head");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).expect("utf-8 head");
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length").then_some(v)
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("a Content-Length: {head}"));
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("a response body");
    parse_response(&(head + &String::from_utf8(body).expect("utf-8 body")))
}

fn dechunk(mut b: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = b.split_once("\r\n").expect("chunk size line");
        let n = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        b = &rest[n + 2..];
    }
}

pub(crate) fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request(addr, "POST", path, body.to_string().as_bytes());
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

/// The `data:` payloads of an event stream.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

pub(crate) fn assert_openai_error(
    status: u16,
    v: &Value,
    want_status: u16,
    kind: &str,
    what: &str,
) {
    assert_eq!(status, want_status, "{what}: {v}");
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
    assert_eq!(e["type"], kind, "{what}: {v}");
    assert!(
        e.get("code").is_some(),
        "{what}: error.code is present: {v}"
    );
}

#[test]
fn http_errors_are_openai_shaped_and_never_panic() {
    let srv = Server::start(2, 256);
    let a = srv.addr;
    let (st, text) = request(a, "POST", "/v1/chat/completions", b"{not json");
    let v: Value = serde_json::from_str(&text).expect("error body is JSON");
    assert_openai_error(st, &v, 400, "invalid_request_error", "malformed JSON");
    let cases = [
        (json!({}), "no messages"),
        (json!({"messages": []}), "empty messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "bad role",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "content of the wrong type",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": 9}),
            "temperature",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 3}),
            "n",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}),
            "effort",
        ),
    ];
    for (body, what) in cases {
        let (st, v) = post(a, "/v1/chat/completions", &body);
        assert_openai_error(st, &v, 400, "invalid_request_error", what);
    }
    // A value beyond f32's range is reported as sent, not as the inf it would round to.
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "temperature": 1e300}),
    );
    assert_openai_error(st, &v, 400, "invalid_request_error", "temperature 1e300");
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(m, "temperature 1e300 is outside [0, 2]", "{m}");
    assert_eq!(v["error"]["param"], "temperature", "{v}");
    let long = "word ".repeat(400);
    let (st, v) = post(a, "/v1/completions", &json!({ "prompt": long }));
    assert_openai_error(
        st,
        &v,
        400,
        "invalid_request_error",
        "prompt beyond the context",
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let (st, v) = post(
        a,
        "/v1/completions",
        &json!({ "prompt": [1, 2, 999_999_999] }),
    );
    assert_openai_error(
        st,
        &v,
        400,
        "invalid_request_error",
        "id beyond the vocabulary",
    );
    // Every malformed prompt is named for what is wrong with it.
    let prompts = [
        (json!([]), "empty"),
        (json!(""), "empty"),
        (json!([""]), "empty"),
        (json!([[]]), "empty"),
        (json!(null), "is null"),
        (json!({"text": "x"}), "is an object"),
        (json!([{"text": "x"}]), "holds an object"),
        (json!(["a", "b"]), "only one prompt"),
        (json!([1, "b"]), "include a string"),
        (json!([1, -2]), "token id -2 is out of range"),
        (
            json!([1, 4294967296_u64]),
            "token id 4294967296 is out of range",
        ),
    ];
    for (prompt, want) in prompts {
        let (st, v) = post(a, "/v1/completions", &json!({ "prompt": prompt }));
        let what = format!("prompt {prompt}");
        assert_openai_error(st, &v, 400, "invalid_request_error", &what);
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(want), "{what}: {m:?} does not say {want:?}");
        assert_eq!(v["error"]["param"], "prompt", "{what}: {v}");
    }
    let huge = json!({ "prompt": "a".repeat(70 << 10) });
    let (st, v) = post(a, "/v1/completions", &huge);
    assert_openai_error(st, &v, 413, "invalid_request_error", "body over the bound");
    let (st, text) = request(a, "GET", "/v1/nothing", b"");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_openai_error(st, &v, 404, "invalid_request_error", "unknown path");
    let (st, text) = request(a, "GET", "/", b"");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_openai_error(st, &v, 404, "invalid_request_error", "the root");
    assert_eq!(v["error"]["message"], "no such endpoint: GET /", "{v}");
    let (st, text) = request(a, "GET", "/v1/chat/completions", b"");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_openai_error(st, &v, 405, "invalid_request_error", "wrong method");
    // Still serving after all of that.
    let (st, text) = request(a, "GET", "/v1/models", b"");
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["object"], "model");
    assert!(v["data"][0]["id"].as_str().is_some_and(|s| !s.is_empty()));
}

#[test]
fn http_requests_beyond_the_queue_get_429() {
    // No waiting room: one request at a time.
    let srv = Server::start(0, 4096);
    let a = srv.addr;
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 3000, "stream": true,
                       "temperature": 0 });
    let mut first = connect(a);
    send(
        &mut first,
        "POST",
        "/v1/completions",
        long.to_string().as_bytes(),
    );
    // Wait until it streams: it holds the engine now.
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while !seen.contains("data: ") {
        let n = first.read(&mut buf).expect("first response streams");
        assert!(n > 0, "first response ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let (st, v) = post(
        a,
        "/v1/completions",
        &json!({ "prompt": "hi", "max_tokens": 1 }),
    );
    assert_openai_error(st, &v, 429, "rate_limit_error", "second request while busy");
    // Hanging up cancels the first; the server takes requests again.
    drop(first);
    let t0 = Instant::now();
    loop {
        let (st, v) = post(
            a,
            "/v1/completions",
            &json!({ "prompt": "hi", "max_tokens": 1 }),
        );
        if st == 200 {
            assert_eq!(v["usage"]["completion_tokens"], 1);
            break;
        }
        assert_eq!(st, 429, "{v}");
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the cancelled request kept the engine"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn http_streams_what_it_answers_whole_and_honours_stop() {
    let srv = Server::start(4, 1024);
    let a = srv.addr;
    let base = json!({ "prompt": "The capital of France is", "max_tokens": 40, "seed": 11,
                       "temperature": 0.8, "top_p": 0.9 });
    let (st, whole) = post(a, "/v1/completions", &base);
    assert_eq!(st, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    let text = whole["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    assert!(!text.is_empty());
    assert_eq!(whole["usage"]["completion_tokens"], 40);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().expect("count");
    assert!(prompt_tokens >= 4);
    // Streaming gives the same text in pieces, then [DONE].
    let mut s = base.clone();
    s["stream"] = json!(true);
    let (st, body) = request(a, "POST", "/v1/completions", s.to_string().as_bytes());
    assert_eq!(st, 200, "{body}");
    let evs = events(&body);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut streamed = String::new();
    let mut finish = Value::Null;
    for e in &evs[..evs.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("event JSON");
        streamed.push_str(v["choices"][0]["text"].as_str().expect("text"));
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(
        streamed, text,
        "streamed text differs from the whole answer"
    );
    assert_eq!(finish, "length");
    // A stop string from the middle of that text cuts it there.
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let (from, _) = chars[chars.len() / 2];
    let to = chars.get(chars.len() / 2 + 2).map_or(text.len(), |c| c.0);
    let stop = &text[from..to];
    let cut = &text[..text.find(stop).expect("the stop occurs")];
    for stream in [false, true] {
        let mut r = base.clone();
        r["stop"] = json!([stop]);
        r["stream"] = json!(stream);
        let (st, body) = request(a, "POST", "/v1/completions", r.to_string().as_bytes());
        assert_eq!(st, 200, "{body}");
        let got = if stream {
            let evs = events(&body);
            evs[..evs.len() - 1]
                .iter()
                .map(|e| {
                    let v: Value = serde_json::from_str(e).expect("JSON");
                    v["choices"][0]["text"].as_str().expect("text").to_string()
                })
                .collect::<String>()
        } else {
            let v: Value = serde_json::from_str(&body).expect("JSON");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            v["choices"][0]["text"].as_str().expect("text").to_string()
        };
        assert_eq!(got, cut, "stop {stop:?} (stream: {stream})");
    }
    // Chat: usage counts the rendered prompt; the whole and streamed answers agree.
    let tm = text_model(srv.model.path(), 64);
    let msgs = [Turn::new(TurnRole::User, "Hello there")];
    let ids = tm
        .format
        .render_prompt(&msgs, &PromptOptions::default())
        .expect("render");
    let chat = json!({ "messages": [{"role": "user", "content": "Hello there"}],
                       "max_tokens": 60, "seed": 3, "temperature": 0.7 });
    let (st, v) = post(a, "/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    let mut sc = chat.clone();
    sc["stream"] = json!(true);
    sc["stream_options"] = json!({ "include_usage": true });
    let (st, body) = request(a, "POST", "/v1/chat/completions", sc.to_string().as_bytes());
    assert_eq!(st, 200, "{body}");
    let evs = events(&body);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"));
    let mut streamed = String::new();
    let mut usage = Value::Null;
    let mut why = Value::Null;
    for e in &evs[..evs.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("JSON");
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(c);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        if !v["choices"][0]["content_empty_reason"].is_null() {
            why = v["choices"][0]["content_empty_reason"].clone();
        }
    }
    assert_eq!(streamed, content);
    // An empty answer says why, whole and streamed alike; an answer with text says nothing.
    let whole_why = &v["choices"][0]["content_empty_reason"];
    assert_eq!(content.is_empty(), whole_why.is_string(), "{v}");
    assert_eq!(
        &why, whole_why,
        "the stream's last chunk gives the same reason"
    );
    // The same counts; the second request found all of its prompt but the last token in the
    // slot's cache the first one left.
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(
            usage[k], v["usage"][k],
            "the streamed usage is the whole answer's"
        );
    }
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{v}"
    );
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        ids.len() - 1,
        "{usage}"
    );
}

/// The real Python `openai` package against the server, streaming and not.
#[test]
fn http_serves_the_python_openai_client() {
    stormo_tests::require_python("openai");
    let srv = Server::start(4, 1024);
    let script = script_path();
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", srv.addr))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai client script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("openai client: all checks passed"),
        "{stdout}"
    );
}

/// Continuous batching through the Python `openai` client: four greedy streams sent at once
/// to a server running four requests together each get the tokens and log-probabilities the
/// same request gets alone (see http_openai_batching.py), and the server's steps ran more
/// than one request at a time.
#[test]
fn http_four_concurrent_greedy_streams_equal_each_alone() {
    stormo_tests::require_python("openai");
    let srv = Server::start_with(4, 2048, |c| c.parallel = 4);
    let script = stormo_tests::repo_root().join("tests/integration/http_openai_batching.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", srv.addr))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai batching script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("openai batching: all checks passed"),
        "{stdout}"
    );
    eprintln!("{stdout}");
}

fn script_path() -> PathBuf {
    stormo_tests::repo_root().join("tests/integration/http_openai_client.py")
}

// ---- Operable: health, metrics, API key, Host and Origin, Retry-After, SIGTERM ----

/// One request with extra headers (`Host: localhost` unless one of them is a Host); the
/// status, the lowercased response head and the body (chunked bodies joined).
fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String, String) {
    let mut s = connect(addr);
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head += "Host: localhost\r\n";
    }
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += &format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).expect("write body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8(raw).expect("utf-8 response");
    let (status, body) = parse_response(&text);
    let head = text
        .split_once("\r\n\r\n")
        .map(|(h, _)| h.to_ascii_lowercase())
        .unwrap_or_default();
    (status, head, body)
}

/// `/health` answers 200 with the model's name (and 503 with a reason while shutting down:
/// see the SIGTERM test); `/metrics` is Prometheus text that counts requests by status and
/// the tokens generated; a 429 says when to retry.
#[test]
fn http_health_and_metrics_answer() {
    // Experts from a RAM cache over the disk (not memory-mapped), so the tiers count.
    let tiered = ExpertsConfig {
        mmap: false,
        ..expert_args()
    };
    let srv = Server::start_experts(0, 2048, &tiered, |_| {});
    let a = srv.addr;
    let (st, head, body) = request_with(a, "GET", "/health", &[], b"");
    assert_eq!(st, 200, "{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["status"], "ok", "{v}");
    // HEAD is answered as GET, without the body.
    let (st, head, body) = request_with(a, "HEAD", "/health", &[], b"");
    assert_eq!(st, 200, "{head}");
    assert!(head.contains("content-type: application/json"), "{head}");
    assert_eq!(body, "", "{head}");
    let (st, head, body) = request_with(a, "HEAD", "/v1/chat/completions", &[], b"");
    assert_eq!((st, body.as_str()), (405, ""), "{head}");
    let (st, v) = post(
        a,
        "/v1/completions",
        &json!({ "prompt": "Hello", "max_tokens": 5, "temperature": 0 }),
    );
    assert_eq!(st, 200, "{v}");
    let (st, _, _) = request_with(a, "GET", "/v1/nothing", &[], b"");
    assert_eq!(st, 404);
    let (st, head, text) = request_with(a, "GET", "/metrics", &[], b"");
    assert_eq!(st, 200, "{text}");
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in\n{text}"))
    };
    assert_eq!(value("stormo_tokens_generated_total"), 5.0);
    assert_eq!(
        value("stormo_http_requests_total{endpoint=\"/v1/completions\",code=\"200\"}"),
        1.0
    );
    assert_eq!(
        value("stormo_http_requests_total{endpoint=\"other\",code=\"404\"}"),
        1.0
    );
    assert_eq!(value("stormo_queue_depth"), 0.0);
    assert_eq!(value("stormo_active_requests"), 0.0);
    // No prompt cache here (--prompt-cache): none of its series.
    assert!(!text.contains("stormo_prompt_cache_"), "{text}");
    assert!(value("stormo_decode_tokens_per_second") > 0.0);
    for line in [
        "# TYPE stormo_tokens_generated_total counter",
        "# TYPE stormo_queue_depth gauge",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // The experts come from a RAM cache over the disk here: the tier's numbers are there.
    let requests = value("stormo_expert_requests_total");
    assert!(requests > 0.0, "{text}");
    assert!(value("stormo_expert_ram_hits_total") <= requests, "{text}");
    let loads: f64 = text
        .lines()
        .filter(|l| l.starts_with("stormo_expert_tier_loads_total{tier="))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        loads > 0.0,
        "the experts were loaded from a tier below RAM: {text}"
    );
    assert!(
        text.contains("stormo_expert_tier_bytes_total{tier="),
        "{text}"
    );

    // A request beyond the queue gets 429 with Retry-After.
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 2000, "stream": true,
                       "temperature": 0 });
    let mut first = connect(a);
    send(
        &mut first,
        "POST",
        "/v1/completions",
        long.to_string().as_bytes(),
    );
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while !seen.contains("data: ") {
        let n = first.read(&mut buf).expect("first response streams");
        assert!(n > 0, "first response ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let body = json!({ "prompt": "hi", "max_tokens": 1 }).to_string();
    let (st, head, _) = request_with(a, "POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(st, 429);
    assert!(head.contains("retry-after: 1"), "{head}");
}

/// A wrong or missing API key is a 401 (except on /health); a Host that is not the listen
/// address or an allowed name is a 403; a browser Origin needs --cors.
#[test]
fn http_checks_the_api_key_the_host_and_the_origin() {
    let srv = Server::start_with(2, 1024, |c| {
        c.api_key = Some("sk-local-test".into());
        c.allowed_hosts = vec!["models.internal".into()];
        c.cors = vec!["http://app.internal:3000".into()];
    });
    let a = srv.addr;
    let good = ("Authorization", "Bearer sk-local-test");
    let (st, head, body) = request_with(a, "GET", "/v1/models", &[], b"");
    assert_eq!(st, 401, "{body}");
    assert!(head.contains("www-authenticate: bearer"), "{head}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_openai_error(st, &v, 401, "invalid_request_error", "no key");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    for wrong in [
        "Bearer sk-local-tes",
        "Bearer sk-local-test2",
        "Basic sk-local-test",
    ] {
        let (st, _, body) = request_with(a, "GET", "/v1/models", &[("Authorization", wrong)], b"");
        assert_eq!(st, 401, "{wrong}: {body}");
    }
    let (st, _, body) = request_with(a, "GET", "/v1/models", &[good], b"");
    assert_eq!(st, 200, "{body}");
    let (st, _, _) = request_with(a, "GET", "/metrics", &[], b"");
    assert_eq!(st, 401, "metrics need the key");
    // `--metrics-public`: /metrics without the key, nothing else.
    let public = Server::start_with(2, 1024, |c| {
        c.api_key = Some("sk-local-test".into());
        c.metrics_public = true;
    });
    let (st, _, body) = request_with(public.addr, "GET", "/metrics", &[], b"");
    assert_eq!(st, 200, "--metrics-public: {body}");
    let (st, _, _) = request_with(public.addr, "GET", "/v1/models", &[], b"");
    assert_eq!(st, 401, "--metrics-public opens /metrics only");
    drop(public);
    let (st, _, body) = request_with(a, "GET", "/health", &[], b"");
    assert_eq!(st, 200, "health needs no key: {body}");

    // DNS rebinding: the attacker's name in Host is refused, before the key is even read.
    let port = a.port().to_string();
    for host in [format!("evil.example:{port}"), "evil.example".to_string()] {
        let (st, _, body) = request_with(a, "GET", "/v1/models", &[("Host", &host), good], b"");
        assert_eq!(st, 403, "{host}: {body}");
        let v: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(v["error"]["code"], "host_not_allowed", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("--allowed-host"),
            "{v}"
        );
    }
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "models.internal".into(),
    ] {
        let (st, _, body) = request_with(a, "GET", "/v1/models", &[("Host", &host), good], b"");
        assert_eq!(st, 200, "{host}: {body}");
    }

    // A web page from another origin cannot drive the server, even with a simple request.
    let (st, _, body) = request_with(
        a,
        "POST",
        "/v1/completions",
        &[("Origin", "http://evil.example"), good],
        br#"{"prompt": "hi", "max_tokens": 1}"#,
    );
    assert_eq!(st, 403, "{body}");
    assert!(body.contains("origin_not_allowed"), "{body}");
    let app = ("Origin", "http://app.internal:3000");
    let (st, head, _) = request_with(
        a,
        "OPTIONS",
        "/v1/chat/completions",
        &[app, ("Access-Control-Request-Method", "POST")],
        b"",
    );
    assert_eq!(st, 204, "{head}");
    assert!(
        head.contains("access-control-allow-origin: http://app.internal:3000"),
        "{head}"
    );
    assert!(
        head.contains("access-control-allow-headers: authorization, content-type"),
        "{head}"
    );
    let (st, head, body) = request_with(a, "GET", "/v1/models", &[app, good], b"");
    assert_eq!(st, 200, "{body}");
    assert!(
        head.contains("access-control-allow-origin: http://app.internal:3000"),
        "{head}"
    );
}

/// Fields the server does not implement are refused with 400 naming them; an unknown model
/// is a 404; the served model's name is accepted.
#[test]
fn http_refuses_what_it_does_not_implement() {
    let srv = Server::start(2, 1024);
    let a = srv.addr;
    let (_, v) = {
        let (st, text) = request(a, "GET", "/v1/models", b"");
        (st, serde_json::from_str::<Value>(&text).expect("JSON"))
    };
    let name = v["data"][0]["id"].as_str().expect("a model id").to_string();
    let msgs = json!([{ "role": "user", "content": "hi" }]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}] }),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "functions": [{"name": "f"}] }),
            "functions",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "tool_choice": "required" }),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "response_format": {"type": "json_schema"} }),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "logprobs": true, "top_logprobs": 21 }),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "frequency_penalty": 0.5 }),
            "frequency_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": msgs, "logit_bias": {"1": 5} }),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "echo": true }),
            "echo",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "suffix": "x" }),
            "suffix",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "logprobs": 50 }),
            "logprobs",
        ),
    ];
    for (path, body, field) in cases {
        let (st, v) = post(a, path, &body);
        assert_openai_error(st, &v, 400, "invalid_request_error", field);
        assert_eq!(v["error"]["param"], field, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap_or("").contains(field),
            "{v}"
        );
    }
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({ "model": "gpt-4o", "messages": msgs }),
    );
    assert_openai_error(st, &v, 404, "invalid_request_error", "unknown model");
    assert_eq!(v["error"]["code"], "model_not_found");
    let (st, v) = post(
        a,
        "/v1/completions",
        &json!({ "model": name, "prompt": "hi", "max_tokens": 2, "user": "u1", "some_new_field": 1 }),
    );
    assert_eq!(
        st, 200,
        "the served model's name, unknown fields warned about: {v}"
    );
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({ "messages": msgs, "max_tokens": 2, "tool_choice": "none", "response_format": {"type": "text"}, "frequency_penalty": 0 }),
    );
    assert_eq!(st, 200, "{v}");
}

/// Reads the f32 tensor "logits" of a safetensors file: its rows.
fn logits_rows(path: &Path) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).expect("the logits file");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("a JSON header");
    let t = &header["logits"];
    assert_eq!(t["dtype"], "F32");
    let shape: Vec<usize> = t["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim") as usize)
        .collect();
    let start = 8 + n + t["data_offsets"][0].as_u64().expect("offset") as usize;
    let data: Vec<f32> = bytes[start..start + shape[0] * shape[1] * 4]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    data.chunks(shape[1]).map(<[f32]>::to_vec).collect()
}

/// What `stormo run --prompt-ids IDS --logits-out` makes, greedily: per generated token its
/// id, bytes, log-softmax and the `top` most likely (bytes, log-probability), in f64.
fn expected_steps(model: &Path, tm: &TextModel, ids: &[u32], n: usize, top: usize) -> Value {
    let out = tempfile::tempdir().expect("temp dir");
    let logits = out.path().join("logits.safetensors");
    let ids_arg = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let run = Command::new(crate::demo::stormo_exe())
        .args(["run", "--model"])
        .arg(model)
        .args([
            "--prompt-ids",
            &ids_arg,
            "--max-new-tokens",
            &n.to_string(),
            "--json",
        ])
        .args(["--no-hot-store", "--logits-out"])
        .arg(&logits)
        .env("XDG_CACHE_HOME", out.path())
        .output()
        .expect("stormo run");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: Value = serde_json::from_slice(&run.stdout).expect("run --json");
    let generated: Vec<u32> = v["generated_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect();
    let bytes =
        |id: u32| -> Value { json!(tm.tokenizer.token_bytes(id).expect("a known id").to_vec()) };
    let rows = logits_rows(&logits);
    assert_eq!(rows.len(), generated.len());
    let steps: Vec<Value> = rows
        .iter()
        .zip(&generated)
        .map(|(row, &id)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let log_z = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]).then(i.cmp(&j)));
            let argmax = order[0] as u32;
            assert_eq!(argmax, id, "run's greedy token is the argmax of its logits");
            json!({
                "id": id,
                "bytes": bytes(id),
                "logprob": row[id as usize] as f64 - log_z,
                "top": order[..top].iter().map(|&i| json!([bytes(i as u32), row[i] as f64 - log_z])).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!(steps)
}

/// The Python `openai` client: log-probabilities (chat and completions, whole and streamed)
/// match the logits `stormo run --logits-out` writes for the same prompt ids within 1e-4;
/// tools, response_format, echo and suffix are refused naming the field; an unknown model is
/// a 404; a wrong API key a 401.
#[test]
fn http_logprobs_match_run_logits_through_the_openai_client() {
    stormo_tests::require_python("openai");
    let key = "sk-stormo-test";
    let srv = Server::start_with(4, 2048, |c| c.api_key = Some(key.into()));
    let tm = text_model(srv.model.path(), 2048);
    let messages = json!([{ "role": "user", "content": "Name three colours." }]);
    let chat_ids = tm
        .format
        .render_prompt(
            &[Turn::new(TurnRole::User, "Name three colours.")],
            &PromptOptions::default(),
        )
        .expect("render");
    let text_ids = tm.tokenizer.encode("Hello there", false).expect("encode");
    let expected = json!({
        "chat": { "messages": messages, "steps": expected_steps(srv.model.path(), &tm, &chat_ids, 6, 5) },
        "text": { "prompt": "Hello there", "steps": expected_steps(srv.model.path(), &tm, &text_ids, 6, 3) },
    });
    let dir = tempfile::tempdir().expect("temp dir");
    let exp = dir.path().join("expected.json");
    std::fs::write(&exp, expected.to_string()).expect("write expected.json");
    let script = stormo_tests::repo_root().join("tests/integration/http_openai_serving.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", srv.addr))
        .arg(key)
        .arg(&exp)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai serving script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("openai serving: all checks passed"),
        "{stdout}"
    );
}

/// `stormo serve --http` as a process: SIGTERM while a reply streams closes the listener,
/// ends the stream cleanly (its last events and the chunked end arrive), and the process
/// exits 0 within the grace period and a margin.
#[test]
fn http_sigterm_mid_stream_ends_the_stream_cleanly_and_exits_0() {
    let model = synth_model();
    let cache = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(crate::demo::stormo_exe())
        .args(["serve", "--model"])
        .arg(model.path())
        .args([
            "--http",
            "127.0.0.1:0",
            "--context",
            "32768",
            "--shutdown-grace",
            "1",
        ])
        .args(["--no-hot-store", "--expert-cache", "64MiB"])
        .env("XDG_CACHE_HOME", cache.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("stormo serve starts");
    // Killed if the test fails before it exits.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let mut child = Reap(child);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
        .expect("the server prints its URL");
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("http://")
        .and_then(|s| s.strip_suffix("/v1"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a URL on stdout: {line:?}"));
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 30000, "stream": true,
                       "temperature": 0 });
    let mut s = connect(addr);
    send(
        &mut s,
        "POST",
        "/v1/completions",
        long.to_string().as_bytes(),
    );
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data: ") {
        let n = s.read(&mut buf).expect("the reply streams");
        assert!(n > 0, "the reply ended early");
        raw.extend_from_slice(&buf[..n]);
    }
    let pid = child.0.id().to_string();
    let t0 = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(kill.success());
    s.read_to_end(&mut raw)
        .expect("the stream ends without a reset");
    let text = String::from_utf8(raw).expect("utf-8");
    let (status, body) = parse_response(&text);
    assert_eq!(status, 200);
    assert!(
        text.ends_with("0\r\n\r\n"),
        "the chunked body is ended: {:?}",
        &text[text.len().saturating_sub(200)..]
    );
    let evs = events(&body);
    assert_eq!(evs.last().map(String::as_str), Some("[DONE]"), "{body}");
    let last: Value = serde_json::from_str(&evs[evs.len() - 2]).expect("a JSON event");
    // Cut after the grace period (a finished reply would end with its finish reason).
    let cut = last["error"]["code"] == "server_shutting_down";
    let finished = last["choices"][0]["finish_reason"].is_string();
    eprintln!(
        "SIGTERM mid-stream: the reply was {}",
        if cut {
            "cut after the grace period"
        } else {
            "finished within it"
        }
    );
    assert!(cut || finished, "{last}");
    let status = loop {
        if let Some(st) = child.0.try_wait().expect("wait") {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    let _ = std::io::BufReader::new(stderr).read_to_string(&mut err);
    assert!(status.success(), "exit status {status}: {err}");
    assert!(err.contains("SIGTERM: shutting down"), "{err}");
    if cut {
        assert!(err.contains("cutting them"), "{err}");
    }
    // The listener is closed.
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err());
}

/// Every 400 names its field in `param` and says what is wrong in the API's terms (no Rust
/// type names); a prompt past the context is refused in the same words with or without
/// `max_tokens`; a large number is shown compactly.
#[test]
fn http_400s_name_the_field_and_say_what_is_wrong() {
    let srv = Server::start(2, 256);
    let a = srv.addr;
    let chat = |extra: Value| {
        let mut b = json!({ "messages": [{ "role": "user", "content": "hi" }] });
        for (k, v) in extra.as_object().expect("an object") {
            b[k] = v.clone();
        }
        b
    };
    let long = "word ".repeat(400);
    let cases = [
        (
            "/v1/chat/completions",
            chat(json!({ "top_p": 0 })),
            "top_p",
            "top_p 0 is outside (0, 1]",
        ),
        (
            "/v1/chat/completions",
            chat(json!({ "top_p": 2 })),
            "top_p",
            "top_p 2 is outside (0, 1]",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "repetition_penalty": 0 }),
            "repetition_penalty",
            "repetition_penalty 0 must be above 0",
        ),
        (
            "/v1/chat/completions",
            chat(json!({ "temperature": 1e308 })),
            "temperature",
            "temperature 1e308 is outside [0, 2]",
        ),
        (
            "/v1/chat/completions",
            chat(json!({ "max_tokens": "3" })),
            "max_tokens",
            "max_tokens must be a whole number from 1 up, not the string \"3\"",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "seed": 1.5 }),
            "seed",
            "seed must be a whole number",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": 5 }] }),
            "messages[0].content",
            "messages[0].content must be a string or an array of text parts, not 5",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url" }] }] }),
            "messages[0].content",
            "content parts of type \"image_url\" are not supported",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "wizard", "content": "x" }] }),
            "messages[0].role",
            "messages[0].role \"wizard\" is not",
        ),
        (
            "/v1/chat/completions",
            chat(json!({ "stop": 5 })),
            "stop",
            "stop must be a string or an array of strings, not 5",
        ),
        (
            "/v1/chat/completions",
            chat(json!({ "stream_options": { "include_usage": "yes" } })),
            "stream_options.include_usage",
            "stream_options.include_usage must be true or false",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "hi", "max_completion_tokens": 100000 }),
            "max_completion_tokens",
            "in the completion). Please reduce the length of the prompt or the completion \
             (max_completion_tokens).",
        ),
        (
            "/v1/completions",
            json!({ "prompt": long }),
            "prompt",
            "This model's maximum context length is 256 tokens. However, you requested ",
        ),
        (
            "/v1/completions",
            json!({ "prompt": long, "max_tokens": 10 }),
            "prompt",
            "This model's maximum context length is 256 tokens. However, you requested ",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": long }] }),
            "messages",
            "Please reduce the length of the messages.",
        ),
    ];
    for (path, body, param, want) in cases {
        let (st, v) = post(a, path, &body);
        let what = format!("{path} {param}");
        assert_openai_error(st, &v, 400, "invalid_request_error", &what);
        assert_eq!(v["error"]["param"], param, "{what}: {v}");
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(want), "{what}: {m:?} does not say {want:?}");
        for rust in ["untagged", "enum ", "struct ", "u64", "invalid type"] {
            assert!(!m.contains(rust), "{what}: {m:?}");
        }
    }
    // The body itself: not JSON, not an object (no field to name).
    for (body, want) in [
        (
            &b"[1, 2]"[..],
            "the body must be a JSON object, not an array",
        ),
        (&b"{not json"[..], "the request body is not valid JSON"),
    ] {
        let (st, text) = request(a, "POST", "/v1/chat/completions", body);
        let v: Value = serde_json::from_str(&text).expect("JSON");
        assert_openai_error(st, &v, 400, "invalid_request_error", want);
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.starts_with(want), "{m:?}");
    }
}

/// `/v1/completions` takes `max_completion_tokens` as the chat endpoint does (it was an
/// unknown field, and the reply took the default 16 tokens).
#[test]
fn http_completions_take_max_completion_tokens() {
    let srv = Server::start(2, 1024);
    let (st, v) = post(
        srv.addr,
        "/v1/completions",
        &json!({ "prompt": "Once upon a time", "max_completion_tokens": 3, "temperature": 0 }),
    );
    assert_eq!(st, 200, "{v}");
    let n = v["usage"]["completion_tokens"].as_u64().expect("usage");
    let reason = &v["choices"][0]["finish_reason"];
    assert!(
        n == 3 || (n < 3 && reason == "stop"),
        "{n} tokens, {reason}: {v}"
    );
}

/// On shutdown, requests still waiting for a slot are refused at once with 503, a stream as
/// well as a whole reply (a stream sends no head while it waits); only the running reply gets
/// the grace period. The tester's case: `--parallel 1`, queued requests started after SIGTERM
/// and ran, and queued streams got a 200 with an event "cut after 0 tokens".
#[test]
fn http_shutdown_refuses_queued_requests_at_once() {
    let grace = Duration::from_secs(3);
    let mut srv = Server::start_with(4, 4096, |c| {
        c.parallel = 1;
        c.shutdown_grace = grace;
    });
    let a = srv.addr;
    let long = json!({ "prompt": "Once upon a time", "max_tokens": 3000, "stream": true,
                       "temperature": 0 });
    let mut running = crate::batch::open_request(a, "/v1/completions", &long);
    let mut seen = crate::batch::read_until(&mut running, "data: ");
    let whole = crate::batch::open_request(
        a,
        "/v1/completions",
        &json!({ "prompt": "hi", "max_tokens": 500 }),
    );
    let chat = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 500,
                       "stream": true });
    let streams = [
        crate::batch::open_request(a, "/v1/chat/completions", &chat),
        crate::batch::open_request(
            a,
            "/v1/completions",
            &json!({ "prompt": "hi",
                                   "max_tokens": 500, "stream": true }),
        ),
    ];
    let t0 = Instant::now();
    while crate::batch::metric(a, "stormo_queue_depth") < 3.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "three requests queue"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let t0 = Instant::now();
    srv.begin_shutdown();
    for (i, mut s) in std::iter::once(whole).chain(streams).enumerate() {
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("the refusal");
        let took = t0.elapsed();
        let (st, body) = parse_response(&String::from_utf8(raw).expect("utf-8"));
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_openai_error(st, &v, 503, "server_error", &format!("queued request {i}"));
        assert_eq!(v["error"]["code"], "server_shutting_down", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("not started")),
            "{v}"
        );
        assert!(
            took < grace / 2,
            "queued request {i} refused only after {took:?}"
        );
    }
    // The running reply had the grace period: it finished within it or was cut cleanly
    // at its end.
    running
        .read_to_string(&mut seen)
        .expect("the running stream ends");
    assert!(seen.contains("data: [DONE]"), "{seen}");
    if seen.contains("server_shutting_down") {
        assert!(
            t0.elapsed() >= grace,
            "the running reply was cut before the grace period"
        );
    }
}
