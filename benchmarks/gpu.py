"""remat on a GPU, in one short run: the promises checked on CUDA, and the GPU table of
shared/peers.md (GPT-2 124M 8x1024, ResNet-50 64x224², Llama ~1B 4x2048, bf16 autocast).

Sections, in order (each writes its rows to ``OUT/gpu.json`` as soon as they are measured, so
a run stopped at its time limit keeps what it measured; a section that fails records its
error and the run goes on):

1. ``promises``: fp32, deterministic algorithms. For small zoo models moved to CUDA:
   ``remat.auto`` at the least budget it names (the refusal of 1 byte) and half-way to the
   unplanned step; the step's ``torch.cuda.max_memory_allocated`` against the budget and the
   prediction, gradients against the unplanned model (max relative difference).
2. ``table``: bf16 autocast, Adam (lr=0: the weights stay, every method is compared at one
   point). Per model: eager, checkpointing each block (Hugging Face's gradient checkpointing,
   or ``torch.utils.checkpoint`` on each torchvision bottleneck), torch.compile with
   ``activation_memory_budget`` K (GPT-2 only: compiling costs minutes), and ``remat.auto`` at
   the measured peak of each of those points and at its own least budget. Peak = the step's
   ``max_memory_allocated`` (one optimizer shared by all methods of a model: one Adam state
   alive); time = median ratio to eager steps interleaved with the method's; gradients =
   relative L2 distance to eager's (bf16: ~3e-3 is rounding; compiled ~1e-2, shared/peers.md).
3. ``compiled``: ``remat.auto(..., compile=True)`` on GPT-2 124M at compile@0.5's peak, if
   time is left.

    python benchmarks/gpu.py --out $OUT                # on the GPU machine
    python benchmarks/gpu.py --tiny --out /tmp/gpu     # the same code on tiny models, any device
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

import remat  # noqa: E402
from remat import zoo  # noqa: E402
from remat.measure.events import cuda_step_peak_bytes, interleaved_times, step_peak_bytes  # noqa: E402
from remat.planners import BudgetTooSmallError  # noqa: E402

START = time.perf_counter()
ROWS: list[dict[str, Any]] = []
REQUESTED: list[int] = []


def elapsed() -> float:
    return time.perf_counter() - START


def log(msg: str) -> None:
    print(f"[{elapsed():6.0f} s] {msg}", flush=True)


class Report:
    def __init__(self, out: Path, device: torch.device) -> None:
        self.path = out / "gpu.json"
        out.mkdir(parents=True, exist_ok=True)
        self.machine = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        try:
            import transformers

            self.machine["transformers"] = transformers.__version__
        except ImportError:
            pass

    def add(self, row: dict[str, Any]) -> None:
        ROWS.append(row)
        shown = {k: v for k, v in row.items() if k not in ("traceback",)}
        log(json.dumps(shown, default=str))
        self.path.write_text(
            json.dumps({"machine": self.machine, "rows": ROWS}, indent=1, default=str)
        )


def to(batch: Any, device: torch.device) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def error_row(section: str, err: Exception, **fields: Any) -> dict[str, Any]:
    """A section's failure as a result row (the run goes on)."""
    return {
        "section": section,
        **fields,
        "error": f"{type(err).__name__}: {err}"[:1500],
        "traceback": traceback.format_exc()[-3000:],
    }


def fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_bytes(
    step: Callable[[], Any], model: nn.Module, opt: Any, batch: Any, device: torch.device
) -> int:
    """The whole step's peak: max_memory_allocated on CUDA, allocator events on the CPU."""
    if device.type != "cuda":
        return step_peak_bytes(step, model, opt, batch)
    peak = cuda_step_peak_bytes(step)
    # the bytes asked for, before the allocator's rounding and unsplit block remainders
    REQUESTED.append(int(torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)))
    return peak


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().float().cpu().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def rel_l2(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref if k in got)
    den = sum(float(r.pow(2).sum()) for r in ref.values())
    missing = [k for k in ref if k not in got]
    if missing:
        return float("inf")
    return (num / den) ** 0.5 if den else 0.0


def max_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k, r in ref.items():
        if k not in got:
            return float("inf")
        worst = max(worst, float((got[k] - r).abs().max()) / (float(r.abs().max()) or 1.0))
    return worst


def one_grad(module: nn.Module, params_of: nn.Module, loss_fn: Any, batch: Any, seed: int = 7):
    params_of.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(module, batch)
    loss.backward()
    out = grads_of(params_of), float(loss)
    params_of.zero_grad(set_to_none=True)
    return out


