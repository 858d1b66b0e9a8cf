"""Knowledge distillation (train.distill, vitgraph.tasks.distill): the losses against hand
computation, a teacher equal to the student, the teacher's forward-graph bookkeeping on the
rerun backend, short CPU runs from a timm teacher and from a vitgraph run, and bad values."""
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, loss_records
from vitgraph.config import ConfigError, load_config
from vitgraph.tasks.distill import ForwardGraphs, Teacher, build_teacher, hard_loss, soft_loss

TINY = ROOT / "configs" / "vit-tiny-shapes.yaml"

# a fixed batch: 4 samples, 5 classes
STUDENT = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.0],
                        [-0.5, 1.5, 0.3, 0.2, -2.0],
                        [0.0, 0.0, 3.0, -1.0, 0.5],
                        [1.0, -1.0, 0.0, 2.5, 0.1]])
TEACHER = torch.tensor([[1.0, 2.0, -0.5, 0.0, 0.3],
                        [0.2, 0.1, 0.4, 1.7, -1.0],
                        [-1.0, 0.5, 2.0, 0.0, 0.0],
                        [0.3, 0.3, -2.0, 1.0, 1.2]])


def _kl_by_hand(s, t, temp, rows):
    """KL(p_t || p_s) x T^2 averaged over ``rows``, one sample and class at a time."""
    total = 0.0
    for i in rows:
        ls = F.log_softmax(s[i] / temp, -1)
        lt = F.log_softmax(t[i] / temp, -1)
        total += sum(math.exp(lt[c]) * (lt[c] - ls[c]) for c in range(s.shape[1]))
    return total * temp * temp / len(rows)


@pytest.mark.parametrize("temp", [1.0, 2.0, 4.0])
def test_soft_loss_is_kl_with_temperature_by_hand(temp):
    got = soft_loss(STUDENT, TEACHER, temp)
    assert got.item() == pytest.approx(float(_kl_by_hand(STUDENT, TEACHER, temp, range(4))),
                                       rel=1e-5)
    # torch's own batchmean KL agrees
    ref = F.kl_div(F.log_softmax(STUDENT / temp, -1), F.log_softmax(TEACHER / temp, -1),
                   reduction="batchmean", log_target=True) * temp ** 2
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    assert got.item() > 0.01  # not a trivial 0


def test_losses_average_over_the_real_samples_only():
    valid = torch.tensor([True, False, True, True])  # sample 1 only fills the microbatch
    got = soft_loss(STUDENT, TEACHER, 2.0, valid)
    assert got.item() == pytest.approx(float(_kl_by_hand(STUDENT, TEACHER, 2.0, [0, 2, 3])),
                                       rel=1e-5)
    top = TEACHER.argmax(-1)
    hand = -sum(F.log_softmax(STUDENT[i], -1)[top[i]] for i in (0, 2, 3)) / 3
    assert hard_loss(STUDENT, TEACHER, valid).item() == pytest.approx(hand.item(), rel=1e-5)
    none = torch.zeros(4, dtype=torch.bool)
    assert soft_loss(STUDENT, TEACHER, 1.0, none).item() == 0.0  # not 0 / 0


def test_hard_loss_is_cross_entropy_against_the_teachers_top_class():
    top = TEACHER.argmax(-1)
    assert top.tolist() == [1, 3, 2, 4]
    hand = -sum(F.log_softmax(STUDENT[i], -1)[top[i]] for i in range(4)) / 4
    assert hard_loss(STUDENT, TEACHER).item() == pytest.approx(hand.item(), rel=1e-6)


def _task(**distill):
    """The classification task's loss alone (its plan is all it reads)."""
    from vitgraph.plan import resolve
    from vitgraph.tasks.classification import ClassificationTask
    cfg = load_config(TINY, [f"train.distill.{k}={v}" for k, v in distill.items()]
                      + ["train.label_smoothing=0.1"])
    task = ClassificationTask.__new__(ClassificationTask)
    task.plan, task.pack = resolve(cfg, 1), None
    return task


