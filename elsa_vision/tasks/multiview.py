"""Multi-view 3D reconstruction training/evaluation (VGGT's camera and depth objectives).

Ground truth is expressed in frame 0's camera and divided by the mean distance of the valid ground-truth
points from frame 0's camera centre (:func:`normalize_ground_truth`). Losses (VGGT, arXiv 2503.11651):

* camera: L1 on translation, quaternion and FoV of the pose encoding, weighted 1, 1, 0.5, summed over the
  refinement iterations with weights ``gamma^(n−1−i)`` (``gamma = 0.6``, the last iteration weighs 1);
* depth: aleatoric ``gamma·|d − d*|·c − alpha·log c`` over valid pixels plus a multi-scale gradient loss on
  ``d − d*`` (``c``: the predicted confidence ``1 + exp``).

Metrics (validation/test): camera AUC@30/15/5 over all frame pairs (pooled over the epoch) and depth AbsRel /
δ<1.25 after per-sequence median scale alignment, logged as ``{stage}/auc30`` ... ``{stage}/abs_rel``,
``{stage}/delta1``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn

from ..data.geometry import (
    closed_form_inverse_se3,
    depth_metrics,
    depth_to_cam_points,
    extri_intri_to_pose_encoding,
    pose_auc,
    pose_encoding_to_extri_intri,
    relative_pose_errors,
)
from ..files import save_safetensors
from .classification import schedule_steps

__all__ = ["MultiViewReconstructionModule", "normalize_ground_truth", "camera_loss", "depth_loss"]


def _to4(ext: Tensor) -> Tensor:
    bottom = torch.zeros(*ext.shape[:-2], 1, 4, dtype=ext.dtype, device=ext.device)
    bottom[..., 0, 3] = 1.0
    return torch.cat([ext, bottom], dim=-2)


def normalize_ground_truth(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Frame-0-relative, scale-normalised ground truth.

    Extrinsics become ``E_i · E_0^{-1}`` (frame 0 = identity); world points are the unprojected valid depths
    in frame 0's camera; ``scale`` = mean norm of those points per sequence; translations and depths are
    divided by it. Returns ``extrinsics [B,S,3,4]``, ``depth [B,S,H,W]``, ``valid``, ``intrinsics``,
    ``scale [B]``.
    """
    ext, intr, depth, valid = batch["extrinsics"], batch["intrinsics"], batch["depth"], batch["valid"]
    if ext.dim() != 4 or depth.dim() != 4:
        raise ValueError(
            f"normalize_ground_truth: expected extrinsics [B,S,3,4] and depth [B,S,H,W], got "
            f"{list(ext.shape)} and {list(depth.shape)}"
        )
    e4 = _to4(ext.double())
    rel = e4 @ closed_form_inverse_se3(e4[:, :1])  # cam_i <- cam_0
    pts_cam = depth_to_cam_points(depth.double(), intr.double())  # [B,S,H,W,3] in camera i
    cam0_from_i = closed_form_inverse_se3(rel)[:, :, None, None]
    pts0 = (cam0_from_i[..., :3, :3] @ pts_cam[..., None]).squeeze(-1) + cam0_from_i[..., :3, 3]
    dist = pts0.norm(dim=-1)
    w = valid.double()
    count = w.flatten(1).sum(1)
    if bool((count == 0).any()):
        raise ValueError("normalize_ground_truth: a sequence has no valid depth pixel")
    scale = (dist * w).flatten(1).sum(1) / count
    rel = rel[..., :3, :].clone()
    rel[..., :3, 3] = rel[..., :3, 3] / scale[:, None, None]
    return {
        "extrinsics": rel.to(ext.dtype),
        "depth": (depth.double() / scale[:, None, None, None]).to(depth.dtype),
        "valid": valid,
        "intrinsics": intr,
        "scale": scale.to(depth.dtype),
    }


def camera_loss(
    pose_enc_list: list[Tensor],
    gt_pose_enc: Tensor,
    weights: tuple[float, float, float] = (1.0, 1.0, 0.5),
    gamma: float = 0.6,
) -> dict[str, Tensor]:
    """Iteration-weighted L1 on ``[..., 9]`` encodings: translation (3), quaternion (4), FoV (2)."""
    n = len(pose_enc_list)
    lt = lq = lf = gt_pose_enc.new_zeros(())
    for i, pred in enumerate(pose_enc_list):
        wgt = gamma ** (n - 1 - i)
        err = (pred - gt_pose_enc).abs()
        lt = lt + wgt * err[..., :3].mean()
        lq = lq + wgt * err[..., 3:7].mean()
        lf = lf + wgt * err[..., 7:].mean()
    total = weights[0] * lt + weights[1] * lq + weights[2] * lf
    return {"loss_camera": total, "loss_T": lt, "loss_R": lq, "loss_fl": lf}


