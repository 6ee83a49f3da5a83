"""The AHBM mesh simulator (backends/ahbm/sim) with hand-written tl kernels (ADR-0060)."""
import contextlib
import math
from collections import defaultdict

import numpy as np
import pytest

from tests.conftest import seed_contracts

pytest.importorskip("greenlet", reason="greenlet (a project dependency) is not installed")

from attnc.backends.ahbm.sim import (  # noqa: E402
    DeadlockError, LatencyModel, Machine, MeshConfig, PerPE, ScratchOverflowError,
    ScratchUseAfterFreeError, ShapeError, TopologyError, tree_children, tree_levels, tree_parent,
    tree_placement, tree_root,
)

FIXTURE = seed_contracts()["ahbm_adr0060"]


def softmax_rows(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_ref(q, k, v, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    return softmax_rows(q @ k.T * scale) @ v


# ---- kernels --------------------------------------------------------------------------------
def gemm_softmax_kernel(at_ptr, b_ptr, c_ptr, M, K, N, TK, mask_cols, *, tl):
    """C = softmax_rows(mask(A @ B)); A is stored transposed ([K, M]) so a K-slab is contiguous."""
    acc = tl.zeros((M, N))
    for kk in range(0, K, TK):
        with tl.scratch_scope():
            a = tl.trans(tl.load(at_ptr + kk * M, (TK, M)))  # [M, TK]
            b = tl.load(b_ptr + kk * N, (TK, N))
            tl.assign(acc, acc + tl.dot(a, b))
    cols = tl.arange(N)[None, :]  # [1, N]
    x = tl.where(cols < mask_cols, acc, -np.inf)  # only the first mask_cols columns are visible
    m = tl.max(x, axis=-1, keepdims=True)
    p = tl.exp(x - m)
    tl.store(c_ptr, p / tl.sum(p, axis=-1, keepdims=True))


def flash_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, n_tiles, TILE, G, d, scale, *, tl,
                        prefetch=False, scoped=True):
    """ADR-0060 §3: one PE sweeps its K/V tiles with the online softmax. With `prefetch`, the
    next tile's K/V are load_async'ed into ping-pong buffers (persistent, outside the scope)."""
    q = tl.load(q_ptr, (G, d))
    m, l, o = tl.full((G, 1), -np.inf), tl.zeros((G, 1)), tl.zeros((G, d))
    if prefetch:
        kbuf = [tl.empty((TILE, d), np.float16) for _ in range(2)]
        vbuf = [tl.empty((TILE, d), np.float16) for _ in range(2)]
        f_k = {0: tl.load_async(k_ptr, (TILE, d), out=kbuf[0])}
        f_v = {0: tl.load_async(v_ptr, (TILE, d), out=vbuf[0])}
    for j in range(n_tiles):
        with tl.scratch_scope() if scoped else contextlib.nullcontext():
            if prefetch:
                kj = tl.wait(f_k[j])
                if j + 1 < n_tiles:  # keep the pipeline full
                    nxt = (j + 1) * TILE * d
                    f_k[j + 1] = tl.load_async(k_ptr + nxt, (TILE, d), out=kbuf[(j + 1) % 2])
                    f_v[j + 1] = tl.load_async(v_ptr + nxt, (TILE, d), out=vbuf[(j + 1) % 2])
            else:
                kj = tl.load(k_ptr + j * TILE * d, (TILE, d))
            s = tl.dot(q, tl.trans(kj)) * scale  # [G, TILE]
            m_new = tl.maximum(m, tl.max(s, axis=-1, keepdims=True))
            p = tl.exp(s - m_new)
            corr = tl.exp(m - m_new)
            tl.assign(l, l * corr + tl.sum(p, axis=-1, keepdims=True))
            vj = tl.wait(f_v[j]) if prefetch else tl.load(v_ptr + j * TILE * d, (TILE, d))
            tl.assign(o, o * corr + tl.dot(p, vj))
            tl.assign(m, m_new)
    tl.store(o_ptr, o / l)


def valid_len(counter, start_pe, pe_id, n):
    """seed_contracts ahbm_adr0060.valid_len (ADR-0060 §2.2)."""
    base, rem = counter // n, counter % n
    return base + (1 if (pe_id - start_pe) % n < rem else 0)


def merge(tl, m_a, l_a, o_a, m_b, l_b, o_b):
    """ADR-0060 §4 log-sum-exp merge."""
    m = tl.maximum(m_a, m_b)
    sa, sb = tl.exp(m_a - m), tl.exp(m_b - m)
    return m, l_a * sa + l_b * sb, o_a * sa + o_b * sb


def tree_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, counter, start_pe, G, d, scale, *, tl,
                       by_rank=False):
    """ADR-0060 §5.3: one-shot partial attention per PE, then the §4 tree to the root."""
    pe, n = tl.program_id(), tl.num_programs()
    my_len = valid_len(counter, start_pe, pe, n)
    q = tl.load(q_ptr, (G, d))
    k, v = tl.load(k_ptr, (my_len, d)), tl.load(v_ptr, (my_len, d))
    s = tl.dot(q, tl.trans(k)) * scale
    m = tl.max(s, axis=-1, keepdims=True)
    p = tl.exp(s - m)
    l, o = tl.sum(p, axis=-1, keepdims=True), tl.dot(p, v)
    for child in tree_children(pe, n):
        src = child if by_rank else tl.direction_to(child)
        m_c, l_c, o_c = tl.recv(src, m.shape), tl.recv(src, l.shape), tl.recv(src, o.shape)
        m, l, o = merge(tl, m, l, o, m_c, l_c, o_c)
    parent = tree_parent(pe, n)
    if parent is None:
        tl.store(o_ptr, o / l)
        return "root"
    dst = parent if by_rank else tl.direction_to(parent)
    for x in (m, l, o):
        tl.send(dst, x)


