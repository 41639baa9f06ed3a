"""kvreuse: rebuild long prompts' KV caches from stored pieces instead of recomputing them."""

__version__ = "0.1.0"
