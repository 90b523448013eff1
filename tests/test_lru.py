"""`LRU` bounded by count and by weight (the raw tee's bases and a raw reader's bodies are bounded by bytes)."""

from __future__ import annotations

from sessionlog.lru import LRU


def test_by_count_the_least_recently_used_entry_goes_first() -> None:
    evicted: list[str] = []
    cache: LRU[str, int] = LRU(2, on_evict=lambda key, _: evicted.append(key))
    cache.put("a", 1)
    cache.put("b", 2)
    cache.use("a")
    cache.put("c", 3)
    assert list(cache) == ["a", "c"] and evicted == ["b"]


def test_by_weight_entries_go_until_the_weights_fit_and_the_newest_stays_whatever_it_weighs() -> None:
    evicted: list[str] = []
    cache: LRU[str, bytes] = LRU(10, on_evict=lambda key, _: evicted.append(key), weigh=len)
    cache.put("a", b"xxxx")
    cache.put("b", b"yyyy")
    cache.put("a", b"zz")  # replaced: its old weight no longer counts (2 + 4), and it is now the newest
    assert list(cache) == ["b", "a"] and evicted == []
    cache.put("c", b"wwww")  # 4 + 2 + 4 = 10: fits
    assert list(cache) == ["b", "a", "c"]
    cache.put("d", b"v")  # 11: the oldest goes
    assert list(cache) == ["a", "c", "d"] and evicted == ["b"]
    assert cache.pop("c") == b"wwww"
    cache.put("e", b"u" * 6)  # 2 + 1 + 6 = 9 once the popped entry no longer counts
    assert list(cache) == ["a", "d", "e"]
    cache.put("big", b"t" * 50)  # heavier than the bound: everything else goes, it stays
    assert list(cache) == ["big"] and evicted == ["b", "a", "d", "e"]
