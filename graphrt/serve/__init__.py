"""``graphrt serve``: an OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

``Server(llm, host, port, limits)`` serves an ``LLM``; ``ServerLimits`` holds its caps and timeouts.
"""