# ---- set-ups ---------------------------------------------------------------------------------
def setup_flash_decode(machine, n_tiles, TILE=64, G=8, d=128, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((G, d)).astype(np.float32)
    k = rng.standard_normal((n_tiles * TILE, d)).astype(np.float16)
    v = rng.standard_normal((n_tiles * TILE, d)).astype(np.float16)
    hbm = machine.hbm(0)
    ptrs = (hbm.alloc("Q", q), hbm.alloc("K", k), hbm.alloc("V", v),
            hbm.alloc("O", shape=(G, d), dtype=np.float32))
    args = (*ptrs, n_tiles, TILE, G, d, 1 / math.sqrt(d))
    return args, attention_ref(q, k, v, 1 / math.sqrt(d))


def setup_tree(machine, counter=37, start_pe=2, G=4, d=32, seed=1):
    """Round-robin KV placement (ADR-0060 §2.1): token i lives on PE (start_pe + i) mod N."""
    n = machine.size
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((G, d)).astype(np.float32)
    k = rng.standard_normal((counter, d)).astype(np.float32)
    v = rng.standard_normal((counter, d)).astype(np.float32)
    q_ptrs, k_ptrs, v_ptrs = [], [], []
    for pe in range(n):
        slots = range(valid_len(counter, start_pe, pe, n))
        idx = [slot * n + (pe - start_pe) % n for slot in slots]  # slot_to_global
        assert all((start_pe + i) % n == pe for i in idx)  # the placement formula
        hbm = machine.hbm(pe)
        q_ptrs.append(hbm.alloc("Q", q))
        k_ptrs.append(hbm.alloc("K", k[idx]))
        v_ptrs.append(hbm.alloc("V", v[idx]))
    root = tree_root(n)
    o_ptr = machine.hbm(root).alloc("O", shape=(G, d), dtype=np.float32)
    args = (PerPE(q_ptrs), PerPE(k_ptrs), PerPE(v_ptrs),
            PerPE(lambda r: o_ptr if r == root else None), counter, start_pe, G, d, 1 / math.sqrt(d))
    return args, attention_ref(q, k, v, 1 / math.sqrt(d))


def tree_machine(placement="tree", latency=None):
    p = tree_placement(8, 2, 4) if placement == "tree" else None
    return Machine(MeshConfig(rows=2, cols=4, placement=p), latency)


# ---- tests -----------------------------------------------------------------------------------
def test_single_pe_tiled_gemm_softmax_matches_numpy():
    M, K, N, TK, mask_cols = 16, 256, 48, 64, 40
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    machine = Machine()
    hbm = machine.hbm(0)
    at, bp = hbm.alloc("At", np.ascontiguousarray(a.T)), hbm.alloc("B", b)
    cp = hbm.alloc("C", shape=(M, N), dtype=np.float32)
    res = machine.run(gemm_softmax_kernel, at, bp, cp, M, K, N, TK, mask_cols)

    want = np.zeros((M, N))
    want[:, :mask_cols] = softmax_rows(a.astype(np.float64) @ b[:, :mask_cols])
    np.testing.assert_allclose(hbm.read("C"), want, rtol=1e-5, atol=1e-6)
    log = res.oplog
    assert log.gemm_count == K // TK
    assert log.dma_read_count == 2 * K // TK and log.dma_write_count == 1
    assert log.dma_reads_by_buffer() == {"At": K // TK, "B": K // TK}
    # byte conservation: what the log counts equals what HBM moved
    read, written = res.hbm_bytes[0]
    assert read == a.nbytes + b.nbytes and written == M * N * 4
    assert log.bytes_by_engine()["DMA"] == read + written
    # every op blocks, so one PE runs serially: latency = sum of engine busy time
    assert res.latency == pytest.approx(sum(log.busy_by_engine().values()))


def test_engine_costs_follow_the_latency_model():
    lat = LatencyModel()

    def kernel(x_ptr, *, tl):
        x = tl.load(x_ptr, (64, 128))  # float32: 32 KiB
        tl.dot(x[:8], tl.trans(x))  # [8,128] x [128,64]
        tl.exp(x)

    machine = Machine(latency=lat)
    res = machine.run(kernel, machine.hbm(0).alloc("X", shape=(64, 128)))
    load, dot, exp = res.oplog.records
    assert (load.engine, dot.engine, exp.engine) == ("DMA", "GEMM", "MATH")
    assert load.duration == lat.dma_latency_ns + 64 * 128 * 4 / lat.dma_bytes_per_ns
    assert dot.flops == 2 * 8 * 64 * 128
    assert dot.duration == lat.gemm_latency_ns + dot.flops / lat.gemm_flops_per_ns
    assert exp.flops == 64 * 128 * lat.math_transcendental_flops
    assert exp.duration == lat.math_latency_ns + exp.flops / lat.math_flops_per_ns
    assert (dot.start, exp.start) == (load.end, dot.end)


def test_load_async_prefetch_beats_serial_load_plus_compute():
    results = {}
    for prefetch in (False, True):
        machine = Machine()
        args, want = setup_flash_decode(machine, n_tiles=6)
        results[prefetch] = res = machine.run(flash_decode_kernel, *args, prefetch=prefetch)
        np.testing.assert_allclose(machine.hbm(0).read("O"), want, rtol=1e-4, atol=1e-5)
    serial, fetched = results[False], results[True]
    serial_sum = sum(fetched.oplog.busy_by_engine().values())  # Σ(load + compute)
    assert serial.latency == pytest.approx(sum(serial.oplog.busy_by_engine().values()))
    assert fetched.latency < serial_sum
    assert fetched.latency < serial.latency
    # the same work either way
    assert fetched.oplog.dma_read_count == serial.oplog.dma_read_count == 1 + 2 * 6
    assert fetched.oplog.gemm_count == serial.oplog.gemm_count == 2 * 6
    # overlap is real: some tile load ran while the GEMM engine was busy
    dots = fetched.oplog.select("dot")
    loads = fetched.oplog.select("load_async")
    assert any(ld.start < dt.end and dt.start < ld.end for ld in loads for dt in dots)


def test_ping_pong_costs_exactly_the_hop_latency():
    lat = LatencyModel(link_latency_ns=7.0, link_bytes_per_ns=16.0)
    rounds, n_floats = 5, 250  # 1000 bytes: one hop = 7 + 1000/16 = 69.5 ns

    def kernel(*, tl):
        if tl.program_id() == 0:
            x = tl.full((n_floats,), 1.0)
            t0 = tl.now()
            for _ in range(rounds):
                tl.send("E", x)
                x = tl.recv("E", (n_floats,))
            return t0, tl.now(), x.numpy()
        for _ in range(rounds):
            tl.send("W", tl.recv("W"))

    res = Machine(MeshConfig(rows=1, cols=2), lat).run(kernel)
    t0, t1, x = res.returns[0]
    hop = 7.0 + 1000 / 16.0
    assert lat.message_time(1000) == hop
    assert t1 - t0 == 2 * rounds * hop
    np.testing.assert_array_equal(x, 1.0)
    sends = res.oplog.select("send")
    assert len(sends) == 2 * rounds == res.oplog.ipcq_recv_count
    assert all(s.duration == hop and s.hops == 1 and s.nbytes == 1000 for s in sends)
    assert [s.direction for s in sends[:2]] == ["E", "W"]
    assert res.unconsumed_messages == 0


def test_cube_crossing_hop_pays_extra_latency():
    lat = LatencyModel()

    def kernel(*, tl):
        if tl.program_id() == 0:
            tl.send("E", tl.zeros((64,)))
        else:
            tl.recv("W")

    one_cube = Machine(MeshConfig(rows=1, cols=2), lat).run(kernel)
    two_cubes = Machine(MeshConfig(rows=1, cols=2, cube_cols=1), lat).run(kernel)
    (a,), (b,) = one_cube.oplog.select("send"), two_cubes.oplog.select("send")
    assert a.duration == lat.message_time(256)
    assert b.duration == lat.message_time(256, cube_crossings=1)
    assert b.duration - a.duration == lat.cube_crossing_latency_ns


def test_tree_levels_match_the_fixture():
    levels = [[list(p) for p in level] for level in tree_levels(8)]
    assert levels == FIXTURE["tree_N8"]["levels"]
    assert tree_root(8) == FIXTURE["tree_N8"]["root"]
    assert len(levels) == FIXTURE["tree_N8"]["rounds"] == math.ceil(math.log2(8))
    placement = tree_placement(8, 2, 4)
    machine = Machine(MeshConfig(rows=2, cols=4, placement=placement))
    for level in tree_levels(8):
        for child, parent in level:  # every pair is a physical N/S/E/W neighbour
            assert machine.topology.direction(child, parent) is not None


def _rounds_from_log(log):
    """Rebuild the reduction rounds from the op log alone: a PE's send is in round
    1 + the latest round among the sends it received."""
    sent_to = defaultdict(set)
    for r in log.select("send"):
        sent_to[r.pe].add(r.peer)
    assert all(len(p) == 1 for p in sent_to.values())  # each PE has one parent
    parent = {pe: p.pop() for pe, p in sent_to.items()}
    children = defaultdict(list)
    for c, p in parent.items():
        children[p].append(c)

    def rnd(pe):
        return 1 + max((rnd(c) for c in children[pe]), default=0)

    levels = defaultdict(set)
    for c, p in parent.items():
        levels[rnd(c)].add((c, p))
    return [sorted(levels[k]) for k in sorted(levels)], parent


def test_tree_reduction_n8_matches_fixture_pattern_and_reference():
    machine = tree_machine()
    args, want = setup_tree(machine)
    res = machine.run(tree_decode_kernel, *args)
    root = FIXTURE["tree_N8"]["root"]
    np.testing.assert_allclose(machine.hbm(root).read("O"), want, rtol=1e-5, atol=1e-6)
    assert [pe for pe, r in res.returns.items() if r == "root"] == [root]

    log = res.oplog
    levels, parent = _rounds_from_log(log)
    assert levels == [sorted(map(tuple, lv)) for lv in FIXTURE["tree_N8"]["levels"]]
    assert len(levels) == FIXTURE["tree_N8"]["rounds"] == 3
    assert root not in parent
    # (m, l, O) per tree edge, every message one physical hop, all received
    assert log.ipcq_send_count == log.ipcq_recv_count == 3 * 7
    assert all(r.hops == 1 and r.direction in "NSEW" for r in log.select(("send", "recv")))
    assert res.unconsumed_messages == 0
    # a PE forwards only after it has received everything from its children
    for s in log.select("send"):
        recvs = log.select("recv", pe=s.pe)
        assert all(r.end <= s.start for r in recvs)
    sent = sum(r.nbytes for r in log.select("send"))
    assert sent == sum(r.nbytes for r in log.select("recv")) == log.bytes_by_engine()["IPCQ"]


def test_tree_on_row_major_placement_routes_over_hops():
    machine = tree_machine(placement="row-major")
    args, want = setup_tree(machine)
    not_neighbour = r"PE 1 \(row 0, col 1\).*PE 3 .*not an N/S/E/W neighbour"
    with pytest.raises(TopologyError, match=not_neighbour):
        machine.run(tree_decode_kernel, *args)

    res = machine.run(tree_decode_kernel, *args, by_rank=True)
    np.testing.assert_allclose(machine.hbm(7).read("O"), want, rtol=1e-5, atol=1e-6)
    hops = {(r.pe, r.peer): r.hops for r in res.oplog.select("send")}
    # row-major 2x4: 1->3 and 5->7 are two hops along the row, the rest one
    assert hops == {(0, 1): 1, (2, 3): 1, (4, 5): 1, (6, 7): 1, (1, 3): 2, (5, 7): 2, (3, 7): 1}
    assert sum(r.hops for r in res.oplog.select("send")) == 3 * 9
    assert _rounds_from_log(res.oplog)[0] == [sorted(map(tuple, lv)) for lv in tree_levels(8)]

    placed = tree_machine()
    args, _ = setup_tree(placed)
    assert placed.run(tree_decode_kernel, *args).latency < res.latency


def test_scratch_overflows_without_scopes_and_fits_with_them():
    # TILE=256, d=128, f16: 128 KiB of K+V per tile; 12 tiles leak past 1 MiB unscoped
    machine = Machine()
    args, want = setup_flash_decode(machine, n_tiles=12, TILE=256)
    with pytest.raises(ScratchOverflowError) as err:
        machine.run(flash_decode_kernel, *args, scoped=False)
    msg = str(err.value)
    assert "PE 0 (row 0, col 0)" in msg and "scratch overflow in load" in msg
    assert "needs 65536 B" in msg and "of the 1048576 B scratch are free" in msg

    res = machine.run(flash_decode_kernel, *args, scoped=True)
    np.testing.assert_allclose(machine.hbm(0).read("O"), want, rtol=1e-4, atol=1e-5)
    assert res.scratch_peak[0] < 200 * 1024  # O(1 tile), not O(n_tiles)


def test_use_after_scope_and_recycled_prefetch_are_errors():
    def stale(*, tl):
        with tl.scratch_scope():
            x = tl.zeros((4,))
        tl.exp(x)

    machine = Machine()
    with pytest.raises(ScratchUseAfterFreeError, match=r"PE 0 .*exp uses tensor %1 \[4\]"):
        machine.run(stale)

    def prefetch_inside_scope(x_ptr, *, tl):
        with tl.scratch_scope():
            h = tl.load_async(x_ptr, (4,))
        tl.wait(h)

    with pytest.raises(ScratchUseAfterFreeError, match="out=buf"):
        machine.run(prefetch_inside_scope, machine.hbm(0).alloc("X", shape=(4,)))


def test_send_to_missing_neighbour_names_pe_and_direction():
    def kernel(*, tl):
        if tl.program_id() == 1:
            tl.send("N", tl.zeros((2,)))

    with pytest.raises(TopologyError, match=r"PE 1 \(row 0, col 1\): send\('N'\).*no N IPCQ"):
        Machine(MeshConfig(rows=1, cols=2)).run(kernel)


def test_deadlock_names_the_blocked_pes_and_their_recvs():
    def both_wait(*, tl):
        other = "E" if tl.program_id() == 0 else "W"
        tl.recv(other)
        tl.send(other, tl.zeros((1,)))

    with pytest.raises(DeadlockError) as err:
        Machine(MeshConfig(rows=1, cols=2)).run(both_wait)
    msg = str(err.value)
    assert "PE 0 (row 0, col 0): waits in recv('E') for message #0 from PE 1" in msg
    assert "PE 1 (row 0, col 1): waits in recv('W') for message #0 from PE 0" in msg
    assert "finished kernels: none" in msg

    def one_short(*, tl):
        if tl.program_id() == 0:
            tl.recv(1)
            tl.recv(1)
        else:
            tl.send(0, tl.zeros((1,)))

    short = r"(?s)recv\(1\) for message #1.*finished kernels: PE 1"
    with pytest.raises(DeadlockError, match=short):
        Machine(MeshConfig(rows=1, cols=2)).run(one_short)


def test_rank_strict_broadcasting_and_gqa_reuse():
    def bad(*, tl):
        tl.zeros((8, 64)) - tl.zeros((8,))  # needs [:, None]

    with pytest.raises(ShapeError, match=r"same rank.*\[:, None\]"):
        Machine().run(bad)

    # ADR-0060 §11.2: K/V loads do not depend on G; GEMM work scales with G
    def gqa(q_ptr, k_ptr, G, *, tl):
        k = tl.load(k_ptr, (64, 32))
        kg = tl.broadcast(k, (G, 64, 32))  # ADR-0061 data-faithful head reuse
        q = tl.load(q_ptr, (G, 1, 32))
        return tl.dot(q, tl.trans(kg)).numpy()

    flops = {}
    for G in (1, 8):
        machine = Machine()
        rng = np.random.default_rng(G)
        q, k = rng.standard_normal((G, 1, 32)), rng.standard_normal((64, 32))
        res = machine.run(gqa, machine.hbm(0).alloc("Q", q.astype(np.float32)),
                          machine.hbm(0).alloc("K", k.astype(np.float32)), G)
        np.testing.assert_allclose(res.returns[0], q @ k.T, rtol=1e-5, atol=1e-5)
        assert res.oplog.dma_reads_by_buffer()["K"] == 1
        flops[G] = res.oplog.flops_by_engine()["GEMM"]
    assert flops[8] == 8 * flops[1]


def test_determinism_identical_logs_and_latency():
    runs = []
    for _ in range(2):
        machine = tree_machine()
        args, _ = setup_tree(machine)
        res = machine.run(tree_decode_kernel, *args)
        runs.append((res.oplog.as_tuples(), res.latency, machine.hbm(7).read("O").tobytes(),
                     res.oplog.counters(), res.oplog.breakdown()))
    again = machine.run(tree_decode_kernel, *args)  # same machine, second launch
    assert runs[0] == runs[1]
    assert again.oplog.as_tuples() == runs[0][0] and again.latency == runs[0][1]
    busy = again.oplog.busy_by_pe()
    assert set(busy) == set(range(8)) and all(busy[pe]["GEMM"] > 0 for pe in busy)


def test_recv_async_overlaps_compute_with_the_incoming_message():
    lat = LatencyModel()
    n = 4096  # 16 KiB message

    def kernel(*, tl):
        if tl.program_id() == 0:
            tl.send("E", tl.full((n,), 2.0))
            return None
        buf = tl.empty((n,))  # persistent receive buffer (ring ping-pong style)
        h = tl.recv_async("W", (n,), out=buf)
        a = tl.full((64, 64), 1.0)
        t_dot = tl.now()
        tl.dot(a, a)
        t_done = tl.now()
        x = tl.wait(h)
        assert x is buf
        return t_dot, t_done, tl.now(), float(x.numpy().sum())

    res = Machine(MeshConfig(rows=1, cols=2), lat).run(kernel)
    t_dot, t_done, t_end, total = res.returns[1]
    (send,) = res.oplog.select("send")
    (recv,) = res.oplog.select("recv_async")
    assert total == 2.0 * n and recv.end == send.end
    assert t_end == max(t_done, send.end)
    assert t_end < (t_done - t_dot) + lat.message_time(4 * n)  # serial would pay both
