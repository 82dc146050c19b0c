"""Hugging Face Hub ids (`owner/name[@revision]`) -> a local snapshot folder.

Only what prunetool needs is downloaded: config, safetensors weights, tokenizer and generation files.
Network problems become one line that points at the offline alternatives.
"""

import re
from pathlib import Path

from prunetool.errors import ModelSourceError
from prunetool.sources.progress import step

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(@[\w./-]{1,200})?$")
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
IGNORE_PATTERNS = ["*/*", "consolidated*", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf"]
OFFLINE_HINT = "pass a local folder, a .gguf file or a demo alias (prunetool models)"


def looks_like_hub_id(spec: str) -> bool:
    """`owner/name` or `owner/name@rev`; paths like `./x`, `/x`, `~/x` or `dir/file.gguf` are not ids."""
    return bool(_HUB_ID.match(spec)) and not spec.lower().endswith(_FILE_SUFFIXES)


def download(spec: str, *, trust_remote_code: bool = False) -> Path:
    """snapshot_download of the files prunetool uses; custom *.py code only when it will be trusted."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = spec.partition("@")
    allow = ALLOW_PATTERNS + (["*.py"] if trust_remote_code else [])
    try:
        with step(f"downloading {spec} from the Hugging Face Hub"):
            folder = snapshot_download(
                repo_id, revision=revision or None, allow_patterns=allow, ignore_patterns=IGNORE_PATTERNS
            )
    except Exception as e:
        raise _download_error(spec, e) from e
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"'{spec}' on the Hugging Face Hub has no config.json at its top level; {OFFLINE_HINT}")
    if not any(folder.glob("*.safetensors")):
        raise ModelSourceError(
            f"'{spec}' on the Hugging Face Hub has no safetensors weights (prunetool does not download .bin/.pt); "
            "convert it with transformers and pass the folder"
        )
    return folder


def _download_error(spec: str, error: Exception) -> ModelSourceError:
    """Map huggingface_hub's exceptions to one actionable line."""
    from huggingface_hub import constants, errors

    repo_id = spec.partition("@")[0]
    if isinstance(error, errors.GatedRepoError):
        why = "the repository is gated: accept its license on huggingface.co and log in with `hf auth login`"
    elif isinstance(error, errors.RepositoryNotFoundError):
        why = f"repository '{repo_id}' not found (check the id, or log in with `hf auth login` if it is private)"
    elif isinstance(error, errors.RevisionNotFoundError):
        why = f"revision '{spec.partition('@')[2]}' not found"
    elif constants.HF_HUB_OFFLINE:
        why = "offline or unreachable: HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
    elif isinstance(error, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, OSError, ConnectionError)):
        why = f"offline or unreachable: {_short_reason(error)}"
    else:
        why = f"{type(error).__name__}: {_short_reason(error)}"
    return ModelSourceError(f"cannot download '{spec}' from the Hugging Face Hub ({why}); {OFFLINE_HINT}")


def _short_reason(error: Exception) -> str:
    """The first line of the message, which names the underlying network error when there is one."""
    text = str(error).strip() or type(error).__name__
    first = text.splitlines()[0].removeprefix("Got: ").strip()
    return first[:200]
