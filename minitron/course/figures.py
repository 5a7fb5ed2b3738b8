"""Pictures for the lessons, drawn from the engine's own objects: the ring all-reduce
from a real trace, the α–β cost model against measured times, f and g around
Megatron's two linears (from the engine's real shards), the q×q×q cube with the
blocks a rank holds (from the process grid), and the naive and balanced placements of a
cube linear (from real ``Linear3D`` shards).

Every function returns a matplotlib ``Figure`` (no global pyplot state), which a
notebook displays as the cell's value.
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle


def _fig(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h))
    try:  # a Figure made without pyplot still shows inline in Jupyter through its canvas
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    except ImportError:  # pragma: no cover
        pass
    return fig


def draw_ring(results: dict) -> Figure:
    """The ring all-reduce of :func:`minitron.course.collectives.collectives_job`, one
    panel per step: the ranks on a circle, the chunks each holds (shaded by how many ranks'
    values are already summed into it) and, as arrows, the messages the trace recorded in
    that step with the chunk each carried.

    `results` is ``run_on_ranks``'s {rank: job result}."""
    ranks = sorted(results)
    p = len(ranks)
    steps = results[ranks[0]]["ring"]["steps"]
    sends = [r for k in ranks for r in results[k]["ring_records"] if r["op"] == "send"]
    cols = p - 1
    fig = _fig(3.0 * cols, 6.2)
    pos = {r: (math.sin(2 * math.pi * r / p), math.cos(2 * math.pi * r / p)) for r in ranks}
    for n, st in enumerate(steps):
        ax = fig.add_subplot(2, cols, n + 1)
        ax.set_xlim(-1.7, 1.7)
        ax.set_ylim(-1.7, 1.7)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{st['phase']}, step {st['step'] + 1}", fontsize=9)
        for m in (m for m in sends if m["phase"] == st["phase"] and m["ring_step"] == st["step"]):
            a, b = pos[m["rank"]], pos[(m["rank"] + 1) % p]
            ax.add_patch(FancyArrowPatch((a[0] * 0.8, a[1] * 0.8), (b[0] * 0.8, b[1] * 0.8),
                                         connectionstyle="arc3,rad=-0.25", arrowstyle="-|>",
                                         mutation_scale=10, color="#dd8452"))
            mid = ((a[0] + b[0]) * 0.62, (a[1] + b[1]) * 0.62)
            ax.text(*mid, f"c{m['chunk']}", fontsize=7, ha="center", va="center", color="#a0522d")
        for r in ranks:
            x, y = pos[r]
            holds = results[r]["ring"]["steps"][n]["holds"]
            w = 0.17
            for c, who in enumerate(holds):
                shade = len(who) / p
                ax.add_patch(Rectangle((x - 2 * w + c * w, y - w / 2), w, w, edgecolor="black", lw=0.5,
                                       facecolor=(1 - 0.7 * shade, 1 - 0.55 * shade, 1 - 0.3 * shade)))
            ax.text(x, y + 0.2 if y > -0.5 else y - 0.32, f"rank {r}", ha="center", fontsize=8)
    fig.suptitle("Ring all-reduce from the trace: chunk c0..c3 of each rank, darker = more ranks summed in",
                 fontsize=9)
    fig.tight_layout()
    return fig


