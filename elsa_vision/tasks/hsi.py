"""Lightning tasks for hyperspectral scenes: patch classification and MAE pretraining.

Both modules take their network either as a module or as a factory (a Hydra ``_partial_: true`` config):
a factory is called in ``setup()`` with ``in_chans``, ``num_classes`` and ``img_size`` read from the
``HSIDataModule`` (bands after PCA, classes in the ground truth, patch size), so one config fits any scene.

Checkpoints carry what inference needs under ``checkpoint["hsi"]``: the network's constructor arguments
(``net_config``) and the data meta (normalisation statistics, PCA components, patch size, class values and
names). Everything in a checkpoint loads with ``torch.load(weights_only=True)``: the network, optimizer and
scheduler objects are kept out of the saved hyperparameters.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCohenKappa

from ..files import read_checkpoint, submodule_weights, unwrap_weights
from ..models.hsi_vit import ElsaHSIViT, HSIMAEDecoder
from .classification import loss_mean, step_accuracy

__all__ = [
    "HSIClassificationModule",
    "MaskedAutoencoderModule",
    "check_hsi_checkpoint",
    "check_net_config",
    "format_report",
    "load_hsi_checkpoint",
]

NetArg = nn.Module | Callable[..., nn.Module]


def _default_optimizer(params, lr: float = 1e-3, weight_decay: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def _param_groups(module: nn.Module, weight_decay_skip: set[str]) -> list[dict]:
    """Weight decay on matrices/kernels only; biases, norms, position embeddings and the MAE mask token
    (``weight_decay_skip`` names of the network, plus ``decoder.pos_embed`` / ``decoder.mask_token``) are not
    decayed."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        head, _, short = name.partition(".")
        skip = (head in ("net", "encoder") and short in weight_decay_skip) or (
            head == "decoder" and short in ("pos_embed", "mask_token")
        )
        (no_decay if p.ndim < 2 or skip else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class _HSIBase(L.LightningModule):
    """Shared: network built lazily from the datamodule's meta, optimizer partials, checkpoint payload."""

    net_attr = "net"

    def __init__(
        self,
        net: NetArg,
        optimizer: Callable | None,
        scheduler: Callable | None,
        scheduler_interval: str,
        net_kwargs: Mapping[str, Any],
    ):
        super().__init__()
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        if isinstance(net, nn.Module):
            setattr(self, self.net_attr, net)
            self._net_factory = None
        elif callable(net):
            setattr(self, self.net_attr, None)
            self._net_factory = net
        else:
            raise TypeError(f"net must be an nn.Module or a callable returning one, got {type(net).__name__}")
        self._net_kwargs = dict(net_kwargs)
        self.optimizer_factory = optimizer if optimizer is not None else _default_optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        self.hsi_meta: dict | None = None

    @property
    def _net(self) -> nn.Module | None:
        return getattr(self, self.net_attr)

    def _datamodule_meta(self) -> dict | None:
        trainer = self._trainer
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        return getattr(dm, "hsi_meta", None) if dm is not None else None

    def _build_net(self, meta: Mapping) -> None:
        """Build the network from the factory (sizes from ``meta``), or check the given one against it."""
        sizes = {"in_chans": int(meta["num_bands"]), "img_size": int(meta["patch_size"]), **self._net_kwargs}
        net = self._net
        if net is None:
            setattr(self, self.net_attr, self._net_factory(**sizes))
            return
        config = getattr(net, "config", None)
        if config is None:
            return
        for k, v in sizes.items():
            if k in config and config[k] != v:
                raise ValueError(f"{type(self).__name__}: net has {k}={config[k]}, the data needs {k}={v}")

    def setup(self, stage: str) -> None:
        meta = self._datamodule_meta()
        if meta is not None:
            self.hsi_meta = meta
        if self._net is None and self.hsi_meta is None:
            raise ValueError(
                f"{type(self).__name__}: net is a factory, so setup() needs a datamodule with `hsi_meta` "
                "(HSIDataModule) to size it"
            )
        if self.hsi_meta is not None:
            self._build_net(self.hsi_meta)

    def configure_optimizers(self):
        net = self._net
        skip = set(net.no_weight_decay()) if hasattr(net, "no_weight_decay") else set()
        groups = _param_groups(self, skip)
        opt = self.optimizer_factory(params=groups)
        if self.scheduler_factory is None:
            return opt
        sched = self.scheduler_factory(optimizer=opt)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": sched,
                "interval": self.scheduler_interval,
                "monitor": "val/loss",
                "frequency": 1,
            },
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        net = self._net
        checkpoint["hsi"] = {
            "net_class": type(net).__name__,
            "net_config": dict(getattr(net, "config", {})),
            "net_attr": self.net_attr,
            "meta": self.hsi_meta,
        }

    @classmethod
    def check_checkpoint(cls, checkpoint: Mapping, source: str = "checkpoint") -> None:
        """Refuse, before anything is built, a checkpoint whose ``hsi`` entry does not describe the network
        its weights hold (:func:`check_hsi_checkpoint`); ``train.py`` calls it on ``ckpt_path``."""
        if isinstance(checkpoint, Mapping) and checkpoint.get("hsi") is not None:
            check_hsi_checkpoint(checkpoint, source)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if checkpoint.get("hsi") is None:
            return
        payload = check_hsi_checkpoint(checkpoint, "checkpoint")
        self.hsi_meta = payload["meta"]
        if self._net is None:
            setattr(self, self.net_attr, ElsaHSIViT(**payload["net_config"]))


