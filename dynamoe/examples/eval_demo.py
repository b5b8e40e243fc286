"""Evaluate the demo model on held-out prompts, per skill.

Usage: python -m dynamoe.examples.eval_demo [--model DIR] [--n-per-group 40] [--json FILE] [--update-card]

The prompts come from :mod:`dynamoe.examples.demo_data`'s held-out split (problems never seen in
training), plus, for code, the six canonical requests ("Write a Python code of the Quicksort
algorithm." ...). Replies are generated greedily by dynamoe's :class:`~dynamoe.engine.GenerationEngine`.

Scoring: exact match of the reply's final answer (:func:`~dynamoe.examples.demo_data.final_answer`:
the last number, list or quoted word) against the expected one. Code replies are executed in a
separate Python process (``python -I``, CPU and memory limits, ``--code-timeout`` seconds) that calls
the function on test inputs (:data:`CODE_TESTS`); a crash, a wrong result or a hang is a failure.

Targets (from the issue): >= 95% on 2-digit arithmetic, >= 90% on sorting/reversing lists, all six
algorithms pass their tests. ``--update-card`` writes the table into the model card (README.md).

``--harness-per-group N`` (default 20) scores N of each target group's prompts again inside what an
agent harness sends (:func:`dynamoe.examples.demo_context.wrap`, ``--harness-chars`` of system text,
about as much as Claude Code sends: system blocks, a system message after the user's turn, offered
tools, reminder blocks in the user's message), under the same targets, as groups ``GROUP@harness``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from . import demo_context, demo_data
from .train_demo import CARD_SCORES_END, CARD_SCORES_START, DEFAULT_OUT

__all__ = ["CODE_TESTS", "run_code_tests", "score", "eval_set", "evaluate", "report_rows", "format_table",
           "update_card", "TARGETS", "main"]

# --------------------------------------------------------------------------------- code tests
_SORT_CASES = [[3, 6, 8, 10, 1, 2, 1], [], [5], [2, 1], [-3, 7, 0, -3, 12, 5], list(range(9, -1, -1)),
               [41, 7, 93, 7, 0, 58, 22, 22, 64, 15, 88, 3, 71, 36, 50]]
_FIB = [0, 1]
for _ in range(40):
    _FIB.append(_FIB[-1] + _FIB[-2])
_FACT = [1]
for _i in range(1, 21):
    _FACT.append(_FACT[-1] * _i)

#: algorithm -> function names to look for, and (args, expected) cases; "inplace": a None return
#: is accepted when the first argument was sorted in place
CODE_TESTS = {
    "quicksort": {"names": ["quicksort", "quick_sort"], "inplace": True,
                  "cases": [([xs], sorted(xs)) for xs in _SORT_CASES]},
    "bubble_sort": {"names": ["bubble_sort", "bubblesort"], "inplace": True,
                    "cases": [([xs], sorted(xs)) for xs in _SORT_CASES]},
    "binary_search": {"names": ["binary_search", "binarysearch"], "inplace": False,
                      "cases": [([[1, 3, 5, 7, 9, 11], 7], 3), ([[1, 3, 5, 7, 9, 11], 1], 0),
                                ([[1, 3, 5, 7, 9, 11], 11], 5), ([[1, 3, 5, 7, 9, 11], 4], -1),
                                ([[1, 3, 5, 7, 9, 11], 12], -1), ([[], 3], -1), ([[5], 5], 0),
                                ([list(range(0, 100, 3)), 42], 14), ([list(range(0, 100, 3)), 43], -1)]},
    "fibonacci": {"names": ["fibonacci", "fib"], "inplace": False,
                  "cases": [([n], _FIB[n]) for n in (0, 1, 2, 3, 5, 10, 15, 30)]},
    "factorial": {"names": ["factorial", "fact"], "inplace": False,
                  "cases": [([n], _FACT[n]) for n in (0, 1, 2, 5, 10, 20)]},
    "gcd": {"names": ["gcd"], "inplace": False,
            "cases": [([48, 18], 6), ([18, 48], 6), ([17, 5], 1), ([0, 7], 7), ([7, 0], 7), ([100, 75], 25),
                      ([270, 192], 6)]},
}

_HARNESS = r'''
import contextlib, copy, inspect, io, json, sys
src = open(sys.argv[1], encoding="utf-8").read()
spec = json.load(open(sys.argv[2], encoding="utf-8"))
def done(ok, detail=""):
    sys.__stdout__.write(json.dumps({"ok": ok, "detail": detail}) + "\n")
    sys.exit(0)
ns = {"__name__": "__answer__"}
with contextlib.redirect_stdout(io.StringIO()):
    exec(compile(src, "<answer>", "exec"), ns)
fn = next((ns[n] for n in spec["names"] if callable(ns.get(n))), None)
if fn is None:
    mine = [v for v in ns.values() if inspect.isfunction(v) and v.__module__ == "__answer__"]
    if len(mine) != 1:
        done(False, "no function named " + " or ".join(spec["names"]))
    fn = mine[0]
for args, expected in spec["cases"]:
    call = copy.deepcopy(args)
    with contextlib.redirect_stdout(io.StringIO()):
        got = fn(*call)
    if got is None and spec["inplace"]:
        got = call[0]
    if got != expected:
        done(False, "%s(%s) returned %r, expected %r" % (fn.__name__, ", ".join(map(repr, args)), got, expected))
done(True)
'''


def _limits(timeout: float):
    def apply():  # in the child, before exec: CPU seconds and address space
        try:
            import resource
            cpu = int(timeout) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
            resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        except (ImportError, ValueError, OSError):
            pass
    return apply if os.name == "posix" else None


def run_code_tests(algo: str, code: str, timeout: float = 5.0) -> tuple[bool, str]:
    """Run ``code`` in a fresh ``python -I`` process and call its ``algo`` function on :data:`CODE_TESTS`.
    Returns (passed, detail); a crash, a wrong result or running past ``timeout`` seconds fails."""
    if algo not in CODE_TESTS:
        raise ValueError(f"algo must be one of {sorted(CODE_TESTS)}, got {algo!r}")
    with tempfile.TemporaryDirectory(prefix="dynamoe-eval-") as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("answer.py", "spec.json", "harness.py")}
        with open(paths["answer.py"], "w", encoding="utf-8") as f:
            f.write(code)
        with open(paths["spec.json"], "w", encoding="utf-8") as f:
            json.dump(CODE_TESTS[algo], f)
        with open(paths["harness.py"], "w", encoding="utf-8") as f:
            f.write(_HARNESS)
        try:
            proc = subprocess.run([sys.executable, "-I", paths["harness.py"], paths["answer.py"], paths["spec.json"]],
                                  capture_output=True, text=True, timeout=timeout, cwd=tmp,
                                  preexec_fn=_limits(timeout))
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:g}s"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return False, f"error: {err}"
    result = json.loads(lines[-1])
    return bool(result["ok"]), result["detail"]


# --------------------------------------------------------------------------------- scoring
def score(example: demo_data.Example, reply: str, code_timeout: float = 5.0) -> tuple[bool, str]:
    """(correct, detail) of ``reply`` for ``example``: exact match of the final answer; code is run."""
    if example.skill == "code":
        return run_code_tests(example.answer, demo_data.code_block(reply), code_timeout)
    got = demo_data.final_answer(example.group.split("@")[0], reply)
    return got == example.answer, f"got {got!r}, expected {example.answer!r}"


def eval_set(n_per_group: int = 40, seed: int = 1000) -> list[demo_data.Example]:
    """Held-out examples, up to ``n_per_group`` distinct problems per group (arithmetic by digits),
    every held-out code wording, and the six canonical code requests (group ``code-canonical``)."""
    buckets: dict[str, list] = {}
    seen = set()
    for i, skill in enumerate(s for s in demo_data.SKILLS if s not in ("code", "chat")):
        # a few chunks per skill: rare groups (1-digit arithmetic has few held-out problems) stay short
        for chunk in range(4):
            for ex in demo_data.generate(seed + 1000 * i + chunk, 4 * n_per_group, "held_out", skills=[skill]):
                if ex.key in seen or len(buckets.setdefault(ex.group, [])) >= n_per_group:
                    continue
                seen.add(ex.key)
                buckets[ex.group].append(ex)
            groups = [g for g in buckets if g.split("-")[0] == skill.split("-")[0]] or [skill]
            if all(len(buckets.get(g, [])) >= n_per_group for g in groups):
                break
    out = [ex for g in sorted(buckets, key=_group_order) for ex in buckets[g]]
    for algo in demo_data.ALGORITHMS:
        reply = demo_data.code_reply(algo)
        for p in demo_data.code_prompts(algo):
            key = f"code:{p}"
            if demo_data.is_held_out(key) and p not in demo_data.CANONICAL_CODE_PROMPTS.values():
                out.append(demo_data.Example("code", f"code-{algo}", [{"role": "user", "content": p},
                                                                      {"role": "assistant", "content": reply}], algo, key))
        p = demo_data.CANONICAL_CODE_PROMPTS[algo]
        out.append(demo_data.Example("code", "code-canonical", [{"role": "user", "content": p},
                                                                {"role": "assistant", "content": reply}], algo,
                                     f"code:{p}", {"canonical": True}))
    return out


HARNESS_SUFFIX = "@harness"


def harness_set(examples: list[demo_data.Example], per_group: int, chars: int, seed: int = 77) -> list[demo_data.Example]:
    """Up to ``per_group`` examples of each target group, wrapped in a harness context of about ``chars``
    characters (their group gets :data:`HARNESS_SUFFIX`; the offered tools go in ``meta['tools']``)."""
    groups = {g for _, gs, _ in TARGETS for g in gs}
    rng, taken, out = random.Random(seed), {}, []
    for ex in examples:
        if ex.group not in groups or taken.get(ex.group, 0) >= per_group:
            continue
        taken[ex.group] = taken.get(ex.group, 0) + 1
        messages, tools = demo_context.wrap(rng, ex.messages, max_chars=chars)
        messages[-1] = ex.messages[-1]
        out.append(demo_data.Example(ex.skill, ex.group + HARNESS_SUFFIX, messages, ex.answer, ex.key,
                                     {**ex.meta, "tools": tools}))
    return out


@dataclass
class Result:
    example: demo_data.Example
    reply: str
    correct: bool
    detail: str


def generate_replies(model, tokenizer, prompts: list[list[dict]], max_tokens: int = 320, batch: int = 8,
                     progress: bool = False, tools: list | None = None) -> list[str]:
    """Greedy replies for many chat prompts (``tools``: each one's offered tools, or None), batched by
    dynamoe's engine (continuous batching)."""
    from ..engine import GenerationEngine, SamplingParams

    tools = tools or [None] * len(prompts)
    ids = [tokenizer.encode_chat(p, tools=t) for p, t in zip(prompts, tools)]
    longest = max((len(i) for i in ids), default=0) + max_tokens
    engine = GenerationEngine(model, tokenizer, max_seq_len=min(model.config.max_position_embeddings, max(longest, 512)),
                              max_batch=batch, prefill_chunk=2048)
    greedy = SamplingParams(temperature=0.0)
    reqs = [engine.add_request(i, greedy, max_tokens, clip_max_tokens=True) for i in ids]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), unit="prompt", file=sys.stderr)
    done = 0
    while engine.has_work():
        engine.step()
        now = sum(r.finished for r in reqs)
        if bar is not None:
            bar.update(now - done)
        done = now
    if bar is not None:
        bar.close()
    return [tokenizer.decode(r.output_ids) for r in reqs]


