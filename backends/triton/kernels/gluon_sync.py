"""Gluon for the engines (``gluon_engine.py``, ``gluon_paged.py``): the import of Gluon (absent from
some Tritons: ``HAS_GLUON``), and the producer / consumer handshake, the scalars the producer warp
hands over in shared memory and the barriers both sides wait on."""
import triton.language as tl

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # TMA copies were renamed after triton 3.6 (async_copy_global_to_shared -> async_load, and the
    # store likewise); the old store name raises in 3.9
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    HAS_GLUON = True
except (ImportError, AttributeError):  # a Triton without Gluon: the engine is unavailable
    HAS_GLUON = False
    TensorDescriptor = None

    class gluon:  # noqa: N801 - keeps the definitions below importable; the launch layer refuses the engine
        jit = staticmethod(lambda fn: fn)


@gluon.jit
def _ws_put(smem, values, N: tl.constexpr):
    """The producer warp writes N int32 scalars into smem (read by ``_ws_get``)."""
    layout: tl.constexpr = gl.BlockedLayout([N], [32], [1], [0])
    idx = gl.arange(0, N, layout)
    vec = gl.zeros([N], gl.int32, layout)
    for j in gl.static_range(N):
        vec = gl.where(idx == j, values[j], vec)
    smem.store(vec)


@gluon.jit
def _ws_get(smem, j: tl.constexpr, N: tl.constexpr):
    """A consumer warpgroup reads the j-th of the N scalars ``_ws_put`` wrote."""
    layout: tl.constexpr = gl.BlockedLayout([N], [32], [4], [0])
    return gl.sum(gl.where(gl.arange(0, N, layout) == j, smem.load(layout), 0), 0)



@gluon.jit
def _ws_take_job(job_smem, q_ready, jc, Q_BUFS: tl.constexpr):
    """A consumer's jc-th job: once its Q is in (the buffer jc % Q_BUFS, in the phase of its
    jc // Q_BUFS-th use), the job's t from that buffer's slot (the other fields: ``_ws_get``)."""
    mbarrier.wait(q_ready.index(jc % Q_BUFS), (jc // Q_BUFS) & 1)
    return _ws_get(job_smem.index(jc % Q_BUFS), 0, 4)


@gluon.jit
def _ws_claim_q(q_empty, jc, Q_BUFS: tl.constexpr):
    """The producer's Q buffer for its jc-th job (or its "none left"), once every consumer has
    released that buffer's previous use: returns the buffer's index."""
    buf = jc % Q_BUFS
    mbarrier.wait(q_empty.index(buf), ((jc // Q_BUFS) & 1) ^ 1)
    return buf


@gluon.jit
def _ws_handover(STAGES: tl.constexpr, CONSUMERS: tl.constexpr = 2, Q_BUFS: tl.constexpr = 1):
    """What the producer and the consumers share besides the data: each Q buffer's job and each
    stage's scalars in shared memory, and the barriers (q_ready and q_empty per Q buffer, k_ready,
    k_empty, v_ready, v_empty, turns), initialized: a Q buffer and a stage are released by every
    consumer, and of the consumers' turns on the tensor cores (PINGPONG) the first warpgroup's is open."""
    job_smem = gl.allocate_shared_memory(gl.int32, [Q_BUFS, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    blk_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)  # every consumer releases a Q buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # every consumer releases a stage
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # the consumers' turns (PINGPONG): the first warpgroup's open
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns)
    return job_smem, blk_smem, bars
