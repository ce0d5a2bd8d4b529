"""`osscar compress` and `service.job.compress` end to end."""

import json
import os
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch

from service.client import cli
from service.job import CompressRequest, compress
from service.job.kinds import FIT_SEQUENCES
from service.job.report import Report
from tests.compressor.cnn.conv_models import write_classifier_job, write_conv_job


@pytest.fixture(autouse=True)
def toy_speed_is_noise(monkeypatch):
    """The toy models here run in microseconds: their measured speedup is noise, and below 0.98 a job ends
    slower_than_dense. These tests are about everything else, so a toy that measured slower counts as even
    (tests of slower_than_dense patch the measurement themselves)."""
    import dataclasses
    import importlib

    from exporters.runtime import measure_latency

    def measured(*args, **kwargs):
        latency = measure_latency(*args, **kwargs)
        if latency.speedup >= 1.0:
            return latency
        return dataclasses.replace(latency, compressed_ms=latency.baseline_ms, speedup=1.0)

    # the modules (service.job.compress is also the function's name): the rounds' and probes' timer, the fused graphs
    for name in ("service.job.timing", "service.job.compress"):
        monkeypatch.setattr(importlib.import_module(name), "measure_latency", measured)


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress")
    return write_conv_job(root)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A classifier whose predictions spread over its classes (as a trained one's do) and its images."""
    return write_classifier_job(tmp_path_factory.mktemp("classifier"))


def _classifier_args(root, out) -> list[str]:
    return ["compress", str(root / "classifier.pt2"), "--uniform-ratio", "0.25", "--calibration",
            str(root / "images.npz"), "--out", str(out), "--samples", "16", "--repeats", "3"]


def test_compress_writes_onnx_program_and_report(model_and_data, capsys):
    root = model_and_data
    out = root / "out"
    code = cli.main(["compress", str(root / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(root / "cal.npz"), "--out", str(out), "--samples", "32", "--sequences", "64",
                     "--max-rounds", "2"])
    assert code == 0
    assert "block2.conv3" in capsys.readouterr().err  # progress on stderr
    report = json.loads((out / "report.json").read_text())
    # flags of other kinds and modes are named, not silently dropped
    assert "ignored, as this job has no use for them: --sequences (for text models), --max-rounds (in target mode " \
           "only)" in report["warnings"]
    assert report["method"] == "osscar" and report["uniform_ratio"] == 0.5 and report["samples"] == 32
    assert report["params_after"] < report["params_before"]
    assert [layer["width_after"] for layer in report["layers"]] == [8, 6, 6, 4, 4]  # the stream, then the blocks
    assert {"name", "kind", "width_before", "width_after", "objective"} <= set(report["layers"][0])
    assert report["elapsed_s"] > 0
    assert report["latency_samples"]["sessions_at_once"] == 2  # paired: this host holds both
    # where the time went: every stage the job entered, in order, adding up to the job's time up to the report
    assert [(t["stage"], t["round"]) for t in report["stages"]] == [("loading", 0), ("baseline", 0), ("prune", 0),
                                                                    ("measure", 0), ("save", 0)]
    assert all(t["seconds"] >= 0 for t in report["stages"])
    assert 0.5 * report["elapsed_s"] < sum(t["seconds"] for t in report["stages"]) <= report["elapsed_s"] + 1
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["x"]
    assert session.get_outputs()[0].name == "logits"
    pruned = torch.export.load(str(out / "model.pt2")).module()
    x = torch.randn(3, 3, 16, 16)
    got = session.run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, pruned(x).detach().numpy(), rtol=1e-4, atol=1e-4)


def test_importable_function_matches_the_cli(model_and_data):
    root = model_and_data
    report = compress(CompressRequest(model=str(root / "model.pt2"), uniform_ratio=0.25,
                                      calibration=root / "cal.npz", out_dir=root / "py", samples=16,
                                      method="mp+"))
    assert report.method == "mp+" and (root / "py" / "model.onnx").is_file()


@pytest.mark.parametrize("args,words", [
    (["--uniform-ratio", "1.2"], "--uniform-ratio must be in (0, 1)"),
    (["--uniform-ratio", "0.5", "--samples", "0"], "--samples must be in [1, 1000000]"),
    (["--uniform-ratio", "0.5", "--model-override"], None),
    (["--uniform-ratio", "0.5", "--remove-blocks", "-1"], "--remove-blocks must be in [0, 10000]"),
])
def test_bad_arguments_give_one_line_and_nonzero_exit(model_and_data, args, words, capsys):
    root = model_and_data
    argv = ["compress", str(root / "model.pt2"), "--calibration", str(root / "cal.npz"), "--out",
            str(root / "bad"), *args]
    if words is None:  # argparse rejects unknown flags itself
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        return
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_missing_model_and_mismatched_images(model_and_data, tmp_path, capsys):
    root = model_and_data
    assert cli.main(["compress", str(tmp_path / "none.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(root / "cal.npz"), "--out", str(tmp_path / "o")]) == 2
    assert "no such torch.export program" in capsys.readouterr().err
    np.savez(tmp_path / "big.npz", x=np.zeros((4, 32, 32, 3), np.uint8))
    assert cli.main(["compress", str(root / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "big.npz"), "--out", str(tmp_path / "o")]) == 2
    assert "the model expects (3, 16, 16)" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--decode-step"], ["--stream", "--activation-dtype", "float16"], []],
                         ids=["in-memory", "streamed", "streamed-by-itself"])
def test_compress_a_transformer_directory(tmp_path, capsys, extra, monkeypatch, request):
    """A (tiny, GQA) Llama directory with token-id calibration: pruned HF directory + manifest, ONNX
    with the model's input names and logits, report; the saved model reloads with the same outputs.
    Streamed from its shards, the job gives the same widths and parameter counts; a host with too little
    memory for pruning in memory streams without being asked, and says so."""
    from compressor.transformer import offload
    from compressor.transformer.surgery import load_pruned
    from exporters.fusion import fusion_of
    from tests.compressor.transformer.transformer_models import tiny_llama

    auto = request.node.callspec.id == "streamed-by-itself"
    if auto:  # 2 x the checkpoint's ~43 kB is more than half of this
        monkeypatch.setattr(offload, "available_memory", lambda: 64_000)
    import tempfile

    from service.job import kinds

    scratch, real_mkdtemp = [], tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):  # the streamed shards go to the job's folder (removed with it), never /tmp
        scratch.append(real_mkdtemp(*args, **kwargs))
        return scratch[-1]

    monkeypatch.setattr(kinds.tempfile, "mkdtemp", mkdtemp)

    tiny_llama().save_pretrained(tmp_path / "llama")
    lengths = [300, 250, 400, 330]  # the text's end (512 tokens) is held out
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=sum(lengths)),
             offsets=np.concatenate([[0], np.cumsum(lengths)]))
    out = tmp_path / "out"
    assert cli.main(["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "ids.npz"), "--out", str(out), "--sequences", "8", "--sequence-length", "16",
                     *extra]) == 0
    assert "mlp.down_proj" in capsys.readouterr().err
    streamed = [p for p in scratch if ".osscar-stream-" in p]
    assert bool(streamed) == ("--stream" in extra or auto) and all(os.path.dirname(p) == str(out) for p in streamed)
    assert (out / "decode.onnx").is_file() == ("--decode-step" in extra)
    from service.files import umask

    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert "model/model.safetensors" in modes and "report.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask())  # safetensors and mkstemp create 0600; not returned so
    report = json.loads((out / "report.json").read_text())
    assert any("streams the checkpoint block by block" in w for w in report.get("warnings", [])) == auto
    assert not any("ignored" in w for w in report.get("warnings", []))  # text and transformer flags apply here
    assert report["gqa"] == "query-heads"  # what its attention widths count (a later --widths-from reads them so)
    # single query heads under GQA: half of the 8 per layer, each reading one of the KV heads kept
    assert (report["widths"]["heads"], report["widths"]["ffn"]) == ([4, 4], [10, 10])
    assert report["min_sequence_length"] == report["sequence_length"] == 16  # a decoder: full causal windows
    assert [len(m) for m in report["widths"]["kv_index"]] == [4, 4]
    kv_heads = [len(set(m)) for m in report["widths"]["kv_index"]]
    q_and_o, k_and_v, ffn = 2 * 4 * 32, 2 * 4 * 32, 3 * 32  # per query head, KV head, FFN neuron (hidden 32)
    removed = sum(4 * q_and_o + (2 - kv) * k_and_v + 10 * ffn for kv in kv_heads)
    assert (report["params_before"], report["params_after"]) == (10720, 10720 - removed)
    assert [layer["kind"] for layer in report["layers"]] == ["attention_heads", "ffn_neurons"] * 2
    # the dense baseline and model.onnx both with ONNX Runtime's fused attention and norms (timed against each
    # other), and the two graphs as exported timed too
    graph = report["onnx_graph"]
    for which in ("dense", "compressed"):
        assert graph[which]["fallback"] is None
        assert {"sdpa", "rotary_embedding", "skip_rms_normalization"} <= set(graph[which]["fusions"])
    assert graph["as_exported"]["baseline_ms"] > 0 and graph["as_exported"]["speedup"] > 0
    assert fusion_of(out / "model.onnx").counts == graph["compressed"]["fusions"]  # stamped in the file
    if "--decode-step" in extra:
        assert fusion_of(out / "decode.onnx").fused and not (out / "unfused").exists()
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    assert session.get_outputs()[0].name == "logits"
    reloaded = load_pruned(out / "model")
    ids = torch.randint(0, 50, (2, 7))
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 7), np.int64)})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, reloaded(input_ids=ids).logits.numpy(), rtol=1e-4, atol=1e-4)


