"""Zero-shot classification, embedding export and the CLI on a tiny generated image folder (random init)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

open_clip = pytest.importorskip("open_clip")
from PIL import Image  # noqa: E402

from elsa_vision.models.clip_patch import elsa_clip  # noqa: E402
from elsa_vision.tasks.zeroshot import (  # noqa: E402
    ImageFolderWithPaths,
    build_zeroshot_classifier,
    encode_images,
    export_embeddings,
    load_classnames,
    load_templates,
    main,
    run,
    zeroshot_evaluate,
)
from tests.helpers import relerr  # noqa: E402

CLASSES = ["cat", "dog", "red_car", "tree"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {}."]
TINY_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """4 classes x 3 images; the images of one class are copies of one random picture (odd sizes, RGB)."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    for c in CLASSES:
        (root / c).mkdir()
        pic = Image.fromarray(rng.integers(0, 256, (37, 45, 3), dtype=np.uint8))
        for i in range(3):
            pic.save(root / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def tiny_name(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "elsa-test-zeroshot-tiny.json"
    path.write_text(json.dumps(TINY_CFG))
    open_clip.add_model_config(path)
    return "elsa-test-zeroshot-tiny"


@pytest.fixture(scope="module")
def model_and_loader(tiny_name, image_folder):
    torch.manual_seed(0)
    model = open_clip.create_model(tiny_name).eval()
    assert elsa_clip(model)["replaced"] == 2
    transform = open_clip.image_transform(32, is_train=False)
    ds = ImageFolderWithPaths(image_folder, transform=transform)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, shuffle=False, num_workers=0)
    return model, open_clip.get_tokenizer(tiny_name), loader


def test_classifier_is_mean_of_normalised_prompt_embeddings(model_and_loader):
    model, tokenizer, _ = model_and_loader
    names = [c.replace("_", " ") for c in CLASSES]
    clf = build_zeroshot_classifier(model, tokenizer, names, TEMPLATES, classes_per_batch=3)
    assert clf.shape == (32, len(CLASSES)) and clf.dtype == torch.float32
    assert torch.allclose(clf.norm(dim=0), torch.ones(len(CLASSES)), atol=1e-6)
    # float64 reference: one prompt at a time through a float64 copy of the text tower
    ref_model = open_clip.create_model("elsa-test-zeroshot-tiny").eval()
    ref_model.load_state_dict(model.state_dict())
    ref_model.double()
    cols = []
    with torch.no_grad():
        for c in names:
            e = torch.cat(
                [F.normalize(ref_model.encode_text(tokenizer([t.format(c)])), dim=-1) for t in TEMPLATES]
            )
            cols.append(F.normalize(e.mean(0), dim=0))
    ref = torch.stack(cols, dim=1)
    assert relerr(clf, ref) <= 1e-5
    # and open_clip's own builder agrees (callable templates accepted too)
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    oc = build_zero_shot_classifier(model, tokenizer, names, TEMPLATES, device="cpu")
    assert relerr(clf, oc) <= 1e-6
    clf2 = build_zeroshot_classifier(model, tokenizer, names, [lambda c: f"a photo of a {c}."])
    assert clf2.shape == clf.shape and relerr(clf2, clf) > 1e-3  # templates matter


def test_zeroshot_metrics_and_planted_classifier(model_and_loader):
    model, tokenizer, loader = model_and_loader
    clf = build_zeroshot_classifier(model, tokenizer, CLASSES, TEMPLATES)
    m = zeroshot_evaluate(model, clf, loader)
    assert m["num_samples"] == 12
    assert 0.0 <= m["top1"] <= 1.0 and m["top5"] == 1.0  # 4 classes: top-5 is top-4 = always right
    # planted classifier: column c = the (shared) embedding of class c's images -> every image is right
    with torch.no_grad():
        feats, labels = [], []
        for x, y, _ in loader:
            feats.append(F.normalize(encode_images(model, x), dim=-1))
            labels.append(y)
    feats, labels = torch.cat(feats), torch.cat(labels)
    planted = torch.stack([feats[labels == c][0] for c in range(len(CLASSES))], dim=1)
    assert zeroshot_evaluate(model, planted, loader)["top1"] == 1.0
    # the same columns shifted by one class: every image is wrong
    assert zeroshot_evaluate(model, planted.roll(1, dims=1), loader)["top1"] == 0.0
    # an ELSA image tower alone (no text tower) is accepted as the image encoder
    from elsa_vision.models import from_open_clip

    tower = from_open_clip(model).eval()
    assert zeroshot_evaluate(tower, planted, loader)["top1"] == 1.0


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_export_embeddings(model_and_loader, tmp_path, suffix):
    model, _, loader = model_and_loader
    out = tmp_path / f"emb{suffix}"
    info = export_embeddings(model, loader, out)
    assert info == {"path": str(out), "num_samples": 12, "dim": 32}
    ds = loader.dataset
    if suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(out), "pt") as f:
            emb, lab = f.get_tensor("embeddings"), f.get_tensor("labels")
            paths = json.loads(f.metadata()["paths"])
    else:
        z = np.load(out)
        emb, lab, paths = torch.from_numpy(z["embeddings"]), torch.from_numpy(z["labels"]), list(z["paths"])
    assert emb.shape == (12, 32) and torch.allclose(emb.norm(dim=1), torch.ones(12), atol=1e-6)
    assert lab.tolist() == [s[1] for s in ds.samples] and paths == [s[0] for s in ds.samples]
    with torch.no_grad():
        x = torch.stack([ds[i][0] for i in range(12)])
        ref = F.normalize(encode_images(model, x), dim=-1)
    assert relerr(emb, ref) <= 1e-6
    with pytest.raises(ValueError, match=r"\.safetensors or \.npz"):
        export_embeddings(model, loader, tmp_path / "emb.pt")


