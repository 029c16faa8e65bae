"""Request timelines (Gantt charts) rebuilt from the engine's `StepRecord`s.

    from workbench.course.viz.timeline import replay, gantt_figure, step_spans
    spans = step_spans(records)                          # (start, end) of every step, in seconds
    rep = replay(records, spans, prompt_lens)            # segments and token times per request
    gantt_figure({"continuous": rep}, title="...", caption="...").show()

A record says which requests ran in a step and how many tokens each fed through the model
(`scheduled`), which were preempted and which finished. With each request's prompt length that is
enough to replay what every request was doing: waiting, a prefill chunk, a decode step, a recompute
after preemption, or sitting preempted. Time comes from outside (`spans`): measured step seconds, or
a cost model, so one trace can be drawn on a modelled clock too. Nothing here touches the engine.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.engine.trace import StepRecord
from workbench.course.viz.figures import add_caption

KIND_COLORS = {"waiting": "rgba(160,160,160,0.35)", "prefill": "#1f77b4", "decode": "#ff7f0e",
               "recompute": "#9467bd", "preempted": "rgba(214,39,40,0.35)"}
KIND_LABELS = {"waiting": "waiting (queued, not admitted)", "prefill": "prefill (prompt chunk)",
               "decode": "decode (1 token)", "recompute": "recompute after preemption",
               "preempted": "preempted (blocks taken away)"}


@dataclass
class Segment:
    request_id: str
    kind: str          # waiting | prefill | decode | recompute | preempted
    start: float
    end: float
    tokens: int = 0    # tokens fed through the model in this segment
    steps: int = 0     # engine steps merged into it


@dataclass
class RequestTimes:
    arrival: float
    token_times: list[float] = field(default_factory=list)   # clock time of each output token
    finish: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.finish - self.arrival if self.finish is not None else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None

    @property
    def gaps(self) -> list[float]:
        """Inter-token gaps: what a streaming user waits between two tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class Replay:
    segments: list[Segment]
    requests: dict[str, RequestTimes]
    spans: list[tuple[float, float]]
    records: list[StepRecord]

    @property
    def makespan(self) -> float:
        return self.spans[-1][1] - min(r.arrival for r in self.requests.values()) \
            if self.spans else 0.0

    def mean(self, metric: str) -> float:
        vals = [getattr(r, metric) for r in self.requests.values()]
        vals = [v for v in vals if v is not None]
        return statistics.mean(vals) if vals else float("nan")


def step_spans(records: Sequence[StepRecord], start: float = 0.0,
               cost: Callable[[StepRecord], float] | None = None) -> list[tuple[float, float]]:
    """Back-to-back (start, end) for each record: measured `total_s`, or `cost(record)` seconds."""
    spans, t = [], start
    for r in records:
        dt = cost(r) if cost is not None else r.total_s
        spans.append((t, t + dt))
        t += dt
    return spans


def replay(records: Sequence[StepRecord], spans: Sequence[tuple[float, float]],
           prompt_lens: Mapping[str, int], arrivals: Mapping[str, float] | None = None,
           preemption_mode: str = "recompute") -> Replay:
    """What each request did in each step, and when each of its tokens came out.

    A request feeds `n` tokens in a step; when its computed tokens reach prompt + output tokens,
    a token is sampled at the end of that step. A step of one token after the whole prompt is a
    decode; anything else is prefill, or recompute when a preempted request (recompute mode)
    prefills its prompt and generated tokens again."""
    arrivals = dict(arrivals or {})
    computed: dict[str, int] = {}
    outs: dict[str, int] = {}
    times: dict[str, RequestTimes] = {}
    raw: list[Segment] = []
    preempted_at: dict[str, float] = {}
    for rec, (t0, t1) in zip(records, spans):
        for rid in rec.preempted:
            preempted_at[rid] = t0
            times[rid].num_preemptions += 1
            if preemption_mode == "recompute":
                computed[rid] = 0
        for rid, n in rec.scheduled:
            if rid not in times:
                arr = arrivals.get(rid, spans[0][0] if spans else 0.0)
                times[rid] = RequestTimes(arrival=arr)
                computed[rid], outs[rid] = 0, 0
                if t0 > arr:
                    raw.append(Segment(rid, "waiting", arr, t0))
            if rid in preempted_at:
                raw.append(Segment(rid, "preempted", preempted_at.pop(rid), t0))
            p, c, o = prompt_lens[rid], computed[rid], outs[rid]
            if c + n > p + o:             # more tokens than it has left: a hidden recompute
                c = computed[rid] = 0
            if n == 1 and o >= 1 and c == p + o - 1:
                kind = "decode"
            elif o >= 1 and c < p + o - 1:
                kind = "recompute"
            else:
                kind = "prefill"
            raw.append(Segment(rid, kind, t0, t1, n, 1))
            computed[rid] = c + n
            if computed[rid] == p + o:
                outs[rid] = o + 1
                times[rid].token_times.append(t1)
        for rid in rec.finished:
            if rid in times:
                times[rid].finish = t1
    return Replay(_merge(raw), times, list(spans), list(records))


