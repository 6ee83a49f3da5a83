"""Plan-time analyses (DESIGN §1, §4): what a call's concrete lengths, tensors and cache decide.

``intervals`` (FlashMask column intervals, and each query row's run of keys), ``tiles`` (tile
classes and the block-sparse CSR), ``phases`` (per-request ``(T, C)``), ``layout`` (logical
coordinates to storage), ``splits`` (per-request split bounds), ``schedule`` (the producer /
reducer DAG), ``ledger`` (bytes and workspace) and ``partition`` (tiles among the ranks of a
context-parallel call, ``compiler.cp``).  ``pipeline.PLAN_PIPELINE`` lists them in
the order they run; ``plan``, ``plan_split``, ``explain`` and dispatch run them through
:func:`run_plan_pipeline`.
"""
from __future__ import annotations

from .pipeline import PLAN_INPUTS, PLAN_PIPELINE, Step, run_plan_pipeline

__all__ = ["PLAN_INPUTS", "PLAN_PIPELINE", "Step", "run_plan_pipeline"]
