"""`memory.read: auto` settled by measurement: a short timed probe at start-up, cached.

Why this exists: KV and FFN memories can be read in place by the fused kernels ("fused",
`TrainableBank.read`) or from gathered per-sequence copies ("gather", `F.embedding` +
`assemble_memories`); both compute the same function. Which is faster depends on the GPU, the
kernels' build, the model's shape, the batch and the precision: on an H100 the fused read was
measured slower than gather in a training step (FFN 0.50x / 0.68x, KV 0.28x / 0.25x the step
speed; docs/benchmarks/2026-11-25-kernels-h100.md, "Kernels and GPU paths on an H100"), so "fused on
any GPU" put every GPU run on the slower path. `auto` now times both on the run's own model and
batch and takes fused only when it is clearly faster:

- `choose_read(timings)`: "fused" only if its step time is <= `margin` (0.95) x gather's; ties,
  a missing or failed fused time → "gather" (the path of standard ops; for KV / FFN memories
  the one without custom kernels).
- `probe_read(model, batch)`: forward + loss + backward of the real model on a real batch in
  both modes, alternating (fused gather, gather fused, ...) so drift hits both, median seconds
  per step. No optimizer step: weights, grads, the forward counter and the mode are as found.
- `ReadProbeCache`: the probes' results by key (device name, torch / triton versions, anchor
  shape, memory config, attention implementation, micro batch, sequence length, precision) in a
  versioned JSON file, `$MEMTREE_CACHE_DIR/read-probe.json` (default
  `~/.cache/memtree/read-probe.json`), written atomically (temp file + os.replace). A corrupt or
  foreign file is named in a warning with the reason and treated as empty (then overwritten).
- `resolve_read(read, model, batch)`: "fused" / "gather" / "flex" are returned unchanged; "auto" on
  the CPU is "gather" without probing (the fused ops run their pure-torch reference there, measured
  not faster: bench/training/training_steps.py --only read); "auto" on a GPU is the cached choice
  or a fresh probe's, logged in one line. A probe that raises (a Triton compile error, say) gives
  "gather", with the error in that line; models with no read to choose (no memory, LoRA memories,
  HF anchors) get "gather" without probing.
- Mixture-of-Chapters layers (training/layers/moc.py) are probed the same way, over their three
  reads: "fused" (the memory-attention kernel), "gather" (SDPA on gathered chapters, a widened
  head carrying the router's log-weights) and, in "bias" mode, "flex" (FlexAttention through a
  block mask from the block table); the fastest non-gather read is taken only if <= `margin` x
  gather's step time, and a read whose warm-up step fails is left out.

What the probe does not match of a Composer step (the same in both modes, so they shift both
times alike, except where noted): the optimizer step (`MemoryAdamW`'s sparse update: the fused
read's table gradient arrives coalesced, the gathered one's not, so the optimizer's coalescing
cost is left out), DDP's gradient all-reduce, FSDP (the probe runs the unsharded model), the
gradient scaler of `amp_fp16`, metric updates, and Composer's microbatch loss weighting (a
scalar). It runs the model's own `forward` and `loss` under the same autocast that Composer's
`get_precision_context` sets for `fp32` / `amp_bf16` / `amp_fp16`, on the run's micro batch
(the whole device batch when the trainer's micro batch is "auto"; halved until it fits if it
runs out of memory), and every step draws the same generic-memory rows (the forward counter
is reset before each step and `memory.dropout` is off during the probe), so both modes do the
same work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from memtree.io import atomic_write_json

log = logging.getLogger(__name__)

CACHE_FORMAT = "memtree-read-probe"
CACHE_VERSION = 1
CACHE_FILE = "read-probe.json"
MODES = ("fused", "gather")  # every model with a choice has these two; MoC layers also "flex"
READS = ("fused", "gather", "flex")


# ------------------------------------------------------------------------------ the choice
def choose_read(timings: Mapping[str, float], *, margin: float = 0.95) -> str:
    """The fastest of the non-gather reads ("fused", "flex") if its time <= margin *
    timings["gather"] (both finite and positive); otherwise, ties and missing or failed times
    included, "gather" (the path of standard ops)."""
    g = timings.get("gather")
    if not _good(g):
        return "gather"
    others = [m for m in READS if m != "gather" and _good(timings.get(m))]
    best = min(others, key=lambda m: timings[m], default=None)
    return best if best is not None and timings[best] <= margin * g else "gather"


def _good(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def read_modes(model: Any) -> tuple[str, ...]:
    """The reads `model` (a `MemtreeLM`) can switch between (`MemtreeLM.read_modes`): ("fused",
    "gather") for a bank of KV or FFN memories on our own anchor, ("fused", "gather", "flex")
    for Mixture-of-Chapters layers in "bias" mode; () when there is nothing to choose (LoRA
    memories and HF anchors are always gathered)."""
    modes = getattr(model, "read_modes", None)
    return tuple(modes()) if callable(modes) else ()


def can_read_in_place(model: Any) -> bool:
    """Whether `model` has a read to choose at all (`read_modes`): a fused read beside gather."""
    return "fused" in read_modes(model)


# ------------------------------------------------------------------------------- the cache
def default_cache_path() -> Path:
    """`$MEMTREE_CACHE_DIR/read-probe.json`, else `~/.cache/memtree/read-probe.json`."""
    root = os.environ.get("MEMTREE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "memtree") / CACHE_FILE


def probe_key(
    model: Any,
    batch: Mapping[str, Any],
    *,
    device_name: str,
    precision: str,
    allow_tf32: bool | None = None,
) -> dict[str, Any]:
    """What determines the relative cost of the two reads: the device, the software that runs
    the kernels, the model's shape (anchor, memory type / multipliers / placement / branching,
    attention implementation) and the step's shape (micro batch, sequence length, precision,
    TF32 matmuls when the caller sets them)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    ids = batch["input_ids"]
    anchor = getattr(model, "model", None)
    shape = {k: v for k, v in dataclasses.asdict(model.anchor_shape).items() if k != "name"}
    memory = getattr(model, "memory", None)
    fields = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton_version,
        "anchor": shape,
        "memory": dataclasses.asdict(memory) if memory is not None else None,
        "attn_impl": getattr(getattr(anchor, "config", None), "attn_impl", None),
        "batch": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]),
        "precision": precision,
        "allow_tf32": allow_tf32,
    }
    moc = getattr(getattr(anchor, "config", None), "moc", None)
    if moc is not None:  # only then: the keys of KV / FFN models' cached probes stay as they were
        fields["moc"] = dataclasses.asdict(moc)
        fields["modes"] = list(read_modes(model))
    return fields


