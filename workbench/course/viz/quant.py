"""Figures for the quantization chapter (plotly graph_objects).

    from workbench.quant.reference import fake_quantize, relative_error
    from workbench.course.viz.quant import error_by_group_figure
    err = relative_error(w, fake_quantize(w, bits=4, group_size=128))
    error_by_group_figure([16, 32, 64, 128], {4: [...], 8: [...]}).show()

Each returns a `go.Figure` with a title, axes with units and a caption under the plot. The
tensor helpers they draw (round-to-nearest at any width, format grids, W8A8, error measures) live
in workbench/quant/reference.py.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from workbench.course.viz.figures import PALETTE, _layout, add_caption
from workbench.course.viz.figures import finish_with_top_legend as _finish

MB = 1e6
FORMAT_COLORS = {"fp32": "#7f7f7f", "bf16": "#1f77b4", "fp8 e4m3": "#9467bd", "int8": "#2ca02c",
                 "int4": "#ff7f0e"}
COLORS = PALETTE + ("#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def _format_color(name: str, i: int) -> str:
    """The colour of a storage format, by the format its name starts with."""
    return next((c for f, c in FORMAT_COLORS.items() if name.startswith(f)), COLORS[i % len(COLORS)])


def _log_ticks(lo: float, hi: float, floor_label: str | None = None) -> dict:
    """Decade ticks from lo to hi written as plain numbers (plotly writes 1e-4 as "100µ"); the
    lowest one can be renamed (a floor standing for zero)."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    steps = (1, 2, 5) if len(decades) <= 3 else (1,)      # 1-2-5 ticks on a short axis
    vals = [m * 10.0 ** e for e in decades for m in steps]
    vals = [v for v in vals if v == vals[0] or lo / 1.01 <= v <= hi * 1.01]
    text = [f"{v:g}" for v in vals]
    if floor_label is not None:
        text[0] = floor_label
    return dict(tickvals=vals, ticktext=text)


# ------------------------------------------------------------------------------ tensor helpers


# ----------------------------------------------------------------------------------- figures
def decode_roofline_figure(labels: Sequence[str], bytes_per_token: Sequence[float],
                           tok_s: Sequence[float], bandwidth_gbs: float, *, title: str = "",
                           caption: str = "") -> go.Figure:
    """Measured batch-1 decode speed against the bytes a step reads, with the ceiling
    tok/s = bandwidth / bytes per token (a hyperbola: halve the bytes, double the ceiling).
    The speed axis is logarithmic, so equal gaps are equal ratios."""
    fig = go.Figure()
    lo, hi = 0.6 * min(bytes_per_token), 1.25 * max(bytes_per_token)
    xs = [lo + (hi - lo) * i / 80 for i in range(81)]
    fig.add_trace(go.Scatter(
        x=[x / MB for x in xs], y=[bandwidth_gbs * 1e9 / x for x in xs], mode="lines",
        name=f"ceiling: {bandwidth_gbs:.1f} GB/s copy bandwidth / bytes per token",
        line=dict(color="#7f7f7f", dash="dash"),
        hovertemplate="%{x:.0f} MB/token: at most %{y:.1f} tok/s<extra></extra>"))
    for i, (name, b, t) in enumerate(zip(labels, bytes_per_token, tok_s)):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(
            x=[b / MB, b / MB], y=[t, bandwidth_gbs * 1e9 / b], mode="lines", showlegend=False,
            line=dict(color=color, width=1, dash="dot"), hoverinfo="skip"))
        fig.add_trace(go.Scatter(
            x=[b / MB], y=[t], mode="markers+text", name=name, text=[f"{name}: {t:.1f} tok/s"],
            textposition="middle right", marker=dict(color=color, size=12),
            hovertemplate=f"{name}: %{{x:.0f}} MB/token, %{{y:.1f}} tok/s<extra></extra>"))
    _layout(fig, title, "weight and KV bytes read per decode step (MB)",
            "decode speed (tokens/s, batch 1, log)", height=460)
    top = max(bandwidth_gbs * 1e9 / lo, max(tok_s))
    fig.update_yaxes(type="log", **_log_ticks(0.5 * min(tok_s), top),
                     range=[math.log10(0.5 * min(tok_s)), math.log10(1.2 * top)])
    return _finish(fig, caption)


