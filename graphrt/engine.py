"""The engine: owns the model, KV cache, scheduler and runner; takes requests and advances them a step
at a time (``add_request`` / ``step``), which is also what ``LLM.generate`` loops over."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import os
import random
import time
from dataclasses import dataclass, field

import torch

from graphrt.attention import get_attention_backend
from graphrt.base import nvtx
from graphrt.base.checks import triton_interpreter_on
from graphrt.base.errors import ConfigError, GraphrtError, InvalidRequestError
from graphrt.block_manager import BlockManager, BlockTables
from graphrt.capture import DecodeGraphRunner, PendingTokens, choose_bucket
from graphrt.capture.prefill_graphs import PrefillGraphRunner, mixed_buckets
from graphrt.config import (DEFAULT_CHUNKED_BATCHED_TOKENS, EngineConfig, resolve_device, resolve_dtype,
                            resolve_kv_cache_dtype)
from graphrt.distributed import RankGroup, rank_device, start_ranks
from graphrt.host_memory import return_freed_host_memory
from graphrt.kv_cache import (allocate_kv_caches, allocation_named, bytes_per_block, default_cpu_num_blocks,
                              num_blocks_for_bytes)
from graphrt.loader import load_weights_into, open_checkpoint
from graphrt.loader.tokenizer import TextStream, Tokenizer
from graphrt.model_runner import ModelRunner, profile_prefill_peak_memory
from graphrt.models.config import ModelConfig
from graphrt.models.llama import LlamaForCausalLM
from graphrt.models.tensor_parallel import check_divides
from graphrt.outputs import RequestOutput
from graphrt.sampling.logprobs import TokenLogprobs
from graphrt.sampling.params import SamplingParams
from graphrt.sampling.stop_strings import StopStrings
from graphrt.scheduler import Scheduler, SchedulerOutput, is_prefilling
from graphrt.sequence import FinishReason, Sequence
from graphrt.speculative.draft_model import DraftModel
from graphrt.speculative.drafting import Drafter, DraftPlan, SpeculativeStats
from graphrt.speculative.step_costs import PIPELINED, SYNCHRONOUS, StepCosts
from graphrt.step_relay import RelayingRunner, follow_steps
from graphrt.swap_space import SwapSpace

logger = logging.getLogger(__name__)

#: Most rows a verify step decodes (each sequence's own row and one per draft token): the decode runner's
#: static buffers hold this many rows (its float32 logits [rows, vocab] among them); drafts are trimmed
#: to fit.
MAX_VERIFY_ROWS = 256

#: Longest single sequence the GPU memory profile prefills (the batch is split into such sequences).
_PROFILE_SEQ_LEN = 2048


@dataclass
class _InFlightDecode:
    """A decode step queued on the device whose tokens the engine has not read yet, with the prompt
    chunks queued beside it (none samples a token)."""

    seqs: list[Sequence]  # row order of the launch
    tokens: PendingTokens
    #: The sequences whose chunks the step computes (their ``num_computed_tokens`` already advanced).
    chunks: list[Sequence] = field(default_factory=list)


def _prefilled(prefills: list[Sequence], token_ids: list[int | None]) -> list[Sequence]:
    """The prefills whose chunk reached their prompt's end this step (they sampled a token)."""
    return [seq for seq, token_id in zip(prefills, token_ids) if token_id is not None]


