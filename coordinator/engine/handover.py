"""A group member dies: the survivors hand over the state of a step every stage reached.

[Note: a group member dies]
The members of a stage group hold the same weights after every step: they sum
their gradients and step the same optimizer (:mod:`edge.runtime.group_sum`). So
when a member dies its units are not lost: every surviving co-member holds them,
and every other stage is alive and holds its own. Rolling back to a replica
would throw away steps that every stage finished; instead the stages hand over
the state of one step that each of them can give:

- Stages are at most one step apart. A stage finishes step ``j`` only after
  every stage (every member) began ``j``: its forward of ``j`` came from stage 0
  through every stage before it, its gradients of ``j`` from the last stage
  through every stage after it, and its group's sum of ``j`` from every
  co-member. A stage begins ``j`` only once it finished ``j - 1``.
- So with ``f`` the newest step each stopped stage finished, ``a = min(f) + 1``
  is a step every stage can give: one with ``f = a - 1`` holds the state of step
  ``a`` live (its optimizer has not stepped since), one with ``f = a`` keeps the
  copy it took just before its optimizer stepped in step ``a`` (assignments with
  ``handover`` keep it: :meth:`edge.runtime.stage.StageRuntime.state_at`).

:class:`Handover` does this for one attempt of a resilient run
(:mod:`coordinator.engine.resilient`), from inside
:func:`~coordinator.engine.runners.run_on_agents` while the attempt's grants still
hold: the attempt's stages are cancelled with ``hold``; each answers ``held``
with its ``f``; once every living device has answered, one living member per
stage is asked (``handover``) for its state of step ``a``, which arrives on the
stage's replica topic like any replica. The next attempt, planned over the
survivors, starts at step ``a`` from those states. No step that every stage
finished runs again; the step in flight when the member died (``a``) does.

Only a death the survivors cover is handed over: every dead device must be a
member of a group with a living member. A stage of one device that dies takes
its units with it, and the run rolls back to its replicas as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from coordinator.engine.replicas import ReplicaStore
from coordinator.planner.score import Plan
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import HandOver, StageHeld
from edge.wire.topics import device_cmd

__all__ = ["Handover"]

log = logging.getLogger(__name__)


class Handover:
    """The hand-over of one attempt's state after a group member died (see the Note)."""

    def __init__(
        self,
        job: str,
        plan: Plan,
        dead: Callable[[], list[str]],
        replicas: ReplicaStore,
        timeout_s: float = 30.0,
    ) -> None:
        self.job = job
        self.plan = plan
        self.dead = dead
        """The devices of the plan known to be dead, now."""
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.holders = {
            (s, m): device
            for s, st in enumerate(plan.stages)
            for m, device in enumerate(st.devices)
        }
        self.held: dict[tuple[int, int], int] = {}
        """``(stage, member)`` -> the newest step it finished, as it answered."""
        self.step: int | None = None
        """The step handed over, once :meth:`collect` succeeded."""
        self._cond = threading.Condition()

    def wanted(self) -> bool:
        """Whether the dead devices are all members of groups that have a living member."""
        dead = set(self.dead())
        if not dead:
            return False
        for st in self.plan.stages:
            if dead & set(st.devices) and (len(st.devices) == 1 or set(st.devices) <= dead):
                return False
        return True

    def on_held(self, event: StageHeld, sender: str | None) -> None:
        """A stage's ``held`` answer (paho's thread); one from a device that does not hold
        that stage and member is logged and dropped."""
        key = (event.stage, event.member)
        if self.holders.get(key) != sender or event.device != sender:
            log.warning("dropped a held answer for %s from %s", key, sender)
            return
        with self._cond:
            self.held[key] = event.finished
            self._cond.notify_all()

    def _answered(self) -> bool:
        dead = set(self.dead())
        return all(key in self.held for key, d in self.holders.items() if d not in dead)

    def collect(self, control: MqttTransport) -> int | None:
        """After the attempt's stages were cancelled with ``hold``: the step whose state
        every stage handed over (kept in :attr:`step`), or ``None`` when the living did
        not all answer, or their states did not all arrive, within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not self._answered():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("hand-over: no held answer from %s", self._silent())
                    return None
                self._cond.wait(min(left, 0.1))
            held = dict(self.held)
        step = min(held.values()) + 1
        if step > 0:
            dead = set(self.dead())
            for s in range(len(self.plan.stages)):
                living = [m for (t, m) in held if t == s and self.holders[(t, m)] not in dead]
                member = min(living or [m for (t, m) in held if t == s])
                cmd = HandOver(job=self.job, step=step).model_dump_json()
                control.publish(device_cmd(self.holders[(s, member)]), cmd, 1)
            while self.replicas.newest_complete(step) != step:
                if time.monotonic() >= deadline:
                    log.warning("hand-over: the states of step %d did not all arrive", step)
                    return None
                time.sleep(0.02)
        self.step = step
        return step

    def _silent(self) -> list[tuple[int, int]]:
        dead = set(self.dead())
        return [k for k, d in self.holders.items() if d not in dead and k not in self.held]
