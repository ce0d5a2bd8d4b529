"""A graph run in pieces, one ONNX Runtime session at a time: the whole graph's outputs, each piece's weights only."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from onnx import TensorProto, helper

from exporters import pieces as cut
from exporters import runtime
from exporters.onnx import export_hf_onnx
from exporters.runtime import measure_latency, piece_budget, run_outputs
from tests.compressor.transformer.transformer_models import tiny_llama


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A tiny GQA Llama as the job exports it (rotary tables, a causal mask, a tied head)."""
    path = tmp_path_factory.mktemp("llama") / "model.onnx"
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    export_hf_onnx(tiny_llama(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path,
                   output_name="logits")
    return path


@pytest.fixture(scope="module")
def external(decoder):
    """The decoder with its weights in `model.onnx.data`, as an export of a large model keeps them."""
    path = decoder.parent / "external" / "model.onnx"
    path.parent.mkdir()
    onnx.save(onnx.load(decoder), path, save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    ids, short = rng.integers(0, 50, (2, 12)), rng.integers(0, 50, (1, 7))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return [{"input_ids": ids, "attention_mask": mask},
            {"input_ids": short, "attention_mask": np.ones_like(short)}]


def _leftovers(path) -> list[str]:
    return [p.name for p in path.parent.iterdir() if ".piece" in p.name]


def test_the_pieces_cover_the_graph_once_in_order_within_the_budget(decoder):
    model = cut.load_structure(decoder)
    sizes = {t.name: cut._tensor_bytes(t) for t in model.graph.initializer}
    budget = 3_000  # the tied 50 x 32 embedding (6,400 bytes) is over it: a piece of its own node
    plan = cut.plan_pieces(model, budget)
    assert len(plan) > 4 and plan[0].start == 0 and plan[-1].stop == len(model.graph.node)
    assert all(a.stop == b.start for a, b in itertools.pairwise(plan))
    for piece in plan:
        assert piece.weight_bytes <= budget or piece.stop - piece.start == 1, piece
    over = [p for p in plan if p.weight_bytes > budget]
    assert over and all(any(sizes.get(n, 0) > budget for n in model.graph.node[p.start].input) for p in over)
    # every value a piece reads is a graph input or handed on by an earlier piece and not yet dropped
    held = {v.name for v in model.graph.input}
    for piece in plan:
        assert set(piece.inputs) <= held, set(piece.inputs) - held
        held |= set(piece.outputs)
        held -= set(piece.done)
    assert "logits" in held


def test_outputs_in_pieces_are_the_whole_graphs(decoder):
    batches = _batches()
    whole = run_outputs(decoder, batches)
    pieced = run_outputs(decoder, batches, piece_bytes=3_000)
    # ONNX Runtime's optimiser fuses within a piece only: float32 rounding apart (6e-8 here), the same logits
    for a, b in zip(whole, pieced, strict=True):
        assert len(a) == len(b) == 1
        np.testing.assert_allclose(b[0], a[0], rtol=0, atol=1e-6)
    for (nll, n), (nll_whole, n_whole) in zip(run_outputs(decoder, batches, reduce="nll", piece_bytes=3_000),
                                              run_outputs(decoder, batches, reduce="nll"), strict=True):
        assert n == n_whole and nll == pytest.approx(nll_whole, rel=1e-6)
    assert run_outputs(decoder, [list(batches[1].values())], reduce="raw", piece_bytes=3_000)[0].shape == (1, 7, 50)
    assert run_outputs(decoder, [], piece_bytes=3_000) == run_outputs(decoder, []) == []  # no batch: no answer
    assert not _leftovers(decoder)


def test_a_piece_reads_its_weights_from_the_sources_external_file(tmp_path):
    rng = np.random.default_rng(0)
    weights = [onnx.numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{k}")
               for k in range(4)]  # raw bytes: what onnx moves to an external file
    nodes = [helper.make_node("MatMul", ["x" if k == 0 else f"h{k - 1}", f"w{k}"], [f"h{k}"]) for k in range(4)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
                              [helper.make_tensor_value_info("h3", TensorProto.FLOAT, [None, 64])], weights)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path, save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)
    model = cut.load_structure(path)
    plan = cut.plan_pieces(model, 2 * 64 * 64 * 4)
    assert [(p.start, p.stop) for p in plan] == [(0, 2), (2, 4)]
    x = rng.standard_normal((3, 64)).astype(np.float32)
    piece = cut.write_piece(model, plan[1], cut.piece_path(path, 1), {"h1": x})
    assert piece.stat().st_size < 2_000  # its two weights stay in model.onnx.data
    (got,) = run_outputs(piece, [{"h1": x}])[0]
    w = [onnx.numpy_helper.to_array(t, base_dir=str(tmp_path)) for t in onnx.load(path).graph.initializer]
    np.testing.assert_allclose(got, x @ w[2] @ w[3], rtol=1e-5, atol=1e-4)
    (whole,) = run_outputs(path, [{"x": x}])[0]
    (pieced,) = run_outputs(path, [{"x": x}], piece_bytes=64 * 64 * 4)[0]
    np.testing.assert_allclose(pieced, whole, rtol=1e-6, atol=1e-5)


def test_an_embedded_graphs_weights_go_to_one_temporary_file_its_pieces_read(tmp_path):
    """Pieces of a graph that embeds its weights embedded copies of them: the whole model held in the subprocess and
    written to disk again (363 MB against 233 MB whole for a 160 MB chain)."""
    rng = np.random.default_rng(0)
    weights = [onnx.numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{k}")
               for k in range(4)]
    nodes = [helper.make_node("MatMul", ["x" if k == 0 else f"h{k - 1}", f"w{k}"], [f"h{k}"]) for k in range(4)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
                              [helper.make_tensor_value_info("h3", TensorProto.FLOAT, [None, 64])], weights)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with cut.structure(path) as (model, source):
        assert source != path and source.parent == tmp_path and source.stat().st_size < 2_000
        assert all(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
        plan = cut.plan_pieces(model, 64 * 64 * 4)
        x = rng.standard_normal((3, 64)).astype(np.float32)
        piece = cut.write_piece(model, plan[1], cut.piece_path(source, 1), {"h0": x})
        assert piece.stat().st_size < 1_000  # w1 stays in the temporary file
        piece.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # the temporary file is gone
    (whole,) = run_outputs(path, [{"x": x}])[0]
    (pieced,) = run_outputs(path, [{"x": x}], piece_bytes=64 * 64 * 4)[0]
    np.testing.assert_allclose(pieced, whole, rtol=1e-6, atol=1e-5)
    latency = measure_latency(path, path, {"x": x}, threads=1, repeats=3, piece_bytes=2 * 64 * 64 * 4)
    assert latency.pieces == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_latency_in_pieces_times_piece_k_of_both_side_by_side(decoder, monkeypatch):
    """Each model's pieces timed in turns of their own read a graph against itself at 0.91-1.14x (SmolLM2-135M, a
    busy 2-core VM): piece k of both models is open at once and sampled alternately, two sessions at a time."""
    opened, alive = [], set()
    real = runtime._session

    class Tracked:
        def __init__(self, path, provider, threads):
            self.session, self.path = real(path, provider, threads), path
            opened.append(path)
            alive.add(path)
            assert len(alive) <= 2, alive  # piece k of each model, no more

        def run(self, *args):
            return self.session.run(*args)

        def __del__(self):
            alive.discard(self.path)

    monkeypatch.setattr(runtime, "_session", Tracked)
    n = len(cut.plan_pieces(cut.load_structure(decoder), 1_500))  # the pair shares the budget: half each
    base, comp, runs, counts = runtime._pieces_worker(str(decoder), str(decoder), _batches()[0], "cpu", 1, 1, 4,
                                                      False, None, 3_000)
    assert counts == [n, n] and len(opened) == 2 * n and runs >= 1
    assert [p.rsplit(".piece", 1)[1].split(".")[0] for p in opened[:4]] == ["0m0", "0m1", "1m0", "1m1"]
    assert len(base) == len(comp) == 4 and min(base + comp) > 0
    monkeypatch.setattr(runtime, "_session", real)
    latency = measure_latency(decoder, decoder, _batches()[0], threads=1, repeats=4, piece_bytes=3_000)
    assert latency.pieces == n and latency.in_turn is None
    assert "at most 1 KiB of weights per graph, two sessions at a time" in latency.in_pieces  # 3,000 B shared
    assert latency.repeats == 4 and 0.5 < latency.speedup < 2  # one graph against itself
    assert not _leftovers(decoder)


def test_a_session_the_host_cannot_hold_runs_in_pieces_and_says_why(decoder, external, monkeypatch, caplog):
    from compressor.transformer import offload

    assert piece_budget((external,)) == (None, None)  # this host holds a tiny graph whole
    whole = run_outputs(external, _batches(), reduce="nll")
    assert piece_budget((external,), "cuda") == (None, None)
    monkeypatch.setattr(offload, "available_memory", lambda: 256 << 20)  # the session's 0.5 GB floor alone is over
    budget, why = piece_budget((external,))
    assert budget == int(runtime.PIECE_SHARE * (256 << 20) / runtime.SESSION_BYTES_PER_FILE_BYTE)
    assert "would need ~0.5 GiB of the host's 0.2 GiB available" in why
    # a graph that embeds its weights holds them twice while it is cut: it stays whole
    assert piece_budget((decoder,)) == (None, None) and piece_budget((external, decoder)) == (None, None)
    latency = measure_latency(external, external, _batches()[0], threads=1, repeats=2)
    assert latency.pieces == 1  # the whole tiny graph is one piece; the pair shares the budget
    assert latency.in_pieces.endswith("available; at most 12 MiB of weights per graph, two sessions at a time")
    with caplog.at_level("INFO", logger="exporters.runtime"):
        got = run_outputs(external, _batches(), reduce="nll")
    assert [n for _, n in got] == [n for _, n in whole]
    assert [nll for nll, _ in got] == pytest.approx([nll for nll, _ in whole], rel=1e-6)
    assert "it runs in pieces" in caplog.text


def test_a_graph_out_of_order_is_refused_naming_what_it_reads():
    nodes = [helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("Relu", ["x"], ["a"], name="first")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    with pytest.raises(ValueError, match="second reads 'a'"):
        cut.plan_pieces(helper.make_model(graph), 1_000)
