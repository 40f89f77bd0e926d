"""Deterministic mode end to end on a small random model: a request's logits (bitwise) and tokens
depend only on (weights, prompt, sampling, seed) — not on batch size, order, neighbours, when
it joined the batch, preemption, or whether its prefix's KV was built by prefill or by decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from model.paged import StepKeys
from services.worker.engine.config import EngineConfig
from services.worker.engine.draft import PROMPT_LOOKUP_MAX, PromptLookup
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sequence import SamplingParams, Sequence
from tests.unit.model_fixtures import make_engine, write_small_model

torch.set_num_threads(1)

N = 40
PROMPT = [5, 17, 301, 42, 7, 99, 123]
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=N, ignore_eos=True),
}
DET = EngineConfig(num_blocks=96, max_model_len=256, max_num_batched_tokens=1024)
NEIGHBOURS = [
    ([3] * 5, SamplingParams(temperature=1.0, max_tokens=N + 9, ignore_eos=True)),  # unseeded
    (list(range(20, 160)), SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)),
    ([400, 401], SamplingParams(temperature=0.7, seed=9, max_tokens=N, ignore_eos=True)),
    (list(range(300, 330)), SamplingParams(temperature=1.2, top_p=0.5, seed=5, max_tokens=3)),
    ([11] * 60, SamplingParams(temperature=0, max_tokens=N + 30, ignore_eos=True)),
    ([7, 8, 9], SamplingParams(temperature=1.0, seed=77, max_tokens=25, ignore_eos=True)),
    (list(range(100, 240)), SamplingParams(temperature=0.5, max_tokens=N, ignore_eos=True)),
]
"""Seven neighbours: long (several attention chunks) and short prompts, greedy, seeded and
unseeded, finishing at different steps so the batch changes shape under the request."""

Run = dict[int, tuple[int, Tensor]]
"""Sample index j → (token, the logits it was drawn from)."""


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("small-model"))


def recording(engine: LLMEngine) -> dict[str, dict[int, Tensor]]:
    """Wrap the engine's model runner so every logits row is kept, by request and index j.
    A draft row (speculative decoding) is kept at the index it would produce; a rejected one
    is overwritten when a later step computes that index for real."""
    seen: dict[str, dict[int, Tensor]] = {}
    run = engine.runner.run

    def recorded(
        seqs: list[Sequence], is_prefill: bool, drafts: list[list[int]] | None = None
    ) -> Tensor:
        logits = run(seqs, is_prefill, drafts)
        rows = iter(logits)
        for i, seq in enumerate(seqs):
            for j in range(1 + (len(drafts[i]) if drafts is not None else 0)):
                seen.setdefault(seq.request_id, {})[seq.sample_index + j] = next(rows).clone()
        assert next(rows, None) is None
        return logits

    engine.runner.run = recorded  # type: ignore[method-assign]  # records each forward pass
    return seen


def drive(
    engine: LLMEngine,
    requests: list[tuple[str, list[int], SamplingParams, int]],
    *,
    join_after: int = 0,
) -> dict[str, Run]:
    """Run ``(id, prompt, sampling, generated_offset)`` requests to completion; the first one is
    added ``join_after`` steps before the others. Returns each request's tokens and logits."""
    logits = recording(engine)
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    pending = list(requests)
    steps = 0

    def add(req: tuple[str, list[int], SamplingParams, int]) -> None:
        rid, prompt, sampling, offset = req
        engine.add_request(rid, prompt, sampling, generated_offset=offset)

    add(pending.pop(0))
    while engine.has_unfinished() or pending:
        if pending and steps >= join_after:
            for req in pending:
                add(req)
            pending = []
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        steps += 1
    runs: dict[str, Run] = {}
    for rid, _, _, offset in requests:
        seen = logits[rid]
        runs[rid] = {offset + i: (t, seen[offset + i]) for i, t in enumerate(tokens[rid])}
    return runs


def same(a: Run, b: Run) -> None:
    """Equal tokens and bitwise-equal logits at every index both runs have."""
    common = sorted(a.keys() & b.keys())
    assert common, "the runs share no index"
    for j in common:
        assert a[j][0] == b[j][0], f"token {j} differs"
        assert torch.equal(a[j][1], b[j][1]), f"logits of token {j} differ"


