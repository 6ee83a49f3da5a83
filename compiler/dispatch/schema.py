"""The dispatch key's schema (M4.5 §0x07A): its coordinates in canonical order, the values
they may take, the spellings a call file may use, and the canonical JSON every digest hashes."""
from __future__ import annotations

import hashlib
import json

KEY_VERSION = 1
PHASES = ("prefill", "append", "decode", "mixed")
DEVICE_TYPES = ("cpu", "cuda", "ahbm")  # ahbm: the mesh simulator (backends/ahbm/sim)
CACHE_LAYOUTS = ("contiguous_bhsd", "contiguous_bshd", "ragged", "paged_nhd", "paged_hnd")
CACHE_ALIASES = {"contiguous": "contiguous_bhsd", "contiguous_hnd": "contiguous_bhsd",
                 "contiguous_nhd": "contiguous_bshd"}
DTYPES = {"f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16",
          "bf16": "bf16", "bfloat16": "bf16",
          "f32": "f32", "fp32": "f32", "float32": "f32", "float": "f32",
          "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
          "float8_e5m2": "fp8_e5m2"}
# The five coordinate families of §0x07A, in canonical order.
KEY_GROUPS: dict[str, tuple[str, ...]] = {
    "environment": ("device_type", "compute_capability", "device_name", "interpreter", "torch", "triton",
                    "cuda_runtime"),
    "operation": ("phase", "training"),
    "tensors": ("B", "S_q", "S_k", "H_q", "H_kv", "d_qk", "d_v", "q_dtype", "kv_dtype", "contiguous",
                "last_dim_contiguous"),
    "semantics": ("mask_kind", "mask_representable", "mask_digest", "score_digest", "dropout_p", "positions"),
    "runtime": ("cache_layout", "page_size", "split", "state", "graph_mode", "deterministic",
                "backend_request"),
}
# Call-file spellings: the seed's teaching key (§0x07A) and §0x0BE's call key map onto ours.
CALL_ALIASES = {
    "device": "device_type", "batch": "B", "q_len": "S_q", "kv_len": "S_k", "kv_lens": "S_k",
    "S_k_per_request": "S_k", "q_lens": "S_q", "num_q_heads": "H_q", "num_kv_heads": "H_kv",
    "head_dim_qk": "d_qk", "head_dim_vo": "d_v", "head_dim": "d_qk", "dtype": "q_dtype",
    "cuda_graph": "graph_mode", "requires_deterministic": "deterministic", "backend": "backend_request",
    "mask": "mask_kind",
}
# Fields a spec fixes: a call may repeat them, never contradict them.
SPEC_FIELDS = ("H_q", "H_kv", "d_qk", "d_v", "q_dtype", "kv_dtype", "cache_layout", "page_size", "split",
               "state", "mask_kind", "mask_digest", "score_digest")

ALL_FIELDS = frozenset(n for names in KEY_GROUPS.values() for n in names)


def canonical_json(obj) -> str:
    """Sorted keys, no whitespace, ASCII, no NaN: the bytes every digest in attnc hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_of(obj) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()

