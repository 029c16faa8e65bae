"""The report command, end to end on small notebooks made here: papermill really executes them in a
kernel, the recorded numbers reach results.json and the index table, kept runs (e.g. from a GPU)
appear as further columns, widgets render statically, a stuck cell fails only its own chapter,
and the HTML renders offline."""
from __future__ import annotations

import json
import re

import nbformat
import pytest

from workbench.course import report
from workbench.course.results import MIME_TYPE, format_value, record, records_in


def _notebook(path, cells: list[str]):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A chapter")]
    params = nbformat.v4.new_code_cell('DEVICE = "auto"\nSMOKE = False')
    params.metadata["tags"] = ["parameters"]
    nb.cells.append(params)
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


MEASURING = [
    "from workbench.course.results import record\nimport ipywidgets as widgets\n"
    "import plotly.graph_objects as go\nfrom workbench.course.viz.widgets import interact",
    "record('ratio', 2.5 if SMOKE else 3.5, 'x', 'speedup over the peer')\n"
    "record('tokens', 1234.0, 'tok/s')",
    "def show(n):\n    go.Figure(go.Bar(y=list(range(n))), layout_title_text=f'n={n}').show()\n"
    "interact(show, n=widgets.IntSlider(value=7, min=1, max=9))",
    "from workbench.course.claims import timing_claim\n"
    "class Busy:\n    quiet = lambda self: False\n    current_share = lambda self: 0.5\n"
    "with timing_claim('fast beats slow'):\n    assert 1 < 2\n"
    "with timing_claim('slow beats fast', Busy()):\n    assert 2 < 1",
]


def test_record_validates_and_reads_back():
    with pytest.raises(ValueError, match=r"key='a b' is invalid"):
        record("a b", 1.0)
    with pytest.raises(ValueError, match=r"value='3' for 'x' is invalid: a real number is required"):
        record("x", "3")
    with pytest.raises(ValueError, match=r"value=nan for 'x' is invalid: it must be finite"):
        record("x", float("nan"))
    out = {"output_type": "display_data", "data": {MIME_TYPE: {"key": "k", "value": 1.0, "unit": "x",
                                                                "label": "k"}}}
    later = {"output_type": "display_data", "data": {MIME_TYPE: {"key": "k", "value": 2.0, "unit": "x",
                                                                  "label": "k"}}}
    nb = {"cells": [{"cell_type": "code", "outputs": [out]}, {"cell_type": "markdown"},
                    {"cell_type": "code", "outputs": [later]}]}
    assert [r["value"] for r in records_in(nb)] == [2.0]       # the last value of a key wins
    assert format_value(3.456, "x") == "3.46x" and format_value(12345.6, "tok/s") == "12,346 tok/s"


def test_report_runs_chapters_and_tabulates_their_numbers(tmp_path, capsys, monkeypatch):
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    _notebook(chapters / "01_measures.ipynb", MEASURING)
    _notebook(chapters / "02_fails.ipynb", ["raise RuntimeError('claim no longer true')"])
    _notebook(chapters / "03_stuck.ipynb", ["import time\ntime.sleep(600)"])
    kept = tmp_path / "kept"
    kept.mkdir()
    gpu_run = {"date": "2026-01-02T03:04:05", "device": "cuda (NVIDIA H200)", "sizes": "full",
               "hardware": {"gpu": "NVIDIA H200", "cpu": "x"},
               "chapters": [{"name": "01_measures", "status": "ok", "seconds": 9.0, "html": "",
                             "error": "", "numbers": [{"key": "ratio", "value": 7.25, "unit": "x",
                                                       "label": "speedup over the peer"}]}]}
    (kept / "2026-01-02-nvidia-h200-full.json").write_text(json.dumps(gpu_run))
    (kept / "broken.json").write_text("{not json")
    monkeypatch.setattr(report, "KEPT_RESULTS_DIR", kept)
    out = tmp_path / "out"

    rc = report.main(["--smoke", "--device", "cpu", "--timeout", "20", "--out", str(out),
                      str(chapters)])
    printed = capsys.readouterr()
    assert rc == 1                                     # two chapters failed, the run went on
    assert "(1/3) 01_measures cell 5/7: record('ratio'" in printed.out      # cell-by-cell progress
    assert "timing claims 1 asserted, 1 skipped for load" in printed.out
    assert "skipping kept results broken.json" in printed.err

    run = json.loads((out / "results.json").read_text())
    by_name = {c["name"]: c for c in run["chapters"]}
    assert [c["status"] for c in run["chapters"]] == ["ok", "failed", "failed"]
    assert by_name["01_measures"]["numbers"] == [
        {"key": "ratio", "value": 2.5, "unit": "x", "label": "speedup over the peer"},  # SMOKE=True
        {"key": "tokens", "value": 1234.0, "unit": "tok/s", "label": "tokens"}]
    assert [(c["name"], c["status"]) for c in by_name["01_measures"]["claims"]] == [
        ("fast beats slow", "asserted"), ("slow beats fast", "skipped for load")]
    assert "claim no longer true" in by_name["02_fails"]["error"]
    assert "timed out" in by_name["03_stuck"]["error"].lower() or \
        "timeout" in by_name["03_stuck"]["error"].lower(), by_name["03_stuck"]["error"]
    assert run["sizes"] == "SMOKE" and run["hardware"]["cpu"].startswith("cpu (")
    assert 50 < by_name["01_measures"]["peak_mib"] < 4096      # a kernel with torch and plotly

    index = (out / "index.html").read_text()
    assert "speedup over the peer: <b>2.5x</b>" in index          # this run
    assert "speedup over the peer: <b>7.25x</b>" in index         # the kept GPU run, side by side
    assert "timing claims: 1 asserted, 1 skipped for load" in index
    assert "<li>slow beats fast: other programs used 50% of the CPU</li>" in index
    assert index.count("timing claims:") == 3          # this run's chapters; the kept run has none
    assert "this run asserted 1 and skipped 1 for load" in index
    assert "GPU: NVIDIA H200" in index and "CPU: cpu (" in index
    assert index.count("<tr><th>") == 1 + 3           # the header, then one row per chapter

    page = (out / "01_measures.html").read_text()
    assert report.offline_problems(page) == []
    assert page.count('class="plotly-graph-div"') == 1             # interact drew once, statically
    assert "n=7" in page and "widget-slider" not in page


