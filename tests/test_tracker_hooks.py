"""The module hooks remat measures under hold no gradient (NOTE [ Module input hooks that hold
no gradient ] in remat.measure.profile). torch's ModTracker learns that a module's backward
ended from a hook on its inputs that keeps each input's gradient until the last one is ready:
in a module with two inputs the first gradient stayed alive through the rest of the backward,
so every stage remat captured, and every step it profiled, peaked above the step the user
runs. Hugging Face ViT's ViTOutput(hidden_states, input_tensor) held the residual's gradient:
its chain was predicted 16,640 B (one block output) above what it measured, at every plan."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from remat.bench import conformance as conf
from remat.measure.events import step_peak_bytes
from remat.measure.profile import _after_every_gradient, _HookReturningModTracker


class _SelfOutput(nn.Module):
    """As Hugging Face ViT's ViTSelfOutput: a second input it does not read (the layer's
    residual), whose gradient comes at the end of the layer's backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden)


class _Layer(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.pre, self.up = nn.Linear(width, width), nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.output, self.head = _SelfOutput(width), nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        context = self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.output(context, h) + h)


@pytest.mark.parametrize("backward_of", ["both", "one"])
def test_the_input_hook_runs_once_per_backward_after_the_last_gradient_as_torchs(
    backward_of: str,
) -> None:
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    x, y = a * 2, b * 3
    calls: list[tuple[str, int]] = []
    _after_every_gradient([x, y], lambda g: calls.append(("remat", len(g))))
    register_multi_grad_hook([x, y], lambda g: calls.append(("torch", len(g))))
    (x + y if backward_of == "both" else x).sum().backward()
    assert calls == [("remat", 2), ("torch", 2)]
    with pytest.raises(ValueError, match="mode"):
        _after_every_gradient([a], lambda g: None, mode="some")


def test_a_step_under_remats_module_tracker_peaks_as_the_plain_step() -> None:
    # (a hook whose closure held the module's input tensors kept the activations alive: this
    # step peaked 3 x 256 KiB higher)
    # activations above the parameters: the step peaks inside the backward
    torch.manual_seed(0)
    model = _Layer(16)
    x = torch.randn(4096, 16)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    def tracked() -> None:
        with _HookReturningModTracker():
            step()

    plain = step_peak_bytes(step, model, None, x)
    assert step_peak_bytes(tracked, model, None, x) == plain


@pytest.mark.slow
def test_hf_vit_chain_is_predicted_to_the_byte() -> None:
    built = conf.build("hf-vit")
    loop = conf.Loop(built, "loss_fn")
    opt = conf._optimizer(built.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned, summary = conf._auto(loop, 10**9, opt)
    assert conf._path(summary).startswith("chain")
    assert summary.predicted_peak_bytes == conf._measure(loop, planned, opt)
