"""One pipeline stage: its segment, its optimizer, and the schedule it executes.

A :class:`StageRuntime` builds only the units of its segment, owns the optimizer
over their parameters, and runs a step by executing its row of the schedule
(:mod:`edge.runtime.schedules`) action by action:

- ``F m``: take microbatch ``m``'s input (stage 0 reads the dataset, others
  take the activation frame), run the segment forward, and send the output on
  (or, on the last stage, compute the loss);
- ``B m``: take the gradient of the output (or, on the last stage, backprop
  the loss), run backward, and send the input's gradient back;
- ``W m`` (a schedule that splits the backward, [Note: zero bubble] in
  :mod:`edge.runtime.schedules`): its ``B m`` ran only the input's gradient
  (:mod:`edge.runtime.split_backward`); this runs the weights' gradients.

After the last action the optimizer steps (the flush). Stage 0 sends every
microbatch's labels straight to the last stage before the first forward, unless
they stay home (below). The
stage tells its inbox which step it runs and what its plan lets it receive
(:mod:`edge.runtime.links`), so anything else a peer sends is dropped, never taken.

On a server (``torch_device`` ``cuda:N``) the segment, its inputs and its
gradients live on the GPU; frames are encoded from and decoded to host memory.
With ``precision="bf16"`` the forward runs under bf16 autocast (weights,
gradients and optimizer state stay fp32). With ``replicas = R`` (data
parallelism, :mod:`edge.server.data_parallel`) replica ``r``'s stage 0 takes
rows ``[r B/R, (r+1) B/R)`` of every step's batch, and before the optimizer
steps the stage averages its gradients with its copies in the other replicas.

For fault tolerance a stage runs steps ``[first_step, steps)``; it can be
restored (:meth:`StageRuntime.restore`) from the state of step ``first_step``,
and with ``replicate_every = R`` it hands its state for step ``k + 1`` to the
``replicate`` hook after every step ``k`` with ``(k + 1) % R == 0`` (not after
the last step: the final weights go out anyway; in a group only member 0 does,
the members' states being the same). States are
:mod:`edge.runtime.checkpoint` blobs; see [Note: the step of a state] there.
With ``handover`` the stage also keeps, in memory, its state at the start of the
newest step it finished (taken just before the optimizer steps), so that after
a stop it can give the state of the step it is in or of the one before
(:meth:`StageRuntime.state_at`; [Note: a group member dies] in
:mod:`coordinator.engine.handover`).

In a group ([Note: groups on the wire] in :mod:`edge.wire.groups`) each member
runs the whole segment on its own block of rows of every microbatch: it takes
the pieces of its input (and of its output's gradient) that the neighbouring
stage's members send and concatenates them, sends each neighbour member the rows
of its output (and input gradient) they hold, scales its loss by its share of
the samples, and before the optimizer steps sums the group's gradients (and
losses) by a reduce-scatter and an all-gather over the ``reduce`` channel
(:class:`~edge.runtime.group_sum.GroupSum`); over torch.distributed the caller passes
``data_parallel`` over the members' process group instead, and the sum is one
bucketed all-reduce (:meth:`~edge.server.data_parallel.DataParallel.sum_gradients`).
A segment with BatchNorm refuses a group: its
statistics would be over a member's rows, not the microbatch's.

On data that stays home (``local_data``), stage 0's members are the devices that
hold it: each reads its own dataset ([Note: local data] in
:mod:`edge.models.local_data`) with its own sampler, ``n_m`` samples of every
microbatch (``M n_m`` a step), and its rows of microbatch ``j`` are the ``j``-th
``n_m`` of its step's samples. Microbatch ``j`` of the job is those rows, member
after member: the union of the holders' data, in an order any device can rebuild.

[Note: labels stay home]
With ``labels_local`` the plan is U-shaped: the holders are stage 0 and, with the
same members in the same order and the same samples each, the last stage too
(:func:`coordinator.engine.assignments.u_tail`); helpers run the stages between. A
holder's last-stage member reads its own dataset again with the same sampler as
its stage 0 (the same seed and count), so its rows of microbatch ``j`` there are
its own samples of microbatch ``j``, and it takes their labels from its own
step's batch: no stage sends labels, and the helpers see activations and
gradients only. An agent then holds two stages of one job (:mod:`edge.agent`).

[Note: loss scaling]
Each microbatch's loss is the mean over its own samples (or tokens) divided by
``M``. With equal microbatches the sum of the ``M`` scaled losses, and of their
gradients, is the mean over the whole batch: a step equals single-device
training on the same batch, and gradients accumulate over microbatches in the
same order whatever the number of stages, so the results agree bit for bit on
CPU with the fp32 codec.

[Note: a device's own compute seconds]
A step report's ``compute_s`` is wall time: what the step took here, including the
time other processes of the host held a CPU this stage wanted. Its ``own_compute_s``
leaves that out where it can be told apart: on the CPU with one torch thread and no
CPU quota, the compute thread's CPU seconds hold all of its work, and nothing but
other processes makes its wall time longer, so the CPU seconds (times the
throttle's slowdown, which emulates a device that much slower) are what the device
itself took. Elsewhere it is the wall time: a CUDA stage runs asynchronously, with
several threads the work is not on one thread, and under a CPU quota (a container's,
the kernel testbed's) the stalls are the device's own limit. A decision that
compares devices (:mod:`coordinator.engine.rebalance`) weighs ``own_compute_s``:
on a host busy with other work, devices emulated side by side are slowed alike in
wall time but a throttled one is not (it sleeps to ``slowdown`` x its CPU seconds,
so contention the sleep absorbs does not add up), and wall times would shrink a
4x slowdown towards 1x as the host gets busier.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from edge.models.datasets import build_dataset
from edge.models.user_code import ANY_CODE, CodeAllowance
from edge.models.zoo import get_model
from edge.runtime.checkpoint import load_state, read_state, select, stage_state
from edge.runtime.compiling import CompileWatch, compiled
from edge.runtime.data import EpochSampler, check_data_fits, load_batch, open_local
from edge.runtime.group_sum import GroupSum
from edge.runtime.links import block, expected_frames
from edge.runtime.outer_sync import OuterSync
from edge.runtime.schedules import is_split, make_schedule
from edge.runtime.split_backward import WeightBackward, input_backward
from edge.runtime.step_clock import StepClock
from edge.transport.base import Transport
from edge.wire.frames import Codec, Kind, encode_frame
from edge.wire.groups import pieces
from edge.wire.messages import OptimizerSpec, StageAssignment, StepReport

if TYPE_CHECKING:
    from edge.models.local_data import LocalData
    from edge.server.data_parallel import DataParallel

__all__ = [
    "StageDevice",
    "StageRuntime",
    "batchnorm_in",
    "build_optimizer",
    "group_batchnorm_error",
    "loss_fn",
]

Reporter = Callable[[Any], None]
Replicator = Callable[[int, bytes], None]
"""``replicate(step, state)``: publish the stage's state at the start of ``step``."""


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (classes, or vocabulary for language models)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batchnorm_in(segment: torch.nn.Module) -> str | None:
    """The name of the first BatchNorm module in ``segment``, if it has one."""
    return next((n for n, mod in segment.named_modules() if isinstance(mod, _BatchNorm)), None)


