"""Training on this machine: stages as threads, as torch.distributed ranks, or as agents.

What ``edgetrain train`` runs, as a library: :func:`train_locally` trains a
:class:`~coordinator.local.options.LocalTraining` (a job, and how it runs here) on
its transport, with :func:`train_inprocess` (the stages as threads of this
process), :func:`train_dist` (the server tier: one rank per stage and replica,
launched with torchrun semantics, :mod:`edge.server.launch`) or
:func:`train_on_local_fleet` (a broker and N real agent processes driven over MQTT
by the :class:`~coordinator.engine.engine.JobEngine`, as the service drives a
fleet). Each plans over copies of this device's measured profile, or the agents'
announced ones, with the job's ``partition``, ``stages`` and ``group_sizes``. Given
catalogue ``profiles`` (one per device), the in-process and agent runs plan over
those devices instead, and agents emulate them: each announces its profile and runs
slowed to its speed relative to the fastest, so a group's members get unequal
shares of each microbatch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coordinator.engine.faults import check_fault_stages
from coordinator.engine.monitor import JobResult
from coordinator.engine.options import JobHooks, RunOptions
from coordinator.engine.spec import JobSpec
from coordinator.local.options import LocalTraining
from coordinator.planner.predict import Prediction
from coordinator.planner.score import PlanScore
from edge.errors import UserError
from edge.wire.messages import StepReport

__all__ = [
    "LocalRun",
    "emulated",
    "train_dist",
    "train_inprocess",
    "train_locally",
    "train_on_local_fleet",
]


@dataclass
class LocalRun:
    """A finished local job: its result, the plan's score, and what to report beside."""

    result: JobResult
    score: PlanScore
    broker: str | None = None
    """The broker the agents used (``mosquitto``, ``amqtt`` or its URL)."""
    prediction: Prediction | None = None
    """The internal model's predicted step (agents' fixed costs, measured unit times)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Transport-specific figures: replicas and processes, recovery events..."""


def _quiet(_text: str) -> None:
    pass


def _plan(
    spec: JobSpec, devices: list[Any], groups: bool | None = None
) -> tuple[JobSpec, Any, Any]:
    """The plan over ``devices`` (the first holds the data) with the spec's ``partition``
    and ``stages``, its spec score, and the spec as the plan runs it (an ``auto`` job at
    the plan's microbatches and schedule); ``groups``: whether the planner may place device groups
    (``None``: as :func:`~coordinator.engine.engine.plans_groups` says)."""
    from coordinator.engine.engine import plan_over

    planned = plan_over(
        spec, devices, pin_first=devices[0].id, where="these devices", groups=groups
    )
    return planned.resolve(spec), planned.plan, planned.score


def emulated(profiles: list[str]) -> tuple[list[Any], list[float]]:
    """The device specs of catalogue ``profiles`` (ids ``local-<i>``) and how many times
    slower than the fastest of them each runs."""
    from edge.profiling.catalog import resolve

    specs = [
        resolve(name).to_device_spec(power=True).model_copy(update={"id": f"local-{i}"})
        for i, name in enumerate(profiles)
    ]
    fastest = max(d.gflops for d in specs)
    return specs, [fastest / d.gflops for d in specs]


def train_inprocess(
    spec: JobSpec,
    n: int,
    on_step: Callable[[StepReport], None] | None = None,
    profiles: list[str] | None = None,
) -> LocalRun:
    """``n`` stages as threads of this process (``n == 1``: the single-device reference),
    planned over copies of this device or over catalogue ``profiles`` (not emulated here:
    they only shape the plan and a group's shares)."""
    from coordinator.engine.runners import run_inprocess
    from edge.profiling.device import profile_device

    if profiles:
        fleet = emulated(profiles)[0]
    else:
        me = profile_device("local", seconds=0.3).to_device_spec()
        fleet = [me.model_copy(update={"id": f"local-{i}"}) for i in range(n)]
    spec, plan, score = _plan(spec, fleet)
    shares = score.shares if plan.grouped else None
    return LocalRun(run_inprocess(spec, plan, on_step=on_step, shares=shares), score)


