"""Tiny random-init models of every supported transformer family (structure tests only)."""

import torch
import transformers

from compressor.transformer.adapters import adapter_for
from compressor.transformer.experts import ALIGN

VOCAB = 50


def _seeded(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


def tiny_bert():
    return _seeded(transformers.BertModel, transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=32))


def tiny_vit():
    return _seeded(transformers.ViTModel, transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24, image_size=16,
        patch_size=4, add_pooling_layer=False))


def tiny_deit():
    """ViT's blocks with a distillation token beside [CLS]."""
    return _seeded(transformers.DeiTModel, transformers.DeiTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24, image_size=16,
        patch_size=4))


def tiny_swin():
    """Blocks in two stages (two blocks each: the second shifts its windows), patch merging between them (16 -> 32
    wide, 8 x 8 -> 4 x 4 patches), 2 then 4 heads of 8, a relative-position bias table with a column per head."""
    return _seeded(transformers.SwinModel, transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, mlp_ratio=1.5))


def tiny_opt():
    return _seeded(transformers.OPTForCausalLM, transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=24, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=32, pad_token_id=1, bos_token_id=2, eos_token_id=2))


def tiny_gpt2():
    return _seeded(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=24, n_positions=32, bos_token_id=0,
        eos_token_id=0))


def tiny_gpt_neox():
    """Per-head fused query_key_value ([q_h | k_h | v_h] per head), partial rotary, parallel residual."""
    return _seeded(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=32, rotary_pct=0.5))


def tiny_llama():
    """Grouped-query attention: 8 query heads over 2 KV heads."""
    return _seeded(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=4, intermediate_size=20, max_position_embeddings=32, tie_word_embeddings=True))


def tiny_qwen2():
    """Grouped-query attention with q/k/v biases."""
    return _seeded(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=20, max_position_embeddings=32))


def tiny_distilbert():
    """Post-norm like BERT, its own module and config names (n_heads, dim, hidden_dim)."""
    return _seeded(transformers.DistilBertModel, transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=24, max_position_embeddings=32))


def tiny_qwen3():
    """Grouped-query attention with per-head q/k norms (q_norm, k_norm over head_dim)."""
    return _seeded(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=20, max_position_embeddings=32))


def tiny_gemma2():
    """Head size not hidden / heads, norms after each sub-layer, soft-capping, a sliding-window layer,
    gated GELU."""
    return _seeded(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=20, max_position_embeddings=32, sliding_window=4))


def tiny_gemma3():
    """Gemma 2's layout with per-head q/k norms; a sliding-window layer (window 4) with its own rotary base,
    then a global one."""
    return _seeded(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=20, max_position_embeddings=64, sliding_window=4, sliding_window_pattern=2))


def tiny_phi3():
    """q/k/v fused into qkv_proj under grouped-query attention, gate and up fused into gate_up_proj, partial
    rotary (Phi-4-mini's)."""
    return _seeded(transformers.Phi3ForCausalLM, transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=20, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        partial_rotary_factor=0.5))


def tiny_mixtral():
    """Mixture-of-Experts: 4 SwiGLU experts of 20 neurons, 2 a token, renormalised routing weights; GQA."""
    return _seeded(transformers.MixtralForCausalLM, transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=20, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))


def tiny_qwen3_moe():
    """Mixture-of-Experts with Qwen3's per-head q/k norms: 4 experts of 20 neurons, 2 a token, routing weights not
    renormalised (norm_topk_prob off)."""
    return _seeded(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, moe_intermediate_size=20, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, max_position_embeddings=32))



def tiny_qwen2_moe():
    """Qwen3-MoE's experts without its q/k norms, with q/k/v biases and a shared expert (24 neurons, its own sigmoid
    gate) beside the routed ones; routing weights not renormalised."""
    return _seeded(transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        moe_intermediate_size=20, shared_expert_intermediate_size=24, intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=32))


def tiny_phimoe():
    """Phi-3.5-MoE: Mixtral's experts (4 of 20 neurons) behind a sparse-mixer router (two a token, jitter 0.01), q/k/v
    biases, LayerNorms."""
    return _seeded(transformers.PhimoeForCausalLM, transformers.PhimoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=20, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        router_jitter_noise=0.01, attention_bias=True))


