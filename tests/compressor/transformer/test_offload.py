"""Streaming a checkpoint block by block: same result as in memory, one block materialised at a time."""

import copy
import json

import pytest
import torch
from safetensors import safe_open

from compressor.errors import ModelReferenceError, UnsupportedArchitecture
from compressor.transformer.adapters import ADAPTERS, layers
from compressor.transformer.offload import StreamedCheckpoint
from compressor.transformer.pipeline import prune_blocks, prune_transformer
from compressor.transformer.surgery import MANIFEST, load_pruned, widths

from .transformer_models import (
    LLAMA_SHAPED,
    MODELS,
    MOE_EXTRA,
    MOE_MIXED,
    example_inputs,
    first_output,
    tiny_falcon_h1,
    tiny_gemma4,
    tiny_lfm2,
    tiny_qwen3_5,
)


def data(model):
    return [example_inputs(model, batch=3, length=12, seed=i) for i in range(3)]


def _streamed_and_in_memory(model, tmp_path):
    """The model saved in tmp_path/src pruned at 0.5 streamed and in memory, the same widths reported by both:
    (the streamed output directory, the model pruned in memory)."""
    expected, expected_reports = prune_transformer(model, data(model), 0.5)
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    reports = prune_blocks(checkpoint, data(model), 0.5)
    out = checkpoint.finish()
    assert [r.width_after for r in reports] == [r.width_after for r in expected_reports]
    return out, expected


STAGED = ("swin",)  # blocks in stages: pruned in memory only (test below)


@pytest.mark.parametrize("name", sorted(set(MODELS) - set(STAGED)))
def test_streamed_pruning_equals_in_memory_pruning(name, tmp_path):
    """Every family in its own checkpoint layout, Mixture-of-Experts ones included: transformers 5's save_pretrained
    stores each expert's projections apart (experts.E.gate_proj.weight), which a streamed block merges as
    from_pretrained does."""
    model = MODELS[name]()
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")  # several shards
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 1
    if ADAPTERS[name].experts:  # one tensor per expert, merged as the block is read
        assert any(".experts.0." in k for k in json.loads((tmp_path / "src" / "model.safetensors.index.json")
                                                               .read_text())["weight_map"])
    out, expected = _streamed_and_in_memory(model, tmp_path)
    assert json.loads((out / MANIFEST).read_text()) == widths(expected)
    reloaded = load_pruned(out)
    torch.testing.assert_close(first_output(reloaded), first_output(expected), rtol=1e-4, atol=1e-4)
    assert not list(out.glob(".*"))  # no temporary shard left behind


@pytest.mark.parametrize("name", [*sorted(MOE_EXTRA), *(f"{n}:mixed" for n in sorted(MOE_MIXED))])
def test_every_moe_family_streams_as_it_prunes_in_memory(name, tmp_path):
    """The Mixture-of-Experts families beyond MODELS' three, and those with dense-FFN layers between their MoE ones:
    each expert's tensors merged as its block is read (gpt-oss stores them merged already), shared experts, latent
    attention and dense layers streamed as they are pruned in memory."""
    mixed = name.endswith(":mixed")  # (a MOE_EXTRA name may hold a colon of its own: "granitemoehybrid:moe")
    model = MOE_MIXED[name.removesuffix(":mixed")][0]() if mixed else MOE_EXTRA[name]()
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    out, expected = _streamed_and_in_memory(model, tmp_path)
    torch.testing.assert_close(first_output(load_pruned(out)), first_output(expected), rtol=1e-4, atol=1e-4)


def test_gemma4_streams_its_per_layer_head_sizes_and_embeddings_as_it_prunes_in_memory(tmp_path):
    """Gemma 4's global layer (heads of its own size, values that are its keys), its per-layer input embeddings
    beside the blocks and each block's output scalar (a buffer in the checkpoint) stream as they are pruned in
    memory."""
    model = tiny_gemma4()
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    out, expected = _streamed_and_in_memory(model, tmp_path)
    torch.testing.assert_close(first_output(load_pruned(out)), first_output(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", [lambda: tiny_qwen3_5(("linear_attention", "full_attention", "linear_attention")),
                                   lambda: tiny_lfm2(("conv", "full_attention", "conv")), tiny_falcon_h1,
                                   LLAMA_SHAPED["bamba"]], ids=["qwen3_5", "lfm2", "falcon_h1", "bamba"])
