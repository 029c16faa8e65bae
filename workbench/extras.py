"""Optional dependencies, grouped in pyproject.toml's extras: what needs one imports it through
`require`, so that a missing one is an error naming the extra to install."""
from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"xgrammar": "structured", "optuna": "search", "plotly": "notebooks",
          "ipywidgets": "notebooks", "triton": "triton", "llama_cpp": "llamacpp"}


def require(module: str, what: str) -> ModuleType:
    """Import `module`, or raise an ImportError that says which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = EXTRAS.get(module.split(".")[0])
        how = (f"pip install 'llm-workbench[{extra}]'" if extra else f"pip install {module}")
        raise ImportError(f"{what} needs the Python package {module!r}, which is not installed: "
                          f"{how}") from err