def tiny_gpt_oss():
    """gpt-oss: 4 experts of 32 neurons stored transposed with interleaved gate / up columns and biases, a clamped
    SwiGLU, a router with a bias, two experts a token; attention sinks; sliding-window (4) and full layers; GQA. Its
    initialisation zeroes the experts' biases and its pre-activations stay far below the clamp: biases drawn and the
    clamp at 0.3, so that both count."""
    model = _seeded(transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias, layer.mlp.router.bias):
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
    return model


def tiny_olmoe():
    """OLMoE: 4 experts of 20 neurons, 2 a token, weights not renormalised; q/k norms over all the heads together
    (heads stay whole), clipped q/k/v."""
    return _decoder("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2, clip_qkv=0.5)


def tiny_flex_olmo():
    """FlexOLMo: OLMoE's experts and q/k norms in OLMo 2's layout (a norm after each sub-layer, none before)."""
    return _decoder("FlexOlmoForCausalLM", "FlexOlmoConfig", num_experts=4, num_experts_per_tok=2)


def tiny_glm4_moe(dense_layers: int = 0, layers: int = 2):
    """GLM-4.5: 8 experts of 16 neurons in 2 groups, 2 a token from the better group by sigmoid scores plus a
    correction bias (drawn: it initialises to 0), weights renormalised and scaled by 2.5; an ungated shared expert of
    16 neurons; per-head q/k norms, partial rotary; `dense_layers` first layers with a dense FFN of 20 neurons."""
    model = _decoder("Glm4MoeForCausalLM", "Glm4MoeConfig", num_hidden_layers=layers, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=dense_layers,
                     moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     use_qk_norm=True, partial_rotary_factor=0.5)
    return _draw_correction_bias(model)


def _draw_correction_bias(model):
    """`model` with each grouped router's correction bias drawn (transformers initialises it to 0; a trained one is
    not): small, so that the sigmoid scores still decide."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias"):  # not DeepSeek-V2's softmax
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.01)
    return model


def _grouped(cls: str, config: str, layers: int = 3, **fields):
    """`tiny_glm4_moe`'s experts, router and shared expert under another family's names (8 experts of 16 neurons in 2
    groups, 2 a token; the correction bias drawn)."""
    model = _decoder(cls, config, num_hidden_layers=layers, num_experts_per_tok=2, n_group=2, topk_group=1,
                     moe_intermediate_size=16, routed_scaling_factor=2.5, norm_topk_prob=True, **fields)
    return _draw_correction_bias(model)


def tiny_latent(cls: str = "DeepseekV3ForCausalLM", config: str = "DeepseekV3Config", layers: int = 3,
                q_lora_rank: int | None = 24, **fields):
    """Multi-head latent attention (DeepSeek-V3's): 4 heads, each 8 + 4 query / key rows (no rotary / rotary) and 8
    value rows expanded from a shared 16-wide latent (what the cache holds) beside a 4-wide shared rotary key; queries
    through a 24-wide latent (`q_lora_rank`, or a plain q_proj with None); GLM-4.5's experts, router and shared expert,
    the first layer a dense FFN of 20 neurons. Built without `_decoder`: a head_dim in the config would size the
    rotary tables for it instead of qk_rope_head_dim."""
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config)(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=20, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **fields)).eval()
    return _draw_correction_bias(model)


def tiny_ernie_moe():
    """ERNIE 4.5 MoE: GLM-4.5's experts and ungated shared expert of `_grouped`, 2 of 8 experts a token by softmax
    scores plus a correction bias (drawn: it initialises to 0), their scores renormalised as weights; its first
    layer a dense FFN of 20 neurons (moe_layer_start_index 1)."""
    model = _decoder("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", num_hidden_layers=3, moe_num_experts=8, moe_k=2,
                     moe_intermediate_size=16, moe_num_shared_experts=1, moe_layer_start_index=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8, generator=gen) * 0.01)
    return model


# MoE decoders of 3 layers with one dense-FFN layer (20 neurons) between or before their MoE layers, and its index:
# GLM-4.5's, dots.llm1's, DeepSeek-V3's and V2's first layer (first_k_dense_replace), GLM-4.7-Flash's (mlp_layer_types),
# ERNIE 4.5's (moe_layer_start_index),
# Qwen3-MoE's (mlp_only_layers) and EXAONE-MoE's (mlp_layer_types) middle one; `test_expert_families.py` takes each
# through pruning, export, layer removal and reload
MOE_MIXED = {
    "glm4_moe": (lambda: tiny_glm4_moe(dense_layers=1, layers=3), 0),
    "dots1": (lambda: _grouped("Dots1ForCausalLM", "Dots1Config", n_routed_experts=8, n_shared_experts=1,
                               first_k_dense_replace=1), 0),
    "exaone_moe": (lambda: _grouped("ExaoneMoeForCausalLM", "ExaoneMoeConfig", num_experts=8, num_shared_experts=1,
                                    mlp_layer_types=["sparse", "dense", "sparse"], sliding_window=4,
                                    sliding_window_pattern=2), 1),
    "qwen3_moe": (lambda: _decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_hidden_layers=3, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]), 1),
    # DeepSeek-V3's and GLM-4.7-Flash's multi-head latent attention over GLM-4.5's FFNs
    "deepseek_v3": (lambda: tiny_latent(first_k_dense_replace=1), 0),
    "glm4_moe_lite": (lambda: tiny_latent("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig"), 0),
    "ernie4_5_moe": (tiny_ernie_moe, 0),
    # Mistral 4's: DeepSeek-V3's layers, its router's softmax scores within the groups whose best two sum highest
    "mistral4": (lambda: tiny_latent("Mistral4ForCausalLM", "Mistral4Config", first_k_dense_replace=1), 0),
    # DeepSeek-V2's: its router's softmax scores within the groups of the best single experts
    "deepseek_v2": (lambda: tiny_latent("DeepseekV2ForCausalLM", "DeepseekV2Config", first_k_dense_replace=1,
                                        topk_method="group_limited_greedy"), 0),
}


# Mixture-of-Experts families beside MODELS' three: `test_experts.py` takes each through its MoE tests and an
# end-to-end test of its own
MOE_EXTRA = {"phimoe": tiny_phimoe, "gpt_oss": tiny_gpt_oss, "olmoe": tiny_olmoe, "flex_olmo": tiny_flex_olmo,
             "glm4_moe": tiny_glm4_moe, "qwen3_5_moe_text": lambda: tiny_qwen3_5_moe(),
             "qwen3_next": lambda: tiny_qwen3_next(), "lfm2_moe": lambda: tiny_lfm2_moe(),
             "granitemoehybrid:moe": lambda: tiny_granite_hybrid_moe(),  # (defined below)
             "granitemoe": lambda: tiny_granite_moe(), "granitemoeshared": lambda: tiny_granite_moe(shared=20)}


def _decoder(cls: str, config: str, **fields):
    """A tiny decoder of a Llama-shaped family: 4 query heads of 8 over 2 KV heads, 20 FFN neurons."""
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, intermediate_size=20, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    return _seeded(getattr(transformers, cls), getattr(transformers, config)(**{**sizes, **fields}))


def _latent_dense(cls: str, config: str, **fields):
    """`tiny_latent`'s multi-head latent attention (4 heads; queries through a 24-wide latent) over a Llama MLP of 20
    neurons, 2 layers."""
    return _seeded(getattr(transformers, cls), getattr(transformers, config)(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=20, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **fields))


def tiny_qwen3_5(layer_types: tuple[str, ...] = ("linear_attention", "full_attention")):
    """Qwen3.5's language model: Gated DeltaNet layers (2 key heads of 8 over 4 value heads of 8: 4 "heads" of the
    output projection's 32 inputs) beside gated-query attention layers, Llama's MLP in each."""
    return _decoder("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", num_hidden_layers=len(layer_types),
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=list(layer_types))


def tiny_qwen3_5_moe(layer_types: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention")):
    """Qwen3.5-MoE's language model: `tiny_qwen3_5`'s two layer kinds, each with 4 experts of 32 neurons (2 a token,
    renormalised) beside a shared expert of 24 neurons under its sigmoid gate."""
    return _decoder("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", num_hidden_layers=len(layer_types),
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=list(layer_types), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=24)


def tiny_qwen3_next():
    """Qwen3-Next: `tiny_qwen3_5_moe`'s layers with its DeltaNet's projections fused (in_proj_qkvz, in_proj_ba, grouped
    by key head) and the last layer's FFN dense (mlp_only_layers: 20 neurons) under a DeltaNet mixer."""
    return _decoder("Qwen3NextForCausalLM", "Qwen3NextConfig", num_hidden_layers=3, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention"], num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24,
                    mlp_only_layers=[2])


def tiny_gemma4(layers: int = 3, **fields):
    """Gemma 4's language model: sliding-window layers of 4 heads of 8 over 2 KV heads, then a global layer of 4 heads
    of 16 over one KV head whose values are its keys (attention_k_eq_v: no v_proj), stated per layer
    (per_layer_config); per-layer input embeddings of 8 a layer; each block's output scalar set unequal to one."""
    model = _decoder("Gemma4ForCausalLM", "Gemma4TextConfig", num_hidden_layers=layers, sliding_window=4,
                     layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], global_head_dim=16,
                     num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8,
                     vocab_size_per_layer_input=VOCAB, **fields)
    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            block.layer_scalar.fill_(0.6 + 0.3 * i)
    return model


def tiny_granite_hybrid(layer_types: tuple[str, ...] = ("linear_attention", "full_attention"), **fields):
    """Granite 4.0-H: Mamba2 mixers (4 heads of 16 over one group, state 8, chunks of 8 tokens) beside attention layers
    without positions (position_embedding_type nope, as Granite 4.0-H's), a fused SwiGLU FFN of 20 neurons in each
    layer (shared_mlp), Granite's multipliers set away from 1."""
    return _decoder("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", num_hidden_layers=len(layer_types),
                    layer_types=list(layer_types), shared_intermediate_size=20, mamba_n_heads=4, mamba_d_head=16,
                    mamba_d_state=8, mamba_chunk_size=8, position_embedding_type="nope", embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
                    **{"num_local_experts": 0, **fields})


def tiny_granite_moe(shared: int = 0):
    """Granite 3.x MoE: Llama's attention over 4 experts of 32 neurons (2 a token by softmax top-k) in each of 2
    layers, Granite's multipliers set away from 1; `shared`: a fused SwiGLU shared expert of that many neurons beside
    them (granitemoeshared)."""
    fields = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
                  num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    if shared:
        return _decoder("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", shared_intermediate_size=shared,
                        **fields)
    return _decoder("GraniteMoeForCausalLM", "GraniteMoeConfig", **fields)


def tiny_granite_hybrid_moe():
    """Granite 4.0-H-Tiny's layout: `tiny_granite_hybrid`'s layers (a Mamba2 mixer, an attention, a Mamba2 mixer), each
    FFN 4 experts of 32 neurons, 2 a token by softmax top-k, beside a fused SwiGLU shared expert of 20 neurons."""
    return tiny_granite_hybrid(("linear_attention", "full_attention", "linear_attention"), num_local_experts=4,
                               num_experts_per_tok=2, intermediate_size=32)


def tiny_falcon_h1(**fields):
    """Falcon-H1: in each layer a Mamba2 mixer (4 heads of 16 over one group, state 8, chunks of 8 tokens, its gated
    norm on) beside a rotary attention on the same input, a SwiGLU FFN of 20 neurons; every muP multiplier set away
    from 1."""
    return _decoder("FalconH1ForCausalLM", "FalconH1Config", mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                    mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=True, key_multiplier=0.7,
                    attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=1.2,
                    ssm_out_multiplier=0.9, mlp_multipliers=[1.1, 0.9], embedding_multiplier=2.0,
                    lm_head_multiplier=0.5, ssm_multipliers=[1.0, 0.9, 1.1, 1.2, 0.8], **fields)


def tiny_lfm2(layer_types: tuple[str, ...] = ("conv", "full_attention")):
    """LFM2: gated short convolutions (32 channels) beside Llama-like attention layers with per-head q/k norms, each
    with a SwiGLU FFN of 20 neurons, which the config sizes from intermediate_size 30 (block_auto_adjust_ff_dim: 2/3
    of it, rounded up to block_multiple_of); full_attn_idxs states the attention layers as real checkpoints do."""
    return _decoder("Lfm2ForCausalLM", "Lfm2Config", num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                    full_attn_idxs=[i for i, t in enumerate(layer_types) if t == "full_attention"],
                    intermediate_size=30, block_multiple_of=4)


def tiny_lfm2_moe():
    """LFM2-MoE: `tiny_lfm2`'s layer kinds (a short convolution, an attention, a short convolution), the first layer's
    FFN dense (num_dense_layers: 20 neurons), the others' 4 experts of 32 neurons, 2 a token by sigmoid scores plus
    the block's expert bias (drawn: it initialises to 0), renormalised and scaled by 2."""
    model = _decoder("Lfm2MoeForCausalLM", "Lfm2MoeConfig", num_hidden_layers=3,
                     layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.model.layers[1:]:
            block.feed_forward.expert_bias.copy_(torch.randn(4, generator=gen) * 0.05)
    return model


def tiny_smollm3():
    """Llama with rotary-free layers (no_rope_layers: the second layer has no positions)."""
    return _decoder("SmolLM3ForCausalLM", "SmolLM3Config", no_rope_layers=[1, 0], use_sliding_window=False)


def tiny_granite():
    """Llama with scalar multipliers: the embeddings, the attention scores, each residual update, the logits."""
    return _decoder("GraniteForCausalLM", "GraniteConfig", embedding_multiplier=4.0, attention_multiplier=0.2,
                    residual_multiplier=0.5, logits_scaling=2.0)


def tiny_glm4():
    """gate and up fused in gate_up_proj as [gate | up], q/k/v biases, partial rotary, a norm after each
    sub-layer."""
    return _decoder("Glm4ForCausalLM", "Glm4Config", partial_rotary_factor=0.5)


def tiny_exaone4():
    """No norm before a sub-layer, one after it; per-head q/k norms; a sliding-window layer, then a global one."""
    return _decoder("Exaone4ForCausalLM", "Exaone4Config", sliding_window=4, sliding_window_pattern=2)


def tiny_starcoder2():
    """One FFN input projection (GELU, no gate), biases everywhere, LayerNorm."""
    return _decoder("Starcoder2ForCausalLM", "Starcoder2Config", use_bias=True)


def tiny_modernbert():
    """Pre-norm encoder, Wqkv fused as [q | k | v], Wi as [input | gate]; a global layer, then a sliding-window
    one (window 4 of 9 tokens) with its own rotary base: each layer's own mask and rotary table."""
    return _seeded(transformers.ModernBertModel, transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))


def tiny_deberta_v2():
    """Disentangled attention with its own per-head position projections (share_att_key off: pos_query_proj and
    pos_key_proj), log-bucketed relative positions, post-norm."""
    return _seeded(transformers.DebertaV2Model, transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=32, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
        share_att_key=False, type_vocab_size=0, norm_rel_ebd="layer_norm"))


