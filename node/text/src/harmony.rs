//! GPT-OSS's Harmony chat format: conversations to token ids and generated ids back to
//! messages.
//!
//! A message is `<|start|>{role}[ to={recipient}][<|channel|>{channel}][ {content_type}]
//! <|message|>{content}<|end|>`; an assistant message to a tool ends with `<|call|>`
//! instead. A completion prompt ends with `<|start|>assistant`; the model then writes
//! `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…
//! <|return|>`. Generated `<|return|>` becomes `<|end|>` when the turn goes into history
//! (re-rendering parsed messages does that by construction; [`Harmony::to_history`] does it
//! on ids).
//!
//! Rendering follows the openai-harmony library token for token: each piece of text (role,
//! recipient, channel name, content) is encoded on its own with no special tokens recognized
//! in it, so message text cannot forge structure. Special ids come from the tokenizer by
//! name. Parsing follows its `StreamableParser` (strict mode): [`StreamParser`] takes one id
//! at a time and reports message starts, content deltas (whole characters only) and finished
//! messages, which is what a streaming chat needs.
//!
//! Non-goals: tool definitions in system/developer content (the TypeScript-like `# Tools`
//! sections) are not rendered; messages with a recipient and tool-role messages are.

use std::sync::Arc;

use super::tokenizer::{DecodeError, EncodeError, StreamDecoder, TokenId, Tokenizer};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The system header (model identity, reasoning effort, channels).
    System,
    /// The developer's instructions (what other APIs call the system prompt).
    Developer,
    /// The person.
    User,
    /// The model.
    Assistant,
    /// A tool's output; rendered under the tool's name.
    Tool,
}

impl Role {
    /// The role as written in a header.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::Developer => "developer",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }

    /// The role a header word names, if any.
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

/// How much the model thinks before answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ReasoningEffort {
    /// `Reasoning: low`.
    Low,
    /// `Reasoning: medium` (the default).
    #[default]
    Medium,
    /// `Reasoning: high`.
    High,
}

impl ReasoningEffort {
    /// As written in the system message.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }

    /// Parses `low`, `medium` or `high` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "low" => Some(Self::Low),
            "medium" => Some(Self::Medium),
            "high" => Some(Self::High),
            _ => None,
        }
    }
}

/// The content of the system message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemContent {
    /// First line, e.g. "You are ChatGPT, a large language model trained by OpenAI."
    pub model_identity: Option<String>,
    /// `Reasoning: …`.
    pub reasoning_effort: Option<ReasoningEffort>,
    /// `Knowledge cutoff: …`.
    pub knowledge_cutoff: Option<String>,
    /// `Current date: …` (the HF chat template always writes one; harmony's default has none).
    pub conversation_start_date: Option<String>,
    /// `# Valid channels: …` (not written when empty).
    pub valid_channels: Vec<String>,
    /// Appends "Channel must be included for every message."
    pub channel_required: bool,
}

impl Default for SystemContent {
    /// openai-harmony's `SystemContent::new()`.
    fn default() -> Self {
        Self {
            model_identity: Some(
                "You are ChatGPT, a large language model trained by OpenAI.".into(),
            ),
            reasoning_effort: Some(ReasoningEffort::Medium),
            knowledge_cutoff: Some("2024-06".into()),
            conversation_start_date: None,
            valid_channels: vec!["analysis".into(), "commentary".into(), "final".into()],
            channel_required: true,
        }
    }
}

impl SystemContent {
    /// The text it renders to.
    pub fn render(&self) -> String {
        let mut sections = Vec::new();
        let mut top = Vec::new();
        if let Some(id) = &self.model_identity {
            top.push(id.clone());
        }
        if let Some(c) = &self.knowledge_cutoff {
            top.push(format!("Knowledge cutoff: {c}"));
        }
        if let Some(d) = &self.conversation_start_date {
            top.push(format!("Current date: {d}"));
        }
        if !top.is_empty() {
            sections.push(top.join("\n"));
        }
        if let Some(e) = self.reasoning_effort {
            sections.push(format!("Reasoning: {}", e.as_str()));
        }
        if !self.valid_channels.is_empty() {
            let mut s = format!("# Valid channels: {}.", self.valid_channels.join(", "));
            if self.channel_required {
                s.push_str(" Channel must be included for every message.");
            }
            sections.push(s);
        }
        sections.join("\n\n")
    }
}

