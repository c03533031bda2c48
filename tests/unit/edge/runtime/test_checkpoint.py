"""Stage state blobs: round trips, refusals, and resuming from one equals never stopping.

Stages run for real (StageRuntime over the in-process transport); the states
they publish through the ``replicate`` hook are what the tests restore from.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterator

import pytest
import safetensors.torch
import torch
from support.reference import assert_matches, one_thread, train_reference

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.runtime.checkpoint import (
    FORMAT,
    StageState,
    encode_state,
    load_state,
    read_state,
    select,
    select_units,
    stage_state,
)
from edge.runtime.stage import StageRuntime
from edge.transport.inprocess import InProcessTransport
from edge.wire.messages import OptimizerSpec, StageAssignment, StepReport

MODELS = {"mlp": 3, "cnn-digits": 4, "gpt-mini": 6}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Stages here run on one torch thread, as agents do, so that they round as the
    independent reference does (see support.reference)."""
    with one_thread():
        yield


OPTIMIZERS = {
    "sgd": OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adamw": OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.01),
}


def _assignments(
    model: str, cuts: list[int], optimizer: str, steps: int, **extra: object
) -> list[StageAssignment]:
    spec = JobSpec(
        model=model,
        steps=steps,
        batch_size=8,
        microbatches=2,
        seed=5,
        optimizer=OPTIMIZERS[optimizer],
        recv_timeout_s=30,
    )
    plan = Plan.of(*((f"d{s}", cuts[s], cuts[s + 1]) for s in range(len(cuts) - 1)))
    return [
        StageAssignment.model_validate(a.model_dump() | extra)
        for a in make_assignments("ckpt", spec, plan)
    ]


