"""Figures for the paged KV cache chapter (plotly graph_objects).

    from workbench.course.viz.paged import block_map_figure, tokens_held
    held = tokens_held(llm.trace)                       # request id -> tokens in the cache, per step
    rec = llm.trace[k]                                  # LLM(..., record_block_tables=True)
    block_map_figure({"paged": (rec.block_tables, held[k])}, rec.blocks_total, rec.block_size)

Like `workbench.course.viz.figures`, every function takes plain data (block tables, token counts, lists of
numbers) or `StepRecord`s, never the engine, and returns a figure with a title, axes with units and a
caption sentence under the plot.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from workbench.engine.trace import StepRecord
from workbench.course.viz.figures import PALETTE, _layout, add_caption

OWNER_COLORS = tuple(qualitative.Dark24)
FREE_COLOR = "#f1f1f1"
EMPTY_COLOR = "#f7b6b6"    # a slot inside a held block with no token in it: reserved, wasted
SHARED_COLOR = "#111111"   # a block held by more than one sequence
GIB = 2 ** 30


# ------------------------------------------------------------------------------------ helpers
def tokens_held(trace: Sequence[StepRecord]) -> list[dict[str, int]]:
    """For every step, request id -> tokens whose K/V the request holds after that step.

    Rebuilt from `StepRecord.scheduled` and `.preempted`: a preempted request restarts from zero
    (recompute), a scheduled one adds its tokens, a finished one is dropped. Prefix-cache hits are not
    in the trace per request, so a request's count starts at its first computed token: with prefix
    caching the counts are too low by the hit tokens (the sum check below then fails)."""
    held: dict[str, int] = {}
    out = []
    for rec in trace:
        for r in rec.preempted:
            held.pop(r, None)
        for r, n in rec.scheduled:
            held[r] = held.get(r, 0) + n
        for r in rec.finished:
            held.pop(r, None)
        if rec.block_tables is not None:   # requests that hold no blocks hold no tokens
            held = {r: n for r, n in held.items() if r in rec.block_tables}
        out.append(dict(held))
    return out


def _owner_index(owner_order: Sequence[str] | None, tables: Mapping[str, list[int]]) -> dict:
    order = list(owner_order) if owner_order is not None else sorted(
        tables, key=lambda r: (len(r), r))
    return {r: i for i, r in enumerate(order)}


def block_grid(block_tables: Mapping[str, list[int]], num_blocks: int, block_size: int,
               num_tokens: Mapping[str, int] | None = None, blocks_per_row: int = 8,
               owner_order: Sequence[str] | None = None):
    """The pool as a grid: one row of cells per `blocks_per_row` blocks, one cell per token slot.

    Returns (z, hover): z is None for a free slot, -1 for a slot in a held block that holds no token
    (reserved and empty), len(OWNER_COLORS) for a slot of a shared block, else the owner's colour
    index. Without `num_tokens` every held block is drawn full."""
    index = _owner_index(owner_order, block_tables)
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    for r, table in block_tables.items():
        n = None if num_tokens is None else num_tokens.get(r, 0)
        for i, b in enumerate(table):
            owners.setdefault(b, []).append(r)
            f = block_size if n is None else max(0, min(block_size, n - i * block_size))
            fill[b] = max(fill.get(b, 0), f)
    rows = math.ceil(num_blocks / blocks_per_row)
    z = [[None] * (blocks_per_row * block_size) for _ in range(rows)]
    hover = [[""] * (blocks_per_row * block_size) for _ in range(rows)]
    for b in range(num_blocks):
        row, col0 = divmod(b, blocks_per_row)
        for s in range(block_size):
            col = col0 * block_size + s
            who = owners.get(b)
            if not who:
                hover[row][col] = f"block {b}, slot {s}: free"
                continue
            names = ", ".join(f"req {r}" for r in who)
            if s >= fill[b]:
                z[row][col] = -1
                hover[row][col] = f"block {b}, slot {s}: reserved by {names}, empty"
            else:
                z[row][col] = len(OWNER_COLORS) if len(who) > 1 else \
                    index.get(who[0], 0) % len(OWNER_COLORS)
                hover[row][col] = f"block {b}, slot {s}: a token of {names}" + (
                    f" (shared by {len(who)})" if len(who) > 1 else "")
    return z, hover


def _colorscale():
    colors = [EMPTY_COLOR, *OWNER_COLORS, SHARED_COLOR]   # z = -1, 0..23, 24
    n = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [(i / n, c), ((i + 1) / n, c)]
    return scale, -1.5, len(OWNER_COLORS) + 0.5


def block_map_figure(panels: Mapping[str, tuple[Mapping[str, list[int]], Mapping[str, int] | None]],
                     num_blocks: int, block_size: int, *, blocks_per_row: int | None = None,
                     owner_order: Sequence[str] | None = None, label_blocks: bool | None = None,
                     title: str = "", caption: str = "", height: int | None = None) -> go.Figure:
    """Block maps side by side (one panel per entry: name -> (block tables, tokens per request)).

    Each cell is a token slot; a block is `block_size` cells between white lines. Colour: the
    sequence owning the block (filled slots), pink for reserved-but-empty slots, black for a block
    shared by several sequences, light grey for free blocks."""
    if blocks_per_row is None:
        blocks_per_row = max(1, min(16, round(math.sqrt(num_blocks * 2))))
    if label_blocks is None:
        label_blocks = num_blocks <= 48
    rows = math.ceil(num_blocks / blocks_per_row)
    names = list(panels)
    fig = make_subplots(rows=len(names), cols=1, vertical_spacing=0.25 / len(names))
    _layout(fig, title, "", "", height=height or 110 + (60 + 34 * rows) * len(names))
    scale, zmin, zmax = _colorscale()
    order = owner_order
    if order is None:
        ids = {r for tables, _ in panels.values() for r in tables}
        order = sorted(ids, key=lambda r: (len(r), r))
    for p, name in enumerate(names, start=1):
        tables, num_tokens = panels[name]
        z, hover = block_grid(tables, num_blocks, block_size, num_tokens, blocks_per_row, order)
        fig.add_trace(go.Heatmap(z=z, text=hover, hoverinfo="text", colorscale=scale, zmin=zmin,
                                 zmax=zmax, showscale=False, ygap=4, hoverongaps=False),
                      row=p, col=1)
        xref = "x" if p == 1 else f"x{p}"
        yref = "y" if p == 1 else f"y{p}"
        for k in range(blocks_per_row + 1):
            fig.add_shape(type="line", x0=k * block_size - 0.5, x1=k * block_size - 0.5,
                          y0=-0.5, y1=rows - 0.5, xref=xref, yref=yref,
                          line=dict(color="white", width=3))
        if label_blocks:
            for b in range(num_blocks):
                row, c = divmod(b, blocks_per_row)
                fig.add_annotation(x=c * block_size + (block_size - 1) / 2, y=row, text=str(b),
                                   xref=xref, yref=yref, showarrow=False,
                                   font=dict(size=9, color="#555"))
        fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, row=p, col=1,
                         range=[-0.5, blocks_per_row * block_size - 0.5])
        fig.update_yaxes(autorange="reversed", showgrid=False, zeroline=False, row=p, col=1,
                         title_text=f"<b>{name}</b>", tickvals=list(range(rows)),
                         ticktext=[f"blocks {r * blocks_per_row}-"
                                   f"{min(num_blocks, (r + 1) * blocks_per_row) - 1}"
                                   for r in range(rows)])
    # A legend: invisible markers, one per kind of cell.
    for label, color in (("free block", FREE_COLOR), ("reserved slot, no token (wasted)", EMPTY_COLOR),
                         ("slot holding a token (colour = sequence)", OWNER_COLORS[0]),
                         ("block shared by several sequences", SHARED_COLOR)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker=dict(symbol="square", size=12, color=color,
                                             line=dict(color="#999", width=1))))
    fig.update_layout(plot_bgcolor=FREE_COLOR)
    fig.add_annotation(text=f"each cell is one token slot; {block_size} slots per block",
                       xref="paper", yref="paper", x=1.0, y=0.0, yshift=-18, showarrow=False,
                       xanchor="right", font=dict(size=11, color="#666"))
    return add_caption(fig, caption)


# ------------------------------------------------------------------------------------ memory
def kv_memory_figure(kv_bytes_per_token: int, weight_bytes: int, context_lens: Sequence[int],
                     batch_sizes: Sequence[int], *, title: str = "", caption: str = "") -> go.Figure:
    """KV cache size against context length for several batch sizes, with the weights as a line."""
    fig = go.Figure()
    for i, b in enumerate(batch_sizes):
        fig.add_trace(go.Scatter(
            x=list(context_lens), y=[b * n * kv_bytes_per_token / GIB for n in context_lens],
            mode="lines+markers", name=f"KV cache, {b} sequence{'s' if b > 1 else ''}",
            line=dict(color=PALETTE[i % len(PALETTE)]),
            hovertemplate="%{x} tokens: %{y:.2f} GiB<extra></extra>"))
    fig.add_trace(go.Scatter(x=[min(context_lens), max(context_lens)],
                             y=[weight_bytes / GIB] * 2, mode="lines", name="model weights",
                             line=dict(color="#444", dash="dash")))
    _layout(fig, title, "context length per sequence (tokens, log scale)",
            "memory (GiB, log scale)")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return add_caption(fig, caption)


def occupancy_figure(traces: Mapping[str, Sequence[StepRecord]], *, title: str = "",
                     caption: str = "") -> go.Figure:
    """Per step: sequences holding KV (top) and the share of held slots that hold a token (bottom)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    for i, (name, trace) in enumerate(traces.items()):
        color = PALETTE[i % len(PALETTE)]
        steps = [r.step for r in trace]
        fig.add_trace(go.Scatter(x=steps, y=[r.num_running for r in trace], mode="lines",
                                 line=dict(color=color, shape="hv", width=2.5),
                                 name=f"{name}: sequences holding KV"), row=1, col=1)
        util = [100 * r.kv_tokens_used / r.kv_tokens_reserved if r.kv_tokens_reserved else None
                for r in trace]
        fig.add_trace(go.Scatter(x=steps, y=util, mode="lines", showlegend=True,
                                 line=dict(color=color, dash="dot", width=2),
                                 name=f"{name}: slots in use (%)"), row=2, col=1)
    _layout(fig, title, "", "", height=560)
    fig.update_xaxes(title_text="engine step", row=2, col=1)
    fig.update_yaxes(title_text="sequences holding KV", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="held slots holding a token (%)", range=[0, 105], row=2, col=1)
    return add_caption(fig, caption)