def alone(model_dir: Path, sampling: SamplingParams, config: EngineConfig = DET) -> Run:
    return drive(make_engine(model_dir, config), [("r", PROMPT, sampling, 0)])["r"]


def with_neighbours(order: list[int]) -> Iterator[tuple[str, list[int], SamplingParams, int]]:
    for i in order:
        prompt, sampling = NEIGHBOURS[i]
        yield (f"n{i}", prompt, sampling, 0)


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_same_request_alone_in_a_batch_of_8_and_in_another_order(
    small_model_dir: Path, kind: str
) -> None:
    sampling = SAMPLINGS[kind]
    ref = alone(small_model_dir, sampling)
    assert len(ref) == N
    # In a batch of 8, submitted together, the request third.
    reqs = list(with_neighbours([0, 1]))
    reqs += [("r", PROMPT, sampling, 0), *with_neighbours([2, 3, 4, 5, 6])]
    batch = drive(make_engine(small_model_dir, DET, sampler_seed=1), reqs)
    same(batch["r"], ref)
    # Another order, the request last, and a different unseeded stream for the neighbours.
    reqs = [*with_neighbours([6, 5, 4, 3, 2, 1, 0]), ("r", PROMPT, sampling, 0)]
    reordered = drive(make_engine(small_model_dir, DET, sampler_seed=2), reqs)
    same(reordered["r"], ref)
    # The request decodes alone for 5 steps, then 7 neighbours join (their prefill in between).
    reqs = [("r", PROMPT, sampling, 0), *with_neighbours(list(range(7)))]
    joined = drive(make_engine(small_model_dir, DET), reqs, join_after=5)
    same(joined["r"], ref)


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_resume_from_a_prefix_built_by_prefill_equals_the_decoded_run(
    small_model_dir: Path, kind: str
) -> None:
    """The uninterrupted run built its KV token by token (decode); a resumed one prefills the
    prompt plus the tokens held, on a fresh engine in a busy batch: same logits, same tokens."""
    sampling = SAMPLINGS[kind]
    ref = alone(small_model_dir, sampling)
    held = [ref[j][0] for j in range(N)]
    for m in (1, 9, 23):
        rest = dataclasses.replace(sampling, max_tokens=N - m)
        reqs = [*with_neighbours([4, 0, 2]), ("r", PROMPT + held[:m], rest, m)]
        resumed = drive(make_engine(small_model_dir, DET, sampler_seed=m), reqs)["r"]
        assert sorted(resumed) == list(range(m, N))
        same(resumed, ref)


def test_preemption_recomputes_sampled_requests_exactly(small_model_dir: Path) -> None:
    sampling = SAMPLINGS["seeded"]
    prompts = [[i + 1] * 10 for i in range(4)]
    params = [dataclasses.replace(sampling, seed=100 + i, max_tokens=30) for i in range(4)]
    roomy = make_engine(small_model_dir, DET).generate(prompts, params)
    tight_config = EngineConfig(
        block_size=4, num_blocks=24, max_model_len=64, max_num_batched_tokens=256
    )
    tight = make_engine(small_model_dir, tight_config)
    results = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
    assert [r.logprobs for r in results] == [r.logprobs for r in roomy]


def test_other_geometry_and_threads_do_not_change_anything(small_model_dir: Path) -> None:
    """Another worker: another KV block size and block count, two torch threads set by the
    caller (the deterministic forward runs on one), another unseeded stream."""
    ref = alone(small_model_dir, SAMPLINGS["seeded"])
    other = EngineConfig(block_size=8, num_blocks=80, max_model_len=256, max_num_batched_tokens=512)
    torch.set_num_threads(2)
    try:
        run = drive(
            make_engine(small_model_dir, other, sampler_seed=3),
            [("r", PROMPT, SAMPLINGS["seeded"], 0), *with_neighbours([1, 6])],
        )["r"]
    finally:
        torch.set_num_threads(1)
    same(run, ref)


def test_unseeded_requests_get_seeds_of_their_own(small_model_dir: Path) -> None:
    """A request without a seed draws from its own seed (taken from the engine's stream when it
    is added), so a neighbour's sampling never shifts it."""
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = make_engine(small_model_dir, DET, sampler_seed=42).generate([PROMPT], unseeded)
    b = make_engine(small_model_dir, DET, sampler_seed=42)
    b.add_request("first", PROMPT, unseeded)  # takes the stream's first seed, like `a`'s
    b.add_request("noisy", [9] * 12, SamplingParams(temperature=1.0, max_tokens=30))
    tokens: list[int] = []
    while b.has_unfinished():
        tokens += [t for o in b.step() if o.request_id == "first" for t in o.new_token_ids]
    assert tokens == a[0].token_ids


