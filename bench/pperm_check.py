import os, json, torch, triton.testing, attnc, attnc.fp8 as F
b, h, s, d = 4, 16, 8192, 128
for mask in ("causal", "true"):
    attn = attnc.compile(f"attention c {{ heads = {h} head_dim = {d} dtype = bf16 mask = {mask} }}")
    kernel = attn.kernel("triton", attn.program)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = F.quantize(q), F.quantize(k), F.quantize(v, transposed=True)
    for bn in (128, 256):
        run = kernel.prepare(q8, k8, v8, engine="gluon", block_n=bn, q_descale=dq, k_descale=dk, v_descale=dv)
        o = run()[0]
        qd, kd, vd = (F.dequantize(x, sc, torch.bfloat16) for x, sc in ((q8, dq), (k8, dk), (v8, dv)))
        ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=mask == "causal")
        err = float((o.float() - ref.float()).norm() / ref.float().norm())
        ms = triton.testing.do_bench(run, warmup=50, rep=300)
        cells = b * h * (s * (s + 1) / 2 if mask == "causal" else s * s)
        print(json.dumps({"pperm": os.environ.get("ATTNC_P_PERM"), "mask": mask, "bn": bn, "tflops": 4 * d * cells / ms / 1e9,
                          "rel_l2_vs_dequant": err}), flush=True)
