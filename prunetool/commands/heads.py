"""`prunetool heads`: model (eager attention) -> calibration -> per-head evidence -> analysis and KV budgets."""

from rich.console import Console

from prunetool.select.calibration import load_calibration
from prunetool.progress import window_progress
from prunetool.output.runs import current_model
from prunetool.sources import model_key, resolve_model


def sliding_layers(config, num_layers: int) -> list[bool]:
    """Which layers attend through a sliding window: `layer_types` where the config lists them (Gemma, Qwen2),
    else every layer when `sliding_window` is set (Mistral and Phi-3 pass it to every layer's attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [bool(window)] * num_layers
    return [kind == "sliding_attention" and bool(window) for kind in types]


def layer_caps(config, seq_len: int, num_layers: int) -> list[int]:
    """Tokens each layer can attend to: the window length, or less for a sliding-window layer."""
    window = getattr(config, "sliding_window", None)
    return [min(seq_len, window) if sliding else seq_len for sliding in sliding_layers(config, num_layers)]


def check_early(source, layers, kv_budget, seq_len: int, trust_remote_code: bool) -> None:
    """--only-layers and --kv-budget against the config alone, before minutes of loading."""
    from transformers import AutoConfig

    from prunetool.heads.budget import check_kv_budget
    from prunetool.select.selection import parse_layers

    from prunetool.sources.checks import ships_our_code

    trusted = trust_remote_code or ships_our_code(source.path)
    text_config = AutoConfig.from_pretrained(source.path, trust_remote_code=trusted).get_text_config(decoder=True)
    num_layers = text_config.num_hidden_layers
    if layers:
        parse_layers(layers, num_layers, allow_all=True, flag="--only-layers")
    if kv_budget is not None:
        check_kv_budget(kv_budget, layer_caps(text_config, seq_len, num_layers))


def run_heads(spec, *, calib, seq_len, samples, layers, kv_budget, dtype, device, trust_remote_code,
              console: Console, placement=None, low_memory: bool = False):
    """Probe every analysed layer's heads on calibration windows (eager attention) and build the report.

    MODEL defaults to the current run's model, else the default demo model. `low_memory` never loads the
    model: each decoder layer is read from the checkpoint when it runs (streaming.py), also for the swap
    test's reruns, so the profiles are the loaded model's.
    """
    from prunetool.commands.score import warn_if_untested
    from prunetool.heads.analysis import analyse
    from prunetool.heads.budget import check_kv_budget
    from prunetool.heads.probe import probe_heads
    from prunetool.model.loading import load_model
    from prunetool.select.selection import parse_layers

    source = resolve_model(spec if spec is not None else current_model(), trust_remote_code=trust_remote_code)
    check_early(source, layers, kv_budget, seq_len, trust_remote_code)

    def calibrate(tokenizer, model):
        return load_calibration(calib, tokenizer, seq_len=seq_len, stride=seq_len, samples=samples, model=model,
                                model_key=model_key(source))

    from prunetool.memory import use_low_memory

    low_memory = use_low_memory(low_memory, placement, source.path, console)
    if low_memory:
        from prunetool.model.loading import pick_device, pick_dtype
        from prunetool.sources.tokenizer import FileTokenizer
        from prunetool.model.streaming import build_streamed

        calibration = calibrate(FileTokenizer(source.path), None)
        target = pick_device(device)
        streamed = build_streamed(source, calibration.input_ids, dtype=pick_dtype(dtype, target), device=target,
                                  attn_implementation="eager")
        model, windows = streamed.model, streamed.remapped_ids
    else:
        model, tokenizer = load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                      attn_implementation="eager", placement=placement)
    layout = warn_if_untested(model, console)
    selected = parse_layers(layers, layout.num_layers, allow_all=True, flag="--only-layers") if layers else tuple(range(layout.num_layers))
    text_config = model.config.get_text_config(decoder=True)
    caps = layer_caps(text_config, seq_len, layout.num_layers)
    full_attention = [not sliding for sliding in sliding_layers(text_config, layout.num_layers)]
    if kv_budget is not None:
        check_kv_budget(kv_budget, caps)
    if not low_memory:  # after the checks above: generating calibration text can take minutes
        calibration = calibrate(tokenizer, model)
        windows = calibration.input_ids
    with window_progress(console) as progress:
        task = progress.add_task("probing heads", total=calibration.windows)
        evidence = probe_heads(model, windows, selected, on_window=lambda: progress.advance(task))
    return analyse(evidence, model=source.spec, calibration=calibration.describe(), kv_budget=kv_budget, caps=caps,
                   full_attention=full_attention)
