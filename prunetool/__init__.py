"""prunetool: remove whole decoder layers from LLMs and explain why they could go."""

__version__ = "0.1.0"
