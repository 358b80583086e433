"""`selfspec bench ab`: a benchmark run from an old tree and from this one in turn, each row's best time per side
and new / old; here with a stand-in benchmark module in two fake trees, through real subprocesses."""
import json

import pytest

from selfspec.bench import ab

STAND_IN = '''
import argparse, json, os
ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, nargs="+")
ap.add_argument("--json")
args = ap.parse_args()
ms = float(os.environ["AB_TEST_MS"]) * (0.5 if "new" in __file__ else 1.0)
rows = [{"kind": "ar", "storage": "planes", "mode": "full", "batch": b, "tokens": 1, "ms": ms * b} for b in args.batch]
json.dump({"rows": rows}, open(args.json, "w"))
'''


def fake_tree(root, name):
    bench = root / name / "selfspec" / "bench"
    bench.mkdir(parents=True)
    (root / name / "selfspec" / "__init__.py").write_text("")
    (bench / "__init__.py").write_text("")
    (bench / "steps.py").write_text(STAND_IN)
    return root / name


def test_runs_both_trees_in_turn_and_compares_each_row(tmp_path, monkeypatch, capsys):
    old, new = fake_tree(tmp_path, "old"), fake_tree(tmp_path, "new")
    monkeypatch.setenv("AB_TEST_MS", "4")
    out = tmp_path / "ab.json"
    ab.main(["--old", str(old), "--new", str(new), "--rounds", "2", "--json", str(out), "--", "steps", "--batch", "1",
             "8"])
    result = json.loads(out.read_text())
    assert [(r["batch"], r["old_ms"], r["new_ms"], r["new_over_old"]) for r in result["rows"]] == [
        (1, 4.0, 2.0, 0.5), (8, 32.0, 16.0, 0.5)]
    assert len(result["runs"]["old"]) == len(result["runs"]["new"]) == 2
    assert "| ar | planes | full | 8 | 1 | 32.0000 | 16.0000 | 0.500 |" in capsys.readouterr().out


def test_compare_keeps_each_sides_best_run_and_rows_both_have():
    runs = [[{"m": 1, "ms": 3.0}, {"m": 2, "ms": 5.0}], [{"m": 1, "ms": 2.0}]]
    rows = ab.compare(runs, [[{"m": 1, "ms": 1.0}]], ("m",))
    assert rows == [{"m": 1, "old_ms": 2.0, "new_ms": 1.0, "new_over_old": 0.5}]


def test_an_old_tree_without_the_package_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab.main(["--old", str(tmp_path), "steps"])
    assert "holds no selfspec/ package" in capsys.readouterr().err
