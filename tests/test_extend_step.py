"""`radixrt::extend_step` (`DecodeLayers.run_extend`): an extend step's layers in one C++ call.

It calls the ops of the Python layer loop in the same order on the same tensors, so every
logit must be bitwise the loop's: fresh prefills (every position's logits), extends over a
cached shared prefix, mixed steps (one-token rows on the paged-decode op beside extend rows on
the extend op, and a mixed step with no extend rows at all), extends after decode steps,
prompt scoring's hidden rows; dense fp32 / bf16 with biases (Qwen2) and GGUF weights on the
qgemv and vnni kernels with dense copies above `max_rows`; a float16 KV cache under a float32
model. Then the steps that must take the loop, the switch, and bad arguments to the op.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import (
    ONE_CALL_CASES,
    PagedRunner,
    make_tiny_checkpoint,
    make_tiny_runner,
    one_call_case_model,
)

from radixrt.attention import cpu_kernels
from radixrt.attention.extend_attention import ExtendStepPlan
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.model.decode_layers import DecodeLayers
from radixrt.model.layer_ops import TorchLayerOps
from radixrt.model.loader import load_model
from radixrt.model.model_config import ModelConfig
from radixrt.model.quant import QuantPlan


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _runner(path: Path, dtype: torch.dtype, quant: QuantPlan | None = None,
            kv_dtype: torch.dtype | None = None) -> PagedRunner:
    config = ModelConfig.from_path(path)
    model, _ = load_model(path, None, dtype, "cpu", model_config=config, quant=quant)
    return PagedRunner.for_model(model, kv_dtype=kv_dtype)


class _Calls:
    """Counts `DecodeLayers.run_extend` calls: (extend rows on the op, decode rows) per call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.kinds: list[tuple[bool, bool]] = []
        real = DecodeLayers.run_extend

        def counted(stack: DecodeLayers, *args: object, **kwargs: object
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            plan = args[8]
            assert isinstance(plan, ExtendStepPlan)
            self.kinds.append((plan.extend is not None, plan.decode is not None))
            return real(stack, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(DecodeLayers, "run_extend", counted)


def _steps(runner: PagedRunner, fused: bool) -> list[torch.Tensor]:
    """A fresh 40-token prefill (every position's logits); three requests sharing it with
    tails of 3, 6 and 1 tokens beside an unrelated 9-token one (the 1-token row a decode row:
    a mixed step); every row one token (a mixed step of decode rows alone); the same with no
    row marked decode (`decode_rows_from`); two decode steps; a 5-token extend of two rows
    after them. Per-step logits; pool invariants checked."""
    runner.model.fused_extend = fused
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 256, (40,), generator=g).tolist()
    first = runner.new_request()
    logits = [runner.extend([first], [prefix], all_positions=True)]
    rows = [runner.share_prefix(first, 40) for _ in range(3)] + [runner.new_request()]
    tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 6, 1, 9)]
    logits.append(runner.extend(rows, tails))
    logits.append(runner.extend(rows, [[t] for t in logits[-1].argmax(-1).tolist()]))
    logits.append(runner.extend(rows, [[t] for t in logits[-1].argmax(-1).tolist()],
                                decode_rows_from=len(rows)))
    for _ in range(2):
        logits.append(runner.decode(rows, logits[-1].argmax(-1).tolist()))
    chunks = [torch.randint(3, 256, (5,), generator=g).tolist() for _ in range(2)]
    logits.append(runner.extend(rows[:2], chunks))
    runner.kv_pool.check_invariants()
    runner.req_pool.check_invariants()
    return logits


