"""A worker's device, taken by one shard at a time in the order the shards asked for it.

A shard asks (ask) with what the shard before it needs to prepare its first batches (its engine, their
requests, their preloads), waits for its turn (take), and gives the device back (give_back). The shard on
the device prepares the first batches of the shard next in line (next_to_prepare) from its last batches'
`then`, so the order the device goes in must be the order of the line: a plain lock wakes any waiter.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from typing import Any


class DeviceTurns:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._line: deque[Hashable] = deque()  # shards waiting for the device, first in line first
        self._to_prepare: dict[Hashable, Any] = {}  # of those, the ones whose first batches nobody took
        self._taken = False

    def ask(self, key: Hashable, first_batches: Any) -> None:
        with self._changed:
            self._line.append(key)
            self._to_prepare[key] = first_batches

    def take(self, key: Hashable) -> None:
        """Block until the device is free and `key` is first in line, then hold it."""
        with self._changed:
            self._changed.wait_for(lambda: not self._taken and self._line and self._line[0] == key)
            self._line.popleft()
            self._to_prepare.pop(key, None)
            self._taken = True

    def give_back(self) -> None:
        with self._changed:
            self._taken = False
            self._changed.notify_all()

    def leave(self, key: Hashable) -> None:
        """Out of the line, for a shard that ends without its turn (an error); a no-op after take."""
        with self._changed:
            if key in self._line:
                self._line.remove(key)
                self._to_prepare.pop(key, None)
                self._changed.notify_all()

    def next_to_prepare(self) -> Any | None:
        """What the shard first in line gave to prepare its first batches, once (None when nobody waits or it
        was taken)."""
        with self._changed:
            if not self._line:
                return None
            return self._to_prepare.pop(self._line[0], None)

    def busy(self) -> bool:
        """Whether a shard holds the device or waits for it."""
        with self._changed:
            return self._taken or bool(self._line)

    def waiting(self) -> int:
        with self._changed:
            return len(self._line)
