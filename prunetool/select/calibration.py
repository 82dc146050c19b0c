"""Calibration text -> token windows.

Every source form (text file, .jsonl, hf: dataset, preset, or text the model generates itself) becomes
one token stream, and `make_windows` cuts the windows from it with a rule simple enough to redo by hand
(docs/calibration.md). Scores are only comparable when the windows are, so the rule is the contract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from prunetool.errors import CalibrationError, OptionError
from prunetool.network import hub_unavailable_reason
from prunetool.paths import calibration_cache_dir, presets_dir

if TYPE_CHECKING:
    import torch

SEED = 0
HOLDOUT_WINDOWS = 4  # windows after the last scored one that selection never sees: prune's and eval's check
LADDER_START = 12288  # generated sizes 12288, 49152, ... tokens: covers the default 16 scored + 4 held-out windows of 512
GEN_MARGIN = 1.125  # generate 12.5% beyond the rung: re-tokenizing decoded text can come out a little shorter
SMALL_RUNG_UNIT = 1024  # a run that needs little text (verification alone) generates a multiple of this
GEN_BATCH = 32  # the 32 shipped prompts go in one batch; fewer, longer forward passes are faster on CPU


class _TooShort(CalibrationError):
    """Too few tokens; private so the generated source can retry a bigger cache file."""

    available: int | None = None  # with holdout_from: tokens the stream has from that token on


@dataclass(frozen=True)
class CalibrationSet:
    source: str
    sha256: str
    seq_len: int
    stride: int
    input_ids: torch.Tensor  # int64 [windows, seq_len]
    spec: str | None = None  # what the user asked for (--calib); None: the model's own generated text
    held_out: torch.Tensor | None = None  # int64 [holdout, seq_len]: after the last window, never overlapping

    @property
    def windows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        return self.windows * self.seq_len

    def describe(self) -> dict:
        """What a run report needs to say which text the scores came from (and how to load it again)."""
        return {"source": self.source, "spec": self.spec, "sha256": self.sha256, "seq_len": self.seq_len,
                "stride": self.stride, "windows": self.windows, "tokens": self.tokens}

    def describe_held_out(self) -> dict | None:
        """Where the held-out windows lie: from the first token after the last window, back to back."""
        if self.held_out is None:
            return None
        first = heldout_start(self.seq_len, self.stride, self.windows)
        count = int(self.held_out.shape[0])
        return {"source": self.source, "spec": self.spec, "sha256": self.sha256, "seq_len": self.seq_len,
                "stride": self.seq_len, "windows": count, "first_token": first,
                "last_token": first + count * self.seq_len - 1,
                "after_windows": self.windows, "after_stride": self.stride}

    def first(self, count: int) -> "CalibrationSet":
        """The first `count` windows (what a search measured), same text, no held-out part."""
        return CalibrationSet(self.source, self.sha256, self.seq_len, self.stride, self.input_ids[:count], self.spec)


@dataclass(frozen=True)
class _Request:
    seq_len: int
    stride: int
    samples: int
    after_tokenizing: Callable[[], None] | None = None  # e.g. free the tokenizer before torch is imported
    holdout: int = 0  # windows of seq_len after the last scored token, back to back
    spec: str | None = None
    holdout_from: int | None = None  # cut the held-out windows from this token instead (heal's training text)

    @property
    def first_held(self) -> int:
        return heldout_start(self.seq_len, self.stride, self.samples) if self.holdout_from is None else self.holdout_from

    @property
    def needed(self) -> int:
        return self.first_held + self.holdout * self.seq_len


def heldout_start(seq_len: int, stride: int, samples: int) -> int:
    """The first token no window touches: held-out text starts here, so it can never overlap a window.

    With no windows (a --remove-layers prune verifies on held-out text alone) it is token 0.
    """
    return (samples - 1) * stride + seq_len if samples > 0 else 0


def _check_options(seq_len: int, stride: int, samples: int, least_samples: int = 1) -> None:
    for flag, value, least in (("--seq-len", seq_len, 1), ("--stride", stride, 1), ("--samples", samples, least_samples)):
        if value < least:
            raise OptionError(f"{flag} must be at least {least}, got {value}")


def make_windows(ids, *, seq_len: int, stride: int, samples: int) -> torch.Tensor:
    """Window k is tokens [k*stride, k*stride + seq_len) of the stream; full windows only, the first `samples`.

    Kept pure and this small so that a user holding the token stream can check any window by hand.
    """
    import torch  # here, not at the top: `score --low-memory` tokenizes before torch is loaded

    _check_options(seq_len, stride, samples)
    stream = torch.as_tensor(ids, dtype=torch.long)
    if stream.dim() != 1:
        raise ValueError(f"make_windows wants a 1-D token stream, got shape {tuple(stream.shape)}")
    needed = (samples - 1) * stride + seq_len
    if stream.numel() < needed:
        raise _TooShort(
            f"calibration text is too short: {stream.numel()} tokens available, {needed} needed "
            f"((samples-1)*stride + seq_len for {samples} windows of {seq_len} at stride {stride}); "
            "lower --samples, --seq-len or --stride, or give more text")
    return stream.unfold(0, seq_len, stride)[:samples].clone()


def _finish(stream: list[int], source: str, sha256: str, req: _Request) -> CalibrationSet:
    if req.after_tokenizing is not None:
        req.after_tokenizing()
    if req.holdout_from is not None and len(stream) < req.needed:
        short = _TooShort(f"{source}: {max(0, len(stream) - req.holdout_from)} tokens from token {req.holdout_from}, "
                          f"{req.holdout * req.seq_len} needed")
        short.available = max(0, len(stream) - req.holdout_from)
        raise short
    try:
        if len(stream) < req.needed and req.holdout:
            raise _TooShort(
                f"calibration text is too short: {len(stream)} tokens available, {req.needed} needed "
                f"({req.samples} windows of {req.seq_len} at stride {req.stride}, then {req.holdout} held-out "
                f"windows of {req.seq_len} that never overlap them); lower --samples or --seq-len, or give more text")
        ids = (make_windows(stream, seq_len=req.seq_len, stride=req.stride, samples=req.samples) if req.samples
               else _no_windows(req.seq_len))
    except _TooShort as exc:
        raise _TooShort(f"{source}: {exc}") from None
    held_out = None
    if req.holdout:
        start = req.first_held
        held_out = make_windows(stream[start:], seq_len=req.seq_len, stride=req.seq_len, samples=req.holdout)
    return CalibrationSet(source, sha256, req.seq_len, req.stride, ids, req.spec, held_out)


def _no_windows(seq_len: int) -> torch.Tensor:
    import torch  # here, not at the top: `score --low-memory` tokenizes before torch is loaded

    return torch.empty((0, seq_len), dtype=torch.long)


def _encode(tokenizer, text: str) -> list[int]:
    """No BOS/EOS: the stream is plain text; verbose=False stops the 'longer than maximum' warning."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _join_documents(tokenizer, docs, needed: int) -> tuple[list[int], list[str], bool]:
    """Tokenize documents one by one, EOS between them (not after the last), until `needed` tokens exist.

    Documents are tokenized independently, so stopping early gives exactly the prefix a full pass would.
    Empty documents are skipped (no tokens, no separator). Without an EOS token, "\\n\\n" (tokenized on
    its own) is the separator instead; the returned flag says so.
    """
    eos = tokenizer.eos_token_id
    sep = [eos] if eos is not None else _encode(tokenizer, "\n\n")
    stream: list[int] = []
    used: list[str] = []
    for doc in docs:
        if not doc:
            continue
        if used:
            stream.extend(sep)
        stream.extend(_encode(tokenizer, doc))
        used.append(doc)
        if len(stream) >= needed:
            break
    return stream, used, eos is None


