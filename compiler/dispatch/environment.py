"""The environment coordinate of a dispatch key: what is installed and which device runs."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields
from functools import lru_cache


def distribution_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` from its metadata (nothing is imported)."""
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Environment:
    """The environment coordinate: which code objects can exist and run here (§0x07A).

    Versions come from distribution metadata (no import); the device is probed through torch
    only when the caller does not name it."""

    device_type: str = "cpu"
    compute_capability: int | None = None  # major * 10 + minor (90 = sm_90)
    device_name: str | None = None
    interpreter: bool = False  # TRITON_INTERPRET=1: Triton kernels run on the CPU
    torch: str | None = None
    triton: str | None = None
    cuda_runtime: str | None = None

    @classmethod
    def detect(cls, device_type: str | None = None) -> "Environment":
        return _detect(device_type)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@lru_cache(maxsize=4)
def _detect(device_type: str | None) -> Environment:
    import importlib.util
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    env = {"interpreter": interp, "torch": distribution_version("torch"),
           "triton": distribution_version("triton")}
    if device_type is None:
        device_type = "cpu"
        if not interp and env["torch"] and importlib.util.find_spec("torch") is not None:
            import torch
            if torch.cuda.is_available():
                device_type = "cuda"
    if device_type == "cuda" and env["torch"]:
        # a broken driver leaves the fields unknown, not a crash
        with contextlib.suppress(Exception):
            import torch
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                env.update(compute_capability=10 * major + minor, device_name=torch.cuda.get_device_name(),
                           cuda_runtime=torch.version.cuda)
    return Environment(device_type=device_type, **env)


def run_environment(device_type: str | None = None, backend_request: str = "auto") -> Environment:
    """The environment of a call that runs here: the detected one (or ``device_type``'s), except
    that Triton's CPU interpreter (a test vehicle, ``TRITON_INTERPRET=1``) admits a CPU call only
    when the call forces the triton backend; under ``auto`` a CPU call takes numpy."""
    env = Environment.detect(device_type)
    if env.device_type == "cpu" and env.interpreter and backend_request != "triton":
        from dataclasses import replace
        env = replace(env, interpreter=False)
    return env


_CAPABILITY: dict = {}


def device_capability(device=None) -> int:
    """The compute capability (10 * major + minor) of the CUDA device a call's tensors live on;
    0 under Triton's interpreter (``TRITON_INTERPRET=1``: kernels run on the CPU) or without CUDA.
    A call's ``compute_capability`` coordinate, read before dispatch chooses a backend."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    import torch
    if not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if device is None or getattr(device, "index", None) is None \
        else device.index
    if index not in _CAPABILITY:
        major, minor = torch.cuda.get_device_capability(index)
        _CAPABILITY[index] = 10 * major + minor
    return _CAPABILITY[index]