def test_linear_attention_layers_stream_as_they_prune_in_memory(build, tmp_path):
    """Qwen3.5's Gated DeltaNet layers and LFM2's short convolutions (their units and FFNs pruned) stream as the
    attention layers beside them do, Falcon-H1's Mamba2 mixers beside its attentions (their muP vector, a buffer no
    checkpoint holds, from the template block; its layer_types, computed from the depth, as Bamba's from
    attn_layer_indices, are not set); Qwen3.5's loading renames by a prefix change (a multimodal checkpoint's language
    model), which a streamed checkpoint reads as a renaming (it was refused as a conversion)."""
    model = build()
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    out, expected = _streamed_and_in_memory(model, tmp_path)
    torch.testing.assert_close(first_output(load_pruned(out)), first_output(expected), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_missing_an_experts_tensor_is_refused_naming_it(tmp_path):
    """An expert's projection missing from the shards (a truncated download) would shift every later expert into its
    place once merged: refused as the checkpoint is opened, naming the pattern and the expert."""
    from safetensors.torch import load_file, save_file

    MODELS["qwen3_moe"]().save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelReferenceError, match=r"model.layers.1.mlp.experts.gate_up_proj is merged from every "
                                                  r"expert.*lacks mlp.experts.\*.up_proj.weight: experts \[2\]"):
        StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    # the last expert gone from every pattern: the model's expert count says so, as the checkpoint opens
    for key in [k for k in state if ".experts.3." in k]:
        del state[key]
    state["model.layers.1.mlp.experts.2.up_proj.weight"] = state["model.layers.1.mlp.experts.1.up_proj.weight"] + 1
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelReferenceError, match=r"model.layers.0.mlp.experts.(gate_up|down)_proj is merged from "
                                                  r"every expert.*experts \[3\]"):
        StreamedCheckpoint(tmp_path / "src", tmp_path / "out")


def test_t5s_encoder_streams_with_the_bias_its_first_block_computes(tmp_path):
    """T5's first block computes the position bias every later block is handed: a streamed capture reads that block
    first, so the streamed pruning equals the in-memory one."""
    from .transformer_models import ENCODER_SHAPED

    model = ENCODER_SHAPED["t5"]()
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    out, expected = _streamed_and_in_memory(model, tmp_path)
    torch.testing.assert_close(first_output(load_pruned(out)), first_output(expected), rtol=1e-4, atol=1e-4)


def test_esm_is_not_streamed(tmp_path):
    """ESM's contact head reads every layer and is narrowed as layers go, which a streamed checkpoint would reread
    whole from the source as it writes the pruned one: refused before anything is pruned, in one line."""
    from .transformer_models import ENCODER_SHAPED

    ENCODER_SHAPED["esm"]().save_pretrained(tmp_path / "src")
    with pytest.raises(UnsupportedArchitecture, match=r"contact_head\.regression reads every layer.*pruned in memory"):
        StreamedCheckpoint(tmp_path / "src", tmp_path / "out")


@pytest.mark.parametrize("name", ["llama", "bert", "gpt2", "opt"])  # rotary tables; position ids; causal masks
def test_opening_draws_no_weights_and_holds_the_checkpoints_own(name, tmp_path, monkeypatch):
    """The one-block model that carries the weights outside the blocks is built without drawing random weights
    (every one is read from the shards next; at a 128k vocabulary the draw alone took ~10 s on this VM), and it
    holds the checkpoint's weights and the buffers a built model computes from its config."""
    model = MODELS[name]()
    model.save_pretrained(tmp_path / "src")
    drawn = []
    for fn in ("normal_", "uniform_"):
        def spy(self, *args, _original=getattr(torch.Tensor, fn), **kwargs):
            if self.device.type != "meta":
                drawn.append(tuple(self.shape))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, fn, spy)
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    monkeypatch.undo()
    assert drawn == []
    outside = {n: t for n, t in checkpoint.model.state_dict().items() if not n.startswith(checkpoint.prefix)}
    expected = model.state_dict()
    assert outside and all(torch.equal(t, expected[n]) for n, t in outside.items()), sorted(outside)
    buffers = dict(model.named_buffers())
    for n, b in checkpoint.model.named_buffers():
        if not n.startswith(checkpoint.prefix):
            assert torch.equal(b, buffers[n]), n


