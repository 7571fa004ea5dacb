"""The `read` benchmark of bench/training/training_steps.py: memories read in place by the fused
ops against gathered per-sequence copies, `memory.read: auto` as the trainer resolves it, and
Mixture-of-Chapters layers per read."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import log, row
from bench.training.steps_models import (
    Trainer,
    anchor_shape,
    fetched_width,
    make_batches,
    median,
    split_width,
)
from memtree.geometry import AnchorShape, MemoryConfig, plan
from memtree.training.model import ModelConfig
from memtree.training.optim import MemoryAdamW


# ------------------------------------------------------------------------ 4. read
def bench_read(S: dict, ctx: dict) -> tuple[dict, list[dict]]:
    """Fused in-place read vs gathered copies, per memory type, at the overhead benchmark's
    anchor and fetched width (FFN: W rows of 3·d per layer; KV: W slots of 2·kv_dim)."""
    a = anchor_shape(S)
    W = fetched_width(a, S["fetch_fraction"])
    mults = split_width(W, S["level_weights"])
    br = S["overhead_branching"]
    T = S["seq_len"]
    warm, rounds, per = S["warmup_steps"], S["overhead_rounds"], S["overhead_steps_per_round"]
    n = warm + rounds * per
    batches = make_batches(
        S,
        n,
        seq_len=T,
        n_leaf=br ** len(mults),
        levels=len(mults),
        branching=br,
        seed=S["seed"] + 300,
    )
    res: dict[str, Any] = {"anchor": S["anchor"], "multipliers": list(mults), "branching": br}
    rows = []
    for kind in ("ffn", "kv"):
        mem = MemoryConfig(multipliers=mults, type=kind, branching=br)
        runs = {r: Trainer(S, a, mem, read=r) for r in ("gather", "fused")}
        times: dict[str, list[float]] = {k: [] for k in runs}
        losses: dict[str, list[float]] = {k: [] for k in runs}
        for k, tr in runs.items():
            for i in range(warm):
                losses[k].append(tr.step(batches[i])[1])
        for r in range(rounds):
            for k in ["gather", "fused"] if r % 2 == 0 else ["fused", "gather"]:
                for j in range(per):
                    dt, loss = runs[k].step(batches[warm + r * per + j])
                    times[k].append(dt)
                    losses[k].append(loss)
        t_g, t_f = median(times["gather"]), median(times["fused"])
        diff = max(abs(x - y) for x, y in zip(losses["gather"], losses["fused"], strict=True))
        log(
            f"  {kind}: gather {t_g * 1e3:.1f} ms, fused {t_f * 1e3:.1f} ms per step; "
            f"max loss difference {diff:.2e}"
        )
        res[kind] = {
            "fetch_params": plan(a, mem).fetch_params,
            "steps": times,
            "losses": losses,
            "median_s": {"gather": t_g, "fused": t_f},
            "time_ratio": t_f / t_g,
            "max_loss_diff": diff,
        }
        data = f"{S['anchor']['name']} B{S['batch']}xS{T}, {kind} mem {list(mults)} br {br}"
        rows += [
            row(
                "read",
                f"{kind}: step ms, fused vs gathered",
                t_f * 1e3,
                baseline=t_g * 1e3,
                ratio=t_g / t_f,
                data=data,
                unit="ms",
            ),
            row(
                "read",
                f"{kind}: max |loss difference| over {n} steps",
                diff,
                target="<= 1e-4",
                met=diff <= 1e-4,
                data=data,
            ),
        ]
        choice, how = resolve_auto(S, a, mem, batches[0], T)
        t_auto, best = {"fused": t_f, "gather": t_g}[choice], min(t_f, t_g)
        log(
            f"  {kind}: memory.read auto -> {choice} ({how}): {t_auto * 1e3:.1f} ms per step, "
            f"{t_auto / best:.2f}x the faster"
        )
        res[kind]["auto"] = {
            "choice": choice,
            "how": how,
            "step_s": t_auto,
            "ratio_to_best": t_auto / best,
        }
        rows.append(
            row(
                "read",
                f"{kind}: step ms, auto ({choice}) vs the faster of fused/gather",
                t_auto * 1e3,
                baseline=best * 1e3,
                ratio=t_auto / best,
                target="<= 1.05",
                met=t_auto <= 1.05 * best,
                data=f"{data}; {how}",
                unit="ms",
            )
        )
    res["moc"], moc_rows = bench_read_moc(S, a, batches, warm=warm, rounds=rounds, per=per)
    return res, rows + moc_rows


def bench_read_moc(
    S: dict, a: AnchorShape, batches: list[dict], *, warm: int, rounds: int, per: int
) -> tuple[dict, list[dict]]:
    """Mixture-of-Chapters reads: one `MemtreeLM` per read of the layer (`MoCLayer.read`), built
    from one seed, stepped (forward, loss with the router losses, backward, MemoryAdamW) on the
    same batches, interleaved by round; then `memory.read: auto` as the trainer resolves it."""
    from memtree.training.composer_model import (  # here: the other benchmarks need no Composer
        MemorySettings,
        MemtreeLM,
    )
    from memtree.training.layers.moc import MoCConfig, read_modes

    T = S["seq_len"]
    moc = MoCConfig(
        n_chapters=S.get("moc_chapters", 65),
        tokens_per_chapter=S.get("moc_tokens", 32),
        top_k=S.get("moc_top_k", 8),
        layers=tuple(range(1, a.n_layers, 2)),
        zero_init_out=False,
    )
    device = torch.device(S.get("device", "cpu"))
    kw = {"lr": S["lr"], "betas": tuple(S["betas"]), "eps": 1e-8, "weight_decay": 0.0}

    def build(read: str):
        torch.manual_seed(S["seed"])
        model = MemtreeLM(
            ModelConfig(anchor=a, max_seq_len=T, moc=moc), memory_settings=MemorySettings(read=read)
        ).to(device)
        return model, MemoryAdamW([{"params": list(model.parameters())}], **kw)

    def step(run, batch) -> tuple[float, float]:
        model, opt = run
        ids = batch["ids"].to(device)
        b = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "paths": batch["paths"]}
        t0 = time.perf_counter()
        loss = model.loss(model(b), b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, float(loss)

    modes = read_modes(moc.weight_mode)
    runs, times, losses, failed = {}, {m: [] for m in modes}, {m: [] for m in modes}, {}
    for m in modes:
        try:
            runs[m] = build(m)
            for i in range(warm):
                losses[m].append(step(runs[m], batches[i])[1])
        # a read that cannot run here (a compile limit) is reported
        except Exception as e:  # noqa: BLE001
            failed[m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            runs.pop(m, None)
            log(f"  moc: the {m} read failed: {failed[m]}")
    order = list(runs)
    for r in range(rounds):
        for m in order if r % 2 == 0 else order[::-1]:
            for j in range(per):
                dt, loss = step(runs[m], batches[warm + r * per + j])
                times[m].append(dt)
                losses[m].append(loss)
    med = {m: median(times[m]) for m in order}
    diff = max(
        (abs(x - y) for m in order for x, y in zip(losses[m], losses["gather"], strict=True)),
        default=0.0,
    )
    data = (
        f"{S['anchor']['name']} B{S['batch']}xS{T}, MoC C{moc.n_chapters} "
        f"T{moc.tokens_per_chapter} "
        f"k{moc.top_k} layers {list(moc.layers)}"
    )
    log(
        "  moc: "
        + ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in med.items())
        + f" per step; max loss "
        f"difference {diff:.2e}"
    )
    res: dict[str, Any] = {
        "moc": dataclasses.asdict(moc),
        "steps": times,
        "losses": losses,
        "median_s": med,
        "failed": failed,
        "max_loss_diff": diff,
    }
    rows = [
        row(
            "read",
            f"moc: step ms, {m} vs gather",
            t * 1e3,
            baseline=med["gather"] * 1e3,
            ratio=med["gather"] / t,
            data=data,
            unit="ms",
        )
        for m, t in med.items()
        if m != "gather"
    ]
    rows.append(
        row(
            "read",
            f"moc: max |loss difference| over {warm + rounds * per} steps",
            diff,
            target="<= 1e-4",
            met=diff <= 1e-4,
            data=data,
        )
    )
    import tempfile

    from memtree.training.read_choice import ReadProbeCache, resolve_read

    model = runs["gather"][0]
    ids = batches[0]["ids"].to(device)
    probe_batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "paths": batches[0]["paths"]}
    with tempfile.TemporaryDirectory(prefix="memtree-read-probe-") as tmp:
        choice = resolve_read(
            "auto",
            model,
            probe_batch,
            precision="fp32",
            cache=ReadProbeCache(Path(tmp) / "read-probe.json"),
        )
    best = min(med.values())
    t_auto = med.get(choice, math.nan)
    res["auto"] = {"choice": choice, "step_s": t_auto, "ratio_to_best": t_auto / best}
    log(
        f"  moc: memory.read auto -> {choice}: {t_auto * 1e3:.1f} ms per step, "
        f"{t_auto / best:.2f}x the fastest"
    )
    rows.append(
        row(
            "read",
            f"moc: step ms, auto ({choice}) vs the fastest read",
            t_auto * 1e3,
            baseline=best * 1e3,
            ratio=t_auto / best,
            target="<= 1.03",
            met=t_auto <= 1.03 * best,
            data=data,
            unit="ms",
        )
    )
    return res, rows


def resolve_auto(
    S: dict, a: AnchorShape, mem: MemoryConfig, batch: dict, seq_len: int
) -> tuple[str, str]:
    """`memory.read: auto` resolved as the trainer does (`training.read_choice.resolve_read`: on a
    GPU a timed probe of both reads on a `MemtreeLM` of this shape and one of the batches, fp32 like
    this benchmark; on the CPU gather without probing), with a fresh cache in a temporary folder.
    Returns (the mode, how it was decided)."""
    import logging
    import tempfile

    from memtree.training.composer_model import (  # here: the other benchmarks need no Composer
        MemorySettings,
        MemtreeLM,
    )
    from memtree.training.read_choice import ReadProbeCache, resolve_read

    torch.manual_seed(S["seed"])
    device = torch.device(S.get("device", "cpu"))
    model = MemtreeLM(
        ModelConfig(anchor=a, memory=mem, max_seq_len=seq_len),
        memory_settings=MemorySettings(generic_prob=S["generic_prob"], read="fused"),
        seed=S["seed"],
    ).to(device)
    ids = batch["ids"]
    probe_batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "paths": batch["paths"]}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("memtree.training.read_choice")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with tempfile.TemporaryDirectory(prefix="memtree-read-probe-") as tmp:
            choice = resolve_read(
                "auto",
                model,
                probe_batch,
                precision="fp32",
                cache=ReadProbeCache(Path(tmp) / "read-probe.json"),
            )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    how = lines[-1].removeprefix("memory.read auto: ").split(" [")[0] if lines else "no log line"
    if how.startswith(f"{choice} (") and how.endswith(")"):  # "gather (why)": the why
        how = how[len(choice) + 2 : -1]
    return choice, how
