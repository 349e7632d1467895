//! Where each weight of a model lies in its checkpoint: the dense tensors, and for every
//! (layer, expert) the byte ranges that make the expert up. The tiers read experts by these
//! ranges, and the manifests hash them; neither needs to know the model family.

use crate::config::{Family, ModelConfig};
use crate::error::{Error, Result};
use crate::kernels::Float;
use crate::moe::{ExpertSchema, PartFormat, PartSchema, Role};
use crate::safetensors::{Checkpoint, Dtype, TensorInfo};

/// A byte range in one checkpoint file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute byte offset in that file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// One part of one expert: which tensor it is cut from and where its bytes lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartLoc {
    /// The checkpoint tensor this part is (a slice of).
    pub tensor: String,
    /// Its bytes.
    pub loc: Loc,
}

/// The layout of every expert of a model.
#[derive(Clone, Debug, Default)]
pub struct ExpertLayout {
    /// The files [`Loc::file`] indexes, with the lengths they were validated at.
    pub files: Vec<(std::path::PathBuf, u64)>,
    /// Per layer: the schema of its experts (None for dense layers).
    pub schemas: Vec<Option<ExpertSchema>>,
    /// `[layer][expert]`: the parts, in schema order.
    pub parts: Vec<Vec<Vec<PartLoc>>>,
}

impl ExpertLayout {
    /// Reads the expert layout of `ckpt` under `cfg`, checking every expert tensor's presence,
    /// dtype and shape.
    pub fn from_checkpoint(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Self> {
        let ld = Loader::new(ckpt, cfg.family);
        let mut out = Self {
            // A dense-only folder's absent tensors lie in the published files after these.
            files: ckpt
                .files
                .iter()
                .map(|f| (f.path.clone(), f.len))
                .chain(ckpt.absent_files.iter().cloned())
                .collect(),
            ..Self::default()
        };
        for l in 0..cfg.num_layers {
            if !cfg.layer_moe[l] {
                out.schemas.push(None);
                out.parts.push(Vec::new());
                continue;
            }
            let (schema, parts) = match cfg.family {
                Family::GptOss => crate::gpt_oss::expert_layout(&ld, cfg, l)?,
                Family::Qwen3Moe => crate::qwen3_moe::expert_layout(&ld, cfg, l)?,
            };
            out.schemas.push(Some(schema));
            out.parts.push(parts);
        }
        Ok(out)
    }

    /// Record length of every expert, `[layer][expert]` (empty for dense layers).
    pub fn sizes(&self) -> Vec<Vec<u64>> {
        self.schemas
            .iter()
            .zip(&self.parts)
            .map(|(s, p)| match s {
                Some(s) => vec![s.expert_len() as u64; p.len()],
                None => Vec::new(),
            })
            .collect()
    }

    /// Every tensor name that holds expert bytes (so the rest are dense).
    pub fn expert_tensor_names(&self) -> std::collections::BTreeSet<&str> {
        self.parts
            .iter()
            .flatten()
            .flatten()
            .map(|p| p.tensor.as_str())
            .collect()
    }
}

/// Checks tensors against what the config implies and turns them into locations.
#[derive(Debug)]
pub(crate) struct Loader<'c> {
    pub(crate) ckpt: &'c Checkpoint,
    family: &'static str,
    /// Every tensor name asked for, found or not.
    asked: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

impl<'c> Loader<'c> {
    pub(crate) fn new(ckpt: &'c Checkpoint, family: Family) -> Self {
        Self {
            ckpt,
            family: family.model_type(),
            asked: Default::default(),
        }
    }

    /// Tensors of the checkpoint that neither this loader was asked for nor `also` names:
    /// weights the configuration does not use (a layer or expert count smaller than the
    /// checkpoint's, or a tensor of another model).
    pub(crate) fn unused(&self, also: &std::collections::BTreeSet<&str>) -> Vec<&'c str> {
        let asked = self.asked.borrow();
        self.ckpt
            .tensors
            .keys()
            .map(String::as_str)
            .filter(|n| !asked.contains(*n) && !also.contains(n))
            .collect()
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.ckpt.tensors.contains_key(name)
    }

