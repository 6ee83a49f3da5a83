"""The Triton split launch's one decision (``backends/triton/split_choice.py``) given device facts,
without a GPU: on a simulated sm_90 device an append whose rows fill the Gluon engine's tiles runs
on the engine (one slot, no workspace), and ``attnc plan`` made for that device reports exactly the
plan the launch (``decode.decode_plan``) makes there and the workspace it allocates."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from attnc.backends.triton import decode as D
from attnc.backends.triton import split_choice as SC
from attnc.compiler import cli, inputs
from attnc.compiler.errors import InputError
from attnc.compiler.launch_plan import plan_launch
from attnc.compiler.lower import compile_spec
from attnc.compiler.plan import logical_layout

SPEC = ("attention engine_case { heads = 4 / 2 head_dim = 64 dtype = bf16 mask = causal "
        "cache = paged(page_size = 16, layout = nhd) }")
KV, FILLS, SHORT = [400, 200], [300, 100], [3, 1]  # 400 of 512 rows fill the engine's tiles; 4 do not
SM90 = replace(SC.device_facts("sm_90"), here=True, assumed=())  # an H200 as its launch reads it


class _Bf16:
    itemsize = 2

    def __str__(self):
        return "torch.bfloat16"


class FakeCuda:
    """What the launch decision and decode_plan read of a contiguous bf16 CUDA tensor."""

    is_cuda = True
    device = SimpleNamespace(type="cuda", index=0)
    dtype = _Bf16()

    def __init__(self, shape):
        self.shape = tuple(shape)

    def stride(self):
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return 0


def _launch_plan(p, q_lens, monkeypatch):
    """decode_plan on the simulated sm_90 device (its facts and its tensors)."""
    monkeypatch.setattr(D.device, "facts", lambda device=None: SM90)
    arrays = inputs.sample_cache(p, KV, q_lens, seed=0)
    q = arrays.pop("q")
    for n in ("k_cache", "v_cache"):
        arrays[n] = FakeCuda(arrays[n].shape)
    return D.decode_plan(p, arrays, total_q=int(q.shape[0]))


def test_the_engine_decision_reads_the_facts_it_is_given():
    p = compile_spec(SPEC)
    kv, fills = np.array(KV, np.int64), np.array(FILLS, np.int64)
    on90 = SC.choose(p, kv, fills, SM90, one_row=False, tuned={})
    assert (on90.engine, on90.slots, on90.decided_by, on90.workspace_bytes(p, sum(FILLS))) == ("gluon", 1, "engine", 0)
    assert (on90.block_q, on90.block_n) == SC.GLUON_TILES and on90.assumed == ("cache",)
    for facts, why in ((replace(SM90, capability=80), "needs an sm_90 GPU"), (replace(SM90, gluon=False), "no Gluon"),
                       (replace(SM90, interpreter=True), "interpreter")):
        assert why in SC.engine_refusal(p, facts)
        other = SC.choose(p, kv, fills, facts, one_row=False, tuned={})
        assert other.engine == "split" and other.slots > 1 and other.workspace_bytes(p, sum(FILLS)) > 0
    short = SC.choose(p, kv, np.array(SHORT, np.int64), SM90, one_row=False, tuned={})
    assert short.engine == "split" and short.decided_by == "auto"  # 4 rows of 256 do not fill the tiles
    tuned = SC.choose(p, kv, fills, SM90, one_row=False, tuned={"splits": 3, "BLOCK_N": 32})
    assert (tuned.engine, tuned.slots, tuned.block_n, tuned.decided_by) == ("split", 3, 32, "tuned")
    with pytest.raises(ValueError, match="engine='gluon': the Gluon engine needs an sm_90 GPU"):
        SC.choose(p, kv, fills, replace(SM90, capability=100), one_row=False, tuned={}, asked={"engine": "gluon"})


@pytest.mark.parametrize("q_lens, engine", [(FILLS, "gluon"), (SHORT, "split")])
def test_plan_for_sm90_reports_the_launch_there(monkeypatch, q_lens, engine):
    """The Gluon-engine case allocates no workspace and `attnc plan --device sm_90` says so; the
    split producer's allocates what the plan reports: the same decision, given the same facts."""
    p = compile_spec(SPEC)
    launch = _launch_plan(p, q_lens, monkeypatch)
    report = plan_launch(p, logical_layout(p, KV), q_lens, device="sm_90").report()
    assert launch["engine"] == report["launch"]["engine"] == engine
    allocated = SC.launch_workspace_bytes(p, launch["engine"], launch["total_q"], launch["splits"])
    assert (launch["splits"], allocated) == (report["capacity"], report["workspace_bytes"]["allocated"])
    assert (allocated == 0) == (engine == "gluon")
    assert report["launch"]["device"] == {**SM90.to_json(), "here": False, "assumed": ["capability", "num_sms", "gluon"]}
    assert report["launch"]["assumed"] == ["capability", "num_sms", "gluon", "cache"]
    assert report["launch"]["tuning_cache"].startswith("not read (an assumed device")


def test_attnc_plan_says_which_device_facts_it_assumed(tmp_path, capsys):
    spec = tmp_path / "engine_case.attn"
    spec.write_text(SPEC + "\n")
    args = ["plan", str(spec), "--kv-lens", "400,200", "--q-lens", "300,100", "--device", "sm_90"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "launch (triton): the Gluon engine over the cache, unsplit, 128 x 128 tiles, no workspace" in text
    assert "device sm_90, 132 SMs, Gluon; assumed: capability, num_sms, gluon, cache (no device read" in text
    assert cli.main([*args[:-1], "sm_80", "--sms", "108", "--json"]) == 0
    launch = __import__("json").loads(capsys.readouterr().out)["launch"]
    assert launch["engine"] == "split" and launch["device"]["num_sms"] == 108
    assert launch["assumed"] == ["capability", "gluon", "cache"]
    with pytest.raises(InputError, match="expected 'here' or a compute capability"):
        SC.device_facts("hopper")


def test_numpy_inputs_read_the_current_devices_facts(monkeypatch):
    """A split call on numpy arrays asks for the facts of ``array.device``: numpy's is the string
    "cpu", whose ``index`` is ``str.index`` (a method, not a device index).  On a GPU machine every
    Triton call on numpy inputs raised TypeError from torch.device (the GPU test list's most common
    failure); numpy inputs mean the current device, as None does."""
    from attnc.backends.triton import device
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(device, "_FACTS", {})
    assert device.facts(np.zeros(2).device) == device.facts(None)
    assert device.facts("cuda") == device.facts(None)
