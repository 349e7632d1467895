//! A [`ChatSession`] in a file (`stormo chat --session FILE`): the engine's session file
//! ([`Session::save_to`]: magic, version, the model's identity and the settings the cache
//! depends on, checksums) whose caller's bytes are a JSON object with the ids of the cached
//! positions and what the caller keeps with them (the chat's transcript).
//!
//! A save writes a temporary file beside the target, syncs it, and renames it over the
//! target (then syncs the folder), so the file is always a whole session: the old one or the
//! new one, whenever the process stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use stormo_engine::{Model, Session};

use super::{ChatSession, TokenId};

/// The `format` field of the caller's bytes.
const FORMAT: &str = "stormo-chat-session";

/// Why a session file could not be written or used.
#[derive(Debug, thiserror::Error)]
#[error("session file {}: {reason}", path.display())]
pub struct SessionFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub reason: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    format: String,
    /// The ids whose keys and values are in the cache.
    cached: Vec<TokenId>,
    /// The caller's.
    chat: serde_json::Value,
}

impl ChatSession {
    /// Writes the session (the KV cache and the ids it holds) and `chat` (the caller's:
    /// the transcript) to `path`, replacing it atomically.
    pub fn save(&self, path: &Path, chat: &serde_json::Value) -> Result<(), SessionFileError> {
        let err = |reason: String| SessionFileError {
            path: path.to_path_buf(),
            reason,
        };
        let app = serde_json::to_vec(&Saved {
            format: FORMAT.into(),
            cached: self.cached.clone(),
            chat: chat.clone(),
        })
        .map_err(|e| err(e.to_string()))?;
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(".partial");
        let tmp = path.with_file_name(name);
        let write = || -> Result<(), String> {
            let file = std::fs::File::create(&tmp)
                .map_err(|e| format!("creating {}: {e}", tmp.display()))?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
            self.sess
                .save_to(&self.model, &app, &mut w)
                .map_err(|e| e.to_string())?;
            let file = w
                .into_inner()
                .map_err(|e| format!("writing it: {}", e.error()))?;
            file.sync_all().map_err(|e| format!("writing it: {e}"))?;
            std::fs::rename(&tmp, path)
                .map_err(|e| format!("renaming {} over it: {e}", tmp.display()))?;
            // The rename itself survives a crash once the folder is synced (best effort:
            // some filesystems cannot sync a folder).
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            if let Ok(d) = std::fs::File::open(dir.unwrap_or(Path::new("."))) {
                let _ = d.sync_all();
            }
            Ok(())
        };
        write().map_err(|reason| {
            let _ = std::fs::remove_file(&tmp);
            err(reason)
        })
    }

