"""The collector spares the objects alive before a region (graphmem/capture/old_objects.py): frozen on
entry and on each nested entry, unfrozen when the outermost region ends; a process's own freeze, or its
collector turned off, is left as it is."""
from __future__ import annotations

import gc

from graphmem.capture.old_objects import old_objects_frozen


def test_objects_frozen_inside_and_unfrozen_after_the_outermost() -> None:
    assert gc.get_freeze_count() == 0
    with old_objects_frozen():
        outer = gc.get_freeze_count()
        made = [[] for _ in range(1000)]  # (young objects, frozen by the next region's entry)
        with old_objects_frozen():
            assert gc.get_freeze_count() >= outer + len(made) > 0
        assert gc.get_freeze_count() > 0  # the outermost region still holds them
    assert gc.get_freeze_count() == 0


def test_a_process_own_freeze_and_a_disabled_collector_are_left_alone() -> None:
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with old_objects_frozen():
            pass
        assert gc.get_freeze_count() == before  # not unfrozen by graphmem
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with old_objects_frozen():
            assert gc.get_freeze_count() == 0 and not gc.isenabled()
    finally:
        gc.enable()


def test_a_decorated_call_is_one_region() -> None:
    @old_objects_frozen()
    def inside() -> int:
        return gc.get_freeze_count()

    assert inside() > 0 and gc.get_freeze_count() == 0
