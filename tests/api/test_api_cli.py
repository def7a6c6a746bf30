"""The ``slipstream`` command line: serve's options reach the engine and the server; other commands
dispatch lazily to their packages."""
from __future__ import annotations

import sys
import types

import pytest

from slipstream.server import cli
from slipstream.server.engine.config import EngineConfig


def test_serve_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--host", "--port", "--served-model-name", "--max-num-seqs", "--max-num-batched-tokens",
                   "--kv-cache-memory-bytes", "--max-model-len", "--max-waiting", "--shutdown-timeout", "--api-key",
                   "--vllm-compatible-metrics", "--block-size", "--no-enable-prefix-caching", "--device", "--dtype",
                   "--seed", "--trace"):
        assert option in text, option


def test_serve_maps_options_onto_engine_config_and_server_options(monkeypatch):
    seen = {}

    async def fake_serve(engine, options, host, port):
        seen.update(engine=engine, options=options, host=host, port=port)
        return 0

    monkeypatch.setattr("slipstream.server.api.server.serve", fake_serve)
    monkeypatch.delenv("SLIPSTREAM_API_KEY", raising=False)
    code = cli.main(["serve", "--model", "/models/x.gguf", "--port", "9001", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "128", "--kv-cache-memory-bytes", "256MiB", "--max-model-len", "1024",
                     "--block-size", "32", "--no-enable-prefix-caching", "--device", "cpu", "--dtype", "bfloat16",
                     "--seed", "5", "--served-model-name", "tiny", "--max-waiting", "7", "--shutdown-timeout", "3",
                     "--api-key", "k", "--vllm-compatible-metrics"])
    assert code == 0
    assert seen["engine"] == EngineConfig(model="/models/x.gguf", block_size=32, max_num_seqs=4,
                                          max_num_batched_tokens=128, kv_cache_memory_bytes=256 << 20,
                                          max_model_len=1024, enable_prefix_caching=False, device="cpu",
                                          dtype="bfloat16", trace=False, seed=5)
    o = seen["options"]
    assert (o.served_model_names, o.max_waiting, o.shutdown_timeout, o.api_key, o.vllm_compatible_metrics) == \
        (("tiny",), 7, 3.0, "k", True)
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 9001)


def test_serve_defaults_are_the_engine_defaults_on_loopback(monkeypatch):
    seen = {}

    async def fake_serve(engine, options, host, port):
        seen.update(engine=engine, host=host, port=port, options=options)
        return 0

    monkeypatch.setattr("slipstream.server.api.server.serve", fake_serve)
    monkeypatch.delenv("SLIPSTREAM_API_KEY", raising=False)
    assert cli.main(["serve"]) == 0
    assert seen["engine"] == EngineConfig()
    assert (seen["host"], seen["port"], seen["options"].api_key) == ("127.0.0.1", 8000, None)


@pytest.mark.parametrize("text, expected", [("1024", 1024), ("512MiB", 512 << 20), ("1G", 1 << 30),
                                            ("1.5GiB", 3 << 29), ("64k", 64 << 10)])
def test_byte_sizes(text, expected):
    assert cli.byte_size(text) == expected


def test_several_served_names_are_kept_once_each_in_order(monkeypatch):
    seen = {}

    async def fake_serve(engine, options, host, port):
        seen.update(options=options)
        return 0

    monkeypatch.setattr("slipstream.server.api.server.serve", fake_serve)
    assert cli.main(["serve", "--served-model-name", "b", "a", "b"]) == 0
    assert seen["options"].served_model_names == ("b", "a")


def test_bad_option_values_exit_with_usage(capsys):
    for argv in (["serve", "--kv-cache-memory-bytes", "lots"], ["serve", "--max-num-seqs", "0"],
                 ["serve", "--served-model-name", ""], ["serve", "--served-model-name", "a", " "]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    assert "usage: slipstream serve" in capsys.readouterr().err


def test_operator_is_dispatched_lazily_with_its_arguments(monkeypatch):
    calls = []
    module = types.ModuleType("slipstream.operator.cli")
    module.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "slipstream.operator.cli", module)
    assert cli.main(["operator", "run", "--namespace", "x"]) == 0
    assert calls == [["run", "--namespace", "x"]]


def test_missing_subcommand_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(cli._DISPATCH, "simulate", "slipstream.server.no_such_module")
    assert cli.main(["simulate"]) == 2
    assert "not available" in capsys.readouterr().err


def test_unknown_command_and_no_command(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().out


async def test_a_model_that_cannot_load_is_one_error_line_and_exit_1(caplog):
    from slipstream.server.api.server import serve
    from slipstream.server.api.state import ServerOptions

    code = await serve(EngineConfig(model="/nonexistent/model.gguf"), ServerOptions(log_interval=0), "127.0.0.1", 0)
    assert code == 1
    failed = [r for r in caplog.records if r.getMessage().startswith("loading the model failed")]
    assert len(failed) == 1 and "/nonexistent/model.gguf" in failed[0].getMessage()
    assert failed[0].exc_info is None  # the message names the problem; no traceback


async def test_a_model_whose_every_output_is_nan_never_reports_ready_and_exits_1(tmp_path, caplog):
    """A layer of NaN weights: the warm-up step already fails every request, so the server must not
    take traffic (a pod would pass its readiness probe and fail everything sent to it)."""
    import torch
    import transformers

    from slipstream.server.api.server import serve
    from slipstream.server.api.state import ServerOptions
    from slipstream.server.models.loader import load_tokenizer

    tok = load_tokenizer("builtin")
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for param in model.model.layers[1].parameters():
            param.fill_(float("nan"))
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    code = await serve(EngineConfig(model=str(tmp_path), kv_cache_memory_bytes=1 << 20), ServerOptions(log_interval=0),
                       "127.0.0.1", 0)
    assert code == 1
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading the model failed")]
    assert len(failed) == 1 and "warm-up" in failed[0] and "not finite" in failed[0], failed
    assert not [r for r in caplog.records if " ready" in r.getMessage()]


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run_serve", interrupted)
    assert cli.main(["serve"]) == 130
    assert capsys.readouterr().err == "slipstream: interrupted\n"
