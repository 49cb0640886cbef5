"""The planner at 1000-GPU scale: a day of trace-shaped traffic planned per window and simulated (no servers).

    python -m benchmarks.planner_trace [--plot docs/planner/trace-day.png] [--repetitions 3] [pd-plan trace options]

Runs ``pd-plan trace`` on the documented case (docs/planner.md, "A day of trace-shaped traffic"): the example
profile, ISL lognormal (median 2048, sigma 0.8), OSL lognormal (median 256, sigma 1.0), a diurnal rate peaking at
5000 requests/s with a peak/trough ratio of 3, TTFT 1 s and TPOT 20 ms at p90, one GPU per instance, so the peak
plan is about 1000 GPUs. Options after the benchmark's own are passed to ``pd-plan trace`` and override these.
It repeats the run ``--repetitions`` times (the same seed: the same plan and result, only the time differs) and
prints, as its last stdout line, the comparison of the first run with the median wall time of all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

from planner import cli

ROOT = Path(__file__).resolve().parent.parent
CASE = [
    "--profile", str(ROOT / "docs" / "planner" / "example-profile.json"),
    "--ttft", "1", "--tpot", "0.02", "--percentile", "90",
    "--isl-median", "2048", "--isl-sigma", "0.8", "--osl-median", "256", "--osl-sigma", "1.0",
    "--peak-rate", "5000", "--peak-to-trough", "3", "--peak-hour", "14",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, help="write the day's PNG here (first run)")
    parser.add_argument("--repetitions", type=int, default=3, help="timed runs (median reported)")
    args, passthrough = parser.parse_known_args(argv)
    walls: list[float] = []
    result: dict[str, object] = {}
    for run in range(max(1, args.repetitions)):
        command = ["trace", *CASE, *passthrough, "--json"]
        if run == 0 and args.plot:
            command += ["--plot", str(args.plot)]
        out = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = cli.main(command)
        walls.append(time.perf_counter() - started)
        if code != 0:
            print(out.getvalue(), end="")
            return code
        result = result or json.loads(out.getvalue().strip().splitlines()[-1])
        print(f"run {run + 1}: {walls[-1]:.2f} s", file=sys.stderr)
    result["wall_s_median"] = statistics.median(walls)
    result["wall_s"] = walls
    result["command"] = "pd-plan " + " ".join(["trace", *CASE, *passthrough]).replace(f"{ROOT}/", "")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
