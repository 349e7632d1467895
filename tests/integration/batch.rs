//! Continuous batching in the engine: several sequences run together through
//! `Model::forward_batch` (prompts in chunks of varying size, joining and leaving at different
//! steps) give, bit for bit, the logits and greedy choices each gets alone through
//! `Model::forward` / `Model::forward_greedy`, and sampled sequences the tokens each draws
//! alone from the whole head. On the oracle fixtures (every instruction set this CPU runs)
//! and on synthetic models of both families. And the HTTP server's queue in
//! front of the batching engine: a waiting request whose client hung up leaves it at once.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use stormo_engine::kernels::{with_isa, Isa};
use stormo_engine::model::{Seq, Want};
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{Batch, LoadOptions, Logits, Model, ScreenStats, Session};
use stormo_simulations::synth::{self, Overrides, Preset, SynthOptions};
use stormo_tests::{fixture, MODEL_FIXTURES};

/// Tokens each sequence generates after its prompt.
const NEW: usize = 6;

/// What one sequence produced: for every step that chose a token, the logits' bits (empty for
/// a greedy choice) and the token.
type Trace = Vec<(Vec<u32>, u32)>;

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|v| v.to_bits()).collect()
}

/// `prompt` alone: the whole prompt in one call, then one token at a time.
fn alone(model: &Model, prompt: &[u32], greedy: bool) -> Trace {
    let mut sess = model.session(prompt.len() + NEW).unwrap();
    let mut trace = Trace::new();
    let mut input = prompt.to_vec();
    for _ in 0..NEW {
        let (lbits, tok) = if greedy {
            (
                Vec::new(),
                model.forward_greedy(&mut sess, &input, None).unwrap().token,
            )
        } else {
            let l = model
                .forward(&mut sess, &input, Logits::Last, None)
                .unwrap();
            (bits(l), stormo_engine::generate::argmax(l))
        };
        trace.push((lbits, tok));
        input = vec![tok];
    }
    trace
}

struct Running {
    sess: Session,
    prompt: Vec<u32>,
    /// Prompt tokens already run.
    done: usize,
    /// The token to run next once the prompt is done.
    next: Option<u32>,
    trace: Trace,
}

/// All prompts through `forward_batch`: sequence `i` joins at step `i`, prompts go in chunks
/// whose size changes from step to step, and a sequence leaves once it has `NEW` tokens.
fn batched(model: &Model, prompts: &[Vec<u32>], greedy: bool) -> Vec<Trace> {
    let vocab = model.config().vocab_size;
    let mut batch = Batch::new();
    let mut all: Vec<Option<Running>> = prompts.iter().map(|_| None).collect();
    let mut finished: Vec<Option<Trace>> = prompts.iter().map(|_| None).collect();
    let mut step = 0;
    while finished.iter().any(Option::is_none) {
        if step < prompts.len() {
            let p = &prompts[step];
            all[step] = Some(Running {
                sess: model.session(p.len() + NEW).unwrap(),
                prompt: p.clone(),
                done: 0,
                next: None,
                trace: Trace::new(),
            });
        }
        let mut inputs: Vec<(usize, Vec<u32>, Want)> = Vec::new();
        for (i, r) in all.iter().enumerate() {
            let Some(r) = r else { continue };
            if let Some(tok) = r.next {
                inputs.push((
                    i,
                    vec![tok],
                    if greedy { Want::Greedy } else { Want::Logits },
                ));
            } else {
                let size = 1 + (step + 3 * i) % r.sess.max_step();
                let end = (r.done + size).min(r.prompt.len());
                let want = match (end == r.prompt.len(), greedy) {
                    (false, _) => Want::Nothing,
                    (true, true) => Want::Greedy,
                    (true, false) => Want::Logits,
                };
                inputs.push((i, r.prompt[r.done..end].to_vec(), want));
            }
        }
        // Sessions in the order of `inputs` (ascending `i`).
        let mut seqs: Vec<Seq<'_>> = Vec::new();
        let mut it = inputs.iter();
        for r in all.iter_mut().flatten() {
            let (_, tokens, want) = it.next().expect("one input per running sequence");
            seqs.push(Seq {
                session: &mut r.sess,
                tokens,
                want: *want,
            });
        }
        model.forward_batch(&mut batch, &mut seqs).unwrap();
        drop(seqs);
        for (j, (i, tokens, want)) in inputs.iter().enumerate() {
            let r = all[*i].as_mut().expect("running");
            if r.next.is_none() {
                r.done += tokens.len();
            }
            let got = match want {
                Want::Nothing => continue,
                Want::Greedy => (Vec::new(), batch.choice(j, vocab).unwrap().token),
                Want::Logits => {
                    let l = batch.logits(j, vocab).unwrap();
                    (bits(l), stormo_engine::generate::argmax(l))
                }
                Want::Sample => unreachable!("this driver asks for no draw"),
            };
            r.next = Some(got.1);
            r.trace.push(got);
            if r.trace.len() == NEW {
                finished[*i] = Some(std::mem::take(&mut r.trace));
                all[*i] = None;
            }
        }
        step += 1;
    }
    finished.into_iter().map(|t| t.expect("finished")).collect()
}

