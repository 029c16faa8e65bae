"""`interact` for the chapters: ipywidgets' own, except in headless reports.

In a notebook this is `ipywidgets.interact(fn, **controls)`: sliders that redraw a figure.
Reports (papermill, `python -m workbench.course.report`) set WORKBENCH_STATIC_WIDGETS=1, and then `fn` runs
once with each control's starting value: a report is static HTML, where a slider could not move
anyway, and nbclient can hang waiting for an execute reply after ipywidgets' comm traffic (about
1 run in 6 on a 2-core machine), which a report cannot afford.
"""
from __future__ import annotations

import os

STATIC_ENV = "WORKBENCH_STATIC_WIDGETS"


def static_widgets() -> bool:
    return os.environ.get(STATIC_ENV, "0") == "1"


def interact(fn, **controls):
    if static_widgets():
        result = fn(**{name: getattr(control, "value", control)
                       for name, control in controls.items()})
        if result is not None:
            from IPython.display import display
            display(result)
        return None
    import ipywidgets
    return ipywidgets.interact(fn, **controls)
