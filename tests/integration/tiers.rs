//! Placement decides only speed: the same ids and bit-identical logits whether experts are
//! mapped, cached in RAM under any budget, prefetched or not, read from the original checkpoint
//! or from a converted flat store, or computed by an executor (honest; lying but spot-checked;
//! failing). One test body runs across all of these.

use std::path::Path;
use std::sync::{Arc, Mutex};

use stormo_engine::generate::{greedy, Timings};
use stormo_engine::moe::{
    expert_forward, Demand, ExecFailed, Executed, ExpertExecutor, ExpertProvider, ExpertSchema,
    ExpertScratch, MappedExperts, Ticket, Verdict,
};
use stormo_engine::tiers::{store, Tier, TierConfig, TieredExperts};
use stormo_engine::{LoadOptions, Model, ModelFiles};
use stormo_tests::{fixture, Reference, MODEL_FIXTURES};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Budget {
    Minimum,
    Half,
    Everything,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Placement {
    Mapped,
    Tiered {
        budget: Budget,
        prefetch: bool,
    },
    /// Mapped, with an in-process executor taking the odd experts (every expert when
    /// `Lies`, whose answers are all spot-checked).
    Executed(Executor),
}

/// How an in-process executor answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Executor {
    /// Computes the expert as the engine does.
    Honest,
    /// Adds 1e-2 to every output of expert 1 (of every layer); every answer is checked.
    Lies,
    /// Fails every call.
    Fails,
}

fn placements() -> Vec<Placement> {
    let mut v = vec![Placement::Mapped];
    for budget in [Budget::Minimum, Budget::Half, Budget::Everything] {
        for prefetch in [false, true] {
            v.push(Placement::Tiered { budget, prefetch });
        }
    }
    for x in [Executor::Honest, Executor::Lies, Executor::Fails] {
        v.push(Placement::Executed(x));
    }
    v
}

type Answer = Result<Executed, ExecFailed>;

/// An executor in the test's process, computing experts from the mapped checkpoint with
/// [`expert_forward`] when submitted, and recording the verdicts it gets.
#[derive(Debug)]
struct InProcess {
    how: Executor,
    experts: MappedExperts,
    schemas: Vec<Option<ExpertSchema>>,
    /// Each call's expert and answer (taken when collected).
    answers: Mutex<Vec<(usize, Option<Answer>)>>,
    verdicts: Mutex<Vec<(usize, Verdict)>>,
}

impl ExpertExecutor for InProcess {
    fn choose(&self, _layer: usize, demand: &[Demand], delegate: &mut [bool]) {
        for (d, x) in demand.iter().zip(delegate) {
            *x = self.how == Executor::Lies || d.expert % 2 == 1;
        }
    }

    fn submit(&self, layer: usize, expert: usize, inputs: &[f32]) -> Ticket {
        let answer = if self.how == Executor::Fails {
            Err(ExecFailed::Unavailable("the test's executor fails".into()))
        } else {
            let schema = self.schemas[layer].as_ref().expect("an MoE layer");
            let mut data = Vec::new();
            self.experts.fetch(layer, &[expert], &mut data).unwrap();
            let mut s = ExpertScratch::default();
            expert_forward(
                &schema.view(&data[0]),
                inputs,
                schema.hidden,
                schema.intermediate,
                &mut s,
            );
            let mut rows = s.output().to_vec();
            if self.how == Executor::Lies && expert == 1 {
                rows.iter_mut().for_each(|y| *y += 1e-2);
            }
            Ok(Executed {
                rows,
                check: self.how == Executor::Lies,
            })
        };
        let mut a = self.answers.lock().unwrap();
        a.push((expert, Some(answer)));
        Ticket(a.len() as u64 - 1)
    }

    fn collect(&self, ticket: Ticket) -> Result<Executed, ExecFailed> {
        let mut a = self.answers.lock().unwrap();
        a[ticket.0 as usize].1.take().expect("collected once")
    }

    fn report(&self, ticket: Ticket, verdict: Verdict) {
        let e = self.answers.lock().unwrap()[ticket.0 as usize].0;
        self.verdicts.lock().unwrap().push((e, verdict));
    }
}

