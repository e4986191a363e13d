"""Batched next-token sampling on the logits' device.

Pipeline per step (`Sampler.sample`):
  1. `apply_penalties`: repetition (HF, prompt + output), then frequency / presence (OpenAI,
     output only), then logit_bias (OpenAI: added per token id), then min_new_tokens bans
     (EOS + stop_token_ids -> -inf), then grammar masks on constrained rows (tokens the
     grammar forbids -> -inf; where a ban would leave a constrained row nothing, the grammar
     wins and the ban is dropped for that row).
  2. Greedy rows: argmax of the penalized logits.
  3. Sampled rows: `filter_logits` (temperature, then top-k, top-p over the top-k renormalized
     distribution, min-p relative to the max probability; masked tokens become -inf), then the
     exponential race argmax(logits - log(E)), E ~ Exp(1) i.i.d. per token (= Gumbel-max).

Invariants:
  * A token masked by top-k / top-p / min-p / min_new_tokens / a grammar is never emitted (its
    score is -inf and the noise is clamped to stay finite).
  * A seeded row's noise depends only on (seed, len(output_ids)), so "same seed, same tokens"
    holds regardless of which other requests share the batch. Unseeded rows share one draw
    from the sampler's own generator.
  * Logprobs are computed from log_softmax of the RAW logits (before penalties / temperature).
  * A batch that is all greedy, without penalties, biases, bans or logprobs, is a bare argmax.
  * Every argmax is `row_argmax`: torch's indices (first maximum; a NaN row gives its first NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from radixrt.core.logprobs import TokenLogprobs
from radixrt.sampling.batch_info import MASK64, SamplingBatchInfo
from radixrt.sampling.flashinfer_sampler import flashinfer_sample
from radixrt.sampling.vocab_mask import apply_vocab_mask


def row_argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)` of `[B, V]` logits: radixrt's CPU op `argmax_rows` when its kernel library
    is loaded (the same indices, read at memory speed: ~10x torch's CPU argmax on a 64-row
    batch of a 49k vocabulary), else torch's."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0
            and x.dtype in (torch.float32, torch.bfloat16)
            and hasattr(torch.ops.radixrt, "argmax_rows")):
        return torch.ops.radixrt.argmax_rows(x)
    return x.argmax(dim=-1)


def apply_penalties(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Penalized logits [B, V]; never mutates `logits` (returns it unchanged if nothing applies).

    Repetition (tokens in prompt or output): x > 0 -> x / r, else x * r. Then
    x -= frequency * count + presence * (count > 0) over output tokens. Then each row's
    logit_bias values are added to their tokens. Then min_new_tokens bans set EOS /
    stop_token_ids to -inf. Then grammar masks (see the module docstring).
    """
    out = logits
    if info.repetition_mask is not None:
        assert info.repetition_penalties is not None
        r = info.repetition_penalties
        out = torch.where(info.repetition_mask, torch.where(out > 0, out / r, out * r), out)
    if info.output_counts is not None:
        assert info.frequency_penalties is not None and info.presence_penalties is not None
        c = info.output_counts
        out = out - info.frequency_penalties * c - info.presence_penalties * (c > 0).float()
    if info.logit_bias is not None:
        rows, ids, values = info.logit_bias
        out = out.index_put((rows, ids), values.to(out.dtype), accumulate=True)
    unbanned = out
    if info.banned_mask is not None:
        out = out.masked_fill(info.banned_mask, float("-inf"))
    if info.vocab_bitmask is not None:
        out = apply_vocab_mask(out, info.mask_rows, info.vocab_bitmask,
                               fallback=unbanned if info.banned_mask is not None else None)
    return out


def filter_logits(
    logits: Tensor,
    temperatures: Tensor,
    top_ks: Tensor | None = None,
    top_ps: Tensor | None = None,
    min_ps: Tensor | None = None,
) -> Tensor:
    """Temperature-scaled logits [N, V] with tokens outside top-k / top-p / min-p set to -inf.

    temperatures must be > 0. top-k keeps the k largest; top-p then keeps the smallest prefix of
    the top-k-renormalized distribution whose mass reaches p (always >= 1 token; p >= 1 keeps
    all); min-p keeps tokens with prob >= min_p * max prob. None skips a filter.
    """
    x = logits / temperatures.view(-1, 1)
    if top_ks is None and top_ps is None and min_ps is None:
        return x
    vocab = x.shape[-1]
    xs, idx = x.sort(dim=-1, descending=True)
    if top_ks is not None:
        ranks = torch.arange(vocab, device=x.device).view(1, -1)
        xs = xs.masked_fill(ranks >= top_ks.view(-1, 1), float("-inf"))
    if top_ps is not None:
        probs = xs.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before > top_ps.view(-1, 1)) & (top_ps < 1.0).view(-1, 1)
        xs = xs.masked_fill(drop, float("-inf"))
    if min_ps is not None:
        threshold = xs[:, :1] + torch.log(min_ps).view(-1, 1)  # log(0) = -inf keeps everything
        xs = xs.masked_fill(xs < threshold, float("-inf"))
    return torch.empty_like(xs).scatter_(-1, idx, xs)


