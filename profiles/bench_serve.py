"""The server's cost per token: the same streamed load through ``graphrt serve`` and through the Python
API (``LLM.generate_stream``), side by side in one run.

For each concurrency, C requests start at once, each greedy and ``--max-tokens`` long (``ignore_eos``),
first through the API, then through a server on 127.0.0.1 over the same ``LLM``, its clients in a
process of their own: plain HTTP read by hand (the server's cost alone), then OpenAI's Python client
(what a user's client adds). A request's time to first token is from its start to its first text; its
inter-token latency is (last text - first text) / (tokens - 1), so that answers whose text came in
fewer pieces than tokens count the same. The server's overhead per token is the difference of the
medians, server less API. Each path runs ``--rounds`` times after one warm-up round; figures pool the
rounds.

    python profiles/bench_serve.py --concurrency 1 32 --max-tokens 128 --json serve_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import statistics
import sys
import time

from graphrt.cli_args import add_engine_arguments, add_model_arguments, engine_options, output_file, positive_int
from graphrt.llm import LLM
from graphrt.sampling.params import SamplingParams
from graphrt.serve.server import Server

PROMPTS = [
    "The history of the printing press begins", "A recipe for bread needs", "The planets of the solar system are",
    "In the morning the harbour", "The rules of chess say that", "Photosynthesis is the process by which",
    "The city at night was", "An engine turns fuel into",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, default_model=None)
    add_engine_arguments(parser)
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 32], metavar="C",
                        help="streaming clients at once, one run each (default 1 32)")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per answer (default 128)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="measured rounds per path (default 3)")
    parser.add_argument("--clients", nargs="+", choices=["raw", "openai"], default=["raw", "openai"],
                        help="the server's clients, one run each: plain HTTP (raw) and OpenAI's (default both)")
    parser.add_argument("--json", type=output_file, default=None, metavar="FILE", help="write the figures here")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens: at least 2 (an inter-token latency needs two tokens)")
    return args


def prompts_for(concurrency: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]


def api_round(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple[float, float, float, int]]:
    """(start, first text, last text, tokens) of each request, through ``generate_stream``."""
    started = time.perf_counter()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: dict[int, int] = {}
    for index, output in llm.generate_stream(prompts, params):
        now = time.perf_counter()
        if output.text:
            first.setdefault(index, now)
            last[index] = now
        tokens[index] = len(output.token_ids)
    return [(started, first[i], last[i], tokens[i]) for i in range(len(prompts))]


def client_rounds(client_kind: str, url: str, model: str, prompts: list[str], max_tokens: int, rounds: int,
                  results) -> None:
    """In the client process: ``rounds`` rounds of concurrent streamed completions, through OpenAI's
    client (``openai``) or plain HTTP over asyncio's streams (``raw``: next to no cost per chunk, so the
    figures are the server's); puts each round's (start, first text, last text, pieces) per request on
    ``results``."""

    async def run() -> None:
        if client_kind == "openai":
            import openai

            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
            one = functools.partial(_openai_stream, client, model, max_tokens)
        else:
            client = None
            one = functools.partial(_raw_stream, url, model, max_tokens)
        try:
            for _ in range(rounds):
                results.put(await asyncio.gather(*(one(prompt) for prompt in prompts)))
        finally:
            if client is not None:
                await client.close()

    asyncio.run(run())


async def _openai_stream(client, model: str, max_tokens: int, prompt: str) -> tuple[float, float, float, int]:
    started = time.perf_counter()
    first = last = None
    pieces = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            pieces += 1
    return started, first, last, pieces


async def _raw_stream(url: str, model: str, max_tokens: int, prompt: str) -> tuple[float, float, float, int]:
    """One streamed completion over a connection of its own: HTTP/1.1, the body's chunked framing and
    the server-sent events read by hand."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    first = last = None
    pieces = 0
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the server answered {head.splitlines()[0]!r}")
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event == b"data: [DONE]":
                    continue
                choices = json.loads(event.removeprefix(b"data: "))["choices"]
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                    pieces += 1
    finally:
        writer.close()
    return started, first, last, pieces


