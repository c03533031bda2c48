"""A server-tier job: its file (``job.toml``), its rank layout and the results it leaves.

``edgetrain launch job.toml`` and ``edgetrain train --transport dist`` run the
same :class:`DistJob`: ``S`` pipeline stages times ``R`` data-parallel replicas,
one process each (world size ``S x R``). Rank ``r x S + s`` runs stage ``s`` of
replica ``r``; the copies of a stage across replicas form its data-parallel
group. With ``groups`` (one replica), stage ``s`` runs on a group of
``len(groups[s])`` ranks ([Note: groups on the wire] in :mod:`edge.wire.groups`),
member ``m`` the rank ``m`` plus the members of the stages before, each on its
share of every microbatch (``groups[s][m]``, split by
:func:`edge.wire.groups.split_samples`); the world is every member of every stage.

A job file is TOML with the fields of :class:`DistJob` (its training settings are
those of :class:`edge.config.TrainConfig`), for example::

    model = "gpt-mini"
    steps = 100
    batch_size = 64
    microbatches = 8
    boundaries = [3, 5]     # stages [0,3) [3,5) [5,n); or `stages = 3` to balance FLOPs
    replicas = 2
    device = "cuda"         # one GPU per process (LOCAL_RANK), NCCL for gradients
    precision = "bf16"
    output = "runs/gpt"
    [optimizer]
    name = "adamw"
    lr = 3e-4

Results go to ``output``: ``losses.json`` (the loss of every step, averaged over
the replicas), ``reports-rank{k}.jsonl`` (every step report of rank ``k``),
``weights-stage{s}.safetensors`` and ``state-stage{s}.safetensors`` (member 0's
on a group; every other member ``m`` writes ``weights-stage{s}-member{m}.safetensors``,
which :func:`read_results` checks equal to member 0's; the state
blob format of :mod:`edge.runtime.checkpoint`, weights and optimizer state, as
the edge runtime writes them). ``resume_from`` names a directory of state blobs
(from either tier: these, or the coordinator's replicas) to start from, at the
step they are for: a job moves between tiers through them.
"""

from __future__ import annotations

import itertools
import json
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import tomli_w
import torch
from pydantic import Field, ValidationError, model_validator

from edge.config import RecvTimeout, Replicas, TrainConfig
from edge.errors import UserError, describe_validation_error
from edge.files import write_atomic
from edge.models.unit_costs import profile_model
from edge.models.zoo import get_model
from edge.runtime.checkpoint import StageState, read_state
from edge.wire.groups import split_samples
from edge.wire.messages import JobId, StageAssignment, StepReport

__all__ = [
    "DistJob",
    "DistResults",
    "balanced_boundaries",
    "load_job",
    "read_results",
    "resume_states",
    "write_job",
]


class DistJob(TrainConfig):
    """What a server-tier job trains (:class:`~edge.config.TrainConfig`), how it is split
    and where it runs (see the module). A ``codec`` of ``auto`` is fp32: no plan chose one."""

    job: JobId = Field(default_factory=lambda: "d" + secrets.token_hex(6))
    boundaries: list[int] | None = None
    """Where stages 1.. start (ascending unit indices); or give ``stages``."""
    stages: int | None = Field(default=None, ge=1)
    """Stages to balance by training FLOPs when ``boundaries`` is not given."""
    replicas: Replicas = 1
    groups: list[list[float]] | None = None
    """Stage groups: per stage, each member's share of a microbatch (``[1.0]`` for one
    device); ``None``: one device per stage."""
    device: Literal["cpu", "cuda"] = "cpu"
    output: str = "edgetrain-dist"
    resume_from: str | None = None
    recv_timeout_s: RecvTimeout = 300.0
    """Also the process groups' timeout: their setup may take longer than one frame."""

    @model_validator(mode="after")
    def _check(self) -> DistJob:
        if self.boundaries is not None and self.stages is not None:
            raise ValueError("give boundaries or stages, not both")
        if self.boundaries is not None and sorted(set(self.boundaries)) != self.boundaries:
            raise ValueError(f"boundaries {self.boundaries} must be ascending, no repeats")
        if self.groups is not None:
            if len(self.groups) != self.num_stages:
                raise ValueError(f"groups has {len(self.groups)} stages, not {self.num_stages}")
            if self.replicas > 1:
                raise ValueError("groups cannot be combined with replicas")
            self.group_samples()  # every member gets at least one sample
        return self

    def group_samples(self) -> tuple[tuple[int, ...], ...] | None:
        """Per stage, each member's samples of a microbatch; ``None`` without groups."""
        if self.groups is None:
            return None
        n = self.batch_size // (self.microbatches * self.replicas)
        out = []
        for s, shares in enumerate(self.groups):
            try:
                out.append(tuple(split_samples(n, shares)))
            except ValueError as exc:
                raise ValueError(f"groups: stage {s}: {exc}") from None
        return tuple(out)

    @property
    def group_sizes(self) -> list[int]:
        """Members of each stage (ranks per stage per replica)."""
        return [len(g) for g in self.groups] if self.groups else [1] * self.num_stages

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1 if self.boundaries is not None else self.stages or 1

    @property
    def layout(self) -> str:
        """The processes it needs, in words: ``2 stages x 2 replicas`` or ``stages of 2+1
        devices``."""
        if self.groups is not None:
            return f"stages of {'+'.join(map(str, self.group_sizes))} devices"
        return f"{self.num_stages} stages x {self.replicas} replicas"

    @property
    def world_size(self) -> int:
        return sum(self.group_sizes) * self.replicas

    def segments(self) -> list[tuple[int, int]]:
        """``[start, end)`` of every stage's units."""
        spec = get_model(self.model, seed=self.seed, **self.model_options)
        cuts = self.boundaries
        if cuts is None:
            cuts = balanced_boundaries(_unit_flops(self, spec), self.num_stages)
        edges = [0, *cuts, spec.num_units]
        if cuts and (cuts[0] <= 0 or cuts[-1] >= spec.num_units):
            raise UserError(f"boundaries {cuts} must lie inside the {spec.num_units} units")
        return list(itertools.pairwise(edges))

    def rank(self, stage: int, replica: int, member: int = 0) -> int:
        sizes = self.group_sizes
        return replica * sum(sizes) + sum(sizes[:stage]) + member

    def place(self, rank: int) -> tuple[int, int, int]:
        """``(stage, replica, member)`` of ``rank``."""
        sizes = self.group_sizes
        replica, at = divmod(rank, sum(sizes))
        for stage, size in enumerate(sizes):
            if at < size:
                return stage, replica, at
            at -= size
        raise AssertionError("unreachable: at < sum(sizes)")

    def assignment(
        self, stage: int, replica: int, first_step: int = 0, member: int = 0
    ) -> StageAssignment:
        start, end = self.segments()[stage]
        dataset, options = self.resolve_data()
        return StageAssignment.for_stage(
            self,
            job=self.job,
            stage=stage,
            num_stages=self.num_stages,
            start=start,
            end=end,
            dataset=dataset,
            dataset_options=options,
            codec_in=self.link_codec,
            codec_out=self.link_codec,
            recv_timeout_s=self.recv_timeout_s,
            first_step=first_step,
            replica=replica,
            replicas=self.replicas,
            member=member,
            group_samples=self.group_samples(),
        )


