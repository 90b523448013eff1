"""`LRU`: the one per-session cache type (bounded by count, or by the sum of a weight such as bytes; oldest use
evicted first, idle entries found by age).

Every per-session cache in the library and the services is one of these: the runtime's session states, the
gateway's derivations, the UI's session headers, the raw tee's bases (by bytes) and a raw reader's request bodies
(by bytes)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most `max_size` entries, or with `weigh`, entries whose weights add up to at most `max_size` (the newest
    is kept whatever it weighs); `on_evict(key, value)` is called for each entry pushed out by a newer one."""

    __slots__ = ("_entries", "_used", "_weight", "max_size", "on_evict", "weigh")

    def __init__(
        self,
        max_size: int,
        on_evict: Callable[[K, V], None] | None = None,
        *,
        weigh: Callable[[V], int] | None = None,
    ) -> None:
        self.max_size = max_size
        self.on_evict = on_evict
        self.weigh = weigh
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._used: dict[K, float] = {}  # monotonic time of each entry's last use
        self._weight = 0  # the entries' weights added up (with `weigh`)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def __setitem__(self, key: K, value: V) -> None:
        self.put(key, value)

    def get(self, key: K) -> V | None:
        """The entry, without counting it as a use (`use` does)."""
        return self._entries.get(key)

    def use(self, key: K) -> V | None:
        """The entry, now the most recently used."""
        value = self._entries.get(key)
        if value is not None:
            self.touch(key)
        return value

    def touch(self, key: K) -> None:
        """Count a use of the entry (none: nothing to do, it was dropped meanwhile)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            self._used[key] = time.monotonic()

    def put(self, key: K, value: V) -> None:
        weigh = self.weigh
        if weigh is not None:
            old = self._entries.get(key)
            self._weight += weigh(value) - (weigh(old) if old is not None else 0)
        self._entries[key] = value
        self.touch(key)
        while self._over():
            oldest, evicted = self._entries.popitem(last=False)
            self._used.pop(oldest, None)
            if weigh is not None:
                self._weight -= weigh(evicted)
            if self.on_evict is not None:
                self.on_evict(oldest, evicted)

    def _over(self) -> bool:
        if self.weigh is None:
            return len(self._entries) > self.max_size
        return self._weight > self.max_size and len(self._entries) > 1

    def pop(self, key: K) -> V | None:
        self._used.pop(key, None)
        value = self._entries.pop(key, None)
        if value is not None and self.weigh is not None:
            self._weight -= self.weigh(value)
        return value

    def values(self) -> list[V]:
        return list(self._entries.values())

    def idle_since(self, cutoff: float) -> list[K]:
        """Keys not used since monotonic time `cutoff`."""
        return [key for key, used in self._used.items() if used < cutoff]
