"""Train a model: ``python train.py [group=option ...] [key=value ...]`` (configs in ``configs/``).

With no arguments it trains the embedded default (a small ElsaViT on scikit-learn's digits, on CPU). The last
line of stdout is one JSON object: the final metrics, the run directory and the checkpoints.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from elsa_vision.files import NotACheckpointError
from elsa_vision.utils.run_dirs import register_resolvers

os.environ.setdefault("PROJECT_ROOT", os.path.dirname(os.path.abspath(__file__)))
register_resolvers()  # hydra.run.dir: a new directory per run, or the resumed run's own


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from elsa_vision.tasks.train import CheckpointPathError, train
    from elsa_vision.utils.run import print_json_line

    try:
        metrics, objects = train(cfg)
    except (CheckpointPathError, NotACheckpointError, FileNotFoundError) as e:  # a wrong path: one line
        sys.exit(f"error: {e}")
    if objects["trainer"].is_global_zero:
        print_json_line(
            {
                "metrics": metrics,
                "run_dir": objects["run_dir"],
                "best_checkpoint": objects["best_checkpoint"],
                "last_checkpoint": objects["last_checkpoint"],
            }
        )
    return metrics.get(cfg.get("optimized_metric", "val/acc_best"))


if __name__ == "__main__":
    main()
