"""The eager decoder's elementwise forms (`engine/elementwise.py`): the soft cap and the GELU on `exp` compute what
transformers' tanh forms compute, to float rounding, over the range logits and activations take and past it; the
eager logits are the model's own."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.activations import GELUTanh

from canvas_ls.engine.elementwise import SigmoidGELUTanh, cheaper_activations, eager_logits, softcap_
from canvas_ls.engine.loading import load_model


def test_the_soft_cap_on_exp_is_cap_times_tanh_and_saturates_without_nan() -> None:
    x = torch.cat([torch.linspace(-200, 200, 40_001), torch.tensor([-1e4, 1e4, -3e38, 3e38, 0.0, -0.0])])
    reference = 30.0 * torch.tanh(x / 30.0)
    capped = softcap_(x.clone(), 30.0)
    assert torch.isfinite(capped).all()
    assert float((capped - reference).abs().max()) < 2e-5
    assert capped[-6:-2].tolist() == [-30.0, 30.0, -30.0, 30.0]  # a barred logit stays far below, capped


def test_the_gelu_on_sigmoid_is_transformers_gelu_tanh_with_and_without_gradients() -> None:
    x = torch.cat([torch.linspace(-12, 12, 24_001), torch.tensor([-80.0, 80.0])])
    reference = GELUTanh()(x)
    assert float((SigmoidGELUTanh()(x.clone()) - reference).abs().max()) < 1e-5
    leaf = x.clone().requires_grad_()
    SigmoidGELUTanh()(leaf).sum().backward()  # out of place where autograd records: no in-place error
    expected = x.clone().requires_grad_()
    GELUTanh()(expected).sum().backward()
    assert float((leaf.grad - expected.grad).abs().max()) < 1e-4


def test_the_eager_logits_are_the_models_own(tiny_model_dir: Path) -> None:
    """transformers' forward against the eager path (LM head, soft cap on exp) and the GELU swapped in: the same
    logits to float rounding, the same argmax."""
    model = load_model(str(tiny_model_dir), "cpu", dtype="float32").model
    torch.manual_seed(0)
    inputs = {"input_ids": torch.randint(5, 200, (1, 12)), "decoder_input_ids": torch.randint(5, 200, (1, 8))}
    with torch.inference_mode():
        expected = model(**inputs).logits
        swapped = cheaper_activations(model)
        logits = eager_logits(model, inputs)
    # every one: the layers' MLPs and experts, encoder and decoder, the vision tower's, the self-conditioning block's
    assert swapped == 10 and not any(type(module) is GELUTanh for module in model.modules())
    assert float((logits - expected).abs().max()) < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
