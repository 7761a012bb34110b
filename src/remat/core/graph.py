"""The cost model of an arbitrary network: a :class:`Graph` of nodes (modules or ops).

A graph is a DAG whose nodes are listed in a topological order (every input of node ``v`` has
an index below ``v``). Node ``v`` is one operation: it reads the outputs of the nodes in
``inputs`` and produces one output tensor (several output tensors are summed into one). Its
costs follow the same convention as the chain model (:mod:`remat.core.chain`, ``docs/cost-model.md``):

* ``fwd_time``, ``bwd_time``: seconds (or FLOPs, ``Graph.time_unit``) of one forward and of the
  backward of the node.
* ``out_bytes``: bytes of the output: what keeping the node's output costs, and the size of the
  gradient that flows back into it.
* ``saved_bytes``: what autograd keeps for the node's backward when it runs with grad,
  **including its own output** and **excluding its inputs** (which are other nodes' outputs,
  accounted there). Hence ``saved_bytes >= out_bytes``.
* ``saved_inputs``: which inputs the backward reads (autograd saves them); ``None`` (the
  default, and the chain model's assumption) means all of them. ``add`` and ``cat`` save no
  input, ``relu`` saves its output only, a convolution saves its input.
* ``fwd_overhead_bytes``, ``bwd_overhead_bytes``: transient bytes during the forward / during
  the backward beyond the input gradients it produces. ``bwd_overhead_bytes`` is **negative**
  when the backward frees part of what it holds before its peak (autograd frees each op's saved
  tensors and the output gradient as soon as they are used), as in measured chains
  (:mod:`remat.core.chain`); never below ``-(held + out_bytes)``, ``held`` being what the node's
  backward holds of its own (``saved_bytes``, or ``residual_bytes`` without ``keeps_output``).

**The graph input is not a node.** ``Graph.input_bytes`` counts it; it is live for the whole
step, gets no gradient, and reads of it are not recorded: a node with ``inputs == ()`` is a
source that reads only the graph input (or nothing). **The outputs are the sinks**: the nodes
no other node reads. The loss reads them and produces one gradient per sink. A tensor that is
both returned and used later is modelled with an extra zero-cost identity sink.

A path graph is exactly a :class:`~remat.core.chain.Chain` (:meth:`Graph.from_chain`, back with
:meth:`Graph.to_chain`), has the chain's fingerprint (so a plan made for the chain is checked
against its path graph and back), and simulates exactly like it (``tests/test_one_simulator.py``).

Example:
    >>> g = Graph(
    ...     nodes=[
    ...         Node("conv", (), 1.0, 2.0, out_bytes=8, saved_bytes=8),
    ...         Node("relu", (0,), 0.1, 0.1, out_bytes=8, saved_bytes=8, saved_inputs=()),
    ...         Node("add", (0, 1), 0.1, 0.1, out_bytes=8, saved_bytes=8, saved_inputs=()),
    ...     ],
    ...     input_bytes=8,
    ... )
    >>> g.n, g.sinks, g.consumers(0)
    (3, (2,), (1, 2))
    >>> Graph.from_json(g.to_json()) == g
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from remat.core.chain import Chain
from remat.core.schema import read_schema

__all__ = ["Node", "Constant", "Graph", "GRAPH_SCHEMA_VERSION"]

GRAPH_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Node:
    """One node of a :class:`Graph`: an operation and its output tensor (see module docstring)."""

    name: str
    """Unique name for reports (a module FQN or an op name such as ``layer1.0.conv1``)."""
    inputs: tuple[int, ...]
    """Indices of the nodes whose outputs this node reads, each below this node's index."""
    fwd_time: float
    """Time of one forward of the node, seconds (or FLOPs, see ``Graph.time_unit``)."""
    bwd_time: float
    """Time of the node's backward, same unit."""
    out_bytes: int
    """Bytes of the node's output (also the size of its gradient)."""
    saved_bytes: int
    """Bytes autograd keeps for the backward, own output included, inputs excluded."""
    fwd_overhead_bytes: int = 0
    """Transient bytes during the forward beyond what it keeps."""
    bwd_overhead_bytes: int = 0
    """Transient bytes during the backward beyond the input gradients it produces; negative when
    the backward frees part of what it holds first (module docstring)."""
    saved_inputs: tuple[int, ...] | None = None
    """The inputs the backward reads (a subset of ``inputs``); ``None`` means all of them."""
    keeps_output: bool = True
    """True (the chain model's assumption) when the node's own backward reads its output (a
    ReLU, a softmax), so a stored node holds it until that backward. False when only its
    consumers' backwards keep it (a convolution's output, saved by the next batch norm) or
    none does: the output is then freed as soon as its last reader (a forward that reads it,
    a backward that saved it, a checkpoint) is done, before the node's own backward."""
    random_calls: int = 0
    """Random calls (dropout: ops tagged ``nondeterministic_seeded``) the node's forward makes;
    the graph executor saves an RNG state for each inside a checkpointed segment
    (:func:`remat.core.simulate.graph_step_peak`). Not part of the fingerprint."""
    held_until: int | None = None
    """The last node during whose first forward the model's program still holds this node's
    output after its last reader is done, or ``None`` (freed by its readers). In
    ``h = block(h) * mask`` the previous ``h`` is read by ``block`` yet lives until the
    multiplication returns and ``h`` is reassigned: a checkpointed ``h`` is not freed when
    ``block`` is done. Only the first forward: a recomputation is the executor's replay, which
    frees by readers. The capture sets it from the death of the output's last tensor object
    (:mod:`remat.capture.graph`); :class:`Graph` checks that it names a later node."""
    fwd_none_overhead_bytes: int | None = None
    """Transient bytes during the forward without grad (``F_none``) beyond its output;
    ``None``: ``fwd_overhead_bytes`` (:attr:`remat.core.chain.Chain.fwd_none_overhead_bytes`)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "inputs", tuple(self.inputs))
        if self.saved_inputs is not None:
            set_(self, "saved_inputs", tuple(self.saved_inputs))
        for name in ("fwd_time", "bwd_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"node {self.name!r}: {name} must be a number, got {value!r}")
            value = float(value)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"node {self.name!r}: {name} = {value}; must be finite and >= 0")
            set_(self, name, value)
        for name in ("out_bytes", "saved_bytes", "fwd_overhead_bytes", "bwd_overhead_bytes"):
            value = _as_bytes(self.name, name, getattr(self, name), name != "bwd_overhead_bytes")
            set_(self, name, value)
        if self.fwd_none_overhead_bytes is not None:
            none = _as_bytes(self.name, "fwd_none_overhead_bytes", self.fwd_none_overhead_bytes)
            set_(self, "fwd_none_overhead_bytes", none)
        if not isinstance(self.keeps_output, bool):
            raise TypeError(f"node {self.name!r}: keeps_output must be a bool")
        if isinstance(self.random_calls, bool) or not isinstance(self.random_calls, int):
            raise TypeError(f"node {self.name!r}: random_calls must be an int")
        if self.random_calls < 0:
            raise ValueError(f"node {self.name!r}: random_calls = {self.random_calls} < 0")
        if self.held_until is not None and (
            isinstance(self.held_until, bool) or not isinstance(self.held_until, int)
        ):
            raise TypeError(f"node {self.name!r}: held_until must be a node index or None")
        if self.saved_bytes < self.out_bytes:
            raise ValueError(
                f"node {self.name!r}: saved_bytes ({self.saved_bytes}) < out_bytes "
                f"({self.out_bytes}); saved_bytes includes the node's own output"
            )
        if self.bwd_overhead_bytes < self.bwd_overhead_floor:
            raise ValueError(
                f"node {self.name!r}: bwd_overhead_bytes = {self.bwd_overhead_bytes} is below "
                f"{self.bwd_overhead_floor}, minus what the node's backward holds (its saved "
                "tensors and its output gradient): a backward cannot free more than it holds"
            )
        if len(set(self.inputs)) != len(self.inputs):
            raise ValueError(
                f"node {self.name!r}: inputs {self.inputs} repeat a node; list each once"
            )
        if self.saved_inputs is not None and not set(self.saved_inputs) <= set(self.inputs):
            raise ValueError(
                f"node {self.name!r}: saved_inputs {self.saved_inputs} are not all in inputs "
                f"{self.inputs}"
            )

    @property
    def residual_bytes(self) -> int:
        """Saved bytes beyond the output (``saved_bytes - out_bytes``)."""
        return self.saved_bytes - self.out_bytes

    @property
    def bwd_overhead_floor(self) -> int:
        """The least ``bwd_overhead_bytes``: minus what the backward holds of its own (saved
        tensors, the output among them under ``keeps_output``, and the output gradient)."""
        held = self.saved_bytes if self.keeps_output else self.residual_bytes
        return -(held + self.out_bytes)

    @property
    def backward_inputs(self) -> tuple[int, ...]:
        """The inputs whose outputs the backward reads (``saved_inputs`` or all inputs)."""
        return self.inputs if self.saved_inputs is None else self.saved_inputs

    @property
    def none_overhead_bytes(self) -> int:
        """The forward's transient bytes without grad (``fwd_none_overhead_bytes`` or, when
        unknown, ``fwd_overhead_bytes``)."""
        none = self.fwd_none_overhead_bytes
        return self.fwd_overhead_bytes if none is None else none

    def to_obj(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["inputs"] = list(self.inputs)
        if self.saved_inputs is not None:
            data["saved_inputs"] = list(self.saved_inputs)
        if self.keeps_output:
            del data["keeps_output"]  # the default: graphs written before it read the same
        if not self.random_calls:
            del data["random_calls"]  # likewise
        if self.held_until is None:
            del data["held_until"]  # likewise
        if self.fwd_none_overhead_bytes is None:
            del data["fwd_none_overhead_bytes"]  # likewise
        return data


@dataclass(frozen=True)
class Constant:
    """A tensor of the forward that needs no gradient and is no node (a frozen layer's output,
    a mask, a base weight's product in a LoRA layer), live while nodes run forward.

    A model whose first layers are frozen makes its activations there without autograd: they
    get no node, yet the forward holds them (the residual stream entering the first trainable
    layer, the frozen projections an adapter's sum reads), and a checkpointed segment that reads
    one keeps it until the segment is recomputed in the backward. The simulator allocates it at
    the first forward of node ``first``, frees it after the first forward of node ``last``, and
    keeps it further for every later forward of a ``readers`` node (a recomputation reads the
    copy its checkpoint kept). A constant that backwards save (a detection model's anchors and
    matched indices, a loss's target indices) lists the nodes whose backward saves it in
    ``saved_by`` and is kept until each of their backwards has run."""

    nbytes: int
    """Bytes of its storage."""
    first: int
    """The first node (in node order) whose forward runs while it is live."""
    last: int
    """The last node whose first forward runs while it is live."""
    readers: tuple[int, ...] = ()
    """The nodes whose forward reads it."""
    saved_by: tuple[int, ...] = ()
    """The nodes whose backward saves it: it lives until the last of their backwards."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "readers", tuple(self.readers))
        object.__setattr__(self, "saved_by", tuple(self.saved_by))
        object.__setattr__(self, "nbytes", _as_bytes("<constant>", "nbytes", self.nbytes))
        if not 0 <= self.first <= self.last:
            raise ValueError(f"constant: need 0 <= first <= last, got {self.first}, {self.last}")
        if any(not self.first <= v <= self.last for v in self.readers):
            raise ValueError(
                f"constant: readers {self.readers} outside [first, last] = "
                f"[{self.first}, {self.last}]"
            )

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "nbytes": self.nbytes,
            "first": self.first,
            "last": self.last,
            "readers": list(self.readers),
        }
        if self.saved_by:  # constants no backward saves read and hash as before
            obj["saved_by"] = list(self.saved_by)
        return obj


@dataclass(frozen=True)
class Graph:
    """A DAG of costed nodes in topological order plus the graph input (module docstring)."""

    nodes: tuple[Node, ...]
    """The nodes; ``nodes[v].inputs`` only name nodes before ``v``."""
    input_bytes: int = 0
    """Bytes of the graph input, live for the whole step (no gradient)."""
    time_unit: str = "s"
    """What the node times count: ``"s"`` (seconds) or ``"flop"``."""
    constants: tuple[Constant, ...] = ()
    """Tensors without gradient live while nodes run forward (:class:`Constant`)."""
    _consumers: tuple[tuple[int, ...], ...] = field(
        default=(), init=False, repr=False, compare=False
    )
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        nodes = tuple(self.nodes)
        set_(self, "nodes", nodes)
        if not nodes:
            raise ValueError("a Graph needs at least one node")
        set_(self, "input_bytes", _as_bytes("<graph>", "input_bytes", self.input_bytes))
        if self.time_unit not in ("s", "flop"):
            raise ValueError(f"time_unit must be 's' or 'flop', got {self.time_unit!r}")
        consumers: list[list[int]] = [[] for _ in nodes]
        names: dict[str, int] = {}
        for v, node in enumerate(nodes):
            if not isinstance(node, Node):
                raise TypeError(f"Graph.nodes[{v}] is {type(node).__name__}, expected Node")
            if node.name in names:
                raise ValueError(
                    f"node name {node.name!r} is used by nodes {names[node.name]} and {v}; "
                    "names must be unique"
                )
            names[node.name] = v
            for u in node.inputs:
                if not isinstance(u, int) or isinstance(u, bool) or not 0 <= u < v:
                    raise ValueError(
                        f"node {v} ({node.name!r}) reads {u!r}: inputs must be indices of "
                        "earlier nodes (list the nodes in a topological order)"
                    )
                consumers[u].append(v)
            if node.held_until is not None and not v < node.held_until < len(nodes):
                raise ValueError(
                    f"node {v} ({node.name!r}): held_until = {node.held_until} must name a "
                    f"later node (below {len(nodes)})"
                )
        set_(self, "_consumers", tuple(tuple(c) for c in consumers))
        set_(self, "constants", tuple(self.constants))
        for c in self.constants:
            if not isinstance(c, Constant):
                raise TypeError(f"Graph.constants holds {type(c).__name__}, expected Constant")
            if max((c.last, *c.saved_by)) >= len(nodes):
                raise ValueError(f"constant {c}: a node it names is not in the graph")
        if self.is_chain():  # one cost model: a chain's path graph has the chain's fingerprint
            set_(self, "_fingerprint", self.to_chain().fingerprint)
        else:
            digest = hashlib.sha256(self._canonical().encode()).hexdigest()[:16]
            set_(self, "_fingerprint", digest)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_chain(cls, chain: Chain) -> Graph:
        """The path graph of a chain: node ``i`` is stage ``i + 1`` and reads node ``i - 1``.
        A chain with a frozen prefix (:attr:`Chain.frozen_prefix`) has none: a graph's frozen
        layers are constants (:class:`Constant`), not nodes."""
        if chain.frozen_prefix:
            raise ValueError(
                f"a chain whose first {chain.frozen_prefix} stages have no backward "
                "(Chain.frozen_prefix) has no path graph: capture the module graph instead, "
                "where frozen layers are constants"
            )
        nodes = [
            Node(
                name=chain.names[i],
                inputs=(i - 1,) if i else (),
                fwd_time=chain.fwd_time[i],
                bwd_time=chain.bwd_time[i],
                out_bytes=chain.out_bytes[i],
                saved_bytes=chain.saved_bytes[i],
                fwd_overhead_bytes=chain.fwd_overhead_bytes[i],
                fwd_none_overhead_bytes=None
                if chain.fwd_none_overhead_bytes == chain.fwd_overhead_bytes
                else chain.fwd_none_overhead_bytes[i],
                bwd_overhead_bytes=chain.bwd_overhead_bytes[i],
            )
            for i in range(chain.n)
        ]
        return cls(tuple(nodes), input_bytes=chain.input_bytes, time_unit=chain.time_unit)

    def to_chain(self) -> Chain:
        """The chain whose path graph this is (:meth:`from_chain` back; :meth:`is_chain`)."""
        if not self.is_chain():
            raise ValueError(
                "not a chain: a chain's path graph has node v read node v - 1 only, each "
                "backward reading its input and keeping its output (saved_inputs, keeps_output "
                "at their defaults)"
            )
        nodes = self.nodes
        return Chain(
            fwd_time=tuple(node.fwd_time for node in nodes),
            bwd_time=tuple(node.bwd_time for node in nodes),
            out_bytes=tuple(node.out_bytes for node in nodes),
            saved_bytes=tuple(node.saved_bytes for node in nodes),
            input_bytes=self.input_bytes,
            fwd_overhead_bytes=tuple(node.fwd_overhead_bytes for node in nodes),
            bwd_overhead_bytes=tuple(node.bwd_overhead_bytes for node in nodes),
            fwd_none_overhead_bytes=tuple(node.none_overhead_bytes for node in nodes),
            names=tuple(node.name for node in nodes),
            time_unit=self.time_unit,
        )

    @classmethod
    def from_edges(
        cls,
        inputs: Sequence[Iterable[int]],
        out_bytes: Sequence[int],
        *,
        fwd_time: Sequence[float] | None = None,
        bwd_time: Sequence[float] | None = None,
        saved_bytes: Sequence[int] | None = None,
        input_bytes: int = 0,
    ) -> Graph:
        """A graph from per-node input lists and sizes (times default to 1 forward, 2 backward)."""
        n = len(inputs)
        fwd = fwd_time if fwd_time is not None else [1.0] * n
        bwd = bwd_time if bwd_time is not None else [2.0 * t for t in fwd]
        saved = saved_bytes if saved_bytes is not None else out_bytes
        nodes = tuple(
            Node(f"n{v}", tuple(inputs[v]), fwd[v], bwd[v], out_bytes[v], saved[v])
            for v in range(n)
        )
        return cls(nodes, input_bytes=input_bytes)

    # ------------------------------------------------------------------ structure
    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def fingerprint(self) -> str:
        """A short hash of the costs and edges (names excluded): plans record it. A chain's
        path graph (:meth:`is_chain`) has the chain's :attr:`~remat.core.chain.Chain.fingerprint`."""
        return self._fingerprint

    def consumers(self, v: int) -> tuple[int, ...]:
        """The nodes that read node ``v``'s output, in increasing order."""
        return self._consumers[v]

    @property
    def sinks(self) -> tuple[int, ...]:
        """The output nodes (read by no node): the loss reads them."""
        return tuple(v for v in range(self.n) if not self._consumers[v])

    @property
    def sources(self) -> tuple[int, ...]:
        """The nodes that read no other node (they read the graph input, if anything)."""
        return tuple(v for v, node in enumerate(self.nodes) if not node.inputs)

    def is_path(self) -> bool:
        """True when node ``v`` reads exactly node ``v - 1`` (a chain)."""
        return all(node.inputs == ((v - 1,) if v else ()) for v, node in enumerate(self.nodes))

    def saved_constants_as_input(self) -> Graph:
        """This graph with each constant a backward saves (``Constant.saved_by``) counted in
        ``input_bytes``, all step: an upper bound of its lifetime, for a planner that models
        constants by their forward span only (the plans it makes are simulated on ``self``)."""
        saved = [c for c in self.constants if c.saved_by]
        if not saved:
            return self
        return replace(
            self,
            input_bytes=self.input_bytes + sum(c.nbytes for c in saved),
            constants=tuple(c for c in self.constants if not c.saved_by),
        )

    def is_chain(self) -> bool:
        """True when this is the path graph of a :class:`~remat.core.chain.Chain`
        (:meth:`from_chain`): a path whose backwards read their input and keep their output,
        as the chain model assumes, with no :attr:`constants` and no output held past its
        reader (:attr:`Node.held_until`; a chain has neither)."""
        return (
            not self.constants
            and self.is_path()
            and all(
                node.keeps_output
                and node.backward_inputs == node.inputs
                and node.held_until is None
                for node in self.nodes
            )
        )

    def edges(self) -> list[tuple[int, int]]:
        """Every ``(producer, consumer)`` pair."""
        return [(u, v) for v, node in enumerate(self.nodes) for u in node.inputs]

    def index(self, name: str) -> int:
        """The index of the node called ``name``."""
        for v, node in enumerate(self.nodes):
            if node.name == name:
                return v
        raise KeyError(f"no node called {name!r}")

    def total_fwd_time(self) -> float:
        return sum(node.fwd_time for node in self.nodes)

    def total_bwd_time(self) -> float:
        return sum(node.bwd_time for node in self.nodes)

    def check_order(self, order: Sequence[int]) -> None:
        """Raise ``ValueError`` unless ``order`` is a permutation of the nodes."""
        if sorted(order) != list(range(self.n)):
            raise ValueError(f"an execution order must list each of the {self.n} nodes once")

    def scaled(self, factor: float) -> Graph:
        """The same graph with every byte count multiplied by ``factor`` (another batch size)."""

        def scale(x: int) -> int:
            return int(round(x * factor))

        def scale_node(node: Node) -> Node:
            out = scale(node.out_bytes)
            saved = max(scale(node.saved_bytes), out)
            held = saved if node.keeps_output else saved - out
            return replace(
                node,
                out_bytes=out,
                saved_bytes=saved,
                fwd_overhead_bytes=scale(node.fwd_overhead_bytes),
                fwd_none_overhead_bytes=None
                if node.fwd_none_overhead_bytes is None
                else scale(node.fwd_none_overhead_bytes),
                # rounded apart, a negative overhead may fall below the scaled floor by a byte
                bwd_overhead_bytes=max(scale(node.bwd_overhead_bytes), -(held + out)),
            )

        nodes = tuple(scale_node(node) for node in self.nodes)
        constants = tuple(replace(c, nbytes=scale(c.nbytes)) for c in self.constants)
        return Graph(
            nodes,
            input_bytes=scale(self.input_bytes),
            time_unit=self.time_unit,
            constants=constants,
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        data = {
            "schema": "remat.graph",
            "version": GRAPH_SCHEMA_VERSION,
            "input_bytes": self.input_bytes,
            "time_unit": self.time_unit,
            "nodes": [node.to_obj() for node in self.nodes],
        }
        if self.constants:  # graphs without constants read and hash as before
            data["constants"] = [c.to_obj() for c in self.constants]
        return data

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        """Read a graph written by :meth:`to_json` (checks the schema and its version)."""

        data = read_schema(text, "remat.graph", GRAPH_SCHEMA_VERSION, "remat graph", ValueError)
        known = {f.name for f in fields(Node)}
        nodes = tuple(Node(**{k: v for k, v in obj.items() if k in known}) for obj in data["nodes"])
        constants = tuple(Constant(**obj) for obj in data.get("constants", ()))
        return cls(
            nodes,
            input_bytes=data.get("input_bytes", 0),
            time_unit=data.get("time_unit", "s"),
            constants=constants,
        )

    def _canonical(self) -> str:
        data = self.to_dict()
        for obj in data["nodes"]:
            obj.pop("name")
            obj.pop("random_calls", None)  # an RNG state's bytes, not the activations' plan
        return json.dumps(data, sort_keys=True)

    def __len__(self) -> int:
        return self.n


def _as_bytes(node: str, name: str, value: Any, nonnegative: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"node {node!r}: {name} must be a number of bytes, got {value!r}")
    if isinstance(value, float):
        if value != int(value):
            raise ValueError(f"node {node!r}: {name} must be a whole number of bytes, got {value}")
        value = int(value)
    if nonnegative and value < 0:
        raise ValueError(f"node {node!r}: {name} = {value}; bytes must be >= 0")
    return int(value)
