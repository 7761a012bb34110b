"""Gradients a backward passes on without a copy, and the target a ``loss_fn`` reads.

A sum's backward (``AddBackward0``) hands its output gradient to each input as it is: no new
tensor. The graph capture measured that backward's peak (nothing above its start) but clipped
the node's ``bwd_overhead_bytes`` at 0, while the simulator allocates a gradient for each input
whose gradient appears there: on a model whose stem output skips across six blocks to a sum
(``head(h + skip)``) the unplanned step was predicted 65,024 B above its measured peak (the
sum's backward allocating the skip's gradient once more). The overhead may now be negative, as
on the chain path, down to what the backward holds (:attr:`remat.core.graph.Node.
bwd_overhead_floor`).

In loop (c) of the conformance suite the criterion's target is read by ``loss_fn``: the capture
counts it (it lives all step, like the batch), the measurement did not. On LRASPP (a 2 x 64 x
64 int64 mask, 65,536 B) remat's least plan was predicted that much above its measured peak,
and the least it named lay above what checkpointing every block measured without the target.
"""

from __future__ import annotations

import pytest
import torch
from graph_steps import measured_and_predicted
from models import Skip
from torch import nn

from remat.bench import conformance
from remat.capture.graph import trace_graph
from remat.core.plan import Plan

W, N = 128, 256


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def test_a_sum_passes_its_gradient_on_without_a_copy() -> None:
    torch.manual_seed(0)
    model, x = Skip(W), torch.randn(N, W)
    trace = trace_graph(model, x, _loss, level="module")
    graph = trace.graph
    (add,) = [v for v, node in enumerate(graph.nodes) if node.name.endswith("/add")]
    # the sum (the last block's GELU merged into it) allocates one input gradient, not two
    assert graph.nodes[add].bwd_overhead_bytes == -N * W * 4
    last = graph.index("blocks.4.1")
    for plan in (Plan.none(), Plan.from_segments([range(1, last + 1)])):
        measured, predicted, _ = measured_and_predicted(model, x, _loss, trace, plan)
        assert measured <= predicted <= measured + 64, (plan, measured, predicted)


@pytest.mark.slow
def test_the_least_named_on_lraspp_is_met_to_the_byte_and_below_every_block() -> None:
    name = "tv-lraspp_mobilenet_v3"
    every_block, _ = conformance.every_block_peak(name, "loss_fn")
    record = conformance.run_case(name, "loss_fn", 0.0)
    assert record.status == "pass", (record.violations, record.error)
    assert record.least_bytes is not None and record.peak_bytes is not None
    assert record.least_bytes <= every_block, (record.least_bytes, every_block)
    assert record.peak_bytes <= record.predicted_peak_bytes <= record.peak_bytes + 64
