"""The durable job store: migrations, idempotency keys, paging, deletes that report orphaned blobs."""

import sqlite3

import pytest

from service.store import (
    MIGRATIONS,
    QUEUED,
    SCHEMA_VERSION,
    SUCCEEDED,
    ArtifactRecord,
    JobRecord,
    JobStore,
    StoreVersionError,
)


def record(name: str, t: float, request_id: str | None = None, **fields) -> JobRecord:
    return JobRecord(name=name, body_sha256="b" * 64, request=b"\x08\x01", spec={"resolved": {"method": "osscar"}},
                     labels={"team": "a"}, request_id=request_id, create_time=t, **fields)


def test_a_fresh_store_is_at_the_latest_schema_and_survives_reopening(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("operations/1", 1.0, request_id="r1"))
    store.update("operations/1", state=SUCCEEDED, report={"status": "ok"}, progress={"stage": "done"})
    store.close()
    again = JobStore(tmp_path / "jobs.sqlite")
    assert again.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == len(MIGRATIONS)
    got = again.get("operations/1")
    assert got.state == SUCCEEDED and got.report == {"status": "ok"} and got.done
    assert again.by_request_id("r1").name == "operations/1"


def test_an_old_store_is_migrated_with_its_rows_and_a_newer_one_refused(tmp_path):
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(f"BEGIN; {MIGRATIONS[0]} PRAGMA user_version = 1; COMMIT;")  # written by release 1
    db.execute("INSERT INTO operations (name, body_sha256, request, spec, labels, state, progress, create_time) "
               "VALUES ('operations/old', 'x', x'', '{}', '{}', 'QUEUED', '{}', 1.0)")
    db.close()
    store = JobStore(path)
    assert store.get("operations/old").state == QUEUED
    store.record_upload("c" * 64, "cal.npz", False, 3)  # the table migration 2 added
    assert store.referenced("c" * 64)
    store.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    store.close()
    with pytest.raises(StoreVersionError, match="newer"):
        JobStore(path)


def test_request_ids_are_unique(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("operations/1", 1.0, request_id="same"))
    with pytest.raises(sqlite3.IntegrityError):
        store.insert(record("operations/2", 2.0, request_id="same"))


def test_pages_follow_creation_order_and_filters(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    for i in range(7):
        store.insert(record(f"operations/{i}", float(i), state=SUCCEEDED if i % 2 else QUEUED))
    names, after = [], None
    while True:
        page = store.page([], after, 3)
        if not page:
            break
        names += [r.name for r in page]
        after = (page[-1].create_time, page[-1].name)
    assert names == [f"operations/{i}" for i in range(7)]
    done = store.page([("state = ?", SUCCEEDED)], None, 100)
    assert [r.name for r in done] == ["operations/1", "operations/3", "operations/5"]


def test_delete_returns_only_the_digests_nobody_else_uses(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("operations/a", 1.0))
    store.insert(record("operations/b", 2.0))
    shared, own = "1" * 64, "2" * 64
    store.set_artifacts("operations/a", [ArtifactRecord("model.onnx", shared, 1, "application/onnx"),
                                         ArtifactRecord("report.json", own, 1, "application/json")])
    store.set_artifacts("operations/b", [ArtifactRecord("model.onnx", shared, 1, "application/onnx")])
    assert [a.name for a in store.get("operations/a").artifacts] == ["model.onnx", "report.json"]
    assert store.delete("operations/a") == [own]
    assert store.get("operations/a") is None and store.referenced(shared)
    assert store.delete("operations/b") == [shared]
