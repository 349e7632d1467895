//! GPT-OSS (`model_type: gpt_oss`): what is particular to the family.
//!
//! Architecture: pre-norm decoder; GQA attention with biases on q/k/v/o, YaRN RoPE
//! (rotate-half), a learned per-head attention sink, a 128-token sliding window on even layers;
//! a router with bias choosing top-k experts, softmax over the k chosen logits; experts with
//! a clipped SwiGLU on interleaved gate/up (gate ≤ 7, |up| ≤ 7, `(up + 1)·gate·σ(1.702·gate)`)
//! and biases; untied head. The shared forward lives in `model.rs`; this file says where the
//! experts are in the two published layouts:
//! - MXFP4 (the hub's): `mlp.experts.{gate_up,down}_proj_{blocks,scales}` plus bf16 biases;
//! - dense (`save_pretrained`): `mlp.experts.gate_up_proj` `[E, H, 2I]` and `down_proj`
//!   `[E, I, H]`, stored input-major, plus biases.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::layout::{split_fused, Loader, PartLoc};
use crate::moe::{ExpertSchema, PartFormat, Role};

pub(crate) fn expert_layout(
    ld: &Loader<'_>,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<(ExpertSchema, Vec<Vec<PartLoc>>)> {
    let (e, h, i) = (cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate);
    let p = format!("model.layers.{layer}.mlp.experts.");
    let mut schema = Vec::new();
    let mut parts = vec![Vec::new(); e];
    let blocks_name = format!("{p}gate_up_proj_blocks");
    let mxfp4 = cfg.mxfp4_experts || ld.has(&blocks_name);
    let n = |s: &str| format!("{p}{s}");
    if mxfp4 {
        let loc = ld.bytes(&blocks_name, &[e, 2 * i, h / 32, 16])?;
        split_fused(
            &blocks_name,
            loc,
            e,
            Role::GateUp,
            PartFormat::Mxfp4Blocks,
            &mut schema,
            &mut parts,
        );
        let name = n("gate_up_proj_scales");
        let loc = ld.bytes(&name, &[e, 2 * i, h / 32])?;
        split_fused(
            &name,
            loc,
            e,
            Role::GateUpScales,
            PartFormat::Mxfp4Scales,
            &mut schema,
            &mut parts,
        );
    } else {
        let name = n("gate_up_proj");
        let (fmt, loc) = ld.float(&name, &[e, h, 2 * i])?;
        split_fused(
            &name,
            loc,
            e,
            Role::GateUp,
            PartFormat::DenseT(fmt),
            &mut schema,
            &mut parts,
        );
    }
    let name = n("gate_up_proj_bias");
    let (fmt, loc) = ld.float(&name, &[e, 2 * i])?;
    split_fused(
        &name,
        loc,
        e,
        Role::GateUpBias,
        PartFormat::Dense(fmt),
        &mut schema,
        &mut parts,
    );
    if mxfp4 {
        let name = n("down_proj_blocks");
        let loc = ld.bytes(&name, &[e, h, i / 32, 16])?;
        split_fused(
            &name,
            loc,
            e,
            Role::Down,
            PartFormat::Mxfp4Blocks,
            &mut schema,
            &mut parts,
        );
        let name = n("down_proj_scales");
        let loc = ld.bytes(&name, &[e, h, i / 32])?;
        split_fused(
            &name,
            loc,
            e,
            Role::DownScales,
            PartFormat::Mxfp4Scales,
            &mut schema,
            &mut parts,
        );
    } else {
        let name = n("down_proj");
        let (fmt, loc) = ld.float(&name, &[e, i, h])?;
        split_fused(
            &name,
            loc,
            e,
            Role::Down,
            PartFormat::DenseT(fmt),
            &mut schema,
            &mut parts,
        );
    }
    let name = n("down_proj_bias");
    let (fmt, loc) = ld.float(&name, &[e, h])?;
    split_fused(
        &name,
        loc,
        e,
        Role::DownBias,
        PartFormat::Dense(fmt),
        &mut schema,
        &mut parts,
    );
    Ok((
        ExpertSchema {
            parts: schema,
            hidden: h,
            intermediate: i,
            activation: cfg.activation,
        },
        parts,
    ))
}
