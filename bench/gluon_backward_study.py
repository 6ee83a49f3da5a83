"""Study: the Gluon backward (backends/triton/gluon_backward.py) against the Triton backward and SDPA.

Run on the H200 (repository root): ``python3 -m bench.gluon_backward_study OUT.jsonl [case ...]
[--variants a,b] [--sdpa cudnn,flash]``.
Cases: B4 H16 S8192 d128 causal and full, B4 H32 S8192 d64 causal (bf16).  For each case, the
gradients of every variant are checked first (rel-L2 against a float32 dense autograd reference on
two (b, h) planes, and against the Triton backward on the whole tensors), then timed with
``triton.testing.do_bench`` (median ms):
  kernel/<variant>  ``Kernel.backward(q, k, v, o, lse, do, config=...)``: the backward alone (for
                    the default Gluon launch, its Triton-dQ twin and the fused dQ, also D + the
                    dK/dV pass and the dQ pass -- fused: the float32 dQ's cast -- timed apart:
                    ms_delta_dkdv, ms_dq); every Gluon variant rerun once (bit_identical_rerun;
                    a warning where one not named *atomic differs);
  call/<variant>    ``o = attn(q, k, v); torch.autograd.grad(o, (q, k, v), do)`` (the public call,
                    forward included; gluon_backward.DEFAULT switched for the Gluon rows);
  sdpa_<backend>    SDPA's forward + backward the same way (causal and full only).
TFLOP/s count visible cells: backward 10 * d * cells * B * H, forward + backward 14 * d * ...
"""
from __future__ import annotations

import json
import math
import sys
import time

CASES = {"causal_d128": (4, 16, 8192, 128, "causal"), "full_d128": (4, 16, 8192, 128, "true"),
         "causal_d64": (4, 32, 8192, 64, "causal")}


def _variants(d, names=None):
    from attnc.backends.triton import gluon_backward as GB
    base = GB.default_config(d)
    out = {"triton": None, "gluon": base,
           "gluon_triton_dq": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "triton"}),
           "gluon_dkdv_s3": GB.GluonBackwardConfig(**{**base.__dict__, "stages": 3}),
           "gluon_dq_s3": GB.GluonBackwardConfig(**{**base.__dict__, "dq_stages": 3}),
           "gluon_dq_n128" if d == 128 else "gluon_dq_n64":
               GB.GluonBackwardConfig(**{**base.__dict__, "dq_block_n": 128 if d == 128 else 64}),
           "gluon_plain_atomic": GB.GluonBackwardConfig(**{**base.__dict__, "warp_specialize": False, "dq": "atomic"}),
           "gluon_fused": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused"}),
           "gluon_fused_atomic": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused_atomic"}),
           "gluon_fused_s3": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused", "stages": 3}),
           "gluon_fused_m128": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused", "block_m": 128}),
           "gluon_fused_b2": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused", "dq_buffers": 2}),
           "gluon_fused_atomic_b2": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused_atomic", "dq_buffers": 2}),
           "gluon_fused_single": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused", "dq_split": 1}),
           "gluon_fused_atomic_single": GB.GluonBackwardConfig(**{**base.__dict__, "dq": "fused_atomic", "dq_split": 1})}
    return {n: c for n, c in out.items() if names is None or n in names}


def _parts(kernel, config, q, k, v, o, lse, do, bench):
    """(ms of D and the dK/dV pass, ms of the dQ pass) of one Gluon launch, timed apart."""
    import torch
    from attnc.backends.triton import gluon_backward as GB
    b, _, s, _ = q.shape
    plan = kernel.plan(b, s, s, {}, 128, 64)
    launch = GB.GluonBackwardLaunch(kernel.module, config, plan.retile, (b, s, s), q.device)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    delta = launch.delta_pass(o, do, None, None)
    dqa = launch.dkdv_pass(q, k, v, lse, do, (), dk, dv, delta, None)
    launch.dq_pass(q, k, v, lse, do, (), dq, dk, dv, delta, dqa, None)
    front = bench(lambda: launch.dkdv_pass(q, k, v, lse, do, (), dk, dv, launch.delta_pass(o, do, None, None), None))
    back = bench(lambda: launch.dq_pass(q, k, v, lse, do, (), dq, dk, dv, delta, dqa, None))
    return front, back


def _tiles(d):
    from attnc.backends.triton import grad as G
    c = G.default_backward_config(d, d, False)
    return dict(block_m1=c.block_m1, block_n1=c.block_n1, block_m2=c.block_m2, block_n2=c.block_n2,
                num_warps=c.num_warps, num_stages=c.num_stages)


