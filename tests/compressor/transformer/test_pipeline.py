"""Sequential, block-by-block head and FFN pruning of HF transformers."""

import copy

import pytest
import torch

from compressor.progress import SOLVE, WARNING
from compressor.solver.counting import OpCounter
from compressor.transformer import pipeline
from compressor.transformer.adapters import adapter_for, block_path, layers, stage_exit
from compressor.transformer.experts import aligned_width, is_experts
from compressor.transformer.pipeline import (
    InMemoryBlocks,
    _run,
    capture_block_inputs,
    prune_blocks,
    prune_transformer,
    resize_transformer,
)
from compressor.transformer.refine import RefineConfig
from compressor.transformer.sublayers import ATTENTION, FFN, remove_sublayer, removed_sublayers
from compressor.transformer.surgery import head_groups, in_features, kv_index, projection, query_heads, widths

from .transformer_models import MODELS, example_inputs, first_output


def batches(model, n=3):
    return [example_inputs(model, batch=3, length=12, seed=i) for i in range(n)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replayed_blocks_match_the_models_own_pass(name):
    """Each block replayed on the captured inputs gives the output it gives inside the model: the captured
    masks and rotary tables are each layer's own (ModernBERT's and Gemma 2's sliding-window layers get other
    ones than their global layers)."""
    model = MODELS[name]()
    data = batches(model, 2)
    streams = capture_block_inputs(model, data, torch.device("cpu"), torch.float32)
    outputs: list[torch.Tensor] = []
    hooks = [block.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                             else out)) for block in layers(model)]
    with torch.no_grad():
        for s, batch in zip(streams, data, strict=True):
            outputs.clear()
            expected = model(**batch, output_hidden_states=True).hidden_states
            torch.testing.assert_close(s.hidden, expected[0], rtol=1e-5, atol=1e-5)
            hidden = s.hidden
            for i, block in enumerate(layers(model)):
                s.layer = i
                hidden = _run(block, hidden, s, torch.device("cpu"))
                torch.testing.assert_close(hidden, outputs[i], rtol=1e-5, atol=1e-5)
                exit_ = stage_exit(model, i)  # Swin's patch merging after a stage's last block
                if exit_ is not None:
                    hidden = exit_(hidden, *s.args)
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_pruned_in_float32_and_stays_in_its_dtype(dtype):
    """Each block is upcast for its turn (statistics, solve, reconstruction in float32) and goes back in the
    model's dtype; so the result is the float32 pipeline's on the same weights, rounded once."""
    model = MODELS["llama"]().to(dtype)
    data = batches(model)
    pruned, reports = prune_transformer(model, data, 0.5)
    assert {p.dtype for p in pruned.parameters()} == {dtype}
    assert {p.dtype for p in model.parameters()} == {dtype}  # the dense model as it was
    expected, expected_reports = prune_transformer(copy.deepcopy(model).float(), data, 0.5)
    assert [r.width_after for r in reports] == [r.width_after for r in expected_reports]
    got, want = first_output(pruned).float(), first_output(expected)
    assert float((got - want).norm() / want.norm()) < 2e-2  # half precision's rounding, not a different model


@pytest.mark.parametrize("name,unit", [(name, "query-heads") for name in sorted(MODELS)]
                         + [("llama", "kv-groups"), ("qwen2", "kv-groups")])
def test_every_block_is_pruned_and_runs(name, unit):
    model = MODELS[name]()
    before = first_output(model)
    pruned, reports = prune_transformer(model, batches(model), 0.5, gqa=unit)
    adapter = adapter_for(model)
    shared = adapter.shared_down is not None  # Qwen2-MoE's shared expert: a second FFN unit, solved before the experts
    assert [r.kind for r in reports] == ["attention_heads", "ffn_neurons", *["ffn_neurons"] * shared] * len(
        layers(model))
    for i, layer in enumerate(layers(pruned)):
        if unit == "query-heads":
            assert query_heads(pruned, i) == query_heads(model, i) // 2
        else:
            assert head_groups(pruned, i) == head_groups(model, i) // 2
        down = projection(layers(model)[i], adapter.down)
        ffn = in_features(down)
        # a MoE layer's experts keep a multiple of experts.ALIGN neurons
        expected = aligned_width(ffn, ffn - round(0.5 * ffn)) if is_experts(down) else ffn - round(0.5 * ffn)
        assert in_features(projection(layer, adapter.down)) == expected
        if shared:
            neurons = in_features(projection(layers(model)[i], adapter.shared_down))
            assert in_features(projection(layer, adapter.shared_down)) == neurons - round(0.5 * neurons)
    assert first_output(pruned).shape == before.shape
    torch.testing.assert_close(first_output(model), before)  # the input model is left alone
    assert all(0 <= r.relative_error <= 1.5 for r in reports)


