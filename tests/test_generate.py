"""`memtree generate` and `Generator` on a real (tiny, briefly trained) run of the shared pipeline
run: routing as the pipeline routed, fetching through memstore's tiers, decoding with a KV cache
that equals full forwards, seeded sampling, blocking honoured, session caches counted, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from memtree.cli import main
from memtree.clustering.route import route_texts
from memtree.memstore.journal import audit_log
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.training.generate.generator import Generator
from memtree.training.model import assemble_memories
from tests.conftest import train_tiny_run

PROMPT = "The river delta of the northern valley is known for"


@pytest.fixture(scope="module")
def run_dir(pipeline_run, tmp_path_factory):
    return train_tiny_run(
        pipeline_run[0] / "shards",
        tmp_path_factory.mktemp("genrun") / "run",
        "data.batch_size=4",
        "max_duration=4ba",
        "memory.multipliers=[16,8]",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
    )


@pytest.fixture(scope="module")
def gen(run_dir):
    g = Generator.from_run(run_dir)
    yield g
    g.close()


def _greedy_full_forward(model, ids, memories, n):
    """Greedy tokens by one full forward over the whole sequence per token: what the cache must
    equal."""
    out = list(ids)
    for _ in range(n):
        out.append(int(model(torch.tensor([out]), memories=memories)[0, -1].argmax()))
    return out[len(ids) :]


def test_the_prompt_is_routed_as_the_pipeline_routes_and_its_path_fetched(gen):
    g = gen.generate(PROMPT, max_new_tokens=8)
    assert g.path == route_texts(gen.tree, [PROMPT])[0].tolist()
    assert [f.level for f in g.fetches] == [1, 2]
    assert [f.cluster for f in g.fetches] == g.path[:2]
    assert all(f.tier == "ram" and f.source == "read" and f.block_bytes > 0 for f in g.fetches)
    t = g.timing
    for key in ("embed_s", "traverse_s", "fetch_s", "attach_s", "prefill_s", "ttft_s", "decode_s"):
        assert t[key] >= 0, key
    assert t["ttft_s"] >= t["prefill_s"] + t["fetch_s"]
    assert g.resident["fetched_bytes"] == sum(f.block_bytes for f in g.fetches)
    assert (
        0 < g.resident["kv_cache_bytes"] and g.resident["bank_bytes"] > g.resident["fetched_bytes"]
    )


@pytest.mark.parametrize("memory", ["fetched", "generic", "none"])
def test_cached_decoding_gives_the_tokens_of_full_forwards(gen, memory):
    g = gen.generate(PROMPT, max_new_tokens=12, memory=memory)
    if memory == "none":
        mems = None
    else:
        blocks = (
            gen.store.fetch_generic(flat=True)
            if memory == "generic"
            else gen.store.fetch(g.path, flat=True)
        )
        mems = assemble_memories(
            {lv: t[None] for lv, t in blocks.items()}, gen.model.config.anchor, gen.memory_config
        )
    with torch.no_grad():
        want = _greedy_full_forward(
            gen.model, gen.encode(PROMPT), mems, len(g.tokens) + (g.stop == "eot")
        )
    if g.stop == "eot":
        assert want[-1] == gen.eot_id
        want = want[:-1]
    assert g.tokens == want and g.text == gen.decode(want)


def test_memory_changes_the_logits_it_is_given(gen):
    """fetched, generic and no memory are three models: their first-token distributions differ."""
    ids = torch.tensor([gen.encode(PROMPT)])
    outs = []
    for memory in ("fetched", "generic"):
        blocks = (
            gen.store.fetch_generic(flat=True)
            if memory == "generic"
            else gen.store.fetch(route_texts(gen.tree, [PROMPT])[0], flat=True)
        )
        mems = assemble_memories(
            {lv: t[None] for lv, t in blocks.items()}, gen.model.config.anchor, gen.memory_config
        )
        with torch.no_grad():
            outs.append(gen.model(ids, memories=mems)[0, -1])
    with torch.no_grad():
        outs.append(gen.model(ids)[0, -1])
    assert (outs[0] - outs[1]).abs().max() > 1e-4 and (outs[0] - outs[2]).abs().max() > 1e-4


def test_the_same_seed_gives_the_same_tokens(gen):
    kw = {"max_new_tokens": 16, "temperature": 1.5, "top_p": 0.95}
    a = gen.generate(PROMPT, seed=3, **kw)
    assert gen.generate(PROMPT, seed=3, **kw).tokens == a.tokens
    others = [gen.generate(PROMPT, seed=s, **kw).tokens for s in (4, 5, 6)]
    assert any(o != a.tokens for o in others)
    # a tiny nucleus keeps only the most likely token: sampling is then greedy
    assert (
        gen.generate(PROMPT, seed=9, max_new_tokens=16, temperature=1.0, top_p=1e-6).tokens
        == gen.generate(PROMPT, max_new_tokens=16).tokens
    )


def _bank_copy(run_dir, tmp_path):
    """A copy of the run whose bank can be blocked without touching the module's run."""
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst, ignore=shutil.ignore_patterns("checkpoints"))
    return dst


