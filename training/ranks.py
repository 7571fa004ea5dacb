"""What each rank of a run is doing, said once at start, and what a run that lost a rank leaves.

- `cpu_thread_count` / `set_cpu_threads`: torch's intra-op threads per rank on the CPU
  (`cpu_threads: auto`: the usable cores shared by the node's ranks). torch's own default is every
  core in every process, so N ranks on a node oversubscribe its cores N times (two sharded ranks
  on 2 cores: 98-169 tokens/s, against 953 with one thread each;
  bench/training/bank_parallel.py --parts threads measures both).
- `Placement`: a callback that, at fit start, gathers every rank's placement (its bank shard,
  rows, bytes, the streams it reads, its threads; host and pid) and prints one line per rank on
  global rank 0's console (`composer -n N` shows only local rank 0's output while the run lives).
- `lost_rank` / `exit_after_lost_rank`: a multi-rank run whose peer vanished mid-collective (gloo
  raises `RuntimeError: … Connection reset by peer`, NCCL a `DistBackendError`) or that the launcher
  stopped (SIGTERM, once one rank failed) ends with a short message — the lost rank, the last
  complete Composer checkpoint and bank-shards checkpoint, and the command that resumes — and
  exit code 75 (EX_TEMPFAIL), not a traceback per survivor. Only when no rank on this host is
  gone (the lost one is elsewhere, or this error has another cause) is the traceback printed too.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as tdist
from composer.core import Callback, State
from composer.loggers import Logger

from memtree.training.bank_shards import (
    BankShardError,
    checkpoint_batches,
    read_manifest,
    verify_shards,
)
from memtree.training.composer_model import unwrap
from memtree.training.config import TrainConfig

log = logging.getLogger(__name__)

LOST_RANK_EXIT = 75  # sysexits' EX_TEMPFAIL: a temporary failure, the user is invited to retry
# a bank-shards checkpoint larger than this is not hashed by a survivor: the launcher kills it
# 30 s after the first failure, and the resumed run checks every file's sha256 before reading it
VERIFY_LIMIT_BYTES = 4 << 30
_BATCH = re.compile(r"-ba(\d+)-")


# --- threads ----------------------------------------------------------------------------------


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_thread_count(
    setting: int | str, *, cores: int, local_ranks: int, env: Mapping[str, str]
) -> tuple[int | None, str]:
    """(threads to set, or None to leave torch's, why). An explicit `cpu_threads: N` wins; under
    `auto` an OMP_NUM_THREADS in the environment is the user's choice (torch read it at start-up)
    and is left alone, and so is a lone process's count (torch's default does not oversubscribe
    one process, and an in-process caller may have set its own); otherwise the usable cores
    shared by the node's ranks, at least 1."""
    if setting != "auto":
        return int(setting), f"cpu_threads={setting}"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        return None, f"OMP_NUM_THREADS={omp} in the environment"
    if local_ranks <= 1:
        return None, "auto: the only rank on this node keeps torch's count"
    return max(1, cores // local_ranks), f"auto: {cores} usable cores / {local_ranks} local ranks"


def set_cpu_threads(cfg: TrainConfig, *, gpu: bool, local_ranks: int) -> str:
    """Apply `cfg.cpu_threads` on a CPU run (a GPU run's threads are left as they are); returns
    what was set and why, for the placement line."""
    if gpu:
        return f"{torch.get_num_threads()} (GPU run: left as is)"
    n, why = cpu_thread_count(
        cfg.cpu_threads, cores=usable_cores(), local_ranks=local_ranks, env=os.environ
    )
    if n is not None:
        torch.set_num_threads(n)
    return f"{torch.get_num_threads()} ({why})"


# --- placement --------------------------------------------------------------------------------


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.1f} MiB)"


