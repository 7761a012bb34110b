"""Parameter gradients during a node's backward on the graph path (``GraphTrace.grad_rise_bytes``).

A node's parameter gradients were counted from the start of its backward, all of them. A linear
layer makes its weight gradient after its input gradient, once the gradient of its output and
what it saved are freed, so that gradient does not raise the backward's peak: on a 2-layer MLP
the graph path predicted the step 65,536 B above the allocator's count (the first layer's
weight gradient), on Hugging Face ViT 4,224 B above, which makes ``remat.auto`` refuse budgets
its plans meet. The capture now walks each node's backward over the samples with the
parameter gradients too and keeps how far they raise its peak above what the simulator counts
there; the whole-step model counts that during the backward (``StepCosts.grad_rise_bytes``, as
the chain path's per stage). Measured: the MLP and ViT (module and op level, unplanned and
``reforward``) to the byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from graph_steps import measured_and_predicted
from torch import nn

from remat.auto import scalar_costs
from remat.capture.graph import trace_graph
from remat.core.plan import Plan
from remat.core.simulate import graph_step_peak
from remat.core.step import StepCosts

N, D, H, C = 64, 128, 128, 10


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_the_mlp_step_is_predicted_to_the_byte_and_never_below() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))
    batch = (torch.randn(N, D), torch.randint(0, C, (N,)))
    trace = trace_graph(model, batch, loss_fn, level="module")
    first = trace.graph.index("1")  # the first linear layer, merged into its ReLU
    # only its bias gradient is live at its backward's peak (the ReLU's): the weight gradient
    # is made after the ReLU's saved output and its incoming gradient are freed
    assert trace.param_grad_bytes[first] == (D * H + H) * 4
    assert trace.grad_rise_bytes[first] == H * 4
    measured, predicted, fixed = measured_and_predicted(model, batch, loss_fn, trace, Plan.none())
    # under-predicting would let a budget be exceeded silently: never below
    assert measured <= predicted <= measured + 256, (measured, predicted)
    # every gradient from its backward's start: the weight gradient over the ReLU's peak
    all_at_start = StepCosts(fixed, trace.param_grad_bytes, **scalar_costs(trace))
    blind = graph_step_peak(trace.graph, Plan.none(), all_at_start)
    assert blind - measured >= D * H * 4, (blind, measured)


def test_without_the_backward_measured_every_gradient_counts_from_the_start() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    structure = trace_graph(model, batch, loss_fn, costs=False)
    assert structure.grad_rise_bytes == ()  # StepCosts: empty means all of them
    measured = trace_graph(model, batch, loss_fn, fake=True)
    assert len(measured.grad_rise_bytes) == measured.graph.n
    assert all(r >= 0 for r in measured.grad_rise_bytes)
