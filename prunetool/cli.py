"""The command line: parse options, call the library, render. The only module that imports typer.

Heavy libraries (torch, transformers) are imported inside command bodies so `--help` stays instant.
"""

import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.22 parses with its own copy of click; older ones use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from prunetool import __version__
from prunetool.errors import OptionError, PrunetoolError

out = Console()
err = Console(stderr=True)
DEBUG_ENV = "PRUNETOOL_DEBUG"
USAGE_EXIT = 2  # a usage error (unknown option, missing value, bad number), as click and POSIX tools use


class OneLineErrors(TyperGroup):
    """Usage errors as one line and exit 2, like every other error, instead of typer's multi-line box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except click_errors.NoArgsIsHelpError as error:
            out.print(error.format_message(), highlight=False, markup=False)
            code = 0
        except click_errors.UsageError as error:
            where = f" (see `{error.ctx.command_path} --help`)" if error.ctx is not None else ""
            err.print(f"[bold red]error:[/] {escape(error.format_message())}{escape(where)}", highlight=False,
                      soft_wrap=True)
            code = USAGE_EXIT
        except click_errors.ClickException as error:
            err.print(f"[bold red]error:[/] {escape(error.format_message())}", highlight=False, soft_wrap=True)
            code = error.exit_code
        except typer.Abort:
            err.print("[bold red]interrupted[/]")
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="prunetool",
    cls=OneLineErrors,
    help="Remove whole decoder layers from LLMs, chosen by query self-similarity, and explain why they could go.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Options shared by commands, declared once.
MODEL_FORMS = "Local HF folder, hub id, .gguf file or demo alias (`prunetool models`)"
ModelArg = Annotated[Optional[str], typer.Argument(help=f"{MODEL_FORMS}; default: smollm2-135m.", show_default=False)]
PruneModelArg = Annotated[Optional[str], typer.Argument(
    help=f"{MODEL_FORMS}; default: the current run's model and its scores (the last `prunetool score`).",
    show_default=False)]
HeadsModelArg = Annotated[Optional[str], typer.Argument(
    help=f"{MODEL_FORMS}; default: the current run's model, else smollm2-135m.", show_default=False)]
CalibOpt = Annotated[
    Optional[str],
    typer.Option("--calib", help="Text file, .jsonl (field `text`), hf:DATASET[:CONFIG][:SPLIT][:FIELD], a preset "
                 "name, or `self` (default: text the model generates, seeded, cached)."),
]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per calibration window.")]
StrideOpt = Annotated[Optional[int], typer.Option("--stride", help="Tokens between window starts (default: --seq-len).")]
SamplesOpt = Annotated[int, typer.Option("--samples", help="Number of windows (the first N full windows).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")]
DeviceMapOpt = Annotated[Optional[str], typer.Option("--device-map", help="Spread the model with accelerate: auto, "
                         "balanced, balanced_low_0 or sequential (GPUs, then the CPU, then --offload-dir).")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option("--max-memory", help="With --device-map: limits per device, "
                         "e.g. 0=20GiB,1=20GiB,cpu=64GiB.")]
OffloadOpt = Annotated[Optional[Path], typer.Option("--offload-dir", help="With --device-map: folder for the weights "
                       "that fit no device (read back layer by layer).")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow a checkpoint's own Python code to run.")]
# Old spellings, still accepted, no longer shown: --output meant a file for score/eval but a folder for
# prune/heads, and --layers removed layers in prune but selected them in heads.
OldOutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", hidden=True)]
OldLayersOpt = Annotated[Optional[str], typer.Option("--layers", hidden=True)]
LowMemoryOpt = Annotated[bool, typer.Option("--low-memory", help="Never load the model: read one decoder layer at a "
                         "time from the checkpoint (same results; score and heads need cached or --calib text; "
                         "prune chooses it by itself when the checkpoint does not fit).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output folder (never the source).")]
VerifyOpt = Annotated[bool, typer.Option("--verify/--no-verify", help="Reload in --dtype on --device, decode with and "
                      "without cache, measure held-out perplexity.")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Also draw the per-layer scores to this PNG "
                    "(needs the [plot] extra: pip install 'prunetool[plot]').")]


def one_of(new_name: str, new, old_name: str, old):
    """The value of an option given under its new name or its old hidden alias, never both."""
    if new is not None and old is not None:
        raise OptionError(f"give {new_name} once ({old_name} is its old spelling)")
    return new if new is not None else old


def _debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _rank_prefix() -> str:
    """'rank 1: ' under a launcher of several ranks (each rank reports its own failure), else nothing."""
    import os

    return f"rank {os.environ.get('RANK', '0')}: " if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""


def handle_errors(command):
    """Turn every failure into one line on stderr and exit 1; `--debug` shows the traceback instead."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except PrunetoolError as error:
            if _debugging():
                raise
            err.print(f"[bold red]error:[/] {_rank_prefix()}{error}", highlight=False, soft_wrap=True)
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(130)
        except Exception as error:  # an unexpected failure is still one line unless debugging
            if _debugging():
                raise
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            err.print(f"[bold red]error:[/] {_rank_prefix()}{type(error).__name__}: {first} (rerun with --debug for "
                      "the traceback)",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(1)

    return wrapper


def require_positive(**values: Optional[int]) -> None:
    """Reject zero and negative counts before anything slow starts."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _version(value: bool):
    if value:
        typer.echo(f"prunetool {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors (also PRUNETOOL_DEBUG=1).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
):
    """prunetool: score layers, prune them, evaluate the result."""
    if debug:
        os.environ[DEBUG_ENV] = "1"


@app.command()
@handle_errors
def models(json_out: JsonOpt = False):
    """List the built-in demo models (fetched once from PyPI wheels, converted, cached)."""
    from rich.table import Table

    from prunetool.sources import list_demo_models

    rows = list_demo_models()
    if json_out:
        typer.echo(json.dumps([{**vars(row), "path": str(row.path)} for row in rows], indent=1))
        return
    table = Table(title="Demo models (alias -> PyPI wheels)", title_justify="left")
    for column in ("alias", "layers", "download", "cached", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.name, str(row.num_layers), f"{row.download_bytes / 1e6:.0f} MB",
                      f"yes ({row.path})" if row.cached else "no", row.description)
    out.print(table)


def placement_for(device_map, max_memory, offload_dir, low_memory: bool = False):
    """--device-map/--max-memory/--offload-dir as one placement; refused beside --low-memory."""
    from prunetool.model.placement import placement_from_options

    placement = placement_from_options(device_map, max_memory, offload_dir)
    if placement is not None and low_memory:
        raise OptionError("--low-memory never loads the model; --device-map places a loaded one: choose one")
    return placement


def check_output_file(path: Optional[Path], flag: str) -> None:
    """A results file must not be a folder: refused before any slow work."""
    if path is not None and path.is_dir():
        raise OptionError(f"{flag} {path} is a folder; give a file name such as results.json")


def check_plot(plot: Optional[Path]) -> None:
    if plot is not None:
        from prunetool.output.plots import check_plot_path

        check_plot_path(plot)


# score's own options
ScoreDropOpt = Annotated[Optional[int], typer.Option("--drop", help="Mark the N lowest-ranked layers, where a default "
                         "prune starts its search (default: a quarter).")]
ScoreOutputOpt = Annotated[Optional[Path], typer.Option("--output-file", help="Write the scores JSON to this file.")]


@app.command()
@handle_errors
def score(
    model: ModelArg = None,
    calib: CalibOpt = None,
    seq_len: SeqLenOpt = 512,
    stride: StrideOpt = None,
    samples: SamplesOpt = 16,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadOpt = None,
    batch_size: BatchOpt = 1,
    drop: ScoreDropOpt = None,
    low_memory: LowMemoryOpt = False,
    output_file: ScoreOutputOpt = None,
    old_output: OldOutputOpt = None,
    plot: PlotOpt = None,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Score every layer (and head) by query self-similarity and its peers on calibration text."""
    require_positive(seq_len=seq_len, stride=stride, samples=samples, batch_size=batch_size, drop=drop)
    output = one_of("--output-file", output_file, "--output", old_output)
    check_output_file(output, "--output-file")
    check_plot(plot)
    from prunetool.commands.score import run_score

    placement = placement_for(device_map, max_memory, offload_dir, low_memory)
    started = time.perf_counter()
    scores, timings = run_score(
        model, calib=calib, seq_len=seq_len, stride=stride, samples=samples, dtype=dtype, device=device,
        batch_size=batch_size, trust_remote_code=trust_remote_code, console=err, low_memory=low_memory, drop=drop,
        placement=placement,
    )
    show_scores(scores, drop, output, plot, json_out)
    timings["total"] = time.perf_counter() - started
    err.print("time: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items()), highlight=False)
    for what, path in (("scores", output), ("plot", plot)):
        if path:
            err.print(f"{what} written to {path}", highlight=False)


def show_scores(scores, drop: Optional[int], output: Optional[Path], plot: Optional[Path], json_out: bool) -> None:
    """Write, plot and print the scores, the lowest-ranked layers marked."""
    from prunetool.checkpoint_io import write_json_atomic
    from prunetool.output.report import scores_table
    from prunetool.select.ranking import GUIDED_BETA, default_drop_count, guided_importance, lowest

    data = scores.to_json()
    importance = guided_importance(scores.column("block_influence"), scores.column("q_similarity"))
    count = drop or default_drop_count(scores.num_layers)
    marked = lowest(importance, count)
    if output:
        write_json_atomic(output, data)
    if plot is not None:
        from prunetool.output.plots import plot_layer_scores

        plot_layer_scores(data, plot, removed=marked, title=f"{scores.model}: the {count} lowest-ranked layers marked",
                          band_label="marked: lowest-ranked by the scores")
    if json_out:
        typer.echo(json.dumps(data))
        return
    out.print(scores_table(scores, set(marked), importance))
    calibration = scores.calibration
    out.print(f"calibration: {calibration['source']} (sha256 {calibration['sha256'][:12]}…), "
              f"{calibration['windows']} windows x {calibration['seq_len']} tokens, stride {calibration['stride']}",
              highlight=False, soft_wrap=True)
    out.print(f"marked: the {count} lowest-ranked layers (rank(BI) + {GUIDED_BETA} * (1 - rank(q-sim))), what the scores "
              f"predict; `prunetool prune --drop {count}` measures candidate cuts instead and may choose others",
              highlight=False, soft_wrap=True)


# prune's own options
DropOpt = Annotated[Optional[int], typer.Option("--drop", help="Remove this many layers (or sublayers of --unit), "
                    "chosen by --criterion.")]
UnitOpt = Annotated[Optional[str], typer.Option("--unit", help="What goes: block (whole decoder layers; the default "
                    "for --drop and --remove-layers), attention (only the self-attention sublayers, and with them "
                    "their KV cache) or mlp; sublayer cuts are written as a nemotron-nas (DeciLM) checkpoint "
                    "(docs/pruning.md). With --target: the only kind the search may remove (default: all three).")]
TargetOpt = Annotated[Optional[str], typer.Option("--target", help="A budget instead of a count: any of params=0.85 "
                      "or params=110M, kv=0.75 or kv=16KiB (per token), memory=2GiB@ctx=4096,batch=8, decode=1.2x, "
                      "prefill=1.3x (speed on this device). Finds the mixed cut of blocks, attention and MLP "
                      "sublayers with the least calibration damage that meets all of them.")]
ParetoOpt = Annotated[Optional[Path], typer.Option("--pareto", help="With --target: write the quality-cost frontier "
                      "(about 8 cuts each of mixed, block-only and attention-only along the first target) to this "
                      "JSON; --plot FILE.png draws it.")]
RemoveLayersOpt = Annotated[Optional[str], typer.Option("--remove-layers", help="Remove exactly these layers: 0-based "
                            "original indices, e.g. 3,7,12.")]
CriterionOpt = Annotated[str, typer.Option("--criterion", help="halving (default), guided, qsim, tappa, bi, angular, "
                         "last or ppl (docs/pruning.md).")]
BetaOpt = Annotated[Optional[float], typer.Option("--beta", help="tappa and guided: weight on (1 - q-similarity), "
                    "default 0.3.")]
ShortlistOpt = Annotated[int, typer.Option("--shortlist", help="guided: layers measured per greedy round; halving: "
                         "screened layers confirmed on all windows per round.")]
RefineOpt = Annotated[int, typer.Option("--refine-windows", help="guided: calibration windows per perplexity "
                      "measurement; halving: windows a screening uses; --target: windows every candidate removal "
                      "and every neighbour of the local search is measured on.")]
BlocksOpt = Annotated[int, typer.Option("--blocks", help="guided and halving: contiguous blocks measured beside the "
                      "greedy path.")]
ScreenTokensOpt = Annotated[int, typer.Option("--screen-tokens", help="halving: tokens of each measuring window a "
                            "screening reads.")]
ScreenDtypeOpt = Annotated[str, typer.Option("--screen-dtype", help="halving: auto screens in bfloat16 where it is "
                           "native (confirmations stay in the model's dtype); model screens in the model's dtype.")]
ScoresOpt = Annotated[Optional[Path], typer.Option("--scores", help="A scores JSON from `prunetool score "
                      "--output-file`; its recorded calibration is used.")]
ProtectFirstOpt = Annotated[int, typer.Option("--protect-first", help="Never remove the first K layers.")]
ProtectLastOpt = Annotated[int, typer.Option("--protect-last", help="Never remove the last K layers.")]
PruneOutputOpt = Annotated[Optional[Path], typer.Option("--output-dir", help="Folder to write (default "
                           "./NAME-pruned-N).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show which layers would go and why; write nothing.")]
PrunePlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Also draw the per-layer scores, the removed "
                         "layers and every candidate the search measured to this PNG (needs the [plot] extra).")]
