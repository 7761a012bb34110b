"""Which tensors torch.compile saves for the backward of the bench's MLP chain (issue #19), at
each ``activation_memory_budget`` given: is torch.compile@0.5's partition the cheapest within
its memory, so that remat can only tie it there?

The bench's ``mlp-chain`` (16 x (Linear 256->256, GELU), batch 1024 x 256) is compiled
(inductor) under each budget; one forward runs under ``saved_tensors_hooks`` and each saved
tensor is named by the eager tensor whose values and shape it has: the input ``x``,
``pre_k`` (Linear k's output) or ``gelu_k`` (GELU k's output), or a parameter (its storage:
no bytes of its own). Writes ``docs/results/compile/knob/saved-mlp-chain.json``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        .venv/bin/python benchmarks/compile_saved.py 1 0.7 0.5
"""

import json
import sys
from pathlib import Path

import torch
import torch._functorch.config as functorch_config

from remat.bench.compile import _options, load_workload
from remat.bench.suites import machine_info

knobs = [float(a) for a in sys.argv[1:]] or [1.0, 0.7, 0.5]
work = load_workload("mlp-chain", **_options("mlp-chain", False))
model, x = work.model, work.batch

# the eager activations, by name
named: dict[str, torch.Tensor] = {"x": x}
h = x
with torch.no_grad():
    for k, (linear, act) in enumerate(zip(model[0::2], model[1::2], strict=True), start=1):
        named[f"pre_{k}"] = h = linear(h)
        named[f"gelu_{k}"] = h = act(h)
params = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}


def name_of(t: torch.Tensor) -> str:
    ptr = t.untyped_storage().data_ptr()
    if ptr in params:
        return f"param {params[ptr]}"
    for name, ref in named.items():
        # (compiled kernels sum in another order: 16 layers on, a few ulps of the largest value)
        if t.shape == ref.shape and (t.detach() - ref).abs().max() <= 1e-4 * ref.abs().max():
            return name
    return f"other {tuple(t.shape)}"


rows = []
for knob in knobs:
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=knob):
        compiled = torch.compile(model)
        work.loss_fn(compiled, x).backward()  # compiles
        model.zero_grad(set_to_none=True)
        saved: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor, saved: dict[int, torch.Tensor] = saved) -> torch.Tensor:
            saved.setdefault(t.untyped_storage().data_ptr(), t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(x)  # the graph's saved tensors only, not the loss's
        # named before the backward, which may write into a saved buffer it frees
        by_name = {name_of(t): t for t in saved.values()}
        out.square().mean().backward()
    names = sorted(by_name, key=lambda n: (n[0], len(n), n))
    activations = [n for n in names if not n.startswith("param")]
    own = [t for n, t in by_name.items() if n != "x" and not n.startswith("param")]
    rows.append(
        {
            "activation_memory_budget": knob,
            "saved": activations,
            "saved_bytes_beyond_input_and_parameters": sum(
                t.untyped_storage().nbytes() for t in own
            ),
            "recomputed": [n for n in named if n != "x" and n not in activations],
        }
    )
    print(json.dumps(rows[-1]), flush=True)

out = Path(__file__).parents[1] / "docs" / "results" / "compile" / "knob" / "saved-mlp-chain.json"
model_text = "mlp-chain: 16 x (Linear 256->256, GELU), batch 1024 x 256, inductor"
out.write_text(json.dumps({"machine": machine_info(), "model": model_text, "rows": rows}, indent=1))
print("wrote", out)
