"""Image classification as a LightningModule around any timm-style backbone.

``ClassificationModule(net, optimizer, scheduler, ...)`` follows lightning-hydra-template: the backbone is
injected (built by Hydra from ``model.net``), the optimizer and the scheduler arrive as partials, and every
stage keeps its own torchmetrics objects (``train/acc``, ``val/acc``, ``val/acc5``, ``test/acc`` ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import timm
import torch
import torch.nn.functional as F
from lightning import LightningModule
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

__all__ = ["ClassificationModule", "create_backbone", "cosine_warmup_schedule", "loss_mean",
           "model_data_config", "step_accuracy"]


class _SharedWeights(Mapping):
    """A state_dict handed to timm through ``pretrained_cfg_overlay``. timm turns the pretrained cfg into a
    dict with ``dataclasses.asdict``, which deep-copies every tensor of a plain dict (twice the weights'
    memory at peak); a deep copy of this holder is the dict itself, its tensors shared."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self.state_dict = state_dict

    def __deepcopy__(self, memo: dict) -> dict[str, Any]:
        return self.state_dict

    def __getitem__(self, key: str) -> Any:
        return self.state_dict[key]

    def __iter__(self):
        return iter(self.state_dict)

    def __len__(self) -> int:
        return len(self.state_dict)


