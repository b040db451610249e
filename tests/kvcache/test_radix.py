"""Page pool and radix prefix cache: refcounts, matching, LRU eviction of unreferenced pages."""

from __future__ import annotations

from ftrs.kvcache.pages import PagePool
from ftrs.kvcache.radix import RadixCache


def test_pool_refcounts_return_pages_exactly_once() -> None:
    pool = PagePool(4, 2)
    a = pool.alloc(3)
    assert a is not None and pool.num_free == 1
    assert pool.alloc(2) is None and pool.num_free == 1  # all-or-nothing
    pool.ref(a[0])
    pool.unref(a[0])
    assert pool.num_free == 1
    for p in a:
        pool.unref(p)
    assert pool.num_free == 4


def test_match_takes_refs_and_eviction_spares_pages_in_use() -> None:
    pool = PagePool(8, 2)
    radix = RadixCache(pool)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    pages = pool.alloc(4)
    assert pages is not None
    radix.insert(tokens, pages)  # 3 full pages cached; the partial 4th is not
    for p in pages:
        pool.unref(p)
    assert radix.num_cached_pages == 3 and pool.num_free == 5
    hit = radix.match([1, 2, 3, 4, 9, 9], max_pages=10)
    assert hit == pages[:2]
    assert radix.evict(10) == 1  # only the unreferenced leaf [5, 6] can go
    assert radix.match([1, 2, 3, 4, 5, 6], max_pages=10) == pages[:2]  # [5, 6] was evicted
    for p in hit + pages[:2]:
        pool.unref(p)
    assert radix.evict(10) == 2 and pool.num_free == 8


def test_lru_order_of_eviction() -> None:
    pool = PagePool(4, 1)
    radix = RadixCache(pool)
    for tok in ([1], [2], [3]):
        pages = pool.alloc(1)
        assert pages is not None
        radix.insert(tok, pages)
        pool.unref(pages[0])
    got = radix.match([1], 1)  # touch [1]: now [2] is the least recently used
    pool.unref(got[0])
    assert radix.evict(1) == 1
    assert radix.match([2], 1) == []
    assert len(radix.match([1], 1)) == 1 and len(radix.match([3], 1)) == 1


def test_evictable_count_matches_a_walk_of_the_tree() -> None:
    import random

    rng = random.Random(0)
    pool = PagePool(64, 2)
    radix = RadixCache(pool)
    held: list[list[int]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4:  # a request finishes: its pages go into the tree
            tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 9))]
            pages = pool.alloc(-(-len(tokens) // 2)) or []
            if pages:
                radix.insert(tokens, pages)
                for p in pages:
                    pool.unref(p)
        elif op < 0.7:  # a request matches a prefix and holds it
            held.append(radix.match([rng.randrange(3) for _ in range(8)], 4))
        elif op < 0.9 and held:  # ... and lets it go
            for p in held.pop(rng.randrange(len(held))):
                pool.unref(p)
        else:
            radix.evict(rng.randrange(1, 4))
        walked = sum(1 for n in radix._nodes() if pool.refcount[n.page] == 1)
        assert radix.evictable() == walked
        assert radix.num_cached_pages == len(radix._nodes())
