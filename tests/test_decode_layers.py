"""`radixrt::decode_layers` (`model/decode_layers.py`): a decode step's layers in one C++ call.

It calls the same ops as the Python layer loop in the same order, so the logits must be bitwise
the loop's: dense fp32 / bf16 with biases (Qwen2), GGUF Q4_1 + Q8_0 on the qgemv or the vnni
kernel with the dense copy taking the calls above `max_rows`, rows sharing a cached prefix (cascade groups
in the plan) beside an unrelated row, the vnni down projection fused with SiLU-mul in the op. Then: the cases that must fall back to the loop, the
switch, and bad arguments to the op.
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
    write_tiny_gguf,
)

from radixrt.attention import cpu_kernels
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.model.decode_layers import DecodeLayers
from radixrt.model.layer_ops import TorchLayerOps
from radixrt.model.loader import load_model
from radixrt.model.model_config import ModelConfig
from radixrt.model.quant import QuantPlan
from radixrt.model.quant_matmul import resolve_quant_kernel, vnni_kernel_available


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _runner(path: Path, dtype: torch.dtype, quant: QuantPlan | None = None) -> PagedRunner:
    config = ModelConfig.from_path(path)
    model, _ = load_model(path, None, dtype, "cpu", model_config=config, quant=quant)
    return PagedRunner.for_model(model)


def _decode_run(runner: PagedRunner, fused: bool, monkeypatch: pytest.MonkeyPatch,
                prefix_len: int = 40, lone_len: int = 9,
                own_len: int = 0) -> tuple[list[torch.Tensor], int]:
    """Three requests sharing a `prefix_len`-token cached prefix plus an unrelated one of
    `lone_len` tokens (with `own_len`: four unrelated requests of `own_len` tokens instead),
    then 4 greedy decode steps: (per-step logits, how many steps ran through
    `DecodeLayers.run_step`; the split row of each is in `_decode_run.splits`)."""
    runner.model.fused_decode = fused
    calls = []
    real = DecodeLayers.run_step

    def counted(self: DecodeLayers, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("split", 0))
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeLayers, "run_step", counted)
    g = torch.Generator().manual_seed(3)
    if own_len:
        rows = [runner.new_request() for _ in range(4)]
        tails = [torch.randint(3, 256, (own_len,), generator=g).tolist() for _ in rows]
    else:
        prefix = torch.randint(3, 256, (prefix_len,), generator=g).tolist()
        first = runner.new_request()
        runner.extend([first], [prefix])
        rows = [runner.share_prefix(first, prefix_len) for _ in range(3)] + [runner.new_request()]
        tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 6, 1, lone_len)]
    logits = [runner.extend(rows, tails)]
    for _ in range(4):
        logits.append(runner.decode(rows, logits[-1].argmax(-1).tolist()))
    monkeypatch.setattr(DecodeLayers, "run_step", real)
    runner.kv_pool.check_invariants()
    runner.req_pool.check_invariants()
    _decode_run.splits = calls  # type: ignore[attr-defined]
    return logits[1:], len(calls)


@pytest.mark.parametrize("case", list(ONE_CALL_CASES))
def test_one_call_is_bitwise_the_layer_loop(tmp_path: Path, case: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # GGUF: 4 decode rows > max_rows_int4: the layers' 4-bit matmuls take the dense copy in the
    # op as in the loop (the kernels alone are covered below); the Q8_0 LM head stays on the
    # quantized kernel.
    path, dtype, plan = one_call_case_model(tmp_path, case)
    runs = {}
    for fused in (True, False):
        runner = _runner(path, dtype, plan)
        stack = runner.model.decode_layers()
        assert isinstance(stack, DecodeLayers), stack
        runs[fused] = _decode_run(runner, fused, monkeypatch)
    (fused_logits, fused_calls), (loop_logits, loop_calls) = runs[True], runs[False]
    assert (fused_calls, loop_calls) == (4, 0)
    for a, b in zip(fused_logits, loop_logits, strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("kernel", ["radixrt", "vnni", "vnni-hilo"])
def test_quantized_rows_under_max_rows_run_the_kernel_in_the_op(tmp_path: Path,
                                                                kernel: str) -> None:
    """Every matmul on the quantized kernel (no dense copy): one decode row at a time, bitwise
    the loop."""
    if resolve_quant_kernel("auto") != "radixrt":
        pytest.skip("radixrt's qgemv kernel unavailable")
    if kernel != "radixrt" and not vnni_kernel_available():
        pytest.skip("no AVX512-VNNI here")
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=9, num_hidden_layers=2)
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_0", "Q8_0")
    plan = QuantPlan("gguf", dense_copy=False, kernel=kernel)
    out = {}
    for fused in (True, False):
        runner = _runner(path, torch.bfloat16, plan)
        runner.model.fused_decode = fused
        row = runner.new_request()
        logits = [runner.extend([row], [[5, 9, 11, 200, 17]])]
        for _ in range(3):
            logits.append(runner.decode([row], logits[-1].argmax(-1).tolist()))
        out[fused] = torch.cat(logits)
    assert torch.equal(out[True], out[False])


def _tiny_vnni_gguf(tmp_path: Path, seed: int, layer_quant: str, kernel: str = "vnni",
                    **dims: int) -> tuple[Path, QuantPlan]:
    """A 3-layer tiny Llama (tied embeddings; `dims` override TINY_DIMS) as GGUF,
    `layer_quant` layers and a Q8_0 head, with every matmul on the vnni kernel (`kernel`:
    "vnni" or "vnni-hilo"; skips where there is no AVX512-VNNI)."""
    if not vnni_kernel_available():
        pytest.skip("no AVX512-VNNI here")
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=seed, num_hidden_layers=3,
                              tie_word_embeddings=True, **dims)
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", layer_quant, "Q8_0")
    return path, QuantPlan("gguf", dense_copy=False, kernel=kernel)


@pytest.mark.parametrize("kernel", ["vnni", "vnni-hilo"])
def test_vnni_down_projection_takes_the_silu_input_bitwise_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Every matmul on the vnni kernel at 4 decode rows (Q4_1 layers, Q8_0 head): in the op the
    down projection runs `qgemm_vnni_silu` on gate_up (no `silu_mul`), the loop `silu_mul` then
    `qgemm_vnni`; the logits are bitwise equal. With vnni-hilo's two terms too."""
    path, plan = _tiny_vnni_gguf(tmp_path, 5, "Q4_1", kernel)
    runs, ops = {}, {}
    for fused in (True, False):
        runner = _runner(path, torch.bfloat16, plan)
        runner.model.decode_team = False  # a team calls every op once per thread
        runner.model.fused_extend = False  # the extend step in the loop in both runs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runs[fused] = _decode_run(runner, fused, monkeypatch)
        ops[fused] = {e.key: e.count for e in prof.key_averages()}
    (fused_logits, fused_calls), (loop_logits, loop_calls) = runs[True], runs[False]
    assert (fused_calls, loop_calls) == (4, 0)
    # 4 decode steps x 3 layers fused; the extend steps (Python loop) call silu_mul in both runs
    fused_silu = ops[True].get("radixrt::qgemm_vnni_silu", 0)
    assert (fused_silu, ops[False].get("radixrt::qgemm_vnni_silu", 0)) == (12, 0)
    assert ops[True].get("radixrt::silu_mul", 0) == ops[False]["radixrt::silu_mul"] - 12
    for a, b in zip(fused_logits, loop_logits, strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


def test_steps_the_op_cannot_run_take_the_loop(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "llama", seed=2, num_hidden_layers=2)
    runner = _runner(tmp_path, torch.float32)
    model = runner.model
    assert isinstance(model.decode_layers(), DecodeLayers)
    # torch's layer ops: no C++ path for them
    model.set_layer_ops(TorchLayerOps())
    assert "layer ops are torch" in str(model.decode_layers())
    # the gather path for decode attention: no paged-decode plan for the op
    model2 = _runner(tmp_path, torch.float32).model
    backend = TorchNativeBackend(model2.attn_backend.kv_pool, decode_kernel=False)
    model2.attn_backend = backend
    r2 = PagedRunner.for_model(model2)
    r2.model.attn_backend = backend
    row = r2.new_request()
    r2.extend([row], [[4, 5, 6]])
    called = []
    real = DecodeLayers.run_step
    DecodeLayers.run_step = (  # type: ignore[method-assign]
        lambda self, *a, **k: called.append(1) or real(self, *a, **k))  # type: ignore
    try:
        r2.decode([row], [7])
    finally:
        DecodeLayers.run_step = real  # type: ignore[method-assign]
    assert called == []


@pytest.mark.parametrize("disable", [False, True])
def test_server_args_switch(tmp_path: Path, disable: bool) -> None:
    runner = make_tiny_runner(tmp_path, disable_fused_decode=disable)
    assert runner.model.fused_decode is (not disable)


@pytest.mark.parametrize("disable", [True, False])
def test_server_args_set_team_steal(tmp_path: Path, disable: bool, team_steal: object) -> None:
    """`disable_team_steal` reaches the process's team setting as the runner starts (the op's
    mode: 0 off, 1 on), whatever it was before."""
    torch.ops.radixrt.decode_team_steal(1 if disable else 0)
    runner = make_tiny_runner(tmp_path, disable_team_steal=disable)
    assert isinstance(runner.model.decode_layers(), DecodeLayers)
    assert torch.ops.radixrt.decode_team_steal()[0] == (0 if disable else 1)
    assert ("(static shares)" in runner.model.decode_path()) is (
        disable and torch.get_num_threads() >= 2 and runner.model.decode_layers().team_capable)


def _direct_args(tmp_path: Path, kv_indices: list[int], vnni: bool = False
                 ) -> tuple[list[object], DecodeLayers, PagedRunner]:
    """Arguments of a direct `radixrt::decode_layers` call (no `split`) on a 2-layer tiny model
    (fp32 dense, or `vnni`: bf16 with GGUF Q4_0 / Q8_0 matmuls on the vnni kernel): one row per
    entry of `kv_indices`, row b writing slot b + 1 and attending over `kv_indices[b]` alone."""
    hf = make_tiny_checkpoint(tmp_path, "llama", seed=4, num_hidden_layers=2)
    dtype = torch.bfloat16 if vnni else torch.float32
    if vnni:
        path = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_0", "Q8_0")
        runner = _runner(path, dtype, QuantPlan("gguf", dense_copy=False, kernel="vnni"))
    else:
        runner = _runner(tmp_path, dtype)
    stack = runner.model.decode_layers()
    assert isinstance(stack, DecodeLayers)
    kv, n = runner.kv_pool, len(kv_indices)
    h = torch.randn(n, runner.model.config.hidden_size,
                    generator=torch.Generator().manual_seed(0)).to(dtype)
    cs = torch.zeros(n, runner.model.config.head_dim, dtype=dtype)
    empty = torch.zeros(0, dtype=torch.int64)
    args = [h, cs, cs, stack.norms, stack.weights, stack.meta, kv.k_buffer, kv.v_buffer, [], [],
            torch.arange(1, n + 1), torch.tensor(kv_indices, dtype=torch.int32),
            torch.arange(n), torch.ones(n, dtype=torch.int64), empty, empty,
            torch.zeros(1, dtype=torch.int64), empty, stack.num_heads, stack.num_kv_heads,
            stack.head_dim, stack.eps, stack.scale]
    return args, stack, runner


def test_bad_arguments_raise_naming_them(tmp_path: Path) -> None:
    args, stack, runner = _direct_args(tmp_path, [1])
    kv, h = runner.kv_pool, args[0]
    op = torch.ops.radixrt.decode_layers
    bad_scales = list(args)
    bad_scales[8] = kv.k_buffer[:1]
    with pytest.raises(RuntimeError, match="k_scales and v_scales"):
        op(*bad_scales)
    bad_norms = list(args)
    bad_norms[3] = stack.norms[:-1]
    with pytest.raises(RuntimeError, match="norms must hold 2 weights per layer"):
        op(*bad_norms)
    bad_meta = list(args)
    bad_meta[5] = stack.meta[:-1]
    with pytest.raises(RuntimeError, match="meta must hold"):
        op(*bad_meta)
    bad_kv = list(args)
    bad_kv[7] = kv.v_buffer[:-1]
    with pytest.raises(RuntimeError, match="k_buffers and v_buffers"):
        op(*bad_kv)
    # well-formed: runs, one row out
    out, res = op(*args)
    assert out.shape == h.shape and res.shape == h.shape
    # decode_step: its step-invariant arguments in one DecodeStack, checked when built
    model = runner.model
    ends = [model.embed_tokens, model.rotary.cos, model.rotary.sin, model.norm, 1e-5]
    shape = [stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.eps, stack.scale]
    with pytest.raises(RuntimeError, match="norms must hold 2 weights per layer"):
        torch.classes.radixrt.DecodeStack(*ends, stack.norms[:-1], stack.weights, stack.meta,
                                          kv.k_buffer, kv.v_buffer, [], [], *shape)
    held = torch.classes.radixrt.DecodeStack(*ends, stack.norms, stack.weights, stack.meta,
                                             kv.k_buffer, kv.v_buffer, [], [], *shape)
    plan_args = args[10:18]
    with pytest.raises(RuntimeError, match="ids and positions must be 1-D with one entry"):
        torch.ops.radixrt.decode_step(held, torch.tensor([3]), torch.tensor([0, 1]), *plan_args)
    last = torch.ops.radixrt.decode_step(held, torch.tensor([3]), torch.tensor([0]), *plan_args)
    assert last.shape == h.shape


def test_run_step_keeps_its_stack_until_an_argument_changes(tmp_path: Path) -> None:
    """run_step builds its DecodeStack once and reuses it; another buffer list (another pool)
    or table gets a new one."""
    args, stack, runner = _direct_args(tmp_path, [1])
    kv, model = runner.kv_pool, runner.model
    ends = (model.embed_tokens, model.rotary.cos, model.rotary.sin, model.norm, 1e-5)
    first = stack._stack_for(*ends, kv.k_buffer, kv.v_buffer, kv.k_scale, kv.v_scale)
    assert stack._stack_for(*ends, kv.k_buffer, kv.v_buffer, kv.k_scale, kv.v_scale) is first
    other = stack._stack_for(*ends, list(kv.k_buffer), kv.v_buffer, kv.k_scale, kv.v_scale)
    assert other is not first
    cos = model.rotary.cos.clone()
    assert stack._stack_for(ends[0], cos, *ends[2:], list(kv.k_buffer), kv.v_buffer,
                            kv.k_scale, kv.v_scale) is not other


@pytest.fixture
def two_threads() -> object:
    """torch with 2 intra-op threads (the micro-batches' condition), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


SPLIT_CASES = {
    "llama-bf16-gguf-qgemv": ("llama", torch.bfloat16, "radixrt", None),
    "llama-bf16-gguf-vnni": ("llama", torch.bfloat16, "vnni", None),
    "llama-bf16-gguf-vnni-int8-kv": ("llama", torch.bfloat16, "vnni", torch.int8),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_micro_batches_are_bitwise_one_batch(tmp_path: Path, case: str, two_threads: object,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two micro-batches (rows [0, 2) and [2, 4): the shared-prefix group of rows 0-2 is cut in
    two) give the logits of one pass over the 4 rows, bitwise, on float and int8 pools."""
    from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason

    kind, dtype, quant, kv_dtype = SPLIT_CASES[case]
    if quant == "vnni" and not vnni_kernel_available():
        pytest.skip("no AVX512-VNNI here")
    if resolve_quant_kernel("auto") != "radixrt":
        pytest.skip("radixrt's qgemv kernel unavailable")
    if kv_dtype is torch.int8 and paged_decode_i8_unavailable_reason():
        pytest.skip(str(paged_decode_i8_unavailable_reason()))
    hf = make_tiny_checkpoint(tmp_path / "hf", kind, seed=11, num_hidden_layers=3,
                              tie_word_embeddings=True)
    path, plan = tmp_path / "hf", None
    if quant is not None:
        path = write_tiny_gguf(hf, tmp_path / "m.gguf", kind, "Q4_0", "Q8_0")
        plan = QuantPlan("gguf", dense_copy=False, kernel=quant)
    runs, splits = {}, {}
    for least in (2, 0):
        config = ModelConfig.from_path(path)
        model, _ = load_model(path, None, dtype, "cpu", model_config=config, quant=plan)
        runner = PagedRunner.for_model(model, kv_dtype=kv_dtype)
        runner.model.decode_microbatch_rows = least
        runner.model.decode_path_tuner = None  # always split from `least` rows
        runs[least] = _decode_run(runner, True, monkeypatch)
        splits[least] = list(_decode_run.splits)  # type: ignore[attr-defined]
    assert runner.model.decode_layers().row_invariant  # type: ignore[union-attr]
    assert splits == {2: [2] * 4, 0: [0] * 4}
    for a, b in zip(runs[2][0], runs[0][0], strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


def test_decode_split_policy(tmp_path: Path, two_threads: object) -> None:
    if resolve_quant_kernel("auto") != "radixrt":
        pytest.skip("radixrt's qgemv kernel unavailable")
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=4, num_hidden_layers=1)
    # dense fp32 matmuls: torch's GEMM need not give a row the same bits at every row count
    dense = _runner(tmp_path / "hf", torch.float32).model
    assert dense.decode_layers().row_invariant is False  # type: ignore[union-attr]
    assert dense.decode_split(64) == 0
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_0", "Q8_0")
    model = _runner(path, torch.bfloat16, QuantPlan("gguf", dense_copy=False)).model
    # a dense copy for large row counts: a micro-batch could take the other path
    with_copy = _runner(path, torch.bfloat16, QuantPlan("gguf", max_rows_int4=2)).model
    assert with_copy.decode_split(64) == 0
    model.decode_microbatch_rows = 16
    one = ("one pass as a team of threads" if model.decode_layers().team_capable  # type: ignore[union-attr]
           else "one pass with a parallel region per op (a matmul is not on the vnni kernel)")
    timed = (" or the team pass, whichever is faster when timed"
             if model.decode_layers().team_capable  # type: ignore[union-attr]
             else " or one pass, whichever is faster when timed")
    assert model.decode_path() == f"one C++ call, {one}, two micro-batches from 16 rows{timed}"
    model.decode_path_tuner = None
    assert model.decode_path() == f"one C++ call, {one}, two micro-batches from 16 rows"
    assert "not on radixrt's row-invariant kernels" in dense.decode_path()
    assert "a matmul is not on the vnni kernel" in dense.decode_path()
    assert [model.decode_split(n) for n in (1, 15, 16, 17, 64)] == [0, 0, 8, 8, 32]
    model.decode_microbatch_rows = 0
    assert model.decode_split(64) == 0
    model.decode_microbatch_rows = 16
    torch.set_num_threads(1)  # one thread: nothing to overlap with
    assert model.decode_split(64) == 0
    torch.set_num_threads(3)  # more: the ops inside a micro-batch would run on one thread
    assert model.decode_split(64) == 0
    assert model.decode_path() == f"one C++ call, {one} (no micro-batches: 3 threads, not 2)"
    model.decode_team = False
    assert model.decode_path() == ("one C++ call, one pass with a parallel region per op (team "
                                   "disabled) (no micro-batches: 3 threads, not 2)")


@pytest.mark.parametrize("value", [0, 32])
def test_server_args_set_the_micro_batch_rows(tmp_path: Path, value: int) -> None:
    runner = make_tiny_runner(tmp_path, decode_microbatch_rows=value)
    assert runner.model.decode_microbatch_rows == value


def test_negative_micro_batch_rows_are_refused() -> None:
    from radixrt.config import ServerArgs

    with pytest.raises(ValueError, match="decode_microbatch_rows"):
        ServerArgs(decode_microbatch_rows=-1)


def test_micro_batch_errors_raise_and_do_not_hang(tmp_path: Path, two_threads: object) -> None:
    """A bad split is refused naming it; an error inside the first micro-batch (a slot out of
    the pool) reaches the caller while the second, which waits on the first's progress, still
    finishes (no hang). Each call gets a fresh model and pool (the same seeded weights)."""
    calls: list[int] = []

    def call(split: int, kv_indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        args, _, _ = _direct_args(tmp_path / str(len(calls)), kv_indices)
        calls.append(split)
        return torch.ops.radixrt.decode_layers(*args, split)

    for bad in (-1, 2):
        with pytest.raises(RuntimeError, match="split must be in"):
            call(bad, [1, 2])
    with pytest.raises(RuntimeError, match="kv slot 99999 out of range"):
        call(1, [99999, 2])
    # a malformed group plan, found as each micro-batch cuts its rows' plan inside the region
    args, _, _ = _direct_args(tmp_path / "bad-groups", [1, 2])
    args[16] = torch.zeros(3, dtype=torch.int64)  # group_row_ptr of a plan with no group
    with pytest.raises(RuntimeError, match="group_row_ptr must have one entry more"):
        torch.ops.radixrt.decode_layers(*args, 1)
    one, res1 = call(0, [1, 2])
    two, res2 = call(1, [1, 2])
    # dense fp32 matmuls here: equal up to torch's GEMM rounding at another row count
    torch.testing.assert_close(one, two)
    torch.testing.assert_close(res1, res2)


# (model dims over TINY_DIMS, shared prefix, lone row, own rows: _decode_run). At "tiny" the
# matmuls are too small to split (each runs on one member while the other waits); at "wide"
# every matmul splits its activation quantization and its tiles between the members. At
# "wide-own" (four equal unrelated rows) the attention's split falls on the members' rows, so
# kv_store and the attention end without the team meeting (attention_keeps_rows).
_WIDE = {"hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 8192}
_TEAM_CASES: dict[str, tuple[dict[str, int], int, int, int]] = {
    "tiny": ({}, 40, 9, 0),
    "wide": (_WIDE, 1500, 4500, 0),
    "wide-own": (_WIDE, 0, 0, 2500),
}
# (team, regions) thresholds of an attention phase's (query, key) pairs below which it runs on
# one thread (`radixrt::attention_parallel_work`): built in; never split (a team's first member
# runs every phase while the other waits, one thread per region); every phase split by cost
# (both attention phases, the shared prefix's and the rows' own keys, however small).
_THRESHOLDS: dict[str, tuple[int, int] | None] = {
    "built-in": None,
    "one-thread": (1 << 40, 1 << 40),
    "split-all": (0, 0),
}


@pytest.fixture
def attention_thresholds(request: pytest.FixtureRequest) -> object:
    """The attention thresholds of `_THRESHOLDS[request.param]`, restored after."""
    from radixrt.attention import cpu_kernels

    if not cpu_kernels.load_cpu_kernels():
        pytest.skip("the CPU kernels are not loaded")
    setting = _THRESHOLDS[request.param]
    before = torch.ops.radixrt.attention_parallel_work()
    if setting is not None:
        torch.ops.radixrt.attention_parallel_work(*setting)
    yield
    torch.ops.radixrt.attention_parallel_work(*before)


@pytest.mark.parametrize("attention_thresholds", sorted(_THRESHOLDS), indirect=True)
@pytest.mark.parametrize("case", sorted(_TEAM_CASES))
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["bf16-kv", "int8-kv"])
def test_team_is_bitwise_a_region_per_op(tmp_path: Path, kv_dtype: torch.dtype | None,
                                         case: str, two_threads: object,
                                         attention_thresholds: object,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass as a team of the 2 threads (each op then runs on both: its calls double) gives
    the logits of the pass with a parallel region per op, bitwise: 3 rows sharing a cached
    prefix (a cascade group) beside an unrelated one, on a bf16 and an int8 pool, whichever
    attention phases run on one thread. Each step attends over the K/V the steps before it
    stored, so the K rows each member stores right after rotating them (no meeting between RoPE
    and kv_store) are checked too. The team runs with its norms split by rows
    (`team_norms_whole` 0), whole on each member (1: each member's own residual stream and
    quantized rows), and as its placement probe picks (-1), and as two micro-batches inside the
    team's region (`team_far_split` 1, what a far placement picks from 8 rows)."""
    from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason

    dims, prefix_len, lone_len, own_len = _TEAM_CASES[case]
    if kv_dtype is torch.int8 and paged_decode_i8_unavailable_reason():
        pytest.skip(str(paged_decode_i8_unavailable_reason()))
    path, plan = _tiny_vnni_gguf(tmp_path, 13, "Q4_0", **dims)
    runs, ropes = {}, {}
    splits = {}  # team steps run as two micro-batches during each run
    for team, whole, far in ((False, -1, 0), (True, 0, 0), (True, 1, 0), (True, -1, -1),
                             (True, -1, 1), (True, -1, 2)):
        config = ModelConfig.from_path(path)
        model, _ = load_model(path, None, torch.bfloat16, "cpu", model_config=config, quant=plan)
        runner = PagedRunner.for_model(model, kv_size=12288, max_context=8192, kv_dtype=kv_dtype)
        runner.model.decode_team = team
        # one pass, micro-batches not off; far 2: far_split 1 with micro-batches off (0), which
        # the model then passes as 0
        runner.model.decode_microbatch_rows = 0 if far == 2 else 1 << 30
        stack = runner.model.decode_layers()
        assert isinstance(stack, DecodeLayers) and stack.team_capable
        stack.team_norms_whole = whole
        stack.team_far_split = min(far, 1)
        before = torch.ops.radixrt.decode_team_microbatch_steps()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runs[team, whole, far] = _decode_run(runner, True, monkeypatch, prefix_len,
                                                 lone_len, own_len)
        splits[team, whole, far] = torch.ops.radixrt.decode_team_microbatch_steps() - before
        ropes[team, whole, far] = {e.key: e.count for e in prof.key_averages()}.get(
            "radixrt::rope_qk", 0)
    region = runs[False, -1, 0]
    assert region[1] == 4
    # far_split 1: every decode step (4 rows) as two micro-batches, one per member of the team
    assert splits[True, -1, 1] == 4
    assert splits[True, 0, 0] == splits[True, 1, 0] == splits[True, -1, 2] == 0
    for key in ((True, 0, 0), (True, 1, 0), (True, -1, -1), (True, -1, 1), (True, -1, 2)):
        assert runs[key][1] == 4
        # the extend steps (Python loop) call rope_qk alike; the team's second thread (or the
        # second micro-batch), once per layer of each of the 4 decode steps
        assert ropes[key] - ropes[False, -1, 0] == 4 * 3
        for a, b in zip(runs[key][0], region[0], strict=True):
            assert torch.equal(a, b), f"{key}: max diff {(a - b).abs().max()}"


def test_team_on_vnni_hilo_is_bitwise_a_region_per_op(tmp_path: Path, two_threads: object,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """vnni-hilo's two terms per row in a team: its members quantize both terms of their own
    input rows (norms split by rows) or of every row (whole); the logits are bitwise those of a
    parallel region per op, and differ from the one-term kernel's."""
    runs = {}
    for kernel in ("vnni-hilo", "vnni"):
        path, plan = _tiny_vnni_gguf(tmp_path / kernel, 13, "Q4_0", kernel)
        for team, whole in ((False, -1), (True, 0), (True, 1)) if kernel != "vnni" else (
                (False, -1),):
            config = ModelConfig.from_path(path)
            model, _ = load_model(path, None, torch.bfloat16, "cpu", model_config=config,
                                  quant=plan)
            assert model.layers[0].qkv_proj.kernel.name == kernel
            runner = PagedRunner.for_model(model, kv_size=4096, max_context=2048)
            runner.model.decode_team = team
            runner.model.decode_microbatch_rows = 1 << 30  # one pass
            stack = runner.model.decode_layers()
            assert isinstance(stack, DecodeLayers) and stack.team_capable
            stack.team_norms_whole = whole
            stack.team_far_split = 0
            runs[kernel, team, whole] = _decode_run(runner, True, monkeypatch)
    region = runs["vnni-hilo", False, -1]
    assert region[1] == 4
    for key in (("vnni-hilo", True, 0), ("vnni-hilo", True, 1)):
        assert runs[key][1] == 4
        for a, b in zip(runs[key][0], region[0], strict=True):
            assert torch.equal(a, b), f"{key}: max diff {(a - b).abs().max()}"
    assert not torch.equal(region[0][-1], runs["vnni", False, -1][0][-1])


@pytest.mark.parametrize("team", [True, False], ids=["team", "region-per-op"])
def test_path_tuner_alternates_bitwise_alike(tmp_path: Path, two_threads: object,
                                             monkeypatch: pytest.MonkeyPatch, team: bool) -> None:
    """Where a step could run as two micro-batches or as one pass (a team pass, or a parallel
    region per op with the team disabled), the model's path tuner (`DecodePathTuner`) takes
    each in turn while it explores: the 4 decode steps of 4 rows (micro-batches from 2 rows
    here) alternate one pass, split, split, one pass; the logits are bitwise those of always
    splitting (no tuner), and the times it was given come as pairs."""
    from radixrt.model.decode_path_tuner import DecodePathTuner

    path, plan = _tiny_vnni_gguf(tmp_path, 13, "Q4_0")
    runs, splits = {}, {}
    for tuned in (False, True):
        config = ModelConfig.from_path(path)
        model, _ = load_model(path, None, torch.bfloat16, "cpu", model_config=config, quant=plan)
        runner = PagedRunner.for_model(model, kv_size=12288, max_context=8192)
        runner.model.decode_microbatch_rows = 2
        runner.model.decode_team = team
        stack = runner.model.decode_layers()
        assert isinstance(stack, DecodeLayers) and stack.team_capable
        tuner = DecodePathTuner(pairs=8) if tuned else None
        runner.model.decode_path_tuner = tuner
        runs[tuned] = _decode_run(runner, True, monkeypatch, own_len=20)
        splits[tuned] = _decode_run.splits  # type: ignore[attr-defined]
        if tuner is not None:
            assert tuner.choices() == {"4-5": "exploring"}
            assert len(tuner._buckets[tuner.bucket(4)].ratios) == 2
    assert splits[False] == [2, 2, 2, 2]
    assert splits[True] == [0, 2, 2, 0]
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


@pytest.fixture
def team_steal() -> object:
    """Restores the team's stealing settings (`radixrt::decode_team_steal`) after the test."""
    mode, slow_us, _ = torch.ops.radixrt.decode_team_steal()
    yield
    torch.ops.radixrt.decode_team_steal(mode, slow_us)


@pytest.mark.parametrize("attention_thresholds", ["split-all"], indirect=True)
@pytest.mark.parametrize("case", sorted(_TEAM_CASES))
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["bf16-kv", "int8-kv"])
def test_members_taking_items_is_bitwise_a_region_per_op(
        tmp_path: Path, kv_dtype: torch.dtype | None, case: str, two_threads: object,
        attention_thresholds: object, team_steal: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the team's second member slowed before each of its own items (`slow_us`), the first
    takes some of them (TeamMember::run_items): the matmuls' tiles and the attention's (row,
    head) items, including at "wide-own", where the attention ends without a meeting and the
    o projection reads the taken items' rows on their owner. The logits stay bitwise those of
    a parallel region per op, and `decode_team_steal`'s count of taken items rises; with
    stealing off (mode 0) nothing is taken, and the logits are the same. At "tiny" the matmuls
    run whole on the first member, so what is taken there is attention items (both phases
    split: thresholds "split-all")."""
    from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason

    dims, prefix_len, lone_len, own_len = _TEAM_CASES[case]
    if kv_dtype is torch.int8 and paged_decode_i8_unavailable_reason():
        pytest.skip(str(paged_decode_i8_unavailable_reason()))
    path, plan = _tiny_vnni_gguf(tmp_path, 13, "Q4_0", **dims)
    runs, taken = {}, {}
    for team, mode in ((False, 1), (True, 1), (True, 0)):
        config = ModelConfig.from_path(path)
        model, _ = load_model(path, None, torch.bfloat16, "cpu", model_config=config, quant=plan)
        runner = PagedRunner.for_model(model, kv_size=12288, max_context=8192, kv_dtype=kv_dtype)
        runner.model.decode_team = team
        runner.model.decode_microbatch_rows = 1 << 30  # one pass
        stack = runner.model.decode_layers()
        assert isinstance(stack, DecodeLayers) and stack.team_capable
        stack.team_far_split = 0
        before = torch.ops.radixrt.decode_team_steal(mode, 300)[2]
        runs[team, mode] = _decode_run(runner, True, monkeypatch, prefix_len, lone_len, own_len)
        taken[team, mode] = torch.ops.radixrt.decode_team_steal()[2] - before
    assert taken[True, 1] > 0
    assert taken[True, 0] == taken[False, 1] == 0
    region = runs[False, 1]
    for key in ((True, 1), (True, 0)):
        assert runs[key][1] == region[1] == 4
        for a, b in zip(runs[key][0], region[0], strict=True):
            assert torch.equal(a, b), f"{key}: max diff {(a - b).abs().max()}"


def _one_pass_runner(path: Path, plan: QuantPlan, kv_dtype: torch.dtype | None, team: bool,
                     kv_size: int, max_context: int, far_split: int = 0) -> PagedRunner:
    """A bf16 runner of the GGUF at `path` whose decode steps run as one pass (micro-batches
    off), as a team or with a parallel region per op, its team's `far_split` set."""
    config = ModelConfig.from_path(path)
    model, _ = load_model(path, None, torch.bfloat16, "cpu", model_config=config, quant=plan)
    runner = PagedRunner.for_model(model, kv_size=kv_size, max_context=max_context,
                                   kv_dtype=kv_dtype)
    runner.model.decode_team = team
    runner.model.decode_microbatch_rows = 1 << 30  # one pass
    stack = runner.model.decode_layers()
    assert isinstance(stack, DecodeLayers) and stack.team_capable
    stack.team_far_split = far_split
    return runner


@pytest.mark.parametrize("case", ["wide", "wide-own"])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["bf16-kv", "int8-kv"])
def test_team_row_parts_are_bitwise_a_region_per_op(
        tmp_path: Path, kv_dtype: torch.dtype | None, case: str, two_threads: object,
        team_steal: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every row's own keys in 32-key parts or more (`paged_decode_row_parts`, forced: built
    in only a batch with fewer than two (row, KV head) items per thread splits), the team's
    steps give the logits of a parallel region per op, bitwise: at "wide" (a cascade group,
    each grouped row's first part continuing from the prefix) the team meets after the parts
    and merges its share of the rows; at "wide-own" each member merges its own rows' parts
    without meeting (attention_keeps_rows counts the parts as paged_decode makes them), also
    when the first member takes some of the second's parts (`slow_us`)."""
    from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason

    dims, prefix_len, lone_len, own_len = _TEAM_CASES[case]
    if kv_dtype is torch.int8 and paged_decode_i8_unavailable_reason():
        pytest.skip(str(paged_decode_i8_unavailable_reason()))
    path, plan = _tiny_vnni_gguf(tmp_path, 13, "Q4_0", **dims)
    parts_before = torch.ops.radixrt.paged_decode_row_parts(32, 8, 1 << 20)
    runs, taken = {}, {}
    try:
        for team, slow_us in ((False, 0), (True, 0), (True, 300)):
            runner = _one_pass_runner(path, plan, kv_dtype, team, 12288, 8192)
            before = torch.ops.radixrt.decode_team_steal(1, slow_us)[2]
            runs[team, slow_us] = _decode_run(runner, True, monkeypatch, prefix_len, lone_len,
                                              own_len)
            taken[team, slow_us] = torch.ops.radixrt.decode_team_steal()[2] - before
    finally:
        torch.ops.radixrt.paged_decode_row_parts(*parts_before)
    assert taken[True, 300] > 0
    region = runs[False, 0]
    for key in ((True, 0), (True, 300)):
        assert runs[key][1] == region[1] == 4
        for a, b in zip(runs[key][0], region[0], strict=True):
            assert torch.equal(a, b), f"{key}: max diff {(a - b).abs().max()}"


def test_team_steal_settings_are_checked(team_steal: object) -> None:
    """decode_team_steal refuses a mode or delay out of range, naming it, and leaves the
    settings as they were."""
    before = torch.ops.radixrt.decode_team_steal()
    with pytest.raises(RuntimeError, match="mode must be -1, 0 or 1"):
        torch.ops.radixrt.decode_team_steal(2)
    with pytest.raises(RuntimeError, match="slow_us must be in"):
        torch.ops.radixrt.decode_team_steal(-1, -5)
    assert torch.ops.radixrt.decode_team_steal()[:2] == before[:2]
    torch.ops.radixrt.decode_team_steal(0, 0)
    assert torch.ops.radixrt.decode_team_steal()[:2] == [0, 0]


def test_bench_op_swap_passes_every_step_argument(tmp_path: Path, two_threads: object,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/decode_step_ab.py `use` (through which decode_phases.py and team_waits.py run their
    rebuilt ops) calls a decode_layers op with every argument the model gives run_step: with the
    team forced to split each step into micro-batches (`team_far_split` 1), the swapped op
    splits them all too, and the logits are bitwise the model's own decode_step's."""
    from bench.decode_step_ab import use

    path, plan = _tiny_vnni_gguf(tmp_path, 13, "Q4_0")
    runs = {}
    for swapped in (False, True):
        config = ModelConfig.from_path(path)
        model, _ = load_model(path, None, torch.bfloat16, "cpu", model_config=config, quant=plan)
        runner = PagedRunner.for_model(model, kv_size=12288, max_context=8192)
        runner.model.decode_team = True
        runner.model.decode_microbatch_rows = 1 << 30  # one pass, micro-batches not off
        stack = runner.model.decode_layers()
        assert isinstance(stack, DecodeLayers) and stack.team_capable
        stack.team_far_split = 1
        if swapped:  # restored by monkeypatch at the end
            monkeypatch.setattr(DecodeLayers, "run_step", DecodeLayers.run_step)
            use(torch.ops.radixrt.decode_layers)
        before = torch.ops.radixrt.decode_team_microbatch_steps()
        runs[swapped] = _decode_run(runner, True, monkeypatch)
        assert torch.ops.radixrt.decode_team_microbatch_steps() - before == 4
    assert runs[True][1] == runs[False][1] == 4
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


def test_team_errors_raise_and_do_not_hang(tmp_path: Path, two_threads: object) -> None:
    """An error inside a team's pass (a kv slot out of the pool, seen by both threads) reaches
    the caller and leaves no thread waiting at a barrier; the next calls run, bitwise the same
    with and without the team. Each call gets a fresh model and pool (the same seeded
    weights)."""
    if not vnni_kernel_available():
        pytest.skip("no AVX512-VNNI here")
    calls: list[bool] = []

    def call(team: bool, kv_indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        args, stack, _ = _direct_args(tmp_path / str(len(calls)), kv_indices, vnni=True)
        assert stack.team_capable
        calls.append(team)
        return torch.ops.radixrt.decode_layers(*args, 0, team)

    with pytest.raises(RuntimeError, match="kv slot 99999 out of range"):
        call(True, [99999, 2])
    (h1, r1), (h2, r2) = call(True, [1, 2]), call(False, [1, 2])
    assert torch.equal(h1, h2) and torch.equal(r1, r2)


# -- several tokens of one request in one decode step ---------------------------------------------
def _multi_token_run(runner: PagedRunner, chunks: list[list[int]], prompts: list[list[int]]
                     ) -> torch.Tensor:
    """Each request's prompt as one extend, then one decode step computing `chunks[i]` for
    request i (`PagedRunner.decode_rows`): that step's logits, one row per token."""
    rows = [runner.new_request() for _ in prompts]
    runner.extend(rows, prompts)
    logits = runner.decode_rows(rows, chunks)
    runner.kv_pool.check_invariants()
    runner.req_pool.check_invariants()
    return logits


@pytest.mark.parametrize("fused", [True, False], ids=["one-call", "layer-loop"])
def test_multi_token_decode_rows_equal_the_extend(tmp_path: Path, fused: bool) -> None:
    """A decode step whose requests compute several tokens each (grammar-forced runs, draft
    tokens), one row per token over the request's table row, gives each token the logits the
    extend of the same tokens gives it (fp32, both paths through the layers; a request sharing
    a cached prefix with another, so the plan groups their rows)."""
    make_tiny_checkpoint(tmp_path / "hf", "llama", seed=5, num_hidden_layers=3)
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, 256, (40,), generator=g).tolist()
    prompts = [head + [7, 8], torch.randint(3, 256, (9,), generator=g).tolist(), head + [9]]
    chunks = [[11, 12, 13, 14], [21], [31, 32]]
    out = {}
    for how in ("decode_rows", "extend"):
        runner = PagedRunner.create(tmp_path / "hf", dtype=torch.float32)
        runner.model.fused_decode = fused
        rows = [runner.new_request() for _ in prompts]
        runner.extend(rows, prompts)
        if how == "decode_rows":
            out[how] = runner.decode_rows(rows, chunks)
        else:
            out[how] = runner.extend(rows, chunks, all_positions=True)
        runner.kv_pool.check_invariants()
    assert out["decode_rows"].shape == (7, out["extend"].shape[1])
    torch.testing.assert_close(out["decode_rows"], out["extend"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_thresholds", ["split-all"], indirect=True)
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["bf16-kv", "int8-kv"])
def test_team_and_micro_batches_keep_dependent_rows_apart(
        tmp_path: Path, two_threads: object, attention_thresholds: object,
        kv_dtype: torch.dtype | None) -> None:
    """Rows of one request read the K/V its earlier rows store in the same layer. A team whose
    members keep their rows through kv_store and the attention (no groups, work split by rows)
    would read them before they are stored where a request's rows straddle the members, and a
    micro-batch boundary inside a request would too: the step's logits must be bitwise those of
    a parallel region per op, the team's micro-batches split only between requests (and not at
    all when one request holds every row)."""
    from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason

    if kv_dtype is torch.int8 and paged_decode_i8_unavailable_reason():
        pytest.skip(str(paged_decode_i8_unavailable_reason()))
    path, plan = _tiny_vnni_gguf(tmp_path, 13, "Q4_0")
    g = torch.Generator().manual_seed(4)
    # Rows A0 A1 A2 B0 attend over 21, 22, 23 and 20 keys: the members' halves by rows (A0 A1 |
    # A2 B0) are their halves by attention work, so a team would keep its rows through the
    # attention, and A2 on the second member reads the K/V of A1, stored by the first.
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 19)]
    layouts = {
        "straddling": ([[5, 6, 7], [9]], prompts),  # a split at 2 rows would be inside A
        "one-request": ([[5, 6, 7, 8, 9]], prompts[:1]),
    }
    for name, (chunks, reqs) in layouts.items():
        runs, splits = {}, {}
        for team, far in ((False, 0), (True, 0), (True, 1)):
            runner = _one_pass_runner(path, plan, kv_dtype, team, 4096, 512, far)
            before = torch.ops.radixrt.decode_team_microbatch_steps()
            runs[team, far] = _multi_token_run(runner, chunks, reqs)
            splits[team, far] = torch.ops.radixrt.decode_team_microbatch_steps() - before
        # far_split 1 splits the straddling rows between the requests (at row 3), never inside
        # the one request's rows
        assert splits[True, 1] == (1 if name == "straddling" else 0), name
        for key in ((True, 0), (True, 1)):
            a, b = runs[key], runs[False, 0]
            assert torch.equal(a, b), f"{name} {key}: max diff {(a - b).abs().max()}"


def test_linear_kinds_are_the_ops() -> None:
    """The kinds `DecodeLayers` writes into meta are the ones decode_layers.cpp reads."""
    from radixrt.model.decode_layers import KIND_DENSE, KIND_QGEMV, KIND_VNNI, KIND_VNNI_HILO

    src = (Path(cpu_kernels.__file__).parent / "csrc" / "decode_layers.cpp").read_text()
    assert (f"constexpr int64_t kKindDense = {KIND_DENSE}, kKindQgemv = {KIND_QGEMV}, "
            f"kKindVnni = {KIND_VNNI}, kKindVnniHilo = {KIND_VNNI_HILO};") in src
