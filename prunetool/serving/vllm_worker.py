"""Runs inside vLLM's own venv (it imports nothing of prunetool): loads folders and answers with token log-probs.

Reads one JSON request on stdin and writes one JSON answer on stdout; vLLM's own logging goes to stderr.
    {"models": [{"path": FOLDER, "trust_remote_code": bool}], "dtype": "float32", "max_model_len": 1024,
     "prompts": [[token ids], ...], "max_tokens": 16}
 -> {"vllm": version, "models": [{"path": ..., "outputs": [{"tokens": [...], "logprobs": [...],
                                   "prompt_logprobs": [null, ...]}]} or {"path": ..., "error": "..."}]}
Each model is loaded, queried greedily (temperature 0, EOS allowed), and freed before the next one, so one
start-up of vLLM serves many folders.
"""

import gc
import json
import os
import sys


def chosen(entries, tokens):
    """The log-probability vLLM gave each chosen token (None where it gave none, as for the first prompt token)."""
    return [None if entry is None else entry[token].logprob for entry, token in zip(entries, tokens)]


def answer(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=0)
    results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    outputs = []
    for prompt, result in zip(prompts, results):
        completion = result.outputs[0]
        outputs.append({"tokens": list(completion.token_ids),
                        "logprobs": chosen(completion.logprobs, completion.token_ids),
                        "prompt_logprobs": chosen(result.prompt_logprobs, prompt)})
    return outputs


def release() -> None:
    """Free one model before the next: the in-process engine keeps vLLM's process group and model state."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def main() -> None:
    request = json.load(sys.stdin)
    answer_to = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout: the answer gets the real stdout, logs stderr
    os.dup2(2, 1)
    import vllm
    from vllm import LLM

    models = []
    for model in request["models"]:
        llm = None
        try:
            # one process ("uni" executor, VLLM_ENABLE_V1_MULTIPROCESSING=0 from the caller): every extra process
            # imports vLLM again, a minute on a busy 2-core machine
            llm = LLM(model=model["path"], dtype=request.get("dtype", "float32"), enforce_eager=True,
                      max_model_len=request.get("max_model_len", 1024), enable_prefix_caching=False,
                      trust_remote_code=model.get("trust_remote_code", False), seed=0,
                      distributed_executor_backend="uni",
                      gpu_memory_utilization=request.get("memory_fraction", 0.1))
            models.append({"path": model["path"], "outputs": answer(llm, request["prompts"], request["max_tokens"])})
        except Exception as error:  # reported per folder: one folder that fails must not hide the others
            models.append({"path": model["path"], "error": f"{type(error).__name__}: {error}"})
        finally:
            del llm
            release()
    json.dump({"vllm": vllm.__version__, "models": models}, answer_to)
    answer_to.flush()


if __name__ == "__main__":
    main()
