"""The remote client's delivery of a finished operation into --out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from google.longrunning import operations_pb2

from service.client import transport
from tests.service.client.fakes import ModelDownloads, Unavailable


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


def test_a_users_model_folder_in_out_is_refused_before_the_job_and_kept_at_its_delivery(tmp_path, monkeypatch):
    """A remote job's delivery replaced out/model/ whole, a folder no job wrote (a local job refuses it): refused by
    check_out before the job runs, unless an earlier job's report names it or it is the job's input; one made while
    the job ran stops the delivery with the user's files kept and the artifacts staged."""

    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "my_notes.txt").write_text("mine")
    with pytest.raises(transport.ClientError, match="its model/ folder is no earlier job's"):
        transport.check_out(out)
    transport.check_out(out, inputs=[out / "model", None])  # the job's own input: read, never removed
    (out / "report.json").write_text('{"artifacts": {"model": "model/"}}')
    transport.check_out(out)  # an earlier job's pruned model: replaced
    (out / "report.json").unlink()

    pruned = tmp_path / "pruned"
    pruned.mkdir()
    (pruned / "config.json").write_text("{}")
    artifacts = [SimpleNamespace(name="model.tar"), SimpleNamespace(name="report.json")]
    monkeypatch.setattr(transport, "unpack_metadata", lambda op: SimpleNamespace(artifacts=artifacts))

    with pytest.raises(transport.ClientError, match="the downloaded artifacts wait in"):
        transport.deliver(ModelDownloads(pruned / "config.json"), operations_pb2.Operation(name="operations/m",
                                                                                            done=True), out)
    assert (out / "model" / "my_notes.txt").read_text() == "mine" and not (out / "report.json").exists()
    (out / "model" / "my_notes.txt").rename(tmp_path / "moved.txt")
    (out / "model").rmdir()
    transport.deliver(ModelDownloads(pruned / "config.json"), operations_pb2.Operation(name="operations/m", done=True),
                      out)
    assert (out / "model" / "config.json").is_file() and (out / "report.json").is_file()


def test_a_delivery_removes_the_other_kind_of_an_earlier_jobs_pruned_model(tmp_path, monkeypatch):
    """A CNN job's model.pt2, then a transformer job's model/ into the same --out: the stale model.pt2 stayed beside
    the new model, a mix of two jobs (a local job removes it); a failed job's delivery (no model) removes an
    earlier job's model/ too. The job's own input stays."""

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt2").write_text("an earlier CNN job's")
    (tmp_path / "cfg.json").write_text("{}")
    returned = {"artifacts": [SimpleNamespace(name="model.tar"), SimpleNamespace(name="report.json")]}
    monkeypatch.setattr(transport, "unpack_metadata", lambda op: SimpleNamespace(artifacts=returned["artifacts"]))
    client = ModelDownloads(tmp_path / "cfg.json")
    transport.deliver(client, operations_pb2.Operation(name="operations/t", done=True), out,
                      inputs=[out / "model.pt2"])  # read by this job: kept
    assert (out / "model.pt2").is_file() and (out / "model" / "config.json").is_file()
    transport.deliver(client, operations_pb2.Operation(name="operations/u", done=True), out)
    assert sorted(p.name for p in out.iterdir()) == ["model", "report.json"]
    returned["artifacts"] = [SimpleNamespace(name="report.json")]  # parity failed: its report alone
    transport.deliver(client, operations_pb2.Operation(name="operations/v", done=True), out)
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]


def test_a_cancel_that_fails_on_interrupt_says_the_job_is_not_cancelled():
    """--cancel-on-interrupt whose cancel fails (the server away, the job done meanwhile): the request's mark must
    stay, so the printed advice (run the command again) follows the job instead of submitting a second one."""
    import argparse

    from service.client.remote import interrupted

    def client(fails: bool):
        def cancel(request, timeout=None, metadata=None):
            if fails:
                raise Unavailable()

        return SimpleNamespace(operations=SimpleNamespace(CancelOperation=cancel), timeout=1.0, metadata=())

    args = argparse.Namespace(cancel_on_interrupt=True, server="127.0.0.1:1", out_dir="out", request_id="r",
                              tls_ca=None, tls_cert=None, tls_key=None, token_file=None)
    assert interrupted(client(False), "operations/a", args) is True
    assert interrupted(client(True), "operations/a", args) is False


