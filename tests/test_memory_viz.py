"""The memory chapter's figures draw the calculator's numbers, and its widget draws once in a
report."""
from __future__ import annotations

import pytest

from workbench import memory_plan
from workbench.course.viz.memory import GB, memory_plan_widget, plan_figure


def test_plan_figure_stacks_the_plan_bytes_under_the_usable_line():
    plan = memory_plan("Llama-3-70B", tp=4, batch=8, context=8192, gpu_memory_gb=80)
    fig = plan_figure(plan)
    bars = {trace.name: trace.y[0] for trace in fig.data}
    assert bars == pytest.approx({"weights": plan.weight_bytes_per_gpu / GB,
                                  "KV cache of the batch": plan.kv_bytes_batch_per_gpu / GB,
                                  "activations": plan.activation_bytes_per_gpu / GB})
    line = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(line) == 1 and line[0].y0 == pytest.approx(80 * 0.9)
    assert plan.max_sequences > 0
    assert f"{plan.max_sequences} sequences of 8,192 tokens fit" in fig_text(fig)


def test_plan_figure_says_why_nothing_fits():
    plan = memory_plan("Llama-2-70B", dtype="fp16", tp=1, gpu_memory_gb=80)
    assert plan.max_sequences == 0
    assert "nothing fits" in fig_text(plan_figure(plan))


def fig_text(fig) -> str:
    return " ".join(a.text for a in fig.layout.annotations)


def test_widget_draws_once_in_a_report(monkeypatch, capsys):
    monkeypatch.setenv("WORKBENCH_STATIC_WIDGETS", "1")
    shown = []
    monkeypatch.setattr("IPython.display.display", shown.append)
    memory_plan_widget("Llama-3-8B", tp=1, gpu_memory_gb=24)
    printed = capsys.readouterr().out
    assert "Llama-3-8B" in printed and "KV cache" in printed
    assert len(shown) == 1 and shown[0].data[0].name == "weights"
