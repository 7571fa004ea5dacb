"""The multi-process training tests' script: `composer -n N tests/train_launcher.py [--batch-log L]
[--stop-at S] [--die RANK:STEP] [--report DIR] key=value …` trains a memtree config with test
callbacks attached, and `launch(...)` runs it from a test. Not collected by pytest."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from composer.core import Callback

REPO = Path(__file__).resolve().parents[1]


def lane_run_args(
    shards: Path, folder: Path, *extra: str, run_name: str, steps: int, save_every: int
) -> list[str]:
    """The overrides of the sharded / replica tests' runs: a tiny anchor with an [8, 4] bank on
    lanes, checkpointed every `save_every` batches, autoresumed."""
    return [
        f"data.shards={shards}",
        "data.batch_size=8",
        f"max_duration={steps}ba",
        f"save_interval={save_every}ba",
        "autoresume=true",
        f"run_name={run_name}",
        "mode=scratch",
        "memory.multipliers=[8,4]",
        "memory.lr=1e-2",
        "memory.export_dtype=fp32",
        "optim.warmup=2ba",
        "save_num_checkpoints_to_keep=-1",
        "model.shape={n_layers: 2, d_model: 64, n_heads: 2, head_dim: 32, ffn_dim: 256}",
        f"save_folder={folder}",
        "parallel.data=lanes",
        *extra,
    ]


def run_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A finished run's exported anchor weights and bank tables."""
    from safetensors.torch import load_file

    from memtree.training.bank import TrainableBank

    bank = TrainableBank.from_bank(folder / "bank")
    return load_file(folder / "anchor.safetensors"), {
        lv: t.detach() for lv, t in bank.tables.items()
    }


def worst_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class BatchLog(Callback):
    """Appends one JSON line per global batch to `path` (rank 0 writes): the step and, per rank, a
    hash of each sequence's tokens and path. Streaming deals a global batch out to the ranks
    round-robin (sample g of a batch goes to rank g % W), so `order` interleaves the ranks' lists
    back into the global batch's order; `samples` is the batch as a sorted list, the same for any
    world size under lanes (where a rank reads its own lanes' samples, not every W-th)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def after_dataloader(self, state, logger) -> None:
        from composer.utils import dist

        ids, paths = state.batch["input_ids"].cpu().numpy(), state.batch["paths"].cpu().numpy()
        mine = [
            hashlib.blake2b(ids[i].tobytes() + paths[i].tobytes(), digest_size=8).hexdigest()
            for i in range(len(ids))
        ]
        ranks = dist.all_gather_object(mine)
        if dist.get_global_rank() != 0:
            return
        order = [r[j] for j in range(max(map(len, ranks))) for r in ranks if j < len(r)]
        with open(self.path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "step": int(state.timestamp.batch) + 1,
                        "world": len(ranks),
                        "ranks": ranks,
                        "order": order,
                        "samples": sorted(order),
                    }
                )
                + "\n"
            )


class StopAt(Callback):
    """Ends every rank's process, like a kill, once `step` batches are done and checkpointed
    (Composer saves at BATCH_CHECKPOINT; the next event of the loop is BEFORE_DATALOADER)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_dataloader(self, state, logger) -> None:
        if int(state.timestamp.batch) >= self.step:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


class DieAt(Callback):
    """SIGKILLs global rank `rank` in the middle of step `step` (after its backward, before the
    optimizer step's collectives), as a crashed or preempted rank would die."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def after_backward(self, state, logger) -> None:
        from composer.utils import dist

        if dist.get_global_rank() == self.rank and int(state.timestamp.batch) + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RankReport(Callback):
    """At the end of fit each rank writes `rank{r}.json` to `folder`: the bank rows it holds, its
    tables' and their optimizer state's bytes, and the bytes it sent per collective (the
    optimizer's own count, and `CommBytes`'s totals with the anchor's DDP all-reduce)."""

    def __init__(self, folder: str | os.PathLike, comm: Callback) -> None:
        self.folder, self.comm = Path(folder), comm

    def fit_end(self, state, logger) -> None:
        from composer.utils import dist

        from memtree.training.composer_model import unwrap

        bank, opt = unwrap(state.model).bank, state.optimizers[0]
        tables = {lv: t for lv, t in bank.tables.items()}
        state_of = {lv: opt.state.get(t, {}) for lv, t in tables.items()}
        report = {
            "rank": dist.get_global_rank(),
            "world": dist.get_world_size(),
            "shard": list(bank.shard) if bank.shard is not None else None,
            "rows": {lv: int(t.shape[0]) for lv, t in tables.items()},
            # replicas of a shard must end with the same rows, bit for bit
            "table_sha": {
                lv: hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()
                for lv, t in tables.items()
            },
            "table_bytes": sum(t.numel() * t.element_size() for t in tables.values()),
            "row_bytes": {lv: t.shape[1] * t.element_size() for lv, t in tables.items()},
            "state_bytes": sum(
                v.numel() * v.element_size()
                for st in state_of.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            ),
            "state_rows_used": {
                lv: int(st["used"]) if "used" in st else 0 for lv, st in state_of.items()
            },
            "comm_bytes": dict(opt.comm_bytes),
            "comm_totals": dict(self.comm.totals),
            "steps": int(state.timestamp.batch),
            "anchor_grad_bytes": sum(
                p.numel() * p.element_size()
                for p in unwrap(state.model).model.parameters()
                if p.requires_grad
            ),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{report['rank']}.json").write_text(json.dumps(report))


def launch(
    world: int,
    args: list[str],
    *,
    log: Path | None = None,
    stop_at: int | None = None,
    die: tuple[int, int] | None = None,
    report: Path | None = None,
    check: bool = True,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`composer -n world` this script with `args` (key=value overrides)."""
    from streaming.base.util import clean_stale_shared_memory

    # a stopped run leaves its shared memory behind, as a killed one would
    clean_stale_shared_memory()
    flags = (
        (["--batch-log", str(log)] if log else [])
        + (["--stop-at", str(stop_at)] if stop_at else [])
        + (["--die", f"{die[0]}:{die[1]}"] if die else [])
        + (["--report", str(report)] if report else [])
    )
    launcher = Path(sys.executable).with_name("composer")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [str(launcher), "-n", str(world), __file__, *flags, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    clean_stale_shared_memory()
    if check:
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _main(argv: list[str]) -> int:
    from memtree.training.config import load_train_config
    from memtree.training.train import train

    callbacks: list[Callback] = []
    rest = []
    it = iter(argv)
    for a in it:
        if a == "--batch-log":
            callbacks.append(BatchLog(next(it)))
        elif a == "--stop-at":
            callbacks.append(StopAt(int(next(it))))
        elif a == "--die":
            rank, step = next(it).split(":")
            callbacks.append(DieAt(int(rank), int(step)))
        elif a == "--report":
            from memtree.training.callbacks import CommBytes

            comm = CommBytes(hook_ddp=True)
            callbacks += [comm, RankReport(next(it), comm)]
        else:
            rest.append(a)
    train(load_train_config(None, rest), callbacks=callbacks)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
