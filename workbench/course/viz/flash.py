"""Figures for the FlashAttention chapter (plotly graph_objects).

    from workbench.attention.flash_reference import online_softmax_steps
    from workbench.course.viz.flash import online_softmax_figure
    steps = online_softmax_steps(scores, v, block_n=8)       # one record per key tile
    online_softmax_figure(scores, steps, exact, step=2).show()

Each returns a `go.Figure` with a title, axes with units and a caption under the plot. The
algorithms and counts they draw (online softmax, split-KV merge, tile maps, FLOPs and bytes) live
in workbench/attention/flash_reference.py.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from workbench.attention.flash_reference import attention_flops, naive_attention_bytes, flash_attention_bytes, SoftmaxStep, SKIP, MASKED, FULL
from workbench.course.viz.figures import PALETTE, _layout, add_caption

MIB = 2 ** 20
TILE_COLORS = {SKIP: "#eeeeee", MASKED: "#ff7f0e", FULL: "#1f77b4"}
TILE_NAMES = {SKIP: "skipped (never loaded)", MASKED: "computed with the mask",
              FULL: "computed, no mask"}


def _finish(fig: go.Figure, caption: str) -> go.Figure:
    """Caption under the plot, and the legend lifted above the subplot titles (the house layout
    puts it at the top edge of the plot, where subplot titles also sit). The top margin grows with
    the legend's estimated number of rows."""
    add_caption(fig, caption)
    names = [t.name for t in fig.data if t.showlegend is not False and t.name]
    # plotly lines a horizontal legend up in columns as wide as its widest entry (~6 px a character)
    per_row = max(1, 950 // (40 + 6 * max((len(n) for n in names), default=1)))
    rows = max(1, -(-len(names) // per_row))
    old_top = fig.layout.margin.t or 90
    top = 88 + 22 * rows           # title, then the legend rows, then 30 px for subplot titles
    height = (fig.layout.height or 430) + top - old_top
    plot_h = height - top - (fig.layout.margin.b or 80)
    fig.update_layout(height=height, margin=dict(t=top),
                      title=dict(y=1 - 18 / height, yref="container", yanchor="top"),
                      legend=dict(y=1 + 30 / plot_h, yanchor="bottom"))
    return fig


# ---------------------------------------------------------------------------------- counting


# ------------------------------------------------------------------------- online softmax


# --------------------------------------------------------------------------- split-KV merge


# -------------------------------------------------------------------------- GPU result files
# ------------------------------------------------------------------------------- figures
def bytes_moved_figure(seq_lens: Sequence[int], head_dim: int, elem_bytes: int, block_m: int,
                       block_n: int, causal: bool, peak_flops: float, bandwidth: float,
                       gpu: str, *, title: str = "", caption: str = "") -> go.Figure:
    """Left: HBM bytes per (batch, head) against sequence length, naive vs tiled (K/V re-read per
    query tile) vs a floor where Q, K, V, O cross HBM once. Right: FLOP per byte of each, with the
    GPU's ridge point (peak FLOP/s / bandwidth) as a line."""
    seq_lens = list(seq_lens)
    naive = [naive_attention_bytes(s, head_dim, elem_bytes) for s in seq_lens]
    tiled = [flash_attention_bytes(s, head_dim, elem_bytes, block_m, block_n, causal)
             for s in seq_lens]
    floor = [4 * s * head_dim * elem_bytes for s in seq_lens]
    flops = [attention_flops(s, s, head_dim, causal) for s in seq_lens]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("bytes moved per (batch, head)",
                                        "arithmetic intensity"))
    series = (("naive: (S, S) matrix through HBM", naive, PALETTE[3], "solid"),
              (f"tiled, K/V re-read per {block_m}-row query tile", tiled, PALETTE[0], "solid"),
              ("floor: Q, K, V, O once each", floor, "#7f7f7f", "dot"))
    for name, values, color, dash in series:
        fig.add_trace(go.Scatter(x=seq_lens, y=[b / MIB for b in values], mode="lines+markers",
                                 name=name, line=dict(color=color, dash=dash),
                                 hovertemplate="S=%{x}: %{y:,.1f} MiB<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=seq_lens, y=[f / b for f, b in zip(flops, values)],
                                 mode="lines+markers", name=name, showlegend=False,
                                 line=dict(color=color, dash=dash),
                                 hovertemplate="S=%{x}: %{y:,.0f} FLOP/byte<extra></extra>"),
                      row=1, col=2)
    ridge = peak_flops / bandwidth
    fig.add_trace(go.Scatter(x=[seq_lens[0], seq_lens[-1]], y=[ridge, ridge], mode="lines",
                             name=f"{gpu} ridge point: {ridge:.0f} FLOP/byte",
                             line=dict(color="black", dash="dash")), row=1, col=2)
    _layout(fig, title, "", "", height=460)
    for col in (1, 2):
        fig.update_xaxes(type="log", title_text="sequence length S (tokens, log scale)", row=1,
                         col=col, tickvals=seq_lens, ticktext=[_k(s) for s in seq_lens])
        fig.update_yaxes(type="log", row=1, col=col)
    fig.update_yaxes(title_text="HBM traffic (MiB, log scale)", row=1, col=1)
    fig.update_yaxes(title_text="FLOP per byte (log scale)", row=1, col=2)
    return _finish(fig, caption)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def cpu_timing_figure(seq_lens: Sequence[int], times: Mapping[str, Sequence[float]],
                      score_mib: Sequence[float], *, title: str = "",
                      caption: str = "") -> go.Figure:
    """Left: median time (s, drawn in ms) per implementation against S. Right: the memory the
    naive path's score matrix takes (MiB)."""
    seq_lens = list(seq_lens)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[0.62, 0.38],
                        subplot_titles=("time (median of repeats)",
                                        "the naive path's score matrix"))
    for i, (name, secs) in enumerate(times.items()):
        fig.add_trace(go.Scatter(x=seq_lens, y=[1e3 * s for s in secs], mode="lines+markers",
                                 name=name, line=dict(color=PALETTE[i % len(PALETTE)],
                                                      dash="dot" if "causal" in name else "solid"),
                                 hovertemplate="S=%{x}: %{y:.2f} ms<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=[str(s) for s in seq_lens], y=list(score_mib), name="score matrix",
                         marker_color=PALETTE[3], showlegend=False, texttemplate="%{y:,.0f}",
                         textposition="outside"), row=1, col=2)
    _layout(fig, title, "", "", height=460)
    fig.update_xaxes(type="log", tickvals=seq_lens, ticktext=[str(s) for s in seq_lens],
                     title_text="sequence length S (tokens, log scale)", row=1, col=1)
    fig.update_yaxes(type="log", title_text="time (ms, log scale)", row=1, col=1)
    fig.update_xaxes(title_text="sequence length S (tokens)", type="category", row=1, col=2)
    fig.update_yaxes(title_text="memory (MiB)", rangemode="tozero", row=1, col=2)
    return _finish(fig, caption)


def online_softmax_figure(scores: torch.Tensor, steps: Sequence[SoftmaxStep], exact: torch.Tensor,
                          step: int, row: int = 0, dims: int = 16, *, title: str = "",
                          caption: str = "") -> go.Figure:
    """The online softmax after `step` + 1 tiles, for one query row: its scores with the tiles
    seen so far (top), the running max and sum per step (bottom left), and the output so far
    against the exact answer (bottom right, the first `dims` dimensions)."""
    st = steps[step]
    s = scores[row].float()
    n = s.numel()
    fig = make_subplots(rows=2, cols=2, row_heights=[0.45, 0.55], vertical_spacing=0.2,
                        horizontal_spacing=0.14, specs=[[{"colspan": 2}, None],
                                                        [{"secondary_y": True}, {}]],
                        subplot_titles=(f"scores of query row {row} (keys in tiles of "
                                        f"{steps[0].end - steps[0].start})",
                                        "running max m and running sum l",
                                        f"output, first {dims} dimensions"))
    colors = ["#1f77b4" if k < st.start else "#ff7f0e" if k < st.end else "#d9d9d9"
              for k in range(n)]
    fig.add_trace(go.Bar(x=list(range(n)), y=s.tolist(), marker_color=colors, showlegend=False,
                         hovertemplate="key %{x}: score %{y:.2f}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=[-0.5, n - 0.5], y=[float(st.m[row])] * 2, mode="lines",
                             name=f"running max m after tile {step}",
                             line=dict(color=PALETTE[3], dash="dash")), row=1, col=1)
    for b in range(steps[0].end, n, steps[0].end):
        fig.add_vline(x=b - 0.5, line=dict(color="#999", width=1, dash="dot"), row=1, col=1)
    xs = list(range(len(steps)))
    ms = [float(x.m[row]) for x in steps]
    ls = [float(x.l[row]) for x in steps]
    faded = dict(size=[11 if i == step else 6 for i in xs],
                 opacity=[1.0 if i <= step else 0.25 for i in xs])
    fig.add_trace(go.Scatter(x=xs, y=ms, mode="lines+markers", name="m (left axis)",
                             line=dict(color=PALETTE[3]), marker=dict(color=PALETTE[3], **faded),
                             hovertemplate="after tile %{x}: m=%{y:.3f}<extra></extra>"),
                  row=2, col=1, secondary_y=False)
    fig.add_trace(go.Scatter(x=xs, y=ls, mode="lines+markers", name="l (right axis)",
                             line=dict(color=PALETTE[2]), marker=dict(color=PALETTE[2], **faded),
                             hovertemplate="after tile %{x}: l=%{y:.3f}<extra></extra>"),
                  row=2, col=1, secondary_y=True)
    d = list(range(min(dims, exact.shape[-1])))
    fig.add_trace(go.Bar(x=d, y=st.out[row, :len(d)].tolist(), marker_color=PALETTE[0],
                         name=f"acc / l after tile {step}", opacity=0.8), row=2, col=2)
    fig.add_trace(go.Scatter(x=d, y=exact[row, :len(d)].float().tolist(), mode="markers",
                             name="exact softmax(s) @ v",
                             marker=dict(color="black", symbol="line-ew-open", size=14,
                                         line=dict(width=3))), row=2, col=2)
    _layout(fig, title, "", "", height=640)
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title_text="key index", row=1, col=1)
    fig.update_yaxes(title_text="score (q·k / √D)", row=1, col=1)
    fig.update_xaxes(title_text="key tile just processed", dtick=1, row=2, col=1)
    fig.update_yaxes(title_text="m (score units)", row=2, col=1, secondary_y=False)
    fig.update_yaxes(title_text="l (sum of exp(s - m))", row=2, col=1, secondary_y=True,
                     showgrid=False)
    fig.update_xaxes(title_text="output dimension", row=2, col=2)
    fig.update_yaxes(title_text="value", row=2, col=2)
    return _finish(fig, caption)


