//! Continuous batching in the engine: several sequences run together through
//! `Model::forward_batch` (prompts in chunks of varying size, joining and leaving at different
//! steps) give, bit for bit, the logits and greedy choices each gets alone through
//! `Model::forward` / `Model::forward_greedy`. On the oracle fixtures (every instruction set
//! this CPU runs) and on synthetic models of both families.

use std::path::Path;

use rand::{Rng, SeedableRng};
use stormo_engine::kernels::{with_isa, Isa};
use stormo_engine::model::{Seq, Want};
use stormo_engine::{Batch, LoadOptions, Logits, Model, Session};
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
