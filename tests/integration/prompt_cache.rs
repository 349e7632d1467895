//! The prompt cache on disk (`serve --http --prompt-cache SIZE`, issue 60): a prompt's KV
//! cache survives a restart and a request sharing its prefix loads it, with the reply of a
//! server that has no cache (greedy and seeded sampling, alone and batched); a corrupt file
//! is ignored and removed; the folder stays within SIZE.
//!
//! Each server here is started and stopped in the test, on a synthetic model folder written
//! once per test (the same weights every time: the seed is fixed), with its own state folder.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use stormo_node::http::{self, HttpConfig, HttpServer, PromptCacheConfig};

use crate::http::{post, request, synth_model, text_model};

const CONTEXT: usize = 512;

/// A server on its own runtime over the model in `model`, with `parallel` slots and the
/// prompt cache `cache` (if any); stopped when dropped.
struct Server {
    rt: Option<tokio::runtime::Runtime>,
    srv: Option<HttpServer>,
    addr: SocketAddr,
}

impl Server {
    fn start(model: &Path, parallel: usize, cache: Option<(&Path, u64)>) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let cfg = HttpConfig {
            context: CONTEXT,
            parallel,
            prompt_cache: cache.map(|(dir, limit)| PromptCacheConfig {
                dir: dir.to_path_buf(),
                limit,
            }),
            ..HttpConfig::new("127.0.0.1:0".parse().expect("addr"))
        };
        let srv = rt
            .block_on(http::start(text_model(model, CONTEXT), cfg))
            .expect("server starts");
        let addr = srv.local_addr();
        Self {
            rt: Some(rt),
            srv: Some(srv),
            addr,
        }
    }

    /// A chat completion's message (content and reasoning) and its cached prompt tokens.
    fn chat(&self, body: &Value) -> (Value, u64) {
        chat(self.addr, body)
    }

    /// A counter or gauge of /metrics.
    fn metric(&self, name: &str) -> f64 {
        let (st, text) = request(self.addr, "GET", "/metrics", b"");
        assert_eq!(st, 200, "{text}");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {text}"))
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

fn chat(addr: SocketAddr, body: &Value) -> (Value, u64) {
    let (st, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(st, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens in {v}"));
    (v["choices"][0]["message"].clone(), cached)
}

/// A request whose system prompt (a few hundred tokens, the same for every `user`) comes
/// first, sampled as `sampling` says.
fn ask(user: &str, sampling: &Value) -> Value {
    let system = "You are a careful assistant. ".repeat(30);
    let mut b = json!({
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": 12,
    });
    for (k, v) in sampling.as_object().expect("an object") {
        b[k] = v.clone();
    }
    b
}

/// The `.kv` files under `dir` (every model folder), and their bytes in all.
fn files(dir: &Path) -> (Vec<std::path::PathBuf>, u64) {
    let mut out = Vec::new();
    let mut bytes = 0;
    for m in std::fs::read_dir(dir).expect("the cache folder").flatten() {
        for f in std::fs::read_dir(m.path())
            .expect("a model folder")
            .flatten()
        {
            let meta = f.metadata().expect("metadata");
            bytes += meta.len();
            out.push(f.path());
        }
    }
    (out, bytes)
}

/// Issue 60: a server with `--prompt-cache` answers a request, stops; a new server on the
/// same state folder answers requests that share the first one's prefix (its system prompt)
/// with prompt tokens from the files (`cached_tokens` > 0, /metrics too) and with exactly the
/// replies of a server without a cache, greedy and seeded-sampled, one at a time and two at
/// once with `--parallel 2`.
#[test]
fn a_prompt_cache_survives_a_restart_and_gives_the_same_replies() {
    let model = synth_model();
    let state = tempfile::tempdir().expect("temp dir");
    let cache = state.path().join("prompt-cache");
    let greedy = json!({"temperature": 0});
    let sampled = json!({"temperature": 0.9, "top_p": 0.95, "seed": 17});
    let requests = [
        ask("What is the first thing?", &greedy),
        ask("And the second one, please?", &greedy),
        ask("Tell me a third thing.", &sampled),
    ];
    let want: Vec<Value> = {
        let plain = Server::start(model.path(), 1, None);
        requests.iter().map(|r| plain.chat(r).0).collect()
    };
    {
        let first = Server::start(model.path(), 1, Some((&cache, 1 << 30)));
        let (got, cached) = first.chat(&requests[0]);
        assert_eq!(got, want[0]);
        assert_eq!(cached, 0, "nothing is cached yet");
    }
    let (written, bytes) = files(&cache);
    assert!(
        !written.is_empty() && bytes > 0,
        "the prompt's chunks are on disk"
    );
    // A restart: nothing in RAM, the files on disk.
    let again = Server::start(model.path(), 1, Some((&cache, 1 << 30)));
    for k in 1..3 {
        let (got, cached) = again.chat(&requests[k]);
        assert_eq!(got, want[k], "request {k}");
        assert!(cached >= 64, "request {k}: {cached} cached tokens");
    }
    assert!(again.metric("stormo_prompt_cache_tokens_total") >= 64.0);
    drop(again);
    // Two at once, batched, after another restart: both load the shared prefix.
    let batched = Server::start(model.path(), 2, Some((&cache, 1 << 30)));
    let addr = batched.addr;
    let handles: Vec<_> = [1, 2]
        .map(|k| {
            let body = requests[k].clone();
            std::thread::spawn(move || chat(addr, &body))
        })
        .into_iter()
        .collect();
    for (k, h) in [1, 2].into_iter().zip(handles) {
        let (got, cached) = h.join().expect("the client thread");
        assert_eq!(got, want[k], "batched request {k}");
        assert!(cached >= 64, "batched request {k}: {cached} cached tokens");
    }
}

/// Cache files cut or changed on disk (and a stray file of junk) are not trusted: the server
/// starts, answers exactly as without a cache, removes what did not load (counted in
/// /metrics), and writes the chunks again.
#[test]
fn a_corrupt_prompt_cache_file_is_ignored_and_removed() {
    let model = synth_model();
    let state = tempfile::tempdir().expect("temp dir");
    let cache = state.path().join("prompt-cache");
    let greedy = json!({"temperature": 0});
    let req = ask("Something to ask.", &greedy);
    let want = Server::start(model.path(), 1, None).chat(&req).0;
    drop(Server::start(model.path(), 1, Some((&cache, 1 << 30))).chat(&req));
    let (written, _) = files(&cache);
    assert!(!written.is_empty());
    for (i, f) in written.iter().enumerate() {
        let mut b = std::fs::read(f).expect("read");
        if i % 2 == 0 {
            b.truncate(b.len() / 2);
        } else {
            let at = b.len() / 2;
            b[at] ^= 0x40;
        }
        std::fs::write(f, b).expect("write");
    }
    let junk = written[0].with_file_name(format!("{}.kv", "ab".repeat(32)));
    std::fs::write(&junk, b"not a cache file").expect("write");
    let srv = Server::start(model.path(), 1, Some((&cache, 1 << 30)));
    let (got, cached) = srv.chat(&req);
    assert_eq!(got, want);
    assert_eq!(cached, 0, "nothing came from the damaged files");
    assert!(srv.metric("stormo_prompt_cache_rejected_total") >= 1.0);
    // The first chunk's file was removed and written again whole: the next request loads it.
    drop(srv);
    let srv = Server::start(model.path(), 1, Some((&cache, 1 << 30)));
    let (got, cached) = srv.chat(&req);
    assert_eq!(got, want);
    assert!(cached >= 64, "{cached}");
}

/// The folder never holds more than SIZE: with room for a few chunks, many different prompts
/// leave it within the bound after each request, evicting the least recently used (counted in
/// /metrics); a temporary file a crash left is removed at start.
#[test]
fn the_prompt_cache_stays_within_its_size() {
    let model = synth_model();
    let state = tempfile::tempdir().expect("temp dir");
    let cache = state.path().join("prompt-cache");
    let greedy = json!({"temperature": 0});
    // One chunk's size, from a request whose prompt has one or more chunks.
    let one = {
        let dir = tempfile::tempdir().expect("temp dir");
        Server::start(model.path(), 1, Some((dir.path(), 1 << 30))).chat(&ask("x", &greedy));
        let (f, bytes) = files(dir.path());
        bytes / f.len() as u64
    };
    let limit = one * 5 / 2;
    std::fs::create_dir_all(cache.join("leftover")).expect("mkdir");
    let stray = cache.join("leftover").join("crashed.tmp");
    std::fs::write(&stray, vec![0u8; 4096]).expect("write");
    let srv = Server::start(model.path(), 1, Some((&cache, limit)));
    assert!(!stray.exists(), "a temporary file is removed at start");
    for k in 0..6 {
        // Different prompts (they may share the chat format's preamble).
        let body = json!({
            "messages": [{"role": "user", "content": format!("{k} {}", "lorem ipsum dolor ".repeat(25 + k))}],
            "max_tokens": 2, "temperature": 0,
        });
        srv.chat(&body);
        let (f, bytes) = files(&cache);
        assert!(
            bytes <= limit,
            "after request {k}: {bytes} bytes in {f:?} > {limit}"
        );
        assert!(
            !f.is_empty(),
            "after request {k}: the newest prompt's first chunks stay"
        );
    }
    assert!(srv.metric("stormo_prompt_cache_evictions_total") >= 1.0);
    assert!(srv.metric("stormo_prompt_cache_bytes") <= limit as f64);
}
