//! A folder that holds a published checkpoint's dense tensors only (what `stormo pull`
//! writes without the experts): honest files, whose length is what they hold.
//!
//! Layout:
//! - per published safetensors file `NAME.safetensors`, a safetensors file
//!   `NAME.dense.safetensors` ([`dense_name`]) holding that file's dense tensors (the same
//!   names, dtypes, shapes and bytes), packed back to back;
//! - `stormo-dense.json` ([`INDEX`]), the index: `{"format": "stormo-dense-only", "version":
//!   1, "files": [{"name": NAME.safetensors, "len": N, "header": "...", "dense":
//!   NAME.dense.safetensors}]}`, with each published file's length and its header as
//!   published (the JSON text between the length prefix and the data, padding included).
//!
//! [`Checkpoint::open`](super::Checkpoint::open) reads such a folder as the published
//! checkpoint with its expert tensors *absent*: described by the published headers (so the
//! expert layout, record sizes and schemas are the published ones) but with no bytes here.
//! Non-goals: the published files' bytes are not reconstructed here (the serving side does
//! that from the index and the dense files), and nothing here knows a manifest.

use std::path::Path;

use crate::error::{Error, Result};

/// The index file of a dense-only folder.
pub const INDEX: &str = "stormo-dense.json";
/// The `format` the index names.
const FORMAT: &str = "stormo-dense-only";

/// One published safetensors file, as a dense-only folder holds it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PublishedFile {
    /// The published file's name.
    pub name: String,
    /// Its published length in bytes.
    pub len: u64,
    /// Its header as published: the JSON text after the 8-byte length prefix, padding
    /// included.
    pub header: String,
    /// The file in the folder holding its dense tensors.
    pub dense: String,
}

impl PublishedFile {
    /// The published header with its length prefix: the first bytes of the published file.
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut out = (self.header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(self.header.as_bytes());
        out
    }
}

/// The index of a dense-only folder.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DenseIndex {
    /// `stormo-dense-only`.
    pub format: String,
    /// 1.
    pub version: u32,
    /// The published safetensors files, in the published order.
    pub files: Vec<PublishedFile>,
}

impl DenseIndex {
    /// An index over `files`.
    pub fn new(files: Vec<PublishedFile>) -> Self {
        Self {
            format: FORMAT.into(),
            version: 1,
            files,
        }
    }

    /// The index of `dir`, `None` when it has none (a folder holding whole files).
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let p = dir.join(INDEX);
        if !p.is_file() {
            return Ok(None);
        }
        let text = super::read_small_text(&p, super::SMALL_FILE_MAX)?;
        let bad = |m: String| Error::config(&p, m);
        let v: Self = serde_json::from_str(&text).map_err(|e| bad(format!("not valid: {e}")))?;
        if v.format != FORMAT || v.version != 1 {
            return Err(bad(format!(
                "not a version 1 {FORMAT} index (format {:?}, version {})",
                v.format, v.version
            )));
        }
        if v.files.is_empty() {
            return Err(bad("it lists no files".into()));
        }
        for f in &v.files {
            for n in [&f.name, &f.dense] {
                if !safe_name(n) {
                    return Err(bad(format!("it names an unsafe file name {n:?}")));
                }
            }
        }
        Ok(Some(v))
    }

    /// The index as it is written.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("an index serializes")
    }
}

/// The dense file of published file `name`: `model.safetensors` → `model.dense.safetensors`.
pub fn dense_name(name: &str) -> String {
    match name.strip_suffix(".safetensors") {
        Some(stem) => format!("{stem}.dense.safetensors"),
        None => format!("{name}.dense.safetensors"),
    }
}

fn safe_name(n: &str) -> bool {
    !(n.is_empty() || n.contains('/') || n.contains('\\') || n == "." || n == ".." || n == INDEX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_round_trips_and_refuses_unsafe_names() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(DenseIndex::read(dir.path()).unwrap(), None);
        let f = PublishedFile {
            name: "model.safetensors".into(),
            len: 100,
            header: "{}    ".into(),
            dense: dense_name("model.safetensors"),
        };
        assert_eq!(f.dense, "model.dense.safetensors");
        assert_eq!(&f.header_bytes()[..8], &6u64.to_le_bytes());
        let idx = DenseIndex::new(vec![f.clone()]);
        std::fs::write(dir.path().join(INDEX), idx.to_json()).unwrap();
        assert_eq!(DenseIndex::read(dir.path()).unwrap(), Some(idx));
        let evil = DenseIndex::new(vec![PublishedFile {
            dense: "../x".into(),
            ..f
        }]);
        std::fs::write(dir.path().join(INDEX), evil.to_json()).unwrap();
        let e = DenseIndex::read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("unsafe file name"), "{e}");
        std::fs::write(dir.path().join(INDEX), b"{").unwrap();
        assert!(DenseIndex::read(dir.path()).is_err());
    }
}
