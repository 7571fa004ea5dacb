"""A full disk in the middle of a write: the error names the path, the previous version stays
intact, and the rerun finishes the work (issue #19).

Each scenario runs in a child process on a real, size-limited file system: a tmpfs mounted in a
private user + mount namespace (`unshare -rm`, no root needed), filled with a filler file so the
next write hits ENOSPC part-way. Freeing the filler and running the same call again must then
produce what an undisturbed run produces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_work(),
    reason="needs unprivileged user + mount namespaces (unshare -rm) for a small tmpfs",
)

PRELUDE = f"""
import errno, json, os, shutil, sys
sys.path.insert(0, {str(REPO)!r})
os.environ["OMP_NUM_THREADS"] = "1"
MNT = sys.argv[1]

def fill(leave=0):
    '''Fill the tmpfs with a filler file, then free about `leave` bytes of it.'''
    path = os.path.join(MNT, "filler")
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    if leave:
        os.truncate(path, max(os.path.getsize(path) - leave, 0))

def unfill():
    os.unlink(os.path.join(MNT, "filler"))

def expect_full(fn, *names):
    '''fn() must fail with memtree's WriteFailed (ENOSPC) naming every string in `names`.'''
    from memtree.io import WriteFailed
    try:
        fn()
    except WriteFailed as e:
        assert e.errno == errno.ENOSPC, e
        for n in names:
            assert str(n) in str(e), (n, str(e))
        return str(e)
    raise AssertionError("the write did not fail")
"""


def run_on_tmpfs(
    tmp_path: Path, code: str, *args: str, size: str = "64m", timeout: int = 600
) -> dict:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = PRELUDE + textwrap.dedent(code)
    cmd = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"',
        str(mnt),
        sys.executable,
        "-c",
        script,
        str(mnt),
        *args,
    ]
    r = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


BANK_AND_TREE = """
import numpy as np, torch
from memtree.clustering.tree import Tree, load_tree, save_tree
from memtree.memstore.format import GENERIC, read_manifest, verify_bank
from memtree.memstore.writer import write_bank
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.memstore.store import MemoryStore, TierConfig

anchor = AnchorShape(name="t", n_layers=2, d_model=64, n_heads=2, head_dim=32, ffn_dim=128,
                     vocab_size=100)
mem = MemoryConfig(multipliers=(64, 32), branching=4)
def values(k):
    def blocks(level):
        n = 4 ** level
        for c in list(range(n)) + [GENERIC]:
            yield c, torch.full((mem.multipliers[level - 1] * 64 * 3 * 2,), float(k))
    return blocks
bank = os.path.join(MNT, "bank")
write_bank(bank, anchor=anchor, memory=mem, dtype="fp32", blocks=values(1))
out = {}

# 1. rewriting the whole bank: fails part-way through its level files
fill(leave=200_000)
out["bank_write"] = expect_full(lambda: write_bank(bank, anchor=anchor, memory=mem, dtype="fp32",
                                                   blocks=values(2)), bank)
verify_bank(bank)
with MemoryStore(bank) as st:
    assert float(st.fetch_flat(2, 7)[0]) == 1.0
# 2. an in-place edit: its journal cannot land, so nothing changes
fill()
with MemoryStore(bank, tiers=[TierConfig(name="flash", kind="flash")]) as st:
    p = st.codec(2).params
    out["bank_edit"] = expect_full(lambda: st.scatter(2, [3, 4], torch.full((2, p), 5.0)),
                                   "journal")
    assert float(st.fetch_flat(2, 3)[0]) == 1.0
assert read_manifest(bank).generation == 0
verify_bank(bank)
unfill()
# rerun both: they complete
write_bank(bank, anchor=anchor, memory=mem, dtype="fp32", blocks=values(2))
with MemoryStore(bank, tiers=[TierConfig(name="flash", kind="flash")]) as st:
    st.scatter(2, [3, 4], torch.full((2, st.codec(2).params), 5.0))
verify_bank(bank)
with MemoryStore(bank) as st:
    assert float(st.fetch_flat(2, 3)[0]) == 5.0 and float(st.fetch_flat(2, 7)[0]) == 2.0

# 3. a tree rewritten over an existing one
rng = np.random.default_rng(0)
def tree(seed):
    r = np.random.default_rng(seed)
    c = [r.standard_normal((8 ** l, 384)).astype(np.float32) for l in (1, 2, 3)]
    return Tree(levels=3, branching=8, dim=384, centroids=c,
                valid=[np.ones(8 ** l, bool) for l in (1, 2, 3)],
                sizes=[np.ones(8 ** l, np.int64) for l in (1, 2, 3)])
