"""results/README.md is generated from the committed JSON (`python -m workbench.bench table`) and
kept current; the generator reads old and new run formats alike."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.bench import table

REPO = Path(__file__).resolve().parents[1]


def test_committed_results_table_is_current():
    files = table.generate(REPO)
    readme = REPO / "results" / "README.md"
    assert readme in files
    text = files[readme]
    assert "python -m workbench.bench table" in text.splitlines()[0]
    # every committed speed run appears once, linked
    speed = table.load(REPO / "results")[0]
    assert speed
    for rel, _ in speed:
        assert text.count(f"]({rel})") >= 1, rel
    assert table.stale(REPO) == [], "run `python -m workbench.bench table` and commit the result"


def _old_run() -> dict:
    """The first format: no targets' sense, no kernels_isa / native_bf16 / commit, no offline."""
    return {"workload": "speed", "date": "2026-01-01T09:05:00",
            "machine": {"processor": "x86_64", "cores": 2, "torch": "2.5.0", "python": "3.10.1"},
            "ladder": {"threads": 2, "new_tokens": 16, "repeats": 1, "prompt_tokens": 8,
                       "copy_bandwidth_gbs": 10.0, "best_bf16_row": "engine eager bf16",
                       "rows": {"engine eager bf16": {"tok_s": 20.0, "decode_tok_s": 21.0,
                                                      "fraction_of_copy_bandwidth": 0.5},
                                "transformers fp32": {"tok_s": 9.0, "decode_tok_s": None}}}}


