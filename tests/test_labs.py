"""The labs: every checker passes its reference solution and catches typical wrong answers with a
message that points at the mistake; the lab notebooks are committed unsolved and consistent with
the registry; the instructor's grader tells solved, wrong and untouched submissions apart.

Solutions live in tests/lab_solutions/<module>.py (SOLUTIONS and WRONG), never in labs/*.ipynb.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.course import labs
from workbench.course.labs import grade

ROOT = Path(__file__).resolve().parents[1]
LAB_NOTEBOOKS = sorted((ROOT / "labs").glob("*.ipynb"))
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def _load_solution_modules():
    modules = []
    for path in sorted((Path(__file__).parent / "lab_solutions").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"lab_solutions_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


SOLUTION_MODULES = _load_solution_modules()
SOLUTIONS = {k: v for m in SOLUTION_MODULES for k, v in m.SOLUTIONS.items()}
WRONG = [w for m in SOLUTION_MODULES for w in m.WRONG]
EXERCISES = labs.load_all()


def define(exercise_id: str, source: str):
    namespace: dict = {}
    exec(compile(source, f"<{exercise_id}>", "exec"), namespace)
    return namespace[EXERCISES[exercise_id].function]


def test_every_exercise_has_a_solution_and_a_wrong_answer():
    assert EXERCISES, "no lab exercises registered"
    assert set(SOLUTIONS) == set(EXERCISES), (set(SOLUTIONS) ^ set(EXERCISES))
    caught = {w[0] for w in WRONG}
    assert caught == set(EXERCISES), f"exercises without a wrong answer: {set(EXERCISES) - caught}"


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_reference_solution_passes(exercise_id):
    fb = labs.check(exercise_id, define(exercise_id, SOLUTIONS[exercise_id]))
    assert fb.status == labs.PASSED, str(fb)


@pytest.mark.parametrize("exercise_id,source,phrase", WRONG,
                         ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_wrong_answer_is_caught_with_a_pointed_hint(exercise_id, source, phrase):
    fb = labs.check(exercise_id, define(exercise_id, source))
    assert fb.status == labs.FAILED, f"the checker passed a wrong answer:\n{source}"
    assert phrase in fb.message + fb.hint, f"expected {phrase!r} in the feedback:\n{fb}"


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_unfinished_exercise_is_not_attempted(exercise_id):
    ex = EXERCISES[exercise_id]

    def unfinished(*args, **kwargs):
        raise NotImplementedError

    assert labs.check(exercise_id, unfinished).status == labs.NOT_ATTEMPTED
    assert labs.check(exercise_id, None).status == labs.NOT_ATTEMPTED
    assert ex.chapter in CHAPTERS, f"{exercise_id}: chapter {ex.chapter!r} is not a notebook"


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(ValueError, match=r"exercise='paged.nope' is not a lab exercise; known: .*"
                                         r"paged.slot_mapping"):
        labs.check("paged.nope", lambda: None)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_every_chapter_with_exercises_has_one_lab_notebook():
    assert LAB_NOTEBOOKS, "labs/ holds no notebooks"
    in_notebooks = {}
    for path in LAB_NOTEBOOKS:
        for ex_id in grade.exercises_in(grade.notebook_cells(path)):
            assert ex_id not in in_notebooks, f"{ex_id} is in {in_notebooks.get(ex_id)} and {path}"
            in_notebooks[ex_id] = path
    assert set(in_notebooks) == set(EXERCISES), set(in_notebooks) ^ set(EXERCISES)
    for ex_id, path in in_notebooks.items():
        assert path.stem == EXERCISES[ex_id].chapter, (
            f"{ex_id} belongs to chapter {EXERCISES[ex_id].chapter} but sits in {path.name}")


@pytest.mark.parametrize("path", LAB_NOTEBOOKS, ids=[p.name for p in LAB_NOTEBOOKS])
def test_lab_notebook_is_committed_unsolved(path):
    cells = _cells(path)
    for cell in cells:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{path.name}: clear outputs before committing")
    sources = grade.notebook_cells(path)
    for src in sources:
        m = grade.EXERCISE_LINE.match(src.lstrip("\n").split("\n", 1)[0]) if src.strip() else None
        if not m:
            continue
        ex = EXERCISES[m.group(1)]
        assert f"def {ex.function}(" in src, f"{path.name}: {ex.id}'s cell must define {ex.function}"
        assert "raise NotImplementedError" in src, f"{path.name}: {ex.id}'s cell is not a stub"
        # The check cell follows, so the learner sees the feedback right below their code.
        assert any(f'labs.check("{ex.id}", {ex.function})' in s for s in sources), (
            f"{path.name}: no check cell for {ex.id}")


def _submission(lab: Path, answers: dict[str, str], dest: Path) -> Path:
    """A copy of a lab notebook with some exercise cells replaced by the given sources."""
    nb = json.loads(lab.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        m = grade.EXERCISE_LINE.match(src.split("\n", 1)[0]) if cell["cell_type"] == "code" else None
        if m and m.group(1) in answers:
            cell["source"] = f"# EXERCISE: {m.group(1)}\n" + answers[m.group(1)].strip() + "\n"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(nb), encoding="utf-8")
    return dest


def test_grader_tells_solved_wrong_and_untouched_apart(tmp_path):
    """Every lab solved by one learner; one wrong answer in two labs by another; a third hands two
    labs in untouched, and a fourth submits a notebook that loops forever. (Every wrong answer is
    already run through its checker above: here the point is the grader, one process a notebook.)"""
    wrong_by_id = {}
    for ex_id, source, _ in WRONG:
        wrong_by_id.setdefault(ex_id, source)
    for lab in LAB_NOTEBOOKS:
        ids = grade.exercises_in(grade.notebook_cells(lab))
        _submission(lab, {i: SOLUTIONS[i] for i in ids}, tmp_path / "ada" / lab.name)
    for lab in LAB_NOTEBOOKS[-2:]:
        ids = grade.exercises_in(grade.notebook_cells(lab))
        _submission(lab, {ids[0]: wrong_by_id[ids[0]]}, tmp_path / "bob" / lab.name)
        _submission(lab, {}, tmp_path / "cy" / lab.name)
    grades = grade.grade_folder(tmp_path, timeout=60)
    # The endless loop in a folder of its own with a short limit: the limit is what is under test.
    first = LAB_NOTEBOOKS[0]
    first_id = grade.exercises_in(grade.notebook_cells(first))[0]
    loop = f"def {EXERCISES[first_id].function}(*a):\n    return 0\nwhile True:\n    pass\n"
    _submission(first, {first_id: loop}, tmp_path / "late" / "dee" / first.name)
    grades.update(grade.grade_folder(tmp_path / "late", timeout=5))
    by_learner: dict[str, dict] = {}
    for name, results in grades.items():
        by_learner.setdefault(name.split("/")[0], {}).update(results)
    assert all(r["status"] == labs.PASSED for r in by_learner["ada"].values()), by_learner["ada"]
    assert set(by_learner["ada"]) == set(EXERCISES)
    for lab in LAB_NOTEBOOKS[-2:]:
        ids = grade.exercises_in(grade.notebook_cells(lab))
        assert by_learner["bob"][ids[0]]["status"] == labs.FAILED
        assert all(by_learner["bob"][i]["status"] == labs.NOT_ATTEMPTED for i in ids[1:])
    assert set(by_learner["cy"]) == {i for lab in LAB_NOTEBOOKS[-2:]
                                     for i in grade.exercises_in(grade.notebook_cells(lab))}
    assert all(r["status"] == labs.NOT_ATTEMPTED for r in by_learner["cy"].values())
    assert by_learner["dee"][first_id]["status"] == labs.FAILED
    assert "did not finish within 5 s" in by_learner["dee"][first_id]["message"]

    header, rows = grade.table(grades)
    assert header[0] == "submission" and header[-1] == "passed"
    ada_rows = [r for r in rows if r[0].startswith("ada")]
    assert len(ada_rows) == len(LAB_NOTEBOOKS)
    assert all(r[-1].split("/")[0] == r[-1].split("/")[1] for r in ada_rows), ada_rows


def test_grade_command_prints_a_table_and_writes_csv(tmp_path):
    lab = LAB_NOTEBOOKS[0]
    ids = grade.exercises_in(grade.notebook_cells(lab))
    _submission(lab, {ids[0]: SOLUTIONS[ids[0]]}, tmp_path / "subs" / "ada.ipynb")
    out = subprocess.run([sys.executable, "-m", "workbench.course.labs", "grade", str(tmp_path / "subs"),
                          "--csv", str(tmp_path / "g.csv")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ada" in out.stdout and "passed" in out.stdout, out.stdout
    rows = (tmp_path / "g.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert header == ["submission", *ids, "passed"], header     # the notebook's order
    assert rows[1].startswith("ada,passed,")
    assert rows[1].endswith(f",1/{len(ids)}")