def rank_placement(
    *, rank: int, world: int, bank: Any, layout: Any, cfg: TrainConfig, threads: str
) -> dict[str, Any]:
    """This rank's placement as plain values (gathered to rank 0): bank rows per level, table
    bytes, the AdamW state's bound, the streams read and the samples per step."""
    from memtree.training.data import read_shards_manifest, selected_streams

    d: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "threads_note": threads,
    }
    if bank is not None:
        tables = {int(lv): t for lv, t in bank.tables.items()}
        d["subtrees"] = list(bank.held_subtrees)
        d["branching"] = int(bank.memory.branching)
        d["rows"] = {lv: int(t.shape[0]) for lv, t in tables.items()}
        d["bank_bytes"] = sum(t.numel() * t.element_size() for t in tables.values())
        # lazy AdamW (training/optim.py): per row ever updated exp_avg and exp_avg_sq in float32,
        # a step count (int64) and, for every row, its pool slot (int64)
        d["state_bound"] = sum(
            int(t.shape[0]) * (int(t.shape[1]) * 2 * 4 + 16) for t in tables.values()
        )
    if layout is not None:
        pl, plan = layout.placement, layout.plan
        g, r = pl.group_of(rank), pl.replica_of(rank)
        names = {int(s["subtree"]): s["name"] for s in layout.streams}
        lanes = [(names[plan.subtrees[k]], int(plan.per_step[k])) for k in pl.lanes[g]]
        total = sum(b for _, b in lanes)
        d.update(
            group=g,
            groups=pl.groups,
            replica=r,
            replicas=pl.replicas,
            lanes=lanes,
            samples=(total - r + pl.replicas - 1) // pl.replicas,
            sharded=layout.shard is not None,
        )
    else:
        streams = selected_streams(read_shards_manifest(cfg.data.shards), cfg.data.subtrees)
        d.update(streams=len(streams), samples=cfg.data.batch_size // world)
    d["batch_size"] = cfg.data.batch_size
    return d


def placement_line(d: dict[str, Any]) -> str:
    """One line for a rank's placement (`rank_placement`); a short one for a lone process."""
    if d["world"] == 1:
        if "rows" in d:
            held = "whole" if len(d["subtrees"]) == d["branching"] else f"subtrees {d['subtrees']}"
            bank = (
                f"bank ({held}) {sum(d['rows'].values())} rows, {d['bank_bytes'] / 2**20:.1f} MiB, "
                f"AdamW state up to {d['state_bound'] / 2**20:.1f} MiB"
            )
        else:
            bank = "no memory bank"
        reads = f"{len(d['lanes'])} lanes" if "lanes" in d else f"all {d['streams']} streams"
        return f"placement: one rank; {bank}; reads {reads}; torch threads {d['threads_note']}"
    if "group" in d:
        what = "bank shard" if d["sharded"] else "lane group"
        head = (
            f"placement: rank {d['rank']} of {d['world']} ({what} {d['group']} of {d['groups']}, "
            f"replica {d['replica']} of {d['replicas']})"
        )
    else:
        head = f"placement: rank {d['rank']} of {d['world']}"
    parts = []
    if "rows" in d:
        whole = len(d["subtrees"]) == d["branching"]
        held = (
            f"all {d['branching']} level-1 subtrees"
            if whole
            else f"level-1 subtrees {d['subtrees']}"
        )
        rows = sum(d["rows"].values())
        per = ", ".join(f"L{lv} {n}" for lv, n in sorted(d["rows"].items()))
        parts += [
            f"holds {held}: bank {rows} rows ({per}), {_bytes(d['bank_bytes'])}",
            f"AdamW state up to {_bytes(d['state_bound'])}",
        ]
    else:
        parts.append("no memory bank")
    if "lanes" in d:
        lanes = ", ".join(f"{name} ({b}/step)" for name, b in d["lanes"])
        parts.append(f"reads lanes {lanes}: {d['samples']} of {d['batch_size']} samples per step")
    else:
        parts.append(
            f"reads all {d['streams']} streams (shuffled): {d['samples']} of {d['batch_size']} "
            "samples per step"
        )
    parts.append(f"torch threads {d['threads_note']}")
    return head + " " + "; ".join(parts)


class Placement(Callback):
    """At fit start: every rank's placement line, printed by global rank 0 (each rank also logs
    its own at INFO); keeps the ranks' (host, pid) for `exit_after_lost_rank`."""

    def __init__(self, cfg: TrainConfig, layout: Any, threads: str) -> None:
        self.cfg, self.layout, self.threads = cfg, layout, threads
        self.ranks: list[dict[str, Any]] = []

    def fit_start(self, state: State, logger: Logger) -> None:
        from composer.utils import dist

        mine = rank_placement(
            rank=dist.get_global_rank(),
            world=dist.get_world_size(),
            bank=unwrap(state.model).bank,
            layout=self.layout,
            cfg=self.cfg,
            threads=self.threads,
        )
        log.info("%s", placement_line(mine))
        self.ranks = dist.all_gather_object(mine) if dist.get_world_size() > 1 else [mine]
        if dist.get_global_rank() == 0:
            print("\n".join(placement_line(d) for d in self.ranks), flush=True)


# --- a lost rank ------------------------------------------------------------------------------

# gloo's errors name its source files (…/gloo/transport/tcp/pair.cc: Read error …, Timed out …)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "gloo", "NCCL")


def lost_rank(e: BaseException, world: int) -> bool:
    """Whether `e`, raised from a multi-rank fit, means another rank is gone (a collective whose
    peer vanished, anywhere in the exception's chain) or the launcher stopped this one (SIGTERM or
    SIGINT, which Composer turns into SystemExit(128 + signal))."""
    if world <= 1:
        return False
    if isinstance(e, SystemExit):
        return e.code in (128 + signal.SIGTERM, 128 + signal.SIGINT)
    seen = e
    while seen is not None:
        if isinstance(seen, tdist.DistError):
            return True
        if isinstance(seen, RuntimeError) and any(s in str(seen) for s in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def last_complete_checkpoint(ckpts: Path) -> Path | None:
    """The Composer checkpoint `latest-rank0.pt` points to: Composer moves the link only once a
    save is complete."""
    latest = ckpts / "latest-rank0.pt"
    return ckpts / Path(os.readlink(latest)).name if latest.is_symlink() else None


def checkpoint_batch(path: Path) -> int | None:
    m = _BATCH.search(path.name)
    return int(m.group(1)) if m else None


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def lost_peers(ranks: list[dict[str, Any]], me: int, *, wait_s: float = 3.0) -> list[int]:
    """The ranks on this host whose processes are gone (other hosts' ranks cannot be seen here).

    A killed peer's sockets close while the kernel is still tearing the process down, so the
    collective that noticed can run before the process is a zombie: when none is gone yet, look
    again for up to `wait_s` (only on this failure path)."""
    host = socket.gethostname()
    peers = [d for d in ranks if d["rank"] != me and d["host"] == host]
    deadline = time.monotonic() + wait_s
    while True:
        gone = [d["rank"] for d in peers if _gone(d["pid"])]
        if gone or not peers or time.monotonic() >= deadline:
            return gone
        time.sleep(0.1)


def resume_command(argv: list[str], env: Mapping[str, str], module: str | None = None) -> str:
    """The launch that resumes this run: its script and arguments with `autoresume=true` (any
    earlier `autoresume=` dropped), under the launcher it ran under. `module`: the module the
    ranks ran (`-m memtree.training.train`, argv[0] then being its file), None for a script."""
    args = [a for a in argv[1:] if not a.startswith("autoresume=")] + ["autoresume=true"]
    tail = " ".join(
        [*(["-m", module] if module else [shlex.quote(argv[0])]), *map(shlex.quote, args)]
    )
    world, local = (
        int(env.get("WORLD_SIZE", "1")),
        int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))),
    )
    if world == local:
        return f"composer -n {world} {tail}"
    where = (
        f"--master_addr {env.get('MASTER_ADDR', 'HEAD')} --master_port "
        f"{env.get('MASTER_PORT', 'PORT')}"
    )
    if "TORCHELASTIC_RUN_ID" in env:
        return (
            f"on each of the {world // local} nodes: torchrun --nnodes {world // local} "
            f"--nproc-per-node {local} --node-rank K {where.replace('_', '-')} {tail}"
        )
    return (
        f"on each of the {world // local} nodes: composer -n {local} --world_size {world} "
        f"--node_rank K {where} {tail}"
    )