/// The content of a developer message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeveloperContent {
    /// Rendered under `# Instructions`.
    pub instructions: Option<String>,
}

impl DeveloperContent {
    /// The text it renders to.
    pub fn render(&self) -> String {
        match &self.instructions {
            Some(i) => format!("# Instructions\n\n{i}"),
            None => String::new(),
        }
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Only in system messages.
    System(SystemContent),
    /// Only in developer messages.
    Developer(DeveloperContent),
}

/// One Harmony message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its author's role.
    pub role: Role,
    /// The author's name (required for [`Role::Tool`], e.g. `functions.get_weather`).
    pub name: Option<String>,
    /// `to=…` (a tool call when the author is the assistant).
    pub recipient: Option<String>,
    /// `analysis`, `commentary`, `final`.
    pub channel: Option<String>,
    /// e.g. `json` or `<|constrain|>json`.
    pub content_type: Option<String>,
    /// The content parts, rendered one after another.
    pub content: Vec<Content>,
}

impl Message {
    /// A message with text content and no header extras.
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Self {
            role,
            name: None,
            recipient: None,
            channel: None,
            content_type: None,
            content: vec![Content::Text(text.into())],
        }
    }

    /// The system message.
    pub fn system(content: SystemContent) -> Self {
        Self {
            content: vec![Content::System(content)],
            ..Self::text(Role::System, "")
        }
    }

    /// A developer message with instructions.
    pub fn developer(instructions: impl Into<String>) -> Self {
        Self {
            content: vec![Content::Developer(DeveloperContent {
                instructions: Some(instructions.into()),
            })],
            ..Self::text(Role::Developer, "")
        }
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::text(Role::User, text)
    }

    /// An assistant message on a channel (`analysis`, `final`, …).
    pub fn assistant(channel: impl Into<String>, text: impl Into<String>) -> Self {
        Self {
            channel: Some(channel.into()),
            ..Self::text(Role::Assistant, text)
        }
    }

    /// The concatenated text parts.
    pub fn text_content(&self) -> String {
        self.content
            .iter()
            .filter_map(|c| match c {
                Content::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// How a conversation is rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderOptions {
    /// When the last assistant message is on `final`, leave out the `analysis` messages
    /// before the first `final` one (earlier chains of thought), as openai-harmony's
    /// `RenderConversationConfig::default()` does.
    pub drop_old_analysis: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self {
            drop_old_analysis: true,
        }
    }
}

/// A missing special token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarmonyError {
    /// The tokenizer lacks a token Harmony needs: not a Harmony vocabulary.
    #[error("the tokenizer has no {0} token: not a Harmony (o200k_harmony) vocabulary")]
    MissingToken(&'static str),
}

/// Why a conversation could not be rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RenderError {
    /// Text could not be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// A message is not well formed (system content outside a system message, a tool
    /// message without a name).
    #[error("cannot render message {index}: {what}")]
    Invalid {
        /// Its index in the conversation.
        index: usize,
        /// What is wrong.
        what: &'static str,
    },
}

/// Why generated ids could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseError {
    /// An id outside the vocabulary.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A token where the grammar does not allow it.
    #[error("unexpected token {token} while expecting {expected}")]
    Unexpected {
        /// The token.
        token: TokenId,
        /// What was expected.
        expected: &'static str,
    },
    /// A header that cannot be read.
    #[error("bad message header {header:?}: {what}")]
    Header {
        /// The header text.
        header: String,
        /// What is wrong.
        what: &'static str,
    },
    /// The ids ended inside a header.
    #[error("the ids end inside a message header")]
    EndInHeader,
}

/// What a generated token means for the generation loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenRole {
    /// Ordinary content or header token.
    Other,
    /// `<|end|>`: a message ended; the model goes on (analysis before final).
    EndOfMessage,
    /// `<|return|>`: the turn is done.
    Return,
    /// `<|call|>`: the turn stops for a tool call.
    Call,
}

