"""Every example × {prefill, append, decode} on the generated Triton kernel (CPU interpreter
unless ATTNC_TEST_GPU=1) against the float64 oracle, with the declared tolerances."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import oracle  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.errors import InputError  # noqa: E402
from attnc.compiler.lower import compile_file  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

PHASES = {"prefill": (40, 40), "append": (11, 40), "decode": (1, 40)}


@pytest.fixture(scope="module", params=EXAMPLES, ids=lambda p: p.stem)
def kernel(request):
    return runtime.load(inputs.contiguous_variant(compile_file(request.param)))


@pytest.mark.parametrize("phase", PHASES)
def test_triton_matches_oracle(kernel, phase):
    program = kernel.program
    s_q, s_k = PHASES[phase]
    arrays = inputs.sample(program, 2, s_q, s_k, seed=11)
    call = inputs.validate(program, arrays)
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                    **{t.name: arrays[t.name] for t in program.tensors})
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse, ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    assert np.isfinite(o).all()


def test_head_dims_that_are_not_powers_of_two_run_padded():
    from attnc.compiler.lower import compile_spec
    program = compile_spec("attention odd { heads = 4 / 2 head_dim = 24 / 40 dtype = f32 mask = causal }")
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 1, 9, 33, seed=2)
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True)
    ref_o, ref_lse = oracle.reference(program, arrays["q"], arrays["k"], arrays["v"])
    assert all(c.ok for c in numerics.compare_outputs("f32", o, lse, ref_o, ref_lse))


def test_all_masked_rows_and_torch_inputs():
    import torch
    from attnc.compiler.lower import compile_spec
    program = compile_spec("attention e { heads = 2 head_dim = 16 dtype = f16 mask = q >= 20 & causal }")
    kernel = runtime.load(program)
    q, k, v = (torch.randn(1, 2, 24, 16).to(torch.float16).to(kernel.device) for _ in range(3))
    o, lse = kernel(q, k, v, return_lse=True)
    assert o.dtype == torch.float16 and (o[:, :, :20] == 0).all() and torch.isneginf(lse[:, :, :20]).all()
    ref_o, ref_lse = oracle.reference(program, *(x.float().cpu().numpy() for x in (q, k, v)))
    assert all(c.ok for c in numerics.compare_outputs("f16", o.float().cpu().numpy(), lse.cpu().numpy(),
                                                      ref_o, ref_lse))
    wrong = "meta" if kernel.device == "cpu" else "cpu"  # torch inputs elsewhere: named, never launched
    with pytest.raises(InputError, match=f"'k' is a torch tensor on {wrong}; this Triton kernel runs on "
                                         f"{kernel.device}"):
        kernel(q, k.to(wrong), v, return_lse=True)


@pytest.mark.parametrize("head_dim", ["64", "256", "192 / 128"])
def test_head_dims_64_256_and_unequal(head_dim):
    from attnc.compiler.lower import compile_spec
    program = compile_spec(f"attention hd {{ heads = 4 / 2 head_dim = {head_dim} dtype = bf16 mask = causal }}")
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 1, 7, 20, seed=5)
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True)
    ref_o, ref_lse = oracle.reference(program, arrays["q"], arrays["k"], arrays["v"])
    assert all(c.ok for c in numerics.compare_outputs("bf16", o, lse, ref_o, ref_lse))
