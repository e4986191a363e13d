"""Batched next-token sampling on the logits' device.

Pipeline per step (`Sampler.sample`):
  1. `apply_penalties`: repetition (HF, prompt + output), then frequency / presence (OpenAI,
     output only), then logit_bias (OpenAI: added per token id), then min_new_tokens bans
     (EOS + stop_token_ids -> -inf), then grammar masks on constrained rows (tokens the
     grammar forbids -> -inf; where a ban would leave a constrained row nothing, the grammar
     wins and the ban is dropped for that row).
  2. Greedy rows: argmax of the penalized logits.
  3. Sampled rows (`sample_filtered`): `filter_logits` (temperature, then top-k, top-p over the
     top-k renormalized distribution, min-p relative to the max probability; masked tokens
     become -inf), then inverse-CDF sampling: one uniform u per row, the first token whose
     cumulative weight exceeds u x the total (`pick_by_uniform`); on CPU both in radixrt's
     op `sample_rows` (`csrc/sample.cpp`). One random number a row instead of
     one per vocabulary entry: the exponential race this replaced (Gumbel-max, 49k draws a row)
     took ~1.1 ms a row on CPU, as long as a whole decode step's share of a row.

Invariants:
  * A token masked by top-k / top-p / min-p / min_new_tokens / a grammar is never emitted (its
    probability is 0, and a draw that rounding puts past the last token with mass takes that
    token).
  * A seeded row's uniform depends only on (seed, len(output_ids)), so "same seed, same
    tokens" holds regardless of which other requests share the batch. Unseeded rows draw from
    the sampler's own generator, one uniform each.
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
    if info.repetition is not None or info.output_penalty is not None:
        out = logits.clone(memory_format=torch.contiguous_format)
        flat = out.view(-1)
        if info.repetition is not None:  # distinct indices: a gather and a scatter
            idx, r = info.repetition
            v = flat.index_select(0, idx)
            r = r.to(v.dtype)
            flat.index_copy_(0, idx, torch.where(v > 0, v / r, v * r))
        if info.output_penalty is not None:
            idx, amount = info.output_penalty
            flat.index_add_(0, idx, -amount.to(flat.dtype))
    if info.logit_bias is not None:
        rows, ids, values = info.logit_bias
        out = out.index_put((rows, ids), values.to(out.dtype), accumulate=True)
    unbanned = out
    if info.banned is not None:  # a few (row, id) pairs: no [B, V] mask
        out = out.index_put(info.banned, torch.tensor(float("-inf"), dtype=out.dtype,
                                                      device=out.device))
    if info.vocab_bitmask is not None:
        out = apply_vocab_mask(out, info.mask_rows, info.vocab_bitmask,
                               fallback=unbanned if info.banned is not None else None)
    return out


# top-k / top-p look at the TOP_WINDOW largest logits of a row first (torch.topk: ~0.1 ms a
# row of a 49k vocabulary, against ~1.8 ms for the full sort); a row whose top-p mass is not
# reached inside the window (a flat distribution) takes the full sort (that row alone).
TOP_WINDOW = 256


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
    all); min-p keeps tokens with prob >= min_p * max prob. None skips a filter. Ties at a
    cut are broken as torch's topk / sort order them.
    """
    x = logits / temperatures.view(-1, 1)
    if top_ks is not None or top_ps is not None:
        x = _top_k_top_p(x, top_ks, top_ps)
    if min_ps is not None:  # log(0) = -inf keeps everything
        threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_ps).view(-1, 1)
        x = x.masked_fill(x < threshold, float("-inf"))
    return x


