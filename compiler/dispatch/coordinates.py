"""The coordinates of a dispatch key that a spec decides (M4.5 §0x07A): cache layout, mask kind
and representability, the mask and score digests, the phase of a batch's lengths."""
from __future__ import annotations

import hashlib
from functools import lru_cache

from .. import ir, policies


def cache_layout_of(program) -> str:
    kind, layout = program.cache.kind.value, program.cache.layout.value
    return kind if kind == "ragged" else f"{kind}_{layout}"


def mask_kind_of(program) -> str:
    """``full`` | ``causal`` | ``window`` (causal sliding window) | ``position`` (any other mask of
    positions only) | ``tensor`` (reads runtime tensors: a data-dependent, custom mask)."""
    text = ir.format_expr(program.mask)
    if ir.loads(program.mask):
        return "tensor"
    if text == "true":
        return "full"
    if text == "k <= q":
        return "causal"
    m = program.mask
    if isinstance(m, ir.Binary) and m.op == "and" and ir.format_expr(m.left) == "k <= q":
        r = m.right
        if isinstance(r, ir.Compare) and r.op == "lt" and ir.format_expr(r.left) == "q - k" \
                and isinstance(r.right, ir.Const):
            return "window"
    return "position"


def mask_digest_of(program) -> str:
    decls = tuple((t.name, t.dtype.value, tuple(t.axes)) for t in program.tensors)
    return hashlib.sha256(repr((program.mask, decls)).encode()).hexdigest()


def score_digest_of(program) -> str:
    return hashlib.sha256(repr((program.score, program.scale, program.masked_rows)).encode()).hexdigest()


def spec_fields(program) -> dict:
    """Every key field the spec fixes (see ``schema.SPEC_FIELDS``)."""
    split = policies.text(program.split.kind, program.split.params)  # balanced(8), capacity(5, 8), auto
    return {"H_q": program.heads_q, "H_kv": program.heads_kv, "d_qk": program.d_qk, "d_v": program.d_v,
            "q_dtype": program.dtype, "kv_dtype": program.dtype, "cache_layout": cache_layout_of(program),
            "page_size": program.cache.page_size, "split": split, "state": program.state.value,
            "mask_kind": mask_kind_of(program), "mask_digest": mask_digest_of(program),
            "score_digest": score_digest_of(program)}


def representable(program, s_q: tuple[int, ...], s_k: tuple[int, ...]) -> bool | None:
    """FlashMask representability of the mask for this call's lengths; None when the mask reads
    runtime tensors (their values decide it, at plan time)."""
    if ir.loads(program.mask):
        return None
    pairs = sorted(set(zip(s_q, s_k)))
    if len(pairs) > 4:  # O(S) each; the extremes stand for the rest
        pairs = [pairs[0], pairs[-1]]
    return all(_representable_at(program.mask, program.heads_q, len(s_q), q, k) for q, k in pairs)


@lru_cache(maxsize=256)
def _representable_at(mask, heads_q: int, batch: int, s_q: int, s_k: int) -> bool:
    """Memoized: a runtime hook builds the same key on every call of one shape.  (The analysis
    widens over b and h only when the mask names them.)"""
    # the analyses are imported on first use: commands that only reach the registry (`attnc
    # check`, `compile`) never build a key
    from ..analysis import run_plan_pipeline
    probe = ir.Program("probe", heads_q, 1, 1, 1, "f32", 1.0, (), (), mask)
    mi = run_plan_pipeline(("intervals",), program=probe, batch=batch, s_q=s_q, s_k=s_k, tensors={})["intervals"]
    return mi.representable


def phase_of_lengths(s_q: tuple[int, ...], s_k: tuple[int, ...]) -> str:
    """The batch's phase: its requests' common phase, or ``mixed``."""
    from ..analysis.phases import phase_of
    phases = {phase_of(k - q, q) for q, k in zip(s_q, s_k)}
    return phases.pop() if len(phases) == 1 else "mixed"
