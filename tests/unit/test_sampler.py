"""Sampler: greedy argmax, top-p nucleus, logprobs, seeded determinism (resume-stable)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from schemas.seeds import derive_seed
from services.worker.engine.sampler import Sampler, seeded_uniform
from services.worker.engine.sequence import SamplingParams

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]


def test_greedy_is_argmax_with_its_logprob() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = Sampler()(logits, [GREEDY] * 3, [0, 0, 0])
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(3), logits.argmax(-1)]
    assert logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does() -> None:
    # Rows of 2,042 real columns and -inf padding, as the tiny model's output layer gives;
    # ties at several places (first, middle, last real column), a wide row, an all-equal row.
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 2048, generator=gen).round(decimals=1)
    logits[:, 2042:] = float("-inf")
    logits[0, [3, 900]] = 9.0
    logits[1, [0, 2041]] = 9.0
    logits[2, [1500, 1501, 1502]] = 9.0
    logits[3, :2042] = 0.5
    greedy = [GREEDY] * 6
    tokens, _ = Sampler(vocab=2042)(logits, greedy, [0] * 6)
    assert tokens == logits.argmax(-1).tolist()
    assert tokens[:4] == [3, 0, 1500, 0]
    mixed = [GREEDY, SamplingParams(temperature=1.0, seed=3)] * 3
    tokens, _ = Sampler(vocab=2042)(logits, mixed, [0] * 6)
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus_and_follows_its_distribution() -> None:
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    counts: Counter[int] = Counter()
    sampler = Sampler()
    for seed in range(2000):
        tokens, _ = sampler(logits, [SamplingParams(top_p=0.75, seed=seed)], [0])
        counts[tokens[0]] += 1
    assert set(counts) == {0, 1}
    assert counts[0] / 2000 == pytest.approx(0.5 / 0.8, abs=0.04)


def test_full_distribution_without_top_p() -> None:
    logits = logits_of([0.6, 0.3, 0.1])
    sampler = Sampler(seed=0)
    counts = Counter(sampler(logits, [SamplingParams()], [0])[0][0] for _ in range(3000))
    assert counts[2] / 3000 == pytest.approx(0.1, abs=0.03)
    assert counts[0] / 3000 == pytest.approx(0.6, abs=0.04)


def test_logprob_is_under_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_p=0.5, seed=3)
    tokens, logprobs = Sampler()(logits, [params], [0])
    expected = torch.log_softmax(logits / 0.5, -1)[0, tokens[0]].item()
    assert logprobs[0] == pytest.approx(expected, abs=1e-6)


def test_seeded_sample_depends_only_on_seed_index_and_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14)]
    indices = [5, 0, 9, 2]
    batch_tokens, batch_lps = Sampler(seed=1)(logits, params, indices)
    for i in range(4):
        # Alone, in another sampler with another random stream, with unseeded neighbours.
        alone, lp = Sampler(seed=99)(logits[i : i + 1], [params[i]], [indices[i]])
        assert alone[0] == batch_tokens[i] and lp[0] == pytest.approx(batch_lps[i], abs=1e-6)
    mixed = torch.cat([logits[:1], torch.randn(1, 300, generator=gen)])
    tokens, _ = Sampler()(mixed, [params[0], SamplingParams()], [indices[0], 0])
    assert tokens[0] == batch_tokens[0]


def test_resume_offset_continues_the_same_stream() -> None:
    """The j-th token of a request is drawn with u(seed, j): a worker resuming at
    generated_offset=m asks for j=m, m+1, … and sees the uninterrupted run's numbers."""
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(seed=7)
    sampler = Sampler()
    uninterrupted = [sampler(logits, [params], [j])[0][0] for j in range(40)]
    resumed = [Sampler(seed=5)(logits, [params], [j])[0][0] for j in range(25, 40)]
    assert resumed == uninterrupted[25:]
    assert len(set(uninterrupted)) > 5  # j really changes the draw


