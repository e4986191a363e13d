"""Batched next-token sampling on the logits' device.

Pipeline per step (`Sampler.sample`):
  1. `apply_penalties`: repetition (HF, prompt + output), then frequency / presence (OpenAI,
     output only), then min_new_tokens bans (EOS + stop_token_ids -> -inf).
  2. Greedy rows: argmax of the penalized logits.
  3. Sampled rows: `filter_logits` (temperature, then top-k, top-p over the top-k renormalized
     distribution, min-p relative to the max probability; masked tokens become -inf), then the
     exponential race argmax(logits - log(E)), E ~ Exp(1) i.i.d. per token (= Gumbel-max).

Invariants:
  * A token masked by top-k / top-p / min-p / min_new_tokens is never emitted (its score is -inf
    and the noise is clamped to stay finite).
  * A seeded row's noise depends only on (seed, len(output_ids)), so "same seed, same tokens"
    holds regardless of which other requests share the batch. Unseeded rows share one draw
    from the sampler's own generator.
  * Logprobs are computed from log_softmax of the RAW logits (before penalties / temperature).
  * A batch that is all greedy, without penalties, bans or logprobs, is a bare argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor

from radixrt.messages import TokenLogprobs
from radixrt.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a bijective 64-bit hash."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request at decoding step `step` (tokens generated so far)."""
    return _mix64(_mix64(seed + 0x9E3779B97F4A7C15) ^ (step & _MASK64))


def _scatter_counts(
    rows: Sequence[int],
    chunks: Sequence[Sequence[int]],
    batch: int,
    vocab: int,
    device: torch.device,
) -> Tensor:
    """Float32 [batch, vocab] counts of the ids in `chunks[j]` on row `rows[j]`.

    Ids outside [0, vocab) are ignored. One scatter_add over flattened indices, no per-token loop.
    """
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
    ids = torch.tensor(list(chain.from_iterable(chunks)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    keep = (ids >= 0) & (ids < vocab)
    flat = (row_idx * vocab + ids)[keep].to(device)
    counts = torch.zeros(batch * vocab, dtype=torch.float32, device=device)
    counts.scatter_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=device))
    return counts.view(batch, vocab)


