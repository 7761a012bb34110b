"""``remat bench sohoni``: the four memory levers of Sohoni et al. 2019, alone and combined.

Sohoni, Aberger, Leszczynski, Zhang and Ré, "Low-Memory Neural Network Training: A Technical
Report" (arXiv:1904.10631) cut the training memory of WideResNet-28-2 on CIFAR-10 "by up to
60.7x with a 0.4% loss in accuracy" and of a DynamicConv Transformer on IWSLT'14 De-En "by up
to 8.7x with a BLEU score drop of 0.15", combining sparsity, low precision, microbatching and
gradient checkpointing. Only the abstract could be read: the report's tables, batch sizes,
precisions, microbatch sizes and sparsity levels were NOT FOUND (shared/papers/notes.md §2.2),
so this suite measures remat's own levers on the same model shapes and puts the abstract's two
headline ratios beside the combination rows; nothing here claims to reproduce a table.

What one row is: one training step (forward, loss, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``, after a warm-up step so that the optimizer state exists) of
the model under one combination of levers, measured **exactly** by :func:`remat.profile` on
real tensors (the CPU allocator does not round), with the live bytes at the peak split into
``parameters``, ``buffers``, ``gradients``, ``optimizer``, ``activations`` and
``temporaries`` (they add up to ``peak_bytes``), plus ``masks`` (sparsity masks, which exist
before the step and are added to the peak). Rows under autocast are measured on fake tensors
(``FakeTensorMode``: the same bytes, nothing computed), because this CPU has no bf16/fp16
matrix instructions: forward and backward only, plus the optimizer's exact state (NOTE [ Fake
rows without the optimizer ]). ``memory_ratio`` = peak / the unplanned fp32 step's peak.
Microbatched steps call the model k times in one step, which ``MemTracker`` refuses for a
root module; each microbatch calls it through a fresh wrapper module.

The levers (``remat.levers``, ``remat.plan``, ``remat.apply``):

* checkpointing: the chain captured on fake tensors at the (micro)batch shape; ``least-memory``
  is ``optimal-time`` at :func:`~remat.planners.optimal_time.min_feasible_peak` (the fastest
  plan with the least activation peak), ``one-extra-forward`` the least-memory plan whose
  simulated time is at most the unplanned time plus one forward;
* low precision: ``torch.autocast`` bf16 / fp16 (fp32 master weights), and saved activations
  stored as bf16 or int8 (:func:`~remat.levers.compress_saved_activations`, fp32 compute);
* microbatching: k forward/backward passes of N/k examples, loss weighted n_i/N (the gradients
  of :class:`~remat.levers.MicroBatcher`);
* sparsity: magnitude pruning to density 0.1 with the masks attached (dense PyTorch: the masks
  *add* memory), and the same weights stored in CSR with int32 indices, **counted**: the bytes of
  real torch sparse tensors (:func:`~remat.levers.sparse_storage_bytes`) replace the dense
  weights and their optimizer state (values only, sharing the weight's indices); gradients and
  activations stay dense (PyTorch's convolutions and matmuls produce dense gradients).

``time_ratio`` is **predicted** from FLOP counts (:func:`remat.simulate` on the fake-captured
chains: recomputation and microbatches; equal FLOPs give 1.0; the conversions of compressed
saved activations are not counted) and absent for the autocast rows, whose speed depends on
hardware this CPU lacks.

Example::

    remat bench sohoni --out docs/results/sohoni          # WRN-28-2 and a small Transformer
    remat bench sohoni --quick --out /tmp/sohoni           # WRN-28-2 at batch 32, ~1 minute

Known limitations:
    * Compressed saved activations cannot be measured on fake tensors (the compression hook
      leaves tensor subclasses alone, and a ``FakeTensor`` is one), so those rows run for real.
    * fp16 autocast is measured without a ``GradScaler`` (its step needs real values); the
      scaler adds a few scalar tensors.
    * The CSR rows are counted, not trained: PyTorch has no sparse convolution.
    * Batch norm under microbatching normalises each microbatch by its own statistics.
    * Hugging Face ``Conv1D`` weights are pruned through :func:`prunable`
      (:func:`remat.levers.prunable_parameters` misses them); GPT-2's tied embedding is pruned
      with its ``lm_head``.
    * No step time is measured; the CPU's timings of 16-bit compute would be meaningless.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat import zoo
from remat.api import plan as make_plan
from remat.capture.chain import capture
from remat.core.chain_simulate import simulate
from remat.core.units import format_bytes
from remat.execute.chain import apply
from remat.levers import (
    MicroBatcher,
    Precision,
    batch_size,
    magnitude_prune,
    precision_context,
    prunable_parameters,
    sparse_storage_bytes,
    split_batch,
)
from remat.measure.events import unique_storage_bytes
from remat.measure.profile import profile
from remat.planners import BudgetTooSmallError
from remat.planners.optimal_time import min_feasible_peak

__all__ = [
    "DEFAULT_MODELS",
    "NOTES",
    "PAPER_RATIOS",
    "CATEGORIES",
    "MODEL_SETTINGS",
    "ModelSetting",
    "Lever",
    "Workbench",
    "levers_for",
    "rows_for",
    "workbench",
    "prunable",
    "suite",
    "write_report",
]

#: WRN-28-2 at CIFAR-10 shape, and a small decoder-only Transformer at DynamicConv's IWSLT'14
#: sizes (6 layers, d=512, FFN 1024, 4 heads; see :data:`MODEL_SETTINGS`).
DEFAULT_MODELS = ["wrn-28-2", "gpt2-iwslt"]

#: The abstract's headline reductions (peak / baseline = 1 / factor) [S-abs].
PAPER_RATIOS: dict[str, tuple[float, str]] = {
    "wrn-28-2": (1 / 60.7, "60.7x (WRN-28-2, CIFAR-10, -0.4% accuracy)"),
    "gpt2-iwslt": (1 / 8.7, "8.7x (DynamicConv, IWSLT'14 De-En, -0.15 BLEU)"),
}

CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer",
    "activations",
    "temporaries",
    "masks",
)


@dataclass(frozen=True)
class ModelSetting:
    """How one model of the suite is built and trained."""

    zoo_name: str
    """The :mod:`remat.zoo` name."""
    batch_size: int
    """Examples per step (full run)."""
    quick_batch_size: int
    """Examples per step with ``--quick``."""
    optimizer: str
    """``"sgd-momentum"`` (SGD, momentum 0.9) or ``"adam"``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Zoo options."""
    description: str = ""
    """What it stands for."""


MODEL_SETTINGS: dict[str, ModelSetting] = {
    "wrn-28-2": ModelSetting(
        "wrn-28-2",
        128,
        32,
        "sgd-momentum",
        {},
        "WideResNet-28-2 (1,467,610 parameters), 3x32x32, batch 128 in the full run, 32 with "
        "--quick (Sohoni's batch size was NOT FOUND; 128 is the common CIFAR-10 WRN setting), "
        "SGD momentum 0.9 (Sohoni's optimizer NOT FOUND)",
    ),
    "gpt2-iwslt": ModelSetting(
        "gpt2",
        32,
        8,
        "adam",
        {
            "n_layer": 6,
            "n_embd": 512,
            "n_head": 4,
            "n_inner": 1024,
            "vocab_size": 8000,
            "seq_len": 128,
        },
        "GPT-2 block stack at DynamicConv/IWSLT'14 sizes (6 layers, d=512, FFN 1024, 4 heads, "
        "vocab 8000), 32 x 128 = 4096 tokens per step in the full run (fairseq's max-tokens "
        "4000), Adam (fairseq's IWSLT recipe); a "
        "stand-in: decoder-only self-attention, not DynamicConv's encoder-decoder",
    ),
}

NOTES = (
    "Exact peak bytes of one training step (remat.profile, real tensors; autocast rows on fake "
    "tensors, same bytes), split by category at the peak; memory_ratio = peak / the unplanned "
    "fp32 step's. time_ratio is predicted from FLOPs (simulate), not measured. Sohoni et al.'s "
    "tables were NOT FOUND: only the abstract's headline ratios are shown."
)


@dataclass(frozen=True)
class Lever:
    """One combination of levers (a row)."""

    method: str
    """The row's name."""
    plan: str | None = None
    """``None``, ``"least-memory"`` or ``"one-extra-forward"``."""
    compute: str | None = None
    """Autocast dtype: ``None``, ``"bf16"`` or ``"fp16"``."""
    saved: str | None = None
    """Saved-activation storage: ``None``, ``"bf16"`` or ``"int8"``."""
    microbatches: int = 1
    """k."""
    masks: bool = False
    """Prune to :attr:`density` with dense masks attached (measured)."""
    sparse_csr: bool = False
    """Count the pruned weights and their optimizer state in CSR (int32 indices)."""
    density: float = 0.1
    """Kept fraction of the prunable weights when ``masks`` or ``sparse_csr``."""

    @property
    def levers(self) -> int:
        """How many levers the row combines."""
        return sum(
            [
                self.plan is not None,
                self.compute is not None or self.saved is not None,
                self.microbatches > 1,
                self.masks or self.sparse_csr,
            ]
        )


