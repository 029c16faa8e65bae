"""What serves the chapters and labs rather than the engine.

    report.py    python -m workbench.course.report: every chapter executed by papermill into HTML
    results.py   record(): the numbers a chapter measured, gathered into results.json
    viz/         the chapters' plotly figures and widgets (figures only)
    labs/        the exercises' checks and the grader (python -m workbench.course.labs grade)
"""
from workbench.extras import require

for _module in ("plotly", "ipywidgets"):      # the 'notebooks' extra: the chapters' figures
    require(_module, "workbench.course (the chapters' figures and widgets)")
