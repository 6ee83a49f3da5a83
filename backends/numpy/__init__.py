"""numpy backend: the float64 oracle and the generated tiled numpy program."""
from . import oracle, state  # noqa: F401
from .emit import emit  # noqa: F401
from .runtime import Kernel, load  # noqa: F401

NAME = "numpy"