def test_an_encoder_is_calibrated_on_many_windows_of_spread_lengths_and_a_decoder_on_full_windows(tmp_path, capsys):
    """Without --sequences / --min-sequence-length, an encoder's calibration is 2,048 windows of 16 to
    --sequence-length tokens (each window is one context of its bidirectional attention); the report
    and the job's log say what was drawn. Explicit values win."""
    from tests.compressor.transformer.transformer_models import tiny_bert

    tiny_bert().save_pretrained(tmp_path / "bert")
    lengths = np.random.default_rng(1).integers(20, 60, size=30)
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=int(lengths.sum())),
             offsets=np.concatenate([[0], np.cumsum(lengths)]))
    common = ["compress", str(tmp_path / "bert"), "--uniform-ratio", "0.5", "--calibration", str(tmp_path / "ids.npz"),
              "--sequence-length", "32", "--refine-steps", "0", "--latency-probes", "0"]
    assert cli.main([*common, "--out", str(tmp_path / "default")]) == 0
    assert "2048 calibration sequences of 16-32 tokens" in capsys.readouterr().err
    report = json.loads((tmp_path / "default" / "report.json").read_text())
    assert (report["sequences"], report["min_sequence_length"], report["sequence_length"]) == (2048, 16, 32)
    assert "model_reconstruction" not in report  # --refine-steps 0: no block fit, no whole-model fit
    given = ["--sequences", "40", "--min-sequence-length", "32"]
    assert cli.main([*common, "--out", str(tmp_path / "given"), *given]) == 0
    assert "40 calibration sequences of <= 32 tokens" in capsys.readouterr().err
    report = json.loads((tmp_path / "given" / "report.json").read_text())
    assert (report["sequences"], report["min_sequence_length"]) == (40, 32)


def test_too_few_calibration_tokens_are_a_report_warning(tmp_path):
    """8 tokens for attention outputs that keep 16 inputs: the objective cannot rank supports; the job says so
    once in report.json (and goes on: the widths are what was asked)."""
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "llama")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1100),
             offsets=np.array([0, 1100]))
    out = tmp_path / "out"
    assert cli.main(["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "ids.npz"), "--out", str(out), "--sequences", "1", "--sequence-length", "8"]) == 0
    report = json.loads((out / "report.json").read_text())
    flat = [w for w in report["warnings"] if "cannot rank supports" in w]
    assert len(flat) == 1 and "rank(H) <= 8" in flat[0] and "keeps 16 inputs" in flat[0], report["warnings"]


def test_windows_past_the_position_embeddings_are_cut_to_them_with_a_warning(tmp_path):
    """GPT-2 with 32 positions and the default 128-token windows ended in an IndexError traceback (a BERT's in an
    ONNX Runtime error blamed on the export): the windows are cut to the model's positions, and the report says so."""
    import transformers

    from tests.compressor.transformer.transformer_models import VOCAB, _seeded

    _seeded(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=24, n_positions=32, bos_token_id=0,
        eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 600, 1200])
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / "gpt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "ids.npz"), "--sequences", "8", "--refine-steps", "0", "--repeats", "3",
                     "--accuracy-budget", "none", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code in (0, 2) and report["status"] in ("ok", "slower_than_dense")
    assert report["sequence_length"] == 32 and report["shape"]["sequence"] == 32
    assert any("windows are cut to 32 tokens" in w for w in report["warnings"])


@pytest.mark.parametrize("bad,words", [(10_000, "token ids 10000 are outside the model's 50 "),
                                       (-5, "token ids -5 are outside")])
def test_token_ids_outside_the_embeddings_are_refused_in_one_line(tmp_path, capsys, bad, words):
    """An id past the embedding table was an IndexError traceback; a negative one was read from the table's end
    (ONNX Runtime's Gather wraps it) and the job ended ok."""
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "llama")
    ids = np.random.default_rng(0).integers(3, 50, 1200)
    ids[::10] = bad  # a vocabulary that is not the model's
    np.save(tmp_path / "ids.npy", ids)
    assert cli.main(["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "ids.npy"), "--sequences", "200", "--sequence-length", "16",
                     "--out", str(tmp_path / "o")]) == 2
    assert words in capsys.readouterr().err


def test_transformer_text_without_tokenizer_is_refused(tmp_path, capsys):
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "llama")
    (tmp_path / "c.txt").write_text("some text\n\nmore text")
    assert cli.main(["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "c.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "needs the model's tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["vit", "deit"])
def test_compress_a_vision_transformer_directory(tmp_path, family):
    """A ViT (or DeiT: a distillation token beside [CLS]) directory is an image job through the transformer
    pipeline: image calibration, pixel_values in the ONNX, cosine of the pooled hidden states, heads and FFN
    neurons physically removed; the saved model reloads with the ONNX file's outputs."""
    from compressor.transformer.surgery import load_pruned
    from tests.compressor.transformer.transformer_models import MODELS

    MODELS[family]().save_pretrained(tmp_path / "vit")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).integers(0, 256, (160, 16, 16, 3), dtype=np.uint8))
    out = tmp_path / "out"
    assert cli.main(["compress", str(tmp_path / "vit"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "cal.npz"), "--out", str(out), "--repeats", "3", "--shape", "batch=4"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["metric"]["name"] == "cosine"
    assert 0 < report["metric"]["compressed"] <= 1 and report["params_after"] < report["params_before"]
    assert report["widths"]["ffn"] == [12, 12] and report["onnx_inputs"] == ["pixel_values"]
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["pixel_values"]
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        expected = load_pruned(out / "model")(pixel_values=x).last_hidden_state.numpy()
    np.testing.assert_allclose(session.run(None, {"pixel_values": x.numpy()})[0], expected, rtol=1e-4, atol=1e-4)


def test_compress_a_swin_directory_with_sublayers_removed(tmp_path):
    """Swin (blocks in two stages, patch merging between them) through the job: --widths-from removes an attention
    of stage 0 and an FFN of stage 1 beside narrower heads and FFNs of both stages (target mode weighs the same
    units: tests/service/job/test_kinds.py, `bench/zoo.py`); the ONNX file gives the outputs of the saved model
    as load_pruned rebuilds it, and transformers alone loads it with trust_remote_code."""
    import transformers

    from compressor.transformer.surgery import load_pruned
    from tests.compressor.transformer.transformer_models import tiny_swin

    tiny_swin().save_pretrained(tmp_path / "swin")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).integers(0, 256, (160, 32, 32, 3), dtype=np.uint8))
    kept = {"0.blocks.0.mlp.fc2": 24, "0.blocks.1.attention.o_proj": 2, "0.blocks.1.mlp.fc2": 12,
            "1.blocks.0.attention.o_proj": 2, "1.blocks.0.mlp.fc2": 30, "1.blocks.1.attention.o_proj": 4}
    structure = {"layers": [{"name": f"encoder.layers.{name}", "width_after": width} for name, width in kept.items()],
                 "removed_layers": ["encoder.layers.0.blocks.0.attention.o_proj",
                                    "encoder.layers.1.blocks.1.mlp.fc2"]}
    (tmp_path / "structure.json").write_text(json.dumps(structure))
    out = tmp_path / "out"
    assert cli.main(["compress", str(tmp_path / "swin"), "--widths-from", str(tmp_path / "structure.json"),
                     "--out", str(out), "--calibration", str(tmp_path / "cal.npz"), "--repeats", "3",
                     "--shape", "batch=4", "--accuracy-budget", "none"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["widths"] == {"heads": [0, 2, 2, 4], "ffn": [24, 12, 30, 0]}
    assert report["removed_layers"] == structure["removed_layers"]
    session = ort.InferenceSession(str(out / "model.onnx"))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = load_pruned(out / "model")(pixel_values=x).last_hidden_state.numpy()
        alone = transformers.AutoModel.from_pretrained(out / "model", trust_remote_code=True, local_files_only=True)
        np.testing.assert_allclose(alone.eval()(pixel_values=x).last_hidden_state.numpy(), expected, rtol=0, atol=0)
    np.testing.assert_allclose(session.run(None, {"pixel_values": x.numpy()})[0], expected, rtol=1e-4, atol=1e-4)


def test_compress_a_convnext_directory_prunes_its_blocks_inner_neurons(tmp_path):
    """A Hugging Face ConvNeXt (its blocks' Linears run channels-last, its stream is normalised over the
    channels) through the conv path: each block's hidden neurons are pruned, the graph is exported with parity,
    and the saved program gives the ONNX file's outputs."""
    import transformers

    config = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10,
                                         layer_scale_init_value=0.5, image_size=32)
    torch.manual_seed(0)
    transformers.ConvNextForImageClassification(config).save_pretrained(tmp_path / "convnext")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).integers(0, 256, (200, 32, 32, 3), dtype=np.uint8))
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / "convnext"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "cal.npz"), "--out", str(out), "--repeats", "3", "--accuracy-budget", "none"])
    report = json.loads((out / "report.json").read_text())
    assert (code, report["status"]) in ((0, "ok"), (2, "slower_than_dense"))  # a toy's speed is noise
    assert [(r["kind"], r["width_before"], r["width_after"]) for r in report["layers"]] == \
        [("ffn_neurons", 64, 32), ("ffn_neurons", 128, 64)]
    assert report["params_after"] < report["params_before"] and report["artifacts"]["parity"]["peak_error"] < 2e-3
    x = torch.randn(3, 3, 32, 32)
    program = torch.export.load(str(out / "model.pt2")).module()
    session = ort.InferenceSession(str(out / "model.onnx"))
    with torch.no_grad():
        expected = program(x)
    expected = expected[0] if isinstance(expected, (tuple, list)) else expected
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0], expected.numpy(),
                               rtol=1e-4, atol=1e-4)


