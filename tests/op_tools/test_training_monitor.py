"""TrainingMonitor on a tiny Llama trained on sim: the figures it writes equal a hand computation, the first NaN is
named with its module, phase and step, spikes and a dropping loss scale are flagged at their step, and TensorBoard
event files read back as written."""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import logging
import math
import os
import re
import time

import pytest
import torch
from browser import chromium, dump_dom, needs_browser
from tiny_models import lm_step, tiny_llama
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import op_tools

STEPS = 10


def _train(device, results_dir, steps=STEPS, scale=None, before_step=None, **monitor_args):
    """Train a tiny Llama ``steps`` AdamW steps under a monitor; ``scale(step)`` multiplies that step's loss,
    ``before_step(step, model)`` runs before its forward. Returns the model, the monitor and, per step, the figures
    computed by hand (our own hooks, registered before the monitor's)."""
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    by_hand: list[dict] = []

    def hand_norms(opt, *_):
        by_hand.append({n: p.grad.cpu().double().norm().item() for n, p in model.named_parameters()
                        if p.grad is not None})

    hook = register_optimizer_step_pre_hook(hand_norms)
    try:
        with op_tools.TrainingMonitor(results_dir=str(results_dir), **{"model": model, **monitor_args}) as monitor:
            for step in range(steps):
                if before_step is not None:
                    before_step(step, model)
                loss = model(input_ids=ids, labels=ids).loss
                if scale is not None:
                    loss = loss * scale(step)
                loss.backward()
                by_hand_loss = loss.item()
                optimizer.step()
                by_hand[-1]["loss"] = by_hand_loss
                optimizer.zero_grad()
    finally:
        hook.remove()
    return model, monitor, by_hand


def _rows(monitor):
    with open(monitor.csv_path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _figures(monitor) -> dict[int, dict[tuple[str, str, str], float]]:
    """step -> (kind, name, statistic) -> value."""
    out: dict[int, dict] = {}
    for r in _rows(monitor):
        out.setdefault(int(r["step"]), {})[(r["kind"], r["name"], r["statistic"])] = float(r["value"])
    return out


def _anomalies(monitor):
    """The anomalies file's records, read as standard JSON (no bare NaN nor Infinity)."""
    def refused(constant):
        raise ValueError(f"{constant} is not standard JSON")

    with open(monitor.anomalies_path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=refused) for line in f]


def test_gradient_norms_and_loss_written_equal_a_hand_computation_at_each_step(sim, tmp_path):
    model, monitor, by_hand = _train(sim, tmp_path)
    figures = _figures(monitor)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(figures) == list(range(STEPS))
    for step in range(STEPS):
        written = figures[step]
        grads = [name for kind, name, s in written if kind == "parameter" and s == "grad_norm"]
        assert grads == names  # every parameter, in model order
        for name in names:
            assert written[("parameter", name, "grad_norm")] == pytest.approx(by_hand[step][name], rel=1e-5)
        expected_global = math.sqrt(sum(by_hand[step][n] ** 2 for n in names))
        assert written[("step", "", "global_grad_norm")] == pytest.approx(expected_global, rel=1e-5)
        assert written[("step", "", "lr/param_groups[0]")] == 1e-3
        assert written[("step", "", "loss")] == pytest.approx(by_hand[step]["loss"], rel=1e-6)  # the backward root
    assert monitor.anomalies == []
    assert _anomalies(monitor) == []


def test_without_model_the_outermost_module_names_parameters_and_layers(sim, tmp_path):
    model, monitor, _ = _train(sim, tmp_path, steps=2, model=None)
    written = _figures(monitor)[1]
    assert [n for k, n, s in written if k == "parameter" and s == "grad_norm"] == [n for n, _ in
                                                                                   model.named_parameters()]
    assert {n for k, n, _ in written if k == "activation"} == {"model.layers.0", "model.layers.1"}


def test_weight_norms_are_read_before_the_step(sim, tmp_path):
    torch.manual_seed(0)
    expected = {n: p.detach().double().norm().item() for n, p in tiny_llama().named_parameters()}
    _, monitor, _ = _train(sim, tmp_path, steps=1)
    written = {n: v for (k, n, s), v in _figures(monitor)[0].items() if s == "weight_norm"}
    assert written == {n: pytest.approx(v, rel=1e-5) for n, v in expected.items()}


