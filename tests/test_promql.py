"""serve/promql.py against hand computations of PromQL's documented semantics, and every query of
deploy/'s dashboard and recording rules parsed and evaluated over a real server's scrapes."""
from __future__ import annotations

import math

import pytest

from workbench.serve.dashboard import dashboard_panels, load_rules, timeseries_panels
from workbench.serve.promql import PromQLError, Scrape, histogram_quantile, legend, parse


def counter_scrapes(values, name="reqs_total", step=1.0, **labels):
    return [Scrape(i * step, [(name, dict(labels), float(v))]) for i, v in enumerate(values)]


def last(q, scrapes, **kw):
    series = q.series(scrapes, **kw)
    return {k: v[-1] for k, (t, v) in series.items()}


def test_rate_is_the_increase_over_the_window_divided_by_its_span():
    s = counter_scrapes([0, 2, 4, 10, 10, 16])         # one scrape a second
    out = parse("rate(reqs_total[3s])").series(s)[frozenset()]
    # at t=3 the window (0, 3] holds t=1..3: (10 - 2) / 2; at t=5: t=3..5, (16 - 10) / 2
    assert out[0] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert out[1] == [2.0, 2.0, 4.0, 3.0, 3.0]


def test_a_counter_restart_counts_from_zero():
    s = counter_scrapes([5, 8, 2, 6])                  # the server restarted between t=1 and t=2
    assert last(parse("increase(reqs_total[10s])"), s) == {frozenset(): 3 + 2 + 4}


def test_window_overrides_every_range():
    s = counter_scrapes([0, 1, 3, 6, 10])
    assert last(parse("rate(reqs_total[1m])"), s, window=2.0) == {frozenset(): 4.0}
    assert last(parse("rate(reqs_total[1m])"), s) == {frozenset(): 2.5}


def test_histogram_quantile_interpolates_inside_the_bucket():
    b = [(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.1 + 0.1 * (20 - 10) / 20)
    assert histogram_quantile(0.25, b) == pytest.approx(0.1)              # rank 10: top of bucket 1
    assert histogram_quantile(0.1, b) == pytest.approx(0.04)              # the first bucket starts at 0
    assert histogram_quantile(0.99, b) == pytest.approx(0.2 + 0.2 * (39.6 - 30) / 10)


def test_histogram_quantile_in_the_inf_bucket_answers_the_highest_finite_bound():
    assert histogram_quantile(0.99, [(0.1, 1.0), (0.2, 2.0), (math.inf, 10.0)]) == 0.2
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))
    assert math.isnan(histogram_quantile(0.5, [(0.1, 3.0)]))              # no +Inf bucket


def test_quantile_of_rates_by_label_group():
    def scrape(t, a, b):
        return Scrape(t, [("lat_bucket", {"le": "0.1", "m": "x"}, a),
                          ("lat_bucket", {"le": "+Inf", "m": "x"}, b),
                          ("lat_bucket", {"le": "0.1", "m": "y"}, 0.0),
                          ("lat_bucket", {"le": "+Inf", "m": "y"}, b)])
    s = [scrape(0, 0, 0), scrape(1, 4, 8)]
    q = parse('histogram_quantile(0.25, sum by (le, m) (rate(lat_bucket{m=~"$m"}[5s])))', {"m": ".*"})
    out = last(q, s)
    assert out[frozenset({("m", "x")})] == pytest.approx(0.05)           # rank 2 of 4 in [0, 0.1]
    assert out[frozenset({("m", "y")})] == 0.1                           # all above 0.1: the bound


def test_aggregations_matchers_and_division():
    s = [Scrape(0, [("hits_total", {"m": "a", "i": "1"}, 0.0), ("hits_total", {"m": "a", "i": "2"}, 0.0),
                    ("q_total", {"m": "a", "i": "1"}, 0.0), ("q_total", {"m": "a", "i": "2"}, 0.0),
                    ("g", {"m": "a", "i": "1"}, 0.5), ("g", {"m": "b", "i": "2"}, 0.9)]),
         Scrape(2, [("hits_total", {"m": "a", "i": "1"}, 2.0), ("hits_total", {"m": "a", "i": "2"}, 4.0),
                    ("q_total", {"m": "a", "i": "1"}, 8.0), ("q_total", {"m": "a", "i": "2"}, 16.0),
                    ("g", {"m": "a", "i": "1"}, 0.25), ("g", {"m": "b", "i": "2"}, 0.75)])]
    ratio = parse("sum by (m) (rate(hits_total[1m])) / sum by (m) (rate(q_total[1m]))")
    assert last(ratio, s) == {frozenset({("m", "a")}): 6 / 24}
    assert last(parse('max by (m) (g{m!="b"})'), s) == {frozenset({("m", "a")}): 0.25}
    assert last(parse('sum(g{m=~"a|b"}) * 2'), s) == {frozenset(): 2.0}
    assert last(parse('count by (i) (g{i!~"1"})'), s) == {frozenset({("i", "2")}): 1}
    assert last(parse("avg by (m) (avg_over_time(g[1m]))"), s) == {
        frozenset({("m", "a")}): 0.375, frozenset({("m", "b")}): 0.825}


def test_a_recording_rule_is_evaluated_where_a_query_reads_it():
    rules = {"reqs:rate": parse("sum by (m) (rate(reqs_total[1m]))")}
    s = counter_scrapes([0, 3, 6], m="a")
    assert last(parse('reqs:rate{m="a"}'), s, rules=rules) == {frozenset({("m", "a")}): 3.0}
    assert last(parse('reqs:rate{m="b"}'), s, rules=rules) == {}


def test_instant_selector_reads_the_newest_scrape_at_or_before_t():
    s = [Scrape(0, [("g", {}, 1.0)]), Scrape(1, [("g", {}, 2.0)]), Scrape(2, [])]
    assert parse("g").series(s) == {frozenset(): ([0, 1], [1.0, 2.0])}    # gone at t=2: no point


@pytest.mark.parametrize("expr, where", [
    ("rate(x)", "range selector"),
    ("topk(3, x)", "'topk' is not covered"),
    ("sum by (le x)", "expected"),
    ('x{a=1}', "matcher"),
    ("x[5q]", "cannot read"),
    ("x +", "expected a number"),
])
def test_what_is_not_covered_is_refused_with_its_position(expr, where):
    with pytest.raises(PromQLError, match=where):
        parse(expr)


def test_a_variable_without_a_value_is_named():
    with pytest.raises(PromQLError, match=r"\$model_name"):
        parse('x{m=~"$model_name"}')


def test_legend_fills_labels():
    assert legend("p50 {{model_name}}", frozenset({("model_name", "smollm2")})) == "p50 smollm2"
    assert legend("{{reason}} {{missing}}", frozenset({("reason", "queue_full")})) == "queue_full"


def test_every_dashboard_query_and_rule_parses():
    load_rules()
    exprs = [t["expr"] for p in timeseries_panels() for t in p["targets"]]
    assert len(exprs) >= 13
    for e in exprs:
        parse(e, {"model_name": ".*"})

