//! The engine against Transformers' outputs on the oracle fixtures.

use stormo_engine::generate::{argmax, greedy, greedy_ids, Timings};
use stormo_engine::kernels::{with_isa, Isa};
use stormo_engine::{LoadOptions, Logits, Model, Observer};
use stormo_tests::{fixture, max_abs, Reference, MODEL_FIXTURES};

#[derive(Default)]
struct Capture {
    hidden: Vec<Vec<f32>>,
    router: Vec<Vec<f32>>,
}

impl Observer for Capture {
    fn hidden(&mut self, index: usize, xs: &[f32]) {
        if self.hidden.len() <= index {
            self.hidden.resize(index + 1, Vec::new());
        }
        self.hidden[index].extend_from_slice(xs);
    }
    fn router(&mut self, layer: usize, logits: &[f32]) {
        if self.router.len() <= layer {
            self.router.resize(layer + 1, Vec::new());
        }
        self.router[layer].extend_from_slice(logits);
    }
}

fn top_set(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx = vec![0; k];
    stormo_engine::ops::top_k(row, &mut idx);
    idx.sort();
    idx
}

/// Full-prompt forward: logits, hidden states and router choices against the reference,
/// for several prefill block sizes (one block, blocks that split the window, one position).
#[test]
fn prompt_forward_matches_transformers() {
    for name in MODEL_FIXTURES {
        let dir = fixture(name);
        let r = Reference::open(&dir);
        let ids = r.ids("input_ids");
        let want_logits = r.f32("prompt_logits");
        let want_hidden = r.f32("hidden_states");
        let want_router = r.f32("router_logits");
        for block in [256, 37, 1] {
            let model = Model::load(
                &dir,
                &LoadOptions {
                    prefill_block: block,
                    ..LoadOptions::default()
                },
            )
            .unwrap();
            let cfg = model.config().clone();
            let (t, h, e) = (ids.len(), cfg.hidden_size, cfg.num_experts);
            let mut sess = model.session(t).unwrap();
            let mut cap = Capture::default();
            let logits = model
                .forward(&mut sess, &ids, Logits::All, Some(&mut cap))
                .unwrap()
                .to_vec();
            let err = max_abs(&logits, &want_logits);
            assert!(
                err < 1e-3,
                "{name} block {block}: prompt logits max abs error {err}"
            );
            for (i, got) in cap.hidden.iter().enumerate() {
                let want = &want_hidden[i * t * h..(i + 1) * t * h];
                let err = max_abs(got, want);
                eprintln!("{name} block {block}: hidden state {i} max abs error {err:.2e}");
                assert!(err < 1e-3, "{name}: hidden state {i} max abs error {err}");
            }
            assert_eq!(cap.hidden.len(), cfg.num_layers + 1);
            for l in 0..cfg.num_layers {
                for p in 0..t {
                    let got = &cap.router[l][p * e..(p + 1) * e];
                    let want = &want_router[(l * t + p) * e..(l * t + p + 1) * e];
                    assert_eq!(
                        top_set(got, cfg.top_k),
                        top_set(want, cfg.top_k),
                        "{name}: layer {l} position {p}"
                    );
                }
            }
            if block == 1 {
                // token-by-token and block prefill agree to the bit
                let model256 = Model::load(
                    &dir,
                    &LoadOptions {
                        prefill_block: 256,
                        ..LoadOptions::default()
                    },
                )
                .unwrap();
                let mut s2 = model256.session(t).unwrap();
                let all = model256.forward(&mut s2, &ids, Logits::All, None).unwrap();
                assert_eq!(
                    all,
                    &logits[..],
                    "{name}: one-position blocks differ from one block"
                );
            }
        }
    }
}

