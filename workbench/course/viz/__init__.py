"""Figures for the chapters (plotly graph_objects).

    from workbench.course import viz
    fig = viz.prefill_figure(lengths, seconds_per_token, title="...", caption="...")
    fig.show()

Figures take plain data or `workbench.engine.trace.StepRecord`s, never engine internals, so a chapter can
redraw them from numbers it has already measured (a widget moving a slider does exactly that).
"""
from workbench.course.viz.figures import (add_caption, decode_figure, estimate_latency, latency_breakdown_figure,
                      prefill_figure, roofline_figure, rolling_median, timeline_figure)

__all__ = ["add_caption", "decode_figure", "estimate_latency", "latency_breakdown_figure",
           "prefill_figure", "roofline_figure", "rolling_median", "timeline_figure"]
