//! The engine against Transformers on checkpoints no other test uses: every folder under
//! `fixtures/extra/` (made by `tests/oracle/make_fixtures.py`; see tests/oracle/README.md).
//!
//! Other head counts, head_dim, expert counts, top-k, vocab sizes, windows and layer counts;
//! both families; the MXFP4 hub layout and the `save_pretrained` layout of GPT-OSS; Qwen3-MoE
//! with dense layers, `norm_topk_prob` false, tied embeddings, attention biases, YaRN; hub and
//! `rope_parameters` configs; sharded checkpoints; bf16, f16 and f32 tensors.
//!
//! Per fixture: prompt logits within 1e-3, every hidden state within 1e-3, router top-k sets
//! identical at every MoE layer and position, for several prefill block sizes (one position per
//! block gives the same logits bit for bit); then greedy generation with the KV cache: every id
//! identical and the logits within 1e-3.

use std::path::Path;

use stormo_engine::generate::{argmax, greedy, Timings};
use stormo_engine::{LoadOptions, Logits, Model};
use stormo_tests::{extra_fixtures, max_abs, top_set, Capture, Reference};

/// Fixtures on which the engine is known to disagree with Transformers, with the reason. The test
/// requires these to still fail, so a fix shows up as a test failure asking to remove the entry.
const KNOWN_ENGINE_MISMATCHES: &[(&str, &str)] = &[];

const TOL: f32 = 1e-3;

/// The MoE layers of a fixture, from its reference.json (Qwen3 dense layers have no router).
fn moe_layers(dir: &Path) -> Vec<usize> {
    let path = dir.join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference.json is JSON");
    v["moe_layers"]
        .as_array()
        .expect("reference.json lists moe_layers")
        .iter()
        .map(|x| x.as_u64().expect("layer index") as usize)
        .collect()
}

/// Every comparison for one fixture; the first disagreement as an error.
fn check(dir: &Path) -> Result<String, String> {
    let name = dir.file_name().expect("folder name").to_string_lossy();
    let r = Reference::open(dir);
    let ids = r.ids("input_ids");
    let want_logits = r.f32("prompt_logits");
    let want_hidden = r.f32("hidden_states");
    let want_router = r.f32("router_logits");
    let moe = moe_layers(dir);
    let mut worst_logits = 0f32;
    let mut worst_hidden = 0f32;
    let mut one_block: Option<Vec<f32>> = None;
    for block in [256, 7, 1] {
        let model = Model::load(
            dir,
            &LoadOptions {
                prefill_block: block,
                ..LoadOptions::default()
            },
        )
        .map_err(|e| format!("{name}: load: {e}"))?;
        let cfg = model.config().clone();
        let (t, h, e) = (ids.len(), cfg.hidden_size, cfg.num_experts);
        let mut sess = model.session(t).map_err(|e| format!("{name}: {e}"))?;
        let mut cap = Capture::default();
        let logits = model
            .forward(&mut sess, &ids, Logits::All, Some(&mut cap))
            .map_err(|e| format!("{name}: forward: {e}"))?
            .to_vec();
        let err = max_abs(&logits, &want_logits);
        worst_logits = worst_logits.max(err);
        if err >= TOL {
            return Err(format!(
                "{name} block {block}: prompt logits max abs error {err}"
            ));
        }
        if cap.hidden.len() != cfg.num_layers + 1 {
            return Err(format!(
                "{name}: {} hidden states reported, want {}",
                cap.hidden.len(),
                cfg.num_layers + 1
            ));
        }
        for (i, got) in cap.hidden.iter().enumerate() {
            let err = max_abs(got, &want_hidden[i * t * h..(i + 1) * t * h]);
            worst_hidden = worst_hidden.max(err);
            if err >= TOL {
                return Err(format!(
                    "{name} block {block}: hidden state {i} max abs error {err}"
                ));
            }
        }
        let reported: Vec<usize> = (0..cap.router.len())
            .filter(|&l| !cap.router[l].is_empty())
            .collect();
        if reported != moe {
            return Err(format!(
                "{name}: router logits reported for layers {reported:?}, MoE layers are {moe:?}"
            ));
        }
        for (j, &l) in moe.iter().enumerate() {
            for p in 0..t {
                let got = &cap.router[l][p * e..(p + 1) * e];
                let want = &want_router[(j * t + p) * e..(j * t + p + 1) * e];
                let (g, w) = (top_set(got, cfg.top_k), top_set(want, cfg.top_k));
                if g != w {
                    return Err(format!(
                        "{name} block {block}: layer {l} position {p}: experts {g:?}, want {w:?}"
                    ));
                }
            }
        }
        match &one_block {
            None => one_block = Some(logits),
            Some(first) if block == 1 && first != &logits => {
                return Err(format!("{name}: one-position blocks differ from one block"));
            }
            Some(_) => {}
        }
    }

    let want_ids = r.ids("generated_ids");
    let want_gen = r.f32("generated_logits");
    let model = Model::load(dir, &LoadOptions::default()).map_err(|e| format!("{name}: {e}"))?;
    let v = model.config().vocab_size;
    let mut sess = model
        .session(ids.len() + want_ids.len())
        .map_err(|e| format!("{name}: {e}"))?;
    let mut got_gen = Vec::new();
    let got_ids = greedy(
        &model,
        &mut sess,
        &ids,
        want_ids.len(),
        &[],
        |_, l| got_gen.extend_from_slice(l),
        &mut Timings::default(),
    )
    .map_err(|e| format!("{name}: generate: {e}"))?;
    if got_ids != want_ids {
        return Err(format!(
            "{name}: generated ids {got_ids:?}, Transformers {want_ids:?}"
        ));
    }
    let err = max_abs(&got_gen, &want_gen);
    if err >= TOL {
        return Err(format!("{name}: generated logits max abs error {err}"));
    }
    for (i, row) in got_gen.chunks(v).enumerate() {
        if argmax(row) != want_ids[i] {
            return Err(format!(
                "{name}: step {i} logits do not choose the generated id"
            ));
        }
    }
    Ok(format!(
        "{name}: ok; max abs error prompt logits {worst_logits:.2e}, hidden {worst_hidden:.2e}, \
         generated logits {err:.2e}"
    ))
}

#[test]
fn extra_fixtures_match_transformers() {
    let dirs = extra_fixtures();
    assert!(
        dirs.len() >= 10,
        "expected the generated fixtures in fixtures/extra, found {}",
        dirs.len()
    );
    let mut failures = Vec::new();
    for dir in &dirs {
        let name = dir
            .file_name()
            .expect("folder name")
            .to_string_lossy()
            .to_string();
        let known = KNOWN_ENGINE_MISMATCHES.iter().find(|(n, _)| *n == name);
        match (check(dir), known) {
            (Ok(summary), None) => eprintln!("{summary}"),
            (Err(e), None) => failures.push(e),
            (Err(e), Some((_, why))) => eprintln!("{name}: known engine mismatch ({why}): {e}"),
            (Ok(_), Some(_)) => failures.push(format!(
                "{name} now matches Transformers: remove it from KNOWN_ENGINE_MISMATCHES"
            )),
        }
    }
    for (n, _) in KNOWN_ENGINE_MISMATCHES {
        assert!(
            dirs.iter().any(|d| d.ends_with(n)),
            "KNOWN_ENGINE_MISMATCHES names {n}, which is not a fixture"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
