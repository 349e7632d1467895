//! The `stormo` binary as a user runs it: outputs on the oracle fixtures, and a clear error (never
//! a panic, never a wrong answer) for each kind of bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use stormo_engine::safetensors::{self, Checkpoint};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn fixture(name: &str) -> PathBuf {
    repo().join("fixtures").join(name)
}

fn stormo(args: &[&str]) -> Output {
    // keep usage counts (the hot-store) out of the fixture folders
    let cache = std::env::temp_dir().join(format!("stormo-cli-test-{}", std::process::id()));
    Command::new(env!("CARGO_BIN_EXE_stormo"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run stormo")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Fails unless the command was refused as a usage error (clap's exit code 2), without a panic,
/// with `needles` in stderr.
fn assert_usage_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}: {err}");
    }
}

/// Fails unless the command failed cleanly: non-zero exit, no panic, stderr mentions `needles`.
fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(
        !o.status.success(),
        "expected failure, got success; stderr: {err}"
    );
    assert_eq!(o.status.code(), Some(1), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(
        o.stdout.is_empty(),
        "nothing on stdout on error: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}: {err}");
    }
}

/// Copies a fixture's model files into a temp dir.
fn copy_model(name: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), d.path().join(f)).unwrap();
    }
    d
}

/// Rewrites `dir/model.safetensors` with `edit` applied to the list of tensors.
fn rewrite(
    dir: &Path,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let ck = Checkpoint::open(dir).unwrap();
    let mut ts: Vec<_> = ck
        .tensors
        .keys()
        .map(|n| {
            let t = ck.get(n).unwrap();
            (n.clone(), t.dtype, t.shape.to_vec(), t.bytes.to_vec())
        })
        .collect();
    drop(ck);
    edit(&mut ts);
    let refs: Vec<_> = ts
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    safetensors::write(&dir.join("model.safetensors"), &refs, None).unwrap();
}

fn run_model(dir: &Path, ids: &str) -> Output {
    stormo(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        ids,
        "--no-hot-store",
        "--max-new-tokens",
        "2",
    ])
}

#[test]
fn run_prints_the_reference_ids_and_json() {
    let dir = fixture("gptoss-tiny-mxfp4");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let want: Vec<u64> = r["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // the prompt ids, from reference.safetensors
    let (f, infos) = safetensors::open_file(&dir.join("reference.safetensors"), 0).unwrap();
    let info = &infos.iter().find(|(n, _)| n == "input_ids").unwrap().1;
    let ids: Vec<String> = f.map[info.offset as usize..(info.offset + info.len) as usize]
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()).to_string())
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let ids_file = tmp.path().join("ids.txt");
    std::fs::write(&ids_file, ids.join("\n")).unwrap();
    let logits = tmp.path().join("logits.safetensors");
    let n = want.len().to_string();
    let o = stormo(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids-file",
        ids_file.to_str().unwrap(),
        "--no-hot-store",
        "--max-new-tokens",
        &n,
        "--json",
        "--logits-out",
        logits.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
    let got: Vec<u64> = j["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(got, want);
    assert_eq!(j["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
    assert!(j["timings"]["decode_tok_s"].as_f64().unwrap() > 0.0);
    let (lf, li) = safetensors::open_file(&logits, 0).unwrap();
    assert_eq!(li.len(), 1);
    assert_eq!(li[0].0, "logits");
    assert_eq!(li[0].1.shape, vec![want.len(), 2048]);
    drop(lf);
    // plain mode: the ids, space separated, and nothing else on stdout
    let o = stormo(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &ids.join(","),
        "--no-hot-store",
        "--max-new-tokens",
        "3",
    ]);
    let text = String::from_utf8(o.stdout).unwrap();
    let plain: Vec<u64> = text
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(plain, want[..3]);
}

#[test]
fn missing_tensor_is_named() {
    let d = copy_model("gptoss-tiny-mxfp4");
    rewrite(d.path(), |ts| {
        ts.retain(|t| t.0 != "model.layers.2.self_attn.sinks")
    });
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["missing tensor", "model.layers.2.self_attn.sinks"],
    );
    let d = copy_model("gptoss-tiny-mxfp4");
    rewrite(d.path(), |ts| {
        ts.retain(|t| t.0 != "model.layers.0.mlp.experts.down_proj_bias")
    });
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["model.layers.0.mlp.experts.down_proj_bias"],
    );
    let d = copy_model("qwen3moe-tiny");
    rewrite(d.path(), |ts| {
        ts.retain(|t| t.0 != "model.layers.3.mlp.experts.15.up_proj.weight")
    });
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["model.layers.3.mlp.experts.15.up_proj.weight"],
    );
}

