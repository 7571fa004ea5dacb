"""Schema tasks and the task-suite runner (`memtree eval tasks`) on a tiny trained run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from memtree.config import ConfigError, load_config
from memtree.eval.model import RunModel
from memtree.eval.suite import SuiteConfig, TaskDataError, load_suite_config, load_task_items
from memtree.eval.tasks import few_shot, retrieval_query, schema
from tests.conftest import train_tiny_run, write_jsonl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(pipeline_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("suiterun") / "run"
    shape = "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 128}"
    return RunModel.load(
        train_tiny_run(
            pipeline_run[0] / "shards",
            folder,
            "data.batch_size=2",
            "max_duration=3ba",
            "memory.multipliers=[8,4]",
            shape,
        )
    )


def hand_score(rm: RunModel, option: str, continuation: str, path: np.ndarray) -> float:
    """Σ log p(continuation tokens | option tokens) straight from the model's logits."""
    ctx = rm.tokenizer.encode(option).ids
    cont = rm.tokenizer.encode(" " + continuation).ids
    ids = ctx + cont
    with torch.no_grad():
        logits = rm.model(torch.tensor([ids]), memories=rm.memories(path[None], 1, "fetched"))[
            0
        ].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(len(ctx), len(ids)))


def test_schema_scores_match_the_model_and_pick_the_likelier_option(run):
    soup = "a cook tasted the soup and the"
    raw = [
        (
            ["the star was bright so the telescope", "the star was bright so the astronomer"],
            "saw it clearly",
        ),
        ([f"{soup} salt", f"{soup} pepper", f"{soup} bread"], "was too strong"),
    ]
    prefixes = ["the star was bright so the", soup]
    paths = run.route(prefixes)
    hand = [[hand_score(run, o, c, paths[i]) for o in opts] for i, (opts, c) in enumerate(raw)]
    # gold: the likelier option for the first item, the least likely for the second → accuracy 1/2
    items = [
        {"context_options": raw[0][0], "continuation": raw[0][1], "gold": int(np.argmax(hand[0]))},
        {"context_options": raw[1][0], "continuation": raw[1][1], "gold": int(np.argmin(hand[1]))},
    ]
    assert len(set(hand[1])) == 3  # argmin and argmax differ, so the 1/2 below is informative
    res = schema(run, items, mode="fetched")
    for got, want in zip(res["scores"], hand, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert res["predictions"] == [int(np.argmax(h)) for h in hand]
    assert res["accuracy"] == 0.5 and res["accuracy_norm"] == 0.5  # one continuation: same ranking


def test_schema_routes_with_the_options_common_prefix(run):
    item = {
        "context_options": [
            "Maria lent Sarah her coat because Maria",
            "Maria lent Sarah her coat because Sarah",
        ],
        "continuation": "was cold.",
        "gold": 1,
    }
    prefix = "Maria lent Sarah her coat because"
    assert retrieval_query(item) == prefix
    routed = schema(run, [item], mode="fetched")
    given = schema(run, [item], mode="fetched", paths=run.route([prefix]))
    assert routed["scores"] == given["scores"]
    # a prefix ending inside a word stops at the last whole word; nothing shared → the continuation
    assert (
        retrieval_query({"context_options": ["the cat", "the car"], "continuation": "ran"}) == "the"
    )
    assert (
        retrieval_query({"context_options": ["Anna", "Maria"], "continuation": " was late."})
        == "was late."
    )
    # few-shot examples go in front of every option but not into the retrieval query
    shot = few_shot([item], [{**item, "gold": 0}])[0]
    assert (
        shot["context_options"][1]
        == "Maria lent Sarah her coat because Maria was cold.\n" + item["context_options"][1]
    )
    assert retrieval_query(shot) == prefix


def test_suite_on_a_trained_run_writes_table_1(run, tmp_path, monkeypatch):
    from memtree.cli import main

    monkeypatch.chdir(REPO)  # the example's task paths are relative to the repository root
    out = tmp_path / "suite"
    assert (
        main(
            [
                "eval",
                "tasks",
                "eval/yamls/suite-example.yaml",
                str(run.store.root.parent),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())
    assert data["modes"] == ["none", "generic", "fetched"]
    cfg = load_suite_config(REPO / "eval/yamls/suite-example.yaml")
    assert sorted(data["tasks"]) == sorted(t.name for t in cfg.tasks)  # results.json sorts its keys
    for g, info in data["groups"].items():
        names = [t.name for t in cfg.tasks if t.group == g and t.type != "perplexity"]
        assert info["tasks"] == names
        for m in data["modes"]:
            want = sum(data["tasks"][n]["modes"][m]["accuracy"] for n in names) / len(names)
            assert info["average"][m] == pytest.approx(want)
    for name, task in data["tasks"].items():
        for m in data["modes"]:
            value = task["modes"][m][task["metric"]]
            assert value > 1 if name == "encyclopedia-ppl" else 0 <= value <= 1
    assert (
        data["tasks"]["everyday-qa"]["n"] == 5
        and data["tasks"]["winograd-mini"]["type"] == "schema"
    )
    md = (out / "report.md").read_text().splitlines()
    assert "| task | type | n | anchor only | + generic | + fetched |" in md
    rows = [line.split(" | ")[0].lstrip("| ").strip() for line in md if line.startswith("| ")]
    common, specific = rows.index("**Common knowledge**"), rows.index("**Specific knowledge**")
    assert rows[common + 1 : specific] == [
        "everyday-qa",
        "winograd-mini",
        "**Avg common knowledge**",
    ]
    assert rows[specific + 1 :] == [
        "science-qa",
        "atomic-numbers",
        "encyclopedia-ppl",
        "**Avg specific knowledge**",
    ]
    avg_row = next(line for line in md if line.startswith("| **Avg common knowledge**"))
    assert f"**{100 * data['groups']['common']['average']['fetched']:.1f}**" in avg_row
    assert (out / "suite.png").stat().st_size > 0


def test_suite_config_rejects_unknown_keys_by_name():
    task = {"name": "a", "type": "schema", "path": "x.jsonl", "group": "common"}
    with pytest.raises(ConfigError, match=r"tasks\[0\]\.shots"):
        load_config(SuiteConfig, {"tasks": [{**task, "shots": 3}]})
    with pytest.raises(ConfigError, match="unknown config key batch"):
        load_config(SuiteConfig, {"tasks": [task], "batch": 2})
    with pytest.raises(ConfigError, match="group"):
        load_config(SuiteConfig, {"tasks": [{**task, "group": "rare"}]})
    with pytest.raises(ConfigError, match="'a' repeats"):
        load_config(SuiteConfig, {"tasks": [task, task]})


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
    good = {"context_options": ["a b", "a c"], "continuation": "d", "gold": 1}
    path = write_jsonl(tmp_path / "t.jsonl", [good, "", "{not json"])
    with pytest.raises(TaskDataError, match=rf"{path}:3: not valid JSON"):
        load_task_items(path, "schema")
    path = write_jsonl(tmp_path / "u.jsonl", [good, {**good, "gold": 2}])
    with pytest.raises(TaskDataError, match=rf"{path}:2: gold 2 is outside the 2 context_options"):
        load_task_items(path, "schema")
    path = write_jsonl(
        tmp_path / "v.jsonl", [{"context": "q", "choices": ["x"], "gold": 0}, {"context": "q"}]
    )
    with pytest.raises(TaskDataError, match=rf"{path}:2: missing key 'choices'"):
        load_task_items(path, "multiple_choice")
    assert load_task_items(write_jsonl(tmp_path / "w.jsonl", [good, "", good]), "schema") == [
        good,
        good,
    ]


def test_the_general_knowledge_suite_is_well_formed():
    # eval/yamls/suite-general.yaml: what a pretrained anchor knows before memories are added
    # (seed 002 Table 2's "nothing else is lost"); four distinct choices, the gold among them
    cfg = load_suite_config(REPO / "eval/yamls/suite-general.yaml")
    assert [(t.name, t.type) for t in cfg.tasks] == [
        ("general-qa", "multiple_choice"),
        ("english-ppl", "perplexity"),
    ]
    base = REPO / "eval" / "yamls"
    items = [
        json.loads(line) for line in (base / "tasks/general_mc.jsonl").read_text().splitlines()
    ]
    assert len(items) == 60 and len({it["context"] for it in items}) == 60
    for it in items:
        assert len(set(it["choices"])) == 4 and 0 <= it["gold"] < 4, it
    golds = [it["gold"] for it in items]
    # no position a model could learn to favour
    assert max(golds.count(g) for g in range(4)) < 0.5 * len(golds)
    texts = [
        json.loads(line)["text"]
        for line in (base / "tasks/general_text.jsonl").read_text().splitlines()
    ]
    assert len(texts) == 12 and all(40 <= len(t.split()) <= 80 for t in texts)