def test_a_vision_transformer_refuses_calibration_of_another_size(tmp_path, capsys):
    from tests.compressor.transformer.transformer_models import tiny_vit

    tiny_vit().save_pretrained(tmp_path / "vit")
    np.savez(tmp_path / "cal.npz", x=np.zeros((4, 32, 32, 3), dtype=np.uint8))
    assert cli.main(["compress", str(tmp_path / "vit"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "cal.npz"), "--out", str(tmp_path / "o")]) == 2
    assert "the model expects (3, 16, 16)" in capsys.readouterr().err


def _conv_args(root, out) -> list[str]:
    return ["compress", str(root / "model.pt2"), "--uniform-ratio", "0.5", "--calibration", str(root / "cal.npz"),
            "--out", str(out), "--samples", "16", "--repeats", "3"]


def _one_line_without_traceback(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("osscar: parity_failed: ")
    return last


def test_a_dense_export_beyond_the_parity_tolerance_fails_the_job(model_and_data, tmp_path, monkeypatch, capsys):
    """No export can meet a negative tolerance: the dense baseline's fails, the job ends parity_failed with
    exit 2, report.json says where and by how much, and no model.onnx is left (not even an earlier one)."""
    from exporters.onnx import ParityTolerance
    from service.job import kinds

    monkeypatch.setitem(kinds.PARITY_TOLERANCES, "fp32", ParityTolerance(peak=-1.0, aggregate=-1.0))
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"an earlier job's")
    assert cli.main(_conv_args(model_and_data, out)) == 2
    line = _one_line_without_traceback(capsys)
    assert "the dense model's export (fp32) fails the parity check" in line and "peak error" in line
    assert {p.name for p in out.iterdir()} == {"report.json"}
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "parity_failed" and report["message"] in line
    parity = report["parity"]
    assert (parity["stage"], parity["round"], parity["error"]) == ("baseline", None, "ParityError")
    assert parity["tolerance"] == {"peak": -1.0, "aggregate": -1.0}
    assert parity["mismatches"][0]["output"] == "logits" and parity["mismatches"][0]["peak_error"] >= 0
    assert report["rounds"] == [] and report["layers"] == [] and report["metric"]["baseline"] is None
    assert [t["stage"] for t in report["stages"]] == ["loading", "baseline"]  # how far it got, and how long


def test_a_round_whose_export_fails_parity_ends_the_job_with_that_round(model_and_data, tmp_path, monkeypatch,
                                                                         capsys):
    from exporters.onnx import ParityError, ParityMismatch
    from service.job import kinds

    real, calls = kinds.check_parity, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the dense baseline passes, round 0's export does not
            raise ParityError([ParityMismatch("logits", "peak error 0.5 of scale (limit 0.001)", 0.5, 0.1, 3.0)])
        return real(*args, **kwargs)

    monkeypatch.setattr(kinds, "check_parity", second_fails)
    out = tmp_path / "out"
    assert cli.main(_conv_args(model_and_data, out)) == 2
    assert "the export of round 0 (fp32) fails the parity check" in _one_line_without_traceback(capsys)
    report = json.loads((out / "report.json").read_text())
    assert (report["parity"]["stage"], report["parity"]["round"]) == ("round", 0)
    assert report["parity"]["mismatches"] == [{"output": "logits", "problem": "peak error 0.5 of scale (limit 0.001)",
                                               "peak_error": 0.5, "aggregate_error": 0.1, "max_abs_error": 3.0}]
    assert [layer["width_after"] for layer in report["layers"]] == [8, 6, 6, 4, 4]  # what the round had pruned
    assert report["metric"]["baseline"] == pytest.approx(1.0) and not (out / "model.onnx").exists()


def test_onnx_runtime_failing_in_evaluation_is_a_parity_failure(model_and_data, tmp_path, monkeypatch, capsys):
    from exporters.runtime import RuntimeFailure
    from service.job import kinds

    def crash(*args, **kwargs):
        raise RuntimeFailure("ONNX Runtime failed: Fail: [ONNXRuntimeError] : 1 : FAIL : bad kernel\nsecond line")

    monkeypatch.setattr(kinds, "run_outputs", crash)  # the evaluation outputs, not the parity check's
    out = tmp_path / "out"
    report = compress(CompressRequest(model=str(model_and_data / "model.pt2"), uniform_ratio=0.5,
                                      calibration=model_and_data / "cal.npz", out_dir=out, samples=16, repeats=3))
    assert report.status == "parity_failed" and report.parity.error == "RuntimeFailure"
    assert "does not run in ONNX Runtime: ONNX Runtime failed: Fail: [ONNXRuntimeError] : 1 : FAIL : bad kernel " \
           "second line" in report.message
    assert {p.name for p in out.iterdir()} == {"report.json"}


def test_onnx_runtime_killed_for_memory_is_the_hosts_memory_not_a_parity_failure(model_and_data, tmp_path,
                                                                                 monkeypatch, capsys):
    """The subprocess killed (SIGKILL, the host's out-of-memory killer), even after running again in pieces: the job
    ended PARITY_FAILED, "the export does not run in ONNX Runtime", a cause in the model that retrying cannot cure."""
    from exporters import runtime

    def killed(*args, **kwargs):
        raise runtime.RuntimeKilled("ONNX Runtime's subprocess was killed (SIGKILL: most likely the host's "
                                    "out-of-memory killer)")

    monkeypatch.setattr(runtime, "_call", killed)
    out = tmp_path / "out"
    assert cli.main(_conv_args(model_and_data, out)) == 2
    err = capsys.readouterr().err
    assert "osscar: the job ran out of host memory in stage baseline" in err and "parity" not in err.lower()


def test_a_model_the_exporter_cannot_trace_is_a_parity_failure_in_one_line(model_and_data, tmp_path, monkeypatch):
    """torch.onnx.export's errors (a data-dependent guard in a rotary update, an op without an ONNX function) ran to
    hundreds of lines of traceback out of the job: the dense model's export now ends it parity_failed, saying
    the tracer's innermost error in one line."""
    import torch

    from exporters import onnx as onnx_export

    def untraceable(module, args, *pargs, **kwargs):
        try:
            raise RuntimeError("Could not guard on data-dependent expression u0 > 16\n(a long trace)")
        except RuntimeError as cause:
            raise torch.onnx.errors.OnnxExporterError("Failed to export the model with torch.export.") from cause

    monkeypatch.setattr(onnx_export.torch.onnx, "export", untraceable)
    out = tmp_path / "out"
    report = compress(CompressRequest(model=str(model_and_data / "model.pt2"), uniform_ratio=0.5,
                                      calibration=model_and_data / "cal.npz", out_dir=out, samples=16, repeats=3))
    assert report.status == "parity_failed" and report.parity.error == "ExportError"
    assert report.parity.stage == "baseline"
    assert "the dense model's export (fp32) fails in torch.onnx.export: RuntimeError: Could not guard on " \
           "data-dependent expression u0 > 16" in report.message and "long trace" not in report.message
    assert {p.name for p in out.iterdir()} == {"report.json"}


def _damaging(monkeypatch) -> None:
    """Every round's pruned model damaged after pruning: each conv's weights shuffled (seeded)."""
    from service.job import kinds

    real = kinds.ConvJob.prune

    def prune(self, plan, observe=None, fit_seconds=None, fit=True, solved=None, fit_deadline=None):
        module, layers = real(self, plan, observe, fit_seconds, fit, solved)
        if observe is None:  # a round, not the dense statistics pass
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for param in module.parameters():
                    if param.dim() == 4:
                        param.copy_(param.flatten()[torch.randperm(param.numel(), generator=gen)].view_as(param))
        return module, layers

    monkeypatch.setattr(kinds.ConvJob, "prune", prune)


