"""The demo model's training data: a deterministic synthetic chat corpus, several skills in many phrasings.

Skills (``Example.skill``) and the eval groups they report under (``Example.group``):

* ``add`` / ``sub`` / ``mul`` -- integer arithmetic on 1-3 digit numbers (group ``add-2d``: the larger
  operand has 2 digits). Answers work column by column from the ones (carries and borrows written
  out); a difference compares the operands first (``60 - 69: 60 < 69, so 60 - 69 = -(69 - 60): ...``);
  a product is long multiplication: the other factor times each digit of the multiplier with carries
  (``75 × 8: 5 × 8 = 40, 7 × 8 + 4 = 60, so 600``), shifted, and the rows added by columns two at a
  time; 1-digit problems answer directly.
* ``sort`` / ``sort-desc`` / ``reverse-list`` -- lists of 2-7 integers in 0..99 (some in 0..9 only).
* ``reverse-word`` / ``word-length`` / ``letter-count`` -- characters of English words; answers spell
  the word out first (``p-l-a-n-e-t``), which the tokenizer splits into single letters.
* ``units`` -- km/m/cm, kg/g, hours/minutes, °C/°F. Rounding rule: results are exact or rounded to one
  decimal, half away from zero (Decimal ``ROUND_HALF_UP``); trailing zeros are dropped (``2.5``, ``77``).
* ``code`` -- quicksort, binary search, fibonacci, factorial, bubble sort, gcd in Python, asked in many
  wordings ("Write a Python code of the Quicksort algorithm." among them); one canonical, tested answer
  per algorithm (:data:`CODE`), function names in :data:`CODE_FUNCTIONS`.
* ``chat`` -- greetings and "what can you do" (training only).

Every reply ends with its final answer, which :func:`final_answer` extracts (the last number, list or
quoted word); ``Example.answer`` is the expected one (for code: the algorithm's name).

Split: a problem's *key* (the operands of an arithmetic problem -- unordered for + and ×, the list,
the word and letter, the quantity, the code prompt's wording) is held out when a hash of
``(split_seed, key)`` falls under ``held_out_fraction``. Training examples are drawn from the other
keys only, so held-out prompts never occur in training (for arithmetic: disjoint operand pairs).

Same ``seed`` -> byte-identical output (only ``random.Random(seed)`` and ``hashlib`` are used).
``python -m dynamoe.examples.demo_data --n 20 --split held_out`` prints a few as JSON lines.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from dataclasses import asdict, dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Callable, Iterable, Optional

from .demo_code import (ALGORITHMS, CANONICAL_CODE_PROMPTS, CODE, CODE_FUNCTIONS, code_prompts,
                        code_reply, make_code)

__all__ = ["Example", "generate", "SKILLS", "TRAIN_WEIGHTS", "CODE", "CODE_FUNCTIONS", "ALGORITHMS",
           "CANONICAL_CODE_PROMPTS", "code_prompts", "code_reply", "final_answer", "is_held_out", "write_jsonl",
           "code_block", "conversation_text"]

SPLITS = ("train", "held_out")
#: bumped whenever a reply format or the mixture changes (cached training data is rebuilt)
DATA_VERSION = 6
DEFAULT_SPLIT_SEED = 1234
DEFAULT_HELD_OUT_FRACTION = 0.1
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a small demo model trained with dynamoe.",
                  "Answer concisely.")


@dataclass
class Example:
    """One conversation. ``messages``: [{role, content}] (the last one the assistant's reply);
    ``answer``: the expected final answer; ``key``: the problem's identity for the split."""

    skill: str
    group: str
    messages: list
    answer: str
    key: str
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @property
    def prompt(self) -> list:
        """The messages without the final assistant reply."""
        return self.messages[:-1]

    @property
    def reply(self) -> str:
        return self.messages[-1]["content"]


def is_held_out(key: str, split_seed: int = DEFAULT_SPLIT_SEED, fraction: float = DEFAULT_HELD_OUT_FRACTION) -> bool:
    """Whether problem ``key`` belongs to the held-out split (a hash, so any process agrees)."""
    h = int.from_bytes(hashlib.sha256(f"{split_seed}:{key}".encode()).digest()[:8], "big")
    return h % 1_000_000 < round(fraction * 1_000_000)


# ------------------------------------------------------------------------------------ formatting
def fmt_num(x) -> str:
    """A number as the corpus writes it: integers plainly, decimals without trailing zeros."""
    d = Decimal(x) if not isinstance(x, Decimal) else x
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def round1(d: Decimal) -> Decimal:
    """The corpus's rounding rule: one decimal, half away from zero."""
    return d.quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)


