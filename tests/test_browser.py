"""One chapter, run in a real browser: JupyterLab served from this environment, driven through
Debian's headless Chromium with Playwright.

nbval (the `notebooks` part of `./run test`) proves that every cell executes, but it never renders
anything: a plotly figure that JupyterLab cannot draw, a widget whose front-end is missing, or an
`interact` whose slider does not redraw its figure all pass nbval. This test opens a chapter the way a
reader does (Run > Run All Cells in JupyterLab), then checks what the page shows: every code cell ran,
no cell shows an error, plotly figures are drawn as SVG, ipywidgets are live, and moving a slider
redraws the figure it drives. Screenshots go to $WORKBENCH_ARTIFACTS/browser/ (default
test-artifacts/browser/).

Nothing leaves 127.0.0.1: JupyterLab's news and update checks are off, the extension manager is
read-only, and Chromium resolves every other host to nothing (any such request is also recorded and
fails the test). Playwright drives the system Chromium (`./run test` installs Debian's package when it
is missing); it never downloads a browser of its own.

WORKBENCH_BROWSER_CHAPTERS=00_tour,03_paged_kv_cache,... runs other chapters (see SLIDERS).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", REPO / "test-artifacts")) / "browser"

# Generous limits: CI is a noisy 2-core machine where the server, the kernel (running the chapter
# through Triton's interpreter) and Chromium all compete for the same cores.
SERVER_START_S = 180
PAGE_LOAD_MS = 180_000
KERNEL_READY_MS = 180_000
RUN_ALL_MS = 480_000
RENDER_MS = 120_000
REDRAW_MS = 120_000


@dataclass(frozen=True)
class Slider:
    """The `interact` slider a chapter is checked with: the function the interact redraws (which
    finds its cell), the slider's description label, and how many arrow-key presses move it."""
    function: str
    label: str
    presses: int = 2


# The chapters whose interact slider redraws a plotly figure, with the slider that is moved.
SLIDERS = {
    "00_tour": Slider("show_request", "prompt"),
    "01_anatomy_of_speed": Slider("show_row", "row"),
    "02_quantization": Slider("show_alpha", "alpha"),
    "03_paged_kv_cache": Slider("show_step", "step"),
    "04_flash_attention": Slider("show_softmax_step", "tile"),
    "05_continuous_batching": Slider("explore", "requests/s"),
    "06_speculative_decoding": Slider("show_toy", "bad weight"),
    "07_parallelism": Slider("show_schedule", "stages P"),
}
# CI opens one chapter. 03 is among the quickest at SMOKE sizes (as quick as 04, the other short
# one; this test prints each chapter's timings), and none of its checks times anything: they
# compare scheduler traces, block counts and tokens, so a busy machine (the browser and the server
# share its cores with the kernel) cannot fail them.
# 04, as quick, asserts speed ratios that a loaded machine can miss. Its "step" slider redraws the
# block map of both runs, with a title naming the step.
DEFAULT_CHAPTERS = ["03_paged_kv_cache"]
CHAPTERS = [c.strip() for c in os.environ.get("WORKBENCH_BROWSER_CHAPTERS", "").split(",")
            if c.strip()] or DEFAULT_CHAPTERS