def evaluate(model, tokenizer, examples: list[demo_data.Example], max_tokens: int = 320, code_timeout: float = 5.0,
             progress: bool = False) -> list[Result]:
    replies = generate_replies(model, tokenizer, [ex.prompt for ex in examples], max_tokens, progress=progress,
                               tools=[ex.meta.get("tools") for ex in examples])
    return [Result(ex, r, *score(ex, r, code_timeout)) for ex, r in zip(examples, replies)]


# --------------------------------------------------------------------------------- report
#: (row name, groups it aggregates, target accuracy or None)
TARGETS = [
    ("arithmetic, 2 digits", ("add-2d", "sub-2d", "mul-2d"), 0.95),
    ("sort / reverse lists", ("sort", "sort-desc", "reverse-list"), 0.90),
    ("code, canonical requests", ("code-canonical",), 1.0),
]


def report_rows(results: list[Result]) -> list[dict]:
    """Per group, then the target rows: name, n, correct, accuracy, target, met."""
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.example.group, []).append(r)
    rows = []
    for g in sorted(by, key=_group_order):
        rs = by[g]
        rows.append({"name": g, "n": len(rs), "correct": sum(r.correct for r in rs), "target": None})
    for suffix, what in (("", ""), (HARNESS_SUFFIX, ", in a harness context")):
        for name, groups, target in TARGETS:
            rs = [r for g in groups for r in by.get(g + suffix, [])]
            if rs:
                rows.append({"name": name + what, "n": len(rs), "correct": sum(r.correct for r in rs), "target": target})
    algos = {r.example.answer for r in by.get("code-canonical", []) if r.correct}
    if by.get("code-canonical"):
        rows.append({"name": "algorithms passing (canonical request)", "n": len(demo_data.ALGORITHMS),
                     "correct": len(algos), "target": 1.0})
    for row in rows:
        row["accuracy"] = row["correct"] / row["n"] if row["n"] else 0.0
        row["met"] = None if row["target"] is None else row["accuracy"] >= row["target"]
    return rows


