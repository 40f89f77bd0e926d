"""The deterministic forward's attention over the paged KV cache (``deterministic=True``).

Every query row attends over its own sequence's keys in the fixed chunks of
:func:`model.batch_invariant.attend`, so its bits do not depend on the batch, on whether its
past keys came from a prefill or from decode steps, or on the engine against the trainer's
dense forward (which calls :func:`attend_sequence` too).

The keys a decode step attends over are read from the cache into the attention's chunk layout
(``[2, chunks, S, kv_heads, C, head_dim]``: :func:`model.batch_invariant.chunk_kv`). Where the
caller gives the step a :class:`~model.paged.StepKeys` (the engine's model runner does), that
copy is kept from one step to the next while the batch holds the same sequences in the same
order and chunk count, and a step writes only its new keys into it: every layer of every step
otherwise re-reads the whole context (a tenth of a batch-8 step of the tiny model). The values
attended to are the same either way: the kept copy holds what the cache holds at every position
a row can see (positions past a row are hidden from it, whatever they hold).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model import batch_invariant as bi
from model.paged import AttentionMetadata


def attend_sequence(q: Tensor, kv: Tensor, kv_heads: int) -> Tensor:
    """One sequence's queries ``[n, heads, hd]`` at positions ``0..n-1`` over its keys and
    values ``kv`` ``[2, L, kv_heads, hd]`` (``L`` a whole number of attention chunks)."""
    n, heads, hd = q.shape
    g = heads // kv_heads
    # Rows of KV head h: query heads h*g .. h*g+g-1 of every token, token-major.
    rows = q.view(n, kv_heads, g, hd).permute(1, 0, 2, 3).reshape(1, kv_heads, n * g, hd)
    pos = torch.arange(n, device=q.device).repeat_interleave(g)[None]
    out = bi.attend(rows, pos, bi.chunk_kv(kv, 1))
    return out.view(kv_heads, n, g, hd).permute(1, 0, 2, 3).reshape(n, heads, hd)


def paged_attention(
    q: Tensor, kv_new: tuple[Tensor, Tensor], attn: AttentionMetadata, flat_cache: Tensor
) -> Tensor:
    """The step's real rows' attention, ``[n, heads, hd]``, for their queries ``q`` and their
    keys and values ``kv_new`` (``[n, kv_heads, hd]`` each), already written to this layer's
    cache ``flat_cache`` ``[2, slots, kv_heads, hd]``."""
    kv_heads = flat_cache.shape[2]
    if attn.is_prefill:
        outs, start = [], 0
        for n, slots in zip(attn.seq_lens, attn.deterministic_kv_slots(), strict=True):
            outs.append(attend_sequence(q[start : start + n], flat_cache[:, slots], kv_heads))
            start += n
        return torch.cat(outs)
    if attn.row_groups is not None:
        return _grouped_attention(q, kv_new, attn, flat_cache, attn.row_groups)
    assert attn.context_lens is not None
    b, heads, hd = q.shape
    g = heads // kv_heads
    kv = _context_kv(kv_new, attn, flat_cache, range(b), None)
    cache = attn.det_cache
    pos = cache.get("pos")
    if pos is None:
        pos = cache["pos"] = (attn.context_lens - 1)[:, None].expand(b, g)
    return bi.attend(q.view(b, kv_heads, g, hd), pos, kv, cache).reshape(b, heads, hd)


def _grouped_attention(
    q: Tensor,
    kv_new: tuple[Tensor, Tensor],
    attn: AttentionMetadata,
    flat_cache: Tensor,
    groups: list[int],
) -> Tensor:
    """Deterministic decode where a sequence has several rows at consecutive positions:
    each sequence's rows attend together, as a prefill's tokens do (:func:`attend_sequence`),
    over its keys read once; every query row gets the bits it gets alone
    (:func:`model.batch_invariant.attend`: a row sees keys up to its position)."""
    assert attn.context_lens is not None
    s, width = len(groups), max(groups)
    heads, kv_heads, hd = q.shape[1], flat_cache.shape[2], q.shape[2]
    g = heads // kv_heads
    cache = attn.det_cache
    if "group-take" not in cache:  # once per step, shared by the layers
        starts = [sum(groups[:i]) for i in range(s)]
        # Row j of group i is step row starts[i] + j; a group's padding rows repeat its
        # last row (same position, output dropped).
        take = [
            st + min(j, n - 1) for st, n in zip(starts, groups, strict=True) for j in range(width)
        ]
        keep = [i * width + j for i, n in enumerate(groups) for j in range(n)]
        cache["group-take"] = torch.tensor(take, device=q.device)
        cache["group-keep"] = torch.tensor(keep, device=q.device)
        cache["group-first"] = torch.tensor(starts, device=q.device)
        rows_pos = (attn.context_lens - 1)[cache["group-take"]]
        cache["group-pos"] = rows_pos.view(s, width).repeat_interleave(g, dim=1)
        cache["group-owners"] = [i for i, n in enumerate(groups) for _ in range(n)]
    kv = _context_kv(kv_new, attn, flat_cache, cache["group-owners"], cache["group-first"])
    rows = q.index_select(0, cache["group-take"]).view(s, width, kv_heads, g, hd)
    rows = rows.permute(0, 2, 1, 3, 4).reshape(s, kv_heads, width * g, hd)
    out = bi.attend(rows, cache["group-pos"], kv, cache)
    out = out.view(s, kv_heads, width, g, hd).permute(0, 2, 1, 3, 4).reshape(s * width, -1, hd)
    return out.index_select(0, cache["group-keep"])


def _context_kv(
    kv_new: tuple[Tensor, Tensor],
    attn: AttentionMetadata,
    flat_cache: Tensor,
    owners: Sequence[int],
    firsts: Tensor | None,
) -> Tensor:
    """Keys and values of the step's sequences in the chunk layout ``[2, chunks, S, kv_heads,
    C, hd]``; ``owners``: each real row's sequence (``0..S-1``), ``firsts``: the step row of
    each sequence's first row (None: one row each). Read from the cache, or the last step's
    copy with this step's rows ``kv_new`` written into it."""
    assert attn.context_lens is not None
    s, c = owners[-1] + 1, bi.ATTENTION_CHUNK
    kv_heads, hd = flat_cache.shape[2], flat_cache.shape[3]
    shape = (2, attn.det_chunks(), s, kv_heads, c, hd)
    cache, kept = attn.det_cache, attn.step_keys
    kv = None if kept is None else kept.get(flat_cache, shape)
    if kv is not None:
        index = cache.get("append")
        if index is None:  # once per step: where each new row's keys go in the layout
            index = cache["append"] = _append_index(attn.context_lens - 1, owners, shape)
        kv.view(-1, hd).index_copy_(0, index, torch.stack(kv_new).view(-1, hd))
        return kv
    index = cache.get("gather")
    if index is None:  # once per step: every layer reads the same slots
        slots = attn.deterministic_kv_slots()[0]
        slots = slots if firsts is None else slots[firsts]
        index = cache["gather"] = bi.gather_index(slots, kv_heads, flat_cache.shape[1])
    kv = flat_cache.view(-1, hd).index_select(0, index).view(shape)
    if kept is not None:
        kept.put(flat_cache, kv)
    return kv


def _append_index(positions: Tensor, owners: Sequence[int], shape: tuple[int, ...]) -> Tensor:
    """Rows of the chunk layout ``shape`` viewed as ``[-1, hd]`` where the keys (then the
    values) of rows at ``positions`` of sequences ``owners`` go, in ``[2, rows, kv_heads]``
    order."""
    _, chunks, s, kv_heads, c, _ = shape
    seq = torch.tensor(owners, device=positions.device)
    base = ((positions // c) * s + seq) * kv_heads  # [rows]
    heads = torch.arange(kv_heads, device=positions.device)
    rows = ((base[:, None] + heads) * c + (positions % c)[:, None]).reshape(-1)
    return torch.cat([rows, rows + chunks * s * kv_heads * c])
