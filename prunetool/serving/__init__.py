"""Serving engines (vLLM, llama.cpp): where `make engines` put them, and how prunetool drives them."""
