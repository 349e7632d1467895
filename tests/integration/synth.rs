//! `stormo synth`'s checkpoints: the engine runs them, they are deterministic, their index and
//! config read like the hub's, and skewed routing makes hot experts win more often.

use std::path::Path;

use stormo_engine::generate::{argmax, greedy, Timings};
use stormo_engine::safetensors::{Checkpoint, Dtype};
use stormo_engine::{LoadOptions, Logits, Model, ModelConfig, Observer};
use stormo_simulations::synth::{
    self, HotExperts, Overrides, Plan, Preset, SynthError, SynthOptions,
};

/// A small GPT-OSS: 2 layers, 64 wide, 8 experts (top-4), 4 KB shards so there are many.
fn small(preset: Preset, seed: u64) -> SynthOptions {
    let o = Overrides {
        layers: Some(2),
        hidden: Some(64),
        intermediate: Some(64),
        experts: Some(8),
        top_k: Some(if preset == Preset::Qwen3_30bA3b { 2 } else { 4 }),
        vocab: Some(512),
        heads: Some(4),
        kv_heads: Some(2),
        head_dim: Some(16),
    };
    let mut opts = SynthOptions::new(preset.geometry().with(&o), seed);
    opts.shard_bytes = Some(64 << 10);
    opts
}

fn write(opts: &SynthOptions, dir: &Path) -> Plan {
    let plan = synth::plan(opts).unwrap();
    let mut calls = 0;
    let report = synth::write(&plan, dir, false, &mut |p| {
        calls += 1;
        assert!(p.written <= p.total);
    })
    .unwrap();
    assert!(calls >= 1, "progress was never reported");
    assert_eq!(report.bytes, dir_bytes(dir));
    plan
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// Logits of every position of `ids`: finite, spread out, and not the same argmax everywhere.
fn assert_lively(model: &Model, ids: &[u32], what: &str) {
    let v = model.config().vocab_size;
    let mut sess = model.session(ids.len()).unwrap();
    let logits = model
        .forward(&mut sess, ids, Logits::All, None)
        .unwrap()
        .to_vec();
    assert!(
        logits.iter().all(|x| x.is_finite()),
        "{what}: non-finite logits"
    );
    let mut tops = std::collections::BTreeSet::new();
    for row in logits.chunks(v) {
        let mean = row.iter().sum::<f32>() / v as f32;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v as f32;
        assert!(var.sqrt() > 0.1, "{what}: flat logits (std {})", var.sqrt());
        tops.insert(argmax(row));
    }
    assert!(
        tops.len() > ids.len() / 4,
        "{what}: {} distinct argmaxes over {} positions",
        tops.len(),
        ids.len()
    );
}

#[test]
fn the_engine_runs_synthesised_checkpoints_of_both_families() {
    for preset in [Preset::GptOss20b, Preset::Qwen3_30bA3b] {
        let dir = tempfile::tempdir().unwrap();
        let plan = write(&small(preset, 11), dir.path());
        assert!(
            plan.shards.len() > 3,
            "{preset}: {} shards",
            plan.shards.len()
        );
        let model = Model::load(dir.path(), &LoadOptions::default()).unwrap();
        let ids: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 512).collect();
        assert_lively(&model, &ids, preset.name());
        // Greedy decoding over many tokens stays finite.
        let mut sess = model.session(ids.len() + 32).unwrap();
        let mut finite = true;
        let out = greedy(
            &model,
            &mut sess,
            &ids,
            32,
            &[],
            |_, l| finite &= l.iter().all(|x| x.is_finite()),
            &mut Timings::default(),
        )
        .unwrap();
        assert_eq!(out.len(), 32);
        assert!(finite, "{preset}: non-finite logits while decoding");
    }
}

/// The real GPT-OSS vocabulary at a small width (what `stormo demo` needs) also runs.
#[test]
fn a_narrow_model_with_the_real_vocabulary_runs() {
    let mut o = small(Preset::GptOss20b, 3);
    o.geometry.vocab = 201_088;
    o.shard_bytes = None;
    let dir = tempfile::tempdir().unwrap();
    write(&o, dir.path());
    let model = Model::load(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(model.config().eos_token_ids, [200_002]);
    assert_lively(
        &model,
        &[200_006, 1, 2, 3, 17, 90_000, 201_087, 5],
        "real vocab",
    );
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn same_seed_gives_identical_files_and_another_seed_different_weights() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write(&small(Preset::GptOss20b, 1), a.path());
    write(&small(Preset::GptOss20b, 1), b.path());
    write(&small(Preset::GptOss20b, 2), c.path());
    let (fa, fb, fc) = (files(a.path()), files(b.path()), files(c.path()));
    assert_eq!(fa, fb, "same seed, different bytes");
    assert_eq!(fa.len(), fc.len());
    for ((name, x), (_, y)) in fa.iter().zip(&fc) {
        if name.ends_with(".safetensors") {
            assert_ne!(x, y, "{name} did not change with the seed");
        } else {
            assert_eq!(x, y, "{name} depends on the seed");
        }
    }
}

#[test]
fn index_and_config_read_like_the_hubs() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write(&small(Preset::GptOss20b, 4), dir.path());
    let n = plan.shards.len();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let total: u64 = ckpt.tensors.values().map(|t| t.len).sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), ckpt.tensors.len());
    for (name, info) in &ckpt.tensors {
        let file = ckpt.files[info.file].path.file_name().unwrap();
        assert_eq!(
            map[name].as_str().unwrap(),
            file.to_str().unwrap(),
            "{name}"
        );
    }
    // The convert script's names: numbered from 0, "of" the last number.
    for s in 0..n {
        let name = format!("model-{s:05}-of-{:05}.safetensors", n - 1);
        assert!(dir.path().join(&name).exists(), "{name}");
    }
    let cfg = ModelConfig::from_dir(dir.path()).unwrap();
    assert!(cfg.mxfp4_experts);
    assert_eq!((cfg.hidden_size, cfg.num_experts, cfg.top_k), (64, 8, 4));
    assert_eq!(cfg.layer_sliding, [true, false]);
    let yarn = cfg.rope.yarn.as_ref().unwrap();
    assert_eq!((yarn.factor, yarn.truncate), (32.0, false));
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        raw["quantization_config"]["modules_to_not_convert"][1],
        "model.layers.*.mlp.router"
    );
    // MXFP4 blocks and scales as documented (SPEC §4.1), BF16 for everything else.
    let t = |n: &str| {
        ckpt.info(&format!("model.layers.1.mlp.experts.{n}"))
            .unwrap()
    };
    assert_eq!(t("gate_up_proj_blocks").shape, [8, 128, 2, 16]);
    assert_eq!(t("gate_up_proj_scales").shape, [8, 128, 2]);
    assert_eq!(t("down_proj_blocks").shape, [8, 64, 2, 16]);
    assert_eq!(t("down_proj_scales").shape, [8, 64, 2]);
    for (name, info) in &ckpt.tensors {
        let want = if name.ends_with("_blocks") || name.ends_with("_scales") {
            Dtype::U8
        } else {
            Dtype::BF16
        };
        assert_eq!(info.dtype, want, "{name}");
    }
    let gen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(gen["eos_token_id"].as_array().unwrap().len(), 3);
}

