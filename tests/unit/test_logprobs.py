"""The chunked log-probability / entropy of ``learner.logprobs`` against the plain computation
(full logits, log-softmax): same values and same gradients for the hidden states and the weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.batching import token_logprobs
from learner.logprobs import linear_logprobs_entropy


def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):  # type: ignore[no-untyped-def]
    logits = hidden @ weight.T
    lp = token_logprobs(logits, targets, temperature)
    logp = torch.log_softmax(logits.float() / temperature, -1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 5, 64])  # chunks that split the rows unevenly, and one chunk
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_matches_plain_values_and_gradients(temperature: float, chunk: int, entropy_grad: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v = 13, 16, 37
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    results = []
    for fn in ("plain", "chunked"):
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fn == "plain":
            lp, ent = plain(hd, wt, targets, temperature)
        else:
            lp, ent = linear_logprobs_entropy(hd, wt, targets, temperature, chunk=chunk)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
        loss.backward()
        assert hd.grad is not None and wt.grad is not None
        results.append((lp.detach(), ent.detach(), hd.grad, wt.grad))
    # the chunked path computes in fp32 (the trainer's precision); the plain one keeps float64's
    # logits but also upcasts to fp32 in token_logprobs
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b.double(), a.double(), rtol=1e-4, atol=1e-4)
    # the plain entropy: a real check that the value is not trivially zero
    assert results[0][1].abs().min() > 0.1


def test_bf16_weight_gradient_accumulates_over_chunks_in_fp32() -> None:
    """bf16 as on the GPU: many chunks must not lose the weight gradient to bf16 partial sums."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 256, 32, 64
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * 0.2).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g)
    grads = []
    for chunk in (None, 4):
        wt = weight.clone().requires_grad_()
        hd = hidden.clone().requires_grad_()
        if chunk is None:
            lp, _ = plain(hd, wt, targets, 1.0)
        else:
            lp, _ = linear_logprobs_entropy(hd, wt, targets, 1.0, chunk=chunk)
        lp.sum().backward()
        assert wt.grad is not None and wt.grad.dtype == torch.bfloat16
        grads.append(wt.grad.float())
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-2)


def test_no_gradient_needed_under_no_grad() -> None:
    hidden, weight = torch.randn(4, 8), torch.randn(11, 8)
    targets = torch.tensor([0, 3, 10, 5])
    with torch.no_grad():
        lp, ent = linear_logprobs_entropy(hidden, weight, targets)
    ref_lp, ref_ent = plain(hidden, weight, targets, 1.0)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    assert not lp.requires_grad


def test_bad_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk"):
        linear_logprobs_entropy(torch.randn(2, 3), torch.randn(5, 3), torch.tensor([0, 1]), chunk=0)


def test_each_model_takes_the_fused_path_only_when_its_own_head_is_plain() -> None:
    """The policy's head is plain, a reference's (another checkpoint) is soft-capped: the
    reference's log-probabilities are its own logits', whichever model goes first. (The check ran
    once, on the first model: a reference after the policy went through the fused path and got
    hidden @ weight, the logits of a head it does not have.)"""
    import numpy as np
    from transformers import LlamaForCausalLM

    from flywheel.tiny import model_config
    from learner.batching import Sequence, build_micro_batch, stage
    from learner.trainer import Trainer

    class SoftCapped(LlamaForCausalLM):
        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = super().forward(*args, **kwargs)
            out.logits = 4.0 * torch.tanh(out.logits / 4.0)
            return out

    torch.manual_seed(0)
    config = model_config(vocab_size=64)
    policy, ref = LlamaForCausalLM(config).eval(), SoftCapped(config).eval()
    with torch.no_grad():  # logits large enough for the cap to matter
        ref.lm_head.weight.mul_(40.0)
    seq = Sequence(
        prompt=np.arange(5, 10, dtype=np.int32),
        response=np.arange(20, 28, dtype=np.int32),
        behav_logprobs=np.full(8, -1.0, dtype=np.float32),
        versions=np.zeros(8, dtype=np.int32),
        reward=1.0,
        group=0,
        staleness=0,
    )
    mb = build_micro_batch([seq], [0], packed=False, pad_id=0)
    smb = stage(mb, torch.device("cpu"))
    with torch.no_grad():
        logits = ref(torch.as_tensor(np.concatenate([seq.prompt, seq.response]), dtype=torch.long)[None]).logits[0]
        expected = torch.log_softmax(logits[len(seq.prompt) - 1 : -1].float(), -1)[
            torch.arange(8), torch.as_tensor(seq.response, dtype=torch.long)
        ]

    for order in ((policy, ref), (ref, policy)):
        trainer = Trainer.__new__(Trainer)
        trainer.engine, trainer.temperature, trainer.compile_loss = policy, 1.0, False
        trainer.fused_logprobs, trainer._fused_head = True, {}
        with torch.no_grad():
            for model in order:
                lp, _ = trainer._token_stats(model, mb, smb, entropy_grad=False)
                if model is ref:
                    torch.testing.assert_close(lp, expected, rtol=1e-4, atol=1e-4)
        assert trainer._fused_head == {id(policy): True, id(ref): False}
        assert trainer.fused_logprobs  # the policy keeps its fused path


