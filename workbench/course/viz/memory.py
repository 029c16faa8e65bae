"""Figures for the memory hierarchy chapter: what one GPU holds for a deployment (weights, the KV
cache of the batch, activations) against the memory it has, and the calculator's widget."""
from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from workbench.course.viz.figures import PALETTE, _layout, finish_with_top_legend
from workbench.course.viz.widgets import interact
from workbench.plan import known_models, memory_plan
from workbench.plan.formats import KV_DTYPE_BYTES, WEIGHT_FORMATS

GB = 10**9
PARTS = ("weights", "KV cache of the batch", "activations")


def memory_stack_figure(labels: Sequence[str], weights: Sequence[int], kv: Sequence[int],
                        activations: Sequence[int], *, usable_bytes: float | None = None,
                        title: str, caption: str) -> go.Figure:
    """One stacked bar per deployment: bytes per GPU of weights, KV cache and activations, with
    the usable memory of one GPU as a dashed line."""
    fig = go.Figure()
    for part, values, color in zip(PARTS, (weights, kv, activations), PALETTE):
        fig.add_bar(x=list(labels), y=[v / GB for v in values], name=part, marker_color=color,
                    hovertemplate="%{x}: %{y:.1f} GB<extra>" + part + "</extra>")
    if usable_bytes is not None:
        fig.add_hline(y=usable_bytes / GB, line=dict(color="#444", dash="dash"),
                      annotation_text=f"usable per GPU: {usable_bytes / GB:.0f} GB",
                      annotation_position="top left")
    _layout(fig, title, "deployment", "GB per GPU")
    fig.update_layout(barmode="stack")
    return finish_with_top_legend(fig, caption)


def plan_figure(plan, *, title: str | None = None) -> go.Figure:
    """One `MemoryPlan` (workbench.memory_plan) as a stacked bar, with its GPU's usable memory."""
    usable = (plan.gpu_memory_gb * GB * plan.gpu_memory_utilization
              if plan.gpu_memory_gb is not None else None)
    label = f"{plan.model} tp={plan.tp} pp={plan.pp} ep={plan.ep}"
    fits = "" if plan.max_sequences is None else (
        f"; {plan.max_sequences} sequences of {plan.context:,} tokens fit"
        if plan.max_sequences else f"; nothing fits: {plan.reason}")
    caption = (f"{plan.weight_format or plan.dtype} weights, {plan.kv_cache_dtype} KV cache, "
               f"batch {plan.batch} x {plan.context:,} tokens{fits}.")
    return memory_stack_figure([label], [plan.weight_bytes_per_gpu], [plan.kv_bytes_batch_per_gpu],
                               [plan.activation_bytes_per_gpu], usable_bytes=usable,
                               title=title or f"{plan.model}: memory per GPU", caption=caption)


def memory_plan_widget(model: str = "Llama-3-70B", *, tp: int = 4, gpu_memory_gb: float = 80):
    """Sliders over `memory_plan`: model, weight format, KV dtype, batch, context and tensor
    parallelism redraw one GPU's memory (a single static draw in reports)."""
    import ipywidgets as w


    def draw(model, weight_format, kv_cache_dtype, batch, context, tp):
        try:
            plan = memory_plan(model, weight_format=None if weight_format == "bf16" else weight_format,
                               kv_cache_dtype=kv_cache_dtype, batch=batch, context=context, tp=tp,
                               gpu_memory_gb=gpu_memory_gb)
        except ValueError as error:       # e.g. a tp that does not divide the heads
            print(error)
            return None
        print(plan.describe())
        return plan_figure(plan)

    return interact(
        draw,
        model=w.Dropdown(options=known_models(), value=model, description="model"),
        weight_format=w.Dropdown(options=["bf16", *[f for f in WEIGHT_FORMATS if f]],
                                 value="bf16", description="weights"),
        kv_cache_dtype=w.Dropdown(options=list(KV_DTYPE_BYTES), value="bf16", description="KV"),
        batch=w.IntSlider(value=16, min=1, max=256, description="batch"),
        context=w.IntSlider(value=8192, min=512, max=131072, step=512, description="context"),
        tp=w.Dropdown(options=[1, 2, 4, 8], value=tp, description="tp"))
