"""Real servers for the server tests: a subprocess running ``python -m server.cli serve`` on a free port.

Test modules load this file as a plugin (``pytest_plugins = ["tests.server_helpers"]``), so
the session-scoped servers below start once for the whole run, however many modules use them.
A server's log is printed after any test that fails while it is running.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TINY_MODEL_NAME = "tiny-llama"
TINY_MAX_MODEL_LEN = 4096
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_LIVE_SERVERS: list[ServerProcess] = []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``minivllm serve`` in a subprocess, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.args = list(args)
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc: subprocess.Popen | None = None
        # A server on a Unix socket (--uds) is reached through it: self.client() then.
        self.uds = self.args[self.args.index("--uds") + 1] if "--uds" in self.args else None

    def client(self, **kwargs) -> httpx.Client:
        """An HTTP client for this server, over its Unix socket when it has one."""
        if self.uds:
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://localhost", **kwargs)
        return httpx.Client(base_url=self.url, **kwargs)

    def start(self, timeout_s: float = 240.0) -> ServerProcess:
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        _LIVE_SERVERS.append(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                with self.client(timeout=2.0) as client:
                    if client.get("/health").status_code == 200:
                        return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not healthy within {timeout_s} s:\n{self.log_tail()}")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in _LIVE_SERVERS:
            _LIVE_SERVERS.remove(self)
        return self.proc.returncode

    def log_tail(self, num_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except FileNotFoundError:
            return "(no log)"


def start_server(tmp_dir: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(args, tmp_dir / f"{name}.log", env).start()


FAULTS_DIR = Path(__file__).resolve().parent / "faults"


def failing_step_env(num_steps: int) -> dict[str, str]:
    """The environment of a server whose engine step raises after ``num_steps`` steps (tests/faults)."""
    path = os.pathsep.join(p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "MINIVLLM_TEST_STEP_FAILS_AFTER": str(num_steps)}


def engine_core_pid(server: ServerProcess) -> int:
    """The engine core process of a running server, as its start-up log names it."""
    match = re.search(r"engine core process (\d+) starting", server.log_path.read_text())
    assert match, f"no engine core pid in the log:\n{server.log_tail()}"
    return int(match.group(1))


def rank_pids(server: ServerProcess) -> list[int]:
    """The processes of the tensor-parallel ranks after rank 0, as the server's start-up log names them."""
    match = re.search(r"tensor parallel: started ranks [\d-]+ \(pids ([\d, ]+)\)", server.log_path.read_text())
    assert match, server.log_tail()
    return [int(p) for p in match.group(1).split(", ")]


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------ tiny model


QWEN_STYLE_TEMPLATE = Path(__file__).parent / "data" / "qwen_style_template.jinja"
QWEN_STYLE_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def build_tiny_model(out_dir: Path, tokenizer_dir: Path, head_dim: int = 16, qwen_style: bool = False,
                     pad_vocab: int = 0) -> Path:
    """A 2-layer random-weight Llama with the default model's tokenizer: fast, and text still works.
    (The Triton kernels on a GPU need ``head_dim`` >= 32.) ``qwen_style``: the tokenizer gets
    Qwen's tool-call and thinking markers as tokens of their own and a Qwen-style chat template
    (tests/data/qwen_style_template.jinja). ``pad_vocab``: embedding rows beyond the tokenizer's
    tokens, as Qwen's and Llama's checkpoints have."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if qwen_style:
        tokenizer.add_tokens(QWEN_STYLE_TOKENS)
        tokenizer.chat_template = QWEN_STYLE_TEMPLATE.read_text()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer) + pad_vocab, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_MAX_MODEL_LEN,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out_dir))
    if qwen_style:
        tokenizer.save_pretrained(str(out_dir))
        return out_dir
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


# -------------------------------------------------------------------------- metrics


def tokenize(url: str, **body) -> list[int]:
    """The token ids a server's /tokenize gives for ``body`` (a prompt, or chat messages)."""
    return httpx.post(f"{url}/tokenize", json=body).json()["tokens"]


def scrape_metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {'name{label="value"}': value} (and bare names for unlabelled samples)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_until_idle(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is in use; return that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(url)
        idle = (metrics["minivllm:num_requests_running"] == 0 and metrics["minivllm:num_requests_waiting"] == 0
                and metrics["minivllm:kv_cache_blocks_used"] == 0 and metrics["minivllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return error


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_model_path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(TINY_MODEL_NAME), Path(default_model_path))


@pytest.fixture(scope="session")
def default_server(tmp_path_factory, default_model_path):
    """The default model, with a small KV pool and context so start-up is quick."""
    server = start_server(tmp_path_factory.mktemp("servers"), "default",
                          ["--num-kvcache-blocks", "256", "--max-model-len", "1024"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "tiny", tiny_server_args(tiny_model_path))
    yield server
    server.stop()


def tiny_server_args(tiny_model_path: Path) -> list[str]:
    return ["--model", str(tiny_model_path), "--served-model-name", TINY_MODEL_NAME,
            "--num-kvcache-blocks", "2048", "--max-model-len", str(TINY_MAX_MODEL_LEN)]


@pytest.fixture
def server_logs_on_failure(request):
    """Print the log of every running server after a test that failed."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        for server in _LIVE_SERVERS:
            sys.stderr.write(f"\n----- log of the server at {server.url} ({server.log_path}) -----\n")
            sys.stderr.write(server.log_tail() + "\n")
