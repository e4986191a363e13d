"""Batch-invariant extend (`TorchNativeBackend(batch_invariant=True)`): a prompt token's logits
are bitwise the same whether computed cold (whole prompt in one extend, batched with anything)
or warm (its prefix's KV computed earlier by another request, the rest chunked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import PagedRunner, hf_logits, make_tiny_checkpoint

from radixrt.attention.torch_native import TorchNativeBackend


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-invariant")
    return path, make_tiny_checkpoint(path, "llama", seed=5, max_position_embeddings=1024)


def _runner(path: Path) -> PagedRunner:
    runner = PagedRunner.create(path, kv_size=8192, max_reqs=64, max_context=1024)
    runner.model.attn_backend = TorchNativeBackend(runner.kv_pool, batch_invariant=True)
    return runner


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _chunked(runner: PagedRunner, row: int, toks: list[int], chunk: int,
             companions: list[list[int]], first: bool) -> torch.Tensor:
    """Extend `row` by `toks` in chunks; every step also carries fresh companion requests."""
    out = []
    for a in range(0, len(toks), chunk):
        others = [runner.new_request() for _ in companions]
        rows, chunks = [row, *others], [toks[a : a + chunk], *companions]
        if not first:  # the request of interest last in the batch
            rows, chunks = rows[::-1], chunks[::-1]
        logits = runner.extend(rows, chunks, all_positions=True)
        start = 0 if first else sum(len(c) for c in chunks[:-1])
        out.append(logits[start : start + len(chunks[0 if first else -1])])
        for o in others:
            runner.kv_pool.free(runner.req_pool.req_to_token[o, : runner.cached[o]].long())
            runner.req_pool.free(o)
    return torch.cat(out)


def test_cold_and_warm_logits_are_bitwise_equal(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    runner = _runner(path)
    n = 150
    prompt = _tokens(n, seed=0)
    cold = _chunked(runner, runner.new_request(), prompt, n, [], first=True)
    # Still the model: close to transformers.
    torch.testing.assert_close(cold, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    # Cold again, batched with other prompts of several lengths, in either position.
    for companions, first in [([_tokens(3, 1)], True), ([_tokens(70, 2), _tokens(1, 3)], False),
                              ([_tokens(200, 4)], True)]:
        again = _chunked(runner, runner.new_request(), prompt, n, companions, first)
        assert torch.equal(again, cold)
    # Warm: a donor computes the first p tokens (itself chunked / batched), a new request
    # reuses those slots and computes the rest, chunked.
    splits = [(1, 1, 149), (5, 2, 48), (11, 3, 7), (16, 16, 45), (17, 9, 133), (64, 64, 64),
              (65, 20, 3), (128, 100, 22), (146, 146, 1)]
    for i, (p, donor_chunk, tail_chunk) in enumerate(splits):
        companions = [_tokens(1 + 37 * i % 90, 10 + i)] if i % 2 else []
        donor = runner.new_request()
        head = _chunked(runner, donor, prompt[:p], donor_chunk, companions, first=i % 3 == 0)
        assert torch.equal(head, cold[:p]), (p, donor_chunk)
        warm = runner.share_prefix(donor, p)
        tail = _chunked(runner, warm, prompt[p:], tail_chunk, companions, first=i % 3 == 1)
        assert torch.equal(tail, cold[p:]), (p, tail_chunk)
    # A longer prompt with the same prefix computes the shared positions identically.
    longer = _chunked(runner, runner.new_request(), prompt + _tokens(90, 9), 240, [], True)
    assert torch.equal(longer[:n], cold)


def test_default_path_is_not_invariant_so_the_test_above_means_something(
    tiny: tuple[Path, Any],
) -> None:
    path, _ = tiny
    runner = PagedRunner.create(path, kv_size=4096)
    prompt = _tokens(150, seed=0)
    cold = runner.extend([runner.new_request()], [prompt], all_positions=True)
    differs = []
    for p in (17, 100, 149):
        donor = runner.new_request()
        runner.extend([donor], [prompt[:p]], all_positions=True)
        warm = runner.share_prefix(donor, p)
        tail = runner.extend([warm], [prompt[p:]], all_positions=True)
        torch.testing.assert_close(tail, cold[p:], atol=1e-4, rtol=0)
        differs.append(not torch.equal(tail, cold[p:]))
    assert any(differs)
