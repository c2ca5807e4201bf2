"""LoGRA layers on HF Qwen2, the optimizer, and predicted-KL step control."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jvp

from membar import logra
from membar.logra import kl as kl_module

transformers = pytest.importorskip("transformers")


def tiny_qwen2(seed=0, vocab=48):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config)
    # Random init is close to uniform over the vocabulary; sharpen it so the Fisher is not tiny.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def test_linear_backward_gives_input_grad_and_sketch_without_weight_grad():
    torch.manual_seed(0)
    base = nn.Linear(40, 24)
    reference = copy.deepcopy(base)
    wrapper = nn.Sequential(base)
    handle = logra.apply_logra(wrapper, rank=8, targets=("0",), seed=3)
    x = torch.randn(2, 5, 40, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_(True)
    grad = torch.randn(2, 5, 24)
    wrapper(x).backward(grad)
    reference(x_reference).backward(grad)
    torch.testing.assert_close(x.grad, x_reference.grad)
    layer = handle.layers[0]
    assert layer.weight.grad is None and layer.bias.grad is None
    a = logra.generate(layer.current_key(), 8, 40)
    torch.testing.assert_close(layer.sketch, reference.weight.grad @ a.t(), rtol=1e-4, atol=1e-4)


def test_apply_logra_on_qwen2_with_checkpointing_matches_plain_sketch():
    model = tiny_qwen2()
    plain = copy.deepcopy(model)
    handle = logra.apply_logra(model, rank=8, seed=7)
    assert len(handle.layers) == 2 * 7
    assert all(not p.requires_grad for p in model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 48, (3, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    plain.train()
    plain(input_ids=ids, labels=ids).loss.backward()
    plain_modules = dict(plain.named_modules())
    for name, layer in zip(handle.names, handle.layers):
        dense = plain_modules[name].weight.grad
        a = logra.generate(layer.current_key(), 8, layer.in_features)
        torch.testing.assert_close(layer.sketch, dense @ a.t(), rtol=1e-3, atol=1e-5)
        assert layer.weight.grad is None


def test_redraw_between_forward_and_backward_is_an_error():
    wrapper = nn.Sequential(nn.Linear(8, 8))
    handle = logra.apply_logra(wrapper, rank=2, targets=("0",))
    out = wrapper(torch.randn(3, 8, requires_grad=True))
    handle.key_state.step += 1
    with pytest.raises(RuntimeError, match="redrawn between"):
        out.sum().backward()


def _random_updates(handle, scale=1.0, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(layer.out_features, layer.rank, generator=generator) * scale for layer in handle.layers]


def test_predicted_kl_matches_exact_quadratic_and_measured_kl():
    model = tiny_qwen2(seed=1)
    dense_model = copy.deepcopy(model).eval()
    handle = logra.apply_logra(model, rank=8, seed=11)
    ids = torch.randint(0, 48, (4, 10))
    mask = torch.ones(4, 10)
    mask[0, :3] = 0
    updates = _random_updates(handle)
    coefficient = 1e-3

    def probe():
        return model(input_ids=ids).logits, mask

    predicted = logra.predict_kl(model, handle.layers, updates, coefficient, probe).predicted_kl
    assert predicted > 0

    # Exact quadratic through an independent path: torch.func.jvp of the dense model with the
    # materialised dense direction dW = -c U A for every targeted weight.
    params = dict(dense_model.named_parameters())
    tangents = {name: torch.zeros_like(p) for name, p in params.items()}
    for name, layer, update in zip(handle.names, handle.layers, updates):
        a = logra.generate(layer.current_key(), layer.rank, layer.in_features)
        tangents[f"{name}.weight"] = -coefficient * update @ a
    with kl_module.forward_mode_attention():
        logits, tangent = jvp(lambda p: functional_call(dense_model, p, (ids,)).logits, (params,), (tangents,))
    exact = (kl_module.softmax_fisher_quadratic(logits, tangent) * mask).sum() / mask.sum()
    assert predicted == pytest.approx(exact.item(), rel=1e-3)

    # Measured KL after applying alpha * D for small alpha: within 25% of alpha^2 q(D).
    with torch.no_grad():
        before = model(input_ids=ids).logits
        target_kl = 2e-4
        alpha = math.sqrt(target_kl / predicted)
        for layer, update in zip(handle.layers, updates):
            logra.fused_update_(layer.weight, update, alpha * coefficient, layer.current_key())
        after = model(input_ids=ids).logits
    measured = logra.measured_kl(before, after, mask)
    assert measured == pytest.approx(target_kl, rel=0.25)


def test_step_scale_follows_the_formula():
    assert logra.step_scale(8e-4, delta=2e-4, alpha_max=1.0) == pytest.approx(0.5)
    assert logra.step_scale(1e-6, delta=2e-4, alpha_max=1.0) == 1.0
    assert logra.step_scale(0.0, delta=2e-4, alpha_max=0.7) == 0.7
    with pytest.raises(ValueError, match="not finite"):
        logra.step_scale(float("nan"), 1e-4, 1.0)


def test_optimizer_with_kl_control_hits_the_kl_target_and_trains():
    model = tiny_qwen2(seed=2)
    handle = logra.apply_logra(model, rank=8, seed=13)
    delta = 1e-3
    optimizer = logra.LoGRAOptimizer(handle, lr=1e-2, algorithm="adam",
                                      kl_control=logra.KLControl(delta=delta, alpha_max=1.0))
    torch.manual_seed(0)
    ids = torch.randint(0, 48, (8, 12))
    losses, kls = [], []
    for step in range(6):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            before = model(input_ids=ids).logits
        result = optimizer.step(kl_probe=lambda: model(input_ids=ids).logits)
        assert result.key_step == step  # redrawn after every update by default
        with torch.no_grad():
            after = model(input_ids=ids).logits
        kls.append(logra.measured_kl(before, after))
        assert result.alpha <= 1.0
        if result.alpha < 1.0:
            assert kls[-1] == pytest.approx(delta, rel=0.35)
    assert handle.key_state.step == 6
    assert losses[-1] < losses[0]
    assert all(layer.sketch.abs().sum() == 0 for layer in handle.layers)


@pytest.mark.parametrize("algorithm", ["adam", "sgd"])
def test_sketched_training_reduces_a_regression_loss(algorithm):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    handle = logra.apply_logra(model, rank=8, targets=("0", "2"), seed=1)
    lr = 3e-3 if algorithm == "adam" else 2e-2
    optimizer = logra.LoGRAOptimizer(handle, lr=lr, algorithm=algorithm, momentum=0.0)
    x = torch.randn(256, 32)
    with torch.no_grad():
        y = teacher(x)
    first = None
    for _ in range(150):
        loss = ((model(x) - y) ** 2).mean()
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first


def test_master_weights_keep_small_updates_that_bf16_would_swallow():
    torch.manual_seed(5)
    base = nn.Linear(64, 16).to(torch.bfloat16)
    with torch.no_grad():
        base.weight.fill_(1.0)
    handle = logra.apply_logra(nn.Sequential(base), rank=4, targets=("0",), master_weights=True)
    layer = handle.layers[0]
    update = torch.full((16, 4), 1e-4)
    for step in range(50):
        logra.fused_update_(layer.master, update, 1.0, layer.current_key())
    moved = (layer.master - 1.0).abs().max().item()
    assert moved > 1e-3  # 50 updates of ~1e-4 accumulate in fp32
    direct = torch.ones(16, 64, dtype=torch.bfloat16)
    for step in range(50):
        logra.fused_update_(direct, update, 1.0, layer.current_key())
    assert torch.all(direct == 1.0)  # each delta is below half a bf16 ulp of 1.0


def test_optimizer_rejects_bad_configuration():
    handle = logra.apply_logra(nn.Sequential(nn.Linear(4, 4)), rank=2, targets=("0",))
    with pytest.raises(ValueError, match="algorithm"):
        logra.LoGRAOptimizer(handle, lr=1e-3, algorithm="lion")
    with pytest.raises(ValueError, match="redraw_every"):
        logra.LoGRAOptimizer(handle, lr=1e-3, redraw_every=0)
    with pytest.raises(ValueError, match="moments_on_redraw"):
        logra.LoGRAOptimizer(handle, lr=1e-3, moments_on_redraw="transport")
    with pytest.raises(ValueError, match="no nn.Linear"):
        logra.apply_logra(nn.Sequential(nn.Linear(4, 4)), rank=2, targets=("q_proj",))
    optimizer = logra.LoGRAOptimizer(handle, lr=1e-3, kl_control=logra.KLControl())
    with pytest.raises(ValueError, match="kl_probe"):
        optimizer.step()


@pytest.mark.parametrize("policy", ["reset_first", "reset_both", "keep"])
def test_moments_follow_the_redraw_policy(policy):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(16, 12))
    handle = logra.apply_logra(model, rank=4, targets=("0",))
    optimizer = logra.LoGRAOptimizer(handle, lr=1e-3, redraw_every=2, moments_on_redraw=policy)
    x = torch.randn(8, 16)
    steps = []
    for update in range(3):
        model(x).square().sum().backward()
        optimizer.step()
        steps.append(handle.key_state.step)
        first, second = optimizer.moment("first_moment", 0), optimizer.moment("second_moment", 0)
        if update == 0:  # no redraw yet: both moments hold the first sketch
            assert first.abs().sum() > 0 and second.abs().sum() > 0
        if update == 1:  # the redraw happened after this update
            assert (first.abs().sum() == 0) == (policy != "keep")
            assert (second.abs().sum() == 0) == (policy == "reset_both")
    assert steps == [0, 1, 1]


def test_projection_in_backward_gives_the_same_sketches_as_in_forward():
    ids = torch.randint(0, 48, (2, 10), generator=torch.Generator().manual_seed(1))
    sketches = {}
    for projection in ("forward", "backward"):
        model = tiny_qwen2(seed=3)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        handle = logra.apply_logra(model, rank=8, seed=2, projection=projection)
        assert all(layer.projection == projection for layer in handle.layers)
        model(input_ids=ids, labels=ids).loss.backward()
        sketches[projection] = [layer.sketch.clone() for layer in handle.layers]
    for forward, backward in zip(sketches["forward"], sketches["backward"]):
        assert forward.abs().sum() > 0
        torch.testing.assert_close(forward, backward, rtol=1e-5, atol=1e-7)
    # "auto" follows the model's checkpointing.
    model = tiny_qwen2()
    assert logra.apply_logra(model, rank=4).layers[0].projection == "forward"
    model = tiny_qwen2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert logra.apply_logra(model, rank=4).layers[0].projection == "backward"
    with pytest.raises(ValueError, match="projection"):
        logra.apply_logra(tiny_qwen2(), rank=4, projection="sideways")


def test_flat_adam_over_all_layers_matches_per_layer_adam():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))
    reference_weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    handle = logra.apply_logra(model, rank=5, targets=("0", "2"), seed=1)
    lr, beta1, beta2, eps = 1e-2, 0.9, 0.999, 1e-8
    optimizer = logra.LoGRAOptimizer(handle, lr=lr, betas=(beta1, beta2), eps=eps, moments_on_redraw="keep",
                                     stochastic_rounding=False)
    first = [torch.zeros(layer.out_features, 5) for layer in handle.layers]
    second = [torch.zeros(layer.out_features, 5) for layer in handle.layers]
    x = torch.randn(16, 12)
    for update in range(3):
        model(x).square().mean().backward()
        sketches = [layer.sketch.clone() for layer in handle.layers]
        keys = [layer.current_key() for layer in handle.layers]
        assert handle.states.flat("sketch").data_ptr() == handle.layers[0].sketch.data_ptr()
        optimizer.step()
        for index, layer in enumerate(handle.layers):
            first[index] = beta1 * first[index] + (1 - beta1) * sketches[index]
            second[index] = beta2 * second[index] + (1 - beta2) * sketches[index] ** 2
            direction = (first[index] / (1 - beta1 ** (update + 1))) / (
                (second[index] / (1 - beta2 ** (update + 1))).sqrt() + eps)
            a = logra.generate(keys[index], 5, layer.in_features)
            reference_weights[index] = reference_weights[index] - lr * direction @ a
            torch.testing.assert_close(layer.weight.detach(), reference_weights[index], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(optimizer.moment("first_moment", index), first[index])
        assert handle.layers[0].sketch.abs().sum() == 0, "the step consumes the sketches"


def test_chunked_linear_cross_entropy_matches_full_logits():
    from membar.logra.loss import causal_lm_loss, chunked_linear_cross_entropy

    torch.manual_seed(10)
    hidden = torch.randn(3, 37, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.5).requires_grad_(True)
    bias = torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 37))
    labels[0, :5] = -100
    loss = chunked_linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=10)
    (3 * loss).backward()
    copies = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    reference = F.cross_entropy(F.linear(*copies).reshape(-1, 50), labels.reshape(-1))
    (3 * reference).backward()
    torch.testing.assert_close(loss, reference)
    for mine, theirs in zip((hidden, weight, bias), copies):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    summed = chunked_linear_cross_entropy(hidden.detach(), weight.detach(), labels, bias=bias.detach(),
                                          reduction="sum", chunk_tokens=7)
    torch.testing.assert_close(summed, reference.detach() * (labels != -100).sum(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="leading"):
        chunked_linear_cross_entropy(hidden, weight, labels[:, :5])
    # On an HF model: the same loss and sketches as HF's own loss.
    model = tiny_qwen2(seed=4)
    twin = copy.deepcopy(model)
    handles = [logra.apply_logra(m, rank=4, seed=5) for m in (model, twin)]
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(2))
    mine = causal_lm_loss(model, ids, chunk_tokens=5)
    mine.backward()
    theirs = twin(input_ids=ids, labels=ids).loss
    theirs.backward()
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    for a, b in zip(handles[0].layers, handles[1].layers):
        torch.testing.assert_close(a.sketch, b.sketch, rtol=1e-4, atol=1e-6)
