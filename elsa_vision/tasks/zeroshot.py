"""Zero-shot classification and image-embedding export for CLIP models (image tower on ELSA).

The protocol is CLIP's (https://arxiv.org/abs/2103.00020, open_clip's ``zero_shot.py``): for every class the
text embeddings of all prompt templates are L2-normalised, averaged and re-normalised; an image is classified
by ``logits = 100 · normalize(encode_image(x)) @ classifier``; top-1 / top-5 accuracy over an image folder.

Library functions (used by ``evaluate.py task=zeroshot|embed``):

* :func:`build_zeroshot_classifier` -> ``[E, C]`` text classifier;
* :func:`zeroshot_evaluate` -> ``{"top1", "top5", "num_samples"}``;
* :func:`export_embeddings` -> ``.safetensors`` / ``.npz``: ``embeddings [N, E]``, ``labels [N]``, ``paths``;
* :func:`load_classnames`, :func:`load_templates` (YAML / JSON files, or the built-in ImageNet lists);
* :func:`run` -> the whole pipeline from plain arguments (a Hydra config maps onto its keyword arguments).

Command line::

    python -m elsa_vision.tasks.zeroshot --model ViT-B-16 --pretrained /path/ckpt.pt --data /path/folder \\
        [--classnames f.yaml] [--templates f.json] [--task zeroshot|embed] [--out DIR]

Without ``--out`` the metrics JSON and the embeddings go to a fresh ``logs/zeroshot/runs/<date>_<time>/``
under the working directory (where ``train.py`` / ``evaluate.py`` keep their runs; ignored by git).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.samplers import usable_workers
from ..files import add_output_arguments, prepare_output_dir, record_outputs, remove_outputs, save_safetensors
from ..layers import set_linear
from ..layers.elsa_module import check_linear_options
from ..utils.accelerator import add_device_argument, resolve_device

__all__ = [
    "build_zeroshot_classifier",
    "zeroshot_evaluate",
    "export_embeddings",
    "encode_images",
    "load_classnames",
    "load_templates",
    "ImageFolderWithPaths",
    "run",
    "main",
    "cli",
]

TASKS = ("zeroshot", "embed")

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- class names, templates


def _read_structured(path: str | os.PathLike) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(text)
    if path.suffix.lower() == ".json":
        return json.loads(text)
    if path.suffix.lower() == ".txt":
        return [line.strip() for line in text.splitlines() if line.strip()]
    raise ValueError(
        f"file {str(path)!r}: expected a .yaml, .yml, .json or .txt file, got suffix {path.suffix!r}"
    )


def load_classnames(source: str | os.PathLike | Sequence[str] | None) -> list[str]:
    """Class names, in label order.

    ``source``: ``None`` or ``"imagenet"`` (the 1000 ImageNet names); a sequence of strings; or a YAML /
    JSON / TXT file holding a list, a mapping ``{label_index: name}`` or a mapping with a ``classnames`` list.
    """
    if source is None or (isinstance(source, str) and source == "imagenet"):
        from ..data.imagenet_zeroshot import IMAGENET_CLASSNAMES

        return list(IMAGENET_CLASSNAMES)
    data = _read_structured(source) if isinstance(source, (str, os.PathLike)) else source
    if isinstance(data, Mapping):
        if "classnames" in data:
            data = data["classnames"]
        else:
            try:
                keys = sorted(int(k) for k in data)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"classnames {source!r}: a mapping must have a 'classnames' list or integer keys "
                    f"(label -> name), got keys {list(data)[:5]}"
                ) from e
            if keys != list(range(len(keys))):
                raise ValueError(
                    f"classnames {source!r}: label keys must be 0..{len(keys) - 1}, got {keys[:5]}..."
                )
            data = [data[k] if k in data else data[str(k)] for k in keys]
    if (
        isinstance(data, str)
        or not isinstance(data, Sequence)
        or not data
        or not all(isinstance(c, str) and c for c in data)
    ):
        raise ValueError(
            f"classnames {source!r}: expected a non-empty list of non-empty strings, got "
            f"{type(data).__name__}"
        )
    return list(data)


def load_templates(source: str | os.PathLike | Sequence[str] | None) -> list[str]:
    """Prompt templates as ``str.format`` strings with one ``{}`` (``{c}`` is accepted too).

    ``source``: ``None`` / ``"openai"`` (the 80 OpenAI ImageNet templates), ``"simple"`` (open_clip's 7), a
    sequence, or a YAML / JSON / TXT file holding a list or a mapping with a ``templates`` list.
    """
    if source is None or (isinstance(source, str) and source in ("openai", "simple")):
        from ..data import imagenet_zeroshot as meta

        return list(meta.SIMPLE_IMAGENET_TEMPLATES if source == "simple" else meta.OPENAI_IMAGENET_TEMPLATES)
    data = _read_structured(source) if isinstance(source, (str, os.PathLike)) else source
    if isinstance(data, Mapping):
        if "templates" not in data:
            raise ValueError(
                f"templates {source!r}: a mapping must have a 'templates' list, got keys {list(data)}"
            )
        data = data["templates"]
    if isinstance(data, str) or not isinstance(data, Sequence) or not data:
        raise ValueError(
            f"templates {source!r}: expected a non-empty list of strings, got {type(data).__name__}"
        )
    out = []
    for t in data:
        if not isinstance(t, str):
            raise ValueError(f"templates {source!r}: every template must be a string, got {t!r}")
        t = t.replace("{c}", "{}")
        if t.count("{}") != 1:
            raise ValueError(f"templates {source!r}: template {t!r} must contain exactly one '{{}}' slot")
        out.append(t)
    return out


def _render(template: str | Callable[[str], str], classname: str) -> str:
    return template(classname) if callable(template) else template.format(classname)


# -------------------------------------------------------------------------------------------------- encoders


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def encode_images(model: nn.Module, images: Tensor) -> Tensor:
    """Image embeddings ``[B, E]`` (not normalised) of an open_clip model (``encode_image``) or a tower."""
    if hasattr(model, "encode_image"):
        out = model.encode_image(images)
    else:
        out = model(images)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if out.dim() == 3 and out.shape[1] == 1:  # parallel/cascade attentional pooling: [B, 1, E]
        out = out[:, 0]
    if out.dim() != 2:
        raise ValueError(f"image encoder returned shape {list(out.shape)}; expected [B, E]")
    return out


@torch.no_grad()
def build_zeroshot_classifier(
    model: nn.Module,
    tokenizer: Callable[[list[str]], Tensor],
    classnames: Sequence[str],
    templates: Sequence[str | Callable[[str], str]],
    device: torch.device | str | None = None,
    classes_per_batch: int = 16,
) -> Tensor:
    """Zero-shot classifier ``[E, C]``: per class the re-normalised mean of its normalised prompt embeddings.

    Args:
        model: anything with ``encode_text(tokens) -> [T, E]`` (an open_clip model).
        tokenizer: ``list[str] -> LongTensor [T, L]`` (``open_clip.get_tokenizer(name)``).
        classnames: ``C`` names. templates: format strings with ``{}`` or callables ``name -> prompt``.
        device: where tokens go (default: the model's device). classes_per_batch: classes per text forward.
    """
    if not hasattr(model, "encode_text"):
        raise TypeError(f"build_zeroshot_classifier: model must have encode_text, got {type(model).__name__}")
    if isinstance(classnames, str) or len(classnames) == 0:
        raise ValueError("build_zeroshot_classifier: classnames must be a non-empty sequence of names")
    if isinstance(templates, str) or len(templates) == 0:
        raise ValueError("build_zeroshot_classifier: templates must be a non-empty sequence")
    if classes_per_batch < 1:
        raise ValueError(
            f"build_zeroshot_classifier: classes_per_batch must be >= 1, got {classes_per_batch}"
        )
    device = torch.device(device) if device is not None else _model_device(model)
    T = len(templates)
    columns = []
    for i in range(0, len(classnames), classes_per_batch):
        names = classnames[i : i + classes_per_batch]
        tokens = tokenizer([_render(t, c) for c in names for t in templates]).to(device)
        emb = F.normalize(model.encode_text(tokens).float(), dim=-1)
        emb = F.normalize(emb.reshape(len(names), T, -1).mean(dim=1), dim=-1)
        columns.append(emb.T)
    return torch.cat(columns, dim=1)


def _unpack(batch) -> tuple[Tensor, Tensor | None, list[str] | None]:
    if isinstance(batch, Tensor):
        return batch, None, None
    if isinstance(batch, Mapping):
        return batch["image"], batch.get("label"), batch.get("path")
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3:
        images = batch[0]
        labels = batch[1] if len(batch) > 1 else None
        paths = list(batch[2]) if len(batch) > 2 else None
        return images, labels, paths
    raise TypeError(
        f"batches must be images, (images, labels[, paths]) or a mapping; got {type(batch).__name__}"
    )


@torch.no_grad()
def zeroshot_evaluate(
    model: nn.Module,
    classifier: Tensor,
    dataloader: Iterable,
    device: torch.device | str | None = None,
    logit_scale: float = 100.0,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy of ``logits = logit_scale · normalize(img) @ classifier`` over ``dataloader``.

    ``classifier``: ``[E, C]`` from :func:`build_zeroshot_classifier`. Batches: ``(images, labels[, paths])``.
    With fewer than 5 classes ``top5`` is top-``C`` (so 1.0). Returns ``{"top1", "top5", "num_samples"}``.
    """
    from torchmetrics.classification import MulticlassAccuracy

    if not isinstance(classifier, Tensor) or classifier.dim() != 2:
        raise ValueError(
            f"zeroshot_evaluate: classifier must be a [E, C] tensor, got "
            f"{getattr(classifier, 'shape', type(classifier).__name__)}"
        )
    device = torch.device(device) if device is not None else _model_device(model)
    C = classifier.shape[1]
    classifier = classifier.to(device=device, dtype=torch.float32)
    top1 = MulticlassAccuracy(num_classes=C, top_k=1, average="micro").to(device)
    top5 = MulticlassAccuracy(num_classes=C, top_k=min(5, C), average="micro").to(device)
    n = 0
    for batch in dataloader:
        images, labels, _ = _unpack(batch)
        if labels is None:
            raise ValueError("zeroshot_evaluate: batches must carry labels: (images, labels[, paths])")
        feats = F.normalize(encode_images(model, images.to(device)).float(), dim=-1)
        if feats.shape[1] != classifier.shape[0]:
            raise ValueError(
                f"zeroshot_evaluate: image embeddings have width {feats.shape[1]}, the classifier "
                f"expects {classifier.shape[0]}"
            )
        logits = logit_scale * feats @ classifier
        labels = torch.as_tensor(labels, device=device)
        top1.update(logits, labels)
        top5.update(logits, labels)
        n += labels.numel()
    if n == 0:
        raise ValueError("zeroshot_evaluate: the dataloader yielded no samples")
    return {"top1": float(top1.compute()), "top5": float(top5.compute()), "num_samples": n}


@torch.no_grad()
def export_embeddings(
    model: nn.Module,
    dataloader: Iterable,
    out_path: str | os.PathLike,
    device: torch.device | str | None = None,
    normalize: bool = True,
) -> dict[str, Any]:
    """Write the image embeddings of ``dataloader`` to ``out_path`` (``.safetensors`` or ``.npz``).

    Stored: ``embeddings [N, E]`` float32 (L2-normalised if ``normalize``), ``labels [N]`` int64 (-1 when the
    batches carry none) and the image ``paths`` (safetensors: JSON list in the metadata under ``"paths"``;
    npz: a string array; empty strings when unknown). Returns ``{"path", "num_samples", "dim"}``.
    """
    out_path = Path(out_path)
    if out_path.suffix not in (".safetensors", ".npz"):
        raise ValueError(
            f"export_embeddings: out_path must end in .safetensors or .npz, got {str(out_path)!r}"
        )
    device = torch.device(device) if device is not None else _model_device(model)
    embs, labels, paths = [], [], []
    for batch in dataloader:
        images, lab, pth = _unpack(batch)
        e = encode_images(model, images.to(device)).float()
        embs.append((F.normalize(e, dim=-1) if normalize else e).cpu())
        B = e.shape[0]
        labels.append(torch.as_tensor(lab).long().cpu() if lab is not None else torch.full((B,), -1))
        paths += [str(p) for p in pth] if pth is not None else [""] * B
    if not embs:
        raise ValueError("export_embeddings: the dataloader yielded no samples")
    emb, lab = torch.cat(embs), torch.cat(labels)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.suffix == ".safetensors":
        save_safetensors(
            {"embeddings": emb.contiguous(), "labels": lab.contiguous()},
            out_path,
            metadata={"paths": json.dumps(paths), "normalized": str(bool(normalize))},
        )
    else:
        import numpy as np

        np.savez(out_path, embeddings=emb.numpy(), labels=lab.numpy(), paths=np.array(paths, dtype=str))
    return {"path": str(out_path), "num_samples": int(emb.shape[0]), "dim": int(emb.shape[1])}


# ----------------------------------------------------------------------------------------------------- data


class ImageFolderWithPaths:
    """``torchvision`` ``ImageFolder`` yielding ``(image, label, path)``; classes are the sorted folders."""

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None) -> None:
        from torchvision.datasets import ImageFolder

        if not Path(root).is_dir():
            raise ValueError(f"data root {str(root)!r} is not a directory")
        self.folder = ImageFolder(str(root), transform=transform)
        self.classes = self.folder.classes
        self.samples = self.folder.samples

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int):
        image, label = self.folder[i]
        return image, label, self.samples[i][0]


