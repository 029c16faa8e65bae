"""Figures for chapter 01 (the anatomy of speed): where a decode step's time goes, the roofline
with one point per optimization, and the progress-log table.

Like every figure of `workbench.course.viz`, these take plain numbers (dicts and lists of floats) and return
a plotly Figure with a title that states the finding and a caption under the plot.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from workbench.course.viz.figures import PALETTE, _layout, add_caption, finish_with_top_legend

POINT_COLORS = PALETTE + ("#e377c2", "#17becf", "#bcbd22", "#7f7f7f")

# The buckets of workbench.bench.anatomy, in the order a step runs them, with fixed colours so a
# bucket looks the same in every bar and every redraw.
PART_COLORS = {
    "schedule + prepare": "#8c564b",
    "matmul": "#1f77b4",
    "attention": "#2ca02c",
    "other ops": "#ff7f0e",
    "overhead": "#d62728",
    "sample": "#9467bd",
    "postprocess": "#7f7f7f",
}


def anatomy_figure(labels: Sequence[str], parts: Sequence[Mapping[str, float]], *, title: str = "",
                   caption: str = "") -> go.Figure:
    """One horizontal stacked bar per configuration: milliseconds per decoded token in each part of
    a decode step (seconds in, milliseconds drawn)."""
    fig = go.Figure()
    names = list(PART_COLORS) + sorted({k for p in parts for k in p} - set(PART_COLORS))
    for name in names:
        ms = [1e3 * p.get(name, 0.0) for p in parts]
        fig.add_trace(go.Bar(
            y=list(labels), x=ms, name=name, orientation="h",
            marker_color=PART_COLORS.get(name, "#bcbd22"),
            hovertemplate=f"{name}: %{{x:.2f}} ms<extra>%{{y}}</extra>"))
    totals = [1e3 * sum(p.values()) for p in parts]
    fig.add_trace(go.Scatter(
        y=list(labels), x=totals, mode="text", text=[f"  {t:.1f} ms" for t in totals],
        textposition="middle right", showlegend=False, hoverinfo="skip"))
    _layout(fig, title, "time per decoded token (ms)", "", height=110 + 48 * max(len(labels), 2))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(range=[0, 1.18 * max(totals)], rangemode="tozero")
    return finish_with_top_legend(fig, caption)


def roofline_points_figure(points: Sequence[Mapping], bandwidth_gbs: float, peak_gflops: float, *,
                           title: str = "", caption: str = "") -> go.Figure:
    """The roofline of Williams, Waterman and Patterson: attained GFLOP/s against arithmetic
    intensity (FLOPs per byte read), both log scales, under the memory roof (bandwidth x intensity)
    and the compute roof (peak GFLOP/s). Each point is a dict with `label`, `intensity`,
    `gflops` and `tok_s` (shown in its label)."""
    xs = [p["intensity"] for p in points]
    lo = 10 ** math.floor(math.log10(min(xs) / 2))
    ridge = peak_gflops / bandwidth_gbs
    hi = 10 ** math.ceil(math.log10(max(max(xs), ridge) * 3))
    grid = [lo * (hi / lo) ** (i / 120) for i in range(121)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=grid, y=[min(bandwidth_gbs * x, peak_gflops) for x in grid], mode="lines",
        name=f"roof: min({bandwidth_gbs:.1f} GB/s x intensity, {peak_gflops:.0f} GFLOP/s)",
        line=dict(color="#7f7f7f", dash="dash"),
        hovertemplate="%{x:.2f} FLOP/byte: at most %{y:.0f} GFLOP/s<extra></extra>"))
    for i, p in enumerate(points):
        color = POINT_COLORS[i % len(POINT_COLORS)]
        fig.add_trace(go.Scatter(
            x=[p["intensity"]], y=[p["gflops"]], mode="markers+text", name=p["label"],
            text=[f"{p['label']}: {p['tok_s']:.0f} tok/s"],
            textposition=p.get("textposition", "middle right"),
            marker=dict(color=color, size=12, symbol=p.get("symbol", "circle")),
            hovertemplate=(f"{p['label']}: %{{x:.2f}} FLOP/byte, %{{y:.1f}} GFLOP/s, "
                           f"{p['tok_s']:.1f} tok/s<extra></extra>")))
    _layout(fig, title, "arithmetic intensity (FLOPs per byte read, log)",
            "attained GFLOP/s (log)", height=520)
    ys = [p["gflops"] for p in points]
    fig.update_xaxes(type="log", range=[math.log10(lo), math.log10(hi)])
    fig.update_yaxes(type="log", range=[math.log10(min(ys) / 3), math.log10(peak_gflops * 2)])
    return finish_with_top_legend(fig, caption, legend_rows=3)


def progress_table_figure(header: Sequence[str], rows: Sequence[Sequence], *, title: str = "",
                          caption: str = "") -> go.Figure:
    """A progress log as a table figure (it shows in static reports, unlike a widget)."""
    columns = [[row[i] for row in rows] for i in range(len(header))]
    fig = go.Figure(go.Table(
        columnwidth=[3.2] + [1] * (len(header) - 1),
        header=dict(values=[f"<b>{h}</b>" for h in header], fill_color="#eaeaea", align="left"),
        cells=dict(values=columns, align=["left"] + ["right"] * (len(header) - 1), height=26)))
    fig.update_layout(template="plotly_white", title=dict(text=title, x=0.02),
                      height=130 + 27 * (len(rows) + 1), margin=dict(l=10, r=10, t=60))
    return add_caption(fig, caption)
