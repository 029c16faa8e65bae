"""Execute the chapters headlessly and write HTML reports.

    python -m workbench.course.report                      # every notebooks/*.ipynb, full sizes, DEVICE auto
    python -m workbench.course.report --smoke              # small sizes (what CI runs)
    python -m workbench.course.report --device cpu --out reports notebooks/00_tour.ipynb

For each chapter, papermill runs the notebook in a fresh `python3` kernel with the parameters SMOKE
and DEVICE, and this writes `<out>/<chapter>.ipynb` (with outputs) and `<out>/<chapter>.html` (code
visible: it is a course). Each chapter's key numbers are the `workbench.course.results.record(...)` calls it
made; they are collected into `<out>/results.json` (with the hardware, sizes and date) and into the
results table of `<out>/index.html`: one row per chapter, one column per run. Each chapter's cell
also counts its timing claims (`workbench.course.claims.timing_claim`): how many were asserted, and
which were skipped because other programs kept the machine busy. Runs kept in the
repository (`results/reports/*.json`, e.g. measured on a GPU; `--keep` adds this run) appear as
further columns, so CPU and GPU read side by side. A failing chapter is reported and the others
still run; the exit status is 1 if any failed. Progress is printed cell by cell.

Widgets: reports set WORKBENCH_STATIC_WIDGETS=1, so the chapters' `interact` draws its figure once
with the controls' starting values (see workbench/course/viz/widgets.py); a cell that runs longer than
--timeout seconds fails its chapter instead of stalling the whole report.

Plotly figures render offline: PLOTLY_RENDERER=plotly_mimetype+notebook is set before any kernel
starts, so the first figure of each notebook carries plotly.js inline instead of a CDN link. Math
renders offline too: a report with math carries MathJax inline, from the django-static-mathjax
package (see `mathjax_path`), instead of nbconvert's and plotly's CDN tags.
"""
from __future__ import annotations

import argparse
import datetime
import html
import json
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from workbench.memory import PeakMemory
from workbench.course.claims import SKIPPED, claims_in, count
from workbench.course.results import format_value, records_in
from workbench.course.viz.widgets import STATIC_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
KEPT_RESULTS_DIR = REPO_ROOT / "results" / "reports"
PLOTLY_RENDERER = "plotly_mimetype+notebook"
DEFAULT_CELL_TIMEOUT = 1800    # s; the slowest full-size cell on 2 CPU cores takes a few minutes


@dataclass
class ChapterResult:
    name: str
    status: str            # "ok" or "failed"
    seconds: float
    started: str           # ISO date and time
    error: str = ""
    html_path: str = ""
    numbers: list = None    # the chapter's workbench.course.results records
    peak_mib: float = 0.0   # the kernel and its child processes, summed PSS
    claims: list = None     # the chapter's timing-claim outcomes (workbench.course.claims)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 1),
                "started": self.started, "error": self.error[-2000:], "html": self.html_path,
                "numbers": self.numbers or [], "peak_mib": round(self.peak_mib),
                "claims": self.claims or []}


def find_notebooks(paths: list[str]) -> list[Path]:
    if not paths:
        return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    found = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found.extend(sorted(path.glob("*.ipynb")))
        elif path.suffix == ".ipynb" and path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"error: {p!r} is not a notebook (.ipynb) or a folder of notebooks")
    return found