@dataclass
class SampleOutput:
    """One token per row; logprobs[i] is set only for rows whose params asked for it."""

    next_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Owns the generator of unseeded rows (seeded from `seed`); stateless otherwise.

    `seed` only reaches the torch path. A CUDA batch that `flashinfer_sample` covers (no
    seeded row, penalties, bans or logprobs) is sampled with torch's default CUDA generator,
    so `ServerArgs.random_seed` does not make such batches reproducible.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared: dict[str, torch.Generator] = {}  # per device: unseeded rows' stream
        self._per_row: dict[str, torch.Generator] = {}  # per device: re-seeded for each row

    def _generator(self, pool: dict[str, torch.Generator], device: torch.device) -> torch.Generator:
        key = str(device)
        gen = pool.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed & MASK64)
            pool[key] = gen
        return gen

    def _noise(self, info: SamplingBatchInfo, device: torch.device) -> Tensor:
        """Exp(1) noise [Ns, V] for the sampled rows; seeded rows from their own (seed, step)."""
        rows = info.sampled_rows
        vocab = info.vocab_size
        seeded = [j for j, r in enumerate(rows) if info.row_seeds[r] is not None]
        noise = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)
        if len(seeded) < len(rows):
            shared = self._generator(self._shared, device)
            if not seeded:
                noise.exponential_(generator=shared)
            else:
                seeded_set = set(seeded)
                unseeded = [j for j in range(len(rows)) if j not in seeded_set]
                draw = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=device)
                draw.exponential_(generator=shared)
                noise.index_copy_(0, torch.tensor(unseeded, device=device), draw)
        if seeded:
            gen = self._generator(self._per_row, device)
            for j in seeded:
                seed = info.row_seeds[rows[j]]
                assert seed is not None
                gen.manual_seed(seed)
                noise[j].exponential_(generator=gen)
        # Keep log(E) finite so a -inf (masked) score can never become NaN or win.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def sample(self, logits: Tensor, info: SamplingBatchInfo,
               greedy_ids: Tensor | None = None) -> SampleOutput:
        """Pick one token per row of `logits` [B, V] (float32; other dtypes are upcast).
        `greedy_ids`: `row_argmax(logits)` already picked (`ModelRunner.forward_greedy`), the
        sample when every row is greedy (`info.is_fast_path`); ignored otherwise."""
        if logits.dim() != 2 or logits.shape != (info.batch_size, info.vocab_size):
            raise ValueError(
                f"logits must be [{info.batch_size}, {info.vocab_size}], got {tuple(logits.shape)}"
            )
        batch = info.batch_size
        if info.is_fast_path:
            if greedy_ids is not None:
                if greedy_ids.shape != (batch,):
                    raise ValueError(f"greedy_ids must be [{batch}], got {tuple(greedy_ids.shape)}")
                return SampleOutput(greedy_ids.tolist(), [None] * batch)
            return SampleOutput(row_argmax(logits).tolist(), [None] * batch)
        if logits.is_cuda:  # FlashInfer's fused kernels where they cover the rows' settings
            ids = flashinfer_sample(logits, info)
            if ids is not None:
                return SampleOutput(ids.tolist(), [None] * batch)

        raw = logits.float()
        x = apply_penalties(raw, info)
        rows = info.sampled_rows
        if rows:
            sub = x if info.sampled_idx is None else x.index_select(0, info.sampled_idx)

            def pick(t: Tensor | None) -> Tensor | None:
                if t is None or info.sampled_idx is None:
                    return t
                return t.index_select(0, info.sampled_idx)

            filtered = filter_logits(
                sub,
                pick(info.temperatures),  # type: ignore[arg-type]
                pick(info.top_ks) if info.need_top_k else None,
                pick(info.top_ps) if info.need_top_p else None,
                pick(info.min_ps) if info.need_min_p else None,
            )
            noise = self._noise(info, filtered.device)
            chosen = row_argmax(filtered - noise.log_())
            if info.sampled_idx is None:
                next_ids = chosen
            else:
                next_ids = row_argmax(x)
                next_ids.index_copy_(0, info.sampled_idx, chosen)
        else:
            next_ids = row_argmax(x)

        logprobs: list[TokenLogprobs | None] = [None] * batch
        if info.logprob_rows:
            self._fill_logprobs(raw, next_ids, info, logprobs)
        return SampleOutput(next_ids.tolist(), logprobs)

    @staticmethod
    def _fill_logprobs(
        raw: Tensor, next_ids: Tensor, info: SamplingBatchInfo, out: list[TokenLogprobs | None]
    ) -> None:
        rows = info.logprob_rows
        idx = torch.tensor(rows, dtype=torch.long, device=raw.device)
        lp = raw.index_select(0, idx).log_softmax(dim=-1)
        chosen = lp.gather(1, next_ids.index_select(0, idx).view(-1, 1)).view(-1).tolist()
        k_max = max(info.top_logprobs[r] for r in rows)
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if k_max > 0:
            vals, ids = lp.topk(min(k_max, lp.shape[-1]), dim=-1, sorted=True)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, r in enumerate(rows):
            k = info.top_logprobs[r]
            out[r] = TokenLogprobs(
                token_logprobs=[chosen[j]],
                top_ids=[top_ids[j][:k]],
                top_logprobs=[top_vals[j][:k]],
            )
