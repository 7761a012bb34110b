"""The sohoni suite's rows on tiny models: exact categories, levers that never raise the peak
(except dense sparsity masks, which must), bf16 storage halving saved bytes, combinations at
least as good as each lever alone, and the report files."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from remat import zoo
from remat.bench import sohoni
from remat.bench.suites import machine_info

torch.set_num_threads(1)


def _bench(name: str, batch: int, **options: object) -> sohoni.Workbench:
    torch.manual_seed(0)
    entry = zoo.get(name, batch_size=batch, **options)
    return sohoni.Workbench(name, entry.model, entry.batch, entry.loss_fn, "sgd-momentum")


@pytest.fixture(scope="module")
def wrn_rows() -> list[dict]:
    bench = _bench("wrn-28-2", 8, depth=10, widen=1, image_size=16)
    return sohoni.rows_for(bench, sohoni.levers_for(quick=True), lambda _: None)


def test_rows_have_the_fields_and_no_error(wrn_rows: list[dict]) -> None:
    assert [r["method"] for r in wrn_rows] == [lv.method for lv in sohoni.levers_for(True)]
    for r in wrn_rows:
        assert "error" not in r, r
        for key in ("model", "method", "peak_bytes", "memory_ratio"):
            assert key in r, (key, r)
    assert wrn_rows[0]["memory_ratio"] == 1.0


def test_categories_add_up_to_the_peak(wrn_rows: list[dict]) -> None:
    for r in wrn_rows:
        total = sum(r[f"{c}_bytes"] for c in sohoni.CATEGORIES)
        assert total == r["peak_bytes"], r["method"]
        assert r["memory_ratio"] == r["peak_bytes"] / wrn_rows[0]["peak_bytes"]


def test_single_levers_do_not_raise_the_peak_but_dense_masks_do(wrn_rows: list[dict]) -> None:
    base = wrn_rows[0]["peak_bytes"]
    levers = {lv.method: lv for lv in sohoni.levers_for(True)}
    for r in wrn_rows[1:]:
        lever = levers[r["method"]]
        if lever.levers != 1:
            continue
        if lever.masks:
            # dense masks save nothing and cost one byte per prunable weight entry
            prunable = sum(p.numel() for p in zoo.wide_resnet(10, 1).parameters() if p.dim() > 1)
            assert r["masks_bytes"] == prunable
            assert r["peak_bytes"] >= base + r["masks_bytes"]
        else:
            assert r["peak_bytes"] <= base, r["method"]


def test_microbatching_and_checkpointing_cut_activations(wrn_rows: list[dict]) -> None:
    by = {r["method"]: r for r in wrn_rows}
    acts = [
        by[m]["activations_bytes"] for m in ("fp32 (unplanned)", "microbatch k=2", "microbatch k=4")
    ]
    assert acts[0] > acts[1] > acts[2]
    assert by["checkpoint: least-memory"]["activations_bytes"] < acts[0]
    # the predicted time of a plan is at least the unplanned one's; microbatches add no FLOPs
    assert by["checkpoint: least-memory"]["time_ratio"] >= 1.0
    assert by["checkpoint: one-extra-forward"]["time_ratio"] <= 2.0 + 1e-9
    assert by["microbatch k=4"]["time_ratio"] == pytest.approx(1.0, rel=1e-6)


def test_csr_counts_real_sparse_bytes(wrn_rows: list[dict]) -> None:
    by = {r["method"]: r for r in wrn_rows}
    dense, csr = by["fp32 (unplanned)"], by["sparsity 0.1, CSR (counted)"]
    # at density 0.1 with int32 indices CSR stores about 0.2 of the dense bytes
    assert csr["parameters_bytes"] < 0.35 * dense["parameters_bytes"]
    assert csr["peak_bytes"] == dense["peak_bytes"] - csr["csr_saved_bytes"]


def test_combination_is_at_most_each_lever_alone(wrn_rows: list[dict]) -> None:
    levers = {lv.method: lv for lv in sohoni.levers_for(True)}
    singles = [r for r in wrn_rows if levers[r["method"]].levers == 1]
    combos = [r for r in wrn_rows if r["method"].startswith("all:")]
    assert combos
    for c in combos:
        assert "paper_memory_ratio" in c
        for s in singles:
            assert c["peak_bytes"] <= s["peak_bytes"], (c["method"], s["method"])


def test_bf16_storage_halves_saved_bytes_exactly() -> None:
    bench = _bench("mlp-chain", 32, layers=4, width=64)
    bf16, int8 = (bench.measure(sohoni.Lever(f"saved {d}", saved=d)) for d in ("bf16", "int8"))
    assert bf16["saved_original_bytes"] > 0
    assert 2 * bf16["saved_stored_bytes"] == bf16["saved_original_bytes"]
    # int8: a quarter plus one fp32 scale per compressed tensor
    assert int8["saved_stored_bytes"] > int8["saved_original_bytes"] // 4
    assert int8["saved_stored_bytes"] < int8["saved_original_bytes"] // 4 + 4 * 64


def test_report_files(tmp_path, wrn_rows: list[dict]) -> None:
    result = {
        "suite": "sohoni",
        "quick": True,
        "machine": machine_info(),
        "seconds": 1.0,
        "rows": wrn_rows,
    }
    sohoni.write_report(tmp_path, result)
    text = (tmp_path / "sohoni.md").read_text()
    assert "NOT FOUND" in text and "60.7x" in text
    for r in wrn_rows:
        assert r["method"] in text
    assert (tmp_path / "sohoni-wrn-28-2.png").stat().st_size > 1000


def test_fake_rows_without_the_optimizer_equal_a_fake_step_with_it() -> None:
    """NOTE [ Fake rows without the optimizer ]: with SGD (which fake tensors can step) the
    autocast row equals remat.measure.profile's fake step with the optimizer, category by category."""
    from remat.measure.profile import profile

    bench = _bench("wrn-28-2", 8, depth=10, widen=1, image_size=16)
    bench.measure(sohoni.levers_for(True)[0])  # the real fp32 row first
    row = bench.measure(sohoni.Lever("autocast bf16", compute="bf16"))

    def loss_fn(model: torch.nn.Module, batch: object) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return bench.loss_fn(model, batch)

    direct = profile(bench.model, bench.batch, loss_fn, bench.optimizer, fake=True)
    assert row["peak_bytes"] == direct.peak_bytes
    for c, nbytes in direct.categories.items():
        assert row[f"{c}_bytes"] == nbytes, c