def number_grids_figure(weights: torch.Tensor, grids: Mapping[str, torch.Tensor | None], *,
                        counts: Mapping[str, int] | None = None, bins: int = 61,
                        value_range: tuple[float, float] | None = None, title: str = "",
                        caption: str = "") -> go.Figure:
    """A histogram of weights (top) over the values each format can hold (one strip per format,
    below). `grids[name]` is a 1-D tensor of values in the weights' units, or None for a format
    too dense to draw (fp32); `counts[name]` is how many values it has in the plotted range
    (`value_range`, by default the weights' own)."""
    names = list(grids)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.55, 0.45],
                        vertical_spacing=0.04)
    w = weights.float().flatten()
    lo, hi = value_range if value_range is not None else (w.min().item(), w.max().item())
    hist = torch.histc(w, bins=bins, min=lo, max=hi)            # binned here: a figure of
    width = (hi - lo) / bins                                     # 500k raw values is megabytes
    centers = [lo + width * (i + 0.5) for i in range(bins)]
    fig.add_trace(go.Bar(x=centers, y=hist.tolist(), width=width, marker_color="#bbbbbb",
                         name="weights", showlegend=False,
                         hovertemplate="%{x:.4f}: %{y:.0f} weights<extra></extra>"), row=1, col=1)
    for i, name in enumerate(names):
        color = _format_color(name, i)
        n = (counts or {}).get(name)
        label = f"{name}" + (f" ({n:,} values)" if n is not None else "")
        grid = grids[name]
        if grid is None:
            fig.add_trace(go.Scatter(x=[lo, hi, hi, lo, lo], y=[i - 0.3, i - 0.3, i + 0.3, i + 0.3,
                                                                 i - 0.3],
                                     fill="toself", mode="lines", line=dict(width=0),
                                     fillcolor=color, opacity=0.5, name=label, showlegend=False,
                                     hoverinfo="skip"), row=2, col=1)
        else:
            g = grid.float()
            tol = 1e-6 * (hi - lo)
            g = g[(g >= lo - tol) & (g <= hi + tol)].tolist()
            xs, ys = [], []
            for v in g:
                xs += [v, v, None]
                ys += [i - 0.35, i + 0.35, None]
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=color, width=1),
                                     name=label, showlegend=False, hoverinfo="skip"), row=2, col=1)
    _layout(fig, title, "", "", height=560)
    fig.update_yaxes(title_text="weights (count)", row=1, col=1)
    labels = [f"{n}" + (f"<br>{(counts or {})[n]:,} values" if (counts or {}).get(n) is not None
                        else "") for n in names]
    fig.update_yaxes(tickvals=list(range(len(names))), ticktext=labels, range=[-0.6, len(names) - 0.4],
                     showgrid=False, row=2, col=1)
    fig.update_xaxes(title_text="weight value", range=[lo, hi], row=2, col=1)
    return _finish(fig, caption, legend_rows=0)


def format_error_figure(names: Sequence[str], errors: Sequence[float],
                        bits_per_weight: Sequence[float], *, title: str = "",
                        caption: str = "") -> go.Figure:
    """Relative rounding error of one layer per storage format (log scale), bits per weight as
    hover and label."""
    fig = go.Figure()
    colors = [_format_color(n, i) for i, n in enumerate(names)]
    fig.add_trace(go.Bar(x=list(names), y=[100 * e for e in errors], marker_color=colors,
                         text=[f"{100 * e:.2g}%<br>{b:.3g} bits" for e, b in zip(errors,
                                                                              bits_per_weight)],
                         textposition="outside", showlegend=False,
                         hovertemplate="%{x}: %{y:.3g}% error<extra></extra>"))
    _layout(fig, title, "storage format", "relative error ||W_q - W|| / ||W|| (%, log)")
    fig.update_yaxes(type="log")
    fig.update_layout(uniformtext_minsize=9)
    top = max(100 * e for e in errors)
    bottom = min(100 * e for e in errors if e > 0)
    fig.update_yaxes(range=[math.log10(bottom) - 0.5, math.log10(top) + 0.8])
    return add_caption(fig, caption)


