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
