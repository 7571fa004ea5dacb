"""Fused FFN-memory read by block index (seed 002 §2.2 and App. I Fig. 19, seed 004 §4–§5).

FFN memories widen the SwiGLU inner dimension of a layer by each sequence's
fetched blocks. This package computes the memory part without gathering the
blocks out of the bank (a grouped GEMM over the bank by block index):

    ffn_memory(x, bank_w1, bank_w2, bank_w3, block_idx, *, sparse_grad=True,
               impl="auto") -> y

- x: (B, S, d) float32/float16/bfloat16.
- bank_w1, bank_w2, bank_w3: (N, W, d), N blocks of memory width W; inner two
  dims contiguous, leading (block) stride arbitrary (views into a wider
  per-level table work).
- block_idx: int64 (B, k); -1 = padding. A sequence's memory is its k blocks
  concatenated along the width, so the result is a sum over blocks.
- y: (B, S, d) = Σ_j [silu(x W1[idx_j]ᵀ) ⊙ (x W2[idx_j]ᵀ)] W3[idx_j], in x's
  dtype with fp32 accumulation (the Triton kernels cast the weights to x's
  dtype for the matmuls, as the model does; the reference computes in fp32).

Gradients: dx, and for each bank a gradient on the referenced blocks only,
computed as (U, W, d) slots for the U distinct blocks and returned as a sparse
COO (N, W, d) tensor (sparse_grad=True, like nn.Embedding(sparse=True); no
bank-sized buffer; the banks must then be leaves or views whose backward
accepts sparse gradients, which slices do not) or scattered into a dense
(N, W, d) tensor (sparse_grad=False, for torch.compile and opcheck).

Dispatch: `memtree::ffn_memory` / `memtree::ffn_memory_backward` torch custom
ops run the Triton kernels (`kernel.py`) on CUDA and `naive.py` elsewhere;
impl="triton" forces the kernels (on CPU they need TRITON_INTERPRET=1),
impl="reference" the naive path. Backward recomputes the hidden activations
instead of storing them (see `kernel.py`).
"""

from kernels.ffn_memory.naive import ffn_memory_naive, ffn_memory_naive_backward
from kernels.ffn_memory.op import ffn_memory

__all__ = ["ffn_memory", "ffn_memory_naive", "ffn_memory_naive_backward"]
