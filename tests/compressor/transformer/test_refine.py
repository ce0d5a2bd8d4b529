"""Block reconstruction: held-out split, the fit and its keep-only-if-better rule, and its place in the pipeline."""

import copy
import dataclasses
import math

import pytest
import torch
from torch.nn.utils import parametrize

from compressor.errors import InputError
from compressor.transformer.adapters import layers
from compressor.transformer.pipeline import _fit_allowance, _run, capture_block_inputs, prune_transformer
from compressor.transformer.refine import (
    DEFAULT_STEPS,
    MAX_STEPS,
    MODEL_STEPS,
    BlockReconstruction,
    RefineConfig,
    Sequences,
    _cut,
    _next_token_kl,
    _squared_error,
    default_config,
    model_config,
    reconstruct_model,
    split,
)

from .transformer_models import MODELS, example_inputs, first_output

CPU = torch.device("cpu")


def batches(model, n=4, batch=5, length=12):
    return [example_inputs(model, batch=batch, length=length, seed=i) for i in range(n)]


def sequences(batch: int, tag: float) -> Sequences:
    x = torch.arange(batch, dtype=torch.float32).view(batch, 1, 1).expand(batch, 3, 2) + tag
    rotary = torch.randn(1, 3, 2)  # broadcast over the batch: kept whole
    mask4d = torch.arange(batch, dtype=torch.float32).view(batch, 1, 1, 1).expand(batch, 1, 3, 3)
    relative = torch.randn(batch, 2)  # relative-position embeddings (buckets x hidden): no sequence dimension
    return Sequences(x, x + 1, (), {"position_embeddings": (rotary, rotary), "attention_mask": mask4d,
                                    "cache_position": torch.arange(batch), "rel_embeddings": relative},
                     torch.ones(batch, 3, dtype=torch.bool))


def test_held_out_sequences_are_a_seeded_tenth_of_all_and_never_fitted():
    data = [sequences(16, 100.0 * i) for i in range(8)]  # 128 sequences, each tagged by its value
    fit, judge = split(data, 0.1, seed=0)
    tags = lambda parts: [float(v) for p in parts for v in p.x[:, 0, 0]]  # noqa: E731
    assert len(tags(judge)) == 13 and len(tags(fit)) == 115
    assert set(tags(fit)).isdisjoint(tags(judge))
    assert sorted(tags(fit) + tags(judge)) == sorted(tags(data))
    assert tags(split(data, 0.1, seed=0)[1]) == tags(judge)
    assert tags(split(data, 0.1, seed=1)[1]) != tags(judge)


def test_a_split_batch_slices_its_batched_context_and_keeps_broadcast_tensors():
    whole = sequences(6, 0.0)
    part = whole.select(torch.tensor([1, 4]))
    assert part.x[:, 0, 0].tolist() == [1.0, 4.0] and part.target[:, 0, 0].tolist() == [2.0, 5.0]
    assert part.kwargs["attention_mask"][:, 0, 0, 0].tolist() == [1.0, 4.0]
    assert part.kwargs["position_embeddings"][0] is whole.kwargs["position_embeddings"][0]
    assert part.kwargs["cache_position"] is whole.kwargs["cache_position"]  # 1-D: positions, not sequences
    assert part.kwargs["rel_embeddings"] is whole.kwargs["rel_embeddings"]  # as many buckets as sequences: kept
    assert part.mask.shape == (2, 3)


def test_one_sequence_has_nothing_to_fit():
    fit, judge = split([sequences(1, 0.0)], 0.1, seed=0)
    assert fit == [] and len(judge) == 1


