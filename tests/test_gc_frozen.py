"""remat's entry points that measure let the garbage collector skip the objects older than the
call (remat.measure.events.older_objects_frozen): each measurement's collection walks only what
the call made, and frees the same garbage; a caller's own gc.freeze is left as it was."""

from __future__ import annotations

import gc
import importlib
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from remat.measure.events import HeldPastStep, older_objects_frozen, tracked_objects

auto_module = importlib.import_module("remat.auto")


class _Cycle:
    def __init__(self) -> None:
        self.me = self
        self.tensor = torch.ones(1000)


@pytest.fixture(autouse=True)
def _nothing_frozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_garbage_from_before_is_freed_and_garbage_made_inside_is_collected() -> None:
    before = _Cycle()
    old_garbage = weakref.ref(before)
    del before
    kept = torch.zeros(3)
    with older_objects_frozen():
        assert old_garbage() is None  # collected before the freeze, not held through the block
        assert gc.get_freeze_count() > 0
        assert all(o is not kept for o in gc.get_objects())  # the collector skips it now
        inside = _Cycle()
        new_garbage = weakref.ref(inside)
        del inside
        gc.collect()
        assert new_garbage() is None  # what the block made is collected as before
    assert gc.get_freeze_count() == 0


def test_a_callers_own_freeze_is_left_as_it_was() -> None:
    marker: list[int] = []
    gc.freeze()
    with older_objects_frozen():
        made = []
    assert all(o is not marker for o in gc.get_objects())  # still frozen
    assert any(o is made for o in gc.get_objects())  # made after the caller's freeze: not frozen


def test_tracked_objects_see_the_frozen_ones() -> None:
    old = torch.zeros(5)
    with older_objects_frozen():
        assert any(o is old for o in tracked_objects())
        assert gc.get_freeze_count() > 0  # frozen again after
    assert any(o is old for o in tracked_objects())


def test_held_past_step_counts_what_a_hook_keeps_inside_a_frozen_block() -> None:
    model = nn.Linear(8, 8)
    kept: dict[str, torch.Tensor] = {}
    model.register_forward_hook(lambda m, i, o: kept.__setitem__("out", o))
    x = torch.randn(4, 8)
    with older_objects_frozen(), HeldPastStep(model) as held:
        model(x).sum().backward()
    assert held.bytes == kept["out"].untyped_storage().nbytes() == 4 * 8 * 4


@pytest.mark.parametrize("frozen_by_caller", [False, True])
def test_auto_collects_inside_a_freeze_and_leaves_it_as_it_found_it(
    frozen_by_caller: bool,
) -> None:
    counts: list[int] = []
    collect = gc.collect

    def counting(*args: object) -> int:
        counts.append(gc.get_freeze_count())
        return collect(*args)

    marker: list[int] = []  # frozen by the caller or not
    if frozen_by_caller:
        gc.freeze()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x = torch.randn(16, 32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gc, "collect", counting)
        planned, _ = auto_module.auto(model, x, budget="1 GB")
    planned(x).square().mean().backward()
    # the caller's freeze kept (the marker still frozen), or none left
    assert any(o is marker for o in gc.get_objects()) is not frozen_by_caller
    assert (gc.get_freeze_count() > 0) is frozen_by_caller
    # one full collection at the start (none where the caller froze), every other one skips
    # the objects older than the call
    assert len(counts) >= 2 - frozen_by_caller  # the start, and a measurement
    first = 0 if frozen_by_caller else 1
    assert counts[:first] == [0] * first and all(c > 0 for c in counts[first:])
