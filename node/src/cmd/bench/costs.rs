//! What a token of the model costs, counted from its checkpoint: the floating-point
//! operations of a prompt token and of the head (against the peak, for prefill) and the bytes
//! a decoded token must read, in all and phase by phase (against the memory and the kernels,
//! for decode). Pure counting: nothing here is timed.

use stormo_engine::profile::{self, Phase};
use stormo_engine::ModelFiles;

/// What one token costs, counted once before the model's files are closed.
#[derive(Debug)]
pub(super) struct Costs {
    /// Floating-point operations per prompt token ([`prefill_flops`]).
    pub(super) flops_tok: f64,
    /// Those of the head, once per prefill.
    pub(super) flops_head: f64,
    /// Bytes a decoded token reads ([`bytes_per_token`]; the head through its screen unless
    /// `--full-head`).
    pub(super) bpt: u64,
    /// The same with the whole head computed.
    pub(super) bpt_full_head: u64,
    /// The experts' share of [`Self::bpt`].
    pub(super) expert_bpt: u64,
    /// Whether the experts are MXFP4 (else as wide as the dense weights).
    pub(super) experts_mxfp4: bool,
    /// [`Self::bpt`] by phase, in [`Phase::ALL`]'s order.
    pub(super) per_phase: [u64; profile::N],
}

impl Costs {
    /// The costs of the model in `files`, its attention and head read from 8-bit copies when
    /// `int8_attn_head`, its head through the 8-bit screen when `screened_head`.
    pub(super) fn of(files: &ModelFiles, int8_attn_head: bool, screened_head: bool) -> Self {
        let (flops_tok, flops_head) = prefill_flops(&files.cfg);
        let (expert_bpt, experts_mxfp4) = expert_bytes_per_token(files);
        Self {
            flops_tok,
            flops_head,
            bpt: bytes_per_token(files, int8_attn_head, screened_head),
            bpt_full_head: bytes_per_token(files, int8_attn_head, false),
            expert_bpt,
            experts_mxfp4,
            per_phase: phase_bytes(files, int8_attn_head, screened_head),
        }
    }
}

/// Floating-point operations of the matrix products one prompt token costs (two per weight
/// it multiplies: attention projections, router, top-k experts or the dense MLP), and those of
/// the head, paid once per prefill. Attention over the cache is left out (a few percent at
/// these prompt lengths).
pub fn prefill_flops(cfg: &stormo_engine::ModelConfig) -> (f64, f64) {
    let h = cfg.hidden_size as f64;
    let attn = h * cfg.head_dim as f64 * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) as f64;
    let per_layer = |moe: bool| {
        if moe {
            attn + h * cfg.num_experts as f64
                + 3.0 * h * (cfg.expert_intermediate * cfg.top_k) as f64
        } else {
            attn + 3.0 * h * cfg.dense_intermediate as f64
        }
    };
    let weights: f64 = (0..cfg.num_layers)
        .map(|l| per_layer(cfg.layer_moe.get(l).copied().unwrap_or(true)))
        .sum();
    (2.0 * weights, 2.0 * h * cfg.vocab_size as f64)
}

/// Bytes each decoded token must read: every dense weight except the embedding table (one row),
/// the head, and top-k experts in every MoE layer.
pub fn bytes_per_token(files: &ModelFiles, int8_attn_head: bool, screened_head: bool) -> u64 {
    phase_bytes(files, int8_attn_head, screened_head)
        .iter()
        .sum()
}

