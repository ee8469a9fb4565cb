"""The decode graph runner: one CUDA graph per ``GraphKey`` (padded batch size, sampling mode),
captured once; every dynamic field lives in static tensors refreshed in place before each replay.

A replay runs the whole decode step: embedding, every layer (attention reads the paged cache),
float32 logits, sampling and, in the graphs of steps where a row asks, log probabilities. The only
device-to-host copies per step are the sampled token ids (and those log probabilities).

A step is decided once, by ``DecodeGraphRunner.plan``: the graph key, and whether it replays or why it
runs eagerly; then the static buffers are prepared, then the graph replays (or the same forward runs
eagerly on the same buffers).

Rules kept: static tensors allocated once at the largest bucket; nothing allocated, synced or shaped
by host data inside capture; padding rows inert (slot -1, length 1, null block); largest bucket
captured first into one shared pool after side-stream warm-up; oversize batches, over-long contexts,
``enforce_eager`` and failed captures run eagerly and are counted in ``stats``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from graphrt.attention import AttentionBackend, AttentionMetadata
from graphrt.attention.metadata import pinned_to_device
from graphrt.base import nvtx
from graphrt.base.checks import is_count
from graphrt.base.progress import progress_bar
from graphrt.capture.buckets import choose_bucket, default_capture_sizes, validate_capture_sizes
from graphrt.capture.decode_batch import DecodeBatch
from graphrt.capture.decode_inputs import DecodeInputs
from graphrt.capture.graph_check import GraphCheck, GraphCheckFailure, static_tensors
from graphrt.capture.pending import HostBuffers, PendingTokens
from graphrt.capture.static_sampling import StaticSampling
from graphrt.capture.stats import DecodeStats, EagerReason
from graphrt.sampling.logprobs import token_logprobs
from graphrt.sampling.sampler import SamplingTensors, sample

logger = logging.getLogger(__name__)

#: Graphs are captured per sampling mode (``DecodeBatch.sampling_mode``): "greedy" is a bare argmax;
#: "temperature" samples without top-k / top-p (greedy rows mixed in), with fused kernels in two short
#: passes over the logits; "sample" adds the general path for top-k / top-p rows, which with fused kernels finds each row's
#: filter boundary by a threshold search (``graphrt.sampling.top_k_top_p``) and otherwise sorts the vocabulary;
#: "logprobs" samples as "sample" does (which gives every row the token the other modes would) and adds
#: each row's log probabilities (``graphrt.sampling.logprobs``), for steps where some row asks.
SAMPLING_MODES = ("greedy", "temperature", "sample", "logprobs")

#: Default of the most top tokens a row's logprobs may list (the width of the static logprob buffers).
DEFAULT_MAX_LOGPROBS = 20

#: Warm-up and capture run on one side stream per device, shared by every runner: a library's
#: per-stream workspace (cuBLAS keeps one per stream for the process's lifetime) is then allocated
#: once, not once per runner.
_capture_streams: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device)
    return _capture_streams[index]


def _sample_unfused(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(sample(logits, sampling))


#: The one sampling mode mixed graphs are captured for: it gives every row the token "greedy" and
#: "temperature" would (steps whose rows ask for logprobs run their prompt part on its own instead).
MIXED_SAMPLING_MODE = "sample"


class GraphKey(NamedTuple):
    """What one captured decode graph is specialised on."""

    #: Rows the graph runs: a batch is padded up to the smallest captured size that holds it.
    padded_batch: int
    #: One of ``SAMPLING_MODES``: which sampling work the graph holds (``DecodeBatch.sampling_mode``).
    sampling_mode: str
    #: A mixed graph's prompt tokens (a bucket of the prompt segment's), run before the decode rows in
    #: the same forward; 0 for a decode-only graph.
    prompt_tokens: int = 0


@dataclass(frozen=True)
class DecodePlan:
    """How one decode step runs, as ``DecodeGraphRunner.plan`` decided it."""

    #: Real rows of the batch.
    rows: int
    #: The shape and sampling variant the step runs: the graph it replays, or the padded shape an
    #: eager step runs on the static buffers (the batch's own size where there is no graph to match).
    key: GraphKey
    #: None: replay the graph captured for ``key``; otherwise why the step runs eagerly (``EagerReason``).
    eager_reason: str | None
    #: Whether the step runs on the static buffers; False for a batch they cannot hold (eager only, on
    #: tensors made for the step).
    static_buffers: bool
    #: Longest context attention is launched for, in eager steps: the batch's own longest row where no
    #: graph is matched; None = the captured maximum, as the graphs run.
    attention_bound: int | None = None

    @property
    def replays(self) -> bool:
        return self.eager_reason is None


class DecodeGraphRunner:
    """Decode for a model over a paged KV cache, through CUDA graphs where it can.

    Embeddable: a serving engine that owns its scheduler and block tables builds one over its model
    and caches, calls ``capture()`` once, then ``decode(DecodeBatch)`` (or ``launch``) each step.

    model: a ``graphrt.models.llama.LlamaForCausalLM`` (``forward(ids, positions, kv_caches,
    metadata)``, ``compute_logits`` with float32 logits, and its ``kernel_policy``, whose ``sample``
    chooses the tokens); kv_caches: one tensor per layer in ``backend``'s layout; max_seq_len: the
    captured maximum context (rows longer than it run eagerly); max_logprobs: the most top tokens a
    row's ``SamplingParams.logprobs`` may ask for (0: no logprob graphs, and batches that ask are
    refused); check_graphs: N >= 1 turns on the runtime oracle (``graph_check``), which checks every
    N-th replay against an eager run, 0 leaves it off. ``close()`` releases the graphs and static
    buffers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: type[AttentionBackend],
        *,
        block_size: int,
        max_seq_len: int,
        max_batch_size: int,
        capture_sizes: list[int] | None = None,
        enforce_eager: bool = False,
        return_logits: bool = False,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        check_graphs: int = 0,
        device: torch.device | None = None,
    ) -> None:
        for name, value in (("max_logprobs", max_logprobs), ("check_graphs", check_graphs)):
            if not is_count(value):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = device or next(model.parameters()).device
        self.capture_sizes = validate_capture_sizes(capture_sizes or default_capture_sizes(max_batch_size))
        self.max_batch_size = self.capture_sizes[-1]
        self.stats = DecodeStats()
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.max_logprobs = int(max_logprobs)
        self.check_graphs = int(check_graphs)
        #: The runtime oracle, made when the graphs are captured with ``check_graphs`` on.
        self.graph_check: GraphCheck | None = None
        self.closed = False
        if enforce_eager:
            self.eager_reason: str | None = EagerReason.ENFORCE_EAGER
        elif self.device.type != "cuda":
            self.eager_reason = EagerReason.NO_CUDA
        else:
            self.eager_reason = None

        bs = self.max_batch_size
        config = model.config
        #: The attention metadata the graphs read (the backend's), and the token inputs (the runner's).
        # One pinned staging for both, the inputs first: a step's refresh is one copy.
        self.graph_state = backend.init_graph_state(
            bs, max_seq_len, block_size, self.device, num_heads=config.num_attention_heads,
            head_size=config.head_dim, leading_fields=DecodeInputs.fields(bs),
        )
        self.inputs = DecodeInputs(self.graph_state.packed)
        self._static_sampling = StaticSampling(bs, self.device)
        self.sampling = self._static_sampling.tensors
        #: [B] int64: where a step's sampled tokens land. The same memory as ``inputs.input_ids``, so
        #: after a step each row's input is already the token it sampled: a pipelined step (``launch``
        #: with ``carry_input_ids``) feeds them back without knowing them on the host.
        self.next_tokens = self.inputs.input_ids
        #: Rows of the static inputs holding the last launch's sampled tokens (0: that launch did not run
        #: through the static buffers, or none ran).
        self._carried_rows = 0
        #: Top tokens the logprob graphs list per row (the request's own count is cut on the host).
        self.num_top_logprobs = min(max_logprobs, config.vocab_size)
        width = 1 + self.num_top_logprobs
        #: [B, 1 + K] float32 and int64: a logprob step's packed results (``graphrt.sampling.logprobs.token_logprobs``).
        self.logprob_values = torch.zeros(bs, width, dtype=torch.float32, device=self.device)
        self.logprob_ids = torch.zeros(bs, width, dtype=torch.int64, device=self.device)
        #: Pinned host buffers the results are copied into, used in turn: two launches may be in flight
        #: (the pipelined engine launches step n + 1 before it reads step n's tokens).
        self._host_buffers = [HostBuffers(bs, width, self.device) for _ in range(2)]
        self._next_host_buffers = 0
        keep_logits = return_logits or check_graphs > 0  # the oracle compares the replay's logits
        self.logits = torch.zeros(bs, config.vocab_size, dtype=torch.float32, device=self.device) if keep_logits else None
        #: (logits, sampling, out) -> out: the model's token choice (its kernel policy's: fused kernels or
        #: the sorting sampler; the sorting sampler for a model without one).
        policy = getattr(model, "kernel_policy", None)
        self._sample_into = _sample_unfused if policy is None else policy.sample
        #: Mixed steps (``add_prompt_segment``): the prompt graph runner whose static buffers hold a step's
        #: prompt tokens, and the prompt-token buckets mixed graphs are captured for (none: no mixed steps).
        self.prompt_segment = None
        self.mixed_buckets: list[int] = []

    @property
    def max_seq_len(self) -> int:
        return self.graph_state.max_seq_len

    @property
    def uses_graphs(self) -> bool:
        return self.eager_reason is None

    @property
    def captured_modes(self) -> tuple[str, ...]:
        """The sampling modes graphs are captured for: all of ``SAMPLING_MODES``, "logprobs" only when
        rows may ask for logprobs (``max_logprobs`` > 0)."""
        return SAMPLING_MODES if self.max_logprobs else tuple(m for m in SAMPLING_MODES if m != "logprobs")

    def add_prompt_segment(self, segment, buckets: list[int]) -> None:
        """Capture mixed graphs too: a step's prompt tokens (staged in ``segment``, a
        ``graphrt.capture.prefill_graphs.PrefillGraphRunner``, padded to one of ``buckets``, which must be
        among its own) and its decode rows in one forward, so the weights are read once for both, and the
        decode rows sampled in the graph. Before ``capture``."""
        if self.graphs:
            raise RuntimeError("add the prompt segment before capturing")
        unknown = sorted(set(buckets) - set(segment.buckets))
        if unknown:
            raise ValueError(f"prompt buckets {unknown} are not among the segment's {segment.buckets}")
        self.prompt_segment = segment
        self.mixed_buckets = sorted(set(buckets))

    # -- capture -----------------------------------------------------------------------------------

    def capture(self, progress: bool = True) -> DecodeStats:
        """Warm up, then capture every bucket, largest first, into one memory pool. A failure
        leaves the runner eager with one warning; it never raises."""
        if not self.uses_graphs:
            if self.check_graphs:
                logger.warning("check_graphs=%d has nothing to check: decode runs without graphs here (%s)",
                               self.check_graphs, self.eager_reason)
            return self.stats
        start = time.perf_counter()
        # Capture empties the allocator's cache (torch.cuda.graph does), so empty it first: freed blocks
        # (e.g. weights drawn and then quantized) would otherwise make the pool look negative.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        self._stage(DecodeBatch([], [], [], [], [], [], []), self.max_batch_size)  # every row inert while capturing
        keys = [GraphKey(size, mode) for size in reversed(self.capture_sizes) for mode in self.captured_modes]
        if self.mixed_buckets:  # mixed graphs warm up and capture over inert prompt rows too
            self.prompt_segment.stage([], [], [], [], [], [], self.mixed_buckets[-1])
            keys += [GraphKey(size, MIXED_SAMPLING_MODE, tokens) for size in reversed(self.capture_sizes)
                     for tokens in reversed(self.mixed_buckets)]
        try:
            with torch.inference_mode():
                side = _capture_stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                # Warm-up also proves the step never syncs with the host: a sync raises here,
                # naming the operation, instead of invalidating the capture later. Every bucket runs
                # once: sizes take different kernels (batch 1's GEMV layers, attention split counts),
                # and a Triton kernel's first launch loads its module, which CUDA refuses mid-capture.
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with torch.cuda.stream(side):
                        largest = keys[:len(self.captured_modes)]
                        for key in largest + keys:  # the largest bucket twice
                            self._forward(key)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.current_stream(self.device).wait_stream(side)
                pool = torch.cuda.graph_pool_handle()
                for key in progress_bar(keys, progress, desc="capturing decode graphs", unit="graph"):
                    graph = torch.cuda.CUDAGraph()
                    with nvtx.capture(key.padded_batch, key.prompt_tokens), torch.cuda.graph(graph, pool=pool):
                        self._forward(key)
                    self.graphs[key] = graph
            torch.cuda.synchronize(self.device)
            self.stats.replay_seconds = self._time_replays()
        except Exception as exc:  # any capture problem: run eagerly rather than crash
            self.graphs.clear()
            self.eager_reason = EagerReason.CAPTURE_FAILED
            self.stats.capture_error = f"{type(exc).__name__}: {exc}"
            logger.warning("CUDA graph capture failed, decoding eagerly instead: %s", self.stats.capture_error)
            return self.stats
        self.stats.num_graphs = len(self.graphs)
        self.stats.num_mixed_graphs = sum(1 for key in self.graphs if key.prompt_tokens)
        self.stats.capture_seconds = time.perf_counter() - start
        if self.check_graphs:
            self.graph_check = GraphCheck(self.check_graphs, self._static_inputs())
        self.stats.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        mixed = (f", {self.stats.num_mixed_graphs} of them mixed with {self.mixed_buckets[0]}.."
                 f"{self.mixed_buckets[-1]} prompt tokens" if self.mixed_buckets else "")
        summary = (
            f"captured {self.stats.num_graphs} decode graphs (batch sizes {self.capture_sizes[0]}.."
            f"{self.max_batch_size}, context <= {self.max_seq_len}{mixed}) in {self.stats.capture_seconds:.1f} s, "
            f"pool {self.stats.pool_bytes / 2**20:.0f} MiB"
        )
        if progress:  # the line that closes the progress bar, like it on stderr
            print(f"graphrt: {summary}", file=sys.stderr)
        logger.info(summary)
        return self.stats

    def _time_replays(self, repeats: int = 5) -> dict[int, float]:
        """Each bucket's greedy graph replayed ``repeats`` times on the rows staged for capture (all inert:
        the weights and the LM head run at the bucket's rows, attention over one key): the median seconds,
        by bucket. What a step's rows cost on the device, for the policies that weigh rows against tokens
        (speculative drafting); attention over real contexts comes on top."""
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        seconds = {}
        for size in self.capture_sizes:
            graph, samples = self.graphs[GraphKey(size, "greedy")], []
            for _ in range(repeats):
                begin.record()
                graph.replay()
                end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end) / 1e3)
            seconds[size] = statistics.median(samples)
        return seconds

    # -- the one dispatch --------------------------------------------------------------------------

    def plan(self, batch: DecodeBatch) -> DecodePlan:
        """How ``batch`` decodes: the graph key it replays, or why it runs eagerly and on what shape.
        Every step's choice is made here, once. Raises ValueError for a batch this runner cannot decode
        (a row asking for more top logprobs than ``max_logprobs``), RuntimeError once closed."""
        if self.closed:
            raise RuntimeError("this decode graph runner is closed")
        asked = [p.logprobs for p in batch.params if p.logprobs is not None]
        if asked and (max(asked) > self.max_logprobs or not self.max_logprobs):
            raise ValueError(f"a row asks for {max(asked)} top logprobs; this runner lists at most "
                             f"{self.max_logprobs} (max_logprobs; 0 = no logprobs)")
        return self._plan(len(batch), max(batch.seq_lens, default=0), batch.sampling_mode)

    def plan_mixed(self, batch: DecodeBatch, prompt_tokens: int) -> DecodePlan | None:
        """How ``batch`` decodes in one forward with ``prompt_tokens`` prompt tokens staged in the prompt
        segment before it (``add_prompt_segment``): a mixed graph's replay, or on CUDA with ``enforce_eager``
        the same forward run eagerly; None when no mixed graph holds the step (no segment, too many prompt
        tokens, a batch or context the decode graphs do not hold, rows that ask for logprobs, graphs that
        failed): its prompt part then runs on its own, before the decode."""
        if not self.mixed_buckets or batch.sampling_mode == "logprobs":
            return None
        tokens = choose_bucket(self.mixed_buckets, prompt_tokens) if prompt_tokens > 0 else None
        plan = self.plan(batch)
        if tokens is None or not plan.static_buffers or plan.eager_reason not in (None, EagerReason.ENFORCE_EAGER):
            return None
        if plan.eager_reason is None and not self.graphs:
            return None  # not captured yet
        return DecodePlan(plan.rows, GraphKey(plan.key.padded_batch, MIXED_SAMPLING_MODE, tokens), plan.eager_reason,
                          True)

    def _padded_key(self, rows: int, mode: str) -> GraphKey:
        return GraphKey(choose_bucket(self.capture_sizes, rows), mode)

    def _plan(self, rows: int, longest: int, mode: str) -> DecodePlan:
        fits = rows <= self.max_batch_size and longest <= self.max_seq_len
        if not fits:
            reason = self.eager_reason or (EagerReason.BATCH_TOO_LARGE if rows > self.max_batch_size
                                           else EagerReason.CONTEXT_TOO_LONG)
            return DecodePlan(rows, GraphKey(rows, mode), reason, static_buffers=False, attention_bound=longest)
        if self.eager_reason == EagerReason.ENFORCE_EAGER and self.device.type == "cuda":
            # The step a graph would replay (padded rows, the captured attention bound) run without one:
            # the kernels see the shapes they would in a graph, so the tokens are the graphs' bit for bit
            # in every dtype (16-bit GEMMs and split attention sum in another order at other shapes).
            return DecodePlan(rows, self._padded_key(rows, mode), self.eager_reason, True)
        if self.eager_reason is not None:  # no graphs at all: no padding, attention bounded by this batch
            return DecodePlan(rows, GraphKey(rows, mode), self.eager_reason, True, attention_bound=longest)
        key = self._padded_key(rows, mode)
        if self.graph_check is not None and key.padded_batch in self.graph_check.failed_buckets:
            # The step its graph would run (same bucket, captured bound), so its tokens are the ones
            # the checked replays agreed with.
            return DecodePlan(rows, key, EagerReason.GRAPH_CHECK_FAILED, True)
        return DecodePlan(rows, key, None, True)

    def can_carry(self, carry_rows: Sequence[int | None], longest_seq_len: int) -> bool:
        """Whether ``launch(batch, carry_rows=carry_rows)`` can run for a batch of ``len(carry_rows)``
        rows whose longest holds ``longest_seq_len`` keys: the previous launch left the sampled tokens of
        those rows in the static buffers (it ran through them, with more rows than the largest named),
        and the new batch runs through them too."""
        rows = len(carry_rows)
        return (all(row is None or 0 <= row < self._carried_rows for row in carry_rows)
                and self._plan(rows, longest_seq_len, "greedy").static_buffers)

    # -- decode ------------------------------------------------------------------------------------

    def decode(self, batch: DecodeBatch) -> list[int]:
        """Sample one token per row; returns them as host ints (the step's only device-to-host copy).
        ``launch(batch).result()``: waits for the step."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: DecodeBatch, carry_input_ids: bool = False,
               carry_rows: Sequence[int | None] | None = None, *, plan: DecodePlan | None = None) -> PendingTokens:
        """Queue one decode step of ``batch`` (plan, prepare, replay or eager forward, the copy of its
        tokens to pinned host memory) without waiting for it; its tokens come from the returned
        ``result()``, the rows' log probabilities (rows whose params set ``logprobs``) from its
        ``logprobs()``.

        ``carry_input_ids``: every row's input is the token the same row sampled in the previous launch,
        which is still on the device (``batch.input_ids`` is ignored): the next step can be queued
        before the previous one's tokens reached the host, so the host's work for step n + 1 overlaps
        the GPU's for step n. ``carry_rows`` (implies carrying): row i's input is the token the previous
        launch's row ``carry_rows[i]`` sampled, for a batch that dropped rows (sequences that finished),
        or, where ``carry_rows[i]`` is None, ``batch.input_ids[i]`` from the host (a row that joins the
        carried ones: a prompt's last token); a gather of the ids, on the device, before the replay.
        Needs the previous launch to have run through the static buffers with the rows named (the first
        ``len(batch)`` without ``carry_rows``), and ``batch`` to run through them too (``can_carry``);
        ValueError otherwise, with nothing queued.
        A row asking for more top logprobs than ``max_logprobs`` is a ValueError too. ``plan``: one
        ``plan_mixed`` made for this batch (its prompt part staged in the segment), else ``plan(batch)``.

        Two launches may await ``result()`` at once; a third first reads the tokens of the oldest (waits
        for it; its ``result()`` still returns them), whose pinned buffer it reuses. A launch's refresh
        waits until the previous refresh's copy has run, so staging is never rewritten early.
        """
        plan = self.plan(batch) if plan is None else plan
        carry_input_ids, carry_rows = self._check_carry(batch, plan, carry_input_ids, carry_rows)
        buffers = self._host_buffers[self._next_host_buffers]
        if buffers.holder is not None:
            buffers.holder.result()  # read before its buffers are reused (at once unless two launches are unread)
        if not len(batch):
            return PendingTokens.empty()
        tokens, logprobs = self._run(batch, plan, carry_input_ids, carry_rows)
        num_tops = [p.logprobs for p in batch.params] if logprobs is not None else ()
        pending = PendingTokens.copy_to_host(tokens, buffers, logprobs, num_tops)
        buffers.holder = pending
        self._next_host_buffers = 1 - self._next_host_buffers
        return pending

    def _check_carry(self, batch: DecodeBatch, plan: DecodePlan, carry_input_ids: bool,
                     carry_rows: Sequence[int | None] | None) -> tuple[bool, list[int | None] | None]:
        """Validate a carrying launch; returns (carry_input_ids, the rows to gather or None)."""
        if carry_rows is not None:
            carry_rows = list(carry_rows)
            if len(carry_rows) != len(batch):
                raise ValueError(f"carry_rows names {len(carry_rows)} source rows for a batch of {len(batch)}")
            outside = [row for row in carry_rows if row is not None and not 0 <= row < self._carried_rows]
            if outside:
                raise ValueError(f"cannot carry the input id of row {outside[0]}: the previous launch left "
                                 f"{self._carried_rows} sampled rows in the static buffers")
            if carry_rows == list(range(len(batch))):
                carry_rows = None  # the rows stay where they are: nothing to gather
            carry_input_ids = True
        elif carry_input_ids and len(batch) > self._carried_rows:
            raise ValueError(f"cannot carry the input ids of {len(batch)} rows: the previous launch left "
                             f"{self._carried_rows} sampled rows in the static buffers")
        if carry_input_ids and not plan.static_buffers:
            raise ValueError("a batch that carries its input ids must fit the static buffers "
                             f"(at most {self.max_batch_size} rows of at most {self.max_seq_len} tokens)")
        return carry_input_ids, carry_rows

    def _run(self, batch: DecodeBatch, plan: DecodePlan, carry_input_ids: bool, carry_rows: list[int | None] | None
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Queue the planned step; returns the [rows] int64 device tensor its tokens land in and, for a
        logprob step, the (values, ids) tensors its rows' logprobs land in."""
        if plan.key.prompt_tokens:
            self.stats.mixed_steps += 1
        if plan.replays:
            self.stats.replays_per_bucket[plan.key.padded_batch] += 1
            self.stats.padded_rows += plan.key.padded_batch - plan.rows
            self.prepare(batch, plan, carry_input_ids, carry_rows)
            self.replay(plan)
            return self._outputs(plan)
        self.stats.eager_steps[plan.eager_reason] += 1
        with nvtx.decode_eager(plan.rows, plan.eager_reason):
            if not plan.static_buffers:
                self._carried_rows = 0
                return self._decode_unbuffered(batch)
            self.prepare(batch, plan, carry_input_ids, carry_rows)
            self._forward(plan.key, plan.attention_bound)
            return self._outputs(plan)

    @torch.inference_mode()
    def prepare(self, batch: DecodeBatch, plan: DecodePlan, carry_input_ids: bool = False,
                carry_rows: list[int | None] | None = None) -> None:
        """Write ``batch`` into the static buffers, rows padded to ``plan.key``: the token inputs (left
        on the device with ``carry_input_ids``; gathered from ``carry_rows`` of the previous launch when
        given) and the backend's attention metadata in one copy, and, unless greedy, the sampling rows."""
        if not plan.static_buffers:
            raise ValueError("this plan runs outside the static buffers; there is nothing to prepare")
        padded = plan.key.padded_batch
        with nvtx.decode_prepare():
            self._stage(batch, padded, carry_input_ids, carry_rows)
            if plan.key.sampling_mode != "greedy":  # greedy graphs never read the sampling rows
                self._static_sampling.refresh(batch.params, batch.seeds, batch.steps)
            if carry_rows is not None:
                # Row i takes the token row carry_rows[i] sampled, or its id fed from the host: gathered
                # into a new tensor first, since the rows read and the rows written share input_ids.
                inputs = self.inputs
                inputs.input_ids[: plan.rows].copy_(inputs.carry_source.index_select(0, inputs.carry_rows[: plan.rows]))
        self._carried_rows = plan.rows

    def _stage(self, batch: DecodeBatch, padded: int, carry_input_ids: bool = False,
               carry_rows: list[int | None] | None = None) -> None:
        """The token inputs and the attention metadata into the shared pinned staging, then one copy."""
        staging = self.graph_state.packed
        staging.wait_until_uploaded()  # the previous step's copy has read the mirror
        first_byte = self.inputs.write(batch.input_ids, batch.positions, padded, keep_input_ids=carry_input_ids,
                                       carry_rows=carry_rows)
        self.backend.refresh_graph_state(self.graph_state, batch.seq_lens, batch.block_tables, batch.slot_mapping,
                                         padded, batch.block_table_versions, upload=False)
        staging.upload(self.graph_state.bytes_in_use(padded), first_byte=first_byte)

    @torch.inference_mode()
    def replay(self, plan: DecodePlan) -> None:
        """Replay the graph of ``plan.key`` over the prepared buffers (under the oracle when it is on)."""
        if not plan.replays:
            raise ValueError(f"this plan runs eagerly ({plan.eager_reason}); there is no graph to replay")
        if self.graph_check is not None:
            self._replay_checked(plan)
            return
        with nvtx.decode_replay(plan.rows, plan.key.padded_batch, plan.key.prompt_tokens):
            self.graphs[plan.key].replay()

    def _outputs(self, plan: DecodePlan) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        rows = plan.rows
        logprobs = (self.logprob_values[:rows], self.logprob_ids[:rows]) if plan.key.sampling_mode == "logprobs" else None
        return self.next_tokens[:rows], logprobs

    @torch.inference_mode()
    def eager_decode(self, batch: DecodeBatch) -> list[int]:
        """The step a replay would run (same padded bucket, static buffers and kernels) executed
        without the graph: what replays are checked against. Not counted in ``stats``."""
        plan = self.plan(batch)
        if not plan.static_buffers:
            raise ValueError("batch exceeds the captured sizes; it has no graph to compare with")
        plan = DecodePlan(plan.rows, self._padded_key(plan.rows, plan.key.sampling_mode), EagerReason.ENFORCE_EAGER,
                          True)
        self.prepare(batch, plan)
        self._forward(plan.key)
        return self.next_tokens[: plan.rows].tolist()

    def _replay_checked(self, plan: DecodePlan) -> None:
        """The replay under the oracle (``graph_check``): the static inputs' addresses checked first
        (moved ones: an eager step instead), and every N-th replay run eagerly too and compared; a
        failure sends the bucket to eager from then on."""
        check, key, rows = self.graph_check, plan.key, plan.rows
        moved = check.moved_inputs(self._static_inputs())
        if moved:
            check.fail(GraphCheckFailure(key.padded_batch, key.sampling_mode, check.replays + 1, "inputs_moved",
                                         moved=moved))
            self._forward(key)
            return
        due = check.count_replay()
        ids = self.inputs.input_ids[: key.padded_batch]
        inputs = ids.clone() if due else None  # the replay overwrites them with its tokens
        with nvtx.decode_replay(rows, key.padded_batch, key.prompt_tokens):
            self.graphs[key].replay()
        if not due:
            return
        graph_tokens, graph_logits = self.next_tokens[:rows].clone(), self.logits[:rows].clone()
        ids.copy_(inputs)
        self._forward(key)  # the same step eagerly: same bucket, same captured bound
        check.checks += 1
        tokens_differ, max_diff, diverged = check.differences(graph_tokens, graph_logits, self.next_tokens[:rows],
                                                             self.logits[:rows])
        check.largest_logit_diff = max(check.largest_logit_diff, max_diff)
        if diverged:  # the eager step's results stay in the buffers
            check.fail(GraphCheckFailure(key.padded_batch, key.sampling_mode, check.replays, "diverged", max_diff,
                                         tokens_differ))

    def _static_inputs(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured graph reads or writes, by name: the oracle's address check."""
        inputs = static_tensors({
            "graph_state": self.graph_state, "input_ids": self.inputs.input_ids,
            "positions": self.inputs.positions, "sampling": self.sampling, "logits": self.logits,
            "logprob_values": self.logprob_values, "logprob_ids": self.logprob_ids, "kv_caches": self.kv_caches,
        })
        if self.prompt_segment is not None:  # a mixed graph's prompt inputs and last rows
            inputs.update(static_tensors({"prompt_segment": self.prompt_segment.packed.device,
                                          "prompt_last_hidden": self.prompt_segment.last_hidden}))
        inputs.update((f"model.{name}", tensor) for name, tensor in self.model.named_parameters())
        inputs.update((f"model.{name}", tensor) for name, tensor in self.model.named_buffers())
        return inputs

    def last_logits(self, batch_size: int) -> torch.Tensor:
        """[batch_size, V] float32 logits of the last launched decode (needs ``return_logits=True``); read
        them after that launch's ``result()``: with two launches queued they are the newer one's."""
        if self.logits is None:
            raise RuntimeError("this runner was built without return_logits=True")
        return self.logits[:batch_size]

    def _forward(self, key: GraphKey, attention_bound: int | None = None) -> None:
        """The captured region: static inputs [:size] -> next_tokens[:size] (and logits, logprobs). A
        mixed key's prompt tokens (the segment's static inputs) go first in the same forward; their
        sequences' last rows land in the segment's ``last_hidden``.

        ``attention_bound`` lowers the attention bound below the captured maximum (eager steps only)."""
        size, mode, prompt_tokens = key
        metadata = self.backend.graph_metadata(self.graph_state, size)
        if attention_bound is not None:
            metadata.max_decode_seq_len = attention_bound
        ids, positions = self.inputs.input_ids[:size], self.inputs.positions[:size]
        if prompt_tokens:
            prompt_ids, prompt_positions, prompt_slots, prompt_metadata = self.prompt_segment.segment_inputs(
                prompt_tokens)
            ids, positions = torch.cat([prompt_ids, ids]), torch.cat([prompt_positions, positions])
            metadata = AttentionMetadata.mixed(prompt_metadata, metadata,
                                               torch.cat([prompt_slots, metadata.slot_mapping]))
        hidden = self.model(ids, positions, self.kv_caches, metadata)  # [prompt_tokens + size, hidden]
        if prompt_tokens:
            self.prompt_segment.keep_last_rows(hidden[:prompt_tokens])
            hidden = hidden[prompt_tokens:]
        logprobs = (self.logprob_values[:size], self.logprob_ids[:size]) if mode == "logprobs" else None
        self._sample_rows(hidden, self._sampling_view(size, mode), self.next_tokens[:size],
                          None if self.logits is None else self.logits[:size], logprobs)

    def _decode_unbuffered(self, batch: DecodeBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Eager decode with per-step tensors, for batches the static buffers cannot hold."""
        metadata = AttentionMetadata.from_seqlens(
            query_lens=[1] * len(batch), seq_lens=batch.seq_lens, num_prefills=0,
            block_tables=batch.block_tables, slot_mapping=batch.slot_mapping,
            block_size=self.graph_state.block_size, device=self.device,
        )
        ids = pinned_to_device(batch.input_ids, torch.int64, self.device)
        positions = pinned_to_device(batch.positions, torch.int64, self.device)
        sampling = SamplingTensors.from_params(batch.params, batch.seeds, batch.steps, self.device)
        tokens = torch.empty(len(batch), dtype=torch.int64, device=self.device)
        logprobs = None
        if batch.sampling_mode == "logprobs":
            width = 1 + self.num_top_logprobs
            logprobs = (torch.empty(len(batch), width, dtype=torch.float32, device=self.device),
                        torch.empty(len(batch), width, dtype=torch.int64, device=self.device))
        self._sample_rows(self.model(ids, positions, self.kv_caches, metadata), sampling, tokens, None, logprobs)
        return tokens, logprobs

    def _sample_rows(self, hidden, sampling, tokens_out, logits_out, logprobs_out) -> None:
        """hidden: [B, hidden], the rows' final states -> their tokens (and logits, logprobs) in the outputs."""
        logits = self.model.compute_logits(hidden)  # [B, V] float32
        if logits_out is not None:
            logits_out.copy_(logits)
        self._sample_into(logits, sampling, out=tokens_out)
        if logprobs_out is not None:
            token_logprobs(logits, tokens_out, self.num_top_logprobs, *logprobs_out)

    def _sampling_view(self, size: int, mode: str) -> SamplingTensors:
        s = self.sampling
        return SamplingTensors(
            temperature=s.temperature[:size], top_k=s.top_k[:size], top_p=s.top_p[:size],
            seeds=s.seeds[:size], steps=s.steps[:size],
            all_greedy=mode == "greedy", needs_top_k_top_p=mode in ("sample", "logprobs"),
        )

    # -- release -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the graphs (and their memory pool), the static buffers and the host buffers, after
        the launches in flight finish. The runner refuses launches from then on; closing twice is a
        no-op. Its model and KV caches belong to the caller and are only let go."""
        if self.closed:
            return
        for buffers in self._host_buffers:
            if buffers.holder is not None:
                buffers.holder.result()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.closed = True
        self.graph_check = None
        self.model = self.kv_caches = self.prompt_segment = None
        self.graph_state = self.inputs = self._static_sampling = self.sampling = None
        self.next_tokens = None
        self.logits = self.logprob_values = self.logprob_ids = None
        self._host_buffers = []