struct Outcome {
    ids: Vec<u32>,
    logits: Vec<f32>,
    stats: Option<stormo_engine::tiers::ExpertStats>,
    executor: Option<Arc<InProcess>>,
}

fn generate(dir: &Path, placement: Placement, prompt: &[u32], n: usize, block: usize) -> Outcome {
    let files = ModelFiles::open(dir).unwrap();
    let mut tiered = None;
    let mut executor = None;
    let provider: Arc<dyn ExpertProvider> = match placement {
        Placement::Mapped => Arc::new(files.mapped_experts().unwrap()),
        Placement::Executed(how) => {
            let x = Arc::new(InProcess {
                how,
                experts: files.mapped_experts().unwrap(),
                schemas: files.layout.schemas.clone(),
                answers: Mutex::default(),
                verdicts: Mutex::default(),
            });
            executor = Some(x);
            Arc::new(files.mapped_experts().unwrap())
        }
        Placement::Tiered { budget, prefetch } => {
            let sizes = files.layout.sizes();
            let total: u64 = sizes.iter().flatten().sum();
            let budget = match budget {
                Budget::Minimum => 0,
                Budget::Half => total / 2,
                Budget::Everything => total,
            };
            let disk: Arc<dyn Tier> = Arc::new(files.disk_tier(3, None).unwrap());
            let cfg = TierConfig {
                budget,
                prefetch,
                ..TierConfig::default()
            };
            let t = Arc::new(TieredExperts::new(vec![disk], sizes, files.cfg.top_k, &cfg));
            tiered = Some(t.clone());
            t
        }
    };
    let mut model = Model::new(
        files,
        provider,
        &LoadOptions {
            prefill_block: block,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    if let Some(x) = &executor {
        model = model.with_executor(x.clone());
    }
    let mut sess = model.session(prompt.len() + n).unwrap();
    let mut logits = Vec::new();
    let ids = greedy(
        &model,
        &mut sess,
        prompt,
        n,
        &[],
        |_, l| logits.extend_from_slice(l),
        &mut Timings::default(),
    )
    .unwrap();
    Outcome {
        ids,
        logits,
        stats: tiered.map(|t| t.stats()),
        executor,
    }
}

#[test]
fn placement_decides_only_speed() {
    for name in MODEL_FIXTURES {
        let dir = fixture(name);
        let r = Reference::open(&dir);
        let prompt = r.ids("input_ids");
        let want = r.ids("generated_ids");
        let n = 12;
        let converted = tempfile::tempdir().unwrap();
        let store_dir = converted.path().join("store");
        store::convert(&dir, &store_dir, |_, _| {}).unwrap();
        let base = generate(&dir, Placement::Mapped, &prompt, n, 64);
        assert_eq!(base.ids, want[..n], "{name}: mapped ids");
        for src in [&dir, &store_dir] {
            for p in placements() {
                let o = generate(src, p, &prompt, n, 64);
                assert_eq!(o.ids, base.ids, "{name} {p:?} from {}", src.display());
                assert!(
                    o.logits
                        .iter()
                        .zip(&base.logits)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} {p:?} from {}: logits differ",
                    src.display()
                );
                if let Some(x) = &o.executor {
                    let calls = x.answers.lock().unwrap().len();
                    assert!(calls > 0, "{name} {p:?}: nothing delegated");
                    let v = x.verdicts.lock().unwrap();
                    if p == Placement::Executed(Executor::Lies) {
                        assert_eq!(v.len(), calls, "{name}: every answer checked");
                        assert!(
                            v.contains(&(1, Verdict::Disagreed)),
                            "{name}: lie not caught"
                        );
                        for &(e, verdict) in v.iter() {
                            assert_eq!(verdict == Verdict::Disagreed, e == 1, "{name} expert {e}");
                        }
                    } else {
                        assert!(v.is_empty(), "{name} {p:?}: {v:?}");
                    }
                }
                if let (Placement::Tiered { budget, prefetch }, Some(s)) = (p, &o.stats) {
                    assert!(s.requests > 0);
                    assert_eq!(s.tiers[0].failures, 0);
                    if !prefetch {
                        assert_eq!(s.prefetch_used + s.prefetch_wasted, 0, "{p:?}");
                    }
                    if let Budget::Minimum = budget {
                        assert!(s.tiers[0].loads > 0);
                    }
                }
            }
        }
    }
}

/// With prefetch on and room in the budget, predictions are issued and some are used.
#[test]
fn prefetch_predicts_and_is_used() {
    let dir = fixture("gptoss-tiny-mxfp4");
    let r = Reference::open(&dir);
    let prompt = r.ids("input_ids");
    let o = generate(
        &dir,
        Placement::Tiered {
            budget: Budget::Half,
            prefetch: true,
        },
        &prompt,
        8,
        16,
    );
    let s = o.stats.unwrap();
    assert!(s.prefetch_used > 0, "{s:?}");
}

/// A checkpoint file that shrinks while the engine runs gives a clear error, never garbage.
#[test]
fn truncated_while_running_is_an_error() {
    let src = fixture("gptoss-tiny-mxfp4");
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), d.path().join(f)).unwrap();
    }
    let files = ModelFiles::open(d.path()).unwrap();
    let disk: Arc<dyn Tier> = Arc::new(files.disk_tier(2, None).unwrap());
    let cfg = TierConfig {
        budget: 0,
        prefetch: false,
        ..TierConfig::default()
    };
    let t = Arc::new(TieredExperts::new(
        vec![disk],
        files.layout.sizes(),
        files.cfg.top_k,
        &cfg,
    ));
    let model = Model::new(files, t, &LoadOptions::default()).unwrap();
    let mut sess = model.session(64).unwrap();
    model
        .forward(&mut sess, &[1, 2, 3], stormo_engine::Logits::Last, None)
        .unwrap();
    // shrink the file (the dense part stays mapped and readable: only expert bytes go)
    let p = d.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let mut err = None;
    for tok in 4..40u32 {
        if let Err(e) = model.forward(&mut sess, &[tok], stormo_engine::Logits::Last, None) {
            err = Some(e.to_string());
            break;
        }
    }
    let err = err.expect("a shrunken file must fail a later expert read");
    assert!(
        err.contains("model.safetensors") && err.contains("changed size"),
        "{err}"
    );
}

