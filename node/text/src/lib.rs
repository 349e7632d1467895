//! stormo's text, for people: tokenizers, chat formats and their stop tokens.
//!
//! Owns: [`tokenizer`] (byte-level BPE from a model folder's `tokenizer.json`, exact for
//! o200k_harmony and Qwen2/Qwen3), [`harmony`] (GPT-OSS's Harmony format: render a
//! conversation to ids, parse generated ids back into messages with channels) and [`chatml`]
//! (Qwen3's ChatML template). Special-token ids always come from the tokenizer by name.
//!
//! [`ChatFormat`] ties them together for callers that hold OpenAI-style turns: it picks the
//! format for a model family, renders a prompt, names the stop ids and parses streamed output
//! into reasoning and answer text.
//!
//! [`session`] keeps a conversation's KV cache between turns and reuses the longest common
//! prefix of each new render; [`shift`] chooses the turns a full conversation still renders
//! (the system prompt kept, the oldest exchanges dropped).
//!
//! [`transcript`] is a saved conversation (`stormo chat`'s /save and /load).
//!
//! [`defaults`] reads the sampling a model's `generation_config.json` recommends.
//!
//! Non-goals here: sampling (in `stormo_engine::sampling`), servers (in `stormo_node::http`), the
//! terminal (in the `stormo` binary). No async runtime and no network here.

use std::sync::Arc;

use stormo_engine::Family;

pub mod chatml;
pub mod defaults;
pub mod harmony;
pub mod reply;
pub mod session;
pub mod shift;
pub mod tokenizer;
pub mod transcript;

pub use tokenizer::{
    DecodeError, EncodeError, LoadError, StreamDecoder, TokenId, Tokenizer, Utf8Stream,
};

/// A chat turn in the shape chat APIs use (OpenAI's `messages`), for either format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: TurnRole,
    /// The text.
    pub content: String,
    /// The assistant's reasoning (Harmony `analysis`, Qwen `<think>`), if any.
    pub reasoning: Option<String>,
    /// For tool turns: the tool's name (Harmony renders it as the author).
    pub name: Option<String>,
}

impl Turn {
    /// A turn with text only.
    pub fn new(role: TurnRole, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            reasoning: None,
            name: None,
        }
    }
}

/// The role of a [`Turn`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TurnRole {
    /// The system prompt: Harmony's developer instructions, ChatML's system block.
    System,
    /// Same as `System` (OpenAI's newer name).
    Developer,
    /// The person.
    User,
    /// The model.
    Assistant,
    /// A tool result.
    Tool,
}

impl TurnRole {
    /// Parses an OpenAI role name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "system" => Self::System,
            "developer" => Self::Developer,
            "user" => Self::User,
            "assistant" => Self::Assistant,
            "tool" => Self::Tool,
            _ => return None,
        })
    }
}

/// Settings of a prompt render.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptOptions {
    /// Harmony's `Reasoning:` line.
    pub reasoning_effort: harmony::ReasoningEffort,
    /// Harmony's `Current date:` line (none by default, like openai-harmony).
    pub date: Option<String>,
    /// Qwen3's thinking (false writes an empty think block).
    pub enable_thinking: bool,
}

impl Default for PromptOptions {
    fn default() -> Self {
        Self {
            reasoning_effort: harmony::ReasoningEffort::Medium,
            date: None,
            enable_thinking: true,
        }
    }
}