@pytest.mark.parametrize("add_bias", [False, True])  # True: output projections gain a bias, stored in the dtype too
def test_one_block_at_a_time_and_source_dtype_kept(add_bias, tmp_path):
    model = MODELS["llama"]().half()
    model.save_pretrained(tmp_path / "src")
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    # the host keeps the checkpoint's dtype (each block is upcast to float32 only for its turn)
    assert checkpoint.model.get_input_embeddings().weight.dtype == torch.float16
    materialised = []
    load = checkpoint.load

    def spy(index):
        block = load(index)
        materialised.append([not next(b.parameters()).is_meta for b in layers(checkpoint.model)])
        assert next(block.parameters()).dtype == torch.float16
        return block

    checkpoint.load = spy
    prune_blocks(checkpoint, data(model), 0.25, add_bias=add_bias)
    out = checkpoint.finish()
    assert materialised == [[True, False], [False, True]]
    with safe_open(str(out / "model-block-00001.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())  # noqa: SIM118
    # the stored model is what pruning in memory gives (float32, from the same float16 weights; stored in float16)
    expected, _ = prune_transformer(copy.deepcopy(model).float(), data(model), 0.25, add_bias=add_bias)
    assert bool(widths(expected).get("biases")) == add_bias
    reloaded = load_pruned(out)
    assert {p.dtype for p in reloaded.parameters()} == {torch.float16}  # rebuilt in the config's dtype
    assert widths(reloaded) == widths(expected) != widths(model)
    torch.testing.assert_close(first_output(reloaded.float()), first_output(expected), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("stated,expected", [(None, torch.bfloat16), ("float32", torch.float32)])
def test_a_streamed_model_takes_its_dtype_as_an_in_memory_load_does(stated, expected, tmp_path):
    """dtype="auto": the config's dtype, else the weights'. A bf16 checkpoint whose config states none was built in
    float32 (twice the memory streaming budgets) and saved so; one whose config says float32 was saved in bf16,
    its refit rows rounded where the in-memory job keeps them in float32."""
    import json

    model = MODELS["llama"]().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    if stated:
        config["dtype"] = stated
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    assert checkpoint.model.get_input_embeddings().weight.dtype == expected
    prune_blocks(checkpoint, data(model), 0.25)
    out = checkpoint.finish()
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {expected}  # noqa: SIM118
    assert {p.dtype for p in load_pruned(out).parameters()} == {expected}


def test_tied_embeddings_stored_under_the_heads_name_stream(tmp_path):
    """Some exporters keep a tied weight as `lm_head.weight` alone: from_pretrained loads it, and streaming refused
    it ("the checkpoint lacks model.embed_tokens.weight"), so a job switched to streaming failed where one in
    memory ran."""
    from safetensors.torch import load_file, save_file

    model = MODELS["llama"]()  # tied
    model.save_pretrained(tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    assert torch.equal(checkpoint.model.get_input_embeddings().weight, model.get_input_embeddings().weight)
    prune_blocks(checkpoint, data(model), 0.25)
    reloaded = load_pruned(checkpoint.finish())
    assert torch.equal(reloaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # tied embeddings and LM head; a head of its own
def test_the_weights_outside_the_blocks_leave_memory_while_the_blocks_are_pruned(name, tmp_path):
    """Only the first block's inputs read the embeddings: from then on they are on the meta device, and `finish`
    writes them back from the shards unchanged (tied weights tied again)."""
    model = MODELS[name]()
    model.save_pretrained(tmp_path / "src")
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    outside = [n for n, _ in checkpoint.model.named_parameters() if not n.startswith(checkpoint.prefix)]
    assert any("embed" in n for n in outside)
    during = []
    load = checkpoint.load

    def spy(index):
        during.append({n: p.is_meta for n, p in checkpoint.model.named_parameters() if n in outside})
        return load(index)

    checkpoint.load = spy
    prune_blocks(checkpoint, data(model), 0.25)
    assert during and all(all(meta.values()) for meta in during)
    out = checkpoint.finish()
    expected = {n: p for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith(checkpoint.prefix)}
    restored = dict(checkpoint.model.named_parameters(remove_duplicate=False))
    for n, p in expected.items():
        assert torch.equal(restored[n], p), n
    tied = model.config.tie_word_embeddings
    assert (checkpoint.model.get_output_embeddings().weight is checkpoint.model.get_input_embeddings().weight) == tied
    reloaded = load_pruned(out)
    assert torch.equal(reloaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(reloaded.get_output_embeddings().weight, model.get_output_embeddings().weight)


def test_missing_weights_and_non_safetensors_are_refused(tmp_path):
    """A directory without safetensors, and a checkpoint missing a block's tensor: refused as the checkpoint opens (a
    missing tensor was found as its block was read, after every block before it was pruned)."""
    model = MODELS["bert"]()
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="needs safetensors"):
        StreamedCheckpoint(tmp_path / "bin", tmp_path / "out")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    del state[next(k for k in state if "layer.1." in k and k.endswith("query.weight"))]
    save_file(state, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ModelReferenceError, match=r"lacks 1 tensors of the blocks, e.g. \['encoder.layer.1.attention"):
        StreamedCheckpoint(tmp_path / "src", tmp_path / "out")


def test_a_model_in_stages_is_refused_in_one_line(tmp_path):
    """Swin's blocks sit in its stages' lists, which the streamed skeleton does not rebuild: refused before any
    block is read, naming what to do instead."""
    MODELS["swin"]().save_pretrained(tmp_path / "src")
    with pytest.raises(UnsupportedArchitecture, match=r"blocks sit in stages.*compress without --stream"):
        StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_available_memory_is_the_containers_where_its_cgroup_is_limited(tmp_path):
    """A container capped at 16 GiB (12 used) on a node with 400 GiB available has 4 GiB to give, under cgroup v2 and
    v1 alike; without a limit (v2 "max", v1's 2^63) or a cgroup to read, the node's MemAvailable stands."""
    from compressor.transformer.offload import available_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {512 * 2**20} kB\nMemAvailable: {400 * 2**20} kB\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{16 * 2**30}\n")
    (v2 / "memory.current").write_text(f"{12 * 2**30}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{16 * 2**30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{12 * 2**30}\n")
    assert available_memory(meminfo, v2) == available_memory(meminfo, v1) == 4 * 2**30
    (v2 / "memory.max").write_text("max\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert available_memory(meminfo, v2) == available_memory(meminfo, v1) == 400 * 2**30
    assert available_memory(meminfo, tmp_path / "none") == 400 * 2**30


def test_checkpoint_bytes_count_the_shards_the_index_names(tmp_path):
    """A Mistral download holds its weights twice (consolidated.safetensors beside the indexed shards): only the
    shards count, or streaming would turn on at half the size it should."""
    from compressor.transformer.offload import checkpoint_bytes

    for name, size in (("model-00001-of-00002.safetensors", 300), ("model-00002-of-00002.safetensors", 200),
                       ("consolidated.safetensors", 500)):
        (tmp_path / name).write_bytes(b"\0" * size)
    assert checkpoint_bytes(tmp_path) == 1000  # no index: every file
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "c": "model-00001-of-00002.safetensors"}}))
    assert checkpoint_bytes(tmp_path) == 500
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 70)  # what a load reads; the consolidated copy is not
    assert checkpoint_bytes(tmp_path) == 70


def test_a_task_models_checkpoint_streams_into_its_base_model(tmp_path):
    """A pretraining checkpoint's weights are named `bert.…`; an encoder job builds its base model (BertModel),
    whose names lack the prefix: the in-memory load strips it, the streamed read did not (a bare KeyError). The
    index the streamed output writes is one from_pretrained reads (it needs `metadata`)."""
    import transformers

    from .transformer_models import tiny_bert

    base = tiny_bert()
    task = transformers.BertForPreTraining(base.config)  # bert-base-uncased's weights: the base model's all there
    task.bert.load_state_dict(base.state_dict(), strict=False)
    task.save_pretrained(tmp_path / "src")
    with safe_open(str(tmp_path / "src" / "model.safetensors"), "pt") as f:
        names = f.keys()
    assert any(k.startswith("bert.") for k in names)
    expected, _ = prune_transformer(copy.deepcopy(task.bert), data(base), 0.5)
    checkpoint = StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    prune_blocks(checkpoint, data(base), 0.5)
    out = checkpoint.finish()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] > 0 and index["weight_map"]
    torch.testing.assert_close(first_output(load_pruned(out)), first_output(expected), rtol=1e-4, atol=1e-4)


def test_a_pruned_model_of_uneven_widths_is_refused_in_one_line(tmp_path):
    """A model/ with osscar_widths.json cannot be streamed (its blocks are built from a config of one width): refused
    before any block is read."""
    from compressor.transformer.surgery import prune_ffn, save_pruned

    model = MODELS["llama"]()
    prune_ffn(model, 0, range(8))
    save_pruned(model, tmp_path / "src")
    with pytest.raises(UnsupportedArchitecture, match=r"osscar_widths.json\) is not streamed"):
        StreamedCheckpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