def test_a_damaged_model_ends_accuracy_budget_exceeded_by_default(classifier, tmp_path, monkeypatch, capsys):
    """A model damaged after pruning (its convs' weights shuffled) is scored on held-out images by top-1
    agreement with the dense model (no labels): by default the job ends accuracy_budget_exceeded (exit 2,
    artifacts kept, the numbers and the rule in the line); with `--accuracy-budget none` it is ok."""
    _damaging(monkeypatch)
    out = tmp_path / "default"
    assert cli.main(_classifier_args(classifier, out)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("osscar: accuracy_budget_exceeded: measured speedup ")
    assert "agreement 1.0000 -> " in line
    assert "beyond the default accuracy budget: agreement at least 0.9 (agreement >= 0.9000)" in line
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "accuracy_budget_exceeded" and (out / "model.onnx").is_file()
    assert report["metric"]["name"] == "agreement" and report["metric"]["compressed"] < 0.9
    assert set(report["metric"]["secondary"]) == {"cosine"}
    assert report["accuracy_budget"] == {"rule": "agreement at least 0.9", "kind": "at_least", "limit": 0.9,
                                         "default": True, "worst_allowed": 0.9, "bound": "agreement >= 0.9000"}
    # scored on images the calibration never saw: 16 drawn for calibration, the other 144 of the file held out
    assert report["evaluation"] == {"source": "held out of the calibration file", "calibration": 16,
                                    "evaluation": 144, "overlap_dropped": 0, "taken_from_calibration": 0,
                                    "tokens": None, "unit": "images"}
    off = tmp_path / "none"
    assert cli.main([*_classifier_args(classifier, off), "--accuracy-budget", "none"]) in (0, 2)
    report = json.loads((off / "report.json").read_text())
    # no budget: only a toy's noisy speed can end it otherwise
    assert report["status"] in ("ok", "slower_than_dense") and report["accuracy_budget"] is None
    assert report["metric"]["compressed"] < 0.9


def test_a_damaged_model_ends_accuracy_budget_exceeded_through_the_service(classifier, tmp_path, monkeypatch):
    """The same damage in the service's own worker (in process, as the server runs it) and supervisor: the
    operation fails FAILED_PRECONDITION / ACCURACY_BUDGET_EXCEEDED with the numbers in its metadata, and its
    artifacts are kept."""
    import os

    from google.rpc import code_pb2

    from service import logs
    from service.api.wire import operation_of
    from service.core import JobService, ServiceConfig, worker
    from service.core.executor import Ended
    from tests.service.core.service_helpers import running_record

    _damaging(monkeypatch)
    monkeypatch.setattr(worker, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(os, "nice", lambda n: 0)
    monkeypatch.setattr(logs, "configure", lambda log_format: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what a cpu slot's worker sets: this process's, until the end
    jobs = JobService(ServiceConfig(home=tmp_path / "home", devices=("cpu",)))
    jobs.open()
    spec = {"model": str(classifier / "classifier.pt2"), "calibration": str(classifier / "images.npz"),
            "uniform_ratio": 0.25, "samples": 16, "repeats": 3}
    class Collected:  # the worker's end of its pipe, as worker.run uses it
        def __init__(self) -> None:
            self.messages: list = []

        def send(self, message) -> None:
            self.messages.append(message)

        def close(self) -> None:
            pass

    work = tmp_path / "work"
    work.mkdir()
    conn = Collected()
    worker.run(worker.WorkerArgs("operations/d", spec, {}, str(jobs.home), str(work), "cpu", 1), conn)
    messages = conn.messages
    result = messages[-1]
    assert result[0] == "done" and result[1]["report"]["status"] == "accuracy_budget_exceeded"
    record = running_record(jobs, "operations/d")
    jobs.supervisor.conclude(record, 1, None, Ended(0), result)
    final = jobs.get(record.name)
    error = operation_of(final).error
    assert error.code == code_pb2.FAILED_PRECONDITION and final.error.reason == "ACCURACY_BUDGET_EXCEEDED"
    assert final.error.metadata["metric"] == "agreement" and float(final.error.metadata["metric_compressed"]) < 0.9
    assert final.artifacts  # the best artifact is kept


def test_a_tflite_mobilenet_v2_is_scored_on_held_out_images_by_top1_agreement(tmp_path, capsys):
    """The issue's case at a small width: an ImageNet MobileNetV2 as TFLite converts it (no BatchNorm, clamp
    for ReLU6, 1,001 classes, 224 x 224), uint8 images without labels, --mean/--std. Every image of the file
    is asked for as calibration, so the job holds 64 out (never scoring what it fitted, which a classifier
    refit on fewer images than it keeps inputs reproduces exactly), says that the classifier sees too few
    images, and reports top-1 agreement with the dense model on exactly those held-out images, which this
    test measures again on its own."""
    from compressor.calibration import split_images
    from compressor.cnn.models import export_module, save_program
    from tests.compressor.cnn.conv_models import TfliteMobileNetV2, scale_to_unit_variance

    torch.manual_seed(0)
    images = np.random.default_rng(0).integers(0, 256, size=(160, 224, 224, 3), dtype=np.uint8)
    np.savez(tmp_path / "images.npz", x=images)
    norm = (0.50196, 0.50196, 0.50196)
    x = (torch.from_numpy(images[:16]).permute(0, 3, 1, 2).float() / 255 - 0.50196) / 0.50196
    model = scale_to_unit_variance(TfliteMobileNetV2(width=0.25, depth=1, last=320), x).eval()
    save_program(export_module(model, x[:2]), tmp_path / "model.pt2", x[:2])
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / "model.pt2"), "--uniform-ratio", "0.5", "--round-to", "8",
                     "--calibration", str(tmp_path / "images.npz"), "--mean", "0.50196,0.50196,0.50196", "--std",
                     "0.50196,0.50196,0.50196", "--refine-steps", "0", "--repeats", "3", "--shape", "batch=4",
                     "--out", str(out), "--accuracy-budget", "none"])
    assert code in (0, 2)  # a toy's speed is noise (slower_than_dense); the evaluation is what is tested
    report = json.loads((out / "report.json").read_text())
    assert report["status"] in ("ok", "slower_than_dense")
    assert report["evaluation"]["calibration"] == 96 and report["evaluation"]["evaluation"] == 64
    assert report["evaluation"]["taken_from_calibration"] == 64
    assert report["metric"]["name"] == "agreement" and report["metric"]["baseline"] == 1.0
    assert any("classifier" in w and "one row per calibration image" in w for w in report["warnings"])
    calibration, held_out, _ = split_images(tmp_path / "images.npz", samples=500, held_out=256, mean=norm, std=norm)
    seen = {c.numpy().tobytes() for c in calibration}
    assert not any(h.numpy().tobytes() in seen for h in held_out)
    dense = torch.export.load(str(tmp_path / "model.pt2")).module()
    session = ort.InferenceSession(str(out / "model.onnx"))
    with torch.no_grad():
        expected = dense(held_out).numpy()
    got = session.run(None, {"x": held_out.numpy()})[0]
    assert got.shape == (64, 1001)
    assert report["metric"]["compressed"] == pytest.approx(float((got.argmax(1) == expected.argmax(1)).mean()))
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert report["metric"]["secondary"]["cosine"]["compressed"] == pytest.approx(float(cosine.mean()), abs=1e-5)