def test_layer_outputs_and_their_gradients_equal_a_hand_computation(sim, tmp_path):
    """The blocks (model.layers.<i>) by default: the statistics of each block's output in forward and of the
    gradient w.r.t. it in backward, read by hand through hooks of our own."""
    by_hand: dict[tuple[str, str], torch.Tensor] = {}

    def hooks(step, model):
        if step:
            return
        for i, layer in enumerate(model.model.layers):
            def keep(module, args, output, name=f"model.layers.{i}"):
                out = output[0] if isinstance(output, tuple) else output
                if torch.is_grad_enabled():
                    by_hand[("activation", name)] = out.detach().cpu().double()
                    out.register_hook(lambda g: by_hand.__setitem__(("output_grad", name), g.cpu().double()))
            layer.register_forward_hook(keep)

    _, monitor, _ = _train(sim, tmp_path, steps=1, before_step=hooks)
    written = _figures(monitor)[0]
    assert {(k, n) for k, n, _ in written if k in ("activation", "output_grad")} == set(by_hand)
    for (kind, name), t in by_hand.items():
        expected = {"norm": t.norm(), "mean": t.mean(), "std": t.std(), "min": t.min(), "max": t.max()}
        for statistic, value in expected.items():
            assert written[(kind, name, statistic)] == pytest.approx(value.item(), rel=1e-4, abs=1e-7), \
                (kind, name, statistic)


class _Checkpointed(torch.nn.Module):
    """Two blocks, each run under torch.utils.checkpoint when ``checkpointed`` (then backward calls each block a
    second time)."""

    def __init__(self, checkpointed=True):
        super().__init__()
        self.checkpointed = checkpointed
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                          for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            use = self.checkpointed and self.training
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True) if use else layer(x)
        return x  # a reentrant checkpoint recomputes whole blocks


def test_evaluation_and_checkpoint_recomputation_are_not_counted(sim, tmp_path):
    """A forward in eval mode between steps is not a training forward; under reentrant activation checkpointing the
    training forward runs under no_grad (still recorded) and its recomputation inside backward is not a second call:
    each block's output norm is its one training call's."""
    torch.manual_seed(0)
    model = _Checkpointed().to(sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8).to(sim).requires_grad_()
    outputs: list[float] = []
    model.layers[0].register_forward_hook(lambda m, a, out: outputs.append(out.detach().norm().item()))
    with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model) as monitor:
        model.eval()
        with torch.no_grad():
            model(x * 2)
        model.train()
        model(x).square().sum().backward()
        optimizer.step()
    assert len(outputs) == 3  # evaluation, training forward, recomputation in backward
    written = _figures(monitor)[0]
    assert written[("activation", "layers.0", "norm")] == pytest.approx(outputs[1], rel=1e-5)
    assert ("output_grad", "layers.1", "norm") in written


def test_a_nan_in_layer_1_forward_from_step_6_is_named_first_at_its_layer_and_step(sim, tmp_path, caplog):
    """A sim fault from step 6 on makes layer 1's MLP activation NaN: the first non-finite figure is layer 1's output,
    in forward, at step 6 (layer 0's output, before it, stays finite), logged once."""
    import ditorch.sim

    def fault(step, model):
        if step == 6:
            ditorch.sim.inject_fault("silu", "nan", module="model.layers.1")

    _, monitor, _ = _train(sim, tmp_path, steps=8, before_step=fault)
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "nonfinite" and anomaly["step"] == 6
    assert anomaly["module"] == "model.layers.1" and anomaly["phase"] == "forward"
    assert anomaly["statistic"] == "activation:norm" and anomaly["value"] == "NaN"  # JSON has no NaN
    assert math.isnan(monitor.anomalies[0]["value"])
    from op_tools.offline.monitor_page import read_monitor
    from op_tools.offline.run_report.readers import read_results

    [read] = read_monitor(str(tmp_path)).anomalies  # the page and the run report read it as a float
    [event] = read_results(str(tmp_path)).anomalies
    assert math.isnan(read.value) and math.isnan(event.value)
    written = _figures(monitor)
    assert math.isfinite(written[6][("activation", "model.layers.0", "norm")])
    assert all(math.isfinite(v) for step in range(6) for v in written[step].values())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "op_tools"]
    assert len(warnings) == 1 and "at step 6 in forward: the output of model.layers.1" in warnings[0]


def test_a_norm_overflowing_float32_over_finite_values_is_said_so_not_called_a_non_finite_value(sim, tmp_path):
    # A weight times 1e30: layer 1's outputs reach 1e28, finite, but their float32 norm is inf; the message said
    # "first non-finite value ... the output of model.layers.1 (norm = inf)", which no value was
    def huge(step, model):
        if step == 3:
            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.weight.mul_(1e30)

    _, monitor, _ = _train(sim, tmp_path, steps=4, before_step=huge)
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["module"], anomaly["statistic"], anomaly["value"]) == \
        ("nonfinite", 3, "model.layers.1", "activation:norm", "Infinity")
    written = _figures(monitor)[3]
    low, high = written[("activation", "model.layers.1", "min")], written[("activation", "model.layers.1", "max")]
    assert math.isfinite(low) and math.isfinite(high) and anomaly["overflow"] is True
    assert anomaly["message"].startswith("first non-finite figure at step 3 in forward: the norm of the output of "
                                         f"model.layers.1 overflows float32 (norm = inf; its values are finite, "
                                         f"from {low:g} to {high:g})")


