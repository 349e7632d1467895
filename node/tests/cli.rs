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
    // The fields a text prompt's object has, where they make sense: the prompt's ids, and
    // why it stopped (no --stop-at-eos: the length).
    let prompt: Vec<String> = j["prompt_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no prompt_ids: {j}"))
        .iter()
        .map(serde_json::Value::to_string)
        .collect();
    assert_eq!(prompt, ids);
    assert_eq!(j["finish_reason"], "length", "{j}");
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
    // An empty text prompt is refused with and without the chat format.
    for raw in [&[][..], &["--raw"]] {
        let o = stormo(&[&["run", "--model", m, "--prompt", ""][..], raw].concat());
        assert_clean_error(&o, &["--prompt is empty"]);
    }
    assert_clean_error(
        &stormo(&["run", "--model", m, "--prompt-ids-file", "/nonexistent/ids"]),
        &["/nonexistent/ids"],
    );
    // A text prompt with a wrong model folder names the folder, not the missing tokenizer.
    let config = dir.join("config.json");
    let config = config.to_str().unwrap();
    for args in [
        &["run", "--model", "/nonexistent/model", "--prompt", "hi"][..],
        &["chat", "--model", "/nonexistent/model"],
        &[
            "serve",
            "--model",
            "/nonexistent/model",
            "--http",
            "127.0.0.1:0",
        ],
        &["run", "--model", config, "--prompt", "hi"],
    ] {
        let o = stormo(args);
        assert_clean_error(&o, &[]);
        // A folder that is no model is named once ("no model at DIR: ..."); any other failure
        // to load names the folder it was loading.
        let err = stderr(&o);
        assert!(
            err.contains("no model at") || err.contains("loading the model in"),
            "{args:?}: {err}"
        );
        assert!(
            !stderr(&o).contains("no tokenizer"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
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
    // Issue: "the prompt (1 tokens) plus 200000 new tokens needs 200000 positions" read as a
    // sum gone wrong; the last new token takes no position, and the message says so.
    let o = stormo(&[
        "run",
        "--model",
        d.path().to_str().unwrap(),
        "--prompt-ids",
        "1",
        "-n",
        "200000",
    ]);
    assert_clean_error(
        &o,
        &[
            "the prompt (1 token) and 200000 new tokens need 200000 positions",
            "1 + 200000 - 1",
        ],
    );
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
    let g = stormo(&["key", "generate", "--key", key.to_str().unwrap()]);
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
        &stormo(&["sim", "--scenario", "lan", "--client-cache", "10XB"]),
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

/// Writes a byte-level BPE tokenizer.json for a 2048-id model into `dir`: ids 0-255 are the
/// bytes, ids 256-2047 the text `<ID>`; no merges, so text encodes byte by byte.
fn write_byte_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    let mut shifted = 0;
    for b in 0..256u32 {
        // GPT-2's byte-level spelling: printable bytes stand for themselves.
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let c = if printable {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        vocab.insert(char::from_u32(c).unwrap().to_string(), b.into());
    }
    for id in 256..2048u32 {
        vocab.insert(format!("<{id}>"), id.into());
    }
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": false});
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
}

/// An `--only-experts` spec holding the experts that `args` with `--max-new-tokens 1` needs,
/// grown one expert at a time (each refusal names the expert missing) until that run
/// succeeds: enough for the prompt and the first token, not for every later one.
fn experts_for_one_token(args: &[&str]) -> String {
    let mut spec = String::from("0:0");
    for _ in 0..128 {
        let o = stormo(&[args, &["--max-new-tokens", "1", "--only-experts", &spec]].concat());
        if o.status.success() {
            return spec;
        }
        let err = stderr(&o);
        let (_, rest) = err
            .split_once("error: expert ")
            .unwrap_or_else(|| panic!("not a missing expert: {err}"));
        // "E of layer L: no tier holds it"
        let mut nums = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty());
        let (expert, layer) = (nums.next().unwrap(), nums.next().unwrap());
        spec += &format!(",{layer}:{expert}");
    }
    panic!("no spec found; the last was {spec}");
}

fn json_ids(j: &serde_json::Value) -> Vec<u64> {
    j["generated_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no generated_ids: {j}"))
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// `stormo run` prints ids (or text) as each token is made: when generation fails partway (an
/// expert no tier holds, as when the peers serving it vanish), what was made before is on
/// stdout, the line ended, and the error on stderr; with --json the object holds the ids so
/// far and the error. On success stdout is as before: the ids and a newline, or the text.
#[test]
fn run_output_made_before_a_failure_is_on_stdout() {
    let d = copy_model("qwen3moe-tiny");
    write_byte_tokenizer(d.path());
    let model = d.path().to_str().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let logits = elsewhere.path().join("logits.safetensors");
    let ids: &[&str] = &["--prompt-ids", "1"];
    let modes: [(&str, Vec<&str>); 4] = [
        ("greedy ids", ids.to_vec()),
        (
            "greedy with logits",
            [ids, &["--logits-out", logits.to_str().unwrap()]].concat(),
        ),
        (
            "sampled",
            [ids, &["--temperature", "1", "--seed", "3"]].concat(),
        ),
        ("text", vec!["--raw", "--prompt", "hi"]),
    ];
    for (mode, extra) in &modes {
        let base = [&["run", "--model", model, "--no-hot-store"], &extra[..]].concat();
        let with = |more: &[&str]| stormo(&[&base[..], &["--max-new-tokens", "8"], more].concat());
        let full = with(&[]);
        assert!(full.status.success(), "{mode}: {}", stderr(&full));
        let full_json = with(&["--json"]);
        assert!(full_json.status.success(), "{mode}: {}", stderr(&full_json));
        let j: serde_json::Value = serde_json::from_slice(&full_json.stdout).unwrap();
        let want = json_ids(&j);
        let full = String::from_utf8(full.stdout).unwrap();
        // The output format is unchanged: ids joined by spaces, or the text, then a newline.
        let line = if *mode == "text" {
            j["text"].as_str().unwrap().to_string()
        } else {
            let s: Vec<String> = want.iter().map(u64::to_string).collect();
            s.join(" ")
        };
        assert_eq!(full, format!("{line}\n"), "{mode}");

        let spec = experts_for_one_token(&base);
        let cut = with(&["--only-experts", &spec]);
        let err = stderr(&cut);
        assert_eq!(cut.status.code(), Some(1), "{mode}: {err}");
        assert!(
            err.contains("no tier holds it") && !err.contains("panicked"),
            "{mode}: {err}"
        );
        let out = String::from_utf8(cut.stdout).unwrap();
        let made = out
            .strip_suffix('\n')
            .unwrap_or_else(|| panic!("{mode}: no line made before the error: {out:?}"));
        assert!(
            !made.is_empty() && made.len() < line.len() && line.starts_with(made),
            "{mode}: {made:?} is not the start of {line:?}"
        );
        let cut = with(&["--only-experts", &spec, "--json"]);
        assert_eq!(cut.status.code(), Some(1), "{mode}: {}", stderr(&cut));
        let j: serde_json::Value = serde_json::from_slice(&cut.stdout)
            .unwrap_or_else(|e| panic!("{mode}: --json after an error is not JSON ({e})"));
        let so_far = json_ids(&j);
        assert!(
            !so_far.is_empty() && so_far.len() < want.len() && want.starts_with(&so_far),
            "{mode}: {so_far:?} is not the start of {want:?}"
        );
        assert_eq!(j["finish_reason"], "error", "{mode}: {j}");
        assert!(j["prompt_ids"].is_array(), "{mode}: {j}");
        assert!(
            j["error"].as_str().unwrap().contains("no tier holds it"),
            "{mode}: {j}"
        );
    }
    // An error before the first token prints nothing; with --json, the error as an object.
    let o = stormo(&["run", "--model", model, "--prompt-ids", "1,2048"]);
    assert_clean_error(&o, &["2048", "vocabulary"]);
    let o = stormo(&["run", "--model", model, "--prompt-ids", "1,2048", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--json error object");
    assert_eq!(j["finish_reason"], "error", "{j}");
    assert_eq!(j["generated_ids"], serde_json::json!([]), "{j}");
    assert!(j["error"].as_str().unwrap().contains("2048"), "{j}");
}

/// Builds the fixture's manifest in a copy and makes two publisher keys; returns the copy, the
/// keys' folder and the keys' paths and public keys.
fn built_manifest_and_two_keys() -> (tempfile::TempDir, tempfile::TempDir, [(String, String); 2]) {
    let d = copy_model("qwen3moe-tiny");
    let o = stormo(&["manifest", "build", "--model", d.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let keys = tempfile::tempdir().unwrap();
    let key = |name: &str| {
        let p = keys.path().join(name).to_str().unwrap().to_string();
        let g = stormo(&["key", "generate", "--key", &p]);
        assert!(g.status.success(), "{}", stderr(&g));
        (p, String::from_utf8(g.stdout).unwrap().trim().to_string())
    };
    let pair = [key("a.key"), key("b.key")];
    (d, keys, pair)
}

#[test]
fn manifest_sign_refuses_to_replace_a_signature_without_force() {
    let (d, _keys, [(a, a_pub), (b, b_pub)]) = built_manifest_and_two_keys();
    let model = d.path().to_str().unwrap();
    let sig = d.path().join("stormo-manifest.sig");
    let sign = |key: &str, more: &[&str]| {
        stormo(&[&["manifest", "sign", "--model", model, "--key", key], more].concat())
    };
    let o = sign(&a, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("replaced"), "{}", stderr(&o));
    let by_a = std::fs::read(&sig).unwrap();
    // Another key, or the same one again: refused, naming the signer, the file left alone.
    for key in [&b, &a] {
        assert_clean_error(
            &sign(key, &[]),
            &["already exists", &a_pub, "for this manifest", "--force"],
        );
        assert_eq!(
            std::fs::read(&sig).unwrap(),
            by_a,
            "the signature was replaced"
        );
    }
    let o = sign(&b, &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("replaced") && err.contains(&a_pub), "{err}");
    let o = stormo(&[
        "manifest",
        "verify",
        "--model",
        model,
        "--trust",
        &b_pub,
        "--signature-only",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A file there that is not a signature is not replaced silently either.
    std::fs::write(&sig, b"not a signature").unwrap();
    assert_clean_error(&sign(&a, &[]), &["already exists", "not a signature"]);
    assert_eq!(std::fs::read(&sig).unwrap(), b"not a signature");
    let help = stormo(&["manifest", "sign", "--help"]);
    assert!(String::from_utf8_lossy(&help.stdout).contains("--force"));
}

/// A file that is not a key is named as such, whatever its mode; `chmod` is advised only for a
/// key file others may read.
#[cfg(unix)]
#[test]
fn key_show_on_a_file_that_is_not_a_key_says_so_and_not_chmod() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let not_key = dir.path().join("config.json");
    std::fs::copy(fixture("qwen3moe-tiny").join("config.json"), &not_key).unwrap();
    let not_key = not_key.to_str().unwrap();
    for mode in [0o644, 0o600] {
        std::fs::set_permissions(not_key, std::fs::Permissions::from_mode(mode)).unwrap();
        let o = stormo(&["key", "show", "--key", not_key]);
        assert_clean_error(
            &o,
            &["not a stormo secret key", "stormo key generate", not_key],
        );
        assert!(
            !stderr(&o).contains("chmod"),
            "mode {mode:o}: {}",
            stderr(&o)
        );
    }
    // The same for the commands that sign with a key.
    let model = fixture("qwen3moe-tiny");
    let o = stormo(&[
        "manifest",
        "sign",
        "--model",
        model.to_str().unwrap(),
        "--key",
        not_key,
    ]);
    assert_clean_error(&o, &["not a stormo secret key"]);
    assert!(!stderr(&o).contains("chmod"), "{}", stderr(&o));
    // And for a node's own key (serve, pull, run --peer): the key is read before listening.
    let o = stormo(&[
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--key",
        not_key,
    ]);
    assert_clean_error(&o, &["not a stormo secret key", "--key"]);
    assert!(!stderr(&o).contains("chmod"), "{}", stderr(&o));
    // A real key others may read: that is about permissions.
    let key = dir.path().join("loose.key");
    let key = key.to_str().unwrap();
    let g = stormo(&["key", "generate", "--key", key]);
    assert!(g.status.success(), "{}", stderr(&g));
    std::fs::set_permissions(key, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_clean_error(
        &stormo(&["key", "show", "--key", key]),
        &["too open", "chmod 600"],
    );
}

/// `stormo synth` of a one-layer GPT-OSS shape into `out`, quiet, with `more` arguments; its
/// 2048 ids fit [`write_byte_tokenizer`]'s tokenizer.
fn synth_tiny(out: &Path, more: &[&str]) -> Output {
    let shape = [
        "synth",
        "--preset",
        "gpt-oss-20b",
        "--quiet",
        "--layers",
        "1",
        "--hidden",
        "64",
        "--intermediate",
        "64",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--vocab",
        "2048",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "16",
        "--out",
        out.to_str().unwrap(),
    ];
    stormo(&[&shape[..], more].concat())
}

/// `synth --force` over a signed synthetic model removes the manifest and signature that
/// described the old weights (they made a later verify fail on every tensor); without
/// --force, a folder holding only such files is refused.
#[test]
fn synth_force_removes_the_manifest_of_the_checkpoint_it_replaces() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let m = out.to_str().unwrap();
    let o = synth_tiny(&out, &["--seed", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let key = tmp.path().join("publisher.key");
    let key = key.to_str().unwrap();
    let g = stormo(&["key", "generate", "--key", key]);
    assert!(g.status.success(), "{}", stderr(&g));
    let public = String::from_utf8(g.stdout).unwrap().trim().to_string();
    let build_sign_verify = || {
        for args in [
            &["manifest", "build", "--model", m][..],
            &["manifest", "sign", "--model", m, "--key", key],
            &["manifest", "verify", "--model", m, "--trust", &public],
        ] {
            let o = stormo(args);
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        }
    };
    build_sign_verify();
    let o = synth_tiny(&out, &["--seed", "2", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("removed"), "{}", stderr(&o));
    for f in ["bin", "json", "sig"] {
        let p = out.join(format!("stormo-manifest.{f}"));
        assert!(
            !p.exists(),
            "{} is left beside the new weights",
            p.display()
        );
    }
    // The folder is consistent: a new manifest and signature (no --force needed) verify.
    build_sign_verify();
    // A folder holding only a signature of something else is not quietly written into.
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("stormo-manifest.sig"), b"old").unwrap();
    assert_clean_error(
        &synth_tiny(&other, &[]),
        &["stormo-manifest.sig", "--force"],
    );
    assert!(!other.join("config.json").exists());
}

/// `synth --force` without --tokenizer over a model synthesized with one removes the old
/// tokenizer.json (it belonged to the weights replaced), and only what it knows: a user's file
/// in the folder stays. A text prompt then names the missing tokenizer; --tokenizer with
/// --force copies one as before.
#[test]
fn synth_force_without_a_tokenizer_removes_the_old_one() {
    let tmp = tempfile::tempdir().unwrap();
    write_byte_tokenizer(tmp.path());
    let tok = tmp.path().join("tokenizer.json");
    let tok_s = tok.to_str().unwrap();
    let out = tmp.path().join("model");
    let in_out = out.join("tokenizer.json");
    let o = synth_tiny(&out, &["--seed", "1", "--tokenizer", tok_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(in_out.is_file(), "--tokenizer not copied");
    let notes = out.join("notes.txt");
    std::fs::write(&notes, b"mine").unwrap();

    let dry = synth_tiny(&out, &["--seed", "2", "--force", "--dry-run"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let listed = String::from_utf8_lossy(&dry.stdout).into_owned();
    assert!(
        listed.contains("tokenizer.json  removed"),
        "the dry run does not list the tokenizer's removal: {listed}"
    );
    assert!(in_out.is_file(), "the dry run removed the tokenizer");

    let o = synth_tiny(&out, &["--seed", "2", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !in_out.exists(),
        "the old tokenizer.json is left beside the new weights"
    );
    assert!(stderr(&o).contains("tokenizer.json"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&notes).unwrap(), b"mine", "a user's file");
    let m = out.to_str().unwrap();
    assert_clean_error(
        &stormo(&["run", "--model", m, "--no-hot-store", "--prompt", "hi"]),
        &["no tokenizer", "tokenizer.json", "--prompt-ids"],
    );

    let o = synth_tiny(&out, &["--seed", "3", "--force", "--tokenizer", tok_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&in_out).unwrap(),
        std::fs::read(&tok).unwrap()
    );
    // --tokenizer naming the one in place keeps it (a copy onto itself would truncate it).
    let o = synth_tiny(
        &out,
        &[
            "--seed",
            "4",
            "--force",
            "--tokenizer",
            in_out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&in_out).unwrap(),
        std::fs::read(&tok).unwrap()
    );
    assert_eq!(std::fs::read(&notes).unwrap(), b"mine", "a user's file");

    // A tokenizer.json put in a folder holding no checkpoint is for the one written there.
    let fresh = tmp.path().join("fresh");
    std::fs::create_dir(&fresh).unwrap();
    std::fs::copy(&tok, fresh.join("tokenizer.json")).unwrap();
    let o = synth_tiny(&fresh, &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        fresh.join("tokenizer.json").is_file(),
        "a tokenizer put there"
    );
}

/// `demo` and `swarm` write keys into `--work`, and keys are never overwritten: a folder that
/// already holds files (an earlier run's) is refused before anything starts, and left alone.
#[test]
fn work_folders_must_be_new_or_empty() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("publisher.key"), b"an earlier run's key").unwrap();
    let work = dir.path().to_str().unwrap();
    for args in [
        &["demo", "--work", work][..],
        &["sim", "--scenario", "lan4", "--work", work],
    ] {
        let o = stormo(args);
        assert_clean_error(&o, &["--work", "not empty"]);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{args:?}");
        assert_eq!(
            std::fs::read(dir.path().join("publisher.key")).unwrap(),
            b"an earlier run's key"
        );
    }
}

/// `bench` on a checkpoint too small for its disk test says so instead of reporting nothing
/// after "measuring disk bandwidth...", and `--disk-test 0` skips the test without a word.
#[test]
fn bench_says_when_the_disk_test_cannot_run() {
    let model = fixture("gptoss-tiny-mxfp4");
    let m = model.to_str().unwrap();
    let common = [
        "bench",
        "--model",
        m,
        "--no-hot-store",
        "--mem-test",
        "1MiB",
        "--prompt-tokens",
        "2",
        "--decode-tokens",
        "2",
    ];
    let o = stormo(&common);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("disk             not measured"), "{out}");
    // A decode longer than the context: the message's sum adds up (each decoded token is
    // fed back, twice --decode-tokens of them).
    let o = stormo(&[&common[..8], &["--decode-tokens", "70000"]].concat());
    assert_clean_error(&o, &["need 140002 positions (2 + 2 × 70000)"]);
    let o = stormo(&[&common[..], &["--disk-test", "0"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains("disk             "), "{out}");
    assert!(!stderr(&o).contains("measuring disk"), "{}", stderr(&o));
}

/// Sampling options that greedy decoding does not use are named in a warning, not dropped in
/// silence; with a temperature they are used and nothing is said.
#[test]
fn sampling_options_without_a_temperature_are_reported_as_ignored() {
    let model = fixture("gptoss-tiny-mxfp4");
    let m = model.to_str().unwrap();
    let run = [
        "run",
        "--model",
        m,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ];
    let o = stormo(&[&run[..], &["--top-p", "0.5", "--seed", "5"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stderr(&o)
            .matches("--top-p, --seed ignored: decoding is greedy")
            .count(),
        1,
        "{}",
        stderr(&o)
    );
    for extra in [
        &[][..],
        &["--temperature", "0.5", "--top-p", "0.5", "--seed", "5"],
    ] {
        let o = stormo(&[&run[..], extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(!stderr(&o).contains("ignored"), "{extra:?}: {}", stderr(&o));
    }
}

/// `stormo completions bash` prints a bash completion script that knows the commands and
/// their options; an unknown shell is a usage error naming the choices; `stormo man` prints
/// the manual page.
#[test]
fn completions_and_man_page_are_printed() {
    let o = stormo(&["completions", "bash"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8(o.stdout).expect("UTF-8");
    for want in [
        "_stormo()",
        "complete -F _stormo",
        "bench",
        "--max-new-tokens",
    ] {
        assert!(s.contains(want), "{want:?} missing from the bash script");
    }
    assert_usage_error(&stormo(&["completions", "cmd.exe"]), &["cmd.exe", "bash"]);
    let o = stormo(&["man"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(".TH stormo"));
}

/// Issue: `chat --help` said resuming a --session with other sampling options is an error
/// (they take over), and that /save's JSON is OpenAI's message shape while /load read only
/// stormo's wrapper; `run --help` listed --json's fields loosely. The help says what happens.
#[test]
fn chat_and_run_help_say_what_sessions_load_and_json_do() {
    let o = stormo(&["chat", "--help"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let help = String::from_utf8(o.stdout).unwrap();
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "a sampling option given again (--temperature, --top-p, --top-k, \
         --repetition-penalty, --seed) takes over",
        "an OpenAI chat request body ({\"messages\": [...]}) or a JSON array of messages",
        "a message that would not fit with the conversation is not added",
    ] {
        assert!(
            flat.contains(want),
            "{want:?} missing from chat --help: {help}"
        );
    }
    assert!(!flat.contains("and sampling options;"), "{help}");
    let o = stormo(&["run", "--help"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let help = String::from_utf8(o.stdout).unwrap();
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("generated_ids, prompt_ids, prompt_tokens, finish_reason"),
        "{help}"
    );
}

/// `stormo swarm create` and `admit` make a certificate that `show` reads back; a bad node
/// key, a missing owner key, a past date and a zero duration are each refused clearly.
#[test]
fn swarm_create_admit_show_and_their_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let owner = p("swarm.key");
    let o = stormo(&["swarm", "create", "--owner", &owner]);
    assert!(o.status.success(), "{}", stderr(&o));
    let swarm = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert_eq!(swarm.len(), 64, "{swarm}");
    let o = stormo(&["key", "generate", "--key", &p("node.key")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let node = String::from_utf8(o.stdout).unwrap().trim().to_string();

    let cert = p("node.cert");
    let o = stormo(&[
        "swarm",
        "admit",
        "--owner",
        &owner,
        "--node",
        &node,
        "--expires",
        "7d",
        "--out",
        &cert,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::metadata(&cert).unwrap().len(), 154);
    // A node's secret key file names its key too.
    let o = stormo(&[
        "swarm",
        "admit",
        "--owner",
        &owner,
        "--node",
        &p("node.key"),
        "--out",
        &p("c2"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&cert).unwrap()[42..74],
        std::fs::read(p("c2")).unwrap()[42..74]
    );
    let o = stormo(&["swarm", "show", "--cert", &cert]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains(&swarm) && out.contains(&node) && out.contains("valid now"),
        "{out}"
    );

    let admit = |node: &str, expires: &str, owner: &str| {
        stormo(&[
            "swarm",
            "admit",
            "--owner",
            owner,
            "--node",
            node,
            "--expires",
            expires,
            "--out",
            &p("refused.cert"),
        ])
    };
    assert_clean_error(&admit("abc", "7d", &owner), &["--node", "not a node key"]);
    assert_clean_error(
        &admit(&node, "7d", &p("missing.key")),
        &["--owner", "missing.key"],
    );
    assert_clean_error(
        &admit(&node, "2020-01-01", &owner),
        &["--expires", "in the past"],
    );
    assert_clean_error(
        &admit(&node, "0d", &owner),
        &["--expires", "valid for some time"],
    );
    assert!(!dir.path().join("refused.cert").exists());
    // An edited certificate is shown as not valid.
    let mut b = std::fs::read(&cert).unwrap();
    b[85] ^= 1;
    std::fs::write(p("edited.cert"), b).unwrap();
    let o = stormo(&["swarm", "show", "--cert", &p("edited.cert")]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("signature is invalid"));
}

/// `swarm status` whose every peer is unreachable prints the empty report but exits with an
/// error that says no peer answered (a script must not read "0 copies" as the swarm's state).
#[test]
fn swarm_status_without_an_answering_peer_fails() {
    let (d, keys, [(key, _), (_, other)]) = built_manifest_and_two_keys();
    // `manifest build` prints the model id; built again, it prints the same.
    let o = stormo(&["manifest", "build", "--model", d.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let id = String::from_utf8(o.stdout).unwrap().trim().to_string();
    // A loopback port with nothing on it: bound, then released.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let peer = format!("{other}@127.0.0.1:{port}");
    let o = stormo(&[
        "swarm",
        "status",
        "--model",
        d.path().to_str().unwrap(),
        "--key",
        &key,
        "--peer",
        &peer,
        "--model-id",
        &id,
        "--wait",
        "1",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(err.contains("no peer answered"), "{err}");
    drop(keys);
}

/// Out-of-range sampling values and negative counts are refused as usage errors that name
/// the flag and say what is wrong (not the engine's parameter names, not "invalid digit").
#[test]
fn bad_sampling_values_and_counts_name_the_flag() {
    let model = fixture("qwen3moe-tiny");
    let model = model.to_str().unwrap();
    for (flag, value, says) in [
        ("--temperature", "-1", "positive finite"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--repetition-penalty", "0", "positive finite"),
        ("--max-new-tokens", "-1", "negative"),
        ("--seed", "-5", "negative"),
        ("--top-k", "-1", "negative"),
        ("--top-k", "two", "not a whole number"),
    ] {
        let o = stormo(&["run", "--model", model, "--prompt-ids", "1,2", flag, value]);
        assert_usage_error(&o, &[flag, says]);
    }
    let o = stormo(&[
        "run",
        "--model",
        model,
        "--prompt-ids",
        "1",
        "--expert-cache",
        "9XB",
    ]);
    assert_usage_error(&o, &["--expert-cache", "or auto"]);
}

/// A render option given with token ids is said to be unused (ids go to the model as given);
/// ids with an empty item between commas are refused.
#[test]
fn run_with_prompt_ids_says_reasoning_effort_is_unused_and_refuses_empty_items() {
    let dir = fixture("gptoss-tiny-mxfp4");
    let m = dir.to_str().unwrap();
    let args = ["run", "--model", m, "--max-new-tokens", "1", "--prompt-ids"];
    let with = |extra: &[&str], ids: &str| {
        let mut a = args.to_vec();
        a.push(ids);
        a.extend_from_slice(extra);
        stormo(&a)
    };
    let out = with(&["--reasoning-effort", "high"], "1,2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("--reasoning-effort applies to --prompt"),
        "{err}"
    );
    let out = with(&[], "1,2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("--reasoning-effort"), "{err}");
    let out = with(&[], "1,,2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--prompt-ids: an empty item after item 1"),
        "{err}"
    );
}

/// `run --json` prints one object when it fails before generating: the error and
/// finish_reason "error" (it printed nothing on stdout before).
#[test]
fn run_json_prints_an_object_for_an_error_before_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-model");
    let out = stormo(&[
        "run",
        "--json",
        "--model",
        missing.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
    ]);
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(v["finish_reason"], "error", "{v}");
    let e = v["error"].as_str().expect("error text");
    assert!(e.contains("no-model"), "{e}");
}
