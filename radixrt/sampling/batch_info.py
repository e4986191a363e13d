"""`SamplingBatchInfo`: one step's per-row sampling state, built once and read by both the torch
sampler and the FlashInfer sampler (so neither imports the other's internals)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor

from radixrt.core.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a bijective 64-bit hash."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request at decoding step `step` (tokens generated so far)."""
    return _mix64(_mix64(seed + 0x9E3779B97F4A7C15) ^ (step & MASK64))


def _distinct_pairs(
    rows: Sequence[int], chunks: Sequence[Sequence[int]], vocab: int
) -> tuple[Tensor, Tensor]:
    """The distinct (row, id) pairs of the ids in `chunks[j]` on row `rows[j]`, as sorted flat
    indices row x vocab + id (int64, CPU) and how often each occurs. Ids outside [0, vocab)
    are ignored."""
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
    ids = torch.tensor(list(chain.from_iterable(chunks)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    keep = (ids >= 0) & (ids < vocab)
    return torch.unique((row_idx * vocab + ids)[keep], sorted=True, return_counts=True)


class SeenIds:
    """The distinct ids in [0, vocab) of one request's prompt and output so far, as an int64
    tensor kept across steps: a repetition-penalty row then costs its new tokens per step, not
    a conversion of its whole prompt and output (64 rows of 2000-token prompts: 33 ms a step on
    a 2-core Zen 1 before). Owned by one request; `ids` takes that request's output list, which
    only grows (a shorter one, or another prompt's request, would need a new object)."""

    def __init__(self, prompt: Sequence[int], vocab: int):
        self.vocab = vocab
        self._seen = {t for t in prompt if 0 <= t < vocab}
        self._ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        self._folded = 0  # output tokens already in `_seen`

    def _fresh(self, tokens: Sequence[int]) -> list[int]:
        new: list[int] = []
        for t in tokens:
            if 0 <= t < self.vocab and t not in self._seen:
                self._seen.add(t)
                new.append(t)
        return new

    def ids(self, output: Sequence[int], extra: Sequence[int] = ()) -> Tensor:
        """Distinct ids of the prompt, `output` and `extra` (tokens not kept: a draft row's
        drafts). `output` extends the list of the previous call."""
        if len(output) < self._folded:
            raise ValueError(f"output shrank from {self._folded} to {len(output)} tokens")
        new = self._fresh(output[self._folded:])
        self._folded = len(output)
        if new:
            self._ids = torch.cat([self._ids, torch.tensor(new, dtype=torch.long)])
        if not extra:
            return self._ids
        more = self._fresh(extra)
        self._seen.difference_update(more)  # drafts are not the request's tokens
        return torch.cat([self._ids, torch.tensor(more, dtype=torch.long)]) if more else self._ids


@dataclass
class SamplingBatchInfo:
    """Per-step, per-row sampling state for one batch, on the logits' device.

    Row i of every [B, ...] tensor belongs to params[i]. Optional tensors are None when no row
    needs them (then the matching step is skipped entirely).
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    # The sampled rows' settings, [B] each; None when no row is sampled (an all-greedy step
    # builds no tensor for them):
    temperatures: Tensor | None  # float32, as requested (greedy rows may hold 0)
    top_ps: Tensor | None  # float32
    top_ks: Tensor | None  # int64, disabled -> vocab_size; clamped to vocab_size
    min_ps: Tensor | None  # float32
    greedy_rows: list[int]
    sampled_rows: list[int]
    sampled_idx: Tensor | None  # [Ns] int64 on device; None when all rows (or none) are sampled
    need_top_k: bool  # some sampled row has 1 < top_k < vocab
    need_top_p: bool  # some sampled row has top_p < 1
    need_min_p: bool  # some sampled row has min_p > 0
    # Penalties, sparse: only the (row, token) pairs they touch, as flat indices into the
    # [B * V] logits (distinct, int64) and a value per index (float32), on device. Applying them
    # costs the prompts' and outputs' lengths, not B x V (dense [B, V] masks and counts took
    # 8-20 ms of a 64-row step's sampling with 1500-token prompts; now 3-5 ms).
    repetition: tuple[Tensor, Tensor] | None  # pairs in prompt or output; the row's penalty
    output_penalty: tuple[Tensor, Tensor] | None  # pairs in output; frequency x count + presence
    # (rows, token ids) [N] each, int64: rows short of min_new_tokens and their EOS / stop ids
    # (pairs may repeat); None when no row is.
    banned: tuple[Tensor, Tensor] | None
    # logit_bias of every row that has one, as (rows, token ids, values) [N] each (int64,
    # int64, float32 on device); None when no row has one.
    logit_bias: tuple[Tensor, Tensor, Tensor] | None
    row_seeds: list[int | None]  # per row: generator seed for this step, None when unseeded
    logprob_rows: list[int]  # rows that asked for logprobs
    top_logprobs: list[int]  # per row, number of alternatives (0 when logprobs is off)
    # Grammar-constrained rows and their token masks (`radixrt.sampling.vocab_mask` layout):
    # vocab_bitmask [Nc, W] int32 on CPU (None when no row is constrained); mask_rows [Nc]
    # int64 on device, None when every row is constrained (bitmask row i = batch row i).
    mask_rows: Tensor | None = None
    vocab_bitmask: Tensor | None = None

    @property
    def is_fast_path(self) -> bool:
        """All greedy, nothing to penalize, ban or report: a bare argmax suffices."""
        return (
            not self.sampled_rows
            and self.repetition is None
            and self.output_penalty is None
            and self.banned is None
            and self.logit_bias is None
            and not self.logprob_rows
            and self.vocab_bitmask is None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        vocab_mask: tuple[Sequence[int], Tensor] | None = None,
        seen_ids: Sequence[Tensor | None] | None = None,
    ) -> SamplingBatchInfo:
        """Gather the batch's settings. `output_ids[i]` is what request i generated so far (its
        length is the seed step and the min_new_tokens progress). Count tensors are only built
        when some row needs them. `vocab_mask`: (constrained rows, their int32 bitmask).
        `seen_ids[i]`, where given for a repetition-penalty row: the distinct ids of its prompt
        and output (`SeenIds.ids`), used instead of converting them."""
        batch = len(params)
        if len(prompt_ids) != batch or len(output_ids) != batch:
            raise ValueError(
                f"params, prompt_ids and output_ids must have equal lengths, got "
                f"{batch}, {len(prompt_ids)}, {len(output_ids)}"
            )
        dev = torch.device(device)
        vocab = vocab_size

        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        greedy_rows: list[int] = []
        sampled_rows: list[int] = []
        need_top_k = need_top_p = need_min_p = False
        for i, p in enumerate(params):
            k = vocab if p.top_k <= 0 else min(p.top_k, vocab)
            temps.append(float(p.temperature))
            top_ps.append(float(p.top_p))
            top_ks.append(k)
            min_ps.append(float(p.min_p))
            if p.is_greedy:
                greedy_rows.append(i)
            else:
                sampled_rows.append(i)
                need_top_k |= k < vocab
                need_top_p |= p.top_p < 1.0
                need_min_p |= p.min_p > 0.0

        sampled_idx = None
        if sampled_rows and greedy_rows:
            sampled_idx = torch.tensor(sampled_rows, dtype=torch.long, device=dev)

        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        repetition = None
        if rep_rows:
            kept = [] if seen_ids is None else [i for i in rep_rows if seen_ids[i] is not None]
            rest = [i for i in rep_rows if seen_ids is None or seen_ids[i] is None]
            parts = [seen_ids[i] + i * vocab for i in kept]  # type: ignore[index,operator]
            if rest:
                rows = [i for i in rest for _ in (0, 1)]
                chunks = [c for i in rest for c in (prompt_ids[i], output_ids[i])]
                parts.append(_distinct_pairs(rows, chunks, vocab)[0])
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            per_row = torch.tensor([float(p.repetition_penalty) for p in params])
            repetition = (flat.to(dev), per_row[flat // vocab].to(dev))

        fp_rows = [
            i
            for i, p in enumerate(params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        output_penalty = None
        if fp_rows:
            flat, counts = _distinct_pairs(fp_rows, [output_ids[i] for i in fp_rows], vocab)
            if flat.numel():
                freq = torch.tensor([float(p.frequency_penalty) for p in params])
                pres = torch.tensor([float(p.presence_penalty) for p in params])
                row = flat // vocab
                amount = freq[row] * counts.float() + pres[row]
                output_penalty = (flat.to(dev), amount.to(dev))

        eos = tuple(eos_token_ids)
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, p in enumerate(params):
            if len(output_ids[i]) < p.min_new_tokens:
                for t in (*eos, *p.stop_token_ids):
                    if 0 <= t < vocab:
                        ban_rows.append(i)
                        ban_ids.append(t)
        banned = None
        if ban_rows:
            banned = (torch.tensor(ban_rows, dtype=torch.long, device=dev),
                      torch.tensor(ban_ids, dtype=torch.long, device=dev))

        bias = None
        bias_items = [(i, t, v) for i, p in enumerate(params)
                      for t, v in (p.logit_bias or {}).items() if 0 <= t < vocab]
        if bias_items:
            rows_, ids_, vals_ = zip(*bias_items, strict=True)
            bias = (torch.tensor(rows_, dtype=torch.long, device=dev),
                    torch.tensor(ids_, dtype=torch.long, device=dev),
                    torch.tensor(vals_, dtype=torch.float32, device=dev))

        row_seeds = [
            None if p.seed is None or p.is_greedy else step_seed(p.seed, len(output_ids[i]))
            for i, p in enumerate(params)
        ]
        return cls(
            batch_size=batch,
            vocab_size=vocab,
            device=dev,
            temperatures=(torch.tensor(temps, dtype=torch.float32, device=dev)
                          if sampled_rows else None),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=dev) if sampled_rows else None,
            top_ks=torch.tensor(top_ks, dtype=torch.long, device=dev) if sampled_rows else None,
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=dev) if sampled_rows else None,
            greedy_rows=greedy_rows,
            sampled_rows=sampled_rows,
            sampled_idx=sampled_idx,
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            need_min_p=need_min_p,
            repetition=repetition,
            output_penalty=output_penalty,
            banned=banned,
            logit_bias=bias,
            row_seeds=row_seeds,
            logprob_rows=[i for i, p in enumerate(params) if p.logprobs],
            top_logprobs=[p.top_logprobs if p.logprobs else 0 for p in params],
            mask_rows=(torch.tensor(list(vocab_mask[0]), dtype=torch.long, device=dev)
                       if vocab_mask is not None and len(vocab_mask[0])
                       and list(vocab_mask[0]) != list(range(batch)) else None),
            vocab_bitmask=(vocab_mask[1] if vocab_mask is not None and len(vocab_mask[0])
                           else None),
        )
