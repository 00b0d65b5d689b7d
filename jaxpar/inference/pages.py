"""Host-side bookkeeping of a paged KV cache: which page holds which positions of which sequence.

The device holds one pool of ``num_pages`` pages per layer, each ``page_size`` positions. Page 0 is the
null page: all zeros, never allocated, and every unused entry of a page table points at it. This module
never touches the device; it decides which page ids a step reads and writes.

* **Reference counts.** A page is referenced once by every sequence whose table holds it. A sequence
  writes only to pages it alone references (``check_writable``), so a shared page is never written.
* **Prefix sharing.** A *full* page is named by a chained SHA-256 of the tokens up to its end
  (``page_hashes``). When a prompt arrives, its leading full pages found in the index are shared, not
  recomputed. At most ``(len(prompt) - 1) // page_size`` pages are shared, so the prompt's last token is
  always computed (its logits start generation) and every write lands in a page of its own. A page whose
  last reference goes keeps its contents and its name, as an evictable cached page, until the pool needs
  it (least recently released first).
* **Forks** share the full pages and copy the partial last page (``fork`` returns the copy to make).
* **Rollback** (speculative decoding) lowers a length; pages past it go back to the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """The pool has no free or evictable page left: the scheduler preempts a sequence and retries."""


def page_hashes(tokens, page_size: int, /, salt: bytes = b"") -> list[bytes]:
    """One name per full page of ``tokens``: SHA-256 of the previous page's name and this page's tokens;
    the first page's "previous name" is ``salt`` (what else the K/V depend on: the adapter)."""
    names, previous = [], salt
    for start in range(0, len(tokens) - page_size + 1, page_size):
        chunk = np.asarray(tokens[start : start + page_size], dtype=np.int64).tobytes()
        previous = hashlib.sha256(previous + chunk).digest()
        names.append(previous)
    return names


@dataclasses.dataclass
class _Sequence:
    pages: list[int]
    length: int = 0  # positions whose K/V are in the cache
    named: int = 0  # leading pages registered in the prefix index
    looked: int = 0  # prefix pages looked up when admitted
    salt: bytes = b""  # ``page_hashes``'s salt: pages are shared only between sequences of one salt


