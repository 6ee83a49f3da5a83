"""GPU benchmark of a gpt-oss-shaped attention layer with learned sinks (issue 36): 64 / 8 heads,
d 64, bf16 q / k / v, one float32 sink per query head (``sink = sinks[h]``), gpt-oss's two layers
-- sliding window 128 (``causal & window(128)``) and causal --, S = 8192, B = 1, 2, 4 unless told;
attnc's public call against its peers in one process on the same inputs:

  attnc_call    ``attn(q, k, v, sinks=sinks)`` (Hopper: the Gluon engine forward, the Gluon
                backward; dSinks from LSE and D);
  attnc_triton  the Triton kernels: the forward by ``engine="triton"`` on the spec's kernel, the
                backward with ``gluon_backward.DEFAULT`` off (no fwd_bwd row: it would mix engines);
  attnc_tiles128  the Gluon forward on 128 x 128 tiles (two consumer warpgroups; the default at d 64
                is 192 x 128, three, where ptxas spills 24 bytes once a sink joins a window mask's
                epilogue): forward only, to choose the tiles for the window layer;
  flex_renorm   transformers' way for gpt-oss on FlexAttention: ``flex_attention(..., enable_gqa=True,
                return_lse=True)`` compiled, then the sink joined in eager PyTorch by renormalising
                O with LSE (LSE and the sinks in v's dtype, ``logsumexp`` over [LSE, sink], O times
                exp(LSE - combined));
  flex_renorm_compiled   the same two steps in one ``torch.compile``'d function (the renormalisation
                fused where Inductor can);
  fa4           FlashAttention-4 (``flash_attn.cute.flash_attn_func``, its ``learnable_sink``; bshd
                copies made outside the timed call), skipped with a line where not importable.

Every implementation is checked first against a float32 dense reference on the GPU (the sink
concatenated to each row's logits, softmax, the sink's column dropped; autograd): O and dQ of
query heads 0 and G - 1 (G = 8, the GQA group) of the first and last request, dK and dV of K/V
head 0 of both (its group's heads summed), dSinks of heads 0 .. G - 1 over the whole batch; worst
relative L2 within 2e-2.  Phases: ``fwd`` (no autograd), ``bwd`` (``torch.autograd.grad`` of
(q, k, v, sinks) on a graph made once), ``fwd_bwd``.  TFLOP/s count visible cells only (forward
4 * d per cell, backward 2.5x, forward+backward 3.5x).  The run ends with the issue's targets per
(layer, B): forward >= 1.3x flex (its best form) and >= 1.0x fa4, backward >= 1.0x both.

``python3 -m bench.sinks [--batches 1,2,4] [--seq 8192] [--layers sliding_128,causal] [--out ...]``
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys

from .harness import Rows, environment, timed

HEADS, HEADS_KV, HEAD_DIM, WINDOW = 64, 8, 64, 128
LAYERS = {"sliding_128": f"causal & window({WINDOW})", "causal": "causal"}
SPEC = ("attention gpt_oss_{layer} {{ heads = {h_q} / {h_kv} head_dim = {d} dtype = bf16 tensor sinks: f32[h] "
        "mask = {mask} sink = sinks[h] }}")
TARGETS = {"fwd": {"flex": 1.3, "fa4": 1.0}, "bwd": {"flex": 1.0, "fa4": 1.0}}
FORWARD_ONLY = ("attnc_tiles128",)


def visible_cells(seq: int, window: int | None) -> int:
    """Visible (query, key) cells of one (request, head): causal, or causal within ``window`` keys."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def visible(seq: int, window: int | None, device):
    import torch
    i = torch.arange(seq, device=device)
    vis = i[:, None] >= i[None, :]
    return vis & (i[:, None] - i[None, :] < window) if window is not None else vis


def reference_plane(q, k, v, sinks, do, vis, scale: float):
    """float32 O and (dq, dk, dv, dsink) of one (request, query head) plane: q [S_q, d], k and v
    [S_k, d], the head's sink (a 0-d tensor), dO [S_q, d]; the sink joins each row's logits as one
    more column, dropped after the softmax."""
    import torch
    qq, kk, vv = (x.float().detach().requires_grad_() for x in (q, k, v))
    ss = sinks.float().detach().clone().requires_grad_()
    logits = (qq @ kk.T * scale).masked_fill(~vis, float("-inf"))
    p = torch.softmax(torch.cat([logits, ss.expand(logits.shape[0], 1)], -1), -1)[:, :-1]
    o = p @ vv
    o.backward(do.float())
    return o.detach(), (qq.grad, kk.grad, vv.grad, ss.grad)