def error_by_group_figure(group_sizes: Sequence[int], errors: Mapping[str, Sequence[float]], *,
                          highlight: tuple[int, float] | None = None, floor: float = 1e-6,
                          title: str = "", caption: str = "") -> go.Figure:
    """Relative error of round-to-nearest against group size, one line per setting (log-log).
    Errors below `floor` (exact results) are drawn at the floor, labelled "exact"; a setting whose
    name contains "shifted" is dotted. `highlight` = (group size, error) rings a chosen point."""
    fig = go.Figure()
    for i, (name, errs) in enumerate(errors.items()):
        fig.add_trace(go.Scatter(
            x=list(group_sizes), y=[100 * max(e, floor) for e in errs], mode="lines+markers",
            name=name, customdata=[100 * e for e in errs],
            line=dict(color=COLORS[i % len(COLORS)], dash="dot" if "shifted" in name else "solid"),
            hovertemplate=f"{name}, group %{{x}}: %{{customdata:.3g}}%<extra></extra>"))
    if highlight is not None:
        fig.add_trace(go.Scatter(x=[highlight[0]], y=[100 * max(highlight[1], floor)], mode="markers",
                                 name="your choice", marker=dict(size=16, color="rgba(0,0,0,0)",
                                                                 line=dict(color="black", width=2))))
    _layout(fig, title, "group size (weights sharing one scale and minimum, log)",
            "relative error ||W_q - W|| / ||W|| (%, log)", height=460)
    fig.update_xaxes(type="log", tickvals=list(group_sizes), ticktext=[str(g) for g in group_sizes])
    top = max(max(e) for e in errors.values())
    fig.update_yaxes(type="log", **_log_ticks(100 * floor, 100 * top, "exact"),
                     range=[math.log10(100 * floor) - 0.3, math.log10(100 * top) + 0.3])
    return _finish(fig, caption, legend_rows=2 if len(errors) > 4 else 1)


def row_segment_figure(w_row: torch.Tensor, q_row: torch.Tensor, group_size: int, offset: int = 0,
                       block: int = 32, *, title: str = "", caption: str = "") -> go.Figure:
    """A stretch of one weight row: the weights (dots), their rounded values (dashes, per group),
    the quantizer's group boundaries (solid) and the source file's blocks of `block` (dotted)."""
    k = w_row.numel()
    cols = list(range(k))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=cols, y=w_row.float().tolist(), mode="markers", name="weight",
                             marker=dict(color="#1f77b4", size=6),
                             hovertemplate="column %{x}: %{y:.5f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=cols, y=q_row.float().tolist(), mode="markers",
                             name="rounded to the group's grid",
                             marker=dict(color="#ff7f0e", size=9, symbol="line-ew-open",
                                         line=dict(width=2)),
                             hovertemplate="column %{x}: %{y:.5f}<extra></extra>"))
    for c in range(0, k + 1, block):
        fig.add_vline(x=c - 0.5, line=dict(color="#999999", dash="dot", width=1))
    starts = [0] + list(range(offset if offset else group_size, k + 1, group_size))
    for c in starts:
        fig.add_vline(x=c - 0.5, line=dict(color="#d62728", width=2))
    _layout(fig, title, f"column (input feature); dotted: Q4_1 blocks of {block}; red: quantizer "
            "groups", "weight value", height=440)
    return _finish(fig, caption)


def q4_1_block_figure(codes: Sequence[int], weights: Sequence[float], scale: float,
                      minimum: float, *, title: str = "", caption: str = "") -> go.Figure:
    """One Q4_1 block: its 32 weights (dots, labelled with their codes) on the 16 levels
    minimum + scale * q (lines)."""
    fig = go.Figure()
    for q in range(16):
        fig.add_hline(y=minimum + scale * q, line=dict(color="#dddddd", width=1))
    fig.add_trace(go.Scatter(
        x=list(range(len(weights))), y=list(weights), mode="markers+text",
        text=[str(c) for c in codes], textposition="top center", name="weight = m + d * code",
        marker=dict(color="#ff7f0e", size=9),
        hovertemplate="weight %{x}: %{y:.6f}, code %{text}<extra></extra>"))
    _layout(fig, title, "position in the block (0-31)", "weight value", height=440)
    fig.update_yaxes(range=[minimum - 1.5 * scale, minimum + 17 * scale])
    return _finish(fig, caption)


