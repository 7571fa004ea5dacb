"""One writer per bank, consistent readers, and blocking seen by running readers (issue #19).

Every test runs real processes against a real bank on disk: a second writer (the `memtree
memstore` CLI or a library call in another interpreter) while one holds the writer lock,
two writers racing on the policy and on the blocks, a reader gathering while a writer rewrites
every block, and a long-running reader while `memtree memstore block` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from memtree.geometry import AnchorShape, MemoryConfig
from memtree.memstore.format import GENERIC, BankError, read_manifest, verify_bank
from memtree.memstore.locking import BankBusy, bank_writer, holder, lock_paths
from memtree.memstore.store import MemoryStore, TierConfig, read_policy
from memtree.memstore.writer import write_bank

REPO = Path(__file__).resolve().parents[1]
TINY = AnchorShape(
    name="tiny", n_layers=2, d_model=16, n_heads=2, head_dim=8, ffn_dim=32, vocab_size=100
)
MEM = MemoryConfig(multipliers=(8, 4, 2), branching=4)
N_BLOCKS = {1: 4, 2: 16, 3: 64}
FLASH = [TierConfig(name="flash", kind="flash", cache_bytes=0)]
RAM = [TierConfig(name="ram", kind="ram")]

PRELUDE = f"""
import json, os, sys, time
sys.path.insert(0, {str(REPO)!r})
import torch
from memtree.memstore.format import GENERIC
from memtree.memstore.store import MemoryStore, TierConfig
"""


def make_bank(root: Path, value: float = 0.0) -> None:
    def blocks(level: int):
        for c in list(range(N_BLOCKS[level])) + [GENERIC]:
            yield c, torch.full((_params(level),), value)

    write_bank(root, anchor=TINY, memory=MEM, dtype="fp32", blocks=blocks)


def _params(level: int) -> int:
    return {1: 768, 2: 384, 3: 192}[level]  # 2 layers x 3 tensors x (w x 16), w = 8 / 4 / 2


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"child exited ({proc.returncode}) early:\n{proc.stdout.read().decode()}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


def finish(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    return text


def memstore_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memtree", "memstore", *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


HOLD = """
from memtree.memstore.locking import bank_writer
root, ready, release = sys.argv[1:4]
with bank_writer(root, operation="hold for the test"):
    open(ready, "w").close()
    while not os.path.exists(release):
        time.sleep(0.02)
"""


def test_second_writer_fails_naming_the_holder_then_waits_for_it(tmp_path):
    root = tmp_path / "bank"
    make_bank(root)
    ready, release = tmp_path / "ready", tmp_path / "release"
    holder_proc = spawn(HOLD, str(root), str(ready), str(release))
    try:
        wait_for(ready, holder_proc)
        assert holder(root)["pid"] == holder_proc.pid
        # a second process, as a user would run it: fails at once and names the holder
        r = memstore_cli("block", str(root), "--level", "1", "--clusters", "2")
        assert r.returncode != 0
        assert f"pid {holder_proc.pid}" in r.stderr and "hold for the test" in r.stderr, r.stderr
        assert read_policy(root)["blocked"] == {}  # nothing written
        # the library says the same
        with (
            MemoryStore(root, tiers=FLASH) as st,
            pytest.raises(BankBusy, match=f"pid {holder_proc.pid}"),
        ):
            st.delete(2, [5])
        # with --wait it waits for the holder, then writes
        waiter = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "memtree",
                "memstore",
                "block",
                str(root),
                "--level",
                "1",
                "--clusters",
                "2",
                "--wait",
                "60",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        time.sleep(1.0)
        assert waiter.poll() is None, waiter.stdout.read().decode()  # still waiting
        release.touch()
        finish(holder_proc)
        assert "level 1: 1" in finish(waiter)
    finally:
        release.touch()
        holder_proc.kill() if holder_proc.poll() is None else None
    assert read_policy(root)["blocked"] == {"1": [[2, 3]]}
    assert read_manifest(root).manifest.get("deleted") is None
    assert holder(root) is None  # released: the lock file names nobody


RACER = """
root, mode, first, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
while not os.path.exists(go):
    time.sleep(0.005)
