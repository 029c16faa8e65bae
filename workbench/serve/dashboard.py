"""deploy/'s Grafana dashboard evaluated over in-memory scrapes: every time-series panel's
queries (through deploy/'s recording rules where a panel reads one) as the series Grafana would
draw, for a notebook without Prometheus or Grafana.

    panels = dashboard_panels(recorder.scrapes, window=10)
    panels[0].title, panels[0].series     # {"p50 smollm2": ([t...], [v...]), ...}
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from workbench.serve.promql import Query, Scrape, legend, parse

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "workbench.json"
RULES = DEPLOY / "prometheus" / "recording_rules.yml"


@dataclass
class Panel:
    title: str
    unit: str                                    # Grafana's unit id ("s", "percentunit", ...)
    series: dict[str, tuple[list[float], list[float]]]
    exprs: list[str]


def load_rules(path: Path = RULES) -> dict[str, Query]:
    """Recording rules by the name they record."""
    groups = yaml.safe_load(path.read_text())["groups"]
    return {r["record"]: parse(r["expr"]) for g in groups for r in g["rules"]}


def timeseries_panels(path: Path = DASHBOARD) -> list[dict]:
    """The dashboard's time-series panels in order, those inside collapsed rows included."""
    out = []
    for p in json.loads(path.read_text())["panels"]:
        out.extend(q for q in [p, *p.get("panels", [])] if q.get("type") == "timeseries")
    return out


def dashboard_panels(scrapes: list[Scrape], *, window: float | None = None,
                     variables: dict[str, str] | None = None, dashboard: Path = DASHBOARD,
                     rules: Path = RULES) -> list[Panel]:
    """Each time-series panel's series over `scrapes`. `window` (seconds) replaces the queries'
    rate windows ([1m]) for runs too short for them; `variables` fill the dashboard's template
    variables (default: every one of them matches all values, Grafana's "All")."""
    recorded = load_rules(rules)
    out = []
    for p in timeseries_panels(dashboard):
        series, exprs = {}, []
        for target in p.get("targets", []):
            names = re.findall(r"\$(\w+)", target["expr"])
            q = parse(target["expr"], {**{n: ".*" for n in names}, **(variables or {})})
            exprs.append(q.expr)
            for labels, points in q.series(scrapes, rules=recorded, window=window).items():
                series[legend(target.get("legendFormat", ""), labels) or q.expr] = points
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        out.append(Panel(p["title"], unit, series, exprs))
    return out

