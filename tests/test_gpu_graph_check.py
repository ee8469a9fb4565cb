"""The decode graphs' runtime oracle on CUDA: real captured graphs pass it, and a graph captured
wrong (its logits negated, as a graph captured from stale state would compute something else) is
caught at its first checked replay, logged, and its bucket decodes eagerly from then on."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from graphrt import LLM, SamplingParams  # noqa: E402
from graphrt.capture import EagerReason, GraphKey  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_real_graphs_pass_and_a_corrupted_graph_is_caught(dtype, record_property):
    options = dict(model="random:smollm2-135m", device="cuda", dtype=dtype, progress=False, num_kv_blocks=256,
                   max_model_len=256, capture_sizes=[1, 2, 4], check_graphs=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(**options) as llm:
        runner = llm.engine.decode_runner
        check = runner.graph_check
        together = llm.generate(prompts, params)
        alone = llm.generate([prompts[0]], params)[0]
        assert check.checks >= 15 and check.failures == [], check.failures
        record_property("largest_replay_vs_eager_logit_diff", check.largest_logit_diff)
        print(f"\n[{dtype}] {check.checks} checked replays agreed; largest logit difference {check.largest_logit_diff:.3g}")

        model = runner.model
        original = model.compute_logits
        model.compute_logits = lambda hidden: -original(hidden)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                runner._forward(GraphKey(1, "greedy"))
        finally:
            del model.compute_logits
        runner.graphs[GraphKey(1, "greedy")] = graph

        again = llm.generate([prompts[0]], params)[0]
        assert again.token_ids == alone.token_ids  # the failing step kept its eager result, later steps ran eagerly
        failure = check.failures[0]
        assert (failure.bucket, failure.mode, failure.reason, failure.tokens_differ) == (1, "greedy", "diverged", 1)
        assert runner.stats.eager_steps[EagerReason.GRAPH_CHECK_FAILED] >= 14
        assert len(together[0].token_ids) == 16
