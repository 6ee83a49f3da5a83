"""AHBM backend (DESIGN §5 "ahbm", ADR-0060): greenlet `tl` programs generated from the IR and
the plan, run on the mesh simulator in `sim/` (see sim/README.md)."""
from .emit import emit  # noqa: F401
from .runtime import Kernel, Run, load  # noqa: F401

NAME = "ahbm"
