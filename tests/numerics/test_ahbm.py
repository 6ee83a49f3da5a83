"""The generated AHBM programs on the mesh simulator against the float64 oracle (ADR-0060 §11.1):
the four cases for small (G, T_q, S, N), masks beyond causal with and without SP (from the
FlashMask intervals and from the predicate), and every example in decode and prefill."""
import numpy as np
import pytest

pytest.importorskip("greenlet", reason="greenlet (a project dependency) is not installed")

from attnc.backends.ahbm import runtime  # noqa: E402
from attnc.compiler import oracle  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from tests.conftest import EXAMPLES, ROOT  # noqa: E402


def check(kernel, s_q, s_k, batch=1, seed=0, **options):
    """Run one call on the simulator; assert O and LSE match the oracle. Returns the Run."""
    program = kernel.program
    arrays = inputs.sample(program, batch, s_q, s_k, seed=seed)
    call = inputs.validate(program, arrays)
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True, **options,
                    **{t.name: arrays[t.name] for t in program.tensors})
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse, ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    empty = ~oracle.dense_mask(program, call.batch, s_q, s_k, call.tensors).any(-1)
    assert (np.isneginf(lse) == empty).all()  # all-masked rows: O = 0, LSE = -inf
    assert (inputs.output_bhsd(program, o)[empty] == 0).all()
    return kernel.last_run


# (G, T_q, S, N): decode (T_q = 1) and prefill/append, with N = 1 (no SP) or N PEs
SHAPES = [
    (1, 1, 37, 1), (4, 1, 37, 8), (2, 1, 50, 3), (8, 1, 5, 8),  # decode; S < N: PEs without slots
    (4, 40, 40, 1), (2, 40, 40, 4), (8, 13, 45, 3), (1, 33, 64, 2), (2, 20, 20, 4),  # prefill / ring
]


@pytest.mark.parametrize("G,T_q,S,N", SHAPES, ids=lambda x: str(x))
def test_four_cases_match_the_oracle(G, T_q, S, N):
    program = compile_spec(f"attention c {{ heads = {2 * G} / 2 head_dim = 32 dtype = f32 mask = causal }}")
    run = check(runtime.load(program, sp=N), T_q, S, batch=2, seed=G * S + N)
    want = {(True, False): "decode", (True, True): "decode-sp", (False, False): "prefill",
            (False, True): "ring"}[T_q == 1, N > 1]
    assert (run.program, run.sp) == (want, N)
    assert run.result.unconsumed_messages == 0


# (example, mask path): masks that read tensors run from the FlashMask intervals (the plan's
# choice) and from the predicate with the driver's tensor streams
BEYOND_CAUSAL = [("sliding_window_causal", None), ("dilated_sliding_window", None), ("alibi", None),
                 ("causal_document", None), ("causal_document", "predicate"),
                 ("bidirectional_document", "predicate"), ("random_eviction", None),
                 ("random_eviction", "predicate"), ("prefix_lm_document", "predicate")]


@pytest.fixture(scope="module", params=BEYOND_CAUSAL, ids=lambda p: f"{p[0]}-{p[1] or 'plan'}")
def masked(request):
    name, mask_from = request.param
    program = inputs.contiguous_variant(compile_file(ROOT / "examples" / f"{name}.attn"))
    return runtime.load(program), mask_from


@pytest.mark.parametrize("case,s_q,sp", [("decode", 1, 4), ("prefill", 48, 3), ("prefill", 17, 2)],
                         ids=["decode-sp4", "ring3", "ring2-append"])
def test_masks_beyond_causal_with_sp(masked, case, s_q, sp):
    kernel, mask_from = masked
    run = check(kernel, s_q, 48, batch=2, seed=5, sp=sp, case=case, mask_from=mask_from)
    assert run.program == ("decode-sp" if case == "decode" else "ring")


def test_decode_program_also_runs_a_block_of_query_rows():
    program = inputs.contiguous_variant(compile_file(ROOT / "examples" / "causal_document.attn"))
    run = check(runtime.load(program), 5, 40, batch=2, seed=3, case="decode", sp=3)
    assert run.program == "decode-sp"


@pytest.mark.parametrize("dtype,layout", [("f16", "bhsd"), ("bf16", "bshd")])
def test_storage_dtypes_and_layouts(dtype, layout):
    program = compile_spec(f"attention s {{ heads = 4 / 2 head_dim = 16 dtype = {dtype} "
                           f"mask = q >= 20 & window(8) cache = contiguous(layout = {layout}) }}")
    kernel = runtime.load(program)
    for s_q, sp in ((1, 1), (1, 4), (30, 1), (30, 3)):
        run = check(kernel, s_q, 30, batch=1, seed=s_q + sp, sp=sp)
        o = run.o
        assert o.dtype == (np.float16 if dtype == "f16" else np.float32)
        assert o.shape == ((1, s_q, 4, 16) if layout == "bshd" else (1, 4, s_q, 16))


@pytest.fixture(scope="module", params=EXAMPLES, ids=lambda p: p.stem)
def example_kernel(request):
    return runtime.load(inputs.contiguous_variant(compile_file(request.param)))


@pytest.mark.parametrize("case,s_q", [("decode", 1), ("prefill", 40)])
def test_every_example_runs_decode_and_prefill_without_sp(example_kernel, case, s_q):
    run = check(example_kernel, s_q, 40, batch=2, seed=11, case=case)
    assert run.program == case and run.sp == 1


@pytest.mark.parametrize("mask_from", [None, "predicate"])
def test_every_kind_of_tensor_stream(mask_from):
    """Reads that depend on b only (Python scalars), on the head, and on the head and the key,
    in the mask and in the score program."""
    program = compile_spec("attention s { heads = 4 / 2 head_dim = 16 dtype = f32 "
                           "tensor temp: f32[b] ~ uniform(1, 2) tensor bias: f32[b, h, s] ~ uniform(-1, 1) "
                           "tensor lo: i32[b, h] ~ randint(0, 3) "
                           "score = score * exp(-temp[b]) + bias[b, h, k] "
                           "mask = causal & k >= lo[b, h] | k < max(temp[b] * 0, 0.0) }")
    kernel = runtime.load(program)
    assert "np.exp(" in kernel.source.text  # the b-only read is a scalar (f32) in the kernel
    for s_q, sp in ((1, 1), (1, 3), (20, 1), (20, 3), (7, 2)):
        check(kernel, s_q, 20, batch=2, seed=s_q + sp, sp=sp, mask_from=mask_from)
