"""What every lab shares: exercises, the feedback a checker gives, and `check`.

An exercise is a function the learner writes in a notebook cell whose first line is
`# EXERCISE: <id>`. Its checker runs the learner's function on a few cases and compares it with the
engine's own implementation (the reference the chapter teaches); at the first disagreement it raises
`Mismatch` with what went in, what was expected, what came back, and a hint aimed at the mistake
it recognises. `check(id, fn)` turns that into `Feedback`, which a notebook shows as a green or red
box. `check` never raises: an unfinished lab still runs top to bottom (CI executes the lab
notebooks as committed, unsolved).
"""
from __future__ import annotations

import html
import importlib
import pkgutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NOT_ATTEMPTED, PASSED, FAILED = "not attempted", "passed", "failed"


class Mismatch(AssertionError):
    """The learner's answer disagrees with the reference. `message` says where, `hint` says why."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message, self.hint = message, hint


@dataclass(frozen=True)
class Exercise:
    id: str              # "<chapter>.<name>", e.g. "paged.slot_mapping"
    chapter: str         # the notebook it belongs to, e.g. "03_paged_kv_cache"
    function: str        # the name the learner's cell defines
    title: str
    hint: str            # shown when the checker has no more specific one
    checker: Callable[[Callable], None]


EXERCISES: dict[str, Exercise] = {}


def exercise(id: str, chapter: str, function: str, title: str, hint: str = ""):
    """Register a checker: `@exercise(...) def check_x(fn): ...` raising Mismatch on a wrong fn."""
    def register(checker: Callable[[Callable], None]) -> Callable[[Callable], None]:
        if id in EXERCISES:
            raise ValueError(f"exercise id {id!r} is registered twice")
        EXERCISES[id] = Exercise(id, chapter, function, title, hint, checker)
        return checker
    return register


@dataclass
class Feedback:
    exercise: str
    status: str          # NOT_ATTEMPTED, PASSED or FAILED
    message: str
    hint: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        text = f"[{self.status}] {self.exercise}: {self.message}"
        return text + (f"\nhint: {self.hint}" if self.hint and not self.passed else "")

    def _repr_html_(self) -> str:
        color = {PASSED: "#1a7f37", FAILED: "#cf222e"}.get(self.status, "#9a6700")
        hint = (f"<div style='margin-top:.3em'><b>Hint:</b> {html.escape(self.hint)}</div>"
                if self.hint and not self.passed else "")
        return (f"<div style='border-left:4px solid {color};padding:.4em .8em;background:#f6f8fa'>"
                f"<b style='color:{color}'>{html.escape(self.exercise)}: {self.status}</b>"
                f"<div style='white-space:pre-wrap;font-family:monospace'>"
                f"{html.escape(self.message)}</div>{hint}</div>")

    def to_dict(self) -> dict:
        return {"exercise": self.exercise, "status": self.status, "message": self.message,
                "hint": self.hint}


def get(exercise_id: str) -> Exercise:
    load_all()
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise ValueError(f"exercise={exercise_id!r} is not a lab exercise; known: "
                         f"{', '.join(sorted(EXERCISES))}") from None


def check(exercise_id: str, fn: Callable | None) -> Feedback:
    """Run the checker of `exercise_id` on the learner's function; never raises."""
    ex = get(exercise_id)
    if fn is None or not callable(fn):
        return Feedback(ex.id, NOT_ATTEMPTED, f"define a function named {ex.function}", ex.hint)
    try:
        ex.checker(fn)
    except NotImplementedError:
        return Feedback(ex.id, NOT_ATTEMPTED, "not done yet: replace `raise NotImplementedError` "
                        "with your code", ex.hint)
    except Mismatch as m:
        return Feedback(ex.id, FAILED, m.message, m.hint or ex.hint)
    except Exception as exc:  # the learner's code crashed: show where, in their code
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if "workbench/course/labs" not in f.filename.replace("\\", "/")]
        where = (f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else "")
        return Feedback(ex.id, FAILED, f"your function raised {type(exc).__name__}: {exc}{where}",
                        ex.hint)
    return Feedback(ex.id, PASSED, f"{ex.title}: correct on every case")


def expect_equal(got, expected, what: str, hint: str = "") -> None:
    """Raise Mismatch naming `what` (the case) when got != expected."""
    if got != expected:
        raise Mismatch(f"{what}:\n  expected {expected!r}\n  got      {got!r}", hint)


def expect_close(got, expected, what: str, atol: float, hint: str = "") -> None:
    """For tensors or arrays: shape, then values within atol."""
    import torch
    got_t = torch.as_tensor(got)
    exp_t = torch.as_tensor(expected)
    if tuple(got_t.shape) != tuple(exp_t.shape):
        raise Mismatch(f"{what}: expected shape {tuple(exp_t.shape)}, got {tuple(got_t.shape)}",
                       hint)
    err = (got_t.double() - exp_t.double()).abs().max().item() if got_t.numel() else 0.0
    if not err <= atol:
        raise Mismatch(f"{what}: largest difference from the reference is {err:.3g} "
                       f"(allowed {atol:g})", hint)


def call(fn: Callable, what: str, *args, **kwargs):
    """fn(*args, **kwargs), but a crash becomes a Mismatch that names the case (`what`)."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, Mismatch):
        raise
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if "workbench/course/labs" not in f.filename.replace("\\", "/")]
        where = f" at line {frames[-1].lineno} of your cell" if frames else ""
        raise Mismatch(f"{what} raised {type(exc).__name__}: {exc}{where}") from exc


_INFRASTRUCTURE = {"core", "grade", "__main__"}


def load_all() -> dict[str, Exercise]:
    """Import every chapter module of this package (each registers its exercises)."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in _INFRASTRUCTURE:
            importlib.import_module(f"workbench.course.labs.{info.name}")
    return EXERCISES
