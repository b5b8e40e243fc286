"""train_demo / eval_demo / expert_usage on a miniature run (tiny Qwen3-MoE, 20 steps, a small corpus):
the loss falls, a run stopped mid-way and resumed from its checkpoint ends with bit-identical parameters,
the exported folder loads with dynamoe and with transformers (same logits), and the scoring helpers
(exact match, code run in a subprocess with a timeout) judge right."""
import json
import os
import shutil

import pytest
import torch

from dynamoe.examples import demo_data as dd
from dynamoe.examples import eval_demo, expert_usage, train_demo

TINY = ["--steps", "20", "--batch-size", "4", "--seq-len", "96", "--corpus-size", "1200", "--vocab-size", "500",
        "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--top-k", "2",
        "--moe-intermediate", "32", "--warmup", "4", "--lr", "3e-3", "--eval-every", "10", "--ckpt-every", "5",
        "--no-progress", "--no-samples", "--max-position", "512", "--sliding-window", "64", "--long-steps", "4",
        "--long-seq-len", "256", "--long-batch-size", "2", "--long-corpus-size", "40", "--long-share", "0.7"]
STEPS = 24  # 20 + the long-context stage's 4


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted run (exported), and one stopped after 10 steps then resumed to 20."""
    root = tmp_path_factory.mktemp("demo")
    full = train_demo.main(TINY + ["--out", str(root / "full"), "--ckpt-dir", str(root / "full-ckpt")])
    shutil.copytree(root / "full-ckpt" / "tokenizer", root / "part-ckpt" / "tokenizer")  # the data cache: same flags
    shutil.copy(root / "full-ckpt" / "data.pt", root / "part-ckpt" / "data.pt")
    part = train_demo.main(TINY + ["--out", str(root / "part"), "--ckpt-dir", str(root / "part-ckpt"),
                                   "--stop-after", "10", "--no-export"])
    resumed = train_demo.main(TINY + ["--out", str(root / "part"), "--ckpt-dir", str(root / "part-ckpt"), "--no-export"])
    return {"root": root, "full": full, "part": part, "resumed": resumed}


def test_loss_falls(runs):
    hist = runs["full"]["history"]
    assert len(hist) == STEPS and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert sum(h["loss"] for h in hist[17:20]) / 3 < hist[0]["loss"] - 0.5
    assert hist[-1]["aux"] > 0  # the balance loss is on (Switch loss: K=2 when balanced)
    assert "eval_loss" in hist[9] and "eval_loss" in hist[19]
    assert "long_eval_loss" in hist[-1] and "long_eval_loss" not in hist[19]
    # the long-context stage's rows are longer: its steps see more tokens
    assert runs["full"]["steps_this_run"] == STEPS


def test_resume_is_bit_identical(runs):
    assert runs["part"]["step"] == 10 and runs["part"]["steps_this_run"] == 10
    assert runs["resumed"]["steps_this_run"] == STEPS - 10 and runs["resumed"]["step"] == STEPS
    a, b = _params(runs["full"]["model"]), _params(runs["resumed"]["model"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [h["loss"] for h in runs["full"]["history"]] == [h["loss"] for h in runs["resumed"]["history"]]


def test_resume_refuses_other_flags(runs):
    with pytest.raises(SystemExit, match="other flags"):
        train_demo.main(TINY + ["--out", str(runs["root"] / "part"), "--ckpt-dir", str(runs["root"] / "part-ckpt"),
                                "--lr", "1e-3", "--no-export"])


def test_resume_refuses_other_data_version(runs, monkeypatch):
    monkeypatch.setattr(train_demo.demo_data, "DATA_VERSION", train_demo.demo_data.DATA_VERSION + 1)
    with pytest.raises(SystemExit, match="data_version"):
        train_demo.main(TINY + ["--out", str(runs["root"] / "part"), "--ckpt-dir", str(runs["root"] / "part-ckpt"),
                                "--no-export"])


def test_export_loads_in_dynamoe_and_transformers(runs):
    from transformers import AutoModelForCausalLM

    from dynamoe.engine import Tokenizer
    from dynamoe.models import load

    out = str(runs["root"] / "full")
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 4
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 64 and cfg["max_position_embeddings"] == 512
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    ours = load(out, dtype=torch.float32, progress=False)
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = Tokenizer.from_dir(out)
    ids = torch.tensor([tok.encode_chat([{"role": "user", "content": "What is 47 + 38?"}])])
    # and a prompt longer than the window, as a harness sends it (system blocks, tools, reminders)
    import random

    from dynamoe.examples import demo_context
    msgs, tools = demo_context.wrap(random.Random(3), [{"role": "user", "content": "What is 47 + 38?"}], max_chars=900)
    long_ids = torch.tensor([tok.encode_chat(msgs, tools=tools)])
    assert long_ids.size(1) > 2 * 64
    with torch.no_grad():
        torch.testing.assert_close(ours(long_ids), hf(long_ids).logits, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        a, b = ours(ids), hf(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the bf16 export is the trained model, rounded
    trained = runs["full"]["model"]
    with torch.no_grad():
        c = trained(ids)
    assert (a - c).abs().max() < 0.1 * c.abs().max()
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "python -m dynamoe.examples.train_demo --steps 20 --batch-size 4 --seq-len 96 --seed 0 --dtype fp32" in card
    assert "--layers 2" in card and "--aux-loss-coef" not in card and train_demo.CARD_SCORES_START in card
    assert "It does not use tools" in card and "Long-context stage: 4 steps of 2 × 256 tokens" in card


def test_init_from_runs_only_the_long_context_stage(runs, tmp_path):
    """--init-from an export: the first stage is that model; only the long-context steps run, from
    its weights and with its tokenizer, and the card quotes the first stage's training from its card."""
    from dynamoe.models import load

    src = str(runs["root"] / "full")
    out = train_demo.main(TINY + ["--init-from", src, "--long-steps", "2", "--out", str(tmp_path / "ft"),
                                  "--ckpt-dir", str(tmp_path / "ft-ckpt")])
    assert out["steps_this_run"] == 2 and out["step"] == 22
    assert open(os.path.join(src, "tokenizer.json")).read() == open(tmp_path / "ft" / "tokenizer.json").read()
    base = load(src, dtype=torch.float32, progress=False).state_dict()
    tuned = out["model"].state_dict()
    moved = [k for k in base if not torch.equal(base[k], tuned[k].to(base[k].dtype))]
    assert moved and all(float((base[k] - tuned[k]).abs().max()) < 0.05 for k in base)  # 2 small steps away
    card = open(tmp_path / "ft" / "README.md", encoding="utf-8").read()
    assert "Stage 1 is the model this run started from" in card and "> " in card and "--init-from" in card
    with pytest.raises(SystemExit):
        train_demo.main(TINY + ["--init-from", str(tmp_path), "--out", str(tmp_path / "x")])  # no tokenizer there