def server_rounds(llm: LLM, client_kind: str, prompts: list[str], max_tokens: int, rounds: int) -> list[list[tuple]]:
    server = Server(llm, "127.0.0.1", 0)
    server.start()
    try:
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        client = context.Process(target=client_rounds, args=(client_kind, server.url, server.handlers.model_name,
                                                             prompts, max_tokens, rounds, results))
        client.start()
        collected = [results.get(timeout=600) for _ in range(rounds)]
        client.join(60)
        if client.exitcode != 0:
            raise RuntimeError(f"the client process exited with {client.exitcode}")
        return collected
    finally:
        server.stop()


def summary(rounds: list[list[tuple]], max_tokens: int) -> dict:
    """Medians and p99 of TTFT and per-request inter-token latency (ms) over every request of ``rounds``."""
    requests = [request for one_round in rounds for request in one_round]
    ttft = sorted((first - start) * 1e3 for start, first, _, _ in requests)
    itl = sorted((last - first) * 1e3 / (max_tokens - 1) for _, first, last, _ in requests)
    round_times = [max(r[2] for r in one_round) - min(r[0] for r in one_round) for one_round in rounds]
    return {
        "requests": len(requests),
        "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
        "itl_ms_p50": statistics.median(itl), "itl_ms_p99": percentile(itl, 0.99),
        "pieces_per_request": statistics.mean(r[3] for r in requests),
        "output_tokens_per_s": len(rounds[0]) * max_tokens / statistics.median(round_times),
    }


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = engine_options(args)
    options["max_num_seqs"] = max(options.get("max_num_seqs") or 0, *args.concurrency)
    rows = []
    with LLM(args.model, **options) as llm:
        device = llm.engine.config.device
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for concurrency in args.concurrency:
            prompts = prompts_for(concurrency)
            api = [api_round(llm, prompts, params) for _ in range(args.rounds + 1)][1:]
            row = {"concurrency": concurrency, "api": summary(api, args.max_tokens)}
            for client_kind in args.clients:
                served = server_rounds(llm, client_kind, prompts, args.max_tokens, args.rounds + 1)[1:]
                path = f"server_{client_kind}_client"
                row[path] = summary(served, args.max_tokens)
                row[f"{path}_overhead_ms_per_token"] = row[path]["itl_ms_p50"] - row["api"]["itl_ms_p50"]
                row[f"{path}_overhead_ttft_ms"] = row[path]["ttft_ms_p50"] - row["api"]["ttft_ms_p50"]
            rows.append(row)
            print_row(row, args.clients)
    report = {"model": args.model or "default (SmolLM2-135M-Instruct)", "device": str(device),
              "dtype": options.get("dtype") or "auto", "max_tokens": args.max_tokens, "rounds": args.rounds,
              "results": rows}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    return 0


def print_row(row: dict, clients: list[str]) -> None:
    for path in ("api", *(f"server_{kind}_client" for kind in clients)):
        figures = row[path]
        print(f"C={row['concurrency']:3d} {path:20s}  TTFT p50 {figures['ttft_ms_p50']:8.2f} "
              f"p99 {figures['ttft_ms_p99']:8.2f} ms"
              f"  ITL p50 {figures['itl_ms_p50']:7.3f} p99 {figures['itl_ms_p99']:7.3f} ms"
              f"  {figures['output_tokens_per_s']:9.0f} tok/s  {figures['pieces_per_request']:.1f} pieces/answer",
              flush=True)
    for kind in clients:
        path = f"server_{kind}_client"
        print(f"C={row['concurrency']:3d} server overhead ({kind} client): {row[path + '_overhead_ms_per_token']:+.3f} "
              f"ms a token, {row[path + '_overhead_ttft_ms']:+.2f} ms to the first", flush=True)


if __name__ == "__main__":
    sys.exit(main())
