"""The demo's session: a coordinator on this machine, a fleet enrolled through its API,
and the two jobs on data that stays home that ``edgetrain demo`` shows.

:func:`demo_session` starts the coordinator (REST API and dashboard) with a freshly
generated API token and its own broker (Mosquitto, else the embedded amqtt; TLS,
accounts and ACLs that follow the plan either way), and enrols agent processes
through the API, as a user would, each emulating a catalogue device of a
:class:`DemoFleet` (slowed in software to its speed relative to the fastest,
announcing the speed it gets): the first :data:`HOLDERS` hold a shard of ``digits``
each, the rest hold nothing. A :class:`DemoSession` submits and follows jobs through
the API: the job on that local data with its labels local too ([Note: local data];
``cnn-digits`` at :data:`MODEL_OPTIONS`, :func:`job_body`: a U-shaped plan, the
holders running the first and the last units and the loss), its accuracy on
held-out digits (:func:`held_out_accuracy`), the payload it put on the wire (its
``traffic`` event) beside what federated averaging of the same model would send
(:func:`fedavg_bytes_per_sample`), and the same job on the holders alone, for
comparison (:class:`DemoResult`). What is printed, and how, is the command's
(:mod:`edgetrain.cli.demo`).

The coordinator extras (httpx, FastAPI) are imported here: import this module where a
missing extra is reported (:func:`edge.errors.needs_coordinator_extras`).
"""

from __future__ import annotations

import contextlib
import math
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import SecretStr

from coordinator.access.accounts import BrokerAccounts
from coordinator.local.broker import free_port
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.local.train import emulated
from coordinator.planner.anatomy import link_share
from coordinator.service.serve import serve_in_thread
from coordinator.service.settings import Settings
from edge.errors import UserError
from edge.profiling.catalog import resolve
from edge.transport.credentials import Credentials
from edge.transport.settings import MqttSettings

if TYPE_CHECKING:
    import torch

    from edge.models.zoo import ModelSpec

__all__ = [
    "HOLDERS",
    "MODEL_OPTIONS",
    "DemoFleet",
    "DemoResult",
    "DemoSession",
    "demo_session",
    "fedavg_bytes_per_sample",
    "fedavg_of_the_demo",
    "held_out",
    "held_out_accuracy",
    "job_body",
]

MODEL = "cnn-digits"

MODEL_OPTIONS: dict[str, Any] = {"width": 64}
"""cnn-digits at four times its default width: enough work per sample that handing all
but the first convolution to the laptop pays over the holders training alone."""

HOLDERS = 3
"""The first devices of the fleet hold the data, a shard each."""

ALONE_STEPS = 40
"""The holders-alone job runs at most this many steps: enough to measure its rate."""

_DONE = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class DemoFleet:
    """The catalogue devices the demo emulates, in order: :data:`HOLDERS` data holders,
    then at least one helper."""

    names: tuple[str, ...]
    """The catalogue names, as given."""
    profiles: tuple[str, ...]
    """Each one's catalogue profile."""
    slowdowns: tuple[float, ...]
    """How many times slower than the fastest of them each runs."""
    links: tuple[float | None, ...] = ()
    """The rate each one's link is shaped to, Mbit/s each way; ``None`` (or none given):
    its catalogue device's."""

    @classmethod
    def parse(cls, fleet: str, link_mbps: float | None = None) -> DemoFleet:
        """The fleet of ``fleet``: comma-separated catalogue names, each with an optional
        ``@MBPS``, its link's rate (else ``link_mbps``, else its catalogue device's). A
        one-line :class:`UserError` for too few devices, an unknown one or a bad rate."""
        names: list[str] = []
        links: list[float | None] = []
        for item in (i.strip() for i in fleet.split(",")):
            if not item:
                continue
            name, at, rate = item.partition("@")
            names.append(name)
            links.append(_rate(item, rate) if at else link_mbps)
        if len(names) <= HOLDERS:
            raise UserError(f"--fleet: {HOLDERS} data holders and at least one helper")
        profiles = tuple(resolve(n).name for n in names)
        _specs, slowdowns = emulated(names)
        return cls(tuple(names), profiles, tuple(slowdowns), tuple(links))

    @property
    def data(self) -> list[list[str]]:
        """The local datasets each holder's agent holds (``--data`` items)."""
        return [[f"digits=digits:shard={i + 1}/{HOLDERS}"] for i in range(HOLDERS)]

    def roles(self) -> AgentRoles:
        """What each agent of the fleet is: its profile, its slowdown, its data."""
        return AgentRoles(
            profiles=self.profiles, slowdowns=self.slowdowns, data=self.data, links=self.links
        )


