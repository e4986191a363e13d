"""Shared-prefix workloads generated from a seed (no downloads), as token-id prompts.

Text is drawn from a fixed word list with `random.Random(seed)` and tokenized with the default
model's tokenizer (SmolLM2's, ChatML markers `<|im_start|>` / `<|im_end|>`); every segment is
tokenized on its own and the ids concatenated, so lengths are exact and a shared segment is a
shared token prefix. Same seed, same ids.

Workloads (see `PRESETS` for the sizes):
- `gsp`: SGLang's generated shared prefix: G groups x P prompts; a group's prompts share a
  system prompt of S tokens, each adds a question of Q tokens; O output tokens; shuffled.
- `few-shot`: one k-shot preamble (~F tokens) shared by N questions; 1-8 output tokens each.
- `multi-turn`: C conversations x T turns on a shared system prompt; turn t+1 = the whole
  history (turn t's prompt + its answer as generated) + a new user message.
- `agent`: a long tool/instruction preamble shared by all chains; each chain's calls extend the
  previous call's prompt and answer with a tool result.
- `random`: prompts of ~L tokens that share nothing (not even a first token): the control.

Each workload carries `optimal_hit_rate_estimate` = 1 - distinct trie tokens / all prompt
tokens (tokens a previous turn decoded count as cached), with every generated token taken as
new; for chains the exact figure depends on the generated ids and is computed after a run
(`metrics.run_optimal_hit_rate`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse
import functools
import random
from collections.abc import Callable
from typing import Any

from bench.common import Session, Turn, Workload, save_workloads, session_prompts
from bench.metrics import optimal_hit_rate

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be have "
    "had not are but were one all been their has when who will more there can an would so what "
    "out if about up into them some could time only other new two these may then do first any "
    "like now my over such our man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three states himself few house use during without again "
    "place american around however home small found thought went say part once general high upon "
    "school every does got united left number course war until always away something fact "
    "though water less public put think almost hand enough far took head yet government system "
    "better set told nothing night end why called eyes find going look asked later knew point "
    "next program city business give group toward young days let room president side social "
    "given present several order national possible rather second face per among form important "
    "often things looked early white case john become large big need four within felt along "
    "children saw best church ever least power development light thing family interest want "
    "members mind country area others done turned although open god service problem certain "
    "kind different thus began door help sense whole matter perhaps itself york times law human "
    "line above name example action company hands local show whether five history gave today "
    "either act feet across taken past quite anything seen having body several half really field "
    "money river garden market letter report window paper answer question table engine memory "
    "cache prefix token batch server request model layer signal vector matrix tensor kernel"
).split()

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class TextGen:
    """Random words -> token ids of an exact length, with ChatML framing."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = list(self.tok.encode(text, add_special_tokens=False))
        return self._cache[text]

    def words(self, rng: random.Random, n: int) -> str:
        out = []
        for i in range(n):
            w = rng.choice(WORDS)
            out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
            if i % 12 == 11:
                out[-1] += "."
        return " ".join(out)

    def body(self, rng: random.Random, n_tokens: int) -> list[int]:
        """Exactly `n_tokens` ids of random prose (tokenized, then truncated)."""
        if n_tokens <= 0:
            return []
        n_words = max(4, int(n_tokens * 0.9) + 4)
        ids = list(self.tok.encode(self.words(rng, n_words), add_special_tokens=False))
        while len(ids) < n_tokens:
            n_words *= 2
            ids = list(self.tok.encode(self.words(rng, n_words), add_special_tokens=False))
        return ids[:n_tokens]

    def framed(self, rng: random.Random, n_tokens: int, head: str, tail: str,
               lead: str = "") -> list[int]:
        """`head` + `lead` + random prose + `tail`, exactly `n_tokens` ids in all (at least the
        frame's)."""
        h = self.ids(head) + (self.ids(lead) if lead else [])
        t = self.ids(tail)
        return h + self.body(rng, n_tokens - len(h) - len(t)) + t

    def system(self, rng: random.Random, n_tokens: int, lead: str = "") -> list[int]:
        return self.framed(rng, n_tokens, f"{IM_START}system\n", f"{IM_END}\n", lead)

    def user(self, rng: random.Random, n_tokens: int, lead: str = "") -> list[int]:
        """A user message closed by the assistant's opening (ready to generate)."""
        return self.framed(rng, n_tokens, f"{IM_START}user\n",
                           f"{IM_END}\n{IM_START}assistant\n", lead)

    def after_answer_user(self, rng: random.Random, n_tokens: int, lead: str = "") -> list[int]:
        """Closes the previous assistant answer, then a new user message."""
        return self.framed(rng, n_tokens, f"{IM_END}\n{IM_START}user\n",
                           f"{IM_END}\n{IM_START}assistant\n", lead)


