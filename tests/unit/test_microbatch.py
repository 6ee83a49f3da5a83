"""The frozen microbatch manifest (M4.5 §0x08F, §0x08H): entries, identity, immutability, and a
plan made for one manifest refused for another, through ``attn.plan_append`` / ``attn.append``
and ``attnc plan --json``."""
import json
import subprocess
import sys

import numpy as np
import pytest

import attnc
from attnc.compiler.errors import PlanError
from tests.conftest import ROOT, seed_contracts

MIXED = seed_contracts()["phase"]["mixed_batch"]


def freeze(ids=("p", "a", "d"), rows=(2, 0, 5)):
    T, C = zip(*MIXED["requests"])
    return attnc.MicrobatchManifest.freeze(list(ids), list(rows), T, C)


def test_entries_follow_the_fixture():
    m = freeze()
    assert m.qo_indptr.tolist() == MIXED["qo_indptr"]
    assert [e.phase for e in m.entries] == ["prefill", "append", "decode"]
    assert [e.q_rows for e in m.entries] == [(0, 4), (4, 6), (6, 7)]
    assert [e.out_rows for e in m.entries] == [e.q_rows for e in m.entries]
    assert m.post_length.tolist() == [4, 8, 10]
    assert m.to_json()["rows_appended"] == MIXED["rows_appended"]
    assert m.lengths.padded_envelope == MIXED["padded_envelope"]
    assert m.cache_rows.tolist() == [2, 0, 5] and m.index("d") == 2
    with pytest.raises(ValueError):
        m.cache_rows[0] = 1  # read-only
    with pytest.raises(AttributeError):
        m.entries[0].T = 3  # frozen


@pytest.mark.parametrize("ids,rows,match", [
    (("p", "a", "p"), (2, 0, 5), r"request_ids\[2\] = 'p' duplicates request_ids\[0\]"),
    (("p", "a", "d"), (2, 0, 2), r"cache_rows\[2\] = 2 duplicates cache_rows\[0\]"),
    (("p", "a", 1.5), (2, 0, 5), "request id is an integer or a string"),
    (("p", "a"), (2, 0, 5), "request_ids has 2 entries"),
    (("p", "a", "d"), (2, -1, 5), r"cache_rows\[1\] = -1 is negative"),
])
def test_freeze_refuses_broken_identities(ids, rows, match):
    with pytest.raises(PlanError, match=match):
        freeze(ids, rows)


def test_any_change_is_a_new_manifest():
    m = freeze()
    assert freeze() == m and freeze().digest == m.digest
    T, C = zip(*MIXED["requests"])
    changes = {
        "new token": attnc.MicrobatchManifest.freeze(["p", "a", "d"], [2, 0, 5], T, [4, 2, 2]),
        "reordered": attnc.MicrobatchManifest.freeze(["a", "p", "d"], [0, 2, 5], [T[1], T[0], T[2]],
                                                     [C[1], C[0], C[2]]),
        "other cache row": freeze(rows=(2, 1, 5)),
        "another id": freeze(ids=("p", "a", "x")),
    }
    for name, other in changes.items():
        assert other.digest != m.digest, name
        with pytest.raises(PlanError, match=f"made for manifest {m.digest[:12]}"):
            m.check_same(other)


def test_scatter_gives_each_request_its_rows():
    m = freeze()
    out = np.arange(7)[:, None] * np.ones((1, 3))
    rows = m.scatter(out)
    assert {k: v[:, 0].tolist() for k, v in rows.items()} == {"p": [0, 1, 2, 3], "a": [4, 5], "d": [6]}
    with pytest.raises(PlanError, match="the output has 6 packed rows"):
        m.scatter(out[:6])


# ---------------------------------------------------------------- through the API
torch = pytest.importorskip("torch")


def _cache():
    """A contiguous cache of 6 rows; requests p, a, d live in rows 2, 0, 5 with T = 0, 6, 9."""
    k = torch.zeros(6, 12, 2, 8)
    return {"k": k, "v": k.clone(), "kv_lens": torch.tensor([0, 6, 9]), "cache_batch_idx": torch.tensor([2, 0, 5])}


def test_a_plan_for_another_manifest_is_refused():
    attn = attnc.compile("attention m { heads = 2 head_dim = 8 dtype = f32 mask = causal "
                         "cache = contiguous(layout = bshd) }")
    q, kn = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    m = freeze()
    plan = attn.plan_append(q, kn, kn, manifest=m, **_cache())
    assert plan.manifest is m
    cache = _cache()
    o = attn.append(q, kn, kn, manifest=m, plan=plan, **cache)
    assert cache["kv_lens"].tolist() == [4, 8, 10]
    assert sorted(m.scatter(o)) == ["a", "d", "p"]
    # the next step: every request decodes one token -- a new manifest; the old plan is refused
    nxt = attnc.MicrobatchManifest.freeze(["p", "a", "d"], [2, 0, 5], [4, 8, 10], [1, 1, 1])
    q1 = torch.randn(3, 2, 8)
    before = cache["k"].clone()
    with pytest.raises(PlanError, match=f"made for manifest {m.digest[:12]} .* new manifest"):
        attn.append(q1, q1, q1, manifest=nxt, plan=plan, **cache)
    assert torch.equal(before, cache["k"]) and cache["kv_lens"].tolist() == [4, 8, 10]
    # the old manifest again, after its commit: its T no longer matches the cache
    with pytest.raises(PlanError, match=r"is stale: request 'p' .* T = 0, the call has kv_lens\[0\] = 4"):
        attn.append(q, kn, kn, manifest=m, **cache)
    o1 = attn.append(q1, q1, q1, manifest=nxt, **cache)
    assert o1.shape == (3, 2, 8) and cache["kv_lens"].tolist() == [5, 9, 11]


def test_plan_json_has_the_manifest():
    out = subprocess.run([sys.executable, "-m", "attnc", "plan", str(ROOT / "examples" / "causal.attn"),
                          "--kv-lens", "4,8,10", "--q-lens", "4,2,1", "--request-ids", "p,a,7",
                          "--cache-rows", "2,0,5", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["manifest"]
    m = attnc.MicrobatchManifest.freeze(["p", "a", 7], [2, 0, 5], [0, 6, 9], [4, 2, 1])
    assert got == m.to_json()
    assert got["requests"][2] == {"request_id": 7, "cache_row": 5, "T": 9, "C": 1, "phase": "decode",
                                  "q_rows": [6, 7], "out_rows": [6, 7], "post_length": 10}
