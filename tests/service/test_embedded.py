"""The embedded resources: the default model's path and the calibration text built on first use."""

import logging

from service import embedded
from service.embedded import EMBEDDED_CALIBRATION, MIN_PARAGRAPHS


def test_the_embedded_text_is_the_standard_librarys_prose_with_no_paragraph_twice(tmp_path):
    """Built once under the home from this Python's standard library: documents (one a module) of distinct
    prose paragraphs, so the job's held-out end shares no sentence with what it calibrates on."""
    path = embedded.embedded(EMBEDDED_CALIBRATION, tmp_path)
    documents = path.read_text().strip().split("\n\n")
    paragraphs = [p for d in documents for p in d.split("\n")]
    assert len(documents) >= 200 and len(paragraphs) >= MIN_PARAGRAPHS
    assert len(set(paragraphs)) == len(paragraphs)
    assert all(len(p) >= 80 and p.endswith(".") and not p.startswith(">>>") for p in paragraphs)
    tail = set(paragraphs[-len(paragraphs) // 10:])  # about what a job holds out
    assert not tail & set(paragraphs[: -len(paragraphs) // 10])
    assert embedded.embedded(EMBEDDED_CALIBRATION, tmp_path) == path  # kept: built once
    assert embedded.stdlib_prose() == documents  # the same text every time


def test_without_the_standard_librarys_sources_the_shipped_sentences_stand_in(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(embedded, "stdlib_prose", lambda: [])
    with caplog.at_level(logging.WARNING, logger="service.embedded"):
        path = embedded.embedded(EMBEDDED_CALIBRATION, tmp_path)
    assert path.read_text().strip().split("\n\n") == embedded.calibration_texts()
    assert "sources are not installed" in caplog.text