class HSIClassificationModule(_HSIBase):
    """Hyperspectral patch classification with OA (micro), AA (macro), Cohen's kappa and per-class accuracy.

    Args:
        net: an ``ElsaHSIViT`` (or any module mapping ``(B, bands, P, P)`` to logits), or a factory called in
            ``setup()`` as ``net(in_chans=bands, img_size=patch, num_classes=K)``.
        optimizer: ``optimizer(params=...)`` factory (a Hydra ``_partial_``); default AdamW(1e-3, wd 0.05).
        scheduler: ``scheduler(optimizer=...)`` factory or None.
        scheduler_interval: ``"epoch"`` or ``"step"``.
        num_classes: class count when ``net`` is a factory and no datamodule gives it (else inferred).
        label_smoothing: cross-entropy label smoothing.
        class_names: names for the evaluation table (default: the datamodule's, else ``class <value>``).
        pretrained_encoder: optional ``MaskedAutoencoderModule`` checkpoint whose encoder is loaded into the
            network in ``setup()`` (once, after the network is built; see :meth:`load_encoder_from`).

    Logs ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc`` (OA), ``val/aa``, ``val/kappa``,
    ``val/acc_best``, and the same under ``test/`` plus ``test/acc_class_<i>``. After ``trainer.test`` the
    evaluation table is in ``test_report`` (dict) and ``format_report(test_report)``.
    """

    def __init__(
        self,
        net: NetArg,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        scheduler_interval: str = "epoch",
        num_classes: int | None = None,
        label_smoothing: float = 0.0,
        class_names: list[str] | None = None,
        pretrained_encoder: str | None = None,
    ):
        super().__init__(net, optimizer, scheduler, scheduler_interval, {})
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        if not (0.0 <= label_smoothing < 1.0):
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)
        self.class_names = None if class_names is None else list(class_names)
        self.num_classes = num_classes if num_classes is not None else getattr(self._net, "num_classes", None)
        self.test_report: dict | None = None
        self.pretrained_encoder = None if pretrained_encoder is None else str(pretrained_encoder)
        self._encoder_loaded = False
        self._metrics_ready = False
        if self.num_classes:
            self._build_metrics(int(self.num_classes))

    def _build_metrics(self, k: int) -> None:
        if k < 2:
            raise ValueError(f"HSIClassificationModule: need >= 2 classes, got {k}")
        self.num_classes = k

        def collection() -> MetricCollection:
            return MetricCollection(
                {
                    "acc": MulticlassAccuracy(k, average="micro"),
                    "aa": MulticlassAccuracy(k, average="macro"),
                    "kappa": MulticlassCohenKappa(k),
                }
            )

        self.train_acc = step_accuracy(k)
        self.val_metrics = collection()
        self.test_metrics = collection()
        self.test_per_class = MulticlassAccuracy(k, average=None)
        self.train_loss, self.val_loss, self.test_loss = loss_mean(), loss_mean(), loss_mean()
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in the checkpoint: a resumed run keeps its best so far
        self._metrics_ready = True

    def setup(self, stage: str) -> None:
        meta = self._datamodule_meta() or self.hsi_meta
        if meta is not None:
            if self.num_classes is not None and int(meta["num_classes"]) != int(self.num_classes):
                raise ValueError(
                    f"HSIClassificationModule: num_classes={self.num_classes}, "
                    f"the data has {meta['num_classes']}"
                )
            self._net_kwargs["num_classes"] = int(meta["num_classes"])
        elif self.num_classes is not None:
            self._net_kwargs["num_classes"] = int(self.num_classes)
        super().setup(stage)
        if not self._metrics_ready:
            self._build_metrics(int(self._net_kwargs["num_classes"]))
        if self.class_names is None and self.hsi_meta is not None:
            names = self.hsi_meta.get("class_names")
            values = self.hsi_meta["class_values"].tolist()
            self.class_names = list(names) if names else [f"class {v}" for v in values]
        if self.pretrained_encoder is not None and not self._encoder_loaded:
            self.load_encoder_from(self.pretrained_encoder)
            self._encoder_loaded = True

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if not self._metrics_ready and self.net is not None:
            self._build_metrics(int(self.net.num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        return loss, logits.argmax(-1), y

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss, pred, y = self._step(batch)
        self.train_loss.update(loss.detach())
        self.train_acc.update(pred, y)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def on_train_start(self) -> None:
        # the sanity check's batches do not count (val_acc_best is not updated during it)
        self.val_loss.reset()
        self.val_metrics.reset()

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, pred, y = self._step(batch)
        self.val_loss.update(loss)
        self.val_metrics.update(pred, y)

    def on_validation_epoch_end(self) -> None:
        m = self.val_metrics.compute()
        self.val_metrics.reset()
        self.log("val/loss", self.val_loss.compute(), prog_bar=True)
        self.val_loss.reset()
        for k, v in m.items():
            self.log(f"val/{k}", v, prog_bar=k == "acc")
        if not self.trainer.sanity_checking:
            self.val_acc_best(m["acc"])
            self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        loss, pred, y = self._step(batch)
        self.test_loss.update(loss)
        self.test_metrics.update(pred, y)
        self.test_per_class.update(pred, y)

    def on_test_epoch_end(self) -> None:
        m = self.test_metrics.compute()
        per_class = self.test_per_class.compute()
        self.log("test/loss", self.test_loss.compute())
        for k, v in m.items():
            self.log(f"test/{k}", v)
        for i, v in enumerate(per_class):
            self.log(f"test/acc_class_{i}", v)
        names = self.class_names or [f"class {i}" for i in range(self.num_classes)]
        self.test_report = {
            "oa": float(m["acc"]),
            "aa": float(m["aa"]),
            "kappa": float(m["kappa"]),
            "per_class": [float(v) for v in per_class],
            "class_names": names,
        }
        self.test_metrics.reset()
        self.test_per_class.reset()
        self.test_loss.reset()
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            print(format_report(self.test_report))

    def load_encoder_from(self, source: Any) -> list[str]:
        """Copy encoder weights (everything but ``head``) into ``self.net``.

        ``source``: a ``MaskedAutoencoderModule``, an ``ElsaHSIViT``, a checkpoint path of either module, or
        a state dict. Shapes and the encoder's data-facing configuration (bands, patch size, token sizes)
        must match; returns the names of the loaded tensors.
        """
        if self.net is None:
            raise ValueError("load_encoder_from: the classifier's net is not built yet (call after setup())")
        state, config = _encoder_state(source)
        own_config = getattr(self.net, "config", {})
        for k in ("in_chans", "img_size", "band_group", "spatial_patch", "embed_dim"):
            if config and k in config and k in own_config and config[k] != own_config[k]:
                raise ValueError(
                    f"load_encoder_from: encoder has {k}={config[k]}, the classifier {k}={own_config[k]}"
                )
        own = self.net.state_dict()
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        missing = [k for k in own if not k.startswith("head.") and k not in state]
        unexpected = [k for k in state if k not in own]
        if missing or unexpected:
            raise ValueError(
                f"load_encoder_from: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}"
            )
        for k, v in state.items():
            if v.shape != own[k].shape:
                raise ValueError(
                    f"load_encoder_from: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}"
                )
        self.net.load_state_dict(state, strict=False)
        return sorted(state)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, map_location: str | torch.device = "cpu"
    ) -> HSIClassificationModule:
        """Rebuild the module and its network from a checkpoint (``weights_only`` load, no unpickling); the
        whole module's state is loaded (the network and the states kept beside it, e.g. ``val_acc_best``)."""
        ckpt = read_checkpoint(path, map_location=map_location)
        payload = check_hsi_checkpoint(ckpt, repr(os.fspath(path)))
        net = ElsaHSIViT(**payload["net_config"])
        hp = ckpt.get("hyper_parameters") or {}
        if not isinstance(hp, Mapping):
            raise ValueError(f"{os.fspath(path)!r}: hyper_parameters is a {type(hp).__name__}, not a mapping")
        for key, ok in (
            ("label_smoothing", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
            ("class_names", lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) == net.num_classes
                                                    and all(isinstance(n, str) for n in v))),
            ("scheduler_interval", lambda v: isinstance(v, str)),
        ):
            if key in hp and not ok(hp[key]):
                raise ValueError(f"{os.fspath(path)!r}: hyper_parameters.{key} = {hp[key]!r} is not valid")
        module = cls(
            net=net,
            **{
                k: v
                for k, v in hp.items()
                if k in ("label_smoothing", "class_names", "scheduler_interval")
            },
        )
        state = unwrap_weights(ckpt, path)
        module.load_state_dict(state, strict=False)
        net_state = submodule_weights(state, "net") or {}
        missing = [k for k in net.state_dict() if k not in net_state]
        if missing:
            raise ValueError(f"{path}: checkpoint lacks network weights {missing[:8]}")
        module.hsi_meta = payload["meta"]
        return module


