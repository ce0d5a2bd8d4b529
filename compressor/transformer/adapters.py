"""Architecture knowledge as data: where each transformer family keeps its heads and FFN neurons.

Module paths and the config keys that differ between families live in this table, and `dims` reads
the sizes that pruning works with (layers, heads, head size, hidden width) from the config, so a
rename in a new transformers release breaks one table entry, not the pipeline. Config fields that
every HF model has and that say nothing about the pruned widths (`use_cache`, `architectures`,
`type_vocab_size`, ...) are read where they are used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..errors import UnsupportedArchitecture

# why a family's heads are not a unit (`FamilyAdapter.heads_prunable`), as the refusals and warnings say it
FIXED_HEADS = "a norm spans all the heads' queries and keys together"
# the `layer_types` entry of a layer built with a linear-attention mixer (transformers' name: Qwen3.5's, Qwen3-Next's)
LINEAR_LAYER = "linear_attention"
# ... why a linear-attention mixer is kept whole where its units are not prunable (`FamilyAdapter.linear_heads` off)
LINEAR_MIXER = "a linear-attention mixer of this family is kept whole: its units are not prunable"


@dataclass(frozen=True)
class FamilyAdapter:
    """Submodule paths of one family, relative to the model (layers) or to a block (the rest).

    Projections are nn.Linear or transformers' Conv1D (GPT-2: the weight is stored transposed).
    """

    layers: str  # path of the ModuleList of blocks
    q: str
    k: str
    v: str
    o: str  # attention output projection: its input rows are the heads
    up: tuple[str, ...]  # FFN input projections (up, and gate for gated FFNs)
    down: str  # FFN output projection: its input rows are the neurons
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = None  # grouped-query attention
    # the config flag of multi-query attention, one KV head read by every query head (GPT-BigCode's multi_query)
    multi_query_key: str | None = None
    # q, k and v are one projection with [q | k | v] output rows (GPT-2's c_attn; Phi-3's qkv_proj, whose k and v
    # parts are KV heads under grouped-query attention)
    fused_qkv: bool = False
    # ... laid out per head instead: [q_h | k_h | v_h] for each head h in turn (GPT-NeoX's query_key_value)
    qkv_per_head: bool = False
    # attention attributes that reshapes read after surgery: the query-head count, the query width
    # (heads x head_dim); models that reshape with -1 need neither
    head_count_attrs: tuple[str, ...] = ()
    width_attrs: tuple[str, ...] = ()
    # further projections whose output rows are laid out per head like q's, pruned with them where a block has
    # them (DeBERTa-v2's pos_query_proj / pos_key_proj, without share_att_key)
    per_head_outputs: tuple[str, ...] = ()
    # the module taking `position_bias`, a score bias per head computed once for every layer (MPNet's relative
    # attention bias): a pruned layer reads the bias rows of the heads it kept (`surgery.set_bias_rows`)
    head_bias: str | None = None
    # the module that hands the per-head score bias on to the next layer (T5's layer.0 returns the position_bias its
    # attention read): with `head_bias` pruned, it hands on the whole bias, computed where the first layer's attention
    # would (`surgery.relay_bias`), so a later layer reads its own heads' rows of it
    bias_relay: str | None = None
    # whether an attention alone can be removed: not where it returns what later layers read (T5's position bias)
    attention_alone: bool = True
    # how many values a block returns that its model unpacks (T5's 3: its hidden states, its position bias, the
    # cross-attention's); the rest of the families' 2 or fewer read as (hidden states, None)
    block_returns: int = 2
    # attention attributes holding the KV-head count (Phi-3 slices its fused q/k/v by it)
    kv_count_attrs: tuple[str, ...] = ()
    # the attention reads its query-head count from the config, which every layer shares (Phi-3 splits qkv_proj
    # at config.num_attention_heads): a resized attention gets a view of the config with its own count
    config_head_count: bool = False
    # the FFN's two input projections are one with two halves of output rows (Phi-3's gate_up_proj: [gate | up];
    # ModernBERT's Wi: [input | gate]): neuron n is row n of each half
    fused_up: bool = False
    # post-norm families: the LayerNorm right after each projection's residual add (its gamma scales
    # every output channel of the projection before anything else sees it)
    o_norm: str | None = None
    down_norm: str | None = None
    # each sub-layer's output is normed before the residual add (Gemma 2 and 3: post_attention_layernorm,
    # post_feedforward_layernorm): a removed sub-layer's constant update would be normed into a full-size vector
    # added to every token, so an attention or an FFN alone is not removed (whole layers are)
    normed_updates: bool = False
    # decoder-only language models: a checkpoint that does not name its class (no `architectures`, common
    # in converted checkpoints) is still loaded with its LM head
    causal: bool = False
    # the config key of the FFN width (a pruned model whose layers kept equal widths says it there)
    ffn_key: str = "intermediate_size"
    # config fields set beside a stated FFN width, so that the family builds that width as it stands (LFM2's
    # block_auto_adjust_ff_dim, which otherwise builds 2/3 of intermediate_size rounded to block_multiple_of)
    ffn_config: tuple[tuple[str, Any], ...] = ()
    # the config carries head_dim: the head count can change without changing the head size (otherwise
    # the head size is hidden / heads, and only an FFN-only pruning can be said in the config)
    config_head_dim: bool = False
    # the first layer is built unlike the others (ModernBERT's has no attention norm), so a checkpoint whose
    # first layer is another cannot be rebuilt from its config: that layer is never removed whole
    first_layer_fixed: bool = False
    # position ids start after the padding index (RoBERTa: pad_token_id + 1), so max_position_embeddings
    # holds that many positions fewer than a sequence may use
    positions_after_padding: bool = False
    # learned absolute positions read from `position_ids`, which the model counts from 0 whatever the padding
    # (GPT-2's wpe): the exports count them along the attention mask as generate() does, so a left-padded row is
    # its unpadded self (rotary positions are shift-invariant; OPT counts along the mask itself)
    positions_from_mask: bool = False
    # where the module holding a sub-layer's output projection also adds the residual (BERT's attention.output:
    # LayerNorm(dense(x) + input); OPT's FFN, inline in the block), the module computing that projection's input:
    # a removed sub-layer replaces it and the projection (`sublayers`); None: the projection's parent module
    # returns the sub-layer's update and is replaced whole
    attention_core: str | None = None
    ffn_core: str | None = None
    # blocks grouped in stages (Swin): `layers` is then the ModuleList of the stages, each holding its blocks at
    # `stage_blocks`; blocks are numbered through the stages (`layers()` lists them all, `block_path` names them)
    stage_blocks: str | None = None
    # a stage's module applied to its last block's output, called as the stage calls it: (hidden states, the
    # block's positional arguments) (Swin's patch merging: a quarter of the tokens, twice the width)
    stage_exit: str | None = None
    # what one stage's blocks see of the first stage's tokens (Swin: 1/4, its patch merging): the latency model's
    # share of each block
    stage_tokens: float = 1.0
    # the config key of an attention window's side (Swin: attention spans window x window tokens, not the image)
    window_key: str | None = None
    # parameters of the attention holding one entry per head on their last axis (Swin's relative-position bias table,
    # gpt-oss's sinks), kept with the heads
    head_columns: tuple[str, ...] = ()
    # per-head norms of the attention, kept with their heads where the block has them: a parameter with one row per
    # query head on its first axis (Command R+'s q_norm weight, (heads, head_dim)) or a ModuleList of one module per
    # head (StableLM 2's q_layernorm.norms); `kv_head_rows` the same per KV head (their k norms)
    head_rows: tuple[str, ...] = ()
    kv_head_rows: tuple[str, ...] = ()
    # the config key of a factor of every residual update divided by sqrt(num_hidden_layers) as a block is built
    # (MiniCPM3's scale_depth): restated when layers go, so that the kept blocks keep their scale once rebuilt
    depth_scale_key: str | None = None
    # whether a layer can be removed whole: no where the blocks differ by their place in a stage (Swin shifts
    # every other block's windows), which a model rebuilt from its config with fewer blocks would misplace
    whole_layers: bool = True
    # a removed sub-layer's stand-in returns its update at every token, not one row broadcast (Swin reshapes the
    # attention's output into windows)
    full_updates: bool = False
    # the attention implementation the ONNX export traces (Swin's SDPA path views a transposed output, which
    # torch.export cannot trace with a dynamic batch; eager computes the same)
    export_attention: str | None = None
    # whether the config can state pruned widths at all (Swin's lists them per stage, from embed_dim and
    # mlp_ratio): a pruned model always has `osscar_widths.json`
    config_widths: bool = True
    # a Mixture-of-Experts FFN (Mixtral, Qwen3-MoE): `down` names the layer's experts module
    # (`compressor.transformer.experts`), whose experts each keep neurons of their own, as many in each; the config key
    # of how many experts a token visits (what one neuron of every expert costs a token)
    experts_per_token_key: str | None = None
    # whether attention heads are a prunable unit: not where a norm spans all the heads' queries or keys together
    # (OLMo 2 and 3: q_norm / k_norm over heads x head_dim, so removing a head renormalises every kept one); then the
    # FFN neurons, whole layers and (where `normed_updates` allows) sub-layers are what a job removes
    heads_prunable: bool = True
    # the FFN module returns (output, router scores), which its block unpacks (gpt-oss): its stand-ins return a pair
    ffn_pair: bool = False
    # a dense FFN beside a MoE layer's routed experts that every token visits, its output scaled per token by a
    # sigmoid gate (Qwen2-MoE's mlp.shared_expert, mlp.shared_expert_gate): its down projection (its input rows are
    # its neurons, a second FFN unit of the layer), its input projections and the config key of its width
    shared_down: str | None = None
    shared_up: tuple[str, ...] = ()
    shared_key: str | None = None
    # whether the shared expert's output is scaled by its own sigmoid gate (Qwen2-MoE) or added as it is (GLM-4.5's
    # mlp.shared_experts, whose width n_shared_experts x moe_intermediate_size no config key states alone)
    shared_gated: bool = True
    # the shared expert's gate and up are one projection, [gate | up] (Granite 4.0-H's shared_mlp.input_linear)
    shared_fused_up: bool = False
    # whether an FFN alone can be removed: not where its shared expert lies outside the MoE block, beside it in the
    # layer (Granite 4.0-H's shared_mlp), which a stand-in of the block would leave computing
    ffn_alone: bool = True
    # a MoE family's layers whose FFN is dense (GLM-4.5's first first_k_dense_replace layers; Qwen2- / Qwen3-MoE's
    # mlp_only_layers, decoder_sparse_step): that FFN's input and output projections and the config key of its width
    # (`at` gives the record as it applies to such a block; `dense_ffn_layers` says which layers the config builds so)
    dense_up: tuple[str, ...] = ()
    dense_down: str | None = None
    dense_key: str = "intermediate_size"
    # a vision transformer that takes images of any size (DINOv2 interpolates its position embeddings, DINOv3's are
    # rotary): it is calibrated, costed and exported at its images' size (squares of whole patches), else at the size
    # its preprocessor crops to (224 for DINOv2, whose config.image_size says 518), not at config.image_size
    any_image_size: bool = False
    # linear layers of the base model reading one block of inputs per layer, layer after layer (ESM's contact head:
    # every layer's every head's attention map, layers x heads inputs): a removed layer's block of columns goes with it
    layer_columns: tuple[str, ...] = ()
    # ... whose outputs hold one block per layer (a Linear's rows, an Embedding's columns: Gemma 4's per-layer input
    # embeddings, packed layer after layer, and their projection from the embeddings)
    layer_outputs: tuple[str, ...] = ()
    # a block's scalar buffer that multiplies its whole output stream, residual included (Gemma 4's layer_scalar):
    # a removed block's scalar is folded into the next kept one, whose updates reach the stream through the norms of
    # `scaled_norms` (divided by it) and which reads the raw stream through the linears of `scaled_reads` (multiplied)
    # the layer kind (`layer_types`) the config makes the last layer whatever it states (Gemma 4's full_attention):
    # a removal must leave such a layer last
    last_layer_kind: str | None = None
    layer_scale: str | None = None
    scaled_norms: tuple[str, ...] = ()
    scaled_reads: tuple[str, ...] = ()
    # the embedding a base model serves where it is not its last hidden state (CLIP's and SigLIP's vision towers:
    # pooler_output, the [CLS] state after post_layernorm or SigLIP's attention-pooling head): the export's first output
    # (what the job scores), the last hidden state after it
    pooled_output: str | None = None
    # multi-head latent attention (DeepSeek-V3): keys and values are expanded per head from one shared latent (what
    # the KV cache holds, untouched by pruning heads) by `k` (= `v`, kv_b_proj: qk_nope_head_dim + v_head_dim rows a
    # head), queries by `q` (q_b_proj, or q_proj without a query latent: qk_nope_head_dim + qk_rope_head_dim rows a
    # head), and the output projection reads v_head_dim inputs a head (`dims`' head_dim); every head its own keys
    latent_attention: bool = False
    # q's output rows are each head's query then its output gate ([q_h | gate_h], 2 x head_dim rows a head: Qwen3.5's
    # attention, whose output is scaled by sigmoid(gate) before o_proj), kept and removed with the head
    gated_query: bool = False
    # the token mixer that some blocks are built with instead of the attention (Qwen3.5's Gated DeltaNet,
    # `linear_attn`: a causal conv and a gated delta rule whose state is a matrix a head, not a KV cache): never removed
    # alone, its units pruned where `linear_heads` (else kept whole), its FFN pruned as any other; `at` gives such a
    # block's record
    linear_attention: str | None = None
    # ... the `layer_types` entry of the blocks built with it (transformers' "linear_attention"; LFM2's "conv")
    linear_layer_type: str = LINEAR_LAYER
    # ... whether its units are prunable (`surgery.prune_mixer_units`): a Gated DeltaNet's key heads, each with the
    # value heads that read it; a gated short convolution's channels (LFM2's, each its own B, C and x rows, filter
    # and output column); a Mamba2 mixer's groups, or heads in one group (`surgery.ssd_unit_heads`); else it stays
    # whole
    linear_heads: bool = False
    # ... whether it carries a recurrent state from token to token beside its conv state (Gated DeltaNet's, a matrix a
    # value head; LFM2's short convolution carries its conv state alone): the decode step's states of such a layer
    linear_recurrent_state: bool = True
    # this record is a block's linear-attention mixer's (`at`): `o` its output projection, its units the mixer's
    # (`linear_heads`), no attention heads
    recurrent: bool = False
    # a Mamba2 mixer beside the attention in every block, reading the same normed input, its output added to the
    # attention's (Falcon-H1's `mamba`): kept whole, its conv and scan states carried by the decode step beside the
    # layer's keys and values; an attention alone is not removed (the layer's cache holds both)
    parallel_mixer: str | None = None

    @property
    def shared_gate(self) -> str | None:
        """The shared expert's gate (one output: the sigmoid's logit), beside the shared expert in the MoE block."""
        if self.shared_down is None or not self.shared_gated:
            return None
        expert = self.shared_down.rpartition(".")[0]  # mlp.shared_expert
        return f"{expert}_gate"

    def at(self, block: nn.Module) -> FamilyAdapter:
        """The record as it applies to `block`: a MoE family's block with a dense FFN (`dense_down`) reads that FFN's
        paths, width key and cost as a dense family's block does; a block built with a linear-attention mixer
        (`linear_attention`) reads that mixer as its attention, its units the mixer's own; every other block, this
        record. Told apart by the block's modules, so a block whose FFN was removed (`sublayers`) reads as a MoE one:
        ask before removing, or ask `dense_ffn_layers`."""
        record = self
        if self.dense_down is not None and has_module(block, self.dense_down):
            record = _dense_record(record)
        if self.linear_attention is not None and has_module(block, self.linear_attention):
            record = _recurrent_record(record)  # Qwen3-Next's: a block may have both
        return record

    @property
    def recurrent_mixers(self) -> bool:
        """Whether blocks mix tokens by a mixer whose state the decode step carries (`linear_attention` in some
        blocks, `parallel_mixer` in every one)."""
        return self.linear_attention is not None or self.parallel_mixer is not None

    @property
    def experts(self) -> bool:
        """Whether the FFN is a Mixture-of-Experts layer (`experts_per_token_key`)."""
        return self.experts_per_token_key is not None

    @property
    def up_matrices(self) -> int:
        """Weight matrices that produce the FFN's neurons (a fused gate/up projection counts twice)."""
        return len(self.up) + int(self.fused_up)


