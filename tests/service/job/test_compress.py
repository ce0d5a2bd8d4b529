"""`osscar compress` and `service.job.compress` end to end."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from service import cli
from service.job import CompressRequest, compress
from tests.compressor.cnn.conv_models import write_conv_job


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress")
    return write_conv_job(root)


def test_compress_writes_onnx_program_and_report(model_and_data, capsys):
    root = model_and_data
    out = root / "out"
    code = cli.main(["compress", str(root / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(root / "cal.npz"), "--out", str(out), "--samples", "32"])
    assert code == 0
    assert "block2.conv3" in capsys.readouterr().err  # progress on stderr
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "osscar" and report["uniform_ratio"] == 0.5 and report["samples"] == 32
    assert report["params_after"] < report["params_before"]
    assert [layer["width_after"] for layer in report["layers"]] == [6, 6, 4, 4]
    assert {"name", "kind", "width_before", "width_after", "objective"} <= set(report["layers"][0])
    assert report["elapsed_s"] > 0
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
    assert report["method"] == "mp+" and (root / "py" / "model.onnx").is_file()


@pytest.mark.parametrize("args,words", [
    (["--uniform-ratio", "1.2"], "--uniform-ratio must be in (0, 1)"),
    (["--uniform-ratio", "0.5", "--samples", "0"], "--samples must be in [1, 1000000]"),
    (["--uniform-ratio", "0.5", "--model-override"], None),
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


@pytest.mark.parametrize("extra", [["--decode-step"], ["--stream", "--activation-dtype", "float16"]],
                         ids=["in-memory", "streamed"])
def test_compress_a_transformer_directory(tmp_path, capsys, extra):
    """A (tiny, GQA) Llama directory with token-id calibration: pruned HF directory + manifest, ONNX
    with the model's input names and logits, report; the saved model reloads with the same outputs.
    Streamed from its shards, the job gives the same widths and parameter counts."""
    from compressor.transformer.surgery import load_pruned
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "llama")
    lengths = [30, 25, 40, 33]
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=sum(lengths)),
             offsets=np.concatenate([[0], np.cumsum(lengths)]))
    out = tmp_path / "out"
    assert cli.main(["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "ids.npz"), "--out", str(out), "--sequences", "8", "--sequence-length", "16",
                     *extra]) == 0
    assert "mlp.down_proj" in capsys.readouterr().err
    assert (out / "decode.onnx").is_file() == ("--decode-step" in extra)
    report = json.loads((out / "report.json").read_text())
    # single query heads under GQA: half of the 8 per layer, each reading one of the KV heads kept
    assert (report["widths"]["heads"], report["widths"]["ffn"]) == ([4, 4], [10, 10])
    assert [len(m) for m in report["widths"]["kv_index"]] == [4, 4]
    kv_heads = [len(set(m)) for m in report["widths"]["kv_index"]]
    q_and_o, k_and_v, ffn = 2 * 4 * 32, 2 * 4 * 32, 3 * 32  # per query head, KV head, FFN neuron (hidden 32)
    removed = sum(4 * q_and_o + (2 - kv) * k_and_v + 10 * ffn for kv in kv_heads)
    assert (report["params_before"], report["params_after"]) == (10720, 10720 - removed)
    assert [layer["kind"] for layer in report["layers"]] == ["attention_heads", "ffn_neurons"] * 2
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    assert session.get_outputs()[0].name == "logits"
    reloaded = load_pruned(out / "model")
    ids = torch.randint(0, 50, (2, 7))
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 7), np.int64)})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, reloaded(input_ids=ids).logits.numpy(), rtol=1e-4, atol=1e-4)


def test_transformer_text_without_tokenizer_is_refused(tmp_path, capsys):
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "llama")
    (tmp_path / "c.txt").write_text("some text\n\nmore text")
    assert cli.main(["compress", str(tmp_path / "llama"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "c.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "needs the model's tokenizer" in capsys.readouterr().err


def test_compress_a_vision_transformer_directory(tmp_path):
    """A ViT directory is an image job through the transformer pipeline: image calibration, pixel_values
    in the ONNX, cosine of the pooled hidden states, heads and FFN neurons physically removed; the saved
    model reloads with the ONNX file's outputs."""
    from compressor.transformer.surgery import load_pruned
    from tests.compressor.transformer.transformer_models import tiny_vit

    tiny_vit().save_pretrained(tmp_path / "vit")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).integers(0, 256, (24, 16, 16, 3), dtype=np.uint8))
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


def test_a_vision_transformer_refuses_calibration_of_another_size(tmp_path, capsys):
    from tests.compressor.transformer.transformer_models import tiny_vit

    tiny_vit().save_pretrained(tmp_path / "vit")
    np.savez(tmp_path / "cal.npz", x=np.zeros((4, 32, 32, 3), dtype=np.uint8))
    assert cli.main(["compress", str(tmp_path / "vit"), "--uniform-ratio", "0.5", "--calibration",
                     str(tmp_path / "cal.npz"), "--out", str(tmp_path / "o")]) == 2
    assert "the model expects (3, 16, 16)" in capsys.readouterr().err
