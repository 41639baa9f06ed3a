"""The engines a benchmark measures beside kvreuse, in the same run."""

PEERS = ("transformers", "vllm")
