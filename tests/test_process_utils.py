"""process_utils.freeze_startup_heap: what exists when it runs leaves the cyclic collector's reach; cycles made after
it are still collected."""
from __future__ import annotations

import gc
import weakref

from pagellm.process_utils import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.partner: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.partner, b.partner = b, a
    return weakref.ref(a)


def test_the_startup_heap_is_frozen_and_later_cycles_still_collected():
    before = _cycle()  # garbage already when the heap is frozen: collected first, not frozen
    startup = _Node()
    try:
        freeze_startup_heap()
        assert before() is None
        assert gc.get_freeze_count() > 0
        assert not any(obj is startup for obj in gc.get_objects())  # frozen objects are no longer tracked
        after = _cycle()
        gc.collect()
        assert after() is None
    finally:
        gc.unfreeze()
