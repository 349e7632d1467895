//! The flat expert store written by `stormo convert`: every expert one 4 KiB-aligned record,
//! so one aligned (O_DIRECT) read loads one expert.
//!
//! Layout of a store folder:
//! - `experts.bin`: the records. Record = the expert's parts back to back in schema order (the
//!   same bytes, in the same order, as the checkpoint's tensors hold them), zero-padded to a
//!   multiple of 4096; every record starts at a multiple of 4096.
//! - `dense.safetensors`: every non-expert tensor, unchanged (names, dtypes, bytes).
//! - `stormo-store.json`: `{"format": "stormo-expert-store", "version": 1, "alignment": 4096,
//!   "experts_file": "experts.bin", "experts_len": N, "layers": [null | {"parts":
//!   [{"role": "gate_up", "format": "mxfp4_blocks", "len": N}, ...], "offsets": [..]}]}`.
//! - `config.json` and the other small files of the source folder (tokenizer, generation config).
//!
//! Because the bytes are the checkpoint's own, a model run from the store computes bit-identical
//! logits to one run from the original checkpoint.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::disk::ALIGN;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kernels::Float;
use crate::layout::{ExpertLayout, Loc, PartLoc};
use crate::moe::{ExpertSchema, PartFormat, PartSchema, Role};
use crate::safetensors::{self, Checkpoint};

/// The store's index file name.
pub const INDEX: &str = "stormo-store.json";
const EXPERTS: &str = "experts.bin";
const DENSE: &str = "dense.safetensors";

fn role_name(r: Role) -> &'static str {
    match r {
        Role::GateUp => "gate_up",
        Role::GateUpScales => "gate_up_scales",
        Role::GateUpBias => "gate_up_bias",
        Role::Gate => "gate",
        Role::Up => "up",
        Role::Down => "down",
        Role::DownScales => "down_scales",
        Role::DownBias => "down_bias",
    }
}

fn role_from(s: &str) -> Option<Role> {
    [
        Role::GateUp,
        Role::GateUpScales,
        Role::GateUpBias,
        Role::Gate,
        Role::Up,
        Role::Down,
        Role::DownScales,
        Role::DownBias,
    ]
    .into_iter()
    .find(|&r| role_name(r) == s)
}

fn float_name(f: Float) -> &'static str {
    match f {
        Float::F32 => "F32",
        Float::BF16 => "BF16",
        Float::F16 => "F16",
    }
}

fn format_name(f: PartFormat) -> String {
    match f {
        PartFormat::Dense(x) => format!("dense_{}", float_name(x)),
        PartFormat::DenseT(x) => format!("dense_t_{}", float_name(x)),
        PartFormat::Mxfp4Blocks => "mxfp4_blocks".into(),
        PartFormat::Mxfp4Scales => "mxfp4_scales".into(),
    }
}

fn format_from(s: &str) -> Option<PartFormat> {
    let float = |x: &str| {
        [Float::F32, Float::BF16, Float::F16]
            .into_iter()
            .find(|&f| float_name(f) == x)
    };
    if let Some(x) = s.strip_prefix("dense_t_") {
        return float(x).map(PartFormat::DenseT);
    }
    if let Some(x) = s.strip_prefix("dense_") {
        return float(x).map(PartFormat::Dense);
    }
    match s {
        "mxfp4_blocks" => Some(PartFormat::Mxfp4Blocks),
        "mxfp4_scales" => Some(PartFormat::Mxfp4Scales),
        _ => None,
    }
}

/// Whether `dir` holds a converted store.
pub fn is_store(dir: &Path) -> bool {
    dir.join(INDEX).is_file()
}