    pub(crate) fn tensor(&self, name: &str) -> Result<&'c TensorInfo> {
        self.asked.borrow_mut().insert(name.to_string());
        self.ckpt.info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            family: self.family,
        })
    }

    fn check_shape(&self, name: &str, t: &TensorInfo, shape: &[usize]) -> Result<()> {
        if t.shape != shape {
            return Err(Error::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(())
    }

    /// A float tensor of exactly `shape`.
    pub(crate) fn float(&self, name: &str, shape: &[usize]) -> Result<(Float, Loc)> {
        let t = self.tensor(name)?;
        let fmt = Float::from_dtype(t.dtype).ok_or_else(|| Error::Dtype {
            name: name.to_string(),
            expected: "F32, BF16 or F16".into(),
            found: t.dtype.to_string(),
        })?;
        self.check_shape(name, t, shape)?;
        Ok((fmt, loc(t)))
    }

    /// A U8 tensor of exactly `shape`.
    pub(crate) fn bytes(&self, name: &str, shape: &[usize]) -> Result<Loc> {
        let t = self.tensor(name)?;
        if t.dtype != Dtype::U8 {
            return Err(Error::Dtype {
                name: name.to_string(),
                expected: "U8".into(),
                found: t.dtype.to_string(),
            });
        }
        self.check_shape(name, t, shape)?;
        Ok(loc(t))
    }
}

pub(crate) fn loc(t: &TensorInfo) -> Loc {
    Loc {
        file: t.file,
        offset: t.offset,
        len: t.len,
    }
}

/// Cuts a fused `[E, ...]` tensor into per-expert slices and appends one part per expert.
pub(crate) fn split_fused(
    name: &str,
    whole: Loc,
    experts: usize,
    role: Role,
    format: PartFormat,
    schema: &mut Vec<PartSchema>,
    parts: &mut [Vec<PartLoc>],
) {
    let per = whole.len / experts as u64;
    schema.push(PartSchema {
        role,
        format,
        len: per as usize,
    });
    for (e, p) in parts.iter_mut().enumerate() {
        p.push(PartLoc {
            tensor: name.to_string(),
            loc: Loc {
                file: whole.file,
                offset: whole.offset + e as u64 * per,
                len: per,
            },
        });
    }
}

/// Checks that a schema has exactly the parts the family's experts need, with the lengths the
/// config implies (used for schemas read from a store index rather than from tensors).
pub(crate) fn check_schema(
    schema: &ExpertSchema,
    cfg: &ModelConfig,
) -> std::result::Result<(), String> {
    use crate::config::Activation;
    let (h, i) = (cfg.hidden_size, cfg.expert_intermediate);
    let dense_len = |f: PartFormat, n: usize| match f {
        PartFormat::Dense(x) | PartFormat::DenseT(x) => Some(n * x.size()),
        _ => None,
    };
    let want: Vec<(Role, usize)> = match cfg.activation {
        Activation::ClippedSwiglu { .. } => {
            let mx = schema
                .parts
                .iter()
                .any(|p| p.format == PartFormat::Mxfp4Blocks);
            let mut v = vec![(Role::GateUp, if mx { 2 * i * h / 2 } else { 2 * i * h })];
            if mx {
                v.push((Role::GateUpScales, 2 * i * h / 32));
            }
            v.push((Role::GateUpBias, 2 * i));
            v.push((Role::Down, if mx { h * i / 2 } else { h * i }));
            if mx {
                v.push((Role::DownScales, h * i / 32));
            }
            v.push((Role::DownBias, h));
            v
        }
        Activation::Silu => vec![(Role::Gate, i * h), (Role::Up, i * h), (Role::Down, h * i)],
    };
    if schema.parts.len() != want.len() {
        return Err(format!(
            "{} expert parts, expected {}",
            schema.parts.len(),
            want.len()
        ));
    }
    for (p, (role, n)) in schema.parts.iter().zip(want) {
        if p.role != role {
            return Err(format!("part {:?} where {role:?} was expected", p.role));
        }
        let len = match p.format {
            PartFormat::Mxfp4Blocks | PartFormat::Mxfp4Scales => Some(n),
            f => dense_len(f, n),
        };
        let bias_ok = !matches!(role, Role::GateUpBias | Role::DownBias)
            || matches!(p.format, PartFormat::Dense(_));
        if len != Some(p.len) || !bias_ok {
            return Err(format!(
                "part {role:?} ({:?}, {} bytes) does not fit the config",
                p.format, p.len
            ));
        }
    }
    Ok(())
}
