"""Code that runs inside each vLLM worker (``worker_extension_cls``): it joins the learner's
weight group and reloads the received weights in place, without restarting the engine.

Called through ``AsyncLLM.collective_rpc("flywheel_update_weights", ...)``. Tensors cannot travel
as RPC arguments, so the call carries the encoded ``WeightsReady`` and the weights themselves
arrive over the process group (gloo on CPUs, NCCL on GPUs), or through CUDA IPC buffers on a GPU
the learner shares (``ipc``, ``flywheel.weights_ipc``), one bucket at a time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flywheel.weights import WeightGroup, WeightSyncError, check_layout, join_announced, receive
from flywheel.wire import Decoder, WeightsReady, WireError


class _RotaryReloadNotice(logging.Filter):
    """vLLM's in-place reload warns "RotaryEmbedding: Failed to load weights" at every sync: the
    layer's cos/sin cache is computed, never in a checkpoint (nor in what the learner sends), and
    vLLM puts the old one back. Expected, so not logged; the same warning for any other layer is."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        expected = (
            record.msg == "%s: Failed to load weights" and bool(args) and str(args[0]).endswith("RotaryEmbedding")
        )
        return not expected


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNotice())


class WeightReceiverExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``device``, ...)."""

    _flywheel_group: WeightGroup | None = None

    def flywheel_update_weights(self, ready_bytes: bytes, first_rank: int, max_bytes: int) -> dict[str, Any]:
        """Receive and load the weights of one sync. Never raises: the result says what happened.

        ``touched`` tells the caller whether the model's weights were partly overwritten before a
        failure, in which case this worker must not generate until a sync succeeds.
        """
        start = time.perf_counter()
        touched = False
        try:
            ready = Decoder(WeightsReady).decode(ready_bytes)
            assert isinstance(ready, WeightsReady)
            check_layout(ready.buckets, max_bytes)
            group = self._flywheel_join(ready, first_rank + self._flywheel_tp_rank())
            loaded = 0

            failed: list[Exception] = []

            def stream() -> Any:
                nonlocal touched, loaded
                try:
                    for name, tensor in receive(group, ready):
                        touched = True
                        loaded += 1
                        yield name, tensor
                except (WeightSyncError, RuntimeError) as err:
                    # End the stream instead of raising through vLLM: its in-place reload must
                    # reach its finalize step, or the layers it moved to the meta device stay
                    # there and the engine dies at its next forward pass. Layers that got
                    # nothing keep their old tensors; this worker serves nothing until a sync
                    # succeeds (``touched``).
                    failed.append(err)

            tensors = stream()
            try:
                self.model_runner.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
            except Exception as err:  # vLLM's own loader failed (a name or a shape it does not know)
                # The rest of the broadcast is received all the same, and dropped: every bucket
                # is a collective of the whole group, and a rank that stopped taking part would
                # fail the sync of every other generator in it, at every sync while the cause lasts.
                for _ in tensors:
                    pass
                # Its in-place reload moved every layer to the meta device first and puts them
                # back only in its finalize step, which an error in the loader skips: the engine
                # would die at its next forward. Layers not loaded get their old tensors back.
                touched = True
                self._flywheel_finalize_reload()
                raise WeightSyncError(f"vLLM could not load the weights: {type(err).__name__}: {err}") from err
            if ready.transport in ("nccl", "ipc"):
                # NCCL's wait() orders the device stream, it does not block this thread: without
                # this the ack would go out before the bytes are in (and miss a late NCCL error)
                import torch

                torch.cuda.synchronize(self.device)  # type: ignore[attr-defined]
            if failed:
                raise failed[0]
            expected = sum(len(b.names) for b in ready.buckets)
            if loaded != expected:
                raise WeightSyncError(f"loaded {loaded} of {expected} tensors")
        except (WeightSyncError, WireError, ValueError, KeyError, RuntimeError) as err:
            self._flywheel_drop_group()
            return {"ok": False, "error": f"{type(err).__name__}: {err}", "touched": touched}
        return {"ok": True, "error": None, "touched": touched, "seconds": time.perf_counter() - start}

    def flywheel_weight_digest(self) -> list[tuple[str, float]]:
        """Sum of each parameter (tests compare it with the learner's model)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return [(name, float(p.detach().float().sum())) for name, p in model.named_parameters()]

    def _flywheel_join(self, ready: WeightsReady, rank: int) -> WeightGroup:
        group = self._flywheel_group
        if group is not None and group.epoch == ready.epoch:
            group.op_timeout_s = max(ready.due - time.time(), 0.1)  # this sync's, not the first one's
            group.deadline = ready.due
            return group
        self._flywheel_drop_group()
        # gloo moves host memory (the loader copies each tensor to the model's device); NCCL
        # receives straight into device memory
        device = self.device if ready.transport in ("nccl", "ipc") else "cpu"  # type: ignore[attr-defined]
        group = join_announced(ready, rank, device)
        group.deadline = ready.due
        self._flywheel_group = group
        return group

    def _flywheel_finalize_reload(self) -> None:
        """vLLM's finalize step of an in-place reload. Where it cannot run (a vLLM laid out
        otherwise), the load still counts as ``touched``: the generator serves nothing until a
        sync succeeds."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            runner = self.model_runner  # type: ignore[attr-defined]
            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        except Exception as err:  # (reported with the load's own error; nothing more to do here)
            logging.getLogger(__name__).error("could not finalize the failed reload: %s: %s", type(err).__name__, err)

    def _flywheel_drop_group(self) -> None:
        if self._flywheel_group is not None:
            self._flywheel_group.close()
            self._flywheel_group = None

    @staticmethod
    def _flywheel_tp_rank() -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
