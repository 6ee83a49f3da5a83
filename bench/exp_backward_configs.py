"""Study: the backward's tiles and warps on the GPU (not a result: the default is what users get).

    python -m bench.exp_backward_configs [--out FILE.jsonl]

Times ``Kernel.backward`` (plan cached, O/LSE from one forward) for a few BackwardConfigs on
causal and full at B=4, H=16, S=8192, d=128, bf16; prints TFLOP/s at 2.5x the forward's
visible-cell FLOPs and checks each config's dQ/dK/dV against the default config's.
"""
from __future__ import annotations

import argparse
import json

CONFIGS = [(64, 128, 128, 64, 8, 3, True, 1), (64, 128, 128, 64, 8, 3, False, 1), (64, 128, 128, 64, 8, 3, True, 2),
           (64, 128, 128, 128, 8, 3, True, 1), (64, 128, 128, 64, 8, 3, True, 1, False),
           (64, 128, 128, 64, 8, 2, True, 1, False), (128, 128, 128, 64, 8, 2, True, 1, False),
           (64, 64, 128, 64, 4, 3, True, 1, False)]


def main(argv=None) -> int:
    import torch
    import triton
    import attnc
    from attnc.backends.triton.grad import BackwardConfig
    from .harness import PREFILL_MASKS, spec_text
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--masks", default="causal,full")
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args(argv)
    B, H, S, D = 4, 16, args.seq, 128
    for name in args.masks.split(","):
        mask, decls = PREFILL_MASKS[name]
        attn = attnc.compile(spec_text(name, mask, decls))
        program = attn.specialize(H, H, D, D, "bf16")
        kernel = attn.kernel("triton", program)
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        tensors = {}
        if program.tensors:
            from attnc.compiler import inputs
            sample = inputs.sample(program, B, S, S, 0)
            tensors = {t.name: torch.as_tensor(sample[t.name].astype("int32"), device="cuda") for t in program.tensors}
        o, lse = kernel(q, k, v, return_lse=True, **tensors)
        base = kernel.backward(q, k, v, o, lse, do, **tensors)
        from .harness import _visible_cells
        cells = H * _visible_cells(program, B, S, tensors)
        flops = 2.5 * 4.0 * D * cells
        for c in CONFIGS:
            cfg = BackwardConfig(*c)
            try:
                got = kernel.backward(q, k, v, o, lse, do, config=cfg, **tensors)
                err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, base))
                ms = triton.testing.do_bench(lambda: kernel.backward(q, k, v, o, lse, do, config=cfg, **tensors), warmup=25,
                                             rep=200)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {c}: ERROR {type(e).__name__}: {str(e)[-200:]}", flush=True)
                continue
            row = {"mask": name, "config": c, "ms": ms, "TFLOPs": flops / ms / 1e9, "rel_vs_default": err}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