class PagedAllocator:
    """Pages of a pool handed to sequences, with reference counts and a prefix index (see module doc)."""

    def __init__(self, num_pages: int, page_size: int, /, *, prefix_cache: bool = True):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} (≥ 2: page 0 is the null page), page_size={page_size} (≥ 1)")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = np.zeros(num_pages, np.int64)
        self._free = collections.deque(range(1, num_pages))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # ref 0, named
        self._index: dict[bytes, int] = {}
        self._name: dict[int, bytes] = {}
        self.seqs: dict[object, _Sequence] = {}
        self.hits = self.lookups = 0  # prefix pages found / looked for
        self.prefix_cache = prefix_cache  # False: nothing is shared, nothing named

    # ------------------------------------------------------------------------------------- the pool
    @property
    def available(self) -> int:
        """Pages a sequence could get now: free ones and cached ones that may be evicted."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        return int((self.refs[1:] > 0).sum())

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        if not self._cached:
            raise OutOfPages(f"all {self.num_pages - 1} pages are in use")
        page, _ = self._cached.popitem(last=False)
        del self._index[self._name.pop(page)]
        return page

    def _retain(self, page: int) -> None:
        if self.refs[page] == 0:
            self._cached.pop(page)
        self.refs[page] += 1

    def _release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self._name:
                self._cached[page] = None
            else:
                self._free.append(page)

    def forget(self) -> None:
        """Drop the prefix index: every cached page goes back to the free pool unnamed (the weights that
        computed them changed). Pages in use keep their contents, unnamed."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._index.clear()
        self._name.clear()

    def _pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    # --------------------------------------------------------------------------------- sequences
    def admit(self, seq_id, prompt, /, *, share: bool = True, salt: bytes = b"") -> int:
        """Start ``seq_id`` with the longest shareable prefix of ``prompt`` already cached; returns how
        many of its positions need no computing (a multiple of ``page_size``). ``share=False``: none
        (every position is computed, e.g. for its log-probs). ``salt``: the pages it shares and names
        are those of sequences with the same salt (``page_hashes``)."""
        if seq_id in self.seqs:
            raise KeyError(f"sequence {seq_id!r} is already admitted")
        shareable = (
            page_hashes(prompt, self.page_size, salt)[: (len(prompt) - 1) // self.page_size]
            if self.prefix_cache and share
            else []
        )
        pages = []
        for name in shareable:
            page = self._index.get(name)
            if page is None:
                break
            self._retain(page)
            pages.append(page)
        self.lookups += len(shareable)
        self.hits += len(pages)
        self.seqs[seq_id] = _Sequence(pages, len(pages) * self.page_size, len(pages), len(shareable), salt)
        return len(pages) * self.page_size

    def unadmit(self, seq_id, /) -> None:
        """Undo ``admit`` (the scheduler found no room for the first chunk): pages released, and the
        prefix lookup taken back out of ``hits`` and ``lookups`` so a retried admission counts once."""
        seq = self.seqs[seq_id]
        self.hits -= seq.named
        self.lookups -= seq.looked
        self.free(seq_id)

    def reserve(self, seq_id, length: int, /) -> None:
        """Give ``seq_id`` pages for positions below ``length``; all or none (``OutOfPages``)."""
        seq = self.seqs[seq_id]
        need = self._pages_for(length) - len(seq.pages)
        if need > self.available:
            raise OutOfPages(f"sequence {seq_id!r} needs {need} more pages, {self.available} available")
        new = [self._take() for _ in range(need)]
        self.refs[new] += 1
        seq.pages += new

    def commit(self, seq_id, tokens, /) -> None:
        """``tokens`` (all of the sequence's tokens so far) now have their K/V in the cache: set the
        length, and name the pages that became full so later prompts can share them."""
        seq = self.seqs[seq_id]
        if len(tokens) > len(seq.pages) * self.page_size:
            raise ValueError(
                f"sequence {seq_id!r}: {len(tokens)} positions but pages for {len(seq.pages) * self.page_size}"
            )
        seq.length = len(tokens)
        names = page_hashes(tokens, self.page_size, seq.salt) if self.prefix_cache else []
        for i in range(seq.named, len(names)):
            page = seq.pages[i]
            if names[i] not in self._index and page not in self._name:
                self._index[names[i]], self._name[page] = page, names[i]
        seq.named = len(names)

    def rollback(self, seq_id, length: int, /) -> None:
        """Forget positions ≥ ``length`` (rejected draft tokens); pages past it return to the pool."""
        seq = self.seqs[seq_id]
        if length < seq.named * self.page_size or length > seq.length:
            raise ValueError(
                f"sequence {seq_id!r}: cannot roll back to {length} "
                f"(named pages end at {seq.named * self.page_size}, length {seq.length})"
            )
        keep = self._pages_for(length)
        for page in seq.pages[keep:]:
            self._release(page)
        seq.pages, seq.length = seq.pages[:keep], length

    def fork(self, parent, child, /) -> tuple[int, int] | None:
        """Start ``child`` as a copy of ``parent``: full pages shared, the partial last page copied.
        Returns ``(source, destination)`` of the page copy the device must make, or None."""
        seq = self.seqs[parent]
        full = seq.length // self.page_size
        partial = len(seq.pages) > full and seq.length % self.page_size
        if partial and not self.available:
            raise OutOfPages(f"forking {parent!r}: no page for the partial last page")
        for page in seq.pages[:full]:
            self._retain(page)
        pages, copy = list(seq.pages[:full]), None
        if partial:
            copy = (seq.pages[full], self._take())
            self.refs[copy[1]] += 1
            pages.append(copy[1])
        self.seqs[child] = _Sequence(pages, seq.length, min(seq.named, full), salt=seq.salt)
        return copy

    def free(self, seq_id, /) -> None:
        """``seq_id`` finished or was preempted: release its pages (named ones stay cached)."""
        for page in self.seqs.pop(seq_id).pages:
            self._release(page)

    # ------------------------------------------------------------------------------ device inputs
    def table(self, seq_id, width: int, /) -> np.ndarray:
        """The sequence's page ids padded with the null page to ``width`` entries."""
        pages = self.seqs[seq_id].pages if seq_id is not None else []
        if len(pages) > width:
            raise ValueError(f"sequence {seq_id!r} holds {len(pages)} pages, the table has {width}")
        return np.asarray(pages + [NULL_PAGE] * (width - len(pages)), np.int32)

    # -------------------------------------------------------------------------------- invariants
    def check_writable(self, seq_id, start: int, end: int, /) -> None:
        """Positions [start, end) of ``seq_id`` land in pages it alone holds and no prompt shares."""
        seq = self.seqs[seq_id]
        for i in range(start // self.page_size, self._pages_for(end)):
            page = seq.pages[i]
            if self.refs[page] != 1 or page in self._name:
                raise AssertionError(
                    f"sequence {seq_id!r} would write page {page} (refs {self.refs[page]}, "
                    f"named {page in self._name}) at positions [{start}, {end})"
                )

    def check(self) -> None:
        """Every page is exactly one of: null, free, cached (ref 0, named) or held (ref = its holders)."""
        holders = np.zeros(self.num_pages, np.int64)
        for seq in self.seqs.values():
            np.add.at(holders, seq.pages, 1)
        assert holders[NULL_PAGE] == 0 and self.refs[NULL_PAGE] == 0, "the null page was handed out"
        assert (holders == self.refs).all(), "reference counts differ from the page tables"
        free, cached = set(self._free), set(self._cached)
        held = set(np.flatnonzero(self.refs).tolist())
        assert not (free & cached) and not ((free | cached) & held), "a page is both free and held"
        assert len(free) + len(cached) + len(held) == self.num_pages - 1, "a page leaked"
        assert all(p in self._name for p in cached) and set(self._index.values()) == set(self._name)
