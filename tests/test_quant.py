"""Quantized weights: GGUF blocks kept exactly, the int4 kernel's packing, quantized models
against fp32, the row-count dispatch, and the `quantization` choice (injected probe timings,
never this CPU's)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import PagedRunner, make_tiny_checkpoint, write_tiny_gguf

from radixrt.cli import add_server_args, args_from_namespace
from radixrt.config import ServerArgs
from radixrt.model.linear import DenseWeight, QuantizedWeight
from radixrt.model.loader import GGUFLoader, default_model_path, load_model
from radixrt.model.model_config import ModelConfig
from radixrt.model.quant import (
    EVERY_CALL,
    GGUFQuantTensor,
    Int4Groups,
    QuantPlan,
    quantize_int4,
    quantize_int8,
)
from radixrt.model.quant_matmul import (
    TiledQuantMatmul,
    TorchInt4Matmul,
    quant_kernel_candidates,
    resolve_quant_kernel,
    vnni_kernel_available,
)
from radixrt.model.quant_probe import ENV_FORCE, QuantProbe, resolve_quantization

CPU = torch.device("cpu")
BF16_EPS = 2.0**-8  # relative rounding of bf16 (8 significant bits), with a factor 2 of slack


def _gguf_tensor(w: np.ndarray, qtype: str) -> GGUFQuantTensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(w.astype(np.float32), GGMLQuantizationType[qtype])
    return GGUFQuantTensor(qtype, raw, tuple(w.shape))  # type: ignore[arg-type]


KERNELS = ["torch", "radixrt"]  # radixrt's is skipped where its library does not build


def _kernel(name: str) -> str:
    if name == "radixrt" and resolve_quant_kernel("auto") != "radixrt":
        pytest.skip("radixrt's CPU kernel library is unavailable")
    return name


def _kernel_weight(groups: Int4Groups) -> torch.Tensor:
    """The weight torch's int4 kernel computes with: run it on identity inputs."""
    n, k = groups.shape
    qw = QuantizedWeight.from_groups(groups, kernel="torch")
    return qw(torch.eye(k, dtype=torch.bfloat16)).t().float()


# -- packing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_map_exactly_onto_int4_groups(qtype: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    t = _gguf_tensor(w, qtype)
    ref = t.dequantize()  # gguf.quants.dequantize
    g = t.to_groups()
    assert g.planes == (2 if qtype == "Q8_0" else 1)
    # Exact before the kernel's bf16 scales ...
    assert torch.equal(g.dequantize(scale_dtype=None), ref)
    # ... and within the rounding of each group's scale and zero to bf16 after.
    s, z = g.scale.abs().sum(0), g.zero.abs().sum(0)
    bound = (8 * s + z).repeat_interleave(32, -1) * 2.0**-8
    assert ((g.dequantize() - ref).abs() <= bound + 1e-12).all()
    # The packed form: the kernel computes exactly `dequantize()` (rounded to bf16 on output).
    assert torch.equal(_kernel_weight(g), g.dequantize().bfloat16().float())


def test_rope_row_permutation_on_blocks_equals_permuting_the_dequantized_rows() -> None:
    from radixrt.model.loader import _unpermute_rope_rows

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    t = _gguf_tensor(w, "Q4_1")
    order = _unpermute_rope_rows(np.arange(64), n_head=4)
    assert not np.array_equal(order, np.arange(64))
    moved = t.take_rows(order)
    assert torch.equal(moved.dequantize(), torch.from_numpy(
        _unpermute_rope_rows(t.dequantize().numpy(), n_head=4)))


def test_default_gguf_tensors_decode_exactly() -> None:
    """The shipped SmolLM2 file: a Q4_1 layer and the Q8_0 token embedding."""
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("default model not installed")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    wanted = {"blk.0.attn_q.weight": "Q4_1", "blk.0.ffn_down.weight": "Q4_1",
              "token_embd.weight": "Q8_0"}
    for t in reader.tensors:
        if t.name in wanted:
            assert t.tensor_type.name == wanted.pop(t.name)
            qt = GGUFQuantTensor(t.tensor_type.name, np.asarray(t.data),
                                 (int(t.shape[1]), int(t.shape[0])))
            assert torch.equal(qt.to_groups().dequantize(scale_dtype=None), qt.dequantize())
    assert not wanted


@pytest.mark.parametrize("quantize,bits", [(quantize_int4, 4), (quantize_int8, 8)])
def test_round_to_nearest_quantizers(quantize, bits: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g) * torch.rand(32, 1, generator=g)
    w[3, :32] = 0.0  # an all-zero group stays exactly zero
    q = quantize(w)
    assert q.bits == bits
    deq = q.dequantize(scale_dtype=None)
    grp = w.reshape(32, 4, 32)
    spread = (grp.amax(-1) - grp.amin(-1)) if bits == 4 else 2 * grp.abs().amax(-1)
    levels = 15 if bits == 4 else 254
    err = (deq - w).abs().reshape(32, 4, 32).amax(-1)
    assert (err <= spread / levels / 2 * (1 + 1e-5) + 1e-7).all()  # half a step
    assert torch.equal(deq[3, :32], torch.zeros(32))


