"""A Qwen3 or Llama causal LM in plain torch whose attention reads and writes a paged KV cache.

The maths follows Hugging Face's ``modeling_qwen3`` and ``modeling_llama`` (RMSNorm, rotate-half
RoPE, grouped-query attention, SiLU-gated MLP, optionally tied embeddings) so that greedy
decoding matches transformers token for token. The two families share this one decoder, its
paged attention, its batch-invariant path and its training forward; the config's family
(:data:`model.config.FAMILIES`) decides what differs: Qwen3 normalises each head's q and k
(``q_norm``/``k_norm``) before RoPE, Llama does not (and has no such weights); the RoPE base,
the head counts and the tying of the output layer come from ``config.json``. What differs is where K/V live: one tensor of shape
:func:`kv_cache_shape` owned by another process (the KV arena). Each step the model writes
the new tokens' K/V into the flat slots ``attn.slot_mapping`` and reads a sequence's past
K/V through its block table.

Every module also has a ``forward_dense`` path over a padded ``[batch, tokens]`` batch with no
KV cache, for training; it reuses the same parameters and projection code, so one state dict
serves both (the public training helpers are in :mod:`model.train_forward`).

Deterministic mode (``build_model(..., deterministic=True)``) swaps the matmuls, the SiLU and
the attention for the batch-invariant versions of :mod:`model.batch_invariant` (the paged
attention: :mod:`model.det_attention`), in both the paged and the dense forward: a
position's logits are then bitwise the same whatever the batch, whether its past K/V was built
by prefill or by decode, and in the trainer's dense forward.
The default (fast) mode matches them to within float rounding only.

The module never owns its weights: :func:`build_model` creates it on the ``meta`` device and
installs the caller's tensors (zero-copy views of the weight store's shared memory) as
parameters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import batch_invariant as bi
from model.config import ModelConfig
from model.det_attention import attend_sequence, paged_attention
from model.fused import Projection
from model.paged import AttentionMetadata
from model.paged import kv_cache_shape as kv_cache_shape  # re-exported: callers import it here


@dataclass(frozen=True)
class PagedStep:
    """What every layer of one paged forward step reads alike (each layer has its own cache)."""

    cos: Tensor
    """RoPE cosines at the step's positions, ``[T, 1, head_dim]``."""
    sin_rot: Tensor
    """RoPE sines (rotate-half signs folded in) at the step's positions, ``[T, 1, head_dim]``."""
    attn: AttentionMetadata
    deterministic: bool = False
    """The batch-invariant attention (:mod:`model.det_attention`): each row over its own
    sequence's keys, in fixed chunks."""


@dataclass(frozen=True)
class DenseStep:
    """What every layer of one dense (training) forward reads alike."""

    cos: Tensor
    """RoPE cosines at each row's positions, ``[B, T, 1, head_dim]``."""
    sin_rot: Tensor
    """RoPE sines (rotate-half signs folded in), ``[B, T, 1, head_dim]``."""
    mask: Tensor | None
    """``[B, 1, T, T]``, true where a query may see a key; None: plain causal attention."""
    spans: list[tuple[int, int]] | None = None
    """Deterministic mode: each row's ``(start, length)`` of real tokens; None otherwise."""