/// Four prompts of different lengths (one longer than a prefill block).
fn prompts(vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    [9, 1, 23, 5]
        .iter()
        .map(|&n| (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect())
        .collect()
}

fn check(dir: &Path, name: &str, opts: &LoadOptions, greedy: bool) {
    let model = Model::load(dir, opts).unwrap();
    let prompts = prompts(model.config().vocab_size, 11);
    let together = batched(&model, &prompts, greedy);
    for (i, p) in prompts.iter().enumerate() {
        let want = alone(&model, p, greedy);
        assert_eq!(
            together[i], want,
            "{name}: sequence {i} (prompt of {} tokens) batched differs from alone ({opts:?}, greedy {greedy})",
            p.len()
        );
    }
}

#[test]
fn batched_sequences_equal_each_alone_on_the_fixtures() {
    for name in MODEL_FIXTURES {
        let dir = fixture(name);
        for isa in Isa::available() {
            with_isa(isa, || {
                let opts = LoadOptions {
                    prefill_block: 4,
                    ..LoadOptions::default()
                };
                check(&dir, name, &opts, false);
                check(&dir, name, &opts, true);
            });
        }
        // The approximate opt-ins are computed per row too: batching changes none of their
        // bits either; and greedy choices through the screened head.
        for opts in [
            LoadOptions {
                prefill_block: 8,
                screened_head: true,
                ..LoadOptions::default()
            },
            LoadOptions {
                prefill_block: 8,
                int8_experts: true,
                int8_attn_head: true,
                ..LoadOptions::default()
            },
        ] {
            check(&dir, name, &opts, true);
            check(&dir, name, &opts, false);
        }
    }
}

#[test]
fn batched_sequences_equal_each_alone_on_synthetic_models() {
    for preset in [Preset::GptOss20b, Preset::Qwen3_30bA3b] {
        let tmp = tempfile::tempdir().unwrap();
        let o = Overrides {
            layers: Some(2),
            hidden: Some(128),
            intermediate: Some(64),
            experts: Some(8),
            top_k: Some(2),
            vocab: Some(512),
            heads: Some(4),
            kv_heads: Some(2),
            head_dim: Some(32),
        };
        let opts = SynthOptions::new(preset.geometry().with(&o), 5);
        let plan = synth::plan(&opts).unwrap();
        synth::write(&plan, tmp.path(), false, &mut |_| {}).unwrap();
        let load = LoadOptions {
            prefill_block: 5,
            ..LoadOptions::default()
        };
        check(tmp.path(), preset.name(), &load, false);
        check(tmp.path(), preset.name(), &load, true);
    }
}

/// `prompt` alone, each token drawn by a sampler with `params` from the whole head's logits
/// (`Model::forward`, then `Sampler::sample`; the penalty over prompt and output).
fn alone_sampled(model: &Model, prompt: &[u32], params: SamplingParams) -> Vec<u32> {
    let mut sess = model.session(prompt.len() + NEW).unwrap();
    let mut sampler = Sampler::new(params).unwrap();
    let mut history = prompt.to_vec();
    let mut input = prompt.to_vec();
    for _ in 0..NEW {
        let l = model
            .forward(&mut sess, &input, Logits::Last, None)
            .unwrap();
        let tok = sampler.sample(l, &history).unwrap();
        history.push(tok);
        input = vec![tok];
    }
    history.split_off(prompt.len())
}

/// A sequence drawing its tokens in a batch.
struct Drawing {
    sess: Session,
    sampler: Sampler,
    /// Prompt, then the tokens drawn.
    history: Vec<u32>,
    prompt: usize,
    /// Prompt tokens already run.
    done: usize,
}

/// All prompts together through `forward_batch` (prompts in chunks of a prefill block), each
/// token drawn with `Want::Sample` and `Model::batch_sample` by the sequence's own sampler;
/// the tokens drawn and the sessions' screen statistics summed.
fn batched_sampled(
    model: &Model,
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
) -> (Vec<Vec<u32>>, ScreenStats) {
    let mut batch = Batch::new();
    let mut all: Vec<Drawing> = prompts
        .iter()
        .zip(params)
        .map(|(p, &params)| Drawing {
            sess: model.session(p.len() + NEW).unwrap(),
            sampler: Sampler::new(params).unwrap(),
            history: p.clone(),
            prompt: p.len(),
            done: 0,
        })
        .collect();
    let live = |d: &Drawing| d.history.len() < d.prompt + NEW;
    while all.iter().any(live) {
        let mut inputs: Vec<(usize, Vec<u32>, Want)> = Vec::new();
        for (i, d) in all.iter().enumerate().filter(|(_, d)| live(d)) {
            if d.done < d.prompt {
                let end = (d.done + d.sess.max_step()).min(d.prompt);
                let want = if end == d.prompt {
                    Want::Sample
                } else {
                    Want::Nothing
                };
                inputs.push((i, d.history[d.done..end].to_vec(), want));
            } else {
                inputs.push((i, vec![*d.history.last().unwrap()], Want::Sample));
            }
        }
        let mut seqs: Vec<Seq<'_>> = Vec::new();
        let mut it = inputs.iter();
        for d in all.iter_mut().filter(|d| live(d)) {
            let (_, tokens, want) = it.next().expect("one input per live sequence");
            seqs.push(Seq {
                session: &mut d.sess,
                tokens,
                want: *want,
            });
        }
        model.forward_batch(&mut batch, &mut seqs).unwrap();
        drop(seqs);
        for (j, (i, tokens, want)) in inputs.iter().enumerate() {
            let d = &mut all[*i];
            if d.done < d.prompt {
                d.done += tokens.len();
            }
            if *want == Want::Sample {
                let tok = model
                    .batch_sample(&mut batch, j, &mut d.sess, &mut d.sampler, &d.history)
                    .unwrap();
                d.history.push(tok);
            }
        }
    }
    let mut stats = ScreenStats::default();
    for d in &all {
        let s = d.sess.screen_stats();
        stats.screened += s.screened;
        stats.exact_rows += s.exact_rows;
        stats.full += s.full;
    }
    let drawn = all
        .into_iter()
        .map(|mut d| d.history.split_off(d.prompt))
        .collect();
    (drawn, stats)
}

/// Sampling settings the sampled tests go through: temperature alone (the race), top-k,
/// top-p, both, a repetition penalty, and greedy with a penalty.
pub(crate) fn sampling_cases() -> Vec<SamplingParams> {
    let p = |temperature, top_k, top_p, repetition_penalty| SamplingParams {
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        seed: 0,
    };
    vec![
        p(0.7, 0, 1.0, 1.0),
        p(1.0, 40, 1.0, 1.0),
        p(0.8, 0, 0.9, 1.0),
        p(0.6, 20, 0.95, 1.1),
        p(0.7, 0, 1.0, 1.3),
        p(1.3, 0, 0.5, 1.0),
        p(0.0, 0, 1.0, 1.2),
    ]
}

/// Sequences sampled together (`Want::Sample`, `Model::batch_sample`) draw, seed for seed,
/// the tokens each draws alone from the whole head's logits, through the screened head and
/// without it, over temperatures, top-k, top-p, penalties and seeds; the screen decides
/// most of the draws, and only with a screen.
#[test]
fn batched_sampled_sequences_draw_the_whole_heads_tokens() {
    let cases = sampling_cases();
    for name in MODEL_FIXTURES {
        let dir = fixture(name);
        let load = |screened_head| {
            let opts = LoadOptions {
                prefill_block: 8,
                screened_head,
                ..LoadOptions::default()
            };
            Model::load(&dir, &opts).unwrap()
        };
        let (plain, screened) = (load(false), load(true));
        assert!(screened.has_screened_head() && !plain.has_screened_head());
        let vocab = plain.config().vocab_size;
        let mut decided = [0u64; 2];
        for round in 0..cases.len() as u64 {
            let prompts = prompts(vocab, 100 + round);
            let params: Vec<SamplingParams> = (0..prompts.len())
                .map(|i| SamplingParams {
                    seed: round * 31 + i as u64,
                    ..cases[(round as usize + i) % cases.len()]
                })
                .collect();
            let want: Vec<Vec<u32>> = prompts
                .iter()
                .zip(&params)
                .map(|(p, &s)| alone_sampled(&plain, p, s))
                .collect();
            for model in [&plain, &screened] {
                let (got, stats) = batched_sampled(model, &prompts, &params);
                assert_eq!(
                    got,
                    want,
                    "{name} round {round}, screened head {}: {params:?}",
                    model.has_screened_head()
                );
                assert_eq!(stats.screened + stats.full, (prompts.len() * NEW) as u64);
                if model.has_screened_head() {
                    decided[0] += stats.screened;
                    decided[1] += stats.full;
                } else {
                    assert_eq!(stats.screened, 0, "{name}: no screen, no screened draw");
                }
            }
        }
        eprintln!(
            "{name}: drawn through the screen {}, whole head {}",
            decided[0], decided[1]
        );
        assert!(
            decided[0] > decided[1],
            "{name}: the screen decided {} of {} draws",
            decided[0],
            decided[0] + decided[1]
        );
    }
}

/// Sends one HTTP request on a new connection and returns it unread.
pub(crate) fn open_request(addr: SocketAddr, path: &str, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body.as_bytes()).expect("write body");
    s
}

