"""Every example × {prefill, append, decode} × {MHA, GQA} on the numpy program vs the oracle."""
from dataclasses import replace

import numpy as np
import pytest

from attnc.compiler import oracle
from attnc.backends.numpy import runtime
from attnc.compiler import inputs, numerics
from attnc.compiler.lower import compile_file
from tests.conftest import EXAMPLES

PHASES = {"prefill": (80, 80), "append": (19, 80), "decode": (1, 80)}
HEADS = {"mha": (4, 4), "gqa": (8, 2)}


@pytest.fixture(scope="module", params=EXAMPLES, ids=lambda p: p.stem)
def example(request):
    return compile_file(request.param)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("phase", PHASES)
def test_example_matches_oracle(example, phase, heads):
    program = replace(example, heads_q=HEADS[heads][0], heads_kv=HEADS[heads][1])
    program = inputs.contiguous_variant(program)  # paged/ragged reads: see the layout planner tests
    s_q, s_k = PHASES[phase]
    arrays = inputs.sample(program, 2, s_q, s_k, seed=hash((phase, heads)) % 1000)
    call = inputs.validate(program, arrays)
    # 16 x 32 tiles over 80 keys: ragged last tiles in both directions
    kernel = runtime.load(program, block_m=16, block_n=32)
    o, lse = kernel(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                    **{t.name: arrays[t.name] for t in program.tensors})
    ref_o, ref_lse = oracle.reference(program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(program.dtype, inputs.output_bhsd(program, o), lse, ref_o, ref_lse)
    assert co.ok, str(co)
    assert cl.ok, str(cl)
    assert np.isfinite(o).all()
    # the all-masked policy: rows with no visible key are exactly zero with LSE = -inf
    empty = ~oracle.dense_mask(program, call.batch, s_q, s_k, call.tensors).any(-1)
    assert (np.isneginf(lse) == empty).all()
    assert (inputs.output_bhsd(program, o)[empty] == 0).all()
