//! `stormo chat` and `stormo run` as a user meets them, without a terminal: piped chat turns,
//! text prompts rendered through the chat format, sampling options, and the errors and
//! warnings given at start (a config that leaves tensors unused, NaN logits, a missing or
//! foreign tokenizer, a context too small). Moved out of `chat.rs` (tokenizers, formats,
//! sessions), which kept them over 1,500 lines.

use std::process::{Command, Stdio};

use serde_json::Value;
use stormo_engine::Family;
use stormo_tests::fixture;
use stormo_text::{ChatFormat, PromptOptions, Turn, TurnRole};

use crate::chat::{ids_of, o200k};

// ---- `stormo chat` without a terminal ----

/// Two turns piped in: both are answered, the second reuses the first's cached prompt, and
/// /reset starts over (nothing reused).
#[test]
fn chat_answers_piped_turns_and_reports_reuse() {
    use clap::Parser;
    use stormo_cli::cmd::chat::{converse, sampling, Args};

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: Args,
    }
    let model = crate::http::synth_model();
    let dir = model.path();
    let w = Wrap::try_parse_from([
        "chat",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--max-new-tokens",
        "64",
        "--context",
        "512",
        "--show-reasoning",
        "show",
        "--seed",
        "4",
    ])
    .expect("chat arguments parse");
    let tm = crate::http::text_model(dir, 512);
    // (Line 3 is not UTF-8: skipped with a note, not the end of the chat.)
    let input: &[u8] =
        b"Hello there\n/bogus\n\xff\xfe\nAnd again?\n/reset\nHello there\n/quit\nnever read\n";
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let sampling = sampling(&w.args).expect("sampling options");
    converse(
        &w.args, &tm, sampling, input, &mut out, &mut notes, false, false,
    )
    .expect("conversation runs");
    let notes = String::from_utf8(notes).expect("utf-8");
    assert!(
        notes.contains("line 3 is not UTF-8 text: skipped"),
        "{notes}"
    );
    let out = String::from_utf8(out).expect("utf-8");
    let stats: Vec<&str> = notes.lines().filter(|l| l.starts_with("[prompt")).collect();
    assert_eq!(stats.len(), 3, "three replies: {notes}");
    assert!(notes.contains("unknown command /bogus"), "{notes}");
    assert!(notes.contains("(conversation reset)"), "{notes}");
    // A random-weight model leaves Harmony's header unfinished; past that the reply shows as
    // plain text, so there is text to see.
    assert!(
        out.chars().any(|c| !c.is_whitespace()),
        "replies were printed: {out:?}"
    );
    let reused = |l: &str| -> usize {
        l.split(", ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a reuse count in {l}"))
    };
    let first_prompt = tm
        .format
        .render_prompt(
            &[Turn::new(TurnRole::User, "Hello there")],
            &PromptOptions::default(),
        )
        .expect("render")
        .len();
    assert_eq!(reused(stats[0]), 0, "{}", stats[0]);
    assert!(
        reused(stats[1]) >= first_prompt,
        "the second turn reuses at least the first prompt ({first_prompt}): {}",
        stats[1]
    );
    assert_eq!(reused(stats[2]), 0, "after /reset: {}", stats[2]);
}

/// `converse` (the piped chat) with `args` after `--model DIR` on `tm`, `input` piped in:
/// its result, and the notes it wrote.
fn converse_in(
    dir: &std::path::Path,
    tm: &stormo_cli::cmd::chat::TextModel,
    args: &[&str],
    input: &str,
) -> (anyhow::Result<()>, String) {
    use clap::Parser;
    use stormo_cli::cmd::chat::{converse, sampling, Args};

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: Args,
    }
    let argv = [
        &["chat", "--model", dir.to_str().expect("utf-8 path")],
        args,
    ]
    .concat();
    let w = Wrap::try_parse_from(argv).expect("chat arguments parse");
    let sampling = sampling(&w.args).expect("sampling options");
    let (mut out, mut notes) = (Vec::new(), Vec::new());
    let r = converse(
        &w.args,
        tm,
        sampling,
        input.as_bytes(),
        &mut out,
        &mut notes,
        false,
        false,
    );
    (r, String::from_utf8(notes).expect("utf-8"))
}

