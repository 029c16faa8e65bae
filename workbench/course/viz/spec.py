"""Figures for the speculative-decoding chapter (plotly graph_objects).

    from workbench.spec.theory import expected_speedup, fit_alpha
    from workbench.course.viz.spec import speedup_vs_k_figure
    alpha = fit_alpha(mean_accepted=2.4, k=4)            # the i.i.d. acceptance that explains it
    speedup_vs_k_figure(range(1, 11), {"draft": [expected_speedup(alpha, k, 0.1) for k in ...]})

Each returns a `go.Figure` with a title, axes with units and a caption under the plot. The
arithmetic they draw (Leviathan et al.'s formula, the rejection sampler's residual) lives in
workbench/spec/theory.py.
"""
from __future__ import annotations

import html
import statistics
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from workbench.spec.theory import residual
from workbench.course.viz.figures import PALETTE, _layout, add_caption
from workbench.course.viz.figures import finish_with_top_legend as _finish

TARGET_COLOR = "#1f77b4"
DRAFT_COLOR = "#ff7f0e"
ACCEPT_COLOR = "#2ca02c"
REJECT_COLOR = "#d62728"
GREY = "#7f7f7f"
# Token-view cell kinds: (label, colour).
TOKEN_KINDS = (("accepted draft", "#98df8a"), ("rejected draft (first mismatch)", "#ff9896"),
               ("discarded (after a rejection)", "#e5e5e5"),
               ("bonus: the target's token after k accepted drafts", "#aec7e8"),
               ("correction: the target's token at the mismatch", "#ffbb78"))


# ------------------------------------------------------------------------------ the arithmetic


# --------------------------------------------------------------------------- section 1: cost
def verify_cost_figure(seconds: Mapping[int, Sequence[float]], *, title: str = "",
                       caption: str = "") -> go.Figure:
    """Time of the target's forward pass per step against the tokens it scored (1 + drafts):
    every step faint, the median as a line, and the line n x (one-token median) that cost would
    follow if each token cost as much as a whole step."""
    ns = sorted(seconds)
    med = {n: statistics.median(seconds[n]) for n in ns}
    fig = go.Figure()
    xs = [n for n in ns for _ in seconds[n]]
    ys = [1e3 * s for n in ns for s in seconds[n]]
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name="each step",
                             marker=dict(color=TARGET_COLOR, size=5, opacity=0.3),
                             hovertemplate="%{x} tokens: %{y:.1f} ms<extra></extra>"))
    fig.add_trace(go.Scatter(x=ns, y=[1e3 * med[n] for n in ns], mode="lines+markers+text",
                             name="median", line=dict(color=TARGET_COLOR, width=3),
                             text=[f"{med[n] / med[ns[0]]:.2f}x" for n in ns],
                             textposition="top left",
                             hovertemplate="%{x} tokens: median %{y:.1f} ms<extra></extra>"))
    fig.add_trace(go.Scatter(x=ns, y=[1e3 * med[ns[0]] * n / ns[0] for n in ns], mode="lines",
                             name="if every token cost a whole step", line=dict(color=GREY,
                                                                                dash="dash"),
                             hovertemplate="%{x} tokens: %{y:.1f} ms<extra></extra>"))
    _layout(fig, title, "tokens scored in one forward pass (1 + drafts)",
            "target forward pass (ms)", height=440)
    fig.update_xaxes(tickvals=ns)
    fig.update_yaxes(rangemode="tozero",
                     range=[0, 1.15 * max(1e3 * med[ns[0]] * ns[-1] / ns[0], max(ys), 1e-6)])
    return _finish(fig, caption)