def group_batchnorm_error(stage: int, members: int, norm: str) -> str:
    """Why a group cannot train a stage with BatchNorm ``norm``: one line."""
    return (
        f"stage {stage}: a group of {members} devices cannot train BatchNorm ({norm}): "
        "its statistics would cover a member's share, not the microbatch (use norm=group)"
    )


def build_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer | None:
    """The optimizer a stage steps after its flush (``None`` for a segment without weights)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return None
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    # On a GPU the fused kernel: one launch for every parameter's update, not a few each.
    fused = True if all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(
        params,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        fused=fused,
    )


class _Step:
    """One step's work in progress on a stage: what it has taken, sent and computed."""

    def __init__(self, step: int, timeout: float, received_before: int) -> None:
        self.step, self.timeout, self.received_before = step, timeout, received_before
        self.clock = StepClock()
        self.compute = 0.0
        self.sent = 0
        self.loss_share: float | None = None
        """A group member's share of each microbatch's rows (and of its loss)."""
        self.xs: tuple[torch.Tensor, ...] = ()
        self.ys: tuple[torch.Tensor, ...] = ()
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.weight_passes: dict[int, WeightBackward] = {}
        """Split: each ``B``'s weight gradient, until its ``W`` runs."""
        self.ran: list[str] = []
        """What the step ran, action by action."""
        self.peak_held = 0