/// Issue: `/quit now` and `/reset now` were sent to the model as messages, and `/load` read
/// only stormo's own wrapper although `/save` promised OpenAI's message shape. A known command
/// given an argument it takes none of says so and is not sent; an unknown one, with or
/// without an argument, is named; a line that starts with a space is a message even when it
/// starts with `/`. `/load` reads a bare array of messages and an OpenAI chat request body;
/// the counts say "1 message", not "1 messages".
#[test]
fn chat_commands_take_their_arguments_and_load_reads_openai_messages() {
    let model = crate::http::synth_model();
    let dir = model.path();
    let tm = crate::http::text_model(dir, 512);
    let tmp = tempfile::tempdir().expect("temp dir");
    let file = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.to_str().expect("utf-8 path").to_string()
    };
    let bare = file("bare.json", r#"[{"role": "user", "content": "Hello."}]"#);
    let body = file(
        "body.json",
        r#"{"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi!"}]}"#,
    );
    let saved = tmp.path().join("saved.json");
    let s = saved.to_str().expect("utf-8 path");
    let input = format!(
        "/quit now\n/reset now\n/help me\n/bogus now\n/load {bare}\n/save {s}\n/load {body}\n \
         /quit\n/save {s}\n/quit\nnever read\n"
    );
    let args = ["-n", "8", "--temperature", "0", "--no-hot-store"];
    let (r, notes) = converse_in(dir, &tm, &args, &input);
    r.expect("the chat runs");
    for want in [
        "/quit takes no argument",
        "/reset takes no argument",
        "/help takes no argument",
        "unknown command /bogus",
        "(loaded 1 message from",
        "(saved 1 message to",
        "(loaded 2 messages from",
        "(saved 4 messages to",
    ] {
        assert!(notes.contains(want), "wanted {want:?} in {notes}");
    }
    let stats = notes.lines().filter(|l| l.starts_with("[prompt")).count();
    assert_eq!(stats, 1, "only \" /quit\" was sent: {notes}");
    let turns = stormo_text::transcript::load(&saved).expect("the saved chat");
    let said: Vec<(TurnRole, &str)> = turns.iter().map(|t| (t.role, &*t.content)).collect();
    assert_eq!(
        said[..3],
        [
            (TurnRole::User, "Hello."),
            (TurnRole::Assistant, "Hi!"),
            (TurnRole::User, " /quit"),
        ],
        "{notes}"
    );
}

/// Issue: `chat --session` to a folder that does not exist said "(new session: saved to
/// ...)", ran every turn, failed every save and exited 0. It is now refused before the model
/// loads, naming the path; and a save that fails later (the folder removed under a running
/// chat) ends the chat with an error once the input is done, every turn still answered.
#[test]
fn a_session_that_cannot_be_saved_is_an_error() {
    let model = crate::http::synth_model();
    let dir = model.path();
    let d = dir.to_str().expect("utf-8 path");
    let tmp = tempfile::tempdir().expect("temp dir");
    let nowhere = tmp.path().join("nope").join("s.kv");
    let n = nowhere.to_str().expect("utf-8 path");
    let out = chat_piped(
        &["--model", d, "--no-hot-store", "--session", n],
        "x\ny\n",
        tmp.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("--session {n}")) && err.contains("create it"),
        "{err}"
    );
    assert!(
        !err.contains("new session") && out.stdout.is_empty(),
        "{err}"
    );

    // Past the check (the library's loop, which does not make it): every turn runs, each
    // failed save is a note, and the chat ends with an error.
    let tm = crate::http::text_model(dir, 512);
    let args = [
        "-n",
        "4",
        "--temperature",
        "0",
        "--no-hot-store",
        "--session",
        n,
    ];
    let (r, notes) = converse_in(dir, &tm, &args, "x\ny\n");
    let e = format!("{:#}", r.expect_err("the saves failed"));
    assert!(
        e.contains(&format!(
            "--session {n}: 2 saves of the conversation failed"
        )),
        "{e}"
    );
    assert_eq!(
        notes.matches("cannot save the session").count(),
        2,
        "{notes}"
    );
    assert_eq!(
        notes.lines().filter(|l| l.starts_with("[prompt")).count(),
        2
    );
}

