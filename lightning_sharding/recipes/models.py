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
        if "stream" in batch:  # a mixture: train/loss/<stream>, and a MixtureController's statistics
            from lightning_sharding.lightning.controller import log_stream_loss

            log_stream_loss(self, error.detach(), batch)
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


class CausalLM(pl.LightningModule):
    """One transformer block over packed sequences (``data=pretrain``): token and position
    embeddings, causal attention masked to each document (from ``document_ids``, with PyTorch's
    ``scaled_dot_product_attention``), an MLP and the logits. Logs the loss and ``data/tokens``,
    the tokens whose labels the step trained.
    """

    def __init__(self, vocab_size: int, seq_len: int, width: int, heads: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.position = torch.nn.Embedding(seq_len, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )
        self.out = torch.nn.Linear(width, vocab_size)

    @override
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``(B, L, vocab)``."""
        x = self.embed(batch["input_ids"]) + self.position(batch["position_ids"])
        b, n, d = x.shape
        heads = self.hparams["heads"]
        q, k, v = self.qkv(x).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        docs = batch["document_ids"]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = (docs[:, :, None] == docs[:, None, :]) & causal
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + attended.transpose(1, 2).reshape(b, n, d)
        return self.out(x + self.mlp(x))  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of every labelled token (padding rows and tokens are -100 or flagged)."""
        labels = batch["labels"].masked_fill(batch["is_padding"][:, None], -100)
        logits = self(batch)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        self.log("train/loss", loss, prog_bar=True)
        trained = float((labels != -100).sum())
        self.log("data/tokens", trained, reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW."""
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["learning_rate"])


class ImageClassifier(pl.LightningModule):
    """A small CNN: ``image (B, 3, H, W)`` ``uint8`` -> logits of ``classes``, cross-entropy with ``label``."""

    def __init__(self, classes: int, width: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * width, classes),
        )

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the class logits, over the real samples."""
        logits = self.net(batch["image"].float() / 255.0 - 0.5)
        loss = _real(batch, torch.nn.functional.cross_entropy(logits, batch["label"], reduction="none"))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam."""
        return torch.optim.Adam(self.parameters(), lr=self.hparams["learning_rate"])
