"""The memory bank as trainable parameters: per-level block tables with sparse gradients.

Each memory level is one `nn.Parameter` of shape (n_slots, P_level): a row per
cluster (global id minus the bank's first id — a per-subtree bank holds only
its subtree's rows) plus a last row for the generic memory, exactly the slot
order of the on-disk `memtree-bank` format (memstore/README.md). A batch's
blocks are read in one of two ways, both with a sparse gradient over the rows
fetched in the step — nothing bank-sized is touched by the backward pass, and
`training.optim.MemoryAdamW` updates only those rows, so step time does not
grow with the bank:
- `read` (KV and FFN memories, the trainer's default): every memory layer's
  tensors as views into the tables, read in place by the fused kernels
  (`kernels.memory_attention`, `kernels.ffn_memory`) by row index. No (B, P)
  copy of the blocks is made. The kernels hand back sparse gradients per view;
  `_RowViews` merges them into one sparse gradient of the table.
- `forward` (gathered): `F.embedding(..., sparse=True)` copies each sequence's
  rows, (B, P_level), for `training.model.assemble_memories`; LoRA memories,
  which have no in-place kernel, and `memory.read: gather` use it.

Generic memory (seed 002 §4): during co-training a sequence uses the generic
row with probability 1/branching and its fetched path otherwise; at evaluation
either can be asked for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memtree.bank_init import paper_block
from memtree.geometry import AnchorShape, MemoryConfig, block_layout
from memtree.memstore.format import GENERIC, BankInfo
from memtree.memstore.store import MemoryStore, TierConfig
from memtree.memstore.writer import write_bank
from memtree.training.model import BankRead, Memories, ReadTables

_ALL_RAM = TierConfig(name="ram", kind="ram")

# memory types with an in-place (fused) read; LoRA memories are always gathered
READ_IN_PLACE = ("kv", "ffn")


class _RowViews(torch.autograd.Function):
    """Column spans of a (rows, P) table as views (rows, *shape), one per span.

    The kernels that read the views return sparse COO gradients over the rows they
    touched; slicing's own backward has no sparse kernel, so this function is the
    views' backward: it writes each view's gradient rows into its columns of one
    (U, P) buffer for the U rows any view touched and returns a single sparse table
    gradient, like F.embedding(sparse=True). A dense incoming gradient makes the
    table's gradient dense.
    """

    @staticmethod
    def forward(ctx, table: Tensor, spans: tuple[tuple[int, tuple[int, ...]], ...]):
        ctx.set_materialize_grads(False)  # views nobody read get None, not a dense zero
        ctx.spans, ctx.table_shape = spans, table.shape
        n = table.shape[0]
        return tuple(table.narrow(1, off, math.prod(shape)).view(n, *shape) for off, shape in spans)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        got = [
            (off, math.prod(shape), g) for (off, shape), g in zip(ctx.spans, grads) if g is not None
        ]
        if not got:
            return None, None
        n, p = ctx.table_shape
        if any(not g.is_sparse for _, _, g in got):
            out = got[0][2].new_zeros((n, p))
            for off, width, g in got:
                out[:, off : off + width] += g.to_dense().reshape(n, width)
            return out, None
        got = [(off, width, g.coalesce()) for off, width, g in got]
        rows = torch.unique(torch.cat([g.indices()[0] for _, _, g in got]))  # sorted (U,)
        values = got[0][2].values().new_zeros((rows.numel(), p))  # (U, P)
        for off, width, g in got:
            at = torch.searchsorted(rows, g.indices()[0])
            values[at, off : off + width] += g.values().reshape(-1, width)
        return torch.sparse_coo_tensor(rows[None], values, (n, p), is_coalesced=True), None


def _drop_tables(module: nn.Module, state: dict[str, Tensor], prefix: str, local_metadata) -> None:
    for key in [k for k in state if k.startswith(prefix + "tables.")]:
        del state[key]


def _keep_tables(module: nn.Module, state: dict[str, Tensor], prefix: str, *args) -> None:
    """A checkpoint without the shard's tables loads into it unchanged (they come from their own
    files)."""
    for name, table in module.tables.items():
        state.setdefault(f"{prefix}tables.{name}", table.detach())


class TrainableBank(nn.Module):
    """Per-level memory tables; rows = clusters of the (sub)tree, last row = generic memory."""

    # Composer's FSDP skips children marked so: the tables stay whole on every rank, since a
    # step reads a handful of rows by index and FSDP's flat shards cannot take sparse gradients.
    # `MemoryAdamW` averages the sparse gradients across ranks instead.
    _fsdp_wrap = False

    def __init__(
        self,
        anchor: AnchorShape,
        memory: MemoryConfig,
        *,
        subtree: int | None = None,
        shard: tuple[int, ...] | None = None,
        init: str = "paper",
        seed: int = 0,
        std: float = 0.02,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if init not in ("paper", "zeros", "empty"):
            raise ValueError(f"bank init {init!r} is not one of 'paper', 'zeros', 'empty'")
        B = memory.branching
        if subtree is not None and not 0 <= subtree < B:
            raise ValueError(f"subtree {subtree} must be in [0, {B})")
        if shard is not None:
            if subtree is not None:
                raise ValueError(
                    "a bank is either one subtree's (subtree) or a shard of the whole tree's "
                    "(shard)"
                )
            shard = tuple(sorted({int(s) for s in shard}))
            if not shard or not all(0 <= s < B for s in shard):
                raise ValueError(f"shard {shard}: needs one or more level-1 subtrees in [0, {B})")
        self.anchor, self.memory, self.subtree, self.shard = anchor, memory, subtree, shard
        self.levels = [lv for lv, m in enumerate(memory.multipliers, start=1) if m > 0]
        if not self.levels:
            raise ValueError(f"memory config {memory.multipliers} has no non-zero level")
        # level-1 subtree -> its position among the held subtrees (-1: not held); the rows of the
        # i-th held subtree at level l are [i * B**(l-1), (i+1) * B**(l-1)), so a whole-tree or
        # one-subtree bank is the special case of consecutive subtrees
        held = (
            shard if shard is not None else ((subtree,) if subtree is not None else tuple(range(B)))
        )
        self.held_subtrees = held
        # a plain tensor on the CPU, not a buffer: the model maps paths to rows on the host
        # (`MemtreeLM.memories_for`); `local_rows` follows the paths' device when they are elsewhere
        self._position = torch.full((B,), -1, dtype=torch.long)
        self._position[list(held)] = torch.arange(len(held))
        self.first: dict[int, int] = {}
        self.n_blocks: dict[int, int] = {}
        self.tables = nn.ParameterDict()
        for lv in self.levels:
            n = len(held) * B ** (lv - 1)
            self.n_blocks[lv] = n
            self.first[lv] = held[0] * B ** (lv - 1) if shard is None else -1  # -1: not one range
            layout = tuple(block_layout(anchor, memory, lv))
            params = sum(t.numel for t in layout)
            table = torch.zeros(n + 1, params, dtype=dtype)
            if init == "paper":
                clusters = self.clusters(lv)
                for row in range(n + 1):
                    cluster = GENERIC if row == n else int(clusters[row])
                    table[row] = paper_block(
                        layout, seed=seed, level=lv, cluster=cluster, std=std
                    ).to(dtype)
            self.tables[str(lv)] = nn.Parameter(table)
        if shard is not None:
            # each rank holds other rows: they are saved per subtree by `training.bank_shards`,
            # never in the rank-0 Composer checkpoint (which would restore rank 0's rows everywhere)
            self.register_state_dict_post_hook(_drop_tables)
            self.register_load_state_dict_pre_hook(_keep_tables)

    # -- addressing --------------------------------------------------------------
    def generic_slot(self, level: int) -> int:
        return self.n_blocks[level]

    def clusters(self, level: int) -> Tensor:
        """(n_blocks[level],) int64: the global cluster id of each row (the generic row
        excluded)."""
        span = self.memory.branching ** (level - 1)
        held = torch.tensor(self.held_subtrees, dtype=torch.long)
        return (held[:, None] * span + torch.arange(span)[None, :]).reshape(-1)

    def local_rows(self, level: int, clusters: Tensor) -> Tensor:
        """Global cluster ids (any shape) at `level` → this bank's rows, -1 where not held."""
        span = self.memory.branching ** (level - 1)
        clusters = clusters.long()
        inside = (clusters >= 0) & (clusters < self.memory.branching * span)
        lut = (
            self._position
            if clusters.device == self._position.device
            else self._position.to(clusters.device)
        )
        pos = lut[(clusters // span).clamp(0, self.memory.branching - 1)]
        rows = pos * span + clusters % span
        return torch.where(inside & (pos >= 0), rows, torch.full_like(rows, -1))

    def slots(
        self, paths: torch.Tensor, use_generic: torch.Tensor | None = None
    ) -> dict[int, torch.Tensor]:
        """paths (B, L) global cluster ids → {level: (B,) row indices}; rows where
        use_generic (B,) is True get the generic memory's row."""
        if paths.ndim != 2 or paths.shape[1] < max(self.levels):
            raise ValueError(f"paths must be (B, >= {max(self.levels)}), got {tuple(paths.shape)}")
        out = {}
        for lv in self.levels:
            local = self.local_rows(lv, paths[:, lv - 1])
            bad = local < 0
            if use_generic is not None:
                bad &= ~use_generic
            if bool(bad.any()):
                ids = paths[:, lv - 1][bad][:5].tolist()
                if self.shard is not None:
                    where = (
                        f"this rank's bank shard (level-1 subtrees {list(self.shard)}; with "
                        "parallel.bank: sharded a rank reads only its subtrees' data)"
                    )
                elif self.subtree is not None:
                    where = (
                        f"subtree {self.subtree} (rows {self.first[lv]}…"
                        f"{self.first[lv] + self.n_blocks[lv] - 1})"
                    )
                else:
                    where = f"the tree (rows 0…{self.n_blocks[lv] - 1})"
                raise ValueError(f"level {lv}: cluster ids {ids} are outside {where}")
            if use_generic is not None:
                local = torch.where(use_generic, torch.full_like(local, self.n_blocks[lv]), local)
            out[lv] = local
        return out

    @staticmethod
    def draw_generic(batch: int, branching: int, generator: torch.Generator) -> torch.Tensor:
        """(B,) bool: True with probability 1/branching (the paper's generic-memory rate)."""
        return torch.rand(batch, generator=generator) < 1.0 / branching

    def forward(self, slots: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{level: (B,) rows} → {level: (B, P_level)} blocks; gradients are sparse over the rows."""
        return {
            lv: F.embedding(rows, self.tables[str(lv)], sparse=True) for lv, rows in slots.items()
        }

    def read(self, slots: dict[int, Tensor]) -> Memories:
        """{level: (B,) rows} → {layer: BankRead} for KV and FFN memories: each memory
        layer's tensors as views into the tables (KV (N, m, H_kv, D), FFN (N, W, d)),
        read in place by the fused kernels; gradients stay sparse over the rows."""
        kind = self.memory.type
        if kind not in READ_IN_PLACE:
            raise ValueError(f"{kind} memories have no in-place read; use forward() (gathered)")
        shape_of = {
            "kv": lambda w: (w, self.anchor.kv_heads, self.anchor.head_dim),
            "ffn": lambda w: (w, self.anchor.d_model),
        }[kind]
        per_layer: dict[int, list[tuple[dict[str, Tensor], Tensor]]] = {}
        for lv, rows in slots.items():
            names, spans, off = [], [], 0
            for t in block_layout(self.anchor, self.memory, lv):
                _, layer, name = t.name.split(".")
                names.append((int(layer), name))
                spans.append((off, shape_of(t.shape[0])))
                off += t.numel
            views = _RowViews.apply(self.tables[str(lv)], tuple(spans))
            by_layer: dict[int, dict[str, Tensor]] = {}
            for (layer, name), view in zip(names, views, strict=True):
                by_layer.setdefault(layer, {})[name] = view
            for layer, tensors in by_layer.items():
                per_layer.setdefault(layer, []).append((tensors, rows))
        tables = (
            ReadTables()
        )  # one KV or FFN table per level, built by the first layer that reads it
        return {
            layer: BankRead(levels=tuple(levels), tables=tables)
            for layer, levels in sorted(per_layer.items())
        }

    def bank_parameters(self) -> Iterator[nn.Parameter]:
        yield from self.tables.values()

    # -- memstore interop -----------------------------------------------------------
    def export(
        self,
        root: str | os.PathLike,
        *,
        dtype: str = "bf16",
        tree_id: str | None = None,
        rank: int | None = None,
    ) -> BankInfo:
        """Write the bank in the memstore format (a per-subtree bank if this is one)."""

        if self.shard is not None:
            raise ValueError(
                "a bank shard holds some subtrees' rows only: export the run's bank with "
                "training.bank_shards.export_bank (it streams every shard's rows)"
            )

        def blocks(level: int):
            table = self.tables[str(level)].detach().float().cpu()
            for row in range(table.shape[0]):
                cluster = GENERIC if row == self.n_blocks[level] else self.first[level] + row
                yield cluster, table[row]

        return write_bank(
            root,
            anchor=self.anchor,
            memory=self.memory,
            dtype=dtype,
            rank=rank,
            tree_id=tree_id,
            subtree=self.subtree,
            generic=True,
            blocks=blocks,
        )

    @classmethod
    def from_bank(
        cls, root: str | os.PathLike, *, dtype: torch.dtype = torch.float32
    ) -> TrainableBank:
        """Load every block of a memstore bank (dequantised) into trainable tables."""
        with MemoryStore(
            root, tiers=[_ALL_RAM], placement="hierarchical", out_dtype=torch.float32
        ) as store:
            info = store.info
            bank = cls(info.anchor, info.memory, subtree=info.subtree, init="empty", dtype=dtype)
            for lv in bank.levels:
                li = info.level(lv)
                if not li.has_generic:
                    raise ValueError(
                        f"{root}: level {lv} has no generic-memory slot; the trainer needs one"
                    )
                with torch.no_grad():
                    for row in range(li.n_slots):
                        cluster = GENERIC if row == li.n_blocks else li.first_cluster + row
                        # bypass blocking: training resumes from every stored value
                        bank.tables[str(lv)][row] = store._read_slot(
                            store.levels[lv], li.slot(cluster)
                        ).to(dtype)
        return bank
