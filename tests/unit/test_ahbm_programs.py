"""The generated AHBM programs' structure on the simulator: ADR-0060 §11.2-§11.7 (GQA reuse, the
tree's rounds, causal skip, long context with scratch scopes, prefetch overlap, determinism),
the driver's placement and layout, and the command line."""
import ast as pyast
import math
from collections import defaultdict

import numpy as np
import pytest

pytest.importorskip("greenlet", reason="greenlet (a project dependency) is not installed")

from attnc.backends.ahbm import emit, runtime  # noqa: E402
from attnc.backends.ahbm.sim import ScratchOverflowError, tree_levels, tree_root  # noqa: E402
from attnc.backends.ahbm.sim.mesh import Topology  # noqa: E402
from attnc.compiler import oracle  # noqa: E402
from attnc.compiler import inputs, numerics  # noqa: E402
from attnc.compiler.analysis.tiles import FULL, PARTIAL, SKIP  # noqa: E402
from attnc.compiler.cli import main  # noqa: E402
from attnc.compiler.errors import PlanError  # noqa: E402
from attnc.compiler.lower import compile_file, compile_spec  # noqa: E402
from attnc.compiler.plan import plan as make_plan  # noqa: E402
from tests.conftest import EXAMPLES, ROOT, seed_contracts  # noqa: E402

FIXTURE = seed_contracts()["ahbm_adr0060"]


def spec(mask="causal", heads="2 / 1", d=32, dtype="f32", extra=""):
    return compile_spec(f"attention t {{ heads = {heads} head_dim = {d} dtype = {dtype} {extra} mask = {mask} }}")


def simulate(kernel, s_q, s_k, batch=1, seed=0, **options):
    arrays = inputs.sample(kernel.program, batch, s_q, s_k, seed=seed)
    run = kernel.simulate(arrays["q"], arrays["k"], arrays["v"], **options,
                          **{t.name: arrays[t.name] for t in kernel.program.tensors})
    call = inputs.validate(kernel.program, arrays)
    ref_o, ref_lse = oracle.reference(kernel.program, call.q, call.k, call.v, call.tensors)
    co, cl = numerics.compare_outputs(kernel.program.dtype, inputs.output_bhsd(kernel.program, run.o),
                                      run.lse, ref_o, ref_lse)
    assert co.ok and cl.ok, (str(co), str(cl))
    return run


# ---- §11.2 GQA reuse --------------------------------------------------------------------------
@pytest.mark.parametrize("case,s_q", [("decode", 1), ("prefill", 32)])
def test_kv_loads_do_not_depend_on_the_group_while_gemm_work_scales_with_it(case, s_q):
    reads, gemm, flops = {}, {}, {}
    for G in (1, 2, 4, 8):
        run = simulate(runtime.load(spec(heads=f"{G} / 1")), s_q, 64, seed=G, case=case)
        by_buffer = run.oplog.dma_reads_by_buffer()
        reads[G] = (by_buffer["K"], by_buffer["V"])
        gemm[G] = run.oplog.gemm_count
        flops[G] = run.oplog.flops_by_engine()["GEMM"]
        # one load per K/V tile the plan does not skip, shared by the G query heads
        assert by_buffer["K"] == by_buffer["V"] == run.group_tiles["full"] + run.group_tiles["partial"]
    assert len(set(reads.values())) == 1 and len(set(gemm.values())) == 1
    assert all(flops[G] == G * flops[1] for G in flops)


# ---- §11.3 tree reduction --------------------------------------------------------------------
def rounds_from_log(log):
    """The reduction rounds rebuilt from the op log: a PE's send is in round 1 + the latest
    round among the sends it received."""
    parent = {}
    for r in log.select("send"):
        assert parent.setdefault(r.pe, r.peer) == r.peer  # one parent per PE
    children = defaultdict(list)
    for c, p in parent.items():
        children[p].append(c)

    def rnd(pe):
        return 1 + max((rnd(c) for c in children[pe]), default=0)

    levels = defaultdict(set)
    for c, p in parent.items():
        levels[rnd(c)].add((c, p))
    return [sorted(levels[k]) for k in sorted(levels)], parent


