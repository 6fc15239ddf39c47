"""Fault injection for the server tests, kept out of the product.

A server started with this folder on ``PYTHONPATH`` and ``MINIVLLM_TEST_STEP_FAILS_AFTER=N``
in its environment runs an engine whose ``step`` raises once it has run N steps. Python
imports ``sitecustomize`` at start-up in every process, so this reaches the engine core
process that the server spawns.
"""

import itertools
import os

_AFTER = os.environ.get("MINIVLLM_TEST_STEP_FAILS_AFTER")

if _AFTER is not None:
    from engine.core import llm_engine

    _num_steps = int(_AFTER)
    _counter = itertools.count(1)
    _step = llm_engine.LLMEngine.step

    def _failing_step(self):
        if next(_counter) > _num_steps:
            raise RuntimeError(f"injected fault: the engine step fails after {_num_steps} steps")
        return _step(self)

    llm_engine.LLMEngine.step = _failing_step
