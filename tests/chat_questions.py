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

#: A request whose answer is mostly in its prompt, so that prompt-lookup drafts are kept (speculation tests).
REPEAT_QUESTION = (
    "Repeat the following text word for word.\n\n"
    "The old mill stood at the bend of the river, where the water slowed and turned brown with the silt of "
    "the fields. Every spring the miller cleared the channel, mended the wheel and waited for the rains, and "
    "every autumn the farmers brought their grain in carts along the lane that ran beside the willows."
)
