"""What the Triton backend admits (DESIGN §6, M4.5 §0x07B): its candidate domain and predicates.

Pure data over a dispatch key; importing it imports neither torch nor triton (``installed``
reads distribution metadata), so ``attnc dispatch`` answers on any host."""
from __future__ import annotations

from attnc.compiler.dispatch.admission import (FORWARD_ONLY, KV_IN_QUERY_DTYPE, STORAGE_DTYPES, BackendSpec,
                                               allowed, bounded, installed, requires, rule)
from attnc.compiler.dispatch.keys import DispatchKey


def _graph(k: DispatchKey) -> str | None:
    """graph_mode: the split kernels replay from a CUDA graph (backends/triton/graph.py); the
    interpreter has no graphs and the contiguous prefill launcher is not captured."""
    if not k.graph_mode:
        return None
    if k.device_type != "cuda" or k.interpreter:
        return "graph_mode=true unsupported without a CUDA device"
    if k.phase == "prefill" and k.cache_layout.startswith("contiguous"):
        return "graph_mode=true unsupported for prefill on a contiguous cache"
    return None


def shared_shift_refusal(split: str) -> str:
    """Why a split call refuses ``state = shared_shift`` under ``split = <split>`` (the admission's
    and the launch's one message)."""
    return (f"state = shared_shift runs the Triton backend's block-share splits; this spec also declares split = "
            f"{split}, which the shared frame's kernels do not take yet (use split = auto, or state = lse_o / mlu)")


def _shift_split(k: DispatchKey) -> str | None:
    """shared_shift with an explicit split policy, on a split call (a paged or ragged cache, or
    per-request lengths): the shift kernels take block shares, not a policy's bounds."""
    split_call = not k.cache_layout.startswith("contiguous") or not k.uniform
    if k.state == "shared_shift" and k.split != "auto" and split_call:
        return shared_shift_refusal(k.split)
    return None


SPEC = BackendSpec(
    "triton", platforms=("cuda", "interpreter"), phases=("prefill", "append", "decode", "mixed"),
    description="generated Triton kernels: prefill/append over the tile CSR on contiguous K/V; "
                "split-K/V producer + combine for decode, append and mixed batches over paged, "
                "ragged or per-request contiguous caches",
    admission=(
        installed("triton", "triton"), installed("torch", "torch"),
        rule("H", "compute capability >= 80 on CUDA",
             lambda k: f"compute_capability={k.compute_capability} unsupported"
             if k.device_type == "cuda" and k.compute_capability is not None and k.compute_capability < 80
             else None, detail="needs sm_80 or newer"),
        allowed("D", "q_dtype", STORAGE_DTYPES),
        KV_IN_QUERY_DTYPE,
        bounded("Q", "d_qk", 1, 256), bounded("Q", "d_v", 1, 256),
        requires("L", "last_dim_contiguous", True, detail="unit stride in the head dim"),
        *FORWARD_ONLY,
        rule("N", "state = shared_shift with split = auto on split calls", _shift_split,
             detail="the shared-shift kernels split by block shares"),
        rule("C", "graph_mode: split calls on a CUDA device", _graph,
             detail="Kernel.decode_graph captures the split-K/V calls (decode, append, mixed, prefill "
                    "over pages) on a GPU; the contiguous prefill launcher allocates per call"),
    ))
