"""Microbatching: gradient accumulation whose gradients equal the full batch's (the
"microbatching" lever of Sohoni et al. 2019).

A batch of N examples is split along dim 0 into k microbatches; each runs forward and backward
on its own, so at most one microbatch's activations are alive at a time: saved-activation
memory falls k-fold (exactly, for a model whose saved tensors all scale with the batch), at
the same FLOPs, run as k smaller passes (slower where small batches use the hardware poorly).

Gradients: microbatch i's loss is multiplied by a weight ``w_i`` before backward, and the
gradients accumulate in ``.grad``:

* ``reduction="mean"`` (a loss averaged over examples, the usual case): ``w_i = n_i / N``, so
  ``sum_i w_i * mean_i = mean`` and the accumulated gradient equals the full-batch gradient,
  for even and uneven splits alike (``k`` need not divide ``N``: the first ``N % k``
  microbatches get one example more, :func:`split_sizes`).
* ``reduction="sum"`` (a loss summed over examples): ``w_i = 1``.
* a loss averaged over something else (tokens with ``-100`` labels, pixels of a mask): pass
  ``count=`` (e.g. the number of valid tokens in a microbatch, :func:`valid_labels`); then
  ``w_i = c_i / sum_j c_j``, which is exact when the loss is the mean over those counted items.
  :func:`loss_weighting` finds which of these a model's loss needs, on the model itself.

What does **not** equal the full batch (NOTE [ Batch norm under microbatching ]): a model whose
forward mixes examples of a batch. Batch norm in training mode normalises each microbatch with
its own statistics, so outputs and gradients differ from the full batch's; and its running
statistics are updated k times instead of once. With momentum ``m``, microbatch means
``mu_1..mu_k`` (unbiased variances ``v_1..v_k``) and starting value ``r_0``::

    r_k = (1 - m)^k r_0 + sum_i m (1 - m)^(k - i) mu_i       # k microbatch steps (what you get)
    r_1 = (1 - m) r_0 + m mu                                   # one full-batch step

and ``num_batches_tracked`` grows by k (with ``momentum=None``, the cumulative average then
weighs each microbatch as one batch). Remat's executor keeps this at k updates (not 2k) under a
plan: recomputations do not update the statistics. Sohoni et al.'s own handling of batch norm
under microbatching could not be read (shared/papers/notes.md §2.2).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from remat.levers import accumulate_step
    >>> model = nn.Linear(8, 1)
    >>> x, y = torch.randn(12, 8), torch.randn(12, 1)
    >>> loss = accumulate_step(
    ...     model, (x, y), k=4, loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))

Composes with anything that is a module (a remat plan, autocast, saved-activation compression,
offload): pass ``forward_context=`` to wrap each microbatch's forward. A remat plan must be made
for the *microbatch*'s shape (``remat.apply(model, plan, example=microbatch)``): plans depend on
the batch shape, and remat's executor refuses other shapes. Under DDP/FSDP the first k-1
backward passes run inside ``model.no_sync()`` when the model has one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

__all__ = [
    "IGNORE_INDEX",
    "MicroBatcher",
    "loss_weighting",
    "valid_labels",
    "accumulate_step",
    "split_batch",
    "split_sizes",
    "batch_size",
    "compute_loss",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class MicroBatcher:
    """Run a training step as k microbatches with gradients equal to the full batch's.

    Args:
        k: number of microbatches (1 <= k <= batch size).
        loss_fn: ``loss_fn(model, microbatch) -> scalar loss``; ``None``: see
            :func:`compute_loss` (the model returns the loss, or an object with ``.loss``).
        reduction: ``"mean"`` (the loss averages over examples or over ``count``) or
            ``"sum"`` (the loss sums over examples).
        count: ``count(microbatch) -> number`` of items the loss averages over (tokens,
            pixels); ``None``: examples (dim 0). Only with ``reduction="mean"``.
        forward_context: zero-argument callable returning a context manager entered around
            each microbatch's forward and loss (autocast, saved-activation compression, offload,
            counting).
        scaler: a ``torch.amp.GradScaler`` for fp16 loss scaling (backward through
            ``scaler.scale``; the optimizer step through ``scaler.step``/``update``). Without
            an optimizer the accumulated gradients still carry the scale.
    """

    def __init__(
        self,
        k: int,
        loss_fn: LossFn | None = None,
        reduction: str = "mean",
        count: Callable[[Any], Any] | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (the number of microbatches) must be an int >= 1, got {k!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if count is not None and reduction != "mean":
            raise ValueError("count= weighs a mean-reduced loss; it makes no sense with 'sum'")
        self.k = k
        self.loss_fn = loss_fn
        self.reduction = reduction
        self.count = count
        self.forward_context = forward_context
        self.scaler = scaler

    def split(self, batch: Any) -> list[Any]:
        """The k microbatches of ``batch`` (views, no copies)."""
        return split_batch(batch, self.k)

    def weights(self, microbatches: Sequence[Any]) -> list[float]:
        """The loss weight of each microbatch (Python floats: a weight multiplies the loss in
        its own dtype; counts ``count`` gives as tensors are read once, before the step)."""
        if self.reduction == "sum":
            return [1.0] * len(microbatches)
        counts = [
            batch_size(mb) if self.count is None else float(self.count(mb)) for mb in microbatches
        ]
        total = sum(counts)
        if total == 0:
            raise ValueError("count() gave 0 items over the whole batch: the mean is undefined")
        return [c / total for c in counts]

    def __call__(
        self, model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Forward and backward every microbatch, accumulating into ``.grad``.

        Gradients add to whatever ``.grad`` already holds (as ``loss.backward()`` does). With
        an ``optimizer``, it then steps (through the scaler, if any) and zeroes the gradients
        (``set_to_none=True``). Returns the full-batch loss (``sum_i w_i loss_i``), detached.
        """
        microbatches = self.split(batch)
        # a microbatch that counts nothing (every label -100) adds nothing to the gradient,
        # and its loss is a mean over nothing, NaN: it is not run
        parts = [
            (mb, w) for mb, w in zip(microbatches, self.weights(microbatches), strict=True) if w
        ]
        no_sync = getattr(model, "no_sync", None)
        total: torch.Tensor | None = None
        last = len(parts) - 1
        for i, (mb, w) in enumerate(parts):
            ctx = self.forward_context() if self.forward_context else contextlib.nullcontext()
            with ctx:
                loss = compute_loss(model, mb, self.loss_fn)
            weighted = loss * w
            sync = contextlib.nullcontext() if (i == last or no_sync is None) else no_sync()
            with sync:
                if self.scaler is None:
                    weighted.backward()
                else:
                    self.scaler.scale(weighted).backward()
            part = weighted.detach().float()
            total = part if total is None else total + part
            del loss, weighted
        if optimizer is not None:
            if self.scaler is None:
                optimizer.step()
            else:
                self.scaler.step(optimizer)
                self.scaler.update()
            optimizer.zero_grad(set_to_none=True)
        assert total is not None
        return total


