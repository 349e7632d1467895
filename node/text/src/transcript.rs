//! Conversations saved to and loaded from JSON files (`/save FILE`, `/load FILE` in `stormo
//! chat`).
//!
//! The file is one object, `{"format": "stormo-chat", "version": 1, "model": NAME,
//! "messages": [...]}`, whose messages are in OpenAI's shape (`role`, `content`, and
//! `reasoning_content` for an assistant's reasoning), so a saved chat can be sent to the HTTP
//! API as it is. Loading also takes OpenAI's own shapes: a chat request body (an object with
//! `messages`, its other fields ignored) or a bare array of messages, each message's
//! `content` a string, an array of text parts (joined) or null (empty), as the HTTP API reads
//! them. Loading checks everything and names what is wrong (file, JSON position, message
//! index); a bad file leaves the conversation as it was.
//!
//! The KV cache is not saved here (the next turn recomputes the conversation, reusing
//! nothing): `stormo chat --session FILE` saves it with the transcript ([`to_json`] inside a
//! session file, [`crate::session::ChatSession::save`]). Non-goal: tool calls.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Turn, TurnRole};

/// The `format` field's value.
pub const FORMAT: &str = "stormo-chat";

/// The largest file `/load` reads.
pub const MAX_BYTES: u64 = 64 << 20;

/// stormo's own file, as written.
#[derive(Debug, Serialize)]
struct File {
    format: String,
    version: u32,
    model: Option<String>,
    messages: Vec<Message>,
}

/// stormo's own file, as read (`model` ignored): the messages checked one by one
/// ([`turn_of`]).
#[derive(Debug, Deserialize)]
struct FileIn {
    format: String,
    version: u32,
    messages: Vec<serde_json::Value>,
}

#[derive(Debug, Serialize)]
struct Message {
    role: String,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
}

fn role_name(r: TurnRole) -> &'static str {
    match r {
        TurnRole::System => "system",
        TurnRole::Developer => "developer",
        TurnRole::User => "user",
        TurnRole::Assistant => "assistant",
        TurnRole::Tool => "tool",
    }
}

/// Why a conversation could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TranscriptError {
    /// Reading or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_BYTES`].
    #[error("{path} is {len} bytes, more than a saved chat can be ({MAX_BYTES})")]
    TooLarge {
        /// The file.
        path: String,
        /// Its length.
        len: u64,
    },
    /// The file is not a conversation in a shape [`load`] reads.
    #[error("{path} is not a saved chat: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// Writes `turns` to `path` (replacing it), via a temporary file beside it.
pub fn save(path: &Path, model: &str, turns: &[Turn]) -> Result<(), TranscriptError> {
    let io = |source| TranscriptError::Io {
        path: path.display().to_string(),
        source,
    };
    let text =
        serde_json::to_string_pretty(&file_of(model, turns)).expect("a transcript serializes");
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, text + "\n").map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// What [`save`] writes, as a JSON value (kept inside a session file by `chat --session`).
pub fn to_json(model: &str, turns: &[Turn]) -> serde_json::Value {
    serde_json::to_value(file_of(model, turns)).expect("a transcript serializes")
}

/// The turns of a value [`to_json`] made (or any shape [`load`] reads); the error says what is
/// wrong.
pub fn from_json(v: serde_json::Value) -> Result<Vec<Turn>, String> {
    turns_of(v)
}

fn file_of(model: &str, turns: &[Turn]) -> File {
    File {
        format: FORMAT.into(),
        version: 1,
        model: Some(model.into()),
        messages: turns
            .iter()
            .map(|t| Message {
                role: role_name(t.role).into(),
                content: t.content.clone(),
                reasoning_content: t.reasoning.clone(),
                name: t.name.clone(),
            })
            .collect(),
    }
}