def tile_map_figure(tmap: Sequence[Sequence[int]], block_m: int, block_n: int,
                    curve: Mapping[str, tuple[Sequence[int], Sequence[float]]] | None = None, *,
                    title: str = "", caption: str = "") -> go.Figure:
    """Left: the (query tile, key tile) grid coloured by what the causal kernel does with each
    tile. Right (optional): skipped fraction against sequence length, one line per tile shape."""
    cols = 2 if curve else 1
    fig = make_subplots(rows=1, cols=cols, horizontal_spacing=0.14,
                        column_widths=[0.5, 0.5] if curve else [1.0],
                        subplot_titles=(f"tiles of {block_m} queries x {block_n} keys",
                                        "tiles never loaded")[:cols])
    scale = []
    for code in (SKIP, MASKED, FULL):
        scale += [(code / 3, TILE_COLORS[code]), ((code + 1) / 3, TILE_COLORS[code])]
    hover = [[f"query tile {i} (rows {i * block_m}-{(i + 1) * block_m - 1}), key tile {j} (keys "
              f"{j * block_n}-{(j + 1) * block_n - 1}): {TILE_NAMES[c]}" for j, c in enumerate(r)]
             for i, r in enumerate(tmap)]
    fig.add_trace(go.Heatmap(z=[list(r) for r in tmap], colorscale=scale, zmin=-0.5, zmax=2.5,
                             showscale=False, xgap=2, ygap=2, text=hover, hoverinfo="text"),
                  row=1, col=1)
    for code in (FULL, MASKED, SKIP):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=TILE_NAMES[code],
                                 marker=dict(symbol="square", size=12, color=TILE_COLORS[code],
                                             line=dict(color="#999", width=1))), row=1, col=1)
    if curve:
        for i, (name, (xs, fr)) in enumerate(curve.items()):
            fig.add_trace(go.Scatter(x=list(xs), y=[100 * f for f in fr], mode="lines+markers",
                                     name=name, line=dict(color=PALETTE[(i + 2) % len(PALETTE)]),
                                     hovertemplate="S=%{x}: %{y:.1f}%<extra></extra>"),
                          row=1, col=2)
        xs_all = [x for xs, _ in curve.values() for x in xs]
        fig.add_trace(go.Scatter(x=[min(xs_all), max(xs_all)], y=[50, 50], mode="lines",
                                 name="the limit: half", line=dict(color="black", dash="dash")),
                      row=1, col=2)
    _layout(fig, title, "", "", height=480)
    fig.update_yaxes(autorange="reversed", title_text="query tile", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="key tile", dtick=1 if len(tmap[0]) <= 16 else None, row=1, col=1)
    if curve:
        fig.update_xaxes(type="log", title_text="sequence length S (tokens, log scale)", row=1,
                         col=2)
        fig.update_yaxes(title_text="tiles skipped (% of all tiles)", range=[0, 55], row=1, col=2)
    return _finish(fig, caption)


