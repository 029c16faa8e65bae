"""Figures for chapter 10 (production): KV blocks of parallel samples, the cost of a grammar per
decode step, overload with and without admission control, SLO-aware batching against fixed
budgets, and a replica killed behind the router."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.course.viz.figures import PALETTE, _layout, finish_with_top_legend

COLORS = PALETTE + ("#e377c2", "#17becf", "#bcbd22", "#7f7f7f")   # the dashboard's roles


def blocks_figure(ns: Sequence[int], shared: Sequence[int], separate: Sequence[int], *,
                  title: str, caption: str) -> go.Figure:
    """Peak KV blocks held against the number of samples: one request with n samples that fork
    the prompt's blocks, against n separate requests."""
    fig = go.Figure()
    fig.add_bar(x=[str(n) for n in ns], y=list(separate), name="n separate requests",
                marker_color=PALETTE[1], text=list(separate), textposition="outside")
    fig.add_bar(x=[str(n) for n in ns], y=list(shared), name="one request, n samples (fork)",
                marker_color=PALETTE[0], text=list(shared), textposition="outside")
    _layout(fig, title, "samples of the prompt (n)", "peak KV blocks held")
    fig.update_layout(barmode="group")
    return finish_with_top_legend(fig, caption)


def step_phases_figure(labels: Sequence[str], phases: Mapping[str, Sequence[float]], *,
                       title: str, caption: str) -> go.Figure:
    """Stacked bars: mean milliseconds per decode step in each phase, one bar per run."""
    fig = go.Figure()
    for i, (phase, seconds) in enumerate(phases.items()):
        fig.add_bar(x=list(labels), y=[1e3 * s for s in seconds], name=phase,
                    marker_color=PALETTE[i % len(PALETTE)])
    _layout(fig, title, "", "ms per decode step")
    fig.update_layout(barmode="stack")
    return finish_with_top_legend(fig, caption)


def overload_figure(rates: Sequence[float], runs: Mapping[str, Mapping[str, Sequence[float]]],
                    *, title: str, caption: str) -> go.Figure:
    """Per configuration, against the offered rate: TTFT p99 of the served requests (left),
    goodput and rejected requests per second (right)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT p99 of served requests",
                                                        "goodput and rejections"))
    for i, (name, r) in enumerate(runs.items()):
        color = PALETTE[i % len(PALETTE)]
        fig.add_scatter(x=list(rates), y=[1e3 * v for v in r["ttft_p99"]], name=f"{name}",
                        mode="lines+markers", line=dict(color=color), row=1, col=1)
        fig.add_scatter(x=list(rates), y=list(r["goodput"]), name=f"{name}: goodput",
                        mode="lines+markers", line=dict(color=color), row=1, col=2,
                        showlegend=False)
        fig.add_scatter(x=list(rates), y=list(r["rejected"]), name=f"{name}: rejected/s",
                        mode="lines+markers", line=dict(color=color, dash="dot"), row=1, col=2)
    _layout(fig, title, "", "", height=460)
    fig.update_xaxes(type="log", title_text="offered load (requests/s)")
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="requests/s", row=1, col=2)
    return finish_with_top_legend(fig, caption, legend_rows=2)


def slo_batching_figure(labels: Sequence[str], metrics: Mapping[str, Sequence[float]], *,
                        title: str, caption: str) -> go.Figure:
    """One panel per metric (name -> a value per configuration), bars per configuration."""
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=list(metrics))
    for c, (name, values) in enumerate(metrics.items(), start=1):
        fig.add_bar(x=list(labels), y=list(values), row=1, col=c, showlegend=False,
                    marker_color=[PALETTE[i % len(PALETTE)] for i in range(len(labels))],
                    text=[f"{v:.3g}" for v in values], textposition="outside")
    _layout(fig, title, "", "", height=430)
    return finish_with_top_legend(fig, caption)


def failover_figure(times: Sequence[float], up: Mapping[str, Sequence[bool]],
                    served: Mapping[str, Sequence[int]], kill_time: float, *, title: str,
                    caption: str) -> go.Figure:
    """The router's view while a replica dies: each replica's state (up = 1) and the requests it
    has been sent, against time."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for i, name in enumerate(up):
        color = PALETTE[i % len(PALETTE)]
        fig.add_scatter(x=list(times), y=[int(u) for u in up[name]], name=f"{name} up",
                        mode="lines", line=dict(color=color, shape="hv"), secondary_y=True)
        fig.add_scatter(x=list(times), y=list(served[name]), name=f"{name} requests sent",
                        mode="lines", line=dict(color=color, dash="dot"))
    fig.add_vline(x=kill_time, line=dict(color="#7f7f7f", dash="dash"))
    _layout(fig, title, "time since the burst started (s)", "requests sent")
    fig.update_yaxes(title_text="up", range=[-0.1, 1.1], tickvals=[0, 1], secondary_y=True,
                     showgrid=False)
    return finish_with_top_legend(fig, caption, legend_rows=2)


