"""Plotly figures for the chapters.

Every function takes plain numbers (lists of floats and ints) or `StepRecord`s, never the engine
itself, and returns a `plotly.graph_objects.Figure` with a title that states the finding, axes with
units and a caption under the plot. Times come in seconds and are drawn in milliseconds.
"""
from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence

import plotly.graph_objects as go

from workbench.engine.trace import StepRecord

PREFILL_COLOR = "#1f77b4"
DECODE_COLOR = "#ff7f0e"
BOUND_COLOR = "#7f7f7f"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
CAPTION_WIDTH = 110  # characters per caption line


def _ms(values: Sequence[float]) -> list[float]:
    return [1e3 * float(v) for v in values]


def _layout(fig: go.Figure, title: str, x_title: str, y_title: str, height: int = 430) -> None:
    fig.update_layout(template="plotly_white", height=height, title=dict(text=title, x=0.02),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0.0),
                      hovermode="closest")
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)


def add_caption(fig: go.Figure, text: str) -> go.Figure:
    """Put a caption sentence under the plot, inside the figure, so it travels with it."""
    if not text:
        return fig
    lines = textwrap.wrap(text, CAPTION_WIDTH)
    fig.add_annotation(text="<br>".join(lines), xref="paper", yref="paper", x=0.0, y=0.0,
                       yshift=-62, xanchor="left", yanchor="top", showarrow=False, align="left",
                       font=dict(size=12, color="#444"))
    bottom = 80 + 17 * len(lines)
    fig.update_layout(margin=dict(b=bottom, t=90), height=(fig.layout.height or 430) + 17 * len(lines))
    return fig


def finish_with_top_legend(fig: go.Figure, caption: str, legend_rows: int = 1) -> go.Figure:
    """Caption under the plot (add_caption); the legend sits between the title and the plot."""
    add_caption(fig, caption)
    top = 96 + 20 * legend_rows
    height = (fig.layout.height or 430) + top - (fig.layout.margin.t or 90)
    plot_h = height - top - (fig.layout.margin.b or 80)
    fig.update_layout(height=height, margin=dict(t=top),
                      title=dict(y=1 - 18 / height, yref="container", yanchor="top"),
                      legend=dict(y=1 + 34 / plot_h, yanchor="bottom"))
    return fig


def rolling_median(values: Sequence[float], window: int = 9) -> list[float]:
    """Median over a centred window: a noise-resistant trend line for per-step timings."""
    half = max(window, 1) // 2
    vals = list(values)
    return [statistics.median(vals[max(0, i - half):i + half + 1]) for i in range(len(vals))]