@pytest.mark.parametrize("drafts", [1, 3, 7])
def test_speculative_decoding_changes_no_bit(small_model_dir: Path, drafts: int) -> None:
    """Draft tokens (prompt lookup) verified in the same step: every request of a busy batch —
    greedy, seeded, unseeded, stopped by a stop token or by its budget — gets the tokens,
    logits, logprobs and finish reasons of one-token decoding, and drafts were really kept."""
    stop = dataclasses.replace(SAMPLINGS["greedy"], stop_token_ids=(11,), ignore_eos=False)
    reqs = [
        ("g", PROMPT, SAMPLINGS["greedy"], 0),
        ("s", PROMPT, SAMPLINGS["seeded"], 0),
        ("stop", [11, 12] * 20, stop, 0),
        ("resumed", [*PROMPT, 5, 17], dataclasses.replace(SAMPLINGS["seeded"], max_tokens=9), 2),
        *with_neighbours(list(range(7))),
    ]
    plain = make_engine(
        small_model_dir, dataclasses.replace(DET, speculative_tokens=0), sampler_seed=1
    )
    spec = make_engine(
        small_model_dir, dataclasses.replace(DET, speculative_tokens=drafts), sampler_seed=1
    )
    a, b = drive(plain, reqs), drive(spec, reqs)
    assert a.keys() == b.keys()
    for rid in a:
        assert sorted(a[rid]) == sorted(b[rid]), rid
        same(a[rid], b[rid])
    assert plain.draft_tokens_proposed == 0
    assert 0 < spec.draft_tokens_accepted <= spec.draft_tokens_proposed
    # generate(): logprobs and finish reasons too, with a tight budget and stop tokens.
    prompts = [PROMPT, [11, 12] * 20, [3] * 5]
    params = [SAMPLINGS["seeded"], stop, dataclasses.replace(SAMPLINGS["greedy"], max_tokens=5)]
    ra = make_engine(small_model_dir, dataclasses.replace(DET, speculative_tokens=0))
    rb = make_engine(small_model_dir, dataclasses.replace(DET, speculative_tokens=drafts))
    for x, y in zip(ra.generate(prompts, params), rb.generate(prompts, params), strict=True):
        assert (x.token_ids, x.logprobs, x.finish_reason) == (
            y.token_ids,
            y.logprobs,
            y.finish_reason,
        )
    assert [len(r.token_ids) for r in rb.generate(prompts[2:], params[2:])] == [5]


@pytest.mark.parametrize("wrong_last", [False, True])
def test_sampled_drafts_are_verified_at_their_own_index(
    small_model_dir: Path, monkeypatch: pytest.MonkeyPatch, wrong_last: bool
) -> None:
    """Seeded sampling at temperature 1 (each draw depends on its index j): a drafter that
    proposes the one-token run's own next tokens (all kept) or the same with its last token
    wrong (all but that one kept) changes no token or log-probability. Always right, its
    sequences are soon trusted and get rows past ``speculative_rows``."""
    seeded = [dataclasses.replace(SAMPLINGS["seeded"], seed=50 + i) for i in range(3)]
    prompts = [PROMPT, [3] * 5, list(range(300, 330))]
    plain = make_engine(small_model_dir, dataclasses.replace(DET, speculative_tokens=0))
    ref = plain.generate(prompts, seeded)
    truth = {tuple(p): p + r.token_ids for p, r in zip(prompts, ref, strict=True)}

    def oracle(self: PromptLookup, tokens: list[int], k: int) -> tuple[list[int], int]:
        full = next(t for p, t in truth.items() if tuple(tokens[: len(p)]) == p)
        assert tokens == full[: len(tokens)], "a token differs from one-token decoding"
        draft = full[len(tokens) : len(tokens) + k]
        if wrong_last and draft:
            draft[-1] = (draft[-1] + 1) % 512
        return draft, PROMPT_LOOKUP_MAX  # a full-length match: confident once trusted

    monkeypatch.setattr(PromptLookup, "guess", oracle)
    config = dataclasses.replace(
        DET, speculative_tokens=3, speculative_rows=3, speculative_rows_confident=6
    )
    spec = make_engine(small_model_dir, config)
    rows: list[int] = []
    drafts = spec._drafts

    def recorded(seqs: list[Sequence]) -> list[list[int]]:  # each step's draft rows
        out = drafts(seqs)
        rows.append(sum(map(len, out)))
        return out

    spec._drafts = recorded  # type: ignore[method-assign]  # records, then returns them
    got = spec.generate(prompts, seeded)
    assert [(r.token_ids, r.logprobs) for r in got] == [(r.token_ids, r.logprobs) for r in ref]
    proposed, kept = spec.draft_tokens_proposed, spec.draft_tokens_accepted
    assert kept > N  # many tokens came from draft rows
    assert kept == proposed if not wrong_last else 0 < kept < proposed
    if not wrong_last:
        assert rows[0] == 3 and max(rows) == 9  # trusted: 3 each, not 3 in all


