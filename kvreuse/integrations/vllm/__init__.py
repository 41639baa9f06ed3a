"""kvreuse's store behind vLLM: `KVReuseConnector` (in `connector`, which imports vLLM) and the vLLM-free parts it
is built on (`pages`: vLLM's CPU cache blocks as store entries, and which blocks each step loads and saves).

Load it in vLLM with
    --kv-transfer-config '{"kv_connector": "KVReuseConnector",
                           "kv_connector_module_path": "kvreuse.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "memory:2GB,redis://127.0.0.1:6379/0"}}'
(docs/VLLM.md).
"""
