"""The Triton kernel's backward calls and the blocks of a larger call (context parallelism):
a mixin of ``runtime.Kernel``."""
from __future__ import annotations

from attnc.compiler import inputs, ir, sinks
from attnc.compiler.dispatch.signature import NO_ADDRESS
from attnc.compiler.errors import InputError

from . import blocks
from . import gluon_backward as GB, grad as G
from . import launch as L
from . import plans as P
from .decode import _check_gpu_tile
from . import device
from .device import interpreted
from .kernels.sink_grad import _sink_grad


class BackwardCalls:
    def block(self, q, k, v, args: dict, tensors: dict, lengths: tuple[int, int]):
        """Partial (O float32, LSE) of one block of a larger call at its absolute positions
        (context parallelism: ``blocks.forward``); bhsd q, k, v."""
        from . import blocks
        return blocks.forward(self, q, k, v, args, tensors, lengths)

    def block_backward(self, q, k, v, o, lse, do, dlse, args: dict, tensors: dict, lengths: tuple[int, int]):
        """Partial (dQ, dK, dV) float32 of one block of a larger call (``blocks.backward``)."""
        from . import blocks
        return blocks.backward(self, q, k, v, o, lse, do, dlse, args, tensors, lengths)

    # ------------------------------------------------------------ backward
    def backward(self, q, k, v, o, lse, do, dlse=None, *, config=None, deterministic: bool = True, **tensors):
        """dQ, dK, dV of a prefill call from its saved O and LSE and the gradient of O (``dlse``: of
        LSE, optional).  Inputs in the spec's layout as for the forward; gradients come back in
        the layout and dtype of q, k and v.  Planned from the same mask analysis as the forward and
        cached like it: the Gluon passes on Hopper where ``gluon_backward.choose`` takes the call
        (``gluon_backward.GluonBackwardLaunch``), else the Triton ones (``grad.BackwardLaunch``).
        ``deterministic`` False (no ``config``): the Gluon passes may add dQ unordered, where that is
        faster (``gluon_backward.default_config``); gradients are then not bit-identical run to run."""
        return self._backward(q, k, v, o, lse, do, dlse, config, tensors, (), deterministic)[:3]

    def backward_with_tensors(self, q, k, v, o, lse, do, dlse, tensors: dict, want: tuple[str, ...],
                              config=None, deterministic: bool = True):
        """(dQ, dK, dV, {name: gradient}) with the gradients of the score tensors named in ``want``
        (``score_grads``: each must be a float tensor the score program reads by plain positions;
        such calls take the Triton passes, whose plan rows the tensor gradients walk) and of the
        f32 tensors the spec's sink reads (:meth:`_sink_grads`; summed where both read one)."""
        from . import score_grads
        for n in want:
            why = score_grads.refusal(self.program, n)
            if why is not None:
                raise InputError(f"inputs: tensor '{n}' requires grad: {why}")
        return self._backward(q, k, v, o, lse, do, dlse, config, tensors, tuple(want), deterministic)

    def _backward_key(self, q, k, v, o, lse, do, dlse, config, tensors: dict, want: tuple, deterministic: bool):
        """A backward call's key in ``_bound``: everything the checks, the copies and the choice of
        passes depend on; None where a tensor has no address (a meta tensor: the checks name what is wrong)."""
        try:
            return ("backward", self._key(q, k, v, tensors), o.shape, o.stride(), do.shape, do.stride(), lse.shape,
                    o.data_ptr() % 16 == 0, do.data_ptr() % 16 == 0, None if dlse is None else dlse.shape,
                    config, self._score_wanted(want), GB.DEFAULT, deterministic)  # (GB.DEFAULT flipped: re-chosen)
        except NO_ADDRESS:
            return None

    def bind_backward(self, q, k, v, o, lse, do, dlse, tensors: dict, deterministic: bool = True):
        """The bound backward (``bound_backward.BoundBackward``) of calls keyed like this one, once one
        ran here (validated, planned, launched), asking no tensor gradient and no config; None where
        there is none to bind: no such call yet, a carried dtype (the interpreter's bf16), or its plan
        no longer cached."""
        key = self._backward_key(q, k, v, o, lse, do, dlse, None, tensors, (), deterministic)
        hit = self._bound.get(key) if key is not None else None
        if hit is None or hit[0].emulate:
            return None
        call_key, part = hit[3], hit[1] or hit[2]
        named, pkey = ((), call_key) if isinstance(call_key, P.Key) else \
            self._plan_key("backward", call_key, part, tensors=tensors)
        launch = P.PLANS.get(pkey, named)
        if launch is None:
            return None
        from .bound_backward import BoundBackward
        return BoundBackward(self, hit, launch, hit[1] is not None and not device.tma_ready(do))

    def _backward(self, q, k, v, o, lse, do, dlse, config, tensors: dict, want: tuple, deterministic: bool = True):
        torch = self._torch
        bind_key = self._backward_key(q, k, v, o, lse, do, dlse, config, tensors, want, deterministic)
        hit = self._bound.get(bind_key) if bind_key is not None else None
        if hit is None:  # validated and chosen once per key, as the forward's calls are
            hit = self._backward_bind(q, k, v, o, lse, do, dlse, tensors, config, want, deterministic)
            if bind_key is not None:
                self._bound[bind_key] = hit
        bound, gluon, cfg, call_key, copies = hit
        if copies:  # (token-major views: the Gluon passes read contiguous copies)
            q, k, v, o = (GB.tma_input(x) for x in (q, k, v, o))
        if gluon:
            do = GB.tma_input(do)
        if isinstance(call_key, P.Key):  # (the mask reads no tensor: the key made once)
            named, pkey = (), call_key
        else:
            named, pkey = self._plan_key("backward", call_key, gluon or cfg, tensors=tensors)
        launch = P.PLANS.get(pkey, named)
        if launch is None:
            (bm1, bn1), (bm2, bn2) = cfg.tiles()
            for bm, bn in cfg.tiles():
                _check_gpu_tile(bm, bn)
            dq_plan = self.plan(bound.batch, bound.s_q, bound.s_k, tensors, bm2, bn2)
            shape = (bound.batch, bound.s_q, bound.s_k)
            if gluon:  # the Gluon passes (gluon_backward), on the same mask analysis
                launch = GB.GluonBackwardLaunch(self.module, gluon, dq_plan.retile, shape, q.device)
            else:
                launch = G.BackwardLaunch(self.module, cfg, dq_plan.retile(bm1, bn1), dq_plan, shape, q.device)
            P.PLANS.put(pkey, launch, launch.nbytes, named)
        if bound.emulate:
            q, k, v, o, do = (x.float() for x in (q, k, v, o, do))
        contiguous = torch.contiguous_format
        dq = torch.empty_like(q, memory_format=contiguous)
        dk = torch.empty_like(k, memory_format=contiguous)
        dv = torch.empty_like(v, memory_format=contiguous)
        views = (q, k, v, o, do, dq, dk, dv)
        if bound.bshd:
            views = tuple(x.transpose(1, 2) for x in views)
        qb, kb, vb, ob, dob, dqb, dkb, dvb = views
        lse = lse.contiguous()
        dlse = dlse.contiguous() if dlse is not None else None
        ts = L.call_tensor_args(self.module, tensors, bound.batch, bound.s_q, bound.s_k, q.device)
        delta = launch(qb, kb, vb, ob, lse, dob, dlse, ts, dqb, dkb, dvb,
                       call_key if not bound.emulate else None)  # (it fixes every argument's specialization)
        dts = {}
        if want:
            from . import score_grads
            if self._score_wanted(want):
                dts = score_grads.tensor_gradients(self, launch, qb, kb, vb, lse, delta, dob, ts, tensors, want,
                                                   call_key if not bound.emulate else None)
            sunk = [n for n in want if n in sinks.tensors_read(self.program)]
            if sunk:
                grads = self._sink_grads(lse, delta, ts, tensors)
                for n in sunk:
                    dts[n] = dts[n] + grads[n] if n in dts else grads[n]
        if bound.emulate:
            dq, dk, dv = (x.to(torch.bfloat16) for x in (dq, dk, dv))
        return dq, dk, dv, dts

    def _takes_copies(self, q, k, v, o, config, want: tuple, deterministic: bool) -> bool:
        """Whether a call's q, k, v and O, which TMA cannot read as they are (token-major views), are
        copied contiguous for the Gluon passes (``gluon_backward.takes_copies``); False where a tensor
        has no address to ask (a meta tensor: the checks that follow name what is wrong)."""
        if self.program.cache.layout is ir.Layout.BSHD or self._score_wanted(want):
            return False
        try:
            if device.tma_ready(q, k, v, o):
                return False
        except NO_ADDRESS:
            return False
        return GB.takes_copies(self.program, config, (q, k, v, o), interpreted(), deterministic)

    def _score_wanted(self, want: tuple) -> bool:
        """Whether a backward call wants the gradient of a tensor the score program reads (the
        names are found once per kernel: every backward call asks)."""
        if not want:
            return False
        read = self.__dict__.get("_score_read")
        if read is None:
            from . import score_grads
            read = self._score_read = frozenset(load.tensor for load in score_grads.loads(self.program))
        return not read.isdisjoint(want)

    def _sink_grads(self, lse, delta, ts: tuple, tensors: dict) -> dict:
        """{tensor: gradient} of the f32 tensors the sink reads, from the saved LSE and the delta
        pass's D - dLSE (every backward launch returns it): dL/dsink per (b, h) (:meth:`_dsink`),
        then through the sink's derivative: on the device where it and the reads depend on no
        tensor value (``compiler.sinks.reduction``: a gather and a fixed-order sum, no host sync;
        ``sink = sinks[h]``), else on the host (``compiler.sinks.tensor_gradients``)."""
        import numpy as np
        torch = self._torch
        dsink = self._dsink(lse, delta, ts)
        red = self._sink_reduction(lse.shape[0], tensors, lse.device)
        if red is not None:
            out = {}
            for n, (scale, order, targets, count) in red.items():
                t = tensors[n]
                g = torch.zeros(t.numel(), dtype=torch.float64, device=t.device)
                g[targets] = (dsink * scale).reshape(-1)[order].view(-1, count).sum(1)
                out[n] = g.view(t.shape).to(t.dtype)
            return out
        host = {n: t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t) for n, t in tensors.items()}
        grads = sinks.tensor_gradients(self.program, dsink.cpu().numpy(), host)
        return {n: torch.from_numpy(g).to(device=tensors[n].device, dtype=tensors[n].dtype) for n, g in grads.items()}

    def _dsink(self, lse, delta, ts: tuple):
        """dL/dsink [B, H_q] float32 = sum over the head's rows of p_sink (dLSE - D), p_sink =
        exp(sink - LSE) (0 where LSE is -inf): one launch, a program per (b, h) with its rows in a
        fixed order (``kernels/sink_grad.py``: no atomics, the same bits every run)."""
        batch, h_q, s_q = lse.shape
        dsink = self._torch.empty((batch, h_q), device=lse.device, dtype=self._torch.float32)
        if batch * h_q:
            lz = self._sink_grad_launcher
            if lz is None:
                lz = self._sink_grad_launcher = L.Launcher(_sink_grad, dict(SINK=self.module.sink_value, H_Q=h_q,
                                                                           BLOCK=256), num_warps=4)
            args = (lse, delta.contiguous(), dsink, ts, s_q)
            lz.launch((batch * h_q,), args, ("sink_grad", L.spec_key(args)))
        return dsink

    def _sink_reduction(self, batch: int, tensors: dict, device) -> dict | None:
        """``compiler.sinks.reduction`` of this call's batch and tensor shapes with its index arrays
        on ``device`` ({tensor: (scale, order, targets, count)}), made once per key; None: the host's."""
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        key = (batch, tuple(sorted(shapes.items())), str(device))
        made = self._sink_reductions  # (few keys: a batch size and shapes each)
        red = made.get(key, False)
        if red is False:
            red = sinks.reduction(self.program, batch, shapes)
            if red is not None:
                red = {n: tuple(self._torch.as_tensor(a, device=device) for a in part[:3]) + (part[3],)
                       for n, part in red.parts.items()}
            if len(made) >= 64:
                made.clear()
            made[key] = red
        return red

    def _backward_bind(self, q, k, v, o, lse, do, dlse, tensors: dict, config, want: tuple,
                       deterministic: bool = True):
        """(what a backward call's key fixes, the Gluon passes' choice or None, the Triton passes'
        config, the call's part of the plan cache's key -- the whole key, a ``plans.Key``, where
        the mask reads no tensor --, whether q, k, v and O are copied contiguous for the Gluon passes,
        :meth:`_takes_copies`): the call's checks, once per key.  Calls asking score-tensor gradients take the
        Triton passes (``score_grads`` walks their plan rows); the sink's tensors' gradients come
        from LSE and D on either (:meth:`_sink_grads`)."""
        copies = self._takes_copies(q, k, v, o, config, want, deterministic)
        if copies:
            q, k, v, o = (GB.tma_input(x) for x in (q, k, v, o))
        bound = self._validate(q, k, v, tensors)
        for n, t, shape in (("o", o, bound.out_shape), ("do", do, bound.out_shape),
                            ("lse", lse, (bound.batch, self.program.heads_q, bound.s_q))):
            if tuple(t.shape) != tuple(shape):
                raise InputError(f"inputs: '{n}' has shape {list(t.shape)}; this call's is {list(shape)}")
        if dlse is not None and tuple(dlse.shape) != tuple(lse.shape):
            raise InputError(f"inputs: 'dlse' has shape {list(dlse.shape)}; LSE's is {list(lse.shape)}")
        p = self.program
        gluon = None if self._score_wanted(want) else \
            GB.choose(p, config, bound.s_q, bound.s_k, (q, k, v, o), bound.bshd, interpreted(), deterministic)
        cfg = (None if gluon else config) or G.default_backward_config(p.d_qk, p.d_v, interpreted(), p.dtype == "f32")
        d = GB.tma_input(do) if gluon else do  # (what the launch reads: its layout is fixed by do's)
        key = (self._key(q, k, v, tensors), o.stride(), d.stride(), o.data_ptr() % 16 == 0, d.data_ptr() % 16 == 0,
               dlse is not None)
        named, plan_key = self._plan_key("backward", key, gluon or cfg, tensors=tensors)
        return bound, gluon, cfg, key if named else plan_key, copies
