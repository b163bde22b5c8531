"""ggx.compare: one model's graphs on two backends, node by node (`ggx compare`).

    from ggx.compare import compare_model
    report = compare_model("smollm2", a="ref", b="CPU:CPU_REPACK", layers=2)
    print("\\n".join(report.summary()))      # report.ok, report.first_isolated, report.to_dict()

- `model.compare_model`: accumulated and isolated per-node NMSE, the first node beyond its op's
  conformance tolerance, teacher-forced logits by the model criteria, graph capture on vs off;
- `backends.BackendSpec`: `DEVICE[:BUFT]`, where a compared model's weights go;
- `criteria`: the model criteria for two runs' logits;
- `nodes`: the scheduler eval callback that sees every node, and the isolated recomputation;
- `gguf_cut.cut_layers`: a GGUF file cut to its first N layers.
"""
from .backends import BackendSpec
from .criteria import LogitsRow, logits_rows
from .gguf_cut import cut_layers
from .model import CompareReport, GraphsCheck, NodeResult, compare_model

__all__ = ["BackendSpec", "CompareReport", "GraphsCheck", "LogitsRow", "NodeResult", "compare_model", "cut_layers",
           "logits_rows"]
