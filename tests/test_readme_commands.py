"""The README's commands, read from the README and typed as a user types them (issue 70, item 5).

Each `memtree …` line of the README's bash blocks is parsed by the real `memtree` parser. Those that
need nothing but the repository run: fast ones whole (`memstore plan`, `simulate-fetch`,
`docs-corpus`), long ones up to the point where their validated config is handed to the stage's run
function, which records it instead of running for minutes (the config, its overrides and its
`--recipes` / `--rows` selection are what a README line can get wrong). Lines whose inputs come from
`make demo` or an earlier line are only parsed; `test_every_readme_command_is_classified` makes a
new README line pick one of these."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from memtree.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def readme_commands(path: Path = REPO / "README.md") -> list[str]:
    """Every `memtree …` command of the file's ```bash blocks, continuation lines joined, `&&`
    chains split, comments dropped."""
    out, block, lines = [], False, path.read_text(encoding="utf-8").splitlines()
    joined: list[str] = []
    for line in lines:
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line.strip())
    for line in joined:
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words[:1] == ["memtree"]:
                out.append(shlex.join(words))
    return out


# How each README command is exercised: "run" whole; "config": up to its validated config
# (value: the module and function that would run it); "parse": inputs from `make demo` or an
# earlier line; "alternatives": a line listing several subcommands (`info|verify|…`).
MODES = {
    "memtree pipeline run --input corpus.jsonl --out runs/mine --levels 4 --branching 16": (
        "config",
        "memtree.pipeline.run",
        "run_pipeline",
    ),
    (
        "memtree pipeline run pipeline/yamls/paper.yaml "
        "'ingest.inputs=[data/*.jsonl]' out=runs/paper"
    ): (
        "config",
        "memtree.pipeline.run",
        "run_pipeline",
    ),
    "memtree memstore plan --anchor openlm-160m --memory 256,64,16,0 --type ffn": ("run",),
    "memtree memstore plan --anchor smollm2-135m --memory 0,96,160 --branching 4": ("run",),
    (
        "memtree memstore init runs/bank --anchor tiny --memory 64,32,16 "
        "--tree runs/mine/tree --dtype int8"
    ): ("parse",),
    "memtree memstore 'info|verify|fetch|block|unblock|delete|split|merge' '…'": ("alternatives",),
    "memtree memstore simulate-fetch --profile phone --anchor openlm-160m --memory 256,64,16,0": (
        "run",
    ),
    "memtree train run training/yamls/tiny-baseline.yaml data.shards=runs/mine/shards": (
        "config",
        "memtree.training.train",
        "run_once",
    ),
    "memtree train run training/yamls/tiny-cotrain.yaml data.shards=runs/mine/shards": (
        "config",
        "memtree.training.train",
        "run_once",
    ),
    "memtree eval knowledge runs/demo/train/cotrain --block-domains astronomy": ("parse",),
    (
        "memtree eval knowledge runs/demo/train/cotrain "
        "--block-documents ids.txt --owner-field entity"
    ): ("parse",),
    "memtree generate runs/demo/train/cotrain --prompt 'The birthplace of Ilsa Varn is'": (
        "parse",
    ),
    "memtree eval tasks eval/yamls/suite-example.yaml runs/demo/train/cotrain": ("parse",),
    "memtree eval memories runs/demo --rows dense-1x,moc": ("parse",),
    "memtree pipeline docs-corpus runs/pydocs-short/corpus --max-chars 4000": ("run",),
    "memtree pipeline run pipeline/yamls/pydocs-short.yaml": (
        "config",
        "memtree.pipeline.run",
        "run_pipeline",
    ),
    (
        "memtree eval realtext runs/pydocs-short "
        "--config eval/yamls/realtext-pydocs.yaml --recipes demo,mlr1e-3"
    ): (
        "config",
        "memtree.eval.realtext",
        "run_realtext",
    ),
    "memtree eval realtext runs/realdocs": ("config", "memtree.eval.realtext", "run_realtext"),
}


def test_every_readme_command_is_classified():
    cmds = readme_commands()
    assert len(cmds) >= 15, cmds
    missing = [c for c in cmds if c not in MODES]
    assert not missing, f"README commands this test does not know (add each to MODES): {missing}"
    stale = [c for c in MODES if c not in cmds]
    assert not stale, f"MODES lists commands the README no longer shows: {stale}"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A fresh working directory that sees the repository's YAMLs where the README's relative paths
    point, and writes its runs/ under tmp."""
    for stage in ("pipeline", "training", "eval"):
        (tmp_path / stage).symlink_to(REPO / stage, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("cmd", [c for c, m in MODES.items() if m[0] != "alternatives"])
def test_readme_command_parses(cmd):
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert callable(args.func)


@pytest.mark.parametrize("cmd", [c for c, m in MODES.items() if m[0] in ("run", "config")])
def test_readme_command_runs_as_typed(cmd, user_dir, monkeypatch, capsys):
    mode = MODES[cmd]
    seen = []
    if mode[0] == "config":
        import importlib

        module = importlib.import_module(mode[1])

        def record(cfg, *args, **kwargs):
            seen.append(cfg)
            return str(user_dir / "report.md")

        monkeypatch.setattr(module, mode[2], record)
        (user_dir / "report.md").write_text("stand-in report\n")
    assert main(shlex.split(cmd)[1:]) == 0
    out = capsys.readouterr().out
    if mode[0] == "config":
        assert len(seen) == 1, cmd
        cfg = seen[0]
        if "--recipes" in cmd:
            names = shlex.split(cmd)[shlex.split(cmd).index("--recipes") + 1].split(",")
            assert [r.name for r in cfg.selected()] == names
        if "data.shards=" in cmd:
            assert cfg.data.shards == "runs/mine/shards"
    elif "memstore plan" in cmd:
        assert "fetch" in out.lower(), out
    elif "docs-corpus" in cmd:
        assert (user_dir / "runs/pydocs-short/corpus/train.jsonl").is_file()
