"""The teacher's cached top-k (`distill.teacher_topk`), bfloat16 students (`distill.precision`) and the budget curve
(`distill.curve_tokens`): the cache round-trips and is keyed by content, a run that reads it trains exactly as the
run that wrote it, the teacher pass stops early, and the curve lands in results.json, results.md and curve.png."""

from __future__ import annotations

import json

import pytest
import torch
from test_distillation import _args, _dense_logits

from ghostdistill.cli import main
from ghostdistill.distill.teacher_cache import TeacherCache, topk_entry


def _store(cache: TeacherCache, ids, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, 8, generator=g))
    hidden = torch.randn(*ids.shape, 8, generator=g)
    return cache.store(ids, torch.ones_like(ids), hidden, head, chunk_tokens=3), head, hidden


@pytest.mark.parametrize("vocab", [50, 40_000, 70_000], ids=["small", "ids_over_int16", "ids_in_32_bits"])
def test_teacher_cache_round_trips_by_window_content(vocab, tmp_path):
    cache = TeacherCache({"model": "m"}, 4, 1.0, vocab, folder=tmp_path / "c")
    ids = torch.randint(0, vocab, (2, 6))
    stored, head, hidden = _store(cache, ids, vocab)
    got = cache.lookup(ids, torch.ones_like(ids))
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, stored))
    # What was stored is the top-k of the head's logits, log-probabilities rounded to 16 bits.
    logp, index, tail = topk_entry(head(hidden[0, :-1]), 4, 1.0)
    assert torch.equal(stored[1][0], index) and torch.equal(stored[0][0], logp.half().float())
    torch.testing.assert_close(stored[2][0], tail)
    # Another window (one token changed) is not in the cache; nor is a batch holding it.
    other = ids.clone()
    other[1, 3] = (other[1, 3] + 1) % vocab
    assert cache.lookup(other, torch.ones_like(other)) is None
    assert cache.hits == 1 and cache.misses == 1


def test_teacher_cache_is_keyed_by_model_k_and_temperature_and_ignores_a_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTDISTILL_CACHE", str(tmp_path))
    base = TeacherCache({"model": "m"}, 4, 1.0, 50)
    others = [TeacherCache({"model": "n"}, 4, 1.0, 50), TeacherCache({"model": "m"}, 8, 1.0, 50)]
    others.append(TeacherCache({"model": "m"}, 4, 2.0, 50))
    assert base.folder.parent == tmp_path / "teacher_topk"
    assert len({base.folder, *(c.folder for c in others)}) == 4
    ids = torch.randint(0, 50, (1, 5))
    _store(base, ids, 50)
    assert base.lookup(ids, torch.ones_like(ids)) is not None
    assert all(c.lookup(ids, torch.ones_like(ids)) is None for c in others)
    (path,) = base.folder.rglob("*.pt")
    path.write_bytes(b"truncated")
    assert base.lookup(ids, torch.ones_like(ids)) is None  # computed again by the caller, then replaced


