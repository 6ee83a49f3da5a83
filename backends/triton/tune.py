"""Tuning the Triton backend (``attnc tune --backend triton``): its search spaces (prefill and
decode, and tiny ones for the interpreter), their constraints, the untuned defaults and the
runner that launches a candidate."""
from __future__ import annotations

import numpy as np

from attnc.compiler import inputs, ir, oracle
from attnc.compiler.dispatch import DispatchKey
from attnc.compiler.errors import TuneError
from attnc.compiler.tune import (Reference, Runner, Shape, Space, Timer, cuda_event_timer, pow2_at_least,
                                 reference_for, tile_fits_keys, tile_fits_rows, wall_timer)


def _tma(cfg, key):
    if not cfg.get("use_tma"):
        return None
    if key.interpreter or key.device_type != "cuda" or (key.compute_capability or 0) < 90:
        return "use_tma needs sm_90+"
    if key.d_qk & (key.d_qk - 1) or key.d_v & (key.d_v - 1):
        return "use_tma needs power-of-two head dims"
    return None


def _shared_memory(cfg, key):
    """K and V tiles per pipeline stage plus the Q tile, in storage bytes, against ~227 KiB (sm_90)."""
    if key.device_type != "cuda" or "BLOCK_N" not in cfg:
        return None
    elem = 4 if key.q_dtype == "f32" else 2
    d_qk, d_v = pow2_at_least(key.d_qk), pow2_at_least(key.d_v)
    stages = max(1, cfg.get("num_stages", 2) - 1)
    need = elem * (stages * cfg["BLOCK_N"] * (d_qk + d_v) + cfg.get("BLOCK_M", 16) * d_qk)
    limit = 227 * 1024 if (key.compute_capability or 0) >= 90 else 160 * 1024
    return f"~{need // 1024} KiB of shared memory" if need > limit else None