def describe_device(device: str) -> str:
    """What DEVICE resolves to in the kernels (they run on this machine), in words."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the workbench needs torch anyway
        return device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if torch.cuda.is_available():
            return f"cuda ({torch.cuda.get_device_name(0)})"
        return "cuda (not available)"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu ({cpu}, {os.cpu_count()} cores)"


def describe_hardware() -> dict:
    """The machine the kernels run on, for the results table."""
    import psutil
    import torch
    info = {"cpu": describe_device("cpu"), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__}
    return info


# The report must read offline. nbconvert's lab template loads require.js (only the embedded-widget
# manager needs it; widget state is not stored), MathJax 2 (for math in markdown) and mermaid (only
# diagrams need it) from a CDN; plotly's notebook renderer adds a MathJax 3 CDN tag to each figure
# (only LaTeX in a figure needs it). Plotly.js itself is inlined by the renderer, once per notebook.
# So require.js is left out, and mermaid too unless a markdown cell draws a diagram (no chapter does;
# offline_problems names that CDN), plotly's MathJax tag is removed, and a report with math
# (in markdown, or as LaTeX in a figure's text) carries MathJax inline: the tex-svg-full component of
# MathJax 3.2.2 (the version plotly's tag names) from the django-static-mathjax package, pinned in
# requirements.txt. That component holds every TeX extension and draws SVG, so it loads no other
# file (no fonts, no autoloaded extensions) and the report stays one self-contained file.
MATHJAX_PACKAGE = "mathjax"                 # the import name of django-static-mathjax
MATHJAX_COMPONENT = "static/mathjax/es5/tex-svg-full.js"
# MathJax 2's settings in nbconvert's template (base/mathjax.html.j2), in MathJax 3's terms; plotly
# typesets its figures' LaTeX itself, so the page-wide pass leaves figures alone.
_MATHJAX_CONFIG = """window.MathJax = {
  tex: {inlineMath: [['$', '$'], ['\\\\(', '\\\\)']], displayMath: [['$$', '$$'], ['\\\\[', '\\\\]']],
        processEscapes: true, processEnvironments: true, tags: 'ams', useLabelIds: true},
  options: {ignoreHtmlClass: 'tex2jax_ignore|plotly-graph-div'},
  svg: {fontCache: 'global'}
};"""
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}
{%- if resources.workbench_mathjax_js %}
<!-- MathJax, inlined from the django-static-mathjax package (workbench.course.report) -->
<script>
{{ resources.workbench_mathjax_config }}
</script>
<script id="workbench-mathjax">{{ resources.workbench_mathjax_js }}</script>
{%- endif -%}
{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}
{%- if resources.workbench_needs_mermaid -%}{{ super() }}{%- endif -%}
{%- endblock html_head_js_mermaidjs -%}
"""
_PLOTLY_MATHJAX_TAG = re.compile(
    r'<script src="https://cdnjs\.cloudflare\.com/ajax/libs/mathjax/[^"]*/tex-svg\.min\.js"></script>')
_MATH = re.compile(r"\$[^$\n]+\$|\\\(|\\\[")
_FIGURE_TEX = re.compile(r"\$[^$]*\$")     # plotly.js typesets a text with $...$ in it
_MERMAID = re.compile(r"^\s*```\s*mermaid", re.MULTILINE)
_EXTERNAL_SCRIPT = re.compile(r'<script\b[^>]*\bsrc="((?:https?:)?//[^"]*)"', re.IGNORECASE)
_EXTERNAL_IMPORT = re.compile(r"""\bimport\s*\(\s*["']((?:https?:)?//[^"']*)["']""")


def mathjax_path() -> Path:
    """The MathJax component that reports inline (from the django-static-mathjax package)."""
    from importlib.resources import files
    try:
        path = Path(str(files(MATHJAX_PACKAGE) / MATHJAX_COMPONENT))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise RuntimeError(
            f"MathJax ({MATHJAX_COMPONENT} of the {MATHJAX_PACKAGE!r} package) is not installed: "
            "pip install django-static-mathjax (pinned in requirements.txt; ./run setup installs it)")
    return path


def _strings(value):
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _figure_has_tex(nb) -> bool:
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            figure = out.get("data", {}).get("application/vnd.plotly.v1+json")
            if figure and any(_FIGURE_TEX.search(s) for s in _strings(figure)):
                return True
    return False


def _needs_mathjax(nb) -> bool:
    return (any(c.cell_type == "markdown" and _MATH.search(c.source) for c in nb.cells)
            or _figure_has_tex(nb))