# ---------------------------------------------------------------------------- section 2: toy
def toy_figure(labels: Sequence[str], p: torch.Tensor, q: torch.Tensor,
               emitted: torch.Tensor | None = None, *, title: str = "",
               caption: str = "") -> go.Figure:
    """Three panels over a small vocabulary: the target p and the draft q with the accepted mass
    min(p, q); the residual norm(max(0, p - q)) a rejection samples from; and (if given) the
    empirical distribution of emitted tokens next to p."""
    labels = list(labels)
    p, q = p.double(), q.double()
    m, r = torch.minimum(p, q), residual(p, q)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07,
                        subplot_titles=("target p, draft q; accepted mass min(p, q)",
                                        "after a rejection: norm(max(0, p - q))",
                                        "emitted tokens against p"))
    fig.add_trace(go.Bar(x=labels, y=p.tolist(), name="target p", marker_color=TARGET_COLOR,
                         legendgroup="p"), row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=q.tolist(), name="draft q", marker_color=DRAFT_COLOR),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=labels, y=m.tolist(), mode="markers", name="min(p, q): accepted",
                             marker=dict(symbol="line-ew-open", size=26, color="black",
                                         line=dict(width=3)),
                             hovertemplate="%{x}: min(p, q) = %{y:.3f}<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=r.tolist(), name="residual", marker_color=REJECT_COLOR,
                         showlegend=False), row=1, col=2)
    fig.add_trace(go.Bar(x=labels, y=p.tolist(), name="target p", marker_color=TARGET_COLOR,
                         legendgroup="p", showlegend=False), row=1, col=3)
    if emitted is not None:
        fig.add_trace(go.Scatter(x=labels, y=emitted.double().tolist(), mode="markers",
                                 name="emitted (empirical)",
                                 marker=dict(color=ACCEPT_COLOR, size=12, symbol="diamond",
                                             line=dict(color="black", width=1)),
                                 hovertemplate="%{x}: %{y:.3f} of emitted<extra></extra>"),
                      row=1, col=3)
    _layout(fig, title, "", "", height=420)
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="probability", row=1, col=1)
    top = 1.12 * max(p.max().item(), q.max().item(), r.max().item(),
                     0 if emitted is None else emitted.max().item())
    fig.update_yaxes(range=[0, top])
    fig.update_xaxes(title_text="token")
    return _finish(fig, caption)


def acceptance_curve_figure(weights: Sequence[float], analytic: Sequence[float],
                            measured_weights: Sequence[float], measured: Sequence[float], *,
                            chosen: float | None = None, title: str = "",
                            caption: str = "") -> go.Figure:
    """Acceptance rate against how much of the draft is a bad distribution: sum_x min(p, q) as
    a line (at `weights`), the rejection sampler's measured rate as markers (at
    `measured_weights`)."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(weights), y=[100 * a for a in analytic], mode="lines",
                             name="sum min(p, q) = 1 - TV(p, q)",
                             line=dict(color=TARGET_COLOR, width=3),
                             hovertemplate="weight %{x:.2f}: %{y:.1f}%<extra></extra>"))
    fig.add_trace(go.Scatter(x=list(measured_weights), y=[100 * a for a in measured], mode="markers",
                             name="measured: verify_sampled", marker=dict(color=DRAFT_COLOR,
                                                                          size=11),
                             hovertemplate="weight %{x:.2f}: %{y:.1f}% accepted<extra></extra>"))
    if chosen is not None:
        fig.add_vline(x=chosen, line=dict(color=GREY, dash="dot"))
    _layout(fig, title, "weight of the bad distribution in the draft q = (1 - w) p + w bad",
            "drafts accepted (%)", height=420)
    fig.update_yaxes(range=[0, 105])
    return _finish(fig, caption)


# ---------------------------------------------------------------------- section 3: token view
def _visible(token: str) -> str:
    """A token as text in a cell: spaces as a middle dot, newlines as a return sign, escaped."""
    t = token.replace(" ", "\u00b7").replace("\n", "\u21b5").replace("\t", "\u2192")
    return html.escape(t if t else "\u2205")


def token_view_figure(steps: Sequence[tuple[Sequence[str], Sequence[str]]], k: int, *,
                      first_step: int = 1, title: str = "", caption: str = "") -> go.Figure:
    """One row per verification step: the drafts (accepted, the first rejected, the discarded
    rest) and, in the last column, the token the target adds (a bonus after k accepted drafts, a
    correction at the first mismatch). `steps` holds (drafted tokens, emitted tokens) as text; the
    emitted tokens are the accepted drafts followed by the target's one token."""
    n = len(steps)
    z = [[None] * (k + 1) for _ in range(n)]
    text = [[""] * (k + 1) for _ in range(n)]
    hover = [[""] * (k + 1) for _ in range(n)]
    for i, (drafted, emitted) in enumerate(steps):
        a = len(emitted) - 1
        for j, tok in enumerate(drafted[:k]):
            kind = 0 if j < a else 1 if j == a else 2
            z[i][j], text[i][j] = kind, _visible(tok)
            hover[i][j] = f"draft {j + 1}: {_visible(tok)} ({TOKEN_KINDS[kind][0]})"
        kind = 3 if a == len(drafted) else 4
        z[i][k], text[i][k] = kind, _visible(emitted[-1])
        hover[i][k] = f"target: {_visible(emitted[-1])} ({TOKEN_KINDS[kind][0]})"
    m = len(TOKEN_KINDS)
    scale = []
    for c, (_, color) in enumerate(TOKEN_KINDS):
        scale += [[c / m, color], [(c + 1) / m, color]]
    fig = go.Figure()
    fig.add_trace(go.Heatmap(z=[[None if v is None else v + 0.5 for v in row] for row in z],
                             text=text, customdata=hover, texttemplate="%{text}",
                             textfont=dict(size=12), colorscale=scale, zmin=0, zmax=m,
                             showscale=False, xgap=3, ygap=3,
                             hovertemplate="%{customdata}<extra></extra>"))
    for label, color in TOKEN_KINDS:          # legend entries for the cell colours
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker=dict(symbol="square", size=13, color=color)))
    ylabels = [f"step {first_step + i}: +{len(e)}" for i, (_, e) in enumerate(steps)]
    _layout(fig, title, "", "verification step: tokens it emitted", height=150 + 30 * n)
    fig.update_xaxes(tickvals=list(range(k + 1)),
                     ticktext=[f"draft {j + 1}" for j in range(k)] + ["target adds"],
                     side="top", showgrid=False)
    fig.update_yaxes(tickvals=list(range(n)), ticktext=ylabels, autorange="reversed",
                     showgrid=False)
    fig.update_layout(plot_bgcolor="white")
    return _finish(fig, caption, legend_rows=2)


