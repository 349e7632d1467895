//! Completion-driven MoE end to end: a prefill and a few decoded tokens of each oracle
//! fixture with its experts from the disk tier under RAM budgets of four to six experts (so a
//! prefill block's experts come in two groups, the second loaded ahead while the first
//! computes) give the logits of the mapped checkpoint bit for bit, with experts computed as
//! they land and with the switch off (each group fetched whole, then computed). This file
//! holds this one test: it flips the process-wide switch.

use std::path::PathBuf;
use std::sync::Arc;

use stormo_engine::generate::argmax;
use stormo_engine::moe::{completion_driven, set_completion_driven};
use stormo_engine::tiers::{ExpertStats, Tier, TierConfig, TieredExperts};
use stormo_engine::{LoadOptions, Logits, Model, ModelFiles};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

/// The logits of a 24-token prompt (every position) and of 4 greedy tokens after it.
fn logits(model: &Model) -> Vec<f32> {
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 1000).collect();
    let mut sess = model.session(32).unwrap();
    let mut all = model
        .forward(&mut sess, &prompt, Logits::All, None)
        .unwrap()
        .to_vec();
    let v = all.len() / prompt.len();
    let mut last = all[all.len() - v..].to_vec();
    for _ in 0..4 {
        let tok = argmax(&last);
        last = model
            .forward(&mut sess, &[tok], Logits::Last, None)
            .unwrap()
            .to_vec();
        all.extend_from_slice(&last);
    }
    all
}

/// The logits with the experts from the disk tier under a budget of `experts` records, and
/// what the cache did.
fn cached(name: &str, experts: u64) -> (Vec<f32>, ExpertStats) {
    let files = ModelFiles::open(&fixture(name)).unwrap();
    let sizes = files.layout.sizes();
    let largest = sizes.iter().flatten().copied().max().unwrap();
    let cfg = TierConfig {
        budget: experts * largest,
        prefetch: false,
        hot_fraction: 0.0,
    };
    let disk: Arc<dyn Tier> = Arc::new(files.disk_tier(2, None).unwrap());
    let top_k = files.cfg.top_k;
    let cache = Arc::new(TieredExperts::new(vec![disk], sizes, top_k, &cfg));
    let model = Model::new(files, cache.clone(), &LoadOptions::default()).unwrap();
    (logits(&model), cache.stats())
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn experts_computed_as_they_land_give_the_mapped_bits() {
    assert!(completion_driven(), "on by default");
    for name in ["gptoss-tiny-mxfp4", "qwen3moe-tiny"] {
        let mapped = logits(&Model::load(&fixture(name), &LoadOptions::default()).unwrap());
        for budget in [4, 5, 6] {
            for on in [true, false] {
                set_completion_driven(on);
                let (got, stats) = cached(name, budget);
                assert!(
                    same_bits(&mapped, &got),
                    "{name}, budget of {budget} experts, completion-driven {on}"
                );
                // The next group loaded ahead only when completion-driven.
                assert_eq!(
                    stats.ahead_used > 0,
                    on,
                    "{name}, budget {budget}, completion-driven {on}: {stats:?}"
                );
            }
        }
    }
    set_completion_driven(true);
}
