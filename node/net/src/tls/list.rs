//! Files of node keys: the revocation list (`--revoked`) and the allow-list file
//! (`--allow-file`), one 64-hex key per line, re-read when they change.
//!
//! Goals: a node never starts on a list it cannot read, and once running a re-read never
//! drops a revocation in force: every line that holds a key applies, each that does not is
//! warned about by file and line, and a file that cannot be read at all keeps the last list.
//! Non-goals: deciding whom to admit ([`super::Admission`]), and watching the file (each
//! handshake asks, and [`super::LiveMembers`] asks every second).

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use anyhow::Context;
use stormo_manifests::PublicKey;

/// A file of node keys (one 64-hex key per line; blank lines and `#` comments skipped):
/// revoked keys (`--revoked`) or allowed ones (`--allow-file`), re-read whenever its
/// modification time or length changes (at each handshake, and every second by the watcher of
/// live connections, `super::LiveMembers`).
///
/// At [`Self::load`] the file must be readable and every line well formed (a node does not
/// start on a list it cannot read). A re-read applies every line that holds a key and warns
/// about each that does not, naming the file and the line: a typo on one line never keeps
/// the keys of the others out (nor in). A file that turns unreadable as a whole (removed,
/// over 1 MiB) is warned about and the last list kept, so a revocation in force is never
/// dropped by a failed read.
#[derive(Debug)]
pub struct RevokedList {
    path: PathBuf,
    state: Mutex<RevokedState>,
}

#[derive(Debug)]
struct RevokedState {
    stamp: Option<Stamp>,
    keys: HashSet<PublicKey>,
    /// Bumped each time a re-read changes `keys`.
    generation: u64,
}

/// The largest key list read: one key a line, 1 MiB holds about 16,000 keys; the cap keeps a
/// device or a runaway file from filling memory.
const MAX_KEY_FILE: u64 = 1 << 20;
/// Malformed lines of one re-read warned about one by one; the rest are counted.
const MAX_LINE_WARNINGS: usize = 10;

impl RevokedList {
    /// Reads `path` (it must be readable and well formed now: the first malformed line is an
    /// error naming the file and the line).
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let (stamp, keys, malformed) = read_key_file(path)?;
        if let Some(m) = malformed.first() {
            anyhow::bail!("{m}; give one 64-hex node key per line (`#` starts a comment)");
        }
        Ok(Self {
            path: path.to_path_buf(),
            state: Mutex::new(RevokedState {
                stamp: Some(stamp),
                keys,
                generation: 0,
            }),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the current list, re-reading the file first if it changed.
    pub fn with<R>(&self, f: impl FnOnce(&HashSet<PublicKey>) -> R) -> R {
        f(&self.current().keys)
    }

    /// How many times a re-read changed the list (re-reading the file first if it changed):
    /// whoever judged connections on the list judges them again when this moves.
    pub fn generation(&self) -> u64 {
        self.current().generation
    }

    /// The state, the file re-read first if its stamp changed.
    fn current(&self) -> std::sync::MutexGuard<'_, RevokedState> {
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = match file_stamp(&self.path) {
            Ok(stamp) => Some(stamp),
            // Gone or unreadable: said once, and the last list kept until it is back.
            Err(e) if st.stamp.is_some() => {
                tracing::warn!(
                    "{}: {e}; keeping the {} keys read before",
                    self.path.display(),
                    st.keys.len()
                );
                st.stamp = None;
                return st;
            }
            Err(_) => return st,
        };
        if now == st.stamp {
            return st;
        }
        match read_key_file(&self.path) {
            Ok((stamp, keys, malformed)) => {
                for m in malformed.iter().take(MAX_LINE_WARNINGS) {
                    tracing::warn!("{m}: line skipped, the file's other keys apply");
                }
                if malformed.len() > MAX_LINE_WARNINGS {
                    tracing::warn!(
                        "{}: {} more malformed lines skipped",
                        self.path.display(),
                        malformed.len() - MAX_LINE_WARNINGS
                    );
                }
                tracing::info!("{}: re-read, {} node keys", self.path.display(), keys.len());
                st.stamp = Some(stamp);
                if keys != st.keys {
                    st.keys = keys;
                    st.generation += 1;
                }
            }
            Err(e) => {
                tracing::warn!(
                    "{}; keeping the {} keys read before",
                    crate::error_message(&e),
                    st.keys.len()
                );
                st.stamp = now;
            }
        }
        st
    }
}

/// What tells a changed file: its modification time and length.
type Stamp = (SystemTime, u64);

fn file_stamp(path: &Path) -> std::io::Result<Stamp> {
    let m = std::fs::metadata(path)?;
    Ok((m.modified()?, m.len()))
}

/// A line of a key file that holds no key.
#[derive(Debug)]
struct Malformed {
    path: PathBuf,
    line: usize,
    error: stormo_manifests::keys::KeyError,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} line {}: not a node key ({})",
            self.path.display(),
            self.line,
            self.error
        )
    }
}