@needs_browser
def test_the_page_written_at_stop_shows_the_nan_step_and_its_anomaly_in_a_browser(sim, tmp_path):
    import ditorch.sim

    def fault(step, model):
        if step == 6:
            ditorch.sim.inject_fault("silu", "nan", module="model.layers.1")

    _, monitor, _ = _train(sim, tmp_path, steps=8, before_step=fault)
    assert monitor.page_path == monitor.csv_path.replace(".csv", ".html")
    rendered = dump_dom(chromium(), monitor.page_path, "", str(tmp_path / "profile"))
    cells = re.findall(r'<rect [^>]*class="cell[^"]*" data-layer="([^"]+)" data-step="(\d+)"', rendered)
    layers = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert sorted(set(cells)) == sorted((layer, str(step)) for layer in layers for step in range(8))
    marked = re.findall(r'<rect [^>]*class="cell (nonfinite|still-nonfinite)" data-layer="([^"]+)" '
                        r'data-step="(\d+)"', rendered)
    # the NaN loss makes every gradient NaN at step 6, and the NaN weights keep them so: step 7's are not new
    assert sorted(marked) == sorted([("nonfinite", layer, "6") for layer in layers] +
                                    [("still-nonfinite", layer, "7") for layer in layers])
    assert re.search(r'<tr class="anomaly" data-step="6"><td></td><td>6</td><td>nonfinite</td>'
                     r'<td>model\.layers\.1</td><td>forward</td>', rendered)
    assert re.search(r'<header id="banner" class="verdict-found">.*?<h1 id="verdict">1 anomaly in 8 monitored steps'
                     r'</h1>', rendered)


def test_a_nan_in_layer_1_backward_is_named_at_the_next_layer_output_gradient(sim, tmp_path):
    """From step 3, the gradient leaving layer 1's MLP is NaN: forward is finite, the gradient w.r.t. layer 1's output
    too (backward meets it before the MLP), and the first non-finite figure is the gradient w.r.t. layer 0's output."""
    state = {"step": 0}

    def poison(module, grad_input, grad_output):
        return tuple(g * float("nan") for g in grad_input) if state["step"] >= 3 else None

    def hook(step, model):
        state["step"] = step
        if step == 0:
            model.model.layers[1].mlp.register_full_backward_hook(poison)

    _, monitor, _ = _train(sim, tmp_path, steps=5, before_step=hook)
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["phase"]) == ("nonfinite", 3, "backward")
    assert anomaly["module"] == "model.layers.0" and anomaly["statistic"] == "output_grad:norm"
    written = _figures(monitor)[3]
    assert math.isfinite(written[("output_grad", "model.layers.1", "norm")])
    assert math.isnan(written[("parameter", "model.embed_tokens.weight", "grad_norm")])


def test_a_loss_spike_fires_the_spike_rule_once(sim, tmp_path, caplog):
    _, monitor, by_hand = _train(sim, tmp_path, steps=6, scale=lambda step: 1000.0 if step == 4 else 1.0)
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "grad_norm_spike" and anomaly["step"] == 4
    assert anomaly["module"] == "model.embed_tokens.weight"
    assert anomaly["value"] == pytest.approx(by_hand[4]["model.embed_tokens.weight"], rel=1e-5)
    assert anomaly["value"] > 10 * anomaly["moving_average"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "op_tools"]
    assert len(warnings) == 1 and "spike at step 4: model.embed_tokens.weight" in warnings[0]


def test_gradient_norms_are_read_before_clipping_and_a_spike_under_clipping_fires(sim, tmp_path):
    # Read at the optimizer's step, after clip_grad_norm_: every norm was at most max_norm (Trainer clips at 1.0),
    # and a loss 1000 times larger at step 4 left the verdict clean
    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    by_hand, clipped, synchronizations = [], [], 0
    with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model) as monitor:
        for step in range(6):
            (model(input_ids=ids, labels=ids).loss * (1000.0 if step == 4 else 1.0)).backward()
            by_hand.append({n: p.grad.cpu().double().norm().item() for n, p in model.named_parameters()})
            before = torch.sim.device_counts()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a generator: still clipped
            synchronizations += (torch.sim.device_counts() - before).synchronizations
            clipped.append(math.sqrt(sum(p.grad.cpu().double().norm().item() ** 2 for p in model.parameters())))
            optimizer.step()
            optimizer.zero_grad()
    assert clipped == pytest.approx([1.0] * 6, rel=1e-5) and synchronizations == 0
    figures = _figures(monitor)
    for step in range(6):
        for name, norm in by_hand[step].items():
            assert figures[step][("parameter", name, "grad_norm")] == pytest.approx(norm, rel=1e-5)
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["module"]) == ("grad_norm_spike", 4, "model.embed_tokens.weight")


