"""The remote client's delivery of a finished operation into --out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from google.longrunning import operations_pb2

from service.client import transport


def test_a_delivery_replaces_an_earlier_jobs_outputs_in_a_reused_out(tmp_path, monkeypatch):
    """A decoder's job with its decode step, then one that returns model.onnx and its report only: the earlier
    decode.onnx, genai_config.json and report.html go, and the serving files its report lists (an image
    classifier's config.json beside model.onnx); files that are no job's output stay, and so does an earlier
    pruned model (model/, model.pt2: it may be this job's input)."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    for name in ("decode.onnx", "genai_config.json", "report.html", "model.onnx", "notes.txt", "config.json",
                 "preprocessor_config.json"):
        (out / name).write_text("earlier")
    (out / "model" / "config.json").write_text("earlier")
    # an image classifier's labels and preprocessing, which its report lists as its own
    (out / "report.json").write_text('{"artifacts": {"serving": {"files": ["config.json", '
                                     '"preprocessor_config.json"]}}}')
    artifacts = [SimpleNamespace(name="model.onnx"), SimpleNamespace(name="report.json")]
    monkeypatch.setattr(transport, "unpack_metadata", lambda op: SimpleNamespace(artifacts=artifacts))

    class Client:
        def download(self, name: str, artifact, into: Path) -> Path:
            (into / artifact.name).write_text("this job's")
            return into / artifact.name

    kept = out / "config.json"
    kept.rename(tmp_path / "kept.json")  # a job whose model is --out itself keeps its listed files (below)
    transport.deliver(Client(), operations_pb2.Operation(name="operations/b", done=True), out)
    assert sorted(p.name for p in out.iterdir()) == ["model", "model.onnx", "notes.txt", "report.json"]
    assert (out / "model.onnx").read_text() == "this job's"
    (tmp_path / "kept.json").rename(kept)
    (out / "report.json").write_text('{"artifacts": {"serving": {"files": ["config.json"]}}}')
    transport.deliver(Client(), operations_pb2.Operation(name="operations/c", done=True), out, inputs=[out, None])
    assert kept.read_text() == "earlier"


def test_an_upload_of_a_folder_takes_the_files_of_its_linked_folders(tmp_path):
    """A Hugging Face snapshot links files, and a user's folder may link folders: Path.rglob does not enter those,
    whose files were missing from the tar; a folder reached twice (a loop) is refused."""
    import tarfile

    import pytest

    from service.files import ArchiveError, write_tar

    shared, model = tmp_path / "shared", tmp_path / "model"
    (shared / "sub").mkdir(parents=True)
    (shared / "sub" / "weights.bin").write_bytes(b"w")
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer").symlink_to(shared)
    write_tar(model, tmp_path / "m.tar", follow_symlinks=True)
    with tarfile.open(tmp_path / "m.tar") as tar:
        assert "tokenizer/sub/weights.bin" in tar.getnames()
    (shared / "back").symlink_to(model)
    with pytest.raises(ArchiveError, match="again"):
        write_tar(model, tmp_path / "loop.tar", follow_symlinks=True)


def test_a_tls_key_without_its_certificate_is_refused(tmp_path):
    import pytest

    key = tmp_path / "client.key"
    key.write_text("not used")
    with pytest.raises(transport.ClientError, match="go together"):
        transport.RemoteCompressor("127.0.0.1:1", tls_key=key)