def test_a_pruned_model_scored_identical_to_the_dense_one_ends_evaluation_failed(model_and_data, tmp_path,
                                                                                 monkeypatch, capsys):
    """If a round's outputs were the dense model's to the bit although layers were narrowed, the check
    compared a model with itself: the job ends evaluation_failed (exit 2, only report.json), never with a
    made-up 1.0."""
    from service.job import kinds

    monkeypatch.setattr(kinds.ConvJob, "outputs", lambda self, path: np.ones((len(self.eval_x), 5), np.float32))
    out = tmp_path / "same"
    assert cli.main(_conv_args(model_and_data, out)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("osscar: evaluation_failed: the accuracy check cannot vouch for the result: round 0's "
                           "export gave outputs identical to the dense model's")
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "evaluation_failed" and report["evaluation_failure"]["round"] == 0
    assert {p.name for p in out.iterdir()} == {"report.json"}
    from service.core.outcomes import JobError

    error = JobError.from_report(Report.from_json(report))
    assert (error.code, error.reason, error.metadata["stage"]) == ("FAILED_PRECONDITION", "EVALUATION_FAILED", "round")


def test_too_few_images_to_hold_out_are_refused_with_what_to_give(model_and_data, tmp_path, capsys):
    np.savez(tmp_path / "few.npz", x=np.random.default_rng(0).integers(0, 256, size=(100, 16, 16, 3), dtype=np.uint8))
    assert cli.main(["compress", str(model_and_data / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "few.npz"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "50 evaluation images unseen by the calibration" in err and "needs at least 64" in err
    assert "--eval" in err and "Traceback" not in err


def test_eval_images_that_repeat_calibration_images_are_dropped(model_and_data, tmp_path):
    """--eval given the calibration file itself: every image the calibration drew is dropped from the
    evaluation, the rest (enough) is scored."""
    x = np.load(model_and_data / "cal.npz")["x"]
    np.savez(tmp_path / "eval.npz", x=x, y=np.arange(len(x)) % 5)
    report = compress(CompressRequest(model=str(model_and_data / "model.pt2"), uniform_ratio=0.25,
                                      calibration=model_and_data / "cal.npz", eval=tmp_path / "eval.npz",
                                      out_dir=tmp_path / "o", samples=32, repeats=3, accuracy_budget=None,
                                      no_accuracy_budget=True))
    assert report.metric.name == "top1" and set(report.metric.secondary) == {"agreement", "cosine"}
    assert report.evaluation["overlap_dropped"] == 32 and report.evaluation["evaluation"] == 128


def test_a_real_lm_pruned_past_twice_its_perplexity_is_not_ok(shared_data, tmp_path, capsys):
    """stories260K (trained) at a uniform 0.5: perplexity ~4.4 -> ~30 on held-out stories; the default
    budget (2x dense) ends the job instead of reporting it ok. Its decode step and genai_config.json, as the job
    writes them, make ONNX Runtime GenAI generate 64 tokens from a story's first 8, exactly the greedy tokens of
    the pruned model in PyTorch (query heads pruned one by one: layers with different KV head counts)."""
    import onnxruntime_genai as og

    from compressor.transformer.surgery import load_pruned

    model = shared_data / "stories260K"
    out = tmp_path / "out"
    assert cli.main(["compress", str(model), "--uniform-ratio", "0.5", "--calibration",
                     str(model / "tinystories-valid-tokens.npz"), "--out", str(out), "--sequences", "16",
                     "--sequence-length", "64", "--shape", "batch=1,sequence=64", "--repeats", "3",
                     "--decode-step"]) == 2
    report = json.loads((out / "report.json").read_text())
    metric = report["metric"]
    assert report["status"] == "accuracy_budget_exceeded" and metric["compressed"] > 2 * metric["baseline"]
    assert "perplexity at most 2x dense" in capsys.readouterr().err.strip().splitlines()[-1]
    assert report["artifacts"]["decode_step"]["genai_config"] == "genai_config.json"
    assert {"decode.onnx", "genai_config.json"} <= set(report["artifacts"]["decode_step"]["files"])
    tokens = np.load(model / "tinystories-valid-tokens.npz")
    prompt = [int(t) for t in tokens["ids"][tokens["offsets"][200]:][:8]]
    generator_model = og.Model(str(out))
    params = og.GeneratorParams(generator_model)
    params.set_search_options(max_length=len(prompt) + 64)
    generator = og.Generator(generator_model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    pruned = load_pruned(out / "model")
    with torch.no_grad():
        greedy = pruned.generate(torch.tensor([prompt]), max_length=len(prompt) + 64, do_sample=False).tolist()[0]
    assert [int(t) for t in generator.get_sequence(0)] == greedy and len(greedy) > len(prompt) + 16


def _slower(monkeypatch, speedup: float = 0.72) -> None:
    """Every measurement: the pruned model at `speedup` of the dense one."""
    import importlib

    from exporters.runtime import Latency

    for name in ("service.job.timing", "service.job.compress"):
        monkeypatch.setattr(importlib.import_module(name), "measure_latency",
                            lambda *a, **k: Latency(10.0, 10.0 / speedup, 11.0, 11.0 / speedup, speedup, "cpu", 1,
                                                    "test", 3))


def test_a_model_measured_slower_than_dense_is_not_ok(model_and_data, tmp_path, monkeypatch, capsys):
    """Uniform widths that measure slower than dense: status slower_than_dense, exit 2, the artifact kept,
    and a warning that the unrounded widths (6 and 4 channels) are the likely cause."""
    _slower(monkeypatch)
    out = tmp_path / "out"
    assert cli.main(_conv_args(model_and_data, out)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("osscar: slower_than_dense: measured speedup")
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "slower_than_dense" and report["measured_speedup"] == pytest.approx(0.72)
    assert (out / "model.onnx").is_file() and (out / "model.pt2").is_file()
    assert any("unrounded uniform widths (4, 6)" in w and "--round-to 8" in w for w in report["warnings"])


def test_an_earlier_jobs_exports_in_a_reused_out_do_not_outlive_a_new_model(model_and_data, tmp_path):
    """A causal LM's job with its decode step, then a conv model's into the same folder: the earlier decode.onnx,
    genai_config.json and external weights go (ONNX Runtime GenAI would generate with the earlier model)."""
    out = tmp_path / "out"
    out.mkdir()
    stale = ("decode.onnx", "decode.onnx.data", "genai_config.json", "model.onnx.data")
    for name in stale:
        (out / name).write_bytes(b"an earlier job's")
    # what its report lists beside them: an image classifier's labels and preprocessing, a decode step's tokenizer
    listed = ("config.json", "preprocessor_config.json", "tokenizer.json")
    for name in (*listed, "notes.txt"):
        (out / name).write_text("an earlier job's")
    (out / "report.json").write_text(json.dumps({"artifacts": {
        "serving": {"files": ["config.json", "preprocessor_config.json", "../outside.txt"]},
        "decode_step": {"files": ["decode.onnx", "genai_config.json", "tokenizer.json"]}}}))
    (tmp_path / "outside.txt").write_text("not the job's to remove")
    assert cli.main(_conv_args(model_and_data, out)) in (0, 2)
    assert (out / "model.onnx").is_file() and not any((out / name).exists() for name in (*stale, *listed))
    assert (out / "notes.txt").is_file() and (tmp_path / "outside.txt").is_file()  # listed by no report, or outside
    assert json.loads((out / "report.json").read_text())["artifacts"].get("decode_step") is None


def test_a_save_interrupted_in_an_earlier_jobs_out_leaves_no_report_of_files_gone(model_and_data, tmp_path,
                                                                                    monkeypatch):
    """Ctrl-C while saving into an earlier job's --out removed its model.onnx and pruned model and kept its report.json,
    which then described artifacts no longer there (and `--widths-from out/report.json` read it)."""
    import importlib

    job_compress = importlib.import_module("service.job.compress")
    out = tmp_path / "out"
    assert cli.main(_conv_args(model_and_data, out)) in (0, 2) and (out / "report.json").is_file()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job_compress, "_save", interrupted)
    assert cli.main(_conv_args(model_and_data, out)) == 130
    assert not any((out / name).exists() for name in ("report.json", "report.html", "model.onnx"))


def test_a_full_disk_while_saving_is_one_line_and_exit_2(model_and_data, tmp_path, monkeypatch, capsys):
    import errno
    import importlib

    job_compress = importlib.import_module("service.job.compress")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "model.onnx"))

    monkeypatch.setattr(job_compress, "_save", full)
    assert cli.main(_conv_args(model_and_data, tmp_path / "out")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("osscar: the job ran out of disk space in stage save (no space left on the device);")


def test_a_piece_the_disk_refuses_to_write_is_out_of_disk_not_a_parity_failure(model_and_data, tmp_path,
                                                                                monkeypatch, capsys):
    """ONNX Runtime's subprocess writes files (a graph's pieces): a write refused for space came back as a
    RuntimeFailure, and the job ended PARITY_FAILED, "the export does not run in ONNX Runtime"."""
    import errno

    from exporters.runtime import RuntimeFailure
    from service.job import kinds

    def full(*args, **kwargs):
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError as err:
            raise RuntimeFailure("ONNX Runtime failed: OSError: [Errno 27] File too large") from err

    monkeypatch.setattr(kinds, "run_outputs", full)
    assert cli.main(_conv_args(model_and_data, tmp_path / "out")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("osscar: the job ran out of disk space in stage baseline (a file grew past the size limit)")


def test_a_cpu_slot_refuses_the_cuda_provider_before_pruning(model_and_data, tmp_path, monkeypatch, capsys):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cli.main([*_conv_args(model_and_data, tmp_path / "out"), "--execution-provider", "cuda"]) == 2
    assert "no GPU is visible to this job" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_host_that_cannot_hold_both_sessions_times_them_in_turn_and_warns(model_and_data, tmp_path, monkeypatch):
    from compressor.transformer import offload

    monkeypatch.setattr(offload, "available_memory", lambda: 1 << 30)  # two sessions' floor alone are 1 GiB
    out = tmp_path / "out"
    assert cli.main(_conv_args(model_and_data, out)) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["latency_samples"]["sessions_at_once"] == 1
    # --repeats 3 rounded up to an even count: one sample in each end turn, two in the three between
    assert report["latency_samples"]["repeats"] == 4 and report["measured_speedup"] > 0
    (warned,) = [w for w in report["warnings"] if "one at a time" in w]
    assert "would need ~" in warned and "1.0 GiB available" in warned


def test_a_host_that_cannot_hold_one_session_checks_evaluates_and_times_the_graphs_in_pieces(tmp_path, monkeypatch):
    """A decoder whose one ONNX Runtime session the host cannot hold (here: none fits, pieces of 4 kB of weights)
    is parity-checked, evaluated and timed in pieces, its decode step too, and the job is ok with what a
    whole-graph job measures; no piece file is left behind."""
    from exporters import fusion, runtime
    from exporters import onnx as onnx_export
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "llama")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 600, 1200])
    args = ["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration", str(tmp_path / "ids.npz"),
            "--sequences", "8", "--sequence-length", "16", "--decode-step", "--refine-steps", "0", "--repeats", "3"]
    assert cli.main([*args, "--out", str(tmp_path / "whole")]) == 0
    monkeypatch.setattr(runtime, "SESSION_SHARE", 0.0)
    monkeypatch.setattr(runtime, "PIECE_SHARE", 0.0)
    monkeypatch.setattr(runtime, "MIN_PIECE_BYTES", 4_000)
    for module in (onnx_export, fusion):  # weights beside the graphs, as a model this large has them
        monkeypatch.setattr(module, "EXTERNAL_DATA_BYTES", 0)
    assert cli.main([*args, "--out", str(tmp_path / "pieces")]) == 0
    whole, pieced = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("whole", "pieces"))
    assert pieced["status"] == "ok" and (out := tmp_path / "pieces" / "decode.onnx").is_file()
    assert whole["latency_samples"]["pieces"] == 0 and pieced["latency_samples"]["pieces"] > 4
    assert pieced["latency_samples"]["sessions_at_once"] == 2 and pieced["measured_speedup"] > 0
    (said,) = [w for w in pieced["warnings"] if "in pieces" in w]  # once, not for every measurement
    assert "of weights per graph, two sessions at a time" in said
    for key in ("baseline", "compressed"):  # the same models evaluated whole and in pieces
        assert pieced["metric"][key] == pytest.approx(whole["metric"][key], rel=1e-5)
    assert pieced["widths"] == whole["widths"] and out.stat().st_size > 0
    assert (tmp_path / "pieces" / "model.onnx.data").is_file()
    assert not [p for p in tmp_path.rglob("*") if ".piece" in p.name]


def test_removed_blocks_leave_the_graph_before_its_channels_are_pruned(model_and_data, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main([*_conv_args(model_and_data, out), "--remove-blocks", "1", "--refine-steps", "10"]) == 0
    err = capsys.readouterr().err
    assert "depth: block 1/1: block" in err and "graph reconstruction" in err
    report = json.loads((out / "report.json").read_text())
    (removed,) = report["removed_blocks"]
    assert removed in ("block1", "block2")
    names = [layer["name"] for layer in report["layers"]]
    assert names and not [n for n in names if n.startswith(removed + ".")]  # its convs are gone, not pruned
    program = torch.export.load(str(out / "model.pt2")).module()
    assert not [k for k in program.state_dict() if k.startswith(removed + ".")]
    x = torch.randn(2, 3, 16, 16)
    got = ort.InferenceSession(str(out / "model.onnx")).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, program(x).detach().numpy(), rtol=1e-4, atol=1e-4)
    # --widths-from reproduces the whole structure, depth included (mp+ through the same choice)
    args = [a for a in _conv_args(model_and_data, tmp_path / "mp") if a not in ("--uniform-ratio", "0.5")]
    assert cli.main([*args, "--widths-from", str(out / "report.json"), "--method", "mp+"]) == 0
    again = json.loads((tmp_path / "mp" / "report.json").read_text())
    assert again["removed_blocks"] == [removed] and again["method"] == "mp+"
    assert {r["name"]: r["width_after"] for r in again["layers"]} == {r["name"]: r["width_after"]
                                                                     for r in report["layers"]}
    assert cli.main([*_conv_args(model_and_data, tmp_path / "more"), "--remove-blocks", "3"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last == ("osscar: error: 3 residual blocks to remove, but this graph has 2 removable ones (identity "
                    "shortcuts only): ['block1', 'block2']")


def test_uniform_widths_are_rounded_only_when_round_to_is_given(model_and_data, tmp_path):
    """The paper's protocol keeps round(ratio x width); --round-to rounds each width to its multiples
    (the stream: 16 -> 8; block1: 12 channels, 0.5 -> 6 -> 8 at multiples of 4; block2: 8 -> 4 stays)."""
    from service.job.compress import rounded_widths

    out = tmp_path / "out"
    assert cli.main([*_conv_args(model_and_data, out), "--round-to", "4"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [layer["width_after"] for layer in report["layers"]] == [8, 8, 8, 4, 4]
    assert rounded_widths([("a", 67 * 2), ("b", 16), ("c", 5), ("d", 3)], 0.5, 8) == {"a": 64, "b": 8, "c": 3, "d": 1}
    assert rounded_widths([("a", 64)], 0.95, 8) == {"a": 8}  # at least one multiple


@pytest.mark.parametrize("config, words", [
    ({"model_type": "convnextv2"}, "'convnextv2' is not supported: ConvNeXt V2's GRN layers"),
    ({"model_type": "gemma4_text", "num_kv_shared_layers": 2}, "reuse earlier layers' keys and values"),
    ({"model_type": "gemma4", "text_config": {}}, "Gemma4ForCausalLM(m.config.text_config)"),
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, "weights are quantized (mxfp4)"),
    ({"model_type": "phimoe", "num_experts_per_tok": 4}, "two experts a token"),
    ({"model_type": "qwen2_moe", "num_experts": 0}, "with num_experts 0 every layer is a dense FFN"),
    ({"model_type": "mixtral", "hidden_act": "gelu"}, "computes SwiGLU (hidden_act silu) experts only"),
    ({"model_type": "glm4_moe", "n_routed_experts": 8, "n_group": 3}, "8 experts in n_group 3; the groups must be"),
    ({"model_type": "deepseek_v3", "num_experts_per_tok": 9, "n_routed_experts": 16, "n_group": 4, "topk_group": 2},
     "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "topk_method 'noaux_tc'; DeepSeek-V2's greedy"),
    ({"model_type": "ernie4_5_moe", "moe_layer_interval": 2, "moe_num_shared_experts": 2}, "moe_layer_interval 1"),
    ({"model_type": "qwen3_5"}, "saved as a qwen3_5_text checkpoint: Qwen3_5ForCausalLM.from_pretrained(path)"),
    ({"model_type": "qwen3_5_moe"}, "saved as a qwen3_5_moe_text checkpoint: Qwen3_5MoeForCausalLM.from_pretrained"),
    ({"model_type": "llama4_text"}, "input scaled by the router's sigmoid score"),
    ({"model_type": "lfm2_vl", "text_config": {}}, "lm = Lfm2ForCausalLM(m.config.text_config)"),
    ({"model_type": "gemma3"}, "their language model alone, saved as a gemma3_text checkpoint"),
    ({"model_type": "nemotron_h"}, "Nemotron-H's blocks each hold one sub-layer"),
    ({"model_type": "jamba"}, "Jamba's Mamba (1) mixers scan token by token"),
    ({"model_type": "zamba2"}, "Zamba's attention blocks are shared between layers"),
    ({"model_type": "deberta-v2", "conv_kernel_size": 3}, "a convolution after its first layer (conv_kernel_size"),
    ({"model_type": "made_up"}, "model_type 'made_up' is neither a supported transformer family"),
    ({"model_type": "swinv2", "num_channels": 3, "num_heads": [3, 6]}, "'swinv2' is a vision transformer that is "
                                                                       "not supported"),
    ({"model_type": "swin", "num_channels": 3, "embed_dim": 96, "num_heads": [3, 4]}, "its head size differs between "
                                                                                      "stages"),
    # rotary frequencies recomputed from the input's length in the forward: a traceback from torch.export before
    ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 8.0},
                                                       "sliding_attention": {"rope_type": "default"}}},
     "rope_type 'dynamic'"),
    # loaded by transformers 5 without their distance embeddings: another model, silently
    ({"model_type": "bert", "position_embedding_type": "relative_key"}, "relative_key / relative_key_query"),
    ({"model_type": "mpnet", "relative_attention_num_buckets": 16}, "relative_attention_num_buckets other than 32"),
    ({"model_type": "convnextv2", "num_channels": 3}, "ConvNeXt V2's GRN layers"),
    ({"model_type": "clip"}, "prune the vision tower alone, saved as clip_vision_model: CLIPVisionModel"),
    ({"model_type": "siglip"}, "saved as siglip_vision_model: SiglipVisionModel.from_pretrained"),
    ({"model_type": "falcon", "new_decoder_architecture": True}, "the grouped q/k/v of new_decoder_architecture"),
    ({"model_type": "falcon", "alibi": True}, "ALiBi positions (Falcon-RW)"),
    ({"model_type": "electra", "position_embedding_type": "relative_key_query"}, "relative_key / relative_key_query"),
])
def test_an_unsupported_family_is_refused_in_one_line_before_loading(tmp_path, config, words, capsys):
    """The CLI applies the server's architecture rule (check_config) before loading anything: the line names
    the family and why, never the conv path's "not an image model"."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "ids.npz").write_bytes(b"")  # never read: the refusal comes first
    assert cli.main(["compress", str(tmp_path / "m"), "--uniform-ratio", "0.25", "--calibration",
                     str(tmp_path / "ids.npz"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert words in err and "not an image model" not in err


def test_a_decoder_reranker_is_compressed_as_an_encoder_scored_by_its_scores(tmp_path):
    """A Qwen3 reranker's score head (num_labels 1) through the CLI: an encoder job (no decode step), exported with its
    last-token pooling (the last token that is not padding) within parity, scored by the centred cosine of its
    scores, never by the top-1 agreement of a single column (1.0 for any model)."""
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=20, max_position_embeddings=64, pad_token_id=0, num_labels=1)).save_pretrained(tmp_path / "m")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 600, 1200])
    code = cli.main(["compress", str(tmp_path / "m"), "--uniform-ratio", "0.25", "--calibration",
                     str(tmp_path / "ids.npz"), "--sequences", "16", "--sequence-length", "16", "--repeats", "3",
                     "--refine-steps", "0", "--accuracy-budget", "none", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (code, report["status"]) in ((0, "ok"), (2, "slower_than_dense"))
    assert report["metric"]["name"] == "cosine" and report["metric"]["compressed"] < 1.0
    assert "decode_step" not in report["artifacts"] and not (tmp_path / "out" / "decode.onnx").exists()
    assert report["artifacts"]["parity"]["peak_error"] < 1e-4
    assert report["artifacts"]["serving"]["optimum"] == "ORTModelForSequenceClassification"
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"))
    assert [(o.name, o.shape[-1]) for o in session.get_outputs()][:1] == [("logits", 1)]


@pytest.mark.parametrize("family", ["gpt2", "phi3", "modernbert", "qwen3_moe"])
def test_families_compress_end_to_end_with_block_reconstruction(family, tmp_path):
    """GPT-2 (Conv1D projections: block reconstruction fits them too), Phi-3 (fused qkv / gate_up, a per-layer
    config view), ModernBERT (fused Wqkv / Wi, global and sliding-window layers) and Qwen3-MoE (experts as 3-D
    tensors: the block fit reaches its attention, the whole-model fit its experts too), tiny random-init, through
    the CLI with the default reconstruction: pruned, exported, parity-checked (16-token windows: longer than the
    sliding windows). Every family's fit, export and parity are tested on its own (tests/compressor/transformer,
    tests/exporters); `bench/zoo.py` runs them all through the CLI."""
    from tests.compressor.transformer.transformer_models import MODELS

    MODELS[family]().save_pretrained(tmp_path / family)
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 600, 1200])
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / family), "--uniform-ratio", "0.25", "--calibration",
                     str(tmp_path / "ids.npz"), "--sequences", "16", "--sequence-length", "16", "--repeats", "3",
                     "--accuracy-budget", "none", "--time-budget", "600", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert (code, report["status"]) in ((0, "ok"), (2, "slower_than_dense"))  # a toy's speed is noise
    assert report["params_after"] < report["params_before"] and report["block_reconstruction"]["blocks"] == 2
    # each block's fit as long as its solves, 50 to 500 steps (a toy's solves take less than 50 steps do)
    recon = report["block_reconstruction"]
    assert 50 <= recon["steps_min"] <= recon["steps"] <= 500
    # a local job paces itself to --time-budget too: an ample one does not cut the fits short
    assert report["pacing"]["time_budget_s"] == 600
    # the allowance paid for the block fits and the whole-model fit after them: both counted
    fit_steps = recon["steps_min"] + recon["steps"] + report["model_reconstruction"]["steps"]
    assert report["pacing"]["rounds"][0]["fit_steps"] == fit_steps
    assert report["artifacts"]["parity"]["peak_error"] < 2e-3
    # the whole model is fitted after its blocks: an encoder's last hidden states for as long as its block fits
    # took, a decoder's next-token distributions for as long as its solves and block fits took; each fit stops at
    # its first held-out check past its time (every 100 steps, every 20)
    whole = report["model_reconstruction"]
    assert whole["kept"] == (whole["after"] < whole["before"])
    solves = sum(layer["seconds"] for layer in report["layers"])
    # through the calibration's fitting windows (an encoder's) or more of the same text (a decoder's, FIT_SEQUENCES
    # in all, less those that repeat a judged window: on this text of 1,200 tokens a tenth share half their 8-token
    # runs with one)
    if family == "modernbert":
        assert whole["steps"] >= 100 and whole["seconds"] <= recon["seconds"] + 60
        assert whole["windows"] < 16
    else:
        assert whole["steps"] >= 20 and whole["seconds"] <= solves + recon["seconds"] + 60
        assert 0.8 * FIT_SEQUENCES < whole["windows"] < FIT_SEQUENCES


@pytest.mark.parametrize("flags, words", [(["--method", "flap"], "method 'flap' gives output projections a bias"),
                                          (["--add-bias", "yes"], "--add-bias yes gives output projections a bias")])
def test_what_moe_experts_cannot_take_is_refused_before_the_model_loads(flags, words, tmp_path, capsys, monkeypatch):
    """FLAP's bias compensation (or --add-bias yes) has no bias to write into a MoE layer's experts: refused in one
    line before anything loads (it was refused once the dense model had been loaded and exported)."""
    from service.job import kinds
    from tests.compressor.transformer.transformer_models import MODELS

    MODELS["mixtral"]().save_pretrained(tmp_path / "m")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=600), offsets=[0, 600])
    monkeypatch.setattr(kinds, "load_transformer", lambda *a, **k: pytest.fail("the model was loaded"))
    code = cli.main(["compress", str(tmp_path / "m"), "--uniform-ratio", "0.25", "--calibration",
                     str(tmp_path / "ids.npz"), "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


def _quick_uniform_job(tmp_path) -> dict:
    """The tiny model saved at tmp_path/m through the CLI at a uniform 0.25 (8 windows of 16 random ids, no fits, no
    accuracy budget); its report, once the job ended ok (or slower than dense: a toy's speed is noise)."""
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 600, 1200])
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / "m"), "--uniform-ratio", "0.25", "--calibration",
                     str(tmp_path / "ids.npz"), "--sequences", "8", "--sequence-length", "16", "--repeats", "3",
                     "--refine-steps", "0", "--accuracy-budget", "none", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert (code, report["status"]) in ((0, "ok"), (2, "slower_than_dense"))
    return report


