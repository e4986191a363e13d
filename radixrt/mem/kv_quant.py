"""The int8 KV cache's number format (`--kv-cache-dtype int8`), in torch.

Each (token, KV head) row `x` of `head_dim` values is stored as int8 codes and one fp32 scale:
`scale = max|x| / 127`, `codes = round(x * (127 / max|x|))` (round half to even; a row of zeros
gets codes 0 and scale 0), read back as `codes * scale`. The C++ store (`radixrt::kv_store_i8`)
computes bitwise the same codes and scales; `radixrt::paged_decode_i8` reads them in place.
"""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`codes` int8 shaped like `x`, `scale` fp32 `x.shape[:-1]`) of the rows of `x`."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a tensor / tensor division: `127.0 / amax` would run as 127 * (1 / amax), rounding twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, amax / 127.0


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`codes * scale` per row, in `dtype`."""
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)
