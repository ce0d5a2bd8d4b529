"""The content-addressed blob store: atomic writes, deterministic directory archives, safe extraction."""

import hashlib
import io
import os
import tarfile

import pytest

from service.core.blobs import BlobStore, tree_sha256, valid_filename
from service.files import ArchiveError, extract_tar


def test_a_blob_is_visible_only_complete_and_under_its_digest(tmp_path):
    store = BlobStore(tmp_path)
    writer = store.writer()
    writer.write(b"hello ")
    assert list(store.blobs.rglob("*")) == []  # nothing visible while it is being written
    writer.write(b"world")
    digest, size = writer.commit()
    assert digest == hashlib.sha256(b"hello world").hexdigest() and size == 11
    assert store.path(digest).read_bytes() == b"hello world"
    assert list(store.tmp.iterdir()) == []
    again = store.writer()
    again.write(b"hello world")
    assert again.commit() == (digest, 11)  # the same content is stored once


def test_an_aborted_or_interrupted_write_leaves_nothing_behind(tmp_path):
    store = BlobStore(tmp_path)
    writer = store.writer()
    writer.write(b"partial")
    writer.abort()
    assert list(store.tmp.iterdir()) == [] and list(store.blobs.rglob("*")) == []
    crashed = store.writer()  # a process killed mid-write leaves its temporary file ...
    crashed.write(b"partial")
    crashed.file.flush()
    assert store.clean_tmp() == 1  # ... which the next start removes
    assert list(store.tmp.iterdir()) == []


def test_a_sweep_removes_what_dead_writers_left_and_nothing_a_live_one_writes(tmp_path):
    """A worker killed in the middle of a model-sized tar left it in tmp/ until the server restarted; the sweep (while
    other workers write) removes the temporary files whose writer is gone."""
    import subprocess
    import sys

    store = BlobStore(tmp_path)
    live = store.writer()  # this process's: alive
    live.write(b"being written")
    live.file.flush()
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE)
    dead = int(child.communicate()[0])
    (store.tmp / f"tar-{dead}-abc").write_bytes(b"half a tar")
    (store.tmp / f"view-{dead}-def").mkdir()
    (store.tmp / "stranger").write_bytes(b"no writer named")
    assert store.clean_tmp(dead_only=True) == 2
    assert sorted(p.name for p in store.tmp.iterdir()) == sorted([live.tmp.name, "stranger"])
    assert live.tmp.name.startswith(f"blob-{os.getpid()}-")
    digest, _ = live.commit()
    assert store.path(digest).read_bytes() == b"being written"


def test_directories_archive_deterministically_and_extract_to_the_same_tree(tmp_path):
    source = tmp_path / "model"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "w.bin").write_bytes(os.urandom(5000))
    store = BlobStore(tmp_path / "store")
    digest, _ = store.put_tree(source)
    os.utime(source / "config.json", (1, 1))  # metadata does not change the digest
    assert store.put_tree(source)[0] == digest
    view = store.view(digest, "model", archive=True)
    assert tree_sha256(view) == tree_sha256(source)
    assert store.view(digest, "model", archive=True) == view


def _tar(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("member", ["../escape", "/etc/passwd", "link"])
def test_archives_with_escaping_or_special_members_are_refused(tmp_path, member):
    info = tarfile.TarInfo(member)
    if member == "link":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    archive = tmp_path / "a.tar"
    archive.write_bytes(_tar(info, b"" if member == "link" else b"x"))
    with pytest.raises(ArchiveError, match="refused members"):
        extract_tar(archive, tmp_path / "out")
    assert not (tmp_path / "escape").exists()


def test_archives_that_would_unpack_past_their_size_or_the_file_system_are_refused(tmp_path, monkeypatch):
    """A sparse member (a few bytes of tar that unpack to terabytes of zeros, past --max-upload-mb), a name the file
    system cannot take (it was an OSError: INTERNAL, the upload's blob left behind), and more members than a model
    directory holds (read one at a time: the count stops the reading) are each an ArchiveError."""
    from service import files

    sparse = tarfile.TarInfo("model.safetensors")
    sparse.type = tarfile.GNUTYPE_SPARSE
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(sparse, io.BytesIO(b""))
    cases = {"sparse": (buffer.getvalue(), "model.safetensors"),
             "long name": (_tar(tarfile.TarInfo("x" * 300), b"x"), "x" * 300),
             "deep path": (_tar(tarfile.TarInfo("/".join(["d" * 200] * 20)), b"x"), "d" * 200)}
    for case, (data, named) in cases.items():
        archive = tmp_path / f"{case}.tar"
        archive.write_bytes(data)
        with pytest.raises(ArchiveError, match="refused members") as refused:
            extract_tar(archive, tmp_path / case)
        assert named in str(refused.value), case
    monkeypatch.setattr(files, "MAX_MEMBERS", 3)
    many = io.BytesIO()
    with tarfile.open(fileobj=many, mode="w") as tar:
        for i in range(5):
            tar.addfile(tarfile.TarInfo(f"f{i}"), io.BytesIO(b""))
    (tmp_path / "many.tar").write_bytes(many.getvalue())
    with pytest.raises(ArchiveError, match="more than 3 members"):
        extract_tar(tmp_path / "many.tar", tmp_path / "many")
    assert not any((tmp_path / "many").iterdir())


def test_file_names_are_plain():
    assert valid_filename("model.pt2") and valid_filename("stories260K")
    assert not any(valid_filename(n) for n in ("", ".", "..", "a/b", "../x", "a\\b" * 0 + "x/..", "\n"))


def test_a_view_that_loses_its_race_to_the_other_kind_is_refused(tmp_path, monkeypatch):
    """Two uploads of one content and name at once, one as a file and one as an archive: the file's view, built while
    the archive's landed first, took the directory as its own and both answered OK."""
    from service.core import blobs

    store = BlobStore(tmp_path)
    writer = store.writer()
    writer.write(b"bytes")
    digest, _ = writer.commit()
    target = store.files / digest / "m.bin"
    real_link = os.link

    def link(source, destination):  # the other upload's directory lands between the check and the rename
        target.mkdir(parents=True)
        (target / "inside.txt").write_text("the archive's")
        real_link(source, destination)

    monkeypatch.setattr(blobs.os, "link", link)
    with pytest.raises(ArchiveError, match="already here as a directory"):
        store.view(digest, "m.bin", archive=False)
    assert (target / "inside.txt").read_text() == "the archive's" and list(store.tmp.iterdir()) == []