/// [`bytes_per_token`] by the phase of the forward pass that reads them, in
/// [`Phase::ALL`]'s order: the attention's norm and q/k/v, its sinks, its output projection,
/// the MLP's norm and router, the experts (or dense MLP), and the embedding row, final norm
/// and head.
pub fn phase_bytes(
    files: &ModelFiles,
    int8_attn_head: bool,
    screened_head: bool,
) -> [u64; profile::N] {
    let cfg = &files.cfg;
    let expert_names = files.layout.expert_tensor_names();
    let mut bytes = [0u64; profile::N];
    let mut add = |p: Phase, n: u64| bytes[profile::index(p)] += n;
    // With 8-bit copies, a matrix of `n` elements reads `n` bytes and one f32 per row.
    let int8 = |t: &stormo_engine::safetensors::TensorInfo| -> u64 {
        let elems: u64 = t.shape.iter().map(|&d| d as u64).product();
        elems + 4 * t.shape.first().copied().unwrap_or(0) as u64
    };
    let is_attn = |name: &str| {
        ["q_proj", "k_proj", "v_proj", "o_proj"]
            .iter()
            .any(|p| name.ends_with(&format!("self_attn.{p}.weight")))
    };
    let phase_of = |name: &str| {
        let has = |parts: &[&str]| parts.iter().any(|p| name.contains(p));
        if has(&[
            "q_proj",
            "k_proj",
            "v_proj",
            "q_norm",
            "k_norm",
            "input_layernorm",
        ]) {
            Phase::Qkv
        } else if has(&["o_proj"]) {
            Phase::OProj
        } else if has(&["sinks"]) {
            Phase::Attend
        } else if has(&["post_attention_layernorm", "router", "mlp.gate.weight"]) {
            Phase::Router
        } else if has(&["lm_head", "embed_tokens", "model.norm"]) {
            Phase::Head
        } else {
            Phase::Experts
        }
    };
    for (name, t) in &files.ckpt.tensors {
        if expert_names.contains(name.as_str()) {
            continue;
        }
        let head = name == "lm_head.weight";
        if name == "model.embed_tokens.weight" {
            // One row looked up per token; when tied it is also the head.
            add(Phase::Head, t.len / cfg.vocab_size.max(1) as u64);
            if cfg.tie_word_embeddings && !files.ckpt.tensors.contains_key("lm_head.weight") {
                add(
                    Phase::Head,
                    if int8_attn_head || screened_head {
                        int8(t)
                    } else {
                        t.len
                    },
                );
            }
        } else if (int8_attn_head && (head || is_attn(name))) || (screened_head && head) {
            add(phase_of(name), int8(t));
        } else {
            add(phase_of(name), t.len);
        }
    }
    add(Phase::Experts, expert_bytes_per_token(files).0);
    bytes
}

/// The experts' share of [`bytes_per_token`], and whether they are MXFP4 (else as wide as
/// the dense weights).
pub fn expert_bytes_per_token(files: &ModelFiles) -> (u64, bool) {
    let bytes = files
        .layout
        .sizes()
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| l[0] * files.cfg.top_k as u64)
        .sum();
    let mxfp4 = files.layout.schemas.iter().flatten().any(|s| {
        s.parts
            .iter()
            .any(|p| p.format == stormo_engine::moe::PartFormat::Mxfp4Blocks)
    });
    (bytes, mxfp4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss-20b's prefill cost, counted by hand from its published geometry: attention
    /// 2880 x 64 x (2 x 64 + 2 x 8) weights, router 32 x 2880, four experts of 3 x 2880 x 2880,
    /// over 24 layers, two FLOPs per weight; the head 2 x 2880 x 201088 once.
    #[test]
    fn prefill_flops_at_gpt_oss_20b_geometry() {
        let text = stormo_engine::config::GPT_OSS_20B_CONFIG;
        let cfg =
            stormo_engine::ModelConfig::from_json_str(text, std::path::Path::new("config.json"))
                .expect("a gpt-oss config");
        let (tok, head) = prefill_flops(&cfg);
        let per_layer = 2880 * 64 * (128 + 16) + 32 * 2880 + 4 * 3 * 2880 * 2880;
        assert_eq!(tok, 2.0 * 24.0 * per_layer as f64);
        assert!((tok / 1e9 - 6.056).abs() < 1e-3, "{tok}");
        assert_eq!(head, 2.0 * 2880.0 * 201_088.0);
    }
}
