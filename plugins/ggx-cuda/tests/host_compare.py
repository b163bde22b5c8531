"""`ggx compare` against ggx-cuda's real kernels built for the host (HostKernelDriver), no GPU:

    python plugins/ggx-cuda/tests/host_compare.py [MODEL] [--layers 2] [-n 1] [-o json]

The default model's 2-layer cut, a prompt and one decode step take about three minutes (every
CUDA thread a fiber on one core); prints what `ggx compare -b ref -b CUDA0` prints."""
from __future__ import annotations

import argparse
import json
import sys

from host_driver import HostKernelDriver

from ggx import registry
from ggx.compare import compare_model
from ggx_cuda.device import CudaBackendReg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("-n", "--n-decode", type=int, default=1)
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    args = p.parse_args()
    reg = CudaBackendReg(driver=HostKernelDriver(deferred=True), prefix="EMUCUDA")
    reg.name = "cuda-host-kernels"
    registry.register(reg, name="cuda-host-kernels")
    report = compare_model(args.model, "ref", registry.get_device("EMUCUDA0"), n_decode=args.n_decode,
                           layers=args.layers or None, progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(report.to_dict(), indent=1) if args.output == "json" else "\n".join(report.summary()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
