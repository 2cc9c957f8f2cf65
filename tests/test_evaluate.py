"""evaluate(cfg): metrics against an independent computation, every weights source, bad inputs, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from elsa_vision.tasks.evaluate import evaluate, load_weights
from elsa_vision.tasks.train import train
from tests.train_helpers import QUIET, ROOT, TINY_NET, compose_cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny digits model trained for two short epochs."""
    out = tmp_path_factory.mktemp("trained") / "run"
    cfg = compose_cfg(
        "train",
        TINY_NET
        + QUIET
        + [
            "trainer.max_epochs=2",
            "trainer.limit_train_batches=6",
            "trainer.limit_val_batches=2",
            "test=false",
        ],
        out,
    )
    _, obj = train(cfg)
    return obj


def _independent_accuracy(net, datamodule) -> tuple[float, float, torch.Tensor]:
    net.eval()
    logits, labels = [], []
    with torch.no_grad():
        for x, y in datamodule.test_dataloader():
            logits.append(net(x).double())
            labels.append(y)
    logits, labels = torch.cat(logits), torch.cat(labels)
    top1 = (logits.argmax(1) == labels).double().mean().item()
    top5 = (logits.topk(5, dim=1).indices == labels[:, None]).any(1).double().mean().item()
    cm = torch.zeros(10, 10, dtype=torch.long)
    cm.index_put_((labels, logits.argmax(1)), torch.ones_like(labels), accumulate=True)
    return top1, top5, cm


def test_evaluate_checkpoint_matches_an_independent_count(trained, tmp_path):
    ckpt = trained["last_checkpoint"]
    cfg = compose_cfg("eval", TINY_NET + [f"ckpt_path={ckpt}", "logger=none"], tmp_path / "eval")
    metrics, obj = evaluate(cfg)
    top1, top5, cm = _independent_accuracy(obj["model"].net, obj["datamodule"])
    assert metrics["num_samples"] == 360
    assert abs(metrics["test/acc"] - top1) <= 1e-6 and abs(metrics["test/acc5"] - top5) <= 1e-6
    assert torch.equal(obj["confusion_matrix"], cm)
    per_class = metrics["per_class_acc"]
    assert set(per_class) == {str(d) for d in range(10)}
    for d in range(10):
        assert abs(per_class[str(d)] - float(cm[d, d] / cm[d].sum())) <= 1e-9
    assert (tmp_path / "eval" / "confusion_matrix.png").stat().st_size > 1000
    assert (tmp_path / "eval" / "per_class_accuracy.csv").read_text().count("\n") == 11
    # FP32 by default
    assert cfg.trainer.precision == "32-true" and next(obj["model"].parameters()).dtype == torch.float32
    # the weights really are the checkpoint's
    sd = torch.load(ckpt, weights_only=True, map_location="cpu")["state_dict"]
    assert torch.equal(obj["model"].net.head.weight, sd["net.head.weight"])


def test_evaluate_backbone_safetensors_and_pretrained_file(trained, tmp_path):
    net_sd = {k: v.contiguous() for k, v in trained["model"].net.state_dict().items()}
    st = tmp_path / "backbone.safetensors"
    save_file(net_sd, str(st))
    ref, _ = evaluate(
        compose_cfg(
            "eval", TINY_NET + [f"ckpt_path={trained['last_checkpoint']}", "logger=none"], tmp_path / "a"
        )
    )
    m, obj = evaluate(compose_cfg("eval", TINY_NET + [f"ckpt_path={st}", "logger=none"], tmp_path / "b"))
    assert obj["weights"].startswith("backbone") and m["test/acc"] == ref["test/acc"]
    # timm-layout pretrained weights: the backbone loads through timm's filter (same classes -> same head)
    m2, obj2 = evaluate(
        compose_cfg("eval", TINY_NET + [f"model.pretrained_file={st}", "logger=none"], tmp_path / "c")
    )
    got = obj2["model"].net.state_dict()
    assert torch.equal(got["blocks.0.attn.qkv.weight"], net_sd["blocks.0.attn.qkv.weight"])
    assert torch.equal(got["pos_embed"], net_sd["pos_embed"])


def test_load_weights_rejects_mismatched_keys(trained, tmp_path):
    sd = {k: v.contiguous() for k, v in trained["model"].net.state_dict().items()}
    sd["unexpected.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    with pytest.raises(RuntimeError, match="unexpected.weight"):
        load_weights(trained["model"], str(bad))
    with pytest.raises(FileNotFoundError, match="nothing.ckpt"):
        load_weights(trained["model"], str(tmp_path / "nothing.ckpt"))


def test_evaluate_needs_weights(tmp_path):
    cfg = compose_cfg("eval", TINY_NET, tmp_path / "e")
    with pytest.raises(ValueError, match="ckpt_path=.*model.pretrained_file="):
        evaluate(cfg)


def test_evaluate_cli_prints_table_then_json(trained, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            f"ckpt_path={trained['last_checkpoint']}",
            *TINY_NET,
            f"hydra.run.dir={tmp_path}/cli",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    payload = json.loads(lines[-1])
    assert payload["run_dir"] == f"{tmp_path}/cli" and 0.0 <= payload["metrics"]["test/acc"] <= 1.0
    assert os.path.isfile(payload["confusion_matrix_png"])
    assert any(line.startswith("test/acc ") for line in lines) and any(
        "support  accuracy" in s for s in lines
    )
    missing = subprocess.run(
        [sys.executable, "evaluate.py", f"paths.log_dir={tmp_path / 'logs'}"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert missing.returncode != 0 and "model.pretrained_file" in (missing.stderr + missing.stdout)
    # one line, before any work, and no run directory left behind
    assert missing.stdout == "" and missing.stderr.startswith("error: evaluate.py needs weights")
    assert missing.stderr.count("\n") == 1 and not (tmp_path / "logs").exists()