def _read_text(path: Path) -> tuple[bytes, str]:
    if not path.exists():
        raise CalibrationError(f"calibration file {path} does not exist")
    if path.is_dir():
        raise CalibrationError(f"calibration file {path} is a directory; give a text or .jsonl file")
    data = path.read_bytes()
    try:
        if b"\x00" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text (binary?)") from None
    if not text.strip():
        raise CalibrationError(f"calibration file {path} is empty")
    return data, text


def _jsonl_texts(path: Path, text: str) -> list[str]:
    """Validate every line up front: a broken line should fail now, not only when a bigger run reaches it."""
    texts = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside a string
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"calibration file {path} line {lineno} is not valid JSON ({exc.msg}); "
                                   'each line must be one object with a string field "text"') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CalibrationError(f'calibration file {path} line {lineno} has no string field "text"')
        texts.append(obj["text"])
    if not any(texts):
        raise CalibrationError(f'calibration file {path} has no document with non-empty "text"')
    return texts


def _load_file(path: Path, tokenizer, req: _Request, source: str | None = None) -> CalibrationSet:
    path = path.resolve()
    data, text = _read_text(path)
    sha = hashlib.sha256(data).hexdigest()
    source = source or str(path)
    if path.suffix.lower() != ".jsonl":
        return _finish(_encode(tokenizer, text), source, sha, req)
    stream, _, no_eos = _join_documents(tokenizer, _jsonl_texts(path, text), req.needed)
    if no_eos:
        source += ' (documents joined by "\\n\\n": the tokenizer has no EOS token)'
    return _finish(stream, source, sha, req)