def reference(q, k, v, sinks, do, window, group):
    """The checked quantities (module docstring): {"o": {(b, h): O}, "dq": {(b, h): dq}, "dk",
    "dv": {(b, 0): ...}, "dsinks": [G]}, from the planes of query heads 0 .. G - 1 of every request."""
    import torch
    batch, seq = q.shape[0], q.shape[2]
    vis = visible(seq, window, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = {"o": {}, "dq": {}, "dk": {}, "dv": {}, "dsinks": torch.zeros(group, device=q.device)}
    for b in range(batch):
        dk = dv = 0.0
        for h in range(group):
            o, (dq_, dk_, dv_, ds) = reference_plane(q[b, h], k[b, 0], v[b, 0], sinks[h], do[b, h], vis, scale)
            dk, dv = dk + dk_, dv + dv_
            out["dsinks"][h] += ds
            if (b, h) in ((0, 0), (batch - 1, group - 1)):
                out["o"][(b, h)], out["dq"][(b, h)] = o, dq_
        if b in (0, batch - 1):
            out["dk"][(b, 0)], out["dv"][(b, 0)] = dk, dv
    return out


def rel(a, b) -> float:
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))


def check_forward(ref):
    return lambda o: max(rel(o[b, h], r) for (b, h), r in ref["o"].items())


def check_backward(ref, group):
    def check(grads):
        dq, dk, dv, ds = grads
        worst = max(rel(dq[b, h], r) for (b, h), r in ref["dq"].items())
        for x, name in ((dk, "dk"), (dv, "dv")):
            worst = max(worst, *(rel(x[b, h], r) for (b, h), r in ref[name].items()))
        return max(worst, rel(ds[:group], ref["dsinks"]))
    return check


def renormalised(o, lse, sinks):
    """transformers' sink join on FlexAttention's (O, LSE): in v's dtype, as its gpt-oss path does."""
    import torch
    lse = lse.to(o.dtype).unsqueeze(-1)
    sink = sinks.to(o.dtype).view(1, -1, 1, 1).expand(lse.shape)
    combined = torch.logsumexp(torch.cat([lse, sink], -1), -1, keepdim=True)
    return o * torch.exp(lse - combined)


