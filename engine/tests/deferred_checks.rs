//! Deferred spot-checks end to end ([`ExpertExecutor::defer_checks`]): an executor that
//! computes every expert of each oracle fixture, but wrong for one expert from some call on,
//! and whose checks end a few steps after the answers they check. The generation uses the
//! wrong answers at once, finds out later, rolls back and makes the tokens again: the ids
//! handed on (and returned) are the reference ids, each handed on once, greedy and sampled,
//! whether the lie starts in the prefill or in a decoded token. Without the rollback the same
//! lie changes the ids, so the test can fail.
//!
//! This file holds this one test: it reads the process-wide rollback counter.

use std::path::PathBuf;
use std::sync::Arc;

use stormo_engine::generate::{greedy, rollbacks, sampled, Timings};
use stormo_engine::late_liar::LateLiar;
use stormo_engine::sampling::{Sampler, SamplingParams};
use stormo_engine::{LoadOptions, Model};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

/// Greedy and sampled ids of `model` after `prompt`, and the ids handed to `on_token`.
fn generate(model: &Model, prompt: &[u32], sampling: bool) -> (Vec<u32>, Vec<u32>) {
    let mut sess = model.session(64).unwrap();
    let mut handed = Vec::new();
    let mut t = Timings::default();
    let ids = if sampling {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: 7,
        })
        .unwrap();
        sampled(
            model,
            &mut sess,
            prompt,
            12,
            &[],
            &mut sampler,
            |id, l| {
                assert!(!l.is_empty(), "the logits that chose {id}");
                handed.push(id)
            },
            &mut t,
        )
    } else {
        greedy(
            model,
            &mut sess,
            prompt,
            12,
            &[],
            |id, _| handed.push(id),
            &mut t,
        )
    };
    (ids.unwrap(), handed)
}

#[test]
fn a_deferred_check_that_disagrees_rolls_back_to_the_reference_ids() {
    for name in ["gptoss-tiny-mxfp4", "qwen3moe-tiny"] {
        let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 1000).collect();
        let local = Model::load(&fixture(name), &LoadOptions::default()).unwrap();
        for sampling in [false, true] {
            let (want, handed) = generate(&local, &prompt, sampling);
            assert_eq!(want, handed);
            // An honest run: the calls before the third step (the second decoded token).
            let honest = Arc::new(LateLiar::new(&fixture(name), usize::MAX, 1, true).unwrap());
            let model = Model::load(&fixture(name), &LoadOptions::default())
                .unwrap()
                .with_executor(honest.clone());
            assert_eq!(
                generate(&model, &prompt, sampling).0,
                want,
                "{name}: honest"
            );
            let third = honest.calls_before()[2];
            // The lie from the prefill's first call, and from a decoded token's.
            for (from, lag) in [(0, 2), (0, 1), (third + 1, 3)] {
                let liar = Arc::new(LateLiar::new(&fixture(name), from, lag, true).unwrap());
                let model = Model::load(&fixture(name), &LoadOptions::default())
                    .unwrap()
                    .with_executor(liar.clone());
                let before = rollbacks();
                let (ids, handed) = generate(&model, &prompt, sampling);
                let what = format!("{name}, sampling {sampling}, lying from call {from}");
                assert_eq!(ids, want, "{what}");
                assert_eq!(handed, want, "{what}: each token handed on once, checked");
                assert!(liar.caught(), "{what}: the lie was found");
                assert!(rollbacks() > before, "{what}: a step was made again");

                // The control: the same lie, never found, changes the ids.
                let blind = Arc::new(LateLiar::new(&fixture(name), from, lag, false).unwrap());
                let model = Model::load(&fixture(name), &LoadOptions::default())
                    .unwrap()
                    .with_executor(blind);
                let (ids, _) = generate(&model, &prompt, sampling);
                assert_ne!(ids, want, "{what}: the lie matters");
            }
        }
    }
}