for i in range(first, first + 8):
    with MemoryStore(root, tiers=[TierConfig(name="flash", kind="flash", cache_bytes=0)],
                     lock_wait=60) as st:
        if mode == "block":
            st.block(3, [i], reason=f"racer {first}")
        else:
            st.scatter(3, [i], torch.full((1, st.codec(3).params), float(i)))
"""


@pytest.mark.parametrize("mode", ["block", "scatter"])
def test_two_writers_lose_no_update(tmp_path, mode):
    """Without the writer lock each process rewrites the policy (or manifest) it read at open,
    and the other's concurrent changes are lost."""
    root = tmp_path / "bank"
    make_bank(root)
    go = tmp_path / "go"
    procs = [spawn(RACER, str(root), mode, str(first), str(go)) for first in (0, 32)]
    time.sleep(0.5)
    go.touch()
    for p in procs:
        finish(p)
    verify_bank(root)  # every record matches its digest: nothing torn
    ids = list(range(8)) + list(range(32, 40))
    if mode == "block":
        blocked = {i for a, b in read_policy(root)["blocked"]["3"] for i in range(a, b)}
        assert blocked == set(ids)
        audit = [json.loads(line) for line in (root / "audit.jsonl").read_text().splitlines()]
        assert len(audit) == 16
    else:
        assert read_manifest(root).generation == 16
        with MemoryStore(root, tiers=FLASH) as st:
            for i in ids:
                assert torch.equal(st.fetch_flat(3, i), torch.full((_params(3),), float(i)))
            assert torch.equal(st.fetch_flat(3, 8), torch.zeros(_params(3)))


REWRITER = """
root, ready, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with MemoryStore(root, tiers=[TierConfig(name="flash", kind="flash", cache_bytes=0)],
                 lock_wait=60) as st:
    open(ready, "w").close()
    for k in range(1, n + 1):
        for level in (1, 2, 3):  # one journaled commit per level: every block of the level at once
            ids = list(range(st.levels[level].info.n_blocks))
            st.scatter(level, ids, torch.full((len(ids), st.codec(level).params), float(k)))
"""

READER = """
root, ready, done, tier = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
tiers = [TierConfig(name="t", kind=tier, cache_bytes=0)]
paths = torch.tensor([[c // 16, c // 4, c] for c in range(64)])
seen, n = set(), 0
with MemoryStore(root, tiers=tiers, verify="always") as st:
    open(ready, "w").close()
    while not os.path.exists(done) or n < 3:
        out = st.gather(paths)
        for level in out:  # one commit rewrote the whole level: all its blocks carry one version
            values = {float(v) for v in out[level].unique()}
            if len(values) != 1:
                print(json.dumps({"level": level, "mixed": sorted(values)}))
                sys.exit(3)
            seen |= values
        n += 1
print(json.dumps({"gathers": n, "versions": sorted(seen)}))
"""


@pytest.mark.parametrize("tier", ["flash", "ram"])
def test_readers_see_the_old_bank_or_the_new_one_never_a_mix(tmp_path, tier):
    root = tmp_path / "bank"
    make_bank(root)
    ready_w, ready_r, done = tmp_path / "ready_w", tmp_path / "ready_r", tmp_path / "done"
    reader = spawn(READER, str(root), str(ready_r), str(done), tier)
    wait_for(ready_r, reader)
    writer = spawn(REWRITER, str(root), str(ready_w), "12")
    try:
        finish(writer)
    finally:
        done.touch()
    out = json.loads(finish(reader).strip().splitlines()[-1])
    # the reader ran across the writer's edits (several versions), and every gather was whole
    assert len(out["versions"]) >= 2, out
    verify_bank(root)


