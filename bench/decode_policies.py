"""GPU study: the Triton split path under a spec's ``split =`` policy, and the (LSE, O)
workspace's partial-O dtype (issue 18).

    python3 bench/decode_policies.py [--out FILE.jsonl] [--cases 8x8192,32x8192,1x131072,64x2048]

For each decode case (GQA 32/8, d = 128, bf16, paged nhd page 16, shuffled pages; the shapes of
``attnc bench decode``) it times the kernels alone (plan made and uploaded once,
``Kernel.prepare_decode``), each checked first against a float32 reference on the GPU:

  auto              ``split = auto``: the untuned fast route (balanced shares of whole blocks), the
                    workspace's partial O in bf16 (the declared (LSE, O) field dtype);
  auto_f32_o        the same plan with partial O stored in float32 (what the kernel stored before:
                    ``workspace.vector_torch_dtype`` patched in a kernel of its own);
  mlu               ``state = mlu`` under the same plan (float32 u, m, l);
  balanced(S)       the spec's policy with S = auto's split count: exact per-request bounds, boundary
                    blocks read by both slots they straddle;
  balanced(8), capacity(8, 16), chunk(1024), heuristic(0.85): the spec's other policies.

Rows go to ``--out`` (JSON lines, ``bench.harness.timed``'s fields plus the plan's policy, slots
and workspace bytes).  What to read: ``auto`` against ``auto_f32_o`` is the workspace dtype's
cost or gain; ``balanced(S)`` against ``auto`` is what exact bounds cost at the same slot count.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if not __package__:  # run as a file from a checkout: its attnc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attnc.bench.harness import DECODE_CASES, Rows, decode_case, environment, timed  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
POLICIES = ("balanced(8)", "capacity(8, 16)", "chunk(1024)", "heuristic(0.85)")


def spec(split: str = "auto", state: str = "lse_o", name: str = "decode_policy") -> str:
    return (f"attention {name} {{ heads = {HQ} / {HKV} head_dim = {D} dtype = bf16 mask = causal "
            f"cache = paged(page_size = {PAGE}, layout = nhd) split = {split} state = {state} }}")


def kernel(split: str = "auto", state: str = "lse_o", name: str = "decode_policy"):
    from attnc.backends.triton import runtime
    from attnc.compiler.lower import compile_spec
    return runtime.load(compile_spec(spec(split, state, name)))


def f32_partial_o():
    """A kernel whose workspace stores partial O in float32: a spec of another name (so a module
    and launchers of its own: a compiled launch is bound to its argument dtypes) whose vector
    field dtype is patched."""
    import torch
    from attnc.backends.triton import workspace

    k = kernel(name="decode_policy_f32_o")
    real = workspace.vector_torch_dtype

    def patched(module, abi):
        return torch.float32 if module is k.module else real(module, abi)
    workspace.vector_torch_dtype = patched
    return k


def main(argv=None) -> int:
    import torch
    from attnc.backends.triton import workspace
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=",".join(f"{b}x{t}" for b, t in DECODE_CASES))
    args = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    rows = Rows(args.out, "python3 bench/decode_policies.py " + " ".join(argv or sys.argv[1:]))
    env = environment()
    g = torch.Generator(device="cuda").manual_seed(0)
    auto = kernel()
    variants = {"auto": auto, "auto_f32_o": f32_partial_o(), "mlu": kernel(state="mlu")}
    for batch, t_len in cases:
        q, k, v, k_cache, v_cache, table, kv_lens = decode_case(batch, t_len, HQ, HKV, D, PAGE, g)
        kf = k.float().repeat_interleave(HQ // HKV, 1)
        vf = v.float().repeat_interleave(HQ // HKV, 1)
        ref = (torch.softmax((q.float()[:, :, None] @ kf.transpose(-1, -2)) / math.sqrt(D), -1) @ vf)[:, :, 0]
        del kf, vf
        kv_bytes = 2 * batch * t_len * HKV * D * 2
        cache = {"k_cache": k_cache, "v_cache": v_cache, "block_table": table, "kv_lens": kv_lens}

        def check(o):
            o = o[0] if isinstance(o, tuple) else o
            return float((o.float() - ref).norm() / ref.norm())

        s_auto = auto.decode_plan(cache)["splits"]
        todo = dict(variants)
        for policy in (f"balanced({s_auto})", *POLICIES):
            todo[policy] = kernel(policy)
        for name, kern in todo.items():
            plan = kern.decode_plan(cache)
            run = kern.prepare_decode(q, plan, **cache)
            ws = workspace.workspace_bytes(kern.module, plan["total_q"], plan["splits"], kern.program.state.value)
            record = {"bench": "decode_policy", "impl": name, "B": batch, "T": t_len, "H_q": HQ, "H_kv": HKV,
                      "D": D, "page_size": PAGE, "env": env, "policy": plan["policy"], "slots": plan["splits"],
                      "block_n": plan["block_n"], "workspace_bytes": ws, "kv_bytes": kv_bytes,
                      "reference": "float32 softmax on GPU (all rows)", "tolerance_rel_l2": 1e-2}
            timed(run, check, record, rows, f"B={batch:3} T={t_len:6} {name:18} slots {plan['splits']:3} "
                  f"ws {ws:>9} B", kv_bytes, "TBps")
        del k, v, k_cache, v_cache
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
