"""The memory bank as trainable parameters: per-level block tables with sparse gradients.

Each memory level is one `nn.Parameter` of shape (n_slots, P_level): a row per
cluster (global id minus the bank's first id — a per-subtree bank holds only
its subtree's rows) plus a last row for the generic memory, exactly the slot
order of the on-disk `memtree-bank` format (memstore/README.md). A batch's
blocks are read with `F.embedding(..., sparse=True)`, so the gradient is a
sparse tensor over the rows fetched in the step: nothing bank-sized is
touched by the backward pass, and `training.optim.MemoryAdamW` updates only
those rows. Step time therefore does not grow with the bank.

Generic memory (seed 002 §4): during co-training a sequence uses the generic
row with probability 1/branching and its fetched path otherwise; at evaluation
either can be asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from memstore.format import GENERIC, BankInfo, RecordCodec, paper_init, write_bank
from memstore.geometry import AnchorShape, MemoryConfig, block_layout
from memstore.store import MemoryStore, TierConfig

_ALL_RAM = TierConfig(name="ram", kind="ram")


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
        self.anchor, self.memory, self.subtree = anchor, memory, subtree
        self.levels = [lv for lv, m in enumerate(memory.multipliers, start=1) if m > 0]
        if not self.levels:
            raise ValueError(f"memory config {memory.multipliers} has no non-zero level")
        self.first: dict[int, int] = {}
        self.n_blocks: dict[int, int] = {}
        self.tables = nn.ParameterDict()
        fill = paper_init(seed, std)
        for lv in self.levels:
            n = B ** (lv - 1) if subtree is not None else B**lv
            self.n_blocks[lv] = n
            self.first[lv] = subtree * B ** (lv - 1) if subtree is not None else 0
            layout = tuple(block_layout(anchor, memory, lv))
            params = sum(t.numel for t in layout)
            table = torch.zeros(n + 1, params, dtype=dtype)
            if init == "paper":
                codec = RecordCodec(layout, "fp32")
                for row in range(n + 1):
                    cluster = GENERIC if row == n else self.first[lv] + row
                    table[row] = fill(lv, cluster, codec).to(dtype)
            self.tables[str(lv)] = nn.Parameter(table)

    # -- addressing --------------------------------------------------------------
    def generic_slot(self, level: int) -> int:
        return self.n_blocks[level]

    def slots(self, paths: torch.Tensor, use_generic: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """paths (B, L) global cluster ids → {level: (B,) row indices}; rows where
        use_generic (B,) is True get the generic memory's row."""
        if paths.ndim != 2 or paths.shape[1] < max(self.levels):
            raise ValueError(f"paths must be (B, >= {max(self.levels)}), got {tuple(paths.shape)}")
        out = {}
        for lv in self.levels:
            local = paths[:, lv - 1].long() - self.first[lv]
            bad = (local < 0) | (local >= self.n_blocks[lv])
            if use_generic is not None:
                bad &= ~use_generic
            if bool(bad.any()):
                ids = paths[:, lv - 1][bad][:5].tolist()
                where = f"subtree {self.subtree}" if self.subtree is not None else "the tree"
                raise ValueError(f"level {lv}: cluster ids {ids} are outside {where} "
                                 f"(rows {self.first[lv]}…{self.first[lv] + self.n_blocks[lv] - 1})")
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
        return {lv: F.embedding(rows, self.tables[str(lv)], sparse=True) for lv, rows in slots.items()}

    def bank_parameters(self) -> Iterator[nn.Parameter]:
        yield from self.tables.values()

    # -- memstore interop -----------------------------------------------------------
    def export(self, root: str | os.PathLike, *, dtype: str = "bf16", tree_id: str | None = None,
               rank: int | None = None) -> BankInfo:
        """Write the bank in the memstore format (a per-subtree bank if this is one)."""

        def blocks(level: int):
            table = self.tables[str(level)].detach().float().cpu()
            for row in range(table.shape[0]):
                cluster = GENERIC if row == self.n_blocks[level] else self.first[level] + row
                yield cluster, table[row]

        return write_bank(root, anchor=self.anchor, memory=self.memory, dtype=dtype, rank=rank, tree_id=tree_id,
                          subtree=self.subtree, generic=True, blocks=blocks)

    @classmethod
    def from_bank(cls, root: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> TrainableBank:
        """Load every block of a memstore bank (dequantised) into trainable tables."""
        with MemoryStore(root, tiers=[_ALL_RAM], placement="hierarchical", out_dtype=torch.float32) as store:
            info = store.info
            bank = cls(info.anchor, info.memory, subtree=info.subtree, init="empty", dtype=dtype)
            for lv in bank.levels:
                li = info.level(lv)
                if not li.has_generic:
                    raise ValueError(f"{root}: level {lv} has no generic-memory slot; the trainer needs one")
                with torch.no_grad():
                    for row in range(li.n_slots):
                        cluster = GENERIC if row == li.n_blocks else li.first_cluster + row
                        # bypass blocking: training resumes from every stored value
                        bank.tables[str(lv)][row] = store._read_slot(store.levels[lv], li.slot(cluster)).to(dtype)
        return bank