def _gradient_loss(diff: Tensor, valid: Tensor, scales: int = 3) -> Tensor:
    """Mean |∂x(d − d*)| + |∂y(d − d*)| over valid neighbour pairs, at ``scales`` dyadic subsamplings."""
    total = diff.new_zeros(())
    for s in range(scales):
        step = 2**s
        d, m = diff[..., ::step, ::step], valid[..., ::step, ::step].to(diff.dtype)
        mx = m[..., :, 1:] * m[..., :, :-1]
        my = m[..., 1:, :] * m[..., :-1, :]
        gx = (d[..., :, 1:] - d[..., :, :-1]).abs() * mx
        gy = (d[..., 1:, :] - d[..., :-1, :]).abs() * my
        total = total + (gx.sum() + gy.sum()) / (mx.sum() + my.sum()).clamp_min(1.0)
    return total / scales


def depth_loss(
    depth: Tensor,
    conf: Tensor,
    gt_depth: Tensor,
    valid: Tensor,
    gamma: float = 1.0,
    alpha: float = 0.2,
    grad_weight: float = 1.0,
) -> dict[str, Tensor]:
    """``depth [B,S,H,W(,1)]``, ``conf [B,S,H,W]``, ``gt_depth [B,S,H,W]``, ``valid`` bool."""
    if depth.dim() == 5:
        depth = depth[..., 0]
    m = valid.to(depth.dtype)
    n = m.sum().clamp_min(1.0)
    err = (depth - gt_depth).abs()
    conf_term = ((gamma * err * conf - alpha * torch.log(conf)) * m).sum() / n
    diff = (depth - gt_depth) * m
    grad = _gradient_loss(diff, valid)
    return {
        "loss_depth": conf_term + grad_weight * grad,
        "loss_conf_depth": conf_term,
        "loss_grad_depth": grad,
    }


