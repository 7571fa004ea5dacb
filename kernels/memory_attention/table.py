"""The reference table of memory attention's Triton path (seed 004 §8.5), built on the device.

`build_table` turns the index lists into the table the kernels of `kernel.py` read (see that
module's docstring for what each part means); `Layout` gives its static shapes from the shapes
alone, so every grid and buffer size is known without reading device data; `dkv_chunks` splits
the dK/dV work of each unique block into chunks.

No host synchronisation anywhere: fixed-shape torch ops only, every data-dependent size padded
to its static bound with the real counts left on the device. Entries that must not land
anywhere (padding, repeats) are routed to spare elements (slot 0 of every group, the first
element of the unique-block arrays) rather than selected by boolean masks, each of which would
be a sync (profiled on an H100: a dozen such syncs made the table cost 2.5 ms per call, four
times the forward kernel). Where every writer of an element writes the same value (all the
entries of one block write its slot's id; all the pairs of one unique block its id), a plain
scatter is used: duplicates are then harmless.

Host cost: each torch op costs ~30 µs of host time on the profiled H100 VM, more than the
kernels' device time at moc's shape, so the build is written for few ops: per-shape constants
are cached (`_consts`), the spare elements replace `where` masks, and the parts are packed into
one int32 buffer by a single cat. Ops per call at bench/kernels/kernel_ops.py's moc shape, counted
with a TorchDispatchMode on the CPU (non-view ops / all dispatched, views included):
per sequence 28 / 70 unweighted, 34 / 77 weighted; per token 31 / 74 and 38 / 84 (before
this rework: 77 / 139, 76 / 138, 78 / 143, 78 / 144). test_table_build_stays_few_ops guards it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Static shapes of one call's reference table, from the shapes alone (no data): every
    data-dependent size is replaced by its upper bound and the real counts stay on the
    device (group_count, the unique-block arrays), read by the kernels. The table travels
    from forward to backward as two flat buffers, `ints` (int32) and `coef` (fp32); these
    are their parts.

    G = groups (sequences, or query tiles for per-token lists), TPG = tokens per group
    (TS per token, 1 per sequence), L = slots per group <= min(TPG·k, N), U_max = unique
    blocks <= min(N, G·L). Slot 0 of the (G, L + 1) arrays and element 0 of the
    (U_max + 2) ones are spares (the views the kernels read skip them).
    """

    per_token: bool
    tokens_per_tile: int  # TS
    n_s_tiles: int  # query tiles per sequence
    n_groups: int  # G
    n_slots: int  # L
    tpg: int  # TPG
    u_max: int  # U_max
    seq_len: int  # S
    first_shape: tuple  # block_idx's shape (per token: S padded to whole tiles); () unweighted

    @classmethod
    def of(cls, block_shape: tuple, s, n_bank, tokens_per_tile: int, weighted: bool) -> Layout:
        # plain arithmetic (no int()): the fake implementation passes symbolic sizes
        per_token = len(block_shape) == 3
        b, k = block_shape[0], block_shape[-1]
        n_s_tiles = (s + tokens_per_tile - 1) // tokens_per_tile
        n_groups = b * n_s_tiles if per_token else b
        tpg = tokens_per_tile if per_token else 1
        n_slots = torch.sym_max(1, torch.sym_min(tpg * k, n_bank))
        u_max = torch.sym_max(1, torch.sym_min(n_bank, n_groups * n_slots))
        first = (b, n_s_tiles * tokens_per_tile, k) if per_token else (b, k)
        return cls(
            per_token=per_token,
            tokens_per_tile=tokens_per_tile,
            n_s_tiles=n_s_tiles,
            n_groups=n_groups,
            n_slots=n_slots,
            tpg=tpg,
            u_max=u_max,
            seq_len=s,
            first_shape=first if weighted else (0,),
        )

    def int_parts(self) -> list[tuple[str, tuple]]:
        g, sl, u = self.n_groups, self.n_slots, self.u_max
        return [
            ("group_blocks", (g, sl + 1)),
            ("group_count", (g,)),
            ("ent", (g, sl + 1, self.tpg)),
            ("first", self.first_shape),
            ("ublocks", (u + 2,)),
            ("pair_off", (u + 2,)),
            ("pairs", (g * sl,)),
        ]

    def numels(self) -> tuple:
        """(ints, coef) buffer sizes."""
        n_int = sum(math.prod(shape) for _, shape in self.int_parts())
        return n_int, self.n_groups * (self.n_slots + 1) * self.tpg


