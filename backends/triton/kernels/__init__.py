"""The Triton backend's kernels: ``@triton.jit`` and ``@gluon.jit`` code only (the host side that
chooses, plans and launches them lives one folder up)."""
