//! Continuous batching through the HTTP server (a perf-style binary, `harness = false`), in
//! one run, side by side:
//!
//! 1. aggregate decode tokens/s with 1, 2, 4 and 8 concurrent greedy streams (counted over the
//!    window in which every stream decodes: from the last stream's first token to the first
//!    stream's last), and the ratio to one stream;
//! 2. time to first token of a new request (a prompt of `STORMO_BENCH_PROMPT` ids) on an idle
//!    server, and while 4 other streams decode.
//!
//! The server is `stormo serve --http`'s (`http::start`, `--parallel 8`) on loopback; clients
//! are plain threads speaking HTTP/1.1 to `/v1/completions` with token-id prompts and
//! `logprobs: 0`, so every streamed chunk names the tokens it carries.
//!
//! ```sh
//! # the figures: a model at gpt-oss-20b geometry (about 13 GB on disk), on a quiet machine
//! stormo synth --preset gpt-oss-20b --tokenizer fixtures/o200k-harmony/tokenizer.json --out /tmp/g20
//! STORMO_BENCH_MODEL=/tmp/g20 cargo bench -p stormo-cli --bench batching
//! # a smoke run on a tiny synthetic model (written to a scratch folder; figures mean nothing)
//! cargo bench -p stormo-cli --bench batching
//! ```
//!
//! `STORMO_BENCH_TOKENS` (tokens per stream, default 64) and `STORMO_BENCH_PROMPT` (default
//! 512) change the sizes.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use stormo_cli::cmd::chat::load_text_model;
use stormo_engine::LoadOptions;
use stormo_node::config::{ExpertsConfig, NodeConfig};
use stormo_node::http::{self, HttpConfig};
use stormo_simulations::synth::{self, Overrides, Preset, SynthOptions};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What one stream saw: when each token arrived.
struct Stream {
    sent: Instant,
    tokens: Vec<Instant>,
}

/// Sends a streamed greedy completion of `prompt` and records its tokens' arrival until it
/// ends or `stop` is set (then the connection is dropped: the server cancels the request).
fn stream(
    addr: SocketAddr,
    prompt: &[u32],
    max_tokens: usize,
    stop: &AtomicBool,
    decoding: &AtomicUsize,
) -> anyhow::Result<Stream> {
    let body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "stream": true,
    })
    .to_string();
    let mut s = TcpStream::connect(addr).context("connect")?;
    s.set_read_timeout(Some(Duration::from_millis(200)))?;
    let sent = Instant::now();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let mut tokens = Vec::new();
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => continue,
            Err(e) => return Err(e.into()),
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            if line.starts_with("HTTP/1.1 ") && !line.contains(" 200 ") {
                anyhow::bail!("server answered {}", line.trim_end());
            }
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).context("a streamed chunk")?;
        if let Some(e) = v.get("error") {
            anyhow::bail!("server error: {e}");
        }
        let n = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .map_or(0, Vec::len);
        if n > 0 && tokens.is_empty() {
            decoding.fetch_add(1, Ordering::Relaxed);
        }
        let now = Instant::now();
        tokens.extend(std::iter::repeat_n(now, n));
    }
    Ok(Stream { sent, tokens })
}

/// `n` distinct prompts of `len` ids from `seed`.
fn prompts(n: usize, len: usize, seed: u64, vocab: u32) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Ids below 200000: ordinary tokens of o200k (no special ones).
                    (x % u64::from(vocab.min(200_000))) as u32
                })
                .collect()
        })
        .collect()
}

/// Aggregate tokens/s of `n` concurrent streams over the window where all decode, and the
/// tokens counted in it.
fn concurrent(
    addr: SocketAddr,
    n: usize,
    tokens: usize,
    seed: u64,
    vocab: u32,
) -> anyhow::Result<(f64, usize)> {
    let ps = prompts(n, 16, seed, vocab);
    let go = Arc::new(Barrier::new(n));
    let handles: Vec<_> = ps
        .into_iter()
        .map(|p| {
            let go = go.clone();
            std::thread::spawn(move || {
                go.wait();
                stream(
                    addr,
                    &p,
                    tokens,
                    &AtomicBool::new(false),
                    &AtomicUsize::new(0),
                )
            })
        })
        .collect();
    let streams = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(
        streams.iter().all(|s| s.tokens.len() >= 2),
        "a stream ended before its second token (the model chose a stop token)"
    );
    let start = streams.iter().map(|s| s.tokens[0]).max().expect("streams");
    let end = streams
        .iter()
        .map(|s| *s.tokens.last().expect("tokens"))
        .min()
        .expect("streams");
    let counted: usize = streams
        .iter()
        .map(|s| s.tokens.iter().filter(|&&t| t > start && t <= end).count())
        .sum();
    let secs = end.saturating_duration_since(start).as_secs_f64();
    anyhow::ensure!(
        secs > 0.0 && counted > 0,
        "the streams never decoded together (one ended before another began)"
    );
    Ok((counted as f64 / secs, counted))
}