def _ref(q, k, v, do, causal, planes):
    import torch
    out = []
    for b, h in planes:
        qq, kk, vv = (x[b, h].float().detach().requires_grad_() for x in (q, k, v))
        s = (qq @ kk.T) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        (torch.softmax(s, -1) @ vv).backward(do[b, h].float())
        out.append((qq.grad, kk.grad, vv.grad))
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(path, names, variants=None, sdpa=("cudnn", "flash")):
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import attnc
    from attnc.backends.triton import gluon_backward as GB, runtime

    rows = open(path, "a")
    command = "python3 -m bench.gluon_backward_study " + " ".join(sys.argv[1:])
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    def emit(row):
        row = {"command": command, **env, **row}
        rows.write(json.dumps(row) + "\n")
        rows.flush()
        print(json.dumps(row), flush=True)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    table = []
    for name in names:
        batch, heads, seq, d, mask = CASES[name]
        causal = mask == "causal"
        cells = seq * (seq + 1) / 2 if causal else seq * seq
        bwd_flops = 10 * d * cells * batch * heads
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (batch, heads, seq, d)
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        text = f"attention s {{ heads = {heads} head_dim = {d} dtype = bf16 mask = {mask} }}"
        attn = attnc.compile(text)
        kernel = runtime.load(attn.specialize(heads, heads, d, d, "bf16"))
        o, lse = kernel(q, k, v, return_lse=True)
        planes = [(0, 0), (batch - 1, heads - 1)]
        refs = _ref(q, k, v, do, causal, planes)
        base = kernel.backward(q, k, v, o, lse, do)
        for vname, cfg in _variants(d, variants).items():
            row = {"case": name, "shape": f"B{batch} H{heads} S{seq} d{d} bf16 mask={mask}", "impl": f"kernel/{vname}",
                   "config": cfg.describe() if hasattr(cfg, "describe") else repr(cfg)}
            try:
                t0 = time.time()
                got = kernel.backward(q, k, v, o, lse, do, config=cfg)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)
                errs = [max(_rel(x[b, h], r) for (b, h), rr in zip(planes, refs) for x, r in [(got[i], rr[i])])
                        for i in range(3)]
                row["rel_l2_ref"] = errs
                row["rel_l2_triton"] = [_rel(a, b) for a, b in zip(got, base)]
                if vname.startswith("gluon"):
                    again = kernel.backward(q, k, v, o, lse, do, config=cfg)
                    row["bit_identical_rerun"] = all(torch.equal(a, b) for a, b in zip(got, again))
                    if "atomic" not in vname and not row["bit_identical_rerun"]:
                        row["warning"] = "a deterministic variant's rerun differs"
                if max(errs) > 2e-2:
                    row["error"] = "gradients off the reference"
                else:
                    ms = bench(lambda: kernel.backward(q, k, v, o, lse, do, config=cfg))
                    row.update(ms=ms, tflops=bwd_flops / ms * 1e-9)
                    if vname in ("gluon", "gluon_triton_dq", "gluon_fused", "gluon_fused_atomic", "gluon_fused_b2"):
                        front, back = _parts(kernel, cfg, q, k, v, o, lse, do, bench)
                        row.update(ms_delta_dkdv=front, ms_dq=back)
            except Exception as e:  # noqa: BLE001 - recorded, the study goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            emit(row)
            table.append(row)
        # the public call, forward + backward
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        for vname, default in (("triton", False), ("gluon", True)):
            GB.DEFAULT = default
            row = {"case": name, "impl": f"call/{vname}"}
            try:
                def step():
                    out = attn(*leaves)
                    return torch.autograd.grad(out, leaves, do)
                got = step()
                row["rel_l2_triton"] = [_rel(a, b) for a, b in zip(got, base)]
                ms = bench(step)
                row.update(ms=ms, tflops_fwd_bwd=1.4 * bwd_flops / ms * 1e-9)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            GB.DEFAULT = False
            emit(row)
            table.append(row)
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        for bname, backend in ((n, backends[n]) for n in sdpa):
            row = {"case": name, "impl": f"sdpa_{bname}"}
            try:
                with sdpa_kernel(backend):
                    def step():
                        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                        return torch.autograd.grad(out, leaves, do)
                    got = step()
                    row["rel_l2_triton"] = [_rel(a, b) for a, b in zip(got, base)]
                    ms = bench(step)
                row.update(ms=ms, tflops_fwd_bwd=1.4 * bwd_flops / ms * 1e-9)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            emit(row)
            table.append(row)
        del leaves, q, k, v, do, o, lse, base
        torch.cuda.empty_cache()
    print("\ncase          impl                        ms  TFLOP/s  (kernel: bwd; call/sdpa: fwd+bwd)  D+dKdV / dQ ms")
    for r in table:
        t = r.get("tflops") or r.get("tflops_fwd_bwd")
        parts = f"{r['ms_delta_dkdv']:.3f} / {r['ms_dq']:.3f}" if "ms_dq" in r else ""
        print(f"{r['case']:13s} {r['impl']:25s} {r.get('ms', float('nan')):7.3f} {t or float('nan'):7.1f} {parts} "
              f"{r.get('error', r.get('warning', ''))[:60]}")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--variants", default=None, help="comma-separated (default: all)")
    ap.add_argument("--sdpa", default="cudnn,flash")
    a = ap.parse_args()
    main(a.out, a.cases or list(CASES), a.variants.split(",") if a.variants else None,
         tuple(x for x in a.sdpa.split(",") if x))
