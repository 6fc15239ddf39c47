"""The README's commands, run as written (but for the port) against a real server, so the README cannot drift."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import REPO_ROOT, start_server, tiny_server_args  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

README = (REPO_ROOT / "README.md").read_text()
FRANCE = "The capital of France is Paris."


def code_blocks(language: str, containing: str) -> list[str]:
    blocks = re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)
    found = [b for b in blocks if containing in b]
    assert found, f"no {language} block with {containing!r} in README.md"
    return found


def run(cmd: list[str], timeout_s: float = 120) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def on_port(text: str, url: str) -> str:
    return text.replace("http://localhost:8000", url)


def test_the_curl_examples(default_server):
    chat, stream = code_blocks("bash", "curl http://localhost:8000/v1/chat") + code_blocks("bash", "curl -N")
    reply = json.loads(run(["bash", "-c", on_port(chat, default_server.url)]))
    assert reply["choices"][0]["message"]["content"] == FRANCE
    events = run(["bash", "-c", on_port(stream, default_server.url)]).strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and len(events) > 2


def test_the_structured_output_example(default_server):
    (script,) = code_blocks("python", "chat.completions.parse")
    out = run([sys.executable, "-c", on_port(script, default_server.url)])
    assert out.startswith("country=") and "capital=" in out


def test_the_tool_call_example(default_server):
    (script,) = code_blocks("python", 'tool_choice="required"')
    out = run([sys.executable, "-c", on_port(script, default_server.url)])
    name, arguments = out.strip().split(" ", 1)
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)


def test_the_openai_sdk_example(default_server):
    (script,) = [b for b in code_blocks("python", "from openai import OpenAI") if "parse(" not in b
                 and "tools=" not in b and "embeddings.create(" not in b]
    lines = run([sys.executable, "-c", on_port(script, default_server.url)]).splitlines()
    assert lines[0] == FRANCE and "".join(lines[1:]).strip()  # then the streamed haiku


def test_the_offline_example():
    (script,) = code_blocks("python", "from engine import LLM")
    out = run([sys.executable, "-c", script], timeout_s=300)
    assert out.rstrip().endswith("\n" + FRANCE)
    assert len(re.findall(r" (length|stop)\n", out)) == 2  # each completion, then its finish reason


def test_serve_help_from_the_virtualenv():
    minivllm = Path(sys.executable).parent / "minivllm"
    assert "--max-tokens-limit" in run([str(minivllm), "serve", "--help"])


def test_the_ready_line_and_the_exposure_warning(tmp_path, tiny_model_path):
    server = start_server(tmp_path, "exposed", tiny_server_args(tiny_model_path) + ["--host", "0.0.0.0"])
    try:
        log = server.log_path.read_text()
        ready = [line for line in log.splitlines() if " ready: " in line]
        assert ready, log[-3000:]
        assert f"at http://localhost:{server.port}/v1; dashboard http://localhost:{server.port}/dashboard" in ready[0]
        assert "API key not required" in ready[0]
        assert "without an API key: anyone who can reach this host" in log
    finally:
        server.stop()


def _install_plan(tmp_path: Path, path_dirs: list[Path], *make_args: str) -> str:
    """What `make install` would run for a new virtualenv (make -n: nothing is installed)."""
    env = {"PATH": ":".join([*map(str, path_dirs), "/usr/bin", "/bin"]), "HOME": str(tmp_path)}
    driver = tmp_path / "nvidia-driver-version"  # this host's own driver (if any) is not what is tested
    proc = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}", f"NVIDIA_DRIVER_FILE={driver}",
                           *make_args], capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_make_takes_the_cpu_torch_without_an_nvidia_gpu(tmp_path):
    """A machine without an NVIDIA GPU gets PyTorch's CPU build (not 5 GB of CUDA libraries); one with nvidia-smi
    gets PyPI's torch; TORCH_INDEX_URL chooses, and empty means PyPI's."""
    cpu_index = "--index-url https://download.pytorch.org/whl/cpu torch"
    assert cpu_index in _install_plan(tmp_path, [])
    assert "no NVIDIA GPU found" in _install_plan(tmp_path, [])
    fake_gpu = tmp_path / "gpu-bin"
    fake_gpu.mkdir()
    (fake_gpu / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
    (fake_gpu / "nvidia-smi").chmod(0o755)
    assert "--index-url" not in _install_plan(tmp_path, [fake_gpu])
    (tmp_path / "nvidia-driver-version").write_text("NVRM version: 570\n")  # a driver but no nvidia-smi on the PATH
    assert "--index-url" not in _install_plan(tmp_path, [])
    (tmp_path / "nvidia-driver-version").unlink()
    assert "--index-url" not in _install_plan(tmp_path, [], "TORCH_INDEX_URL=")
    other = _install_plan(tmp_path, [fake_gpu], "TORCH_INDEX_URL=https://example.org/whl/cu128")
    assert "--index-url https://example.org/whl/cu128 torch" in other
