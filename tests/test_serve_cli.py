"""``dynamoe serve``'s command line (model choice, clear errors) and the streaming client example."""
import io

import pytest

from serve_testing import shared_server

from dynamoe import cli
from dynamoe.serve import cli as serve_cli


def test_model_choice(tmp_path):
    a, b, demo = tmp_path / "a", tmp_path / "b", tmp_path / "demo"
    b.mkdir()
    assert serve_cli.resolve_model_path(None, [str(a), str(b)], demo_dir=str(demo)) == str(b)
    with pytest.raises(ValueError, match="none of the --try_path folders exists"):
        serve_cli.resolve_model_path(None, [str(a)], demo_dir=str(demo))
    with pytest.raises(ValueError, match="is not a directory"):
        serve_cli.resolve_model_path(str(a), [str(b)], demo_dir=str(demo))
    with pytest.raises(ValueError, match="pass --model DIR"):
        serve_cli.resolve_model_path(None, [], demo_dir=str(demo))
    demo.mkdir()
    assert serve_cli.resolve_model_path(None, [], demo_dir=str(demo)) == str(demo)


def test_cli_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serve_cli, "DEMO_MODEL_DIR", str(tmp_path / "no-demo"))
    assert cli.main(["serve"]) == 2
    assert "no model to serve: pass --model DIR" in capsys.readouterr().err
    assert cli.main(["serve", "--try_path", str(tmp_path / "x"), "--try_path", str(tmp_path / "y")]) == 2
    assert "none of the --try_path folders exists" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["serve", "--model", str(tmp_path)]) == 2
    assert "WORLD_SIZE=2 but RANK is not set: start the ranks with torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--serve", "gui"])
    with pytest.raises(SystemExit):
        cli.main(["serve", "--port", "70000"])
    args = cli._parser().parse_args(["serve", "--listen_port", "9000", "--max-model-len", "64", "--try_path", "p",
                                     "--try_path", "q", "--thinking_effort", "low", "--max-num-seqs", "3"])
    assert (args.listen_port, args.max_seq_len, args.try_path, args.thinking_effort, args.max_num_seqs, args.host) == \
        (9000, 64, ["p", "q"], "low", 3, "127.0.0.1")
    args = cli._parser().parse_args(["serve", "--kv-cache-memory", "2GiB", "--kv-cache-fraction", "0.4", "--block-size",
                                     "32", "--max-num-batched-tokens", "512", "--num-speculative-tokens", "4"])
    assert (args.kv_cache_memory, args.kv_cache_fraction, args.block_size, args.token_budget,
            args.speculative_tokens) == (2 << 30, 0.4, 32, 512, 4)
    for bad in (["--block-size", "0"], ["--num-speculative-tokens", "-1"], ["--kv-cache-memory", "much"]):
        with pytest.raises(SystemExit):
            cli._parser().parse_args(["serve", *bad])


@pytest.mark.parametrize("flag", [[], ["--no-openai"]])
def test_streaming_client_example(tmp_path_factory, flag):
    from dynamoe.examples import oai_request_stream

    server = shared_server(tmp_path_factory)
    out, err = io.StringIO(), io.StringIO()
    rc = oai_request_stream.main(["--url", server.url.removeprefix("http://"), "--prompt", "hello world",
                                  "--max-tokens", "7", "--temperature", "0", "--api-key", server.api_key, *flag],
                                 out=out, err=err)
    assert rc == 0 and out.getvalue().strip()
    assert "7 generated tokens" in err.getvalue()