def _estimate(sessions: list[Session]) -> float:
    """Optimal hit rate with every generated token taken as new (placeholder ids < 0)."""
    prompts: list[list[int]] = []
    decoded: list[tuple[list[int], int]] = []
    fake = -1
    for s in sessions:
        outs = []
        for t in s.turns:
            outs.append(list(range(fake, fake - t.max_tokens, -1)))
            fake -= t.max_tokens
        ps = session_prompts(s, outs)
        prompts.extend(ps)
        decoded.extend((p + o[:-1], len(p)) for p, o in zip(ps, outs, strict=True))
    return optimal_hit_rate(prompts, decoded)


def _workload(name: str, seed: int, params: dict[str, Any], sessions: list[Session],
              description: str) -> Workload:
    return Workload(name, seed, params, sessions, description, _estimate(sessions))


def gen_gsp(tg: TextGen, seed: int, groups: int, prompts_per_group: int, system_len: int,
            question_len: int, output_len: int) -> Workload:
    rng = random.Random(f"gsp/{seed}")
    items = []
    for g in range(groups):
        sys_ids = tg.system(rng, system_len, lead=f"You are assistant number {g}. ")
        for _ in range(prompts_per_group):
            items.append(sys_ids + tg.user(rng, question_len))
    rng.shuffle(items)
    sessions = [Session(i, 0.0, [Turn(p, output_len)]) for i, p in enumerate(items)]
    return _workload("gsp", seed, dict(groups=groups, prompts_per_group=prompts_per_group,
                                       system_len=system_len, question_len=question_len,
                                       output_len=output_len), sessions,
                     f"{groups} groups x {prompts_per_group} prompts, system {system_len} + "
                     f"question {question_len} tokens, {output_len} out, shuffled")


def gen_few_shot(tg: TextGen, seed: int, num_questions: int, preamble_len: int,
                 question_len: int, max_output: int) -> Workload:
    rng = random.Random(f"few-shot/{seed}")
    pre = tg.system(rng, 24, lead="Answer each question with one word. ")
    k = 0
    while len(pre) < preamble_len:  # whole examples until the preamble reaches its length
        pre += tg.user(rng, question_len, lead="Question: ")
        pre += tg.ids("Answer: ") + tg.body(rng, 2) + tg.ids(f"{IM_END}\n")
        k += 1
    sessions = []
    for i in range(num_questions):
        q = tg.user(rng, question_len, lead="Question: ") + tg.ids("Answer:")
        sessions.append(Session(i, 0.0, [Turn(pre + q, rng.randint(1, max_output))]))
    return _workload("few-shot", seed, dict(num_questions=num_questions, shots=k,
                                            preamble_len=len(pre), question_len=question_len,
                                            max_output=max_output), sessions,
                     f"{k}-shot preamble of {len(pre)} tokens, {num_questions} questions, "
                     f"1-{max_output} out")


