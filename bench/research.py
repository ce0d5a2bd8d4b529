"""A local `osscar compress` job with request fields the command line leaves out on purpose (research knobs
of `service.job.request.LOCAL_ONLY`, e.g. target mode's loss currency `normalise`), for benchmarks only:

    python bench/research.py normalise=output -- compress MODEL --target-speedup 1.25 --calibration TEXT --out DIR

Each NAME=VALUE before `--` sets that text field of the CompressRequest the command line builds; everything after
`--` is the command line of `osscar`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _fields(pairs: list[str]) -> dict[str, object]:
    from service.job.request import LOCAL_ONLY, CompressRequest

    types = {f.name: f for f in dataclasses.fields(CompressRequest)}
    out: dict[str, object] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"{pair!r}: expected NAME=VALUE with NAME a request field")
        if name not in LOCAL_ONLY or types[name].metadata.get("cli"):
            raise SystemExit(f"{name}: the command line sets it (--{name.replace('_', '-')}); this is for the others")
        if types[name].type != "str":
            raise SystemExit(f"{name}: not a text field ({types[name].type}); set it in Python")
        choices = types[name].metadata.get("choices")
        if choices and value not in choices:
            raise SystemExit(f"{name}={value}: one of {', '.join(choices)}")
        out[name] = value
    return out


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    fields = _fields(argv[:cut])
    import service.job as job
    from service.client import cli

    job.CompressRequest = functools.partial(job.CompressRequest, **fields)  # what the CLI builds its request with
    return cli.main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