def capacity_figure(labels: Sequence[str], max_seqs: Sequence[float], utilization: Sequence[float],
                    *, title: str = "", caption: str = "") -> go.Figure:
    """Two bar groups: most sequences held at once, and slot utilization (0..1), per layout."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.15,
                        subplot_titles=("sequences held at once (max)",
                                        "held slots holding a token (%)"))
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(labels))]
    fig.add_trace(go.Bar(x=list(labels), y=list(max_seqs), marker_color=colors,
                         texttemplate="%{y}", textposition="outside", showlegend=False), row=1, col=1)
    fig.add_trace(go.Bar(x=list(labels), y=[100 * u for u in utilization], marker_color=colors,
                         texttemplate="%{y:.0f}%", textposition="outside", showlegend=False),
                  row=1, col=2)
    _layout(fig, title, "", "", height=430)
    fig.update_yaxes(title_text="sequences", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="% of held slots", range=[0, 110], row=1, col=2)
    fig.update_xaxes(title_text="KV cache layout", row=1, col=1)
    fig.update_xaxes(title_text="KV cache layout", row=1, col=2)
    return add_caption(fig, caption)


# ------------------------------------------------------------------------------ fragmentation
def request_slots_figure(lengths: Sequence[int], slots: Sequence[int], block_size: int, *,
                         title: str = "", caption: str = "") -> go.Figure:
    """One bar per request: tokens it stores and the slots its blocks hold beyond them."""
    xs = list(range(len(lengths)))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=xs, y=list(lengths), name="tokens stored", marker_color=PALETTE[0]))
    fig.add_trace(go.Bar(x=xs, y=[s - n for s, n in zip(slots, lengths)],
                         name=f"empty slots in the last block (block size {block_size})",
                         marker_color=EMPTY_COLOR))
    _layout(fig, title, "request (sorted by length)", "token slots")
    fig.update_layout(barmode="stack", bargap=0.1)
    return add_caption(fig, caption)


def block_size_figure(block_sizes: Sequence[int], utilization: Sequence[float], *,
                      reference: Mapping[str, float] | None = None, title: str = "",
                      caption: str = "") -> go.Figure:
    """Slot utilization (0..1) against block size (log2 x), with reference lines."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(block_sizes), y=[100 * u for u in utilization],
                             mode="lines+markers", name="paged, this request mix",
                             line=dict(color=PALETTE[0], width=2.5),
                             hovertemplate="block size %{x}: %{y:.1f}%<extra></extra>"))
    for i, (name, u) in enumerate((reference or {}).items(), start=1):
        fig.add_trace(go.Scatter(x=[min(block_sizes), max(block_sizes)], y=[100 * u] * 2,
                                 mode="lines", name=name,
                                 line=dict(color=PALETTE[i % len(PALETTE)], dash="dash")))
    _layout(fig, title, "block size (tokens per block, log scale)", "held slots holding a token (%)")
    fig.update_xaxes(type="log", tickvals=list(block_sizes), ticktext=[str(b) for b in block_sizes])
    fig.update_yaxes(range=[0, 105])
    return add_caption(fig, caption)
