"""The host side of FlashDecoding++'s guarded shared shift (``kernels/shared_shift.py``): the
four launches of a shared-shift split call."""
from attnc.compiler.errors import PlanError

from .admission import shared_shift_refusal
from .kernels.shared_shift import LOG2E, _fallback_combine, _fallback_split, _shift_combine, _shift_split
from .launch import Launcher, qk_scale, row_sinks, sink_constexprs, spec_constexprs, spec_key
from .workspace import next_power_of_2, shift_layout


class ShiftLaunch:
    """The four launches of a shared-shift split call with one launch config (warps, stages):
    ``__call__(q, k_cache, v_cache, plan, arrays, ts, out, lse, workspace)``, as
    ``launch.SplitLaunch``.  ``shift`` is the spec's ``ir.SharedShift``."""

    KERNELS = {"split": _shift_split, "combine": _shift_combine, "fallback_split": _fallback_split,
               "fallback_combine": _fallback_combine}

    def __init__(self, module, shift, num_warps: int = 4, num_stages: int = 2):
        self.module, self.shift = module, shift
        self.num_warps, self.num_stages = num_warps, num_stages
        self._launchers: dict = {}

    def _launcher(self, which, constexprs):
        key = (which, tuple(sorted((n, v) for n, v in constexprs.items())))
        lz = self._launchers.get(key)
        if lz is None:
            spec = spec_constexprs(self.module)
            if which.endswith("split"):
                lz = Launcher(self.KERNELS[which], {**constexprs, **spec}, num_warps=self.num_warps,
                              num_stages=self.num_stages)
            else:
                keep = {n: spec[n] for n in ("H_Q", "D_V", "D_V_PAD")}
                lz = Launcher(self.KERNELS[which], {**constexprs, **keep, **{"HAS_SINK": sink_constexprs(
                    self.module)["HAS_SINK"]}}, num_warps=4)
            self._launchers[key] = lz
        return lz

    def fields(self, workspace, total_q: int, s_cap: int) -> dict:
        """The workspace's fields as typed views (the layout of :func:`workspace.shift_layout`)."""
        import torch
        spec = self.module.SPEC
        _, fields, size = shift_layout(total_q, s_cap, spec["H_Q"], spec["D_V"])
        if workspace.dtype != torch.uint8 or workspace.numel() < size:
            raise PlanError(f"workspace: {workspace.numel()} {workspace.dtype} elements; this call needs {size} uint8")
        out = {}
        for name, (off, count) in fields.items():
            dtype = torch.float32 if name in ("o", "m", "l") else torch.uint8
            out[name] = workspace[off:off + count * (4 if dtype is torch.float32 else 1)].view(dtype)
        return out

    marks = False  # (four launches write LSE: the caller marks the non-finite flag with a launch of its own)

    def __call__(self, q, k_cache, v_cache, plan: dict, arrays: dict, ts: tuple, out, lse, workspace, flag=None):
        import torch
        spec = self.module.SPEC
        total_q = q.shape[0]
        if total_q == 0:
            return out, lse
        if plan.get("bounded"):
            raise PlanError(shared_shift_refusal(plan["policy"].split(" -> ")[0]))
        s_cap = plan["splits"]
        f = self.fields(workspace, total_q, s_cap)
        block_q = plan["block_q"]
        ks, vs = plan["k_strides"], plan["v_strides"]
        g_pad = max(next_power_of_2(spec["GROUP"]), 16 // block_q)
        walk = dict(CACHE=plan["cache"], PAGE_SIZE=plan["page_size"], ONE_ROW=bool(plan["one_row"]), BLOCK_Q=block_q,
                    BLOCK_N=plan["block_n"], G_PAD=g_pad)
        common = (*q.stride(), *ks, *vs, arrays["kv_lens"], arrays["qo_indptr"], arrays["tile_req"],
                  arrays["tile_row0"], arrays["base"], arrays["table"], plan["table_stride"], arrays["entry_ptr"],
                  arrays["blocks"], arrays["partial"], ts, s_cap, qk_scale(self.module))
        aligned = (q.data_ptr() % 16 == 0, k_cache.data_ptr() % 16 == 0, v_cache.data_ptr() % 16 == 0,
                   workspace.data_ptr() % 16 == 0)
        key = (aligned, spec_key(q.stride() + tuple(ks) + tuple(vs) + (plan["table_stride"], s_cap)), spec_key(ts))
        grid = (s_cap, plan["tiles"] * spec["H_KV"])
        sh = self.shift
        producer = self._launcher("split", dict(walk, P_F32=v_cache.dtype == torch.float16))
        producer.launch(grid, (q, k_cache, v_cache, f["o"], f["l"], f["valid"], f["guard"], *common,
                               sh.phi * LOG2E, sh.lower * LOG2E, sh.upper * LOG2E), key)
        pad = max(2, next_power_of_2(s_cap))
        okey = (aligned[3], out.data_ptr() % 16 == 0, spec_key(out.stride() + (s_cap,)))
        sinks = row_sinks(self.module, self._launchers, total_q, arrays, ts, lse)  # (lse: unread, no sink)
        combine = self._launcher("combine", dict(SPLITS_PAD=pad))
        combine.launch((total_q * spec["H_Q"],), (f["o"], f["l"], f["valid"], f["guard"], f["need"], out, lse,
                                                   *out.stride(), s_cap, float(sh.phi), sinks, float(sh.lower),
                                                   float(sh.upper)), okey)
        fallback = self._launcher("fallback_split", dict(walk, ABI_MLU=True))
        fallback.launch(grid, (f["need"], q, k_cache, v_cache, f["o"], f["m"], f["l"], f["valid"], *common), key)
        merge = self._launcher("fallback_combine", dict(ABI_MLU=True, SPLITS_PAD=pad))
        merge.launch((total_q * spec["H_Q"],), (f["need"], f["o"], f["m"], f["l"], f["valid"], out, lse,
                                                *out.stride(), s_cap, sinks), okey)
        return out, lse
