"""The demo corpus (dynamoe.examples.demo_data) and its tokenizer (demo_tokenizer): deterministic,
correct answers (arithmetic checked by evaluating every step, code by running it), held-out problems
disjoint from training, and a tokenizer that dynamoe and transformers read the same way."""
import io
import re
from decimal import ROUND_HALF_UP, Decimal

import pytest

from dynamoe.examples import demo_data as dd
from dynamoe.examples import demo_tokenizer as dt
from dynamoe.examples.eval_demo import run_code_tests


def _jsonl(examples) -> bytes:
    f = io.StringIO()
    dd.write_jsonl(examples, f)
    return f.getvalue().encode()


@pytest.fixture(scope="module")
def train():
    return dd.generate(0, 6000)


@pytest.fixture(scope="module")
def held():
    return dd.generate(7, 1500, "held_out")


def test_same_seed_same_bytes_other_seed_other_bytes():
    a, b, c = dd.generate(3, 400), dd.generate(3, 400), dd.generate(4, 400)
    assert _jsonl(a) == _jsonl(b)
    assert _jsonl(a) != _jsonl(c)
    assert _jsonl(dd.generate(3, 300, "held_out")) == _jsonl(dd.generate(3, 300, "held_out"))


def test_every_skill_and_many_phrasings(train):
    skills = {e.skill for e in train}
    assert skills == set(dd.SKILLS)
    for skill in ("add", "sort", "reverse-word", "units", "code"):
        prompts = {re.sub(r"[-\d.]+|\[.*\]|\"\w+\"|\b[a-z]{3,}\b(?=[.?]?$)", "#", e.prompt[-1]["content"])
                   for e in train if e.skill == skill}
        assert len(prompts) >= 5, (skill, prompts)
    code = dd.generate(0, 3000, skills=["code"])  # the seeds' example request is one of the trained wordings
    assert any(e.prompt[-1]["content"] == "Write a Python code of the Quicksort algorithm." for e in code)
    assert any(e.messages[0]["role"] == "system" for e in train)
    assert any(sum(m["role"] == "assistant" for m in e.messages) == 2 for e in train)


def _eval_expr(expr: str) -> int:
    expr = expr.replace("×", "*").replace("−", "-").strip()
    assert re.fullmatch(r"[-\d\s+*()]+", expr), expr
    return eval(expr)  # noqa: S307 -- digits, parentheses and + - * only (checked above)


def _digit(n: int, i: int) -> int:
    return n // 10 ** i % 10


def _check_columns(steps: str, op: str, terms: list[int]) -> int:
    """Checks worked column steps ("4 + 8 = 12, 5 + 1 + 1 = 7" / "12 - 7 = 5, 8 - 1 - 3 = 4") digit by
    digit against ``terms`` and returns the number they spell (ones first; the last sum written whole)."""
    cols = steps.split(", ")
    assert len(cols) == len(str(max(terms))), steps
    carry, out = 0, []
    for i, col in enumerate(cols):
        lhs, rhs = col.split(" = ")
        parts = [int(x) for x in lhs.split(f" {op} ")]
        assert _eval_expr(lhs) == int(rhs), col
        if op == "+":
            assert parts == [_digit(t, i) for t in terms] + ([carry] if carry else []), (steps, i)
            carry = int(rhs) // 10
            out.append(rhs if i == len(cols) - 1 else str(int(rhs) % 10))
        else:
            a, b = terms
            top = parts[0]
            assert top % 10 == _digit(a, i) and top in (_digit(a, i), 10 + _digit(a, i)), (steps, i)
            assert parts[1:] == ([carry] if carry else []) + [_digit(b, i)], (steps, i)
            assert 0 <= int(rhs) <= 9, col
            carry = 1 if top >= 10 else 0
            out.append(rhs)
    return int("".join(reversed(out)))


def _check_times_digit(steps: str, m: int, d: int) -> int:
    """Checks schoolbook "5 × 8 = 40, 7 × 8 + 4 = 60" digit by digit against m × d; returns the number
    the steps spell (each product's last digit, the last product whole)."""
    cols = steps.split(", ")
    assert len(cols) == len(str(m)), steps
    carry, out = 0, []
    for i, col in enumerate(cols):
        lhs, rhs = col.split(" = ")
        assert lhs == f"{_digit(m, i)} × {d}" + (f" + {carry}" if carry else ""), (steps, i)
        assert _eval_expr(lhs) == int(rhs), col
        carry = int(rhs) // 10
        out.append(rhs if i == len(cols) - 1 else str(int(rhs) % 10))
    return int("".join(reversed(out)))


