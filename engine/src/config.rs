//! `config.json`, in every form in use, normalised into one [`ModelConfig`].
//!
//! Accepted forms (see SPEC §1 and §5):
//! - the Hugging Face hub's: top-level `rope_theta` plus `rope_scaling`;
//! - Transformers v5 `save_pretrained`: `rope_parameters` holding `rope_theta` and the scaling;
//! - expert counts as `num_local_experts` or `num_experts`, top-k as `num_experts_per_tok` or
//!   `experts_per_token`.
//!
//! Geometry fields have no defaults: a config without `hidden_size` is an error, not a guess.
//! Fields that Transformers itself defaults (rope betas, eps, window) take its defaults.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The model families the engine implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// OpenAI GPT-OSS (`model_type: gpt_oss`).
    GptOss,
    /// Qwen3-MoE (`model_type: qwen3_moe`).
    Qwen3Moe,
}

impl Family {
    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::GptOss => "gpt_oss",
            Self::Qwen3Moe => "qwen3_moe",
        }
    }
}

/// Rotary embedding parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base θ.
    pub theta: f64,
    /// YaRN scaling, when the config asks for it.
    pub yarn: Option<YarnConfig>,
}

/// YaRN parameters (Transformers `_compute_yarn_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnConfig {
    /// Context extension factor.
    pub factor: f64,
    /// β_fast (default 32).
    pub beta_fast: f64,
    /// β_slow (default 1).
    pub beta_slow: f64,
    /// Pre-training context length L0.
    pub original_max_position_embeddings: f64,
    /// Floor/ceil the correction range (Transformers' default: true).
    pub truncate: bool,
    /// Explicit attention factor, if given.
    pub attention_factor: Option<f64>,
    /// DeepSeek-style mscale pair, if given.
    pub mscale: Option<f64>,
    /// DeepSeek-style mscale_all_dim, if given.
    pub mscale_all_dim: Option<f64>,
}

/// How the router turns logits into expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// GPT-OSS: top-k of the logits, then softmax over the k selected.
    TopKThenSoftmax,
    /// Qwen3-MoE: softmax over all experts, top-k, optionally renormalised to sum 1.
    SoftmaxThenTopK {
        /// `norm_topk_prob`.
        renormalize: bool,
    },
}

/// The expert's activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// GPT-OSS clipped SwiGLU on interleaved gate/up: gate ≤ limit, |up| ≤ limit,
    /// `(up + 1) · gate · σ(alpha · gate)`.
    ClippedSwiglu {
        /// `swiglu_limit` (7.0).
        limit: f32,
        /// `swiglu_alpha` (1.702).
        alpha: f32,
    },
    /// Plain SwiGLU on separate gate and up: `silu(gate) · up`.
    Silu,
}

/// A model's configuration, normalised across families and config formats.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub family: Family,
    /// Residual width H.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding and the head).
    pub vocab_size: usize,
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Per-expert intermediate width I.
    pub expert_intermediate: usize,
    /// Intermediate width of dense MLP layers (Qwen3 layers that are not MoE).
    pub dense_intermediate: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// The longest context the model supports.
    pub max_position_embeddings: usize,
    /// Sliding window length W (a position sees W keys), for the layers that slide.
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window?
    pub layer_sliding: Vec<bool>,
    /// Per layer: is its MLP a mixture of experts (else dense)?
    pub layer_moe: Vec<bool>,
    /// q/k/v/o projections carry biases.
    pub attention_bias: bool,
    /// Attention sinks (GPT-OSS).
    pub attention_sinks: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Router has a bias (GPT-OSS).
    pub router_bias: bool,
    /// Experts have biases (GPT-OSS).
    pub expert_bias: bool,
    /// Routing rule.
    pub routing: Routing,
    /// Expert activation.
    pub activation: Activation,
    /// `lm_head` is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Experts are stored as MXFP4 (`quantization_config.quant_method == "mxfp4"`).
    pub mxfp4_experts: bool,
    /// End-of-sequence ids from config.json (may be empty).
    pub eos_token_ids: Vec<u32>,
}

