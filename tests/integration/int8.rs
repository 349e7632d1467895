//! The opt-in 8-bit attention/head path against the exact path on every oracle fixture:
//! top-1 agreement and logit error over every position of each fixture's prompt.

use stormo_engine::generate::argmax;
use stormo_engine::{LoadOptions, Logits, Model};
use stormo_tests::{extra_fixtures, fixture, max_abs, Reference, MODEL_FIXTURES};

/// Logits at every position of the fixture's prompt.
fn logits(dir: &std::path::Path, int8: bool) -> (Vec<f32>, usize, u64) {
    let ids = Reference::open(dir).ids("input_ids");
    let opts = LoadOptions {
        int8_attn_head: int8,
        ..LoadOptions::default()
    };
    let model = Model::load(dir, &opts).unwrap();
    let mut s = model.session(ids.len()).unwrap();
    let l = model
        .forward(&mut s, &ids, Logits::All, None)
        .unwrap()
        .to_vec();
    (l, model.config().vocab_size, model.int8_bytes())
}

#[test]
fn int8_attn_head_agreement_on_every_fixture() {
    let mut dirs: Vec<_> = MODEL_FIXTURES.iter().map(|n| fixture(n)).collect();
    dirs.extend(extra_fixtures());
    let (mut agree, mut total) = (0usize, 0usize);
    for dir in &dirs {
        let name = dir.file_name().unwrap().to_string_lossy();
        let (exact, vocab, none) = logits(dir, false);
        let (approx, _, held) = logits(dir, true);
        assert_eq!(none, 0, "{name}: the exact path holds no 8-bit copies");
        assert!(held > 0, "{name}: the 8-bit path holds its copies");
        let err = max_abs(&exact, &approx);
        let range = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(err > 0.0, "{name}: 8-bit logits identical to exact ones");
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
            "{name}: int8 attention/head top-1 agreement {same}/{n} ({:.1}%), logit error median {median:.3} max {err:.3} (max |logit| {range:.2})",
            100.0 * same as f64 / n as f64
        );
        // A position whose routing flips somewhere (a near-tie among router logits) can move
        // a lot; the typical position must stay close. A wrong scale or row would not.
        assert!(
            median < 0.05 * range.max(1e-3),
            "{name}: median logit error {median} against max {range}"
        );
        agree += same;
        total += n;
    }
    let rate = agree as f64 / total as f64;
    eprintln!(
        "all fixtures: top-1 agreement {agree}/{total} ({:.2}%)",
        100.0 * rate
    );
    assert!(rate > 0.9, "top-1 agreement {rate}");
}