def _top_k_top_p(x: Tensor, top_ks: Tensor | None, top_ps: Tensor | None) -> Tensor:
    """`filter_logits`' top-k and top-p over the rows' `TOP_WINDOW` largest logits (or their
    top_k, if larger), the full sort where a row's top-p reaches past them."""
    rows, vocab = x.shape
    ks = top_ks if top_ks is not None else torch.full((rows,), vocab, device=x.device)
    ps = top_ps if top_ps is not None else torch.ones(rows, device=x.device)
    has_k = ks < vocab
    has_p = ps < 1.0
    if not bool((has_k | has_p).any()):
        return x
    window = min(vocab, max(TOP_WINDOW, int(ks[has_k].max()) if bool(has_k.any()) else 0))
    vals, idx = x.topk(window, dim=-1)
    kept = torch.arange(window, device=x.device).view(1, -1) < ks.view(-1, 1)
    # The distribution top-p cuts: renormalized over the top-k (inside the window), or the
    # whole row without top-k.
    lse = torch.where(has_k.view(-1, 1),
                      torch.logsumexp(vals.masked_fill(~kept, float("-inf")), -1, keepdim=True),
                      torch.logsumexp(x, -1, keepdim=True))
    probs = (vals - lse).exp().masked_fill(~kept, 0.0)
    mass = probs.cumsum(dim=-1)
    # A row without top-k whose window holds no more than its top_p of the mass would keep
    # tokens beyond the window: the full sort decides those rows.
    short = has_p & ~has_k & (mass[:, -1] <= ps) & (window < vocab)
    kept &= ~(((mass - probs) > ps.view(-1, 1)) & has_p.view(-1, 1))
    out = torch.full_like(x, float("-inf")).scatter_(
        -1, idx, vals.masked_fill(~kept, float("-inf")))
    out = torch.where((has_k | has_p).view(-1, 1), out, x)
    if bool(short.any()):
        rows_short = torch.nonzero(short).view(-1)
        out[rows_short] = _top_k_top_p_sorted(x[rows_short], ks[rows_short], ps[rows_short])
    return out


def _top_k_top_p_sorted(x: Tensor, ks: Tensor, ps: Tensor) -> Tensor:
    """`_top_k_top_p` by a full sort of every row."""
    vocab = x.shape[-1]
    xs, idx = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device).view(1, -1)
    xs = xs.masked_fill(ranks >= ks.view(-1, 1), float("-inf"))
    probs = xs.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before > ps.view(-1, 1)) & (ps < 1.0).view(-1, 1)
    xs = xs.masked_fill(drop, float("-inf"))
    return torch.empty_like(xs).scatter_(-1, idx, xs)


def pick_by_uniform(scores: Tensor, u: Tensor) -> Tensor:
    """One token per row of `scores` [N, V] (logits, -inf for masked tokens; each row has a
    finite one), drawn with probability softmax(scores) by inverse CDF: the first token whose
    cumulative weight exp(score - max) exceeds `u` [N] (in [0, 1)) x the row's total. The
    weights are summed in place in float32 (non-decreasing, so searchable; each token's share
    is off by about one rounding of the running sum, ~1e-7): float64 and a normalized softmax
    first took 9 ms for 64 rows of a 49k vocabulary, this 2-3 ms."""
    w = scores.float() - scores.float().amax(dim=-1, keepdim=True)
    cdf = w.exp_().cumsum_(dim=-1)
    vocab = cdf.shape[-1]
    target = (u.to(cdf.dtype).view(-1) * cdf[:, -1]).view(-1, 1)
    chosen = torch.searchsorted(cdf, target, right=True).view(-1).clamp_(max=vocab - 1)
    # A target that rounding put at or past the total lands beyond the last token with mass:
    # take that token instead.
    at = cdf.gather(1, chosen.view(-1, 1)).view(-1)
    prev = torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp(min=0).view(-1, 1)).view(-1),
                       torch.zeros_like(at))
    empty = at <= prev
    if bool(empty.any()):
        rows = torch.nonzero(empty).view(-1)
        grew = cdf[rows, 1:] > cdf[rows, :-1]  # token j + 1 has weight
        last = vocab - 1 - grew.flip(-1).int().argmax(dim=-1)
        # no later token has weight: only the first one does (every row has one)
        chosen[rows] = torch.where(grew.any(dim=-1), last, torch.zeros_like(last))
    return chosen