/// What a process needs beside its budget, dense weights and KV cache: the binary's pages,
/// thread stacks, scratch activations, I/O buffers in flight and the allocator's slack. The
/// README states this figure.
const RSS_OVERHEAD: u64 = 48 << 20;

/// The JSON report of `stormo bench` on `dir` (a child process, so its peak RSS is its own)
/// with small probes and no hot-store, plus `args`.
fn bench_json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(crate::demo::stormo_exe())
        .args(["bench", "--model"])
        .arg(dir)
        .args([
            "--mem-test",
            "1MiB",
            "--disk-test",
            "0",
            "--no-hot-store",
            "--json",
        ])
        .args(args)
        .output()
        .expect("running stormo bench");
    assert!(
        out.status.success(),
        "stormo bench {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bench JSON")
}

/// Peak resident memory of `stormo bench` with a 64-token prompt and `placement`.
fn bench_peak_rss(dir: &Path, placement: &[&str]) -> u64 {
    let mut args = vec!["--prompt-tokens", "64", "--decode-tokens", "8"];
    args.extend_from_slice(placement);
    bench_json(dir, &args)["peak_rss_bytes"]
        .as_u64()
        .expect("peak_rss_bytes")
}

/// A 2-layer synthetic model of `hidden`, `intermediate` and `experts` in `dir`.
fn synth_small(dir: &Path, hidden: &str, intermediate: &str, experts: &str) {
    let out = dir.to_str().unwrap();
    crate::demo::synth(&[
        "--layers",
        "2",
        "--hidden",
        hidden,
        "--intermediate",
        intermediate,
        "--experts",
        experts,
        "--vocab",
        "1000",
        "--out",
        out,
    ])
    .unwrap();
}

