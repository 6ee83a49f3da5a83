"""Split calls replayed from a CUDA graph (``Kernel.decode_graph``, graph_mode): a serving loop
of decode steps (new lengths, new query rows, a moved page table, new document ids) over one
captured launch must give exactly what the eager call gives with the same plan, and, under the
interpreter, the float64 oracle's answer.  On the CPU interpreter the graph runs its launch
without capture (CUDA graphs need a GPU); with ATTNC_TEST_GPU=1 the same tests capture and
replay a real graph.  What the captured launch cannot run is refused with the array and value."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton backend's tests need torch (pip install -e '.[test]')")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (pip install -e '.[test]')")

from attnc.compiler import oracle  # noqa: E402
from attnc.backends.triton import runtime  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.errors import InputError, PlanError  # noqa: E402
from attnc.compiler.lower import compile_spec  # noqa: E402

B, T, PAGE, D = 4, 48, 8, 16
HQ, HKV = 8, 2


def _spec(mask="causal", cache=f"paged(page_size = {PAGE})", decl="", state="lse_o"):
    return compile_spec(f"attention g {{ heads = {HQ} / {HKV} head_dim = {D} dtype = f32 {decl} mask = {mask} "
                        f"cache = {cache} state = {state} }}")


def _kernel(program):
    kernel = runtime.load(program)
    return kernel, kernel.device


def _pool(k, v, dev, seed=0):
    """Every request's T tokens stored twice in one page pool: table A and table B name different
    pages holding the same keys (a page table the scheduler moved)."""
    per = T // PAGE
    rng = np.random.default_rng(seed)
    ids = rng.permutation(2 * B * per + 3)
    pool_k = np.full((len(ids), PAGE, HKV, D), np.nan, np.float32)
    pool_v = pool_k.copy()
    tables = np.zeros((2, B, per), np.int32)
    c = 0
    for copy in range(2):
        for b in range(B):
            for j in range(per):
                tables[copy, b, j] = ids[c]
                pool_k[ids[c]] = k[b, :, j * PAGE:(j + 1) * PAGE].transpose(1, 0, 2)
                pool_v[ids[c]] = v[b, :, j * PAGE:(j + 1) * PAGE].transpose(1, 0, 2)
                c += 1
    t = lambda a: torch.as_tensor(a).to(dev)  # noqa: E731
    return t(pool_k), t(pool_v), tables


def _oracle_check(program, arrays, q, lens, o, lse, tensors=()):
    """Under the interpreter: row b against the oracle over the request's first lens[b] keys."""
    if not runtime.interpreted():
        return
    decl, mask = (_DECL, _MASK) if tensors else ("", "causal")
    cont = compile_spec(f"attention g {{ heads = {HQ} / {HKV} head_dim = {D} dtype = f32 {decl} mask = {mask} }}")
    o, lse = o.cpu().numpy(), lse.cpu().numpy()
    for b, n in enumerate(lens):
        if n == 0:
            continue
        call = inputs.validate(cont, {"q": q[b:b + 1, :, None], "k": arrays["k"][b:b + 1, :, :n],
                                      "v": arrays["v"][b:b + 1, :, :n],
                                      **{name: arrays[name][b:b + 1, :n] for name in tensors}})
        ref_o, ref_lse = oracle.reference(cont, call.q, call.k, call.v, call.tensors)
        co, cl = numerics.compare_outputs(program.dtype, o[b:b + 1, :, None], lse[b:b + 1, :, None], ref_o, ref_lse)
        assert co.ok and cl.ok, (b, str(co), str(cl))


_DECL = "tensor doc: i32[b, s] ~ segments(4, 20)"
_MASK = "causal & doc[b, q] == doc[b, k]"


def _sample(seed):
    cont = compile_spec(f"attention g {{ heads = {HQ} / {HKV} head_dim = {D} dtype = f32 mask = causal }}")
    return inputs.sample(cont, B, 1, T, seed=seed)


