//! Qwen3's ChatML chat template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message and
//! `<|im_start|>assistant\n` as the generation prompt.
//!
//! Follows the `chat_template` Qwen3 (e.g. Qwen3-30B-A3B) ships in `tokenizer_config.json`,
//! without tools: a leading system message; user messages; assistant messages whose
//! reasoning (`<think>…</think>`) is kept only after the last user query (earlier turns keep
//! their answer only); tool results wrapped in `<tool_response>` inside a user turn (several
//! consecutive ones share it); and `enable_thinking = false` writing an empty think block in
//! the generation prompt.
//!
//! The template produces text; the `tokenizers` library would then encode it with special
//! tokens recognized. Here the special tokens are pushed by id and only the text between
//! them is encoded (ordinary encoding, so a `<|im_end|>` typed by a user stays text). For
//! content without special-token strings the ids are the same as Transformers'
//! `apply_chat_template(tokenize=True)`.

use std::sync::Arc;

use super::tokenizer::{EncodeError, TokenId, Tokenizer};

/// A ChatML role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The system prompt (only the first message is rendered as the system block; a later
    /// one is rendered in place).
    System,
    /// The person.
    User,
    /// The model.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// As written after `<|im_start|>`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

/// One message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// Its text. For the assistant it may hold `<think>…</think>` before the answer.
    pub content: String,
    /// The assistant's reasoning, if kept apart from `content`.
    pub reasoning: Option<String>,
}

impl Message {
    /// A message with text and no separate reasoning.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            reasoning: None,
        }
    }
}

/// A missing special token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatMlError {
    /// The tokenizer lacks a token ChatML needs.
    #[error("the tokenizer has no {0} token: not a ChatML (Qwen) vocabulary")]
    MissingToken(&'static str),
}

/// The ChatML template over a tokenizer with `<|im_start|>` and `<|im_end|>`.
#[derive(Debug, Clone)]
pub struct ChatMl {
    tokenizer: Arc<Tokenizer>,
    im_start: TokenId,
    im_end: TokenId,
    end_of_text: Option<TokenId>,
}

/// A rendered prompt under construction: special ids pushed directly, text between them
/// gathered and encoded as one piece (as encoding the template's whole text would).
struct Builder<'a> {
    tok: &'a Tokenizer,
    out: Vec<TokenId>,
    text: String,
}

impl Builder<'_> {
    fn special(&mut self, id: TokenId) -> Result<(), EncodeError> {
        self.flush()?;
        self.out.push(id);
        Ok(())
    }
    fn text(&mut self, s: &str) {
        self.text.push_str(s);
    }
    fn flush(&mut self) -> Result<(), EncodeError> {
        if !self.text.is_empty() {
            let ids = self.tok.encode(&self.text, false)?;
            self.out.extend(ids);
            self.text.clear();
        }
        Ok(())
    }
}

/// Splits an assistant message into (reasoning, answer) as the template does.
fn split_reasoning(m: &Message) -> (String, String) {
    if let Some(r) = &m.reasoning {
        return (r.clone(), m.content.clone());
    }
    match m.content.find("</think>") {
        Some(_) => {
            let mut parts = m.content.split("</think>");
            let before = parts.next().unwrap_or("");
            let after = m.content.rsplit("</think>").next().unwrap_or("");
            let reasoning = before
                .trim_end_matches('\n')
                .rsplit("<think>")
                .next()
                .unwrap_or("")
                .trim_start_matches('\n');
            (
                reasoning.to_string(),
                after.trim_start_matches('\n').to_string(),
            )
        }
        None => (String::new(), m.content.clone()),
    }
}

