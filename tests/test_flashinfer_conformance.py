"""Every FlashInfer call radixrt makes, bound to the installed package's real signatures.

FlashInfer imports on CPU but runs nothing there, so the backend (and the sampler) run with a
recording stand-in: its classes / functions record `(args, kwargs)` and compute their results
with the pure-torch reference of `test_flashinfer_reference.py`. Each recorded call is then bound
with `inspect.signature(<real object>).bind(...)`, so a misspelt keyword, a wrong argument order or
an argument swallowed by a `*args` / `**kwargs` fails here; and the values passed are checked
against what FlashInfer expects (int32 indptr / indices, kv_last_page_len all ones, page size 1,
causal flags, planned dtypes, NHD page views of the pool, base-2 LSE into merge_state).

Install the package on CPU with `scripts/install_flashinfer_cpu.sh`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_flashinfer_reference import (
    WORKSPACE,
    D,
    make_batch,
    random_qkv,
    torch_flashinfer,
)

from radixrt.attention import FlashInferUnavailableError, create_attention_backend
from radixrt.attention.flashinfer import (
    FlashInferBackend,
    decode_use_tensor_cores,
    flashinfer_unavailable_reason,
)
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.core.sampling_params import SamplingParams
from radixrt.mem.memory_pool import TokenToKVPool
from radixrt.model.cuda_graph_runner import capture_batch_sizes
from radixrt.sampling.batch_info import SamplingBatchInfo
from radixrt.sampling.flashinfer_sampler import flashinfer_covers, flashinfer_sample
from radixrt.sampling.sampler import filter_logits

real = pytest.importorskip(
    "flashinfer", reason="flashinfer-python not installed (scripts/install_flashinfer_cpu.sh)"
)

RAGGED = "BatchPrefillWithRaggedKVCacheWrapper"
PAGED = "BatchPrefillWithPagedKVCacheWrapper"
DECODE = "BatchDecodeWithPagedKVCacheWrapper"
SELF = object()  # stands in for the wrapper instance when binding unbound methods


@dataclass
class Call:
    target: str  # dotted path under the module: "<Wrapper>.<method>", "merge_state", "sampling.x"
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any = None


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)

    def of(self, target: str) -> list[Call]:
        return [c for c in self.calls if c.target == target]

    def clear(self) -> None:
        self.calls.clear()


def _recording_class(cls: type, name: str, rec: Recorder) -> type:
    class Recording(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            rec.calls.append(Call(f"{name}.__init__", args, kwargs))
            super().__init__(*args, **kwargs)

        def plan(self, *args: Any, **kwargs: Any) -> None:
            rec.calls.append(Call(f"{name}.plan", args, kwargs))
            super().plan(*args, **kwargs)

        def run(self, *args: Any, **kwargs: Any) -> Any:
            call = Call(f"{name}.run", args, kwargs)
            rec.calls.append(call)
            call.result = super().run(*args, **kwargs)
            return call.result

    return Recording


def _recording_fn(fn: Any, target: str, rec: Recorder) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        call = Call(target, args, kwargs)
        rec.calls.append(call)
        call.result = fn(*args, **kwargs)
        return call.result

    return recorded


# --- pure-torch sampling stand-ins (results only need the right shape, dtype and support) ---------
def _multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).view(-1).to(torch.int32)


def _top_k_renorm_probs(probs: torch.Tensor, top_k: torch.Tensor, **_: Any) -> torch.Tensor:
    ranks = probs.argsort(dim=-1, descending=True).argsort(dim=-1)
    kept = probs.masked_fill(ranks >= top_k.view(-1, 1), 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _top_p_renorm_probs(probs: torch.Tensor, top_p: torch.Tensor, **_: Any) -> torch.Tensor:
    ps, idx = probs.sort(dim=-1, descending=True)
    drop = (ps.cumsum(-1) - ps) > top_p.view(-1, 1)
    kept = torch.empty_like(ps).scatter_(-1, idx, ps.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def _min_p_sampling_from_probs(
    probs: torch.Tensor, min_p: torch.Tensor, generator: torch.Generator | None = None, **_: Any
) -> torch.Tensor:
    kept = probs.masked_fill(probs < min_p.view(-1, 1) * probs.amax(-1, keepdim=True), 0.0)
    return _multinomial(kept, generator)


def _top_k_top_p_sampling_from_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    **_: Any,
) -> torch.Tensor:
    ones = torch.ones(logits.shape[0])
    return _multinomial(filter_logits(logits, ones, top_k, top_p).softmax(-1), generator)


def _sampling_from_logits(
    logits: torch.Tensor, generator: torch.Generator | None = None, **_: Any
) -> torch.Tensor:
    return _multinomial(logits.softmax(-1), generator)


def recording_flashinfer(rec: Recorder) -> SimpleNamespace:
    ref = torch_flashinfer()
    sampling = {
        "top_k_renorm_probs": _top_k_renorm_probs,
        "top_p_renorm_probs": _top_p_renorm_probs,
        "min_p_sampling_from_probs": _min_p_sampling_from_probs,
        "top_k_top_p_sampling_from_logits": _top_k_top_p_sampling_from_logits,
        "sampling_from_logits": _sampling_from_logits,
    }
    return SimpleNamespace(
        **{name: _recording_class(getattr(ref, name), name, rec) for name in (RAGGED, PAGED, DECODE)},
        merge_state=_recording_fn(ref.merge_state, "merge_state", rec),
        sampling=SimpleNamespace(
            **{n: _recording_fn(f, f"sampling.{n}", rec) for n, f in sampling.items()}
        ),
    )


# --- binding ---------------------------------------------------------------------------------------
def _real_object(target: str) -> Any:
    obj: Any = real
    for part in target.split("."):
        obj = getattr(obj, part)  # AttributeError: radixrt calls something FlashInfer lacks
    return obj


def bind(call: Call) -> inspect.BoundArguments:
    """Bind `call` to the real signature; nothing may land in a `*args` / `**kwargs` catch-all."""
    is_method = "." in call.target and not call.target.startswith("sampling.")
    fn = _real_object(call.target)
    args = (SELF, *call.args) if is_method else call.args
    bound = inspect.signature(fn).bind(*args, **call.kwargs)
    if call.target == f"{DECODE}.plan":
        # `plan(..., page_size, *deprecated_positional_args, **kwargs)` forwards to `_plan_impl`,
        # whose keyword-only signature is the one the keywords must match.
        assert not bound.arguments.get("deprecated_positional_args")
        fn = getattr(real.BatchDecodeWithPagedKVCacheWrapper, "_plan_impl", fn)
        bound = inspect.signature(fn).bind(*args, **call.kwargs)
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            assert not bound.arguments.get(p.name), (
                f"{call.target}: {bound.arguments.get(p.name)!r} went to the catch-all {p.name}"
            )
    bound.apply_defaults()
    return bound


def bind_all(rec: Recorder) -> dict[str, list[inspect.BoundArguments]]:
    out: dict[str, list[inspect.BoundArguments]] = {}
    for call in rec.calls:
        out.setdefault(call.target, []).append(bind(call))
    return out


def assert_int32(t: Any, values: torch.Tensor | list[int]) -> None:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1
    want = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    assert t.tolist() == want


# --- attention -------------------------------------------------------------------------------------
def run_backend(
    kv: TokenToKVPool, fb: ForwardBatch, heads: int, rec: Recorder
) -> tuple[FlashInferBackend, list[torch.Tensor]]:
    backend = FlashInferBackend(
        kv, heads, flashinfer=recording_flashinfer(rec), workspace_bytes=WORKSPACE
    )
    backend.init_forward_metadata(fb)
    outs = []
    for layer in range(kv.num_layers):
        q, k, v = random_qkv(fb.num_tokens, heads, kv.num_kv_heads, seed=layer, dtype=kv.dtype)
        outs.append(backend.forward(q, k, v, layer, D**-0.5, fb))
    return backend, outs


def check_wrappers_constructed(b: dict[str, list[inspect.BoundArguments]], kv: TokenToKVPool,
                               heads: int) -> None:
    for name in (RAGGED, PAGED, DECODE):
        (init,) = b[f"{name}.__init__"]
        ws = init.arguments["float_workspace_buffer"]
        assert ws.dtype == torch.uint8 and ws.dim() == 1 and ws.numel() == WORKSPACE
        assert init.arguments["kv_layout"] == "NHD"
        assert init.arguments["use_cuda_graph"] is False
    assert b[f"{PAGED}.__init__"][0].arguments["backend"] == "fa2"
    dec = b[f"{DECODE}.__init__"][0].arguments
    assert dec["backend"] == "fa2"
    assert dec["use_tensor_cores"] == decode_use_tensor_cores(kv.dtype, heads, kv.num_kv_heads)
    # The three wrappers share one workspace.
    assert len({id(b[f"{n}.__init__"][0].arguments["float_workspace_buffer"])
                for n in (RAGGED, PAGED, DECODE)}) == 1


def check_paged_cache(cache: Any, kv: TokenToKVPool, layer: int) -> None:
    """A (k, v) tuple of NHD page-size-1 views of the pool's own buffers for `layer`."""
    assert isinstance(cache, tuple) and len(cache) == 2
    for view, buf in zip(cache, (kv.k_buffer[layer], kv.v_buffer[layer]), strict=True):
        assert tuple(view.shape) == (kv.size + 1, 1, kv.num_kv_heads, kv.head_dim)
        assert view.data_ptr() == buf.data_ptr() and view.is_contiguous()