def sample_filtered(
    scores: Tensor,
    temperatures: Tensor,
    top_ks: Tensor | None,
    top_ps: Tensor | None,
    min_ps: Tensor | None,
    u: Tensor,
) -> Tensor:
    """One token per row of `scores` [N, V]: `filter_logits` then `pick_by_uniform` with the
    uniforms `u` [N]. On CPU with radixrt's kernel library loaded, its op `sample_rows` does
    both in one pass over each row (the same cut and draw up to float rounding at a boundary,
    ~10x faster with top-k / top-p); elsewhere the torch path."""
    if (scores.device.type == "cpu" and scores.dim() == 2 and scores.dtype == torch.float32
            and scores.shape[1] > 0 and hasattr(torch.ops.radixrt, "sample_rows")):
        rows, vocab = scores.shape
        return torch.ops.radixrt.sample_rows(
            scores,
            temperatures.to(torch.float32),
            top_ks.to(torch.int64) if top_ks is not None
            else torch.full((rows,), vocab, dtype=torch.int64),
            top_ps.to(torch.float32) if top_ps is not None else torch.ones(rows),
            min_ps.to(torch.float32) if min_ps is not None else torch.zeros(rows),
            u.to(torch.float64),
        )
    return pick_by_uniform(filter_logits(scores, temperatures, top_ks, top_ps, min_ps), u)


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

    def _uniforms(self, info: SamplingBatchInfo, device: torch.device) -> Tensor:
        """U[0, 1) [Ns] for the sampled rows (float64); seeded rows from their own (seed, step)."""
        rows = info.sampled_rows
        u = torch.empty(len(rows), dtype=torch.float64)  # float64 draws, cast where used
        seeded = [j for j, r in enumerate(rows) if info.row_seeds[r] is not None]
        if len(seeded) < len(rows):
            draw = torch.rand(len(rows) - len(seeded), dtype=torch.float64,
                              generator=self._generator(self._shared, torch.device("cpu")))
            seeded_set = set(seeded)
            u[[j for j in range(len(rows)) if j not in seeded_set]] = draw
        if seeded:
            gen = self._generator(self._per_row, torch.device("cpu"))
            for j in seeded:
                seed = info.row_seeds[rows[j]]
                assert seed is not None
                gen.manual_seed(seed)
                u[j] = torch.rand((), dtype=torch.float64, generator=gen)
        return u.to(device)

    def sample(self, logits: Tensor | None, info: SamplingBatchInfo,
               greedy_ids: Tensor | None = None) -> SampleOutput:
        """Pick one token per row of `logits` [B, V] (float32; other dtypes are upcast).
        `greedy_ids`: `row_argmax(logits)` already picked (`ModelRunner.forward_greedy`), the
        sample when every row is greedy (`info.is_fast_path`); ignored otherwise. `logits` may
        be None only with such a step's `greedy_ids` (a head that picked them without writing
        the logits)."""
        batch = info.batch_size
        if logits is not None and (logits.dim() != 2
                                   or logits.shape != (batch, info.vocab_size)):
            raise ValueError(
                f"logits must be [{batch}, {info.vocab_size}], got {tuple(logits.shape)}"
            )
        if info.is_fast_path and greedy_ids is not None:
            if greedy_ids.shape != (batch,):
                raise ValueError(f"greedy_ids must be [{batch}], got {tuple(greedy_ids.shape)}")
            return SampleOutput(greedy_ids.tolist(), [None] * batch)
        if logits is None:
            raise ValueError("logits are required unless every row is greedy and greedy_ids "
                             "are given")
        if info.is_fast_path:
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

            chosen = sample_filtered(
                sub,
                pick(info.temperatures),  # type: ignore[arg-type]
                pick(info.top_ks) if info.need_top_k else None,
                pick(info.top_ps) if info.need_top_p else None,
                pick(info.min_ps) if info.need_min_p else None,
                self._uniforms(info, sub.device),
            )
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