@pytest.mark.parametrize("fallback", ["zeros", "generic"])
def test_a_blocked_block_is_never_read_and_generation_leaves_the_audit_log_alone(
    run_dir, tmp_path, fallback
):
    """The prompt's level-2 block is blocked and its bytes on disk overwritten: a read of it would
    fail its checksum (verify="always"), so generation succeeding proves it was never read. It is
    served as the policy says (zeros, or the generic block), and generation writes no audit
    entry."""
    from memtree.memstore.format import level_path

    run = _bank_copy(run_dir, tmp_path)
    g0 = Generator.from_run(run)
    path = g0.generate(PROMPT, max_new_tokens=4).path
    g0.close()
    with MemoryStore(run / "bank") as store:
        store.block(2, [path[1]], reason="test")
        store.set_fallback(fallback)
        lv = store.info.levels[2]
        where, at = level_path(store.root, lv), lv.slot(path[1]) * lv.stride
    with open(where, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * lv.record_bytes)
    log = audit_log(run / "bank")
    policy = (run / "bank" / "policy.json").read_bytes()
    g = Generator.from_run(run, verify="always")
    g.store.reset_stats()
    out = g.generate(PROMPT, max_new_tokens=6)
    l1, l2 = out.fetches
    assert l1.source == "read" and l2.source == "refused" and l2.cluster == path[1]
    assert g.store.stats()["refused_served"]["2"] == 1
    served = g.fetch(path, "fetched")[0][2][0]
    if fallback == "zeros":
        assert l2.bytes_read == 0 and not served.any()
    else:  # the generic block's bytes, once
        assert l2.bytes_read == lv.stride and torch.equal(
            served, g.store.fetch_generic(flat=True)[2]
        )
    g.close()
    assert audit_log(run / "bank") == log and (run / "bank" / "policy.json").read_bytes() == policy
    # the check sees a read: unblocked, the overwritten block fails its checksum
    with MemoryStore(run / "bank") as store:
        store.unblock(2, [path[1]], reason="test")
    g = Generator.from_run(run, verify="always")
    with pytest.raises(Exception, match="(?i)checksum|corrupt|digest"):
        g.generate(PROMPT, max_new_tokens=2)
    g.close()


def test_a_session_keeps_shallow_levels_in_the_cache_as_the_simulator_counts(run_dir, tmp_path):
    """Both levels on the flash tier with a session cache: the per-prompt hits equal an LRU over
    the trace of paths (the simulator's session model, memstore.sim), bytes fetched only on a
    miss."""
    from memtree.memstore.cache import ByteLRU

    prompts = [
        PROMPT,
        PROMPT + " its ancient bridges",
        "Quantum computing uses qubits to",
        PROMPT,
        "The violin sonata was composed in",
    ]
    tiers = [
        TierConfig(name="ram", kind="ram", capacity_bytes=0),
        TierConfig(name="flash", kind="flash", cache_bytes=1 << 30),
    ]
    g = Generator.from_run(run_dir, tiers=tiers)
    assert set(g.store.placement.values()) == {"flash"}
    outs = [g.generate(p, max_new_tokens=2) for p in prompts]
    lru = ByteLRU(1 << 30)
    for o in outs:
        for f in o.fetches:
            hit = lru.get((f.level, f.cluster)) is not None
            if not hit:
                lru.put((f.level, f.cluster), True, f.block_bytes)
            assert f.source == ("cache" if hit else "read"), (o.prompt, f)
            assert (f.bytes_read > 0) == (not hit)
    assert outs[3].fetches[0].source == "cache" and outs[3].fetches[1].source == "cache"
    assert g.store.stats()["caches"]["flash"]["hits"] == lru.hits
    g.close()