/// Why `dir` (whose config is `config`) is not a model folder, with what to do; `None` when
/// its `config.json` is there (or cannot be checked: reading it then names the error).
fn not_a_model(dir: &Path, config: &Path) -> Option<String> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut reason = String::from("no such folder");
            // `org/name`, relative and not there: a Hugging Face model id, most likely.
            let parts: Vec<_> = dir.components().collect();
            let hub_id = dir.is_relative()
                && parts.len() == 2
                && parts
                    .iter()
                    .all(|c| matches!(c, std::path::Component::Normal(_)));
            if let (true, Some(name)) = (hub_id, dir.file_name()) {
                let (id, name) = (dir.display(), Path::new(name).display());
                reason.push_str(&format!(
                    "; if {id} is a Hugging Face model, download it first \
                     (`huggingface-cli download {id} --local-dir {name}`, then --model {name}), \
                     or fetch it from a peer with `stormo pull`"
                ));
            }
            Some(reason)
        }
        Ok(m) if m.is_dir() => match std::fs::metadata(config) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(
                "no config.json (a model folder holds config.json, tokenizer.json and the \
                 safetensors files, as published on Hugging Face)"
                    .into(),
            ),
            _ => None,
        },
        _ => None,
    }
}

/// The geometry fields of gpt-oss-20b's published config.json: a fixed, real model for the
/// arithmetic of memory plans and costs (tests and examples), without a checkpoint.
pub const GPT_OSS_20B_CONFIG: &str = r#"{"model_type": "gpt_oss", "hidden_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 201088, "num_local_experts": 32, "num_experts_per_tok": 4,
    "intermediate_size": 2880, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "sliding_window": 128, "max_position_embeddings": 131072}"#;

