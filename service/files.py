"""Files: where our data lives, content digests, writes that no reader ever sees half done, and the tar
archives a pruned model directory travels in (both sides: the client uploads and unpacks them, the server
stores them)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path


def default_home() -> Path:
    """$OSSCAR_HOME, else ~/.osscar: the curves cache, embedded models and the server's data."""
    return Path(os.environ.get("OSSCAR_HOME") or Path.home() / ".osscar")


_NAME = re.compile(r"^[A-Za-z0-9._+-][A-Za-z0-9._+ -]{0,254}$")


def hold_folder(folder: Path, wait: bool) -> int | None:
    """An exclusive advisory lock on `folder` (made if need be) for whoever writes into it: the descriptor to
    close when done (closing releases it, and the kernel does if the holder dies), or None when another process
    holds it and `wait` is false. A job and a delivery into one --out take turns through it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def valid_filename(name: str) -> bool:
    """A plain file name: no separators, not `.`/`..`, printable ASCII."""
    return bool(_NAME.match(name)) and name not in (".", "..")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def umask() -> int:
    """This process's file-creation mask, read without changing it where Linux says it (/proc/self/status);
    elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a file, or every file and directory under a directory, the mode a plain open() or mkdir() would
    have (0666 / 0777 less the umask). Temporary files (mkstemp) and safetensors' weights are created 0600:
    returned as they are, a serving process running as another user could not read them."""
    mask = umask()
    path = Path(path)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


def write_text_atomically(path: Path, text: str) -> None:
    """Write beside `path` under a hidden name, then rename over it (atomic on one filesystem); the file gets
    the umask's mode, as an ordinary write would give it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        follow_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# what a job writes into its --out (service.job.compress, the model kinds' `save`; a server's artifacts, `model/` as
# `model.tar`): what a Ctrl-C takes back and what a remote job's download replaces
JOB_OUTPUTS = ("model.onnx", "model.onnx.data", "decode.onnx", "decode.onnx.data", "genai_config.json", "model.pt2",
               "model", "report.json", "report.html", "manifest.json")  # manifest.json: a remote job's
# those a remote job's download clears when its operation does not return them: not the pruned model itself (an
# earlier job's model.pt2 or model/ may be this job's input: `compress out/model.pt2 --out out`)
JOB_EXPORTS = tuple(name for name in JOB_OUTPUTS if name not in ("model.pt2", "model"))


def touches(path: Path, inputs: Sequence[object]) -> bool:
    """Whether `path` is one of `inputs` (paths, or references that are not: None, "embedded:..."), lies inside one
    of them, or holds one."""
    path = Path(path).resolve()
    for given in inputs:
        if not given:
            continue
        i = Path(str(given)).expanduser().resolve()
        if i == path or path in i.parents or i in path.parents:
            return True
    return False


def earlier_model(out: Path) -> bool:
    """Whether an earlier job's report.json in `out` names `out/model` as its pruned model: a job replaces that
    folder whole, and any other one is the user's."""
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return False
    artifacts = report.get("artifacts") if isinstance(report, dict) else None
    return isinstance(artifacts, dict) and str(artifacts.get("model", "")).rstrip("/") == "model"


def foreign_model(out: Path, inputs: Sequence[object] = ()) -> str | None:
    """Why a job may not replace `out/model`, or None: a folder that is no earlier job's pruned model
    (`earlier_model`) nor one of the job's `inputs` (which a job reads, never removes)."""
    model = out / "model"
    if model.is_dir() and not model.is_symlink() and not touches(model, inputs) and not earlier_model(out):
        return (f"--out {out}: its model/ folder is no earlier job's (no report.json there names it), and a job "
                "replaces that folder whole; move it or choose another --out")
    return None


def earlier_job_files(out: Path) -> list[str]:
    """The files an earlier job's report.json in `out` lists as its own beside JOB_OUTPUTS (an image classifier's
    config.json and preprocessor_config.json, a decode step's tokenizer files): plain names of files at the top of
    `out`. A new job's results there replace or remove them, else they describe its model with another's labels,
    preprocessing or tokenizer."""
    try:
        artifacts = json.loads((out / "report.json").read_text()).get("artifacts") or {}
    except (OSError, ValueError, AttributeError):
        return []
    names: list[str] = []
    for entry in (artifacts.get("serving"), artifacts.get("decode_step")) if isinstance(artifacts, dict) else ():
        files = entry.get("files") if isinstance(entry, dict) else None
        names += [f for f in files if isinstance(f, str)] if isinstance(files, list) else []
    return [n for n in names if Path(n).name == n and n not in ("", ".", "..") and (out / n).is_file()]


