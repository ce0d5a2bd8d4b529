"""File helpers: atomic writes and the modes of what a job returns."""

import os
import tempfile
from pathlib import Path

import pytest

from service.files import extract_tar, follow_umask, umask, write_tar, write_text_atomically


@pytest.fixture
def mask_027():
    previous = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(previous)


def test_the_umask_is_read_without_changing_it(mask_027):
    assert umask() == mask_027
    assert umask() == mask_027


def test_files_and_directories_follow_the_umask_not_0600(tmp_path, mask_027):
    fd, name = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    assert Path(name).stat().st_mode & 0o777 == 0o600
    follow_umask(Path(name))
    assert Path(name).stat().st_mode & 0o777 == 0o640
    tree = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700
    (tree / "sub").mkdir()
    (tree / "sub" / "w.safetensors").write_bytes(b"x")
    os.chmod(tree / "sub" / "w.safetensors", 0o600)
    follow_umask(tree)
    assert [p.stat().st_mode & 0o777 for p in (tree, tree / "sub", tree / "sub" / "w.safetensors")] == \
        [0o750, 0o750, 0o640]


def test_an_atomic_write_has_the_mode_of_an_ordinary_one(tmp_path, mask_027):
    write_text_atomically(tmp_path / "report.json", "{}")
    (tmp_path / "plain.json").write_text("{}")
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == (tmp_path / "plain.json").stat().st_mode & 0o777 \
        == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_hard_link_travels_as_a_file_of_its_own(tmp_path):
    """An encoder's model/onnx/model.onnx is a hard link to model.onnx; the archive must still hold regular
    files only, which is all extract_tar takes."""
    job = tmp_path / "job"
    (job / "model" / "onnx").mkdir(parents=True)
    (job / "model.onnx").write_bytes(b"graph bytes")
    os.link(job / "model.onnx", job / "model" / "onnx" / "model.onnx")
    write_tar(job, tmp_path / "job.tar")
    extract_tar(tmp_path / "job.tar", tmp_path / "back")
    assert (tmp_path / "back" / "model" / "onnx" / "model.onnx").read_bytes() == b"graph bytes"
    assert (tmp_path / "back" / "model.onnx").read_bytes() == b"graph bytes"


def test_an_upload_follows_symbolic_links_where_a_job_archive_leaves_them_out(tmp_path):
    """A Hugging Face cache snapshot is links into its blobs: uploaded, the archive holds the files they point to
    (it held nothing); a job's own archive still leaves links out, and a link to nothing is an error."""
    import pytest

    from service.files import ArchiveError

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    (blobs / "abc").write_bytes(b"weights")
    (snapshot / "model.safetensors").symlink_to(blobs / "abc")
    write_tar(snapshot, tmp_path / "up.tar", follow_symlinks=True)
    extract_tar(tmp_path / "up.tar", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / "back" / "model.safetensors").is_symlink()
    write_tar(snapshot, tmp_path / "job.tar")
    extract_tar(tmp_path / "job.tar", tmp_path / "job")
    assert list((tmp_path / "job").iterdir()) == []
    (snapshot / "config.json").symlink_to(blobs / "gone")
    with pytest.raises(ArchiveError, match=r"config\.json is a symbolic link to nothing"):
        write_tar(snapshot, tmp_path / "broken.tar", follow_symlinks=True)