def create_backbone(
    model_name: str,
    num_classes: int,
    pretrained_file: str | None = None,
    checkpoint_path: str | None = None,
    grad_checkpointing: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """``timm.create_model`` for ``elsa_*`` (or any timm) names, with local weights only.

    Args:
        model_name: a registered timm name, e.g. ``"elsa_vit_small_patch16_224"``.
        num_classes: classifier width (the pretrained head is dropped when it differs).
        pretrained_file: ``.safetensors``/``.pth``/``.bin`` of timm (or OpenAI-CLIP / DINOv2) weights, read by
            :func:`elsa_vision.files.read_weights` and loaded by timm through the model's pretrained filter fn
            (pos-embed resampling, ``in_chans`` adaptation, a head of another width dropped).
        checkpoint_path: a raw state_dict with exactly this model's keys, loaded strictly after building
            (:func:`elsa_vision.models.load_checkpoint`).
        grad_checkpointing: recompute each block's activations in the backward pass (timm's
            ``set_grad_checkpointing``, as timm's ``train.py --grad-checkpointing``): training keeps one
            block's activations at a time instead of every block's, for high resolutions (with
            ``trainer=cp`` too). Results are unchanged.
        **kwargs: model arguments (``img_size``, ``patch_size``, ``in_chans``, ``attn_backend``, ...).

    Raises:
        FileNotFoundError, ValueError: a weights file that is missing or not a checkpoint, before the model
            is built; the message starts with ``create_backbone: pretrained_file:`` (``checkpoint_path``)
            and names the file. ValueError: ``grad_checkpointing`` for a model that does not support it.
    """
    import elsa_vision.models  # noqa: F401  (registers the elsa_* names with timm)

    if not timm.is_model(model_name):
        valid = ", ".join(timm.list_models("elsa_*"))
        raise ValueError(
            f"create_backbone: unknown model_name {model_name!r}; registered ELSA models: {valid}"
        )
    from ..files import checkpoint_kind, read_weights
    from ..models import load_checkpoint

    img_size, patch_size = kwargs.get("img_size"), kwargs.get("patch_size")
    sizes_given = isinstance(img_size, int) and isinstance(patch_size, int)
    if sizes_given and (patch_size < 1 or img_size % patch_size):
        raise ValueError(f"create_backbone: patch_size ({patch_size}) must divide img_size ({img_size})")
    if checkpoint_path is not None:  # a missing file, a JPEG or a text file is named before anything is built
        checkpoint_kind(checkpoint_path, arg="create_backbone: checkpoint_path")
    if pretrained_file is not None:
        weights = read_weights(pretrained_file, arg="create_backbone: pretrained_file")
        # timm's load_pretrained takes a state_dict in place of a file (and runs the filter fn on it)
        kwargs.update(pretrained=True, pretrained_cfg_overlay=dict(state_dict=_SharedWeights(weights)))
    net = timm.create_model(model_name, num_classes=num_classes, **kwargs)
    if pretrained_file is not None:
        net.pretrained_cfg.pop("state_dict", None)  # the cfg would keep the file's tensors alive
    if checkpoint_path is not None:
        load_checkpoint(net, checkpoint_path, strict=True)
    if grad_checkpointing:
        try:
            net.set_grad_checkpointing(True)
        except (AttributeError, AssertionError):  # timm models without it assert `not enable`
            raise ValueError(f"create_backbone: grad_checkpointing: {model_name} does not support gradient "
                             f"checkpointing") from None
    return net


def model_data_config(net: nn.Module) -> dict[str, Any]:
    """The data config a network expects, as timm's ``train.py`` resolves it
    (``timm.data.resolve_data_config(model=net)``: mean/std, interpolation, crop_pct from its pretrained cfg),
    with the input size the network was built for (``patch_embed.img_size``, ``in_chans``). Data modules
    take it through ``set_data_config``."""
    from timm.data import resolve_data_config

    args: dict[str, Any] = {}
    patch_embed = getattr(net, "patch_embed", None)
    img_size = getattr(patch_embed, "img_size", None)
    proj = getattr(patch_embed, "proj", None)
    in_chans = getattr(net, "in_chans", None) or getattr(proj, "in_channels", None)
    if img_size is not None and in_chans is not None:
        args["input_size"] = (int(in_chans), *(int(v) for v in img_size))
    return resolve_data_config(args, model=net)


def cosine_warmup_schedule(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    steps_per_epoch: int,
    warmup_epochs: float = 5.0,
    warmup_lr_ratio: float = 1e-3,
    min_lr_ratio: float = 1e-2,
) -> LambdaLR:
    """Linear warmup then half-cosine decay, evaluated per optimizer step (a ``LambdaLR``).

    The learning rate is ``base_lr * f(step)`` with ``f`` rising linearly from ``warmup_lr_ratio`` to 1 over
    ``warmup_epochs * steps_per_epoch`` steps, then ``min_lr_ratio + (1 - min_lr_ratio)·(1 + cos(pi·t))/2``
    for ``t`` going from 0 to 1 at ``total_steps``.
    """
    if total_steps < 1 or steps_per_epoch < 1:
        raise ValueError(
            f"cosine_warmup_schedule: total_steps and steps_per_epoch must be >= 1, got {total_steps}, "
            f"{steps_per_epoch}"
        )
    warmup = min(int(round(warmup_epochs * steps_per_epoch)), max(total_steps - 1, 0))

    def factor(step: int) -> float:
        if step < warmup:
            return warmup_lr_ratio + (1.0 - warmup_lr_ratio) * step / warmup
        t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return LambdaLR(optimizer, factor)


def loss_mean() -> MeanMetric:
    """The epoch mean of a step's loss that never waits for the GPU: torchmetrics' ``MeanMetric`` checks
    every value for NaN by default (``nan_strategy="warn"`` drops NaN values), and that check reads the
    result back, a host-device synchronisation in the middle of every training step (after the forward,
    before the backward is launched). Here the check is off: a NaN loss makes the epoch's mean NaN, where
    a diverging run should show it. The tasks' modules call its ``update`` (not the metric itself, which also
    computes the step's own value) and log the metric per epoch."""
    return MeanMetric(nan_strategy="disable")


def step_accuracy(num_classes: int) -> MulticlassAccuracy:
    """The epoch's top-1 accuracy over the training steps' predictions (logits or labels), updated without
    waiting for the GPU: torchmetrics checks label predictions by default (``torch.unique`` of the targets and
    of the predictions, whose sizes the host reads back: two host-device synchronisations between the forward
    and the backward of every training step). The step's loss has checked the targets already (cross entropy
    fails on a label outside ``[0, num_classes)``) and the predictions are the network's own. Validation and
    test metrics keep torchmetrics' checks."""
    return MulticlassAccuracy(num_classes, top_k=1, average="micro", validate_args=False)


def schedule_steps(trainer) -> tuple[int, int]:
    """``(total_steps, steps_per_epoch)`` of a fit, what a per-step schedule (:func:`cosine_warmup_schedule`)
    is built with: Lightning's estimate of the optimizer steps, spread over ``max_epochs``."""
    total = int(trainer.estimated_stepping_batches)
    epochs = trainer.max_epochs
    per_epoch = max(1, math.ceil(total / epochs)) if epochs is not None and epochs > 0 else max(1, total)
    return total, per_epoch


class ClassificationModule(LightningModule):
    """Supervised image classification.

    Args:
        net: backbone mapping ``[B, C, H, W]`` to logits ``[B, num_classes]``.
        optimizer: ``partial`` taking the module (e.g. ``timm.optim.create_optimizer_v2`` with ``opt``,
            ``lr``, ``weight_decay``); timm exempts biases, norms and ``no_weight_decay()`` from decay.
        scheduler: ``partial`` taking ``(optimizer, total_steps=, steps_per_epoch=)`` and returning a
            torch LR scheduler stepped every optimizer step, or ``None`` for a constant rate.
        num_classes: number of classes (metrics).
        label_smoothing: cross-entropy label smoothing (folded into the soft targets when mixup is on).
        mixup: ``None`` or timm ``Mixup`` arguments (``mixup_alpha``, ``cutmix_alpha``, ``prob``,
            ``switch_prob``, ``mode``); the loss becomes ``SoftTargetCrossEntropy``.
        compile: ``torch.compile`` the backbone in place for fitting (state_dict keys are unchanged).
        attention: the ``{backend, precision}`` the backbone was built with (recorded in the hyperparameters).
        linear: the ``{backend}`` of the backbone's linear layers (recorded in the hyperparameters).
        pretrained_file: the weights file the backbone started from (recorded in the hyperparameters).
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        num_classes: int = 1000,
        label_smoothing: float = 0.0,
        mixup: Mapping[str, Any] | None = None,
        compile: bool = False,
        attention: Mapping[str, Any] | None = None,
        linear: Mapping[str, Any] | None = None,
        pretrained_file: str | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"ClassificationModule: num_classes must be >= 2, got {num_classes}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(
                f"ClassificationModule: label_smoothing must be in [0, 1), got {label_smoothing}"
            )
        # Only plain values go to the checkpoint (it must load with torch.load(weights_only=True)); the
        # optimizer/scheduler recipe lives in the run's resolved config.
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler

        self.mixup_fn = None
        if mixup:
            self.mixup_fn = Mixup(**dict(mixup), label_smoothing=label_smoothing, num_classes=num_classes)
            self.train_criterion: nn.Module = SoftTargetCrossEntropy()
        else:
            self.train_criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

        top5 = min(5, num_classes)
        self.train_acc = step_accuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_acc5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")
        self.test_confmat = MulticlassConfusionMatrix(num_classes)
        self.train_loss, self.val_loss, self.test_loss = loss_mean(), loss_mean(), loss_mean()
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in the checkpoint: a resumed run keeps its best so far

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    # ------------------------------------------------------------------------------------------- training
    def on_train_start(self) -> None:
        # Sanity-check batches must not count towards the validation metrics (val_acc_best is never updated
        # during the sanity check, and keeps the value a resumed checkpoint restored).
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc5.reset()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        if self.mixup_fn is not None:
            if x.shape[0] % 2:
                raise ValueError(f"mixup needs an even per-device batch size, got {x.shape[0]}")
            x_mix, y_soft = self.mixup_fn(x, y)
            logits = self(x_mix)
            loss = self.train_criterion(logits, y_soft)
        else:
            logits = self(x)
            loss = self.train_criterion(logits, y)
        # updates only (logged per epoch): no per-step value, no host synchronisation (loss_mean,
        # step_accuracy)
        self.train_loss.update(loss.detach())
        self.train_acc.update(logits.detach(), y)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    # ---------------------------------------------------------------------------------- validation / test
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y))
        self.val_acc.update(logits, y)
        self.val_acc5.update(logits, y)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc5", self.val_acc5, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_loss.update(F.cross_entropy(logits, y))
        self.test_acc.update(logits, y)
        self.test_acc5.update(logits, y)
        self.test_confmat.update(logits, y)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)
        self.log("test/acc5", self.test_acc5, on_step=False, on_epoch=True)

    def on_test_epoch_start(self) -> None:
        self.test_confmat.reset()

    def on_test_epoch_end(self) -> None:
        # Kept (synchronised across processes) for evaluate.py: rows are true classes, columns predictions.
        self.confusion_matrix = self.test_confmat.compute().cpu()

    # ---------------------------------------------------------------------------------------- optimizers
    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net.compile()

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.optimizer_factory(self.net)
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        total, per_epoch = schedule_steps(self.trainer)
        scheduler = self.scheduler_factory(optimizer, total_steps=total, steps_per_epoch=per_epoch)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }
