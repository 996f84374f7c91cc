"""TrainingMonitor on a tiny Llama trained on sim: the norms it writes equal a hand computation, a NaN and a spike
are flagged at their step, naming the parameter, and TensorBoard is written or refused as documented."""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import logging
import math
import os
import time

import pytest
import torch
from tiny_models import lm_step, tiny_llama
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import op_tools

STEPS = 5


def _train(device, results_dir, steps=STEPS, scale=None, **monitor_args):
    """Train a tiny Llama ``steps`` AdamW steps under a monitor; ``scale(step)`` multiplies that step's loss. Returns
    the monitor and, per step, the gradient norms computed by hand (our own pre-step hook, before the monitor's)."""
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    by_hand: list[dict[str, float]] = []

    def hand_norms(opt, *_):
        by_hand.append({n: p.grad.cpu().double().norm().item() for n, p in model.named_parameters()
                        if p.grad is not None})

    hook = register_optimizer_step_pre_hook(hand_norms)
    try:
        with op_tools.TrainingMonitor(results_dir=str(results_dir), model=model, **monitor_args) as monitor:
            for step in range(steps):
                loss = model(input_ids=ids, labels=ids).loss
                if scale is not None:
                    loss = loss * scale(step)
                loss.backward()
                monitor.log_loss(loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        hook.remove()
    return model, monitor, by_hand


def _rows(monitor):
    with open(monitor.csv_path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _anomalies(monitor):
    with open(monitor.anomalies_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_gradient_norms_written_equal_a_hand_computation(sim, tmp_path):
    model, monitor, by_hand = _train(sim, tmp_path)
    rows = _rows(monitor)
    names = [n for n, _ in model.named_parameters()]
    for step in range(STEPS):
        written = {r["name"]: r for r in rows if r["step"] == str(step)}
        assert [n for n in written if n in names] == names  # every parameter, in model order
        for name in names:
            assert float(written[name]["grad_norm"]) == pytest.approx(by_hand[step][name], rel=1e-5)
        expected_global = math.sqrt(sum(v * v for v in by_hand[step].values()))
        assert float(written["global_grad_norm"]["value"]) == pytest.approx(expected_global, rel=1e-5)
        assert float(written["lr/param_groups[0]"]["value"]) == 1e-3
        assert math.isfinite(float(written["loss"]["value"]))
    assert monitor.anomalies == []
    assert _anomalies(monitor) == []


def test_weight_norms_are_read_before_the_step(sim, tmp_path):
    torch.manual_seed(0)
    expected = {n: p.detach().double().norm().item() for n, p in tiny_llama().named_parameters()}
    _, monitor, _ = _train(sim, tmp_path, steps=1)
    written = {r["name"]: r for r in _rows(monitor) if r["weight_norm"]}
    assert {n: pytest.approx(float(r["weight_norm"]), rel=1e-5) for n, r in written.items()} == expected


def test_a_nan_in_layer_1_backward_names_layer_1_nearest_the_output(sim, tmp_path):
    """From step 3, the gradient leaving layer 1's MLP is NaN: every parameter the backward reaches after it (layer 1's
    attention and norms, layer 0, the embedding) gets a NaN gradient, the MLP's own and those nearer the output do
    not. The anomaly fires once, at step 3: the first NaN in model order is the embedding, and the one nearest the
    output, where backward met the NaN first, is layer 1's post-attention norm."""
    state = {"step": 0}

    def poison(module, grad_input, grad_output):
        return tuple(g * float("nan") for g in grad_input) if state["step"] >= 3 else None

    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    model.model.layers[1].mlp.register_full_backward_hook(poison)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model) as monitor:
        for step in range(5):
            state["step"] = step
            lm_step(model, optimizer, ids)
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "nonfinite_grad" and anomaly["step"] == 3
    assert anomaly["parameter"] == "model.embed_tokens.weight"
    assert anomaly["nearest_output"] == "model.layers.1.post_attention_layernorm.weight"
    nan_at_3 = [r["name"] for r in _rows(monitor)
                if r["step"] == "3" and r["grad_norm"] and math.isnan(float(r["grad_norm"]))]
    upstream = [n for n, _ in model.named_parameters()
                if n.startswith(("model.embed_tokens", "model.layers.0.")) or
                n.startswith("model.layers.1.") and ".mlp." not in n]
    assert nan_at_3 == upstream
    assert not any(int(r["step"]) < 3 and r["grad_norm"] and math.isnan(float(r["grad_norm"])) for r in _rows(monitor))


def test_a_nan_in_layer_1_forward_makes_every_gradient_nan_at_that_step(sim, tmp_path):
    """A sim fault in layer 1's silu makes the loss NaN, hence every gradient: the anomaly fires at the fault's first
    step and, every gradient being NaN, names the first parameter in model order (grad norms cannot localise a forward
    NaN; docs/tools/training_monitor.md)."""
    import ditorch.sim

    state = {"step": 0}

    def scale(step):
        state["step"] = step
        if step == 3:
            ditorch.sim.inject_fault("silu", "nan", module="model.layers.1")
        return 1.0

    # the fault is set after step 3's forward by `scale`: it poisons step 4's forward first
    _, monitor, _ = _train(sim, tmp_path, steps=6, scale=scale)
    [anomaly] = _anomalies(monitor)
    assert anomaly["step"] == 4 and anomaly["parameter"] == "model.embed_tokens.weight"
    assert anomaly["count"] == anomaly["of"] == len(list(tiny_llama().parameters()))


def test_a_loss_spike_fires_the_spike_rule_once(sim, tmp_path, caplog):
    _, monitor, by_hand = _train(sim, tmp_path, steps=6, scale=lambda step: 1000.0 if step == 4 else 1.0)
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "grad_norm_spike" and anomaly["step"] == 4
    assert anomaly["parameter"] == "model.embed_tokens.weight"
    assert anomaly["value"] == pytest.approx(by_hand[4]["model.embed_tokens.weight"], rel=1e-5)
    assert anomaly["value"] > 10 * anomaly["moving_average"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "op_tools"]
    assert len(warnings) == 1 and "spike at step 4: model.embed_tokens.weight" in warnings[0]


def test_every_and_modules_narrow_what_is_written(sim, tmp_path):
    _, monitor, _ = _train(sim, tmp_path, steps=4, every=2, modules=[r"model\.layers\.1\."])
    rows = [r for r in _rows(monitor) if r["weight_norm"]]
    assert {r["step"] for r in rows} == {"0", "2"}
    assert rows and all(r["name"].startswith("model.layers.1.") for r in rows)


def test_tensorboard_is_written_when_installed_and_refused_clearly_when_not(sim, tmp_path, caplog):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            op_tools.TrainingMonitor(results_dir=str(tmp_path), tensorboard=True)
        caplog.set_level(logging.INFO, logger="op_tools")
        _, monitor, _ = _train(sim, tmp_path, steps=1)
        assert "no TensorBoard files (tensorboard is not installed: pip install tensorboard)" in caplog.text
        assert glob.glob(os.path.join(tmp_path, "**", "events.out.tfevents.*"), recursive=True) == []
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, monitor, by_hand = _train(sim, tmp_path, tensorboard=True)
    events = EventAccumulator(monitor.tensorboard_dir)
    events.Reload()
    written = [e.value for e in events.Scalars("grad_norm/model.layers.1.mlp.up_proj.weight")]
    assert written == pytest.approx([h["model.layers.1.mlp.up_proj.weight"] for h in by_hand], rel=1e-5)


def test_update_ratio_equals_the_weights_change_over_their_norm(sim, tmp_path):
    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before, by_hand = {}, []

    def keep(opt, *_):
        before.update({n: p.detach().cpu().double() for n, p in model.named_parameters()})

    def ratio(opt, *_):
        by_hand.append({n: (p.detach().cpu().double() - before[n]).norm().item() / before[n].norm().item()
                        for n, p in model.named_parameters()})

    hooks = (register_optimizer_step_pre_hook(keep), register_optimizer_step_post_hook(ratio))
    try:
        with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model, update_ratio=True) as monitor:
            for _ in range(3):
                lm_step(model, optimizer, ids)
    finally:
        for hook in hooks:
            hook.remove()
    rows = [r for r in _rows(monitor) if r["weight_norm"]]
    assert len(rows) == 3 * len(by_hand[0])
    for r in rows:
        assert float(r["update_ratio"]) == pytest.approx(by_hand[int(r["step"])][r["name"]], rel=1e-4)
    assert all(float(r["update_ratio"]) > 0 for r in rows)


def test_step_time_is_written_for_every_step_and_spans_the_loop(sim, tmp_path):
    started = time.perf_counter()
    _, monitor, _ = _train(sim, tmp_path, steps=3)
    elapsed = time.perf_counter() - started
    times = {r["step"]: float(r["value"]) for r in _rows(monitor) if r["name"] == "step_time"}
    assert sorted(times) == ["0", "1", "2"]
    assert all(t > 0 for t in times.values()) and sum(times.values()) < elapsed


def _train_scaled(device, results_dir, init_scale, iterations, inf_at=(), **monitor_args):
    """Train a tiny Llama under float16 autocast and a GradScaler; the loss of the iterations in ``inf_at`` is made
    inf. Returns the monitor and the scale read by hand at each optimizer step (GradScaler skips the steps whose
    gradients are not finite: no optimizer hook sees them)."""
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    by_hand: list[float] = []
    hook = register_optimizer_step_pre_hook(lambda *_: by_hand.append(scaler.get_scale()))
    try:
        with op_tools.TrainingMonitor(results_dir=str(results_dir), model=model, scaler=scaler,
                                      **monitor_args) as monitor:
            for iteration in range(iterations):
                with torch.autocast(device, dtype=torch.float16):
                    loss = model(input_ids=ids, labels=ids).loss
                scaler.scale(loss * (float("inf") if iteration in inf_at else 1.0)).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    finally:
        hook.remove()
    return monitor, by_hand


def test_a_huge_initial_scale_falling_before_the_first_step_fires_the_loss_scale_rule(sim, tmp_path, caplog):
    """float16 gradients overflow at 2**24: GradScaler skips those iterations and halves the scale until they fit. The
    first optimizer step sees the scale after all those halvings: the rule fires there, counting them."""
    monitor, by_hand = _train_scaled(sim, tmp_path, init_scale=2.0**24, iterations=12)
    drops = round(math.log2(2.0**24 / by_hand[0]))
    assert drops >= 3 and len(by_hand) == 12 - drops  # the skipped iterations are no steps
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "loss_scale_dropping" and anomaly["step"] == 0
    assert anomaly["value"] == by_hand[0] and anomaly["drops"] == drops
    written = {int(r["step"]): float(r["value"]) for r in _rows(monitor) if r["name"] == "loss_scale"}
    assert written == dict(enumerate(by_hand))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "op_tools"]
    assert len(warnings) == 1 and f"loss scale dropping at step 0: {by_hand[0]:g} after {drops} drops" in warnings[0]