def least_budget(model: nn.Module, batch: Any, **kw: Any) -> int:
    try:
        remat.auto(model, batch, budget=1, **kw)
    except BudgetTooSmallError as err:
        return err.minimum_bytes
    raise AssertionError("a 1-byte budget was accepted")


# ---------------------------------------------------------------------- 1. promises


def promises(report: Report, device: torch.device, names: list[str]) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        for name in names:
            try:
                _promise(report, device, name)
            except Exception as err:  # a failure is a result
                report.add(error_row("promises", err, model=name))
            fresh(device)
    finally:
        torch.use_deterministic_algorithms(False)


def _promise(report: Report, device: torch.device, name: str) -> None:
    torch.manual_seed(0)
    entry = zoo.get(name)
    model = entry.model.to(device)
    batch = to(entry.batch, device)
    loss_fn = entry.loss_fn
    ref, ref_loss = one_grad(model, model, loss_fn, batch)
    opt = torch.optim.Adam(model.parameters(), lr=0.0)

    def eager_step() -> None:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    eager_peak = peak_bytes(eager_step, model, opt, batch, device)
    least = least_budget(model, batch, loss_fn=loss_fn, optimizer=opt, loop="loss-only")
    for label, budget in (("least", least), ("half-way", (least + eager_peak) // 2)):
        planned, summary = remat.auto(
            model, batch, loss_fn=loss_fn, budget=budget, optimizer=opt, loop="loss-only"
        )
        got, loss = one_grad(planned, model, loss_fn, batch)

        def step(planned: nn.Module = planned) -> None:
            loss_fn(planned, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        measured = peak_bytes(step, model, opt, batch, device)
        requested = REQUESTED[-1] if REQUESTED and device.type == "cuda" else None
        report.add(
            {
                "section": "promises",
                "model": name,
                "budget": label,
                "path": "graph" if isinstance(summary.plan, remat.graphs.Plan) else "chain",
                "budget_bytes": budget,
                "predicted_peak_bytes": summary.predicted_peak_bytes,
                "measured_peak_bytes": measured,
                "requested_peak_bytes": requested,
                "eager_peak_bytes": eager_peak,
                "within_budget": measured <= budget,
                "measured_minus_predicted": measured - summary.predicted_peak_bytes,
                "loss_equal": loss == ref_loss,
                "max_grad_rel_diff": max_rel(got, ref),
            }
        )
        del planned, summary
        fresh(device)


# ---------------------------------------------------------------------- 2. the table


class Case:
    """A model in bf16 autocast with its batch, loss and its 'checkpoint each block' switch."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        batch: Any,
        loss: Callable[[nn.Module, Any], torch.Tensor],
        each_block: Callable[[bool], None] | None,
        device: torch.device,
    ) -> None:
        self.name, self.model, self.batch, self.each_block = name, model, batch, each_block
        dtype = torch.bfloat16

        def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
            with torch.autocast(device.type, dtype=dtype):
                return loss(m, b)

        self.loss_fn = loss_fn
        self.opt = torch.optim.Adam(model.parameters(), lr=0.0)

    def step_of(self, module: nn.Module, context: Callable[[], Any] = nullcontext):
        def step() -> None:
            with context():
                self.loss_fn(module, self.batch).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

        return step


def _causal_lm(name: str, model_class: Any, cfg: Any, b: int, t: int, device: Any) -> Case:
    """A Hugging Face causal LM of ``cfg`` on ``device``, its loss inside the model, its
    each-block switch Hugging Face's gradient checkpointing (non-reentrant)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (b, t), device=device)

    def each_block(on: bool) -> None:
        if on:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()

    batch = {"input_ids": ids, "labels": ids}
    return Case(name, model, batch, lambda m, b: m(**b).loss, each_block, device)


def _gpt2(tiny: bool, device: torch.device) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        b, t = 2, 64
    else:
        cfg = GPT2Config()  # 124M
        b, t = 8, 1024
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # compiled RNG differs from eager's
    name = "gpt2-124m" if not tiny else "gpt2-tiny"
    return _causal_lm(name, GPT2LMHeadModel, cfg, b, t, device)


def _llama(tiny: bool, device: torch.device) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
        heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
        b, t = 2, 64
    else:  # TinyLlama-1.1B's shape
        shape = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22}
        heads = {"num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000}
        b, t = 4, 2048
    name = "llama-1b" if not tiny else "llama-tiny"
    return _causal_lm(name, LlamaForCausalLM, LlamaConfig(**shape, **heads), b, t, device)


def _resnet50(tiny: bool, device: torch.device) -> Case:
    import torchvision
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device).train()
    b, s = (2, 64) if tiny else (64, 224)
    x = torch.randn(b, 3, s, s, device=device)
    y = torch.randint(0, 1000, (b,), device=device)
    blocks = [
        blk for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for blk in layer
    ]
    originals = [blk.forward for blk in blocks]

    def each_block(on: bool) -> None:
        for blk, fwd in zip(blocks, originals, strict=True):
            if on:
                blk.forward = lambda t, fwd=fwd: checkpoint(fwd, t, use_reentrant=False)
            else:
                blk.forward = fwd

    return Case(
        "resnet50" if not tiny else "resnet50-tiny",
        model,
        (x, y),
        lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        each_block,
        device,
    )


def measure(
    case: Case,
    method: str,
    module: nn.Module,
    ref: dict,
    device: torch.device,
    context: Callable[[], Any] = nullcontext,
    **extra: Any,
) -> dict[str, Any]:
    row: dict[str, Any] = {"section": "table", "model": case.name, "method": method, **extra}
    start = time.perf_counter()
    with context():
        got, _ = one_grad(module, case.model, case.loss_fn, case.batch)
    row["first_step_seconds"] = round(time.perf_counter() - start, 2)
    row["grad_rel_l2"] = rel_l2(got, ref)
    del got
    step = case.step_of(module, context)
    row["peak_bytes"] = peak_bytes(step, case.model, case.opt, case.batch, device)
    if device.type == "cuda":
        row["requested_peak_bytes"] = REQUESTED[-1]
    times = interleaved_times({"eager": case.step_of(case.model), "method": step}, repeats=5)
    row["step_seconds"] = statistics.median(times["method"])
    row["eager_step_seconds"] = statistics.median(times["eager"])
    row["time_ratio"] = row["step_seconds"] / row["eager_step_seconds"]
    return row


BUILDERS = {"gpt2": _gpt2, "resnet50": _resnet50, "llama": _llama}


def table(
    report: Report,
    device: torch.device,
    tiny: bool,
    deadline: float,
    compile_budgets: tuple[float, ...],
    models: list[str],
) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for key in models:
        build = BUILDERS[key]
        if elapsed() > deadline:
            report.add({"section": "table", "model": key, "skipped": "out of time"})
            continue
        try:
            _table_model(
                report,
                device,
                build(tiny, device),
                key,
                deadline,
                compile_budgets if key == "gpt2" else (),
                peaks,
            )
        except Exception as err:
            report.add(error_row("table", err, model=key))
        fresh(device)
    return peaks


def _table_model(
    report: Report,
    device: torch.device,
    case: Case,
    key: str,
    deadline: float,
    compile_budgets: tuple[float, ...],
    peaks: dict[str, int],
) -> None:
    import torch._functorch.config as functorch_config

    ref, _ = one_grad(case.model, case.model, case.loss_fn, case.batch)
    points: dict[str, int] = {}

    def add(row: dict[str, Any]) -> None:
        if "peak_bytes" in row and "eager" in points:
            row["memory_ratio"] = row["peak_bytes"] / points["eager"]
        report.add(row)
        if "peak_bytes" in row:
            points[row["method"]] = row["peak_bytes"]

    add(measure(case, "eager", case.model, ref, device))
    if case.each_block is not None:
        switch = case.each_block

        @contextlib.contextmanager
        def each_block() -> Any:  # on for the method's steps only, not the interleaved eager's
            switch(True)
            try:
                yield
            finally:
                switch(False)

        add(measure(case, "checkpoint-each-block", case.model, ref, device, context=each_block))
    for k in compile_budgets:
        if elapsed() > deadline:
            break
        torch._dynamo.reset()
        compiled = torch.compile(case.model)
        try:
            add(
                measure(
                    case,
                    f"torch-compile@{k:g}",
                    compiled,
                    ref,
                    device,
                    context=lambda k=k: functorch_config.patch(activation_memory_budget=k),
                )
            )
        except Exception as err:
            add(
                {
                    "section": "table",
                    "model": case.name,
                    "method": f"torch-compile@{k:g}",
                    "error": f"{type(err).__name__}: {err}"[:1500],
                }
            )
        del compiled
        torch._dynamo.reset()
        fresh(device)
    kw = {"loss_fn": case.loss_fn, "optimizer": case.opt, "loop": "loss-only"}
    least = least_budget(case.model, case.batch, **kw)
    budgets = {f"remat@{m}": b for m, b in points.items() if m != "eager"}
    budgets["remat@least"] = least
    for label, budget in budgets.items():
        if elapsed() > deadline:
            break
        if budget < least:
            add(
                {
                    "section": "table",
                    "model": case.name,
                    "method": label,
                    "budget_bytes": budget,
                    "refused": f"below remat's least {least}",
                }
            )
            continue
        try:
            planned, summary = remat.auto(case.model, case.batch, budget=budget, **kw)
        except BudgetTooSmallError as err:  # a second capture named another minimum
            add(
                {
                    "section": "table",
                    "model": case.name,
                    "method": label,
                    "budget_bytes": budget,
                    "refused": f"a second capture's minimum is {err.minimum_bytes}",
                }
            )
            budget = err.minimum_bytes
            label += "-again"
            planned, summary = remat.auto(case.model, case.batch, budget=budget, **kw)
        add(
            measure(
                case,
                label,
                planned,
                ref,
                device,
                budget_bytes=budget,
                predicted_peak_bytes=summary.predicted_peak_bytes,
                plan=str(summary.plan)[:300],
            )
        )
        del planned, summary
        fresh(device)
    for m, b in points.items():
        peaks[f"{key}:{m}"] = b


def compiled(report: Report, device: torch.device, tiny: bool, budget: int | None) -> None:
    case = _gpt2(tiny, device)
    ref, _ = one_grad(case.model, case.model, case.loss_fn, case.batch)
    if budget is None:
        budget = least_budget(
            case.model, case.batch, loss_fn=case.loss_fn, optimizer=case.opt, loop="loss-only"
        )
    torch._dynamo.reset()
    start = time.perf_counter()
    kw = {"loss_fn": case.loss_fn, "optimizer": case.opt, "loop": "loss-only", "compile": True}
    try:
        planned, summary = remat.auto(case.model, case.batch, budget=budget, **kw)
    except BudgetTooSmallError as err:  # compile's peak is below remat-compiled's least
        report.add({"section": "compiled", "budget_bytes": budget, "refused": str(err)[:300]})
        budget = err.minimum_bytes
        planned, summary = remat.auto(case.model, case.batch, budget=budget, **kw)
    plan_seconds = time.perf_counter() - start
    row = measure(
        case,
        "remat-compiled",
        planned,
        ref,
        device,
        budget_bytes=budget,
        predicted_peak_bytes=summary.predicted_peak_bytes,
        plan=str(summary.plan)[:300],
        plan_seconds=round(plan_seconds, 1),
    )
    report.add(row)


def run_gpu_tests(report: Report, out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "tests/test_levers.py",
        "tests/test_profile.py",
        "tests/test_runtime.py",
        "tests/test_gpu_budget.py",
    ]
    start = time.perf_counter()
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    (out / "gpu_tests.log").write_text(done.stdout + done.stderr)
    report.add(
        {
            "section": "gpu-tests",
            "returncode": done.returncode,
            "seconds": round(time.perf_counter() - start, 1),
            "summary": (done.stdout.strip().splitlines() or [""])[-1],
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny models (checks the script)")
    ap.add_argument("--seconds", type=float, default=480.0, help="start no section after this")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--compile-budgets", default="1,0.5")
    ap.add_argument("--models", default="gpt2,resnet50,llama")
    ap.add_argument("--promise-models", default="mlp-chain,gpt2,resnet18")
    ap.add_argument("--no-compiled", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = Report(args.out, device)
    log(f"{report.machine}")
    if device.type == "cuda" and not args.no_tests:
        try:
            run_gpu_tests(report, args.out)
        except Exception as err:
            report.add({"section": "gpu-tests", "error": f"{type(err).__name__}: {err}"})
    promises(report, device, [m for m in args.promise_models.split(",") if m])
    budgets = tuple(float(k) for k in args.compile_budgets.split(",") if k)
    peaks = table(
        report,
        device,
        args.tiny,
        args.seconds - 120,
        budgets,
        [m for m in args.models.split(",") if m],
    )
    if not args.no_compiled and elapsed() < args.seconds - 60:
        try:
            compiled(report, device, args.tiny, peaks.get("gpt2:torch-compile@0.5"))
        except Exception as err:
            report.add(error_row("compiled", err))
    log("done")


if __name__ == "__main__":
    main()