def to_html(notebook_path: Path, html_path: Path) -> str:
    """Export with code visible, plotly inline and MathJax inline where there is math; returns
    the HTML."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(str(notebook_path), as_version=4)
    nb.metadata.pop("widgets", None)  # widget state is not kept (store_widget_state=False)
    exporter = HTMLExporter(template_name="lab", template_file="workbench_offline.html.j2",
                            extra_loaders=[jinja2.DictLoader(
                                {"workbench_offline.html.j2": _OFFLINE_TEMPLATE})])
    resources = {"workbench_needs_mermaid": any(
        c.cell_type == "markdown" and _MERMAID.search(c.source) for c in nb.cells)}
    if _needs_mathjax(nb):
        resources["workbench_mathjax_config"] = _MATHJAX_CONFIG
        resources["workbench_mathjax_js"] = mathjax_path().read_text(encoding="utf-8")
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    body = _PLOTLY_MATHJAX_TAG.sub("", body)
    html_path.write_text(body, encoding="utf-8")
    return body


def offline_problems(body: str) -> list[str]:
    """What would stop the report from rendering offline: external scripts or modules, or figures
    drawn without plotly.js inline."""
    problems = [f"external script {src}" for src in _EXTERNAL_SCRIPT.findall(body)]
    problems += [f"external module {src}" for src in _EXTERNAL_IMPORT.findall(body)]
    if "Plotly.newPlot" in body and "plotly.js v" not in body:
        problems.append("figures without plotly.js inline (was PLOTLY_RENDERER set before the kernel?)")
    return problems


def _tolerate_output_widgets_without_state() -> None:
    """Work around an nbclient bug (0.10, 0.11): with store_widget_state=False, the emulated Output
    widget (ipywidgets' `interact` draws into one) writes to `executor.widget_state[comm_id]`, an
    entry that only store_widget_state=True creates, and the run dies with a KeyError. Creating the
    entry when the widget opens is harmless: entries without a `_model_name` are never saved."""
    from nbclient import output_widget
    cls = output_widget.OutputWidget
    if getattr(cls, "_workbench_patched", False):
        return
    original = cls.__init__

    def __init__(self, comm_id, state, kernel_client, executor):
        original(self, comm_id, state, kernel_client, executor)
        if isinstance(getattr(executor, "widget_state", None), dict):
            executor.widget_state.setdefault(comm_id, {})

    cls.__init__ = __init__
    cls._workbench_patched = True


class CellProgress:
    """Prints which cell of which chapter is running, and how long the chapter has taken."""

    def __init__(self, label: str, enabled: bool, num_cells: int):
        self.label, self.enabled, self.t0 = label, enabled, time.perf_counter()
        self.num_cells = num_cells

    def __call__(self, cell, cell_index: int, **_) -> None:
        if not self.enabled or cell.cell_type != "code":
            return
        first = next((line for line in cell.source.splitlines() if line.strip()), "")
        print(f"[report] {self.label} cell {cell_index + 1}/{self.num_cells}: {first[:70]}"
              f"  ({time.perf_counter() - self.t0:.0f} s)", flush=True)


def _num_cells_after_injection(notebook: Path) -> int:
    """Cells papermill will run: the notebook's, plus the injected-parameters cell."""
    import nbformat
    nb = nbformat.read(str(notebook), as_version=4)
    tagged = any("parameters" in c.metadata.get("tags", []) for c in nb.cells)
    return len(nb.cells) + (1 if tagged else 0)


def run_chapter(notebook: Path, out_dir: Path, smoke: bool, device: str,
                timeout: int | None, progress: bool, label: str = "") -> ChapterResult:
    import nbformat
    import papermill as pm
    _tolerate_output_widgets_without_state()
    name = notebook.stem
    out_nb, out_html = out_dir / f"{name}.ipynb", out_dir / f"{name}.html"
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    status, error = "ok", ""
    memory = PeakMemory(os.getpid(), include_root=False).start()   # the kernel and its children
    try:
        pm.execute_notebook(str(notebook), str(out_nb), parameters={"SMOKE": smoke, "DEVICE": device},
                            kernel_name="python3", cwd=str(notebook.parent),
                            store_widget_state=False, progress_bar=False,
                            execution_timeout=timeout,
                            on_cell_start=CellProgress(label or name, progress,
                                                       _num_cells_after_injection(notebook)))
    except Exception as exc:  # papermill's error, or a kernel that died: report and go on
        status = "failed"
        error = f"{type(exc).__name__}: {exc}".strip()
        if not out_nb.exists():
            error += "\n" + traceback.format_exc()
    seconds = time.perf_counter() - t0
    peak_mib = memory.stop() / 2**20
    html_rel = ""
    if out_nb.exists():
        try:
            body = to_html(out_nb, out_html)
            html_rel = out_html.name
            for problem in offline_problems(body):
                print(f"[report] warning: {out_html.name} will not render fully offline: {problem}",
                      file=sys.stderr)
        except Exception as exc:  # a report without HTML is still a report
            error = (error + "\n" if error else "") + f"HTML export failed: {exc}"
            status = "failed"
    executed = nbformat.read(str(out_nb), as_version=4) if out_nb.exists() else None
    numbers = records_in(executed) if executed else []
    claims = claims_in(executed) if executed else []
    return ChapterResult(name, status, seconds, started, error, html_rel, numbers, peak_mib, claims)


def run_record(results: list[ChapterResult], smoke: bool, device: str, hardware: dict) -> dict:
    """What results.json holds: one run of the report."""
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device,
            "hardware": hardware, "sizes": "SMOKE" if smoke else "full",
            "chapters": [r.to_dict() for r in results]}


