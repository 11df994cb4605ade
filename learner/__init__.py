"""The DeepSpeed learner (``python -m learner``)."""

from __future__ import annotations

import sys
import types

_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _without_deepspeed_muon() -> None:
    """DeepSpeed's ZeRO optimizers import its Muon optimizer to ask ``isinstance(opt, Muon)``, and
    importing it torch.compiles Muon's kernels: 1.5-3 s of every learner start, a restart after a
    crash included, for an optimizer Flywheel never uses. A stand-in module answers the question
    (no optimizer is one of its class) without compiling anything. Left alone when the real one
    is already imported."""
    if _MUON in sys.modules:
        return
    stub = types.ModuleType(_MUON, "Flywheel's stand-in: Muon is not used, so nothing is compiled for it.")

    class MuonWithAuxAdam:  # never instantiated: every isinstance check answers no
        pass

    stub.MuonWithAuxAdam = MuonWithAuxAdam  # type: ignore[attr-defined]
    sys.modules[_MUON] = stub


_without_deepspeed_muon()
