"""Course labs: exercises with checkers, one lab notebook per chapter (`labs/`).

In a lab notebook::

    from workbench.course import labs

    # EXERCISE: paged.slot_mapping
    def slot_mapping(block_table, positions, block_size):
        ...

    labs.check("paged.slot_mapping", slot_mapping)      # a green or red box, with a hint

For instructors: `python -m workbench.course.labs grade SUBMISSIONS/` runs every exercise of every
submitted notebook in its own process and prints who passed what (see `workbench/course/labs/grade.py`).
Each chapter's checkers live in their own module here; every module is found automatically.
"""
from __future__ import annotations

from workbench.course.labs.core import (
                                        EXERCISES,
                                        FAILED,
                                        NOT_ATTEMPTED,
                                        PASSED,
                                        Exercise,
                                        Feedback,
                                        Mismatch,
                                        check,
                                        exercise,
                                        get,
                                        load_all,
)

__all__ = ["EXERCISES", "Exercise", "Feedback", "Mismatch", "check", "exercise", "get", "load_all",
           "PASSED", "FAILED", "NOT_ATTEMPTED"]
