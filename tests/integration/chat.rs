//! Tokenizer, Harmony and ChatML against the o200k_harmony fixture and Python oracles.
//!
//! The oracle tests run the Python `tiktoken` and `tokenizers` packages (installed by
//! `.ci/run` with pip). Locally, without them, those tests print why and pass; under CI
//! (`CI` set) a missing package is a failure.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};

use serde_json::Value;
use stormo_engine::Family;
use stormo_tests::fixture;
use stormo_text::chatml::{self, ChatMl};
use stormo_text::harmony::{
    self, Content, DeveloperContent, Harmony, Message, ReasoningEffort, RenderOptions, Role,
    StreamEvent, SystemContent,
};
use stormo_text::{
    ChatFormat, OutputDelta, PromptOptions, StreamDecoder, Tokenizer, Turn, TurnRole,
};

fn o200k_dir() -> PathBuf {
    fixture("o200k-harmony")
}

fn o200k() -> &'static Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        Arc::new(Tokenizer::from_model_dir(&o200k_dir()).expect("fixture tokenizer.json loads"))
    })
}

fn reference() -> &'static Value {
    static REF: OnceLock<Value> = OnceLock::new();
    REF.get_or_init(|| {
        let path = o200k_dir().join("reference.json");
        let text = std::fs::read_to_string(&path).expect("reference.json is readable");
        serde_json::from_str(&text).expect("reference.json is JSON")
    })
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// Decodes ids one at a time through the streaming decoder; returns the text and how many
/// pushes emitted nothing (bytes of an unfinished character held back).
fn stream_decode(tok: &Tokenizer, ids: &[u32]) -> (String, usize) {
    let mut d = StreamDecoder::new(false);
    let mut out = String::new();
    let mut held = 0;
    for &id in ids {
        let piece = d.push(tok, id).expect("known id");
        if piece.is_empty() {
            held += 1;
        }
        out.push_str(piece);
    }
    out.push_str(&d.finish());
    (out, held)
}

#[test]
fn o200k_encodes_the_reference_texts() {
    let tok = o200k();
    let cases = reference()["tokenizations"]
        .as_array()
        .expect("tokenizations");
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = ids_of(&case["ids"]);
        let got = tok.encode(text, true).expect("encode");
        assert_eq!(got, want, "text {text:?}");
        assert_eq!(tok.decode(&got, false).expect("decode"), text);
        assert_eq!(stream_decode(tok, &got).0, text);
    }
}

#[test]
fn o200k_special_tokens_come_from_the_file() {
    let tok = o200k();
    for (name, id) in reference()["special_tokens"].as_object().expect("map") {
        assert_eq!(
            tok.token_to_id(name),
            Some(id.as_u64().expect("id") as u32),
            "{name}"
        );
        assert!(tok.is_special(id.as_u64().expect("id") as u32));
    }
    assert_eq!(tok.vocab_size(), 201_088);
    // Without special recognition a marker is ordinary text, never a special id.
    let plain = tok.encode("<|start|>user", false).expect("encode");
    assert!(plain.iter().all(|&id| !tok.is_special(id)), "{plain:?}");
    assert_eq!(tok.decode(&plain, false).expect("decode"), "<|start|>user");
}

#[test]
fn o200k_stream_decoder_holds_split_characters() {
    let tok = o200k();
    // The emoji reference case splits characters across ids.
    let text = "emoji 🐦🌳🔥 and ZWJ 👩‍👩‍👧‍👦 sequences";
    let ids = tok.encode(text, false).expect("encode");
    let (out, held) = stream_decode(tok, &ids);
    assert_eq!(out, text);
    assert!(held > 0, "no id ended inside a character");
    // Cut inside a character: the stream ends with U+FFFD, as a lossy decode does.
    let cut = ids
        .iter()
        .position(|&id| std::str::from_utf8(tok.token_bytes(id).expect("known")).is_err())
        .expect("some id holds part of a character");
    let partial = &ids[..=cut];
    let lossy = tok.decode(partial, false).expect("decode");
    assert_eq!(stream_decode(tok, partial).0, lossy);
}

#[test]
fn decode_rejects_unknown_ids() {
    let err = o200k()
        .decode(&[1, 999_999], false)
        .expect_err("unknown id");
    assert!(err.to_string().contains("999999"), "{err}");
}

// ---- Harmony ----

fn harmony() -> Harmony {
    Harmony::new(o200k().clone()).expect("o200k has the Harmony tokens")
}

fn role_of(s: &str) -> Role {
    Role::parse(s).unwrap_or_else(|| panic!("unknown role {s}"))
}

/// A message from the openai-harmony JSON shape in reference.json.
fn message_from_json(m: &Value) -> Message {
    let role = role_of(m["role"].as_str().expect("role"));
    let content = m["content"]
        .as_array()
        .expect("content")
        .iter()
        .map(|c| match c["type"].as_str().expect("type") {
            "text" => Content::Text(c["text"].as_str().expect("text").into()),
            "system_content" => {
                let ch = &c["channel_config"];
                Content::System(SystemContent {
                    model_identity: c["model_identity"].as_str().map(Into::into),
                    reasoning_effort: c["reasoning_effort"]
                        .as_str()
                        .map(|e| ReasoningEffort::parse(e).expect("effort")),
                    knowledge_cutoff: c["knowledge_cutoff"].as_str().map(Into::into),
                    conversation_start_date: c["conversation_start_date"].as_str().map(Into::into),
                    valid_channels: ch["valid_channels"]
                        .as_array()
                        .map(|v| v.iter().map(|x| x.as_str().expect("ch").into()).collect())
                        .unwrap_or_default(),
                    channel_required: ch["channel_required"].as_bool().unwrap_or(false),
                })
            }
            "developer_content" => Content::Developer(DeveloperContent {
                instructions: c["instructions"].as_str().map(Into::into),
            }),
            other => panic!("content type {other}"),
        })
        .collect();
    Message {
        role,
        name: m["name"].as_str().map(Into::into),
        recipient: m["recipient"].as_str().map(Into::into),
        channel: m["channel"].as_str().map(Into::into),
        content_type: m["content_type"].as_str().map(Into::into),
        content,
    }
}