/// The Harmony encoding over a tokenizer with the o200k_harmony special tokens.
#[derive(Debug, Clone)]
pub struct Harmony {
    tokenizer: Arc<Tokenizer>,
    start: TokenId,
    message: TokenId,
    end: TokenId,
    ret: TokenId,
    call: TokenId,
    channel: TokenId,
    constrain: TokenId,
}

impl Harmony {
    /// Looks up the special tokens by name.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, HarmonyError> {
        let id = |name: &'static str| {
            tokenizer
                .token_to_id(name)
                .ok_or(HarmonyError::MissingToken(name))
        };
        Ok(Self {
            start: id("<|start|>")?,
            message: id("<|message|>")?,
            end: id("<|end|>")?,
            ret: id("<|return|>")?,
            call: id("<|call|>")?,
            channel: id("<|channel|>")?,
            constrain: id("<|constrain|>")?,
            tokenizer,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Tokens that end a message when parsing: `<|return|>`, `<|call|>`, `<|end|>`
    /// (openai-harmony `stop_tokens()`).
    pub fn stop_tokens(&self) -> [TokenId; 3] {
        [self.ret, self.call, self.end]
    }

    /// Tokens that end an assistant turn during generation: `<|return|>`, `<|call|>`
    /// (`stop_tokens_for_assistant_actions()`). `<|end|>` is not one: after an analysis
    /// message the model goes on with the final one.
    pub fn stop_tokens_for_assistant_actions(&self) -> [TokenId; 2] {
        [self.ret, self.call]
    }

    /// What `id` means for a generation loop.
    pub fn token_role(&self, id: TokenId) -> TokenRole {
        match id {
            x if x == self.ret => TokenRole::Return,
            x if x == self.call => TokenRole::Call,
            x if x == self.end => TokenRole::EndOfMessage,
            _ => TokenRole::Other,
        }
    }

    /// Generated ids as they go into history: `<|return|>` becomes `<|end|>`.
    pub fn to_history(&self, ids: &mut [TokenId]) {
        for id in ids {
            if *id == self.ret {
                *id = self.end;
            }
        }
    }

    fn text_into(&self, text: &str, out: &mut Vec<TokenId>) -> Result<(), RenderError> {
        out.extend(self.tokenizer.encode_ordinary(text)?);
        Ok(())
    }

    /// Renders one message (`<|start|>…<|end|>` or `…<|call|>`).
    pub fn render_message_into(
        &self,
        index: usize,
        m: &Message,
        out: &mut Vec<TokenId>,
    ) -> Result<(), RenderError> {
        let invalid = |what| RenderError::Invalid { index, what };
        out.push(self.start);
        if m.role == Role::Tool {
            let name = m
                .name
                .as_deref()
                .ok_or(invalid("a tool message needs a name"))?;
            self.text_into(name, out)?;
        } else {
            self.text_into(m.role.as_str(), out)?;
            if let Some(name) = &m.name {
                self.text_into(&format!(":{name}"), out)?;
            }
        }
        if let Some(r) = m.recipient.as_deref().filter(|r| *r != "all") {
            self.text_into(&format!(" to={r}"), out)?;
        }
        if let Some(c) = &m.channel {
            out.push(self.channel);
            self.text_into(c, out)?;
        }
        if let Some(ct) = &m.content_type {
            if let Some(rest) = ct.strip_prefix("<|constrain|>") {
                self.text_into(" ", out)?;
                out.push(self.constrain);
                if !rest.is_empty() {
                    self.text_into(rest, out)?;
                }
            } else {
                self.text_into(&format!(" {ct}"), out)?;
            }
        }
        out.push(self.message);
        for c in &m.content {
            match c {
                Content::Text(t) => self.text_into(t, out)?,
                Content::System(s) => {
                    if m.role != Role::System {
                        return Err(invalid("system content outside a system message"));
                    }
                    self.text_into(&s.render(), out)?;
                }
                Content::Developer(d) => {
                    if m.role != Role::Developer {
                        return Err(invalid("developer content outside a developer message"));
                    }
                    self.text_into(&d.render(), out)?;
                }
            }
        }
        if m.role == Role::Assistant && m.recipient.is_some() {
            out.push(self.call);
        } else {
            out.push(self.end);
        }
        Ok(())
    }

    /// Renders a conversation (every message ends with `<|end|>`, or `<|call|>` for an
    /// assistant tool call).
    pub fn render_conversation(
        &self,
        messages: &[Message],
        opts: &RenderOptions,
    ) -> Result<Vec<TokenId>, RenderError> {
        let last_assistant_is_final = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Assistant)
            .is_some_and(|m| m.channel.as_deref() == Some("final"));
        let drop = opts.drop_old_analysis && last_assistant_is_final;
        let first_final = messages
            .iter()
            .position(|m| m.channel.as_deref() == Some("final"));
        let mut out = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let old_analysis = drop
                && first_final.is_some_and(|f| i < f)
                && m.channel.as_deref() == Some("analysis");
            if !old_analysis {
                self.render_message_into(i, m, &mut out)?;
            }
        }
        Ok(out)
    }

    /// Renders a conversation as a prompt for `next` to continue: the conversation, then
    /// `<|start|>{next}`.
    pub fn render_for_completion(
        &self,
        messages: &[Message],
        next: Role,
        opts: &RenderOptions,
    ) -> Result<Vec<TokenId>, RenderError> {
        let mut out = self.render_conversation(messages, opts)?;
        out.push(self.start);
        self.text_into(next.as_str(), &mut out)?;
        Ok(out)
    }

    /// Parses generated ids into messages. `role` is the role the prompt already opened
    /// (`Some(Role::Assistant)` after [`Harmony::render_for_completion`]); with `None` the ids
    /// must start with `<|start|>`. A message cut off by the end of the ids is returned with
    /// the content so far.
    pub fn parse_completion(
        &self,
        ids: &[TokenId],
        role: Option<Role>,
    ) -> Result<Vec<Message>, ParseError> {
        let mut p = self.parser(role);
        for &id in ids {
            p.push(id)?;
        }
        p.finish()?;
        Ok(p.into_messages())
    }

    /// A streaming parser (see [`StreamParser`]).
    pub fn parser(&self, role: Option<Role>) -> StreamParser {
        StreamParser {
            harmony: self.clone(),
            next_role: role,
            state: match role {
                Some(_) => State::Header(Vec::new()),
                None => State::ExpectStart,
            },
            messages: Vec::new(),
        }
    }

    /// Reads a decoded header: `{role}[ to={recipient}]<|channel|>{channel}[ {content_type}]`.
    fn parse_header(&self, mut h: String, role: Option<Role>) -> Result<Message, ParseError> {
        let bad = |header: &str, what| ParseError::Header {
            header: header.to_string(),
            what,
        };
        let original = h.clone();
        let mut channel = None;
        if let Some(idx) = h.find("<|channel|>") {
            let after = &h[idx + "<|channel|>".len()..];
            let end = after
                .find(|c: char| c.is_whitespace() || c == '<')
                .unwrap_or(after.len());
            if end == 0 {
                return Err(bad(&original, "channel marker without a channel"));
            }
            channel = Some(after[..end].to_string());
            h = format!("{}{}", &h[..idx], &after[end..]);
        }
        let mut h = h.trim().to_string();
        if h.contains("<|constrain|>") {
            h = h
                .replace("<|constrain|>", " <|constrain|>")
                .trim()
                .to_string();
        }
        let mut parts: Vec<&str> = h.split_ascii_whitespace().collect();
        let mut name = None;
        let role = match role {
            Some(r) => r,
            None => {
                let first = *parts.first().ok_or(bad(&original, "no role"))?;
                match Role::parse(first) {
                    Some(r) => r,
                    None if parts.len() > 1 || first.starts_with("to=") => {
                        // An unknown author with more header: a tool's output.
                        name = Some(first.to_string());
                        parts.remove(0);
                        Role::Tool
                    }
                    None => return Err(bad(&original, "unknown role")),
                }
            }
        };
        if parts.first() == Some(&role.as_str()) {
            parts.remove(0);
        }
        let mut recipient = None;
        let mut content_type = None;
        if let Some(last) = parts.pop() {
            let single = parts.is_empty();
            if let Some(r) = last.strip_prefix("to=") {
                recipient = Some(r.to_string());
            } else if single && !last.starts_with("<|constrain|>") {
                recipient = Some(last.to_string());
            } else {
                content_type = Some(last.to_string());
                if let Some(r) = parts.pop() {
                    recipient = Some(r.strip_prefix("to=").unwrap_or(r).to_string());
                }
            }
        }
        if !parts.is_empty() {
            return Err(bad(&original, "unexpected words in the header"));
        }
        Ok(Message {
            role,
            name,
            recipient,
            channel,
            content_type,
            content: Vec::new(),
        })
    }
}