def fmt_list(xs) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")
_LIST_RE = re.compile(r"\[[^\[\]]*\]")
_QUOTED_RE = re.compile(r'"([^"\n]*)"')


def final_answer(group_or_skill: str, text: str) -> Optional[str]:
    """The final answer of a reply: the last list (list skills), the last quoted word (reverse-word),
    the code block (code), else the last number; None when there is none."""
    skill = group_or_skill.split("-")[0] if group_or_skill.startswith(("add", "sub", "mul")) else group_or_skill
    if skill.startswith("code"):
        return code_block(text)
    if skill in ("sort", "sort-desc", "reverse-list"):
        found = _LIST_RE.findall(text)
        return re.sub(r"\s+", " ", found[-1]).strip() if found else None
    if skill == "reverse-word":
        found = _QUOTED_RE.findall(text)
        return found[-1] if found else None
    found = _NUM_RE.findall(text.replace("−", "-"))
    return fmt_num(Decimal(found[-1])) if found else None


def code_block(text: str) -> str:
    """The first fenced code block of ``text`` (```python ... ```), or the whole text without fences."""
    m = re.search(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", text, re.S)
    return (m.group(1) if m else text).strip("\n") + "\n"


def conversation_text(messages) -> str:
    """A readable one-line summary (for logs)."""
    return " | ".join(f"{m['role']}: {m['content']!r:.80}" for m in messages)


# ------------------------------------------------------------------------------------ arithmetic
_OPS = {"add": ("+", lambda a, b: a + b), "sub": ("-", lambda a, b: a - b), "mul": ("×", lambda a, b: a * b)}
_ARITH_PROMPTS = {
    "add": ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "Calculate {a} + {b}", "{a} + {b} = ?",
            "Add {a} and {b}.", "What do you get when you add {a} and {b}?", "How much is {a} plus {b}?",
            "What's the sum of {a} and {b}?", "Please add {a} to {b}.", "{a}+{b}", "Find the sum of {a} and {b}."],
    "sub": ["What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.", "Calculate {a} − {b}", "{a} - {b} = ?",
            "Subtract {b} from {a}.", "How much is {a} minus {b}?", "What is the difference {a} - {b}?",
            "Take {b} away from {a}.", "{a}-{b}", "What's {a} − {b}?", "Find {a} minus {b}."],
    "mul": ["What is {a} × {b}?", "What is {a} times {b}?", "Compute {a} * {b}.", "Calculate {a} × {b}", "{a} * {b} = ?",
            "Multiply {a} by {b}.", "What do you get when you multiply {a} and {b}?", "How much is {a} times {b}?",
            "What's the product of {a} and {b}?", "{a}*{b}", "{a} x {b} = ?", "Find the product of {a} and {b}."],
}


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _digits_pair(rng: random.Random, op: str) -> tuple[int, int]:
    # 2-digit problems dominate (the demo's target); multiplication stays at most 3 x 2 digits
    r = rng.random()
    if r < 0.15:
        da, db = rng.choice([(1, 1), (1, 2), (2, 1)])
    elif r < 0.75:
        da, db = 2, 2
    else:
        da, db = rng.choice([(3, 3), (3, 2), (2, 3), (3, 1)]) if op != "mul" else rng.choice([(3, 1), (3, 2), (2, 3), (1, 3)])
    return da, db


