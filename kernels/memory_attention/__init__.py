"""Memory attention read by block index (seed 000 §5, seed 004 §8.5, seed 002 App. I).

The queries of a sequence attend over the memory blocks (chapters) its list names,
read by block id out of the bank without gathering copies:

    memory_attention(q, bank_k, bank_v, block_idx, weights=None, *,
                     weight_mode="bias", scale=None, sparse_grad=None,
                     impl="auto", return_lse=False, table=None,
                     per_token_layout="auto") -> out | (out, lse)
    memory_attention_table(q, bank_k, bank_v, block_idx, weights=None, *, impl="auto",
                           per_token_layout="auto")
        -> MemoryTable | None   # built once, passed as table= to every call reading
                                 # the same lists (a model's layers)

Files: `op.py` the public function (every tensor shape in its docstring), its input
checks and the `memtree::memory_attention_fwd` / `_bwd` torch custom ops that dispatch;
`kernel.py` the Triton path over slot tiles (tile sizes, launches; the kernels themselves in
`kernel_fwd.py` and `kernel_bwd.py`); `table.py` their reference table; `blocks.py` the
block-major kernels for per-token lists (per_token_layout="blocks": each (token, block) pair
computed once, for lists that neighbouring tokens do not share); `naive.py` the pure-torch
reference (gathered copies), which defines the semantics and is the CPU implementation.
impl: "auto" | "triton" | "reference".

Which weight mode is exact for what:
- weights=None: exactly seed 000 eq. (4) over the concatenated selected
  chapters M_S (Algorithm 1, sequence-level top-k), i.e. SDPA on the gathered
  blocks; also a hierarchical path's KV blocks read as one memory.
- "mix": exact for MoC's weighted routed read (as in mixture-of-experts):
  every chapter normalised on its own, outputs mixed by the router weights
  (fold a routed scaling factor into the weights). Gradients reach the
  router through d(weights) = dO · O_block.
- "bias": a joint softmax in which weight w_c multiplies every token of
  chapter c before normalisation: out = Σ_c w_c Z_c O_c / Σ_c w_c Z_c, with
  Z_c the chapter's partition sum and O_c its own softmax read. That is
  "mix" with the query-dependent weights w_c Z_c / Σ w Z (they sum to 1 and
  favour chapters the query matches), so the two differ in general. It is
  exact for attention over the concatenated chapters with the router as a
  log-prior on each chapter's tokens; constant weights give the unweighted
  read. Weights must be > 0.

Three exact paths for per-sequence lists (B, k) (per-token lists: `memory_attention` only):
- `memory_attention` (`op.py`): the Triton kernel on CUDA reads K/V in place by block id, no
  gathered copy, row-sparse bank gradients without a bank-sized buffer; every mode, per-token
  lists, return_lse, shared tables; the reference on the CPU.
- `memory_attention_sdpa` (`sdpa.py`): gathers each sequence's blocks (B, H_kv, k·T, D) and
  calls torch's SDPA, so flash / cuDNN run it. Exact for every mode: unweighted as is, "bias"
  by the widened head (q' = [q, 1], k' = [k, log(w)/scale], head dim round_up(D + 1, 8)),
  "mix" as SDPA batched over the (B·k) entries. sparse_grad=True gives the sparse COO bank
  gradient training pays; no return_lse.
- `memory_attention_flex` (`flex.py`): FlexAttention over the bank viewed in place as one KV
  sequence, a BlockMask with KV block T listing each sequence's blocks, log-weights by
  score_mod. Exact for the joint-softmax modes (unweighted, "bias"; not "mix") when each
  list names distinct blocks; return_lse. Compiled on CUDA (D >= 16, T a multiple of the
  kernel's tiles), torch's dense eager reference on the CPU.
"""

from memtree.kernels.memory_attention.flex import flex_available, memory_attention_flex
from memtree.kernels.memory_attention.naive import (
    memory_attention_naive,
    memory_attention_naive_backward,
)
from memtree.kernels.memory_attention.op import (
    MemoryTable,
    memory_attention,
    memory_attention_table,
)
from memtree.kernels.memory_attention.sdpa import memory_attention_sdpa

__all__ = [
    "MemoryTable",
    "flex_available",
    "memory_attention",
    "memory_attention_flex",
    "memory_attention_naive",
    "memory_attention_naive_backward",
    "memory_attention_sdpa",
    "memory_attention_table",
]
