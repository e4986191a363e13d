"""Process-level behaviour on a tiny random model: streaming, stop strings through the
detokenizer, aborts, bad input, and a dead child reported instead of waited on."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from radixrt import Engine, SamplingParams
from radixrt.core import cpu_policy
from radixrt.core.errors import EngineDeadError


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, num_threads=1) as eng:
        yield eng


def clean(engine: Engine) -> None:
    engine.wait_idle()
    engine.check_invariants()


def test_stream_concatenation_equals_blocking_output(engine):
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    prompt = "The quick brown fox"
    full = engine.generate(prompt, params)

    async def collect():
        chunks = []
        async for ch in engine.generate_stream(prompt, params):
            chunks.append(ch)
        return chunks

    chunks = asyncio.run(collect())
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert full.text == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    clean(engine)


def test_stop_string_trims_and_stops_the_request(engine):
    base = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    full = engine.generate("Radix trees", base)
    text = full.text
    # Pick a stop string from the middle of the greedy continuation.
    assert len(text) > 12
    stop = text[6:9]
    cut = text.index(stop)
    out = engine.generate("Radix trees", SamplingParams(max_new_tokens=60, temperature=0,
                                                        ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.completion_tokens < full.completion_tokens
    clean(engine)


def test_stop_token_ids_and_seeded_sampling(engine):
    full = engine.generate("A system prompt", SamplingParams(max_new_tokens=20, temperature=0,
                                                             ignore_eos=True))
    tok = full.token_ids[5]
    first = full.token_ids.index(tok)
    out = engine.generate("A system prompt", SamplingParams(max_new_tokens=20, temperature=0,
                                                            ignore_eos=True, stop_token_ids=[tok]))
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    a = engine.generate(["Hello there"] * 3, sp)
    b = engine.generate("Hello there", sp)
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids == b.token_ids
    clean(engine)


def test_abandoned_stream_aborts_request(engine):
    params = SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True)

    async def take_two():
        n = 0
        agen = engine.generate_stream("The quick brown fox", params)
        async for _ in agen:
            n += 1
            if n == 2:
                break
        await agen.aclose()

    asyncio.run(take_two())
    clean(engine)  # the abort reached the scheduler; nothing leaked
    assert engine.stats()["num_running"] == 0


@pytest.mark.parametrize("call, field", [
    (lambda e: e.generate("", SamplingParams()), "prompt"),
    (lambda e: e.generate("hi", {"max_new_tokens": 4, "temprature": 0.5}), "temprature"),
    (lambda e: e.generate("hi", {"max_new_tokens": -1}), "max_new_tokens"),
    (lambda e: e.generate("hi", {"top_p": 1.5}), "top_p"),
    (lambda e: e.generate("hi", {"top_p": 0.0}), "top_p"),
    (lambda e: e.generate(input_ids=[1] * 5000, sampling_params=SamplingParams()), "prompt"),
    (lambda e: e.generate(input_ids=[10**9], sampling_params=SamplingParams()), "input_ids"),
    (lambda e: e.chat([{"content": "no role"}]), "messages"),
])
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(engine, call, field):
    with pytest.raises(ValueError, match=field):
        call(engine)
    out = engine.generate("still alive?", SamplingParams(max_new_tokens=3, temperature=0,
                                                         ignore_eos=True))
    assert out.completion_tokens == 3
    clean(engine)


def test_many_concurrent_requests_and_flush(engine):
    prompts = [f"Request number {i} shares this long preamble about radix trees." for i in range(40)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert all(o.completion_tokens == 8 for o in outs)
    clean(engine)
    before = engine.stats()
    assert engine.flush_cache()
    after = engine.stats()
    assert after["free_tokens"] == after["max_total_tokens"]
    # Counters are monotonic: a flush does not reset them.
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]


def test_dead_scheduler_fails_fast(tiny_llama_dir):
    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=2048, num_threads=1)
    try:
        os.kill(eng.launcher.scheduler.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="scheduler"):
            eng.generate("anyone there?", SamplingParams(max_new_tokens=4))
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDeadError):
            eng.generate("and now?", SamplingParams(max_new_tokens=4))
    finally:
        eng.shutdown()
    assert not eng.launcher.detokenizer.is_alive()


def test_children_exit_when_parent_dies(tiny_llama_dir, tmp_path):
    """A parent killed with SIGKILL (no cleanup at all) leaves no orphaned children."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    pidfile = tmp_path / "pids"
    script.write_text(
        "import sys, time\n"
        "from radixrt import Engine\n"
        f"e = Engine(model_path={str(tiny_llama_dir)!r}, max_total_tokens=1024, num_threads=1)\n"
        f"open({str(pidfile)!r}, 'w').write(f'{{e.launcher.scheduler.pid}} {{e.launcher.detokenizer.pid}}')\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        pids = [int(p) for p in pidfile.read_text().split()]
        sockdir = _socket_dir(pids[0])
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, "children outlived their parent"
            time.sleep(0.1)
        assert sockdir is not None and not os.path.exists(sockdir), "socket dir left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _socket_dir(pid: int) -> str | None:
    """The ipc dir of a runtime child, from its command line (the payload lives there)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    payload = next((a.decode() for a in args if a.endswith(b".pkl")), None)
    return os.path.dirname(payload) if payload else None


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().decode(errors="replace").split("\0")
    return dict(kv.split("=", 1) for kv in items if "=" in kv)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
def test_scheduler_waits_briefly_and_the_detokenizer_yields(engine):
    """ServerArgs.thread_wait reaches the scheduler through its environment (OpenMP reads it
    once, at load), no OMP_WAIT_POLICY overriding the spin count; the detokenizer runs
    `helper_nice` below us and waits passively, the scheduler at our priority."""
    sched, detok = engine.launcher.scheduler.pid, engine.launcher.detokenizer.pid
    env = _environ(sched)
    assert env["GOMP_SPINCOUNT"] == str(cpu_policy.BRIEF_SPINCOUNT)
    assert "OMP_WAIT_POLICY" not in env and env["OMP_NUM_THREADS"] == "1"
    assert _environ(detok)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _environ(detok)["OMP_NUM_THREADS"] == "1"
    me = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, sched) == me
    assert os.getpriority(os.PRIO_PROCESS, detok) == min(19, me + engine.args.helper_nice)
    assert engine.info["thread_wait"] == "brief" and engine.info["num_threads"] == 1