def _rate(item: str, rate: str) -> float:
    """The ``MBPS`` of a ``--fleet`` item ``NAME@MBPS``."""
    try:
        mbps = float(rate)
    except ValueError:
        mbps = math.nan
    if not (math.isfinite(mbps) and mbps > 0):
        raise UserError(f"--fleet: {item!r}: expected NAME@MBPS with MBPS a number above 0")
    return mbps


def job_body(
    steps: int, batch_size: int, microbatches: int | str, lr: float, codec: str = "fp32"
) -> dict[str, Any]:
    """The demo's job, as ``POST /api/v1/jobs`` takes it: on the holders' digits, their
    labels kept home too; ``codec`` ``auto`` lets the planner compress the links that
    bind."""
    return {
        "model": MODEL,
        "model_options": MODEL_OPTIONS,
        "dataset": "digits",
        "steps": steps,
        "batch_size": batch_size,
        "microbatches": microbatches,
        "codec": codec,
        "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9},
        "data": {"name": "digits", "placement": "local", "labels": "local"},
    }


def held_out_accuracy(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> float:
    """Accuracy of the trained weights on the test split of the model's dataset."""
    return held_out(spec, weights)[0]


def held_out(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """The trained weights on the test split of the model's dataset: the share of its
    predictions that are right, and its mean cross-entropy a prediction (a sample, or a
    token of a language model's)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from edge.models.datasets import build_dataset

    model = spec.build()
    model.load_state_dict(dict(weights))
    model.eval()
    data = build_dataset(spec.dataset, "test", **spec.dataset_options)
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=256):
            flat = model(x).reshape(-1, spec.num_classes).float()
            target = y.reshape(-1)
            loss += F.cross_entropy(flat, target, reduction="sum").item()
            correct += int((flat.argmax(-1) == target).sum())
            total += target.numel()
    return correct / total, loss / total


@dataclass(frozen=True)
class DemoSession:
    """A running demo: the coordinator at ``url`` (``api`` logged in with ``token``) and
    its enrolled ``agents``."""

    url: str
    token: str
    api: httpx.Client
    agents: LocalFleet
    fleet: DemoFleet
    coordinator_login: MqttSettings
    """The coordinator's own MQTT login, whose account may read every topic: a look at
    what crosses the wire (tests/e2e/test_demo_wire.py)."""

    def wait_online(self, timeout_s: float = 120.0) -> None:
        """Wait until the coordinator sees every agent online; a :class:`UserError` if
        they are not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._online() < len(self.fleet.names):
            if time.monotonic() > deadline:
                raise UserError("the emulated devices did not come online")
            time.sleep(0.2)

    def _online(self) -> int:
        devices = self.api.get("/api/v1/devices").json()["data"]
        return sum(d["state"] == "online" for d in devices)

    def submit(self, body: dict[str, Any]) -> str:
        """Submit the job ``body``; its id."""
        created = self.api.post("/api/v1/jobs", json=body)
        created.raise_for_status()
        return str(created.json()["id"])

    def wait_plan(self, job: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """The job's plan, once the coordinator has made it (bounded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = self.api.get(f"/api/v1/jobs/{job}").json()
            if record.get("plan"):
                return dict(record["plan"])
            if record["state"] in ("failed", "cancelled"):
                raise UserError(f"job {job} {record['state']}: {record['reason']}")
            time.sleep(0.2)
        raise UserError(f"job {job} was not planned within {timeout_s:.0f} s")

    def wait_job(
        self,
        job: str,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        *,
        label: str = "",
    ) -> dict[str, Any]:
        """The job's record once it ended, every poll's record handed to ``on_record``;
        a :class:`UserError` with its reason (the job called ``job`` and ``label``) unless
        it completed."""
        while True:
            record = self.api.get(f"/api/v1/jobs/{job}").json()
            if on_record is not None:
                on_record(record)
            if record["state"] in _DONE:
                break
            time.sleep(0.3)
        if record["state"] != "completed":
            raise UserError(f"job {job}{label} {record['state']}: {record['reason']}")
        return dict(record)

    def accuracy(self, job: str) -> float:
        """The accuracy of ``job``'s trained model on held-out digits."""
        import safetensors.torch

        from edge.models.zoo import get_model

        weights = safetensors.torch.load(self.api.get(f"/api/v1/jobs/{job}/model").content)
        return held_out_accuracy(get_model(MODEL, **MODEL_OPTIONS), weights)

    def traffic(self, job: str) -> dict[str, float]:
        """What ``job`` put on the wire (its ``traffic`` event, :meth:`JobResult.traffic`)."""
        events = self.api.get(f"/api/v1/jobs/{job}/events").json()["events"]
        found = [e["detail"] for e in events if e["kind"] == "traffic"]
        if not found:
            raise UserError(f"job {job} recorded no traffic")
        return dict(found[-1])

    def anatomy(self, job: str) -> dict[str, Any]:
        """Where ``job``'s step goes, ``predicted`` and ``measured`` (its anatomy)."""
        got = self.api.get(f"/api/v1/jobs/{job}/anatomy")
        got.raise_for_status()
        return dict(got.json())

    def links(self, job: str, mbps: list[float] | None = None) -> dict[str, Any]:
        """``job`` planned with every link at each of ``mbps`` (default: the
        coordinator's ladder), and where its split stops paying
        (:mod:`coordinator.engine.links`)."""
        got = self.api.post(f"/api/v1/jobs/{job}/links", json={"mbps": mbps})
        got.raise_for_status()
        return dict(got.json())

    def holders_alone(self, body: dict[str, Any]) -> dict[str, Any]:
        """The record of the job ``body`` run on the holders alone (the federated option),
        for at most :data:`ALONE_STEPS` steps."""
        steps = min(body["steps"], ALONE_STEPS)
        alone = self.submit({**body, "steps": steps, "devices": self.agents.ids[:HOLDERS]})
        return self.wait_job(alone, label=" (the holders alone)")


def fedavg_bytes_per_sample(model_bytes: int, clients: int, samples_per_round: int) -> float:
    """Federated averaging's payload a training sample, at one local epoch a round: each
    of ``clients`` downloads the model and uploads its update once a round (``model_bytes``
    twice), and a round trains on every client's samples once."""
    return 2 * model_bytes * clients / samples_per_round


def fedavg_of_the_demo() -> dict[str, float]:
    """:func:`fedavg_bytes_per_sample` for the demo's model on its holders' digits."""
    from edge.models.datasets import build_dataset
    from edge.models.zoo import get_model

    model = get_model(MODEL, **MODEL_OPTIONS).build()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    samples = len(build_dataset("digits", "train"))  # type: ignore[arg-type]
    return {
        "model_bytes": size,
        "clients": HOLDERS,
        "samples_per_round": samples,
        "bytes_per_sample": fedavg_bytes_per_sample(size, HOLDERS, samples),
    }


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured: the job's accuracy, its rate on the plan and on the
    holders alone, the plan's predicted rate, and its bytes on the wire beside what
    federated averaging would send."""

    accuracy: float
    record: dict[str, Any]
    """The job's record."""
    alone: dict[str, Any]
    """The holders-alone job's record."""
    traffic: dict[str, float]
    """The job's payload on the wire (:meth:`DemoSession.traffic`)."""
    fedavg: dict[str, float]
    """Federated averaging of the same model (:func:`fedavg_of_the_demo`)."""
    anatomy: dict[str, Any]
    """Where the job's step went, predicted and measured (:meth:`DemoSession.anatomy`)."""
    links: dict[str, Any]
    """The job on other link rates (:meth:`DemoSession.links`)."""

    @property
    def measured(self) -> float:
        """Samples/s measured on the plan."""
        return self.record["samples_per_s"]

    @property
    def by_holders(self) -> float:
        """Samples/s measured on the holders alone."""
        return self.alone["samples_per_s"]

    @property
    def predicted(self) -> float:
        """Samples/s the plan was predicted to train at."""
        return self.record["plan"]["throughput_sps"]

    @property
    def speedup(self) -> float | None:
        """The plan's rate over the holders'."""
        return self.measured / self.by_holders if self.by_holders else None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted."""
        return self.measured / self.predicted if self.predicted else None

    @property
    def labels_local(self) -> bool:
        """Whether the job kept its labels on the holders."""
        data = self.record["spec"].get("data") or {}
        return bool(data.get("labels") == "local")

    def link_share(self, which: str) -> float | None:
        """The share of the job's step on links and group sums, ``predicted`` or
        ``measured`` (summed over its stages' members); ``None`` before there is one."""
        parts = (self.anatomy.get(which) or {}).get("fractions")
        return None if parts is None else link_share(parts)

    def summary(self) -> dict[str, Any]:
        """What ``--json`` prints."""
        plan = self.record["plan"]
        keys = ("stages", "egress", "step_time_s", "throughput_sps", "feasible", "u_shaped")
        return {
            "labels_local": self.labels_local,
            "accuracy": self.accuracy,
            "samples_per_s": self.measured,
            "holders_alone_samples_per_s": self.by_holders,
            "speedup_vs_holders_alone": self.speedup,
            "predicted_samples_per_s": self.predicted,
            "measured_over_predicted": self.ratio,
            "bytes_per_sample": self.traffic["bytes_per_sample"],
            "bytes_to_finish": self.traffic["bytes_sent"] + self.traffic["bytes_received"],
            "fedavg_bytes_per_sample": self.fedavg["bytes_per_sample"],
            "fedavg": self.fedavg,
            "link_share_predicted": self.link_share("predicted"),
            "link_share_measured": self.link_share("measured"),
            "link_ladder": self.links["ladder"],
            "split_stops_paying_below_mbps": self.links["split_stops_paying_below_mbps"],
            "plan": {k: plan[k] for k in keys if k in plan},
        }


@contextlib.contextmanager
def demo_session(fleet: DemoFleet, port: int = 0) -> Iterator[DemoSession]:
    """A coordinator on ``port`` (0: a free one) with its own broker, and ``fleet``'s
    agents enrolled through its API, for the block (see the module docstring)."""
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="edgetrain-demo-") as tmp:
        settings = Settings(
            data_dir=Path(tmp), api_token=SecretStr(token), port=port or free_port()
        )
        auth = {"Authorization": f"Bearer {token}"}
        with (
            serve_in_thread(settings) as url,
            httpx.Client(base_url=url, timeout=30, headers=auth) as api,
        ):
            enrolled: list[Credentials] = []

            def enroll(device: str) -> Credentials:
                got = api.post("/api/v1/devices/enroll", json={"device_id": device})
                got.raise_for_status()
                enrolled.append(Credentials.model_validate(got.json()))
                return enrolled[-1]

            roles = fleet.roles()
            with LocalFleet(
                len(fleet.names), None, roles=roles, threads=1, enroll=enroll
            ) as agents:
                broker, ca = enrolled[0].broker, enrolled[0].ca
                login = BrokerAccounts(Path(tmp) / "broker", broker, ca).login(broker)
                yield DemoSession(url, token, api, agents, fleet, login)
