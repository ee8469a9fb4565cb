"""One decode step's rows as an embedding engine hands them over (host side, one entry per row)."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphrt.sampling.params import SamplingParams


@dataclass
class DecodeBatch:
    """B rows, each decoding one token.

    ``input_ids[i]`` is the token at ``positions[i]``; ``seq_lens[i] = positions[i] + 1`` keys are
    attended after its K/V is written at ``slot_mapping[i]`` (block * block_size + offset);
    ``block_tables[i]`` lists the row's physical KV blocks. Sampling: ``params[i]``, ``seeds[i]``
    (the row's random stream) and ``steps[i]`` (index of this token within the row's output).

    ``block_table_versions`` (optional): one int >= 0 per row naming the contents of its block table
    (``BlockManager.table_version``): equal versions promise equal tables, so the graph runner restages
    only rows whose version changed since the last step (without them every table is converted every
    step: O(batch x blocks) host work).
    """

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    params: list[SamplingParams]
    seeds: list[int]
    steps: list[int]
    seq_lens: list[int] = field(default_factory=list)
    block_table_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.seq_lens:
            self.seq_lens = [p + 1 for p in self.positions]
        size = len(self.input_ids)
        lengths = {name: len(getattr(self, name)) for name in
                   ("positions", "block_tables", "slot_mapping", "params", "seeds", "steps", "seq_lens")}
        if self.block_table_versions is not None:
            lengths["block_table_versions"] = len(self.block_table_versions)
            if min(self.block_table_versions, default=0) < 0:
                raise ValueError("block_table_versions must be >= 0")
        wrong = {name: n for name, n in lengths.items() if n != size}
        if wrong:
            raise ValueError(f"decode batch has {size} input ids but {wrong}")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def sampling_mode(self) -> str:
        """The graph this batch replays: ``logprobs`` when some row asks for logprobs (the general
        sampling path, then each row's log probabilities), else ``greedy`` (every row), ``temperature``
        (some row samples, none uses top-k or top-p) or ``sample`` (the general path, which filters
        top-k / top-p rows: with the fused kernels by a threshold search, ``graphrt.sampling.top_k_top_p``,
        else by sorting the vocabulary). Every mode gives a row the same token."""
        if any(p.logprobs is not None for p in self.params):
            return "logprobs"
        if self.all_greedy:
            return "greedy"
        return "sample" if any(p.filtered for p in self.params) else "temperature"
