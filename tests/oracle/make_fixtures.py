#!/usr/bin/env python3
"""Generate the extra oracle fixtures in fixtures/extra/ with Hugging Face Transformers.

Each case is a tiny random GPT-OSS or Qwen3-MoE checkpoint in one of the layouts the engine must
load (see tests/oracle/README.md for the list and what each covers), plus the outputs that
Transformers computes on it. Run with a venv (VENV below) holding torch and transformers 5.x (CPU):

    VENV/bin/python tests/oracle/make_fixtures.py            # all cases
    VENV/bin/python tests/oracle/make_fixtures.py NAME ...   # some cases
    VENV/bin/python tests/oracle/make_fixtures.py --list

Method (SPEC.md §2-§5, fixtures/README.md):
  1. Build the config and a float32 model with eager attention and eager experts.
  2. Randomise every parameter non-trivially (norm weights, biases, sinks included), scaled so
     that the SwiGLU clamp, the sinks and the sliding window all change the logits.
  3. Round every non-expert weight to the stored dtype first, and quantise MXFP4 experts
     (SPEC §4.3), so the stored tensors are exactly the weights the reference uses.
  4. Save in the case's layout and config form, then load the saved directory back with
     Transformers (`Mxfp4Config(dequantize=True)` for MXFP4, dtype float32) and check that every
     parameter is bit-identical to the in-memory model. The reference outputs are computed by
     that loaded-back model, i.e. by Transformers reading the stored files.
  5. Greedy decoding with the KV cache; a case whose smallest greedy top1-top2 margin or
     smallest router top-k boundary gap is too small to be unambiguous is regenerated with the
     next seed.
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "fixtures" / "extra"

MIN_GREEDY_MARGIN = 2e-3
MIN_ROUTER_GAP = 2e-4
MAX_TRIES = 12

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

# FP4 E2M1 magnitudes for codes 0..7; bit 3 is the sign.
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

YARN_HUB = {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": False,
}

# Each case: name, family, layout ("mxfp4" | "pretrained" (save_pretrained) | "qwen"),
# dtype of the stored non-expert tensors, config form ("hub" | "v5"), shards, prompt and
# generation lengths, seed and the model geometry (Transformers config kwargs).
CASES = [
    dict(
        name="gptoss-mxfp4-w17-sharded",
        family="gpt_oss",
        layout="mxfp4",
        dtype="bf16",
        config_form="hub",
        shards=3,
        prompt_len=41,
        gen=20,
        seed=11,
        cfg=dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=24,
            num_local_experts=6,
            num_experts_per_tok=3,
            intermediate_size=32,
            vocab_size=499,
            sliding_window=17,
            rope_parameters=dict(YARN_HUB, rope_theta=150000.0),
            max_position_embeddings=131072,
        ),
    ),
    dict(
        name="gptoss-mxfp4-v5-top1",
        family="gpt_oss",
        layout="mxfp4",
        dtype="bf16",
        config_form="v5",
        shards=1,
        prompt_len=30,
        gen=24,
        seed=12,
        cfg=dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            num_local_experts=3,
            num_experts_per_tok=1,
            intermediate_size=64,
            vocab_size=611,
            sliding_window=5,
            rope_parameters=dict(
                rope_type="yarn",
                factor=8.0,
                beta_fast=16.0,
                beta_slow=2.0,
                original_max_position_embeddings=512,
                rope_theta=10000.0,
            ),
            max_position_embeddings=4096,
        ),
    ),
    dict(
        name="gptoss-mxfp4-6layers-num_experts",
        family="gpt_oss",
        layout="mxfp4",
        dtype="bf16",
        config_form="hub",
        num_experts_key=True,
        shards=1,
        prompt_len=52,
        gen=16,
        seed=13,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            num_local_experts=16,
            num_experts_per_tok=4,
            intermediate_size=32,
            vocab_size=1031,
            sliding_window=40,
            rope_parameters=dict(YARN_HUB, rope_theta=150000.0),
            max_position_embeddings=131072,
        ),
    ),
    dict(
        name="gptoss-bf16-v5-alpha-limit",
        family="gpt_oss",
        layout="pretrained",
        dtype="bf16",
        config_form="v5",
        shards=1,
        prompt_len=29,
        gen=20,
        seed=14,
        cfg=dict(
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            num_local_experts=5,
            num_experts_per_tok=2,
            intermediate_size=24,
            vocab_size=389,
            sliding_window=17,
            swiglu_alpha=1.5,
            swiglu_limit=5.0,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=256,
                truncate=True,
                rope_theta=50000.0,
            ),
            max_position_embeddings=1024,
        ),
    ),
    dict(
        name="gptoss-f16-tied-nobias-sharded",
        family="gpt_oss",
        layout="pretrained",
        dtype="f16",
        config_form="v5",
        shards=2,
        prompt_len=60,
        gen=16,
        seed=15,
        cfg=dict(
            hidden_size=40,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=20,
            num_local_experts=7,
            num_experts_per_tok=2,
            intermediate_size=20,
            vocab_size=517,
            sliding_window=40,
            layer_types=[
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            tie_word_embeddings=True,
            attention_bias=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            max_position_embeddings=2048,
        ),
    ),
    dict(
        name="gptoss-f32-hub-plain",
        family="gpt_oss",
        layout="pretrained",
        dtype="f32",
        config_form="hub",
        shards=1,
        prompt_len=24,
        gen=20,
        seed=16,
        cfg=dict(
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=4,
            intermediate_size=12,
            vocab_size=263,
            sliding_window=5,
            rope_parameters=dict(
                rope_type="yarn",
                factor=16.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=1024,
                truncate=False,
                rope_theta=150000.0,
            ),
            max_position_embeddings=16384,
        ),
    ),
    dict(
        name="gptoss-hub-no-rope-scaling",
        family="gpt_oss",
        layout="pretrained",
        dtype="bf16",
        config_form="hub",
        # config.json has rope_theta but no rope_scaling: Transformers' GptOssConfig then applies
        # its default YaRN (factor 32, beta 32/1, L0 4096, truncate false), as the model uses
        drop_rope_scaling=True,
        shards=1,
        prompt_len=26,
        gen=20,
        seed=17,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            vocab_size=359,
            sliding_window=9,
            rope_parameters=dict(YARN_HUB, rope_theta=20000.0),
            max_position_embeddings=131072,
        ),
    ),
    dict(
        name="qwen3-dense-layers-hub",
        family="qwen3_moe",
        layout="qwen",
        dtype="bf16",
        config_form="hub",
        shards=1,
        prompt_len=33,
        gen=20,
        seed=21,
        cfg=dict(
            hidden_size=48,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            intermediate_size=72,
            vocab_size=733,
            mlp_only_layers=[0, 4],
            decoder_sparse_step=1,
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            max_position_embeddings=40960,
        ),
    ),
    dict(
        name="qwen3-sparse-step2-v5",
        family="qwen3_moe",
        layout="qwen",
        dtype="bf16",
        config_form="v5",
        shards=1,
        prompt_len=28,
        gen=20,
        seed=22,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            num_experts=9,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            intermediate_size=40,
            vocab_size=401,
            mlp_only_layers=[],
            decoder_sparse_step=2,
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            max_position_embeddings=8192,
        ),
    ),
    dict(
        name="qwen3-nonorm-tied",
        family="qwen3_moe",
        layout="qwen",
        dtype="bf16",
        config_form="hub",
        shards=1,
        prompt_len=26,
        gen=20,
        seed=23,
        cfg=dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=10,
            num_experts_per_tok=3,
            moe_intermediate_size=20,
            intermediate_size=64,
            vocab_size=769,
            norm_topk_prob=False,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            max_position_embeddings=40960,
        ),
    ),
    dict(
        name="qwen3-f16-bias-v5",
        family="qwen3_moe",
        layout="qwen",
        dtype="f16",
        config_form="v5",
        shards=1,
        prompt_len=30,
        gen=20,
        seed=24,
        cfg=dict(
            hidden_size=40,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=12,
            num_experts_per_tok=5,
            moe_intermediate_size=12,
            intermediate_size=48,
            vocab_size=457,
            norm_topk_prob=True,
            attention_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
            max_position_embeddings=32768,
        ),
    ),
    dict(
        name="qwen3-f32-sliding17-sharded",
        family="qwen3_moe",
        layout="qwen",
        dtype="f32",
        config_form="hub",
        shards=3,
        prompt_len=45,
        gen=16,
        seed=25,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            intermediate_size=64,
            vocab_size=311,
            norm_topk_prob=True,
            use_sliding_window=True,
            sliding_window=17,
            max_window_layers=3,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            max_position_embeddings=32768,
        ),
    ),
    dict(
        name="qwen3-yarn-hub",
        family="qwen3_moe",
        layout="qwen",
        dtype="bf16",
        config_form="hub",
        shards=1,
        prompt_len=30,
        gen=20,
        seed=26,
        cfg=dict(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=5,
            num_experts_per_tok=5,
            moe_intermediate_size=16,
            intermediate_size=64,
            vocab_size=523,
            norm_topk_prob=False,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                rope_theta=10000.0,
            ),
            max_position_embeddings=256,
        ),
    ),
    dict(
        name="qwen3-yarn-no-original",
        family="qwen3_moe",
        layout="qwen",
        dtype="bf16",
        config_form="hub",
        # rope_scaling without original_max_position_embeddings: Transformers then uses
        # max_position_embeddings as the original length (standardize_rope_params).
        drop_yarn_original=True,
        shards=1,
        prompt_len=30,
        gen=20,
        seed=27,
        cfg=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            intermediate_size=64,
            vocab_size=300,
            norm_topk_prob=True,
            rope_parameters=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=64,
                rope_theta=10000.0,
            ),
            max_position_embeddings=64,
        ),
    ),
]


# ----------------------------------------------------------------------------------------------
# model construction


def build_config(case):
    kw = dict(case["cfg"])
    kw.pop("max_window_layers", None)  # hub-config only; v5 ignores it (SPEC §5)
    kw.setdefault("rms_norm_eps", 1e-5 if case["family"] == "gpt_oss" else 1e-6)
    if case["family"] == "gpt_oss":
        kw.setdefault("eos_token_id", kw["vocab_size"] - 2)
        kw.setdefault("pad_token_id", kw["vocab_size"] - 1)
        return GptOssConfig(**kw)
    kw.setdefault("eos_token_id", kw["vocab_size"] - 2)
    kw.setdefault("bos_token_id", kw["vocab_size"] - 3)
    return Qwen3MoeConfig(**kw)


def build_model(config):
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def randomise(model, case, gen):
    """Every parameter random and non-trivial; scales chosen so the logits are O(1) and the
    details (clamp, sinks, window, biases, norm weights) all matter."""
    family = case["family"]

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("embed_tokens.weight"):
                # tied: it is also the lm_head, so scale it like one (logits O(1))
                tied = model.config.tie_word_embeddings
                v = normal(shape, 2.0 / math.sqrt(shape[-1]) if tied else 1.0)
            elif name.endswith("norm.weight"):  # input/post/final/q/k norms
                v = normal(shape, 0.25, 1.0)
            elif name.endswith("sinks"):
                v = normal(shape, 1.0, 0.5)
            elif name.endswith("lm_head.weight"):
                v = normal(shape, 2.0 / math.sqrt(shape[-1]))
            elif name.endswith("router.weight") or name.endswith("mlp.gate.weight"):
                v = normal(shape, 3.0 / math.sqrt(shape[-1]))
            elif name.endswith("router.bias"):
                v = normal(shape, 0.5)
            elif name.endswith("experts.gate_up_proj"):
                if family == "gpt_oss":  # [E, H, 2I]: x @ W; large enough to hit the clamp
                    v = normal(shape, 3.5 / math.sqrt(shape[1]))
                else:  # qwen [E, 2I, H]
                    v = normal(shape, 1.5 / math.sqrt(shape[2]))
            elif name.endswith("experts.gate_up_proj_bias"):
                v = normal(shape, 1.0)
            elif name.endswith("experts.down_proj"):
                if family == "gpt_oss":  # [E, I, H]
                    v = normal(shape, 0.5 / math.sqrt(shape[1]))
                else:  # [E, H, I]
                    v = normal(shape, 1.0 / math.sqrt(shape[2]))
            elif name.endswith("experts.down_proj_bias"):
                v = normal(shape, 0.3)
            elif name.endswith(".bias"):  # attention projection biases
                v = normal(shape, 0.3)
            elif name.endswith(".weight") and p.dim() == 2:  # attention / dense MLP linears
                v = normal(shape, 1.2 / math.sqrt(shape[1]))
            else:
                raise SystemExit(f"{case['name']}: no randomisation rule for {name} {tuple(shape)}")
            p.copy_(v)


def round_to_dtype(model, dtype, skip=()):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(name.endswith(s) for s in skip):
                continue
            p.copy_(p.to(dtype).to(torch.float32))


# ----------------------------------------------------------------------------------------------
# MXFP4 (SPEC §4.3)


def mxfp4_quantize(w):
    """w [E, out, in] float32 -> (blocks u8 [E, out, in/32, 16], scales u8 [E, out, in/32],
    dequantised float32 [E, out, in])."""
    e_, out_, in_ = w.shape
    assert in_ % 32 == 0, in_
    g = w.reshape(e_, out_, in_ // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    mag = scaled.abs()
    idx = (mag[..., None] - FP4_MAGNITUDES).abs().argmin(-1)  # nearest magnitude, 0..7
    neg = (scaled < 0) & (idx > 0)
    codes = (idx | (neg.to(torch.int64) << 3)).to(torch.uint8)
    deq = FP4_MAGNITUDES[idx] * torch.where(neg, -1.0, 1.0) * torch.exp2(exp)[..., None]
    codes = codes.reshape(e_, out_, in_ // 32, 16, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous(), deq.reshape(e_, out_, in_)


def quantize_experts(model):
    """Quantise every GPT-OSS expert matrix in place; returns {name: tensor} for the stored
    blocks and scales."""
    stored = {}
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(ex, proj)  # [E, in, out]
                blocks, scales, deq = mxfp4_quantize(p.transpose(1, 2).contiguous())
                p.copy_(deq.transpose(1, 2))
                base = f"model.layers.{li}.mlp.experts.{proj}"
                stored[f"{base}_blocks"] = blocks
                stored[f"{base}_scales"] = scales
    return stored


# ----------------------------------------------------------------------------------------------
# saving


def write_shards(tensors, out_dir, shards, zero_based):
    """One model.safetensors, or `shards` files plus model.safetensors.index.json. The hub's
    MXFP4 checkpoints number shards from 0 with count-1 as "of" (convert script); save_pretrained
    numbers from 1."""
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    per = total / shards
    groups, acc = [[]], 0
    for n in names:
        if acc >= per * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(n)
        acc += tensors[n].numel() * tensors[n].element_size()
    assert len(groups) == shards, (len(groups), shards)
    weight_map = {}
    for i, grp in enumerate(groups):
        if zero_based:
            fname = f"model-{i:05d}-of-{shards - 1:05d}.safetensors"
        else:
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in grp}, str(out_dir / fname), metadata={"format": "pt"})
        for n in grp:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hub_config(case, config):
    """config.json as the hub ships it: top-level rope_theta + rope_scaling (null for default
    RoPE), torch_dtype, and for GPT-OSS the extra keys of openai/gpt-oss-20b."""
    c = case["cfg"]
    fam = case["family"]
    rp = dict(c["rope_parameters"])
    theta = rp.pop("rope_theta")
    scaling = None if rp.get("rope_type") == "default" else rp
    if scaling is not None and case.get("drop_yarn_original"):
        scaling.pop("original_max_position_embeddings")
    d = {
        "architectures": ["GptOssForCausalLM" if fam == "gpt_oss" else "Qwen3MoeForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": fam,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[case["dtype"]],
        "use_cache": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.9 if fam == "gpt_oss" else 0.001,
    }
    if case.get("drop_rope_scaling"):
        del d["rope_scaling"]
    if fam == "gpt_oss":
        experts_key = "num_experts" if case.get("num_experts_key") else "num_local_experts"
        d.update(
            {
                experts_key: config.num_local_experts,
                "num_experts_per_tok": config.num_experts_per_tok,
                "experts_per_token": config.num_experts_per_tok,
                "intermediate_size": config.intermediate_size,
                "initial_context_length": 4096,
                "layer_types": list(config.layer_types),
                "sliding_window": config.sliding_window,
                "swiglu_limit": config.swiglu_limit,
                "pad_token_id": config.pad_token_id,
            }
        )
    else:
        d.update(
            {
                "bos_token_id": config.bos_token_id,
                "num_experts": config.num_experts,
                "num_experts_per_tok": config.num_experts_per_tok,
                "moe_intermediate_size": config.moe_intermediate_size,
                "intermediate_size": config.intermediate_size,
                "decoder_sparse_step": config.decoder_sparse_step,
                "mlp_only_layers": list(config.mlp_only_layers),
                "norm_topk_prob": config.norm_topk_prob,
                "use_sliding_window": config.use_sliding_window,
                "sliding_window": case["cfg"].get("sliding_window") if config.use_sliding_window else None,
                "max_window_layers": case["cfg"].get("max_window_layers", config.num_hidden_layers),
            }
        )
    return d


MXFP4_QUANT = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def save_checkpoint(model, case, out_dir):
    dtype = DTYPES[case["dtype"]]
    layout = case["layout"]
    if layout == "mxfp4":
        stored = quantize_experts(model)
        tensors = {}
        for name, p in model.state_dict().items():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            tensors[name] = p.detach().to(dtype).contiguous()
        tensors.update(stored)
        tensors = dict(sorted(tensors.items()))
        write_shards(tensors, out_dir, case["shards"], zero_based=True)
        if case["config_form"] == "hub":
            cfg = hub_config(case, model.config)
        else:
            # exactly what save_pretrained writes for this config, in the stored dtype
            c = copy.deepcopy(model.config)
            c.architectures = [type(model).__name__]
            c.dtype = dtype
            with tempfile.TemporaryDirectory() as tmp:
                c.save_pretrained(tmp)
                cfg = json.loads((Path(tmp) / "config.json").read_text())
        cfg["quantization_config"] = MXFP4_QUANT
    else:
        # save_pretrained in the stored dtype: the bf16/f16/f32 Transformers layout
        m = copy.deepcopy(model).to(dtype)
        total = sum(p.numel() * p.element_size() for p in m.state_dict().values())
        # save_pretrained packs whole tensors greedily: try shard sizes until the count is right
        sizes = [None] if case["shards"] == 1 else [
            int(total / case["shards"] * f) + 1 for f in (1.05, 1.2, 1.4, 1.7, 0.95, 0.9, 0.8)
        ]
        for size in sizes:
            for f in out_dir.iterdir():
                f.unlink()
            with tempfile.TemporaryDirectory() as tmp:
                m.save_pretrained(tmp, **({"max_shard_size": size} if size else {}))
                for f in sorted(os.listdir(tmp)):
                    if f.endswith(".safetensors") or f == "model.safetensors.index.json":
                        shutil.copy(Path(tmp) / f, out_dir / f)
                saved_cfg = json.loads((Path(tmp) / "config.json").read_text())
            n_shards = len([f for f in os.listdir(out_dir) if f.endswith(".safetensors")])
            if n_shards == case["shards"]:
                break
        else:
            raise SystemExit(f"{case['name']}: save_pretrained never wrote {case['shards']} shards")
        cfg = hub_config(case, model.config) if case["config_form"] == "hub" else saved_cfg
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_back(out_dir, case):
    kw = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    if case["layout"] == "mxfp4":
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model, info = AutoModelForCausalLM.from_pretrained(str(out_dir), output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs" or (k == "error_msgs" and v)}
    if bad:
        raise SystemExit(f"{case['name']}: Transformers loading reported {bad}")
    return model.eval()


# ----------------------------------------------------------------------------------------------
# reference


@torch.no_grad()
def full_forward(model, ids):
    out = model(
        torch.tensor([ids]),
        use_cache=False,
        output_hidden_states=True,
        output_router_logits=True,
    )
    hs = torch.stack([h[0] for h in out.hidden_states])
    rl = out.router_logits
    rl = torch.stack([r.reshape(len(ids), -1) for r in rl]) if rl else torch.zeros(0)
    return out.logits[0], hs, rl


@torch.no_grad()
def greedy(model, ids, n):
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
    gen, logits, margins = [], [], []
    for step in range(n):
        row = out.logits[0, -1]
        top2 = torch.topk(row, 2).values
        tok = int(torch.argmax(row))
        gen.append(tok)
        logits.append(row.clone())
        margins.append(float(top2[0] - top2[1]))
        if step + 1 < n:
            out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
    return gen, torch.stack(logits), min(margins)


def router_gap(rl, k):
    """Smallest gap between the k-th and (k+1)-th router logit over all layers and positions."""
    if rl.numel() == 0 or k >= rl.shape[-1]:
        return math.inf
    s = torch.sort(rl, dim=-1, descending=True).values
    return float((s[..., k - 1] - s[..., k]).min())


def moe_layers(config, family):
    if family == "gpt_oss":
        return list(range(config.num_hidden_layers))
    return [
        l
        for l in range(config.num_hidden_layers)
        if l not in config.mlp_only_layers
        and config.num_experts > 0
        and (l + 1) % config.decoder_sparse_step == 0
    ]


@torch.no_grad()
def sensitivity(model, ids, base_logits):
    """How far the prompt logits move without sinks, without the SwiGLU clamp, without the window."""
    res = {}
    saved = [l.self_attn.sinks.clone() for l in model.model.layers]
    for l in model.model.layers:
        l.self_attn.sinks.fill_(-1e30)
    res["without_sinks"] = float((full_forward(model, ids)[0] - base_logits).abs().max())
    for l, s in zip(model.model.layers, saved):
        l.self_attn.sinks.copy_(s)
    limits = [l.mlp.experts.limit for l in model.model.layers]
    for l in model.model.layers:
        l.mlp.experts.limit = 1e30
    res["without_swiglu_clamp"] = float((full_forward(model, ids)[0] - base_logits).abs().max())
    for l, lim in zip(model.model.layers, limits):
        l.mlp.experts.limit = lim
    if any(t == "sliding_attention" for t in model.config.layer_types):
        w = model.config.sliding_window
        model.config.sliding_window = 1 << 30
        res["without_sliding_window"] = float((full_forward(model, ids)[0] - base_logits).abs().max())
        model.config.sliding_window = w
    return res


def make_case(case, seed):
    out_dir = OUT / case["name"]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = build_config(case)
    model = build_model(config)
    randomise(model, case, gen)
    dtype = DTYPES[case["dtype"]]
    skip = ("experts.gate_up_proj", "experts.down_proj") if case["layout"] == "mxfp4" else ()
    round_to_dtype(model, dtype, skip)
    if case["layout"] == "mxfp4":
        # expert biases are stored in the same dtype as every other non-expert tensor
        pass
    save_checkpoint(model, case, out_dir)  # quantises MXFP4 experts in `model` in place

    ref = load_back(out_dir, case)
    # the loaded-back model holds exactly the weights of the in-memory one
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if name not in mine:
            raise SystemExit(f"{case['name']}: loaded model has unexpected parameter {name}")
        d = float((p.detach().float() - mine[name].detach().float()).abs().max())
        if d != 0.0:
            raise SystemExit(f"{case['name']}: parameter {name} differs after reload by {d}")

    v = config.vocab_size
    ids = torch.randint(0, v, (case["prompt_len"],), generator=gen).tolist()
    logits, hidden, router = full_forward(ref, ids)
    logits_mem = full_forward(model, ids)[0]
    roundtrip = float((logits - logits_mem).abs().max())
    gen_ids, gen_logits, margin = greedy(ref, ids, case["gen"])
    # the cached decode agrees with one full forward over prompt + generated
    all_ids = ids + gen_ids
    full_logits, _, full_router = full_forward(ref, all_ids)
    cached_vs_full = float((full_logits[len(ids) - 1 : len(all_ids) - 1] - gen_logits).abs().max())
    k = config.num_experts_per_tok
    # Qwen3 takes the top-k of softmax(logits): the same set as the top-k of the logits
    gap = router_gap(full_router, k)
    assert hidden.shape[0] == config.num_hidden_layers + 1
    layers = moe_layers(config, case["family"])
    assert router.shape[0] == len(layers), (router.shape, layers)

    # a continuation stuck on one token would test little
    varied = len(set(gen_ids)) >= max(3, len(gen_ids) // 4)
    ok = margin >= MIN_GREEDY_MARGIN and gap >= MIN_ROUTER_GAP and roundtrip == 0.0 and varied
    info = {
        "fixture": case["name"],
        "family": case["family"],
        "seed": seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "math": "float32, eager attention, eager experts, batch 1, greedy argmax, no sampling",
        "layout": case["layout"],
        "stored_dtype": case["dtype"],
        "config_form": case["config_form"],
        "shards": case["shards"],
        "prompt_len": len(ids),
        "generated": len(gen_ids),
        "input_ids": ids,
        "generated_ids": gen_ids,
        "moe_layers": layers,
        "min_greedy_margin": margin,
        "min_router_topk_gap": gap if math.isfinite(gap) else None,
        "max_abs_cached_vs_full": cached_vs_full,
        "roundtrip_max_abs": roundtrip,
        "logit_std": float(logits.std()),
    }
    if case["family"] == "gpt_oss":
        info["sensitivity_max_abs_logit_change"] = sensitivity(ref, ids, logits)
    save_file(
        {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "prompt_logits": logits.contiguous(),
            "hidden_states": hidden.contiguous(),
            "router_logits": router.contiguous(),
            "generated_ids": torch.tensor(gen_ids, dtype=torch.int64),
            "generated_logits": gen_logits.contiguous(),
        },
        str(out_dir / "reference.safetensors"),
        metadata={"format": "pt"},
    )
    (out_dir / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    return ok, info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="cases to (re)generate; default all")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args()
    if args.list:
        for c in CASES:
            print(c["name"])
        return
    known = {c["name"] for c in CASES}
    for n in args.names:
        if n not in known:
            raise SystemExit(f"unknown case {n!r}; known: {sorted(known)}")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for case in CASES:
        if args.names and case["name"] not in args.names:
            continue
        for attempt in range(MAX_TRIES):
            seed = case["seed"] + 1000 * attempt
            ok, info = make_case(case, seed)
            summary = (
                f"{case['name']}: seed {seed} margin {info['min_greedy_margin']:.4g} "
                f"router gap {info['min_router_topk_gap']} roundtrip {info['roundtrip_max_abs']} "
                f"cached-vs-full {info['max_abs_cached_vs_full']:.2g} "
                f"sens {info.get('sensitivity_max_abs_logit_change')}"
            )
            print(summary, file=sys.stderr)
            if ok:
                break
        else:
            raise SystemExit(f"{case['name']}: no unambiguous seed in {MAX_TRIES} tries")
        size = sum(f.stat().st_size for f in (OUT / case["name"]).iterdir())
        print(f"  -> {OUT / case['name']} ({size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