def has_module(block: nn.Module, path: str) -> bool:
    """Whether `block` has a module at `path` (an attribute set to None, as Gemma 4's missing v_proj, is none)."""
    return submodule(block, path) is not None


@functools.cache
def _recurrent_record(adapter: FamilyAdapter) -> FamilyAdapter:
    """`adapter` for its blocks with a linear-attention mixer (`FamilyAdapter.linear_attention`): the mixer's input
    and output projections in the attention's place, never removed alone; its units prunable where `linear_heads`
    (`surgery.prune_mixer_units`), else it stays whole."""
    mixer = adapter.linear_attention
    return replace(adapter, q=f"{mixer}.in_proj_qkv", k=f"{mixer}.in_proj_qkv", v=f"{mixer}.in_proj_qkv",
                   o=f"{mixer}.out_proj", heads_prunable=adapter.linear_heads, attention_alone=False,
                   gated_query=False, head_rows=(), kv_head_rows=(), recurrent=True)


@functools.cache
def _dense_record(adapter: FamilyAdapter) -> FamilyAdapter:
    """`adapter` for its blocks with a dense FFN: no experts, no shared expert."""
    return replace(adapter, up=adapter.dense_up, down=adapter.dense_down, ffn_key=adapter.dense_key,
                   experts_per_token_key=None, ffn_pair=False, shared_down=None, shared_up=(), shared_key=None,
                   dense_up=(), dense_down=None)


BERT_LIKE = FamilyAdapter(layers="encoder.layer", q="attention.self.query", k="attention.self.key",
                          v="attention.self.value", o="attention.output.dense", up=("intermediate.dense",),
                          down="output.dense", o_norm="attention.output.LayerNorm", down_norm="output.LayerNorm",
                          attention_core="attention.self", ffn_core="intermediate")
ROBERTA_LIKE = replace(BERT_LIKE, positions_after_padding=True)
VIT_LIKE = FamilyAdapter(layers="layers", q="attention.q_proj", k="attention.k_proj", v="attention.v_proj",
                         o="attention.o_proj", up=("mlp.fc1",), down="mlp.fc2")
# pre-norm OPT (do_layer_norm_before, every size but 350m); its reshapes use self.num_heads
OPT_LIKE = FamilyAdapter(layers="model.decoder.layers", q="self_attn.q_proj", k="self_attn.k_proj",
                         v="self_attn.v_proj", o="self_attn.out_proj", up=("fc1",), down="fc2",
                         head_count_attrs=("self_attn.num_heads",), causal=True, ffn_key="ffn_dim", ffn_core="fc1")
GPT2_LIKE = FamilyAdapter(layers="h", q="attn.c_attn", k="attn.c_attn", v="attn.c_attn", o="attn.c_proj",
                          up=("mlp.c_fc",), down="mlp.c_proj", fused_qkv=True,
                          head_count_attrs=("attn.num_heads",), width_attrs=("attn.split_size",), causal=True,
                          ffn_key="n_inner", positions_from_mask=True)
# GPT-J: separate q/k/v (reshaped with -1), the FFN beside the attention on one input norm
GPTJ = FamilyAdapter(layers="h", q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj",
                     up=("mlp.fc_in",), down="mlp.fc_out", causal=True, ffn_key="n_inner")
