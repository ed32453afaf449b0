"""What the attention tests share: a dense fp64 reference and the step metadata of a
paged batch (not a test module)."""
import torch

from realexec.attention.metadata import AttentionMetadata


def dense(q, keys, values, context_len, scale, window=None, cap=None):
    """Causal attention of q [Lq, Hq, D] at positions context_len.. over keys/values
    [Lk, Hkv, D] at 0..Lk-1, in fp64, returned in q's dtype. HF semantics for the options:
    a query at p sees keys p - window < j <= p; scores s -> cap * tanh(s / cap) before the mask."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).double()
    v = values.repeat_interleave(group, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(hidden, float("-inf")).softmax(-1), v).to(q.dtype)


def paged_metadata(tables, slots, starts, lens, query_lens, block_size, width) -> AttentionMetadata:
    """One step's metadata: block tables (padded to `width` columns), the new tokens' cache
    slots, query start offsets, sequence lengths and query lengths per sequence."""
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=bt, block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(lens))