# ------------------------------------------------------------------ section 5: the drafters
def drafter_figure(names: Sequence[str], measured: Sequence[float], predicted: Sequence[float],
                   acceptance: Sequence[float], cost_ratio: Sequence[float], *, title: str = "",
                   caption: str = "") -> go.Figure:
    """Left: measured end-to-end speedup over plain decoding next to Leviathan et al.'s expected
    speedup. Right: what decides it: the acceptance rate and the draft's cost per token as a
    share of a target step (c)."""
    names = [n.replace(", ", ",<br>") for n in names]      # two-line labels, no tilted text
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, column_widths=[0.55, 0.45],
                        subplot_titles=("speedup over plain decoding",
                                        "acceptance and draft cost per token"))
    fig.add_trace(go.Bar(x=names, y=list(predicted), name="expected: tokens per step / (k c + 1)",
                         marker_color="#bbbbbb", texttemplate="%{y:.2f}x",
                         textposition="outside"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=list(measured), name="measured (median of rounds)",
                         marker_color=DRAFT_COLOR, texttemplate="%{y:.2f}x",
                         textposition="outside"), row=1, col=1)
    fig.add_hline(y=1, line=dict(color=GREY, dash="dot"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[100 * a for a in acceptance], name="acceptance rate (%)",
                         marker_color=ACCEPT_COLOR, texttemplate="%{y:.0f}%",
                         textposition="outside"), row=1, col=2)
    fig.add_trace(go.Bar(x=names, y=[100 * c for c in cost_ratio],
                         name="c: draft time per token / plain step (%)",
                         marker_color="#9467bd", texttemplate="%{y:.0f}%",
                         textposition="outside"), row=1, col=2)
    _layout(fig, title, "", "", height=470)
    fig.update_layout(barmode="group")
    top = max(max(measured), max(predicted), 1.0)
    fig.update_yaxes(title_text="speedup (x)", range=[0, 1.2 * top], row=1, col=1)
    fig.update_yaxes(title_text="%", range=[0, 118], row=1, col=2)
    fig.update_xaxes(tickangle=0)
    return _finish(fig, caption, legend_rows=2)


