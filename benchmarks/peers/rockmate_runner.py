"""Run Rockmate 2.0.0 (github topal-team/rockmate) as a peer, on the CPU, in its own process.

    python benchmarks/peers/rockmate_runner.py --model chain --budget-fraction 0.25 \
        --out result.json [--solver rotor|hilp] [--batch N] [--steps 5]

Rockmate keeps one live module per process (``RK_Storage`` is a singleton), so the suite runs
this program once per (model, budget, solver) and reads the JSON it writes. Install the peer
(see benchmarks/peers/README.md, Installing); nothing of Rockmate's code is in this repository.

Rockmate is CUDA-only as shipped. This runner applies a thin patch at run time so that it runs
on the CPU; every patch applied is listed in the result's ``patched`` field (and in
benchmarks/peers/README.md), and figures measured with it must say so.

The result (always written, also on failure; ``error`` then holds the exception verbatim and
the stage it happened in)::

    {model, method, budget_fraction, budget_bytes, peak_bytes, eager_peak_bytes,
     persistent_bytes, activation_bytes, retained_bytes, memory_ratio, step_times,
     eager_step_times, interleaved, time_ratio, plan_seconds, max_grad_rel_diff, patched,
     error, ...}

``peak_bytes`` is :func:`remat.measure.events.step_peak_bytes` (allocator events plus the persistent
state at the step's start); the tensors Rockmate keeps in its own storage between steps are
counted in that persistent state (``retained_bytes``), so nothing it holds is missed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

SOLVERS = {"rotor": "rotor", "hilp": "rockmate"}
"""--solver -> Rockmate's ``generate_config`` type (``rockmate`` = rotor on top, HILP below)."""

INLINE_MODELS = ("chain", "gpt2-small")
HF_DECODERS = ("gpt2", "llama-tiny")  # zoo models wrapped to take token ids, return logits


# --------------------------------------------------------------------------------------------
# Pure helpers (tested without rockmate installed)
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="remat zoo model, or chain / gpt2 (inline)")
    p.add_argument("--budget-fraction", type=float, required=True, help="x eager activations")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--solver", choices=sorted(SOLVERS), default="rotor")
    p.add_argument("--batch", type=int, default=None, help="batch size (model default)")
    p.add_argument(
        "--options",
        default=None,
        help="zoo options as JSON (default: the peers suite's, remat.bench.suites._model_options)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (each of eager, rockmate)")
    p.add_argument("--n-layer", type=int, default=6, help="inline gpt2: layers (2..6)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--hilp-grid", type=int, default=3, help="HILP nb_bdg_save = nb_bdg_peak")
    p.add_argument("--hilp-time-limit", type=int, default=10, help="seconds per HILP solve")
    args = p.parse_args(argv)
    if not args.budget_fraction > 0:
        p.error("--budget-fraction must be > 0")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def method_name(solver: str) -> str:
    return f"rockmate-{solver}"


def activation_bytes(eager_peak: int, persistent: int) -> int:
    """peers.md: activations = eager peak - persistent state."""
    return max(0, int(eager_peak) - int(persistent))


def budget_bytes(fraction: float, eager_peak: int, persistent: int) -> int:
    return int(fraction * activation_bytes(eager_peak, persistent))


def max_grad_rel_diff(ref: dict[str, Any], got: dict[str, Any]) -> tuple[float, int, list[str]]:
    """max over parameters of max|got - ref| / max|ref|; (worst, compared, missing names)."""
    worst, compared, missing = 0.0, 0, []
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            missing.append(name)
            continue
        denom = float(r.abs().max()) or 1.0
        worst = max(worst, float((g - r).abs().max()) / denom)
        compared += 1
    return worst, compared, missing


