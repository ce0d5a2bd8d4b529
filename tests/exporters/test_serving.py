"""An encoder's job output loads where users serve it: sentence-transformers (its ONNX backend and PyTorch) and
Optimum's ORTModelForFeatureExtraction, giving model.onnx's embeddings."""

import json
import os
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers

from exporters.serving import LayoutError, copy_sentence_files, link_onnx, sentence_pooling
from service.client import cli
from service.embedded import calibration_texts, default_model_path

SENTENCES = ["A pruned model that still embeds.", "Second sentence, a longer one than the first one is.", "Short."]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _sentence_model(directory, hidden: int = 32):
    """A tiny random BERT as a sentence-transformers model: all-MiniLM-L6-v2's tokenizer and modules (mean
    pooling, normalisation) around it."""
    source = default_model_path()
    config = transformers.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=24, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(directory)
    for name in (*TOKENIZER_FILES, "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        shutil.copyfile(source / name, directory / name)
    shutil.copytree(source / "1_Pooling", directory / "1_Pooling")
    pooling = directory / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "word_embedding_dimension": hidden}))
    return directory


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's output for the tiny sentence model at uniform 0.5 (heads BERT's config cannot state)."""
    tmp = tmp_path_factory.mktemp("sentence")
    model = _sentence_model(tmp / "st")
    (tmp / "c.txt").write_text("\n\n".join(calibration_texts(64)))
    out = tmp / "out"
    _compress(model, out, "--calibration", str(tmp / "c.txt"), "--sequence-length", "32", "--sequences", "64")
    return out


def _compress(model, out, *flags) -> None:
    """A job that returns its artifact: these toy models' speedups are timing noise, so slower_than_dense (exit 2,
    the artifact kept) is as good as ok here."""
    code = cli.main(["compress", str(model), "--out", str(out), "--uniform-ratio", "0.5", "--refine-steps", "0",
                     "--latency-probes", "0", *flags])
    assert json.loads((out / "report.json").read_text())["status"] in {"ok", "slower_than_dense"}
    assert code in (0, 2) and (out / "model.onnx").is_file()


def _ours(out, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """model.onnx's token embeddings, and their masked mean, normalised (the source's modules)."""
    tokens = tokenizer(SENTENCES, padding=True, return_tensors="np")
    feed = {k: tokens[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    hidden = ort.InferenceSession(str(out / "model.onnx")).run(None, feed)[0]  # (batch, tokens, hidden)
    mask = tokens["attention_mask"][..., None]
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return hidden, pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def test_the_report_names_the_serving_files(job):
    report = json.loads((job / "report.json").read_text())
    assert report["artifacts"]["serving"] == {"onnx": "model/onnx/model.onnx", "sentence_transformers": True,
                                              "optimum": "ORTModelForFeatureExtraction",
                                              "trust_remote_code": True}
    model = job / "model"
    assert {"modules.json", "sentence_bert_config.json", "1_Pooling", "2_Normalize", "modeling_osscar.py"} <= {
        p.name for p in model.iterdir()}
    assert (model / "onnx" / "model.onnx").read_bytes() == (job / "model.onnx").read_bytes()
    assert "<code>model/onnx/model.onnx</code>" in (job / "report.html").read_text()


def test_sentence_transformers_onnx_backend_gives_our_embeddings(job):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(job / "model"), backend="onnx")
    _, expected = _ours(job, model.tokenizer)
    np.testing.assert_allclose(model.encode(SENTENCES), expected, rtol=0, atol=1e-5)


def test_sentence_transformers_in_pytorch_loads_the_unequal_widths_by_remote_code(job):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(job / "model"), trust_remote_code=True, device="cpu")
    assert type(model[0].auto_model).__name__ == "OsscarBertModel"
    _, expected = _ours(job, model.tokenizer)
    np.testing.assert_allclose(model.encode(SENTENCES), expected, rtol=0, atol=1e-5)


def test_optimum_feature_extraction_runs_the_shipped_graph(job):
    from optimum.onnxruntime import ORTModelForFeatureExtraction

    model = ORTModelForFeatureExtraction.from_pretrained(job / "model", subfolder="onnx")
    tokenizer = transformers.AutoTokenizer.from_pretrained(job / "model")
    hidden, _ = _ours(job, tokenizer)
    got = model(**tokenizer(SENTENCES, padding=True, return_tensors="pt")).last_hidden_state
    np.testing.assert_allclose(got.detach().numpy(), hidden, rtol=0, atol=1e-6)


def test_a_model_without_modules_is_not_a_sentence_model(tmp_path):
    (tmp_path / "src").mkdir()
    assert not copy_sentence_files(tmp_path / "src", tmp_path, hidden=32)
    assert not (tmp_path / "modules.json").exists()


def test_module_folders_outside_the_model_or_missing_are_refused(tmp_path):
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "../x", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "/etc", "type": "sentence_transformers.models.Dense"}]
    (source / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(LayoutError, match=r"outside the model directory: \.\./x, /etc"):
        copy_sentence_files(source, target, hidden=32)
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text("{}")
    (source / "modules.json").write_text(json.dumps([{**modules[1], "path": "1_Pooling"},
                                                     {**modules[1], "path": "2_Dense"}]))
    with pytest.raises(LayoutError, match="has no folder '2_Dense'"):
        copy_sentence_files(source, target, hidden=32)
    assert list(target.iterdir()) == []  # a refused layout leaves no modules.json naming what is not there


def test_a_pooling_of_another_width_is_refused(tmp_path):
    source = _sentence_model(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    with pytest.raises(LayoutError, match="pools 32 channels, the model has 64"):
        copy_sentence_files(source, tmp_path / "dst", hidden=64)
    assert copy_sentence_files(source, tmp_path / "dst", hidden=32)
    assert (tmp_path / "dst" / "2_Normalize").is_dir()  # absent from the source: it keeps nothing


def test_sentence_transformers_6_module_names_are_read(tmp_path):
    """sentence-transformers 6 writes `sentence_transformers.base.modules.normalize.Normalize` and a pooling config
    with `embedding_dimension`: its Normalize without a folder was refused (the job then shipped no modules, and
    the model loaded with another pooling and no normalisation) and its pooling width went unchecked."""
    source = _sentence_model(tmp_path / "src")
    modules = json.loads((source / "modules.json").read_text())
    for module in modules:
        name = module["type"].rsplit(".", 1)[-1]
        module["type"] = f"sentence_transformers.base.modules.{name.lower()}.{name}"
    (source / "modules.json").write_text(json.dumps(modules))
    pooling = source / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config["embedding_dimension"] = config.pop("word_embedding_dimension")
    pooling.write_text(json.dumps(config))
    (tmp_path / "dst").mkdir()
    with pytest.raises(LayoutError, match="pools 32 channels, the model has 64"):
        copy_sentence_files(source, tmp_path / "dst", hidden=64)
    assert copy_sentence_files(source, tmp_path / "dst", hidden=32)
    assert (tmp_path / "dst" / "2_Normalize").is_dir()


@pytest.mark.parametrize("config, pooling", [
    ({"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"word_embedding_dimension": 32, "pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, "max"),
    ({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, "mean"),
    ({"embedding_dimension": 32, "pooling_mode": "cls"}, "cls"),  # sentence-transformers 6
    ({"embedding_dimension": 32, "pooling_mode": "lasttoken"}, "lasttoken"),  # a decoder's (Qwen3-Embedding)
    ({"word_embedding_dimension": 32, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "lasttoken"),
    ({"embedding_dimension": 32, "pooling_mode": "weightedmean"}, "mean"),  # approximated by the mean
])
def test_the_pooling_a_sentence_model_serves_is_read(tmp_path, config, pooling):
    source = _sentence_model(tmp_path / "src")
    (source / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert sentence_pooling(source) == pooling
    assert sentence_pooling(tmp_path) == "mean"  # not a sentence model


def test_the_graph_and_its_external_data_are_linked_into_onnx(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"graph")
    (tmp_path / "model.onnx.data").write_bytes(b"weights")
    path = link_onnx(tmp_path / "model.onnx", tmp_path / "model")
    assert path == tmp_path / "model" / "onnx" / "model.onnx"
    assert os.path.samefile(path, tmp_path / "model.onnx")
    assert (path.parent / "model.onnx.data").read_bytes() == b"weights"
    assert link_onnx(tmp_path / "model.onnx", tmp_path / "model") == path  # again: replaced, not refused


def test_an_image_classifier_job_loads_as_optimums_image_classifier(tmp_path):
    """A Hugging Face CNN's job: config.json (labels) and its preprocessing beside model.onnx, so the job's
    directory is what ORTModelForImageClassification loads."""
    from optimum.onnxruntime import ORTModelForImageClassification

    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10,
                                       image_size=32, id2label={i: f"class {i}" for i in range(10)})
    torch.manual_seed(0)
    transformers.ResNetForImageClassification(config).save_pretrained(tmp_path / "resnet")
    (tmp_path / "resnet" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 32}, "crop_pct": 1.0}))
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).integers(0, 256, (200, 32, 32, 3), dtype=np.uint8))
    out = tmp_path / "out"
    _compress(tmp_path / "resnet", out, "--calibration", str(tmp_path / "cal.npz"))
    serving = json.loads((out / "report.json").read_text())["artifacts"]["serving"]
    assert serving == {"onnx": "model.onnx", "optimum": "ORTModelForImageClassification",
                       "files": ["config.json", "preprocessor_config.json"]}
    model = ORTModelForImageClassification.from_pretrained(out)
    assert model.config.id2label[3] == "class 3"
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    expected = ort.InferenceSession(str(out / "model.onnx")).run(None, {"pixel_values": x})[0]
    np.testing.assert_allclose(model(pixel_values=torch.from_numpy(x)).logits.numpy(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["vit", "deit"])
def test_a_vision_transformer_classifier_keeps_its_head_and_loads_as_optimums_classifier(tmp_path, family):
    """ViTForImageClassification and DeiT with its distillation head were loaded as their base models: the head
    dropped, a random pooler added, the labels of --eval unused. Now model.onnx gives the logits, scored by top-1
    on labelled images; Optimum's ORTModelForImageClassification (model/onnx/, the preprocessing beside it) and
    transformers (its remote code) give the same logits."""
    from optimum.onnxruntime import ORTModelForImageClassification

    fields = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8, num_labels=5, id2label={i: f"class {i}" for i in range(5)})
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(**fields)) if family == "vit" else \
        transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(**fields))
    model.save_pretrained(tmp_path / "source")
    (tmp_path / "source" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32}}))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8))
    np.savez(tmp_path / "eval.npz", x=rng.integers(0, 256, (80, 32, 32, 3), dtype=np.uint8), y=rng.integers(0, 5, 80))
    out = tmp_path / "out"
    _compress(tmp_path / "source", out, "--calibration", str(tmp_path / "cal.npz"), "--eval",
              str(tmp_path / "eval.npz"))
    report = json.loads((out / "report.json").read_text())
    assert report["metric"]["name"] == "top1" and {"agreement", "cosine"} <= set(report["metric"]["secondary"])
    assert report["onnx_output"] == "logits"
    assert report["artifacts"]["serving"] == {"onnx": "model/onnx/model.onnx",
                                              "optimum": "ORTModelForImageClassification", "trust_remote_code": True}
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    expected = ort.InferenceSession(str(out / "model.onnx")).run(None, {"pixel_values": x})[0]
    assert expected.shape == (2, 5)
    optimum = ORTModelForImageClassification.from_pretrained(out / "model", subfolder="onnx")
    assert optimum.config.id2label[3] == "class 3"
    np.testing.assert_allclose(optimum(pixel_values=torch.from_numpy(x)).logits.numpy(), expected, rtol=0, atol=1e-6)
    pruned = transformers.AutoModelForImageClassification.from_pretrained(out / "model", trust_remote_code=True)
    assert not any(name.startswith(("vit.pooler", "deit.pooler")) for name, _ in pruned.named_parameters())
    with torch.no_grad():
        np.testing.assert_allclose(pruned.eval()(pixel_values=torch.from_numpy(x)).logits.numpy(), expected, rtol=0,
                                   atol=1e-5)


def test_an_encoder_classifier_keeps_its_head_and_loads_as_optimums_classifier(tmp_path):
    """A BertForSequenceClassification directory is pruned with its head: model.onnx gives its logits, scored
    by top-1 agreement with the dense model; Optimum's ORTModelForSequenceClassification (model/onnx/) and
    transformers (its remote code) give the same logits."""
    from optimum.onnxruntime import ORTModelForSequenceClassification

    source = default_model_path()
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=24, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([10.0, 0.0, 0.0]))  # class 0 everywhere: a weak agreement
    model.save_pretrained(tmp_path / "classifier")
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, tmp_path / "classifier" / name)
    (tmp_path / "c.txt").write_text("\n\n".join(calibration_texts(64)))
    out = tmp_path / "out"
    _compress(tmp_path / "classifier", out, "--calibration", str(tmp_path / "c.txt"), "--sequence-length", "32",
              "--sequences", "64")
    report = json.loads((out / "report.json").read_text())
    assert report["metric"]["name"] == "agreement" and "cosine" in report["metric"]["secondary"]
    assert any("predicts class 0 for 100% of the" in w for w in report["warnings"]), report["warnings"]
    assert report["artifacts"]["serving"] == {"onnx": "model/onnx/model.onnx", "sentence_transformers": False,
                                              "optimum": "ORTModelForSequenceClassification",
                                              "trust_remote_code": True}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    tokens = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert [o.name for o in session.get_outputs()] == ["logits"]
    expected = session.run(None, {k: v.numpy() for k, v in tokens.items()})[0]
    assert expected.shape == (len(SENTENCES), 3)
    optimum = ORTModelForSequenceClassification.from_pretrained(out / "model", subfolder="onnx")
    np.testing.assert_allclose(optimum(**tokens).logits.detach().numpy(), expected, rtol=0, atol=1e-6)
    pruned = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model", trust_remote_code=True)
    with torch.no_grad():
        np.testing.assert_allclose(pruned.eval()(**tokens).logits.numpy(), expected, rtol=0, atol=1e-5)
