"""Fit a training step into a memory budget: ``setup = remat.fit(model, batch, budget="512MiB")``.

Sohoni et al. 2019 ("Low-Memory Neural Network Training") cut training memory with four
levers, alone and combined: recomputation (checkpointing), low precision, microbatching and
sparsity. :func:`fit` searches their combinations for the one that fits a budget at the least
predicted step time:

* **precision** (``precisions=("fp32", "bf16")``): autocast compute in bf16 or fp16, fp32
  master weights kept (what ``torch.autocast`` does: parameters, gradients and optimizer state
  stay fp32; each matmul/conv casts its weight to a 16-bit copy that autograd saves for
  backward, counted in the stage's saved bytes);
* **microbatch count** k (default: every divisor of the batch size): k forward/backward passes
  of N/k examples with gradients equal to the full batch's (:mod:`remat.levers.microbatch`);
* **plan**: for each (precision, k) the time-optimal remat plan (``optimal-time``, Beaumont et
  al. 2019) under the activation memory left by the rest;
* **sparsity** (``density=d``, optional): weights pruned by magnitude to density d, applied
  to every candidate, not searched. Masked weights are dense
  tensors in PyTorch, so masks *add* one byte per element and a search would never choose them;
  the summary reports what CSR storage of those weights would take (NOTE [ Masks save no
  memory ] in :mod:`remat.levers.sparsity`).

How a combination is predicted (NOTE [ What fit predicts ]):

* the chain is captured **at the microbatch shape** (activation bytes are not quite linear in
  the batch: autocast's weight copies and parameter-gradient transients are not), fp32 by a
  real capture (exact bytes, measured seconds), 16-bit by a real capture inside autocast
  (exact bytes, one timed repeat) whose stage times are the fp32 times times a
  **precision factor** measured once per precision (one interleaved fwd+bwd at the smallest
  microbatch tried) or given (``precision_factors={"bf16": 0.5}``). On a CPU without bf16
  matrix instructions the factor is large (about 9x for a WideResNet on the 2-core EPYC
  this was written on), so bf16 is chosen there only when nothing in fp32 fits;
* predicted peak = the one whole-step model of :func:`remat.auto` (:func:`remat.auto.step_costs`
  of the candidate's capture: persistent state, the optimizer state measured on fake tensors,
  parameter gradients, the plan's simulated activations and the small tensors the capture
  sees) + sparsity masks + the batch beyond the microbatch + the microbatcher's weighted loss.
  With one microbatch and an optimizer the gradients appear as the backward reaches them; from the second microbatch on (and in a step
  without an optimizer, where gradients persist) all of them are live. The optimizer step's own
  transients (Adam's ``sqrt``/division temporaries, measured on fake tensors with the
  ``foreach`` choice the real optimizer makes, :func:`remat.measure.profile.optimizer_costs`) bound it
  too;
* predicted time = simulated plan time (forward, recomputation, backward) times k.

The chosen setup is then **measured** (``measure=True``): one whole :meth:`FitSetup.step` under
:func:`remat.measure.events.step_peak_bytes` (the allocator's own events, so workspace that is not a
tensor counts too), after one warm-up step, on a snapshot of the model and optimizer that is
restored afterwards. If the measured peak exceeds the budget, the search runs again with the
missed bytes reserved (up to three times), so the returned setup's measured peak fits.

Example:
    >>> import torch, remat
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256),
    ...                               torch.nn.GELU()) for _ in range(16)])
    >>> batch = torch.randn(512, 256)
    >>> setup = remat.fit(model, batch, budget="24MiB", precisions=("fp32",))  # doctest: +SKIP
    >>> print(setup)                           # doctest: +SKIP
    >>> setup.step(batch, torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP

Known limitations:
    * Compressed saved activations (``Precision(saved=...)``) are not searched: the chain model
      cannot express tensors that are compressed when kept but recomputed in full precision.
      :meth:`FitSetup.step` runs them if you build a setup with :func:`make_setup`.
    * Batch norm under microbatching normalises each microbatch by its own statistics:
      gradients then differ from the full batch's (NOTE [ Batch norm under microbatching ]).
    * A loss averaged over something other than examples is found on the model before
      microbatching (:func:`remat.levers.loss_weighting`: tokens with ``-100`` labels, a causal
      LM's shifted ones); any other needs ``count=``, and is refused without it.
    * Every search candidate costs one real capture; the time of a 16-bit stage is scaled
      from fp32 by one factor.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from remat.auto import stage_grad_bytes, step_costs
from remat.capture.chain import Captured, _model_arguments, capture
from remat.capture.stages import split_stages
from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.plan import Plan
from remat.core.step import StepCosts
from remat.core.units import format_bytes, format_time, resolve_budget
from remat.execute.chain import PlannedModule, apply
from remat.guards import BufferSnapshot, check_not_wrapped
from remat.levers import Precision, compress_saved_activations, magnitude_prune, make_grad_scaler
from remat.levers.microbatch import MicroBatcher, batch_size, loss_weighting, split_batch
from remat.levers.sparsity import predicted_sparse_bytes
from remat.measure.events import (
    cuda_step_peak_bytes,
    device_library_bytes,
    interleaved_times,
    median_ratio,
    older_objects_frozen,
    step_peak_bytes,
    unique_storage_bytes,
)
from remat.measure.profile import default_loss_fn, optimizer_costs
from remat.planners import BudgetTooSmallError
from remat.planning import least_step_plan, plan_for_step, step_peak_of

__all__ = [
    "fit",
    "make_setup",
    "FitSetup",
    "FitCandidate",
    "FitBudgetError",
    "PRECISIONS",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]

#: The precision names :func:`fit` searches: autocast compute dtype (None = full precision).
PRECISIONS: dict[str, str | None] = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}

_METHOD = "optimal-time"
#: Examples in the microbatch on which a 16-bit precision's time factor is measured.
_FACTOR_EXAMPLES = 16
_MAX_REMEASURE = 3


# ---------------------------------------------------------------------- records
class FitBudgetError(BudgetTooSmallError):
    """No combination of levers fits the budget; ``minimum_bytes`` is the smallest predicted
    peak any combination reaches (a budget of that many bytes fits)."""

    def __init__(self, budget_bytes: int, minimum_bytes: int, where: str, detail: str = "") -> None:
        ValueError.__init__(
            self,
            f"whole-step budget {format_bytes(budget_bytes)} ({budget_bytes} B) is below the "
            f"smallest peak any combination of plans, precision and microbatching reaches: "
            f"{format_bytes(minimum_bytes)} ({minimum_bytes} B), with {where}. Raise the budget "
            f"to at least {minimum_bytes} B, or add levers (more microbatches, bf16, a smaller "
            "optimizer)" + (f"; {detail}" if detail else ""),
        )
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.method = _METHOD
        self.kind = "whole-step"


@dataclass(frozen=True)
class FitCandidate:
    """One combination the search evaluated."""

    precision: str
    """Precision name (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
    microbatches: int
    """Number of microbatches k."""
    microbatch_size: int
    """Examples in the largest microbatch (the shape the chain was captured at)."""
    plan: Plan | None
    """The fastest plan that fits the budget, or None when none does."""
    predicted_peak_bytes: int | None
    """Predicted peak of the whole step under ``plan`` (None when nothing fits)."""
    predicted_time: float | None
    """Predicted step time, seconds: simulated plan time times k (None when nothing fits)."""
    min_peak_bytes: int
    """The smallest predicted peak this combination reaches (its least-memory plan)."""
    unplanned_peak_bytes: int
    """Predicted peak storing every activation (no recomputation)."""
    chain: Chain = field(repr=False, compare=False, default=None)  # type: ignore[assignment]
    """The chain captured for this combination (microbatch shape, this precision)."""

    @property
    def fits(self) -> bool:
        """Whether some plan of this combination fits the budget."""
        return self.plan is not None


@dataclass(frozen=True)
class _StepState:
    """What a setup's steps need beyond the records (not compared, not printed)."""

    base_model: nn.Module
    loss_fn: LossFn
    reduction: str
    count: Callable[[Any], Any] | None
    device_type: str
    masks: Any
    scaler: Any
    planned_state_bytes: int
    microbatch_size: int
    seen_optimizers: set[int] = field(default_factory=set)


@dataclass(frozen=True, eq=False)
class FitSetup:
    """A model planned to fit a memory budget, and how to train it: :meth:`step`.

    ``print(setup)`` gives a readable summary; :meth:`to_dict` the same as JSON-ready data.
    """

    model: nn.Module
    """The planned module (:class:`remat.execute.chain.PlannedModule`; shares the model's
    parameters). Call :meth:`step` to train it within the budget."""
    plan: Plan
    """The remat plan, made for the microbatch shape."""
    precision: Any
    """The :class:`remat.levers.Precision` of the step (autocast compute dtype)."""
    precision_name: str
    """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
    microbatches: int
    """Number of microbatches per step."""
    microbatch_size: int
    """Examples in the largest microbatch."""
    batch_size: int
    """Examples per step."""
    chain: Chain
    """The chain the plan was made for (microbatch shape, this precision)."""
    budget_bytes: int
    """The budget asked for (the whole step's peak)."""
    predicted_peak_bytes: int
    """Predicted peak of one whole step."""
    predicted_time: float
    """Predicted step time, seconds (simulated plan time times the microbatches)."""
    measured_peak_bytes: int | None
    """Peak of one whole :meth:`step`, measured (None when ``measure=False``)."""
    persistent_bytes: int
    """Parameters, buffers, optimizer state and sparsity masks."""
    optimizer_state_bytes: int
    """Of those, the optimizer state."""
    gradient_bytes: int
    """Parameter gradients."""
    batch_bytes: int
    """The batch (held for the whole step)."""
    activation_peak_bytes: int
    """The plan's simulated activation peak (microbatch input included)."""
    reserve_bytes: int = 0
    """Bytes the search held back after a measurement exceeded its prediction."""
    precision_factors: tuple[tuple[str, float], ...] = ()
    """``(precision, step-time factor against fp32)`` used for the 16-bit candidates."""
    candidates: tuple[FitCandidate, ...] = ()
    """Every combination evaluated, in search order."""
    search_seconds: float = 0.0
    """Wall time of the search (captures and planning)."""
    density: float | None = None
    """Weight density applied by magnitude pruning (None: dense weights)."""
    sparse_weight_bytes: tuple[int, int] | None = None
    """``(dense bytes, CSR bytes with int32 indices)`` of the masked weights."""
    batch_norms: int = 0
    """Batch-norm modules in the model: with microbatches each normalises a microbatch by its
    own statistics (:func:`_batch_norm_note`)."""
    weighting: str = "examples"
    """What each microbatch's loss is weighted by (:func:`remat.levers.loss_weighting`):
    ``"examples"``, the labels other than -100 (a mean over tokens), ``"count="`` (given)."""
    _state: _StepState | None = field(default=None, repr=False, compare=False)

    # -------------------------------------------------------------- training
    def step(self, batch: Any, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """One whole training step within the budget: every microbatch's forward and backward
        (gradients accumulate to the full batch's), then ``optimizer.step()`` and
        ``zero_grad(set_to_none=True)`` if an optimizer is given. Returns the full-batch loss.

        Without an optimizer the gradients stay in ``.grad`` (as after ``loss.backward()``),
        unscaled under fp16 loss scaling too (NOTE [ fp16 gradients without an optimizer ]).
        A batch smaller than the one fitted runs under the same plan; a larger one is refused.
        """

        state = self._require_state()
        if optimizer is not None:
            self._prepare_optimizer(optimizer)
        exclude = tuple(_tensors(batch))
        precision = self.precision

        def context() -> contextlib.AbstractContextManager[Any]:
            return _forward_context(precision, state.device_type, state.base_model, exclude)

        batcher = MicroBatcher(
            min(self.microbatches, _batch_size(batch)),
            state.loss_fn,
            reduction=state.reduction,
            count=state.count,
            forward_context=context,
            scaler=state.scaler,
        )
        scaler = state.scaler
        if optimizer is not None or scaler is None or not scaler.is_enabled():
            return batcher(self.model, batch, optimizer)
        # NOTE [ fp16 gradients without an optimizer ]: the scaler multiplies every backward by
        # its scale S and unscales only inside scaler.step(optimizer). Without an optimizer the
        # gradients are unscaled here, in place (no extra memory): what .grad held before is
        # multiplied by S first, so .grad ends as old + new, as after a plain backward. S is a
        # power of two (GradScaler's default 2**16, halved and doubled), so both are exact;
        # an overflow leaves inf/NaN in .grad, as an unscaled fp16 backward would.
        scale = float(scaler.get_scale())
        parameters = list(state.base_model.parameters())
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(scale)
        loss = batcher(self.model, batch, None)
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.div_(scale)
        return loss

    # -------------------------------------------------------------- reporting
    def __str__(self) -> str:
        lines = [
            f"remat.fit: whole-step budget {format_bytes(self.budget_bytes)} -> "
            f"{self.describe_levers()}",
            f"  predicted peak {format_bytes(self.predicted_peak_bytes)}"
            + (
                f", measured {format_bytes(self.measured_peak_bytes)}"
                if self.measured_peak_bytes is not None
                else ", not measured"
            )
            + f" ({self.predicted_peak_bytes} / {self.measured_peak_bytes} B)",
            f"    persistent (parameters, buffers, optimizer {format_bytes(self.optimizer_state_bytes)}"
            f"{', masks' if self.density is not None else ''}): "
            f"{format_bytes(self.persistent_bytes)}; gradients {format_bytes(self.gradient_bytes)}; "
            f"batch {format_bytes(self.batch_bytes)}; activations "
            f"{format_bytes(self.activation_peak_bytes)} per microbatch",
            f"  predicted step time {format_time(self.predicted_time)}",
            f"  plan: {_short(self.plan.describe(), 90)}",
        ]
        if self.sparse_weight_bytes is not None:
            dense, csr = self.sparse_weight_bytes
            lines.append(
                f"  sparsity: density {self.density:g}; masked weights {format_bytes(dense)} "
                f"dense, {format_bytes(csr)} in CSR (int32 indices) - dense PyTorch saves none "
                "of it"
            )
        if self.microbatches > 1:
            lines.append(f"  microbatch losses weighted by: {self.weighting}")
        if self.microbatches > 1 and self.batch_norms:
            note = _batch_norm_note(
                self.batch_norms, self.microbatch_size, self.batch_size, self.microbatches
            )
            lines.append(f"  {note}")
        if self.reserve_bytes:
            lines.append(
                f"  reserved {format_bytes(self.reserve_bytes)} that a first measurement "
                "showed the prediction missed"
            )
        fitting = sum(c.fits for c in self.candidates)
        factors = ", ".join(f"{p} x{f:.2f}" for p, f in self.precision_factors)
        lines.append(
            f"  searched {len(self.candidates)} combinations ({fitting} fit) in "
            f"{self.search_seconds:.1f} s"
            + (f"; time factors vs fp32: {factors}" if factors else "")
        )
        return "\n".join(lines)

    def describe_levers(self) -> str:
        """One line: precision, microbatches, plan, sparsity."""
        checkpoints = sum(1 for _ in self.plan.walk())
        parts = [
            self.precision_name + ("" if self.precision_name == "fp32" else " autocast"),
            f"{self.microbatches} microbatch{'es' if self.microbatches > 1 else ''} of "
            f"{self.microbatch_size}",
            "no recomputation"
            if checkpoints == 0
            else f"{checkpoints} checkpointed segment{'s' if checkpoints > 1 else ''}",
        ]
        if self.density is not None:
            parts.append(f"density {self.density:g}")
        return ", ".join(parts)

    def table(self) -> str:
        """Every evaluated combination: predicted peak, least reachable peak, predicted time."""
        rows = [
            f"{'precision':<9} {'k':>4} {'mb':>5} {'least peak':>12} {'store-all':>12} "
            f"{'fits':>4} {'peak':>12} {'time':>10}"
        ]
        for c in self.candidates:
            rows.append(
                f"{c.precision:<9} {c.microbatches:>4} {c.microbatch_size:>5} "
                f"{format_bytes(c.min_peak_bytes):>12} {format_bytes(c.unplanned_peak_bytes):>12} "
                f"{'yes' if c.fits else 'no':>4} "
                f"{format_bytes(c.predicted_peak_bytes) if c.predicted_peak_bytes is not None else '-':>12} "
                f"{format_time(c.predicted_time) if c.predicted_time is not None else '-':>10}"
            )
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (bytes as ints, seconds as floats)."""
        return {
            "schema": "remat.fit",
            "version": 1,
            "budget_bytes": self.budget_bytes,
            "precision": self.precision_name,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "batch_size": self.batch_size,
            "density": self.density,
            "plan": self.plan.describe(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_time": self.predicted_time,
            "persistent_bytes": self.persistent_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "gradient_bytes": self.gradient_bytes,
            "batch_bytes": self.batch_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "reserve_bytes": self.reserve_bytes,
            "precision_factors": dict(self.precision_factors),
            "sparse_weight_bytes": list(self.sparse_weight_bytes)
            if self.sparse_weight_bytes
            else None,
            "search_seconds": self.search_seconds,
            "candidates": [
                {
                    "precision": c.precision,
                    "microbatches": c.microbatches,
                    "microbatch_size": c.microbatch_size,
                    "fits": c.fits,
                    "predicted_peak_bytes": c.predicted_peak_bytes,
                    "predicted_time": c.predicted_time,
                    "min_peak_bytes": c.min_peak_bytes,
                    "unplanned_peak_bytes": c.unplanned_peak_bytes,
                    "plan": c.plan.describe() if c.plan is not None else None,
                }
                for c in self.candidates
            ],
        }

    # -------------------------------------------------------------- implementation
    def _require_state(self) -> _StepState:
        if self._state is None:
            raise RuntimeError("this FitSetup was rebuilt from data and cannot run steps")
        return self._state

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        state = self._require_state()
        if id(optimizer) in state.seen_optimizers:
            return
        state.seen_optimizers.add(id(optimizer))
        if state.masks is not None:
            state.masks.attach(optimizer, mask_gradients=False)

        needed, _ = optimizer_costs(state.base_model, optimizer)
        if needed > state.planned_state_bytes:
            warnings.warn(
                f"remat.fit planned for {format_bytes(state.planned_state_bytes)} of optimizer "
                f"state, but this {type(optimizer).__name__} keeps {format_bytes(needed)}: the "
                "step may exceed the budget by the difference. Pass optimizer= to remat.fit.",
                RuntimeWarning,
                stacklevel=3,
            )


# ---------------------------------------------------------------------- entry points
@older_objects_frozen()
def fit(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    loss_fn: LossFn | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    precisions: Sequence[str] = ("fp32", "bf16"),
    microbatches: Sequence[int] | None = None,
    density: float | None = None,
    stages: Sequence[str] | None = None,
    reduction: str | None = None,
    count: Callable[[Any], Any] | None = None,
    precision_factors: Mapping[str, float] | None = None,
    measure: bool = True,
    repeats: int = 1,
    progress: bool = True,
) -> FitSetup:
    """Find the fastest combination of plan, precision and microbatching whose training step
    fits ``budget`` (the whole step's peak: parameters, gradients, optimizer state, batch and
    activations), apply it, and return a :class:`FitSetup` (module docstring).

    Args:
        model: the model (plain ``nn.Module``, not yet planned or wrapped in DDP/FSDP).
        batch: one training batch (its size is the step's batch size).
        budget: bytes, a string like ``"512MiB"``, or a percentage of the unplanned step's
            predicted peak (fp32, one microbatch, no plan) such as ``"50%"``
            (:func:`remat.core.units.resolve_budget`; ``float("inf")``: that peak itself).
        loss_fn: ``loss_fn(model, batch) -> scalar``; default :func:`remat.measure.profile.default_loss_fn`.
        optimizer: the optimizer the steps will use: its state and its step's temporaries are
            part of the budget. Without it the steps keep gradients and nothing else.
        precisions: precision names to search (:data:`PRECISIONS`), in order of preference.
        microbatches: microbatch counts to search (default: every divisor of the batch size,
            ascending; larger counts are skipped once storing every activation fits).
        density: fraction of each Linear/Conv weight kept by magnitude pruning (masks kept
            through training); applied to every candidate, not searched: in dense PyTorch it
            saves nothing (the masks add one byte per element, and are counted).
        stages: stage boundaries for models that are not cut automatically.
        reduction: ``"mean"`` or ``"sum"``: how the loss reduces over examples (microbatch
            weights). Default: found on the model where the setup has microbatches
            (:func:`remat.levers.loss_weighting`: a mean over examples, over the labels other
            than -100, shifted or not, or a sum); one given is checked against it.
        count: ``count(microbatch)`` items a mean loss averages over (see ``MicroBatcher``);
            given, it is used as it is.
        precision_factors: step-time factor of each 16-bit precision against fp32; default:
            measured once.
        measure: measure one whole step of the chosen setup (and re-plan if it exceeds).
        repeats: timed runs per stage in each fp32 capture.
        progress: show a progress bar.

    Raises:
        FitBudgetError: no combination fits; it names the smallest budget one reaches.
    """

    if isinstance(model, PlannedModule):
        raise TypeError("remat.fit plans the model itself: pass planned.model, not a planned one")
    check_not_wrapped(model, "remat.fit")
    resolve_budget(budget, 0)  # a budget remat cannot read fails before the model is touched
    names = _precision_names(precisions)
    for name in names:
        _check_supported(name, _device_type(model))
    n = _batch_size(batch)
    counts = _microbatch_counts(n, microbatches)
    started = time.perf_counter()
    masks = _prune(model, density)
    search = _Search(
        model=model,
        batch=batch,
        loss_fn=loss_fn or _default_loss(),
        optimizer=optimizer,
        stages=stages,
        repeats=repeats,
        precision_factors=dict(precision_factors or {}),
        masks=masks,
    )
    budget_bytes = resolve_budget(
        budget,
        lambda: search.evaluate("fp32", 1, 0).unplanned_peak_bytes,
        "the unplanned step's predicted peak (fp32, one microbatch)",
    )
    reserve = 0
    setup: FitSetup | None = None
    for attempt in range(_MAX_REMEASURE + 1):
        candidates = search.run(
            names, counts, budget_bytes - reserve, microbatches is None, progress
        )
        chosen = _choose(candidates)
        if chosen is None:
            best = min(candidates, key=lambda c: c.min_peak_bytes)
            detail = (
                f"{format_bytes(reserve)} of it held back for what a measurement showed the "
                "prediction misses"
                if reserve
                else ""
            )
            raise FitBudgetError(
                budget_bytes,
                best.min_peak_bytes + reserve,
                f"{best.precision}, {best.microbatches} microbatch(es) of {best.microbatch_size} "
                "and the least-memory plan",
                detail,
            )
        setup = search.build(chosen, budget_bytes, reserve, candidates, reduction, count)
        if not measure:
            break
        measured = _measure_step(setup, batch, optimizer)
        setup = replace(setup, measured_peak_bytes=measured)
        if measured <= budget_bytes or attempt == _MAX_REMEASURE:
            break
        # what the prediction missed (workspace that is not a tensor, allocator details)
        reserve = max(reserve + 1, measured - setup.predicted_peak_bytes)
    assert setup is not None
    setup = replace(setup, search_seconds=time.perf_counter() - started)
    if setup.measured_peak_bytes is not None and setup.measured_peak_bytes > budget_bytes:
        warnings.warn(
            f"the chosen setup's measured peak {format_bytes(setup.measured_peak_bytes)} "
            f"exceeds the whole-step budget {format_bytes(budget_bytes)} after {_MAX_REMEASURE} "
            "re-plans",
            RuntimeWarning,
            stacklevel=2,
        )
    return setup


def make_setup(
    model: nn.Module,
    batch: Any,
    plan: Plan,
    precision: Any = None,
    microbatches: int = 1,
    loss_fn: LossFn | None = None,
    *,
    reduction: str | None = None,
    count: Callable[[Any], Any] | None = None,
    stages: Sequence[str] | None = None,
) -> FitSetup:
    """A :class:`FitSetup` for a combination you choose (no search, no prediction): ``plan``
    made for the microbatch shape, any :class:`remat.levers.Precision` (compressed saved
    activations included), ``microbatches`` per step. The prediction fields are zero. The
    microbatch weights are found on the model as :func:`fit` finds them (``reduction`` and
    ``count`` as there)."""

    precision = precision if precision is not None else Precision()
    if not isinstance(precision, Precision):
        precision = Precision(compute=PRECISIONS[_precision_names([precision])[0]])
    n = _batch_size(batch)
    example = _example_microbatch(batch, microbatches)
    size = _batch_size(example)
    device_type = _device_type(model)
    loss_fn = loss_fn or _default_loss()
    weighting, reduction, count = _weighting(model, batch, loss_fn, microbatches, reduction, count)
    inputs = _model_inputs(model, loss_fn, example)
    planned = apply(model, plan, stages=stages, example=inputs, replan=_same_plan(plan, size))
    state = _StepState(
        base_model=model,
        loss_fn=loss_fn,
        reduction=reduction,
        count=count,
        device_type=device_type,
        masks=None,
        scaler=make_grad_scaler(precision, device_type) if precision.scales_loss else None,
        planned_state_bytes=1 << 62,
        microbatch_size=size,
    )
    name = next((k for k, v in PRECISIONS.items() if v == precision.compute), "fp32")
    if precision.saved is not None:
        name += f"+saved-{precision.saved}"
    return FitSetup(
        model=planned,
        plan=plan,
        precision=precision,
        precision_name=name,
        microbatches=microbatches,
        microbatch_size=size,
        batch_size=n,
        chain=Chain(fwd_time=(0.0,), bwd_time=(0.0,), out_bytes=(0,), saved_bytes=(0,)),
        budget_bytes=0,
        predicted_peak_bytes=0,
        predicted_time=0.0,
        measured_peak_bytes=None,
        persistent_bytes=0,
        optimizer_state_bytes=0,
        gradient_bytes=0,
        batch_bytes=_storage_bytes(_tensors(batch)),
        activation_peak_bytes=0,
        weighting=weighting,
        _state=state,
    )


# ---------------------------------------------------------------------- the search
class _Search:
    """Captures chains on demand (cached per precision and microbatch count) and evaluates
    combinations against a budget."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        stages: Sequence[str] | None,
        repeats: int,
        precision_factors: dict[str, float],
        masks: Any,
    ) -> None:

        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.stage_names = stages
        self.repeats = repeats
        self.factors = precision_factors
        self.masks = masks
        self.device_type = _device_type(model)
        self.n = _batch_size(batch)
        self.batch_bytes = _storage_bytes(_tensors(batch))
        self.stages = split_stages(model, stages)
        self.grad_bytes = stage_grad_bytes(self.stages)

        self.optimizer_state_bytes, self.optimizer_step_bytes = optimizer_costs(model, optimizer)
        self.mask_bytes = masks.mask_bytes() if masks is not None else 0
        self.persistent_bytes = (
            _storage_bytes([*model.parameters(), *model.buffers()])
            + self.optimizer_state_bytes
            + self.mask_bytes
            + device_library_bytes(next((p.device for p in model.parameters()), None))
        )
        self.counts: list[int] = [1]
        self._captures: dict[tuple[str, int], Captured] = {}
        self._examples: dict[int, Any] = {}

    # -------------------------------------------------------------- evaluation
    def run(
        self,
        names: Sequence[str],
        counts: Sequence[int],
        budget: int,
        stop_early: bool,
        progress: bool,
    ) -> list[FitCandidate]:
        from tqdm.auto import tqdm

        self.counts = list(counts)
        found: list[FitCandidate] = []
        total = len(names) * len(counts)
        with tqdm(total=total, desc="remat fit", unit="combination", disable=not progress) as bar:
            for name in names:
                for j, k in enumerate(counts):
                    bar.set_postfix_str(f"{name}, {k} microbatch(es)")
                    candidate = self.evaluate(name, k, budget)
                    found.append(candidate)
                    bar.update(1)
                    if stop_early and candidate.unplanned_peak_bytes <= budget:
                        bar.update(len(counts) - j - 1)  # more microbatches only add passes
                        break
        return found

    def evaluate(self, name: str, k: int, budget: int) -> FitCandidate:
        """The fastest plan of this combination under ``budget`` (the one budget search,
        :func:`remat.planning.plan_for_step`) and its least peak
        (:func:`remat.planning.least_step_plan`: the least-activation plan made on unit times,
        or storing everything when the executor's own bytes per checkpoint, its RNG states,
        outweigh the activations it saves, as with tiny microbatches)."""

        chain = self.chain(name, k)
        size = _batch_size(self.example(k))
        costs = self._costs(name, k)
        _, least_peak = least_step_plan(chain, costs, _METHOD)
        chosen: Plan | None = None
        predicted = time_s = None
        if least_peak <= budget:
            chosen = plan_for_step(chain, costs, budget, _METHOD)  # type: ignore[assignment]
            predicted = step_peak_of(chain, chosen, costs)
            assert predicted <= budget, (predicted, budget)
            time_s = simulate(chain, chosen).total_time * k
        return FitCandidate(
            precision=name,
            microbatches=k,
            microbatch_size=size,
            plan=chosen,
            predicted_peak_bytes=predicted,
            predicted_time=time_s,
            min_peak_bytes=least_peak,
            unplanned_peak_bytes=step_peak_of(chain, Plan.none(chain), costs),
            chain=chain,
        )

    def _costs(self, name: str, k: int) -> StepCosts:
        """The one whole-step model's costs of this combination
        (:func:`remat.auto.step_costs` of its capture), with the state and the batch beyond the
        microbatch, and the gradients, as the backward makes them, or all live from the start
        from the second microbatch on and in a step without an optimizer (NOTE [ Gradients that
        accumulate ]). :meth:`FitSetup.step` computes the loss inside the microbatcher and keeps
        only it: no model output is held (``loop="loss-only"``)."""
        costs = step_costs(
            self.captured(name, k),
            self.model,
            self.optimizer,
            loop="loss-only",
            loss_fn=self.loss_fn,
        )
        example = self._example_bytes(k)
        return replace(
            costs,
            persistent_bytes=costs.persistent_bytes + self.mask_bytes + self.batch_bytes - example,
            input_bytes=example,
            grads_live=k > 1 or self.optimizer is None,
            loss_held=3,  # the microbatcher's weighted loss beside the loss and its seed
        )

    # -------------------------------------------------------------- chains
    def example(self, k: int) -> Any:
        if k not in self._examples:
            self._examples[k] = _example_microbatch(self.batch, k)
        return self._examples[k]

    def _example_bytes(self, k: int) -> int:
        return _storage_bytes(_tensors(self.example(k)))

    def chain(self, name: str, k: int) -> Chain:
        return self.captured(name, k).chain

    def captured(self, name: str, k: int) -> Captured:
        key = (name, k)
        if key not in self._captures:
            self._captures[key] = self._capture(name, k)
        return self._captures[key]

    def _capture(self, name: str, k: int) -> Captured:

        example = self.example(k)
        if name == "fp32":
            return capture(
                self.model, example, self.loss_fn, self.stage_names, repeats=self.repeats
            )
        reference = self.chain("fp32", k)
        factor = self.factor(name)
        with _autocast(name, self.device_type):
            # on real tensors (its times replaced below): under FakeTensorMode the bf16 blocks
            # of GPT-2 missed 17,408 B of their kernels' backward workspace, and the plan at
            # the least fit named measured that much above it
            measured = capture(self.model, example, self.loss_fn, self.stage_names, repeats=1)
        chain = replace(
            measured.chain,
            fwd_time=tuple(t * factor for t in reference.fwd_time),
            bwd_time=tuple(t * factor for t in reference.bwd_time),
            time_unit="s",
        )
        return replace(measured, chain=chain)

    def factor(self, name: str) -> float:
        """Step time of ``name`` against fp32, measured once on a microbatch of about
        :data:`_FACTOR_EXAMPLES` examples (small enough to be cheap, large enough that the
        arithmetic, not the per-operation overhead, dominates)."""
        if name not in self.factors:
            # the most microbatches that leave that many examples; else the largest microbatch
            # searched (microbatches=[2] of a batch of 2 left none: a ValueError of max())
            enough = [k for k in self.counts if -(-self.n // k) >= min(self.n, _FACTOR_EXAMPLES)]
            k = max(enough, default=min(self.counts))
            self.factors[name] = _measure_factor(
                self.model, self.example(k), self.loss_fn, name, self.device_type
            )
        return self.factors[name]

    # -------------------------------------------------------------- the setup
    def build(
        self,
        chosen: FitCandidate,
        budget: int,
        reserve: int,
        candidates: Sequence[FitCandidate],
        reduction: str | None,
        count: Callable[[Any], Any] | None,
    ) -> FitSetup:

        assert chosen.plan is not None and chosen.predicted_peak_bytes is not None
        assert chosen.predicted_time is not None
        k = chosen.microbatches
        example = self.example(k)
        precision = Precision(compute=PRECISIONS[chosen.precision])
        weighting, reduction, count = _weighting(
            self.model, self.batch, self.loss_fn, k, reduction, count
        )
        norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        if k > 1 and norms:
            warnings.warn(_batch_norm_note(norms, chosen.microbatch_size, self.n, k), stacklevel=3)
        planned = apply(
            self.model,
            chosen.plan,
            stages=self.stages,
            example=_model_inputs(self.model, self.loss_fn, example),
            replan=_same_plan(chosen.plan, chosen.microbatch_size),
        )
        sparse = None
        if self.masks is not None:
            dense = csr = 0
            for name, p in self.masks.parameters.items():
                nnz = int(self.masks.masks[name].sum())
                counted = predicted_sparse_bytes(p.shape, nnz, p.dtype, "csr", torch.int32)
                dense += counted.dense_bytes
                csr += counted.sparse_bytes
            sparse = (dense, csr)
        chain = self.chain(chosen.precision, k)
        state = _StepState(
            base_model=self.model,
            loss_fn=self.loss_fn,
            reduction=reduction,
            count=count,
            device_type=self.device_type,
            masks=self.masks,
            scaler=make_grad_scaler(precision, self.device_type) if precision.scales_loss else None,
            planned_state_bytes=self.optimizer_state_bytes,
            microbatch_size=chosen.microbatch_size,
        )
        if self.optimizer is not None:
            state.seen_optimizers.add(id(self.optimizer))
            if self.masks is not None:
                self.masks.attach(self.optimizer, mask_gradients=False)
        return FitSetup(
            model=planned,
            plan=chosen.plan,
            precision=precision,
            precision_name=chosen.precision,
            microbatches=k,
            microbatch_size=chosen.microbatch_size,
            batch_size=self.n,
            chain=chain,
            budget_bytes=budget,
            predicted_peak_bytes=chosen.predicted_peak_bytes,
            predicted_time=chosen.predicted_time,
            measured_peak_bytes=None,
            persistent_bytes=self.persistent_bytes,
            optimizer_state_bytes=self.optimizer_state_bytes,
            gradient_bytes=sum(self.grad_bytes),
            batch_bytes=self.batch_bytes,
            activation_peak_bytes=simulate(chain, chosen.plan).peak_bytes,
            reserve_bytes=reserve,
            precision_factors=tuple(sorted(self.factors.items())),
            candidates=tuple(candidates),
            density=None if self.masks is None else self.masks.density(),
            sparse_weight_bytes=sparse,
            weighting=weighting,
            batch_norms=norms,
            _state=state,
        )


def _weighting(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    k: int,
    reduction: str | None,
    count: Callable[[Any], Any] | None,
) -> tuple[str, str, Callable[[Any], Any] | None]:
    """``(what, reduction, count)`` a step of ``k`` microbatches weights each loss by: ``count``
    where given; else found on the model (:func:`remat.levers.loss_weighting`: a mean over
    tokens, padding or -100 labels, or a sum, weighted as a mean over examples trains another
    model), a ``reduction`` given checked against it."""
    if count is not None:
        return "count=", "mean", count
    if k == 1:
        return "examples", reduction or "mean", None
    what, found, count = loss_weighting(model, batch, loss_fn)
    if reduction not in (None, found):
        raise ValueError(
            f"reduction={reduction!r} was given, but on the model the loss is weighted by "
            f"{what} ({found!r}): microbatches weighted as given would not sum to the batch's "
            "gradient"
        )
    return what, found, count


def _batch_norm_note(norms: int, size: int, n: int, k: int) -> str:
    """What microbatching changes in a model with batch norm (NOTE [ Batch norm under
    microbatching ] in remat.levers.microbatch)."""
    return (
        f"batch norm ({norms} modules) normalises each microbatch of {size} by its own "
        f"statistics, not the batch of {n}: the gradients are not the whole batch's, and the "
        f"running statistics move {k} times a step (pass microbatches=[1] to keep the batch's)"
    )


def _choose(candidates: Sequence[FitCandidate]) -> FitCandidate | None:
    """The fitting candidate with the least predicted time (ties: search order)."""
    best: FitCandidate | None = None
    for c in candidates:
        if c.fits and (best is None or c.predicted_time < best.predicted_time):  # type: ignore[operator]
            best = c
    return best


# ---------------------------------------------------------------------- measurement
def _measure_step(setup: FitSetup, batch: Any, optimizer: torch.optim.Optimizer | None) -> int:
    """Peak bytes of one whole :meth:`FitSetup.step` after a warm-up step; the model, its
    gradients and buffers, the optimizer and the RNG are restored afterwards."""

    state = setup._require_state()
    model = state.base_model
    extra = list(state.masks.masks.values()) if state.masks is not None else []
    with _preserved(model, optimizer, state.scaler):

        def one_step() -> None:
            setup.step(batch, optimizer)

        if state.device_type == "cuda":
            return cuda_step_peak_bytes(one_step)
        return step_peak_bytes(one_step, model, optimizer, inputs=(batch, extra))


@contextlib.contextmanager
def _preserved(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None
) -> Iterator[None]:
    """Restore parameters, gradients, buffers, optimizer and scaler state and the RNG on exit."""
    params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
    buffers = BufferSnapshot(model)
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
    devices = sorted({p.device.index or 0 for p, _, _ in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for p, value, grad in params:
                p.copy_(value)
                p.grad = grad
        buffers.restore()
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)


def _measure_factor(
    model: nn.Module, example: Any, loss_fn: LossFn, name: str, device_type: str
) -> float:
    """Median time of a ``name`` forward+backward over an fp32 one (interleaved, after a
    warm-up of each), on ``example``; the model is left as it was."""

    def step(low: bool) -> Callable[[], None]:
        def run() -> None:
            ctx = _autocast(name, device_type) if low else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model, example)
            loss.float().backward()
            model.zero_grad(set_to_none=True)

        return run

    with _preserved(model):
        times = interleaved_times({"fp32": step(False), name: step(True)}, repeats=1, warmup=1)
    return median_ratio(times, name, "fp32")


# ---------------------------------------------------------------------- helpers
def _precision_names(precisions: Sequence[Any]) -> list[str]:
    if isinstance(precisions, str):
        precisions = [precisions]
    names: list[str] = []
    for p in precisions:
        label = "fp32" if p is None else str(p).lower()
        label = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(
            label, label
        )
        if label not in PRECISIONS:
            raise ValueError(
                f"unknown precision {p!r}: fit searches {', '.join(PRECISIONS)} (autocast "
                "compute). Compressed saved activations are not searched; see make_setup"
            )
        if label not in names:
            names.append(label)
    if not names:
        raise ValueError("precisions is empty: give at least one of " + ", ".join(PRECISIONS))
    return names


def _check_supported(name: str, device_type: str) -> None:
    """Refuse a 16-bit precision this torch cannot run on ``device_type``: autocast to its
    dtype, and for fp16 the gradient scaler (``torch.amp.GradScaler`` on CPU needs torch 2.3+;
    torch warns and disables autocast for an unsupported dtype rather than failing)."""
    compute = PRECISIONS[name]
    if compute is None:
        return
    dtype = torch.bfloat16 if compute == "bf16" else torch.float16
    problem = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type, dtype=dtype):
                enabled = torch.is_autocast_enabled(device_type)
            if name == "fp16":
                torch.amp.GradScaler(device_type)
        except (RuntimeError, ValueError, TypeError, AttributeError) as err:
            enabled, problem = False, f"{type(err).__name__}: {err}"
    problem = problem or "; ".join(str(w.message) for w in caught)
    if not enabled or problem:
        what = "autocast and a gradient scaler" if name == "fp16" else "autocast"
        raise ValueError(
            f"precision {name!r} needs {what} on {device_type!r}, which torch "
            f"{torch.__version__} does not provide here ({problem or 'autocast stays off'}); "
            f"search other precisions, e.g. precisions=('fp32', 'bf16')"
        )


def _microbatch_counts(n: int, microbatches: Sequence[int] | None) -> list[int]:
    if microbatches is None:
        return [k for k in range(1, n + 1) if n % k == 0]
    counts = sorted(set(int(k) for k in microbatches))
    if not counts or counts[0] < 1 or counts[-1] > n:
        raise ValueError(
            f"microbatch counts must be between 1 and the batch size {n}, got {list(microbatches)}"
        )
    return counts


def _prune(model: nn.Module, density: float | None) -> Any:
    if density is None:
        return None

    if not 0.0 < density <= 1.0:
        raise ValueError(f"density is the fraction of weights kept, in (0, 1]; got {density}")
    masks = magnitude_prune(model, density)
    return masks.attach(None, mask_gradients=True)


def _default_loss() -> LossFn:

    return default_loss_fn


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:

    return unique_storage_bytes(tensors)


def _batch_size(batch: Any) -> int:

    return batch_size(batch)


def _example_microbatch(batch: Any, k: int) -> Any:
    """The first (largest) of ``k`` microbatches, as its own storage (k > 1), so that a
    capture counts its bytes and not the whole batch's."""
    if k == 1:
        return batch

    first = split_batch(batch, k)[0]
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t.dim() > 0 else t, first)


def _device_type(model: nn.Module) -> str:
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return "cpu"


def _autocast(name: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast for a precision name, without its weight cache: a cached 16-bit weight copy
    lives until the autocast region ends, even where a checkpoint frees everything else; not
    caching keeps each copy only as long as autograd saves it (what the chain counts)."""
    compute = PRECISIONS[name]
    if compute is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if compute == "bf16" else torch.float16
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


@contextlib.contextmanager
def _forward_context(
    precision: Any, device_type: str, model: nn.Module, exclude: Sequence[torch.Tensor]
) -> Iterator[None]:

    with contextlib.ExitStack() as stack:
        if precision.compute is not None:
            dtype = precision.compute_dtype
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
        if precision.saved is not None:
            stack.enter_context(
                compress_saved_activations(precision.saved, model, precision.min_numel, exclude)
            )
        yield


def _same_plan(plan: Plan, size: int) -> Callable[..., Plan]:
    """``replan`` for the executor: a smaller microbatch (the last ones of an uneven split, a
    short last batch) runs under the same plan; a larger one would not fit."""

    def replan(*args: Any, **kwargs: Any) -> Plan:
        leaves = [t for t in _tensors((args, kwargs)) if t.dim() > 0]
        if leaves and leaves[0].shape[0] > size:
            raise ValueError(
                f"this setup was fitted for microbatches of {size} examples, got "
                f"{leaves[0].shape[0]}: call remat.fit again for the larger batch"
            )
        return plan

    return replan


def _model_inputs(model: nn.Module, loss_fn: LossFn, batch: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that ``loss_fn(model, batch)`` calls the model with: the input
    signature the plan is made for (``batch = (x, y)`` with ``model(x)`` inside the loss gives
    ``((x,), {})``). Found as the capture finds it (a stand-in model that records its call and
    stops), so the plan's signature is the one its chain was captured at."""

    return _model_arguments(model, loss_fn, batch)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