/// Whether `text`, a header's ids so far decoded with their special tokens, can still grow
/// into a header GPT-OSS writes: `[role] [to=NAME] <|channel|>NAME [to=NAME] [<|constrain|>]
/// [TYPE]` (`role_known`: the role was given, as for a reply's first message). Only ASCII
/// words and those two special tokens, at most one channel, at most six words: a model that
/// leaves the format (random weights, a confused model) is seen at its first id that cannot
/// belong to a header, not after [`HELD_MAX`](crate::reply::HELD_MAX) ids.
pub fn header_prefix_ok(text: &str, role_known: bool) -> bool {
    let word_char = |c: char| c.is_ascii_alphanumeric() || "_.:=/-".contains(c);
    // Before the channel only a recipient may come (`to=NAME`; its last word may still be
    // growing into one), after the role word when the role is not known yet.
    let recipient_prefix = |w: &str| w.starts_with("to=") || "to=".starts_with(w);
    let (mut rest, mut channel, mut words) = (text, false, 0);
    let mut role_pending = !role_known;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("<|channel|>") {
            if channel || role_pending {
                return false;
            }
            (channel, rest) = (true, r);
            continue;
        }
        if let Some(r) = rest.strip_prefix("<|constrain|>") {
            if !channel {
                return false;
            }
            rest = r;
            continue;
        }
        if rest.starts_with("<|") {
            return false;
        }
        let end = rest.find("<|").unwrap_or(rest.len());
        for w in rest[..end].split(' ') {
            if w.is_empty() {
                continue;
            }
            if !w.chars().all(word_char) {
                return false;
            }
            words += 1;
            if role_pending {
                role_pending = false;
            } else if !channel && !recipient_prefix(w) {
                return false;
            }
        }
        rest = &rest[end..];
    }
    words <= 6
}

