"""Synthetic graphs for tests and benchmarks: random DAGs and the shapes of real networks.

Small shapes (:func:`residual_chain`, :func:`dense_block`, :func:`inception_block`) use unit-ish
integer costs; the large ones (:func:`resnet50_like` at module level, :func:`densenet_like` at
op level) use the activation sizes of the real networks (fp32, NCHW) and times from a simple
roofline (convolutions at 100 TFLOP/s, everything else at 1 TB/s), so that planners see the
same orders of magnitude as on a captured model.

>>> g = residual_chain(2)
>>> g.n, g.sinks
(15, (14,))
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from remat.core.graph import Graph, Node

__all__ = [
    "random_dag",
    "residual_chain",
    "dense_block",
    "inception_block",
    "resnet50_like",
    "densenet_like",
]


def random_dag(
    n: int,
    seed: int | None = None,
    *,
    max_inputs: int = 3,
    max_bytes: int = 50,
    locality: int = 4,
    overheads: bool = True,
    single_sink: bool = True,
    free_outputs: bool = False,
    held_outputs: bool = False,
) -> Graph:
    """A random DAG of ``n`` nodes with integer costs (reproducible by seed).

    Node ``v`` reads 1..``max_inputs`` earlier nodes, mostly among the ``locality`` previous
    ones; with ``single_sink`` every node without a reader is given one later reader. With
    ``free_outputs`` about half of the nodes do not keep their own output for their backward
    (``Node.keeps_output``; drawn from a separate stream, the rest of the graph is unchanged).
    With ``held_outputs`` about half of the nodes that have a reader and a later node after it
    are held by the program until a later node's forward (``Node.held_until``; likewise).
    """
    rng = random.Random(seed)
    inputs: list[set[int]] = [set() for _ in range(n)]
    for v in range(1, n):
        k = rng.randint(1, max_inputs)
        for _ in range(k):
            if rng.random() < 0.8:
                inputs[v].add(rng.randint(max(0, v - locality), v - 1))
            else:
                inputs[v].add(rng.randint(0, v - 1))
    if single_sink:
        for v in range(n - 1):
            if not any(v in inputs[w] for w in range(v + 1, n)):
                inputs[rng.randint(v + 1, n - 1)].add(v)
    nodes = []
    for v in range(n):
        out = rng.randint(1, max_bytes)
        ins = tuple(sorted(inputs[v]))
        saved_inputs = None
        if ins and rng.random() < 0.5:
            saved_inputs = tuple(u for u in ins if rng.random() < 0.5)
        nodes.append(
            Node(
                name=f"n{v}",
                inputs=ins,
                fwd_time=float(rng.randint(1, 10)),
                bwd_time=float(rng.randint(1, 20)),
                out_bytes=out,
                saved_bytes=out + (rng.randint(0, max_bytes) if rng.random() < 0.5 else 0),
                fwd_overhead_bytes=rng.randint(0, max_bytes // 2) if overheads else 0,
                bwd_overhead_bytes=rng.randint(0, max_bytes // 2) if overheads else 0,
                saved_inputs=saved_inputs,
            )
        )
    input_bytes = rng.randint(1, max_bytes)
    if free_outputs:
        flags = random.Random(f"{seed}/keeps_output")
        nodes = [replace(node, keeps_output=flags.random() < 0.5) for node in nodes]
    if held_outputs:
        draw = random.Random(f"{seed}/held_until")
        last = [max((w for w in range(n) if v in inputs[w]), default=n) for v in range(n)]
        nodes = [
            replace(node, held_until=draw.randint(last[v] + 1, n - 1))
            if last[v] < n - 1 and draw.random() < 0.5
            else node
            for v, node in enumerate(nodes)
        ]
    return Graph(tuple(nodes), input_bytes=input_bytes)


@dataclass
class _Builder:
    """Appends nodes with simple per-kind cost rules."""

    nodes: list[Node] = field(default_factory=list)

    def add(
        self,
        name: str,
        inputs: tuple[int, ...],
        out: int,
        *,
        fwd: float = 1.0,
        bwd: float | None = None,
        saved: int | None = None,
        saved_inputs: tuple[int, ...] | None = None,
        fwd_overhead: int = 0,
        bwd_overhead: int = 0,
    ) -> int:
        self.nodes.append(
            Node(
                name,
                inputs,
                fwd,
                2.0 * fwd if bwd is None else bwd,
                out,
                out if saved is None else saved,
                fwd_overhead,
                bwd_overhead,
                saved_inputs,
            )
        )
        return len(self.nodes) - 1


def residual_chain(blocks: int, width: int = 10) -> Graph:
    """A stem and ``blocks`` residual blocks (conv-bn-relu-conv-bn, add, relu) at op level."""
    b = _Builder()
    x = b.add("stem", (), width, fwd=2.0, saved_inputs=())
    for i in range(blocks):
        c1 = b.add(f"b{i}.conv1", (x,), width, fwd=3.0)
        n1 = b.add(f"b{i}.bn1", (c1,), width, fwd=0.5)
        r1 = b.add(f"b{i}.relu1", (n1,), width, fwd=0.2, saved_inputs=())
        c2 = b.add(f"b{i}.conv2", (r1,), width, fwd=3.0)
        n2 = b.add(f"b{i}.bn2", (c2,), width, fwd=0.5)
        s = b.add(f"b{i}.add", (n2, x), width, fwd=0.2, saved_inputs=())
        x = b.add(f"b{i}.relu", (s,), width, fwd=0.2, saved_inputs=())
    return Graph(tuple(b.nodes), input_bytes=width)


def dense_block(layers: int, growth: int = 4, base: int = 8) -> Graph:
    """A DenseNet block at op level: layer ``i`` concatenates all earlier features."""
    b = _Builder()
    feats = [b.add("stem", (), base, fwd=2.0, saved_inputs=())]
    width = base
    for i in range(layers):
        cat = b.add(f"l{i}.cat", tuple(feats), width, fwd=0.2, saved_inputs=())
        n = b.add(f"l{i}.bn", (cat,), width, fwd=0.5)
        r = b.add(f"l{i}.relu", (n,), width, fwd=0.2, saved_inputs=())
        f = b.add(f"l{i}.conv", (r,), growth, fwd=2.0)
        feats.append(f)
        width += growth
    b.add("out.cat", tuple(feats), width, fwd=0.2, saved_inputs=())
    return Graph(tuple(b.nodes), input_bytes=base)


def inception_block(branches: int = 3, depth: int = 2, width: int = 6) -> Graph:
    """A stem, parallel branches of ``depth`` convs of different sizes, and a concat."""
    b = _Builder()
    x = b.add("stem", (), width, fwd=2.0, saved_inputs=())
    ends = []
    for i in range(branches):
        y = x
        for d in range(depth):
            y = b.add(f"br{i}.conv{d}", (y,), width + i + d, fwd=1.0 + i)
        ends.append(y)
    cat = b.add("cat", tuple(ends), sum(b.nodes[e].out_bytes for e in ends), saved_inputs=())
    b.add("head", (cat,), width, fwd=1.0)
    return Graph(tuple(b.nodes), input_bytes=width)


_CONV_RATE = 100e12  # FLOP/s
_MEM_RATE = 1e12  # bytes/s


def _conv(b: _Builder, name: str, x: int, cin: int, cout: int, k: int, hw: int, batch: int) -> int:
    """A convolution reading node ``x`` (or the graph input when ``x`` is -1)."""
    out = batch * cout * hw * hw * 4
    flops = 2 * batch * cout * hw * hw * cin * k * k
    inputs = () if x < 0 else (x,)
    return b.add(name, inputs, out, fwd=flops / _CONV_RATE, bwd=2 * flops / _CONV_RATE)


def _eltwise(b: _Builder, name: str, inputs: tuple[int, ...], out: int, saves_input: bool) -> int:
    t = (len(inputs) + 1) * out / _MEM_RATE
    return b.add(name, inputs, out, fwd=t, bwd=2 * t, saved_inputs=inputs if saves_input else ())


def resnet50_like(batch: int = 32, image: int = 224) -> Graph:
    """ResNet-50 at module level (conv, bn, relu, add, pool, fc): 176 nodes, real sizes."""
    b = _Builder()
    hw = image // 2
    x = _conv(b, "conv1", -1, 3, 64, 7, hw, batch)
    x = _eltwise(b, "bn1", (x,), b.nodes[x].out_bytes, True)
    x = _eltwise(b, "relu", (x,), b.nodes[x].out_bytes, False)
    hw //= 2
    x = _eltwise(b, "maxpool", (x,), batch * 64 * hw * hw * 4, True)
    cin = 64
    for stage, (blocks, mid) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        for blk in range(blocks):
            p = f"layer{stage + 1}.{blk}"
            if blk == 0 and stage > 0:
                hw //= 2
            cout = 4 * mid
            y = _conv(b, f"{p}.conv1", x, cin, mid, 1, hw, batch)
            y = _eltwise(b, f"{p}.bn1", (y,), b.nodes[y].out_bytes, True)
            y = _eltwise(b, f"{p}.relu1", (y,), b.nodes[y].out_bytes, False)
            y = _conv(b, f"{p}.conv2", y, mid, mid, 3, hw, batch)
            y = _eltwise(b, f"{p}.bn2", (y,), b.nodes[y].out_bytes, True)
            y = _eltwise(b, f"{p}.relu2", (y,), b.nodes[y].out_bytes, False)
            y = _conv(b, f"{p}.conv3", y, mid, cout, 1, hw, batch)
            y = _eltwise(b, f"{p}.bn3", (y,), b.nodes[y].out_bytes, True)
            skip = x
            if blk == 0:
                skip = _conv(b, f"{p}.downsample.0", x, cin, cout, 1, hw, batch)
                skip = _eltwise(b, f"{p}.downsample.1", (skip,), b.nodes[skip].out_bytes, True)
            s = _eltwise(b, f"{p}.add", (y, skip), b.nodes[y].out_bytes, False)
            x = _eltwise(b, f"{p}.relu3", (s,), b.nodes[s].out_bytes, False)
            cin = cout
    x = _eltwise(b, "avgpool", (x,), batch * cin * 4, True)
    x = b.add("fc", (x,), batch * 1000 * 4, fwd=2 * batch * cin * 1000 / _CONV_RATE)
    _eltwise(b, "loss", (x,), 4, True)
    return Graph(tuple(b.nodes), input_bytes=batch * 3 * image * image * 4)


def densenet_like(
    block_config: tuple[int, ...] = (6, 12, 48, 32),
    batch: int = 16,
    image: int = 224,
    growth: int = 32,
    bn_size: int = 4,
    ops_per_layer: int = 7,
) -> Graph:
    """DenseNet at op level (default DenseNet-201: 712 nodes); each layer is
    ``cat, bn, relu, conv1x1, bn, relu, conv3x3``. ``ops_per_layer=10`` splits each batch norm
    into three ops and adds a dropout, for a finer graph (~1000 nodes for DenseNet-201; use
    ``block_config=(6, 12, 64, 48)`` and 10 for ~1300, more blocks for ~2000)."""
    if ops_per_layer not in (7, 10):
        raise ValueError("ops_per_layer must be 7 or 10")
    b = _Builder()
    hw = image // 2
    x = _conv(b, "conv0", -1, 3, 64, 7, hw, batch)
    x = _eltwise(b, "norm0", (x,), b.nodes[x].out_bytes, True)
    x = _eltwise(b, "relu0", (x,), b.nodes[x].out_bytes, False)
    hw //= 2
    x = _eltwise(b, "pool0", (x,), batch * 64 * hw * hw * 4, True)
    channels = 64

    def norm(name: str, y: int) -> int:
        size = b.nodes[y].out_bytes
        if ops_per_layer == 7:
            return _eltwise(b, name, (y,), size, True)
        m = _eltwise(b, f"{name}.mean", (y,), size // max(1, size // 4096), True)
        c = _eltwise(b, f"{name}.sub", (y, m), size, False)
        return _eltwise(b, f"{name}.scale", (c,), size, True)

    for i, layers in enumerate(block_config):
        feats = [x]
        for j in range(layers):
            p = f"denseblock{i + 1}.layer{j + 1}"
            cin = channels + j * growth
            cat = _eltwise(b, f"{p}.cat", tuple(feats), batch * cin * hw * hw * 4, False)
            y = norm(f"{p}.norm1", cat)
            y = _eltwise(b, f"{p}.relu1", (y,), b.nodes[y].out_bytes, False)
            y = _conv(b, f"{p}.conv1", y, cin, bn_size * growth, 1, hw, batch)
            y = norm(f"{p}.norm2", y)
            y = _eltwise(b, f"{p}.relu2", (y,), b.nodes[y].out_bytes, False)
            y = _conv(b, f"{p}.conv2", y, bn_size * growth, growth, 3, hw, batch)
            if ops_per_layer == 10:
                y = _eltwise(b, f"{p}.dropout", (y,), b.nodes[y].out_bytes, False)
            feats.append(y)
        channels += layers * growth
        x = _eltwise(
            b, f"denseblock{i + 1}.cat", tuple(feats), batch * channels * hw * hw * 4, False
        )
        if i < len(block_config) - 1:
            p = f"transition{i + 1}"
            x = _eltwise(b, f"{p}.norm", (x,), b.nodes[x].out_bytes, True)
            x = _eltwise(b, f"{p}.relu", (x,), b.nodes[x].out_bytes, False)
            channels //= 2
            x = _conv(b, f"{p}.conv", x, channels * 2, channels, 1, hw, batch)
            hw //= 2
            x = _eltwise(b, f"{p}.pool", (x,), batch * channels * hw * hw * 4, True)
    x = _eltwise(b, "norm5", (x,), b.nodes[x].out_bytes, True)
    x = _eltwise(b, "relu5", (x,), b.nodes[x].out_bytes, False)
    x = _eltwise(b, "avgpool", (x,), batch * channels * 4, True)
    x = b.add("classifier", (x,), batch * 1000 * 4, fwd=2 * batch * channels * 1000 / _CONV_RATE)
    _eltwise(b, "loss", (x,), 4, True)
    return Graph(tuple(b.nodes), input_bytes=batch * 3 * image * image * 4)