def test_seeded_uniform_is_uniform_and_distinct() -> None:
    us = [seeded_uniform(42, j) for j in range(5000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert sum(us) / len(us) == pytest.approx(0.5, abs=0.02)
    assert seeded_uniform(1, 0) != seeded_uniform(2, 0)
    assert seeded_uniform(-1, 3) == seeded_uniform(-1, 3)


def test_unseeded_sampling_varies() -> None:
    logits = torch.zeros(1, 64)
    sampler = Sampler()
    tokens = {sampler(logits, [SamplingParams()], [0])[0][0] for _ in range(50)}
    assert len(tokens) > 10


def test_mixed_batch_greedy_and_sampled() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [1.0, 1.0, 1.0]])
    tokens, logprobs = Sampler()(logits, [GREEDY, SamplingParams(seed=0)], [0, 0])
    assert tokens[0] == 1
    assert logprobs[1] == pytest.approx(math.log(1 / 3), abs=1e-6)


def test_invalid_params_rejected() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_seeded_draws_are_bitwise_functions_of_seed_and_index() -> None:
    """Counter-based: token and logprob of a row depend on (seed, j, its logits) only — not on
    the batch, the row's place in it, the sampler's own stream or what it drew before."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=gen)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(6)]
    indices = [0, 3, 3, 17, 200, 1]
    tokens, lps = Sampler(seed=1)(logits, params, indices)
    warm = Sampler(seed=2)
    for _ in range(5):  # a sampler that has drawn before, for other requests
        warm(torch.randn(2, 500, generator=gen), [SamplingParams(), SamplingParams()], [0, 0])
    order = [5, 2, 0, 4, 1, 3]
    shuffled = warm(logits[order], [params[i] for i in order], [indices[i] for i in order])
    for k, i in enumerate(order):
        assert shuffled[0][k] == tokens[i] and shuffled[1][k] == lps[i]
        alone = Sampler()(logits[i : i + 1], [params[i]], [indices[i]])
        assert alone == ([tokens[i]], [lps[i]])


def test_derive_seed_gives_each_sample_its_own_stable_seed() -> None:
    """The n samples of one task get distinct seeds (identical samples would zero a GRPO
    group's advantages), the same on every run and machine (golden values)."""
    assert [derive_seed(0, i) for i in range(3)] == [
        5929318815373528752,
        550273252226424709,
        -1349443622673582321,
    ]
    assert derive_seed(-1, 0) == -4902657135600986228
    for seed in (0, 1, -1, 2**63 - 1, -(2**63)):
        seeds = [derive_seed(seed, i) for i in range(5000)]
        assert len(set(seeds)) == len(seeds)
        assert all(-(2**63) <= s < 2**63 for s in seeds)
        assert SamplingParams(seed=seeds[-1]).seed == seeds[-1]
    assert derive_seed(1, 0) != derive_seed(2, 0)
    # Distinct seeds give distinct draws: the samples of a group really differ.
    draws = {seeded_uniform(derive_seed(7, i), 0) for i in range(64)}
    assert len(draws) == 64
    with pytest.raises(ValueError):
        derive_seed(1, -1)


def test_columns_past_the_tokenizer_are_left_out_of_the_draw_with_the_same_tokens() -> None:
    """An engine's sampler knows the tokenizer's id range (the model's output vocabulary is
    padded with −inf columns): it sorts only the real columns, and every token and
    log-probability is bitwise what sorting them all gives — any temperature, top-p, seed —
    and never a padding column."""
    gen = torch.Generator().manual_seed(5)
    real, width = 2042, 4096
    logits = torch.randn(64, width, generator=gen) * 4
    logits[:, real:] = float("-inf")
    params = [
        SamplingParams(temperature=t, top_p=p, seed=1000 + i)
        for i, (t, p) in enumerate(
            (t, p) for t in (0.3, 0.7, 1.0, 2.0) for p in (1.0, 0.9, 0.5, 0.05)
        )
    ] * 4
    indices = list(range(64))
    padded = Sampler(seed=3, vocab=real)(logits, params, indices)
    full = Sampler(seed=3)(logits, params, indices)
    assert padded == full
    assert max(padded[0]) < real
    unseeded = [SamplingParams(temperature=1.0)] * 64
    assert Sampler(seed=4, vocab=real)(logits, unseeded, indices) == Sampler(seed=4)(
        logits, unseeded, indices
    )
