"""Run GGUF files in llama.cpp through its Python bindings; a script for a subprocess with LlamaCpp.python_env()
(llamacpp_tokens.llamacpp_logits starts it).

    python llamacpp_worker.py REQUEST.json OUT.npz

REQUEST: {"models": [gguf paths], "sequences": [[token ids], ...], "texts": ["...", ...], "kv_cache": "f32"}.
OUT.npz gets `logits_<m>_<i>`: model m's logits at every position of sequence i (one llama_decode with
logits for all tokens, as llama-perplexity does), and `tokens_<m>_<j>`: model m's tokenization of text j
with its own BOS rule and no parsing of special tokens (what llama-perplexity feeds itself). The KV cache
is float32 unless asked otherwise (llama.cpp's default, f16, rounds keys and values).

llama-cpp-python's package __init__ imports its disk prompt cache, which needs `diskcache`, a package the
engine build does not install; that cache is never used here, so an empty stand-in is registered.
"""

import json
import sys
import types

import numpy as np


def import_llama_cpp():
    try:
        import diskcache  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("diskcache")
        stand_in.Cache = object
        sys.modules["diskcache"] = stand_in
    import llama_cpp

    return llama_cpp


def run_model(llama_cpp, path: str, request: dict, index: int, arrays: dict) -> None:
    sequences = request.get("sequences", [])
    n_ctx = max([len(sequence) for sequence in sequences] + [64])
    cache = getattr(llama_cpp, f"GGML_TYPE_{request.get('kv_cache', 'f32').upper()}")
    model = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=2,
                            n_threads_batch=2, type_k=cache, type_v=cache, flash_attn=False, verbose=False)
    for number, sequence in enumerate(sequences):
        model.reset()
        model.eval(sequence)
        arrays[f"logits_{index}_{number}"] = np.array(model.scores[: len(sequence)], dtype=np.float32)
    for number, text in enumerate(request.get("texts", [])):
        ids = model.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        arrays[f"tokens_{index}_{number}"] = np.array(ids, dtype=np.int64)
    model.close()


def main(request_path: str, out_path: str) -> None:
    llama_cpp = import_llama_cpp()
    with open(request_path, encoding="utf-8") as stream:
        request = json.load(stream)
    arrays: dict[str, np.ndarray] = {}
    for index, path in enumerate(request["models"]):
        run_model(llama_cpp, path, request, index, arrays)
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
