"""Evaluation harness on a real (tiny, briefly trained) run from the shared pipeline run."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from memtree.eval.knowledge import blocking_eval, knowledge_eval, write_report
from memtree.eval.longtail import BUCKETS, accuracy_by_bucket, build_probes
from memtree.eval.model import RunModel
from memtree.eval.tasks import extract_integer, few_shot, multiple_choice, perplexity
from memtree.pipeline.corpus.topical import CorpusSpec, entity_facts
from tests.conftest import train_tiny_run

SPEC = CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01)  # the corpus of tests/conftest.py


@pytest.fixture(scope="module")
def run(pipeline_run, tmp_path_factory):
    return RunModel.load(
        train_tiny_run(
            pipeline_run[0] / "shards",
            tmp_path_factory.mktemp("evalrun") / "run",
            "data.batch_size=4",
            "max_duration=6ba",
            "memory.multipliers=[16,8]",
            "memory.lr=3e-2",
            "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        )
    )


@pytest.fixture(scope="module")
def probes():
    return build_probes(entity_facts(SPEC), seed=0)[::40]  # ~49 probes spread over all 16 domains


def test_probes_are_deterministic_and_well_formed():
    facts = entity_facts(SPEC)
    a, b = build_probes(facts, seed=1), build_probes(facts, seed=1)
    assert a == b and a != build_probes(facts, seed=2)
    for p in a[:50]:
        assert len(p["choices"]) == 4 and len(set(p["choices"])) == 4
        assert p["context"].startswith("The ") and p["context"].endswith(" is")
    # bucket counts add up and follow the facts' own mention counts
    rows = accuracy_by_bucket(a, [p["gold"] for p in a])
    assert sum(r["n"] for r in rows) == len(a)
    assert all(r["accuracy"] in (None, 1.0) for r in rows)
    lo, hi = BUCKETS[0]
    assert rows[0]["n"] == sum(lo <= p["mentions"] < hi for p in a)


def test_bios_probes_draw_distractors_from_the_value_set_and_count_exposures():
    from memtree.pipeline.corpus.bios import BiosSpec, bios_facts

    facts = bios_facts(BiosSpec(seed=2, entities_per_subtopic=3, head_docs=4))
    probes = build_probes(facts, seed=0, epochs=3)
    assert probes == build_probes(facts, seed=0, epochs=3)
    assert len(probes) == len(facts)  # every attribute has ≥ 4 values: no fact is dropped
    for p, f in zip(probes, facts, strict=True):
        assert set(p["choices"]) <= set(f["values"]) and p["choices"][p["gold"]] == f["value"]
        assert p["exposures"] == 3 * f["mentions"]
        assert p["context"] == f"The {f['label']} of {f['reference']} is"
    rows = accuracy_by_bucket(probes, [p["gold"] for p in probes])
    assert {r["bucket"] for r in rows if r["n"]} >= {"0", "2-3"}
    assert all(r["ci95"] is None or r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] for r in rows)


def test_balanced_unseen_probes_put_a_count_led_scorer_at_chance():
    """balance_unseen redraws only the never-stated facts' choices, from the fact's value set,
    spreading the gold's rank by corpus statement count evenly: a scorer that picks the most-stated
    choice (ties at random) is at chance on them, and the seen probes stay exactly as drawn."""
    from collections import Counter

    from memtree.eval.longtail import value_counts
    from memtree.pipeline.corpus.bios import BiosSpec, bios_facts

    for corpus_seed in (0, 3):
        facts = bios_facts(BiosSpec(seed=corpus_seed))
        counts = value_counts(facts)
        plain = build_probes(facts, seed=corpus_seed, epochs=7)
        balanced = build_probes(facts, seed=corpus_seed, epochs=7, balance_unseen=True)
        assert balanced == build_probes(facts, seed=corpus_seed, epochs=7, balance_unseen=True)
        assert len(balanced) == len(plain)
        unseen = []
        for a, b, f in zip(plain, balanced, facts, strict=True):
            if f["mentions"]:
                assert a == b
                continue
            unseen.append(b)
            assert len(set(b["choices"])) == 4 and set(b["choices"]) <= set(f["values"])
            assert b["choices"][b["gold"]] == f["value"]
            c = counts[f["attribute"]]
            more = sum(c[v] > c[f["value"]] for v in b["choices"])
            assert more == b["prior_rank"]  # no value stated as often as the gold is needed here
        assert len(unseen) > 400
        ranks = Counter(p["prior_rank"] for p in unseen)
        assert max(ranks.values()) - min(ranks[r] for r in range(4)) <= 2
        # the count-led scorer's expected accuracy: 1 / (choices tied at the top) when the gold is
        # among them
        expected = 0.0
        for p in unseen:
            c = [counts[p["attribute"]][v] for v in p["choices"]]
            expected += (c[p["gold"]] == max(c)) / c.count(max(c))
        assert abs(expected / len(unseen) - 0.25) < 0.01


def test_scorer_is_at_chance_without_knowledge(run):
    """No knowledge of the facts (random weights, and a model never trained on them): chance."""
    import dataclasses

    from memtree.pipeline.corpus.bios import BiosSpec, bios_facts
    from memtree.training.train import build_model

    probes = build_probes(bios_facts(BiosSpec(seed=4)), seed=0)[::2]  # 1,536 probes
    torch.manual_seed(0)
    fresh = build_model(run.config)[0].model.eval()  # freshly initialised anchor and bank
    chance, se = 0.25, (0.25 * 0.75 / len(probes)) ** 0.5
    for rm in (dataclasses.replace(run, model=fresh), run):
        for mode in ("none", "generic", "fetched"):
            acc = multiple_choice(rm, probes, mode=mode, batch_size=256)["accuracy"]
            assert abs(acc - chance) < 4 * se, (mode, acc)


def test_fetched_retrieval_is_the_traversal_of_the_question_text(run, probes):
    from memtree.clustering.route import route_texts

    k = knowledge_eval(run, probes[:12], modes=("fetched",))
    assert k["paths"] == route_texts(run.tree, [p["context"] for p in probes[:12]]).tolist()


def test_retrieval_uses_the_training_path_for_identical_text(run, pipeline_run):
    out = pipeline_run[0]  # window part 0 and assign part 0 list the same windows in the same order
    texts = pq.read_table(out / "window" / "part-00000.parquet", columns=["text"])[
        "text"
    ].to_pylist()[:12]
    want = pq.read_table(out / "assign" / "part-00000.parquet", columns=["path"])[
        "path"
    ].to_pylist()[:12]
    assert run.route(texts).tolist() == want


def test_multiple_choice_and_perplexity_match_direct_computation(run, probes):
    items = probes[:6]
    paths = run.route([p["context"] for p in items])
    res = multiple_choice(run, items, mode="fetched", paths=paths)
    for i, it in enumerate(items):
        ctx = run.encode(it["context"])
        mems = run.memories(paths[i : i + 1], 1, "fetched")
        scores = []
        for ch in it["choices"]:
            cont = run.encode(" " + ch)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                lp = F.log_softmax(run.model(ids, memories=mems)[0, :-1].float(), -1)
            scores.append(
                float(lp[torch.arange(len(ctx) - 1, ids.shape[1] - 1), ids[0, len(ctx) :]].sum())
            )
        assert res["predictions"][i] == int(np.argmax(scores))
    docs = [{"text": "the star is bright and the telescope is old"}]
    ids = torch.tensor([run.encode(docs[0]["text"])])
    with torch.no_grad():
        lp = F.log_softmax(run.model(ids)[0, :-1].float(), -1)
    nll = -float(lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].mean())
    assert perplexity(run, docs, mode="none")["nll"] == pytest.approx(nll, rel=1e-5)


def test_choice_scores_in_one_row_equal_the_separate_sequences(run, probes):
    """Multiple choice scores an item's choices in one row behind the shared question; every score
    is the separate sequence's, in each memory mode, on ragged items (a one-token question, a
    one-token choice), and pack=False computes the same."""
    items = probes[:7]
    paths = run.route([p["context"] for p in items])
    batch = [
        (run.encode(it["context"]), [run.encode(" " + ch) for ch in it["choices"]]) for it in items
    ]
    batch[0] = (batch[0][0][:1], batch[0][1])
    batch[1] = (batch[1][0], [batch[1][1][0][:1], *batch[1][1][1:]])
    assert max(len(c) for _, choices in batch for c in choices) > 2
    for mode in ("none", "generic", "fetched"):
        packed = run.choice_scores(batch, paths=paths, mode=mode)
        apart = run.choice_scores(batch, paths=paths, mode=mode, pack=False)
        for i, (prefix, choices) in enumerate(batch):
            mems = run.memories(paths[i : i + 1], 1, mode)
            for k, c in enumerate(choices):
                ids = torch.tensor([prefix + c])
                with torch.no_grad():
                    lp = F.log_softmax(run.model(ids, memories=mems)[0, :-1].float(), -1)
                direct = float(
                    lp[torch.arange(len(prefix) - 1, ids.shape[1] - 1), ids[0, len(prefix) :]].sum()
                )
                assert packed[i][k] == pytest.approx(direct, abs=1e-4), (mode, i, k)
                assert apart[i][k] == pytest.approx(direct, abs=1e-4), (mode, i, k)


def test_greedy_decoding_matches_the_argmax_of_full_forwards(run, probes):
    """Generation's greedy decoding (head on the last position only) picks what the full forward's
    last logits pick, token by token, with fetched memory; the stop token ends it."""
    paths = run.route([probes[0]["context"]])
    prompt = run.encode(probes[0]["context"])
    got = run.greedy(prompt, max_new_tokens=6, paths=paths, mode="fetched")
    mems, out = run.memories(paths, 1, "fetched"), list(prompt)
    for _ in range(6):
        with torch.no_grad():
            out.append(int(run.model(torch.tensor([out]), memories=mems)[0, -1].argmax()))
    assert got == out[len(prompt) :]
    assert (
        run.greedy(prompt, max_new_tokens=6, paths=paths, mode="fetched", stop=got[2])
        == got[: got.index(got[2])]
    )


def test_extraction_and_few_shot_routing():
    assert extract_integer("it is 5,812 kelvin") == "5812"
    assert extract_integer("no digits") is None
    assert extract_integer("-40 degrees") == "-40"
    items = few_shot(
        [{"context": "Q2", "choices": ["a", "b"], "gold": 1}],
        [{"context": "Q1", "choices": ["x", "y"], "gold": 0}],
    )
    assert items[0]["context"] == "Q1 x\nQ2" and items[0]["query"] == "Q2"  # retrieval sees only Q2


def test_memory_settings_and_report(run, probes, tmp_path):
    held_out = [{"text": f"{p['context']} {p['choices'][p['gold']]}."} for p in probes[::6]]
    k = knowledge_eval(run, probes, held_out)
    assert set(k["modes"]) == {"none", "generic", "fetched"}
    for row in k["modes"].values():
        assert 0 <= row["accuracy"] <= 1 and row["perplexity"] > 1
    # trained memories change the scores: fetched and anchor-only differ somewhere
    assert k["modes"]["fetched"]["perplexity"] != k["modes"]["none"]["perplexity"]
    domains = sorted({p["domain"] for p in probes})
    b = blocking_eval(run, probes, target_domains=domains[:1])
    adv = b["settings"]["adversarial"]
    # one level-1 subtree of a branching-8 bank
    assert adv["bank_fraction_blocked"] == pytest.approx(1 / 8)
    # probes routed elsewhere never see the blocked part
    assert adv["other_predictions_changed"] == 0
    files = write_report(tmp_path / "report", knowledge=k, blocking=b, meta={"run": "test"})
    for key in ("json", "markdown", "accuracy_vs_frequency_png", "blocking_png"):
        assert (tmp_path / "report").joinpath(files[key].rsplit("/", 1)[-1]).stat().st_size > 0
    data = json.loads((tmp_path / "report" / "results.json").read_text())
    assert data["blocking"]["settings"]["random"]["bank_fraction_blocked"] == pytest.approx(1 / 8)
    # the bank on disk is untouched by the experiment
    assert not (run.store.root / "policy.json").exists()


@pytest.fixture(scope="module")
def learned(pipeline_run, tmp_path_factory):
    """A run whose memories have learned something: 40 batches, the bank at a high LR (~5 s)."""
    return RunModel.load(
        train_tiny_run(
            pipeline_run[0] / "shards",
            tmp_path_factory.mktemp("evalrun") / "learned",
            "data.batch_size=4",
            "max_duration=40ba",
            "memory.multipliers=[16,8]",
            "optim.lr=1e-2",
            "memory.lr=3e-1",
            "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        )
    )


def test_fetched_blocks_beat_the_generic_block_and_the_anchor_alone_on_the_facts(learned):
    """The direction the memory settings exist for, on the corpus's facts stated in ≥ 4 training
    documents: the fetched blocks' NLL is below the generic block's and the anchor alone's, and
    below the same blocks fetched for another fact's route (shuffled paths), so it is the routed
    blocks that help, not any block. Measured (seeds 0 / 1 / 2): fetched 6.431 / 6.504 / 6.449,
    generic 6.534 / 6.537 / 6.500, anchor 6.726 / 6.649 / 6.595, shuffled 6.498 / 6.549 / 6.484.
    On an AVX2-only AMD EPYC VM (2026-12-05; another tree and other rounding): fetched 6.538,
    shuffled 6.579, anchor 6.667, generic 6.710 — the generic block of this 3-batch run does not
    beat the anchor alone there, so only the fetched blocks' margins are held."""
    seen = [p for p in build_probes(entity_facts(SPEC), seed=0) if p["mentions"] >= 4][:200]
    docs = [{"text": f"{p['context']} {p['choices'][p['gold']]}."} for p in seen]
    paths = learned.route([d["text"] for d in docs])
    nll = {
        m: perplexity(learned, docs, mode=m, paths=paths)["nll"]
        for m in ("none", "generic", "fetched")
    }
    shuffled = paths[np.random.default_rng(0).permutation(len(paths))]
    nll["shuffled"] = perplexity(learned, docs, mode="fetched", paths=shuffled)["nll"]
    assert nll["fetched"] < nll["generic"] and nll["fetched"] < nll["none"] - 0.05, nll
    assert nll["fetched"] < nll["shuffled"] - 0.02, nll


