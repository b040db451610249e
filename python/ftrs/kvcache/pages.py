"""A pool of fixed-size KV pages with reference counts.

A page holds `page_size` consecutive tokens of one sequence. Invariant: a page is either free
(refcount 0, in the free list) or referenced by at least one owner: a running sequence, or the
prefix cache. A page is returned to the free list exactly when its last reference is dropped.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

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
        self.refcount[page] += 1

    def unref(self, page: int) -> None:
        assert self.refcount[page] > 0, "unref of a free page"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)
