//! `stormo chat --session FILE`: the conversation and its KV cache kept in a file, saved after
//! every turn and resumed by the next `stormo chat --session FILE`.
//!
//! The file is the engine's session file ([`stormo_engine::Session::save_to`]) written by
//! [`ChatSession::save`]: a magic, a version, the model's identity and the settings the cache
//! depends on, the cache, and this module's [`ChatState`] (the transcript in `/save`'s shape,
//! where the context shift got to, the turn count the sampler's seed follows, and, from
//! version 2 on, the sampling options, which a resumed chat takes unless given again). A save
//! replaces the file atomically. A file that cannot be resumed (another model, another
//! --context or 8-bit option, truncated, corrupt) is an error at start that says what is
//! wrong, and the file is left as it is: never a fresh session that would overwrite it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use stormo_engine::sampling::SamplingParams;
use stormo_text::session::ChatSession;
use stormo_text::{transcript, Turn};

/// The version of [`ChatState`] this build writes. Version 1 (no `version` field) had no
/// sampling options; it is still read.
pub const VERSION: u32 = 2;

fn version_1() -> u32 {
    1
}

/// What `stormo chat` keeps with the cache.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatState {
    /// [`VERSION`] when written by this build; absent (1) in the first.
    #[serde(default = "version_1")]
    pub version: u32,
    /// The sampling options the chat ran with (version 2 on).
    #[serde(default)]
    pub sampling: Option<SavedSampling>,
    /// The turns, as `/save` writes them.
    pub conversation: serde_json::Value,
    /// Turns from --system at the start (kept by /reset).
    pub system_turns: usize,
    /// The first turn after the system turns still rendered (the context shifts).
    pub start: usize,
    /// Turns run (the sampler's seed of a turn is --seed plus it).
    pub turn_no: u64,
}

/// The sampling options a session file keeps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedSampling {
    /// Temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Most likely tokens kept (0: all).
    pub top_k: usize,
    /// Penalty on tokens already seen (1: none).
    pub repetition_penalty: f32,
    /// The sampler's seed (each turn's is it plus the turn count).
    pub seed: u64,
}

impl From<&SamplingParams> for SavedSampling {
    fn from(p: &SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            repetition_penalty: p.repetition_penalty,
            seed: p.seed,
        }
    }
}

/// A conversation to go on with: read back from a session file, or a new one.
#[derive(Debug)]
pub struct Resumed {
    /// The sampling options the file was saved with (`None`: a new session, or a version 1
    /// file, which kept none).
    pub sampling: Option<SavedSampling>,
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
    if state.version > VERSION {
        return Err(bad(format!(
            "its conversation is version {}, written by a newer stormo (this one reads up to \
             version {VERSION})",
            state.version
        )));
    }
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
        sampling: state.sampling,
        sess,
        turns,
        system_turns: state.system_turns,
        start: state.start,
        turn_no: state.turn_no,
    })
}

impl ChatState {
    /// The state of a conversation of `turns` with `model_name` (as `/save` writes it), its
    /// first `system_turns` from --system, shifted to turn `start`, after `turn_no` turns run,
    /// sampled with `sampling`: what this build saves.
    pub fn now(
        model_name: &str,
        turns: &[Turn],
        system_turns: usize,
        start: usize,
        turn_no: u64,
        sampling: &SamplingParams,
    ) -> Self {
        Self {
            version: VERSION,
            sampling: Some(sampling.into()),
            conversation: transcript::to_json(model_name, turns),
            system_turns,
            start,
            turn_no,
        }
    }
}

/// Checks, before any work, that a session can be saved to `path`: it is not a folder, and its
/// folder exists and takes a new file (the save's temporary file beside `path`, made and
/// removed). The error names the path and what is wrong.
pub fn check_writable(path: &Path) -> anyhow::Result<()> {
    let shown = path.display();
    anyhow::ensure!(
        !path.is_dir(),
        "--session {shown} is a folder: give a file name (a new one, or a saved session)"
    );
    let name = path
        .file_name()
        .ok_or_else(|| anyhow::anyhow!("--session {shown}: give a file name"))?;
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(folder) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => anyhow::bail!("--session {shown}: {} is not a folder", folder.display()),
        Err(e) => anyhow::bail!(
            "--session {shown}: its folder {} cannot be used ({e}); create it, or give a file \
             in a folder that exists",
            folder.display()
        ),
    }
    // The name the save writes before it renames (stormo_text's session persist).
    let mut probe = name.to_os_string();
    probe.push(".partial");
    let probe = path.with_file_name(probe);
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&probe);
    match made {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => anyhow::bail!(
            "--session {shown}: cannot write in its folder {} ({e}); give a file in a folder \
             you can write in",
            folder.display()
        ),
    }
}

/// Saves `state` and `sess`'s cache to `path`.
pub fn save(path: &Path, sess: &ChatSession, state: &ChatState) -> anyhow::Result<()> {
    sess.save(path, &serde_json::to_value(state)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue: `chat --session` in a folder that does not exist ran every turn and lost them
    /// all. Such a path, or a folder given as FILE, is refused before any work, naming the
    /// path; a new file in a folder that exists passes and leaves nothing behind.
    #[test]
    fn a_session_that_cannot_be_saved_is_refused_up_front() {
        let dir = tempfile::tempdir().expect("temp dir");
        let missing = dir.path().join("nope").join("s.kv");
        let e = format!("{:#}", check_writable(&missing).expect_err("no folder"));
        assert!(
            e.contains(&missing.display().to_string()) && e.contains("create it"),
            "{e}"
        );
        let e = format!("{:#}", check_writable(dir.path()).expect_err("a folder"));
        assert!(e.contains("is a folder"), "{e}");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").expect("write");
        let e = format!(
            "{:#}",
            check_writable(&file.join("s.kv")).expect_err("a file")
        );
        assert!(e.contains("is not a folder"), "{e}");
        let fine = dir.path().join("s.kv");
        check_writable(&fine).expect("a new file in a folder that exists");
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("list").collect();
        assert_eq!(left.len(), 1, "only `file` is left: {left:?}");
    }

    /// A version 1 state (no version, no sampling) still reads; this build writes version 2
    /// with the sampling options; a newer version is refused by `resume`.
    #[test]
    fn chat_state_reads_version_1_and_writes_version_2() {
        let v1 = serde_json::json!({
            "conversation": [], "system_turns": 0, "start": 0, "turn_no": 3
        });
        let s: ChatState = serde_json::from_value(v1).unwrap();
        assert_eq!((s.version, s.sampling, s.turn_no), (1, None, 3));
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_p: 0.9,
            repetition_penalty: 1.0,
            seed: 3,
        };
        let v2 = ChatState {
            version: VERSION,
            sampling: Some((&p).into()),
            ..s
        };
        let back: ChatState = serde_json::from_value(serde_json::to_value(&v2).unwrap()).unwrap();
        assert_eq!(back.version, 2);
        assert_eq!(back.sampling, Some(SavedSampling::from(&p)));
    }
}
