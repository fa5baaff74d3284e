"""Chat sources (`data.chat`, `data.answers`) on a tiny model with a tiny chat template: rendering and the
assistant mask, the records' formats and errors, packing, the dense model's answers, and the default chat score."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import tiny_model

from ghostdistill.data import ChatSettings, TextSource, validate_source
from ghostdistill.data.answers import generated_chat_windows, score_windows, stop_tokens
from ghostdistill.data.chat import (
    CALIBRATION_PROMPTS,
    HELDOUT_PROMPTS,
    check_chat_template,
    conversations,
    encode,
    encode_prompt,
    given_windows,
    pack,
    parse_messages,
)
from ghostdistill.data.config import CalibrationData, section_settings
from ghostdistill.data.run_chat import evaluation_sources, statistics_masks

# A ChatML-like template in the tiny tokenizer's own special tokens.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "the model"},
    {"role": "user", "content": "the data run"},
    {"role": "assistant", "content": "a dense layer"},
    {"role": "user", "content": "the loss"},
    {"role": "assistant", "content": "ghost operator"},
]


@pytest.fixture
def chat_tokenizer(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def write_jsonl(path, records):
    with gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_rendering_marks_exactly_the_assistant_turns(chat_tokenizer):
    ids, answers = encode(chat_tokenizer, CONVERSATION)
    assert ids == chat_tokenizer(chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)).input_ids
    marked = chat_tokenizer.decode([i for i, a in zip(ids, answers) if a])
    # Each answer is what the template adds beyond the generation prompt: its text and end-of-turn.
    assert marked == "a dense layer</s>\nghost operator</s>\n"
    unmarked = chat_tokenizer.decode([i for i, a in zip(ids, answers) if not a])
    assert "the data run" in unmarked and "dense" not in unmarked
    prompt = encode_prompt(chat_tokenizer, CONVERSATION[:2])
    assert ids[: len(prompt)] == prompt and not any(answers[: len(prompt)])


def test_sharegpt_messages_read_alike_and_bad_records_are_named(tmp_path):
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert parse_messages(share, "conversations", "x") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    good = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [good, "{not json", good])
    with pytest.raises(ValueError, match=r"c\.jsonl: line 2 is not valid JSON"):
        conversations(TextSource(str(path), chat=ChatSettings()), for_eval=False)
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"text": "plain"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: no conversation under 'messages' \(found \['text'\]\)"):
        conversations(TextSource(str(path), chat=ChatSettings()), for_eval=False)
    path = write_jsonl(tmp_path / "e.jsonl.gz", [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"e\.jsonl\.gz:1: message 0 .* needs a role"):
        conversations(TextSource(str(path), chat=ChatSettings()), for_eval=False)
    path = write_jsonl(tmp_path / "f.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"f\.jsonl:1: no user message"):
        conversations(TextSource(str(path), chat=ChatSettings()), for_eval=True)


def test_bad_chat_settings_fail_in_one_line_before_any_work(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="has no chat template"):
        check_chat_template(tiny_tokenizer, "data.calibration.source")
    with pytest.raises(ValueError, match=r"chat\.tokens 'answer': choose one of all, answers"):
        validate_source(TextSource("generate", chat=ChatSettings(tokens="answer")), "data.calibration.source")
    with pytest.raises(ValueError, match="calibration settings"):
        validate_source(TextSource("generate", chat=ChatSettings(tokens="answers")), "e", for_eval=True)
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ValueError, match=r"must end in \.jsonl, \.json, \.parquet"):
        validate_source(TextSource(str(tmp_path / "c.txt"), chat=ChatSettings()))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        validate_source(TextSource(str(tmp_path / "missing.jsonl"), chat=ChatSettings()))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        validate_source(TextSource("generate", chat=ChatSettings(instructions=str(tmp_path / "nope.jsonl"))))


def test_hub_conversations_are_read_by_load_dataset(tmp_path, monkeypatch):
    """A dataset folder is read for real by `datasets.load_dataset` (offline); a hub id asks it for the subset
    and split (the call recorded, not made)."""
    folder = tmp_path / "my_chats"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)])
    got = conversations(TextSource(str(folder), chat=ChatSettings(), max_documents=2), for_eval=False)
    assert got == [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]]
    import datasets

    calls = []
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or [row])
    src = TextSource("Open-Orca/SlimOrca", chat=ChatSettings(messages_field="conversations", subset="default"))
    assert conversations(src, for_eval=False)[0][1] == {"role": "assistant", "content": "yo"}
    assert calls == [(("Open-Orca/SlimOrca", "default"), {"split": "train"})]


def test_packing_starts_every_window_at_a_conversation_and_cuts_the_last():
    items = [([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7], [0, 0, 1, 1]), ([8, 9], [0, 1]), ([10, 11, 12], [0, 0, 1])]
    ids, mask = pack(iter(items), seq_len=5, num_samples=2, label="toy")
    assert ids.tolist() == [[1, 2, 3, 4, 5], [8, 9, 10, 11, 12]]  # 6, 7 cut: the next window starts with 8
    assert mask.tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 1]]
    with pytest.raises(ValueError, match="fill only 2 windows of 5 tokens, 3 requested"):
        pack(iter(items), seq_len=5, num_samples=3, label="toy")
    counted = statistics_masks(TextSource("generate", chat=ChatSettings(tokens="answers")), mask)
    assert counted.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 1]]  # answers, and each window's first position


def test_given_windows_are_seeded_and_mark_the_answers(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION} for _ in range(40)])
    src = TextSource(str(path), chat=ChatSettings())
    ids, answers = given_windows(chat_tokenizer, src, 24, 4, seed=0)
    assert ids.shape == answers.shape == (4, 24)
    again = given_windows(chat_tokenizer, src, 24, 4, seed=0)
    assert torch.equal(ids, again[0]) and torch.equal(answers, again[1])
    one, marks = encode(chat_tokenizer, CONVERSATION)
    assert ids[0].tolist() == one[:24] and answers[0].tolist() == marks[:24]


def test_the_dense_answers_calibrate_deterministically(chat_tokenizer, tmp_path):
    model = tiny_model("llama", num_layers=4)
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"the run {i}"}]} for i in range(3)]
    )
    src = TextSource("generate", chat=ChatSettings(instructions=str(prompts), max_new_tokens=6, temperature=1.0))
    a = generated_chat_windows(model, chat_tokenizer, src, 32, 5, seed=0, progress=False)
    b = generated_chat_windows(model, chat_tokenizer, src, 32, 5, seed=0, progress=False)
    c = generated_chat_windows(model, chat_tokenizer, src, 32, 5, seed=1, progress=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    # Every window starts with an instruction's prompt (where a conversation starts), and answers are marked.
    starts = {tuple(encode_prompt(chat_tokenizer, [{"role": "user", "content": f"the run {i}"}])[:3]) for i in range(3)}
    assert all(tuple(row[:3]) in starts for row in a[0].tolist())
    assert a[1].sum() > 0 and not a[1][:, :3].any()
    greedy = TextSource("generate", chat=ChatSettings(instructions=str(prompts), max_new_tokens=6))  # greedy
    with pytest.raises(ValueError, match="fill only"):  # greedy answers of 3 instructions cannot fill 5 windows
        generated_chat_windows(model, chat_tokenizer, greedy, 32, 5, seed=0, progress=False)


@torch.no_grad()
def test_score_answers_are_the_dense_models_own_greedy_tokens(chat_tokenizer):
    model = tiny_model("llama", num_layers=4)
    src = TextSource("generate", name="chat", chat=ChatSettings(max_new_tokens=8), max_documents=5)
    windows = score_windows(model, chat_tokenizer, src, progress=False)
    assert len(windows) == 5 and windows.answers.sum() > 0
    logits = model(input_ids=windows.input_ids, attention_mask=windows.attention_mask).logits[:, :-1]
    scored = windows.answers[:, 1:].bool()
    # On every scored token the dense argmax is the answer's token (the answer is cut where it would not be).
    assert torch.equal(logits.argmax(-1)[scored], windows.input_ids[:, 1:][scored])
    assert (windows.answers.sum(1) <= 8).all()
    stop = stop_tokens(model, chat_tokenizer)
    for row, answers in zip(windows.input_ids, windows.answers):  # an answer ends at its stop token or N
        tokens = row[answers.bool()].tolist()
        assert not any(t in stop for t in tokens[:-1])
    again = score_windows(model, chat_tokenizer, src, progress=False)
    assert torch.equal(again.input_ids, windows.input_ids) and torch.equal(again.answers, windows.answers)


def test_the_chat_score_is_on_by_default_only_with_a_chat_template(chat_tokenizer, tiny_tokenizer):
    wiki = [TextSource("wikitext2")]
    assert [s.label for s in evaluation_sources(wiki, None, chat_tokenizer)] == ["wikitext2", "chat"]
    assert [s.label for s in evaluation_sources(wiki, None, tiny_tokenizer)] == ["wikitext2"]
    assert [s.label for s in evaluation_sources(wiki, False, chat_tokenizer)] == ["wikitext2"]
    with pytest.raises(ValueError, match="has no chat template"):
        evaluation_sources(wiki, True, tiny_tokenizer)
    mine = [TextSource("generate", name="mine", chat=ChatSettings())]
    assert evaluation_sources(mine, None, chat_tokenizer) == mine  # a configured chat source replaces it
    with pytest.raises(ValueError, match="already has that name"):
        evaluation_sources([TextSource("wikitext2", name="chat")], True, chat_tokenizer)


def test_text_sources_keep_their_fingerprints_and_the_shipped_prompts_are_disjoint():
    settings = section_settings(CalibrationData())
    assert "chat" not in settings["source"] and "records" not in settings["source"]
    calibration = {m[-1]["content"] for m in conversations(TextSource("generate", chat=ChatSettings()), for_eval=False)}
    heldout = {m[-1]["content"] for m in conversations(TextSource("generate", chat=ChatSettings()), for_eval=True)}
    assert CALIBRATION_PROMPTS.is_file() and HELDOUT_PROMPTS.is_file()
    assert len(calibration) == 846 and len(heldout) == 48 and not calibration & heldout


class _Interrupted(KeyboardInterrupt):
    """What Ctrl-C raises, here from inside an answer batch."""


def _count_calls(monkeypatch, module, name: str, real, interrupt_after: int | None = None) -> list:
    """`module.name` replaced by `real` counted (the list returned), raising `_Interrupted` at the call after
    `interrupt_after` ones."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(1)
        if interrupt_after is not None and len(calls) > interrupt_after:
            raise _Interrupted
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _run_data(run_dir, tokenizer, model, calibration: TextSource, evaluation: list[TextSource], seq_len: int):
    from contextlib import nullcontext

    from ghostdistill.data.config import DataConfig, EvaluationData
    from ghostdistill.data.run import RunData

    cfg = DataConfig(
        calibration=CalibrationData(calibration, num_samples=5, seq_len=seq_len, seed=0),
        evaluation=EvaluationData(sources=evaluation, chat=False),
        batch_size=2,
    )
    return RunData(cfg, tokenizer, run_dir, dense=lambda: nullcontext(model), model_key={"m": 1}, progress=False)