def test_blocking_changes_scores_only_under_the_blocked_subtree(run, probes):
    paths = run.route([p["context"] for p in probes])
    seqs = [run.encode(p["context"] + " " + p["choices"][0]) for p in probes]
    before = run.logprobs(seqs, paths=paths, mode="fetched")

    def trained(c: int) -> bool:  # a block the short run updated (W3 left its zero init)
        w3 = run.store.codec(1).unflatten(run.store.fetch_flat(1, c))["layers.0.w3"]
        return bool(w3.abs().sum() > 0)

    target = next(int(c) for c in np.unique(paths[:, 0]) if trained(int(c)))
    run.store.block(1, [target], subtree=True, persist=False)
    try:
        after = run.logprobs(seqs, paths=paths, mode="fetched")
    finally:
        run.store.unblock(1, [target], subtree=True, persist=False)
    for i in range(len(probes)):
        same = torch.equal(before[i], after[i])
        assert same == (int(paths[i, 0]) != target), i


def test_eval_cli_writes_the_report(run, tmp_path):
    from memtree.cli import main
    from memtree.pipeline.corpus.topical import write_facts_jsonl

    facts = tmp_path / "facts.jsonl"
    assert write_facts_jsonl(facts, SPEC) == len(entity_facts(SPEC))
    out = tmp_path / "report"
    folder = run.store.root.parent
    assert (
        main(
            [
                "eval",
                "knowledge",
                str(folder),
                "--facts",
                str(facts),
                "--max-probes",
                "16",
                "--block-domains",
                "astronomy,cooking",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())
    assert data["knowledge"]["n_probes"] == 16
    assert (out / "accuracy_vs_frequency.png").stat().st_size > 0


def test_main_job_end_to_end_on_a_tiny_configuration(tmp_path, capsys):
    """`memtree demo` on a small corpus: corpus → pipeline → anchor → co-training → evaluation
    report."""
    from memtree.cli import main

    root = tmp_path / "demo"
    argv = [
        "demo",
        "--root",
        str(root),
        "--corpus",
        "entities_per_subtopic=2",
        "--corpus",
        "head_docs=3",
        "--anchor-duration",
        "2ba",
        "--cotrain-duration",
        "1ep",
        "--max-probes",
        "48",
        "--train",
        "memory.multipliers=[0,8]",
        "--train",
        "data.batch_size=4",
        "--train",
        "model.shape={n_layers: 1, d_model: 32, n_heads: 1, head_dim: 32, ffn_dim: 64}",
        "tree.levels=2",
        "tree.branching=4",
        "window.vocab_size=1000",
        "window.train_sample_docs=300",
        "progress=false",
    ]
    assert main(argv) == 0
    data = json.loads((root / "report" / "results.json").read_text())
    assert set(data["knowledge"]["modes"]) == {"none", "generic", "fetched", "rag", "rag+fetched"}
    assert data["knowledge"]["n_choices"] == 4 and data["knowledge"]["n_probes"] == 48
    # exposures = documents stating the fact × epochs: 2 batches of 4 samples + 1 epoch
    manifest = json.loads((root / "pipeline" / "shards" / "manifest.json").read_text())
    epochs = 8 / sum(s["n_samples"] for s in manifest["streams"]) + 1
    assert data["meta"]["epochs"] == pytest.approx(epochs)
    rows = data["knowledge"]["modes"]["fetched"]["by_bucket"]
    assert sum(r["n"] for r in rows) == 48 and rows[0]["bucket"] == "0" and rows[0]["n"] > 0
    b = data["blocking"]
    assert b["level"] == 2 and b["fallback"] == "generic"
    assert b["settings"]["adversarial"]["bank_fraction_blocked"] == pytest.approx(1 / 16)
    assert b["settings"]["random"]["clusters"] != b["settings"]["adversarial"]["clusters"]
    assert "perplexity" in data["knowledge"]["modes"]["none"]
    # forgetting by data owner: one long-tail entity's documents, then its whole subtopic's
    owners = data["forgetting"]
    assert [r["name"].split()[0] for r in owners] == ["entity", "subtopic"]
    corpus = [json.loads(line) for line in (root / "corpus.jsonl").read_text().splitlines()]
    for r, field in zip(owners, ("entity", "topic"), strict=True):
        ids = (
            root
            / "report"
            / f"forget-{field.replace('topic', 'subtopic')}-{r['owner_values'][0]}.txt"
        )
        assert set(ids.read_text().split()) == {
            c["id"] for c in corpus if c[field] == r["owner_values"][0]
        }
        assert (
            r["fallback"] == "generic"
            and r["bank_fraction"] > 0
            and r["held_out"]["owner"]["pages"] >= 0
        )
        assert r["random"]["bank_fraction"] == pytest.approx(r["bank_fraction"])
    report = (root / "report" / "report.md").read_text()
    assert "## Forgetting by data owner" in report and (root / "report" / "forgetting.png").exists()
    assert "Routing: share of probes" in report and "## Design" in report
    assert (root / "report" / "accuracy_vs_frequency.png").exists()
    assert (root / "train" / "cotrain" / "bank" / "manifest.json").exists()
    # a rerun resumes: nothing is trained again, the corpus is not rewritten
    trained = lambda: {
        s: (root / "train" / s / "metrics.json").stat().st_mtime_ns for s in ("anchor", "cotrain")
    }
    mtime, before = (root / "corpus.jsonl").stat().st_mtime_ns, trained()
    assert main([*argv, "--gate", "leaf:0.01"]) == 0  # the rerun adds the gated row (no training)
    assert (root / "corpus.jsonl").stat().st_mtime_ns == mtime and trained() == before
    gated = json.loads((root / "report" / "results.json").read_text())["knowledge"]
    assert gated["gate"]["quantile"] == 0.01 and gated["gate"]["windows"] > 0
    assert 0 < gated["gate"]["probes_admitted"] <= 48 and "gated" in gated["modes"]
    assert "Gated (`memtree.clustering.gate`)" in (root / "report" / "report.md").read_text()
    # a pipeline change that rebuilds the shards under the same root retrains both stages on them
    capsys.readouterr()
    assert main([*argv, "tree.restarts=2"]) == 0
    after = trained()
    assert all(after[s] != before[s] for s in before)
    assert capsys.readouterr().out.count("(upstream changed), retraining") == 2
    inputs = json.loads((root / "train" / "anchor" / "demo_inputs.json").read_text())["inputs"]
    assert (
        inputs["upstream"]
        == json.loads((root / "pipeline" / "shards" / "_stage.json").read_text())["fingerprint"]
    )
    # the memory stage on the frozen anchor (seed 002's row A3): the anchor run is reused, the
    # memory stage retrains in mode frozen (with the demo's memory settings: no dropout) and
    # leaves the anchor's weights exactly as the anchor stage wrote them
    from safetensors.torch import load_file

    from memtree.eval.demo import run_main_job

    assert main([*argv, "tree.restarts=2", "--memory-mode", "frozen"]) == 0
    out = capsys.readouterr().out
    assert (
        "anchor: already trained" in out
        and "cotrain: " in out
        and "(config changed), retraining" in out
    )
    cfg = json.loads((root / "train" / "cotrain" / "memtree_config.json").read_text())["config"]
    assert cfg["mode"] == "frozen" and cfg["memory"]["dropout"] == 0.0
    before, after = (
        load_file(root / "train" / s / "anchor.safetensors") for s in ("anchor", "cotrain")
    )
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="memory_mode: 'cotrain' or 'frozen', got 'both'"):
        run_main_job(root, memory_mode="both")
    # a different corpus under the same root is refused
    assert main([*argv[:3], "--corpus", "entities_per_subtopic=3", *argv[5:]]) == 1
    assert "holds a corpus" in capsys.readouterr().err


def test_gated_knowledge_takes_each_probe_from_its_setting(run, probes, tmp_path):
    """With a domain gate (memtree.clustering.gate), the "gated" row is fetched memory on the
    probes and documents the gate admits and the anchor alone on the rest, item for item."""
    import dataclasses

    from memtree.clustering.gate import GateSpec, calibrate, similarities
    from memtree.clustering.route import embed_like_tree

    held_out = [{"text": f"{p['context']} {p['choices'][p['gold']]}."} for p in probes[::6]]
    _, sims = similarities(run.tree, embed_like_tree(run.tree, [p["context"] for p in probes]))
    mid = float(np.median(sims[:, -1]))  # half the probes in, half out
    gated = dataclasses.replace(run, gate=calibrate(run.tree, GateSpec.parse(f"leaf:={mid}")))
    k = knowledge_eval(gated, probes, held_out)
    admit = sims[:, -1] >= mid
    assert k["gate"]["probes_admitted"] == int(admit.sum()) and 0 < admit.sum() < len(probes)
    none, fetched, g = (k["modes"][m]["predictions"] for m in ("none", "fetched", "gated"))
    assert g == [f if a else n for n, f, a in zip(none, fetched, admit.tolist())]
    assert none != fetched  # the memories change some answers here, so the check can fail
    # the whole gate shut: exactly the anchor alone, held-out perplexity included
    shut = dataclasses.replace(run, gate=calibrate(run.tree, GateSpec.parse("leaf:=1.0")))
    k = knowledge_eval(shut, probes, held_out)
    assert k["modes"]["gated"]["perplexity"] == pytest.approx(k["modes"]["none"]["perplexity"])
    assert k["modes"]["gated"]["predictions"] == k["modes"]["none"]["predictions"]
    assert k["gate"]["documents_admitted"] == 0 and k["gate"]["documents"] == len(held_out)
    write_report(tmp_path / "r", knowledge=k, meta={"run": "test"})
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| anchor + fetched memory, gated (anchor alone outside the tree's domain) |" in md
    assert f"probes 0 of {len(probes)}, held-out documents 0 of {len(held_out)}" in md