#[test]
fn harmony_renders_the_reference_ids() {
    let h = harmony();
    let renders = reference()["harmony_renders"].as_array().expect("renders");
    assert_eq!(renders.len(), 3);
    for r in renders {
        let name = r["name"].as_str().expect("name");
        let messages: Vec<Message> = r["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(message_from_json)
            .collect();
        let got = h
            .render_for_completion(&messages, Role::Assistant, &RenderOptions::default())
            .expect("render");
        assert_eq!(got, ids_of(&r["ids"]), "render {name}");
        let text = o200k().decode(&got, false).expect("decode");
        assert_eq!(text, r["text"].as_str().expect("text"), "text of {name}");
    }
}

#[test]
fn harmony_render_built_by_hand_matches_the_spec_example() {
    // SPEC §6: harmony's SystemContent::new() and one user message, 64 tokens.
    let h = harmony();
    let ids = h
        .render_for_completion(
            &[
                Message::system(SystemContent::default()),
                Message::user("What is 2 + 2?"),
            ],
            Role::Assistant,
            &RenderOptions::default(),
        )
        .expect("render");
    assert_eq!(ids, ids_of(&reference()["harmony_renders"][0]["ids"]));
    assert_eq!(ids.len(), 64);
}

#[test]
fn harmony_parses_the_reference_completion() {
    let h = harmony();
    let p = &reference()["harmony_parse"];
    let ids = ids_of(&p["completion_ids"]);
    let got = h
        .parse_completion(&ids, Some(Role::Assistant))
        .expect("parse");
    let want: Vec<Message> = p["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(message_from_json)
        .collect();
    assert_eq!(got, want);
    assert_eq!(got[0].channel.as_deref(), Some("analysis"));
    assert_eq!(got[1].text_content(), "2 + 2 = 4.");

    // Streaming: the same messages, deltas adding up to each content.
    let mut parser = h.parser(Some(Role::Assistant));
    let mut deltas = String::new();
    let mut done = Vec::new();
    for &id in &ids {
        match parser.push(id).expect("push") {
            Some(StreamEvent::Delta(d)) => deltas.push_str(d),
            Some(StreamEvent::MessageDone(m)) => {
                assert_eq!(m.text_content(), deltas);
                deltas.clear();
                done.push(m.clone());
            }
            Some(StreamEvent::MessageStart(m)) => assert!(m.content.is_empty()),
            None => {}
        }
    }
    parser.finish().expect("finish");
    assert_eq!(done, want);
    // The last id is <|return|>: it ends the turn.
    assert_eq!(
        h.token_role(*ids.last().expect("ids")),
        harmony::TokenRole::Return
    );
}

#[test]
fn harmony_stop_sets_and_history() {
    let h = harmony();
    let r = reference();
    let mut stops = h.stop_tokens().to_vec();
    stops.sort();
    assert_eq!(stops, ids_of(&r["stop_tokens"]));
    let mut actions = h.stop_tokens_for_assistant_actions().to_vec();
    actions.sort();
    assert_eq!(actions, ids_of(&r["stop_tokens_for_assistant_actions"]));

    // A generated turn goes into history with <|return|> as <|end|>, and then equals the
    // render of the parsed messages (the analysis message is dropped once a final follows).
    let p = &r["harmony_parse"];
    let mut generated = ids_of(&p["completion_ids"]);
    h.to_history(&mut generated);
    let end = o200k().token_to_id("<|end|>").expect("end");
    assert_eq!(*generated.last().expect("ids"), end);
    let parsed = h
        .parse_completion(&ids_of(&p["completion_ids"]), Some(Role::Assistant))
        .expect("parse");
    let mut convo = vec![
        Message::system(SystemContent::default()),
        Message::user("What is 2 + 2?"),
    ];
    let prompt = h
        .render_for_completion(&convo, Role::Assistant, &RenderOptions::default())
        .expect("render");
    convo.extend(parsed);
    let keep_all = RenderOptions {
        drop_old_analysis: false,
    };
    let full = h.render_conversation(&convo, &keep_all).expect("render");
    // prompt ends with "<|start|>assistant"; the generated ids continue it exactly.
    let mut expect = prompt.clone();
    expect.extend(&generated);
    assert_eq!(full, expect);
    let dropped = h
        .render_conversation(&convo, &RenderOptions::default())
        .expect("render");
    assert!(dropped.len() < full.len());
    let text = o200k().decode(&dropped, false).expect("decode");
    assert!(!text.contains("<|channel|>analysis"), "{text}");
    assert!(text.contains("<|channel|>final"), "{text}");
}

#[test]
fn harmony_parse_errors_are_errors() {
    let h = harmony();
    let tok = o200k();
    let start = tok.token_to_id("<|start|>").expect("start");
    // Without a role, ids must open with <|start|>.
    assert!(h.parse_completion(&[1428], None).is_err());
    // Ending inside a header.
    assert!(h.parse_completion(&[start, 1428], None).is_err());
    // An unknown id in content.
    let msg = tok.token_to_id("<|message|>").expect("message");
    assert!(h
        .parse_completion(&[msg, 4_000_000], Some(Role::Assistant))
        .is_err());
    // A tool call header parses recipient and content type.
    let ids = h
        .render_conversation(
            &[Message {
                recipient: Some("functions.get_weather".into()),
                content_type: Some("<|constrain|>json".into()),
                ..Message::assistant("commentary", "{\"city\":\"Rome\"}")
            }],
            &RenderOptions::default(),
        )
        .expect("render");
    let call = tok.token_to_id("<|call|>").expect("call");
    assert_eq!(*ids.last().expect("ids"), call);
    let parsed = h.parse_completion(&ids, None).expect("parse");
    assert_eq!(parsed.len(), 1);
    assert_eq!(
        parsed[0].recipient.as_deref(),
        Some("functions.get_weather")
    );
    assert_eq!(parsed[0].content_type.as_deref(), Some("<|constrain|>json"));
    assert_eq!(parsed[0].channel.as_deref(), Some("commentary"));
    assert_eq!(parsed[0].text_content(), "{\"city\":\"Rome\"}");
}

// ---- Python oracles ----

/// Runs `script` with `input` on stdin and parses its stdout as JSON. When the Python packages
/// are absent: a failure, or `None` (with a note on stderr) where the opt-out variable
/// [`stormo_tests::SKIP_PYTHON`] is set to 1.
fn python_oracle(packages: &[&str], script: &str, input: &Value) -> Option<Value> {
    let imports = packages.join(", ");
    let have = Command::new("python3")
        .args(["-c", &format!("import {imports}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        let msg = format!(
            "python3 with `{imports}` is not available (pip install {}): oracle comparison skipped",
            packages.join(" ")
        );
        if !stormo_tests::python_opted_out() {
            panic!(
                "{msg}; set {}=1 to skip the Python oracles",
                stormo_tests::SKIP_PYTHON
            );
        }
        eprintln!("SKIPPED ({}=1): {msg}", stormo_tests::SKIP_PYTHON);
        return None;
    }
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 starts");
    let body = serde_json::to_vec(input).expect("json");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(&body)
        .expect("write to python");
    let out = child.wait_with_output().expect("python3 runs");
    assert!(
        out.status.success(),
        "oracle script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("oracle prints JSON"))
}

/// A small deterministic generator for test texts (SplitMix64).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Texts beyond the fixture's: long, mixed scripts, emoji, code, whitespace runs, and random
/// strings over a palette of tricky characters.
fn oracle_texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
        "    indented\n\tтабуляция\r\n\r\n  \n   trailing   \n",
        "naïve café — e\u{301}te\u{301} (combining) vs été; Å Å; ﬁ ligature; ２０２４年",
        "日本語の文章です。中文句子。한국어 문장입니다. हिन्दी वाक्य। ภาษาไทย. עברית. ελληνικά.",
        "👍🏽 👨‍👩‍👧 🏳️‍🌈 🇮🇹🇯🇵 ❤️‍🔥 1️⃣ 🫠",
        "fn main() {\n    let x: Vec<u8> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "def f(a, b):\n\treturn a ** b  # ok\n\n\nclass A:\n    pass\n",
        "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
        "don't can't WON'T it’s they’re I'M We'LL y'all 's 't",
        "1234567890 12 345 6789 3.14159e-10 0xDEADBEEF 1,000,000.00",
        "\u{a0}\u{a0}nbsp\u{3000}ideographic\u{2003}em\u{200b}zwsp\u{feff}bom",
        "a\n\n\nb\r\r\rc\n \n \nd",
        "<|endoftext|> <|start|> <|reserved_200100|> <|not_a_token|> <| |>",
        "",
        " ",
        "\n",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    texts.push("a".repeat(20_000));
    texts.push(" ".repeat(3_000) + "x" + &"\n".repeat(500));
    texts.push("ab".repeat(5_000));
    texts.push("🔥".repeat(2_000));
    let palette: Vec<char> = concat!(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        "     \t\n\r.,;:!?'\"`-_=+*/\\()[]{}<>|@#$%^&~",
        "éèüßçñøåÆŒ\u{301}\u{308}ΩΣДЖя日本語中文한국ひらカナ١٢٣ابت",
        "€£¥©®™…—–“”‘’«»\u{a0}\u{2028}\u{3000}\u{200d}🔥🐦🌳👩🏽😀✨",
    )
    .chars()
    .collect();
    let mut g = Gen(20_240_601);
    for _ in 0..400 {
        let len = g.below(120);
        texts.push((0..len).map(|_| palette[g.below(palette.len())]).collect());
    }
    // One long mixed document.
    let mut long = String::new();
    while long.len() < 60_000 {
        long.push_str(&texts[g.below(16)]);
        long.push_str(&texts[20 + g.below(400)]);
    }
    texts.push(long);
    texts
}

const TIKTOKEN_SCRIPT: &str = r#"
import json, sys, tiktoken
req = json.load(sys.stdin)
tj = json.load(open(req["path"], encoding="utf-8"))
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
dec = {chr(c): b for b, c in zip(bs, cs)}
ranks = {bytes(dec[ch] for ch in tok): i for tok, i in tj["model"]["vocab"].items()}
pat = tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
special = {t["content"]: t["id"] for t in tj["added_tokens"]}
enc = tiktoken.Encoding("o200k_harmony_from_file", pat_str=pat, mergeable_ranks=ranks, special_tokens=special)
print(json.dumps([enc.encode(t, allowed_special="all") for t in req["texts"]]))
"#;

#[test]
fn o200k_matches_tiktoken_on_many_texts() {
    let texts = oracle_texts();
    let input = serde_json::json!({
        "path": o200k_dir().join("tokenizer.json"),
        "texts": texts,
    });
    let Some(want) = python_oracle(&["tiktoken"], TIKTOKEN_SCRIPT, &input) else {
        return;
    };
    let want = want.as_array().expect("list");
    let tok = o200k();
    for (text, want) in texts.iter().zip(want) {
        let got = tok.encode(text, true).expect("encode");
        let short: String = text.chars().take(80).collect();
        assert_eq!(got, ids_of(want), "text {short:?} ({} bytes)", text.len());
        assert_eq!(&tok.decode(&got, false).expect("decode"), text);
        assert_eq!(&stream_decode(tok, &got).0, text);
    }
}

// ---- A Qwen-style tokenizer.json, synthetic ----

const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's byte-to-character table (byte-level spelling).
fn byte_chars() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut n = 0;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        out[b as usize] = char::from_u32(c).expect("char");
    }
    out
}

/// A Qwen2/Qwen3-format tokenizer.json: byte-level BPE whose merges are learned here by a
/// few hundred rounds of pair counting on a small multilingual corpus, NFC normalizer, the
/// Qwen2 Split regex, ByteLevel, and Qwen's added tokens (special and not).
fn synthetic_qwen_json() -> Value {
    let bc = byte_chars();
    let corpus = concat!(
        "the cat sat on the mat. the dog ate the hat! There, then, these others. ",
        "Il gatto è sulla sedia; perché no? Ça va très bien, merci. ",
        "我们今天学习中文。我们明天也学习。日本語を勉強します。 ",
        "def main():\n    return 42\n\n    print('hello world')\n",
        "🔥🔥 fire 🔥 emoji 🌳🌳 tree 1234 5678 don't won't it's",
    );
    // Words as lists of byte-level strings, split crudely at spaces (a space opens a word).
    let mut words: Vec<Vec<String>> = Vec::new();
    for (i, w) in corpus.split(' ').enumerate() {
        let w = if i == 0 {
            w.to_string()
        } else {
            format!(" {w}")
        };
        words.push(w.bytes().map(|b| bc[b as usize].to_string()).collect());
    }
    let mut vocab: Vec<String> = bc.iter().map(|c| c.to_string()).collect();
    let mut merges: Vec<(String, String)> = Vec::new();
    for _ in 0..300 {
        let mut counts: std::collections::BTreeMap<(String, String), usize> = Default::default();
        for w in &words {
            for p in w.windows(2) {
                *counts.entry((p[0].clone(), p[1].clone())).or_default() += 1;
            }
        }
        let Some((pair, _)) = counts
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(p, c)| (p.clone(), *c))
        else {
            break;
        };
        let joined = format!("{}{}", pair.0, pair.1);
        if !vocab.contains(&joined) {
            vocab.push(joined.clone());
        }
        for w in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == pair.0 && w[i + 1] == pair.1 {
                    w[i] = joined.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        merges.push(pair);
    }
    let n = vocab.len();
    let vocab_map: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), Value::from(i)))
        .collect();
    let added = |id: usize, content: &str, special: bool| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special})
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            added(n, "<|endoftext|>", true),
            added(n + 1, "<|im_start|>", true),
            added(n + 2, "<|im_end|>", true),
            added(n + 3, "<think>", false),
            added(n + 4, "</think>", false),
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab_map,
            "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>(),
        }
    })
}