#[test]
fn wrong_shape_and_dtype_name_expected_and_found() {
    let d = copy_model("gptoss-tiny-bf16");
    rewrite(d.path(), |ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "model.layers.1.self_attn.q_proj.weight")
            .unwrap();
        t.2 = vec![t.2[1], t.2[0]];
    });
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &[
            "model.layers.1.self_attn.q_proj.weight",
            "[128, 64]",
            "[64, 128]",
        ],
    );
    let d = copy_model("gptoss-tiny-mxfp4");
    rewrite(d.path(), |ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "model.layers.0.mlp.experts.gate_up_proj_scales")
            .unwrap();
        t.1 = safetensors::Dtype::I8;
    });
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["gate_up_proj_scales", "U8", "I8"],
    );
    let d = copy_model("qwen3moe-tiny");
    rewrite(d.path(), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
        t.1 = safetensors::Dtype::I16;
    });
    assert_clean_error(&run_model(d.path(), "1,2"), &["model.norm.weight", "I16"]);
}

#[test]
fn truncated_or_corrupt_safetensors() {
    let d = copy_model("gptoss-tiny-mxfp4");
    let p = d.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 1000).unwrap();
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["model.safetensors", "truncated"],
    );
    f.set_len(100).unwrap();
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["model.safetensors", "truncated"],
    );
    std::fs::write(&p, b"\x0f\x00\x00\x00\x00\x00\x00\x00{\"a\": not json}").unwrap();
    assert_clean_error(&run_model(d.path(), "1,2"), &["model.safetensors", "JSON"]);
    std::fs::write(&p, b"\x05\x00").unwrap();
    assert_clean_error(&run_model(d.path(), "1,2"), &["model.safetensors"]);
    std::fs::write(&p, u64::MAX.to_le_bytes()).unwrap();
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["model.safetensors", "header length"],
    );
}

#[test]
fn bad_configs() {
    let d = copy_model("gptoss-tiny-mxfp4");
    let cfg = d.path().join("config.json");
    let orig = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, "{\"model_type\": ").unwrap();
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["config.json", "not valid JSON"],
    );
    std::fs::write(&cfg, orig.replace("\"num_hidden_layers\": 4,", "")).unwrap();
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["config.json", "num_hidden_layers"],
    );
    std::fs::write(&cfg, orig.replace("\"gpt_oss\"", "\"mixtral\"")).unwrap();
    assert_clean_error(
        &run_model(d.path(), "1,2"),
        &["mixtral", "gpt_oss", "qwen3_moe"],
    );
    std::fs::remove_file(&cfg).unwrap();
    assert_clean_error(&run_model(d.path(), "1,2"), &["config.json"]);
}

