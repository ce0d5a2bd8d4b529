"""The client side of the service: Ctrl-C on `osscar compress --server` (real subprocesses, a real SIGINT to
the process group as a terminal sends it) and `osscar operations list|get|watch|cancel|download`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from google.rpc import code_pb2

from service.api import compression_pb2 as pb
from service.api.wire import unpack_metadata
from service.client import cli
from tests.compressor.cnn.conv_models import write_conv_job
from tests.service.client.fakes import Unavailable
from tests.service.server_process import ROOT, ServerProcess


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_conv_job(tmp_path_factory.mktemp("client-data"), size=32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("client") / "home").start()
    yield process
    assert process.stop() == 0


def compress_args(data: Path, out: Path, repeats: int) -> list[str]:
    return ["compress", str(data / "model.pt2"), "--uniform-ratio", "0.5", "--calibration", str(data / "cal.npz"),
            "--samples", "16", "--repeats", str(repeats), "--accuracy-budget", "none", "--out", str(out)]


def interrupt_when(args: list[str], ready: str, after: str | None = None,
                   terminate: bool = False) -> tuple[int, list[str], list[str]]:
    """Run `osscar ARGS` in its own session, send SIGINT to its whole process group (what Ctrl-C on a
    terminal does) once a stderr line contains `ready` (and then one contains `after`); returns the exit
    code, the stderr lines before the signal and those after it. `terminate`: SIGTERM to the process alone
    instead (what `timeout`, `docker stop` or a CI's cancel send)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # a suite started in the background by a non-interactive shell (`cmd &`) has SIGINT ignored, and an
    # ignored signal stays ignored across exec: the CLI would never see the Ctrl-C. A handled one is reset
    # to the default at exec, where Python installs its KeyboardInterrupt handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen([sys.executable, "-m", "service.client.cli", *args], cwd=ROOT, env=env, text=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    before, waiting = [], [w for w in (ready, after) if w]
    try:
        for line in process.stderr:
            before.append(line.rstrip("\n"))
            if waiting and waiting[0] in line:
                waiting.pop(0)
            if not waiting:
                break
        assert not waiting, f"never saw {waiting}:\n" + "\n".join(before[-30:])
        if terminate:
            os.kill(process.pid, signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGINT)
        rest = process.stderr.read()
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return code, before, [line for line in rest.splitlines() if line.strip()]


def operation_name(lines: list[str]) -> str:
    return next(line.split(":")[0] for line in lines if line.startswith("operations/"))


def test_ctrl_c_leaves_the_job_running_and_says_how_to_follow_or_cancel_it(server, data, tmp_path, capsys):
    code, before, after = interrupt_when([*compress_args(data, tmp_path / "out", 3000), "--server", server.address],
                                         "operations/", "measure")
    name = operation_name(before)
    assert code == 130
    assert after[0] == f"osscar: interrupted; {name} keeps running on {server.address}"
    commands = "\n".join(after[1:])
    assert f"osscar operations watch {name} --server {server.address}" in commands
    assert f"osscar operations cancel {name} --server {server.address}" in commands
    assert f"osscar operations download {name} --server {server.address} --out {tmp_path / 'out'}" in commands
    assert not server.get(name).done  # still running on the server
    mark = json.loads((tmp_path / "out" / ".osscar-request.json").read_text())
    assert mark["operation"] == name  # what the same command, run again, follows
    # the printed command cancels it
    assert cli.main(["operations", "cancel", name, "--server", server.address]) == 0
    assert capsys.readouterr().err.strip() == f"cancelled {name}"
    final = server.wait_done(name, timeout=60)
    assert final.error.code == code_pb2.CANCELLED
    # the same command again is the same job (here cancelled), not a second one; its mark and the folder made
    # for it go once the job is delivered
    assert cli.main([*compress_args(data, tmp_path / "out", 3000), "--server", server.address]) == 2
    err = capsys.readouterr().err
    assert f"following {name} that an earlier run of this command submitted" in err
    assert f"{name}: cancelled on {server.address}" in err and f"{name} failed: CANCELLED" in err
    assert not (tmp_path / "out").exists()


def test_cancel_on_interrupt_cancels_the_job(server, data, tmp_path):
    code, before, after = interrupt_when([*compress_args(data, tmp_path / "out", 3000), "--server", server.address,
                                          "--cancel-on-interrupt"], "operations/", "measure")
    name = operation_name(before)
    assert code == 130 and after == [f"osscar: interrupted; cancelled {name}"]
    assert unpack_metadata(server.wait_done(name, timeout=60)).state == pb.CANCELLED
    assert not (tmp_path / "out").exists()  # nothing was downloaded


def test_operations_list_get_watch_and_download(server, data, tmp_path, capsys):
    request = pb.CompressRequest(model=str(data / "model.pt2"), calibration=str(data / "cal.npz"),
                                 uniform_ratio=0.5, request_id=str(uuid.uuid4()), labels={"suite": "ops-cli"},
                                 no_accuracy_budget=True)
    request.options.samples = 16
    request.options.repeats = 15
    name = server.compression.Compress(request, timeout=30).name
    flags = ["--server", server.address]

    # the tiny model can measure slower than dense on a loaded machine (slower_than_dense, exit 2, artifacts
    # kept): the commands must say whichever it was
    final = server.wait_done(name)
    state = pb.State.Name(unpack_metadata(final).state)
    assert state in ("SUCCEEDED", "FAILED")
    expected = 0 if state == "SUCCEEDED" else 2

    assert cli.main(["operations", "watch", name, *flags]) == expected
    out = capsys.readouterr().out
    assert f"name               {name}" in out and f"state              {state}" in out
    assert ("measured speedup" in out) if state == "SUCCEEDED" else ("error              FAILED_PRECONDITION" in out)

    assert cli.main(["operations", "list", "--filter", 'labels.suite = "ops-cli"', *flags]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].split()[:4] == ["NAME", "STATE", "PROGRESS", "CREATED"]
    assert len(rows) == 2 and rows[1].split()[:3] == [name, state, "done"]

    assert cli.main(["operations", "get", name, "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == name

    assert cli.main(["operations", "download", name, *flags, "--out", str(tmp_path / "got")]) == expected
    captured = capsys.readouterr()
    assert "status             ok" in captured.out if expected == 0 else f"{name} failed" in captured.err
    assert {p.name for p in (tmp_path / "got").iterdir()} == {"model.onnx", "model.pt2", "report.json",
                                                              "report.html", "manifest.json"}
    from service.files import umask

    # what a serving process running as another user reads: the umask's mode, not the temporary files' 0600
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "got").iterdir()} == \
        dict.fromkeys(["model.onnx", "model.pt2", "report.json", "report.html", "manifest.json"], 0o666 & ~umask())

    # a finished job cannot be cancelled: exit 2 with the server's reason
    assert cli.main(["operations", "cancel", name, *flags]) == 2
    assert "FAILED_PRECONDITION" in capsys.readouterr().err

    # Ctrl-C during a download of an ended job says so (not that the job "keeps running"), and how to resume
    from service.client import operations

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    original, operations.deliver = operations.deliver, cut
    try:
        assert cli.main(["operations", "download", name, *flags, "--out", str(tmp_path / "cut")]) == 130
    finally:
        operations.deliver = original
    err = capsys.readouterr().err
    assert f"{name} has ended" in err and "resumes the download" in err and "keeps running" not in err

    # the list piped into a reader that stops early (`| head`): no BrokenPipeError traceback
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "service.client.cli", "operations", "list", *flags], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the first line
    assert process.wait(120) == 0
    assert b"BrokenPipe" not in process.stderr.read()


