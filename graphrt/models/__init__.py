"""Llama-family model implementations."""