IGNORE_INDEX = -100
"""The label PyTorch's cross entropy and Hugging Face's losses leave out of their mean."""


def valid_labels(shift: bool = False) -> Callable[[Any], torch.Tensor]:
    """``count=`` for a loss averaged over the labels that are not :data:`IGNORE_INDEX` in a
    mapping batch's ``"labels"`` (Hugging Face token-level losses: padding, prompts masked out).
    ``shift=True`` leaves each row's first label out, as a causal language model's loss does
    (it predicts token t + 1 from the tokens up to t)."""

    def count(microbatch: Any) -> torch.Tensor:
        labels = microbatch["labels"]
        return (labels[..., 1:] if shift else labels).ne(IGNORE_INDEX).sum()

    return count


def loss_weighting(
    model: nn.Module, batch: Any, loss_fn: LossFn | None = None
) -> tuple[str, str, Callable[[Any], Any] | None]:
    """How a loss reduces over a batch, found on the model: ``(what, reduction, count)`` for
    :class:`MicroBatcher`, the first of a mean over examples (``"mean"``, ``count=None``), over
    the labels other than -100 (:func:`valid_labels`, and ``valid_labels(shift=True)``) and a
    sum (``"sum"``) whose microbatch weights give back the gradient of the whole.

    The probe is the batch's first two examples, each its own microbatch; where the batch holds
    token-level ``"labels"`` (an integer tensor of two or more dims), the first example keeps
    two labels (the rest :data:`IGNORE_INDEX`) and the second all of them, so that the two hold
    unequal counts (on a batch without padding every rule agrees, and disagrees on the next
    padded batch). Each gradient is reduced to its dot products with the parameters and with
    ones, per parameter,
    and a rule holds where the weighted sum of the two examples' matches the pair's within
    1e-3 (float32's rounding is about 1e-6; a wrong weight, 10 % or more on a padded pair). A
    loss on its value alone does not tell them apart: at initialisation every token's loss is
    about log(vocabulary). The model runs in eval mode (dropout off, batch norm on its running
    statistics: the examples independent); its gradients, each module's mode and the RNG are
    put back.

    Raises:
        ValueError: no rule gives the whole batch's gradient: microbatches would train another
            model than the batch; pass ``count=`` or one microbatch.
    """
    if batch_size(batch) < 2:
        return "examples", "mean", None
    pair = tree_map_only(torch.Tensor, lambda t: t.clone() if t.dim() > 0 else t,
                         _take(batch, [2, batch_size(batch) - 2], 0))  # fmt: skip
    rules: list[tuple[str, str, Callable[[Any], Any] | None]] = [
        ("examples", "mean", None),
        ("a sum over examples", "sum", None),
    ]
    labels = pair.get("labels") if isinstance(pair, Mapping) else None
    if (
        isinstance(labels, torch.Tensor)
        and labels.dim() >= 2
        and not labels.is_floating_point()
        and labels.shape[-1] >= 4
    ):
        # unequal counts whatever the batch held: the first example keeps two labels, the
        # second all (class 0 where it had none)
        labels[1].masked_fill_(labels[1] == IGNORE_INDEX, 0)
        labels[0] = IGNORE_INDEX
        labels[0, :2] = 0
        rules += [
            ("labels other than -100", "mean", valid_labels()),
            ("labels other than -100, each row's first left out (a causal LM's shift)", "mean",
             valid_labels(shift=True)),
        ]  # fmt: skip
    try:
        whole, parts = _probe(model, pair, loss_fn)
    except Exception:  # noqa: BLE001 - a loss that cannot take -100 labels has no such labels
        if len(rules) == 2:
            raise
        pair, rules = _take(batch, [2, batch_size(batch) - 2], 0), rules[:2]
        whole, parts = _probe(model, pair, loss_fn)
    halves = split_batch(pair, 2)
    scale = float(whole.norm()) or 1.0
    for what, reduction, count in rules:
        weights = MicroBatcher(2, loss_fn, reduction, count).weights(halves)
        mixed = sum(w * g for w, g in zip(weights, parts, strict=True))
        if float((mixed - whole).norm()) <= 1e-3 * scale:
            return what, reduction, count
    raise ValueError(
        "microbatching: the loss is neither a mean over examples or over labels other than "
        f"{IGNORE_INDEX}, nor a sum over examples: the summed microbatch gradients would not be "
        "the batch's. Pass count=(microbatch -> the number of items a mean loss averages "
        "over), or microbatches=[1]"
    )


