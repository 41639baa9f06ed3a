"""Evaluation harness: datasets as chunked prompts, quality metrics, a resumable runner, reports."""