def _digits(n: int, width: int) -> list[int]:
    """The decimal digits of ``n`` >= 0, ones first, padded with zeros to ``width``."""
    s = str(n)[::-1]
    return [int(s[i]) if i < len(s) else 0 for i in range(width)]


def column_add(terms: list[int]) -> str:
    """Column-by-column addition of non-negative ``terms``, ones first: ``"4 + 8 = 12, 5 + 1 + 1 = 7"``
    (the carry is added as its own term; the last column's sum is written whole)."""
    width = max(len(str(t)) for t in terms)
    cols = list(zip(*(_digits(t, width) for t in terms)))
    steps, carry = [], 0
    for col in cols:
        s = sum(col) + carry
        expr = " + ".join(map(str, col)) + (f" + {carry}" if carry else "")
        steps.append(f"{expr} = {s}")
        carry = s // 10
    return ", ".join(steps)


def column_sub(a: int, b: int) -> str:
    """Column-by-column subtraction ``a - b`` with ``a >= b >= 0``, ones first: a column that must borrow
    is written ``"12 - 7 = 5"``, the next one takes the borrow as ``"- 1"``: ``"8 - 1 - 3 = 4"``."""
    width = len(str(a))
    steps, borrow = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        take = f" - {borrow}" if borrow else ""
        if x - borrow >= y:
            steps.append(f"{x}{take} - {y} = {x - borrow - y}")
            borrow = 0
        else:
            steps.append(f"1{x}{take} - {y} = {10 + x - borrow - y}")
            borrow = 1
    return ", ".join(steps)

def _add_reply(a: int, b: int) -> str:
    if max(a, b) < 10:
        return f"{a} + {b} = {a + b}"
    return f"{a} + {b}: {column_add([a, b])}, so {a} + {b} = {a + b}"


def _compare(a: int, b: int) -> str:
    return f"{a} {'<' if a < b else '>' if a > b else '='} {b}"


def _sub_reply(a: int, b: int) -> str:
    """``a - b``: 1-digit problems answer directly; otherwise the operands are compared first (the sign
    of the result is decided in its own step), then the smaller is taken from the larger by columns:
    ``60 - 69: 60 < 69, so 60 - 69 = -(69 - 60): 9 - 0 = 9, 6 - 6 = 0, so 60 - 69 = -9``."""
    if max(a, b) < 10:
        return f"{a} - {b} = -({b} - {a}) = {a - b}" if a < b else f"{a} - {b} = {a - b}"
    if a < b:  # a - b = -(b - a): subtract the smaller from the larger, then negate
        return f"{a} - {b}: {_compare(a, b)}, so {a} - {b} = -({b} - {a}): {column_sub(b, a)}, so {a} - {b} = {a - b}"
    return f"{a} - {b}: {_compare(a, b)}, so {column_sub(a, b)}, so {a} - {b} = {a - b}"


def place_parts(n: int) -> list[int]:
    """The nonzero place-value parts of ``n`` >= 0, largest first: 305 -> [300, 5]; 0 -> []."""
    s = str(n)
    return [int(c) * 10 ** (len(s) - 1 - i) for i, c in enumerate(s) if c != "0"]


def times_digit(m: int, d: int) -> str:
    """Schoolbook ``m × d`` for one digit ``d``, the digits of ``m`` from the ones, each product taking
    the previous carry: ``"5 × 8 = 40, 7 × 8 + 4 = 60"`` (75 × 8; each product's last digit is written,
    the rest carried; the last product is written whole)."""
    steps, carry = [], 0
    for x in _digits(m, len(str(m))):
        p = x * d + carry
        steps.append(f"{x} × {d}" + (f" + {carry}" if carry else "") + f" = {p}")
        carry = p // 10
    return ", ".join(steps)