def test_decode_sp_tree_matches_the_fixture_for_n8():
    tree = FIXTURE["tree_N8"]
    run = simulate(runtime.load(spec(heads="4 / 1"), sp=8), 1, 61, seed=2)
    assert run.program == "decode-sp"
    log = run.oplog
    levels, parent = rounds_from_log(log)
    assert levels == [sorted(map(tuple, lv)) for lv in tree["levels"]]
    assert len(levels) == tree["rounds"] == math.ceil(math.log2(8)) < tree["baseline_fanout_steps"]
    assert tree["root"] not in parent and run.result.returns[tree["root"]] == "root"
    # (m, l, O) per tree edge, each over one physical N/S/E/W hop, all received
    assert log.ipcq_send_count == log.ipcq_recv_count == 3 * 7
    assert all(r.hops == 1 and r.direction in ("N", "S", "E", "W") for r in log.select(("send", "recv")))
    assert run.result.unconsumed_messages == 0
    assert log.dma_write_count == 2  # only the root stores (O and LSE)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 16])
def test_decode_sp_issues_ceil_log2_n_rounds(n):
    run = simulate(runtime.load(spec()), 1, 3 * n + 1, seed=n, sp=n)
    levels, _ = rounds_from_log(run.oplog)
    assert [sorted(lv) for lv in levels] == [sorted(lv) for lv in tree_levels(n)]
    assert len(levels) == math.ceil(math.log2(n))
    assert run.oplog.ipcq_send_count == 3 * (n - 1)


def test_generated_tree_and_placement_formulas_follow_the_fixture():
    module = runtime.load(spec()).module
    for n in range(1, 17):
        assert module.tree_levels(n) == tree_levels(n)
        assert [module.tree_parent(r, n) for r in range(n)].count(None) == 1
    for counter in range(0, 40):
        for n in (1, 3, 8):
            for start_pe in range(n):
                lens = [module.valid_len(counter, start_pe, pe, n) for pe in range(n)]
                assert sum(lens) == counter and max(lens) - min(lens) <= 1
                for pe in range(n):  # slot -> global inverts pe = (start_pe + token) mod N
                    for slot in range(lens[pe]):
                        g = module.slot_to_global(slot, pe, start_pe, n)
                        assert g < counter and (start_pe + g) % n == pe


def test_round_robin_layout_puts_each_token_on_its_pe():
    kernel = runtime.load(spec())
    arrays = inputs.sample(kernel.program, 3, 1, 29, seed=1)
    run = kernel.simulate(arrays["q"], arrays["k"], arrays["v"], sp=4)
    k = arrays["k"]
    for b in range(3):
        start_pe = b % 4  # request_id mod N
        for pe in range(4):
            held = run.machine.hbm(b * 4 + pe).read("K")
            tokens = [t for t in range(29) if (b + t) % 4 == pe]  # (request_id + token) mod N
            np.testing.assert_array_equal(held, k[b, 0, tokens])
            assert len(held) == kernel.module.valid_len(29, start_pe, pe, 4)


def test_placements_make_tree_pairs_and_ring_steps_neighbours():
    topo = Topology(runtime.mesh_config(2, 8, "tree"))
    for w in range(2):
        for level in tree_levels(8):
            for child, parent in level:
                assert topo.direction(w * 8 + child, w * 8 + parent) is not None
        assert topo.cube_of(w * 8) == topo.cube_of(w * 8 + 7) != topo.cube_of((1 - w) * 8)
    for n, cycle in ((2, True), (4, True), (6, True), (8, True), (16, True), (3, False), (9, False)):
        topo = Topology(runtime.mesh_config(1, n, "ring"))
        assert all(topo.direction(i, i + 1) for i in range(n - 1))
        assert bool(topo.direction(n - 1, 0)) is cycle


# ---- §11.4 causal skip -----------------------------------------------------------------------
def group_nonskip(program, batch, s_q, s_k, tensors, bm, bn):
    """Non-SKIP tiles per K/V head: a tile is skipped only when every query head of the group
    skips it (the G heads share the tile's load)."""
    classes = make_plan(program, batch, s_q, s_k, tensors, bm, bn).tiles.classes
    c = np.broadcast_to(classes, (batch, program.heads_q) + classes.shape[2:])
    c = c.reshape(batch, program.heads_kv, program.group, *classes.shape[2:])
    return int((c != SKIP).any(axis=2).sum()), int(c[:, :, 0].size)