def _one_call_against_loop(path: Path, dtype: torch.dtype, plan: QuantPlan | None,
                           monkeypatch: pytest.MonkeyPatch,
                           kv_dtype: torch.dtype | None = None) -> None:
    runs, kinds = {}, {}
    for fused in (True, False):
        calls = _Calls(monkeypatch)
        runner = _runner(path, dtype, plan, kv_dtype)
        assert runner.kv_pool.narrowed == (kv_dtype == torch.float16)
        runs[fused] = _steps(runner, fused)
        kinds[fused] = calls.kinds
        monkeypatch.undo()
    # the five extend steps: fresh, mixed, mixed without extend rows, extend, extend
    assert kinds[True] == [(True, False), (True, True), (False, True), (True, False),
                           (True, False)]
    assert kinds[False] == []
    for step, (a, b) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("case", list(ONE_CALL_CASES))
def test_one_call_is_bitwise_the_layer_loop(tmp_path: Path, case: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # GGUF: steps of 1-40 rows on both sides of max_rows (the kernels and the dense copies)
    path, dtype, plan = one_call_case_model(tmp_path, case)
    _one_call_against_loop(path, dtype, plan, monkeypatch)


@pytest.mark.parametrize("case", ["qwen2-fp32-dense", "llama-bf16-gguf-vnni"])
def test_float16_pool_under_fp32_one_call_is_bitwise_the_layer_loop(
        tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model over a float16 KV cache (narrowed, the default with GGUF weights on
    CPUs without bf16): the one call reads the pool in place as the loop does."""
    path, _, plan = one_call_case_model(tmp_path, case)
    _one_call_against_loop(path, torch.float32, plan, monkeypatch, kv_dtype=torch.float16)


def _scored_step(runner: PagedRunner, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A 12-token prefill scoring its tokens 2..11 (`forward_scored`): (logits, hidden)."""
    runner.model.fused_extend = fused
    row = runner.new_request()
    ids = list(range(20, 32))
    loc = runner.kv_pool.alloc(len(ids))
    assert loc is not None
    runner.req_pool.write([row], [0], [len(ids)], loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [row], [0], [len(ids)],
                            runner.req_pool.req_to_token)
    fb.score_rows = torch.arange(2, 12)
    assert runner.model.attn_backend is not None
    runner.model.attn_backend.init_forward_metadata(fb)
    logits, hidden = runner.model.forward_scored(fb)
    assert hidden is not None
    return logits, hidden


def test_scored_prompt_rows_are_bitwise_the_layer_loop(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    make_tiny_checkpoint(tmp_path, "llama", seed=8, num_hidden_layers=2)
    out = {}
    for fused in (True, False):
        calls = _Calls(monkeypatch)
        out[fused] = _scored_step(_runner(tmp_path, torch.bfloat16), fused)
        assert len(calls.kinds) == (1 if fused else 0)
        monkeypatch.undo()
    for a, b in zip(out[True], out[False], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def _loop_only(runner: PagedRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """An extend step of two requests runs, and not through `run_extend`."""
    calls = _Calls(monkeypatch)
    rows = [runner.new_request() for _ in range(2)]
    logits = runner.extend(rows, [[5, 6, 7], [8, 9]])
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()
    assert calls.kinds == []
    monkeypatch.undo()


def test_steps_the_op_cannot_run_take_the_loop(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    make_tiny_checkpoint(tmp_path, "llama", seed=2, num_hidden_layers=2)
    runner = _runner(tmp_path, torch.bfloat16)
    runner.model.fused_extend = False  # switched off
    _loop_only(runner, monkeypatch)
    runner = _runner(tmp_path, torch.bfloat16, kv_dtype=torch.int8)  # an int8 KV cache
    _loop_only(runner, monkeypatch)
    runner = _runner(tmp_path, torch.bfloat16)
    backend = runner.model.attn_backend
    assert isinstance(backend, TorchNativeBackend)
    backend.extend_kernel = False  # the SDPA extend path
    _loop_only(runner, monkeypatch)
    runner = _runner(tmp_path, torch.bfloat16)
    backend = runner.model.attn_backend
    assert isinstance(backend, TorchNativeBackend)
    backend.batch_invariant = True  # batch-invariant extends
    _loop_only(runner, monkeypatch)
    runner = _runner(tmp_path, torch.float32)
    runner.model.set_layer_ops(TorchLayerOps())  # no C++ stack for torch's layer ops
    _loop_only(runner, monkeypatch)


@pytest.mark.parametrize("disable", [False, True])
def test_server_args_switch(tmp_path: Path, disable: bool) -> None:
    runner = make_tiny_runner(tmp_path, disable_fused_extend=disable)
    assert runner.model.fused_extend is (not disable)


def test_bad_arguments_raise_naming_them(tmp_path: Path) -> None:
    """Each malformed call raises naming what is wrong, writes nothing that matters, and a good
    step runs after it with the pools intact."""
    make_tiny_checkpoint(tmp_path, "llama", seed=4, num_hidden_layers=2)
    runner = _runner(tmp_path, torch.float32)
    model, kv = runner.model, runner.kv_pool
    stack = model.decode_layers()
    assert isinstance(stack, DecodeLayers)
    held = stack._stack_for(model.embed_tokens, model.rotary.cos, model.rotary.sin, model.norm,
                            model.config.rms_norm_eps, kv.k_buffer, kv.v_buffer, kv.k_scale,
                            kv.v_scale)
    ids, pos, loc = torch.tensor([5, 6, 7]), torch.arange(3), torch.tensor([1, 2, 3])
    i64 = {"dtype": torch.int64}
    ext = [torch.zeros(0, dtype=torch.int32), torch.tensor([0, 0], **i64),
           torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([0, 3], **i64)]
    op = torch.ops.radixrt.extend_step
    out = op(held, ids, pos, loc, ext, None, None, [])  # the good call
    assert out[0].shape == (3, model.config.hidden_size)
    with pytest.raises(RuntimeError, match="one entry per token"):
        op(held, ids, pos[:2], loc, ext, None, None, [])
    with pytest.raises(RuntimeError, match="ext must hold"):
        op(held, ids, pos, loc, ext[:3], None, None, [])
    with pytest.raises(RuntimeError, match="takes ext alone"):
        op(held, ids, pos, loc, [], None, None, [])
    dec_plan = [torch.tensor([1], dtype=torch.int32), torch.tensor([0], **i64),
                torch.tensor([1], **i64)] + [torch.zeros(0, **i64)] * 2 + [
                torch.zeros(1, **i64), torch.zeros(0, **i64)]
    with pytest.raises(RuntimeError, match="dec_plan must hold"):
        op(held, ids, pos, loc, [], torch.tensor([0]), None, dec_plan[:6])
    with pytest.raises(RuntimeError, match="ext_tok must be given exactly when ext is"):
        op(held, ids, pos, loc, [], torch.tensor([0]), torch.tensor([1, 2]), dec_plan)
    with pytest.raises(RuntimeError, match="must cover the 3 tokens"):
        op(held, ids, pos, loc, [], torch.tensor([0]), None, dec_plan)
    with pytest.raises(RuntimeError, match="one row per dec_tok"):
        op(held, ids, pos, loc, [], torch.tensor([0, 1, 2]), None, dec_plan)
    int8 = _runner(tmp_path, torch.float32, kv_dtype=torch.int8)
    kv8 = int8.kv_pool
    held8 = stack._stack_for(model.embed_tokens, model.rotary.cos, model.rotary.sin, model.norm,
                             model.config.rms_norm_eps, kv8.k_buffer, kv8.v_buffer, kv8.k_scale,
                             kv8.v_scale)
    with pytest.raises(RuntimeError, match="int8 pool takes the layer loop"):
        op(held8, ids, pos, loc, ext, None, None, [])
    kv.check_invariants()
    row = runner.new_request()
    assert torch.isfinite(runner.extend([row], [[9, 10, 11, 12]])).all()
    kv.check_invariants()
    runner.req_pool.check_invariants()