class ArchiveError(ValueError):
    """A tar upload that is not a plain directory of regular files."""


def write_tar(directory: Path, out: Path, follow_symlinks: bool = False) -> None:
    """`directory`'s regular files and folders as a tar with fixed metadata (the same content, the same bytes).
    Symbolic links are left out, or with `follow_symlinks` (a user's upload: a Hugging Face cache snapshot is
    links into its blobs) stored as the files they point to; a link that points nowhere is then an error."""
    directory = Path(directory)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in _entries(directory, follow_symlinks):
            if path.is_symlink() and follow_symlinks and not path.exists():
                raise ArchiveError(f"{path} is a symbolic link to nothing ({os.readlink(path)})")
            if not (path.is_file() or path.is_dir()) or (path.is_symlink() and not follow_symlinks):
                continue
            info = tar.gettarinfo(str(path.resolve() if follow_symlinks else path),
                                  arcname=path.relative_to(directory).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if path.is_file():
                # a hard link (an encoder's model/onnx/model.onnx) as a file of its own: extract_tar takes no links
                info.type, info.linkname, info.size = tarfile.REGTYPE, "", path.stat().st_size
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def _entries(directory: Path, follow_symlinks: bool) -> list[Path]:
    """Every path under `directory`, sorted; with `follow_symlinks` also under linked folders (Path.rglob does not
    enter them: their files would be missing from the tar), a folder reached twice refused."""
    if not follow_symlinks:
        return sorted(directory.rglob("*"))
    found, seen = [], set()
    for root, dirs, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # top-down: a link back to a folder it is in, or two links to one folder
            raise ArchiveError(f"{root} reaches {real} again (a link loop, or two links to one folder)")
        seen.add(real)
        found += [Path(root) / name for name in dirs + files]
    return sorted(found)


MAX_MEMBERS = 100_000  # an archive's files and folders: a model directory holds tens
MAX_NAME_BYTES = 255  # Linux's NAME_MAX
MAX_PATH_BYTES = 3584  # of PATH_MAX's 4096, what is left beside the folder a member unpacks into


def _too_long(name: str) -> bool:
    raw = name.encode("utf-8", "surrogateescape")
    return len(raw) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/"))


def extract_tar(archive: Path, target: Path) -> None:
    """Regular files and directories only, every member inside `target`, at most MAX_MEMBERS of them, none
    sparse (a few bytes of archive that unpack to terabytes of zeros) and no name longer than a file system takes;
    anything else is refused with the list of offending members."""
    target.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:") as tar:
            members = []
            while (member := tar.next()) is not None:  # one at a time: a count past the cap stops the reading
                members.append(member)
                if len(members) > MAX_MEMBERS:
                    raise ArchiveError(f"the archive holds more than {MAX_MEMBERS:,} members")
            bad = [m.name for m in members if not (m.isfile() or m.isdir()) or m.issparse() or m.name.startswith("/")
                   or ".." in Path(m.name).parts or _too_long(m.name)]
            if bad:
                raise ArchiveError(f"the archive may hold only regular (not sparse) files and directories inside it, "
                                   f"under names of at most {MAX_NAME_BYTES} bytes a part; refused members: "
                                   f"{', '.join(bad[:10])}")
            tar.extractall(target, members=members, filter="data")
    except tarfile.TarError as err:
        raise ArchiveError(f"not a readable uncompressed tar archive: {err}") from err
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as err:  # members that contradict each other
        raise ArchiveError(f"the archive's members conflict: {type(err).__name__}") from err  # (`a`, then `a/b`)


_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
         errno.EFBIG: "a file grew past the size limit"}


def out_of_disk(err: BaseException) -> str | None:
    """What ran out when `err`, or an error it was raised from, is the file system refusing a write for space (a
    full disk, a quota, a file-size limit: the machine's, not the model's), else None. Its words only: the path it
    names is the server's."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _FULL:
            return _FULL[err.errno]
        if any(words in str(err) for words in ("No space left on device", "database or disk is full")):
            return _FULL[errno.ENOSPC]  # a library's own error that kept only the words (safetensors, SQLite)
        err = err.__cause__ or err.__context__
    return None
