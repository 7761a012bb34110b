"""The figures of docs/levers.md: what each memory lever saves and costs, measured exactly.

Sohoni et al. (2019) combine low precision, microbatching, sparsity and checkpointing;
``remat.levers`` provides the first three (and CPU offload). This script measures each on the
CPU workloads of ``shared/peers.md``:

* ``chain32``: 32 x (Linear 512->512, GELU), input 1024 x 512, loss ``mean(out**2)``;
* ``resnet18``: torchvision, 100 classes, 16 x 3 x 128 x 128, cross-entropy;
* ``chain8``: 8 x (Linear 512->512, GELU), input 256 x 512, only for autocast (a CPU without
  bf16/fp16 matrix instructions emulates them: its autocast timings mean nothing, and none are
  taken).

Parts (each a key of the JSON):

* ``autocast``: saved-activation bytes and gradient error of autocast and compressed storage
  on chain8;
* ``storage``: compressed saved activations (bf16, fp16, int8) with fp32 compute on chain32 and
  resnet18: saved bytes, gradient error, whole-step peak with Adam, time against fp32;
* ``microbatch``: chain32 with k = 1, 2, 4, 8 microbatches, and a 5-checkpoint remat plan
  composed with int8 storage and 4 microbatches;
* ``sparsity``: what magnitude pruning to 10 % saves in dense PyTorch (nothing) and what CSR and
  COO storage of one 512 x 512 weight take at several densities.

Bytes: saved activations by :func:`remat.levers.count_saved_tensors` or the compression's own
statistics (unique storages, parameters and batch excluded); step peak by
:func:`remat.measure.events.step_peak_bytes`. Gradient error: :func:`remat.levers.gradient_error`
(relative L2 against fp32, same random state). Times: medians of interleaved steps
(:func:`remat.measure.events.interleaved_times`), as ratios within one run.

Run: ``OMP_NUM_THREADS=1 python benchmarks/levers.py`` (about 10 min on a 2-core CPU) writes
``docs/results/levers.json`` and ``docs/results/levers.md``; ``--parts sparsity,autocast`` runs
a subset and keeps the other parts of an existing JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.levers import (
    Precision,
    accumulate_step,
    compress_saved_activations,
    count_saved_tensors,
    gradient_error,
    magnitude_prune,
    precision_context,
    predicted_sparse_bytes,
    sparse_storage_bytes,
)
from remat.measure.events import interleaved_times, median_ratio, step_peak_bytes

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
PARTS = ("autocast", "storage", "microbatch", "sparsity")
#: The remat plan of the composition table: keep 5 of the chain's 31 inner activations.
CHECKPOINTS = (6, 12, 18, 24, 30)
DENSITIES = (0.01, 0.05, 0.10, 0.25, 0.33, 0.50)
Loss = Callable[[nn.Module, Any], torch.Tensor]


# ---------------------------------------------------------------------- workloads
def chain(layers: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(layers)])


def chain_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().square().mean()


def resnet18() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=100)


def resnet_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).float(), batch[1])


def batches() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "chain32": torch.randn(1024, 512, generator=g),
        "chain8": torch.randn(256, 512, generator=g),
        "resnet18": (
            torch.randn(16, 3, 128, 128, generator=g),
            torch.randint(0, 100, (16,), generator=g),
        ),
    }


# ---------------------------------------------------------------------- parts
def saved_peak(model: nn.Module, batch: Any, loss_fn: Loss, context: Any) -> int:
    """Saved-activation peak of one forward+backward under ``context`` (yields statistics)."""
    with context as stats:
        loss = loss_fn(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return stats.peak_bytes


def part_autocast(data: dict[str, Any]) -> dict[str, Any]:
    model, x = chain(8), data["chain8"]
    exclude = (x,)
    out: dict[str, Any] = {
        "saved_fp32": saved_peak(model, x, chain_loss, count_saved_tensors(model, exclude))
    }
    for dtype in ("bf16", "fp16", "int8"):
        hooks = compress_saved_activations(dtype, model, exclude=exclude)
        out[f"saved_storage_{dtype}"] = saved_peak(model, x, chain_loss, hooks)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["saved_autocast_bf16"] = saved_peak(
            model, x, chain_loss, count_saved_tensors(model, exclude)
        )
    both = Precision(compute="bf16", saved="int8")
    out["saved_autocast_bf16_storage_int8"] = saved_peak(
        model, x, chain_loss, precision_context(both, "cpu", model, exclude)
    )
    variants = {
        "autocast_bf16": Precision(compute="bf16"),
        "autocast_fp16": Precision(compute="fp16"),
        "storage_bf16": Precision(saved="bf16"),
        "storage_fp16": Precision(saved="fp16"),
        "storage_int8": Precision(saved="int8"),
        "autocast_bf16_storage_int8": both,
    }
    for label, precision in variants.items():
        out[f"error_{label}"] = gradient_error(model, x, precision, chain_loss).relative_l2
    return out


def part_storage(data: dict[str, Any], repeats: int) -> dict[str, Any]:
    workloads: dict[str, tuple[Callable[[], nn.Module], Loss]] = {
        "chain32": (chain, chain_loss),
        "resnet18": (resnet18, resnet_loss),
    }
    out: dict[str, Any] = {}
    for name, (make, loss_fn) in workloads.items():
        model, batch = make(), data[name]
        exclude = batch if isinstance(batch, tuple) else (batch,)
        row: dict[str, Any] = {
            "saved_fp32": saved_peak(model, batch, loss_fn, count_saved_tensors(model, exclude))
        }
        for dtype in ("bf16", "fp16", "int8"):
            hooks = compress_saved_activations(dtype, model, exclude=exclude)
            row[f"saved_{dtype}"] = saved_peak(model, batch, loss_fn, hooks)
            error = gradient_error(model, batch, Precision(saved=dtype), loss_fn)
            row[f"error_{dtype}"] = error.relative_l2
        steps = {}
        for label in ("fp32", "bf16", "int8"):
            copied = copy.deepcopy(model)
            optimizer = torch.optim.Adam(copied.parameters(), lr=1e-4)
            steps[label] = _adam_step(copied, optimizer, batch, loss_fn, label, exclude)
            row[f"step_peak_{label}"] = step_peak_bytes(steps[label], copied, optimizer, batch)
        times = interleaved_times(steps, repeats=repeats)
        for label in steps:
            row[f"time_ratio_{label}"] = median_ratio(times, label, "fp32")
        row["time_fp32_s"] = statistics.median(times["fp32"])
        out[name] = row
    return out


def _adam_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Loss,
    storage: str,
    exclude: tuple[torch.Tensor, ...],
) -> Callable[[], None]:
    def step() -> None:
        if storage == "fp32":
            loss = loss_fn(model, batch)
        else:
            with compress_saved_activations(storage, model, exclude=exclude):
                loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def part_microbatch(data: dict[str, Any], repeats: int) -> dict[str, Any]:
    model, x = chain(), data["chain32"]
    out: dict[str, Any] = {}
    steps = {}
    for k in (1, 2, 4, 8):
        with count_saved_tensors(model, exclude=(x,)) as stats:
            accumulate_step(model, x, k, chain_loss)
        model.zero_grad(set_to_none=True)
        out[f"saved_k{k}"] = stats.peak_bytes
        copied = copy.deepcopy(model)
        optimizer = torch.optim.Adam(copied.parameters(), lr=1e-4)

        def step(m: nn.Module = copied, o: torch.optim.Optimizer = optimizer, k: int = k) -> None:
            accumulate_step(m, x, k, chain_loss, o)

        out[f"step_peak_k{k}"] = step_peak_bytes(step, copied, optimizer, x)
        steps[f"k{k}"] = step
    times = interleaved_times(steps, repeats=repeats)
    for label in steps:
        out[f"time_ratio_{label}"] = median_ratio(times, label, "k1")
    out["time_k1_s"] = statistics.median(times["k1"])
    # composition: a remat plan made for the microbatch, int8 storage, 4 microbatches
    plan = remat.Plan.from_checkpoints(32, list(CHECKPOINTS))
    for k in (1, 4):
        copied = copy.deepcopy(model)
        optimizer = torch.optim.Adam(copied.parameters(), lr=1e-4)
        planned = remat.apply(copied, plan, example=x[: len(x) // k])
        for label, storage in (("plan", None), ("plan_int8", "int8")):

            def context(m: nn.Module = copied, storage: str | None = storage) -> Any:
                if storage is None:
                    return count_saved_tensors(m, exclude=(x,))
                return compress_saved_activations(storage, m, exclude=(x,))

            with context() as stats:
                accumulate_step(planned, x, k, chain_loss)
            copied.zero_grad(set_to_none=True)
            out[f"saved_{label}_k{k}"] = stats.peak_bytes

            def step(
                p: nn.Module = planned,
                o: torch.optim.Optimizer = optimizer,
                k: int = k,
                storage: str | None = storage,
                m: nn.Module = copied,
            ) -> None:
                forward = None
                if storage is not None:

                    def forward() -> Any:
                        return compress_saved_activations(storage, m, exclude=(x,))

                accumulate_step(p, x, k, chain_loss, o, forward_context=forward)

            out[f"step_peak_{label}_k{k}"] = step_peak_bytes(step, copied, optimizer, x)
    return out


def part_sparsity() -> dict[str, Any]:
    model = chain()
    params = [p for p in model.parameters()]
    out: dict[str, Any] = {"parameter_bytes_dense": sum(p.nbytes for p in params)}
    masks = magnitude_prune(model, 0.10)
    out["parameter_bytes_pruned"] = sum(p.nbytes for p in model.parameters())
    out["mask_bytes"] = masks.mask_bytes()
    out["zeros_after_pruning"] = sum(int((p == 0).sum()) for p in model.parameters())
    # torch's own pruning: weight_orig (a parameter) and an fp32 weight_mask (a buffer)
    from torch.nn.utils import prune

    reference = chain()
    for module in reference.modules():
        if isinstance(module, nn.Linear):
            prune.l1_unstructured(module, "weight", amount=0.9)
    out["torch_prune_parameter_and_buffer_bytes"] = sum(
        t.nbytes for t in (*reference.parameters(), *reference.buffers())
    )
    torch.manual_seed(0)
    weight = torch.randn(512, 512)
    rows = []
    for density in DENSITIES:
        nnz = round(density * weight.numel())
        kept = weight.abs().flatten().topk(nnz).indices
        sparse = torch.zeros_like(weight).flatten()
        sparse[kept] = weight.flatten()[kept]
        sparse = sparse.view_as(weight)
        row: dict[str, Any] = {"density": density, "nnz": nnz, "dense_bytes": weight.nbytes}
        for label, layout, index in (
            ("csr_int64", "csr", torch.int64),
            ("csr_int32", "csr", torch.int32),
            ("coo", "coo", torch.int64),
        ):
            measured = sparse_storage_bytes(sparse, layout, index)
            formula = predicted_sparse_bytes(weight.shape, nnz, weight.dtype, layout, index)
            assert measured.sparse_bytes == formula.sparse_bytes, (label, density)
            row[f"{label}_bytes"] = measured.sparse_bytes
        rows.append(row)
    out["storage_512x512_fp32"] = rows
    return out


# ---------------------------------------------------------------------- report
def render(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# The memory levers measured (docs/levers.md)",
        "",
        "Generated by `benchmarks/levers.py` (do not edit by hand). "
        f"{env['machine']}, torch {env['torch']}, {env['threads']} thread(s), fp32 parameters, "
        "Adam. Bytes exact; times are medians of interleaved steps, as ratios within one run "
        f"(1-minute load average {env['load_average_at_start']:.1f} at the start on "
        f"{os.cpu_count()} cores; other jobs share the machine, so time ratios move by "
        "tens of percent between runs).",
    ]
    if "storage" in results:
        s = results["storage"]
        lines += [
            "",
            "## Compressed saved activations, fp32 compute",
            "",
            "| workload | storage | saved bytes | ratio | grad error | step peak | time ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in s.items():
            base = row["saved_fp32"]
            for dtype in ("fp32", "bf16", "fp16", "int8"):
                saved = row[f"saved_{dtype}"]
                error = "—" if dtype == "fp32" else f"{row[f'error_{dtype}']:.1e}"
                peak = row.get(f"step_peak_{dtype}")
                ratio = row.get(f"time_ratio_{dtype}")
                lines.append(
                    f"| {name} | {dtype} | {saved:,} | ×{saved / base:.2f} | {error} | "
                    f"{f'{peak:,}' if peak else '—'} | "
                    f"{f'{ratio:.2f}' if ratio is not None else '—'} |"
                )
            lines.append(f"| {name} | fp32 step time | {row['time_fp32_s']:.2f} s | | | | |")
    if "autocast" in results:
        a = results["autocast"]
        lines += [
            "",
            "## Autocast, chain8 (8 x Linear 512 + GELU, batch 256)",
            "",
            "| precision | saved bytes | grad error |",
            "|---|---|---|",
            f"| fp32 | {a['saved_fp32']:,} | — |",
            f"| autocast bf16 | {a['saved_autocast_bf16']:,} | {a['error_autocast_bf16']:.1e} |",
            f"| autocast fp16 (loss scaled) | — | {a['error_autocast_fp16']:.1e} |",
        ]
        for dtype in ("bf16", "fp16", "int8"):
            lines.append(
                f"| fp32 compute, saved {dtype} | {a[f'saved_storage_{dtype}']:,} | "
                f"{a[f'error_storage_{dtype}']:.1e} |"
            )
        lines.append(
            f"| autocast bf16 + saved int8 | {a['saved_autocast_bf16_storage_int8']:,} | "
            f"{a['error_autocast_bf16_storage_int8']:.1e} |"
        )
    if "microbatch" in results:
        m = results["microbatch"]
        lines += [
            "",
            "## Microbatching, chain32",
            "",
            "| k | saved activations (peak) | step peak | time ratio |",
            "|---|---|---|---|",
        ]
        for k in (1, 2, 4, 8):
            lines.append(
                f"| {k} | {m[f'saved_k{k}']:,} | {m[f'step_peak_k{k}']:,} | "
                f"{m[f'time_ratio_k{k}']:.2f} |"
            )
        lines.append(f"\nk = 1 step time: {m['time_k1_s']:.2f} s.")
        lines += [
            "",
            f"## Composition, chain32: plan keeping activations {list(CHECKPOINTS)}",
            "",
            "| | saved activations (peak) | step peak |",
            "|---|---|---|",
            f"| no lever | {m['saved_k1']:,} | {m['step_peak_k1']:,} |",
        ]
        for label, key in (
            ("plan", "plan_k1"),
            ("plan + int8", "plan_int8_k1"),
            ("plan + 4 microbatches", "plan_k4"),
            ("plan + int8 + 4 microbatches", "plan_int8_k4"),
        ):
            lines.append(f"| {label} | {m[f'saved_{key}']:,} | {m[f'step_peak_{key}']:,} |")
    if "sparsity" in results:
        p = results["sparsity"]
        lines += [
            "",
            "## Sparsity, chain32 pruned to density 0.10",
            "",
            "| | bytes |",
            "|---|---|",
            f"| parameters before pruning | {p['parameter_bytes_dense']:,} |",
            f"| parameters after pruning ({p['zeros_after_pruning']:,} zeros) | "
            f"{p['parameter_bytes_pruned']:,} |",
            f"| bool masks | {p['mask_bytes']:,} |",
            "| `torch.nn.utils.prune.l1_unstructured`: parameters + buffers | "
            f"{p['torch_prune_parameter_and_buffer_bytes']:,} |",
            "",
            "One 512 x 512 fp32 weight in sparse storage (measured from torch sparse tensors, "
            "equal to the formula):",
            "",
            "| density | dense | CSR, int64 indices | CSR, int32 indices | COO |",
            "|---|---|---|---|---|",
        ]
        for row in p["storage_512x512_fp32"]:
            cells = [
                f"{row[f'{key}_bytes']:,} (×{row[f'{key}_bytes'] / row['dense_bytes']:.3f})"
                for key in ("csr_int64", "csr_int32", "coo")
            ]
            lines.append(
                f"| {row['density']:.2f} | {row['dense_bytes']:,} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS)
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for levers.json/.md")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite levers.md from levers.json"
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = args.out / "levers.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if args.render:
        (args.out / "levers.md").write_text(render(results))
        return 0
    results["environment"] = {
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg()[0],
    }
    data = batches()
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "autocast": lambda: part_autocast(data),
        "storage": lambda: part_storage(data, args.repeats),
        "microbatch": lambda: part_microbatch(data, args.repeats),
        "sparsity": part_sparsity,
    }
    for part in parts:
        started = time.perf_counter()
        results[part] = runners[part]()
        results["environment"].setdefault("load_average_after", {})[part] = os.getloadavg()[0]
        print(f"{part}: {time.perf_counter() - started:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (args.out / "levers.md").write_text(render(results))
    print(f"wrote {path} and {args.out / 'levers.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