def split_parts(int_parts: list[tuple[str, tuple]], ints: Tensor) -> dict[str, Tensor]:
    """{name: view of its shape} for the parts packed one after another into ints."""
    parts, off = {}, 0
    for name, shape in int_parts:
        n = math.prod(shape)
        parts[name] = ints[off : off + n].view(shape)
        off += n
    return parts


@dataclass(frozen=True, kw_only=True)
class Table:
    """Reference table of one call (see kernel.py's docstring), views into `ints`/`coef_buf`.
    G = groups, L = slots (static bounds, see Layout)."""

    layout: Layout
    ints: Tensor  # (n_int,) int32: every part below but coef
    coef_buf: Tensor  # (n_coef,) fp32: coef with its spare slot
    group_blocks: Tensor  # (G, L) int32 block id per slot; N beyond the group's count
    group_count: Tensor  # (G,) int32 slots used
    coef: Tensor  # (G, L, TS) fp32 per sequence (G, L, 1), read with token stride 0
    ent: Tensor  # (G, L, TS) int32 first entry of the token naming the slot, -1 if none
    first: Tensor  # like block_idx, int32: first entry naming the same block, -1 for padding
    #                (weighted calls only; empty otherwise)
    ublocks: Tensor  # (U_max + 1,) int32 sorted unique referenced blocks, then N (padding)
    pair_off: Tensor  # (U_max + 1,) int32 CSR offsets into pairs (see build_table)
    pairs: Tensor  # (G·L,) int32 group·L + slot of every pair, grouped by unique block

    per_token = property(lambda self: self.layout.per_token)
    tokens_per_tile = property(lambda self: self.layout.tokens_per_tile)
    n_s_tiles = property(lambda self: self.layout.n_s_tiles)

    @classmethod
    def unpack(cls, layout: Layout, ints: Tensor, coef: Tensor) -> Table:
        parts = split_parts(layout.int_parts(), ints)
        for name in ("group_blocks", "ent"):  # skip the spare slot 0
            parts[name] = parts[name][:, 1:]
        for name in ("ublocks", "pair_off"):  # skip the spare element 0
            parts[name] = parts[name][1:]
        if layout.per_token and layout.first_shape != (0,):
            parts["first"] = parts["first"][:, : layout.seq_len]
        lay = layout
        return cls(
            layout=layout,
            ints=ints,
            coef_buf=coef,
            coef=coef.view(lay.n_groups, lay.n_slots + 1, lay.tpg)[:, 1:],
            **parts,
        )

    @property
    def coef_token_stride(self) -> int:
        return self.coef.stride(2) if self.per_token else 0

    @property
    def ent_token_stride(self) -> int:
        return self.ent.stride(2) if self.per_token else 0


