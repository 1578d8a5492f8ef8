"""In-place Q norm + RoPE on DSV4's ``q_head_norm`` path.

Stock ``MQALayer._compute_q_b`` (models/deepseek_v4.py) allocates ``q_out = torch.empty_like(q)``
and runs ``fused_q_norm_rope(q, q_out, eps, freqs_cis, positions)`` out of place: one
tokens x heads x head_dim buffer per layer call in eager prefill. The kernel
(``sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh``, ``fused_q_norm_rope``) is safe with
input aliased to output, read from its source:

* one warp owns one (token, head) row; with equal input and output strides no other warp, block
  or launch touches that row;
* every lane loads all of its ``kLocalSize`` vectors of the row (``input_vec[i] = gmem.load``)
  before it stores anything; with the norm, the warp-wide ``reduce_sum`` (a shuffle every lane
  must reach) follows the loads, so no lane stores before every lane has loaded;
* a lane stores its non-rope vectors only to the positions it loaded itself; the rope tail goes
  registers -> shared memory -> ``__syncwarp()`` -> rotated stores, all after the loads.

So the whole input row is in registers/shared memory before its first store, for both ``eps``
branches. tests/gpu checks it bit for bit against the out-of-place call over DSV4 shapes, with a
negative control (an overlapping, offset output) that the comparison detects.

Only the ``q_head_norm`` path with no caller-provided ``q_out`` changes; every other branch
(the FP8-output branch included) is stock's, called as is.
"""

from __future__ import annotations

import threading
from typing import Callable

CALLS = {"inplace": 0}
_LOCK = threading.Lock()


def build_compute_q_b(stock: Callable, on_call: Callable[[], None]) -> Callable:
    def _compute_q_b(self, q, positions, q_out=None):
        if q_out is not None or not self.q_head_norm or self.use_mega_attention:
            return stock(self, q, positions, q_out)
        from sglang.kernels.ops.attention.dsv4 import fused_q_norm_rope  # the object deepseek_v4 imports

        q, _ = self.wq_b(q)
        q = q.view(-1, self.n_local_heads, self.head_dim)
        fused_q_norm_rope(q, q, self.eps, self.freqs_cis, positions)  # aliased: see the module docstring
        with _LOCK:
            CALLS["inplace"] += 1
        on_call()
        return q

    return _compute_q_b


def saved_bytes(tokens: int, heads: int, head_dim: int = 512, elem_bytes: int = 2) -> int:
    """Bytes the in-place call does not allocate per layer call (stock's ``empty_like(q)``)."""
    return tokens * heads * head_dim * elem_bytes