# ---------------------------------------------------------------- hf: datasets and presets

def parse_hf_spec(spec: str) -> tuple[str, str | None, str, str]:
    """hf:DATASET[:CONFIG][:SPLIT][:FIELD] -> (dataset, config or None, split, field); empty parts take defaults."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 4:
        raise CalibrationError(f"bad calibration source {spec!r}: expected hf:DATASET[:CONFIG][:SPLIT][:FIELD]")
    name, config, split, field = parts + [""] * (4 - len(parts))
    return name, config or None, split or "train", field or "text"


def load_presets() -> dict[str, dict]:
    """Named sources from calibration/presets.toml: {name: {spec, description, citation, url}}."""
    with (presets_dir() / "presets.toml").open("rb") as fh:
        return tomllib.load(fh)


def _check_hub_reachable(label: str) -> None:
    """Fail in milliseconds, not after datasets' ~25 s of retries, when the Hub cannot be reached."""
    reason = hub_unavailable_reason()
    if reason is not None:
        raise CalibrationError(f"{label} needs the Hugging Face Hub, but {reason}; "
                               "save the text to a file and pass its path instead")


def _hf_texts(name: str, config: str | None, split: str, field: str, label: str):
    import datasets

    try:
        rows = datasets.load_dataset(name, config, split=split, streaming=True)
        for row in rows:
            if field not in row:
                raise CalibrationError(f"{label}: rows have no field {field!r} (fields: {', '.join(row)})")
            if not isinstance(row[field], str):
                raise CalibrationError(f"{label}: field {field!r} is not text")
            yield row[field]
    except CalibrationError:
        raise
    except Exception as exc:  # datasets raises many types (hub, split, config, network); the user needs one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CalibrationError(f"{label} could not be read: {first}") from None


def _load_hf(spec: str, tokenizer, req: _Request, preset: str | None = None) -> CalibrationSet:
    """sha256 covers the documents used, joined by "\\n\\n": a stream has no file to hash."""
    name, config, split, field = parse_hf_spec(spec)
    source = f"hf:{name}:{config or ''}:{split}:{field}" + (f" (preset {preset})" if preset else "")
    _check_hub_reachable(source)
    stream, used, no_eos = _join_documents(tokenizer, _hf_texts(name, config, split, field, source), req.needed)
    if no_eos:
        source += ' (documents joined by "\\n\\n": the tokenizer has no EOS token)'
    sha = hashlib.sha256("\n\n".join(used).encode("utf-8")).hexdigest()
    return _finish(stream, source, sha, req)


# ---------------------------------------------------------------- the offline default: the model's own text

def self_prompts() -> list[str]:
    """Team-written opening lines (calibration/self_prompts.txt): one per line, a literal \\n is a line break."""
    lines = (presets_dir() / "self_prompts.txt").read_text(encoding="utf-8").split("\n")
    return [line.rstrip().replace("\\n", "\n") for line in lines if line.strip()]


def self_cache_path(model_key: str, rung: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_key.replace("/", "--"))
    return calibration_cache_dir() / f"{safe}-self-seed{SEED}-{rung}.jsonl"


