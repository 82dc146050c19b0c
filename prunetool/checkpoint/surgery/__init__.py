"""Plan -> pruned checkpoint folder, written without instantiating the model.

The only entry point is `write_pruned_checkpoint`. Data flow: config.json + shard headers are read
and checked first (every refusal happens before anything is written); then each shard is rewritten
byte for byte with renumbered layer names (`tensors`, `safetensors_io`), the config is pruned
(`config`), side files are copied and the folder is published atomically (`output`).
"""

import json
import shutil
from pathlib import Path

from prunetool.errors import OptionError
from prunetool.select.plan import PrunePlan
from prunetool.checkpoint.surgery.config import load_config, prune_config
from prunetool.checkpoint.surgery.materialise import safetensors_folder
from prunetool.checkpoint_io import staged_folder
from prunetool.checkpoint.surgery.output import check_extra_names, check_output, copy_side_files, write_extra_files
from prunetool.checkpoint.surgery.safetensors_io import torch_dtype_of
from prunetool.sources.checks import SAFETENSORS_INDEX
from prunetool.sources.weights import find_decoder_prefix, has_safetensors, read_weights
from prunetool.checkpoint.surgery.tensors import renamer, source_tensors, write_weights

__all__ = ["patched_tensor_names", "prune_config", "write_cut_checkpoint", "write_pruned_checkpoint",
           "write_replaced_checkpoint", "write_nemotron_checkpoint", "write_sublayer_checkpoint"]


def patched_tensor_names(source_dir: Path, relative: list[str]) -> dict[str, tuple]:
    """Decoder-relative tensor names -> (name in the source checkpoint, its torch dtype), from headers only.

    What `write_pruned_checkpoint(replacements=...)` is keyed by, and the dtype a reload will see, so the
    in-memory reference can round the new weights exactly as the written checkpoint does. Needs
    safetensors weights (a .bin source is converted only while writing).
    """
    source_dir = Path(source_dir).expanduser()
    if not has_safetensors(source_dir):
        raise OptionError(f"--patch needs safetensors weights, and {source_dir} has only .bin files; "
                          "convert it first (load and save_pretrained)")
    _, num_layers, _ = load_config(source_dir)
    weights = read_weights(source_dir)
    prefix = find_decoder_prefix(weights.names, num_layers)
    return {name: (entry.name, torch_dtype_of(entry)) for name, entry in source_tensors(weights, prefix, relative).items()}


def write_pruned_checkpoint(
    source_dir: Path,
    plan: PrunePlan,
    output: Path,
    *,
    force: bool = False,
    extra_files: dict[str, str] | None = None,
    on_shard=None,
    before_publish=None,
    replacements: dict | None = None,
) -> Path:
    """Write `source_dir` minus the plan's removed layers to `output`; return `output`.

    Kept tensors keep their dtype and bytes, shard file names and shard metadata; the index and
    config.json describe the new layer count. `on_shard(file_name)` is called once per source shard
    (progress). `extra_files` ({relative name: text}) are written into the folder as well.
    `replacements` ({tensor name in the source: torch tensor}) give new data for a few kept tensors
    (`prune --patch`): cast to the source tensor's dtype, same shape; everything else stays byte-exact.
    `before_publish(folder)` gets the complete temporary folder before it is renamed into place: if it
    raises (a failed reload check), nothing is published. The source folder is only read. With
    `force` an existing output is replaced once the new one is complete (and checked).
    """
    source_dir, output = Path(source_dir).expanduser(), Path(output).expanduser().absolute()
    check_output(source_dir, output, force)
    check_extra_names(extra_files, {"config.json", SAFETENSORS_INDEX})
    config, num_layers, derived = load_config(source_dir)
    if plan.num_layers != num_layers:
        raise OptionError(
            f"the plan is for a {plan.num_layers}-layer model but {source_dir} has {num_layers} decoder layers; "
            "make the plan from this model"
        )
    new_config = prune_config(config, list(plan.kept), derived)
    with safetensors_folder(source_dir, output) as weights_dir:
        weights = read_weights(weights_dir)
        prefix = find_decoder_prefix(weights.names, num_layers)
        with staged_folder(output, force) as staging:
            write_weights(weights, renamer(prefix, plan.index_map), staging, on_shard, replacements)
            copy_side_files(source_dir, staging)
            (staging / "config.json").write_text(json.dumps(new_config, indent=2) + "\n", encoding="utf-8")
            write_extra_files(staging, extra_files)
            if before_publish is not None:
                before_publish(staging)
    return output


def write_replaced_checkpoint(source_dir: Path, output: Path, replacements: dict, *, force: bool = False,
                              extra_files: dict[str, str] | None = None, on_shard=None, before_publish=None) -> Path:
    """Copy `source_dir` to `output` with the given tensors replaced (`heal`): no layer removed, config unchanged.

    `replacements` are keyed by the tensor names in the source and cast to each source tensor's dtype;
    every other tensor keeps its bytes. `extra_files` replace side files of the same name (prune.json,
    README.md). Published atomically after `before_publish(folder)` passes, like write_pruned_checkpoint.
    """
    source_dir, output = Path(source_dir).expanduser(), Path(output).expanduser().absolute()
    check_output(source_dir, output, force)
    check_extra_names(extra_files, {"config.json", SAFETENSORS_INDEX})
    if not has_safetensors(source_dir):
        raise OptionError(f"{source_dir} has no safetensors weights to rewrite")
    weights = read_weights(source_dir)
    with staged_folder(output, force) as staging:
        write_weights(weights, lambda name: name, staging, on_shard, replacements)
        copy_side_files(source_dir, staging)
        shutil.copyfile(source_dir / "config.json", staging / "config.json")  # unchanged: no layer goes
        write_extra_files(staging, extra_files)
        if before_publish is not None:
            before_publish(staging)
    return output