def load_kept_runs(folder: Path | None = None) -> list[dict]:
    """Runs kept in the repository (results.json files), newest first; unreadable ones are
    reported and skipped."""
    folder = KEPT_RESULTS_DIR if folder is None else folder
    runs = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            run = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(run.get("chapters"), list):
                raise ValueError("no 'chapters' list")
        except (OSError, ValueError) as exc:
            print(f"[report] warning: skipping kept results {path.name}: {exc}", file=sys.stderr)
            continue
        run["file"] = path.name
        runs.append(run)
    return sorted(runs, key=lambda r: r.get("date", ""), reverse=True)


def keep_run(run: dict, folder: Path | None = None) -> Path:
    """Save this run under results/reports/ (to commit it): <date>-<device>-<sizes>.json."""
    folder = KEPT_RESULTS_DIR if folder is None else folder
    device = run["hardware"].get("gpu") or "cpu"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run['date'][:10]}-{slug}-{run['sizes'].lower()}.json"
    path.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    return path


def _run_heading(run: dict, this_run: bool) -> str:
    hw = run.get("hardware", {})
    where = hw.get("gpu") or hw.get("cpu") or run.get("device", "?")
    kind = "GPU" if hw.get("gpu") else "CPU"
    label = "this run" if this_run else f"kept: {run.get('file', '')}"
    return (f"{kind}: {html.escape(str(where))}<br><small>{html.escape(run.get('date', '?'))}, "
            f"{html.escape(run.get('sizes', '?'))} sizes, {html.escape(label)}</small>")


def _claims_line(ch: dict) -> str:
    """'N timing claims asserted, M skipped for load' and the skipped ones' names and reasons;
    empty for a kept run whose results have no claims."""
    if "claims" not in ch:
        return ""
    asserted, skipped = count(ch["claims"])
    names = "".join(f"<li>{html.escape(c['name'])}: {html.escape(c.get('reason', ''))}</li>"
                    for c in ch["claims"] if c.get("status") == SKIPPED)
    color = "#9a6700" if skipped else "#57606a"
    return (f'<div class="claims" style="color:{color}">timing claims: {asserted} asserted, '
            f'{skipped} skipped for load</div>' + (f'<ul class="skipped">{names}</ul>' if names else ""))


def _chapter_cell(ch: dict | None, link: bool) -> str:
    if ch is None:
        return '<td class="none">not run</td>'
    color = "#1a7f37" if ch["status"] == "ok" else "#cf222e"
    rows = "".join(
        f"<li>{html.escape(n.get('label') or n['key'])}: <b>{html.escape(format_value(n['value'], n.get('unit', '')))}</b></li>"
        for n in ch.get("numbers", []))
    err = (f'<pre class="err">{html.escape(ch["error"][-1500:])}</pre>'
           if ch.get("error") and link else "")
    status = (f'<a href="{html.escape(ch["html"])}">{ch["status"]}</a>' if link and ch.get("html")
              else ch["status"])
    return (f'<td><span style="color:{color};font-weight:600">{status}</span> '
            f'<small>{ch.get("seconds", 0):.0f} s, peak {ch.get("peak_mib", 0):,.0f} MiB</small>'
            f'{_claims_line(ch)}<ul>{rows}</ul>{err}</td>')


def write_index(out_dir: Path, run: dict, kept: list[dict]) -> Path:
    """index.html: the results table, one row per chapter and one column per run."""
    runs = [run, *kept]
    names = [c["name"] for c in run["chapters"]]
    names += sorted({c["name"] for r in kept for c in r["chapters"]} - set(names))
    by_run = [{c["name"]: c for c in r["chapters"]} for r in runs]
    head = "".join(f"<th>{_run_heading(r, i == 0)}</th>" for i, r in enumerate(runs))
    body = []
    for name in names:
        this = by_run[0].get(name)
        title = (f'<a href="{html.escape(this["html"])}">{html.escape(name)}</a>'
                 if this and this.get("html") else html.escape(name))
        cells = "".join(_chapter_cell(chapters.get(name), i == 0) for i, chapters in enumerate(by_run))
        body.append(f"<tr><th>{title}</th>{cells}</tr>")
    ok = sum(c["status"] == "ok" for c in run["chapters"])
    asserted, skipped = count([c for ch in run["chapters"] for c in ch.get("claims", [])])
    hw = run["hardware"]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Workbench reports</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 75rem; color: #1f2328; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ text-align: left; vertical-align: top; padding: .4rem .8rem; border-bottom: 1px solid #d0d7de; }}