def _cached_rungs(model_key: str) -> list[int]:
    """Sizes of this model's generated texts already in the cache, ascending."""
    pattern = self_cache_path(model_key, 0).name.removesuffix("0.jsonl")
    sizes = (path.name.removeprefix(pattern).removesuffix(".jsonl") for path in calibration_cache_dir().glob(pattern + "*.jsonl"))
    return sorted(int(size) for size in sizes if size.isdigit())


def _rungs(needed: int) -> list[int]:
    rung = LADDER_START
    while rung < needed:
        rung *= 4
    return [rung, rung * 4]


def _small_rung(needed: int) -> int:
    """The smallest generated size for a run that needs only a few windows (a --remove-layers prune's checks)."""
    return max(SMALL_RUNG_UNIT, -(-needed // SMALL_RUNG_UNIT) * SMALL_RUNG_UNIT)


@contextmanager
def _progress(total: int, label: str):
    """A transient bar on stderr: stdout stays clean for piping, and nothing lingers after the run."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


class _Tick:
    """A pass-through logits processor: the one hook generate() calls once per step, batched."""

    def __init__(self, tick):
        self.tick = tick

    def __call__(self, input_ids, scores):
        self.tick(int(input_ids.shape[0]))
        return scores


def _generate_batch(model, tokenizer, prompts: list[str], new_tokens: int, tick) -> list[str]:
    """Left-padded by hand so the caller's tokenizer is not mutated (it may have no pad token)."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    eos = tokenizer.eos_token_id
    pad = next((t for t in (tokenizer.pad_token_id, eos, 0) if t is not None))
    encoded = [tokenizer(p)["input_ids"] for p in prompts]  # special tokens as the model expects a text to start
    encoded = [e[:-1] if len(e) > 1 and e[-1] == eos else e for e in encoded]  # but never end the prompt
    width = max(map(len, encoded))
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, enc in enumerate(encoded):
        ids[row, width - len(enc):] = torch.tensor(enc)
        mask[row, width - len(enc):] = 1
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=0.95, top_k=0, num_beams=1,
                              repetition_penalty=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=pad, eos_token_id=eos)  # min_new_tokens: exact, predictable size
    with torch.inference_mode():
        from prunetool.model.loading import input_device

        device = input_device(model)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=config, logits_processor=LogitsProcessorList([_Tick(tick)]))
    return [tokenizer.decode(row[width - len(enc):], skip_special_tokens=True)
            for row, enc in zip(out.tolist(), encoded)]


def generate_self_text(model, tokenizer, path: Path, rung: int, label: str) -> None:
    """Sample continuations of the shipped prompts with seed 0 and write them as JSONL (temp file, then rename)."""
    import torch

    prompts = self_prompts()
    new_tokens = math.ceil(rung * GEN_MARGIN / len(prompts))
    from prunetool.model.loading import input_device

    device = input_device(model)
    start = time.monotonic()
    with _progress(len(prompts) * new_tokens, f"generating calibration text with {label}") as tick, \
            torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(SEED)
        docs = []
        for first in range(0, len(prompts), GEN_BATCH):
            docs += _generate_batch(model, tokenizer, prompts[first:first + GEN_BATCH], new_tokens, tick)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"generated calibration text in {time.monotonic() - start:.0f}s: {path}", file=sys.stderr)


