"""The engine's view of each instance's prefix store (prefix sharing under the exact block
cache), so that a request's predicted cost counts the prompt blocks an instance already
holds: the scheduler weighs that instance at the shorter first step
(`Scheduler.expect_prefix`), and a request goes where its system prompt is, not to an
instance that would prefill it again.

A worker keeps the prompt blocks of the requests it prefilled (`worker.prefix_cache`). The
engine records the same chain of blocks for each instance it sends a request to, and keeps
the most recently used, at most as many blocks as the instance's KV pool holds. That is an
estimate, as SGLang's cache-aware router keeps of its workers' radix trees: a worker's
store lives in its pool's free rows and gives them up to requests, so a predicted hit may
be gone — the request then prefills in full, as it would have anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dilaserve.protocol import prompt_block_keys


class PrefixIndex:
    """Per instance, the keys of the prompt blocks (of `block` tokens) it is expected to
    hold (`prompt_block_keys`: a block's key covers its tokens and every block before it)."""

    def __init__(self, block: int) -> None:
        if block <= 0:
            raise ValueError(f"prefix blocks need a positive length, got {block}")
        self.block = block
        self._stores: dict[int, OrderedDict[int, None]] = {}  # oldest use first
        self._capacity: dict[int, int] = {}

    def add_instance(self, instance: int, kv_tokens: int) -> None:
        self._stores[instance] = OrderedDict()
        self._capacity[instance] = kv_tokens // self.block

    def remove_instance(self, instance: int) -> None:
        self._stores.pop(instance, None)
        self._capacity.pop(instance, None)

    def keys(self, prompt: Sequence[int]) -> list[int]:
        """The keys of `prompt`'s whole blocks, computed once per request: `record` and
        `longest` take them."""
        return prompt_block_keys(prompt, self.block)

    def record(self, instance: int, keys: Sequence[int]) -> None:
        """`instance` prefills a prompt of these block `keys` (a request sent there): it
        will hold its blocks."""
        store = self._stores.get(instance)
        if store is None:
            return
        # The root used last: evicted last.
        for key in reversed(keys):
            store[key] = None
            store.move_to_end(key)
        while len(store) > self._capacity[instance]:
            store.popitem(last=False)

    def longest(self, chain: Sequence[int]) -> tuple[int, int] | None:
        """(instance, tokens) of the instance expected to hold the longest run of the
        leading blocks of a prompt of block keys `chain`; None if none holds its first."""
        best: tuple[int, int] | None = None
        for instance, store in self._stores.items():
            held = 0
            while held < len(chain) and chain[held] in store:
                held += 1
            if held and (best is None or held * self.block > best[1]):
                best = (instance, held * self.block)
        return best