# GPT-BigCode (StarCoder, SantaCoder): GPT-2's blocks under multi-query attention, c_attn fused as [q | k | v] with one
# KV head's k and v; the attention splits it at embed_dim and repeats its KV head num_key_value_groups times
GPT_BIGCODE = replace(GPT2_LIKE, width_attrs=("attn.embed_dim",),
                      head_count_attrs=("attn.num_heads", "attn.num_key_value_groups"),
                      multi_query_key="multi_query", kv_count_attrs=("attn.kv_heads",))
# Falcon (the 7B layout: multi_query, rotary): query_key_value fused as [q | k | v] with one KV head's k and v, split by
# the attention's head count; the FFN beside the attention (parallel_attn) or after it, the attention's output added
# into the FFN's in place (so a removed FFN's stand-in returns its update at every token)
FALCON = FamilyAdapter(layers="h", q="self_attention.query_key_value", k="self_attention.query_key_value",
                       v="self_attention.query_key_value", o="self_attention.dense", up=("mlp.dense_h_to_4h",),
                       down="mlp.dense_4h_to_h", fused_qkv=True, multi_query_key="multi_query", causal=True,
                       head_count_attrs=("self_attention.num_heads", "self_attention.num_key_value_groups"),
                       ffn_key="ffn_hidden_size", full_updates=True)
# GPT-BigCode without multi-query attention (multi_query false): c_attn per head, [q_h | k_h | v_h], viewed by num_heads
GPT_BIGCODE_MHA = replace(GPT_BIGCODE, qkv_per_head=True, head_count_attrs=("attn.num_heads",))
# parallel or sequential residual alike (use_parallel_residual): the projections' inputs are what they are
GPT_NEOX = FamilyAdapter(layers="gpt_neox.layers", q="attention.query_key_value", k="attention.query_key_value",
                         v="attention.query_key_value", o="attention.dense", up=("mlp.dense_h_to_4h",),
                         down="mlp.dense_4h_to_h", fused_qkv=True, qkv_per_head=True, causal=True)
LLAMA_LIKE = FamilyAdapter(layers="model.layers", q="self_attn.q_proj", k="self_attn.k_proj",
                           v="self_attn.v_proj", o="self_attn.o_proj", up=("mlp.up_proj", "mlp.gate_proj"),
                           down="mlp.down_proj", kv_heads_key="num_key_value_heads", causal=True, config_head_dim=True)
# Gemma 2 and 3: Llama's names, a norm after each sub-layer as well as before it
GEMMA2_LIKE = replace(LLAMA_LIKE, normed_updates=True)
# OLMo 2 and 3: EXAONE 4's layout (a norm after each sub-layer, none before) with q/k norms over all heads together
OLMO2 = replace(GEMMA2_LIKE, heads_prunable=False)
# Mixture-of-Experts decoders: Llama's attention, a router (mlp.gate) and the experts as 3-D tensors (mlp.experts)
MOE_LIKE = replace(LLAMA_LIKE, up=(), down="mlp.experts", experts_per_token_key="num_experts_per_tok")
# the dense FFN of a MoE family's dense layers: Llama's MLP under `mlp`
DENSE_MLP = dict(dense_up=("mlp.up_proj", "mlp.gate_proj"), dense_down="mlp.down_proj")
# routed experts picked by grouped sigmoid routing beside ungated shared experts (mlp.shared_experts), dense FFN
# layers first (GLM-4.5's, dots.llm1's, EXAONE-MoE's)
GROUPED_MOE = replace(MOE_LIKE, ffn_key="moe_intermediate_size", shared_down="mlp.shared_experts.down_proj",
                      shared_up=("mlp.shared_experts.up_proj", "mlp.shared_experts.gate_proj"), shared_gated=False,
                      **DENSE_MLP)
# ... behind multi-head latent attention (DeepSeek-V3's)
LATENT_MOE = replace(GROUPED_MOE, q="self_attn.q_b_proj", k="self_attn.kv_b_proj", v="self_attn.kv_b_proj",
                     latent_attention=True, head_count_attrs=("self_attn.num_heads",))
# multi-head latent attention over Llama's MLP (MiniCPM3, Youtu-LLM)
LATENT = replace(LLAMA_LIKE, q="self_attn.q_b_proj", k="self_attn.kv_b_proj", v="self_attn.kv_b_proj",
                 latent_attention=True, head_count_attrs=("self_attn.num_heads",))
# Qwen2-MoE's FFNs: Qwen3-MoE's experts beside a shared expert that every token visits, scaled by its own sigmoid gate
QWEN2_MOE = replace(MOE_LIKE, ffn_key="moe_intermediate_size", shared_down="mlp.shared_expert.down_proj",
                    shared_up=("mlp.shared_expert.up_proj", "mlp.shared_expert.gate_proj"),
                    shared_key="shared_expert_intermediate_size")
# Qwen3.5 (its language model, qwen3_5_text): Gated DeltaNet mixers (linear_attn) in three of every four layers, Qwen3's
# attention with an output gate (q_proj: [q_h | gate_h] a head) in the fourth, Llama's MLP in every layer
QWEN3_5 = replace(LLAMA_LIKE, gated_query=True, linear_attention="linear_attn", linear_heads=True)
# LFM2 (Liquid AI): Llama's attention (out_proj, per-head q/k norms) in some layers, a gated short convolution in the
# others (`conv`: in_proj gives B, C and x, the output C * conv(B * x) through out_proj, its channels pruned as a unit,
# its conv state the decode step's), a SwiGLU FFN under feed_forward (w1 the gate, w3 up, w2 down) sized from
# intermediate_size by block_auto_adjust_ff_dim unless that is off
LFM2 = replace(LLAMA_LIKE, o="self_attn.out_proj", up=("feed_forward.w3", "feed_forward.w1"), down="feed_forward.w2",
               linear_attention="conv", linear_layer_type="conv", linear_recurrent_state=False, linear_heads=True,
               ffn_config=(("block_auto_adjust_ff_dim", False),))
# Granite 4.0-H (granitemoehybrid): Mamba2 mixers (`mamba`: in_proj gives the gate z, x, B, C and the time steps, a
# depthwise causal conv over x, B, C, the selective scan whose state is head_dim x ssm_state_size a head, a norm gated
# by z over each group of heads, out_proj) in most layers, Llama's attention in the others, and in every layer a SwiGLU
# FFN whose gate and up are one projection (shared_mlp.input_linear: [gate | up]); Granite's scalar multipliers
GRANITE_HYBRID = replace(LLAMA_LIKE, up=("shared_mlp.input_linear",), down="shared_mlp.output_linear", fused_up=True,
                         ffn_key="shared_intermediate_size", linear_attention="mamba", linear_heads=True)
# ... with Mixture-of-Experts layers (num_local_experts > 0: Granite 4.0-H-Tiny, -Small): routed experts
# (block_sparse_moe: Mixtral's softmax top-k routing and 3-D experts) beside the fused SwiGLU FFN, their shared expert
GRANITE_HYBRID_MOE = replace(GRANITE_HYBRID, up=(), down="block_sparse_moe.experts", fused_up=False,
                             ffn_key="intermediate_size", experts_per_token_key="num_experts_per_tok",
                             shared_down="shared_mlp.output_linear", shared_up=("shared_mlp.input_linear",),
                             shared_gated=False, shared_fused_up=True, shared_key="shared_intermediate_size",
                             ffn_alone=False)
# Granite 3.x MoE (granitemoe: granite-3.1-1b-a400m, -3b-a800m): Granite 4.0-H-Tiny's routed experts
# (block_sparse_moe) under Llama's attention in every layer; granitemoeshared (Granite 3.x MoE with a shared expert):
# Granite 4.0-H-Tiny's layers with their Mamba2 mixers replaced by attention
GRANITE_MOE_SHARED = replace(GRANITE_HYBRID_MOE, linear_attention=None, linear_heads=False)
GRANITE_MOE = replace(GRANITE_MOE_SHARED, shared_down=None, shared_up=(), shared_key=None, shared_fused_up=False,
                      ffn_alone=True)
# Bamba (IBM): Granite 4.0-H's Mamba2 mixers beside Llama's attention in the layers of attn_layer_indices, Llama's MLP
# under feed_forward
BAMBA = replace(LLAMA_LIKE, up=("feed_forward.up_proj", "feed_forward.gate_proj"), down="feed_forward.down_proj",
                linear_attention="mamba", linear_heads=True)
# Falcon-H1 (TII): in every layer a Mamba2 mixer (`mamba`, Granite 4.0-H's, kept whole) beside Llama's attention on the
# same normed input, their outputs summed, then a SwiGLU FFN under feed_forward; muP multipliers on each path's input
# and output (scalars, and one per in_proj section), which no pruned width changes
FALCON_H1 = replace(LLAMA_LIKE, up=("feed_forward.up_proj", "feed_forward.gate_proj"), down="feed_forward.down_proj",
                    parallel_mixer="mamba")
# Phi-3 and Phi-4 (model_type phi3): Llama's layout with q/k/v fused into qkv_proj and gate/up into gate_up_proj
PHI3 = replace(LLAMA_LIKE, q="self_attn.qkv_proj", k="self_attn.qkv_proj", v="self_attn.qkv_proj",
               up=("mlp.gate_up_proj",), fused_qkv=True, fused_up=True,
               kv_count_attrs=("self_attn.num_key_value_heads",), config_head_count=True)

