"""The chat questions the default-model tests ask (CPU, GPU and FP8), in one list so they cannot drift."""

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CUDA graph is.",
    "Who wrote Romeo and Juliet?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name the planets of the solar system.",
]
