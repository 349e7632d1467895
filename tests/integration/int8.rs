//! The opt-in 8-bit paths against the exact path on every oracle fixture: top-1 agreement
//! and logit error over every position of each fixture's prompt, for `--int8-attn-head`,
//! `--int8-experts` and both.

use stormo_engine::generate::argmax;
use stormo_engine::{LoadOptions, Logits, Model};
use stormo_tests::{extra_fixtures, fixture, max_abs, Reference, MODEL_FIXTURES};

/// Logits at every position of the fixture's prompt.
fn logits(dir: &std::path::Path, opts: &LoadOptions) -> (Vec<f32>, usize, u64) {
    let ids = Reference::open(dir).ids("input_ids");
    let model = Model::load(dir, opts).unwrap();
    let mut s = model.session(ids.len()).unwrap();
    let l = model
        .forward(&mut s, &ids, Logits::All, None)
        .unwrap()
        .to_vec();
    (l, model.config().vocab_size, model.int8_bytes())
}

fn all_fixtures() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<_> = MODEL_FIXTURES.iter().map(|n| fixture(n)).collect();
    dirs.extend(extra_fixtures());
    dirs
}

/// Whether the fixture's experts are stored as MXFP4 (the only ones `--int8-experts` changes).
fn has_mxfp4_experts(dir: &std::path::Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .contains("mxfp4")
}

/// Compares `opts` with the exact path on every fixture that `changes` says it affects
/// (others must give identical logits), prints agreement and error, and returns the top-1
/// agreement over all affected positions. The median per-position logit error must stay
/// below `median_share` of the largest logit.
fn agreement(
    label: &str,
    opts: &LoadOptions,
    changes: impl Fn(&std::path::Path) -> bool,
    median_share: f32,
) -> f64 {
    let (mut agree, mut total) = (0usize, 0usize);
    for dir in &all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy();
        let (exact, vocab, none) = logits(dir, &LoadOptions::default());
        let (approx, _, held) = logits(dir, opts);
        assert_eq!(none, 0, "{name}: the exact path holds no 8-bit copies");
        assert_eq!(
            held > 0,
            opts.int8_attn_head,
            "{name}: 8-bit copies held only with --int8-attn-head"
        );
        let err = max_abs(&exact, &approx);
        if !changes(dir) {
            assert_eq!(
                err, 0.0,
                "{name}: {label} changed a model it does not apply to"
            );
            continue;
        }
        let range = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(err > 0.0, "{name}: {label} logits identical to exact ones");
        let same = exact
            .chunks(vocab)
            .zip(approx.chunks(vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        let n = exact.len() / vocab;
        let mut per_pos: Vec<f32> = exact
            .chunks(vocab)
            .zip(approx.chunks(vocab))
            .map(|(a, b)| max_abs(a, b))
            .collect();
        per_pos.sort_by(f32::total_cmp);
        let median = per_pos[per_pos.len() / 2];
        eprintln!(
            "{name}: {label} top-1 agreement {same}/{n} ({:.1}%), logit error median {median:.3} max {err:.3} (max |logit| {range:.2})",
            100.0 * same as f64 / n as f64
        );
        // A position whose routing flips somewhere (a near-tie among router logits) can move
        // a lot; the typical position must stay close. A wrong scale or row would not.
        assert!(
            median < median_share * range.max(1e-3),
            "{name}: median logit error {median} against max {range}"
        );
        agree += same;
        total += n;
    }
    let rate = agree as f64 / total as f64;
    eprintln!(
        "{label}, all affected fixtures: top-1 agreement {agree}/{total} ({:.2}%)",
        100.0 * rate
    );
    rate
}

#[test]
fn int8_attn_head_agreement_on_every_fixture() {
    let opts = LoadOptions {
        int8_attn_head: true,
        ..LoadOptions::default()
    };
    let rate = agreement("int8 attention/head", &opts, |_| true, 0.05);
    assert!(rate > 0.9, "top-1 agreement {rate}");
}

#[test]
fn int8_experts_agreement_on_every_fixture() {
    let opts = LoadOptions {
        int8_experts: true,
        ..LoadOptions::default()
    };
    let rate = agreement("int8 experts", &opts, has_mxfp4_experts, 0.05);
    assert!(rate > 0.9, "top-1 agreement {rate}");
    let both = LoadOptions {
        int8_attn_head: true,
        int8_experts: true,
        ..LoadOptions::default()
    };
    // The two roundings add up: a looser bound on the typical error, the same on agreement.
    let rate = agreement("int8 attention/head and experts", &both, |_| true, 0.1);
    assert!(rate > 0.9, "top-1 agreement {rate}");
}
