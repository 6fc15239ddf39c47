"""The synchronous engine: requests in, one ``step()`` at a time, outputs out.

    step():  StepPipeline.take()  ->  StepPipeline.finish()  ->  Scheduler.update_from_output()  ->  StepPipeline.done()
             schedule + launch        the step's one sync        (+ BeamSearch.advance)             (the next launch)

Which step is launched when (overlapped steps, async scheduling, grammar masks) is the ``StepPipeline``'s to
decide; beam searches run behind their coordinator (``BeamSearch``). Both the offline ``LLM`` and the async
server engine drive this class.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import socket
import time
import weakref

from engine.config import ConfigError, EngineConfig
from engine.core.beam_search import BeamSearch
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.step_pipeline import StepPipeline, StepTiming
from engine.errors import RequestError
from engine.loading.default_model import resolve_model_path
from engine.loading.generation_defaults import load_sampling_defaults
from engine.loading.model_config import ModelConfig, check_tensor_parallel, resolve_max_model_len
from engine.loading.model_info import ModelInfo, matryoshka_dimensions
from engine.loading.mrope import MRopePositions, mrope_positions
from engine.loading.tokenizer import load_tokenizer
from engine.lora.checks import AdapterChecks
from engine.outputs import EngineOutput, EngineStats, FinishReason
from engine.sampling_params import SamplingParams
from engine.speculative.proposer import SpeculationProposer
from engine.worker.model_runner import ModelRunner
from kvcache.manager import KVCacheManager

logger = logging.getLogger("minivllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report_rank_death(engine_ref: weakref.ref, message: str) -> None:
    """The rank watcher's call (engine/worker/ranks.py LocalRanks): it holds the engine only weakly."""
    logger.error("%s: the engine stops", message)
    engine = engine_ref()
    callback = engine.on_rank_death if engine is not None else None
    del engine
    if callback is not None:
        callback(message)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self._frozen = False  # start-up's objects are out of the garbage collector's walks (set once ready)
        self._ranks = None  # the other tensor-parallel ranks of this machine (engine/worker/ranks.py LocalRanks)
        self.pipeline: StepPipeline | None = None  # the steps in flight and the grammars (engine/core/step_pipeline.py)
        self.on_rank_death = None  # called from a watcher thread when another rank's process exits
        try:
            self._start(config)
        except BaseException:
            self.close()  # ranks already started would keep the process group (and their processes) alive
            raise

    def _start(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.model_path = resolve_model_path(config)
        self.model_config = ModelConfig.from_pretrained(self.model_path, config.trust_remote_code)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        if self.model_config.num_labels and config.runner != "pooling":
            raise ConfigError(f"{self.model_config.architecture} is a classifier, which scores and does not "
                              "generate: serve it with --runner pooling")
        if config.tensor_parallel_size > 1:
            self._start_tensor_parallel()
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, self.eos_token_ids)
        if self._ranks is not None:
            self._ranks.channel = self.runner.followers
        num_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.runner.warm_up_kernels()
        self.runner.capture_cuda_graphs()
        self.kv_manager = KVCacheManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching,
                                         num_host_blocks=self.runner.num_host_blocks)
        images = bool(getattr(self.runner.model, "accepts_images", False))
        # A step encodes at most as many image tokens as it computes tokens; no image may take more.
        max_encoder_tokens = config.max_num_batched_tokens if images else 0
        self.model_info = self._model_info(num_blocks, images, max_encoder_tokens)
        if self.model_info.sampling_defaults:
            logger.info("sampling defaults from the generation config (requests override them; "
                        "--generation-config vllm ignores them): %s",
                        ", ".join(f"{k}={v}" for k, v in self.model_info.sampling_defaults.items()))
        # (request id, why, the request field) of requests ended because their grammar failed to compile
        # (or took too long); the engine core reports them to the API server as errors.
        self.grammar_failures: list[tuple[str, str, str]] = []
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_encoder_tokens=max_encoder_tokens,
            preemption_mode=config.preemption_mode or ("auto" if self.runner.num_host_blocks else "recompute"),
            max_loras=config.max_loras if config.enable_lora else None,
        )
        self.adapters = AdapterChecks(config, self.model_config, self.runner.lora)
        self.beams = BeamSearch(self.scheduler, self.eos_token_ids, self.max_model_len)
        on_cuda = self.runner.device.type == "cuda"
        self.proposer = SpeculationProposer.from_config(config.speculative_config)
        async_scheduling = config.async_scheduling if config.async_scheduling is not None else on_cuda
        if self.proposer is not None and async_scheduling:
            # A step planned before the last one's tokens are known cannot hold proposals that follow them.
            logger.info("speculative decoding: steps are planned ahead (async scheduling) only while none would "
                        "take proposals")
        self.pipeline = StepPipeline(
            self.scheduler, self.runner,
            overlap_steps=config.overlap_steps if config.overlap_steps is not None else on_cuda,
            async_scheduling=async_scheduling,
            new_grammars=functools.partial(_new_grammar_manager, self.tokenizer, self.model_config.vocab_size,
                                           self.eos_token_ids, config),
            wants_proposals=(lambda: self.proposer.wants_proposals(self.scheduler.running))
            if self.proposer is not None else None,
        )
        # Start-up made objects that live as long as the engine, one per KV block above all (139k on an H200
        # with an FP8 cache). A full garbage collection walks every one: on an H200 host that stalled one
        # step of a run for 217 ms. Frozen, collections skip them (close() lets them go again). Dropped
        # engines free their tensors by reference counting alone, so freezing keeps no GPU memory.
        gc.freeze()
        self._frozen = True
        logger.info(
            "engine ready in %.1f s: %s, max_model_len=%d, max_num_seqs=%d, max_num_batched_tokens=%d, "
            "overlap_steps=%s, async_scheduling=%s",
            time.perf_counter() - start, self.model_config.architecture, self.max_model_len, config.max_num_seqs,
            config.max_num_batched_tokens, self.pipeline.overlap_steps, self.pipeline.async_scheduling,
        )

    def _start_tensor_parallel(self) -> None:
        """Rank 0 of several: start this machine's other ranks and join the group (engine/worker/ranks.py)."""
        from engine import distributed
        from engine.worker.ranks import LocalRanks, init_method, spawn_local_workers

        check_tensor_parallel(self.model_config, self.config.tensor_parallel_size)
        if self.config.node_rank != 0:
            raise ConfigError("the engine is rank 0, on node 0; other nodes run `minivllm worker`")
        self.config.rank_device(self.config.ranks_per_node - 1)  # this node has a GPU for each of its ranks
        if self.config.master_port == 0:
            self.config = dataclasses.replace(self.config, master_port=free_port())
        self._ranks = LocalRanks(spawn_local_workers(self.config, 1, self.config.ranks_per_node - 1))
        # Stops the ranks when the engine is dropped without close(), and at interpreter exit. The finalizer
        # holds the ranks, not the engine: an atexit hook on close() kept every engine (its model, its KV
        # cache) alive until exit.
        weakref.finalize(self, self._ranks.stop)
        distributed.init_tensor_parallel(0, self.config.tensor_parallel_size, init_method(self.config),
                                         timeout_s=self.config.distributed_timeout_s)
        # A rank that exits while the engine runs is fatal: the next collective would fail or hang.
        self._ranks.watch(functools.partial(_report_rank_death, weakref.ref(self)))

    def close(self) -> None:
        """Release what the engine holds beyond its own objects; idempotent. Stops the other tensor-parallel
        ranks (their processes joined) and destroys the process group, so that another engine can start in this
        process; stops the grammar threads; and unfreezes what start-up froze (all of the process's frozen
        objects: another engine's are only walked by collections again). The model and KV cache go with the
        engine object: ``LLM.shutdown()`` drops it too."""
        if self._frozen:
            self._frozen = False
            gc.unfreeze()
        if self.pipeline is not None:
            self.pipeline.shutdown()
        if self._ranks is not None:
            self._ranks.stop()

    def _model_info(self, num_blocks: int, images: bool, max_encoder_tokens: int) -> ModelInfo:
        """What a front end needs to know about the served model (``engine.loading.model_info``)."""
        config = self.config
        return ModelInfo(
            model_path=self.model_path, tokenizer_path=config.tokenizer or self.model_path,
            architecture=self.model_config.architecture, max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size, eos_token_ids=tuple(sorted(self.eos_token_ids)),
            num_kv_blocks=num_blocks, kv_block_size=config.kvcache_block_size, device=str(self.runner.device),
            sampling_defaults=load_sampling_defaults(config.generation_config, self.model_path),
            max_logprobs=config.max_logprobs, max_num_seqs=config.max_num_seqs,
            input_modalities=("text", "image") if images else ("text",),
            image_token_id=self.model_config.multimodal.image_token_id if images else None,
            max_tokens_per_image=max_encoder_tokens or None,
            structured_outputs_max_bytes=config.structured_outputs_max_bytes,
            runner=config.runner, hidden_size=self.model_config.hidden_size, num_labels=self.model_config.num_labels,
            matryoshka_dimensions=matryoshka_dimensions(self.model_path),
        )

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, checked: bool = False, mm_inputs: list | None = None
                    ) -> Request:
        """Queue a request. Raises RequestError for input that cannot be served.

        ``checked``: the caller already ran ``validate_request`` (the API server does, before
        the request crosses to the engine process), so it is not checked twice; the images'
        pixel sizes, which only the model knows how to read, are checked here in any case.
        ``mm_inputs``: the prompt's images (``engine.loading.multimodal.ImageInput``), by offset.
        """
        if not checked:
            params = self.validate_request(prompt_token_ids, params, mm_inputs)
        elif mm_inputs:
            self._check_image_sizes(mm_inputs)
        mrope = self._mrope_positions(mm_inputs)
        if params.lora_request is not None:
            self.adapters.check(params.lora_request, params)
        if params.use_beam_search:
            return self.beams.add(request_id, prompt_token_ids, params, arrival_time, mm_inputs, mrope)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time, mm_inputs, mrope)
        if params.structured_outputs is not None:
            request.grammar = self.pipeline.attach_grammar(request_id, params.structured_outputs)
        self.scheduler.add_request(request)
        return request

    @property
    def grammars(self):
        """The ``GrammarManager`` (engine/core/structured_output.py), made with the first constrained request."""
        return self.pipeline.grammars

    def waiting_for_grammars(self) -> bool:
        """True when nothing can be scheduled until a grammar compiles: no step runs or waits to, and every
        waiting request waits for its grammar (the engine core then sleeps instead of stepping)."""
        return self.pipeline.waiting_for_grammars()

    def settle_grammars(self) -> list[EngineOutput]:
        """End the requests whose grammar failed to compile or passed its time bound (``grammar_failures``
        says why); their outputs finish with "abort"."""
        failures = self.pipeline.settle_grammars()
        if not failures:
            return []
        self.grammar_failures += failures
        return self.abort_requests([request_id for request_id, _, _ in failures])

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams,
                         mm_inputs: list | None = None) -> SamplingParams:
        """Check a prompt (and its images) against the model and the context; return params with max_tokens
        resolved."""
        params = self.model_info.check_request(prompt_token_ids, params, mm_inputs)
        if params.structured_outputs is not None:
            from engine.core.structured_output import check_structured_outputs

            check_structured_outputs(params.structured_outputs, self.config.structured_outputs_max_bytes)
        if mm_inputs:
            self._check_image_sizes(mm_inputs)
        return params

    def _check_image_sizes(self, mm_inputs: list) -> None:
        """Each image's pixel values are what the vision encoder takes, and make as many embeddings as the
        image has placeholder tokens (a mismatch would fail the step of every request in it)."""
        if not self.model_info.accepts_images:
            raise RequestError(f"{self.model_config.architecture} does not take images", param="multi_modal_data")
        for i, mm in enumerate(mm_inputs):
            try:
                expected = self.runner.model.num_image_tokens(tuple(mm.pixel_values.shape), mm.grid_thw)
            except ValueError as exc:
                raise RequestError(f"image {i}: {exc}", param="multi_modal_data") from None
            if expected != mm.length:
                raise RequestError(f"image {i} has {mm.length} placeholder tokens, but the model makes {expected} "
                                   f"embeddings of its pixel values", param="multi_modal_data")

    def _mrope_positions(self, mm_inputs: list | None) -> MRopePositions | None:
        """An M-RoPE model's positions of a prompt with images, computed once per request (None: every token is
        at its index, as for any prompt of a text model)."""
        if not mm_inputs or self.model_config.mrope_section is None:
            return None
        return mrope_positions(mm_inputs, self.model_config.multimodal.spatial_merge_size)

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        self.pipeline.forget(request_ids)
        return self.beams.abort(request_ids) + self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --------------------------------------------------------------------- step

    def step(self) -> list[EngineOutput]:
        """Finish one step and return what each request produced.

        With overlapped steps (CUDA by default) the next step is scheduled and queued on the
        device before this returns, so the device computes while the caller handles these
        outputs (detokenization, streaming) and while the next call waits on it. Requests
        added or aborted in between take effect from the step after; an aborted request's
        result from the step in flight is dropped.

        Requests whose grammar failed to compile end first (``settle_grammars``); when every request waits
        for its grammar, this waits for a compile to end (or a time bound to pass) instead of stepping.
        """
        settled = self.settle_grammars()
        pipeline = self.pipeline
        if pipeline.waiting_for_grammars():
            pipeline.wait_for_grammars()
            return settled + self.settle_grammars()
        step = pipeline.take()  # schedule and launch (or the step launched ahead); async: launch the next one
        if step is None:
            return settled
        runner_out = pipeline.finish(step)  # the step's one sync
        outputs = self.scheduler.update_from_output(step.sched, runner_out)
        if runner_out.pooled:  # pooling requests end with their prompt: their output is the vector, not a token
            for out in outputs:
                if out.request_id in runner_out.pooled:
                    out.pooled, out.new_token_ids = runner_out.pooled[out.request_id], []
                    out.finish_reason = FinishReason.STOP
        if self.proposer is not None:  # before the next step is planned (overlapped steps: in done())
            self.proposer.count(step.sched.spec_token_ids, runner_out.accepted_token_ids)
            self.proposer.propose(self.scheduler.running)
        if self.scheduler.group_reports:  # beams' logprobs: their searches choose their tokens
            outputs += self.beams.advance(self.scheduler.take_group_reports())
        pipeline.done(step, outputs)  # overlapped steps: launch the next one
        return settled + outputs

    def check_invariants(self) -> None:
        """Check the KV manager's tables against its pool (~1 us per block): for idle moments only."""
        self.kv_manager.check_invariants()
        if self.scheduler.encoder_cache is not None:
            self.scheduler.encoder_cache.check_invariants()

    def measure_steps(self, enabled: bool = True) -> None:
        """Record a StepTiming for every step (host work vs device time), for benchmarks."""
        self.pipeline.measure_steps(enabled)

    @property
    def step_timings(self) -> list[StepTiming]:
        return self.pipeline.step_timings

    @property
    def num_steps_planned_ahead(self) -> int:
        return self.pipeline.num_steps_planned_ahead

    @property
    def last_num_scheduled_tokens(self) -> int:
        """The tokens (prompt and decode) of the step that ``step()`` finished last."""
        return self.pipeline.last_num_scheduled_tokens

    @property
    def overlap_steps(self) -> bool:
        return self.pipeline.overlap_steps

    @property
    def async_scheduling(self) -> bool:
        return self.pipeline.async_scheduling

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions_total,
            kv=self.kv_manager.get_stats(),
            block_states=self.kv_manager.pool.block_states(),
            visual_blocks=self.kv_manager.pool.visual_blocks(),
            num_waiting_for_grammar=sum(1 for r in self.scheduler.waiting if not r.ready),
            encoder=self.scheduler.encoder_cache.stats() if self.scheduler.encoder_cache is not None else None,
            num_steps_by_kind=dict(self.runner.num_steps_by_kind),
            kv_transfers=(dataclasses.replace(self.runner.offloader.poll()) if self.runner.offloader is not None
                          else None),
            host_block_states=self.kv_manager.host.block_states() if self.kv_manager.host is not None else None,
            spec_decode=self.proposer.stats() if self.proposer is not None else None,
            lora=self.adapters.stats(self.scheduler, self.runner.lora),
        )


def _new_grammar_manager(tokenizer, vocab_size: int, eos_token_ids: frozenset[int], config: EngineConfig):
    """The engine's ``GrammarManager``, made with its first constrained request."""
    if tokenizer is None:
        raise RequestError("structured outputs need a tokenizer, and this model has none", param="structured_outputs")
    from engine.core.structured_output import GrammarManager

    return GrammarManager(tokenizer, vocab_size, eos_token_ids, config.max_num_seqs, config.xgrammar_cache_mb,
                          config.structured_outputs_compile_timeout_s)


__all__ = ["LLMEngine", "EngineStats"]