    /// The session saved in `path` by [`ChatSession::save`], for `model` in a session of
    /// `context` positions (as [`ChatSession::new`] makes), and the caller's value saved with
    /// it. Fails, naming what is wrong, when the file is not a whole session file of this
    /// model with these settings.
    pub fn restore(
        model: Arc<Model>,
        context: usize,
        path: &Path,
    ) -> Result<(Self, serde_json::Value), SessionFileError> {
        let err = |reason: String| SessionFileError {
            path: path.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        let mut r = std::io::BufReader::with_capacity(1 << 20, file);
        let (sess, app) =
            Session::load_from(&model, &mut r, context, context).map_err(|e| err(e.to_string()))?;
        let saved: Saved = serde_json::from_slice(&app).map_err(|e| {
            err(format!(
                "its conversation is not what stormo chat saves: {e}"
            ))
        })?;
        if saved.format != FORMAT {
            return Err(err(format!(
                "its conversation's format is {:?}, not {FORMAT:?}",
                saved.format
            )));
        }
        if saved.cached.len() != sess.position() {
            return Err(err(format!(
                "it holds {} positions but names {} ids",
                sess.position(),
                saved.cached.len()
            )));
        }
        let vocab = model.config().vocab_size;
        if let Some(id) = saved.cached.iter().find(|&&id| id as usize >= vocab) {
            return Err(err(format!(
                "id {id} is outside the model's vocabulary of {vocab}"
            )));
        }
        Ok((
            Self {
                model,
                sess,
                cached: saved.cached,
                interrupt: None,
            },
            saved.chat,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{FinishReason, GenerateOptions};
    use std::ops::ControlFlow;
    use std::sync::atomic::{AtomicBool, Ordering};
    use stormo_engine::sampling::SamplingParams;

    fn model() -> Arc<Model> {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gptoss-tiny-mxfp4");
        Arc::new(Model::load(&dir, &stormo_engine::LoadOptions::default()).expect("fixture"))
    }

    fn opts() -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: 6,
            stop: Vec::new(),
            sampling: SamplingParams {
                temperature: 0.8,
                seed: 5,
                ..SamplingParams::default()
            },
        }
    }

    fn turn(s: &mut ChatSession, prompt: &[TokenId]) -> crate::session::Generation {
        s.generate(prompt, &opts(), |_| ControlFlow::Continue(()))
            .expect("a turn")
    }

    /// Two turns in one session equal one turn, a save, a restore in a new session and the
    /// second turn there: the same ids, and the second turn reuses the restored cache.
    #[test]
    fn a_restored_session_continues_as_one_that_never_stopped() {
        let m = model();
        let first: Vec<TokenId> = (0..20).map(|i| (i * 13 + 2) % 900).collect();
        let mut whole = ChatSession::new(m.clone(), 96).unwrap();
        let g1 = turn(&mut whole, &first);
        let second = [&first[..], &g1.ids, &[11, 12, 13]].concat();
        let want = turn(&mut whole, &second);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.kv");
        let mut a = ChatSession::new(m.clone(), 96).unwrap();
        assert_eq!(turn(&mut a, &first).ids, g1.ids);
        a.save(&path, &serde_json::json!({"turns": 2}))
            .expect("saved");
        assert!(!dir.path().join("s.kv.partial").exists());
        let (mut b, chat) = ChatSession::restore(m.clone(), 96, &path).expect("restored");
        assert_eq!(chat, serde_json::json!({"turns": 2}));
        assert_eq!(b.cached(), a.cached());
        let got = turn(&mut b, &second);
        assert_eq!(got.ids, want.ids);
        assert_eq!(got.reused, first.len() + g1.ids.len() - 1);

        // Another context is a named error; so is a file that is not a session.
        let e = ChatSession::restore(m.clone(), 64, &path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("s.kv") && e.contains("context of 96"), "{e}");
        std::fs::write(&path, b"{}").unwrap();
        let e = ChatSession::restore(m, 96, &path).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
    }

    /// A raised interrupt flag stops the prompt: the turn ends with no ids, the cache is the
    /// one before the turn, and the next turn runs as if the stopped one never happened.
    #[test]
    fn an_interrupted_prompt_leaves_the_cache_as_before_the_turn() {
        let m = model();
        let first: Vec<TokenId> = (0..20).map(|i| (i * 7 + 1) % 900).collect();
        let mut s = ChatSession::new(m.clone(), 96).unwrap();
        let g1 = turn(&mut s, &first);
        let before = s.cached().to_vec();
        let flag = Arc::new(AtomicBool::new(true));
        s.set_interrupt(Some(flag.clone()));
        let second = [&first[..], &g1.ids, &[5, 6, 7]].concat();
        let g = turn(&mut s, &second);
        assert_eq!(g.finish, FinishReason::Cancelled);
        assert!(g.ids.is_empty());
        assert_eq!(s.cached(), &before[..]);
        assert_eq!(s.engine_session().position(), before.len());
        flag.store(false, Ordering::SeqCst);
        let mut fresh = ChatSession::new(m, 96).unwrap();
        turn(&mut fresh, &first);
        assert_eq!(turn(&mut s, &second).ids, turn(&mut fresh, &second).ids);
    }
}
