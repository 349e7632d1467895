//! Conversations saved to and loaded from JSON files (`/save FILE`, `/load FILE` in `stormo
//! chat`).
//!
//! The file is one object, `{"format": "stormo-chat", "version": 1, "model": NAME,
//! "messages": [...]}`, whose messages are in OpenAI's shape (`role`, `content`, and
//! `reasoning_content` for an assistant's reasoning), so a saved chat can be sent to the HTTP
//! API as it is. Loading checks everything and names what is wrong (file, JSON position,
//! message index); a bad file leaves the conversation as it was.
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

#[derive(Debug, Serialize, Deserialize)]
struct File {
    format: String,
    version: u32,
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Message>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Message {
    role: String,
    content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    /// The file is not a saved chat.
    #[error("{path} is not a saved stormo chat: {reason}")]
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

/// The turns of a value [`to_json`] made; the error says what is wrong.
pub fn from_json(v: serde_json::Value) -> Result<Vec<Turn>, String> {
    turns_of(serde_json::from_value(v).map_err(|e| e.to_string())?)
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

/// Reads the turns saved in `path`.
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
    let file: File = serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    turns_of(file).map_err(invalid)
}

/// The turns of a parsed file, checked.
fn turns_of(file: File) -> Result<Vec<Turn>, String> {
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
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let role = TurnRole::parse(&m.role).ok_or_else(|| {
                format!(
                    "messages[{i}].role {:?} is not system, developer, user, assistant or tool",
                    m.role
                )
            })?;
            Ok(Turn {
                reasoning: m.reasoning_content,
                name: m.name,
                ..Turn::new(role, m.content)
            })
        })
        .collect()
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
            ("{", "is not a saved stormo chat"),
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
        ];
        for (text, want) in cases {
            std::fs::write(&path, text).expect("write");
            let e = load(&path).expect_err(text).to_string();
            assert!(e.contains(want) && e.contains("bad.json"), "{text}: {e}");
        }
        let e = load(&dir.path().join("none.json")).expect_err("missing");
        assert!(e.to_string().contains("none.json"), "{e}");
    }
}
