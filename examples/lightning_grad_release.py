"""Gradient release with Lightning's manual optimization: the optimizer steps inside
``self.manual_backward(loss)``; ``training_step`` calls no ``opt.step()``
(docs/gradient_release.md).

    python examples/lightning_grad_release.py

A synthetic regression task (no downloads). The GPU is used when there is one.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L

from mpext.optim import AdamW, lr_scheduler


class Regressor(L.LightningModule):
    def __init__(self, lr=3e-3, total_steps=64):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # the step is made in backward
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.manual_backward(loss)  # steps and frees the gradients
        self.lr_schedulers().step()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = AdamW(self.parameters(), lr=self.hparams.lr)
        opt.release_grads()
        sched = lr_scheduler.get_cosine_schedule_with_warmup(opt, 4, self.hparams.total_steps)
        return {"optimizer": opt, "lr_scheduler": sched}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(2 * x @ torch.randn(32, 1, generator=g)
                                                        / 32 ** 0.5))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    model = Regressor(total_steps=args.epochs * len(loader))
    trainer = L.Trainer(accelerator="auto", devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader)
    return float(trainer.callback_metrics["loss"]), model


if __name__ == "__main__":
    print("final loss %.5f" % main()[0])
