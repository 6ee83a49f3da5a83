"""The gpt-oss sink layer bench (bench/sinks.py) on the CPU, tiny shapes: its float32 dense reference
(the sink as one more logit column) and transformers' LSE renormalisation agree with attnc's numpy
backend in float64, its visible-cell count with the mask, and its summary's verdicts on synthetic
rows.  No GPU: the lead runs ``python3 -m bench.sinks`` on the H200."""
import pytest

torch = pytest.importorskip("torch", reason="the bench takes torch tensors (pip install -e '.[test]')")

import attnc  # noqa: E402
from attnc.bench import sinks as S  # noqa: E402


@pytest.mark.parametrize("window", [3, None])
def test_the_reference_and_the_renormalisation_are_attncs_sink(window):
    mask = f"causal & window({window})" if window else "causal"
    attn = attnc.compile("attention g { heads = 4 / 2 head_dim = 8 dtype = f32 tensor sinks: f32[h] "
                         f"mask = {mask} sink = sinks[h] }}")
    plain = attnc.compile(f"attention p {{ heads = 4 / 2 head_dim = 8 dtype = f32 mask = {mask} }}")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    do = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64)
    o = attn(q, k, v, sinks=sinks)
    dq, dk, dv, ds = torch.autograd.grad(o, (q, k, v, sinks), do)
    ref = S.reference(q.detach(), k.detach(), v.detach(), sinks.detach(), do, window, group=2)
    assert set(ref["o"]) == {(0, 0), (1, 1)} and set(ref["dk"]) == {(0, 0), (1, 0)}
    for (b, h), r in ref["o"].items():
        assert S.rel(o[b, h].detach(), r) < 1e-6 and S.rel(dq[b, h], ref["dq"][(b, h)]) < 1e-6
    for b in (0, 1):  # K/V head 0: the sum over its query heads 0 and 1
        assert S.rel(dk[b, 0], ref["dk"][(b, 0)]) < 1e-6 and S.rel(dv[b, 0], ref["dv"][(b, 0)]) < 1e-6
    assert S.rel(ds[:2], ref["dsinks"]) < 1e-6
    assert S.check_backward(ref, 2)((dq, dk, dv, ds)) < 1e-6
    # transformers' way: the sinkless call's O and LSE (float32), renormalised in O's dtype (float64)
    o0, lse0 = plain(q.detach(), k.detach(), v.detach(), return_lse=True)
    assert S.rel(S.renormalised(o0, lse0, sinks.detach()), o.detach()) < 1e-6


def test_visible_cells_count_the_mask():
    for seq, window in ((10, 3), (10, None), (5, 8), (300, 128)):
        assert S.visible_cells(seq, window) == int(S.visible(seq, window, "cpu").sum())


def test_the_summary_checks_the_issues_targets():
    rows = [{"bench": "sinks", "layer": "causal", "B": 1, "phase": "fwd", "impl": i, "pass": True, "median_ms": ms}
            for i, ms in (("attnc_call", 1.0), ("flex_renorm", 1.5), ("flex_renorm_compiled", 1.4), ("fa4", 0.9))]
    rows.append({"bench": "sinks", "layer": "causal", "B": 1, "phase": "bwd", "impl": "attnc_call", "pass": True,
                 "median_ms": 2.0})
    rows.append({"bench": "sinks", "layer": "causal", "B": 1, "phase": "bwd", "impl": "flex_renorm", "pass": False})
    fwd, bwd = S.sinks_summary(rows)
    assert "flex 1.40x (target 1.3x: met)" in fwd and "fa4 0.90x (target 1.0x: NOT met)" in fwd
    assert "flex: no row" in bwd and "fa4: no row" in bwd
