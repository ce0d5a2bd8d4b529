"""Files: where our data lives, content digests, and writes that no reader ever sees half done."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def default_home() -> Path:
    """$OSSCAR_HOME, else ~/.osscar: the curves cache, embedded models and the server's data."""
    return Path(os.environ.get("OSSCAR_HOME") or Path.home() / ".osscar")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_text_atomically(path: Path, text: str) -> None:
    """Write beside `path` under a hidden name, then rename over it (atomic on one filesystem)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
