"""Security of the service: TLS, mTLS and bearer tokens, the bind rule, the reference policy and a table
of hostile inputs — each refused with the right status, the server alive, nothing written."""

from __future__ import annotations

import json
import os
import pickle
import re
import uuid
from pathlib import Path

import grpc
import pytest
from google.longrunning import operations_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api import compression_pb2 as pb
from service.api import compression_pb2_grpc as pb_grpc
from service.api.wire import error_details
from service.client import cli
from service.server.settings import ServerSettings
from tests.compressor.cnn.conv_models import write_conv_job
from tests.service.certs import make_pki
from tests.service.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[3]
SERVING = health_pb2.HealthCheckResponse.SERVING
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("secure-data")
    return write_conv_job(root, size=32)


# ---- settings and the bind rule ----------------------------------------------------------------------


def test_a_public_bind_needs_tls_and_auth_unless_insecure(tmp_path, monkeypatch):
    monkeypatch.delenv("OSSCAR_TOKENS", raising=False)
    with pytest.raises(ValueError, match=r"refusing to serve on 0\.0\.0\.0"):
        ServerSettings(host="0.0.0.0")
    pki = make_pki(tmp_path)
    with pytest.raises(ValueError, match="refusing"):  # TLS alone is not authentication
        ServerSettings(host="0.0.0.0", tls_cert=pki["server"], tls_key=pki["server_key"])
    assert ServerSettings(host="0.0.0.0", insecure=True).insecure
    assert ServerSettings(host="0.0.0.0", tls_cert=pki["server"], tls_key=pki["server_key"], tokens=TOKEN).tls
    mtls = ServerSettings(host="::", tls_cert=pki["server"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    assert mtls.authenticated and not mtls.loopback


def test_the_cli_refuses_a_public_bind_with_one_line(capsys, monkeypatch):
    monkeypatch.delenv("OSSCAR_TOKENS", raising=False)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "refusing to serve on 0.0.0.0" in capsys.readouterr().err


def test_environment_variables_configure_and_flags_override(tmp_path, monkeypatch):
    monkeypatch.setenv("OSSCAR_MAX_QUEUE", "7")
    monkeypatch.setenv("OSSCAR_ALLOWED_ROOTS", f"{tmp_path},/data")
    monkeypatch.setenv("OSSCAR_TOKENS", "tok-alpha, tok-beta")
    settings = ServerSettings()
    assert settings.max_queue == 7 and settings.list_of("allowed_roots") == (str(tmp_path), "/data")
    assert settings.bearer_tokens() == {"tok-alpha", "tok-beta"}
    assert "tok-alpha" not in repr(settings)  # secrets stay out of logs
    assert ServerSettings(max_queue=3).max_queue == 3
    with pytest.raises(ValueError, match="unknown schemes"):
        ServerSettings(allowed_schemes="path,ftp")


def test_the_readme_documents_every_setting():
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"`OSSCAR_([A-Z_]+)`", readme))
    expected = {name.upper() for name in ServerSettings.model_fields}
    assert expected <= documented, sorted(expected - documented)


# ---- TLS, mTLS and tokens ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("pki")
    pki = make_pki(root)
    credentials = grpc.ssl_channel_credentials(pki["ca"].read_bytes(), pki["client_key"].read_bytes(),
                                               pki["client"].read_bytes())
    server = ServerProcess(root / "home", "--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]),
                           "--tls-client-ca", str(pki["ca"]), env={"OSSCAR_TOKENS": TOKEN},
                           credentials=credentials).start()
    yield server, pki
    assert server.stop() == 0


def _get_unknown(channel: grpc.Channel, metadata=()):
    from google.longrunning import operations_pb2_grpc

    stub = operations_pb2_grpc.OperationsStub(channel)
    return stub.GetOperation(operations_pb2.GetOperationRequest(name=f"operations/{uuid.uuid4()}"), timeout=10,
                             metadata=metadata)