def _block_problem(steps: int, lr: float = 0.05):
    """Block 0 of a tiny Llama with its MLP perturbed, to be fitted back to the dense block's outputs."""
    model = MODELS["llama"]()
    streams = capture_block_inputs(model, batches(model), CPU, torch.float32)
    dense = layers(model)[0]
    block = copy.deepcopy(dense)
    with torch.no_grad():
        block.mlp.down_proj.weight.mul_(0.5)
        targets = [_run(dense, s.hidden, s, CPU) for s in streams]
    data = [Sequences(s.hidden, t, s.args, s.kwargs, s.mask) for s, t in zip(streams, targets, strict=True)]
    fit, judge = split(data, 0.25, seed=0)
    return block, fit, judge, RefineConfig(steps=steps, lr=lr)


def run(block, seqs):
    return _run(block, seqs.x, seqs, CPU)


def test_a_token_cap_weighs_a_massive_tokens_error_as_at_most_cap_median_tokens():
    target = torch.ones(2, 4, 3)
    target[0, 0] = 100.0  # a token of massive activation: 10,000x the others' squared norm
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = False  # padding: neither counted nor weighed
    out = target.clone()
    out[0, 0] += 1.0  # an error of 3 on the massive token
    out[1, 1] += 1.0  # and of 3 on an ordinary one
    batch = Sequences(torch.zeros(2, 4, 3), target, (), {}, mask)
    error, energy = _squared_error(out, batch)
    assert float(error) == pytest.approx(6.0) and float(energy) == pytest.approx(30_000 + 6 * 3)
    error, energy = _squared_error(out, batch, token_cap=1.0)
    w = 3.0 / 30_000  # the massive token weighs one median token (squared norm 3)
    assert float(error) == pytest.approx(3.0 + 3.0 * w) and float(energy) == pytest.approx(3.0 + 6 * 3)
    with pytest.raises(AssertionError, match="token cap"):
        RefineConfig(steps=1, token_cap=0.0)


def test_a_capped_fit_lowers_its_held_out_error_too():
    block, fit, judge, config = _block_problem(steps=60)
    capped = dataclasses.replace(config, token_cap=1.0)
    result = BlockReconstruction(block, capped).fit(fit, judge, run)
    assert result.kept and result.after < 0.5 * result.before


def test_the_fit_lowers_the_held_out_error_and_only_touches_the_block_weights():
    block, fit, judge, config = _block_problem(steps=60)
    norm = block.input_layernorm.weight.detach().clone()
    result = BlockReconstruction(block, config).fit(fit, judge, run)
    assert result.kept and result.steps == 60
    assert result.after < 0.5 * result.before
    assert result.after == pytest.approx(BlockReconstruction(block, config).error(judge, run), rel=1e-5)
    torch.testing.assert_close(block.input_layernorm.weight, norm, rtol=0, atol=0)  # norms frozen by default
    assert all(p.requires_grad for p in block.parameters())  # as it found them
    assert all(p.grad is None for p in block.parameters())


def test_a_fit_with_an_allowance_stops_at_its_first_check_past_it_with_the_best_weights():
    """A time budget's allowance (`seconds`) ends the fit at the held-out check after it runs out: fewer steps
    than asked, a multiple of the check interval, the best weights kept; an allowance of 0 fits nothing."""
    block, fit, judge, _ = _block_problem(steps=100_000)
    result = BlockReconstruction(block, RefineConfig(steps=100_000, seconds=0.3)).fit(fit, judge, run)
    assert 0 < result.steps < 100_000 and result.steps % 10 == 0 and result.seconds < 10
    assert result.kept and result.after < result.before
    assert result.after == pytest.approx(BlockReconstruction(block, RefineConfig()).error(judge, run), rel=1e-5)
    block, fit, judge, _ = _block_problem(steps=5)
    nothing = BlockReconstruction(block, RefineConfig(steps=50, seconds=0.0)).fit(fit, judge, run)
    assert nothing.steps == 0 and not nothing.kept and nothing.after == nothing.before


