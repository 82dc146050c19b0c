"""A model's tokenizer.json through the `tokenizers` library alone, for `score --low-memory`.

Gemma 3's 262k-entry vocabulary costs about 300 MB once parsed, as much as the rest of a streamed
scoring run; loaded with AutoTokenizer (which imports torch) it peaks near 700 MB. Reading the file
with `tokenizers` needs neither torch nor transformers, so the calibration text can be tokenized and
the tables freed before the model machinery is imported. Only what calibration uses is offered:
plain-text encoding without special tokens, and the EOS id. The ids equal AutoTokenizer's for the
fast tokenizers transformers builds from the same file (tests/test_low_memory.py checks this).
"""

import json
from pathlib import Path

from prunetool.errors import ModelSourceError
from prunetool.memory import return_freed_memory


class FileTokenizer:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]` and `eos_token_id`, from tokenizer.json."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.file = self.folder / "tokenizer.json"
        if not self.file.is_file():
            raise ModelSourceError(f"--low-memory reads {self.file}, which does not exist; score without --low-memory")
        self._backend = None
        self.eos_token_id = self._special_id("eos_token")

    @property
    def backend(self):
        if self._backend is None:
            from tokenizers import Tokenizer

            try:
                self._backend = Tokenizer.from_file(str(self.file))
            except Exception as error:  # tokenizers raises plain Exception subclasses from Rust
                raise ModelSourceError(f"cannot read {self.file}: {error}") from None
        return self._backend

    def _special_id(self, name: str) -> int | None:
        """The id of tokenizer_config.json's `name` token (a string or an AddedToken dict), as AutoTokenizer reads it."""
        config_file = self.folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        return self.backend.token_to_id(token)

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        if add_special_tokens:
            raise NotImplementedError("FileTokenizer encodes plain text only (add_special_tokens=False)")
        return {"input_ids": self.backend.encode(text, add_special_tokens=False).ids}

    def release(self) -> None:
        """Free the parsed tables now (they come back on the next call) and hand the pages back to the system."""
        self._backend = None
        return_freed_memory()