def test_a_moe_model_too_large_to_prune_in_memory_is_streamed(tmp_path, monkeypatch):
    """A checkpoint over the memory share that turns streaming on: a MoE model, its experts stored one tensor each, is
    streamed block by block as a dense one is (it was pruned in memory with a warning: a model too large for that
    host ran out of memory instead), and its model/ reloads at the widths reported."""
    from compressor.transformer.surgery import load_pruned
    from service.job import kinds
    from tests.compressor.transformer.transformer_models import MODELS

    MODELS["qwen3_moe"]().save_pretrained(tmp_path / "m")
    monkeypatch.setattr(kinds, "needs_streaming", lambda _model: True)
    report = _quick_uniform_job(tmp_path)
    assert any("pruning streams the checkpoint block by block" in w for w in report["warnings"])
    assert report["params_after"] < report["params_before"]
    model = load_pruned(tmp_path / "out" / "model")
    assert sum(p.numel() for p in model.parameters()) == report["params_after"]


def test_a_model_this_service_pruned_to_uneven_widths_compresses_again(tmp_path):
    """A returned model/ with osscar_widths.json (layers of their own widths, which from_pretrained refuses: a
    transformers traceback) is rebuilt by its manifest and pruned further."""
    from compressor.transformer.surgery import prune_ffn, prune_query_heads, save_pruned, widths
    from tests.compressor.transformer.transformer_models import MODELS

    model = MODELS["llama"]()
    prune_query_heads(model, 0, [0, 1, 2, 5, 6])  # 5 of 8 query heads, uneven over the KV heads
    prune_ffn(model, 1, range(12))
    save_pruned(model, tmp_path / "m")
    assert (tmp_path / "m" / "osscar_widths.json").is_file()
    report = _quick_uniform_job(tmp_path)
    assert report["params_before"] == sum(p.numel() for p in model.parameters()) > report["params_after"]
    assert report["widths"]["ffn"][1] < 12 and widths(model)["heads"][0] == 5


