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
