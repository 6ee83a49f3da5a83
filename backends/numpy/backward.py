"""numpy backend: the float64 backward reference (templates/numpy/backward.py.j2).

Generated from the same IR as the kernels: the score statements and their derivatives
(:func:`compiler.autodiff.score_grad`) printed in float64 by the numpy printer.  The oracle's
``reference_backward`` evaluates the same derivatives with the IR interpreter instead, so the
two check each other.  Contiguous calls only (:func:`compiler.inputs.contiguous_only`).
"""
from __future__ import annotations

from attnc.compiler import inputs, ir, sinks
from attnc.compiler.autodiff import derivative, f32_loads, score_grad
from attnc.backends.common import render
from .emit import Source, _spec_context, numpy_expr, shape_docs


def emit_backward(program: ir.Program) -> Source:
    """The module with ``forward(q, k, v, **tensors) -> (o, lse)`` and ``backward(q, k, v, o,
    lse, do, **tensors) -> (dq, dk, dv, dtensors)``, float64, in the spec's layout."""
    inputs.contiguous_only(program)
    p, grad = program, score_grad(program)
    code = lambda e: numpy_expr(e, f64=True)  # noqa: E731
    statements = [
        dict(index=i, number=i + 1, source=ir.format_expr(s), code=code(s),
             dscore_code=code(grad.dscore[i]), dscore_source=ir.format_expr(grad.dscore[i]),
             loads=[dict(tensor=load.tensor, source=ir.format_expr(load), index=[code(x) for x in load.index],
                         code=code(d), derivative_source=ir.format_expr(d))
                    for j, load, d in grad.dloads if j == i])
        for i, s in enumerate(grad.forward)]
    layout = p.cache.layout.value
    sink_loads = [dict(tensor=load.tensor, source=ir.format_expr(load), index=[code(x) for x in load.index],
                       code=code(derivative(p.sink, load)), derivative_source=ir.format_expr(derivative(p.sink, load)))
                  for load in (f32_loads(p.sink) if p.sink is not None else ())]
    read = set(grad.tensors) | set(sinks.tensors_read(p))
    grad_tensors = tuple(t.name for t in p.tensors if t.name in read)
    text = render(
        "numpy", "backward.py.j2", **{**_spec_context(p), "mask_code": code(p.mask),
                                      "sink_code": code(p.sink) if p.sink is not None else None},
        layout=layout, sink_loads=sink_loads,
        statements=statements, grad_tensors=list(grad_tensors), grad_tensors_repr=repr(grad_tensors),
        **shape_docs(p, layout),
    )
    return Source(text, f"{p.name}_numpy_backward", entry="backward", family="backward")
