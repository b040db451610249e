"""A pool of fixed-size KV pages with reference counts.

A page holds `page_size` consecutive tokens of one sequence. Invariant: a page is either free
(refcount 0, in the free list) or referenced by at least one owner: a running sequence, or the
prefix cache. A page is returned to the free list exactly when its last reference is dropped.

The pool also counts, in O(1), the pages the prefix cache holds that nobody else references
(`num_idle_cached`): the scheduler reads it every step to report KV usage.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.cached = [False] * num_pages  # held by the prefix cache (one of its references)
        self.num_idle_cached = 0  # cached pages whose only reference is the cache's

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` fresh pages with refcount 1, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def ref(self, page: int) -> None:
        assert self.refcount[page] > 0, "ref of a free page"
        if self.cached[page] and self.refcount[page] == 1:
            self.num_idle_cached -= 1
        self.refcount[page] += 1

    def unref(self, page: int) -> None:
        assert self.refcount[page] > 0, "unref of a free page"
        self.refcount[page] -= 1
        if self.cached[page] and self.refcount[page] == 1:
            self.num_idle_cached += 1
        elif self.cached[page] and self.refcount[page] == 0:
            self.num_idle_cached -= 1
        if self.refcount[page] == 0:
            self._free.append(page)

    def set_cached(self, page: int, cached: bool) -> None:
        """Mark whether one of the page's references is the prefix cache's."""
        if self.cached[page] != cached:
            self.cached[page] = cached
            if self.refcount[page] == 1:
                self.num_idle_cached += 1 if cached else -1