class MaskedAutoencoderModule(_HSIBase):
    """MAE pretraining of an ``ElsaHSIViT`` encoder on unlabelled patches.

    A fraction ``mask_ratio`` of the ``G*S`` spectral-spatial tokens of each patch is masked at random
    (independently per sample, jointly over space and spectrum); the encoder sees only the visible ones (key
    mask), an ``HSIMAEDecoder`` reconstructs the pixels of every token, and the loss is the mean squared error
    on the masked tokens (optionally against per-token normalised targets, ``norm_pix_loss``).

    Args:
        net: the encoder (``ElsaHSIViT``; its head is dropped) or a factory called in ``setup()`` with
            ``in_chans``, ``img_size`` from the datamodule and ``num_classes=0``.
        optimizer, scheduler, scheduler_interval: as in ``HSIClassificationModule``.
        mask_ratio: fraction of masked tokens, in (0, 1).
        decoder_dim, decoder_depth, decoder_heads: decoder size.
        norm_pix_loss: normalise each target token to zero mean, unit variance.
    """

    net_attr = "encoder"
    curves = {"reconstruction loss (masked tokens)": ("train/loss", "val/loss")}  # curves.png

    def __init__(
        self,
        net: NetArg,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        scheduler_interval: str = "epoch",
        mask_ratio: float = 0.5,
        decoder_dim: int = 128,
        decoder_depth: int = 2,
        decoder_heads: int = 4,
        norm_pix_loss: bool = False,
    ):
        super().__init__(net, optimizer, scheduler, scheduler_interval, {"num_classes": 0})
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        if not (0.0 < mask_ratio < 1.0):
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        self.mask_ratio = float(mask_ratio)
        self.norm_pix_loss = norm_pix_loss
        self._decoder_args = dict(decoder_dim=decoder_dim, depth=decoder_depth, num_heads=decoder_heads)
        self.decoder: HSIMAEDecoder | None = None
        self.train_loss, self.val_loss, self.test_loss = loss_mean(), loss_mean(), loss_mean()
        if self.encoder is not None:
            self._prepare_encoder()

    def _prepare_encoder(self) -> None:
        if not isinstance(self.encoder, ElsaHSIViT):
            raise TypeError(
                f"MaskedAutoencoderModule: the encoder must be an ElsaHSIViT, got {type(self.encoder)}"
            )
        if self.encoder.num_classes:
            self.encoder.reset_classifier(0)
        if self.decoder is None:
            pe = self.encoder.patch_embed
            out_dim = pe.band_group * pe.spatial_patch**2
            self.decoder = HSIMAEDecoder(
                self.encoder.embed_dim, pe.num_groups * pe.num_spatial, out_dim, **self._decoder_args
            )

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self._prepare_encoder()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._prepare_encoder()

    def random_visible(self, batch: int, num_tokens: int, device=None, generator=None) -> Tensor:
        """``(batch, num_tokens)`` bool: ``round((1 - mask_ratio) * num_tokens)`` (>= 1) True per row."""
        keep = max(1, int(round((1.0 - self.mask_ratio) * num_tokens)))
        noise = torch.rand(batch, num_tokens, device=device, generator=generator)
        ids = noise.argsort(dim=1)[:, :keep]
        return torch.zeros(batch, num_tokens, dtype=torch.bool, device=device).scatter_(1, ids, True)

    def reconstruction_loss(self, x: Tensor, visible: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, bands, P, P)`` -> ``(loss, pred (B, T, out), visible (B, T))``; loss over masked tokens."""
        enc = self.encoder
        tokens = enc.embed(x)
        B, G, S, _ = tokens.shape
        if visible is None:
            visible = self.random_visible(B, G * S, device=x.device)
        z = enc.forward_tokens(tokens, visible.reshape(B, G, S))
        pred = self.decoder(z, visible)
        target = enc.patch_embed.patchify(x)
        if self.norm_pix_loss:
            mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1e-6).sqrt()
        err = (pred - target).pow(2).mean(-1)
        masked = (~visible).to(err.dtype)
        return (err * masked).sum() / masked.sum().clamp_min(1.0), pred, visible

    def forward(self, x: Tensor) -> Tensor:
        return self.reconstruction_loss(x)[0]

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss = self(batch[0])
        self.train_loss.update(loss.detach())
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def _fixed_mask_loss(self, x: Tensor, batch_idx: int) -> Tensor:
        # A fixed masking per batch index keeps evaluation losses comparable across epochs.
        g = torch.Generator(device="cpu").manual_seed(batch_idx)
        T = self.encoder.num_groups * self.encoder.num_spatial
        visible = self.random_visible(x.shape[0], T, generator=g).to(x.device)
        return self.reconstruction_loss(x, visible)[0]

    def validation_step(self, batch, batch_idx: int) -> None:
        self.val_loss.update(self._fixed_mask_loss(batch[0], batch_idx))
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self.test_loss.update(self._fixed_mask_loss(batch[0], batch_idx))
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)


# ElsaHSIViT's constructor arguments as a checkpoint may hold them: name -> accepted types
_NET_CONFIG = {
    "in_chans": int,
    "num_classes": int,
    "img_size": int,
    "band_group": int,
    "spatial_patch": int,
    "embed_dim": int,
    "num_heads": int,
    "mlp_ratio": (int, float),
    "qkv_bias": bool,
    "branch_depth": int,
    "fusion_depth": int,
    "global_pool": str,
    "drop_rate": (int, float),
    "drop_path_rate": (int, float),
    "attn_backend": str,
    "attn_precision": str,
    "linear_backend": str,
}
_NET_REQUIRED = ("in_chans", "num_classes")


def check_net_config(config: Any, source: str) -> dict:
    """``config`` (``checkpoint["hsi"]["net_config"]``) as ``ElsaHSIViT`` keyword arguments, after checking
    it is a mapping of known argument names to values of the right types (one ``ValueError`` naming
    ``source`` and the field, never the ``TypeError`` of the constructor)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{source}: hsi.net_config is a {type(config).__name__}, not a mapping of "
                         "ElsaHSIViT arguments")
    unknown = sorted(str(k) for k in config if k not in _NET_CONFIG)
    if unknown:
        raise ValueError(f"{source}: hsi.net_config has unknown keys {unknown[:8]}; ElsaHSIViT takes "
                         f"{sorted(_NET_CONFIG)}")
    missing = [k for k in _NET_REQUIRED if k not in config]
    if missing:
        raise ValueError(f"{source}: hsi.net_config lacks {missing}")
    for key, value in config.items():
        kinds = _NET_CONFIG[key]
        wrong = not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool)
        if wrong or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{source}: hsi.net_config.{key} = {value!r} is not a valid {key}")
    return dict(config)