// ---- `stormo run --prompt` and `stormo chat` through the binary ----

/// Runs the stormo binary with its cache (the hot store) in a temporary folder.
fn stormo_bin(args: &[&str], cache: &std::path::Path) -> std::process::Output {
    Command::new(crate::demo::stormo_exe())
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .stdin(Stdio::null())
        .output()
        .expect("run the stormo binary")
}

fn json_of(out: &std::process::Output, what: &str) -> Value {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed: {err}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{what} --json is not JSON ({e}): {err}"))
}

/// `stormo run --prompt TEXT --json` on a synthetic GPT-OSS with the real vocabulary: the
/// prompt ids are the library's Harmony render of the text as one user turn (default
/// reasoning effort), and the generated ids are what a greedy `--prompt-ids` run of those
/// same ids makes (up to a Harmony stop token, where the text run ends).
#[test]
fn run_prompt_renders_harmony_and_generates_as_prompt_ids() {
    let model = crate::http::synth_model();
    let dir = model.path();
    let d = dir.to_str().expect("utf-8 path");
    let cache = tempfile::tempdir().expect("temp dir");
    let text = "Why is the sky blue?  Ünïcödé 😀 <|start|> fn main() {}";
    let common = [
        "--model",
        d,
        "--max-new-tokens",
        "6",
        "--no-hot-store",
        "--json",
    ];

    let mut args = vec!["run", "--prompt", text];
    args.extend_from_slice(&common);
    let v = json_of(&stormo_bin(&args, cache.path()), "run --prompt");
    let prompt = ids_of(&v["prompt_ids"]);
    let format =
        ChatFormat::for_family(Family::GptOss, o200k().clone()).expect("o200k fits Harmony");
    let popts = stormo_cli::cmd::chat::prompt_options("medium", false).expect("options");
    let want = format
        .render_prompt(&[Turn::new(TurnRole::User, text)], &popts)
        .expect("render");
    assert_eq!(
        prompt, want,
        "--prompt is not the Harmony render of the text"
    );
    assert_eq!(v["prompt_tokens"], want.len());
    // The text is user content: the special token written in it is not a special token.
    let start = o200k().token_to_id("<|start|>").expect("<|start|>");
    assert_eq!(
        prompt.iter().filter(|&&i| i == start).count(),
        3,
        "{prompt:?}"
    );
    let generated = ids_of(&v["generated_ids"]);
    assert!(!generated.is_empty(), "nothing generated: {v}");
    assert!(v["text"].is_string(), "{v}");

    let joined: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let joined = joined.join(",");
    let mut args = vec!["run", "--prompt-ids", &joined];
    args.extend_from_slice(&common);
    let w = json_of(&stormo_bin(&args, cache.path()), "run --prompt-ids");
    let by_ids = ids_of(&w["generated_ids"]);
    assert_eq!(by_ids.len(), 6, "{w}");
    assert_eq!(
        generated[..],
        by_ids[..generated.len()],
        "--prompt generated other ids than --prompt-ids of its own prompt"
    );
    if v["finish_reason"] == "length" {
        assert_eq!(generated, by_ids);
    } else {
        let stop = format.stop_tokens();
        let last = generated.last().expect("non-empty");
        assert!(
            stop.contains(last),
            "finished early without a stop token: {v}"
        );
    }
}

