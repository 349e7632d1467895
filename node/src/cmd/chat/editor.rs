//! The terminal side of `stormo chat`: a line editor (rustyline) with history kept across
//! sessions, multi-line messages, and Ctrl-C that stops a reply without ending the chat.
//!
//! Owns: reading one message from a terminal, the history file, the state directory's
//! location ([`state_dir`]), and the flag Ctrl-C raises while a reply is generated
//! ([`Interrupt`]). Piped input does not come here: `stormo chat` reads it line by line as
//! before.
//!
//! - **Editing and history**: rustyline's emacs keys; Up/Down walk the history, which is
//!   saved to `STATE_DIR/chat_history` after every message (at most [`HISTORY_LEN`] entries).
//! - **Multi-line**: a line ending in `\` continues on the next (the backslash is dropped);
//!   a paste keeps its line breaks in one message (bracketed paste).
//! - **Ctrl-C**: at the prompt it clears the line (Ctrl-D leaves); while a reply is being
//!   generated the terminal is not in raw mode, so Ctrl-C is SIGINT: [`Interrupt`] turns it
//!   into a flag the reply loop checks after each token. A second Ctrl-C before the first is
//!   taken ends the program, so a stuck prefill can still be left.
//!
//! Why rustyline rather than reedline: it is the smaller of the two well-kept editors, has
//! file history, validation for multi-line input and bracketed paste, and no async runtime.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use rustyline::error::ReadlineError;
use rustyline::history::{FileHistory, History};
use rustyline::validate::{ValidationContext, ValidationResult, Validator};
use rustyline::{Config, Editor};

/// The most history entries kept.
pub const HISTORY_LEN: usize = 1000;

/// The name of the history file in the state directory.
pub const HISTORY_FILE: &str = "chat_history";

/// Where stormo keeps state between runs (history): `flag` when given, else
/// `$XDG_STATE_HOME/stormo` (when set to an absolute path), else `~/.local/state/stormo`;
/// `None` when there is no home either.
pub fn state_dir(flag: Option<&Path>) -> Option<PathBuf> {
    if let Some(f) = flag {
        return Some(f.to_path_buf());
    }
    let env = |k: &str| {
        std::env::var_os(k)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    if let Some(x) = env("XDG_STATE_HOME") {
        return Some(x.join("stormo"));
    }
    env("HOME").map(|h| h.join(".local/state/stormo"))
}

/// What the person did at the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A message or command (continuation backslashes removed).
    Line(String),
    /// Ctrl-C at the prompt: the line is dropped.
    Interrupted,
    /// Ctrl-D on an empty line: leave.
    Eof,
}

/// Joins the lines of a message continued with a trailing `\`.
pub fn join_continued(text: &str) -> String {
    text.replace("\\\r\n", "\n").replace("\\\n", "\n")
}

/// Continues a message whose last line ends in `\`.
#[derive(Debug, Default)]
struct Continuation;

impl Validator for Continuation {
    fn validate(&self, ctx: &mut ValidationContext<'_>) -> rustyline::Result<ValidationResult> {
        Ok(if ctx.input().ends_with('\\') {
            ValidationResult::Incomplete
        } else {
            ValidationResult::Valid(None)
        })
    }
}

impl rustyline::completion::Completer for Continuation {
    type Candidate = String;
}

impl rustyline::hint::Hinter for Continuation {
    type Hint = String;
}

impl rustyline::highlight::Highlighter for Continuation {}

impl rustyline::Helper for Continuation {}

/// A line editor with history.
pub struct LineEditor {
    editor: Editor<Continuation, FileHistory>,
    history: Option<PathBuf>,
}

impl std::fmt::Debug for LineEditor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineEditor")
            .field("history", &self.history)
            .finish_non_exhaustive()
    }
}

impl LineEditor {
    /// An editor on the terminal, with the history in `history` (loaded when the file exists;
    /// its folder made when saving). A history file that cannot be read is a warning.
    pub fn new(history: Option<PathBuf>) -> anyhow::Result<Self> {
        let config = Config::builder()
            .max_history_size(HISTORY_LEN)
            .context("history size")?
            .auto_add_history(false)
            .history_ignore_dups(true)
            .context("history settings")?
            .build();
        let mut editor =
            Editor::with_config(config).context("setting up the terminal's line editor")?;
        editor.set_helper(Some(Continuation));
        if let Some(p) = &history {
            if p.exists() {
                if let Err(e) = editor.load_history(p) {
                    tracing::warn!(
                        "cannot read the chat history {} ({e}): starting a new one",
                        p.display()
                    );
                }
            }
        }
        Ok(Self { editor, history })
    }

    /// Reads one message.
    pub fn read(&mut self, prompt: &str) -> anyhow::Result<Input> {
        match self.editor.readline(prompt) {
            Ok(line) => Ok(Input::Line(join_continued(&line))),
            Err(ReadlineError::Interrupted) => Ok(Input::Interrupted),
            Err(ReadlineError::Eof) => Ok(Input::Eof),
            Err(e) => Err(e).context("reading from the terminal"),
        }
    }

    /// Adds `line` to the history and saves it; a failure to save is a warning (once).
    pub fn remember(&mut self, line: &str) {
        if line.trim().is_empty() {
            return;
        }
        let _ = self.editor.add_history_entry(line);
        let Some(p) = &self.history else { return };
        let saved = p
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .map_err(|e| e.to_string())
            .and_then(|()| self.editor.save_history(p).map_err(|e| e.to_string()));
        if let Err(e) = saved {
            tracing::warn!(
                "cannot save the chat history to {} ({e}); history is kept for this session only",
                p.display()
            );
            self.history = None;
        }
    }

    /// Entries in the history.
    pub fn history_len(&self) -> usize {
        self.editor.history().len()
    }
}

/// Ctrl-C while a reply is generated: a flag set by SIGINT. Installed once; while it is,
/// SIGINT no longer ends the process unless the flag is already set (a second Ctrl-C).
#[derive(Debug, Clone)]
pub struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    /// Installs the SIGINT handler.
    pub fn install() -> anyhow::Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        #[cfg(unix)]
        {
            use signal_hook::consts::SIGINT;
            // First: a SIGINT while the flag is already set ends the process (exit code 130
            // is what a shell reports for SIGINT; signal-hook exits with the code given).
            signal_hook::flag::register_conditional_shutdown(SIGINT, 130, flag.clone())
                .context("installing the Ctrl-C handler")?;
            signal_hook::flag::register(SIGINT, flag.clone())
                .context("installing the Ctrl-C handler")?;
        }
        Ok(Self(flag))
    }

    /// Clears the flag (before a reply).
    pub fn clear(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// Whether Ctrl-C was pressed since the last [`Self::clear`].
    pub fn raised(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// The flag itself.
    pub fn flag(&self) -> &AtomicBool {
        &self.0
    }

    /// The flag, shared (for the engine, which checks it between layers of a prompt).
    pub fn shared(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continued_lines_join_without_their_backslashes() {
        assert_eq!(join_continued("one\\\ntwo\\\nthree"), "one\ntwo\nthree");
        assert_eq!(join_continued("a \\ b"), "a \\ b");
        assert_eq!(join_continued("pasted\nlines"), "pasted\nlines");
    }

    #[test]
    fn the_state_dir_follows_the_flag_then_xdg() {
        assert_eq!(
            state_dir(Some(Path::new("/tmp/s"))),
            Some(PathBuf::from("/tmp/s"))
        );
        // The environment is the process's; only check the shape of the default.
        if let Some(d) = state_dir(None) {
            assert!(d.ends_with("stormo"), "{}", d.display());
        }
    }
}