/// Why a chat format could not be set up or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The tokenizer lacks the format's special tokens.
    #[error(transparent)]
    Harmony(#[from] harmony::HarmonyError),
    /// The tokenizer lacks ChatML's special tokens.
    #[error(transparent)]
    ChatMl(#[from] chatml::ChatMlError),
    /// Rendering failed.
    #[error(transparent)]
    Render(#[from] harmony::RenderError),
    /// Encoding failed.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// Parsing generated ids failed.
    #[error(transparent)]
    Parse(#[from] harmony::ParseError),
    /// Decoding generated ids failed.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// The chat format of a model family: Harmony for GPT-OSS, ChatML for Qwen3.
#[derive(Debug, Clone)]
pub enum ChatFormat {
    /// GPT-OSS.
    Harmony(harmony::Harmony),
    /// Qwen3.
    ChatMl(chatml::ChatMl),
}

impl ChatFormat {
    /// The format a family was trained on, over its tokenizer.
    pub fn for_family(family: Family, tokenizer: Arc<Tokenizer>) -> Result<Self, ChatError> {
        Ok(match family {
            Family::GptOss => Self::Harmony(harmony::Harmony::new(tokenizer)?),
            Family::Qwen3Moe => Self::ChatMl(chatml::ChatMl::new(tokenizer)?),
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        match self {
            Self::Harmony(h) => h.tokenizer(),
            Self::ChatMl(c) => c.tokenizer(),
        }
    }

    /// Renders turns as a prompt for the assistant's next turn. Harmony: a system message
    /// (harmony's default identity, the effort and date from `opts`), system/developer turns
    /// as developer instructions, assistant turns on `final` (their reasoning on `analysis`,
    /// which the renderer drops from earlier turns), tool turns under their name.
    pub fn render_prompt(
        &self,
        turns: &[Turn],
        opts: &PromptOptions,
    ) -> Result<Vec<TokenId>, ChatError> {
        match self {
            Self::Harmony(h) => {
                use harmony::{Message, Role};
                let mut msgs = vec![Message::system(harmony::SystemContent {
                    reasoning_effort: Some(opts.reasoning_effort),
                    conversation_start_date: opts.date.clone(),
                    ..Default::default()
                })];
                for t in turns {
                    match t.role {
                        TurnRole::System | TurnRole::Developer => {
                            msgs.push(Message::developer(t.content.clone()))
                        }
                        TurnRole::User => msgs.push(Message::user(t.content.clone())),
                        TurnRole::Assistant => {
                            if let Some(r) = &t.reasoning {
                                msgs.push(Message::assistant("analysis", r.clone()));
                            }
                            msgs.push(Message::assistant("final", t.content.clone()));
                        }
                        TurnRole::Tool => msgs.push(Message {
                            name: Some(t.name.clone().unwrap_or_else(|| "tool".into())),
                            channel: Some("commentary".into()),
                            ..Message::text(Role::Tool, t.content.clone())
                        }),
                    }
                }
                let opts = harmony::RenderOptions::default();
                Ok(h.render_for_completion(&msgs, Role::Assistant, &opts)?)
            }
            Self::ChatMl(c) => {
                use chatml::{Message, Role};
                let msgs: Vec<Message> = turns
                    .iter()
                    .map(|t| Message {
                        role: match t.role {
                            TurnRole::System | TurnRole::Developer => Role::System,
                            TurnRole::User => Role::User,
                            TurnRole::Assistant => Role::Assistant,
                            TurnRole::Tool => Role::Tool,
                        },
                        content: t.content.clone(),
                        reasoning: t.reasoning.clone(),
                    })
                    .collect();
                Ok(c.render(&msgs, true, opts.enable_thinking)?)
            }
        }
    }

    /// Ids that end the assistant's turn (Harmony: `<|return|>`, `<|call|>`; ChatML:
    /// `<|im_end|>`, `<|endoftext|>`).
    pub fn stop_tokens(&self) -> Vec<TokenId> {
        match self {
            Self::Harmony(h) => h.stop_tokens_for_assistant_actions().to_vec(),
            Self::ChatMl(c) => c.stop_tokens(),
        }
    }

    /// A parser for the ids generated after [`ChatFormat::render_prompt`].
    pub fn output_parser(&self) -> OutputParser {
        match self {
            Self::Harmony(h) => {
                OutputParser::Harmony(Box::new(h.parser(Some(harmony::Role::Assistant))))
            }
            Self::ChatMl(c) => {
                let tok = c.tokenizer();
                OutputParser::ChatMl {
                    tokenizer: tok.clone(),
                    think: tok.token_to_id("<think>"),
                    end_think: tok.token_to_id("</think>"),
                    in_think: false,
                    decoder: StreamDecoder::new(true),
                }
            }
        }
    }
}

/// A piece of streamed assistant output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputDelta {
    /// Reasoning text (Harmony `analysis`, Qwen `<think>`): show dimmed or hide.
    Reasoning(String),
    /// Answer text (Harmony `final`/`commentary`, Qwen after `</think>`).
    Content(String),
}

/// Turns generated ids into reasoning and answer text as they arrive (whole characters
/// only). Stop tokens produce nothing; the caller stops on [`ChatFormat::stop_tokens`].
#[derive(Debug)]
pub enum OutputParser {
    /// Harmony, through its streaming parser.
    Harmony(Box<harmony::StreamParser>),
    /// ChatML: `<think>`/`</think>` ids switch between reasoning and answer.
    ChatMl {
        /// The tokenizer.
        tokenizer: Arc<Tokenizer>,
        /// `<think>`, if the vocabulary has it.
        think: Option<TokenId>,
        /// `</think>`, if the vocabulary has it.
        end_think: Option<TokenId>,
        /// Inside a think block.
        in_think: bool,
        /// Text decoder (special tokens skipped).
        decoder: StreamDecoder,
    },
}

impl OutputParser {
    /// Harmony: the header being read, if any (see [`harmony::StreamParser::header_so_far`]).
    pub fn header_so_far(&self) -> Option<(&[TokenId], bool)> {
        match self {
            Self::Harmony(p) => p.header_so_far(),
            Self::ChatMl { .. } => None,
        }
    }

    /// Takes one generated id; returns the text it completes, if any.
    pub fn push(&mut self, id: TokenId) -> Result<Option<OutputDelta>, ChatError> {
        match self {
            Self::Harmony(p) => {
                let channel = p.current_channel().map(str::to_owned);
                Ok(match p.push(id)? {
                    Some(harmony::StreamEvent::Delta(d)) => {
                        Some(if channel.as_deref() == Some("analysis") {
                            OutputDelta::Reasoning(d.to_string())
                        } else {
                            OutputDelta::Content(d.to_string())
                        })
                    }
                    _ => None,
                })
            }
            Self::ChatMl {
                tokenizer,
                think,
                end_think,
                in_think,
                decoder,
            } => {
                if Some(id) == *think {
                    *in_think = true;
                    return Ok(None);
                }
                if Some(id) == *end_think {
                    *in_think = false;
                    return Ok(None);
                }
                let text = decoder.push(tokenizer, id)?;
                if text.is_empty() {
                    return Ok(None);
                }
                Ok(Some(if *in_think {
                    OutputDelta::Reasoning(text.to_string())
                } else {
                    OutputDelta::Content(text.to_string())
                }))
            }
        }
    }
}
