"""The reference policy: which paths and reference kinds a request may name.

Path references must be absolute, free of `..`, and resolve (symlinks followed) inside one of the
configured roots when roots are configured; only regular files and directories are accepted, and a
directory's files must be regular files whose real paths stay inside the roots (no symlink escape, no
device files, fifos or sockets). Reference kinds (`path`, `blob`, `embedded`) can be switched off.
`trust_remote_code` is granted per model directory, never by the request.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import FieldViolation, InvalidArgument, NotFound, PermissionDenied
from ..files import MAX_MEMBERS

MAX_DIRECTORY_FILES = MAX_MEMBERS  # a referenced folder's entries, as an uploaded archive's members


@dataclass(frozen=True)
class ReferencePolicy:
    roots: tuple[Path, ...] = ()  # resolved directories; empty: any absolute path
    schemes: frozenset[str] = frozenset({"path", "blob", "embedded"})
    trusted_code: tuple[Path, ...] = ()  # model directories allowed trust_remote_code

    @classmethod
    def of(cls, roots: tuple[str, ...] = (), schemes: tuple[str, ...] = ("path", "blob", "embedded"),
           trusted_code: tuple[str, ...] = ()) -> ReferencePolicy:
        return cls(tuple(Path(r).resolve() for r in roots), frozenset(schemes),
                   tuple(Path(t).resolve() for t in trusted_code))

    def require_scheme(self, scheme: str, field: str) -> None:
        if scheme not in self.schemes:
            raise PermissionDenied("SCHEME_DISABLED", f"{field}: {scheme} references are disabled on this server "
                                                      f"(allowed: {', '.join(sorted(self.schemes)) or 'none'})")

    def check_path(self, reference: str, field: str, resource: str) -> Path:
        """The real path behind an absolute path reference, or the error that refuses it."""
        path = Path(reference)
        if not path.is_absolute():
            raise InvalidArgument([FieldViolation(field, f"{reference!r} is a relative path; send absolute paths "
                                                         "(the server does not share the client's working directory)")])
        if ".." in path.parts:
            raise InvalidArgument([FieldViolation(field, f"{reference!r} contains '..'; send the path itself")])
        if "\x00" in reference:
            raise InvalidArgument([FieldViolation(field, "the path contains a NUL byte")])
        try:
            real = path.resolve(strict=True)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(resource, reference, f"no such {resource} on the server: {reference}") from None
        except (OSError, RuntimeError) as err:  # loops, permissions
            raise InvalidArgument([FieldViolation(field, f"{reference!r} cannot be resolved: "
                                                         f"{type(err).__name__}")]) from None
        self._inside(real, reference, field)
        mode = real.stat().st_mode
        if stat.S_ISDIR(mode):
            self._check_tree(real, reference, field)
        elif not stat.S_ISREG(mode):
            raise InvalidArgument([FieldViolation(field, f"{reference!r} is not a regular file or directory "
                                                         "(devices, fifos and sockets are refused)")])
        return real

    def _inside(self, real: Path, reference: str, field: str) -> None:
        if self.roots and not any(real == root or root in real.parents for root in self.roots):
            raise PermissionDenied("OUTSIDE_ALLOWED_ROOTS", f"{field}: {reference} is outside the directories this "
                                                            "server reads from")

    def _check_tree(self, real: Path, reference: str, field: str) -> None:
        """Every entry under `real`, and under every directory a link in it leads to (a link inside a linked
        folder may lead anywhere a job would then read from), at most MAX_DIRECTORY_FILES in all."""
        count, trees, seen = 0, [real], {real}
        while trees:
            tree = trees.pop()
            for directory, dirs, files in os.walk(tree, followlinks=False):
                for name in dirs + files:
                    count += 1
                    if count > MAX_DIRECTORY_FILES:
                        raise InvalidArgument([FieldViolation(field, f"{reference!r} holds more than "
                                                                     f"{MAX_DIRECTORY_FILES} entries")])
                    entry = Path(directory) / name
                    shown = entry.relative_to(tree) if tree == real else f"{tree}/{entry.relative_to(tree)}"
                    target = entry.resolve()
                    if entry.is_symlink():  # a link may not lead out of the allowed roots
                        self._inside(target, f"{reference} (symlink {shown})", field)
                        if name in dirs and target not in seen:
                            seen.add(target)
                            trees.append(target)
                    if name in files:
                        try:
                            mode = target.stat().st_mode
                        except OSError:
                            raise InvalidArgument([FieldViolation(field, f"{shown} in {reference!r} is a dangling "
                                                                         "link")]) from None
                        if not stat.S_ISREG(mode):
                            raise InvalidArgument([FieldViolation(field, f"{shown} in {reference!r} is not a "
                                                                         "regular file")])

    def trusts_code(self, real: Path) -> bool:
        return any(real == root or root in real.parents for root in self.trusted_code)
