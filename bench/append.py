"""Append (chunked prefill) over a paged cache: ``attnc bench append``.

Each case is B requests with T committed tokens each and C new query rows (their K/V already
in the cache: the post-commit view, kv_lens = T + C), GQA 32/8, d 128, bf16, a paged nhd cache
with shuffled page ids; query row i of a request sees keys [0, T + i] (bottom-right causal).
Implementations, each checked against a float32 reference on the GPU before it is timed:

  attnc_call        ``attn.decode(q, k_cache=, v_cache=, block_table=, kv_lens=, q_lens=)`` as a
                    user makes it (metadata on the host, as serving engines keep it; the plan
                    comes from the plan cache after the first call): the untuned default, which
                    takes the Gluon engine over the cache where the rows fill its tiles;
  attnc_split       the same call with ``engine="split"``: the split-K/V producer and combine;
  attnc_contiguous  ``attnc.compile(spec)(q, k, v)`` on the same rows with K/V contiguous (bhsd):
                    the engine without the page table (its ceiling here);
  flex_default      FlexAttention (torch.compile) on contiguous K/V, a bottom-right causal
                    BlockMask made once, enable_gqa;
  sdpa_lower_right  SDPA with ``causal_lower_right`` (flash / efficient kernels) on contiguous
                    K/V with the heads repeated (SDPA's bias does not take enable_gqa).

With ``scores`` naming a score program (``harness.SCORES``: ``alibi``, ``softcap30``), the spec, the
reference and FlexAttention's score_mod apply it (the query row at position T + i); SDPA, which has
no score program, is timed on the plain causal rows only.

TFLOP/s count visible cells, 4 * d FLOPs each: C * T + C * (C + 1) / 2 per (request, head).
"""
from __future__ import annotations

import math

from .harness import SCORES, Rows, call_key, environment, prefill_flops, timed

