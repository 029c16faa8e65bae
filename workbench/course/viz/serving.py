"""Figures for chapter 08 (serving): one request's time, latency against load, decode stalls by
prefill budget, a live metrics panel's history, priority classes and prefix-aware routing."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.course.viz.figures import PALETTE, _layout, add_caption, finish_with_top_legend


def request_breakdown_figure(parts: Mapping[str, float], *, title: str,
                             caption: str) -> go.Figure:
    """One horizontal bar: consecutive phases of a request, in milliseconds."""
    fig = go.Figure()
    start = 0.0
    for i, (name, seconds) in enumerate(parts.items()):
        ms = 1e3 * seconds
        fig.add_bar(y=["one request"], x=[ms], base=[start], orientation="h", name=name,
                    marker_color=PALETTE[i % len(PALETTE)], text=[f"{ms:.0f} ms"],
                    textposition="inside", insidetextanchor="middle")
        start += ms
    _layout(fig, title, "time since the client sent the request (ms)", "", height=260)
    fig.update_layout(barmode="overlay")
    return finish_with_top_legend(fig, caption)


def latency_vs_load_figure(rates: Sequence[float], ttft: Mapping[str, Sequence[float]],
                           tpot: Mapping[str, Sequence[float]], throughput: Sequence[float],
                           knee: float | None, *, title: str, caption: str) -> go.Figure:
    """Left: TTFT percentiles; right: TPOT percentiles; both against the offered rate (log x),
    with the output throughput reached on the right's secondary axis."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token",
                                                        "time per output token"),
                        specs=[[{}, {"secondary_y": True}]])
    for i, (name, ys) in enumerate(ttft.items()):
        fig.add_scatter(x=list(rates), y=[1e3 * y for y in ys], name=f"TTFT {name}",
                        mode="lines+markers", line=dict(color=PALETTE[0], dash=["solid", "dash",
                                                                                "dot"][i % 3]),
                        row=1, col=1)
    for i, (name, ys) in enumerate(tpot.items()):
        fig.add_scatter(x=list(rates), y=[1e3 * y for y in ys], name=f"TPOT {name}",
                        mode="lines+markers", line=dict(color=PALETTE[1], dash=["solid", "dash",
                                                                                "dot"][i % 3]),
                        row=1, col=2)
    fig.add_scatter(x=list(rates), y=list(throughput), name="output tok/s reached",
                    mode="lines+markers", line=dict(color=PALETTE[2]), row=1, col=2,
                    secondary_y=True)
    if knee is not None:
        for col in (1, 2):
            fig.add_vline(x=knee, line=dict(color="#7f7f7f", dash="dash"), row=1, col=col)
    _layout(fig, title, "", "", height=460)
    fig.update_xaxes(type="log", title_text="offered load (requests/s)")
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=2, secondary_y=False)
    fig.update_yaxes(title_text="tok/s", row=1, col=2, secondary_y=True, showgrid=False)
    return finish_with_top_legend(fig, caption, legend_rows=2)


def itl_figure(series: Mapping[str, Sequence[float]], *, title: str, caption: str) -> go.Figure:
    """The distribution of gaps between streamed chunks, one box per configuration."""
    fig = go.Figure()
    for i, (name, gaps) in enumerate(series.items()):
        fig.add_box(y=[1e3 * g for g in gaps], name=name, marker_color=PALETTE[i % 6],
                    boxpoints="outliers")
    _layout(fig, title, "", "gap between streamed tokens (ms, log)")
    fig.update_yaxes(type="log")
    fig.update_layout(showlegend=False)
    return add_caption(fig, caption)


def live_figure(times: Sequence[float], series: Mapping[str, Sequence[float]],
                kv_usage: Sequence[float], *, title: str, caption: str) -> go.Figure:
    """Metrics polled during a load: request counts (left axis) and KV usage (right axis)."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for i, (name, ys) in enumerate(series.items()):
        fig.add_scatter(x=list(times), y=list(ys), name=name, mode="lines",
                        line=dict(color=PALETTE[i % 6], shape="hv"))
    fig.add_scatter(x=list(times), y=[100 * k for k in kv_usage], name="KV cache used (%)",
                    mode="lines", line=dict(color=PALETTE[3], dash="dot"), secondary_y=True)
    _layout(fig, title, "time since the load started (s)", "requests")
    fig.update_yaxes(title_text="KV cache used (%)", range=[0, 100], secondary_y=True,
                     tickvals=[0, 25, 50, 75, 100], showgrid=False)
    return finish_with_top_legend(fig, caption)


def bars_figure(labels: Sequence[str], values: Sequence[float], *, y_title: str, title: str,
                caption: str, text_format: str = "{:.2f}") -> go.Figure:
    fig = go.Figure(go.Bar(x=list(labels), y=list(values),
                           marker_color=[PALETTE[i % 6] for i in range(len(labels))],
                           text=[text_format.format(v) for v in values], textposition="outside"))
    _layout(fig, title, "", y_title, height=400)
    fig.update_layout(showlegend=False)
    return add_caption(fig, caption)
