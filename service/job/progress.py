"""The job's progress in words: every line a user reads is rendered here from a `Progress` record
(`compressor.progress`), so rewording one touches nothing that reads the records (the API's `layer` /
`layers`, the report's warnings, the CLI's transient lines)."""

from __future__ import annotations

from compressor.progress import (
    DEPTH,
    NOTE,
    RECONSTRUCTION,
    REMOVED,
    SOLVE,
    STATISTICS,
    WARNING,
    Progress,
)

UNITS = {"attention_heads": "heads", "ffn_neurons": "FFN neurons"}  # the rest: channels
# the pipelines' per-layer steps: a terminal redraws them in place
TRANSIENT = frozenset({SOLVE, STATISTICS, REMOVED, RECONSTRUCTION, DEPTH})


def render(p: Progress) -> str:
    """One line of text for `p`."""
    if p.stage in (WARNING, NOTE):
        return f"WARNING: {p.message}" if p.stage == WARNING else p.message
    at = f"[{p.index}/{p.total}] " if p.total else ""
    n = p.numbers
    if p.stage == SOLVE:
        coupled = f" ({n['consumers']:g} consumers)" if "consumers" in n else ""
        return (f"{at}{p.unit}{coupled}: {n['width_before']:g} -> {n['width_after']:g} {UNITS.get(p.kind, 'channels')}"
                f", relative error {n['relative_error']:.4f} ({n['seconds']:.1f}s)")
    if p.stage == STATISTICS:
        return f"{at}{p.unit}: statistics of {n['width_before']:g} {UNITS.get(p.kind, 'channels')}"
    if p.stage == REMOVED:
        return f"{at}{p.unit}: removed whole"
    if p.stage == RECONSTRUCTION:
        return (f"{at}{p.unit} reconstruction: held-out relative error {n['before']:.4f} -> {n['after']:.4f} "
                f"({'kept' if n['kept'] else 'discarded'}, {n['steps']:g} steps, {n['seconds']:.1f}s)")
    assert p.stage == DEPTH, p.stage
    return (f"depth: block {n['step']:g}/{n['steps']:g}: {p.unit} (output relative error with it removed "
            f"{n['error']:.4f})")