def test_a_bf16_checkpoint_compresses_and_stays_in_its_dtype(tmp_path):
    """A bf16 checkpoint (Qwen3, tiny): pruned in float32 block by block, exported in float32 (ONNX Runtime's
    CPU kernels lack bf16), the decode step too; model/ keeps the checkpoint's dtype (fp16 alike: the
    pipeline's and streaming's tests)."""
    from safetensors import safe_open

    dtype = "bfloat16"
    from tests.compressor.transformer.transformer_models import MODELS

    MODELS["qwen3"]().to(getattr(torch, dtype)).save_pretrained(tmp_path / "m")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 600, 1200])
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / "m"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "ids.npz"), "--sequences", "16", "--sequence-length", "16", "--repeats", "3",
                     "--decode-step", "--accuracy-budget", "none", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert (code, report["status"]) in ((0, "ok"), (2, "slower_than_dense")), report["status"]  # a toy's speed
    assert report["params_after"] < report["params_before"]
    assert report["artifacts"]["parity"]["peak_error"] < 2e-3 and (out / "decode.onnx").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == dtype
    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {f"torch.{dtype}"}  # noqa: SIM118


def test_the_sources_tokenizer_files_are_copied_as_they_are(tmp_path):
    """A BERT directory with vocab.txt beside tokenizer.json: the job's model/ lacked vocab.txt (the tokenizer was
    saved again by transformers) and its tokenizer_config.json gained this machine's loading keys; each file is now
    the source's, byte for byte."""
    import transformers

    from tests.compressor.transformer.transformer_models import MODELS

    source = tmp_path / "bert"
    MODELS["bert"]().save_pretrained(source)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(45)]]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(source)
    (source / "vocab.txt").write_text("\n".join(words) + "\n")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(5, 50, size=1200), offsets=[0, 1200])
    out = tmp_path / "out"
    cli.main(["compress", str(source), "--uniform-ratio", "0.25", "--calibration", str(tmp_path / "ids.npz"),
              "--out", str(out), "--sequences", "16", "--sequence-length", "24", "--repeats", "3",
              "--refine-steps", "0", "--accuracy-budget", "none"])
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (out / "model" / name).read_bytes() == (source / name).read_bytes(), name


def test_a_decode_step_of_sliding_window_layers_is_exported_and_checked(tmp_path):
    """Gemma 2's sliding-window layer (window 4) keeps every position in decode.onnx's cache, its mask restricting
    attention to the window (it was refused): the job's checks pass on calibration windows far past the window, and
    the step after a 20-token prompt gives the pruned model's own logits."""
    import onnxruntime as ort
    import torch

    from compressor.transformer.surgery import load_pruned
    from exporters.onnx import _past_of, decode_step_names
    from tests.compressor.transformer.transformer_models import MODELS

    MODELS["gemma2"]().save_pretrained(tmp_path / "m")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=1200), offsets=[0, 1200])
    out = tmp_path / "out"
    code = cli.main(["compress", str(tmp_path / "m"), "--uniform-ratio", "0.25", "--calibration",
                     str(tmp_path / "ids.npz"), "--decode-step", "--out", str(out), "--sequences", "16",
                     "--sequence-length", "24", "--repeats", "3", "--refine-steps", "0"])
    report = json.loads((out / "report.json").read_text())
    assert (code, report["status"]) in ((0, "ok"), (2, "slower_than_dense")), report["status"]  # a toy's speed
    assert "decode.onnx" in report["artifacts"]["decode_step"]["files"]
    model = load_pruned(out / "model").eval()
    ids = torch.randint(3, 50, (2, 21), generator=torch.Generator().manual_seed(1))
    session = ort.InferenceSession(str(out / "decode.onnx"), providers=["CPUExecutionProvider"])
    names, _ = decode_step_names(model.config.num_hidden_layers)
    past = _past_of(model, ids[:, :-1])
    assert past[0].shape[2] == 20  # the sliding layer's cache keeps every position
    got = session.run(None, {"input_ids": ids[:, -1:].numpy(), "attention_mask": np.ones((2, 21), np.int64),
                             **{n: t.numpy() for n, t in zip(names[2:], past, strict=True)}})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(input_ids=ids).logits[:, -1:].numpy(), rtol=1e-4, atol=1e-4)


