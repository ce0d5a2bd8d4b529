"""The content-addressed blob store: uploads and artifacts under `sha256/<aa>/<hex>`.

Every blob is written to `tmp/` beside the store, fsynced, and renamed into place (atomic on one
filesystem; the directories fsynced too, so the rename outlives a power loss as the job's record of it does),
so no reader ever sees a partial file and a crash leaves at most a temporary file that the next start removes
(or the next sweep, once the process that wrote it is gone: `tmp/<kind>-<pid>-...`). Jobs read uploads
through a view, `files/<hex>/<name>` (loaders need the file's name and extension; a directory uploaded as a tar
is extracted there), built the same way: in `tmp/`, then renamed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from ..files import ArchiveError, extract_tar, file_sha256, valid_filename, write_tar

CHUNK = 1 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")


def valid_digest(digest: str) -> bool:
    return bool(_HEX.match(digest))


def tree_sha256(path: Path) -> str:
    """A file's digest, or a directory's: sha256 over its files' relative paths and digests, sorted."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
    return digest.hexdigest()


def _fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a file's own fsync does not cover its directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_prefix(kind: str) -> str:
    """`<kind>-<pid>-`: a temporary file names the process writing it, so a sweep can tell a dead one's leftovers."""
    return f"{kind}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that number: alive
        return True
    return True


class BlobWriter:
    """Incremental write of one blob; `commit()` moves it into place and returns (digest, size)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        fd, name = tempfile.mkstemp(dir=store.tmp, prefix=_tmp_prefix("blob"))
        self.tmp = Path(name)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.hash.update(data)
        self.size += len(data)

    def commit(self) -> tuple[str, int]:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        digest = self.hash.hexdigest()
        final = self.store.path(digest)
        new_directory = not final.parent.is_dir()
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():  # same content already stored: written again now, as far as retention is concerned
            self.tmp.unlink()
            os.utime(final)
        else:
            os.replace(self.tmp, final)
            _fsync_directory(final.parent)
            if new_directory:
                _fsync_directory(final.parent.parent)
        return digest, self.size

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blobs = self.root / "sha256"
        self.files = self.root / "files"
        self.tmp = self.root / "tmp"
        for d in (self.blobs, self.files, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def clean_tmp(self, dead_only: bool = False) -> int:
        """Remove what an interrupted write left behind: everything (at start, when no write is in flight), or with
        `dead_only` what processes that are gone wrote (a worker killed by a cancel or a deadline in the middle of a
        model-sized tar; the sweep's, while others write)."""
        leftovers = []
        for p in self.tmp.iterdir():
            writer = p.name.split("-")
            if dead_only and not (len(writer) > 2 and writer[1].isdigit() and not _alive(int(writer[1]))):
                continue
            leftovers.append(p)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return len(leftovers)

    def path(self, digest: str) -> Path:
        assert valid_digest(digest), f"not a sha256 hex digest: {digest!r}"
        return self.blobs / digest[:2] / digest

    def written_before(self, cutoff: float) -> list[str]:
        """Digests of the blobs last written (or written again, `BlobWriter.commit`) before `cutoff` (epoch s)."""
        return [p.name for p in self.blobs.glob("??/*")
                if valid_digest(p.name) and p.is_file() and p.stat().st_mtime < cutoff]

    def exists(self, digest: str) -> bool:
        return valid_digest(digest) and self.path(digest).is_file()

    def writer(self) -> BlobWriter:
        return BlobWriter(self)

    def put_file(self, source: Path) -> tuple[str, int]:
        writer = self.writer()
        try:
            with open(source, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    writer.write(chunk)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    def put_tree(self, directory: Path) -> tuple[str, int]:
        """A directory as an uncompressed tar blob (members relative to the directory, sorted, with fixed
        metadata so the same content gives the same digest)."""
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix=_tmp_prefix("tar"))
        os.close(fd)
        try:
            write_tar(directory, Path(name))
            return self.put_file(Path(name))
        finally:
            Path(name).unlink(missing_ok=True)

    def delete(self, digest: str) -> None:
        if valid_digest(digest):
            self.path(digest).unlink(missing_ok=True)
            shutil.rmtree(self.files / digest, ignore_errors=True)

    def delete_view(self, digest: str, filename: str) -> None:
        """Remove `files/<hex>/<filename>` (an upload forgotten while its content lives on as an artifact: a
        reference to it must not resolve to a view nothing keeps)."""
        if valid_digest(digest) and valid_filename(filename):
            target = self.files / digest / filename
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)

    def view(self, digest: str, filename: str, archive: bool) -> Path:
        """`files/<hex>/<filename>`: the blob under its name, or the tar extracted as that directory."""
        assert valid_filename(filename), filename
        target = self.files / digest / filename
        if target.exists():
            if target.is_dir() != archive:
                raise ArchiveError(f"this content is already here as a {'directory' if target.is_dir() else 'file'} "
                                   f"named {filename!r}; upload it under another name")
            return target
        staging = Path(tempfile.mkdtemp(dir=self.tmp, prefix=_tmp_prefix("view")))
        try:
            if archive:
                extract_tar(self.path(digest), staging / filename)
            else:
                try:
                    os.link(self.path(digest), staging / filename)  # blobs are immutable: share the inode
                except OSError:
                    shutil.copyfile(self.path(digest), staging / filename)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(staging / filename, target)
            except OSError:
                if not target.exists():  # lost a race to an identical view: fine; anything else is not
                    raise
            if target.is_dir() != archive:  # lost it to a view of the other kind: this upload is refused
                raise ArchiveError(f"this content is already here as a {'directory' if target.is_dir() else 'file'} "
                                   f"named {filename!r}; upload it under another name")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target
