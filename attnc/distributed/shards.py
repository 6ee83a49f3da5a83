"""One rank's view of a context-parallel plan (:class:`ShardPlan`): shard inputs, gather outputs,
and how the group moves a device's tensors."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import BackendRefused
from ..compiler import ir
from ..compiler.cp import CPPlan
from ..compiler.errors import InputError
from .agree import agree


def _backend_config(group) -> dict[str, str]:
    """The group's backend per device type, e.g. {"cpu": "gloo", "cuda": "nccl"}."""
    get = getattr(dist, "get_backend_config", None)
    text = str(get(group) if get is not None else dist.get_backend(group)).lower()
    if ":" in text:
        return dict(part.split(":", 1) for part in text.split(","))
    return {"cuda": text} if text == "nccl" else {"cpu": text, "cuda": text}


def _pair(x, what: str) -> tuple[int, int] | None:
    if x is None:
        return None
    pair = tuple(x) if isinstance(x, (tuple, list)) else (x, x)
    if len(pair) != 2 or not all(isinstance(n, int) and n > 0 for n in pair):
        raise InputError(f"{what} takes a positive int or a pair of them, got {x!r}")
    return pair


class ShardPlan:
    """A context-parallel plan as one rank holds it: :class:`compiler.cp.CPPlan` plus this rank,
    its group and the mask's tensors; shards inputs and gathers outputs."""

    def __init__(self, cp: CPPlan, rank: int, group, tensors: dict):
        self.cp = cp
        self.rank = rank
        self.group = group
        self.tensors = tensors  # as the caller gave them (the one-rank plain call reads these)
        self.program = cp.program
        self.seq_axis = 1 if cp.program.cache.layout is ir.Layout.BSHD else 2  # of 4-D q, k, v, O
        self._positions = torch.from_numpy(cp.positions(rank))
        self._whole = cp.ranks == 1

    @property
    def ranks(self) -> int:
        return self.cp.ranks

    @property
    def tokens(self) -> int:
        """This rank's tokens (per request)."""
        return int(self._positions.numel())

    @property
    def positions(self) -> torch.Tensor:
        """The absolute positions of this rank's tokens, in shard order (e.g. for rotary embeddings)."""
        return self._positions

    def report(self) -> dict:
        """Per-rank tokens, computed cells and K/V bytes (``CPPlan.report``: ``attnc plan --ranks``)."""
        return self.cp.report()

    def _dim(self, x, dim: int | None) -> int:
        d = (self.seq_axis if x.dim() == 4 else 1) if dim is None else dim
        if not -x.dim() <= d < x.dim():
            raise InputError(f"dim {dim} is outside a tensor of shape {list(x.shape)}")
        return d % x.dim()

    def shard(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor, along ``dim`` (default: the spec
        layout's sequence axis for 4-D q/k/v, else axis 1 as in [B, S, ...] and doc ids [B, S])."""
        d = self._dim(x, dim)
        if x.shape[d] != self.cp.seq_len:
            raise InputError(f"shard: the tensor has {x.shape[d]} entries along dim {d} (shape {list(x.shape)}); "
                             f"the plan is for S = {self.cp.seq_len} tokens")
        if self._whole:
            return x
        return x.index_select(d, self._positions.to(x.device))

    def transport(self, device) -> str:
        """How the group moves tensors of ``device``: "device" (NCCL for CUDA tensors, gloo for CPU
        tensors) or "host" (CUDA tensors over gloo, staged through host memory).  A group that
        can do neither is refused."""
        device = torch.device(device)
        if self._whole:
            return "device"
        config = _backend_config(self.group)
        if device.type == "cuda" and config.get("cuda") == "nccl":
            return "device"
        if config.get("cpu") == "gloo":
            return "host" if device.type != "cpu" else "device"
        raise BackendRefused(f"attnc.distributed: the process group's backend is "
                             f"{','.join(f'{d}:{b}' for d, b in config.items())!r} and q, k, v are on {device}; a "
                             "multi-rank call moves CUDA tensors over NCCL and CPU tensors (or CUDA tensors staged "
                             "through host memory) over gloo: create the group with 'nccl', 'gloo' or "
                             "'cpu:gloo,cuda:nccl'")

    def gather(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """The whole sequence from every rank's shard along ``dim`` (as :meth:`shard`; LSE
        [B, H, S] shards take dim=2), on every rank.  The ranks agree first (``agree``): one
        rank's refusal, or shards of other shapes or dtypes, are every rank's error."""
        d, error, signature = None, None, {}
        try:
            d = self._dim(x, dim)
            if x.shape[d] != self.tokens:
                raise InputError(f"gather: the shard has {x.shape[d]} entries along dim {d}; rank {self.rank} owns "
                                 f"{self.tokens} tokens")
            shape = list(x.shape)
            shape[d] = "tokens"
            signature = {"dim": d, "shape": shape, "dtype": str(x.dtype), "device type": x.device.type}
        except Exception as e:  # noqa: BLE001 (every rank raises it: agree)
            error = e
        agree(self.group, 1 if self._whole else self.ranks, "plan.gather", signature, error)
        if self._whole:
            return x
        longest = int(self.cp.tokens.max())
        pad = list(x.shape)
        pad[d] = longest - self.tokens
        padded = torch.cat([x, x.new_zeros(pad)], dim=d).contiguous()
        if self.transport(x.device) == "host":
            padded = padded.cpu()
        # gloo gathers no bfloat16 in some torch builds ("unsupported ScalarType"): 2-byte floats go
        # over it as float32 (exact); P2P messages are bytes and need no such care
        wire = padded.float() if padded.device.type == "cpu" and padded.element_size() == 2 else padded
        parts = [torch.empty_like(wire) for _ in range(self.ranks)]
        dist.all_gather(parts, wire, group=self.group)
        shape = list(x.shape)
        shape[d] = self.cp.seq_len
        out = x.new_empty(shape)
        for r, part in enumerate(parts):
            n = int(self.cp.tokens[r])
            if n:
                out.index_copy_(d, torch.from_numpy(self.cp.positions(r)).to(x.device),
                                part.narrow(d, 0, n).to(x.device, x.dtype))
        return out