def test_default_mode_still_matches_to_rounding(small_model_dir: Path) -> None:
    """The fast mode and the deterministic one compute the same model (to float rounding)."""
    det = alone(small_model_dir, SAMPLINGS["greedy"])
    fast = alone(
        small_model_dir, SAMPLINGS["greedy"], dataclasses.replace(DET, deterministic=False)
    )
    for j in range(N):
        assert torch.allclose(det[j][1], fast[j][1], atol=1e-4)


def test_keys_kept_from_step_to_step_change_no_bit(small_model_dir: Path) -> None:
    """A decode step keeps the keys it read for the next step of the same sequences and writes
    only its new rows into them (``model.paged.StepKeys``): a busy batch — a late join, requests
    finishing at different steps, draft rows, contexts crossing an attention chunk — gets the
    tokens and logits of reading every key from the cache in every step, and the kept keys
    were really used."""
    reqs = [("g", PROMPT, SAMPLINGS["greedy"], 0), *with_neighbours(list(range(7)))]
    reqs.append(("s", PROMPT, SAMPLINGS["seeded"], 0))
    fresh = make_engine(small_model_dir, DET, sampler_seed=1)
    fresh.runner.step_keys.put = lambda layer_cache, kv: None  # type: ignore[method-assign]  # nothing kept: every step reads the cache
    kept = make_engine(small_model_dir, DET, sampler_seed=1)
    hits = []
    get = kept.runner.step_keys.get

    def counted(layer_cache: Tensor, shape: tuple[int, ...]) -> Tensor | None:
        found = get(layer_cache, shape)
        hits.append(found is not None)
        return found

    kept.runner.step_keys.get = counted  # type: ignore[method-assign]  # counts the reuses
    a, b = drive(fresh, reqs, join_after=5), drive(kept, reqs, join_after=5)
    assert a.keys() == b.keys()
    for rid in a:
        assert sorted(a[rid]) == sorted(b[rid]), rid
        same(a[rid], b[rid])
    assert sum(hits) > len(hits) // 2 and not all(hits)  # kept mostly, read again at changes


def test_step_keys_are_kept_only_for_the_same_batch_and_shape() -> None:
    keys, cache, other, kv = StepKeys(), torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 3)
    keys.begin(("a", "b"))
    keys.put(cache, kv)
    keys.begin(("a", "b"))
    assert keys.get(cache, (2, 3)) is kv
    assert keys.get(cache, (2, 4)) is None  # another chunk count or batch size
    assert keys.get(other, (2, 3)) is None  # another layer
    keys.begin(("b", "a"))
    assert keys.get(cache, (2, 3)) is None
    keys.put(cache, kv)
    keys.clear()
    keys.begin(("b", "a"))
    assert keys.get(cache, (2, 3)) is None
    small = StepKeys(max_bytes=kv.nbytes)  # room for one layer's copy
    small.begin(("a",))
    small.put(cache, kv)
    small.put(other, kv.clone())
    assert small.get(cache, (2, 3)) is kv and small.get(other, (2, 3)) is None
    small.put(cache, kv.clone())  # a layer's new copy replaces its old one
    assert small.get(cache, (2, 3)) is not kv and small.get(cache, (2, 3)) is not None