def launched_module() -> str | None:
    """The module this process was started as (`python -m NAME`, as `composer -m` / `torchrun -m`
    start their ranks), or None when it ran a script file."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else None


def intact_lines(cfg: TrainConfig, *, sharded: bool) -> list[str]:
    """What a rerun resumes from: the last complete Composer checkpoint and, for a sharded bank,
    its bank-shards checkpoint, checked against its manifest's sha256 (`verify_shards`)."""
    ckpts = Path(cfg.save_folder) / "checkpoints"
    ckpt = last_complete_checkpoint(ckpts)
    if ckpt is None:
        return [f"no checkpoint was complete yet in {ckpts}: the rerun starts from the beginning"]
    batch = checkpoint_batch(ckpt)
    out = [f"intact: Composer checkpoint {ckpt} (batch {batch})"]
    if not sharded:
        return out
    bank = ckpts / "bank" / f"ba{batch}"
    try:
        man = read_manifest(bank)
        size = sum(int(e["bytes"]) for e in man["files"].values())
        if size > VERIFY_LIMIT_BYTES:
            out.append(
                f"intact: bank shards {bank} ({len(man['files'])} files, {size / 2**30:.1f} GiB, "
                "published with a manifest; not hashed here: the resumed run checks each file's "
                "sha256)"
            )
        else:
            got = verify_shards(bank)
            out.append(f"intact: bank shards {bank} ({got['files']} files, sha256 verified)")
    except (BankShardError, OSError, KeyError) as e:
        out.append(
            f"NOT intact: bank shards {bank}: {e} (finished bank checkpoints: "
            f"{checkpoint_batches(ckpts / 'bank')}); the rerun cannot resume from batch {batch}"
        )
    return out


