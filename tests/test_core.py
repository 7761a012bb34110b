"""Chain, Plan and simulate: validation, JSON round-trips and hand-computed answers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat import Chain, ChainSegment, Plan, PlanError, parse_bytes, simulate
from remat.core.graph import Graph


def test_chain_validation_messages() -> None:
    with pytest.raises(ValueError, match="one value per stage"):
        Chain(fwd_time=[1, 1], bwd_time=[1], out_bytes=[1, 1], saved_bytes=[1, 1])
    with pytest.raises(ValueError, match="saved_bytes includes the stage's own output"):
        Chain(fwd_time=[1], bwd_time=[1], out_bytes=[4], saved_bytes=[2])
    with pytest.raises(ValueError, match="at least one stage"):
        Chain(fwd_time=[], bwd_time=[], out_bytes=[], saved_bytes=[])
    with pytest.raises(ValueError, match=">= 0"):
        Chain(fwd_time=[-1], bwd_time=[1], out_bytes=[1], saved_bytes=[1])


def test_chain_json_round_trip_and_schema() -> None:
    chain = Chain.random(7, seed=3)
    again = Chain.from_json(chain.to_json())
    assert again == chain
    assert again.fingerprint == chain.fingerprint
    with pytest.raises(ValueError, match="not a remat chain"):
        Chain.from_json('{"a": 1}')
    bad = chain.to_dict() | {"version": 99}
    import json

    with pytest.raises(ValueError, match="version 99"):
        Chain.from_json(json.dumps(bad))


def test_plan_validation_messages() -> None:
    with pytest.raises(PlanError, match="without gaps"):
        Plan.from_chain_segments((ChainSegment(1, 2), ChainSegment(4, 5)))
    with pytest.raises(PlanError, match="only checkpointed"):
        ChainSegment(1, 2, False, (ChainSegment(1, 2),))
    with pytest.raises(PlanError, match="out of range"):
        Plan.from_checkpoints(5, [5])
    with pytest.raises(PlanError, match="chain has 6 stages"):
        Plan.from_checkpoints(5, [2]).for_chain(Chain.homogeneous(6))
    with pytest.raises(PlanError, match="checkpointed twice"):
        ChainSegment(1, 3, True, (ChainSegment(1, 3, True),))


def test_plan_json_round_trip_nested() -> None:
    inner = (ChainSegment(3, 4, True), ChainSegment(5, 6))
    plan = Plan.from_chain_segments(
        (ChainSegment(1, 2), ChainSegment(3, 6, True, inner), ChainSegment(7, 8, True)), method="x"
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert plan.describe() == "[1-2] (3-6: (3-4) [5-6]) (7-8)"
    assert plan.depth() == 2
    assert Plan.from_json(Plan.none().to_json()).chain_segments(Chain.homogeneous(3)) == (
        ChainSegment(1, 3),
    )
    with pytest.raises(PlanError, match="version 7"):
        Plan.from_json(plan.to_json().replace('"version": 2', '"version": 7'))


def test_plan_rejects_other_chain_fingerprint() -> None:
    from remat import plan as make_plan

    chain = Chain.homogeneous(4)
    p = make_plan(chain, "none")
    with pytest.raises(PlanError, match="re-plan"):
        p.for_chain(Chain.homogeneous(4, out_bytes=2))


def test_simulate_store_all_by_hand() -> None:
    chain = Chain(
        fwd_time=[1, 2, 3],
        bwd_time=[2, 4, 6],
        out_bytes=[10, 20, 30],
        saved_bytes=[15, 20, 40],
        input_bytes=5,
        fwd_overhead_bytes=[0, 7, 0],
        bwd_overhead_bytes=[0, 0, 100],
    )
    sim = simulate(chain, Plan.none())
    # forward: 5 + 15 + 20 + 40 = 80 (transient 7 while stage 2 runs: 5+15+20+7 = 47)
    # loss: +30 (δ3) -> 110; B3: +20 (δ2) + 100 transient -> 230
    assert sim.forward_peak_bytes == 80
    assert sim.peak_bytes == 230
    assert sim.total_time == 18
    assert sim.recompute_time == 0
    assert sim.forward_counts == (1, 1, 1)


def test_simulate_one_checkpoint_by_hand() -> None:
    chain = Chain.homogeneous(4, out_bytes=10, saved_bytes=30)
    plan = Plan.from_checkpoints(chain, [2], store_last=True)  # (1-2) [3-4]
    sim = simulate(chain, plan)
    # forward: a0=10; F_none 1,2 -> a2 kept (10), stage 3,4 stored: +30 +30 -> 80
    # loss: +10 -> 90; B4 +10 -> 100; B3: a2 held by stage 3 and segment... +10 -> δ2
    # recompute (1-2) with δ2 live: a0 10 + δ2 10 + a2 held 10 + 30 + 30 = 90, B2 +10 -> 100
    assert sim.peak_bytes == 100
    assert sim.recompute_time == 2.0
    assert sim.forward_counts == (2, 2, 1, 1)


def test_simulate_every_stage_saves_internal_bytes() -> None:
    chain = Chain.homogeneous(8, out_bytes=10, saved_bytes=50)
    stored = simulate(chain, Plan.none())
    each = simulate(chain, Plan.every_stage())
    assert each.peak_bytes < stored.peak_bytes
    assert each.recompute_time == chain.total_fwd_time()


@given(st.integers(1, 9), st.integers(0, 10_000))
def test_simulate_properties_random_chains(n: int, seed: int) -> None:
    chain = Chain.random(n, seed=seed)
    store = simulate(chain, Plan.none())
    assert store.recompute_time == 0
    assert store.total_time == pytest.approx(chain.total_fwd_time() + chain.total_bwd_time())
    # a lower bound any plan must respect: input + the largest single backward
    floor = max(
        chain.input_bytes + chain.saved_bytes[i] + chain.bwd_overhead_bytes[i] for i in range(n)
    )
    for plan in (Plan.none(), Plan.every_stage(), Plan.from_checkpoints(chain, range(1, n))):
        sim = simulate(chain, plan)
        assert sim.peak_bytes >= floor
        assert sim.timeline[-1].live_bytes == chain.input_bytes  # everything else freed
        assert sum(e.op == "B" for e in sim.timeline) == n


def test_parse_bytes() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError, match="'512MiB'"):
        parse_bytes("lots")


def test_a_frozen_prefix_has_no_backward_in_the_chain_model() -> None:
    base = Chain.homogeneous(4, out_bytes=10)
    data = base.to_dict()
    data.pop("schema"), data.pop("version")
    frozen = Chain(**{**data, "frozen_prefix": 2})
    # store everything, at stage 4's backward: a0, a2 (stage 3's input), a3, a4, δ4, δ3 =
    # 60; a1 was freed once stage 2 read it (no backward keeps it), against 70 without
    assert simulate(base, Plan.none()).peak_bytes == 70
    assert simulate(frozen, Plan.none()).peak_bytes == 60
    # a checkpointed segment that starts in the prefix keeps its input (a1) until its
    # backward: recomputed, a0 a1 a2 a3 a4 δ4 and δ3 are live at stage 4's backward (70)
    plan = Plan.from_chain_segments((ChainSegment(1, 1, False), ChainSegment(2, 4, True)))
    assert simulate(frozen, plan).peak_bytes == 70
    # then 50 (stage 3's: no δ2), 20 (stage 2's: a0 and the segment's a1), 10
    backward = [e.peak_bytes for e in simulate(frozen, plan).timeline if e.op == "B"]
    assert backward == [70, 50, 20, 10]
    assert Chain.from_json(frozen.to_json()) == frozen
    assert frozen.fingerprint != base.fingerprint
    assert "frozen_prefix" not in base.to_dict()  # the default: the file format as before
    with pytest.raises(ValueError, match="frozen_prefix"):
        Chain(**{**data, "frozen_prefix": 5})
    with pytest.raises(ValueError, match="path graph"):
        Graph.from_chain(frozen)