def _new_run() -> dict:
    return {"workload": "speed", "date": "2026-02-03T17:42:10",
            "machine": {"processor": "aarch64", "cores": 8, "torch": "2.9.0", "python": "3.12.0",
                        "kernels_isa": "avx2", "native_bf16": False,
                        "forced_isa": {"WORKBENCH_ISA": "avx2"}, "commit": "abc1234-dirty"},
            "ladder": {"threads": 8, "new_tokens": 16, "repeats": 1, "prompt_tokens": 8,
                       "copy_bandwidth_gbs": 20.0, "int4_vs_llamacpp": 0.5,
                       "rows": {"engine default": {"tok_s": 40.0, "decode_tok_s": 42.0,
                                                   "fraction_of_copy_bandwidth": 0.9}}},
            "offline": {"ratio_vs_transformers": 9.5, "batch_invariant_time_ratio": 1.1,
                        "engine": {"tok_s": 100.0}, "llama.cpp": {"tok_s": 50.0}},
            "targets": [
                {"target": "single-stream INT4 (default) tok/s vs llama.cpp", "measured": 0.5,
                 "bar": 1.0, "sense": "min", "met": False},
                {"target": "single-stream default decode, share of copy bandwidth",
                 "measured": 0.9, "bar": 0.7, "sense": "min", "met": True},
                {"target": "offline-mixed vs transformers static batches (pairs)",
                 "measured": 9.5, "bar": 8.0, "sense": "min", "met": True},
                {"target": "offline-mixed vs llama.cpp one by one", "measured": 2.0, "bar": 3.0,
                 "sense": "min"},    # no "met": computed from measured, bar and sense
                {"target": "offline-mixed time, batch_invariant / default (pairs)",
                 "measured": 1.1, "bar": 1.3, "sense": "max", "met": True}]}


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of the first markdown table after '## Speed runs', split into cells."""
    lines = text.split("## Speed runs", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| date |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


@pytest.fixture()
def synthetic_repo(tmp_path):
    (tmp_path / "results" / "cpu").mkdir(parents=True)
    (tmp_path / "results" / "cpu" / "speed-a.json").write_text(json.dumps(_old_run()))
    (tmp_path / "results" / "cpu" / "speed-b.json").write_text(json.dumps(_new_run()))
    (tmp_path / "results" / "cpu" / "floor-c.json").write_text(json.dumps(
        {"model": "m", "threads": 2, "paths": {"aten linear": {"floor_tok_s": 123.0}}}))
    (tmp_path / "results" / "cpu" / "other.json").write_text(json.dumps({"workload": "gpu"}))
    return tmp_path


def test_synthetic_runs_newest_first_with_dashes_and_verdicts(synthetic_repo):
    text = table.render_readme(synthetic_repo / "results")
    rows = _table_rows(text)
    assert len(rows) == 2
    new, old = rows
    header = table.HEADLINE_HEADER
    assert all(len(r) == len(header) for r in rows)
    new, old = dict(zip(header, new)), dict(zip(header, old))
    # newest first, by the JSON's date (the file names sort the other way round)
    assert new["date"] == "2026-02-03 17:42" and "speed-b.json" in new["run"]
    assert old["date"] == "2026-01-01 09:05" and "speed-a.json" in old["run"]
    assert "(cpu/speed-b.json)" in new["run"]
    # the new run: forced ISA, commit, each target with its verdict
    assert "kernels avx2" in new["machine"] and "native bf16 no" in new["machine"]
    assert "forced WORKBENCH_ISA=avx2" in new["machine"]
    assert new["commit"] == "`abc1234-dirty`"
    assert new["torch / Python"] == "2.9.0 / 3.12.0"
    int4, share, vs_tf, vs_llama, bi = (new[h[0]] for h in table.HEADLINES)
    assert int4 == "0.50x (≥ 1x: not met)"
    assert share == "90% (≥ 70%: met)"
    assert vs_tf == "9.50x (≥ 8x: met)"
    assert vs_llama == "2.00x (≥ 3x: not met)"
    assert bi == "1.10x (≤ 1.3x: met)"
    # the old run: "-" for everything it does not record, no verdicts without targets
    assert old["commit"] == "-"
    assert "kernels -" in old["machine"] and "native bf16 -" in old["machine"]
    assert "forced" not in old["machine"]
    assert old[table.HEADLINES[0][0]] == "-"            # no int4_vs_llamacpp
    assert old[table.HEADLINES[1][0]] == "50%"          # the best bf16 row, no target stored
    assert [old[h[0]] for h in table.HEADLINES[2:]] == ["-", "-", "-"]
    assert "met" not in " ".join(old.values())
    # one ladder section per machine kind, the floor run and the other file listed
    assert "### kernels avx2, no native bf16, forced WORKBENCH_ISA=avx2" in text
    assert "### kernels ISA not recorded, native bf16 not recorded" in text
    assert "| engine eager bf16 | 20.0 | 21.0 | 50% |" in text
    assert "| transformers fp32 | 9.0 | - | - |" in text
    assert "[floor-c.json](cpu/floor-c.json)" in text and "| 123 |" in text
    assert "- [cpu/other.json](cpu/other.json): workload `gpu`" in text
    # deterministic
    assert table.render_readme(synthetic_repo / "results") == text


def test_check_and_docs_block(synthetic_repo, capsys):
    root = synthetic_repo
    readme = root / "results" / "README.md"
    assert table.stale(root) == [readme]
    with pytest.raises(SystemExit) as e:
        table.main(["--check", "--root", str(root)])
    assert e.value.code == 1 and "results/README.md is out of date" in capsys.readouterr().err
    assert table.main(["--root", str(root)]) == 0
    assert "docs/performance.md does not exist" in capsys.readouterr().out
    assert table.stale(root) == []
    assert table.main(["--check", "--root", str(root)]) == 0

    docs = root / "docs" / "performance.md"
    docs.parent.mkdir()
    docs.write_text(f"# Performance\n\nbefore\n{table.BEGIN}\nold table\n{table.END}\nafter\n")
    assert table.stale(root) == [docs]
    table.main(["--root", str(root)])
    text = docs.read_text()
    assert text.startswith("# Performance\n\nbefore\n" + table.BEGIN + "\n")
    assert text.endswith(table.END + "\nafter\n") and "old table" not in text
    # the latest run of each recorded machine kind; the run without a recorded ISA stays out
    assert "(../results/cpu/speed-b.json)" in text and "speed-a.json" not in text
    assert table.stale(root) == []
    # a hand edit inside the markers is caught
    docs.write_text(text.replace("2.00x", "3.00x"))
    assert table.stale(root) == [docs]
    # a docs page without the markers is left alone
    docs.write_text("# Performance\n")
    assert table.stale(root) == []


def test_compress_runs_merge_into_each_variants_newest_row(tmp_path):
    (tmp_path / "cpu").mkdir()
    common = {"workload": "compress", "model": "m", "dtype": "torch.float32", "num_windows": 2,
              "window_len": 64, "threads": 2}
    dense = {"variant": "dense", "ppl": None, "mean_kl": 0.0, "top1": 1.0, "zero_fraction": 0.0,
             "dense": 2e6, "compressed": 2e6, "speedup_b1": 1.0, "speedup_b16": 1.0}
    older = dict(common, date="2026-03-01T10:00:00", rows=[
        dense, {"variant": "wanda-2:4", "ppl": 95.9, "mean_kl": 1.708, "top1": 0.383,
                "zero_fraction": 0.5, "dense": 2e6, "compressed": 1.125e6, "speedup_b1": 1.01,
                "speedup_b16": 0.99},
        {"variant": "layers-0.3+kd", "ppl": 34.7, "mean_kl": 0.796, "top1": 0.573,
         "zero_fraction": 0.0, "dense": 1.5e6, "compressed": 1.5e6, "speedup_b1": 1.33,
         "speedup_b16": 1.34, "distill_s": 299.4, "distill_steps": 60}])
    newer = dict(common, date="2026-03-02T10:00:00", rows=[
        dict(dense, speedup_b1=1.0), {"variant": "mixed", "ppl": 24.9, "mean_kl": 0.318,
                                      "top1": 0.702, "zero_fraction": 0.0, "dense": 6.5e5,
                                      "compressed": 6.5e5, "speedup_b1": 1.61, "speedup_b16": 0.82}])
    (tmp_path / "cpu" / "compress-a.json").write_text(json.dumps(older))
    (tmp_path / "cpu" / "compress-b.json").write_text(json.dumps(newer))
    text = table.render_readme(tmp_path)
    assert "## Compression" in text
    assert "run 1: [compress-b.json](cpu/compress-b.json)" in text
    assert "run 2: [compress-a.json](cpu/compress-a.json)" in text
    assert "| dense | 1 | - | 0.000 | 1.000 | 0% | 2.0 | 2.0 | 1.00 | 1.00 | - |" in text
    assert "| mixed | 1 | 24.9 | 0.318 | 0.702 | 0% | 0.7 | 0.7 | 1.61 | 0.82 | - |" in text
    assert "| wanda-2:4 | 2 | 95.9 | 1.708 | 0.383 | 50% | 2.0 | 1.1 | 1.01 | 0.99 | - |" in text
    assert "| layers-0.3+kd | 2 | 34.7 | 0.796 | 0.573 | 0% | 1.5 | 1.5 | 1.33 | 1.34 | 299 s, 60 steps |" in text
    assert text.count("| dense |") == 1
    assert "Other result files" not in text


def test_memory_runs_render_their_three_tables(tmp_path):
    (tmp_path / "cpu").mkdir()
    run = {"workload": "memory", "model": "m", "date": "2026-03-03T10:00:00",
           "offload": {"rows": [
               {"batch_size": 1, "weights": "resident", "measured_tokens_per_s": 30.0,
                "ratio_to_resident": 1.0, "calibrated_error": 0.0},
               {"batch_size": 1, "weights": "offloaded", "measured_tokens_per_s": 4.5,
                "ratio_to_resident": 0.15, "calibrated_error": -0.21}]},
           "kv_tiers": {"rows": [{"context_tokens": 512, "recompute_s": 0.75,
                                  "recompute_over_cpu": 12.5, "recompute_over_disk": 9.25}]},
           "kv_compression": {"rows": [{"method": "uniform", "setting": "int8",
                                        "kv_bytes_per_token": 12240, "ratio": 0.53125,
                                        "perplexity": 25.01, "delta": -0.14}]}}
    (tmp_path / "cpu" / "memory-a.json").write_text(json.dumps(run))
    text = table.render_readme(tmp_path)
    assert "## Memory hierarchy" in text and "### [memory-a.json](cpu/memory-a.json)" in text
    assert "| 1 | 4.5 | 0.15 | -21% |" in text           # only the offloaded row
    assert "| 512 | 750 | 12.5 | 9.2 |" in text
    assert "| uniform | int8 | 12240 | 0.531 | 25.01 | -0.14 |" in text
    assert "Other result files" not in text
