"""What the call at a compiled refusal's named minimum costs, with the model's last-call record
(NOTE [ A call again at the minimum named ] in remat.auto) and with it forgotten (as before).

A LoRA GPT-2 (``tests/test_compile.py``'s tiny GPT-2, LoRA rank 4 on ``c_attn``), batch 4 x 32,
``aot_eager_decomp_partition``: ``remat.auto`` at a 1-byte budget (refused, naming the least),
then at the least it named; once as a user runs it, once with the record forgotten between the
two calls. Writes ``docs/results/compile/retry/lora-gpt2.json``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/compile_retry.py
"""

import importlib
import json
import time
import warnings
from pathlib import Path

import peft
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import remat
from remat.bench.suites import machine_info

AUTO = importlib.import_module("remat.auto")
COMPILE = {"backend": "aot_eager_decomp_partition"}
OUT = Path("docs/results/compile/retry/lora-gpt2.json")


def lora_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, name, 0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def run(record_kept: bool) -> dict:
    model = lora_gpt2()
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        remat.auto(model, batch, budget=1, compile=COMPILE, loop="loss-only")
        raise AssertionError("a 1-byte budget was accepted")
    except remat.BudgetTooSmallError as err:
        least = err.minimum_bytes
    refused = time.perf_counter()
    if not record_kept:
        model.__dict__[AUTO._LAST_CALL].forget()
    planned, summary = remat.auto(model, batch, budget=least, compile=COMPILE, loop="loss-only")
    done = time.perf_counter()
    return {
        "record": "kept" if record_kept else "forgotten",
        "refusal_seconds": round(refused - start, 1),
        "least_bytes": least,
        "call_at_least_seconds": round(done - refused, 1),
        "plan": remat.execute.chain.describe_compiled(planned.plan),
        "compiled": summary.compiled,
        "predicted_peak_bytes": summary.predicted_peak_bytes,
    }


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    rows = [run(True), run(False)]
    for row in rows:
        print(row, flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": machine_info(), "runs": rows}, indent=2) + "\n")