def _cached_args(tiny_dir, text_files, run, *extra, steps=3):
    train = json.dumps({"source": str(text_files["jsonl_gz"]), "first_document": 150})
    return _args(
        tiny_dir,
        text_files,
        run,
        "--model.distill.teacher_topk",
        "16",
        "--data.train.source",
        train,
        "--data.train.num_samples",
        "8",
        "--data.train.seq_len",
        "32",
        *extra,
        steps=steps,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_teacher_cache_a_run_reading_it_trains_as_the_run_that_wrote_it(
    precision, tiny_dir, text_files, tmp_path, monkeypatch
):
    monkeypatch.setenv("GHOSTDISTILL_CACHE", str(tmp_path / "cache"))
    extra = ["--model.distill.precision", precision]
    first = main(_cached_args(tiny_dir, text_files, tmp_path / "a", *extra)).model.run
    files = list((tmp_path / "cache" / "teacher_topk").rglob("*.pt"))
    assert len(files) == 8  # every training window once (3 steps × 4 windows cycle through the 8)
    # Every step after the first epoch read the cache: the teacher ran for the first two batches only.
    assert (first.students.cache.misses, first.students.cache.hits) == (2, 1)
    # A second run (another folder, same model and text) never runs the teacher for its logits, and its
    # students end bit for bit where the first run's did.
    second = main(_cached_args(tiny_dir, text_files, tmp_path / "b", *extra)).model.run
    assert (second.students.cache.misses, second.students.cache.hits) == (0, 3)
    for view in ("ghost_ft", "linearpatch_ft"):
        a, b = first.students.trainable_state(view), second.students.trainable_state(view)
        assert all(torch.equal(a[k], b[k]) for k in a), view
    a = json.loads((tmp_path / "a" / "results.json").read_text())["distill"]["history"]
    assert a == json.loads((tmp_path / "b" / "results.json").read_text())["distill"]["history"]


def test_teacher_cache_the_teacher_pass_stops_at_the_shared_prefix(tiny_dir, text_files, tmp_path, monkeypatch):
    """With every window cached, the teacher runs only the blocks before the students' first gap (the shared
    prefix): its last block never runs during the steps."""
    monkeypatch.setenv("GHOSTDISTILL_CACHE", str(tmp_path / "cache"))
    main(_cached_args(tiny_dir, text_files, tmp_path / "a", steps=2))
    from ghostdistill.distill.students import Students

    seen = {"last": 0}
    original = Students.teacher

    def counting(self, batch, logits=True):
        last = self.pruned.dense_layers[-1]
        handle = last.register_forward_pre_hook(lambda *a: seen.__setitem__("last", seen["last"] + 1))
        try:
            return original(self, batch, logits)
        finally:
            handle.remove()

    monkeypatch.setattr(Students, "teacher", counting)
    run = main(_cached_args(tiny_dir, text_files, tmp_path / "b", steps=2)).model.run
    assert run.students.share_prefix and run.students.cache.misses == 0
    # check_prefix runs the full teacher once, before the steps; the two steps run none of it.
    assert seen["last"] == 1


def test_bf16_students_train_in_float32_state_and_the_teacher_stays_exact(tiny_dir, text_files, tmp_path):
    cli = main(_args(tiny_dir, text_files, tmp_path / "run", "--model.distill.precision", "bf16", steps=3))
    run = cli.model.run
    assert run.students.bf16
    ids, reference = _dense_logits(tiny_dir)
    with torch.no_grad(), run.pruned.use("dense") as model:
        assert torch.equal(model(input_ids=ids).logits, reference)
    params = [p for v in run.students.views for p in run.students.params[v].all()]
    assert params and all(p.dtype == torch.float32 for p in params)
    state = cli.trainer.optimizers[0].state
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    history = json.loads((tmp_path / "run" / "results.json").read_text())["distill"]["history"]
    # On the calibration windows (this run's training windows) ghost's closed form is already least-squares
    # optimal and only overfits (tests/distill/test_distillation.py); LinearPatch's is not, and learns.
    assert history[-1]["linearpatch_ft"]["kl"] < history[0]["linearpatch_ft"]["kl"]


def test_budget_curve_from_one_run_and_kept_across_a_resume(tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    # 4 windows of 32 tokens a step: 128 tokens per student per step.
    main(_args(tiny_dir, text_files, run, "--model.distill.curve_tokens", "[100, 256, 384]", steps=2))
    first = json.loads((run / "results.json").read_text())["distill"]["curve"]
    assert [(p["tokens"], p["step"], p["budgets"]) for p in first] == [(128, 1, [100]), (256, 2, [256])]
    assert {"ghost_ft", "linearpatch_ft"} <= set(first[0]) and first[0]["source"] == "held_out"
    assert (run / "curve.png").stat().st_size > 0
    assert "Budget curve" in (run / "results.md").read_text()
    cli = main(
        _args(
            # The run continued from its checkpoint with more steps (--ckpt_path: its own folder, on purpose).
            *(tiny_dir, text_files, run, "--model.distill.curve_tokens", "[100, 256, 384]", "--ckpt_path", "last"),
            steps=3,
        )
    )
    curve = json.loads((run / "results.json").read_text())["distill"]["curve"]
    assert [(p["tokens"], p["step"]) for p in curve] == [(128, 1), (256, 2), (384, 3)]
    assert curve[:2] == first
    assert cli.model.run.tracker.curve == curve


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("teacher_topk", "0", "teacher_topk must be >= 1"),
        ("precision", "bf8", "precision"),
        ("curve_tokens", "[300, 100]", "curve_tokens"),
    ],
)
def test_bad_budget_settings_are_named(key, value, match, tiny_dir, text_files, tmp_path, capsys):
    with pytest.raises((ValueError, SystemExit)) as err:
        main(_args(tiny_dir, text_files, tmp_path / "run", f"--model.distill.{key}", value))
    assert match in str(err.value) + capsys.readouterr().err
    assert not (tmp_path / "run" / "calibration_state.pt").exists()  # refused before any work


@pytest.mark.parametrize(
    ("hardware", "aten", "onednn", "native"),
    [
        (True, "AVX512", None, True),
        (True, "AVX512", "avx512_core_amx", True),
        (True, "AVX2", None, False),  # ATEN_CPU_CAPABILITY=avx2: emulated, 8-9x slower (docs/benchmarks.md)
        (True, "AVX512", "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2 likewise
        (True, "AVX512", "AVX512_CORE", False),  # AVX-512 without its bfloat16 kernels
        (False, "AVX512", None, False),  # an AVX-512 CPU without BF16 or AMX
    ],
)
def test_auto_precision_takes_bf16_only_where_the_cpu_and_its_libraries_compute_it(
    hardware, aten, onednn, native, monkeypatch
):
    from ghostdistill.distill.students import native_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)
    if onednn is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    assert native_bf16(torch.device("cpu")) is native
    assert native_bf16(torch.device("meta")) is False