def _probe(
    model: nn.Module, pair: Any, loss_fn: LossFn | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`_projected_gradient` of ``pair`` and of each of its two examples, in eval mode;
    the model's gradients, each module's mode (a frozen part kept in eval stays so) and the RNG
    put back."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]):
            whole, *parts = (
                _projected_gradient(model, b, loss_fn, params)
                for b in (pair, *split_batch(pair, 2))
            )
    finally:
        for m, training in modes:
            m.training = training
        for p, g in zip(params, held, strict=True):
            p.grad = g
    return whole, parts


def _projected_gradient(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, params: Sequence[nn.Parameter]
) -> torch.Tensor:
    """The gradient of ``batch``'s loss as its dot products with each parameter and with
    ones (no copy of a parameter's size is made), float64."""
    for p in params:
        p.grad = None
    compute_loss(model, batch, loss_fn).backward()
    dots = []
    with torch.no_grad():
        for p in params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            flat = g.reshape(-1)
            dots += [torch.dot(flat, p.detach().reshape(-1)).double(), flat.sum().double()]
    return torch.stack(dots).cpu()


def accumulate_step(
    model: nn.Module,
    batch: Any,
    k: int,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> torch.Tensor:
    """One training step as ``k`` microbatches: ``MicroBatcher(k, loss_fn, **options)(model,
    batch, optimizer)``. See :class:`MicroBatcher`."""
    return MicroBatcher(k, loss_fn, **options)(model, batch, optimizer)


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar loss of ``model`` on ``batch``.

    With ``loss_fn``: ``loss_fn(model, batch)``. Without: the model is called with the batch
    (a mapping as keyword arguments, a tuple/list as positional arguments, anything else as the
    single argument) and must return a scalar tensor, or an object with a ``loss`` attribute or
    key (Hugging Face models given ``labels``).
    """
    if loss_fn is not None:
        loss = loss_fn(model, batch)
    else:
        if isinstance(batch, Mapping):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        loss = _loss_from_output(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "the loss must be a scalar tensor; give loss_fn(model, batch) -> scalar when the "
            f"model returns something else (got {type(loss).__name__}"
            + (f" of shape {list(loss.shape)})" if isinstance(loss, torch.Tensor) else ")")
        )
    return loss


def split_sizes(n: int, k: int) -> list[int]:
    """Sizes of k microbatches of n examples: as equal as possible, larger ones first."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(
            f"cannot split a batch of {n} examples into {k} microbatches: every microbatch "
            "needs at least one example (use k <= batch size)"
        )
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def batch_size(batch: Any) -> int:
    """The size of dim 0 shared by every tensor of ``batch`` (0-d tensors aside)."""
    sizes: dict[int, str] = {}
    _collect_sizes(batch, "batch", sizes)
    if not sizes:
        raise ValueError(
            "the batch holds no tensor with a batch dimension: nothing to split along dim 0"
        )
    if len(sizes) > 1:
        found = ", ".join(f"{path}: {n}" for n, path in sorted(sizes.items()))
        raise ValueError(
            f"the batch's tensors disagree on dim 0 ({found}); microbatching splits every "
            "tensor along dim 0, so they must share the batch size"
        )
    return next(iter(sizes))


def split_batch(batch: Any, k: int) -> list[Any]:
    """Split ``batch`` along dim 0 into ``k`` microbatches of :func:`split_sizes`.

    Tensors (at any depth of tuples, lists, named tuples and mappings, including Hugging Face
    ``BatchEncoding``) are split into views; 0-d tensors and non-tensor leaves are repeated in
    every microbatch; containers keep their type.
    """
    sizes = split_sizes(batch_size(batch), k)
    return [_take(batch, sizes, i) for i in range(k)]


# ---------------------------------------------------------------------- implementation
def _loss_from_output(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"]
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    raise TypeError(
        f"the model returned {type(out).__name__}, not a loss: give loss_fn(model, batch) -> "
        "scalar, or make the model return its loss (Hugging Face models: pass labels)"
    )


def _collect_sizes(obj: Any, path: str, sizes: dict[int, str]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            sizes.setdefault(obj.shape[0], path)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect_sizes(value, f"{path}[{key!r}]", sizes)
    elif isinstance(obj, (tuple, list)):
        for j, value in enumerate(obj):
            _collect_sizes(value, f"{path}[{j}]", sizes)


def _take(obj: Any, sizes: list[int], i: int) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return obj
        return obj.split(sizes)[i]
    if isinstance(obj, Mapping):
        items = {key: _take(value, sizes, i) for key, value in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(_take(value, sizes, i) for value in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_take(value, sizes, i) for value in obj)
    return obj