def test_eval_and_expert_usage_on_the_export(runs, tmp_path):
    from dynamoe.engine import load

    out = str(runs["root"] / "full")
    model, tok = load(out)
    examples = [e for e in eval_demo.eval_set(1) if e.group in ("add-2d", "sort", "code-canonical")][:4]
    results = eval_demo.evaluate(model, tok, examples, max_tokens=12)
    assert len(results) == 4 and all(isinstance(r.reply, str) for r in results)
    rows = eval_demo.report_rows(results)
    assert {r["name"] for r in rows} >= {"add-2d", "sort"}
    eval_demo.update_card(os.path.join(out, "README.md"), eval_demo.format_table(rows), "python -m x")
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "| add-2d | 1 |" in card and "Not evaluated yet" not in card

    by_skill = {s: dd.generate(5, 2, "held_out", skills=[s]) for s in ("add", "code")}
    shares = expert_usage.routing_shares(model, tok, by_skill)
    assert shares.shape == (2, 2, 4)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 2, dtype=shares.dtype))
    pytest.importorskip("matplotlib")
    png = tmp_path / "usage.png"
    expert_usage.plot_heatmap(shares, list(by_skill), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------- scoring
def _ex(group: str, answer: str, skill: str | None = None) -> dd.Example:
    return dd.Example(skill or group.split("-")[0], group, [{"role": "user", "content": "?"}], answer, "k")


@pytest.mark.parametrize("group, answer, reply, ok", [
    ("add-2d", "85", "47 + 38 = 85", True),
    ("add-2d", "85", "47 + 38 = 84", False),
    ("sub-2d", "-45", "12 - 57 = -45", True),
    ("mul-2d", "1786", "47 × 38 = 47 × 30 + 47 × 8 = 1410 + 376 = 1786", True),
    ("mul-2d", "1786", "47 × 38 = 1410 + 376", False),
    ("sort", "[3, 5, 9]", "Sorted in ascending order: [3, 5, 9]", True),
    ("sort", "[3, 5, 9]", "Sorted in ascending order: [3, 9, 5]", False),
    ("reverse-word", "tenalp", 'p-l-a-n-e-t reversed is t-e-n-a-l-p, so the answer is "tenalp".', True),
    ("reverse-word", "tenalp", "tenalp", False),  # no quoted answer
    ("units", "77", "so 25 °C = 77 °F.", True),
    ("units", "2.5", "so 150 minutes = 150 / 60 = 2.50 hours.", True),
    ("word-length", "6", "no number here", False),
])
def test_exact_match(group, answer, reply, ok):
    assert eval_demo.score(_ex(group, answer), reply)[0] is ok


@pytest.mark.parametrize("code, ok, detail", [
    ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\nprint(gcd(4, 6))\n", True, ""),
    ("def gcd(a, b):\n    return a * b\n", False, "gcd(48, 18) returned 864, expected 6"),
    ("def gcd(a, b):\n    raise RuntimeError('boom')\n", False, "RuntimeError: boom"),
    ("def gcd(a, b):\n    while True:\n        pass\n", False, "timed out"),
    ("def gcd(a, b)\n    return a\n", False, "SyntaxError"),
    ("x = 1\n", False, "no function named gcd"),
    ("def my_gcd(a, b):\n    import math\n    return math.gcd(a, b)\n", True, ""),  # the only function
])
def test_code_execution_scoring(code, ok, detail):
    passed, why = eval_demo.run_code_tests("gcd", code, timeout=2.0)
    assert passed is ok and detail in why


def test_code_scoring_from_a_reply_and_in_place_sorts():
    reply = "Here it is:\n\n```python\ndef bubble_sort(arr):\n    arr.sort()\n```"
    assert eval_demo.score(_ex("code-bubble_sort", "bubble_sort", "code"), reply)[0]
    with pytest.raises(ValueError, match="algo must be one of"):
        eval_demo.run_code_tests("mergesort", "")


def test_harness_eval_set_wraps_the_target_groups():
    base = eval_demo.eval_set(2)
    wrapped = eval_demo.harness_set(base, 1, 3000)
    targets = {g for _, gs, _ in eval_demo.TARGETS for g in gs}
    assert {e.group for e in wrapped} == {g + eval_demo.HARNESS_SUFFIX for g in targets if any(b.group == g for b in base)}
    originals = {b.key: b for b in base if b.group in targets}
    for e in wrapped:
        o = originals[e.key]
        assert e.messages[-1] == o.messages[-1] and e.answer == o.answer
        last_user = [m for m in e.prompt if m["role"] == "user"][-1]["content"]
        texts = [last_user] if isinstance(last_user, str) else [p["text"] for p in last_user]
        assert o.prompt[-1]["content"] in texts  # the question itself, unchanged, among the harness's parts
        assert sum(len(str(m["content"])) for m in e.prompt) > 3 * len(o.prompt[-1]["content"])
        if e.skill != "code":  # scored as the plain group is
            assert eval_demo.score(e, o.messages[-1]["content"])[0]
