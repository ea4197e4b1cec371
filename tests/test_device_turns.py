"""The device goes to shards in the order they asked for it; each first batch is given out to prepare once."""

from __future__ import annotations

import threading
import time

from pipeline.device_turns import DeviceTurns


def test_the_device_goes_in_line_and_a_shard_that_leaves_gives_up_its_place():
    turns = DeviceTurns()
    for key in "abcd":
        turns.ask(key, f"first batch of {key}")
    turns.take("a")
    assert turns.next_to_prepare() == "first batch of b" and turns.next_to_prepare() is None  # given once
    took: list[str] = []

    def take(key: str) -> None:
        turns.take(key)
        took.append(key)
        turns.give_back()

    threads = [threading.Thread(target=take, args=(key,)) for key in "db"]  # asking to take out of line
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert took == []  # a holds the device
    turns.leave("c")  # its shard ended before its turn (an error): d need not wait for it
    turns.leave("a")  # a no-op: a took its turn
    turns.give_back()
    for t in threads:
        t.join(timeout=10)
    assert took == ["b", "d"] and turns.waiting() == 0
