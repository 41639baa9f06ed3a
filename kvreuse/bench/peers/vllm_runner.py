"""Times vLLM's prefill on given prompts (token ids). Run by the vLLM venv's python, not imported by kvreuse:

    python vllm_runner.py JOB.json RESULT.json

JOB: {"model": DIR, "mode": "full" | "prefix" | "decode", "repeats": N, "max_model_len": N, "dtype": "float32",
      "kv_cache_bytes": N, "workloads": [{"id": str, "prompt": [ids], "chunk_requests": [[ids], ...]}, ...],
      "batches": [{"id": str, "prompts": [[ids], ...]}, ...], "steps": N}
mode "full": prefix caching off, each prompt prefilled from scratch.
mode "prefix": prefix caching on; before every timed prompt the cache is emptied and the chunk requests (each
chunk behind the template head, as the requests that brought the chunks in) are run, so vLLM holds what it
would hold in a RAG service that has seen every chunk before, and reuses whatever exact prefix it can.
Each timed call is LLM.generate of one prompt with max_tokens=1: its wall time is the TTFT an offline caller
sees. The first round of every prompt is a warm-up, not reported (as for the other engines).
mode "rounds" (prefix caching on): "rounds": [{"prompts": [{"ids": [...], "salt": str, "kv_transfer_params": {}}, ...],
"max_tokens": N, "reset_prefix_cache": bool, "logprobs": bool}] are generated greedily in order, each prompt alone;
every output's tokens, cached prompt tokens, wall time and (with "logprobs") the first token's log-probabilities
over the whole vocabulary are returned. With "kv_transfer_config" set, the engine runs with that KV connector (kvreuse's, for its tests and bench);
"hf_overrides" changes the model's config as vLLM's --hf-overrides does;
a round with "stop_redis": URL first shuts that Redis server down (a replica's shared store failing under it).
mode "decode" (prefix caching off): each batch of prompts is added to vLLM's engine at once and stepped until every
prompt has steps + 1 tokens (greedy, ignoring EOS; all prefilled in one step); a sequence's time per output token
(from its first token to its last, over the tokens between) is the time of one decoding step of the whole batch,
its prefill left out. The difference of two generate calls (steps tokens and one) gave that before, and at 16
prompts of 512 tokens the prefills' spread outweighed the steps (a negative step once).
"""

import json
import sys
import time


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def _time_workload(llm, workload, job, params):
    seconds, cached = [], []
    for _ in range(job["repeats"] + 1):
        if job["mode"] == "prefix":
            llm.reset_prefix_cache()
            _generate(llm, workload["chunk_requests"], params)
        start = time.perf_counter()
        output = _generate(llm, [workload["prompt"]], params)[0]
        seconds.append(time.perf_counter() - start)
        cached.append(output.num_cached_tokens or 0)
    return {"id": workload["id"], "seconds": seconds[1:], "cached_tokens": cached[1:]}


def _time_batch(llm, batch, job):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    # DELTA: each step hands back only its new tokens, the least work for vLLM's own process between steps
    params = SamplingParams(max_tokens=job["steps"] + 1, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    step_seconds = []
    for round_ in range(job["repeats"] + 1):
        for i, prompt in enumerate(batch["prompts"]):
            engine.add_request(f"{batch['id']}-{round_}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        events, tokens = [], {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] = tokens.get(output.request_id, 0) + len(output.outputs[0].token_ids)
                events.append((time.perf_counter(), output.request_id, tokens[output.request_id]))
        per_sequence = decode_step_seconds(events)
        if len(per_sequence) != len(batch["prompts"]):
            raise RuntimeError(f"{len(per_sequence)} of {len(batch['prompts'])} sequences decoded")
        if round_:
            step_seconds.append(sorted(per_sequence)[len(per_sequence) // 2])
    return {"id": batch["id"], "step_seconds": step_seconds}


def decode_step_seconds(events):
    """Per sequence that decoded: (when its last token came - when its first came) / the tokens between, its time
    per output token. events: (seconds, sequence id, its tokens so far), in the order they came."""
    first, last = {}, {}
    for seconds, sequence, tokens in events:
        first.setdefault(sequence, (seconds, tokens))
        last[sequence] = (seconds, tokens)
    return [(last[s][0] - first[s][0]) / (last[s][1] - first[s][1]) for s in first if last[s][1] > first[s][1]]


def _run_rounds(llm, job):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for round_ in job["rounds"]:
        if round_.get("stop_redis"):
            import redis

            try:
                redis.Redis.from_url(round_["stop_redis"]).shutdown(nosave=True)
            except redis.ConnectionError:  # the server closes the connection as it goes down
                pass
        if round_.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        outputs = []
        for prompt in round_["prompts"]:
            params = SamplingParams(max_tokens=round_["max_tokens"], temperature=0.0,
                                    logprobs=-1 if round_.get("logprobs") else None,
                                    extra_args={"kv_transfer_params": prompt["kv_transfer_params"]}
                                    if prompt.get("kv_transfer_params") else None)
            inputs = TokensPrompt(prompt_token_ids=prompt["ids"])
            if prompt.get("salt"):
                inputs["cache_salt"] = prompt["salt"]
            start = time.perf_counter()
            output = llm.generate([inputs], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            first = output.outputs[0].logprobs[0] if round_.get("logprobs") else {}
            outputs.append({"seconds": seconds, "tokens": list(output.outputs[0].token_ids),
                            "cached_tokens": output.num_cached_tokens or 0,
                            "first_logprobs": [first[t].logprob for t in sorted(first)]})
        results.append(outputs)
    return results


def main(job_path, result_path):
    import vllm
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        # one prefill step per prompt, as the other engines do it (no chunked prefill across steps), unless asked
        max_num_batched_tokens=job.get("max_num_batched_tokens") or job["max_model_len"],
        enable_prefix_caching=job["mode"] in ("prefix", "rounds"),
        kv_transfer_config=job.get("kv_transfer_config"),
        hf_overrides=job.get("hf_overrides") or {},
        enforce_eager=job.get("enforce_eager", False),
        max_logprobs=-1,  # rounds may ask for the first token's whole distribution (first-token KL)
        max_num_seqs=max([len(b["prompts"]) for b in job.get("batches", [])] + [16]),
        # explicit, not a share of the machine's memory: the machine is shared and its free memory varies
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        seed=0,
    )
    startup = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0)
    if job["mode"] == "decode":
        results = [_time_batch(llm, b, job) for b in job["batches"]]
    elif job["mode"] == "rounds":
        results = _run_rounds(llm, job)
    else:
        results = [_time_workload(llm, w, job, params) for w in job["workloads"]]
    with open(result_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "mode": job["mode"], "startup_seconds": startup,
                   "results": results}, f)


if __name__ == "__main__":  # vLLM starts worker processes: it runs only under this guard
    main(sys.argv[1], sys.argv[2])