def test_operations_on_an_unknown_name_exit_2_with_not_found(server, capsys):
    assert cli.main(["operations", "get", "operations/nope", "--server", server.address]) == 2
    assert capsys.readouterr().err.startswith("osscar: error: NOT_FOUND")


def test_operations_without_a_server_say_so(capsys):
    assert cli.main(["operations", "list", "--server", "127.0.0.1:9", "--connect-timeout", "1"]) == 2
    assert "cannot reach an osscar server at 127.0.0.1:9" in capsys.readouterr().err


def test_a_value_that_does_not_fit_the_wire_is_one_line_before_anything_is_uploaded(server, data, tmp_path, capsys):
    """`--seed 3000000000` (the API's seed is an int32) with `--upload`: exit 2 with one line naming the flag,
    no traceback, and no upload sent first."""
    args = [*compress_args(data, tmp_path / "out", 3), "--seed", "3000000000", "--upload", "--server", server.address]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--seed must be in [0, 2^31 - 1] (got 3000000000)" in err and "Traceback" not in err
    assert "uploading" not in err


@pytest.mark.parametrize("extra, words", [
    (["--shape", "batc=8"], "--shape takes batch=N and sequence=N"),
    (["--shape", "batch=0"], "--shape takes batch=N and sequence=N"),
    (["--time-budget", "inf"], "--time-budget must be a positive number of seconds"),
    (["--request-id", "not-a-uuid"], "request_id: must be a UUID"),
    (["--label", "Suite=x"], "label keys are lowercase letters"),
])
def test_values_a_local_run_refuses_are_one_line_before_anything_is_uploaded(server, data, tmp_path, capsys, extra,
                                                                             words):
    """What a local run refuses in one line was a traceback (an unknown --shape key, an infinite budget) or was
    silently ignored (batch=0 reads as unset on the wire) with --server."""
    args = [*compress_args(data, tmp_path / "out", 3), *extra, "--upload", "--server", server.address]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "uploading" not in err


