"""The durable job store: one SQLite file (embedded, no server), versioned schema, every change committed.

Operations are rows; their artifacts are rows pointing into the content-addressed blob store
(`service.core.blobs`). The schema version lives in SQLite's `user_version`; `MIGRATIONS[i]` takes a database
from version i to i + 1 inside one transaction, so a crash mid-migration leaves the old version intact.
A database written by a newer release (a higher version than this code knows) is refused rather than
guessed at. Journal: WAL with synchronous=FULL, so a committed state change survives a power cut.

Listing lives here too, next to its SQL: the AIP-160 filter subset becomes parameterised conditions, and
page tokens are opaque cursors bound to their filter. An operation's error is a `JobError`, stored as the
JSON of `JobError.to_dict`.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import json
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FieldViolation, InvalidArgument
from ..fields import LABEL_KEY
from ..job.request import DEFAULT_METHOD
from .outcomes import FAILED, FINISHED, QUEUED, STATES, JobError

log = logging.getLogger(__name__)

_FILTER_TERM = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*=\s*(?:"([^"]*)"|([^\s"]+))\s*$')

MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1: operations and their artifacts
    """
    CREATE TABLE operations (
        name TEXT PRIMARY KEY,              -- operations/<uuid>
        request_id TEXT UNIQUE,             -- AIP-155 idempotency key, NULL when the client sent none
        body_sha256 TEXT NOT NULL,          -- the request without its request_id: same id + other body = conflict
        request BLOB NOT NULL,              -- the request as the transport received it (echoed in metadata)
        spec TEXT NOT NULL,                 -- JSON: the resolved job (CompressRequest fields)
        labels TEXT NOT NULL,               -- JSON object
        time_budget_s REAL,                 -- NULL: no budget
        state TEXT NOT NULL,
        progress TEXT NOT NULL,             -- JSON: stage, round, layer, layers, message
        attempt INTEGER NOT NULL DEFAULT 0, -- runs started
        error TEXT,                         -- JSON: code, message, reason, metadata
        report TEXT,                        -- JSON: report.json
        create_time REAL NOT NULL,
        start_time REAL,
        end_time REAL
    );
    CREATE INDEX operations_by_time ON operations (create_time, name);
    CREATE INDEX operations_by_state ON operations (state);
    CREATE TABLE artifacts (
        operation TEXT NOT NULL REFERENCES operations (name) ON DELETE CASCADE,
        name TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        media_type TEXT NOT NULL,
        PRIMARY KEY (operation, name)
    );
    CREATE INDEX artifacts_by_digest ON artifacts (sha256);
    """,
    # 1 -> 2: uploads, so that retention can forget blobs nobody has used for a while
    """
    CREATE TABLE uploads (
        sha256 TEXT NOT NULL,
        filename TEXT NOT NULL,
        archive INTEGER NOT NULL,
        size_bytes INTEGER NOT NULL,
        last_used REAL NOT NULL,
        PRIMARY KEY (sha256, filename)
    );
    """,
    # 2 -> 3: the seconds a job's attempts have run, so that its time budget spans a restart's re-run
    """
    ALTER TABLE operations ADD COLUMN ran_s REAL NOT NULL DEFAULT 0;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


class StoreVersionError(RuntimeError):
    """The database was written by a newer release."""


@dataclass
class JobRecord:
    name: str
    body_sha256: str
    request: bytes
    spec: dict[str, Any]
    labels: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None
    time_budget_s: float | None = None
    state: str = QUEUED
    progress: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    error: JobError | None = None
    report: dict[str, Any] | None = None
    create_time: float = field(default_factory=time.time)
    start_time: float | None = None
    end_time: float | None = None
    ran_s: float = 0.0  # seconds its attempts have run (to their last progress event): what its time budget spent
    artifacts: list[ArtifactRecord] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.state in FINISHED


@dataclass(frozen=True)
class ArtifactRecord:
    name: str
    sha256: str
    size_bytes: int
    media_type: str


_JSON_COLUMNS = ("spec", "labels", "progress", "error", "report")
_EMPTY: dict[str, Any] = {"spec": {}, "labels": {}, "progress": {}, "error": None, "report": None}  # a damaged value
_COLUMNS = ("name", "request_id", "body_sha256", "request", "spec", "labels", "time_budget_s", "state", "progress",
            "attempt", "error", "report", "create_time", "start_time", "end_time", "ran_s")


