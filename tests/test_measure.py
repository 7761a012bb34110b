"""The profiler-based step peak equals MemTracker's exact peak on eager steps; the CUDA
allocator's rounding and configuration as remat reads them."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from remat.measure.events import (
    allocation_bytes,
    expandable_segments,
    interleaved_times,
    median_ratio,
    step_peak_bytes,
    unique_storage_bytes,
)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(128, 128), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def test_step_peak_equals_memtracker() -> None:
    model = _mlp()
    x = torch.randn(64, 128)
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ours = step_peak_bytes(step, model, opt, x)
    tracker = MemTracker()
    tracker.track_external(model, opt, x)
    with tracker:
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours - theirs) <= 64, (ours, theirs)
    # the activations of 4 x (Linear, GELU) on 64 x 128 floats are in there
    assert ours > unique_storage_bytes([*model.parameters(), x]) * 3


def test_interleaved_times_shape() -> None:
    calls: list[str] = []
    times = interleaved_times(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    # the rounds alternate their order: each step first as often as last (counterbalanced)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert len(times["a"]) == 3 and median_ratio(times, "a", "a") == 1.0


def test_allocation_bytes_round_to_the_cuda_block_and_not_on_cpu() -> None:
    meta = torch.empty(64, device="meta")  # a 64-channel batch norm's weight: 256 bytes
    assert allocation_bytes(torch.empty(64)) == 256
    assert allocation_bytes(torch.empty(0)) == 0

    class OnCuda:  # allocation_bytes reads only numel, element_size and device
        device = torch.device("cuda")
        numel = meta.numel
        element_size = meta.element_size

    assert allocation_bytes(OnCuda()) == 512  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:true", True),
        ("expandable_segments:False", False),
        ("", False),
    ],
)
def test_expandable_segments_read_from_the_allocator_configuration(
    monkeypatch: pytest.MonkeyPatch, conf: str, expected: bool
) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert expandable_segments() is expected