def test_files_an_upload_cannot_send_are_refused_before_the_first_upload(server, data, tmp_path, capsys):
    """A missing --calibration was found after the model's upload (gigabytes sent for nothing), and a name that is
    not ASCII was refused by the server with another reason ("without separators")."""
    import shutil

    args = compress_args(data, tmp_path / "out", 3)
    missing = [*args[:args.index("--calibration") + 1], str(tmp_path / "nocal.npz"),
               *args[args.index("--calibration") + 2:]]
    assert cli.main([*missing, "--upload", "--server", server.address]) == 2
    err = capsys.readouterr().err
    assert f"--upload: no such file or directory: {tmp_path / 'nocal.npz'}" in err and "uploading" not in err
    shutil.copy(data / "model.pt2", tmp_path / "modèle.pt2")
    accented = [args[0], str(tmp_path / "modèle.pt2"), *args[2:]]
    assert cli.main([*accented, "--upload", "--server", server.address]) == 2
    err = capsys.readouterr().err
    assert "modèle.pt2: an uploaded file keeps its name, which must be ASCII" in err and "uploading" not in err
    assert not (tmp_path / "out").exists()  # no mark of a request that was never sent, nor a folder made for it


def test_a_run_again_after_a_lost_submit_reuses_its_uploads(data, tmp_path, monkeypatch, capsys):
    """The command run again (its client killed, the connection lost before the server answered) found the earlier
    job only after uploading every input again: gigabytes of a large model sent a second time. The mark is of the
    local files now, and keeps their blob references: the second run sends nothing and submits the same request."""
    from service.client import remote

    sent, submitted = [], []

    class Client:
        def upload(self, path):
            sent.append(Path(path).name)
            return f"blob:sha256:{len(sent):064d}/{Path(path).name}"

        def submit(self, request):
            submitted.append((request.request_id, request.model, request.calibration))
            raise Unavailable()

        def close(self):
            pass

    monkeypatch.setattr(remote, "connect", lambda args: Client())
    args = [*compress_args(data, tmp_path / "out", 3), "--upload", "--server", "127.0.0.1:1"]
    assert cli.main(args) == 2 and sent == ["model.pt2", "cal.npz"]
    assert "running this command again submits the same job" in capsys.readouterr().err
    assert cli.main(args) == 2 and sent == ["model.pt2", "cal.npz"]  # nothing sent again
    assert "sent by an earlier run of this command" in capsys.readouterr().err
    assert len(submitted) == 2 and submitted[0] == submitted[1]  # the same request id and blobs
    (data / "cal.npz").touch()  # a file changed in place: another job, its files sent again
    assert cli.main(args) == 2 and sent[2:] == ["model.pt2", "cal.npz"] and submitted[2][0] != submitted[0][0]


def test_an_out_that_is_a_file_is_refused_before_the_job_runs(server, data, tmp_path, capsys):
    (tmp_path / "out").write_text("a file")
    assert cli.main([*compress_args(data, tmp_path / "out", 3), "--server", server.address]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a file" in err and "operations/" not in err  # nothing was submitted


def test_a_download_that_fails_after_the_job_ended_says_how_to_download_it_again(server, data, tmp_path, capsys,
                                                                                 monkeypatch):
    """The server went away during the download of a finished job: exit 2 with one line that says the job has
    ended and the command that fetches its artifacts, not the bare UNAVAILABLE of a call."""
    from service.client import remote

    def cut(*args):
        raise Unavailable("connection reset")

    monkeypatch.setattr(remote, "deliver", cut)
    out = tmp_path / "out"
    assert cli.main([*compress_args(data, out, 3), "--server", server.address]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("osscar: error:")]
    assert "has ended, but downloading its artifacts failed (UNAVAILABLE: connection reset)" in line
    assert "osscar operations download operations/" in line and f"--server {server.address} --out {out}" in line
