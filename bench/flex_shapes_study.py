"""Study: attnc's public call against FlexAttention (torch.compile, default mode, BlockMask made
once) on issue 21's shapes that the bench does not carry: head dims 192 / 128 (MLA prefill) and
256, and the score programs ALiBi and softcap 30 at d 128; causal, bf16, S 8192.  Both outputs
are checked against each other first (relative L2 on the whole output); times are
``triton.testing.do_bench`` medians of the call as a user makes it.  One JSON line per case.

    python -m bench.flex_shapes_study > study.jsonl
"""
from __future__ import annotations

import json
import math
import sys

ALIBI = "score = score - exp(-(h + 1) * log(2.0) / 2.0) * (q - k)"
SOFTCAP = "score = softcap(score, 30.0)"
CASES = [("d192_128", 2, 16, 192, 128, ""), ("d256", 2, 16, 256, 256, ""), ("alibi", 4, 16, 128, 128, ALIBI),
         ("softcap", 4, 16, 128, 128, SOFTCAP)]
SEQ = 8192


def _score_mod(name):
    import torch
    if name == "alibi":
        return lambda s, b, h, q, k: s - torch.exp2(-(h + 1) / 2.0) * (q - k)
    if name == "softcap":
        return lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0)
    return None


def main() -> int:
    import torch
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import attnc
    block_mask = create_block_mask(lambda b, h, q, k: k <= q, None, None, SEQ, SEQ, device="cuda")
    flex = torch.compile(flex_attention)
    for name, b, h, d_qk, d_v, score in CASES:
        attn = attnc.compile(f"attention c {{ heads = {h} head_dim = {d_qk} / {d_v} dtype = bf16 {score} "
                             "mask = causal }")
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, SEQ, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, h, SEQ, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, h, SEQ, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
        cells = b * h * SEQ * (SEQ + 1) / 2
        flops = 2 * (d_qk + d_v) * cells
        row = {"study": "flex_shapes", "case": name, "B": b, "H": h, "S": SEQ, "d_qk": d_qk, "d_v": d_v,
               "score": score}
        mine = attn(q, k, v)
        try:
            theirs = flex(q, k, v, score_mod=_score_mod(name), block_mask=block_mask, scale=1 / math.sqrt(d_qk))
            row["rel_l2_vs_flex"] = float(((mine.float() - theirs.float()).norm() / theirs.float().norm()))
            ms_flex = triton.testing.do_bench(lambda: flex(q, k, v, score_mod=_score_mod(name), block_mask=block_mask,
                                                            scale=1 / math.sqrt(d_qk)), warmup=50, rep=300)
            row.update(flex_ms=ms_flex, flex_tflops=flops / ms_flex / 1e9)
        except Exception as e:  # noqa: BLE001 - a study records what its peer could not run
            row["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        ms = triton.testing.do_bench(lambda: attn(q, k, v), warmup=50, rep=300)
        row.update(attnc_ms=ms, attnc_tflops=flops / ms / 1e9)
        if "flex_ms" in row:
            row["x_flex"] = row["flex_ms"] / ms
        print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
