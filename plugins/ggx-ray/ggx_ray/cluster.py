"""The driver's side of the cluster: joining it, one worker actor per node, and `Link`, the
ordered, time-bounded, typed connection to one worker.

Workers are detached named actors (namespace "ggx", name "ggx-worker-<node id>"), pinned to their
node and holding no CPU resource (they compute with the node's cores when asked, and never wait
for a slot): a second connect, from this driver or another, finds them by name; a worker that
died is started again.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggx.errors import GGXDeviceError, GGXError

from .worker import PROTOCOL, Worker

NAMESPACE = "ggx"
NO_CLUSTER = "no Ray cluster: set GGX_RAY_ADDRESS (or call ggx_ray.connect(address))"
#: Seconds a call may take before its device is reported unresponsive (GGX_RAY_TIMEOUT).
DEFAULT_TIMEOUT = 120.0


def address_from_env() -> str | None:
    return os.environ.get("GGX_RAY_ADDRESS") or None


def timeout_from_env() -> float:
    raw = os.environ.get("GGX_RAY_TIMEOUT")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise GGXDeviceError(f"GGX_RAY_TIMEOUT={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise GGXDeviceError(f"GGX_RAY_TIMEOUT={raw!r} must be positive")
    return value


@dataclass
class LinkStats:
    """What crossed one link (bytes of tensor data; calls submitted)."""

    n_calls: int = 0
    bytes_sent: int = 0  # writes and graph inputs
    bytes_received: int = 0  # reads and graph results
    weight_bytes_sent: int = 0  # bytes the hash cache did not have


class Link:
    """One worker as the driver sees it. Calls go in submission order (Ray runs one caller's
    calls to an actor in order); writes the host makes are queued and travel with the next call.
    Every wait is bounded by `timeout`; a dead worker marks the link lost, and every later use
    raises GGXDeviceError at once (`ggx_ray.connect()` attaches a new worker)."""

    def __init__(self, actor: Any, name: str, node_id: str, info: dict, timeout: float):
        self.actor = actor
        self.name = name  # for messages: "worker on <host> (node <id>)"
        self.node_id = node_id
        self.info = info
        self.session: str = info["session"]
        self.timeout = timeout
        self.lost: str | None = None
        self.pending: list[tuple[int, int, np.ndarray]] = []
        self.exports: Any = None  # the last compute's reference: its sinks' bytes, until the next call
        self.unchecked: list[Any] = []  # calls nobody waits for (writes, copies): checked at the next wait
        self.stats = LinkStats()

    def check(self) -> None:
        if self.lost is not None:
            raise GGXDeviceError(f"{self.name} is lost ({self.lost}); reconnect with ggx_ray.connect()")

    def queue_write(self, buffer_id: int, offset: int, data: np.ndarray) -> None:
        """A host write, ordered before every later call (the bytes are copied now)."""
        self.pending.append((buffer_id, offset, np.array(data, dtype=np.uint8, copy=True).reshape(-1)))
        self.stats.bytes_sent += data.nbytes
        self.exports = None

    def take_writes(self) -> list[tuple[int, int, np.ndarray]]:
        writes, self.pending = self.pending, []
        return writes

    def submit(self, method: str, *args: Any, checked: bool = False) -> Any:
        """Queue a call; returns its object reference at once. `checked`: nobody will wait for
        this call, so its failure is raised by the next `wait` (it ran before what that waits for)."""
        self.check()
        if self.pending and method != "compute":
            self.unchecked.append(self.actor.write_many.remote(self.take_writes()))
            self.stats.n_calls += 1
        self.exports = None
        self.stats.n_calls += 1
        try:
            ref = getattr(self.actor, method).remote(*args)
        except Exception as e:  # noqa: BLE001 - a handle whose actor is gone fails here
            raise self._lost(e) from e
        if checked:
            self.unchecked.append(ref)
        return ref

    def call(self, method: str, *args: Any) -> Any:
        return self.wait(self.submit(method, *args))

    def wait(self, ref: Any) -> Any:
        """The result of a call, within `timeout` seconds; failures as GGXError."""
        import ray
        from ray import exceptions as rx

        self.check()
        try:
            out = ray.get(ref, timeout=self.timeout)
            if self.unchecked:  # done before `ref`: Ray runs one caller's calls in order
                earlier, self.unchecked = self.unchecked, []
                ray.get(earlier, timeout=self.timeout)
            return out
        except rx.GetTimeoutError:
            raise GGXDeviceError(f"{self.name}: no answer within {self.timeout:g} s (GGX_RAY_TIMEOUT)") from None
        except rx.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, GGXError):
                raise cause from None
            if isinstance(cause, rx.RayActorError):
                raise self._lost(cause) from None
            raise GGXDeviceError(f"{self.name}: {type(cause or e).__name__}: {cause or e}"[:1000]) from None
        except (rx.RayActorError, rx.ObjectLostError) as e:
            raise self._lost(e) from None

    def _lost(self, e: BaseException) -> GGXDeviceError:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self.lost = f"{type(e).__name__}: {first_line}"[:300]
        return GGXDeviceError(f"{self.name} died or is unreachable ({self.lost}); reconnect with ggx_ray.connect()")


def _actor_class() -> Any:
    import ray

    return ray.remote(Worker)


def join(address: str | None) -> None:
    """Join the cluster at `address` unless this process already has (never starts one)."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        raise GGXDeviceError(NO_CLUSTER)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
    except Exception as e:  # noqa: BLE001 - ConnectionError, an authentication failure, ...
        raise GGXDeviceError(f"cannot join the Ray cluster at {address}: {type(e).__name__}: {e}"[:600]) from e


def start_workers(timeout: float) -> list[Link]:
    """One worker per alive node (found by name, else started), each answering `hello`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    cls = _actor_class()
    links = []
    for n in nodes:
        node_id = n["NodeID"]
        actor = cls.options(
            name=f"ggx-worker-{node_id[:16]}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        link = Link(actor, f"ggx worker on {n['NodeManagerAddress']} (node {node_id[:8]})", node_id,
                    {"session": "?"}, timeout)
        info = link.wait(actor.hello.remote())
        if info.get("protocol") != PROTOCOL:
            raise GGXDeviceError(f"{link.name} speaks protocol {info.get('protocol')}, this driver {PROTOCOL}: "
                                 "install the same ggx-ray on every node")
        link.info, link.session = info, info["session"]
        links.append(link)
    return links


def connect(address: str | None = None, timeout: float | None = None) -> list:
    """Join the Ray cluster at `address` (default: GGX_RAY_ADDRESS, or the cluster this process
    joined with ray.init), find or start one worker per node, and list their devices in the ggx
    registry (RAY0, RAY1, ...). Called again after a worker died, it attaches the devices to a
    new worker (buffers and streams of the old one raise GGXDeviceError). Returns the devices."""
    from ggx import registry

    from .plugin import backend_reg

    join(address or address_from_env())
    devices = backend_reg().adopt(start_workers(timeout or timeout_from_env()))
    backend_reg().note = ""
    registry.refresh_plugin("ray")
    return devices


def connect_if_configured(reg: Any) -> str:
    """At plugin load: connect when GGX_RAY_ADDRESS is set or ray.init was called; else, or when
    that fails, the reason no device is listed (shown by `ggx devices`)."""
    import sys

    address = address_from_env()
    initialized = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if address is None and not initialized:
        return NO_CLUSTER
    try:
        join(address)
        reg.adopt(start_workers(timeout_from_env()))
    except GGXError as e:
        return str(e)
    return ""
