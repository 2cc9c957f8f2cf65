"""Evaluate a checkpoint or weights file: ``python evaluate.py ckpt_path=... [data=... model=...]``.

Prints a table of top-1/top-5 and per-class accuracy, writes ``confusion_matrix.png`` into the run directory;
the last line of stdout is one JSON object with the metrics and the run directory. A refused setting or file
(no weights given, a checkpoint that is not one, a GPU this machine lacks ...) ends the run before any work
with one ``error: ...`` line and no run directory left behind.
"""

import os

import hydra
from omegaconf import DictConfig

from elsa_vision.utils.run_dirs import register_resolvers

os.environ.setdefault("PROJECT_ROOT", os.path.dirname(os.path.abspath(__file__)))
register_resolvers()  # hydra.run.dir: a new directory per run


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from elsa_vision.tasks.evaluate import TASKS, evaluate_zeroshot, prepare_evaluation, run_evaluation
    from elsa_vision.utils.run import no_empty_run_dir, print_json_line, refused_in_one_line

    run_dir = str(cfg.paths.output_dir)  # the directory Hydra made for this invocation
    task = cfg.get("task", "classification")
    with refused_in_one_line(run_dir):
        if task not in TASKS:
            raise ValueError(f"unknown task={task!r}; expected one of {', '.join(TASKS)}")
        if task != "classification":  # zero-shot checks its inputs before it builds anything
            result = evaluate_zeroshot(cfg)
            print_json_line({"metrics": result, "run_dir": run_dir})
            return
        prepared = prepare_evaluation(cfg)
    with no_empty_run_dir(run_dir):
        metrics, objects = run_evaluation(prepared)
    if objects["trainer"].is_global_zero:
        print_json_line(
            {
                "metrics": metrics,
                "run_dir": objects["run_dir"],
                "weights": objects["weights"],
                "confusion_matrix_png": objects["confusion_matrix_png"],
            }
        )


if __name__ == "__main__":
    main()