def split_weights_figure(panels: Mapping[str, tuple[Sequence[tuple[int, int]], Sequence[float]]],
                         *, title: str = "", caption: str = "") -> go.Figure:
    """One horizontal row per split count: each split is a segment over its key range, labelled
    with its merge weight (its share of the softmax mass)."""
    fig = go.Figure()
    names = list(panels)
    for i, name in enumerate(names):
        bounds, weights = panels[name]
        for s, ((a, b), w) in enumerate(zip(bounds, weights)):
            fig.add_trace(go.Bar(
                y=[name], x=[b - a], base=[a], orientation="h", showlegend=False,
                marker=dict(color=PALETTE[s % len(PALETTE)], opacity=0.35 + 0.65 * float(w),
                            line=dict(color="white", width=2)),
                text=[f"w={float(w):.2f}"], textposition="inside", insidetextanchor="middle",
                hovertemplate=f"{name}, split {s}: keys {a}-{b - 1}, weight {float(w):.3f}"
                              "<extra></extra>"))
    _layout(fig, title, "key position (index in the sequence)", "", height=160 + 70 * len(names))
    fig.update_layout(barmode="overlay", bargap=0.3)
    fig.update_yaxes(autorange="reversed", title_text="phase 1 programs per head")
    return add_caption(fig, caption)


