//! Helpers shared by the workspace integration tests: fixture paths and the oracle reference.

#![allow(missing_docs)]

use std::path::{Path, PathBuf};

use stormo_engine::safetensors::{open_file, Dtype, MappedFile, TensorInfo};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A fixture folder by name.
pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("fixtures").join(name)
}

/// Copies fixture `name`'s model (every file but its `reference*` outputs) into `to`, an
/// existing folder, for a test that writes beside it (a manifest, kept experts).
pub fn copy_model(name: &str, to: &Path) {
    for e in std::fs::read_dir(fixture(name)).expect("fixture dir") {
        let e = e.expect("fixture entry");
        let n = e.file_name();
        if !n.to_string_lossy().starts_with("reference") {
            std::fs::copy(e.path(), to.join(&n)).expect("copying a fixture file");
        }
    }
}

/// The model fixtures with Transformers references.
pub const MODEL_FIXTURES: &[&str] = &["gptoss-tiny-mxfp4", "gptoss-tiny-bf16", "qwen3moe-tiny"];

/// A reference.safetensors, read.
#[derive(Debug)]
pub struct Reference {
    file: MappedFile,
    tensors: Vec<(String, TensorInfo)>,
}

impl Reference {
    pub fn open(dir: &Path) -> Self {
        let (file, tensors) =
            open_file(&dir.join("reference.safetensors"), 0).expect("reference.safetensors");
        Self { file, tensors }
    }

    fn info(&self, name: &str) -> &TensorInfo {
        &self
            .tensors
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("reference has {name}"))
            .1
    }

    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.info(name).shape.clone()
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        let i = self.info(name);
        assert_eq!(i.dtype, Dtype::F32, "{name}");
        self.file.map[i.offset as usize..(i.offset + i.len) as usize]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let i = self.info(name);
        assert_eq!(i.dtype, Dtype::I64, "{name}");
        self.file.map[i.offset as usize..(i.offset + i.len) as usize]
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }
}

/// Largest absolute difference.
pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The generated fixtures under `fixtures/extra/` (one folder each, see tests/oracle/README.md),
/// sorted by name.
pub fn extra_fixtures() -> Vec<PathBuf> {
    let root = repo_root().join("fixtures").join("extra");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Hidden states and router logits recorded by one forward pass, keyed by index and layer.
#[derive(Debug, Default)]
pub struct Capture {
    pub hidden: Vec<Vec<f32>>,
    pub router: Vec<Vec<f32>>,
}

impl stormo_engine::Observer for Capture {
    fn hidden(&mut self, index: usize, xs: &[f32]) {
        if self.hidden.len() <= index {
            self.hidden.resize(index + 1, Vec::new());
        }
        self.hidden[index].extend_from_slice(xs);
    }
    fn router(&mut self, layer: usize, logits: &[f32]) {
        if self.router.len() <= layer {
            self.router.resize(layer + 1, Vec::new());
        }
        self.router[layer].extend_from_slice(logits);
    }
}

/// The indices of the `k` largest entries of `row`, sorted ascending (a top-k set).
pub fn top_set(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx = vec![0; k];
    stormo_engine::ops::top_k(row, &mut idx);
    idx.sort_unstable();
    idx
}

/// Fails the calling test unless `python3` can import `module`: a test that needs a Python
/// package never passes without it (`.ci/run` installs tests/requirements.txt).
pub fn require_python(module: &str) {
    let have = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        have,
        "python3 with the `{module}` package is needed (pip install -r tests/requirements.txt)"
    );
}