def _rope_tables(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin tables, ``[max_position_embeddings, head_dim]`` each.

    Computed exactly as HF does (same float32 ops) so positions match bit for bit. ``sin``
    has its first half negated so that ``rotate_half(x) * sin`` becomes
    ``roll(x, half) * sin_rot``: one op instead of a slice/neg/cat.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = dim // 2
    sin_rot = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.to(cfg.dtype), sin_rot.to(cfg.dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` for ``x`` of shape ``[..., heads, head_dim]``."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_rot


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Qwen3Attention(nn.Module):
    """Grouped-query self-attention over a paged KV cache (or, for training, over a dense
    padded batch); with per-head q/k norms when the family has them (Qwen3, not Llama)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: Projection | None = None
        """The engine's q, k and v as one product (:func:`model.fused.prepare_for_inference`)."""
        self.qk_norm_weight: Tensor | None = None
        """With ``qkv``, where the family norms q and k: their norms' weights stacked per head,
        ``[heads + kv_heads, head_dim]``, so that one norm serves the q and k heads of the
        fused product."""
        self.o: Projection | None = None
        """The engine's output projection (likewise)."""

    def project_qkv(
        self, x: Tensor, cos: Tensor, sin_rot: Tensor, det: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q and k (normed when the family says so, rotated) and v, ``[..., heads, head_dim]``, for ``x`` ``[..., hidden]``.

        ``cos``/``sin_rot`` broadcast against the result (``[..., 1, head_dim]``). Shared by the
        paged and the dense forward, so both compute the same projections; ``det`` uses the
        batch-invariant matmul (the paged deterministic forward passes False: its rows are
        already padded, so the plain matmul is row-invariant).
        """
        lead, h, kvh, hd = x.shape[:-1], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None and not det:
            # Views of one product, q and k rotated together: every op below is row-wise and
            # elementwise-exact or a copy, so the bits are those of the separate products.
            # (narrow, not [..., a:b, :]: the same views, a third of the indexing's time)
            qkv = self.qkv(x).view(*lead, h + 2 * kvh, hd)
            qk, v = qkv.narrow(-2, 0, h + kvh), qkv.narrow(-2, h + kvh, kvh)
            if self.q_norm is not None and self.k_norm is not None:
                qk = self._norm_qk(qk, h)
            qk = _apply_rope(qk, cos, sin_rot)
            return qk.narrow(-2, 0, h), qk.narrow(-2, h, kvh), v
        lin = bi.linear if det else _linear
        q = lin(x, self.q_proj.weight).view(*lead, h, hd)
        k = lin(x, self.k_proj.weight).view(*lead, kvh, hd)
        v = lin(x, self.v_proj.weight).view(*lead, kvh, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _apply_rope(q, cos, sin_rot)
        k = _apply_rope(k, cos, sin_rot)
        return q, k, v

    def _norm_qk(self, qk: Tensor, h: int) -> Tensor:
        """The q norm of the first ``h`` heads of ``qk`` and the k norm of the rest."""
        assert self.q_norm is not None and self.k_norm is not None
        if self.qk_norm_weight is None:
            return torch.cat((self.q_norm(qk[..., :h, :]), self.k_norm(qk[..., h:, :])), -2)
        # One norm of every head, then the stacked weights: F.rms_norm multiplies by its weight
        # last, so these are the two norms' bits (tests/unit/test_fused.py) for one op, not 3.
        return F.rms_norm(qk, self.q_norm.shape, None, self.q_norm.eps) * self.qk_norm_weight

    def forward_dense(self, x: Tensor, step: DenseStep) -> Tensor:
        """Causal attention over a padded batch ``x`` ``[B, T, hidden]``, no KV cache.

        ``step.mask`` is ``[B, 1, T, T]`` (true where a query may see a key) or None for plain
        causal attention over unpadded rows. With ``step.spans`` (deterministic mode: each
        row's ``(start, length)`` of real tokens) the mask is unused and every real query
        attends exactly as the paged deterministic forward does; padded queries get zeros.
        """
        b, t = x.shape[:2]
        cos, sin_rot, spans = step.cos, step.sin_rot, step.spans
        if spans is not None:
            q, k, v = self.project_qkv(x, cos, sin_rot, det=True)
            rows = []
            for i, (start, n) in enumerate(spans):
                end = start + n
                if n == 0:  # an all-padding row
                    rows.append(q.new_zeros(t, self.num_heads, self.head_dim))
                    continue
                kv = torch.stack([k[i, start:end], v[i, start:end]])
                pad = bi.chunks_for(n) * bi.ATTENTION_CHUNK - n
                kv = F.pad(kv, (0, 0, 0, 0, 0, pad))
                o = attend_sequence(q[i, start:end], kv, self.num_kv_heads)
                rows.append(F.pad(o, (0, 0, 0, 0, start, t - end)))
            return bi.linear(torch.stack(rows).reshape(b, t, -1), self.o_proj.weight)
        q, k, v = (y.transpose(1, 2) for y in self.project_qkv(x, cos, sin_rot))
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=step.mask, is_causal=step.mask is None, enable_gqa=True
        )
        return F.linear(o.transpose(1, 2).reshape(b, t, -1), self.o_proj.weight)

    def forward(
        self, x: Tensor, step: PagedStep, flat_cache: Tensor, block_cache: Tensor
    ) -> Tensor:
        """``x`` is ``[T, hidden]``; ``flat_cache`` is this layer's ``[2, slots, kv_heads, hd]``
        view and ``block_cache`` the same memory as ``[2, blocks, block_size, kv_heads, hd]``.
        ``step.deterministic`` selects the batch-invariant attention, which
        reads every key back from the cache; ``x`` then holds the step's tokens followed by zero
        or more padding rows (already enough rows for every matmul to be row-invariant:
        :func:`model.batch_invariant.bucket`).
        """
        t = x.shape[0]
        attn = step.attn
        q, k, v = self.project_qkv(x, step.cos, step.sin_rot)
        if step.deterministic:
            # Rows past the step's tokens are padding (see Qwen3ForCausalLM.forward): the
            # matmuls run on all of them, the cache and the attention on the real ones only.
            n = attn.slot_mapping.shape[0]
            flat_cache[0].index_copy_(0, attn.slot_mapping, k[:n])
            flat_cache[1].index_copy_(0, attn.slot_mapping, v[:n])
            out = paged_attention(q[:n], (k[:n], v[:n]), attn, flat_cache)
            out = out.reshape(n, -1)
            return self._project_out(out if t == n else F.pad(out, (0, 0, 0, t - n)))
        flat_cache[0].index_copy_(0, attn.slot_mapping, k)
        flat_cache[1].index_copy_(0, attn.slot_mapping, v)
        if attn.is_prefill:
            out = self._prefill_attention(q, k, v, attn.seq_lens)
        else:
            out = self._decode_attention(q, attn, block_cache)
        return self._project_out(out.reshape(t, -1))

    def _project_out(self, x: Tensor) -> Tensor:
        return self.o(x) if self.o is not None else F.linear(x, self.o_proj.weight)

    def _prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, seq_lens: list[int]) -> Tensor:
        # Whole sequences from position 0: the fresh K/V are the full context, so no cache
        # read. Varlen by looping; prompts are few per step and each call is one big kernel.
        out = torch.empty_like(q)
        start = 0
        for n in seq_lens:
            end = start + n
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)
            start = end
        return out

    def _decode_attention(self, q: Tensor, attn: AttentionMetadata, block_cache: Tensor) -> Tensor:
        assert attn.block_tables is not None and attn.attn_mask is not None
        b = attn.block_tables.shape[0]
        # One gather of K and V for the whole batch: [2, B, max_blocks, block_size, kvh, hd]
        # (index_select copies whole blocks; advanced indexing was several times slower).
        blocks = block_cache.index_select(1, attn.block_tables.reshape(-1))
        kv = blocks.view(2, b, -1, self.num_kv_heads, self.head_dim)
        k = kv[0].transpose(1, 2)
        v = kv[1].transpose(1, 2)
        # The query heads sharing a KV head become that head's "query positions", so GQA
        # needs no repeat of K/V and the mask [B, 1, 1, L] broadcasts over them.
        groups = self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, groups, self.head_dim)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=attn.attn_mask)
        return o.reshape(b, self.num_heads, self.head_dim)


class Qwen3MLP(nn.Module):
    """SiLU-gated feed-forward block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.intermediate_size = cfg.intermediate_size
        self.gate_up: Projection | None = None
        """The engine's gate and up as one product (:func:`model.fused.prepare_for_inference`)."""
        self.down: Projection | None = None
        """The engine's down projection (likewise)."""

    def forward(self, x: Tensor, det: bool = False, padded: bool = False) -> Tensor:
        """``det``: the batch-invariant SiLU and matmuls; ``padded``: ``x``'s rows are already
        enough for the plain matmul to be row-invariant (the paged deterministic forward)."""
        if self.gate_up is not None and self.down is not None and (padded or not det):
            gate_up, inter = self.gate_up(x), self.intermediate_size
            gate, up = gate_up.narrow(-1, 0, inter), gate_up.narrow(-1, inter, inter)
            # bi.silu's first op (clamp) is exact on the strided view; F.silu's scalar tail
            # would fall per row on it, so it gets the contiguous copy the separate product gave.
            act = bi.silu(gate) if det else F.silu(gate.contiguous())
            return self.down(
                act.mul_(up)
            )  # act is this call's own (a prepared model is not trained)
        if det:
            lin = _linear if padded else bi.linear
            gate = bi.silu(lin(x, self.gate_proj.weight))
            return lin(gate * lin(x, self.up_proj.weight), self.down_proj.weight)
        gate = F.silu(F.linear(x, self.gate_proj.weight))
        return F.linear(gate * F.linear(x, self.up_proj.weight), self.down_proj.weight)


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, step: PagedStep, flat_cache: Tensor, block_cache: Tensor
    ) -> Tensor:
        # .forward, not the modules' __call__: no hooks here, and a decode step makes 21 calls.
        normed = self.input_layernorm.forward(x)
        x = x + self.self_attn.forward(normed, step, flat_cache, block_cache)
        det = step.deterministic
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x), det, det)

    def forward_dense(self, x: Tensor, step: DenseStep) -> Tensor:
        """The same block over a padded batch ``[B, T, hidden]`` (see ``forward_dense`` of
        :class:`Qwen3Attention`; ``step.spans`` selects deterministic mode)."""
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x), step.spans is not None)


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` parameters)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 or Llama causal LM (``config.model_type``) over a paged KV cache (:meth:`forward`), with a dense training path
    (:meth:`forward_dense`) on the same parameters. Build it with :func:`build_model`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.deterministic = False
        """Batch-invariant forward (see the module docstring); set by :func:`build_model`."""
        self.head: Projection | None = None
        """The engine's output layer (:func:`model.fused.prepare_for_inference`)."""
        self._det_min_rows: int | None = None
        self.rope_cos: Tensor
        self.rope_sin: Tensor

    def forward(
        self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata, kv_cache: Tensor
    ) -> Tensor:
        """Run ``T`` tokens through the model, writing their K/V into ``kv_cache``.

        ``input_ids`` and ``positions`` are ``[T]`` int64; ``kv_cache`` has
        :func:`kv_cache_shape`. Returns the final-norm hidden states ``[T, hidden]``.

        Deterministic mode pads the step once, to :func:`model.batch_invariant.bucket` rows
        (token 0 at position 0: finite, never written to the cache, dropped at the end), so
        every matmul of the decoder runs row-invariant without padding its own input.
        """
        with bi.one_thread() if self.deterministic else contextlib.nullcontext():
            t = input_ids.shape[0]
            rows = self.det_rows(t) if self.deterministic else t
            if rows > t:
                input_ids = F.pad(input_ids, (0, rows - t))
                positions = F.pad(positions, (0, rows - t))
            x = F.embedding(input_ids, self.model.embed_tokens.weight)
            step = PagedStep(
                cos=self.rope_cos.index_select(0, positions).unsqueeze(1),
                sin_rot=self.rope_sin.index_select(0, positions).unsqueeze(1),
                attn=attn,
                deterministic=self.deterministic,
            )
            flat = kv_cache.flatten(2, 3)
            for i, layer in enumerate(self.model.layers):
                x = cast(Qwen3DecoderLayer, layer).forward(x, step, flat[i], kv_cache[i])
            return self.model.norm(x[:t])

    def det_rows(self, t: int) -> int:
        """Rows a deterministic step of ``t`` tokens runs its products with: ``t`` padded to
        the bucket of :meth:`det_min_rows`, or only up to it where every prepared product is
        exact for any count of rows from there (:attr:`model.fused.Projection.any_count`)."""
        prepared = [p for p in self._products() if p is not None]
        any_count = bool(prepared) and all(p.any_count for p in prepared)
        return bi.bucket(t, self.det_min_rows(), any_count)

    def _products(self) -> list[Projection | None]:
        layers = [cast(Qwen3DecoderLayer, layer) for layer in self.model.layers]
        products = [(x.self_attn.qkv, x.self_attn.o, x.mlp.gate_up, x.mlp.down) for x in layers]
        return [p for four in products for p in four] + [self.head]

    def det_min_rows(self) -> int:
        """The most rows any of the decoder's matmuls needs to be row-invariant on this
        machine: the prepared products' ``exact_rows`` (:mod:`model.fused`), else
        :func:`model.batch_invariant.min_rows` over their shapes (probed once)."""
        prepared = [p.exact_rows for p in self._products() if p is not None]
        if prepared:
            return max(prepared)
        if self._det_min_rows is None:
            cfg = self.config
            hidden, inter = cfg.hidden_size, cfg.intermediate_size
            q_out = cfg.num_attention_heads * cfg.head_dim
            kv_out = cfg.num_key_value_heads * cfg.head_dim
            shapes = {(hidden, q_out), (hidden, kv_out), (q_out, hidden), (hidden, inter)}
            shapes.add((inter, hidden))
            rows = (bi.min_rows("linear", k, n, cfg.dtype) for k, n in shapes)
            self._det_min_rows = max(rows)
        return self._det_min_rows

    def forward_dense(
        self,
        input_ids: Tensor,
        positions: Tensor,
        mask: Tensor | None,
        spans: list[tuple[int, int]] | None = None,
    ) -> Tensor:
        """Run a padded batch without a KV cache, autograd-friendly (the training path).

        ``input_ids`` and ``positions`` are ``[B, T]`` int64; ``mask`` is ``[B, 1, T, T]`` bool
        or None; in deterministic mode ``spans`` (each row's ``(start, length)`` of real tokens)
        replaces the mask (see :mod:`model.train_forward`, which builds them). Returns the
        final-norm hidden states ``[B, T, hidden]``.
        """
        if self.deterministic and spans is None:
            raise ValueError("a deterministic model's dense forward needs spans")
        with bi.one_thread() if self.deterministic else contextlib.nullcontext():
            x = F.embedding(input_ids, self.model.embed_tokens.weight)
            step = DenseStep(
                cos=self.rope_cos[positions].unsqueeze(2),
                sin_rot=self.rope_sin[positions].unsqueeze(2),
                mask=mask,
                spans=spans if self.deterministic else None,
            )
            for layer in self.model.layers:
                x = cast(Qwen3DecoderLayer, layer).forward_dense(x, step)
            return self.model.norm(x)

    def output_weight(self) -> Tensor:
        """The output layer's rows :meth:`compute_logits` multiplies by: in deterministic mode
        only the tokenizer's (``config.output_vocab_size``; the rest become −inf without a
        product), else all of them. The engine and the trainer both multiply by this, so they
        agree bit for bit whatever the kernels; on the CPUs measured the real columns also keep
        the bits of the whole product from the row-invariant GEMM's rows up."""
        weight = self.lm_head.weight
        limit = self.config.output_vocab_size
        if self.deterministic and 0 < limit < weight.shape[0]:
            return weight[:limit]
        return weight

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Output-layer logits ``[..., vocab]`` for hidden states ``[..., hidden]``; rows past
        the tokenizer (``config.output_vocab_size``) are −inf, so no sampler picks them and
        their log-probability is −inf in the engine and the trainer alike. Deterministic mode
        computes only the tokenizer's columns (:meth:`output_weight`): on the tiny model (2,042
        of 4,096) that halves the output layer, a quarter of a decode step's products."""
        if self.deterministic:
            head = self.head
            floor, any_count = (None, False) if head is None else (head.exact_rows, head.any_count)
            with bi.one_thread():
                logits = bi.linear(hidden, self.output_weight(), head, floor, any_count)
        elif self.head is not None:
            logits = self.head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head.weight)
        limit = self.config.output_vocab_size
        if 0 < limit < self.config.vocab_size:
            # A copy of the real columns, -inf after: a third of masked_fill's time.
            width = self.config.vocab_size - limit
            logits = F.pad(logits[..., :limit], (0, width), value=float("-inf"))
        return logits


