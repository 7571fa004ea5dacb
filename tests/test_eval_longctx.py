"""`eval.camelot.longctx` and `memtree eval longctx`: CAMELoT's long-context perplexity on a tiny
frozen anchor — base and XL against plain forwards computed here, input-length buckets, skipped
empty documents, the window check, the report files, and the CLI on a hand-built tiny run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memtree.eval.camelot.longctx import (
    ABLATIONS,
    load_records,
    long_documents,
    longctx_eval,
    position_buckets,
    write_longctx_report,
)
from memtree.memstore.camelot.memory import CamelotConfig
from memtree.training.model import AnchorLM, ModelConfig
from tests.conftest import TINY_GQA_ANCHOR

ANCHOR = TINY_GQA_ANCHOR
L = 8
CFG = CamelotConfig(slots=16, threshold=0.9, search="exact")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> AnchorLM:
    torch.manual_seed(0)
    m = AnchorLM(ModelConfig(anchor=ANCHOR, max_seq_len=32))
    with torch.no_grad():  # non-trivial norm gains and biases
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def _doc(n: int, seed: int) -> list[int]:
    return torch.randint(
        0, ANCHOR.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def _plain_nll(model: AnchorLM, ids: list[int]) -> torch.Tensor:
    """Per-token NLL of one plain forward over `ids` (prediction at t of t + 1)."""
    x = torch.tensor(ids)
    with torch.no_grad():
        logits = model(x[None])[0].float()
    return F.cross_entropy(logits[:-1], x[1:], reduction="none").double()


def test_base_is_exp_mean_nll_of_plain_windows_and_empty_docs_are_skipped(model):
    docs = [_doc(21, 1), [], _doc(13, 2), [5]]
    res = longctx_eval(model, docs, methods=["base"], window=L, ablations=False)
    total, n = 0.0, 0
    for ids in (docs[0], docs[2]):
        for s in range(
            0, len(ids) - 1, L
        ):  # window s..s+L-1 predicts s+1..s+L (the last window: what is left)
            part = _plain_nll(model, ids[s : s + L + 1])[:L]
            total, n = total + float(part.sum()), n + part.numel()
    row = res["methods"]["base"]
    assert row["n_tokens"] == n == 20 + 12
    assert row["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-5)
    assert row["ratio_to_base"] == pytest.approx(1.0)
    assert res["docs"]["skipped_empty"] == 2 and res["docs"]["n_docs"] == 2
    # buckets by the position the prediction is made at: [0, L), [L, 2L), [2L, 4L)
    assert [(b["start"], b["end"]) for b in res["buckets"]] == [(0, 8), (8, 16), (16, 32)]
    assert [b["n_tokens"] for b in row["by_position"]] == [8 + 8, 8 + 4, 4]
    assert sum(b["sum_nll"] for b in row["by_position"]) == pytest.approx(row["sum_nll"])
    assert res["ablations"] == {}


def test_xl_second_window_equals_a_plain_forward_over_both_windows(model):
    ids = _doc(2 * L, 3)
    res = longctx_eval(model, [ids], methods=["base", "xl"], window=L, ablations=False)
    plain = _plain_nll(model, ids)  # one forward over 2L tokens: window 2 sees window 1 as context
    xl = res["methods"]["xl"]["by_position"]
    assert xl[1]["n_tokens"] == L - 1
    assert xl[1]["sum_nll"] == pytest.approx(float(plain[L:].sum()), rel=1e-5, abs=1e-5)
    # the first window has no cache: XL and base agree there
    base = res["methods"]["base"]["by_position"]
    assert xl[0]["sum_nll"] == pytest.approx(base[0]["sum_nll"], rel=1e-5)
    assert base[1]["sum_nll"] != pytest.approx(xl[1]["sum_nll"], rel=1e-4)  # the cache matters


def test_all_methods_ablations_and_report_files(model, tmp_path):
    docs = [_doc(40, 4), _doc(17, 5), []]
    res = longctx_eval(model, docs, window=L, cfg=CFG)
    assert list(res["methods"]) == ["base", "xl", "memorizing", "camelot"]
    assert list(res["ablations"]) == list(ABLATIONS.values())
    for name, row in {**res["methods"], **res["ablations"]}.items():
        assert row["n_tokens"] == 39 + 16, name
        assert row["ratio_to_base"] == pytest.approx(
            row["perplexity"] / res["methods"]["base"]["perplexity"]
        )
        assert math.isfinite(row["perplexity"])
    # every method sees the first window alone (no memory yet): same losses there
    first = {
        n: r["by_position"][0]["sum_nll"] for n, r in {**res["methods"], **res["ablations"]}.items()
    }
    assert all(v == pytest.approx(first["base"], rel=1e-5) for v in first.values())
    files = write_longctx_report(tmp_path / "rep", res, meta={"run": "tiny"})
    assert set(files) == {"json", "markdown", "png"} and all(
        Path(f).exists() for f in files.values()
    )
    data = json.loads(Path(files["json"]).read_text())
    assert set(data) == {"meta", "longctx"}
    lc = data["longctx"]
    assert {
        "window",
        "visibility",
        "camelot_config",
        "context",
        "docs",
        "buckets",
        "methods",
        "ablations",
    } <= set(lc)
    assert set(lc["docs"]) == {
        "n_docs",
        "skipped_empty",
        "n_tokens",
        "min_tokens",
        "mean_tokens",
        "max_tokens",
    }
    assert {"perplexity", "sum_nll", "n_tokens", "seconds", "ratio_to_base", "by_position"} <= set(
        lc["methods"]["camelot"]
    )
    assert "ratio_to_camelot" in lc["ablations"]["camelot-no-retrieval"]
    assert lc["camelot_config"]["slots"] == 16
    md = Path(files["markdown"]).read_text()
    assert "CAMELoT" in md and "0-8" in md and "skipped" in md
    assert Path(files["png"]).read_bytes()[:4] == b"\x89PNG"


def test_window_longer_than_the_context_is_an_error_naming_window(model):
    with pytest.raises(ValueError, match=r"window=33"):
        longctx_eval(model, [_doc(40, 6)], methods=["base"], window=33)
    with pytest.raises(
        ValueError, match=r"window=17.*2·window"
    ):  # memory methods need 2L positions
        longctx_eval(model, [_doc(40, 6)], methods=["base", "camelot"], window=17)
    # base alone: L fits
    longctx_eval(model, [_doc(40, 6)], methods=["base"], window=32, ablations=False)
    with pytest.raises(ValueError, match="methods"):
        longctx_eval(model, [_doc(40, 6)], methods=["rag"], window=L)
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        longctx_eval(model, [[], [3]], methods=["base"], window=L)


def test_long_documents_group_records_in_file_order():
    recs = [
        {"id": "a", "text": "x y", "topic": "t1"},
        {"id": "b", "text": "z", "topic": "t2"},
        {"id": "c", "text": "", "topic": "t1"},
        {"id": "d", "text": "w", "topic": "t1"},
        {"id": "e", "text": "v"},
        {"id": "f", "text": "", "topic": "t3"},
    ]
    enc = {"x": 1, "y": 2, "z": 3, "w": 4, "v": 5}
    keys, docs = long_documents(recs, lambda s: [enc[w] for w in s.split()], separator=0)
    assert keys == ["topic=t1", "topic=t2", "doc=e", "topic=t3"]
    assert docs == [[1, 2, 0, 4], [3], [5], []]
    _, alone = long_documents(
        recs, lambda s: [enc[w] for w in s.split()], group_by=None, max_docs=2
    )
    assert alone == [[1, 2], [3]]
    assert position_buckets(8, 7) == [(0, 8)] and position_buckets(8, 40)[-1] == (32, 64)


# -- CLI on a hand-built run folder (what RunModel.load reads: config, anchor weights, shards
# manifest and tokenizer) — training a real run would need the pipeline and take minutes.
WORDS = [
    "the",
    "red",
    "star",
    "is",
    "bright",
    "and",
    "old",
    "a",
    "cold",
    "moon",
    "of",
    "blue",
    "ice",
]


def _tiny_run(tmp: Path, model_seq_len: int = 32) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from memtree.config import to_dict
    from memtree.io import atomic_write_json
    from memtree.training.config import load_train_config
    from memtree.training.train import build_model

    shards = tmp / "pipe" / "shards"
    shards.mkdir(parents=True)
    tok = Tokenizer(
        models.WordLevel(
            {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", *WORDS])}, unk_token="[UNK]"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(shards / "tokenizer.json"))
    atomic_write_json(
        shards / "manifest.json",
        {
            "format": "memtree-shards",
            "version": 1,
            "tokenizer": "tokenizer.json",
            "eot_id": 0,
            "branching": 2,
            "levels": 1,
            "seq_len": model_seq_len,
            "tree_id": "t",
            "streams": [],
        },
    )
    run = tmp / "run"
    cfg = load_train_config(
        None,
        [
            f"data.shards={shards}",
            f"save_folder={run}",
            "mode=baseline",
            "model.shape={n_layers: 2, d_model: 32, n_heads: 2, head_dim: 16, ffn_dim: 64}",
        ],
    )
    torch.manual_seed(0)
    anchor = build_model(cfg)[0].model
    run.mkdir()
    atomic_write_json(
        run / "memtree_config.json", {"fingerprint": cfg.fingerprint(), "config": to_dict(cfg)}
    )
    save_file(
        {k: v.clone().contiguous() for k, v in anchor.state_dict().items()},
        str(run / "anchor.safetensors"),
    )
    (tmp / "heldout.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "id": "h0",
                    "topic": "stars",
                    "text": "the red star is bright and old the red star is bright",
                },
                {"id": "h1", "topic": "moons", "text": "a cold moon of blue ice"},
                {
                    "id": "h2",
                    "topic": "stars",
                    "text": "the old star is red and bright and the star is old",
                },
                {"id": "h3", "topic": "empty", "text": ""},
            ]
        )
    )
    return run


def test_cli_end_to_end_on_a_tiny_run(tmp_path, capsys):
    from memtree.cli import main

    run = _tiny_run(tmp_path)
    out = tmp_path / "lc"
    # default documents: heldout.jsonl beside the pipeline run (memtree demo's layout), grouped by
    # topic
    assert (
        main(["eval", "longctx", str(run), "--window", "8", "--slots", "8", "--out", str(out)]) == 0
    )
    data = json.loads((out / "results.json").read_text())
    lc = data["longctx"]
    assert lc["window"] == 8 and lc["camelot_config"]["slots"] == 8
    assert (
        set(lc["methods"]) == {"base", "xl", "memorizing", "camelot"} and len(lc["ablations"]) == 4
    )
    # stars: 12 + 1 (end-of-text) + 12 tokens; moons: 6; the empty topic is skipped
    assert (
        lc["docs"]["n_docs"] == 2
        and lc["docs"]["skipped_empty"] == 1
        and lc["docs"]["n_tokens"] == 31
    )
    assert data["meta"]["group_by"] == "topic"
    assert (out / "report.md").exists() and (out / "ppl_vs_length.png").exists()
    assert "report:" in capsys.readouterr().out
    # --docs, --method, --max-docs, --no-ablations, --group-by none
    docs = tmp_path / "d.jsonl"
    docs.write_text(
        json.dumps({"text": "the red star is bright and old"})
        + "\n"
        + json.dumps({"text": "a cold moon"})
        + "\n"
    )
    assert (
        main(
            [
                "eval",
                "longctx",
                str(run),
                "--method",
                "base,xl",
                "--window",
                "4",
                "--docs",
                str(docs),
                "--max-docs",
                "1",
                "--group-by",
                "none",
                "--no-ablations",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    lc = json.loads((out / "results.json").read_text())["longctx"]
    assert (
        set(lc["methods"]) == {"base", "xl"} and lc["ablations"] == {} and lc["docs"]["n_docs"] == 1
    )
    assert lc["visibility"] == "causal"
    # --visibility full reaches the hookup: the first window (nothing retrieved yet) is unchanged,
    # and later windows see every retrieved entry, so CAMELoT's loss there differs from the causal
    # run's
    base_args = [
        "eval",
        "longctx",
        str(run),
        "--method",
        "camelot",
        "--window",
        "4",
        "--docs",
        str(docs),
        "--group-by",
        "none",
        "--no-ablations",
        "--slots",
        "8",
    ]
    assert main([*base_args, "--out", str(tmp_path / "c")]) == 0
    assert main([*base_args, "--visibility", "full", "--out", str(tmp_path / "f")]) == 0
    causal, full = (
        json.loads((tmp_path / k / "results.json").read_text())["longctx"] for k in "cf"
    )
    assert full["visibility"] == "full"
    assert main([*base_args, "--layers", "1", "--out", str(tmp_path / "l")]) == 0
    assert json.loads((tmp_path / "l" / "results.json").read_text())["longctx"]["camelot_config"][
        "layers"
    ] == [1]
    cb, fb = causal["methods"]["camelot"]["by_position"], full["methods"]["camelot"]["by_position"]
    assert cb[0]["sum_nll"] == fb[0]["sum_nll"] and cb[1]["sum_nll"] != fb[1]["sum_nll"]
    # --sink reaches the hookup: the first window is the document's start either way, later ones
    # change
    assert main([*base_args, "--sink", "2", "--out", str(tmp_path / "s")]) == 0
    sunk = json.loads((tmp_path / "s" / "results.json").read_text())["longctx"]
    assert sunk["sink"] == 2 and causal["sink"] == 0
    assert (
        "attention sink: the document's first 2 tokens"
        in (tmp_path / "s" / "report.md").read_text()
    )
    sb = sunk["methods"]["camelot"]["by_position"]
    assert sb[0]["sum_nll"] == cb[0]["sum_nll"] and sb[1]["sum_nll"] != cb[1]["sum_nll"]
    # a window the model cannot hold: an error naming window
    assert main(["eval", "longctx", str(run), "--window", "20", "--out", str(out)]) != 0
    assert "window=20" in capsys.readouterr().err


def test_load_records_names_a_bad_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_records(p)
