//! Tokenizer, Harmony and ChatML against the o200k_harmony fixture and Python oracles, chat
//! formats, and sessions (longest-common-prefix KV reuse). `stormo chat` and `stormo run`
//! through the binary are in `chat_cli.rs`, on a terminal in `chat_terminal.rs`.
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

pub(crate) fn o200k() -> &'static Arc<Tokenizer> {
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

pub(crate) fn ids_of(v: &Value) -> Vec<u32> {
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

/// Runs `script` with `input` on stdin and parses its stdout as JSON; fails where `python3`
/// cannot import `package`.
fn python_oracle(package: &str, script: &str, input: &Value) -> Value {
    stormo_tests::require_python(package);
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
    serde_json::from_slice(&out.stdout).expect("oracle prints JSON")
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
    let want = python_oracle("tiktoken", TIKTOKEN_SCRIPT, &input);
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
    let want = python_oracle("tokenizers", HF_SCRIPT, &input);
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
    /// With `screened`, the session's model finds greedy tokens and draws sampled ones through
    /// its screened head, and the full recomputes run without one.
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
            // Every turn's tokens (5 x 6 + 3), greedy and sampled.
            assert_eq!(st.screened + st.full, 33, "{name}: tokens chosen");
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

    /// Sampled turns through a session whose model keeps a screened head draw, seed for seed,
    /// the tokens of a session whose model has none (the whole head), over temperatures,
    /// top-k, top-p, penalties and seeds, turn after turn in one conversation (the cache
    /// reused); the screen draws most of them.
    #[test]
    fn sampled_turns_through_the_screened_head_draw_the_whole_heads_tokens() {
        for name in ["gptoss-tiny-mxfp4", "qwen3moe-tiny"] {
            let (screened, plain) = (load_with(name, true), load(name));
            let vocab = plain.config().vocab_size;
            let mut g = Gen(0x5a3e_11ed);
            let mut a = ChatSession::new(screened, 512).expect("session");
            let mut b = ChatSession::new(plain, 512).expect("session");
            let mut prompt = ids(&mut g, 12, vocab);
            for (k, case) in crate::batch::sampling_cases().into_iter().enumerate() {
                for seed in 0..3 {
                    let sampling = SamplingParams {
                        seed: seed * 7 + k as u64,
                        ..case
                    };
                    let o = opts(8, sampling);
                    let go = |s: &mut ChatSession| {
                        s.generate(&prompt, &o, |_| ControlFlow::Continue(()))
                            .expect("turn runs")
                            .ids
                    };
                    let (got, want) = (go(&mut a), go(&mut b));
                    assert_eq!(got, want, "{name}: {sampling:?}");
                    prompt = [&prompt[..], &got[..], &ids(&mut g, 3, vocab)[..]].concat();
                }
            }
            let st = a.screen_stats();
            assert_eq!(st.screened + st.full, 7 * 3 * 8, "{name}: tokens chosen");
            assert!(st.screened > st.full, "{name}: the screen drew {st:?}");
            assert_eq!(b.screen_stats().screened, 0, "{name}: no screen");
        }
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

// ---- ReplyStream: output in and out of the chat format ----

/// Reasoning and answer text `ids` give through a reply stream, cut after `n` ids.
fn reply_of(f: &ChatFormat, ids: &[u32], n: usize) -> (String, String) {
    let mut r = stormo_text::reply::ReplyStream::chat(f);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for &id in &ids[..n] {
        match r.push(id) {
            Some(OutputDelta::Reasoning(t)) => reasoning.push_str(&t),
            Some(OutputDelta::Content(t)) => content.push_str(&t),
            None => {}
        }
    }
    if let Some(OutputDelta::Content(t)) = r.finish() {
        content.push_str(&t);
    }
    (reasoning, content)
}

/// A reply in the format gives its channels' text at every length it is cut at (a cut inside
/// a header shows nothing of it); a reply that leaves the format right away (as a
/// random-weight model's does) is shown as plain text from its first id, so a short reply is
/// the start of a longer one rather than empty until 48 ids have come.
#[test]
fn reply_stream_judges_short_and_long_replies_alike() {
    let f = ChatFormat::for_family(Family::GptOss, o200k().clone()).expect("Harmony vocab");
    let tok = o200k();
    let good = tok
        .encode(
            "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant\
             <|channel|>final<|message|>2 + 2 = 4.<|return|>",
            true,
        )
        .expect("encode");
    let (reasoning, content) = reply_of(&f, &good, good.len());
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("Simple arithmetic.", "2 + 2 = 4.")
    );
    for n in 0..good.len() {
        let (r, c) = reply_of(&f, &good, n);
        assert!(
            reasoning.starts_with(&r) && content.starts_with(&c),
            "{n}: {r:?} {c:?}"
        );
        assert!(
            !c.contains("final") && !r.contains("analysis"),
            "{n}: {r:?} {c:?}"
        );
    }
    // A tool call's header (recipient and content type) is a header too.
    let call = tok
        .encode(
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",
            true,
        )
        .expect("encode");
    assert_eq!(reply_of(&f, &call, call.len()).1, "{}");
    // Out of the format from the first id: plain text at every length.
    let bad = tok
        .encode(" приводит pack of words that are no header at all", false)
        .expect("encode");
    let (_, all) = reply_of(&f, &bad, bad.len());
    assert_eq!(all, " приводит pack of words that are no header at all");
    for n in 1..bad.len() {
        let (_, c) = reply_of(&f, &bad, n);
        assert!(!c.is_empty() && all.starts_with(&c), "{n}: {c:?}");
    }
}