def test_task_loss_mixes_the_task_and_distillation_terms():
    labels = torch.tensor([0, 1, 2, 3])
    ce = F.cross_entropy(STUDENT, labels, label_smoothing=0.1)
    for kind, w, temp in (("soft", 0.5, 2.0), ("hard", 0.3, 1.0), ("soft", 1.0, 1.0)):
        task = _task(teacher="timm:x", kind=kind, weight=w, temperature=temp)
        loss, stats = task.loss((None, labels, labels, TEACHER), STUDENT)
        term = soft_loss(STUDENT, TEACHER, temp) if kind == "soft" \
            else hard_loss(STUDENT, TEACHER)
        assert loss.item() == pytest.approx(((1 - w) * ce + w * term).item(), rel=1e-6)
        # the total, then each term (logged apart: loss_task, loss_distill)
        assert stats.tolist() == pytest.approx([loss.item() * 4, 4.0, 4.0, ce.item() * 4,
                                                term.item() * 4], rel=1e-6)
    # weight 0: the plain task loss, whatever the teacher
    task = _task(teacher="timm:x", weight=0.0)
    assert task.loss((None, labels, labels, TEACHER), STUDENT)[0].item() == \
        pytest.approx(ce.item(), rel=1e-7)
    # no teacher logits (evaluation): the plain loss
    assert task.loss((None, labels, labels), STUDENT)[0].item() == pytest.approx(ce.item())


def test_mixed_targets_keep_the_task_loss_and_distil_on_the_mixed_images():
    """With mixup / cutmix the task term is the soft-target CE as without a teacher; the
    distillation term uses the teacher's logits of the same (mixed) images."""
    labels = torch.tensor([0, 1, 2, 3])
    one = F.one_hot(labels, 5).float() * 0.9 + 0.02
    mixed = 0.7 * one + 0.3 * one.flip(0)
    task = _task(teacher="timm:x", weight=0.4, temperature=3.0)
    loss, _ = task.loss((None, mixed, labels, TEACHER), STUDENT)
    ce = -(mixed * F.log_softmax(STUDENT, -1)).sum(-1).mean()
    want = 0.6 * ce + 0.4 * _kl_by_hand(STUDENT, TEACHER, 3.0, range(4))
    assert loss.item() == pytest.approx(float(want), rel=1e-5)


def test_teacher_equal_to_the_student():
    """A teacher with the student's logits: the soft term is 0 at any temperature, so the loss
    is (1 - weight) x the plain task loss and its gradient is that of the task loss scaled by
    (1 - weight); the hard term is the student's CE against its own top class."""
    labels = torch.tensor([0, 1, 2, 3])
    student = STUDENT.clone().requires_grad_(True)
    plain = F.cross_entropy(student, labels, label_smoothing=0.1)
    (g_plain,) = torch.autograd.grad(plain, student)
    for temp in (1.0, 3.0):
        task = _task(teacher="timm:x", weight=0.25, temperature=temp)
        loss, _ = task.loss((None, labels, labels, student.detach().clone()), student)
        assert soft_loss(student, student.detach(), temp).item() == pytest.approx(0, abs=1e-6)
        assert loss.item() == pytest.approx(0.75 * plain.item(), rel=1e-6)
        (g,) = torch.autograd.grad(loss, student)
        assert torch.allclose(g, 0.75 * g_plain, atol=1e-6)


def test_forward_graphs_bookkeeping_on_the_rerun_backend():
    from vitgraph.graphs.backend import RerunBackend
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5)).eval()
    backend = RerunBackend()
    calls = []

    def fn(x):
        calls.append(tuple(x.shape))
        return net(x)

    graphs = ForwardGraphs(fn, backend, warmup=2)
    a, b = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    out_a = graphs(a)
    assert (backend.captures, backend.replays) == (1, 0)
    assert len(calls) == 3  # two warm-up runs, the capture
    assert torch.equal(out_a, net(a))
    out_b = graphs(b)
    assert (backend.captures, backend.replays) == (1, 1)
    assert torch.equal(out_b, net(b))
    assert torch.equal(out_a, net(a))  # a copy: the next replay does not overwrite it
    c = torch.randn(2, 3, 2, 2)  # another shape: its own graph
    assert torch.equal(graphs(c), net(c))
    assert backend.captures == 2 and len(graphs.graphs) == 2
    teacher = Teacher(net, 5, torch.float32, None, "t", graphs=RerunBackend())
    assert torch.equal(teacher(a), net(a)) and not any(p.requires_grad for p in net.parameters())


def _fake_dist(**kw):
    d = dict(tp=1, pp=1, vpp=1, tp_rank=0, pp_rank=0, is_last_stage=True, cuda=False,
             device=torch.device("cpu"))
    d.update(kw)
    return SimpleNamespace(**d)