@pytest.mark.parametrize("state", ["lse_o", "mlu"])
def test_decode_steps_replay_what_the_eager_call_computes(state):
    program = _spec(state=state)
    kernel, dev = _kernel(program)
    arrays = _sample(0)
    k_cache, v_cache, tables = _pool(arrays["k"], arrays["v"], dev)
    lens = np.array([20, 9, 1, 33])
    rng = np.random.default_rng(5)
    q0 = torch.as_tensor(rng.standard_normal((B, HQ, D)).astype(np.float32)).to(dev)
    table = torch.as_tensor(tables[0]).to(dev)
    g = kernel.decode_graph(q0, k_cache=k_cache, v_cache=v_cache, block_table=table,
                            kv_lens=torch.as_tensor(lens).to(dev), max_kv_len=T, block_n=16, splits=3)
    assert g.capacity["blocks"] == B * (T // 16) and (g.graph is not None) == (dev == "cuda")
    for step in range(4):
        if step:
            lens = np.minimum(lens + [1, 7, 0, 5], T)  # requests grow (request 2 idles)
            g.update(kv_lens=lens, **({"block_table": tables[step % 2]} if step >= 2 else {}))
        q = torch.as_tensor(rng.standard_normal((B, HQ, D)).astype(np.float32)).to(dev)
        o, lse = g(q)
        eo, el = kernel.decode(q, k_cache=k_cache, v_cache=v_cache, block_table=torch.as_tensor(
            tables[step % 2 if step >= 2 else 0]).to(dev), kv_lens=lens, block_n=16, splits=3, return_lse=True)
        assert torch.equal(o, eo) and torch.equal(lse, el), step
        _oracle_check(program, arrays, q.cpu().numpy(), lens, o, lse)


def test_csr_table_capacity_and_refusals():
    program = _spec(cache=f"paged(page_size = {PAGE}, table = csr)")
    kernel, dev = _kernel(program)
    arrays = _sample(1)
    k_cache, v_cache, tables = _pool(arrays["k"], arrays["v"], dev, seed=2)

    def csr(lens, table):
        pages = -(-lens // PAGE)
        return {"kv_indptr": np.r_[0, np.cumsum(pages)],
                "kv_indices": np.concatenate([table[b, :pages[b]] for b in range(B)]),
                "kv_last_page_len": lens - (pages - 1) * PAGE}

    lens = np.array([5, 17, 24, 8])
    q = torch.as_tensor(np.random.default_rng(0).standard_normal((B, HQ, D)).astype(np.float32)).to(dev)
    g = kernel.decode_graph(q, k_cache=k_cache, v_cache=v_cache, max_kv_len=32, block_n=16, splits=2,
                            **csr(lens, tables[0]))
    assert g.capacity["table"] == B * 4
    lens = np.array([32, 1, 30, 16])
    g.update(**csr(lens, tables[1]))
    o, lse = g(q)
    eo, el = kernel.decode(q, k_cache=k_cache, v_cache=v_cache, block_n=16, splits=2, return_lse=True,
                             **csr(lens, tables[1]))
    assert torch.equal(o, eo) and torch.equal(lse, el)
    _oracle_check(program, arrays, q.cpu().numpy(), lens, o, lse)
    g.update(**csr(np.array([32, 40, 1, 1]), tables[0]))  # capacity is a total: one request may outgrow 32
    g.update(**csr(lens, tables[1]))
    with pytest.raises(PlanError, match=r"'blocks' needs 10 block-list entries; the graph holds 8 "
                                        r"\(max_kv_len = 32 keys per request at capture\); the longest request "
                                        r"now: kv_lens\[0\] = 48"):
        g.update(**csr(np.array([48, 48, 48, 8]), tables[0]))  # refused: the graph keeps the last plan
    other = k_cache.clone()
    with pytest.raises(InputError, match="'k_cache' is not the tensor the graph captured"):
        g.update(k_cache=other, **csr(lens, tables[0]))
    with pytest.raises(InputError, match=r"'q' is \[3, 8, 16\]"):
        g(q[:3])
    o2, _ = g(q)
    assert torch.equal(o2, eo)


def test_document_ids_and_mixed_rows_update():
    """A declared mask tensor is the graph's copy (updates rewrite it, and the blocks it skips);
    an append batch (several query rows per request) keeps its tiles across steps."""
    program = _spec(mask=_MASK, decl=_DECL, state="mlu")
    kernel, dev = _kernel(program)
    cont = compile_spec(f"attention g {{ heads = {HQ} / {HKV} head_dim = {D} dtype = f32 {_DECL} mask = {_MASK} }}")
    arrays = inputs.sample(cont, B, 1, T, seed=3)
    k_cache, v_cache, tables = _pool(arrays["k"], arrays["v"], dev, seed=4)
    table = torch.as_tensor(tables[0]).to(dev)
    lens = np.array([40, 12, 30, 48])
    rng = np.random.default_rng(7)
    q = torch.as_tensor(rng.standard_normal((B, HQ, D)).astype(np.float32)).to(dev)
    doc = arrays["doc"].copy()
    g = kernel.decode_graph(q, k_cache=k_cache, v_cache=v_cache, block_table=table, kv_lens=lens, doc=doc,
                            block_n=16, splits=2)
    doc2 = doc.copy()
    doc2[:, 24:] += 100  # a new document starts at 24 in every request
    g.update(doc=doc2)
    o, lse = g(q)
    eo, el = kernel.decode(q, k_cache=k_cache, v_cache=v_cache, block_table=table, kv_lens=lens, doc=doc2,
                             block_n=16, splits=2, return_lse=True)
    assert torch.equal(o, eo) and torch.equal(lse, el)
    _oracle_check(program, {**arrays, "doc": doc2}, q.cpu().numpy(), lens, o, lse, tensors=("doc",))
    with pytest.raises(InputError, match=r"tensor 'doc' has shape \[4, 56\]; the graph holds \[4, 48\]"):
        g.update(doc=np.pad(doc, ((0, 0), (0, 8))))  # the launch baked in the tensor's shape and strides
    with pytest.raises(PlanError, match=r"tensor 'doc' read out of range: axis 1 index 47 is outside \[0, 40\)"):
        g.update(doc=doc[:, :40])

    append = _spec()
    kernel, dev = _kernel(append)
    q_lens = np.array([3, 1, 2, 4])
    qa = torch.as_tensor(rng.standard_normal((int(q_lens.sum()), HQ, D)).astype(np.float32)).to(dev)
    ga = kernel.decode_graph(qa, k_cache=k_cache, v_cache=v_cache, block_table=table, kv_lens=lens,
                             q_lens=q_lens, block_n=16, splits=2, block_q=2)
    lens = lens - 4
    ga.update(kv_lens=lens)
    o, lse = ga(qa)
    eo, el = kernel.decode(qa, k_cache=k_cache, v_cache=v_cache, block_table=table, kv_lens=lens, q_lens=q_lens,
                             block_n=16, splits=2, block_q=2, return_lse=True)
    assert torch.equal(o, eo) and torch.equal(lse, el)
    with pytest.raises(PlanError, match="the plan has tiles = 7; the graph was captured with tiles = 6"):
        ga.update(kv_lens=lens, q_lens=np.array([1, 1, 1, 7]))


def test_capture_needs_a_cuda_device():
    """Host tensors cannot be captured, on any machine (the GPU run captures in the tests above)."""
    program = _spec()
    kernel, _ = _kernel(program)
    arrays = _sample(0)
    k_cache, v_cache, tables = _pool(arrays["k"], arrays["v"], "cpu")
    q = torch.zeros(B, HQ, D)
    with pytest.raises(InputError, match="a CUDA graph needs a CUDA device and no TRITON_INTERPRET"):
        kernel.decode_graph(q, k_cache=k_cache, v_cache=v_cache, block_table=tables[0], kv_lens=[1] * B,
                            capture=True)
    with pytest.raises(InputError, match="'q' is torch.float16; spec 'g' stores f32"):
        kernel.decode_graph(q.half(), k_cache=k_cache, v_cache=v_cache, block_table=tables[0], kv_lens=[1] * B)
