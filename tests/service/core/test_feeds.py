"""The in-memory event feeds behind watch and wait: followers see each event once, in order, from where they
start, until the end; a slow follower skips to the latest; an ended operation's feed is gone."""

import asyncio
import time

from service.core.feeds import Feed, Feeds


async def _collect(feed: Feed, after: int = 0) -> list[dict]:
    return [event async for event in feed.follow(after)]


def test_a_follower_sees_the_events_after_its_cursor_in_order_and_stops_at_the_end():
    feed = Feed()
    for i in range(3):
        feed.publish({"i": i})
    feed.publish({"i": 3}, done=True)
    assert feed.seq == 4 and feed.done.is_set()
    assert asyncio.run(_collect(feed)) == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]
    assert asyncio.run(_collect(feed, after=2)) == [{"i": 2}, {"i": 3}]
    assert asyncio.run(_collect(feed, after=4)) == []  # nothing new and done: ends at once


def test_a_waiting_follower_is_woken_by_each_new_event_until_the_end():
    async def main():
        feed = Feed()
        follower = asyncio.create_task(_collect(feed))
        await asyncio.sleep(0)  # the follower now waits: there is nothing yet
        assert not follower.done()
        for i in range(3):
            feed.publish({"i": i})
            await asyncio.sleep(0)
        assert not follower.done()  # not done: it waits for more
        feed.publish({"i": 3}, done=True)
        return await asyncio.wait_for(follower, 2)

    assert asyncio.run(main()) == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]


def test_two_followers_each_see_every_event():
    async def main():
        feed = Feed()
        first = asyncio.create_task(_collect(feed))
        await asyncio.sleep(0)
        feed.publish({"i": 0})
        second = asyncio.create_task(_collect(feed, after=feed.seq))  # joins late: starts after what it saw
        await asyncio.sleep(0)
        feed.publish({"i": 1})
        feed.publish({"i": 2}, done=True)
        return await asyncio.wait_for(asyncio.gather(first, second), 2)

    first, second = asyncio.run(main())
    assert first == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert second == [{"i": 1}, {"i": 2}]


def test_a_slow_follower_skips_to_the_latest_events():
    feed = Feed()
    maxlen = feed.events.maxlen
    total = maxlen + 100
    for i in range(total):
        feed.publish({"i": i}, done=i == total - 1)
    events = asyncio.run(_collect(feed))
    assert len(events) == maxlen
    assert events[0] == {"i": total - maxlen} and events[-1] == {"i": total - 1}


def test_publishing_by_name_stamps_the_state_and_time_and_the_end_closes_the_feed():
    feeds = Feeds()
    feed = feeds.of("operations/a")
    assert feeds.of("operations/a") is feed and feeds.of("operations/b") is not feed
    before = time.time()
    feeds.publish("operations/a", "RUNNING", {"message": "round 1", "round": 1})
    (seq, event), = feed.events
    assert seq == 1 and event["state"] == "RUNNING" and event["message"] == "round 1" and event["round"] == 1
    assert before <= event["time"] <= time.time()
    feeds.publish("operations/a", "SUCCEEDED", {"message": "done"}, done=True)
    assert feed.done.is_set() and [e["state"] for _, e in feed.events] == ["RUNNING", "SUCCEEDED"]
    assert feeds.of("operations/a") is not feed  # closed: a later use opens a fresh feed
    assert not feeds.of("operations/b").done.is_set()  # the other operation's feed is untouched


def test_wait_done_returns_at_the_end_or_after_the_timeout_without_raising():
    async def main():
        feeds = Feeds()
        started = time.monotonic()
        await feeds.wait_done("operations/slow", 0.05)  # never ends: returns after the timeout
        timed_out = time.monotonic() - started

        waiter = asyncio.create_task(feeds.wait_done("operations/a", 10))
        await asyncio.sleep(0)
        assert not waiter.done()
        feeds.publish("operations/a", "FAILED", {}, done=True)
        started = time.monotonic()
        await asyncio.wait_for(waiter, 2)
        return timed_out, time.monotonic() - started

    timed_out, woken = asyncio.run(main())
    assert 0.04 <= timed_out < 5 and woken < 5  # woken at the end, long before its 10 s timeout
