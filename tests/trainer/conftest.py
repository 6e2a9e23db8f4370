"""Fixtures for the trainer and inference tests: one tiny random model built locally per session, and that
same model loaded directly with transformers as the reference the engine is checked against."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from trainer.models import build_tiny_model


class Reference:
    """The model run directly, one unpadded sequence at a time, with no cache: what the engine must match."""

    def __init__(self, path: Path) -> None:
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True
        ).eval()
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True
        )

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits after each position of `token_ids`, float32 [len, vocab]."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([list(token_ids)]))
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def greedy(self, prompt: Sequence[int], count: int) -> list[int]:
        """The plain argmax loop: `count` tokens, each from a full forward pass over everything before it."""
        ids = list(prompt)
        for _ in range(count):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt) :]

    def assert_same_greedy(self, prompt: Sequence[int], got: Sequence[int], want: Sequence[int]) -> None:
        """`got` equals `want`, except that the two may part where the model's two best next tokens are a
        near-tie (float noise from batching and padding may then tip either way); after that nothing is
        compared."""
        for i, (a, b) in enumerate(zip(got, want, strict=False)):
            if a != b:
                logits = self.logits([*prompt, *want[:i]])[-1]
                gap = abs(float(logits[a] - logits[b]))
                assert gap < 1e-3, f"greedy outputs part at token {i} ({a} vs {b}) with a logit gap of {gap}"
                return
        assert len(got) == len(want)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (Llama architecture, ~1M parameters, tied embeddings, context 512)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Reference:
    return Reference(tiny_model)
