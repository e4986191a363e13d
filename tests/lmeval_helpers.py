"""lm-evaluation-harness against local tasks, offline: task materialization, the fp32 HF export of
the default model, and per-sample extraction so two evaluations can be compared number by number.

Import from tests with `from lmeval_helpers import ...`. As a script it runs lm-eval's `hf` model
on the local tasks and prints the accuracies, per-sample log-likelihoods and the time taken:

    PYTHONPATH=. .venv/bin/python tests/lmeval_helpers.py [--hf-dir DIR]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Nothing may reach a hub: set before `datasets`/`transformers` are imported (they read these at
# import time). The datasets cache goes to a private temp dir so runs never share a stale build.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="radixrt-lmeval-datasets-"))

import yaml  # noqa: E402 - after the environment above

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
MC_TASK = "radixrt_mc"
GEN_TASK = "radixrt_gen"
TASKS = [MC_TASK, GEN_TASK]


def materialize_tasks(dst: Path) -> Path:
    """Copy the task YAMLs to `dst` with `data_files` made absolute; return `dst` (an include path).

    lm-eval hands `dataset_kwargs` to `datasets.load_dataset` unchanged, so relative `data_files`
    would resolve against the working directory, not the YAML's folder.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for src in sorted(TASK_DIR.glob("*.yaml")):
        cfg = yaml.safe_load(src.read_text())
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        for split, name in files.items():
            path = (TASK_DIR / name).resolve()
            assert path.is_file(), path
            files[split] = str(path)
        (dst / src.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


def export_hf_dir(out: Path) -> Path:
    """The default GGUF (SmolLM2-135M-Instruct) as an fp32 HF directory, via bench/peers/export_hf.py.

    Both lm-eval's `hf` model and the server load this one directory, so weights and tokenizer are
    the same bytes on both sides. Takes ~30 s on 2 cores.
    """
    from radixrt.model.loader import default_model_path

    if not (out / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(REPO / "bench" / "peers" / "export_hf.py"),
                        "--model", default_model_path(), "--out", str(out)],
                       check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


def task_manager(include_path: Path) -> Any:
    from lm_eval.tasks import TaskManager

    # include_defaults=False: skip indexing lm-eval's ~200 built-in task folders.
    return TaskManager(include_path=str(include_path), include_defaults=False)


def evaluate(model: str, model_args: str, include_path: Path, tasks: list[str] | None = None,
             **kwargs: Any) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on the local tasks with samples logged; fixed seeds (defaults)."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks or TASKS,
                                  task_manager=task_manager(include_path), log_samples=True,
                                  **kwargs)
    assert out is not None
    return out


def hf_model_args(hf_dir: Path) -> str:
    return f"pretrained={hf_dir},dtype=float32,device=cpu"


def per_sample(out: dict[str, Any], task: str) -> dict[int, dict[str, Any]]:
    """doc_id → {"ll": [per-choice log-likelihoods], "greedy": [...], "text": generated text,
    "prompt": the first request's context, plus every per-sample metric (acc, exact_match, ...)}."""
    res = {}
    for s in out["samples"][task]:
        row: dict[str, Any] = {"prompt": s["arguments"][0][0]}
        resps = [r[0] for r in s["resps"]]
        if resps and isinstance(resps[0], tuple | list):  # loglikelihood: (ll, is_greedy)
            row["ll"] = [float(r[0]) for r in resps]
            row["greedy"] = [bool(r[1]) for r in resps]
        else:
            row["text"] = resps[0]
        for m in out["configs"][task].get("metric_list", []):
            if m["metric"] in s:
                row[m["metric"]] = s[m["metric"]]
        res[s["doc_id"]] = row
    return res


def task_metrics(out: dict[str, Any], task: str) -> dict[str, float]:
    """The task's aggregate metrics without the stderr entries: {"acc,none": 0.5, ...}."""
    return {k: v for k, v in out["results"][task].items()
            if "_stderr" not in k and isinstance(v, int | float)}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="lm-eval `hf` on the local tasks (offline)")
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="fp32 HF export (default: export the default GGUF to a temp dir)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="radixrt-lmeval-"))
    t0 = time.perf_counter()
    hf_dir = a.hf_dir or export_hf_dir(tmp / "hf")
    t1 = time.perf_counter()
    out = evaluate("hf", hf_model_args(hf_dir), materialize_tasks(tmp / "tasks"), batch_size=1)
    t2 = time.perf_counter()
    for task in TASKS:
        print(task, task_metrics(out, task))
        for doc_id, row in sorted(per_sample(out, task).items()):
            print(f"  {doc_id:3d}", {k: v for k, v in row.items() if k != "prompt"})
    print(f"export {t1 - t0:.1f}s  hf eval {t2 - t1:.1f}s")


if __name__ == "__main__":
    main()
