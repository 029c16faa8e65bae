"""The observability assets under deploy/: every metric and label the Grafana dashboard, the
recording rules and the autoscaler read is one a live server exports, and the Prometheus,
Grafana, docker-compose and Kubernetes files name each other consistently."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_serve import KEY, MODEL, start_server, stop_server

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "workbench.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
PROMETHEUS_K8S = DEPLOY / "prometheus" / "prometheus-k8s.yml"
RULES = DEPLOY / "prometheus" / "recording_rules.yml"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"

# PromQL words that look like metric names but are not.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset", "inf", "nan"}
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def load_all_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def promql_parts(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression reads: selectors, matchers and grouping."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\[[^\]]*\]", " ", e)                  # range windows: [1m], [$__rate_interval]
    labels: set[str] = set()
    for body in re.findall(r"\{([^}]*)\}", e):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    e = re.sub(r"\{[^}]*\}", " ", e)
    for body in re.findall(GROUPING, e):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    e = re.sub(GROUPING, " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() in KEYWORDS or e[m.end():].lstrip().startswith("("):
            continue                                            # a function or an aggregation
        names.add(m.group())
    return names, labels


def outer_by_labels(expr: str) -> set[str]:
    """The labels a recording rule's result keeps: those of its first `by (...)` clause."""
    m = re.search(r"\bby\s*\(([^)]*)\)", expr)
    assert m, f"recording rule without `by (...)`: {expr}"
    return {x.strip() for x in m.group(1).split(",") if x.strip()}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))                        # panels inside collapsed rows
    return out


