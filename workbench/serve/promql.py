"""The part of PromQL that deploy/'s dashboard and recording rules use, evaluated over scrapes
of /metrics held in memory, so a notebook can draw the dashboard's panels from a live run without
a Prometheus server.

    scrapes = [Scrape(t, samples), ...]                 # e.g. from serve.scrape.MetricsRecorder
    q = parse('histogram_quantile(0.99, sum by (le) (rate(x_bucket[1m])))')
    q.series(scrapes)                                   # {labels: ([t...], [v...])}

Covered: selectors with =, !=, =~, !~ matchers and `$variables`; range selectors; rate,
increase, avg_over_time, max_over_time; sum/avg/max/min/count with `by (...)`; histogram_quantile;
number literals; + - * / between vectors with identical label sets, or a vector and a number.
Anything else is refused with its position, so a dashboard edit the notebook cannot draw fails
loudly instead of drawing something else.

Semantics follow Prometheus's documentation with one simplification: rate and increase take the
first and last samples inside the window and do not extrapolate to the window's edges, so a short
run's first window reads lower than Prometheus would show (by at most one scrape interval's share).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

Labels = frozenset            # of (name, value) pairs, without __name__


@dataclass
class Scrape:
    """One scrape: its time in seconds and its samples as (metric name, labels, value)."""
    t: float
    samples: list[tuple[str, dict[str, str], float]]


class PromQLError(ValueError):
    pass


_TOKEN = re.compile(r"""\s*(?:
    (?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?P<unit>ms|s|m|h|d)?(?![\w:])
  | (?P<name>[A-Za-z_:][\w:]*)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|==|[=(){}\[\],/*+-])
)""", re.X)
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_AGGREGATIONS = {"sum": sum, "max": max, "min": min, "count": len,
                 "avg": lambda v: sum(v) / len(v)}
_RANGE_FUNCTIONS = ("rate", "increase", "avg_over_time", "max_over_time")


def _substitute(expr: str, variables: dict[str, str]) -> str:
    def value(m):
        name = m.group(1)
        if name not in variables:
            raise PromQLError(f"variable ${name} in {expr!r} has no value: pass variables="
                              f"{{{name!r}: ...}} (known: {sorted(variables)})")
        return variables[name]
    return re.sub(r"\$(\w+)", value, expr)


def _duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d*)?)(ms|s|m|h|d)", text)
    return float(m.group(1)) * _UNIT[m.group(2)]


# ---- the expression tree -------------------------------------------------------------------------

@dataclass
class _Ctx:
    scrapes: list[Scrape]
    rules: dict[str, "Query"]
    window: float | None              # overrides every range's duration when set
    lookback: float = 300.0           # how old an instant selector's newest sample may be


@dataclass
class _Selector:
    name: str
    matchers: list[tuple[str, str, str]]
    range: float | None = None

    def _match(self, labels: dict[str, str]) -> bool:
        for label, op, value in self.matchers:
            have = labels.get(label, "")
            if op == "=" and have != value or op == "!=" and have == value:
                return False
            if op == "=~" and not re.fullmatch(value, have) or op == "!~" and re.fullmatch(value, have):
                return False
        return True

    def at(self, ctx: _Ctx, t: float) -> dict[Labels, float]:
        if self.name in ctx.rules:                   # a recording rule: evaluate its expression
            return {k: v for k, v in ctx.rules[self.name].at(ctx, t).items() if self._match(dict(k))}
        scrape = next((s for s in reversed(ctx.scrapes) if s.t <= t), None)
        if scrape is None or t - scrape.t > ctx.lookback:
            return {}
        return {frozenset(labels.items()): v for name, labels, v in scrape.samples
                if name == self.name and self._match(labels)}

    def window(self, ctx: _Ctx, t: float) -> dict[Labels, list[tuple[float, float]]]:
        width = ctx.window if ctx.window is not None else self.range
        out: dict[Labels, list[tuple[float, float]]] = {}
        for s in ctx.scrapes:
            if t - width < s.t <= t:
                for name, labels, v in s.samples:
                    if name == self.name and self._match(labels):
                        out.setdefault(frozenset(labels.items()), []).append((s.t, v))
        return out


def _increase(points: list[tuple[float, float]]) -> float:
    """Counter increase from the first to the last point, a drop counted as a restart from 0."""
    total = 0.0
    for (_, a), (_, b) in zip(points, points[1:]):
        total += b - a if b >= a else b
    return total


@dataclass
class _Call:
    fn: str
    args: list

    def at(self, ctx: _Ctx, t: float):
        if self.fn in _RANGE_FUNCTIONS:
            out = {}
            for k, pts in self.args[0].window(ctx, t).items():
                if self.fn in ("avg_over_time", "max_over_time"):
                    vals = [v for _, v in pts]
                    out[k] = sum(vals) / len(vals) if self.fn == "avg_over_time" else max(vals)
                elif len(pts) >= 2:
                    inc = _increase(pts)
                    out[k] = inc if self.fn == "increase" else inc / (pts[-1][0] - pts[0][0])
            return out
        q, vector = self.args[0].at(ctx, t), self.args[1].at(ctx, t)
        groups: dict[Labels, list[tuple[float, float]]] = {}
        for k, v in vector.items():
            labels = dict(k)
            le = labels.pop("le", None)
            if le is not None:
                groups.setdefault(frozenset(labels.items()), []).append((float(le), v))
        return {k: histogram_quantile(q, b) for k, b in groups.items()}


@dataclass
class _Aggregate:
    op: str
    by: list[str]
    arg: object

    def at(self, ctx: _Ctx, t: float) -> dict[Labels, float]:
        groups: dict[Labels, list[float]] = {}
        for k, v in self.arg.at(ctx, t).items():
            key = frozenset((n, val) for n, val in k if n in self.by)
            groups.setdefault(key, []).append(v)
        return {k: _AGGREGATIONS[self.op](vals) for k, vals in groups.items()}


@dataclass
class _Number:
    value: float

    def at(self, ctx: _Ctx, t: float) -> float:
        return self.value


_BINARY: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))}


@dataclass
class _Binary:
    op: str
    left: object
    right: object

    def at(self, ctx: _Ctx, t: float):
        a, b, f = self.left.at(ctx, t), self.right.at(ctx, t), _BINARY[self.op]
        if isinstance(a, float) and isinstance(b, float):
            return f(a, b)
        if isinstance(a, float):
            return {k: f(a, v) for k, v in b.items()}
        if isinstance(b, float):
            return {k: f(v, b) for k, v in a.items()}
        return {k: f(v, b[k]) for k, v in a.items() if k in b}     # one-to-one on equal labels


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's estimate of the q-quantile from cumulative (upper bound, count) buckets: find
    the bucket holding rank q * total and interpolate linearly inside it; the lowest bucket starts
    at 0 (when its bound is positive); a rank in the +Inf bucket answers the highest finite bound."""
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    b = sorted(buckets)
    if not b or not math.isinf(b[-1][0]) or b[-1][1] == 0:
        return math.nan
    total, rank = b[-1][1], q * b[-1][1]
    i = next(i for i, (_, count) in enumerate(b) if count >= rank)
    if i == len(b) - 1:
        return b[-2][0] if len(b) > 1 else math.nan
    upper, count = b[i]
    lower, below = (b[i - 1][0], b[i - 1][1]) if i > 0 else (0.0 if upper > 0 else upper, 0.0)
    if count == below:
        return upper
    return lower + (upper - lower) * (rank - below) / (count - below)


# ---- the parser ----------------------------------------------------------------------------------

class _Parser:
    def __init__(self, expr: str):
        self.expr, self.toks, self.i = expr, [], 0
        pos = 0
        while True:
            m = _TOKEN.match(expr, pos)
            if expr[pos:].strip() == "":
                break
            if not m or m.end() == pos:
                raise PromQLError(f"cannot read {expr[pos:].strip()[:20]!r} at position {pos} "
                                  f"of {expr!r}")
            if m.group("unit"):
                self.toks.append(("dur", m.group("num") + m.group("unit"), m.start("num")))
            else:
                kind = m.lastgroup
                self.toks.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()

    def peek(self, k: int = 0):
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("end", "", len(self.expr))

    def fail(self, what: str):
        kind, text, pos = self.peek()
        raise PromQLError(f"{what} at position {pos} of {self.expr!r} (found {text or 'the end'!r})")

    def take(self, text: str):
        if self.peek()[1] != text:
            self.fail(f"expected {text!r}")
        self.i += 1

    def parse(self):
        node = self.sum()
        if self.peek()[0] != "end":
            self.fail("unexpected text")
        return node

    def sum(self):
        node = self.product()
        while self.peek()[1] in ("+", "-"):
            op = self.peek()[1]
            self.i += 1
            node = _Binary(op, node, self.product())
        return node

    def product(self):
        node = self.term()
        while self.peek()[1] in ("*", "/"):
            op = self.peek()[1]
            self.i += 1
            node = _Binary(op, node, self.term())
        return node

    def labels(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            kind, text, _ = self.peek()
            if kind != "name":
                self.fail("expected a label name")
            names.append(text)
            self.i += 1
            if self.peek()[1] == ",":
                self.i += 1
        self.take(")")
        return names

    def term(self):
        kind, text, _ = self.peek()
        if text == "(":
            self.i += 1
            node = self.sum()
            self.take(")")
            return node
        if kind == "num":
            self.i += 1
            return _Number(float(text))
        if kind != "name":
            self.fail("expected a number, a metric, a function or an aggregation")
        if text in _AGGREGATIONS and self.peek(1)[1] in ("by", "("):
            self.i += 1
            by = None
            if self.peek()[1] == "by":
                self.i += 1
                by = self.labels()
            self.take("(")
            arg = self.sum()
            self.take(")")
            if by is None and self.peek()[1] == "by":
                self.i += 1
                by = self.labels()
            return _Aggregate(text, by or [], arg)
        if self.peek(1)[1] == "(" and text in (*_RANGE_FUNCTIONS, "histogram_quantile"):
            self.i += 2
            if text == "histogram_quantile":
                q = self.sum()
                self.take(",")
                args = [q, self.sum()]
            else:
                sel = self.term()
                if not isinstance(sel, _Selector) or sel.range is None:
                    self.fail(f"{text}() takes a range selector such as x[1m]")
                args = [sel]
            self.take(")")
            return _Call(text, args)
        if self.peek(1)[1] == "(":
            self.fail(f"the function or aggregation {text!r} is not covered")
        return self.selector()

    def selector(self) -> _Selector:
        name = self.peek()[1]
        self.i += 1
        matchers = []
        if self.peek()[1] == "{":
            self.i += 1
            while self.peek()[1] != "}":
                label = self.peek()
                op = self.peek(1)
                value = self.peek(2)
                if label[0] != "name" or op[1] not in ("=", "!=", "=~", "!~") or value[0] != "str":
                    self.fail('expected a matcher such as label="value"')
                raw = value[1][1:-1].encode().decode("unicode_escape")
                matchers.append((label[1], op[1], raw))
                self.i += 3
                if self.peek()[1] == ",":
                    self.i += 1
            self.take("}")
        rng = None
        if self.peek()[1] == "[":
            self.i += 1
            kind, text, _ = self.peek()
            if kind != "dur":
                self.fail("expected a duration such as 1m")
            rng = _duration(text)
            self.i += 1
            self.take("]")
        return _Selector(name, matchers, rng)


@dataclass
class Query:
    """One parsed expression; `at` and `series` evaluate it over scrapes."""
    expr: str
    node: object = field(repr=False)

    def at(self, ctx: _Ctx, t: float):
        return self.node.at(ctx, t)

    def series(self, scrapes: list[Scrape], *, rules: dict[str, "Query"] | None = None,
               window: float | None = None) -> dict[Labels, tuple[list[float], list[float]]]:
        """The expression evaluated at every scrape's time, as Grafana's range query would at that
        step: {labels: (times, values)}, NaN values left out. `window` (seconds) replaces every
        range's duration, e.g. [1m] -> [10s] for a run shorter than the dashboard's windows."""
        ctx = _Ctx(scrapes, rules or {}, window)
        out: dict[Labels, tuple[list[float], list[float]]] = {}
        for s in scrapes:
            value = self.at(ctx, s.t)
            if isinstance(value, float):
                value = {frozenset(): value}
            for k, v in value.items():
                if not math.isnan(v):
                    ts, vs = out.setdefault(k, ([], []))
                    ts.append(s.t)
                    vs.append(v)
        return out


def parse(expr: str, variables: dict[str, str] | None = None) -> Query:
    """Parse `expr`, replacing each $name by variables[name] (e.g. {"model_name": ".*"}, what
    Grafana sends for "All")."""
    text = _substitute(expr, variables or {})
    return Query(text, _Parser(text).parse())


def legend(fmt: str, labels: Labels) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' value of that label."""
    values = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), fmt).strip()
