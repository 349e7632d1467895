//! Qwen3-MoE (`model_type: qwen3_moe`): what is particular to the family.
//!
//! Architecture: pre-norm decoder; GQA attention without biases or sinks, with QK-norm (an
//! RMSNorm over head_dim on q and k, before RoPE), plain RoPE; a bias-free router whose softmax
//! over all experts is taken before top-k and optionally renormalised (`norm_topk_prob`);
//! plain SwiGLU experts stored one tensor per expert and projection; dense SwiGLU MLPs on the
//! layers `mlp_only_layers`/`decoder_sparse_step` name; optionally tied embeddings.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::layout::{Loader, PartLoc};
use crate::moe::{ExpertSchema, PartFormat, PartSchema, Role};

pub(crate) fn expert_layout(
    ld: &Loader<'_>,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<(ExpertSchema, Vec<Vec<PartLoc>>)> {
    let (e, h, i) = (cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate);
    let mut schema: Vec<PartSchema> = Vec::new();
    let mut parts = Vec::with_capacity(e);
    for ex in 0..e {
        let mut mine = Vec::with_capacity(3);
        for (k, (role, shape)) in [
            (Role::Gate, [i, h]),
            (Role::Up, [i, h]),
            (Role::Down, [h, i]),
        ]
        .into_iter()
        .enumerate()
        {
            let proj = match role {
                Role::Gate => "gate_proj",
                Role::Up => "up_proj",
                _ => "down_proj",
            };
            let name = format!("model.layers.{layer}.mlp.experts.{ex}.{proj}.weight");
            let (fmt, loc) = ld.float(&name, &shape)?;
            if ex == 0 {
                schema.push(PartSchema {
                    role,
                    format: PartFormat::Dense(fmt),
                    len: loc.len as usize,
                });
            } else if schema[k].format != PartFormat::Dense(fmt) {
                return Err(Error::Dtype {
                    name,
                    expected: format!("{:?} like expert 0 of the layer", schema[k].format),
                    found: format!("{fmt:?}"),
                });
            }
            mine.push(PartLoc { tensor: name, loc });
        }
        parts.push(mine);
    }
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
