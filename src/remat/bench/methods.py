"""The methods a benchmark compares: remat's planners and the peers a user has today.

Each builder takes a :class:`Workload` (model, batch, loss and what remat captured of it) and
returns a :class:`Setup`: the module to train, or the exact error that stopped the method. The
suites (``remat.bench.suites``) measure every setup the same way, in one process.

Peers (shared/peers.md has how each behaves here):

* ``eager``: no checkpointing.
* ``torch-sequential-sqrt``: ``torch.utils.checkpoint.checkpoint_sequential`` over remat's
  stage list with round(sqrt(n)) segments (non-reentrant).
* ``torch-checkpoint-each``: ``torch.utils.checkpoint.checkpoint`` around every stage.
* ``torch-sac-matmul``: selective activation checkpointing per stage, saving matmul/conv
  outputs (``create_selective_checkpoint_contexts``), recomputing the rest.
* ``hf-gradient-checkpointing``: ``model.gradient_checkpointing_enable()`` (Hugging Face only).
* ``torch-compile@B``: ``torch.compile`` with ``activation_memory_budget = B`` (0..1).
* ``remat-<planner>[@budget]``: ``remat.apply`` with a plan from a remat planner.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.api import plan as make_plan
from remat.auto import plan_for_total_budget, total_peak_bytes
from remat.execute.chain import apply
from remat.planners import BudgetTooSmallError

__all__ = ["Workload", "Setup", "peer_methods", "remat_setup", "compile_setup"]


@dataclass
class Workload:
    """A model to benchmark, with what remat measured of it (captured once per model)."""

    name: str
    """Zoo name."""
    model: nn.Module
    """The model (shared by the setups that wrap it; parameters are shared)."""
    batch: Any
    """The example batch."""
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """``loss_fn(model, batch) -> scalar``."""
    chain: Any = None
    """The captured :class:`remat.Chain` (None when the model cannot be split)."""
    stages: Any = None
    """The :class:`remat.capture.stages.Stages` the chain was captured on."""
    fixed_bytes: int = 0
    """Parameters + gradients + buffers + Adam state."""
    grad_bytes: list[int] = field(default_factory=list)
    """Parameter-gradient bytes per stage (:func:`remat.auto.stage_grad_bytes`)."""
    grad_rise_bytes: tuple[int, ...] = ()
    """How much each stage's gradients raise its backward's peak (capture's measurement)."""
    optimizer_step_bytes: int = 0
    """Temporaries of one ``Adam.step()`` (:func:`remat.measure.profile.optimizer_costs`)."""


@dataclass
class Setup:
    """One method ready to train on a workload, or why it cannot."""

    method: str
    """Method name as it appears in the results."""
    module: nn.Module | None
    """The module to train (None when the method failed to build)."""
    family: str = "peer"
    """``"remat"``, ``"peer"`` or ``"baseline"``."""
    predicted_peak_bytes: int | None = None
    """remat's prediction of the total step peak (remat methods only)."""
    context: Callable[[], Any] | None = None
    """A context manager factory to enter around every step (e.g. compile settings)."""
    error: str = ""
    """The exact error when the method cannot run here."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Anything worth reporting (plan, segments, budget)."""


class _Checkpointed(nn.Module):
    """Runs stages with torch's own checkpoint API (what a user writes by hand today)."""

    def __init__(self, model: nn.Module, stages: Any, mode: str, context_fn: Any = None) -> None:
        super().__init__()
        self.model = model
        self._stages = stages
        self.mode = mode
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential

        st = self._stages
        a = st.prepare(*args, **kwargs)
        if not torch.is_grad_enabled():
            for m in st.modules:
                a = m(a)
        elif self.mode == "sequential":
            segments = max(1, round(math.sqrt(len(st.modules))))
            a = checkpoint_sequential(nn.Sequential(*st.modules), segments, a, use_reentrant=False)
        else:
            for m in st.modules:
                kwargs_ckpt: dict[str, Any] = {"use_reentrant": False}
                if self.context_fn is not None:
                    kwargs_ckpt["context_fn"] = self.context_fn
                a = checkpoint(m, a, **kwargs_ckpt)
        return st.finish(a, *args, **kwargs)


def _sac_context_fn() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
    }

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def peer_methods(work: Workload, quick: bool = False) -> list[Setup]:
    """Every peer that applies to ``work`` (eager first)."""
    setups = [Setup("eager", work.model, family="baseline")]
    if work.stages is not None:
        setups.append(
            Setup("torch-sequential-sqrt", _Checkpointed(work.model, work.stages, "sequential"))
        )
        setups.append(
            Setup("torch-checkpoint-each", _Checkpointed(work.model, work.stages, "each"))
        )
        if not quick:
            setups.append(
                Setup(
                    "torch-sac-matmul",
                    _Checkpointed(work.model, work.stages, "each", _sac_context_fn),
                )
            )
    if hasattr(work.model, "gradient_checkpointing_enable"):
        hf = copy.deepcopy(work.model)
        hf.load_state_dict(work.model.state_dict())
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        setups.append(Setup("hf-gradient-checkpointing", hf))
    return setups


def compile_setup(work: Workload, budget: float, backend: str = "inductor") -> Setup:
    """``torch.compile`` with ``torch._functorch.config.activation_memory_budget = budget``
    (``backend``: torch.compile's; ``aot_eager_decomp_partition`` partitions the same way as
    inductor, budget included, without generating code)."""
    import torch._functorch.config as functorch_config

    compiled = torch.compile(work.model, backend=backend)

    def context() -> Any:
        return functorch_config.patch(activation_memory_budget=budget)

    return Setup(
        f"torch-compile@{budget:g}",
        compiled,
        context=context,
        notes={"activation_memory_budget": budget},
    )


def remat_setup(
    work: Workload,
    method: str,
    total_budget: int | None = None,
    label: str | None = None,
    compile: dict[str, Any] | None = None,
) -> Setup:
    """``remat.apply`` with ``method``'s plan; ``total_budget`` is the whole step's peak;
    ``compile``: ``remat.apply``'s (torch.compile keyword arguments)."""

    name = label or f"remat-{method}"
    try:
        if total_budget is None:
            p = make_plan(work.chain, method)
        else:
            p = plan_for_total_budget(
                work.chain,
                work.fixed_bytes,
                total_budget,
                method,
                work.grad_bytes or None,
                work.grad_rise_bytes,
                work.optimizer_step_bytes,
            )
    except BudgetTooSmallError as err:
        return Setup(name, None, family="remat", error=str(err))

    module = apply(work.model, p, stages=work.stages, compile=compile or False)
    persistent = work.fixed_bytes - sum(work.grad_bytes)
    return Setup(
        name,
        module,
        family="remat",
        predicted_peak_bytes=total_peak_bytes(
            work.chain,
            p,
            persistent,
            work.grad_bytes,
            work.grad_rise_bytes,
            optimizer_step_bytes=work.optimizer_step_bytes,
        ),
        notes={
            "plan": p.describe(),
            "planner": method,
            "total_budget": total_budget,
            "predicted_time": p.predicted_time,
        },
    )
