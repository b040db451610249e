"""Radix prefix cache at page granularity.

Each edge of the tree is one full page of tokens; a path from the root spells a prefix that
was computed before, and each node keeps the KV page that holds its tokens. The tree holds one
reference on every page it caches; a request that reuses a prefix takes a reference on each
matched page, so eviction (LRU over leaves that only the tree references) never frees a page a
running request reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ftrs.kvcache.pages import PagePool


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_use: int = 0


class RadixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_cached_pages = 0

    def _chunks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.pool.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def match(self, tokens: list[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix (at most `max_pages`), each with a new reference."""
        node, pages, now = self.root, [], next(self._clock)
        for chunk in self._chunks(tokens)[:max_pages]:
            child = node.children.get(chunk)
            if child is None:
                break
            child.last_use = now
            self.pool.ref(child.page)
            pages.append(child.page)
            node = child
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Cache the full pages of `tokens` (page i holds chunk i). Takes the tree's own refs."""
        node, now = self.root, next(self._clock)
        for chunk, page in zip(self._chunks(tokens), pages):
            child = node.children.get(chunk)
            if child is None:
                child = _Node(chunk, page, node)
                node.children[chunk] = child
                self.pool.ref(page)
                self.pool.set_cached(page, True)
                self.num_cached_pages += 1
            child.last_use = now
            node = child

    def evictable(self) -> int:
        """Pages that only the tree references (freed by `evict`). O(1): counted by the pool."""
        return self.pool.num_idle_cached

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, n: int) -> int:
        """Free up to `n` pages, least recently used leaves first; returns how many were freed."""
        freed = 0
        while freed < n:
            leaves = [x for x in self._nodes() if not x.children and self.pool.refcount[x.page] == 1]
            if not leaves:
                break
            leaves.sort(key=lambda x: x.last_use)
            for leaf in leaves[: n - freed]:
                assert leaf.parent is not None
                del leaf.parent.children[leaf.key]
                self.pool.unref(leaf.page)
                self.pool.set_cached(leaf.page, False)
                self.num_cached_pages -= 1
                freed += 1
        return freed