/// Sampling options apply to `stormo run --prompt-ids` as to a text prompt: the ids sampled
/// from a `--raw` text prompt's ids are the ids a `--prompt-ids` run of those ids samples with
/// the same options and seed (temperature, top-k, top-p, repetition penalty over prompt and
/// output), another seed samples others, and an invalid value is refused before any work.
#[test]
fn run_prompt_ids_samples_as_the_text_prompt_does() {
    let model = crate::http::synth_model();
    let d = model.path().to_str().expect("utf-8 path");
    let cache = tempfile::tempdir().expect("temp dir");
    let sampling = |seed: &'static str| {
        [
            "--model",
            d,
            "--max-new-tokens",
            "8",
            "--no-hot-store",
            "--json",
            "--temperature",
            "1.3",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--repetition-penalty",
            "1.2",
            "--seed",
            seed,
        ]
    };
    let mut args = vec!["run", "--raw", "--prompt", "The sky is"];
    args.extend_from_slice(&sampling("7"));
    let v = json_of(&stormo_bin(&args, cache.path()), "run --raw --prompt");
    let prompt = ids_of(&v["prompt_ids"]);
    let by_text = ids_of(&v["generated_ids"]);
    assert!(!by_text.is_empty(), "{v}");

    let joined: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let joined = joined.join(",");
    let by_ids = |seed| {
        let mut args = vec!["run", "--prompt-ids", &joined];
        args.extend_from_slice(&sampling(seed));
        ids_of(&json_of(&stormo_bin(&args, cache.path()), "run --prompt-ids")["generated_ids"])
    };
    let seven = by_ids("7");
    assert_eq!(seven.len(), 8);
    // The text run stops at the model's end-of-sequence ids; the id run goes on.
    assert_eq!(
        by_text[..],
        seven[..by_text.len()],
        "other ids than the text prompt's"
    );
    assert_eq!(seven, by_ids("7"), "the same seed sampled other ids");
    assert_ne!(seven, by_ids("8"), "another seed sampled the same 8 ids");

    let mut args = vec!["run", "--prompt-ids", &joined];
    args.extend_from_slice(&sampling("7"));
    let pos = args.iter().position(|&a| a == "1.3").expect("temperature");
    args[pos] = "NaN";
    let out = stormo_bin(&args, cache.path());
    let err = String::from_utf8_lossy(&out.stderr);
    // Checked when the arguments are parsed: a usage error (exit 2) that names the flag.
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--temperature") && out.stdout.is_empty(),
        "{err}"
    );
}

/// A temporary folder holding `src`'s config.json and model.safetensors, to be changed.
fn copy_of(src: &std::path::Path) -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("temp dir");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), d.path().join(f)).expect("copy the fixture");
    }
    d
}

/// A config.json that uses fewer layers than the checkpoint holds (the rest silently unused
/// before) draws a warning naming the count and a first unused tensor; the fixture as
/// published draws none.
#[test]
fn run_warns_of_checkpoint_tensors_the_config_does_not_use() {
    let (d, cache) = (
        copy_of(&fixture("qwen3moe-tiny")),
        tempfile::tempdir().expect("temp dir"),
    );
    let run = || {
        let args = [
            "run",
            "--model",
            d.path().to_str().expect("utf-8 path"),
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "1",
            "--no-hot-store",
        ];
        let out = stormo_bin(&args, cache.path());
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let err = run();
    assert!(!err.contains("not used"), "{err}");
    let path = d.path().join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let layers = cfg["num_hidden_layers"]
        .as_u64()
        .expect("num_hidden_layers");
    cfg["num_hidden_layers"] = (layers - 1).into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let err = run();
    let last = format!("\"model.layers.{}.", layers - 1);
    assert!(
        err.contains("not used by its config.json") && err.contains(&last),
        "{err}"
    );
}

/// Weights that make every logit NaN (the final norm's bytes all 0xff): greedy `run` still
/// answers but warns that the tokens mean nothing; sampling refuses with an error naming the
/// cause. The fixture as published draws neither.
#[test]
fn run_says_when_no_logit_is_a_number() {
    let (d, cache) = (
        copy_of(&fixture("gptoss-tiny-mxfp4")),
        tempfile::tempdir().expect("temp dir"),
    );
    let dir = d.path().to_str().expect("utf-8 path");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            dir,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "3",
            "--no-hot-store",
        ];
        args.extend_from_slice(extra);
        let out = stormo_bin(&args, cache.path());
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    const WARNING: &str = "no logit that is a number";
    let (code, err) = run(&[]);
    assert!(code == Some(0) && !err.contains(WARNING), "{err}");
    let norm = {
        let ckpt = stormo_engine::safetensors::Checkpoint::open(d.path()).expect("checkpoint");
        let t = ckpt.info("model.norm.weight").expect("final norm").clone();
        (t.offset as usize, t.len as usize)
    };
    let path = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[norm.0..norm.0 + norm.1].fill(0xff);
    std::fs::write(&path, bytes).unwrap();
    for head in [&[][..], &["--full-head"][..]] {
        let (code, err) = run(head);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(err.matches(WARNING).count(), 1, "{head:?}: {err}");
    }
    let (code, err) = run(&["--temperature", "1"]);
    assert!(code == Some(1) && err.contains("no finite logit"), "{err}");
}