def logprobs_at_temperature(logits: Tensor, temperatures: Tensor | None) -> Tensor:
    """fp32 ``log_softmax(logits / temperature)`` over the last dim; ``temperatures`` has
    ``logits``' leading shape (1.0 for greedy rows), None: 1.0 everywhere (no division:
    ``x / 1`` is ``x`` bit for bit). The one definition of a reported log-probability: the
    engine's sampler and the trainer's :func:`~model.train_forward.token_logprobs` both call
    it, so equal logits give bitwise-equal log-probabilities."""
    if temperatures is None:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(logits.float() / temperatures.float()[..., None], dim=-1)


def build_model(
    cfg: ModelConfig, tensors: dict[str, Tensor], *, deterministic: bool = False
) -> Qwen3ForCausalLM:
    """Build the model around ``tensors`` (HF names) without copying them.

    The module is created on the ``meta`` device, then every parameter is replaced by an
    ``nn.Parameter`` that shares storage with the given tensor, so weights living in another
    process's shared memory are used in place. Raises ``ValueError`` on a missing, unexpected
    or misshapen tensor. Run the result under ``torch.inference_mode()``. ``deterministic``
    selects the batch-invariant forward (see the module docstring).
    """
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    expected = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    # Non-parameter tensors some exporters include; they carry nothing we use.
    provided = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        provided.pop("lm_head.weight", None)
    missing = sorted(expected.keys() - provided.keys())
    unexpected = sorted(provided.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the config: missing={missing[:8]} unexpected={unexpected[:8]}"
        )
    for name, meta in expected.items():
        tensor = provided[name]
        if tuple(tensor.shape) != tuple(meta.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(meta.shape)}")
        if tensor.dtype != cfg.dtype:
            raise ValueError(f"{name}: dtype {tensor.dtype}, config says {cfg.dtype}")
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    cos, sin_rot = _rope_tables(cfg)
    device = model.model.embed_tokens.weight.device  # the weights' (cpu, or cuda on a GPU)
    model.register_buffer("rope_cos", cos.to(device), persistent=False)
    model.register_buffer("rope_sin", sin_rot.to(device), persistent=False)
    model.deterministic = deterministic
    return model.eval()


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)
