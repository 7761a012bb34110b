"""A model as a costed :class:`~remat.core.chain.Chain`: :func:`capture_chain` and :func:`capture`.

The model is cut into stages by :func:`remat.capture.stages.split_stages`; then the stages run one by
one on the real activations (each stage's input is the previous stage's output, detached, with
``requires_grad`` as it had in the model), and each stage is measured alone:

* ``out_bytes``: bytes of the output's storages that are new (not the input's: a tensor that
  passes through a stage unchanged, such as an attention mask, is counted where it is made);
* ``saved_bytes``: bytes of the **unique** storages that autograd saves for backward during the
  stage's forward (``torch.autograd.graph.saved_tensors_hooks``), each storage once, not counting
  parameters and buffers, nor the input ``a[i-1]`` (nor the batch), **plus** the output's bytes
  when the output storage is not among them (docs/cost-model.md's convention);
* ``fwd_overhead_bytes``: the highest activation-side bytes during the forward (from
  :class:`remat.measure.profile.StepTracker`) minus the input and ``saved_bytes``: transient memory
  beyond what the stage keeps;
* ``fwd_none_overhead_bytes``: the same forward run again without grad (as in a checkpointed
  segment): its highest bytes minus the input and its output (NOTE [ Forward without grad ]);
* ``bwd_overhead_bytes``: the highest activation-side bytes during the backward minus what
  was live before it, minus the output's gradient ``δ[i]`` (ones, made inside the backward
  and freed when consumed, as in a whole step) and minus the input gradient ``δ[i-1]``
  (``out_bytes[i-1]``): the simulator counts both gradients itself; and minus the output's
  bytes when the stage's own backward does not keep its output (a linear layer, GELU, a
  residual add): the simulator holds ``a[i]`` until ``B_i``, but in a whole step it is freed
  before (by the next stage's backward). Negative when autograd frees saved tensors and
  ``δ[i]`` before the peak (docs/cost-model.md);
* on real tensors the forward and backward also run under the allocator's own count
  (:class:`remat.measure.events.AllocatorWindow`), which sees the scratch memory kernels allocate
  inside themselves (oneDNN convolutions, batch norms, LSTMs on the CPU); what it saw above
  MemTracker's peak is added to the overheads. The next stage gets a copy of the output, so
  that a saved output is freed partway through the stage's backward, as in a whole step;
* ``fwd_time``, ``bwd_time``: median of ``repeats`` runs (``time.perf_counter``, CUDA
  synchronised); with ``fake=True`` the FLOPs of ``torch.utils.flop_counter.FlopCounterMode``
  instead (``time_unit="flop"``), or, given a ``time_model``
  (:class:`remat.measure.calibration.TimeModel`), the seconds it predicts from each op's FLOPs, bytes
  moved and count (``time_unit="s"``, nothing run for real);
* ``input_bytes``: the batch and ``a[0]`` (unique storages).

**The loss is folded into the last stage.** Stage ``n`` is measured as "last stage module, the
model's own output step (``Stages.finish``: e.g. a Hugging Face model's loss from ``labels``),
then ``loss_fn``": its output is the scalar loss (``out_bytes[n]`` = 4 bytes for float32, the
``δ[n]`` that :func:`remat.simulate` allocates at the loss) and what the loss saves (the
log-softmax of a cross-entropy: as large as the logits) is in its ``saved_bytes``; the
gradients the loss's backward makes are in its ``bwd_overhead_bytes``. So
``simulate(chain, Plan.none()).peak_bytes`` predicts the activation peak of a whole step, and
:func:`remat.auto.predicted_step_peak_bytes` the whole step's peak, which tests/test_capture.py
checks within 1 % of :func:`remat.measure.events.step_peak_bytes` on an MLP, ResNet-18, VGG-11, GPT-2
and an LSTM (measured: exact to a few bytes).

Measuring changes nothing: parameter gradients, buffers (batch-norm statistics) and the RNG
state are restored afterwards, and the stages run on a copy of the batch
(:class:`remat.measure.profile.BatchCopy`), so a model that writes into its input leaves the caller's
batch as it was; each stage's inputs that need no gradient get their values back before each
timed run, so each stage sees what one forward of the stages before it left.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    >>> chain = capture_chain(model, torch.randn(8, 16), fake=True)
    >>> chain.n, chain.time_unit
    (3, 'flop')

Known limitations: a plan that checkpoints the last stage cannot drop what the loss saves
(the executor runs the loss outside the stages), so such a plan may use up to the loss's
saved bytes more than predicted; under fake tensors user-named stages are not checked against
the model (the check compares values); a loss function that calls the model more than once is
refused (``ValueError``: the chain is one forward), and so is a stage that writes into its input
in place (:class:`remat.execute.chain.InPlaceInputError`: a checkpointed segment starting at it could
not be recomputed). Fake tensors allocate nothing: a ``fake=True`` capture measures the kernel
scratch memory (oneDNN's convolution and batch-norm workspaces) by running each op once for real
on zeroed tensors (:mod:`remat.measure.scratch`), except ops over its size limit and ops on a
device the planning process cannot run (it warns).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

from remat.capture.stages import Stages, split_stages
from remat.core.chain import Chain
from remat.core.errors import UnsupportedModelError
from remat.guards import (
    BatchCopy,
    BufferSnapshot,
    BufferWrites,
    _versions,
    in_place_input_error,
    running_stat_bytes,
)
from remat.measure.calibration import TimeModel, WorkCounter
from remat.measure.events import (
    AllocatorWindow,
    HeldPastStep,
    criterion_input_bytes,
    garbage_collected,
    older_objects_frozen,
    output_tensors,
    unique_storage_bytes,
)
from remat.measure.events import storage_bytes as _keys
from remat.measure.profile import ONE_MODEL_CALL, LossFn, StepTracker, default_loss_fn, fake_step
from remat.measure.scratch import ScratchProbe, ScratchWindow

__all__ = [
    "capture_chain",
    "draws_random",
    "capture",
    "Captured",
    "StageCost",
    "compile_stages",
    "measure_compiled_stage",
    "measure_stage",
    "unhooked_saved",
    "unhooked_saves",
]


@dataclass(frozen=True)
class Captured:
    """What :func:`capture` returns: the costs and the stages they were measured on."""

    chain: Chain
    """Per-stage costs (the loss folded into the last stage)."""
    stages: Stages
    """The model's stages (real modules, for :func:`remat.execute.chain.apply`)."""
    grad_rise_bytes: tuple[int, ...] = ()
    """Per stage, how much the parameter gradients its backward makes raise that backward's
    peak (0 when they appear after it, at most their size when they are all live at it). The
    whole-step prediction (:func:`remat.auto.step_costs`) uses it; empty when unknown."""
    output_bytes: int = 0
    """Unique bytes of what the model returns (``Stages.finish``: e.g. the logits, and a Hugging
    Face model's loss), parameters, buffers and the batch excluded: what a training loop that
    holds the output keeps through the step (:class:`remat.core.step.StepCosts`)."""
    largest_output_bytes: int = 0
    """Bytes of the largest tensor of that output (the logits) as a criterion reads it, half
    precision at float32 (:func:`remat.measure.events.criterion_input_bytes`): what a criterion
    the loop applies to it may save for its backward (:func:`remat.core.step.criterion_costs`)."""
    output_has_loss: bool = False
    """The output has its own ``.loss`` tensor (a Hugging Face model given labels, a model that
    computes its criterion inside): the loss remat captured is the loop's, not the output's
    sum, and no criterion of the loop's is left to count."""
    small_scratch_bytes: tuple[tuple[int, int], ...] = ()
    """Per stage, ``(forward, backward)`` allocator-only bytes below 1 KiB at its peaks
    (:attr:`StageCost.small_scratch_bytes`): :attr:`remat.core.step.StepCosts.
    op_scratch_bytes`. Empty when unknown (fake tensors)."""
    external_bytes: int = 0
    """Bytes of the storages the stages saved that the step did not make and the batch does
    not hold (:attr:`StageCost.external`: a target ``loss_fn`` reads from its closure),
    counted in ``chain.input_bytes``: a step measured with only the batch as its inputs does
    not count them (:func:`remat.auto._one_graph_peak` adds them)."""
    recompute_kept_bytes: tuple[int, ...] = ()
    """Per stage, the batch-norm running statistics (training mode) of its modules that the
    chain executor copies when it recomputes the stage (all under per-stage compile; eager,
    only those of batch norms with their own forward), kept by the recomputed backward
    (:attr:`remat.core.step.StepCosts.recompute_kept_bytes`). Empty when none."""
    buffer_copy_bytes: tuple[int, ...] = ()
    """Per stage, the bytes of the buffers its forward wrote when captured (batch norm's
    running statistics left out), which the chain executor copies around a checkpoint
    (:attr:`remat.core.step.StepCosts.buffer_copy_bytes`). Empty when none, and under fake
    tensors (not known there)."""
    held_past_step_bytes: int = 0
    """Bytes of tensors the capture's step made that the program still held after it
    (:class:`remat.measure.events.HeldPastStep`: a hook's feature dict, a cached attribute):
    live all step whatever the plan (:func:`remat.auto.step_costs`)."""
    forward_kept_bytes: tuple[int, ...] = ()
    """Per stage, the wrapped scalars its forward saves without the saved-tensor hooks
    (:func:`unhooked_saved`, NOTE [ Saved wrapped scalars ]): every forward of the stage keeps
    them, a checkpointed one too, until its backward (:attr:`remat.core.step.StepCosts.
    forward_kept_bytes`); not in ``saved_bytes``. Empty when unknown."""
    grad_made: tuple[frozenset[int], ...] = ()
    """Per stage, the ids of the model's parameters whose gradients its backward made, as
    measured (NOTE [ The gradients a stage's backward makes ]); empty when unknown."""
    forward_only_bytes: int = 0
    """Bytes of the carried tensors no stage saves, in ``chain.input_bytes``: freed when the
    forward returns where no checkpoint holds them (NOTE [ Carried tensors no stage saves ];
    :attr:`remat.core.step.StepCosts.forward_only_bytes`)."""
    carried_grads: tuple[tuple[int, int, int], ...] = ()
    """``(maker, last, bytes)`` per carried tensor that requires grad (NOTE [ The gradient of
    a carried tensor ]): stages from 0; :attr:`remat.core.step.StepCosts.carried_grads`."""
    random_stages: tuple[int, ...] = ()
    """The stages (numbers from 1) whose forward draws random numbers (:attr:`StageCost.random`:
    dropout). remat's executor replays them when it recomputes; torch's partitioner below its
    budget 1 does not (NOTE [ The partitioner's budget ] in remat.execute.chain)."""

    @property
    def loss_bytes(self) -> int:
        """Bytes of the loss tensor, the last stage's output
        (:attr:`remat.core.step.StepCosts.loss_bytes`)."""
        return self.chain.out_bytes[-1]