# ------------------------------------------------------------------------------------------------- pipeline


def _from_file(open_clip, model_name: str, path: str):
    """An open_clip model with the weights of a local file (open_clip's layout, OpenAI's ``state_dict`` or
    TorchScript archive), read by :func:`elsa_vision.models.clip_vision.load_clip_state_dict` (weights only;
    a TorchScript archive's code is never run). The tensors go through open_clip's own loader
    (``load_checkpoint``: layout conversions, position-embedding resizing), which takes only a file: they are
    written to a temporary ``torch.save`` file (read back with ``weights_only=True``) and dropped before
    open_clip reads it, so one copy of the weights is alive besides the model's. Buffers the model does not
    keep in its state_dict (``attn_mask``) are left out."""
    import tempfile

    from ..models.clip_vision import load_clip_state_dict

    sd = load_clip_state_dict(path)  # a refused file ends the run before the model is built
    # open_clip warns that the model it builds without `pretrained` is "initialized randomly": the file's
    # weights are loaded next, so that record is dropped (and the load is logged instead)
    random_init = f"No pretrained weights loaded for model '{model_name}'"

    def dropped(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(random_init)

    root = logging.getLogger()
    root.addFilter(dropped)
    try:
        model = open_clip.create_model(model_name, device="cpu")
    finally:
        root.removeFilter(dropped)
    transient = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    sd = {k: v for k, v in sd.items() if k not in transient}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_file = os.path.join(tmp, "weights.pt")
        torch.save(sd, tmp_file)
        del sd
        open_clip.load_checkpoint(model, tmp_file)
    log.info("%s: weights loaded from %s", model_name, path)
    return model


def _check_model(model_name: str, pretrained: str | None) -> None:
    """One line for an unknown open_clip config name or a ``pretrained`` that is not a local file."""
    import open_clip

    if pretrained is not None and not os.path.isfile(pretrained):
        raise ValueError(
            f"pretrained must be a local checkpoint file, got {pretrained!r} (nothing is downloaded)"
        )
    if open_clip.get_model_config(model_name) is None:
        raise ValueError(f"unknown open_clip model {model_name!r}; see open_clip.list_models()")


def _check_image_size(model_name: str, image_size: int | None, batch_size: int, device: torch.device) -> None:
    """Refuse, before the model is built, an ``image_size`` whose image tower cannot fit in the device's
    memory: the resampled positional embedding (``(image_size / patch)^2 x width`` floats), the weights
    (about ``12 width^2`` per block) and one block's activations for a batch (``(6 + 2 mlp_ratio)`` floats
    per token and channel; the torch attention backend on CPU adds five ``heads x 1024 x tokens``
    workspaces per image)."""
    import open_clip

    from ..utils.accelerator import available_memory_mb

    if image_size is None:
        return
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    vision = (open_clip.get_model_config(model_name) or {}).get("vision_cfg") or {}
    patch, width = int(vision.get("patch_size", 16)), int(vision.get("width", 768))
    layers, ratio = int(vision.get("layers", 12)), float(vision.get("mlp_ratio", 4.0))
    heads = max(1, width // int(vision.get("head_width", 64)))
    tokens = (image_size // patch) ** 2 + 1
    weights = (12 * width * width * layers + tokens * width) * 4
    activations = batch_size * (6 + 2 * ratio) * tokens * width * 4
    if device.type != "cuda":
        activations += batch_size * 5 * heads * min(tokens, 1024) * tokens * 4
    need = (weights + activations) / 2**20
    available, where = available_memory_mb(device)
    if need > available:
        raise ValueError(
            f"image_size {image_size} ({image_size // patch}x{image_size // patch} patches of {patch}px): "
            f"the image tower of {model_name} needs at least {need / 1024:,.1f} GiB for a batch of "
            f"{batch_size}, more than the {available / 1024:,.1f} GiB available ({where}); lower the image "
            "size or the batch size"
        )


def _build_model(
    model_name: str,
    pretrained: str | None,
    device: torch.device,
    image_size: int | None,
    elsa: bool,
    backend: str,
    precision: str,
):
    """An open_clip model with its image tower on ELSA, and its eval preprocessing (the name and the file
    checked by :func:`_check_model` first)."""
    import open_clip

    from ..models.clip_patch import elsa_clip
    from ..models.clip_vision import from_open_clip

    if pretrained is not None:
        model = _from_file(open_clip, model_name, pretrained)
    else:
        model = open_clip.create_model(model_name, device="cpu")
    model.eval()
    pp = dict(open_clip.get_model_preprocess_cfg(model))
    report = {"elsa": False}
    if image_size is not None:
        # ElsaCLIPVision resamples the positional embedding to the requested input size.
        model.visual = from_open_clip(
            model, image_size=image_size, attn_backend=backend, attn_precision=precision
        )
        report = {"elsa": True, "image_tower": "ElsaCLIPVision", "image_size": image_size}
    elif elsa:
        report = {"elsa": True, **elsa_clip(model, backend=backend, precision=precision)}
    model.to(device).eval()
    size = image_size if image_size is not None else pp.get("size", model.visual.image_size)
    if isinstance(size, (tuple, list)) and size[0] == size[1]:
        size = size[0]
    transform = open_clip.image_transform(
        size,
        is_train=False,
        mean=pp.get("mean"),
        std=pp.get("std"),
        interpolation=pp.get("interpolation", "bicubic"),
        resize_mode=pp.get("resize_mode", "shortest"),
    )
    return model, open_clip.get_tokenizer(model_name), transform, report


def run(
    model: str,
    data: str,
    pretrained: str | None = None,
    task: str = "zeroshot",
    classnames: str | Sequence[str] | None = None,
    templates: str | Sequence[str] | None = None,
    out: str | None = None,
    batch_size: int = 64,
    num_workers: int = 4,
    device: str | None = None,
    image_size: int | None = None,
    elsa: bool = True,
    attn_backend: str = "auto",
    attn_precision: str = "auto",
    embed_format: str = "safetensors",
    overwrite: bool = False,
    linear_backend: str = "auto",
) -> dict[str, Any]:
    """Zero-shot evaluation (``task="zeroshot"``) or embedding export (``task="embed"``) on an image folder.

    Args:
        model: open_clip config name. data: ImageFolder root (one sub-folder per class).
        pretrained: local checkpoint (None: random init, for smoke tests).
        classnames: file / list / "imagenet";
            None uses ImageNet names for a 1000-class folder, else the folder names ("_" -> " ").
        templates: file / list / "openai" / "simple" (None: the 80 OpenAI templates).
        out: directory for ``<task>_metrics.json`` and ``embeddings.<fmt>``; required for ``task="embed"``
            (None with ``"zeroshot"``: nothing is written).
        image_size: run the image tower at this size (ElsaCLIPVision with resampled positional embedding).
        elsa: False keeps open_clip's stock attention (reference runs).
        overwrite: replace the outputs of an earlier run in ``out`` (otherwise refused before any work).
        linear_backend: the ELSA image tower's linear layers: ``"auto"`` (FP32-accurate split GEMMs for
            float32 on CUDA) or ``"torch"`` (PyTorch's own GEMMs).
    Returns the metrics / export summary plus timing.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if embed_format not in ("safetensors", "npz"):
        raise ValueError(f"embed_format must be 'safetensors' or 'npz', got {embed_format!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_linear_options("run", linear_backend)
    if task == "embed" and out is None:
        raise ValueError("run: task='embed' writes files: pass out=DIR (the CLI defaults to a fresh run "
                         "directory under logs/zeroshot/runs)")
    outputs = [f"{task}_metrics.json", "embeddings.*"]
    if out is not None:
        out = str(prepare_output_dir(out, outputs, overwrite=overwrite))
    dev = resolve_device(device, "device")
    # the model's name, the weights file, the data and the class names are checked before the model is built
    _check_model(model, pretrained)
    _check_image_size(model, image_size, batch_size, dev)
    dataset = ImageFolderWithPaths(data)
    names = None
    if task == "zeroshot":
        if classnames is None:
            names = (
                load_classnames("imagenet")
                if len(dataset.classes) == 1000
                else [c.replace("_", " ") for c in dataset.classes]
            )
        else:
            names = load_classnames(classnames)
        if len(names) != len(dataset.classes):
            raise ValueError(
                f"classnames: {len(names)} names for {len(dataset.classes)} class folders in {data!r}"
            )
        prompts = load_templates(templates)
    net, tokenizer, transform, report = _build_model(
        model, pretrained, dev, image_size, elsa, attn_backend, attn_precision
    )
    set_linear(net, backend=linear_backend, who="--linear-backend")
    dataset.folder.transform = transform
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=usable_workers(num_workers),
        pin_memory=dev.type == "cuda"
    )
    result: dict[str, Any] = {
        "task": task,
        "model": model,
        "pretrained": pretrained,
        "data": str(data),
        "num_classes": len(dataset.classes),
        **{k: v for k, v in report.items() if k in ("elsa", "replaced", "image_size")},
    }
    t0 = time.perf_counter()
    if task == "zeroshot":
        classifier = build_zeroshot_classifier(net, tokenizer, names, prompts, device=dev)
        result.update(zeroshot_evaluate(net, classifier, loader, device=dev))
    if out is not None and overwrite:  # the earlier run's outputs go, embeddings of another format too
        remove_outputs(out, outputs)
    if task == "embed":
        out_file = Path(out) / f"embeddings.{embed_format}"
        record_outputs(out, [out_file.name])
        result.update(export_embeddings(net, loader, out_file, device=dev))
    result["seconds"] = round(time.perf_counter() - t0, 3)
    if out is not None:
        result["out"] = str(out)
        record_outputs(out, [f"{task}_metrics.json"])
        (Path(out) / f"{task}_metrics.json").write_text(json.dumps(result, indent=2))
    return result


def fresh_run_dir(root: str | os.PathLike = "logs/zeroshot/runs") -> Path:
    """A new ``root/<date>_<time>`` directory (``_2``, ``_3`` ... appended within the same second)."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for n in range(1, 1000):
        path = Path(root) / (stamp if n == 1 else f"{stamp}_{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"fresh_run_dir: no free name for {stamp} under {root}")


def _table(result: Mapping[str, Any]) -> str:
    rows = [
        (k, f"{v:.4f}" if isinstance(v, float) and not math.isnan(v) else str(v)) for k, v in result.items()
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from ..kernels.precision import PRECISIONS

    p = argparse.ArgumentParser(
        prog="python -m elsa_vision.tasks.zeroshot", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="open_clip config name, e.g. ViT-B-16")
    p.add_argument("--pretrained", default=None, help="local checkpoint file (omit: random init)")
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--classnames", default=None, help="YAML/JSON/TXT file or 'imagenet'")
    p.add_argument("--templates", default=None, help="YAML/JSON/TXT file, 'openai' or 'simple'")
    p.add_argument("--task", default="zeroshot", choices=TASKS)
    add_output_arguments(p, "output directory (metrics JSON, embeddings); default: a fresh "
                         "logs/zeroshot/runs/<date>_<time>/")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=4)
    add_device_argument(p)
    p.add_argument("--image-size", type=int, default=None, help="run the image tower at this resolution")
    p.add_argument("--no-elsa", action="store_true", help="keep open_clip's stock attention")
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--attn-precision", default="auto", choices=PRECISIONS,
                   help="ELSA float32 precision (auto: FP32-accurate)")
    p.add_argument("--linear-backend", default="auto", choices=("auto", "torch"),
                   help="the image tower's linear layers: auto = FP32-accurate split GEMMs on CUDA float32 "
                   "(error below PyTorch FP32's), torch = PyTorch's own FP32 GEMMs")
    p.add_argument("--embed-format", default="safetensors", choices=("safetensors", "npz"))
    a = p.parse_args(argv)
    fresh = None if a.out else fresh_run_dir()
    try:
        result = _run_args(a, a.out or str(fresh))
    except BaseException:
        if fresh is not None:  # a run that fails before writing leaves no empty run directory
            with contextlib.suppress(OSError):
                fresh.rmdir()
        raise
    print(_table(result))
    print(json.dumps(result))
    sys.stdout.flush()
    return result


def _run_args(a: argparse.Namespace, out: str) -> dict[str, Any]:
    return run(
        model=a.model,
        data=a.data,
        pretrained=a.pretrained,
        task=a.task,
        classnames=a.classnames,
        templates=a.templates,
        out=out,
        overwrite=a.overwrite,
        batch_size=a.batch_size,
        num_workers=a.workers,
        device=a.device,
        image_size=a.image_size,
        elsa=not a.no_elsa,
        attn_backend=a.attn_backend,
        attn_precision=a.attn_precision,
        embed_format=a.embed_format,
        linear_backend=a.linear_backend,
    )


def cli() -> None:
    """``python -m elsa_vision.tasks.zeroshot``: a refused input (a missing or refused ``--pretrained``, an
    unknown model, a data folder that is not one) ends the run with one ``error:`` line and exit code 2."""
    try:
        main()
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