def _merge(segments: list[Segment]) -> list[Segment]:
    """Join back-to-back segments of one request and kind (a run of decodes becomes one bar)."""
    out: list[Segment] = []
    last: dict[str, Segment] = {}
    for s in segments:
        prev = last.get(s.request_id)
        if prev is not None and prev.kind == s.kind and abs(prev.end - s.start) < 1e-12:
            prev.end, prev.tokens, prev.steps = s.end, prev.tokens + s.tokens, prev.steps + s.steps
            continue
        seg = Segment(s.request_id, s.kind, s.start, s.end, s.tokens, s.steps)
        out.append(seg)
        last[s.request_id] = seg
    return out


def _label(rid: str) -> str:
    return rid if not rid.isdigit() else f"req {rid}"


def gantt_figure(runs: Mapping[str, Replay], *, title: str = "", caption: str = "",
                 order: Sequence[str] | None = None, time_unit: str = "s",
                 time_label: str = "time (s, summed engine step times)",
                 row_height: int = 16) -> go.Figure:
    """One panel per run (shared time axis): a row per request, a bar per segment coloured by
    kind, waiting and preempted time shaded, and an x where a request was preempted."""
    names = list(runs)
    scale = 1e3 if time_unit == "ms" else 1.0
    rows_per = [len(r.requests) for r in runs.values()]
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, subplot_titles=names,
                        vertical_spacing=0.08 if len(names) > 1 else 0.0,
                        row_heights=[max(n, 1) for n in rows_per])
    seen: set[str] = set()
    for row, name in enumerate(names, start=1):
        rep = runs[name]
        ids = list(order) if order is not None else sorted(
            rep.requests, key=lambda r: (int(r) if r.isdigit() else r))
        ids = [r for r in ids if r in rep.requests]
        for kind in KIND_COLORS:
            segs = [s for s in rep.segments if s.kind == kind and s.request_id in rep.requests]
            if not segs:
                continue
            fig.add_trace(go.Bar(
                orientation="h", y=[_label(s.request_id) for s in segs],
                x=[(s.end - s.start) * scale for s in segs], base=[s.start * scale for s in segs],
                marker=dict(color=KIND_COLORS[kind], line=dict(width=0.5, color="white")),
                name=KIND_LABELS[kind], legendgroup=kind, showlegend=kind not in seen,
                customdata=[[s.tokens, s.steps, s.start * scale, s.end * scale] for s in segs],
                hovertemplate=("%{y}: " + kind + " %{customdata[2]:.2f}-%{customdata[3]:.2f} "
                               + time_unit + ", %{customdata[0]} tokens in %{customdata[1]} "
                               "steps<extra></extra>")), row=row, col=1)
            seen.add(kind)
        pre_x, pre_y = [], []
        for rec, (t0, _) in zip(rep.records, rep.spans):
            for rid in rec.preempted:
                pre_x.append(t0 * scale)
                pre_y.append(_label(rid))
        if pre_x:
            fig.add_trace(go.Scatter(x=pre_x, y=pre_y, mode="markers", name="preemption",
                                     legendgroup="preemption", showlegend="x" not in seen,
                                     marker=dict(symbol="x", size=9, color="#d62728"),
                                     hovertemplate="%{y} preempted at %{x:.2f}<extra></extra>"),
                          row=row, col=1)
            seen.add("x")
        fig.update_yaxes(categoryorder="array", categoryarray=[_label(r) for r in ids][::-1],
                         title_text="request", row=row, col=1)
    fig.update_xaxes(title_text=time_label.replace("(s", f"({time_unit}") if time_unit != "s"
                     else time_label, row=len(names), col=1)
    height = 140 + sum(max(n, 2) * row_height + 40 for n in rows_per)
    fig.update_layout(template="plotly_white", barmode="overlay", height=height, bargap=0.25,
                      title=dict(text=title, x=0.02), hovermode="closest",
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0.0))
    fig.update_layout(margin=dict(t=110))
    return add_caption(fig, caption)


def latency_figure(runs: Mapping[str, Replay], *, title: str = "", caption: str = "") -> go.Figure:
    """Per-request TTFT and end-to-end latency for each run, as strip plots (one dot a request)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["time to first token", "end-to-end latency"])
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
    for i, (name, rep) in enumerate(runs.items()):
        for col, metric in ((1, "ttft"), (2, "e2e")):
            vals = [getattr(r, metric) for r in rep.requests.values()]
            fig.add_trace(go.Box(y=[v for v in vals if v is not None], name=name, boxpoints="all",
                                 jitter=0.4, pointpos=0, marker_color=palette[i % len(palette)],
                                 showlegend=col == 1), row=1, col=col)
    fig.update_yaxes(title_text="seconds", rangemode="tozero")
    fig.update_layout(template="plotly_white", height=420, title=dict(text=title, x=0.02))
    return add_caption(fig, caption)