class Run:
    """The stages of one job in threads of this process; what they reported and published."""

    def __init__(self, assignments: list[StageAssignment], restore: list[bytes] | None = None):
        self.losses: dict[int, float] = {}
        self.reports: list[StepReport] = []
        self.states: dict[tuple[int, int], bytes] = {}  # (stage, step) -> state
        lock = threading.Lock()
        transport = InProcessTransport()

        def report(event: StepReport) -> None:
            with lock:
                self.reports.append(event)
                if event.loss is not None:
                    self.losses[event.step] = event.loss

        def replicator(stage: int) -> Callable[[int, bytes], None]:
            return lambda step, data: self.states.__setitem__((stage, step), data)

        self.runtimes = [
            StageRuntime(a, transport, report=report, replicate=replicator(a.stage))
            for a in assignments
        ]
        for rt, blob in zip(self.runtimes, restore or [], strict=False):
            rt.restore(blob)
        errors: list[BaseException] = []

        def work(rt: StageRuntime) -> None:
            try:
                rt.run()
            except BaseException as exc:
                errors.append(exc)
                for other in self.runtimes:
                    other.cancel()

        threads = [threading.Thread(target=work, args=(rt,)) for rt in self.runtimes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        transport.close()
        if errors:
            raise errors[0]

    def weights(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for rt in self.runtimes:
            out.update(rt.segment.state_dict())
        return out


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"weights differ: {unequal[:5]}"


def _assert_same_optimizer(x: torch.optim.Optimizer, y: torch.optim.Optimizer) -> None:
    sx, sy = x.state_dict()["state"], y.state_dict()["state"]
    assert sx.keys() == sy.keys()
    for i in sx:
        assert sx[i].keys() == sy[i].keys()
        for k in sx[i]:
            assert torch.equal(torch.as_tensor(sx[i][k]), torch.as_tensor(sy[i][k])), (i, k)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_round_trip_after_real_steps(model: str, optimizer: str) -> None:
    n = MODELS[model]
    cuts = [0, 1, n]  # a one-unit segment and the rest: keys keep their unit prefix
    run = Run(_assignments(model, cuts, optimizer, steps=3, replicate_every=2))
    assert {k for k in run.states} == {(0, 2), (1, 2)}
    for rt in run.runtimes:
        blob = rt.state(3)
        st = read_state(blob)
        a = rt.a
        assert (st.step, st.job, st.stage, st.start, st.end) == (3, "ckpt", a.stage, a.start, a.end)
        _assert_same_weights(st.weights, rt.segment.state_dict())
        unit_names = set(get_model(model).unit_names[a.start : a.end])
        assert {k.split(".")[0] for k in st.weights} <= unit_names
        expected = {"sgd": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}
        params = dict(rt.segment.named_parameters())
        assert set(st.optim) == set(params)
        assert all(set(v) == expected[optimizer] for v in st.optim.values())
        if optimizer == "adamw":
            assert all(
                isinstance(v["step"], torch.Tensor) and float(v["step"]) == 3.0
                for v in st.optim.values()
            )

        fresh = StageRuntime(
            StageAssignment.model_validate(
                a.model_dump() | {"steps": 5, "first_step": 3, "restore": True}
            ),
            InProcessTransport(),
        )
        assert fresh.restore(blob) == 3
        _assert_same_weights(fresh.segment.state_dict(), rt.segment.state_dict())
        assert fresh.optimizer is not None and rt.optimizer is not None
        _assert_same_optimizer(fresh.optimizer, rt.optimizer)
        again = read_state(fresh.state(3))  # nothing lost on the way
        _assert_same_weights(again.weights, st.weights)
        assert again.optim.keys() == st.optim.keys()


def test_python_number_state_is_kept_as_a_number() -> None:
    seg = get_model("mlp").build_segment(0, 3)
    opt = torch.optim.SGD(seg.parameters(), lr=0.1, momentum=0.9)
    for p in seg.parameters():
        opt.state[p] = {"momentum_buffer": torch.ones_like(p), "count": 7, "none": None}
    st = read_state(stage_state(seg, opt, step=4, job="j", stage=0, start=0, end=3))
    assert all(v["count"] == 7 and isinstance(v["count"], int) for v in st.optim.values())
    assert all("none" not in v for v in st.optim.values())


def _blob(meta: dict[str, str] | None, tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    return safetensors.torch.save(tensors or {"fc1.1.weight": torch.zeros(2)}, metadata=meta)


GOOD = {
    "format": FORMAT,
    "step": "3",
    "job": "j1",
    "stage": "0",
    "start": "0",
    "end": "3",
    "units": '["fc1", "fc2", "out"]',
}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a safetensors state"),
        (b"garbage that is not a state at all", "not a safetensors state"),
        (struct.pack("<Q", 5) + b"{{{{{", "not JSON"),
        (struct.pack("<Q", 200_000) + b"[" * 200_000, "not JSON"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header of"),
        (struct.pack("<Q", 2) + b"[]", "no metadata"),
        (_blob(None), "no metadata"),
        (_blob(GOOD | {"format": "edgetrain-state-0"}), "format"),
        (_blob({k: v for k, v in GOOD.items() if k != "step"}), "'step'"),
        (_blob(GOOD | {"step": "-1"}), "'step'"),
        (_blob(GOOD | {"start": "٣"}), "'start'"),
        (_blob(GOOD | {"job": "no/slashes"}), "job"),
        (_blob(GOOD | {"end": "0"}), "empty unit range"),
        (_blob(GOOD | {"scalars": "[1]"}), "scalars"),
        (_blob(GOOD | {"units": '["fc1", "fc2"]'}), "'units'"),
        (_blob(GOOD | {"units": '["fc1", "fc1", "out"]'}), "'units'"),
        (_blob(GOOD | {"units": "fc1"}), "'units'"),
        (_blob(GOOD, {"conv1.weight": torch.zeros(1)}), "none of its units"),
        (_blob(GOOD, {"optim/x": torch.zeros(1)}), "optim/<param>/<key>"),
        (_blob(GOOD)[:-3], "unreadable tensors"),
    ],
)
def test_malformed_blobs_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_state(data)


def test_restore_refuses_wrong_job_step_units_and_shapes() -> None:
    (a,) = _assignments("mlp", [0, 3], "sgd", steps=4, first_step=2, restore=True)
    good = Run(_assignments("mlp", [0, 3], "sgd", steps=3, replicate_every=2)).states[(0, 2)]
    rt = StageRuntime(a, InProcessTransport())
    before = {k: v.clone() for k, v in rt.segment.state_dict().items()}
    st = read_state(good)

    def variant(**changes: object) -> bytes:
        return encode_state(StageState(**(vars(st) | changes)))

    with pytest.raises(ValueError, match="job other, not ckpt"):
        rt.restore(variant(job="other"))
    with pytest.raises(ValueError, match="for step 3, the stage starts at step 2"):
        rt.restore(variant(step=3))
    with pytest.raises(ValueError, match=r"no state for units \[2\]"):
        rt.restore(encode_state(select_units([st], 0, 2)))
    missing = {k: v for k, v in st.weights.items() if k != "out.bias"}
    with pytest.raises(ValueError, match=r"lacks 1 weights.*out\.bias"):
        rt.restore(variant(weights=missing))
    wrong = st.weights | {"out.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"weight out\.weight"):
        rt.restore(variant(weights=wrong))
    bad_optim = st.optim | {"out.weight": {"momentum_buffer": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"optimizer state out\.weight/momentum_buffer"):
        rt.restore(variant(optim=bad_optim))
    _assert_same_weights(rt.segment.state_dict(), before)  # a refused state changes nothing
    assert rt.restore(good) == 2


def test_select_takes_units_from_several_states_and_ignores_the_rest() -> None:
    run = Run(_assignments("cnn-digits", [0, 2, 4], "adamw", steps=3, replicate_every=1))
    parts = [read_state(run.states[(s, 2)]) for s in (0, 1)]
    mid = select_units(parts, 1, 3)
    assert (mid.start, mid.end, mid.step, mid.units) == (1, 3, 2, ["conv2", "fc1"])
    assert {k.split(".")[0] for k in mid.weights} == {"conv2", "fc1"}
    assert {k.split(".")[0] for k in mid.optim} == {"conv2", "fc1"}
    with pytest.raises(ValueError, match=r"no state for units \[2, 3\]"):
        select_units(parts[:1], 1, 4)
    names = get_model("cnn-digits").unit_names
    assert select(parts, 1, 3, names).units == ["conv2", "fc1"]
    with pytest.raises(ValueError, match="not the model's"):
        select(parts, 1, 3, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="mixed"):
        select_units([parts[0], read_state(run.states[(1, 1)])], 0, 4)
    # The merged state restores a whole-model stage.
    (whole,) = _assignments("cnn-digits", [0, 4], "adamw", steps=3, first_step=2, restore=True)
    seg = StageRuntime(whole, InProcessTransport())
    whole_state = select_units(parts, 0, 4)
    seg.restore(encode_state(whole_state))
    load_state(seg.segment, seg.optimizer, whole_state)  # loading twice is fine
    # The coordinator relabels a composed state for a new attempt (another job id).
    relabelled = read_state(encode_state(whole_state, job="attempt2", stage=1))
    assert (relabelled.job, relabelled.stage, relabelled.step) == ("attempt2", 1, 2)


SPLITS = [("mlp", [0, 3]), ("mlp", [0, 1, 3]), ("gpt-mini", [0, 6]), ("gpt-mini", [0, 2, 6])]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("model", "cuts"), SPLITS)
def test_resuming_from_a_state_equals_never_stopping(
    model: str, cuts: list[int], optimizer: str
) -> None:
    steps, k = 6, 4
    reference = Run(_assignments(model, cuts, optimizer, steps))
    independent = train_reference(
        model,
        steps=steps,
        batch_size=8,
        seed=5,
        optimizer=OPTIMIZERS[optimizer].model_dump(),
        microbatches=2,  # for AdamW: see support.reference
    )
    losses = [reference.losses[t] for t in range(steps)]
    assert_matches(losses, reference.weights(), independent)
    replicated = Run(_assignments(model, cuts, optimizer, steps, replicate_every=2))
    # Publishing states does not change training.
    assert replicated.losses == reference.losses
    _assert_same_weights(replicated.weights(), reference.weights())
    assert sorted(replicated.states) == sorted((s, t) for s in range(len(cuts) - 1) for t in (2, 4))
    sized = [r for r in replicated.reports if r.replica_bytes]
    assert {r.step for r in sized} == {1, 3} and all(r.replica_s > 0 for r in sized)
    assert all(r.replica_bytes == 0 for r in reference.reports)

    blobs = [replicated.states[(s, k)] for s in range(len(cuts) - 1)]
    resumed = Run(_assignments(model, cuts, optimizer, steps, first_step=k, restore=True), blobs)
    assert sorted(resumed.losses) == list(range(k, steps))
    assert resumed.losses == {t: v for t, v in reference.losses.items() if t >= k}
    _assert_same_weights(resumed.weights(), reference.weights())


def test_resuming_on_another_split_equals_never_stopping() -> None:
    """The coordinator's case: two stages' states, one new stage over all their units."""
    steps, k = 5, 2
    reference = Run(_assignments("mlp", [0, 3], "adamw", steps))
    two = Run(_assignments("mlp", [0, 1, 3], "adamw", steps, replicate_every=2))
    parts = [read_state(two.states[(s, k)]) for s in (0, 1)]
    blob = encode_state(select_units(parts, 0, 3))
    assert (
        json.loads(blob[8 : 8 + struct.unpack_from("<Q", blob)[0]])["__metadata__"]["step"] == "2"
    )
    resumed = Run(_assignments("mlp", [0, 3], "adamw", steps, first_step=k, restore=True), [blob])
    assert resumed.losses == {t: v for t, v in reference.losses.items() if t >= k}
    _assert_same_weights(resumed.weights(), reference.weights())


def test_first_step_must_be_below_steps() -> None:
    (a,) = _assignments("mlp", [0, 3], "sgd", steps=3)
    with pytest.raises(ValueError, match="first_step 3 is not below steps 3"):
        StageAssignment.model_validate(a.model_dump() | {"first_step": 3})