def gen_multi_turn(tg: TextGen, seed: int, conversations: int, turns: int, system_len: int,
                   user_len: int, output_len: int) -> Workload:
    rng = random.Random(f"multi-turn/{seed}")
    sys_ids = tg.system(rng, system_len, lead="You are a friendly chat assistant. ")
    sessions = []
    for c in range(conversations):
        ts = [Turn(sys_ids + tg.user(rng, user_len), output_len)]
        ts += [Turn(tg.after_answer_user(rng, user_len), output_len) for _ in range(turns - 1)]
        sessions.append(Session(c, 0.0, ts))
    return _workload("multi-turn", seed, dict(conversations=conversations, turns=turns,
                                              system_len=system_len, user_len=user_len,
                                              output_len=output_len), sessions,
                     f"{conversations} conversations x {turns} turns, system {system_len}, "
                     f"user {user_len}, {output_len} out; each turn resends the history")


def gen_agent(tg: TextGen, seed: int, chains: int, calls: int, preamble_len: int,
              task_len: int, tool_len: int, output_len: int) -> Workload:
    rng = random.Random(f"agent/{seed}")
    pre = tg.system(rng, preamble_len,
                    lead="You are an agent. Tools: search(query), open(url), calc(expr). ")
    sessions = []
    for c in range(chains):
        ts = [Turn(pre + tg.user(rng, task_len, lead="Task: "), output_len)]
        ts += [Turn(tg.after_answer_user(rng, tool_len, lead="Tool result: "), output_len)
               for _ in range(calls - 1)]
        sessions.append(Session(c, 0.0, ts))
    return _workload("agent", seed, dict(chains=chains, calls=calls, preamble_len=preamble_len,
                                         task_len=task_len, tool_len=tool_len,
                                         output_len=output_len), sessions,
                     f"{chains} chains x {calls} calls on a {preamble_len}-token preamble; "
                     "each call extends the previous prompt + answer")


def gen_random(tg: TextGen, seed: int, num_prompts: int, prompt_len: int, output_len: int,
               jitter: float = 0.1) -> Workload:
    """Unframed prose: no chat header, and no two prompts share even their first token."""
    rng = random.Random(f"random/{seed}")
    firsts: set[int] = set()
    sessions = []
    lo, hi = int(prompt_len * (1 - jitter)), int(prompt_len * (1 + jitter))
    while len(sessions) < num_prompts:
        ids = tg.body(rng, rng.randint(lo, hi))
        if ids[0] in firsts:
            continue
        firsts.add(ids[0])
        sessions.append(Session(len(sessions), 0.0, [Turn(ids, output_len)]))
    return _workload("random", seed, dict(num_prompts=num_prompts, prompt_len=prompt_len,
                                          output_len=output_len), sessions,
                     f"{num_prompts} unrelated prompts of ~{prompt_len} tokens, {output_len} out")


GENERATORS: dict[str, Callable[..., Workload]] = {
    "gsp": gen_gsp, "few-shot": gen_few_shot, "multi-turn": gen_multi_turn, "agent": gen_agent,
    "random": gen_random,
}
WORKLOADS = tuple(GENERATORS)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "gsp": dict(groups=8, prompts_per_group=8, system_len=512, question_len=48,
                    output_len=32),
        "few-shot": dict(num_questions=32, preamble_len=600, question_len=24, max_output=8),
        "multi-turn": dict(conversations=8, turns=4, system_len=192, user_len=48,
                           output_len=32),
        "agent": dict(chains=4, calls=4, preamble_len=700, task_len=48, tool_len=64,
                      output_len=32),
        "random": dict(num_prompts=32, prompt_len=300, output_len=32),
    },
    "tiny": {
        "gsp": dict(groups=2, prompts_per_group=2, system_len=64, question_len=16,
                    output_len=4),
        "few-shot": dict(num_questions=4, preamble_len=64, question_len=12, max_output=4),
        "multi-turn": dict(conversations=2, turns=2, system_len=32, user_len=12, output_len=4),
        "agent": dict(chains=1, calls=2, preamble_len=64, task_len=12, tool_len=12,
                      output_len=4),
        "random": dict(num_prompts=4, prompt_len=32, output_len=4),
    },
}