@pytest.mark.parametrize("example", ["causal", "sliding_window_causal", "causal_document", "chunked"])
def test_prefill_gemm_count_equals_the_non_skip_tile_count(example):
    program = inputs.contiguous_variant(compile_file(ROOT / "examples" / f"{example}.attn"))
    kernel = runtime.load(program)
    arrays = inputs.sample(program, 1, 96, 96, seed=4)
    tensors = {t.name: arrays[t.name] for t in program.tensors}
    call = inputs.validate(program, arrays)
    nonskip, grid = group_nonskip(program, 1, 96, 96, call.tensors, kernel.module.BLOCK_M,
                                  kernel.module.BLOCK_N)
    for sp in (1, 3):
        run = kernel.simulate(arrays["q"], arrays["k"], arrays["v"], sp=sp, **tensors)
        dots = run.oplog.select("dot")
        assert run.oplog.gemm_count == len(dots) == 2 * nonskip  # Q.K^T and P.V per tile
        assert sum(1 for d in dots if d.shape[-1] != program.d_v) == nonskip
        assert nonskip < grid  # the future (and out-of-window) tiles are really skipped
        if sp == 1:  # SKIP tiles are never loaded
            assert run.oplog.dma_reads_by_buffer()["K"] == nonskip


def test_causal_ring_skips_steps_and_never_wraps():
    n = 4
    runs = {mask: simulate(runtime.load(spec(mask)), 64, 64, sp=n, seed=1) for mask in ("causal", "true")}
    full, causal = runs["true"].oplog, runs["causal"].oplog
    assert full.ipcq_send_count == 2 * n * (n - 1)  # every block visits every PE: K and V
    assert causal.ipcq_send_count == 2 * n * (n - 1) // 2  # block c only travels to c+1..N-1
    assert all(s.peer == s.pe + 1 for s in causal.select("send"))  # nothing from PE N-1 to PE 0
    assert causal.gemm_count < full.gemm_count
    # recv_async overlap: each PE claims its next block before folding the current one, and
    # some block is in flight while that PE's GEMM engine works
    recvs = causal.select("recv_async")
    assert recvs and not causal.select("recv")
    assert any(r.start < d.end and d.start < r.end for r in recvs for d in causal.select("dot", pe=r.pe))


# ---- §11.5 long context ----------------------------------------------------------------------
def test_long_context_overflows_scratch_without_scopes_and_fits_with_them():
    program = spec(heads="8 / 1", d=64)
    arrays = inputs.sample(program, 1, 1, 8192, seed=7)
    with pytest.raises(ScratchOverflowError) as err:
        runtime.load(program, block_n=64, scoped=False)(arrays["q"], arrays["k"], arrays["v"])
    assert "PE 0 (row 0, col 0)" in str(err.value) and "scratch overflow in" in str(err.value)
    run = simulate(runtime.load(program, block_n=64), 1, 8192, seed=7)
    assert run.result.scratch_peak[0] < 128 * 1024  # O(1 tile), not O(context)
    assert run.oplog.dma_reads_by_buffer()["K"] == 8192 // 64


# ---- §11.6 prefetch overlap ------------------------------------------------------------------
@pytest.mark.parametrize("case,s_q", [("decode", 1), ("prefill", 48)])
def test_prefetch_latency_is_below_the_serial_sum_of_load_and_compute(case, s_q):
    program = spec(heads="4 / 1", d=64)
    runs = {depth: simulate(runtime.load(program, prefetch=depth), s_q, 512, seed=3, case=case)
            for depth in (0, 2)}
    serial, fetched = runs[0], runs[2]
    busy = fetched.oplog.busy_by_engine()
    assert fetched.latency < sum(busy.values())  # Σ(load + compute) on the one PE
    assert serial.latency == pytest.approx(sum(serial.oplog.busy_by_engine().values()))
    assert fetched.latency < serial.latency
    assert fetched.oplog.select("load_async") and not serial.oplog.select("load_async")
    loads, dots = fetched.oplog.select("load_async"), fetched.oplog.select("dot")
    assert any(ld.start < dt.end and dt.start < ld.end for ld in loads for dt in dots)