# GLM and GLM-4: Llama's attention, gate and up fused in gate_up_proj as [gate | up]; GLM-4 norms each sub-layer's
# output as Gemma 2 does (post_self_attn_layernorm, post_mlp_layernorm)
GLM = replace(LLAMA_LIKE, up=("mlp.gate_up_proj",), fused_up=True)
# Command R / R+ and Command R7B / A (cohere, cohere2): Llama's modules beside a parallel FFN, R+'s q/k LayerNorms one
# row per head (use_qk_norm)
COHERE = replace(LLAMA_LIKE, head_rows=("self_attn.q_norm.weight",), kv_head_rows=("self_attn.k_norm.weight",))
# StableLM (2): Llama's modules, the head counts read from attributes (head_dim is hidden / heads: no config can state
# pruned heads), StableLM 2 12B's q/k LayerNorms one module per head
STABLELM = replace(LLAMA_LIKE, head_count_attrs=("self_attn.num_heads",),
                   kv_count_attrs=("self_attn.num_key_value_heads",), config_head_dim=False,
                   head_rows=("self_attn.q_layernorm.norms",), kv_head_rows=("self_attn.k_layernorm.norms",))
# Phi-1.5 / Phi-2 (phi): Llama's q/k/v, an output projection named dense, a GELU FFN fc1 -> fc2 beside the attention
PHI = replace(LLAMA_LIKE, o="self_attn.dense", up=("mlp.fc1",), down="mlp.fc2")
# one input projection, no gate: StarCoder2's GELU FFN (c_fc, c_proj, with biases); Nemotron's squared ReLU
STARCODER2 = replace(LLAMA_LIKE, up=("mlp.c_fc",), down="mlp.c_proj")
UNGATED = replace(LLAMA_LIKE, up=("mlp.up_proj",))

# pre-norm encoder: q/k/v fused in Wqkv as [q | k | v], the gated FFN's two projections in Wi; its global and
# sliding-window layers get different masks and rotary tables, which the pipeline captures per layer
MODERNBERT = FamilyAdapter(layers="layers", q="attn.Wqkv", k="attn.Wqkv", v="attn.Wqkv", o="attn.Wo",
                           up=("mlp.Wi",), down="mlp.Wo", fused_qkv=True, fused_up=True, first_layer_fixed=True)

# DeBERTa-v2 / v3: BERT's post-norm layout; disentangled attention projects the shared relative-position
# embeddings through q and k (share_att_key) or through per-head pos_query / pos_key projections
DEBERTA_V2 = replace(BERT_LIKE, q="attention.self.query_proj", k="attention.self.key_proj",
                     v="attention.self.value_proj",
                     per_head_outputs=("attention.self.pos_query_proj", "attention.self.pos_key_proj"),
                     head_count_attrs=("attention.self.num_attention_heads",),
                     width_attrs=("attention.self.all_head_size",))

# BERT's post-norm layout under other names; the relative attention bias (one per head, shared by the layers)
MPNET = FamilyAdapter(layers="encoder.layer", q="attention.attn.q", k="attention.attn.k", v="attention.attn.v",
                      o="attention.attn.o", up=("intermediate.dense",), down="output.dense",
                      o_norm="attention.LayerNorm", down_norm="output.LayerNorm",
                      head_count_attrs=("attention.attn.num_attention_heads",),
                      width_attrs=("attention.attn.all_head_size",), head_bias="attention.attn",
                      positions_after_padding=True, ffn_core="intermediate")

# post-norm like BERT, with its own names; its config says hidden_dim for the FFN width
DISTILBERT = FamilyAdapter(layers="transformer.layer", q="attention.q_lin", k="attention.k_lin", v="attention.v_lin",
                           o="attention.out_lin", up=("ffn.lin1",), down="ffn.lin2", o_norm="sa_layer_norm",
                           down_norm="output_layer_norm", ffn_key="hidden_dim")

# BERT's layout whose attention reshapes by its own head count and width (RoFormer: rotary positions computed once by
# the encoder, one table of head_dim for every head)
ROFORMER = replace(BERT_LIKE, head_count_attrs=("attention.self.num_attention_heads",),
                   width_attrs=("attention.self.all_head_size",))
# XLM-R XL / XXL: RoBERTa's modules, pre-norm (a LayerNorm before each sub-layer inside it, none after the residual add)
XLMR_XL = replace(ROBERTA_LIKE, o_norm=None, down_norm=None)
# ESM (ESM-2, ESM-1b: protein language models): the same pre-norm layout, rotary or absolute positions counted after the
# padding index; its contact head reads every layer's heads' attention maps (layers x heads inputs)
ESM = replace(XLMR_XL, layer_columns=("contact_head.regression",))
# Megatron-BERT: the same pre-norm layout, an attention reshaping by its own head count and width
MEGATRON_BERT = replace(ROFORMER, o_norm=None, down_norm=None)
# Jina Embeddings v3: XLM-R's post-norm blocks under Llama-like names (self_attn.*_proj, mlp.fc1 / fc2, the residual
# added in the block, then post_attention_layernorm / post_mlp_layernorm), rotary positions
JINA_V3 = replace(VIT_LIKE, q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                  o_norm="post_attention_layernorm", down_norm="post_mlp_layernorm")
# DINOv2 (with registers too): ViT's pre-norm blocks under encoder.layer, each update scaled per channel (layer_scale1
# / 2, outside the projections); its FFN width is hidden x mlp_ratio and its head size hidden / heads, so no config
# states pruned widths. DINOv3: the same under model.layer, rotary positions, an attention reshaping by its own count
DINOV2 = replace(VIT_LIKE, layers="encoder.layer", config_widths=False, any_image_size=True)
DINOV3 = replace(VIT_LIKE, layers="model.layer", up=("mlp.up_proj",), down="mlp.down_proj",
                 head_count_attrs=("attention.num_heads",), any_image_size=True)
# DINOv2 giant's SwiGLU FFN (use_swiglu_ffn) and DINOv3's gated one (use_gated_mlp, the H+ and 7B): Llama's MLP
DINOV2_SWIGLU = replace(DINOV2, up=("mlp.up_proj", "mlp.gate_proj"), down="mlp.down_proj")
DINOV3_GATED = replace(DINOV3, up=("mlp.up_proj", "mlp.gate_proj"))
# CLIP's and SigLIP's vision towers: pre-norm blocks under encoder.layers, attention output out_proj
CLIP_VISION = replace(VIT_LIKE, layers="encoder.layers", q="self_attn.q_proj", k="self_attn.k_proj",
                      v="self_attn.v_proj", o="self_attn.out_proj", pooled_output="pooler_output")

# T5's encoder (T5EncoderModel: Flux's and SD3's text encoder, sentence-T5; mT5's): pre-norm blocks of layer.0
# (attention) and layer.1 (the FFN, DenseReluDense), a head size of its own (d_kv); the first layer's attention
# computes a relative position bias of one row per head that every later layer reads as it is handed on
# (position_bias): a pruned layer reads its kept heads' rows and hands the whole bias on; the first layer never goes,
# nor an attention alone
T5 = FamilyAdapter(layers="encoder.block", q="layer.0.SelfAttention.q", k="layer.0.SelfAttention.k",
                   v="layer.0.SelfAttention.v", o="layer.0.SelfAttention.o", up=("layer.1.DenseReluDense.wi",),
                   down="layer.1.DenseReluDense.wo", ffn_key="d_ff", config_head_dim=True, first_layer_fixed=True,
                   head_bias="layer.0.SelfAttention", bias_relay="layer.0", attention_alone=False, block_returns=3)
# T5 v1.1's, Flan-T5's and T5-XXL's gated FFN (feed_forward_proj gated-gelu): wi_0 (through the activation) x wi_1
T5_GATED = replace(T5, up=("layer.1.DenseReluDense.wi_0", "layer.1.DenseReluDense.wi_1"))
# UMT5 (Wan's text encoder): every layer's attention its own relative position bias table, a column per head, kept
# with its heads; its attention reshapes by its own head count
UMT5 = replace(T5_GATED, head_bias=None, bias_relay=None, first_layer_fixed=False, attention_alone=True,
               block_returns=2, head_columns=("layer.0.SelfAttention.relative_attention_bias.weight",),
               head_count_attrs=("layer.0.SelfAttention.n_heads",), width_attrs=("layer.0.SelfAttention.inner_dim",))
UMT5_UNGATED = replace(UMT5, up=("layer.1.DenseReluDense.wi",))

# hierarchical vision transformer: blocks in stages (encoder.layers.S.blocks.B), patch merging between stages
# (half the grid, twice the width), windowed attention with a relative-position bias table of one column per head;
# transformers 5.x's attention reshapes with -1, so only the weights and the table change with the heads
SWIN = FamilyAdapter(layers="encoder.layers", stage_blocks="blocks", stage_exit="downsample", stage_tokens=0.25,
                     q="attention.q_proj", k="attention.k_proj", v="attention.v_proj", o="attention.o_proj",
                     up=("mlp.fc1",), down="mlp.fc2", heads_key="num_heads",
                     head_count_attrs=("attention.num_attention_heads",), window_key="window_size",
                     head_columns=("attention.relative_position_bias.relative_position_bias_table",),
                     whole_layers=False, full_updates=True, export_attention="eager", config_widths=False)