impl ModelConfig {
    /// Reads and normalises `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if dir.is_file() {
            return Err(Error::io(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "is a file: give the model's folder (config.json and the safetensors files)",
                ),
            ));
        }
        let path = dir.join("config.json");
        if let Some(reason) = not_a_model(dir, &path) {
            return Err(Error::NoModel {
                dir: dir.to_path_buf(),
                reason,
            });
        }
        let text = crate::safetensors::read_small_text(&path, crate::safetensors::SMALL_FILE_MAX)?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config.json text; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| Error::config(path, "config is not a JSON object"))?;
        let f = Fields { obj, path };
        let model_type = f
            .opt_str("model_type")?
            .ok_or_else(|| Error::config(path, "missing field \"model_type\""))?;
        let cfg = match model_type.as_str() {
            "gpt_oss" => parse_gpt_oss(&f)?,
            "qwen3_moe" => parse_qwen3_moe(&f)?,
            other => {
                return Err(Error::UnsupportedModel {
                    found: other.to_string(),
                })
            }
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let err = |m: String| Err(Error::config(path, m));
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return err(format!("{name} must be positive"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return err(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if self.layer_moe.iter().any(|&m| m) {
            if self.num_experts == 0 || self.top_k == 0 || self.top_k > self.num_experts {
                return err(format!(
                    "need 0 < experts per token ({}) <= experts ({})",
                    self.top_k, self.num_experts
                ));
            }
            if self.expert_intermediate == 0 {
                return err("expert intermediate size must be positive".into());
            }
        }
        if self.layer_moe.iter().any(|&m| !m) && self.dense_intermediate == 0 {
            return err("intermediate_size must be positive for dense MLP layers".into());
        }
        if self.mxfp4_experts && !self.hidden_size.is_multiple_of(32) {
            return err(format!(
                "MXFP4 experts need hidden_size divisible by 32, got {}",
                self.hidden_size
            ));
        }
        if self.mxfp4_experts && !self.expert_intermediate.is_multiple_of(32) {
            return err(format!(
                "MXFP4 experts need intermediate_size divisible by 32, got {}",
                self.expert_intermediate
            ));
        }
        if let Some(w) = self.sliding_window {
            if w == 0 {
                return err("sliding_window must be positive".into());
            }
        }
        if !self.rms_norm_eps.is_finite() || self.rms_norm_eps < 0.0 {
            return err(format!(
                "rms_norm_eps must be a finite number >= 0, got {}",
                self.rms_norm_eps
            ));
        }
        if let Activation::ClippedSwiglu { limit, alpha } = self.activation {
            if limit.is_nan() || limit <= 0.0 {
                return err(format!("swiglu_limit must be positive, got {limit}"));
            }
            if !alpha.is_finite() {
                return err(format!("swiglu_alpha must be a finite number, got {alpha}"));
            }
        }
        // RoPE's frequencies base^(-2i/d) fall with i only for a base above 1; YaRN divides by
        // ln(base), and a base far below 1 makes the f32 frequencies infinite.
        let theta = self.rope.theta;
        if !theta.is_finite() || theta <= 1.0 {
            return err(format!(
                "rope_theta must be a finite number greater than 1, got {theta:?}"
            ));
        }
        if let Some(y) = &self.rope.yarn {
            // YaRN extends the context: Transformers requires factor >= 1 (below it, get_mscale
            // is 1 and the "interpolated" frequencies exceed the original ones). A factor near 0
            // made 1/(factor·base^(2i/d)) infinite and the frequencies NaN.
            if !y.factor.is_finite() || y.factor < 1.0 {
                return err(format!(
                    "rope scaling factor must be a finite number >= 1, got {:?} (when absent it is \
                     max_position_embeddings / original_max_position_embeddings)",
                    y.factor
                ));
            }
            let l0 = y.original_max_position_embeddings;
            if !l0.is_finite() || l0 <= 0.0 {
                return err(format!(
                    "rope scaling original_max_position_embeddings must be positive, got {l0:?}"
                ));
            }
            // The correction range takes ln(L0 / (2π·β)): a β of 0 gave ln(inf) and NaN
            // frequencies (Transformers' math.log fails on β <= 0).
            for (name, beta) in [("beta_fast", y.beta_fast), ("beta_slow", y.beta_slow)] {
                if !beta.is_finite() || beta <= 0.0 {
                    return err(format!(
                        "rope scaling {name} must be a positive number, got {beta:?}"
                    ));
                }
            }
            let (low, high) = crate::rope::correction_range(y, theta, self.head_dim);
            if !low.is_finite() || !high.is_finite() {
                return err(format!(
                    "rope scaling beta_fast {:?} and beta_slow {:?} with \
                     original_max_position_embeddings {l0:?} give a YaRN correction range \
                     [{low:?}, {high:?}] that is not finite",
                    y.beta_fast, y.beta_slow
                ));
            }
            let a = crate::rope::attention_factor(y) as f32;
            if !a.is_finite() {
                return err(format!(
                    "rope scaling attention factor {a} (from attention_factor, or mscale and \
                     mscale_all_dim) is not finite"
                ));
            }
        }
        Ok(())
    }
}

/// Most layers, and most experts per layer, a configuration may declare (published MoE models
/// have at most a few hundred of either).
const MAX_COUNT: usize = 1 << 16;

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn err(&self, msg: String) -> Error {
        Error::config(self.path, msg)
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.err(format!(
                        "field {key:?} must be a non-negative integer, found {v}"
                    ))
                }),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing field {key:?}")))
    }
    /// A count that sizes tables before any tensor is checked against it (layers, experts):
    /// anything above [`MAX_COUNT`] is refused here rather than allocated.
    fn count(&self, key: &str) -> Result<usize> {
        self.count_any(&[key])
    }
    /// [`Fields::count`] of the first of several aliases that is present.
    fn count_any(&self, keys: &[&str]) -> Result<usize> {
        let v = self.usize_any(keys)?;
        if v > MAX_COUNT {
            let key = keys
                .iter()
                .find(|k| self.get(k).is_some())
                .unwrap_or(&keys[0]);
            return Err(self.err(format!(
                "field {key:?} is {v}, more than this engine takes ({MAX_COUNT})"
            )));
        }
        Ok(v)
    }
    /// The first of several aliases that is present.
    fn usize_any(&self, keys: &[&str]) -> Result<usize> {
        for k in keys {
            if let Some(v) = self.opt_usize(k)? {
                return Ok(v);
            }
        }
        Err(self.err(format!("missing field {:?} (or {:?})", keys[0], &keys[1..])))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        opt_f64_in(self.obj, key).map_err(|m| self.err(m))
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field {key:?} must be true or false, found {v}"))),
        }
    }
    fn opt_str(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.err(format!("field {key:?} must be a string, found {v}"))),
        }
    }
    fn opt_usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| self.err(format!("field {key:?} must list integers")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(format!("field {key:?} must be a list, found {v}"))),
        }
    }
    fn eos_ids(&self) -> Result<Vec<u32>> {
        match self.get("eos_token_id") {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| {
                            self.err(format!(
                                "eos_token_id must hold non-negative integers (token ids \
                                 below 2^32), found {x}"
                            ))
                        })
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(|x| vec![x])
                .ok_or_else(|| {
                    self.err(format!(
                        "eos_token_id must be a non-negative integer (a token id below 2^32) \
                         or a list of them, found {v}"
                    ))
                }),
        }
    }
    /// `layer_types` if present: true where a layer slides.
    fn layer_types(&self, num_layers: usize) -> Result<Option<Vec<bool>>> {
        let Some(v) = self.get("layer_types") else {
            return Ok(None);
        };
        let a = v
            .as_array()
            .ok_or_else(|| self.err("layer_types must be a list".into()))?;
        if a.len() != num_layers {
            return Err(self.err(format!(
                "layer_types has {} entries but num_hidden_layers is {num_layers}",
                a.len()
            )));
        }
        a.iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(self.err(format!(
                    "layer_types entry {t} is not \"sliding_attention\" or \"full_attention\""
                ))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Rotary parameters from `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (hub).
    fn rope(&self, default_theta: f64) -> Result<RopeConfig> {
        let params = self
            .get("rope_parameters")
            .or_else(|| self.get("rope_scaling"));
        let scaling = match params {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(v) => return Err(self.err(format!("rope scaling must be an object, found {v}"))),
        };
        let from_v5 = self.get("rope_parameters").is_some();
        let theta = match scaling
            .map(|m| opt_f64_in(m, "rope_theta"))
            .transpose()
            .map_err(|m| self.err(m))?
            .flatten()
        {
            Some(t) => t,
            None => self.opt_f64("rope_theta")?.unwrap_or(default_theta),
        };
        let Some(m) = scaling else {
            return Ok(RopeConfig { theta, yarn: None });
        };
        let rope_type = m
            .get("rope_type")
            .or_else(|| m.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let yarn = match rope_type {
            "default" => None,
            "yarn" => {
                let g =
                    |k: &str| opt_f64_in(m, k).map_err(|e| self.err(format!("rope scaling: {e}")));
                // As Transformers' standardize_rope_params: a top-level
                // original_max_position_embeddings wins, then the scaling dict's, then
                // max_position_embeddings; a missing factor is max_position / original.
                let max_pos = self.opt_usize("max_position_embeddings")?;
                let original = match (self.opt_f64("original_max_position_embeddings")?, g("original_max_position_embeddings")?, max_pos) {
                    (Some(x), _, _) | (None, Some(x), _) => x,
                    (None, None, Some(m)) => m as f64,
                    (None, None, None) => {
                        return Err(self.err("rope scaling of type yarn needs original_max_position_embeddings or max_position_embeddings".into()))
                    }
                };
                let factor = match (g("factor")?, max_pos) {
                    (Some(f), _) => f,
                    (None, Some(m)) => m as f64 / original,
                    (None, None) => {
                        return Err(self.err("rope scaling of type yarn has no \"factor\"".into()))
                    }
                };
                let truncate = match m.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(self.err(format!(
                            "rope scaling: truncate must be a boolean, found {v}"
                        )))
                    }
                };
                let _ = from_v5;
                Some(YarnConfig {
                    factor,
                    beta_fast: g("beta_fast")?.unwrap_or(32.0),
                    beta_slow: g("beta_slow")?.unwrap_or(1.0),
                    original_max_position_embeddings: original,
                    truncate,
                    attention_factor: g("attention_factor")?,
                    mscale: g("mscale")?,
                    mscale_all_dim: g("mscale_all_dim")?,
                })
            }
            other => {
                return Err(self.err(format!(
                    "unsupported rope type {other:?} (supported: default, yarn)"
                )))
            }
        };
        Ok(RopeConfig { theta, yarn })
    }
}

fn opt_f64_in(m: &Map<String, Value>, key: &str) -> std::result::Result<Option<f64>, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("field {key:?} must be a number, found {v}")),
    }
}

fn parse_gpt_oss(f: &Fields<'_>) -> Result<ModelConfig> {
    let hidden_size = f.usize("hidden_size")?;
    let num_layers = f.count("num_hidden_layers")?;
    let num_heads = f.usize("num_attention_heads")?;
    let num_kv_heads = f.usize("num_key_value_heads")?;
    // Absent fields take GptOssConfig's defaults: head_dim 64, sliding_window 128 (an explicit
    // null turns the window off), YaRN as the published model uses it.
    let head_dim = f.opt_usize("head_dim")?.unwrap_or(64);
    let sliding_window = match f.obj.get("sliding_window") {
        None => Some(128),
        Some(_) => f.opt_usize("sliding_window")?,
    };
    let layer_sliding = match f.layer_types(num_layers)? {
        Some(t) => t,
        None => (0..num_layers).map(|i| i % 2 == 0).collect(),
    };
    let quant = match f.get("quantization_config") {
        None => None,
        Some(Value::Object(q)) => Some(
            q.get("quant_method")
                .and_then(|m| m.as_str())
                .unwrap_or("")
                .to_string(),
        ),
        Some(v) => return Err(f.err(format!("quantization_config must be an object, found {v}"))),
    };
    let mxfp4_experts = match quant.as_deref() {
        None => false,
        Some("mxfp4") => true,
        Some(other) => {
            return Err(f.err(format!(
                "unsupported quantization_config.quant_method {other:?} (supported: mxfp4)"
            )))
        }
    };
    let limit = f.opt_f64("swiglu_limit")?.unwrap_or(7.0) as f32;
    let alpha = f.opt_f64("swiglu_alpha")?.unwrap_or(1.702) as f32;
    Ok(ModelConfig {
        family: Family::GptOss,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size: f.usize("vocab_size")?,
        num_experts: f.count_any(&["num_local_experts", "num_experts"])?,
        top_k: f.usize_any(&["num_experts_per_tok", "experts_per_token"])?,
        expert_intermediate: f.usize("intermediate_size")?,
        dense_intermediate: 0,
        rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
        rope: {
            let mut r = f.rope(150000.0)?;
            if f.get("rope_parameters").is_none() && f.get("rope_scaling").is_none() {
                r.yarn = Some(YarnConfig {
                    factor: 32.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    original_max_position_embeddings: 4096.0,
                    truncate: false,
                    attention_factor: None,
                    mscale: None,
                    mscale_all_dim: None,
                });
            }
            r
        },
        max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(131072),
        layer_sliding: if sliding_window.is_some() {
            layer_sliding
        } else {
            vec![false; num_layers]
        },
        sliding_window,
        layer_moe: vec![true; num_layers],
        attention_bias: f.opt_bool("attention_bias")?.unwrap_or(true),
        attention_sinks: true,
        qk_norm: false,
        router_bias: true,
        expert_bias: true,
        routing: Routing::TopKThenSoftmax,
        activation: Activation::ClippedSwiglu { limit, alpha },
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        mxfp4_experts,
        eos_token_ids: f.eos_ids()?,
    })
}

fn parse_qwen3_moe(f: &Fields<'_>) -> Result<ModelConfig> {
    let hidden_size = f.usize("hidden_size")?;
    let num_layers = f.count("num_hidden_layers")?;
    let num_heads = f.usize("num_attention_heads")?;
    let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
    let head_dim = match f.opt_usize("head_dim")? {
        Some(d) => d,
        None => hidden_size / num_heads.max(1),
    };
    let num_experts = f.count_any(&["num_experts", "num_local_experts"])?;
    // Layer l is sparse when (l + 1) % decoder_sparse_step == 0, so a step of 0 names no
    // layer (Transformers divides by zero).
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(f.err("decoder_sparse_step must be positive, found 0".into()));
    }
    let mut dense_only = vec![false; num_layers];
    for l in f.opt_usize_list("mlp_only_layers")?.unwrap_or_default() {
        let slot = dense_only.get_mut(l).ok_or_else(|| {
            f.err(format!(
                "mlp_only_layers names layer {l}, but num_hidden_layers is {num_layers}"
            ))
        })?;
        *slot = true;
    }
    let layer_moe: Vec<bool> = (0..num_layers)
        .map(|l| !dense_only[l] && num_experts > 0 && (l + 1) % step == 0)
        .collect();
    let use_sliding = f.opt_bool("use_sliding_window")?.unwrap_or(false);
    let sliding_window = if use_sliding {
        Some(f.opt_usize("sliding_window")?.unwrap_or(4096))
    } else {
        None
    };
    let layer_sliding = match (sliding_window, f.layer_types(num_layers)?) {
        (None, _) => vec![false; num_layers],
        (Some(_), Some(t)) => t,
        (Some(_), None) => vec![true; num_layers],
    };
    if let Some(Value::Object(q)) = f.get("quantization_config") {
        return Err(f.err(format!(
            "quantized Qwen3-MoE checkpoints are not supported (quant_method {})",
            q.get("quant_method").cloned().unwrap_or(Value::Null)
        )));
    }
    let any_moe = layer_moe.iter().any(|&m| m);
    Ok(ModelConfig {
        family: Family::Qwen3Moe,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size: f.usize("vocab_size")?,
        num_experts,
        top_k: if any_moe {
            f.usize_any(&["num_experts_per_tok", "experts_per_token"])?
        } else {
            0
        },
        expert_intermediate: if any_moe {
            f.usize("moe_intermediate_size")?
        } else {
            0
        },
        dense_intermediate: if layer_moe.iter().all(|&m| m) {
            f.opt_usize("intermediate_size")?.unwrap_or(0)
        } else {
            f.usize("intermediate_size")?
        },
        rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        rope: f.rope(10000.0)?,
        max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(32768),
        sliding_window,
        layer_sliding,
        layer_moe,
        attention_bias: f.opt_bool("attention_bias")?.unwrap_or(false),
        attention_sinks: false,
        qk_norm: true,
        router_bias: false,
        expert_bias: false,
        routing: Routing::SoftmaxThenTopK {
            renormalize: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
        },
        activation: Activation::Silu,
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        mxfp4_experts: false,
        eos_token_ids: f.eos_ids()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(s, Path::new("config.json"))
    }

    const GPT: &str = r#"{"model_type":"gpt_oss","hidden_size":64,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":100,
        "num_local_experts":4,"num_experts_per_tok":2,"intermediate_size":32,"sliding_window":8,
        "rope_theta":150000,"rope_scaling":{"rope_type":"yarn","factor":32.0,"beta_fast":32.0,
        "beta_slow":1.0,"original_max_position_embeddings":4096,"truncate":false}}"#;

    /// A folder without config.json, a missing folder and a Hugging Face id that is not a
    /// folder each say what is wrong and what to do, not a bare OS error.
    #[test]
    fn a_folder_that_is_not_a_model_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let e = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "no model at {}: no config.json (a model folder holds config.json, \
                 tokenizer.json and the safetensors files, as published on Hugging Face)",
                dir.path().display()
            )
        );
        let gone = dir.path().join("gone");
        let e = ModelConfig::from_dir(&gone).unwrap_err().to_string();
        assert_eq!(e, format!("no model at {}: no such folder", gone.display()));
        let e = ModelConfig::from_dir(Path::new("openai/gpt-oss-20b"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("no model at openai/gpt-oss-20b: no such folder; if openai/gpt-oss-20b is a Hugging Face model, download it first (`huggingface-cli download openai/gpt-oss-20b --local-dir gpt-oss-20b`, then --model gpt-oss-20b)"),
            "{e}"
        );
        assert!(e.contains("stormo pull"), "{e}");
    }

    #[test]
    fn gpt_oss_hub_form() {
        let c = parse(GPT).unwrap();
        assert_eq!(c.family, Family::GptOss);
        assert_eq!(c.layer_sliding, vec![true, false]);
        let y = c.rope.yarn.unwrap();
        assert_eq!(y.factor, 32.0);
        assert!(!y.truncate);
        assert_eq!(c.rope.theta, 150000.0);
    }

    #[test]
    fn gpt_oss_v5_rope_parameters_and_num_experts_alias() {
        let s = GPT
            .replace("\"num_local_experts\"", "\"num_experts\"")
            .replace(
                "\"rope_theta\":150000,\"rope_scaling\"",
                "\"rope_parameters\"",
            )
            .replace("\"truncate\":false}", "\"rope_theta\":5000}");
        let c = parse(&s).unwrap();
        assert_eq!(c.num_experts, 4);
        assert_eq!(c.rope.theta, 5000.0);
        assert!(c.rope.yarn.unwrap().truncate, "absent truncate means true");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse("{not json").unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
        let e = parse(&GPT.replace("\"hidden_size\":64,", ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");
        let e = parse(&GPT.replace("gpt_oss", "llama"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama") && e.contains("gpt_oss") && e.contains("qwen3_moe"),
            "{e}"
        );
        let e = parse(&GPT.replace("\"num_experts_per_tok\":2", "\"num_experts_per_tok\":9"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("experts per token"), "{e}");
        let e = parse(&GPT.replace("\"hidden_size\":64", "\"hidden_size\":\"64\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");
    }

    #[test]
    fn values_that_would_crash_or_exhaust_memory_later_are_refused() {
        let err = |from: &str, to: &str| {
            assert!(GPT.contains(from), "{from}");
            parse(&GPT.replace(from, to)).unwrap_err().to_string()
        };
        // Each sized a table before any tensor was checked (an allocation of terabytes).
        let e = err(
            "\"num_local_experts\":4",
            "\"num_local_experts\":1099511627776",
        );
        assert!(
            e.contains("num_local_experts") && e.contains("1099511627776"),
            "{e}"
        );
        let e = err("\"num_local_experts\":4", "\"num_experts\":1073741824");
        assert!(e.contains("\"num_experts\""), "{e}");
        let e = err(
            "\"num_hidden_layers\":2",
            "\"num_hidden_layers\":1099511627776",
        );
        assert!(e.contains("num_hidden_layers"), "{e}");
        // A negative limit made the activation's clamp panic; a negative epsilon gave zeros.
        let with = |extra: &str| GPT.replacen('{', &format!("{{{extra},"), 1);
        for bad in ["-7.0", "0"] {
            let e = parse(&with(&format!("\"swiglu_limit\":{bad}"))).unwrap_err();
            assert!(e.to_string().contains("swiglu_limit"), "{e}");
        }
        let e = parse(&with("\"rms_norm_eps\":-1")).unwrap_err();
        assert!(e.to_string().contains("rms_norm_eps"), "{e}");
        // The limits themselves still parse.
        let c = parse(&with("\"swiglu_limit\":3.5,\"rms_norm_eps\":0")).unwrap();
        assert_eq!(
            c.activation,
            Activation::ClippedSwiglu {
                limit: 3.5,
                alpha: 1.702
            }
        );
        let q = r#"{"model_type":"qwen3_moe","hidden_size":32,"num_hidden_layers":65537,
            "num_attention_heads":4,"vocab_size":50,"num_experts":4,"num_experts_per_tok":2,
            "moe_intermediate_size":16}"#;
        let e = parse(q).unwrap_err().to_string();
        assert!(
            e.contains("num_hidden_layers") && e.contains("65536"),
            "{e}"
        );
    }

    /// The rope tables a config gives are finite: frequencies, scaling, cos and sin.
    fn assert_rope_finite(c: &ModelConfig) {
        let r = crate::rope::Rope::new(&c.rope, c.head_dim);
        assert!(
            r.inv_freq.iter().all(|f| f.is_finite()) && r.attention_scaling.is_finite(),
            "{:?} gives {r:?}",
            c.rope
        );
        let half = c.head_dim / 2;
        let (mut cos, mut sin) = (vec![0.0; half], vec![0.0; half]);
        for pos in [0, 1, 4095, c.max_position_embeddings - 1] {
            r.cos_sin(pos, &mut cos, &mut sin);
            assert!(
                cos.iter().chain(&sin).all(|v| v.is_finite()),
                "{:?} at {pos}",
                c.rope
            );
        }
    }

    #[test]
    fn rope_scaling_that_gave_nan_frequencies_is_refused() {
        let yarn = "\"factor\":32.0,\"beta_fast\":32.0,\"beta_slow\":1.0";
        let gpt = GPT.replace(",\n        \"beta_slow\"", ",\"beta_slow\"");
        assert!(gpt.contains(yarn));
        let with = |to: &str| parse(&gpt.replace(yarn, to));
        for (to, names) in [
            // ln(L0 / 0) is infinite: the ramp was inf/inf.
            (
                "\"factor\":32.0,\"beta_fast\":0,\"beta_slow\":0",
                "beta_fast",
            ),
            (
                "\"factor\":32.0,\"beta_fast\":32.0,\"beta_slow\":-1",
                "beta_slow",
            ),
            // Positive, but L0 / (2π·β) overflows.
            (
                "\"factor\":32.0,\"beta_fast\":1e-320,\"beta_slow\":1e-321",
                "beta_fast 1e-320 and beta_slow 1e-321",
            ),
            // 1 / (factor · base^(2i/d)) overflowed f32.
            (
                "\"factor\":1e-300,\"beta_fast\":32.0,\"beta_slow\":1.0",
                "factor",
            ),
            (
                "\"factor\":0.5,\"beta_fast\":32.0,\"beta_slow\":1.0",
                "factor",
            ),
            (
                "\"factor\":0,\"beta_fast\":32.0,\"beta_slow\":1.0",
                "factor",
            ),
            // Finite in f64, infinite as the f32 scaling.
            (
                "\"factor\":32.0,\"beta_fast\":32.0,\"beta_slow\":1.0,\"attention_factor\":1e300",
                "attention factor",
            ),
        ] {
            let e = with(to).expect_err(to).to_string();
            assert!(e.contains(names), "{to}: {e}");
        }
        // ln(1) = 0 divides the correction range.
        let e = parse(&GPT.replace("\"rope_theta\":150000", "\"rope_theta\":1"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_theta"), "{e}");

        // Unusual but well defined: accepted, with finite tables.
        assert_rope_finite(&parse(GPT).unwrap());
        for to in [
            "\"factor\":1,\"beta_fast\":32.0,\"beta_slow\":1.0",
            "\"factor\":32.0,\"beta_fast\":1.0,\"beta_slow\":32.0",
            "\"factor\":32.0,\"beta_fast\":4.0,\"beta_slow\":4.0",
            "\"factor\":32.0,\"beta_fast\":32.0,\"beta_slow\":1e300",
            "\"factor\":1e300,\"beta_fast\":32.0,\"beta_slow\":1.0",
            "\"factor\":40,\"beta_fast\":32.0,\"beta_slow\":1.0,\"mscale\":1,\"mscale_all_dim\":0",
        ] {
            assert_rope_finite(&with(to).expect(to));
        }
        let c = parse(&GPT.replace(",\"truncate\":false", "")).unwrap();
        assert!(c.rope.yarn.as_ref().unwrap().truncate);
        assert_rope_finite(&c);
    }

    #[test]
    fn negative_eos_token_id_is_named_a_token_id() {
        let with = |eos: &str| GPT.replacen('{', &format!("{{\"eos_token_id\":{eos},"), 1);
        for eos in ["-5", "[1,-5]", "4294967296", "1.5"] {
            let e = parse(&with(eos)).unwrap_err().to_string();
            assert!(
                e.contains("non-negative integer") && e.contains("token id"),
                "{e}"
            );
        }
        assert_eq!(parse(&with("[2,7]")).unwrap().eos_token_ids, vec![2, 7]);
    }

    #[test]
    fn qwen_sparse_step_zero_and_unknown_mlp_only_layers_are_refused() {
        let q = r#"{"model_type":"qwen3_moe","hidden_size":32,"num_hidden_layers":4,
            "num_attention_heads":4,"vocab_size":50,"num_experts":4,"num_experts_per_tok":2,
            "moe_intermediate_size":16,"intermediate_size":64,"decoder_sparse_step":1,
            "mlp_only_layers":[]}"#;
        let with = |from: &str, to: &str| {
            assert!(q.contains(from), "{from}");
            parse(&q.replace(from, to))
        };
        // Step 0 made every layer dense, so loading asked for a dense MLP the file lacks.
        let e = with("\"decoder_sparse_step\":1", "\"decoder_sparse_step\":0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("decoder_sparse_step"), "{e}");
        // A layer past the last was ignored.
        let e = with("\"mlp_only_layers\":[]", "\"mlp_only_layers\":[0,99]")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mlp_only_layers") && e.contains("99") && e.contains('4'),
            "{e}"
        );
        let e = with("\"mlp_only_layers\":[]", "\"mlp_only_layers\":[4]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer 4"), "{e}");
        let c = with("\"mlp_only_layers\":[]", "\"mlp_only_layers\":[3,0,3]").unwrap();
        assert_eq!(c.layer_moe, vec![false, true, true, false]);
    }

    #[test]
    fn qwen_dense_layers_follow_sparse_step_and_only_list() {
        let s = r#"{"model_type":"qwen3_moe","hidden_size":32,"num_hidden_layers":4,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":50,"num_experts":4,
            "num_experts_per_tok":2,"moe_intermediate_size":16,"intermediate_size":64,
            "decoder_sparse_step":2,"mlp_only_layers":[3],"norm_topk_prob":true}"#;
        let c = parse(s).unwrap();
        assert_eq!(c.layer_moe, vec![false, true, false, false]);
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.routing, Routing::SoftmaxThenTopK { renormalize: true });
        assert_eq!(c.sliding_window, None);
    }
}
