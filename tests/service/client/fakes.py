"""What the client tests fake of a server: an UNAVAILABLE call, and a finished job's downloads of a pruned model."""

from __future__ import annotations

import tarfile
from pathlib import Path

import grpc


class Unavailable(grpc.RpcError):
    """UNAVAILABLE as a call raises it (the server gone), with its details."""

    def __init__(self, details: str = "the server went away") -> None:
        super().__init__()
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


class ModelDownloads:
    """A client whose downloads are a pruned model directory (model.tar holding `config` as its config.json) and a
    report.json that names model/ as the job's pruned model."""

    def __init__(self, config: Path) -> None:
        self.config = config

    def download(self, name: str, artifact, into: Path) -> Path:
        if artifact.name == "model.tar":
            with tarfile.open(into / "model.tar", "w") as tar:
                tar.add(self.config, arcname="config.json")
        else:
            (into / artifact.name).write_text('{"artifacts": {"model": "model/"}}')
        return into / artifact.name
