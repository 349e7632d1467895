//! Verifying a local checkpoint against its manifest, byte for byte.
//!
//! Every metadata file, every safetensors header (re-parsed and compared tensor by tensor),
//! every tensor, every expert record and every file's SHA-256 is checked, and each mismatch is
//! named in a [`Problem`]: which tensor or expert differs (and which chunks of the record),
//! which file is truncated or missing, which tensor is missing or moved. The files are read
//! through positioned reads only, so a damaged or truncated file is reported, never mapped.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::build::{MAX_META_LEN, META_FILES};
use crate::hash::{ExpertId, Hash};
use crate::hashing::{self, IoMode, Plan, Progress, Span, PENDING_BUDGET};
use crate::manifest::{Manifest, TensorDtype};

/// Upper bound on a safetensors header read for comparison.
const MAX_HEADER_LEN: u64 = 100 << 20;

/// How to verify.
#[derive(Clone, Copy, Debug, Default)]
pub struct VerifyOptions<'a> {
    /// Where to report progress, if anywhere.
    pub progress: Option<&'a Progress>,
    /// How the weight files are read.
    pub io: IoMode,
}

/// Why verification could not run at all (a mismatch is a [`Problem`], not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// The model folder does not exist or is not a folder.
    #[error("{}: not a model folder", path.display())]
    NotADirectory {
        /// The path given.
        path: PathBuf,
    },
}

/// One way the local checkpoint differs from its manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// A metadata file of the manifest is absent.
    MetaMissing {
        /// File name.
        name: String,
    },
    /// A metadata file's bytes differ.
    MetaDiffers {
        /// File name.
        name: String,
    },
    /// A metadata file (config, tokenizer...) is present but not in the manifest.
    MetaUnexpected {
        /// File name.
        name: String,
    },
    /// A weight file is absent or cannot be opened.
    FileMissing {
        /// File name.
        file: String,
        /// The operating system's reason.
        reason: String,
    },
    /// A safetensors file the manifest does not list, which the engine would load (the
    /// folder has no index and no `model.safetensors`, so every `*.safetensors` is loaded).
    FileUnexpected {
        /// File name.
        file: String,
    },
    /// A weight file is shorter than the manifest says.
    FileTruncated {
        /// File name.
        file: String,
        /// Length in the manifest.
        expected: u64,
        /// Length on disk.
        found: u64,
    },
    /// A weight file is longer than the manifest says.
    FileTooLong {
        /// File name.
        file: String,
        /// Length in the manifest.
        expected: u64,
        /// Length on disk.
        found: u64,
    },
    /// A read failed.
    FileUnreadable {
        /// File name.
        file: String,
        /// The reason.
        reason: String,
    },
    /// A weight file's SHA-256 differs although every tensor in it matches: the header or the
    /// padding changed.
    FileBytesDiffer {
        /// File name.
        file: String,
    },
    /// A safetensors header does not parse.
    HeaderInvalid {
        /// File name.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor of the manifest is not in its file's header.
    TensorMissing {
        /// Tensor name.
        name: String,
        /// The file that should hold it.
        file: String,
    },
    /// A header holds a tensor the manifest does not list.
    TensorUnexpected {
        /// Tensor name.
        name: String,
        /// The file that holds it.
        file: String,
    },
    /// A tensor's header entry (dtype, shape, offset, length or file) differs.
    TensorLayout {
        /// Tensor name.
        name: String,
        /// What differs.
        what: String,
    },
    /// A tensor's bytes differ.
    TensorDiffers {
        /// Tensor name.
        name: String,
        /// Its file.
        file: String,
    },
    /// A tensor's bytes could not be read (they lie past the end of a truncated file).
    TensorUnreadable {
        /// Tensor name.
        name: String,
        /// Its file.
        file: String,
    },
    /// An expert record's bytes differ.
    ExpertDiffers {
        /// The expert.
        id: ExpertId,
        /// The chunks that differ.
        chunks: Vec<u32>,
        /// The tensors whose bytes those chunks hold.
        tensors: Vec<String>,
    },
    /// An expert record could not be read in full.
    ExpertUnreadable {
        /// The expert.
        id: ExpertId,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MetaMissing { name } => write!(f, "metadata file {name} is missing"),
            Self::MetaDiffers { name } => write!(f, "metadata file {name} differs"),
            Self::MetaUnexpected { name } => {
                write!(f, "metadata file {name} is present but not in the manifest")
            }
            Self::FileMissing { file, reason } => write!(f, "file {file} is missing: {reason}"),
            Self::FileUnexpected { file } => write!(
                f,
                "file {file} is not in the manifest, and the engine would load it"
            ),
            Self::FileTruncated {
                file,
                expected,
                found,
            } => write!(
                f,
                "file {file} is truncated: {found} bytes, expected {expected} ({} missing)",
                expected - found
            ),
            Self::FileTooLong {
                file,
                expected,
                found,
            } => write!(
                f,
                "file {file} is too long: {found} bytes, expected {expected}"
            ),
            Self::FileUnreadable { file, reason } => {
                write!(f, "file {file} could not be read: {reason}")
            }
            Self::FileBytesDiffer { file } => write!(
                f,
                "file {file}: SHA-256 differs while every tensor matches (header or padding bytes changed)"
            ),
            Self::HeaderInvalid { file, reason } => {
                write!(f, "file {file}: safetensors header is invalid: {reason}")
            }
            Self::TensorMissing { name, file } => {
                write!(f, "tensor {name} is missing (expected in {file})")
            }
            Self::TensorUnexpected { name, file } => {
                write!(f, "tensor {name} in {file} is not in the manifest")
            }
            Self::TensorLayout { name, what } => write!(f, "tensor {name}: {what}"),
            Self::TensorDiffers { name, file } => {
                write!(f, "tensor {name} differs (bytes in {file})")
            }
            Self::TensorUnreadable { name, file } => write!(
                f,
                "tensor {name} could not be read (past the end of {file})"
            ),
            Self::ExpertDiffers {
                id,
                chunks,
                tensors,
            } => write!(
                f,
                "expert {id} (layer {}, expert {}) differs: chunk(s) {chunks:?}, in tensor(s) {}",
                id.layer,
                id.expert,
                tensors.join(", ")
            ),
            Self::ExpertUnreadable { id } => {
                write!(f, "expert {id} could not be read in full")
            }
        }
    }
}

