"""Fused FFN-memory read by block index (seed 002 §2.2 and App. I Fig. 19, seed 004 §4–§5).

FFN memories widen the SwiGLU inner dimension of a layer by each sequence's
fetched blocks. This package computes the memory part without gathering the
blocks out of the bank (a grouped GEMM over the bank by block index):

    ffn_memory(x, bank_w1, bank_w2, bank_w3, block_idx, *, sparse_grad=True,
               impl="auto", table=None) -> y = Σ_j [silu(x W1[idx_j]ᵀ) ⊙ (x W2[idx_j]ᵀ)] W3[idx_j]

Files: `op.py` the public function (every tensor shape in its docstring), its input
checks and the `memtree::ffn_memory` / `memtree::ffn_memory_backward` torch custom ops
that dispatch; `kernel.py` the Triton kernels (backward recomputes the hidden
activations instead of storing them); `naive.py` the pure-torch reference (gathered
copies), which defines the semantics and is the CPU implementation. impl: "auto" |
"triton" | "reference". `ffn_memory_table(block_idx, N)` sorts a block list's pairs once for
every call that reads it (a model's layers, one table per memory level and step).
"""

from memtree.kernels.ffn_memory.naive import ffn_memory_naive, ffn_memory_naive_backward
from memtree.kernels.ffn_memory.op import FFNTable, ffn_memory, ffn_memory_table

__all__ = [
    "FFNTable",
    "ffn_memory",
    "ffn_memory_naive",
    "ffn_memory_naive_backward",
    "ffn_memory_table",
]