fn qwen() -> (Arc<Tokenizer>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = synthetic_qwen_json();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        serde_json::to_vec(&json).expect("json"),
    )
    .expect("write tokenizer.json");
    let tok = Tokenizer::from_model_dir(dir.path()).expect("synthetic Qwen tokenizer loads");
    (Arc::new(tok), dir)
}

#[test]
fn qwen_style_mechanics() {
    let (tok, _dir) = qwen();
    // Merges apply: a frequent corpus word is fewer tokens than bytes.
    let the = tok.encode(" the", false).expect("encode");
    assert!(the.len() < 4, "{the:?}");
    // NFC: a decomposed "é" encodes like the composed one.
    assert_eq!(
        tok.encode("e\u{301}te\u{301}", false).expect("encode"),
        tok.encode("été", false).expect("encode")
    );
    // Special added tokens only with allow_special; non-special ones always.
    let im_start = tok.token_to_id("<|im_start|>").expect("im_start");
    let think = tok.token_to_id("<think>").expect("think");
    assert_eq!(
        tok.encode("<|im_start|>", true).expect("encode"),
        vec![im_start]
    );
    assert!(!tok
        .encode("<|im_start|>", false)
        .expect("encode")
        .contains(&im_start));
    assert_eq!(tok.encode("<think>", false).expect("encode"), vec![think]);
    // The ordinary encoding leaves even <think> as text.
    assert!(!tok
        .encode_ordinary("<think>")
        .expect("encode")
        .contains(&think));
    // Round trips (NFC-stable text).
    for t in ["the cat 🔥 我们 don't\n\n  x", "def f():\n\treturn 1\n"] {
        let ids = tok.encode(t, false).expect("encode");
        assert_eq!(tok.decode(&ids, false).expect("decode"), t);
    }
}