#[test]
fn bad_prompts() {
    let dir = fixture("qwen3moe-tiny");
    let m = dir.to_str().unwrap();
    assert_clean_error(&run_model(&dir, "1,2048"), &["2048", "vocabulary"]);
    assert_clean_error(&run_model(&dir, "1,-3"), &["-3"]);
    assert_clean_error(&run_model(&dir, "1,x"), &["\"x\""]);
    assert_clean_error(&run_model(&dir, " , "), &["no token ids"]);
    assert_clean_error(
        &stormo(&["run", "--model", m, "--prompt-ids-file", "/nonexistent/ids"]),
        &["/nonexistent/ids"],
    );
    // a prompt longer than the context
    let d = copy_model("qwen3moe-tiny");
    let cfg = d.path().join("config.json");
    let orig = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        orig.replace(
            "\"max_position_embeddings\": 40960",
            "\"max_position_embeddings\": 8",
        ),
    )
    .unwrap();
    assert_clean_error(&run_model(d.path(), "1,2,3,4,5,6,7,8,9"), &["context", "8"]);
    // fits exactly: 7 prompt + 2 new needs 8 positions
    let o = run_model(d.path(), "1,2,3,4,5,6,7");
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn convert_then_run_is_bit_identical_and_refuses_to_overwrite() {
    let src = fixture("qwen3moe-tiny");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("store");
    let o = stormo(&[
        "convert",
        "--model",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "-q",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("experts.bin").is_file() && out.join("stormo-store.json").is_file());
    let run = |dir: &Path, extra: &[&str]| {
        let l = tmp
            .path()
            .join(format!("logits-{}.safetensors", extra.len()));
        let mut args = vec![
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "5,6,7,8,9",
            "--max-new-tokens",
            "6",
            "--no-hot-store",
            "--logits-out",
            l.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = stormo(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        (
            String::from_utf8(o.stdout).unwrap(),
            std::fs::read(&l).unwrap(),
        )
    };
    let a = run(&src, &["--mmap-experts"]);
    let b = run(&out, &["--expert-cache", "0"]);
    assert_eq!(
        a, b,
        "store and original give the same ids and logits bytes"
    );
    // a second convert into the same folder is refused and leaves it intact
    let before = std::fs::read(out.join("experts.bin")).unwrap();
    let o = stormo(&[
        "convert",
        "--model",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "-q",
    ]);
    assert_clean_error(&o, &["not empty"]);
    assert_eq!(std::fs::read(out.join("experts.bin")).unwrap(), before);
    // A bad size is a usage error, reported when the arguments are parsed (exit code 2).
    assert_usage_error(&run_bad_cache(&src), &["--expert-cache", "parsecs"]);
    let o = stormo(&[
        "run",
        "--model",
        src.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--expert-dir",
        tmp.path().join("cache-store").to_str().unwrap(),
        "--expert-dir-limit",
        "3 furlongs",
    ]);
    assert_usage_error(&o, &["--expert-dir-limit", "furlongs"]);
    assert!(
        !tmp.path().join("cache-store").exists(),
        "nothing created on a usage error"
    );
}

fn run_bad_cache(dir: &Path) -> Output {
    stormo(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--expert-cache",
        "5 parsecs",
    ])
}

#[test]
fn options_that_would_mislead_or_destroy_are_refused() {
    let d = copy_model("gptoss-tiny-mxfp4");
    let model = d.path().to_str().unwrap();
    let weights = std::fs::read(d.path().join("model.safetensors")).unwrap();
    let base = [
        "run",
        "--model",
        model,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ];
    let with = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        stormo(&args)
    };
    // Timeouts beyond what the clock arithmetic holds (1e20 s panicked, 1e18 s hung).
    for t in ["1e20", "1e18", "0", "nan"] {
        assert_usage_error(&with(&["--peer-timeout", t]), &["--peer-timeout"]);
    }
    // The logits file may not land on the checkpoint.
    let target = d.path().join("model.safetensors");
    assert_clean_error(
        &with(&["--logits-out", target.to_str().unwrap()]),
        &["--logits-out", "model folder"],
    );
    assert_eq!(
        std::fs::read(&target).unwrap(),
        weights,
        "the checkpoint was changed"
    );
    // Manifest checks with nothing to check are refused, not ignored.
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("publisher.key");
    let g = stormo(&["key", "generate", "--out", key.to_str().unwrap()]);
    assert!(g.status.success(), "{}", stderr(&g));
    let public = String::from_utf8_lossy(&g.stdout).trim().to_string();
    assert_eq!(public.len(), 64, "{public}");
    assert_clean_error(
        &with(&["--trust", &public]),
        &["--trust applies only with --peer"],
    );
    assert_clean_error(
        &with(&["--trust", &public, "--key", key.to_str().unwrap()]),
        &["--trust, --key apply only with --peer"],
    );
    // Manifest files may not land on the checkpoint, on each other, or on the manifest.
    let build_to = |out: &Path| {
        let out = out.to_str().unwrap();
        stormo(&["manifest", "build", "--model", model, "--out", out])
    };
    assert_clean_error(&build_to(&target), &["is not a manifest"]);
    assert_eq!(
        std::fs::read(&target).unwrap(),
        weights,
        "the checkpoint was changed"
    );
    assert_clean_error(&build_to(&d.path().join("m.json")), &["share one file"]);
    let sig = d.path().join("m.sig");
    let (key_arg, sig_arg) = (key.to_str().unwrap(), sig.to_str().unwrap());
    assert_clean_error(
        &stormo(&[
            "manifest",
            "sign",
            "--model",
            model,
            "--key",
            key_arg,
            "--manifest",
            sig_arg,
        ]),
        &["would overwrite the manifest"],
    );
    // A device is not a prompt file or an allow-list (it would fill memory).
    assert_clean_error(
        &stormo(&["run", "--model", model, "--prompt-ids-file", "/dev/zero"]),
        &["--prompt-ids-file", "/dev/zero"],
    );
    assert_clean_error(
        &stormo(&[
            "serve",
            "--model",
            model,
            "--listen",
            "127.0.0.1:0",
            "--allow-file",
            "/dev/zero",
        ]),
        &["--allow-file", "/dev/zero"],
    );
    // A bad size is refused when the arguments are read, before any node starts.
    assert_usage_error(
        &stormo(&["swarm", "--scenario", "lan", "--client-cache", "10XB"]),
        &["--client-cache", "unknown size unit"],
    );
    // Options that would be ignored.
    assert_clean_error(&with(&["--raw"]), &["--raw"]);
    assert_clean_error(
        &stormo(&[
            "run",
            "--model",
            model,
            "--prompt-ids",
            "1",
            "--max-new-tokens",
            "0",
        ]),
        &["--max-new-tokens"],
    );
    // A manifest written over a folder fails without leaving a temporary file beside it.
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    assert_clean_error(&build_to(&out), &["is a folder"]);
    let left: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}
