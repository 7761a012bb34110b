"""What a compiled re-plan for a new input shape costs: a tiny GPT-2 (4 layers, 64 wide,
batch 4) planned by ``remat.auto(compile=True)`` at a budget on length 32, then trained one step
at each of the longer lengths given, one after another; per step the seconds and the one-graph
trials measured (``remat.auto._one_graph_peak`` calls). Writes ``OUT/replans.json``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        .venv/bin/python benchmarks/compile_replans.py --budget 80% --out /tmp/replans
"""

import argparse
import importlib
import json
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import remat
from remat.bench.suites import machine_info

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--budget", default="80%")
parser.add_argument("--lengths", default="34,36,40")
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

AUTO = importlib.import_module("remat.auto")
graphs = [0]
real_peak = AUTO._one_graph_peak


def counted(*a, **k):  # type: ignore[no-untyped-def]
    graphs[0] += 1
    return real_peak(*a, **k)


AUTO._one_graph_peak = counted
torch.manual_seed(0)
config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
model = GPT2LMHeadModel(config)
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 256, (4, 32))
start = time.perf_counter()
planned, summary = remat.auto(
    model,
    {"input_ids": ids, "labels": ids},
    budget=args.budget,
    compile=True,
    optimizer=optimizer,
    loop="loss-only",
)
rows = [
    {
        "length": 32,
        "what": "remat.auto",
        "seconds": time.perf_counter() - start,
        "graphs": graphs[0],
        "plan": AUTO.describe_compiled(planned.plan),
    }
]
print(rows[-1], flush=True)
for length in (int(n) for n in args.lengths.split(",")):
    graphs[0] = 0
    ids = torch.randint(0, 256, (4, length))
    start = time.perf_counter()
    planned(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rows.append(
        {
            "length": length,
            "what": "re-plan and step",
            "seconds": time.perf_counter() - start,
            "graphs": graphs[0],
            "plan": AUTO.describe_compiled(planned.plan),
        }
    )
    print(rows[-1], flush=True)
args.out.mkdir(parents=True, exist_ok=True)
result = {"budget": args.budget, "rows": rows, "machine": machine_info()}
(args.out / "replans.json").write_text(json.dumps(result, indent=1) + "\n")