# Llama's module paths serve every family below: Qwen3 normalises q and k per head (q_norm / k_norm: one
# weight of head_dim shared by the heads, untouched by removing heads), Gemma 2 adds norms after each
# sub-layer, soft-capping and sliding windows, Gemma 3 per-head q/k norms and a rotary base per layer kind,
# none of which reads the pruned widths
ADAPTERS: dict[str, FamilyAdapter] = {
    "bert": BERT_LIKE,
    "roberta": ROBERTA_LIKE,
    "xlm-roberta": ROBERTA_LIKE,
    "distilbert": DISTILBERT,
    "deberta-v2": DEBERTA_V2,
    "mpnet": MPNET,
    "modernbert": MODERNBERT,
    # BERT's layout under other names: ELECTRA (its embeddings projected to the blocks' width first), ERNIE, RoFormer
    # (rotary positions), CamemBERT and Data2Vec-Text (RoBERTa's), XLM-R XL (pre-norm)
    "electra": BERT_LIKE,
    "ernie": BERT_LIKE,
    "roformer": ROFORMER,
    "camembert": ROBERTA_LIKE,
    "data2vec-text": ROBERTA_LIKE,
    "xlm-roberta-xl": XLMR_XL,
    "megatron-bert": MEGATRON_BERT,
    "esm": ESM,
    "jina_embeddings_v3": JINA_V3,
    "eurobert": replace(LLAMA_LIKE, causal=False),  # EuroBERT: Llama's layers, bidirectional
    "t5": T5,
    "mt5": T5,
    "umt5": UMT5,
    "vit": VIT_LIKE,
    "deit": VIT_LIKE,  # ViT's blocks; a distillation token beside [CLS]
    "dinov2": DINOV2,
    "dinov2_with_registers": DINOV2,  # register tokens beside [CLS]
    "dinov3_vit": DINOV3,
    "clip_vision_model": CLIP_VISION,
    "siglip_vision_model": CLIP_VISION,  # no [CLS]; an attention-pooling head after the blocks
    "swin": SWIN,
    "opt": OPT_LIKE,
    "gpt2": GPT2_LIKE,
    "gpt_neox": GPT_NEOX,
    "gptj": GPTJ,
    "gpt_bigcode": GPT_BIGCODE,
    "falcon": FALCON,
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,
    "qwen3_5_text": QWEN3_5,
    "lfm2": LFM2,
    # LFM2-MoE (LFM2-8B-A1B): LFM2's layers, the FFNs after the first num_dense_layers MoE layers under feed_forward
    # (3-D experts; a router, gate, picking by sigmoid scores plus the block's expert_bias, its weights renormalised
    # and scaled by routed_scaling_factor: `experts.BLOCK_BIASED_ROUTERS`); its dense FFNs sized by intermediate_size
    "lfm2_moe": replace(LFM2, up=(), down="feed_forward.experts", experts_per_token_key="num_experts_per_tok",
                        ffn_key="moe_intermediate_size", ffn_config=(), dense_up=("feed_forward.w3", "feed_forward.w1"),
                        dense_down="feed_forward.w2"),
    "gemma": LLAMA_LIKE,
    "gemma2": GEMMA2_LIKE,
    "gemma3_text": GEMMA2_LIKE,
    # Gemma 4's language model: Gemma 3's layout, global layers of their own head size and KV heads (per_layer_config;
    # with attention_k_eq_v their values are their keys: no v_proj), a scalar on each block's output stream, and
    # per-layer input embeddings (PLE) added to each block's stream through a gate and a projection of its own
    "gemma4_text": replace(GEMMA2_LIKE, layer_outputs=("embed_tokens_per_layer", "per_layer_model_projection"),
                           layer_scale="layer_scalar", scaled_reads=("per_layer_input_gate",),
                           last_layer_kind="full_attention",
                           scaled_norms=("post_attention_layernorm", "post_feedforward_layernorm",
                                         "post_per_layer_input_norm")),
    "phi3": PHI3,
    # Llama's layout under other names for what the pruned widths do not touch: SmolLM3 (rotary-free layers),
    # Granite (scalar multipliers of the embeddings, the attention, each residual update and the logits), OLMo
    # (LayerNorm without parameters, clipped q/k/v), Helium (no config states its pruned heads: o_proj is built
    # hidden x hidden), Ministral, ERNIE 4.5, Seed-OSS (q/k/v biases),
    # HunYuan (per-head q/k norms, as Qwen3's)
    "smollm3": LLAMA_LIKE,
    "granite": LLAMA_LIKE,
    "granitemoehybrid": GRANITE_HYBRID,
    "bamba": BAMBA,
    "granitemoe": GRANITE_MOE,
    "granitemoeshared": GRANITE_MOE_SHARED,
    "falcon_h1": FALCON_H1,
    "olmo": LLAMA_LIKE,
    "helium": replace(LLAMA_LIKE, config_head_dim=False),  # its o_proj is hidden x hidden whatever the heads
    "ministral": LLAMA_LIKE,
    "ernie4_5": LLAMA_LIKE,
    "seed_oss": LLAMA_LIKE,
    # checkpoints first served by remote code, now config classes of their own over transformers' Llama modeling
    "exaone": LLAMA_LIKE,  # EXAONE 3.0 / 3.5
    "internlm3": LLAMA_LIKE,
    "iquestcoder": LLAMA_LIKE,
    "hunyuan_v1_dense": LLAMA_LIKE,
    # EXAONE 4: no norm before a sub-layer, one after it (as Gemma 2's second), per-head q/k norms, sliding windows
    "exaone4": GEMMA2_LIKE,
    "olmo2": OLMO2,
    "olmo3": OLMO2,  # OLMo 2's layers with sliding-window ones between full-attention ones
    "glm": GLM,
    "glm4": replace(GLM, normed_updates=True),
    "starcoder2": STARCODER2,
    "nemotron": UNGATED,
    # Apertus's xIELU, Arcee (AFM)'s and Jais 2's squared ReLU: one FFN input projection, up_proj
    "apertus": UNGATED,
    "arcee": UNGATED,
    "jais2": UNGATED,
    "cohere": COHERE,
    "cohere2": COHERE,  # Command R's layers with sliding-window ones between full-attention ones
    "stablelm": STABLELM,
    "phi": PHI,
    "vaultgemma": LLAMA_LIKE,  # Gemma 2's layers without the norms after each sub-layer
    "ministral3": LLAMA_LIKE,
    "cwm": LLAMA_LIKE,  # Code World Model: Llama 3's layers, sliding-window ones between global ones
    # HyperCLOVA X SEED: Granite's multipliers on Llama's modules, a norm after each sub-layer too (use_post_norm)
    "hyperclovax": GEMMA2_LIKE,
    # MiniCPM3: DeepSeek-V3's latent attention over Llama's MLP, each residual update scaled by scale_depth /
    # sqrt(num_hidden_layers) (restated when layers go), scaled embeddings and logits; Youtu-LLM: the same attention
    "minicpm3": replace(LATENT, depth_scale_key="scale_depth"),
    "youtu": LATENT,
    "mixtral": MOE_LIKE,
    # gpt-oss: experts stored transposed with interleaved gate / up columns, biases and a clamped SwiGLU
    # (`experts.INTERLEAVED_EXPERTS`), a router with a bias (mlp.router), sliding-window layers between full ones, a
    # learned sink logit per head in every softmax (self_attn.sinks, kept with its head)
    "gpt_oss": replace(MOE_LIKE, ffn_pair=True, head_columns=("self_attn.sinks",)),
    # Phi-3.5-MoE: Mixtral's experts with q/k/v biases, LayerNorms and a router (mlp.router) that picks two experts by
    # the sparse mixer (`experts.sparse_mixer`), not by softmax and top-k
    "phimoe": MOE_LIKE,
    # OLMoE: OLMo's q/k norms over all the heads together (heads stay whole), a softmax router over 3-D experts
    "olmoe": replace(MOE_LIKE, heads_prunable=False),
    # FlexOLMo: OLMoE's experts in OLMo 2's layout (a norm after each sub-layer, none before)
    "flex_olmo": replace(MOE_LIKE, heads_prunable=False, normed_updates=True),
    "qwen3_moe": replace(MOE_LIKE, ffn_key="moe_intermediate_size", **DENSE_MLP),
    # Qwen2-MoE: Qwen3-MoE's experts (q/k/v biases, no q/k norms) beside a shared expert that every token visits,
    # scaled by its own sigmoid gate: its neurons are pruned as a unit of their own
    "qwen2_moe": replace(QWEN2_MOE, **DENSE_MLP),
    # Qwen3.5-MoE (its language model, qwen3_5_moe_text): Qwen3.5's Gated DeltaNet and gated-query attention layers,
    # each with Qwen2-MoE's routed experts beside a gated shared expert (renormalised top-k, no dense layers)
    "qwen3_5_moe_text": replace(QWEN2_MOE, gated_query=True, linear_attention="linear_attn", linear_heads=True),
    # Qwen3-Next: the same layers, its DeltaNet's projections fused (in_proj_qkvz, in_proj_ba), dense FFN layers by
    # mlp_only_layers / decoder_sparse_step, routing weights renormalised by its config (norm_topk_prob)
    "qwen3_next": replace(QWEN2_MOE, gated_query=True, linear_attention="linear_attn", linear_heads=True,
                          **DENSE_MLP),
    # GLM-4.5 / 4.6 (glm4_moe): dense FFNs in the first first_k_dense_replace layers, then routed experts chosen by
    # sigmoid scores within the best groups (`experts.routes_itself`) beside ungated shared experts; partial rotary.
    # dots.llm1 (dots1): the same layers with Qwen3's per-head q/k norms; EXAONE-MoE (exaone_moe): its dense layers
    # by mlp_layer_types, sliding-window layers
    "glm4_moe": GROUPED_MOE,
    "dots1": GROUPED_MOE,
    "exaone_moe": GROUPED_MOE,
    # DeepSeek-V3 (and Kimi K2, saved as deepseek_v3): GLM-4.5's FFNs behind multi-head latent attention; GLM-4.7-Flash
    # (glm4_moe_lite): the same, its dense layers by mlp_layer_types
    "deepseek_v3": LATENT_MOE,
    "mistral4": LATENT_MOE,  # Mistral Small 4: DeepSeek-V3's layout, its router softmax scores grouped by their top two
    "glm4_moe_lite": LATENT_MOE,
    # ERNIE 4.5 MoE (ernie4_5_moe): GLM-4.5's layers, routed by softmax scores plus a correction bias (its router's
    # moe_statics, `experts.routes_itself`), dense FFN layers outside the MoE range
    "ernie4_5_moe": GROUPED_MOE,
    # DeepSeek-V2 (and V2-Lite, DeepSeek-Coder-V2): the same layers, routed by softmax scores, greedily or within the
    # groups of the best single experts (topk_method), weights scaled and not renormalised
    "deepseek_v2": LATENT_MOE,
}