def _fa4(q, k, v, sinks, window):
    """FlashAttention-4's forward on its own bshd copies, its leaves, and dO's layout change, or why
    it is skipped."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:
        return f"flash_attn.cute is not importable: {e}"
    qs, ks, vs = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    left = (window - 1, 0) if window is not None else (None, None)

    def forward():
        r = flash_attn_func(qs, ks, vs, causal=True, window_size=left, learnable_sink=sinks)
        return (r[0] if isinstance(r, tuple) else r).transpose(1, 2)
    return forward, (qs, ks, vs, sinks)


def run_sinks(batches=(1, 2, 4), seq=8192, layers=tuple(LAYERS), out=None, seed=0, command="", flex=True, fa4=True):
    import torch
    import attnc
    from attnc.backends.triton import gluon_backward as GB, runtime

    rows = Rows(out, command)
    env = environment()
    group = HEADS // HEADS_KV
    for layer in layers:
        window = WINDOW if layer == "sliding_128" else None
        text = SPEC.format(layer=layer, h_q=HEADS, h_kv=HEADS_KV, d=HEAD_DIM, mask=LAYERS[layer])
        attn = attnc.compile(text)
        kernel = runtime.load(attn.program)
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            torch._dynamo.reset()
            torch._functorch.config.donated_buffer = False  # bwd replays one graph (retain_graph)
            mask_mod = (lambda b, h, qi, ki: (qi >= ki) & (qi - ki < WINDOW)) if window else \
                (lambda b, h, qi, ki: qi >= ki)
            block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cuda")
            flex_fn = torch.compile(flex_attention)

            def flex_renorm(q, k, v, s):
                return renormalised(*flex_fn(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True), s)
            flex_whole = torch.compile(lambda q, k, v, s: renormalised(
                *flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True), s))
        for batch in batches:
            g = torch.Generator(device="cuda").manual_seed(seed)
            shapes = ((batch, HEADS, seq, HEAD_DIM), (batch, HEADS_KV, seq, HEAD_DIM), (batch, HEADS_KV, seq, HEAD_DIM))
            q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                       for s in shapes)
            sinks = (torch.rand(HEADS, device="cuda", generator=g) * 4 - 2).requires_grad_()
            do = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16, generator=g)
            ref = reference(q, k, v, sinks, do, window, group)
            cells = visible_cells(seq, window) * batch
            fwd_flops = 4.0 * HEAD_DIM * cells * HEADS
            record = {"bench": "sinks", "layer": layer, "mask": LAYERS[layer], "B": batch, "H": HEADS, "H_kv": HEADS_KV,
                      "S": seq, "D": HEAD_DIM, "dtype": "bf16", "sink": "sinks[h] f32", "visible_cells": cells,
                      "env": env, "tolerance_rel_l2": 2e-2,
                      "reference": "float32 dense autograd on GPU (sink as one more logit column): O, dq of heads 0 "
                                   "and G-1 of the first and last request, dk/dv of K/V head 0, dsinks of heads "
                                   "0..G-1; worst rel-L2"}
            impls = {"attnc_call": lambda: attn(q, k, v, sinks=sinks),
                     "attnc_triton": lambda: kernel(q, k, v, sinks=sinks, engine="triton"),
                     "attnc_tiles128": lambda: kernel(q, k, v, sinks=sinks, engine="gluon", block_m=128, block_n=128)}
            if flex:
                impls["flex_renorm"] = lambda: flex_renorm(q, k, v, sinks)
                impls["flex_renorm_compiled"] = lambda: flex_whole(q, k, v, sinks)
            leaves = {n: ((q, k, v, sinks), None) for n in impls}
            if fa4:
                peer = _fa4(q, k, v, sinks, window)
                if isinstance(peer, str):
                    print(f"{layer} B={batch} fa4: skipped ({peer})", flush=True)
                else:
                    impls["fa4"], leaves["fa4"] = peer[0], (peer[1], "bshd")
            _time_impls(impls, leaves, do, ref, group, record, rows, fwd_flops, GB)
            del q, k, v, sinks, do, ref, impls, leaves
            torch.cuda.empty_cache()
    summary = sinks_summary(rows)
    for line in summary:
        print(line, flush=True)
    return list(rows)


def _time_impls(impls, leaves, do, ref, group, record, rows, fwd_flops, GB):
    import torch
    label = f"{record['layer']:11} B={record['B']} S={record['S']}"
    for impl, forward in impls.items():
        grad_of, layout = leaves[impl]
        grad_o = do.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else do

        def fwd(forward=forward):
            with torch.no_grad():
                return forward()
        timed(fwd, check_forward(ref), {**record, "impl": impl, "phase": "fwd"}, rows, f"{label} {impl:21} fwd    ",
              fwd_flops, "TFLOPs", tol=2e-2)
        if impl in FORWARD_ONLY:
            continue
        triton_bwd = impl == "attnc_triton"
        if triton_bwd:  # the Triton backward under the public call (its forward: the default engine)
            forward = impls["attnc_call"]
        try:
            o = forward()
        except Exception as e:  # noqa: BLE001 - a peer failing is a row
            rows.append({**record, "impl": impl, "phase": "bwd", "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
            print(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[-300:]}", flush=True)
            continue

        def bwd(o=o, grad_of=grad_of, grad_o=grad_o, triton_bwd=triton_bwd):
            GB.DEFAULT = not triton_bwd
            try:
                grads = torch.autograd.grad(o, grad_of, grad_o, retain_graph=True)
            finally:
                GB.DEFAULT = True
            return _bhsd(grads, layout)

        def fwd_bwd(forward=forward, grad_of=grad_of, grad_o=grad_o):
            return _bhsd(torch.autograd.grad(forward(), grad_of, grad_o), layout)
        timed(bwd, check_backward(ref, group), {**record, "impl": impl, "phase": "bwd"}, rows,
              f"{label} {impl:21} bwd    ", 2.5 * fwd_flops, "TFLOPs", tol=2e-2)
        if not triton_bwd:
            timed(fwd_bwd, check_backward(ref, group), {**record, "impl": impl, "phase": "fwd_bwd"}, rows,
                  f"{label} {impl:21} fwd+bwd", 3.5 * fwd_flops, "TFLOPs", tol=2e-2)
        del o


def _bhsd(grads, layout):
    if layout != "bshd":
        return grads
    return tuple(g.transpose(1, 2) for g in grads[:3]) + tuple(grads[3:])


def sinks_summary(rows) -> list[str]:
    """One line per (layer, B, phase): attnc_call's speedup over flex's best form and over fa4 (their
    median ms over attnc's), with the issue's target and whether it is met."""
    best: dict = {}
    for r in rows:
        if r.get("bench") != "sinks" or not r.get("pass"):
            continue
        peer = "flex" if r["impl"].startswith("flex") else r["impl"]
        key = (r["layer"], r["B"], r["phase"], peer)
        best[key] = min(best.get(key, math.inf), r["median_ms"])
    lines = []
    phases = ("fwd", "bwd", "fwd_bwd")
    for (layer, batch, phase, peer), ms in sorted(best.items(), key=lambda x: (x[0][:2], phases.index(x[0][2]))):
        if peer != "attnc_call":
            continue
        parts = []
        for other, target in TARGETS.get(phase, {}).items():
            theirs = best.get((layer, batch, phase, other))
            if theirs is None:
                parts.append(f"{other}: no row")
                continue
            x = theirs / ms
            parts.append(f"{other} {x:.2f}x (target {target}x: {'met' if x >= target else 'NOT met'})")
        lines.append(f"{layer:11} B={batch} {phase:7} attnc {ms * 1e3:8.1f} us  " + "; ".join(parts))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--out", default="bench/results/sinks_h200.jsonl")
    a = p.parse_args(argv)
    layers = tuple(a.layers.split(","))
    for layer in layers:
        if layer not in LAYERS:
            p.error(f"--layers: {layer!r} is not one of {', '.join(LAYERS)}")
    if not a.no_fa4 and importlib.util.find_spec("flash_attn") is None:
        print("fa4: skipped (flash_attn is not importable)", flush=True)
    command = "python3 -m bench.sinks " + " ".join(sys.argv[1:] if argv is None else argv)
    run_sinks(tuple(int(b) for b in a.batches.split(",")), a.seq, layers, a.out, command=command,
              flex=not a.no_flex, fa4=not a.no_fa4 and importlib.util.find_spec("flash_attn") is not None)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
