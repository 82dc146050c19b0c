"""Configuration of a nemotron-nas (DeciLM) checkpoint: a Llama configuration plus one block config per layer.

Written by the prunetool authors from the format's description. This file is copied into every folder
`prunetool prune --unit attention|mlp` writes and is loaded with `trust_remote_code=True`; it imports only
transformers.

Each entry of `block_configs` says what one decoder layer holds:
    {"attention": {"no_op": bool, "replace_with_linear": false, "n_heads_in_group": int},
     "ffn": {"no_op": bool, "replace_with_linear": false, "ffn_mult": float}}
`n_heads_in_group` is query heads per key/value head (num_attention_heads // num_key_value_heads), and
`ffn_mult` gives the MLP width as 256-multiple-rounded int(2 * ffn_mult * hidden_size / 3); where no
ffn_mult reproduces a width, `intermediate_size` is written instead, which vLLM also reads. Entries are
exposed with attribute access (`block.attention.no_op`), as serving engines read them.
"""

from transformers import LlamaConfig


class BlockSection:
    """One sublayer's settings with attribute access; only the keys the file holds exist as attributes."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"BlockSection({self.__dict__})"


class BlockConfig:
    """What one decoder layer holds: its attention and its feed-forward section."""

    def __init__(self, attention=None, ffn=None, **extra):
        self.attention = attention if isinstance(attention, BlockSection) else BlockSection(**(attention or {}))
        self.ffn = ffn if isinstance(ffn, BlockSection) else BlockSection(**(ffn or {}))
        self.__dict__.update(extra)

    @classmethod
    def of(cls, value) -> "BlockConfig":
        return value if isinstance(value, cls) else cls(**value)

    def to_dict(self) -> dict:
        return {key: value.to_dict() if isinstance(value, BlockSection) else value
                for key, value in self.__dict__.items()}


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        self.block_configs = [BlockConfig.of(block) for block in (block_configs or [])]
        super().__init__(**kwargs)

    def to_dict(self) -> dict:
        output = super().to_dict()
        output["block_configs"] = [block.to_dict() for block in self.block_configs]
        return output