def test_nothing_pruned_keeps_the_outputs():
    model = MODELS["llama"]()
    pruned, reports = prune_transformer(model, batches(model), 0.0)
    assert all(r.width_after == r.width_before for r in reports)
    torch.testing.assert_close(first_output(pruned), first_output(model), rtol=1e-4, atol=1e-4)


def test_fewer_calibration_tokens_than_kept_inputs_are_reported_once(caplog):
    model = MODELS["llama"]()
    few = [example_inputs(model, batch=1, length=12)]  # 6 counted tokens (half padded); o_proj keeps 16 of 32
    with caplog.at_level("WARNING", logger=pipeline.__name__):
        prune_transformer(model, few, 0.5)
    flat = [r for r in caplog.records if "cannot rank supports" in r.getMessage()]
    assert len(flat) == 1 and "rank(H) <= 6" in flat[0].getMessage() and "keeps 16 inputs" in flat[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger=pipeline.__name__):
        prune_transformer(model, batches(model), 0.5)  # 3 x 3 x 12 tokens, 16 kept at most
    assert not [r for r in caplog.records if "cannot rank supports" in r.getMessage()]
    records = []  # a job's progress: the warning goes there (and on to its report) instead of the log
    prune_transformer(model, few, 0.5, progress=records.append)
    assert [r.message for r in records if r.stage == WARNING and "cannot rank supports" in r.message] == \
        [flat[0].getMessage()]
    solves = [r for r in records if r.stage == SOLVE]  # every projection's solve, where it is among the blocks
    assert [(r.index, r.total, r.kind) for r in solves[:2]] == [(1, 2, "attention_heads"), (1, 2, "ffn_neurons")]
    assert solves[0].numbers["width_after"] < solves[0].numbers["width_before"]


def test_float16_activations_prune_like_float32():
    model = MODELS["bert"]()
    full = prune_transformer(model, batches(model), 0.5)[1]
    half = prune_transformer(model, batches(model), 0.5, activation_dtype=torch.float16)[1]
    for a, b in zip(full, half, strict=True):
        assert a.relative_error == pytest.approx(b.relative_error, rel=0.05, abs=1e-3)


def test_osscar_beats_mp_plus_on_stories260k(shared_data):
    import numpy as np
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(shared_data / "stories260K")).eval()
    tok = np.load(shared_data / "stories260K" / "tinystories-valid-tokens.npz")
    ids, off = tok["ids"], tok["offsets"]
    cal = [{"input_ids": torch.from_numpy(ids[off[i]:off[i] + 64].astype(np.int64)).unsqueeze(0)}
           for i in range(24)]
    held = [torch.from_numpy(ids[off[i]:off[i + 1]][:256].astype(np.int64)).unsqueeze(0) for i in range(150, 170)]

    def nll(m):
        with torch.no_grad():
            return sum(float(m(input_ids=s, labels=s).loss) for s in held) / len(held)

    results = {method: nll(prune_transformer(model, cal, 0.25, method=method)[0]) for method in ("osscar", "mp+")}
    assert results["osscar"] < results["mp+"]
    assert nll(model) < results["osscar"]


def test_observations_carry_the_residual_stream_energy():
    model = MODELS["llama"]()
    seen = []
    prune_transformer(model, batches(model), 0.0, observe=seen.append)
    assert [o.kind for o in seen] == ["attention_heads", "ffn_neurons"] * 2
    for o in seen:
        assert o.stream_energy > 0 and o.energy > 0 and o.cost > 0
        assert o.H.shape[0] == o.G.shape[0] and o.H.shape[0] % o.group_size == 0
    assert seen[0].stream_energy == seen[1].stream_energy  # one block, one stream


def test_an_unknown_gqa_unit_is_refused():
    from compressor.errors import InputError

    model = MODELS["llama"]()
    with pytest.raises(InputError, match="gqa must be one of query-heads, kv-groups"):
        prune_transformer(model, batches(model), 0.5, gqa="heads")


@pytest.mark.parametrize("name,unit", [(name, "query-heads") for name in sorted(MODELS)]
                         + [("llama", "kv-groups")])