def levers_for(quick: bool) -> list[Lever]:
    """The rows of the suite, in order (the baseline first)."""
    ks = (2, 4) if quick else (2, 4, 8)
    rows = [
        Lever("fp32 (unplanned)"),
        Lever("checkpoint: least-memory", plan="least-memory"),
        Lever("checkpoint: one-extra-forward", plan="one-extra-forward"),
        Lever("autocast bf16", compute="bf16"),
        Lever("autocast fp16 (no scaler)", compute="fp16"),
        Lever("saved activations bf16", saved="bf16"),
        Lever("saved activations int8", saved="int8"),
        *[Lever(f"microbatch k={k}", microbatches=k) for k in ks],
        Lever("sparsity 0.1, dense masks", masks=True),
        Lever("sparsity 0.1, CSR (counted)", sparse_csr=True),
    ]
    big = 4 if quick else 8
    rows += [
        Lever(
            f"least-memory + saved bf16 + k={big}",
            plan="least-memory",
            saved="bf16",
            microbatches=big,
        ),
        Lever(
            f"all: least-memory + saved bf16 + k={big} + CSR 0.1",
            plan="least-memory",
            saved="bf16",
            microbatches=big,
            sparse_csr=True,
        ),
        Lever(
            f"all: least-memory + saved int8 + k={big} + CSR 0.1",
            plan="least-memory",
            saved="int8",
            microbatches=big,
            sparse_csr=True,
        ),
    ]
    if not quick:
        rows.append(
            Lever(
                "all: least-memory + saved int8 + k=32 + CSR 0.1",
                plan="least-memory",
                saved="int8",
                microbatches=32,
                sparse_csr=True,
            )
        )
    return rows