const HF_SCRIPT: &str = r#"
import json, sys
from tokenizers import Tokenizer
req = json.load(sys.stdin)
tok = Tokenizer.from_file(req["path"])
print(json.dumps([tok.encode(t, add_special_tokens=False).ids for t in req["texts"]]))
"#;

#[test]
fn qwen_style_matches_hf_tokenizers() {
    let (tok, dir) = qwen();
    let mut texts = oracle_texts();
    texts.push("<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\nok".into());
    let input = serde_json::json!({
        "path": dir.path().join("tokenizer.json"),
        "texts": texts,
    });
    let Some(want) = python_oracle(&["tokenizers"], HF_SCRIPT, &input) else {
        return;
    };
    for (text, want) in texts.iter().zip(want.as_array().expect("list")) {
        let got = tok.encode(text, true).expect("encode");
        let short: String = text.chars().take(80).collect();
        assert_eq!(got, ids_of(want), "text {short:?} ({} bytes)", text.len());
    }
}

#[test]
fn chatml_renders_the_qwen3_template() {
    let (tok, _dir) = qwen();
    let c = ChatMl::new(tok.clone()).expect("ChatML tokens");
    use chatml::{Message as M, Role as R};
    let convo = [
        M::new(R::System, "You are helpful."),
        M::new(R::User, "Hi"),
        M::new(R::Assistant, "<think>\nold thoughts\n</think>\n\nHello!"),
        M::new(R::User, "2+2?"),
    ];
    let ids = c.render(&convo, true, true).expect("render");
    // The template's text; earlier reasoning is dropped before the last query.
    let text = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
                <|im_start|>assistant\n";
    assert_eq!(ids, tok.encode(text, true).expect("encode"));
    assert_eq!(tok.decode(&ids, false).expect("decode"), text);

    // Thinking off: an empty think block opens the answer.
    let ids = c.render(&convo[1..2], true, false).expect("render");
    assert_eq!(
        tok.decode(&ids, false).expect("decode"),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );

    // Reasoning after the last query is kept; tool results go into one user turn.
    let convo = [
        M::new(R::User, "weather?"),
        M {
            reasoning: Some("need a tool".into()),
            ..M::new(R::Assistant, "calling")
        },
        M::new(R::Tool, "sunny"),
        M::new(R::Tool, "22C"),
    ];
    let ids = c.render(&convo, false, true).expect("render");
    assert_eq!(
        tok.decode(&ids, false).expect("decode"),
        "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<think>\nneed a tool\n\
         </think>\n\ncalling<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n\
         </tool_response>\n<tool_response>\n22C\n</tool_response><|im_end|>\n"
    );

    // A user typing a special marker cannot close the turn.
    let ids = c
        .render(&[M::new(R::User, "x<|im_end|>y")], false, true)
        .expect("render");
    let im_end = tok.token_to_id("<|im_end|>").expect("im_end");
    assert_eq!(ids.iter().filter(|&&i| i == im_end).count(), 1);
    let mut stops = c.stop_tokens();
    stops.sort();
    let eot = tok.token_to_id("<|endoftext|>").expect("eot");
    assert_eq!(stops, {
        let mut v = vec![im_end, eot];
        v.sort();
        v
    });
}

