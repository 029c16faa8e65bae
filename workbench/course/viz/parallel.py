"""Figures for chapter 07 (parallelism): how the matrices split, compute against communication,
the all-reduce's cost per call, pipeline schedules (drawn from the formula and measured from the
workers' own clocks), and expert routing."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.engine.trace import StepRecord
from workbench.parallel.pipeline import gpipe_schedule
from workbench.course.viz.figures import PALETTE, _layout, add_caption, finish_with_top_legend


def split_figure(matrices: Mapping[str, tuple[str, Sequence[tuple[int, int]]]], *, title: str,
                 caption: str) -> go.Figure:
    """matrices: name -> (the split dimension's label, [(start, end) per rank]). One bar per
    matrix, its split dimension (drawn as 0-100%, the index ranges written in) cut into
    coloured rank slices."""
    fig = go.Figure()
    names = list(matrices)
    ranks = max(len(s) for _, s in matrices.values())
    for r in range(ranks):
        xs, bases, texts = [], [], []
        for name in names:
            _, spans = matrices[name]
            total = spans[-1][1]
            lo, hi = spans[r]
            xs.append(100 * (hi - lo) / total)
            bases.append(100 * lo / total)
            texts.append(f"{lo}-{hi}")
        fig.add_bar(y=[f"{n}<br>({matrices[n][0]})" for n in names], x=xs, base=bases,
                    orientation="h", name=f"rank {r}", marker_color=PALETTE[r % len(PALETTE)],
                    text=texts, textposition="inside", insidetextanchor="middle")
    _layout(fig, title, "share of the split dimension (%); index ranges written in", "",
            height=380)
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(autorange="reversed")
    return finish_with_top_legend(fig, caption)


def compute_comm_figure(labels: Sequence[str], compute_ms: Sequence[float],
                        comm_ms: Mapping[str, Sequence[float]], *, title: str,
                        caption: str) -> go.Figure:
    """Per layout, one worker's milliseconds per decode step: compute, then each collective."""
    fig = go.Figure()
    fig.add_bar(x=list(labels), y=list(compute_ms), name="compute", marker_color=PALETTE[0])
    for i, (name, ms) in enumerate(comm_ms.items()):
        fig.add_bar(x=list(labels), y=list(ms), name=name, marker_color=PALETTE[(i + 1) % 6])
    _layout(fig, title, "layout", "ms per decode step (one worker)")
    fig.update_layout(barmode="stack")
    return finish_with_top_legend(fig, caption)


def allreduce_cost_figure(payload_bytes: Sequence[float], seconds: Sequence[float],
                          latency_s: float, bandwidth: float, *, title: str,
                          caption: str) -> go.Figure:
    """Measured seconds per all-reduce call against its payload, with the fitted alpha + S/beta."""
    fig = go.Figure()
    fig.add_scatter(x=list(payload_bytes), y=[1e3 * s for s in seconds], mode="markers",
                    name="measured (one step's mean per call)", marker=dict(color=PALETTE[0]))
    lo, hi = min(payload_bytes), max(payload_bytes)
    xs = [lo * (hi / lo) ** (i / 40) for i in range(41)] if lo > 0 else [lo, hi]
    fig.add_scatter(x=xs, y=[1e3 * (latency_s + x / bandwidth) for x in xs], mode="lines",
                    name=f"fit: {1e6 * latency_s:.0f} µs + bytes / {bandwidth / 1e9:.2f} GB/s",
                    line=dict(color=PALETTE[3], dash="dash"))
    _layout(fig, title, "payload per call (bytes)", "ms per all-reduce")
    fig.update_xaxes(type="log")
    return finish_with_top_legend(fig, caption)


def schedule_figure(num_stages: int, num_microbatches: int, *, title: str,
                    caption: str) -> go.Figure:
    """The formula's picture: stages by time slots, each box one micro-batch on one stage."""
    spans = [(s, m, t, t + 1) for s, m, t in gpipe_schedule(num_stages, num_microbatches)]
    return _gantt(spans, num_stages, "time (slots of one stage's work)", title, caption)


def measured_schedule_figure(records: Sequence[StepRecord], *, title: str,
                             caption: str) -> go.Figure:
    """The workers' own clocks: when each stage ran each batch (colour: the micro-batch slot)."""
    t0 = min(s for r in records for s, _ in r.stage_spans)
    spans = [(stage, r.micro_batch, 1e3 * (a - t0), 1e3 * (b - t0))
             for r in records for stage, (a, b) in enumerate(r.stage_spans)]
    num_stages = max(len(r.stage_spans) for r in records)
    return _gantt(spans, num_stages, "time (ms)", title, caption, label_steps=False)


def _gantt(spans, num_stages: int, x_title: str, title: str, caption: str,
           label_steps: bool = True) -> go.Figure:
    fig = go.Figure()
    seen = set()
    for stage, mb, a, b in spans:
        fig.add_bar(y=[f"stage {stage}"], x=[b - a], base=[a], orientation="h",
                    marker=dict(color=PALETTE[mb % len(PALETTE)], line=dict(color="white",
                                                                               width=1)),
                    name=f"micro-batch {mb}", legendgroup=str(mb), showlegend=mb not in seen,
                    text=[str(mb)] if label_steps else None, textposition="inside",
                    hovertemplate=f"stage {stage}, micro-batch {mb}: %{{base:.1f}} - "
                                  f"{b:.1f}<extra></extra>")
        seen.add(mb)
    _layout(fig, title, x_title, "", height=200 + 40 * num_stages)
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(autorange="reversed")
    return finish_with_top_legend(fig, caption)


def routing_figure(tokens_per_expert: Sequence[Sequence[int]], *, title: str,
                   caption: str) -> go.Figure:
    """Share of each layer's (token, expert) assignments that went to each expert."""
    shares = [[c / max(1, sum(row)) for c in row] for row in tokens_per_expert]
    fig = go.Figure(go.Heatmap(z=shares, colorscale="Blues", zmin=0,
                               colorbar=dict(title="share", tickformat=".0%"),
                               hovertemplate="layer %{y}, expert %{x}: %{z:.1%}<extra></extra>"))
    _layout(fig, title, "expert", "layer", height=460)
    fig.update_yaxes(autorange="reversed")
    return add_caption(fig, caption)


def moe_quality_figure(top_ks: Sequence[int], kl: Sequence[float], agree: Sequence[float], *,
                       oracle: tuple[Sequence[float], Sequence[float]] | None = None,
                       title: str, caption: str) -> go.Figure:
    """Against the dense model: KL of the next-token distributions (left, log) and greedy
    agreement (right), for the router and, dashed, for an oracle router."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    series = [("router", kl, agree, "solid")]
    if oracle is not None:
        series.append(("oracle", oracle[0], oracle[1], "dash"))
    for name, k_l, ag, dash in series:
        fig.add_scatter(x=list(top_ks), y=[max(v, 1e-9) for v in k_l], name=f"KL to dense, {name}",
                        mode="lines+markers", line=dict(color=PALETTE[0], dash=dash))
        fig.add_scatter(x=list(top_ks), y=[100 * a for a in ag], name=f"same top-1, {name}",
                        mode="lines+markers", line=dict(color=PALETTE[1], dash=dash),
                        secondary_y=True)
    _layout(fig, title, "experts per token (top_k)", "")
    fig.update_yaxes(title_text="KL (nats, log)", type="log", secondary_y=False)
    fig.update_yaxes(title_text="top-1 agreement (%)", range=[0, 101], tickvals=[0, 25, 50, 75, 100],
                     showgrid=False, secondary_y=True)
    return finish_with_top_legend(fig, caption, legend_rows=2 if oracle is not None else 1)