/// Time to first token of a `prompt_len`-id prompt, with `others` streams decoding meanwhile,
/// and how many of them got tokens while its prompt was read (one ends early if the model
/// chooses a stop token or fills the context).
fn ttft(
    addr: SocketAddr,
    (prompt_len, context): (usize, usize),
    others: usize,
    seed: u64,
    vocab: u32,
) -> anyhow::Result<(f64, usize)> {
    let stop = Arc::new(AtomicBool::new(false));
    let decoding = Arc::new(AtomicUsize::new(0));
    let background: Vec<_> = prompts(others, 16, seed, vocab)
        .into_iter()
        .map(|p| {
            let (stop, decoding) = (stop.clone(), decoding.clone());
            // A stream long enough to outlast the measurement (as long as the context lets
            // it: more is refused with 400); cut when it is done.
            std::thread::spawn(move || stream(addr, &p, context - 16, &stop, &decoding))
        })
        .collect();
    // The others are decoding (each has its first token) before the new request is sent; one
    // that ended before (refused, failed) ends the measurement with its error.
    while decoding.load(Ordering::Relaxed) < others {
        if let Some(i) = background.iter().position(|h| h.is_finished()) {
            stop.store(true, Ordering::Relaxed);
            let mut background = background;
            let r = background.swap_remove(i).join().expect("background thread");
            r?;
            anyhow::bail!("a background stream ended before it decoded");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let p = prompts(1, prompt_len, seed ^ 0xabcd, vocab).remove(0);
    let s = stream(addr, &p, 1, &AtomicBool::new(false), &AtomicUsize::new(0))?;
    stop.store(true, Ordering::Relaxed);
    let first = *s.tokens.first().context("the new request made no token")?;
    let mut along = 0;
    for h in background {
        let bg = h.join().expect("background thread")?;
        along += usize::from(bg.tokens.iter().any(|&b| b > s.sent && b < first));
    }
    Ok((first.duration_since(s.sent).as_secs_f64(), along))
}

fn tiny_model(dir: &Path) -> anyhow::Result<PathBuf> {
    let o = Overrides {
        layers: Some(2),
        hidden: Some(64),
        intermediate: Some(64),
        experts: Some(4),
        top_k: Some(2),
        heads: Some(2),
        kv_heads: Some(1),
        head_dim: Some(32),
        ..Overrides::default()
    };
    let opts = SynthOptions::new(Preset::GptOss20b.geometry().with(&o), 5);
    let plan = synth::plan(&opts)?;
    synth::write(&plan, dir, false, &mut |_| {})?;
    let tok =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/o200k-harmony/tokenizer.json");
    std::fs::copy(&tok, dir.join("tokenizer.json")).with_context(|| tok.display().to_string())?;
    Ok(dir.to_path_buf())
}

fn main() -> anyhow::Result<()> {
    let tokens = env("STORMO_BENCH_TOKENS", 64).max(4);
    let prompt = env("STORMO_BENCH_PROMPT", 512).max(1);
    let scratch = tempfile::tempdir()?;
    let model = match std::env::var_os("STORMO_BENCH_MODEL") {
        Some(d) => PathBuf::from(d),
        None => {
            eprintln!("no STORMO_BENCH_MODEL: a tiny synthetic model (a smoke run)");
            tiny_model(scratch.path())?
        }
    };
    let context = (prompt + tokens + 64).max(2048);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let tm = load_text_model(
        NodeConfig {
            experts: ExpertsConfig {
                hot_store: false,
                ..ExpertsConfig::default()
            },
            ..NodeConfig::local(&model, context * 8)
        },
        &LoadOptions::default(),
    )?;
    let vocab = tm.model.config().vocab_size as u32;
    let cfg = HttpConfig {
        parallel: 8,
        queue: 8,
        context,
        ..HttpConfig::new("127.0.0.1:0".parse()?)
    };
    let srv = rt.block_on(http::start(tm, cfg))?;
    let addr = srv.local_addr();
    // One untimed request: pages the weights in.
    let (no, zero) = (AtomicBool::new(false), AtomicUsize::new(0));
    stream(addr, &prompts(1, 16, 99, vocab)[0], 4, &no, &zero)?;
    println!("model {}", model.display());
    println!(
        "{:>8} {:>14} {:>16} {:>8} {:>8}",
        "streams", "aggregate t/s", "per stream t/s", "vs 1", "tokens"
    );
    let mut one = None;
    for (i, n) in [1usize, 2, 4, 8].into_iter().enumerate() {
        let (rate, counted) = concurrent(addr, n, tokens, 1000 + i as u64, vocab)?;
        let base = *one.get_or_insert(rate);
        println!(
            "{n:>8} {rate:>14.2} {:>16.2} {:>7.2}x {counted:>8}",
            rate / n as f64,
            rate / base
        );
    }
    let (idle, _) = ttft(addr, (prompt, context), 0, 2000, vocab)?;
    let (busy, along) = ttft(addr, (prompt, context), 4, 3000, vocab)?;
    println!(
        "time to first token, {prompt}-id prompt: {idle:.3} s idle, {busy:.3} s while 4 streams \
         decode ({:.2}x; {along} of the 4 got tokens during its prefill)",
        busy / idle
    );
    srv.close();
    rt.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}
