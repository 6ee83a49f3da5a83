"""A Hugging Face model's prefill forward with attn_implementation = sdpa, flex_attention, attnc.

    PYTHONPATH=. python3 bench/hf_model.py --out bench/results/hf_model_h200.jsonl
        [--seqs 4096,8192] [--impls sdpa,flex_attention,attnc] [--runs 20] [--warm-cache]

An 8-layer Llama (hidden 2048, 16 / 8 heads, head dim 128, intermediate 5632, vocab 32000), random
initialised in bf16 on the GPU, batch 1, ``model(input_ids, use_cache=False)`` under
``torch.inference_mode()``: one model, its implementation switched with
``model.set_attn_implementation``.  For each sequence length and implementation:

- ``first_call_s``: the first forward at that length (compilation included: Triton's JIT for
  attnc, torch.compile for flex_attention).  By default the process starts with empty Triton and
  Inductor caches (temporary folders), so it is a cold first call; ``--warm-cache`` keeps the
  user's caches;
- ``median_ms`` over ``--runs`` forwards after ``--warmup`` more (each timed with
  ``time.perf_counter`` between ``torch.cuda.synchronize()`` calls: host time included, as a
  user sees it), with every sample recorded;
- the logits against sdpa's at the same length: relative L2 error and the largest absolute
  difference (float32), and whether the greedy next tokens agree.

``--train`` times a training step instead: ``loss = model(input_ids, labels=input_ids).loss`` and
``torch.autograd.grad(loss, parameters)`` (forward + backward with every parameter's gradient, no
optimizer), the model in train mode (dropout 0); each implementation's loss and gradients are
compared with sdpa's (relative L2 over all parameter gradients together).

Rows are JSON lines appended to ``--out`` as they are measured (the command line in each row);
a table is printed at the end.  Sdpa runs first at each length (the reference).  ``--smoke``
runs a tiny model on the CPU (the script's plumbing, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__ and str(ROOT) not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, str(ROOT))


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines file the rows are appended to")
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--impls", default="sdpa,flex_attention,attnc", help="comma-separated; sdpa is the reference")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-packed-check", action="store_true",
                    help="attnc: register(packed_sequences=False), no position_ids restart check (one sync per forward)")
    ap.add_argument("--use-cache", action="store_true", help="forward with a DynamicCache (default: use_cache=False)")
    ap.add_argument("--warm-cache", action="store_true", help="keep the Triton / Inductor caches (default: cold)")
    ap.add_argument("--train", action="store_true", help="time a training step (forward + backward, parameter "
                    "gradients, no optimizer) instead of the inference forward")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) if argv is None else \
        " ".join(["bench/hf_model.py", *map(shlex.quote, argv)])
    if not args.warm_cache:  # before torch / triton are imported: their cache folders are read once
        cold = tempfile.mkdtemp(prefix="attnc_hf_bench_")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cold, "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cold, "inductor")
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim = 2, 64, 4, 2, 16
        args.intermediate, args.vocab, args.runs, args.warmup = 128, 128, 3, 1
        if args.seqs == "4096,8192":
            args.seqs = "64,96"
        if args.impls == "sdpa,flex_attention,attnc":
            args.impls = "sdpa,attnc"

    import torch
    import transformers
    import attnc
    import attnc.integrations.transformers as attnc_hf  # (registers "attnc")
    attnc_hf.register(packed_sequences=not args.no_packed_check)

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    env = {"gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "attnc": attnc.__version__,
           "python": platform.python_version(), "caches": "warm" if args.warm_cache else "cold"}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:  # (the CPU smoke run needs no Triton)
        env["triton"] = None
    model_desc = {"model": "llama", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate": args.intermediate,
                  "vocab": args.vocab, "dtype": str(dtype).removeprefix("torch."), "batch": args.batch,
                  "use_cache": args.use_cache, "attnc_packed_check": not args.no_packed_check,
                  "phase": "train" if args.train else "forward"}

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                                   vocab_size=args.vocab, max_position_embeddings=max(map(int, args.seqs.split(","))))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters on {device}, "
          f"made in {time.perf_counter() - t0:.1f} s", flush=True)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def forward(ids):
        with torch.inference_mode():
            return model(ids, use_cache=args.use_cache).logits

    params = [p for p in model.parameters() if p.requires_grad]

    def train_step(ids):
        """(loss, gradients flattened into one float32 vector): forward + backward, no optimizer."""
        loss = model(ids, labels=ids, use_cache=False).loss
        grads = torch.autograd.grad(loss, params)
        return loss.detach(), grads

    def flat(grads):
        return torch.cat([g.float().reshape(-1) for g in grads])

    if args.train:
        model.train()
        step = train_step
    else:
        step = forward

    impls = args.impls.split(",")
    if "sdpa" in impls:
        impls = ["sdpa"] + [i for i in impls if i != "sdpa"]
    rows = []
    for s in map(int, args.seqs.split(",")):
        ids = torch.randint(0, args.vocab, (args.batch, s), generator=torch.Generator().manual_seed(s)).to(device)
        reference = None
        for impl in impls:
            row = {"schema": "attnc-hf-model-row/1", "command": command, "impl": impl, "S": s, **model_desc,
                   "env": env}
            try:
                model.set_attn_implementation(impl)
                assert model.config._attn_implementation == impl, model.config._attn_implementation
                sync()
                t = time.perf_counter()
                logits = step(ids)
                sync()
                row["first_call_s"] = time.perf_counter() - t
                for _ in range(args.warmup):
                    step(ids)
                samples = []
                for _ in range(args.runs):
                    sync()
                    t = time.perf_counter()
                    step(ids)
                    sync()
                    samples.append((time.perf_counter() - t) * 1e3)
                row["median_ms"] = statistics.median(samples)
                row["samples_ms"] = samples
                if args.train:  # (loss, gradients): the gradients take the logits' place in the comparison
                    loss, grads = logits
                    row["loss"] = float(loss)
                    logits = flat(grads)
                if impl == "sdpa":
                    reference = logits.float()
                elif reference is not None:
                    diff = logits.float() - reference
                    row["rel_l2_vs_sdpa"] = float(diff.norm() / reference.norm())
                    row["max_abs_vs_sdpa"] = float(diff.abs().max())
                    if not args.train:
                        row["argmax_agree_vs_sdpa"] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
                del logits
            except Exception as e:  # noqa: BLE001 - a failing implementation is a row, the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            rows.append(row)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(_line(row), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()

    print("\n" + _table(rows))
    return 1 if any("error" in r for r in rows) else 0


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['impl']:>15} S={r['S']:<6} ERROR {r['error'][:300]}"
    return (f"{r['impl']:>15} S={r['S']:<6} first {r['first_call_s']:7.2f} s  median {r['median_ms']:8.2f} ms  "
            f"rel_l2 vs sdpa {_fmt(r.get('rel_l2_vs_sdpa'), '.2e')}")


def _table(rows: list) -> str:
    sdpa = {r["S"]: r["median_ms"] for r in rows if r["impl"] == "sdpa" and "median_ms" in r}
    out = ["| impl | S | first call (s) | median (ms) | sdpa / impl | rel L2 vs sdpa | argmax agree |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['impl']} | {r['S']} | error: {r['error'][:80]} | | | | |")
            continue
        speed = sdpa[r["S"]] / r["median_ms"] if r["S"] in sdpa else None
        out.append(f"| {r['impl']} | {r['S']} | {r['first_call_s']:.2f} | {r['median_ms']:.2f} | {_fmt(speed, '.3f')} | "
                   f"{_fmt(r.get('rel_l2_vs_sdpa'), '.2e')} | {_fmt(r.get('argmax_agree_vs_sdpa'), '.4f')} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
