"""The results table: `results/README.md`, generated from the committed JSON of every run.

    python -m workbench.bench table          # write results/README.md (and docs/performance.md's)
    python -m workbench.bench table --check  # exit 1, naming the file, if either is out of date

Reads every `results/**/*.json`. Speed runs (`python -m workbench.bench speed --json F`: "workload"
"speed", or a "ladder" with "rows") go into one table, newest first: date, machine, versions, the
commit measured, and the headline numbers against the target bars stored in the run's own
"targets". Then, per machine kind (kernels ISA, native bf16, forced ISA), the latest run's full
ladder. Matmul-floor runs (`python -m workbench.bench floor`) get their own table; any other JSON is
listed by name. Fields a run does not have read "-".

`docs/performance.md`, when it holds the lines `<!-- results-table:begin -->` and
`<!-- results-table:end -->`, gets the latest run per machine kind between them (the kinds the runs
record; runs older than that record go only into results/README.md).

The output depends only on the JSON files (sorted, no generation time), so `--check` can tell
whether the committed table is current.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- results-table:begin -->"
END = "<!-- results-table:end -->"
COMMAND = "python -m workbench.bench table"


# ------------------------------------------------------------------------------ reading
def _get(d, *keys):
    """d[k0][k1]... or None where any level is missing or not a dict."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _ratio(a, b) -> float | None:
    a, b = _num(a), _num(b)
    return a / b if a is not None and b else None


def is_speed(d) -> bool:
    return isinstance(d, dict) and (d.get("workload") == "speed"
                                    or isinstance(_get(d, "ladder", "rows"), dict))


def is_floor(d) -> bool:
    paths = _get(d, "paths")
    return (isinstance(d, dict) and d.get("workload") in (None, "floor") and isinstance(paths, dict)
            and any(isinstance(p, dict) and "floor_tok_s" in p for p in paths.values()))


def is_compress(d) -> bool:
    return isinstance(d, dict) and d.get("workload") == "compress" and isinstance(d.get("rows"),
                                                                                  list)


def is_soak(d) -> bool:
    return isinstance(d, dict) and d.get("workload") == "soak" and isinstance(d.get("rounds"), list)


def is_memory(d) -> bool:
    return (isinstance(d, dict) and d.get("workload") == "memory"
            and all(isinstance(d.get(k), dict) for k in ("offload", "kv_tiers", "kv_compression")))


def load(results_dir: Path) -> tuple[list, list, list, list, list]:
    """(speed, floor, compress, soak, other): lists of (path relative to results_dir, data),
    sorted by path. A file that is not valid JSON is listed under "other" with None as data."""
    speed, floor, compress, soak, other = [], [], [], [], []
    for path in sorted(Path(results_dir).glob("**/*.json"), key=lambda p: p.as_posix()):
        rel = path.relative_to(results_dir).as_posix()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None
        (speed if is_speed(data) else floor if is_floor(data) else
         compress if is_compress(data) else soak if is_soak(data) else other).append((rel, data))
    return speed, floor, compress, soak, other


def _newest_first(runs: list) -> list:
    """By the JSON's own "date" (ISO), newest first; runs without one last; ties by file name."""
    dated = sorted((r for r in runs if isinstance(r[1].get("date"), str)),
                   key=lambda r: (r[1]["date"], r[0]), reverse=True)
    return dated + sorted((r for r in runs if not isinstance(r[1].get("date"), str)),
                          key=lambda r: r[0])


# ------------------------------------------------------------------------ the headlines
def _share(d):
    rows = _get(d, "ladder", "rows") or {}
    label = "engine default" if "engine default" in rows else _get(d, "ladder", "best_bf16_row")
    return _num(_get(rows, label, "fraction_of_copy_bandwidth")) if isinstance(label, str) else None