@pytest.mark.parametrize("fused", [True, False])
def test_trainer_entropy_is_that_of_the_sampled_distribution(fused: bool) -> None:
    """At temperature T the generator samples from softmax(logits / T): the entropy the learner
    reports and regularises is that distribution's, on the fused path and on the plain one."""
    import numpy as np
    from transformers import LlamaForCausalLM

    from flywheel.tiny import model_config
    from learner.batching import Sequence, build_micro_batch, stage
    from learner.trainer import Trainer

    torch.manual_seed(0)
    policy = LlamaForCausalLM(model_config(vocab_size=64)).eval()
    seq = Sequence(
        prompt=np.arange(5, 10, dtype=np.int32),
        response=np.arange(20, 28, dtype=np.int32),
        behav_logprobs=np.full(8, -1.0, dtype=np.float32),
        versions=np.zeros(8, dtype=np.int32),
        reward=1.0,
        group=0,
        staleness=0,
    )
    mb = build_micro_batch([seq], [0], packed=False, pad_id=0)
    smb = stage(mb, torch.device("cpu"))
    temperature = 0.5
    with torch.no_grad():
        logits = policy(torch.as_tensor(np.concatenate([seq.prompt, seq.response]), dtype=torch.long)[None]).logits[0]
        logp = torch.log_softmax(logits[len(seq.prompt) - 1 : -1].float() / temperature, -1)
        expected_lp = logp[torch.arange(8), torch.as_tensor(seq.response, dtype=torch.long)]
        expected_ent = -(logp.exp() * logp).sum(-1)
        raw = torch.log_softmax(logits[len(seq.prompt) - 1 : -1].float(), -1)
        raw_ent = -(raw.exp() * raw).sum(-1)
    assert (expected_ent - raw_ent).abs().max() > 0.05  # the temperature changes the entropy here

    trainer = Trainer.__new__(Trainer)
    trainer.engine, trainer.temperature, trainer.compile_loss = policy, temperature, False
    trainer.fused_logprobs, trainer._fused_head = fused, {}
    with torch.no_grad():
        lp, ent = trainer._token_stats(policy, mb, smb, entropy_grad=False)
    torch.testing.assert_close(lp, expected_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, expected_ent, rtol=1e-4, atol=1e-4)


def test_the_learner_trains_without_dropout(tmp_path: Path) -> None:
    """A checkpoint whose config asks for dropout (attention_dropout here; GPT-2's resid_pdrop and
    the like too): the learner's forward in train mode took each log-probability under a random
    sub-network, against behaviour log-probabilities sampled without one. Now it loads with every
    dropout probability at 0: two forwards in train mode agree."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from flywheel.tiny import model_config
    from learner.trainer import config_without_dropout

    config = model_config(vocab_size=64)
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    ids = torch.arange(2, 30)[None]
    outputs = {}
    for name, conf in (("as saved", None), ("learner", config_without_dropout(str(tmp_path / "m")))):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", config=conf, attn_implementation="eager").train()
        outputs[name] = [model(ids).logits for _ in range(2)]
    assert not torch.equal(*outputs["as saved"])  # the checkpoint's dropout does act in train mode
    torch.testing.assert_close(*outputs["learner"])
    assert config_without_dropout(str(tmp_path / "m")).attention_dropout == 0.0