def _check_sub(a: int, b: int, reply: str) -> None:
    if max(a, b) < 10:
        assert all(_eval_expr(s) == a - b for s in reply.split(" = ")), reply
        return
    head, rest = reply.split(": ", 1)
    assert head == f"{a} - {b}"
    cmp, rest = rest.split(", so ", 1)
    assert cmp == f"{a} {'<' if a < b else '>' if a > b else '='} {b}", reply
    if a < b:
        neg, rest = rest.split(": ", 1)
        assert neg == f"{a} - {b} = -({b} - {a})", reply
    steps, so = rest.rsplit(", so ", 1)
    assert so == f"{a} - {b} = {a - b}", reply
    assert _check_columns(steps, "-", [max(a, b), min(a, b)]) == abs(a - b), reply


def _check_mul(a: int, b: int, reply: str) -> None:
    head, sep, rest = reply.partition(": ")
    if not sep:  # answered directly: at most one nonzero digit on each side (or a zero factor)
        assert head == f"{a} × {b} = {a * b}" and (a * b == 0 or len(str(a).strip("0")) == len(str(b).strip("0")) == 1)
        return
    chain = head.split(" = ")
    m, n = (int(x) for x in chain[-1].split(" × "))
    assert {m, n} == {a, b} and chain[0] == f"{a} × {b}", reply
    assert len(dd.place_parts(n)) <= len(dd.place_parts(m)), reply  # the multiplier has fewer nonzero digits
    *rows, so = rest.split("; ")
    assert so == f"so {a} × {b} = {a * b}", reply
    parts = list(reversed(dd.place_parts(n)))
    assert len(rows) == 2 * len(parts) - 1, reply
    values = []
    for part, row in zip(parts, rows):  # one row per nonzero digit of the multiplier, ones first
        d = int(str(part)[0])
        pre, steps_so = row.split(": ", 1)
        assert pre == f"{m} × {d}", reply
        steps, *sos = steps_so.split(", so ")
        assert _check_times_digit(steps, m, d) == m * d == int(sos[0]), reply
        assert sos[1:] == ([f"{m} × {part} = {m * part}"] if part != d else []), reply
        values.append(m * part)
    acc = values[0]
    for v, row in zip(values[1:], rows[len(parts):]):  # then the rows added two at a time, by columns
        pre, steps_so = row.split(": ", 1)
        assert pre == f"{acc} + {v}", reply
        steps, total = steps_so.rsplit(", so ", 1)
        assert _check_columns(steps, "+", [acc, v]) == acc + v == int(total), reply
        acc += v
    assert acc == a * b, reply


@pytest.mark.parametrize("split", ["train", "held_out"])
def test_arithmetic_answers_evaluate(split):
    examples = dd.generate(11, 3000, split, skills=["add", "sub", "mul"])
    for e in examples:
        m = re.match(r"(\d+) ([-+×]) (\d+)", e.reply)
        a, b = int(m.group(1)), int(m.group(3))
        text = e.prompt[-1]["content"]
        in_prompt = [int(x) for x in re.findall(r"\d+", text)]
        # the order the prompt means: "Subtract 57 from 91." is 91 - 57
        assert in_prompt == ([b, a] if re.search(r"from|away", text) else [a, b]), (text, e.reply)
        want = {"add": a + b, "sub": a - b, "mul": a * b}[e.skill]
        assert e.answer == str(want)
        if e.skill == "sub":
            _check_sub(a, b, e.reply)
        elif e.skill == "mul":
            _check_mul(a, b, e.reply)
        else:
            head, _, rest = e.reply.partition(": ")
            if rest:  # column steps, then "so a + b = result"
                steps, so = rest.split(", so ")
                assert head == f"{a} + {b}" and so == f"{a} + {b} = {want}", e.reply
                assert _check_columns(steps, "+", [a, b]) == want, e.reply
            else:
                assert max(a, b) < 10 and head == f"{a} + {b} = {want}", e.reply
        assert dd.final_answer(e.group, e.reply) == e.answer
        assert e.group == f"{e.skill}-{max(len(str(a)), len(str(b)))}d"


