"""The models of the packaged recipes: small enough to train in seconds on a CPU.

Every model leaves padded samples (``batch["is_padding"]``) out of its loss.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from typing_extensions import override


def _real(batch: dict[str, torch.Tensor], per_sample: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_sample`` (shape ``(B,)``) over the samples that are not padding."""
    padding = batch.get("is_padding")
    if padding is None or bool(padding.all()):
        return per_sample.mean()
    return per_sample[~padding].mean()


class Regressor(pl.LightningModule):
    """A two-layer MLP for the regression samples ``{"x": (B, dim), "y": (B,)}``."""

    def __init__(self, dim: int, hidden: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean squared error of the prediction of ``y`` from ``x``."""
        error = (self.net(batch["x"].float()).squeeze(-1) - batch["y"].float()) ** 2
        loss = _real(batch, error)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=self.hparams["learning_rate"])


class Forecaster(pl.LightningModule):
    """Predict step ``T`` of a window from its first ``T - 1`` steps: ``x (B, T-1, V) -> y (B, V)``."""

    def __init__(self, window: int, variables: int, hidden: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        inputs = (window - 1) * variables
        self.net = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, variables)
        )

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean squared error of the forecast, over variables, then over real samples."""
        error = ((self.net(batch["x"].flatten(1)) - batch["y"]) ** 2).mean(-1)
        loss = _real(batch, error)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam."""
        return torch.optim.Adam(self.parameters(), lr=self.hparams["learning_rate"])


class TokenModel(pl.LightningModule):
    """Next-token prediction from the previous two tokens: ``tokens (B, L + 1)`` -> ``L`` predictions.

    Deliberately tiny (an embedding of the last two tokens and an MLP): the recipe is about the
    data path, not the model. Replace ``model._target_`` with your own language model.
    """

    def __init__(self, vocab_size: int, width: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(2 * width, width), torch.nn.ReLU(), torch.nn.Linear(width, vocab_size)
        )

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of token ``t + 1`` given tokens ``t - 1`` and ``t``."""
        tokens = batch["tokens"].long()  # (B, L + 1)
        pairs = torch.cat((self.embed(tokens[:, :-2]), self.embed(tokens[:, 1:-1])), dim=-1)  # (B, L - 1, 2W)
        logits = self.head(pairs)  # (B, L - 1, vocab)
        targets = tokens[:, 2:]
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        loss = _real(batch, per_token.mean(-1))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam."""
        return torch.optim.Adam(self.parameters(), lr=self.hparams["learning_rate"])