def check_hsi_checkpoint(checkpoint: Mapping, source: str) -> dict:
    """The ``hsi`` entry of a hyperspectral task checkpoint, checked before anything is built from it.

    ``net_config`` must be ``ElsaHSIViT`` arguments (:func:`check_net_config`) describing the network the
    checkpoint's weights hold: the network is built on the meta device (no memory) and every parameter and
    buffer must be in the weights with the same shape, so a small file cannot ask for a large network
    (``embed_dim=32768``: 12.9 GB) it does not hold. ``meta`` must be a mapping whose patch size and band
    count are the network's. Raises one ``ValueError`` naming ``source`` and the field; returns the entry.
    """
    payload = checkpoint.get("hsi") if isinstance(checkpoint, Mapping) else None
    if not isinstance(payload, Mapping) or "net_config" not in payload:
        raise ValueError(
            f"{source}: not a hyperspectral task checkpoint (no 'hsi' entry with the network config)"
        )
    config = check_net_config(payload["net_config"], source)
    net_attr = payload.get("net_attr", "net")
    if net_attr not in ("net", "encoder"):
        raise ValueError(f"{source}: hsi.net_attr is {net_attr!r}, expected 'net' or 'encoder'")
    state = submodule_weights(unwrap_weights(checkpoint, source), net_attr) or {}
    blocks = 2 * config.get("branch_depth", 2) + config.get("fusion_depth", 2)
    if blocks > len(state):  # each block holds several tensors: a config asking for more is not this file's
        raise ValueError(f"{source}: hsi.net_config asks for {blocks} blocks; the checkpoint holds "
                         f"{len(state)} network tensors")
    try:
        with torch.device("meta"):
            own = ElsaHSIViT(**config).state_dict()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: hsi.net_config does not build an ElsaHSIViT: {e}") from None
    for key, tensor in own.items():
        if key not in state:
            raise ValueError(f"{source}: hsi.net_config describes a network with {key!r}, which the "
                             f"checkpoint's weights lack")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ValueError(f"{source}: hsi.net_config gives {key} the shape {list(tensor.shape)}, the "
                             f"checkpoint's weights hold {list(state[key].shape)}")
    meta = payload.get("meta")
    if meta is not None:
        if not isinstance(meta, Mapping):
            raise ValueError(f"{source}: hsi.meta is a {type(meta).__name__}, not a mapping")
        for key, want in (("patch_size", config.get("img_size", 9)), ("num_bands", config["in_chans"])):
            if key in meta and meta[key] != want:
                raise ValueError(f"{source}: hsi.meta.{key} = {meta[key]!r}, the network's is {want}")
    return payload