APPEND_CASES = ((4, 8192, 2048, 16), (4, 8192, 2048, 128), (8, 2048, 1024, 16), (1, 2048, 2048, 16))
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def append_case(batch, t_len, c_len, page_size, generator):
    """Packed q [B * C, H_q, d]; contiguous k/v [B, H_kv, T + C, d]; the same K/V in a paged nhd
    cache with shuffled page ids; block_table, kv_lens and q_lens on the host."""
    import torch
    g = generator
    n = t_len + c_len
    q = torch.randn(batch * c_len, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, HEADS_KV, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, HEADS_KV, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    per = -(-n // page_size)
    pages = batch * per
    perm = torch.randperm(pages, device="cuda", generator=g)
    table = perm.view(batch, per).to(torch.int32)
    k_cache = torch.zeros(pages, page_size, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    pad = per * page_size - n
    for src, dst in ((k, k_cache), (v, v_cache)):
        rows = torch.nn.functional.pad(src.permute(0, 2, 1, 3), (0, 0, 0, 0, 0, pad))  # [B, per * P, H_kv, d]
        dst[perm] = rows.reshape(pages, page_size, HEADS_KV, HEAD_DIM)
    kv_lens = torch.full((batch,), n, dtype=torch.int32)
    q_lens = torch.full((batch,), c_len, dtype=torch.int32)
    return q, k, v, {"k_cache": k_cache, "v_cache": v_cache, "block_table": table.cpu(), "kv_lens": kv_lens,
                     "q_lens": q_lens}


def check_scores(scores) -> None:
    """Refuse score program names the bench does not know ('' is none)."""
    unknown = [n for n in scores if n and n not in SCORES]
    if unknown:
        raise ValueError(f"unknown score program '{unknown[0]}' (known: none, {', '.join(SCORES)})")


def run_append(cases=None, out=None, seed=0, command="", flex: bool = True, scores=("",)):
    import torch
    import attnc
    from torch.nn.attention.bias import causal_lower_right

    rows = Rows(out, command)
    env = environment()
    g = torch.Generator(device="cuda").manual_seed(seed)
    check_scores(scores)
    for (batch, t_len, c_len, page), score in ((c, n) for c in cases or APPEND_CASES for n in scores):
        statement, score_ref, score_flex = SCORES[score] if score else ("", None, None)
        contiguous = attnc.compile(f"attention append_contiguous {{ dtype = bf16 {statement} mask = causal }}")
        attn = attnc.compile(f"attention append_bench {{ dtype = bf16 {statement} mask = causal "
                             f"cache = paged(page_size = {page}, layout = nhd) }}")
        program = attn.specialize(HEADS_Q, HEADS_KV, HEAD_DIM, HEAD_DIM, "bf16")
        q, k, v, cache = append_case(batch, t_len, c_len, page, g)
        n = t_len + c_len
        cells = batch * (c_len * t_len + c_len * (c_len + 1) / 2)
        flops = prefill_flops(cells, HEADS_Q, HEAD_DIM, HEAD_DIM)
        q4 = q.view(batch, c_len, HEADS_Q, HEAD_DIM).transpose(1, 2)  # [B, H_q, C, d] view
        bias = causal_lower_right(c_len, n)
        group = HEADS_Q // HEADS_KV
        ref = torch.empty(batch, HEADS_Q, c_len, HEAD_DIM, device="cuda", dtype=torch.float32)
        for b in range(batch):  # float32 reference, one request at a time
            kf = k[b:b + 1].float().repeat_interleave(group, 1)
            vf = v[b:b + 1].float().repeat_interleave(group, 1)
            s = (q4[b:b + 1].float() @ kf.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
            qi = (t_len + torch.arange(c_len, device="cuda"))[:, None]
            ki = torch.arange(n, device="cuda")[None, :]
            if score_ref is not None:
                for h in range(HEADS_Q):
                    s[0, h] = score_ref(s[0, h], h, qi, ki)
            ref[b:b + 1] = torch.softmax(s.masked_fill(~(ki <= qi), float("-inf")), -1) @ vf
            del kf, vf, s

        def check(o, layout="packed"):
            o = o[0] if isinstance(o, tuple) else o
            if layout == "packed":
                o = o.view(batch, c_len, HEADS_Q, HEAD_DIM).transpose(1, 2)
            return float((o.float() - ref).norm() / ref.norm())

        record = {"_key": call_key(program, batch, c_len, [n] * batch), "bench": "append", "B": batch, "T": t_len,
                  "C": c_len, "H_q": HEADS_Q, "H_kv": HEADS_KV, "D": HEAD_DIM, "dtype": "bf16", "page_size": page,
                  "score": score or "none",
                  "visible_cells": cells, "env": env, "reference": "float32 softmax on GPU, per request",
                  "tolerance_rel_l2": 1e-2}
        label = f"append B={batch} T={t_len} C={c_len} page={page}" + (f" {score}" if score else "")
        kernel = attn.kernel("triton", program)
        engine = kernel.decode_plan(dict(cache), total_q=int(q.shape[0]))["engine"]
        timed(lambda: attn.decode(q, **cache), check, {**record, "impl": "attnc_call", "engine": engine}, rows,
              f"{label} attnc_call ({engine})", flops, "TFLOPs")
        timed(lambda: attn.decode(q, engine="split", **cache), check, {**record, "impl": "attnc_split"}, rows,
              f"{label} attnc_split", flops, "TFLOPs")
        qc = q4.contiguous()
        timed(lambda: contiguous(qc, k, v), lambda o: check(o, "bhsd"), {**record, "impl": "attnc_contiguous"},
              rows, f"{label} attnc_contiguous", flops, "TFLOPs")
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            torch._dynamo.reset()
            compiled = torch.compile(flex_attention)
            offset = t_len
            mask = create_block_mask(lambda b, h, qi, ki: ki <= qi + offset, None, None, c_len, n, device="cuda")
            mod = None
            if score_flex is not None:
                inner = score_flex()

                def mod(s, b, h, qi, ki):
                    return inner(s, b, h, qi + offset, ki)
            timed(lambda: compiled(qc, k, v, block_mask=mask, score_mod=mod, enable_gqa=True),
                  lambda o: check(o, "bhsd"),
                  {**record, "impl": "flex_default"}, rows, f"{label} flex_default", flops, "TFLOPs")
        if not score:
            kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            timed(lambda: torch.nn.functional.scaled_dot_product_attention(qc, kr, vr, attn_mask=bias),
                  lambda o: check(o, "bhsd"), {**record, "impl": "sdpa_lower_right", "note": "K/V heads repeated"},
                  rows, f"{label} sdpa_lower_right", flops, "TFLOPs")
            del kr, vr
        del q, k, v, cache, ref, qc
        torch.cuda.empty_cache()
    return list(rows)
