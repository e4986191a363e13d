"""CUDA sampling through `flashinfer.sampling`, for the batches it covers.

`flashinfer_sample(logits, info)` returns next-token ids, or None when the batch needs what only
the torch `Sampler` provides. It covers a batch when no row has penalties, min_new_tokens bans,
logprobs or a seed (FlashInfer's generator is one stream for the whole batch, so the per-row
"same seed, same tokens" guarantee of `Sampler` cannot hold). Greedy rows take the argmax.

Filter semantics match `radixrt.sampling.sampler.filter_logits`: temperature, then top-k, then
top-p over the top-k-renormalised distribution (FlashInfer's `filter_apply_order="top_k_first"`),
then min-p relative to the most likely token (a ratio, so renormalising before it changes
nothing). Sampling is FlashInfer's (inverse-CDF / rejection), not the torch sampler's Gumbel race:
the same distribution, a different random stream. `Sampler` calls it without a generator, so
its draws come from torch's default CUDA generator: `Sampler(seed=...)` (the scheduler passes
`ServerArgs.random_seed`) seeds only the torch path, not this one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from radixrt.attention.flashinfer import import_flashinfer
from radixrt.sampling.batch_info import SamplingBatchInfo


def flashinfer_covers(info: SamplingBatchInfo) -> bool:
    """True when FlashInfer's kernels can sample every row of `info` exactly as requested."""
    return (
        info.repetition is None
        and info.output_penalty is None
        and info.banned is None
        and info.logit_bias is None
        and info.vocab_bitmask is None
        and not info.logprob_rows
        and all(info.row_seeds[r] is None for r in info.sampled_rows)
    )


def flashinfer_sample(
    logits: Tensor,
    info: SamplingBatchInfo,
    *,
    flashinfer: Any = None,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """int64 `[B]` next-token ids for raw logits `[B, V]`, or None when not covered.

    Without an injected `flashinfer` module, only CUDA logits with the package installed are
    covered. `generator` (a CUDA generator) drives the sampled rows; None uses torch's default.
    """
    if logits.dim() != 2 or logits.shape != (info.batch_size, info.vocab_size):
        raise ValueError(
            f"logits must be [{info.batch_size}, {info.vocab_size}], got {tuple(logits.shape)}"
        )
    if not flashinfer_covers(info):
        return None
    fi = flashinfer
    if fi is None:
        if logits.device.type != "cuda":
            return None
        fi = import_flashinfer()
        if fi is None:
            return None
    x = logits.float()
    if not info.sampled_rows:
        return x.argmax(dim=-1)

    idx = info.sampled_idx  # None: every row is sampled
    # a step with a sampled row has its settings' tensors (SamplingBatchInfo.build)
    assert info.temperatures is not None and info.top_ks is not None
    assert info.top_ps is not None and info.min_ps is not None

    def rows(t: Tensor) -> Tensor:
        return t if idx is None else t.index_select(0, idx)

    scaled = rows(x) / rows(info.temperatures).view(-1, 1)
    top_ks = rows(info.top_ks).to(torch.int32)
    top_ps = rows(info.top_ps)
    sampling = fi.sampling
    if info.need_min_p:
        probs = torch.softmax(scaled, dim=-1)
        if info.need_top_k:
            probs = sampling.top_k_renorm_probs(probs, top_ks)
        if info.need_top_p:
            probs = sampling.top_p_renorm_probs(probs, top_ps)
        chosen = sampling.min_p_sampling_from_probs(
            probs, rows(info.min_ps), deterministic=True, generator=generator
        )
    elif info.need_top_k or info.need_top_p:
        chosen = sampling.top_k_top_p_sampling_from_logits(
            scaled,
            top_ks,
            top_ps,
            filter_apply_order="top_k_first",
            deterministic=True,
            generator=generator,
        )
    else:
        chosen = sampling.sampling_from_logits(scaled, deterministic=True, generator=generator)
    chosen = chosen.to(torch.int64)
    if idx is None:
        return chosen
    out = x.argmax(dim=-1)
    out.index_copy_(0, idx, chosen)
    return out