def test_gradient_norms_before_clipping_are_those_of_the_step_taken_not_of_an_iteration_skipped(sim, tmp_path):
    # The norms read at a clip were kept until the optimizer's step: a program skipping its step after clipping
    # (its own check of the norm) had the skipped iteration's norms written for the next step's
    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model) as monitor:
        (model(input_ids=ids, labels=ids).loss * 1000.0).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.zero_grad()  # skipped by the program: no step
        model(input_ids=ids, labels=ids).loss.backward()
        taken = {n: p.grad.cpu().double().norm().item() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    figures = _figures(monitor)
    for name, norm in taken.items():
        assert figures[0][("parameter", name, "grad_norm")] == pytest.approx(norm, rel=1e-5), name


def test_every_parameters_and_activations_narrow_what_is_written(sim, tmp_path):
    _, monitor, _ = _train(sim, tmp_path, steps=4, every=2, parameters=[r"model\.layers\.1\."],
                           activations=[r"model\.layers\.\d+\.mlp"])
    figures = _figures(monitor)
    assert sorted(figures) == [0, 2]
    names = {n for step in figures.values() for k, n, _ in step if k == "parameter"}
    assert names and all(n.startswith("model.layers.1.") for n in names)
    assert {n for step in figures.values() for k, n, _ in step if k == "activation"} == \
        {"model.layers.0.mlp", "model.layers.1.mlp"}
    # the global norm is still over every parameter
    _, every_param, _ = _train(sim, tmp_path / "all", steps=1)
    assert figures[0][("step", "", "global_grad_norm")] == \
        pytest.approx(_figures(every_param)[0][("step", "", "global_grad_norm")], rel=1e-6)


def test_no_parameter_selected_is_monitored_and_a_selection_matching_nothing_is_said(sim, tmp_path, caplog):
    # parameters=[] ("empty: none") failed every step's recording (the update ratio's copy of no parameter), so the
    # step's loss and global norm went unjudged; a pattern matching nothing (a typo) monitored nothing, said nowhere
    _, none, _ = _train(sim, tmp_path / "none", steps=3, parameters=[], state_every=1)
    assert none.verdict() == "clean" and none._monitored == 3
    assert [(k, n) for k, n, _ in _figures(none)[0] if k == "parameter"] == []
    assert ("step", "", "global_grad_norm") in _figures(none)[2]
    with caplog.at_level(logging.INFO, logger="op_tools"):
        _, typo, _ = _train(sim, tmp_path / "typo", steps=2, parameters=["model.layres"],
                            activations=[r"model\.layres\.\d+"])
    assert typo.verdict() == "unchecked" and typo._monitored == 2
    closing = [" ".join(r.getMessage().split()) for r in caplog.records  # unwrapped: fit_path breaks long lines
               if r.getMessage().startswith("TrainingMonitor: 2 steps")]
    assert len(closing) == 1
    assert "; parameters matched no parameter the optimizer updates: model.layres;" in closing[0]
    assert r"; activations matched no module of the model: model\.layres\.\d+;" in closing[0]


def test_the_default_blocks_on_a_model_without_a_module_list_says_no_module_output_was_measured(sim, tmp_path,
                                                                                                 caplog):
    # A plain Sequential CNN: "blocks" (the items of every ModuleList) selects nothing, and nothing said so
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2)).to(sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="op_tools"), \
            op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model) as monitor:
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8, device=sim)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "TrainingMonitor: no module output measured (activations='blocks': the model has no torch.nn.ModuleList; " \
           "name modules with activations=[...])" in said, said
    assert monitor.verdict() == "clean"  # the default's choice, not the user's: the parameters and loss were judged


def test_tensorboard_event_files_read_back_as_written(sim, tmp_path, caplog):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            op_tools.TrainingMonitor(results_dir=str(tmp_path), tensorboard=True)
        caplog.set_level(logging.INFO, logger="op_tools")
        _train(sim, tmp_path, steps=1)
        assert "no TensorBoard files (tensorboard is not installed: pip install tensorboard)" in caplog.text
        assert glob.glob(os.path.join(tmp_path, "**", "events.out.tfevents.*"), recursive=True) == []
        if os.environ.get("CI"):  # the test extra installs tensorboard: CI reads event files back
            pytest.fail("tensorboard is not installed under CI=true: `pip install -e .[test]` installs it")
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, monitor, by_hand = _train(sim, tmp_path, tensorboard=True)
    events = EventAccumulator(monitor.tensorboard_dir, size_guidance={"scalars": 0})
    events.Reload()
    names = [n for n, _ in tiny_llama().named_parameters()]
    for name in names:  # every parameter's gradient norm at every step, as computed by hand
        read = events.Scalars(f"grad_norm/{name}")
        assert [e.step for e in read] == list(range(STEPS))
        assert [e.value for e in read] == pytest.approx([h[name] for h in by_hand], rel=1e-5)
    name = names[-1]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([h["loss"] for h in by_hand], rel=1e-5)
    tags = events.Tags()["scalars"]
    assert "activation_norm/model.layers.0" in tags and "output_grad_std/model.layers.1" in tags
    assert f"update_ratio/{name}" in tags and f"exp_avg_sq_norm/{name}" in tags and "step_time" in tags