# ---- §11.7 determinism -----------------------------------------------------------------------
@pytest.mark.parametrize("s_q,sp", [(1, 8), (40, 4), (40, 1)])
def test_identical_inputs_give_identical_op_log_and_latency(s_q, sp):
    kernel = runtime.load(inputs.contiguous_variant(compile_file(ROOT / "examples" / "causal_document.attn")))
    runs = [simulate(kernel, s_q, 40, batch=2, seed=9, sp=sp) for _ in range(2)]
    a, b = runs
    assert a.oplog.as_tuples() == b.oplog.as_tuples() and len(a.oplog) > 0
    assert a.latency == b.latency and a.oplog.counters() == b.oplog.counters()
    assert a.o.tobytes() == b.o.tobytes()


# ---- the generated source and the driver -------------------------------------------------------
def test_generated_module_is_self_contained_and_holds_the_programs():
    for path in EXAMPLES:
        source = emit(compile_file(path)).text
        tree = pyast.parse(source)
        imports = [a.name for n in pyast.walk(tree) if isinstance(n, (pyast.Import, pyast.ImportFrom))
                   for a in n.names]
        assert "numpy" in imports and set(imports) <= {"math", "numpy"}, path
        defs = {n.name for n in tree.body if isinstance(n, pyast.FunctionDef)}
        assert {"decode", "prefill", "ring", "reduce_tree", "visible", "score_program"} <= defs
    text = emit(compile_file(ROOT / "examples" / "causal_blockwise.attn")).text
    assert "return ((k <= q) & ((ld[0] == ld[1]) | (q >= ld[2])))" in text
    for needle in ("tl.load_async", "tl.scratch_scope()", "tl.recv_async", "tl.broadcast",
                   "tree_children(pe_id, n)"):
        assert needle in text


def test_tile_classes_are_merged_over_the_group():
    c = np.array([[[[SKIP, FULL, PARTIAL, FULL]], [[SKIP, FULL, SKIP, PARTIAL]]]], np.int8)  # [1, 2, 1, 4]
    merged = runtime.group_classes(c, batch=1, heads_q=2, group=2)
    assert merged.tolist() == [[[[SKIP, FULL, PARTIAL, PARTIAL]]]]


def test_tensor_read_at_a_q_and_k_dependent_index_is_refused():
    program = compile_spec("attention t { heads = 2 head_dim = 16 dtype = f32 "
                           "tensor w: i32[b, s] ~ randint(0, 2) mask = causal & w[b, abs(q - k)] == 0 }")
    arrays = inputs.sample(program, 1, 8, 8)
    kernel = runtime.load(program)
    with pytest.raises(PlanError, match=r"w\[b, abs\(q - k\)\] varies with both q and k"):
        kernel(arrays["q"], arrays["k"], arrays["v"], w=arrays["w"], mask_from="predicate")


def test_bad_options_are_errors():
    kernel = runtime.load(spec())
    arrays = inputs.sample(kernel.program, 1, 1, 8)
    for options, match in (({"sp": 0}, "sp"), ({"case": "ring"}, "case"), ({"mask_from": "x"}, "mask_from")):
        with pytest.raises(PlanError, match=match):
            kernel(arrays["q"], arrays["k"], arrays["v"], **options)
    with pytest.raises(PlanError, match="no AHBM run"):
        runtime.load(spec()).report()


# ---- command line ----------------------------------------------------------------------------
def test_cli_compile_and_run_with_report(capsys):
    path = str(ROOT / "examples" / "causal_document.attn")
    assert main(["compile", path, "--backend", "ahbm"]) == 0
    out = capsys.readouterr().out
    assert out == emit(compile_file(path)).text
    assert main(["run", path, "--backend", "ahbm", "--kv-len", "40", "--q-len", "1", "--sp", "8",
                 "--batch", "1", "--report", "--check"]) == 0
    out = capsys.readouterr().out
    assert "program decode-sp (N = 8)" in out and "end-to-end latency" in out
    assert "ipcq_send_count 84" in out  # 4 K/V heads x 7 tree edges x (m, l, O)
    assert "vs float64 oracle: O:" in out and "FAIL" not in out
    assert main(["run", path, "--backend", "ahbm", "--kv-len", "40", "--batch", "1", "--report"]) == 0
    out = capsys.readouterr().out
    assert "program prefill (N = 1)" in out and "DMA" in out and "gemm_count" in out
    assert main(["run", path, "--sp", "2"]) == 1
    assert "--backend ahbm" in capsys.readouterr().err


def test_root_is_the_fixture_root():
    assert tree_root(8) == FIXTURE["tree_N8"]["root"]
    assert runtime.cube_shape(8) == (2, 4)
