"""The embedded demo model that `make serve` serves (dynamoe/assets/demo-moe): what ships, that it
loads (dynamoe and transformers), and that it answers fixed prompts of each skill correctly --
through the engine and through the real server's /chat."""
import json
import pathlib
import subprocess
import sys
import time

import httpx
import pytest
import torch

import dynamoe
import dynamoe.models as dm
from dynamoe.engine import GenerationEngine, SamplingParams, Tokenizer
from dynamoe.examples import demo_data, eval_demo
from serve_testing import free_port

DEMO = pathlib.Path(dynamoe.__file__).parent / "assets" / "demo-moe"

# (prompt, answer group for demo_data.final_answer, expected answer); phrasings from the corpus,
# operands chosen by us (whether or not they were among the training problems)
PROMPTS = [
    ("What is 23 + 45?", "add-2d", "68"),
    ("What is 81 - 37?", "sub-2d", "44"),
    ("What is 12 × 11?", "mul-2d", "132"),
    ("What is 75 × 8?", "mul-2d", "600"),
    ("Reverse the list [4, 8, 15, 16].", "reverse-list", "[16, 15, 8, 4]"),
    ("Convert 5 km to meters.", "units", "5000"),
    ("What is 64 - 29?", "sub-2d", "35"),
    # missed by the data-v6 model before its long-context stages (the final sort dropped 93)
    ("Sort [42, 7, 93, 15].", "sort", "[7, 15, 42, 93]"),
    ("Sort [38, 5, 71, 24].", "sort", "[5, 24, 38, 71]"),
    ("Sort [6, 2, 9, 4].", "sort", "[2, 4, 6, 9]"),
    ('Reverse the word "planet".', "reverse-word", "tenalp"),
]
QUICKSORT = "Write a Python code of the Quicksort algorithm."


def test_what_ships():
    names = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md"} <= names
    size = sum(p.stat().st_size for p in DEMO.iterdir())
    assert size <= 40 * 2**20, f"the demo model is {size / 2**20:.1f} MiB, over the 40 MiB budget"
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    # an agent's prompt fits, at a cost linear in its length
    assert cfg["max_position_embeddings"] >= 32768 and cfg["use_sliding_window"] and 512 <= cfg["sliding_window"] < 4096
    card = (DEMO / "README.md").read_text()
    assert "train_demo" in card and "eval_demo" in card and "does not use tools" in card


@pytest.fixture(scope="module")
def engine():
    model = dm.load(str(DEMO), progress=False)
    return GenerationEngine(model, Tokenizer.from_dir(str(DEMO)), max_seq_len=512, max_batch=4)


def _reply(engine, prompt: str) -> str:
    return engine.generate([{"role": "user", "content": prompt}], 320, params=SamplingParams(temperature=0.0))


@pytest.mark.parametrize("prompt,group,answer", PROMPTS)
def test_engine_answers(engine, prompt, group, answer):
    reply = _reply(engine, prompt)
    assert demo_data.final_answer(group, reply) == answer, reply


# questions inside what an agent harness sends (demo_context: ~12k characters of system prompts, a system
# message after the user's turn, offered tools, reminder blocks), seeds chosen by us
HARNESS = [(1, "What is 23 + 45?", "add-2d", "68"), (2, "Sort [6, 2, 9, 4].", "sort", "[2, 4, 6, 9]"),
           (3, "What is 81 - 37?", "sub-2d", "44")]


@pytest.mark.parametrize("seed,prompt,group,answer", HARNESS)
def test_engine_answers_inside_a_harness_context(seed, prompt, group, answer):
    import random

    from dynamoe.examples import demo_context
    model = dm.load(str(DEMO), progress=False)
    tok = Tokenizer.from_dir(str(DEMO))
    messages, tools = demo_context.wrap(random.Random(seed), [{"role": "user", "content": prompt}], max_chars=12000)
    ids = tok.encode_chat(messages, tools=tools)
    assert len(ids) > 2 * 512  # past the attention window
    engine = GenerationEngine(model, tok, max_seq_len=len(ids) + 400, max_batch=1, prefill_chunk=2048)
    reply = engine.generate(ids, 320, params=SamplingParams(temperature=0.0))
    assert demo_data.final_answer(group, reply) == answer, reply


def test_engine_writes_a_working_quicksort(engine):
    reply = _reply(engine, QUICKSORT)
    ok, detail = eval_demo.run_code_tests("quicksort", demo_data.code_block(reply))
    assert ok, f"{detail}\n{reply}"


def test_transformers_loads_it_too():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    ours = dm.load(str(DEMO), progress=False)
    ids = torch.tensor([Tokenizer.from_dir(str(DEMO)).encode("What is 23 + 45?")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_served_by_default_over_chat():
    """`dynamoe serve` with no model serves the demo (what `make serve` runs); /chat streams the answer."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dynamoe.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        chunks = []
        with httpx.stream("POST", url + "/chat", json={"text": PROMPTS[0][0], "temperature": 0}, timeout=60) as r:
            assert r.status_code == 200
            chunks = list(r.iter_text())
        text = "".join(chunks)
        assert demo_data.final_answer(PROMPTS[0][1], text) == PROMPTS[0][2], text
        assert "demo-moe" in httpx.get(url + "/v1/models").text
        # a chat front end's side call (Open WebUI's title task: instructions + the chat so far) fits too
        task = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
                "### Guidelines:\n" + "- Keep it short and in the chat's language; no quotes or extra text.\n" * 12 +
                '### Output:\nJSON format: { "title": "your concise title here" }\n### Chat History:\n<chat_history>\n'
                f"USER: {PROMPTS[0][0]}\nASSISTANT: {text}\n</chat_history>")
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "demo-moe", "stream": False, "max_tokens": 1000, "messages": [{"role": "user", "content": task}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(10)