def test_the_command_prints_an_answer_and_its_timing(run_dir, tmp_path, capsys):
    assert main(["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    for word in (
        "answer (fetched memory",
        "path:",
        "route",
        "fetch L1",
        "fetch L2",
        "attach",
        "prefill",
        "first token after",
        "tokens/s",
        "resident anchor",
    ):
        assert word in out, (word, out)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in (PROMPT, PROMPT, "Another topic")) + "\n"
    )
    js = tmp_path / "g.json"
    assert (
        main(
            [
                "generate",
                str(run_dir),
                "--prompts",
                str(prompts),
                "--session",
                "--cache-bytes",
                str(1 << 30),
                "--ram-bytes",
                "0",
                "--max-new-tokens",
                "3",
                "--out",
                str(js),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "session: levels from the cache" in out
    doc = json.loads(js.read_text())
    gens = doc["generations"]
    assert len(gens) == 3 and [f["source"] for f in gens[1]["fetches"]] == ["cache", "cache"]
    assert doc["placement"] == {"1": "flash", "2": "flash"}
    assert (
        main(
            [
                "generate",
                str(run_dir),
                "--prompt",
                PROMPT,
                "--memory",
                "none",
                "--json",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    none = json.loads(capsys.readouterr().out)["generations"][0]
    assert none["fetches"] == [] and none["path"] is None and none["resident"]["fetched_bytes"] == 0


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["--prompt", "x", "--max-new-tokens", "0"],
            "--max-new-tokens: must be a positive integer",
        ),
        (["--prompt", "x", "--top-p", "0"], r"--top-p: must be in \(0, 1\]"),
        (["--prompt", "x", "--top-p", "1.5"], r"--top-p: must be in \(0, 1\]"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature: must be >= 0"),
        (["--prompt", "   "], "--prompt: the prompt is empty"),
        (["--prompt", "x", "--session"], "--session: needs --prompts"),
        (["--prompt", "x", "--gate", "3:1.5"], r"gate quantile: in \[0, 1\)"),
        (
            ["--prompt", "x", "--memory", "none", "--gate", "leaf:0.01"],
            "--gate: gates fetched memory",
        ),
    ],
)
def test_bad_arguments_are_named_before_anything_loads(argv, match, tmp_path, capsys):
    # the run folder does not even exist: the argument's error comes first
    assert main(["generate", str(tmp_path / "nowhere"), *argv]) == 1
    err = capsys.readouterr().err
    assert pytest.importorskip("re").search(match, err), err


def test_bad_runs_and_prompt_files_are_named(run_dir, pipeline_run, tmp_path, capsys):
    def fails(*argv):
        assert main(["generate", *argv]) == 1
        return capsys.readouterr().err

    assert "no such run folder" in fails(str(tmp_path / "nowhere"), "--prompt", "x")
    assert "not a training run folder" in fails(str(tmp_path), "--prompt", "x")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    assert f"--prompts {bad}, line 2" in fails(str(run_dir), "--prompts", str(bad))
    bad.write_text("not json\n")
    assert f"--prompts {bad}, line 1: not JSON" in fails(str(run_dir), "--prompts", str(bad))
    # a prompt longer than the context
    err = fails(str(run_dir), "--prompt", " ".join(["word"] * 3000))
    assert "leave no room to generate in the model's context of 512 tokens" in err
    # a run without a bank
    nobank = _bank_copy(run_dir, tmp_path)
    shutil.rmtree(nobank / "bank")
    assert "bank does not exist" in fails(str(nobank), "--prompt", "x")
    assert (
        main(
            [
                "generate",
                str(nobank),
                "--prompt",
                PROMPT,
                "--memory",
                "none",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    capsys.readouterr()
    # a bank built on another tree (its level-2 centroids moved): the store refuses it, naming both
    # ids
    from memtree.clustering.tree import compute_tree_id, load_tree
    from memtree.io import sha256_file

    other = tmp_path / "other" / "tree"
    shutil.copytree(pipeline_run[0] / "tree", other)
    shutil.copytree(
        pipeline_run[0] / "embed" / "embedder", tmp_path / "other" / "embed" / "embedder"
    )
    c = np.load(other / "centroids-l2.npy")
    np.save(other / "centroids-l2.npy", c + np.float32(1e-3))
    meta = json.loads((other / "tree.json").read_text())
    meta["files"]["centroids-l2.npy"] = sha256_file(other / "centroids-l2.npy")
    (other / "tree.json").write_text(json.dumps(meta))
    err = fails(str(run_dir), "--prompt", "x", "--tree", str(other))
    assert f"not tree {compute_tree_id(load_tree(other))}" in err, err


def test_routing_is_deterministic_across_generators(run_dir, gen):
    other = Generator.from_run(run_dir)
    p1, _ = gen.route(PROMPT)
    p2, _ = other.route(PROMPT)
    assert np.array_equal(p1, p2)
    other.close()


def test_the_export_answers_as_memtree_does(run_dir, gen, tmp_path, capsys):
    """`--export DIR`: the anchor with the prompt's blocks merged, loaded by transformers'
    AutoModelForCausalLM, gives memtree's logits (≤ 1e-4) and greedy tokens; so does the generic
    one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import memtree.training.generate.export  # noqa: F401  (registers the memtree_anchor architecture)

    for memory in ("fetched", "generic"):
        out = tmp_path / memory
        assert (
            main(
                [
                    "generate",
                    str(run_dir),
                    "--prompt",
                    PROMPT,
                    "--memory",
                    memory,
                    "--max-new-tokens",
                    "8",
                    "--export",
                    str(out),
                    "--json",
                ]
            )
            == 0
        )
        doc = json.loads(capsys.readouterr().out)
        assert doc["export"]["memory_merged"] and doc["export"]["memory"] == memory
        hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(out)
        ids = gen.encode(PROMPT)
        assert tok(PROMPT, add_special_tokens=False)["input_ids"] == ids
        blocks = (
            gen.store.fetch_generic(flat=True)
            if memory == "generic"
            else gen.store.fetch(doc["export"]["route_path"], flat=True)
        )
        mems = assemble_memories(
            {lv: t[None] for lv, t in blocks.items()}, gen.model.config.anchor, gen.memory_config
        )
        with torch.no_grad():
            want = gen.model(torch.tensor([ids]), memories=mems)
            got = hf(torch.tensor([ids])).logits
            assert (want - got).abs().max() <= 1e-4
            tokens = doc["generations"][0]["tokens"]
            hf_tokens = hf.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=len(tokens),
                eos_token_id=gen.eot_id,
                pad_token_id=gen.eot_id,
            )[0, len(ids) :].tolist()
        assert hf_tokens[: len(tokens)] == tokens
    assert (
        main(["generate", str(run_dir), "--prompt", PROMPT, "--export", str(tmp_path / "fetched")])
        == 1
    )
    assert "exists and is not empty" in capsys.readouterr().err


def test_a_session_is_held_against_the_simulator_on_a_hardware_profile(run_dir, tmp_path, capsys):
    """`--session --profile`: the same trace through memstore's simulator with the store's placement
    and cache budget; its cached levels equal the store's, prompt by prompt, and its bytes too.
    The profile is written here with the tier names `memtree memstore calibrate` writes (a
    calibration's timings on a loaded 2-core machine can fail its own fit; they are not what this
    test checks, and `tests/test_memstore_calibrate.py` holds the calibration)."""
    profile = tmp_path / "here.yaml"
    profile.write_text(
        "format: memtree-hw-profile\nversion: 1\nname: here\ntiers:\n"
        "  - {name: ram, bandwidth_gbps: 4.0, latency_us: 30, capacity_gb: 6}\n"
        "  - {name: flash, bandwidth_gbps: 1.4, latency_us: 200, capacity_gb: null}\n"
        "cache_gb: 0.5\ntensor_us: 1.7\n"
    )
    prompts = tmp_path / "p.jsonl"
    texts = [
        PROMPT,
        "Quantum computing uses qubits to",
        PROMPT + " in spring",
        PROMPT,
        "The violin sonata was composed in",
        "Quantum computing uses qubits to",
    ]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "s.json"
    assert (
        main(
            [
                "generate",
                str(run_dir),
                "--prompts",
                str(prompts),
                "--session",
                "--profile",
                str(profile),
                "--ram-bytes",
                "0",
                "--max-new-tokens",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "measured against predicted, per prompt" in printed and "equal per prompt" in printed
    sim = json.loads(out.read_text())["simulation"]
    gens = json.loads(out.read_text())["generations"]
    assert sim["hits_agree"] and sim["placement"] == {"1": "flash", "2": "flash"}
    for row, g in zip(sim["per_prompt"], gens, strict=True):
        assert row["cached_levels"] == row["predicted_cached_levels"]
        assert (
            row["bytes_fetched"]
            == row["predicted_bytes"]
            == sum(f["bytes_read"] for f in g["fetches"])
        )
        assert row["measured_s"] > 0 and row["predicted_s"] >= 0
    # the first prompt again: both levels cached
    assert sim["per_prompt"][3]["cached_levels"] == [1, 2]
    assert sim["hit_rate"]["measured"] == sim["hit_rate"]["predicted"] > 0
    assert main(["generate", str(run_dir), "--prompt", PROMPT, "--profile", str(profile)]) == 1
    assert "--profile: needs --session" in capsys.readouterr().err


def test_the_demo_answers_in_words_with_fetched_generic_and_blocked_memory(run_dir, tmp_path):
    """eval.answers: questions at a fixed stride, answered by the generator in three settings; the
    blocked subtree covers every memory level of the path, so its answer is the generic one; the
    bank on disk is untouched; the report gets its table, rates and PNG."""
    from memtree.eval.answers import answers_in_words
    from memtree.eval.knowledge import write_report
    from memtree.eval.longtail import build_probes
    from memtree.pipeline.corpus.topical import CorpusSpec, entity_facts

    probes = build_probes(
        entity_facts(CorpusSpec(n_docs=1200, seed=3, long_doc_fraction=0.01)), seed=0
    )
    for i, p in enumerate(probes):  # a few unseen facts beside the long tail
        p["exposures"] = 0 if i % 5 == 0 else p["exposures"]
    policy = (
        (run_dir / "bank" / "policy.json").read_bytes()
        if (run_dir / "bank" / "policy.json").exists()
        else None
    )
    a = answers_in_words(run_dir, probes, n_shown=3, n_scored=8, max_new_tokens=4)
    assert policy == (
        (run_dir / "bank" / "policy.json").read_bytes()
        if (run_dir / "bank" / "policy.json").exists()
        else None
    )
    assert len(a["shown"]) == 3 and len(a["rows"]["tail"]) == 8 and len(a["rows"]["unseen"]) == 8
    for row in a["rows"]["tail"] + a["rows"]["unseen"]:
        assert row["blocked"] == row["generic"] and row["blocked_level"] == 1
        assert row["fetched_correct"] == row["fetched"].strip().startswith(row["value"])
    assert all(1 <= r["exposures"] <= 7 for r in a["rows"]["tail"]) and all(
        r["exposures"] == 0 for r in a["rows"]["unseen"]
    )
    for kind in ("tail", "unseen"):
        for s in ("fetched", "generic", "blocked"):
            v = a["scored"][kind][s]
            assert v["n"] == 8 and v["rate"] == v["correct"] / 8
    files = write_report(tmp_path / "report", answers=a)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Answers in words" in text and a["shown"][0]["question"] in text
    assert (tmp_path / "report" / "answers.png").stat().st_size > 0 and "answers_png" in files
    assert (
        json.loads((tmp_path / "report" / "results.json").read_text())["answers"]["scored"]
        == a["scored"]
    )


def test_post_hoc_memories_on_a_hugging_face_anchor_generate_and_export(
    pipeline_run, tmp_path, capsys
):
    """A run with post-hoc FFN memories on a local (tiny, random) HF Llama: generation decodes with
    the HF model's own KV cache and the memories hooked in, giving the tokens of full forwards;
    the export is the same Llama with a wider FFN, whose logits equal the hooked model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=2048,
        )
    ).save_pretrained(hf_dir)
    run = train_tiny_run(
        pipeline_run[0] / "shards",
        tmp_path / "hf",
        "data.batch_size=4",
        "max_duration=3ba",
        "mode=frozen",
        f"model.hf_dir={hf_dir}",
        "memory.multipliers=[8,4]",
        "memory.lr=5e-1",
    )
    g = Generator.from_run(run)
    assert g.hf is not None
    out = g.generate(PROMPT, max_new_tokens=6)
    mems = g.attach(g.fetch(out.path, "fetched")[0])
    ids = g.encode(PROMPT)
    want = list(ids)
    with torch.no_grad():
        for _ in range(len(out.tokens)):
            want.append(int(g.hf(torch.tensor([want]), memories=mems).logits[0, -1].argmax()))
        assert out.tokens == want[len(ids) :]
        with_mem = g.hf(torch.tensor([ids]), memories=mems).logits
        assert (
            with_mem - g.model(torch.tensor([ids])).logits
        ).abs().max() > 1e-6  # the memory acts
    assert out.resident["kv_cache_bytes"] > 0
    # the anchor alone is the base model: no memory hooked in, not even the generic one (the HF
    # wrapper's own bank, which its hooks would fall back to, is made loud to show it)
    with torch.no_grad():
        for table in g.hf.bank.tables.values():
            table.normal_(std=1.0)
    alone = g.generate(PROMPT, max_new_tokens=4, memory="none")
    want = list(ids)
    with torch.no_grad():
        for _ in range(len(alone.tokens)):
            want.append(int(g.model(torch.tensor([want])).logits[0, -1].argmax()))
    assert alone.tokens == want[len(ids) :] and alone.fetches == []
    g.close()
    exported = tmp_path / "export"
    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "2",
                "--export",
                str(exported),
            ]
        )
        == 0
    )
    assert "LlamaForCausalLM" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    assert hf.config.intermediate_size > 64
    with torch.no_grad():
        assert (hf(torch.tensor([ids])).logits - with_mem).abs().max() <= 1e-4


def test_the_gate_answers_refused_prompts_with_the_anchor_alone_and_fetches_nothing(
    run_dir, tmp_path, capsys
):
    def answer(*extra: str) -> dict:
        argv = ["generate", str(run_dir), "--prompt", PROMPT, "--json", "--max-new-tokens", "6"]
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    alone, fetched = answer("--memory", "none"), answer()
    shut, wide = answer("--gate", "leaf:=1.0"), answer("--gate", "1:=-1.0")
    g = shut["generations"][0]
    assert g["admitted"] is False and g["fetches"] == [] and g["resident"]["fetched_bytes"] == 0
    assert g["tokens"] == alone["generations"][0]["tokens"]
    assert g["path"] == fetched["generations"][0]["path"]  # routed all the same
    assert shut["gate"]["threshold"] == 1.0 and shut["gate"]["level"] == 2
    w = wide["generations"][0]
    assert w["admitted"] is True and w["tokens"] == fetched["generations"][0]["tokens"]
    assert len(w["fetches"]) == 2 and -1.0 <= w["similarity"] <= 1.0
    # a quantile is calibrated on the pipeline's windows; the table says what the gate did
    assert main(["generate", str(run_dir), "--prompt", PROMPT, "--gate", "leaf:0.01"]) == 0
    out = capsys.readouterr().out
    assert "gate: similarity" in out and ("admitted" in out or "refused" in out), out
