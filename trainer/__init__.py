"""Trainer and inference workers: the only part of Tandem that imports torch, transformers or vLLM.

The GRPO loop, the inference engines (torch on CPU, vLLM on GPU), weight sync and checkpoints land here
with the inference and trainer work; see trainer/README.md for their contracts.
"""