/// Reads from `s` until what was read contains `want`; what was read.
pub(crate) fn read_until(s: &mut TcpStream, want: &str) -> String {
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains(want) {
        let n = s.read(&mut buf).expect("the response goes on");
        assert!(n > 0, "the response ended before {want:?}: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    seen
}

/// The value of metric `name` in a `/metrics` scrape of `addr`.
pub(crate) fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (st, text) = crate::http::request(addr, "GET", "/metrics", b"");
    assert_eq!(st, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} in\n{text}"))
}

/// Issue 58 item 7: requests waiting in the HTTP queue whose clients hang up (a whole answer
/// and a stream) give their places back at once, so live clients are not turned away with
/// 429 by requests nobody waits for; the running request is not disturbed.
///
/// One request runs (`--parallel 1`), two wait (`--queue 2`), a third is refused. The
/// waiting two hang up: within a second the queue is empty while the first still runs (it
/// has generated fewer tokens than it will, and it ends with all of them), and two new
/// requests are taken, a third refused again.
#[test]
fn a_queued_http_request_whose_client_hung_up_leaves_the_queue_at_once() {
    const LONG: u64 = 3000;
    let srv = crate::http::Server::start_with(2, 4096, |c| c.parallel = 1);
    let a = srv.addr;
    let long = json!({ "prompt": "Once upon a time", "max_tokens": LONG, "stream": true,
                       "temperature": 0, "stream_options": { "include_usage": true } });
    let mut running = open_request(a, "/v1/completions", &long);
    // It streams: it holds the engine's one slot now.
    let mut first = read_until(&mut running, "data: ");
    let chat = |stream: bool| {
        json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 4,
                "stream": stream })
    };
    let whole = open_request(
        a,
        "/v1/completions",
        &json!({ "prompt": "hi", "max_tokens": 4 }),
    );
    // A stream sends its head only once the request runs: while it waits, nothing.
    let streamed = open_request(a, "/v1/chat/completions", &chat(true));
    let t0 = Instant::now();
    while metric(a, "stormo_queue_depth") < 2.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "two requests queue");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (st, v) = crate::http::post(
        a,
        "/v1/completions",
        &json!({ "prompt": "hi", "max_tokens": 1 }),
    );
    crate::http::assert_openai_error(st, &v, 429, "rate_limit_error", "the queue is full");

    drop((whole, streamed));
    let t0 = Instant::now();
    let (depth, active, tokens) = loop {
        let depth = metric(a, "stormo_queue_depth");
        let active = metric(a, "stormo_active_requests");
        let tokens = metric(a, "stormo_tokens_generated_total");
        if depth == 0.0 || t0.elapsed() > Duration::from_secs(5) {
            break (depth, active, tokens);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = t0.elapsed();
    assert_eq!(
        depth, 0.0,
        "the hung-up requests still queue after {took:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "the queue emptied only after {took:?}"
    );
    // The running request still held the engine: the queue emptied because its requests
    // left, not because they ran.
    assert_eq!(active, 1.0);
    assert!(
        tokens < LONG as f64,
        "the long request had ended: {tokens} tokens"
    );

    // Two new requests are taken (they wait in the queue), a third is not.
    let taken: Vec<_> = (0..2)
        .map(|_| open_request(a, "/v1/chat/completions", &chat(true)))
        .collect();
    let t0 = Instant::now();
    while metric(a, "stormo_queue_depth") < 2.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "two new requests queue"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (st, v) = crate::http::post(
        a,
        "/v1/completions",
        &json!({ "prompt": "hi", "max_tokens": 1 }),
    );
    crate::http::assert_openai_error(st, &v, 429, "rate_limit_error", "the queue is full again");
    drop(taken);

    // The running request was not disturbed: it ends with every token it asked for.
    running
        .read_to_string(&mut first)
        .expect("the long request's stream");
    let usage = first
        .split("\n\n")
        .filter_map(|e| {
            e.trim_start_matches(|c: char| c != 'd')
                .strip_prefix("data: ")
        })
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    assert_eq!(usage, Some(LONG), "the long request's usage");
}