def test_classnames_and_templates_files(tmp_path):
    import yaml

    assert len(load_classnames(None)) == 1000 and load_classnames("imagenet")[0] == "tench"
    assert len(load_templates(None)) == 80 and load_templates("openai")[0] == "a bad photo of a {}."
    assert len(load_templates("simple")) == 7
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(["cat", "dog"]))
    (tmp_path / "c.json").write_text(json.dumps({"1": "dog", "0": "cat"}))
    (tmp_path / "c2.yaml").write_text(yaml.safe_dump({"classnames": ["cat", "dog"], "templates": ["a {c}."]}))
    for f in ("c.yaml", "c.json", "c2.yaml"):
        assert load_classnames(tmp_path / f) == ["cat", "dog"]
    assert load_templates(tmp_path / "c2.yaml") == ["a {}."]
    (tmp_path / "t.json").write_text(json.dumps(["a photo", "a {} and a {}"]))
    with pytest.raises(ValueError, match="exactly one"):
        load_templates(tmp_path / "t.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_classnames(tmp_path / "missing.yaml")
    (tmp_path / "c.csv").write_text("cat,dog")
    with pytest.raises(ValueError, match="suffix"):
        load_classnames(tmp_path / "c.csv")
    (tmp_path / "gap.json").write_text(json.dumps({"0": "cat", "2": "dog"}))
    with pytest.raises(ValueError, match="label keys"):
        load_classnames(tmp_path / "gap.json")
    with pytest.raises(ValueError, match="non-empty"):
        load_classnames([])


def test_bad_inputs(model_and_loader, image_folder, tiny_name):
    model, tokenizer, loader = model_and_loader
    with pytest.raises(TypeError, match="encode_text"):
        build_zeroshot_classifier(torch.nn.Linear(2, 2), tokenizer, CLASSES, TEMPLATES)
    with pytest.raises(ValueError, match="classnames"):
        build_zeroshot_classifier(model, tokenizer, [], TEMPLATES)
    with pytest.raises(ValueError, match=r"\[E, C\]"):
        zeroshot_evaluate(model, torch.zeros(32), loader)
    with pytest.raises(ValueError, match="width 32, the classifier expects 16"):
        zeroshot_evaluate(model, torch.zeros(16, 4), loader)
    with pytest.raises(ValueError, match="task"):
        run(model=tiny_name, data=str(image_folder), task="retrieve")
    with pytest.raises(ValueError, match="local checkpoint"):
        run(model=tiny_name, data=str(image_folder), pretrained="laion2b_s34b_b88k")
    with pytest.raises(ValueError, match="unknown open_clip model"):
        run(model="ViT-Nope", data=str(image_folder))
    with pytest.raises(ValueError, match="3 names for 4 class folders"):
        run(
            model=tiny_name,
            data=str(image_folder),
            classnames=["a", "b", "c"],
            templates=TEMPLATES,
            num_workers=0,
        )
    with pytest.raises(ValueError, match="not a directory"):
        ImageFolderWithPaths(image_folder / "nope")


def test_cli_zeroshot_and_embed(tiny_name, image_folder, tmp_path, capsys):
    torch.manual_seed(0)
    ckpt = tmp_path / "tiny.pt"
    torch.save(open_clip.create_model(tiny_name).state_dict(), ckpt)
    tfile = tmp_path / "templates.json"
    tfile.write_text(json.dumps(TEMPLATES))
    out = tmp_path / "out"
    common = [
        "--model",
        tiny_name,
        "--pretrained",
        str(ckpt),
        "--data",
        str(image_folder),
        "--workers",
        "0",
        "--batch-size",
        "5",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    main(common + ["--templates", str(tfile)])
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert any(line.startswith("top1") for line in lines[:-1])  # the table
    assert res["task"] == "zeroshot" and res["num_samples"] == 12 and res["replaced"] == 2
    assert 0.0 <= res["top1"] <= res["top5"] <= 1.0
    assert json.loads((out / "zeroshot_metrics.json").read_text())["top1"] == res["top1"]
    # the same checkpoint with stock attention gives the same accuracy
    stock = run(
        model=tiny_name,
        data=str(image_folder),
        pretrained=str(ckpt),
        templates=str(tfile),
        elsa=False,
        num_workers=0,
        device="cpu",
    )
    assert stock["top1"] == res["top1"] and stock["elsa"] is False
    # high-resolution embeddings through ElsaCLIPVision (positional embedding resampled 4x4 -> 6x6)
    main(common + ["--task", "embed", "--image-size", "48", "--embed-format", "npz"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["image_size"] == 48 and res["num_samples"] == 12 and res["dim"] == 32
    z = np.load(out / "embeddings.npz")
    assert z["embeddings"].shape == (12, 32) and np.isfinite(z["embeddings"]).all()
    # an earlier run's outputs are refused before any work, replaced only with --overwrite
    with pytest.raises(ValueError, match=r"already holds outputs of an earlier run \(embed_metrics.json"):
        main(common + ["--task", "embed", "--image-size", "48", "--embed-format", "npz"])
    main(common + ["--task", "embed", "--image-size", "48", "--embed-format", "safetensors", "--overwrite"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_samples"] == 12
    # the earlier run's .npz went with it: one embeddings file, the new one
    assert sorted(p.name for p in out.glob("embeddings.*")) == ["embeddings.safetensors"]


def test_cli_without_out_writes_a_fresh_run_directory(tiny_name, image_folder, tmp_path, monkeypatch, capsys):
    """No --out: the outputs go to logs/zeroshot/runs/<time>/ (ignored by git, beside the training runs), a
    new directory per run, never an ``embeddings/`` folder in the working tree; the library call names it."""
    monkeypatch.chdir(tmp_path)
    args = ["--model", tiny_name, "--data", str(image_folder), "--workers", "0", "--device", "cpu",
            "--task", "embed"]
    first, second = main(args), main(args)
    capsys.readouterr()
    runs = tmp_path / "logs" / "zeroshot" / "runs"
    for res in (first, second):
        assert Path(res["out"]).resolve().parent == runs.resolve()
        assert Path(res["path"]).resolve() == (Path(res["out"]) / "embeddings.safetensors").resolve()
        assert (Path(res["out"]) / "embed_metrics.json").is_file()
    assert first["out"] != second["out"] and sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    with pytest.raises(ValueError, match="task='embed' writes files: pass out=DIR"):
        run(model=tiny_name, data=str(image_folder), task="embed", num_workers=0, device="cpu")


def test_evaluate_task_zeroshot_and_embed(tiny_name, image_folder, tmp_path):
    """evaluate.py's task=zeroshot / task=embed route through the same pipeline as the CLI."""
    from elsa_vision.tasks.evaluate import evaluate_zeroshot
    from tests.train_helpers import compose_cfg

    torch.manual_seed(0)
    ckpt = tmp_path / "tiny.pt"
    torch.save(open_clip.create_model(tiny_name).state_dict(), ckpt)
    common = [f"zeroshot.model={tiny_name}", f"zeroshot.pretrained={ckpt}", f"zeroshot.data={image_folder}",
              "zeroshot.num_workers=0", "zeroshot.batch_size=5", "zeroshot.device=cpu"]
    cfg = compose_cfg("eval", ["task=zeroshot", *common], tmp_path / "zs")
    res = evaluate_zeroshot(cfg)
    direct = run(model=tiny_name, data=str(image_folder), pretrained=str(ckpt), num_workers=0, batch_size=5,
                 device="cpu")
    assert res["num_samples"] == 12 and res["top1"] == direct["top1"] and res["top5"] == direct["top5"]
    cfg = compose_cfg("eval", ["task=embed", "zeroshot.embed_format=npz", *common], tmp_path / "emb")
    res = evaluate_zeroshot(cfg)
    z = np.load(tmp_path / "emb" / "embeddings.npz")
    assert z["embeddings"].shape == (12, 32) and res["num_samples"] == 12
    with pytest.raises(ValueError, match="zeroshot.data"):
        evaluate_zeroshot(compose_cfg("eval", ["task=zeroshot"], tmp_path / "bad"))
    with pytest.raises(ValueError, match="task"):
        evaluate_zeroshot(compose_cfg("eval", [], tmp_path / "cls"))


def test_openai_torchscript_archive_is_read_without_running_it(tiny_name, image_folder, tmp_path):
    """An OpenAI-style TorchScript archive as --pretrained: its tensors are read without torch.jit.load and
    give the accuracy of the same weights saved as a state_dict; a file that is no checkpoint is named."""
    import warnings

    torch.manual_seed(0)
    model = open_clip.create_model(tiny_name).eval()
    torch.save(model.state_dict(), tmp_path / "tiny.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image = torch.randn(1, 3, 32, 32)
        traced = torch.jit.trace_module(model, {"encode_image": (image,)}, check_trace=False)
    traced.save(str(tmp_path / "tiny_jit.pt"))
    common = dict(model=tiny_name, data=str(image_folder), num_workers=0, batch_size=5, device="cpu")
    ref = run(pretrained=str(tmp_path / "tiny.pt"), **common)
    res = run(pretrained=str(tmp_path / "tiny_jit.pt"), **common)
    assert res["top1"] == ref["top1"] and res["top5"] == ref["top5"]
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(60))
    with pytest.raises(ValueError, match=r"photo\.jpg' is not a checkpoint: it is a JPEG image"):
        run(pretrained=str(tmp_path / "photo.jpg"), **common)


def test_cli_precisions_are_the_kernels_vocabulary(capsys):
    from elsa_vision.kernels.precision import PRECISIONS

    with pytest.raises(SystemExit):
        main(["--model", "ViT-B-16", "--data", "/nowhere", "--attn-precision", "fp64"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp64'" in err
    assert f"choose from {', '.join(repr(p) for p in PRECISIONS)}" in err.replace("\n", " ")


def test_cli_refusals_are_one_line_before_the_model_and_leave_no_run_directory(
    tiny_name, image_folder, tmp_path, monkeypatch, capsys
):
    """A --pretrained that is not a file, or a file that is refused (not a checkpoint), ends the CLI with one
    `error:` line and exit code 2 before any model is built; the fresh run directory does not stay."""
    import sys

    from elsa_vision.tasks import zeroshot

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(open_clip, "create_model", lambda *a, **k: pytest.fail("a model was built"))
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(60))
    for pretrained, why in ((tmp_path / "nope.pt", "must be a local checkpoint file"),
                            (tmp_path / "photo.jpg", "is not a checkpoint: it is a JPEG image"),
                            (tmp_path, "must be a local checkpoint file")):
        monkeypatch.setattr(sys, "argv", ["zeroshot", "--model", tiny_name, "--pretrained", str(pretrained),
                                          "--data", str(image_folder), "--workers", "0", "--device", "cpu"])
        with pytest.raises(SystemExit) as e:
            zeroshot.cli()
        captured = capsys.readouterr()
        assert e.value.code == 2 and captured.out == ""
        assert captured.err.count("\n") == 1 and captured.err.startswith("error: ") and why in captured.err
    assert not (tmp_path / "logs" / "zeroshot" / "runs").exists() or not any(
        (tmp_path / "logs" / "zeroshot" / "runs").iterdir())


def test_overwrite_keeps_files_it_did_not_write(tiny_name, image_folder, tmp_path):
    out = tmp_path / "out"
    common = dict(model=tiny_name, data=str(image_folder), task="embed", num_workers=0, device="cpu",
                  out=str(out))
    run(embed_format="npz", **common)
    (out / "embeddings.README").write_text("mine")
    run(embed_format="safetensors", overwrite=True, **common)
    assert sorted(p.name for p in out.iterdir()) == [
        "embed_metrics.json", "embeddings.README", "embeddings.safetensors", "outputs.json"]


def test_an_image_size_that_cannot_fit_is_refused_before_the_model_is_built(tiny_name, image_folder, tmp_path,
                                                                           monkeypatch):
    """--image-size 100000 resampled the positional embedding to a 12500x12500 grid (40 GB for this tiny
    tower): refused in one line, naming the size and the estimate, before open_clip builds anything."""
    monkeypatch.setattr(open_clip, "create_model", lambda *a, **k: pytest.fail("a model was built"))
    refused = (r"^image_size 100000 \(12500x12500 patches of 8px\): the image tower of "
               r"elsa-test-zeroshot-tiny needs at least [\d,.]+ GiB for a batch of 4")
    with pytest.raises(ValueError, match=refused):
        run(model=tiny_name, data=str(image_folder), task="embed", image_size=100000, batch_size=4,
            num_workers=0, device="cpu", out=str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_a_pretrained_file_is_not_reported_as_random_init(tiny_name, tmp_path, caplog):
    """open_clip builds the model without weights and warns that it is "initialized randomly"; the file's
    weights are loaded right after, so that record is dropped and the load is logged instead."""
    import logging

    from elsa_vision.tasks.zeroshot import _from_file

    torch.manual_seed(0)
    ref = open_clip.create_model(tiny_name)
    torch.save(ref.state_dict(), tmp_path / "tiny.pt")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        model = _from_file(open_clip, tiny_name, str(tmp_path / "tiny.pt"))
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    messages = [r.getMessage() for r in caplog.records]
    assert not any("initialized randomly" in m for m in messages), messages
    assert f"{tiny_name}: weights loaded from {tmp_path / 'tiny.pt'}" in messages
    caplog.clear()
    with caplog.at_level(logging.INFO):  # without a file open_clip's warning stays: it is true then
        open_clip.create_model(tiny_name)
    assert any("initialized randomly" in r.getMessage() for r in caplog.records)


def test_linear_backend_reaches_the_image_tower(tiny_name, image_folder, tmp_path, monkeypatch):
    """The ELSA image tower's linear layers run the FP32-accurate split GEMMs by default; --linear-backend
    torch gives PyTorch's own back (checked before anything is built)."""
    from elsa_vision.layers import ElsaLinearModule
    from elsa_vision.tasks import zeroshot

    built = []
    real = zeroshot._build_model
    monkeypatch.setattr(zeroshot, "_build_model", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    for backend in ("auto", "torch"):
        run(model=tiny_name, data=str(image_folder), task="embed", num_workers=0, device="cpu",
            out=str(tmp_path / backend), linear_backend=backend)
        linears = [m for m in built[-1][0].visual.modules() if isinstance(m, ElsaLinearModule)]
        assert linears and all(m.backend == backend for m in linears)
    with pytest.raises(ValueError, match="unknown linear_backend 'eca'"):
        run(model=tiny_name, data=str(image_folder), task="embed", num_workers=0, device="cpu",
            out=str(tmp_path / "eca"), linear_backend="eca")
    assert len(built) == 2