def test_a_round_with_outputs_that_are_not_finite_ends_evaluation_failed_and_leaves_no_model(model_and_data, tmp_path,
                                                                                              monkeypatch, capsys):
    """Parity passes when PyTorch and ONNX Runtime overflow alike; a NaN metric was 'ok' without a budget. The
    job ends evaluation_failed, and a reused --out keeps no earlier pruned model beside the report."""
    from service.job import kinds

    real, calls = kinds.ConvJob.outputs, []

    def outputs(self, path):
        calls.append(path)
        got = real(self, path)
        return got if len(calls) == 1 else [np.full_like(np.asarray(o), np.nan) for o in got]

    monkeypatch.setattr(kinds.ConvJob, "outputs", outputs)
    out = tmp_path / "nan"
    (out / "model").mkdir(parents=True)
    (out / "model.pt2").write_bytes(b"an earlier job's")
    (out / "report.json").write_text(json.dumps({"artifacts": {"model": "model/"}}))  # whose model/ it is
    assert cli.main([*_conv_args(model_and_data, out), "--accuracy-budget", "none"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("osscar: evaluation_failed") and "not finite" in line
    assert {p.name for p in out.iterdir()} == {"report.json"}


def test_every_stage_an_export_can_fail_in_has_words_in_the_report():
    import importlib
    import inspect
    import re

    from service.job.reporting import STAGES

    compress = importlib.import_module("service.job.compress")  # the module (the package exports its function)
    raised = set(re.findall(r'_ExportFailed\("(\w+)"', inspect.getsource(compress)))
    assert raised and raised <= set(STAGES), raised - set(STAGES)


def test_the_time_budget_counts_from_the_jobs_start_loading_included(model_and_data, tmp_path, monkeypatch):
    import importlib

    compress = importlib.import_module("service.job.compress")

    moments, paces = {}, []
    real_open, real_pace = compress.open_job, compress.Pace

    def open_job(*args, **kwargs):
        moments["open"] = time.perf_counter()
        return real_open(*args, **kwargs)

    def pace(*args, **kwargs):
        paces.append(real_pace(*args, **kwargs))
        return paces[-1]

    from service.job import kinds

    deadlines, real_prune = [], kinds.ConvJob.prune

    def prune(self, plan, observe=None, fit_seconds=None, fit=True, solved=None, fit_deadline=None):
        deadlines.append(fit_deadline)
        return real_prune(self, plan, observe, fit_seconds, fit, solved, fit_deadline)

    monkeypatch.setattr(compress, "open_job", open_job)
    monkeypatch.setattr(compress, "Pace", pace)
    monkeypatch.setattr(kinds.ConvJob, "prune", prune)
    assert cli.main([*_conv_args(model_and_data, tmp_path / "out"), "--time-budget", "3600"]) == 0
    assert paces and paces[0].start <= moments["open"]
    # the round's fits end by the usable budget's end, whatever the solves before them took
    assert deadlines[-1] == paces[0].end() == pytest.approx(paces[0].start + 0.9 * 3600)


def test_a_round_left_no_time_for_its_fit_says_so(model_and_data, tmp_path, monkeypatch):
    """The statistics, depth plan or earlier rounds spent the usable budget: the round's fits run 0 steps, which only
    `pacing.fit_allowance_s: 0` showed; the report's warnings say it now."""
    from service.job.pacing import Pace

    monkeypatch.setattr(Pace, "left", lambda self: -5.0)
    out = tmp_path / "out"
    cli.main([*_conv_args(model_and_data, out), "--time-budget", "3600", "--accuracy-budget", "none"])
    report = json.loads((out / "report.json").read_text())
    assert report["pacing"]["rounds"][0]["fit_allowance_s"] == 0
    assert any("no time left for the reconstruction" in w for w in report["warnings"])
    # a job that fits nothing anyway is not told to raise its budget for it
    cli.main([*_conv_args(model_and_data, out), "--time-budget", "3600", "--accuracy-budget", "none",
              "--refine-steps", "0"])
    report = json.loads((out / "report.json").read_text())
    assert not any("no time left for the reconstruction" in w for w in report["warnings"])


def test_target_mode_starts_no_round_its_time_budget_cannot_hold(model_and_data, tmp_path, monkeypatch):
    """The rounds after the first looked at no budget: a job with a finished round started another one, which a
    server killed at the budget with the finished round thrown away. A round is not started when the budget left is
    shorter than the longest round so far (its latency probes counted, which ran before the check, past the budget):
    the job returns the best of those it has and says why."""
    import importlib

    from service.job.pacing import Pace

    compress = importlib.import_module("service.job.compress")
    left = {"s": 3600.0}
    monkeypatch.setattr(Pace, "left", lambda self: left["s"])
    real_target, started = compress.run_target, []

    def run_target(request, job, measure, rounds, *args):
        measure.probe_model(job.dense, 1)  # a depth trial's probe before the rounds (numbered 1): no round's start
        real_target(request, job, measure, rounds, *args)  # the toy lands at its minimum widths in one round
        left["s"] = 0.01  # then the budget is nearly spent, and the loop asks for another round
        started.append(len(rounds))
        # its latency probes (an export and a timing each) are not run either: they ran past the budget
        measure.probe(rounds[-1].plan, len(rounds))
        started.append("probed")
        measure.run_round(rounds[-1].plan, len(rounds))
        started.append(len(rounds))

    monkeypatch.setattr(compress, "run_target", run_target)
    out = tmp_path / "out"
    args = [a for a in _conv_args(model_and_data, out) if a not in ("--uniform-ratio", "0.5")]
    cli.main([*args, "--target-speedup", "2", "--remove-blocks", "0", "--time-budget", "3600",
              "--accuracy-budget", "none"])
    report = json.loads((out / "report.json").read_text())
    assert started == [1] and len(report["rounds"]) == 1 and (out / "model.onnx").is_file()
    assert any("round 1 not started: 0s of the time budget left" in w for w in report["warnings"]), report["warnings"]


def test_what_the_machine_refuses_is_said_before_the_model_loads(model_and_data, tmp_path, monkeypatch):
    """A device or ONNX Runtime provider this machine lacks, an --out that cannot be made, and an --out whose model/
    folder is no job's (the job replaced it whole, a user's files with it) end in one line before anything loads:
    they were tracebacks, or a parity failure after every layer was pruned."""
    import importlib

    from compressor.errors import InputError

    compress = importlib.import_module("service.job.compress")
    monkeypatch.setattr(compress, "open_job", lambda *a, **k: pytest.fail("the model was loaded"))
    root = model_and_data

    def request(**fields):
        return CompressRequest(**{"model": root / "model.pt2", "calibration": root / "cal.npz", "uniform_ratio": 0.5,
                                  "out_dir": tmp_path / "out", **fields})

    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="--device cuda: this torch has no CUDA device"):
            compress.compress(request(device="cuda"))
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(InputError, match="--execution-provider cuda: ONNX Runtime here has only"):
            compress.compress(request(execution_provider="cuda"))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        compress.compress(request(out_dir=tmp_path / "a-file" / "sub"))
    (tmp_path / "garbage.json").write_text("not json")  # was read after the dense export
    with pytest.raises(InputError, match=r"--widths-from .*garbage\.json: expected a report\.json"):
        compress.compress(request(uniform_ratio=None, widths_from=tmp_path / "garbage.json"))
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "notes.txt").write_text("a user's")
    with pytest.raises(InputError, match="its model/ folder is no earlier job's"):
        compress.compress(request(out_dir=mine))
    assert (mine / "model" / "notes.txt").read_text() == "a user's"


def test_a_job_into_an_earlier_jobs_out_removes_the_other_kinds_pruned_model(model_and_data, tmp_path):
    """A conv job into the --out of a transformer job: the earlier model/ stayed beside the new model.pt2 and
    model.onnx, as if it were this model's."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    (out / "report.json").write_text(json.dumps({"artifacts": {"model": "model/"}}))
    assert cli.main([*_conv_args(model_and_data, out), "--accuracy-budget", "none"]) == 0
    assert (out / "model.pt2").is_file() and not (out / "model").exists()


def test_torchs_pool_keeps_within_the_cgroups_cpu_quota(monkeypatch):
    """Torch sizes its pool by the host's cores: a job in a container limited to 2 CPUs of 64 ran 64 threads."""
    import importlib

    job_compress = importlib.import_module("service.job.compress")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(job_compress, "default_threads", lambda: 2)
        assert job_compress.fit_torch_threads() == 2 and torch.get_num_threads() == 2
        monkeypatch.setattr(job_compress, "default_threads", lambda: 8)  # never raised past what it was set to
        assert job_compress.fit_torch_threads() == 2
    finally:
        torch.set_num_threads(before)
