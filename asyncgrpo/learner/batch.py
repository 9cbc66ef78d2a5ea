"""Turn scored groups into padded training tensors (pure; no model, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo.wire import ScoredGroup


@dataclass
class Batch:
    """B = total samples, L = longest prompt+completion, T = longest completion.

    input_ids [B, L] right-padded prompt+completion; attention_mask [B, L];
    logit_index [B, T]: position of the logits that predict completion token t (prompt_len + t - 1);
    targets [B, T] completion tokens; mask [B, T] the policy mask: 1 on the completion tokens the
    policy sampled, 0 on an environment's (observations: context, never trained) and on padding,
    so a row's mask may have holes; completion_lengths [B] every completion token, the policy's and
    the environment's (a row's real columns are [0, completion_lengths)); rollout_logp [B, T]
    generator log-probs (0 off the mask); token_versions [B, T]; rewards [B]; group_index [B];
    group_version_min [G] (oldest policy token); truncated [B] 1.0 where the completion hit
    rollout.max_new_tokens without stopping (algo.overlong).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logit_index: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    completion_lengths: torch.Tensor
    rollout_logp: torch.Tensor
    token_versions: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    group_version_min: torch.Tensor
    truncated: torch.Tensor

    def to(self, device: torch.device) -> "Batch":
        if device.type == "cpu":
            return self
        return Batch(**{name: value.to(device, non_blocking=True) for name, value in vars(self).items()})

    def select(self, index: torch.Tensor) -> "Batch":
        """Rows `index` (any order), with padding trimmed to what those rows need."""
        attention_mask = self.attention_mask.index_select(0, index)
        completion_lengths = self.completion_lengths.index_select(0, index)
        length = max(1, int(attention_mask.sum(1).max()))
        # Not the mask's row sums: an environment's tokens are holes in it, and policy tokens lie after them.
        width = max(1, int(completion_lengths.max()))
        return Batch(
            input_ids=self.input_ids.index_select(0, index)[:, :length],
            attention_mask=attention_mask[:, :length],
            logit_index=self.logit_index.index_select(0, index)[:, :width],
            targets=self.targets.index_select(0, index)[:, :width],
            mask=self.mask.index_select(0, index)[:, :width],
            completion_lengths=completion_lengths,
            rollout_logp=self.rollout_logp.index_select(0, index)[:, :width],
            token_versions=self.token_versions.index_select(0, index)[:, :width],
            rewards=self.rewards.index_select(0, index),
            group_index=self.group_index.index_select(0, index),
            group_version_min=self.group_version_min,
            truncated=self.truncated.index_select(0, index),
        )

    @property
    def num_samples(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_tokens(self) -> int:
        """The tokens trained: the policy's."""
        return int(self.mask.sum().item())


def collate(groups: Sequence[ScoredGroup], pad_id: int) -> Batch:
    """Pad `groups`' completions into a `Batch`; `mask` is each completion's policy mask."""
    samples = []  # (prompt, completion tokens, logprobs, versions, reward, group index, truncated, policy mask)
    for index, group in enumerate(groups):
        for i in range(group.num_samples):
            tokens, logprobs, versions = group.completion(i)
            samples.append((group.prompt_tokens, tokens, logprobs, versions, float(group.rewards[i]), index,
                            float(group.truncated[i]), group.completion_mask(i)))
    batch_size = len(samples)
    max_len = max(len(p) + len(c) for p, c, *_ in samples)
    max_completion = max(1, max(len(c) for _, c, *_ in samples))

    input_ids = np.full((batch_size, max_len), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch_size, max_len), dtype=np.int64)
    logit_index = np.zeros((batch_size, max_completion), dtype=np.int64)
    targets = np.zeros((batch_size, max_completion), dtype=np.int64)
    mask = np.zeros((batch_size, max_completion), dtype=np.float32)
    rollout_logp = np.zeros((batch_size, max_completion), dtype=np.float32)
    token_versions = np.zeros((batch_size, max_completion), dtype=np.int64)
    for row, (prompt, completion, logprobs, versions, *_, policy) in enumerate(samples):
        prompt_len, length = len(prompt), len(completion)
        input_ids[row, :prompt_len] = prompt
        input_ids[row, prompt_len:prompt_len + length] = completion
        attention_mask[row, :prompt_len + length] = 1
        logit_index[row, :length] = np.arange(prompt_len - 1, prompt_len + length - 1)
        targets[row, :length] = completion
        mask[row, :length] = policy
        # An environment token's log-prob field is ignored: whatever a sender put there, the loss's
        # ratios see 0, as on padding.
        rollout_logp[row, :length] = np.where(policy == 1, logprobs, 0.0)
        token_versions[row, :length] = versions
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        logit_index=torch.from_numpy(logit_index),
        targets=torch.from_numpy(targets),
        mask=torch.from_numpy(mask),
        completion_lengths=torch.tensor([len(s[1]) for s in samples], dtype=torch.int64),
        rollout_logp=torch.from_numpy(rollout_logp),
        token_versions=torch.from_numpy(token_versions),
        rewards=torch.tensor([s[4] for s in samples], dtype=torch.float32),
        group_index=torch.tensor([s[5] for s in samples], dtype=torch.int64),
        group_version_min=torch.tensor([g.version_min for g in groups], dtype=torch.int64),
        truncated=torch.tensor([s[6] for s in samples], dtype=torch.float32),
    )


