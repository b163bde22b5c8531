"""What a user sees: GGX_RAY_ADDRESS finds the workers again; without it, the reason; import is inert."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(args: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "GGX_RAY_ADDRESS"} | env
    return subprocess.run(args, env=full, capture_output=True, text=True, timeout=timeout)


def _ggx() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ggx")


def test_importing_the_plugin_neither_starts_nor_joins_a_cluster():
    code = ("import sys, ggx_ray, ggx_ray.plugin, ggx_ray.device, ggx_ray.worker, ggx_ray.cluster; "
            "from ggx import registry; registry.devices(); print('ray' in sys.modules)")
    out = _run([sys.executable, "-c", code], {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_without_a_cluster_ggx_devices_says_why():
    out = _run([_ggx(), "devices", "--json"], {})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    ray = next(p for p in report["plugins"] if p["name"] == "ray")
    assert ray["status"] == "loaded" and "no Ray cluster: set GGX_RAY_ADDRESS" in ray["reason"]
    assert not [d for d in report["devices"] if d["name"].startswith("RAY")]


@pytest.mark.usefixtures("ray_device")  # the workers exist: the new process finds them by name
def test_ggx_devices_finds_the_workers_with_ggx_ray_address(ray_cluster):
    address, env = ray_cluster
    out = _run([_ggx(), "devices", "--json"], env | {"GGX_RAY_ADDRESS": address})
    assert out.returncode == 0, out.stderr
    devices = {d["name"]: d for d in json.loads(out.stdout)["devices"]}
    assert "RAY0" in devices and devices["RAY0"]["description"].startswith("CPU on ")


@pytest.mark.usefixtures("ray_device")
def test_ggx_run_splits_the_layers_and_reports_the_traffic(ray_cluster):
    address, env = ray_cluster
    out = _run([_ggx(), "run", "--device", "RAY0", "--device", "CPU", "-ts", "1,1", "-n", "6",
                "-p", "Hello"],
               env | {"GGX_RAY_ADDRESS": address})
    assert out.returncode == 0, out.stderr
    summary = out.stderr  # the text on stdout, the summary on stderr
    assert out.stdout.startswith("Hello")
    assert "layer split:     RAY0 layers 0-14, CPU layers 15-29 + output" in summary
    assert "moved between devices:" in summary and "per decode step" in summary