def _encoder_state(source: Any) -> tuple[dict[str, Tensor], dict]:
    """(encoder state dict without prefix, encoder config) of a module, checkpoint path or state dict."""
    if isinstance(source, MaskedAutoencoderModule):
        return source.encoder.state_dict(), dict(source.encoder.config)
    if isinstance(source, HSIClassificationModule):
        return source.net.state_dict(), dict(getattr(source.net, "config", {}))
    if isinstance(source, ElsaHSIViT):
        return source.state_dict(), dict(source.config)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        ckpt = read_checkpoint(path, arg="load_encoder_from")
        payload = check_hsi_checkpoint(ckpt, f"load_encoder_from: {str(path)!r}")
        net_attr = payload.get("net_attr", "encoder")
        state = unwrap_weights(ckpt, path, arg="load_encoder_from", submodule=net_attr)
        return state, dict(payload["net_config"])
    if isinstance(source, Mapping):
        keys = list(source)
        for prefix in ("encoder.", "net."):
            if keys and all(k.startswith(prefix) or k.startswith("decoder.") for k in keys):
                return {k[len(prefix) :]: v for k, v in source.items() if k.startswith(prefix)}, {}
        return dict(source), {}
    raise TypeError(
        "load_encoder_from: source must be a MaskedAutoencoderModule, ElsaHSIViT, checkpoint path or "
        "state dict, "
        f"got {type(source).__name__}"
    )