def exit_after_lost_rank(cfg: TrainConfig, trainer: Any, e: BaseException) -> NoReturn:
    """Print what was lost, what is intact and the command that resumes; exit LOST_RANK_EXIT.
    The process group is broken (a barrier in Trainer.close would wait for the lost rank or raise
    again), so only the atexit handlers run (Composer's callbacks' close, Streaming's shared
    memory), with a watchdog: a handler stuck on the lost peer is cut short after 20 s, before the
    launcher's SIGKILL at 30 s."""
    for sig in (
        signal.SIGTERM,
        signal.SIGINT,
    ):  # the launcher's SIGTERM must not cut the message short
        signal.signal(sig, signal.SIG_IGN)
    from composer.utils import dist

    me = dist.get_global_rank()
    placement = next((c for c in trainer.state.callbacks if isinstance(c, Placement)), None)
    ranks = placement.ranks if placement is not None else []
    gone = lost_peers(ranks, me)
    why = [f"rank {', '.join(map(str, gone))} is gone"] if gone else []
    if isinstance(e, SystemExit):
        why.append(
            f"stopped by signal {int(e.code) - 128} (the launcher stops every rank once one fails)"
        )
    else:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if not gone:  # a rank on another host, or a failure of this rank's own: keep the evidence
            traceback.print_exception(e)
            why.append("no rank on this host is gone (a peer on another host?)")
        why.append(f"{type(e).__name__}: {first[:200]}")
    done = int(trainer.state.timestamp.batch)
    bank = unwrap(trainer.state.model).bank
    lines = [
        f"training stopped after {done} batches: {'; '.join(why)}",
        *intact_lines(cfg, sharded=bank is not None and bank.shard is not None),
        f"resume with: {resume_command(sys.argv, os.environ, launched_module())}",
    ]
    sys.stdout.flush()
    print("\n".join(f"[rank {me}] {line}" for line in lines), file=sys.stderr, flush=True)
    watchdog = threading.Timer(20.0, os._exit, args=(LOST_RANK_EXIT,))
    watchdog.daemon = True  # never delays an exit that goes through
    watchdog.start()
    raise SystemExit(LOST_RANK_EXIT)