def _vs_transformers(d):
    r = _num(_get(d, "offline", "ratio_vs_transformers"))
    return r if r is not None else _ratio(_get(d, "offline", "engine", "tok_s"),
                                          _get(d, "offline", "transformers", "tok_s"))


# (column header, does a target's name belong to this column, the value where no target does,
#  percent or ratio)
HEADLINES = [
    ("single-stream INT4 vs llama.cpp", lambda n: n.startswith("single-stream INT4"),
     lambda d: _num(_get(d, "ladder", "int4_vs_llamacpp")), False),
    ("single-stream default decode, share of copy bandwidth",
     lambda n: "share of copy bandwidth" in n, _share, True),
    ("offline-mixed vs transformers", lambda n: n.startswith("offline-mixed vs transformers"),
     _vs_transformers, False),
    ("offline-mixed vs llama.cpp", lambda n: n.startswith("offline-mixed vs llama.cpp"),
     lambda d: _ratio(_get(d, "offline", "engine", "tok_s"), _get(d, "offline", "llama.cpp",
                                                                  "tok_s")), False),
    ("offline-mixed time, batch_invariant / default", lambda n: "batch_invariant" in n,
     lambda d: _num(_get(d, "offline", "batch_invariant_time_ratio")), False),
]


def _targets(d: dict) -> list[dict]:
    t = d.get("targets")
    return [x for x in t if isinstance(x, dict)] if isinstance(t, list) else []


def _target_met(t: dict) -> bool | None:
    if isinstance(t.get("met"), bool):
        return t["met"]
    m, bar = _num(t.get("measured")), _num(t.get("bar"))
    if m is None or bar is None:
        return None
    return m <= bar if t.get("sense") == "max" else m >= bar


def _fmt_value(x: float | None, percent: bool) -> str:
    if x is None:
        return "-"
    return f"{x:.0%}" if percent else f"{x:.2f}x"


def _fmt_bar(x: float, percent: bool) -> str:
    return f"{x * 100:g}%" if percent else f"{x:g}x"


def headline(d: dict, column: int) -> str:
    """One headline cell: the measured value and, where the run stores a target for it, the bar
    and met / not met; "-" where the run has neither."""
    _, belongs, fallback, percent = HEADLINES[column]
    targets = [t for t in _targets(d) if isinstance(t.get("target"), str)
               and belongs(t["target"])]
    if not targets:
        return _fmt_value(fallback(d), percent)
    t = targets[0]
    value = _num(t.get("measured"))
    if value is None:
        value = fallback(d)
    cell = _fmt_value(value, percent)
    bar, met = _num(t.get("bar")), _target_met(t)
    if bar is None:
        return cell
    sign = "≤" if t.get("sense") == "max" else "≥"
    verdict = "skipped" if met is None else ("met" if met else "not met")
    return f"{cell} ({sign} {_fmt_bar(bar, percent)}: {verdict})"


# ----------------------------------------------------------------------------- machines
def _machine(d: dict) -> dict:
    m = d.get("machine")
    return m if isinstance(m, dict) else {}


def _forced(m: dict) -> tuple:
    f = m.get("forced_isa")
    return tuple(sorted((str(k), str(v)) for k, v in f.items())) if isinstance(f, dict) else ()


def machine_kind(d: dict) -> tuple:
    m = _machine(d)
    isa = m.get("kernels_isa")
    bf16 = m.get("native_bf16")
    return (isa if isinstance(isa, str) else "-", bf16 if isinstance(bf16, bool) else None,
            _forced(m))


def kind_title(kind: tuple) -> str:
    isa, bf16, forced = kind
    text = (f"kernels {isa}" if isa != "-" else "kernels ISA not recorded") + ", " + \
        {True: "native bf16", False: "no native bf16", None: "native bf16 not recorded"}[bf16]
    if forced:
        text += ", forced " + " ".join(f"{k}={v}" for k, v in forced)
    return text


def _yes_no(x) -> str:
    return "-" if not isinstance(x, bool) else ("yes" if x else "no")


