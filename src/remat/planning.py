"""The planning layer (pure Python, no torch): :func:`plan`, :func:`pareto`, :func:`compare`
for an activation budget, and :func:`plan_for_step`, **the** search for a plan whose whole
training step fits a budget (chain or module graph), with :func:`step_peak_of` (the whole-step
model of :mod:`remat.core.step` over a plan's simulated timeline). :func:`remat.auto`,
:func:`remat.fit`, :func:`remat.distributed.auto_distributed` and the benchmarks all plan a
whole step through :func:`plan_for_step`; ``remat.api`` re-exports this module's first half.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.graph import Graph
from remat.core.plan import ChainSegment, Plan
from remat.core.simulate import checkpoint_spans, graph_step_peak, simulate_graph
from remat.core.step import StepCosts, StepEvent, measured_step_peak, step_peak
from remat.core.units import format_bytes, parse_bytes
from remat.planners import (
    BudgetTooSmallError,
    available,
    candidates,
    least_peak,
    plan_chain,
    plan_graph,
    stamp,
    sweep,
)

__all__ = [
    "plan",
    "pareto",
    "ParetoPoint",
    "compare",
    "Comparison",
    "plan_for_step",
    "least_step_plan",
    "step_candidates",
    "step_peak_of",
    "measured_step_peak_of",
    "unit_time_least_plan",
    "unit_time_candidates",
    "step_descent",
    "chain_timeline",
    "DEFAULT_METHOD",
]


_UNSET: Any = object()


def _activation_budget(activation_budget: Any, budget: Any, where: str) -> Any:
    """``activation_budget``, or the deprecated ``budget=`` alias (with a DeprecationWarning)."""
    if budget is _UNSET:
        return activation_budget
    if activation_budget is not None:
        raise TypeError(f"{where} got both activation_budget= and its deprecated alias budget=")
    warnings.warn(
        f"{where}(budget=...) is deprecated and will be removed in the next release: use "
        f"{where}(activation_budget=...) (the peak of the activations; budget= of remat.auto "
        "and remat.fit is the whole training step)",
        DeprecationWarning,
        stacklevel=3,
    )
    return budget


def plan(
    chain: Chain,
    method: str = "optimal-time",
    activation_budget: int | float | str | None = None,
    *,
    budget: int | float | str | None = _UNSET,
) -> Plan:
    """Plan ``chain`` with the planner ``method`` under an ``activation_budget``.

    ``activation_budget`` is the peak activation memory that :func:`remat.simulate` predicts
    (bytes, a string such as ``"512MiB"``, or a percentage of the unplanned activation peak such
    as ``"50%"``: :func:`remat.core.units.resolve_budget`), not the whole training step (that is
    ``budget=`` of :func:`remat.auto` and :func:`remat.fit`); ``None`` lets the planner pick its
    default. ``budget=`` is its deprecated alias (a DeprecationWarning). The returned plan
    carries its simulated peak and time and the chain's fingerprint. Raises
    :class:`~remat.planners.BudgetTooSmallError` (naming the minimum) when nothing fits.

    >>> from remat import Chain
    >>> p = plan(Chain.homogeneous(16), method="chen-sqrt")
    >>> p.method, p.predicted_peak_bytes is not None
    ('chen-sqrt', True)
    """
    activation_budget = _activation_budget(activation_budget, budget, "remat.plan")
    if not isinstance(chain, Chain):
        if isinstance(chain, Graph):  # the graph planners: reforward, checkmate-milp, ...
            return plan_graph(chain, method, activation_budget)  # type: ignore[return-value]
        raise TypeError(f"plan takes a Chain or a Graph, got {type(chain).__name__}")
    return plan_chain(chain, method, activation_budget)


@dataclass(frozen=True)
class ParetoPoint:
    """One plan on the memory–time plane."""

    method: str
    """Planner name."""
    budget_bytes: int | None
    """Budget the planner was given (None: its default)."""
    peak_bytes: int
    """Simulated peak activation bytes."""
    total_time: float
    """Simulated forward + recomputation + backward time."""
    plan: Plan
    """The plan itself."""


def pareto(
    chain: Chain, methods: list[str] | None = None, num_budgets: int = 12
) -> dict[str, list[ParetoPoint]]:
    """Each planner's points on the memory–time plane over a sweep of budgets.

    Budgets run evenly from the smallest peak any planner reached to the unplanned peak. Budget
    planners that cannot meet a budget simply have no point there. Returns, per method, its
    points sorted by peak with dominated points removed (that method's frontier).
    """
    methods = methods or available()
    top = simulate(chain, Plan.none(chain)).peak_bytes
    floor_points: list[ParetoPoint] = []
    for method in methods:
        try:
            p = plan(chain, method)
        except BudgetTooSmallError:
            continue
        floor_points.append(
            ParetoPoint(method, None, p.predicted_peak_bytes or 0, p.predicted_time or 0.0, p)
        )
    low = min((pt.peak_bytes for pt in floor_points), default=top)
    budgets = sorted(
        {int(low + (top - low) * k / max(1, num_budgets - 1)) for k in range(num_budgets)}
    )
    result: dict[str, list[ParetoPoint]] = {}
    for method in methods:
        points = [pt for pt in floor_points if pt.method == method]
        for b, p in zip(budgets, sweep(chain, method, budgets), strict=True):
            if p is not None:
                points.append(
                    ParetoPoint(method, b, p.predicted_peak_bytes or 0, p.predicted_time or 0.0, p)
                )
        result[method] = _frontier(points)
    return result


def _frontier(points: list[ParetoPoint]) -> list[ParetoPoint]:
    best: list[ParetoPoint] = []
    for pt in sorted(points, key=lambda q: (q.peak_bytes, q.total_time)):
        if not best or pt.total_time < best[-1].total_time:
            best.append(pt)
    return best


@dataclass(frozen=True)
class Comparison:
    """One planner's answer for a chain, for side-by-side tables."""

    method: str
    """Planner name."""
    peak_bytes: int | None
    """Simulated peak activation bytes (None when the planner failed)."""
    total_time: float | None
    """Simulated total time (None when the planner failed)."""
    recompute_time: float | None
    """Simulated recomputation time."""
    plan_seconds: float
    """Wall time the planner took."""
    plan: Plan | None
    """The plan (None when the planner failed)."""
    error: str = ""
    """Why the planner gave no plan (e.g. the budget is below its minimum)."""


def compare(
    chain: Chain,
    methods: list[str] | None = None,
    activation_budget: int | float | str | None = None,
    *,
    budget: int | float | str | None = _UNSET,
) -> list[Comparison]:
    """Run every planner (or ``methods``) on ``chain`` at ``activation_budget``; one row each
    (``budget=``: its deprecated alias)."""
    import time

    activation_budget = _activation_budget(activation_budget, budget, "remat.compare")
    rows = []
    for method in methods or available():
        start = time.perf_counter()
        try:
            p = plan(chain, method, activation_budget)
        except BudgetTooSmallError as err:
            rows.append(
                Comparison(method, None, None, None, time.perf_counter() - start, None, str(err))
            )
            continue
        elapsed = time.perf_counter() - start
        sim = simulate(chain, p)
        rows.append(
            Comparison(method, sim.peak_bytes, sim.total_time, sim.recompute_time, elapsed, p)
        )
    return rows


# ---------------------------------------------------------------------- the whole step
DEFAULT_METHOD = {"chain": "optimal-time", "graph": "checkmate-milp"}
"""The planner :func:`plan_for_step` uses when given none, per structure."""

BISECTION_RESOLUTION = 4096
"""The budget search bisects the activation budget down to 1/4096 of its upper end."""
BISECTION_STEPS = 40
"""... and at most this many times."""
DESCENT_STEPS = 2000
"""The most whole-step peaks :func:`step_descent` evaluates for one chain."""

Structure = Chain | Graph


def chain_timeline(chain: Chain, plan: Plan) -> list[StepEvent]:
    """The simulated timeline of ``plan`` as :class:`remat.core.step.StepEvent` (0-based stages)."""
    return [
        StepEvent(e.op == "B", e.stage - 1, e.peak_bytes, e.live_bytes)
        for e in simulate(chain, plan).timeline
    ]


def step_peak_of(structure: Structure, plan: Plan, costs: StepCosts) -> int:
    """The whole training step's peak of ``plan`` (:func:`remat.core.step.step_peak` over its
    simulated timeline on a chain or a module graph), with ``costs.checkpoint_state_bytes``
    per checkpointed segment from the top-level segment's forward to its backward
    (:func:`remat.core.simulate.checkpoint_spans`; its nested segments counted with it, an
    upper bound: a nested one only exists while its parent recomputes). A chain and its path
    graph give the same number for every plan (the chain's plan read as its graph plan)."""
    if isinstance(structure, Graph):
        return graph_step_peak(structure, plan, costs)  # type: ignore[arg-type]
    if costs.checkpoint_states != "per-segment":
        raise ValueError(
            f"checkpoint_states={costs.checkpoint_states!r} is the graph executor's; a chain's "
            "executor (torch's checkpoint) keeps one state per segment: 'per-segment'"
        )
    return step_peak(*_chain_step(structure, plan, costs))


def _chain_step(
    chain: Chain, plan: Plan, costs: StepCosts
) -> tuple[list[StepEvent], StepCosts, tuple[tuple[int, int], ...]]:
    """``(timeline, costs, segments)`` of :func:`remat.core.step.step_peak` for ``plan`` on
    ``chain`` (the checkpointed segments, :func:`remat.core.simulate.checkpoint_spans`,
    where ``costs`` keeps a state per segment)."""
    plan = plan.for_chain(chain)
    spans = (
        tuple(checkpoint_spans(plan, copy_bytes=costs.buffer_copy_bytes))
        if costs.checkpoint_state_bytes or any(costs.buffer_copy_bytes)
        else ()
    )
    return chain_timeline(chain, plan), costs, spans


def measured_step_peak_of(
    chain: Chain,
    plan: Plan,
    costs: StepCosts,
    measured_bytes: int,
    measured_costs: StepCosts,
    measured_chain: Chain | None = None,
) -> int:
    """The whole training step's peak of ``plan`` on ``chain`` with ``costs``, where its step
    with ``measured_costs`` (no optimizer: the one compiled graph :func:`remat.auto` measures)
    measured ``measured_bytes`` (:func:`remat.core.step.measured_step_peak`; ``measured_chain``:
    the chain that step was simulated on, default ``chain``). :func:`step_peak_of` moved by
    what was measured above or below the simulation, the optimizer step kept."""
    timeline, _, spans = _chain_step(chain, plan, costs)
    measured_chain = measured_chain or chain
    measured_timeline = chain_timeline(measured_chain, plan.for_chain(measured_chain))
    return measured_step_peak(
        timeline, costs, measured_bytes, measured_costs, measured_timeline, spans
    )


def plan_for_step(
    structure: Structure,
    costs: StepCosts,
    budget: int | str | None,
    method: str | None = None,
) -> Plan:
    """The plan of ``structure`` (a :class:`~remat.Chain` or a module
    :class:`~remat.graphs.Graph`) whose whole training step fits ``budget`` bytes
    (:func:`step_peak_of` with ``costs``), the fastest (simulated time) of the plans weighed.

    ``method`` is the planner (default :data:`DEFAULT_METHOD`: ``optimal-time`` for a chain,
    ``checkmate-milp`` for a graph). The plans weighed:

    1. the planner's plan for the activation budget left beside what the step always holds
       (``budget`` minus :attr:`~remat.core.step.StepCosts.held_bytes`, minus every gradient when
       they are all live): when its step fits it is the answer (no fitting plan keeps more
       activations);
    2. its plan for the safe reading (every gradient counted live at the activation peak);
       for a chain, a bisection between the two (the step's peak is
       not a monotone function of the activation peak: a gradient made early in the backward
       can meet a recomputation); a graph planner below its least peak plans at that least;
    3. :func:`step_candidates`: the planner's candidates (chain: :func:`remat.planners.
       candidates`) and the floor (:func:`least_step_plan`'s plans).

    The fastest that fits is returned (ties: the first in that order). A budget below every
    plan raises :class:`~remat.planners.BudgetTooSmallError` (``kind="whole-step"``) naming the
    least step peak of the floor (:func:`least_step_plan`): passed back as the budget it is
    accepted, it never exceeds the unplanned step's peak, and a budget that one
    of :func:`step_candidates` meets is never refused.

    ``budget=None``: the plan with the least activation peak whose simulated time is at most
    the unplanned time plus one forward (chain: a bisection over ``method``'s plans; graph:
    Re-forwarding's least-memory plan, else store everything).

    Pure and deterministic: same inputs, same plan.
    """
    space = _space(structure, costs, method)
    if budget is None:
        return space.least_memory_within_one_forward()
    return _search(space, parse_bytes(budget))


def least_step_plan(
    structure: Structure, costs: StepCosts, method: str | None = None
) -> tuple[Plan, int]:
    """The floor's plan with the least whole-step peak and that peak: a budget
    :func:`plan_for_step` always accepts. The floor does not depend on the budget nor on the
    measured times: a chain's is ``method``'s least-activation plan and its candidates made on
    unit times (the fewest recomputations: the minimum does not move with timing noise,
    :func:`unit_time_candidates`), its least-activation plan on times weighted by each stage's
    parameter gradients (:func:`weighted_time_least_plan`) and store-everything;
    a graph's is the planner's plan at the least activation peak it names, Re-forwarding's
    least-memory plan and store-everything."""
    space = _space(structure, costs, method)
    return min(((p, space.peak(p)) for p in space.floor()), key=lambda pp: pp[1])


def step_candidates(
    structure: Structure, costs: StepCosts, method: str | None = None
) -> list[Plan]:
    """The budget-independent plans :func:`plan_for_step` always weighs (step 3 there): a
    budget that one of them meets is never refused."""
    space = _space(structure, costs, method)
    return [*space.candidates(), *space.floor()]


KEPT = 8
"""How many searches (:class:`_Space`: one structure, step costs and planner) and step
descents the planning layer keeps, so that the next call with equal inputs reuses them."""


def _hashable(*parts: Any) -> bool:
    try:
        hash(parts)
    except TypeError:  # (inputs holding something unhashable are searched afresh)
        return False
    return True


def _space(structure: Structure, costs: StepCosts, method: str | None) -> _Space:
    """The search over ``structure``'s plans with ``costs`` and ``method``: the one an earlier
    call with equal inputs made (the :data:`KEPT` latest are kept), else a new one.

    The search is pure, so a kept one gives what a new one would, without making its plans
    again: the floor (a chain's unit-time plans and the step descent from them, a graph's
    least-peak MILP) and the planner's plan at each activation budget the bisection tried.
    :func:`remat.auto` and :func:`remat.fit` plan one captured structure at many budgets (a
    budget lowered by what a compiled graph measured over, a re-plan, a 1-byte refusal then the
    named minimum); a test re-planning a 12-stage chain 35 times spent 28 s of its 86 s in the
    descent it made anew each time."""
    if not _hashable(structure, costs):
        return _Space(structure, costs, method)
    kind = "chain" if isinstance(structure, Chain) else "graph"
    return _kept_space(structure, costs, method or DEFAULT_METHOD[kind])


@functools.lru_cache(maxsize=KEPT)
def _kept_space(structure: Structure, costs: StepCosts, method: str) -> _Space:
    return _Space(structure, costs, method)


class _Space:
    """The plans of one structure and planner, their step peaks and times (cached)."""

    def __init__(self, structure: Structure, costs: StepCosts, method: str | None) -> None:
        if not isinstance(structure, Chain | Graph):
            raise TypeError(
                f"plan_for_step takes a Chain or a Graph, got {type(structure).__name__}"
            )
        self.structure = structure
        self.costs = costs
        self.is_chain = isinstance(structure, Chain)
        self.method = method or DEFAULT_METHOD["chain" if self.is_chain else "graph"]
        self._peaks: dict[int, tuple[Plan, int]] = {}
        self._floor: list[Plan] | None = None
        self._at: dict[int, Plan | None] = {}

    # ------------------------------------------------------------------ costs
    def peak(self, p: Plan) -> int:
        if id(p) not in self._peaks:  # the plan is kept with its peak, so its id stays unique
            self._peaks[id(p)] = (p, step_peak_of(self.structure, p, self.costs))
        return self._peaks[id(p)][1]

    @staticmethod
    def time(p: Plan) -> float:
        return p.predicted_time or 0.0

    # ------------------------------------------------------------------ plans
    def plan_at(self, activation_budget: int) -> Plan | None:
        """The planner's plan for ``activation_budget``; below its least peak: None for a chain
        planner, a graph planner's least-peak plan (:meth:`graph_least`)."""
        if activation_budget <= 0:
            return None
        if activation_budget not in self._at:
            self._at[activation_budget] = self._plan_at(activation_budget)
        return self._at[activation_budget]

    def _plan_at(self, activation_budget: int) -> Plan | None:
        if self.is_chain:
            try:
                return plan_chain(self.structure, self.method, activation_budget)  # type: ignore[arg-type]
            except BudgetTooSmallError:
                return None
        try:
            return plan_graph(self.structure, self.method, activation_budget)  # type: ignore[arg-type]
        except BudgetTooSmallError:
            return self.graph_least()

    def graph_least(self) -> Plan | None:
        """A graph planner's plan at the least activation peak it names, chosen on unit times
        (:func:`_on_unit_times`, as :func:`unit_time_least_plan` for a chain: among the
        plans at that peak, which one the measured times pick moved the whole step's least by
        12 KB between two captures of T5 with equal bytes), stamped with the graph's simulated
        cost; None when it names none it can meet."""
        if not hasattr(self, "_graph_least"):
            graph: Graph = self.structure  # type: ignore[assignment]
            unit = _on_unit_times(graph)
            found: Plan | None = None
            try:
                found = plan_graph(unit, self.method, 1)
            except BudgetTooSmallError as err:
                try:
                    found = plan_graph(unit, self.method, err.minimum_bytes)
                except BudgetTooSmallError:
                    found = None
            if found is not None:
                found = replace(found, fingerprint=None)
                sim = simulate_graph(graph, found)
                found = stamp(found, sim, found.method, None).made_for(graph)
            self._graph_least = found
        return self._graph_least

    def candidates(self) -> list[Plan]:
        if self.is_chain:
            return candidates(self.structure, self.method)  # type: ignore[arg-type]
        return []

    def floor(self) -> list[Plan]:
        if self._floor is None:
            if self.is_chain:
                chain: Chain = self.structure  # type: ignore[assignment]
                weighted = weighted_time_least_plan(chain, self.costs.grad_bytes, self.method)
                base: list[Plan] = [
                    unit_time_least_plan(chain, self.method),
                    plan_chain(chain, "none"),
                    *unit_time_candidates(chain, self.method),
                    *([weighted] if weighted is not None else []),
                ]
                lower = step_descent(chain, self.costs, base, self.method)
                self._floor = [*base, *([lower] if lower is not None else [])]
            else:
                graph: Graph = self.structure  # type: ignore[assignment]
                least = self.graph_least()
                base = [
                    *([least] if least is not None else []),
                    plan_graph(graph, "reforward"),
                    plan_graph(graph, "none"),
                ]
                lower = step_descent(graph, self.costs, base, self.method)
                self._floor = [*base, *([lower] if lower is not None else [])]
        return self._floor

    # ------------------------------------------------------------------ budget=None
    def least_memory_within_one_forward(self) -> Plan:
        if not self.is_chain:
            graph: Graph = self.structure  # type: ignore[assignment]
            limit = simulate_graph(graph, Plan.none()).total_time + sum(
                node.fwd_time for node in graph.nodes
            )
            least = plan_graph(graph, "reforward")
            return least if self.time(least) <= limit else plan_graph(graph, "none")
        chain: Chain = self.structure  # type: ignore[assignment]
        store_all = plan_chain(chain, "none")
        limit = self.time(store_all) + chain.total_fwd_time()
        best = [plan_chain(chain, self.method, store_all.predicted_peak_bytes)]

        def within(activation_budget: int) -> bool:
            found = self.plan_at(activation_budget)
            if found is None or self.time(found) > limit:
                return False
            best.append(found)
            return True

        _bisect(best[0].predicted_peak_bytes or 0, 0, within)
        return best[-1]


def _search(space: _Space, total: int) -> Plan:
    """:func:`plan_for_step` with a budget of ``total`` bytes."""
    costs = space.costs
    if costs.optimizer_phase_bytes > total:
        raise _too_small(space, total)
    grads = sum(costs.grad_bytes)
    hi = total - costs.held_bytes - (grads if costs.grads_live else 0)
    first = space.plan_at(hi)
    if first is not None and space.peak(first) <= total:
        return first
    fitting: list[Plan] = []

    def fits(activation_budget: int) -> bool:
        found = space.plan_at(activation_budget)
        if found is None or space.peak(found) > total:
            return False
        fitting.append(found)
        return True

    # the safe reading: every gradient live at the activation peak
    lo = total - costs.fixed_bytes
    lo -= max(costs.grad_bytes, default=0) if costs.grads_live else 0
    if lo < hi:
        fits(lo)
        if space.is_chain:  # a graph planner (an MILP) is too slow to bisect
            _bisect(max(lo, 0), hi, fits)
    fitting += [p for p in [*space.candidates(), *space.floor()] if space.peak(p) <= total]
    if not fitting:
        raise _too_small(space, total)
    return min(fitting, key=space.time)


def _bisect(good: int, bad: int, test: Callable[[int], bool]) -> None:
    """Bisect between ``good`` and ``bad`` (either order) with ``test`` (True: the new good
    end) down to :data:`BISECTION_RESOLUTION` of the larger end, at most
    :data:`BISECTION_STEPS` times; ``test`` records what it finds. The one bisection of the
    budget search (largest fitting activation budget) and of ``budget=None`` (least activation
    budget within one extra forward)."""
    for _ in range(BISECTION_STEPS):
        if abs(good - bad) <= max(1, max(good, bad) // BISECTION_RESOLUTION):
            return
        mid = (good + bad) // 2
        if test(mid):
            good = mid
        else:
            bad = mid


def _on_unit_times(structure: Structure) -> Any:
    """``structure`` (a chain or a graph) with every forward and backward time 1: what a least
    plan is chosen on, so that timing noise does not move it (the fewest recomputations)."""
    if isinstance(structure, Chain):
        return replace(structure, fwd_time=(1.0,) * structure.n, bwd_time=(1.0,) * structure.n)
    nodes = tuple(replace(n, fwd_time=1.0, bwd_time=1.0) for n in structure.nodes)
    return replace(structure, nodes=nodes)


def unit_time_least_plan(chain: Chain, method: str) -> Plan:
    """``method``'s least-activation plan chosen on unit times (the fewest recomputations),
    stamped with ``chain``'s simulated cost: it, and the minimum a budget search names, do not
    move with timing noise."""
    return _least_on(_on_unit_times(chain), chain, method)


def weighted_time_least_plan(chain: Chain, weights: Sequence[int], method: str) -> Plan | None:
    """``method``'s least-activation plan chosen on times made from ``weights`` (a stage's
    parameter-gradient bytes: forward 1 + w / max w, backward 1 + 2 w / max w), stamped with
    ``chain``'s simulated cost; None where every weight is 0 (unit times).

    Several plans reach the least activation peak, and their whole steps differ by the
    gradients made before the peak. Unit times pick one among them blindly. The measured times
    pick the one that recomputes the cheap stages; so do these weighted times (a layer with
    weights multiplies, one without is pointwise), which, like unit times, do not move with
    timing noise. On an MLP of Linear and GELU stages its step peaks 5,693,208 B, one layer's
    gradient below the unit-time plan's 5,956,376 B: remat named the latter as its minimum,
    and accepted budgets below it only where the measured times happened to pick the other."""
    top = max(weights, default=0)
    if top <= 0 or len(weights) != chain.n:
        return None
    proxy = replace(
        chain,
        fwd_time=tuple(1.0 + w / top for w in weights),
        bwd_time=tuple(1.0 + 2.0 * w / top for w in weights),
    )
    return _least_on(proxy, chain, method)


def _least_on(timed: Chain, chain: Chain, method: str) -> Plan:
    """``method``'s least-activation plan of ``timed`` (``chain`` with other times), stamped
    with ``chain``'s simulated cost."""
    least = plan_chain(timed, method, least_peak(timed, method))
    return _for_chain(replace(least, params={**least.params, "least_memory": True}), chain, method)


def unit_time_candidates(chain: Chain, method: str) -> list[Plan]:
    """``method``'s candidates (:func:`remat.planners.candidates`) made on unit times, stamped
    with ``chain``'s simulated costs: plans of the floor that do not move with timing noise.
    The least-activation plan need not have the least whole-step peak (a stage's gradients
    made early in the backward meet what it recomputes): on a ResNet with a frozen stem one of
    these measured 60,647,328 B where the least-activation plan's step was 61,567,904 B, and
    remat named the latter as its minimum while it accepted budgets down to the former."""
    return [_for_chain(p, chain, method) for p in candidates(_on_unit_times(chain), method)]


def step_descent(
    structure: Structure,
    costs: StepCosts,
    starts: list[Plan],
    method: str,
    steps: int = DESCENT_STEPS,
) -> Plan | None:
    """A flat plan whose whole step (:func:`step_peak_of` with ``costs``) peaks lower than every
    plan of ``starts``, or None: a descent on the step's peak from the top level of each start
    (nested sub-plans dropped), moving to the first neighbour that lowers it until none does,
    or ``steps`` peaks were evaluated. Deterministic, and it reads no time. A chain plan's
    neighbours: a segment's checkpoint flag toggled, a segment split in two, two neighbours
    merged; a graph plan's: a node taken out of its segment (stored), a node added or moved to
    a segment it reads or feeds, a stored node made a segment of its own, a segment dropped or
    merged with one it reads or feeds.

    The planners minimise the activation peak (and the time under it); the step's peak also
    holds the parameter gradients made so far, so a stage whose gradients appear early in the
    backward can make the least-activation plan's step peak above another plan's. On a ResNet
    with a frozen stem the floor's best step peaked at 60,647,328 B; checkpointing its two
    middle stages alone (what checkpointing every block does there) peaks at 60,555,192 B. On
    Hugging Face T5 the MILP's least-activation plan steps at 531,980 B, and the same plan with
    the encoder's final layer norm recomputed too at 522,120 B.
    Stamped with ``method`` and ``params["step_descent"]``.

    As it reads no time, the walk is kept (:func:`_walk`) by the structure's bytes: two
    captures of one model differ in their measured times only, and a 116-node graph's walk took
    12 s."""
    if isinstance(structure, Chain):
        n = structure.n
        chain_starts = [
            tuple((s.start, s.stop, s.checkpoint) for s in p.chain_segments(n)) for p in starts
        ]
        best = _walk(structure, costs, chain_starts, steps)
        if best is None:
            return None
        found = replace(_flat(best), method=method, params={"step_descent": True})
        return stamp(found, simulate(structure, found), method, None).made_for(structure)
    graph = structure
    graph_starts = [tuple(seg.nodes for seg in p.segments) for p in starts]  # type: ignore[union-attr]

    found_segs = _walk(graph, costs, graph_starts, steps)
    if found_segs is None:
        return None
    plan = Plan.from_segments(found_segs, method=method, params={"step_descent": True})
    sim = simulate_graph(graph, plan)
    return stamp(plan, sim, method, None).made_for(graph)


def _walk(structure: Structure, costs: StepCosts, starts: list[Any], steps: int) -> Any:
    """:func:`_descend` from ``starts`` over ``structure``'s flat plans (chain segments or graph
    segments) on its whole-step peaks, kept by the structure on unit times (the walk reads no
    time); made afresh where an input is unhashable."""
    untimed, kept = _on_unit_times(structure), tuple(starts)
    if not _hashable(untimed, costs, kept):
        return _untimed_walk.__wrapped__(untimed, costs, kept, steps)
    return _untimed_walk(untimed, costs, kept, steps)


@functools.lru_cache(maxsize=KEPT)
def _untimed_walk(untimed: Structure, costs: StepCosts, starts: tuple[Any, ...], steps: int) -> Any:
    if isinstance(untimed, Chain):
        return _descend(
            list(starts),
            _chain_neighbours,
            lambda s: step_peak_of(untimed, _flat(s), costs),
            steps,
        )
    graph = untimed

    def graph_peak(segs: tuple[tuple[int, ...], ...]) -> int:
        return step_peak_of(graph, Plan.from_segments(segs), costs)

    return _descend(list(starts), lambda s: _graph_neighbours(graph, s), graph_peak, steps)


def _descend(
    starts: list[Any],
    neighbours: Callable[[Any], list[Any]],
    peak_of: Callable[[Any], int],
    steps: int,
) -> Any:
    """:func:`step_descent`'s walk over hashable plan states: the best state found whose peak
    is below every start's, or None."""
    peaks: dict[Any, int] = {}

    def peak(state: Any) -> int:
        if state not in peaks:
            peaks[state] = peak_of(state)
        return peaks[state]

    target = min(peak(s) for s in starts)
    best = None
    for here in starts:
        moved = True
        while moved and len(peaks) < steps:
            moved = False
            for near in neighbours(here):
                if len(peaks) >= steps:
                    break
                if peak(near) < peak(here):
                    here, moved = near, True
                    break
        if peak(here) < target and (best is None or peak(here) < peak(best)):
            best = here
    return best


def _graph_neighbours(
    graph: Graph, segs: tuple[tuple[int, ...], ...]
) -> list[tuple[tuple[int, ...], ...]]:
    """The flat graph plans one move from ``segs`` (see :func:`step_descent`)."""

    def canon(groups: list[set[int]]) -> tuple[tuple[int, ...], ...]:
        return tuple(sorted(tuple(sorted(g)) for g in groups if g))

    groups = [set(g) for g in segs]
    where = {v: k for k, g in enumerate(groups) for v in g}
    readers: dict[int, list[int]] = {}
    for v, node in enumerate(graph.nodes):
        for u in node.inputs:
            readers.setdefault(u, []).append(v)

    def adjacent(nodes: Iterable[int]) -> list[int]:
        """The segments that read from or feed ``nodes``, in order."""
        ends = {u for v in nodes for u in (*graph.nodes[v].inputs, *readers.get(v, ()))}
        return sorted({where[u] for u in ends if u in where})

    out = []
    for v in range(graph.n):
        k = where.get(v)
        if k is None:
            for j in adjacent([v]):  # recomputed with a segment it reads or feeds
                out.append(canon([g | {v} if i == j else g for i, g in enumerate(groups)]))
            out.append(canon([*groups, {v}]))
        elif len(groups[k]) > 1:  # stored instead
            out.append(canon([g - {v} if i == k else g for i, g in enumerate(groups)]))
    for v, k in sorted(where.items()):  # moved to a segment it reads or feeds
        for j in adjacent([v]):
            if j != k:
                out.append(
                    canon(
                        [
                            g - {v} if i == k else g | {v} if i == j else g
                            for i, g in enumerate(groups)
                        ]
                    )
                )
    for k, group in enumerate(groups):  # a segment dropped, or merged with one it reads or feeds
        out.append(canon([g for i, g in enumerate(groups) if i != k]))
        for j in adjacent(group):
            if j > k:
                out.append(
                    canon([g | groups[j] if i == k else g for i, g in enumerate(groups) if i != j])
                )
    return out


def _flat(segs: tuple[tuple[int, int, bool], ...]) -> Plan:
    return Plan.from_chain_segments(tuple(ChainSegment(a, b, f) for a, b, f in segs))


def _chain_neighbours(
    segs: tuple[tuple[int, int, bool], ...],
) -> list[tuple[tuple[int, int, bool], ...]]:
    """The flat plans one move from ``segs``: a flag toggled, a segment split, two merged."""
    out = []
    for j, (a, b, f) in enumerate(segs):
        out.append((*segs[:j], (a, b, not f), *segs[j + 1 :]))
    for j, (a, b, f) in enumerate(segs):
        for k in range(a, b):
            out.append((*segs[:j], (a, k, f), (k + 1, b, f), *segs[j + 1 :]))
    for j in range(len(segs) - 1):
        (a, _, f), (_, b, g) = segs[j], segs[j + 1]
        out.append((*segs[:j], (a, b, f or g), *segs[j + 2 :]))
    return out


def _for_chain(plan: Plan, chain: Chain, method: str) -> Plan:
    """A plan made on another reading of ``chain`` (unit times), stamped with its costs."""
    plan = replace(plan, fingerprint=None, stages_fingerprint=None).for_chain(chain)
    return stamp(plan, simulate(chain, plan), method, None).made_for(chain)


def _too_small(space: _Space, total: int) -> BudgetTooSmallError:
    """The refusal of ``total``: the least step peak of the floor (passed back, it is
    accepted), and why."""
    costs = space.costs
    minimum = min(space.peak(p) for p in space.floor())
    if costs.optimizer_step_bytes and costs.optimizer_phase_bytes > total:
        detail = (
            f"the optimizer step alone needs {format_bytes(costs.optimizer_phase_bytes)} "
            "(parameters, gradients, buffers, state, the batch and "
            f"{format_bytes(costs.optimizer_step_bytes)} of its own temporaries); shrink them "
            "with the levers (precision, sparsity) or use an optimizer with foreach=False"
        )
    else:
        output = (
            f" and the output the loop holds {format_bytes(costs.output_held_bytes)}"
            if costs.output_held_bytes
            else ""
        )
        detail = (
            f"parameters, buffers and optimizer state take {format_bytes(costs.persistent_bytes)}"
            f", parameter gradients {format_bytes(sum(costs.grad_bytes))}{output}; shrink them "
            "with the levers (precision, sparsity) first"
        )
    return BudgetTooSmallError(total, minimum, space.method, detail, kind="whole-step")