/// `--threads N` (and `-t N`) is the number of threads the engine computes on, whatever the
/// machine's core count (3 on a 2-core machine is 3).
#[test]
fn threads_option_sets_the_engine_threads() {
    let dir = tempfile::tempdir().unwrap();
    synth_small(dir.path(), "64", "64", "4");
    let short = ["--prompt-tokens", "4", "--decode-tokens", "2"];
    for (t, flag) in [(1u64, "--threads"), (3, "-t")] {
        let mut args = short.to_vec();
        let n = t.to_string();
        args.extend([flag, n.as_str()]);
        assert_eq!(bench_json(dir.path(), &args)["threads"], t, "{args:?}");
    }
}

/// Memory is bounded: with experts larger than the budget, peak RSS stays within budget +
/// dense + KV + the stated overhead, where mapping the experts instead exceeds that bound.
#[test]
fn peak_rss_stays_within_the_expert_budget() {
    let dir = tempfile::tempdir().unwrap();
    synth_small(dir.path(), "512", "2048", "64");
    let files = ModelFiles::open(dir.path()).unwrap();
    let all: u64 = files.layout.sizes().iter().flatten().sum();
    let fixed =
        stormo_node::experts::dense_bytes(&files) + stormo_node::experts::kv_bytes(&files, 72);
    for budget in [8u64 << 20, 48 << 20] {
        assert!(
            budget * 3 < all,
            "the experts ({all} bytes) must dwarf the budget"
        );
        let arg = format!("{}MiB", budget >> 20);
        let peak = bench_peak_rss(dir.path(), &["--expert-cache", &arg]);
        let bound = fixed + budget + RSS_OVERHEAD;
        eprintln!(
            "budget {arg}: peak RSS {} MiB, bound {} MiB (experts {} MiB, dense + KV {} MiB)",
            peak >> 20,
            bound >> 20,
            all >> 20,
            fixed >> 20
        );
        assert!(peak <= bound, "budget {arg}: peak RSS {peak} above {bound}");
    }
    let mapped = bench_peak_rss(dir.path(), &["--mmap-experts"]);
    eprintln!("mapped experts: peak RSS {} MiB", mapped >> 20);
    assert!(
        mapped > fixed + (48 << 20) + RSS_OVERHEAD,
        "mapped experts should exceed the bound the budgets keep ({mapped})"
    );
}