def dashboard_queries(dash: dict) -> list[tuple[str, str, str]]:
    """(where, expr, legendFormat) of every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"], t.get("legendFormat", ""))
           for p in panels(dash) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_]+)\)", q)
            assert m, f"variable {v['name']}: {q}"
            out.append((f"variable {v['name']!r}", m.group(1), "{{%s}}" % m.group(2)))
    return out


def recording_rules() -> dict[str, str]:
    return {r["record"]: r["expr"] for g in load_yaml(RULES)["groups"] for r in g["rules"]}


def target_labels(*configs: Path) -> set[str]:
    """Labels Prometheus attaches at scrape time: job, instance, relabelled and static labels."""
    out = {"job", "instance"}
    for path in configs:
        for job in load_yaml(path)["scrape_configs"]:
            for r in job.get("relabel_configs", []):
                if r.get("target_label") and not r["target_label"].startswith("__"):
                    out.add(r["target_label"])
            for s in job.get("static_configs", []):
                out |= set(s.get("labels", {}))
    return out


def seconds(duration: str) -> float:
    return sum(int(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u]
               for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))


def check_against(series: dict[str, set[str]], rules: dict[str, str], extra_labels: set[str],
                  where: str, expr: str, legend: str = "") -> list[str]:
    """What `expr` reads that `series` (sample name -> its label names) lacks."""
    names, labels = promql_parts(expr)
    labels |= set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))
    problems, available = [], set(extra_labels)
    if not names:
        problems.append(f"{where}: no metric in {expr!r}")
    for name in names:
        if name in series:
            available |= series[name]
        elif name in rules:
            available |= outer_by_labels(rules[name])
        else:
            problems.append(f"{where}: {name} is neither exported nor a recording rule")
    problems += [f"{where}: label {lab!r} is on none of {sorted(names)}"
                 for lab in sorted(labels - available)]
    return problems


# ------------------------------------------------------------------ the live server
@pytest.fixture(scope="module")
def server(tiny_folder):
    proc, url = start_server(tiny_folder, "--api-key", KEY, "--enable-prefix-caching")
    yield url
    stop_server(proc)


def drive(url: str) -> int:
    """Plain, streamed and chat requests, then one with a wrong API key; the tokens generated."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    tokens = 0
    for prompt in ("The capital of France is", "Once upon a time"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        tokens += r.usage.completion_tokens
    chunks = list(client.completions.create(
        model=MODEL, prompt="Streaming works", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    tokens += chunks[-1].usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    tokens += chunks[-1].usage.completion_tokens
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    return tokens


@pytest.fixture(scope="module")
def live(server):
    """(sample name -> label names, sample name -> [(labels, value)], tokens generated) of the
    server's /metrics after drive()."""
    tokens = drive(server)
    text = httpx.get(f"{server}/metrics", timeout=10).text
    series: dict[str, set[str]] = {}
    values: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            series.setdefault(s.name, set()).update(s.labels)
            values.setdefault(s.name, []).append((s.labels, s.value))
    return series, values, tokens


def total(values, name: str, **labels) -> float:
    return sum(v for lab, v in values.get(name, [])
               if all(lab.get(k) == x for k, x in labels.items()) and "le" not in lab)


def test_the_traffic_shows_in_the_scrape(live):
    series, values, tokens = live
    assert total(values, "workbench:generation_tokens_total", model_name=MODEL) == tokens
    assert total(values, "workbench:time_to_first_token_seconds_count") == 4
    assert total(values, "workbench:e2e_request_latency_seconds_count") == 4
    assert total(values, "workbench:request_success_total", finished_reason="length") == 4
    assert total(values, "workbench:prompt_tokens_total") > 0


def test_a_wrong_api_key_counts_as_a_rejection(live):
    series, values, _ = live
    assert series["workbench:request_rejected_total"] >= {"model_name", "reason"}
    assert total(values, "workbench:request_rejected_total", reason="unauthorized") == 1


def test_every_dashboard_query_reads_what_the_server_exports(live):
    series, _, _ = live
    rules, extra = recording_rules(), target_labels(PROMETHEUS, PROMETHEUS_K8S)
    queries = dashboard_queries(dashboard())
    assert len(queries) >= 15
    problems = [p for q in queries for p in check_against(series, rules, extra, *q)]
    assert not problems, "\n".join(problems)


def test_every_recording_rule_reads_what_the_server_exports(live):
    series, _, _ = live
    rules = recording_rules()
    extra = target_labels(PROMETHEUS, PROMETHEUS_K8S)
    problems = [p for name, expr in rules.items()
                for p in check_against(series, {}, extra, f"rule {name}", expr)]
    assert not problems, "\n".join(problems)
    for name in rules:                                 # level:metric:operation, and new names
        assert re.fullmatch(r"workbench:[a-z_]+:[a-z0-9_]+", name), name
        assert name not in series


def test_the_autoscaling_metrics_come_from_exported_series(live):
    series, _, _ = live
    rules = recording_rules()
    for rule in adapter_rules():
        name = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group()
        assert name in series or name in rules, rule["seriesQuery"]
        if name in rules:
            assert check_against(series, {}, target_labels(PROMETHEUS_K8S), name,
                                 rules[name]) == []


# ------------------------------------------------------------------ the checker itself
def test_the_query_checker_finds_what_is_missing():
    series = {"workbench:x_bucket": {"le", "model_name"}, "workbench:y_total": {"model_name"}}
    names, labels = promql_parts(
        'histogram_quantile(0.99, sum by (le) (rate(workbench:x_bucket{model_name=~"$model_name"}'
        '[$__rate_interval]))) / on (model_name) workbench:y_total offset 1m')
    assert names == {"workbench:x_bucket", "workbench:y_total"}
    assert labels == {"le", "model_name"}
    assert check_against(series, {}, set(), "p", "rate(workbench:y_total[1m])") == []
    typo = check_against(series, {}, set(), "p", "rate(workbench:y[1m])")
    assert typo == ["p: workbench:y is neither exported nor a recording rule"]
    wrong_label = check_against(series, {}, {"instance"}, "p",
                                "sum by (reason, instance) (rate(workbench:y_total[1m]))")
    assert wrong_label == ["p: label 'reason' is on none of ['workbench:y_total']"]
    legend = check_against(series, {}, set(), "p", "workbench:y_total", "{{pod}}")
    assert legend == ["p: label 'pod' is on none of ['workbench:y_total']"]
    rules = {"workbench:y:rate1m": "sum by (pod) (rate(workbench:y_total[1m]))"}
    assert check_against(series, rules, set(), "p", "workbench:y:rate1m", "{{pod}}") == []


# ------------------------------------------------------------------ the dashboard
def test_the_dashboard_shows_what_it_promises():
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query" and variables["model_name"]["multi"]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert 'model_name=~"$model_name"' in t["expr"], (p["title"], t["expr"])
    exprs = [re.sub(r"\s+", " ", t["expr"]) for p in panels(dash) for t in p.get("targets", [])]
    wanted = [rf"histogram_quantile\({q}, sum by \(le[^)]*\) "
              rf"\(rate\(workbench:{h}_bucket\{{[^}}]*\}}\[1m\]\)\)\)"
              for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                        "inter_token_latency_seconds", "e2e_request_latency_seconds")
              for q in ("0.5", "0.99")]
    wanted += [r"rate\(workbench:prompt_tokens_total", r"rate\(workbench:generation_tokens_total",
               r"workbench:num_requests_running", r"workbench:num_requests_waiting",
               r"by \([^)]*\breason\b[^)]*\) \(rate\(workbench:request_rejected_total",
               r"by \([^)]*\bfinished_reason\b[^)]*\) \(rate\(workbench:request_success_total",
               r"workbench:kv_cache_usage_perc",
               r"rate\(workbench:prefix_cache_hits_total.* / "
               r".*rate\(workbench:prefix_cache_queries_total",
               r"rate\(workbench:num_preemptions_total",
               r"rate\(workbench:spec_decode_num_accepted_tokens_total.* / "
               r".*rate\(workbench:spec_decode_num_draft_tokens_total",
               r"workbench:generation_tokens:rate1m"]
    missing = [w for w in wanted if not any(re.search(w, e) for e in exprs)]
    assert not missing, missing


# ------------------------------------------------------------------ Prometheus, Grafana, compose
def test_prometheus_scrapes_often_enough_for_the_rate_windows():
    for path in (PROMETHEUS, PROMETHEUS_K8S):
        cfg = load_yaml(path)
        interval = seconds(cfg["global"]["scrape_interval"])
        assert interval <= 15 and seconds(cfg["global"]["scrape_timeout"]) < interval
        assert [(path.parent / f).is_file() for f in cfg["rule_files"]] == [True] * len(
            cfg["rule_files"])
        for job in cfg["scrape_configs"]:
            assert job.get("metrics_path", "/metrics") == "/metrics"
            interval_job = seconds(job.get("scrape_interval", cfg["global"]["scrape_interval"]))
            windows = re.findall(r"\[(\d+[smh])\]", RULES.read_text() + DASHBOARD.read_text())
            assert windows and all(seconds(w) >= 4 * interval_job for w in windows)
    for group in load_yaml(RULES)["groups"]:
        assert seconds(group.get("interval", "1m")) <= 15


def test_compose_wires_the_server_prometheus_and_grafana():
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert {"server", "prometheus", "grafana"} <= set(services)
    mounts = {}
    for name, s in services.items():
        for v in s.get("volumes", []):
            src, dst = v.split(":")[:2]
            assert (COMPOSE.parent / src).exists(), (name, src)
            mounts[(name, dst)] = (COMPOSE.parent / src).resolve()
    # Prometheus reads its config and every rule file beside it.
    assert mounts[("prometheus", "/etc/prometheus/prometheus.yml")] == PROMETHEUS.resolve()
    for f in load_yaml(PROMETHEUS)["rule_files"]:
        assert mounts[("prometheus", f"/etc/prometheus/{f}")] == (RULES.parent / f).resolve()
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    # Every scrape target is a compose service serving on the port it was started with.
    for job in load_yaml(PROMETHEUS)["scrape_configs"]:
        for s in job["static_configs"]:
            for target in s["targets"]:
                host, port = target.split(":")
                command = services[host]["command"]
                assert command[command.index("--port") + 1] == port, target
                assert command[:4] == ["python", "-m", "workbench", "serve"], target
    for name, s in services.items():                   # health checks ask the port served
        if "healthcheck" in s:
            port = s["command"][s["command"].index("--port") + 1]
            assert f"127.0.0.1:{port}/health" in " ".join(s["healthcheck"]["test"]), name
    router = services["router"]["command"]
    replicas = [router[i + 1] for i, a in enumerate(router) if a == "--replica"]
    assert replicas == [f"http://{t}" for s in load_yaml(PROMETHEUS)["scrape_configs"][1]
                        ["static_configs"] for t in s["targets"]]
    # Grafana provisions the data source and the dashboards folder it mounts.
    prov = mounts[("grafana", "/etc/grafana/provisioning")]
    assert prov == (DEPLOY / "grafana" / "provisioning").resolve()
    provider = load_yaml(prov / "dashboards" / "workbench.yaml")["providers"][0]
    assert mounts[("grafana", provider["options"]["path"])] == DASHBOARD.parent.resolve()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    ds = load_yaml(prov / "datasources" / "prometheus.yaml")["datasources"]
    assert [d["type"] for d in ds] == ["prometheus"] and ds[0]["isDefault"]
    assert ds[0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]


def test_every_command_line_uses_real_server_flags():
    """The compose services' and the Deployment's flags exist in `python -m workbench`."""
    helps = {c: subprocess.run([sys.executable, "-m", "workbench", c, "--help"],
                               capture_output=True, text=True, check=True).stdout
             for c in ("serve", "router")}
    commands = [s["command"] for s in load_yaml(COMPOSE)["services"].values()
                if s.get("command", [None])[0] == "python"]
    container = deployment()["spec"]["template"]["spec"]["containers"][0]
    commands.append(container["command"] + container["args"])
    assert len(commands) >= 5
    for cmd in commands:
        assert cmd[:3] == ["python", "-m", "workbench"] and cmd[3] in helps, cmd
        for flag in (a.split("=")[0] for a in cmd[4:] if a.startswith("--")):
            pattern = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
            assert re.search(pattern, helps[cmd[3]]), (cmd[3], flag)


# ------------------------------------------------------------------ Kubernetes
def k8s_objects() -> list[dict]:
    return [d for path in sorted(K8S.glob("*.yaml"))
            if path.name != "prometheus-adapter-values.yaml" for d in load_all_yaml(path)]


def k8s_object(kind: str) -> dict:
    found = [d for d in k8s_objects() if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def deployment() -> dict:
    return k8s_object("Deployment")


def adapter_rules() -> list[dict]:
    return load_yaml(K8S / "prometheus-adapter-values.yaml")["rules"]["custom"]


def test_kubernetes_objects_match_the_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    objects = k8s_objects()
    assert {d["kind"] for d in objects} == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for d in objects:
        kv.validate(d, "1.30.0", strict=True)
    broken = json.loads(json.dumps(k8s_object("HorizontalPodAutoscaler")))
    broken["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = "1"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.30.0", strict=True)


def test_the_deployment_is_scraped_probed_and_served():
    dep, svc = deployment(), k8s_object("Service")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = dict(a.split("=", 1) for a in container["args"] if "=" in a)
    assert int(args["--port"]) == ports["http"] and args["--host"] == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    # Prometheus in the cluster keeps exactly these pods, at this port and path.
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == ports["http"]
    relabel = load_yaml(PROMETHEUS_K8S)["scrape_configs"][0]["relabel_configs"]
    keep = {r["source_labels"][0]: r["regex"] for r in relabel if r.get("action") == "keep"}
    assert keep["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] == "true"
    assert labels["app.kubernetes.io/name"] == keep[
        "__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    # Running requests finish before the kill.
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(args["--shutdown-timeout"])


def test_the_autoscaler_scales_the_deployment_on_the_adapter_metrics():
    hpa, dep = k8s_object("HorizontalPodAutoscaler"), deployment()
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"], "Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    exported = {}
    rules = recording_rules()
    for rule in adapter_rules():
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group()
        assert re.search(rule["name"]["matches"], series), rule
        exported[rule["name"]["as"]] = series
        over = rule["resources"]["overrides"]
        assert over == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        # The series carries namespace and pod: the recording rule keeps them, Prometheus sets them.
        assert {"namespace", "pod"} <= outer_by_labels(rules[series])
        assert {"namespace", "pod"} <= target_labels(PROMETHEUS_K8S)
        for part in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert part in rule["metricsQuery"]
    metrics = hpa["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Pods"] * len(metrics)
    names = [m["pods"]["metric"]["name"] for m in metrics]
    assert set(names) == set(exported)
    assert exported[names[0]] == "workbench:generation_tokens:rate1m"   # tokens/s drives it
    assert "rate(workbench:generation_tokens_total[1m])" in rules[exported[names[0]]]
    for m in metrics:
        target = m["pods"]["target"]
        assert target["type"] == "AverageValue" and float(target["averageValue"]) > 0
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] <= 60
    for direction in ("scaleUp", "scaleDown"):
        assert behavior[direction]["policies"]
