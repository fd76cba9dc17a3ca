"""Online drift check (issue 30 item 6): the shadow replay changes no state; the flag fires on a planted
outlier and not on a clean run; the fallback switches the blamed GLUs to Smooth-SwiGLU and the drift goes."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import fp8pass
from fp8pass import Config, DriftCheck
from fp8pass.monitor.drift import DriftMonitor, DriftReport, grad_cosines
from fp8pass.train import ModelConfig, TinyLlama, TrainConfig, train
from fp8pass.train.logging import read_metrics

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64, max_seq_len=32)


class Net(torch.nn.Module):
    """Two FP8 linears with dropout between them: the replay draws from the RNG."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), 0.2, self.training)).square().mean()


def _snapshot(model, opt):
    return {"model": copy.deepcopy(model.state_dict()),  # weights, scaling state, stochastic-rounding streams
            "grad": [p.grad.clone() for p in model.parameters()],
            "opt": copy.deepcopy(opt.state_dict()),
            "scaling": fp8pass.scaling_state_dict(model),
            "rng": torch.get_rng_state()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_the_shadow_replay_changes_no_state():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    cfg = Config(compiler="aot_eager", grad_stochastic_rounding=True, drift_check=DriftCheck(every=1))
    fwd = torch.compile(model, backend=fp8pass.backend(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    drift = DriftMonitor(fwd)
    x = torch.randn(64, 32)
    for _ in range(3):  # optimizer moments, amax histories and rounding streams all have state
        opt.zero_grad()
        loss = fwd(x)
        loss.backward()
        opt.step()
    opt.zero_grad()
    loss = fwd(x)
    loss.backward()
    before = _snapshot(model, opt)
    assert any(".fp8_sr." in k for k in before["model"]) and any(".fp8_scaling." in k for k in before["model"])
    report = drift.check(4, x, fp8_loss=loss)
    assert _same(before, _snapshot(model, opt))
    assert report.grad_cosine.keys() == {"l1.weight", "l2.weight"} and report.fp8_weights == ["l1.weight", "l2.weight"]
    # the eager forward draws dropout masks: the replay's restore is what keeps the RNG as it was
    model(x)
    assert not torch.equal(torch.get_rng_state(), before["rng"])


def test_grad_cosines_edge_cases():
    a = {"x": torch.tensor([1.0, 0.0]), "z": torch.zeros(2), "n": torch.tensor([float("nan"), 1.0])}
    b = {"x": torch.tensor([1.0, 1.0]), "z": torch.zeros(2), "n": torch.tensor([1.0, 1.0])}
    c = grad_cosines(a, b)
    assert c["x"] == pytest.approx(2 ** -0.5) and c["z"] == 1.0 and c["n"] != c["n"]


def test_drift_check_arguments_are_checked():
    with pytest.raises(ValueError, match="DriftCheck.every must be an int >= 1"):
        DriftCheck(every=0)
    with pytest.raises(ValueError, match="unknown DriftCheck.on_drift 'stop'"):
        DriftCheck(on_drift="stop")
    with pytest.raises(TypeError, match="Config.drift_check must be an fp8pass.DriftCheck"):
        Config(drift_check=100)
    with pytest.raises(ValueError, match="DriftMonitor needs a DriftCheck"):
        DriftMonitor(torch.compile(Net(), backend=fp8pass.backend(Config(compiler="aot_eager"))))
    with pytest.raises(ValueError, match="drift_check compares FP8 steps"):
        TrainConfig(recipe="bf16", drift_check=10)
    with pytest.raises(ValueError, match="drift_check must be an int >= 0"):
        TrainConfig(recipe="fp8", drift_check=-1)
    with pytest.raises(ValueError, match="unknown DriftCheck.cosine_blame 'glu'"):
        DriftCheck(cosine_blame="glu")
    with pytest.raises(ValueError, match="DriftCheck.act_at_once"):
        DriftCheck(act_at_once=-1)
    with pytest.raises(ValueError, match="DriftCheck.reset_moments must be True or False"):
        TrainConfig(recipe="fp8", drift_check=5, drift_reset_moments=1)
    with pytest.raises(ValueError, match="pass the optimizer"):
        DriftMonitor(torch.compile(Net(), backend=fp8pass.backend(Config(compiler="aot_eager"))),
                     DriftCheck(on_drift="fallback", reset_moments=True))


# Scripted check results: DriftMonitor.decide on made-up measurements, so each decision is exact.
GLU0 = [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
GLU1 = [f"layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
ATTN0 = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
DOWN0, DOWN1 = GLU0[2], GLU1[2]


def _scripted(**check):
    """A DriftMonitor of a 2-block TinyLlama in plain FP8 and ``script(step, local=..., cos=..., loss=...)``: one check whose
    local errors and gradient cosines are 0.02 and 1.0 except those given, decided and returned."""
    torch._dynamo.reset()
    model = TinyLlama(SMALL)
    cfg = Config(compiler="aot_eager", smooth_swiglu=None, drift_check=DriftCheck(**check))  # plain FP8 GLUs
    monitor = DriftMonitor(torch.compile(model, backend=fp8pass.backend(cfg)))
    fp8 = monitor.fp8_weights()
    assert set(GLU0 + GLU1 + ATTN0) <= set(fp8)

    def script(step, local=(), cos=(), loss=0.0):
        report = DriftReport(step, 1.0 + loss, 1.0, loss, {w: 1.0 for w in fp8} | dict(cos), fp8,
                             {w: 0.02 for w in fp8} | dict(local))
        monitor.decide(report)
        return report
    return monitor, script


def test_a_confirming_check_blames_its_layers_and_those_of_the_check_it_confirms():
    _, script = _scripted(every=1, act_at_once=0)
    first = script(10, local={DOWN0: 0.17})
    assert (first.action, first.flagged, first.reasons) == ("pending", [DOWN0], ["local_error"])
    second = script(11, local={DOWN0: 0.09, DOWN1: 0.15})  # layer 0 dips under the threshold on this batch
    assert (second.action, second.flagged) == ("warn", [DOWN0, DOWN1])  # worst first, at its worse error
    _, script = _scripted(every=1, act_at_once=0, blame_pending=False)
    script(10, local={DOWN0: 0.17})
    assert script(11, local={DOWN0: 0.09, DOWN1: 0.15}).flagged == [DOWN1]
    _, script = _scripted(every=1, act_at_once=0)  # a drift seen on cosines only, confirmed by a local error
    assert script(10, cos={ATTN0[0]: 0.3}).action == "pending"
    assert script(11, local={DOWN1: 0.12}).flagged == [DOWN1]


def test_a_local_error_far_past_its_threshold_acts_without_confirmation():
    _, script = _scripted(every=1)  # act_at_once=3.0: past 30%
    assert [script(s, local={DOWN0: e}).action for s, e in ((10, 0.29), (11, 0.2))] == ["pending", "warn"]
    assert script(20, local={DOWN0: 0.31, DOWN1: 0.12}).action == "warn"  # 20 does not follow a drift at 19
    monitor, script = _scripted(every=5, act_at_once=0)
    assert script(30, local={DOWN0: 5.0}).action == "pending" and monitor.due(31) and not monitor.due(32)


def test_a_drift_after_a_fallback_is_confirmed_on_its_own_and_a_warning_repeats():
    _, script = _scripted(every=1, act_at_once=0, on_drift="fallback")
    # decide only: no switch is made, so the GLU stays blamable
    assert [script(s, local={DOWN0: 0.2}).action for s in (10, 11, 12, 13, 14)] == [
        "pending", "fallback", "pending", "fallback", "pending"]
    _, script = _scripted(every=1, act_at_once=0, on_drift="warn")
    assert [script(s, local={DOWN0: 0.2}).action for s in (10, 11, 12, 13)] == ["pending", "warn", "warn", "warn"]
    assert script(14).action == "none" and script(15, local={DOWN0: 0.2}).action == "pending"


def test_a_drift_on_cosines_alone_blames_the_glus_first_not_every_low_layer():
    low = {ATTN0[0]: 0.1, ATTN0[1]: 0.2, ATTN0[2]: 0.3, ATTN0[3]: 0.35, GLU1[1]: 0.4, GLU0[2]: 0.45}
    expected = {"glu_first": [GLU1[1], GLU0[2]], "lowest": ATTN0[:3], "all": ATTN0 + [GLU1[1], GLU0[2]]}
    for mode, blamed in expected.items():
        monitor, script = _scripted(every=1, cosine_blame=mode, on_drift="fallback")
        script(10, cos=low)
        report = script(11, cos=low)
        assert report.flagged == blamed and report.reasons == ["grad_cosine"], mode
        if mode == "glu_first":  # both GLUs keep FP8, with Smooth-SwiGLU; no attention projection switches
            assert monitor.fallback_rules(report.flagged)[1] == {"layers.1.mlp": "Smooth-SwiGLU per channel",
                                                                  "layers.0.mlp": "Smooth-SwiGLU per channel"}
    _, script = _scripted(every=1, cosine_blame="glu_first")  # no GLU among the low layers: the top_k lowest
    script(10, cos={w: 0.1 * i for i, w in enumerate(ATTN0)})
    assert script(11, cos={w: 0.1 * i for i, w in enumerate(ATTN0)}).flagged == ATTN0[:3]
    _, script = _scripted(every=1)  # only the loss: the top_k lowest cosines, above the threshold too
    script(10, loss=0.02, cos={ATTN0[1]: 0.8, DOWN1: 0.9})
    assert script(11, loss=0.02, cos={ATTN0[1]: 0.8, DOWN1: 0.9}).flagged[:2] == [ATTN0[1], DOWN1]


@pytest.fixture
def corpus(tmp_path):
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))
    (tmp_path / "corpus.txt").write_text(text)
    return str(tmp_path / "corpus.txt")


def _cfg(tmp_path, corpus, name, **kw):
    base = dict(recipe="fp8", steps=6, out=str(tmp_path / name), data=corpus, batch_size=4, seq_len=32, model=SMALL,
                eval_every=6, eval_batches=1, ckpt_every=6, monitor_every=0, warmup=2, precision="fp32",
                compiler="aot_eager", progress=False)
    base.update(kw)
    return TrainConfig(**base)


def _plant_outlier(at: int, alpha: float = 300.0):
    """Callback: after step ``at`` (and re-pinned after every later step), channel 0 of every GLU is
    w_gate = w_up = alpha * u and w_down[:, 0] = v / (100 * alpha**2) (u, v random, the same after a resume):
    experiments/outlier_plant.py's aligned outlier, made silent in the output so that this untrained model's
    small channels carry it. Plain FP8's down-projection input cast, scaled to the outlier, flushes them to 0."""
    pinned = {}

    def plant(step, model, log, final=False):
        if step < at:
            return
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                mlp = layer.mlp
                if i not in pinned:
                    g = torch.Generator().manual_seed(i)
                    u = torch.randn(mlp.gate_proj.weight.shape[1], generator=g)
                    v = 0.02 * torch.randn(mlp.down_proj.weight.shape[0], generator=g)
                    pinned[i] = (alpha * u / u.norm(), v / (100 * alpha ** 2))
                w, col = pinned[i]
                mlp.gate_proj.weight[0] = w
                mlp.up_proj.weight[0] = w
                mlp.down_proj.weight[:, 0] = col
    return plant


def test_the_check_logs_every_n_steps_and_leaves_the_run_bit_identical(tmp_path, corpus):
    """With gradient accumulation: the check compares micro-batch 0's own gradients (kept before micro-batch 1)."""
    torch._dynamo.reset()
    plain = train(_cfg(tmp_path, corpus, "plain", batch_size=2, grad_accum=2))
    torch._dynamo.reset()
    checked = train(_cfg(tmp_path, corpus, "checked", batch_size=2, grad_accum=2, drift_check=2))
    assert checked.losses == plain.losses and checked.final_val_loss == plain.final_val_loss
    recs = read_metrics(tmp_path / "checked" / "metrics.jsonl", "drift")
    assert [r["step"] for r in recs] == [2, 4, 6]
    assert all(r["action"] == "none" and r["flagged"] == [] for r in recs)   # a clean run: no flag
    assert {w for r in recs for w in r["grad_cosine"]} >= {"layers.0.mlp.down_proj.weight", "lm_head.weight"}
    assert all(r["min_grad_cosine"] > 0.9 and abs(r["loss_rel_diff"]) < 1e-2 for r in recs)


def test_the_flag_fires_on_a_planted_outlier_and_names_the_down_projections(tmp_path, corpus):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(_cfg(tmp_path, corpus, "planted", drift_check=1, drift_act_at_once=0), callbacks=[_plant_outlier(at=2)])
    recs = {r["step"]: r for r in read_metrics(tmp_path / "planted" / "metrics.jsonl", "drift")}
    assert [recs[s]["action"] for s in (1, 2)] == ["none", "none"]
    assert [recs[s]["action"] for s in (3, 4, 5, 6)] == ["pending", "warn", "warn", "warn"]  # confirmed by step 4
    assert set(recs[4]["flagged"]) == {"layers.0.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"}
    assert min(recs[4]["local_error"][w] for w in recs[4]["flagged"]) > 0.1
    drift_warnings = [str(w.message) for w in caught if "drift check at step" in str(w.message)]
    assert len(drift_warnings) == 3 and "layers.0.mlp.down_proj.weight" in drift_warnings[0]  # steps 4, 5, 6


def test_the_fallback_switches_the_blamed_glus_to_smooth_swiglu_and_the_drift_goes(tmp_path, corpus):
    """The planted outlier's local errors (~100%) are past act_at_once: the fallback acts at the first check that
    sees it. With reset_moments the switched GLUs' Adam state restarts there: 4 steps (3-6) against 6."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(_cfg(tmp_path, corpus, "fallback", drift_check=1, on_drift="fallback", drift_reset_moments=True),
              callbacks=[_plant_outlier(at=2)])
    recs = {r["step"]: r for r in read_metrics(tmp_path / "fallback" / "metrics.jsonl", "drift")}
    assert [recs[s]["action"] for s in range(1, 7)] == ["none", "none", "fallback", "none", "none", "none"]
    assert recs[3]["switched"] == {"layers.0.mlp": "Smooth-SwiGLU per channel", "layers.1.mlp": "Smooth-SwiGLU per channel"}
    assert recs[3]["min_grad_cosine"] < 0.5 and min(recs[s]["min_grad_cosine"] for s in (4, 5, 6)) > 0.9
    ckpt = torch.load(tmp_path / "fallback" / "checkpoint.pt", weights_only=True)
    assert "fp8_precision_switches" in ckpt["model"]  # a resume continues switched (tests/train/test_precision_switch.py)
    params = list(TinyLlama(SMALL).named_parameters())  # the trainer's groups: matrices, then norm gains
    names = [n for n, p in params if p.dim() >= 2] + [n for n, p in params if p.dim() < 2]
    ids = [i for g in ckpt["optimizer"]["param_groups"] for i in g["params"]]
    steps = {names[ids.index(i)]: int(st["step"]) for i, st in ckpt["optimizer"]["state"].items()}
    assert len(steps) == len(names)
    assert {n for n, s in steps.items() if s == 4} == {n for n in steps if ".mlp." in n}
    assert all(s == 6 for n, s in steps.items() if ".mlp." not in n)


def test_a_run_resumed_after_the_fallback_continues_switched(tmp_path, corpus):
    """The switch is in the checkpoint: the resumed run trains like the uninterrupted one, its down projections
    still smoothed (their local error stays low under the planted outlier, ~100% when plain)."""
    torch._dynamo.reset()
    kw = dict(drift_check=1, on_drift="fallback", ckpt_every=5, schedule="constant")  # lr independent of `steps`
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = train(_cfg(tmp_path, corpus, "full", **kw), callbacks=[_plant_outlier(at=2)])
        torch._dynamo.reset()
        train(_cfg(tmp_path, corpus, "part", steps=5, **kw), callbacks=[_plant_outlier(at=2)])
        torch._dynamo.reset()
        resumed = train(_cfg(tmp_path, corpus, "part", **kw), callbacks=[_plant_outlier(at=2)], resume=True)
    assert resumed.losses == full.losses[5:]  # bit for bit (the part run's last-step evaluation changes no state)
    recs = read_metrics(tmp_path / "part" / "metrics.jsonl", "drift")
    assert [r["action"] for r in recs] == ["none", "none", "fallback", "none", "none", "none"]
    last = recs[-1]["local_error"]
    assert recs[-1]["step"] == 6 and max(last[f"layers.{i}.mlp.down_proj.weight"] for i in (0, 1)) < 0.1
    assert min(recs[2]["local_error"][f"layers.{i}.mlp.down_proj.weight"] for i in (0, 1)) > 0.9  # plain, step 3