class MultiViewReconstructionModule(L.LightningModule):
    """LightningModule around :class:`elsa_vision.models.ElsaVGGT` (or any net with the same outputs).

    Args:
        net: the network; ``net(images [B,S,3,H,W])`` -> dict with ``pose_enc_list`` / ``pose_enc``,
            ``depth``, ``depth_conf``. Its architecture (``ElsaVGGT.config``) is recorded in the
            hyperparameters as ``net_config``, so that ``load_from_checkpoint(path)`` rebuilds it.
        optimizer: partial optimizer (``optimizer(params=...)``), needed to fit only (a module loaded from a
            checkpoint for inference or export has none); scheduler: partial scheduler or None.
        scheduler_interval: ``"epoch"``: ``scheduler(optimizer=...)`` stepped every epoch (``val/loss``
            monitored); ``"step"``: ``scheduler(optimizer=..., total_steps=..., steps_per_epoch=...)``
            stepped every optimizer step (``elsa_vision.tasks.cosine_warmup_schedule``'s convention).
        camera_weight, depth_weight: loss weights; depth_alpha, depth_gamma, grad_weight: depth loss terms.
        compile: ``torch.compile`` the net at fit start.
        net_config: ``ElsaVGGT`` arguments to build the network from when ``net`` is None (what
            ``load_from_checkpoint`` passes back from the checkpoint).

    A run's checkpoint holds tensors and plain values only (``torch.load(weights_only=True)``):
    ``MultiViewReconstructionModule.load_from_checkpoint("last.ckpt").export_net("net.safetensors")`` writes
    the network alone; ``python -m elsa_vision.inference.multiview --weights`` reads either file.
    """

    # curves.png of a run (elsa_vision.utils.run.plot_curves): the losses and the validation metrics
    curves = {
        "loss": ("train/loss_epoch", "val/loss"),
        "camera pose AUC (val)": ("val/auc30", "val/auc15"),
        "depth δ<1.25 (val)": ("val/delta1",),
    }

    def __init__(
        self,
        net: nn.Module | None = None,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        camera_weight: float = 1.0,
        depth_weight: float = 1.0,
        depth_alpha: float = 0.2,
        depth_gamma: float = 1.0,
        grad_weight: float = 1.0,
        compile: bool = False,
        net_config: dict | None = None,
        scheduler_interval: str = "epoch",
    ) -> None:
        super().__init__()
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"MultiViewReconstructionModule: scheduler_interval must be 'epoch' or 'step', "
                             f"got {scheduler_interval!r}")
        if net is None:
            if net_config is None:
                raise ValueError("MultiViewReconstructionModule: pass net (a network) or net_config "
                                 "(ElsaVGGT arguments); a checkpoint of an older run records neither: "
                                 "load_from_checkpoint(path, net=ElsaVGGT.from_config(name))")
            from ..models.vggt import ElsaVGGT

            net = ElsaVGGT(**net_config)
        config = getattr(net, "config", None)
        net_config = dict(config) if isinstance(config, dict) else None
        # Only plain values go to the checkpoint (it must load with torch.load(weights_only=True)); the
        # optimizer/scheduler factories (Hydra partials) live in the run's resolved config.
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self._pose_errs: dict[str, list[tuple[Tensor, Tensor]]] = {"val": [], "test": []}
        self._depth_stats: dict[str, list[tuple[float, float, int]]] = {"val": [], "test": []}

    def forward(self, images: Tensor) -> dict:
        return self.net(images)

    def _step(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict, dict[str, Tensor]]:
        images = batch["images"]
        H, W = images.shape[-2:]
        gt = normalize_ground_truth(batch)
        gt_enc = extri_intri_to_pose_encoding(gt["extrinsics"], gt["intrinsics"], (H, W)).to(images.dtype)
        out = self.net(images)
        hp = self.hparams
        cam = camera_loss(out["pose_enc_list"], gt_enc)
        dep = depth_loss(
            out["depth"],
            out["depth_conf"],
            gt["depth"],
            gt["valid"],
            hp.depth_gamma,
            hp.depth_alpha,
            hp.grad_weight,
        )
        losses = {
            **cam,
            **dep,
            "loss": hp.camera_weight * cam["loss_camera"] + hp.depth_weight * dep["loss_depth"],
        }
        return losses, out, gt

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        losses, _, _ = self._step(batch)
        bs = batch["images"].shape[0]
        self.log_dict(
            {f"train/{k}": v.detach() for k, v in losses.items() if k != "loss"},
            on_step=True,
            on_epoch=True,
            prog_bar=False,
            batch_size=bs,
        )
        self.log(
            "train/loss", losses["loss"].detach(), on_step=True, on_epoch=True, prog_bar=True, batch_size=bs
        )
        return losses["loss"]

    def _eval_step(self, batch: dict[str, Tensor], stage: str) -> None:
        losses, out, gt = self._step(batch)
        images = batch["images"]
        H, W = images.shape[-2:]
        pred_ext, _ = pose_encoding_to_extri_intri(out["pose_enc"].double(), (H, W))
        if images.shape[1] >= 2:
            for b in range(images.shape[0]):
                self._pose_errs[stage].append(relative_pose_errors(pred_ext[b], gt["extrinsics"][b].double()))
        pred_depth = out["depth"][..., 0] if out["depth"].dim() == 5 else out["depth"]
        dm = depth_metrics(pred_depth.detach(), gt["depth"], gt["valid"])
        self._depth_stats[stage].append((dm["abs_rel"], dm["delta1"], images.shape[0]))
        self.log(f"{stage}/loss", losses["loss"], on_epoch=True, prog_bar=True, batch_size=images.shape[0])
        self.log(f"{stage}/loss_camera", losses["loss_camera"], on_epoch=True, batch_size=images.shape[0])
        self.log(f"{stage}/loss_depth", losses["loss_depth"], on_epoch=True, batch_size=images.shape[0])

    def _eval_epoch_end(self, stage: str) -> None:
        errs, stats = self._pose_errs[stage], self._depth_stats[stage]
        metrics = {}
        if errs:
            r = torch.cat([e[0] for e in errs])
            t = torch.cat([e[1] for e in errs])
            metrics.update(
                {
                    f"{stage}/auc30": pose_auc(r, t, 30),
                    f"{stage}/auc15": pose_auc(r, t, 15),
                    f"{stage}/auc5": pose_auc(r, t, 5),
                    f"{stage}/rot_err": float(r.mean()),
                    f"{stage}/trans_err": float(t.mean()),
                }
            )
        if stats:
            n = sum(s[2] for s in stats)
            metrics[f"{stage}/abs_rel"] = sum(s[0] * s[2] for s in stats) / n
            metrics[f"{stage}/delta1"] = sum(s[1] * s[2] for s in stats) / n
        if metrics:
            self.log_dict(metrics, prog_bar=stage == "val", sync_dist=False)
        errs.clear()
        stats.clear()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def export_net(self, path: str | Path) -> Path:
        """Write the network's state_dict as safetensors (what ``--weights`` of the inference CLI reads)."""
        net = getattr(self.net, "_orig_mod", self.net)
        return save_safetensors({k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}, path)

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("MultiViewReconstructionModule: no optimizer to fit with (a module loaded from "
                             "a checkpoint has none); pass optimizer=functools.partial(torch.optim.AdamW, "
                             "lr=...)")
        optimizer = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        if self.hparams.scheduler_interval == "step":
            total, per_epoch = schedule_steps(self.trainer)
            scheduler = self.scheduler_factory(optimizer=optimizer, total_steps=total,
                                               steps_per_epoch=per_epoch)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "monitor": "val/loss",
                "interval": "epoch",
                "frequency": 1,
            },
        }