def find_chromium() -> str | None:
    # Debian's /usr/bin/chromium is a shell wrapper that adds flags from /etc/chromium.d and then
    # execs the binary; Playwright launches the binary itself so that only the flags below apply.
    for candidate in ("/usr/lib/chromium/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


CHROMIUM_ARGS = [
    "--no-sandbox",                      # CI runs as root, where Chromium's sandbox cannot start
    "--headless",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",           # containers often have a tiny /dev/shm
    # Every host but 127.0.0.1 resolves to nothing: a page that needs a CDN fails here as offline.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _die_with_parent() -> None:
    """In the server's process, before exec: Linux sends it SIGTERM when pytest dies, even when
    pytest is killed outright and no finalizer runs (the kernels then exit with the server:
    ipykernel watches its parent)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)      # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class JupyterLab:
    """`jupyter lab` on 127.0.0.1, serving a private copy of notebooks/ with private config, data,
    runtime and settings folders, so the test neither writes into the repository (JupyterLab saves
    and checkpoints notebooks) nor depends on the user's Jupyter configuration."""

    def __init__(self, home: Path, log_path: Path):
        self.home = home
        self.log_path = log_path
        self.root = home / "root"
        shutil.copytree(REPO / "notebooks", self.root / "notebooks",
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        self.token = secrets.token_hex(24)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._configure()

    def _configure(self) -> None:
        config_dir, settings = self.home / "config", self.home / "settings"
        write_json(config_dir / "jupyter_lab_config.json", {
            "LabApp": {
                "news_url": None,                                        # no news feed fetch
                "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
                "extension_manager": "readonly",                         # never asks PyPI
                "user_settings_dir": str(settings),
                "workspaces_dir": str(self.home / "workspaces"),
                # window.jupyterapp: the test reads cell models (execution counts, error outputs)
                # that the DOM only shows as text.
                "expose_app_in_browser": True,
            },
        })
        # All cells stay in the DOM (JupyterLab otherwise skips rendering cells out of view), and
        # nothing is saved or announced while the test runs.
        write_json(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                   {"windowingMode": "none"})
        write_json(settings / "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings",
                   {"autosave": False})
        write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                   {"fetchNews": "false", "checkForUpdates": False})

    def env(self) -> dict:
        env = dict(os.environ)
        # The kernels inherit the server's environment: chapters run at SMOKE sizes, and the Triton
        # kernels through the interpreter, exactly as under `./run test`.
        # Live widgets even where reports' static mode is set (workbench.course.viz.widgets): the sliders
        # are what this test moves.
        env.update(TRITON_INTERPRET="1", WORKBENCH_SMOKE="1", WORKBENCH_STATIC_WIDGETS="0",
                   PYTHONUNBUFFERED="1",
                   JUPYTER_CONFIG_DIR=str(self.home / "config"),
                   JUPYTER_DATA_DIR=str(self.home / "data"),
                   JUPYTER_RUNTIME_DIR=str(self.home / "runtime"))
        # The copy of notebooks/ lives outside the repository: make `workbench` and `kernels`
        # importable from the repository even where the package is not installed editable.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        return env

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # Another process may take the free port between free_port() and the server's bind;
        # port_retries=0 makes the server fail instead of silently moving, and we retry.
        for _attempt in range(3):
            self.port = free_port()
            self._log = open(self.log_path, "ab")
            cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={self.root}"]
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=self.env(), stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
            if self._wait_until_up():
                return
            self.stop()
        raise RuntimeError(f"jupyter lab did not start; its log ({self.log_path}):\n"
                           f"{tail(self.log_path)}")

    def _wait_until_up(self) -> bool:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                self.api("GET", "/api/status", timeout=5)
                return True
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        return False

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Shut down every kernel (between chapters, and before the server stops)."""
        try:
            for kernel in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)
        except (OSError, urllib.error.URLError, ValueError):
            pass

    def stop(self) -> None:
        """Stop the server and everything it started, however the test ended. Kernels run in
        sessions of their own, so they are collected as the server's descendants first and killed
        by pid if the server's own shutdown leaves any behind."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                descendants = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                descendants = []
            if proc.poll() is None:
                self.shutdown_kernels()
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
            for child in descendants:
                try:
                    child.terminate()
                except psutil.Error:
                    pass
            _gone, alive = psutil.wait_procs(descendants, timeout=10)
            for child in alive:
                try:
                    child.kill()
                except psutil.Error:
                    pass
        if self._log is not None:
            self._log.close()
            self._log = None


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        message = ("Chromium is not installed: `./run test` installs Debian's package "
                   "(apt-get install chromium); install it, or point PATH at a chromium binary")
        if os.environ.get("CI"):
            pytest.fail(message)     # on CI a missing browser is a broken setup, not a skip
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def lab(artifacts, tmp_path_factory):
    server = JupyterLab(tmp_path_factory.mktemp("jupyterlab"), artifacts / "jupyter-server.log")
    server.log_path.write_bytes(b"")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(chromium_path):
    # Imported here, not skipped: in this environment Playwright is pinned in requirements.txt, and
    # a missing package must fail the test loudly.
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, headless=True,
                                     args=CHROMIUM_ARGS, timeout=120_000)
        try:
            yield browser
        finally:
            browser.close()      # the context manager then stops Playwright's driver


# --- what the page shows, read in the browser ---------------------------------------------------

# Per cell of the open notebook: its prompt as drawn, its model (execution count, error outputs),
# the first line of its source (to name it in messages) and any traceback drawn as stderr.
CELLS_JS = r"""
() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const nb = panel && panel.content;
  if (!nb || !nb.widgets) return null;
  return nb.widgets.map((cell, index) => {
    const model = cell.model;
    const info = {index, type: model.type, source: model.sharedModel.getSource().split('\n')[0]};
    if (model.type !== 'code') return info;
    const prompt = cell.node.querySelector('.jp-InputArea-prompt');
    info.prompt = prompt ? prompt.textContent.trim() : '';
    info.count = model.executionCount;
    info.errors = [];
    info.figures = 0;   // plotly outputs of the cell itself (an interact's live in its widget)
    const outputs = model.outputs;
    for (let i = 0; i < outputs.length; i++) {
      const out = outputs.get(i).toJSON();
      if (out.output_type === 'error') {
        info.errors.push(`${out.ename}: ${out.evalue}`);
      }
      if (out.data && out.data['application/vnd.plotly.v1+json']) info.figures++;
    }
    info.drawn = Array.from(cell.node.querySelectorAll('.js-plotly-plot'))
      .filter(p => p.querySelector('.main-svg') && !p.closest('.widget-output')).length;
    for (const el of cell.node.querySelectorAll(
        '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')) {
      if (el.textContent.includes('Traceback')) info.errors.push(el.textContent.slice(-1500));
    }
    return info;
  });
}
"""

KERNEL_STATUS_JS = r"""
() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const ctx = panel && panel.sessionContext;
  return ctx && ctx.session && ctx.session.kernel ? ctx.session.kernel.status : null;
}
"""

# The notebook is loaded (all its cells are on the page) and its kernel is idle.
NOTEBOOK_READY_JS = r"""
(n_cells) => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  return !!panel && !!panel.context && panel.context.isReady && !!panel.content
      && panel.content.widgets.length === n_cells
      && panel.content.node.querySelectorAll('.jp-Cell').length === n_cells
      && (STATUS)() === 'idle';
}
""".replace("(STATUS)", f"({KERNEL_STATUS_JS.strip()})")

# Some code cell is queued, running or done.
RUN_STARTED_JS = r"""
() => {
  const cells = (CELLS)();
  return !!cells && cells.some(c => c.type === 'code' && /\[(\*|\d+)\]/.test(c.prompt));
}
""".replace("(CELLS)", f"({CELLS_JS.strip()})")

# Done: every code cell has an execution count and none is queued or running, or a cell failed
# (Run All stops there); and the kernel is idle.
RUN_DONE_JS = r"""
() => {
  const cells = (CELLS)();
  const status = (STATUS)();
  if (status === 'dead') return true;      // reported as such, without waiting out the timeout
  if (!cells || status !== 'idle') return false;
  const code = cells.filter(c => c.type === 'code');
  if (code.some(c => c.prompt.includes('*'))) return false;
  return code.every(c => c.count !== null && /\[\d+\]/.test(c.prompt))
      || code.some(c => c.errors.length > 0);
}
""".replace("(CELLS)", f"({CELLS_JS.strip()})").replace("(STATUS)", f"({KERNEL_STATUS_JS.strip()})")

# Every cell's plotly outputs are drawn as SVG, at least one figure exists, and a widget slider too.
FIGURES_DRAWN_JS = r"""
() => {
  const cells = (CELLS)();
  if (!cells) return false;
  const code = cells.filter(c => c.type === 'code');
  return code.some(c => c.figures > 0) && code.every(c => c.drawn >= c.figures)
      && document.querySelectorAll('.js-plotly-plot .main-svg').length > 0
      && document.querySelectorAll('.jupyter-widgets .widget-slider, .widget-slider.jupyter-widgets')
           .length > 0;
}
""".replace("(CELLS)", f"({CELLS_JS.strip()})")

# Marks the code cell(s) whose source matches a regular expression; returns how many matched.
MARK_CELL_JS = r"""
(pattern) => {
  const re = new RegExp(pattern);
  let n = 0;
  for (const cell of window.jupyterapp.shell.currentWidget.content.widgets) {
    if (cell.model.type === 'code' && re.test(cell.model.sharedModel.getSource())) {
      cell.node.setAttribute('data-browser-test', '');
      n++;
    }
  }
  return n;
}
"""

# A plotly figure's content, without the random ids plotly gives clip paths and gradients: every
# text (titles, annotations, tick labels) and every path's geometry.
FIGURE_SIGNATURE_JS = r"""
(plot) => {
  const svg = plot.querySelector('.main-svg');
  if (!svg) return null;
  const texts = Array.from(plot.querySelectorAll('svg text')).map(t => t.textContent);
  const paths = Array.from(plot.querySelectorAll('svg path')).map(p => p.getAttribute('d') || '');
  const title = plot.querySelector('.gtitle');
  return {title: title ? title.textContent : '', body: texts.join('|') + '#' + paths.join('|')};
}
"""


def describe(cells: list[dict] | None) -> str:
    if not cells:
        return "(no notebook found on the page)"
    lines = []
    for c in cells:
        if c["type"] != "code":
            continue
        flag = "ERROR" if c["errors"] else ("ok" if c["count"] is not None else "not run")
        figs = f"{c['drawn']}/{c['figures']} fig" if c["figures"] else ""
        lines.append(f"  cell {c['index']:>2} {c['prompt']:>6} {flag:<7} {figs:<9} {c['source'][:64]}")
        for err in c["errors"]:
            lines.append("      " + err.strip().replace("\n", "\n      ")[-1200:])
    return "\n".join(lines)


def failed_cells(cells: list[dict]) -> list[dict]:
    return [c for c in cells if c["type"] == "code" and c["errors"]]


def shoot(page, path: Path) -> None:
    try:
        page.screenshot(path=str(path), full_page=True, timeout=30_000)
    except Exception as exc:  # a screenshot must never hide the failure being reported
        print(f"screenshot {path.name} failed: {exc}")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_in_jupyterlab(chapter, browser, lab, artifacts):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    assert chapter in SLIDERS, f"no slider known for {chapter}; add it to SLIDERS"
    assert (REPO / "notebooks" / f"{chapter}.ipynb").is_file(), f"notebooks/{chapter}.ipynb not found"
    slider = SLIDERS[chapter]
    for old in artifacts.glob(f"{chapter}-*.png"):     # a stale failure screenshot would mislead
        old.unlink()
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    console_errors: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console_errors.append(f"page error: {e}"))
    page.on("request", lambda r: None if r.url.startswith((lab.url, "data:", "blob:"))
            else outside.append(r.url))
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def fail(step: str, detail: str = "") -> None:
        shoot(page, artifacts / f"{chapter}-failure.png")
        try:
            cells = page.evaluate(CELLS_JS)
        except Exception:
            cells = None
        pytest.fail(
            f"{chapter}: {step} (after {time.monotonic() - t0:.0f} s; "
            + ", ".join(f"{k} at {v:.0f} s" for k, v in timings.items()) + f")\n{detail}\ncells:\n"
            f"{describe(cells)}\nbrowser console errors: {console_errors[-10:]}\n"
            f"requests outside 127.0.0.1: {outside[:10]}\nscreenshot: "
            f"{artifacts / f'{chapter}-failure.png'}\njupyter log tail:\n{tail(lab.log_path, 3000)}",
            pytrace=False)

    def waited(js: str, timeout_ms: int, arg=None, polling: int = 500) -> bool:
        """Wait until `js` (evaluated in the page) is truthy; False when it timed out, so that the
        caller fails with its own message outside the exception handler."""
        try:
            page.wait_for_function(js, arg=arg, timeout=timeout_ms, polling=polling)
            return True
        except PlaywrightTimeout:
            return False

    try:
        # 1. Open the chapter and wait for its kernel.
        # A workspace of its own: JupyterLab saves the open tabs on the server and reopens them in
        # the default workspace, which would restart the previous chapter's kernel next to this one.
        workspace = f"browser-test-{chapter}-{secrets.token_hex(4)}"
        page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/notebooks/{chapter}.ipynb"
                  f"?token={lab.token}", timeout=PAGE_LOAD_MS)
        served = lab.root / "notebooks" / f"{chapter}.ipynb"     # the copy the server serves
        n_cells = len(json.loads(served.read_text("utf-8"))["cells"])
        if not waited(NOTEBOOK_READY_JS, KERNEL_READY_MS, arg=n_cells):
            fail(f"the notebook did not open ({n_cells} cells) with an idle kernel",
                 f"kernel status: {page.evaluate(KERNEL_STATUS_JS)}")
        timings["open"] = time.monotonic() - t0

        # 2. Run > Run All Cells, as a reader would.
        page.locator("#jp-MainMenu").get_by_role("menuitem", name="Run", exact=True).click()
        page.locator('#jp-mainmenu-run .lm-Menu-item[data-command="runmenu:run-all"]').click()
        # The first cell is queued or done at once; this names a lost click as such.
        if not waited(RUN_STARTED_JS, 60_000, polling=250):
            fail("Run > Run All Cells did not start running the cells")
        if not waited(RUN_DONE_JS, RUN_ALL_MS, polling=1000):
            fail(f"Run All Cells did not finish within {RUN_ALL_MS // 1000} s")
        timings["run all"] = time.monotonic() - t0
        if page.evaluate(KERNEL_STATUS_JS) == "dead":
            fail("the kernel died during Run All Cells (out of memory?)")
        cells = page.evaluate(CELLS_JS)
        bad = failed_cells(cells)
        if bad:
            fail(f"{len(bad)} cell(s) failed: {[c['index'] for c in bad]}")
        not_run = [c["index"] for c in cells if c["type"] == "code" and c["count"] is None]
        if not_run:
            fail(f"cells without an execution count: {not_run}")

        # 3. Figures are drawn and widgets are live. Plotly draws asynchronously after its output
        # arrives, so this waits (for every cell with plotly outputs to show as many drawn plots,
        # and for a widget slider) rather than counting at once.
        if not waited(FIGURES_DRAWN_JS, RENDER_MS):
            fail("plotly figures or ipywidgets sliders did not render",
                 "(cells list drawn/expected plotly figures)")
        timings["figures drawn"] = time.monotonic() - t0
        n_plots = page.locator(".js-plotly-plot").count()
        n_svg = page.locator(".js-plotly-plot .main-svg").count()
        n_widgets = page.locator(".jupyter-widgets").count()
        if page.get_by_text("Error displaying widget").count():
            fail("a widget failed to display")
        shoot(page, artifacts / f"{chapter}-run-all.png")

        # 4. Move the slider; the interact's figure must be redrawn with different content.
        # The cell that calls interact(<function>, ...) is marked, so that every lookup below (and
        # the wait for the redraw, which replaces the figure's DOM) stays inside it.
        marked = page.evaluate(MARK_CELL_JS, rf"interact\(\s*{re.escape(slider.function)}\b")
        if marked != 1:
            fail(f"expected one cell calling interact({slider.function}, ...), found {marked}")
        label = page.locator(".widget-label", has_text=re.compile(
            rf"^\s*{re.escape(slider.label)}\s*$"))
        interact = page.locator("[data-browser-test] .widget-interact").filter(
            has=page.locator(".widget-slider").filter(has=label))
        if interact.count() != 1:
            fail(f"expected one interact with a slider labelled {slider.label!r} in the cell of "
                 f"interact({slider.function}, ...), found {interact.count()}")
        # Marked too: the waits below query the page, and the redraw replaces the figure's DOM.
        interact.evaluate("el => el.setAttribute('data-browser-interact', '')")
        plot = interact.locator(".widget-output .js-plotly-plot")
        if not waited("() => !!document.querySelector("
                      "'[data-browser-interact] .widget-output .js-plotly-plot .main-svg')",
                      RENDER_MS):
            fail(f"the figure of the {slider.label!r} interact did not render")
        interact.scroll_into_view_if_needed()
        before = plot.first.evaluate(FIGURE_SIGNATURE_JS)
        handle = interact.locator(".widget-slider").filter(has=label).locator(".noUi-handle")
        # The value as the reader sees it: the readout next to the slider (aria-valuenow is rounded,
        # to one decimal for a FloatSlider, so a 0.05 step can leave it unchanged).
        readout = interact.locator(".widget-slider").filter(has=label).locator(".widget-readout")
        value_before = readout.text_content().strip()
        interact.screenshot(path=str(artifacts / f"{chapter}-slider-before.png"))
        timings["slider found"] = time.monotonic() - t0
        # Towards the farther end, one step at a time: each step must move the slider and redraw
        # the figure (so the last screenshot shows the last value, not a redraw still on its way).
        lo, now, hi = (float(handle.get_attribute(f"aria-value{a}")) for a in ("min", "now", "max"))
        key = "ArrowRight" if hi - now >= now - lo else "ArrowLeft"
        handle.focus()
        shown, value = before, value_before
        for press in range(1, slider.presses + 1):
            handle.press(key)
            deadline = time.monotonic() + 30
            while readout.text_content().strip() == value and time.monotonic() < deadline:
                time.sleep(0.1)
            if readout.text_content().strip() == value:
                fail(f"{key} did not move the {slider.label!r} slider from {value}")
            value = readout.text_content().strip()
            # Redrawn: the figure's content differs; or the callback failed, with a traceback in
            # the interact's output (reported at once rather than after the timeout).
            redrawn = waited(
                "(shown) => { const box = document.querySelector('[data-browser-interact]');"
                " if (!box) return false;"
                " for (const el of box.querySelectorAll("
                "'.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]'))"
                "   if (el.textContent.includes('Traceback')) return true;"
                " const plot = box.querySelector('.widget-output .js-plotly-plot');"
                f" const sig = plot && ({FIGURE_SIGNATURE_JS.strip()})(plot);"
                " return !!sig && sig.body !== shown.body; }",
                REDRAW_MS, arg=shown, polling=250)
            if failed_cells(page.evaluate(CELLS_JS)):
                fail(f"the {slider.label!r} slider's redraw failed (press {press}, value {value})")
            if not redrawn:
                fail(f"moving the {slider.label!r} slider to {value} (press {press}) did not "
                     "redraw its figure", f"title shown: {shown['title']!r}")
            shown = plot.first.evaluate(FIGURE_SIGNATURE_JS)
        after, value_after = shown, value
        timings["slider"] = time.monotonic() - t0
        interact.screenshot(path=str(artifacts / f"{chapter}-slider-after.png"))
        shoot(page, artifacts / f"{chapter}-slider.png")
        assert not outside, f"the page requested hosts other than 127.0.0.1: {outside[:10]}"
        print(f"{chapter}: {len([c for c in cells if c['type'] == 'code'])} code cells, "
              f"{n_plots} plotly figures ({n_svg} SVG layers), {n_widgets} widget elements; "
              f"slider {slider.label!r} {value_before} -> {value_after}; title "
              f"{before['title']!r} -> {after['title']!r}; timings "
              + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    finally:
        context.close()
        # Free the chapter's kernel (a loaded model) before the next chapter starts its own.
        lab.shutdown_kernels()


def test_report_math_renders_offline(browser, tmp_path, artifacts):
    """A report (workbench.course.report's HTML) opened from disk with the network off draws its
    math: MathJax, inlined from the installed package, turns the markdown's TeX and the figure's
    LaTeX title into SVG, and the page requests nothing but itself."""
    from test_report import math_notebook

    from workbench.course import report

    html_path = tmp_path / "math.html"
    report.to_html(math_notebook(tmp_path / "math.ipynb"), html_path)
    context = browser.new_context(viewport={"width": 1200, "height": 900}, offline=True)
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:"))
            else outside.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(html_path.as_uri(), timeout=PAGE_LOAD_MS)
        # MathJax's output: an <mjx-container> holding an SVG per formula (two in the markdown, one
        # displayed), and the figure's title typeset by plotly.js with the page's MathJax.
        drawn = ("() => document.querySelectorAll('.jp-RenderedMarkdown mjx-container svg').length"
                 " >= 2 && !!document.querySelector('.js-plotly-plot .main-svg')"
                 " && !!document.querySelector('.js-plotly-plot svg.gtitle-math')")
        try:
            page.wait_for_function(drawn, timeout=RENDER_MS, polling=250)
        except Exception:
            shoot(page, artifacts / "report-math-failure.png")
            raise
        shoot(page, artifacts / "report-math.png")
        found = page.evaluate("""() => ({
            version: window.MathJax && MathJax.version,
            inline: document.querySelectorAll('.jp-RenderedMarkdown mjx-container:not([display])').length,
            display: document.querySelectorAll('.jp-RenderedMarkdown mjx-container[display="true"]').length,
            errors: document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
            raw: document.querySelector('.jp-RenderedMarkdown').textContent.includes('\\\\frac')})""")
        assert found == {"version": "3.2.2", "inline": 1, "display": 1, "errors": 0, "raw": False}, found
        assert not outside, f"the report requested {outside[:5]}"
        assert not errors, errors
    finally:
        context.close()
