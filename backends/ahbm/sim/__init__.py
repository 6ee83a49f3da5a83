"""AHBM mesh simulator (DESIGN §5 "ahbm", ADR-0060): PEs with DMA/GEMM/MATH engines on a
2-D mesh of CUBEs, IPCQ N/S/E/W queues, per-PE HBM and 1 MiB scratch, greenlet `tl` kernels
under a deterministic discrete-event scheduler, and an op log. See README.md here."""
from .errors import (  # noqa: F401
    DeadlockError, HbmError, ScratchOverflowError, ScratchUseAfterFreeError, ShapeError,
    SimError, TopologyError,
)
from .latency import LatencyModel  # noqa: F401
from .machine import Machine, PerPE, RunResult  # noqa: F401
from .memory import Ptr  # noqa: F401
from .mesh import DIRECTIONS, OPPOSITE, MeshConfig, Topology  # noqa: F401
from .oplog import OpLog, OpRecord  # noqa: F401
from .pe import ENGINES  # noqa: F401
from .tensor import AsyncHandle, TensorHandle  # noqa: F401
from .tl import Tl  # noqa: F401
from .tree import tree_children, tree_levels, tree_parent, tree_placement, tree_root  # noqa: F401
