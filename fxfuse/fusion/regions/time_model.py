"""What a recompute costs in time: FLOPs for convs and matmuls, bytes moved for everything else.

    seconds = flops * SECONDS_PER_FLOP + moved * SECONDS_PER_BYTE + ops * OP_SECONDS

`flops` are FlopCounterMode's counts, `moved` the bytes every op reads and writes
(measure/traffic.py), `ops` how many ops run. A FLOP count alone prices every pointwise op,
copy, pooling and BN-apply at zero, so a region of 16-channel convs at 224² (DLA's stem), whose
BN statistics, BN-apply and ReLU move as much time as its convs compute, looked as cheap as its
convs; the bytes term prices them. The constants were measured on the 2-core CPU machine these
docs are measured on, by timing every op of ResNet-50 and DLA-34 train steps (eager and fxfuse)
and fitting this formula (docs/memory_budgets.md#the-time-model); rerun with

    python benchmarks/time_model.py

Only the ranking's order and the report's estimates use them: what is chosen still meets the
budget, whatever the machine.
"""

from __future__ import annotations

# benchmarks/time_model.py, 2026-11-26, 2 threads of an AVX-512 AMD EPYC, float32, channels_last, batch 8 at
# 224²: the fit priced the four train steps it was fitted on (ResNet-50 and DLA-34, eager and fxfuse) at
# 0.95-1.07x of their ops' measured time (three runs: 435-450 GFLOP/s, 53-61 GB/s). A byte moved costs
# about 7.5 FLOPs. EfficientNet-B0's ops run slower than priced (0.61x: its depthwise convs and
# broadcast multiplies do not stream at these rates); regions.ranking.REGION_TIME_COST covers part.
SECONDS_PER_FLOP = 2.22e-12  # 450 GFLOP/s
SECONDS_PER_BYTE = 1.655e-11  # 60 GB/s read and written
OP_SECONDS = 3.4e-6


def seconds(flops: float, moved: float = 0, ops: float = 0) -> float:
    return flops * SECONDS_PER_FLOP + moved * SECONDS_PER_BYTE + ops * OP_SECONDS
