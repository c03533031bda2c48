"""Mutants the suite must catch, and the runner behind ``make mutants``.

A mutant is a small, hand-written bug of the kind that training frameworks
really ship: a loss scaled wrongly, a microbatch skipped, a replica that trains
on the whole batch, a duplicate frame taken twice. Each one names the exact
text it replaces in one file and the tests that must fail because of it. The
runner copies the working tree (tracked and untracked files, not ignored ones)
to a temporary directory per mutant, applies the mutant there, runs only its
tests against the copy (``PYTHONPATH`` points at the copy, so agent and rank
processes the tests start import the mutated code too), and reports each
mutant as killed, with the test that failed, or survived. It exits 1 if any
survived or could not be applied, so a refactoring that silently disarms a test
is caught as soon as the mutant stops dying.

    python tests/mutants.py              # all, two at a time
    python tests/mutants.py --list       # what there is
    python tests/mutants.py NAME...      # some
    python tests/mutants.py --jobs 1 --json results.json

Each later feature adds its own mutant here, with the tests that catch it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_TIMEOUT_S = 240


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    """The bug, in a sentence."""
    path: str
    """The file it changes, relative to the repository root."""
    old: str
    """Text that occurs exactly once in ``path``..."""
    new: str
    """...and what it becomes."""
    tests: tuple[str, ...]
    """pytest node ids (files, or ``file::test``) that must fail."""


_GROUP_PARITY = "tests/e2e/test_group_parity.py::test_groups_in_process_equal_one_device"
"""Group training equals one device's, in-process, for every shares, sizes and schedule."""