/// `stormo bench --warm` with a budget that holds every expert loads them all before timing
/// (so nothing is read from disk while decoding), and its untimed forward pass runs with a
/// prompt shorter than the pass. (That the pass leaves the dense weights in the page cache
/// is not observable here.) The screened head's options report what they did.
#[test]
fn bench_warm_makes_experts_resident_with_short_prompts() {
    let dir = tempfile::tempdir().unwrap();
    synth_small(dir.path(), "256", "512", "16");
    let v = bench_json(
        dir.path(),
        &[
            "--warm",
            "--expert-cache",
            "256MiB",
            "--prompt-tokens",
            "3",
            "--decode-tokens",
            "6",
        ],
    );
    assert_eq!(v["prefill"][0]["tokens"].as_u64(), Some(3), "{v}");
    assert_eq!(v["decode"]["tokens"].as_u64(), Some(6), "{v}");
    assert_eq!(
        v["decode"]["disk_bytes_per_token"].as_f64(),
        Some(0.0),
        "every expert resident after --warm: {v}"
    );
    // The kernel bound is judged by the kernels' rates sampled between the decoded tokens:
    // the bound is the token's bytes at those medians.
    for kernel in ["bf16", "mxfp4"] {
        let d = &v["kernel_stream_gb_s"][kernel]["during_decode"];
        let [min, median, max] = ["min", "median", "max"].map(|k| d[k].as_f64().unwrap_or(0.0));
        assert!(0.0 < min && min <= median && median <= max, "{kernel}: {v}");
    }
    let (dense, experts) = (
        v["kernel_stream_gb_s"]["bf16"]["during_decode"]["median"].as_f64(),
        v["kernel_stream_gb_s"]["mxfp4"]["during_decode"]["median"].as_f64(),
    );
    let bound = v["decode_kernel_bound_tok_s"]
        .as_f64()
        .expect("kernel bound");
    let (lo, hi) = (
        dense.unwrap().min(experts.unwrap()),
        dense.unwrap().max(experts.unwrap()),
    );
    let bpt = v["bytes_per_decoded_token"]
        .as_f64()
        .expect("bytes per token");
    assert!(
        lo * 1e9 / bpt <= bound * 1.000_001 && bound <= hi * 1e9 / bpt * 1.000_001,
        "the bound lies between the token's bytes at the slower and at the faster rate: {v}"
    );
    // Where the decode's time went: every phase timed, together no more than the decode took
    // (the bandwidth probe between tokens is outside them), and their bytes are the token's.
    let phases = v["decode"]["phases"].as_object().expect("decode.phases");
    let names: Vec<&str> = phases.keys().map(String::as_str).collect();
    for p in [
        "qkv",
        "attention",
        "o_proj",
        "router",
        "expert_fetch",
        "experts",
        "head",
    ] {
        assert!(names.contains(&p), "{p} missing from {names:?}");
    }
    let ms: f64 = phases
        .values()
        .map(|p| p["ms_per_token"].as_f64().expect("ms_per_token"))
        .sum();
    let per_token_ms = v["decode"]["seconds"].as_f64().unwrap() * 1e3 / 6.0;
    assert!(
        ms > 0.0 && ms <= per_token_ms * 1.001,
        "{ms} of {per_token_ms}: {v}"
    );
    for p in ["qkv", "experts", "head"] {
        assert!(
            phases[p]["ms_per_token"].as_f64().unwrap() > 0.0,
            "{p}: {v}"
        );
    }
    let phase_bytes: u64 = phases
        .values()
        .map(|p| p["bytes_per_token"].as_u64().expect("bytes_per_token"))
        .sum();
    assert_eq!(
        Some(phase_bytes),
        v["bytes_per_decoded_token"].as_u64(),
        "{v}"
    );
    // Where the prefill's time went: the same phases, together no more than it took, the
    // experts and the projections among them.
    let pp = v["prefill"][0]["phases"]
        .as_object()
        .expect("prefill[].phases");
    assert_eq!(
        pp.keys().collect::<Vec<_>>(),
        phases.keys().collect::<Vec<_>>(),
        "{v}"
    );
    let ms: f64 = pp
        .values()
        .map(|p| p["ms_per_token"].as_f64().expect("ms_per_token"))
        .sum();
    let per_token_ms = v["prefill"][0]["seconds"].as_f64().unwrap() * 1e3 / 3.0;
    assert!(
        ms > 0.0 && ms <= per_token_ms * 1.001,
        "{ms} of {per_token_ms}: {v}"
    );
    for p in ["qkv", "experts"] {
        assert!(pp[p]["ms_per_token"].as_f64().unwrap() > 0.0, "{p}: {v}");
    }
    // Greedy decoding goes through the screened head by default: fewer bytes per token.
    assert_eq!(v["screened_head"], true, "{v}");
    let bytes = |v: &serde_json::Value, k: &str| v[k].as_u64().expect(k);
    assert!(
        bytes(&v, "bytes_per_decoded_token") < bytes(&v, "bytes_per_decoded_token_full_head"),
        "{v}"
    );
    let short = ["--prompt-tokens", "3", "--decode-tokens", "4"];
    let full = bench_json(dir.path(), &[&short[..], &["--full-head"]].concat());
    assert_eq!(full["screened_head"], false, "{full}");
    assert_eq!(
        bytes(&full, "bytes_per_decoded_token"),
        bytes(&v, "bytes_per_decoded_token_full_head")
    );
    let paired = bench_json(dir.path(), &[&short[..], &["--pair-full-head"]].concat());
    for k in ["screened_head", "full_head"] {
        let tok_s = paired["paired_tok_s"][k].as_f64().unwrap_or(0.0);
        assert!(tok_s > 0.0, "{k}: {paired}");
    }
    let prefetch = bench_json(
        dir.path(),
        &[&short[..], &["--pair-prefetch", "0,4KiB"]].concat(),
    );
    let p = &prefetch["paired_prefetch"];
    assert_eq!(p["bytes"], serde_json::json!([0, 4096]), "{prefetch}");
    for k in 0..2 {
        assert!(p["tok_s"][k].as_f64().unwrap_or(0.0) > 0.0, "{prefetch}");
    }
    assert!(
        p["median_pair_ratio"].as_f64().unwrap_or(0.0) > 0.0,
        "{prefetch}"
    );
    assert!(v["paired_prefetch"].is_null(), "{v}");
    let tasks = bench_json(dir.path(), &[&short[..], &["--pair-tasks", "6,1"]].concat());
    let p = &tasks["paired_tasks"];
    assert_eq!(p["tasks_per_thread"], serde_json::json!([6, 1]), "{tasks}");
    for k in 0..2 {
        assert!(p["tok_s"][k].as_f64().unwrap_or(0.0) > 0.0, "{tasks}");
    }
    assert!(tasks["paired_prefetch"].is_null(), "{tasks}");
    assert!(v["paired_tasks"].is_null(), "{v}");
}

