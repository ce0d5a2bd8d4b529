"""The servicers' own rules: a page of operations never passes the message cap."""

import asyncio

from google.longrunning import operations_pb2

from service.core.store import JobRecord, JobStore
from service.server.servicers import OperationsServicer


def record(name: str, t: float, note: str = "") -> JobRecord:
    return JobRecord(name=name, body_sha256="b" * 64, request=b"\x08\x01", spec={}, labels={"note": note},
                     create_time=t)


class _Jobs:
    """JobService.list over a real store (the paging is the store's; the servicer weighs the messages)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def list(self, filter_text, page_size, page_token, weigh=None, budget=0):
        return self.store.search(filter_text, page_size, page_token, weigh, budget)


def test_a_page_of_large_operations_ends_under_the_message_cap_and_its_token_goes_on(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    for i in range(30):  # ~100 kB each, as a six-layer encoder's report is
        store.insert(record(f"operations/{i:02d}", float(i), "x" * 100_000))
    servicer = OperationsServicer(_Jobs(store), max_message_bytes=1 << 20)
    names, token, pages = [], "", 0
    while True:
        page = asyncio.run(servicer.ListOperations(
            operations_pb2.ListOperationsRequest(name="operations", page_size=100, page_token=token), None))
        assert 0 < len(page.operations) < 11 and page.ByteSize() <= 1 << 20
        names += [op.name for op in page.operations]
        token, pages = page.next_page_token, pages + 1
        if not token:
            break
    assert names == [f"operations/{i:02d}" for i in range(30)] and pages >= 3
    # small operations still fill the page asked for
    small = JobStore(tmp_path / "small.sqlite")
    for i in range(5):
        small.insert(record(f"operations/{i}", float(i)))
    page = asyncio.run(OperationsServicer(_Jobs(small), max_message_bytes=1 << 20).ListOperations(
        operations_pb2.ListOperationsRequest(page_size=3), None))
    assert len(page.operations) == 3 and page.next_page_token


def test_the_client_receives_the_largest_message_a_server_may_be_set_to_send():
    from service.client.transport import MAX_RECEIVE_BYTES
    from service.server.settings import ServerSettings

    largest = max(getattr(m, "le", 0) for m in ServerSettings.model_fields["max_message_mb"].metadata)
    assert largest << 20 == MAX_RECEIVE_BYTES and largest >= 8