/// A new folder with every file of the model folder `src` linked in but `skip`.
fn linked_except(src: &std::path::Path, skip: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for e in std::fs::read_dir(src).expect("model dir").flatten() {
        if e.file_name() != skip {
            std::os::unix::fs::symlink(e.path(), dir.path().join(e.file_name()))
                .expect("link a model file");
        }
    }
    dir
}

/// `--reasoning-effort none` (and its old spelling `--no-thinking`) on a GPT-OSS model, which
/// always reasons, warns that it runs at `low`; `low` itself does not warn.
#[test]
fn reasoning_effort_none_on_gpt_oss_warns() {
    let model = crate::http::synth_model();
    let d = model.path().to_str().expect("utf-8 path");
    let cache = tempfile::tempdir().expect("temp dir");
    let base = [
        "run",
        "--model",
        d,
        "-p",
        "Hello",
        "-n",
        "1",
        "--no-hot-store",
    ];
    for (extra, warns) in [
        (&["--reasoning-effort", "none"][..], true),
        (&["--no-thinking"][..], true),
        (&["--reasoning-effort", "low"][..], false),
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let out = stormo_bin(&args, cache.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        assert_eq!(
            err.contains("GPT-OSS always reasons"),
            warns,
            "{args:?}: {err}"
        );
    }
}

/// Text prompts without the model folder's tokenizer.json: `stormo run --prompt` and `stormo
/// chat` fail with exit code 1, naming the missing file, without a panic or any output.
#[test]
fn run_prompt_and_chat_without_a_tokenizer_are_clear_errors() {
    let model = crate::http::synth_model();
    let src = model.path();
    // The model without its tokenizer.
    let dir = linked_except(src, "tokenizer.json");
    let d = dir.path().to_str().expect("utf-8 path");
    let missing = dir.path().join("tokenizer.json");
    let missing = missing.to_str().expect("utf-8 path");
    let cache = tempfile::tempdir().expect("temp dir");
    for args in [
        vec!["run", "--model", d, "--prompt", "Hello", "--no-hot-store"],
        vec![
            "run",
            "--model",
            d,
            "--prompt",
            "Hello",
            "--json",
            "--no-hot-store",
        ],
        vec!["chat", "--model", d, "--no-hot-store"],
    ] {
        let out = stormo_bin(&args, cache.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(
            err.contains(missing),
            "{args:?} does not name {missing}: {err}"
        );
        if args.contains(&"--json") {
            // With --json the error is one object on stdout too.
            let v: Value =
                serde_json::from_slice(&out.stdout).expect("--json prints an error object");
            assert_eq!(v["finish_reason"], "error", "{v}");
            assert!(v["error"].as_str().unwrap_or("").contains(missing), "{v}");
        } else {
            assert!(
                out.stdout.is_empty(),
                "{args:?} printed {:?}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    // The same model with the tokenizer runs, so the error above is about the tokenizer.
    std::os::unix::fs::symlink(
        src.join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("link the tokenizer");
    let out = stormo_bin(
        &[
            "run",
            "--model",
            d,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "1",
            "--no-hot-store",
        ],
        cache.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A tokenizer with ids beyond the model's vocabulary, and a chat context too small for the
/// chat format's own tokens, are refused at start (exit code 1, no panic, no output) instead
/// of failing every request or ending a chat that never ran.
#[test]
fn a_foreign_tokenizer_and_a_context_too_small_are_refused_at_start() {
    let model = crate::http::synth_model();
    let src = model.path();
    let d = src.to_str().expect("utf-8 path");
    let cache = tempfile::tempdir().expect("temp dir");
    let refused = |args: &[&str], needle: &str| {
        let out = stormo_bin(args, cache.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(
            err.contains(needle),
            "{args:?} does not say {needle:?}: {err}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed output");
    };
    refused(
        &["chat", "--model", d, "--context", "4", "--no-hot-store"],
        "--context 4",
    );
    // The same folder with a config whose vocabulary ends below the tokenizer's ids.
    let dir = linked_except(src, "config.json");
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("config.json"))
            .expect("config json");
    cfg["vocab_size"] = Value::from(1000);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).expect("write config");
    let small = dir.path().to_str().expect("utf-8 path");
    for args in [
        vec![
            "run",
            "--model",
            small,
            "--prompt",
            "Hello",
            "--no-hot-store",
        ],
        vec!["chat", "--model", small, "--no-hot-store"],
    ] {
        refused(&args, "beyond the model's vocabulary of 1000");
    }
}

/// Runs `stormo chat` with `input` piped to it.
fn chat_piped(args: &[&str], input: &str, cache: &std::path::Path) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(crate::demo::stormo_exe())
        .arg("chat")
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the stormo binary");
    // A chat refused at start may exit before it reads its input: a broken pipe then.
    if let Err(e) = child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
    {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe,
            "write the turns: {e}"
        );
    }
    child.wait_with_output().expect("chat ends")
}

/// Six long turns piped into `chat -c 128`: the conversation no longer fits after the first,
/// so the context shifts (the oldest turns dropped, the system prompt kept, the status line
/// says how many) and every turn is answered, exit 0. With --no-context-shift the chat stops
/// answering once the context is full, as before.
#[test]
fn a_full_chat_context_shifts_and_goes_on_to_the_end() {
    let model = crate::http::synth_model();
    let d = model.path().to_str().expect("utf-8 path");
    let cache = tempfile::tempdir().expect("temp dir");
    let turns: String = (1..=6)
        .map(|i| {
            format!(
                "Turn {i}: please tell me, at some length and in plain words, why the sky \
                 looks blue on a clear day and red at sunset.\n"
            )
        })
        .collect();
    let base = [
        "--model",
        d,
        "-c",
        "128",
        "-n",
        "16",
        "--temperature",
        "0",
        "--system",
        "Be brief.",
        "--no-hot-store",
    ];
    let out = chat_piped(&base, &turns, cache.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("no longer fits"), "{err}");
    let stats: Vec<&str> = err.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(stats.len(), 6, "six replies: {err}");
    let shifts: Vec<&str> = stats
        .iter()
        .copied()
        .filter(|l| l.contains("context full: dropped the"))
        .collect();
    assert!(
        shifts.len() >= 4,
        "the later turns shift the context: {err}"
    );
    for l in &shifts {
        assert!(l.contains("the system prompt kept"), "{l}");
        // The system prompt and the format's preamble are reused from the cache.
        let reused: usize = l
            .split(", ")
            .find_map(|p| p.strip_suffix(" reused from the cache"))
            .and_then(|n| n.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a reuse count in {l}"));
        assert!(reused > 0, "{l}");
    }

    // A reply that fills the context shifts it too, and goes on: after a loaded exchange
    // with a short reply, a reply of up to 200 tokens in 256 positions fills the context,
    // drops the loaded exchange and continues past what its prompt left.
    let saved = cache.path().join("short.json");
    std::fs::write(
        &saved,
        r#"{"format": "stormo-chat", "version": 1, "messages": [
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi!"}]}"#,
    )
    .expect("write a saved chat");
    let long = [
        "--model",
        d,
        "-c",
        "256",
        "-n",
        "200",
        "--temperature",
        "0",
        "--no-hot-store",
    ];
    let input = format!("/load {}\nGo on.\n", saved.display());
    let out = chat_piped(&long, &input, cache.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let stats: Vec<&str> = err.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(stats.len(), 1, "{err}");
    assert!(
        stats[0].starts_with("[context full: dropped the 2 oldest turns"),
        "{err}"
    );
    let prompt_and_reply = |l: &str| -> (usize, usize) {
        let num = |key: &str| -> usize {
            l.split(key)
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{key:?} in {l}"))
        };
        (num("; prompt "), num("; reply "))
    };
    let (prompt, reply) = prompt_and_reply(stats[0]);
    assert!(
        prompt + reply > 257,
        "the reply went on past the context its prompt left: {}",
        stats[0]
    );

    // --no-context-shift: the turns that no longer fit are refused, not added, and the
    // conversation is not shifted.
    let mut no_shift = base.to_vec();
    no_shift.push("--no-context-shift");
    let out = chat_piped(&no_shift, &turns, cache.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let refused = "more than the context of 128 positions holds (--no-context-shift): the \
                   message was not added";
    assert!(err.contains(refused), "{err}");
    assert!(!err.contains("context full: dropped"), "{err}");
    let answered = err.lines().filter(|l| l.starts_with("[prompt")).count();
    assert!(answered < 6, "{err}");
    // Issue: the note said "/reset to start over", yet the message was only dropped: a
    // message too long is refused, and the next one that fits is answered, without /reset.
    let long = format!("{}\nHi.\n", "Why is the sky blue? ".repeat(40));
    let out = chat_piped(&no_shift, &long, cache.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains(refused), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("[prompt")).count(),
        1,
        "the short message is answered: {err}"
    );
}

/// Issue 60 item 8: errors that say what to do. A folder without config.json is "no model
/// at PATH: no config.json", not an OS error; a Hugging Face id that is not a folder says how
/// to download it; llama.cpp's `-ngl 99` gets a hint that stormo runs on CPUs instead of being
/// read as `-n gl`. Each exits 1 or 2 without a panic.
#[test]
fn model_paths_and_gpu_layers_are_errors_that_say_what_to_do() {
    let empty = tempfile::tempdir().expect("temp dir");
    let e = s_of(empty.path());
    let run = |args: &[&str]| {
        let out = Command::new(crate::demo::stormo_exe())
            .args(args)
            .current_dir(empty.path())
            .env("XDG_CACHE_HOME", empty.path())
            .stdin(Stdio::null())
            .output()
            .expect("run the stormo binary");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!out.status.success(), "{args:?}: {err}");
        err
    };
    for cmd in ["run", "chat"] {
        let mut args = vec![cmd, "--model", &e];
        if cmd == "run" {
            args.extend(["--prompt", "Hi"]);
        }
        let err = run(&args);
        assert!(
            err.contains(&format!("no model at {e}: no config.json")),
            "{args:?}: {err}"
        );
        assert!(!err.contains("os error"), "{args:?}: {err}");
        args[2] = "openai/gpt-oss-20b";
        let err = run(&args);
        assert!(
            err.contains("no model at openai/gpt-oss-20b: no such folder")
                && err.contains(
                    "huggingface-cli download openai/gpt-oss-20b --local-dir gpt-oss-20b"
                ),
            "{args:?}: {err}"
        );
    }
    for args in [
        &["run", "-m", "m", "-p", "Hi", "-ngl", "99"][..],
        &["chat", "-m", "m", "-ngl", "99"],
    ] {
        let err = run(args);
        assert!(
            err.contains("-ngl (llama.cpp's GPU layers) is not a stormo option")
                && err.contains("stormo runs on CPUs"),
            "{args:?}: {err}"
        );
    }
}

fn s_of(p: &std::path::Path) -> String {
    p.to_str().expect("utf-8 path").to_string()
}

/// `chat --session FILE`: a chat of two turns in one process equals one turn, the process
/// ended, and a second process resuming with --session for the second turn (the same replies,
/// greedy and sampled with a seed), the second process given no sampling option at all: it
/// samples as the file was saved, and says so; it says what it resumed and its first status
/// line reports the cached positions reused. A file from another model, or a damaged
/// one, is an error at start that names what is wrong, and the file is left as it was.
#[test]
fn a_chat_session_resumes_in_a_new_process_as_if_it_never_stopped() {
    let model = crate::http::synth_model();
    let d = model.path().to_str().expect("utf-8 path");
    let tmp = tempfile::tempdir().expect("temp dir");
    let reused = |l: &str| -> usize {
        l.split(", ")
            .find_map(|p| p.strip_suffix(" reused from the cache"))
            .and_then(|n| n.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a reuse count in {l}"))
    };
    for sampling in [
        &["--temperature", "0"][..],
        &["--temperature", "0.8", "--seed", "3"],
    ] {
        let file = tmp.path().join(format!("chat-{}.kv", sampling.len()));
        let f = file.to_str().expect("utf-8 path");
        let mut base = vec![
            "--model",
            d,
            "-c",
            "512",
            "-n",
            "64",
            "--show-reasoning",
            "show",
            "--no-hot-store",
        ];
        let resume = [&base[..], &["--session", f]].concat();
        base.extend_from_slice(sampling);
        let ok = |out: &std::process::Output| {
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "{err}");
            (String::from_utf8_lossy(&out.stdout).into_owned(), err)
        };
        let (whole, whole_err) = ok(&chat_piped(&base, "Hello there\nAnd again?\n", tmp.path()));
        let with_session = [&base[..], &["--session", f]].concat();
        let (first, err1) = ok(&chat_piped(&with_session, "Hello there\n", tmp.path()));
        assert!(err1.contains("(new session: saved to"), "{err1}");
        assert!(file.exists(), "{err1}");
        let (second, err2) = ok(&chat_piped(&resume, "And again?\n", tmp.path()));
        assert!(err2.contains("(resumed"), "{err2}");
        assert!(err2.contains("sampling as saved: temperature"), "{err2}");
        // (A random-weight model's replies show as text once past Harmony's header.)
        assert!(
            !first.trim().is_empty() && !second.trim().is_empty(),
            "both replies have text: {first:?} {second:?}"
        );
        assert_eq!(
            first + &second,
            whole,
            "{sampling:?}: {whole_err}\n{err1}\n{err2}"
        );
        let stats = |e: &str| -> Vec<String> {
            e.lines()
                .filter(|l| l.starts_with("[prompt"))
                .map(str::to_string)
                .collect()
        };
        let (whole_stats, resumed_stats) = (stats(&whole_err), stats(&err2));
        assert_eq!(resumed_stats.len(), 1, "{err2}");
        assert!(reused(&resumed_stats[0]) > 0, "{err2}");
        assert_eq!(
            reused(&resumed_stats[0]),
            reused(&whole_stats[1]),
            "the resumed turn reuses what the uninterrupted one did: {whole_err}\n{err2}"
        );
    }

    // Damaged or foreign files: clear errors at start, the file untouched.
    let file = tmp.path().join("chat-2.kv");
    let f = file.to_str().expect("utf-8 path");
    let good = std::fs::read(&file).expect("the session file");
    let with_context = |c: &'static str| ["--model", d, "-c", c, "--no-hot-store", "--session", f];
    let base = with_context("512");
    let refused = |args: &[&str], want: &str| {
        let out = chat_piped(args, "Hello\n", tmp.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains("cannot resume the chat from"), "{err}");
        assert!(err.contains(want), "{args:?}: wanted {want:?} in {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    std::fs::write(&file, &good[..good.len() / 2]).expect("truncate");
    refused(&base, "the file is truncated");
    let mut flipped = good.clone();
    flipped[20] ^= 1;
    std::fs::write(&file, &flipped).expect("corrupt");
    refused(&base, "the header is corrupt");
    std::fs::write(&file, &good).expect("restore");
    refused(
        &with_context("256"),
        "saved with a context of 512 positions",
    );
    // The same shape, other weights.
    let other = tempfile::tempdir().expect("temp dir");
    let o = other.path().to_str().expect("utf-8 path");
    let mut args = vec!["--layers", "2", "--top-k", "2", "--seed", "6", "--out", o];
    args.extend_from_slice(crate::demo::SMALL_SHAPE);
    crate::demo::synth(&args).expect("stormo synth writes the model");
    std::fs::copy(
        fixture("o200k-harmony").join("tokenizer.json"),
        other.path().join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    refused(
        &["--model", o, "-c", "512", "--no-hot-store", "--session", f],
        "saved with another model",
    );
    assert_eq!(std::fs::read(&file).expect("the file"), good);
}
