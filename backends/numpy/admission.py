"""What the numpy backend admits (DESIGN §6, M4.5 §0x07B): its candidate domain and predicates."""
from __future__ import annotations

from attnc.compiler.dispatch.admission import (FORWARD_ONLY, KV_IN_QUERY_DTYPE, STORAGE_DTYPES, BackendSpec,
                                               allowed, installed, requires)

SPEC = BackendSpec(
    "numpy", platforms=("cpu", "cuda"), phases=("prefill", "append", "decode", "mixed"),
    description="the numpy programs: tiled (contiguous, one S_q/S_k) and split (paged, ragged, "
                "per-request lengths, mixed batches); host memory, any device's arrays are copied",
    admission=(
        installed("numpy"),
        allowed("D", "q_dtype", STORAGE_DTYPES),
        KV_IN_QUERY_DTYPE,
        *FORWARD_ONLY,
        requires("C", "graph_mode", False, detail="host code cannot be captured in a CUDA graph"),
    ))