def train_dist(
    spec: JobSpec,
    n: int,
    *,
    replicas: int = 1,
    device: str = "cpu",
    threads: int | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    note: Callable[[str], None] = _quiet,
) -> LocalRun:
    """Plan over ``n / replicas`` local devices and run it as a server-tier job (a plan's
    stage groups as groups of ranks, one bucketed all-reduce each per step)."""
    from edge.profiling.device import profile_device
    from edge.server.job_file import DistJob, read_results
    from edge.server.launch import launch

    me = profile_device("local", seconds=0.3).to_device_spec()
    fleet = [me.model_copy(update={"id": f"rank-{i}"}) for i in range(n // replicas)]
    spec, plan, score = _plan(spec, fleet, groups=None if replicas == 1 else False)  # see DistJob
    with tempfile.TemporaryDirectory(prefix="edgetrain-dist-") as out:
        job = DistJob.model_validate(
            spec.train_settings()
            | {
                "codec": spec.codec,
                "boundaries": [st.start for st in plan.stages[1:]],
                "replicas": replicas,
                "groups": score.shares if plan.grouped else None,
                "device": device,
                "output": out,
            }
        )
        processes = job.world_size
        note(
            f"launching {job.layout} = {processes} processes (torch.distributed, "
            f"{'gloo' if device == 'cpu' else 'NCCL'})"
        )
        cores = os.cpu_count() or 1
        launch(job, threads=threads or max(1, cores // processes))
        got = read_results(Path(out), job)
    if on_step is not None:
        for report in got.reports:
            on_step(report)
    result = JobResult(
        job=job.job,
        plan=plan,
        spec=spec,
        losses=got.losses,
        reports=got.reports,
        wall_s=got.wall_s,
        weights=got.weights,
    )
    extra = {
        "replicas": replicas,
        "processes": processes,
        "device": device,
        "precision": spec.precision,
    }
    return LocalRun(result, score, extra=extra)


def train_locally(
    training: LocalTraining,
    *,
    on_step: Callable[[StepReport], None] | None = None,
    note: Callable[[str], None] = _quiet,
) -> LocalRun:
    """Train ``training``'s job on its transport: :func:`train_inprocess`,
    :func:`train_dist` or :func:`train_on_local_fleet`. ``note`` hears what the user is
    told on the way (a broker started, a replication interval chosen)."""
    from edge.runtime.allocator import tune_malloc

    spec, n = training.spec, training.devices
    tune_malloc()  # the in-process paths train here; agents tune their own
    if training.transport == "mqtt":
        return train_on_local_fleet(training, on_step=on_step, note=note)
    if training.transport == "inprocess":
        profiles = list(training.profiles) if training.profiles else None
        return train_inprocess(spec, n, on_step=on_step, profiles=profiles)
    return train_dist(
        spec,
        n,
        replicas=training.replicas,
        device=training.device,
        threads=training.threads,
        on_step=on_step,
        note=note,
    )


def train_on_local_fleet(
    training: LocalTraining,
    *,
    on_step: Callable[[StepReport], None] | None = None,
    note: Callable[[str], None] = _quiet,
) -> LocalRun:
    """``training.devices`` agent processes on this machine (a broker started unless
    ``training.broker`` is given), driven by the job engine exactly as the service drives
    a fleet, with the fault tolerance ``training`` asks for
    (:attr:`~coordinator.local.options.LocalTraining.tolerance`): the run then survives
    its faults and migrates to faster plans. With ``holders`` (and ``spec.data``), the
    first that many agents each hold a shard of the dataset as local data,
    ``spec.data.name``."""
    from coordinator.engine.egress import egress
    from coordinator.engine.engine import JobEngine
    from coordinator.engine.runners import server_tier
    from coordinator.engine.spec import largest_message_bytes, new_job_id
    from coordinator.local.fleet import AgentRoles, LocalFleet
    from coordinator.local.owned import OwnedBroker, start_owned_broker
    from coordinator.planner.baselines import job_baselines
    from edge.models.user_code import user_modules
    from edge.transport.mqtt import MqttSettings, MqttTransport

    spec, n, broker, holders = training.spec, training.devices, training.broker, training.holders
    profiles = list(training.profiles) if training.profiles else None
    own_code = user_modules(spec.model, spec.resolve_data()[0])  # the job's: its agents run it
    name: str
    with contextlib.ExitStack() as stack:
        target: str | OwnedBroker
        if broker is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgetrain-train-")))
            largest = largest_message_bytes(spec)  # the broker takes nothing larger
            owned = start_owned_broker(work / "broker", log_dir=work, max_packet=largest)
            stack.callback(owned.stop)
            target, settings, name = owned, owned.settings(), owned.broker.kind
            note(f"started {owned.describe()}")
        else:
            target, settings, name = broker, MqttSettings(url=broker), broker
            note(f"using the broker at {broker}")
        control = MqttTransport(settings)
        control.connect(timeout=15)
        stack.callback(control.close)
        data = None
        if holders:
            if spec.data is None or holders > n:
                raise UserError(f"--holders {holders} needs local data and at most {n} devices")
            held = spec.data.name
            data = [[f"{held}={held}:shard={i + 1}/{holders}"] for i in range(holders)]
        roles = AgentRoles(
            profiles=profiles,
            slowdowns=emulated(profiles)[1] if profiles else None,
            servers=training.servers,
            server_device=training.device,
            data=data,
        )
        fleet = stack.enter_context(
            LocalFleet(n, target, roles=roles, threads=training.threads, allow_code=own_code)
        )
        announced = fleet.wait_online(control)
        options = RunOptions(
            heartbeat_timeout_s=training.heartbeat_timeout_s,
            access=fleet.owned.accounts if fleet.owned is not None else None,
        )
        engine = JobEngine(
            control,
            fleet,
            fleet,
            options=options,
            servers=lambda: server_tier({d.id: d for d in fleet.available()}),
        )
        tolerance = training.tolerance
        asked = engine.replication_asked(spec, tolerance)
        first = fleet.ids[0]
        planned = engine.plan(spec, pin_first=first, where="these devices", resilient=asked != 0)
        spec = planned.resolve(spec)  # "auto": the plan's microbatches and schedule
        check_fault_stages(tolerance.faults or (), [len(st.devices) for st in planned.plan.stages])
        extra: dict[str, Any] = {"egress": egress(spec, planned.plan)}
        # The speeds the agents announced, which the plan and a group's shares follow.
        extra["gflops"] = {d.id: d.gflops for d in planned.problem.devices}
        if spec.unit_times == "devices":  # who timed the units the plan was priced by
            extra["own_unit_times"] = list(planned.own_units)
        if planned.holders is not None:  # what the job's constraints allow, side by side
            extra["alternatives"] = job_baselines(planned.problem, planned.holders)
        tier = server_tier(announced)
        if tier and not asked:
            extra["servers"] = sorted(tier)
        extra["training"] = spec.training
        if spec.diloco is not None:
            grouped = planned.plan.grouped
            note(spec.training + ("" if grouped else " (the plan has no group: exact anyway)"))

        def on_plan(again: Any) -> None:
            if again.fewer_stages:
                note(again.fewer_stages.replace("stages=", "--stages "))

        def on_fault(fault: Any, detail: dict[str, Any]) -> None:
            note(f"fault {fault}: {detail.get('done') or detail.get('error')}")

        def on_join(device: str, online: bool) -> None:
            note(f"{device} joined" if online else f"{device} did not come online")

        hooks = JobHooks(on_step=on_step, on_plan=on_plan, on_fault=on_fault, on_join=on_join)
        if asked < 0:  # chosen from the plan's costs: say what was chosen
            every = engine.replication(spec, planned, tolerance)
            most = max(1, spec.steps // 10)
            note(f"replicating every {every} steps (5% of a step, at most {most})")
            tolerance = replace(tolerance, replicate_every=every)
        run = engine.run(
            new_job_id(), spec, planned, hooks=hooks, pin_first=first, tolerance=tolerance
        )
        if run.resilient is not None:
            extra.update(run.resilient.to_json(), replicate_every=run.replicate_every)
        found = planned.found
        return LocalRun(run.result, found.score, name, extra=extra, prediction=found.prediction)
    raise AssertionError("unreachable")