#[derive(Debug)]
enum State {
    ExpectStart,
    Header(Vec<TokenId>),
    Content {
        header: Message,
        text: String,
        decoder: StreamDecoder,
    },
}

/// What one token did to a [`StreamParser`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent<'a> {
    /// A header was read; content follows. The message has no content yet.
    MessageStart(&'a Message),
    /// Text of the current message (whole characters only).
    Delta(&'a str),
    /// The current message ended (by `<|end|>`, `<|return|>` or `<|call|>`).
    MessageDone(&'a Message),
}

/// Parses generated ids one at a time, like openai-harmony's `StreamableParser` (strict).
#[derive(Debug)]
pub struct StreamParser {
    harmony: Harmony,
    next_role: Option<Role>,
    state: State,
    messages: Vec<Message>,
}

impl StreamParser {
    /// Takes one id. Returns what it did, if anything visible.
    pub fn push(&mut self, id: TokenId) -> Result<Option<StreamEvent<'_>>, ParseError> {
        let h = &self.harmony;
        match &mut self.state {
            State::ExpectStart => {
                if id != h.start {
                    return Err(ParseError::Unexpected {
                        token: id,
                        expected: "<|start|>",
                    });
                }
                self.state = State::Header(Vec::new());
                Ok(None)
            }
            State::Header(tokens) => {
                if id != h.message {
                    tokens.push(id);
                    return Ok(None);
                }
                let text = h.tokenizer.decode(tokens, false)?;
                let header = h.parse_header(text, self.next_role.take())?;
                self.state = State::Content {
                    header,
                    text: String::new(),
                    decoder: StreamDecoder::new(false),
                };
                match &self.state {
                    State::Content { header, .. } => Ok(Some(StreamEvent::MessageStart(header))),
                    _ => unreachable!("state was just set to Content"),
                }
            }
            State::Content { text, decoder, .. } => {
                if h.stop_tokens().contains(&id) {
                    self.finish_message();
                    let last = self.messages.last().expect("a message was just pushed");
                    return Ok(Some(StreamEvent::MessageDone(last)));
                }
                let start = text.len();
                text.push_str(decoder.push(&h.tokenizer, id)?);
                if text.len() == start {
                    return Ok(None);
                }
                match &self.state {
                    State::Content { text, .. } => Ok(Some(StreamEvent::Delta(&text[start..]))),
                    _ => unreachable!("state is Content"),
                }
            }
        }
    }

    /// The header being read, if the parser is inside one: its ids so far, and whether its
    /// role is already known (the first message of a reply, after the prompt's
    /// `<|start|>assistant`) rather than still to come as the header's first word.
    pub fn header_so_far(&self) -> Option<(&[TokenId], bool)> {
        match &self.state {
            State::Header(tokens) => Some((tokens, self.next_role.is_some())),
            _ => None,
        }
    }

    fn finish_message(&mut self) {
        if let State::Content {
            mut header,
            mut text,
            mut decoder,
        } = std::mem::replace(&mut self.state, State::ExpectStart)
        {
            text.push_str(&decoder.finish());
            header.content = vec![Content::Text(text)];
            self.messages.push(header);
        }
    }

    /// Ends the input: a message cut off in its content is kept with what it has; ending
    /// inside a header is an error.
    pub fn finish(&mut self) -> Result<(), ParseError> {
        match &self.state {
            State::ExpectStart => Ok(()),
            State::Header(_) => Err(ParseError::EndInHeader),
            State::Content { .. } => {
                self.finish_message();
                Ok(())
            }
        }
    }

    /// The channel of the message being read, if its header is done.
    pub fn current_channel(&self) -> Option<&str> {
        match &self.state {
            State::Content { header, .. } => header.channel.as_deref(),
            _ => None,
        }
    }

    /// The messages finished so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The finished messages.
    pub fn into_messages(self) -> Vec<Message> {
        self.messages
    }
}

#[cfg(test)]
mod tests {
    use super::header_prefix_ok;

    /// Headers GPT-OSS writes, and every prefix of them, pass; words or tokens no header has
    /// do not.
    #[test]
    fn header_prefixes() {
        for (h, role_known) in [
            ("<|channel|>analysis", true),
            ("<|channel|>final", true),
            (
                " to=functions.get_weather<|channel|>commentary <|constrain|>json",
                true,
            ),
            (
                "<|channel|>commentary to=functions.get_weather <|constrain|>json",
                true,
            ),
            ("assistant<|channel|>final", false),
            ("assistant to=functions.f<|channel|>commentary json", false),
        ] {
            for end in (0..=h.len()).filter(|&e| h.is_char_boundary(e)) {
                // Special tokens come whole: cut only outside them.
                let cut = &h[..end];
                if cut.rfind('<').is_some_and(|i| !cut[i..].contains("|>")) {
                    continue;
                }
                assert!(header_prefix_ok(cut, role_known), "{cut:?}");
            }
        }
        for (h, role_known) in [
            (" приводит", true),
            ("pack", true),
            ("hello world", false),
            ("<|channel|>final<|channel|>x", true),
            ("<|start|>", true),
            ("<|channel|>", false),
            ("<|constrain|>json", true),
            ("assistant pack<|channel|>final", false),
            ("<|channel|>final a b c d e f g", true),
            ("<|channel|>final\n", true),
        ] {
            assert!(!header_prefix_ok(h, role_known), "{h:?}");
        }
    }
}