def tiny_mpnet():
    """BERT's post-norm layout, a relative attention bias per head computed once for every layer."""
    return _seeded(transformers.MPNetModel, transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=40))  # 32 relative buckets: compute_position_bias assumes them


MODELS = {"bert": tiny_bert, "vit": tiny_vit, "deit": tiny_deit, "swin": tiny_swin, "opt": tiny_opt, "gpt2": tiny_gpt2,
          "gpt_neox": tiny_gpt_neox,
          "llama": tiny_llama, "qwen2": tiny_qwen2, "distilbert": tiny_distilbert, "qwen3": tiny_qwen3,
          "gemma2": tiny_gemma2, "gemma3_text": tiny_gemma3, "phi3": tiny_phi3, "mixtral": tiny_mixtral,
          "qwen3_moe": tiny_qwen3_moe, "qwen2_moe": tiny_qwen2_moe, "smollm3": tiny_smollm3, "granite": tiny_granite,
          "glm4": tiny_glm4, "exaone4": tiny_exaone4, "starcoder2": tiny_starcoder2,
          "modernbert": tiny_modernbert, "deberta-v2": tiny_deberta_v2,
          "mpnet": tiny_mpnet}

# families whose blocks are Llama's modules under Llama's paths (or GLM's fused gate_up_proj, or one FFN input
# projection), only their own modeling code around them differing (OLMo's parameter-free LayerNorm and clipped
# q/k/v, HunYuan's per-head q/k norms, Seed-OSS's q/k/v biases, Nemotron's squared ReLU and LayerNorm1p, GLM's
# partial rotary, Apertus's xIELU, Command R's parallel FFN and R+'s q/k norms one row per head, StableLM 2's q/k norms
# one module per head and attribute head counts, Phi-2's fc1 / fc2 and dense, Cohere 2's sliding-window layers,
# MiniCPM3's and Youtu-LLM's latent attention over a dense MLP):
# `test_adapters.py` takes each through the pruning, the exports and a reload once, where MODELS' families each run
# the whole family-parametrised suite
LLAMA_SHAPED = {
    "olmo": lambda: _decoder("OlmoForCausalLM", "OlmoConfig", clip_qkv=0.5),
    "helium": lambda: _decoder("HeliumForCausalLM", "HeliumConfig"),
    "ministral": lambda: _decoder("MinistralForCausalLM", "MinistralConfig"),
    "ernie4_5": lambda: _decoder("Ernie4_5ForCausalLM", "Ernie4_5Config"),
    "seed_oss": lambda: _decoder("SeedOssForCausalLM", "SeedOssConfig", attention_bias=True),
    # configs of their own over Llama's modeling (LlamaForCausalLM, its model_type theirs)
    "exaone": lambda: _decoder("LlamaForCausalLM", "ExaoneConfig"),
    "internlm3": lambda: _decoder("LlamaForCausalLM", "InternLM3Config"),
    "iquestcoder": lambda: _decoder("LlamaForCausalLM", "IQuestCoderConfig"),
    "hunyuan_v1_dense": lambda: _decoder("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config"),
    "glm": lambda: _decoder("GlmForCausalLM", "GlmConfig", partial_rotary_factor=0.5),
    "nemotron": lambda: _decoder("NemotronForCausalLM", "NemotronConfig", partial_rotary_factor=0.5),
    "apertus": lambda: _decoder("ApertusForCausalLM", "ApertusConfig"),
    "arcee": lambda: _decoder("ArceeForCausalLM", "ArceeConfig"),
    "jais2": lambda: _decoder("Jais2ForCausalLM", "Jais2Config"),
    "cohere": lambda: _decoder("CohereForCausalLM", "CohereConfig", use_qk_norm=True),
    "cohere2": lambda: _decoder("Cohere2ForCausalLM", "Cohere2Config", sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"]),
    "stablelm": lambda: _decoder("StableLmForCausalLM", "StableLmConfig", qk_layernorm=True,
                                 use_parallel_residual=True, use_qkv_bias=True),
    "phi": lambda: _decoder("PhiForCausalLM", "PhiConfig", qk_layernorm=True),
    "vaultgemma": lambda: _decoder("VaultGemmaForCausalLM", "VaultGemmaConfig"),
    "ministral3": lambda: _decoder("Ministral3ForCausalLM", "Ministral3Config"),
    "cwm": lambda: _decoder("CwmForCausalLM", "CwmConfig"),
    "hyperclovax": lambda: _decoder("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig"),
    # latent attention over a dense MLP; MiniCPM3's residual scale restated with the depth (a layer goes below)
    "minicpm3": lambda: _latent_dense("MiniCPM3ForCausalLM", "MiniCPM3Config", scale_emb=4.0, scale_depth=1.4,
                                      dim_model_base=8),
    "youtu": lambda: _latent_dense("YoutuForCausalLM", "YoutuConfig"),
    # a Gated DeltaNet layer (its key groups pruned) before a gated-query attention layer (`test_adapters.py` exports
    # both kinds)
    "qwen3_5_text": tiny_qwen3_5,
    # short convolutions (their channels pruned, their conv states the decode step's) around an attention layer
    "lfm2": lambda: tiny_lfm2(("conv", "full_attention", "conv")),
    # a Mamba2 mixer (its heads pruned, its conv and scan states the decode step's) before an attention without
    # positions
    "granitemoehybrid": tiny_granite_hybrid,
    # Granite 4.0-H's mixers beside a rotary attention, its layer kinds stated by attn_layer_indices
    "bamba": lambda: _decoder("BambaForCausalLM", "BambaConfig", attn_layer_indices=[1], mamba_n_heads=4,
                              mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8),
    # a Mamba2 mixer beside the attention in every layer (kept whole; the decode step carries each layer's keys and
    # values and their conv and scan states), muP multipliers away from 1 on every path
    "falcon_h1": lambda: tiny_falcon_h1(),
    # global layers of their own head size over values that are keys, per-layer input embeddings, output scalars
    "gemma4_text": lambda: tiny_gemma4(),
    # GPT-2-like blocks: GPT-J's separate q/k/v, interleaved partial rotary and parallel FFN; GPT-BigCode's multi-query
    # attention (one KV head in c_attn, [q | k | v]) and learned positions
    "gptj": lambda: _seeded(transformers.GPTJForCausalLM, transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=20, n_positions=32, rotary_dim=4, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)),
    "gpt_bigcode": lambda: _seeded(transformers.GPTBigCodeForCausalLM, transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=20, n_positions=32, multi_query=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # GPT-BigCode without multi-query attention: c_attn per head, [q_h | k_h | v_h] (`adapters.VARIANTS`)
    "gpt_bigcode:mha": lambda: _seeded(transformers.GPTBigCodeForCausalLM, transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=20, n_positions=32, multi_query=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Falcon-7B's layout: multi-query attention fused as [q | k | v], the FFN beside the attention
    "falcon": lambda: _seeded(transformers.FalconForCausalLM, transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=20,
        max_position_embeddings=32, multi_query=True, parallel_attn=True, bias=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)),
}

_TEXT_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
                     max_position_embeddings=40)