def test_update_ratio_and_adam_moments_equal_a_hand_computation(sim, tmp_path):
    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    ids = torch.randint(0, 128, (2, 16)).to(sim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before, by_hand = {}, []

    def keep(opt, *_):
        before.update({n: p.detach().cpu().double() for n, p in model.named_parameters()})

    def after(opt, *_):
        by_hand.append({n: ((p.detach().cpu().double() - before[n]).norm().item() / before[n].norm().item(),
                            opt.state[p]["exp_avg"].cpu().double().norm().item(),
                            opt.state[p]["exp_avg_sq"].cpu().double().norm().item())
                        for n, p in model.named_parameters()})

    hooks = (register_optimizer_step_pre_hook(keep), register_optimizer_step_post_hook(after))
    try:
        with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model, state_every=1) as monitor:
            for _ in range(3):
                lm_step(model, optimizer, ids)
    finally:
        for hook in hooks:
            hook.remove()
    figures = _figures(monitor)
    for step in range(3):
        for name, (ratio, exp_avg, exp_avg_sq) in by_hand[step].items():
            assert figures[step][("parameter", name, "update_ratio")] == pytest.approx(ratio, rel=1e-4)
            assert figures[step][("parameter", name, "exp_avg_norm")] == pytest.approx(exp_avg, rel=1e-5)
            assert figures[step][("parameter", name, "exp_avg_sq_norm")] == pytest.approx(exp_avg_sq, rel=1e-5)
            assert ratio > 0


def test_weights_updates_and_moments_are_recorded_every_state_every_monitored_step(sim, tmp_path):
    """They cost a pass over every weight each: at monitored steps 0, state_every, 2 * state_every... (20 by default);
    gradients, the loss and the layers' outputs at every monitored step."""
    assert op_tools.TrainingMonitor(results_dir=str(tmp_path)).state_every == 20
    _, monitor, _ = _train(sim, tmp_path, steps=12, state_every=5)
    figures = _figures(monitor)
    for statistic in ("weight_norm", "update_ratio", "exp_avg_norm", "exp_avg_sq_norm"):
        assert {s for s, f in figures.items() if any(k[2] == statistic for k in f)} == {0, 5, 10}, statistic
    for statistic in ("grad_norm", "loss", "norm"):
        assert {s for s, f in figures.items() if any(k[2] == statistic for k in f)} == set(range(12)), statistic
    _, every_2, _ = _train(sim, tmp_path / "every_2", steps=8, every=2, state_every=2)
    assert {s for s, f in _figures(every_2).items() if ("parameter", "lm_head.weight", "weight_norm") in f} == {0, 4}


def test_step_time_is_written_for_every_step_and_spans_the_loop(sim, tmp_path):
    started = time.perf_counter()
    _, monitor, _ = _train(sim, tmp_path, steps=3)
    elapsed = time.perf_counter() - started
    times = {step: f[("step", "", "step_time")] for step, f in _figures(monitor).items()}
    assert sorted(times) == [0, 1, 2]
    assert all(t > 0 for t in times.values()) and sum(times.values()) < elapsed


