"""The ``minivllm`` command line: the engine's options come from EngineConfig's fields, declared once; every flag
users pass (vLLM's names among them) stays; ``--help`` lists them by group."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import OPTION_GROUPS, EngineConfig
from engine.loading.default_model import DEFAULT_MODEL_NAME
from server.cli import build_parser, engine_config_from_args
from server.cli.engine_options import option_fields

REPO = Path(__file__).resolve().parent.parent
# EngineConfig's fields that are for the Python API only.
PYTHON_ONLY = {"cuda_graph_batch_sizes", "check_invariants_when_idle"}
ENGINE_FLAGS = [
    "--model", "--tokenizer", "--trust-remote-code", "--served-model-name", "--dtype", "--device", "--load-format",
    "--quantization", "-q", "--generation-config", "--seed", "--max-model-len",
    "--kvcache-block-size", "--kv-cache-dtype", "--num-kvcache-blocks", "--num-gpu-blocks-override",
    "--gpu-memory-utilization", "--cpu-kvcache-space-gib", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--kv-offloading-size", "--kv-offloading-backend", "--preemption-mode",
    "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--max-logprobs", "--attention-backend", "--enforce-eager", "--compile", "--runner", "--cuda-graph-max-tokens",
    "--overlap-steps",
    "--no-overlap-steps", "--async-scheduling", "--no-async-scheduling", "--structured-outputs-max-bytes",
    "--structured-outputs-compile-timeout", "--xgrammar-cache-mb", "--speculative-config",
    "--tensor-parallel-size", "-tp", "--nnodes", "--node-rank", "--master-addr", "--master-port",
    "--distributed-timeout", "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
]
SERVER_FLAGS = [
    "--tool-call-parser", "--reasoning-parser", "--host", "--port", "--uds", "--root-path", "--api-key",
    "--metrics-prefix", "--enable-force-include-usage", "--trust-request-chat-template",
    "--enable-prompt-tokens-details", "--return-tokens-as-token-ids", "--enable-prompt-embeds",
    "--enable-per-request-metrics", "--max-waiting-requests", "--max-request-body-mb", "--max-choices-per-request",
    "--max-tokens-limit", "--max-logprob-entries", "--request-header-timeout", "--request-body-timeout",
    "--timeout-keep-alive", "--allowed-media-domains", "--allow-private-media-addresses", "--max-image-mb",
    "--max-image-megapixels", "--max-request-megapixels", "--max-images-per-request", "--media-fetch-timeout",
    "--shutdown-timeout", "--log-level", "--lora-modules",
]


def command(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def flags(name: str) -> set[str]:
    return {flag for action in command(name)._actions for flag in action.option_strings} - {"-h", "--help"}


def test_every_flag_is_still_there():
    assert flags("serve") == set(ENGINE_FLAGS) | set(SERVER_FLAGS)
    # A worker takes the server's model, KV cache, scheduling and parallel options, so one command line fits both.
    assert flags("worker") == set(ENGINE_FLAGS) | {"--tool-call-parser", "--reasoning-parser", "--log-level"}


def test_every_engine_field_is_an_option_or_python_only():
    names = {f.name for f in option_fields()}
    assert names | PYTHON_ONLY == {f.name for f in dataclasses.fields(EngineConfig)} and not names & PYTHON_ONLY
    for f in option_fields():
        assert f.metadata["help"] and f.metadata["group"] in OPTION_GROUPS, f.name


def test_the_defaults_are_engine_configs():
    args = build_parser().parse_args(["serve"])
    config = engine_config_from_args(args)
    assert config == dataclasses.replace(EngineConfig(), served_model_name=DEFAULT_MODEL_NAME)
    assert config.served_model_name == DEFAULT_MODEL_NAME


def test_flags_land_in_their_fields():
    args = build_parser().parse_args([
        "serve", "-tp", "2", "-q", "fp8", "--no-enable-prefix-caching", "--overlap-steps", "--no-async-scheduling",
        "--distributed-timeout", "5", "--structured-outputs-compile-timeout", "3", "--enforce-eager",
        "--trust-remote-code", "--max-model-len", "100", "--dtype", "float32", "--model", "/nowhere/Qwen3-0.6B",
        "--gpu-memory-utilization", "0.5", "--master-addr", "10.0.0.1"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.quantization, config.enable_prefix_caching) == (2, "fp8", False)
    assert (config.overlap_steps, config.async_scheduling, config.enforce_eager) == (True, False, True)
    assert (config.distributed_timeout_s, config.structured_outputs_compile_timeout_s) == (5.0, 3.0)
    assert (config.max_model_len, config.dtype, config.gpu_memory_utilization) == (100, "float32", 0.5)
    assert config.trust_remote_code and config.master_addr == "10.0.0.1"
    assert config.served_model_name == "/nowhere/Qwen3-0.6B"  # no such directory: the name as given


def test_quantization_defaults_to_the_checkpoint_and_takes_none():
    """``--quantization`` unset is None (what the checkpoint says: a GGUF model's blocks); ``none`` dequantizes, as
    ``LLM(quantization="none")`` does; its help says both."""
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).quantization is None
    assert engine_config_from_args(parser.parse_args(["serve", "-q", "none"])).quantization == "none"
    assert EngineConfig(quantization="none").quantization == "none"
    help_text = " ".join(command("serve").format_help().split())
    assert "default: what the checkpoint says" in help_text and "none: dequantize" in help_text


def test_values_outside_the_choices_are_refused(capsys):
    for bad in (["--dtype", "float8"], ["--kv-cache-dtype", "int8"], ["--attention-backend", "flash"],
                ["--quantization", "awq"], ["--max-num-seqs", "many"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
        assert bad[0] in capsys.readouterr().err


def test_help_lists_the_options_by_group_with_their_defaults():
    text = command("serve").format_help()
    headings = [text.index(f"\n{heading}:\n") for heading in (*OPTION_GROUPS, "HTTP server")]
    assert headings == sorted(headings)
    model = text[headings[0]:headings[1]]
    assert "--tool-call-parser" in model and "--max-model-len" in model
    assert "--distributed-timeout DISTRIBUTED_TIMEOUT" in text and "DISTRIBUTED_TIMEOUT_S" not in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text and "--enforce-eager       never" in text
    assert "(default: 8192)" in text and "(default: None)" not in text and "(default: False)" not in text
    assert f"({DEFAULT_MODEL_NAME} for" in " ".join(text.split())


def test_python_m_server_cli_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--max-num-seqs" in done.stdout and "HTTP server:" in done.stdout