td ul {{ margin: .3rem 0 0 1rem; padding: 0; font-size: .9rem; }}
td.none {{ color: #8c959f; }}
div.claims {{ font-size: .85rem; margin-top: .2rem; }}
pre.err {{ white-space: pre-wrap; background: #fff5f5; padding: .5rem; font-size: .8rem; }}
</style></head><body>
<h1>Workbench chapter reports</h1>
<p>{ok} of {len(run["chapters"])} chapters ran without error in this run ({run["sizes"]} sizes,
{html.escape(run["device"])}, {hw.get("memory_gib")} GiB, Python {html.escape(str(hw.get("python")))},
torch {html.escape(str(hw.get("torch")))}). Every number below was measured by the chapter itself
(its <code>workbench.course.results.record</code> calls) in the run named at the top of its column; a
chapter's page shows how. A timing claim is asserted only when other programs left the machine
quiet: this run asserted {asserted} and skipped {skipped} for load (each skipped one is named with
the share of the CPU others used). Columns after the first are runs kept in the repository
(<code>results/reports/</code>).</p>
<table><thead><tr><th>chapter</th>{head}</tr></thead>
<tbody>
{chr(10).join(body)}
</tbody></table>
</body></html>
"""
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.course.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--smoke", dest="smoke", action="store_true",
                      help="small sizes (SMOKE=True): about a minute per chapter on 2 CPU cores")
    size.add_argument("--full", dest="smoke", action="store_false",
                      help="full sizes (SMOKE=False, the default)")
    ap.set_defaults(smoke=False)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="the DEVICE parameter of every chapter (default: auto)")
    ap.add_argument("--out", default="reports", help="output folder (default: reports)")
    ap.add_argument("--timeout", type=int, default=DEFAULT_CELL_TIMEOUT,
                    help="seconds a single cell may run before its chapter fails "
                         f"(default {DEFAULT_CELL_TIMEOUT})")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="do not print each cell as it starts")
    ap.add_argument("--keep", action="store_true",
                    help="also save this run's results under results/reports/ (to commit, e.g. "
                         "after a GPU run), where later indexes show them next to their own")
    ap.add_argument("notebooks", nargs="*",
                    help="notebooks or folders to run (default: notebooks/*.ipynb, sorted)")
    args = ap.parse_args(argv)

    notebooks = find_notebooks(args.notebooks)
    if not notebooks:
        print("no notebooks to run", file=sys.stderr)
        return 1
    out_dir = Path(args.out)
    clash = [nb for nb in notebooks if nb.parent.resolve() == out_dir.resolve()]
    if clash:
        print(f"error: --out {out_dir} is the folder of {clash[0]}: its report would overwrite it",
              file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    # Kernels inherit this process's environment: set it before the first kernel starts.
    os.environ["PLOTLY_RENDERER"] = PLOTLY_RENDERER
    os.environ[STATIC_ENV] = "1"
    device = describe_device(args.device)
    print(f"[report] {len(notebooks)} chapter(s), {'SMOKE' if args.smoke else 'full'} sizes, "
          f"DEVICE={args.device!r} -> {device}, writing to {out_dir}/")
    results = []
    for i, nb in enumerate(notebooks, 1):
        print(f"[report] ({i}/{len(notebooks)}) {nb.stem} ...", flush=True)
        r = run_chapter(nb, out_dir, args.smoke, args.device, args.timeout, args.progress,
                        label=f"({i}/{len(notebooks)}) {nb.stem}")
        results.append(r)
        asserted, skipped = count(r.claims or [])
        print(f"[report] ({i}/{len(notebooks)}) {nb.stem}: {r.status} in {r.seconds:.1f} s, "
              f"peak {r.peak_mib:,.0f} MiB, timing claims {asserted} asserted, {skipped} skipped for load"
              + (f"\n{r.error.splitlines()[0] if r.error else ''}" if r.status != "ok" else ""),
              flush=True)
    run = run_record(results, args.smoke, device, describe_hardware())
    (out_dir / "results.json").write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    if args.keep:
        print(f"[report] kept this run's results in {keep_run(run)}")
    index = write_index(out_dir, run, load_kept_runs())
    failed = [r.name for r in results if r.status != "ok"]
    asserted, skipped = count([c for r in results for c in r.claims or []])
    print(f"[report] {len(results) - len(failed)} of {len(results)} chapters ok; timing claims "
          f"{asserted} asserted, {skipped} skipped for load; index: {index}")
    if failed:
        print(f"[report] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