def test_gradient_accumulation_loss_is_the_sum_of_the_backward_roots(sim, tmp_path):
    """Two micro-batches, each loss divided by 2 before backward (as Trainer and Lightning do): the step's loss is
    the mean of the two, and each block's output norm combines its two calls."""
    torch.manual_seed(0)
    model = tiny_llama().to(sim)
    batches = [torch.randint(0, 128, (2, 16)).to(sim) for _ in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, outputs = [], []
    model.model.layers[1].register_forward_hook(
        lambda m, a, out: outputs.append((out[0] if isinstance(out, tuple) else out).detach().norm().item()))
    with op_tools.TrainingMonitor(results_dir=str(tmp_path), model=model) as monitor:
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss / 2
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    written = _figures(monitor)[0]
    assert written[("step", "", "loss")] == pytest.approx(sum(losses), rel=1e-6)
    assert written[("activation", "model.layers.1", "norm")] == \
        pytest.approx(math.sqrt(sum(o * o for o in outputs)), rel=1e-5)
    assert ("parameter", "model.embed_tokens.weight", "exp_avg_norm") not in written  # SGD keeps no moments


def _train_scaled(device, results_dir, init_scale, iterations, overflow_at=(), pass_scaler=True, before=None,
                  **monitor_args):
    """Train a tiny Llama under float16 autocast and a GradScaler; the loss of the iterations in ``overflow_at`` is
    made huge (finite: its float16 gradients overflow), ``before(iteration)`` runs before each forward. Returns the
    monitor, the scale read by hand at each optimizer step (GradScaler skips the steps whose gradients are not finite:
    no optimizer hook sees them) and the unscaled losses of the steps taken."""
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    by_hand: list[float] = []
    losses: list[float] = []
    hook = register_optimizer_step_pre_hook(lambda *_: by_hand.append(scaler.get_scale()))
    if pass_scaler:
        monitor_args["scaler"] = scaler
    try:
        with op_tools.TrainingMonitor(results_dir=str(results_dir), model=model, **monitor_args) as monitor:
            for iteration in range(iterations):
                if before is not None:
                    before(iteration)
                with torch.autocast(device, dtype=torch.float16):
                    loss = model(input_ids=ids, labels=ids).loss
                scaler.scale(loss * (1e30 if iteration in overflow_at else 1.0)).backward()
                taken = len(by_hand)
                scaler.step(optimizer)
                if len(by_hand) > taken:
                    losses.append(loss.item())
                scaler.update()
                optimizer.zero_grad()
    finally:
        hook.remove()
    return monitor, by_hand, losses


def test_a_huge_initial_scale_falling_before_the_first_step_fires_the_loss_scale_rule(sim, tmp_path, caplog):
    """float16 gradients overflow at 2**24: GradScaler skips those iterations and halves the scale until they fit. The
    rule fires at the third halving, in the iteration that made it, before the first optimizer step."""
    monitor, by_hand, _ = _train_scaled(sim, tmp_path, init_scale=2.0**24, iterations=12)
    drops = round(math.log2(2.0**24 / by_hand[0]))
    assert drops >= 3 and len(by_hand) == 12 - drops  # the skipped iterations are no steps
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "loss_scale_dropping" and anomaly["step"] == 0
    assert anomaly["value"] == 2.0**21 and anomaly["drops"] == 3
    written = {step: f[("step", "", "loss_scale")] for step, f in _figures(monitor).items()}
    assert written == dict(enumerate(by_hand))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "op_tools"]
    assert len(warnings) == 1
    assert "loss scale dropping at step 0 (in an iteration GradScaler skipped): 2.09715e+06 after 3 drops" \
        in warnings[0]


@pytest.mark.parametrize("every", [1, 2])
def test_a_scale_collapsing_in_the_last_iterations_fires_though_no_step_follows(sim, tmp_path, every):
    # The scale was judged at the optimizer's steps only: a run ending on iterations GradScaler skipped (the scale
    # halved five times) closed with a clean verdict. Step 3 is not monitored with every=2: its scale is judged still
    monitor, by_hand, _ = _train_scaled(sim, tmp_path, init_scale=2.0**8, iterations=8, overflow_at=(3, 4, 5, 6, 7),
                                        every=every)
    assert by_hand == [2.0**8] * 3 and monitor.skipped_iterations == 5
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["value"], anomaly["drops"]) == \
        ("loss_scale_dropping", 3, 2.0**5, 3)
    assert "(in an iteration GradScaler skipped)" in anomaly["message"]
    assert monitor.verdict() == "found"


def test_a_scale_falling_between_consecutive_steps_fires_once_at_the_third_fall(sim, tmp_path):
    """Gradients overflowing on every other iteration: each optimizer step sees half the scale of the one before.
    With scale_drops=3 the rule fires at step 3 (three falls since step 0), and once only."""
    monitor, by_hand, _ = _train_scaled(sim, tmp_path, init_scale=2.0**8, iterations=10, overflow_at=(1, 3, 5, 7))
    assert by_hand == [2.0**8, 2.0**7, 2.0**6, 2.0**5, 2.0**4, 2.0**4]
    [anomaly] = _anomalies(monitor)
    assert anomaly["rule"] == "loss_scale_dropping" and anomaly["step"] == 3
    assert anomaly["value"] == 2.0**5 and anomaly["drops"] == 3


def test_a_nan_in_the_forward_of_an_iteration_gradscaler_skipped_is_named(sim, tmp_path):
    # Its figures were dropped whole ("its scaled gradients overflow by design"): a nan in a layer's output, no
    # scaling's, left the verdict clean
    import ditorch.sim

    def fault(iteration):
        ditorch.sim.set_faults("silu@model.layers.1:nan" if iteration == 3 else "")

    try:
        monitor, by_hand, _ = _train_scaled(sim, tmp_path, init_scale=2.0**8, iterations=5, before=fault)
    finally:
        ditorch.sim.set_faults("")
    assert len(by_hand) == 4 and monitor.skipped_iterations == 1
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["module"], anomaly["phase"]) == \
        ("nonfinite", 3, "model.layers.1", "forward")
    assert "(in an iteration GradScaler skipped)" in anomaly["message"]
    assert monitor.verdict() == "found"