def key_id(fields: Mapping[str, Any]) -> str:
    """The cache key of `probe_key`'s fields: a short hash of their canonical JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


class ReadProbeCache:
    """The probes' results, {key: {"fused", "gather" (seconds per step), "choice", "measured_at",
    "batch" (the batch size probed), "key" (the fields hashed)}}, in one versioned JSON file.

    Several processes writing at once can lose one another's new entry (read, merge, replace):
    the file is a cache, and the loser probes again next time."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()

    def entries(self) -> dict[str, dict[str, Any]]:
        """The stored entries; a missing file is empty, an unreadable or foreign one is empty after
        a warning naming the file and the reason."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            return self._bad(f"cannot read it ({type(e).__name__}: {e})")
        try:
            data = json.loads(text)
        except ValueError as e:
            return self._bad(f"not valid JSON ({e})")
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            return self._bad(f"not a {CACHE_FORMAT} file (format {got!r})")
        if data.get("version") != CACHE_VERSION:
            return self._bad(
                f"version {data.get('version')!r}, this code reads version {CACHE_VERSION}"
            )
        entries = data.get("entries")
        if not isinstance(entries, dict):
            return self._bad("its 'entries' is not an object")
        return entries

    def _bad(self, reason: str) -> dict[str, dict[str, Any]]:
        warnings.warn(
            f"{self.path}: read-probe cache ignored, {reason}; treating it as empty (the next "
            "probe rewrites it)",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry of `key` if it holds usable timings, else None."""
        entry = self.entries().get(key)
        if not isinstance(entry, dict) or not _good(entry.get("gather")):
            return None
        return entry

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store `entry` under `key` (atomically: temp file + os.replace)."""
        entries = self.entries()
        entries[key] = dict(entry)
        atomic_write_json(
            self.path, {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries}
        )


# ------------------------------------------------------------------------------- the probe
def precision_context(precision: str, device_type: str):
    """The autocast Composer's `get_precision_context` sets for `precision` (fp32: none; amp_bf16:
    bf16; amp_fp16: fp16), on CUDA; on the CPU Composer autocasts nothing, nor does this."""
    if precision not in ("fp32", "amp_bf16", "amp_fp16"):
        raise ValueError(f"precision {precision!r} is not one of fp32, amp_bf16, amp_fp16")
    if device_type != "cuda":
        return contextlib.nullcontext()
    if precision == "fp32":
        return torch.autocast("cuda", enabled=False)
    return torch.autocast(
        "cuda", dtype=torch.bfloat16 if precision == "amp_bf16" else torch.float16
    )


def _device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def probe_read(
    model: Any,
    batch: Mapping[str, Any],
    *,
    steps: int = 3,
    warmup: int = 1,
    precision: str = "fp32",
    allow_tf32: bool | None = None,
    timer: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per training step of `model` (a `MemtreeLM` with a read to choose,
    `read_modes`) on `batch` with each of its reads: {"fused": s, "gather": s[, "flex": s]}.

    A step is what Composer's microbatch step does: the model's forward and loss under the
    precision's autocast, then backward (grads set to None first, as after `zero_grad`), with
    TF32 matmuls on or off as `allow_tf32` says (None: as they are; Composer's `DeviceGPU` sets
    them when the Trainer is built, after the probe, so the trainer passes its setting). Order:
    `warmup` untimed steps of each mode (Triton and FlexAttention compile here), then `steps`
    rounds of one timed step per mode, alternating fused, gather / gather, fused / ... `sync`
    (default: `torch.cuda.synchronize` on CUDA) runs before each reading of `timer`. A read other
    than "gather" whose warm-up step raises (a compile error, an unsupported shape), other than
    running out of memory, is left out and timed nan, with a warning naming the error.

    The model is left as found: mode (`read`), train/eval flag, forward counter,
    `memory_dropout`, `memory_mode`, the last-forward records (MoC layers' routing and
    auxiliary losses too), the RNG states and every parameter's `.grad`, the TF32 flags; there
    is no optimizer step, so no weight changes. Raises what a gather step raises (after
    restoring)."""
    modes = read_modes(model)
    if "fused" not in modes:
        raise ValueError(
            "probe_read: the model has no read to compare (no KV/FFN bank on its own anchor, "
            "no Mixture-of-Chapters layers)"
        )
    if steps < 1 or warmup < 0:
        raise ValueError(f"probe_read: steps {steps} must be >= 1 and warmup {warmup} >= 0")
    device = next(model.parameters()).device
    sync = sync or _device_sync(device)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    params = list(model.parameters())
    saved = {
        "grads": [p.grad for p in params],
        "training": model.training,
        "read": model.read,
        "forwards": model.forwards.detach().clone(),
        "memory_dropout": model.memory_dropout,
        "memory_mode": model.memory_mode,
        "last_slots": model.last_slots,
        "last_use_generic": model.last_use_generic,
        "last_seq_loss": model.last_seq_loss,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "moc": [(m, m.last_routing, m.last_aux) for m in model.moc_layers()],
    }

    def step() -> None:
        with torch.no_grad():
            model.forwards.copy_(saved["forwards"])  # the same generic-memory draws every step
        for p in params:
            p.grad = None
        with precision_context(precision, device.type):
            loss = model.loss(model(batch), batch)
        loss.backward()

    times: dict[str, list[float]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    try:
        if allow_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allow_tf32
        model.train()
        model.memory_dropout = 0.0  # a dropped step would read no memory in either mode
        model.memory_mode = "fetched"
        for mode in modes:
            model.read = mode
            try:
                for _ in range(warmup):
                    step()
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # a read that fails is out; the others still compete
                if mode == "gather":
                    raise
                failed[mode] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warnings.warn(
                    f"memory.read probe: the {mode!r} read failed ({failed[mode]}); left out",
                    RuntimeWarning,
                    stacklevel=2,
                )
        alive = [m for m in modes if m not in failed]
        for i in range(steps):
            for mode in alive if i % 2 == 0 else alive[::-1]:
                model.read = mode  # the switch: read by every forward
                sync()
                t0 = timer()
                step()
                sync()
                times[mode].append(timer() - t0)
    finally:
        for p, g in zip(params, saved["grads"], strict=True):
            p.grad = g
        with torch.no_grad():
            model.forwards.copy_(saved["forwards"])
        model.train(saved["training"])
        for name in (
            "read",
            "memory_dropout",
            "memory_mode",
            "last_slots",
            "last_use_generic",
            "last_seq_loss",
        ):
            setattr(model, name, saved[name])
        for layer, routing, aux in saved["moc"]:
            layer.last_routing, layer.last_aux = routing, aux
        torch.set_rng_state(saved["rng"])
        if saved["cuda_rng"] is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"], device)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved["tf32"]
    return {m: float(statistics.median(ts)) if ts else math.nan for m, ts in times.items()}


def _batch_size(batch: Mapping[str, Any]) -> int:
    return int(batch["input_ids"].shape[0])


def _probe_fitting(
    model: Any,
    batch: Mapping[str, Any],
    *,
    steps: int,
    warmup: int,
    precision: str,
    allow_tf32: bool | None,
    probed: list[int],
) -> dict[str, float]:
    """`probe_read`, on half the batch (and so on) while the device runs out of memory; the batch
    size that ran is appended to `probed`."""
    while True:
        try:
            out = probe_read(
                model, batch, steps=steps, warmup=warmup, precision=precision, allow_tf32=allow_tf32
            )
            probed.append(_batch_size(batch))
            return out
        except torch.cuda.OutOfMemoryError:
            n = _batch_size(batch)
            if n <= 1:
                raise
            torch.cuda.empty_cache()
            log.warning(
                "memory.read auto: the probe ran out of memory at micro batch %d; probing at %d",
                n,
                n // 2,
            )
            batch = {k: v[: n // 2] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ---------------------------------------------------------------------------- the decision
def resolve_read(
    read: str,
    model: Any = None,
    batch: Mapping[str, Any] | None = None,
    *,
    on_gpu: bool | None = None,
    device_name: str | None = None,
    precision: str = "fp32",
    allow_tf32: bool | None = None,
    cache: ReadProbeCache | str | os.PathLike | None = None,
    steps: int = 3,
    warmup: int = 1,
    margin: float = 0.95,
    probe: Callable[[Any, Mapping[str, Any]], Mapping[str, float]] | None = None,
) -> str:
    """`memory.read` resolved to one of the model's reads (`read_modes`; module docstring).

    `on_gpu` (default: whether the model's parameters are on CUDA) and `device_name` (default:
    `torch.cuda.get_device_name` there, "cpu" otherwise) say where the run trains; `cache` is a
    `ReadProbeCache` or its file (default `default_cache_path()`); `probe(model, batch)` returns
    {"fused": s, "gather": s[, "flex": s]} (default `probe_read` with `steps`, `warmup`,
    `precision`, `allow_tf32`, on a halved batch after running out of memory). `precision`: the
    trainer's, resolved (fp32, amp_bf16, amp_fp16). Logs one line saying what was measured and
    chosen."""
    if read not in ("auto", *READS):
        raise ValueError(f"memory.read {read!r} is not 'auto', 'fused', 'gather' or 'flex'")
    if read != "auto":
        return read
    if model is None or not can_read_in_place(model):
        log.info(
            "memory.read auto: gather (this model has no read to choose: no KV/FFN bank on its "
            "own anchor, no Mixture-of-Chapters layers)"
        )
        return "gather"
    device = next(model.parameters()).device
    if on_gpu is None:
        on_gpu = device.type == "cuda"
    if not on_gpu:
        log.info(
            "memory.read auto: gather (CPU: the fused ops run their pure-torch reference, not "
            "faster; bench/training/training_steps.py --only read)"
        )
        return "gather"
    if batch is None:
        raise ValueError("resolve_read: 'auto' on a GPU needs a batch to probe with")
    if device_name is None:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cache = cache if isinstance(cache, ReadProbeCache) else ReadProbeCache(cache)
    fields = probe_key(
        model, batch, device_name=device_name, precision=precision, allow_tf32=allow_tf32
    )
    key = key_id(fields)
    where = f"B{fields['batch']} x S{fields['seq_len']}, {device_name}, {precision}"
    entry = cache.get(key)
    if entry is not None:
        choice = choose_read(entry, margin=margin)
        log.info(
            "memory.read auto: %s (%s) -> %s [cached in %s]",
            _times(entry),
            where,
            choice,
            cache.path,
        )
        return choice
    probed: list[int] = []
    if probe is None:

        def probe(m, b):
            return _probe_fitting(
                m,
                b,
                steps=steps,
                warmup=warmup,
                precision=precision,
                allow_tf32=allow_tf32,
                probed=probed,
            )

    try:
        timings = {m: float(t) for m, t in probe(model, batch).items() if m in READS}
    except Exception as e:  # noqa: BLE001 — a compile error, an unsupported shape, …: no kernels then
        log.warning(
            "memory.read auto: probe failed (%s: %s) (%s) -> gather",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
            where,
        )
        return "gather"
    choice = choose_read(timings, margin=margin)
    if probed and probed[-1] != fields["batch"]:
        where += f", probed at B{probed[-1]}"
    entry = {
        **timings,
        "choice": choice,
        "batch": probed[-1] if probed else fields["batch"],
        "measured_at": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "key": fields,
    }
    try:
        cache.put(key, entry)
        stored = f"saved to {cache.path}"
    except OSError as e:  # a read-only home, say: the choice stands, the next start probes again
        stored = f"not saved: {type(e).__name__}: {e}"
    log.info("memory.read auto: %s (%s) -> %s [probed, %s]", _times(timings), where, choice, stored)
    return choice


def _times(t: Mapping[str, Any]) -> str:
    ms = [
        f"{m} {t[m] * 1e3:.1f} ms" if _good(t.get(m)) else f"{m} n/a"
        for m in READS
        if m in t or m in MODES
    ]
    return " vs ".join(ms) + " per step"


# -------------------------------------------------------------------------- the probe batch
def peek_batch(loader: Any, size: int | None = None, *, seed: int = 0) -> dict[str, Any]:
    """A batch of the loader's own samples and collate function, without iterating the loader (so
    the trainer's first batch and the loader's state are untouched): with a batch sampler that
    knows its batches (`rank_samples`, training/lanes.py) this rank's first batch; otherwise
    `size` (default the loader's batch size) sample ids drawn without replacement from the
    dataset with `seed` — a batch like a shuffled one (Streaming's own first batch is not
    computed: that would start its epoch). `size` truncates the batch (the micro batch)."""
    dataset = loader.dataset
    sampler = getattr(loader, "batch_sampler", None)
    if hasattr(sampler, "rank_samples"):
        ids = list(sampler.rank_samples(0))
    else:
        n = int(getattr(dataset, "num_samples", None) or len(dataset))
        want = min(n, size or loader.batch_size or 1)
        g = torch.Generator().manual_seed(seed)
        ids = sorted(torch.randperm(n, generator=g)[:want].tolist())
    if size:
        ids = ids[:size]
    return loader.collate_fn([dataset[i] for i in ids])