MUTANTS = [
    Mutant(
        name="loss-not-scaled",
        what="each microbatch's loss is not divided by the number of microbatches",
        path="edge/runtime/stage.py",
        old="losses[mb] = mb_loss / m if m > 1 else mb_loss",
        new="losses[mb] = mb_loss",
        tests=(
            "tests/unit/edge/runtime/test_reference_parity.py::test_three_stages_equal_the_reference",
        ),
    ),
    Mutant(
        name="replicas-take-whole-batch",
        what="every data-parallel replica trains on the whole batch instead of its slice",
        path="edge/runtime/stage.py",
        old="if a.replicas > 1:  # this replica's share of the step's batch",
        new="if False:  # this replica's share of the step's batch",
        tests=("tests/integration/test_replica_shares.py",),
    ),
    Mutant(
        name="local-shards-overlap",
        what="each shard of a local dataset takes one sample of the next shard too",
        path="edge/models/datasets.py",
        old="piece = order[(shard - 1) * size // shards : shard * size // shards]",
        new="piece = order[(shard - 1) * size // shards : shard * size // shards + 1]",
        tests=(
            "tests/unit/edge/models/test_local_data.py::test_shards_are_disjoint_and_cover_the_split",
        ),
    ),
    Mutant(
        name="local-code-without-allowance",
        what="an agent's --data imports a user's dataset module that --allow-code does not allow",
        path="edge/models/local_data.py",
        old='return build_dataset(spec, "train", allow_code=allow_code), "code", None',
        new='return build_dataset(spec, "train"), "code", None',
        tests=("tests/unit/edge/models/test_local_data.py::test_user_code_only_under_allow_code",),
    ),
    Mutant(
        name="local-sample-announced",
        what="an agent's profile carries the first sample of each local dataset",
        path="edge/models/local_data.py",
        old="        details[DETAILS_KEY] = {",
        new=(
            "        details['peek'] = [d.dataset[0][0].tolist() for d in local.values()]\n"
            "        details[DETAILS_KEY] = {"
        ),
        tests=(
            "tests/integration/test_agent_local_data.py::test_the_profile_lists_the_datasets_and_no_sample_crosses_the_wire",
        ),
    ),
    Mutant(
        name="rebalancer-misreads-time",
        what="the rebalancer reads stage 1's measured compute time three times too long",
        path="coordinator/engine/rebalance.py",
        old="st.device: compute_s[st.device] / (score.compute_s[s] * m)",
        new="st.device: compute_s[st.device] * (3 if s == 1 else 1) / (score.compute_s[s] * m)",
        tests=("tests/unit/coordinator/engine/test_rebalance.py",),
    ),
    Mutant(
        name="own-seconds-count-the-host",
        what="a stage's own compute seconds count the time other processes held the CPU",
        path="edge/runtime/stage.py",
        old="self._own_s += cpu * self.slowdown if single and self._cpu_is_own else wall",
        new="self._own_s += wall",
        tests=(
            "tests/unit/edge/runtime/test_unit_times.py"
            "::test_time_another_process_takes_is_not_the_devices_own",
        ),
    ),
    Mutant(
        name="move-priced-at-worst-redo",
        what="the rebalancer prices every move as redoing replicate_every steps",
        path="coordinator/engine/rebalance.py",
        old="cost = redo * now.step_time_s + self.restart_s",
        new="cost = self.replicate_every * now.step_time_s + self.restart_s",
        tests=("tests/unit/coordinator/engine/test_rebalance.py",),
    ),
    Mutant(
        name="last-microbatch-skipped",
        what="every stage skips the last microbatch of each step",
        path="edge/runtime/stage.py",
        old="        for action in self.actions:\n",
        new="        for action in [x for x in self.actions if x.microbatch < m - 1]:\n",
        tests=(
            "tests/unit/edge/runtime/test_reference_parity.py::test_three_stages_equal_the_reference",
        ),
    ),
    Mutant(
        name="stage-skips-optimizer",
        what="stage 1 never steps its optimizer",
        path="edge/runtime/stage.py",
        old="        if self.optimizer is not None and self.outer is None:  # (a non-exact one",
        new="        if self.optimizer is not None and self.outer is None and a.stage != 1:  #",
        tests=(
            "tests/unit/edge/runtime/test_reference_parity.py::test_three_stages_equal_the_reference",
        ),
    ),
    Mutant(
        name="gradient-half-scale",
        what="the gradient sent back over a link is halved",
        path="edge/runtime/stage.py",
        old='"bwd", Kind.GRADIENT, st.step, mb, inp.grad, self.codec_in',
        new='"bwd", Kind.GRADIENT, st.step, mb, inp.grad * 0.5, self.codec_in',
        tests=(
            "tests/unit/edge/runtime/test_reference_parity.py::test_three_stages_equal_the_reference",
        ),
    ),
    Mutant(
        name="forwards-first-whatever-the-schedule",
        what="every stage runs all its forwards before any backward (GPipe), whatever the "
        "job names: parity cannot tell, the memory it holds can",
        path="edge/runtime/stage.py",
        old="self.actions = make_schedule(a.schedule, a.num_stages, a.microbatches)[a.stage]",
        new=(
            "self.actions = sorted(make_schedule(a.schedule, a.num_stages, a.microbatches)"
            '[a.stage], key=lambda x: x.kind == "B")'
        ),
        tests=(
            "tests/unit/edge/runtime/test_schedule_run.py",
            "tests/e2e/test_pipeline_parity.py::test_three_stages_over_mqtt_equal_one_device",
        ),
    ),
    Mutant(
        name="engine-shares-only-for-holders",
        what="the job engine hands the agents the plan's shares only on local data: other "
        "groups split equally",
        path="coordinator/engine/engine.py",
        old="                on_step=hooks.on_step,\n                shares=planned.shares,\n",
        new=(
            "                on_step=hooks.on_step,\n"
            "                shares=planned.shares if planned.holders else None,\n"
        ),
        tests=(
            "tests/e2e/test_planned_groups.py::test_the_engine_hands_real_agents_the_plans_unequal_shares",
        ),
    ),
    Mutant(
        name="duplicate-frame-accepted",
        what="an inbox accepts a frame whose key it has already seen",
        path="edge/transport/inbox.py",
        old='or ("duplicate" if head.key in self._seen else None)',
        new="or None",
        tests=("tests/integration/test_transport_conformance.py",),
    ),
    Mutant(
        name="restore-wrong-step",
        what="a stage restores a state blob of another step than the one it starts at",
        path="edge/runtime/stage.py",
        old="if state.step != a.first_step:",
        new="if False:",
        tests=("tests/unit/edge/runtime/test_checkpoint.py",),
    ),
    Mutant(
        name="planner-memory-off-by-one",
        what="the planner counts each stage one position nearer the end in its 1F1B memory",
        path="coordinator/planner/tables.py",
        old="factor = min(position_from_end, self.m)",
        new="factor = min(position_from_end - 1, self.m)",
        tests=("tests/unit/coordinator/planner/test_planner_exact.py",),
    ),
    # Issue 13's own feature: jobs with a fixed number of stages.
    Mutant(
        name="stages-at-most-n",
        what="a job asking for N stages may get a plan of fewer (the exact search keeps any size)",
        path="coordinator/planner/search.py",
        old="starts = np.where((size == stages)[:, None], starts, inf)",
        new="starts = np.where((size <= stages)[:, None], starts, inf)",
        tests=("tests/unit/coordinator/planner/test_partition.py",),
    ),
    # Issue 14's own features: one job engine for the service too, one device feed.
    Mutant(
        name="service-never-migrates",
        what="a job submitted through the REST API runs without the rebalancer",
        path="coordinator/service/manager.py",
        old="faults=tuple(self._faults_left(job, spec)),",
        new="faults=tuple(self._faults_left(job, spec)), rebalance=False,",
        tests=(
            "tests/e2e/test_migration.py::"
            "test_a_service_job_with_a_slowed_device_migrates_with_the_same_result",
        ),
    ),
    Mutant(
        name="cancel-keeps-no-reason",
        what="a job the user cancels while it is queued ends cancelled with no reason",
        path="coordinator/service/manager.py",
        old='self.store.set_job_state(job, "cancelled", reason="cancelled by the user")',
        new='self.store.set_job_state(job, "cancelled")',
        tests=(
            "tests/unit/coordinator/service/test_final_jobs.py::"
            "test_a_job_the_manager_ends_has_every_final_field",
            "tests/unit/coordinator/service/api/routes/test_final_job_routes.py::"
            "test_an_ended_job_shows_every_final_field",
        ),
    ),
    Mutant(
        name="feed-trusts-any-sender",
        what="a device status naming another device is believed on any device's topic",
        path="coordinator/engine/watch.py",
        old="if status.device != device:",
        new="if False:",
        tests=("tests/unit/coordinator/engine/test_watch.py",),
    ),
    Mutant(
        name="broker-default-allows-publish",
        what="the broker's default ACL lets any account publish anywhere",
        path="coordinator/access/dynsec.py",
        old='"publishClientSend": False,',
        new='"publishClientSend": True,',
        tests=("tests/security/test_attacker.py",),
    ),
    # Issue 35: a stage's device may read its stage's own inputs, not their siblings.
    Mutant(
        name="stage-reads-siblings",
        what="a stage's grant reads its topics' whole level ('+'): every stage's restore "
        "state and replica",
        path="coordinator/access/accounts.py",
        old='        rules += [("subscribeLiteral", topic), ("publishClientReceive", topic)]',
        new=(
            '        level = topic.rsplit("/", 1)[0] + "/+"\n'
            '        rules += [("subscribePattern", level), ("publishClientReceive", level)]'
        ),
        tests=(
            "tests/integration/test_stage_grants.py",
            "tests/security/test_stage_holder.py",
        ),
    ),
    Mutant(
        name="monitor-trusts-payload",
        what="an event counts if its payload names the stage's device, whoever sent it",
        path="coordinator/engine/monitor.py",
        old="if sender != holder or event.device != holder:",
        new="if event.device != holder:",
        tests=("tests/unit/coordinator/engine/test_senders.py",),
    ),
    # Issue 15's own feature: an agent imports only the user code its owner allows.
    Mutant(
        name="allowance-accepts-any-module",
        what="an agent's code allowance lets every module in, os included",
        path="edge/models/user_code.py",
        old='return any(module == p or module.startswith(p + ".") for p in self.prefixes)',
        new="return True",
        tests=(
            "tests/unit/edge/models/test_user_code.py",
            "tests/integration/test_agent_allow_code.py::"
            "test_an_open_agent_refuses_code_it_was_not_allowed_and_keeps_serving",
        ),
    ),
    Mutant(
        name="allowance-ignores-dot-boundary",
        what="an allowed prefix mypkg also lets in mypkgevil",
        path="edge/models/user_code.py",
        old='module.startswith(p + ".")',
        new="module.startswith(p)",
        tests=(
            "tests/unit/edge/models/test_user_code.py::test_a_prefix_matches_at_dot_boundaries",
            "tests/integration/test_agent_allow_code.py::"
            "test_an_open_agent_refuses_code_it_was_not_allowed_and_keeps_serving",
        ),
    ),
    Mutant(
        name="agent-ignores-allowance",
        what="an agent builds its stage with the default allowance (any code), not its own",
        path="edge/runtime/keeper.py",
        old="                on=self.settings,\n",
        new=(
            "                on=StageDevice(device_id=self.settings.device_id, "
            "torch_device=self.settings.torch_device, local_data=self.settings.local_data),\n"
        ),
        tests=(
            "tests/integration/test_agent_allow_code.py::"
            "test_an_open_agent_refuses_code_it_was_not_allowed_and_keeps_serving",
        ),
    ),
    Mutant(
        name="testbed-broker-anonymous",
        what="testbed up starts its broker anonymous and its agents with --insecure",
        path="coordinator/testbed/access.py",
        old="    if find_mosquitto() is not None:\n        return True\n",
        new="    if False:\n        return True\n",
        tests=("tests/e2e/test_testbed.py::test_software_method_trains_through_the_coordinator",),
    ),
    Mutant(
        name="testbed-coordinator-open-api",
        what="testbed up starts its coordinator without its API token: anyone here may enrol",
        path="coordinator/testbed/procs.py",
        old="    env = {**os.environ, API_TOKEN_ENV: state.api_token}\n",
        new="    env = {k: v for k, v in os.environ.items() if k != API_TOKEN_ENV}\n",
        tests=("tests/e2e/test_testbed.py::test_up_prints_the_api_token_that_enrolment_needs",),
    ),
    Mutant(
        name="shape-check-skipped",
        what="an inbox keeps a frame whatever shape and dtype its stage's plan implies",
        path="edge/transport/inbox.py",
        old="or self._mismatch(head.kind, head.shape, head.dtype, head.samples)",
        new="or None",
        tests=(
            "tests/integration/test_hostile_frames.py",
            "tests/unit/edge/transport/test_inbox.py",
        ),
    ),
    Mutant(
        name="bf16-clipped-to-fp16-range",
        what="the bf16 codec clips values to fp16's largest (65504) before rounding",
        path="edge/wire/frames.py",
        old="        t = t.to(_WIRE_DTYPE[codec])",
        new=(
            "        t = (t.clamp(-65504, 65504) if codec is Codec.BF16 else t)"
            ".to(_WIRE_DTYPE[codec])"
        ),
        tests=("tests/unit/edge/wire/test_codec_range.py",),
    ),
    # The REST API's hardening.
    Mutant(
        name="chunked-body-unbounded",
        what="a request body without Content-Length (chunked) is read whole, past the limit",
        path="coordinator/service/body_limit.py",
        old="                if received > self.max_bytes:\n",
        new="                if received > self.max_bytes and declared is not None:\n",
        tests=(
            "tests/unit/coordinator/service/test_body_limit.py",
            "tests/unit/coordinator/service/test_app.py::test_a_body_over_max_body_bytes_is_a_413",
        ),
    ),
    # Issue 15: nothing torn, and agents that join only stores they accept.
    Mutant(
        name="agent-joins-any-store",
        what="an agent joins a rendezvous store on any address an assignment names",
        path="edge/server/groups.py",
        old="return any(_address(a) == wanted for a in accepted)",
        new="return True",
        tests=("tests/unit/edge/server/test_groups.py",),
    ),
    Mutant(
        name="writes-in-place",
        what="a file that matters is written in place: a failed write leaves it torn",
        path="edge/files.py",
        old='tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")',
        new="(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), str(target))",
        tests=("tests/unit/edge/test_files.py",),
    ),
    # Issue 15: the embedded amqtt broker enforces the same accounts and ACLs.
    Mutant(
        name="amqtt-acl-allows-any-publish",
        what="the embedded amqtt broker lets any logged-in account publish on any topic",
        path="coordinator/local/amqtt_embedded.py",
        old="return _tables(self.config).allowed(session.username, _KIND[action], topic)",
        new=(
            "return action == Action.PUBLISH or "
            "_tables(self.config).allowed(session.username, _KIND[action], topic)"
        ),
        tests=("tests/integration/test_amqtt_security.py::test_the_embedded_broker_is_secure",),
    ),
    # Issue 16: planner version 2 (device groups, energy, deadlines).
    Mutant(
        name="groups-allreduce-summed",
        what="the exact group search adds all-reduces where the score takes the largest",
        path="coordinator/planner/group_search.py",
        old="            step = step + r.max(axis=1)",
        new="            step = step + r.sum(axis=1)",
        tests=("tests/unit/coordinator/planner/test_groups_exact.py",),
    ),
    Mutant(
        name="groups-memory-whole-microbatch",
        what="a group member's memory is checked as if it held the whole microbatch's activations",
        path="coordinator/planner/group_tables.py",
        old="got &= need_bytes(k, self.params, depth, w, self.b, self.acts) <= d.memory_bytes",
        new="got &= need_bytes(k, self.params, depth, 1.0, self.b, self.acts) <= d.memory_bytes",
        tests=("tests/unit/coordinator/planner/test_groups_exact.py",),
    ),
    Mutant(
        name="tables-link-own-formula",
        what="the search's tables write the link time out again, dividing in another order: "
        "their times differ from the score's in the last bit",
        path="coordinator/planner/tables.py",
        old=(
            "        link = link_s(b, out[None, None, :], lat[sender], lat[receiver], "
            "bw[sender], bw[receiver])\n"
        ),
        new=(
            "        link = 2 * (lat[sender] + lat[receiver]) / 1000 + 2 * b "
            "* out[None, None, :] * 8 / np.minimum(bw[sender], bw[receiver]) / 1e6\n"
        ),
        tests=("tests/unit/coordinator/planner/test_terms.py",),
    ),
    Mutant(
        name="groups-v1-share-of-budget",
        what="the group search asks version 1 with a share of the budget: cut short, its "
        "answer can be worse than version 1's own",
        path="coordinator/planner/group_search.py",
        old="    best, v1 = _version_1(problem, time_budget_s, stages)\n",
        new="    best, v1 = _version_1(problem, time_budget_s * 0.35, stages)\n",
        tests=("tests/unit/coordinator/planner/test_groups_v1.py",),
    ),
    Mutant(
        name="groups-spare-dominance-ignores-memory",
        what="the group search leaves out an unused device that only its memory sets apart",
        path="coordinator/planner/group_search.py",
        old="        and da.memory_bytes >= db.memory_bytes\n",
        new="",
        tests=("tests/unit/coordinator/planner/test_group_spares.py",),
    ),
    # Issue 16: groups in the runtime.
    Mutant(
        name="group-loss-not-shared",
        what="a group member's loss is not scaled by its share of the microbatch's samples",
        path="edge/runtime/stage.py",
        old="st.loss_share = (hi - lo) / sum(a.samples_of(a.stage))",
        new="st.loss_share = None",
        tests=(_GROUP_PARITY,),
    ),
    Mutant(
        name="group-sum-averaged",
        what="a group averages its members' gradients (and loss) instead of summing them",
        path="edge/runtime/group_sum.py",
        old="        self._send(Kind.GATHER, step, mine)  # all-gather: once, for everyone else",
        new="        mine /= g\n        self._send(Kind.GATHER, step, mine)",
        tests=(_GROUP_PARITY,),
    ),
    Mutant(
        name="group-gather-sent-per-member",
        what="a member publishes its summed chunk once per other member, not once for all",
        path="edge/runtime/group_sum.py",
        old="        self._send(Kind.GATHER, step, mine)  # all-gather: once, for everyone else",
        new="        for k in others:\n            self._send(Kind.GATHER, step, mine, k)",
        tests=("tests/integration/test_group_sum_mqtt.py",),
    ),
    Mutant(
        name="group-split-loses-remainder",
        what="split_samples hands out one sample too few of the remainder (off by one)",
        path="edge/wire/groups.py",
        old="for i in order[: n - sum(counts)]:",
        new="for i in order[: max(0, n - sum(counts) - 1)]:",
        tests=(_GROUP_PARITY,),
    ),
    Mutant(
        name="group-split-overshoots",
        what="split_samples hands out one sample more than the remainder: counts exceed n",
        path="edge/wire/groups.py",
        old="for i in order[: n - sum(counts)]:",
        new="for i in order[: n - sum(counts) + 1]:",
        tests=(_GROUP_PARITY,),
    ),
    Mutant(
        name="group-gather-reversed",
        what="a receiver concatenates the pieces of its block in reverse member order",
        path="edge/runtime/stage.py",
        old="for _, rows in pieces(a.samples_of(sender), self.rows)",
        new="for _, rows in reversed(pieces(a.samples_of(sender), self.rows))",
        tests=(_GROUP_PARITY,),
    ),
    Mutant(
        name="group-chunk-trusts-claim",
        what="a group member takes a gradient chunk as the member it claims, whatever its topic",
        path="edge/transport/inbox.py",
        old="if head.kind in _BY_MEMBER and head.microbatch != sender:",
        new="if False:",
        tests=(
            "tests/e2e/test_group_parity.py::"
            "test_a_member_cannot_pass_its_chunk_off_as_another_members",
        ),
    ),
    Mutant(
        name="handover-keeps-no-previous",
        what="a stage with handover never keeps the state of the step before its last update",
        path="edge/runtime/stage.py",
        old="if a.handover:  # the state at the start of this step",
        new="if False:  # the state at the start of this step",
        tests=("tests/unit/edge/runtime/test_held_state.py",),
    ),
    Mutant(
        name="handover-ignored",
        what="after a group member dies the run rolls back to its replicas, not the hand-over",
        path="coordinator/engine/resilient.py",
        old="handed = self.handover.step if self.handover is not None else None",
        new="handed = None",
        tests=(
            "tests/e2e/test_group_faults.py::test_a_killed_member_is_survived_without_rollback",
        ),
    ),
    Mutant(
        name="holders-slice-own-data",
        what="a holder of local data takes its group rows out of its own step's samples",
        path="edge/runtime/stage.py",
        old="if a.group_samples is not None and a.local_data is None:  # its rows of each",
        new="if a.group_samples is not None:  # its rows of each",
        tests=("tests/e2e/test_local_data_parity.py",),
    ),
    Mutant(
        name="holders-shares-by-speed",
        what="the score ignores the holders' fixed shares and splits stage 0 by speed",
        path="coordinator/planner/score.py",
        old="share = list(fixed[s]) if s in fixed else shares_of(group)",
        new="share = shares_of(group)",
        tests=("tests/unit/coordinator/planner/test_holders.py",),
    ),
    Mutant(
        name="u-head-sends-labels",
        what="with labels local the head still sends its labels; the tail's inbox drops them",
        path="edge/runtime/stage.py",
        old="        if not a.is_last and not a.labels_local:",
        new="        if not a.is_last:",
        tests=(
            "tests/e2e/test_local_data_parity.py::"
            "test_labels_that_stay_home_equal_one_device_on_the_union",
        ),
    ),
    Mutant(
        name="u-tail-wrong-labels",
        what="with labels local the tail pairs each of its samples with its neighbour's label",
        path="edge/runtime/stage.py",
        old="if self.reads:  # its own labels ([Note: labels stay home])\n"
        "                target = st.ys[mb]",
        new="if self.reads:  # its own labels ([Note: labels stay home])\n"
        "                target = st.ys[mb] if a.is_first else st.ys[mb].roll(1)",
        tests=(
            "tests/e2e/test_local_data_parity.py::"
            "test_labels_that_stay_home_equal_one_device_on_the_union",
        ),
    ),
    Mutant(
        name="u-tail-forgets-head-memory",
        what="a U's score checks the holders' tail memory without their stage 0 segment",
        path="coordinator/planner/score.py",
        old="need = [mine + first for mine, first in zip(need, out[0], strict=True)]",
        new="need = list(need)",
        tests=("tests/unit/coordinator/planner/test_holders.py",),
    ),
    Mutant(
        name="predict-free-gradient-bytes",
        what="the cost model forgets the CPU a group's members spend moving gradients",
        path="coordinator/planner/predict.py",
        old="allreduce[s] = max(allreduce[s] - hidden, _sum_cpu_s(problem, st, fixed))",
        new="allreduce[s] = max(allreduce[s] - hidden, 0.0)",
        tests=("tests/unit/coordinator/planner/test_predict.py",),
    ),
    Mutant(
        name="testbed-flop-quota-on-the-whole-agent",
        what="the scalar method's quota is the device's FLOP share again, so its Python, "
        "framing and messaging run at the FLOP ratio (a Pi 4's 29x, not its 8x)",
        path="coordinator/testbed/sizing.py",
        old='if method == "scalar":\n            return self.general_cpus',
        new='if method == "scalar":\n            return self.cpus',
        tests=(
            "tests/unit/coordinator/testbed/test_testbed_sizing.py",
            "tests/e2e/test_testbed.py::"
            "test_scalar_testbed_runs_code_at_the_scalar_share_and_compute_at_the_flop_share",
        ),
    ),
    Mutant(
        name="sum-sends-stretched-as-compute",
        what="the throttle stretches the group sum's early sends (made from the last "
        "backward's hooks) by the FLOP ratio as if they were compute",
        path="edge/runtime/stage.py",
        old="cpu = time.thread_time() - self._cpu0 - sent_cpu",
        new="cpu = time.thread_time() - self._cpu0",
        tests=(
            "tests/unit/edge/runtime/test_unit_times.py::"
            "test_a_sums_early_sends_are_neither_compute_nor_stretched",
        ),
    ),
    Mutant(
        name="whole-sum-own-vector-first",
        what="a small sum summed whole adds the member's own vector first, not in member "
        "order: the members' gradients differ in their last bits",
        path="edge/runtime/group_sum.py",
        old="for i in range(self.members):",
        new="for i in sorted(range(self.members), key=lambda i: i != me):",
        tests=(
            "tests/unit/edge/runtime/test_group_sum.py::"
            "test_a_small_vector_is_summed_whole_in_member_order",
        ),
    ),
    Mutant(
        name="throttled-timing-scaled-to-wall",
        what="a throttled device's unit timing scales its CPU seconds to the step's wall "
        "(its quota's stalls) before the throttle's factor: the slowdown counted twice",
        path="edge/runtime/unit_times.py",
        old="k = wall_total / cpu_total if by is self.cpu and scale_to_wall else 1.0",
        new="k = wall_total / cpu_total if by is self.cpu else 1.0",
        tests=(
            "tests/unit/edge/runtime/test_unit_times.py::"
            "test_a_throttled_devices_timing_keeps_its_cpu_seconds_as_they_are",
        ),
    ),
    Mutant(
        name="predict-sum-links-then-bytes",
        what="the cost model charges a group's sum its links' time and then its bytes' time, "
        "where the pieces keep both busy at once (measured: the sum takes the longer)",
        path="coordinator/planner/predict.py",
        old="allreduce[s] = max(allreduce[s] - hidden, _sum_cpu_s(problem, st, fixed))",
        new="allreduce[s] = allreduce[s] - hidden + _sum_cpu_s(problem, st, fixed)",
        tests=("tests/unit/coordinator/planner/test_predict.py",),
    ),
    Mutant(
        name="predict-member-rows-proportional",
        what="the cost model takes a group member's compute as its share of the whole "
        "microbatch's, forgetting the part of each unit's time that does not shrink with rows",
        path="coordinator/planner/predict.py",
        old="return fixed + (total - fixed) * share",
        new="return total * share",
        tests=("tests/unit/coordinator/planner/test_predict.py",),
    ),
    Mutant(
        name="predict-own-seconds-dropped",
        what="the cost model prices a device that timed the units itself at this host's "
        "seconds scaled to its FLOP speed: it drops the term that binds at 8 holders, each "
        "holder's own seconds of its units under its limits (bench/local_data.py: 0.355 s a "
        "step, predicted 0.355 s)",
        path="coordinator/planner/predict.py",
        old="        own = self.devices.get(device.id)\n        if own is not None:\n"
        "            return own.at_share(",
        new="        own = None\n        if own is not None:\n            return own.at_share(",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py::"
            "test_a_device_that_timed_its_units_takes_its_own_seconds_as_they_are",
        ),
    ),
    Mutant(
        name="auto-microbatches-too-few-rows-for-holders",
        what="an auto job on local data starts planning at 4 microbatches whatever its "
        "holders: 32 holders of batches of 64 get 16 samples a microbatch, and the job "
        "cannot be planned",
        path="coordinator/engine/engine.py",
        old="problem, units, choices = _rows_for_holders(problem, units, choices, len(holders))",
        new="pass",
        tests=(
            "tests/unit/coordinator/engine/test_auto_microbatches.py::"
            "test_an_auto_job_on_many_holders_starts_where_each_holds_a_sample",
        ),
    ),
    Mutant(
        name="predict-throttle-fixed-whole",
        what="the cost model charges a throttled group member the fixed part of its units "
        "whole, which the demo's measurements say its fixed cost per microbatch already holds",
        path="coordinator/planner/predict.py",
        old="whole = not _throttled(device)",
        new="whole = True",
        tests=("tests/unit/coordinator/planner/test_predict.py",),
    ),
    Mutant(
        name="v2-job-without-v1-candidate",
        what="a version 2 job chooses among the timed and the spec's group searches only, "
        "not the plan a version 1 job gets, and can run a plan predicted slower than it",
        path="coordinator/planner/partition.py",
        old="searched.append((timed or problem).as_version(1))",
        new="pass",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py::"
            "test_a_version_2_job_runs_the_timed_pipeline_when_the_model_predicts_it_fastest",
        ),
    ),
    Mutant(
        name="refine-never-moves",
        what="the local search under the cost model never leaves the searches' plan",
        path="coordinator/planner/refine.py",
        old="for _ in range(MAX_STEPS):",
        new="for _ in range(0):",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py::test_a_version_2_job_splits_a_"
            "member_off_where_the_model_says_its_rows_do_not_shrink",
        ),
    ),
    Mutant(
        name="transport-probe-counts-warm-up",
        what="the transport probe counts its warm-up round, whose first frames pay for "
        "buffers and page faults the sum does not",
        path="edge/profiling/fixed_costs.py",
        old="if r > 0:  # the first round warms up",
        new="if True:  # the first round warms up",
        tests=("tests/unit/edge/profiling/test_transport_byte_cost.py",),
    ),
    Mutant(
        name="split-ties-by-rounding",
        what="a group's samples split by remainders as floats compute them, so speeds and "
        "their shares can split differently (the planner accepts what the runtime refuses)",
        path="edge/wire/groups.py",
        old="key=lambda i: (-round(exact[i] - counts[i], 9), i)",
        new="key=lambda i: (-(exact[i] - counts[i]), i)",
        tests=("tests/unit/edge/wire/test_group_contract.py",),
    ),
    Mutant(
        name="heartbeat-before-profile-is-online",
        what="a heartbeat of a device whose profile never came lists it online, so a job "
        "is planned while it is still measuring itself",
        path="coordinator/service/registry.py",
        old="        if current is None or current.profile is None:\n            return",
        new="        if False:\n            return",
        tests=("tests/unit/coordinator/service/api/routes/test_device_routes.py",),
    ),
    Mutant(
        name="group-pieces-of-one-size",
        what="a sum's chunks always go in the largest pieces: a chunk of 1 MiB crosses "
        "two links one after the other instead of overlapping them",
        path="edge/runtime/group_sum.py",
        old="        step = piece_elements(self.chunk)",
        new="        step = PIECE_BYTES // 4",
        tests=("tests/unit/edge/runtime/test_group_sum.py",),
    ),
    Mutant(
        name="group-without-margin",
        what="a job runs a plan with groups predicted barely ahead of the best pipeline, "
        "within the model's error (measured 0.75x and 0.91x version 1's)",
        path="coordinator/planner/partition.py",
        old="flat_s < best_s * (1 + GROUP_MARGIN)",
        new="flat_s < best_s",
        tests=("tests/unit/coordinator/planner/test_predict.py",),
    ),
    Mutant(
        name="own-unit-seconds-ignored",
        what="a device that timed the model's units itself is priced by the host's seconds "
        "scaled to its matmul rate, as if it had not",
        path="coordinator/planner/predict.py",
        old="own = self.devices.get(device.id)\n        if own is not None:\n            return",
        new="own = None\n        if own is not None:\n            return",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py",
            "tests/integration/test_agent_unit_times.py",
        ),
    ),
    Mutant(
        name="unit-times-devices-not-asked",
        what="a job with unit_times devices is planned without asking its devices to time "
        "the units",
        path="coordinator/engine/engine.py",
        old='own = self.device_units(spec, devices) if spec.unit_times == "devices" else None',
        new="own = None",
        tests=(
            "tests/e2e/test_train_cli.py::"
            "test_unit_times_from_the_devices_price_the_plan_and_it_still_trains_exactly",
        ),
    ),
    Mutant(
        name="timed-microbatch-takes-the-whole-optimizer",
        what="timing one microbatch of a step charges it the whole optimizer step, not its share",
        path="edge/runtime/unit_times.py",
        old="bwd[i].append((b_step[i] - opt_s[i]) / timed + opt_s[i] / microbatches)",
        new="bwd[i].append(b_step[i] / timed)",
        tests=("tests/unit/edge/runtime/test_unit_times.py",),
    ),
    Mutant(
        name="balanced-shares-ignore-fixed-seconds",
        what="a group's members that timed the units themselves are balanced by their "
        "per-row seconds only, as if the fixed part of a microbatch shrank with the rows",
        path="coordinator/planner/predict.py",
        old="a = [units.on_device(dev[i], st.start, st.end, 0.0) for i in st.devices]",
        new="a = [0.0 for i in st.devices]",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py::"
            "test_a_group_with_a_member_that_timed_the_units_is_split_so_its_members_finish_"
            "together",
        ),
    ),
    Mutant(
        name="balanced-shares-no-sample-floor",
        what="a member whose fixed seconds outlast the others' microbatch is balanced to a "
        "share below one sample (negative, even), not clamped to one",
        path="coordinator/planner/predict.py",
        old="low = {k for k in free if w[k] < floor}",
        new="low: set[int] = set()",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py::"
            "test_a_group_with_a_member_that_timed_the_units_is_split_so_its_members_finish_"
            "together",
        ),
    ),
    Mutant(
        name="job-runs-at-the-spec-shares",
        what="a job scores and runs its groups at the spec's shares by GFLOP/s although a "
        "member timed the units itself",
        path="coordinator/planner/partition.py",
        old="score = score_plan(for_plan(problem, plan), plan, fixed_shares=shares or None)",
        new="score = score_plan(for_plan(problem, plan), plan, fixed_shares=None)",
        tests=(
            "tests/unit/coordinator/planner/test_predict.py::"
            "test_a_jobs_group_runs_at_the_shares_its_members_own_seconds_balance",
        ),
    ),
    Mutant(
        name="timing-budget-ignored",
        what="a device's timing runs every requested step however long they take",
        path="edge/runtime/unit_times.py",
        old="if budget_s is not None and step > warmup and measured >= budget_s:",
        new="if False:",
        tests=(
            "tests/unit/edge/runtime/test_unit_times.py::"
            "test_a_budget_ends_the_measured_steps_after_at_least_one",
        ),
    ),
    Mutant(
        name="timing-stall-stays-on-its-unit",
        what="a device's timing keeps each unit's wall seconds although it has a CPU clock, "
        "so a quota's stall stays on the unit it landed on",
        path="edge/runtime/unit_times.py",
        old="by = self.cpu if self.cpu_clock is not None and cpu_total > 0 else self.wall",
        new="by = self.wall",
        tests=(
            "tests/unit/edge/runtime/test_unit_times.py::"
            "test_a_stall_is_spread_over_the_units_by_their_cpu_seconds",
        ),
    ),
    Mutant(
        name="options-passed-unchecked",
        what="a job's model options reach the builder unchecked: a reserved name clashes (500)",
        path="edge/config.py",
        old=(
            '    if model is None or (":" not in model and model not in MODELS):\n'
            "        return options\n"
        ),
        new="    if True:\n        return options\n",
        tests=(
            "tests/unit/edge/models/test_options.py::test_a_models_reserved_names_are_refused_by_name",
        ),
    ),
    Mutant(
        name="option-types-unchecked",
        what="an option's value is not checked against the type its builder takes",
        path="edge/models/options.py",
        old="        schema.model_validate_json(json.dumps(options))\n",
        new="        pass\n",
        tests=(
            "tests/unit/edge/models/test_options.py::test_every_option_is_checked_against_its_builder",
        ),
    ),
    Mutant(
        name="422-echoes-nan",
        what="a 422 echoes a NaN it was sent, which JSON cannot encode: a 500 instead",
        path="coordinator/service/api/routes/errors.py",
        old='        if "input" in error and not _encodable(error["input"]):\n',
        new="        if False:\n",
        tests=("tests/e2e/test_hostile_requests.py",),
    ),
    Mutant(
        name="job-data-memory-unchecked",
        what="a job is stored whose sample order no device that may run stage 0 can hold",
        path="coordinator/service/api/routes/jobs.py",
        old="        _check_data_memory(body, data, dataset, registry, data_field)\n",
        new="        pass\n",
        tests=("tests/e2e/test_hostile_requests.py",),
    ),
    Mutant(
        name="stage-data-memory-unchecked",
        what="an agent takes a stage whose sample order exceeds its free memory",
        path="edge/runtime/stage.py",
        old="            check_data_fits(self.dataset, a.dataset, usable_memory_bytes())\n",
        new="",
        tests=("tests/integration/test_agent_memory.py",),
    ),
    Mutant(
        name="overlap-waits-for-the-last-backward",
        what="an armed group sum sends nothing as gradients become final: its reduce-scatter "
        "waits for the last backward anyway",
        path="edge/runtime/group_sum.py",
        old="                self._send_ready(armed)\n",
        new="                pass\n",
        tests=("tests/unit/edge/runtime/test_group_sum.py",),
    ),
    Mutant(
        name="overlap-hides-more-than-the-backward",
        what="the cost model hides the reduce-scatter's whole half however short the last backward",
        path="coordinator/planner/predict.py",
        old=(
            "            hidden = min(allreduce[s] / 2, "
            "min(members[s]) * _backward_share(problem, st))\n"
        ),
        new="            hidden = allreduce[s] / 2\n",
        tests=("tests/unit/coordinator/planner/test_predict.py",),
    ),
    Mutant(
        name="auto-microbatches-ignore-fixed-costs",
        what="auto microbatches chosen by the spec's score, blind to what each one costs fixed",
        path="coordinator/planner/microbatches.py",
        old="        if best is None or guess.step_time_s < best.prediction.step_time_s:\n",
        new="        if best is None or score.step_time_s < best.score.step_time_s:\n",
        tests=("tests/unit/coordinator/planner/test_microbatches.py",),
    ),
    Mutant(
        name="zero-bubble-weight-gradient-twice",
        what="a zero-bubble stage's B runs the whole backward, and its W adds the weights' again",
        path="edge/runtime/stage.py",
        old="            st.weight_passes[mb] = input_backward(out, grad, inp, self._weights)\n",
        new=(
            "            out.backward(grad, retain_graph=True)\n"
            "            st.weight_passes[mb] = input_backward(out, grad, inp, self._weights)\n"
        ),
        tests=(
            "tests/unit/edge/runtime/test_reference_parity.py::"
            "test_three_stages_equal_the_reference[mlp-zb-h1]",
        ),
    ),
    Mutant(
        name="diloco-steps-on-its-share",
        what="a DiLoCo member steps on its share of the microbatches' gradient, not its rows' mean",
        path="edge/runtime/outer_sync.py",
        old="                p.grad.div_(self.share)\n",
        new="                pass\n",
        tests=("tests/unit/edge/runtime/test_outer_sync.py",),
    ),
    Mutant(
        name="diloco-inbox-two-steps",
        what="a DiLoCo member's inbox drops the next sum's chunks from a member steps ahead",
        path="edge/transport/inbox.py",
        old="            return max(_WINDOW, plan.group_every + 1)\n",
        new="            return _WINDOW\n",
        tests=("tests/unit/edge/transport/test_inbox.py",),
    ),
    Mutant(
        name="fused-attention-not-causal",
        what="gpt-mini's fused attention lets each token attend to the tokens after it",
        path="edge/models/units.py",
        old="F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        new="F.scaled_dot_product_attention(q, k, v, is_causal=False)",
        tests=("tests/unit/edge/models/test_attention.py",),
    ),
    Mutant(
        name="demo-labels-central",
        what="the demo's job sends the holders' labels to the helper again",
        path="coordinator/local/demo.py",
        old='"data": {"name": "digits", "placement": "local", "labels": "local"},',
        new='"data": {"name": "digits", "placement": "local"},',
        tests=("tests/e2e/test_demo_wire.py",),
    ),
    Mutant(
        name="compile-counted-as-compute",
        what="a compute block that compiled also counts as the step's compute",
        path="edge/runtime/stage.py",
        old=(
            "            self._compile_s += spent  # it compiled: not compute"
            " ([Note: compiled stages])\n            return 0.0\n"
        ),
        new=(
            "            self._compile_s += spent  # it compiled: not compute"
            " ([Note: compiled stages])\n"
        ),
        tests=("tests/integration/test_compiled_stages.py",),
    ),
    Mutant(
        name="traffic-counts-one-link",
        what="a job's bytes a sample count what was sent and not what was received",
        path="coordinator/engine/monitor.py",
        old='"bytes_per_sample": (sent + received) / samples if samples else 0.0,',
        new='"bytes_per_sample": sent / samples if samples else 0.0,',
        tests=("tests/unit/coordinator/engine/test_job_result.py",),
    ),
    Mutant(
        name="diloco-priced-as-exact",
        what="a DiLoCo job's groups are priced as summing every step",
        path="coordinator/planner/predict.py",
        old="_sum_cpu_s(problem, st, fixed)) / sum_every\n",
        new="_sum_cpu_s(problem, st, fixed)) / 1\n",
        tests=("tests/unit/coordinator/engine/test_diloco_plan.py",),
    ),
    Mutant(
        name="dist-overlap-waits-for-the-last-backward",
        what="an armed all-reduce over torch.distributed starts no bucket from the hooks",
        path="edge/server/data_parallel.py",
        old="                    self.early_bytes += self._start(armed, b)\n",
        new="                    pass\n",
        tests=("tests/integration/test_data_parallel_groups.py",),
    ),
    Mutant(
        name="stage-never-arms-its-sum",
        what="a group's stage starts its sum only after its last backward",
        path="edge/runtime/stage.py",
        old=(
            "            self.group_sum.arm(st.step, float(sum(v.item() for v in losses))"
            " if losses else None)\n"
        ),
        new="            pass\n",
        tests=("tests/e2e/test_group_parity.py",),
    ),
    Mutant(
        name="bound-ignores-groups",
        what="a version 2 plan's lower bound is version 1's, which a group can beat: a "
        "certificate below zero gap",
        path="coordinator/planner/bounds.py",
        old="    return min(pipelines, _group_bound(problem))\n",
        new="    return pipelines\n",
        tests=("tests/unit/coordinator/planner/test_bounds.py",),
    ),
    Mutant(
        name="anatomy-wait-by-the-receivers-clock",
        what="the measured anatomy counts a whole wait as link time, not from when the "
        "neighbour began sending",
        path="coordinator/planner/anatomy.py",
        old=(
            "            on_wire = 0.0 if sent is None else "
            "min(i.seconds, max(0.0, end - max(start, sent)))\n"
        ),
        new="            on_wire = 0.0 if sent is None else i.seconds\n",
        tests=("tests/unit/coordinator/planner/test_anatomy.py",),
    ),
    Mutant(
        name="anatomy-meter-keeps-warmup",
        what="a run's measured anatomy averages in its warm-up step",
        path="coordinator/planner/anatomy.py",
        old="        if report.step < self._first + self.warmup:\n",
        new="        if report.step < self._first:\n",
        tests=("tests/unit/coordinator/planner/test_anatomy.py",),
    ),
    Mutant(
        name="plan-priced-without-its-codecs",
        what="a plan that carries its links' codecs is scored and predicted as fp32",
        path="coordinator/planner/score.py",
        old="    return with_codecs(problem, plan, plan.codecs) if plan.codecs else problem\n",
        new="    return problem\n",
        tests=("tests/unit/coordinator/planner/test_codecs.py",),
    ),
    Mutant(
        name="holders-ignore-the-auto-codec",
        what="a job on local data with codec auto is planned with fp32 links",
        path="coordinator/engine/engine.py",
        old="        codec=spec.codec,\n",
        new='        codec="fp32",\n',
        tests=("tests/unit/coordinator/engine/test_link_ladder.py",),
    ),
    Mutant(
        name="split-runs-though-it-does-not-pay",
        what="the holders' split runs where the engine predicts the holders alone faster",
        path="coordinator/engine/engine.py",
        old="        if alone_guess.step_time_s < guess.step_time_s:\n",
        new="        if False:\n",
        tests=("tests/unit/coordinator/engine/test_link_ladder.py",),
    ),
    Mutant(
        name="u-tail-at-speed-shares",
        what="a U-shaped plan's last stage is scored with its holders at speed shares, not "
        "by their data",
        path="coordinator/planner/holders.py",
        old="    last = len(plan.stages) - 1 if plan.u_shaped else 0\n",
        new="    last = 0\n",
        tests=("tests/unit/coordinator/planner/test_codecs.py",),
    ),
    Mutant(
        name="links-bisection-reports-the-slow-end",
        what="the rate where the split stops paying is the bracket's slow end",
        path="coordinator/engine/links.py",
        old="            return high\n",
        new="            return low\n",
        tests=("tests/unit/coordinator/engine/test_link_ladder.py",),
    ),
]


