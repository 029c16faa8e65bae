"""deploy/'s Grafana dashboard asked of a real Prometheus (loadtest/prometheus.py): every time-series
panel's queries as range queries, the template variables filled as Grafana fills them, each
answer named by the panel's legend, for a notebook without Grafana.

    panels = dashboard_panels(prom, start, end, step=0.5, window=5)
    panels[0].title, panels[0].series     # {"p50 smollm2": ([s since start...], [v...]), ...}
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from workbench.loadtest.prometheus import Prometheus, with_window

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "workbench.json"


@dataclass
class Panel:
    title: str
    unit: str                                    # Grafana's unit id ("s", "percentunit", ...)
    series: dict[str, tuple[list[float], list[float]]]
    exprs: list[str]                             # the queries as sent, variables filled


def timeseries_panels(path: Path = DASHBOARD) -> list[dict]:
    """The dashboard's time-series panels in order, those inside collapsed rows included."""
    out = []
    for p in json.loads(path.read_text())["panels"]:
        out.extend(q for q in [p, *p.get("panels", [])] if q.get("type") == "timeseries")
    return out


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' value of that label."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def variable_values(prom: Prometheus, path: Path = DASHBOARD) -> dict[str, str]:
    """Each query variable as Grafana fills it with every value selected: the values its
    label_values(...) query finds, joined into one regex (the dashboard's allValue when it has
    one)."""
    out = {}
    for v in json.loads(path.read_text())["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
        if not m:
            raise ValueError(f"variable {v['name']!r}: query {q!r} is not label_values(series, "
                             "label), the only kind filled here")
        found = prom.label_values(m.group(2), m.group(1))
        out[v["name"]] = v.get("allValue") or "|".join(re.escape(x) for x in found)
    return out


def dashboard_panels(prom: Prometheus, start: float, end: float, step: float, *,
                     window: float | None = None, variables: dict[str, str] | None = None,
                     dashboard: Path = DASHBOARD) -> list[Panel]:
    """Each time-series panel's series between unix times `start` and `end`, one point every
    `step` seconds, times given in seconds since `start`, NaN points left out (Grafana draws
    none). `window` (seconds) replaces the queries' range windows ([1m]) for runs too short for
    them; `variables` override the template variables (default: all values, see
    variable_values)."""
    fill = {**variable_values(prom, dashboard), **(variables or {})}

    def value(m: re.Match) -> str:
        if m.group(1) not in fill:
            raise ValueError(f"variable ${m.group(1)} in {m.string!r} has no value: pass "
                             f"variables={{{m.group(1)!r}: ...}} (known: {sorted(fill)})")
        return fill[m.group(1)]

    out = []
    for p in timeseries_panels(dashboard):
        series, exprs = {}, []
        for target in p.get("targets", []):
            expr = re.sub(r"\$(\w+)", value, target["expr"])
            expr = with_window(expr, window)
            exprs.append(expr)
            for s in prom.query_range(expr, start, end, step):
                kept = [(t - start, v) for t, v in zip(s.times, s.values) if not math.isnan(v)]
                if kept:
                    name = legend(target.get("legendFormat", ""), s.labels) or expr
                    series[name] = ([t for t, _ in kept], [v for _, v in kept])
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        out.append(Panel(p["title"], unit, series, exprs))
    return out