def machine_cell(d: dict) -> str:
    m = _machine(d)
    cores = m.get("cores")
    parts = [str(m.get("cpu") or m.get("processor") or "-"),
             f"{cores if cores is not None else '-'} cores",
             f"kernels {m.get('kernels_isa') or '-'}",
             f"native bf16 {_yes_no(m.get('native_bf16'))}"]
    forced = _forced(m)
    if forced:
        parts.append("forced " + " ".join(f"{k}={v}" for k, v in forced))
    return ", ".join(parts)


def versions_cell(d: dict) -> str:
    m = _machine(d)
    return f"{m.get('torch') or '-'} / {m.get('python') or '-'}"


def commit_cell(d: dict) -> str:
    c = _machine(d).get("commit") or d.get("commit")
    return f"`{c}`" if isinstance(c, str) and c else "-"


def date_cell(d: dict) -> str:
    s = d.get("date")
    if not isinstance(s, str):
        return "-"
    try:
        return datetime.datetime.fromisoformat(s).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return s


# ---------------------------------------------------------------------------- rendering
def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


HEADLINE_HEADER = (["date", "run", "machine", "torch / Python", "commit"]
                   + [h[0] for h in HEADLINES])


def headline_rows(runs: list, link_prefix: str) -> list[list]:
    return [[date_cell(d), f"[{Path(rel).name}]({link_prefix}{rel})", machine_cell(d),
             versions_cell(d), commit_cell(d)] + [headline(d, i) for i in range(len(HEADLINES))]
            for rel, d in runs]


def latest_per_kind(speed: list) -> list[tuple[tuple, str, dict]]:
    """(kind, file, data) of the newest run of each machine kind, newest kind first."""
    seen, out = set(), []
    for rel, d in _newest_first(speed):
        kind = machine_kind(d)
        if kind not in seen:
            seen.add(kind)
            out.append((kind, rel, d))
    return out


def _f(x, spec: str) -> str:
    x = _num(x)
    return "-" if x is None else format(x, spec)


def ladder_section(kind: tuple, rel: str, d: dict) -> list[str]:
    lad = d.get("ladder") if isinstance(d.get("ladder"), dict) else {}
    m = _machine(d)
    lines = [f"### {kind_title(kind)}", "",
             f"Latest run: [{Path(rel).name}]({rel}), {date_cell(d)}, {machine_cell(d)}, "
             f"torch {m.get('torch') or '-'}, commit {commit_cell(d)}. "
             f"Single-stream: {lad.get('prompt_tokens', '-')}-token prompt, "
             f"{lad.get('new_tokens', '-')} new tokens, batch 1, "
             f"{lad.get('threads', '-')} threads, {lad.get('repeats', '-')} rounds; "
             f"copy bandwidth {_f(lad.get('copy_bandwidth_gbs'), '.1f')} GB/s (median).", ""]
    rows = lad.get("rows") if isinstance(lad.get("rows"), dict) else {}
    lines += _table(["row", "tok/s", "decode tok/s", "share of copy bandwidth"],
                    [[label, _f(_get(r, "tok_s"), ".1f"), _f(_get(r, "decode_tok_s"), ".1f"),
                      _fmt_value(_num(_get(r, "fraction_of_copy_bandwidth")), True)]
                     for label, r in rows.items()])
    targets = _targets(d)
    if targets:
        lines += [""] + _table(["target", "measured", "bar", "met"], [
            [t.get("target", "-"), _f(t.get("measured"), ".2f"),
             ("≤ " if t.get("sense") == "max" else "≥ ") + _f(t.get("bar"), ".2f"),
             {True: "met", False: "not met", None: "skipped"}[_target_met(t)]]
            for t in targets])
    return lines + [""]