def _splits_fit(cfg, key):
    if cfg.get("splits") and cfg["splits"] > -(-max(key.S_k) // cfg["BLOCK_N"]):
        return f"splits={cfg['splits']} exceeds the {-(-max(key.S_k) // cfg['BLOCK_N'])} K/V blocks"
    return None


def _prefill_default(key: DispatchKey) -> dict:
    from attnc.backends.triton.choice import default_prefill_config
    return default_prefill_config(key.d_qk, key.d_v, key.interpreter, key.compute_capability,
                                  key.mask_kind == "tensor")


def _decode_default(key: DispatchKey) -> dict:
    # splits None: the runtime's own occupancy rule picks the split count
    return {"BLOCK_N": 16 if key.interpreter else 64, "splits": None, "num_warps": 4, "num_stages": 2}


# family -> Space.  Family: "prefill" (prefill and append share a kernel) or "decode"; the
# Triton interpreter gets tiny spaces of its own (tests, not speed).
SPACES: dict[str, Space] = {
    "prefill": Space({"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8),
                      "num_stages": (2, 3, 4), "use_tma": (False, True)},
                     _prefill_default, (tile_fits_rows, tile_fits_keys, _tma, _shared_memory)),
    # GQA packing (the G query heads of a K/V head in one program) becomes an axis here
    # once the decode kernel takes it as a launch parameter.
    "decode": Space({"BLOCK_N": (32, 64, 128), "splits": (1, 2, 4, 8, 16, 32), "num_warps": (2, 4, 8),
                     "num_stages": (2, 3)},
                    _decode_default, (tile_fits_keys, _splits_fit, _shared_memory)),
    "interpreter_prefill": Space({"BLOCK_M": (16,), "BLOCK_N": (16, 32), "num_warps": (4,),
                                  "num_stages": (1,), "use_tma": (False,)},
                                 _prefill_default, (tile_fits_keys,)),
    "interpreter_decode": Space({"BLOCK_N": (16, 32), "splits": (1, 2), "num_warps": (4,),
                                 "num_stages": (1,)}, _decode_default, (tile_fits_keys, _splits_fit)),
}


def family_of(key: DispatchKey) -> str:
    fam = "decode" if key.phase == "decode" else "prefill"
    return f"interpreter_{fam}" if key.interpreter else fam


class TritonRunner(Runner):
    """Prefill/append: the tile-plan kernel on contiguous q/k/v.  Decode: the split-K/V kernel
    over the spec's own cache (paged pages handed out shuffled, tails poisoned with NaN)."""

    def __init__(self, program: ir.Program, shape: Shape, key: DispatchKey, seed: int, max_cells: int):
        import torch
        from attnc.backends.triton import runtime
        self.torch, self.program = torch, program
        self.kernel = runtime.load(program)
        self.device = self.kernel.device
        self.dtype = getattr(torch, runtime.TORCH_DTYPES[program.dtype])
        # the interpreter reads bf16 as garbage: carry bf16-rounded values in float32, as the runtime does
        self.emulate = runtime.interpreted() and self.dtype == torch.bfloat16
        self.carry = torch.float32 if self.emulate else self.dtype
        self.decode = family_of(key).endswith("decode")
        if self.device == "cuda":
            self.synchronization = cuda_event_timer.synchronization
        if self.decode:
            self._init_decode(shape, seed)
        else:
            self._init_prefill(shape, seed, max_cells)

    def default_timer(self) -> Timer:
        return cuda_event_timer if self.device == "cuda" else wall_timer

    def _upload(self, a: np.ndarray):
        t = self.torch.as_tensor(np.ascontiguousarray(a), device=self.device)
        if a.dtype.kind == "f":
            return t.to(self.dtype).to(self.carry)
        return t.to(self.torch.int32) if a.dtype.kind in "iu" else t

    def _host(self, o, lse):
        if self.emulate:
            o = o.to(self.torch.bfloat16)
        return o.float().cpu().numpy(), lse.float().cpu().numpy()

    def prepare(self, cfg: dict):
        return self._prepare_decode(cfg) if self.decode else self._prepare_prefill(cfg)

    # -- prefill / append
    def _init_prefill(self, shape: Shape, seed: int, max_cells: int):
        program = self.program
        arrays = inputs.sample(program, shape.batch, shape.s_q, shape.s_k, seed)
        self.call = call = inputs.validate(program, arrays)
        self.reference = reference_for(program, call, max_cells)
        self.bshd = program.cache.layout is ir.Layout.BSHD
        # logical bhsd views over storage in the spec's layout, as the runtime passes them
        if self.bshd:
            self.q, self.k, self.v = (self._upload(x.transpose(0, 2, 1, 3)).transpose(1, 2)
                                      for x in (call.q, call.k, call.v))
        else:
            self.q, self.k, self.v = (self._upload(x) for x in (call.q, call.k, call.v))
        self.tensors = {n: self._upload(t) for n, t in call.tensors.items()}

    def _prepare_prefill(self, cfg):
        c = self.call
        plan = self.kernel.plan(c.batch, c.s_q, c.s_k, c.tensors, cfg["BLOCK_M"], cfg["BLOCK_N"])
        q, k, v = (x.transpose(1, 2) for x in (self.q, self.k, self.v)) if self.bshd else (self.q, self.k, self.v)
        # the configs are the Triton kernel's
        launch = self.kernel.prepare(q, k, v, plan=plan, engine="triton", num_warps=cfg["num_warps"],
                                     num_stages=cfg["num_stages"], use_tma=bool(cfg.get("use_tma")), **self.tensors)

        def host(r):
            o, lse = r
            return self._host(o.transpose(1, 2) if self.bshd else o, lse)
        return launch, host

    # -- decode
    def _init_decode(self, shape: Shape, seed: int):
        if not hasattr(self.kernel, "decode_plan"):
            raise TuneError("this Triton backend has no split-K/V decode kernel to tune")
        program = self.program
        arrays = inputs.sample_cache(program, [shape.s_k] * shape.batch, [1] * shape.batch, seed)
        call = inputs.validate_cache(program, arrays)
        o, lse = oracle.reference_cache(program, call)
        self.reference = Reference(o, lse, lambda o, lse: (o, lse), "float64 oracle per request, every cell")
        names = {t.name for t in program.tensors}
        self.q = self._upload(arrays["q"])
        self.cache = {n: self._upload(a) for n, a in arrays.items() if n not in names and n not in ("q", "q_lens")}
        self.tensors = {n: self._upload(arrays[n]) for n in names}

    def _prepare_decode(self, cfg):
        plan = self.kernel.decode_plan(self.cache, block_n=cfg["BLOCK_N"], splits=cfg.get("splits"),
                                       tensors=self.tensors)
        launch = self.kernel.prepare_decode(self.q, plan, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                            **self.cache, **self.tensors)  # uploaded once, launched per sample
        return launch, lambda r: self._host(*r)



RUNNER = TritonRunner