# configurations of a family that lay its modules out otherwise, each with a record of its own: (the config test, on
# config.json as a dict or a config object's fields, the record it takes)
VARIANTS: dict[str, tuple[Callable[[dict], bool], FamilyAdapter]] = {
    "dinov2": (lambda c: bool(c.get("use_swiglu_ffn")), DINOV2_SWIGLU),
    "dinov2_with_registers": (lambda c: bool(c.get("use_swiglu_ffn")), DINOV2_SWIGLU),
    "dinov3_vit": (lambda c: bool(c.get("use_gated_mlp")), DINOV3_GATED),
    "gpt_bigcode": (lambda c: not c.get("multi_query", True), GPT_BIGCODE_MHA),
    "granitemoehybrid": (lambda c: int(c.get("num_local_experts") or 0) > 0, GRANITE_HYBRID_MOE),
    # T5 v1.1, Flan-T5, T5-XXL, mT5: feed_forward_proj "gated-gelu"; UMT5 without it
    "t5": (lambda c: str(c.get("feed_forward_proj", "relu")).startswith("gated-"), T5_GATED),
    "mt5": (lambda c: str(c.get("feed_forward_proj", "gated-gelu")).startswith("gated-"), T5_GATED),
    "umt5": (lambda c: not str(c.get("feed_forward_proj", "gated-gelu")).startswith("gated-"), UMT5_UNGATED),
}


def family_record(model_type: str, config: dict) -> FamilyAdapter:
    """The record of a family of ADAPTERS for `config` (config.json as a dict, or `vars` of a config object): its
    variant's where the config lays the modules out otherwise (`VARIANTS`)."""
    test, variant = VARIANTS.get(model_type, (None, None))
    return variant if test is not None and test(config) else ADAPTERS[model_type]


VISION_FAMILIES = ("vit", "deit", "swin", "dinov2", "dinov2_with_registers", "dinov3_vit", "clip_vision_model",
                   "siglip_vision_model")  # the vision transformers of ADAPTERS (images in, patches as tokens)

# families that load but are refused, each with the unit or step that stops it (one line a user can act on)
REFUSED: dict[str, str] = {
    "gemma3": "Gemma 3 checkpoints with a vision tower are multimodal (images and text in one model); their "
              "language model alone, saved as a gemma3_text checkpoint (Gemma3ForCausalLM), is supported",
    "gemma4": "Gemma 4 checkpoints with vision and audio towers are multimodal; their language model alone is "
              "supported, saved as a gemma4_text checkpoint: m = Gemma4ForConditionalGeneration.from_pretrained(path); "
              "with torch.device('meta'): lm = Gemma4ForCausalLM(m.config.text_config); "
              "lm.model, lm.lm_head = m.model.language_model, m.lm_head; lm.save_pretrained(out)",
    "qwen3_5": "Qwen3.5 checkpoints with a vision tower are multimodal (images and text in one model); their "
               "language model alone is supported, saved as a qwen3_5_text checkpoint: "
               "Qwen3_5ForCausalLM.from_pretrained(path).save_pretrained(out)",
    "qwen3_5_moe": "Qwen3.5-MoE checkpoints with a vision tower are multimodal (images and text in one model); their "
                   "language model alone is supported, saved as a qwen3_5_moe_text checkpoint: "
                   "Qwen3_5MoeForCausalLM.from_pretrained(path).save_pretrained(out)",
    "lfm2_vl": "LFM2-VL checkpoints hold a vision tower beside the language model (images and text in one model); "
               "their language model alone is supported, saved as an lfm2 checkpoint: "
               "m = Lfm2VlForConditionalGeneration.from_pretrained(path); with torch.device('meta'): "
               "lm = Lfm2ForCausalLM(m.config.text_config); lm.model, lm.lm_head = m.model.language_model, m.lm_head; "
               "lm.save_pretrained(out)",
    **dict.fromkeys(("llama4", "llama4_text"),
                    "Llama 4's experts read their input scaled by the router's sigmoid score, which ONNX Runtime's "
                    "MoE operator (it scales the experts' outputs) does not compute; Llama 3 (llama) is supported"),
    "hunyuan_v1_moe": "HunYuan-MoE's router (a wg projection inside its gate, per-layer expert counts) and its shared "
                      "MLP (sized by the experts' own intermediate_size) are not supported yet; HunYuan dense "
                      "(hunyuan_v1_dense) is",
    **{name: f"{label} checkpoints hold a text tower and a vision tower; prune the vision tower alone, saved as "
                 f"{name}_vision_model: {tower}.from_pretrained(path).save_pretrained(out)"
       for name, label, tower in (("clip", "CLIP", "CLIPVisionModel"), ("siglip", "SigLIP", "SiglipVisionModel"))},
    "nemotron_h": "Nemotron-H's blocks each hold one sub-layer (a Mamba2 mixer, an attention, an MLP or a MoE layer, "
                  "layers_block_type), where every supported decoder's block holds a token mixer and an FFN; not "
                  "supported yet (the Mamba2 hybrids Granite 4.0-H, Bamba and Falcon-H1 are)",
    "jamba": "Jamba's Mamba (1) mixers scan token by token (a selective scan that no exported graph runs at any "
             "length yet); not supported yet (the Mamba2 hybrids Granite 4.0-H, Bamba and Falcon-H1 are)",
    **dict.fromkeys(("zamba", "zamba2"),
                    "Zamba's attention blocks are shared between layers (one set of weights, per-layer adapters), so "
                    "neither a head nor a layer is any one layer's to remove; not supported (the Mamba2 hybrids "
                    "Granite 4.0-H, Bamba and Falcon-H1 are)"),
    "convnextv2": "ConvNeXt V2's GRN layers scale each channel by its norm over the mean norm of all the block's "
                  "channels, so removing channels changes the kept ones; ConvNeXt (v1) is supported",
}

_RELATIVE_POSITIONS = (lambda c: c.get("position_embedding_type", "absolute") not in ("absolute", None),
                       "position_embedding_type relative_key / relative_key_query is not implemented by transformers "
                       "5, which loads such a checkpoint without its distance embeddings (another model); only "
                       "absolute position embeddings are supported")


# configurations of a supported family that are refused all the same: (the config.json test, why)
def _not_silu(config: dict) -> bool:
    return config.get("hidden_act", "silu") not in ("silu", "swish")  # transformers' two names of SiLU


_NOT_SWIGLU = (_not_silu, "Mixture-of-Experts experts are exported as ONNX Runtime's MoE operator, which computes "
                          "SwiGLU (hidden_act silu) experts only")

_QWEN_MOE = (lambda c: _not_silu(c) or not _experts_count(c.get),
             "Qwen2-MoE and Qwen3-MoE are supported with SwiGLU experts (hidden_act silu); with num_experts 0 every "
             "layer is a dense FFN: set model_type and architectures in its config.json to qwen2 / qwen3 to prune it "
             "as those")


def _grouping_error(c: dict) -> str | None:
    """Why a grouped-routing config (GLM-4.5, dots.llm1, EXAONE-MoE, DeepSeek-V2 / V3, Mistral 4) is refused, or
    None."""
    family = f"{c.get('model_type')} (grouped routing)"
    if _not_silu(c):
        return f"{family}: hidden_act {c.get('hidden_act')!r}; experts are exported as SwiGLU (hidden_act silu) only"
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 1)
    groups, chosen = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    k = int(c.get("num_experts_per_tok") or 1)
    # a sigmoid router (Mistral 4's softmax one too) scores a group by its best two experts; DeepSeek-V2's by its best
    least = 2
    if c.get("model_type") == "deepseek_v2":
        method = c.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            return f"{family}: topk_method {method!r}; DeepSeek-V2's greedy and group_limited_greedy are supported"
        if method == "greedy":
            groups, chosen = 1, 1
        elif not c.get("n_group") or not c.get("topk_group"):
            return f"{family}: group_limited_greedy routing without n_group and topk_group"
        least = 1
    if experts % groups or experts // groups < least:
        return (f"{family}: {experts} experts in n_group {groups}; the groups must be equal, of {least} expert"
                f"{'s' * (least > 1)} at least")
    if not 1 <= chosen <= groups:
        return f"{family}: topk_group {chosen} of n_group {groups} groups"
    if k > chosen * experts // groups:
        return (f"{family}: num_experts_per_tok {k} exceeds the {chosen * experts // groups} experts of the "
                f"topk_group {chosen} groups a token may visit")
    return None


_GROUPED = (lambda c: _grouping_error(c) is not None, _grouping_error)
_T5_ENCODERS = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}

