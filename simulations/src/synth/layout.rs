//! The plan of a checkpoint: tensors in the hub's order, their values' distributions, shards,
//! safetensors headers, and the JSON files beside them.

use serde_json::{json, Value};
use stormo_engine::safetensors::Dtype;
use stormo_engine::Family;

use super::pyjson;
use super::rng;
use super::{Geometry, SynthOptions};

/// Hub-sized shards: the largest shard's tensor data, in bytes.
const GPT_OSS_SHARD_BYTES: u64 = 4_800_000_000;
const QWEN3_SHARD_BYTES: u64 = 4_000_000_000;

/// How a tensor's values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Fill {
    /// BF16: element `i` is `mean + shift[i] + std · z`, z ~ N(0, 1) (an empty `shift` is 0).
    Bf16 {
        mean: f32,
        std: f32,
        shift: Vec<f32>,
    },
    /// U8 MXFP4 blocks: two random FP4 codes per byte.
    Fp4Blocks,
    /// U8 E8M0 scales: `lo` or `lo + 1`, the latter when a u32 draw is below `threshold`.
    E8m0 { lo: u8, threshold: u32 },
}

impl Fill {
    fn normal(mean: f32, std: f32) -> Self {
        Self::Bf16 {
            mean,
            std,
            shift: Vec::new(),
        }
    }

    /// Writes bytes `[start, start + out.len())` of a tensor drawn from stream `key`.
    pub(crate) fn fill(&self, key: u64, start: u64, out: &mut [u8]) {
        match self {
            Self::Bf16 { mean, std, shift } => {
                // Byte ranges handed out by the writer are even; a stray odd start would only
                // shift which half of an element is written, never change an element's value.
                let first = start / 2;
                let skip = (start % 2) as usize;
                let mut i = first;
                let mut pos = 0usize;
                while pos < out.len() {
                    let sh = shift.get(i as usize).copied().unwrap_or(0.0);
                    let v = mean + sh + std * rng::gauss(rng::draw(key, i));
                    let b = rng::bf16_bits(v).to_le_bytes();
                    let from = if pos == 0 { skip } else { 0 };
                    for &byte in &b[from..] {
                        if pos < out.len() {
                            out[pos] = byte;
                            pos += 1;
                        }
                    }
                    i += 1;
                }
            }
            Self::Fp4Blocks => {
                let t = &rng::NIBBLE_OF_BYTE;
                let byte_at = |k: u64, r: u64| {
                    let lane = (k % 4) * 16;
                    let lo = t[((r >> lane) & 0xFF) as usize];
                    let hi = t[((r >> (lane + 8)) & 0xFF) as usize];
                    lo | (hi << 4)
                };
                let mut k = start;
                let mut pos = 0usize;
                // Unaligned head, one byte at a time.
                while pos < out.len() && !k.is_multiple_of(4) {
                    out[pos] = byte_at(k, rng::draw(key, k / 4));
                    pos += 1;
                    k += 1;
                }
                // Four bytes per draw.
                let body = (out.len() - pos) / 4 * 4;
                for quad in out[pos..pos + body].chunks_exact_mut(4) {
                    let r = rng::draw(key, k / 4);
                    for (j, o) in quad.iter_mut().enumerate() {
                        *o = byte_at(k + j as u64, r);
                    }
                    k += 4;
                }
                pos += body;
                while pos < out.len() {
                    out[pos] = byte_at(k, rng::draw(key, k / 4));
                    pos += 1;
                    k += 1;
                }
            }
            Self::E8m0 { lo, threshold } => {
                for (j, o) in out.iter_mut().enumerate() {
                    let r = rng::draw(key, start + j as u64) as u32;
                    *o = lo + u8::from(r < *threshold);
                }
            }
        }
    }
}

/// One tensor of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    /// Name, as in the published checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Byte length.
    pub len: u64,
    /// Which shard holds it.
    pub shard: usize,
    /// Byte offset of its data from the start of the shard's data section.
    pub offset: u64,
    pub(crate) fill: Fill,
    pub(crate) key: u64,
}

