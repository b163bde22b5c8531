"""The opt-in pytest plugin: the conformance suite as pytest cases.

    pytest -p ggx.testing --ggx-backend NAME [--ggx-op OP] [--ggx-type TYPE] [--ggx-buft BUFT]

adds one pytest item per suite item for each `--ggx-backend`, with readable ids::

    ggx-conformance[cpu]::MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256)
    ggx-conformance[cpu]::MUL_MAT(ggml=mul_mat_q4_0_K256_M13_N1)
    ggx-conformance[cpu]::contract:round_trip

Cases the device does not support are reported as skipped ("not supported: ..."), never as passed.
`--ggx-buft CPU_REPACK` runs the MUL_MAT / MUL_MAT_ID cases with their weights in that extra buffer
type (ids `ggx-conformance[cpu,CPU_REPACK]::...`). The terminal summary lists the skips per op and
every tolerance bound of the device's own that a case was judged by (`Device.max_nmse_err`).
`--ggx-model [MODEL]` runs model mode instead (ggx.conformance.model): one item per backend,
`ggx-conformance[cpu]::model:<file>`, the model (default: the default model cut to
`--ggx-model-layers`, 2) through the device against the reference, node by node.
The plugin is deliberately not registered under the `pytest11` entry point: it loads only when
asked for with `-p ggx.testing` (or `pytest_plugins = ["ggx.testing"]` in a conftest), so it
never intrudes on unrelated test runs. It also provides the `ggx_device` fixture (the device of
the first --ggx-backend) for a plugin's own tests.
"""
from __future__ import annotations

from collections import Counter

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ggx", "ggx conformance suite")
    group.addoption("--ggx-backend", action="append", default=[], metavar="NAME",
                    help="run the ggx conformance suite against this device (repeatable)")
    group.addoption("--ggx-op", action="append", default=[], metavar="OP",
                    help="only cases of this op (repeatable), e.g. MUL_MAT or CONTRACT")
    group.addoption("--ggx-type", action="append", default=[], metavar="TYPE",
                    help="only cases involving this type (repeatable), e.g. q4_0")
    group.addoption("--ggx-buft", default=None, metavar="BUFT",
                    help="put the weights of MUL_MAT / MUL_MAT_ID cases in this extra buffer type of the "
                         "device (e.g. CPU_REPACK); only those cases run")
    group.addoption("--ggx-model", nargs="?", const="", default=None, metavar="MODEL",
                    help="model mode: the model (default: the default model) through each backend against the "
                         "reference, node by node, instead of the op cases")
    group.addoption("--ggx-model-layers", type=int, default=None, metavar="N",
                    help="model mode: cut the model to its first N layers (default 2; 0: the whole model)")
    group.addoption("--ggx-model-steps", type=int, default=None, metavar="N",
                    help="model mode: decode steps after the prompt (default 1)")


class ConformanceFailure(AssertionError):
    """A suite item failed; the message is the suite's."""


class ConformanceItem(pytest.Item):
    """One op case, golden case or contract check against one device."""

    def __init__(self, *, suite, entry, **kwargs):
        super().__init__(**kwargs)
        self.suite = suite
        self.entry = entry

    def runtest(self) -> None:
        from .conformance.runner import FAIL, SKIP

        r = self.suite.run_item(self.entry)
        self.config.stash.setdefault(_SKIPS, Counter())
        if r.override is not None:
            self.config.stash.setdefault(_OVERRIDES, {})[(self.suite.device.name, str(r.override))] = None
        if r.status == SKIP:
            self.config.stash[_SKIPS][(self.suite.device.name, r.op)] += 1
            pytest.skip(r.message)
        if r.status == FAIL:
            raise ConformanceFailure(r.message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.name} on {self.suite.device.name}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"ggx conformance [{self.suite.device.name}] {self.name}"


class ModelItem(pytest.Item):
    """Model mode against one device (ggx.conformance.model)."""

    def __init__(self, *, device, buft, model, layers, steps, **kwargs):
        super().__init__(**kwargs)
        self.device, self.buft, self.model, self.layers, self.steps = device, buft, model, layers, steps

    def runtest(self) -> None:
        from .conformance.model import model_check
        from .conformance.runner import FAIL

        r, _ = model_check(self.device, self.buft, self.model, self.layers, self.steps)
        if r.status == FAIL:
            raise ConformanceFailure(r.message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.name} on {self.device}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"ggx model mode [{self.device}] {self.name}"


class ConformanceSuite(pytest.Collector):
    """All suite items for one device."""

    def __init__(self, *, suite, ops, types, **kwargs):
        super().__init__(**kwargs)
        self.suite = suite
        self.ops = ops
        self.types = types

    def collect(self):
        from .conformance import item_id

        for entry in self.suite.items(self.ops or None, self.types or None):
            yield ConformanceItem.from_parent(self, name=item_id(entry), suite=self.suite, entry=entry)


_SKIPS = pytest.StashKey[Counter]()
_OVERRIDES = pytest.StashKey[dict]()  # (device, override as printed) -> None, in run order


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so they apply to these items too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    from .conformance import Suite
    from .errors import GGXError

    buft = config.getoption("ggx_buft")
    model = config.getoption("ggx_model")
    if model is not None:
        from .conformance.model import MODEL_LAYERS, MODEL_STEPS

        layers = config.getoption("ggx_model_layers")
        steps = config.getoption("ggx_model_steps")
        for name in config.getoption("ggx_backend"):
            try:
                Suite(name, weight_buft=buft)  # an unknown device or buffer type: a usage error now
            except GGXError as e:
                raise pytest.UsageError(f"--ggx-backend {name}" + (f" --ggx-buft {buft}" if buft else "")
                                        + f": {e}") from e
            label = f"ggx-conformance[{name}{',' + buft if buft else ''}]"
            items.append(ModelItem.from_parent(session, name=f"{label}::model", nodeid=f"{label}::model",
                                               device=name, buft=buft, model=model or None,
                                               layers=MODEL_LAYERS if layers is None else (layers or None),
                                               steps=MODEL_STEPS if steps is None else steps))
        return
    for name in config.getoption("ggx_backend"):
        try:
            suite = Suite(name, weight_buft=buft)
        except GGXError as e:
            raise pytest.UsageError(f"--ggx-backend {name}" + (f" --ggx-buft {buft}" if buft else "") + f": {e}") from e
        label = f"ggx-conformance[{name}{',' + suite.weight_buft.name if buft else ''}]"
        col = ConformanceSuite.from_parent(session, name=label, nodeid=label, suite=suite,
                                           ops=config.getoption("ggx_op"), types=config.getoption("ggx_type"))
        items.extend(col.collect())


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    skips = config.stash.get(_SKIPS, None)
    if skips:
        terminalreporter.section("ggx conformance: skipped (not supported)")
        for (device, op), n in sorted(skips.items()):
            terminalreporter.write_line(f"{device}: {op} {n}")
    overrides = config.stash.get(_OVERRIDES, None)
    if overrides:
        terminalreporter.section("ggx conformance: tolerance overrides (the device's own bounds)")
        for device, override in overrides:
            terminalreporter.write_line(f"{device}: {override}")


@pytest.fixture
def ggx_device(request: pytest.FixtureRequest):
    """The device named by the first --ggx-backend."""
    from . import registry

    names = request.config.getoption("ggx_backend")
    if not names:
        raise pytest.UsageError("the ggx_device fixture needs --ggx-backend NAME")
    return registry.get_device(names[0])