def dashboard_figure(panels: Sequence, *, shade: tuple[float, float] | None = None,
                     constant: Sequence[str] = (), title: str, caption: str,
                     cols: int = 3) -> go.Figure:
    """deploy/'s Grafana dashboard as a grid: one subplot per time-series panel (loadtest/dashboard.py's
    Panel) on one time axis, seconds drawn in ms, "no data" where a panel has no series (as
    Grafana shows it), series that stay at 0 left out when others in the panel are not. Legend
    names drop the words in `constant` (the model's name, the one instance); a panel's only
    series needs no legend. `shade` marks a phase of the run, e.g. a burst, on every panel."""
    rows = -(-len(panels) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[p.title for p in panels],
                        vertical_spacing=0.5 / rows, horizontal_spacing=0.07)
    colors: dict[str, str] = {}
    end = max((t[-1] for p in panels for t, _ in p.series.values() if t), default=1.0)
    for i, p in enumerate(panels):
        r, c = i // cols + 1, i % cols + 1
        scale = 1e3 if p.unit == "s" else 100.0 if p.unit == "percentunit" else 1.0
        shown = {k: tv for k, tv in p.series.items() if any(tv[1])} or p.series   # zero lines hidden
        for name, (t, v) in shown.items():
            role = " ".join(w for w in name.split() if w not in constant)
            first = role not in colors
            color = colors.setdefault(role, "#444444" if not role else
                                      COLORS[len([k for k in colors if k]) % len(COLORS)])
            fig.add_scatter(x=list(t), y=[scale * x for x in v], name=role or p.title,
                            legendgroup=role, showlegend=first and bool(role), mode="lines",
                            line=dict(color=color, width=1.5),
                            hovertemplate=f"{name}<br>%{{x:.1f}} s: %{{y:.3g}}<extra></extra>",
                            row=r, col=c)
        if not p.series:             # an invisible trace: plotly.js drops an axis that has none
            fig.add_scatter(x=[0, end], y=[0, 1], mode="markers", marker=dict(opacity=0),
                            showlegend=False, hoverinfo="skip", row=r, col=c)
            fig.add_annotation(text="no data", showarrow=False, font=dict(color="#7f7f7f"),
                               x=0.5, y=0.5, xref="x domain", yref="y domain", row=r, col=c)
        unit = {"s": "ms", "percentunit": "%", "reqps": "req/s", "short": ""}.get(p.unit, p.unit)
        fig.update_yaxes(title_text=unit, rangemode="tozero", row=r, col=c)
        if shade:
            fig.add_vrect(x0=shade[0], x1=shade[1], fillcolor="#d62728", opacity=0.08,
                          line_width=0, row=r, col=c)
    _layout(fig, title, "", "", height=230 * rows)
    fig.update_annotations(font_size=11)
    fig.update_xaxes(range=[0, end])
    fig.update_xaxes(title_text="s since the run started", row=rows)
    return finish_with_top_legend(fig, caption, legend_rows=1)