def published_figure(published: Mapping[str, Sequence[float]], seq_lens: Sequence[int],
                     committed: Sequence[dict] = (), peak_tflops: float | None = None,
                     peak_label: str = "", *, title: str = "", caption: str = "") -> go.Figure:
    """Published forward-attention TFLOP/s per implementation (grouped bars against sequence
    length; None = not run), and, when committed GPU results exist, their TFLOP/s in a second
    panel (this kernel vs SDPA, per head dim / causal)."""
    rows = [r for res in committed for r in res.get("flash_attention", [])]
    cols = 2 if rows else 1
    fig = make_subplots(rows=1, cols=cols, horizontal_spacing=0.1,
                        subplot_titles=("published (H100 SXM5, FP16, head dim 128)",
                                        "committed runs of this workbench")[:cols])
    labels = [_k(s) for s in seq_lens]
    for i, (name, values) in enumerate(published.items()):
        fig.add_trace(go.Bar(x=labels, y=[v if v is not None else 0 for v in values], name=name,
                             marker_color=PALETTE[i % len(PALETTE)],
                             text=[f"{v:.0f}" if v is not None else "OOM" for v in values],
                             textposition="outside", textfont=dict(size=9),
                             hovertemplate=f"{name}, S=%{{x}}: %{{y}} TFLOP/s<extra></extra>"),
                      row=1, col=1)
    if peak_tflops:
        fig.add_hline(y=peak_tflops, line=dict(color="black", dash="dash"), row=1, col=1,
                      annotation_text=peak_label, annotation_position="top left")
    if rows:
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault((r["head_dim"], r["causal"], r.get("dtype", "")), []).append(r)
        gpu = committed[-1].get("gpu", "GPU")
        for i, (key, rs) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
            rs = sorted(rs, key=lambda r: r["seq_len"])
            tag = f"D={key[0]}, {'causal' if key[1] else 'full'}, {key[2]}"
            color = PALETTE[i % len(PALETTE)]
            fig.add_trace(go.Scatter(x=[r["seq_len"] for r in rs], y=[r["triton_tflops"] for r in rs],
                                     mode="lines+markers", name=f"{gpu} this kernel, {tag}",
                                     line=dict(color=color)), row=1, col=2)
            fig.add_trace(go.Scatter(x=[r["seq_len"] for r in rs], y=[r["sdpa_tflops"] for r in rs],
                                     mode="lines+markers", name=f"{gpu} SDPA, {tag}",
                                     line=dict(color=color, dash="dot")), row=1, col=2)
    _layout(fig, title, "", "", height=480)
    if rows:
        ticks = sorted({r["seq_len"] for r in rows})
        fig.update_xaxes(type="log", title_text="sequence length (tokens, log scale)", row=1, col=2,
                         tickvals=ticks, ticktext=[_k(t) for t in ticks])
        fig.update_yaxes(title_text="forward attention TFLOP/s", rangemode="tozero", row=1, col=2)
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="sequence length (tokens)", row=1, col=1)
    fig.update_yaxes(title_text="forward attention TFLOP/s", rangemode="tozero", row=1, col=1)
    return _finish(fig, caption)


__all__ = ["bytes_moved_figure", "cpu_timing_figure", "online_softmax_figure", "tile_map_figure", "split_weights_figure", "published_figure"]