# -- the kernel against the dequantized fp32 matmul -------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_quantized_matmul_matches_dequantized_fp32_within_bf16_rounding(kernel: str, bits: int,
                                                                        rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 96, generator=g)
    groups = quantize_int4(w) if bits == 4 else quantize_int8(w)
    qw = QuantizedWeight.from_groups(groups, kernel=_kernel(kernel))
    assert qw.kernel.name == kernel and qw.bits == bits
    x = torch.randn(rows, 96, generator=g)
    bias = torch.randn(64, generator=g)
    deq = groups.dequantize(qw.kernel.scale_dtype)
    ref = x @ deq.t() + bias
    y = qw(x, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    bound = BF16_EPS * (x.abs() @ deq.abs().t() + ref.abs()) + 1e-6
    assert ((y - ref).abs() <= bound).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_above_max_rows_and_invariant_calls_use_the_dense_copy(kernel: str) -> None:
    """A dense copy made deliberately different (zeros) shows which path each call took."""
    g = torch.Generator().manual_seed(0)
    groups = quantize_int4(torch.randn(32, 64, generator=g))
    qw = QuantizedWeight.from_groups(groups, dense=torch.zeros(32, 64), max_rows=4,
                                     kernel=_kernel(kernel))
    x = torch.randn(8, 64, generator=g)
    assert qw(x[:4]).abs().sum() > 0  # <= max_rows: the kernel
    assert torch.equal(qw(x[:5]), torch.zeros(5, 32))  # above: the dense copy
    assert torch.equal(qw(x[:2], invariant=True), torch.zeros(2, 32))  # invariant: dense
    assert qw.bytes_read(4) < qw.bytes_read(5) == 32 * 64 * 4


@pytest.mark.parametrize("kernel", KERNELS)
def test_invariant_kernel_calls_are_row_count_independent_below_16_rows(kernel: str) -> None:
    g = torch.Generator().manual_seed(0)
    qw = QuantizedWeight.from_groups(quantize_int8(torch.randn(32, 64, generator=g)),
                                     kernel=_kernel(kernel))
    x = torch.randn(12, 64, generator=g)
    one = qw(x[:1], invariant=True)
    for m in (2, 7, 12):
        assert torch.equal(qw(x[:m], invariant=True)[:1], one)


# -- tiny models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    d = tmp_path_factory.mktemp("tiny_quant")
    model = make_tiny_checkpoint(d, "llama", seed=3, tie_word_embeddings=True)
    with torch.no_grad():  # sharpen the logits so greedy is far from ties
        model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(str(d), safe_serialization=True)
    return model, d


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf: tuple[object, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's layout: Q4_1 matrices, a tied Q8_0 token embedding, permuted q/k."""
    model, _ = tiny_hf
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.Q4_1.gguf"
    return write_tiny_gguf(model, path, "llama", matrix_qtype="Q4_1", embd_qtype="Q8_0")


def test_gguf_loader_keeps_blocks_that_dequantize_to_the_fp32_loaders_tensors(
        tiny_gguf: Path) -> None:
    cfg = ModelConfig.from_path(tiny_gguf)
    dense = dict(GGUFLoader(tiny_gguf, cfg).iter_weights())
    kept = dict(GGUFLoader(tiny_gguf, cfg, keep_quantized=True).iter_weights())
    assert dense.keys() == kept.keys()
    kinds = {n: t.qtype for n, t in kept.items() if isinstance(t, GGUFQuantTensor)}
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert len(kinds) == 1 + 7 * cfg.num_layers  # every matrix; norms stay fp32
    for name, t in kept.items():
        got = t.dequantize() if isinstance(t, GGUFQuantTensor) else t
        assert torch.equal(got, dense[name]), name  # q/k rows un-permuted alike


def _teacher_forced_logits(model: object, ids: list[int]) -> torch.Tensor:
    """Logits at every position: a 4-token prefill, then one decode step per token (the
    decode steps run on the quantized kernels)."""
    r = PagedRunner.for_model(model)  # type: ignore[arg-type]
    row = r.new_request()
    out = [r.extend([row], [ids[:4]], all_positions=True)]
    out += [r.decode([row], [t]) for t in ids[4:]]
    return torch.cat(out)


def _greedy_ids(model: object, prompt: list[int], n: int) -> list[int]:
    r = PagedRunner.for_model(model)  # type: ignore[arg-type]
    row = r.new_request()
    nxt = int(r.extend([row], [prompt])[0].argmax())
    out = [nxt]
    for _ in range(n - 1):
        nxt = int(r.decode([row], [nxt])[0].argmax())
        out.append(nxt)
    return out


# Stated tolerances: max |logit - fp32 logit| over 57 positions of the tiny model (logits in
# about -3..6), measured 0.031 (int8, fp32 activations), 0.10 (int4), 0.028 (gguf Q4_1/Q8_0 with
# bf16 activations; bf16 alone: 0.020); asserted with a 3x margin.
LOGIT_TOL = {"int8": 0.1, "int4": 0.3, "gguf": 0.1}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_hf_model_quantized_at_load_stays_close_to_fp32(tiny_hf: tuple[object, Path],
                                                        mode: str) -> None:
    _, path = tiny_hf
    ref_model, _ = load_model(path, None, torch.float32, "cpu")
    plan = QuantPlan(mode, dense_copy=False)  # every matmul on the kernel
    q_model, _ = load_model(path, None, torch.float32, "cpu", quant=plan)
    assert isinstance(q_model.layers[0].qkv_proj, QuantizedWeight)
    assert q_model.layers[0].gate_up_proj.planes == (2 if mode == "int8" else 1)
    assert q_model.lm_head.planes == 2  # the LM head stays 8-bit in int4 mode
    ids = list(range(3, 60))
    ref = _teacher_forced_logits(ref_model, ids)
    got = _teacher_forced_logits(q_model, ids)
    tol = LOGIT_TOL[mode]
    assert (got - ref).abs().max() < tol
    if mode == "int8":
        # Greedy agrees wherever fp32's top-2 gap exceeds twice the bound (so it cannot flip).
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert clear.float().mean() > 0.8  # not vacuous
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
        for prompt in ([5, 17, 99], [200, 3, 3, 41, 8], [77]):
            assert _greedy_ids(q_model, prompt, 12) == _greedy_ids(ref_model, prompt, 12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_gguf_mode_keeps_the_files_blocks(tiny_gguf: Path, kernel: str) -> None:
    ref_model, _ = load_model(tiny_gguf, None, torch.float32, "cpu")
    plan = QuantPlan("gguf", max_rows_int4=1, max_rows_int8=1, kernel=_kernel(kernel))
    q_model, _ = load_model(tiny_gguf, None, torch.bfloat16, "cpu", quant=plan)
    layer = q_model.layers[0]
    assert isinstance(layer.qkv_proj, QuantizedWeight) and layer.qkv_proj.planes == 1
    assert isinstance(q_model.lm_head, QuantizedWeight) and q_model.lm_head.planes == 2
    # The dense copy (prefill) holds the kernel's weights; the tied table shares it.
    assert q_model.lm_head.dense is not None
    assert q_model.lm_head.dense.weight is q_model.embed_tokens
    assert layer.qkv_proj.kernel.name == kernel
    kernel_w = _kernel_weight_of(layer.qkv_proj)
    ref_w = ref_model.layers[0].qkv_proj.weight
    if kernel == "torch":
        # Dense-loaded fp32 weights are the file's values; torch's agree to bf16 scales.
        assert torch.equal(layer.qkv_proj.dense.weight.float(), kernel_w)
        assert (kernel_w - ref_w).abs().max() <= ref_w.abs().max() * 2.0**-6
    else:
        # radixrt's kernel holds the file's values exactly (fp16 scales kept); the dense
        # copy is them rounded to bf16.
        assert layer.qkv_proj.kernel.scale.dtype == torch.float16
        assert torch.equal(kernel_w, ref_w)
        assert torch.equal(layer.qkv_proj.dense.weight, ref_w.bfloat16())
        assert torch.equal(q_model.lm_head.kernel.dequantize(), ref_model.lm_head.weight)
    ids = list(range(3, 60))
    ref = _teacher_forced_logits(ref_model, ids)
    got = _teacher_forced_logits(q_model, ids)
    assert (got - ref).abs().max() < LOGIT_TOL["gguf"]


def _kernel_weight_of(qw: QuantizedWeight) -> torch.Tensor:
    if isinstance(qw.kernel, TiledQuantMatmul):
        return qw.kernel.dequantize()
    assert isinstance(qw.kernel, TorchInt4Matmul)
    return qw.kernel(torch.eye(qw.in_features, dtype=torch.bfloat16)).t().float()


def test_gguf_mode_needs_a_gguf_file(tiny_hf: tuple[object, Path]) -> None:
    with pytest.raises(ValueError, match="gguf"):
        load_model(tiny_hf[1], None, torch.float32, "cpu", quant=QuantPlan("gguf"))


def test_runner_wires_quantization_from_server_args(tiny_gguf: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from radixrt.model import runner as runner_mod

    def no_probe(*a: object, **k: object) -> QuantProbe:
        raise AssertionError("probed although quant_max_rows was given")

    monkeypatch.setattr(runner_mod, "probe_quant_kernels", no_probe)
    kernel = resolve_quant_kernel("auto")  # named: one candidate, nothing to choose by timing
    args = ServerArgs(model_path=str(tiny_gguf), dtype="bfloat16", quantization="gguf",
                      quant_max_rows=3, quant_kernel=kernel, max_total_tokens=256,
                      attention_backend="torch")
    r = runner_mod.ModelRunner(args)
    assert r.quant == QuantPlan("gguf", 3, 3, kernel=kernel)
    qkv = r.model.layers[1].qkv_proj
    assert isinstance(qkv, QuantizedWeight) and qkv.max_rows == 3
    args = args.replace(quantization="none")
    assert isinstance(runner_mod.ModelRunner(args).model.layers[1].qkv_proj, DenseWeight)


@pytest.mark.usefixtures("unforced")
@pytest.mark.parametrize(("always_wins", "half_pool", "kv_cache_dtype"), [
    (True, False, "auto"), (True, True, "auto"), (True, False, "int8"), (True, False, "float32"),
    (False, False, "auto")])
def test_auto_dtype_takes_bf16_once_no_matmul_runs_in_it(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, always_wins: bool, half_pool: bool,
        kv_cache_dtype: str) -> None:
    """A CPU whose bf16 matmul is slow (the dtype probe says fp32) but where the vnni kernel
    beats dense fp32 at every row count: every matmul runs on it with no dense copy, so `auto`
    stores activations and K/V in bf16 where that halves the K/V bytes (an fp32 model would
    keep fp32 K/V: no float16 pool decode here). Where the fp32 model would store float16 K/V
    (`half_pool`), or the K/V dtype is given (int8: the same bytes either way; float32: needs
    an fp32 model, which once failed the start here), fp32 stays with a note saying why. Where
    the kernel loses above 64 rows (a dense fp32 copy for prefill), fp32 stays."""
    from radixrt.model import quant_probe
    from radixrt.model import runner as runner_mod
    from radixrt.model.dtype_probe import ENV_FORCE as DTYPE_FORCE
    from radixrt.model.dtype_probe import DtypeProbe
    from radixrt.model.quant_matmul import VnniQuantMatmul, vnni_kernel_available

    if not vnni_kernel_available():
        pytest.skip("needs the vnni kernel (AVX512-VNNI)")
    monkeypatch.delenv(DTYPE_FORCE, raising=False)
    monkeypatch.setattr(runner_mod, "probe_cpu_dtype",
                        lambda: DtypeProbe(torch.float32, 1.0, 4.0, 2))
    rows = quant_probe.ROWS
    ms = {"dense": dict.fromkeys(rows, 10.0)}
    for kind in ("int4", "int8"):
        ms[kind] = {r: 2.0 if always_wins or r <= 64 else 20.0 for r in rows}
    dense_dtypes: list[torch.dtype] = []

    def probe(h: int, i: int, dense_dtype: torch.dtype, kernel: str) -> QuantProbe:
        dense_dtypes.append(dense_dtype)
        return QuantProbe(ms, 2, "vnni")

    monkeypatch.setattr(runner_mod, "probe_quant_kernels", probe)
    monkeypatch.setattr(runner_mod, "half_pool_decode_available", lambda head_dim: half_pool)
    # the probe's plan is under test, not the start-up timing of real steps that may lower its
    # crossover (tests/test_crossover_tuning.py): on a tiny model that timing is noise
    r = runner_mod.ModelRunner(ServerArgs(model_path=str(tiny_gguf), max_total_tokens=256,
                                          attention_backend="torch",
                                          kv_cache_dtype=kv_cache_dtype,
                                          disable_crossover_tuning=True))
    assert dense_dtypes == [torch.float32]  # timed against what fp32 would have run
    weights = r.model.linear_weights()
    assert all(isinstance(w, QuantizedWeight) and isinstance(w.kernel, VnniQuantMatmul)
               for w in weights)
    assert r.dtype_probe is not None
    kv = r.token_to_kv_pool.k_buffer[0].dtype
    if always_wins:
        assert r.quant == QuantPlan("gguf", EVERY_CALL, EVERY_CALL, kernel="vnni")
        assert all(w.dense is None for w in weights)  # type: ignore[union-attr]
        assert "vnni" in r.dtype_probe.describe() and r.dtype_probe.as_info()["note"]
        if kv_cache_dtype == "auto" and not half_pool:
            assert r.dtype == torch.bfloat16 and kv == torch.bfloat16
            assert r.dtype_probe.choice == torch.bfloat16
            assert "halves" in r.dtype_probe.describe()
        else:
            assert r.dtype == torch.float32 and r.dtype_probe.choice == torch.float32
            assert "fp32 stays" in r.dtype_probe.describe()
            assert kv == {"auto": torch.float16, "int8": torch.int8,
                          "float32": torch.float32}[kv_cache_dtype]
    else:
        assert r.quant == QuantPlan("gguf", 64, 64, kernel="vnni")
        assert r.dtype == torch.float32 and r.dtype_probe.note is None
        assert all(w.dense is not None and w.dense.weight.dtype == torch.float32  # type: ignore[union-attr]
                   for w in weights)


@pytest.mark.usefixtures("unforced")
def test_vnni_hilo_runs_in_float32_whatever_the_dtype_probe_says(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`quant_kernel="vnni-hilo"` with `dtype="auto"`: float32 without timing bf16 (a CPU whose
    bf16 matmul wins here), and not bf16 either where every matmul runs on the kernel (its
    activations are to reach it unrounded); every matmul on the two-term kernel, in the
    one-call decode step too (linear kind 3)."""
    from radixrt.model import quant_probe
    from radixrt.model import runner as runner_mod
    from radixrt.model.decode_layers import KIND_VNNI_HILO, DecodeLayers
    from radixrt.model.dtype_probe import ENV_FORCE as DTYPE_FORCE
    from radixrt.model.quant_matmul import VnniQuantMatmul, vnni_kernel_available

    if not vnni_kernel_available():
        pytest.skip("needs the vnni kernel (AVX512-VNNI or AVX2)")
    monkeypatch.delenv(DTYPE_FORCE, raising=False)

    def no_dtype_probe() -> object:
        raise AssertionError("the dtype was timed although vnni-hilo runs in float32")

    monkeypatch.setattr(runner_mod, "probe_cpu_dtype", no_dtype_probe)
    ms = {"dense": dict.fromkeys(quant_probe.ROWS, 10.0)}
    ms.update({kind: dict.fromkeys(quant_probe.ROWS, 2.0) for kind in ("int4", "int8")})
    kernels: list[str] = []

    def probe(h: int, i: int, dense_dtype: torch.dtype, kernel: str) -> QuantProbe:
        kernels.append(kernel)
        return QuantProbe(ms, 2, kernel)

    monkeypatch.setattr(runner_mod, "probe_quant_kernels", probe)
    r = runner_mod.ModelRunner(ServerArgs(model_path=str(tiny_gguf), max_total_tokens=256,
                                          attention_backend="torch", quant_kernel="vnni-hilo",
                                          disable_crossover_tuning=True))
    assert kernels == ["vnni-hilo"] and r.dtype == torch.float32 and r.dtype_probe is None
    assert r.quant == QuantPlan("gguf", EVERY_CALL, EVERY_CALL, kernel="vnni-hilo")
    assert "vnni-hilo kernel" in r.quant.describe()
    weights = r.model.linear_weights()
    assert all(isinstance(w, QuantizedWeight) and isinstance(w.kernel, VnniQuantMatmul)
               and w.kernel.terms == 2 for w in weights)
    stack = r.model.decode_layers()
    assert isinstance(stack, DecodeLayers)
    assert set(stack.meta[0::3]) == {KIND_VNNI_HILO} and stack.row_invariant


# -- choosing: `auto`, overrides, bad values ---------------------------------------------------------
def _qp(*args: object, **kw: object) -> QuantPlan:
    """A quantizing plan as `resolve_quantization` makes it: kernel "auto" resolved."""
    return QuantPlan(*args, kernel=resolve_quant_kernel("auto"), **kw)  # type: ignore[arg-type]


def _probe(ms: dict[str, dict[int, float]]):  # noqa: ANN202
    calls: list[torch.dtype] = []

    def run(dense_dtype: torch.dtype) -> QuantProbe:
        calls.append(dense_dtype)
        return QuantProbe(ms, 2)
    return run, calls


FAST = {"dense": {1: 3.0, 2: 3.1, 4: 3.3, 8: 3.6, 16: 4.0},
        "int4": {1: 0.8, 2: 1.0, 4: 1.6, 8: 3.0, 16: 5.0},
        "int8": {1: 1.5, 2: 2.0, 4: 3.4, 8: 6.0}}


@pytest.fixture
def unforced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FORCE, raising=False)  # conftest forces none


def test_probe_crossover_is_the_last_row_count_of_the_winning_prefix() -> None:
    p = QuantProbe(FAST, 2)
    assert p.crossover("int4") == 8 and p.crossover("int8") == 2
    assert p.speedup("int4") == pytest.approx(3.75)
    assert QuantProbe({"dense": {1: 1.0, 2: 1.0}, "int4": {1: 2.0, 2: 0.5}}).crossover("int4") == 0
    info = p.as_info()
    assert info["max_rows_int4"] == 8 and info["ms"]["int4"]["1"] == 0.8  # type: ignore[index]


@pytest.mark.usefixtures("unforced")
def test_auto_quantizes_where_a_kernel_is_clearly_faster_in_the_model_dtype() -> None:
    probe, calls = _probe(FAST)
    plan, why = resolve_quantization("auto", torch.bfloat16, CPU, True, probe)
    assert plan == _qp("gguf", 8, 2) and "probe" in why
    plan, _ = resolve_quantization("auto", torch.bfloat16, CPU, False, probe)
    assert plan == _qp("int8", 8, 2)  # an HF directory: 8-bit
    assert calls == [torch.bfloat16, torch.bfloat16]
    # fp32 activations are timed like bf16 ones (the int8-activation kernel does not need bf16
    # matmul): quantized when the probe, run in fp32, says so.
    plan, why = resolve_quantization("auto", torch.float32, CPU, True, probe)
    assert plan == _qp("gguf", 8, 2) and "probe" in why and calls[-1] == torch.float32
    # A kernel only 1.1x faster at one row: not worth it.
    slow = {"dense": {1: 1.1}, "int4": {1: 1.0}, "int8": {1: 1.0}}
    plan, why = resolve_quantization("auto", torch.bfloat16, CPU, True, _probe(slow)[0])
    assert plan == QuantPlan() and "needs" in why
    # CUDA: auto is none; an explicit quantized mode is an error naming the field.
    assert resolve_quantization("auto", torch.bfloat16, torch.device("cuda"), True, probe)[0] == (
        QuantPlan())
    with pytest.raises(ValueError, match="ServerArgs.quantization"):
        resolve_quantization("int8", torch.bfloat16, torch.device("cuda"), True, probe)


@pytest.mark.usefixtures("unforced")
def test_explicit_modes_and_knobs() -> None:
    probe, calls = _probe(FAST)
    assert resolve_quantization("none", torch.bfloat16, CPU, True, probe)[0] == QuantPlan()
    # Explicit modes apply whatever the dtype; the crossover is measured in the model dtype ...
    assert resolve_quantization("int4", torch.float32, CPU, False, probe)[0] == (
        _qp("int4", 8, 2))
    assert calls == [torch.float32]
    # ... unless given, or unused without a dense copy.
    assert resolve_quantization("gguf", torch.bfloat16, CPU, True, probe, max_rows=5)[0] == (
        _qp("gguf", 5, 5))
    assert resolve_quantization("int8", torch.bfloat16, CPU, True, probe,
                                dense_copy=False)[0] == _qp("int8", dense_copy=False)
    # (timed again only where `auto` has several kernels to choose from: vnni CPUs)
    assert len(calls) == (3 if len(quant_kernel_candidates("auto")) > 1 else 1)
    with pytest.raises(ValueError, match="ServerArgs.quantization.*gguf"):
        resolve_quantization("gguf", torch.bfloat16, CPU, False, probe)
    with pytest.raises(ValueError, match="ServerArgs.quantization"):
        resolve_quantization("int3", torch.bfloat16, CPU, True, probe)


def test_env_forces_the_auto_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    probe, calls = _probe(FAST)
    monkeypatch.setenv(ENV_FORCE, "none")
    plan, why = resolve_quantization("auto", torch.bfloat16, CPU, True, probe)
    assert plan == QuantPlan() and ENV_FORCE in why and not calls
    monkeypatch.setenv(ENV_FORCE, "int4")  # forced even with fp32 activations
    assert resolve_quantization("auto", torch.float32, CPU, True, probe)[0] == (
        _qp("int4", 8, 2))
    monkeypatch.setenv(ENV_FORCE, "fp8")
    with pytest.raises(ValueError, match=ENV_FORCE):
        resolve_quantization("auto", torch.bfloat16, CPU, True, probe)


def test_server_args_reject_bad_values_and_the_cli_exposes_the_knobs() -> None:
    with pytest.raises(ValueError, match="ServerArgs.quantization"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="ServerArgs.quant_max_rows"):
        ServerArgs(quant_max_rows=-1)
    with pytest.raises(ValueError, match="ServerArgs.quant_kernel"):
        ServerArgs(quant_kernel="fast")
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    args = args_from_namespace(ap.parse_args(
        ["--quantization", "int4", "--quant-max-rows", "6", "--disable-quant-dense-copy",
         "--quant-kernel", "torch"]))
    assert (args.quantization, args.quant_max_rows, args.disable_quant_dense_copy,
            args.quant_kernel) == ("int4", 6, True, "torch")
    assert ServerArgs().quantization == "auto"


# -- several candidate kernels (vnni vs radixrt), injected timings ----------------------------------
def _two_kernel_ms(vnni_factor: float, radixrt_factor: float,
                   rows: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """Measure-style keys: dense 10 ms per row count, each kernel a constant factor of it."""
    ms: dict[str, dict[int, float]] = {"dense": dict.fromkeys(rows, 10.0)}
    for kernel, f in (("vnni", vnni_factor), ("radixrt", radixrt_factor)):
        for kind in ("int4", "int8"):
            ms[f"{kind}:{kernel}"] = dict.fromkeys(rows, 10.0 * f)
    return ms


def test_probe_keeps_the_faster_candidate_and_drops_the_dense_copy_when_it_always_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from radixrt.model import quant_probe

    monkeypatch.setattr(quant_probe, "quant_kernel_candidates",
                        lambda kernel: ("vnni", "radixrt") if kernel == "auto" else (kernel,))
    rows = quant_probe.ROWS

    def measured(ms: dict[str, dict[int, float]]) -> QuantProbe:
        return quant_probe.probe_quant_kernels(576, 1536, measure=lambda r, d: ms)

    fast = measured(_two_kernel_ms(0.5, 0.8, rows))
    assert fast.kernel == "vnni" and set(fast.others) == {"radixrt"}
    assert fast.wins_everywhere() and "radixrt kernel" in fast.describe()
    plan, why = resolve_quantization("gguf", torch.bfloat16, CPU, True, lambda d: fast)
    assert plan == QuantPlan("gguf", EVERY_CALL, EVERY_CALL, kernel="vnni") and "no dense copy" in why
    # Explicit max rows keep the dense copy; an explicit kernel is never replaced.
    plan, _ = resolve_quantization("gguf", torch.bfloat16, CPU, True, lambda d: fast, max_rows=9)
    assert plan == QuantPlan("gguf", 9, 9, kernel="vnni")  # max_rows given: the kernel still timed
    plan, _ = resolve_quantization("gguf", torch.bfloat16, CPU, True, lambda d: fast,
                                   dense_copy=False)
    assert plan == QuantPlan("gguf", dense_copy=False, kernel="vnni")
    assert resolve_quantization("gguf", torch.bfloat16, CPU, True, lambda d: fast,
                                kernel="radixrt")[0].kernel == "radixrt"
    # radixrt faster on average (half dense's time, 1.1x it from 128 rows on): kept, with its
    # crossover; slower on average (3x dense from 128 rows on): vnni.
    ms = _two_kernel_ms(0.9, 0.5, rows)
    for kind in ("int4", "int8"):
        for r in rows:
            if r >= 128:
                ms[f"{kind}:radixrt"][r] = 11.0
    slow = measured(ms)
    assert slow.kernel == "radixrt" and slow.crossover("int4") == 64
    assert resolve_quantization("gguf", torch.bfloat16, CPU, True, lambda d: slow)[0] == (
        QuantPlan("gguf", 64, 64, kernel="radixrt"))
    for kind in ("int4", "int8"):
        for r in rows:
            if r >= 128:
                ms[f"{kind}:radixrt"][r] = 30.0
    assert measured(ms).kernel == "vnni"


def test_a_width_faster_at_every_row_count_runs_every_call_and_keeps_no_dense_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Zen 1's shape of the probe: the 4-bit kernel beats dense up to 512 rows, the 8-bit one
    only up to 64. 4-bit weights then run every call on the kernel (no dense copy, prefill
    chunks of any size on it), the 8-bit head keeps its copy above 64 rows."""
    from radixrt.model import quant_probe

    monkeypatch.setattr(quant_probe, "quant_kernel_candidates", lambda kernel: ("vnni",))
    rows = quant_probe.ROWS
    ms = {"dense": dict.fromkeys(rows, 10.0), "int4": dict.fromkeys(rows, 8.0),
          "int8": {r: (5.0 if r <= 64 else 15.0) for r in rows}}
    probe = QuantProbe(ms, 2, "vnni")
    assert probe.crossover("int4") == rows[-1] and probe.crossover("int8") == 64
    plan, why = resolve_quantization("gguf", torch.float32, CPU, True, lambda d: probe)
    assert plan == QuantPlan("gguf", EVERY_CALL, 64, kernel="vnni")
    assert not plan.keeps_dense(4) and plan.keeps_dense(8)
    assert "kernels every call (4-bit) / up to 64 rows (8-bit), dense copy above" in why
    # An explicit crossover or `--disable-quant-dense-copy` still wins.
    assert resolve_quantization("gguf", torch.float32, CPU, True, lambda d: probe,
                                max_rows=9)[0] == QuantPlan("gguf", 9, 9, kernel="vnni")
    off = resolve_quantization("gguf", torch.float32, CPU, True, lambda d: probe,
                               dense_copy=False)[0]
    assert not off.keeps_dense(4) and not off.keeps_dense(8)
    # 4-bit faster at 512 rows by less than EVERY_CALL_MARGIN (Zen 1's 8-bit head once won
    # there by 9%): it keeps its dense copy, above 512 rows, so that two starts a few percent
    # apart resolve alike.
    ms["int4"][rows[-1]] = 10.0 / (quant_probe.EVERY_CALL_MARGIN - 0.06)
    narrow = QuantProbe(ms, 2, "vnni")
    assert narrow.crossover("int4") == rows[-1] and not narrow.runs_every_call("int4")
    plan, _ = resolve_quantization("gguf", torch.float32, CPU, True, lambda d: narrow)
    assert plan == QuantPlan("gguf", rows[-1], 64, kernel="vnni") and plan.keeps_dense(4)
    # 4-bit short of 512 rows: both widths bounded, as before.
    ms["int4"][rows[-1]] = 12.0
    plan, _ = resolve_quantization("gguf", torch.float32, CPU, True,
                                   lambda d: QuantProbe(ms, 2, "vnni"))
    assert plan == QuantPlan("gguf", 128, 64, kernel="vnni") and plan.keeps_dense(4)


def test_a_4bit_width_on_every_call_keeps_only_the_heads_dense_copy(tiny_gguf: Path) -> None:
    """`EVERY_CALL` for 4 bits on SmolLM2's layout (Q4_1 layers, tied Q8_0 head): the layers
    keep no dense copy, the head keeps one above its max rows. A 40-token prefill's logits are
    then bitwise those of the plan with every call on the kernel; with the layers' dense copy
    used above 4 rows they are not (the kernel rounds activations to int8, the copy does not)."""
    if not vnni_kernel_available():
        pytest.skip("the vnni kernel needs AVX2 or AVX512-VNNI")
    plans = {"every": QuantPlan("gguf", EVERY_CALL, 2, kernel="vnni"),
             "kernel": QuantPlan("gguf", dense_copy=False, kernel="vnni"),
             "bounded": QuantPlan("gguf", 4, 2, kernel="vnni")}
    models = {k: load_model(tiny_gguf, None, torch.float32, "cpu", quant=p)[0]
              for k, p in plans.items()}
    every, bounded = models["every"], models["bounded"]
    for layer in every.layers:
        for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            assert isinstance(w, QuantizedWeight) and w.planes == 1 and w.dense is None
    assert every.lm_head.dense is not None and every.lm_head.max_rows == 2
    assert bounded.layers[0].qkv_proj.dense is not None
    size = {k: sum(w.nbytes() for w in m.modules() if isinstance(w, QuantizedWeight))
            for k, m in models.items()}
    assert size["kernel"] < size["every"] < size["bounded"]
    ids = list(range(3, 43))

    def prefill(model: object) -> torch.Tensor:
        r = PagedRunner.for_model(model)  # type: ignore[arg-type]
        return r.extend([r.new_request()], [ids])  # the head computes the last row only

    got = prefill(every)
    assert torch.equal(got, prefill(models["kernel"]))
    assert not torch.equal(got, prefill(bounded))


def test_a_prompts_last_token_alone_gives_the_fresh_prefills_logits(tiny_gguf: Path) -> None:
    """A prompt cached but for its last token (the same prompt again): with every matmul on the
    row-invariant vnni kernel, that token alone on the extend path gives bitwise the logits of
    the whole prompt's prefill, when the step marks it a prompt row (`decode_rows_from`, as the
    scheduler does); a row marked as a decode row takes the paged-decode op (on SmolLM2 its
    other summation order moved the logits by up to 0.87, stop 50)."""
    if not vnni_kernel_available():
        pytest.skip("the vnni kernel needs AVX2 or AVX512-VNNI")
    from radixrt.attention.paged_decode import paged_decode_unavailable_reason

    if paged_decode_unavailable_reason(torch.float32, 16) is not None:
        pytest.skip("paged decode op unavailable")
    plan = QuantPlan("gguf", dense_copy=False, kernel="vnni")
    model = load_model(tiny_gguf, None, torch.float32, "cpu", quant=plan)[0]
    r = PagedRunner.for_model(model)
    ids = [(7 * i + 3) % 250 + 2 for i in range(60)]
    fresh = r.extend([r.new_request()], [ids], decode_rows_from=1)
    backend = model.attn_backend
    for first, split in ((1, False), (0, True)):
        row = r.new_request()
        r.extend([row], [ids[:-1]], decode_rows_from=1)
        out = r.extend([row], [ids[-1:]], decode_rows_from=first)
        assert (backend._split is not None) == split  # the paged-decode op took the row
        if not split:
            assert torch.equal(out, fresh)
        else:  # another summation order: close, not necessarily the same bits
            torch.testing.assert_close(out, fresh, atol=1e-4, rtol=1e-4)


def test_probe_times_both_ends_first_in_the_model_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real (tiny) measurement: with no budget left after the first row count, one row and
    the largest are still timed (the two ends decide decode and the dense copy), and every kind
    is fed activations in the dense dtype (fp32 here: what an fp32 model passes them)."""
    from radixrt.model import quant_probe
    from radixrt.model.linear import DenseWeight as Dense

    monkeypatch.setattr(quant_probe, "BUDGET_S", 0.0)
    monkeypatch.setattr(quant_probe, "PROBE_PARAMS", 1)
    seen: set[tuple[str, torch.dtype]] = set()
    for cls in (Dense, QuantizedWeight):
        def spy(self: object, x: torch.Tensor, *a: object, _f=cls.forward, _n=cls.__name__,
                **k: object) -> torch.Tensor:
            seen.add((_n, x.dtype))
            return _f(self, x, *a, **k)

        monkeypatch.setattr(cls, "forward", spy)
    for kernel in ("torch", resolve_quant_kernel("auto")):
        ms = quant_probe.measure_kernels(64, 128, (kernel,))(quant_probe.ROWS, torch.float32)
        assert set(ms["dense"]) == {1, quant_probe.ROWS[-1]}
    assert seen == {("DenseWeight", torch.float32), ("QuantizedWeight", torch.float32)}
    assert quant_probe.probe_order((1, 2, 4, 512)) == (1, 512, 2, 4)
    # Unmeasured middle counts do not break a crossover that won at both ends.
    p = QuantProbe({"dense": {1: 2.0, 512: 9.0}, "int4": {1: 1.0, 512: 5.0},
                    "int8": {1: 1.0, 512: 5.0}})
    assert p.wins_everywhere()


@pytest.mark.parametrize("kernels", [("vnni",), ("radixrt", "vnni")])
def test_probe_weights_each_hold_memory_of_their_own(kernels: tuple[str, ...]) -> None:
    """The probe draws random codes once per shape and copies them for the next weight of that
    shape: every weight must still stream its own bytes (the probe times weights read from
    memory, not from cache), in each kind, with at least PROBE_PARAMS parameters."""
    from radixrt.model import quant_probe

    weights = quant_probe._probe_weights(576, 1536, torch.float32, kernels)
    assert set(weights) == {"dense", *(f"{w}:{k}" for w in ("int4", "int8") for k in kernels)}
    for kind, ws in weights.items():
        assert sum(w.out_features * w.in_features for w in ws) >= quant_probe.PROBE_PARAMS
        tensors = [t for w in ws for t in w.buffers()] + [t for w in ws for t in w.parameters()]
        assert tensors, kind
        ptrs = [t.untyped_storage().data_ptr() for t in tensors]
        assert len(set(ptrs)) == len(ptrs), kind
        if kind.endswith(":vnni"):  # same-shape weights: equal copies of one draw
            a, b = ws[0].kernel.packed, ws[2].kernel.packed
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
            assert int(a.max()) > 200 and int(a.min()) < 50


def test_no_dense_matmul_needs_vnni_every_call_and_every_weight_quantized() -> None:
    vnni = QuantPlan("gguf", dense_copy=False, kernel="vnni")
    assert vnni.no_dense_matmul(frozenset({"Q4_1", "Q8_0"}))
    assert not vnni.no_dense_matmul(frozenset({"Q4_1", "Q6_K"}))  # a Q6_K matmul stays dense
    assert not vnni.no_dense_matmul(None)
    assert QuantPlan("int8", dense_copy=False, kernel="vnni").no_dense_matmul(None)
    assert not QuantPlan("gguf", 64, 64, kernel="vnni").no_dense_matmul(frozenset({"Q4_1"}))
    assert not QuantPlan("gguf", dense_copy=False, kernel="radixrt").no_dense_matmul(
        frozenset({"Q4_1"}))
    assert not QuantPlan().no_dense_matmul(None)


def test_choose_kernel_compares_only_cells_every_kernel_has() -> None:
    from radixrt.model.quant_probe import choose_kernel

    a = {"dense": {1: 10.0, 2: 10.0}, "int4": {1: 5.0, 2: 1.0}, "int8": {1: 5.0}}
    b = {"dense": {1: 10.0, 2: 10.0}, "int4": {1: 4.0}, "int8": {1: 4.0}}
    assert choose_kernel({"a": a, "b": b}) == "b"  # row 2 (a only) does not count
    assert choose_kernel({"a": a, "b": {"dense": {}}}) == "a"  # no common cell: the first
