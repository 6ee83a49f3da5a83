"""numpy backend: the generated tiled and split numpy programs (the float64 oracle they are
checked against is the compiler's, `compiler/oracle.py`)."""
from . import state  # noqa: F401
from .emit import emit  # noqa: F401
from .runtime import Kernel, load  # noqa: F401

NAME = "numpy"