/// Greedy generation with the KV cache: every id identical, logits within 1e-3.
#[test]
fn greedy_generation_matches_transformers() {
    for name in MODEL_FIXTURES {
        let dir = fixture(name);
        let r = Reference::open(&dir);
        let ids = r.ids("input_ids");
        let want_ids = r.ids("generated_ids");
        let want_logits = r.f32("generated_logits");
        let model = Model::load(&dir, &LoadOptions::default()).unwrap();
        let v = model.config().vocab_size;
        let mut sess = model.session(ids.len() + want_ids.len()).unwrap();
        let mut got_logits = Vec::new();
        let got = greedy(
            &model,
            &mut sess,
            &ids,
            want_ids.len(),
            &[],
            |_, l| got_logits.extend_from_slice(l),
            &mut Timings::default(),
        )
        .unwrap();
        assert_eq!(got, want_ids, "{name}: generated ids");
        let err = max_abs(&got_logits, &want_logits);
        eprintln!("{name}: generated logits max abs error {err:.2e}");
        assert!(err < 1e-3, "{name}: generated logits error {err}");
        for (i, row) in got_logits.chunks(v).enumerate() {
            assert_eq!(argmax(row), want_ids[i]);
        }
    }
}

/// Every fixture, main and extra, generates the reference's greedy ids with each SIMD ISA
/// this CPU runs forced in turn (the scalar reference included), logits within 1e-3.
#[test]
fn every_simd_isa_generates_the_reference_tokens() {
    let mut cases: Vec<(String, Vec<u32>, Vec<u32>, std::path::PathBuf)> = MODEL_FIXTURES
        .iter()
        .map(|name| {
            let dir = fixture(name);
            let r = Reference::open(&dir);
            (
                name.to_string(),
                r.ids("input_ids"),
                r.ids("generated_ids"),
                dir,
            )
        })
        .collect();
    for dir in stormo_tests::extra_fixtures() {
        let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
        let j: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ids = |k: &str| -> Vec<u32> {
            j[k].as_array()
                .unwrap_or_else(|| panic!("{}: {k}", dir.display()))
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect()
        };
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        cases.push((name, ids("input_ids"), ids("generated_ids"), dir));
    }
    assert!(cases.len() > MODEL_FIXTURES.len(), "extra fixtures found");
    let isas = Isa::available();
    assert!(isas.contains(&Isa::Scalar));
    // Tokens chosen through the screen, exact rows they read, whole-head fallbacks.
    let mut screened = (0u64, 0u64, 0u64);
    for isa in isas {
        for (name, ids, want, dir) in &cases {
            let model = Model::load(dir, &LoadOptions::default()).unwrap();
            let mut sess = model.session(ids.len() + want.len()).unwrap();
            let got = with_isa(isa, || {
                greedy(
                    &model,
                    &mut sess,
                    ids,
                    want.len(),
                    &[],
                    |_, _| {},
                    &mut Timings::default(),
                )
            })
            .unwrap();
            assert_eq!(&got, want, "{name} with the {isa} kernels: generated ids");
            // The same ids through the screened head (8-bit screen, exact candidates).
            let opts = LoadOptions {
                screened_head: true,
                ..LoadOptions::default()
            };
            let model = Model::load(dir, &opts).unwrap();
            let mut sess = model.session(ids.len() + want.len()).unwrap();
            let got = with_isa(isa, || {
                greedy_ids(
                    &model,
                    &mut sess,
                    ids,
                    want.len(),
                    &[],
                    |_| {},
                    &mut Timings::default(),
                )
            })
            .unwrap();
            assert_eq!(&got, want, "{name}, {isa} kernels, screened head: ids");
            let st = sess.screen_stats();
            assert_eq!(st.screened + st.full, want.len() as u64, "{name}: choices");
            screened.0 += st.screened;
            screened.1 += st.exact_rows;
            screened.2 += st.full;
        }
        eprintln!(
            "{isa}: {} fixtures token-exact, with and without the screened head",
            cases.len()
        );
    }
    // The screen must have decided, or the test above proves nothing about it.
    let (n, rows, full) = screened;
    eprintln!("screened head: {n} tokens, {rows} exact rows in all, {full} whole-head passes");
    assert!(
        n > 10 * full,
        "the screen decided {n} tokens and gave up on {full}"
    );
}