def test_timm_teacher_matches_the_run_and_bad_names_are_config_errors():
    cfg = load_config(TINY, ["train.distill.teacher=timm:test_vit"])
    plan = SimpleNamespace(arch=SimpleNamespace(image_size=32))
    t = build_teacher(cfg.train.distill, plan, _fake_dist(), 10)
    assert t.graphs is None and t.dtype == torch.float32  # CPU: eager, fp32
    out = t(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and out.dtype == torch.float32
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(0)
    eager = build_teacher(cfg.train.distill, plan, _fake_dist(), 10)
    torch.manual_seed(0)  # the same random weights
    graphed = build_teacher(cfg.train.distill, plan, _fake_dist(), 10, graphs=True)  # the rerun backend here
    assert graphed.graphs.backend.name == "rerun"
    assert torch.allclose(graphed(x), eager(x), atol=1e-6)
    assert torch.allclose(graphed(x), eager(x), atol=1e-6)
    assert graphed.graphs.backend.replays == 1
    assert build_teacher(cfg.train.distill, plan, _fake_dist(is_last_stage=False, pp=2, pp_rank=0), 10) is None
    cfg = load_config(TINY, ["train.distill.teacher=timm:no_such_model_xyz"])
    with pytest.raises(ConfigError, match="train.distill.teacher.*no_such_model_xyz"):
        build_teacher(cfg.train.distill, plan, _fake_dist(), 10)


def test_bad_teacher_values_are_config_errors(tmp_path):
    def bad(match, *over):
        with pytest.raises(ConfigError, match=match):
            load_config(TINY, list(over))

    bad(r"train\.distill\.teacher=.*no such run directory",
        f"train.distill.teacher={tmp_path / 'nothing'}")
    bad(r"train\.distill\.teacher=.*without config\.yaml", f"train.distill.teacher={tmp_path}")
    bad(r"train\.distill\.teacher", "train.distill.teacher=timm:")  # YAML reads a mapping
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    bad(r"train\.distill\.model=None.*needs its architecture", f"train.distill.teacher={weights}")
    bad(r"train\.distill\.model=.*weights-file teacher only", "train.distill.model=vit_b16_224")
    with pytest.raises(ConfigError, match=r"train\.distill\.teacher=.*classification"):
        load_config(ROOT / "configs" / "clip-tiny-shapes.yaml",
                    ["train.distill.teacher=timm:test_vit"])
    with pytest.raises(ConfigError, match=r"train\.distill\.teacher=.*native"):
        load_config(ROOT / "configs" / "vit-tiny-shapes-native.yaml",
                    ["train.distill.teacher=timm:test_vit"])
    with pytest.raises(ConfigError, match=r"train\.distill\.kind"):
        load_config(TINY, ["train.distill.kind=medium"])


RUN = ["train.log_every=1", "train.eval_every=0", "train.tensorboard=false",
       "train.progress=false", "data.num_train=64", "data.num_val=32",
       "train.global_batch_size=16", "train.micro_batch_size=8"]


def _train(run_dir, steps, *extra):
    from vitgraph.train.loop import train
    cfg = load_config(TINY, [*RUN, f"train.steps={steps}", f"run.dir={run_dir}", *extra])
    return train(cfg)


def _log(run_dir):
    return (Path(run_dir) / "train.log").read_text()


def _losses(run_dir):
    lines = (Path(run_dir) / "log.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


# the student's distillation settings in the pp=2 comparison
PP_STUDENT = ["train.distill.kind=hard", "data.augment.enabled=true", "model.spec=torch"]


def launch_jobs(root: Path) -> dict[int, list]:
    """This module's runs (conftest.launched): in one process a vitgraph run of 5 steps, the
    teacher of the module's runs (its newest checkpoint), and a 2-step student of it; the
    same student at pp=2."""
    def job(name, steps, *extra):
        return name, {"args": [str(TINY), *RUN, f"train.steps={steps}", f"run.dir={root / name}",
                               *extra]}
    student = [f"train.distill.teacher={root / 'teacher'}", *PP_STUDENT]
    return {1: [job("teacher", 5), job("one", 2, *student)],
            2: [job("pp2", 2, "parallel.pp=2", *student)]}


@pytest.fixture(scope="module")
def teacher_run(launched):
    return launched[__name__]["teacher"][0]


def test_short_runs_from_a_timm_teacher_and_from_a_vitgraph_run(tmp_path, teacher_run):
    # a timm teacher (random init), mixup / cutmix on
    m = _train(tmp_path / "timm", 3, "train.distill.teacher=timm:test_vit",
               "data.augment.enabled=true", "data.augment.preset=deit",
               "data.augment.mix_prob=1.0")
    losses = _losses(tmp_path / "timm")
    assert m["step"] == 3 and len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "distilling (soft, weight 0.5, T 1.0) from timm test_vit" in _log(tmp_path / "timm")

    # a vitgraph run as the teacher: distil from its newest checkpoint
    m = _train(tmp_path / "student", 3, f"train.distill.teacher={teacher_run}",
               "train.distill.kind=hard", "train.distill.weight=0.7",
               "data.augment.enabled=true")
    losses = _losses(tmp_path / "student")
    assert m["step"] == 3 and len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "step_000005 (step 5)" in _log(tmp_path / "student")
    # each logged record holds both terms, and the loss is their mix
    records = [r for r in map(json.loads, (tmp_path / "student" / "log.jsonl").read_text()
                              .splitlines()) if "loss" in r]
    assert records and m["loss_distill"] == records[-1]["loss_distill"]
    for r in records:
        assert r["loss"] == pytest.approx(0.3 * r["loss_task"] + 0.7 * r["loss_distill"], rel=1e-5)
    assert " | task " in _log(tmp_path / "student") and " | distill " in _log(tmp_path / "student")
    # without a teacher neither term is logged
    assert "loss_task" not in json.loads((teacher_run / "metrics.json").read_text())

    # weight 0: the same run as without a teacher (the teacher changes nothing else)
    _train(tmp_path / "plain", 2)
    _train(tmp_path / "w0", 2, f"train.distill.teacher={teacher_run}", "train.distill.weight=0")
    assert len(_losses(tmp_path / "plain")) == 2
    assert _losses(tmp_path / "w0") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-6)


def test_a_vitgraph_teacher_is_the_runs_model_and_checks_its_classes(tmp_path, teacher_run):
    """The teacher built from a run directory computes what that run's model computes: as the
    student, initialised from the same checkpoint, its soft term is 0 and the loss
    (1 - weight) x the task loss. Another class count is a ConfigError."""
    from vitgraph.convert import load_into_model, read_checkpoint_weights
    from vitgraph.parallel.setup import init_distributed, shutdown
    from vitgraph.plan import resolve
    from vitgraph.tasks.classification import ClassificationTask
    from vitgraph.convert.checkpoints import checkpoint_dir
    cfg = load_config(TINY, [*RUN, "train.steps=1", f"run.dir={tmp_path / 'student'}",
                             f"train.distill.teacher={teacher_run}",
                             "train.distill.weight=0.4", "train.distill.temperature=2"])
    plan = resolve(cfg, 1)
    d = init_distributed(plan)
    try:
        teacher = build_teacher(cfg.train.distill, plan, d, 10)
        task = ClassificationTask(plan, d)
        task.num_classes = 10
        (student,) = task.build_model()
        sd, step = read_checkpoint_weights(checkpoint_dir(teacher_run))
        assert step == 5
        load_into_model(student, sd)
        student.eval()
        torch.manual_seed(1)
        x = torch.randn(6, 3, 32, 32)
        labels = torch.randint(0, 10, (6,))
        with torch.no_grad():
            out, t_out = student(x), teacher(x)
        assert torch.allclose(out, t_out, atol=1e-5)
        assert out.std() > 0  # a trained head, not the zero init
        task.pack = None
        loss, _ = task.loss((x, labels, labels, t_out), out)
        ce = F.cross_entropy(out, labels, label_smoothing=cfg.train.label_smoothing)
        assert loss.item() == pytest.approx(0.6 * ce.item(), rel=1e-5)
        with pytest.raises(ConfigError, match=r"train\.distill\.teacher=.*10 classes, the run 7"):
            build_teacher(cfg.train.distill, plan, d, 7)

        # the same weights as a file in timm's naming, the architecture named by
        # train.distill.model: format detected as for model.init_from, the same teacher
        from vitgraph.convert import from_vitgraph, save_safetensors
        path = save_safetensors(from_vitgraph(sd, "timm", 4), tmp_path / "teacher.safetensors")
        fcfg = load_config(TINY, [f"train.distill.teacher={path}",
                                  "train.distill.model=vit_pico_patch4_32"])
        with torch.no_grad():
            assert torch.allclose(build_teacher(fcfg.train.distill, plan, d, 10)(x), t_out, atol=1e-5)
        with pytest.raises(ConfigError, match=r"train\.distill\.teacher=.*no head of the run's 7"):
            build_teacher(fcfg.train.distill, plan, d, 7)
    finally:
        shutdown()
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.multiproc
def test_a_pipeline_parallel_student_distils_as_one_process(launched):
    """pp=2: the last stage prepares the (augmented) images itself and runs the teacher there,
    built whole (its layers for single-rank groups): the losses and gradient norms of one
    process. (tp=2 goes through the same group swap; run by hand it logs the same numbers.)"""
    runs = launched[__name__]

    def records(name):
        return [x for r in loss_records(*runs[name]) for x in (r["loss"], r["grad_norm"])]

    assert len(records("one")) == 4  # loss and gradient norm of steps 1, 2
    assert records("pp2") == pytest.approx(records("one"), rel=1e-5)
