"""transformers' continuous batching (``model.generate_batch``) on attnc's paged append against
transformers' default paged attention: generated tokens per second at N concurrent requests.

    PYTHONPATH=. python3 bench/hf_continuous_batching.py --out bench/results/hf_cb_h200.jsonl
        [--requests 64] [--prompt 128:1024] [--new-tokens 128] [--impls sdpa,attnc] [--runs 3]

A Llama (default: 8 layers, hidden 1024, 16 / 8 heads, head dim 64, intermediate 2816, vocab
32000), random initialised in bf16 on the GPU.  ``--requests`` prompts of lengths drawn uniformly
from ``--prompt`` (seeded), each generating ``--new-tokens`` greedy tokens (no EOS: every request
runs to the end), all submitted at once to ``generate_batch``.  Implementations:

- ``sdpa`` (the reference): the model loaded with ``attn_implementation="sdpa"``, continuous
  batching with transformers' defaults, so transformers picks its default paged path (``sdpa`` or
  ``paged|sdpa``, or FlashAttention when it is installed) and its CUDA-graph setting; the name it
  ran is recorded (``ran``).  ``paged|eager`` or a flash name may be given too;
- ``attnc``: ``attnc.integrations.transformers.continuous_batching(model)``, CUDA graphs off (an
  append validates each step on the host).

Per implementation: one warm-up ``generate_batch`` (a few requests: compilation, Triton's JIT),
then ``--runs`` timed ones (``time.perf_counter`` around the call, ``torch.cuda.synchronize``
after), each sample recorded; ``tokens_per_s`` = generated tokens / median seconds.  Each
implementation's tokens are compared with the reference's: ``same_requests`` (identical token
lists; bf16 rounding may let a near-tie flip) and ``same_tokens`` (matching prefix tokens).
Rows are JSON lines appended to ``--out`` (the command in each row).  ``--smoke`` runs a tiny
float32 model on the CPU (the script's plumbing, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__ and str(ROOT) not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, str(ROOT))


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines file the rows are appended to")
    ap.add_argument("--impls", default="sdpa,attnc", help="comma-separated; the first is the reference")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", default="128:1024", help="prompt lengths MIN:MAX (uniform, seeded)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=None, help="default: transformers' own")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="default: transformers' own")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the model's dtype on the GPU (float32: tokens comparable without bf16 near-ties)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script")
    return ap.parse_args(argv)


def _cb_config(args, impl: str):
    from transformers.generation import ContinuousBatchingConfig
    kw = {}
    if args.page_size:
        kw["page_size" if hasattr(ContinuousBatchingConfig(), "page_size") else "block_size"] = args.page_size
    if args.max_batch_tokens:
        kw["max_batch_tokens"] = args.max_batch_tokens
    if impl == "attnc":
        kw["use_cuda_graph"] = False
    if args.smoke:
        kw.update(num_blocks=64, use_cuda_graph=False)
    return ContinuousBatchingConfig(**kw)


def main(argv=None) -> int:
    args = _args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) if argv is None else \
        " ".join(["bench/hf_continuous_batching.py", *map(shlex.quote, argv)])
    import torch
    import transformers
    from transformers import GenerationConfig

    import attnc.integrations.transformers as hf
    transformers.logging.set_verbosity_error()
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim = 2, 64, 4, 2, 16
        args.intermediate, args.vocab, args.requests, args.new_tokens, args.runs = 128, 128, 4, 4, 1
        args.prompt, args.page_size, args.max_batch_tokens = "5:40", 16, 32
    elif not torch.cuda.is_available():
        print("hf_continuous_batching: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", getattr(torch, args.dtype))
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab,
                                   max_position_embeddings=8192)
    torch.manual_seed(args.seed)
    weights = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device, dtype).eval()
    lo, hi = (int(x) for x in args.prompt.split(":"))
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)

    rows, reference = [], None
    for impl in args.impls.split(","):
        model = weights
        if impl == "attnc":
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="attnc").to(device, dtype)
            model.load_state_dict(weights.state_dict())
            hf.continuous_batching(model.eval())
        elif impl != "sdpa":
            model.set_attn_implementation(impl)
        ran = []
        hook = model.register_forward_pre_hook(lambda m, a: ran.append(m.config._attn_implementation) and None)

        def run(batch):
            out = model.generate_batch(batch, generation_config=gen, continuous_batching_config=_cb_config(args, impl),
                                       progress_bar=False)
            if device == "cuda":
                torch.cuda.synchronize()
            return list(out.values())

        run(prompts[:4])
        samples = []
        for _ in range(args.runs):
            t = time.perf_counter()
            out = run(prompts)
            samples.append(time.perf_counter() - t)
        hook.remove()
        if impl != "attnc" and impl != "sdpa":
            model.set_attn_implementation("sdpa")
        errors = [o.error for o in out if o.error]
        tokens = [o.generated_tokens for o in out]
        reference = tokens if reference is None else reference
        same_tokens = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                          for x, y in zip(tokens, reference))
        median = statistics.median(samples)
        row = dict(bench="hf_continuous_batching", impl=impl, ran=ran[-1] if ran else None,
                   transformers=transformers.__version__, torch=torch.__version__, device=(
                       torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"),
                   requests=args.requests, prompt_tokens=sum(lengths), new_tokens=args.new_tokens,
                   generated=sum(len(t) for t in tokens), median_s=median, samples_s=samples,
                   tokens_per_s=sum(len(t) for t in tokens) / median, errors=errors[:3],
                   same_requests=sum(a == b for a, b in zip(tokens, reference)),
                   same_tokens=same_tokens, model=dict(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                                       kv_heads=args.kv_heads, head_dim=args.head_dim),
                   dtype=str(dtype).removeprefix("torch."), smoke=args.smoke, command=command)
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"{'impl':<14}{'ran':<22}{'tokens/s':>10}{'median s':>10}{'same req':>10}")
    for r in rows:
        print(f"{r['impl']:<14}{str(r['ran']):<22}{r['tokens_per_s']:>10.1f}{r['median_s']:>10.3f}"
              f"{r['same_requests']:>7}/{r['requests']}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