@dataclass(frozen=True)
class StageCost:
    """One stage measured alone (see the module docstring)."""

    out_bytes: int
    """New bytes of the stage's output."""
    saved_bytes: int
    """Unique bytes saved for backward (no parameters, no input), output included."""
    fwd_overhead_bytes: int
    """Transient bytes of the forward beyond the input and ``saved_bytes``."""
    fwd_none_overhead_bytes: int
    """Transient bytes of the forward run without grad beyond the input and the output
    (NOTE [ Forward without grad ])."""
    bwd_peak_bytes: int
    """Highest activation-side bytes of the backward minus what was live before it and minus
    the output's gradient ``δ[i]`` (which the simulator counts as live already); negative when
    the backward frees more before its peak than it allocates."""
    unsaved_out_bytes: int
    """Bytes of the new output that the stage's own backward does not keep (a linear layer's
    or GELU's output): in a whole step they are freed before this backward runs."""
    grad_rise_bytes: int
    """How much the parameter gradients the backward makes raise its peak."""
    fwd_time: float
    """Forward seconds (median) or FLOPs."""
    bwd_time: float
    """Backward seconds (median) or FLOPs."""
    kept_scalar_bytes: int = 0
    """Bytes of the wrapped scalars autograd saves in the forward (:func:`unhooked_saved`):
    kept from the stage's first forward to its backward whether or not the forward stores."""
    small_scratch_bytes: tuple[int, int] = (0, 0)
    """``(forward, backward)``: what the allocator saw above the tracked tensors at the peak
    when it is below :data:`remat.measure.events.SCRATCH_MIN_BYTES` (left out of the
    overheads, so that real and fake captures agree): a kernel's small workspace (layer norm's
    backward, 512 B in ViT's head) or the scalars of Python numbers."""
    external: Mapping[int, int] = field(default_factory=dict)
    """Storages (identity -> bytes) the forward saved that it did not make, outside the input,
    the parameters and the buffers: a target ``loss_fn`` reads from its closure, a tensor kept
    on a module as a plain attribute. They live all step, whatever the plan: counted with the
    chain's input, not in ``saved_bytes``."""
    packed: frozenset[int] = frozenset()
    """Every storage its forward saved for the backward, its inputs' too (identities): which
    carried tensors a stage saves (NOTE [ Carried tensors ])."""
    random: bool = False
    """The forward drew random numbers (:func:`draws_random`: dropout, ``randn_like``)."""
    seeded_layouts: tuple[Layout, ...] = ()
    """The layouts of the gradients its backward was given, one per output that requires grad
    (NOTE [ Gradient layouts ])."""
    input_grad_layouts: tuple[Layout | None, ...] = ()
    """The layouts of the gradients its backward made for its inputs that require grad, in
    order (None: no gradient reached that input)."""
    passed_through: tuple[tuple[int, int, int], ...] = ()
    """``(input, output, bytes)``: the positions (in the flattened tensors of its input and
    output) and bytes of each input tensor that requires grad it returns unchanged: a carried
    tensor (NOTE [ The gradient of a carried tensor ])."""
    grad_inputs: tuple[int, ...] = ()
    """The positions (in the flattened tensors of its input) of the inputs that require grad:
    the order of ``input_grad_layouts``."""
    grad_made: frozenset[int] = frozenset()
    """Positions in the ``params`` it was measured with of the parameters whose gradients its
    backward made (NOTE [ The gradients a stage's backward makes ])."""


def capture_chain(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    stages: Sequence[str] | None = None,
    fake: bool = False,
    repeats: int = 3,
    progress: bool = False,
    time_model: TimeModel | None = None,
) -> Chain:
    """Measure ``model`` on ``batch`` as a :class:`~remat.core.chain.Chain` (module docstring)."""
    return capture(model, batch, loss_fn, stages, fake, repeats, progress, time_model).chain