def load_hsi_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu"
) -> tuple[ElsaHSIViT, dict]:
    """The classifier network (eval mode, weights loaded) and data meta of a ``HSIClassificationModule``
    checkpoint, read with ``torch.load(weights_only=True)`` (:func:`elsa_vision.files.read_checkpoint`).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not a checkpoint, or not one of a classifier with data meta. Errors of the
            file itself start with ``checkpoint:`` and name it.
    """
    p = Path(path)
    ckpt = read_checkpoint(p, arg="checkpoint", map_location=map_location)
    payload = check_hsi_checkpoint(ckpt, f"checkpoint: {str(p)!r}")
    if payload.get("net_attr", "net") != "net" or payload.get("meta") is None:
        raise ValueError(
            f"{p}: not a classification checkpoint with data meta (an MAE checkpoint has no head)"
        )
    net = ElsaHSIViT(**payload["net_config"])
    net.load_state_dict(unwrap_weights(ckpt, p, arg="checkpoint", submodule="net"), strict=True)
    return net.eval(), payload["meta"]


def format_report(report: Mapping) -> str:
    """A plain-text evaluation table: per-class accuracy then OA, AA and kappa (in %)."""
    names = list(report["class_names"])
    width = max([len(n) for n in names] + [14])
    lines = [f"{'class':<{width}}  accuracy (%)", "-" * (width + 14)]
    for name, acc in zip(names, report["per_class"]):
        lines.append(f"{name:<{width}}  {100 * acc:11.2f}")
    lines.append("-" * (width + 14))
    for label, key in (("OA", "oa"), ("AA", "aa"), ("kappa x 100", "kappa")):
        lines.append(f"{label:<{width}}  {100 * report[key]:11.2f}")
    return "\n".join(lines)