@dataclass
class _Summed:
    """What a step's sum of gradients (or a DiLoCo sync) did, for its report."""

    loss: float | None
    seconds: float = 0.0
    bytes: int = 0
    started: float = 0.0
    cpu_s: float = 0.0
    early: int = 0

    def of_group(self, group_sum: GroupSum, *, early: bool) -> None:
        """The bytes, start and CPU of ``group_sum``'s last sum (and what of it went early)."""
        self.bytes, self.started = group_sum.bytes_sent, group_sum.started
        self.cpu_s = group_sum.cpu_s
        self.early = group_sum.early_bytes if early else 0
        if early:  # sent from the last backward, left out of its compute
            self.seconds += group_sum.early_s
            self.cpu_s += group_sum.early_cpu_s


@dataclass(frozen=True, kw_only=True)
class StageDevice:
    """The device a stage runs on, as the stage sees it: what it is called, where its
    tensors live, the user code it allows and the datasets it holds."""

    device_id: str = "local"
    """The name the stage's reports give."""
    torch_device: str = "cpu"
    """Where the segment, its inputs and its gradients live (``cpu``, ``cuda:N``)."""
    allow_code: CodeAllowance = ANY_CODE
    """The user code an assignment may name ([Note: user code on devices])."""
    local_data: LocalData | None = None
    """The datasets this device holds, by name ([Note: local data]); ``None``: none."""


