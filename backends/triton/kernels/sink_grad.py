"""dL/dsink of every (request, query head) of a backward call with a sink
(``BackwardCalls._sink_grads``; attnc.compiler.sinks): the sum over the head's query rows of
p_sink * -(D - dLSE), p_sink = exp(sink - LSE) (0 where LSE is -inf: no key and no sink), the sink
computed by the spec's generated ``sink_value``.  One program per (b, h), its rows in a fixed
order: the same bits every run, one launch where the torch expression took a dozen."""
import triton
import triton.language as tl


@triton.jit
def _sink_grad(LSE, DELTA, OUT, TS, S_Q, SINK: tl.constexpr, H_Q: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[b * H_Q + h] (float32) from LSE and DELTA [B, H_Q, S_Q] (contiguous, float32)."""
    bh = tl.program_id(0)
    sink = SINK(bh // H_Q, bh % H_Q, TS) + tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for r0 in range(0, S_Q, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        keep = rows < S_Q
        lse = tl.load(LSE + bh * S_Q + rows, mask=keep, other=float("-inf"))
        delta = tl.load(DELTA + bh * S_Q + rows, mask=keep, other=0.0)
        finite = (lse == lse) & (lse != float("inf")) & (lse != float("-inf"))
        p = tl.where(finite, tl.exp(sink - tl.where(finite, lse, 0.0)), 0.0)
        acc += p * delta
    tl.store(OUT + bh, -tl.sum(acc, 0))