/// Reads the turns saved in `path`, in any of the shapes the module names.
pub fn load(path: &Path) -> Result<Vec<Turn>, TranscriptError> {
    let p = path.display().to_string();
    let io = |source| TranscriptError::Io {
        path: p.clone(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MAX_BYTES {
        return Err(TranscriptError::TooLarge { path: p, len });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    let invalid = |reason: String| TranscriptError::Invalid {
        path: p.clone(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    turns_of(value).map_err(invalid)
}

/// The turns of a parsed file in one of the shapes [`load`] reads, checked.
fn turns_of(v: serde_json::Value) -> Result<Vec<Turn>, String> {
    use serde_json::Value;
    let messages = match v {
        Value::Array(messages) => messages,
        Value::Object(o) if o.contains_key("format") => {
            let file: FileIn =
                serde_json::from_value(Value::Object(o)).map_err(|e| e.to_string())?;
            if file.format != FORMAT {
                return Err(format!("its format is {:?}, not {FORMAT:?}", file.format));
            }
            if file.version != 1 {
                return Err(format!(
                    "version {} (this stormo reads version 1)",
                    file.version
                ));
            }
            file.messages
        }
        Value::Object(mut o) => match o.remove("messages") {
            Some(Value::Array(messages)) => messages,
            Some(other) => {
                return Err(format!(
                    "its messages field is {}, not an array of messages",
                    json_kind(&other)
                ))
            }
            None => return Err(SHAPES.into()),
        },
        other => return Err(format!("it is {}: {SHAPES}", json_kind(&other))),
    };
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| turn_of(i, m))
        .collect()
}

/// What [`load`] reads, for an error that found none of it.
const SHAPES: &str = "expected stormo's saved chat ({\"format\": \"stormo-chat\", ...}), an \
                      OpenAI chat request body ({\"messages\": [...]}) or an array of messages \
                      ([{\"role\": \"user\", \"content\": \"...\"}])";

/// The `i`th message as a turn: OpenAI's `role`, `content` (a string, text parts, or null),
/// and stormo's `reasoning_content`; other fields are ignored.
fn turn_of(i: usize, m: serde_json::Value) -> Result<Turn, String> {
    use serde_json::Value;
    let Value::Object(mut m) = m else {
        return Err(format!(
            "messages[{i}] is {}, not a message ({{\"role\": ..., \"content\": ...}})",
            json_kind(&m)
        ));
    };
    let text = |m: &mut serde_json::Map<String, Value>, field: &str| match m.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!(
            "messages[{i}].{field} is {}, not a string",
            json_kind(&other)
        )),
    };
    let role = text(&mut m, "role")?.ok_or_else(|| format!("messages[{i}] has no role"))?;
    let role = TurnRole::parse(&role).ok_or_else(|| {
        format!("messages[{i}].role {role:?} is not system, developer, user, assistant or tool")
    })?;
    let content = match m.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => s.push_str(t),
                    _ => {
                        return Err(format!(
                            "messages[{i}].content[{j}] is not a text part ({{\"type\": \"text\", \
                             \"text\": ...}}; only text is read)"
                        ))
                    }
                }
            }
            s
        }
        Some(other) => {
            return Err(format!(
                "messages[{i}].content is {}, not a string or an array of text parts",
                json_kind(&other)
            ))
        }
    };
    Ok(Turn {
        reasoning: text(&mut m, "reasoning_content")?,
        name: text(&mut m, "name")?,
        ..Turn::new(role, content)
    })
}

/// How an error names a JSON value's kind (never the value itself, which may be large); the
/// HTTP API's errors use it too.
pub fn json_kind(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_round_trips() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("c.json");
        let turns = vec![
            Turn::new(TurnRole::System, "Be brief."),
            Turn::new(TurnRole::User, "Hi\nthere"),
            Turn {
                reasoning: Some("They greet.".into()),
                ..Turn::new(TurnRole::Assistant, "Hello!")
            },
        ];
        save(&path, "m", &turns).expect("saved");
        assert_eq!(load(&path).expect("loaded"), turns);
        assert!(!dir.path().join("c.partial").exists());
    }

    #[test]
    fn bad_files_are_named_errors() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("bad.json");
        let cases = [
            ("{", "is not a saved chat"),
            (
                r#"{"format": "x", "version": 1, "messages": []}"#,
                "its format is \"x\"",
            ),
            (
                r#"{"format": "stormo-chat", "version": 2, "messages": []}"#,
                "version 2",
            ),
            (
                r#"{"format": "stormo-chat", "version": 1, "messages": [{"role": "bot", "content": ""}]}"#,
                "messages[0].role \"bot\"",
            ),
            (
                r#"{"format": "stormo-chat", "version": 1}"#,
                "missing field `messages`",
            ),
            // None of the shapes read: each error says which are.
            (r#"{"model": "m"}"#, "an OpenAI chat request body"),
            ("3", "it is a number: expected stormo's saved chat"),
            (r#"{"messages": {}}"#, "its messages field is an object"),
            (
                r#"[{"role": "user", "content": 3}]"#,
                "messages[0].content is a number",
            ),
            (r#"[{"content": "hi"}]"#, "messages[0] has no role"),
            (r#"["hi"]"#, "messages[0] is a string, not a message"),
            (
                r#"[{"role": "user", "content": [{"type": "image_url"}]}]"#,
                "messages[0].content[0] is not a text part",
            ),
        ];
        for (text, want) in cases {
            std::fs::write(&path, text).expect("write");
            let e = load(&path).expect_err(text).to_string();
            assert!(e.contains(want) && e.contains("bad.json"), "{text}: {e}");
        }
        let e = load(&dir.path().join("none.json")).expect_err("missing");
        assert!(e.to_string().contains("none.json"), "{e}");
    }

    /// `/load` takes what `/save`'s help promises, OpenAI's message shape: a bare array of
    /// messages and a chat request body (`{"messages": [...]}`, its other fields ignored), as
    /// well as stormo's own file; content as a string, text parts or null, as the HTTP API
    /// reads it.
    #[test]
    fn openai_message_arrays_and_request_bodies_load() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("c.json");
        let want = vec![
            Turn::new(TurnRole::System, "Be brief."),
            Turn::new(TurnRole::User, "Hi there"),
            Turn {
                reasoning: Some("They greet.".into()),
                ..Turn::new(TurnRole::Assistant, "")
            },
        ];
        let messages = r#"[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": null, "reasoning_content": "They greet.",
             "tool_calls": []}
        ]"#;
        for text in [
            messages.to_string(),
            format!(r#"{{"model": "gpt-4o", "temperature": 0.2, "messages": {messages}}}"#),
        ] {
            std::fs::write(&path, &text).expect("write");
            assert_eq!(load(&path).expect(&text), want, "{text}");
        }
        assert_eq!(
            from_json(serde_json::from_str(messages).expect("JSON")).expect("turns"),
            want
        );
    }
}