# ---------------------------------------------------------------------- measurement
class Workbench:
    """One model, its optimizer (kept across rows so that its state exists), its batch and the
    chains captured per microbatch count; :meth:`measure` gives a row for a :class:`Lever`."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        batch: Any,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: str = "sgd-momentum",
    ) -> None:
        self.name = name
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn
        self.optimizer_name = optimizer
        if optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        elif optimizer == "sgd-momentum":
            self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        else:
            raise ValueError(f"optimizer must be 'sgd-momentum' or 'adam', got {optimizer!r}")

        self.n = batch_size(batch)
        self._captured: dict[int, Any] = {}
        self._masks: Any = None
        self.base_time: float | None = None
        # highest live bytes during optimizer.step() of the first real (fp32) step measured
        self._phases: dict[str, int] = {}

    # -------------------------------------------------------------- chains and plans
    def captured(self, k: int) -> Any:
        """The model captured on fake tensors at the microbatch shape of ``k`` microbatches."""

        if k not in self._captured:
            example = self.batch if k == 1 else split_batch(self.batch, k)[0]
            self._captured[k] = capture(self.model, example, self.loss_fn, fake=True)
        return self._captured[k]

    def plan(self, kind: str | None, k: int) -> Any:
        """The remat plan of ``kind`` for the microbatch shape (``None``: store everything)."""

        chain = self.captured(k).chain
        if kind is None:
            return make_plan(chain, "none")
        if kind == "least-memory":
            return make_plan(chain, "optimal-time", min_feasible_peak(chain))
        if kind == "one-extra-forward":
            return _within_one_forward(chain)
        raise ValueError(f"plan kind must be 'least-memory' or 'one-extra-forward', got {kind!r}")

    def predicted_time_ratio(self, lever: Lever) -> float:
        """Simulated (FLOP) time of the row's plan times k over the unplanned step's."""

        if self.base_time is None:
            self.base_time = simulate(self.captured(1).chain, self.plan(None, 1)).total_time
        k = lever.microbatches
        sim = simulate(self.captured(k).chain, self.plan(lever.plan, k))
        return sim.total_time * k / self.base_time

    # -------------------------------------------------------------- sparsity
    def prune(self, density: float) -> Any:
        """Prune the weights of :func:`prunable` to ``density`` in place, each weight to that
        density (once); returns the masks."""

        if self._masks is None:
            self._masks = magnitude_prune(prunable(self.model), density)
        return self._masks

    def csr_savings(self, density: float) -> dict[str, int]:
        """Bytes saved by storing the pruned weights in CSR (int32 indices, from real torch
        sparse tensors) and their optimizer state as values sharing those indices."""

        masks = self.prune(density)
        params = optimizer = 0
        for name, p in masks.parameters.items():
            # the kept entries as a real torch CSR tensor (the weight itself may have moved
            # off its mask during a step without masks attached)
            counted = sparse_storage_bytes(p.detach() * masks.masks[name], "csr", torch.int32)
            params += counted.dense_bytes - counted.sparse_bytes
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    optimizer += value.nbytes - counted.nnz * value.element_size()
        return {"parameters": params, "optimizer": optimizer}

    # -------------------------------------------------------------- one row
    def measure(self, lever: Lever) -> dict[str, Any]:
        """Exact memory of one training step under ``lever`` (module docstring)."""

        row: dict[str, Any] = {"model": self.name, "method": lever.method, "levers": lever.levers}
        k = lever.microbatches
        module: nn.Module = self.model
        if lever.plan is not None:
            plan = self.plan(lever.plan, k)
            module = apply(self.model, plan, stages=self.captured(k).stages)
            row["plan"] = plan.describe()
        masks = None
        if lever.masks or lever.sparse_csr:
            masks = self.prune(lever.density)
        if lever.masks:
            masks.attach(self.optimizer, mask_gradients=True)
        csr = self.csr_savings(lever.density) if lever.sparse_csr else {}
        stats: list[Any] = []
        loss_fn = self._step_loss(module, lever, stats)
        fake = lever.compute is not None
        try:
            with warnings.catch_warnings():
                # the per-microbatch callers (_Call) are gone when MemTracker's backward hooks
                # fire; it says so and skips them (their bytes are still counted)
                warnings.filterwarnings("ignore", message="Module is None")
                if fake:
                    peak, categories, note = self._fake_step(module, loss_fn)
                    row["measured_by_note"] = note
                else:
                    report = profile(
                        module, self.batch, loss_fn, self.optimizer, timeline=not self._phases
                    )
                    peak, categories = report.peak_bytes, dict(report.categories)
                    row["peak_label"] = report.peak_label
                    if not self._phases:
                        self._phases = _optimizer_phase(report)
        finally:
            if lever.masks:
                masks.detach()
        categories["masks"] = masks.mask_bytes() if lever.masks else 0
        peak += categories["masks"]
        if lever.sparse_csr:
            saved = csr
            for key, nbytes in saved.items():
                categories[key] -= nbytes
            peak -= sum(saved.values())
            row["csr_saved_bytes"] = sum(saved.values())
        row["peak_bytes"] = peak
        row.update({f"{c}_bytes": categories[c] for c in CATEGORIES})
        row["measured_by"] = (
            "remat.profile, fake tensors" if fake else "remat.profile, real tensors"
        ) + (" + CSR counted" if lever.sparse_csr else "")
        if stats and stats[0] is not None:
            row["saved_original_bytes"] = sum(s.original_bytes for s in stats)
            row["saved_stored_bytes"] = sum(s.stored_bytes for s in stats)
            row["saved_peak_bytes"] = max(s.peak_bytes for s in stats)
        if lever.compute is None:
            row["time_ratio"] = self.predicted_time_ratio(lever)
            row["time_ratio_kind"] = "predicted (FLOPs, simulate)" + (
                "; compression's conversions not counted" if lever.saved else ""
            )
        return row

    def _fake_step(
        self, module: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    ) -> tuple[int, dict[str, int], str]:
        """NOTE [ Fake rows without the optimizer ]: :func:`remat.profile` on fake tensors
        cannot run ``Adam.step()`` once its state exists (its ``step`` counter becomes a fake
        tensor and Adam reads it with ``.item()``). So fake rows run forward and backward only
        and add what the optimizer contributes, both exact: its state (constant through the
        step, unique storages) to every moment, and the highest live bytes of the fp32 step's
        ``optimizer.step()`` phase (the same under autocast, whose master weights, gradients
        and state are fp32) as a lower bound of the peak; when that phase is the higher, the
        difference is booked as temporaries."""

        if not self._phases:
            raise RuntimeError("measure a real (fp32) row first: fake rows reuse its phases")
        state = [
            v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
        ]
        state_bytes = unique_storage_bytes(state)
        report = profile(module, self.batch, loss_fn, None, fake=True, timeline=False)
        categories = dict(report.categories)
        categories["optimizer"] += state_bytes
        peak = report.peak_bytes + state_bytes
        note = "fake tensors; forward+backward measured, optimizer state added"
        if self._phases["optimizer"] > peak:
            categories["temporaries"] += self._phases["optimizer"] - peak
            peak = self._phases["optimizer"]
            note += "; the peak is the fp32 step's optimizer phase"
        return peak, categories, note

    def _step_loss(
        self, module: nn.Module, lever: Lever, stats: list[Any]
    ) -> Callable[[nn.Module, Any], torch.Tensor]:
        """A loss function for :func:`remat.profile` that runs the first k - 1 microbatches'
        forward and backward itself (loss weighted n_i / N) and returns the last one's
        weighted loss, each forward under the row's precision."""

        precision = Precision(compute=lever.compute, saved=lever.saved)
        base = self.model
        loss_fn = self.loss_fn

        @contextlib.contextmanager
        def context(batch: Any) -> Iterator[None]:
            if precision.compute is None and precision.saved is None:
                yield
                return
            exclude = [t for t in _leaves(batch)]
            with precision_context(precision, "cpu", base, exclude=exclude) as st:
                yield
            stats.append(st)

        def step_loss(m: nn.Module, batch: Any) -> torch.Tensor:
            stats.clear()
            batcher = MicroBatcher(lever.microbatches, loss_fn)
            parts = batcher.split(batch)
            weights = batcher.weights(parts)  # (examples: the workloads' losses are such means)
            for part, w in zip(parts[:-1], weights, strict=False):
                with context(batch):
                    loss = loss_fn(_Call(m), part) * w
                loss.backward()
            with context(batch):
                loss = loss_fn(_Call(m), parts[-1]) * weights[-1]
            return loss

        return step_loss