def test_a_pipelines_allowance_is_shared_by_its_blocks():
    """prune_transformer's fits share `seconds`: with 0 none runs a step; with time to spare every block runs
    its steps."""
    model = MODELS["llama"]()
    data = batches(model)
    _, starved = prune_transformer(model, data, 0.5, refine=RefineConfig(steps=10, seconds=0.0))
    _, ample = prune_transformer(model, data, 0.5, refine=RefineConfig(steps=10, seconds=600.0))
    assert [r.refine.steps for r in starved[1::2]] == [0, 0]
    assert [r.refine.steps for r in ample[1::2]] == [10, 10]


def test_blocks_removed_whole_leave_their_share_of_the_allowance_to_the_fitted_ones(monkeypatch):
    """With block 1 removed, block 0 is the only one fitted and gets all of `seconds` (it got half)."""
    from compressor.transformer import pipeline

    model = MODELS["llama"]()
    assert len(model.model.layers) == 2
    given: list[float | None] = []
    fit = pipeline._refine

    def recording(block, streams, share, device):
        given.append(share.seconds)
        return fit(block, streams, share, device)

    monkeypatch.setattr(pipeline, "_refine", recording)
    prune_transformer(model, batches(model), 0.5, refine=RefineConfig(steps=5, seconds=60.0), skip={1})
    assert given == [60.0]


def test_a_floor_of_steps_runs_whatever_the_allowance_says():
    """`min_steps` run even when `seconds` ran out at the first check; past them the allowance binds again."""
    block, fit, judge, _ = _block_problem(steps=100_000)
    floored = BlockReconstruction(block, RefineConfig(steps=100_000, seconds=1e-9, min_steps=30)).fit(fit, judge, run)
    assert floored.steps == 30


def test_the_per_solve_allowance_follows_each_blocks_solves_and_yields_to_a_time_budget():
    """`_fit_allowance`: per_solve x the block's solve seconds, floored at min_steps; a time budget's share
    that is tighter binds instead, without the floor (the budget is not overrun for it)."""
    rule = RefineConfig(steps=500, min_steps=50, per_solve=1.0)
    assert _fit_allowance(rule, 4.0, 0.0, 3) == dataclasses.replace(rule, seconds=4.0)
    assert _fit_allowance(dataclasses.replace(rule, per_solve=2.0), 4.0, 0.0, 3).seconds == 8.0
    paced = _fit_allowance(dataclasses.replace(rule, seconds=6.0), 4.0, 3.0, 3)  # (6 - 3) / 3 = 1 s < 4 s
    assert paced.seconds == pytest.approx(1.0) and paced.min_steps == 0 and paced.budgeted  # stops at once
    roomy = _fit_allowance(dataclasses.replace(rule, seconds=600.0), 4.0, 0.0, 3)
    assert roomy.seconds == 4.0 and roomy.min_steps == 50 and not roomy.budgeted  # runs on to its next check
    assert _fit_allowance(RefineConfig(steps=50, seconds=6.0), 4.0, 0.0, 3).budgeted
    fixed = RefineConfig(steps=50)  # a user's --refine-steps: steps alone
    assert _fit_allowance(fixed, 4.0, 0.0, 3) == fixed


def test_a_jobs_default_fit_follows_the_solves_and_a_given_count_is_fixed():
    default = default_config(None)
    assert default.per_solve == 1.0 and default.min_steps == DEFAULT_STEPS and default.steps == MAX_STEPS
    assert default_config(120) == RefineConfig(steps=120)
    model = MODELS["llama"]()
    _, fits = prune_transformer(model, batches(model), 0.5, refine=default)
    steps = [r.refine.steps for r in fits[1::2]]
    assert all(DEFAULT_STEPS <= n <= MAX_STEPS for n in steps), steps


def test_trainable_norms_move_with_the_weights():
    block, fit, judge, _ = _block_problem(steps=20)
    norm = block.input_layernorm.weight.detach().clone()
    result = BlockReconstruction(block, RefineConfig(steps=20, norms=True)).fit(fit, judge, run)
    assert result.kept and not torch.equal(block.input_layernorm.weight, norm)


