"""Train a model: ``python train.py [group=option ...] [key=value ...]`` (configs in ``configs/``).

With no arguments it trains the embedded default (a small ElsaViT on scikit-learn's digits, on CPU). The last
line of stdout is one JSON object: the final metrics, the run directory and the checkpoints. A refused setting
or file (a GPU this machine lacks, a checkpoint that is not one, a missing data file, a model that cannot fit
in memory ...) ends the run before any work with one ``error: ...`` line and no run directory left behind.
"""

import os

import hydra
from omegaconf import DictConfig

from elsa_vision.utils.run_dirs import register_resolvers

os.environ.setdefault("PROJECT_ROOT", os.path.dirname(os.path.abspath(__file__)))
register_resolvers()  # hydra.run.dir: a new directory per run, or the resumed run's own


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from elsa_vision.tasks.train import fit_and_test, prepare_training
    from elsa_vision.utils.run import no_empty_run_dir, print_json_line, refused_in_one_line

    run_dir = str(cfg.paths.output_dir)  # the directory Hydra made for this invocation
    with refused_in_one_line(run_dir):
        prepared = prepare_training(cfg)
    with no_empty_run_dir(run_dir):
        metrics, objects = fit_and_test(prepared)
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