def prunable(model: nn.Module) -> dict[str, nn.Parameter]:
    """:func:`remat.levers.prunable_parameters` (Linear, Bilinear, Conv weights) plus the
    weights of Hugging Face's ``Conv1D`` (GPT-2's attention and MLP projections, which are
    matmuls but not ``nn.Linear``, so ``prunable_parameters`` misses them)."""

    found = dict(prunable_parameters(model))
    for module_name, module in model.named_modules():
        if type(module).__name__ == "Conv1D" and isinstance(
            getattr(module, "weight", None), nn.Parameter
        ):
            found[f"{module_name}.weight"] = module.weight
    return found


def _optimizer_phase(report: Any) -> dict[str, int]:
    """``{"optimizer": highest live bytes during optimizer.step()}`` from a report's timeline."""
    live = [b for label, b in report.timeline if label.startswith("optimizer")]
    return {"optimizer": max(live, default=0)}


class _Call(nn.Module):
    """Calls the model. A fresh one per microbatch: MemTracker (under :func:`remat.profile`)
    refuses a root module called twice in one step, but not a submodule called twice."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def _leaves(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _within_one_forward(chain: Any) -> Any:
    """The least-memory ``optimal-time`` plan whose simulated time is at most the unplanned
    time plus one forward (bisection on the activation budget)."""

    store_all = make_plan(chain, "none")
    limit = (store_all.predicted_time or 0.0) + chain.total_fwd_time()
    best = make_plan(chain, "optimal-time", store_all.predicted_peak_bytes)
    lo, hi = min_feasible_peak(chain) - 1, best.predicted_peak_bytes or 0
    while hi - lo > max(1, hi // 2000):
        mid = (lo + hi) // 2
        try:
            candidate = make_plan(chain, "optimal-time", mid)
        except BudgetTooSmallError:
            lo = mid
            continue
        if (candidate.predicted_time or 0.0) <= limit * (1 + 1e-9):
            best, hi = candidate, candidate.predicted_peak_bytes or mid
        else:
            lo = mid
    return best


def workbench(name: str, quick: bool, batch_size: int | None = None) -> Workbench:
    """The :class:`Workbench` of a suite model (or any zoo name, with SGD momentum)."""

    setting = MODEL_SETTINGS.get(name) or ModelSetting(name, 32, 8, "sgd-momentum")
    size = batch_size or (setting.quick_batch_size if quick else setting.batch_size)
    torch.manual_seed(0)
    entry = zoo.get(setting.zoo_name, batch_size=size, **setting.options)
    return Workbench(name, entry.model, entry.batch, entry.loss_fn, setting.optimizer)


def rows_for(bench: Workbench, levers: list[Lever], progress: Callable[[str], None]) -> list[dict]:
    """Measure every lever on ``bench``; adds ``memory_ratio``, ``reduction`` and the paper's
    ratio where one exists. Rows that need pruning run after the others (pruning changes the
    weights, never their dense bytes)."""
    ordered = [lv for lv in levers if not (lv.masks or lv.sparse_csr)]
    ordered += [lv for lv in levers if lv.masks or lv.sparse_csr]
    rows: dict[str, dict[str, Any]] = {}
    for lever in ordered:
        progress(f"{bench.name}: {lever.method}")
        start = time.perf_counter()
        try:
            row = bench.measure(lever)
        except Exception as err:  # a lever failing is a result: report it verbatim
            row = {
                "model": bench.name,
                "method": lever.method,
                "error": f"{type(err).__name__}: {err}"[:2000],
            }
        row["measure_seconds"] = time.perf_counter() - start
        rows[lever.method] = row
    out = [rows[lv.method] for lv in levers]
    base = out[0].get("peak_bytes")
    paper = PAPER_RATIOS.get(bench.name)
    for row, lever in zip(out, levers, strict=True):
        row["batch_size"] = bench.n
        row["optimizer"] = bench.optimizer_name
        if base and "peak_bytes" in row:
            row["memory_ratio"] = row["peak_bytes"] / base
            row["reduction"] = base / row["peak_bytes"]
        if paper is not None and lever.method.startswith("all:"):
            row["paper_memory_ratio"] = paper[0]
            row["paper_claim"] = paper[1]
    return out


def suite(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """Every lever alone and combined on each model (module docstring)."""
    rows: list[dict[str, Any]] = []
    for name in models:
        bench = workbench(name, quick)
        setting = MODEL_SETTINGS.get(name)
        for row in rows_for(bench, levers_for(quick), progress):
            if setting is not None:
                row["setting"] = setting.description
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- report
def write_report(out: Path, result: dict[str, Any]) -> None:
    """``out/sohoni.md`` (the table beside the paper's ratios) and ``out/sohoni-MODEL.png``."""

    rows = result["rows"]
    machine = result["machine"]
    lines = [
        f"# remat bench sohoni{' (quick)' if result.get('quick') else ''}",
        "",
        f"Measured {machine['date']} on {machine['device']} ({machine.get('cpus')} CPUs, "
        f"{machine['threads']} torch threads), torch {machine['torch']}, Python "
        f"{machine['python']}; the run took {result['seconds']:.0f} s.",
        "",
        NOTES,
        "",
        "Paper (Sohoni et al. 2019, arXiv:1904.10631, abstract only; the body and its tables "
        "were NOT FOUND): WRN-28-2/CIFAR-10 memory cut up to 60.7x (ratio 0.0165) at -0.4% "
        "accuracy; DynamicConv/IWSLT'14 up to 8.7x (ratio 0.115) at -0.15 BLEU. Which levers, "
        "batch size, precisions and what counts as memory in those figures is unknown.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        first = mine[0]
        lines += [f"## {model}", ""]
        if first.get("setting"):
            lines += [first["setting"] + ".", ""]
        lines += [
            "| method | peak | memory ratio | reduction | time ratio (pred.) | params | grads | "
            "optimizer | activations | temporaries | masks | paper |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            if "peak_bytes" not in r:
                lines.append(f"| {r['method']} | error: {r.get('error', '')[:120]} |" + " |" * 10)
                continue
            time_ratio = f"{r['time_ratio']:.2f}" if r.get("time_ratio") is not None else "-"
            paper = (
                f"{r['paper_memory_ratio']:.4f} ({r['paper_claim']})"
                if "paper_memory_ratio" in r
                else ""
            )
            cells = [
                r["method"],
                format_bytes(r["peak_bytes"]),
                f"{r['memory_ratio']:.4f}",
                f"{r['reduction']:.2f}x",
                time_ratio,
                *(
                    format_bytes(r[f"{c}_bytes"])
                    for c in ("parameters", "gradients", "optimizer", "activations", "temporaries")
                ),
                format_bytes(r["masks_bytes"]) if r["masks_bytes"] else "-",
                paper,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"![memory by lever]({_plot_name(model)})")
        lines.append("")
        _plot(out / _plot_name(model), model, mine)
    lines += [
        "Notes: buffers (batch-norm statistics) are in the JSON (`buffers_bytes`), not in the "
        "table. The CSR rows subtract from the measured step the bytes that real torch CSR "
        "tensors (int32 indices) save on the pruned weights and on their optimizer state "
        "(values sharing the weight's indices); gradients and activations stay dense. "
        "`peak_label` in the JSON says where each peak happened.",
        "",
    ]
    (out / "sohoni.md").write_text("\n".join(lines))


def _plot_name(model: str) -> str:
    return f"sohoni-{model}.png"


def _plot(path: Path, model: str, rows: list[dict[str, Any]]) -> None:
    """Stacked horizontal bars of the peak by category, one bar per row; the paper's headline
    ratio as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "peak_bytes" in r]
    if not rows:
        return
    base = rows[0]["peak_bytes"]
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(rows) + 1.6))
    labels = [r["method"] for r in rows][::-1]
    left = [0.0] * len(rows)
    colors = ["#4c72b0", "#8c8c8c", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for c, color in zip(CATEGORIES, colors, strict=True):
        widths = [max(0, r[f"{c}_bytes"]) / base for r in rows][::-1]
        ax.barh(labels, widths, left=left, color=color, label=c)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    paper = PAPER_RATIOS.get(model)
    if paper is not None:
        ax.axvline(paper[0], color="black", linestyle="--", linewidth=1)
        ax.text(paper[0], len(rows) - 0.4, f" paper: {paper[1]}", fontsize=7, va="top")
    ax.set_xlabel("peak bytes / unplanned fp32 peak")
    ax.set_title(f"{model}: one training step's peak by category")
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
