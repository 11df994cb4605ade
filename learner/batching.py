"""From a claimed batch of groups to micro-batches a model can take.

Each sample becomes one sequence (prompt + response). Micro-batches hold whole sequences up to a
token budget. Packed (padding-free) micro-batches lay their sequences end to end in one row with
position ids restarting at 0 for each: transformers then restricts attention to each sequence
(a block-causal mask for sdpa/eager, variable-length kernels for flash attention). Padded
micro-batches are the fallback for models that do not support packing.

Token-level values live in two layouts: ``_1L``/``_bL`` aligned with the model's input row (the
value at position p belongs to the token at p + 1, the one predicted there) and ``_BT``: one row
per sequence, its response tokens only, right-padded (what ``learner.algos`` takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flywheel.hub_client import Batch


@dataclass
class Sequence:
    prompt: np.ndarray  # int32 token ids
    response: np.ndarray  # int32 token ids
    behav_logprobs: np.ndarray  # float32, one per response token
    versions: np.ndarray  # int32, one per response token
    reward: float
    group: int  # index of its group in the batch
    staleness: int
    aborted: bool = False  # cut off by the engine (finish "abort"), not ended by the policy or the budget


def sequences(batch: Batch) -> tuple[list[Sequence], torch.Tensor]:
    """Every sample of the batch, in group order, and the rewards as [groups, samples]."""
    out = []
    rewards = []
    for g, group in enumerate(batch.groups):
        row = []
        for s in group.samples:
            out.append(
                Sequence(
                    prompt=group.prompt_tokens,
                    response=s.tokens,
                    behav_logprobs=s.logprobs,
                    versions=s.versions,
                    reward=float(s.reward),
                    group=g,
                    staleness=group.staleness,
                    aborted=s.finish_reason == "abort",
                )
            )
            row.append(float(s.reward))
        rewards.append(row)
    return out, torch.tensor(rewards, dtype=torch.float32)


@dataclass
class MicroBatch:
    seq_index: list[int]  # which sequences of the step (indices into the step's list)
    input_ids: torch.Tensor  # [b, L] (b = 1 when packed)
    position_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor | None  # [b, L] when padded; None when packed
    targets: torch.Tensor  # [b, L] next token at each position (0 where none)
    # (row, column) in the input layout of each response token's prediction, per sequence
    gather_rows: list[torch.Tensor]
    gather_cols: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``budget`` tokens (first-fit
    decreasing; a sequence longer than the budget gets one of its own)."""
    if budget <= 0:
        raise ValueError(f"micro-batch token budget must be > 0, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def build_micro_batch(seqs: list[Sequence], index: list[int], packed: bool, pad_id: int) -> MicroBatch:
    parts = [np.concatenate([seqs[i].prompt, seqs[i].response]).astype(np.int64) for i in index]
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    if packed:
        ids = torch.from_numpy(np.concatenate(parts))[None]
        pos = torch.cat([torch.arange(len(p)) for p in parts])[None]
        targets = torch.zeros_like(ids)
        offset = 0
        for i, p in zip(index, parts, strict=True):
            n_prompt, n_resp = len(seqs[i].prompt), len(seqs[i].response)
            targets[0, offset : offset + len(p) - 1] = torch.from_numpy(p[1:])
            # the logits at position (prompt + k - 1) predict response token k
            cols.append(torch.arange(offset + n_prompt - 1, offset + n_prompt - 1 + n_resp))
            rows.append(torch.zeros(n_resp, dtype=torch.long))
            offset += len(p)
        return MicroBatch(list(index), ids, pos, None, targets, rows, cols)
    width = max(len(p) for p in parts)
    ids = torch.full((len(parts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(parts), width), dtype=torch.long)
    targets = torch.zeros_like(ids)
    for r, (i, p) in enumerate(zip(index, parts, strict=True)):
        ids[r, : len(p)] = torch.from_numpy(p)
        mask[r, : len(p)] = 1
        targets[r, : len(p) - 1] = torch.from_numpy(p[1:])
        n_prompt, n_resp = len(seqs[i].prompt), len(seqs[i].response)
        cols.append(torch.arange(n_prompt - 1, n_prompt - 1 + n_resp))
        rows.append(torch.full((n_resp,), r, dtype=torch.long))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return MicroBatch(list(index), ids, pos, mask, targets, rows, cols)


def to_rows(values_bL: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position values of a micro-batch -> [sequences, response tokens] plus its mask."""
    width = max((len(c) for c in mb.gather_cols), default=0)
    out = values_bL.new_zeros((len(mb.gather_cols), width))
    mask = torch.zeros((len(mb.gather_cols), width), dtype=torch.float32)
    for k, (r, c) in enumerate(zip(mb.gather_rows, mb.gather_cols, strict=True)):
        out[k, : len(c)] = values_bL[r, c]
        mask[k, : len(c)] = 1.0
    return out, mask


def pad_rows(arrays: list[np.ndarray], width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    width = max((len(a) for a in arrays), default=0) if width is None else width
    out = torch.zeros((len(arrays), width), dtype=dtype)
    for k, a in enumerate(arrays):
        out[k, : len(a)] = torch.tensor(np.asarray(a), dtype=dtype)  # a copy: hub arrays are read-only views
    return out


def token_logprobs(logits_bLV: torch.Tensor, targets_bL: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) at every position, under logits / temperature (the sampled distribution)."""
    logits = logits_bLV.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets_bL[..., None])[..., 0]


def entropy_at(logits_bLV: torch.Tensor, mb: MicroBatch, grad: bool, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution under logits / temperature (the sampled one, as
    ``token_logprobs``) at the response positions only (zeros elsewhere): computing it over the
    whole vocabulary at every position would cost a logits-sized buffer."""
    rows = torch.cat(mb.gather_rows).to(logits_bLV.device) if mb.gather_rows else torch.zeros(0, dtype=torch.long)
    cols = torch.cat(mb.gather_cols).to(logits_bLV.device) if mb.gather_cols else torch.zeros(0, dtype=torch.long)
    with torch.enable_grad() if grad else torch.no_grad():
        logits = logits_bLV[rows, cols].float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, -1)
        ent = -(logp.exp() * logp).sum(-1)
        out = torch.zeros(logits_bLV.shape[:2], dtype=ent.dtype, device=logits_bLV.device)
        out = out.index_put((rows, cols), ent)
    return out


@dataclass
class StagedMicroBatch:
    """A micro-batch's tensors on the training device, moved once at the start of a step (from
    pinned memory, without blocking) so the micro-batch loop issues no host-to-device copy, each
    of which would otherwise wait for the GPU to drain."""

    input_ids: torch.Tensor  # [b, L]
    position_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor | None  # [b, L] when padded
    targets: torch.Tensor  # [b, L] next token at each position
    rows_N: torch.Tensor  # input-layout (row, column) of every response token's prediction,
    cols_N: torch.Tensor  # sequence after sequence (N = response tokens of the micro-batch)
    targets_N: torch.Tensor  # the response tokens
    seq_N: torch.Tensor  # their place in the [sequences, width] layout: sequence, position
    pos_N: torch.Tensor
    mask: torch.Tensor  # [sequences, width] 1 on real tokens (on the device)
    mask_cpu: torch.Tensor  # the same on the host: sums and shapes without a device sync
    # packed rows: cumulative sequence lengths (int32, [sequences + 1]) and the longest, what
    # variable-length attention kernels take (transformers' cu_seq_lens_q / max_length_q)
    cu_seqlens: torch.Tensor | None
    max_seqlen: int

    @property
    def width(self) -> int:
        return int(self.mask_cpu.shape[1])


def stage(mb: MicroBatch, device: torch.device, trained: torch.Tensor | None = None) -> StagedMicroBatch:
    """``trained`` ([sequences, at least the micro-batch's width]): 1 on the response tokens that
    train, 0 on those that get no gradient; the mask is every response token without it."""
    lens = [len(c) for c in mb.gather_cols]
    width = max(lens, default=0)
    rows = torch.cat(mb.gather_rows) if lens else torch.zeros(0, dtype=torch.long)
    cols = torch.cat(mb.gather_cols) if lens else torch.zeros(0, dtype=torch.long)
    seq = torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(lens)]) if lens else rows
    pos = torch.cat([torch.arange(n) for n in lens]) if lens else rows
    mask = torch.zeros((len(lens), width), dtype=torch.float32)
    mask[seq, pos] = 1.0
    if trained is not None:
        mask *= trained[:, :width]
    packed = packed_lengths(mb)

    def dev(t: torch.Tensor) -> torch.Tensor:
        if device.type != "cuda":
            return t
        return t.pin_memory().to(device, non_blocking=True)

    return StagedMicroBatch(
        input_ids=dev(mb.input_ids),
        position_ids=dev(mb.position_ids),
        attention_mask=None if mb.attention_mask is None else dev(mb.attention_mask),
        targets=dev(mb.targets),
        rows_N=dev(rows),
        cols_N=dev(cols),
        targets_N=dev(mb.targets[rows, cols]),
        seq_N=dev(seq),
        pos_N=dev(pos),
        mask=dev(mask),
        mask_cpu=mask,
        cu_seqlens=None if packed is None else dev(packed[0]),
        max_seqlen=0 if packed is None else packed[1],
    )


def packed_lengths(mb: MicroBatch) -> tuple[torch.Tensor, int] | None:
    """A packed micro-batch's cumulative sequence lengths (int32) and longest sequence, from the
    restarts of its position ids (host tensors: no device sync); None when padded."""
    if mb.attention_mask is not None or mb.position_ids.shape[0] != 1:
        return None
    pos = mb.position_ids[0]
    starts = torch.nonzero(pos == 0).flatten()
    cu = torch.cat([starts, torch.tensor([len(pos)])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max()) if len(starts) else 0


def scatter_rows(values_N: torch.Tensor, smb: StagedMicroBatch) -> torch.Tensor:
    """Flat per-response-token values -> [sequences, width] (zeros past each sequence's end);
    differentiable, one kernel (``to_rows`` loops over the sequences)."""
    out = values_N.new_zeros(smb.mask.shape)
    return out.index_put((smb.seq_N, smb.pos_N), values_N)
