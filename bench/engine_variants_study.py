"""Study: variants of the Gluon engine's consumer on causal and full, B4 H16 S8192 d128 (``--heads``,
``--head-dim``, ``--seq`` change the shape), bf16 and FP8 (kernel alone, ``Kernel.prepare``, each
variant a fresh launch):

  base        the engine as shipped;
  overlap / no_overlap   block i+1's Q.K^T issued before block i's softmax (FlashAttention-3's
              intra-warpgroup overlap: ``choice.GLUON_OVERLAP``; FP8 launches never overlap);
  regs232 / regs240      the consumer warpgroups' registers (``choice.GLUON_REGS_D128``);
  stages3, stages4   three or four K/V stages (``choice.GLUON_STAGES``; FP8 blocks are half the bytes);
  q1          one Q buffer (``choice.GLUON_Q_BUFFERS``; the engine takes two where they cost no stage);
  pingpong    FlashAttention-3's ping-pong: the consumers take turns issuing block i's Q.K^T with
              block i-1's P.V, each softmax under the other's MMAs (``choice.GLUON_PINGPONG_DIMS``: the head dims that take it);
  one_tile, head_group<n>   the call options ``schedule="one_tile"`` (one job per program) and
              ``head_group=n`` (heads whose tiles interleave; default 4);
  bn128, bn256, wg3, wg3_bn64, wg3_stages3   tiles asked for: 128 x 128, 128 x 256, 192 x 128 (three
              consumer warpgroups, head dims <= 64), 192 x 64, 192 x 128 with three K/V stages.
  (r49's exp2_poly<k>, pingpong ring at d 64 and 256 x 64 tiles: studies/d64_levers_r49.diff.)

Each row records the compiled kernel's registers and spills (``n_regs``, ``n_spills``): the
overlap keeps two score tiles live, and the question is whether it spills.  Outputs are checked
against the first variant's (max |diff|) before timing, and O and LSE of the first (batch, head)
against a float64 reference (``err_o``, ``err_lse``: max |diff|).

    python -m bench.engine_variants_study > study.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys

VARIANTS = {"base": {}, "overlap": {"OVERLAP": True}, "no_overlap": {"OVERLAP": False},
            "regs232": {"REGS": (168, 232, 24)}, "regs240": {"REGS": (168, 240, 24)},
            "overlap_regs240": {"OVERLAP": True, "REGS": (168, 240, 24)}, "stages3": {"STAGES": 3},
            "stages4": {"STAGES": 4}, "q1": {"Q_BUFFERS": 1},
            "overlap_stages3": {"OVERLAP": True, "STAGES": 3},
            "one_tile": {"options": {"schedule": "one_tile"}}, "head_group8": {"options": {"head_group": 8}},
            "head_group16": {"options": {"head_group": 16}}, "head_group2": {"options": {"head_group": 2}},
            "pingpong": {"PINGPONG": (64, 128, 256)}, "no_pingpong": {"PINGPONG": ()},
            "pingpong_regs232": {"PINGPONG": (64, 128, 256), "REGS": (168, 232, 24)},
            "bn256": {"options": {"block_n": 256}},
            "wg3": {"options": {"block_m": 192, "block_n": 128}}, "wg3_bn64": {"options": {"block_m": 192, "block_n": 64}},
            "wg3_stages3": {"STAGES": 3, "options": {"block_m": 192, "block_n": 128}},
            "bn128": {"options": {"block_m": 128, "block_n": 128}}}


PTX_OPS = ("wgmma.mma_async", "ex2.approx", "shfl.sync", "prmt.b32", "st.shared", "ld.shared", "stmatrix", "ldmatrix",
           "cvt.rn.satfinite.e4m3x2", "cvt.rn.bf16x2", "bar.sync", "mbarrier.try_wait")


def _ptx_counts(compiled) -> dict:
    """How often each of PTX_OPS appears in the kernel's PTX (where P's layout change goes:
    shuffles and byte permutes, or a round trip through shared memory)."""
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    return {op: ptx.count(op) for op in PTX_OPS}


def _reference(q, k, v, mask: str, program) -> tuple:
    """O and LSE (natural log) of batch 0, head 0 in float64 from the bf16 inputs."""
    import math

    import torch
    s = q.shape[2]
    scale = program.scale if program.scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = (q[0, 0].double() @ k[0, 0].double().T) * scale
    if mask == "causal":
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (torch.exp(scores - lse[:, None]) @ v[0, 0].double()), lse


def _errors(o, lse, ref) -> dict:
    """Max |diff| of O and LSE at batch 0, head 0 against ``_reference``."""
    return {"err_o": float((o[0, 0].double() - ref[0]).abs().max()),
            "err_lse": float((lse[0, 0].double() - ref[1]).abs().max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--masks", default="causal,full")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    import torch
    import triton.testing
    import attnc
    from attnc.backends.triton import choice
    b, h, s, d = 4, args.heads, args.seq, args.head_dim
    defaults = {"OVERLAP": choice.GLUON_OVERLAP, "REGS": choice.GLUON_REGS_D128, "STAGES": choice.GLUON_STAGES,
                "PINGPONG": choice.GLUON_PINGPONG_DIMS, "Q_BUFFERS": choice.GLUON_Q_BUFFERS}
    for mask in args.masks.split(","):
        attn = attnc.compile(f"attention c {{ heads = {h} head_dim = {d} dtype = bf16 "
                             f"mask = {'causal' if mask == 'causal' else 'true'} }}")
        kernel = attn.kernel("triton", attn.program)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        (q8, dq), (k8, dk), (v8, dv) = attnc.fp8.quantize(q), attnc.fp8.quantize(k), attnc.fp8.quantize(v, transposed=True)
        inputs = {"bf16": ((q, k, v), {}), "fp8": ((q8, k8, v8), dict(q_descale=dq, k_descale=dk, v_descale=dv))}
        cells = b * h * (s * (s + 1) / 2 if mask == "causal" else s * s)
        for dtype in args.dtypes.split(","):
            qkv, extra = inputs[dtype]
            base = None
            ref = _reference(q, k, v, mask, attn.program)
            for name in args.variants.split(","):
                knobs = {**defaults, **{n: x for n, x in VARIANTS[name].items() if n != "options"}}
                choice.GLUON_OVERLAP, choice.GLUON_REGS_D128, choice.GLUON_STAGES = (knobs["OVERLAP"], knobs["REGS"],
                                                                                 knobs["STAGES"])
                choice.GLUON_PINGPONG_DIMS = knobs["PINGPONG"]
                choice.GLUON_Q_BUFFERS = knobs["Q_BUFFERS"]
                row = {"study": "engine_variants", "variant": name, "mask": mask, "dtype": dtype, "B": b, "H": h,
                       "S": s, "D": d}
                try:
                    run = kernel.prepare(*qkv, engine="gluon", **VARIANTS[name].get("options", {}), **extra)
                    o, lse = run()[:2]
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a study records what failed and goes on
                    print(json.dumps({**row, "error": f"{type(e).__name__}: {str(e)[-600:]}"}), flush=True)
                    continue
                base = o if base is None else base
                compiled = list(run.launch.launcher.compiled.values())
                ms = triton.testing.do_bench(run, warmup=50, rep=300)
                print(json.dumps({**row, "ms": ms, "tflops": 4 * d * cells / ms / 1e9,
                                  "max_diff_vs_first": float((o.float() - base.float()).abs().max()),
                                  **_errors(o, lse, ref),
                                  "n_regs": getattr(compiled[0], "n_regs", None) if compiled else None,
                                  "n_spills": getattr(compiled[0], "n_spills", None) if compiled else None,
                                  "ptx_counts": _ptx_counts(compiled[0]) if compiled else None,
                                  "config": run.config.describe()}), flush=True)
        choice.GLUON_OVERLAP, choice.GLUON_REGS_D128, choice.GLUON_STAGES = (defaults["OVERLAP"], defaults["REGS"],
                                                                         defaults["STAGES"])
        choice.GLUON_PINGPONG_DIMS = defaults["PINGPONG"]
        choice.GLUON_Q_BUFFERS = defaults["Q_BUFFERS"]
        del q, k, v, q8, k8, v8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