@older_objects_frozen()
def capture(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    stages: Sequence[str] | None = None,
    fake: bool = False,
    repeats: int = 3,
    progress: bool = False,
    time_model: TimeModel | None = None,
    *,
    compile: Mapping[str, Any] | None = None,
    eager_stages: Collection[int] = (),
) -> Captured:
    """Like :func:`capture_chain`, also returning the :class:`~remat.capture.stages.Stages` (for the
    executor). ``stages`` names the boundaries for models that are not cut automatically.
    ``progress`` shows a tqdm bar over the stages. ``time_model`` (with ``fake=True`` only)
    gives the stages' times in seconds from the work counted under fake tensors.

    ``compile`` (``torch.compile`` keyword arguments; real tensors only): the plan will run
    compiled (``remat.apply(..., compile=...)``: each stage its own compiled graph, NOTE [ One
    graph per stage ], or as one graph measured by ``remat.auto``, NOTE [ One compiled graph ]),
    so each stage is measured as it will run, compiled
    (:func:`compile_stages`, :func:`measure_compiled_stage`): what it saves (its partitioner
    recomputes some pointwise ops instead of saving them: a GPT-2 block saves about 40% less
    than eager), its transients and parameter gradients by the allocator's own events, and
    its times after warm-up. The last stage is its module compiled, with ``finish`` and the
    loss eager, as in the planned step. ``eager_stages`` (numbers from 1, with ``compile``):
    stages that run eager among the compiled ones, measured so (NOTE [ A stage compiled where
    it pays ] in remat.auto)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if time_model is not None and not fake:
        raise ValueError("time_model is for fake=True captures: a real capture times the stages")
    if fake and compile is not None:
        raise ValueError("compile= needs a real capture (fake=False): it runs the stages")
    if eager_stages and compile is None:
        raise ValueError("eager_stages= is for a compiled capture (compile=...)")
    loss_fn = loss_fn or default_loss_fn
    split = split_stages(model, stages)
    with HeldPastStep(model, batch, fake) as held:
        with garbage_collected():  # NOTE [ Collect before measuring ] in remat.measure.events
            captured = _capture(
                model,
                batch,
                loss_fn,
                split,
                fake,
                repeats,
                progress,
                time_model,
                compile,
                eager_stages,
            )
    return replace(captured, held_past_step_bytes=held.bytes)


def _capture(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    split: Stages,
    fake: bool,
    repeats: int,
    progress: bool,
    time_model: TimeModel | None = None,
    compile: Mapping[str, Any] | None = None,
    eager_stages: Collection[int] = (),
) -> Captured:
    copies: tuple[int, ...] = ()  # not known under fake tensors
    if fake:
        with fake_step(model, batch) as (mode, fake_batch, _), mode, ScratchProbe():
            chain, rises, output, kept, small, external, random, made, carried, only = (
                _measure_chain(
                    model, split, fake_batch, loss_fn, True, repeats, progress, time_model
                )
            )
    else:
        buffers = BufferSnapshot(model)
        writes = BufferWrites(split.modules)
        grads = {p: p.grad for p in model.parameters()}
        devices = sorted({t.device for t in buffers.tensors if t.device.type == "cuda"}, key=str)
        private = BatchCopy(batch)  # the model may write into its input: never the caller's
        try:
            # (the stages run as the planned forward runs them, autocast's cache off: compiled,
            # dynamo guards on that global state, and each stage was compiled twice)
            with torch.random.fork_rng(devices=devices), no_autocast_cache():
                calls = None if compile is None else compile_stages(split, compile, eager_stages)
                chain, rises, output, kept, small, external, random, made, carried, only = (
                    _measure_chain(
                        model,
                        split,
                        private.batch,
                        loss_fn,
                        False,
                        repeats,
                        progress,
                        calls=calls,
                        callers=batch,
                    )
                )
            copies = writes.written_bytes()
        finally:
            buffers.restore()
            for p, g in grads.items():
                p.grad = g
    # the eager executor pauses torch's batch norm's update instead of copying its statistics
    stats = tuple(running_stat_bytes(module, paused=compile is None) for module in split.modules)
    return Captured(
        chain,
        split,
        rises,
        *output,
        small_scratch_bytes=small,
        forward_kept_bytes=kept,
        external_bytes=external,
        recompute_kept_bytes=stats if any(stats) else (),
        buffer_copy_bytes=copies if any(copies) else (),
        random_stages=random,
        grad_made=_parameter_ids(model, made),
        carried_grads=carried,
        forward_only_bytes=only,
    )


def _parameter_ids(model: nn.Module, positions: Sequence[frozenset[int]]) -> tuple:
    """Per stage, the ids of ``model``'s parameters at ``positions`` in ``model.parameters()``
    (measured there, under fake tensors on the fakes in their places)."""
    params = list(model.parameters())
    return tuple(frozenset(id(params[i]) for i in stage) for stage in positions)


def compile_stages(
    split: Stages, options: Mapping[str, Any], eager: Collection[int] = ()
) -> tuple[Callable[[Any], Any], ...]:
    """Each stage's module compiled on its own (``torch.compile`` with ``options``, static
    shapes), but the stages numbered in ``eager`` (from 1), which run as their modules: what
    ``remat.apply(..., compile=...)`` runs for a plan not marked one-graph and
    ``capture(compile=...)`` measures.

    NOTE [ One graph per stage ]: a compiled plan that is not marked one-graph (what
    ``remat.auto`` runs where no plan's one graph measured within the budget, and
    ``remat.apply``'s default for a hand-made plan; NOTE [ One compiled graph ] in
    remat.execute.chain is the other mode) runs each stage as its own compiled graph
    (the checkpointed segments around them are eager checkpoints), not the whole forward as
    one graph: so each stage saves, allocates and takes in the step exactly what it did when
    measured. In one graph the partitioner decides across stages, and the stages measured
    compiled alone did not predict the step: GPT-2 tiny's plan ``(1-2) (3) [4]`` measured
    25,330,872 B under inductor against 20,491,324 B predicted, and under
    ``aot_eager_decomp_partition`` a checkpointed block's recomputation held 8.1 MB in the
    backward graph, its compiled forward alone saved 4.5 MB (docs/results/compile/README.md).
    Stages with the same code (a model's blocks) share one compilation."""
    opts = {"dynamic": False, **options}
    # dynamo caches its graphs per code object: one per stage and shape, at most
    # ``recompile_limit`` (8), then the rest ran eagerly (DenseNet-121's dense-layer groups: 15
    # input widths; RegNet's 6 block stages re-planned for a second batch shape: 12; VGG-11's
    # 14 stages of torch.nn classes, 13 graphs on one code: :func:`_frame_code`), and each
    # stage compiles again under autocast (dynamo guards on its state). The limit is raised to
    # the most stages compiled on one code object in this process, every re-plan's and
    # executor's counted, times :data:`_STAGE_VARIANTS`.
    compiled = [i not in eager for i in range(1, split.n + 1)]
    codes = [_frame_code(m) for m, c in zip(split.modules, compiled, strict=True) if c]
    _COMPILED_STAGES.update(code for code in codes if code is not None)
    most = max((_COMPILED_STAGES[code] for code in codes if code is not None), default=0)
    config = torch._dynamo.config
    most *= _STAGE_VARIANTS
    config.recompile_limit = max(config.recompile_limit, most)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, most)
    return tuple(
        torch.compile(module, **opts) if c else module
        for module, c in zip(split.modules, compiled, strict=True)
    )


_STAGE_VARIANTS = 4
"""Graphs one compiled stage may need for one input shape: one per autocast state the step runs
in (off, bfloat16, float16: dynamo guards on it) and one more where the batch requires grad
(the first stage's input)."""
_COMPILED_STAGES: Counter[Any] = Counter()
"""Stage modules :func:`compile_stages` compiled in this process, per code object dynamo caches
their graphs on (:func:`_frame_code`; an upper bound on dynamo's graphs for that code: each is
compiled for one shape)."""