def floor_section(floor: list) -> list[str]:
    rows = []
    for rel, d in sorted(floor, key=lambda r: r[0], reverse=True):
        for path, p in sorted(d["paths"].items()):
            p = p if isinstance(p, dict) else {}
            rows.append([f"[{Path(rel).name}]({rel})", date_cell(d), machine_cell(d),
                         d.get("model", "-"),
                         d.get("threads", "-"), path, _f(p.get("decode_gflops"), ".0f"),
                         _f(p.get("prefill_gflops"), ".0f"), _f(p.get("matmul_seconds"), ".1f"),
                         _f(p.get("floor_tok_s"), ".0f")])
    return (["## Matmul floor of offline-mixed", "",
             "`python -m workbench.bench floor --json F`: offline-mixed's matmul FLOPs over this "
             "CPU's GEMM rate on the model's shapes (bf16 where native, else fp32).", ""]
            + _table(["run", "date", "machine", "model", "threads", "path", "decode GFLOP/s",
                      "prefill GFLOP/s", "matmul s", "floor tok/s"], rows) + [""])


def compress_section(compress: list) -> list[str]:
    """Per machine kind, each variant's newest measurement (a run may measure a few variants; its
    speed ratios are against the dense engine of the same run)."""
    lines = ["## Compression", "",
             "`python -m workbench.bench compress --json F`: pruning and quantization variants "
             "against the dense model on held-out text; projection bytes dense and in the best "
             "compressed form for their zeros; decode tok/s over the same run's dense engine at "
             "batch 1 and 16 (medians of rounds); `+loss`: the pruned model distilled from the "
             "dense one with that loss (training seconds and steps). Each variant's newest "
             "measurement per machine kind.", ""]
    kinds: dict = {}
    for rel, d in _newest_first(compress):
        rows = kinds.setdefault(machine_kind(d), {})
        for r in d["rows"]:
            rows.setdefault(r.get("variant", "-"), (rel, d, r))
    for kind, by_variant in kinds.items():
        runs = list(dict.fromkeys(rel for rel, _, _ in by_variant.values()))
        for i, rel in enumerate(runs):
            d = next(d for r, d, _ in by_variant.values() if r == rel)
            lines += [f"run {i + 1}: [{Path(rel).name}]({rel}), {date_cell(d)}, {machine_cell(d)}, "
                      f"{d.get('model', '-')} {str(d.get('dtype', '-')).removeprefix('torch.')}, "
                      f"{d.get('num_windows', '-')} x {d.get('window_len', '-')} held-out tokens, "
                      f"{d.get('threads', '-')} threads, commit {commit_cell(d)}", ""]
        rows = [[r.get("variant", "-"), str(runs.index(rel) + 1), _f(r.get("ppl"), ".1f"),
                 _f(r.get("mean_kl"), ".3f"), _f(r.get("top1"), ".3f"),
                 _f(r.get("zero_fraction"), ".0%"), _f((r.get("dense") or 0) / 1e6, ".1f"),
                 _f((r.get("compressed") or 0) / 1e6, ".1f"),
                 _f(r.get("speedup_b1"), ".2f"), _f(r.get("speedup_b16"), ".2f"),
                 f"{r['distill_s']:.0f} s, {r['distill_steps']} steps" if r.get("distill_s") else "-"]
                for rel, d, r in by_variant.values()]
        lines += _table(["variant", "run", "perplexity", "mean KL", "top-1", "zeros",
                         "projections MB", "compressed MB", "batch 1 x", "batch 16 x",
                         "distillation"], rows) + [""]
    return lines


