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


def test_default_max_seq_len_is_the_models_context_as_far_as_its_kv_cache_fits(monkeypatch):
    """Without --max_seq_len: max_position_embeddings when slots x positions of KV cache fit a quarter
    of the memory (a small model: the whole context), else what fits, in steps of 1024."""
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
    assert cli.default_max_seq_len(demo, 8) == 32768          # 24 KB a position: the whole context fits
    big = fake(40960, layers=48, kv_heads=4, head_dim=128)    # a Qwen3-30B-A3B-sized cache: 96 KB a position
    n = cli.default_max_seq_len(big, 8)
    assert n % 1024 == 0 and n * 8 * 48 * 2 * 4 * 128 * 2 <= (24 << 30) * cli.KV_CACHE_SHARE < (n + 1024) * 8 * 48 * 2 * 4 * 128 * 2
    assert cli.default_max_seq_len(big, 100000) == 1024       # never below 1024
    assert cli.default_max_seq_len(types.SimpleNamespace(config=None), 8) == cli.FALLBACK_MAX_SEQ_LEN
