//! Context shift: a conversation that no longer fits its context drops its oldest turns.
//!
//! Owns the choice of which turns a full conversation still renders: the system turns at the
//! start (and the chat format's own preamble, which every render begins with) are always
//! kept; after them, the oldest whole exchanges (a user turn and the turns that answer it, up
//! to the next user turn) are dropped, oldest first, until the prompt fits a budget or only
//! the last exchange is left. Turns are never cut in the middle: a half-rendered message
//! would read to the model as a different message.
//!
//! The kept preamble is rendered exactly as before, so a [`crate::session::ChatSession`]
//! reuses its cache up to the first dropped turn and recomputes the rest (the positions of
//! everything after it moved; nothing is re-rotated in place).
//!
//! Non-goals: summarizing what was dropped; keeping the dropped turns (the caller keeps the
//! whole conversation and renders `turns[..keep]` followed by `turns[start..]`).

use super::{ChatError, ChatFormat, PromptOptions, TokenId, Turn, TurnRole};

/// The turns a conversation renders after a shift, and what the shift dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// The first turn after the kept ones that is rendered: the prompt is
    /// `turns[..keep]` followed by `turns[start..]`.
    pub start: usize,
    /// The rendered prompt.
    pub prompt: Vec<TokenId>,
    /// Turns dropped by this shift (`start` minus the start it was given).
    pub dropped_turns: usize,
    /// Tokens the prompt lost by this shift.
    pub dropped_tokens: usize,
}

/// The turns `turns[..keep]` then `turns[start..]`.
pub fn window(turns: &[Turn], keep: usize, start: usize) -> Vec<Turn> {
    let keep = keep.min(turns.len());
    let start = start.clamp(keep, turns.len());
    turns[..keep]
        .iter()
        .chain(&turns[start..])
        .cloned()
        .collect()
}

/// Leading system (or developer) turns: the ones a shift always keeps.
pub fn system_turns(turns: &[Turn]) -> usize {
    turns
        .iter()
        .take_while(|t| matches!(t.role, TurnRole::System | TurnRole::Developer))
        .count()
}

/// Renders `turns[..keep]` then `turns[start..]` and, while the prompt has more than `budget`
/// tokens, moves `start` past the oldest whole exchange (to the next user turn), never past
/// the last user turn. The prompt may still exceed `budget` when only the last exchange is
/// left: the caller decides whether it fits at all.
pub fn shift_to_fit(
    format: &ChatFormat,
    turns: &[Turn],
    keep: usize,
    start: usize,
    opts: &PromptOptions,
    budget: usize,
) -> Result<Window, ChatError> {
    let keep = keep.min(turns.len());
    let first = start.clamp(keep, turns.len());
    let render = |s: usize| format.render_prompt(&window(turns, keep, s), opts);
    let full = render(first)?;
    let full_len = full.len();
    let last_user = turns
        .iter()
        .rposition(|t| t.role == TurnRole::User)
        .filter(|&i| i >= first);
    let mut at = first;
    let mut prompt = full;
    while prompt.len() > budget {
        // The next exchange starts at the next user turn after `at`.
        let Some(next) = (at + 1..turns.len()).find(|&i| turns[i].role == TurnRole::User) else {
            break;
        };
        if last_user.is_some_and(|l| next > l) {
            break;
        }
        at = next;
        prompt = render(at)?;
    }
    Ok(Window {
        start: at,
        dropped_turns: at - first,
        dropped_tokens: full_len.saturating_sub(prompt.len()),
        prompt,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::session::common_prefix;
    use crate::Tokenizer;

    fn harmony() -> ChatFormat {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/o200k-harmony/tokenizer.json");
        let tok = Tokenizer::from_file(&path).expect("the o200k fixture loads");
        ChatFormat::for_family(stormo_engine::Family::GptOss, Arc::new(tok)).expect("harmony")
    }

    fn talk() -> Vec<Turn> {
        let mut turns = vec![Turn::new(TurnRole::System, "Answer in French.")];
        for i in 0..4 {
            turns.push(Turn::new(
                TurnRole::User,
                format!("Question {i}: tell me a long story about the number {i}."),
            ));
            turns.push(Turn {
                reasoning: Some(format!("They ask about {i}.")),
                ..Turn::new(
                    TurnRole::Assistant,
                    format!("Il était une fois le nombre {i}."),
                )
            });
        }
        turns.push(Turn::new(TurnRole::User, "And the last one?"));
        turns
    }

    /// The shift keeps the system turn and the format's preamble (the new prompt starts with
    /// the tokens of the old one up to the first dropped turn), drops whole exchanges from the
    /// oldest, and the prompt that remains is exactly the render of the system turn and the
    /// remaining turns.
    #[test]
    fn a_shift_keeps_the_system_prompt_and_drops_the_oldest_exchanges() {
        let f = harmony();
        let turns = talk();
        let opts = PromptOptions::default();
        let keep = system_turns(&turns);
        assert_eq!(keep, 1);
        let full = f.render_prompt(&turns, &opts).expect("render");
        let last_two = [&turns[..1], &turns[5..]].concat();
        let want = f.render_prompt(&last_two, &opts).expect("render");
        // A budget that the last two exchanges (and the current message) fit, not three.
        let w = shift_to_fit(&f, &turns, keep, keep, &opts, want.len()).expect("shift");
        assert_eq!(w.start, 5);
        assert_eq!(w.dropped_turns, 4);
        assert_eq!(w.prompt, want);
        assert_eq!(w.dropped_tokens, full.len() - want.len());
        // The kept prefix: everything up to the first user turn renders as before.
        let system_only = f.render_prompt(&turns[..1], &opts).expect("render");
        let prefix = common_prefix(&full, &w.prompt);
        assert!(
            prefix + 4 >= system_only.len(),
            "{prefix} of {}",
            system_only.len()
        );
        assert_eq!(&w.prompt[..prefix], &full[..prefix]);
        let sys = f
            .tokenizer()
            .encode("Answer in French.", false)
            .expect("encode");
        assert!(
            w.prompt.windows(sys.len()).any(|x| x == sys),
            "the system prompt is kept"
        );
        // Enough room: nothing dropped.
        let w = shift_to_fit(&f, &turns, keep, keep, &opts, full.len()).expect("shift");
        assert_eq!((w.start, w.dropped_turns, w.dropped_tokens), (1, 0, 0));
        assert_eq!(w.prompt, full);
        // No room at all: everything but the last message goes, and the prompt may still be
        // over the budget (the caller refuses it).
        let w = shift_to_fit(&f, &turns, keep, keep, &opts, 1).expect("shift");
        assert_eq!(w.start, turns.len() - 1);
        let alone = [&turns[..1], &turns[turns.len() - 1..]].concat();
        assert_eq!(w.prompt, f.render_prompt(&alone, &opts).expect("render"));
        // A later shift starts from where the last one left off.
        let w2 = shift_to_fit(&f, &turns, keep, 3, &opts, 1).expect("shift");
        assert_eq!(
            (w2.start, w2.dropped_turns),
            (turns.len() - 1, turns.len() - 4)
        );
        assert_eq!(window(&turns, keep, 3).len(), turns.len() - 2);
    }
}
