"""Launching a compiled Triton kernel straight through its C launcher (``raw_launch``), where the
Triton at hand is one whose calling convention this module knows (3.6), so that a launch after the
first costs the C call and not Triton's Python wrapper: the launch layer (``launch.Launcher``)
decides when, and falls back to the compiled kernel's ``run`` wherever ``raw_launch`` returns None.
This is the one module that knows Triton's launcher internals."""


def hooked(hook) -> bool:
    """Whether a Triton launch hook does anything: a function, or a chain (3.6's ``HookChain``) with calls."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launches_hooked(runtime) -> bool:
    """Whether a tool hooks Triton's launches (``triton.knobs.runtime``'s enter or exit hook does
    anything): then a launch takes the compiled kernel's ``run``, which calls them, not the raw one."""
    return hooked(runtime.launch_enter_hook) or hooked(runtime.launch_exit_hook)


RAW_DESCRIPTORS = 32  # TMA descriptors a raw launch keeps encoded (then it starts over)


class Encoded(list):
    """A TMA descriptor argument already encoded for a raw launch ([CUtensorMap, *shape, *strides],
    ``launch.encode``): a bound call keeps these per address (``bound.py``) and hands them over as
    they are."""
    __slots__ = ()


class TensorView:
    """What a raw launch reads of a TMA descriptor argument (``raw_launch``): a contiguous tensor's
    address and its [-1, cols] shape and strides, made per call (for O, new each call)."""
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, t, cols: int):
        self.base, self.shape, self.strides, self.padding = t, (t.numel() // cols, cols), (cols, 1), "zero"


def raw_launch(kernel):
    """``launch(grid3, stream, args)`` of a compiled kernel straight through its C launcher, where
    the Triton at hand is one whose launcher this knows (3.6: ``CudaLauncher`` calling the C
    ``launch`` with 13 leading arguments, through a wrapper that turns each TensorDescriptor
    argument into an encoded CUtensorMap and its shape and strides); else None, and the launch
    goes through ``kernel.run``.  What it saves per launch: the wrapper's walk over every
    argument and a ``cuTensorMapEncodeTiled`` per descriptor -- an encoding is kept per (address,
    shape, strides), holding no tensor.  The same arguments reach the same C function; kernels
    with scratch buffers keep the wrapper."""
    try:
        from triton.backends.nvidia import driver as nv
    except ImportError:  # pragma: no cover - not an NVIDIA Triton
        return None
    run = kernel.run
    if (getattr(nv, "_BASE_ARGS_FORMAT_LEN", None) != 13 or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0 or not hasattr(run, "launch_pdl")):
        return None
    wrapped = run.launch
    code, cells = getattr(wrapped, "__code__", None), getattr(wrapped, "__closure__", None)
    if code is None:  # no descriptor arguments: the C function itself
        c_launch, positions, metas = wrapped, (), ()
    else:
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells or ())))
        if set(free) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or not callable(
                getattr(nv, "make_tensordesc_arg", None)):
            return None
        c_launch = free["launcher"]
        positions = tuple(sorted(free["tensordesc_indices"]))
        metas = tuple(free["tensordesc_meta"] or ())
        if len(metas) != len(positions) or None in metas:  # (descriptors decomposed in the frontend: no encoding)
            return None
    head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
            None, None, None)
    encoded: dict = {}  # (position, address, shape, strides, padding) -> [CUtensorMap, *shape, *strides]

    def launch(g, stream, args):
        final = [g[0], g[1], g[2], stream, *head]
        prev = 0
        for p, meta in zip(positions, metas):
            final.extend(args[prev:p])
            desc = args[p]
            if type(desc) is Encoded:
                final.extend(desc)
                prev = p + 1
                continue
            key = (p, desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding)
            hit = encoded.get(key)
            if hit is None:
                if len(encoded) >= RAW_DESCRIPTORS:
                    encoded.clear()
                hit = encoded[key] = nv.make_tensordesc_arg(desc, meta)
            final.extend(hit)
            prev = p + 1
        final.extend(args[prev:])
        c_launch(*final)

    def encode(p: int, desc) -> Encoded:
        """The encoding of descriptor argument ``p`` (a position of ``positions``) of ``desc``."""
        return Encoded(nv.make_tensordesc_arg(desc, metas[positions.index(p)]))
    launch.encode, launch.positions = encode, positions
    return launch
