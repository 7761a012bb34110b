"""One planned graph step measured and predicted, for the graph tests (not a test module)."""

from __future__ import annotations

from typing import Any

from remat.auto import scalar_costs
from remat.capture.graph import GraphTrace
from remat.core.plan import Plan
from remat.core.simulate import graph_step_peak
from remat.core.step import StepCosts
from remat.execute.graph import apply_graph
from remat.measure.events import step_peak_bytes, unique_storage_bytes


def measured_and_predicted(
    model: Any, batch: Any, loss_fn: Any, trace: GraphTrace, plan: Plan, data: Any = None
) -> tuple[int, int, int]:
    """The whole step's peak counted from the allocator's events (remat.measure.events), its
    prediction from the graph (graph_step_peak, with the scalars the capture found:
    remat.auto.scalar_costs), and the fixed bytes (parameters, buffers)
    both include (with ``data``, default ``batch``: the tensors the step reads that live
    before it, a target ``loss_fn`` reads among them). The step starts with no parameter
    gradient."""
    run = apply_graph(model, plan, trace.graph, batch, loss_fn)

    def one_step() -> None:
        loss_fn(run, batch).backward()
        for p in model.parameters():
            p.grad = None

    measured = step_peak_bytes(one_step, model, None, batch if data is None else data)
    fixed = unique_storage_bytes([*model.parameters(), *model.buffers()])
    device = next((p.device for p in model.parameters()), None)
    costs = StepCosts(
        fixed, trace.param_grad_bytes, trace.grad_rise_bytes, **scalar_costs(trace, device)
    )
    predicted = graph_step_peak(trace.graph, run.executed_plan, costs)
    return measured, predicted, fixed
