"""bench/cost_model.py's pure part: the measured step time from step reports."""

from __future__ import annotations

from support.bench import load_bench

from edge.wire.messages import StepReport


def _report(stage: int, step: int, ts: float) -> StepReport:
    return StepReport(job="j", stage=stage, device=f"d{stage}", step=step, ts=ts)


def test_the_measured_step_is_the_median_gap_between_step_ends_after_warmup() -> None:
    bench = load_bench("cost_model")
    # Step k ends when its last stage reports; steps 0-1 warm up (their gap is left out).
    ends = [0.0, 5.0, 6.0, 6.5, 7.5, 8.0]
    reports = [_report(1, k, t) for k, t in enumerate(ends)]
    reports += [_report(0, k, t - 0.25) for k, t in enumerate(ends)]
    # gaps after step 2: 0.5, 1.0, 0.5 -> median 0.5
    assert bench.measured_step_s(reports, warmup=2) == 0.5
    assert bench.measured_step_s(reports, warmup=0) == 1.0  # 5, 1, 0.5, 1, 0.5