def test_keep_names_the_file_after_date_device_and_sizes(tmp_path):
    run = {"date": "2026-11-30T05:00:00", "sizes": "full", "hardware": {"gpu": "NVIDIA H200"},
           "chapters": []}
    path = report.keep_run(run, tmp_path)
    assert path.name == "2026-11-30-nvidia-h200-full.json"
    assert report.load_kept_runs(tmp_path)[0]["file"] == path.name


def math_notebook(path, figure_title: str = r"$\alpha^2$ per step"):
    """A notebook with math in markdown and LaTeX in a plotly figure's title, with the outputs the
    report's renderer (plotly_mimetype+notebook) leaves: the figure's JSON, and its HTML with
    plotly.js inline and plotly's MathJax CDN tag. Not executed: to_html needs no kernel."""
    import plotly.graph_objects as go
    import plotly.io as pio
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(
        "# Math\nInline $a^2 + b^2 = c^2$, and displayed:\n"
        "$$\\sum_{i=1}^n i = \\frac{n(n+1)}{2} \\qquad \\boldsymbol{x}$$")]
    fig = go.Figure(go.Bar(y=[1, 2, 3]), layout_title_text=figure_title)
    cell = nbformat.v4.new_code_cell("fig")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "application/vnd.plotly.v1+json": fig.to_plotly_json(),
        "text/html": pio.to_html(fig, include_plotlyjs=True, include_mathjax="cdn", full_html=False)})]
    nb.cells.append(cell)
    nbformat.write(nb, str(path))
    return path


# MathJax from a CDN: nbconvert's tag (2.7.7/latest.js) and plotly's (3.2.2/es5/tex-svg.min.js), both
# on cdnjs, as are nbconvert's require.js and mermaid. (Plotly.js and MathJax themselves name other
# CDNs as defaults of features a report never uses, such as geo maps and speech: the browser test
# checks that the page requests nothing.)
def names_a_cdn(page: str) -> list[str]:
    return (re.findall(r"https?://cdnjs\.cloudflare\.com[^\"' ]*", page)
            + re.findall(r"https?://[^\"' ]*/mathjax[^\"' ]*\.js", page, re.IGNORECASE))


def test_report_math_uses_the_installed_mathjax_not_a_cdn(tmp_path):
    mathjax = report.mathjax_path()           # in the installed django-static-mathjax package
    assert mathjax.is_file() and mathjax.name == "tex-svg-full.js"
    package = json.loads((mathjax.parents[1] / "package.json").read_text(encoding="utf-8"))
    assert package["version"] == "3.2.2"      # the MathJax that plotly's (removed) CDN tag names
    js = mathjax.read_text(encoding="utf-8")
    assert "</script" not in js.lower()                       # safe to inline in a <script>

    page = report.to_html(math_notebook(tmp_path / "m.ipynb"), tmp_path / "m.html")
    assert page == (tmp_path / "m.html").read_text(encoding="utf-8")
    assert report.offline_problems(page) == []
    assert names_a_cdn(page) == []
    assert page.count(js) == 1                                  # MathJax inline, once
    assert page.count("window.MathJax = {") == 1 and "tags: 'ams'" in page

    # No math in markdown, none in figures: no MathJax at all (the page stays smaller).
    plain = math_notebook(tmp_path / "plain.ipynb", figure_title="per step")
    nb = nbformat.read(str(plain), as_version=4)
    nb.cells[0].source = "# No math here, only $5 once"
    nbformat.write(nb, str(plain))
    page = report.to_html(plain, tmp_path / "plain.html")
    assert report.offline_problems(page) == [] and "window.MathJax = {" not in page
    assert names_a_cdn(page) == []

    # LaTeX in a figure alone brings MathJax in too (plotly.js typesets with the page's MathJax).
    nb.cells[1].outputs[0].data["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] = "$x_1$"
    nbformat.write(nb, str(plain))
    assert report.to_html(plain, tmp_path / "plain.html").count(js) == 1


def test_offline_problems_names_external_scripts_and_modules():
    page = ('<script src="https://cdnjs.cloudflare.com/x.js"></script>'
            '<script type="module">const m = await import("https://cdn.jsdelivr.net/m.mjs")</script>')
    assert report.offline_problems(page) == ["external script https://cdnjs.cloudflare.com/x.js",
                                             "external module https://cdn.jsdelivr.net/m.mjs"]
    nbconvert_tag = ('<script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js'
                     '?config=TeX-AMS_CHTML-full,Safe"> </script>')
    assert names_a_cdn(nbconvert_tag) and names_a_cdn('<script src="https://x.org/mathjax/tex-svg.js">')
