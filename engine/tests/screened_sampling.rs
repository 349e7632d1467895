//! Sampled generation through the screened head ([`sampled_ids`], [`Model::forward_sample`])
//! gives, seed for seed, the ids of sampled generation from the whole exact head's logits
//! ([`sampled`]): on every oracle fixture, every SIMD instruction set this CPU runs, over
//! temperatures, top-k, top-p and the repetition penalty.

use std::path::PathBuf;

use stormo_engine::generate::{sampled, sampled_ids, Timings};
use stormo_engine::kernels::{with_isa, Isa};
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{LoadOptions, Model};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

#[test]
fn screened_sampling_gives_the_whole_heads_ids() {
    let prompt = [1u32, 2, 3, 4, 5];
    let n = 12;
    let mut screened_tokens = 0;
    let mut full_tokens = 0;
    for name in ["gptoss-tiny-mxfp4", "gptoss-tiny-bf16", "qwen3moe-tiny"] {
        let dir = fixture(name);
        let whole = Model::load(&dir, &LoadOptions::default()).unwrap();
        let opts = LoadOptions {
            screened_head: true,
            ..LoadOptions::default()
        };
        let screened = Model::load(&dir, &opts).unwrap();
        assert!(screened.has_screened_head());
        for isa in Isa::available() {
            for case in 0..8 {
                let params = SamplingParams {
                    temperature: [0.7f32, 1.0, 0.7, 0.4][case % 4],
                    top_k: [0, 0, 40, 0][case % 4],
                    top_p: [1.0f32, 1.0, 1.0, 0.95][case % 4],
                    repetition_penalty: [1.0f32, 1.3][case % 2],
                    seed: case as u64 * 31 + 7,
                };
                let want = with_isa(isa, || {
                    let mut sess = whole.session(64).unwrap();
                    let mut s = Sampler::new(params).unwrap();
                    sampled(
                        &whole,
                        &mut sess,
                        &prompt,
                        n,
                        &[],
                        &mut s,
                        |_, _| {},
                        &mut Timings::default(),
                    )
                    .unwrap()
                });
                let (got, stats) = with_isa(isa, || {
                    let mut sess = screened.session(64).unwrap();
                    let mut s = Sampler::new(params).unwrap();
                    let ids = sampled_ids(
                        &screened,
                        &mut sess,
                        &prompt,
                        n,
                        &[],
                        &mut s,
                        |_| {},
                        &mut Timings::default(),
                    )
                    .unwrap();
                    (ids, sess.screen_stats())
                });
                assert_eq!(got, want, "{name}, {isa}, {params:?}");
                assert_eq!(stats.screened + stats.full, n as u64);
                screened_tokens += stats.screened;
                full_tokens += stats.full;
            }
        }
    }
    eprintln!("screened sampling: {screened_tokens} tokens through the screen, {full_tokens} through the whole head");
    assert!(
        screened_tokens > 2 * full_tokens,
        "the screen decided {screened_tokens} and gave up on {full_tokens}"
    );
}

/// `decode_greedy_and_sampled` (what `stormo bench` reports) decodes its steps, alternating,
/// and gives both rates.
#[test]
fn greedy_and_sampled_decode_rates_are_measured() {
    let opts = LoadOptions {
        screened_head: true,
        ..LoadOptions::default()
    };
    let model = Model::load(&fixture("gptoss-tiny-mxfp4"), &opts).unwrap();
    let mut sess = model.session(64).unwrap();
    let first = model
        .forward_greedy(&mut sess, &[1, 2, 3], None)
        .unwrap()
        .token;
    let params = SamplingParams {
        temperature: 0.7,
        ..SamplingParams::default()
    };
    let before = sess.position();
    let pair =
        stormo_engine::generate::decode_greedy_and_sampled(&model, &mut sess, first, 10, params)
            .unwrap();
    assert_eq!(sess.position(), before + 10);
    assert!(
        pair.greedy_tok_s.is_finite() && pair.greedy_tok_s > 0.0,
        "{pair:?}"
    );
    assert!(
        pair.sampled_tok_s.is_finite() && pair.sampled_tok_s > 0.0,
        "{pair:?}"
    );
    let st = sess.screen_stats();
    assert_eq!(st.screened + st.full, 1 + 10, "{st:?}");
}
