"""Tasks: what the model trains and is evaluated on. A family (arithmetic, gsm8k, math, jsonl, code, pycode)
is one `Task` in its own module, registered by name below; the gen workers, evaluation and the
config reach the families only through the registry (toolrl.tasks.registry)."""
from toolrl.tasks.arithmetic import ArithmeticTask
from toolrl.tasks.base import DataError, Grading, Problem, Task, Teacher, TeacherTrace
from toolrl.tasks.code.procedural import ProceduralCodeTask
from toolrl.tasks.code.task import CodeTask
from toolrl.tasks.registry import (TASKS, get_task, load_problems, load_task, problem_stream, register_task,
                                   task_names, task_seed)
from toolrl.tasks.textmath import GSM8KTask, JsonlTask, MathTask

for _task in (ArithmeticTask(), GSM8KTask(), MathTask(), JsonlTask(), CodeTask(), ProceduralCodeTask()):
    register_task(_task)

__all__ = ["TASKS", "DataError", "Grading", "Problem", "Task", "Teacher", "TeacherTrace", "get_task",
           "load_problems", "load_task", "problem_stream", "register_task", "task_names", "task_seed"]
