"""The graph-model resolver: what is accepted, what is refused and how."""

import warnings

import pytest
import torch

from compressor.cnn.models import load_model, save_program
from compressor.errors import ModelReferenceError

from .conv_models import exported


def test_pt2_round_trip(tmp_path):
    gm = exported("folded_pad")
    save_program(gm, tmp_path / "m.pt2", torch.randn(2, 3, 16, 16))
    loaded = load_model(str(tmp_path / "m.pt2"))
    assert loaded.kind == "pt2" and loaded.input_shape == (3, 16, 16)
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(loaded.module(x), gm(x))


def test_a_program_of_a_fixed_batch_is_refused_at_load_with_how_to_export_it(tmp_path):
    """Plain torch.export.export(net, (x,)) fixes the batch: the job failed later as parity_failed with a message
    cut before its reason."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    torch.export.save(torch.export.export(net, (torch.randn(2, 3, 8, 8),)), tmp_path / "static.pt2")
    with pytest.raises(ModelReferenceError, match=r"batch dimension is fixed at 2: export it with a dynamic batch, "
                                                  r"torch\.export\.export\(model, \(x,\), dynamic_shapes="):
        load_model(str(tmp_path / "static.pt2"))


class Tiny(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("make,words", [
    (lambda p: "s3://bucket/model.pt2", "unknown model reference scheme 's3'"),
    (lambda p: str(p / "missing.pt2"), "no such torch.export program"),
    (lambda p: str(p / "nothing-here"), "no such file"),
    (lambda p: "", "empty model reference"),
    (lambda p: (p / "empty").mkdir() or str(p / "empty"), "without config.json"),
    (lambda p: (p / "weights.txt").write_text("x") and str(p / "weights.txt"), "unsupported file type"),
])
def test_bad_references_are_refused_with_what_was_expected(tmp_path, make, words):
    with pytest.raises(ModelReferenceError, match=words):
        load_model(make(tmp_path))


def test_torchvision_references_load_where_torchvision_imports_and_are_refused_with_why_elsewhere():
    """torchvision is supported, never required: next to the CPU torch wheel it does not import (its ops need a
    CUDA torch) and the reference is refused with the reason; where it imports (a GPU node) the model loads."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        with pytest.raises(ModelReferenceError, match="torchvision does not import"):
            load_model("torchvision:resnet18")
        return
    loaded = load_model("torchvision:resnet18")
    assert loaded.kind == "torchvision" and loaded.input_shape == (3, 224, 224)
    with pytest.raises(ModelReferenceError, match="unknown torchvision model 'resnet-9000'"):
        load_model("torchvision:resnet-9000")


def test_pickles_are_refused(tmp_path):
    torch.save(Tiny(), tmp_path / "module.pt")  # a pickled module: code on load
    with pytest.raises(ModelReferenceError, match="weights_only loading refuses"):
        load_model(str(tmp_path / "module.pt"))
    torch.save({"w": torch.ones(2)}, tmp_path / "state.pt")
    with pytest.raises(ModelReferenceError, match="without an architecture"):
        load_model(str(tmp_path / "state.pt"))


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling writes the marker: code ran
        return (_write_marker, (self.marker,))


def _write_marker(path: str) -> tuple:
    with open(path, "w") as f:
        f.write("ran")
    return (torch.zeros(1),)


def test_a_program_whose_pickles_would_run_code_is_refused_without_running_it(tmp_path):
    """torch.export.load falls back to a full unpickle for a member weights_only refuses (its sample inputs,
    pickled weights or constants) and unpickles opaque constants freely: an uploaded .pt2 ran code on the server.
    Every load in it is weights_only now, and opaque or script-object constants are refused by name."""
    import io
    import zipfile

    gm = exported("folded_pad")
    save_program(gm, tmp_path / "good.pt2", torch.randn(2, 3, 16, 16))
    marker = tmp_path / "ran"
    payload = io.BytesIO()
    torch.save(_RunsCode(marker), payload)
    with zipfile.ZipFile(tmp_path / "good.pt2") as src, zipfile.ZipFile(tmp_path / "bad.pt2", "w") as dst, \
            zipfile.ZipFile(tmp_path / "opaque.pt2", "w") as opaque:
        members = src.namelist()
        assert any(n.endswith("sample_inputs/model.pt") for n in members), members
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info, payload.getvalue() if info.filename.endswith("sample_inputs/model.pt") else data)
            opaque.writestr(info, data)
        opaque.writestr(members[0].split("/")[0] + "/data/constants/opaque_obj_0", b"anything")
    with pytest.raises(ModelReferenceError, match=r"not a loadable torch\.export program"):
        load_model(str(tmp_path / "bad.pt2"))
    assert not marker.exists()
    with pytest.raises(ModelReferenceError, match=r"holds pickled objects .*opaque_obj_0"):
        load_model(str(tmp_path / "opaque.pt2"))
    assert load_model(str(tmp_path / "good.pt2")).kind == "pt2"  # a plain program still loads


def test_uncached_hub_id_is_not_downloaded(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelReferenceError, match="local Hugging Face cache"):
        load_model("no-such-org/no-such-model")


def test_hf_image_model_directory_is_exported_and_prunable(tmp_path):
    """A random-init Hugging Face ResNet saved locally: resolved offline, exported to the ATen
    graph with pixel_values as input and logits as output, and its inner channels found."""
    import transformers

    from compressor.cnn.graph import analyse

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


def test_a_program_whose_weights_are_views_saves_without_a_warning(tmp_path):
    gm = exported("bottleneck")
    conv = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("conv2.weight"))
    owner, attr = conv.target.rsplit(".", 1)
    weight = getattr(gm.get_submodule(owner), attr)
    wider = torch.cat([weight.detach(), weight.detach()], dim=1)  # a surgery-like view: half the columns
    setattr(gm.get_submodule(owner), attr, torch.nn.Parameter(wider[:, : weight.shape[1]]))
    x = torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_program(gm, tmp_path / "m.pt2", x)
    torch.testing.assert_close(load_model(str(tmp_path / "m.pt2")).module(x), gm(x))


def test_a_program_exported_in_training_mode_is_loaded_for_inference(tmp_path, caplog):
    """Its BatchNorms would normalise by each batch (and move their running statistics), its dropout drop at
    random: the flags are constants in the graph, which .eval() cannot change."""
    from .conv_models import MobileNetV2

    torch.manual_seed(0)
    model = MobileNetV2()
    with torch.no_grad():  # running statistics away from their initial 0 / 1
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    program = torch.export.export(model.train(), (torch.randn(2, 3, 32, 32),),
                                  dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    torch.export.save(program, str(tmp_path / "train.pt2"))
    loaded = load_model(str(tmp_path / "train.pt2"))
    assert "exported in training mode" in caplog.text
    gm, x = loaded.module, torch.randn(4, 3, 32, 32)
    running = {k: v.clone() for k, v in gm.state_dict().items()}
    with torch.no_grad():
        out = gm(x)
        torch.testing.assert_close(out, gm(x), rtol=0, atol=0)  # no dropout
        torch.testing.assert_close(out[:1], gm(x[:1]), rtol=1e-5, atol=1e-5)  # no batch statistics
        torch.testing.assert_close(out, model.eval()(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in running.items())
