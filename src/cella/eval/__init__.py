"""Evaluation harness: tasks run in fresh sandboxes forked from one prepared snapshot."""

from cella.eval.runner import EvalJob, Runner, arun_eval, run_eval, summarize
from cella.eval.tasks import Step, Task, TaskResult, load_tasks

__all__ = [
    "EvalJob",
    "Runner",
    "Step",
    "Task",
    "TaskResult",
    "arun_eval",
    "load_tasks",
    "run_eval",
    "summarize",
]