def plot_alpha_beta(sizes, measured: dict, fitted: dict) -> Figure:
    """Measured seconds per collective (points) and the α–β model's times (lines) against
    the message size, log–log. `measured` and `fitted` map an op name to seconds per
    size."""
    fig = _fig(6.0, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    for k, (op, secs) in enumerate(measured.items()):
        color = f"C{k}"
        ax.loglog(sizes, [s * 1e3 for s in secs], "o", color=color, label=f"{op}, measured")
        if op in fitted:
            ax.loglog(sizes, [s * 1e3 for s in fitted[op]], "-", color=color, label=f"{op}, α–β model")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time (ms)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def draw_f_and_g(model, t: int = 2) -> Figure:
    """Megatron's MLP on `t` tensor ranks: f before the column-parallel linear, g after
    the row-parallel one, with every weight block drawn at the shape the engine gives
    that rank (`ShardInfo` of the real parameters of a one-layer GPT)."""
    import torch

    from ..comm import Comm
    from ..config import ParallelConfig
    from ..context import Context
    from ..grid import ProcessGrid
    from ..model import GPT

    shapes = {}
    for r in range(t):   # tensor rank r's part of a one-layer model, built in this process
        ctx = Context(Comm(ProcessGrid(tp=t, rank=r)), ParallelConfig(tp=t), torch.float32)
        for name, prm in GPT(model.replace(layers=1), ctx).named_parameters():
            if name.endswith(("mlp.fc.weight", "mlp.fc2.weight")):
                shapes[(r, name.split(".")[-2])] = tuple(prm.shape)
    fig = _fig(8.0, 1.2 + 1.6 * t)
    ax = fig.add_subplot(1, 1, 1)
    ax.axis("off")
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.5, 1.9 * t)
    for r in range(t):
        y = 1.9 * (t - 1 - r)
        ax.text(0.1, y + 0.6, f"rank {r}", fontsize=9)
        boxes = [(1.6, "X", "#dddddd"),
                 (3.6, f"fc block\n{list(shapes[(r, 'fc')])}", "#4c72b0"),
                 (5.6, f"fc2 block\n{list(shapes[(r, 'fc2')])}", "#55a868")]
        for x, label, color in boxes:
            ax.add_patch(Rectangle((x, y + 0.2), 1.4, 0.9, facecolor=color, alpha=0.35, edgecolor="black"))
            ax.text(x + 0.7, y + 0.65, label, ha="center", va="center", fontsize=8)
        for x0, x1 in ((3.0, 3.6), (5.0, 5.6), (7.0, 7.9)):
            ax.annotate("", (x1, y + 0.65), (x0, y + 0.65), arrowprops=dict(arrowstyle="->"))
        ax.text(8.0, y + 0.65, "partial Y", va="center", fontsize=8)
    top = 1.9 * (t - 1) + 1.4
    ax.add_patch(Rectangle((1.05, -0.2), 0.4, top + 0.2, facecolor="#dd8452", alpha=0.5))
    ax.text(1.25, top + 0.2, "f", ha="center", fontsize=12, weight="bold")
    ax.add_patch(Rectangle((9.1, -0.2), 0.4, top + 0.2, facecolor="#c44e52", alpha=0.5))
    ax.text(9.3, top + 0.2, "g", ha="center", fontsize=12, weight="bold")
    ax.set_title("f: identity forward, all-reduce backward  |  g: all-reduce forward, identity backward",
                 fontsize=9)
    fig.tight_layout()
    return fig


def _cube_blocks(model, q: int, weight: str) -> dict[int, str]:
    """{rank: 'rows r0:r1, cols c0:c1'}: the block of `weight` each rank of the cube holds,
    read from the `ShardInfo` of a one-layer GPT built for that rank."""
    import torch

    from ..comm import Comm
    from ..config import ParallelConfig
    from ..context import Context
    from ..grid import ProcessGrid
    from ..model import GPT

    out = {}
    for r in range(q ** 3):
        ctx = Context(Comm(ProcessGrid(tp=q ** 3, cube=True, rank=r)), ParallelConfig(tp=q ** 3, tp_mode="3d"),
                      torch.float32)
        prm = dict(GPT(model.replace(layers=1), ctx).named_parameters())[weight]
        rows, cols = prm.shard.slices
        out[r] = f"[{rows.start}:{rows.stop}, {cols.start}:{cols.stop}]"
    return out