def _frame_code(module: nn.Module) -> Any:
    """The code object dynamo keeps ``torch.compile(module)``'s graphs on: its class's
    ``forward``; but a ``forward`` of torch's own (``nn.Linear``, ``nn.Sequential`` and their
    subclasses), which dynamo does not start a frame in, runs inside one wrapper function that
    every such module compiled in the process shares (``torch._dynamo.external_utils.
    wrap_inline``), so all of them count against that one code's limit."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None:
        return None
    if torch._dynamo.config.wrap_top_frame or _torch_skips(module):
        return _WRAPPED_FRAME
    return code


_WRAPPED_FRAME = "torch.nn forward run inside dynamo's wrap_inline"
""":func:`_frame_code`'s one key for the modules whose frames share ``wrap_inline``'s code."""


def _torch_skips(module: nn.Module) -> bool:
    """Whether dynamo does not start a frame in ``module.forward`` (its trace rules skip it: a
    ``forward`` defined in torch), so that ``torch.compile(module)`` wraps it (torch 2.14:
    ``OptimizedModule._forward_has_skip_rule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    rule = getattr(OptimizedModule, "_forward_has_skip_rule", None)
    if rule is None:  # another torch: a forward of torch's own, by where it is defined
        return type(module).forward.__module__.startswith("torch.")
    return bool(rule(module))


# ---------------------------------------------------------------------- implementation
class _Stop(Exception):
    """Raised by the recording proxy once it has seen the model's arguments."""


class _ModelProxy:
    """Stands in for the model inside ``loss_fn``: calling it runs ``call``; attributes come
    from the model."""

    def __init__(self, model: nn.Module, call: Callable[..., Any]) -> None:
        self._model = model
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _model_arguments(model: nn.Module, loss_fn: LossFn, batch: Any) -> tuple[tuple, dict]:
    """What ``loss_fn`` calls the model with."""
    args, kwargs, _ = _model_call(model, loss_fn, batch)
    return args, kwargs


def _model_call(model: nn.Module, loss_fn: LossFn, batch: Any) -> tuple[tuple, dict, Regions]:
    """What ``loss_fn`` calls the model with, and the autocast regions it calls it in
    (:func:`autocast_now`; :func:`autocast_regions` enters them again: stages measured alone
    run as they run in the step)."""
    seen: list[tuple[tuple, dict, Regions]] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs, autocast_now()))
        raise _Stop

    try:
        loss_fn(_ModelProxy(model, record), batch)  # type: ignore[arg-type]
    except _Stop:
        pass
    if not seen:
        raise ValueError("loss_fn(model, batch) never called the model: remat cannot capture it")
    return seen[0]


Regions = tuple[tuple[str, torch.dtype], ...]
""":func:`autocast_now`: the autocast regions in force, ``(device type, dtype)`` each."""