#[test]
fn an_existing_checkpoint_is_kept_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let first = write(&small(Preset::GptOss20b, 1), dir.path());
    let mut bigger_shards = small(Preset::GptOss20b, 2);
    bigger_shards.shard_bytes = None;
    let plan = synth::plan(&bigger_shards).unwrap();
    let err = synth::write(&plan, dir.path(), false, &mut |_| {}).unwrap_err();
    assert!(matches!(err, SynthError::OutputExists { .. }), "{err}");
    synth::write(&plan, dir.path(), true, &mut |_| {}).unwrap();
    // The stale shards of the first checkpoint are gone; only the new one is left.
    let names: Vec<String> = files(dir.path()).into_iter().map(|(n, _)| n).collect();
    assert!(first.shards.len() > 1 && plan.shards.len() == 1);
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "model-00000-of-00000.safetensors",
            "model.safetensors.index.json"
        ]
    );
    Model::load(dir.path(), &LoadOptions::default()).unwrap();
}

#[derive(Default)]
struct Routes {
    logits: Vec<Vec<f32>>,
}

impl Observer for Routes {
    fn router(&mut self, layer: usize, logits: &[f32]) {
        if self.logits.len() <= layer {
            self.logits.resize(layer + 1, Vec::new());
        }
        self.logits[layer].extend_from_slice(logits);
    }
}

/// Share of all top-k choices that went to `hot` experts, over a 64-token forward.
fn hot_share(dir: &Path, hot: &[Vec<usize>]) -> f64 {
    let model = Model::load(dir, &LoadOptions::default()).unwrap();
    let cfg = model.config().clone();
    let ids: Vec<u32> = (0..64).map(|i| (i * 101 + 7) % 512).collect();
    let mut sess = model.session(ids.len()).unwrap();
    let mut routes = Routes::default();
    model
        .forward(&mut sess, &ids, Logits::Last, Some(&mut routes))
        .unwrap();
    let (mut hits, mut all) = (0usize, 0usize);
    for (l, logits) in routes.logits.iter().enumerate() {
        for row in logits.chunks(cfg.num_experts) {
            let mut top = vec![0; cfg.top_k];
            stormo_engine::ops::top_k(row, &mut top);
            hits += top.iter().filter(|e| hot[l].contains(e)).count();
            all += top.len();
        }
    }
    hits as f64 / all as f64
}

#[test]
fn hot_experts_are_chosen_more_often() {
    for preset in [Preset::GptOss20b, Preset::GptOss120b] {
        let plain_dir = tempfile::tempdir().unwrap();
        let hot_dir = tempfile::tempdir().unwrap();
        write(&small(preset, 9), plain_dir.path());
        let mut skewed = small(preset, 9);
        skewed.hot = Some(HotExperts {
            fraction: 0.25,
            bias: 2.0,
        });
        let plan = write(&skewed, hot_dir.path());
        assert!(plan.hot_experts.iter().all(|h| h.len() == 2));
        let plain = hot_share(plain_dir.path(), &plan.hot_experts);
        let hot = hot_share(hot_dir.path(), &plan.hot_experts);
        eprintln!(
            "{preset}: share of top-4 choices going to the 2 hot experts of 8: \
             {plain:.2} unskewed, {hot:.2} skewed"
        );
        assert!(
            hot > plain + 0.15,
            "{preset}: hot share {hot:.2} vs {plain:.2} without skew"
        );
    }
}

/// Qwen3-MoE's router has no bias, so skew is refused rather than faked.
#[test]
fn skew_is_refused_for_qwen3() {
    let mut o = small(Preset::Qwen3_30bA3b, 1);
    o.hot = Some(HotExperts {
        fraction: 0.25,
        bias: 2.0,
    });
    let err = synth::plan(&o).unwrap_err().to_string();
    assert!(err.contains("router has no bias"), "{err}");
}