def _mul_reply(a: int, b: int) -> str:
    """Long multiplication: the factor with fewer nonzero digits (the multiplier) is taken digit by
    digit; each row multiplies the other factor by one digit with carries (:func:`times_digit`), shifted
    by the digit's place; the rows are then added by columns, two at a time:
    ``75 × 68: 75 × 8: 5 × 8 = 40, 7 × 8 + 4 = 60, so 600; 75 × 6: ..., so 450, so 75 × 60 = 4500;
    600 + 4500: ..., so 5100; so 75 × 68 = 5100``. Products of single-digit parts answer directly."""
    r = a * b
    pa, pb = place_parts(a), place_parts(b)
    if len(pa) <= 1 and len(pb) <= 1 or r == 0:
        return f"{a} × {b} = {r}"
    m, n = (a, b) if (len(pb), len(str(b))) <= (len(pa), len(str(a))) else (b, a)
    head = f"{a} × {b}" + (f" = {m} × {n}" if m != a else "")
    rows, parts = [], []
    for part in reversed(place_parts(n)):  # ones first
        d = int(str(part)[0])
        row = f"{m} × {d}: {times_digit(m, d)}, so {m * d}"
        if part != d:
            row += f", so {m} × {part} = {m * part}"
        rows.append(row)
        parts.append(m * part)
    acc = parts[0]
    for p in parts[1:]:
        rows.append(f"{acc} + {p}: {column_add([acc, p])}, so {acc + p}")
        acc += p
    return f"{head}: {'; '.join(rows)}; so {a} × {b} = {r}"


_REPLIES = {"add": _add_reply, "sub": _sub_reply, "mul": _mul_reply}


def _arith(op: str) -> Callable:
    def make(rng: random.Random):
        da, db = _digits_pair(rng, op)
        a, b = _operand(rng, da), _operand(rng, db)
        if op == "sub" and da == db > 1 and rng.random() < 0.25:  # same leading digit: the sign is in the ones
            b = int(str(a)[0] + str(b)[1:])
        fn = _OPS[op][1]
        key = f"{op}:{min(a, b)},{max(a, b)}" if op in ("add", "mul") else f"{op}:{a},{b}"
        prompt = rng.choice(_ARITH_PROMPTS[op]).format(a=a, b=b)
        reply = _REPLIES[op](a, b)
        group = f"{op}-{max(len(str(a)), len(str(b)))}d"
        return key, group, prompt, reply, str(fn(a, b))
    return make


# ------------------------------------------------------------------------------------ lists
_LIST_PROMPTS = {
    "sort": ["Sort the list {l} in ascending order.", "Sort {l}.", "Sort these numbers from smallest to largest: {c}",
             "Put {l} in increasing order.", "Can you sort {l}?", "Arrange {c} in ascending order.",
             "Order the numbers {c} from lowest to highest.", "sort {l}"],
    "sort-desc": ["Sort the list {l} in descending order.", "Sort these numbers from largest to smallest: {c}",
                  "Put {l} in decreasing order.", "Arrange {c} in descending order.",
                  "Order the numbers {c} from highest to lowest.", "Sort {l} in reverse order."],
    "reverse-list": ["Reverse the list {l}.", "Reverse {l}.", "Write the list {l} backwards.",
                     "What is {l} reversed?", "Reverse the order of these numbers: {c}", "reverse {l}"],
}


def _list_task(task: str) -> Callable:
    def make(rng: random.Random):
        hi = 9 if rng.random() < 0.15 else 99  # some lists of 1-digit numbers only
        xs = [rng.randint(0, hi) for _ in range(rng.randint(2, 7))]
        prompt = rng.choice(_LIST_PROMPTS[task]).format(l=fmt_list(xs), c=", ".join(map(str, xs)))
        if task == "sort":
            out, lead = sorted(xs), "Sorted in ascending order"
        elif task == "sort-desc":
            out, lead = sorted(xs, reverse=True), "Sorted in descending order"
        else:
            out, lead = xs[::-1], "Reversed"
        reply = f"{lead}: {fmt_list(out)}"
        if task != "reverse-list":
            reply = _length_groups(xs, descending=task == "sort-desc") + reply
        return f"{task}:{fmt_list(xs)}", task, prompt, reply, fmt_list(out)
    return make