/// The file's stamp (taken before reading, so a write during the read shows as a change next
/// time), the keys of its well-formed lines, and its malformed lines. Fails only when the file
/// cannot be read at all.
fn read_key_file(path: &Path) -> anyhow::Result<(Stamp, HashSet<PublicKey>, Vec<Malformed>)> {
    let stamp = file_stamp(path).with_context(|| format!("{}", path.display()))?;
    let bytes = stormo_manifests::read_small_file(path, MAX_KEY_FILE)
        .with_context(|| format!("{}", path.display()))?;
    // Lossy: a line with bytes that are not UTF-8 is one malformed line, not a failed file.
    let text = String::from_utf8_lossy(&bytes);
    let (mut keys, mut malformed) = (HashSet::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        match line.parse::<PublicKey>() {
            Ok(k) => {
                keys.insert(k);
            }
            Err(error) => malformed.push(Malformed {
                path: path.to_path_buf(),
                line: i + 1,
                error,
            }),
        }
    }
    Ok((stamp, keys, malformed))
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    use stormo_manifests::SecretKey;

    /// A list is re-read when its file's modification time or length changes, and only then
    /// (one `stat` per handshake, not a read): a rewrite that keeps both is not seen until the
    /// time moves.
    #[test]
    fn a_list_is_re_read_only_when_its_stamp_changes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("allowed");
        let a = SecretKey::from_seed(&[43; 32]).public();
        let b = SecretKey::from_seed(&[44; 32]).public();
        std::fs::write(&path, format!("{a}\n")).expect("write");
        let stamp = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .expect("modification time");
        let list = RevokedList::load(&path).expect("loads");
        assert!(list.with(|s| s.contains(&a)));
        // Same length, same time: not re-read.
        std::fs::write(&path, format!("{b}\n")).expect("rewrite");
        let f = std::fs::File::options()
            .write(true)
            .open(&path)
            .expect("open");
        f.set_modified(stamp).expect("set the time back");
        drop(f);
        assert!(
            list.with(|s| s.contains(&a) && !s.contains(&b)),
            "an unchanged stamp re-read the file"
        );
        // The time moves: re-read.
        let f = std::fs::File::options()
            .write(true)
            .open(&path)
            .expect("open");
        f.set_modified(stamp + Duration::from_secs(2))
            .expect("move the time");
        drop(f);
        assert!(list.with(|s| s.contains(&b) && !s.contains(&a)));
    }

    /// Issue 58 (5): a re-read with malformed lines applies every line that holds a key and
    /// warns about each other one by file and line, where it used to keep the old list whole
    /// (so a key revoked beside a typo was still admitted); a file that cannot be read keeps
    /// the last list; at the start a malformed line is an error naming the file and the line.
    #[test]
    fn a_re_read_applies_every_valid_line_and_warns_about_each_malformed_one() {
        let (logs, _guard) = crate::tls::tests::Logs::warnings();
        let take = || logs.take();
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("revoked");
        let [a, b, c] = [45u8, 46, 47].map(|s| SecretKey::from_seed(&[s; 32]).public());

        std::fs::write(&path, format!("{a}\n{a}x\n")).expect("write");
        let e = RevokedList::load(&path).expect_err("a malformed line at the start");
        let e = crate::error_message(&e);
        assert!(
            e.contains(&format!("{} line 2: not a node key", path.display())),
            "{e}"
        );

        std::fs::write(&path, format!("{a}\n")).expect("write");
        let list = RevokedList::load(&path).expect("loads");
        assert_eq!(list.generation(), 0);
        // A typo on line 2, a key on line 3, bytes that are not UTF-8 on line 5, a comment.
        let mut text = format!("# revoked\n{b}0\n{b}  # typo above\n\n").into_bytes();
        text.extend_from_slice(b"\xff\xfe\n");
        text.extend_from_slice(format!("{c}\n").as_bytes());
        std::fs::write(&path, text).expect("rewrite");
        assert_eq!(list.with(Clone::clone), [b, c].into());
        assert_eq!(list.generation(), 1);
        let log = take();
        for line in [2, 5] {
            let want = format!("{} line {line}: not a node key", path.display());
            assert!(log.contains(&want), "no warning {want:?}:\n{log}");
        }
        assert!(!log.contains("line 3"), "{log}");

        // Removed: the last list stays, with one warning; nothing changed for the watchers.
        std::fs::remove_file(&path).expect("remove");
        assert_eq!(list.with(Clone::clone), [b, c].into());
        assert_eq!(list.generation(), 1);
        let log = take();
        assert!(
            log.contains(&format!("{}: ", path.display()))
                && log.contains("keeping the 2 keys read before"),
            "{log}"
        );
        assert_eq!(list.with(Clone::clone), [b, c].into());
        assert_eq!(take(), "", "the missing file was warned about twice");
        std::fs::write(&path, format!("{a}\n")).expect("write again");
        assert_eq!(list.with(Clone::clone), [a].into());
        assert_eq!(list.generation(), 2);

        // Many malformed lines: the first ten are named, the rest counted.
        let mut many: String = (0..25).map(|i| format!("bad{i}\n")).collect();
        many.push_str(&format!("{c}\n"));
        std::fs::write(&path, many).expect("write");
        take();
        assert_eq!(list.with(Clone::clone), [c].into());
        let log = take();
        assert_eq!(log.matches("not a node key").count(), 10, "{log}");
        assert!(log.contains("15 more malformed lines"), "{log}");
    }
}