def test_a_fit_that_does_not_help_on_held_out_data_is_discarded():
    block, fit, judge, _ = _block_problem(steps=5)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    result = BlockReconstruction(block, RefineConfig(steps=5, lr=50.0)).fit(fit, judge, run)  # diverges
    assert not result.kept and result.after >= result.before
    for name, value in block.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_a_block_with_nothing_to_fix_is_not_fitted():
    """A block left whole on a stream still equal to the dense one reproduces the dense output exactly:
    no steps are spent on it."""
    block, fit, judge, _ = _block_problem(steps=5)
    with torch.no_grad():
        block.mlp.down_proj.weight.mul_(2.0)  # undo the perturbation: the dense block again
    result = BlockReconstruction(block, RefineConfig(steps=50)).fit(fit, judge, run)
    assert result.before == 0.0 and result.steps == 0 and not result.kept


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_pipeline_reports_each_blocks_fit(name):
    """Every family's blocks are fitted after their solves (GPT-2's Conv1D projections, fused and per-head
    projections alike): the fit keeps the solved widths and is kept only where it lowered the held-out error."""
    model = MODELS[name]()
    data = batches(model)
    _, plain_reports = prune_transformer(model, data, 0.5)
    refined, reports = prune_transformer(model, data, 0.5, refine=RefineConfig(steps=10))
    assert [r.width_after for r in reports] == [r.width_after for r in plain_reports]
    fits = [r.refine for r in reports]
    per_block = len(reports) // len(layers(model))  # a Qwen2-MoE block reports its shared expert's solve too
    last = [f for i, f in enumerate(fits) if i % per_block == per_block - 1]
    assert [f for i, f in enumerate(fits) if i % per_block != per_block - 1] == [None] * (len(fits) - len(last))
    assert all(f is not None and f.steps == 10 and f.kept == (f.after < f.before) for f in last)  # the block's last
    assert all(r.refine is None for r in plain_reports)
    assert first_output(refined).isfinite().all()


def test_refined_stories260k_predicts_held_out_stories_better(shared_data):
    import numpy as np
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(shared_data / "stories260K")).eval()
    tok = np.load(shared_data / "stories260K" / "tinystories-valid-tokens.npz")
    ids, off = tok["ids"], tok["offsets"]
    cal = [{"input_ids": torch.stack([torch.from_numpy(ids[off[i]:off[i] + 64].astype(np.int64))
                                      for i in range(b, b + 8)])} for b in range(0, 48, 8)]
    held = [torch.from_numpy(ids[off[i]:off[i + 1]][:256].astype(np.int64)).unsqueeze(0) for i in range(150, 170)]

    def nll(m):
        with torch.no_grad():
            return sum(float(m(input_ids=s, labels=s).loss) for s in held) / len(held)

    plain = nll(prune_transformer(model, cal, 0.5)[0])
    refined, reports = prune_transformer(model, cal, 0.5, refine=RefineConfig(steps=30))
    assert all(r.refine.kept for r in reports[1::2])
    assert nll(refined) < plain - 0.1  # nats per token


def test_refining_magnitude_pruning_is_refused():
    model = MODELS["llama"]()
    with pytest.raises(InputError, match="does not apply to method 'mp'"):
        prune_transformer(model, batches(model), 0.5, method="mp", refine=RefineConfig(steps=10))


def _fitted_names(model) -> set[str]:
    """The parameters a whole-model fit may move: the blocks' projections' weights and biases, MoE experts'."""
    from compressor.transformer.adapters import layers_path
    from compressor.transformer.experts import is_experts
    from compressor.transformer.surgery import is_projection

    root = layers_path(model)
    fitted = [(name, m) for name, m in model.named_modules()
              if name.startswith(root) and (is_projection(m) or is_experts(m))]
    return {f"{name}.{p}" for name, m in fitted for p, _ in m.named_parameters(recurse=False)}


