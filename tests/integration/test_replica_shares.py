"""Data-parallel replicas each train on their own slice of every batch, checked by content.

Averaging gradients hides a replica that trains on the whole batch: every copy
then computes the whole batch's mean gradient, the average is that same mean,
and the final weights still equal single-device training. So this test looks
at what each replica actually fed its model. Two real processes form a gloo
group; each runs replica ``r`` of a one-stage cnn-digits job (edgetrain's
:class:`~edge.runtime.stage.StageRuntime` with
:class:`~edge.server.data_parallel.DataParallel`) and records every input its
segment's forward received. Replica ``r``'s inputs of step ``t`` must be rows
``[r B/2, (r+1) B/2)`` of the batch the independent reference reads at step
``t``; the two shares are disjoint and make up the whole batch; and both
replicas end with the reference's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from support.ranks import gloo_world, run_ranks
from support.reference import assert_matches, batch_indices, train_reference

from edge.models.datasets import build_dataset
from edge.models.zoo import get_model
from edge.runtime.stage import StageRuntime
from edge.server.data_parallel import DataParallel
from edge.transport.inprocess import InProcessTransport
from edge.wire.messages import StageAssignment

MODEL, STEPS, BATCH, MICRO, SEED, REPLICAS = "cnn-digits", 4, 16, 2, 7, 2


def _assignment(replica: int) -> StageAssignment:
    spec = get_model(MODEL, seed=SEED)
    return StageAssignment(
        job="shares",
        stage=0,
        num_stages=1,
        start=0,
        end=spec.num_units,
        model=MODEL,
        dataset=spec.dataset,
        dataset_options=spec.dataset_options,
        seed=SEED,
        batch_size=BATCH,
        microbatches=MICRO,
        steps=STEPS,
        replica=replica,
        replicas=REPLICAS,
    )


def _replica_on_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_world(rank, world, store_path):
        dp = DataParallel(dist.new_group(list(range(world))), world)
        reports: list[Any] = []
        rt = StageRuntime(
            _assignment(rank), InProcessTransport(), report=reports.append, data_parallel=dp
        )
        seen: list[torch.Tensor] = []
        rt.segment.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
        assert rt.run() == STEPS
        out = {f"input{i}": x.contiguous() for i, x in enumerate(seen)}
        out |= {f"weight.{k}": v.detach().contiguous() for k, v in rt.segment.state_dict().items()}
        out["losses"] = torch.tensor([r.loss for r in reports], dtype=torch.float64)
        safetensors.torch.save_file(out, str(Path(out_dir) / f"rank{rank}.safetensors"))


@pytest.mark.slow
def test_each_replica_trains_on_its_own_slice_of_every_batch(tmp_path: Path) -> None:
    run_ranks(_replica_on_rank, REPLICAS, str(tmp_path / "store"), str(tmp_path), timeout=120)
    got = [safetensors.torch.load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    data = build_dataset("digits", "train")
    share = BATCH // REPLICAS
    for step in range(STEPS):
        rows = batch_indices(len(data), BATCH, SEED, step).tolist()  # type: ignore[arg-type]
        batch = torch.stack([torch.as_tensor(data[i][0]) for i in rows])
        taken = []
        for r, out in enumerate(got):
            # One forward per microbatch: this step's are inputs [step * M, (step + 1) * M).
            fed = torch.cat([out[f"input{step * MICRO + mb}"] for mb in range(MICRO)])
            assert fed.shape[0] == share, (step, r, fed.shape)
            assert torch.equal(fed, batch[r * share : (r + 1) * share]), (step, r)
            taken.append(fed)
        assert torch.equal(torch.cat(taken), batch)  # disjoint shares, the whole batch
    reference = train_reference(MODEL, steps=STEPS, batch_size=BATCH, seed=SEED)
    for out in got:
        weights = {k.removeprefix("weight."): v for k, v in out.items() if k.startswith("weight.")}
        assert_matches(out["losses"].tolist(), weights, reference)
    assert torch.equal(got[0]["losses"], got[1]["losses"])  # the averaged loss, on both
