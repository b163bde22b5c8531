"""Model mode: the default model (or any GGUF file) through the device under test against the
reference backend, node by node (`ggx test-ops -b X --model`, `pytest -p ggx.testing --ggx-model`).

Per-op cases cannot see what only a model shows: real activations (non-zero means, outlier
channels), the model's own views and strides, buckets, copies between backends. `model_check`
runs `ggx.compare.compare_model` with the reference as A and the device (its weights in a chosen
extra buffer type, if any) as B: it passes when no node, recomputed on the device from the
reference's exact inputs, is beyond its op's conformance tolerance and every teacher-forced
logits row meets the model criteria. The default is short (CI runs it per plugin): the model
cut to MODEL_LAYERS layers, a short prompt and MODEL_STEPS decode steps.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from ..backend import Device
from .runner import FAIL, PASS, Result, weight_buffer_type

MODEL = "MODEL"
#: the cut of the model the check runs by default: every kernel of the full model, in seconds
MODEL_LAYERS = 2
MODEL_STEPS = 1


def model_check(device: Device | str, weight_buft: str | None = None, model: str | os.PathLike | None = None,
                layers: int | None = MODEL_LAYERS, n_decode: int = MODEL_STEPS,
                progress: Callable[[str], None] | None = None) -> tuple[Result, object]:
    """(the model check as a suite Result, the ggx.compare CompareReport behind it)."""
    from ..compare import compare_model
    from ..compare.backends import WeightsIn
    from ..compare.model import model_file

    if isinstance(device, Device):
        b = WeightsIn(device, weight_buffer_type(device, weight_buft) if weight_buft else None)
        label = device.name + (f":{weight_buft}" if weight_buft else "")
    else:
        b = label = device + (f":{weight_buft}" if weight_buft else "")
    path = model_file(model, layers)
    rid = f"model:{os.path.basename(path)}"
    report = compare_model(path, "ref", b, n_decode=n_decode, progress=progress)
    if report.ok:
        worst = max((n for n in report.nodes if n.isolated is not None),
                    key=lambda n: n.isolated / max(n.tolerance, 1e-30), default=None)
        note = f"{len(report.nodes)} nodes over {n_decode + 1} steps on {label}"
        if worst is not None:
            note += f", worst isolated {worst.op} NMSE {worst.isolated:.3g} (tolerance {worst.tolerance:g})"
        return Result(rid, MODEL, PASS, note, source="model"), report
    problems = []
    first = report.first_isolated
    if first is not None:
        problems.append("first node beyond its tolerance (isolated): " + first.line())
    problems += [f"logits step {r.step} pos {r.position}: {r.problem()}" for r in report.bad_logits]
    return Result(rid, MODEL, FAIL, "\n".join(problems), source="model"), report
