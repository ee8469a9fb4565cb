"""Speculative decoding: drafts proposed on the host, verified by the target model in one decode step.

``config``: what ``EngineConfig.speculative`` takes; ``ngram``: prompt-lookup drafts; ``draft_model``:
drafts from a second model; ``drafting``: the engine's side (draft lengths, their blocks, which drafts
the target keeps).
"""
