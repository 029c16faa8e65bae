"""Execute the chapters headlessly and write HTML reports.

    python -m workbench.report                      # every notebooks/*.ipynb, full sizes, DEVICE auto
    python -m workbench.report --smoke              # small sizes (what CI runs)
    python -m workbench.report --device cpu --out reports notebooks/00_tour.ipynb

For each chapter, papermill runs the notebook in a fresh `python3` kernel with the parameters SMOKE
and DEVICE, and this writes `<out>/<chapter>.ipynb` (with outputs) and `<out>/<chapter>.html` (code
visible: it is a course). `<out>/index.html` lists every chapter with its status, run time, date and
device. A failing chapter is reported and the others still run; the exit status is 1 if any failed.

Plotly figures render offline: PLOTLY_RENDERER=plotly_mimetype+notebook is set before any kernel
starts, so the first figure of each notebook carries plotly.js inline instead of a CDN link.
"""
from __future__ import annotations

import argparse
import datetime
import html
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PLOTLY_RENDERER = "plotly_mimetype+notebook"


@dataclass
class ChapterResult:
    name: str
    status: str            # "ok" or "failed"
    seconds: float
    started: str           # ISO date and time
    error: str = ""
    html_path: str = ""


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


# The report must read offline. nbconvert's lab template loads require.js (only the embedded-widget
# manager needs it; widget state is not stored) and MathJax (only math in markdown needs it) from a
# CDN; plotly's notebook renderer adds a MathJax 3 CDN tag to each figure (only LaTeX in a figure
# needs it). Plotly.js itself is inlined by the renderer, once per notebook.
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}
{%- if resources.workbench_needs_mathjax -%}{{ super() }}{%- endif -%}
{%- endblock html_head_js_mathjax -%}
"""
_PLOTLY_MATHJAX_TAG = re.compile(
    r'<script src="https://cdnjs\.cloudflare\.com/ajax/libs/mathjax/[^"]*/tex-svg\.min\.js"></script>')
_MATH = re.compile(r"\$[^$\n]+\$|\\\(|\\\[")
_EXTERNAL_SCRIPT = re.compile(r'<script\b[^>]*\bsrc="((?:https?:)?//[^"]*)"', re.IGNORECASE)


def _needs_mathjax(nb) -> bool:
    return any(c.cell_type == "markdown" and _MATH.search(c.source) for c in nb.cells)


def to_html(notebook_path: Path, html_path: Path) -> str:
    """Export with code visible and plotly inline; returns the HTML."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(str(notebook_path), as_version=4)
    nb.metadata.pop("widgets", None)  # widget state is not kept (store_widget_state=False)
    exporter = HTMLExporter(template_name="lab", template_file="workbench_offline.html.j2",
                            extra_loaders=[jinja2.DictLoader(
                                {"workbench_offline.html.j2": _OFFLINE_TEMPLATE})])
    body, _ = exporter.from_notebook_node(
        nb, resources={"workbench_needs_mathjax": _needs_mathjax(nb)})
    body = _PLOTLY_MATHJAX_TAG.sub("", body)
    html_path.write_text(body, encoding="utf-8")
    return body


def offline_problems(body: str) -> list[str]:
    """What would stop the report from rendering offline: external scripts, or figures drawn
    without plotly.js inline."""
    problems = [f"external script {src}" for src in _EXTERNAL_SCRIPT.findall(body)]
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


def run_chapter(notebook: Path, out_dir: Path, smoke: bool, device: str,
                timeout: int | None, progress: bool) -> ChapterResult:
    import papermill as pm
    _tolerate_output_widgets_without_state()
    name = notebook.stem
    out_nb, out_html = out_dir / f"{name}.ipynb", out_dir / f"{name}.html"
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        pm.execute_notebook(str(notebook), str(out_nb), parameters={"SMOKE": smoke, "DEVICE": device},
                            kernel_name="python3", cwd=str(notebook.parent),
                            store_widget_state=False, progress_bar=progress,
                            execution_timeout=timeout)
    except Exception as exc:  # papermill's error, or a kernel that died: report and go on
        status = "failed"
        error = f"{type(exc).__name__}: {exc}".strip()
        if not out_nb.exists():
            error += "\n" + traceback.format_exc()
    seconds = time.perf_counter() - t0
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
    return ChapterResult(name, status, seconds, started, error, html_rel)


def write_index(out_dir: Path, results: list[ChapterResult], smoke: bool, device: str) -> Path:
    import torch
    rows = []
    for r in results:
        link = (f'<a href="{html.escape(r.html_path)}">{html.escape(r.name)}</a>'
                if r.html_path else html.escape(r.name))
        color = "#1a7f37" if r.status == "ok" else "#cf222e"
        err = (f'<pre class="err">{html.escape(r.error[-2000:])}</pre>' if r.error else "")
        rows.append(f"<tr><td>{link}</td><td style=\"color:{color};font-weight:600\">"
                    f"{r.status}</td><td>{r.seconds:.1f} s</td><td>{html.escape(r.started)}</td>"
                    f"<td>{html.escape(device)}</td></tr>"
                    + (f"<tr><td colspan=5>{err}</td></tr>" if err else ""))
    ok = sum(r.status == "ok" for r in results)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Workbench reports</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #1f2328; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ text-align: left; padding: .4rem .8rem; border-bottom: 1px solid #d0d7de; }}
pre.err {{ white-space: pre-wrap; background: #fff5f5; padding: .5rem; font-size: .85rem; }}
</style></head><body>
<h1>Workbench chapter reports</h1>
<p>{ok} of {len(results)} chapters ran without error. Sizes: {"SMOKE (small)" if smoke else "full"}.
Python {platform.python_version()}, torch {html.escape(torch.__version__)}.</p>
<table><thead><tr><th>chapter</th><th>status</th><th>run time</th><th>date</th><th>device</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
</body></html>
"""
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.report", description=__doc__,
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
    ap.add_argument("--timeout", type=int, default=None,
                    help="seconds a single cell may run before the chapter fails (default: no limit)")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="hide papermill's per-cell progress bar")
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
    device = describe_device(args.device)
    print(f"[report] {len(notebooks)} chapter(s), {'SMOKE' if args.smoke else 'full'} sizes, "
          f"DEVICE={args.device!r} -> {device}, writing to {out_dir}/")
    results = []
    for i, nb in enumerate(notebooks, 1):
        print(f"[report] ({i}/{len(notebooks)}) {nb.stem} ...", flush=True)
        r = run_chapter(nb, out_dir, args.smoke, args.device, args.timeout, args.progress)
        results.append(r)
        print(f"[report] ({i}/{len(notebooks)}) {nb.stem}: {r.status} in {r.seconds:.1f} s"
              + (f"\n{r.error.splitlines()[0] if r.error else ''}" if r.status != "ok" else ""),
              flush=True)
    index = write_index(out_dir, results, args.smoke, device)
    failed = [r.name for r in results if r.status != "ok"]
    print(f"[report] {len(results) - len(failed)} of {len(results)} chapters ok; index: {index}")
    if failed:
        print(f"[report] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