def test_a_nan_made_by_the_loss_itself_is_named_as_the_loss_not_a_gradient(sim, tmp_path):
    # The loss is added to the step's figures at the optimizer's step, after the backward's: the first non-finite
    # figure was the last layer's output gradient, "in backward"
    import ditorch.sim

    def fault(step, model):
        ditorch.sim.set_faults("nll_loss_forward:nan" if step == 2 else "")

    try:
        _, monitor, _ = _train(sim, tmp_path, steps=3, before_step=fault)
    finally:
        ditorch.sim.set_faults("")
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["module"], anomaly["phase"], anomaly["statistic"]) == \
        ("nonfinite", 2, "", "forward", "loss")


def test_the_scaler_is_found_without_being_passed_and_the_loss_is_unscaled(sim, tmp_path):
    monitor, by_hand, losses = _train_scaled(sim, tmp_path, init_scale=2.0**8, iterations=4, pass_scaler=False)
    assert by_hand == [2.0**8] * 4
    figures = _figures(monitor)
    assert [figures[s][("step", "", "loss_scale")] for s in range(4)] == by_hand
    assert [figures[s][("step", "", "loss")] for s in range(4)] == pytest.approx(losses, rel=1e-6)
    assert _anomalies(monitor) == []


def test_stopping_keeps_what_was_patched_over_the_monitors_patches(sim, tmp_path):
    # The monitor wraps GradScaler.scale/update and torch.autograd.backward while it runs; a wrapper installed over
    # its own (a user's, another tool's) must outlive its stop, its wrapper underneath passing calls through.
    from op_tools.ops.torch_versions import GradScaler

    true_scale = GradScaler.scale
    seen = []
    monitor = op_tools.TrainingMonitor(results_dir=str(tmp_path)).start()
    monitors_scale = GradScaler.scale

    def users_scale(scaler, outputs):
        seen.append(outputs)
        return monitors_scale(scaler, outputs)

    GradScaler.scale = users_scale
    try:
        monitor.stop()
        assert GradScaler.scale is users_scale
        scaler = GradScaler("sim", init_scale=4.0)
        assert scaler.scale(torch.ones(1, device=sim)).item() == 4.0 and len(seen) == 1
    finally:
        GradScaler.scale = true_scale


def test_a_monitored_step_never_waits_for_the_device(sim, tmp_path):
    # counted on sim: the monitor adds one non-blocking copy per step and no synchronisation
    def counted(monitored: bool):
        before = torch.sim.device_counts()
        _train(sim, tmp_path / str(monitored), steps=4) if monitored else _plain_steps(sim, 4)
        return torch.sim.device_counts() - before

    plain, monitored = counted(False), counted(True)
    # _train reads each gradient and the loss by hand for the other tests: the same reads as _plain_steps makes
    assert monitored.synchronizations == plain.synchronizations
    assert monitored.device_to_host_copies - plain.device_to_host_copies == 4


def test_on_an_asynchronous_device_every_step_is_written_with_its_own_figures(sim, tmp_path):
    # the figures of a step arrive 10,000 kernels later (steps later): the files must equal a synchronous run's
    import ditorch.sim

    _, synchronous, _ = _train(sim, tmp_path / "sync", steps=4, before_step=_nan_at(2))
    with ditorch.sim.asynchronous(lag=10_000):
        _, late, _ = _train(sim, tmp_path / "async", steps=4, before_step=_nan_at(2))
    def comparable(monitor):  # the step's wall time aside; nan equal to nan
        return {step: {k: ("nan" if math.isnan(v) else v) for k, v in figures.items() if k[2] != "step_time"}
                for step, figures in _figures(monitor).items()}

    assert comparable(late) == comparable(synchronous) and sorted(comparable(late)) == [0, 1, 2, 3]
    assert [(a["rule"], a["step"], a["module"]) for a in _anomalies(late)] == \
        [(a["rule"], a["step"], a["module"]) for a in _anomalies(synchronous)] == [("nonfinite", 2, "model.layers.0")]


def _plain_steps(device, steps: int) -> None:
    """_train's loop and its reads by hand, without a monitor."""
    from tiny_models import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama().to(device)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        {n: p.grad.cpu().double().norm().item() for n, p in model.named_parameters() if p.grad is not None}
        loss.item()
        optimizer.step()
        optimizer.zero_grad()


def _nan_at(step: int):
    def before_step(k, model):
        if k == step:
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    return before_step