def completion_rows(logits: torch.Tensor, logit_index: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits that predict each completion token, over the temperature: logits [B, L, V],
    logit_index [B, T] -> [B, T, V] (float32).

    Selects the T needed rows before any softmax, so memory is O(B*T*V), not O(B*L*V).
    """
    vocab = logits.shape[-1]
    return logits.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, vocab)).float() / temperature


def target_logprobs(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-prob of each target token: rows [B, T, V] (from `completion_rows`), targets [B, T] -> [B, T]."""
    return rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - rows.logsumexp(-1)


def completion_logprobs(logits: torch.Tensor, logit_index: torch.Tensor, targets: torch.Tensor,
                        temperature: float) -> torch.Tensor:
    """Log-prob of each target token: logits [B, L, V], logit_index/targets [B, T] -> [B, T]."""
    return target_logprobs(completion_rows(logits, logit_index, temperature), targets)


# ------------------------------------------------------------------------------ multi-rank split

_INT_FIELDS = ("input_ids", "attention_mask", "logit_index", "targets", "token_versions", "group_index",
               "group_version_min", "completion_lengths")
_FLOAT_FIELDS = ("mask", "rollout_logp", "rewards", "truncated")


def mini_batch_rows(group_index: Sequence[int], count: int) -> list[list[int]]:
    """The rows of each of `count` mini-batches (learner.mini_batches): whole groups, dealt in turn
    in order of first appearance (group j to mini-batch j mod count), so each mini-batch mixes the
    batch's order (arrival, staleness) alike. Empty mini-batches (fewer groups than `count`) are left out.
    """
    slot: dict[int, int] = {}
    rows: list[list[int]] = [[] for _ in range(max(1, count))]
    for row, group in enumerate(group_index):
        rows[slot.setdefault(int(group), len(slot) % len(rows))].append(row)
    return [share for share in rows if share]


def rank_shares(batch: Batch, world_size: int) -> list[list[int]]:
    """Whole groups, contiguous, to each rank, balanced by (unpadded) tokens.

    A group goes to the rank whose share of the cumulative token count holds the group's middle,
    so shares differ by at most about one group. With fewer groups than ranks some shares are empty.
    """
    if world_size == 1:
        return [list(range(batch.num_samples))]
    lengths = batch.attention_mask.sum(1).tolist()
    group_of = batch.group_index.tolist()
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_of):
        groups.setdefault(group, []).append(row)
    total = float(sum(lengths)) or 1.0
    shares: list[list[int]] = [[] for _ in range(world_size)]
    before = 0.0
    for rows in groups.values():
        size = float(sum(lengths[r] for r in rows))
        rank = min(world_size - 1, int((before + size / 2) * world_size / total))
        shares[rank].extend(rows)
        before += size
    return shares


def micro_batch_plan(lengths: Sequence[int], rows: Sequence[int], max_tokens: int,
                     bucket_by_length: bool) -> list[list[int]]:
    """Split `rows` into micro-batches whose padded size (rows x longest row) stays within `max_tokens`
    (learner.micro_batch_tokens).

    With `bucket_by_length` (learner.bucket_by_length; no default here: config's is the only one)
    rows are taken longest first, so each micro-batch holds rows of
    similar length and little padding; otherwise in the given order. A row longer than the budget
    gets a micro-batch of its own; 0 means one micro-batch (empty `rows` -> no micro-batch).
    """
    rows = list(rows)
    if not rows:
        return []
    if max_tokens <= 0:
        return [rows]
    if bucket_by_length:
        rows.sort(key=lambda r: -lengths[r])  # stable: ties keep their order
    plan: list[list[int]] = [[]]
    longest = 0
    for row in rows:
        longest_with_row = max(longest, lengths[row])
        if plan[-1] and longest_with_row * (len(plan[-1]) + 1) > max_tokens:
            plan.append([])
            longest_with_row = lengths[row]
        plan[-1].append(row)
        longest = longest_with_row
    return plan


def broadcast_batch(batch: Batch | None, device: torch.device, src: int = 0) -> Batch:
    """Rank `src` sends its batch to every rank of the default group as three tensor broadcasts.

    Raw tensors only (no pickling): a shape header, then every integer field in one int64 buffer
    and every float field in one float32 buffer.
    """
    import torch.distributed as dist

    if dist.get_rank() == src:
        assert batch is not None
        batch_size, length = batch.input_ids.shape
        width = batch.mask.shape[1]
        header = torch.tensor([batch_size, length, width, batch.group_version_min.numel()], dtype=torch.int64,
                              device=device)
        dist.broadcast(header, src)
        ints = torch.cat([getattr(batch, name).to(device, torch.int64).reshape(-1) for name in _INT_FIELDS])
        floats = torch.cat([getattr(batch, name).to(device, torch.float32).reshape(-1) for name in _FLOAT_FIELDS])
        dist.broadcast(ints, src)
        dist.broadcast(floats, src)
        return batch.to(device)
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.broadcast(header, src)
    batch_size, length, width, num_groups = header.tolist()
    size = {"input_ids": (batch_size, length), "attention_mask": (batch_size, length),
            "logit_index": (batch_size, width), "targets": (batch_size, width), "token_versions": (batch_size, width),
            "group_index": (batch_size,), "group_version_min": (num_groups,), "mask": (batch_size, width),
            "completion_lengths": (batch_size,),
            "rollout_logp": (batch_size, width), "rewards": (batch_size,), "truncated": (batch_size,)}
    ints = torch.empty(sum(int(np.prod(size[n])) for n in _INT_FIELDS), dtype=torch.int64, device=device)
    floats = torch.empty(sum(int(np.prod(size[n])) for n in _FLOAT_FIELDS), dtype=torch.float32, device=device)
    dist.broadcast(ints, src)
    dist.broadcast(floats, src)
    fields: dict[str, torch.Tensor] = {}
    for names, buffer in ((_INT_FIELDS, ints), (_FLOAT_FIELDS, floats)):
        offset = 0
        for name in names:
            count = int(np.prod(size[name]))
            fields[name] = buffer[offset:offset + count].reshape(size[name])
            offset += count
    return Batch(**fields)
