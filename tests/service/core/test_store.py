"""The durable job store: migrations, idempotency keys, paging, filters, page tokens, stored errors, deletes
that report orphaned blobs."""

import json
import sqlite3

import pytest

from service.core.outcomes import FAILED, QUEUED, SUCCEEDED, JobError
from service.core.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ArtifactRecord,
    JobRecord,
    JobStore,
    StoreVersionError,
    parse_filter,
)
from service.errors import InvalidArgument


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


def test_search_pages_with_tokens_bound_to_their_filter(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    for i in range(5):
        store.insert(record(f"operations/{i}", float(i), state=SUCCEEDED if i % 2 else QUEUED))
    names, token = [], ""
    while True:
        page, token = store.search("done = false", 2, token)
        names += [r.name for r in page]
        if not token:
            break
    assert names == ["operations/0", "operations/2", "operations/4"]
    _, token = store.search("", 2, "")
    with pytest.raises(InvalidArgument, match="another filter"):
        store.search("state = QUEUED", 2, token)
    with pytest.raises(InvalidArgument, match="not a page token"):
        store.search("", 2, "bm90IGpzb24")


def test_a_weighed_page_ends_before_its_budget_is_passed_and_is_never_empty(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    for i in range(5):
        store.insert(record(f"operations/{i}", float(i)))
    weights = {"operations/0": 3, "operations/1": 3, "operations/2": 9, "operations/3": 1, "operations/4": 1}
    pages, token = [], ""
    while True:
        page, token = store.search("", 10, token, lambda r: weights[r.name], 7)
        pages.append([r.name[-1] for r in page])
        if not token:
            break
    assert pages == [["0", "1"], ["2"], ["3", "4"]]  # the heavy one alone, over the budget as it is


@pytest.mark.parametrize("text, sql", [
    ("", []),
    ('state = running AND labels.team = "ml"', ["state = ?", "json_extract(labels, '$.\"team\"') = ?"]),
    ("done = true", ["(state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')) = ?"]),
])
def test_filters_become_parameterised_conditions(text, sql):
    assert [condition for condition, _ in parse_filter(text)] == sql


@pytest.mark.parametrize("text", ["state = SLEEPING", "done = maybe", "labels.Bad = x", "x = 1 OR y = 2",
                                  "model ~ x", "labels.a = \"x\" AND"])
def test_bad_filters_are_invalid_arguments(text):
    with pytest.raises(InvalidArgument):
        parse_filter(text)


def test_errors_are_stored_as_the_json_of_earlier_releases(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("operations/budget", 1.0))
    store.update("operations/budget", state=FAILED, error=JobError.time_budget_exceeded(4))
    raw = store.db.execute("SELECT error FROM operations WHERE name = 'operations/budget'").fetchone()[0]
    assert json.loads(raw) == {"code": "DEADLINE_EXCEEDED", "reason": "TIME_BUDGET_EXCEEDED",
                               "message": "the job exceeded its time budget of 4s", "metadata": {"time_budget_s": "4"}}
    assert raw == json.dumps(json.loads(raw), sort_keys=True)
    # a row as an earlier release wrote it (no metadata key; reason-less errors read the code as the reason)
    for name, error in (("operations/old", {"code": "CANCELLED", "message": "cancelled by the client",
                                            "reason": "CANCELLED"}),
                        ("operations/older", {"code": "INTERNAL", "message": "boom"})):
        store.insert(record(name, 2.0, state=FAILED))
        store.db.execute("UPDATE operations SET error = ? WHERE name = ?", (json.dumps(error), name))
    assert store.get("operations/old").error == JobError.cancelled()
    assert store.get("operations/old").error.to_dict() == {"code": "CANCELLED", "message": "cancelled by the client",
                                                           "reason": "CANCELLED"}
    older = store.get("operations/older").error
    assert (older.code, older.reason, older.metadata) == ("INTERNAL", "INTERNAL", {})


def test_a_final_state_and_its_artifacts_are_one_transaction(tmp_path):
    # a report that cannot be written (here not JSON) must not leave the artifacts recorded without the state
    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("operations/a", 1.0))
    artifact = ArtifactRecord("model.onnx", "1" * 64, 1, "application/onnx")
    with pytest.raises(TypeError):
        store.update("operations/a", artifacts=[artifact], state=SUCCEEDED, report={"x": object()})
    kept = store.get("operations/a")
    assert kept.state == QUEUED and kept.artifacts == [] and not store.referenced(artifact.sha256)
    store.update("operations/a", artifacts=[artifact], state=SUCCEEDED, report={"x": 1})
    done = store.get("operations/a")
    assert done.state == SUCCEEDED and done.report == {"x": 1} and done.artifacts == [artifact]


def test_a_filter_on_the_method_counts_jobs_that_ran_the_default_and_quoted_values_may_hold_and(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(JobRecord(name="operations/named", body_sha256="b" * 64, request=b"", labels={"team": "x AND y"},
                           spec={"resolved": {"method": "osscar"}}, create_time=1.0))
    store.insert(JobRecord(name="operations/default", body_sha256="b" * 64, request=b"", spec={"resolved": {}},
                           create_time=2.0))
    store.insert(JobRecord(name="operations/mp", body_sha256="b" * 64, request=b"",
                           spec={"resolved": {"method": "mp"}}, create_time=3.0))
    found, _ = store.search("method = osscar", 10, "")
    assert [r.name for r in found] == ["operations/named", "operations/default"]
    found, _ = store.search('labels.team = "x AND y" AND method = osscar', 10, "")
    assert [r.name for r in found] == ["operations/named"]
    with pytest.raises(InvalidArgument, match="cannot parse"):
        store.search('labels.team = "x AND', 10, "")


def test_a_damaged_row_is_failed_alone_and_the_rest_are_served(tmp_path):
    """A row whose JSON was cut short (a disk's torn write, a hand edit) raised JSONDecodeError from every read that
    reached it: the server's start (its recovery lists QUEUED and RUNNING jobs) and every listing page."""
    from service.core.outcomes import RUNNING

    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("operations/ok", 1.0))
    store.insert(record("operations/running", 2.0, state=RUNNING, progress={"stage": "pruning"}))
    store.insert(record("operations/queued", 3.0))
    store.insert(record("operations/done", 4.0, state=FAILED, error=JobError.cancelled()))
    for name, column in (("running", "progress"), ("queued", "spec"), ("done", "error")):
        store.db.execute(f"UPDATE operations SET {column} = '{{\"stage\": \"pru' WHERE name = ?",
                         (f"operations/{name}",))
    assert [r.name for r in store.in_states([QUEUED, RUNNING])] == ["operations/ok"]
    listed = store.page([], None, 10)
    assert [r.name for r in listed] == ["operations/ok", "operations/running", "operations/queued", "operations/done"]
    for name, column in (("running", "progress"), ("queued", "spec"), ("done", "error")):
        damaged = store.get(f"operations/{name}")
        assert damaged.state == FAILED and damaged.error.reason == "INTERNAL" and damaged.end_time is not None
        assert f"damaged ({column} unreadable)" in damaged.error.message
    reopened = JobStore(tmp_path / "jobs.sqlite")  # the mark is stored: the next start sees a failed job
    assert reopened.count(QUEUED) == 1 and reopened.count(RUNNING) == 0
    # set aside once: the damaged columns are emptied, so a later read neither logs nor writes again
    assert reopened.get("operations/running").progress == {}
    stored = reopened.db.execute("SELECT progress FROM operations WHERE name = 'operations/running'").fetchone()[0]
    assert stored == "{}"
    # a finished job whose outcome still reads keeps it when only its labels or progress are lost
    reopened.insert(record("operations/succeeded", 4.5, state=SUCCEEDED, report={"status": "ok"}))
    reopened.db.execute("UPDATE operations SET labels = '{\"te' WHERE name = 'operations/succeeded'")
    kept = reopened.get("operations/succeeded")
    assert (kept.state, kept.error, kept.labels, kept.report) == (SUCCEEDED, None, {}, {"status": "ok"})
    # bytes that are not UTF-8 (sqlite raised inside fetchall()) and JSON of the wrong type are damage too
    reopened.insert(record("operations/bytes", 5.0))
    reopened.insert(record("operations/null", 6.0))
    reopened.db.execute("UPDATE operations SET spec = CAST(x'7b22ff22' AS TEXT) WHERE name = 'operations/bytes'")
    reopened.db.execute("UPDATE operations SET labels = '[1]', spec = 'null' WHERE name = 'operations/null'")
    assert [r.name for r in reopened.in_states([QUEUED])] == ["operations/ok"]
    assert "damaged (spec, labels unreadable)" in reopened.get("operations/null").error.message