def _load_generated(tokenizer, model, model_key: str | None, req: _Request, small: bool) -> CalibrationSet:
    """Reuse a cached file that is long enough; otherwise generate the smallest rung that covers the request.

    `small`: generate just what the request needs (rounded up to SMALL_RUNG_UNIT) instead of the ladder's
    first rung, for runs that only verify; a cached rung that is long enough is still used first.
    """
    if not model_key:
        raise CalibrationError("the default calibration text is generated by the model and cached under its key; "
                               "pass a text file, a .jsonl file, hf:DATASET or a preset instead")
    generated = [_small_rung(req.needed)] if small else _rungs(req.needed)
    cached = sorted(set(generated) | set(_rungs(req.needed))) if small else generated
    last: CalibrationError | None = None
    # text that must continue a given stream (holdout_from) is never generated: a new rung is other text.
    # Every cached rung is tried, smallest first: a rung holds GEN_MARGIN more than its name, so the
    # stream prune used may be long enough for more than its nominal size (heal's training text)
    passes = (((False, _cached_rungs(model_key)),) if req.holdout_from is not None
              else ((False, cached), (True, generated)))
    for may_generate, rungs in passes:
        for rung in rungs:
            path = self_cache_path(model_key, rung)
            if not path.exists():
                if not may_generate:
                    continue
                if model is None:
                    raise CalibrationError(f"the default calibration text for {model_key} is not generated yet and "
                                           "this run has no loaded model to generate it (--low-memory); run "
                                           "`prunetool score` once without --low-memory, or pass --calib")
                generate_self_text(model, tokenizer, path, rung, model_key)
            try:
                return _load_file(path, tokenizer, req, f"{path} (generated by {model_key}, seed {SEED})")
            except _TooShort as exc:
                last = exc
    if last is None:
        raise CalibrationError(f"the generated calibration text of {model_key} is not cached; pass --calib")
    raise last


def load_calibration(spec: str | None, tokenizer, *, seq_len: int = 512, stride: int | None = None,
                     samples: int = 16, model=None, model_key: str | None = None,
                     after_tokenizing: Callable[[], None] | None = None, holdout: int = 0,
                     small: bool = False, holdout_from: int | None = None) -> CalibrationSet:
    """Resolve `spec` (None/"self", hf:..., an existing file, or a preset name) and cut the windows.

    `holdout` > 0 also cuts that many windows of `seq_len` starting at the first token after the last
    window (CalibrationSet.held_out): text no window has seen, whatever the stride. `samples` may then be 0.
    `small`: generated text only as long as this request needs (see _load_generated).
    `holdout_from`: cut the held-out windows from this token of the stream instead (with samples=0: `heal`
    re-cuts prune's held-out windows, and its training windows after them); never generates new text, and
    a stream that is too short raises a CalibrationError whose `available` says how many tokens it had.
    `after_tokenizing` runs once the token stream exists and before torch is needed (it may run again if
    a generated cache file turns out too short and the next one is tokenized).
    """
    stride = seq_len if stride is None else stride
    _check_options(seq_len, stride, samples, least_samples=0 if holdout > 0 else 1)
    req = _Request(seq_len, stride, samples, after_tokenizing, holdout, spec, holdout_from)
    if spec is not None and not spec.strip():
        raise CalibrationError("the calibration source is an empty string; omit it to use generated text")
    if spec is None or spec == "self":
        return _load_generated(tokenizer, model, model_key, req, small)
    if spec.startswith("hf:"):
        return _load_hf(spec, tokenizer, req)
    path = Path(spec).expanduser()
    if path.exists():  # recorded absolute, so a later command in another folder loads the same text
        return _load_file(path, tokenizer, dataclasses.replace(req, spec=str(path.resolve())))
    presets = load_presets()
    if spec in presets:
        return _load_hf(presets[spec]["spec"], tokenizer, req, preset=spec)
    if "/" in spec or os.sep in spec or path.suffix:
        raise CalibrationError(f"calibration file {path.resolve()} does not exist")
    raise CalibrationError(f"unknown calibration source {spec!r}: no such file, and not a preset "
                           f"({', '.join(sorted(presets))}) or hf:DATASET[:CONFIG][:SPLIT][:FIELD]")


def recut_held_out(held: dict, tokenizer, model_key: str | None) -> torch.Tensor:
    """The held-out windows prune recorded (`perplexity.held_out`), cut again from the same text, which must
    hash the same: what `eval` and `heal` measure is exactly what `prune` reported on."""
    try:
        windows = load_calibration(held["spec"], tokenizer, seq_len=held["seq_len"], samples=0,
                                   holdout=held["windows"], holdout_from=held["first_token"], model_key=model_key)
    except CalibrationError as error:
        raise CalibrationError(f"cannot re-cut prune's held-out windows: {error}") from None
    if windows.sha256 != held["sha256"]:
        raise CalibrationError(f"prune's calibration text {held['source']} has changed since it was pruned (sha256 "
                               f"{held['sha256'][:12]}… then, {windows.sha256[:12]}… now); prune again")
    return windows.held_out