def soak_section(soak: list) -> list[str]:
    """One row per soak run, newest first: what was sent and how each request ended."""
    rows = []
    for rel, d in _newest_first(soak):
        t, rss = d.get("totals", {}), [r.get("rss_mb") for r in d["rounds"]]
        rows.append([f"[{Path(rel).name}]({rel})", date_cell(d), machine_cell(d),
                     f"{d.get('clients', '-')} x {len(d['rounds'])}", d.get("sent", "-"),
                     t.get("completed", "-"), t.get("rejected", "-"), t.get("disconnected", "-"),
                     t.get("clean_error", "-"), t.get("lost", "-"),
                     f"{_f(rss[0], '.0f')} -> {_f(rss[-1], '.0f')}" if rss else "-",
                     "yes" if all(r.get("drained") and r.get("rejected_match") for r in d["rounds"])
                     else "no", commit_cell(d)])
    return (["## Soak", "",
             "`python -m workbench.bench soak --json F`: concurrent streaming clients mixed with "
             "disconnects, malformed and oversized bodies, wrong keys, invalid parameters and "
             "bursts past the waiting bound, in rounds. Lost must be 0; drained: the KV cache "
             "empty after every round and the server's rejection counters equal the clients'.", ""]
            + _table(["run", "date", "machine", "clients x rounds", "sent", "completed",
                      "rejected", "disconnected", "clean error", "lost", "server RSS MB",
                      "drained", "commit"], rows) + [""])


def memory_section(memory: list) -> list[str]:
    """Per memory run, newest first: offloaded over resident tok/s by batch, the next turn's
    TTFT speedup of each KV tier over recomputing, and KV compression's bytes and perplexity."""
    lines = ["## Memory hierarchy", "",
             "`python -m workbench.bench memory --json F`: offloaded weights against resident "
             "(tokens/s by batch), a KV tier's load against recomputing the evicted context (the "
             "next turn's TTFT), and KV compression against the model's dtype (bytes per token, "
             "perplexity), each against its baseline measured in the same run.", ""]
    for rel, d in _newest_first(memory):
        off = d["offload"].get("rows", [])
        lines += [f"### [{Path(rel).name}]({rel})", "",
                  f"{date_cell(d)}; {machine_cell(d)}; commit {commit_cell(d)}", ""]
        rows = [[r["batch_size"], _f(r["measured_tokens_per_s"], ".1f"),
                 _f(r["ratio_to_resident"], ".2f"), _f(r.get("calibrated_error"), "+.0%")]
                for r in off if r.get("weights") == "offloaded"]
        lines += _table(["batch", "offloaded tok/s", "of resident", "cost model error"], rows)
        lines.append("")
        rows = [[r["context_tokens"], _f(1e3 * r["recompute_s"], ".0f"),
                 _f(r["recompute_over_cpu"], ".1f"), _f(r["recompute_over_disk"], ".1f")]
                for r in d["kv_tiers"].get("rows", [])]
        lines += _table(["context tokens", "recompute TTFT ms", "CPU tier speedup",
                         "disk tier speedup"], rows)
        lines.append("")
        rows = [[r["method"], r["setting"], r["kv_bytes_per_token"], _f(r["ratio"], ".3f"),
                 _f(r["perplexity"], ".2f"), _f(r["delta"], "+.2f")]
                for r in d["kv_compression"].get("rows", [])]
        lines += _table(["method", "setting", "KV bytes/token", "of model dtype", "perplexity",
                         "change"], rows)
        lines.append("")
    return lines