def autocast_now() -> Regions:
    """The ``torch.autocast`` regions in force now: ``(device type, dtype)`` for the CPU and
    CUDA where enabled (empty: none)."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )


def autocast_regions(regions: Regions) -> contextlib.AbstractContextManager:
    """A context (entered by the call) in which exactly ``regions`` (:func:`autocast_now`'s
    form) are in force: those on, the others off, inside another region too. The weight-cast
    cache is off in it, as in the planned forward (:func:`no_autocast_cache`)."""
    stack = contextlib.ExitStack()
    on = dict(regions)
    for device in ("cpu", "cuda"):
        if device in on:
            stack.enter_context(torch.autocast(device, dtype=on[device], cache_enabled=False))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


@contextlib.contextmanager
def no_autocast_cache() -> Any:
    """Autocast's weight-cast cache off for the body (nothing changes outside autocast).

    The cache keeps each 16-bit copy of a weight until the outermost autocast region ends,
    the whole forward: the copies a checkpointed segment made would stay through the rest of
    the forward although the plan dropped them (Llama tiny in bf16 measured 8,720 B over its
    budget), and a bias's copy, which no backward saves, would outlive its stage. Without the
    cache each copy lives as its stage's capture measured it (a weight read twice in one stage
    is cast twice)."""
    if not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


def _under(regions: Regions, run: Callable) -> Callable:
    """``run`` called in the autocast ``regions`` (:func:`autocast_regions`)."""

    def call(inp: Any) -> Any:
        with autocast_regions(regions):
            return run(inp)

    return call


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _writes_input(run: Callable[[Any], Any], inp: Any) -> bool:
    """Whether ``run`` writes into its input in place (tried on a copy without grad, where
    writing into a leaf is allowed; buffers and RNG are restored by the caller)."""
    probe = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), inp)
    versions = _versions(_tensors(probe))
    try:
        with torch.no_grad():
            run(probe)
    except Exception:  # noqa: BLE001 - the caller re-raises the original error
        return False
    return _versions(_tensors(probe)) != versions


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_chain(
    model: nn.Module,
    split: Stages,
    batch: Any,
    loss_fn: LossFn,
    fake: bool,
    repeats: int,
    progress: bool,
    time_model: TimeModel | None = None,
    calls: Sequence[Callable[[Any], Any]] | None = None,
    callers: Any = None,
) -> tuple[
    Chain,
    tuple[int, ...],
    tuple[int, int, bool],
    tuple[int, ...],
    tuple[tuple[int, int], ...],
    int,
    tuple[int, ...],
    tuple[frozenset[int], ...],
    tuple[tuple[int, int, int], ...],
    int,
]:
    """``calls``: what runs each stage (:func:`compile_stages`: a compiled one is measured by
    :func:`measure_compiled_stage`, its module by :func:`measure_stage`). The last items are
    :attr:`Captured.external_bytes`, :attr:`Captured.random_stages` and per stage the positions
    in ``model.parameters()`` of :attr:`StageCost.grad_made`, and
    :attr:`Captured.carried_grads` and :attr:`Captured.forward_only_bytes`."""
    from tqdm.auto import tqdm

    args, kwargs, autocast = _model_call(model, loss_fn, batch)
    if split.check is not None and not fake:
        split.check(*args, **kwargs)  # compares values: not possible on fake tensors
    if split.fake_check is not None and fake:
        split.fake_check(*args, **kwargs)
    with autocast_regions(autocast):
        a0 = split.prepare(*args, **kwargs)
    fixed = _keys([*model.parameters(), *model.buffers()])
    outside = _keys([*_tensors(batch), *_tensors((args, kwargs)), *_tensors(a0)])
    input_bytes = sum(outside.values())
    # the caller's own batch tensors, of which ``batch`` is a copy: a loss_fn that reads one
    # from its closure (labels that are the batch's input_ids) reads the batch, counted above
    # (the last stage counted it as a tensor it saved: 512 B over on each HF decoder here)
    skip = fixed | outside | {k: 0 for k in _keys(_tensors(callers))}
    params = list(model.parameters())
    for p in params:
        p.grad = None
    costs: list[StageCost] = []
    outs: list[int] = []
    trains: list[bool] = []  # per stage, whether its output needs a gradient
    # the model's output (what finish returns): all, largest, whether it has its own .loss
    held: list[tuple[int, int, bool]] = []
    x = a0
    n = split.n
    made: list[dict[int, int]] = []  # per stage, the storages its output has that are new
    passed: list[set[int]] = []  # per stage, every storage of its output
    bar = tqdm(total=n, desc="measuring stages", unit="stage", disable=not progress, leave=False)
    # the stage before: how to measure it again, and its input (held one stage longer)
    before_stage: tuple[Callable[..., tuple[StageCost, Any]], Any] | None = None
    try:
        for i, module in enumerate(split.modules):
            last = i == n - 1
            stage: Callable[[Any], Any] = module if calls is None else calls[i]
            if last:

                def run(inp: Any, module: Callable[[Any], Any] = stage) -> Any:
                    calls = []

                    def call(*a: Any, **k: Any) -> Any:
                        calls.append(None)
                        if len(calls) > 1:  # the chain is one forward of the model
                            raise ValueError(ONE_MODEL_CALL)
                        out = split.finish(module(inp), *a, **k)
                        if not held:
                            tensors = output_tensors(out)
                            new = _keys(tensors)
                            kept = [v for key, v in new.items() if key not in skip]
                            read = [
                                criterion_input_bytes(t)
                                for t in tensors
                                if t.untyped_storage()._cdata not in skip
                            ]
                            has_loss = isinstance(getattr(out, "loss", None), torch.Tensor)
                            held.append((sum(kept), max(read, default=0), has_loss))
                        return out

                    return loss_fn(_ModelProxy(model, call), batch)  # type: ignore[arg-type]
            else:
                run = _under(autocast, stage)
            versions = _versions(_tensors(x))

            def measure(
                x: Any,
                layouts: Sequence[Layout | None] | None = None,
                run: Callable[[Any], Any] = run,
                compiled: bool = stage is not module,
                module: nn.Module = module,
            ) -> tuple[StageCost, Any]:
                if compiled:
                    return measure_compiled_stage(
                        run, x, skip, repeats, params, grad_layouts=layouts
                    )
                return measure_stage(
                    run,
                    x,
                    exclude=skip,
                    fake=fake,
                    repeats=repeats,
                    params=params,
                    track=module,
                    time_model=time_model,
                    grad_layouts=layouts,
                )

            try:
                cost, out = measure(x)
            except RuntimeError as err:  # a leaf that requires grad written in place: whose?
                if last and "backward through the graph a second time" in str(err):
                    # the stages are measured apart: each one's backward has run by now
                    raise UnsupportedModelError(
                        "the loss reads a tensor an earlier stage made (a forward hook that "
                        "keeps a layer's output for a feature loss?), so the stages cannot be "
                        "measured one at a time; remat plans the module graph instead "
                        "(remat.auto does), which runs the whole step"
                    ) from err
                if "in-place" in str(err) and _writes_input(run, x):
                    raise in_place_input_error(i + 1, split.names[i]) from err
                raise
            if _versions(_tensors(x)) != versions:
                raise in_place_input_error(i + 1, split.names[i])
            if before_stage is not None and not _same_layouts(
                costs[-1].seeded_layouts, cost.input_grad_layouts
            ):
                # NOTE [ Gradient layouts ]
                redo, x_before = before_stage
                costs[-1], _ = redo(x_before, cost.input_grad_layouts)
            before_stage = (measure, x)
            costs.append(cost)
            outs.append(cost.out_bytes)
            trains.append(any(t.requires_grad for t in _tensors(out)))
            before = _keys(_tensors(x))
            after = _keys(_tensors(out))
            made.append({s: b for s, b in after.items() if s not in skip and s not in before})
            passed.append(set(after))
            x = out
            bar.update(1)
    finally:
        bar.close()
        for p in params:
            p.grad = None
    # NOTE [ Carried tensors ]: a tensor a stage makes that every later stage passes on
    # unchanged (an attention mask, position embeddings: the extra arguments of every block)
    # lives to the end of the forward whatever the plan, even where the activation it was
    # made in is dropped: counted with the input, not in that stage's output
    carried = [0] * n
    saved_bytes = [c.saved_bytes for c in costs]
    external: dict[int, int] = {}  # StageCost.external: counted with the input
    for c in costs:
        external.update({k: v for k, v in c.external.items() if k not in skip})
    input_bytes += sum(external.values())
    # NOTE [ Carried tensors no stage saves ]: a carried tensor no stage saves (Llama's causal
    # mask, which the attention adds and keeps no copy of) is freed when the model's forward
    # returns, unless a checkpoint holds it as a segment's input: counted in the chain's input,
    # it made the store-all step of every HF decoder 8,964 B above what it measured, and a
    # budget at the eager peak recomputed. StepCosts.forward_only_bytes
    packed = frozenset().union(*(c.packed for c in costs))
    forward_only = 0
    for j in range(n - 2):  # passed on by stages j+2 .. n-1, to the last
        for key, nbytes in made[j].items():
            if all(key in later for later in passed[j + 1 : n - 1]):
                outs[j] -= nbytes
                saved_bytes[j] -= nbytes  # (the output is in saved_bytes: its convention)
                carried[j] += nbytes
                forward_only += 0 if key in packed else nbytes
    input_bytes += sum(carried)
    # NOTE [ The gradient of a carried tensor ]: a carried tensor that requires grad (DeBERTa's
    # relative-position embeddings, a layer norm of a parameter made before the blocks) gets a
    # gradient from each block's backward; autograd adds them up in one buffer that lives from
    # the last block's backward to the backward of the stage that made the tensor. A stage
    # measured alone counts the gradient its backward gives an input as a gradient, not as
    # its bytes, and the chain's delta is the hidden state's only, so the buffer was counted
    # nowhere: a tiny DeBERTa measured 4,096 B (that buffer) above the prediction at every
    # plan, and over a budget set between the two. StepCosts.carried_grads counts it
    carried_grads = _carried_grads(costs)
    # the leading stages whose output needs no gradient (frozen layers on a batch without
    # gradient) have no backward: Chain.frozen_prefix
    frozen = next((i for i, needs in enumerate(trains) if needs), n)
    bwd_overhead = []
    for i, cost in enumerate(costs):
        if i < frozen:
            bwd_overhead.append(0)
            continue
        grad_in = outs[i - 1] if i > frozen else 0  # a[i] gets a gradient when it needs one
        # The simulator holds a[i] until B_i; in a whole step an output the stage's backward
        # does not need is gone by then (the next stage's backward, or the end of the
        # checkpointed segment that took it as input, released it). The last stage's output
        # is the loss.
        gone = max(0, cost.unsaved_out_bytes - carried[i]) if i < len(costs) - 1 else 0
        # may be negative: the backward frees saved tensors and δ[i] before its peak (Chain)
        floor = -(cost.saved_bytes + cost.out_bytes)
        bwd_overhead.append(max(floor, cost.bwd_peak_bytes - grad_in - gone))
    chain = Chain(
        fwd_time=[c.fwd_time for c in costs],
        bwd_time=[c.bwd_time for c in costs],
        out_bytes=outs,
        saved_bytes=saved_bytes,
        input_bytes=input_bytes,
        fwd_overhead_bytes=[c.fwd_overhead_bytes for c in costs],
        bwd_overhead_bytes=bwd_overhead,
        fwd_none_overhead_bytes=[c.fwd_none_overhead_bytes for c in costs],
        frozen_prefix=frozen,
        names=split.names,
        time_unit="flop" if fake and time_model is None else "s",
        stages_fingerprint=split.fingerprint,
    )
    return (
        chain,
        tuple(c.grad_rise_bytes for c in costs),
        held[0] if held else (0, 0, False),
        tuple(c.kept_scalar_bytes for c in costs),
        tuple(c.small_scratch_bytes for c in costs),
        sum(external.values()),
        tuple(i + 1 for i, c in enumerate(costs) if c.random),
        tuple(c.grad_made for c in costs),
        carried_grads,
        forward_only,
    )


def _carried_grads(costs: Sequence[StageCost]) -> tuple[tuple[int, int, int], ...]:
    """:attr:`Captured.carried_grads`: per tensor that requires grad, made by a stage and
    returned unchanged by the next one or more (:attr:`StageCost.passed_through`),
    ``(maker, last, bytes)``: the stage that makes it, the last stage whose backward gave it
    a gradient, and its bytes (NOTE [ The gradient of a carried tensor ])."""
    out = []
    for j in range(len(costs) - 1):
        # outputs of stage j that stage j + 1 returns unchanged and stage j did not get
        got = {q for _, q, _ in costs[j].passed_through}
        for p, _, nbytes in costs[j + 1].passed_through:
            if p in got:
                continue
            takers = []
            i, pos = j + 1, p
            while pos is not None and i < len(costs):
                if _grad_reached(costs[i], pos):
                    takers.append(i)
                pos = next((q for a, q, _ in costs[i].passed_through if a == pos), None)
                i += 1
            if takers and nbytes:
                out.append((j, max(takers), nbytes))
    return tuple(out)


def _grad_reached(cost: StageCost, position: int) -> bool:
    """Whether the backward of ``cost``'s stage gave its input tensor at ``position`` (in its
    flattened input) a gradient."""
    rank = cost.grad_inputs.index(position) if position in cost.grad_inputs else -1
    return 0 <= rank < len(cost.input_grad_layouts) and cost.input_grad_layouts[rank] is not None


def measure_stage(
    run: Callable[[Any], Any],
    inp: Any,
    exclude: dict[int, int] | None = None,
    fake: bool = False,
    repeats: int = 3,
    params: Sequence[torch.Tensor] = (),
    track: nn.Module | None = None,
    time_model: TimeModel | None = None,
    grad_layouts: Sequence[Layout | None] | None = None,
) -> tuple[StageCost, Any]:
    """Measure ``run(x)`` on a detached copy ``x`` of ``inp``; return its cost and its output
    (detached, ``requires_grad`` kept) for the next stage. The backward is given gradients of
    ones in ``grad_layouts`` (default: each output's own; NOTE [ Gradient layouts ]).

    ``exclude`` maps storages not to count as saved (parameters, buffers, the batch);
    ``params`` get their gradients reset to ``None`` after each backward. Under fake tensors
    the times are FLOPs, or the seconds ``time_model`` predicts.

    A stage may write into its input in place (``x.add_(1)``, as a block may in a model): it
    gets ``x`` through an identity autograd function, not the leaf itself, and the inputs that
    need no gradient (the batch, masks: the same tensors as the next stages') get their values
    back before each timed run, so that after this stage they hold what one run left in them.
    """
    x = tree_map_only(torch.Tensor, _fresh_leaf, inp)
    x_tensors = _tensors(x)
    # values of the inputs that need no gradient, for the timed runs (not under fake tensors)
    inputs = BatchCopy([] if fake else [t for t in x_tensors if not t.requires_grad], snapshot=True)
    skip = dict(exclude or {})
    skip.update(_keys(x_tensors))
    saved: dict[int, int] = {}
    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st._cdata
        packed.add(key)
        if key not in skip:
            saved[key] = st.nbytes()
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def reset() -> None:
        for p in params:
            p.grad = None
        for t in x_tensors:
            t.grad = None

    # memory (and, under fake tensors, FLOPs): one run under the tracker, and on real tensors
    # under the allocator's own count too (it also sees kernels' internal scratch memory)
    device = next((t.device for t in x_tensors), None)
    fwd_counter, bwd_counter = _work_counters(fake, time_model)
    tracker = StepTracker(timeline=False)
    fwd_alloc, bwd_alloc = _allocator_windows(fake, device, tracker)
    tracker.track_external(*([track] if track is not None else []), *x_tensors)
    with tracker:
        tracker.start()
        base = tracker.activation_bytes()
        tracker.set_phase("forward")
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), fwd_counter, fwd_alloc:
            with _MadeStorages() as made:
                out = run(_entered(x))
        fwd_tracked = tracker.window_peak - base
        fwd_scratch, fwd_small = fwd_alloc.excess(fwd_tracked)
        fwd_peak = fwd_tracked + fwd_scratch
        out_tensors = _tensors(out)
        new_out = {k: v for k, v in _keys(out_tensors).items() if k not in skip}
        kept = {**saved, **new_out}
        scalars = unhooked_saved(out_tensors, {**skip, **kept}, device)
        external = {k: v for k, v in saved.items() if k not in made.keys and k not in new_out}
        saved_bytes = sum(kept.values()) - sum(external.values())
        seed, grad_bytes = _seed(out_tensors, grad_layouts)
        seeded = _seeded(out_tensors, grad_layouts)
        passed_through = _passed_through(x_tensors, out_tensors)
        # the seed's own gradient, made before the window: a whole step has no such tensor
        seed_grad = None if seed is None else torch.ones_like(seed)
        # the next stage gets a copy: the output itself must be free to go when autograd
        # releases it (a saved output is freed partway through the backward, as in a step)
        next_input = tree_map_only(torch.Tensor, _fresh_copy, out)
        del out, out_tensors
        tracker.reset_window()
        start_bwd = tracker.activation_bytes()
        tracker.set_phase("backward")
        with bwd_counter, bwd_alloc, _InputGradLayouts(x_tensors) as input_grads:
            if seed is not None:
                seed.backward(seed_grad)
        # scratch memory only the allocator saw (it counts parameter gradients too)
        scratch, bwd_small = bwd_alloc.excess(tracker.window_peak_with_grads - start_bwd)
        bwd_peak = tracker.window_peak - start_bwd + scratch - grad_bytes
        # parameter gradients start at None (reset), so the two windows share their base
        grad_rise = max(0, tracker.window_peak_with_grads - tracker.window_peak)
        grad_made = _grads_made(params)
        del seed, seed_grad
        # NOTE [ Forward without grad ]: the same forward without grad (a checkpointed
        # segment's, F_none) frees its intermediates as it goes, but several may be live at
        # once (an MLP's h and gelu(h), both saved with grad: fwd_overhead_bytes 0 there)
        reset()
        inputs.restore()
        none_alloc = _allocator_windows(fake, device, tracker)[0]
        tracker.reset_mod_stats()  # (a module's second forward under the tracker)
        tracker.reset_window()
        none_base = tracker.activation_bytes()
        with torch.no_grad(), none_alloc:
            none_out = run(_entered(x))
        none_tracked = tracker.window_peak - none_base
        none_peak = none_tracked + none_alloc.excess(none_tracked)[0]
        del none_out
    reset()

    # time: FLOPs or modelled seconds under fake tensors, else the median of `repeats` runs
    if fake:
        fwd_time = fwd_counter.cost()
        bwd_time = bwd_counter.cost()
    else:
        fwd_time, bwd_time = _timed_runs(run, x, inputs, reset, repeats, device, grad_layouts)
    cost = StageCost(
        out_bytes=sum(new_out.values()),
        saved_bytes=saved_bytes,
        fwd_overhead_bytes=max(0, fwd_peak - saved_bytes),
        fwd_none_overhead_bytes=max(0, none_peak - sum(new_out.values())),
        bwd_peak_bytes=bwd_peak,
        unsaved_out_bytes=sum(v for k, v in new_out.items() if k not in saved),
        grad_rise_bytes=grad_rise,
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        kept_scalar_bytes=sum(scalars.values()),
        small_scratch_bytes=(fwd_small, bwd_small),
        external=external,
        random=made.random,
        seeded_layouts=seeded,
        input_grad_layouts=input_grads.layouts,
        grad_made=grad_made,
        passed_through=passed_through,
        grad_inputs=input_grads.positions,
        packed=frozenset(packed),
    )
    return cost, next_input


def draws_random(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the ATen op ``func``, called with ``args`` and ``kwargs``, draws random numbers:
    it is tagged ``nondeterministic_seeded`` (dropout, ``randn_like``) and not given a dropout
    probability of 0 (``dropout_p``: the fused attention kernels are tagged whether they drop or
    not, and GPT-2 with its dropout set to 0 counted as random)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            if "dropout_p" in kwargs:
                return bool(kwargs["dropout_p"])
            return bool(args[i]) if i < len(args) else bool(arg.default_value)
    return True


class _MadeStorages(TorchDispatchMode):
    """The storages the ops run under it make (:func:`_keys`): ``keys``; ``random``: whether one
    of them draws random numbers (:func:`draws_random`)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()
        self.random = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.random = self.random or draws_random(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        self.keys.update(_keys(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


def measure_compiled_stage(
    run: Callable[[Any], Any],
    inp: Any,
    exclude: dict[int, int],
    repeats: int,
    params: Sequence[torch.Tensor],
    grad_layouts: Sequence[Layout | None] | None = None,
) -> tuple[StageCost, Any]:
    """:func:`measure_stage` for a compiled stage (:func:`compile_stages`), by the allocator's
    own count alone (compiled kernels allocate outside any TorchDispatchMode, and dynamo runs
    the stage eagerly under one): one untimed step compiles the forward and the backward, the
    next is measured, then ``repeats`` are timed.

    The same quantities as :func:`measure_stage`: ``saved_bytes`` from the saved-tensor hooks
    (the compiled function's saved tensors, output included); the forward's transients are its
    allocator peak above the start minus them; the backward's peak is its allocator peak minus
    ``δ[i]`` and minus the parameter gradients it made, which are its ``grad_rise_bytes``
    (all of them: the compiled backward returns them together)."""
    x = tree_map_only(torch.Tensor, _fresh_leaf, inp)
    x_tensors = _tensors(x)
    inputs = BatchCopy([t for t in x_tensors if not t.requires_grad], snapshot=True)
    skip = dict(exclude)
    skip.update(_keys(x_tensors))
    device = next((t.device for t in x_tensors), None)
    saved: dict[int, int] = {}

    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        packed.add(st._cdata)
        if st._cdata not in skip:
            saved[st._cdata] = st.nbytes()
        return t

    def reset() -> None:
        for p in params:
            p.grad = None
        for t in x_tensors:
            t.grad = None

    def one_step() -> None:  # compiles the forward and (at its first call) the backward
        inputs.restore()
        seed, _ = _seed(_tensors(run(_entered(x))), grad_layouts)
        if seed is not None:
            seed.backward()
        del seed
        reset()

    one_step()
    external, random = _external_saved(run, x, inputs, pack, saved)
    inputs.restore()
    fwd_alloc, bwd_alloc = AllocatorWindow(device), AllocatorWindow(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, _identity), fwd_alloc:
        out = run(_entered(x))
    out_tensors = _tensors(out)
    new_out = {k: v for k, v in _keys(out_tensors).items() if k not in skip}
    saved_bytes = sum({**saved, **new_out}.values()) - sum(
        v for k, v in external.items() if k in saved and k not in new_out
    )
    seed, grad_bytes = _seed(out_tensors, grad_layouts)
    seeded = _seeded(out_tensors, grad_layouts)
    passed_through = _passed_through(x_tensors, out_tensors)
    next_input = tree_map_only(torch.Tensor, _fresh_copy, out)
    del out, out_tensors
    with bwd_alloc, _InputGradLayouts(x_tensors) as input_grads:
        if seed is not None:
            seed.backward()
    del seed
    made = unique_storage_bytes(p.grad for p in params if p.grad is not None)
    grad_made = _grads_made(params)
    if fwd_alloc.peak_bytes is None or bwd_alloc.peak_bytes is None:
        raise RuntimeError(
            "capture(compile=...) counts a compiled stage's memory with the allocator's own "
            "events: capture outside a torch.profiler session (and on a CPU or CUDA device)"
        )
    reset()
    fwd_time, bwd_time = _timed_runs(run, x, inputs, reset, repeats, device, grad_layouts)
    cost = StageCost(
        out_bytes=sum(new_out.values()),
        saved_bytes=saved_bytes,
        fwd_overhead_bytes=max(0, fwd_alloc.peak_bytes - saved_bytes),
        # not measured without grad (it would compile another graph): bounded by the forward
        # with grad, which holds at each moment what the one without grad holds and more
        fwd_none_overhead_bytes=max(0, fwd_alloc.peak_bytes - sum(new_out.values())),
        bwd_peak_bytes=bwd_alloc.peak_bytes - grad_bytes - made,
        unsaved_out_bytes=sum(v for k, v in new_out.items() if k not in saved),
        grad_rise_bytes=made,
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        external=external,
        random=random,
        seeded_layouts=seeded,
        input_grad_layouts=input_grads.layouts,
        grad_made=grad_made,
        passed_through=passed_through,
        grad_inputs=input_grads.positions,
        packed=frozenset(packed),
    )
    return cost, next_input


def _grads_made(params: Sequence[torch.Tensor]) -> frozenset[int]:
    """NOTE [ The gradients a stage's backward makes ]: the positions in ``params`` of those
    with a gradient after a stage's backward (they start at None). A parameter's gradient is
    counted from the backward that makes it (:func:`remat.auto.stage_grad_bytes`), and which
    stage's that is can only be seen: a parameter on the model itself that the code before its
    blocks reads (timm ViT's ``pos_embed`` and ``cls_token``) belongs to no stage's module, and
    counted with the stage after the blocks, whose backward runs first, it was counted in the
    gradients of the stage before the blocks twice (8,448 B, the whole step predicted that much
    above what it measured, and a budget its plan met refused)."""
    return frozenset(i for i, p in enumerate(params) if p.grad is not None)


def _external_saved(
    run: Callable[[Any], Any],
    x: Any,
    inputs: BatchCopy,
    pack: Callable[[torch.Tensor], torch.Tensor],
    saved: dict[int, int],
) -> tuple[dict[int, int], bool]:
    """:attr:`StageCost.external` and :attr:`StageCost.random` of a compiled stage: the storages
    its forward saves that it did not make (a target ``loss_fn`` reads from its closure), and
    whether it draws random numbers, found on one forward run eagerly
    (``torch.compiler.set_stance("force_eager")``: the op-level count of the storages made is a
    TorchDispatchMode, which compiled kernels bypass). Which tensors from outside a
    stage reads is its Python code's, the same compiled; without it, a classifier's target
    (8 bytes a sample) was counted as saved until the last stage's backward, not for the
    whole step as the step measures it. ``saved`` is the dict ``pack`` fills, emptied after."""
    inputs.restore()
    with (
        torch.compiler.set_stance("force_eager"),
        torch.autograd.graph.saved_tensors_hooks(pack, _identity),
        _MadeStorages() as made,
    ):
        out = run(_entered(x))
    new_out = _keys(_tensors(out))
    del out
    external = {k: v for k, v in saved.items() if k not in made.keys and k not in new_out}
    saved.clear()  # (``pack`` skips ``skip``: the inputs, parameters and buffers)
    return external, made.random


def _timed_runs(
    run: Callable[[Any], Any],
    x: Any,
    inputs: BatchCopy,
    reset: Callable[[], None],
    repeats: int,
    device: torch.device | None,
    grad_layouts: Sequence[Layout | None] | None = None,
) -> tuple[float, float]:
    """Median forward and backward seconds of ``repeats`` runs of ``run`` on ``x`` (the inputs
    without gradient restored before each, ``reset`` after each; the backward seeded as
    :func:`_seed` with ``grad_layouts``)."""
    fwd_times, bwd_times = [], []
    for _ in range(repeats):
        inputs.restore()
        entered = _entered(x)
        _sync(device)
        start = time.perf_counter()
        out = run(entered)
        _sync(device)
        fwd_times.append(time.perf_counter() - start)
        seed, _ = _seed(_tensors(out), grad_layouts)
        _sync(device)
        start = time.perf_counter()
        if seed is not None:
            seed.backward()
        _sync(device)
        bwd_times.append(time.perf_counter() - start)
        del out, seed, entered
        reset()
    return statistics.median(fwd_times), statistics.median(bwd_times)


def unhooked_saved(
    outputs: Iterable[torch.Tensor],
    known: Mapping[int, int] | set[int],
    device: torch.device | None,
) -> dict[int, int]:
    """Storages (``_cdata`` key: bytes) on ``device`` that the autograd graph behind
    ``outputs`` saves for its backward and that are not in ``known``: the tensors autograd
    saves without calling ``saved_tensors_hooks`` (:func:`unhooked_saves`, NOTE [ Saved
    wrapped scalars ])."""
    return {key: nbytes for _, key, nbytes in unhooked_saves(outputs, known, device)}


def unhooked_saves(
    outputs: Iterable[torch.Tensor],
    known: Mapping[int, int] | set[int],
    device: torch.device | None,
) -> Iterator[tuple[Any, int, int]]:
    """``(autograd function, storage key, bytes)`` for each storage on ``device`` that the
    autograd graph behind ``outputs`` saves for its backward and that is not in ``known``
    (``_cdata`` keys), each storage once, at the first function found saving it: the tensors
    autograd saves without calling ``saved_tensors_hooks``. The chain capture sums them per
    stage (:func:`unhooked_saved`), the graph capture per node (by the function's call).

    NOTE [ Saved wrapped scalars ]: a Python number an operation takes (``0.5 * x``,
    ``x.pow(3.0)``'s sibling ``0.044715 * x``) becomes a *wrapped number*, a 0-dim double
    tensor (8 bytes) made by the argument parser, not by a dispatched operation, so no
    TorchDispatchMode sees it; and autograd saves a wrapped number without the saved-tensor
    hooks (torch's SavedVariable), so the hooks that count ``saved_bytes`` miss it too. It
    lives from the forward to the backward like any saved tensor: three per GELU of GPT-2
    (``NewGELUActivation``), 24 bytes per block, the bytes by which every-block checkpointing
    measured above the whole-step prediction (hf-gpt2: 679,660 B measured, 679,632 B
    predicted without them). On CUDA they stay on the CPU (not on ``device``: not counted)."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(fn for fn, _ in node.next_functions)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # a saved tensor already freed
                continue
            for t in value if isinstance(value, tuple | list) else (value,):
                if not isinstance(t, torch.Tensor) or (device is not None and t.device != device):
                    continue
                storage = t.untyped_storage()
                if storage._cdata not in known and storage._cdata not in found:
                    found.add(storage._cdata)
                    yield node, storage._cdata, storage.nbytes()


def _identity(t: Any) -> Any:
    return t


def _fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    """A tensor that requires grad becomes a new leaf on the same storage (so the stage's
    backward stops there); any other tensor passes as the same object, as in the model (an
    attention mask keeps its identity, and with it whatever is cached on it)."""
    if t.requires_grad and (t.is_floating_point() or t.is_complex()):
        return t.detach().requires_grad_(True)
    return t


def _entered(x: Any) -> Any:
    """``x`` with each leaf that requires grad passed through :class:`_Enter`."""
    return tree_map_only(
        torch.Tensor, lambda t: _Enter.apply(t) if t.requires_grad and t.is_leaf else t, x
    )


class _Enter(torch.autograd.Function):
    """Identity on the same storage whose output is not a leaf, so that the stage may write
    into it in place (autograd refuses that on a leaf that requires grad); the gradient passes
    through to the leaf unchanged (no memory)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _passed_through(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
) -> tuple[tuple[int, int, int], ...]:
    """:attr:`StageCost.passed_through`: the inputs that require grad and come out on their own
    storage, whole, as outputs (positions in ``inputs`` and ``outputs``, bytes)."""
    where = {
        (t.untyped_storage()._cdata, t.storage_offset(), t.shape): i
        for i, t in enumerate(inputs)
        if t.requires_grad
    }
    return tuple(
        (where[key], q, t.numel() * t.element_size())
        for q, t in enumerate(outputs)
        if (key := (t.untyped_storage()._cdata, t.storage_offset(), t.shape)) in where
    )


def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """Like :func:`_fresh_leaf`, on a new storage for a tensor that requires grad."""
    if t.requires_grad and (t.is_floating_point() or t.is_complex()):
        return t.detach().clone().requires_grad_(True)
    return t


def _work_counters(fake: bool, time_model: TimeModel | None) -> tuple[Any, Any]:
    """Two :class:`remat.measure.calibration.WorkCounter` (forward, backward) under fake tensors,
    else two no-op contexts."""
    if not fake:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return WorkCounter(time_model), WorkCounter(time_model)


def _allocator_windows(
    fake: bool, device: torch.device | None, tracker: StepTracker
) -> tuple[Any, Any]:
    """Two :class:`remat.measure.events.AllocatorWindow` (forward, backward) on real tensors;
    on fake tensors (which allocate nothing) two :class:`remat.measure.scratch.ScratchWindow`
    of the capture's probe over ``tracker``'s bytes (the scratch its ops measured when run for
    real). Both give ``excess(tracked)``: the scratch and small scratch above the tracked
    bytes."""
    if fake:
        probe = ScratchProbe.current()
        return ScratchWindow(probe, tracker.live_bytes), ScratchWindow(probe, tracker.live_bytes)
    if torch.autograd.profiler._is_profiler_enabled and (device is None or device.type == "cpu"):
        warnings.warn(
            "remat.capture runs inside a torch.profiler session: it cannot count the scratch "
            "memory of oneDNN kernels (convolutions, batch norms, LSTMs) and may under-predict "
            "such models; capture outside the profiler",
            stacklevel=4,
        )

    return AllocatorWindow(device), AllocatorWindow(device)


Layout = tuple[tuple[int, ...], tuple[int, ...]]
"""A tensor's shape and strides: how a gradient is laid out in memory."""

# NOTE [ Gradient layouts ]: a stage's backward is measured with gradients of ones for its
# outputs, and a kernel given a gradient in another layout than its saved tensors copies it
# first. ResNet-18 in channels_last, seeded with contiguous ones: its stem's backward measured
# 37.7 MB above its saved tensors where the whole step's is 16.8 MB, so the step's least
# budget was named 13 MB above what its plan measured. Each seed takes its output's layout
# (as `ones_like`), which is what the next stage's backward gives back in the usual case; where
# the next stage gives back another (an average pool's backward makes a contiguous gradient for
# a channels_last input), the capture, which records the layout each stage's backward gave its
# input, measures the stage before again seeded with that one.


def _layout(t: torch.Tensor) -> Layout:
    return tuple(t.shape), tuple(t.stride())


def _seeded(
    outputs: list[torch.Tensor], layouts: Sequence[Layout | None] | None
) -> tuple[Layout, ...]:
    """The layouts :func:`_seed` gives the gradients of ``outputs`` that require grad: those of
    ``layouts`` that fit the output's shape, else the output's own."""
    roots = [t for t in outputs if t.requires_grad]
    given = list(layouts or ()) + [None] * len(roots)
    return tuple(
        g if g is not None and g[0] == tuple(t.shape) else _layout(t)
        for t, g in zip(roots, given, strict=False)
    )


def _same_layouts(seeded: Sequence[Layout], arrived: Sequence[Layout | None]) -> bool:
    """Whether gradients laid out as ``arrived`` (None: none came) are laid out as
    ``seeded``: the same strides on every dimension longer than 1."""
    if len(seeded) != len(arrived):
        return True  # (not the same outputs: nothing to compare)
    for (shape, a), b in zip(seeded, arrived, strict=True):
        if b is None or b[0] != shape:
            continue
        if any(n > 1 and x != y for n, x, y in zip(shape, a, b[1], strict=True)):
            return False
    return True


def _dense(layout: Layout) -> bool:
    """Whether ``layout`` covers one block of memory, each element once."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(*layout, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _seed(
    outputs: list[torch.Tensor], layouts: Sequence[Layout | None] | None = None
) -> tuple[torch.Tensor | None, int]:
    """A scalar whose backward gives every output that requires grad a gradient of ones, laid
    out as :func:`_seeded` says (NOTE [ Gradient layouts ]), and the bytes of those gradients.

    The gradients are made inside the backward and owned by the autograd engine alone, so they
    are freed as soon as they are consumed, as ``δ[i]`` is in a whole step (a gradient passed
    to ``torch.autograd.backward`` stays referenced by the caller until it returns).
    """
    roots = [t for t in outputs if t.requires_grad]
    if not roots:
        return None, 0
    grad_bytes = sum(t.numel() * t.element_size() for t in roots)
    return _SeedGradients.apply(_seeded(outputs, layouts), *roots), grad_bytes


class _SeedGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, layouts: tuple[Layout, ...], *outputs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(lay, o.dtype, o.device) for lay, o in zip(layouts, outputs, strict=True)]
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, *_: Any) -> tuple[torch.Tensor | None, ...]:
        return (None, *(_ones(lay, dtype, dev) for lay, dtype, dev in ctx.specs))


def _ones(layout: Layout, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    shape, stride = layout
    if not _dense(layout):  # (an expanded or overlapping layout: a new tensor is dense)
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1)


class _InputGradLayouts:
    """Records the layout of the gradient each of ``inputs`` that requires grad (at
    ``positions``) gets in a backward run inside it (``layouts``, in order; None where none
    came)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.positions = tuple(i for i, t in enumerate(inputs) if t.requires_grad)
        self.inputs = [inputs[i] for i in self.positions]
        self.layouts: tuple[Layout | None, ...] = ()
        self._found: list[Layout | None] = [None] * len(self.inputs)
        self._handles: list[Any] = []

    def __enter__(self) -> _InputGradLayouts:
        def record(i: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                self._found[i] = _layout(grad)

            return hook

        self._handles = [t.register_hook(record(i)) for i, t in enumerate(self.inputs)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self.layouts = tuple(self._found)