# ------------------------------------------------------------------------------------ prefill
def prefill_figure(prompt_lens: Sequence[int], seconds_per_token: Sequence[float], *,
                   decode_seconds_per_token: float | None = None, title: str = "",
                   caption: str = "") -> go.Figure:
    """Prefill time per prompt token against prompt length (log x), with decode's per-token
    time as a reference line."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(prompt_lens), y=_ms(seconds_per_token), mode="lines+markers",
                             name="prefill: time per prompt token", line=dict(color=PREFILL_COLOR),
                             hovertemplate="%{x} tokens: %{y:.2f} ms/token<extra></extra>"))
    if decode_seconds_per_token is not None:
        fig.add_trace(go.Scatter(x=[min(prompt_lens), max(prompt_lens)],
                                 y=_ms([decode_seconds_per_token] * 2), mode="lines",
                                 name="decode: time per output token",
                                 line=dict(color=DECODE_COLOR, dash="dash"),
                                 hovertemplate="decode: %{y:.2f} ms/token<extra></extra>"))
    _layout(fig, title, "prompt length (tokens, log scale)", "time per token (ms, log scale)")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return add_caption(fig, caption)


# ------------------------------------------------------------------------------------- decode
def decode_figure(series: dict[str, tuple[Sequence[int], Sequence[float]]], *,
                  floor: dict[str, tuple[Sequence[int], Sequence[float]]] | None = None,
                  title: str = "", caption: str = "", window: int = 9) -> go.Figure:
    """Time of each decode step against the context length it attended over.

    series: name -> (context lengths, seconds per step); each is drawn as faint markers plus a
    rolling median. floor: name -> (context lengths, seconds), drawn as dotted lines (for example
    the roofline's bytes / bandwidth time per token).
    """
    fig = go.Figure()
    for i, (name, (ctx, secs)) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=list(ctx), y=_ms(secs), mode="markers", name=f"{name}: each step",
                                 marker=dict(color=color, size=4, opacity=0.35),
                                 hovertemplate="context %{x}: %{y:.1f} ms<extra></extra>"))
        fig.add_trace(go.Scatter(x=list(ctx), y=_ms(rolling_median(secs, window)), mode="lines",
                                 name=f"{name}: rolling median", line=dict(color=color, width=2.5),
                                 hoverinfo="skip"))
    for i, (name, (ctx, secs)) in enumerate((floor or {}).items()):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=list(ctx), y=_ms(secs), mode="lines", name=name,
                                 line=dict(color=color, dash="dot", width=2),
                                 hovertemplate="context %{x}: %{y:.2f} ms<extra></extra>"))
    _layout(fig, title, "context length (tokens in the KV cache)", "time per decode step (ms)")
    fig.update_yaxes(rangemode="tozero")
    return add_caption(fig, caption)


# ----------------------------------------------------------------------------------- timeline
def timeline_figure(records: Sequence[StepRecord], *, title: str = "",
                    caption: str = "") -> go.Figure:
    """One bar per engine step, coloured by kind: a request's prefill step, then its decode steps."""
    kinds = ["prefill" if r.num_prefill_tokens else "decode" for r in records]
    fig = go.Figure()
    for kind, color in (("prefill", PREFILL_COLOR), ("decode", DECODE_COLOR)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if not idx:
            continue
        fig.add_trace(go.Bar(
            x=[records[i].step for i in idx], y=_ms([records[i].total_s for i in idx]),
            name=f"{kind} step", marker_color=color,
            customdata=[[records[i].num_tokens] for i in idx],
            hovertemplate="step %{x}: %{y:.1f} ms, %{customdata[0]} tokens<extra></extra>"))
    _layout(fig, title, "engine step", "step time (ms)")
    fig.update_layout(bargap=0.15)
    return add_caption(fig, caption)


# ----------------------------------------------------------------------------------- roofline
def roofline_figure(labels: Sequence[str], measured_tok_s: Sequence[float],
                    bound_tok_s: Sequence[float], *, title: str = "",
                    caption: str = "") -> go.Figure:
    """Measured decode tokens/s next to the memory-bandwidth bound, one group per label."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=list(labels), y=list(bound_tok_s), name="bound: bandwidth / bytes per token",
                         marker_color=BOUND_COLOR, texttemplate="%{y:.0f}", textposition="outside"))
    fig.add_trace(go.Bar(x=list(labels), y=list(measured_tok_s), name="measured decode",
                         marker_color=DECODE_COLOR, texttemplate="%{y:.0f}", textposition="outside"))
    _layout(fig, title, "configuration", "decode speed (tokens/s, batch 1)")
    fig.update_layout(barmode="group")
    fig.update_yaxes(rangemode="tozero")
    return add_caption(fig, caption)


# ------------------------------------------------------------------------- latency breakdown
def estimate_latency(prompt_len: int, output_tokens: int, prompt_lens: Sequence[int],
                     prefill_seconds: Sequence[float], tpot_seconds: float) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one request, from measurements: prefill time is
    interpolated linearly between the measured prompt lengths (extrapolated from the last two
    beyond them); the first output token comes out of prefill, each later one costs one TPOT."""
    pts = sorted(zip(prompt_lens, prefill_seconds))
    if len(pts) == 1:
        (n0, t0), = pts
        prefill = t0 * prompt_len / n0
    else:
        lo, hi = pts[0], pts[1]
        for a, b in zip(pts, pts[1:]):
            lo, hi = a, b
            if prompt_len <= b[0]:
                break
        (n0, t0), (n1, t1) = lo, hi
        prefill = t0 + (t1 - t0) * (prompt_len - n0) / (n1 - n0)
        prefill = max(prefill, 0.0)
    return prefill, tpot_seconds * max(output_tokens - 1, 0)


def latency_breakdown_figure(labels: Sequence[str], prefill_seconds: Sequence[float],
                             decode_seconds: Sequence[float], *, title: str = "",
                             caption: str = "") -> go.Figure:
    """Horizontal stacked bars: how much of each request's latency is prefill and how much decode."""
    fig = go.Figure()
    fig.add_trace(go.Bar(y=list(labels), x=list(prefill_seconds), orientation="h",
                         name="prefill (time to first token)", marker_color=PREFILL_COLOR,
                         hovertemplate="%{y}: prefill %{x:.2f} s<extra></extra>"))
    fig.add_trace(go.Bar(y=list(labels), x=list(decode_seconds), orientation="h",
                         name="decode (the other tokens)", marker_color=DECODE_COLOR,
                         hovertemplate="%{y}: decode %{x:.2f} s<extra></extra>"))
    _layout(fig, title, "latency of one request (s)", "request", height=160 + 45 * len(labels))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed")
    return add_caption(fig, caption)
