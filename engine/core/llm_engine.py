"""The synchronous engine: requests in, one ``step()`` at a time, outputs out.

    step():  Scheduler.schedule()  ->  ModelRunner.execute()  ->  Scheduler.update_from_output()

Both the offline ``LLM`` and the async server engine drive this class.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import socket
import time
import weakref
from dataclasses import dataclass

from engine.config import ConfigError, EngineConfig
from engine.core.beam_search import BeamGroup
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.errors import RequestError
from engine.loading.default_model import resolve_model_path
from engine.loading.generation_defaults import load_sampling_defaults
from engine.loading.model_config import ModelConfig, check_tensor_parallel, resolve_max_model_len
from engine.loading.model_info import ModelInfo
from engine.loading.mrope import MRopePositions, mrope_positions
from engine.loading.tokenizer import load_tokenizer
from engine.outputs import EngineOutput, EngineStats, FinishReason, RunnerTiming
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner
from kvcache.manager import KVCacheManager

logger = logging.getLogger("minivllm")


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went: Python work on the host, and the device's own time."""

    num_reqs: int
    num_tokens: int
    graph: bool  # replayed a captured decode graph
    host_s: float  # scheduling, input building and kernel launches: the device waits for these
    device_s: float  # forward pass and sampling on the device (CUDA events)
    wall_s: float


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
        self.grammars = None  # a GrammarManager, made with the first constrained request
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
        self.kv_manager = KVCacheManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        images = bool(getattr(self.runner.model, "accepts_images", False))
        # A step encodes at most as many image tokens as it computes tokens; no image may take more.
        max_encoder_tokens = config.max_num_batched_tokens if images else 0
        self.model_info = ModelInfo(
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
        )
        if self.model_info.sampling_defaults:
            logger.info("sampling defaults from the generation config (requests override them; "
                        "--generation-config vllm ignores them): %s",
                        ", ".join(f"{k}={v}" for k, v in self.model_info.sampling_defaults.items()))
        self._grammar_requests: set[str] = set()  # unfinished requests with a grammar
        # (request id, why, the request field) of requests ended because their grammar failed to compile
        # (or took too long); the engine core reports them to the API server as errors.
        self.grammar_failures: list[tuple[str, str, str]] = []
        self.step_timings: list[StepTiming] = []
        self._last_sync: float | None = None
        self._inflight: tuple | None = None  # (SchedulerOutput, StepHandle, prepare start) of a launched step
        self.last_num_scheduled_tokens = 0  # of the step step() finished last
        self._masks_filling: tuple | None = None  # (StepHandle, Future of its masks): _launch_masked_sampling
        self.num_steps_planned_ahead = 0  # steps launched before the previous step's tokens were known
        on_cuda = self.runner.device.type == "cuda"
        self.overlap_steps = config.overlap_steps if config.overlap_steps is not None else on_cuda
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else on_cuda
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_encoder_tokens=max_encoder_tokens,
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
            time.perf_counter() - start, self.model_config.architecture, self.max_model_len,
            config.max_num_seqs, config.max_num_batched_tokens, self.overlap_steps, self.async_scheduling,
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
        if self.grammars is not None:
            self.grammars.shutdown()
        if self._ranks is not None:
            self._ranks.stop()

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
        if params.use_beam_search:
            return self._add_beam_search(request_id, prompt_token_ids, params, arrival_time, mm_inputs, mrope)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time, mm_inputs, mrope)
        if params.structured_outputs is not None:
            request.grammar = self._grammar_manager().attach(request_id, params.structured_outputs)
        self.scheduler.add_request(request)
        if request.grammar is not None:
            self._grammar_requests.add(request_id)
        return request

    def _add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         arrival_time: float | None, mm_inputs: list | None = None,
                         mrope: MRopePositions | None = None) -> Request:
        """A beam search: one group (``request_id``) whose first beam prefills the prompt."""
        if request_id in self.scheduler.beam_groups or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        group = BeamGroup(request_id, len(prompt_token_ids), params.n, params.length_penalty, frozenset(stop),
                          params.max_tokens, self.max_model_len)
        # Each beam reports its top candidates' raw logprobs; the group chooses the tokens.
        beam_params = dataclasses.replace(params, n=1, use_beam_search=False, temperature=0.0,
                                          logprobs=group.num_candidates)
        first = Request(group.new_beam_id(), prompt_token_ids, beam_params, self.eos_token_ids, arrival_time,
                        mm_inputs, mrope)
        first.beam = group
        group.beams[first.request_id] = 0.0
        self.scheduler.add_request(first)
        self.scheduler.beam_groups[request_id] = group
        return first

    def _advance_beams(self) -> list[EngineOutput]:
        """Hand this step's beam logprobs to their groups; every group whose beams have all reported
        chooses its next beams (forking, continuing and dropping beam requests), or ends."""
        scheduler = self.scheduler
        reports, scheduler.beam_reports = scheduler.beam_reports, []
        ready = {}
        for request, logprobs in reports:
            group = request.beam
            if scheduler.beam_groups.get(group.request_id) is group and group.report(
                    request.request_id, logprobs.top_token_ids, logprobs.top_logprobs):
                ready[group.request_id] = group
        outputs = []
        for group in ready.values():
            beams = {rid: scheduler.requests[rid] for rid in group.beams}
            running, done = group.select({rid: r.output_token_ids for rid, r in beams.items()})
            if done:
                outputs.append(self._finish_beam_search(group, beams))
                continue
            chosen = {parent for parent, _, _ in running}
            for rid, request in beams.items():
                if rid not in chosen:
                    scheduler.drop_beam(request)  # first: its blocks may serve the forks' copies
            next_beams, continued = {}, {}
            for parent, token, score in running:
                if parent in continued:  # chosen again: a new beam branches off it
                    child = scheduler.fork_beam(beams[parent], group.new_beam_id(), token)
                    next_beams[child.request_id] = score
                else:
                    continued[parent] = (token, score)
            for parent, (token, score) in continued.items():  # after the forks, which copy the parent's tokens
                scheduler.append_beam_token(beams[parent], token)
                next_beams[parent] = score
            group.beams = next_beams
        return outputs

    def _finish_beam_search(self, group: BeamGroup, beams: dict[str, Request]) -> EngineOutput:
        first = next(iter(beams.values()))
        for request in beams.values():
            self.scheduler.drop_beam(request)
        del self.scheduler.beam_groups[group.request_id]
        results = group.results()
        return EngineOutput(
            request_id=group.request_id, new_token_ids=[], finished=True, finish_reason=results[0].finish_reason,
            num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=max(first.num_cached_tokens, 0),
            queue_time_s=None if first.first_scheduled_time is None else first.first_scheduled_time - first.arrival_time,
            beams=results,
        )

    def _grammar_manager(self):
        if self.grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need a tokenizer, and this model has none",
                                   param="structured_outputs")
            from engine.core.structured_output import GrammarManager

            config = self.config
            self.grammars = GrammarManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                           config.max_num_seqs, config.xgrammar_cache_mb,
                                           config.structured_outputs_compile_timeout_s)
        return self.grammars

    def waiting_for_grammars(self) -> bool:
        """True when nothing can be scheduled until a grammar compiles: no step runs or waits to, and every
        waiting request waits for its grammar (the engine core then sleeps instead of stepping)."""
        if self.grammars is None or not self.grammars.num_pending or self._inflight is not None:
            return False
        scheduler = self.scheduler
        return self._masks_filling is None and not scheduler.running and not any(r.ready for r in scheduler.waiting)

    def settle_grammars(self) -> list[EngineOutput]:
        """End the requests whose grammar failed to compile or passed its time bound (``grammar_failures``
        says why); their outputs finish with "abort"."""
        failures = self.grammars.settle() if self.grammars is not None else []
        if not failures:
            return []
        for request_id, why, _ in failures:
            logger.warning("request %s: %s", request_id, why)
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
        self._grammar_requests.difference_update(request_ids)
        if self.grammars is not None:
            self.grammars.forget(request_ids)
        outputs = []
        groups = self.scheduler.beam_groups
        for rid in request_ids:
            group = groups.pop(rid, None)
            if group is not None:
                for beam in group.beams:
                    self.scheduler.drop_beam(self.scheduler.requests[beam])
                outputs.append(EngineOutput(rid, [], finished=True, finish_reason=FinishReason.ABORT, beams=[]))
        return outputs + self.scheduler.abort_requests(request_ids)

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
        if self.waiting_for_grammars():
            self.grammars.wait(self.grammars.seconds_to_deadline())
            return settled + self.settle_grammars()
        if not self.scheduler.has_unfinished_requests() and self._inflight is None:
            return settled
        self._launch_masked_sampling()
        if self._inflight is None:
            self._inflight = self._launch_next()
            self._complete_sampling(self._inflight)
        sched, handle, prepare_start = self._inflight
        self._inflight = None
        if self.async_scheduling and self.scheduler.can_schedule_ahead():
            # Plan and queue the next step before this one's tokens are known: the device goes
            # from one step straight to the next while the host waits and does the bookkeeping.
            # Its sampling waits for grammar masks, if any request in it has a grammar.
            self._inflight = self._launch_next(in_flight=handle)
            self.num_steps_planned_ahead += 1
        runner_out = self.runner.finish(handle)
        synced = time.perf_counter()
        if self._grammar_requests:
            # The step planned ahead needs masks from this step's tokens: the grammars take them
            # first, and the masks are filled on a thread during the bookkeeping below and the
            # caller's handling of the outputs (its sampling is queued when the engine next steps).
            self._advance_grammars(runner_out)
            if self._inflight is not None:
                self._complete_sampling(self._inflight, wait=False)
        outputs = self.scheduler.update_from_output(sched, runner_out)
        if self.scheduler.beam_reports:
            outputs += self._advance_beams()
        self.last_num_scheduled_tokens = sched.total_num_scheduled_tokens
        if self._grammar_requests:
            self._grammar_requests.difference_update(out.request_id for out in outputs if out.finished)
        if runner_out.timing is not None:
            self._record_timing(sched, runner_out.timing, prepare_start, synced)
        if self._inflight is None and self.overlap_steps and self.scheduler.has_unfinished_requests():
            self._inflight = self._launch_next()
            self._complete_sampling(self._inflight)
        return settled + outputs

    def _advance_grammars(self, runner_out) -> None:
        requests = self.scheduler.requests
        grammars, tokens = [], []
        for rid, token_id in zip(runner_out.request_ids, runner_out.sampled_token_ids):
            request = requests.get(rid)
            if request is not None and request.grammar is not None:
                grammars.append(request.grammar)
                tokens.append(token_id)
        self.grammars.advance(grammars, tokens)

    def _complete_sampling(self, inflight: tuple, wait: bool = True) -> None:
        """Queue the sampling of a launched step that waits for its grammar masks; ``wait=False``
        leaves the masks filling and the sampling to ``_launch_masked_sampling``."""
        handle = inflight[1]
        if handle.pending is None:
            return
        requests = self.scheduler.requests
        grammars = []
        for rid in handle.inputs.sampled_request_ids:
            request = requests.get(rid)  # gone: finished while the step was planned; its token is dropped
            grammars.append(request.grammar if request is not None else None)
        if wait:
            self.runner.launch_sampling(handle, self.grammars.fill_bitmask(grammars))
        else:
            self._masks_filling = (handle, self.grammars.fill_bitmask_async(grammars))

    def _launch_masked_sampling(self) -> None:
        """Queue the sampling whose masks were left filling (before anything else reaches the device)."""
        if self._masks_filling is None:
            return
        handle, future = self._masks_filling
        self._masks_filling = None
        self.runner.launch_sampling(handle, future.result() if future is not None else None)

    def check_invariants(self) -> None:
        """Check the KV manager's tables against its pool (~1 us per block): for idle moments only."""
        self.kv_manager.check_invariants()
        if self.scheduler.encoder_cache is not None:
            self.scheduler.encoder_cache.check_invariants()

    def _launch_next(self, in_flight=None) -> tuple:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        constrained = bool(self._grammar_requests) and any(
            rid in self._grammar_requests for rid in sched.num_scheduled_tokens)
        return sched, self.runner.launch(sched, in_flight, sample=not constrained), start

    def _record_timing(self, sched, timing: RunnerTiming, prepare_start: float, synced: float) -> None:
        wall = synced - (self._last_sync if self._last_sync is not None else prepare_start)
        self._last_sync = synced
        self.step_timings.append(StepTiming(num_reqs=timing.num_reqs, num_tokens=sched.total_num_scheduled_tokens,
                                            graph=timing.graph, host_s=timing.launched_s - prepare_start,
                                            device_s=timing.device_s, wall_s=wall))

    def measure_steps(self, enabled: bool = True) -> None:
        """Record a StepTiming for every step (host work vs device time), for benchmarks."""
        self.runner.measure_steps = enabled
        self.step_timings.clear()
        self._last_sync = None

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
        )


__all__ = ["LLMEngine", "EngineStats"]
