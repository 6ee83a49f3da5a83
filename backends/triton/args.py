"""What the Triton kernel's call paths share: torch dtype names, the prefill call's launch options,
an FP8 call's descales, and the record of a validated prefill key (``_Bound``)."""
from __future__ import annotations

from typing import NamedTuple

from attnc import fp8 as F

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
# keyword options of a prefill call that are the launch layer's (everything else is a mask tensor)
PREFILL_OPTIONS = ("block_m", "block_n", "num_warps", "num_stages", "use_tma", "walk", "mask_source", "head_group",
                   "engine", "schedule")
FP8_INPUTS = F.DESCALES  # an FP8 call's descales (attnc.fp8)


def _kind(t) -> str:
    import torch
    if t.dtype.is_floating_point:
        return "f"
    return "b" if t.dtype == torch.bool else "i"


class _Bound(NamedTuple):
    """What one prefill key fixes once it is validated: the call's lengths, O's shape in q's
    layout, whether that layout is bshd, whether bf16 is carried in float32 (interpreter), the
    plan cache's key of the call where the mask reads no tensor (``plans.Key``, made once), and
    the order O is stored in, ``attnc.layouts`` (a bhsd spec's token-major q: "bshd")."""

    batch: int
    s_q: int
    s_k: int
    out_shape: tuple
    bshd: bool
    emulate: bool
    plan_key: object = None
    out_order: str = "bhsd"

