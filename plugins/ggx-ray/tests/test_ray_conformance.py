"""The conformance suite on RAY0: the CPU device of this machine's worker, reached through Ray."""
from __future__ import annotations

from ggx.conformance import PASS, SKIP, Suite


def test_ray0_passes_the_suite(ray_device):
    suite = Suite(ray_device)
    report = suite.run(suite.items())
    failures = "\n".join(f"{r.id}: {r.message}" for r in report.failures)
    assert report.ok, failures
    assert report.count(PASS) >= 400
    # the only skips: Q5_K cases, a type ggx-cpu does not compute (its supports_op declines them)
    skipped = [r.id for r in report.results if r.status == SKIP]
    assert all("q5_K" in name for name in skipped), report.details()


def test_ray0_describes_its_remote_device(ray_device):
    assert ray_device.name == "RAY0"
    assert ray_device.description.startswith("CPU on ")
    free, total = ray_device.memory()
    assert 0 < free <= total
    assert ray_device.caps.async_ and ray_device.caps.events
