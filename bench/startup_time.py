"""Engine start-up time with an empty and with a warm Triton kernel cache (what a container pays without
its /cache volume). Each start is a fresh process, as a new container would be.

    python bench/startup_time.py --shape qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from workloads import shape_dir  # noqa: E402

_START = """
import time
start = time.perf_counter()
from engine import LLM
LLM({model!r}, load_format="dummy", max_model_len=4096)
print("STARTUP_S", time.perf_counter() - start)
"""


def start_once(model: str, cache_dir: str) -> float:
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", _START.format(model=model)], capture_output=True, text=True,
                          env=env, cwd=BENCH.parent, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("STARTUP_S")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    args = parser.parse_args()
    model = str(shape_dir(args.shape))
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        cold = start_once(model, cache)
        warm = start_once(model, cache)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "cold_s": cold, "warm_s": warm}
    print(json.dumps(record))
    print(f"{args.shape}: start-up {cold:.1f} s with an empty Triton cache, {warm:.1f} s with a warm one")


if __name__ == "__main__":
    main()