def test_max_seq_len_above_the_model_warns(tmp_path):
    from types import SimpleNamespace

    from serve_testing import ScriptedLM, script
    from engine_testing import write_tokenizer_dir
    from dynamoe.engine import Tokenizer

    tok = Tokenizer.from_dir(write_tokenizer_dir(str(tmp_path)))
    model = ScriptedLM(tok, script, eos_token_id=2, max_position_embeddings=512)
    for asked, warns in ((512, False), (None, False), (2048, True)):
        err = io.StringIO()
        args = SimpleNamespace(max_seq_len=asked, max_num_seqs=1, prefix_caching=False)
        engine, max_seq_len = serve_cli.build_engine(args, model, tok, err)
        assert max_seq_len == engine.max_seq_len == (asked or 512)
        assert ("--max_seq_len 2048 is above the model's max_position_embeddings 512" in err.getvalue()) == warns
    # the flags reach the engine
    err = io.StringIO()
    args = SimpleNamespace(max_seq_len=None, max_num_seqs=2, prefix_caching=True, block_size=8, token_budget=64,
                           speculative_tokens=3, kv_cache_memory=None, kv_cache_fraction=0.25)
    engine, _ = serve_cli.build_engine(args, model, tok, err)
    assert (engine.cache.block_size, engine.token_budget, engine.adaptive_budget) == (8, 64, False)
    # ScriptedLM keeps per-sequence state: no prefix caching, no speculation (no rollback)
    assert not engine.prefix_caching and engine.speculative_tokens == 0


def test_kv_cache_blocks_take_a_share_of_the_memory_and_no_more_than_needed(monkeypatch):
    """Without --max_seq_len the model's whole context; the paged KV cache gets --kv-cache-memory, else a
    quarter of the memory, in blocks -- never more than every slot at max_seq_len needs, at least one block
    a slot."""
    import types

    import torch

    from dynamoe.models import ModelConfig
    from dynamoe.serve import cli

    def fake(mpe, layers=6, kv_heads=2, head_dim=64, dtype=torch.bfloat16):
        cfg = ModelConfig.from_dict({"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": layers,
                                     "num_attention_heads": 4, "num_key_value_heads": kv_heads, "head_dim": head_dim,
                                     "vocab_size": 64, "intermediate_size": 64, "max_position_embeddings": mpe})
        m = torch.nn.Linear(1, 1, dtype=dtype)
        return types.SimpleNamespace(config=cfg, dtype=dtype, parameters=m.parameters)

    monkeypatch.setattr(cli, "_memory_bytes", lambda device: 24 << 30)
    demo = fake(32768)
    assert demo.config.kv_elements_per_position() == 6 * 2 * 2 * 64
    assert cli.default_max_seq_len(demo) == 32768
    assert cli.kv_cache_blocks(demo, 32768, 8, 16) == 8 * 32768 // 16     # 3 KB a position: everything fits
    big = fake(40960, layers=48, kv_heads=4, head_dim=128)    # a Qwen3-30B-A3B-sized cache: 96 KB a position
    block = 48 * 2 * 4 * 128 * 2 * 16
    n = cli.kv_cache_blocks(big, 40960, 8, 16)
    assert n == int((24 << 30) * cli.KV_CACHE_SHARE) // block < 8 * 40960 // 16   # far fewer than slots x context
    assert cli.kv_cache_blocks(big, 40960, 8, 16, memory=1 << 30) == (1 << 30) // block
    assert cli.kv_cache_blocks(big, 40960, 8, 16, fraction=0.5) == int((24 << 30) * 0.5) // block
    assert cli.kv_cache_blocks(big, 40960, 8, 16, memory=1) == 8                # at least a block a slot
    assert cli.kv_cache_blocks(types.SimpleNamespace(config=None), 4096, 8, 16) is None
    assert cli.default_max_seq_len(types.SimpleNamespace(config=None)) == cli.FALLBACK_MAX_SEQ_LEN


def test_cache_size_flags_parse_and_refuse_bad_values():
    import argparse

    from dynamoe.serve import cli

    assert cli._size("4GiB") == 4 << 30 and cli._size("512m") == 512 << 20 and cli._size("1000") == 1000
    assert cli._size("1.5G") == 3 << 29
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._size(bad)
    assert cli._fraction("0.5") == 0.5
    for bad in ("0", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._fraction(bad)
