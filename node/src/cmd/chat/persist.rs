//! `stormo chat --session FILE`: the conversation and its KV cache kept in a file, saved after
//! every turn and resumed by the next `stormo chat --session FILE`.
//!
//! The file is the engine's session file ([`stormo_engine::Session::save_to`]) written by
//! [`ChatSession::save`]: a magic, a version, the model's identity and the settings the cache
//! depends on, the cache, and this module's [`ChatState`] (the transcript in `/save`'s shape,
//! where the context shift got to, the turn count the sampler's seed follows). A save
//! replaces the file atomically. A file that cannot be resumed (another model, another
//! --context or 8-bit option, truncated, corrupt) is an error at start that says what is
//! wrong, and the file is left as it is: never a fresh session that would overwrite it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use stormo_text::session::ChatSession;
use stormo_text::{transcript, Turn};

/// What `stormo chat` keeps with the cache.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatState {
    /// The turns, as `/save` writes them.
    pub conversation: serde_json::Value,
    /// Turns from --system at the start (kept by /reset).
    pub system_turns: usize,
    /// The first turn after the system turns still rendered (the context shifts).
    pub start: usize,
    /// Turns run (the sampler's seed of a turn is --seed plus it).
    pub turn_no: u64,
}

/// A conversation to go on with: read back from a session file, or a new one.
#[derive(Debug)]
pub struct Resumed {
    /// The session, its cache restored.
    pub sess: ChatSession,
    /// The turns.
    pub turns: Vec<Turn>,
    /// [`ChatState::system_turns`].
    pub system_turns: usize,
    /// [`ChatState::start`].
    pub start: usize,
    /// [`ChatState::turn_no`].
    pub turn_no: u64,
}

/// Reads `path` for `model` and `context`; an error names the file and what is wrong.
pub fn resume(
    model: std::sync::Arc<stormo_engine::Model>,
    context: usize,
    path: &Path,
) -> anyhow::Result<Resumed> {
    let hint = || {
        format!(
            "cannot resume the chat from {} (give another --session FILE, or remove it to \
             start over)",
            path.display()
        )
    };
    let (sess, chat) = ChatSession::restore(model, context, path)
        .map_err(anyhow::Error::from)
        .map_err(|e| e.context(hint()))?;
    let bad = |reason: String| {
        anyhow::anyhow!("session file {}: {reason}", path.display()).context(hint())
    };
    let state: ChatState = serde_json::from_value(chat).map_err(|e| {
        bad(format!(
            "its conversation is not what stormo chat saves: {e}"
        ))
    })?;
    let turns = transcript::from_json(state.conversation)
        .map_err(|e| bad(format!("its conversation: {e}")))?;
    if state.system_turns > state.start || state.start > turns.len() {
        return Err(bad(format!(
            "its conversation's bounds ({} system turns, shifted to turn {}) do not fit its {} \
             turns",
            state.system_turns,
            state.start,
            turns.len()
        )));
    }
    Ok(Resumed {
        sess,
        turns,
        system_turns: state.system_turns,
        start: state.start,
        turn_no: state.turn_no,
    })
}

/// Saves the conversation and `sess`'s cache to `path`.
pub fn save(
    path: &Path,
    sess: &ChatSession,
    model_name: &str,
    turns: &[Turn],
    system_turns: usize,
    start: usize,
    turn_no: u64,
) -> anyhow::Result<()> {
    let state = ChatState {
        conversation: transcript::to_json(model_name, turns),
        system_turns,
        start,
        turn_no,
    };
    sess.save(path, &serde_json::to_value(state)?)?;
    Ok(())
}
