"""Token masks from grammars, applied to a batch's logits.

Layout (the one `radixrt.grammar.base` documents): int32 [rows, ceil(V / 32)], bit j of word w
(little-endian) allows token 32 * w + j. Words beyond the logits' width are ignored.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """Bool [rows, vocab_size]: True where the token is allowed."""
    words = bitmask.detach().cpu().contiguous().numpy()
    if sys.byteorder != "little":  # the bit order is defined on little-endian words
        words = words.byteswap()
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).bool()


def apply_vocab_mask(logits: Tensor, rows: Tensor | None, bitmask: Tensor,
                     fallback: Tensor | None = None) -> Tensor:
    """`logits` [B, V] with the disallowed tokens of row `rows[i]` (row i when `rows` is
    None: every row constrained) set to -inf per `bitmask[i]`; other rows untouched. A new
    tensor; `logits` is not mutated.

    `fallback` [B, V] (the logits before bans such as min_new_tokens): a masked row left with
    no finite logit takes its values from `fallback` instead, masked the same way — the
    grammar wins over the ban, so every row keeps a token to pick."""
    allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
    ninf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)

    def pick(x: Tensor) -> Tensor:
        return x if rows is None else x.index_select(0, rows)

    sub = torch.where(allowed, pick(logits), ninf)  # faster than masked_fill on CPU
    if fallback is not None:
        dead = torch.isneginf(sub).all(dim=1)
        if bool(dead.any()):
            alt = torch.where(allowed, pick(fallback), ninf)
            sub = torch.where(dead.view(-1, 1), alt, sub)
    return sub if rows is None else logits.index_copy(0, rows, sub)
