"""Host cost of the public ops' AOT path on a CPU-only machine: ``ultraquant.bench.host`` with the
fake driver of tests/test_runtime.py standing in for libcuda (no GPU, no ctypes launch).

CPU tensors are treated as device 0 of a fake sm_90 GPU, value checks are off as they are for GPU
tensors, self-tests are off, and the manifest lists fake blobs under the exact keys the calls plan.
What remains is the Python around the launch: validation, planning, lookup and argument packing.
Not a timed test (numbers vary with the machine's load): run from the repo root,
``.venv/bin/python benchmarks/lab/host_path_cpu.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gen = Path(tempfile.mkdtemp(prefix="uq_host_")) / "gen"
    os.environ.update(ULTRAQUANT_GENERATED=str(gen), ULTRAQUANT_SELFTEST="0",
                      ULTRAQUANT_CACHE_DIR=str(gen.parent / "cache"))
    os.environ.pop("ULTRAQUANT_REQUIRE_AOT", None)

    from tests.test_runtime import FakeDriver, write_manifest
    from ultraquant import config, validate
    from ultraquant.bench import host
    from ultraquant.kernels import plans
    from ultraquant.runtime import driver, launch, loader

    driver._DRIVER = FakeDriver()
    driver._DRIVER.launch = lambda *a: None  # keep no record: a long run must not grow a list
    launch._DEVICES[0] = driver.DeviceInfo(index=0, arch="sm_90", name="fake", uuid="GPU-0", driver_version=1)
    loader._raw_stream_getter = lambda: (lambda dev: 0)
    launch.plan_device = lambda plan: 0
    validate.values_checkable = lambda *tensors: False  # as for GPU tensors without ULTRAQUANT_CHECK_VALUES
    config.reload()

    p = host.tiny_problem("cpu")
    need = [plans.plan_decode(p["q"], p["cache"], p["table"], p["lens"], host.D ** -0.5, None, None, None,
                              p["out"]).spec,
            plans.plan_store(p["k"], p["k"], p["cache"], p["slots"]).spec]
    write_manifest(gen, specs=need)
    launch.reset()
    res = host.run_host_bench(args.calls, args.repeats, backends=("aot",), device="cpu", sync=lambda: None)
    print(host.format_rows(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