def position_figure(per_position: Mapping[str, Sequence[float]],
                    alphas: Mapping[str, float] | None = None, *, title: str = "",
                    caption: str = "") -> go.Figure:
    """Share of verification steps whose i-th draft was accepted (so were all before it), per
    drafter; dotted: alpha^i for the i.i.d. alpha fitted to the drafter's tokens per step."""
    fig = go.Figure()
    for i, (name, rates) in enumerate(per_position.items()):
        color = PALETTE[i % len(PALETTE)]
        xs = list(range(1, len(rates) + 1))
        fig.add_trace(go.Scatter(x=xs, y=[100 * r for r in rates], mode="lines+markers",
                                 name=name, line=dict(color=color, width=2.5),
                                 hovertemplate=f"{name}, draft %{{x}}: %{{y:.1f}}%<extra></extra>"))
        if alphas and name in alphas:
            fig.add_trace(go.Scatter(x=xs, y=[100 * alphas[name] ** x for x in xs], mode="lines",
                                     name=f"{name}: alpha^i, alpha = {alphas[name]:.2f}",
                                     line=dict(color=color, dash="dot", width=1.5),
                                     showlegend=False, hoverinfo="skip"))
    _layout(fig, title, "draft position i within a step",
            "steps whose draft i was accepted (%)", height=440)
    fig.update_yaxes(range=[0, 105])
    fig.update_xaxes(dtick=1)
    return _finish(fig, caption, legend_rows=2 if len(per_position) > 3 else 1)


def speedup_vs_k_figure(ks: Sequence[int], predicted: Mapping[str, Sequence[float]],
                        measured: Mapping[str, tuple[Sequence[int], Sequence[float]]] | None = None,
                        *, best: Mapping[str, int] | None = None, title: str = "",
                        caption: str = "") -> go.Figure:
    """Expected speedup against k (lines), measured speedups (markers of the same colour), the
    best k of each curve ringed."""
    fig = go.Figure()
    for i, (name, ys) in enumerate(predicted.items()):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=list(ks), y=list(ys), mode="lines", name=f"{name}: expected",
                                 line=dict(color=color, width=2.5),
                                 hovertemplate=f"{name}, k = %{{x}}: %{{y:.2f}}x<extra></extra>"))
        if measured and name in measured:
            mk, mv = measured[name]
            fig.add_trace(go.Scatter(x=list(mk), y=list(mv), mode="markers",
                                     name=f"{name}: measured",
                                     marker=dict(color=color, size=12, symbol="diamond",
                                                 line=dict(color="black", width=1)),
                                     hovertemplate=f"{name}, k = %{{x}}: measured %{{y:.2f}}x"
                                                   "<extra></extra>"))
        if best and name in best:
            kb = best[name]
            fig.add_trace(go.Scatter(x=[kb], y=[list(ys)[list(ks).index(kb)]], mode="markers",
                                     showlegend=False, hoverinfo="skip",
                                     marker=dict(size=18, color="rgba(0,0,0,0)",
                                                 line=dict(color=color, width=2))))
    fig.add_hline(y=1, line=dict(color=GREY, dash="dot"))
    _layout(fig, title, "k: drafts per verification step", "speedup over plain decoding (x)",
            height=450)
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(rangemode="tozero")
    rows = 1 + (2 * len(predicted) > 4)
    return _finish(fig, caption, legend_rows=rows)


