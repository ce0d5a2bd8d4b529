"""Linear attention's delta rule as the export computes it: the same as transformers' kernels, at any length."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from exporters.recurrent import (
    CHUNK,
    CHUNK_RULE,
    MASK,
    chunk_for,
    chunk_gated_delta_rule,
    has_chunked_scans,
    scanned_linear_attention,
    spanning_chunks,
    ssd_chunk_scan,
    stepped_scan,
    traced_chunk,
    unit_lower_inverse,
)

from ..compressor.transformer.transformer_models import tiny_granite_hybrid, tiny_qwen3_5


@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_the_neumann_product_inverts_a_unit_lower_triangular_matrix(n):
    # entries as a chunk's (beta k_i . k_j decayed, unit keys): the inverse's growth stays within float64's digits
    a = 0.3 * torch.randn(3, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).tril(-1)
    eye = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(unit_lower_inverse(a), torch.linalg.inv(eye + a))


def _inputs(length: int, state: bool, seed: int = 0) -> dict:
    """Delta-rule inputs as a Qwen3.5 layer makes them: 2 key heads of 8 over 4 value heads of 8, decays <= 0."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, length, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, length, 4, 8, generator=gen)
    g = -torch.rand(2, length, 4, generator=gen)
    beta = torch.rand(2, length, 4, generator=gen)
    initial = torch.randn(2, 4, 8, 8, generator=gen) if state else None
    return dict(query=q, key=k, value=v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("length, state, chunk", [(1, False, 64), (1, True, 64), (63, True, 64), (130, True, 64),
                                                  (130, False, 16)])
def test_the_scanned_rule_computes_transformers_chunked_and_token_by_token_rules(length, state, chunk):
    """Against transformers' chunked rule (a triangular solve per chunk, a Python loop over chunks) and its token by
    token recurrence, with and without a state to start from, across chunk boundaries and at another chunk size."""
    inputs = _inputs(length, state)
    out, final = chunk_gated_delta_rule(**inputs, chunk_size=chunk)
    for reference in (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule):
        expected, expected_final = reference(**inputs)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, expected_final, rtol=1e-4, atol=1e-4)


def test_the_scanned_rule_stays_exact_in_float32_on_a_run_of_near_identical_tokens():
    """A run of one token (a "=====" line, repeated digits) gives near-identical keys with beta near 1 and little
    decay: the chunk's inverse then has entries that a Neumann series' product form reached through partial sums of
    ~1e19 before they cancelled (float32: outputs 2e19 off); the recursive blocks stay within 1e-5."""
    gen = torch.Generator().manual_seed(0)
    length = 130
    key = torch.randn(1, 1, 2, 16, generator=gen).expand(1, length, 2, 16) + 0.01 * torch.randn(
        1, length, 2, 16, generator=gen)
    query, value = torch.randn(1, length, 2, 16, generator=gen), torch.randn(1, length, 4, 16, generator=gen)
    beta, g = torch.full((1, length, 4), 0.99), torch.zeros(1, length, 4)
    out, _ = chunk_gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True)
    expected, _ = qwen3_5.torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta,
                                                           use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_an_export_traces_more_than_one_chunk_within_the_models_length():
    """A prompt of one chunk would fix the graph's length to it: the example is repeated past a chunk where the
    model's positions allow, else the chunk shrinks to the largest power of two below the length."""
    assert [chunk_for(n) for n in (1, 2, 3, 32, 33, 65, 66, 4096)] == [1, 1, 2, 16, 32, 64, CHUNK, CHUNK]
    ids = torch.arange(20).reshape(2, 10)
    example, chunk = spanning_chunks({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None)
    assert example["input_ids"].shape == (2, CHUNK + 2) and chunk == CHUNK
    assert torch.equal(example["input_ids"][:, 10:20], ids)
    example, chunk = spanning_chunks({"input_ids": ids}, 32)
    assert example["input_ids"].shape == (2, 32) and chunk == 16


def test_the_export_patches_are_undone_after_the_block_even_on_error():
    """The export swaps a Gated DeltaNet's forward, the chunk rule and the mask builder of its modeling module for
    the traceable ones; all three come back, after an error too, and a model without such layers is left alone."""
    model = tiny_qwen3_5()
    cls = type(model.model.layers[0].linear_attn)
    originals = cls.forward, getattr(qwen3_5, CHUNK_RULE), getattr(qwen3_5, MASK)
    with pytest.raises(RuntimeError, match="inside"), scanned_linear_attention(model) as found:
        assert found and getattr(qwen3_5, CHUNK_RULE) is chunk_gated_delta_rule and cls.forward is not originals[0]
        raise RuntimeError("inside")
    assert (cls.forward, getattr(qwen3_5, CHUNK_RULE), getattr(qwen3_5, MASK)) == originals
    with scanned_linear_attention(torch.nn.Linear(2, 2)) as found:
        assert not found and getattr(qwen3_5, CHUNK_RULE) is originals[1]


@pytest.mark.parametrize("length, groups", [(1, 1), (21, 2), (70, 4)])
def test_the_ssd_scan_is_transformers_mamba2_scan_with_any_chunk(length, groups):
    """`ssd_chunk_scan` against transformers' own `mamba2_chunk_scan` (Granite 4.0-H's, chunks of 8): outputs and the
    final state, from a given state, on chunks of 8 (the same products: within rounding), 4, 64 and the decode step's,
    for a length shorter than a chunk and for several chunks, one group of heads or more."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite

    gen = torch.Generator().manual_seed(length)
    batch, heads, size, state = 2, 4, 16, 8
    x, dt = torch.randn(batch, length, heads, size, generator=gen), torch.randn(batch, length, heads, generator=gen)
    b, c = (torch.randn(batch, length, groups, state, generator=gen) for _ in range(2))
    a = -2 * torch.rand(heads, generator=gen)  # the decay's rate: A < 0
    d, bias = (torch.randn(heads, generator=gen) for _ in range(2))
    start = torch.randn(batch, heads, size, state, generator=gen)
    args = dict(chunk_size=8, D=d, dt_bias=bias, initial_states=start, dt_softplus=True, dt_limit=(0.0, 5.0),
                return_final_states=True)
    expected, final = granite.mamba2_chunk_scan(x, dt, a, b, c, **args)
    for chunk in (8, 4, 64):
        with traced_chunk(chunk):
            out, last = ssd_chunk_scan(x, dt, a, b, c, **args)
        assert out.dtype == torch.float32 and out.shape == (batch, length, heads, size)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last, final, rtol=1e-4, atol=1e-4)
    with stepped_scan():
        torch.testing.assert_close(ssd_chunk_scan(x, dt, a, b, c, **args)[0], expected, rtol=1e-4, atol=1e-4)


def test_a_half_model_read_in_float32_has_its_scans_replaced():
    """A bf16 checkpoint is exported through a float32 view (`precision.float32_view`) whose layers are parametrized
    subclasses defined by torch: its Gated DeltaNets and Mamba2 mixers are still found and their scans replaced."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite

    from compressor.precision import float32_view

    original = granite.mamba2_chunk_scan
    for build in (tiny_qwen3_5, tiny_granite_hybrid):
        with float32_view(build().to(torch.bfloat16)) as view, scanned_linear_attention(view) as found:
            assert has_chunked_scans(view) and found
            assert build is tiny_qwen3_5 or granite.mamba2_chunk_scan is ssd_chunk_scan
    assert granite.mamba2_chunk_scan is original