def test_tokens_are_checked_and_health_is_exempt(secure_server):
    server, _ = secure_server
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING  # no token needed
    for metadata, reason in (((), "TOKEN_MISSING"), ((("authorization", "Bearer wrong"),), "TOKEN_INVALID"),
                             ((("authorization", f"Basic {TOKEN}"),), "TOKEN_INVALID")):
        with pytest.raises(grpc.RpcError) as err:
            _get_unknown(server.channel, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_details(err.value)["error_info"].reason == reason and TOKEN not in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # streaming methods too
        list(server.compression.WatchCompression(pb.WatchCompressionRequest(name="operations/x"), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:  # authorised: the call itself answers
        _get_unknown(server.channel, (("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_plaintext_and_certificate_less_clients_are_refused(secure_server):
    server, pki = secure_server
    for channel in (grpc.insecure_channel(server.address),
                    grpc.secure_channel(server.address, grpc.ssl_channel_credentials(pki["ca"].read_bytes()))):
        with pytest.raises(grpc.RpcError) as err:
            _get_unknown(channel, (("authorization", f"Bearer {TOKEN}"),))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()


def test_the_cli_client_compresses_over_mtls_with_a_token(secure_server, data, tmp_path, capsys):
    server, pki = secure_server
    (tmp_path / "token").write_text(TOKEN + "\n")
    code = cli.main(["compress", str(data / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(data / "cal.npz"), "--samples", "16", "--repeats", "15", "--server", server.address,
                     "--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client"]), "--tls-key", str(pki["client_key"]),
                     "--token-file", str(tmp_path / "token"), "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "ok"


# ---- reference policy and hostile inputs -------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, data):
    """A server reading only from `allowed/`, with 1 MiB uploads and messages, no embedded references."""
    root = tmp_path_factory.mktemp("hostile")
    allowed = root / "allowed"
    allowed.mkdir()
    for name in ("model.pt2", "cal.npz"):
        (allowed / name).write_bytes((data / name).read_bytes())
    secret = root / "secret.pt2"
    secret.write_bytes((data / "model.pt2").read_bytes())
    (allowed / "escape.pt2").symlink_to(secret)
    tree = allowed / "hf"
    tree.mkdir()
    (tree / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tree / "model.safetensors").symlink_to(secret)
    pickled = allowed / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "bert"}))
    marker = root / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(Evil()))
    (allowed / "weights.pt").write_bytes(pickle.dumps(Evil()))
    os.mkfifo(allowed / "fifo.npz")
    server = ServerProcess(root / "home", "--allowed-roots", str(allowed), "--allowed-schemes", "path,blob",
                           "--max-upload-mb", "1", "--max-message-mb", "2").start()
    yield server, allowed, marker
    assert server.stop() == 0


def _request(allowed: Path, **fields) -> pb.CompressRequest:
    request = pb.CompressRequest(model=str(allowed / "model.pt2"), calibration=str(allowed / "cal.npz"),
                                 uniform_ratio=0.5, request_id=str(uuid.uuid4()))
    for key, value in fields.items():
        if key == "shape":
            request.shape.batch, request.shape.sequence = value
        elif key == "labels":
            request.labels.update(value)
        else:
            setattr(request, key, value(allowed) if callable(value) else value)
    return request


def _upload(size: int) -> list[pb.UploadBlobRequest]:
    header = pb.UploadBlobRequest(header=pb.BlobHeader(filename="big.npz"))
    return [header] + [pb.UploadBlobRequest(chunk=b"\x00" * (256 << 10)) for _ in range(size // (256 << 10))]


HOSTILE = [
    ("traversal", dict(model=lambda a: f"{a}/../secret.pt2"), "INVALID_ARGUMENT"),
    ("outside the roots", dict(model="/etc/hostname"), "PERMISSION_DENIED"),
    ("device file", dict(calibration="/dev/zero"), "PERMISSION_DENIED"),
    ("symlink escape", dict(model=lambda a: str(a / "escape.pt2")), "PERMISSION_DENIED"),
    ("symlink escape inside a model directory", dict(model=lambda a: str(a / "hf")), "PERMISSION_DENIED"),
    ("fifo", dict(calibration=lambda a: str(a / "fifo.npz")), "INVALID_ARGUMENT"),
    ("pickle with code (file)", dict(model=lambda a: str(a / "weights.pt")), "INVALID_ARGUMENT"),
    ("pickle with code (HF directory)", dict(model=lambda a: str(a / "pickled")), "INVALID_ARGUMENT"),
    ("disabled scheme", dict(calibration="embedded:calibration.txt"), "PERMISSION_DENIED"),
    ("NUL byte", dict(model=lambda a: f"{a}/model.pt2\x00.txt"), "INVALID_ARGUMENT"),
    ("reference too long", dict(model="/" + "a" * 5000), "INVALID_ARGUMENT"),
    ("huge shape", dict(shape=(65536, 65536)), "INVALID_ARGUMENT"),
    ("negative shape", dict(shape=(-5, 0)), "INVALID_ARGUMENT"),
    ("nan target", dict(target_speedup=float("nan")), "INVALID_ARGUMENT"),
    ("infinite target", dict(target_speedup=float("inf")), "INVALID_ARGUMENT"),
    ("too many labels", dict(labels={f"k{i}": "v" for i in range(100)}), "INVALID_ARGUMENT"),
    ("message over the limit", dict(eval="/" + "b" * (3 << 20)), "RESOURCE_EXHAUSTED"),
]


@pytest.mark.parametrize("fields, code", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_requests_are_refused(hostile, fields, code):
    server, allowed, marker = hostile
    with pytest.raises(grpc.RpcError) as err:
        server.compression.Compress(_request(allowed, **fields), timeout=30)
    assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
    assert "secret.pt2" not in (err.value.details() or "") or code != "PERMISSION_DENIED"
    assert not marker.exists()


def test_hostile_bytes_and_uploads_are_refused(hostile):
    server, _, _ = hostile
    garbage = server.channel.unary_unary("/osscar.compression.v1.Compression/Compress")
    for payload in (b"\xff\xff\xff\xff", b"\x0a\x05\xff\xfe\xfd\xfc\xfb"):  # bad wire format; invalid UTF-8 string
        with pytest.raises(grpc.RpcError) as err:
            garbage(payload, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # over --max-upload-mb, in chunks below the message limit
        server.compression.UploadBlob(iter(_upload(2 << 20)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in err.value.details()
    garbage_stream = server.channel.stream_unary("/osscar.compression.v1.Compression/UploadBlob")
    with pytest.raises(grpc.RpcError) as err:
        garbage_stream(iter([b"\xff\xff\xff"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_after_the_hostile_table_the_server_is_up_and_nothing_was_written(hostile):
    server, _, marker = hostile
    assert len(HOSTILE) >= 15 and not marker.exists()
    assert server.process.poll() is None and server.health() == SERVING
    listed = server.operations.ListOperations(operations_pb2.ListOperationsRequest(), timeout=10)
    assert list(listed.operations) == []
    blobs = server.home / "blobs"
    assert [p for p in blobs.rglob("*") if p.is_file()] == []
    stub = pb_grpc.CompressionStub(server.channel)  # and a legitimate request still works
    op = stub.Compress(_request(server.home.parent / "allowed"), timeout=30)
    assert op.name.startswith("operations/")
    server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=op.name), timeout=40)


def test_the_health_command_checks_a_server_that_asks_for_client_certificates(secure_server, capsys):
    """`osscar health` had no client certificate flags: a server with --tls-client-ca could be checked only through
    its loopback --health-port."""
    server, pki = secure_server
    flags = ["health", "--server", server.address, "--tls-ca", str(pki["ca"]), "--timeout", "10"]
    assert cli.main([*flags, "--tls-cert", str(pki["client"]), "--tls-key", str(pki["client_key"])]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert cli.main(flags) == 1  # no client certificate: the handshake is refused
    assert cli.main([*flags, "--tls-cert", str(pki["client"])]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
