"""Benchmark records under bench/<topic>/results are never overwritten by a later run's default
name."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def common(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    mod = importlib.import_module("bench.common")
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")
    yield mod
    sys.modules.pop("bench.common", None)


def test_a_second_run_on_the_same_day_takes_the_next_free_name(common, tmp_path):
    first = common.results_path(None, "knowledge-2026-11-26.json")
    assert first == tmp_path / "results" / "knowledge-2026-11-26.json" and first.parent.is_dir()
    first.write_text("{}")
    second = common.results_path(None, "knowledge-2026-11-26.json")
    assert second.name == "knowledge-2026-11-26-2.json"
    second.write_text("{}")
    assert (
        common.results_path(None, "knowledge-2026-11-26.json").name == "knowledge-2026-11-26-3.json"
    )
    # an explicit --out is written as given, even over an existing file
    assert common.results_path(str(first), "x.json") == first
    # and its folder is made, as a default's is
    assert common.results_path(str(tmp_path / "new" / "r.json"), "x.json").parent.is_dir()


def test_no_bench_script_builds_a_results_path_of_its_own():
    """Every script names its default through `results_path`, so the rule above holds for all."""
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "bench").rglob("*.py")
        if p != REPO / "bench" / "common.py" and re.search(r"""["']results["']""", p.read_text())
    ]
    assert not offenders, (
        f"bench scripts writing under bench/<topic>/results without results_path: {offenders}"
    )


def test_every_committed_result_is_dated():
    """A record says when it was measured in its name (files and run folders alike)."""
    undated = [
        p.name
        for p in (REPO / "bench").glob("*/results/*")
        if not re.search(r"\d{4}-\d{2}-\d{2}", p.name)
    ]
    assert not undated, undated
