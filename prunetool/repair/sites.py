"""Where each removed run's patch goes, decided from the model's structure before any calibration pass.

A run [a, b] of removed layers is patched in one of these ways (`PatchSite.kind`):
- "down_proj": layer a-1's output is Y + mlp(...), so the map folds exactly into its mlp.down_proj
  (Llama, Mistral, Qwen2/3, Phi-3; Phi-3's fused gate_up_proj is untouched);
- "norm": layer a-1 normalises the MLP output before adding it (Gemma 2/3 `post_feedforward_layernorm`),
  so no linear map folds exactly; its down_proj is fitted through the fixed norm instead;
- "embedding": the run starts at layer 0, so the map folds into the token embeddings (E' = E T), which
  is exact because the decoder only scales them (Gemma) before layer 0;
- "skip": no standard-checkpoint fold exists (tied input/output embeddings, no down_proj); the reason
  is recorded in prune.json and printed on stderr, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from prunetool.model.architecture import decoder_of

# Norms applied to the MLP output before the residual add, by attribute name on the decoder layer.
POST_MLP_NORMS = ("post_feedforward_layernorm",)


@dataclass(frozen=True)
class PatchSite:
    """One contiguous run of removed layers and how its patch is applied."""

    first: int  # a: first removed layer (original index)
    last: int  # b: last removed layer
    kind: str  # "down_proj" | "norm" | "embedding" | "skip"
    layer: int | None = None  # a-1, the kept layer that absorbs the patch ("down_proj", "norm")
    tensors: tuple[str, ...] = ()  # decoder-relative names of the tensors that change
    reason: str | None = None  # "skip" only
    final: bool = False  # b is the last layer: the target is the input of the final norm

    @property
    def layers(self) -> list[int]:
        return [self.first, self.last]


def contiguous_runs(removed) -> list[tuple[int, int]]:
    """Sorted removed indices -> [(a, b), ...], each a maximal run of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for index in sorted(removed):
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def _relative_name(root: nn.Module, target: nn.Module) -> str | None:
    for name, module in root.named_modules():
        if module is target:
            return name
    return None


def embeddings_tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def plan_sites(model: nn.Module, removed) -> list[PatchSite]:
    """One PatchSite per contiguous run of `removed` (original 0-based indices of `model`'s layers)."""
    decoder = decoder_of(model)
    num_layers = len(decoder.layers)
    has_final_norm = isinstance(getattr(decoder, "norm", None), nn.Module)
    sites = []
    for first, last in contiguous_runs(removed):
        final = last == num_layers - 1
        if final and not has_final_norm:
            sites.append(PatchSite(first, last, "skip", final=True,
                                   reason="the decoder has no final `norm` whose input would be the target"))
            continue
        if first == 0:
            sites.append(_embedding_site(model, decoder, first, last, final))
            continue
        layer = decoder.layers[first - 1]
        down = getattr(getattr(layer, "mlp", None), "down_proj", None)
        if not isinstance(down, nn.Linear):
            sites.append(PatchSite(first, last, "skip", first - 1, final=final,
                                   reason=f"layer {first - 1} has no mlp.down_proj linear layer to fold into"))
            continue
        prefix = f"layers.{first - 1}.mlp.down_proj."
        norm = next((name for name in POST_MLP_NORMS if isinstance(getattr(layer, name, None), nn.Module)), None)
        if norm is not None and down.bias is not None:
            sites.append(PatchSite(first, last, "skip", first - 1, final=final,
                                   reason=f"layer {first - 1} has a biased down_proj before {norm}"))
            continue
        tensors = (prefix + "weight",) + ((prefix + "bias",) if down.bias is not None and norm is None else ())
        sites.append(PatchSite(first, last, "norm" if norm else "down_proj", first - 1, tensors, final=final))
    return sites


def _embedding_site(model, decoder, first: int, last: int, final: bool) -> PatchSite:
    embedding = model.get_input_embeddings()
    name = _relative_name(decoder, embedding) if embedding is not None else None
    if name is None or not isinstance(getattr(embedding, "weight", None), nn.Parameter):
        return PatchSite(first, last, "skip", final=final,
                         reason="the run starts at layer 0 and the decoder's token embedding was not found")
    if embeddings_tied(model):
        return PatchSite(first, last, "skip", final=final, reason=(
            "the run starts at layer 0, where the only fold is into the token embeddings (E' = E T), but they "
            "are tied to lm_head, so changing them would change the output head as well"))
    return PatchSite(first, last, "embedding", tensors=(f"{name}.weight",), final=final)


def post_mlp_norm(layer: nn.Module) -> nn.Module | None:
    return next((getattr(layer, name) for name in POST_MLP_NORMS
                 if isinstance(getattr(layer, name, None), nn.Module)), None)


def norm_name(layer: nn.Module) -> str | None:
    return next((name for name in POST_MLP_NORMS if isinstance(getattr(layer, name, None), nn.Module)), None)


def runner_sites(runner, removed) -> list[PatchSite]:
    """plan_sites for a ModelRunner: where its embedding holds only the calibration rows (prune --low-memory),
    a run from layer 0 is recorded as not patched, since folding into the embedding needs the whole table."""
    sites = plan_sites(runner.model, removed)
    if runner.holds_embedding_table:
        return sites
    return [PatchSite(site.first, site.last, "skip", final=site.final,
                      reason="a run from layer 0 is not patched with --low-memory (the fold needs the whole "
                             "embedding table in memory)")
            if site.kind == "embedding" else site for site in sites]