def channel_figure(panels: Mapping[str, Mapping[str, torch.Tensor]], *, highlight: Sequence[int] = (),
                   y_title: str = "max |value| over calibration tokens (log)", title: str = "",
                   caption: str = "") -> go.Figure:
    """Per-channel magnitudes side by side: panels name -> {series name -> (K,) tensor}.
    Channels in `highlight` are marked with a ring in every panel."""
    names = list(panels)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.08)
    color_of: dict[str, str] = {}        # one colour per series name, across panels
    for p, name in enumerate(names, start=1):
        for i, (series, values) in enumerate(panels[name].items()):
            v = values.float().tolist()
            first = series not in color_of
            color_of.setdefault(series, COLORS[len(color_of) % len(COLORS)])
            fig.add_trace(go.Scatter(
                x=list(range(len(v))), y=v, mode="markers", name=series,
                legendgroup=series, showlegend=first,
                marker=dict(color=color_of[series], size=4, opacity=0.85 if i else 0.6),
                hovertemplate=f"{series}, channel %{{x}}: %{{y:.3g}}<extra></extra>"),
                row=1, col=p)
            for j in highlight:
                fig.add_trace(go.Scatter(x=[j], y=[v[j]], mode="markers", showlegend=False,
                                         marker=dict(size=13, color="rgba(0,0,0,0)",
                                                     line=dict(color="black", width=1.5)),
                                         hovertemplate=f"channel {j}: %{{y:.3g}}<extra></extra>"),
                              row=1, col=p)
        fig.update_xaxes(title_text="input channel", row=1, col=p)
        fig.update_yaxes(type="log", row=1, col=p)
    _layout(fig, title, "", "", height=470)
    fig.update_xaxes(title_text="input channel")
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    return _finish(fig, caption)


def sweep_figure(x: Sequence[float], series: Mapping[str, Sequence[float]], *, x_title: str,
                 y_title: str, marker: tuple[float, str] | None = None,
                 reference: tuple[float, str] | None = None, log_y: bool = False,
                 title: str = "", caption: str = "") -> go.Figure:
    """Lines of measured values against one knob; `marker` = (x, label) draws a vertical line,
    `reference` = (y, label) a horizontal one."""
    fig = go.Figure()
    for i, (name, ys) in enumerate(series.items()):
        fig.add_trace(go.Scatter(x=list(x), y=list(ys), mode="lines+markers", name=name,
                                 line=dict(color=PALETTE[i % len(PALETTE)]),
                                 hovertemplate=f"{name}: %{{x}} -> %{{y:.4g}}<extra></extra>"))
    if marker is not None:
        fig.add_vline(x=marker[0], line=dict(color="#7f7f7f", dash="dash"),
                      annotation_text=marker[1], annotation_position="top")
    if reference is not None:
        fig.add_hline(y=reference[0], line=dict(color="#d62728", dash="dot"),
                      annotation_text=reference[1], annotation_position="top right")
    _layout(fig, title, x_title, y_title, height=440)
    if log_y:
        fig.update_yaxes(type="log")
    return _finish(fig, caption)