def test_a_resized_model_has_the_pruned_models_widths(name, unit):
    """Latency probes measure resize_transformer: the widths pruning to the same plan returns, a model
    that runs, and the input left alone."""
    model = MODELS[name]()
    before = first_output(model)
    pruned, reports = prune_transformer(model, batches(model), 0.5, gqa=unit)
    resized = resize_transformer(model, {r.name: r.width_after for r in reports}, gqa=unit)
    adapter = adapter_for(model)
    for i in range(len(layers(model))):
        assert query_heads(resized, i) == query_heads(pruned, i)
        down = [in_features(projection(layers(m)[i], adapter.down)) for m in (resized, pruned)]
        assert down[0] == down[1]
    assert first_output(resized).shape == before.shape
    torch.testing.assert_close(first_output(model), before)


def test_resized_query_heads_keep_the_most_kv_heads():
    """Probed widths keep query heads spread over the KV heads (the slowest case of a width), so a probe
    never measures a KV head emptied that a solve would keep: 8 query heads over 2 KV heads, 2 kept,
    read both KV heads."""
    model = MODELS["llama"]()
    prefix = "model.layers"
    adapter = adapter_for(model)
    plan = {f"{prefix}.{i}.{path}": width for i in range(2) for path, width in ((adapter.o, 2), (adapter.down, 8))}
    resized = resize_transformer(model, plan)
    for i in range(2):
        assert query_heads(resized, i) == 2 and kv_index(resized, i).tolist() == [0, 1]
        assert projection(layers(resized)[i], adapter.k).weight.shape[0] == 2 * 4  # two KV heads of head_dim 4


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_layer_loop_makes_no_host_synchronisation_per_batch(name, monkeypatch):
    """Statistics of every projection accumulate on the device: the host reads them once per layer, not
    once per calibration batch (padded batches included), so doubling the batches adds no synchronisation."""
    counts = []
    for n in (2, 4):
        model = MODELS[name]()
        data = batches(model, n)
        streams = capture_block_inputs(model, data, torch.device("cpu"), torch.float32)
        assert all(s.counted is not None for s in streams)  # example_inputs pads the first row
        monkeypatch.setattr(pipeline, "capture_block_inputs", lambda *args, streams=streams: streams)
        with OpCounter() as counter:
            prune_blocks(InMemoryBlocks(model), data, 0.5, method="mp+")
        counts.append((counter.syncs, dict(counter.sync_ops)))
    assert counts[0][0] == counts[1][0], counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_activations_move_through_pinned_memory_and_prune_like_on_the_cpu():
    """Block activations go to the CPU in asynchronous copies into pinned memory (and back from it), and the
    pruned model is the one the CPU gives."""
    model = MODELS["llama"]()
    data = batches(model)
    streams = capture_block_inputs(model, data, torch.device("cuda"), torch.float32)
    torch.cuda.synchronize()
    assert all(s.hidden.device.type == "cpu" and s.hidden.is_pinned() for s in streams)
    assert all(s.counted is None or s.counted.is_pinned() for s in streams)
    cpu = prune_blocks(InMemoryBlocks(copy.deepcopy(model)), data, 0.5, method="mp+", device="cpu")
    gpu = prune_blocks(InMemoryBlocks(copy.deepcopy(model)), data, 0.5, method="mp+", device="cuda")
    assert [r.kept for r in gpu] == [r.kept for r in cpu]
    for a, b in zip(gpu, cpu, strict=True):
        assert a.relative_error == pytest.approx(b.relative_error, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_a_skipped_layer_leaves_the_pruned_model_and_the_rest_are_solved_against_the_dense_stream(name):
    model = MODELS[name]()
    data = batches(model, 2)
    pruned, reports = prune_transformer(model, data, 0.25, skip=[0], refine=pipeline.RefineConfig(steps=0))
    assert len(layers(pruned)) == pruned.config.num_hidden_layers == 1 and len(layers(model)) == 2
    assert reports and all(r.name.startswith(f"{block_path(model, 1)}.") for r in reports)  # the dense numbering
    resized = resize_transformer(model, {r.name: r.width_after for r in reports}, skip=[0])
    assert len(layers(resized)) == 1
    assert first_output(resized).shape == first_output(pruned).shape == first_output(model).shape
    with pytest.raises(ValueError, match="in-memory models only"):
        prune_blocks(type("Streamed", (), {"model": model})(), data, 0.25, skip=[0])


def test_a_layer_that_cannot_be_removed_is_refused_before_any_solve():
    """ModernBERT's first layer is built unlike the others: named for removal (a hand-edited --widths-from report),
    it was refused only once every other block had been solved and fitted."""
    from compressor.errors import UnsupportedArchitecture

    model = MODELS["modernbert"]()
    events = []
    with pytest.raises(UnsupportedArchitecture, match="first layer is built unlike the others"):
        prune_transformer(model, batches(model, 2), 0.25, skip=[0], progress=events.append)
    assert events == []
    with pytest.raises(UnsupportedArchitecture, match="first layer is built unlike the others"):
        resize_transformer(model, {}, skip=[0])


def test_activations_beyond_float16_are_refused_naming_the_layer_and_the_fix():
    """A stream value beyond float16's 65,504 (a bf16 model's massive activation) stored in float16 between blocks
    became infinite, and the solve raised 'invalid layer problem: H contains NaN or Inf' with a traceback."""
    from compressor.errors import CalibrationError

    model = MODELS["llama"]()
    data = batches(model, 2)
    with torch.no_grad():
        model.model.embed_tokens.weight[data[0]["input_ids"][0, 0], 0] = 1e5
    with pytest.raises(CalibrationError, match=r"model\.layers\.0\.self_attn\.o_proj: .*overflow float16.*"
                       "--activation-dtype float32"):
        prune_transformer(copy.deepcopy(model), data, 0.25, activation_dtype=torch.float16,
                          refine=pipeline.RefineConfig(steps=0))
    pruned, _ = prune_transformer(model, data, 0.25, refine=pipeline.RefineConfig(steps=0))  # float32 holds it
    assert torch.isfinite(first_output(pruned)).all()


def test_removal_losses_are_a_layers_update_relative_to_the_stream_it_reads():
    """The width curves' denominator (the block's input stream), not the stream it writes: a layer whose update
    grows the stream (here 5x layer 0's output projections) would otherwise be priced cheaper than its widths."""
    model = MODELS["llama"]()
    adapter = adapter_for(model)
    with torch.no_grad():  # layer 1 writes nothing to the stream; layer 0 writes much more than it reads
        projection(layers(model)[1], adapter.o).weight.zero_()
        projection(layers(model)[1], adapter.down).weight.zero_()
        projection(layers(model)[0], adapter.o).weight.mul_(5)
        projection(layers(model)[0], adapter.down).weight.mul_(5)
    data = batches(model, 2)
    losses = [loss.layer for loss in pipeline.removal_losses(model, data)]
    assert len(losses) == 2 and losses[1] == pytest.approx(0.0, abs=1e-12) and losses[0] > 0
    update = read = written = 0.0  # layer 0 by hand, over the tokens that count (the attention mask's)
    for batch in data:
        with torch.no_grad():
            hidden = model(**batch, output_hidden_states=True).hidden_states
        mask = batch["attention_mask"].bool()
        update += float((hidden[1] - hidden[0])[mask].double().square().sum())
        read += float(hidden[0][mask].double().square().sum())
        written += float(hidden[1][mask].double().square().sum())
    assert written > 2 * read  # the two denominators differ here
    assert losses[0] == pytest.approx(update / read, rel=1e-4)


def _mean_output(model, index, path, data):
    """The mean output of a projection over the counted tokens of the calibration batches, by hand."""
    seen = []
    handle = projection(layers(model)[index], path).register_forward_hook(
        lambda _m, _i, out: seen.append(out.detach().clone()))  # Falcon's block adds into it in place
    total, count = 0, 0
    with torch.no_grad():
        for batch in data:
            model(**batch)
            rows = seen.pop()[batch["attention_mask"].bool()].double()
            total, count = total + rows.sum(0), count + rows.shape[0]
    handle.remove()
    return (total / count).float()


@pytest.mark.parametrize("kind", [ATTENTION, FFN])
def test_a_sublayers_removal_loss_is_what_its_mean_in_its_place_changes(kind):
    """The loss of removing layer 0's attention (or FFN) alone: the change of the block's output when that
    sub-layer adds its calibration mean instead, relative to the block's input (the widths'), by hand."""
    model = MODELS["llama"]()
    path = adapter_for(model).o if kind == ATTENTION else adapter_for(model).down
    data = batches(model, 2)
    losses = pipeline.removal_losses(model, data)
    assert all(loss.attention is not None and loss.ffn is not None for loss in losses)
    without = copy.deepcopy(model)
    remove_sublayer(without, 0, kind, _mean_output(model, 0, path, data))
    change = stream = 0.0
    for batch in data:
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            hidden = model(**batch, output_hidden_states=True).hidden_states
            dense = hidden[1][mask].double()
            cut = without(**batch, output_hidden_states=True).hidden_states[1][mask].double()
        change += float((dense - cut).square().sum())
        stream += float(hidden[0][mask].double().square().sum())
    got = losses[0].attention if kind == ATTENTION else losses[0].ffn
    assert 0 < got < losses[0].layer * 10 and got == pytest.approx(change / stream, rel=1e-4)


def test_sublayers_removed_while_pruning_get_their_mean_update_and_the_rest_is_solved():
    """Layer 0's attention and layer 1's FFN removed alone, the rest pruned: the stand-ins carry the dense
    stream's mean update (layer 1's over the dense stream after the dense layer 0), the other projections are
    narrowed, and the pruned model has resize_transformer's structure."""
    model = MODELS["llama"]()
    adapter = adapter_for(model)
    data = batches(model, 2)
    removed = [(0, ATTENTION), (1, FFN)]
    pruned, reports = prune_transformer(model, data, 0.5, sublayers=removed, refine=RefineConfig(steps=5))
    assert removed_sublayers(pruned) == removed
    assert [r.name for r in reports] == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    torch.testing.assert_close(layers(pruned)[0].self_attn.update, _mean_output(model, 0, adapter.o, data),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layers(pruned)[1].mlp.update, _mean_output(model, 1, adapter.down, data),
                               rtol=1e-4, atol=1e-6)
    assert widths(pruned) == widths(resize_transformer(model, 0.5, sublayers=removed))
    # a plan by name need not name the removed sub-layers (their curves left the allocation)
    plan = {r.name: r.width_after for r in reports}
    assert widths(resize_transformer(model, plan, sublayers=removed)) == widths(pruned)
    assert torch.isfinite(first_output(pruned)).all()
    with pytest.raises(ValueError, match="in-memory models only"):
        prune_blocks(type("Streamed", (), {"model": model})(), data, 0.25, sublayers=[(0, FFN)])


def test_a_removed_ffn_that_its_block_adds_into_in_place_gets_its_own_mean():
    """Falcon's parallel block adds the attention's output into the FFN's in place (mlp_output += attention_output):
    the mean update of a removed FFN is the FFN's own, not the FFN's plus the attention's."""
    from .transformer_models import LLAMA_SHAPED

    model = LLAMA_SHAPED["falcon"]()
    data = batches(model, 2)
    pruned, _ = prune_transformer(model, data, 0.25, sublayers=[(1, FFN)])
    expected = _mean_output(model, 1, adapter_for(model).down, data)
    torch.testing.assert_close(layers(pruned)[1].mlp.update, expected, rtol=1e-4, atol=1e-6)


def test_a_token_cap_weighs_the_solves_and_a_cap_no_token_reaches_changes_nothing():
    model = MODELS["llama"]().eval()
    batches = [example_inputs(model, batch=3, length=7, seed=s) for s in range(2)]
    sublayers = [(1, FFN)]  # its stand-in's mean is weighted too
    plain, _ = pipeline.prune_transformer(model, batches, 0.25, sublayers=sublayers)
    unreached, _ = pipeline.prune_transformer(model, batches, 0.25, sublayers=sublayers, token_cap=1e12)
    capped, _ = pipeline.prune_transformer(model, batches, 0.25, sublayers=sublayers, token_cap=1.0)
    inputs = example_inputs(model, seed=7)
    torch.testing.assert_close(first_output(unreached, inputs), first_output(plain, inputs))
    assert not torch.allclose(first_output(capped, inputs), first_output(plain, inputs))
    assert torch.isfinite(first_output(capped, inputs)).all()
    update = layers(capped)[1].mlp.update
    assert not torch.allclose(update, layers(plain)[1].mlp.update)


def _rows_problem():
    """Block 0 of a tiny Llama, its streams' targets the dense block's outputs, and a copy of the block to choose
    rows in: each output projection offered its dense weight and a halved one."""
    model = MODELS["llama"]().eval()
    streams = capture_block_inputs(model, [example_inputs(model, batch=5, length=12, seed=s) for s in range(4)],
                                   torch.device("cpu"), torch.float32)
    dense = layers(model)[0]
    with torch.no_grad():
        for s in streams:
            s.hidden = _run(dense, s.hidden, s, torch.device("cpu"))
    block = copy.deepcopy(dense)
    o, down = block.self_attn.o_proj, block.mlp.down_proj
    exact = {p: pipeline.dense_weight(p).clone() for p in (o, down)}
    return block, streams, o, down, exact


@pytest.mark.parametrize("good", [("refit", "dense"), ("dense", "refit"), ("dense", "dense")])
def test_the_combination_of_rows_with_the_lowest_held_out_block_error_is_installed(good):
    block, streams, o, down, exact = _rows_problem()
    choices = []
    for proj, which in zip((o, down), good, strict=True):
        right, wrong = (exact[proj], None), (0.5 * exact[proj], None)
        choices.append(pipeline._Rows(f"x.{which}", proj, *((right, wrong) if which == "refit" else (wrong, right))))
    picked = pipeline._choose_rows(block, choices, streams, RefineConfig(), torch.device("cpu"))
    assert picked == list(good)
    for proj in (o, down):  # the right weights are the ones left installed
        torch.testing.assert_close(pipeline.dense_weight(proj), exact[proj], rtol=0, atol=0)


def test_chosen_rows_are_the_solves_refit_or_the_dense_weights_kept_rows_and_are_reported():
    model = MODELS["llama"]().eval()
    data = [example_inputs(model, batch=5, length=12, seed=s) for s in range(4)]
    refit, plain = prune_transformer(model, data, 0.5, add_bias=True)
    chosen, reports = prune_transformer(model, data, 0.5, add_bias=True, choose_rows=True)
    assert [r.rows for r in plain] == [None] * len(plain)
    assert {r.rows for r in reports} <= {"refit", "dense"} and all(r.rows for r in reports)
    first = reports[0]  # block 0's attention: the same problem and support in both runs
    assert first.kept == plain[0].kept
    o = layers(chosen)[0].self_attn.o_proj
    if first.rows == "refit":
        torch.testing.assert_close(o.weight, layers(refit)[0].self_attn.o_proj.weight)
    else:
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        cols = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in first.kept])
        torch.testing.assert_close(o.weight, layers(model)[0].self_attn.o_proj.weight[:, cols])
    assert torch.isfinite(first_output(chosen)).all()
    # methods that keep the dense rows anyway have nothing to choose
    _, flap = prune_transformer(model, data, 0.5, method="flap", choose_rows=True)
    assert [r.rows for r in flap] == [None] * len(flap)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_family_chooses_its_rows_and_runs(name):
    """Fused projections, Conv1D (GPT-2), post-norm column scaling (BERT): each family's choice installs weights of
    its projections' own layout, and the pruned model runs."""
    model = MODELS[name]().eval()
    pruned, reports = prune_transformer(model, batches(model), 0.25, choose_rows=True)
    # a MoE layer's experts keep their refit rows (one solve per expert, no block-level choice)
    experts = {r.name for r in reports if r.name.endswith(f".{adapter_for(model).down}") and adapter_for(model).experts}
    assert reports and all(r.rows in ("refit", "dense") for r in reports if r.name not in experts)
    assert all(r.rows is None for r in reports if r.name in experts)
    assert torch.isfinite(first_output(pruned)).all()


def test_a_norm_weight_of_zero_leaves_finite_refit_weights():
    """A post-norm model weighs each output column's error by its gamma^2 and unscales the refit weights after: a
    gamma of exactly 0 gave 0 / 0 in that column."""
    from .transformer_models import tiny_bert

    model = tiny_bert()
    with torch.no_grad():
        for block in model.encoder.layer:
            block.output.LayerNorm.weight[0] = 0.0
            block.attention.output.LayerNorm.weight[1] = 0.0
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(3)]
    pruned, _ = prune_transformer(model, data, 0.5)
    assert all(torch.isfinite(p).all() for p in pruned.parameters())


def test_mp_plus_keeps_mps_support_on_a_post_norm_model():
    """The OSSCAR paper's MP+ is MP's support, refit: on BERT (a LayerNorm after each sub-layer, whose gamma weights
    the refit's error) mp+ ranked the gamma-scaled weight and kept other heads and neurons than mp."""
    model = MODELS["bert"]()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) * 3 + 0.05)
    data = batches(model)
    _, mp = prune_transformer(model, data, 0.5, method="mp")
    _, mp_plus = prune_transformer(model, data, 0.5, method="mp+")
    assert [r.kept for r in mp_plus] == [r.kept for r in mp]