@dataclass
class SamplingBatchInfo:
    """Per-step, per-row sampling state for one batch, on the logits' device.

    Row i of every [B, ...] tensor belongs to params[i]. Optional tensors are None when no row
    needs them (then the matching step is skipped entirely).
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    temperatures: Tensor  # [B] float32, as requested (greedy rows may hold 0)
    top_ps: Tensor  # [B] float32
    top_ks: Tensor  # [B] int64, disabled -> vocab_size; clamped to vocab_size
    min_ps: Tensor  # [B] float32
    greedy_rows: list[int]
    sampled_rows: list[int]
    sampled_idx: Tensor | None  # [Ns] int64 on device; None when all rows (or none) are sampled
    need_top_k: bool  # some sampled row has 1 < top_k < vocab
    need_top_p: bool  # some sampled row has top_p < 1
    need_min_p: bool  # some sampled row has min_p > 0
    repetition_penalties: Tensor | None  # [B, 1] float32
    repetition_mask: Tensor | None  # [B, V] bool: token occurs in prompt or output
    frequency_penalties: Tensor | None  # [B, 1] float32
    presence_penalties: Tensor | None  # [B, 1] float32
    output_counts: Tensor | None  # [B, V] float32: occurrences in output
    banned_mask: Tensor | None  # [B, V] bool: min_new_tokens not yet reached -> EOS/stop ids
    row_seeds: list[int | None]  # per row: generator seed for this step, None when unseeded
    logprob_rows: list[int]  # rows that asked for logprobs
    top_logprobs: list[int]  # per row, number of alternatives (0 when logprobs is off)

    @property
    def is_fast_path(self) -> bool:
        """All greedy, nothing to penalize, ban or report: a bare argmax suffices."""
        return (
            not self.sampled_rows
            and self.repetition_mask is None
            and self.output_counts is None
            and self.banned_mask is None
            and not self.logprob_rows
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
    ) -> SamplingBatchInfo:
        """Gather the batch's settings. `output_ids[i]` is what request i generated so far (its
        length is the seed step and the min_new_tokens progress). Count tensors are only built
        when some row needs them."""
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
        rep_pen = rep_mask = None
        if rep_rows:
            rep_pen = torch.tensor(
                [[float(p.repetition_penalty)] for p in params], dtype=torch.float32, device=dev
            )
            rows = [i for i in rep_rows for _ in (0, 1)]
            chunks = [c for i in rep_rows for c in (prompt_ids[i], output_ids[i])]
            rep_mask = _scatter_counts(rows, chunks, batch, vocab, dev) > 0

        fp_rows = [
            i
            for i, p in enumerate(params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        freq = pres = counts = None
        if fp_rows:
            freq = torch.tensor(
                [[float(p.frequency_penalty)] for p in params], dtype=torch.float32, device=dev
            )
            pres = torch.tensor(
                [[float(p.presence_penalty)] for p in params], dtype=torch.float32, device=dev
            )
            counts = _scatter_counts(fp_rows, [output_ids[i] for i in fp_rows], batch, vocab, dev)

        eos = tuple(eos_token_ids)
        ban_rows: list[int] = []
        ban_chunks: list[tuple[int, ...]] = []
        for i, p in enumerate(params):
            if len(output_ids[i]) < p.min_new_tokens:
                banned = eos + tuple(p.stop_token_ids)
                if banned:
                    ban_rows.append(i)
                    ban_chunks.append(banned)
        banned_mask = None
        if ban_rows:
            banned_mask = _scatter_counts(ban_rows, ban_chunks, batch, vocab, dev) > 0

        row_seeds = [
            None if p.seed is None or p.is_greedy else step_seed(p.seed, len(output_ids[i]))
            for i, p in enumerate(params)
        ]
        return cls(
            batch_size=batch,
            vocab_size=vocab,
            device=dev,
            temperatures=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=dev),
            top_ks=torch.tensor(top_ks, dtype=torch.long, device=dev),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=dev),
            greedy_rows=greedy_rows,
            sampled_rows=sampled_rows,
            sampled_idx=sampled_idx,
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            need_min_p=need_min_p,
            repetition_penalties=rep_pen,
            repetition_mask=rep_mask,
            frequency_penalties=freq,
            presence_penalties=pres,
            output_counts=counts,
            banned_mask=banned_mask,
            row_seeds=row_seeds,
            logprob_rows=[i for i, p in enumerate(params) if p.logprobs],
            top_logprobs=[p.top_logprobs if p.logprobs else 0 for p in params],
        )


def apply_penalties(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Penalized logits [B, V]; never mutates `logits` (returns it unchanged if nothing applies).

    Repetition (tokens in prompt or output): x > 0 -> x / r, else x * r. Then
    x -= frequency * count + presence * (count > 0) over output tokens. Then min_new_tokens
    bans set EOS / stop_token_ids to -inf.
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
    if info.banned_mask is not None:
        out = out.masked_fill(info.banned_mask, float("-inf"))
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
    """Owns the generator of unseeded rows (seeded from `seed`); stateless otherwise."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared: dict[str, torch.Generator] = {}  # per device: unseeded rows' stream
        self._per_row: dict[str, torch.Generator] = {}  # per device: re-seeded for each row

    def _generator(self, pool: dict[str, torch.Generator], device: torch.device) -> torch.Generator:
        key = str(device)
        gen = pool.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed & _MASK64)
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

    def sample(self, logits: Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """Pick one token per row of `logits` [B, V] (float32; other dtypes are upcast)."""
        if logits.dim() != 2 or logits.shape != (info.batch_size, info.vocab_size):
            raise ValueError(
                f"logits must be [{info.batch_size}, {info.vocab_size}], got {tuple(logits.shape)}"
            )
        batch = info.batch_size
        if info.is_fast_path:
            return SampleOutput(logits.argmax(dim=-1).tolist(), [None] * batch)
        if logits.is_cuda:  # FlashInfer's fused kernels where they cover the rows' settings
            from radixrt.sampling.flashinfer_sampler import flashinfer_sample

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
            chosen = (filtered - noise.log_()).argmax(dim=-1)
            if info.sampled_idx is None:
                next_ids = chosen
            else:
                next_ids = x.argmax(dim=-1)
                next_ids.index_copy_(0, info.sampled_idx, chosen)
        else:
            next_ids = x.argmax(dim=-1)

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