_IMAGE_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24, image_size=16,
                      patch_size=4)


def _encoder(cls: str, config: str, **fields):
    return lambda: _seeded(getattr(transformers, cls), getattr(transformers, config)(**fields))


# encoders whose blocks are BERT's, ViT's or Llama's modules under their own paths, each taken through the pruning, the
# export and a reload once by `test_adapters.py`: ELECTRA's embedding projection, RoFormer's rotary positions, XLM-R
# XL's and Megatron-BERT's pre-norm, Jina v3's post-norm under Llama-like names, EuroBERT's bidirectional Llama;
# DINOv2's layer scales (its FFN 4 x hidden whatever intermediate_size says), register tokens, DINOv3's rotary
# patches, CLIP's and SigLIP's vision towers
ENCODER_SHAPED = {
    "electra": _encoder("ElectraModel", "ElectraConfig", embedding_size=16, **_TEXT_ENCODER),
    "ernie": _encoder("ErnieModel", "ErnieConfig", **_TEXT_ENCODER),
    "roformer": _encoder("RoFormerModel", "RoFormerConfig", **_TEXT_ENCODER),
    "camembert": _encoder("CamembertModel", "CamembertConfig", pad_token_id=1, **_TEXT_ENCODER),
    "data2vec-text": _encoder("Data2VecTextModel", "Data2VecTextConfig", pad_token_id=1, **_TEXT_ENCODER),
    "xlm-roberta-xl": _encoder("XLMRobertaXLModel", "XLMRobertaXLConfig", pad_token_id=1, **_TEXT_ENCODER),
    "megatron-bert": _encoder("MegatronBertModel", "MegatronBertConfig", **_TEXT_ENCODER),
    # ESM-2: rotary positions, a contact head over every layer's heads' attention maps
    "esm": _encoder("EsmModel", "EsmConfig", pad_token_id=1, mask_token_id=2, position_embedding_type="rotary",
                    **_TEXT_ENCODER),
    "jina_embeddings_v3": _encoder("JinaEmbeddingsV3Model", "JinaEmbeddingsV3Config", pad_token_id=1, **_TEXT_ENCODER),
    "eurobert": _encoder("EuroBertModel", "EuroBertConfig", num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, **_TEXT_ENCODER),
    # T5's encoder: the first layer's relative position bias handed on through the later ones; UMT5's per layer
    "t5": _encoder("T5EncoderModel", "T5Config", vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_kv=8,
                   d_ff=24, relative_attention_num_buckets=8, relative_attention_max_distance=16),
    "t5:gated": _encoder("T5EncoderModel", "T5Config", vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_kv=8,
                         d_ff=24, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                         feed_forward_proj="gated-gelu"),
    "mt5": _encoder("MT5EncoderModel", "MT5Config", vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_kv=8,
                    d_ff=24, relative_attention_num_buckets=8, relative_attention_max_distance=16),
    "umt5": _encoder("UMT5EncoderModel", "UMT5Config", vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_kv=8,
                     d_ff=24, relative_attention_num_buckets=8, relative_attention_max_distance=16),
    "umt5:ungated": _encoder("UMT5EncoderModel", "UMT5Config", vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                             d_kv=8, d_ff=24, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                             feed_forward_proj="relu"),
    "dinov2": _encoder("Dinov2Model", "Dinov2Config", layerscale_value=0.5, **_IMAGE_ENCODER),
    "dinov2_with_registers": _encoder("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", num_register_tokens=2,
                                      **_IMAGE_ENCODER),
    "dinov3_vit": _encoder("DINOv3ViTModel", "DINOv3ViTConfig", num_register_tokens=2, **_IMAGE_ENCODER),
    "clip_vision_model": _encoder("CLIPVisionModel", "CLIPVisionConfig", **_IMAGE_ENCODER),
    "siglip_vision_model": _encoder("SiglipVisionModel", "SiglipVisionConfig", **_IMAGE_ENCODER),
    # variants of a family's layout (`adapters.VARIANTS`): DINOv2 giant's SwiGLU FFN, DINOv3 7B's gated one
    "dinov2:swiglu": _encoder("Dinov2Model", "Dinov2Config", use_swiglu_ffn=True, **_IMAGE_ENCODER),
    "dinov3_vit:gated": _encoder("DINOv3ViTModel", "DINOv3ViTConfig", use_gated_mlp=True, **_IMAGE_ENCODER),
}

