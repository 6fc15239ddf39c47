"""An ``LLM`` gives back what it holds: ``del llm``, ``shutdown()``, a ``with`` block and interpreter exit each stop
the tensor-parallel rank processes, destroy the process group and let the model go, so the next ``LLM`` starts in
the same process, as vLLM users write in notebooks, sweeps and tests.

Each scenario runs in a fresh Python process of its own: the pytest process's state (another test's process group,
its children) can neither hide a leak nor cause one. Ranks run on the CPU over gloo.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers

from tests.helpers import SMALL_CONFIG, save_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent


def processes() -> dict[int, tuple[str, int, int]]:
    """{pid: (state, parent pid, process group)} of every process on the machine, read from /proc as ``ps`` does."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended while we looked
                continue
            found[int(name)] = (fields[0], int(fields[1]), int(fields[2]))
    return found


def children(pid: int) -> list[int]:
    return sorted(p for p, (_, parent, _) in processes().items() if parent == pid)


# The scripts below find processes with the same two functions.
PROC_HELPERS = "import os\n" + inspect.getsource(processes) + inspect.getsource(children)

LIFECYCLE_SCRIPT = PROC_HELPERS + '''
import json, multiprocessing, sys, weakref
import torch.distributed as dist
from engine import LLM, SamplingParams

path, prompts, broken_tokenizer = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
common = dict(max_model_len=256, num_kvcache_blocks=24)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
me = os.getpid()
report = []

def use(llm):
    """Generate; note the rank processes, and weak references to the engine and its model."""
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    held = [weakref.ref(llm.engine), weakref.ref(llm.engine.runner.model)]
    return {"tokens": tokens, "ranks": children(me), "group_while_alive": dist.is_initialized()}, held

def released(phase, held, error=None):
    alive = {p: s for p, s in processes().items() if p in phase["ranks"]}
    phase.update(ranks_left=alive, children_left=children(me), mp_children=len(multiprocessing.active_children()),
                 group_after=dist.is_initialized(), objects_alive=[r() is not None for r in held], error=error)
    report.append(phase)

def error_of(call):
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return None

# Its rank is started before the tokenizer fails to load: the failed start stops it and leaves the group.
try:
    LLM(path, tensor_parallel_size=2, tokenizer=broken_tokenizer, **common)
    failed_start = None
except Exception as exc:
    failed_start = {"error": type(exc).__name__, "children_left": children(me), "group_after": dist.is_initialized()}

llm = LLM(path, tensor_parallel_size=2, **common)
phase, held = use(llm)
del llm  # no gc.collect(): the last reference going is enough
released(phase, held)

llm = LLM(path, tensor_parallel_size=2, **common)
phase, held = use(llm)
llm.shutdown()
llm.shutdown()  # a second call does nothing
released(phase, held, error_of(lambda: llm.generate([{"prompt_token_ids": [1, 2]}], params, use_tqdm=False)))

with LLM(path, tensor_parallel_size=2, **common) as llm:
    phase, held = use(llm)
released(phase, held, error_of(lambda: llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)))
del llm

llm = LLM(path, **common)
phase, held = use(llm)
del llm
released(phase, held)
print(json.dumps({"failed_start": failed_start, "phases": report}))
'''

EXIT_SCRIPT = '''
import json, logging, os, sys
from engine import LLM, SamplingParams

logging.basicConfig(level=logging.INFO)
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=256, num_kvcache_blocks=24)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
tokens = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"tokens": tokens, "ranks": children(os.getpid())}), flush=True)
# Exits with the LLM alive: no del, no shutdown().
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    config = transformers.LlamaConfig(**{**SMALL_CONFIG, "tie_word_embeddings": True})
    return save_checkpoint(config, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def scripts(model_dir, tmp_path_factory):
    """Both scenarios' scripts, started together: each runs in a fresh process (and group) of its own, and the
    two use two cores where one scenario alone would leave one idle. A test reads its own with ``finish``."""
    prompts = [[3, 17, 42, 99, 7], [250, 11, 64]]
    broken = tmp_path_factory.mktemp("broken-tokenizer")
    (broken / "tokenizer.json").write_text("not json")
    procs = {"lifecycle": python(LIFECYCLE_SCRIPT, str(model_dir), json.dumps(prompts), str(broken)),
             "exit": python(PROC_HELPERS + EXIT_SCRIPT, str(model_dir), start_new_session=True)}
    yield procs
    for proc in procs.values():  # a test that was deselected or failed early leaves its script behind
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def python(script: str, *args: str, **popen) -> subprocess.Popen:
    # One torch thread a process: the scripts' ranks (two scripts at once) would otherwise spin against each other.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script hung:\n{out}\n{err[-5000:]}")
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{out}\n{err[-5000:]}"
    return out, err


def test_three_tp2_llms_in_turn_then_tp1_leave_no_rank_and_no_process_group(scripts):
    """A TP=2 LLM whose start fails after its rank started leaves neither rank nor group. Then three TP=2 LLMs,
    released by ``del llm``, by ``shutdown()`` (twice) and by a ``with`` block, and a TP=1 one: each TP=2 LLM had
    its rank process while alive and none after, the process group is gone, the engine and its model were freed
    (after ``shutdown()`` and ``with`` too, while the LLM object lives on), and each generated the TP=1 LLM's greedy
    tokens. A shut-down LLM refuses work with a clear error."""
    out, err = finish(scripts["lifecycle"])
    result = json.loads(out.strip().splitlines()[-1])
    failed = result["failed_start"]
    assert failed is not None, "an LLM with a broken tokenizer started"
    assert failed["children_left"] == [] and failed["group_after"] is False, f"a failed start leaked: {failed}"
    phases = result["phases"]
    names = ["del", "shutdown", "with", "tp1"]
    assert len(phases) == 4, err[-5000:]
    expected = phases[3]["tokens"]
    assert all(len(t) == 8 for t in expected)
    for name, phase in zip(names, phases):
        tp = name != "tp1"
        assert phase["tokens"] == expected, name
        assert len(phase["ranks"]) == (1 if tp else 0), f"{name}: rank processes while alive {phase['ranks']}"
        assert phase["group_while_alive"] is tp, name
        assert phase["ranks_left"] == {}, f"{name}: rank processes left after release: {phase['ranks_left']}"
        assert phase["children_left"] == [] and phase["mp_children"] == 0, name
        assert phase["group_after"] is False, f"{name}: the process group is still initialised"
        assert phase["objects_alive"] == [False, False], f"{name}: engine, model still alive: {phase['objects_alive']}"
    for name in ("shutdown", "with"):
        assert "has been shut down" in phases[names.index(name)]["error"], name
    assert "trying to initialize the default process group twice" not in err


def test_interpreter_exit_with_a_live_tp2_llm_leaves_no_orphan(scripts):
    """A script that ends with its TP=2 LLM still alive stops the rank cleanly on the way out (status 0, not
    killed), and nothing of its process group outlives it."""
    proc = scripts["exit"]
    out, err = finish(proc)
    run = json.loads(out.strip().splitlines()[-1])
    assert len(run["tokens"]) == 4 and len(run["ranks"]) == 1
    assert "tensor parallel: ranks stopped (exit statuses [0])" in err, err[-5000:]
    left = {pid: info for pid, info in processes().items()
            if info[2] == proc.pid or pid in run["ranks"]}
    assert left == {}, f"processes of the script's group outlived it: {left}"