def migrate(db: sqlite3.Connection) -> int:
    """Bring `db` to SCHEMA_VERSION; returns the version it had."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreVersionError(f"the job store has schema version {version}, newer than this release knows "
                                f"({SCHEMA_VERSION}); run a newer osscar or point OSSCAR_HOME elsewhere")
    for target in range(version, SCHEMA_VERSION):
        # executescript commits first; the explicit transaction makes each step all-or-nothing
        db.executescript(f"BEGIN; {MIGRATIONS[target]} PRAGMA user_version = {target + 1}; COMMIT;")
    return version


class JobStore:
    """Operations and artifacts in SQLite. Called from one thread (the server's event loop); every
    method commits before it returns."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        # a torn write's bytes that are not UTF-8 raised from inside fetchall(), before `_record` could set the one
        # row aside: decoded with replacement characters, they fail its JSON check instead
        self.db.text_factory = lambda raw: raw.decode("utf-8", "replace")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA busy_timeout = 5000")
        migrate(self.db)

    def close(self) -> None:
        self.db.close()

    def ping(self) -> bool:
        try:
            self.db.execute("SELECT 1").fetchone()
            return True
        except sqlite3.Error:
            return False

    # ---- operations ---------------------------------------------------------------------------------

    def insert(self, record: JobRecord) -> None:
        values = [_encode(c, getattr(record, c)) for c in _COLUMNS]
        self.db.execute(f"INSERT INTO operations ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                        values)

    def get(self, name: str) -> JobRecord | None:
        row = self.db.execute("SELECT * FROM operations WHERE name = ?", (name,)).fetchone()
        return self._record(row) if row else None

    def by_request_id(self, request_id: str) -> JobRecord | None:
        row = self.db.execute("SELECT * FROM operations WHERE request_id = ?", (request_id,)).fetchone()
        return self._record(row) if row else None

    def update(self, name: str, artifacts: Sequence[ArtifactRecord] | None = None, **fields: Any) -> None:
        """Set columns of an operation; with `artifacts`, replace its artifacts in the same transaction (a
        job's final state and the artifacts it vouches for are one change: a crash between two would leave
        a running job naming artifacts, or a finished one naming none)."""
        bad = set(fields) - set(_COLUMNS[1:])
        assert not bad, f"not operation columns: {sorted(bad)}"
        values = [*(_encode(c, v) for c, v in fields.items()), name]
        sets = ", ".join(f"{c} = ?" for c in fields)
        if artifacts is None:
            self.db.execute(f"UPDATE operations SET {sets} WHERE name = ?", values)
            return
        self.db.execute("BEGIN")
        try:
            if fields:
                self.db.execute(f"UPDATE operations SET {sets} WHERE name = ?", values)
            self.db.execute("DELETE FROM artifacts WHERE operation = ?", (name,))
            self.db.executemany("INSERT INTO artifacts VALUES (?, ?, ?, ?, ?)",
                                [(name, a.name, a.sha256, a.size_bytes, a.media_type) for a in artifacts])
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # else the ROLLBACK's own error would hide the real one (disk I/O error)
                self.db.execute("ROLLBACK")
            raise

    def in_states(self, states: Iterable[str]) -> list[JobRecord]:
        states = list(states)
        rows = self.db.execute(f"SELECT * FROM operations WHERE state IN ({', '.join('?' * len(states))}) "
                               "ORDER BY create_time, name", states).fetchall()
        return [r for r in map(self._record, rows) if r.state in states]  # a damaged row leaves them, failed

    def counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT state, COUNT(*) FROM operations GROUP BY state").fetchall())

    def count(self, state: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM operations WHERE state = ?", (state,)).fetchone()[0]

    def page(self, where: Sequence[tuple[str, Any]], after: tuple[float, str] | None, limit: int) -> list[JobRecord]:
        """Operations in creation order after the cursor `after` (create_time, name), filtered by
        `where`: (SQL condition with one placeholder, value) pairs over the columns."""
        clauses, values = [], []
        for condition, value in where:
            clauses.append(condition)
            values.append(value)
        if after is not None:
            clauses.append("(create_time, name) > (?, ?)")
            values += list(after)
        sql = "SELECT * FROM operations" + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
        rows = self.db.execute(sql + " ORDER BY create_time, name LIMIT ?", [*values, limit]).fetchall()
        return [self._record(r) for r in rows]

    def search(self, filter_text: str, size: int, page_token: str,
               weigh: Callable[[JobRecord], int] | None = None, budget: int = 0) -> tuple[list[JobRecord], str]:
        """One page of `size` operations matching the filter, after the page token's cursor; returns them
        and the next page's token ("" on the last page). With `weigh`, the page also ends before the records'
        summed weights pass `budget` (never empty): the size of a message that must stay under a cap, as AIP-158
        lets a page hold fewer than asked."""
        where = parse_filter(filter_text)
        fingerprint = hashlib.sha256(filter_text.encode()).hexdigest()[:16]
        after = decode_page_token(page_token, fingerprint) if page_token else None
        records = self.page(where, after, size + 1)
        if weigh is not None:
            total = 0
            for i, record in enumerate(records[:size]):
                total += weigh(record)
                if i and total > budget:
                    return records[:i], encode_page_token(records[i - 1], fingerprint)
        if len(records) <= size:
            return records, ""
        records = records[:size]
        return records, encode_page_token(records[-1], fingerprint)

    def delete(self, name: str) -> list[str]:
        """Forget an operation; returns the digests of its artifacts that no other operation uses."""
        digests = [r[0] for r in self.db.execute("SELECT sha256 FROM artifacts WHERE operation = ?", (name,))]
        self.db.execute("BEGIN")
        try:
            self.db.execute("DELETE FROM operations WHERE name = ?", (name,))
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # else the ROLLBACK's own error would hide the real one (disk I/O error)
                self.db.execute("ROLLBACK")
            raise
        return [d for d in set(digests) if not self.referenced(d)]

    def finished_before(self, cutoff: float) -> list[str]:
        states = list(FINISHED)
        rows = self.db.execute(f"SELECT name FROM operations WHERE state IN ({', '.join('?' * len(states))}) "
                               "AND end_time < ?", [*states, cutoff])
        return [r[0] for r in rows]

    # ---- artifacts and uploads ----------------------------------------------------------------------

    def set_artifacts(self, name: str, artifacts: Sequence[ArtifactRecord]) -> None:
        self.update(name, artifacts=artifacts)

    def referenced(self, digest: str) -> bool:
        hit = self.db.execute("SELECT 1 FROM artifacts WHERE sha256 = ? UNION ALL SELECT 1 FROM uploads WHERE "
                              "sha256 = ? LIMIT 1", (digest, digest)).fetchone()
        return hit is not None

    def record_upload(self, digest: str, filename: str, archive: bool, size: int) -> None:
        self.db.execute("INSERT INTO uploads VALUES (?, ?, ?, ?, ?) ON CONFLICT (sha256, filename) DO UPDATE SET "
                        "last_used = excluded.last_used", (digest, filename, int(archive), size, time.time()))

    def has_upload(self, digest: str, filename: str) -> bool:
        return self.db.execute("SELECT 1 FROM uploads WHERE sha256 = ? AND filename = ?",
                               (digest, filename)).fetchone() is not None

    def forget_upload(self, digest: str, filename: str) -> None:
        self.db.execute("DELETE FROM uploads WHERE sha256 = ? AND filename = ?", (digest, filename))

    def touch_upload(self, digest: str, filename: str) -> None:
        self.db.execute("UPDATE uploads SET last_used = ? WHERE sha256 = ? AND filename = ?",
                        (time.time(), digest, filename))

    def forget_uploads_before(self, cutoff: float) -> list[tuple[str, str]]:
        rows = self.db.execute("SELECT sha256, filename FROM uploads WHERE last_used < ?", (cutoff,)).fetchall()
        self.db.execute("DELETE FROM uploads WHERE last_used < ?", (cutoff,))
        return [(r[0], r[1]) for r in rows]

    def _set_aside(self, values: dict[str, Any], damaged: list[str]) -> None:
        """Replace a row's unreadable columns with empty values, once (stored: the next read is clean). A finished
        job whose outcome still reads (only its labels or progress lost) keeps it; any other job is FAILED, as
        nothing can run or report it."""
        keeps = values["state"] in FINISHED and set(damaged) <= {"labels", "progress"}
        if not keeps:
            values.update(state=FAILED, error=JobError.of(
                "internal", f"the job's record in the store is damaged ({', '.join(damaged)} unreadable)"))
            values["end_time"] = values["end_time"] or time.time()
        log.error("operation %s: its stored %s cannot be read; %s", values["name"], ", ".join(damaged),
                  "emptied" if keeps else "it is marked FAILED")
        fields = {column: values[column] for column in {*damaged, "state", "error", "end_time"}}
        sets = ", ".join(f"{c} = ?" for c in fields)
        self.db.execute(f"UPDATE operations SET {sets} WHERE name = ?",
                        [*(_encode(c, v) for c, v in fields.items()), values["name"]])

    def _record(self, row: sqlite3.Row) -> JobRecord:
        values: dict[str, Any] = {}
        damaged = []
        for column in _COLUMNS:
            values[column] = row[column]
            if column in _JSON_COLUMNS and row[column] is not None:
                try:
                    values[column] = json.loads(row[column])
                    if not isinstance(values[column], dict):  # `null` or a list where an object was written
                        raise TypeError(f"{column} is a JSON {type(values[column]).__name__}")
                    if column == "error":
                        values[column] = JobError.from_dict(values[column])
                except (ValueError, TypeError, KeyError, AttributeError):
                    damaged.append(column)
                    values[column] = copy.copy(_EMPTY[column])
        if damaged:  # one bad row must not stop the server's start, nor every listing that reaches it
            self._set_aside(values, damaged)
        record = JobRecord(**values)
        record.artifacts = [ArtifactRecord(r["name"], r["sha256"], r["size_bytes"], r["media_type"]) for r in
                            self.db.execute("SELECT * FROM artifacts WHERE operation = ? ORDER BY name",
                                            (record.name,))]
        return record


def _encode(column: str, value: Any) -> Any:
    if isinstance(value, JobError):
        value = value.to_dict()
    if column in _JSON_COLUMNS and value is not None:
        return json.dumps(value, sort_keys=True)
    return value


# ---- listing -----------------------------------------------------------------------------------------


def parse_filter(text: str) -> list[tuple[str, Any]]:
    """The AIP-160 subset we serve: `key = value` terms joined by AND over state, done, model, calibration,
    method and labels.<key>; returns (SQL condition with one placeholder, value) pairs for `JobStore.page`."""
    where: list[tuple[str, Any]] = []
    if not text.strip():
        return where
    for term in _filter_terms(text.strip()):
        match = _FILTER_TERM.match(term)
        if not match:
            raise InvalidArgument([FieldViolation("filter", f"cannot parse {term!r}; expected key = value terms "
                                                            "joined by AND")])
        key, value = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
        if key == "state":
            if value.upper() not in STATES:
                raise InvalidArgument([FieldViolation("filter", f"unknown state {value!r}")])
            where.append(("state = ?", value.upper()))
        elif key == "done":
            if value not in ("true", "false"):
                raise InvalidArgument([FieldViolation("filter", "done takes true or false")])
            finished = ", ".join(f"'{s}'" for s in FINISHED)
            where.append((f"(state IN ({finished})) = ?", int(value == "true")))
        elif key in ("model", "calibration"):
            where.append((f"json_extract(spec, '$.references.{key}') = ?", value))
        elif key == "method":  # a request that named none ran the default
            where.append((f"COALESCE(json_extract(spec, '$.resolved.method'), '{DEFAULT_METHOD}') = ?", value))
        elif key.startswith("labels.") and LABEL_KEY.match(key[7:]):
            where.append((f"json_extract(labels, '$.\"{key[7:]}\"') = ?", value))
        else:
            raise InvalidArgument([FieldViolation("filter", f"unknown filter field {key!r}; known: state, done, "
                                                            "model, calibration, method, labels.<key>")])
    return where


def _filter_terms(text: str) -> list[str]:
    """The terms of `text` joined by AND outside double quotes (a quoted label value may hold " AND ")."""
    terms, start, quoted = [], 0, False
    for match in re.finditer(r'"|\s+AND\s+', text):
        if match.group() == '"':
            quoted = not quoted
        elif not quoted:
            terms.append(text[start:match.start()])
            start = match.end()
    return [*terms, text[start:]]


def encode_page_token(last: JobRecord, fingerprint: str) -> str:
    """The cursor after `last`, bound to the filter's fingerprint."""
    return base64.urlsafe_b64encode(json.dumps({"t": last.create_time, "n": last.name, "f": fingerprint}).encode()
                                    ).decode()


def decode_page_token(token: str, fingerprint: str) -> tuple[float, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        after = (float(data["t"]), str(data["n"]))
        same_filter = data["f"] == fingerprint
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise InvalidArgument([FieldViolation("page_token", "not a page token from this server")]) from None
    if not same_filter:
        raise InvalidArgument([FieldViolation("page_token", "the page token belongs to another filter")])
    return after
