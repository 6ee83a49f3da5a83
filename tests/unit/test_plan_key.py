"""Plans are frozen with their plan key (M4.5 §0x07F): a static change is refused by name,
declared dynamic fields change only through ``plan.update``."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnc.compiler import inputs
from attnc.compiler.dispatch import PlanKey
from attnc.compiler.errors import PlanError
from attnc.compiler.lower import compile_spec
from attnc.compiler.plan import plan

SPEC = "attention t {{ heads = 4 / 2 head_dim = {d} dtype = f32 mask = causal }}"
DOC = "attention t { heads = 2 head_dim = 16 dtype = f32 tensor doc: i32[b, s] ~ segments(3, 9) " \
      "mask = causal & doc[b, q] == doc[b, k] }"


def test_plan_is_frozen_with_its_key():
    p = compile_spec(SPEC.format(d=32))
    pl = plan(p, 2, 16, 16)
    assert pl.key == PlanKey.of(p) and pl.key.device is None and len(pl.key.digest) == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        pl.s_k = 32  # type: ignore[misc]
    assert plan(p, 1, 8, 64).key == pl.key  # lengths are not in the static projection


def test_changed_static_field_is_named():
    p32, p64 = compile_spec(SPEC.format(d=32)), compile_spec(SPEC.format(d=64))
    pl = plan(p32, 1, 16, 16)
    with pytest.raises(PlanError, match="plan was made for d_qk = 32, the run has d_qk = 64 .also d_v."):
        pl.check_call(p64, 1, 16, 16)
    bound = plan(p32, 1, 16, 16, device="cuda:0", graph_mode=True)
    bound.check_call(p32, 1, 16, 16, device="cuda:0")
    with pytest.raises(PlanError, match="device = 'cuda:0', the run has device = 'cuda:1'"):
        bound.check_call(p32, 1, 16, 16, device="cuda:1")
    with pytest.raises(PlanError, match="graph_mode = True, the run has graph_mode = False"):
        bound.check_call(p32, 1, 16, 16, device="cuda:0", graph_mode=False)
    with pytest.raises(PlanError, match="workspace_device"):
        bound.check_key(bound.key.replace(workspace_device="cuda:1"))
    plan(p32, 1, 16, 16).check_call(p32, 1, 16, 16, device="cuda:1")  # a host-only plan serves any device


def test_dynamic_fields_change_through_update_only():
    p = compile_spec(SPEC.format(d=32))
    pl = plan(p, 1, 16, 16, block_m=8, block_n=8)
    with pytest.raises(PlanError, match=r"S_k = 16, the call has S_k = 32 .*plan.update\(s_k=...\)"):
        pl.check_call(p, 1, 16, 32)
    up = pl.update(s_k=32)
    up.check_call(p, 1, 16, 32)
    assert (up.block_m, up.block_n, up.key) == (8, 8, pl.key) and pl.s_k == 16
    with pytest.raises(PlanError, match="d_qk is static"):
        pl.update(d_qk=64)
    with pytest.raises(PlanError, match="block_n is static"):
        pl.update(block_n=16)
    with pytest.raises(PlanError, match="not a field of the plan"):
        pl.update(colour=1)


def test_update_of_a_tensor_mask_needs_the_new_values_and_runs():
    from attnc.compiler import oracle
    from attnc.compiler.dispatch import backend
    p = compile_spec(DOC)
    arrays = inputs.sample(p, 2, 12, 12, seed=1)
    pl = plan(p, 2, 12, 12, {"doc": arrays["doc"].astype(np.int64)}, 8, 8)
    longer = inputs.sample(p, 2, 12, 20, seed=2)
    with pytest.raises(PlanError, match="the mask reads doc"):
        pl.update(s_k=20)
    up = pl.update(s_k=20, tensors={"doc": longer["doc"].astype(np.int64)})
    kernel = backend("numpy").load(p)
    o = kernel(longer["q"], longer["k"], longer["v"], plan=up, doc=longer["doc"])
    ref, _ = oracle.reference(p, longer["q"], longer["k"], longer["v"], {"doc": longer["doc"].astype(np.int64)})
    np.testing.assert_allclose(o, ref, atol=2e-5, rtol=2e-5)