class StageRuntime:
    """Runs one stage of one job over a transport (see the module docstring)."""

    def __init__(
        self,
        assignment: StageAssignment,
        transport: Transport,
        *,
        on: StageDevice = StageDevice(),
        report: Reporter | None = None,
        slowdown: float = 1.0,
        replicate: Replicator | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        """Build the stage ``assignment`` names, ``on`` this device, over ``transport``:
        ``report`` hears its step reports, ``slowdown`` is its throttle, ``replicate``
        publishes its states and ``data_parallel`` is its replicas' (or its group's)
        process group."""
        if slowdown < 1:
            raise ValueError(f"slowdown must be at least 1 (got {slowdown})")
        # Emulate a device this many times slower: each compute block is stretched to
        # slowdown x the CPU time it took (duty-cycling: the software throttle).
        self.slowdown = slowdown
        self._cpu0 = 0.0
        self._sends0 = (0.0, 0.0)  # the sum's early sends when a block started
        self._own_s = 0.0
        """The step's compute seconds on the device itself ([Note: a device's own compute
        seconds]), summed by :meth:`_throttle`."""
        self._compiles0 = 0
        self._compile_s = 0.0
        """The step's seconds compiling ([Note: compiled stages]), out of its compute."""
        self.a = assignment
        self.transport = transport
        self.device = on.device_id
        self.report: Reporter = report or (lambda _event: None)
        self.replicate = replicate
        self.torch_device = torch.device(on.torch_device)
        # (edge.profiling times stages with this module: import it here, not above.)
        from edge.profiling.device import cgroup_limits, usable_memory_bytes

        limits = cgroup_limits() if self.torch_device.type == "cpu" else None
        self._cpu_is_own = (
            limits is not None and limits.cpu_quota_cores is None and not limits.cpu_hidden
        )
        """Whether, on one torch thread, the thread's CPU seconds are the device's own
        compute seconds: on the CPU, under no CPU quota (nor a hidden one)."""
        self.data_parallel = data_parallel
        self._cancelled = threading.Event()
        self.hold = False
        """Cancelled with ``hold``: keep the state for a hand-over (see :meth:`state_at`)."""
        self.finished = assignment.first_step - 1
        """The newest step this stage finished (its optimizer stepped)."""
        self._previous: tuple[int, bytes] | None = None
        """With ``handover``: the state at the start of step :attr:`finished`."""
        a = assignment
        if a.replicas > 1 and data_parallel is None:
            raise ValueError(f"{a.replicas} replicas need a data_parallel group")
        # An agent's allowance: see [Note: user code on devices] in edge.models.user_code.
        spec = get_model(a.model, seed=a.seed, allow_code=on.allow_code, **a.model_options)
        if a.end > spec.num_units:
            raise ValueError(f"segment [{a.start}, {a.end}) beyond the {spec.num_units} units")
        self.unit_names = spec.unit_names
        # The data first: a dataset this device cannot hold is refused before any weight.
        self.sampler: EpochSampler | None = None
        self.reads = a.is_first or (a.is_last and a.labels_local)
        """Whether this stage reads the dataset: stage 0, and the tail of a U-shape."""
        if self.reads and a.local_data is not None:
            if on.local_data is None:
                raise ValueError(f"local dataset {a.local_data!r}: this device holds none")
            # This holder's samples a step: its rows of stage 0 (the tail's are the same).
            own = a.samples_of(0)[a.member] * a.microbatches
            self.dataset, self.sampler = open_local(on.local_data, a.local_data, own, a.seed)
        elif a.is_first:
            self.dataset = build_dataset(
                a.dataset, "train", allow_code=on.allow_code, **a.dataset_options
            )
            check_data_fits(self.dataset, a.dataset, usable_memory_bytes())
            self.sampler = EpochSampler(len(self.dataset), a.batch_size, a.seed)  # type: ignore[arg-type]
        self.segment = spec.build_segment(a.start, a.end).train().to(self.torch_device)
        self.forward: Callable[[torch.Tensor], torch.Tensor] = self.segment
        """The segment's forward: compiled where the job says ([Note: compiled stages])."""
        self._compiling: CompileWatch | None = None
        self.rows = block(a)
        """The rows ``[lo, hi)`` of every microbatch this member computes."""
        norm = batchnorm_in(self.segment) if a.group_size > 1 else None
        if norm is not None:
            raise ValueError(group_batchnorm_error(a.stage, a.group_size, norm))
        self.optimizer = build_optimizer(a.optimizer, self.segment.parameters())
        self.actions = make_schedule(a.schedule, a.num_stages, a.microbatches)[a.stage]
        self.split = is_split(self.actions)
        """Whether a backward runs in two actions, ``B`` then ``W``."""
        if a.compile:
            self.forward, self._compiling = compiled(self.segment)
        self.codec_out = Codec.parse(a.codec_out)
        self.codec_in = Codec.parse(a.codec_in)
        self.expected = expected_frames(a, spec, self.dataset if self.reads else None)
        """What the plan lets this stage receive (see :mod:`edge.runtime.links`)."""
        self._weights = [p for p in self.segment.parameters() if p.requires_grad]
        """What a weight pass (``W``) accumulates into."""
        self.group_sum: GroupSum | None = None
        if a.group_size > 1 and data_parallel is None:
            self.group_sum = GroupSum(a, transport, self._weights)
            self.expected |= self.group_sum.expected
        self.outer = self._outer_sync(a)
        """Non-exact, in a group: its own steps, and the group's every few."""
        self.inbox = transport.attach(a.job, a.stage, a.member, members=a.group_size)
        self._expect(a.first_step)

    def _outer_sync(self, a: StageAssignment) -> OuterSync | None:
        """The member's DiLoCo state ([Note: DiLoCo in a group]), when its job asks for it
        and it is in a group; a one-line :class:`ValueError` where it cannot run yet."""
        if a.diloco is None or a.group_size == 1:
            return None
        if self.group_sum is None:
            raise ValueError("diloco: a group over torch.distributed cannot sync less often yet")
        if a.replicate_every or a.handover:
            raise ValueError("diloco cannot be combined with fault tolerance yet")
        lo, hi = self.rows
        return OuterSync(self._weights, a.diloco, (hi - lo) / sum(a.samples_of(a.stage)))

    def _outer_step(self, step: int, loss: float | None) -> tuple[float | None, float, float]:
        """A non-exact member's step: its own optimizer's, on its rows' mean gradient, and
        at a sync the group's outer step. The loss to report (the group's at a sync,
        member 0's own between), the compute seconds and the sum's seconds."""
        assert self.outer is not None and self.group_sum is not None
        outer, a = self.outer, self.a
        t0 = self._start()
        outer.own_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        compute = self._throttle(t0)
        if not outer.due(step, a.steps):
            own = None if loss is None or a.member else loss / outer.share
            return own, compute, 0.0
        outer.outer_gradients()
        t0 = time.perf_counter()
        loss = self.group_sum.sum(self.inbox, step, loss)
        reduce = time.perf_counter() - t0
        t0 = self._start()
        outer.step()
        return loss, compute + self._throttle(t0), reduce

    def _expect(self, step: int) -> None:
        """Have the inbox keep only the frames of the plan, for ``step`` and the next."""
        a = self.a
        every = self.outer.spec.every if self.outer is not None else 1
        self.inbox.expect(
            self.expected,
            microbatches=a.microbatches,
            step=step,
            members=a.group_size,
            group_every=every,
        )

    def _start(self) -> float:
        """Start timing a compute block: its wall-clock start (and CPU start, kept here)."""
        self._cpu0 = time.thread_time()
        if self.group_sum is not None:
            self._sends0 = (self.group_sum.early_s, self.group_sum.early_cpu_s)
        if self._compiling is not None:
            self._compiles0 = self._compiling.compiles
        return time.perf_counter()

    def _throttle(self, t0: float) -> float:
        """Wall time since ``t0`` (from :meth:`_start`), stretched by the slowdown; the
        block's own seconds ([Note: a device's own compute seconds]) go to ``_own_s``.

        The block is made to last ``slowdown`` x the CPU time this thread spent in
        it, not x its wall time: time lost waiting for a CPU another process holds
        is not multiplied (that would turn a busy host into a much slower device).
        With more than one torch thread the work is not all on this thread, so the
        wall time is stretched instead.

        [Note: a block's own seconds]
        A group's sum sends its first pieces from the last backward's gradient hooks
        ([Note: the sum overlapped with the backward] in :mod:`edge.runtime.group_sum`),
        on this thread, inside the block. Sending is not compute: its wall and CPU
        seconds (``GroupSum.early_s``, ``early_cpu_s``) are left out of the block, so
        the throttle does not stretch them by the FLOP ratio (an emulated Pi's eight
        holders would pay each piece's framing 55x over, where the scalar method's quota
        already runs it at the Pi's scalar speed), and they count in the step's sum
        (``allreduce_s``), not its compute.
        """
        sent_s = sent_cpu = 0.0
        if self.group_sum is not None:
            sent_s = self.group_sum.early_s - self._sends0[0]
            sent_cpu = self.group_sum.early_cpu_s - self._sends0[1]
        spent = time.perf_counter() - t0 - sent_s
        single = torch.get_num_threads() == 1
        cpu = time.thread_time() - self._cpu0 - sent_cpu
        compiling = self._compiling
        if compiling is not None and compiling.compiles != self._compiles0:
            self._compile_s += spent  # it compiled: not compute ([Note: compiled stages])
            return 0.0
        wall = spent
        if self.slowdown > 1:
            time.sleep(max(0.0, (cpu if single else spent) * self.slowdown - spent))
            wall = time.perf_counter() - t0 - sent_s
        self._own_s += cpu * self.slowdown if single and self._cpu_is_own else wall
        return wall

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast for ``precision="bf16"``, nothing for fp32."""
        if self.a.precision == "bf16":
            return torch.autocast(self.torch_device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this stage's device (a no-op on the host)."""
        return t if t.device == self.torch_device else t.to(self.torch_device, non_blocking=True)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.segment.parameters())

    def cancel(self, hold: bool = False) -> None:
        """Stop at the next wait; :meth:`run` returns without finishing. With ``hold`` the
        caller keeps the stage for a hand-over (:meth:`state_at`)."""
        self.hold = self.hold or hold
        self._cancelled.set()
        self.inbox.close()

    def _send(
        self,
        stage: int,
        channel: str,
        kind: Kind,
        step: int,
        mb: int,
        tensor: torch.Tensor,
        codec: Codec,
    ) -> int:
        """Send the rows of ``tensor`` (this member's block of microbatch ``mb``) that each
        member of ``stage`` holds; bytes sent."""
        a, (lo, hi) = self.a, self.rows
        if a.group_samples is None:
            frame = encode_frame(kind, a.job, step, mb, tensor, codec)
            self.transport.send(a.job, stage, channel, frame)  # type: ignore[arg-type]
            return len(frame)
        sent = 0
        for member, rows in pieces(a.samples_of(stage), (lo, hi)):
            part = tensor if rows == (lo, hi) else tensor[rows[0] - lo : rows[1] - lo]
            frame = encode_frame(kind, a.job, step, mb, part, codec, first=rows[0])
            self.transport.send(a.job, stage, channel, frame, member)  # type: ignore[arg-type]
            sent += len(frame)
        return sent

    def _take(self, kind: Kind, sender: int, step: int, mb: int, timeout: float) -> torch.Tensor:
        """This member's block of microbatch ``mb`` of ``kind``, from stage ``sender``:
        the pieces its members send, in row order, concatenated."""
        a = self.a
        if a.group_samples is None:
            return self.inbox.take(kind, step, mb, timeout).tensor
        parts = [
            self.inbox.take(kind, step, mb, timeout, first=rows[0]).tensor
            for _, rows in pieces(a.samples_of(sender), self.rows)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def run_step(self, step: int) -> StepReport:
        """Execute this stage's actions for ``step`` and step the optimizer."""
        a = self.a
        self._own_s = self._compile_s = 0.0
        st = _Step(step, a.recv_timeout_s, self.inbox.bytes_received)
        lo, hi = self.rows
        if a.group_size > 1:  # its share of each microbatch's loss ([Note: groups on the wire])
            st.loss_share = (hi - lo) / sum(a.samples_of(a.stage))
        if self.reads:
            self._load(st)
        for action in self.actions:
            if action.kind == "F":
                self._forward(st, action.microbatch)
                continue
            if a.group_size > 1 and action is self.actions[-1] and self.outer is None:
                self._arm_sum(st)  # the last backward: the sum starts as gradients are final
            if action.kind == "W":
                self._weight_pass(st, action.microbatch)
            else:
                self._backward(st, action.microbatch)
        loss = float(sum(v.item() for v in st.losses.values())) if a.is_last else None
        summed = self._sum(st, loss)
        if a.handover:  # the state at the start of this step, until the next one ends
            self._previous = (step, self.state(step))
        t0 = self._start()
        if self.optimizer is not None and self.outer is None:  # (a non-exact one stepped)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        st.compute += self._throttle(t0)
        self.inbox.forget_before(step + 1)
        return self._report(st, summed)

    def _load(self, st: _Step) -> None:
        """Read the step's batch (this replica's, this member's rows of each microbatch)
        and send the last stage its labels, unless they stay home."""
        a, m = self.a, self.a.microbatches
        assert self.sampler is not None
        x, y = load_batch(self.dataset, self.sampler, st.step)
        if a.replicas > 1:  # this replica's share of the step's batch
            share = a.batch_size // a.replicas
            x = x[a.replica * share : (a.replica + 1) * share]
            y = y[a.replica * share : (a.replica + 1) * share]
        st.xs, st.ys = self._here(x).chunk(m), self._here(y).chunk(m)
        if a.group_samples is not None and a.local_data is None:  # its rows of each
            lo, hi = self.rows
            st.xs, st.ys = tuple(t[lo:hi] for t in st.xs), tuple(t[lo:hi] for t in st.ys)
        if not a.is_last and not a.labels_local:
            for mb, labels in enumerate(st.ys):
                with st.clock.sending("L", mb):
                    st.sent += self._send(
                        a.num_stages - 1, "fwd", Kind.LABELS, st.step, mb, labels, Codec.RAW
                    )

    def _forward(self, st: _Step, mb: int) -> None:
        """Microbatch ``mb``'s forward: its input taken (or read), its output sent on, or on
        the last stage its loss."""
        a = self.a
        if a.is_first:
            inp = st.xs[mb]
        else:
            with st.clock.waiting("A", mb):
                taken = self._take(Kind.ACTIVATION, a.stage - 1, st.step, mb, st.timeout)
            inp = self._here(taken)
            if inp.is_floating_point():
                inp = inp.detach().requires_grad_()
        st.inputs[mb] = inp
        t0 = self._start()
        with self._autocast():
            out = self.forward(inp)
        st.compute += self._throttle(t0)
        if a.is_last:
            if self.reads:  # its own labels ([Note: labels stay home])
                target = st.ys[mb]
            else:
                with st.clock.waiting("L", mb):
                    target = self._here(self._take(Kind.LABELS, 0, st.step, mb, st.timeout))
            t0 = self._start()
            m = a.microbatches
            mb_loss = loss_fn(out.float(), target)
            st.losses[mb] = mb_loss / m if m > 1 else mb_loss  # /1 is exact: skip it
            if st.loss_share is not None:
                st.losses[mb] = st.losses[mb] * st.loss_share
            st.compute += self._throttle(t0)
        else:
            with st.clock.sending("A", mb):
                st.sent += self._send(
                    a.stage + 1, "fwd", Kind.ACTIVATION, st.step, mb, out, self.codec_out
                )
            st.outputs[mb] = out
        st.ran.append(f"F{mb}")
        st.peak_held = max(st.peak_held, len(st.inputs.keys() | st.outputs.keys()))

    def _backward(self, st: _Step, mb: int) -> None:
        """Microbatch ``mb``'s backward (``B``): the output's gradient taken (or the loss),
        the input's gradient sent back; split, the weights' gradient is left for its ``W``."""
        a = self.a
        if a.is_last:
            out, grad = st.losses[mb], None
            t0 = self._start()
        else:
            with st.clock.waiting("G", mb):
                taken = self._take(Kind.GRADIENT, a.stage + 1, st.step, mb, st.timeout)
            grad = self._here(taken)
            out = st.outputs.pop(mb)
            t0 = self._start()
        if self.split:  # the input's gradient now, the weights' at this W
            inp = st.inputs[mb]
            st.weight_passes[mb] = input_backward(out, grad, inp, self._weights)
        else:
            out.backward(grad)
            inp = st.inputs.pop(mb)
        st.compute += self._throttle(t0)
        if not a.is_first and inp.grad is not None:
            with st.clock.sending("G", mb):
                st.sent += self._send(
                    a.stage - 1, "bwd", Kind.GRADIENT, st.step, mb, inp.grad, self.codec_in
                )
        st.ran.append(f"B{mb}")

    def _weight_pass(self, st: _Step, mb: int) -> None:
        """Microbatch ``mb``'s weight gradient (``W``), which its ``B`` left."""
        t0 = self._start()
        st.weight_passes.pop(mb).run()
        st.compute += self._throttle(t0)
        st.inputs.pop(mb)
        st.ran.append(f"W{mb}")

    def _arm_sum(self, st: _Step) -> None:
        """Before the step's last backward: a group's sum sends each piece as soon as its
        gradients are final ([Note: the sum overlapped with the backward])."""
        losses = list(st.losses.values()) if self.a.is_last else []
        if self.group_sum is not None:  # the loss goes out in a frame: read it now
            self.group_sum.arm(st.step, float(sum(v.item() for v in losses)) if losses else None)
        elif self.data_parallel is not None:  # it stays on the device: no wait for its work
            mine = torch.stack([v.detach().double() for v in losses]).sum() if losses else None
            self.data_parallel.arm(self.segment.parameters(), mine)

    def _sum(self, st: _Step, loss: float | None) -> _Summed:
        """The group's or the replicas' sum of this step's gradients (a DiLoCo member's own
        step, and its group's sum when due), and the loss to report."""
        a, out = self.a, _Summed(loss)
        if self.outer is not None and self.group_sum is not None:
            out.loss, took, out.seconds = self._outer_step(st.step, loss)
            st.compute += took
            if self.outer.due(st.step, a.steps):  # the group synced
                out.of_group(self.group_sum, early=False)
                st.sent += out.bytes
        elif self.group_sum is not None:
            t0 = time.perf_counter()
            out.loss = self.group_sum.sum(self.inbox, st.step, loss)
            out.seconds = time.perf_counter() - t0
            out.of_group(self.group_sum, early=True)
            st.sent += out.bytes
        if self.data_parallel is not None and a.group_size > 1:
            t0 = time.perf_counter()
            before = self.data_parallel.bytes_reduced
            out.loss = self.data_parallel.sum_gradients(self.segment.parameters(), out.loss)
            out.seconds = time.perf_counter() - t0
            out.bytes = self.data_parallel.bytes_reduced - before
            out.early = self.data_parallel.early_bytes
        elif self.data_parallel is not None:
            out.seconds = self.data_parallel.average_gradients(self.segment.parameters())
            if out.loss is not None:
                t0 = time.perf_counter()
                out.loss = self.data_parallel.average(out.loss)
                out.seconds += time.perf_counter() - t0
        return out

    def _report(self, st: _Step, summed: _Summed) -> StepReport:
        a = self.a
        return StepReport(
            job=a.job,
            stage=a.stage,
            member=a.member,
            device=self.device,
            step=st.step,
            samples=(self.rows[1] - self.rows[0]) * a.microbatches,
            loss=summed.loss,
            compute_s=st.compute,
            own_compute_s=self._own_s,
            compile_s=self._compile_s,
            wait_s=st.clock.wait_s,
            send_s=st.clock.send_s,
            step_s=st.clock.elapsed(),
            started_at=st.clock.started_at,
            bytes_sent=st.sent,
            bytes_received=self.inbox.bytes_received - st.received_before,
            frames_dropped=sum(self.inbox.dropped.values()),
            allreduce_s=summed.seconds,
            allreduce_bytes=summed.bytes,
            allreduce_started=summed.started,
            allreduce_cpu_s=summed.cpu_s,
            allreduce_early_bytes=summed.early,
            actions=" ".join(st.ran),
            peak_held=st.peak_held,
            timeline=st.clock.timeline(),
        )

    def run(self, first_step: int | None = None) -> int:
        """Run the job's steps from ``first_step`` (the assignment's by default); how many ran.

        The caller reports :class:`~edge.wire.messages.StageDone` (after saving or
        sending the weights, which the coordinator expects before it).
        """
        a, done = self.a, 0
        replicate, every = self.replicate, a.replicate_every
        first = a.first_step if first_step is None else first_step
        self._expect(first)
        try:
            for step in range(first, a.steps):
                if self._cancelled.is_set():
                    break
                report = self.run_step(step)
                self.finished = step
                due = every and (step + 1) % every == 0 and step + 1 < a.steps
                if replicate and due and a.member == 0:
                    t0 = time.perf_counter()
                    data = self.state(step + 1)
                    replicate(step + 1, data)
                    cost = {"replica_bytes": len(data), "replica_s": time.perf_counter() - t0}
                    report = report.model_copy(update=cost)
                self.report(report)
                done += 1
        finally:
            self.transport.detach(self.a.job, self.a.stage, self.a.member)
        return done

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def weights(self) -> bytes:
        """The segment's weights as safetensors bytes (keys are unit-prefixed)."""
        state = {k: v.detach().cpu().contiguous() for k, v in self.segment.state_dict().items()}
        return safetensors.torch.save(state)

    def state(self, step: int) -> bytes:
        """Weights and optimizer state as a state blob for ``step`` (steps done so far)."""
        a = self.a
        return stage_state(
            self.segment,
            self.optimizer,
            step=step,
            job=a.job,
            stage=a.stage,
            start=a.start,
            end=a.end,
        )

    def state_at(self, step: int) -> bytes:
        """The state blob for ``step`` after a stop: the live state for the step after the
        newest one finished, or (with ``handover``) the one kept from the start of that
        step. Any other step is a one-line :class:`ValueError`."""
        if step == self.finished + 1:
            return self.state(step)
        if self._previous is not None and self._previous[0] == step:
            return self._previous[1]
        kept = [self.finished + 1] + ([self._previous[0]] if self._previous else [])
        raise ValueError(f"no state for step {step}: this stage holds steps {kept}")

    def restore(self, data: bytes) -> int:
        """Load a state blob of this job covering this segment, for ``first_step``.

        Raises a one-line :class:`ValueError` (and changes nothing) for a blob
        that is malformed, of another job or step, or lacks some of the units.
        Returns the step it is for.
        """
        a = self.a
        try:
            state = read_state(data)
            if state.job != a.job:
                raise ValueError(f"the state is of job {state.job}, not {a.job}")
            if state.step != a.first_step:
                raise ValueError(
                    f"the state is for step {state.step}, the stage starts at step {a.first_step}"
                )
            load_state(
                self.segment, self.optimizer, select([state], a.start, a.end, self.unit_names)
            )
        except ValueError as exc:
            raise ValueError(f"restore: {exc}") from None
        return state.step