/// One safetensors file of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPlan {
    /// File name (`model-00000-of-00002.safetensors`).
    pub file_name: String,
    /// Indices into [`Plan::tensors`], in file order.
    pub tensors: Vec<usize>,
    /// The whole header: the 8-byte little-endian length, then the padded JSON.
    pub header: Vec<u8>,
    /// Bytes of tensor data after the header.
    pub data_len: u64,
}

impl ShardPlan {
    /// The file's size in bytes.
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }
}

/// A whole checkpoint, laid out but not yet written.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// What it was planned from.
    pub options: SynthOptions,
    /// Every tensor, in the index's order.
    pub tensors: Vec<TensorPlan>,
    /// The shards.
    pub shards: Vec<ShardPlan>,
    /// Per layer, the hot experts (empty without skew).
    pub hot_experts: Vec<Vec<usize>>,
}

impl Plan {
    /// Sum of all tensors' bytes (the index's `metadata.total_size`).
    pub fn total_size(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Sum of all shard files' sizes (headers included).
    pub fn files_size(&self) -> u64 {
        self.shards.iter().map(ShardPlan::file_len).sum()
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorPlan> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Generates bytes `[start, start + out.len())` of tensor `index` (any range, same bytes).
    ///
    /// # Panics
    /// If the range lies outside the tensor.
    pub fn fill(&self, index: usize, start: u64, out: &mut [u8]) {
        let t = &self.tensors[index];
        assert!(
            start + out.len() as u64 <= t.len,
            "range {start}+{} outside tensor {} of {} bytes",
            out.len(),
            t.name,
            t.len
        );
        t.fill.fill(t.key, start, out);
    }

    /// `model.safetensors.index.json`, formatted as the hub's.
    pub fn index_json(&self) -> String {
        let total = json!({ "total_size": self.total_size() });
        match self.options.geometry.family {
            Family::GptOss => {
                // The convert script's `json.dump`: one line, default separators, the
                // weight_map in the order tensors were written.
                let map = pyjson::ordered_object_line(
                    self.tensors
                        .iter()
                        .map(|t| (t.name.as_str(), self.shards[t.shard].file_name.as_str())),
                );
                let head = pyjson::dumps_line(&[("metadata", total)]);
                format!("{}, \"weight_map\": {map}}}", &head[..head.len() - 1])
            }
            Family::Qwen3Moe => {
                // Transformers' save_pretrained: indent=2, sorted keys, trailing newline.
                let mut map = serde_json::Map::new();
                for t in &self.tensors {
                    map.insert(
                        t.name.clone(),
                        Value::String(self.shards[t.shard].file_name.clone()),
                    );
                }
                let v = json!({ "metadata": total, "weight_map": map });
                pyjson::dumps_indented(&v) + "\n"
            }
        }
    }

    /// `config.json` as the hub ships it (with this plan's geometry).
    pub fn config_json(&self) -> String {
        pyjson::dumps_indented(&config_value(&self.options.geometry)) + "\n"
    }

    /// `generation_config.json` as the hub ships it.
    pub fn generation_config_json(&self) -> String {
        let g = &self.options.geometry;
        let v = match g.family {
            Family::GptOss => json!({
                "bos_token_id": special(199_998, g.vocab, 3),
                "do_sample": true,
                "eos_token_id": [special(200_002, g.vocab, 1), special(199_999, g.vocab, 2), special(200_012, g.vocab, 4)],
                "pad_token_id": special(199_999, g.vocab, 2),
                "transformers_version": "4.55.0.dev0",
            }),
            Family::Qwen3Moe => json!({
                "bos_token_id": special(151_643, g.vocab, 2),
                "do_sample": true,
                "eos_token_id": [special(151_645, g.vocab, 1), special(151_643, g.vocab, 2)],
                "pad_token_id": special(151_643, g.vocab, 2),
                "temperature": 0.6,
                "top_k": 20,
                "top_p": 0.95,
                "transformers_version": "4.51.0",
            }),
        };
        pyjson::dumps_indented(&v) + "\n"
    }
}

/// A special token id: the published one if the vocabulary holds it, else the `from_end`-th
/// id from the end (so a reduced vocabulary still names valid eos/pad/bos ids).
fn special(id: usize, vocab: usize, from_end: usize) -> usize {
    if id < vocab {
        id
    } else {
        vocab.saturating_sub(from_end)
    }
}

fn config_value(g: &Geometry) -> Value {
    match g.family {
        Family::GptOss => {
            let layer_types: Vec<&str> = (0..g.layers)
                .map(|i| {
                    if i % 2 == 0 {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            json!({
                "architectures": ["GptOssForCausalLM"],
                "attention_bias": true,
                "attention_dropout": 0.0,
                "eos_token_id": special(200_002, g.vocab, 1),
                "experts_per_token": g.top_k,
                "head_dim": g.head_dim,
                "hidden_act": "silu",
                "hidden_size": g.hidden,
                "initial_context_length": 4096,
                "initializer_range": 0.02,
                "intermediate_size": g.intermediate,
                "layer_types": layer_types,
                "max_position_embeddings": 131_072,
                "model_type": "gpt_oss",
                "num_attention_heads": g.heads,
                "num_experts_per_tok": g.top_k,
                "num_hidden_layers": g.layers,
                "num_key_value_heads": g.kv_heads,
                "num_local_experts": g.experts,
                "output_router_logits": false,
                "pad_token_id": special(199_999, g.vocab, 2),
                "quantization_config": {
                    "modules_to_not_convert": [
                        "model.layers.*.self_attn",
                        "model.layers.*.mlp.router",
                        "model.embed_tokens",
                        "lm_head"
                    ],
                    "quant_method": "mxfp4"
                },
                "rms_norm_eps": 1e-05,
                "rope_scaling": {
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "factor": 32.0,
                    "original_max_position_embeddings": 4096,
                    "rope_type": "yarn",
                    "truncate": false
                },
                "rope_theta": 150_000,
                "router_aux_loss_coef": 0.9,
                "sliding_window": 128,
                "swiglu_limit": 7.0,
                "tie_word_embeddings": false,
                "transformers_version": "4.55.0.dev0",
                "use_cache": true,
                "vocab_size": g.vocab,
            })
        }
        Family::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": special(151_643, g.vocab, 2),
            "decoder_sparse_step": 1,
            "eos_token_id": special(151_645, g.vocab, 1),
            "head_dim": g.head_dim,
            "hidden_act": "silu",
            "hidden_size": g.hidden,
            "initializer_range": 0.02,
            "intermediate_size": g.dense_intermediate.max(1),
            "max_position_embeddings": 40_960,
            "max_window_layers": g.layers,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": g.intermediate,
            "norm_topk_prob": true,
            "num_attention_heads": g.heads,
            "num_experts": g.experts,
            "num_experts_per_tok": g.top_k,
            "num_hidden_layers": g.layers,
            "num_key_value_heads": g.kv_heads,
            "output_router_logits": false,
            "rms_norm_eps": 1e-06,
            "rope_scaling": null,
            "rope_theta": 1_000_000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": true,
            "use_sliding_window": false,
            "vocab_size": g.vocab,
        }),
    }
}

/// The hot experts of `layer`: the `n` experts with the smallest seeded hash.
fn hot_set(seed: u64, layer: usize, experts: usize, fraction: f64) -> Vec<usize> {
    let n = ((fraction * experts as f64).ceil() as usize).clamp(1, experts);
    let k = rng::key(seed, &format!("hot-experts.{layer}"));
    let mut order: Vec<usize> = (0..experts).collect();
    order.sort_by_key(|&e| rng::draw(k, e as u64));
    let mut hot = order[..n].to_vec();
    hot.sort_unstable();
    hot
}

struct Builder {
    seed: u64,
    out: Vec<(String, Dtype, Vec<usize>, Fill)>,
}

impl Builder {
    fn push(&mut self, name: String, dtype: Dtype, shape: Vec<usize>, fill: Fill) {
        self.out.push((name, dtype, shape, fill));
    }
    fn bf16(&mut self, name: String, shape: Vec<usize>, mean: f32, std: f32) {
        self.push(name, Dtype::BF16, shape, Fill::normal(mean, std));
    }
    /// A linear weight `[out, in]` ~ N(0, 1/in).
    fn linear(&mut self, name: String, out: usize, inp: usize) {
        self.bf16(name, vec![out, inp], 0.0, (1.0 / inp as f64).sqrt() as f32);
    }
}

const EMBED_STD: f32 = 0.02;
const NORM_STD: f32 = 0.05;
const BIAS_STD: f32 = 0.02;
const SINK_STD: f32 = 0.5;

fn gpt_oss_layer(b: &mut Builder, g: &Geometry, l: usize, hot: &[usize], hot_bias: f32) {
    let p = format!("model.layers.{l}.");
    let (h, e, i) = (g.hidden, g.experts, g.intermediate);
    let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
    // The order of the published index (SPEC §4.1).
    b.bf16(format!("{p}input_layernorm.weight"), vec![h], 1.0, NORM_STD);
    b.bf16(format!("{p}self_attn.o_proj.bias"), vec![h], 0.0, BIAS_STD);
    b.linear(format!("{p}self_attn.o_proj.weight"), h, q);
    b.bf16(format!("{p}self_attn.q_proj.bias"), vec![q], 0.0, BIAS_STD);
    b.bf16(format!("{p}self_attn.k_proj.bias"), vec![kv], 0.0, BIAS_STD);
    b.bf16(format!("{p}self_attn.v_proj.bias"), vec![kv], 0.0, BIAS_STD);
    b.linear(format!("{p}self_attn.q_proj.weight"), q, h);
    b.linear(format!("{p}self_attn.k_proj.weight"), kv, h);
    b.linear(format!("{p}self_attn.v_proj.weight"), kv, h);
    b.bf16(format!("{p}self_attn.sinks"), vec![g.heads], 0.0, SINK_STD);
    let mut shift = vec![0.0; e];
    for &x in hot {
        shift[x] = hot_bias;
    }
    b.push(
        format!("{p}mlp.router.bias"),
        Dtype::BF16,
        vec![e],
        Fill::Bf16 {
            mean: 0.0,
            std: BIAS_STD,
            shift,
        },
    );
    b.linear(format!("{p}mlp.router.weight"), e, h);
    let x = format!("{p}mlp.experts.");
    for (proj, rows, cols) in [("gate_up_proj", 2 * i, h), ("down_proj", h, i)] {
        b.bf16(format!("{x}{proj}_bias"), vec![e, rows], 0.0, BIAS_STD);
        b.push(
            format!("{x}{proj}_blocks"),
            Dtype::U8,
            vec![e, rows, cols / 32, 16],
            Fill::Fp4Blocks,
        );
        let (lo, threshold) = rng::e8m0_for_std((1.0 / cols as f64).sqrt());
        b.push(
            format!("{x}{proj}_scales"),
            Dtype::U8,
            vec![e, rows, cols / 32],
            Fill::E8m0 { lo, threshold },
        );
    }
    b.bf16(
        format!("{p}post_attention_layernorm.weight"),
        vec![h],
        1.0,
        NORM_STD,
    );
}

fn qwen3_layer(b: &mut Builder, g: &Geometry, l: usize) {
    let p = format!("model.layers.{l}.");
    let (h, e, i) = (g.hidden, g.experts, g.intermediate);
    let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
    b.bf16(format!("{p}input_layernorm.weight"), vec![h], 1.0, NORM_STD);
    b.linear(format!("{p}self_attn.q_proj.weight"), q, h);
    b.linear(format!("{p}self_attn.k_proj.weight"), kv, h);
    b.linear(format!("{p}self_attn.v_proj.weight"), kv, h);
    b.linear(format!("{p}self_attn.o_proj.weight"), h, q);
    b.bf16(
        format!("{p}self_attn.q_norm.weight"),
        vec![g.head_dim],
        1.0,
        NORM_STD,
    );
    b.bf16(
        format!("{p}self_attn.k_norm.weight"),
        vec![g.head_dim],
        1.0,
        NORM_STD,
    );
    b.bf16(
        format!("{p}post_attention_layernorm.weight"),
        vec![h],
        1.0,
        NORM_STD,
    );
    b.linear(format!("{p}mlp.gate.weight"), e, h);
    for x in 0..e {
        let n = format!("{p}mlp.experts.{x}.");
        b.linear(format!("{n}gate_proj.weight"), i, h);
        b.linear(format!("{n}up_proj.weight"), i, h);
        b.linear(format!("{n}down_proj.weight"), h, i);
    }
}

pub(crate) fn build(opts: &SynthOptions) -> Plan {
    let g = &opts.geometry;
    let hot_experts: Vec<Vec<usize>> = (0..g.layers)
        .map(|l| match opts.hot {
            Some(hx) => hot_set(opts.seed, l, g.experts, hx.fraction),
            None => Vec::new(),
        })
        .collect();
    let hot_bias = opts.hot.map_or(0.0, |h| h.bias);
    let mut b = Builder {
        seed: opts.seed,
        out: Vec::new(),
    };
    match g.family {
        Family::GptOss => {
            // The convert script walks layers in the order of their names as strings
            // (0, 1, 10, 11, ..., 19, 2, 20, ...), then the embedding, final norm and head.
            let mut layers: Vec<usize> = (0..g.layers).collect();
            layers.sort_by_key(|l| l.to_string());
            for l in layers {
                gpt_oss_layer(&mut b, g, l, &hot_experts[l], hot_bias);
            }
            b.bf16(
                "model.embed_tokens.weight".into(),
                vec![g.vocab, g.hidden],
                0.0,
                EMBED_STD,
            );
            b.bf16("model.norm.weight".into(), vec![g.hidden], 1.0, NORM_STD);
            b.linear("lm_head.weight".into(), g.vocab, g.hidden);
        }
        Family::Qwen3Moe => {
            b.bf16(
                "model.embed_tokens.weight".into(),
                vec![g.vocab, g.hidden],
                0.0,
                EMBED_STD,
            );
            for l in 0..g.layers {
                qwen3_layer(&mut b, g, l);
            }
            b.bf16("model.norm.weight".into(), vec![g.hidden], 1.0, NORM_STD);
            b.linear("lm_head.weight".into(), g.vocab, g.hidden);
        }
    }
    let seed = b.seed;
    let mut tensors: Vec<TensorPlan> = b
        .out
        .into_iter()
        .map(|(name, dtype, shape, fill)| {
            let len = shape.iter().map(|&d| d as u64).product::<u64>() * dtype.size() as u64;
            TensorPlan {
                key: rng::key(seed, &name),
                name,
                dtype,
                shape,
                len,
                shard: 0,
                offset: 0,
                fill,
            }
        })
        .collect();

    // Greedy shards in index order.
    let limit = opts.shard_bytes.unwrap_or(match g.family {
        Family::GptOss => GPT_OSS_SHARD_BYTES,
        Family::Qwen3Moe => QWEN3_SHARD_BYTES,
    });
    let mut members: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0u64;
    for (idx, t) in tensors.iter_mut().enumerate() {
        if used > 0 && used + t.len > limit {
            members.push(Vec::new());
            used = 0;
        }
        used += t.len;
        t.shard = members.len() - 1;
        members.last_mut().expect("at least one shard").push(idx);
    }
    let n = members.len();
    let shards = members
        .into_iter()
        .enumerate()
        .map(|(s, mut idxs)| {
            // safetensors' save_file order: wider dtypes first, then by name.
            idxs.sort_by(|&a, &b| {
                let (ta, tb) = (&tensors[a], &tensors[b]);
                tb.dtype
                    .size()
                    .cmp(&ta.dtype.size())
                    .then_with(|| ta.name.cmp(&tb.name))
            });
            let mut offset = 0u64;
            let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
            for &i in &idxs {
                let t = &mut tensors[i];
                t.offset = offset;
                header.push_str(&format!(
                    ",{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                    serde_json::to_string(&t.name).expect("a string serialises"),
                    t.dtype.as_str(),
                    serde_json::to_string(&t.shape).expect("a shape serialises"),
                    offset,
                    offset + t.len
                ));
                offset += t.len;
            }
            header.push('}');
            while header.len() % 8 != 0 {
                header.push(' ');
            }
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            let file_name = match g.family {
                Family::GptOss => format!("model-{s:05}-of-{:05}.safetensors", n - 1),
                Family::Qwen3Moe => format!("model-{:05}-of-{n:05}.safetensors", s + 1),
            };
            ShardPlan {
                file_name,
                tensors: idxs,
                header: bytes,
                data_len: offset,
            }
        })
        .collect();
    Plan {
        options: opts.clone(),
        tensors,
        shards,
        hot_experts,
    }
}

#[cfg(test)]
mod tests {
    use super::super::{plan, HotExperts, Overrides, Preset, SynthOptions};
    use super::*;

    fn tiny_gpt() -> SynthOptions {
        let g = Preset::GptOss20b.geometry().with(&Overrides {
            layers: Some(2),
            hidden: Some(64),
            intermediate: Some(64),
            experts: Some(4),
            vocab: Some(300),
            heads: Some(4),
            kv_heads: Some(2),
            head_dim: Some(16),
            ..Overrides::default()
        });
        SynthOptions::new(g, 5)
    }

    /// The published gpt-oss-20b index (openai/gpt-oss-20b, model.safetensors.index.json):
    /// total_size 13,761,264,768, three shards, the first ending inside layer 18 after
    /// `v_proj.bias`, the second inside layer 6 after `gate_up_proj_bias`.
    #[test]
    fn gpt_oss_20b_matches_the_published_index() {
        let p = plan(&SynthOptions::new(Preset::GptOss20b.geometry(), 0)).unwrap();
        assert_eq!(p.total_size(), 13_761_264_768);
        let names: Vec<&str> = p.shards.iter().map(|s| s.file_name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model-00000-of-00002.safetensors",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        let shard = |n: &str| p.tensor(n).unwrap().shard;
        assert_eq!(shard("model.layers.18.self_attn.v_proj.bias"), 0);
        assert_eq!(shard("model.layers.18.self_attn.q_proj.weight"), 1);
        assert_eq!(shard("model.layers.6.mlp.experts.gate_up_proj_bias"), 1);
        assert_eq!(shard("model.layers.6.mlp.experts.gate_up_proj_blocks"), 2);
        assert_eq!(shard("lm_head.weight"), 2);
        let index = p.index_json();
        assert!(index.starts_with(
            "{\"metadata\": {\"total_size\": 13761264768}, \"weight_map\": {\"model.layers.0.input_layernorm.weight\": \"model-00000-of-00002.safetensors\", \"model.layers.0.self_attn.o_proj.bias\""
        ), "{}", &index[..200]);
        assert!(index.ends_with("\"lm_head.weight\": \"model-00002-of-00002.safetensors\"}}"));
    }

    #[test]
    fn mxfp4_shapes_are_the_published_ones() {
        let p = plan(&SynthOptions::new(Preset::GptOss120b.geometry(), 0)).unwrap();
        let t = |n: &str| p.tensor(n).unwrap();
        let e = "model.layers.35.mlp.experts.";
        assert_eq!(
            t(&format!("{e}gate_up_proj_blocks")).shape,
            [128, 5760, 90, 16]
        );
        assert_eq!(t(&format!("{e}gate_up_proj_scales")).shape, [128, 5760, 90]);
        assert_eq!(
            t(&format!("{e}down_proj_blocks")).shape,
            [128, 2880, 90, 16]
        );
        assert_eq!(t(&format!("{e}down_proj_scales")).shape, [128, 2880, 90]);
        for n in ["blocks", "scales"] {
            assert_eq!(t(&format!("{e}down_proj_{n}")).dtype, Dtype::U8);
        }
        for n in [
            "model.layers.3.self_attn.sinks",
            "model.layers.3.mlp.router.bias",
            "model.layers.3.mlp.experts.down_proj_bias",
            "model.norm.weight",
        ] {
            assert_eq!(t(n).dtype, Dtype::BF16, "{n}");
        }
        // 60.8 GiB, as published.
        let gib = p.total_size() as f64 / (1u64 << 30) as f64;
        assert!((gib - 60.8).abs() < 0.05, "{gib}");
    }

    #[test]
    fn qwen3_has_one_tensor_per_expert_and_hub_shard_names() {
        let p = plan(&SynthOptions::new(Preset::Qwen3_30bA3b.geometry(), 0)).unwrap();
        let t = p
            .tensor("model.layers.47.mlp.experts.127.down_proj.weight")
            .unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice()),
            (Dtype::BF16, &[2048, 768][..])
        );
        assert_eq!(
            p.tensor("model.layers.0.mlp.gate.weight").unwrap().shape,
            [128, 2048]
        );
        assert_eq!(p.shards[0].file_name, "model-00001-of-00016.safetensors");
        assert_eq!(p.shards.len(), 16);
        assert!(p.tensors.iter().all(|t| t.dtype == Dtype::BF16));
        assert!(p.config_json().contains("\"rms_norm_eps\": 1e-06,\n"));
    }

    #[test]
    fn shard_headers_parse_and_tile_the_data() {
        let mut o = tiny_gpt();
        o.shard_bytes = Some(20_000);
        let p = plan(&o).unwrap();
        assert!(p.shards.len() > 2);
        for s in &p.shards {
            let infos = stormo_engine::safetensors::parse_header(
                std::path::Path::new(&s.file_name),
                &s.header,
                s.file_len(),
                0,
            )
            .unwrap();
            assert_eq!(infos.len(), s.tensors.len());
            assert_eq!(s.header.len() % 8, 0);
            let covered: u64 = infos.iter().map(|(_, i)| i.len).sum();
            assert_eq!(covered, s.data_len);
        }
    }

    #[test]
    fn fill_does_not_depend_on_chunking() {
        let p = plan(&tiny_gpt()).unwrap();
        for (i, t) in p.tensors.iter().enumerate() {
            let mut whole = vec![0u8; t.len as usize];
            p.fill(i, 0, &mut whole);
            let mut pieces = vec![0u8; t.len as usize];
            let mut at = 0usize;
            for (j, step) in [1usize, 3, 2, 7, 64, 5].iter().cycle().enumerate() {
                if at >= pieces.len() {
                    break;
                }
                let end = (at + step + j % 3).min(pieces.len());
                p.fill(i, at as u64, &mut pieces[at..end]);
                at = end;
            }
            assert_eq!(whole, pieces, "{}", t.name);
        }
    }

    #[test]
    fn dequantised_experts_have_the_target_scale() {
        let p = plan(&tiny_gpt()).unwrap();
        let get = |n: &str| {
            let i = p.tensors.iter().position(|t| t.name == n).unwrap();
            let mut b = vec![0u8; p.tensors[i].len as usize];
            p.fill(i, 0, &mut b);
            b
        };
        let e = "model.layers.1.mlp.experts.gate_up_proj_";
        let (blocks, scales) = (get(&format!("{e}blocks")), get(&format!("{e}scales")));
        let mut s2 = 0f64;
        for (k, byte) in blocks.iter().enumerate() {
            let sc = scales[k / 16];
            for nib in [byte & 15, byte >> 4] {
                let v = stormo_engine::kernels::mxfp4_value(nib, sc) as f64;
                s2 += v * v;
            }
        }
        let std = (s2 / (blocks.len() * 2) as f64).sqrt();
        let want = 1.0 / 64f64.sqrt();
        assert!((std / want - 1.0).abs() < 0.1, "std {std}, want {want}");
    }

    #[test]
    fn hot_experts_get_the_router_bias() {
        let mut o = tiny_gpt();
        o.hot = Some(HotExperts {
            fraction: 0.5,
            bias: 3.0,
        });
        let p = plan(&o).unwrap();
        assert!(p.hot_experts.iter().all(|h| h.len() == 2));
        let i = p
            .tensors
            .iter()
            .position(|t| t.name == "model.layers.0.mlp.router.bias")
            .unwrap();
        let mut b = vec![0u8; 8];
        p.fill(i, 0, &mut b);
        for e in 0..4 {
            let v = stormo_engine::kernels::bf16_at(&b, e);
            let hot = p.hot_experts[0].contains(&e);
            assert_eq!(v > 1.5, hot, "expert {e}: {v}");
        }
    }

    #[test]
    fn special_ids_stay_inside_a_small_vocabulary() {
        let p = plan(&tiny_gpt()).unwrap();
        let c: Value = serde_json::from_str(&p.config_json()).unwrap();
        assert_eq!(c["eos_token_id"], 299);
        assert_eq!(c["pad_token_id"], 298);
        let full = plan(&SynthOptions::new(Preset::GptOss20b.geometry(), 0)).unwrap();
        let c: Value = serde_json::from_str(&full.config_json()).unwrap();
        assert_eq!(c["eos_token_id"], 200_002);
    }

    /// openai/gpt-oss-20b's config.json and generation_config.json as published on the hub.
    const HUB_CONFIG_20B: &str = r#"{
  "architectures": [
    "GptOssForCausalLM"
  ],
  "attention_bias": true,
  "attention_dropout": 0.0,
  "eos_token_id": 200002,
  "experts_per_token": 4,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2880,
  "initial_context_length": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 2880,
  "layer_types": [
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention"
  ],
  "max_position_embeddings": 131072,
  "model_type": "gpt_oss",
  "num_attention_heads": 64,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 24,
  "num_key_value_heads": 8,
  "num_local_experts": 32,
  "output_router_logits": false,
  "pad_token_id": 199999,
  "quantization_config": {
    "modules_to_not_convert": [
      "model.layers.*.self_attn",
      "model.layers.*.mlp.router",
      "model.embed_tokens",
      "lm_head"
    ],
    "quant_method": "mxfp4"
  },
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": false
  },
  "rope_theta": 150000,
  "router_aux_loss_coef": 0.9,
  "sliding_window": 128,
  "swiglu_limit": 7.0,
  "tie_word_embeddings": false,
  "transformers_version": "4.55.0.dev0",
  "use_cache": true,
  "vocab_size": 201088
}
"#;
    const HUB_GENERATION_CONFIG_20B: &str = r#"{
  "bos_token_id": 199998,
  "do_sample": true,
  "eos_token_id": [
    200002,
    199999,
    200012
  ],
  "pad_token_id": 199999,
  "transformers_version": "4.55.0.dev0"
}
"#;

    #[test]
    fn gpt_oss_20b_json_files_are_the_published_bytes() {
        let p = plan(&SynthOptions::new(Preset::GptOss20b.geometry(), 0)).unwrap();
        assert_eq!(p.config_json(), HUB_CONFIG_20B);
        assert_eq!(p.generation_config_json(), HUB_GENERATION_CONFIG_20B);
    }
}
