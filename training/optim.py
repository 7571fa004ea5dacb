"""AdamW for an anchor plus a sparse memory bank, with global gradient clipping.

Dense parameters (the anchor, the generic memory when it is a separate
module) get ordinary decoupled-weight-decay AdamW. Parameters whose gradient
arrives sparse (the bank tables of `training.bank.TrainableBank`, read with
`F.embedding(sparse=True)`) get *lazy* AdamW: only the rows present in the
gradient are updated, each row keeps its own step count for bias correction,
and weight decay is applied to a row only when it is updated. Optimizer state
for sparse parameters lives in a pool that grows as rows are first touched, so
its memory is proportional to the rows ever fetched, not to the bank, and a
step's cost is proportional to the rows fetched in that step.

`max_grad_norm` clips by the global L2 norm over dense gradients and the
(coalesced) sparse values together, as `clip_grad_norm_` would for a dense model.

Across data-parallel ranks a sparse gradient is reduced in one of two ways:
- replicated (the default): every rank holds the whole table, and every rank's
  (rows, values) are all-gathered and summed, so the bytes sent grow with the
  rows the whole batch touched;
- sharded (`shard_rows`, `parallel.bank: sharded`): this rank holds some
  level-1 subtrees' rows plus the generic row, and reads only data routed to
  them, so its owned rows' gradient is already complete (or needs only its
  replica group, when there are more ranks than subtrees); only the generic
  row, which every rank may read, is all-reduced. Nothing that grows with the
  bank crosses the network.
`comm_bytes` counts what each of these collectives sends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer


@dataclass(frozen=True)
class RowShard:
    """A sparse table of which this rank holds a shard (`MemoryAdamW.shard_rows`).

    generic_row: the row every rank holds a replica of (the generic memory), all-reduced;
    group: the process group of the ranks that hold the same other rows (None: this rank alone);
    replicas: that group's size."""

    generic_row: int
    group: Any = None
    replicas: int = 1


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def ring_bytes(kind: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for a collective over n ranks under the ring algorithm (the "bus
    bytes" of nccl-tests): all-reduce 2(n-1)/n of the buffer, all-gather (n-1) times its input."""
    if n <= 1:
        return 0
    return 2 * (n - 1) * nbytes // n if kind == "all_reduce" else (n - 1) * nbytes


class MemoryAdamW(Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        dense_sharded: bool = False,
    ) -> None:
        if lr < 0 or eps <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(
                f"invalid MemoryAdamW hyperparameters lr={lr} betas={betas} eps={eps} "
                f"weight_decay={weight_decay}"
            )
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.max_grad_norm = max_grad_norm
        # FSDP: each rank holds a shard of every dense gradient, so the squared norms are summed
        # across ranks; sparse (bank) gradients are replicated after `_sync_sparse_grads`.
        self.dense_sharded = dense_sharded
        self.last_grad_norm: float | None = None
        self.last_rows: dict[int, int] = {}  # id(param) → rows updated in the last step
        self.row_shards: dict[int, RowShard] = {}  # id(param) → how its rows are split (sharded)
        # bytes this rank sent per collective (ring estimate, `ring_bytes`), cumulative
        self.comm_bytes: dict[str, int] = {}
        # An entry per parameter, so `optim.state` is never empty: torch's distributed
        # state-dict helpers (which Composer saves and loads with) otherwise initialise an
        # empty optimizer by stepping once with dense zero gradients, which for a bank table
        # would allocate a dense gradient and a dense Adam state of the whole table.
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]

    def shard_rows(self, p: torch.Tensor, shard: RowShard) -> None:
        """Mark `p` as this rank's shard of a sparse table (see the module docstring). Its state is
        then kept out of `state_dict()` (each rank's differs; `training.bank_shards` saves it)."""
        if not any(p is q for g in self.param_groups for q in g["params"]):
            raise ValueError("shard_rows: the tensor is not one of this optimizer's parameters")
        self.row_shards[id(p)] = shard

    def _count(self, key: str, kind: str, nbytes: int, n: int) -> None:
        self.comm_bytes[key] = self.comm_bytes.get(key, 0) + ring_bytes(kind, nbytes, n)

    def _gather_rows(self, rows: torch.Tensor, vals: torch.Tensor, group: Any, n: int, key: str):
        """Every rank's (rows (k_r,), vals (k_r, P)) in `group` (n ranks), concatenated."""
        k = torch.tensor([len(rows)], device=vals.device)
        sizes = [torch.zeros_like(k) for _ in range(n)]
        dist.all_gather(sizes, k, group=group)
        self._count("control", "all_gather", k.numel() * k.element_size(), n)
        cap = int(max(int(x) for x in sizes))
        pad_rows = torch.zeros(cap, dtype=rows.dtype, device=rows.device)
        pad_vals = torch.zeros(cap, vals.shape[1], dtype=vals.dtype, device=vals.device)
        pad_rows[: len(rows)], pad_vals[: len(rows)] = rows, vals
        all_rows = [torch.zeros_like(pad_rows) for _ in range(n)]
        all_vals = [torch.zeros_like(pad_vals) for _ in range(n)]
        dist.all_gather(all_rows, pad_rows, group=group)
        dist.all_gather(all_vals, pad_vals, group=group)
        self._count(
            key,
            "all_gather",
            pad_rows.numel() * pad_rows.element_size() + pad_vals.numel() * pad_vals.element_size(),
            n,
        )
        idx = torch.cat([r[: int(c)] for r, c in zip(all_rows, sizes, strict=True)])
        val = torch.cat([v[: int(c)] for v, c in zip(all_vals, sizes, strict=True)])
        return idx, val

    def _sync_sparse_grads(self) -> None:
        """Average sparse gradients across data-parallel ranks.

        DDP cannot bucket sparse gradients, so the bank tables are excluded from
        DDP (`MemtreeLM` lists them in `_ddp_params_and_buffers_to_ignore`) and
        reduced here, divided by the world size as DDP does for dense gradients
        (each rank's loss is scaled by its share of the global batch's tokens):
        a replicated table's (rows, values) are gathered from every rank and
        summed; a sharded table's owned rows only within its replica group, and
        its generic row by one all-reduce for all sharded tables together."""
        world = _world()
        if world == 1:
            return
        generic: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, RowShard]] = []
        for group in self.param_groups:
            for p in group["params"]:
                shard = self.row_shards.get(id(p))
                if shard is None:
                    if p.grad is None or not p.grad.is_sparse:
                        continue
                    g = p.grad.coalesce()
                    idx, val = self._gather_rows(
                        g.indices()[0], g.values(), None, world, "bank_rows_all_gather"
                    )
                    p.grad = torch.sparse_coo_tensor(idx[None], val / world, p.shape).coalesce()
                    continue
                # every rank joins a sharded table's collectives, also one that read none of its
                # rows (a forward without memory): the others would wait for it
                g = p.grad
                if g is None:
                    g = torch.sparse_coo_tensor(
                        torch.zeros(1, 0, dtype=torch.long, device=p.device),
                        p.new_zeros(0, p.shape[1]),
                        p.shape,
                    )
                elif not g.is_sparse:
                    g = g.to_sparse(sparse_dim=1)
                g = g.coalesce()
                rows, vals = g.indices()[0], g.values()
                own = rows != shard.generic_row
                rows_own, vals_own = rows[own], vals[own]
                if shard.replicas > 1:
                    rows_own, vals_own = self._gather_rows(
                        rows_own, vals_own, shard.group, shard.replicas, "bank_group_all_gather"
                    )
                at = torch.nonzero(~own).flatten()  # where the generic row is, if this rank read it
                flat = vals.new_zeros(
                    vals.shape[1] + 1
                )  # (P + 1,): the row's gradient, then "read"
                if len(at):
                    flat[:-1], flat[-1] = vals[at[0]], 1.0
                generic.append((p, rows_own, vals_own, flat))
        if not generic:
            return
        buf = torch.cat([flat for *_, flat in generic])  # one all-reduce for every sharded table
        dist.all_reduce(buf)
        self._count(
            "bank_generic_all_reduce", "all_reduce", buf.numel() * buf.element_size(), world
        )
        off = 0
        for p, rows_own, vals_own, flat in generic:
            n = flat.numel()
            part, off = buf[off : off + n], off + n
            shard = self.row_shards[id(p)]
            if float(part[-1]) > 0:  # some rank read the generic row: it is updated, as replicated
                rows_own = torch.cat([rows_own, rows_own.new_tensor([shard.generic_row])])
                vals_own = torch.cat([vals_own, part[None, :-1]])
            p.grad = torch.sparse_coo_tensor(rows_own[None], vals_own / world, p.shape).coalesce()

    def _clip_coef(self) -> float:
        # dense: the anchor (replicated, or sharded under FSDP); sparse: replicated tables and the
        # generic rows (the same on every rank after the sync); sharded: owned rows, the same on a
        # replica group's ranks, so each counts 1/replicas of its group's sum
        dense_sq, sparse_sq, sharded_sq = 0.0, 0.0, 0.0
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if not g.is_sparse:
                    dense_sq = dense_sq + g.double().pow(2).sum()
                    continue
                g = g.coalesce()
                sq = g.values().double().pow(2).sum(1)  # (U,)
                shard = self.row_shards.get(id(p))
                if shard is None:
                    sparse_sq = sparse_sq + sq.sum()
                else:
                    generic = g.indices()[0] == shard.generic_row
                    sparse_sq = sparse_sq + sq[generic].sum()
                    sharded_sq = sharded_sq + sq[~generic].sum() / shard.replicas
        if self.row_shards or self.dense_sharded:
            parts = self._sum_across_ranks(
                torch.stack(
                    [
                        torch.as_tensor(x, dtype=torch.float64).cpu()
                        for x in (dense_sq if self.dense_sharded else 0.0, sharded_sq)
                    ]
                )
            )
            if self.dense_sharded:
                dense_sq = parts[0]
            sharded_sq = parts[1]
        norm = float(torch.as_tensor(dense_sq + sparse_sq + sharded_sq).sqrt())
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm}; refusing to step")
        if self.max_grad_norm is None or norm <= self.max_grad_norm:
            return 1.0
        return self.max_grad_norm / (norm + 1e-6)

    def _sum_across_ranks(self, value: torch.Tensor | float) -> torch.Tensor | float:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return value
        device = next(
            (p.grad.device for g in self.param_groups for p in g["params"] if p.grad is not None),
            torch.device("cpu"),
        )
        t = torch.as_tensor(value, dtype=torch.float64).to(device)
        dist.all_reduce(t)  # every rank joins, also one whose shards hold no gradient
        self._count("control", "all_reduce", t.numel() * t.element_size(), _world())
        return t

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_sparse_grads()
        coef = self._clip_coef()
        self.last_rows = {}
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    self._sparse_step(p, coef, lr, b1, b2, eps, wd)
                else:
                    self._dense_step(p, coef, lr, b1, b2, eps, wd)
        return loss

    def _dense_step(self, p, coef, lr, b1, b2, eps, wd) -> None:
        g = p.grad.float() * coef
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        st["step"] += 1
        m, v, t = st["exp_avg"], st["exp_avg_sq"], st["step"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v / (1 - b2**t)).sqrt_().add_(eps)
        update = (m / (1 - b1**t)) / denom
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)

    def _pool(self, p: torch.Tensor) -> dict[str, Any]:
        """A sparse parameter's lazy state: row r's state lives at pool index slot[r] (-1 = never
        updated); the pool holds `used` rows and grows by doubling, up to the table's rows."""
        st = self.state[p]
        if not st:
            dev = p.device
            st["slot"] = torch.full((p.shape[0],), -1, dtype=torch.long, device=dev)
            st["used"] = torch.zeros((), dtype=torch.long)
            st["exp_avg"] = torch.zeros(0, p.shape[1], device=dev)
            st["exp_avg_sq"] = torch.zeros(0, p.shape[1], device=dev)
            st["steps"] = torch.zeros(0, dtype=torch.long, device=dev)
        for key in ("slot", "used", "steps"):
            # Optimizer.load_state_dict casts every non-"step" state tensor to the param dtype
            if st[key].dtype != torch.long:
                st[key] = st[key].round().long()
        return st

    def _admit(self, p: torch.Tensor, st: dict[str, Any], rows: torch.Tensor) -> None:
        """Give the rows (U,) that have no pool entry yet one each."""
        slot = st["slot"]
        new = rows[slot[rows] < 0]
        if len(new):
            used = int(st["used"])
            need = used + len(new)
            if need > st["exp_avg"].shape[0]:  # grow by doubling: amortised O(rows touched)
                cap = min(p.shape[0], max(need, 2 * st["exp_avg"].shape[0]))
                for key in ("exp_avg", "exp_avg_sq", "steps"):
                    old = st[key]
                    grown = torch.zeros((cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
                    grown[: old.shape[0]] = old
                    st[key] = grown
            slot[new] = torch.arange(used, need, device=slot.device)
            st["used"] = torch.tensor(need)

    def _sparse_step(self, p, coef, lr, b1, b2, eps, wd) -> None:
        g = p.grad.coalesce()
        rows = g.indices()[0]  # (U,)
        vals = g.values().float() * coef  # (U, P)
        st = self._pool(p)
        self._admit(p, st, rows)
        idx = st["slot"][rows]
        st["steps"][idx] += 1
        t = st["steps"][idx].double()
        m = st["exp_avg"][idx].mul_(b1).add_(vals, alpha=1 - b1)
        v = st["exp_avg_sq"][idx].mul_(b2).addcmul_(vals, vals, value=1 - b2)
        st["exp_avg"][idx] = m
        st["exp_avg_sq"][idx] = v
        bc1 = (1 - b1**t).float()[:, None]
        bc2 = (1 - b2**t).float()[:, None]
        update = (m / bc1) / ((v / bc2).sqrt() + eps)
        w = p[rows].float()
        if wd:
            w.mul_(1 - lr * wd)
        p[rows] = (w - lr * update).to(p.dtype)
        self.last_rows[id(p)] = len(rows)

    def row_state(self, p: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The lazy Adam state of a sparse parameter's rows `rows` (R,) that were ever updated:
        {"rows": (U,) those rows, in the order given, "exp_avg", "exp_avg_sq": (U, P) float32,
        "steps": (U,) int64 updates per row}; the state of a row never updated is all zero."""
        st = self._pool(p)
        rows = rows.to(st["slot"].device)
        idx = st["slot"][rows]
        have = idx >= 0
        idx = idx[have]
        return {
            "rows": rows[have],
            "exp_avg": st["exp_avg"][idx],
            "exp_avg_sq": st["exp_avg_sq"][idx],
            "steps": st["steps"][idx],
        }

    def load_row_state(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Set rows' lazy Adam state from `row_state`'s layout (rows of this parameter)."""
        st = self._pool(p)
        dev = st["slot"].device
        rows = state["rows"].to(dev).long()
        if len(rows) == 0:
            return
        self._admit(p, st, rows)
        idx = st["slot"][rows]
        st["exp_avg"][idx] = state["exp_avg"].to(dev, torch.float32)
        st["exp_avg_sq"][idx] = state["exp_avg_sq"].to(dev, torch.float32)
        st["steps"][idx] = state["steps"].to(dev).long()

    def state_dict(self) -> dict[str, Any]:
        """As torch's, with the state of sharded tables left empty: each rank holds other rows, and
        a Composer checkpoint keeps rank 0's state only (`training.bank_shards` saves theirs)."""
        sd = super().state_dict()
        if self.row_shards:
            at = 0
            for group in self.param_groups:
                for p in group["params"]:
                    if id(p) in self.row_shards and at in sd["state"]:
                        sd["state"][at] = {}
                    at += 1
        return sd

    def state_bytes(self) -> int:
        """Bytes of optimizer state (what a dense AdamW would hold: 2 × params × 4)."""
        total = 0
        for st in self.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total
