"""A stand-in model that answers instantly, so a run measures the engine's own CPU work per step."""
from __future__ import annotations

import torch

from backend.models.random_model import byte_tokenizer
from backend.models.spec import ModelSpec
from backend.ops import get_ops

STAND_IN = "stand-in"  # the model setting that picks it


class StandInModel(torch.nn.Module):
    """Next token = (input token + 1) mod vocab; no weights, no attention, almost no device work."""

    def __init__(self, vocab_size: int = 512, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.spec = ModelSpec(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, hidden_size=1,
                              intermediate_size=1, vocab_size=vocab_size, max_position_embeddings=1 << 20,
                              eos_token_ids=(), dtype=torch.float32, model_type="stand-in")
        self._ramp = torch.arange(vocab_size, dtype=torch.float32, device=device)  # (V,)
        self.ops = get_ops("torch")  # the decode graph's greedy pick

    def forward(self, input_ids, positions, kv_cache, meta, ops=None):
        return input_ids.to(torch.float32).unsqueeze(1)  # (T, 1): the input token, as the "hidden state"

    def compute_logits(self, hidden, out=None, ops=None):
        nxt = torch.remainder(hidden + 1, self.spec.vocab_size)  # (N, 1)
        logits = -(self._ramp.unsqueeze(0) - nxt).abs()  # (N, V): the maximum sits at the next token
        return logits if out is None else out.copy_(logits)


def expected_tokens(prompt: list[int], n: int, vocab_size: int) -> list[int]:
    """What the stand-in model generates for prompt: a ramp from its last token."""
    return [(prompt[-1] + i + 1) % vocab_size for i in range(n)]


def stand_in_model(device: torch.device) -> tuple[StandInModel, object]:
    """The stand-in model and a byte-level tokenizer for it."""
    return StandInModel(device=device), byte_tokenizer()