@pytest.mark.parametrize(
    "prefix,ext",
    [([0, 37, 5, 0], [7, 1, 20, 1]), ([40], [7]), ([0, 0], [5, 3]), ([96, 16], [16, 16])],
    ids=["mixed", "long-prefix", "no-prefix", "chunked"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_extend_calls_bind_and_carry_the_right_values(
    prefix: list[int], ext: list[int], dtype: torch.dtype
) -> None:
    heads, kv_heads = 8, 2
    kv, fb = make_batch(prefix, ext, heads, kv_heads, ForwardMode.EXTEND, seed=1, dtype=dtype)
    rec = Recorder()
    _, outs = run_backend(kv, fb, heads, rec)
    b = bind_all(rec)
    check_wrappers_constructed(b, kv, heads)
    has_prefix = any(prefix)
    layers = kv.num_layers

    # One plan per batch, reused by every layer.
    (rp,) = b[f"{RAGGED}.plan"]
    a = rp.arguments
    assert_int32(a["qo_indptr"], fb.qo_indptr)
    assert_int32(a["kv_indptr"], fb.qo_indptr)  # the ragged K/V are the new tokens
    assert (a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"]) == (heads, kv_heads, D)
    assert a["causal"] is True
    assert a["sm_scale"] == pytest.approx(D**-0.5)
    assert a["q_data_type"] == dtype and a["kv_data_type"] == dtype
    assert a["pos_encoding_mode"] == "NONE"  # RoPE is applied by the model

    runs = b[f"{RAGGED}.run"]
    assert len(runs) == layers
    for r in runs:
        assert tuple(r.arguments["q"].shape) == (fb.num_tokens, heads, D)
        assert tuple(r.arguments["k"].shape) == (fb.num_tokens, kv_heads, D)
        assert r.arguments["return_lse"] is has_prefix
        # merge_state consumes base-2 LSEs in [tokens, heads]: the defaults must stay so.
        assert r.arguments["lse_base"] == "log2" and r.arguments["lse_layout"] == "NH"

    if not has_prefix:
        assert f"{PAGED}.plan" not in b and f"{PAGED}.run" not in b and "merge_state" not in b
        return
    (pp,) = b[f"{PAGED}.plan"]
    a = pp.arguments
    assert_int32(a["qo_indptr"], fb.qo_indptr)
    assert_int32(a["paged_kv_indptr"], fb.kv_indptr)  # cached prefix only
    assert a["paged_kv_indices"] is fb.kv_indices and fb.kv_indices.dtype == torch.int32
    assert_int32(a["paged_kv_last_page_len"], [1] * fb.batch_size)
    assert a["page_size"] == 1
    assert (a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"]) == (heads, kv_heads, D)
    assert a["causal"] is False
    assert a["sm_scale"] == pytest.approx(D**-0.5)
    assert a["q_data_type"] == dtype and a["kv_data_type"] == dtype

    pruns, merges = b[f"{PAGED}.run"], b["merge_state"]
    assert len(pruns) == len(merges) == layers
    ragged_calls, paged_calls = rec.of(f"{RAGGED}.run"), rec.of(f"{PAGED}.run")
    merge_calls = rec.of("merge_state")
    for layer in range(layers):
        assert pruns[layer].arguments["return_lse"] is True
        assert pruns[layer].arguments["lse_base"] == "log2"
        check_paged_cache(pruns[layer].arguments["paged_kv_cache"], kv, layer)
        # merge_state(ragged out, ragged lse, paged out, paged lse), float32 LSEs.
        (o1, s1), (o2, s2) = ragged_calls[layer].result, paged_calls[layer].result
        m = merges[layer].arguments
        assert (m["v_a"], m["s_a"], m["v_b"], m["s_b"]) == (o1, s1, o2, s2)
        assert s1.dtype == s2.dtype == torch.float32 and s1.shape == (fb.num_tokens, heads)
        assert merge_calls[layer].result[0] is outs[layer]


@pytest.mark.parametrize(
    "heads,kv_heads,dtype,tensor_cores",
    [(8, 2, torch.bfloat16, True), (8, 2, torch.float16, True), (6, 3, torch.bfloat16, False),
     (8, 2, torch.float32, False)],
)
def test_decode_calls_bind_and_carry_the_right_values(
    heads: int, kv_heads: int, dtype: torch.dtype, tensor_cores: bool
) -> None:
    seq_lens = [1, 9, 33, 2]
    kv, fb = make_batch([s - 1 for s in seq_lens], [1] * 4, heads, kv_heads, ForwardMode.DECODE,
                        seed=3, dtype=dtype)
    rec = Recorder()
    run_backend(kv, fb, heads, rec)
    b = bind_all(rec)
    check_wrappers_constructed(b, kv, heads)
    assert b[f"{DECODE}.__init__"][0].arguments["use_tensor_cores"] is tensor_cores
    (plan,) = b[f"{DECODE}.plan"]
    a = plan.arguments
    assert_int32(a["indptr"], fb.kv_indptr)  # every slot, this step's included
    assert_int32(a["indptr"], [0, 1, 10, 43, 45])
    assert a["indices"] is fb.kv_indices and fb.kv_indices.dtype == torch.int32
    assert_int32(a["last_page_len"], [1] * 4)
    assert (a["num_qo_heads"], a["num_kv_heads"], a["head_dim"], a["page_size"]) == (
        heads, kv_heads, D, 1)
    assert a["sm_scale"] == pytest.approx(D**-0.5)
    assert a["q_data_type"] == dtype and a["kv_data_type"] == dtype
    runs = b[f"{DECODE}.run"]
    assert len(runs) == kv.num_layers
    for layer, r in enumerate(runs):
        assert tuple(r.arguments["q"].shape) == (4, heads, D)
        assert r.arguments["return_lse"] is False
        check_paged_cache(r.arguments["paged_kv_cache"], kv, layer)
    assert not any(c.target.startswith((RAGGED + ".r", PAGED + ".r", "merge")) for c in rec.calls)


def test_cuda_graph_decode_wrappers_bind() -> None:
    """The capture / replay path: one fixed-buffer wrapper per bucket, re-planned per replay."""
    heads, kv_heads = 8, 2
    kv, fb = make_batch([4, 0, 9, 2], [1] * 4, heads, kv_heads, ForwardMode.DECODE, seed=4)
    _, fb2 = make_batch([7, 1, 3, 5], [1] * 4, heads, kv_heads, ForwardMode.DECODE, seed=5)
    rec = Recorder()
    backend = FlashInferBackend(kv, heads, flashinfer=recording_flashinfer(rec),
                                workspace_bytes=WORKSPACE)
    backend.init_cuda_graph_state(max_bs=8, max_kv_tokens=kv.size + 8)
    rec.clear()
    backend.init_forward_metadata_capture(fb)
    q, k, v = random_qkv(4, heads, kv_heads, seed=0)
    backend.forward(q, k, v, 0, D**-0.5, fb)
    backend.init_forward_metadata_replay(fb2)  # same bucket: no new wrapper
    b = bind_all(rec)
    (init,) = b[f"{DECODE}.__init__"]
    a = init.arguments
    assert a["use_cuda_graph"] is True and a["backend"] == "fa2" and a["kv_layout"] == "NHD"
    assert a["paged_kv_indptr_buffer"].numel() == 5  # batch size + 1
    assert a["paged_kv_last_page_len_buffer"].tolist() == [1] * 4
    assert a["paged_kv_indices_buffer"].numel() >= kv.size + 4
    for t in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"):
        assert a[t].dtype == torch.int32
    plans = b[f"{DECODE}.plan"]
    assert len(plans) == 2
    assert_int32(plans[1].arguments["indptr"], fb2.kv_indptr)
    with pytest.raises(ValueError, match="captured"):
        backend.init_forward_metadata_replay(make_batch([1, 2], [1, 1], heads, kv_heads,
                                                        ForwardMode.DECODE, seed=6)[1])


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


# --- sampling --------------------------------------------------------------------------------------
VOCAB = 50


def _info(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingBatchInfo:
    outs = outputs or [[] for _ in params]
    return SamplingBatchInfo.build(params, [[1, 2]] * len(params), outs, VOCAB, "cpu", (2,))


SAMPLING_CASES = {
    "top_k": [SamplingParams(temperature=0.7, top_k=5)],
    "top_p": [SamplingParams(temperature=1.3, top_p=0.6)],
    "top_k_top_p": [SamplingParams(top_k=8, top_p=0.5), SamplingParams(top_k=3)],
    "min_p": [SamplingParams(min_p=0.2), SamplingParams(top_k=4, top_p=0.7, min_p=0.1)],
    "plain": [SamplingParams(temperature=0.9), SamplingParams(temperature=1.1)],
    "mixed_greedy": [SamplingParams(temperature=0), SamplingParams(top_k=6, top_p=0.9),
                     SamplingParams(temperature=0)],
    "all_greedy": [SamplingParams(temperature=0)] * 3,
}
EXPECTED_CALLS = {
    "top_k": ["top_k_top_p_sampling_from_logits"],
    "top_p": ["top_k_top_p_sampling_from_logits"],
    "top_k_top_p": ["top_k_top_p_sampling_from_logits"],
    "min_p": ["top_k_renorm_probs", "top_p_renorm_probs", "min_p_sampling_from_probs"],
    "plain": ["sampling_from_logits"],
    "mixed_greedy": ["top_k_top_p_sampling_from_logits"],
    "all_greedy": [],
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_calls_bind_and_respect_filters(case: str) -> None:
    params = SAMPLING_CASES[case]
    info = _info(params)
    assert flashinfer_covers(info)
    rec = Recorder()
    fi = recording_flashinfer(rec)
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        ids = flashinfer_sample(logits, info, flashinfer=fi, generator=gen)
        assert ids is not None and ids.dtype == torch.int64 and ids.shape == (len(params),)
        for i, p in enumerate(params):
            if p.is_greedy:
                assert int(ids[i]) == int(logits[i].argmax())
                continue
            allowed = filter_logits(
                logits[i : i + 1],
                info.temperatures[i : i + 1],
                info.top_ks[i : i + 1],
                info.top_ps[i : i + 1],
                info.min_ps[i : i + 1],
            )[0].isfinite()
            assert allowed[int(ids[i])], f"{case}: row {i} drew a filtered-out token"
    names = [c.target.removeprefix("sampling.") for c in rec.calls[: len(EXPECTED_CALLS[case])]]
    assert names == EXPECTED_CALLS[case]
    n_sampled = len(info.sampled_rows)
    for bound in (x for v in bind_all(rec).values() for x in v):
        a = bound.arguments
        first = next(iter(a.values()))
        assert first.dtype == torch.float32 and first.shape == (n_sampled, VOCAB)
        if "top_k" in a:
            assert a["top_k"].dtype == torch.int32 and a["top_k"].shape == (n_sampled,)
        if "top_p" in a:
            assert a["top_p"].dtype == torch.float32 and a["top_p"].shape == (n_sampled,)
        if "min_p" in a:
            assert a["min_p"].dtype == torch.float32
        if "deterministic" in a and "generator" in a:
            assert a["deterministic"] is True and a["generator"] is gen
        if "filter_apply_order" in a:
            assert a["filter_apply_order"] == "top_k_first"  # top-p over the top-k renormalised


@pytest.mark.parametrize(
    "params,outputs",
    [
        ([SamplingParams(top_k=5, seed=3)], None),
        ([SamplingParams(repetition_penalty=1.2)], None),
        ([SamplingParams(frequency_penalty=0.5)], [[4]]),
        ([SamplingParams(logprobs=True)], None),
        ([SamplingParams(min_new_tokens=2)], None),  # bans EOS
    ],
    ids=["seed", "repetition", "frequency", "logprobs", "min_new_tokens"],
)
def test_sampling_not_covered(params: list[SamplingParams], outputs: list[list[int]] | None) -> None:
    info = _info(params, outputs)
    rec = Recorder()
    logits = torch.randn(1, VOCAB)
    assert flashinfer_sample(logits, info, flashinfer=recording_flashinfer(rec)) is None
    assert rec.calls == []


def test_sampling_needs_cuda_without_an_injected_module() -> None:
    info = _info([SamplingParams(top_k=5)])
    assert flashinfer_sample(torch.randn(1, VOCAB), info) is None


# --- selection -------------------------------------------------------------------------------------
def test_factory_on_cpu() -> None:
    kv = TokenToKVPool(4, 1, 1, D)
    assert isinstance(create_attention_backend("auto", kv), TorchNativeBackend)
    assert isinstance(create_attention_backend("torch", kv), TorchNativeBackend)
    with pytest.raises(FlashInferUnavailableError, match="CUDA"):
        create_attention_backend("flashinfer", kv, num_q_heads=2)
    with pytest.raises(ValueError, match="unknown"):
        create_attention_backend("nope", kv)


def test_unavailable_reasons() -> None:
    cuda = torch.device("cuda")
    assert "CUDA" in str(flashinfer_unavailable_reason(torch.device("cpu"), torch.bfloat16, 8))
    assert "float16" in str(flashinfer_unavailable_reason(cuda, torch.float32, 8))
    assert "query heads" in str(flashinfer_unavailable_reason(cuda, torch.bfloat16, None))
    assert flashinfer_unavailable_reason(cuda, torch.bfloat16, 8) is None  # it imports here


def test_backend_refuses_head_major_pools() -> None:
    with pytest.raises(ValueError, match="slot-major"):
        FlashInferBackend(TokenToKVPool(4, 1, 1, D, head_major=True), 2,
                          flashinfer=recording_flashinfer(Recorder()))


def test_real_module_refuses_fp32_pools() -> None:
    with pytest.raises(FlashInferUnavailableError, match="float16"):
        FlashInferBackend(TokenToKVPool(4, 1, 1, D), 1)
