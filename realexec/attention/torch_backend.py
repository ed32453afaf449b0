"""Paged attention in plain torch: the reference backend, runs on any device.

Every layer call (1) scatters the step's new K/V rows into the paged cache at
`slot_mapping`, then (2) lets each sequence's new queries attend to its whole context,
read back from the cache through its block table. Reading everything through the cache
makes prefills, chunked prefills, prefix-cache hits and decodes one code path.

- Decode rows (query length 1) are batched: gather the blocks of the decoding sequences
  into a padded [N, max_len] view and run one masked SDPA call. A batch of very different
  lengths would be mostly padding (ShareGPT-like lengths, median ~100 and max ~1000: 4x
  of a CPU decode step at 64 sequences), so rows are sorted by length and batched per
  group whose lengths are within 2x (`group_decodes`; off: one padded call for all, the
  plainest reference).
- Other rows (prefills, prefill chunks) loop per sequence with SDPA: causal when the
  sequence has no cached context, else an explicit mask with the context offset.
- Per-layer options: `sliding_window` W narrows every mask to the last W positions
  (the query's own included), `logits_soft_cap` c replaces the scaled scores s by
  c * tanh(s / c) before masking; SDPA has no soft cap, so capped layers take an explicit
  scores -> cap -> mask -> softmax path (`_attend`). See `check_layer_options`.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata, check_layer_options


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new rows k, v [T, Hkv, D] into the caches at flat slots; slot -1 is skipped."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    valid = slot_mapping >= 0
    if not bool(valid.all()):   # padding rows present (a host sync; fine for the reference backend)
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[N, num_blocks] block ids -> the sequences' cache rows [N, num_blocks * block_size, Hkv, D]."""
    ids = block_tables[:, :num_blocks]
    n, nb = ids.shape
    # index_select with int64 ids: much faster on CPU than advanced indexing with int32.
    blocks = cache.index_select(0, ids.reshape(-1).long())      # [N * nb, block_size, Hkv, D]
    return blocks.view(n, nb * cache.shape[1], *cache.shape[2:])


def _attend(q, k, v, mask, causal, scale, soft_cap, gqa):
    """Attention over [..., H, L, D] tensors (k/v with H // group heads when gqa): SDPA, or
    with a soft cap the explicit computation (fp32 softmax, like HF's eager attention)."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def _window_mask(kpos: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] keys visible to queries at qpos: causal, and within the last `window`."""
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    return mask


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, group_decodes: bool = True) -> None:
        self.group_decodes = group_decodes
        self._md: AttentionMetadata | None = None
        self._plan: tuple[list, list[int]] = ([], [])

    def _step_plan(self, md: AttentionMetadata) -> tuple[list, list[int]]:
        """([(token rows, sequence rows, max_len) per decode group], prefill sequence ids),
        computed once per step: every layer gets the same metadata object."""
        if md is not self._md:
            qlens, lens = md.query_lens_cpu, md.seq_lens_cpu
            starts = list(accumulate(qlens, initial=0))
            decode = sorted((i for i, n in enumerate(qlens) if n == 1), key=lens.__getitem__)
            groups: list[list[int]] = []
            for i in decode:
                if not groups or (self.group_decodes and lens[i] > 2 * max(lens[groups[-1][0]], md.block_size)):
                    groups.append([])
                groups[-1].append(i)
            device = md.seq_lens.device
            buckets = [(torch.tensor([starts[i] for i in g], device=device), torch.tensor(g, device=device),
                        lens[g[-1]]) for g in groups]
            self._plan = (buckets, [i for i, n in enumerate(qlens) if n > 1])
            self._md = md
        return self._plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                md: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D].

        With k_cache None (a profiling run before the cache exists) every sequence must be
        a whole prompt (seq_len == query_len); it attends to its own new K/V only.
        sliding_window / logits_soft_cap: this layer's options (`check_layer_options`).
        """
        check_layer_options(sliding_window, logits_soft_cap)
        opts = (sliding_window, logits_soft_cap)
        if k_cache is None:
            return self._per_sequence(q, k, v, None, None, md, scale, range(md.num_seqs), opts)
        write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
        buckets, prefills = self._step_plan(md)
        if len(buckets) == 1 and not prefills and q.shape[0] == md.num_seqs:   # one row per sequence, one group
            return self._decode(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                md.max_seq_len, md.block_size, scale, opts)

        out = torch.zeros_like(q)   # rows of no sequence (padding) stay 0
        for token_rows, seq_rows, max_len in buckets:
            out[token_rows] = self._decode(q[token_rows], k_cache, v_cache, md.block_tables[seq_rows],
                                           md.seq_lens[seq_rows], max_len, md.block_size, scale, opts)
        if prefills:
            self._per_sequence(q, k, v, k_cache, v_cache, md, scale, prefills, opts, out)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, block_size, scale, opts=(None, None)):
        """One query per sequence: q [N, Hq, D] against each sequence's first seq_len cache rows."""
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[-2]
        num_blocks = max(1, -(-max_seq_len // block_size))
        keys = gather_kv(k_cache, block_tables, num_blocks).transpose(1, 2).to(q.dtype)  # [N, Hkv, L, D]
        values = gather_kv(v_cache, block_tables, num_blocks).transpose(1, 2).to(q.dtype)
        # GQA without repeating K/V: the query heads sharing a kv head become that head's
        # "query length" axis, since in decode they all see the same keys with the same mask.
        qg = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        # clamp: a padding row (seq_len 0) attends to one junk key instead of producing NaN.
        lens = seq_lens.clamp(min=1).to(torch.long)
        window, soft_cap = opts
        kpos = torch.arange(keys.shape[2], device=q.device)[None, :]
        mask = kpos < lens[:, None]
        if window is not None:      # the query sits at position len - 1
            mask &= kpos >= lens[:, None] - window
        out = _attend(qg, keys, values, mask[:, None, None, :], False, scale, soft_cap, False)
        return out.reshape(n, num_heads, head_dim)

    @staticmethod
    def _per_sequence(q, k, v, k_cache, v_cache, md, scale, seq_ids, opts=(None, None), out=None):
        if out is None:
            out = torch.zeros_like(q)
        starts = list(accumulate(md.query_lens_cpu, initial=0))
        gqa = q.shape[1] != k.shape[1]
        for i in seq_ids:
            q_len, seq_len = md.query_lens_cpu[i], md.seq_lens_cpu[i]
            if q_len == 0 or seq_len == 0:      # padding
                continue
            s = starts[i]
            context_len = seq_len - q_len
            if k_cache is None:
                assert context_len == 0, "no KV cache: only whole-prompt prefills are possible"
                keys, values = k[s:s + q_len], v[s:s + q_len]
            else:
                num_blocks = -(-seq_len // md.block_size)
                table = md.block_tables[i:i + 1]
                keys = gather_kv(k_cache, table, num_blocks)[0, :seq_len].to(q.dtype)
                values = gather_kv(v_cache, table, num_blocks)[0, :seq_len].to(q.dtype)
            window, soft_cap = opts
            if context_len == 0 and (window is None or window >= seq_len):
                mask, causal = None, True
            else:  # query j sits at position context_len + j and sees keys 0..context_len + j
                kpos = torch.arange(seq_len, device=q.device)
                qpos = torch.arange(context_len, seq_len, device=q.device)
                mask, causal = _window_mask(kpos, qpos, window), False
            o = _attend(q[s:s + q_len].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                        mask, causal, scale, soft_cap, gqa)
            out[s:s + q_len] = o.transpose(0, 1)
        return out
