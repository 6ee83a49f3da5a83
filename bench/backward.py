"""GPU benchmark of training: the backward pass and forward+backward of attnc's public call,
against FlexAttention (compiled, the same BlockMask made once; its Triton kernels and, as
``flex_flash``, ``kernel_options={"BACKEND": "FLASH"}``), FlashAttention-4
(``flash_attn.cute.flash_attn_func``; ``flash_attn_varlen_func`` over the documents) and SDPA
(cuDNN, flash; causal and full), in one process on the same inputs.  A peer that is not
importable is skipped (a line says so); one that fails is an error row.  FlashAttention-4 takes
its own bshd copies of q, k, v and dO (its layout: no transposing copy inside the timed call).

``attnc bench backward``.  Each implementation's dQ, dK, dV are checked
first against a float32 dense reference (autograd over masked softmax on the GPU) on two (b, h)
planes.  Timings:
  fwd_bwd   ``o = f(q, k, v); o.backward(do)`` (q, k, v require grad);
  bwd       ``torch.autograd.grad(o, (q, k, v), do, retain_graph=True)`` on a graph made once.
TFLOP/s count visible cells only: forward 4 * d * cells, backward 2.5x that (10 * d * cells),
forward+backward 3.5x.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .peers import fa4 as fa4_peer, flash_importable
from .harness import (GOAL_MASKS, PREFILL_MASKS, Rows, _dense_visible, _flex_mask_mod, _visible_cells, call_key,
                      environment, spec_text, timed)


def _reference_grads(q, k, v, do, planes, dense):
    """float32 (dq, dk, dv) of each (b, h) plane by autograd over dense masked softmax."""
    import torch
    out = []
    for b, h in planes:
        qq, kk, vv = (x[b, h].float().detach().requires_grad_() for x in (q, k, v))
        s = (qq @ kk.T) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~dense(b), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        (p @ vv).backward(do[b, h].float())
        out.append((qq.grad, kk.grad, vv.grad))
    return out


def run_backward(batch=4, heads=16, seq=8192, head_dim=128, masks=None, out=None, seed=0, command="",
                 flex_modes=("default",), sdpa=True, flex_flash=True, fa4=True):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import attnc
    from attnc.compiler import inputs

    rows = Rows(out, command)
    env = environment()
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name in masks or GOAL_MASKS:
        mask_src, decls = PREFILL_MASKS[name]
        attn = attnc.compile(spec_text(name, mask_src, decls))
        shape = (batch, heads, seq, head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        program = attn.specialize(heads, heads, head_dim, head_dim, "bf16")
        tensors = {}
        if program.tensors:
            sample = inputs.sample_tensors(program, batch, seq, seed)  # (q, k, v are drawn on the GPU)
            tensors = {t.name: torch.as_tensor(sample[t.name].astype(np.int32), device="cuda")
                       for t in program.tensors}
        visible = _visible_cells(program, batch, seq, tensors)
        fwd_flops = 4.0 * head_dim * visible * heads
        planes = [(0, 0), (batch - 1, heads - 1)]
        dense = _dense_visible(program, seq, tensors)
        refs = _reference_grads(q, k, v, do, planes, dense)

        def check_bhsd(grads):
            worst = 0.0
            for (b, h), ref in zip(planes, refs):
                for gx, r in zip(grads, ref):
                    worst = max(worst, float(((gx[b, h].float() - r).norm() / r.norm())))
            return worst

        record = {"_key": call_key(program, batch, seq, seq), "bench": "backward", "mask": name, "B": batch,
                  "H": heads, "S": seq, "D": head_dim, "dtype": "bf16", "visible_cells": visible,
                  "density": visible / (batch * seq * seq), "env": env,
                  "reference": f"float32 dense autograd on GPU, (b,h) in {planes}, worst of dq/dk/dv",
                  "tolerance_rel_l2": 2e-2}
        label = f"{name:20} B={batch} S={seq}"
        impls = {"attnc_call": lambda: attn(q, k, v, **tensors)}
        if flex_modes:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            torch._dynamo.reset()
            # the bwd timing replays one graph's backward (retain_graph): compiled graphs must not donate
            # their saved buffers to the first backward
            torch._functorch.config.donated_buffer = False
            block_mask = create_block_mask(_flex_mask_mod(name, tensors), batch if tensors else None, None, seq, seq,
                                           device="cuda")
            for mode in flex_modes:
                compiled = torch.compile(flex_attention) if mode == "default" else torch.compile(flex_attention,
                                                                                                 mode=mode)
                impls[f"flex_{mode}"] = (lambda c=compiled: c(q, k, v, block_mask=block_mask))
        if sdpa and name in ("causal", "full"):
            for impl, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal")
                impls[impl] = fn
        if flex_flash and flex_modes and not flash_importable():
            print(f"{label} flex_flash: skipped (its FLASH backend needs flash_attn.cute, not importable)", flush=True)
        elif flex_flash and flex_modes:
            impls["flex_flash"] = (lambda c=torch.compile(flex_attention): c(
                q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"}))
        leaves = {impl: ((q, k, v), do, None) for impl in impls}
        if fa4:
            peer = fa4_peer(name, q, k, v, tensors, grad=True)
            if isinstance(peer, str):
                print(f"{label} fa4: skipped ({peer})", flush=True)
            else:  # its own bshd leaves and dO; its gradients back to bhsd for the check
                forward, fa4_leaves, to_bhsd = peer
                impls["fa4"] = forward
                leaves["fa4"] = (fa4_leaves, do.transpose(1, 2).contiguous(), lambda gs, f=to_bhsd: [f(x) for x in gs])
        for impl, forward in impls.items():
            grad_of, grad_o, to_bhsd = leaves[impl]
            t0 = time.perf_counter()
            try:
                o = forward()
                torch.autograd.grad(o, grad_of, grad_o)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a peer failing is a row
                rows.append({**record, "impl": impl, "error": f"{type(e).__name__}: {str(e)[-1200:]}"})
                print(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[-300:]}", flush=True)
                continue
            first_ms = (time.perf_counter() - t0) * 1e3
            o = forward()

            def bwd(o=o, grad_of=grad_of, grad_o=grad_o):
                return torch.autograd.grad(o, grad_of, grad_o, retain_graph=True)

            def fwd_bwd(forward=forward, grad_of=grad_of, grad_o=grad_o):
                return torch.autograd.grad(forward(), grad_of, grad_o)

            check = check_bhsd if to_bhsd is None else (lambda grads, f=to_bhsd: check_bhsd(f(grads)))
            timed(bwd, check, {**record, "impl": impl, "phase": "bwd", "first_call_ms": first_ms}, rows,
                  f"{label} {impl:14} bwd    ", 2.5 * fwd_flops, "TFLOPs", tol=2e-2)
            timed(fwd_bwd, check, {**record, "impl": impl, "phase": "fwd_bwd"}, rows,
                  f"{label} {impl:14} fwd+bwd", 3.5 * fwd_flops, "TFLOPs", tol=2e-2)
            del o, grad_of, grad_o
        del q, k, v, do, leaves, impls
        torch.cuda.empty_cache()
    return list(rows)
