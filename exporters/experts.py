"""ONNX Runtime's com.microsoft.MoE node for a Mixture-of-Experts layer (`compressor.transformer.experts`).

The dynamo exporter cannot trace transformers' experts loop (which experts a batch reaches is data), so the
export runs each sparse MoE block as one custom torch operator (`experts_as_operator`) and translates that
operator here into the MoE contrib node: router logits in; softmax, top-k and the renormalisation of the top-k
weights inside (a router without it, Qwen3-MoE's `norm_topk_prob` off, scales the node's output back; Phi-3.5-MoE's
sparse mixer is computed before the node, which then finds its two picks again, and so is a grouped sigmoid router's
choice, GLM-4.5's, by its own forward before the operator: `experts._as_operator`); SwiGLU
experts whose fc1 weights interleave gate and up rows (the CPU kernel takes only `swiglu_fusion=1`), fc2 the down
projections, with their biases and gpt-oss's clamped SwiGLU (`swiglu_limit`, alpha 1.702, beta 1) where the experts have
them. onnxscript ships no schema for the contrib op, so it is declared here with the inputs and attributes
the node uses.
"""

from __future__ import annotations

import functools
from typing import Any

# the contrib operator's inputs, in order ("optional": an input this export leaves empty)
_INPUTS = (("input", False), ("router_probs", False), ("fc1_experts_weights", False), ("fc1_experts_bias", True),
           ("fc2_experts_weights", False), ("fc2_experts_bias", True), ("fc3_experts_weights", True),
           ("fc3_experts_bias", True))
_ATTRIBUTES = (("k", "INT"), ("activation_type", "STRING"), ("swiglu_fusion", "INT"), ("activation_alpha", "FLOAT"),
               ("activation_beta", "FLOAT"), ("normalize_routing_weights", "INT"), ("swiglu_limit", "FLOAT"))


@functools.cache
def _moe_node() -> Any:
    """The com.microsoft.MoE operator as onnxscript calls it."""
    import onnxscript
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        "MoE", "com.microsoft", 1,
        inputs=[OpSchema.FormalParameter(name, "T", param_option=optional) if opt else
                OpSchema.FormalParameter(name, "T") for name, opt in _INPUTS],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(name, getattr(OpSchema.AttrType, kind), "") for name, kind in _ATTRIBUTES])
    return onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MoE", schema)


def _sparse_mixer(logits: Any, eps: float) -> tuple[Any, Any]:
    """Phi-3.5-MoE's routing (`experts.sparse_mixer`) in plain ops, which the MoE node's CPU kernel does not compute
    (it ignores use_sparse_mixer): the two picks as scores the node's own softmax and top-2 turn back into them, the
    log of each pick's weight there and -1e9 elsewhere, (tokens, experts); and the two weights' sum (tokens, 1),
    by which the node's renormalised output is scaled back."""
    from onnxscript import opset18 as op

    scores = op.Cast(logits, to=1)  # float32
    # -1e9 at every expert (an Expand, not scores x 0: an infinite logit would make it NaN)
    masked, chosen, total = scores, op.Expand(op.Constant(value_float=-1e9), op.Shape(scores)), None
    for _ in range(2):
        top = op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1)  # (tokens, 1)
        index = op.ArgMax(masked, axis=-1, keepdims=1)
        far = op.Greater(op.Div(op.Sub(top, scores), op.Max(op.Abs(scores), top)),
                         op.Constant(value_float=2 * eps))
        gates = op.Softmax(op.Where(far, op.Constant(value_float=float("-inf")), masked), axis=-1)
        weight = op.GatherElements(gates, index, axis=-1)  # (tokens, 1)
        chosen = op.ScatterElements(chosen, index, op.Log(weight), axis=-1)
        total = weight if total is None else op.Add(total, weight)
        never = op.Expand(op.Constant(value_float=float("-inf")), op.Shape(weight))
        masked = op.ScatterElements(masked, index, never, axis=-1)
    return chosen, total


def _translate(x: Any, logits: Any, gate_up: Any, down: Any, fc1_bias: Any, fc2_bias: Any, k: int, normalize: bool,
               mixer: bool, eps: float, alpha: float, beta: float, limit: float) -> Any:
    """osscar::moe_experts as one MoE node: [gate | up] rows of each expert interleaved as [g0, u0, g1, u1, ...], its
    biases too (gpt-oss); the SwiGLU's alpha, beta and clamp `limit` (0: none) as the node's attributes."""
    from onnxscript import opset18 as op

    experts = op.Shape(gate_up, start=0, end=1)
    rows = op.Shape(gate_up, start=1, end=2)  # 2 x width
    hidden = op.Shape(gate_up, start=2, end=3)
    width = op.Div(rows, op.Constant(value_ints=[2]))
    halves = op.Reshape(gate_up, op.Concat(experts, op.Constant(value_ints=[2]), width, hidden, axis=0))
    interleaved = op.Reshape(op.Transpose(halves, perm=[0, 2, 1, 3]), op.Concat(experts, rows, hidden, axis=0))
    if fc1_bias is not None:  # (experts, 2 x width) [gate | up] -> interleaved likewise
        bias_halves = op.Reshape(fc1_bias, op.Concat(experts, op.Constant(value_ints=[2]), width, axis=0))
        fc1_bias = op.Reshape(op.Transpose(bias_halves, perm=[0, 2, 1]), op.Concat(experts, rows, axis=0))
    # always said: ONNX Runtime's CUDA kernel takes a missing limit as 7 (gpt-oss's), its CPU kernel as none
    activation = dict(activation_type="swiglu", swiglu_fusion=1, activation_alpha=alpha, activation_beta=beta,
                      swiglu_limit=limit if limit > 0 else float("inf"))
    # the node always renormalises its top-k weights: ONNX Runtime 1.31 did whatever normalize_routing_weights said
    # (a Qwen3-MoE without norm_topk_prob: 6e-3 off); unrenormalised weights are the renormalised ones times their
    # sum, a factor per token
    if mixer:  # the picks and their weights computed here; the node's top-2 finds them again
        chosen, total = _sparse_mixer(logits, eps)
        out = _moe_node()(x, op.CastLike(chosen, logits), interleaved, fc1_bias, down, fc2_bias, k=2,
                          normalize_routing_weights=1, **activation)
        return op.Mul(out, op.CastLike(total, out))
    out = _moe_node()(x, logits, interleaved, fc1_bias, down, fc2_bias, k=k, normalize_routing_weights=1,
                      **activation)
    if normalize:
        return out
    top, _ = op.TopK(op.Softmax(logits, axis=-1), op.Constant(value_ints=[k]), axis=-1)  # (tokens, k)
    return op.Mul(out, op.ReduceSum(top, op.Constant(value_ints=[-1]), keepdims=1))


def translation_table() -> dict[Any, Any]:
    """The exporter's `custom_translation_table` entry of the experts operator (registering it on first use)."""
    from compressor.transformer.experts import moe_op

    return {moe_op().default: _translate}