PatchOpt = Annotated[bool, typer.Option("--patch", help="Repair each removed run by refitting the down_proj of the "
                     "kept layer before it on calibration activations (closed form, no training; the checkpoint keeps "
                     "the standard architecture; docs/repair.md).")]
PatchObjectiveOpt = Annotated[Optional[str], typer.Option("--patch-objective", help="--patch fit: lstsq, cosine or "
                              "down_proj (default: down_proj, which measured best).")]
PatchWindowsOpt = Annotated[Optional[int], typer.Option("--patch-windows", help="--patch fits on the first N "
                            "calibration windows (the selection windows, then the ones after them; held-out "
                            "windows start after both). Default: 65536 tokens' worth (128 of 512).")]


@app.command()
@handle_errors
def prune(
    model: PruneModelArg = None,
    drop: DropOpt = None,
    target: TargetOpt = None,
    pareto: ParetoOpt = None,
    unit: UnitOpt = None,
    remove_layers: RemoveLayersOpt = None,
    old_layers: OldLayersOpt = None,
    criterion: CriterionOpt = "halving",
    beta: BetaOpt = None,
    shortlist: ShortlistOpt = 4,
    refine_windows: RefineOpt = 4,
    blocks: BlocksOpt = 3,
    screen_tokens: ScreenTokensOpt = 128,
    screen_dtype: ScreenDtypeOpt = "auto",
    scores: ScoresOpt = None,
    calib: CalibOpt = None,
    seq_len: SeqLenOpt = 512,
    stride: StrideOpt = None,
    samples: SamplesOpt = 16,
    protect_first: ProtectFirstOpt = 0,
    protect_last: ProtectLastOpt = 0,
    output_dir: PruneOutputOpt = None,
    old_output: OldOutputOpt = None,
    force: ForceOpt = False,
    dry_run: DryRunOpt = False,
    verify: VerifyOpt = True,
    plot: PrunePlotOpt = None,
    patch: PatchOpt = False,
    patch_objective: PatchObjectiveOpt = None,
    patch_windows: PatchWindowsOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadOpt = None,
    batch_size: BatchOpt = 1,
    low_memory: LowMemoryOpt = False,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Remove decoder layers and write a loadable safetensors checkpoint (0-based original indices throughout)."""
    require_positive(seq_len=seq_len, stride=stride, samples=samples, batch_size=batch_size, drop=drop)
    check_plot(plot)
    from prunetool.commands.prune import PruneRequest, run_prune

    if target is not None:
        from prunetool.commands.budget import run_budget
    request = PruneRequest(
        placement=placement_for(device_map, max_memory, offload_dir, low_memory), low_memory=low_memory,
        model=model, drop=drop, layers=one_of("--remove-layers", remove_layers, "--layers", old_layers),
        criterion=criterion, beta=beta, scores_file=scores, calib=calib, seq_len=seq_len, stride=stride,
        samples=samples, protect_first=protect_first, protect_last=protect_last,
        output=one_of("--output-dir", output_dir, "--output", old_output), force=force, dry_run=dry_run,
        verify=verify, dtype=dtype, device=device, batch_size=batch_size, trust_remote_code=trust_remote_code,
        shortlist=shortlist, refine_windows=refine_windows, blocks=blocks, screen_tokens=screen_tokens,
        screen_dtype=screen_dtype, patch=patch, patch_objective=patch_objective, patch_windows=patch_windows,
        unit=unit, target=target,
    )
    if pareto is not None and target is None:
        raise OptionError("--pareto draws the frontier of a --target search; add --target")
    if target is not None:  # the frontier is the plot of a budget search
        show_prune(run_budget(dataclasses.replace(request, plot=plot, pareto=pareto), err), None, json_out, dry_run,
                   verify)
        return
    show_prune(run_prune(request, err), plot, json_out, dry_run, verify)


def show_prune(result: dict, plot: Optional[Path], json_out: bool, dry_run: bool, verify: bool) -> None:
    """Plot and print what prune chose, measured and wrote."""
    from prunetool.output.report import perplexity_table, plan_table

    plan = result["plan"]
    if result.get("low_memory"):
        err.print(f"peak memory: {result['peak_rss_bytes'] / 2**30:.2f} GiB resident (layer-streamed)", highlight=False)
    if plot is not None:
        from prunetool.output.plots import plot_prune

        plot_prune(result["scores"], plan, plot)
        err.print(f"plot written to {plot}", highlight=False)
    if json_out:
        typer.echo(json.dumps({key: value for key, value in result.items() if key != "scores"}))
        return
    if result.get("budget"):
        from prunetool.output.report import budget_table

        out.print(budget_table(result["budget"], plan))
    if dry_run:
        if not result.get("budget"):
            out.print(plan_table(plan))
        out.print("dry run: nothing written", highlight=False)
        return
    if result["perplexity"]:
        out.print(perplexity_table(result["perplexity"], plan["num_layers"], len(plan["kept"])))
    checked = "not verified"
    if verify:
        checks = result["verification"]
        what = ("layer count, perplexity read layer by layer" if checks.get("low_memory")
                else "reload, layer count, cached = uncached decoding, perplexity")
        checked = f"verified in {checks['dtype']} on {checks['device']} ({what} within {checks['perplexity_rtol']:g})"
    unit = plan.get("unit", "block")
    what = ("layers " + str(plan["removed"]) if unit == "block" else
            f"the {unit} sublayers of layers {plan['removed']}" if unit in ("attention", "mlp") else
            plan["cut"]["describe"])
    out.print(f"wrote {result['output']}: removed {what} (0-based original indices); {checked}",
              highlight=False, soft_wrap=True)


# heal's own options
HealModelArg = Annotated[Optional[str], typer.Argument(help="A folder written by `prunetool prune`; default: the "
                         "current run's pruned model.", show_default=False)]
TokensOpt = Annotated[int, typer.Option("--tokens", help="Training budget in tokens (rounded up to whole steps of "
                      "batch-size x grad-accum windows).")]
EpochsOpt = Annotated[int, typer.Option("--epochs", help="Passes over the training text: the budget reads "
                      "tokens / epochs of text, each later pass in a new order.")]
TrainOpt = Annotated[str, typer.Option("--train", help="What trains: lora (adapters on every attention and MLP "
                     "projection, merged back), adjacent (the kept layers next to each cut) or all.")]
TeacherOpt = Annotated[Optional[str], typer.Option("--teacher", help="The model to distil from (default: the base "
                       "prune.json names); must have the student's tokenizer.")]
HealCalibOpt = Annotated[Optional[str], typer.Option("--calib", help="Train on this text instead (same forms as "
                         "score's --calib); default: prune's calibration text after its held-out windows.")]
GradAccumOpt = Annotated[int, typer.Option("--grad-accum", help="Micro-batches per optimizer step.")]
LrOpt = Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate (default 1e-3 for lora, 2e-5 "
                  "otherwise: LoRA's zero-initialised adapters need larger steps, full weights drift with them).")]
LoraRankOpt = Annotated[int, typer.Option("--lora-rank", help="LoRA rank r (alpha = 2r).")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="Softmax temperature of the KL term (scaled "
                           "by T^2).")]
CeWeightOpt = Annotated[float, typer.Option("--ce-weight", help="a in (1-a) KL + a CE on the next token (0: pure "
                        "distillation; 0.5 did best in docs/repair.md).")]
SaveEveryOpt = Annotated[Optional[int], typer.Option("--save-every", help="Write a resumable checkpoint every N "
                         "optimizer steps (to OUTPUT.checkpoint).")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint (same options).")]
HealOutputOpt = Annotated[Optional[Path], typer.Option("--output-dir", help="Folder to write (default "
                          "./NAME-healed).")]
HealDtypeOpt = Annotated[str, typer.Option("--dtype", help="Teacher and verification dtype: auto (float32 on CPU, "
                         "bfloat16 on GPU), float32, bfloat16, float16. With bfloat16 the student keeps float32 "
                         "weights and trains under bf16 autocast (2.5x faster on CPUs with AMX).")]
ReportToOpt = Annotated[Optional[str], typer.Option("--report-to", help="Log loss and learning rate to an "
                        "accelerate tracker: tensorboard or wandb (default: none).")]


@app.command()
@handle_errors
def heal(
    model: HealModelArg = None,
    tokens: TokensOpt = 100_000,
    epochs: EpochsOpt = 1,
    train: TrainOpt = "lora",
    teacher: TeacherOpt = None,
    calib: HealCalibOpt = None,
    seq_len: SeqLenOpt = 256,
    batch_size: BatchOpt = 4,
    grad_accum: GradAccumOpt = 1,
    lr: LrOpt = None,
    lora_rank: LoraRankOpt = 8,
    temperature: TemperatureOpt = 1.0,
    ce_weight: CeWeightOpt = 0.5,
    save_every: SaveEveryOpt = None,
    resume: ResumeOpt = False,
    output_dir: HealOutputOpt = None,
    force: ForceOpt = False,
    verify: VerifyOpt = True,
    dtype: HealDtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadOpt = None,
    report_to: ReportToOpt = None,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Heal a pruned model by distilling its base's next-token distributions into it (forward KL).

    Runs as one process, or data parallel under `accelerate launch -m prunetool heal` or `torchrun`."""
    from prunetool.commands.heal import HealRequest, run_heal

    request = HealRequest(placement=placement_for(device_map, max_memory, offload_dir),
                          model=model, teacher=teacher, calib=calib, tokens=tokens, epochs=epochs, seq_len=seq_len,
                          train=train, lora_rank=lora_rank, lr=lr, batch_size=batch_size, grad_accum=grad_accum,
                          temperature=temperature, ce_weight=ce_weight, save_every=save_every, resume=resume,
                          output=output_dir, force=force, verify=verify, dtype=dtype, device=device,
                          trust_remote_code=trust_remote_code, report_to=report_to)
    result = run_heal(request, err)
    if result["output"] is None:  # a rank other than the main one: the main one prints
        return
    heal = result["heal"]
    if json_out:
        typer.echo(json.dumps({"output": result["output"], "heal": heal, "verification": result["verification"]}))
        return
    ppl = heal["perplexity"]
    out.print(f"wrote {result['output']}: {heal['train']} on {heal['tokens']} tokens in {heal['steps']} steps "
              f"({heal['tokens_per_second']:.0f} tokens/s); held-out perplexity {ppl['before']:.3f} -> {ppl['after']:.3f}"
              f"; loss {heal['loss_summary']['first']:.4f} -> {heal['loss_summary']['last']:.4f}"
              + ("; verified" if result["verification"] else "; not verified"), highlight=False, soft_wrap=True)


# heads' own options
OnlyLayersOpt = Annotated[Optional[str], typer.Option("--only-layers", help="Analyse only these layers: 0-based "
                          "indices, e.g. 0,5,12 (default: all).")]
HeadsSamplesOpt = Annotated[int, typer.Option("--samples", help="Number of calibration windows.")]
HeadsKvBudgetOpt = Annotated[Optional[int], typer.Option("--kv-budget", help="Also write per-layer KV-cache budgets "
                             "averaging this many tokens per layer: more where post-RoPE queries differ (TAPPA's rule).")]
HeadsOutputOpt = Annotated[Optional[Path], typer.Option("--output-dir", help="Folder for heads.json, report.html "
                           "with attention heatmaps, and kv_budget.json.")]


@app.command()
@handle_errors
def heads(
    model: HeadsModelArg = None,
    calib: CalibOpt = None,
    only_layers: OnlyLayersOpt = None,
    old_layers: OldLayersOpt = None,
    samples: HeadsSamplesOpt = 4,
    seq_len: SeqLenOpt = 512,
    kv_budget: HeadsKvBudgetOpt = None,
    output_dir: HeadsOutputOpt = None,
    old_output: OldOutputOpt = None,
    force: ForceOpt = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadOpt = None,
    low_memory: LowMemoryOpt = False,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Explain layers head by head: attention pattern types, RoPE periods, positional vs symbolic heads, KV budgets."""
    require_positive(samples=samples, seq_len=seq_len, kv_budget=kv_budget)
    if seq_len < 16:
        raise OptionError(f"--seq-len {seq_len} is too short to tell attention patterns apart; use at least 16 tokens")
    output = one_of("--output-dir", output_dir, "--output", old_output)
    layers = one_of("--only-layers", only_layers, "--layers", old_layers)
    if output is not None:
        from prunetool.checkpoint_io import check_free_folder

        check_free_folder(output, force)
    from prunetool.commands.heads import run_heads
    from prunetool.output.report import heads_summary, heads_table

    placement = placement_for(device_map, max_memory, offload_dir, low_memory)
    started = time.perf_counter()
    report = run_heads(model, calib=calib, seq_len=seq_len, samples=samples, layers=layers, kv_budget=kv_budget,
                       dtype=dtype, device=device, trust_remote_code=trust_remote_code, console=err,
                       placement=placement, low_memory=low_memory)
    if output is not None:
        from prunetool.heads.publish import publish_report

        publish_report(output, report, force)
    if json_out:
        typer.echo(json.dumps(report.data))
    else:
        out.print(heads_table(report.data))
        for line in heads_summary(report.data):
            out.print(line, highlight=False, soft_wrap=True)
    err.print(f"time: {time.perf_counter() - started:.1f}s" + (f"; report written to {output}" if output else ""),
              highlight=False)


# eval's own options
EvalModelsArg = Annotated[Optional[list[str]], typer.Argument(help="Models to evaluate (folders, hub ids, demo "
                          "aliases); default: the current run's pruned model and its base.", show_default=False)]
TasksOpt = Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated: wikitext, lambada_openai, "
                     "arc_easy, arc_challenge, piqa, winogrande (local with --data-dir), hop_number, hop_name (or e.g. "
                     "hop_name_512), heldout_ppl, needle, multikey (or e.g. needle_2048), or any lm-eval task (online).")]
DataDirOpt = Annotated[Optional[Path], typer.Option("--data-dir", help="Folder with the local evaluation files "
                       "(also PRUNETOOL_DATA_DIR); see docs/evaluation.md.")]
LimitOpt = Annotated[Optional[int], typer.Option("--limit", help="First N documents per task (hop probes: N per "
                     "length).")]
FewshotOpt = Annotated[Optional[int], typer.Option("--num-fewshot", help="Few-shot examples for lm-eval tasks "
                       "(hop probes carry their own four).")]
EvalBatchOpt = Annotated[str, typer.Option("--batch-size", help="Requests per forward pass, or auto (on the CPU: "
                         "what fits 4 GiB of logits at --max-length).")]
MaxLengthOpt = Annotated[Optional[int], typer.Option("--max-length", help="Tokens per forward pass (default: "
                         "2048, or the model's context if shorter).")]
BackendOpt = Annotated[str, typer.Option("--backend", help="hf (transformers, in this process) or vllm (lm-eval "
                       "tasks through vLLM, which loads each checkpoint itself: vllm installed here, else vLLM's CPU "
                       "build from `make engines` served in a separate process, which also measures the efficiency "
                       "columns).")]
TensorParallelOpt = Annotated[int, typer.Option("--tensor-parallel", help="vllm: GPUs per model replica.")]
DataParallelOpt = Annotated[int, typer.Option("--data-parallel", help="vllm: model replicas (for hf, run lm-eval "
                            "under `accelerate launch`: docs/evaluation.md).")]
EvalKvBudgetOpt = Annotated[Optional[list[str]], typer.Option("--kv-budget", help="Also run the long-context tasks "
                            "(default needle_1024, multikey_1024, hop_number_512, hop_name_512) on a compressed KV "
                            "cache: uniform:B, pyramid:B, tappa:B, tappa-floor:B, tappa-cake:B (B tokens per layer on "
                            "average) or a JSON file of per-layer budgets (heads --kv-budget writes one); repeat to "
                            "compare.")]
EfficiencyOpt = Annotated[bool, typer.Option("--efficiency/--no-efficiency", help="Also measure each model's "
                          "parameters, KV-cache bytes per token, prefill and decode tokens/s and peak memory (hf "
                          "backend, batch 1, median of 3).")]
KvWindowOpt = Annotated[int, typer.Option("--kv-window", help="Prompt tokens at the end whose attention ranks what "
                        "the cache keeps (SnapKV's observation window).")]
EvalOutputOpt = Annotated[Optional[Path], typer.Option("--output-file", help="Write lm-eval's results for each model "
                          "plus a prunetool section to this JSON file.")]


@app.command("eval")
@handle_errors
def evaluate(
    models: EvalModelsArg = None,
    tasks: TasksOpt = None,
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    num_fewshot: FewshotOpt = None,
    calib: CalibOpt = None,
    seq_len: SeqLenOpt = 512,
    samples: SamplesOpt = 16,
    batch_size: EvalBatchOpt = "auto",
    max_length: MaxLengthOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadOpt = None,
    backend: BackendOpt = "hf",
    tensor_parallel: TensorParallelOpt = 1,
    data_parallel: DataParallelOpt = 1,
    kv_budget: EvalKvBudgetOpt = None,
    kv_window: KvWindowOpt = 32,
    efficiency: EfficiencyOpt = True,
    output_file: EvalOutputOpt = None,
    old_output: OldOutputOpt = None,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Run lm-eval (offline on local data), hop probes and long-context tasks; the pruned model beside its base.

    --kv-budget runs the long-context tasks on SnapKV-style compressed KV caches, one row per schedule
    beside the full cache (docs/kv.md).

    heldout_ppl uses the windows prune held out (after its selection windows, never overlapping them) when
    MODEL is omitted, else the windows after --samples windows of --calib/--seq-len.
    """
    require_positive(seq_len=seq_len, samples=samples)
    output = one_of("--output-file", output_file, "--output", old_output)
    check_output_file(output, "--output-file")
    from prunetool.commands.eval import EvalRequest, jsonable, run_eval

    calibration = {"calib": calib, "seq_len": seq_len, "stride": seq_len, "samples": samples}
    request = EvalRequest(models=list(models or []), tasks=tasks, data_dir=data_dir, limit=limit,
                          num_fewshot=num_fewshot, batch_size=batch_size, max_length=max_length,
                          calibration=calibration, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                          backend=backend, tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                          placement=placement_for(device_map, max_memory, offload_dir),
                          kv_budgets=tuple(kv_budget or ()), kv_window=kv_window, efficiency=efficiency)
    show_eval(jsonable(run_eval(request, err)), output, json_out)


def show_eval(report: dict, output: Optional[Path], json_out: bool) -> None:
    """Write and print eval's report: the task table, hop probes and long-context rows."""
    from prunetool.checkpoint_io import write_json_atomic
    from prunetool.output.report import efficiency_table, eval_rows, eval_table, hop_table, long_context_table

    if output is not None:
        write_json_atomic(output, report)
    if json_out:
        typer.echo(json.dumps(report))
    else:
        if eval_rows(report):
            out.print(eval_table(report))
        for extra in (hop_table(report), long_context_table(report), efficiency_table(report)):
            if extra is not None:
                out.print(extra)
    err.print(f"time: {report['prunetool']['seconds']:.1f}s" + (f"; results written to {output}" if output else ""),
              highlight=False)


# export's own options
ExportFolderArg = Annotated[Path, typer.Argument(help="A folder prune or heal wrote: a block cut (Llama, Mistral, "
                            "Qwen2, Qwen3, Gemma 3) or a nemotron-nas sublayer cut.", show_default=False)]
GgufOpt = Annotated[Optional[Path], typer.Option("--gguf", help="Write one GGUF file for llama.cpp here (atomically: "
                    "a temporary file beside it, then a rename).")]
GgufTypeOpt = Annotated[str, typer.Option("--type", help="Tensor storage: f32, f16, bf16 or q8_0. Norms, biases "
                        "and vectors stay f32; q8_0 tensors whose rows are not a multiple of 32 values are f16.")]
ExportForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --gguf file.")]


@app.command()
@handle_errors
def export(
    folder: ExportFolderArg,
    gguf: GgufOpt = None,
    gguf_type: GgufTypeOpt = "f32",
    force: ExportForceOpt = False,
    json_out: JsonOpt = False,
):
    """Write a pruned or healed folder as a GGUF file that llama.cpp runs (docs/serving.md)."""
    from prunetool.commands.export import run_export, summary_line

    started = time.perf_counter()
    result = run_export(folder, gguf=gguf, type_name=gguf_type, force=force, console=err)
    if json_out:
        typer.echo(json.dumps(result))
    else:
        out.print(summary_line(result), highlight=False, soft_wrap=True)
    err.print(f"time: {time.perf_counter() - started:.1f}s", highlight=False)


def main() -> None:
    """Console entry point; `--debug` is accepted anywhere on the line."""
    argv = sys.argv[1:]
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
        argv = [arg for arg in argv if arg != "--debug"]
    app(args=argv, prog_name="prunetool")
