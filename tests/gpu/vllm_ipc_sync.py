"""Real vLLM on a GPU takes a learner's weights over the ``ipc`` transport, through Flywheel's
worker extension: rank 0 (this process) and the vLLM worker (in vLLM's engine-core process) on
one device, where NCCL refuses the pair. Needs vLLM and a CUDA GPU (see
../shared/gpu/VLLM_ON_H200.md); not collected by pytest (run it: python tests/gpu/vllm_ipc_sync.py).

Checks: the worker's load succeeds, every parameter's sum in vLLM doubles when the weights sent
are the checkpoint's times two (exact in bf16), a second sync in the same group (the buffers kept
open) halves them again, and the engine still generates.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def build(path: Path) -> torch.nn.Module:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = 4096
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(4, vocab_size)]
    tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=688, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def sync(llm: object, version: int, tensors: dict[str, torch.Tensor], store: object, epoch: int) -> dict:
    from flywheel.weights import join_group, plan_buckets, send
    from flywheel.weights_ipc import sync_prefix
    from flywheel.wire import WeightsReady, encode

    buckets = plan_buckets(tensors.items(), 1 << 20)  # 1 MiB: many buckets through the two buffers
    deadline = time.time() + 60
    ready = WeightsReady(
        version=version, buckets=buckets, transport="ipc", deadline=deadline, epoch=epoch,
        master_addr="127.0.0.1", master_port=store.port, world_size=2, ranks={"g": 1},  # type: ignore[attr-defined]
    )  # fmt: skip
    errors: list[BaseException] = []
    groups = SYNC_GROUP

    def rank0() -> None:
        try:
            if not groups:
                groups.append(join_group("ipc", "127.0.0.1", store.port, 0, 2, epoch, 60, store=store, device="cuda:0"))  # type: ignore[attr-defined]
            group = groups[0]
            group.deadline, group.sync_prefix = deadline, sync_prefix(version, deadline)
            send(group, buckets, tensors)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    sender = threading.Thread(target=rank0)
    sender.start()
    started = time.perf_counter()
    (result,) = llm.collective_rpc("flywheel_update_weights", args=(encode(ready), 1, 1 << 34))  # type: ignore[attr-defined]
    sender.join(60)
    assert not errors and result["ok"], (errors, result)
    llm.reset_prefix_cache()  # type: ignore[attr-defined]
    print(f"sync v{version}: {len(buckets)} buckets in {time.perf_counter() - started:.3f}s", flush=True)
    return result


SYNC_GROUP: list = []


def main() -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams

    from flywheel.weights import host_store

    path = Path("/tmp/ipc-model")
    model = build(path)
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        gpu_memory_utilization=0.25,
        enforce_eager=True,
        seed=0,
        worker_extension_cls="generators.worker_ext.WeightReceiverExtension",
    )

    def sums() -> dict[str, float]:
        (digest,) = llm.collective_rpc("flywheel_weight_digest")
        return dict(digest)

    before = sums()
    store = host_store("127.0.0.1", 60)
    named = {n: p.detach().to("cuda:0") for n, p in model.named_parameters()}
    sync(llm, 1, {n: t * 2 for n, t in named.items()}, store, epoch=5)
    doubled = sums()
    bad = [n for n in before if abs(doubled[n] - 2 * before[n]) > 1e-3 * max(1.0, abs(before[n]))]
    assert not bad, [(n, before[n], doubled[n]) for n in bad[:5]]
    sync(llm, 2, named, store, epoch=5)  # the same group: rank 0's buffers already open
    again = sums()
    bad = [n for n in before if abs(again[n] - before[n]) > 1e-3 * max(1.0, abs(before[n]))]
    assert not bad, [(n, before[n], again[n]) for n in bad[:5]]
    out = llm.generate([{"prompt_token_ids": list(range(5, 30))}], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8
    print(f"{len(before)} vLLM parameters doubled and restored over ipc; IPC VLLM OK", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