LONG_READER = """
root, ready, after, result = sys.argv[1:5]
path = [1, 5, 21]  # level-1 subtree 1
with MemoryStore(root, tiers=[TierConfig(name="flash", kind="flash", cache_bytes=0)]) as st:
    st.fetch(path)
    open(ready, "w").close()
    while not os.path.exists(after):
        st.fetch(path)  # fetching all along, as a serving process does
    st.reset_stats()
    outs = [st.fetch(path, flat=True) for _ in range(5)]
    s = st.stats()
    json.dump({"reads": s["tiers"]["flash"]["reads"], "refused": s["refused_served"],
               "zeros": all(float(o[lv].abs().sum()) == 0.0
                            for o in outs for lv in (1, 2, 3))}, open(result, "w"))
"""


def test_block_is_honoured_by_a_running_reader_at_its_next_fetch(tmp_path):
    root = tmp_path / "bank"
    make_bank(root, value=1.0)
    ready, after, result = tmp_path / "ready", tmp_path / "after", tmp_path / "result.json"
    reader = spawn(LONG_READER, str(root), str(ready), str(after), str(result))
    wait_for(ready, reader)
    r = memstore_cli(
        "block", str(root), "--level", "1", "--clusters", "1", "--subtree", "--reason", "test"
    )
    assert r.returncode == 0, r.stderr
    after.touch()  # the block command has returned
    finish(reader)
    out = json.loads(result.read_text())
    # every level of the path is refused, not one byte of it read: the tier counters show no reads
    assert out == {"reads": 0, "refused": {"1": 5, "2": 5, "3": 5}, "zeros": True}


def test_refresh_and_session_blocks_survive_a_reload(tmp_path):
    """A store's own persist=False blocks stay in force when another process's change makes it
    reload."""
    root = tmp_path / "bank"
    make_bank(root, value=1.0)
    with MemoryStore(root, tiers=FLASH) as st:
        st.block(1, [0], persist=False)
        assert st.is_refused(1, 0) and not st.refresh()
        r = memstore_cli("block", str(root), "--level", "2", "--clusters", "7")
        assert r.returncode == 0, r.stderr
        assert st.refresh()
        assert st.is_refused(1, 0) and st.is_refused(2, 7)
        with st.experiment(
            fallback="generic"
        ):  # undone at exit, including after a reload inside it
            st.block(3, [9], persist=False)
            assert (
                memstore_cli("block", str(root), "--level", "3", "--clusters", "10").returncode == 0
            )
            assert (
                st.refresh()
                and st.is_refused(3, 9)
                and st.is_refused(3, 10)
                and st.fallback == "generic"
            )
        assert (
            not st.is_refused(3, 9)
            and st.is_refused(3, 10)
            and st.is_refused(1, 0)
            and st.fallback == "zeros"
        )
    # session blocks never reach the file
    assert read_policy(root)["blocked"] == {"2": [[7, 8]], "3": [[10, 11]]}


def test_recovery_on_open_leaves_a_live_writers_files_alone(tmp_path):
    """A reader opening the bank while a writer is mid-operation must not 'recover' (delete)
    the writer's temp files or replay its journal under it."""
    root = tmp_path / "bank"
    make_bank(root)
    debris = root / ".policy.json.x.tmp"
    with bank_writer(root, operation="edit in progress"):
        debris.write_text("{}")
        code = f"""
from memtree.memstore.store import MemoryStore
MemoryStore({str(root)!r}).close()
"""
        subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=REPO, check=True, timeout=60)
        assert debris.exists()
    MemoryStore(root).close()  # no writer now: recovery runs
    assert not debris.exists()


def test_failed_first_write_leaves_no_lock_files(tmp_path):
    root = tmp_path / "bank"

    def blocks(level: int):
        yield 0, torch.zeros(_params(level))  # not every slot: the write fails

    with pytest.raises(BankError, match="no values given"):
        write_bank(root, anchor=TINY, memory=MEM, dtype="fp32", blocks=blocks)
    assert list(tmp_path.iterdir()) == []
    assert not any(p.exists() for p in lock_paths(root))