#[test]
fn chat_formats_refuse_the_wrong_vocabulary() {
    let (tok, _dir) = qwen();
    assert!(Harmony::new(tok).is_err());
    assert!(ChatMl::new(o200k().clone()).is_err());
}

#[test]
fn bad_tokenizer_files_are_clear_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let err = Tokenizer::from_model_dir(dir.path()).expect_err("missing");
    let msg = format!("{err}");
    assert!(msg.contains("tokenizer.json"), "{msg}");
    std::fs::write(dir.path().join("tokenizer.json"), b"{\"model\": 3}").expect("write");
    assert!(Tokenizer::from_model_dir(dir.path()).is_err());
    let mut json = synthetic_qwen_json();
    json["model"]["merges"]
        .as_array_mut()
        .expect("merges")
        .push("zzz qqq".into());
    let bytes = serde_json::to_vec(&json).expect("json");
    let err = Tokenizer::from_json(&bytes).expect_err("unknown merge part");
    assert!(format!("{err}").contains("zzz"), "{err}");
    let mut json = synthetic_qwen_json();
    json["normalizer"] = serde_json::json!({"type": "Lowercase"});
    let err = Tokenizer::from_json(&serde_json::to_vec(&json).expect("json")).expect_err("norm");
    assert!(format!("{err}").contains("Lowercase"), "{err}");
}

// ---- ChatFormat: one API over both formats ----

#[test]
fn chat_format_harmony_renders_and_streams() {
    let f = ChatFormat::for_family(Family::GptOss, o200k().clone()).expect("Harmony vocab");
    // The reference multi-turn render, from OpenAI-style turns.
    let turns = [
        Turn::new(TurnRole::User, "Hi!"),
        Turn::new(TurnRole::Assistant, "Hello! How can I help?"),
        Turn::new(TurnRole::User, "Tell me a joke about woodpeckers."),
    ];
    let ids = f
        .render_prompt(&turns, &PromptOptions::default())
        .expect("render");
    assert_eq!(ids, ids_of(&reference()["harmony_renders"][2]["ids"]));
    // A system turn becomes developer instructions (the reference's second render).
    let turns = [
        Turn::new(TurnRole::System, "Answer in Italian."),
        Turn::new(
            TurnRole::User,
            "Come si chiama un uccello che tamburella sugli alberi?",
        ),
    ];
    let opts = PromptOptions {
        reasoning_effort: ReasoningEffort::Low,
        ..Default::default()
    };
    let ids = f.render_prompt(&turns, &opts).expect("render");
    assert_eq!(ids, ids_of(&reference()["harmony_renders"][1]["ids"]));

    let completion = ids_of(&reference()["harmony_parse"]["completion_ids"]);
    let mut p = f.output_parser();
    let (mut reasoning, mut content) = (String::new(), String::new());
    for &id in &completion {
        match p.push(id).expect("push") {
            Some(OutputDelta::Reasoning(r)) => reasoning.push_str(&r),
            Some(OutputDelta::Content(c)) => content.push_str(&c),
            None => {}
        }
    }
    assert_eq!(reasoning, "Simple arithmetic.");
    assert_eq!(content, "2 + 2 = 4.");
    assert!(f.stop_tokens().contains(completion.last().expect("ids")));
}