@pytest.mark.parametrize("name", ["bert", "llama", "gpt2", "vit", "qwen3_moe"])
def test_the_whole_model_fit_brings_the_last_hidden_states_back_toward_the_dense_ones(name):
    """After the block solves, a fit of every block's projections at once lowers the held-out error of the last
    hidden states (an encoder's output, a decoder's before its LM head; GPT-2's Conv1D too; a MoE layer's experts
    too, not its router), keeps the widths, and leaves the embeddings, norms and heads as they were."""
    model = MODELS[name]()
    data = batches(model, n=6, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    before = {k: v.clone() for k, v in pruned.state_dict().items()}
    trainable = [p.requires_grad for p in pruned.parameters()]
    fit = reconstruct_model(pruned, model, data, RefineConfig(steps=60, lr=0.01), CPU)
    assert fit.kept and fit.steps == 60 and fit.after < 0.97 * fit.before  # seeded: 4-50 % lower
    moved = {k for k, v in pruned.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and moved <= _fitted_names(pruned)
    if name == "qwen3_moe":  # the experts were left out of the whole-model fit before
        assert {k for k in moved if k.endswith(("experts.down_proj", "experts.gate_up_proj"))}
    assert {k: v.shape for k, v in pruned.state_dict().items()} == {k: v.shape for k, v in before.items()}
    assert [p.requires_grad for p in pruned.parameters()] == trainable  # as it found them
    assert all(p.grad is None for p in pruned.parameters())


def test_a_whole_model_fit_that_does_not_help_on_held_out_windows_is_discarded():
    model = MODELS["bert"]()
    data = batches(model, n=4, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    before = {k: v.clone() for k, v in pruned.state_dict().items()}
    fit = reconstruct_model(pruned, model, data, RefineConfig(steps=10, lr=50.0, check_every=5), CPU)  # diverges
    assert not fit.kept and fit.after == fit.before
    for name, value in pruned.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_whole_model_fit_of_the_next_token_distributions_lowers_their_kl(name):
    """target="logits": every block's projections fitted at once to the dense model's next-token distributions;
    the held-out KL falls, only projections move, and the dense model is left as it was, where it was."""
    model = MODELS[name]()
    data = batches(model, n=6, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    before, dense = {k: v.clone() for k, v in pruned.state_dict().items()}, copy.deepcopy(model.state_dict())
    fit = reconstruct_model(pruned, model, data, RefineConfig(steps=60, lr=0.01), CPU, target="logits")
    assert fit.kept and fit.steps == 60 and fit.after < 0.97 * fit.before
    moved = {k for k, v in pruned.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and moved <= _fitted_names(pruned)
    assert all(torch.equal(v, dense[k]) for k, v in model.state_dict().items())
    assert next(model.parameters()).device == CPU and all(p.grad is None for p in pruned.parameters())


def test_the_whole_model_fit_moves_the_norms_only_when_asked():
    """`RefineConfig.norms`: the blocks' norms and the final one join the fitted projections; by default they stay."""
    model = MODELS["llama"]()
    data = batches(model, n=6, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    norms = {k for k in pruned.state_dict() if "norm" in k}
    for asked in (False, True):
        fitted, before = copy.deepcopy(pruned), copy.deepcopy(pruned.state_dict())
        fit = reconstruct_model(fitted, model, data, RefineConfig(steps=30, lr=0.01, norms=asked), CPU,
                                target="logits")
        moved = {k for k, v in fitted.state_dict().items() if not torch.equal(v, before[k])}
        assert fit.kept and moved - norms and moved <= _fitted_names(fitted) | norms
        assert (moved & norms == norms) if asked else not moved & norms  # the final norm's included


def test_the_whole_model_fit_leaves_the_embeddings_norm_as_it_was(monkeypatch):
    """With `norms`, BERT's embeddings.LayerNorm (beside the word embeddings, before any block) is not fitted: the
    blocks' norms are, the embeddings stay as they were."""
    from compressor.transformer import refine as refine_module

    model = MODELS["bert"]()
    data = batches(model, n=6, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    fitted, real = [], refine_module.Reconstruction

    def spy(module, parameters, config):
        fitted.extend(parameters)
        return real(module, parameters, config)

    monkeypatch.setattr(refine_module, "Reconstruction", spy)
    reconstruct_model(pruned, model, data, RefineConfig(steps=5, lr=0.01, norms=True), CPU)
    names = {id(p): n for n, p in pruned.named_parameters()}
    chosen = {names[id(p)] for p in fitted}
    assert any(n.startswith("encoder.") and "LayerNorm" in n for n in chosen)
    assert not [n for n in chosen if n.startswith("embeddings.")]


def test_a_pool_of_more_windows_is_fitted_on_and_never_judged():
    """`pool`: windows the fit steps through beside the calibration's fitting ones, never among the judged ones (the
    held-out error before the fit is the calibration's alone), without those identical to a judged window."""
    model = MODELS["llama"]()
    data = batches(model, n=4, batch=5)  # 20 windows: 5 steps of 4, one step (4 windows) judged
    pruned, _ = prune_transformer(model, data, 0.5)
    config = RefineConfig(steps=4, lr=0.01, check_every=2)
    alone = reconstruct_model(copy.deepcopy(pruned), model, data, config, CPU, target="logits")
    fresh = [example_inputs(model, batch=5, length=12, seed=100 + i) for i in range(2)]  # 10 new windows
    pool = fresh + data  # and every calibration window again: the judged ones are left out, the fitted ones not
    pooled = reconstruct_model(copy.deepcopy(pruned), model, data, config, CPU, target="logits", pool=pool)
    assert alone.windows == 16 and pooled.windows == 16 + 10 + 16
    assert pooled.before == alone.before
    with pytest.raises(AssertionError, match="no calibration windows"):
        reconstruct_model(pruned, model, [], config, CPU, target="logits", pool=fresh)


def test_the_next_token_kl_is_the_mean_over_the_tokens_that_count():
    model = MODELS["llama"]()
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs = example_inputs(model, batch=3, length=7)  # the first row half padding
    kl, count = _next_token_kl(other, model, inputs, CPU)
    with torch.no_grad():
        p, q = (torch.log_softmax(m(**inputs).logits, -1) for m in (model, other))
    per_token = (p.exp() * (p - q)).sum(-1)  # (3, 7)
    mask = inputs["attention_mask"].bool()
    assert int(count) == int(mask.sum()) < mask.numel()
    torch.testing.assert_close(kl, per_token[mask].sum(), rtol=1e-5, atol=1e-7)
    assert float(kl.detach()) > 0 and float(_next_token_kl(model, model, inputs, CPU)[0].detach()) == 0


def test_a_whole_model_fit_of_logits_needs_a_causal_lm_and_a_known_target():
    model = MODELS["bert"]()
    data = batches(model)
    pruned, _ = prune_transformer(model, data, 0.5)
    with pytest.raises(ValueError, match="no next-token logits to fit"):
        reconstruct_model(pruned, model, data, RefineConfig(steps=5), CPU, target="logits")
    with pytest.raises(ValueError, match="target must be"):
        reconstruct_model(pruned, model, data, RefineConfig(steps=5), CPU, target="tokens")


def test_a_dense_model_has_nothing_for_the_whole_model_fit_to_fix():
    model = MODELS["bert"]()
    data = batches(model)
    fit = reconstruct_model(copy.deepcopy(model), model, data, RefineConfig(steps=50), CPU)
    assert fit.before == 0.0 and fit.steps == 0 and not fit.kept


def test_a_few_windows_of_a_batch_drop_the_padding_none_of_them_needs():
    ids = torch.arange(24).view(4, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    tail = _cut(batch, slice(1, 3))
    assert tail["input_ids"].tolist() == [[6, 7, 8], [12, 13, 14]] and tail["attention_mask"].shape == (2, 3)
    assert tail["token_type_ids"].shape == (2, 3)
    head = _cut(batch, slice(0, 2))
    assert head["input_ids"].shape == (2, 6)  # the first window is full length
    images = {"pixel_values": torch.randn(4, 3, 8, 8)}
    assert _cut(images, slice(0, 2))["pixel_values"].shape == (2, 3, 8, 8)  # no mask: as they are


def test_the_whole_model_fit_lasts_as_long_as_the_block_fits_or_what_a_budget_left():
    config = model_config(block_fits=40.0)
    assert config.steps == MODEL_STEPS and config.seconds == pytest.approx(40.0) and config.min_steps == 0
    assert config.lr < default_config(None).lr  # every block moves at once: smaller steps
    assert model_config(40.0, budget=10.0).seconds == pytest.approx(10.0) and model_config(40.0, 10.0).budgeted
    assert model_config(40.0, budget=100.0).seconds == pytest.approx(40.0) and not model_config(40.0, 100.0).budgeted
    assert not config.budgeted
    assert model_config(40.0, budget=-3.0).seconds == 0.0  # the block fits overran the budget: no time left


def test_the_next_token_fit_lasts_as_long_as_the_pruning_pass_and_checks_more_often():
    hidden = model_config(block_fits=40.0, solves=100.0)
    logits = model_config(block_fits=40.0, solves=100.0, target="logits")
    assert hidden.seconds == pytest.approx(40.0) and logits.seconds == pytest.approx(140.0)
    assert logits.check_every < hidden.check_every  # its steps cost more: its seconds bind sooner
    assert model_config(40.0, budget=50.0, solves=100.0, target="logits").seconds == pytest.approx(50.0)
    with pytest.raises(ValueError, match="target must be"):
        model_config(40.0, target="tokens")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_fitted_in_float32_and_keeps_its_dtype(dtype):
    """Adam's small relative steps are below half precision's resolution: the fit runs on float32 copies, and the
    pruned model comes back in its own dtype (parameters and buffers alike), with the fitted weights."""
    model = MODELS["llama"]()
    data = batches(model, n=6, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    pruned.to(dtype)
    dtypes = {k: v.dtype for k, v in pruned.state_dict().items()}
    before = {k: v.clone() for k, v in pruned.state_dict().items()}
    fit = reconstruct_model(pruned, model, data, RefineConfig(steps=40, lr=2e-3, check_every=20), CPU,
                            target="logits")
    assert fit.kept and fit.after < fit.before
    assert {k: v.dtype for k, v in pruned.state_dict().items()} == dtypes
    moved = {k for k, v in pruned.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and moved <= _fitted_names(pruned)


@pytest.mark.parametrize("target", ["hidden", "logits"])
def test_the_dense_models_target_is_computed_in_float32_for_a_half_precision_checkpoint(target):
    """An fp16 checkpoint whose activations pass fp16's 65,504: the dense model's forward in its own dtype gave an
    infinite / NaN target and the fit was thrown away (`before` NaN) without a word. The target is float32 now (read
    through an upcast, no float32 copy), and the dense model comes back as it was."""
    model = MODELS["llama"]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.mul_(300.0)
    data = batches(model, n=6, batch=8)
    pruned, _ = prune_transformer(model, data, 0.5)
    model.to(torch.float16)
    pruned.to(torch.float16)
    with torch.no_grad():
        assert not torch.isfinite(model(**{k: v[:2] for k, v in data[0].items()}).logits.float()).all()
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    fit = reconstruct_model(pruned, model, data, RefineConfig(steps=4, lr=1e-4, check_every=2), CPU, target=target)
    assert math.isfinite(fit.before) and math.isfinite(fit.after)
    assert all(torch.equal(v, dense[k]) and v.dtype == dense[k].dtype for k, v in model.state_dict().items())
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