def _unit_flops(job: DistJob, spec: Any) -> list[float]:
    costs = profile_model(spec, 1, timing=False, seed=job.seed)
    return [u.fwd_flops + u.bwd_flops for u in costs.units]


def balanced_boundaries(costs: list[float], stages: int) -> list[int]:
    """Cut ``costs`` into ``stages`` contiguous runs minimising the largest run's sum.

    Dynamic programming over (units, stages); ties go to the earliest cut. Every
    stage gets at least one unit.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise UserError(f"cannot split {n} units into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least largest sum cutting the first i units into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    out, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        out.append(i)
    return sorted(out)[1:]


def load_job(path: Path, **overrides: Any) -> DistJob:
    """Read and validate a job file; a bad one is a one-line :class:`UserError`."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return DistJob.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, str(path))) from None


def write_job(job: DistJob, path: Path) -> None:
    """Write ``job`` as a job file :func:`load_job` reads back equal (tomli-w)."""
    data = job.model_dump(mode="json", exclude_none=True)
    try:
        text = tomli_w.dumps(data)
    except (TypeError, ValueError) as exc:  # e.g. a None inside model_options
        raise UserError(f"job {job.job} cannot be written as TOML: {exc}") from None
    write_atomic(path, text)


@dataclass
class DistResults:
    """What the ranks of a finished job left in its output directory."""

    losses: list[float]
    reports: list[StepReport]
    weights: dict[str, torch.Tensor]

    @property
    def wall_s(self) -> float:
        """From the start of the first step to the end of the last, over every rank."""
        if not self.reports:
            return 0.0
        return max(r.ts for r in self.reports) - min(r.ts - r.step_s for r in self.reports)


def read_results(output: Path, job: DistJob) -> DistResults:
    """Read the losses, replica 0's step reports (every member's) and the whole model's
    weights; a group whose members ended with different weights is a :class:`UserError`."""
    losses = json.loads((output / "losses.json").read_text())["losses"]
    reports: list[StepReport] = []
    for stage, size in enumerate(job.group_sizes):
        for member in range(size):
            path = output / f"reports-rank{job.rank(stage, 0, member)}.jsonl"
            lines = path.read_text().splitlines()
            reports.extend(StepReport.model_validate_json(line) for line in lines if line)
    weights: dict[str, torch.Tensor] = {}
    for stage, size in enumerate(job.group_sizes):
        first = (output / f"weights-stage{stage}.safetensors").read_bytes()
        for member in range(1, size):
            if (output / f"weights-stage{stage}-member{member}.safetensors").read_bytes() != first:
                raise UserError(
                    f"job {job.job} stage {stage}: member {member} ended with other weights "
                    "than member 0"
                )
        weights.update(safetensors.torch.load(first))
    return DistResults(losses=losses, reports=reports, weights=weights)


def resume_states(directory: Path, num_units: int) -> tuple[int, list[StageState]]:
    """The newest step whose state blobs in ``directory`` cover all ``num_units`` units.

    Any ``*.safetensors`` file with edgetrain state metadata counts (the states
    this module writes, or a coordinator's replicas); other files are skipped.
    """
    by_step: dict[int, list[StageState]] = {}
    for path in sorted(directory.glob("**/*.safetensors")):
        try:
            state = read_state(path.read_bytes())
        except ValueError:
            continue  # weights-only files sit next to the states
        by_step.setdefault(state.step, []).append(state)
    for step in sorted(by_step, reverse=True):
        covered = {u for s in by_step[step] for u in range(s.start, s.end)}
        if covered >= set(range(num_units)):
            return step, by_step[step]
    raise UserError(f"resume_from {directory}: no step has states covering all {num_units} units")
