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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer


class MemoryAdamW(Optimizer):
    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                 dense_sharded: bool = False) -> None:
        if lr < 0 or eps <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"invalid MemoryAdamW hyperparameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.max_grad_norm = max_grad_norm
        # FSDP: each rank holds a shard of every dense gradient, so the squared norms are summed
        # across ranks; sparse (bank) gradients are replicated after `_sync_sparse_grads`.
        self.dense_sharded = dense_sharded
        self.last_grad_norm: float | None = None
        self.last_rows: dict[int, int] = {}  # id(param) → rows updated in the last step

    def _sync_sparse_grads(self) -> None:
        """Average sparse gradients across data-parallel ranks.

        DDP cannot bucket sparse gradients, so the bank tables are excluded from
        DDP (`MemtreeLM` lists them in `_ddp_params_and_buffers_to_ignore`) and
        reduced here: every rank's (rows, values) are gathered and summed, then
        divided by the world size as DDP does for dense gradients."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.grad.is_sparse:
                    continue
                g = p.grad.coalesce()
                rows, vals = g.indices()[0], g.values()
                n = torch.tensor([len(rows)], device=vals.device)
                sizes = [torch.zeros_like(n) for _ in range(world)]
                dist.all_gather(sizes, n)
                cap = int(max(int(x) for x in sizes))
                pad_rows = torch.zeros(cap, dtype=rows.dtype, device=rows.device)
                pad_vals = torch.zeros(cap, vals.shape[1], dtype=vals.dtype, device=vals.device)
                pad_rows[: len(rows)], pad_vals[: len(rows)] = rows, vals
                all_rows = [torch.zeros_like(pad_rows) for _ in range(world)]
                all_vals = [torch.zeros_like(pad_vals) for _ in range(world)]
                dist.all_gather(all_rows, pad_rows)
                dist.all_gather(all_vals, pad_vals)
                idx = torch.cat([r[: int(k)] for r, k in zip(all_rows, sizes, strict=True)])
                val = torch.cat([v[: int(k)] for v, k in zip(all_vals, sizes, strict=True)]) / world
                p.grad = torch.sparse_coo_tensor(idx[None], val, p.shape).coalesce()

    def _clip_coef(self) -> float:
        dense_sq, sparse_sq = 0.0, 0.0
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    sparse_sq = sparse_sq + g.coalesce().values().double().pow(2).sum()
                else:
                    dense_sq = dense_sq + g.double().pow(2).sum()
        if self.dense_sharded:
            dense_sq = self._sum_across_ranks(dense_sq)
        norm = float(torch.as_tensor(dense_sq + sparse_sq).sqrt())
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm}; refusing to step")
        if self.max_grad_norm is None or norm <= self.max_grad_norm:
            return 1.0
        return self.max_grad_norm / (norm + 1e-6)

    def _sum_across_ranks(self, value: torch.Tensor | float) -> torch.Tensor | float:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return value
        device = next((p.grad.device for g in self.param_groups for p in g["params"] if p.grad is not None),
                      torch.device("cpu"))
        t = torch.as_tensor(value, dtype=torch.float64).to(device)
        dist.all_reduce(t)  # every rank joins, also one whose shards hold no gradient
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

    def _sparse_step(self, p, coef, lr, b1, b2, eps, wd) -> None:
        g = p.grad.coalesce()
        rows = g.indices()[0]  # (U,)
        vals = g.values().float() * coef  # (U, P)
        st = self.state[p]
        if not st:
            # pool: row r's state lives at pool index slot[r] (-1 = never updated)
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
        idx = slot[rows]
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

    def state_bytes(self) -> int:
        """Bytes of optimizer state (what a dense AdamW would hold: 2 × params × 4)."""
        total = 0
        for st in self.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total