def test_column_steps_carry_and_borrow():
    assert dd.column_add([28, 47]) == "8 + 7 = 15, 2 + 4 + 1 = 7"
    assert dd.column_add([999, 1]) == "9 + 1 = 10, 9 + 0 + 1 = 10, 9 + 0 + 1 = 10"
    assert dd.column_sub(100, 99) == "10 - 9 = 1, 10 - 1 - 9 = 0, 1 - 1 - 0 = 0"
    assert dd._sub_reply(43, 92) == ("43 - 92: 43 < 92, so 43 - 92 = -(92 - 43): 12 - 3 = 9, 9 - 1 - 4 = 4, "
                                     "so 43 - 92 = -49")
    assert dd._sub_reply(85, 23) == "85 - 23: 85 > 23, so 5 - 3 = 2, 8 - 2 = 6, so 85 - 23 = 62"
    assert dd._sub_reply(3, 7) == "3 - 7 = -(7 - 3) = -4"
    subs = [e for e in dd.generate(2, 3000, skills=["sub"]) if e.group == "sub-2d"]
    pairs = [tuple(re.match(r"(\d+) - (\d+)", e.reply).groups()) for e in subs]
    same_lead = [(x, y) for x, y in pairs if len(x) == len(y) == 2 and x[0] == y[0]]
    assert len(same_lead) > 0.15 * len(subs)  # many pairs share the tens digit: the sign is in the ones


def test_products_are_long_multiplication():
    assert dd.place_parts(305) == [300, 5] and dd.place_parts(0) == [] and dd.place_parts(7) == [7]
    assert dd.times_digit(75, 8) == "5 × 8 = 40, 7 × 8 + 4 = 60"
    assert dd.times_digit(305, 7) == "5 × 7 = 35, 0 × 7 + 3 = 3, 3 × 7 = 21"
    assert dd._mul_reply(75, 68) == (
        "75 × 68: 75 × 8: 5 × 8 = 40, 7 × 8 + 4 = 60, so 600; 75 × 6: 5 × 6 = 30, 7 × 6 + 3 = 45, so 450, "
        "so 75 × 60 = 4500; 600 + 4500: 0 + 0 = 0, 0 + 0 = 0, 6 + 5 = 11, 0 + 4 + 1 = 5, so 5100; "
        "so 75 × 68 = 5100")
    assert dd._mul_reply(8, 75) == "8 × 75 = 75 × 8: 75 × 8: 5 × 8 = 40, 7 × 8 + 4 = 60, so 600; so 8 × 75 = 600"
    assert dd._mul_reply(40, 20) == "40 × 20 = 800" and dd._mul_reply(0, 7) == "0 × 7 = 0"
    assert dd._mul_reply(0, 75) == "0 × 75 = 0"
    for a in (1, 9, 10, 47, 70, 99, 100, 305, 999):
        for b in (1, 7, 10, 38, 60, 99, 120, 507):
            _check_mul(a, b, dd._mul_reply(a, b))


def test_sorting_groups_mixed_lengths():
    lengths = "Lengths: 38 (2), 2 (1), 46 (2), 7 (1). "
    assert dd._length_groups([38, 2, 46, 7], descending=False) == lengths + "1-digit: 2, 7; 2-digit: 38, 46. "
    assert dd._length_groups([38, 2, 46, 7], descending=True) == lengths + "2-digit: 38, 46; 1-digit: 2, 7. "
    assert dd._length_groups([38, 46], descending=True) == ""


def test_list_word_and_unit_answers(train):
    for e in train:
        text = e.prompt[-1]["content"]
        if e.skill in ("sort", "sort-desc", "reverse-list"):
            xs = [int(x) for x in re.findall(r"\d+", text)]
            want = sorted(xs) if e.skill == "sort" else sorted(xs, reverse=True) if e.skill == "sort-desc" else xs[::-1]
            assert e.answer == dd.fmt_list(want) == dd.final_answer(e.skill, e.reply)
        elif e.skill in ("reverse-word", "word-length"):
            word = next(w for w in dd.WORDS if re.search(rf"\b{w}\b", text))
            assert e.answer == (word[::-1] if e.skill == "reverse-word" else str(len(word)))
            assert dd.final_answer(e.skill, e.reply) == e.answer
        elif e.skill == "letter-count":
            word, letter = e.key.split(":")[1:]
            assert e.answer == str(word.count(letter)) == dd.final_answer(e.skill, e.reply)
        elif e.skill == "units":
            kind, v = e.key.split(":")[1], int(e.key.split(":")[2])
            exact = {"km-m": v * 1000, "m-km": v / 1000, "m-cm": v * 100, "cm-m": v / 100, "kg-g": v * 1000,
                     "g-kg": v / 1000, "h-min": v * 60, "min-h": v / 60, "c-f": v * 9 / 5 + 32,
                     "f-c": (v - 32) * 5 / 9}[kind]
            want = Decimal(repr(exact))
            if kind in ("c-f", "f-c"):  # the corpus's rule: one decimal, half away from zero
                want = Decimal(str((Decimal(v) * 9 / 5 + 32) if kind == "c-f" else (Decimal(v) - 32) * 5 / 9))
                want = want.quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
                assert abs(float(want) - exact) <= 0.05 + 1e-9
            assert Decimal(e.answer) == want, (e.key, e.answer)
            assert dd.final_answer("units", e.reply) == e.answer