def draw_cube(q: int = 2, rank: int = 0, model=None, weight: str = "blocks.0.mlp.fc.weight") -> Figure:
    """The q×q×q cube of tensor ranks (from `ProcessGrid`'s cube coordinates), with the
    lines through `rank` along i, j and k highlighted: the groups its collectives use.
    With a `model`, each rank is labelled with the block of `weight` it holds (rows and
    columns of the single-device weight, from the engine's own shards)."""
    from ..grid import ProcessGrid

    grid = ProcessGrid(tp=q ** 3, cube=True)
    blocks = _cube_blocks(model, q, weight) if model is not None else {}
    fig = _fig(6.0 if blocks else 5.0, 5.5 if blocks else 5.0)
    ax = fig.add_subplot(1, 1, 1, projection="3d")
    lines = {axis: set(grid.axis_ranks(axis, rank)) for axis in ("cube_i", "cube_j", "cube_k")}
    colors = {"cube_i": "#4c72b0", "cube_j": "#55a868", "cube_k": "#c44e52"}
    for r in range(q ** 3):
        i, j, k = grid.cube_coord(r)
        color, size = "#bbbbbb", 40
        for axis, members in lines.items():
            if r in members:
                color, size = colors[axis], 90
        if r == rank:
            color, size = "black", 140
        ax.scatter([i], [j], [k], s=size, color=color, depthshade=False)
        ax.text(i, j, k + 0.12, f"{r} {blocks[r]}" if blocks else str(r), fontsize=7)
    for axis, members in lines.items():
        pts = sorted(grid.cube_coord(r) for r in members)
        ax.plot(*zip(*pts), color=colors[axis], lw=2, label=f"{axis} line of rank {rank}")
    ax.set_xlabel("i")
    ax.set_ylabel("j")
    ax.set_zlabel("k")
    ax.legend(fontsize=7, loc="upper left")
    title = f"the {q}×{q}×{q} cube: the three lines through rank {rank}"
    if blocks:
        title += f"\nlabels: rank and its block of {weight} [rows, columns]"
    ax.set_title(title, fontsize=9)
    return fig


def draw_cube_placements(placements: dict, q: int) -> Figure:
    """The naive and the balanced 3-D matrix multiply side by side (rows), one panel per
    k-plane of the cube: each rank (i, j) of the plane is a cell with four bars, the bytes
    of input, weight, output and bias it holds, scaled to the largest of each kind.
    `placements` is :func:`minitron.course.tp_schemes.cube_placements`' result."""
    from ..grid import ProcessGrid
    from .tp_schemes import HELD

    grid = ProcessGrid(tp=q ** 3, cube=True)
    colors = dict(zip(HELD, ("#4c72b0", "#55a868", "#dd8452", "#c44e52")))
    top = {k: max(row[k] for rows in placements.values() for row in rows.values()) or 1 for k in HELD}
    fig = _fig(3.2 * q, 6.0)
    for n, (name, rows) in enumerate(placements.items()):
        for k in range(q):
            ax = fig.add_subplot(2, q, n * q + k + 1)
            ax.set_xlim(0, q)
            ax.set_ylim(0, q)
            ax.set_aspect("equal")
            ax.set_xticks([x + 0.5 for x in range(q)], [f"i={x}" for x in range(q)], fontsize=7)
            ax.set_yticks([y + 0.5 for y in range(q)], [f"j={y}" for y in range(q)], fontsize=7)
            ax.set_title(f"{name}: plane k={k}", fontsize=9)
            for r, row in rows.items():
                i, j, kk = grid.cube_coord(r)
                if kk != k:
                    continue
                ax.add_patch(Rectangle((i, j), 1, 1, facecolor="white", edgecolor="black", lw=0.8))
                ax.text(i + 0.05, j + 0.88, f"rank {r}", fontsize=6)
                for m, what in enumerate(HELD):
                    height = 0.7 * row[what] / top[what]
                    ax.add_patch(Rectangle((i + 0.12 + 0.2 * m, j + 0.08), 0.16, height, color=colors[what]))
    handles = [Rectangle((0, 0), 1, 1, color=colors[w]) for w in HELD]
    fig.legend(handles, [f"{w} held" for w in HELD], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("one cube linear: bytes each rank holds (bar height, scaled to the largest of each kind)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    return fig