/// The outcome of a verification.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// The manifest's model id.
    pub model_id: Hash,
    /// Tensors checked.
    pub tensors: usize,
    /// Expert records checked.
    pub experts: usize,
    /// Bytes of weight files checked.
    pub bytes: u64,
    /// Everything that differs; empty when the checkpoint is exactly the manifest's.
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    /// No problems.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks every byte of the checkpoint in `dir` against `manifest`.
pub fn verify(
    dir: &Path,
    manifest: &Manifest,
    opts: &VerifyOptions<'_>,
) -> Result<VerifyReport, VerifyError> {
    if !dir.is_dir() {
        return Err(VerifyError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    let mut problems = Vec::new();
    check_meta(dir, manifest, &mut problems);
    check_unlisted(dir, manifest, &mut problems);

    // Headers.
    let mut layout_bad = vec![false; manifest.tensors.len()];
    for (fi, wf) in manifest.files.iter().enumerate() {
        let path = dir.join(&wf.name);
        let Ok(found) = read_header(&path, wf.len) else {
            continue; // missing or unreadable: reported from the hashing pass
        };
        match found {
            Err(reason) => {
                problems.push(Problem::HeaderInvalid {
                    file: wf.name.clone(),
                    reason,
                });
                for (i, t) in manifest.tensors.iter().enumerate() {
                    if t.file as usize == fi {
                        layout_bad[i] = true;
                    }
                }
            }
            Ok(header) => compare_header(manifest, fi, &header, &mut layout_bad, &mut problems),
        }
    }

    let plan = Plan {
        dir: dir.to_path_buf(),
        files: manifest
            .files
            .iter()
            .map(|f| (f.name.clone(), f.len))
            .collect(),
        tensors: manifest
            .tensors
            .iter()
            .map(|t| Span {
                file: t.file as usize,
                offset: t.offset,
                len: t.len,
            })
            .collect(),
        experts: manifest
            .experts
            .iter()
            .map(|e| {
                e.parts
                    .iter()
                    .map(|p| Span {
                        file: manifest.tensors[p.tensor as usize].file as usize,
                        offset: p.offset,
                        len: p.len,
                    })
                    .collect()
            })
            .collect(),
        chunk_size: manifest.chunk_size,
        io: opts.io,
        pending_budget: PENDING_BUDGET,
    };
    let hashed = hashing::run(&plan, opts.progress);

    // Files.
    let mut file_gone = vec![false; manifest.files.len()];
    for (fi, (wf, out)) in manifest.files.iter().zip(&hashed.files).enumerate() {
        let file = wf.name.clone();
        match out.len {
            None => {
                file_gone[fi] = true;
                problems.push(Problem::FileMissing {
                    file,
                    reason: out.error.clone().unwrap_or_default(),
                });
                continue;
            }
            Some(found) if found < wf.len => problems.push(Problem::FileTruncated {
                file: file.clone(),
                expected: wf.len,
                found,
            }),
            Some(found) if found > wf.len => problems.push(Problem::FileTooLong {
                file: file.clone(),
                expected: wf.len,
                found,
            }),
            Some(_) => {}
        }
        if out.sha256.is_none() {
            problems.push(Problem::FileUnreadable {
                file,
                reason: out.error.clone().unwrap_or_default(),
            });
        }
    }

    // Tensors.
    let mut file_explained = vec![false; manifest.files.len()];
    for (i, (t, h)) in manifest.tensors.iter().zip(&hashed.tensors).enumerate() {
        let fi = t.file as usize;
        if file_gone[fi] {
            continue;
        }
        let file = manifest.files[fi].name.clone();
        if layout_bad[i] {
            file_explained[fi] = true;
            continue;
        }
        match h {
            None => {
                file_explained[fi] = true;
                problems.push(Problem::TensorUnreadable {
                    name: t.name.clone(),
                    file,
                });
            }
            Some(h) if *h != t.hash => {
                file_explained[fi] = true;
                problems.push(Problem::TensorDiffers {
                    name: t.name.clone(),
                    file,
                });
            }
            Some(_) => {}
        }
    }

    // Experts.
    for (e, h) in manifest.experts.iter().zip(&hashed.experts) {
        let in_gone_file = e
            .parts
            .iter()
            .any(|p| file_gone[manifest.tensors[p.tensor as usize].file as usize]);
        match h {
            None if in_gone_file => {}
            None => problems.push(Problem::ExpertUnreadable { id: e.id }),
            Some((hash, chunks)) if *hash != e.hash => {
                let bad: Vec<u32> = chunks
                    .iter()
                    .zip(&e.chunks)
                    .enumerate()
                    .filter(|(_, (a, b))| a != b)
                    .map(|(i, _)| i as u32)
                    .collect();
                let mut tensors: Vec<String> = Vec::new();
                for &c in &bad {
                    let Some(r) = e.chunk_range(manifest.chunk_size, c) else {
                        continue;
                    };
                    let mut at = 0u64;
                    for p in &e.parts {
                        let (lo, hi) = (at, at + p.len);
                        at = hi;
                        if lo < r.end && r.start < hi {
                            let name = &manifest.tensors[p.tensor as usize].name;
                            if !tensors.contains(name) {
                                tensors.push(name.clone());
                            }
                        }
                    }
                }
                problems.push(Problem::ExpertDiffers {
                    id: e.id,
                    chunks: bad,
                    tensors,
                });
            }
            Some(_) => {}
        }
    }

    // Whole-file hashes not explained by anything above.
    for (fi, (wf, out)) in manifest.files.iter().zip(&hashed.files).enumerate() {
        if let (Some(sha), Some(len)) = (out.sha256, out.len) {
            if sha != wf.sha256 && !file_explained[fi] && len == wf.len {
                problems.push(Problem::FileBytesDiffer {
                    file: wf.name.clone(),
                });
            }
        }
    }

    Ok(VerifyReport {
        model_id: manifest.model_id(),
        tensors: manifest.tensors.len(),
        experts: manifest.experts.len(),
        bytes: manifest.total_file_bytes(),
        problems,
    })
}

fn check_meta(dir: &Path, manifest: &Manifest, problems: &mut Vec<Problem>) {
    for m in &manifest.identity.meta {
        let path = dir.join(&m.name);
        // Read with a bound (a metadata file is small; a huge one or a directory in its
        // place simply differs).
        let bytes = match std::fs::metadata(&path) {
            Ok(_) => crate::read_small_file(&path, MAX_META_LEN).ok(),
            Err(_) => {
                problems.push(Problem::MetaMissing {
                    name: m.name.clone(),
                });
                continue;
            }
        };
        match bytes {
            Some(b) if b.len() as u64 == m.len && Hash::of(&b) == m.hash => {}
            _ => problems.push(Problem::MetaDiffers {
                name: m.name.clone(),
            }),
        }
    }
    for name in META_FILES {
        if !manifest.identity.meta.iter().any(|m| m.name == *name) && dir.join(name).is_file() {
            problems.push(Problem::MetaUnexpected {
                name: (*name).to_string(),
            });
        }
    }
}

/// Safetensors files the engine would load that the manifest does not list. With an index
/// (a metadata file, checked above) the index names the files; else `model.safetensors` alone
/// if present; else every `*.safetensors` in the folder.
fn check_unlisted(dir: &Path, manifest: &Manifest, problems: &mut Vec<Problem>) {
    if dir.join("model.safetensors.index.json").exists() {
        return;
    }
    let loaded: Vec<String> = if dir.join("model.safetensors").exists() {
        vec!["model.safetensors".to_string()]
    } else {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        let mut v: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        v.sort();
        v
    };
    for name in loaded {
        if !manifest.files.iter().any(|f| f.name == name) {
            problems.push(Problem::FileUnexpected { file: name });
        }
    }
}

/// One header entry, as the file holds it.
struct Entry {
    dtype: TensorDtype,
    shape: Vec<u64>,
    offset: u64,
    len: u64,
}

/// Reads and parses a file's safetensors header. Outer error: the file cannot be opened
/// (reported elsewhere); inner error: the header is invalid.
fn read_header(
    path: &Path,
    expected_len: u64,
) -> std::io::Result<Result<BTreeMap<String, Entry>, String>> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let mut n8 = [0u8; 8];
    if f.read_exact(&mut n8).is_err() {
        return Ok(Err(format!("file is {len} bytes, too short for a header")));
    }
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_LEN || 8 + n > len {
        return Ok(Err(format!(
            "header length {n} is implausible for a {len}-byte file"
        )));
    }
    let mut buf = vec![0u8; 8 + n as usize];
    buf[..8].copy_from_slice(&n8);
    if let Err(e) = f.read_exact(&mut buf[8..]) {
        return Ok(Err(format!("reading the header: {e}")));
    }
    // Judge tensor ranges against the length the file should have; truncation is reported
    // separately, with the tensors it cuts off.
    let judged = len.max(expected_len);
    Ok(
        match stormo_engine::safetensors::parse_header(path, &buf, judged, 0) {
            Err(e) => Err(e.to_string()),
            Ok(list) => Ok(list
                .into_iter()
                .map(|(name, t)| {
                    (
                        name,
                        Entry {
                            dtype: t.dtype.into(),
                            shape: t.shape.iter().map(|&d| d as u64).collect(),
                            offset: t.offset,
                            len: t.len,
                        },
                    )
                })
                .collect()),
        },
    )
}

fn compare_header(
    manifest: &Manifest,
    fi: usize,
    header: &BTreeMap<String, Entry>,
    layout_bad: &mut [bool],
    problems: &mut Vec<Problem>,
) {
    let file = &manifest.files[fi].name;
    let by_name: HashMap<&str, usize> = manifest
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    for (i, t) in manifest.tensors.iter().enumerate() {
        if t.file as usize != fi {
            continue;
        }
        let Some(h) = header.get(&t.name) else {
            layout_bad[i] = true;
            problems.push(Problem::TensorMissing {
                name: t.name.clone(),
                file: file.clone(),
            });
            continue;
        };
        let mut what = Vec::new();
        if h.dtype != t.dtype {
            what.push(format!("dtype is {}, expected {}", h.dtype, t.dtype));
        }
        if h.shape != t.shape {
            what.push(format!("shape is {:?}, expected {:?}", h.shape, t.shape));
        }
        if h.offset != t.offset || h.len != t.len {
            what.push(format!(
                "bytes at [{}, +{}), expected [{}, +{})",
                h.offset, h.len, t.offset, t.len
            ));
        }
        if !what.is_empty() {
            layout_bad[i] = true;
            problems.push(Problem::TensorLayout {
                name: t.name.clone(),
                what: what.join("; "),
            });
        }
    }
    for name in header.keys() {
        match by_name.get(name.as_str()) {
            Some(&i) if manifest.tensors[i].file as usize == fi => {}
            Some(&i) => {
                layout_bad[i] = true;
                problems.push(Problem::TensorLayout {
                    name: name.clone(),
                    what: format!(
                        "found in {file}, expected in {}",
                        manifest.files[manifest.tensors[i].file as usize].name
                    ),
                });
            }
            None => problems.push(Problem::TensorUnexpected {
                name: name.clone(),
                file: file.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    //! `verify` against a real checkpoint (the repository's tiny Qwen3-MoE fixture): a clean
    //! copy verifies, and each kind of damage is named. These guard the bytes in this crate's
    //! own tests (they were only reached through the CLI's integration tests, which a
    //! mutation run scoped to this crate does not run).

    use super::*;
    use crate::manifest::MIN_CHUNK_SIZE;

    /// A copy of the fixture's checkpoint (without the reference files) and its manifest.
    fn checkpoint() -> (tempfile::TempDir, Manifest) {
        checkpoint_of("qwen3moe-tiny")
    }

    /// A copy of fixture `name`'s checkpoint and its manifest.
    fn checkpoint_of(name: &str) -> (tempfile::TempDir, Manifest) {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures")
            .join(name);
        let dir = tempfile::tempdir().unwrap();
        for name in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(name), dir.path().join(name)).unwrap();
        }
        let m = crate::build::build_reference(dir.path(), MIN_CHUNK_SIZE).unwrap();
        (dir, m)
    }

    fn problems(dir: &Path, m: &Manifest) -> Vec<Problem> {
        verify(dir, m, &VerifyOptions::default()).unwrap().problems
    }

    fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
        let mut b = std::fs::read(path).unwrap();
        f(&mut b);
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn a_clean_checkpoint_verifies() {
        let (dir, m) = checkpoint();
        let p = problems(dir.path(), &m);
        assert!(p.is_empty(), "{p:?}");
        assert!(verify(dir.path(), &m, &VerifyOptions::default())
            .unwrap()
            .is_ok());
    }

    #[test]
    fn a_flipped_expert_byte_names_that_expert_and_chunk() {
        let (dir, m) = checkpoint();
        let e = &m.experts[m.experts.len() / 2];
        let id = e.id;
        // The first byte of the record: its first part's offset in the file.
        let at = usize::try_from(e.parts[0].offset).unwrap();
        edit(&dir.path().join("model.safetensors"), |b| b[at] ^= 0x40);
        let p = problems(dir.path(), &m);
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::ExpertDiffers { id: i, chunks, .. }
                if *i == id && !chunks.is_empty())),
            "{p:?}"
        );
        assert!(
            !p.iter()
                .any(|p| matches!(p, Problem::ExpertDiffers { id: i, .. } if *i != id)),
            "another expert was blamed: {p:?}"
        );
    }

    #[test]
    fn a_truncated_file_and_a_bad_header_are_named() {
        let (dir, m) = checkpoint();
        let path = dir.path().join("model.safetensors");
        let len = std::fs::metadata(&path).unwrap().len();
        edit(&path, |b| b.truncate(b.len() - 100));
        let p = problems(dir.path(), &m);
        assert!(
            p.iter().any(
                |p| matches!(p, Problem::FileTruncated { expected, found, .. }
                if *expected == len && *found == len - 100)
            ),
            "{p:?}"
        );
        let (dir, m) = checkpoint();
        let path = dir.path().join("model.safetensors");
        // A header length past the file.
        edit(&path, |b| {
            b[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes())
        });
        let p = problems(dir.path(), &m);
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::HeaderInvalid { reason, .. } if reason.contains("implausible"))),
            "{p:?}"
        );
    }

    #[test]
    fn changed_missing_and_unlisted_metadata_are_named() {
        let (dir, m) = checkpoint();
        edit(&dir.path().join("config.json"), |b| b.push(b' '));
        std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
        let p = problems(dir.path(), &m);
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::MetaDiffers { name } if name == "config.json")),
            "{p:?}"
        );
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::MetaUnexpected { name } if name == "tokenizer.json")),
            "{p:?}"
        );
        std::fs::remove_file(dir.path().join("config.json")).unwrap();
        let p = problems(dir.path(), &m);
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::MetaMissing { name } if name == "config.json")),
            "{p:?}"
        );
        assert!(matches!(
            verify(&dir.path().join("nope"), &m, &VerifyOptions::default()),
            Err(VerifyError::NotADirectory { .. })
        ));
    }

    /// Rewrites the safetensors header of `path` through `f` (as JSON), keeping the data bytes:
    /// tensors' offsets are relative to the data, so only a header edit changes them.
    fn edit_header(path: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
        let b = std::fs::read(path).unwrap();
        let n = usize::try_from(u64::from_le_bytes(b[..8].try_into().unwrap())).unwrap();
        let mut h: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&b[8..8 + n]).unwrap();
        f(&mut h);
        let mut text = serde_json::to_vec(&h).unwrap();
        // The same header length as before, padded with spaces as safetensors does, so the
        // data starts where it did.
        assert!(text.len() <= n, "the edited header grew past the old one");
        text.resize(n, b' ');
        let mut out = b[..8].to_vec();
        out.extend_from_slice(&text);
        out.extend_from_slice(&b[8 + n..]);
        std::fs::write(path, out).unwrap();
    }

    fn said(p: &[Problem]) -> Vec<String> {
        p.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_damaged_checkpoint_is_not_ok_and_its_problems_are_said_in_words() {
        let (dir, m) = checkpoint();
        let e = &m.experts[0];
        let at = usize::try_from(e.parts[0].offset).unwrap();
        edit(&dir.path().join("model.safetensors"), |b| b[at] ^= 1);
        let report = verify(dir.path(), &m, &VerifyOptions::default()).unwrap();
        assert!(!report.is_ok(), "a damaged checkpoint verified");
        assert_eq!(report.experts, m.experts.len());
        assert_eq!(report.tensors, m.tensors.len());
        let words = said(&report.problems);
        assert!(
            words.iter().any(|w| w.contains(&format!(
                "(layer {}, expert {}) differs: chunk(s) [0]",
                e.id.layer, e.id.expert
            ))),
            "{words:?}"
        );
        let truncated = Problem::FileTruncated {
            file: "a.safetensors".into(),
            expected: 10,
            found: 4,
        };
        assert_eq!(
            truncated.to_string(),
            "file a.safetensors is truncated: 4 bytes, expected 10 (6 missing)"
        );
    }

    #[test]
    fn a_bad_header_is_the_only_problem_named_for_its_file() {
        // The tensors of a file whose header is unreadable are not blamed one by one, nor is
        // the file's hash: the header explains them.
        let (dir, m) = checkpoint();
        edit(&dir.path().join("model.safetensors"), |b| {
            b[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes())
        });
        let p = problems(dir.path(), &m);
        assert!(
            matches!(&p[..], [Problem::HeaderInvalid { .. }]),
            "expected the header alone: {p:?}"
        );
    }

    #[test]
    fn a_file_too_long_is_named_with_both_lengths() {
        let (dir, m) = checkpoint();
        let path = dir.path().join("model.safetensors");
        let len = std::fs::metadata(&path).unwrap().len();
        edit(&path, |b| b.extend_from_slice(&[0; 3]));
        let p = problems(dir.path(), &m);
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::FileTooLong { expected, found, .. }
                if *expected == len && *found == len + 3)),
            "{p:?}"
        );
        assert!(
            !p.iter().any(|p| matches!(p, Problem::FileTruncated { .. })),
            "{p:?}"
        );
    }

    #[test]
    fn a_changed_dense_tensor_is_named_and_explains_the_file_hash() {
        let (dir, m) = checkpoint();
        let t = m
            .tensors
            .iter()
            .find(|t| t.name == "lm_head.weight")
            .unwrap();
        let at = usize::try_from(t.offset + 2).unwrap();
        edit(&dir.path().join("model.safetensors"), |b| b[at] ^= 0x10);
        let p = problems(dir.path(), &m);
        assert!(
            matches!(&p[..], [Problem::TensorDiffers { name, .. }] if name == "lm_head.weight"),
            "{p:?}"
        );
    }

    #[test]
    fn experts_cut_off_by_truncation_are_unreadable_but_a_missing_file_is_named_once() {
        let (dir, m) = checkpoint();
        let path = dir.path().join("model.safetensors");
        let last = m.experts.last().unwrap();
        let cut = last.parts.iter().map(|p| p.offset).min().unwrap();
        edit(&path, |b| b.truncate(usize::try_from(cut).unwrap()));
        let p = problems(dir.path(), &m);
        assert!(
            p.iter()
                .any(|p| matches!(p, Problem::ExpertUnreadable { id } if *id == last.id)),
            "{p:?}"
        );
        let (dir, m) = checkpoint();
        std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
        let p = problems(dir.path(), &m);
        assert!(
            matches!(&p[..], [Problem::FileMissing { file, .. }] if file == "model.safetensors"),
            "a missing file is one problem, not one per tensor or expert: {p:?}"
        );
    }

    #[test]
    fn a_damaged_chunk_names_exactly_the_tensors_that_overlap_it() {
        // GPT-OSS's bf16 fixture: a record of parts larger and smaller than a chunk, so chunk
        // boundaries meet part boundaries. A flipped byte names the tensors that share bytes
        // with its chunk: none before the chunk starts, none from where it ends.
        let (dir, m) = checkpoint_of("gptoss-tiny-bf16");
        let e = &m.experts[1];
        assert!(
            e.chunks.len() > 1,
            "the test wants a record of several chunks"
        );
        let cs = u64::from(m.chunk_size);
        // Flip one byte inside each part in turn (a fresh copy each time).
        let mut start = 0u64;
        for (pi, part) in e.parts.iter().enumerate() {
            let (copy, m2) = checkpoint_of("gptoss-tiny-bf16");
            let at = usize::try_from(part.offset).unwrap();
            edit(&copy.path().join("model.safetensors"), |b| b[at] ^= 0x20);
            let chunk = start / cs;
            let (c0, c1) = (chunk * cs, ((chunk + 1) * cs).min(e.len));
            let mut want: Vec<String> = Vec::new();
            let mut lo = 0u64;
            for q in &e.parts {
                let hi = lo + q.len;
                if lo.max(c0) < hi.min(c1) {
                    let name = m2.tensors[q.tensor as usize].name.clone();
                    if !want.contains(&name) {
                        want.push(name);
                    }
                }
                lo = hi;
            }
            let p = problems(copy.path(), &m2);
            let got: Vec<&Problem> = p
                .iter()
                .filter(|p| matches!(p, Problem::ExpertDiffers { id, .. } if *id == e.id))
                .collect();
            assert!(
                matches!(&got[..], [Problem::ExpertDiffers { chunks, tensors, .. }]
                    if *chunks == vec![u32::try_from(chunk).unwrap()] && *tensors == want),
                "part {pi} at record byte {start}: want chunk {chunk} naming {want:?}, got {got:?}"
            );
            start += part.len;
        }
        drop(dir);
    }

    #[test]
    fn a_metadata_file_changed_at_the_same_length_differs() {
        let (dir, m) = checkpoint();
        edit(&dir.path().join("config.json"), |b| {
            let i = b.iter().position(|c| c.is_ascii_digit()).unwrap();
            b[i] = if b[i] == b'7' { b'8' } else { b'7' };
        });
        let p = problems(dir.path(), &m);
        assert!(
            matches!(&p[..], [Problem::MetaDiffers { name }] if name == "config.json"),
            "{p:?}"
        );
    }

    #[test]
    fn header_bytes_that_change_no_tensor_are_named_by_the_file_hash() {
        // The header's own metadata, changed at the same length: every tensor and expert
        // matches, the file's SHA-256 does not.
        let (dir, m) = checkpoint();
        edit_header(&dir.path().join("model.safetensors"), |h| {
            h.insert("__metadata__".into(), serde_json::json!({"format": "px"}));
        });
        let p = problems(dir.path(), &m);
        assert!(
            matches!(&p[..], [Problem::FileBytesDiffer { file }] if file == "model.safetensors"),
            "{p:?}"
        );
    }

    #[test]
    fn a_weight_file_the_engine_would_load_but_the_manifest_does_not_list_is_named() {
        // Without an index and without model.safetensors, the engine loads every
        // *.safetensors of the folder.
        let (dir, m) = checkpoint();
        std::fs::rename(
            dir.path().join("model.safetensors"),
            dir.path().join("other.safetensors"),
        )
        .unwrap();
        let p = problems(dir.path(), &m);
        assert!(
            p.iter().any(
                |p| matches!(p, Problem::FileUnexpected { file } if file == "other.safetensors")
            ),
            "{p:?}"
        );
        assert!(
            p.iter().any(
                |p| matches!(p, Problem::FileMissing { file, .. } if file == "model.safetensors")
            ),
            "{p:?}"
        );
    }

    /// `read_header`'s verdict on a file of `len` bytes (sparse) whose header claims `n`.
    fn header_verdict(n: u64, len: u64) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let mut f = File::create(&path).unwrap();
        std::io::Write::write_all(&mut f, &n.to_le_bytes()).unwrap();
        f.set_len(len).unwrap();
        drop(f);
        match read_header(&path, len).unwrap() {
            Ok(_) => "ok".into(),
            Err(reason) => reason,
        }
    }

    #[test]
    fn a_header_length_is_implausible_exactly_past_the_file_or_past_the_limit() {
        let len = 4096;
        // One byte past the end of the file.
        assert!(header_verdict(len - 7, len).contains("implausible"));
        // Exactly to the end: plausible (it then fails to parse as JSON).
        let v = header_verdict(len - 8, len);
        assert!(!v.contains("implausible"), "{v}");
        // An eighth of the file: plausible.
        let v = header_verdict(len / 8 + 1, len);
        assert!(!v.contains("implausible"), "{v}");
        // Past the limit in a file long enough to hold it (sparse, nothing read).
        let big = MAX_HEADER_LEN + 64;
        assert!(header_verdict(MAX_HEADER_LEN + 1, big).contains("implausible"));
        // At the limit: plausible (read, then not JSON).
        let v = header_verdict(MAX_HEADER_LEN, big);
        assert!(!v.contains("implausible"), "{v}");
    }

    #[test]
    fn a_header_that_disagrees_with_the_manifest_names_each_tensor() {
        let (dir, m) = checkpoint();
        let path = dir.path().join("model.safetensors");
        // One tensor's dtype (same width), two same-sized tensors' places swapped, one renamed.
        let (a, b) = (
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight",
        );
        edit_header(&path, |h| {
            h["lm_head.weight"]["dtype"] = "F16".into();
            let (oa, ob) = (h[a]["data_offsets"].clone(), h[b]["data_offsets"].clone());
            h[a]["data_offsets"] = ob;
            h[b]["data_offsets"] = oa;
            let v = h.remove("model.norm.weight").unwrap();
            h.insert("model.norm.weigh".into(), v);
        });
        let p = problems(dir.path(), &m);
        let words = said(&p);
        let has = |what: &str| words.iter().any(|w| w.contains(what));
        assert!(
            has("tensor lm_head.weight: dtype is F16, expected BF16"),
            "{words:?}"
        );
        assert!(
            !words
                .iter()
                .any(|w| w.contains("model.embed_tokens.weight")),
            "an unchanged tensor was blamed: {words:?}"
        );
        for t in [a, b] {
            assert!(has(&format!("tensor {t}: bytes at")), "{t}: {words:?}");
        }
        assert!(has("tensor model.norm.weight is missing"), "{words:?}");
        assert!(
            has("tensor model.norm.weigh in model.safetensors is not in the manifest"),
            "{words:?}"
        );
    }

    #[test]
    fn a_tensor_found_in_another_file_than_the_manifest_says_is_named() {
        let (dir, mut m) = checkpoint();
        // The manifest says lm_head.weight lives in a second file.
        m.files.push(crate::manifest::WeightFile {
            name: "second.safetensors".into(),
            len: 8,
            sha256: m.files[0].sha256,
        });
        let i = m
            .tensors
            .iter()
            .position(|t| t.name == "lm_head.weight")
            .unwrap();
        m.tensors[i].file = 1;
        let words = said(&problems(dir.path(), &m));
        assert!(
            words.iter().any(|w| w
                == "tensor lm_head.weight: found in model.safetensors, expected in second.safetensors"),
            "{words:?}"
        );
    }
}