/// Converts the checkpoint in `src` into a flat store in `out` (which must not exist or be
/// empty). `progress(done, total)` is called as bytes are written.
pub fn convert(src: &Path, out: &Path, mut progress: impl FnMut(u64, u64)) -> Result<()> {
    if is_store(src) {
        return Err(Error::config(src.join(INDEX), "already a converted store"));
    }
    let cfg = ModelConfig::from_dir(src)?;
    let ckpt = Checkpoint::open(src)?;
    let layout = ExpertLayout::from_checkpoint(&ckpt, &cfg)?;
    if out.exists() {
        let mut rd = std::fs::read_dir(out).map_err(|e| Error::io(out, e))?;
        if rd.next().is_some() {
            return Err(Error::config(
                out,
                "output folder exists and is not empty; refusing to overwrite",
            ));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let expert_names = layout.expert_tensor_names();
    let total: u64 = ckpt.tensors.values().map(|t| t.len).sum();
    let mut done = 0u64;

    // experts.bin
    let tmp = out.join(format!("{EXPERTS}.partial"));
    let mut f = std::io::BufWriter::with_capacity(
        8 << 20,
        std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?,
    );
    let mut pos = 0u64;
    let zeros = vec![0u8; ALIGN];
    let mut layers_json = Vec::new();
    for (l, experts) in layout.parts.iter().enumerate() {
        let Some(schema) = &layout.schemas[l] else {
            layers_json.push(serde_json::Value::Null);
            continue;
        };
        let mut offsets = Vec::with_capacity(experts.len());
        for parts in experts {
            offsets.push(pos);
            for p in parts {
                let file = &ckpt.files[p.loc.file];
                let bytes = &file.map[p.loc.offset as usize..(p.loc.offset + p.loc.len) as usize];
                f.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
                pos += p.loc.len;
                done += p.loc.len;
            }
            let pad = (ALIGN - (pos as usize % ALIGN)) % ALIGN;
            f.write_all(&zeros[..pad]).map_err(|e| Error::io(&tmp, e))?;
            pos += pad as u64;
            progress(done, total);
        }
        let parts: Vec<_> = schema
            .parts
            .iter()
            .map(|p| serde_json::json!({"role": role_name(p.role), "format": format_name(p.format), "len": p.len}))
            .collect();
        layers_json.push(serde_json::json!({"parts": parts, "offsets": offsets}));
    }
    let file = f
        .into_inner()
        .map_err(|e| Error::io(&tmp, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, out.join(EXPERTS)).map_err(|e| Error::io(out.join(EXPERTS), e))?;

    // dense.safetensors
    let dense: Vec<_> = ckpt
        .tensors
        .keys()
        .filter(|n| !expert_names.contains(n.as_str()))
        .map(|n| {
            let t = ckpt.get(n).expect("listed tensor");
            (t.name, t.dtype, t.shape, t.bytes)
        })
        .collect();
    let dense_path = out.join(DENSE);
    safetensors::write(&dense_path, &dense, None).map_err(|e| Error::io(&dense_path, e))?;
    done = total;
    progress(done, total);

    // small files
    let rd = std::fs::read_dir(src).map_err(|e| Error::io(src, e))?;
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let small = entry
            .metadata()
            .map(|m| m.is_file() && m.len() < (64 << 20))
            .unwrap_or(false);
        let skip = name.ends_with(".safetensors")
            || name == "model.safetensors.index.json"
            || name.starts_with("stormo-")
            || name.starts_with('.');
        if small && !skip {
            std::fs::copy(entry.path(), out.join(&name))
                .map_err(|e| Error::io(out.join(&name), e))?;
        }
    }
    let index = serde_json::json!({
        "format": "stormo-expert-store",
        "version": 1,
        "alignment": ALIGN,
        "experts_file": EXPERTS,
        "experts_len": pos,
        "layers": layers_json,
    });
    let ip = out.join(INDEX);
    std::fs::write(&ip, serde_json::to_vec_pretty(&index).expect("json"))
        .map_err(|e| Error::io(&ip, e))?;
    Ok(())
}

/// Reads a store's index into an [`ExpertLayout`] over its experts file, checking it against
/// the config: every part the family expects with the right length, every record inside the
/// file and aligned.
pub fn open(dir: &Path, cfg: &ModelConfig) -> Result<ExpertLayout> {
    let ip = dir.join(INDEX);
    let bad = |m: String| Error::config(&ip, m);
    let text = safetensors::read_small_text(&ip, safetensors::SMALL_FILE_MAX)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    if v["format"] != "stormo-expert-store" || v["version"] != 1 {
        return Err(bad("not a version 1 stormo-expert-store index".into()));
    }
    let name = v["experts_file"]
        .as_str()
        .ok_or_else(|| bad("no experts_file".into()))?;
    if name.contains('/') || name.contains("..") {
        return Err(bad(format!("unsafe experts_file {name:?}")));
    }
    let path: PathBuf = dir.join(name);
    let file_len = std::fs::metadata(&path)
        .map_err(|e| Error::io(&path, e))?
        .len();
    let want_len = v["experts_len"]
        .as_u64()
        .ok_or_else(|| bad("no experts_len".into()))?;
    if file_len != want_len {
        // Not a safetensors file: name the problem without calling it one.
        return Err(Error::io(
            &path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "expert store is {file_len} bytes, index says {want_len}: truncated or replaced"
                ),
            ),
        ));
    }
    let layers = v["layers"]
        .as_array()
        .ok_or_else(|| bad("no layers list".into()))?;
    if layers.len() != cfg.num_layers {
        return Err(bad(format!(
            "{} layers, config has {}",
            layers.len(),
            cfg.num_layers
        )));
    }
    let mut out = ExpertLayout {
        files: vec![(path, file_len)],
        ..ExpertLayout::default()
    };
    for (l, lv) in layers.iter().enumerate() {
        if lv.is_null() {
            if cfg.layer_moe[l] {
                return Err(bad(format!(
                    "layer {l} is MoE in config.json but has no experts in the store"
                )));
            }
            out.schemas.push(None);
            out.parts.push(Vec::new());
            continue;
        }
        let mut parts = Vec::new();
        for p in lv["parts"]
            .as_array()
            .ok_or_else(|| bad(format!("layer {l}: no parts")))?
        {
            let role = p["role"]
                .as_str()
                .and_then(role_from)
                .ok_or_else(|| bad(format!("layer {l}: bad part role {}", p["role"])))?;
            let format = p["format"]
                .as_str()
                .and_then(format_from)
                .ok_or_else(|| bad(format!("layer {l}: bad part format {}", p["format"])))?;
            let len = p["len"]
                .as_u64()
                .ok_or_else(|| bad(format!("layer {l}: bad part len")))?
                as usize;
            parts.push(PartSchema { role, format, len });
        }
        let schema = ExpertSchema {
            parts,
            hidden: cfg.hidden_size,
            intermediate: cfg.expert_intermediate,
            activation: cfg.activation,
        };
        crate::layout::check_schema(&schema, cfg).map_err(|m| bad(format!("layer {l}: {m}")))?;
        let offsets = lv["offsets"]
            .as_array()
            .ok_or_else(|| bad(format!("layer {l}: no offsets")))?;
        if offsets.len() != cfg.num_experts {
            return Err(bad(format!(
                "layer {l}: {} experts, config has {}",
                offsets.len(),
                cfg.num_experts
            )));
        }
        let rec = schema.expert_len() as u64;
        let mut experts = Vec::with_capacity(offsets.len());
        for (e, o) in offsets.iter().enumerate() {
            let off = o
                .as_u64()
                .ok_or_else(|| bad(format!("layer {l} expert {e}: bad offset")))?;
            if off % ALIGN as u64 != 0 || off.checked_add(rec).is_none_or(|end| end > file_len) {
                return Err(bad(format!("layer {l} expert {e}: record at {off} (+{rec}) is unaligned or outside the {file_len}-byte file")));
            }
            let mut at = off;
            experts.push(
                schema
                    .parts
                    .iter()
                    .map(|p| {
                        let loc = Loc {
                            file: 0,
                            offset: at,
                            len: p.len as u64,
                        };
                        at += p.len as u64;
                        PartLoc {
                            tensor: format!("{name}#{l}:{e}:{}", role_name(p.role)),
                            loc,
                        }
                    })
                    .collect(),
            );
        }
        out.schemas.push(Some(schema));
        out.parts.push(experts);
    }
    Ok(out)
}