/// Something other than a regular file in a checkpoint's place (a named pipe, a directory, a
/// device) is refused by name at load, instead of blocking in `open` (a pipe with no writer),
/// reading without end (`/dev/zero` as config.json) or failing in `mmap` with an OS code.
#[test]
fn a_pipe_a_directory_or_a_device_in_a_checkpoint_is_refused_by_name() {
    let src = &fixture("gptoss-tiny-mxfp4");
    let open = |config: &dyn Fn(&Path), weights: &dyn Fn(&Path)| {
        let d = tempfile::tempdir().unwrap();
        config(&d.path().join("config.json"));
        weights(&d.path().join("model.safetensors"));
        ModelFiles::open(d.path()).map(|_| ()).unwrap_err().chain()
    };
    let copy = |name: &'static str| {
        move |p: &Path| {
            std::fs::copy(src.join(name), p).unwrap();
        }
    };
    let fifo = |p: &Path| {
        let made = std::process::Command::new("mkfifo").arg(p).status();
        assert!(made.unwrap().success(), "mkfifo {}", p.display());
    };
    let e = open(&copy("config.json"), &fifo);
    assert!(
        e.contains("model.safetensors") && e.contains("not a regular file"),
        "{e}"
    );
    let e = open(&copy("config.json"), &|p: &Path| {
        std::fs::create_dir(p).unwrap()
    });
    assert!(
        e.contains("model.safetensors") && e.contains("a directory"),
        "{e}"
    );
    let zero = |p: &Path| std::os::unix::fs::symlink("/dev/zero", p).unwrap();
    let e = open(&zero, &copy("model.safetensors"));
    assert!(
        e.contains("config.json") && e.contains("not a regular file"),
        "{e}"
    );
}

/// The hot-store's usage counts are a hint for the next start: a run whose counts cannot be
/// saved (here `stormo-usage.json` is a folder, so the atomic rename onto it fails) still
/// prints its result and succeeds, warns once, and leaves what is there alone.
#[test]
fn a_usage_file_that_cannot_be_saved_does_not_fail_the_run() {
    let dir = crate::manifests::copy_fixture("gptoss-tiny-mxfp4");
    // Usage counts go to the state directory (never the model folder); a file where its
    // `models` folder would be makes them unsavable.
    let state = tempfile::tempdir().unwrap();
    let blocker = state.path().join("models");
    std::fs::write(&blocker, b"kept").unwrap();
    let out = std::process::Command::new(crate::demo::stormo_exe())
        .args(["run", "--model"])
        .arg(dir.path())
        .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"])
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .expect("running stormo run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json output");
    assert_eq!(v["generated_ids"].as_array().map(Vec::len), Some(4), "{v}");
    assert_eq!(
        stderr.matches("could not save expert usage counts").count(),
        1,
        "{stderr}"
    );
    assert_eq!(std::fs::read(&blocker).unwrap(), b"kept");
    for d in [dir.path(), state.path()] {
        let left: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains(".tmp"))
            .collect();
        assert!(
            left.is_empty(),
            "temporary files left in {}: {left:?}",
            d.display()
        );
    }
}