@pytest.mark.parametrize("where, said", [("send", "recording"), ("read", "writing")])
def test_a_failure_inside_the_monitor_is_said_counted_and_the_run_goes_on(sim, tmp_path, caplog, monkeypatch, where,
                                                                         said):
    # send: on the training thread, in the post-step hook; read: on the writer thread, which writes the figures
    from op_tools.tools import training_monitor

    calls = {"n": 0}
    real = getattr(training_monitor._StepFigures, where)

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(self, *args)

    monkeypatch.setattr(training_monitor._StepFigures, where, flaky)
    caplog.set_level(logging.INFO, logger="op_tools")
    _, monitor, _ = _train(sim, tmp_path, steps=3)
    assert sorted(_figures(monitor)) == [0, 2]
    assert f"{said} at step 1 failed" in caplog.text
    assert f"not measured: 1 x {said} failed" in caplog.text


def test_arguments_are_validated(tmp_path):
    with pytest.raises(TypeError, match="scaler="):
        op_tools.TrainingMonitor(results_dir=str(tmp_path), scaler=torch.optim.SGD)
    with pytest.raises(ValueError, match="scale_drops=0"):
        op_tools.TrainingMonitor(results_dir=str(tmp_path), scale_drops=0)
    with pytest.raises(ValueError, match=r"parameters=\['\('\]"):
        op_tools.TrainingMonitor(results_dir=str(tmp_path), parameters=["("])


def test_under_torch_compile_parameters_are_measured_and_module_outputs_said_not_measured(tmp_path, caplog):
    """A compiled region traces the forward hooks into its graph once: no figure of a module output per call. The
    parameters' figures (the optimizer's hooks run outside) equal an eager run's, and the closing line names the
    modules whose outputs were not measured."""
    def train(compiled):
        torch.manual_seed(0)
        model = _Checkpointed(checkpointed=False)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        x = torch.randn(4, 8)
        with op_tools.TrainingMonitor(results_dir=str(tmp_path / str(compiled)), model=model) as monitor:
            for _ in range(2):
                run(x).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        return _figures(monitor)

    caplog.set_level(logging.INFO, logger="op_tools")
    eager, compiled = train(False), train(True)
    for step in (0, 1):
        grads = {k: v for k, v in eager[step].items() if k[2] == "grad_norm"}
        assert grads and {k: compiled[step][k] for k in grads} == pytest.approx(grads, rel=1e-5)
        assert any(k[0] == "activation" for k in eager[step])
        assert not any(k[0] in ("activation", "output_grad") for k in compiled[step])
    assert "not measured: 2 x module outputs inside torch.compile regions (layers.0, layers.1)" in caplog.text


def test_a_torch_compiled_optimizer_step_is_monitored_as_an_eager_one(sim, tmp_path, caplog):
    """``torch.compile(step)`` around ``optimizer.step()``: dynamo reaches the monitor's step hooks inside the compiled
    frame. They run eagerly there (before, dynamo traced them and failed on their host work: every step's recording
    failed, 0 monitored), and the figures equal an eager step's."""
    def train(compiled):
        torch.manual_seed(0)
        model = _Checkpointed(checkpointed=False).to(sim)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = torch.compile(optimizer.step, backend="aot_eager") if compiled else optimizer.step
        x = torch.randn(4, 8).to(sim)
        with op_tools.TrainingMonitor(results_dir=str(tmp_path / str(compiled)), model=model) as monitor:
            for _ in range(2):
                model(x).square().sum().backward()
                step()
                optimizer.zero_grad()
        return monitor, _figures(monitor)

    caplog.set_level(logging.INFO, logger="op_tools")
    (_, eager), (monitor, compiled) = train(False), train(True)
    assert monitor.verdict() == "clean" and "failed" not in caplog.text, caplog.text
    assert sorted(compiled) == [0, 1]
    for step in (0, 1):
        assert set(compiled[step]) == set(eager[step])
        del compiled[step][("step", "", "step_time")], eager[step][("step", "", "step_time")]  # the compilation's
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5, abs=1e-6)


def test_a_sparse_gradient_is_measured_as_its_dense_form_and_its_nan_fires_the_rule(sim, tmp_path):
    # An embedding with sparse gradients (uncoalesced: a token seen twice). Before, _foreach_norm refused the sparse
    # gradient and the whole step went unmeasured ("recording failed"): the nan below was never seen.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1)).to(sim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    index = torch.tensor([1, 3, 3, 7], device=sim)
    dense_norms = []
    with op_tools.TrainingMonitor(model=model, results_dir=str(tmp_path)) as monitor:
        for step in range(3):
            model(index).square().mean().backward()
            dense_norms.append(model[0].weight.grad.to_dense().norm().item())
            if step == 2:
                model[0].weight.grad._values()[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
    figures = _figures(monitor)
    for step in range(2):
        assert figures[step][("parameter", "0.weight", "grad_norm")] == pytest.approx(dense_norms[step], rel=1e-6)
    [anomaly] = _anomalies(monitor)
    assert (anomaly["rule"], anomaly["step"], anomaly["module"]) == ("nonfinite", 2, "0.weight")
    assert not monitor._unmeasured  # every figure measured, the sparse gradient's too