def test_a_watch_whose_server_stays_away_says_so_and_ends(monkeypatch, capsys):
    """The server gone (killed, its node down): the watch waited in silence for as long as it stayed away, whatever
    --timeout said. It says once that it reconnects, goes on when the server is back, and ends with a ClientError
    naming the job once the server stayed away for `reconnect_s`."""
    from service.api import compression_pb2 as pb

    monkeypatch.setattr(transport.time, "sleep", lambda s: None)
    client = transport.RemoteCompressor("127.0.0.1:1", timeout_s=1.0)
    events = [Unavailable(), Unavailable(), [pb.CompressionEvent(stage="done", operation=operations_pb2.Operation(
        name="operations/w", done=True))]]

    def watch(request, wait_for_ready=None, metadata=None):
        event = events.pop(0)
        if isinstance(event, Exception):
            raise event
        return iter(event)

    client.stub = SimpleNamespace(WatchCompression=watch)
    monkeypatch.setattr(client, "wait_ready", lambda timeout_s: None)  # back after a while
    assert client.follow("operations/w", print).done
    err = capsys.readouterr().err
    assert err.count("lost the connection to 127.0.0.1:1 while following operations/w") == 1
    assert "reconnected; following operations/w" in err

    events[:] = [Unavailable()] * 100
    monkeypatch.undo()
    monkeypatch.setattr(transport.time, "sleep", lambda s: None)
    with pytest.raises(transport.ClientError, match="stayed unreachable for 1s; the job may still be running"):
        client.follow("operations/w", print, reconnect_s=1.0)
    client.close()


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


def test_a_delivery_cut_short_leaves_the_earlier_jobs_files_and_the_next_one_resumes(tmp_path, monkeypatch):
    """Ctrl-C (or a killed client) during the second download: --out still holds the earlier job's files, not the
    new job's first artifacts beside the earlier one's others; delivering the operation again fetches only what
    was missing and leaves no staging folder."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    for name in ("model.onnx", "report.json", "model/config.json"):
        (out / name).write_text("earlier")
    artifacts = [SimpleNamespace(name="manifest.json"), SimpleNamespace(name="model.onnx"),
                 SimpleNamespace(name="report.json")]
    monkeypatch.setattr(transport, "unpack_metadata", lambda op: SimpleNamespace(artifacts=artifacts))
    fetched: list[str] = []

    class Client:
        def __init__(self, cut_at: str | None = None) -> None:
            self.cut_at = cut_at

        def download(self, name: str, artifact, into: Path) -> Path:
            if (into / artifact.name).exists():  # the real client keeps a file it already has
                return into / artifact.name
            if artifact.name == self.cut_at:
                raise KeyboardInterrupt
            fetched.append(artifact.name)
            (into / artifact.name).write_text("this job's")
            return into / artifact.name

    op = operations_pb2.Operation(name="operations/new", done=True)
    with pytest.raises(KeyboardInterrupt):
        transport.deliver(Client(cut_at="model.onnx"), op, out)
    assert {p.name: p.read_text() for p in out.rglob("*") if p.is_file() and ".osscar-download-" not in str(p)} == \
        {"model.onnx": "earlier", "report.json": "earlier", "config.json": "earlier"}
    transport.deliver(Client(), op, out)
    assert fetched == ["manifest.json", "model.onnx", "report.json"]  # manifest.json once
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model", "model.onnx", "report.json"]
    assert (out / "model.onnx").read_text() == "this job's"


def test_a_refusal_says_each_field_violation_once():
    """INVALID_ARGUMENT's message is its violations joined: printed with the BadRequest lines, each said twice."""
    import grpc
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2

    violations = [("request_id", "must be a UUID (got 'x')"), ("options.seed", "--seed must be in [0, 2^31 - 1]")]
    message = "; ".join(f"{f}: {d}" for f, d in violations)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message, details=[detail])

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return message

        def trailing_metadata(self):
            return (("grpc-status-details-bin", status.SerializeToString()),)

    text = transport.describe_error(Refused())
    assert text.splitlines() == ["INVALID_ARGUMENT: the request is invalid", "  request_id: must be a UUID (got 'x')",
                                 "  options.seed: --seed must be in [0, 2^31 - 1]"]


