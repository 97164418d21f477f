"""fxfuse's float32 error against eager's across the timm zoo, both measured against float64.

    python benchmarks/accuracy_zoo.py [--models resnet18,dla34] [--seeds 0,1,2] [--mode memory] [--threads 1]

One line per model of tests/support/timm_zoo.py (its input shape, each seed, train mode, one
step): the worst ratio fxfuse error / eager error over every output, input gradient,
parameter gradient and running statistic (tests/test_accuracy.py's errors(); an eager
error below FLOOR counts as FLOOR), the tensor it is on, how many tensors fail the test's
criterion (as_accurate: fxfuse <= 2x eager + FLOOR, 4x on tensors that are zero in exact
arithmetic), and the geometric mean of the ratios over the tensors eager gets wrong by more
than FLOOR. Run it under ATEN_CPU_CAPABILITY=... to cover the other CPU kernel builds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from support.timm_zoo import BY_NAME, ZOO, without_dropout  # noqa: E402
from test_accuracy import errors, summarize  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(m.name for m in ZOO))
    p.add_argument("--seeds", default="0")
    p.add_argument("--mode", default="memory")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cap = torch.backends.cpu.get_cpu_capability()
    bad = 0
    for name in args.models.split(","):
        for seed in map(int, args.seeds.split(",")):
            entry = BY_NAME[name]
            torch.manual_seed(seed)
            model = without_dropout(entry.build())
            shape = (entry.batch, 3, entry.size, entry.size)
            x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            start = time.perf_counter()
            try:
                errs = errors(model, x, mode=args.mode, seed=seed)
            except AssertionError as e:  # nothing fused
                print(f"{cap} {name}: skipped ({e})", flush=True)
                continue
            ratio, tensor, failing, geo = summarize(errs)
            bad += bool(failing)
            print(
                f"{cap} {name} {tuple(x.shape)} seed={seed}: worst {ratio:.2f}x on {tensor} "
                f"(eager {errs[tensor][0]:.1e}, fxfuse {errs[tensor][1]:.1e}); geomean {geo:.2f}; "
                f"{len(failing)} of {len(errs)} over 2x"
                + (f" ({', '.join(failing[:3])})" if failing else "")
                + f" [{time.perf_counter() - start:.0f} s]",
                flush=True,
            )
    print(f"{bad} model(s) with a tensor over 2x eager's error")


if __name__ == "__main__":
    main()