def format_error(err: BaseException, stage: str) -> dict[str, Any]:
    """The exception verbatim, the stage, and where it was raised (innermost frames)."""
    tb = traceback.extract_tb(err.__traceback__)
    where = [f"{f.filename}:{f.lineno} in {f.name}" for f in tb[-6:]]
    return {
        "stage": stage,
        "type": type(err).__name__,
        "message": str(err),
        "where": where,
        "traceback": "".join(traceback.format_exception(err)).strip().splitlines()[-40:],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def median_or_none(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


# --- torch.export output -> what rkgb 2.0.0 parses (torch 2.14) -------------------------------


def clean_exported_graph(graph: Any) -> dict[str, int]:
    """Rewrite a ``torch.export`` graph (torch 2.14) into the subset rkgb 2.0.0 parses, in place.

    * value-less ``aten._assert_tensor_metadata`` / ``_assert_*`` nodes are erased (they print
      as bare calls, not assignments, and break rkgb's node/assignment pairing);
    * no-op aliases are erased, their uses given the input: ``aten.to`` / ``aten._to_copy``
      / ``aten.type_as`` whose output has the input's dtype and device, ``aten.dropout`` with
      ``p == 0`` or ``train=False``, and ``aten.alias`` of the same dtype, device and shape;
    * in-place ops (``add_``, ``relu_``, ...) become their out-of-place forms, and later uses of
      the mutated tensor use the new node (rkgb assumes every node makes a fresh value).

    Returns how many nodes of each kind were changed.
    """
    import torch

    counts = {"asserts_erased": 0, "aliases_erased": 0, "inplace_rewritten": 0}
    nodes = list(graph.nodes)
    for node in nodes:
        if node.op != "call_function":
            continue
        target = node.target
        name = getattr(target, "__name__", str(target))  # e.g. "add_.Tensor"
        base = name.split(".")[0]
        if base.startswith("_assert") or base in ("sym_constrain_range_for_size",):
            if not node.users:
                graph.erase_node(node)
                counts["asserts_erased"] += 1
            continue
        src = node.args[0] if node.args else None
        alias = False
        if base in ("to", "_to_copy", "type_as", "alias") and isinstance(src, torch.fx.Node):
            out_val, in_val = node.meta.get("val"), src.meta.get("val")
            if isinstance(out_val, torch.Tensor) and isinstance(in_val, torch.Tensor):
                alias = (out_val.dtype, out_val.device, tuple(out_val.shape)) == (
                    in_val.dtype,
                    in_val.device,
                    tuple(in_val.shape),
                )
        elif base in ("dropout", "native_dropout") and isinstance(src, torch.fx.Node):
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            alias = base == "dropout" and (p == 0 or train is False)
        if alias:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            counts["aliases_erased"] += 1
            continue
        if base.endswith("_") and not base.startswith("_") and isinstance(src, torch.fx.Node):
            packet = getattr(torch.ops.aten, base[:-1], None)
            overload = name.split(".")[1] if "." in name else "default"
            new_target = getattr(packet, overload, None) if packet is not None else None
            if new_target is None:
                continue
            node.target = new_target
            # uses of the mutated tensor after this node now read the new value
            position = {n: i for i, n in enumerate(graph.nodes)}
            for user in list(src.users):
                if user is not node and position[user] > position[node]:
                    user.replace_input_with(src, node)
            counts["inplace_rewritten"] += 1
    graph.lint()
    return counts


# --------------------------------------------------------------------------------------------
# The CPU patch (applied at run time; needs rockmate)
# --------------------------------------------------------------------------------------------


class _FakeStream:
    """torch.cuda.Stream on the CPU: every operation is synchronous already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event or _FakeEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True


class _FakeEvent:
    """torch.cuda.Event on the CPU: records a perf_counter time; elapsed_time in ms."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.t = time.perf_counter()

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1000.0


def make_cuda_shim(torch: Any) -> types.SimpleNamespace:
    """The ``torch.cuda`` that Rockmate sees: CPU no-ops, CPU RNG, zero memory statistics."""
    zero = lambda *a, **k: 0  # noqa: E731
    noop = lambda *a, **k: None  # noqa: E731
    return types.SimpleNamespace(
        is_available=lambda: False,
        synchronize=noop,
        current_stream=lambda *a, **k: _FakeStream(),
        default_stream=lambda *a, **k: _FakeStream(),
        Stream=_FakeStream,
        Event=_FakeEvent,
        stream=lambda *a, **k: nullcontext(),
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        memory_allocated=zero,
        max_memory_allocated=zero,
        memory_reserved=zero,
        memory_cached=zero,
        reset_peak_memory_stats=noop,
        reset_max_memory_allocated=noop,
        empty_cache=noop,
        memory_stats=lambda *a, **k: {},
        current_device=lambda: 0,
        device_count=lambda: 0,
    )


def cpu_device_arg(device: Any) -> Any:
    """Map a ``cuda`` device (string, torch.device, index) to ``cpu``; leave others alone."""
    import torch

    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(device, int):
        return "cpu"
    return device


def make_torch_proxy(torch: Any) -> types.ModuleType:
    """A stand-in for the ``torch`` module inside Rockmate/rkgb modules.

    Everything is torch's own except: ``torch.cuda`` (the CPU shim), ``torch.device("cuda")``
    (-> cpu; ``isinstance(x, torch.device)`` still works) and tensor factories, whose
    ``device="cuda"`` becomes cpu and whose ``pin_memory=True`` is dropped (page-locked memory
    needs a CUDA driver, and on the CPU nothing is copied to a device).
    """
    shim = make_cuda_shim(torch)

    class _DeviceMeta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, torch.device)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            dev = torch.device(*args, **kwargs)
            return torch.device("cpu") if dev.type == "cuda" else dev

    class device(metaclass=_DeviceMeta):  # noqa: N801
        pass

    def factory(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            if "device" in kwargs:
                kwargs["device"] = cpu_device_arg(kwargs["device"])
            return fn(*args, **kwargs)

        wrapped.__name__ = getattr(fn, "__name__", "factory")
        return wrapped

    class _TorchProxy(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    proxy = _TorchProxy("torch")
    proxy.__dict__["cuda"] = shim
    proxy.__dict__["device"] = device
    for name in ("empty", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full"):
        proxy.__dict__[name] = factory(getattr(torch, name))
    proxy.__dict__["__rockmate_cpu_proxy__"] = True
    return proxy


PATCHES: dict[str, str] = {}
"""Patch id -> what it does; filled by apply_cpu_patches (the result lists the ids applied)."""


def _patch(name: str, doc: str) -> None:
    PATCHES[name] = doc


def apply_cpu_patches() -> list[str]:
    """Monkeypatch rockmate/rkgb (already imported) to run on the CPU; returns what was done."""
    import rkgb
    import rkgb.lowlevel.measure as rk_measure
    import rockmate
    import rockmate.rockmate as rk_main
    import torch

    applied: list[str] = []

    # 1. torch seen by rockmate/rkgb: CUDA calls -> CPU no-ops, "cuda" -> cpu, no pin_memory
    proxy = make_torch_proxy(torch)
    patched_modules = []
    for name, mod in list(sys.modules.items()):
        if not (name.startswith("rockmate") or name.startswith("rkgb")) or mod is None:
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
            patched_modules.append(name)
    _patch(
        "cuda-to-cpu",
        "the `torch` global of rockmate/rkgb modules is a proxy: torch.cuda -> CPU no-ops "
        "(synchronize, Stream, current_stream, stream(), Event timed with perf_counter), "
        "cuda RNG state -> CPU RNG state, cuda memory statistics -> 0, "
        "torch.device('cuda') -> cpu, tensor factories drop pin_memory and map device cuda->cpu",
    )
    applied.append("cuda-to-cpu")

    # 2. start-up measurements that are CUDA-only (optimizer speed, PCIe bandwidth)
    def get_optimize_metrics(_p: Any, optim: Any, cpu_optim: Any = None, optim_kwargs=None, **_):
        if optim is None:
            return None
        return {
            "cpu_optimize_speed": 1e9,
            "gpu_optimize_speed": 1e9,
            "optimizer_states_factor": 2 if optim in (torch.optim.Adam, torch.optim.AdamW) else 0,
            "optimizer_overhead": 0,
            "cpu_optim": cpu_optim or optim,
            "gpu_optim": optim,
            "optim_kwargs": optim_kwargs or {},
        }

    rk_main.get_optimize_metrics = get_optimize_metrics
    rk_main.measure_bandwidth = lambda *a, **k: 1e10
    _patch(
        "no-cuda-probes",
        "rockmate.rockmate.get_optimize_metrics and measure_bandwidth (CUDA benchmarks at start-up) "
        "replaced by constants: Adam keeps 2 states per parameter, bandwidth 1e10 B/s "
        "(only offloading uses them; offloading is off)",
    )
    applied.append("no-cuda-probes")

    # 3. rkgb's CPU memory tracker is RSS-based ("not usable"): count allocator events instead
    def measure(self: Any, func: Callable[..., Any], *args: Any) -> tuple[Any, int, int]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = func(*args)
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        running = peak = 0
        for event in events:
            running += event.nbytes()
            peak = max(peak, running)
        return result, running, peak

    rk_measure.MemoryTrackerCPU.measure = measure
    _patch(
        "tensor-memory-tracker",
        "rkgb.lowlevel.measure.MemoryTrackerCPU.measure counts the CPU allocator's events "
        "(torch.profiler profile_memory) instead of process RSS: usage = net bytes, "
        "max = running-sum peak",
    )
    applied.append("tensor-memory-tracker")

    # 4. torch.export output (torch 2.14) -> what rkgb 2.0.0 parses
    import rkgb.core.raw as rk_raw

    real_export = torch.export.export

    def export(*args: Any, **kwargs: Any) -> Any:
        ep = real_export(*args, **kwargs)
        EXPORT_LOG.append(clean_exported_graph(ep.graph))
        ep.graph_module.recompile()
        return ep

    if getattr(rk_raw, "torch", None) is proxy:
        proxy.__dict__["export"] = types.SimpleNamespace(
            export=export, ExportedProgram=torch.export.ExportedProgram
        )
    else:  # pragma: no cover - rkgb imported torch differently
        raise RuntimeError("rkgb.core.raw does not use the patched torch proxy")
    _patch(
        "export-graph-cleanup",
        "torch.export.export as called by rkgb.core.raw: value-less _assert_* nodes erased; "
        "no-op aten.to/_to_copy/type_as/alias (same dtype, device, shape) and dropout(p=0 or "
        "train=False) erased, uses given the input; in-place aten ops (add_, relu_, ...) "
        "rewritten out of place, later uses of the mutated tensor given the new node",
    )
    applied.append("export-graph-cleanup")

    # 5. generated code may print float constants as a bare `inf` / `nan`
    import builtins

    builtins.inf = math.inf  # type: ignore[attr-defined]
    builtins.nan = math.nan  # type: ignore[attr-defined]
    _patch(
        "literal-inf",
        "builtins.inf / builtins.nan defined, so generated code containing a literal `inf` runs",
    )
    applied.append("literal-inf")

    del rkgb, rockmate
    return applied


EXPORT_LOG: list[dict[str, int]] = []


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


class Workload:
    def __init__(self, name: str, model: Any, inputs: tuple, loss_fn: Callable, source: str):
        self.name, self.model, self.inputs, self.loss_fn, self.source = (
            name,
            model,
            inputs,
            loss_fn,
            source,
        )


def _chain_workload(batch: int | None) -> Workload:
    import torch
    from torch import nn

    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(32)])
    x = torch.randn(batch or 1024, 512)

    def loss_fn(out: Any, inputs: tuple) -> Any:
        return torch.nn.functional.mse_loss(out, torch.zeros_like(out))

    return Workload("chain", model, (x,), loss_fn, "inline: 32 x (Linear 512->512, GELU)")


def _gpt2_workload(batch: int | None, n_layer: int) -> Workload:
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    # dropout 0 so that gradients can be compared with eager ones (peers.md did the same)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=256,
        n_head=4,
        vocab_size=4096,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config.use_cache = False
    seq = 256

    class GPT2Logits(nn.Module):
        """GPT2LMHeadModel returning the logits tensor (rkgb traces tensors, not ModelOutput).

        The causal mask is passed as a 4-D boolean buffer: transformers 4.57 otherwise builds it
        with vmap, which torch.export records as functorch calls and pytree-spec constants
        that rkgb cannot parse. Same mask, same result; eager runs the same module."""

        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPT2LMHeadModel(config)
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
            self.register_buffer("causal_mask", causal, persistent=False)

        def forward(self, input_ids: Any) -> Any:
            out = self.gpt(
                input_ids=input_ids,
                attention_mask=self.causal_mask,
                use_cache=False,
                return_dict=False,
            )
            return out[0]

    model = GPT2Logits()
    ids = torch.randint(0, 4096, (batch or 8, seq))

    def loss_fn(logits: Any, inputs: tuple) -> Any:
        ids = inputs[0]
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )

    return Workload(
        "gpt2",
        model,
        (ids,),
        loss_fn,
        f"inline: GPT2LMHeadModel(GPT2Config(n_layer={n_layer}, n_embd=256, n_head=4, "
        "vocab_size=4096, dropout 0)) -> logits, 4-D causal mask buffer; loss: next-token CE",
    )


def _decoder_workload(zoo: Any, name: str, chosen: dict[str, Any]) -> Workload:
    """The suite's own Hugging Face decoder (same config, weights seed and tokens), wrapped to
    take the token ids and return the logits: rkgb traces tensors, not ModelOutput, and
    cannot parse the vmap-built causal mask of transformers 4.57, so the same causal mask is
    passed as a 4-D boolean buffer. Loss: next-token cross-entropy, what the model computes
    from ``labels=input_ids``."""
    import torch
    from torch import nn

    entry = zoo.get(name, **chosen)
    ids = entry.batch["input_ids"]
    seq = ids.shape[1]

    class DecoderLogits(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
            self.register_buffer("causal_mask", causal, persistent=False)

        def forward(self, input_ids: Any) -> Any:
            out = self.lm(
                input_ids=input_ids,
                attention_mask=self.causal_mask,
                use_cache=False,
                return_dict=False,
            )
            return out[0]

    def loss_fn(logits: Any, inputs: tuple) -> Any:
        tokens = inputs[0]
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )

    return Workload(
        name,
        DecoderLogits(entry.model),
        (ids,),
        loss_fn,
        f"remat.zoo.get({name!r}, **{chosen!r}): {entry.description}; wrapped to return the "
        "logits from a 4-D causal mask buffer",
    )


def zoo_options(name: str, batch: int | None, options: str | None) -> dict[str, Any]:
    """The zoo options of a run: ``--options`` (JSON) or else the peers suite's for ``name``
    (so that Rockmate runs on the same model and input as the suite's other methods), with
    ``--batch`` as ``batch_size`` over both."""
    if options is not None:
        chosen = json.loads(options)
        if not isinstance(chosen, dict):
            raise SystemExit(f"--options must be a JSON object, got {options!r}")
    else:
        try:
            from remat.bench.suites import _model_options  # noqa: PLC0415
        except ImportError:
            chosen = {}
        else:
            chosen = dict(_model_options(name, False))
    if batch is not None:
        chosen["batch_size"] = batch
    return chosen


def load_workload(
    name: str, batch: int | None, n_layer: int, options: str | None = None
) -> Workload:
    """A remat zoo model if remat.zoo exists and knows ``name``; else the inline ones."""
    import torch

    torch.manual_seed(0)
    try:
        from remat import zoo  # noqa: PLC0415
    except ImportError:
        zoo = None
    if zoo is not None and name in HF_DECODERS:
        return _decoder_workload(zoo, name, zoo_options(name, batch, options))
    if zoo is not None and name not in INLINE_MODELS:
        from remat.capture.chain import _model_arguments  # noqa: PLC0415

        chosen = zoo_options(name, batch, options)
        entry = zoo.get(name, **chosen)
        batch_obj = entry.batch
        zoo_loss = entry.loss_fn
        # what the zoo loss calls the model with (a classifier gets the images, not the labels)
        args, kwargs = _model_arguments(entry.model, zoo_loss, batch_obj)
        if kwargs:
            raise TypeError(
                f"zoo model {name!r} is called with keyword arguments {sorted(kwargs)}; "
                "Rockmate takes positional inputs only (use an inline workload)"
            )
        inputs = tuple(args)

        class _Out(torch.nn.Module):
            def __init__(self, out: Any) -> None:
                super().__init__()
                self.out = out

            def forward(self, *a: Any) -> Any:
                return self.out

        def loss_fn(out: Any, inputs: tuple, _zl: Callable = zoo_loss) -> Any:
            # zoo loss_fn(module, batch) calls the module: hand it the computed output
            return _zl(_Out(out), batch_obj)

        source = f"remat.zoo.get({name!r}, **{chosen!r}): {entry.description}"
        return Workload(name, entry.model, inputs, loss_fn, source)
    if name == "chain":
        return _chain_workload(batch)
    if name == "gpt2-small" or (zoo is None and name == "gpt2"):
        return _gpt2_workload(batch, n_layer)
    raise SystemExit(f"unknown model {name!r} (remat.zoo absent: inline models {INLINE_MODELS})")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


BUILTIN_ARG_NAMES = ("input", "type", "id", "len", "list", "dict", "sum", "min", "max")


def renamed_forward_args(params: list[str]) -> list[str]:
    """Forward argument names that shadow a Python builtin get a trailing ``_arg``."""
    return [f"{p}_arg" if p in BUILTIN_ARG_NAMES else p for p in params]


def wrap_builtin_arg_names(model: Any) -> tuple[Any, bool]:
    """torch.export names a placeholder after the forward argument; codegen then emits
    ``input_1 = input`` (not a node) for a builtin's name, which rkgb cannot pair with a node.
    Hand Rockmate a wrapper whose positional arguments are renamed (same parameters)."""
    import inspect

    import torch

    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    new = renamed_forward_args(params)
    if new == params:
        return model, False
    src = f"def forward(self, {', '.join(new)}):\n    return self.inner({', '.join(new)})\n"
    namespace: dict[str, Any] = {}
    exec(src, namespace)
    wrapper_cls = type("RenamedArgs", (torch.nn.Module,), {"forward": namespace["forward"]})
    wrapper = wrapper_cls()
    wrapper.inner = model
    return wrapper, True


def _unwrap(out: Any) -> Any:
    while isinstance(out, tuple | list) and len(out) == 1:
        out = out[0]
    return out


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _tensors_in(obj: Any, depth: int = 0) -> list[Any]:
    import torch

    if depth > 3:
        return []
    if isinstance(obj, torch.Tensor):
        out = [obj]
        if obj.is_leaf and obj.grad is not None:
            out.append(obj.grad)
        return out
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v, depth + 1)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors_in(v, depth + 1)]
    return []


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    stage = "import"
    try:
        import torch

        torch.set_num_threads(args.threads)
        from remat.measure.events import interleaved_times, step_peak_bytes, unique_storage_bytes

        result["torch"] = torch.__version__
        result["threads"] = torch.get_num_threads()

        stage = "import rockmate"
        import rkgb  # noqa: F401
        import rockmate
        from rockmate import from_config, generate_config

        result["rockmate_version"] = "2.0.0"

        stage = "patch"
        result["patched"] = apply_cpu_patches()
        result["patch_details"] = {k: PATCHES[k] for k in result["patched"]}

        stage = "workload"
        work = load_workload(args.model, args.batch, args.n_layer, args.options)
        result["workload"] = work.source
        model, inputs, loss_fn = work.model, work.inputs, work.loss_fn
        eager = copy.deepcopy(model)
        reference = copy.deepcopy(model)

        stage = "eager reference gradients"
        loss_fn(_unwrap(reference(*inputs)), inputs).backward()
        ref_grads = _grads(reference)
        del reference

        stage = "eager peak"
        eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-6)

        def eager_step() -> None:
            loss = loss_fn(_unwrap(eager(*inputs)), inputs)
            loss.backward()
            eager_opt.step()
            eager_opt.zero_grad(set_to_none=True)

        eager_peak = step_peak_bytes(eager_step, eager, eager_opt, inputs)
        eager_state = [*eager.parameters(), *eager.buffers(), *inputs]
        for st in eager_opt.state.values():
            eager_state.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        persistent = unique_storage_bytes(eager_state)
        budget = budget_bytes(args.budget_fraction, eager_peak, persistent)
        result.update(
            eager_peak_bytes=eager_peak,
            persistent_bytes=persistent,
            activation_bytes=activation_bytes(eager_peak, persistent),
            budget_bytes=budget,
        )

        stage = "plan (rockmate.from_config)"
        config = generate_config(SOLVERS[args.solver])
        if args.solver == "hilp":
            hilp = config.solver.bottom.hilp
            hilp.nb_bdg_save = hilp.nb_bdg_peak = args.hilp_grid
            hilp.time_limit = args.hilp_time_limit
            result["hilp_config"] = {
                "nb_bdg_save": args.hilp_grid,
                "nb_bdg_peak": args.hilp_grid,
                "time_limit": args.hilp_time_limit,
            }
        rk_model, renamed = wrap_builtin_arg_names(model)
        if renamed:
            result["patched"].append("arg-rename")
            result["patch_details"]["arg-rename"] = (
                "the model is handed to Rockmate inside a wrapper module whose forward "
                "arguments named after a Python builtin (nn.Sequential's `input`) are renamed "
                "(`input_arg`); same parameters, same computation"
            )
        t0 = time.perf_counter()
        rk = from_config(rk_model, list(inputs), budget, config=config)
        result["export_cleanup"] = list(EXPORT_LOG)
        result["plan_seconds"] = time.perf_counter() - t0
        if rk.op_sched is None:
            raise RuntimeError(
                f"Rockmate found no schedule for budget {budget} B "
                f"({args.budget_fraction} x {activation_bytes(eager_peak, persistent)} B "
                "of activations)"
            )
        result["rockmate_predicted_peak"] = _predicted_peak(rk)

        stage = "rockmate gradients"
        model.zero_grad(set_to_none=True)
        loss_fn(_unwrap(rk(*inputs)), inputs).backward()
        worst, compared, missing = max_grad_rel_diff(ref_grads, _grads(model))
        result.update(max_grad_rel_diff=worst, grads_compared=compared, grads_missing=missing)
        model.zero_grad(set_to_none=True)

        stage = "rockmate peak"
        opt = torch.optim.Adam(model.parameters(), lr=1e-6)

        def rk_step() -> None:
            loss = loss_fn(_unwrap(rk(*inputs)), inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        rk_step()  # warm-up: Adam state exists
        rk_step()
        # tensors Rockmate keeps in its own storage between steps count as persistent state
        storage = rk.compiler.storage
        retained = [t for v in storage.ld.values() for t in _tensors_in(v)]
        retained += [t for k, v in storage.gd.items() if k == "meta" for t in _tensors_in(v)]
        model_state = [*model.parameters(), *model.buffers(), *inputs]
        for st in opt.state.values():
            model_state.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        result["retained_bytes"] = unique_storage_bytes(model_state + retained) - (
            unique_storage_bytes(model_state)
        )
        peak = step_peak_bytes(rk_step, model, opt, [inputs, retained], warmup=0)
        result["peak_bytes"] = peak
        result["memory_ratio"] = ratio(peak, eager_peak)

        stage = "timing (interleaved with eager)"
        times = interleaved_times({"rockmate": rk_step, "eager": eager_step}, repeats=args.steps)
        result["step_times"] = times["rockmate"]
        result["eager_step_times"] = times["eager"]
        result["interleaved"] = True
        result["time_ratio"] = ratio(
            median_or_none(times["rockmate"]), median_or_none(times["eager"])
        )
        stage = "done"
        del rockmate
    except BaseException as err:  # a peer failing is a result: report it verbatim
        result["error"] = format_error(err, stage)
        if isinstance(err, KeyboardInterrupt):
            raise


def _predicted_peak(rk: Any) -> int | None:
    try:
        sched = rk.op_sched
        for attr in ("peak_mem", "get_peak_mem"):
            v = getattr(sched, attr, None)
            if v is not None:
                v = v() if callable(v) else v
                return int(v) if v is not None and not math.isnan(float(v)) else None
    except Exception:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "model": args.model,
        "method": method_name(args.solver),
        "budget_fraction": args.budget_fraction,
        "batch": args.batch,
        "steps": args.steps,
        "device": "cpu",
        "peak_bytes": None,
        "step_times": [],
        "eager_step_times": [],
        "interleaved": False,
        "plan_seconds": None,
        "max_grad_rel_diff": None,
        "patched": [],
        "error": None,
    }
    t0 = time.perf_counter()
    try:
        run(args, result)
    finally:
        result["wall_seconds"] = time.perf_counter() - t0
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
