//! Generated ids to text as they arrive, for terminals and servers.
//!
//! A [`ReplyStream`] follows the chat format when there is one (Harmony channels, ChatML
//! think blocks) and decodes plain text otherwise. It never fails: a model that leaves the
//! format (a random-weight checkpoint, a confused model) has the rest of its output shown as
//! plain text (from the first id the format did not show), and an id the tokenizer does not
//! know shows as U+FFFD. "Leaves the format" means a parse error, a Harmony header that can
//! no longer become one ([`crate::harmony::header_prefix_ok`]: seen at the first id that
//! cannot belong to it, so a short reply and a long one are judged alike), or [`HELD_MAX`] ids
//! in a row that produce no text.

use std::sync::Arc;

use super::{ChatFormat, OutputDelta, OutputParser, StreamDecoder, TokenId, Tokenizer};

/// Ids in a row without text after which the output is taken to have left the format.
pub const HELD_MAX: usize = 48;

/// Turns generated ids into reasoning and answer text.
#[derive(Debug)]
pub struct ReplyStream {
    tokenizer: Arc<Tokenizer>,
    parser: Option<OutputParser>,
    plain: StreamDecoder,
    stop: Vec<TokenId>,
    /// Ids given to the parser since it last produced text.
    held: Vec<TokenId>,
}

impl ReplyStream {
    /// For output after a prompt rendered by `format`.
    pub fn chat(format: &ChatFormat) -> Self {
        Self {
            tokenizer: format.tokenizer().clone(),
            parser: Some(format.output_parser()),
            plain: StreamDecoder::new(true),
            stop: format.stop_tokens(),
            held: Vec::new(),
        }
    }

    /// For plain text (no template): special tokens are left out of the text.
    pub fn plain(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            parser: None,
            plain: StreamDecoder::new(true),
            stop: Vec::new(),
            held: Vec::new(),
        }
    }

    /// Takes one generated id; returns the text it completes, if any.
    pub fn push(&mut self, id: TokenId) -> Option<OutputDelta> {
        if self.stop.contains(&id) {
            return None;
        }
        if let Some(p) = &mut self.parser {
            self.held.push(id);
            match p.push(id) {
                Ok(Some(d)) => {
                    self.held.clear();
                    return Some(d);
                }
                Ok(None) if self.held.len() >= HELD_MAX => {
                    tracing::debug!("{HELD_MAX} ids without text: showing plain text");
                }
                Ok(None) => match p.header_so_far() {
                    Some((ids, role_known))
                        if !self.tokenizer.decode(ids, false).is_ok_and(|text| {
                            crate::harmony::header_prefix_ok(&text, role_known)
                        }) =>
                    {
                        tracing::debug!("a header that cannot be one: showing plain text");
                    }
                    _ => return None,
                },
                Err(e) => tracing::debug!("output leaves the chat format ({e}): plain text"),
            }
            self.parser = None;
            let held = std::mem::take(&mut self.held);
            let mut text = String::new();
            for id in held {
                text.push_str(&self.plain_piece(id));
            }
            return (!text.is_empty()).then_some(OutputDelta::Content(text));
        }
        let text = self.plain_piece(id);
        (!text.is_empty()).then_some(OutputDelta::Content(text))
    }

    fn plain_piece(&mut self, id: TokenId) -> String {
        if self.stop.contains(&id) {
            return String::new();
        }
        match self.plain.push(&self.tokenizer, id) {
            Ok(s) => s.to_string(),
            Err(_) => "\u{fffd}".into(),
        }
    }

    /// Ends the stream: bytes of an unfinished character, if any, as U+FFFD.
    pub fn finish(&mut self) -> Option<OutputDelta> {
        let rest = self.plain.finish();
        (!rest.is_empty()).then_some(OutputDelta::Content(rest))
    }
}
