"""``grpo_loss`` and ``group_advantages`` on hand-computed examples (the numbers in the comments
are worked out on paper from TRL's definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.core import ScaleRewards, group_advantages, grpo_loss

EPS = 1e-4


def close(
    got: torch.Tensor, want: float | list[float] | list[list[float]], tol: float = 1e-6
) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=tol, rtol=0)


# --- advantages ---------------------------------------------------------------------------------
REWARDS = [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0]
# group 1: mean 2.5, deviations -1.5 -0.5 0.5 1.5, Bessel std sqrt(5/3) = 1.290994
# group 2: constant 5 → deviations 0, std 0
# whole batch: mean 3.75, squared deviations sum 17.5, Bessel var 2.5, std 1.581139
DEV = [-1.5, -0.5, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0]


def test_group_scale_divides_by_each_groups_std() -> None:
    std1 = math.sqrt(5 / 3)
    want = [d / (std1 + EPS) for d in DEV[:4]] + [0.0] * 4
    close(group_advantages(REWARDS, 4, scale="group"), want)


def test_batch_scale_keeps_the_group_mean_and_divides_by_the_batch_std() -> None:
    std = math.sqrt(2.5)
    close(group_advantages(REWARDS, 4, scale="batch"), [d / (std + EPS) for d in DEV])


def test_no_scale_is_the_centred_reward() -> None:
    close(group_advantages(REWARDS, 4, scale="none"), DEV)


def test_default_scale_is_group() -> None:
    close(group_advantages(REWARDS, 4), group_advantages(REWARDS, 4, scale="group").tolist())


def test_two_sample_group_uses_bessels_correction() -> None:
    # [1, 0]: mean 0.5, Bessel std sqrt(0.5) (the population std would be 0.5)
    s = math.sqrt(0.5)
    close(group_advantages([1.0, 0.0], 2), [0.5 / (s + EPS), -0.5 / (s + EPS)])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_rewards_give_zero_advantage_not_nan(scale: ScaleRewards) -> None:
    a = group_advantages([0.7, 0.7, 0.7], 3, scale=scale)
    assert torch.isfinite(a).all()
    close(a, [0.0, 0.0, 0.0])


def test_group_of_one_has_zero_advantage() -> None:
    close(group_advantages([3.0, -1.0], 1), [0.0, 0.0])


def test_bad_advantage_input_is_refused() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0, 2.0, 3.0], 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1.0, 2.0], 2, scale="rank")  # type: ignore[arg-type]  # unknown scale, on purpose
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], 2)


# --- aggregation of each loss_type ------------------------------------------------------------
# Two sequences of different lengths, on-policy (ratio 1): per-token loss = -A.
#   row 0: A = 1,    mask [1 1 0] → per-token -1, -1      (2 tokens)
#   row 1: A = -0.5, mask [1 1 1] → per-token .5, .5, .5  (3 tokens)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -0.5])
LOGP = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.6, 0.3]]))


def on_policy(**kw: object) -> torch.Tensor:
    return grpo_loss(LOGP, LOGP.clone(), ADV, MASK, **kw)  # type: ignore[arg-type]  # kw: loss options by name


def test_grpo_averages_each_sequence_then_the_batch() -> None:
    close(on_policy(loss_type="grpo"), (-1.0 + 0.5) / 2)  # -0.25


def test_bnpo_divides_by_the_masked_tokens() -> None:
    close(on_policy(loss_type="bnpo"), (-2.0 + 1.5) / 5)  # -0.1


def test_dr_grpo_divides_by_batch_times_max_completion_length() -> None:
    close(on_policy(loss_type="dr_grpo", max_completion_length=4), -0.5 / (2 * 4))
    close(on_policy(loss_type="dr_grpo"), -0.5 / (2 * 3))  # default: the token dimension


def test_dapo_divides_by_the_global_batch_tokens() -> None:
    close(on_policy(loss_type="dapo", num_items_in_batch=10), -0.5 / 10)
    close(on_policy(loss_type="dapo"), -0.5 / 5)  # default: this call's masked tokens
    close(on_policy(), -0.5 / 5)  # dapo is the default


def test_dapo_over_micro_batches_sums_to_the_whole_batch_loss() -> None:
    whole = on_policy(loss_type="dapo")
    parts = sum(
        grpo_loss(
            LOGP[i : i + 1], LOGP[i : i + 1], ADV[i : i + 1], MASK[i : i + 1], num_items_in_batch=5
        )
        for i in range(2)
    )
    close(torch.as_tensor(parts), float(whole))


def test_masked_tokens_do_not_count() -> None:
    wild = LOGP.clone()
    wild[0, 2] = 50.0  # a masked position: any value
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        base = on_policy(loss_type=loss_type)
        got = grpo_loss(wild, LOGP.clone(), ADV, MASK, loss_type=loss_type)
        close(got, float(base))


def test_gradient_of_on_policy_loss_is_minus_advantage_over_tokens() -> None:
    logp = LOGP.clone().requires_grad_(True)
    grpo_loss(logp, LOGP.clone(), ADV, MASK, loss_type="bnpo").backward()
    assert logp.grad is not None
    # d/dlogp of -ratio·A at ratio 1 is -A; bnpo divides by 5; masked token 0
    close(logp.grad, [[-1 / 5, -1 / 5, 0.0], [0.1, 0.1, 0.1]])


# --- clipping on both sides ------------------------------------------------------------------------
def one_token(ratio: float, advantage: float, **kw: object) -> tuple[float, float]:
    """(loss, d loss / d logp) of one token with ``exp(logp - old) = ratio``."""
    old = torch.tensor([[math.log(0.4)]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    loss = grpo_loss(logp, old, torch.tensor([advantage]), torch.ones(1, 1), **kw)  # type: ignore[arg-type]  # kw: loss options
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), float(logp.grad)


def test_positive_advantage_is_clipped_above_one_plus_eps_high() -> None:
    loss, grad = one_token(1.5, 2.0)  # min(1.5·2, 1.28·2) = 2.56
    assert loss == pytest.approx(-2.56, abs=1e-6)
    assert grad == 0.0  # clipped: no gradient


def test_positive_advantage_below_the_band_is_not_clipped() -> None:
    loss, grad = one_token(0.5, 2.0)  # min(0.5·2, 0.8·2) = 1.0, unclipped
    assert loss == pytest.approx(-1.0, abs=1e-6)
    assert grad == pytest.approx(-1.0, abs=1e-6)  # -ratio·A


def test_negative_advantage_is_clipped_below_one_minus_eps_low() -> None:
    loss, grad = one_token(0.5, -2.0)  # min(0.5·-2, 0.8·-2) = -1.6
    assert loss == pytest.approx(1.6, abs=1e-6)
    assert grad == 0.0


def test_negative_advantage_above_the_band_is_not_clipped() -> None:
    loss, grad = one_token(1.5, -2.0)  # min(1.5·-2, 1.28·-2) = -3.0, unclipped (pessimistic)
    assert loss == pytest.approx(3.0, abs=1e-6)
    assert grad == pytest.approx(3.0, abs=1e-6)


def test_eps_bounds_are_configurable() -> None:
    assert one_token(1.5, 1.0, eps_high=0.2)[0] == pytest.approx(-1.2, abs=1e-6)
    assert one_token(0.5, -1.0, eps_low=0.4)[0] == pytest.approx(0.6, abs=1e-6)
    assert one_token(1.1, 1.0)[0] == pytest.approx(-1.1, abs=1e-6)  # inside the band


# --- KL to the reference (beta > 0) -----------------------------------------------------------
def test_k3_kl_term_is_added_per_token() -> None:
    # logp = log .5, ref = log .25: d = ref - logp = log .5;
    # k3 = exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    k3 = 0.5 + math.log(2) - 1
    for beta in (0.1, 0.04):
        got = grpo_loss(
            logp, logp.clone(), torch.zeros(1), torch.ones(1, 2), beta=beta, ref_logp=ref
        )
        close(got, beta * k3)
    # with an advantage too: -A + beta·k3 per token
    got = grpo_loss(
        logp, logp.clone(), torch.tensor([1.0]), torch.ones(1, 2), beta=0.1, ref_logp=ref
    )
    close(got, -1.0 + 0.1 * k3)


def test_kl_is_zero_when_policy_equals_reference() -> None:
    got = grpo_loss(LOGP, LOGP.clone(), torch.zeros(2), MASK, beta=1.0, ref_logp=LOGP.clone())
    close(got, 0.0)


def test_beta_without_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(LOGP, LOGP, ADV, MASK, beta=0.1)


# --- sequence-level importance sampling (GSPO) ----------------------------------------------
def test_sequence_level_ratio_is_the_exp_of_the_mean_masked_log_ratio() -> None:
    old = torch.log(torch.tensor([[0.2, 0.3, 0.1]]))
    # log ratios log 1.2, log 1.1 on the two real tokens, log 5 on the masked one
    logp = old + torch.log(torch.tensor([[1.2, 1.1, 5.0]]))
    mask = torch.tensor([[1, 1, 0]])
    seq_ratio = math.sqrt(1.2 * 1.1)  # 1.148913, inside [0.8, 1.28]
    got = grpo_loss(
        logp, old, torch.tensor([1.0]), mask, loss_type="grpo", importance_sampling_level="sequence"
    )
    close(got, -seq_ratio)
    tok = grpo_loss(logp, old, torch.tensor([1.0]), mask, loss_type="grpo")
    close(tok, -(1.2 + 1.1) / 2)  # token level: each ratio on its own


def test_sequence_level_ratio_is_clipped_as_a_whole() -> None:
    old = torch.zeros(1, 2)
    logp = torch.full((1, 2), math.log(2.0), requires_grad=True)
    got = grpo_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 2), importance_sampling_level="sequence"
    )
    close(got, -1.28)
    got.backward()
    assert logp.grad is not None and torch.all(logp.grad == 0)


def test_sequence_level_gradient_is_shared_by_the_sequences_tokens() -> None:
    old = torch.zeros(1, 3)
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    grpo_loss(
        logp, old, torch.tensor([1.0]), mask, loss_type="bnpo", importance_sampling_level="sequence"
    ).backward()
    assert logp.grad is not None
    # loss = -exp(mean(lr)) over 2 tokens, averaged over 2 tokens → d/dlr_i = -1/2 each
    close(logp.grad, [[-0.5, -0.5, 0.0]])


def test_bad_loss_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(LOGP, LOGP, ADV, MASK, loss_type="ppo")  # type: ignore[arg-type]  # unknown, on purpose
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(LOGP, LOGP, ADV, MASK, importance_sampling_level="group")  # type: ignore[arg-type]  # unknown, on purpose
    with pytest.raises(ValueError, match="shape"):
        grpo_loss(LOGP, LOGP[:, :2], ADV, MASK)
