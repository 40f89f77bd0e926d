"""The data-parallel update's pure parts: how a micro-batch's rows are dealt to the ranks, and
the weights that make the shares' losses add up to the micro-batch's loss for every loss type
(``services/trainer/dp.py``)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.core import grpo_loss
from services.trainer.dp import share, share_weight


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_shares_of_a_micro_batch_partition_its_rows(world: int) -> None:
    rows = [7, 3, 9, 0, 4]
    shares = [share(rows, r, world) for r in range(world)]
    assert sorted(i for s in shares for i in s) == sorted(rows)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_weighted_share_losses_add_up_to_the_micro_batch_loss(loss_type: str, world: int) -> None:
    gen = torch.Generator().manual_seed(3)
    b, t = 4, 9
    logp = -torch.rand(b, t, generator=gen) * 3
    old = logp + 0.1 * torch.randn(b, t, generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.3).float()
    mask[2] = 0.0  # a row without model tokens
    adv = torch.randn(b, generator=gen)
    kw = {"loss_type": loss_type, "max_completion_length": 12, "num_items_in_batch": 40.0}
    whole = grpo_loss(logp, old, adv, mask, **kw)  # type: ignore[arg-type]
    total = torch.zeros(())
    for r in range(world):
        rows = share(list(range(b)), r, world)
        if not rows:
            continue
        part = grpo_loss(logp[rows], old[rows], adv[rows], mask[rows], **kw)  # type: ignore[arg-type]
        w = share_weight(loss_type, len(rows), b, float(mask[rows].sum()), float(mask.sum()))  # type: ignore[arg-type]
        total = total + part * w
    assert float(total) == pytest.approx(float(whole), abs=1e-6)


def test_procs_must_be_a_sensible_count() -> None:
    assert TrainerConfig(procs=4).procs == 4
    with pytest.raises(ValueError, match="procs"):
        TrainerConfig(procs=0)
