"""`ModelRunner`: owns the device, the model, the KV pools and the attention backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from radixrt.attention import create_attention_backend
from radixrt.attention.flashinfer import FlashInferBackend
from radixrt.attention.paged_decode import paged_decode_unavailable_reason
from radixrt.config import ServerArgs
from radixrt.core.cpu_policy import QuietBeforeTiming
from radixrt.core.forward_batch import ForwardBatch
from radixrt.mem.huge_pages import move_to_huge_pages
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool, kv_bytes_per_token
from radixrt.mem.step_heap import retain_step_heap
from radixrt.model import prepack
from radixrt.model.crossover_tuning import describe as describe_crossover
from radixrt.model.crossover_tuning import own_head_copy, tune_crossover, tune_head_crossover
from radixrt.model.decode_layers import DecodeLayers, set_team_steal
from radixrt.model.decode_path_tuner import DecodePathTuner
from radixrt.model.dtype_probe import DtypeProbe, probe_cpu_dtype
from radixrt.model.linear import describe_quantized, pack_dense_weights
from radixrt.model.loader import (
    default_model_path,
    gguf_matrix_types,
    load_model,
    resolve_device,
    resolve_dtype,
)
from radixrt.model.model_config import ModelConfig, resolve_gguf_file
from radixrt.model.quant import QuantPlan
from radixrt.model.quant_matmul import vnni_terms
from radixrt.model.quant_probe import (
    QuantProbe,
    probe_quant_kernels,
    probe_single_tile_passes,
    resolve_quantization,
)
from radixrt.model.scoring import RowScores, score_hidden

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSizes:
    max_total_tokens: int
    max_running_requests: int
    max_context_len: int


def kv_storage_dtype(args: ServerArgs, dtype: torch.dtype, device: torch.device | None = None,
                     quantized: bool = False, head_dim: int = 64) -> torch.dtype:
    """What the KV pool stores: int8 for `kv_cache_dtype=int8`; float16 for `float16` (a float32
    or float16 model; a bfloat16 one is refused, naming the field); float32 for `float32` (a
    float32 model only). `auto` is the compute dtype, except on CPU under a float32 model whose
    weights are `quantized` and whose decode reads a half pool in C++: there float16, because
    the rounding is noise next to the weights' (README, Float16 KV cache) and every decode step
    then streams half the K/V bytes. The fp32 dense reference keeps fp32 K/V."""
    if args.kv_cache_dtype == "int8":
        return torch.int8
    if args.kv_cache_dtype == "float16":
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"kv_cache_dtype=float16 needs a float32 or float16 model; this "
                             f"one runs in {dtype} (use kv_cache_dtype auto or int8, or dtype "
                             f"float32)")
        return torch.float16
    if args.kv_cache_dtype == "float32":
        if dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype=float32 needs a float32 model; this one runs in "
                             f"{dtype} (use kv_cache_dtype auto, or dtype float32)")
        return torch.float32
    if (dtype == torch.float32 and quantized and device is not None and device.type == "cpu"
            and not args.disable_cpu_decode_kernel and half_pool_decode_available(head_dim)):
        return torch.float16
    return dtype


def bf16_halves_kv(args: ServerArgs, device: torch.device, quantized: bool,
                   head_dim: int) -> bool:
    """Whether a bfloat16 model would store half the K/V bytes of a float32 one: with
    `kv_cache_dtype auto` only, where the float32 model keeps fp32 K/V (`kv_storage_dtype`).
    An explicit float16 / float32 needs a float32 model and int8 stores the same bytes either
    way, so `dtype auto` does not move off fp32 for them (`DtypeProbe.without_dense_matmuls`)."""
    return (args.kv_cache_dtype == "auto"
            and kv_storage_dtype(args, torch.float32, device, quantized, head_dim) == torch.float32)


def half_pool_decode_available(head_dim: int) -> bool:
    """Whether the C++ decode kernel runs on a float16 pool of this head dim here."""
    return paged_decode_unavailable_reason(torch.float16, head_dim) is None


def plan_pools(args: ServerArgs, cfg: ModelConfig, kv_dtype: torch.dtype,
               device: torch.device) -> PoolSizes:
    """Pool sizes for K/V stored as `kv_dtype` (`kv_storage_dtype`)."""
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    total = args.max_total_tokens
    if total is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = psutil.virtual_memory().available
        total = max(1024, int(free * args.mem_fraction) // per_token)
    ctx = min(args.max_context_len or cfg.context_len, total)
    return PoolSizes(total, args.max_running_requests, ctx)


class ModelRunner:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.device = resolve_device(args.device)
        self.model_path = args.model_path or str(default_model_path())
        self.model_config = ModelConfig.from_path(self.model_path)
        self.dtype_probe: DtypeProbe | None = None  # set when `auto` timed (or was forced)
        quiet = QuietBeforeTiming(args.startup_quiet_wait_s if self.device.type == "cpu" else 0)

        def probe() -> DtypeProbe:
            quiet()
            self.dtype_probe = probe_cpu_dtype()
            return self.dtype_probe

        dtype = args.dtype
        if dtype == "auto" and self.device.type == "cpu" and vnni_terms(args.quant_kernel) == 2:
            dtype = "float32"  # vnni-hilo: the activations are to reach the kernel unrounded
        self.dtype = resolve_dtype(dtype, self.device, self.model_config, probe)
        cfg = self.model_config
        self.quant_probe: QuantProbe | None = None  # set when the kernels were timed

        def qprobe(dense_dtype: torch.dtype) -> QuantProbe:
            quiet()
            self.quant_probe = probe_quant_kernels(cfg.hidden_size, cfg.intermediate_size,
                                                   dense_dtype, kernel=args.quant_kernel)
            return self.quant_probe

        self.quant: QuantPlan
        gguf_file = resolve_gguf_file(Path(self.model_path))
        self.quant, why = resolve_quantization(
            args.quantization, self.dtype, self.device, gguf_file is not None, qprobe,
            args.quant_max_rows, dense_copy=not args.disable_quant_dense_copy,
            kernel=args.quant_kernel)
        if self.dtype_probe is not None and self.quant.no_dense_matmul(
                None if gguf_file is None else gguf_matrix_types(gguf_file)):
            self.dtype_probe = self.dtype_probe.without_dense_matmuls(bf16_halves_kv(
                args, self.device, self.quant.quantized, cfg.head_dim))
            self.dtype = self.dtype_probe.choice
        if self.dtype_probe is not None:
            logger.info("dtype auto -> %s", self.dtype_probe.describe())
        logger.info("quantization %s -> %s", args.quantization, why)
        if self.quant.mode != "none" and vnni_terms(self.quant.kernel):
            quiet()
            _, passes = probe_single_tile_passes(cfg.hidden_size, cfg.intermediate_size)
            logger.info("vnni kernel passes -> %s", passes)
        if self.device.type == "cpu" and hasattr(torch.ops.radixrt, "paged_decode_prefetch_l1"):
            # csrc/paged_decode.cpp: by CPU vendor, or RADIXRT_PD_PREFETCH_L1
            into = "L1" if torch.ops.radixrt.paged_decode_prefetch_l1() else "L2"
            logger.info("paged decode prefetches K/V rows into %s", into)
        tunes = (self.device.type == "cpu" and self.quant.quantized
                 and args.quant_max_rows is None and not args.disable_crossover_tuning)
        if tunes:  # the LM head's dense copy is timed at load, whatever the probe said
            self.quant = replace(self.quant, time_head=True)
        kv_dtype = kv_storage_dtype(args, self.dtype, self.device, self.quant.quantized,
                                    cfg.head_dim)
        if args.kv_cache_dtype == "auto" and kv_dtype != self.dtype:
            logger.info("kv_cache_dtype auto -> %s (a %s model with quantized weights)",
                        kv_dtype, self.dtype)
        self.sizes = plan_pools(args, cfg, kv_dtype, self.device)
        self.req_to_token_pool = ReqToTokenPool(
            self.sizes.max_running_requests, self.sizes.max_context_len, self.device)
        self.token_to_kv_pool = TokenToKVPool(
            self.sizes.max_total_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
            self.dtype, self.device, huge_pages=not args.disable_huge_pages,
            kv_dtype=kv_dtype)
        self.attn_backend = create_attention_backend(
            args.attention_backend, self.token_to_kv_pool, self.device,
            num_q_heads=cfg.num_heads,
            decode_kernel=False if args.disable_cpu_decode_kernel else None,
            extend_kernel=False if args.disable_cpu_extend_kernel else None)
        self.model, _ = load_model(self.model_path, self.attn_backend, self.dtype, self.device,
                                   model_config=cfg, quant=self.quant,
                                   fused_ops=False if args.disable_fused_cpu_ops else None)
        huge_pages = not args.disable_huge_pages and self.device.type == "cpu"
        timed_copy = own_head_copy(self.model) if tunes and huge_pages else None
        if huge_pages:
            # a head copy only kept for its timing joins the arena once it is kept for good
            moved = move_to_huge_pages([t for t in (*self.model.parameters(),
                                                    *self.model.buffers())
                                        if t is not timed_copy])
            logger.info("model tensors: %.1f MiB moved to huge-page buffers", moved / 2**20)
        if not args.disable_heap_retention and self.device.type == "cpu":
            logger.info("step heap: %s", retain_step_heap())
        if not args.disable_prepacked_weights and self.device.type == "cpu":
            if self.dtype == torch.bfloat16:
                quiet()  # the packing decision may time plain against packed
            packed = pack_dense_weights(self.model)  # before the C++ decode stack lists them
            if packed:
                logger.info("prepacked matmul weights: %d dense weights packed for %s", packed,
                            "AMX tiles (radixrt::amx_linear)" if prepack.amx_available()
                            else "oneDNN")
        # compiled dense parts replace the layers' Python methods, which the C++ loop skips
        self.model.fused_decode = not (args.disable_fused_decode or args.compile_decode)
        self.model.fused_extend = not args.disable_fused_extend
        self.model.decode_microbatch_rows = args.decode_microbatch_rows
        self.model.decode_team = not args.disable_decode_team
        self.model.decode_path_tuner = (None if args.disable_decode_path_tuning
                                        else DecodePathTuner())
        if self.device.type == "cpu" and isinstance(self.model.decode_layers(), DecodeLayers):
            set_team_steal(not args.disable_team_steal)
        self.compiled = None
        if args.compile_decode:
            from radixrt.model.compiled_layers import CompiledDense

            self.compiled = CompiledDense(self.model.layers)
        self.cuda_graphs = None
        if (self.device.type == "cuda" and not args.disable_cuda_graph
                and isinstance(self.attn_backend, FlashInferBackend)):
            from radixrt.model.cuda_graph_runner import CudaGraphRunner

            self.cuda_graphs = CudaGraphRunner(
                self.model, self.attn_backend, max_bs=self.sizes.max_running_requests,
                max_kv_tokens=self.sizes.max_total_tokens)
        if tunes:
            quiet()
            tuned = tune_crossover(self)
            if tuned is not None:
                self.quant = self.quant.capped(tuned[1])
                logger.info("quantized matmul crossover -> %s", describe_crossover(tuned))
            head = tune_head_crossover(self.model, self.dtype)
            if head is not None:
                self.quant = replace(self.quant, max_rows_head=head[1])
                logger.info("quantized LM head crossover -> %s",
                            describe_crossover(head, "the head's own calls"))
            if timed_copy is not None and own_head_copy(self.model) is timed_copy:
                move_to_huge_pages([timed_copy])
        if self.device.type == "cpu":
            logger.info("decode steps: %s", self.model.decode_path())
        logger.info(
            "KV pool: %d tokens (%.1f MiB, %s), %d request rows x %d context, device %s",
            self.sizes.max_total_tokens,
            self.sizes.max_total_tokens * self.token_to_kv_pool.bytes_per_token() / 2**20,
            ("int8 codes + fp32 scales" if self.token_to_kv_pool.quantized
             else self.token_to_kv_pool.kv_dtype),
            self.sizes.max_running_requests, self.sizes.max_context_len, self.device)

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV pool stores (`kv_storage_dtype`; int8 for codes + scales)."""
        return self.token_to_kv_pool.kv_dtype

    def describe_quantization(self) -> str:
        """The resolved `quantization` mode and where its weights run, read from the loaded
        weights (`linear.describe_quantized`), not from the plan: starts that compute alike
        describe alike (`engine.info["quantization"]`)."""
        if not self.quant.quantized:
            return "none"
        where = describe_quantized(self.model)
        return f"{self.quant.mode} ({where or 'no weight quantized'})"

    @torch.inference_mode()
    def forward_scored(self, fb: ForwardBatch, top_k: int) -> tuple[torch.Tensor, RowScores | None]:
        """`forward`, plus the scores of `fb.score_targets` at `fb.score_rows` (extend batches
        that score prompt tokens; never CUDA-graphed) with `top_k` alternatives."""
        if fb.score_rows is None:
            return self.forward(fb), None
        self.attn_backend.init_forward_metadata(fb)
        logits, hidden = self.model.forward_scored(fb)
        if hidden is None or fb.score_targets is None:
            raise ValueError("score_rows without score_targets")
        return logits, score_hidden(hidden, self.model.lm_head, fb.score_targets, top_k)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits `[B, vocab]` for each request's `logits_indices` row."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(fb):
            return self.cuda_graphs.replay(fb)  # plans the batch itself
        self.attn_backend.init_forward_metadata(fb)
        if self.compiled is not None and fb.is_decode:
            with self.compiled.active():
                return self.model(fb)
        return self.model(fb)

    @torch.inference_mode()
    def forward_greedy(self, fb: ForwardBatch
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward`'s logits and, where the LM head's kernel picks them, each row's argmax
        (bitwise `sampler.row_argmax(logits)`; None elsewhere: CUDA graphs, a compiled step, a
        torch-kernel head). The logits are None where the head picked the ids without writing
        them (`LlamaForCausalLM.forward_greedy`). For steps whose rows are all greedy
        (`SamplingBatchInfo.is_fast_path`): the argmax is then the sample."""
        if (self.cuda_graphs is not None and self.cuda_graphs.can_run(fb)) or (
                self.compiled is not None and fb.is_decode):
            return self.forward(fb), None
        self.attn_backend.init_forward_metadata(fb)
        return self.model.forward_greedy(fb)
