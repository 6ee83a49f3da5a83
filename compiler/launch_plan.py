"""`attnc plan`: a split call planned as the GPU's backend launches it.

The backend that runs split calls on a GPU (``registry.DEVICE_DEFAULT["cuda"]``: Triton) owns the
launch decision -- the engine, the split slots (the caller's, the spec's policy, `attnc tune`'s
winner, ``split = auto``'s rule), the tiles and the workspace it allocates -- in its
``split_choice`` module, which its launch asks too.  This module asks it with device facts and
plans the call (``plan.plan_split``) with the slots it chose, so the plan's capacity and
``workspace_bytes.allocated`` are the launch's, and the report's ``launch`` says how it was decided.

The device facts are this host's (``device="here"``: its GPU, or Triton's interpreter under
TRITON_INTERPRET=1; `attnc tune`'s entries for this host apply) or an assumed GPU's
(``device="sm_90"``: no device is read, nothing is imported beyond numpy, no tuning cache
applies, and the report lists what was assumed).  Without a backend that declares a launch
decision, the plan is the spec's policy alone.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import ir
from .analysis.splits import from_ir
from .dispatch.registry import backend_module, device_default
from .plan import DEFAULT_SMS, SplitPlan, plan_split


def plan_launch(program: ir.Program, layout, q_lens=None, *, device: str | None = None,
                num_sms: int | None = None) -> SplitPlan:
    """The split plan of a call of ``program`` over ``layout`` with ``q_lens`` query rows per
    request (default: one, decode), as the GPU backend launches it on ``device`` ("here", "sm_XY";
    None: here under Triton's interpreter, else sm_90) with ``num_sms`` SMs (None: the device's)."""
    q = np.ones(layout.kv_lens.size, np.int64) if q_lens is None else np.asarray(q_lens, np.int64)
    name = device_default("cuda")
    chooser = backend_module(name, "split_choice")
    if chooser is None:
        return plan_split(program, layout, q, policy=from_ir(program.split), num_sms=num_sms or DEFAULT_SMS,
                          block_rows=None)
    facts = chooser.device_facts(device, num_sms)
    kv = np.asarray(layout.kv_lens, np.int64)
    choice = chooser.choose(program, kv, q, facts, one_row=bool(q.size and (q == 1).all()))
    if choice.refusal:
        plan = plan_split(program, layout, q, policy=from_ir(program.split), num_sms=facts.num_sms, block_rows=None)
        launch = {"backend": name, "refused": choice.refusal, "device": facts.to_json(),
                  "assumed": list(choice.assumed)}
    else:
        plan = plan_split(program, layout, q, policy=choice.plan_policy(), num_sms=facts.num_sms, block_rows=None)
        launch = {"backend": name, **choice.report(program, plan.total_q)}
    return replace(plan, launch=launch)