# (the config.json test, why: a line, or a function of the config giving it)
REFUSED_CONFIGS: dict[str, tuple[Callable[[dict], bool], str | Callable[[dict], str | None]]] = {
    "mixtral": _NOT_SWIGLU,
    "olmoe": _NOT_SWIGLU,
    "flex_olmo": _NOT_SWIGLU,
    # transformers' sparse mixer picks two experts whatever num_experts_per_tok says
    "phimoe": (lambda c: _not_silu(c) or c.get("num_experts_per_tok", 2) != 2,
               "Phi-3.5-MoE is supported with SwiGLU experts (hidden_act silu) and two experts a token (its sparse "
               "mixer routing picks two)"),
    "qwen3_moe": _QWEN_MOE,
    "granitemoehybrid": (lambda c: int(c.get("num_local_experts") or 0) > 0 and _not_silu(c), _NOT_SWIGLU[1]),
    "granitemoe": _NOT_SWIGLU,
    "granitemoeshared": (lambda c: _not_silu(c) or not int(c.get("shared_intermediate_size") or 0),
                         lambda c: _NOT_SWIGLU[1] if _not_silu(c) else
                         "shared_intermediate_size 0 builds no shared expert: the model is Granite 3.x MoE, whose "
                         "checkpoint holds the same weights; set model_type granitemoe in its config.json"),
    "qwen2_moe": _QWEN_MOE,
    "gemma4_text": (lambda c: bool(int(c.get("num_kv_shared_layers") or 0)) or bool(c.get("enable_moe_block")),
                    "Gemma 4 is supported without layers that reuse earlier layers' keys and values "
                    "(num_kv_shared_layers 0) and without Mixture-of-Experts blocks beside its FFN (enable_moe_block "
                    "false); such layers are not pruned yet"),
    "qwen3_5_moe_text": (lambda c: _not_silu(c) or not _experts_count(c.get),
                         "Qwen3.5-MoE is supported with SwiGLU experts (hidden_act silu) and num_experts 1 or more"),
    "qwen3_next": _NOT_SWIGLU,  # without experts (num_experts 0) every layer is its dense FFN: pruned as such
    "glm4_moe": _GROUPED,
    "dots1": _GROUPED,
    "exaone_moe": _GROUPED,
    "deepseek_v3": _GROUPED,
    "mistral4": _GROUPED,
    "glm4_moe_lite": _GROUPED,
    "deepseek_v2": _GROUPED,
    "ernie4_5_moe": (lambda c: _not_silu(c) or int(c.get("moe_layer_interval") or 1) != 1
                     or not int(c.get("moe_num_shared_experts", 2) or 0),  # its config class's default: 2
                     "ERNIE 4.5 MoE is supported with SwiGLU experts (hidden_act silu), its MoE layers one run "
                     "(moe_layer_interval 1: a removed layer would leave a pattern the config cannot state) and "
                     "shared experts (moe_num_shared_experts 1 or more)"),
    "falcon": (lambda c: bool(c.get("new_decoder_architecture")) or not c.get("multi_query", True)
               or bool(c.get("alibi")),
               "Falcon is supported in Falcon-7B's layout (multi_query, rotary positions); the grouped q/k/v of "
               "new_decoder_architecture (Falcon-40B, 180B), per-head q/k/v without multi_query and ALiBi positions "
               "(Falcon-RW) are not yet (Falcon 3 is saved as llama, which is)"),
    **dict.fromkeys(("t5", "mt5", "umt5"), (
        lambda c: not any(str(a).endswith("EncoderModel") for a in c.get("architectures") or []),
        lambda c: f"{c.get('model_type')}: its encoder is supported (the text encoder of Flux, SD3 or Wan, "
                  f"sentence-T5), saved as one: {_T5_ENCODERS.get(c.get('model_type'), 'T5EncoderModel')}"
                  ".from_pretrained(path).save_pretrained(out); its decoder (generation) is not pruned")),
    "opt": (lambda c: c.get("do_layer_norm_before") is False,
            "post-norm OPT (do_layer_norm_before=False, e.g. opt-350m) is not supported"),
    "deberta-v2": (lambda c: (c.get("conv_kernel_size") or 0) > 0,
                   "DeBERTa-v2 with a convolution after its first layer (conv_kernel_size, the v2 xlarge / xxlarge "
                   "checkpoints) is not supported: the convolution sits between blocks, which are pruned one at a "
                   "time"),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra", "ernie", "camembert", "data2vec-text",
                     "xlm-roberta-xl", "megatron-bert"), _RELATIVE_POSITIONS),
    # transformers' MPNetEncoder computes its position bias with 32 buckets whatever the config says: another table
    # size does not run (an IndexError in the first forward)
    "mpnet": (lambda c: c.get("relative_attention_num_buckets", 32) != 32,
              "MPNet with relative_attention_num_buckets other than 32 does not run in transformers (its encoder "
              "buckets positions into 32 whatever the config says)"),
}


def dense_ffn_layers(config: Any) -> list[bool] | None:
    """Which layers a MoE family's config (object or config.json dict) builds with a dense FFN, per layer, or None
    where it builds every FFN alike: EXAONE-MoE's `mlp_layer_types` ("dense" / "sparse"); ERNIE 4.5's MoE range and
    interval; GLM-4.5's and dots.llm1's first `first_k_dense_replace`, LFM2-MoE's first `num_dense_layers`; Qwen2- /
    Qwen3-MoE's `mlp_only_layers` and every layer but each `decoder_sparse_step`-th."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    model_type, n = get("model_type"), int(get("num_hidden_layers") or 0)
    if model_type not in ADAPTERS or ADAPTERS[model_type].dense_down is None:
        return None
    if get("mlp_layer_types") is not None:
        return [t == "dense" for t in get("mlp_layer_types")]
    if get("moe_layer_interval") is not None:  # ERNIE 4.5: MoE from start to end (-1: the last), every interval-th
        start, end = _ernie_moe_range(get, n)
        return [not ((i + 1) % int(get("moe_layer_interval")) == 0 and start <= i <= end) for i in range(n)]
    for key in ("first_k_dense_replace", "num_dense_layers"):  # GLM-4.5's, LFM2-MoE's: the first k
        if get(key) is not None:
            return [i < int(get(key)) for i in range(n)]
    only, step = set(get("mlp_only_layers") or ()), int(get("decoder_sparse_step") or 1)
    experts = _experts_count(get)
    return [i in only or not experts or (i + 1) % step != 0 for i in range(n)]


def _ernie_moe_range(get: Callable[..., Any], n: int) -> tuple[int, int]:
    """ERNIE 4.5's first and last MoE layer (`moe_layer_start_index`, `moe_layer_end_index`; -1 the last layer, which
    its config class states once built but config.json keeps)."""
    start, end = get("moe_layer_start_index"), get("moe_layer_end_index")
    end = n - 1 if end is None or int(end) == -1 else int(end)
    return (1 if start is None else int(start)), end


def _experts_count(get: Callable[..., Any]) -> int:
    """A Qwen-MoE config's routed experts: `num_experts`, which config.json may hold as `num_local_experts` (the
    name transformers' attribute map stores it under)."""
    for key in ("num_experts", "num_local_experts"):
        if get(key) is not None:
            return int(get(key))
    return 1


def restate_dense_ffn_layers(config: Any, dense: Sequence[bool]) -> None:
    """Set the config's keys of which layers have a dense FFN to `dense` (per layer, e.g. the kept ones once layers
    are removed): EXAONE-MoE's `mlp_layer_types` (its first_k_dense_replace, which only fills a missing list, set to
    the leading dense layers), ERNIE 4.5's MoE range (one run), GLM-4.5's `first_k_dense_replace` and LFM2-MoE's
    `num_dense_layers` (a prefix), Qwen's `mlp_only_layers` (with decoder_sparse_step 1, which states any pattern)."""
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mlp_layer_types = ["dense" if d else "sparse" for d in dense]
        if getattr(config, "first_k_dense_replace", None) is not None:
            config.first_k_dense_replace = next((i for i, d in enumerate(dense) if not d), len(dense))
    elif getattr(config, "moe_layer_interval", None) is not None:  # ERNIE 4.5 (interval 1: `REFUSED_CONFIGS`)
        moe = [i for i, d in enumerate(dense) if not d]
        if moe != list(range(moe[0], moe[-1] + 1) if moe else []):
            raise ValueError(f"MoE layers {moe} are not one run of layers, which is all moe_layer_start_index and "
                             "moe_layer_end_index can state")
        # none left: a range past the last layer (not -1, which says the last one)
        config.moe_layer_start_index, config.moe_layer_end_index = (moe[0], moe[-1]) if moe else (len(dense),
                                                                                                 len(dense))
    elif (key := next((name for name in ("first_k_dense_replace", "num_dense_layers")
                       if getattr(config, name, None) is not None), None)) is not None:
        k = sum(dense)
        if list(dense) != [i < k for i in range(len(dense))]:
            raise ValueError(f"dense FFN layers {[i for i, d in enumerate(dense) if d]} are not the first ones, which "
                             f"is all {key} can state")
        setattr(config, key, k)
    elif hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = [i for i, d in enumerate(dense) if d]
        config.decoder_sparse_step = 1


@dataclass(frozen=True)
class TransformerDims:
    layers: int
    heads: int
    kv_heads: int  # == heads without grouped-query attention
    head_dim: int
    hidden: int  # the residual stream's width

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


def adapter_for(model: nn.Module) -> FamilyAdapter:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedArchitecture(f"unsupported transformer family {model_type!r}; supported: {sorted(ADAPTERS)}")
    adapter = family_record(model_type, vars(model.config))
    if model_type in REFUSED_CONFIGS:  # refused by the same rule as a config.json (its fields, not copied)
        # the model's own class, not the one its config names (T5EncoderModel.from_pretrained keeps a whole T5's
        # ["T5ForConditionalGeneration"])
        check_config({**vars(model.config), "model_type": model_type, "architectures": [type(model).__name__]},
                     type(model).__name__)
    if adapter.stage_blocks is not None:
        _check_stages(vars(model.config), type(model).__name__)
    return adapter


def _located(model: nn.Module) -> tuple[str, str]:
    """(the path of the module that holds the blocks as the family's record names them, the blocks' path in it). The
    record's path is the family's task models' (Qwen3ForCausalLM's model.layers); a task head may wrap the base model
    under another prefix ("esm" in EsmForMaskedLM), and the base model alone (Qwen3Model, what an embedding checkpoint
    such as Qwen3-Embedding saves) holds the path's end (layers)."""
    adapter = adapter_for(model)
    parts = adapter.layers.split(".")
    if hasattr(model, parts[0]):
        return "", adapter.layers
    for name, child in model.named_children():
        if hasattr(child, parts[0]):
            return name, adapter.layers
    for start in range(1, len(parts)):
        path = ".".join(parts[start:])
        if isinstance(submodule(model, path), nn.ModuleList):
            return "", path
    raise UnsupportedArchitecture(f"no {adapter.layers!r} in {type(model).__name__}")