class UnpackedTables:
    """The tables a process read lately, unpacked once: {buffers -> (Table, dK/dV chunks)}.

    A table shared by a model's layers (one per memory level and step) is unpacked by every
    layer's forward and backward and its dK/dV split recomputed by every backward; on the
    profiled H100 host those cost ~0.1 ms and ~0.28 ms per call (a dozen small ops each) for
    results that depend on the buffers alone. Keyed by the buffers' addresses, sizes and
    device and the layout: an entry holds views of its buffers, so their memory cannot be
    freed, and the address reused by another table, while the entry lives. Bounded (LRU):
    a step holds a few tables; an evicted one is unpacked again."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.entries: dict[tuple, tuple[Table, dict]] = {}

    @staticmethod
    def key(layout: Layout, ints: Tensor, coef: Tensor) -> tuple:
        return (layout, ints.device, ints.data_ptr(), ints.numel(), coef.data_ptr(), coef.numel())

    def put(self, table: Table) -> Table:
        self._insert(self.key(table.layout, table.ints, table.coef_buf), (table, {}))
        return table

    def unpack(self, layout: Layout, ints: Tensor, coef: Tensor) -> Table:
        return self._entry(layout, ints, coef)[0]

    def chunks(self, table: Table, chunk: int, n_bank: int) -> tuple[Tensor, Tensor, Tensor, int]:
        """dkv_chunks(table, chunk, n_bank), computed once per table and chunk size."""
        memo = self._entry(table.layout, table.ints, table.coef_buf)[1]
        if (chunk, n_bank) not in memo:
            memo[(chunk, n_bank)] = dkv_chunks(table, chunk, n_bank)
        return memo[(chunk, n_bank)]

    def clear(self) -> None:
        self.entries.clear()

    def _entry(self, layout: Layout, ints: Tensor, coef: Tensor) -> tuple[Table, dict]:
        key = self.key(layout, ints, coef)
        hit = self.entries.pop(key, None)  # re-inserted last: most recently used
        if hit is None:
            hit = (Table.unpack(layout, ints, coef), {})
        self._insert(key, hit)
        return hit

    def _insert(self, key: tuple, entry: tuple[Table, dict]) -> None:
        self.entries.pop(key, None)
        self.entries[key] = entry
        while len(self.entries) > self.size:
            self.entries.pop(next(iter(self.entries)))


@functools.lru_cache(maxsize=64)
def _consts(
    device: torch.device, n_groups: int, n_ent: int, n_slots: int, tpg: int, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Per-shape constants of build_table, made once: (G, 1) first cell of every group,
    (G, E) ones (unweighted coefficients), (G·L,) int32 pair positions, and per token the
    (G, E) token and int32 entry of every entry position (None per sequence). Read only."""
    group_cell = torch.arange(n_groups, device=device)[:, None] * ((n_slots + 1) * tpg)
    ones = torch.ones((n_groups, n_ent), dtype=torch.float32, device=device)
    pair_pos = torch.arange(n_groups * n_slots, dtype=torch.int32, device=device)
    tok = entry = None
    if tpg > 1:
        pos = torch.arange(n_ent, device=device).expand(n_groups, n_ent)
        tok, entry = (pos // k).contiguous(), (pos % k).to(torch.int32)
    return group_cell, ones, pair_pos, tok, entry


def build_table(
    block_idx: Tensor, weights: Tensor | None, s: int, n_bank: int, tokens_per_tile: int
) -> Table:
    """The reference table for block_idx (B, k) or (B, S, k) and weights of the same shape.

    A block id >= n_bank fails a device-side assertion (RuntimeError on the CPU) instead of
    a host-side check. Steps: sort every group's entries (padding, -1, first); the first
    entry of each run of equal ids opens a slot (slot = running count of such heads, 0 for
    padding: the spare); every entry adds its weight to coef[group, slot, token] and names
    itself in ent (scatter-min: the first entry wins). Then the (group, slot) pairs sorted
    by block id give the unique blocks (runs) and, in sort order, each block's pairs (CSR).
    """
    lay = Layout.of(tuple(block_idx.shape), s, n_bank, tokens_per_tile, weights is not None)
    b, k = block_idx.shape[0], block_idx.shape[-1]
    idx = block_idx.to(torch.int32)
    torch._assert_async(
        (idx < n_bank).all(),
        "memory_attention: block_idx holds a block id beyond the bank's blocks",
    )
    w = None if weights is None else weights.float()
    if lay.per_token:
        pad = lay.n_s_tiles * tokens_per_tile - s
        idx = F.pad(idx, (0, 0, 0, pad), value=-1).reshape(b * lay.n_s_tiles, tokens_per_tile * k)
        if w is not None:
            w = F.pad(w, (0, 0, 0, pad)).reshape(idx.shape)
    n_groups, n_ent = idx.shape  # (G, tokens per group · k)
    n_slots, tpg, u_max = lay.n_slots, lay.tpg, lay.u_max
    group_cell, ones, pair_pos, tok, entry = _consts(idx.device, n_groups, n_ent, n_slots, tpg, k)
    srt, order = idx.sort(dim=1, stable=True)  # padding (-1) first
    head = srt > F.pad(srt[:, :-1], (1, 0), value=-1)  # first entry of each valid block
    slot = head.cumsum(1)  # (G, E) int64: 1 + the slot of every sorted entry; 0 for padding
    group_blocks = torch.full((n_groups, n_slots + 1), n_bank, dtype=torch.int32, device=idx.device)
    group_blocks.scatter_(1, slot, srt)  # a slot's entries all write its id; padding → spare
    # flat (group, slot, token) cell of every sorted entry (padding: the group's spare slot)
    if tok is None:
        flat = group_cell + slot
        ent_src = order.to(torch.int32)
    else:
        flat = torch.add(group_cell, slot, alpha=tpg) + tok.gather(1, order)
        ent_src = entry.gather(1, order)
    flat = flat.view(-1)
    coef = torch.zeros(lay.numels()[1], dtype=torch.float32, device=idx.device)
    coef.index_add_(0, flat, (ones if w is None else w.gather(1, order)).view(-1))
    ent = torch.full((coef.numel(),), -1, dtype=torch.int32, device=idx.device)
    ent.scatter_reduce_(0, flat, ent_src.view(-1), reduce="amin", include_self=False)
    first = ent[:0]
    if w is not None:  # per original entry; padding -1
        first = ent[flat].view(srt.shape).masked_fill_(srt < 0, -1)
        first = torch.empty_like(first).scatter_(1, order, first)

    # Unique referenced blocks: the (group, slot) pairs sorted by block id (unused slots, N,
    # last). Each run of equal ids is one unique block (the run of N after the last real one
    # is a padding block); its running head count hu (1-based) indexes the (U_max + 2) arrays
    # whose element 0 is spare, and the sort order lists each block's pairs contiguously.
    key_srt, by_u = group_blocks[:, 1:].reshape(-1).sort(stable=True)
    hu = (key_srt > F.pad(key_srt[:-1], (1, 0), value=-1)).cumsum(0)  # (G·L,) >= 1
    ublocks = torch.full((u_max + 2,), n_bank, dtype=torch.int32, device=idx.device)
    ublocks.scatter_(0, hu, key_srt)
    # pair_off[u] = the first sorted pair of block u; the padding block's start is the pair
    # count, and blocks past it never written (G·L): their ranges are empty
    pair_off = torch.full((u_max + 2,), n_groups * n_slots, dtype=torch.int32, device=idx.device)
    pair_off.scatter_reduce_(0, hu, pair_pos, reduce="amin", include_self=False)
    parts = {
        "group_blocks": group_blocks,
        "group_count": slot[:, -1],
        "ent": ent,
        "first": first,
        "ublocks": ublocks,
        "pair_off": pair_off,
        "pairs": by_u,
    }
    ints = torch.cat([parts[name].reshape(-1).to(torch.int32) for name, _ in lay.int_parts()])
    return Table.unpack(lay, ints, coef)


def dkv_chunks(table: Table, chunk: int, n_bank: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """The dK/dV work split (no host sync): unique block u has pairs × tiles-per-pair query
    tiles (units: 1 per pair for per-token lists, the sequence's S / TS tiles per sequence),
    cut into ceil(units / chunk) chunks. Returns chunk_off (U_max + 1,) (the first chunk of
    each block; padded blocks own none), chunk_u (NC,) the block of every chunk (U_max past
    the real ones), the chunk count (1,) on the device, and the static bound
    NC = U_max + ceil(G·L·tiles_per_pair / chunk) >= Σ_u ceil(units_u / chunk)."""
    lay = table.layout
    tpp = 1 if lay.per_token else lay.n_s_tiles
    units = (table.pair_off[1:] - table.pair_off[:-1]) * tpp  # (U_max,)
    units = units.masked_fill_(table.ublocks[:-1] >= n_bank, 0)  # the padding block's run
    chunk_off = F.pad(torch.cumsum((units + chunk - 1) // chunk, 0, dtype=torch.int32), (1, 0))
    n_chunk_max = lay.u_max + -(-lay.n_groups * lay.n_slots * tpp // chunk)
    chunk_u = torch.searchsorted(
        chunk_off[1:],
        torch.arange(n_chunk_max, device=units.device, dtype=torch.int32),
        out_int32=True,
        right=True,
    )
    return chunk_off, chunk_u, chunk_off[-1:], n_chunk_max