def test_two_deliveries_into_one_out_take_turns(tmp_path, monkeypatch, capsys):
    """The same command run twice at once (or two jobs given one --out): the second waits until the first has moved
    its files into place instead of resuming the first's partial files and removing its staging folder."""
    import fcntl
    import os
    import threading

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(transport, "unpack_metadata",
                        lambda op: SimpleNamespace(artifacts=[SimpleNamespace(name="model.onnx")]))
    started = threading.Event()

    class Client:
        def download(self, name: str, artifact, into: Path) -> Path:
            started.set()
            (into / artifact.name).write_text(name)
            return into / artifact.name

    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # another client holds the folder
    fcntl.flock(fd, fcntl.LOCK_EX)
    second = threading.Thread(target=transport.deliver,
                              args=(Client(), operations_pb2.Operation(name="operations/b", done=True), out))
    second.start()
    assert not started.wait(1.0) and not any(out.iterdir())  # nothing written while the other holds it
    os.close(fd)
    second.join(10)
    assert not second.is_alive() and (out / "model.onnx").read_text() == "operations/b"
    assert "another osscar command is writing into" in capsys.readouterr().err


def test_artifact_names_that_are_not_plain_file_names_are_refused_before_any_download(tmp_path, monkeypatch):
    """A server (compromised, or a man in the middle of a plaintext channel) names the artifacts: `./../x` became a
    path outside --out that the client wrote, then moved into --out. Only plain names are taken, none hidden."""
    out = tmp_path / "proj" / "out"
    for name in ("./../../.bashrc", "../x", ".osscar-request.json", "a/b"):
        monkeypatch.setattr(transport, "unpack_metadata",
                            lambda op, name=name: SimpleNamespace(artifacts=[SimpleNamespace(name=name)]))

        class Client:
            def download(self, *args):
                raise AssertionError("nothing may be downloaded")

        with pytest.raises(transport.ClientError, match="not plain file names"):
            transport.deliver(Client(), operations_pb2.Operation(name="operations/e", done=True), out)
    assert not (tmp_path / "proj").exists() and not (tmp_path / ".bashrc").exists()


def test_the_same_command_after_its_inputs_changed_is_another_job(tmp_path):
    """The mark that lets a re-run follow the job an earlier, killed run submitted: a model changed in place (same
    path, new bytes) made the same command follow the old job and deliver a model of weights that no longer exist."""
    import os

    from service.api import compression_pb2 as pb
    from service.client.remote import RequestMark

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"old weights")
    request = pb.CompressRequest(model=str(model), calibration="embedded:calibration.txt", uniform_ratio=0.5)
    out = tmp_path / "out"
    RequestMark(out, "host:1", request).write("11111111-1111-1111-1111-111111111111", "operations/old")
    assert RequestMark(out, "host:1", request).earlier()["operation"] == "operations/old"  # unchanged: followed
    stat = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes(b"new weights")  # same size, and the same mtime restored
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert RequestMark(out, "host:1", request).earlier() is None


def test_the_commands_a_client_suggests_quote_their_paths():
    """A path with a space in --out or a TLS flag broke the printed command when copied and pasted."""
    import argparse
    import shlex

    from service.client.remote import follow_up

    args = argparse.Namespace(server="127.0.0.1:50051", out_dir="my out", tls_ca="ca dir/ca.pem", tls_cert=None,
                              tls_key=None, token_file=None)
    download = follow_up("operations/q", args).splitlines()[1].split("download:", 1)[1]
    assert shlex.split(download) == ["osscar", "operations", "download", "operations/q", "--server",
                                     "127.0.0.1:50051", "--tls-ca", "ca dir/ca.pem", "--out", "my out"]
