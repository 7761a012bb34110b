"""On a GPU: the whole-step budget holds on CUDA (skipped without one).

The CUDA caching allocator holds the libraries' workspaces (cuBLAS, cuBLASLt, cuDNN) for the
rest of the process once used; every step's ``max_memory_allocated`` includes them. Before they
were counted, every plan measured ~66 MiB over its prediction on an H100 (torch 2.11), so
every binding budget was exceeded (benchmarks/gpu.py, docs/results/gpu/)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

import remat
from remat import zoo
from remat.measure.events import (
    UNSPLIT_BLOCKS_WARNING,
    cuda_step_peak_bytes,
    device_library_bytes,
    expandable_segments,
)
from remat.planners import BudgetTooSmallError

pytestmark = pytest.mark.gpu


def test_library_workspaces_are_counted_after_a_matrix_product() -> None:
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()
    assert device_library_bytes(torch.device("cuda", torch.cuda.current_device())) > 0


MLP_CHAIN_OVER = pytest.mark.xfail(
    strict=False,
    reason="H100, torch 2.11: at its least budget the mlp-chain step measured 239,403,008 B "
    "against 238,355,712 predicted, +1,047,296 B in the bytes requested from the allocator too "
    "(not its rounding), with and without expandable segments, also after warming the "
    "autograd thread's cuBLAS workspace; alone in a fresh process the same test measured "
    "1,069,824 B under a least of 244,582,656 B: it depends on what the process ran before "
    "(the library workspaces counted at planning differ by 6.2 MB); docs/results/gpu",
)


@pytest.mark.parametrize(
    "name", [pytest.param("mlp-chain", marks=MLP_CHAIN_OVER), "gpt2", "resnet18"]
)
def test_measured_cuda_peak_within_the_least_budget(name: str) -> None:
    if name == "resnet18" and not expandable_segments():
        pytest.xfail(UNSPLIT_BLOCKS_WARNING)  # measured +657,376 B without (docs/results/gpu)
    torch.manual_seed(0)
    entry = zoo.get(name)
    model = entry.model.cuda()
    batch = tree_map_only(torch.Tensor, lambda t: t.cuda(), entry.batch)
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    kw = {"loss_fn": entry.loss_fn, "optimizer": opt, "loop": "loss-only"}
    with pytest.raises(BudgetTooSmallError) as info:
        remat.auto(model, batch, budget=1, **kw)
    least = info.value.minimum_bytes
    planned, summary = remat.auto(model, batch, budget=least, **kw)
    assert summary.predicted_peak_bytes <= least

    def step() -> None:
        torch.manual_seed(3)
        entry.loss_fn(planned, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = cuda_step_peak_bytes(step)
    assert measured <= least, (measured, least, summary.predicted_peak_bytes)