def _length_groups(xs: list[int], descending: bool) -> str:
    """A sorting reply's first steps when the list mixes 1- and 2-digit numbers: each number in list
    order with its length (a copy of the list that marks where one number ends -- picking the 1-digit
    numbers straight out of "42, 7, 93" was where models went wrong), then the numbers of each length
    in list order (longer first when descending), so that only equal-length numbers, whose order is
    their digits' order, are compared afterwards. Empty when all have the same length."""
    groups = {n: [x for x in xs if len(str(x)) == n] for n in (1, 2)}
    if not groups[1] or not groups[2]:
        return ""
    order = (2, 1) if descending else (1, 2)
    lengths = "Lengths: " + ", ".join(f"{x} ({len(str(x))})" for x in xs) + ". "
    return lengths + "; ".join(f"{n}-digit: {', '.join(map(str, groups[n]))}" for n in order) + ". "


# ------------------------------------------------------------------------------------ words
WORDS = (
    "apple banana cherry grape lemon mango orange peach pear plum melon berry olive onion garlic carrot potato tomato "
    "pepper salad bread butter cheese honey sugar water coffee tea juice milk cookie pizza pasta rice soup "
    "house window door garden kitchen table chair sofa lamp mirror pillow blanket carpet ladder bucket basket "
    "bottle candle pencil paper letter book story poem song music piano guitar violin drum flute radio camera "
    "phone laptop screen mouse cable rocket planet comet star moon sun cloud rain snow storm thunder river lake "
    "ocean island beach forest desert valley mountain hill stone rock sand field meadow bridge tower castle "
    "village city street market school office doctor nurse teacher farmer baker artist pilot sailor driver "
    "singer dancer player friend family mother father sister brother baby child people animal tiger lion zebra "
    "horse donkey monkey rabbit turtle spider eagle parrot falcon dolphin whale shark salmon kitten puppy "
    "dragon robot wizard knight pirate queen king prince jacket shirt sweater hat glove shoe sock scarf "
    "button pocket wallet ticket money coin silver gold copper iron metal plastic wood glass marble diamond "
    "purple yellow green blue red black white brown pink orange silent happy quiet gentle clever brave "
    "strong simple little yellow bright dark early late quick slow yesterday tomorrow morning evening winter "
    "summer autumn spring monday friday holiday journey travel rocket engine wheel bicycle train airplane boat "
    "anchor harbor compass python kernel tensor vector matrix expert router signal number letter puzzle "
    "riddle secret magic energy nature science history memory dream wonder echo banana mississippi "
    "balloon coffee committee bookkeeper success address parallel occasion"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_WORD_PROMPTS = {
    "reverse-word": ['Reverse the word "{w}".', "Spell {w} backwards.", 'What is "{w}" reversed?',
                     "Write the word {w} in reverse.", 'Reverse the letters of "{w}".', "reverse {w}",
                     'Can you spell "{w}" backwards?'],
    "word-length": ['How many letters are in the word "{w}"?', "How long is the word {w}?",
                    'Count the letters in "{w}".', "How many characters does {w} have?",
                    'What is the length of the word "{w}"?', "Number of letters in {w}?"],
    "letter-count": ['How many times does the letter "{c}" appear in "{w}"?', "Count the {c}'s in {w}.",
                     'How many "{c}" are there in the word "{w}"?', "How often does {c} occur in {w}?",
                     'Count how many times "{c}" appears in "{w}".'],
}


def _word_task(task: str) -> Callable:
    def make(rng: random.Random):
        w = rng.choice(WORDS)
        spelled = "-".join(w)
        if task == "reverse-word":
            prompt = rng.choice(_WORD_PROMPTS[task]).format(w=w)
            rev = w[::-1]
            reply = f'{spelled} reversed is {"-".join(rev)}, so the answer is "{rev}".'
            return f"{task}:{w}", task, prompt, reply, rev
        if task == "word-length":
            prompt = rng.choice(_WORD_PROMPTS[task]).format(w=w)
            return f"{task}:{w}", task, prompt, f'"{w}" is spelled {spelled}, so it has {len(w)} letters.', str(len(w))
        c = rng.choice(w) if rng.random() < 0.75 else rng.choice(_ALPHABET)
        prompt = rng.choice(_WORD_PROMPTS[task]).format(w=w, c=c)
        n = w.count(c)
        times = "time" if n == 1 else "times"
        reply = f'{spelled}: the letter "{c}" appears {n} {times}.'
        return f"{task}:{w}:{c}", task, prompt, reply, str(n)
    return make


# ------------------------------------------------------------------------------------ units
_UNITS = {
    # name: (from unit, to unit, factor as Decimal to multiply, value picker, prompt templates)
    "km-m": ("km", "m", Decimal(1000), lambda r: r.randint(1, 99),
             ["Convert {v} km to meters.", "How many meters are in {v} kilometers?", "{v} km = ? m", "What is {v} km in meters?"]),
    "m-km": ("m", "km", Decimal("0.001"), lambda r: r.randint(1, 99) * 100,
             ["Convert {v} m to kilometers.", "How many kilometers is {v} meters?", "{v} m = ? km", "What is {v} meters in km?"]),
    "m-cm": ("m", "cm", Decimal(100), lambda r: r.randint(1, 99),
             ["Convert {v} m to centimeters.", "How many centimeters are in {v} meters?", "{v} m = ? cm"]),
    "cm-m": ("cm", "m", Decimal("0.01"), lambda r: r.randint(1, 99) * 10,
             ["Convert {v} cm to meters.", "How many meters is {v} centimeters?", "{v} cm = ? m"]),
    "kg-g": ("kg", "g", Decimal(1000), lambda r: r.randint(1, 99),
             ["Convert {v} kg to grams.", "How many grams are in {v} kilograms?", "{v} kg = ? g", "What is {v} kg in grams?"]),
    "g-kg": ("g", "kg", Decimal("0.001"), lambda r: r.randint(1, 99) * 100,
             ["Convert {v} g to kilograms.", "How many kilograms is {v} grams?", "{v} g = ? kg"]),
    "h-min": ("hours", "minutes", Decimal(60), lambda r: r.randint(1, 48),
              ["Convert {v} hours to minutes.", "How many minutes are in {v} hours?", "{v} hours = ? minutes"]),
    "min-h": ("minutes", "hours", None, lambda r: r.randint(1, 40) * 15,
              ["Convert {v} minutes to hours.", "How many hours is {v} minutes?", "{v} minutes = ? hours"]),
    "c-f": ("°C", "°F", None, lambda r: r.randint(-40, 100),
            ["Convert {v} °C to Fahrenheit.", "What is {v} degrees Celsius in Fahrenheit?", "{v}°C in °F?",
             "How many degrees Fahrenheit is {v} °C?"]),
    "f-c": ("°F", "°C", None, lambda r: r.randint(-40, 212),
            ["Convert {v} °F to Celsius.", "What is {v} degrees Fahrenheit in Celsius?", "{v}°F in °C?",
             "How many degrees Celsius is {v} °F?"]),
}


def convert(kind: str, v: int) -> Decimal:
    """The exact (or rule-rounded, for temperatures) result of conversion ``kind`` of value ``v``."""
    if kind == "c-f":
        return round1(Decimal(v) * 9 / 5 + 32)
    if kind == "f-c":
        return round1((Decimal(v) - 32) * 5 / 9)
    if kind == "min-h":
        return Decimal(v) / 60  # v is a multiple of 15: exact
    return Decimal(v) * _UNITS[kind][2]


def _units(rng: random.Random):
    kind = rng.choice(sorted(_UNITS))
    src, dst, factor, pick, prompts = _UNITS[kind]
    v = pick(rng)
    out = fmt_num(convert(kind, v))
    prompt = rng.choice(prompts).format(v=v)
    if kind == "c-f":
        reply = f"°F = °C × 9 / 5 + 32 = {v} × 9 / 5 + 32 = {fmt_num(Decimal(v) * 9 / 5)} + 32 = {out}, so {v} °C = {out} °F."
    elif kind == "f-c":
        diff = v - 32
        reply = f"°C = (°F - 32) × 5 / 9 = {diff} × 5 / 9 = {out} (rounded to one decimal), so {v} °F = {out} °C."
    elif factor is not None and factor >= 1:
        reply = f"1 {src[:-1] if src == 'hours' else src} = {fmt_num(factor)} {dst}, so {v} {src} = {v} × {fmt_num(factor)} = {out} {dst}."
    else:
        per = {"m-km": "1000", "cm-m": "100", "g-kg": "1000", "min-h": "60"}[kind]
        one = {"m-km": "1 km = 1000 m", "cm-m": "1 m = 100 cm", "g-kg": "1 kg = 1000 g", "min-h": "1 hour = 60 minutes"}[kind]
        reply = f"{one}, so {v} {src} = {v} / {per} = {out} {dst}."
    return f"units:{kind}:{v}", "units", prompt, reply, out


# ------------------------------------------------------------------------------------ chat
_ABOUT = ("I am a small Mixture-of-Experts demo model, trained with dynamoe on a synthetic corpus. I can do "
          "integer arithmetic, sort and reverse lists, reverse words and count their letters, convert units "
          "(km, m, cm, kg, g, hours, minutes, °C, °F), and write Python code for quicksort, binary search, "
          "fibonacci, factorial, bubble sort and gcd.")
_CHAT = [
    (["Hello!", "Hi", "Hello", "hi!", "Hey", "Good morning!", "Hi there"],
     "Hello! " + _ABOUT.replace("I am", "I'm", 1) + " What would you like to try?"),
    (["Who are you?", "What are you?", "Tell me about yourself.", "What is your name?"], _ABOUT),
    (["What can you do?", "Help", "help", "What can I ask you?", "What are your skills?"],
     _ABOUT + ' For example, ask "What is 47 + 38?" or "Write a Python code of the Quicksort algorithm."'),
    (["Thank you!", "Thanks", "thanks!", "Great, thank you."], "You're welcome! Ask me anything else you like."),
    (["Bye", "Goodbye!", "See you later."], "Goodbye! Have a nice day."),
]


def _chat(rng: random.Random):
    prompts, reply = rng.choice(_CHAT)
    prompt = rng.choice(prompts)
    return f"chat:{prompt}", "chat", prompt, reply, reply


# ------------------------------------------------------------------------------------ corpus
MAKERS: dict[str, Callable] = {
    "add": _arith("add"), "sub": _arith("sub"), "mul": _arith("mul"),
    "sort": _list_task("sort"), "sort-desc": _list_task("sort-desc"), "reverse-list": _list_task("reverse-list"),
    "reverse-word": _word_task("reverse-word"), "word-length": _word_task("word-length"),
    "letter-count": _word_task("letter-count"), "units": _units, "code": make_code, "chat": _chat,
}
SKILLS = tuple(MAKERS)
#: the training mixture (share of conversations)
TRAIN_WEIGHTS = {"add": 0.09, "sub": 0.12, "mul": 0.15, "sort": 0.12, "sort-desc": 0.09, "reverse-list": 0.08,
                 "reverse-word": 0.07, "word-length": 0.04, "letter-count": 0.05, "units": 0.09, "code": 0.06,
                 "chat": 0.04}
_NO_HELD_OUT = ("chat",)  # trained on every wording: a greeting has no "unseen" variant worth scoring


def _in_split(key: str, skill: str, split: str, split_seed: int, fraction: float) -> bool:
    if skill in _NO_HELD_OUT:
        return split == "train"
    if skill == "code" and key[len("code:"):] in CANONICAL_CODE_PROMPTS.values():
        return split == "train"
    return is_held_out(key, split_seed, fraction) == (split == "held_out")


def _one(rng: random.Random, skill: str, split: str, split_seed: int, fraction: float):
    for _ in range(10_000):
        key, group, prompt, reply, answer = MAKERS[skill](rng)
        if _in_split(key, skill, split, split_seed, fraction):
            return key, group, prompt, reply, answer
    raise RuntimeError(f"no {split} problem found for skill {skill!r} (held_out_fraction={fraction})")


def generate(seed: int, n: int, split: str = "train", skills: Optional[Iterable[str]] = None,
             weights: Optional[dict] = None, split_seed: int = DEFAULT_SPLIT_SEED,
             held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION, system_rate: float = 0.1,
             multi_turn_rate: float = 0.05) -> list[Example]:
    """``n`` conversations of ``split`` ('train' | 'held_out'), deterministic in all arguments.

    skills: restrict to these (default all; 'chat' has no held-out problems). weights: skill -> share
    (default :data:`TRAIN_WEIGHTS`; held-out: equal shares). system_rate / multi_turn_rate: share of
    training conversations with a system message / a second exchange (held-out ones have neither).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
    chosen = list(skills) if skills is not None else list(SKILLS)
    bad = [s for s in chosen if s not in MAKERS]
    if bad:
        raise ValueError(f"unknown skills {bad}; known: {list(SKILLS)}")
    if split == "held_out":
        chosen = [s for s in chosen if s not in _NO_HELD_OUT]
    if not chosen:
        raise ValueError(f"no skill left to generate for split {split!r}")
    w = weights or (TRAIN_WEIGHTS if split == "train" else {})
    shares = [float(w.get(s, 1.0 if not w else 0.0)) for s in chosen]
    if sum(shares) <= 0:
        raise ValueError(f"weights give every chosen skill zero share: {w}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        skill = rng.choices(chosen, shares)[0]
        key, group, prompt, reply, answer = _one(rng, skill, split, split_seed, held_out_fraction)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        if split == "train":
            if rng.random() < multi_turn_rate:
                s2 = rng.choices(chosen, shares)[0]
                _, _, p2, r2, _ = _one(rng, s2, split, split_seed, held_out_fraction)
                messages = [{"role": "user", "content": p2}, {"role": "assistant", "content": r2}] + messages
            if rng.random() < system_rate:
                messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
        out.append(Example(skill, group, messages, answer, key))
    return out


def write_jsonl(examples: Iterable[Example], path_or_file) -> None:
    """One JSON object per line (sorted keys, UTF-8): the byte-identical form of a corpus."""
    if hasattr(path_or_file, "write"):
        for ex in examples:
            path_or_file.write(ex.to_json() + "\n")
        return
    with open(path_or_file, "w", encoding="utf-8", newline="\n") as f:
        write_jsonl(examples, f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=20, help="number of conversations")
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--skills", nargs="*", choices=SKILLS, default=None)
    p.add_argument("--out", default="-", help="JSONL file ('-': stdout)")
    args = p.parse_args(argv)
    examples = generate(args.seed, args.n, args.split, args.skills)
    if args.out == "-":
        write_jsonl(examples, sys.stdout)
    else:
        write_jsonl(examples, args.out)


if __name__ == "__main__":
    main()