@pytest.mark.parametrize("algo", dd.ALGORITHMS)
def test_code_answers_run_and_pass(algo):
    reply = dd.code_reply(algo)
    assert dd.code_block(reply) == dd.CODE[algo]
    ok, detail = run_code_tests(algo, dd.code_block(reply))
    assert ok, detail
    assert len(dd.code_prompts(algo)) >= 20 and dd.CANONICAL_CODE_PROMPTS[algo] in dd.code_prompts(algo)


def test_held_out_disjoint_from_training(train, held):
    train_keys = {e.key for e in train}
    assert not train_keys & {e.key for e in held}
    train_prompts = {e.prompt[-1]["content"] for e in train if e.skill != "chat"}
    assert not train_prompts & {e.prompt[-1]["content"] for e in held}
    # arithmetic: operand pairs disjoint (either order for + and ×)
    pairs = {(e.skill, *sorted(map(int, re.findall(r"\d+", e.prompt[-1]["content"])))) for e in train
             if e.skill in ("add", "mul")}
    for e in held:
        if e.skill in ("add", "mul"):
            assert (e.skill, *sorted(map(int, re.findall(r"\d+", e.prompt[-1]["content"])))) not in pairs
        assert dd.is_held_out(e.key) or e.skill == "code"
    assert {e.skill for e in held} == set(dd.SKILLS) - {"chat"}
    assert all(len(e.messages) == 2 for e in held)


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        dd.generate(0, 1, "test")
    with pytest.raises(ValueError, match="unknown skills"):
        dd.generate(0, 1, skills=["poetry"])
    with pytest.raises(ValueError, match="no skill left"):
        dd.generate(0, 1, "held_out", skills=["chat"])


# ----------------------------------------------------------------------------------- tokenizer
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    tok = dt.train_tokenizer((dt.render(e.messages) for e in dd.generate(0, 3000)), vocab_size=1200)
    dt.save_tokenizer(tok, str(out))
    return str(out)


CONVERSATIONS = [
    [{"role": "user", "content": "What is 47 + 38?"}],
    [{"role": "system", "content": "Answer concisely."}, {"role": "user", "content": "Sort [5, 3, 9]."},
     {"role": "assistant", "content": "Sorted in ascending order: [3, 5, 9]"},
     {"role": "user", "content": "Convert 25 °C to Fahrenheit — and 7 km × 2?"}],
]


def test_tokenizer_round_trip_and_specials(tok_dir):
    from dynamoe.engine import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert tok.pad_token == "<|endoftext|>" and 1000 <= tok.vocab_size <= 1200
    for text in ["What is 47 + 38?", "25 °C = 77 °F", "−12 × 3 … naïve café 🙂", dd.CODE["quicksort"], "  spaces\n\ttab"]:
        assert tok.decode(tok.encode(text)) == text
    # digits are single tokens
    assert [tok.id_to_token(i) for i in tok.encode("1234")] == ["1", "2", "3", "4"]
    # a quoted word is single letters (so it can be written backwards); an unquoted one stays merged
    pieces = [tok.id_to_token(i) for i in tok.encode('the answer is "planet"')]
    assert pieces[pieces.index('Ġ"') + 1:pieces.index('Ġ"') + 8] == ["p", "l", "a", "n", "e", "t", '"']
    assert "Ġanswer" in pieces


def test_chat_template_matches_transformers(tok_dir):
    from transformers import AutoTokenizer

    from dynamoe.engine import Tokenizer

    ours, hf = Tokenizer.from_dir(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    assert hf.eos_token == "<|im_end|>"
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ours.apply_chat_template(conv, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert text == dt.render(conv, add_generation_prompt=gen)
            assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]}]
    assert ours.apply_chat_template(parts) == hf.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(parts) == dt.render([{"role": "user", "content": "What is 2 + 2?"}], True)


def test_loss_mask_covers_assistant_replies_only(tok_dir):
    from tokenizers import Tokenizer as HFTok

    tok = HFTok.from_file(f"{tok_dir}/tokenizer.json")
    conv = CONVERSATIONS[1] + [{"role": "assistant", "content": "25 °C = 77 °F"}]
    ids, mask = dt.encode_conversation(tok, conv)
    kept = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert kept == "Sorted in ascending order: [3, 5, 9]<|im_end|>25 °C = 77 °F<|im_end|>"
    assert dt.encode_conversations(tok, [conv, CONVERSATIONS[0]])[0] == (ids, mask)
