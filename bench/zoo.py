"""Every family users bring, as a tiny random-init Hugging Face directory, through `osscar compress` at a
uniform ratio and at a measured-speedup target: ok / refused (with the line a user reads), the parity
error of the returned export, the measured speedup and the seconds.

Random weights: quality is not measured here (budgets are off), structure, export and latency are. Speeds
of models this small are noise (slower_than_dense is common); what matters is that each family either
compresses end to end or is refused in one line.

    .venv/bin/python bench/zoo.py [--families llama,qwen3] [--modes uniform,target]
    .venv/bin/python bench/zoo.py --real-sizes [--modes uniform]

`--real-sizes`: the vision CNN families at their published shapes instead (ResNet-50, MobileNetV2 1.0,
EfficientNet-B0, ConvNeXt-T; random init, 224 x 224, the job's default batch), where a toy's timing
says nothing: does pruning a quarter of the channels make them faster in ONNX Runtime?

`--keep DIR`: the work stays in DIR (each family's directory, each job's `--out` with its report.json, and
`job.log`, the job's verbose log), so a row can be read back: which units went, how the rounds converged.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = dict(vocab_size=50, max_position_embeddings=64)


def _lm(cls: str, config: str, **fields) -> Callable[[], object]:
    def build():
        import torch
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, cls)(getattr(transformers, config)(**fields)).eval()

    return build


def _live_scales(build: Callable[[], object]) -> Callable[[], object]:
    """A builder whose BatchNorms get random scales and shifts: HF EfficientNet's initialisation makes its
    pooled features exactly 0 for every input (so a pruned model's outputs equal the dense one's and the
    accuracy check refuses to compare them), which no trained checkpoint does. ConvNeXt's layer scales too:
    initialised at 1e-6, every block's branch adds ~nothing to its stream, so removing blocks is free (removal
    losses ~1e-15) and a target job's depth plan removed blocks until they alone passed the target, never
    reaching the widths (bench/RESULTS.md, session 39)."""
    def live():
        import torch

        model = build()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.BatchNorm2d):
                    module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
            for name, parameter in model.named_parameters():
                if name.endswith("layer_scale_parameter"):  # ConvNeXt's; trained ones are ~0.1-1
                    parameter.copy_(0.1 + 0.5 * torch.rand(parameter.shape, generator=generator))
        return model

    return live


GQA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
           **TEXT)
ENCODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=96, **TEXT)
IMAGE = dict(num_channels=3, image_size=32)
# (family, model builder, input kind)
FAMILIES: list[tuple[str, Callable[[], object], str]] = [
    ("llama", _lm("LlamaForCausalLM", "LlamaConfig", head_dim=8, **GQA), "text"),
    ("mistral", _lm("MistralForCausalLM", "MistralConfig", head_dim=8, **GQA), "text"),
    ("qwen2", _lm("Qwen2ForCausalLM", "Qwen2Config", **GQA), "text"),
    ("qwen3", _lm("Qwen3ForCausalLM", "Qwen3Config", head_dim=8, **GQA), "text"),
    # Qwen3.5's language model: Gated DeltaNet mixers in three of every four layers (its default layout)
    ("qwen3_5_text", _lm("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", head_dim=8, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
                         **{**GQA, "num_hidden_layers": 4}), "text"),
    # LFM2: gated short convolutions beside attention layers (LFM2-350M's 16 layers hold 6 attentions), a SwiGLU FFN
    # of 2/3 of intermediate_size rounded to block_multiple_of (96 neurons)
    ("lfm2", _lm("Lfm2ForCausalLM", "Lfm2Config", layer_types=["conv", "conv", "full_attention", "conv"],
                 block_multiple_of=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 **{**GQA, "num_hidden_layers": 4, "intermediate_size": 144}), "text"),
    # Granite 4.0-H (granitemoehybrid): Mamba2 mixers in most layers, attention in the others, a fused SwiGLU FFN
    # (shared_mlp) in every layer; Granite's multipliers
    ("granitemoehybrid", _lm("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                             num_local_experts=0, shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                             mamba_d_state=8, mamba_chunk_size=8, embedding_multiplier=2.0, residual_multiplier=0.5,
                             attention_multiplier=0.125, logits_scaling=2.0, position_embedding_type="rope",
                             **{**GQA, "num_hidden_layers": 4}), "text"),
    # Granite 4.0-H-Tiny / -Small: the same layers, each FFN routed experts (softmax top-k) beside the fused shared
    # SwiGLU FFN; attention without positions (position_embedding_type nope, as Granite 4.0-H's)
    ("granitemoehybrid_moe", _lm("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                                 layer_types=["linear_attention", "full_attention", "linear_attention"],
                                 num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=96,
                                 mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
                                 position_embedding_type="nope", **{**GQA, "num_hidden_layers": 3}), "text"),
    # Granite 3.x MoE: Llama's attention over softmax top-k routed experts (block_sparse_moe); with a fused SwiGLU
    # shared expert beside them (granitemoeshared); Granite's multipliers
    ("granitemoe", _lm("GraniteMoeForCausalLM", "GraniteMoeConfig", num_local_experts=8, num_experts_per_tok=2,
                       embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.125,
                       logits_scaling=2.0, **GQA), "text"),
    ("granitemoeshared", _lm("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", num_local_experts=8,
                             num_experts_per_tok=2, shared_intermediate_size=96, embedding_multiplier=2.0,
                             residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0, **GQA), "text"),
    # Bamba: Mamba2 mixers beside Llama's attention in the layers attn_layer_indices names, Llama's MLP
    ("bamba", _lm("BambaForCausalLM", "BambaConfig", attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=16,
                  mamba_d_state=8, mamba_chunk_size=8, **{**GQA, "num_hidden_layers": 4}), "text"),
    # Falcon-H1: a Mamba2 mixer beside the attention in every layer, a SwiGLU FFN; muP multipliers away from 1
    ("falcon_h1", _lm("FalconH1ForCausalLM", "FalconH1Config", head_dim=8, mamba_d_ssm=128, mamba_n_heads=8,
                      mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=True, key_multiplier=0.7,
                      attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_out_multiplier=0.9,
                      mlp_multipliers=[1.1, 0.9], **{**GQA, "num_hidden_layers": 4}), "text"),
    ("gemma", _lm("GemmaForCausalLM", "GemmaConfig", head_dim=8, **GQA), "text"),
    ("gemma2", _lm("Gemma2ForCausalLM", "Gemma2Config", head_dim=16, sliding_window=16, **GQA), "text"),
    ("gemma3_text", _lm("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=16, sliding_window=16, **GQA), "text"),
    # Gemma 4's language model: global layers of their own head size and KV heads (values are keys), per-layer input
    # embeddings; five sliding-window layers to a global one (its default)
    ("gemma4_text", _lm("Gemma4ForCausalLM", "Gemma4TextConfig", head_dim=16, global_head_dim=32, sliding_window=16,
                        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=16,
                        vocab_size_per_layer_input=50, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        **{**GQA, "num_hidden_layers": 6}), "text"),
    ("phi3", _lm("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, bos_token_id=1, eos_token_id=2, **GQA), "text"),
    # Phi-4-mini's rotary: a partial one with longrope scaling (windows of 32 tokens pass its original 16), tied
    ("phi3-longrope", _lm("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          tie_word_embeddings=True, original_max_position_embeddings=16, partial_rotary_factor=0.75,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2],
                                        "long_factor": [2.0, 3.0, 4.0], "partial_rotary_factor": 0.75}, **GQA),
     "text"),
    ("smollm3", _lm("SmolLM3ForCausalLM", "SmolLM3Config", head_dim=8, no_rope_layer_interval=2, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, **GQA), "text"),
    ("granite", _lm("GraniteForCausalLM", "GraniteConfig", head_dim=8, embedding_multiplier=12.0,
                    attention_multiplier=0.125, residual_multiplier=0.22, logits_scaling=8.0, **GQA), "text"),
    ("olmo", _lm("OlmoForCausalLM", "OlmoConfig", head_dim=8, clip_qkv=8.0, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, **GQA), "text"),
    # OLMo 2 and 3: q/k norms over all heads together (heads stay whole), a norm after each sub-layer
    ("olmo2", _lm("Olmo2ForCausalLM", "Olmo2Config", head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **GQA),
     "text"),
    ("olmo3", _lm("Olmo3ForCausalLM", "Olmo3Config", head_dim=8, sliding_window=16, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, layer_types=["sliding_attention", "full_attention"], **GQA), "text"),
    ("helium", _lm("HeliumForCausalLM", "HeliumConfig", head_dim=8, **GQA), "text"),
    ("ministral", _lm("MinistralForCausalLM", "MinistralConfig", head_dim=8, **GQA), "text"),
    ("ernie4_5", _lm("Ernie4_5ForCausalLM", "Ernie4_5Config", head_dim=8, **GQA), "text"),
    ("seed_oss", _lm("SeedOssForCausalLM", "SeedOssConfig", head_dim=8, attention_bias=True, **GQA), "text"),
    # EXAONE 3.0 / 3.5 and InternLM3: configs of their own over transformers' Llama modeling
    ("exaone", _lm("LlamaForCausalLM", "ExaoneConfig", head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   **GQA), "text"),
    ("internlm3", _lm("LlamaForCausalLM", "InternLM3Config", head_dim=8, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, **GQA), "text"),
    ("iquestcoder", _lm("LlamaForCausalLM", "IQuestCoderConfig", head_dim=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, **GQA), "text"),
    ("hunyuan_v1_dense", _lm("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", head_dim=8, **GQA), "text"),
    ("exaone4", _lm("Exaone4ForCausalLM", "Exaone4Config", head_dim=8, sliding_window=16, sliding_window_pattern=2,
                    **GQA), "text"),
    ("glm", _lm("GlmForCausalLM", "GlmConfig", head_dim=8, pad_token_id=0, **GQA), "text"),
    ("glm4", _lm("Glm4ForCausalLM", "Glm4Config", head_dim=8, pad_token_id=0, **GQA), "text"),
    ("starcoder2", _lm("Starcoder2ForCausalLM", "Starcoder2Config", head_dim=8, bos_token_id=0, eos_token_id=0, **GQA),
     "text"),
    ("nemotron", _lm("NemotronForCausalLM", "NemotronConfig", head_dim=8, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, **GQA), "text"),
    ("apertus", _lm("ApertusForCausalLM", "ApertusConfig", head_dim=8, **GQA), "text"),
    ("arcee", _lm("ArceeForCausalLM", "ArceeConfig", head_dim=8, **GQA), "text"),
    ("jais2", _lm("Jais2ForCausalLM", "Jais2Config", head_dim=8, **GQA), "text"),
    ("cohere", _lm("CohereForCausalLM", "CohereConfig", head_dim=8, use_qk_norm=True, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2, **GQA), "text"),
    ("cohere2", _lm("Cohere2ForCausalLM", "Cohere2Config", head_dim=8, sliding_window=16, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, layer_types=["sliding_attention", "full_attention"], **GQA),
     "text"),
    ("stablelm", _lm("StableLmForCausalLM", "StableLmConfig", qk_layernorm=True, use_parallel_residual=True,
                     use_qkv_bias=True, **GQA), "text"),
    ("phi", _lm("PhiForCausalLM", "PhiConfig", qk_layernorm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                **GQA), "text"),
    ("vaultgemma", _lm("VaultGemmaForCausalLM", "VaultGemmaConfig", head_dim=8, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, **GQA), "text"),
    ("ministral3", _lm("Ministral3ForCausalLM", "Ministral3Config", head_dim=8, **GQA), "text"),
    ("cwm", _lm("CwmForCausalLM", "CwmConfig", head_dim=8, sliding_window=16, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, **GQA), "text"),
    ("hyperclovax", _lm("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", head_dim=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, **GQA), "text"),
    # multi-head latent attention over a dense MLP (MiniCPM3's residual updates scaled by the depth)
    ("minicpm3", _lm("MiniCPM3ForCausalLM", "MiniCPM3Config", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     **{**GQA, "num_key_value_heads": 8}), "text"),
    ("youtu", _lm("YoutuForCausalLM", "YoutuConfig", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  **{**GQA, "num_key_value_heads": 8}), "text"),
    ("gpt_neox", _lm("GPTNeoXForCausalLM", "GPTNeoXConfig", **ENCODER), "text"),
    ("gptj", _lm("GPTJForCausalLM", "GPTJConfig", n_embd=64, n_layer=2, n_head=8, n_inner=96, n_positions=64,
                 rotary_dim=4, vocab_size=50, bos_token_id=1, eos_token_id=2), "text"),
    # multi-query attention: one KV head for the eight query heads
    ("gpt_bigcode", _lm("GPTBigCodeForCausalLM", "GPTBigCodeConfig", n_embd=64, n_layer=2, n_head=8, n_inner=96,
                        n_positions=64, multi_query=True, vocab_size=50, bos_token_id=1, eos_token_id=2), "text"),
    ("gpt_bigcode-mha", _lm("GPTBigCodeForCausalLM", "GPTBigCodeConfig", n_embd=64, n_layer=2, n_head=8, n_inner=96,
                            n_positions=64, multi_query=False, vocab_size=50, bos_token_id=1, eos_token_id=2), "text"),
    ("falcon", _lm("FalconForCausalLM", "FalconConfig", ffn_hidden_size=96, multi_query=True, parallel_attn=True,
                   bos_token_id=1, eos_token_id=2, **ENCODER), "text"),
    ("opt", _lm("OPTForCausalLM", "OPTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                ffn_dim=96, word_embed_proj_dim=64, **TEXT), "text"),
    ("gpt2", _lm("GPT2LMHeadModel", "GPT2Config", n_embd=64, n_layer=2, n_head=8, n_inner=96, n_positions=64,
                 vocab_size=50), "text"),
    ("mixtral", _lm("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, **GQA),
     "text"),
    ("gpt_oss", _lm("GptOssForCausalLM", "GptOssConfig", num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"], **GQA), "text"),
    ("phimoe", _lm("PhimoeForCausalLM", "PhimoeConfig", num_local_experts=4, num_experts_per_tok=2,
                   router_jitter_noise=0.01, attention_bias=True, **GQA), "text"),
    # OLMoE and FlexOLMo: OLMo's q/k norms over all heads (heads stay whole) over 3-D experts; FlexOLMo post-norm
    ("olmoe", _lm("OlmoeForCausalLM", "OlmoeConfig", head_dim=8, num_experts=4, num_experts_per_tok=2, clip_qkv=8.0,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **GQA), "text"),
    ("flex_olmo", _lm("FlexOlmoForCausalLM", "FlexOlmoConfig", head_dim=8, num_experts=4, num_experts_per_tok=2,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, **GQA), "text"),
    ("qwen3_moe", _lm("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=96, **GQA), "text"),
    # Qwen3-MoE with a dense FFN layer between its MoE layers (mlp_only_layers)
    ("qwen3_moe_mixed", _lm("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=8, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=96, **{**GQA, "num_hidden_layers": 3}, mlp_only_layers=[1]), "text"),
    # LFM2-MoE: LFM2's layer kinds, a dense first layer (num_dense_layers), then experts picked by sigmoid scores plus
    # the block's expert bias (zeros at init), renormalised
    ("lfm2_moe", _lm("Lfm2MoeForCausalLM", "Lfm2MoeConfig", layer_types=["conv", "full_attention", "conv"],
                     num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**GQA, "num_hidden_layers": 3}), "text"),
    # GLM-4.5: a dense first layer, then experts chosen by grouped sigmoid routing beside ungated shared experts
    ("glm4_moe", _lm("Glm4MoeForCausalLM", "Glm4MoeConfig", head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=96, n_shared_experts=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, pad_token_id=0,
                     **{**GQA, "num_hidden_layers": 3}), "text"),
    # dots.llm1 and EXAONE-MoE: GLM-4.5's routing and shared experts; EXAONE-MoE's dense layer by mlp_layer_types
    ("dots1", _lm("Dots1ForCausalLM", "Dots1Config", head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, moe_intermediate_size=96, n_shared_experts=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0, **{**GQA, "num_hidden_layers": 3}),
     "text"),
    ("exaone_moe", _lm("ExaoneMoeForCausalLM", "ExaoneMoeConfig", head_dim=8, num_experts=8, num_experts_per_tok=2,
                       n_group=2, topk_group=1, mlp_layer_types=["sparse", "dense", "sparse"],
                       moe_intermediate_size=96, num_shared_experts=1, sliding_window=16, sliding_window_pattern=2,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**GQA, "num_hidden_layers": 3}), "text"),
    # DeepSeek-V3 and GLM-4.7-Flash: multi-head latent attention (queries through a latent, keys and values expanded
    # per head from one shared latent) over GLM-4.5's FFNs
    ("deepseek_v3", _lm("DeepseekV3ForCausalLM", "DeepseekV3Config", n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=96, n_shared_experts=1,
                        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        **{**GQA, "num_hidden_layers": 3, "num_key_value_heads": 8}), "text"),
    # Mistral 4: DeepSeek-V3's layers, its router's softmax scores within the groups whose best two sum highest
    ("mistral4", _lm("Mistral4ForCausalLM", "Mistral4Config", n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                     topk_group=1, first_k_dense_replace=1, moe_intermediate_size=96, n_shared_experts=1,
                     q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     **{**GQA, "num_hidden_layers": 3, "num_key_value_heads": 8}), "text"),
    ("glm4_moe_lite", _lm("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", n_routed_experts=8, num_experts_per_tok=2,
                          n_group=2, topk_group=1, moe_intermediate_size=96, n_shared_experts=1, q_lora_rank=48,
                          kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, **{**GQA, "num_hidden_layers": 3, "num_key_value_heads": 8}),
     "text"),
    # DeepSeek-V2: the same attention (a complex-valued rotary, exported in real arithmetic), a softmax router within
    # the groups of the best single experts
    ("deepseek_v2", _lm("DeepseekV2ForCausalLM", "DeepseekV2Config", n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1,
                        moe_intermediate_size=96, n_shared_experts=1, q_lora_rank=48, kv_lora_rank=32,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, **{**GQA, "num_hidden_layers": 3, "num_key_value_heads": 8}), "text"),
    # ERNIE 4.5 MoE: softmax scores plus a correction bias pick the experts; a dense first layer
    ("ernie4_5_moe", _lm("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", head_dim=8, moe_num_experts=8, moe_k=2,
                         moe_intermediate_size=96, moe_num_shared_experts=1, moe_layer_start_index=1,
                         **{**GQA, "num_hidden_layers": 3}), "text"),
    ("qwen2_moe", _lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=96, shared_expert_intermediate_size=128, **GQA), "text"),
    # Qwen3.5-MoE's language model: Qwen3.5's Gated DeltaNet and gated-query attention layers over Qwen2-MoE's FFNs
    ("qwen3_5_moe_text", _lm("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", head_dim=8, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=128,
                             **{**GQA, "num_hidden_layers": 4}), "text"),
    # Qwen3-Next: the same layers, its DeltaNet's projections fused
    ("qwen3_next", _lm("Qwen3NextForCausalLM", "Qwen3NextConfig", head_dim=8, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=128,
                       **{**GQA, "num_hidden_layers": 4}), "text"),
    # decoders served as encoders: an embedding model's base model (Qwen3-Embedding), a reranker's score head
    ("qwen3-embedding", _lm("Qwen3Model", "Qwen3Config", head_dim=8, pad_token_id=0, **GQA), "text"),
    ("qwen3-reranker", _lm("Qwen3ForSequenceClassification", "Qwen3Config", head_dim=8, pad_token_id=0, num_labels=1,
                           **GQA), "text"),
    ("bert", _lm("BertModel", "BertConfig", **ENCODER), "text"),
    ("roberta", _lm("RobertaModel", "RobertaConfig", pad_token_id=1, **ENCODER), "text"),
    ("distilbert", _lm("DistilBertModel", "DistilBertConfig", dim=64, n_layers=2, n_heads=8, hidden_dim=96, **TEXT),
     "text"),
    ("deberta-v2", _lm("DebertaV2Model", "DebertaV2Config", **ENCODER), "text"),
    ("modernbert", _lm("ModernBertModel", "ModernBertConfig", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       cls_token_id=1, sep_token_id=2, **ENCODER), "text"),
    ("mpnet", _lm("MPNetModel", "MPNetConfig", **ENCODER), "text"),
    ("electra", _lm("ElectraModel", "ElectraConfig", embedding_size=32, **ENCODER), "text"),
    ("ernie", _lm("ErnieModel", "ErnieConfig", **ENCODER), "text"),
    ("roformer", _lm("RoFormerModel", "RoFormerConfig", **ENCODER), "text"),
    ("camembert", _lm("CamembertModel", "CamembertConfig", pad_token_id=1, **ENCODER), "text"),
    ("data2vec-text", _lm("Data2VecTextModel", "Data2VecTextConfig", pad_token_id=1, **ENCODER), "text"),
    ("xlm-roberta-xl", _lm("XLMRobertaXLModel", "XLMRobertaXLConfig", pad_token_id=1, **ENCODER), "text"),
    # T5's encoder (Flux's, SD3's text encoder; T5 v1.1 / Flan-T5's gated FFN), UMT5's (Wan's)
    ("t5", _lm("T5EncoderModel", "T5Config", d_model=64, num_layers=2, num_heads=8, d_kv=8, d_ff=96, vocab_size=50),
     "text"),
    ("t5-gated", _lm("T5EncoderModel", "T5Config", d_model=64, num_layers=3, num_heads=8, d_kv=8, d_ff=96,
                     feed_forward_proj="gated-gelu", vocab_size=50), "text"),
    ("umt5", _lm("UMT5EncoderModel", "UMT5Config", d_model=64, num_layers=2, num_heads=8, d_kv=8, d_ff=96,
                 vocab_size=50), "text"),
    ("esm", _lm("EsmModel", "EsmConfig", pad_token_id=1, mask_token_id=2, position_embedding_type="rotary",
                **ENCODER), "text"),
    ("megatron-bert", _lm("MegatronBertModel", "MegatronBertConfig", **ENCODER), "text"),
    ("jina_embeddings_v3", _lm("JinaEmbeddingsV3Model", "JinaEmbeddingsV3Config", pad_token_id=1, **ENCODER), "text"),
    ("eurobert", _lm("EuroBertModel", "EuroBertConfig", num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, **ENCODER), "text"),
    ("vit", _lm("ViTModel", "ViTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                intermediate_size=96, patch_size=8, add_pooling_layer=False, **IMAGE), "image"),
    ("deit", _lm("DeiTModel", "DeiTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                 intermediate_size=96, patch_size=8, add_pooling_layer=False, **IMAGE), "image"),
    ("dinov2", _lm("Dinov2Model", "Dinov2Config", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                   mlp_ratio=2, patch_size=8, **IMAGE), "image"),
    ("dinov2_with_registers", _lm("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", hidden_size=64,
                                  num_hidden_layers=2, num_attention_heads=8, mlp_ratio=2, patch_size=8,
                                  num_register_tokens=4, **IMAGE), "image"),
    ("dinov3_vit", _lm("DINOv3ViTModel", "DINOv3ViTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                       intermediate_size=96, patch_size=8, num_register_tokens=4, **IMAGE), "image"),
    # the gated FFNs of DINOv2 giant and DINOv3 H+ / 7B
    ("dinov2-swiglu", _lm("Dinov2Model", "Dinov2Config", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                          mlp_ratio=2, use_swiglu_ffn=True, patch_size=8, **IMAGE), "image"),
    ("dinov3_vit-gated", _lm("DINOv3ViTModel", "DINOv3ViTConfig", hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=8, intermediate_size=96, use_gated_mlp=True, patch_size=8,
                             num_register_tokens=4, **IMAGE), "image"),
    ("clip_vision_model", _lm("CLIPVisionModel", "CLIPVisionConfig", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=8, intermediate_size=96, patch_size=8, **IMAGE), "image"),
    ("siglip_vision_model", _lm("SiglipVisionModel", "SiglipVisionConfig", hidden_size=64, num_hidden_layers=2,
                                num_attention_heads=8, intermediate_size=96, patch_size=8, **IMAGE), "image"),
    # image classifiers of the vision transformer families: their heads kept (DeiT's two, averaged)
    ("vit-classifier", _lm("ViTForImageClassification", "ViTConfig", hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=8, intermediate_size=96, patch_size=8, num_labels=10, **IMAGE), "image"),
    ("dinov2-classifier", _lm("Dinov2ForImageClassification", "Dinov2Config", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=8, mlp_ratio=2, patch_size=8, num_labels=10, **IMAGE), "image"),
    ("deit-teacher", _lm("DeiTForImageClassificationWithTeacher", "DeiTConfig", hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=8, intermediate_size=96, patch_size=8, num_labels=10, **IMAGE), "image"),
    ("swin", _lm("SwinModel", "SwinConfig", embed_dim=16, depths=[1, 1], num_heads=[2, 4], patch_size=4, window_size=4,
                 **IMAGE), "image"),
    ("resnet", _lm("ResNetForImageClassification", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                   depths=[1, 1], num_labels=10, num_channels=3), "image224"),
    ("mobilenet_v2", _lm("MobileNetV2ForImageClassification", "MobileNetV2Config", depth_multiplier=0.35,
                         num_labels=10, **IMAGE), "image"),
    ("efficientnet", _live_scales(_lm("EfficientNetForImageClassification", "EfficientNetConfig",
                                     width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, num_labels=10,
                                     **IMAGE)), "image"),
    ("convnext", _lm("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1],
                     num_stages=2, num_labels=10, num_channels=3), "image224"),
]
# the vision CNNs at their published shapes (`--real-sizes`): each builder is the family's HF config with the
# shape's fields (HF's default EfficientNetConfig is B7, its default ResNetConfig is ResNet-50)
REAL_SIZES: list[tuple[str, Callable[[], object], str]] = [
    ("resnet-50", _live_scales(_lm("ResNetForImageClassification", "ResNetConfig", num_labels=1000)), "real224"),
    ("mobilenet_v2-1.0", _live_scales(_lm("MobileNetV2ForImageClassification", "MobileNetV2Config", num_labels=1001)),
     "real224"),
    ("efficientnet-b0", _live_scales(_lm("EfficientNetForImageClassification", "EfficientNetConfig",
                                        width_coefficient=1.0, depth_coefficient=1.0, image_size=224,
                                        hidden_dim=1280, num_labels=1000)), "real224"),
    ("convnext-t", _live_scales(_lm("ConvNextForImageClassification", "ConvNextConfig", num_labels=1000)), "real224"),
]
# each input kind's own flags: toys are timed with more repeats (their milliseconds are noise), a real size with
# the job's defaults
KIND_FLAGS = {"text": ["--repeats", "5", "--sequences", "32", "--sequence-length", "32"],
              "image": ["--repeats", "5"],
              "image224": ["--repeats", "5", "--shape", "batch=8"],
              "real224": []}
MODES = {"uniform": ["--uniform-ratio", "0.25"], "target": ["--target-speedup", "1.3", "--max-rounds", "2"]}


def _data(root: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    np.savez(root / "ids.npz", ids=rng.integers(3, 50, size=4000), offsets=[0, 2000, 4000])
    np.savez(root / "images.npz", x=rng.integers(0, 256, size=(200, 32, 32, 3), dtype=np.uint8))
    # configs without image_size (ResNet, ConvNeXt) are loaded at 224 x 224
    np.savez(root / "images224.npz", x=rng.integers(0, 256, size=(160, 224, 224, 3), dtype=np.uint8))
    return {"text": root / "ids.npz", "image": root / "images.npz", "image224": root / "images224.npz",
            "real224": root / "images224.npz"}


class _Stderr:
    """Whatever sys.stderr is at each write: the jobs' log lines follow each job's redirection (the CLI's
    `logging.basicConfig` would otherwise bind the first job's stream for every job after it)."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def run(family: str, build: Callable[[], object], kind: str, mode: str, root: Path, data: dict[str, Path]) -> dict:
    from service.client import cli

    directory = root / family
    if not directory.exists():
        try:
            build().save_pretrained(directory)
        except Exception as exc:  # a config this table gets wrong for the installed transformers
            return {"family": family, "mode": mode, "result": f"not built: {type(exc).__name__}: {str(exc)[:100]}",
                    "seconds": 0.0}
    out = root / f"{family}-{mode}"
    args = ["-v", "compress", str(directory), *MODES[mode], "--calibration", str(data[kind]), "--out", str(out),
            "--accuracy-budget", "none", "--samples", "64", "--refine-steps", "0", *KIND_FLAGS[kind]]
    err = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            code = cli.main(args)
    except Exception as exc:  # a traceback is a result here: the table says which family still raises
        return {"family": family, "mode": mode, "result": f"traceback: {type(exc).__name__}: {str(exc)[:120]}",
                "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    if out.is_dir():  # the verbose log beside the report (--keep reads it back)
        (out / "job.log").write_text(err.getvalue())
    lines = [line for line in err.getvalue().strip().splitlines() if not line.startswith(("[", "20"))]
    last = lines[-1] if lines else ""
    report_path = out / "report.json"
    if not report_path.is_file():
        return {"family": family, "mode": mode, "result": f"refused (exit {code}): {last[:200]}", "seconds": seconds}
    report = json.loads(report_path.read_text())
    parity = report.get("artifacts", {}).get("parity", {})
    return {"family": family, "mode": mode, "result": report["status"], "speedup": report.get("measured_speedup"),
            "parity_peak": parity.get("peak_error"),
            "params": [report.get("params_before"), report.get("params_after")], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="", help="comma-separated (default: all)")
    parser.add_argument("--modes", default="uniform,target")
    parser.add_argument("--real-sizes", action="store_true",
                        help="the vision CNNs at their published shapes instead of the tiny families")
    parser.add_argument("--keep", type=Path, help="keep the work (models, reports, job logs) in this directory")
    args = parser.parse_args()
    chosen = set(filter(None, args.families.split(",")))
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s", stream=_Stderr())
    rows = []
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            root = args.keep
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        data = _data(root)
        for family, build, kind in REAL_SIZES if args.real_sizes else FAMILIES:
            if chosen and family not in chosen:
                continue
            for mode in args.modes.split(","):
                row = run(family, build, kind, mode, root, data)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| family | mode | result | measured speedup | parameters | parity peak | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r['speedup']:.3f}x" if r.get("speedup") else "-"
        peak = f"{r['parity_peak']:.1e}" if r.get("parity_peak") is not None else "-"
        params = " -> ".join(f"{p:,}" for p in r["params"]) if r.get("params") and None not in r["params"] else "-"
        print(f"| {r['family']} | {r['mode']} | {r['result']} | {speed} | {params} | {peak} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
