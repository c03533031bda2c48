"""Check ``edgetrain profile``'s GFLOP/s against a plain torch matmul loop timed by hand.

Runs ``edgetrain profile --json`` in a subprocess, then, separately and with its
own code (nothing from ``edge.profiling.device``), times a plain loop of ``n x n`` fp32
matmuls: total FLOPs (``2 n^3`` each) over total wall time. The two alternate for
``--rounds`` rounds; the medians of each side and their ratio (profile / plain)
are printed. The profile is acceptable when the ratio lies within a factor 1.5
either way; the exit status is 1 when it does not.

    .venv/bin/python bench/profile_check.py [--rounds 5] [--seconds 2] [--size 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

FACTOR = 1.5


def profile_gflops(command: list[str], seconds: float) -> dict[str, Any]:
    """Run ``edgetrain profile --json`` and return its parsed output."""
    result = subprocess.run(
        [*command, "profile", "--json", "--seconds", str(seconds)],
        cwd=Path(__file__).resolve().parents[1],  # the checkout's packages, not a stale install
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        sys.exit(f"edgetrain profile failed ({result.returncode}): {result.stderr.strip()}")
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def plain_loop_gflops(size: int, seconds: float) -> dict[str, Any]:
    """Time back-to-back fp32 matmuls for about ``seconds``: total FLOPs / total time."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    for _ in range(3):  # warm-up
        torch.mm(a, b)
    iterations = 0
    start = time.perf_counter()
    while True:
        torch.mm(a, b)
        iterations += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and iterations >= 3:
            break
    return {
        "gflops": 2.0 * size**3 * iterations / elapsed / 1e9,
        "size": size,
        "iterations": iterations,
        "seconds": elapsed,
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget of each side")
    parser.add_argument("--size", type=int, default=1024, help="matmul size n of the plain loop")
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating (profile, plain) pairs to run"
    )
    parser.add_argument(
        "--edgetrain",
        default=f"{shlex.quote(sys.executable)} -m edgetrain.cli",
        help="command that runs edgetrain (default: this Python's edgetrain.cli)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    # A shared machine's speed drifts by 2-3x over seconds, so the two sides are
    # measured alternately, round after round, and compared by their medians.
    rounds = []
    for _ in range(max(1, args.rounds)):
        profile = profile_gflops(shlex.split(args.edgetrain), args.seconds)
        plain = plain_loop_gflops(args.size, args.seconds)
        rounds.append(
            {
                "profile_gflops": profile["gflops"],
                "profile_matmul": profile["details"]["matmul"],
                "plain_gflops": plain["gflops"],
                "plain": plain,
                "ratio": profile["gflops"] / plain["gflops"],
            }
        )
    profile_median = statistics.median(r["profile_gflops"] for r in rounds)
    plain_median = statistics.median(r["plain_gflops"] for r in rounds)
    ratio = profile_median / plain_median
    within = 1 / FACTOR <= ratio <= FACTOR
    out = {
        "profile_gflops": profile_median,
        "plain_gflops": plain_median,
        "ratio": ratio,
        f"within_{FACTOR}x": within,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if within else 1
    for i, r in enumerate(rounds):
        mm, plain = r["profile_matmul"], r["plain"]
        print(
            f"round {i + 1}: profile {r['profile_gflops']:7.2f} GFLOP/s "
            f"(median of {mm['repeats']}, n={mm['size']})  "
            f"plain {r['plain_gflops']:7.2f} GFLOP/s "
            f"(mean of {plain['iterations']}, n={plain['size']})  ratio {r['ratio']:.3f}"
        )
    print(f"edgetrain profile  (median of rounds): {profile_median:8.2f} GFLOP/s")
    print(f"plain torch loop   (median of rounds): {plain_median:8.2f} GFLOP/s")
    print(f"ratio profile/plain: {ratio:.3f} (within {FACTOR}x: {'yes' if within else 'NO'})")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