impl ChatMl {
    /// Looks up the special tokens by name.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, ChatMlError> {
        let im_start = tokenizer
            .token_to_id("<|im_start|>")
            .ok_or(ChatMlError::MissingToken("<|im_start|>"))?;
        let im_end = tokenizer
            .token_to_id("<|im_end|>")
            .ok_or(ChatMlError::MissingToken("<|im_end|>"))?;
        let end_of_text = tokenizer.token_to_id("<|endoftext|>");
        Ok(Self {
            tokenizer,
            im_start,
            im_end,
            end_of_text,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Tokens that end the assistant's turn: `<|im_end|>` and, if present, `<|endoftext|>`.
    pub fn stop_tokens(&self) -> Vec<TokenId> {
        let mut v = vec![self.im_end];
        v.extend(self.end_of_text);
        v
    }

    /// Renders the conversation; with `generation_prompt`, ends with `<|im_start|>assistant\n`
    /// (and an empty `<think>\n\n</think>\n\n` when `enable_thinking` is false).
    pub fn render(
        &self,
        messages: &[Message],
        generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<Vec<TokenId>, EncodeError> {
        let mut b = Builder {
            tok: &self.tokenizer,
            out: Vec::new(),
            text: String::new(),
        };
        if let Some(first) = messages.first().filter(|m| m.role == Role::System) {
            b.special(self.im_start)?;
            b.text("system\n");
            b.text(&first.content);
            b.special(self.im_end)?;
            b.text("\n");
        }
        // The last user message that is a real query (not a wrapped tool response).
        let last_query = messages
            .iter()
            .rposition(|m| {
                m.role == Role::User
                    && !(m.content.starts_with("<tool_response>")
                        && m.content.ends_with("</tool_response>"))
            })
            .unwrap_or(messages.len().saturating_sub(1));
        for (i, m) in messages.iter().enumerate() {
            match m.role {
                Role::User | Role::System => {
                    if m.role == Role::System && i == 0 {
                        continue;
                    }
                    b.special(self.im_start)?;
                    b.text(m.role.as_str());
                    b.text("\n");
                    b.text(&m.content);
                    b.special(self.im_end)?;
                    b.text("\n");
                }
                Role::Assistant => {
                    let (reasoning, content) = split_reasoning(m);
                    b.special(self.im_start)?;
                    b.text("assistant\n");
                    let last = i + 1 == messages.len();
                    if i > last_query && (last || !reasoning.is_empty()) {
                        b.text("<think>\n");
                        b.text(reasoning.trim_matches('\n'));
                        b.text("\n</think>\n\n");
                        b.text(content.trim_start_matches('\n'));
                    } else {
                        b.text(&content);
                    }
                    b.special(self.im_end)?;
                    b.text("\n");
                }
                Role::Tool => {
                    if i == 0 || messages[i - 1].role != Role::Tool {
                        b.special(self.im_start)?;
                        b.text("user");
                    }
                    b.text("\n<tool_response>\n");
                    b.text(&m.content);
                    b.text("\n</tool_response>");
                    if i + 1 == messages.len() || messages[i + 1].role != Role::Tool {
                        b.special(self.im_end)?;
                        b.text("\n");
                    }
                }
            }
        }
        if generation_prompt {
            b.special(self.im_start)?;
            b.text("assistant\n");
            if !enable_thinking {
                b.text("<think>\n\n</think>\n\n");
            }
        }
        b.flush()?;
        Ok(b.out)
    }

    /// Splits generated text into (reasoning, answer): the text before `</think>` (without
    /// a leading `<think>`) and the rest, both trimmed of surrounding newlines. Without
    /// `</think>` all of it is the answer.
    pub fn split_reasoning(text: &str) -> (Option<String>, String) {
        let m = Message::new(Role::Assistant, text);
        let (r, c) = split_reasoning(&m);
        if text.contains("</think>") {
            (Some(r.trim_matches('\n').to_string()), c)
        } else {
            (None, c)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_split_follows_the_template() {
        let (r, c) = ChatMl::split_reasoning("<think>\nhmm\n</think>\n\nIt is 4.");
        assert_eq!(r.as_deref(), Some("hmm"));
        assert_eq!(c, "It is 4.");
        let (r, c) = ChatMl::split_reasoning("plain");
        assert_eq!(r, None);
        assert_eq!(c, "plain");
    }
}
