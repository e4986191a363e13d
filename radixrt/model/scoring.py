"""Prompt scoring: log-probabilities of given next tokens from final hidden states, in chunks,
so a long prompt never materializes `[tokens, vocab]` logits at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.model.linear import LinearWeight

# Rows per lm_head call: 64 × 49152 float32 logits is 12 MiB.
SCORE_CHUNK_ROWS = 64
# Small matmuls take other CPU kernel paths than large ones, with other rounding; padding every
# chunk to a multiple of this many rows keeps a row's result independent of its chunk-mates.
_ROW_ALIGN = 8


@dataclass
class RowScores:
    logprob: torch.Tensor  # float32 [S]: log p(target)
    top_ids: torch.Tensor  # int64 [S, K], most likely first
    top_logprobs: torch.Tensor  # float32 [S, K]


def score_hidden(hidden: torch.Tensor, lm_head: LinearWeight, targets: torch.Tensor,
                 top_k: int, chunk_rows: int = SCORE_CHUNK_ROWS) -> RowScores:
    """Scores of `targets[i]` under the logits of `hidden[i]` (log-softmax in float32), with
    the top `max(top_k, 1)` alternatives; the target's value and the alternatives come from
    the same tensor, so a target that is the argmax equals the first alternative exactly."""
    k = max(top_k, 1)
    n = int(hidden.shape[0])
    lp = torch.empty(n, dtype=torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64)
    tops = torch.empty(n, k, dtype=torch.float32)
    for s in range(0, n, chunk_rows):
        h = hidden[s : s + chunk_rows]
        m = int(h.shape[0])
        pad = (-m) % _ROW_ALIGN
        if pad:
            h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
        logsm = torch.log_softmax(lm_head.logits(h), dim=-1)[:m]
        tgt = targets[s : s + m].to(logsm.device)
        lp[s : s + m] = logsm.gather(1, tgt[:, None]).squeeze(1).cpu()
        v, i = logsm.topk(k, dim=-1)
        ids[s : s + m] = i.cpu()
        tops[s : s + m] = v.cpu()
    return RowScores(lp, ids, tops)
