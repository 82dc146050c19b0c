"""The baseline for bench/score_overhead.py: load a model and run the same windows forward, nothing else.

Usage: python bench/plain_forward.py MODEL_DIR TEXT_FILE SEQ_LEN SAMPLES [full|decoder]
Windows follow prunetool's contract: the file tokenized as one stream without special tokens,
window k = tokens [k*SEQ_LEN, (k+1)*SEQ_LEN).
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, text_file, seq_len, samples = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "full"
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
ids = tokenizer(open(text_file, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
windows = torch.tensor(ids[: seq_len * samples]).view(samples, seq_len)
runner = model if mode == "full" else model.get_decoder()
with torch.inference_mode():
    for window in windows:
        runner(input_ids=window[None], use_cache=False)