def layers_path(model: nn.Module) -> str:
    """Full path of the blocks' ModuleList from the model (e.g. "model.layers", "transformer.h"); of the stages'
    where blocks are grouped in stages (`FamilyAdapter.stage_blocks`)."""
    base, path = _located(model)
    return f"{base}.{path}" if base else path


def base_path(model: nn.Module) -> str:
    """Path of the module that holds the family's blocks as its record names them ("" for the model itself; "esm" in
    EsmForMaskedLM): where the base model's other modules (`FamilyAdapter.layer_columns`) are."""
    return _located(model)[0]


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` in `model`, or None where there is none (or the attribute is None)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def block_lists(model: nn.Module) -> list[str]:
    """Paths of the ModuleLists that hold the blocks, in block order: one, or one per stage."""
    adapter, path = adapter_for(model), layers_path(model)
    if adapter.stage_blocks is None:
        return [path]
    return [f"{path}.{s}.{adapter.stage_blocks}" for s in range(len(model.get_submodule(path)))]


def layers(model: nn.Module) -> nn.ModuleList:
    """The blocks, numbered through the stages where they are grouped in stages (then a new list of the same
    modules: replacing an entry of it does not reach the model)."""
    paths = block_lists(model)
    if adapter_for(model).stage_blocks is None:
        return model.get_submodule(paths[0])
    return nn.ModuleList([block for path in paths for block in model.get_submodule(path)])


def _locate(model: nn.Module, index: int) -> tuple[int, str, int, int]:
    """Block `index` as (its stage, its list's path, its place in that list, the list's length)."""
    start = index
    for stage, path in enumerate(block_lists(model)):
        count = len(model.get_submodule(path))
        if 0 <= index < count:
            return stage, path, index, count
        index -= count
    raise IndexError(f"block index {start} is out of range ({len(layers(model))} blocks)")


def block_path(model: nn.Module, index: int) -> str:
    """Full path of block `index` ("model.layers.7"; Swin: "swin.encoder.layers.1.blocks.0")."""
    _, path, place, _ = _locate(model, index)
    return f"{path}.{place}"


def stage_of(model: nn.Module, index: int) -> tuple[int, bool]:
    """(the stage of block `index`, whether it is its stage's last block); (0, False) without stages."""
    if adapter_for(model).stage_blocks is None:
        return 0, False
    stage, _, place, count = _locate(model, index)
    return stage, place == count - 1


def stage_exit(model: nn.Module, index: int) -> nn.Module | None:
    """The module applied to block `index`'s output before the next block sees it (`FamilyAdapter.stage_exit`,
    after a stage's last block), or None."""
    adapter = adapter_for(model)
    stage, last = stage_of(model, index)
    if adapter.stage_exit is None or not last:
        return None
    return getattr(model.get_submodule(layers_path(model))[stage], adapter.stage_exit, None)


def dims(model: nn.Module, index: int | None = None) -> TransformerDims:
    """The model's sizes, from its config (the one place the size fields are read); with `index`, block `index`'s
    where the config states sizes per layer (transformers' `per_layer_config`: Gemma 4's global layers' head size
    and KV heads), else the config's own values. A family in stages (Swin) gives its first stage's heads and width
    (`block_hidden` per block); its head size is the same in every stage (`check_config`)."""
    config = model.config
    adapter = adapter_for(model)
    if getattr(config, "is_heterogeneous", False):
        # a layer's view holds its overrides; the global config refuses to read a per-layer field without one
        config = config.per_layer_config[index] if index is not None else _global_view(config)
    heads_value = getattr(config, adapter.heads_key)
    if adapter.stage_blocks is not None:
        heads = int(heads_value[0])
        hidden = int(config.embed_dim)
        return TransformerDims(sum(config.depths), heads, heads, hidden // heads, hidden)  # blocks of every stage
    heads = int(heads_value)
    kv_heads = kv_heads_of(adapter, lambda key: getattr(config, key, None), heads)
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    if adapter.latent_attention:  # each head's keys and values its own; the output projection's inputs a head
        kv_heads, head_dim = heads, int(config.v_head_dim)
    return TransformerDims(int(config.num_hidden_layers), heads, kv_heads, head_dim, hidden)


def _global_view(config: Any) -> Any:
    """A copy of a per-layer config (`per_layer_config`) reading its fields' global values."""
    import copy

    view = copy.copy(config)
    view.__dict__.pop("_heterogeneity_spec", None)
    return view


def kv_heads_of(adapter: FamilyAdapter, get: Callable[[str], Any], heads: int) -> int:
    """The KV heads of a config (`get`: a config field by name, None where it has none) of `heads` query heads."""
    if adapter.multi_query_key is not None and get(adapter.multi_query_key) in (None, True):
        return 1  # the families' config classes default to multi-query attention (a config.json may omit the flag)
    return int(get(adapter.kv_heads_key) or heads) if adapter.kv_heads_key else heads


def adapter_at(model: nn.Module, index: int) -> FamilyAdapter:
    """`adapter_for(model)` as it applies to block `index` (`FamilyAdapter.at`); the block is looked up only where the
    family has dense-FFN or linear-attention layers (`layers` builds a new list for a family in stages)."""
    adapter = adapter_for(model)
    if adapter.dense_down is None and adapter.linear_attention is None:
        return adapter
    return adapter.at(layers(model)[index])


def block_hidden(model: nn.Module, index: int) -> int:
    """The residual stream's width at block `index` (Swin's doubles with every stage)."""
    if adapter_for(model).stage_blocks is None:
        return dims(model).hidden
    return int(model.config.embed_dim) * 2 ** stage_of(model, index)[0]


def max_sequence(model: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings take (None: no limit in its config)."""
    config = model.config
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if not limit:
        return None
    if adapter_for(model).positions_after_padding:
        limit -= int(getattr(config, "pad_token_id", 0) or 0) + 1
    return limit


def check_config(config: dict, reference: str) -> None:
    """Refuse a Hugging Face config (config.json as a dict) that no pipeline here prunes, before anything is
    loaded: post-norm OPT, a quantized checkpoint, and a model_type that is neither a family of ADAPTERS nor an image
    model (a config with num_channels, pruned as a conv graph). Raises UnsupportedArchitecture naming `reference`."""
    model_type = config.get("model_type")
    if model_type in REFUSED:
        raise UnsupportedArchitecture(f"{reference}: {model_type!r} is not supported: {REFUSED[model_type]}")
    quantized = config.get("quantization_config")
    if quantized:  # packed integer or MXFP4 blocks (gpt-oss ships so): no rows and columns to remove, nor to refit
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "quantized"
        raise UnsupportedArchitecture(f"{reference}: its weights are quantized ({method}): pruning reads and refits "
                                      "float weights; dequantize the checkpoint (bf16, fp16 or fp32, saved with "
                                      "save_pretrained), prune that, and quantize the pruned model")
    if model_type in REFUSED_CONFIGS and REFUSED_CONFIGS[model_type][0](config):
        why = REFUSED_CONFIGS[model_type][1]
        raise UnsupportedArchitecture(f"{reference}: {why if isinstance(why, str) else why(config)}")
    if model_type not in ADAPTERS and "num_channels" not in config:
        raise UnsupportedArchitecture(f"{reference}: model_type {model_type!r} is neither a supported transformer "
                                      f"family ({', '.join(sorted(ADAPTERS))}) nor an image model")
    if model_type in ADAPTERS and ADAPTERS[model_type].stage_blocks is not None:
        _check_stages(config, reference)
    if dynamic := sorted(t for t in _rope_types(config) if "dynamic" in t):
        raise UnsupportedArchitecture(f"{reference}: rope_type {dynamic[0]!r} (dynamic NTK scaling) recomputes the "
                                      "rotary frequencies from each input's length in the forward pass, which "
                                      "torch.onnx.export cannot trace; a static rope_type (default, linear, yarn, "
                                      "llama3, longrope) is supported")
    if "num_channels" in config and model_type not in ADAPTERS and _vision_transformer(config):
        raise UnsupportedArchitecture(f"{reference}: {model_type!r} is a vision transformer that is not supported "
                                      f"(supported vision transformers: {', '.join(VISION_FAMILIES)}); it has no "
                                      "conv channels to prune")


def _rope_types(config: dict) -> set[str]:
    """The rotary scaling types a config names: transformers 5's `rope_parameters` or the older `rope_scaling`, one
    for the model or one per attention type (Gemma 3's {"full_attention": {...}, "sliding_attention": {...}})."""
    found: set[str] = set()
    for key in ("rope_parameters", "rope_scaling"):
        entries = [config.get(key)]
        if isinstance(entries[0], dict) and all(isinstance(v, dict) for v in entries[0].values()) and entries[0]:
            entries = list(entries[0].values())
        for entry in entries:
            if isinstance(entry, dict):
                found |= {str(entry[k]) for k in ("rope_type", "type") if entry.get(k) is not None}
    return found


def _vision_transformer(config: dict) -> bool:
    """An image model built of attention blocks (patch embeddings and heads), not of conv channels."""
    return "num_attention_heads" in config or "num_heads" in config


def _check_stages(config: dict, reference: str) -> None:
    """A Swin config whose head size changes between stages is refused: heads are pruned head_dim rows at a time,
    one size for the model."""
    embed, heads = config.get("embed_dim"), config.get("num_heads")
    if not isinstance(embed, int) or not isinstance(heads, list) or not heads:
        raise UnsupportedArchitecture(f"{reference}: a {config.get('model_type')!r} config needs embed_dim and a list "
                                      "of num_heads per stage")
    sizes = sorted({embed * 2 ** s / h for s, h in enumerate(heads)})
    if len(sizes) != 1 or not sizes[0].is_integer():
        raise UnsupportedArchitecture(f"{reference}: its head size differs between stages (embed_dim {embed}, "
                                      f"num_heads {heads}: {', '.join(f'{x:g}' for x in sizes)}); heads are pruned "
                                      "with one head size for the whole model")
