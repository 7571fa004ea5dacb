"""The house style holds: ruff's linter (its line-length rule included) and its formatter report
nothing over the repository, as `make lint` and CI check them, so a change that breaks the style
fails `make test` on the machine it was made on, not only in CI."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff_reports_nothing(args):
    r = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout}{r.stderr}"


def test_the_line_length_rule_is_on():
    """The formatter cannot wrap comments and strings; the rule is what keeps them at 100."""
    long_line = "x = 1  # " + "a" * 100 + "\n"
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--stdin-filename", "probe.py", "-"],
        cwd=ROOT,
        input=long_line,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1 and "E501" in r.stdout, r.stdout + r.stderr