def gptq_columns_figure(rtn_column_error: torch.Tensor, gptq_column_error: torch.Tensor,
                        output_errors: Mapping[str, Mapping[str, float]], group_size: int, *,
                        title: str = "", caption: str = "") -> go.Figure:
    """Left: per input column, how far each method moved the weights (RMS over rows of
    W_q - W). Right: the layer's relative output error per method, on calibration and held-out
    inputs (grouped bars)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.68, 0.32], horizontal_spacing=0.1,
                        subplot_titles=("weight change per column", "output error"))
    k = rtn_column_error.numel()
    for i, (name, v) in enumerate((("round to nearest", rtn_column_error),
                                   ("GPTQ", gptq_column_error))):
        fig.add_trace(go.Scatter(x=list(range(k)), y=v.float().tolist(), mode="lines",
                                 name=f"{name}: RMS of W_q - W", line=dict(color=PALETTE[i], width=1),
                                 hovertemplate=f"{name}, column %{{x}}: %{{y:.3g}}<extra></extra>"),
                      row=1, col=1)
    for c in range(group_size, k, group_size):
        fig.add_vline(x=c - 0.5, line=dict(color="#999999", dash="dot", width=1), row=1, col=1)
    methods = list(output_errors)
    splits = list(next(iter(output_errors.values())))
    for j, split in enumerate(splits):
        fig.add_trace(go.Bar(x=methods, y=[100 * output_errors[m][split] for m in methods],
                             name=f"output error, {split} tokens",
                             marker_color=("#9467bd", "#8c564b", "#17becf")[j % 3],
                             texttemplate="%{y:.2g}%", textposition="outside",
                             hovertemplate=f"%{{x}}, {split}: %{{y:.3g}}%<extra></extra>"),
                      row=1, col=2)
    _layout(fig, title, "", "", height=470)
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text=f"input column (dotted: groups of {group_size})", row=1, col=1)
    fig.update_yaxes(title_text="RMS weight change over rows", row=1, col=1)
    fig.update_yaxes(title_text="||X W_q^T - X W^T|| / ||X W^T|| (%)", rangemode="tozero",
                     row=1, col=2)
    return _finish(fig, caption, legend_rows=2)


def quality_bytes_figure(labels: Sequence[str], read_bytes: Sequence[float],
                         mean_kl: Sequence[float], *, kv_labels: Sequence[str] = (),
                         title: str = "", caption: str = "") -> go.Figure:
    """Mean KL against the bytes a decode step reads, one point per variant (log y). Labels in
    `kv_labels` (KV-cache variants: the weights are unchanged) are drawn as open markers."""
    fig = go.Figure()
    right = max(read_bytes)
    for i, (name, b, kl) in enumerate(zip(labels, read_bytes, mean_kl)):
        kv = name in kv_labels
        fig.add_trace(go.Scatter(
            x=[b / MB], y=[kl], mode="markers+text", name=name, text=[name],
            textposition="middle left" if b > 0.8 * right else "middle right",
            marker=dict(size=12, color=COLORS[i % len(COLORS)],
                        symbol="circle-open" if kv else "circle", line=dict(width=2)),
            hovertemplate=f"{name}: %{{x:.0f}} MB read per token, KL %{{y:.4f}}<extra></extra>"))
    _layout(fig, title, "weight bytes read per decode step (MB)",
            "mean KL(bf16 || variant) per position (nats, log)", height=480)
    lo, hi = min(mean_kl), max(mean_kl)
    fig.update_yaxes(type="log", **_log_ticks(lo / 2, hi * 2),
                     range=[math.log10(lo) - 0.4, math.log10(hi) + 0.4])
    fig.update_xaxes(range=[0.6 * min(read_bytes) / MB, 1.1 * right / MB])
    fig.update_layout(showlegend=False)
    return add_caption(fig, caption)


def speedup_figure(labels: Sequence[str], measured: Sequence[float], byte_ratio: Sequence[float],
                   *, title: str = "", caption: str = "") -> go.Figure:
    """Decode speedup over the reference, measured, next to the speedup bytes alone would give
    (reference bytes per token / variant bytes per token)."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=list(labels), y=list(byte_ratio), name="if speed followed bytes: "
                         "reference bytes / variant bytes", marker_color="#bbbbbb",
                         texttemplate="%{y:.2f}x", textposition="outside"))
    fig.add_trace(go.Bar(x=list(labels), y=list(measured), name="measured decode speedup",
                         marker_color="#ff7f0e", texttemplate="%{y:.2f}x", textposition="outside"))
    fig.add_hline(y=1, line=dict(color="#7f7f7f", dash="dot"))
    _layout(fig, title, "variant", "speedup over the reference (x)", height=440)
    fig.update_layout(barmode="group")
    fig.update_yaxes(rangemode="tozero", range=[0, 1.15 * max(max(byte_ratio), max(measured))])
    return _finish(fig, caption)