tdir = os.path.join(MNT, "tree")
save_tree(tree(0), tdir, config={}, embedder={})
fill(leave=300_000)
out["tree"] = expect_full(lambda: save_tree(tree(1), tdir, config={}, embedder={}), tdir)
t = load_tree(tdir)  # checksums verified: the old tree, whole
assert np.array_equal(t.centroids[2], tree(0).centroids[2])
unfill()
save_tree(tree(1), tdir, config={}, embedder={})
assert np.array_equal(load_tree(tdir).centroids[2], tree(1).centroids[2])
print(json.dumps(out))
"""


def test_full_disk_during_bank_and_tree_writes(tmp_path):
    out = run_on_tmpfs(tmp_path, BANK_AND_TREE)
    assert (
        "No space left on device" in out["bank_write"] and "previous version" in out["bank_write"]
    )
    assert "journal" in out["bank_edit"]


PIPELINE = """
from memtree.config import load_config
from memtree.pipeline.config import PipelineConfig
from memtree.pipeline.run import run_pipeline
src, corpus, overrides = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
run = os.path.join(MNT, "run")
shutil.copytree(src, run)
shutil.rmtree(os.path.join(run, "shards"))  # the shards stage (and the report after it) run again
before = {n: open(os.path.join(run, "tree", n), "rb").read()
          for n in sorted(os.listdir(os.path.join(run, "tree")))}
cfg = load_config(PipelineConfig, {"out": run, "ingest": {"inputs": [corpus]}},
                  overrides + ["dask.n_workers=1", "dask.threads_per_worker=1"])
fill(leave=64_000)
out = {"shards": expect_full(lambda: run_pipeline(cfg, log=lambda m: None), "shards")}
# a changed tree config on a full disk: the tree stage fails, the published tree stays whole
fill(leave=16_000)  # room for the run's config.json, not for the tree
cfg2 = load_config(PipelineConfig, {"out": run, "ingest": {"inputs": [corpus]}},
                   overrides + ["dask.n_workers=1", "dask.threads_per_worker=1", "tree.steps=9"])
out["tree"] = expect_full(lambda: run_pipeline(cfg2, log=lambda m: None), "tree")
after = {n: open(os.path.join(run, "tree", n), "rb").read()
         for n in sorted(os.listdir(os.path.join(run, "tree")))}
assert after == before
unfill()
logs = []
run_pipeline(cfg, log=logs.append)
out["skipped"] = sorted(m.split("]")[0][1:] for m in logs if "up to date" in m)
files = {}
for base, _, names in os.walk(os.path.join(run, "shards")):
    for n in names:
        if n.endswith((".mds", ".zstd", ".json")) and n != "_stage.json":
            rel = os.path.relpath(os.path.join(base, n), run)
            files[rel] = (open(os.path.join(base, n), "rb").read()
                          == open(os.path.join(src, rel), "rb").read())
out["files"] = files
print(json.dumps(out))
"""


def test_full_disk_during_pipeline_shards_and_tree(tmp_path, pipeline_run):
    from tests.conftest import PIPELINE_OVERRIDES

    run, _, _, corpus = pipeline_run
    out = run_on_tmpfs(
        tmp_path, PIPELINE, str(run), str(corpus), json.dumps(PIPELINE_OVERRIDES), size="256m"
    )
    assert "No space left on device" in out["shards"]
    assert set(out["skipped"]) >= {"ingest", "tokenizer", "window", "embed", "tree", "assign"}
    # byte-identical to the undisturbed run
    assert out["files"] and all(out["files"].values()), out["files"]


CHECKPOINT = """
import torch
from composer.core import Callback
from safetensors.torch import load_file
from streaming.base.util import clean_stale_shared_memory
from memtree.training.config import load_train_config
from memtree.training.train import train
shards, ref = sys.argv[2], sys.argv[3]

class FillAt(Callback):
    '''Fill the disk after batch 3 trains, so that batch 3's checkpoint write hits ENOSPC.'''
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == 3:
            fill(leave=100_000)

def cfg(folder):
    return load_train_config(None, [
        f"data.shards={shards}", f"save_folder={folder}", "data.batch_size=4",
        "optim.warmup=1ba", "max_duration=5ba", "save_interval=1ba",
        "save_num_checkpoints_to_keep=-1", "autoresume=true", "mode=scratch",
        "memory.multipliers=[8,4]", "memory.export_dtype=fp32",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}"])
folder = os.path.join(MNT, "run")
clean_stale_shared_memory()
train(cfg(ref))  # the undisturbed reference, in this process (same threads, so the same float sums)
clean_stale_shared_memory()
out = {"error": expect_full(lambda: train(cfg(folder), callbacks=[FillAt()]),
                            "checkpoints", "ep0-ba2")}
clean_stale_shared_memory()
unfill()
train(cfg(folder))  # resumes from batch 2, drops the unfinished batch-3 file
clean_stale_shared_memory()
a, b = (load_file(os.path.join(folder, "anchor.safetensors")),
        load_file(os.path.join(ref, "anchor.safetensors")))
out["anchor_equal"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
out["bank_equal"] = all(open(os.path.join(folder, "bank", n), "rb").read()
                        == open(os.path.join(ref, "bank", n), "rb").read()
                        for n in os.listdir(os.path.join(ref, "bank")) if n.endswith(".bin"))
print(json.dumps(out))
"""


def test_full_disk_during_a_checkpoint_write(tmp_path, pipeline_run):
    shards = pipeline_run[0] / "shards"
    out = run_on_tmpfs(tmp_path, CHECKPOINT, str(shards), str(tmp_path / "ref"), size="256m")
    assert "No space left on device" in out["error"]
    assert out["anchor_equal"] and out["bank_equal"], out
