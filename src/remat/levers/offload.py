"""CPU offload of saved activations: device memory for host memory and PCIe traffic.

:func:`offload_saved_activations` is a ``saved_tensors_hooks`` context. On a CUDA machine, each
tensor an op saves for backward is copied to host memory (pinned by default, so the copy back
can overlap) and copied back to its device when backward needs it: the mechanism of
``torch.autograd.graph.save_on_cpu``. Unlike ``save_on_cpu``, parameters, buffers and their
views (``weight.t()`` saved by ``linear``) and tensors already on the CPU are kept by reference:
copying a weight to the host frees no device memory (the parameter stays) and only costs
bandwidth. ``exclude_parameters=False`` gives exactly ``torch.autograd.graph.save_on_cpu``.

**On a machine without CUDA it does nothing** (NOTE [ Offload without a device ]): saved
tensors already live in host memory, and ``save_on_cpu`` would only copy them (twice the host
memory) or fail on ``pin_memory``. The context then warns once per process
(``on_cpu="warn"``, the default), stays silent (``"ignore"``) or raises
:class:`OffloadUnavailableError` (``"error"``) — use the last in scripts that must not run
without offload.

Example:
    >>> import torch
    >>> from remat.levers import offload_saved_activations
    >>> model = torch.nn.Linear(8, 8)
    >>> with offload_saved_activations(on_cpu="ignore"):
    ...     loss = model(torch.randn(4, 8)).sum()
    >>> loss.backward()

Composes with a remat plan: under nested non-reentrant checkpoints the outer hooks see exactly
the tensors the plan keeps (each checkpointed segment's inputs and the stored segments' saved
tensors); recomputed tensors live only during backward and stay on the device.

Known limitations:
    * The device-to-host copies are synchronous (as in ``save_on_cpu``); the copies back are
      non-blocking when pinned. Expect the step to slow by the saved bytes over the PCIe
      bandwidth, unless compute hides it.
    * Pinned host memory is page-locked: offloading many GiB can starve the host.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from remat.core.errors import RematError
from remat.levers.precision import _is_plain, _is_state, _state_storages

__all__ = ["offload_saved_activations", "offload_available", "OffloadUnavailableError"]

_WARNED = False


class OffloadUnavailableError(RematError, RuntimeError):
    """Offload was requested with ``on_cpu="error"`` on a machine without CUDA."""


def offload_available() -> bool:
    """Whether offloading can move anything: a CUDA device is present."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def offload_saved_activations(
    pin_memory: bool = True,
    module: nn.Module | Sequence[nn.Module] | None = None,
    exclude_parameters: bool = True,
    on_cpu: str = "warn",
) -> Iterator[bool]:
    """Keep saved activations in host memory until backward needs them.

    Args:
        pin_memory: copy into page-locked host memory (faster, asynchronous copies back).
        module: the model, so that its buffers are never copied.
        exclude_parameters: keep parameters/buffers and their views on the device (default);
            ``False``: use ``torch.autograd.graph.save_on_cpu`` unchanged.
        on_cpu: without CUDA: ``"warn"`` (once per process), ``"ignore"`` or ``"error"``.

    Yields whether offloading is active (False on a machine without CUDA).
    """
    if on_cpu not in ("warn", "ignore", "error"):
        raise ValueError(f"on_cpu must be 'warn', 'ignore' or 'error', got {on_cpu!r}")
    if not offload_available():
        _no_device(on_cpu)
        yield False
        return
    if not exclude_parameters:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
            yield True
        return
    state_ptrs = _state_storages(module)

    def pack(t: torch.Tensor) -> Any:
        if t.device.type == "cpu" or not _is_plain(t) or _is_state(t, state_ptrs):
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory)
        host.copy_(t)
        return (t.device, host)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=pin_memory)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield True


def _no_device(on_cpu: str) -> None:
    global _WARNED
    message = (
        "offload_saved_activations: no CUDA device, so saved activations already live in host "
        "memory and offloading does nothing (the step runs unchanged)"
    )
    if on_cpu == "error":
        raise OffloadUnavailableError(message + "; on_cpu='error' was requested")
    if on_cpu == "warn" and not _WARNED:
        _WARNED = True
        warnings.warn(message, RuntimeWarning, stacklevel=4)
