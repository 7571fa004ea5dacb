"""Per-step training losses of one config, to compare the same run across devices/precisions.

    python -m bench.training.train_losses training/yamls/demo.yaml --out gpu.json device=gpu \
        precision=amp_bf16 data.shards=runs/demo/pipeline/shards mode=scratch max_duration=200ba
    python -m bench.training.train_losses training/yamls/demo.yaml --out cpu.json device=cpu \
        precision=fp32 ...
    python -m bench.training.train_losses --compare cpu.json gpu.json

Runs training.train.train (a real Composer Trainer.fit) with a callback that records the
loss after every batch; --compare prints the two curves' mean losses per window of steps
and their largest relative difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import log


def record(config: str, overrides: list[str], out: Path) -> int:
    # Composer and the trainer (which imports it) are heavy; --compare needs neither.
    import torch
    from composer.core import Callback

    from memtree.training.config import load_train_config
    from memtree.training.train import train

    class Losses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def batch_end(self, state, logger) -> None:
            self.losses.append(float(state.loss))

    cfg = load_train_config(config, overrides)
    cb = Losses()
    t0 = time.perf_counter()
    train(cfg, callbacks=[cb])
    res = {
        "config": config,
        "overrides": overrides,
        "seconds": round(time.perf_counter() - t0, 1),
        "device": torch.cuda.get_device_name()
        if cfg.device != "cpu" and torch.cuda.is_available()
        else "cpu",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # as the run left them (Composer's DeviceGPU sets both from cfg.allow_tf32)
        "tf32": {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        },
        "losses": cb.losses,
    }
    out.write_text(json.dumps(res, indent=1))
    log(
        f"{len(cb.losses)} steps in {res['seconds']} s on {res['device']}: first "
        f"{cb.losses[0]:.4f}, last {cb.losses[-1]:.4f} -> {out}"
    )
    return 0


def compare(a_path: str, b_path: str, window: int) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    la, lb = a["losses"], b["losses"]
    n = min(len(la), len(lb))
    print(f"A = {a['device']} {a['overrides']}\nB = {b['device']} {b['overrides']}")
    print("steps        mean A   mean B   (B-A)/A")
    worst = 0.0
    for s in range(0, n, window):
        ma = sum(la[s : s + window]) / len(la[s : s + window])
        mb = sum(lb[s : s + window]) / len(lb[s : s + window])
        worst = max(worst, abs(mb - ma) / ma)
        print(f"{s:5d}-{min(s + window, n) - 1:<5d} {ma:8.4f} {mb:8.4f} {(mb - ma) / ma:+9.2%}")
    print(f"largest windowed relative difference: {worst:.2%} over {n} steps")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    ap.add_argument("--window", type=int, default=25)
    args = ap.parse_intermixed_args(argv)  # key=value overrides may follow --out
    if args.compare:
        return compare(*args.compare, args.window)
    if not (args.config and args.out):
        ap.error("give CONFIG and --out (or --compare A B)")
    return record(args.config, args.overrides, args.out)


if __name__ == "__main__":
    sys.exit(main())
