"""The command line: every engine argument is a flag of generate, info and serve, generated from
EngineConfig's fields with their types and help, and parsed into what LLM(...) takes."""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from workbench.cli import engine_args, generate, serve
from workbench.config import EngineConfig


def _parser(build) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    build(p)
    return p


@pytest.mark.parametrize("build", [generate.add_info_arguments, serve.add_arguments])
def test_every_engine_argument_is_a_flag_with_its_help(build):
    p = _parser(build)
    flags = {a.dest: a for a in p._actions}
    for f in fields(EngineConfig):
        assert f.name in flags, f.name
        assert f.metadata["help"] in flags[f.name].help
    defaults = engine_args.engine_kwargs(p.parse_args([]))
    expected = {f.name: f.default for f in fields(EngineConfig)}
    if build is serve.add_arguments:
        expected.update(serve.SERVER_DEFAULTS)
    assert defaults == expected


def test_flags_parse_into_engine_arguments():
    p = _parser(generate.add_arguments)
    args = p.parse_args(["hello", "--max-num-seqs", "3", "--no-enable-chunked-prefill", "-tp", "2",
                         "-sp", "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 2}', "--cpu-gemv",
                         "false", "--fused-decode", "auto", "--cpu-offload-gb", "0.5",
                         "--tpot-slo", "0.1", "--kv-cache-dtype", "auto:0,int8:1",
                         "--moe-experts", "4", "--seed", "7"])
    kw = engine_args.engine_kwargs(args)
    assert kw["max_num_seqs"] == 3 and kw["enable_chunked_prefill"] is False
    assert kw["tensor_parallel_size"] == 2 and kw["sequence_parallel"] is True
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert kw["cpu_gemv"] is False and kw["fused_decode"] is None
    assert kw["cpu_offload_gb"] == 0.5 and kw["tpot_slo"] == 0.1
    assert kw["kv_cache_dtype"] == "auto:0,int8:1"
    assert kw["moe_config"] == {"num_experts": 4, "top_k": 4}
    assert "seed" not in kw and args.seed == 7       # generate's --seed is the request's


@pytest.mark.parametrize("argv,message", [
    (["--speculative-config", "{method: ngram}"], "--speculative-config takes a JSON object"),
    (["--moe-config", "[1, 2]"], "--moe-config takes a JSON object"),
    (["--cpu-gemv", "maybe"], "'maybe' is not one of auto, true, false"),
    (["--max-num-seqs", "many"], "invalid int value: 'many'"),
])
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parser(generate.add_info_arguments).parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_router_starts_without_torch():
    code = ("import sys\nfrom workbench.cli import main\n"
            "try:\n    main(['router', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'the router imported torch'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--replica" in result.stdout