def render_readme(results_dir: Path) -> str:
    speed, floor, compress, soak, other = load(results_dir)
    lines = [f"<!-- Generated by `{COMMAND}` from the JSON files in this folder. "
             "Do not edit by hand: run the command. -->",
             "# Results", "",
             f"Generated by `{COMMAND}` from the JSON files in this folder; do not edit by hand "
             f"(`{COMMAND} --check` fails when this file is out of date). Each JSON is one run.",
             "",
             "## Speed runs", "",
             "`python -m workbench.bench speed --json F`, newest first. Ratios are the engine's "
             "over the peer's (batch_invariant: its offline-mixed time over the default's); each "
             "with the target bar stored in that run and whether it was met. The share of copy "
             "bandwidth is the `engine default` row's, or the best bf16 row's in runs without one. "
             "\"-\": not recorded in that run.", ""]
    lines += _table(HEADLINE_HEADER, headline_rows(_newest_first(speed), "")) + [""]
    kinds = latest_per_kind(speed)
    if kinds:
        lines += ["## Latest ladder per machine kind", ""]
        for kind, rel, d in kinds:
            lines += ladder_section(kind, rel, d)
    if floor:
        lines += floor_section(floor)
    if compress:
        lines += compress_section(compress)
    if soak:
        lines += soak_section(soak)
    memory = [(rel, d) for rel, d in other if is_memory(d)]
    other = [(rel, d) for rel, d in other if not is_memory(d)]
    if memory:
        lines += memory_section(memory)
    if other:
        lines += ["## Other result files", ""]
        for rel, d in other:
            workload = d.get("workload") if isinstance(d, dict) else None
            lines.append(f"- [{rel}]({rel})"
                         + (f": workload `{workload}`" if isinstance(workload, str) else ""))
        lines += [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_docs_block(results_dir: Path, link_prefix: str = "../results/") -> str:
    """The latest speed run of each machine kind (the headline table), for docs/performance.md.
    Runs that do not record their kernels' ISA (the first format) are left to results/README.md
    when any run records it."""
    speed = load(results_dir)[0]
    kinds = latest_per_kind(speed)
    recorded = [k for k in kinds if k[0][0] != "-"]
    runs = [(rel, d) for _, rel, d in (recorded or kinds)]
    lines = [f"<!-- generated by `{COMMAND}`; do not edit between these markers -->", ""]
    lines += _table(HEADLINE_HEADER, headline_rows(runs, link_prefix))
    lines += ["", f"Every run, and each machine's full ladder: [results/README.md]({link_prefix}"
              "README.md)."]
    return "\n".join(lines) + "\n"


def splice(text: str, block: str) -> str | None:
    """text with what lies between the marker lines replaced by block; None without both markers."""
    lines = text.splitlines(keepends=True)
    try:
        b = next(i for i, line in enumerate(lines) if line.strip() == BEGIN)
        e = next(i for i, line in enumerate(lines) if line.strip() == END and i > b)
    except StopIteration:
        return None
    return "".join(lines[:b + 1]) + block + "".join(lines[e:])


# ------------------------------------------------------------------------ the command
def generate(root: Path = REPO_ROOT) -> dict[Path, str]:
    """{file: the content it should have}: results/README.md, and docs/performance.md when it
    exists with both markers."""
    root = Path(root)
    results = root / "results"
    out = {results / "README.md": render_readme(results)}
    docs = root / "docs" / "performance.md"
    if docs.is_file():
        spliced = splice(docs.read_text(encoding="utf-8"), render_docs_block(results))
        if spliced is not None:
            out[docs] = spliced
    return out


def stale(root: Path = REPO_ROOT) -> list[Path]:
    """The generated files whose committed content differs from what the JSON files give."""
    return [path for path, text in generate(root).items()
            if not path.is_file() or path.read_text(encoding="utf-8") != text]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"{COMMAND}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a generated file is out of date")
    ap.add_argument("--root", default=str(REPO_ROOT),
                    help="the repository root (default: the one holding this package)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.check:
        bad = stale(root)
        for path in bad:
            print(f"{path.relative_to(root).as_posix()} is out of date: run `{COMMAND}`",
                  file=sys.stderr)
        if bad:
            sys.exit(1)
        print("results tables are up to date")
        return 0
    docs = root / "docs" / "performance.md"
    files = generate(root)
    for path, text in files.items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(root).as_posix()}")
        else:
            print(f"{path.relative_to(root).as_posix()} is up to date")
    if not docs.is_file():
        print("docs/performance.md does not exist: its results table was skipped")
    elif docs not in files:
        print(f"docs/performance.md has no {BEGIN} ... {END} lines: its results table was skipped")
    return 0


if __name__ == "__main__":
    main()