@pytest.mark.parametrize("what", ["calibration", "score"])
def test_interrupted_dense_answers_resume_and_equal_an_uninterrupted_run(what, chat_tokenizer, tmp_path, monkeypatch):
    """Issue 53: the dense model's answers (sampled chat calibration; the chat score) were kept only at the end, so
    Ctrl-C lost them. Kept batch by batch, a rerun answers only the batches not yet answered (the sampler's state
    restored) and ends with the uninterrupted run's windows, to the bit; the partial file goes once they are kept."""
    from ghostdistill.data import answers as answers_module

    model, real = tiny_model("llama", num_layers=4), answers_module.answer
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"the run {i}"}]} for i in range(40)]
    )
    # 40 instructions: batches of 16, 16 and 8, and (sampled calibration) a second round of them.
    cal = TextSource("generate", chat=ChatSettings(instructions=str(prompts), max_new_tokens=6, temperature=1.0))
    score = TextSource("generate", name="chat", chat=ChatSettings(max_new_tokens=6), max_documents=40)

    def windows(run_dir):
        data = _run_data(run_dir, chat_tokenizer, model, cal, [score], seq_len=192)
        if what == "calibration":
            return data.calibration_ids(), data._answers
        out = data.eval_windows(score)
        return out.input_ids, out.answers

    whole_calls = _count_calls(monkeypatch, answers_module, "answer", real)
    whole = windows(tmp_path / "whole")
    assert len(whole_calls) > 2, len(whole_calls)
    _count_calls(monkeypatch, answers_module, "answer", real, interrupt_after=2)
    with pytest.raises(_Interrupted):
        windows(tmp_path / "cut")
    kept = "generated_calibration_" if what == "calibration" else "chat_answers_"
    assert [p.name.startswith(kept) for p in (tmp_path / "cut").glob("*")] == [True], list((tmp_path / "cut").glob("*"))
    resumed_calls = _count_calls(monkeypatch, answers_module, "answer", real)
    resumed = windows(tmp_path / "cut")
    assert torch.equal(resumed[0], whole[0]) and torch.equal(resumed[1], whole[1])
    assert len(resumed_calls) == len(whole_calls) - 2  # the two batches kept were not answered again
    assert sorted(p.name for p in (tmp_path / "cut").glob("*")) == sorted(
        p.name for p in (tmp_path / "whole").glob("*")
    )
    assert not list((tmp_path / "cut").glob("*.partial.pt"))