# families whose attention heads are not a prunable unit (`FamilyAdapter.heads_prunable`): OLMo 2 and 3 normalise
# all heads' queries and keys together; their FFNs and layers are pruned (`test_adapters.py`)
HEADS_FIXED = {
    "olmo2": lambda: _decoder("Olmo2ForCausalLM", "Olmo2Config"),
    "olmo3": lambda: _decoder("Olmo3ForCausalLM", "Olmo3Config", sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"]),
}


def ffn_keep(model, keep: list[int]) -> list[int]:
    """FFN neurons to keep: `keep`, or for a Mixture-of-Experts layer as many more as make a multiple of
    experts.ALIGN (the widths its experts take)."""
    if not adapter_for(model).experts:
        return keep
    spare = [n for n in range(ALIGN * 3) if n not in keep]
    return sorted(keep + spare[:ALIGN - len(keep) % ALIGN])


def example_inputs(model, batch: int = 2, length: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if hasattr(model.config, "num_channels"):  # a vision transformer
        size = model.config.image_size
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=gen)}
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, length // 2:] = 0  # right padding in the first row
    return {"input_ids": ids, "attention_mask": mask}


def output_name(model) -> str:
    return "logits" if hasattr(model, "lm_head") else "last_hidden_state"


def first_output(model, inputs=None) -> torch.Tensor:
    inputs = example_inputs(model) if inputs is None else inputs
    with torch.no_grad():
        return getattr(model(**inputs), output_name(model))