def _group_order(g: str):
    order = ["add", "sub", "mul", "sort", "reverse", "word", "letter", "units", "code"]
    return next((i for i, p in enumerate(order) if g.startswith(p)), len(order)), g


def format_table(rows: list[dict]) -> str:
    """A Markdown table of :func:`report_rows`."""
    lines = ["| skill | n | correct | accuracy | target |", "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        target = "" if r["target"] is None else f"≥ {r['target']:.0%} {'✅' if r['met'] else '❌'}"
        lines.append(f"| {r['name']} | {r['n']} | {r['correct']} | {r['accuracy']:.1%} | {target} |")
    return "\n".join(lines)


def update_card(card_path: str, table: str, command: str) -> None:
    """Replace the scores section of the model card (between the eval-scores markers) with ``table``."""
    with open(card_path, encoding="utf-8") as f:
        text = f.read()
    if CARD_SCORES_START not in text or CARD_SCORES_END not in text:
        raise ValueError(f"{card_path} has no scores section ({CARD_SCORES_START} ... {CARD_SCORES_END})")
    head, rest = text.split(CARD_SCORES_START, 1)
    _, tail = rest.split(CARD_SCORES_END, 1)
    body = f"{CARD_SCORES_START}\n`{command}`\n\n{table}\n{CARD_SCORES_END}"
    with open(card_path, "w", encoding="utf-8") as f:
        f.write(head + body + tail)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_OUT, help="HF folder of the demo model")
    p.add_argument("--n-per-group", type=int, default=40, help="held-out problems per group")
    p.add_argument("--seed", type=int, default=1000, help="seed of the held-out sample")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--code-timeout", type=float, default=5.0, help="seconds per code answer")
    p.add_argument("--harness-per-group", type=int, default=20,
                   help="prompts of each target group scored again inside a harness context (0: none)")
    p.add_argument("--harness-chars", type=int, default=12000, help="characters of harness text around each of them")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--json", default=None, help="also write rows and every reply to this JSON file")
    p.add_argument("--update-card", action="store_true", help="write the table into MODEL/README.md")
    p.add_argument("--show-failures", type=int, default=3, help="print this many failed replies per group")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = p.parse_args(argv)
    if args.n_per_group < 1:
        p.error(f"argument --n-per-group: must be >= 1, got {args.n_per_group}")
    if not os.path.isdir(args.model):
        p.error(f"argument --model: {args.model!r} is not a folder (train it first: python -m dynamoe.examples.train_demo)")
    from ..engine import load

    model, tokenizer = load(args.model, dtype=args.dtype)
    examples = eval_set(args.n_per_group, args.seed)
    if args.harness_per_group:
        examples += harness_set(examples, args.harness_per_group, args.harness_chars)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    results = evaluate(model, tokenizer, examples, args.max_tokens, args.code_timeout, progress)
    rows = report_rows(results)
    table = format_table(rows)
    shown: dict[str, int] = {}
    for r in results:
        if not r.correct and shown.get(r.example.group, 0) < args.show_failures:
            shown[r.example.group] = shown.get(r.example.group, 0) + 1
            question = r.example.prompt[-1]["content"]
            question = question if isinstance(question, str) else question[-1]["text"]
            print(f"[fail] {r.example.group}: {question[-200:]!r} -> {r.reply!r:.300} ({r.detail})")
    print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "results": [{"group": r.example.group, "prompt": r.example.prompt,
                                                   "reply": r.reply, "answer": r.example.answer,
                                                   "correct": r.correct, "detail": r.detail} for r in results]},
                      f, indent=1, ensure_ascii=False)
    if args.update_card:
        cmd = "python -m dynamoe.examples.eval_demo" + (f" --n-per-group {args.n_per_group}" if args.n_per_group != 40 else "")
        cmd += f" --harness-per-group {args.harness_per_group}" if args.harness_per_group != 20 else ""
        update_card(os.path.join(args.model, "README.md"), table, cmd)
        print(f"[card] scores written to {os.path.join(args.model, 'README.md')}")
    return rows


if __name__ == "__main__":
    main()