# The full preset's workloads with enough sessions to keep 64 requests in flight
# (`--max-concurrency 64`): the same shapes, more sessions.
def _derived(base: str, changes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Preset `base` with `changes[i]` applied to its i-th workload (in WORKLOADS order)."""
    return {name: {**params, **more}
            for (name, params), more in zip(PRESETS[base].items(), changes, strict=True)}


PRESETS["wide"] = _derived("full", [dict(prompts_per_group=16), dict(num_questions=128),
                                    dict(conversations=64), dict(chains=64),
                                    dict(num_prompts=128)])

# The full preset's prompts with chat-length answers: decode-bound traffic, where the step's
# speed at 8 rows decides, not the prefix reuse (few-shot keeps its one-word answers).
_LONG_ANSWERS = [dict(output_len=256), {}, dict(output_len=192), dict(output_len=128),
                 dict(output_len=256)]
PRESETS["long"] = _derived("full", _LONG_ANSWERS)
# ... and `wide`'s sessions with those answers, for 64 in flight.
PRESETS["wide-long"] = _derived("wide", _LONG_ANSWERS)

# Long shared prefixes (a document under several questions, a long system prompt or tool
# preamble, 2k-token unrelated prompts): long-context attention decides, in the prefill of the
# first request of a prefix, in each later request's extend over it and in every decode step.
PRESETS["long-context"] = {
    "gsp": dict(groups=4, prompts_per_group=8, system_len=4096, question_len=48, output_len=64),
    "few-shot": dict(num_questions=32, preamble_len=3072, question_len=24, max_output=8),
    "multi-turn": dict(conversations=8, turns=4, system_len=2048, user_len=96, output_len=64),
    "agent": dict(chains=4, calls=4, preamble_len=3072, task_len=48, tool_len=256,
                  output_len=64),
    "random": dict(num_prompts=16, prompt_len=2048, output_len=64),
}


@functools.lru_cache(maxsize=2)
def default_tokenizer(model_path: str | None = None) -> Any:
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    return load_tokenizer(model_path or default_model_path())


def make_workload(name: str, seed: int = 0, tokenizer: Any = None, **params: Any) -> Workload:
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    return GENERATORS[name](TextGen(tokenizer or default_tokenizer()), seed, **params)


def make_preset(preset: str, seed: int = 0, names: list[str] | None = None,
                tokenizer: Any = None, request_rate: float | None = None) -> list[Workload]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {tuple(PRESETS)}")
    tok = tokenizer or default_tokenizer()
    out = []
    for name, params in PRESETS[preset].items():
        if names and name not in names:
            continue
        w = make_workload(name, seed, tok, **params)
        out.append(w.with_arrivals(request_rate) if request_rate else w)
    return out


def describe(w: Workload) -> str:
    n_prompt = sum(len(t.append) for s in w.sessions for t in s.turns)
    return (f"{w.name:11s} {w.num_requests:3d} requests in {len(w.sessions):2d} sessions, "
            f"{n_prompt} new prompt tokens, optimal hit rate (estimate) "
            f"{w.optimal_hit_rate_estimate:.3f}: {w.description}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Generate the benchmark workloads as token ids.")
    ap.add_argument("--preset", default="full", choices=tuple(PRESETS))
    ap.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-rate", type=float, default=None,
                    help="Poisson arrivals of sessions (default: all at once)")
    ap.add_argument("--out", default=None, help="write the workloads as JSON here")
    a = ap.parse_args()
    ws = make_preset(a.preset, a.seed, a.workloads, request_rate=a.request_rate)
    for w in ws:
        print(describe(w))
    if a.out:
        save_workloads(a.out, ws)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
