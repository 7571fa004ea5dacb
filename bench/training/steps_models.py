"""The models, batches and timed steps that bench/training/training_steps.py's benchmarks share:
the anchor's shape and FLOP counts, the fetched memory's width, banks, batches with their cluster
paths, and `Trainer`, one direct PyTorch training step of an anchor with its memories; plus the
result rows and table."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import print_targets
from memtree.geometry import AnchorShape, MemoryConfig
from memtree.training.bank import TrainableBank
from memtree.training.model import AnchorLM, ModelConfig, assemble_memories
from memtree.training.optim import MemoryAdamW


# ---------------------------------------------------------------------------------- helpers
def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def print_table(rows: list[dict]) -> None:
    print_targets(rows, data_width=40)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ------------------------------------------------------------------------------ the models
def anchor_shape(S: dict) -> AnchorShape:
    return AnchorShape(tied_embeddings=True, **S["anchor"])


def matmul_params(a: AnchorShape) -> int:
    """Weights each token multiplies through in the anchor: every linear in the blocks plus
    the (tied) output head. Norm gains and the input embedding lookup do no matmul."""
    d, q, kv, f = a.d_model, a.q_dim, a.kv_dim, a.ffn_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    return a.n_layers * per_layer + a.vocab_size * a.d_model


def attn_fwd_flops_per_token(a: AnchorShape, seq_len: int) -> float:
    """QKᵀ and AV in the forward pass, 2·d_q FLOPs per (query, key) pair each, causal: a
    query sees (S+1)/2 keys on average."""
    return a.n_layers * 2 * 2 * a.q_dim * (seq_len + 1) / 2


def split_width(total: int, weights: list[int]) -> tuple[int, ...]:
    """total FFN width over levels in proportion to weights (remainder to level 1)."""
    parts = [total * w // sum(weights) for w in weights]
    parts[0] += total - sum(parts)
    return tuple(parts)


def fetched_width(a: AnchorShape, fraction: float) -> int:
    """FFN memory width W (summed over levels, on every layer) whose fetched params are
    closest to fraction x the anchor's params: an FFN memory of width W holds 3·W·d per
    layer."""
    return max(1, round(fraction * a.params() / (3 * a.d_model * a.n_layers)))


def make_bank(a: AnchorShape, mem: MemoryConfig, seed: int) -> TrainableBank:
    """A bank with every value ~ N(0, 0.02²) (W3 included, so every memory gradient is
    non-zero from the first step; the paper's init zeroes W3, which times the same)."""
    bank = TrainableBank(a, mem, init="empty")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for t in bank.tables.values():
            t.normal_(0.0, 0.02, generator=g)
    return bank


def make_batches(
    S: dict,
    n: int,
    *,
    seq_len: int,
    n_leaf: int,
    levels: int,
    branching: int,
    seed: int,
    distinct: bool = False,
) -> list[dict]:
    """n batches of random tokens, random leaf paths (global cluster ids per level) and
    generic-memory draws, all from one seeded generator. distinct=True: the batch's leaves
    are distinct (drawn without replacement), so every bank size fetches the same number of
    distinct rows per step."""
    # one generator each, so tokens and generic draws do not depend on the bank size
    g_ids, g_leaf, g_gen = (torch.Generator().manual_seed(seed + i) for i in range(3))
    out = []
    for _ in range(n):
        ids = torch.randint(
            0, S["anchor"]["vocab_size"], (S["batch"], seq_len + 1), generator=g_ids
        )
        if distinct:
            leaf = torch.randperm(n_leaf, generator=g_leaf)[: S["batch"]]
        else:
            leaf = torch.randint(0, n_leaf, (S["batch"],), generator=g_leaf)
        paths = torch.stack([leaf // branching ** (levels - lv) for lv in range(1, levels + 1)], 1)
        generic = torch.rand(S["batch"], generator=g_gen) < S["generic_prob"]
        out.append({"ids": ids, "paths": paths, "generic": generic})
    return out


class Trainer:
    """One model instance: anchor (+ bank) and its optimizers; `step` times one training step.

    sparse=True: the bank's own forward (F.embedding(sparse=True)) and MemoryAdamW over anchor
    and bank together. sparse=False: F.embedding(sparse=False), so the bank tables get dense
    gradients, and a plain torch.optim.AdamW (defaults) steps the tables; the anchor keeps
    MemoryAdamW, so only the bank's handling differs.
    """

    def __init__(
        self,
        S: dict,
        a: AnchorShape,
        mem: MemoryConfig | None,
        *,
        sparse: bool = True,
        max_grad_norm: float | None = None,
        seq_len: int | None = None,
        read: str = "gather",
    ) -> None:
        torch.manual_seed(S["seed"])
        self.a, self.mem, self.sparse, self.read = a, mem, sparse, read
        self.device = torch.device(S.get("device", "cpu"))
        seq_len = seq_len or S["seq_len"]
        self.model = AnchorLM(ModelConfig(anchor=a, max_seq_len=seq_len, memory=mem)).to(
            self.device
        )
        self.bank = make_bank(a, mem, S["seed"]).to(self.device) if mem is not None else None
        kw = {"lr": S["lr"], "betas": tuple(S["betas"]), "eps": 1e-8, "weight_decay": 0.0}
        groups = [{"params": list(self.model.parameters())}]
        self.dense_opt = None
        if self.bank is not None and sparse:
            groups.append({"params": list(self.bank.bank_parameters())})
        elif self.bank is not None:
            self.dense_opt = torch.optim.AdamW(list(self.bank.bank_parameters()), **kw)
        self.opt = MemoryAdamW(groups, max_grad_norm=max_grad_norm, **kw)
        self.steps = 0
        self.rows_seen: dict[int, set[int]] = {}
        self.distinct_rows: list[int] = []  # distinct bank rows fetched per step
        self.cpu_share: list[float] = []

    def step(self, batch: dict) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        mems = None
        if self.bank is not None:
            slots = self.bank.slots(batch["paths"], batch["generic"])
            self.distinct_rows.append(sum(len(set(r.tolist())) for r in slots.values()))
            for lv, r in slots.items():
                self.rows_seen.setdefault(lv, set()).update(r.tolist())
            if self.read == "fused":
                mems = self.bank.read(slots)
            elif self.sparse:
                blocks = self.bank(slots)
            else:
                blocks = {
                    lv: F.embedding(r, self.bank.tables[str(lv)], sparse=False)
                    for lv, r in slots.items()
                }
            if self.read != "fused":
                mems = assemble_memories(blocks, self.a, self.mem)
        ids = batch["ids"]
        logits = self.model(ids[:, :-1], memories=mems)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        if self.dense_opt is not None:
            self.dense_opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.dense_opt is not None:
            self.dense_opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":  # the step is done when the device is
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        # CPU seconds of this process per wall second: ~ the thread count when the machine is
        # quiet, lower when other work takes the cores (a contaminated step)
        self.cpu_share.append((time.process_time() - c0) / dt)
        self.steps += 1
        return dt, float(loss)

    def bank_state_bytes(self) -> int:
        """Optimizer-state bytes held for the bank tables, counted as
        `MemoryAdamW.state_bytes()` counts them (every tensor in the parameter's state)."""
        if self.bank is None:
            return 0
        opt = self.opt if self.sparse else self.dense_opt
        total = 0
        for p in self.bank.bank_parameters():
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total