def distill_figure(steps: Sequence[int], agreement: Sequence[float],
                   train_loss: Sequence[float | None], *, engine_acceptance: float | None = None,
                   title: str = "", caption: str = "") -> go.Figure:
    """The draft's held-out top-1 agreement with the target over training (left axis) and its
    training loss (right axis); a dotted line at the acceptance the engine measured."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=list(steps), y=[100 * a for a in agreement], mode="lines+markers",
                             name="held-out agreement with the target's greedy token",
                             line=dict(color=ACCEPT_COLOR, width=3),
                             hovertemplate="step %{x}: %{y:.1f}%<extra></extra>"),
                  secondary_y=False)
    pts = [(s, v) for s, v in zip(steps, train_loss) if v is not None]
    if pts:
        fig.add_trace(go.Scatter(x=[s for s, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                 name="training loss (nats, right)",
                                 line=dict(color=GREY, dash="dash"),
                                 hovertemplate="step %{x}: loss %{y:.2f}<extra></extra>"),
                      secondary_y=True)
    if engine_acceptance is not None:
        fig.add_hline(y=100 * engine_acceptance, line=dict(color=DRAFT_COLOR, dash="dot"),
                      annotation_text=f"engine: first draft accepted {engine_acceptance:.0%}",
                      annotation_position="bottom right", secondary_y=False)
    _layout(fig, title, "training step", "", height=440)
    top = max([100 * a for a in agreement] + [100 * (engine_acceptance or 0)])
    fig.update_yaxes(title_text="agreement (%)", range=[0, 1.2 * top + 1], secondary_y=False)
    top_loss = max([v for _, v in pts] + [1.0])
    fig.update_yaxes(title_text="loss (nats)", secondary_y=True, showgrid=False,
                     range=[0, 1.1 * top_loss], tickmode="auto", nticks=6, tickformat=".0f")
    return _finish(fig, caption)


# ---------------------------------------------------------------- section 6: batch size
def batch_figure(batches: Sequence[int], plain_tok_s: Sequence[float],
                 spec_tok_s: Sequence[float], drafter: str, *, title: str = "",
                 caption: str = "") -> go.Figure:
    """Left: throughput of plain decoding and of speculation against the batch size (log x).
    Right: their ratio, the speedup, with the break-even line."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("throughput", "speedup of speculation"))
    b = list(batches)
    fig.add_trace(go.Scatter(x=b, y=list(plain_tok_s), mode="lines+markers", name="plain decoding",
                             line=dict(color=TARGET_COLOR, width=2.5),
                             hovertemplate="batch %{x}: %{y:.0f} tok/s<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=b, y=list(spec_tok_s), mode="lines+markers",
                             name=f"speculative ({drafter})",
                             line=dict(color=DRAFT_COLOR, width=2.5),
                             hovertemplate="batch %{x}: %{y:.0f} tok/s<extra></extra>"),
                  row=1, col=1)
    ratio = [s / p for s, p in zip(spec_tok_s, plain_tok_s)]
    fig.add_trace(go.Bar(x=[str(x) for x in b], y=ratio, name="speedup",
                         marker_color=[ACCEPT_COLOR if r >= 1 else REJECT_COLOR for r in ratio],
                         texttemplate="%{y:.2f}x", textposition="outside", showlegend=False),
                  row=1, col=2)
    fig.add_hline(y=1, line=dict(color=GREY, dash="dot"), row=1, col=2)
    _layout(fig, title, "", "", height=440)
    fig.update_xaxes(type="log", tickvals=b, title_text="batch size (sequences decoded together)",
                     row=1, col=1)
    fig.update_xaxes(title_text="batch size", type="category", row=1, col=2)
    fig.update_yaxes(title_text="generated tokens/s (all sequences)", rangemode="tozero",
                     row=1, col=1)
    fig.update_yaxes(title_text="speculative / plain (x)", range=[0, 1.2 * max(ratio + [1.0])],
                     row=1, col=2)
    return _finish(fig, caption)


# ------------------------------------------------------------------------ section 8: GPU
def published_figure(labels: Sequence[str], speedups: Sequence[float], sources: Sequence[str], *,
                     ours: tuple[str, float] | None = None, title: str = "",
                     caption: str = "") -> go.Figure:
    """Published speedups (horizontal bars, source in the hover), with this machine's best
    measured speedup as a reference bar."""
    labels, speedups, sources = list(labels), list(speedups), list(sources)
    colors = [TARGET_COLOR] * len(labels)
    if ours is not None:
        labels.append(ours[0])
        speedups.append(ours[1])
        sources.append("measured in this notebook")
        colors.append(DRAFT_COLOR)
    fig = go.Figure(go.Bar(y=labels, x=speedups, orientation="h", marker_color=colors,
                           customdata=sources, texttemplate="%{x:.2f}x", textposition="outside",
                           hovertemplate="%{y}: %{x:.2f}x (%{customdata})<extra></extra>"))
    fig.add_vline(x=1, line=dict(color=GREY, dash="dot"))
    _layout(fig, title, "speedup over decoding without speculation (x)", "",
            height=170 + 38 * len(labels))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(range=[0, 1.18 * max(speedups)])
    fig.update_layout(showlegend=False)
    return add_caption(fig, caption)