@dataclass
class Outcome:
    mutant: Mutant
    status: str
    """``killed``, ``survived`` or ``error`` (not applied, or the tests could not run)."""
    killer: str
    seconds: float
    detail: str = ""


def _tree_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def _copy_tree(files: list[str], dest: Path) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)


def _apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.path}: the text to replace occurs {count} times, not once")
    path.write_text(text.replace(mutant.old, mutant.new))


def _failed_test(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0].strip()
    return ""


def run_mutant(mutant: Mutant, files: list[str]) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree(files, tree)
        try:
            _apply(mutant, tree)
        except (OSError, ValueError) as exc:
            return Outcome(
                mutant=mutant,
                status="error",
                killer="",
                seconds=time.monotonic() - started,
                detail=str(exc),
            )
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            "-o",
            f"timeout={TEST_TIMEOUT_S}",
            *mutant.tests,
        ]
        try:
            done = subprocess.run(
                cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=2 * TEST_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return Outcome(
                mutant=mutant,
                status="error",
                killer="",
                seconds=time.monotonic() - started,
                detail="pytest timed out",
            )
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    if done.returncode == 0:
        return Outcome(mutant=mutant, status="survived", killer="", seconds=seconds)
    if done.returncode == 1:
        return Outcome(
            mutant=mutant, status="killed", killer=_failed_test(output) or "?", seconds=seconds
        )
    tail = " | ".join(output.strip().splitlines()[-3:])
    return Outcome(
        mutant=mutant,
        status="error",
        killer="",
        seconds=seconds,
        detail=f"pytest exit {done.returncode}: {tail}",
    )


def _check_copy_is_imported(files: list[str]) -> None:
    """The copy's packages, not the editable install's, are what a mutant's tests import."""
    with tempfile.TemporaryDirectory(prefix="mutant-check-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree([f for f in files if f.startswith("edge/")], tree)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        got = subprocess.run(
            [sys.executable, "-c", "import edge; print(edge.__file__)"],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not got.startswith(str(tree)):
            raise SystemExit(f"mutants: the copy is not what Python imports ({got})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28} {m.path:34} {m.what}")
        return 0
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"mutants: unknown mutant {unknown[0]!r} (see --list)", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.names] if args.names else MUTANTS
    files = _tree_files()
    _check_copy_is_imported(files)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = list(pool.map(lambda m: run_mutant(m, files), chosen))
    wall = time.monotonic() - started
    width = max(len(m.name) for m in chosen)
    for o in outcomes:
        shown = o.killer if o.status == "killed" else o.detail
        print(f"{o.mutant.name:{width}}  {o.status:8}  {o.seconds:6.1f} s  {shown}")
    bad = [o for o in outcomes if o.status != "killed"]
    killed = len(outcomes) - len(bad)
    print(f"{killed} of {len(outcomes)} mutants killed in {wall:.0f} s")
    if args.json:
        rows = [
            {
                "mutant": o.mutant.name,
                "what": o.mutant.what,
                "file": o.mutant.path,
                "status": o.status,
                "killed_by": o.killer,
                "seconds": round(o.seconds, 1),
                "detail": o.detail,
            }
            for o in outcomes
        ]
        args.json.write_text(json.dumps({"wall_s": round(wall, 1), "mutants": rows}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
