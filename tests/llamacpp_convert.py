"""Run llama.cpp's own convert_hf_to_gguf.py on several folders; a script for a subprocess with
LlamaCpp.python_env().

    python tests/llamacpp_convert.py CONVERTER JOBS.json RESULTS.json

JOBS: [{"folder": ..., "outfile": ..., "pre": "gpt-2" or null}, ...]; every job is converted to float32
in this one process (the converter's imports of torch and transformers are paid once). RESULTS gets one
{"returncode": 0 or 1, "log": the converter's log and any traceback} per job.

The converter names a byte-level BPE's pre-tokenizer by hashing the token ids it gives for a fixed text
and looking the hash up in a table of published models; the tests' tiny tokenizer is in no table. Where
the lookup fails, and only there, the converter is told the job's `pre` (what the tokenizer's
pre_tokenizer is); with `pre` null it fails as it would.
"""

import io
import json
import logging
import runpy
import sys
import traceback
from pathlib import Path

given = {"pre": None}


def tell_unknown_pre_tokenizers() -> None:
    from conversion.base import TextModel

    lookup = TextModel.get_vocab_base_pre

    def known_or_given(self, tokenizer):
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            if given["pre"] is None:
                raise
            return given["pre"]

    TextModel.get_vocab_base_pre = known_or_given


def convert(main, converter: str, job: dict) -> dict:
    given["pre"] = job.get("pre")
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    sys.argv = [converter, job["folder"], "--outfile", job["outfile"], "--outtype", "f32"]
    try:
        main()
        returncode = 0
    except SystemExit as exit_:
        returncode = exit_.code if isinstance(exit_.code, int) else 1
    except Exception:  # the converter's own failure is the result
        traceback.print_exc(file=log)
        returncode = 1
    finally:
        logging.getLogger().removeHandler(handler)
    return {"returncode": returncode, "log": log.getvalue()[-20000:]}


def main(converter: str, jobs_path: str, results_path: str) -> None:
    sys.path.insert(0, str(Path(converter).parent))
    module = runpy.run_path(converter, run_name="llamacpp_converter")  # defines main() without running it
    tell_unknown_pre_tokenizers()
    jobs = json.loads(Path(jobs_path).read_text(encoding="utf-8"))
    results = [convert(module["main"], converter, job) for job in jobs]
    Path(results_path).write_text(json.dumps(results), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:4])