#[test]
fn chat_format_chatml_renders_and_streams() {
    let (tok, _dir) = qwen();
    let f = ChatFormat::for_family(Family::Qwen3Moe, tok.clone()).expect("ChatML vocab");
    let ids = f
        .render_prompt(
            &[
                Turn::new(TurnRole::Developer, "Be brief."),
                Turn::new(TurnRole::User, "Hi"),
            ],
            &PromptOptions::default(),
        )
        .expect("render");
    assert_eq!(
        tok.decode(&ids, false).expect("decode"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let generated = tok
        .encode(
            "<think>\nthe user greets\n</think>\n\nHello 🔥!<|im_end|>",
            true,
        )
        .expect("encode");
    let mut p = f.output_parser();
    let (mut reasoning, mut content) = (String::new(), String::new());
    for &id in &generated {
        match p.push(id).expect("push") {
            Some(OutputDelta::Reasoning(r)) => reasoning.push_str(&r),
            Some(OutputDelta::Content(c)) => content.push_str(&c),
            None => {}
        }
    }
    assert_eq!(reasoning, "\nthe user greets\n");
    assert_eq!(content, "\n\nHello 🔥!");
    assert!(f.stop_tokens().contains(generated.last().expect("ids")));
}

// ---- Sessions: longest-common-prefix KV reuse ----

mod sessions {
    use std::ops::ControlFlow;
    use std::sync::Arc;

    use stormo_engine::sampling::SamplingParams;
    use stormo_engine::{LoadOptions, Model};
    use stormo_tests::fixture;
    use stormo_text::session::{ChatSession, FinishReason, GenerateOptions, SessionError};

    use super::Gen;

    fn load(name: &str) -> Arc<Model> {
        load_with(name, false)
    }

    fn load_with(name: &str, screened_head: bool) -> Arc<Model> {
        let opts = LoadOptions {
            prefill_block: 16,
            screened_head,
            ..LoadOptions::default()
        };
        Arc::new(Model::load(&fixture(name), &opts).expect("fixture model loads"))
    }

    fn ids(g: &mut Gen, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| g.below(vocab) as u32).collect()
    }

    fn lcp(a: &[u32], b: &[u32]) -> usize {
        let mut n = 0;
        while n < a.len() && n < b.len() && a[n] == b[n] {
            n += 1;
        }
        n
    }

    fn opts(max_new: usize, sampling: SamplingParams) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: max_new,
            stop: Vec::new(),
            sampling,
        }
    }

    /// The tokens a fresh session computes for the whole prompt (no reuse possible).
    fn full_recompute(model: &Arc<Model>, prompt: &[u32], o: &GenerateOptions) -> Vec<u32> {
        let mut s = ChatSession::new(model.clone(), 512).expect("session");
        let g = s
            .generate(prompt, o, |_| ControlFlow::Continue(()))
            .expect("generate");
        assert_eq!(g.reused, 0, "a fresh session has nothing to reuse");
        g.ids
    }

    /// Several turns through one session give the tokens of a full recompute each time, and
    /// reuse exactly the common prefix of the new prompt and the ids already in the cache
    /// (prompt and generated ids, all but the last generated one, which is never run).
    /// With `screened`, the session's model finds greedy tokens through its screened head
    /// (the sampled turns use the whole head) and the full recomputes run without one.
    fn turns_match_full_recompute(name: &str, screened: bool) {
        let model = load_with(name, screened);
        let plain = load(name);
        let vocab = model.config().vocab_size;
        let mut g = Gen(0x5e55_1011);
        let mut sess = ChatSession::new(model.clone(), 512).expect("session");
        let sampled = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 7,
            ..SamplingParams::default()
        };
        let p1 = ids(&mut g, 24, vocab);
        let mut expected_cache: Vec<u32> = Vec::new();
        let mut prompts = vec![p1.clone()];
        let mut last_prompt = p1;
        let mut streamed = Vec::new();
        for turn in 0..5 {
            let prompt = prompts[turn].clone();
            let o = opts(
                6,
                if turn % 2 == 0 {
                    SamplingParams::default()
                } else {
                    sampled
                },
            );
            streamed.clear();
            let got = sess
                .generate(&prompt, &o, |id| {
                    streamed.push(id);
                    ControlFlow::Continue(())
                })
                .expect("turn runs");
            let want_reused = lcp(&expected_cache, &prompt).min(prompt.len() - 1);
            assert_eq!(
                got.reused, want_reused,
                "{name} turn {turn}: positions reused"
            );
            assert_eq!(got.prompt_tokens, prompt.len());
            assert_eq!(got.finish, FinishReason::Length);
            assert_eq!(got.ids, streamed, "the callback sees every generated id");
            let reference = full_recompute(&plain, &prompt, &o);
            assert_eq!(
                got.ids, reference,
                "{name} turn {turn}: tokens differ from a full recompute"
            );
            expected_cache = prompt.clone();
            expected_cache.extend_from_slice(&got.ids[..got.ids.len() - 1]);
            assert_eq!(
                sess.cached(),
                &expected_cache[..],
                "{name} turn {turn}: cached ids"
            );
            // The next turn's prompt.
            let next = match turn {
                // A prefix extension: the reply and a new user turn appended.
                0 | 3 => [&prompt[..], &got.ids[..], &ids(&mut g, 5, vocab)[..]].concat(),
                // Not a prefix extension: the reply re-rendered differently (its last id
                // replaced, as Harmony turns `<|return|>` into `<|end|>`), then new ids.
                1 => {
                    let mut reply = got.ids.clone();
                    *reply.last_mut().expect("a reply") ^= 1;
                    [&prompt[..], &reply[..], &ids(&mut g, 4, vocab)[..]].concat()
                }
                // Diverges early: an earlier turn edited.
                2 => {
                    let mut p = last_prompt.clone();
                    p.truncate(10);
                    [&p[..], &ids(&mut g, 7, vocab)[..]].concat()
                }
                _ => prompt.clone(),
            };
            last_prompt = prompt;
            prompts.push(next);
        }
        // The same prompt again reuses all but its last position.
        let again = prompts[4].clone();
        let got = sess
            .generate(&again, &opts(3, SamplingParams::default()), |_| {
                ControlFlow::Continue(())
            })
            .expect("repeat runs");
        assert_eq!(got.reused, again.len() - 1);
        assert_eq!(
            got.ids,
            full_recompute(&plain, &again, &opts(3, SamplingParams::default()))
        );
        let st = sess.screen_stats();
        if screened {
            // The greedy turns' tokens (3 x 6 + 3), all but the sampled turns' (2 x 6).
            assert_eq!(st.screened + st.full, 21, "{name}: greedy choices");
            assert!(st.screened > 0, "{name}: the screen decided none");
        } else {
            assert_eq!(
                st,
                Default::default(),
                "{name}: no screen, no screened choice"
            );
        }
    }

    #[test]
    fn session_turns_match_full_recompute_gptoss() {
        turns_match_full_recompute("gptoss-tiny-mxfp4", false);
        turns_match_full_recompute("gptoss-tiny-mxfp4", true);
    }

    #[test]
    fn session_turns_match_full_recompute_qwen3() {
        turns_match_full_recompute("qwen3moe-tiny", false);
        turns_match_full_recompute("qwen3moe-tiny", true);
    }

    /// GPT-OSS's sliding layers: a turn that goes back further than the window still reuses
    /// the common prefix (the session keeps every position), with the same tokens.
    #[test]
    fn session_rewinds_past_the_sliding_window() {
        let model = load("gptoss-tiny-mxfp4");
        let window = model.config().sliding_window.expect("gpt-oss slides");
        let vocab = model.config().vocab_size;
        let mut g = Gen(99);
        let long = ids(&mut g, 2 * window + 40, vocab);
        let mut sess = ChatSession::new(model.clone(), 512).expect("session");
        let o = opts(2, SamplingParams::default());
        sess.generate(&long, &o, |_| ControlFlow::Continue(()))
            .expect("long turn");
        let edited = [&long[..20], &ids(&mut g, 9, vocab)[..]].concat();
        let got = sess
            .generate(&edited, &o, |_| ControlFlow::Continue(()))
            .expect("edited turn");
        assert_eq!(got.reused, lcp(&long, &edited));
        assert!(got.reused >= 20);
        assert_eq!(got.ids, full_recompute(&model, &edited, &o));
    }

    /// A prompt longer than the context is refused before the cache is touched; a callback's
    /// Break stops generation; the session goes on after both.
    #[test]
    fn session_refuses_prompts_beyond_the_context_without_touching_the_cache() {
        let model = load("qwen3moe-tiny");
        let vocab = model.config().vocab_size;
        let mut g = Gen(3);
        let mut sess = ChatSession::new(model.clone(), 40).expect("session");
        let p = ids(&mut g, 30, vocab);
        let got = sess
            .generate(&p, &opts(50, SamplingParams::default()), |_| {
                ControlFlow::Continue(())
            })
            .expect("fits");
        assert_eq!(
            got.finish,
            FinishReason::ContextFull,
            "stops when the context is full"
        );
        assert_eq!(got.ids.len(), 40 - 30 + 1);
        let before = sess.cached().to_vec();
        assert_eq!(before.len(), 40);
        let too_long = [&p[..], &ids(&mut g, 11, vocab)[..]].concat();
        let err = sess
            .generate(&too_long, &opts(1, SamplingParams::default()), |_| {
                ControlFlow::Continue(())
            })
            .expect_err("41 tokens do not fit 40 positions");
        assert!(
            matches!(
                err,
                SessionError::PromptTooLong {
                    prompt: 41,
                    context: 40
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("41"), "{err}");
        let bad = [&p[..5], &[vocab as u32][..]].concat();
        let err = sess
            .generate(&bad, &opts(1, SamplingParams::default()), |_| {
                ControlFlow::Continue(())
            })
            .expect_err("id out of range");
        assert!(matches!(err, SessionError::TokenOutOfRange { .. }), "{err}");
        assert_eq!(
            sess.cached(),
            &before[..],
            "refused prompts leave the cache alone"
        );
        let mut n = 0;
        let got = sess
            .generate(&p, &opts(10, SamplingParams::default()), |_| {
                n += 1;
                if n == 2 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .expect("runs");
        assert_eq!(got.finish, FinishReason::Cancelled);
        assert_eq!(got.ids.len(), 2);
        assert_eq!(got.reused, 29);
    }
}

// ---- `stormo chat` without a terminal ----

/// Two turns piped in: both are answered, the second reuses the first's cached prompt, and
/// /reset starts over (nothing reused).
#[test]
fn chat_answers_piped_turns_and_reports_reuse() {
    use clap::Parser;
    use stormo_cli::cmd::chat::{converse, Args};

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
    converse(&w.args, &tm, input, &mut out, &mut notes, false, false).expect("conversation runs");
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
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("temperature") && out.stdout.is_empty(),
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
        assert!(
            out.stdout.is_empty(),
            "{args:?} printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
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

// ---- `stormo chat` on a terminal (tmux) ----

/// A tmux server of the test's own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("tmux runs")
    }

    /// The pane's text, scrollback included, wrapped lines joined.
    fn screen(&self) -> String {
        let o = self.cmd(&["capture-pane", "-p", "-J", "-S", "-", "-t", "chat"]);
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Waits (at most 60 s) until the screen satisfies `done`; returns it.
    fn wait(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let t0 = std::time::Instant::now();
        loop {
            let s = self.screen();
            if done(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "waited 60 s for {what}; the screen:\n{s}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "chat"];
        args.extend_from_slice(keys);
        assert!(self.cmd(&args).status.success(), "send-keys {keys:?}");
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// The last line of the screen that is not blank.
fn last_line(screen: &str) -> &str {
    screen
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim_end()
}

/// `stormo chat` driven through a terminal (tmux): the Up arrow recalls the last message
/// (from the history file in the state directory), Ctrl-C stops a reply without ending the
/// chat, and the next message continues the same conversation (its prompt reuses the cached
/// first turn and the stopped reply); /save writes the conversation with the stopped reply.
#[test]
fn chat_on_a_terminal_recalls_history_and_ctrl_c_stops_a_reply() {
    let have = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        let msg = "tmux is not installed (apt-get install tmux)";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED chat_on_a_terminal_recalls_history_and_ctrl_c_stops_a_reply: {msg}");
        return;
    }
    let model = crate::http::synth_model();
    let tmp = tempfile::tempdir().expect("temp dir");
    let state = tmp.path().join("state");
    let saved = tmp.path().join("saved.json");
    let q = |p: &std::path::Path| format!("'{}'", p.display());
    // Greedy (a random-weight model then repeats itself rather than ending its reply), with
    // room for a reply far longer than the test waits.
    let command = format!(
        "env XDG_STATE_HOME={} XDG_CACHE_HOME={} {} chat --model {} --context 32768 \
         --max-new-tokens 30000 --temperature 0 --no-hot-store; echo CHAT-EXITED $?; sleep 60",
        q(&state),
        q(tmp.path()),
        q(&crate::demo::stormo_exe()),
        q(model.path())
    );
    let t = Tmux {
        socket: format!("stormo-test-{}", std::process::id()),
    };
    let o = t.cmd(&[
        "new-session",
        "-d",
        "-s",
        "chat",
        "-x",
        "200",
        "-y",
        "50",
        &command,
    ]);
    assert!(
        o.status.success(),
        "tmux: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    t.wait("the banner", |s| s.contains("stormo chat with"));

    // A reply, stopped with Ctrl-C once it has started.
    t.keys(&["Hello there", "Enter"]);
    let shown = t.wait("the reply to start", |s| {
        s.lines()
            .skip_while(|l| !l.starts_with("> Hello there"))
            .skip(1)
            .any(|l| !l.trim().is_empty())
    });
    assert!(
        !shown.contains("[prompt"),
        "the reply ended by itself:\n{shown}"
    );
    t.keys(&["C-c"]);
    let s = t.wait("the stopped reply's note", |s| s.contains("[prompt"));
    assert!(
        s.contains("(stopped; the reply so far stays in the conversation)"),
        "{s}"
    );
    let first = s
        .lines()
        .find(|l| l.contains("[prompt"))
        .expect("a stats line")
        .to_string();
    assert!(first.contains("(stopped)"), "{first}");
    let first_prompt: usize = first
        .split("[prompt ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the prompt size in {first}"));
    t.wait("the next prompt", |s| last_line(s) == ">");

    // Up recalls the message; it is kept in the history file too.
    t.keys(&["Up"]);
    t.wait("the recalled message", |s| last_line(s) == "> Hello there");
    let history = std::fs::read_to_string(state.join("stormo/chat_history")).expect("history file");
    assert!(history.contains("Hello there"), "{history}");

    // The next message continues the conversation: its prompt reuses the first turn and the
    // stopped reply from the cache.
    t.keys(&["C-u", "And again?", "Enter"]);
    let s = t.wait("the second reply to start", |s| {
        s.lines()
            .skip_while(|l| !l.starts_with("> And again?"))
            .skip(1)
            .any(|l| !l.trim().is_empty())
    });
    assert_eq!(s.matches("[prompt").count(), 1, "{s}");
    t.keys(&["C-c"]);
    let s = t.wait("the second stats line", |s| {
        s.matches("[prompt").count() == 2
    });
    let second = s
        .lines()
        .filter(|l| l.contains("[prompt"))
        .nth(1)
        .expect("stats")
        .to_string();
    let reused: usize = second
        .split(", ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the reuse count in {second}"));
    assert!(
        reused >= first_prompt,
        "the second turn reuses the first prompt ({first_prompt}) from the cache: {second}"
    );

    // /save keeps both turns, the stopped replies included; /quit leaves with status 0.
    t.wait("the next prompt", |s| last_line(s) == ">");
    t.keys(&[&format!("/save {}", saved.display()), "Enter"]);
    t.wait("the save note", |s| s.contains("(saved 4 messages to"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&saved).expect("saved file"))
        .expect("saved JSON");
    let roles: Vec<&str> = v["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"], "{v}");
    assert_eq!(v["messages"][0]["content"], "Hello there");
    assert_eq!(v["messages"][2]["content"], "And again?");
    // The stopped reply is in the conversation as far as it was shown.
    let m = &v["messages"][1];
    let text = |k: &str| m[k].as_str().unwrap_or("").trim().to_string();
    assert!(
        !text("content").is_empty() || !text("reasoning_content").is_empty(),
        "{v}"
    );

    // A line ending in a backslash continues the message on the next line.
    t.keys(&["first line\\", "Enter"]);
    t.wait("the continuation line", |s| s.contains("first line\\"));
    t.keys(&["second line", "Enter"]);
    t.wait("the third reply to start", |s| {
        s.lines()
            .skip_while(|l| !l.contains("second line"))
            .skip(1)
            .any(|l| !l.trim().is_empty())
    });
    t.keys(&["C-c"]);
    t.wait("the third stats line", |s| {
        s.matches("[prompt").count() == 3
    });
    t.wait("the next prompt", |s| last_line(s) == ">");
    let saved6 = tmp.path().join("six.json");
    t.keys(&[&format!("/save {}", saved6.display()), "Enter"]);
    t.wait("the second save", |s| {
        s.contains(&format!("(saved 6 messages to {})", saved6.display()))
    });
    let v6: Value = serde_json::from_str(&std::fs::read_to_string(&saved6).expect("saved"))
        .expect("saved JSON");
    assert_eq!(
        v6["messages"][4]["content"], "first line\nsecond line",
        "{v6}"
    );

    // /load: a bad file is a clear error and changes nothing; a good one replaces the
    // conversation (saving again gives its four messages).
    let bad = tmp.path().join("bad.json");
    std::fs::write(
        &bad,
        "{\"format\": \"stormo-chat\", \"version\": 1, \"messages\": 5}",
    )
    .expect("write");
    t.keys(&[&format!("/load {}", bad.display()), "Enter"]);
    let s = t.wait("the load error", |s| {
        s.contains("cannot load the conversation")
    });
    assert!(s.contains("bad.json is not a saved stormo chat"), "{s}");
    assert!(s.contains("(the conversation is unchanged)"), "{s}");
    t.keys(&[&format!("/load {}", saved.display()), "Enter"]);
    t.wait("the load note", |s| s.contains("(loaded 4 messages from"));
    let again = tmp.path().join("again.json");
    t.keys(&[&format!("/save {}", again.display()), "Enter"]);
    t.wait("the third save", |s| {
        s.contains(&format!("(saved 4 messages to {})", again.display()))
    });
    let v4: Value =
        serde_json::from_str(&std::fs::read_to_string(&again).expect("saved")).expect("saved JSON");
    assert_eq!(v4["messages"], v["messages"]);
    t.keys(&["/quit", "Enter"]);
    t.wait("the chat to exit", |s| s.contains("CHAT-EXITED 0"));
}