class LLMEngine:
    """``ranks``: this process's place among tensor-parallel ranks started for rank 0's engine
    (``graphrt.distributed``); None for rank 0, which starts them when ``config.tensor_parallel_size``
    asks. An engine of a rank other than 0 serves rank 0's steps from inside its constructor until rank 0
    closes; under torchrun the process then exits (status 0), since the script's later lines are rank 0's
    to run."""

    def __init__(self, config: EngineConfig, progress: bool = True, ranks: RankGroup | None = None) -> None:
        self.config = config
        #: The tensor-parallel ranks (None with one): rank 0 sends them its steps.
        self.ranks: RankGroup | None = ranks
        self.closed = False
        nvtx.configure(enabled=config.nvtx, layers=config.nvtx_layers)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        try:
            self._build(config, progress)
        except BaseException as error:
            reported = self.ranks.abandon() if self.ranks is not None else ""
            if reported and not isinstance(error, GraphrtError):  # this one's: the broken connection to that rank
                raise GraphrtError(f"a tensor-parallel rank failed to start: {reported}") from error
            raise
        if not self.is_driver:
            try:
                follow_steps(self.runner, self.swap_space, self.ranks)
            finally:
                self.close()
            if self.ranks.launched_by_torchrun:  # this process exists to serve rank 0: its work is done
                raise SystemExit(0)

    @property
    def is_driver(self) -> bool:
        """Whether this engine takes requests: one rank, or rank 0 of several."""
        return self.ranks is None or self.ranks.is_driver

    def _build(self, config: EngineConfig, progress: bool) -> None:
        with nvtx.range("load"):
            checkpoint = open_checkpoint(config.model, **config.loader_options)
            #: The checkpoint's model (with tensor parallelism each rank runs a slice of it: ``model.config``).
            self.model_config: ModelConfig = checkpoint.config
            if config.tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                logger.warning("WORLD_SIZE is %s but tensor_parallel_size is 1: each of the processes runs a whole "
                               "engine of its own (--tensor-parallel-size %s splits the model over them)",
                               os.environ["WORLD_SIZE"], os.environ["WORLD_SIZE"])
            if config.tensor_parallel_size > 1:
                check_divides(self.model_config, config.tensor_parallel_size)
                if self.ranks is None:
                    self.ranks = start_ranks(config, self.device)
                self.device = rank_device(self.device, self.ranks.rank, self.ranks.size)
            self.tokenizer: Tokenizer | None = checkpoint.tokenizer
            self.max_model_len = self._resolve_max_model_len()
            #: Said beside max_model_len in the errors it causes when the cache lowered it.
            self._max_model_len_origin = ""
            if config.enable_chunked_prefill:  # the budget a step's decodes and prompt chunks share
                self.max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_CHUNKED_BATCHED_TOKENS
            else:  # whole prompts: one must fit
                self.max_num_batched_tokens = max(config.max_num_batched_tokens or 0, self.max_model_len)
            try:
                self.attention_backend = get_attention_backend(config.attention_backend, self.device)
            except ValueError as error:  # unknown, or unusable on this device
                raise ConfigError(f"attention_backend: {error}") from None
            self.fused_kernels = self.device.type == "cuda" if config.fused_kernels is None else config.fused_kernels
            if self.fused_kernels and self.device.type == "cpu" and not triton_interpreter_on():
                raise ConfigError("fused_kernels=True needs a CUDA device; on CPU Triton runs only in its "
                                  "interpreter (TRITON_INTERPRET=1, slow: meant for tests)")
            # An FP8 checkpoint is FP8 without being asked; a 16-bit one is quantized at load when asked.
            self.quantization = config.quantization or ("fp8" if self.model_config.fp8_checkpoint else None)
            self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
            self._check_fp8_device()
            self.dependent_launch = self._resolve_dependent_launch()
            self.model = self._build_model(checkpoint, self.quantization, progress)
            speculative = config.speculative
            #: With a draft model (``speculative`` method "draft"): it, built like the target.
            self.draft_model_weights = None
            if speculative is not None and speculative.method == "draft":
                self.draft_model_weights = self._build_draft_model(speculative, progress)

        num_blocks = self._choose_num_blocks()
        if self.ranks is not None:  # every rank's tables are rank 0's: as many blocks as the least memory holds
            num_blocks = self.ranks.agree_on_least(num_blocks)
        shard = self.model.config  # the heads this rank caches
        cache_bytes = num_blocks * bytes_per_block(shard, config.block_size, self.kv_cache_dtype)
        with allocation_named(f"a KV cache of {num_blocks} blocks", cache_bytes, self.device, str(self.device),
                              "lower num_kv_blocks (--num-kv-blocks), kv_cache_bytes or gpu_memory_utilization"):
            kv_caches = allocate_kv_caches(shard, self.attention_backend, num_blocks, config.block_size,
                                           self.kv_cache_dtype, self.device)
        # The block tables after the cache: a cache too large to allocate is refused before they are sized by it.
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching)
        #: The longest sequence the KV cache holds (its usable blocks, the last token never cached).
        self.sequence_capacity = (num_blocks - 1) * config.block_size + 1
        self.max_model_len = self._fit_max_model_len(num_blocks)
        # A verify step decodes a row per draft token besides each sequence's own (graphrt.speculative.drafting).
        decode_rows = config.max_num_seqs if speculative is None else max(
            config.max_num_seqs, min(config.max_num_seqs * (speculative.num_tokens + 1), MAX_VERIFY_ROWS))
        self.decode_runner = self._decode_runner(self.model, kv_caches, decode_rows, config.max_logprobs,
                                                 config.check_graphs)
        # Calibrated KV scales are baked into the decode graphs: they are captured after the first prefill.
        #: Whether the first prefill calibrates KV-cache scales (asked, and some layer lacks a stored one).
        self.calibrate_kv_scales = config.calibrate_kv_scales and any(
            not (layer.self_attn.k_scale_stored and layer.self_attn.v_scale_stored) for layer in self.model.layers)
        if config.calibrate_kv_scales and self.model.layers and not self.calibrate_kv_scales:
            logger.warning("calibrate_kv_scales: every layer has KV-cache scales from the checkpoint; they are "
                           "kept and nothing is calibrated")
        #: Captured prompt steps (None: prompts run eagerly; ``EngineConfig.prefill_graph_tokens``).
        self.prefill_graphs = self._prefill_graphs(kv_caches)
        if self.prefill_graphs is not None and config.mixed_step_tokens:
            buckets = mixed_buckets(self.prefill_graphs.buckets, config.mixed_step_tokens)
            if buckets:
                self.decode_runner.add_prompt_segment(self.prefill_graphs, buckets)
        if not self.calibrate_kv_scales:
            self.decode_runner.capture(progress=progress)
            if self.prefill_graphs is not None:
                self.prefill_graphs.capture(progress=progress)
        # Ranks other than 0 read the tables rank 0 sends with each step.
        tables = self.block_manager if self.is_driver else BlockTables(config.block_size)
        self.runner = ModelRunner(self.model, kv_caches, self.attention_backend, tables, self.decode_runner,
                                  kv_scales_pending=self.calibrate_kv_scales, progress=progress,
                                  prefill_graphs=self.prefill_graphs)
        if self.ranks is not None and self.is_driver:
            self.runner = RelayingRunner(self.runner, self.block_manager, self.ranks)
        #: Host blocks for swap preemption (None: preempted sequences are recomputed).
        self.swap_space = self._swap_space(kv_caches) if config.swap_space_bytes else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   chunked_prefill=config.enable_chunked_prefill, swap=self.swap_space)
        self.async_decode = self.device.type == "cuda" if config.async_decode is None else config.async_decode
        #: Drafts and what verification kept (None without ``EngineConfig.speculative``).
        self.drafter = None
        #: What decode steps cost by rows (replay times, the host's share learnt from the steps), for
        #: speculation's draft lengths (None without it).
        self.step_costs: StepCosts | None = None
        self._completed_step: tuple[int, str] | None = None  # (rows, step_costs kind) of the step just read
        self._completed_verify: tuple[int, int] | None = None  # (sequences, tokens appended) of a verify just run
        self._draft_decode_runner: DecodeGraphRunner | None = None
        if speculative is not None:
            draft = None if self.draft_model_weights is None else self._draft_model(num_blocks, progress)
            runner = self.decode_runner
            self.step_costs = StepCosts(lambda: runner.stats.replay_seconds,
                                        lambda rows: choose_bucket(runner.capture_sizes, rows))
            # The rows the decode runner's static buffers hold (fewer than decode_rows with capture_sizes given).
            self.drafter = Drafter(speculative, self.block_manager, self.max_model_len, runner.max_batch_size,
                                   draft, self.step_costs, PIPELINED if self.async_decode else SYNCHRONOUS)
        self._in_flight: _InFlightDecode | None = None
        self._seed_source = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        #: Requests aborted while running: finished at their next output (``abort_request``).
        self._aborting: set[str] = set()
        #: Outputs of requests aborted while waiting, returned by the next step.
        self._aborted_outputs: list[RequestOutput] = []
        #: Per running sequence: its output's text so far, and the copy of its prompt ids its outputs share.
        self._text_streams: dict[int, TextStream] = {}
        self._prompt_copies: dict[int, list[int]] = {}
        #: Per running sequence with stop strings (``SamplingParams.stop``): their watch over its text.
        self._stop_strings: dict[int, StopStrings] = {}
        logger.info(
            "graphrt engine: %s on %s (%s%s), %d KV blocks of %d tokens (%s), max_model_len %d, attention %s, "
            "%s kernels%s%s%s",
            self.model_config.architecture, self.device, self.dtype,
            f", {self.quantization} weights" if self.quantization else "", num_blocks, config.block_size,
            str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len, self.attention_backend.name,
            "fused" if self.fused_kernels else "unfused", " (dependent launches)" if self.dependent_launch else "",
            ", KV scales to calibrate over the first prefill" if self.calibrate_kv_scales else "",
            f", tensor-parallel rank {self.ranks.rank} of {self.ranks.size}" if self.ranks is not None else "",
        )

    def _swap_space(self, kv_caches: list[torch.Tensor]) -> SwapSpace:
        """``swap_space_bytes`` of host blocks shaped as the cache's (a null block among them)."""
        per_block = bytes_per_block(self.model.config, self.config.block_size, self.kv_cache_dtype)
        num_blocks = self.config.swap_space_bytes // per_block
        if num_blocks < 2:
            raise ConfigError(f"swap_space_bytes {self.config.swap_space_bytes} holds {num_blocks} KV blocks of "
                              f"{per_block} bytes; it needs at least 2 (one is the null block)")
        with allocation_named(f"a swap space of {num_blocks} KV blocks", num_blocks * per_block, torch.device("cpu"),
                              "the host", "lower swap_space_bytes (--swap-space-mib)"):
            return SwapSpace.allocate(kv_caches, num_blocks)

    def _decode_runner(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], max_batch_size: int,
                       max_logprobs: int, check_graphs: int = 0) -> DecodeGraphRunner:
        """Decode graphs of ``model`` over ``kv_caches`` as the config asks (capture sizes, context, eager)."""
        cfg = self.config
        return DecodeGraphRunner(
            model, kv_caches, self.attention_backend, block_size=cfg.block_size,
            max_seq_len=min(cfg.max_capture_seq_len or self.max_model_len, self.max_model_len),
            max_batch_size=max_batch_size, capture_sizes=cfg.capture_sizes, enforce_eager=cfg.enforce_eager,
            max_logprobs=max_logprobs, check_graphs=check_graphs, device=self.device,
        )

    def _prefill_graphs(self, kv_caches: list[torch.Tensor]) -> PrefillGraphRunner | None:
        """Prompt graphs up to ``prefill_graph_tokens`` (at most the step budget), where they can run: CUDA,
        an attention backend that takes captured prompt metadata. With ``enforce_eager`` the runner runs
        what the graphs would replay without capturing them (so that eager and graphs give the same
        tokens)."""
        cfg = self.config
        tokens = min(cfg.prefill_graph_tokens, self.max_num_batched_tokens)
        if self.device.type != "cuda" or tokens == 0 or not self.attention_backend.supports_prompt_graphs:
            return None
        return PrefillGraphRunner(self.model, kv_caches, cfg.block_size, tokens, self.max_model_len, self.device,
                                  eager=cfg.enforce_eager)

    def _build_model(self, checkpoint, quantization: str | None, progress: bool) -> LlamaForCausalLM:
        """A checkpoint's model on the engine's device, dtype and kernels, weights loaded."""
        try:
            model = LlamaForCausalLM(
                checkpoint.config, self.attention_backend, self.max_model_len, self.dtype, self.device,
                fused_kernels=self.fused_kernels, dependent_launch=self.dependent_launch, quantization=quantization,
                tensor_parallel=None if self.ranks is None else self.ranks.tensor_parallel,
            )
        except ValueError as exc:  # e.g. a head size the attention backend cannot run
            raise ConfigError(f"cannot build {checkpoint.config.architecture}: {exc}") from None
        load_weights_into(model, checkpoint, progress=progress)
        model.check_finite()
        return model.eval()

    def _build_draft_model(self, speculative, progress: bool) -> LlamaForCausalLM:
        """The draft model of ``speculative`` (method "draft"), in the target's dtype and kernels; its
        vocabulary must be the target's and its positions reach max_model_len."""
        try:
            checkpoint = open_checkpoint(speculative.model, **speculative.loader_options)
        except (GraphrtError, OSError, TypeError) as error:
            raise ConfigError(f"speculative: the draft model {speculative.model!r}: {error}") from None
        config = checkpoint.config
        if config.vocab_size != self.model_config.vocab_size:
            raise ConfigError(f"speculative: the draft model's vocabulary ({config.vocab_size} tokens) is not the "
                              f"target's ({self.model_config.vocab_size}); a draft model needs the same tokenizer")
        if config.max_position_embeddings < self.max_model_len:
            raise ConfigError(f"speculative: the draft model reaches {config.max_position_embeddings} positions, "
                              f"less than max_model_len {self.max_model_len}")
        # FP8 when the target is quantised, or the draft's checkpoint is FP8 (as the target's would be).
        quantization = "fp8" if config.fp8_checkpoint or self.config.quantization == "fp8" else None
        return self._build_model(checkpoint, quantization, progress)

    def _draft_model(self, num_blocks: int, progress: bool) -> DraftModel:
        """The draft model's cache (as many blocks as the target's), block tables, decode graphs and runner."""
        model, cfg = self.draft_model_weights, self.config
        kv_caches = allocate_kv_caches(model.config, self.attention_backend, num_blocks, cfg.block_size,
                                       self.kv_cache_dtype, self.device)
        block_manager = BlockManager(num_blocks, cfg.block_size)
        self._draft_decode_runner = self._decode_runner(model, kv_caches, cfg.max_num_seqs, max_logprobs=0)
        self._draft_decode_runner.capture(progress=progress)
        runner = ModelRunner(model, kv_caches, self.attention_backend, block_manager, self._draft_decode_runner,
                             progress=progress)
        return DraftModel(runner, block_manager)

    def _check_fp8_device(self) -> None:
        """FP8 weights or an fp8 cache on CUDA need compute capability 8.9+: Triton has no E4M3 type
        below it, and every FP8 kernel here takes one."""
        fp8 = [what for what, wanted in (("FP8 weights (quantization='fp8')", self.quantization == "fp8"),
                                         ("an fp8 KV cache", self.kv_cache_dtype == torch.float8_e4m3fn)) if wanted]
        if not fp8 or self.device.type != "cuda":
            return
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"{' and '.join(fp8)} need a GPU of compute capability 8.9 or later (Ada, Hopper); "
                              f"this one is {major}.{minor}")

    def _resolve_dependent_launch(self) -> bool:
        """``config.dependent_launch`` resolved: None = on with fused kernels on an sm_90+ GPU."""
        wanted = self.config.dependent_launch
        if wanted is False:
            return False
        possible = self.fused_kernels and self.device.type == "cuda"
        if possible:
            from graphrt.kernels.dependent_launch import dependent_launch_available

            possible = dependent_launch_available(self.device)
        if wanted and not possible:
            raise ConfigError("dependent_launch=True needs fused kernels on a CUDA GPU of compute capability 9.0 "
                              "or later, with a Triton that has grid dependency control")
        return possible

    # -- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and enqueue a request; returns its id. Raises InvalidRequestError (nothing enqueued),
        or GraphrtError once the engine is closed."""
        self._check_open()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        # A copy, validated again: fields the caller changed since building it are checked now, and its
        # later changes cannot reach the queued request.
        params = dataclasses.replace(params)
        text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids, params)
        seq_id = next(self._seq_ids)
        if request_id is None:
            request_id = f"req-{seq_id}"
            while request_id in self._requests:  # a caller chose that id: take the next free one
                request_id = f"req-{seq_id}-{next(self._seq_ids)}"
        request_id = str(request_id)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_source.randrange(2**63)
        seq = Sequence(
            seq_id=seq_id, request_id=request_id, prompt_token_ids=token_ids, params=params, seed=seed,
            eos_token_ids=self._eos_token_ids(), prompt=text,
        )
        self._requests[request_id] = seq
        if params.stop:
            self._stop_strings[seq_id] = StopStrings(params.stop)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (a client that went away, a caller that stopped reading): a waiting one (or one
        swapped out) leaves at once, a running one before the next step is scheduled (a prompt partway
        through its chunks runs no further chunk; a step already queued still runs it); either way the
        next ``step`` returns its last output, finished with ``finish_reason="abort"``, and its blocks
        (device and host) are freed. Returns False for an id that is not an unfinished request."""
        self._check_open()
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished or request_id in self._aborting:
            return False
        waiting = self.scheduler.waiting
        index = next((i for i, queued in enumerate(waiting) if queued is seq), None)
        if index is not None:  # waiting, or swapped out (its swap-out copy is done: copies are synchronous)
            del waiting[index]
            if self.swap_space is not None:
                self.swap_space.drop(seq.seq_id)
            if self.block_manager.has(seq.seq_id):
                self.block_manager.free(seq.seq_id)
            seq.finish(FinishReason.ABORT)
            self._aborted_outputs.append(self._output_of(seq))
            self._forget(seq)
        else:  # running: finished before the next step is scheduled, or where a step in flight is read
            self._aborting.add(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or a queued step's tokens are still unread (``step`` again)."""
        return not self.closed and (self.scheduler.has_unfinished() or self._in_flight is not None
                                    or bool(self._aborted_outputs))

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the requests that got a token (finished ones included).

        With ``async_decode`` a decode-only step (or one of decodes and prompt chunks that sample
        nothing) is queued and its tokens are returned by the next call, which first queues the step
        after it (the sequences that carry on, the prompts' next chunks) unless that step needs the
        tokens first (``_schedule_following`` lists when: a prompt to admit or swap in, a prompt's
        chunks done, blocks running out, ...): a call may return no outputs while requests are
        unfinished."""
        self._check_open()
        started, self._completed_step, self._completed_verify = time.perf_counter(), None, None
        with nvtx.range("step"):
            outputs = self._step_pipelined(self._in_flight) if self._in_flight is not None else self._step()
        # Aborted requests' outputs, taken after the step (one that raises leaves them for the next).
        aborted, self._aborted_outputs = self._aborted_outputs, []
        outputs = aborted + outputs
        seconds = time.perf_counter() - started
        if self.step_costs is not None and self._completed_step is not None:
            self.step_costs.observe(*self._completed_step, seconds)
        if self._completed_verify is not None:
            self.drafter.observe_verify(*self._completed_verify, seconds)
        return outputs

    def _step(self) -> list[RequestOutput]:
        self._finish_aborted_running()
        with nvtx.range("schedule"):
            scheduled = self.scheduler.schedule()
        return self._run_scheduled(scheduled)

    def _finish_aborted_running(self) -> None:
        """Running requests aborted since the last step, finished before scheduling (no step is in
        flight here), so none runs another step or another prompt chunk; their outputs wait with the
        other aborted ones."""
        aborted = [seq for seq in self.scheduler.running if seq.request_id in self._aborting]
        for seq in aborted:
            seq.finish(FinishReason.ABORT)
        if aborted:
            self._aborted_outputs.extend(self._finish_step(aborted))

    def _run_scheduled(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        if scheduled.swap_in or scheduled.swap_out:
            try:
                with nvtx.range("swap"):  # over several ranks each copies its own cache's blocks
                    self.runner.copy_swaps(self.swap_space, scheduled.swap_in, scheduled.swap_out)
            except BaseException:
                # Blocks a copy may not have filled: their sequences are recomputed instead.
                self.scheduler.abandon_swaps(scheduled)
                self.scheduler.requeue_prefills(scheduled.prefills)
                raise
        if scheduled.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler found no runnable request although requests are pending")
            return []
        plan = None
        if self.drafter is not None and scheduled.decodes:
            with nvtx.range("propose"):
                plan = self.drafter.plan(scheduled.decodes)
        if (self.async_decode and scheduled.decodes and not scheduled.prefills
                and (plan is None or not plan.drafts_any)):
            self._in_flight = self._launch_pipelined(scheduled.decodes)
            return []
        blind = self._blind_prompt_step(scheduled) if self.async_decode and scheduled.decodes else None
        if blind is not None:
            prefills, lengths, decodes = blind
            try:
                self._in_flight = (self._launch_chunks(prefills, lengths, decodes) if prefills
                                   else self._launch_pipelined(decodes))
            except BaseException:
                self.scheduler.requeue_prefills(scheduled.prefills)  # their K/V may be half-written
                raise
            return []
        if plan is not None:
            return self._step_speculative(scheduled, plan)
        seqs = scheduled.prefills + scheduled.decodes
        try:
            token_ids, logprobs = self.runner.execute(scheduled.prefills, scheduled.decodes, scheduled.prefill_tokens)
        except BaseException:
            # Decodes left as they were run this token again next step; prompts are prefilled again.
            self.scheduler.requeue_prefills(scheduled.prefills)
            raise
        outputs = self._record_tokens(seqs, token_ids, logprobs)
        self._cache_computed([seq for seq, token_id in zip(scheduled.prefills, token_ids) if token_id is None])
        if self.drafter is not None:
            self.drafter.begin([seq for seq in _prefilled(scheduled.prefills, token_ids) if not seq.is_finished])
        return outputs

    def _step_speculative(self, scheduled: SchedulerOutput, plan: DraftPlan) -> list[RequestOutput]:
        """The step's prefills, then one verify of the decodes with their drafts (``plan``'s lengths);
        each decode appends the tokens verification kept (one at least), up to a stop condition."""
        prefills, decodes = scheduled.prefills, scheduled.decodes
        try:
            with nvtx.range("propose"):
                drafts = self.drafter.propose(decodes, plan)
            token_ids, logprobs = (self.runner.execute(prefills, [], scheduled.prefill_tokens) if prefills
                                   else ([], []))
            sampled, scored = self.runner.verify(decodes, drafts)
        except BaseException:
            # Decodes stay as they were (their drafts' blocks stay theirs); prompts are prefilled again.
            self.scheduler.requeue_prefills(prefills)
            raise
        if not prefills:
            self._completed_step = (len(decodes) + sum(map(len, drafts)), SYNCHRONOUS)
        prefilled = _prefilled(prefills, token_ids)
        for seq, token_id, token_logprobs in zip(prefills, token_ids, logprobs):
            if token_id is not None:
                seq.append_token(token_id, self.max_model_len, token_logprobs)
        self.drafter.begin([seq for seq in prefilled if not seq.is_finished])
        self._cache_computed([seq for seq, token_id in zip(prefills, token_ids) if token_id is None])
        appended_total = 0
        for seq, draft, row_tokens, row_logprobs in zip(decodes, drafts, sampled, scored):
            kept = self.drafter.kept_tokens(draft, row_tokens)
            stop_strings = self._stop_strings.get(seq.seq_id) if len(kept) > 1 else None
            appended = 0
            for token_id, token_logprobs in zip(kept, row_logprobs):
                seq.append_token(token_id, self.max_model_len, token_logprobs)
                appended += 1
                if seq.is_finished:
                    break
                # A stop string ends the request at the token that completes it, as without speculation:
                # the kept tokens after it are not the request's (``_finish_step`` checks once a step).
                if stop_strings is not None and stop_strings.found(self._running_text(seq)):
                    seq.finish(FinishReason.STOP)
                    break
            self.drafter.record(seq, len(draft), len(kept) - 1, appended)
            appended_total += appended
            # The K/V of every appended token but the newest is in the cache (the newest is the next input).
            seq.num_computed_tokens = seq.num_tokens - 1
        if not prefills and any(drafts):
            self._completed_verify = (len(decodes), appended_total)
        return self._finish_step(prefilled + decodes)

    def _pipelines(self, seqs: list[Sequence]) -> bool:
        """Whether a decode of ``seqs`` may be queued blind (``async_decode``): always without speculation;
        with it, when no sequence would draft this step (a verify needs the newest tokens on the host, a
        queued step's are not there yet), judged from what is known before the tokens in flight."""
        return self.drafter is None or not self.drafter.plan(seqs, blind=True).drafts_any

    def _blind_prompt_step(self, scheduled: SchedulerOutput
                           ) -> tuple[list[Sequence], list[int], list[Sequence]] | None:
        """A scheduled step of prompt chunks and decodes as one to queue blind: each chunk that reaches
        its prompt's end stops a token short, and that last token joins the decodes (it samples the same
        output index in the decode graph; the step writes the chunk's K/V before attention reads it).
        Returns the chunks (sequences and lengths) and the decodes; None when the step must be read
        (``_chunks_run_blind``; speculation, prompt logprobs, KV scales to calibrate)."""
        if not scheduled.prefills or self.drafter is not None or self.runner.kv_scales_pending:
            return None
        prefills, lengths, finishing = [], [], []
        for seq, length in zip(scheduled.prefills, scheduled.prefill_tokens):
            if seq.needs_prompt_logprobs:
                return None
            if seq.num_computed_tokens + length == seq.num_tokens:
                finishing.append(seq)
                length -= 1
            if length:
                prefills.append(seq)
                lengths.append(length)
        if prefills and not self._chunks_run_blind(prefills, lengths):
            return None
        return prefills, lengths, scheduled.decodes + finishing

    def _chunks_run_blind(self, prefills: list[Sequence], lengths: list[int]) -> bool:
        """Whether prompt chunks may be queued beside a decode without reading the step's tokens
        (``async_decode``): without speculation (drafting starts from a prompt's first token, on the
        host), no chunk samples (``ModelRunner.can_launch_chunks``), and no request among them is aborted
        (it stops at the next synchronous step)."""
        return (self.drafter is None and bool(prefills) and self.runner.can_launch_chunks(prefills, lengths)
                and not any(seq.request_id in self._aborting for seq in prefills))

    def _launch_chunks(self, prefills: list[Sequence], lengths: list[int], decodes: list[Sequence],
                       ahead_from: list[int] | None = None) -> _InFlightDecode:
        """Queue prompt chunks and a plain decode of ``decodes`` in one step (``ModelRunner.launch_chunks``)."""
        tokens = self.runner.launch_chunks(prefills, lengths, decodes, ahead_from=ahead_from)
        return _InFlightDecode(decodes, tokens, list(prefills))

    def _launch_pipelined(self, seqs: list[Sequence], ahead_from: list[int] | None = None) -> _InFlightDecode:
        """Queue a plain decode of ``seqs`` (a draft model's pauses count the step)."""
        if self.drafter is not None:
            self.drafter.pass_step(seqs)
        return _InFlightDecode(seqs, self.runner.launch_decode(seqs, ahead_from=ahead_from))

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        """Speculative decoding's counts since the engine started (None without it)."""
        return None if self.drafter is None else self.drafter.stats

    def _step_pipelined(self, in_flight: _InFlightDecode) -> list[RequestOutput]:
        """Queue the step after ``in_flight`` when it can follow blind, then read ``in_flight``'s tokens.

        If queueing or the wait fails (an interrupt during the wait, most likely), both steps are
        dropped after the device finishes them, and the decoding sequences stay as they were before
        ``in_flight``: the next step decodes that token again, with the same seed and step index (the
        prompt chunks queued keep what they computed)."""
        try:
            with nvtx.range("schedule"):
                following, rows, prefills, lengths = self._schedule_following(in_flight.seqs)
            self._in_flight = None
            if prefills:
                self._in_flight = self._launch_chunks(prefills, lengths, following, ahead_from=rows)
            elif following:
                self._in_flight = self._launch_pipelined(following, ahead_from=rows)
            if following:
                # A step's period: this call waits for it and queues the next (a last one only waits).
                self._completed_step = (len(in_flight.seqs), PIPELINED)
            token_ids = in_flight.tokens.result()
            logprobs = in_flight.tokens.logprobs()
        except BaseException:
            self._in_flight = None
            if self.device.type == "cuda":
                # Nothing queued may still write what the next step reads. Chunks keep their progress: a
                # chunk's num_computed_tokens moved once its launch was queued, and that launch has run.
                torch.cuda.synchronize(self.device)
            raise
        self._cache_computed(in_flight.chunks)  # their K/V is written now
        # A sequence that finished on the step before this one (a stop token, seen after this step was
        # queued) got a token it must not keep.
        live = [row for row, seq in enumerate(in_flight.seqs) if not seq.is_finished]
        for row in live:
            in_flight.seqs[row].num_computed_tokens = in_flight.seqs[row].num_tokens
        if self.drafter is not None:
            self.drafter.record_plain_step([in_flight.seqs[row] for row in live])
        outputs = self._record_tokens([in_flight.seqs[row] for row in live], [token_ids[row] for row in live],
                                      [logprobs[row] for row in live])
        if (self._in_flight is not None and not self._in_flight.chunks
                and all(seq.is_finished for seq in self._in_flight.seqs)):
            # Every row of the queued step just finished: nothing will read it, so wait here rather
            # than leave a step in flight with no request behind it.
            self._in_flight.tokens.result()
            self._in_flight = None
        return outputs

    def _schedule_following(self, seqs: list[Sequence]
                            ) -> tuple[list[Sequence], list[int | None], list[Sequence], list[int]]:
        """The decode after the in-flight one, planned before its tokens are known: the in-flight
        sequences that carry on, with the rows (of the in-flight launch) their inputs come from, their
        tables grown by one position; then the prompts with one token left, which decode it from the
        host (row None): those whose chunks are done, and those whose chunk in this step leaves them
        one token, budget permitting; and the next chunk of each prompt under way (their sequences and
        lengths: ``Scheduler.chunks_under_way``, none reaching its last token), a waiting prompt
        admitted with what the budget leaves (``Scheduler.admit_blind``). A sequence that finished (a
        stop token, seen now), ends with the token in flight (max_tokens, max_model_len) or was aborted
        is left out (it is finished when the token in flight is read). Nothing (wait for the tokens,
        then schedule as usual) when a swapped-out sequence can come back, a prompt under way or with
        one token left was aborted, speculation would draft or has a prompt to start from, the chunks
        cannot run blind (``_chunks_run_blind``), the blocks do not fit (preemption), the in-flight
        launch ran outside the decode graphs' static buffers (it outgrew them: its tokens are not there
        to carry), or the rows outgrow them now."""
        nothing: tuple[list[Sequence], list[int | None], list[Sequence], list[int]] = ([], [], [], [])
        rows: list[int | None] = [
            row for row, seq in enumerate(seqs)
            if not (seq.is_finished or seq.at_length_limit(self.max_model_len, pending=1)
                    or seq.request_id in self._aborting)]
        following = [seqs[row] for row in rows]
        if not following or self.scheduler.can_swap_in():
            return nothing
        if any(seq.request_id in self._aborting and is_prefilling(seq) for seq in self.scheduler.running):
            return nothing  # an aborted prompt is finished by the synchronous step
        if not self.runner.can_launch_ahead(following, rows) or not self._pipelines(following):
            return nothing
        in_flight = {seq.seq_id for seq in seqs}
        # Running, outside the step in flight, one prompt token left: its chunks are done (or a cached
        # prefix left it one token). Its decode samples its first token (or, recomputed, its next).
        fed = [seq for seq in self.scheduler.running if seq.seq_id not in in_flight and not is_prefilling(seq)]
        if fed and (self.drafter is not None or any(seq.request_id in self._aborting for seq in fed)):
            return nothing  # drafting starts from a prompt's first token on the host; aborts stop synchronously
        # Position num_tokens (the in-flight token's) is the one written next: cover num_tokens + 1. The
        # decodes' blocks come first, as in ``schedule``; a prompt is admitted with what they leave.
        targets = [(seq.seq_id, seq.num_tokens + 1) for seq in following]
        if not self.block_manager.can_grow_all(targets):
            return nothing
        for seq_id, num_tokens in targets:
            self.block_manager.grow(seq_id, num_tokens)
        budget = self.max_num_batched_tokens - len(following) - len(fed)
        prefills, lengths = self.scheduler.chunks_under_way(budget)
        left = budget - sum(lengths)
        if self.scheduler.can_admit(left):
            # A waiting prompt the budget left admits (as ``schedule`` would), its first chunk stopping a
            # token short of its end; one that cannot (speculation, prompt logprobs) waits for the tokens.
            admitted = self.scheduler.admit_blind(left) if self.drafter is None else None
            if admitted is None:
                return nothing
            length = min(left, admitted.num_tokens - 1 - admitted.num_computed_tokens)
            if length:
                prefills.append(admitted)
                lengths.append(length)
                left -= length
            else:  # its cached prefix left it one token (can_admit kept a token of budget for it)
                fed.append(admitted)
                left -= 1
        if prefills and not self._chunks_run_blind(prefills, lengths):
            return nothing
        # A chunk that leaves its prompt one token decodes that token in the same step: every layer writes
        # the step's K/V before its attention reads the cache.
        for seq, length in zip(prefills, lengths):
            if left > 0 and seq.num_computed_tokens + length == seq.num_tokens - 1:
                fed.append(seq)
                left -= 1
        following, rows = following + fed, rows + [None] * len(fed)
        if fed and not self.runner.can_launch_ahead(following, rows):
            return nothing  # the rows outgrow the static buffers (a prompt admitted stays under way)
        return following, rows, prefills, lengths

    def _record_tokens(self, seqs: list[Sequence], token_ids: list[int],
                       logprobs: list[TokenLogprobs | None]) -> list[RequestOutput]:
        """Append each sequence's new token (and its logprobs), release the finished ones; returns their
        outputs. A prompt chunk short of its prompt's end (token None) appends nothing and has no output."""
        for seq, token_id, token_logprobs in zip(seqs, token_ids, logprobs):
            if token_id is not None:
                seq.append_token(token_id, self.max_model_len, token_logprobs)
        return self._finish_step([seq for seq, token_id in zip(seqs, token_ids) if token_id is not None])

    def _finish_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The step's outputs; the finished sequences' blocks (and drafting state) released, their
        computed full blocks named for the prefix cache first."""
        self._cache_computed(seqs)
        for seq in seqs:
            stop_strings = self._stop_strings.get(seq.seq_id)
            if seq.is_finished:
                # A stop string that the last allowed token completes ends the request as a stop.
                if (seq.finish_reason is FinishReason.LENGTH and stop_strings is not None
                        and stop_strings.found(self._running_text(seq))):
                    seq.finish(FinishReason.STOP)
            elif seq.request_id in self._aborting:
                seq.finish(FinishReason.ABORT)
            elif stop_strings is not None and stop_strings.found(self._running_text(seq)):
                seq.finish(FinishReason.STOP)
        try:
            outputs = [self._output_of(seq) for seq in seqs]
        finally:  # finished sequences are released even if an output could not be built
            for seq in self.scheduler.finish_step(seqs):
                self._forget(seq)
        return outputs

    def _forget(self, seq: Sequence) -> None:
        """Drop a finished request's engine state (its blocks are already free)."""
        if self.drafter is not None:
            self.drafter.forget(seq)
        if self.ranks is not None:  # the other ranks' copy of it
            self.runner.forget(seq.seq_id)
        self._text_streams.pop(seq.seq_id, None)
        self._prompt_copies.pop(seq.seq_id, None)
        self._stop_strings.pop(seq.seq_id, None)
        self._aborting.discard(seq.request_id)
        del self._requests[seq.request_id]

    def _cache_computed(self, seqs: list[Sequence]) -> None:
        """With prefix caching: the full blocks whose K/V the step computed, named for later prompts."""
        if self.block_manager.prefix_caching:
            for seq in seqs:
                self.block_manager.cache_computed(seq.seq_id, seq.num_computed_tokens, seq.token_ids_between)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache over prompt tokens looked up since the start (None
        without prefix caching, 0.0 before any prompt)."""
        manager = self.block_manager
        if not manager.prefix_caching:
            return None
        return manager.prefix_hit_tokens / manager.prefix_queried_tokens if manager.prefix_queried_tokens else 0.0

    def close(self) -> None:
        """Release what the engine holds on its device: the decode graphs and their memory pool, the
        static buffers, the KV cache and the model's weights (replaced by meta tensors, so they are
        freed even where a caller still holds the model), then return the allocator's cached memory to
        the device. A step in flight is finished first; requests still unfinished are dropped, with a
        warning that counts them. The engine refuses requests and steps from then on; closing twice is
        a no-op. Garbage collection of an unreferenced engine frees the same memory."""
        if self.closed:
            return
        try:
            if self._in_flight is not None:
                self._in_flight.tokens.result()
        finally:
            self._in_flight = None
            if self._requests:
                logger.warning("closing the engine with %d unfinished request(s); they are dropped",
                               len(self._requests))
            self._requests.clear()
            self.closed = True
            self.decode_runner.close()
            if self.prefill_graphs is not None:
                self.prefill_graphs.close()
            self.runner.kv_caches.clear()  # the list the model runner and the graph runner share
            if self.swap_space is not None:  # the pinned host pool
                self.swap_space.caches.clear()
                self.swap_space = self.scheduler.swap = None
            self.model.release_weights()
            if self._draft_decode_runner is not None:
                self._draft_decode_runner.close()
                self.drafter.draft_model.runner.kv_caches.clear()
                self.draft_model_weights.release_weights()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            else:
                return_freed_host_memory()
            if self.ranks is not None:  # rank 0 tells the others to close, and waits for those it started
                self.ranks.close()

    def _check_open(self) -> None:
        if self.closed:
            raise GraphrtError("this engine is closed")

    def error_output(self, prompt: str | list[int], error: Exception, request_id: str) -> RequestOutput:
        """The output of a request rejected by ``add_request``."""
        is_ids = isinstance(prompt, (list, tuple))
        return RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(prompt) if is_ids else [],
            finish_reason="error",
            error=str(error),
        )

    # -- helpers -----------------------------------------------------------------------------------

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"model {self.config.model!r} has no tokenizer: pass prompts as token ids (--prompt-ids)"
                )
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if set(map(type, prompt)) <= {int}:  # the common case, without a Python-level check a token
            return None, list(prompt)
        # Any integer type (NumPy's scalars included, as SamplingParams takes them), not bool.
        bad = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers, got {bad[0]!r}")
        return None, [int(t) for t in prompt]

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C-level scans; the loop only names the first
            outside = next(t for t in token_ids if not 0 <= t < vocab)
            raise InvalidRequestError(f"token id {outside} is outside the vocabulary [0, {vocab})")
        origin = self._max_model_len_origin
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}{origin}, "
                "which leaves no room for a generated token"
            )
        room = self.max_model_len - len(token_ids)
        cut = (f"prompt of {len(token_ids)} tokens leaves room for {room} of the {params.max_tokens} tokens asked "
               f"(max_model_len {self.max_model_len}{origin})") if params.max_tokens > room else None
        if cut and self.config.strict_max_tokens:
            raise InvalidRequestError(cut + "; lower max_tokens or raise max_model_len (--max-tokens, --max-model-len)")
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        # The last token is sampled, never fed back: its K/V needs no slot.
        needed = self.block_manager.blocks_needed(longest - 1)
        if needed > self.block_manager.num_usable_blocks:
            raise InvalidRequestError(
                f"request may grow to {longest} tokens ({needed} KV blocks) but the cache has only "
                f"{self.block_manager.num_usable_blocks} blocks; lower max_tokens or enlarge the cache"
            )
        if cut:  # only for a request accepted: a refused one must not be told where it would stop
            logger.warning("%s: the request stops there (finish_reason 'length')", cut)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"stop strings need a tokenizer, and model {self.config.model!r} has none: "
                                      "use stop_token_ids")
        too_big = [t for t in params.stop_token_ids if t >= vocab]
        if too_big:
            raise InvalidRequestError(f"stop token id {too_big[0]} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and (asked > limit or limit == 0):
                why = "logprobs are off" if limit == 0 else "it asks for more top tokens than this engine lists"
                raise InvalidRequestError(f"{name}={asked} is refused: {why} (max_logprobs={limit}); build the "
                                          "engine with a larger max_logprobs")

    def _eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's end-of-sequence token and the model config's
        (``config.json`` and ``generation_config.json``), which for instruct models add the end of a turn
        (Llama 3's ``<|eot_id|>`` and ``<|eom_id|>``, Qwen2.5's ``<|endoftext|>``)."""
        tokenizer_ids = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        return tuple(dict.fromkeys((*tokenizer_ids, *self.model_config.eos_token_ids)))

    def _output_of(self, seq: Sequence) -> RequestOutput:
        """The request's output now. Its text: while it runs, decoded a step's new tokens at a time
        (``Tokenizer.text_stream``: a character whose bytes span tokens still to come waits for them);
        once finished, the whole output's decoding; with stop strings, cut before the first (finished) or
        less an ending that may begin one (running). Its prompt ids: one copy for all its outputs."""
        text = None
        if self.tokenizer is not None:
            text = (self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if seq.is_finished
                    else self._running_text(seq))
            stop_strings = self._stop_strings.get(seq.seq_id)
            if stop_strings is not None:
                text = stop_strings.cut(text) if seq.is_finished else stop_strings.safe_prefix(text)
        prompt_ids = self._prompt_copies.get(seq.seq_id)
        if prompt_ids is None:
            prompt_ids = self._prompt_copies[seq.seq_id] = list(seq.prompt_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=prompt_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_preemptions=seq.num_preemptions,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            speculative=None if self.drafter is None else dataclasses.replace(
                self.drafter.request_stats.get(seq.seq_id, SpeculativeStats())),
        )

    def _running_text(self, seq: Sequence) -> str:
        """A running sequence's output text so far, decoded a step's new tokens at a time."""
        stream = self._text_streams.get(seq.seq_id)
        if stream is None:
            stream = self._text_streams[seq.seq_id] = self.tokenizer.text_stream()
        return stream.text_of(seq.output_token_ids)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ConfigError(f"max_model_len {wanted} exceeds the model's max_position_embeddings ({limit})")
        return wanted

    def _fit_max_model_len(self, num_blocks: int) -> int:
        """``max_model_len``, lowered to the longest sequence ``num_blocks`` KV blocks hold when the config
        left it to the model (its max_position_embeddings can be far beyond the cache), so that requests
        (and a server's default max_tokens) are sized to what can run; an explicit value larger than the
        cache is kept, with a warning."""
        holds = self.sequence_capacity
        if self.max_model_len <= holds:
            return self.max_model_len
        if self.config.max_model_len is not None:
            logger.warning("max_model_len %d is longer than the KV cache holds (%d blocks, one of them reserved, of "
                           "%d tokens: %d tokens a sequence at most): longer requests are refused", self.max_model_len,
                           num_blocks, self.config.block_size, holds)
            return self.max_model_len
        logger.info("max_model_len lowered from %d to %d, the longest sequence the KV cache's %d blocks (one of them "
                    "reserved) hold", self.max_model_len, holds, num_blocks)
        self._max_model_len_origin = (f" (lowered from {self.max_model_len} to what the KV cache's {num_blocks} blocks "
                                      f"of {self.config.block_size} tokens hold, one of them reserved, the last token "
                                      "needing none; a larger cache raises it)")
        return holds

    def _choose_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cpu":
            if cfg.kv_cache_bytes is not None:
                return num_blocks_for_bytes(cfg.kv_cache_bytes, self.model.config, cfg.block_size, self.kv_cache_dtype)
            return default_cpu_num_blocks(
                self.model.config, cfg.block_size, self.kv_cache_dtype, cfg.max_num_seqs, self.max_model_len
            )
        return self._profile_gpu_num_blocks()

    def _profile_gpu_num_blocks(self) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the device after weights and the activation
        peak of a full-budget prefill (measured), minus memory other processes hold."""
        torch.cuda.empty_cache()
        peak = profile_prefill_peak_memory(
            self.model, self.attention_backend, self.config.block_size, self.device,
            self.max_num_batched_tokens, min(self.max_model_len, _PROFILE_SEQ_LEN), self.config.max_logprobs,
        )
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        held_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - held_elsewhere
        per_block = bytes_per_block(self.model.config, self.config.block_size, self.kv_cache_dtype)
        if self.draft_model_weights is not None:  # the draft model's cache gets as many blocks
            per_block += bytes_per_block(self.draft_model_weights.config, self.config.block_size, self.kv_cache_dtype)
        if budget < 2 * per_block:
            raise ConfigError(
                f"no GPU memory left for the KV cache (weights and activations peak at {peak / 2**30:.2f} GiB); "
                "raise gpu_memory_utilization or lower max_num_batched_tokens / max_model_len"
            )
        return budget // per_block