def sublayer_renamer(prefix: str, removed_attention=(), removed_mlp=()):
    """name -> name, or None for a tensor of a removed sublayer (or its input norm); nothing is renumbered."""
    from prunetool.model.sublayers import SUBLAYER_MODULES

    gone = tuple(f"{prefix}{index}.{part}."
                 for unit, removed in (("attention", removed_attention), ("mlp", removed_mlp))
                 for index in removed for part in SUBLAYER_MODULES[unit])

    def rename(name: str) -> str | None:
        return None if name.startswith(gone) else name

    return rename


def write_sublayer_checkpoint(source_dir: Path, plan: PrunePlan, output: Path, **options) -> Path:
    """Write `source_dir` without the plan's attention (or MLP) sublayers as a nemotron-nas (DeciLM) folder."""
    source_dir = Path(source_dir).expanduser()
    _, num_layers, _ = load_config(source_dir)
    if plan.num_layers != num_layers:
        raise OptionError(f"the plan is for a {plan.num_layers}-layer model but {source_dir} has {num_layers} "
                          "decoder layers; make the plan from this model")
    return write_nemotron_checkpoint(source_dir, output, removed_attention=plan.cut.attention,
                                     removed_mlp=plan.cut.mlp, **options)


def write_nemotron_checkpoint(source_dir: Path, output: Path, *, removed_attention=(), removed_mlp=(),
                              force: bool = False, extra_files: dict[str, str] | None = None, on_shard=None,
                              before_publish=None) -> Path:
    """Write `source_dir` without the given attention and MLP sublayers as a nemotron-nas (DeciLM) folder.

    Every layer stays; a removed sublayer's tensors (and its input norm's) are not written, and config.json
    describes each layer in `block_configs` (checkpoint.nemotron_nas.convert), under the rules of the engines
    that serve the format. The folder carries our configuration and modeling code for transformers
    (trust_remote_code); vLLM has the architecture built in. Kept tensors keep their bytes; publishing is
    atomic as for a block prune.
    """
    from prunetool.checkpoint.nemotron_nas.convert import check_expressible, nemotron_config

    source_dir, output = Path(source_dir).expanduser(), Path(output).expanduser().absolute()
    check_output(source_dir, output, force)
    check_extra_names(extra_files, {"config.json", SAFETENSORS_INDEX})
    config, num_layers, _ = load_config(source_dir)
    check_expressible(config)
    new_config = nemotron_config(config, removed_attention, removed_mlp)
    return _write_nemotron(source_dir, output, new_config, num_layers,
                           lambda prefix: sublayer_renamer(prefix, removed_attention, removed_mlp), force=force,
                           extra_files=extra_files, on_shard=on_shard, before_publish=before_publish)


def _write_nemotron(source_dir: Path, output: Path, new_config: dict, num_layers: int, rename_for, *, force: bool,
                    extra_files, on_shard, before_publish) -> Path:
    """The write both nemotron-nas writers share: tensors renamed by `rename_for(decoder prefix)`, side files, the
    new config.json and our code, published atomically after `before_publish`."""
    from prunetool.checkpoint.nemotron_nas.convert import write_code_files

    with safetensors_folder(source_dir, output) as weights_dir:
        weights = read_weights(weights_dir)
        prefix = find_decoder_prefix(weights.names, num_layers)
        with staged_folder(output, force) as staging:
            write_weights(weights, rename_for(prefix), staging, on_shard)
            copy_side_files(source_dir, staging)
            (staging / "config.json").write_text(json.dumps(new_config, indent=2) + "\n", encoding="utf-8")
            write_code_files(staging)
            write_extra_files(staging, extra_files)
            if before_publish is not None:
                before_publish(staging)
    return output


def write_cut_checkpoint(source_dir: Path, cut, output: Path, *, force: bool = False,
                         extra_files: dict[str, str] | None = None, on_shard=None, before_publish=None) -> Path:
    """Write `source_dir` under a Cut (prunetool.cut): whole blocks only as the source's own format (as
    write_pruned_checkpoint), anything else as nemotron-nas with the removed blocks gone and the other
    removals as no-op sublayers, in one pass over the shards. Refusals (format, engine rules) come first."""
    from prunetool.checkpoint.nemotron_nas.convert import check_expressible, nemotron_config

    source_dir, output = Path(source_dir).expanduser(), Path(output).expanduser().absolute()
    config, num_layers, derived = load_config(source_dir)
    if cut.num_layers != num_layers:
        raise OptionError(f"the cut is for a {cut.num_layers}-layer model but {source_dir} has {num_layers} decoder "
                          "layers; make the cut from this model")
    if cut.blocks_only:
        plan = PrunePlan(base_model=str(source_dir), num_layers=num_layers, removed=cut.blocks, criterion="manual")
        return write_pruned_checkpoint(source_dir, plan, output, force=force, extra_files=extra_files,
                                       on_shard=on_shard, before_publish=before_publish)
    check_output(source_dir, output, force)
    check_extra_names(extra_files, {"config.json", SAFETENSORS_INDEX})
    check_expressible(config)
    cut.check_engines()
    rest = cut.after_blocks()
    new_config = nemotron_config(prune_config(config, list(cut.kept), derived), rest.attention, rest.mlp)

    def rename_for(prefix: str):
        renumber, drop = renamer(prefix, cut.index_map), sublayer_renamer(prefix, rest.attention, rest.mlp)
        return lambda name: None if (new := renumber(name)) is None else drop(new)

    return _write_nemotron(source_dir, output, new_config, num_layers, rename_for, force=force,
                           extra_files=extra_files, on_shard=on_shard, before_publish=before_publish)