def test_a_scale_falling_between_consecutive_steps_fires_once_at_the_third_fall(sim, tmp_path):
    """An inf loss on every other iteration: each optimizer step sees half the scale of the one before. With
    scale_drops=3 the rule fires at step 3 (three falls since step 0), and once only."""
    monitor, by_hand = _train_scaled(sim, tmp_path, init_scale=2.0**8, iterations=10, inf_at=(1, 3, 5, 7))
    assert by_hand == [2.0**8, 2.0**7, 2.0**6, 2.0**5, 2.0**4, 2.0**4]
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "loss_scale_dropping" and anomaly["step"] == 3
    assert anomaly["value"] == 2.0**5 and anomaly["drops"] == 3


def test_a_healthy_scaler_fires_no_loss_scale_rule(sim, tmp_path):
    monitor, by_hand = _train_scaled(sim, tmp_path, init_scale=2.0**8, iterations=4)
    assert by_hand == [2.0**8] * 4
    written = [float(r["value"]) for r in _rows(monitor) if r["name"] == "loss_scale"]
    assert written == by_hand
    assert _anomalies(monitor) == []


def test_scaler_and_scale_drops_are_validated(tmp_path):
    with pytest.raises(TypeError, match="scaler="):
        op_tools.TrainingMonitor(results_dir=str(tmp_path), scaler=torch.optim.SGD)
    with pytest.raises(ValueError, match="scale_drops=0"):
        op_tools.TrainingMonitor(results_dir=str(tmp_path), scale_drops=0)
